//! A GGUF model's tokenizer, rebuilt as a Hugging Face `tokenizer.json` from the vocabulary and
//! merges llama.cpp stores in the file's metadata (`tokenizer.ggml.*`), so a llama.cpp user
//! can see token text offline without the original repository.
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
}

/// The tokenizer metadata of a GGUF file.
#[derive(Debug, Default)]
struct Vocabulary {
    model: Option<String>,
    tokens: Vec<String>,
    merges: Vec<String>,
    /// llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    token_types: Vec<i64>,
}

/// The `tokenizer.json` (as JSON) equivalent to `path`'s tokenizer: byte-level BPE with the
/// file's vocabulary and merges; control and user-defined tokens as added tokens.
pub fn tokenizer_json_from_gguf(path: &Path) -> Result<Value, GgufError> {
    let v = read_vocabulary(&mut BufReader::new(File::open(path)?))?;
    match v.model.as_deref() {
        Some("gpt2") => {}
        Some(other) => return Err(GgufError::Model(other.to_owned())),
        None => return Err(GgufError::Missing("tokenizer.ggml.model")),
    }
    if v.tokens.is_empty() {
        return Err(GgufError::Missing("tokenizer.ggml.tokens"));
    }
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, token) in v.tokens.iter().enumerate() {
        vocab.insert(token.clone(), json!(id));
        let kind = v.token_types.get(id).copied().unwrap_or(1);
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
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": v.merges,
        },
    }))
}

fn read_vocabulary(r: &mut impl Read) -> Result<Vocabulary, GgufError> {
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
    let mut v = Vocabulary::default();
    for _ in 0..entries {
        let key = read_string(r)?;
        let kind = read_u32(r)?;
        match (key.as_str(), kind) {
            ("tokenizer.ggml.model", STRING) => v.model = Some(read_string(r)?),
            ("tokenizer.ggml.tokens", ARRAY) => v.tokens = read_string_array(r)?,
            ("tokenizer.ggml.merges", ARRAY) => v.merges = read_string_array(r)?,
            ("tokenizer.ggml.token_type", ARRAY) => v.token_types = read_int_array(r)?,
            _ => skip_value(r, kind)?,
        }
    }
    Ok(v)
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
        ]);
        let v = read_vocabulary(&mut bytes.as_slice()).unwrap();
        assert_eq!(v.model.as_deref(), Some("gpt2"));
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
}
