//! Building one call's capture record, and handing records to the spool without making the
//! harness wait on the disk.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokentap_schema::{
    BackendInfo, CaptureError, CaptureRecord, ChatRequest, HarnessRequest, Normalization,
    TokenField, TokenGap, TokenProvenance, TokenSource, WireApi, CAPTURE_SCHEMA_VERSION,
};
use tokentap_spool::SpoolWriter;
use tokio::sync::{mpsc, oneshot};

use crate::canonical::GenerationAccumulator;
use crate::metrics::Metrics;
use crate::session::Session;
use crate::wire::CallError;

/// What is known about a call while it runs; becomes its [`CaptureRecord`] at the end.
pub struct CallCapture {
    pub record_id: String,
    pub arrived: Instant,
    pub started_at: SystemTime,
    pub wire_api: WireApi,
    pub session: Option<(Session, u64)>,
    pub request: HarnessRequest,
    pub backend_request: Option<ChatRequest>,
    pub normalizations: Vec<Normalization>,
    pub backend: BackendInfo,
    pub generation: GenerationAccumulator,
    /// Time spent awaiting the backend.
    pub backend_time: Duration,
    pub first_content_at: Option<Instant>,
    pub response_status: u16,
    pub error: Option<CallError>,
    /// The record was already taken ([`CallCapture::take_record`]) and sent.
    pub committed: bool,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl CallCapture {
    /// A call that has just arrived: nothing generated, nothing answered yet.
    pub fn new(wire_api: WireApi, request: HarnessRequest, backend: BackendInfo) -> CallCapture {
        CallCapture {
            record_id: uuid::Uuid::now_v7().to_string(),
            arrived: Instant::now(),
            started_at: SystemTime::now(),
            wire_api,
            session: None,
            request,
            backend_request: None,
            normalizations: Vec::new(),
            backend,
            generation: GenerationAccumulator::default(),
            backend_time: Duration::ZERO,
            first_content_at: None,
            response_status: 0,
            error: None,
            committed: false,
        }
    }

    /// The record of the call as it stands, leaving a committed husk behind: for durable
    /// answers, whose record is written before the harness gets the answer's last bytes.
    pub fn take_record(&mut self) -> CaptureRecord {
        let mut husk = CallCapture::new(
            self.wire_api,
            HarnessRequest::bare(&self.request.method, &self.request.path),
            self.backend.clone(),
        );
        husk.committed = true;
        std::mem::replace(self, husk).into_record()
    }

    /// Turns the call into its record. Token data is taken only from engine events; whatever
    /// is missing is listed as a gap.
    pub fn into_record(self) -> CaptureRecord {
        let total = self.arrived.elapsed();
        let g = self.generation;
        let mut gaps = g.gaps.clone();
        let message = g.message();
        let (prompt_token_ids, prompt_source) = match g.prompt {
            Some((ids, source)) => (Some(ids), source),
            None => {
                if self.backend_request.is_some()
                    && !gaps.iter().any(|x| x.field == TokenField::PromptTokenIds)
                {
                    gaps.push(TokenGap {
                        field: TokenField::PromptTokenIds,
                        reason: "the call ended before prompt ids were obtained".into(),
                    });
                }
                (None, TokenSource::Unavailable)
            }
        };
        let (completion_token_ids, completion_source, logprobs) = if g.saw_sampled_tokens {
            let all_logprobs: Option<Vec<f32>> = g.logprobs.iter().copied().collect();
            let logprobs = match all_logprobs {
                Some(lp) if lp.len() == g.completion_ids.len() => Some(lp),
                _ => {
                    let missing = g.logprobs.iter().filter(|x| x.is_none()).count()
                        + g.completion_ids.len().saturating_sub(g.logprobs.len());
                    gaps.push(TokenGap {
                        field: TokenField::Logprobs,
                        reason: format!(
                            "the engine sent no logprob for {missing} of {} sampled tokens",
                            g.completion_ids.len()
                        ),
                    });
                    None
                }
            };
            (
                Some(g.completion_ids.clone()),
                TokenSource::EngineResponse,
                logprobs,
            )
        } else {
            if g.finish.is_some()
                && !gaps
                    .iter()
                    .any(|x| x.field == TokenField::CompletionTokenIds)
            {
                gaps.push(TokenGap {
                    field: TokenField::CompletionTokenIds,
                    reason: "the engine returned no sampled token ids".into(),
                });
            }
            (None, TokenSource::Unavailable, None)
        };
        let (finish_reason, usage) = match g.finish {
            Some((f, u)) => (Some(f), u),
            None if g.started => (Some(tokentap_schema::FinishReason::Abort), None),
            None => (None, None),
        };
        let (session_id, session_source, seq) = match self.session {
            Some((s, seq)) => (s.id, s.source, seq),
            None => (
                format!("unattributed-{}", self.record_id),
                tokentap_schema::SessionSource::Generated,
                0,
            ),
        };
        let backend_ms = ms(self.backend_time);
        let total_ms = ms(total);
        CaptureRecord {
            schema_version: CAPTURE_SCHEMA_VERSION,
            record_id: self.record_id,
            session_id,
            session_source,
            seq,
            started_at_unix_ms: unix_ms(self.started_at),
            ended_at_unix_ms: unix_ms(self.started_at + total),
            wire_api: self.wire_api,
            request: self.request,
            // Fields passed through to the engine as given are redacted like a body; the
            // conversation and tools stay as sent (what the prompt ids encode).
            backend_request: self.backend_request.map(crate::redact::recorded_request),
            normalizations: self.normalizations,
            backend: self.backend,
            prompt_token_ids,
            completion_token_ids,
            logprobs,
            token_provenance: TokenProvenance {
                prompt: prompt_source,
                completion: completion_source,
                gaps,
            },
            finish_reason,
            message,
            usage,
            timings: tokentap_schema::Timings {
                time_to_first_token_ms: self.first_content_at.map(|t| ms(t - self.arrived)),
                total_ms,
                backend_ms,
                proxy_overhead_ms: (total_ms - backend_ms).max(0.0),
            },
            response_status: self.response_status,
            error: self.error.map(|e| CaptureError {
                kind: e.kind,
                message: e.message,
                backend_status: e.backend_status,
            }),
        }
    }
}

/// Called by the spool writer with each batch it has appended.
pub type RecordObserver = Box<dyn FnMut(&[CaptureRecord]) + Send>;

/// A record on its way to the spool writer, with whom to tell once it is written.
pub struct Queued {
    record: CaptureRecord,
    /// Told `true` once the record is appended (and synced, per the fsync policy), `false` if
    /// it could not be.
    written: Option<oneshot::Sender<bool>>,
}

/// Where finished records go.
#[derive(Clone)]
pub enum RecordSink {
    /// To the spool writer thread.
    Spool(mpsc::Sender<Queued>),
    /// Nowhere (capture off; for measuring the proxy without it).
    Discard,
}

/// Records waiting for the spool writer; beyond this the request path waits (backpressure)
/// rather than dropping records.
const SINK_QUEUE: usize = 8192;
/// Records written with one write and one fsync.
const MAX_BATCH: usize = 256;

impl RecordSink {
    /// Starts the spool writer thread. Dropping every sender drains the queue, syncs the spool
    /// and ends the thread; join the handle to wait for that.
    pub fn spool(writer: SpoolWriter, metrics: Arc<Metrics>) -> (RecordSink, JoinHandle<()>) {
        RecordSink::spool_observed(writer, metrics, None)
    }

