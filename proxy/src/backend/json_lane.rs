//! A fast lane through an engine answer's JSON: the object and array grammar walked by hand, so
//! that the one value that is most of an answer's bytes, vLLM's ~10,000 `prompt_token_ids`,
//! can be read by a word-at-a-time digit loop instead of serde_json's per-element path (about
//! 100 µs per answer there, about a fifth of the proxy's CPU per captured call).
//!
//! The lane never decides anything. Every function answers `Some` only for input it reads
//! exactly as serde_json would, and `None` for anything else (an escape in a key, whitespace in
//! an id array, a leading zero, any error, nesting near serde_json's limit): the caller then
//! hands the whole document to serde_json, whose answer (and error) stands. Values the lane
//! does not read itself are read by serde_json in place, from the same bytes.
//!
//! Depth: serde_json refuses a document nested 128 deep. A value read in place by serde_json
//! starts its own count, so the lane passes the depth down and refuses (`None`) wherever the
//! nesting could reach that limit: never accepting what a whole-document parse would refuse.

use serde::Deserialize;

/// Nesting at or past which the lane leaves the document to serde_json (which refuses 128).
const MAX_DEPTH: usize = 100;

/// What a lane reader gives: the value and the number of bytes it took.
pub(crate) type Read<T> = Option<(T, usize)>;

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\t' | b'\r')
}

fn skip_ws(json: &[u8], mut at: usize) -> usize {
    while json.get(at).copied().is_some_and(is_ws) {
        at += 1;
    }
    at
}

/// One whole JSON document (whitespace around it, nothing else), read by `value`.
pub(crate) fn document<'de, T>(
    json: &'de [u8],
    value: impl FnOnce(&'de [u8]) -> Read<T>,
) -> Option<T> {
    let start = skip_ws(json, 0);
    let (v, n) = value(&json[start..])?;
    (skip_ws(json, start + n) == json.len()).then_some(v)
}

/// A value read in place by serde_json (`T` is the caller's serde reading of it), at `depth`
/// containers deep.
pub(crate) fn serde_value<'de, T: Deserialize<'de>>(json: &'de [u8], depth: usize) -> Read<T> {
    let mut values = serde_json::Deserializer::from_slice(json).into_iter::<T>();
    let v = values.next()?.ok()?;
    let n = values.byte_offset();
    // The value nests no deeper than it has openers (strings' brackets counted too: the check
    // may refuse what was fine, never the reverse).
    let openers = json[..n]
        .iter()
        .filter(|&&b| b == b'[' || b == b'{')
        .count();
    (depth + openers < MAX_DEPTH).then_some((v, n))
}

/// A JSON object at `depth` containers deep: `field(key, rest, depth)` reads each member's
/// value from the start of `rest` and says how many bytes it took. Keys are read only when
/// they are plain (no escape, control or non-ASCII byte); a repeated key is passed again.
pub(crate) fn object<'de>(
    json: &'de [u8],
    depth: usize,
    mut field: impl FnMut(&'de str, &'de [u8], usize) -> Option<usize>,
) -> Option<usize> {
    if json.first() != Some(&b'{') || depth + 1 >= MAX_DEPTH {
        return None;
    }
    let mut at = skip_ws(json, 1);
    if json.get(at) == Some(&b'}') {
        return Some(at + 1);
    }
    loop {
        let key = plain_key(&json[at..])?;
        at = skip_ws(json, at + key.len() + 2);
        if json.get(at) != Some(&b':') {
            return None;
        }
        at = skip_ws(json, at + 1);
        at += field(key, &json[at..], depth + 1)?;
        at = skip_ws(json, at);
        match json.get(at) {
            Some(b',') => at = skip_ws(json, at + 1),
            Some(b'}') => return Some(at + 1),
            _ => return None,
        }
    }
}

/// The text of the plain string key at the start of `json` (see [`object`]).
fn plain_key(json: &[u8]) -> Option<&str> {
    if json.first() != Some(&b'"') {
        return None;
    }
    let len = json[1..].iter().position(|&b| b == b'"')?;
    let key = &json[1..1 + len];
    if key
        .iter()
        .any(|&b| b == b'\\' || !(0x20..0x80).contains(&b))
    {
        return None;
    }
    std::str::from_utf8(key).ok()
}

