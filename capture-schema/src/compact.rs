//! Token data in a record, compactly (schema version 2).
//!
//! A 40 KB prompt is about 10,000 token ids. As a JSON array of numbers they take 5–7 bytes
//! each and are the slowest thing a reader parses (a number per id). Version 2 writes each id
//! list as one string, `"u32v:" + base64(LEB128 varint of each id)` (about 3–4 bytes per id
//! for real vocabularies), and logprobs as `"f32le:" + base64(little-endian f32 of each)`, bit
//! for bit. Readers take either form, so version 1 records (plain arrays) read as before.
//!
//! Decoding outside Rust, in Python:
//!
//! ```python
//! import base64, struct
//! def ids(s):                      # "u32v:..." or a plain list
//!     if isinstance(s, list): return s
//!     out, v, shift = [], 0, 0
//!     for b in base64.b64decode(s.split(":", 1)[1]):
//!         v |= (b & 0x7F) << shift; shift += 7
//!         if b < 0x80: out.append(v); v, shift = 0, 0
//!     return out
//! def logprobs(s):                 # "f32le:..." or a plain list
//!     if isinstance(s, list): return s
//!     raw = base64.b64decode(s.split(":", 1)[1])
//!     return list(struct.unpack(f"<{len(raw) // 4}f", raw))
//! ```
//!
//! `tokentap records show --json` prints records with plain arrays ([`expand_token_fields`]).

use std::fmt;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use schemars::JsonSchema;
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;
use serde_json::Value;

/// The prefix of a compact id list.
pub const IDS_PREFIX: &str = "u32v:";
/// The prefix of compact logprobs.
pub const LOGPROBS_PREFIX: &str = "f32le:";

/// How an id list appears in a record (for the JSON Schema).
#[allow(dead_code)] // documents the wire form only
#[derive(JsonSchema)]
#[serde(untagged)]
pub(crate) enum IdsOnWire {
    /// Version 2: `u32v:` and the base64 of each id as a LEB128 varint.
    Compact(String),
    /// Version 1: a plain array.
    Plain(Vec<u32>),
}

/// How logprobs appear in a record (for the JSON Schema).
#[allow(dead_code)] // documents the wire form only
#[derive(JsonSchema)]
#[serde(untagged)]
pub(crate) enum LogprobsOnWire {
    /// Version 2: `f32le:` and the base64 of each logprob as a little-endian f32.
    Compact(String),
    /// Version 1: a plain array.
    Plain(Vec<f32>),
}

/// `ids` as `u32v:<base64 of LEB128 varints>`.
pub fn encode_ids(ids: &[u32]) -> String {
    compact_text(IDS_PREFIX, &varints(ids), "")
}

/// Each id as a LEB128 varint.
fn varints(ids: &[u32]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(ids.len() * 3);
    for &id in ids {
        let mut v = id;
        while v >= 0x80 {
            bytes.push((v as u8) | 0x80);
            v >>= 7;
        }
        bytes.push(v as u8);
    }
    bytes
}

/// `prefix` and the base64 of `bytes`, between two `quote`s.
fn compact_text(prefix: &str, bytes: &[u8], quote: &str) -> String {
    let mut out =
        String::with_capacity(2 * quote.len() + prefix.len() + bytes.len().div_ceil(3) * 4);
    out.push_str(quote);
    out.push_str(prefix);
    STANDARD.encode_string(bytes, &mut out);
    out.push_str(quote);
    out
}

/// A compact field as the JSON string it is, written as is. Neither the prefixes nor base64
/// have a character JSON escapes, and serde_json would look at each of a 40 KB id list's bytes
/// to find that out: 15 µs a record, against about 5 for the check `RawValue` makes.
fn compact_json(prefix: &str, bytes: &[u8]) -> Box<RawValue> {
    RawValue::from_string(compact_text(prefix, bytes, "\""))
        .expect("a quoted prefix and base64 are a JSON string")
}

