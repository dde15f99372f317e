//! tokentap's durable local spool: every [`CaptureRecord`] the proxy captures, appended as one
//! NDJSON line to segment files in a directory, and read back in order.
//!
//! ```text
//! DIR/spool.lock                              advisory lock held by the one writer
//! DIR/segment-00000000000000000000.ndjson     one CaptureRecord per `\n`-terminated line
//! DIR/segment-00000000000000000001.ndjson     started when the previous one reached the size limit
//! ```
//!
//! - [`SpoolWriter`]: the single writer (sync std::fs, for a dedicated thread): append, group
//!   commit, segment rolling, fsync per [`FsyncPolicy`], torn-tail repair on open.
//! - [`SpoolReader`]: streaming reader, resumable from a [`SpoolPosition`], with a follow mode.
//! - [`tail`], [`find`], [`stats`]: one-shot queries for the CLI.
//! - [`Handoff`]: records a process just appended, passed decoded to its own reader.
//!
//! Invariant everything relies on: a line is a record only once its `\n` is written. A crash
//! can leave at most one unterminated line, at the end of the last segment; readers report it
//! as [`SpoolItem::Torn`] and never parse it, and the next writer truncates it.
//!
//! The directory is `0700` and its files `0600` ([`owner_only`]): records hold prompts, tool
//! output and sometimes secrets.
//!
//! One writer per directory (enforced by a `flock` on `spool.lock`, so a second
//! [`SpoolWriter::open`] fails with [`SpoolError::Locked`]); readers never lock.

mod cursor;
pub mod downstream;
mod error;
mod fsync;
mod handoff;
mod lock;
pub mod owner_only;
mod query;
mod reader;
mod recovery;
pub mod segment;
mod writer;

pub use error::SpoolError;
pub use fsync::{parse_duration, FsyncPolicy, ParseFsyncPolicyError};
pub use handoff::{Handoff, HandoffStats};
pub use lock::LOCK_FILE_NAME;
pub use query::{bytes_after, find, read_lines, stats, tail, SpoolStats};
pub use reader::{LineAt, SpoolEntry, SpoolItem, SpoolPosition, SpoolReader};
pub use writer::{
    SpoolConfig, SpoolWriter, DEFAULT_PAGE_CACHE_KEEP_BYTES, DEFAULT_SEGMENT_MAX_BYTES,
};

#[doc(no_inline)]
pub use tokentap_schema::CaptureRecord;
