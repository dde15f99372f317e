//! Segment file naming and discovery.
//!
//! Names carry a 20-digit zero-padded sequence number (the width of `u64::MAX`) so that a
//! lexical sort (`ls`, shell globs) is also the write order.

use std::fs;
use std::path::{Path, PathBuf};

use crate::SpoolError;

const PREFIX: &str = "segment-";
const SUFFIX: &str = ".ndjson";
const DIGITS: usize = 20;

/// File name of segment `seq`, e.g. `segment-00000000000000000007.ndjson`.
pub fn segment_file_name(seq: u64) -> String {
    format!("{PREFIX}{seq:0DIGITS$}{SUFFIX}")
}

/// Path of segment `seq` inside `dir`.
pub fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(segment_file_name(seq))
}

/// The sequence number of a segment file name; `None` for anything else in the directory
/// (the lock file, editor backups, files of other tools).
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.len() != DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Sequence numbers of all segments in `dir`, ascending.
pub fn list_segments(dir: &Path) -> Result<Vec<u64>, SpoolError> {
    let entries = fs::read_dir(dir).map_err(SpoolError::io("read spool directory", dir))?;
    let mut seqs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(SpoolError::io("read spool directory", dir))?;
        if let Some(seq) = entry.file_name().to_str().and_then(parse_segment_file_name) {
            seqs.push(seq);
        }
    }
    seqs.sort_unstable();
    Ok(seqs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sort() {
        assert_eq!(segment_file_name(7), "segment-00000000000000000007.ndjson");
        assert_eq!(
            segment_file_name(u64::MAX).len(),
            PREFIX.len() + DIGITS + SUFFIX.len()
        );
        for seq in [0, 1, 42, u64::MAX] {
            assert_eq!(parse_segment_file_name(&segment_file_name(seq)), Some(seq));
        }
        assert!(segment_file_name(9) < segment_file_name(10));
    }

    #[test]
    fn foreign_names_are_ignored() {
        for name in [
            "spool.lock",
            "segment-1.ndjson",
            "segment-0000000000000000000a.ndjson",
            "segment-00000000000000000001.ndjson.tmp",
            "segment-99999999999999999999.ndjson", // overflows u64
        ] {
            assert_eq!(parse_segment_file_name(name), None, "{name}");
        }
    }
}