/// The ids of a `u32v:` string.
pub fn decode_ids(s: &str) -> Result<Vec<u32>, String> {
    let b64 = s
        .strip_prefix(IDS_PREFIX)
        .ok_or_else(|| format!("a compact id list starts with `{IDS_PREFIX}`"))?;
    let bytes = STANDARD
        .decode(b64)
        .map_err(|e| format!("compact id list: {e}"))?;
    // Every id ends with a byte below 0x80, so this many ids exactly.
    let mut ids = Vec::with_capacity(bytes.iter().filter(|&&b| b < 0x80).count());
    let (mut v, mut shift) = (0u64, 0u32);
    for &b in &bytes {
        if shift > 28 {
            return Err("compact id list: an id longer than 5 bytes".into());
        }
        v |= u64::from(b & 0x7F) << shift;
        if b < 0x80 {
            ids.push(u32::try_from(v).map_err(|_| "compact id list: an id past u32".to_string())?);
            (v, shift) = (0, 0);
        } else {
            shift += 7;
        }
    }
    if shift != 0 {
        return Err("compact id list: cut off inside an id".into());
    }
    Ok(ids)
}

/// `logprobs` as `f32le:<base64 of little-endian f32s>`.
pub fn encode_logprobs(logprobs: &[f32]) -> String {
    compact_text(LOGPROBS_PREFIX, &f32_bytes(logprobs), "")
}

