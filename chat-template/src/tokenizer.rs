//! A model's tokenizer with its chat templates and special tokens, from a Hugging Face
//! directory (`tokenizer.json` + `tokenizer_config.json`) or a GGUF file.
//!
//! Encoding follows transformers: added tokens (special or not) written in the text are
//! matched whole, as one id each, before the rest is split and merged. [`Tokenizer::encode`]
//! adds no BOS/EOS, which is right after a chat template (templates write `bos_token`
//! themselves; adding it again would double it).

use std::path::Path;

use serde_json::{Map, Value as Json};

use crate::fast_bpe::FastBpe;
use crate::gguf::{GgufError, GgufVocabulary};
use crate::template::{ChatTemplates, TemplateError};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {message}")]
    Config { path: String, message: String },
    #[error("the tokenizer: {0}")]
    Tokenizers(String),
    #[error(transparent)]
    Template(#[from] TemplateError),
}

/// A tokenizer ready to encode rendered prompts; cheap to keep for a process's lifetime.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    templates: Option<ChatTemplates>,
    /// `bos_token`, `eos_token`, … as templates receive them.
    variables: Map<String, Json>,
    bos_id: Option<u32>,
    /// Whether the model's own encode adds BOS (for [`Tokenizer::encode_with_special_tokens`]
    /// on a GGUF; a tokenizer.json carries this in its post-processor).
    add_bos: bool,
    from_gguf: bool,
    /// The fast encoder, for a GGUF or a tokenizer.json whose pipeline it reproduces; others
    /// go through the `tokenizers` pipeline.
    fast: Option<FastBpe>,
    /// The tokenizer.json normalizes with NFC: the fast path serves only text that is
    /// already NFC (where normalizing changes nothing), the rest goes through the pipeline.
    nfc: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("variables", &self.variables)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.display().to_string(),
        source,
    })
}

