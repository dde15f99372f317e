//! A GGUF model's tokenizer: the vocabulary, merges, pre-tokenizer type, special token ids
//! and chat templates llama.cpp stores in the file's metadata (`tokenizer.ggml.*`,
//! `tokenizer.chat_template*`), and the Hugging Face `tokenizer.json` equivalent to it, so a
//! llama.cpp model tokenizes here as llama-server tokenizes it.
//!
//! Only the metadata section is read (the tensors, which are nearly all of the file, are not),
//! with a size limit on every string and array. The published GGUF crates were not used: they
//! switch on serde_json's `arbitrary_precision` for the whole workspace, which changes how
//! every number in a capture record is parsed.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use serde_json::{json, Map, Value};

/// Longest string accepted (a token, a merge, a chat template).
const MAX_STRING: u64 = 1 << 20;
/// Most elements accepted in one array (vocabularies reach ~260k; merges a little more).
const MAX_ARRAY: u64 = 4 << 20;
/// Most metadata entries accepted.
const MAX_ENTRIES: u64 = 1 << 16;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("reading the GGUF file: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a GGUF file (bad magic)")]
    Magic,
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    #[error("GGUF metadata is malformed: {0}")]
    Malformed(String),
    #[error("the GGUF file has no {0}: it holds no usable tokenizer")]
    Missing(&'static str),
    #[error("the GGUF tokenizer model {0:?} is not supported (\"gpt2\" byte-level BPE is)")]
    Model(String),
    #[error(
        "the GGUF pre-tokenizer {0:?} is not supported (supported: {list}); \
         its regexes are in llama.cpp's llama-vocab.cpp",
        list = SUPPORTED_PRE.join(", ")
    )]
    Pre(String),
}

/// The tokenizer metadata of a GGUF file.
#[derive(Debug, Default, Clone)]
pub struct GgufVocabulary {
    /// `tokenizer.ggml.model`: `gpt2` (byte-level BPE), `llama` (SentencePiece), …
    pub model: Option<String>,
    /// `tokenizer.ggml.pre`: which pre-tokenizer regexes llama.cpp applies.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub merges: Vec<String>,
    /// llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Vec<i64>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// `tokenizer.ggml.add_bos_token`, when the file says.
    pub add_bos_token: Option<bool>,
    /// `tokenizer.chat_template` as `("default", …)`, then `tokenizer.chat_template.NAME`.
    pub chat_templates: Vec<(String, String)>,
}

impl GgufVocabulary {
    /// Reads the tokenizer metadata of the GGUF file at `path`.
    pub fn read(path: &Path) -> Result<GgufVocabulary, GgufError> {
        read_vocabulary(&mut BufReader::new(File::open(path)?))
    }

    /// The `tokenizer.json` (as JSON) equivalent to this tokenizer: byte-level BPE with the
    /// file's vocabulary and merges, llama.cpp's pre-tokenizer regexes for its `pre` type
    /// (each a `Split` isolating its matches, as llama.cpp's `unicode_regex_split` does), and
    /// control and user-defined tokens as added tokens (matched whole in the text, as
    /// llama.cpp does with `parse_special`).
    pub fn tokenizer_json(&self) -> Result<Value, GgufError> {
        self.check_model()?;
        let pre = self.pre.as_deref().unwrap_or("default");
        let (regexes, ignore_merges) =
            pre_tokenizer(pre).ok_or_else(|| GgufError::Pre(pre.to_owned()))?;
        let mut steps: Vec<Value> = regexes
            .iter()
            .map(|r| {
                json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false})
            })
            .collect();
        steps.push(json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}));
        self.build(
            json!({"type": "Sequence", "pretokenizers": steps}),
            ignore_merges,
        )
    }

    /// A tokenizer for decoding ids to text only: any `pre` type is accepted, since the
    /// pre-tokenizer plays no part in decoding.
    pub fn decoding_tokenizer_json(&self) -> Result<Value, GgufError> {
        self.build(
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
            false,
        )
    }

    fn check_model(&self) -> Result<(), GgufError> {
        match self.model.as_deref() {
            Some("gpt2") => {}
            Some(other) => return Err(GgufError::Model(other.to_owned())),
            None => return Err(GgufError::Missing("tokenizer.ggml.model")),
        }
        if self.tokens.is_empty() {
            return Err(GgufError::Missing("tokenizer.ggml.tokens"));
        }
        Ok(())
    }

    fn build(&self, pre_tokenizer: Value, ignore_merges: bool) -> Result<Value, GgufError> {
        self.check_model()?;
        let mut vocab = Map::new();
        let mut added = Vec::new();
        for (id, token) in self.tokens.iter().enumerate() {
            vocab.insert(token.clone(), json!(id));
            let kind = self.token_types.get(id).copied().unwrap_or(1);
            if kind == 3 || kind == 4 {
                added.push(json!({
                    "id": id, "content": token, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": kind == 3,
                }));
            }
        }
        Ok(json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "ignore_merges": ignore_merges, "vocab": vocab, "merges": self.merges,
            },
        }))
    }
}

