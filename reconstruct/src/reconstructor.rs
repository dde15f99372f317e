//! [`Reconstructor`]: many sessions at once, fed record by record in spool order (the worker
//! and local mode), finishing sessions when told or when idle; and a whole spool at once.

use std::collections::HashMap;

use tokentap_schema::{CaptureRecord, SessionReport, Strategy, Trace, TRAJECTORY_SCHEMA_VERSION};

use crate::builder::SessionBuilder;
use crate::error::Error;
use crate::verify::{verify, RecordDigest};

/// A finished session: its traces and its report.
pub struct FinishedSession {
    pub traces: Vec<Trace>,
    pub report: SessionReport,
}

struct OpenSession {
    builder: SessionBuilder,
    digests: HashMap<String, RecordDigest>,
    /// `ended_at_unix_ms` of the latest record.
    last_record_ms: u64,
}

/// Reconstructs many sessions at once from records fed one by one in spool order.
pub struct Reconstructor {
    strategy: Strategy,
    open: HashMap<String, OpenSession>,
    /// Sessions finished before: the index their next trace gets if more records arrive.
    /// The [`FINISHED_SESSIONS_KEPT`] most recent are kept; a session forgotten here that
    /// gets records again numbers its new traces from 0.
    next_index: lru::LruCache<String, u32>,
}

/// Finished sessions whose next trace index is remembered.
pub const FINISHED_SESSIONS_KEPT: usize = 65_536;

impl Reconstructor {
    pub fn new(strategy: Strategy) -> Reconstructor {
        Reconstructor {
            strategy,
            open: HashMap::new(),
            next_index: lru::LruCache::new(
                std::num::NonZeroUsize::new(FINISHED_SESSIONS_KEPT).expect("non-zero"),
            ),
        }
    }

    /// Declares that `session` was finished earlier with traces up to `next_index - 1`
    /// (after a restart), so late records continue its numbering.
    pub fn continue_session(&mut self, session_id: &str, next_index: u32) {
        self.next_index.put(session_id.to_owned(), next_index);
    }

    pub fn push(&mut self, r: &CaptureRecord) {
        let s = self
            .open
            .entry(r.session_id.clone())
            .or_insert_with(|| OpenSession {
                builder: SessionBuilder::continuing(
                    &r.session_id,
                    self.strategy,
                    self.next_index.peek(&r.session_id).copied().unwrap_or(0),
                ),
                digests: HashMap::new(),
                last_record_ms: 0,
            });
        s.builder.push(r);
        s.digests
            .entry(r.record_id.clone())
            .or_insert_with(|| RecordDigest::of(r));
        s.last_record_ms = s.last_record_ms.max(r.ended_at_unix_ms);
    }

    pub fn open_sessions(&self) -> usize {
        self.open.len()
    }

    /// Tokens held by open chains, over all open sessions.
    pub fn open_tokens(&self) -> usize {
        self.open.values().map(|s| s.builder.open_tokens()).sum()
    }

    /// Heap bytes held by open sessions (see [`SessionBuilder::held_bytes`]), with the
    /// per-record digests kept for the faithfulness check.
    pub fn held_bytes(&self) -> usize {
        self.open
            .values()
            .map(|s| {
                s.builder.held_bytes()
                    + s.digests
                        .keys()
                        .map(|k| k.capacity() + std::mem::size_of::<RecordDigest>() + 48)
                        .sum::<usize>()
            })
            .sum()
    }

    /// Finishes the sessions whose latest record ended before `before_unix_ms`.
    pub fn finish_idle(&mut self, before_unix_ms: u64) -> Vec<FinishedSession> {
        let idle: Vec<String> = self
            .open
            .iter()
            .filter(|(_, s)| s.last_record_ms < before_unix_ms)
            .map(|(id, _)| id.clone())
            .collect();
        let mut out: Vec<FinishedSession> = idle.iter().filter_map(|id| self.finish(id)).collect();
        out.sort_by(|a, b| a.report.session_id.cmp(&b.report.session_id));
        out
    }

    /// Finishes every open session.
    pub fn finish_all(&mut self) -> Vec<FinishedSession> {
        self.finish_idle(u64::MAX)
    }

    /// Finishes one session, if open.
    pub fn finish(&mut self, session_id: &str) -> Option<FinishedSession> {
        let s = self.open.remove(session_id)?;
        let built = s.builder.finish();
        if let Some(last) = built.traces.iter().map(|t| t.index).max() {
            self.next_index.put(session_id.to_owned(), last + 1);
        }
        let faithfulness = verify(&built.traces, &s.digests);
        Some(FinishedSession {
            report: SessionReport {
                schema_version: TRAJECTORY_SCHEMA_VERSION,
                session_id: built.session_id,
                strategy: built.strategy,
                stats: built.stats,
                faithfulness,
                split_points: built.split_points,
            },
            traces: built.traces,
        })
    }
}

/// Offline: every record of a spool directory, reconstructed; sessions finish at the end.
pub fn reconstruct_spool(
    spool: &std::path::Path,
    strategy: Strategy,
) -> Result<(Vec<FinishedSession>, SpoolReadStats), Error> {
    let mut r = Reconstructor::new(strategy);
    let mut stats = SpoolReadStats::default();
    for item in tokentap_spool::SpoolReader::open(spool)? {
        match item? {
            tokentap_spool::SpoolItem::Record(e) => {
                stats.records += 1;
                r.push(&e.record);
            }
            _ => stats.unreadable += 1,
        }
    }
    Ok((r.finish_all(), stats))
}

/// What reading a spool found.
#[derive(Debug, Default, Clone, Copy)]
pub struct SpoolReadStats {
    pub records: u64,
    /// Corrupt or torn lines, skipped.
    pub unreadable: u64,
}
