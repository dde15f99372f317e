//! The spool's calls, grouped by session: read once, then only what was appended since, so a
//! page over a spool that is still being written stays current without re-reading it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use tokentap_schema::CaptureRecord;
use tokentap_spool::{SpoolError, SpoolItem, SpoolPosition, SpoolReader};

/// One call as the session list and the timeline show it (the whole record is fetched on
/// demand from its spool position).
#[derive(Debug, Clone, Serialize)]
pub struct CallSummary {
    pub record_id: String,
    pub seq: u64,
    pub started_at_unix_ms: u64,
    pub ended_at_unix_ms: u64,
    pub wire_api: &'static str,
    pub model: String,
    pub status: u16,
    pub prompt_tokens: Option<usize>,
    pub completion_tokens: Option<usize>,
    /// Whether the record holds prompt ids, sampled ids and their logprobs.
    pub token_data: bool,
    pub time_to_first_token_ms: Option<f64>,
    pub backend_ms: f64,
    pub proxy_overhead_ms: f64,
    pub finish_reason: Option<String>,
    pub error: Option<&'static str>,
    #[serde(skip)]
    position: SpoolPosition,
}

impl CallSummary {
    fn of(r: &CaptureRecord, position: SpoolPosition) -> CallSummary {
        CallSummary {
            record_id: r.record_id.clone(),
            seq: r.seq,
            started_at_unix_ms: r.started_at_unix_ms,
            ended_at_unix_ms: r.ended_at_unix_ms,
            wire_api: r.wire_api.as_str(),
            model: r.backend.model.clone(),
            status: r.response_status,
            prompt_tokens: r.prompt_token_ids.as_ref().map(Vec::len),
            completion_tokens: r.completion_token_ids.as_ref().map(Vec::len),
            token_data: r.prompt_token_ids.is_some()
                && r.completion_token_ids.is_some()
                && r.logprobs.is_some(),
            time_to_first_token_ms: r.timings.time_to_first_token_ms,
            backend_ms: r.timings.backend_ms,
            proxy_overhead_ms: r.timings.proxy_overhead_ms,
            finish_reason: r.finish_reason.map(|f| f.as_openai().to_owned()),
            error: r.error.as_ref().map(|e| e.kind.as_str()),
            position,
        }
    }
}

/// A session as the session list shows it.
#[derive(Debug, Clone, Serialize)]
pub struct SessionSummary {
    pub session_id: String,
    pub calls: usize,
    pub first_started_at_unix_ms: u64,
    pub last_ended_at_unix_ms: u64,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub errors: usize,
    /// Time the engine spent on the session's calls (their backend time), in ms.
    pub engine_ms: f64,
    /// Time between one call's end and the next call's start, when no call was running: the
    /// harness's and its tools' time, in ms.
    pub harness_ms: f64,
}

impl SessionSummary {
    /// A session known only from its traces (its calls are not in this spool).
    pub fn empty(session_id: &str) -> SessionSummary {
        SessionSummary::of(session_id, &[])
    }

    fn of(session_id: &str, calls: &[CallSummary]) -> SessionSummary {
        let mut s = SessionSummary {
            session_id: session_id.to_owned(),
            calls: calls.len(),
            first_started_at_unix_ms: calls.first().map_or(0, |c| c.started_at_unix_ms),
            last_ended_at_unix_ms: 0,
            prompt_tokens: 0,
            completion_tokens: 0,
            errors: 0,
            engine_ms: 0.0,
            harness_ms: 0.0,
        };
        for c in calls {
            s.prompt_tokens += c.prompt_tokens.unwrap_or(0);
            s.completion_tokens += c.completion_tokens.unwrap_or(0);
            s.errors += usize::from(c.error.is_some());
            s.engine_ms += c.backend_ms;
            // Calls are kept in start order; a gap exists only past every earlier call's end.
            if s.last_ended_at_unix_ms > 0 && c.started_at_unix_ms > s.last_ended_at_unix_ms {
                s.harness_ms += (c.started_at_unix_ms - s.last_ended_at_unix_ms) as f64;
            }
            s.last_ended_at_unix_ms = s.last_ended_at_unix_ms.max(c.ended_at_unix_ms);
        }
        s
    }
}

/// Every call read so far, by session.
pub struct SpoolCalls {
    dir: PathBuf,
    reader: Option<SpoolReader>,
    sessions: HashMap<String, Vec<CallSummary>>,
    /// record id → (session, index in its calls)
    records: HashMap<String, (String, usize)>,
    /// Lines that were not records (skipped, as every reader of the spool does).
    pub corrupt_lines: u64,
}

impl SpoolCalls {
    pub fn new(dir: &Path) -> SpoolCalls {
        SpoolCalls {
            dir: dir.to_owned(),
            reader: None,
            sessions: HashMap::new(),
            records: HashMap::new(),
            corrupt_lines: 0,
        }
    }

    /// Reads what was appended since the last call. A spool that does not exist yet is empty.
    pub fn refresh(&mut self) -> Result<(), SpoolError> {
        if self.reader.is_none() {
            if !self.dir.is_dir() {
                return Ok(());
            }
            self.reader = Some(SpoolReader::open(&self.dir)?);
        }
        let reader = self.reader.as_mut().expect("opened above");
        while let Some(item) = reader.next_available()? {
            match item {
                SpoolItem::Record(e) => {
                    // A redelivered record (same id) is one call.
                    if self.records.contains_key(&e.record.record_id) {
                        continue;
                    }
                    let calls = self
                        .sessions
                        .entry(e.record.session_id.clone())
                        .or_default();
                    let call = CallSummary::of(&e.record, e.position);
                    // Keep start order: concurrent calls of a session end (and are written)
                    // out of the order they started in.
                    let at = calls.partition_point(|c| {
                        (c.started_at_unix_ms, c.seq) <= (call.started_at_unix_ms, call.seq)
                    });
                    calls.insert(at, call);
                    for (i, c) in calls.iter().enumerate().skip(at) {
                        self.records
                            .insert(c.record_id.clone(), (e.record.session_id.clone(), i));
                    }
                }
                SpoolItem::Corrupt { .. } => self.corrupt_lines += 1,
                SpoolItem::Torn { .. } => {}
            }
        }
        Ok(())
    }

    pub fn sessions(&self) -> impl Iterator<Item = SessionSummary> + '_ {
        self.sessions
            .iter()
            .map(|(id, calls)| SessionSummary::of(id, calls))
    }

    pub fn session(&self, id: &str) -> Option<(SessionSummary, &[CallSummary])> {
        let calls = self.sessions.get(id)?;
        Some((SessionSummary::of(id, calls), calls))
    }

    /// The whole record, read back from the spool; `Ok(None)` if unknown or no longer there
    /// (a shipper deletes segments once the worker has them).
    pub fn record(&self, id: &str) -> Result<Option<CaptureRecord>, SpoolError> {
        let Some((session, i)) = self.records.get(id) else {
            return Ok(None);
        };
        let position = self.sessions[session][*i].position;
        match SpoolReader::open_at(&self.dir, position)?.next() {
            Some(Ok(SpoolItem::Record(e)))
                if e.position == position && e.record.record_id == id =>
            {
                Ok(Some(e.record))
            }
            _ => Ok(None),
        }
    }
}
