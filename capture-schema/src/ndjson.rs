//! NDJSON framing: one JSON value per line, `\n`-terminated.
//!
//! A line is complete only when its terminating newline is present; a reader treats an
//! unterminated last line as torn (a writer died mid-append) and never parses it.

use serde::{de::DeserializeOwned, Serialize};

/// Appends `value` as one NDJSON line (JSON has no raw newlines, so the line is unambiguous).
pub fn encode_line<T: Serialize>(value: &T, out: &mut Vec<u8>) -> serde_json::Result<()> {
    serde_json::to_writer(&mut *out, value)?;
    out.push(b'\n');
    Ok(())
}

/// One line found in an NDJSON buffer.
#[derive(Debug, PartialEq)]
pub enum Line<'a> {
    /// A complete line (without its newline) starting at `offset`.
    Complete { offset: usize, bytes: &'a [u8] },
    /// Bytes after the last newline: a record still being written or torn by a crash.
    Torn { offset: usize, bytes: &'a [u8] },
}

/// Splits a buffer into lines, reporting an unterminated tail as [`Line::Torn`].
pub fn split_lines(buf: &[u8]) -> impl Iterator<Item = Line<'_>> {
    let mut pos = 0;
    std::iter::from_fn(move || {
        if pos >= buf.len() {
            return None;
        }
        let start = pos;
        match buf[start..].iter().position(|&b| b == b'\n') {
            Some(n) => {
                pos = start + n + 1;
                Some(Line::Complete {
                    offset: start,
                    bytes: &buf[start..start + n],
                })
            }
            None => {
                pos = buf.len();
                Some(Line::Torn {
                    offset: start,
                    bytes: &buf[start..],
                })
            }
        }
    })
}

/// Parses one complete line.
pub fn decode_line<T: DeserializeOwned>(line: &[u8]) -> serde_json::Result<T> {
    serde_json::from_slice(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any prefix of a sequence of encoded lines yields exactly the values whose newline
        /// made it, plus at most one torn tail: a crash mid-write never corrupts earlier lines.
        #[test]
        fn truncation_never_breaks_complete_lines(values in proptest::collection::vec(any::<(String, u32)>(), 0..20), cut in any::<prop::sample::Index>()) {
            let mut buf = Vec::new();
            let mut ends = Vec::new();
            for v in &values {
                encode_line(v, &mut buf).unwrap();
                ends.push(buf.len());
            }
            let cut = if buf.is_empty() { 0 } else { cut.index(buf.len() + 1) };
            let prefix = &buf[..cut];
            let mut complete = Vec::new();
            let mut torn = 0;
            for line in split_lines(prefix) {
                match line {
                    Line::Complete { bytes, .. } => complete.push(decode_line::<(String, u32)>(bytes).unwrap()),
                    Line::Torn { .. } => torn += 1,
                }
            }
            let expected = ends.iter().filter(|&&e| e <= cut).count();
            prop_assert_eq!(&complete[..], &values[..expected]);
            prop_assert!(torn <= 1);
            prop_assert_eq!(torn == 1, cut > 0 && !ends.contains(&cut));
        }
    }
}
