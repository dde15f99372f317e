//! The model's chat template and tokenizer, loaded once from `--tokenizer PATH`.

use std::path::Path;

use tokentap_chat_template::{ChatTemplates, RenderOptions, Tokenizer};
use tokentap_schema::ChatRequest;

/// `--token-mode`: what tokentap does with its own prompt ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenMode {
    /// Nothing: the engine renders, tokentap records what it saw.
    #[default]
    Off,
    /// Calls go to the engine as today; tokentap also renders and tokenizes each one and
    /// records how its ids compare ([`crate::Observer`]).
    Observe,
}

impl std::str::FromStr for TokenMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(TokenMode::Off),
            "observe" => Ok(TokenMode::Observe),
            other => Err(format!(
                "unknown token mode {other:?}: give `off` or `observe`"
            )),
        }
    }
}

/// A model's tokenizer and chat template, ready to turn a canonical request into the ids an
/// engine would see (`apply_chat_template(add_generation_prompt=True)` then encode without
/// added special tokens).
pub struct TokenModel {
    tokenizer: Tokenizer,
    options: RenderOptions,
    source: String,
}

impl std::fmt::Debug for TokenModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenModel")
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl TokenModel {
    /// `--tokenizer PATH`: a Hugging Face model directory, a `tokenizer.json` or a GGUF file.
    /// Refused when it carries no chat template, or one that does not compile.
    pub fn open(path: &Path) -> Result<TokenModel, String> {
        let tokenizer = Tokenizer::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        TokenModel::new(tokenizer, path.display().to_string())
    }

    /// A tokenizer already loaded; `source` names it in messages.
    pub fn new(tokenizer: Tokenizer, source: String) -> Result<TokenModel, String> {
        if tokenizer.chat_templates().is_none() {
            return Err(format!(
                "{source}: no chat template in the model's files (tokenizer_config.json's \
                 chat_template, chat_template.jinja, or the GGUF's tokenizer.chat_template)"
            ));
        }
        let options = RenderOptions {
            add_generation_prompt: true,
            kwargs: tokenizer.template_variables().clone(),
            ..Default::default()
        };
        Ok(TokenModel {
            tokenizer,
            options,
            source,
        })
    }

    /// Where the model was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn templates(&self) -> &ChatTemplates {
        self.tokenizer
            .chat_templates()
            .expect("checked in TokenModel::new")
    }

    /// The prompt text the template renders for `request`, with the generation prompt.
    pub fn prompt_text(&self, request: &ChatRequest) -> Result<String, String> {
        self.templates()
            .render(request, &self.options)
            .map_err(|e| e.to_string())
    }

    /// The prompt ids of `request`: rendered, then encoded without added BOS/EOS (the
    /// template writes them).
    pub fn prompt_ids(&self, request: &ChatRequest) -> Result<Vec<u32>, String> {
        let text = self.prompt_text(request)?;
        self.tokenizer.encode(&text).map_err(|e| e.to_string())
    }

    /// The text of `ids`, special tokens included (lossy where ids split a character).
    pub fn text(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids).unwrap_or_default()
    }

    /// The text of `ids` without special tokens (control tokens such as `<|im_end|>`).
    pub fn text_without_special(&self, ids: &[u32]) -> String {
        self.tokenizer.inner().decode(ids, true).unwrap_or_default()
    }
}