/// The `pre` names [`pre_tokenizer`] knows (llama.cpp's `llama_vocab::impl::load` maps them).
pub const SUPPORTED_PRE: &[&str] = &[
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "jais",
    "exaone4",
    "qwen2",
    "deepseek-r1-qwen",
    "megrez",
    "stablelm2",
    "qwen35",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "smaug-bpe",
    "dbrx",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "falcon",
    "chatglm-bpe",
    "glm4",
];

// The regexes of llama.cpp's `llm_tokenizer_bpe` (src/llama-vocab.cpp, llama.cpp 11434),
// applied in order, each to the pieces the previous ones left.
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
// Non-ASCII as escapes: these ranges were copied by program from llama-vocab.cpp, since
// look-alike letters (U+1FDB vs U+038A) change a range's meaning or validity.
const DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];
const DEEPSEEK_CODER: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}",
];
const DEEPSEEK_V3: &[&str] = &[
    "\\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const FALCON: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|`]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "[0-9][0-9][0-9]",
];

/// The regexes and `ignore_merges` (a word already in the vocabulary is one token) llama.cpp
/// uses for a `pre` type; `None` for one this crate does not know.
pub fn pre_tokenizer(pre: &str) -> Option<(Vec<&'static str>, bool)> {
    Some(match pre {
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" => (vec![GPT2], false),
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => (vec![QWEN2], false),
        "qwen35" => (vec![QWEN35], false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (vec![LLAMA3], true),
        "smaug-bpe" | "dbrx" => (vec![LLAMA3], false),
        "chatglm-bpe" => (vec![LLAMA3], false),
        "glm4" => (vec![LLAMA3], true),
        "deepseek-llm" => (DEEPSEEK_LLM.to_vec(), false),
        "deepseek-coder" => (DEEPSEEK_CODER.to_vec(), false),
        "deepseek-v3" => (DEEPSEEK_V3.to_vec(), false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec![r"\p{N}", GPT2], false)
        }
        "falcon" => (FALCON.to_vec(), false),
        _ => return None,
    })
}

fn read_vocabulary(r: &mut impl Read) -> Result<GgufVocabulary, GgufError> {
    let mut magic = [0u8; 4];
    r.read_exact(&mut magic)?;
    if &magic != b"GGUF" {
        return Err(GgufError::Magic);
    }
    let version = read_u32(r)?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::Version(version));
    }
    let _tensors = read_u64(r)?;
    let entries = read_u64(r)?;
    if entries > MAX_ENTRIES {
        return Err(GgufError::Malformed(format!("{entries} metadata entries")));
    }
    let mut v = GgufVocabulary::default();
    for _ in 0..entries {
        let key = read_string(r)?;
        let kind = read_u32(r)?;
        match (key.as_str(), kind) {
            ("tokenizer.ggml.model", STRING) => v.model = Some(read_string(r)?),
            ("tokenizer.ggml.pre", STRING) => v.pre = Some(read_string(r)?),
            ("tokenizer.ggml.tokens", ARRAY) => v.tokens = read_string_array(r)?,
            ("tokenizer.ggml.merges", ARRAY) => v.merges = read_string_array(r)?,
            ("tokenizer.ggml.token_type", ARRAY) => v.token_types = read_int_array(r)?,
            ("tokenizer.ggml.bos_token_id", _) => v.bos_token_id = read_id(r, kind)?,
            ("tokenizer.ggml.eos_token_id", _) => v.eos_token_id = read_id(r, kind)?,
            ("tokenizer.ggml.add_bos_token", BOOL) => v.add_bos_token = Some(read_u8(r)? != 0),
            ("tokenizer.chat_template", STRING) => {
                let t = read_string(r)?;
                v.chat_templates.insert(0, ("default".into(), t));
            }
            (k, STRING) if k.starts_with("tokenizer.chat_template.") => {
                let name = k["tokenizer.chat_template.".len()..].to_owned();
                v.chat_templates.push((name, read_string(r)?));
            }
            _ => skip_value(r, kind)?,
        }
    }
    Ok(v)
}

