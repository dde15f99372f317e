//! The one error type of the crate.

use std::io;
use std::path::PathBuf;

/// Anything that can go wrong opening, writing or reading a spool. Messages name the path.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// An I/O call failed; `op` says what we were doing (e.g. `fsync`, `open segment`).
    #[error("cannot {op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another writer holds `spool.lock`: a spool has exactly one writer.
    #[error(
        "spool {} is already open for writing by another process or writer (lock file {} is held)",
        dir.display(),
        lock.display()
    )]
    Locked { dir: PathBuf, lock: PathBuf },
    /// A record could not be serialized (cannot happen for well-formed records; reported rather
    /// than panicking because `serde_json::Value` fields come from the outside).
    #[error("cannot serialize record {record_id} for spool {}: {source}", dir.display())]
    Serialize {
        dir: PathBuf,
        record_id: String,
        #[source]
        source: serde_json::Error,
    },
    /// A line given to `SpoolWriter::append_encoded_at` holds a newline (it would be read as
    /// two lines); nothing of its batch was written.
    #[error("line {index} of a batch for spool {} holds a newline: not one record's line", dir.display())]
    NotOneLine { dir: PathBuf, index: usize },
    /// `SpoolReader::open_at` was given a position that is not the start of a line.
    #[error("invalid spool position {segment}:{offset} in {}: {reason}", dir.display())]
    InvalidPosition {
        dir: PathBuf,
        segment: u64,
        offset: u64,
        reason: &'static str,
    },
    /// A record id prefix matched several records.
    #[error(
        "record id prefix `{prefix}` in {} is ambiguous: it matches {total} records ({}{})",
        dir.display(),
        candidates.join(", "),
        if *total > candidates.len() { ", ..." } else { "" }
    )]
    AmbiguousRecordId {
        dir: PathBuf,
        prefix: String,
        /// The first few matching ids.
        candidates: Vec<String>,
        /// How many distinct ids matched.
        total: usize,
    },
}

impl SpoolError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| SpoolError::Io { op, path, source }
    }
}