fn f32_bytes(logprobs: &[f32]) -> Vec<u8> {
    logprobs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The logprobs of an `f32le:` string.
pub fn decode_logprobs(s: &str) -> Result<Vec<f32>, String> {
    let b64 = s
        .strip_prefix(LOGPROBS_PREFIX)
        .ok_or_else(|| format!("compact logprobs start with `{LOGPROBS_PREFIX}`"))?;
    let bytes = STANDARD
        .decode(b64)
        .map_err(|e| format!("compact logprobs: {e}"))?;
    if bytes.len() % 4 != 0 {
        return Err("compact logprobs: not a whole number of f32s".into());
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// A record as JSON with its token fields as plain arrays (for `records show --json`, jq and
/// pandas); any other JSON is returned unchanged.
pub fn expand_token_fields(mut record: Value) -> Value {
    if let Some(o) = record.as_object_mut() {
        for key in ["prompt_token_ids", "completion_token_ids"] {
            if let Some(Value::String(s)) = o.get(key) {
                if let Ok(ids) = decode_ids(s) {
                    o.insert(key.into(), ids.into());
                }
            }
        }
        if let Some(Value::String(s)) = o.get("logprobs") {
            if let Ok(lp) = decode_logprobs(s) {
                o.insert("logprobs".into(), lp.into());
            }
        }
    }
    record
}

/// Reads a token field either way: a JSON array of `T` (version 1) or the compact string
/// (version 2, decoded by `decode`); `null` is absent.
struct CompactOrArray<T> {
    what: &'static str,
    decode: fn(&str) -> Result<Vec<T>, String>,
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for CompactOrArray<T> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.what)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        (self.decode)(s).map(Some).map_err(E::custom)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(x) = seq.next_element::<T>()? {
            out.push(x);
        }
        Ok(Some(out))
    }
}

/// `#[serde(with)]` for `Option<Vec<u32>>` token id fields: written compact, read either way.
pub mod ids {
    use serde::{Deserializer, Serialize, Serializer};

    use super::{compact_json, decode_ids, varints, CompactOrArray, IDS_PREFIX};

    pub fn serialize<S: Serializer>(ids: &Option<Vec<u32>>, s: S) -> Result<S::Ok, S::Error> {
        match ids {
            Some(ids) => compact_json(IDS_PREFIX, &varints(ids)).serialize(s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
        d.deserialize_any(CompactOrArray {
            what: "token ids: an array of u32 or a `u32v:` string",
            decode: decode_ids,
        })
    }
}

/// `#[serde(with)]` for `Option<Vec<f32>>` logprob fields: written compact, read either way.
pub mod logprobs {
    use serde::{Deserializer, Serialize, Serializer};

    use super::{compact_json, decode_logprobs, f32_bytes, CompactOrArray, LOGPROBS_PREFIX};

    pub fn serialize<S: Serializer>(lp: &Option<Vec<f32>>, s: S) -> Result<S::Ok, S::Error> {
        match lp {
            Some(lp) => compact_json(LOGPROBS_PREFIX, &f32_bytes(lp)).serialize(s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<f32>>, D::Error> {
        d.deserialize_any(CompactOrArray {
            what: "logprobs: an array of numbers or an `f32le:` string",
            decode: decode_logprobs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn ids_round_trip_at_the_edges_of_each_varint_length() {
        let ids = vec![0, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, u32::MAX];
        assert_eq!(decode_ids(&encode_ids(&ids)).unwrap(), ids);
        assert_eq!(decode_ids(&encode_ids(&[])).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn damaged_id_lists_are_errors_not_other_ids() {
        // Cut inside an id (a continuation byte last).
        let cut = format!("{IDS_PREFIX}{}", STANDARD.encode([0x80u8]));
        assert!(decode_ids(&cut).is_err());
        // Past u32: 5 bytes with high bits set in the last.
        let big = format!(
            "{IDS_PREFIX}{}",
            STANDARD.encode([0xFF, 0xFF, 0xFF, 0xFF, 0x7F])
        );
        assert!(decode_ids(&big).is_err());
        let long = format!("{IDS_PREFIX}{}", STANDARD.encode([0x80; 6]));
        assert!(decode_ids(&long).is_err());
        assert!(decode_ids("AAAA").is_err());
        assert!(decode_ids("u32v:!!").is_err());
    }

    #[test]
    fn logprobs_round_trip_bit_for_bit_and_damage_is_an_error() {
        let lp = vec![0.0, -0.0, -1e-30, -9999.0, f32::MIN, -0.123_456_79];
        let back = decode_logprobs(&encode_logprobs(&lp)).unwrap();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            lp.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let odd = format!("{LOGPROBS_PREFIX}{}", STANDARD.encode([1u8, 2, 3]));
        assert!(decode_logprobs(&odd).is_err());
    }

    #[test]
    fn show_json_expands_compact_fields_and_leaves_arrays() {
        let v = serde_json::json!({
            "prompt_token_ids": encode_ids(&[1, 2, 300]),
            "completion_token_ids": [4, 5],
            "logprobs": encode_logprobs(&[-0.5, -1.0]),
        });
        assert_eq!(
            expand_token_fields(v),
            serde_json::json!({
                "prompt_token_ids": [1, 2, 300],
                "completion_token_ids": [4, 5],
                "logprobs": [-0.5, -1.0],
            })
        );
    }

    #[derive(serde::Serialize, Deserialize, PartialEq, Debug)]
    struct Fields {
        #[serde(with = "super::ids")]
        ids: Option<Vec<u32>>,
        #[serde(with = "super::logprobs")]
        logprobs: Option<Vec<f32>>,
    }

    /// The fields are written as is (not through serde_json's string escaping), and are the
    /// same JSON strings either way: as text and as a `Value`.
    #[test]
    fn fields_are_written_as_their_compact_strings() {
        let fields = Fields {
            ids: Some(vec![0, 127, 128, 151_643, u32::MAX]),
            logprobs: Some(vec![-0.5, 0.0, f32::MIN_POSITIVE]),
        };
        let ids = encode_ids(fields.ids.as_deref().unwrap());
        let logprobs = encode_logprobs(fields.logprobs.as_deref().unwrap());
        let text = serde_json::to_string(&fields).unwrap();
        assert_eq!(
            text,
            format!(r#"{{"ids":"{ids}","logprobs":"{logprobs}"}}"#)
        );
        assert_eq!(serde_json::from_str::<Fields>(&text).unwrap(), fields);
        let value = serde_json::to_value(&fields).unwrap();
        assert_eq!(value["ids"], Value::String(ids));
        assert_eq!(value["logprobs"], Value::String(logprobs));
        assert_eq!(serde_json::from_value::<Fields>(value).unwrap(), fields);
        let none = Fields {
            ids: None,
            logprobs: None,
        };
        assert_eq!(
            serde_json::to_string(&none).unwrap(),
            r#"{"ids":null,"logprobs":null}"#
        );
    }

    proptest! {
        #[test]
        fn any_ids_round_trip(ids in proptest::collection::vec(any::<u32>(), 0..300)) {
            prop_assert_eq!(decode_ids(&encode_ids(&ids)).unwrap(), ids);
        }
    }
}