/// A JSON array at `depth` containers deep: `element(index, rest, depth)` reads each element
/// from the start of `rest` and says how many bytes it took.
pub(crate) fn array<'de>(
    json: &'de [u8],
    depth: usize,
    mut element: impl FnMut(usize, &'de [u8], usize) -> Option<usize>,
) -> Option<usize> {
    if json.first() != Some(&b'[') || depth + 1 >= MAX_DEPTH {
        return None;
    }
    let mut at = skip_ws(json, 1);
    if json.get(at) == Some(&b']') {
        return Some(at + 1);
    }
    for index in 0.. {
        at += element(index, &json[at..], depth + 1)?;
        at = skip_ws(json, at);
        match json.get(at) {
            Some(b',') => at = skip_ws(json, at + 1),
            Some(b']') => return Some(at + 1),
            _ => return None,
        }
    }
    unreachable!("an array has fewer than usize::MAX elements")
}

/// A compact array of token ids, `[` id (`,` id)* `]` with no whitespace (as vLLM, SGLang and
/// llama.cpp write them), each id an integer without leading zeros that fits a `u32`.
/// Anything else is `None` (serde_json then reads it, with the same result it always had).
///
/// Word-at-a-time: eight bytes at once find the commas, and each id's digits are converted
/// from one eight-byte load, so no id waits on the one before it.
pub(crate) fn compact_ids(json: &[u8], depth: usize) -> Read<Vec<u32>> {
    if json.first() != Some(&b'[') || depth + 1 >= MAX_DEPTH {
        return None;
    }
    let body = &json[1..];
    let end = memchr::memchr(b']', body)?;
    let list = &body[..end];
    let taken = end + 2;
    if list.is_empty() {
        return Some((Vec::new(), taken));
    }
    let mut ids = Vec::with_capacity(end / 4 + 1);
    // Validity is gathered, not branched on, to keep the loop free of unpredictable jumps.
    let mut valid = true;
    let mut id = |from: usize, to: usize| {
        let (value, ok) = digits(list, from, to);
        valid &= ok;
        ids.push(value);
    };
    let mut from = 0;
    let mut word_at = 0;
    while let Some(word) = list.get(word_at..word_at + 8) {
        let mut commas =
            byte_positions(u64::from_le_bytes(word.try_into().expect("8 bytes")), b',');
        while commas != 0 {
            let comma = word_at + (commas.trailing_zeros() / 8) as usize;
            commas &= commas - 1;
            id(from, comma);
            from = comma + 1;
        }
        word_at += 8;
    }
    for (comma, _) in list
        .iter()
        .enumerate()
        .skip(word_at)
        .filter(|(_, &b)| b == b',')
    {
        id(from, comma);
        from = comma + 1;
    }
    id(from, list.len());
    valid.then_some((ids, taken))
}

/// The high bit of each byte of `word` that equals `byte`.
fn byte_positions(word: u64, byte: u8) -> u64 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    let x = word ^ (u64::from(byte) * 0x0101_0101_0101_0101);
    // A byte's high bit ends up set iff the byte of `x` is non-zero (no carry crosses bytes).
    let nonzero = ((x & LOW7).wrapping_add(LOW7)) | x;
    !nonzero & !LOW7
}

/// The id written in `list[from..to]`, and whether it is one (1–10 digits, no leading zero,
/// at most `u32::MAX`).
fn digits(list: &[u8], from: usize, to: usize) -> (u32, bool) {
    let len = to - from;
    let leading_zero = len > 1 && list[from] == b'0';
    if (1..=8).contains(&len) {
        if let Some(word) = list.get(from..from + 8) {
            let word = u64::from_le_bytes(word.try_into().expect("8 bytes"));
            let ok = digit_run(word) as usize >= len && !leading_zero;
            return (eight_digits(word, len) as u32, ok);
        }
    }
    if !(1..=10).contains(&len) {
        return (0, false);
    }
    let text = &list[from..to];
    let ok = !leading_zero && text.iter().all(u8::is_ascii_digit);
    let value = text
        .iter()
        .fold(0u64, |v, &b| v * 10 + u64::from(b.wrapping_sub(b'0') % 10));
    match u32::try_from(value) {
        Ok(value) => (value, ok),
        Err(_) => (0, false),
    }
}

