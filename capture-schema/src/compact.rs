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

// SIMD base64 (runtime-detected): about 4x the `base64` crate's speed on a 30 KB id list,
// each way (2.4 against 9.3 µs to encode, 3.3 against 12.6 to decode).
use base64_simd::STANDARD;
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
    // A plain byte loop into a growing Vec. Writing each id into a five-byte window of a
    // buffer sized and zeroed up front ran faster alone (14 against 20 µs for 10,000 ids), but
    // in the proxy that 50 KB zeroed allocation came from fresh pages each time (page faults
    // and TLB shootdowns): 0.04 ms a call more CPU in all.
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

/// The most bytes a `u32` takes as a varint.
const MAX_VARINT: usize = 5;

/// `prefix` and the base64 of `bytes`, between two `quote`s.
fn compact_text(prefix: &str, bytes: &[u8], quote: &str) -> String {
    let mut out = String::with_capacity(
        2 * quote.len() + prefix.len() + STANDARD.encoded_length(bytes.len()),
    );
    out.push_str(quote);
    out.push_str(prefix);
    STANDARD.encode_append(bytes, &mut out);
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

/// What a compact field that fails to decode is not (base64-simd's error says only
/// "Base64Error").
const NOT_BASE64: &str = "not standard padded base64 (RFC 4648)";

/// The ids of a `u32v:` string.
pub fn decode_ids(s: &str) -> Result<Vec<u32>, String> {
    let b64 = s
        .strip_prefix(IDS_PREFIX)
        .ok_or_else(|| format!("a compact id list starts with `{IDS_PREFIX}`"))?;
    let bytes = STANDARD
        .decode_to_vec(b64)
        .map_err(|_| format!("compact id list: {NOT_BASE64}"))?;
    read_varints(&bytes)
}

/// The ids of a run of LEB128 varints.
///
/// Ids are found by their last byte (the only one below 0x80): 64 bytes at a time, the last
/// bytes become a bit mask, and each id is read from one eight-byte load between two of them.
/// A byte loop branches on every byte, and real id lists mix two- and three-byte ids, so it
/// mispredicts; this reads 10,000 ids in about 27 µs against 34 (Rust, one core here).
fn read_varints(bytes: &[u8]) -> Result<Vec<u32>, String> {
    const TOO_LONG: &str = "compact id list: an id longer than 5 bytes";
    const PAST_U32: &str = "compact id list: an id past u32";
    // Every id ends with a byte below 0x80, so this many ids exactly.
    let mut ids = Vec::with_capacity(bytes.iter().filter(|&&b| b < 0x80).count());
    // The first byte of the id being read.
    let mut start = 0;
    let mut block = 0;
    // A block's ids may start up to MAX_VARINT bytes before it, and each is loaded as eight
    // bytes from its start: the block and eight bytes past it must be in the list.
    while block + 64 + 8 <= bytes.len() {
        let mut ends = 0u64;
        for (k, word) in bytes[block..block + 64].chunks_exact(8).enumerate() {
            ends |= last_bytes(u64::from_le_bytes(word.try_into().expect("8 bytes"))) << (8 * k);
        }
        while ends != 0 {
            let end = block + ends.trailing_zeros() as usize;
            ends &= ends - 1;
            let len = end + 1 - start;
            if len > MAX_VARINT {
                return Err(TOO_LONG.into());
            }
            let word = u64::from_le_bytes(bytes[start..start + 8].try_into().expect("8 bytes"));
            let w = word & (u64::MAX >> (64 - 8 * len));
            // The seven payload bits of each byte, put side by side.
            let id = (w & 0x7f)
                | ((w >> 1) & 0x3f80)
                | ((w >> 2) & 0x1f_c000)
                | ((w >> 3) & 0xfe0_0000)
                | ((w >> 4) & 0x7_f000_0000);
            ids.push(u32::try_from(id).map_err(|_| PAST_U32.to_string())?);
            start = end + 1;
        }
        block += 64;
    }
    let (mut v, mut shift) = (0u64, 0u32);
    for &b in &bytes[start..] {
        if shift > 28 {
            return Err(TOO_LONG.into());
        }
        v |= u64::from(b & 0x7F) << shift;
        if b < 0x80 {
            ids.push(u32::try_from(v).map_err(|_| PAST_U32.to_string())?);
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

/// One bit for each byte of `word` below 0x80, byte `i` at bit `i`.
fn last_bytes(word: u64) -> u64 {
    let high = !word & 0x8080_8080_8080_8080;
    // Each high bit moved to bit 56 + its byte's index (no two products overlap), then down.
    (high >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56
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
        .decode_to_vec(b64)
        .map_err(|_| format!("compact logprobs: {NOT_BASE64}"))?;
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
        let cut = format!("{IDS_PREFIX}{}", STANDARD.encode_to_string([0x80u8]));
        assert!(decode_ids(&cut).is_err());
        // Past u32: 5 bytes with high bits set in the last.
        let big = format!(
            "{IDS_PREFIX}{}",
            STANDARD.encode_to_string([0xFF, 0xFF, 0xFF, 0xFF, 0x7F])
        );
        assert!(decode_ids(&big).is_err());
        let long = format!("{IDS_PREFIX}{}", STANDARD.encode_to_string([0x80; 6]));
        assert!(decode_ids(&long).is_err());
        assert!(decode_ids("AAAA").is_err());
        assert_eq!(
            decode_ids("u32v:!!").unwrap_err(),
            "compact id list: not standard padded base64 (RFC 4648)"
        );
    }

    #[test]
    fn logprobs_round_trip_bit_for_bit_and_damage_is_an_error() {
        let lp = vec![0.0, -0.0, -1e-30, -9999.0, f32::MIN, -0.123_456_79];
        let back = decode_logprobs(&encode_logprobs(&lp)).unwrap();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            lp.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let odd = format!(
            "{LOGPROBS_PREFIX}{}",
            STANDARD.encode_to_string([1u8, 2, 3])
        );
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

    /// The plain byte loop `read_varints` stands in for: ids, or `None` for a damaged list.
    fn read_varints_bytewise(bytes: &[u8]) -> Option<Vec<u32>> {
        let (mut ids, mut v, mut shift) = (Vec::new(), 0u64, 0u32);
        for &b in bytes {
            if shift > 28 {
                return None;
            }
            v |= u64::from(b & 0x7F) << shift;
            if b < 0x80 {
                ids.push(u32::try_from(v).ok()?);
                (v, shift) = (0, 0);
            } else {
                shift += 7;
            }
        }
        (shift == 0).then_some(ids)
    }

    /// Ids of every varint length, in runs that cross the word reader's 64-byte blocks.
    fn mixed_length_ids() -> impl Strategy<Value = Vec<u32>> {
        let id = prop_oneof![
            0u32..128,
            128u32..16_384,
            16_384u32..2_097_152,
            any::<u32>()
        ];
        proptest::collection::vec(id, 0..300)
    }

    proptest! {
        #[test]
        fn any_ids_round_trip(ids in proptest::collection::vec(any::<u32>(), 0..300)) {
            prop_assert_eq!(decode_ids(&encode_ids(&ids)).unwrap(), ids);
        }

        #[test]
        fn mixed_length_ids_round_trip(ids in mixed_length_ids()) {
            prop_assert_eq!(decode_ids(&encode_ids(&ids)).unwrap(), ids);
        }

        /// Any bytes at all, valid or damaged, read as the byte loop reads them.
        #[test]
        fn the_word_reader_reads_any_bytes_as_the_byte_loop(
            bytes in proptest::collection::vec(
                prop_oneof![any::<u8>(), 0x80u8..=0xFF, Just(0xFFu8)], 0..400),
        ) {
            prop_assert_eq!(read_varints(&bytes).ok(), read_varints_bytewise(&bytes));
        }

        /// A valid list with one id damaged (made too long, or past u32) is an error.
        #[test]
        fn a_damaged_id_anywhere_is_an_error(
            ids in proptest::collection::vec(0u32..2_097_152, 1..200),
            at in any::<prop::sample::Index>(),
            past_u32 in any::<bool>(),
        ) {
            let at = at.index(ids.len());
            let mut bytes = varints(&ids[..at]);
            if past_u32 {
                bytes.extend([0xFF, 0xFF, 0xFF, 0xFF, 0x10]);
            } else {
                bytes.extend([0x80; 6].iter().chain(&[0x01]));
            }
            bytes.extend(varints(&ids[at..]));
            prop_assert!(read_varints(&bytes).is_err());
        }
    }
}