fn read_u8(r: &mut impl Read) -> Result<u8, GgufError> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

/// A token id stored as any integer type; one out of `u32` range is no id.
fn read_id(r: &mut impl Read, kind: u32) -> Result<Option<u32>, GgufError> {
    let v: i128 = match kind {
        U8 => read_u8(r)? as i128,
        I8 => read_u8(r)? as i8 as i128,
        U16 | I16 => {
            let mut b = [0u8; 2];
            r.read_exact(&mut b)?;
            if kind == U16 {
                u16::from_le_bytes(b) as i128
            } else {
                i16::from_le_bytes(b) as i128
            }
        }
        U32 => read_u32(r)? as i128,
        I32 => read_u32(r)? as i32 as i128,
        U64 => read_u64(r)? as i128,
        I64 => read_u64(r)? as i64 as i128,
        other => {
            skip_value(r, other)?;
            return Err(GgufError::Malformed(format!(
                "a token id of value type {other}"
            )));
        }
    };
    Ok(u32::try_from(v).ok())
}

// GGUF value types.
const U8: u32 = 0;
const I8: u32 = 1;
const U16: u32 = 2;
const I16: u32 = 3;
const U32: u32 = 4;
const I32: u32 = 5;
const F32: u32 = 6;
const BOOL: u32 = 7;
const STRING: u32 = 8;
const ARRAY: u32 = 9;
const U64: u32 = 10;
const I64: u32 = 11;
const F64: u32 = 12;

fn scalar_size(kind: u32) -> Option<u64> {
    Some(match kind {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        U64 | I64 | F64 => 8,
        _ => return None,
    })
}

fn read_u32(r: &mut impl Read) -> Result<u32, GgufError> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> Result<u64, GgufError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_string(r: &mut impl Read) -> Result<String, GgufError> {
    let len = read_u64(r)?;
    if len > MAX_STRING {
        return Err(GgufError::Malformed(format!("a string of {len} bytes")));
    }
    let mut b = vec![0u8; len as usize];
    r.read_exact(&mut b)?;
    // Vocabulary entries are UTF-8 (byte-level BPE maps bytes to printable characters).
    String::from_utf8(b).map_err(|_| GgufError::Malformed("a string is not UTF-8".into()))
}

fn array_head(r: &mut impl Read) -> Result<(u32, u64), GgufError> {
    let kind = read_u32(r)?;
    let len = read_u64(r)?;
    if len > MAX_ARRAY {
        return Err(GgufError::Malformed(format!("an array of {len} elements")));
    }
    Ok((kind, len))
}

fn read_string_array(r: &mut impl Read) -> Result<Vec<String>, GgufError> {
    let (kind, len) = array_head(r)?;
    if kind != STRING {
        return Err(GgufError::Malformed(format!(
            "a string array holds type {kind}"
        )));
    }
    (0..len).map(|_| read_string(r)).collect()
}

fn read_int_array(r: &mut impl Read) -> Result<Vec<i64>, GgufError> {
    let (kind, len) = array_head(r)?;
    (0..len)
        .map(|_| {
            Ok(match kind {
                I32 => read_u32(r)? as i32 as i64,
                U32 => read_u32(r)? as i64,
                I64 | U64 => read_u64(r)? as i64,
                other => {
                    return Err(GgufError::Malformed(format!(
                        "an integer array holds type {other}"
                    )))
                }
            })
        })
        .collect()
}

