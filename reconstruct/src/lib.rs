//! tokentap's reconstruction: capture records in, token-faithful traces out.
//!
//! - [`builder`]: one session's records → traces (`per-request` or `prefix-merge`).
//! - [`verify`]: the faithfulness check of traces against their records.
//! - [`Reconstructor`]: many sessions at once, fed record by record (the worker and local
//!   mode), finishing sessions when told or when idle.
//! - [`live`]: following a spool as it grows, with checkpoints (worker and local mode).
//! - [`output`]: JSONL and Parquet files.
//! - [`show`]: traces as text for people, mask runs made visible.
//! - [`synthetic`]: made-up sessions for benchmarks and tests.

pub mod builder;
pub mod error;
pub mod live;
pub mod output;
pub mod recent;
pub mod reconstructor;
pub mod show;
pub mod synthetic;
pub mod verify;

pub use builder::{build_all, SessionBuilder, SessionTraces};
pub use error::Error;
pub use live::{LiveOptions, LiveReconstructor, LiveStats};
pub use output::{EncodedTraces, SinkMark, TraceSink};
pub use recent::RecentIds;
pub use reconstructor::{reconstruct_spool, FinishedSession, Reconstructor, SpoolReadStats};
pub use verify::{verify, RecordDigest};