impl Tokenizer {
    /// A Hugging Face model directory: `tokenizer.json`, and `tokenizer_config.json` for the
    /// chat template and special tokens when present (the template may instead be in
    /// `chat_template.jinja` or `chat_template.json`, as newer repositories store it).
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let tokenizer_json = dir.join("tokenizer.json");
        let config = dir.join("tokenizer_config.json");
        let mut t =
            Tokenizer::from_files(&tokenizer_json, config.exists().then_some(config.as_path()))?;
        if t.templates.is_none() {
            let jinja = dir.join("chat_template.jinja");
            let json = dir.join("chat_template.json");
            if jinja.exists() {
                t.templates = Some(ChatTemplates::single(&read(&jinja)?)?);
            } else if json.exists() {
                let v: Json =
                    serde_json::from_str(&read(&json)?).map_err(|e| TokenizerError::Config {
                        path: json.display().to_string(),
                        message: e.to_string(),
                    })?;
                if let Some(ct) = v.get("chat_template") {
                    t.templates = Some(ChatTemplates::from_config(ct)?);
                }
            }
        }
        Ok(t)
    }

    /// What `--tokenizer PATH` names: a Hugging Face model directory ([`Tokenizer::from_dir`]),
    /// a `tokenizer.json` (with the `tokenizer_config.json` beside it, when there is one), or
    /// a GGUF file (recognised by its magic, whatever its name).
    pub fn open(path: &Path) -> Result<Tokenizer, TokenizerError> {
        if path.is_dir() {
            return Tokenizer::from_dir(path);
        }
        let mut magic = [0u8; 4];
        let is_gguf = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map(|()| &magic == b"GGUF");
        match is_gguf {
            Ok(true) => Tokenizer::from_gguf(path),
            Ok(false) => {
                let config = path.with_file_name("tokenizer_config.json");
                Tokenizer::from_files(path, config.is_file().then_some(config.as_path()))
            }
            Err(source) => Err(TokenizerError::Io {
                path: path.display().to_string(),
                source,
            }),
        }
    }

    /// A `tokenizer.json`, and optionally its `tokenizer_config.json`.
    pub fn from_files(
        tokenizer_json: &Path,
        config: Option<&Path>,
    ) -> Result<Tokenizer, TokenizerError> {
        let text = read(tokenizer_json)?;
        let inner: tokenizers::Tokenizer = text.parse().map_err(|e| {
            TokenizerError::Tokenizers(format!("{}: {e}", tokenizer_json.display()))
        })?;
        let (fast, nfc) = match serde_json::from_str::<Json>(&text) {
            Ok(v) => fast_path_for(&v),
            Err(_) => (None, false),
        };
        let mut t = Tokenizer {
            inner,
            templates: None,
            variables: Map::new(),
            bos_id: None,
            add_bos: false,
            from_gguf: false,
            fast,
            nfc,
        };
        if let Some(config) = config {
            let path = config.display().to_string();
            let v: Json =
                serde_json::from_str(&read(config)?).map_err(|e| TokenizerError::Config {
                    path: path.clone(),
                    message: e.to_string(),
                })?;
            // transformers passes its special_tokens_map to the template: the named special
            // tokens that are set, each as its text (a config may write an AddedToken dict).
            for key in [
                "bos_token",
                "eos_token",
                "unk_token",
                "sep_token",
                "pad_token",
                "cls_token",
                "mask_token",
            ] {
                let text = match v.get(key) {
                    Some(Json::String(s)) => Some(s.clone()),
                    Some(Json::Object(o)) => {
                        o.get("content").and_then(Json::as_str).map(str::to_owned)
                    }
                    _ => None,
                };
                if let Some(text) = text {
                    t.variables.insert(key.into(), Json::String(text));
                }
            }
            if let Some(Json::Array(extra)) = v.get("additional_special_tokens") {
                t.variables.insert(
                    "additional_special_tokens".into(),
                    Json::Array(extra.clone()),
                );
            }
            if let Some(ct) = v.get("chat_template") {
                t.templates = Some(ChatTemplates::from_config(ct)?);
            }
            t.bos_id = t
                .variables
                .get("bos_token")
                .and_then(Json::as_str)
                .and_then(|b| t.inner.token_to_id(b));
        }
        Ok(t)
    }

    /// A GGUF model (or vocabulary-only) file: its vocabulary rebuilt as the equivalent
    /// byte-level BPE tokenizer with llama.cpp's pre-tokenizer for the file's `pre` type, its
    /// chat template(s), and `bos_token`/`eos_token` from its BOS/EOS ids.
    pub fn from_gguf(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let v = GgufVocabulary::read(path)?;
        Tokenizer::from_gguf_vocabulary(&v)
    }

    pub fn from_gguf_vocabulary(v: &GgufVocabulary) -> Result<Tokenizer, TokenizerError> {
        let json = v.tokenizer_json()?;
        let added: Vec<(String, u32)> = v
            .tokens
            .iter()
            .enumerate()
            .filter(|(id, _)| matches!(v.token_types.get(*id), Some(3 | 4)))
            .map(|(id, t)| (t.clone(), id as u32))
            .collect();
        let (patterns, _) = crate::gguf::pre_tokenizer(v.pre.as_deref().unwrap_or("default"))
            .expect("tokenizer_json() accepted the pre type");
        let fast = FastBpe::new(&added, &patterns).map_err(TokenizerError::Tokenizers)?;
        let inner: tokenizers::Tokenizer = serde_json::from_value(json)
            .map_err(|e| TokenizerError::Tokenizers(format!("the GGUF vocabulary: {e}")))?;
        let mut variables = Map::new();
        let token = |id: Option<u32>| id.and_then(|i| v.tokens.get(i as usize)).cloned();
        if let Some(b) = token(v.bos_token_id) {
            variables.insert("bos_token".into(), Json::String(b));
        }
        if let Some(e) = token(v.eos_token_id) {
            variables.insert("eos_token".into(), Json::String(e));
        }
        let templates = if v.chat_templates.is_empty() {
            None
        } else {
            let list: Vec<Json> = v
                .chat_templates
                .iter()
                .map(|(n, t)| serde_json::json!({"name": n, "template": t}))
                .collect();
            Some(ChatTemplates::from_config(&Json::Array(list))?)
        };
        // llama.cpp's default for the pre types that add BOS unless the file says otherwise.
        let default_bos = matches!(
            v.pre.as_deref(),
            Some("llama3" | "llama-v3" | "llama-bpe" | "falcon3")
        );
        Ok(Tokenizer {
            inner,
            templates,
            variables,
            bos_id: v.bos_token_id,
            add_bos: v.add_bos_token.unwrap_or(default_bos),
            from_gguf: true,
            fast: Some(fast),
            nfc: false,
        })
    }

    /// The ids of `text` without added BOS/EOS (`add_special_tokens=False`): the encoding of
    /// a rendered chat template. Special tokens written in the text are matched whole.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.fast {
            Some(fast)
                if !self.nfc
                    || unicode_normalization::is_nfc_quick(text.chars())
                        == unicode_normalization::IsNormalized::Yes =>
            {
                fast.encode(text, self.inner.get_model())
                    .map_err(TokenizerError::Tokenizers)
            }
            _ => self.encode_reference(text),
        }
    }

    /// [`Tokenizer::encode`] through the whole `tokenizers` pipeline: the reference the fast
    /// path is tested against (the same ids, slower).
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The ids of `text` as the model's plain encode produces them (`add_special_tokens=True`:
    /// BOS first where the model adds one).
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if self.from_gguf {
            let mut ids = Vec::new();
            if let (true, Some(bos)) = (self.add_bos, self.bos_id) {
                ids.push(bos);
            }
            ids.extend(self.encode(text)?);
            return Ok(ids);
        }
        let enc = self
            .inner
            .encode_fast(text, true)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Whether [`Tokenizer::encode`] takes the fast path (a GGUF, or a tokenizer.json whose
    /// pipeline it reproduces) rather than the `tokenizers` pipeline.
    pub fn uses_fast_encoder(&self) -> bool {
        self.fast.is_some()
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Tokenizers(e.to_string()))
    }

    /// The model's chat template(s), when its files carry any.
    pub fn chat_templates(&self) -> Option<&ChatTemplates> {
        self.templates.as_ref()
    }

    /// The special-token variables templates read (`bos_token`, `eos_token`, …); put them in
    /// [`crate::RenderOptions::kwargs`].
    pub fn template_variables(&self) -> &Map<String, Json> {
        &self.variables
    }

    /// The BOS id, when the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// The `tokenizers` tokenizer underneath (vocabulary, decoding of single ids).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Hugging Face's ByteLevel pre-tokenizer regex (`use_regex: true`).