    /// Like [`RecordSink::spool`], and `observer` sees every batch once it is appended (a
    /// rollout node indexes its samples' records this way instead of re-reading the spool).
    pub fn spool_observed(
        mut writer: SpoolWriter,
        metrics: Arc<Metrics>,
        mut observer: Option<RecordObserver>,
    ) -> (RecordSink, JoinHandle<()>) {
        let (tx, mut rx) = mpsc::channel::<Queued>(SINK_QUEUE);
        metrics.spool_bytes.set(writer.total_bytes() as i64);
        let handle = std::thread::Builder::new()
            .name("tokentap-spool".into())
            .spawn(move || {
                // A private single-thread runtime only to wait on the queue with a deadline:
                // the interval fsync policy must sync even when no new record arrives.
                let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("spool writer runtime");
                rt.block_on(async move {
                    let mut batch = Vec::with_capacity(MAX_BATCH);
                    let mut waiting: Vec<oneshot::Sender<bool>> = Vec::new();
                    loop {
                        let next = match writer.sync_deadline() {
                            Some(deadline) => match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
                                Ok(next) => next,
                                Err(_) => {
                                    if let Err(e) = writer.sync_if_due() {
                                        tracing::error!(error = %e, "spool sync failed");
                                    }
                                    continue;
                                }
                            },
                            None => rx.recv().await,
                        };
                        let Some(first) = next else { break };
                        let mut next = Some(first);
                        while let Some(q) = next.take() {
                            batch.push(q.record);
                            waiting.extend(q.written);
                            if batch.len() < MAX_BATCH {
                                next = rx.try_recv().ok();
                            }
                        }
                        let written = match writer.append_batch(&batch) {
                            Ok(_) => {
                                metrics.records_written.inc_by(batch.len() as u64);
                                if let Some(observe) = observer.as_mut() {
                                    observe(&batch);
                                }
                                true
                            }
                            Err(e) => {
                                tracing::error!(error = %e, records = batch.len(), "spool append failed; records lost");
                                metrics.spool_write_errors.inc();
                                metrics.records_lost.inc_by(batch.len() as u64);
                                false
                            }
                        };
                        for w in waiting.drain(..) {
                            let _ = w.send(written);
                        }
                        metrics.spool_bytes.set(writer.total_bytes() as i64);
                        batch.clear();
                    }
                    if let Err(e) = writer.sync() {
                        tracing::error!(error = %e, "final spool sync failed");
                    }
                });
            })
            .expect("spawning the spool writer thread");
        (RecordSink::Spool(tx), handle)
    }

    /// Hands `record` to the spool writer and returns at once.
    pub async fn send(&self, record: CaptureRecord, metrics: &Metrics) {
        if let RecordSink::Spool(tx) = self {
            let queued = Queued {
                record,
                written: None,
            };
            if tx.send(queued).await.is_err() {
                tracing::error!("spool writer is gone; record lost");
                metrics.records_lost.inc();
            }
        }
    }

    /// Hands `record` to the spool writer and waits until it is written (appended, and synced
    /// per the fsync policy: on disk under `always`). Whether it was; a record that could not
    /// be written is counted lost by the writer.
    pub async fn commit(&self, record: CaptureRecord, metrics: &Metrics) -> bool {
        let RecordSink::Spool(tx) = self else {
            return true;
        };
        let (written, told) = oneshot::channel();
        let queued = Queued {
            record,
            written: Some(written),
        };
        if tx.send(queued).await.is_err() {
            tracing::error!("spool writer is gone; record lost");
            metrics.records_lost.inc();
            return false;
        }
        told.await.unwrap_or(false)
    }
}