/// How many of `word`'s bytes, from the first (lowest), are ASCII digits.
fn digit_run(word: u64) -> u32 {
    let x = word ^ 0x3030_3030_3030_3030;
    // High bit set on a byte that is not a digit; a carry only runs into later bytes, so the
    // first such byte is found exactly.
    let not_digit = (x.wrapping_add(0x7676_7676_7676_7676) | x) & 0x8080_8080_8080_8080;
    not_digit.trailing_zeros() / 8
}

/// The number written by the first `len` (1..=8) bytes of `word`, digits assumed.
fn eight_digits(word: u64, len: usize) -> u64 {
    // Shift the digits to the top, so the missing ones read as leading zeros, then combine
    // pairs, quads and halves (the classic SWAR conversion).
    let v = (word & 0x0F0F_0F0F_0F0F_0F0F) << (8 * (8 - len.clamp(1, 8)));
    let v = (v.wrapping_mul(2561) >> 8) & 0x00FF_00FF_00FF_00FF;
    let v = (v.wrapping_mul(6_553_601) >> 16) & 0x0000_FFFF_0000_FFFF;
    v.wrapping_mul(42_949_672_960_001) >> 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_ids_read_every_length_and_the_edges() {
        for text in [
            "[]",
            "[0]",
            "[7]",
            "[12345678]",
            "[123456789]",
            "[4294967295]",
        ] {
            let expected: Vec<u32> = serde_json::from_str(text).unwrap();
            assert_eq!(
                compact_ids(text.as_bytes(), 0),
                Some((expected, text.len())),
                "{text}"
            );
        }
        let long: Vec<u32> = (0..3000).map(|i| i * 1_431_655).collect();
        let text = serde_json::to_string(&long).unwrap();
        assert_eq!(
            compact_ids(format!("{text},1]").as_bytes(), 0),
            Some((long, text.len()))
        );
    }

    #[test]
    fn compact_ids_leave_everything_else_to_serde() {
        for text in [
            "[4294967296]",
            "[01]",
            "[00]",
            "[1,,2]",
            "[,1]",
            "[1,]",
            "[1 ,2]",
            "[ 1]",
            "[1.0]",
            "[-1]",
            "[-0]",
            "[1e3]",
            "[\"1\"]",
            "[1,[2]]",
            "[1",
            "1",
            "[12345678901]",
            "[1,2a]",
            "[99999999999999999999]",
            "[1,2,3,4,5,6,7,8,9,x]",
        ] {
            assert_eq!(compact_ids(text.as_bytes(), 0), None, "{text}");
        }
    }

    #[test]
    fn object_and_array_walk_members_and_stop_at_their_end() {
        let json = br#"{ "a" : [1,2] , "b":{"c":3}}tail"#;
        let mut seen = Vec::new();
        let n = object(json, 0, |key, rest, depth| {
            let (v, n) = serde_value::<serde_json::Value>(rest, depth)?;
            seen.push((key.to_owned(), v));
            Some(n)
        });
        assert_eq!(n, Some(json.len() - 4));
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[1].1["c"], 3);
        assert_eq!(
            array(b"[1, 2 ,3]", 0, |_, rest, d| serde_value::<u8>(rest, d)
                .map(|v| v.1)),
            Some(9)
        );
        // An escaped key, a trailing comma and a missing colon are serde's to judge.
        for json in [r#"{"\u0061":1}"#, r#"{"a":1,}"#, r#"{"a" 1}"#, r#"{"é":1}"#] {
            assert_eq!(
                object(json.as_bytes(), 0, |_, r, d| {
                    serde_value::<serde_json::Value>(r, d).map(|v| v.1)
                }),
                None,
                "{json}"
            );
        }
    }
}