const HF_BYTE_LEVEL: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The fast encoder for a `tokenizer.json` whose pipeline it reproduces exactly — byte-level
/// BPE (no dropout, byte fallback or affixes), no normalizer or NFC, pre-tokenized by
/// isolating regex splits then a regex-free ByteLevel (Llama 3, Qwen2/3, DeepSeek V3 …) or
/// by ByteLevel's own regex (GPT-2), added tokens without strip or single-word rules — and
/// whether it normalizes with NFC. Anything else: `None`, the `tokenizers` pipeline.
fn fast_path_for(v: &Json) -> (Option<FastBpe>, bool) {
    let none = (None, false);
    let model = &v["model"];
    let plain = |k: &str| match &model[k] {
        Json::Null => true,
        Json::String(s) => s.is_empty(),
        Json::Bool(b) => !b,
        _ => false,
    };
    if model["type"] != "BPE"
        || ![
            "dropout",
            "byte_fallback",
            "continuing_subword_prefix",
            "end_of_word_suffix",
        ]
        .iter()
        .all(|k| plain(k))
    {
        return none;
    }
    let nfc = match &v["normalizer"] {
        Json::Null => false,
        n if n["type"] == "NFC" => true,
        _ => return none,
    };
    let byte_level_plain = |p: &Json, use_regex: bool| {
        p["type"] == "ByteLevel"
            && p["add_prefix_space"] != true
            && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true) == use_regex
    };
    let pre = &v["pre_tokenizer"];
    let mut patterns: Vec<String> = Vec::new();
    if byte_level_plain(pre, true) {
        patterns.push(HF_BYTE_LEVEL.into());
    } else if pre["type"] == "Sequence" {
        let Some(steps) = pre["pretokenizers"].as_array() else {
            return none;
        };
        let Some((last, splits)) = steps.split_last() else {
            return none;
        };
        if !byte_level_plain(last, false) {
            return none;
        }
        for s in splits {
            if s["type"] != "Split" || s["behavior"] != "Isolated" || s["invert"] == true {
                return none;
            }
            match (&s["pattern"]["Regex"], &s["pattern"]["String"]) {
                (Json::String(r), _) => patterns.push(r.clone()),
                (_, Json::String(lit)) => patterns.push(regex::escape(lit)),
                _ => return none,
            }
        }
    } else {
        return none;
    }
    let mut added = Vec::new();
    for t in v["added_tokens"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
    {
        if ["single_word", "lstrip", "rstrip"]
            .iter()
            .any(|k| t[*k] == true)
        {
            return none;
        }
        let (Some(content), Some(id)) = (t["content"].as_str(), t["id"].as_u64()) else {
            return none;
        };
        added.push((content.to_owned(), id as u32));
    }
    let patterns: Vec<&str> = patterns.iter().map(String::as_str).collect();
    match FastBpe::new(&added, &patterns) {
        Ok(f) => (Some(f), nfc),
        Err(_) => none,
    }
}