fn skip_value(r: &mut impl Read, kind: u32) -> Result<(), GgufError> {
    let skip = |r: &mut dyn Read, n: u64| -> Result<(), GgufError> {
        let copied = std::io::copy(&mut r.take(n), &mut std::io::sink())?;
        if copied == n {
            Ok(())
        } else {
            Err(GgufError::Malformed(
                "the file ends inside its metadata".into(),
            ))
        }
    };
    match kind {
        STRING => {
            let len = read_u64(r)?;
            if len > MAX_STRING {
                return Err(GgufError::Malformed(format!("a string of {len} bytes")));
            }
            skip(r, len)
        }
        ARRAY => {
            let (inner, len) = array_head(r)?;
            match scalar_size(inner) {
                Some(size) => skip(r, size * len),
                None => (0..len).try_for_each(|_| skip_value(r, inner)),
            }
        }
        other => match scalar_size(other) {
            Some(size) => skip(r, size),
            None => Err(GgufError::Malformed(format!("unknown value type {other}"))),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF metadata section with the given entries (already encoded as key, type, value).
    fn file(entries: &[Vec<u8>]) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend((entries.len() as u64).to_le_bytes());
        for e in entries {
            out.extend(e);
        }
        out
    }

    fn string(s: &str) -> Vec<u8> {
        let mut out = (s.len() as u64).to_le_bytes().to_vec();
        out.extend(s.as_bytes());
        out
    }

    fn entry(key: &str, kind: u32, value: Vec<u8>) -> Vec<u8> {
        let mut out = string(key);
        out.extend(kind.to_le_bytes());
        out.extend(value);
        out
    }

    fn strings(items: &[&str]) -> Vec<u8> {
        let mut out = STRING.to_le_bytes().to_vec();
        out.extend((items.len() as u64).to_le_bytes());
        for s in items {
            out.extend(string(s));
        }
        out
    }

    #[test]
    fn reads_the_vocabulary_and_skips_everything_else() {
        let mut types = I32.to_le_bytes().to_vec();
        types.extend(3u64.to_le_bytes());
        for t in [1i32, 1, 3] {
            types.extend(t.to_le_bytes());
        }
        let mut floats = F32.to_le_bytes().to_vec();
        floats.extend(2u64.to_le_bytes());
        floats.extend([0u8; 8]);
        let bytes = file(&[
            entry("general.name", STRING, string("tiny")),
            entry("llama.block_count", U32, 2u32.to_le_bytes().to_vec()),
            entry("tokenizer.ggml.scores", ARRAY, floats),
            entry("tokenizer.ggml.model", STRING, string("gpt2")),
            entry(
                "tokenizer.ggml.tokens",
                ARRAY,
                strings(&["h", "i", "<|end|>"]),
            ),
            entry("tokenizer.ggml.merges", ARRAY, strings(&["h i"])),
            entry("tokenizer.ggml.token_type", ARRAY, types),
            entry("tokenizer.ggml.pre", STRING, string("qwen2")),
            entry(
                "tokenizer.ggml.bos_token_id",
                U32,
                2u32.to_le_bytes().to_vec(),
            ),
            entry("tokenizer.ggml.add_bos_token", BOOL, vec![0]),
            entry("tokenizer.chat_template.tool_use", STRING, string("U")),
            entry("tokenizer.chat_template", STRING, string("T")),
        ]);
        let v = read_vocabulary(&mut bytes.as_slice()).unwrap();
        assert_eq!(v.model.as_deref(), Some("gpt2"));
        assert_eq!(v.pre.as_deref(), Some("qwen2"));
        assert_eq!(v.bos_token_id, Some(2));
        assert_eq!(v.add_bos_token, Some(false));
        assert_eq!(
            v.chat_templates,
            [
                ("default".to_owned(), "T".to_owned()),
                ("tool_use".to_owned(), "U".to_owned())
            ]
        );
        assert_eq!(v.tokens, ["h", "i", "<|end|>"]);
        assert_eq!(v.merges, ["h i"]);
        assert_eq!(v.token_types, [1, 1, 3]);
    }

    #[test]
    fn refuses_what_is_not_a_bounded_gguf() {
        assert!(matches!(
            read_vocabulary(&mut &b"GGML\0\0\0\0"[..]),
            Err(GgufError::Magic)
        ));
        let mut huge = string("tokenizer.ggml.tokens");
        huge.extend(ARRAY.to_le_bytes());
        huge.extend(STRING.to_le_bytes());
        huge.extend(u64::MAX.to_le_bytes());
        assert!(matches!(
            read_vocabulary(&mut file(&[huge]).as_slice()),
            Err(GgufError::Malformed(_))
        ));
        // Truncated inside the metadata: an error, not a panic.
        let cut = file(&[entry("general.name", STRING, string("tiny"))]);
        assert!(read_vocabulary(&mut &cut[..cut.len() - 2]).is_err());
    }

    #[test]
    fn every_supported_pre_type_compiles_with_fancy_regex() {
        for pre in SUPPORTED_PRE {
            let (regexes, _) = pre_tokenizer(pre).unwrap();
            for r in regexes {
                let split = json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false});
                if let Err(e) = serde_json::from_value::<tokenizers::PreTokenizerWrapper>(split) {
                    panic!("{pre}: {r:?}: {e}");
                }
            }
        }
        assert!(pre_tokenizer("no-such-pre").is_none());
    }
}
