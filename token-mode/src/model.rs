//! The model's chat template and tokenizer, loaded once from `--tokenizer PATH`.

use std::borrow::Cow;
use std::path::Path;

use tokentap_chat_template::{ChatTemplates, RenderOptions, Tokenizer};
use tokentap_schema::{ChatMessage, ChatRequest, ContentPart, RawJson, Role};

/// `--token-mode`: what tokentap does with its own prompt ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TokenMode {
    /// Nothing: the engine renders, tokentap records what it saw.
    #[default]
    Off,
    /// Calls go to the engine as today; tokentap also renders and tokenizes each one and
    /// records how its ids compare ([`crate::Observer`]).
    Observe,
    /// Token in, token out: tokentap builds each prompt's ids from the conversation's earlier
    /// ids and sends the engine ids; it reads the answer back itself ([`crate::Tito`]).
    Tito,
}

impl std::str::FromStr for TokenMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(TokenMode::Off),
            "observe" => Ok(TokenMode::Observe),
            "tito" => Ok(TokenMode::Tito),
            other => Err(format!(
                "unknown token mode {other:?}: give `off`, `observe` or `tito`"
            )),
        }
    }
}

/// Which engine's way of handing a request to the chat template to follow: the engines
/// differ before the template runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineDialect {
    /// transformers' `apply_chat_template` on the request's dicts, as vLLM and SGLang call
    /// it (text parts joined for string-only templates, as vLLM's string content format).
    #[default]
    Transformers,
    /// llama.cpp's server (`common_chat_msgs_parse_oaicompat` and its `…_to_json_oaicompat`):
    /// a `developer` message becomes `system`, every tool is written back as
    /// `{"type", "function": {"name", "description", "parameters"}}` (description `""` and
    /// parameters `{}` when absent, `strict` and other fields dropped), text parts joined.
    LlamaCpp,
}

/// A model's tokenizer and chat template, ready to turn a canonical request into the ids an
/// engine would see (`apply_chat_template(add_generation_prompt=True)` then encode without
/// added special tokens).
pub struct TokenModel {
    tokenizer: Tokenizer,
    options: RenderOptions,
    source: String,
    /// The template renders text only when content is a list of parts: the engines then
    /// pass parts as they are; otherwise they join a message's text parts into one string.
    requires_typed_content: bool,
    dialect: EngineDialect,
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
    pub fn open(path: &Path, dialect: EngineDialect) -> Result<TokenModel, String> {
        let tokenizer = Tokenizer::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        TokenModel::new(tokenizer, path.display().to_string(), dialect)
    }

    /// A tokenizer already loaded; `source` names it in messages.
    pub fn new(
        tokenizer: Tokenizer,
        source: String,
        dialect: EngineDialect,
    ) -> Result<TokenModel, String> {
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
        let mut model = TokenModel {
            tokenizer,
            options,
            source,
            requires_typed_content: false,
            dialect,
        };
        model.requires_typed_content = model.probe_requires_typed_content();
        Ok(model)
    }

    /// As llama.cpp (minja's template capabilities) and vLLM (`content_format` detection) ask
    /// a template: does it show a user message's text given as a string, and given as a list
    /// of text parts? Parts are kept only for a template that shows them and not the string.
    fn probe_requires_typed_content(&self) -> bool {
        const NEEDLE: &str = "<tokentap content probe>";
        let shows = |content: Vec<ContentPart>, was_string: bool| {
            let request = ChatRequest {
                model: String::new(),
                messages: vec![ChatMessage {
                    content,
                    content_was_string: was_string,
                    ..ChatMessage::text(Role::User, "")
                }],
                tools: Vec::new(),
                tool_choice: None,
                sampling: Default::default(),
                stream: false,
                extra: Default::default(),
            };
            self.templates()
                .render(&request, &self.options)
                .is_ok_and(|t| t.contains(NEEDLE))
        };
        let text = || {
            vec![ContentPart::Text {
                text: NEEDLE.into(),
            }]
        };
        !shows(text(), true) && shows(text(), false)
    }

    /// `request` as the engine hands it to the template: unless the template requires typed
    /// content, each message's text parts joined with `\n` into one string (other parts
    /// dropped), as llama.cpp's `common_chat_msgs_to_json_oaicompat(concat_typed_text)` and
    /// vLLM's string content format do; and llama.cpp's own changes ([`EngineDialect`]).
    fn as_engine_renders<'r>(&self, request: &'r ChatRequest) -> Cow<'r, ChatRequest> {
        let has_parts = |m: &ChatMessage| !m.content_was_string && !m.content.is_empty();
        let join = !self.requires_typed_content && request.messages.iter().any(has_parts);
        let llama = self.dialect == EngineDialect::LlamaCpp
            && (request.messages.iter().any(|m| m.role == Role::Developer)
                || request.tools.iter().any(|t| {
                    t.description.is_none() || t.parameters.is_none() || t.strict.is_some()
                }));
        if !join && !llama {
            return Cow::Borrowed(request);
        }
        let mut out = request.clone();
        if join {
            for m in out.messages.iter_mut().filter(|m| has_parts(m)) {
                let text: Vec<&str> = m
                    .content
                    .iter()
                    .filter_map(|p| match p {
                        ContentPart::Text { text } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect();
                m.content = vec![ContentPart::Text {
                    text: text.join("\n"),
                }];
                m.content_was_string = true;
            }
        }
        if self.dialect == EngineDialect::LlamaCpp {
            for m in out
                .messages
                .iter_mut()
                .filter(|m| m.role == Role::Developer)
            {
                m.role = Role::System;
            }
            for t in &mut out.tools {
                t.description.get_or_insert_with(String::new);
                t.parameters
                    .get_or_insert_with(|| RawJson::from_value(&serde_json::json!({})));
                t.strict = None;
            }
        }
        Cow::Owned(out)
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
            .render(&self.as_engine_renders(request), &self.options)
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
