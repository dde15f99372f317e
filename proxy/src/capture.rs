//! Building one call's capture record, and handing records to the spool without making the
//! harness wait on the disk.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokentap_schema::{
    BackendInfo, CaptureError, CaptureRecord, ChatRequest, ConversationSource, HarnessRequest,
    Normalization, TokenField, TokenGap, TokenProvenance, TokenSource, WireApi,
    CAPTURE_SCHEMA_VERSION,
};
use tokentap_spool::{SpoolError, SpoolWriter};
use tokio::sync::{mpsc, oneshot};

use crate::harness::Harness;
use crate::metrics::Metrics;
use crate::session::Session;
use tokentap_wire::canonical::GenerationAccumulator;
use tokentap_wire::CallError;

/// What is known about a call while it runs; becomes its [`CaptureRecord`] at the end.
pub struct CallCapture {
    pub record_id: String,
    pub arrived: Instant,
    pub started_at: SystemTime,
    pub wire_api: WireApi,
    pub session: Option<(Session, u64)>,
    pub request: HarnessRequest,
    pub backend_request: Option<ChatRequest>,
    /// `request.body` is the harness's own bytes: the record need not keep the conversation
    /// a second time in `backend_request` (see [`tokentap_wire::replay`]).
    pub body_verbatim: bool,
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
    /// For the metrics, not the record: the harness (from the request's headers, or as the
    /// admission gate knows it; `None` before the session is known), and whether the
    /// session's activity counts this call (`SessionActivity::begin` was called).
    pub harness: Option<Harness>,
    pub in_activity: bool,
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
            body_verbatim: false,
            normalizations: Vec::new(),
            backend,
            generation: GenerationAccumulator::default(),
            backend_time: Duration::ZERO,
            first_content_at: None,
            response_status: 0,
            error: None,
            committed: false,
            harness: None,
            in_activity: false,
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
        let mut backend_request = self.backend_request;
        let mut backend_conversation = ConversationSource::Recorded;
        if let (Some(r), true) = (&mut backend_request, self.body_verbatim) {
            r.messages = Vec::new();
            r.tools = Vec::new();
            backend_conversation = ConversationSource::HarnessBody;
        }
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
            // conversation and tools stay as sent (what the prompt ids encode), in the harness
            // body when that is kept byte for byte, else here.
            backend_request: backend_request.map(crate::redact::recorded_request),
            backend_conversation,
            normalizations: self.normalizations,
            backend: BackendInfo {
                engine_weight_version: g.engine_weight_version.clone(),
                ..self.backend
            },
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
            token_observation: None,
            token_in: g.token_in,
        }
    }
}

/// Called by the spool writer with each batch it has appended, and where each record's line is.
pub type RecordObserver = Box<dyn FnMut(&[CaptureRecord], &[tokentap_spool::LineAt]) + Send>;

/// What the proxy does while its spool cannot be written (disk full, read-only file system,
/// I/O errors): `--on-spool-error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnSpoolError {
    /// Keep every record in memory and retry until the spool takes it; meanwhile refuse new
    /// calls (a provider-shaped 503 naming the cause, before the engine is called), so that
    /// every answered call ends up in the data exactly once. The default: the data is the
    /// product.
    #[default]
    FailClosed,
    /// Keep answering; records that cannot be written are dropped and counted in
    /// `tokentap_records_lost_total`. For serving harnesses when capture is best effort.
    FailOpen,
}

impl std::str::FromStr for OnSpoolError {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fail-closed" | "closed" => Ok(OnSpoolError::FailClosed),
            "fail-open" | "open" => Ok(OnSpoolError::FailOpen),
            _ => Err(format!(
                "invalid spool error policy `{s}`: expected `fail-closed` (refuse calls until the spool is writable) or `fail-open` (answer, count records lost)"
            )),
        }
    }
}

impl std::fmt::Display for OnSpoolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OnSpoolError::FailClosed => "fail-closed",
            OnSpoolError::FailOpen => "fail-open",
        })
    }
}

/// Whether the spool is taking records, shared by the writer thread (which sets it) and the
/// request path (which reads it once per call, before the engine).
#[derive(Debug)]
pub struct SpoolHealth {
    policy: OnSpoolError,
    failing: AtomicBool,
    /// Why the last append failed (the OS's words, e.g. "No space left on device (os error
    /// 28)"); meaningful while `failing`.
    cause: Mutex<String>,
}

impl SpoolHealth {
    pub fn new(policy: OnSpoolError) -> SpoolHealth {
        SpoolHealth {
            policy,
            failing: AtomicBool::new(false),
            cause: Mutex::new(String::new()),
        }
    }

    pub fn policy(&self) -> OnSpoolError {
        self.policy
    }

    /// Whether the last append succeeded (or none failed yet).
    pub fn writable(&self) -> bool {
        !self.failing.load(Ordering::Acquire)
    }

    /// Why new calls must be refused now: the cause of the spool's failure, under
    /// `fail-closed` while it lasts; `None` otherwise.
    pub fn refusal(&self) -> Option<String> {
        if self.policy == OnSpoolError::FailOpen || self.writable() {
            return None;
        }
        Some(self.cause.lock().map(|c| c.clone()).unwrap_or_default())
    }

    fn set_failing(&self, cause: String) {
        if let Ok(mut c) = self.cause.lock() {
            *c = cause;
        }
        self.failing.store(true, Ordering::Release);
    }

    fn set_writable(&self) {
        self.failing.store(false, Ordering::Release);
    }
}

/// The OS's own words for why the spool failed, without the spool's path (the cause is shown
/// to harnesses in refusals; the logs have the path).
fn spool_error_cause(e: &SpoolError) -> String {
    match e {
        SpoolError::Io { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

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
    Spool(mpsc::Sender<Queued>, Arc<SpoolHealth>),
    /// Nowhere (capture off; for measuring the proxy without it).
    Discard,
}

/// Records waiting for the spool writer; beyond this the request path waits (backpressure)
/// rather than dropping records.
const SINK_QUEUE: usize = 8192;
/// Records written with one write and one fsync.
const MAX_BATCH: usize = 256;
/// Under `fail-closed`, the wait before retrying a failed append, doubling up to the max.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Once the proxy is shutting down (every sender gone) with the spool still failing, how long
/// the writer keeps retrying before it gives up on the records it holds (counted lost).
const SHUTDOWN_RETRY: Duration = Duration::from_secs(10);
/// At most one error log per this while the spool keeps failing.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// The writer thread's state: the spool, the policy and what it tells the proxy.
struct SpoolThread {
    writer: SpoolWriter,
    metrics: Arc<Metrics>,
    observer: Option<RecordObserver>,
    health: Arc<SpoolHealth>,
    /// When the current failure began and when it was last logged.
    failing_since: Option<Instant>,
    last_log: Option<Instant>,
    /// Failed attempts (or records dropped, under fail-open) since the last log.
    unlogged: u64,
}

impl SpoolThread {
    /// Writes `batch` (with `waiters` told the outcome, one per record), per the policy:
    /// under fail-closed retries until it is written or `give_up` says stop; under fail-open
    /// one attempt.
    async fn settle(
        &mut self,
        batch: &mut Vec<CaptureRecord>,
        waiters: &mut Vec<Option<oneshot::Sender<bool>>>,
        mut give_up: impl FnMut() -> bool,
    ) {
        let mut backoff = RETRY_FIRST;
        let written = loop {
            match self.writer.append_batch_at(batch) {
                Ok(lines) => {
                    self.recovered();
                    self.metrics.records_written.inc_by(batch.len() as u64);
                    if let Some(observe) = self.observer.as_mut() {
                        observe(batch, &lines);
                    }
                    break true;
                }
                Err(SpoolError::Serialize { record_id, .. }) => {
                    // One record that cannot be encoded (not a disk problem; cannot happen for
                    // records the proxy builds) must not hold up the others.
                    tracing::error!(%record_id, "a capture record cannot be serialized; record lost");
                    self.metrics.records_lost.inc();
                    if let Some(i) = batch.iter().position(|r| r.record_id == record_id) {
                        batch.remove(i);
                        if let Some(w) = waiters.remove(i) {
                            let _ = w.send(false);
                        }
                        continue;
                    }
                    // Unreachable (the id comes from the batch); drop the batch rather than spin.
                    self.lost(batch.len(), "unserializable batch");
                    break false;
                }
                Err(e) => {
                    self.failed(&e, batch.len());
                    if self.health.policy() == OnSpoolError::FailOpen {
                        self.lost(batch.len(), &e.to_string());
                        break false;
                    }
                    if give_up() {
                        tracing::error!(error = %e, records = batch.len(), "the proxy is stopping and the spool is still failing; records lost");
                        self.metrics.records_lost.inc_by(batch.len() as u64);
                        break false;
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RETRY_MAX);
                }
            }
        };
        if let Some(e) = self.writer.take_sync_error() {
            // The lines are written; only their durability is in doubt (retried next interval).
            tracing::error!(error = %e, "spool fsync failed; retrying at the next interval");
            self.metrics.spool_write_errors.inc();
        }
        for w in waiters.drain(..).flatten() {
            let _ = w.send(written);
        }
        self.metrics
            .spool_bytes
            .set(self.writer.total_bytes() as i64);
        batch.clear();
    }

    /// An append failed: counted, the proxy told, logged at most once per [`LOG_EVERY`].
    fn failed(&mut self, e: &SpoolError, records: usize) {
        self.metrics.spool_write_errors.inc();
        self.metrics.spool_writable.set(0);
        self.health.set_failing(spool_error_cause(e));
        let now = Instant::now();
        let since = *self.failing_since.get_or_insert(now);
        self.unlogged += 1;
        if self.last_log.is_none_or(|t| now - t >= LOG_EVERY) {
            match self.health.policy() {
                OnSpoolError::FailClosed => tracing::error!(
                    error = %e,
                    records,
                    failed_attempts = self.unlogged,
                    failing_for = ?now - since,
                    "spool append failed; keeping the records and retrying, new calls are refused until the spool is writable (--on-spool-error fail-closed)"
                ),
                OnSpoolError::FailOpen => tracing::error!(
                    error = %e,
                    records,
                    failed_appends = self.unlogged,
                    failing_for = ?now - since,
                    "spool append failed; records lost, calls still answered (--on-spool-error fail-open)"
                ),
            }
            self.last_log = Some(now);
            self.unlogged = 0;
        }
    }

    fn lost(&self, records: usize, why: &str) {
        tracing::debug!(records, why, "capture records dropped");
        self.metrics.records_lost.inc_by(records as u64);
    }

    /// An append succeeded: if the spool was failing, it is writable again.
    fn recovered(&mut self) {
        if let Some(since) = self.failing_since.take() {
            tracing::info!(
                failed_for = ?since.elapsed(),
                "the spool is writable again; calls are served"
            );
            self.last_log = None;
            self.unlogged = 0;
        }
        if !self.health.writable() {
            self.health.set_writable();
        }
        self.metrics.spool_writable.set(1);
    }
}

impl RecordSink {
    /// Whether records go anywhere (not under `--no-capture`).
    pub fn keeps_records(&self) -> bool {
        !matches!(self, RecordSink::Discard)
    }

    /// Starts the spool writer thread (under `fail-closed`). Dropping every sender drains
    /// the queue, syncs the spool and ends the thread; join the handle to wait for that.
    pub fn spool(writer: SpoolWriter, metrics: Arc<Metrics>) -> (RecordSink, JoinHandle<()>) {
        RecordSink::spool_observed(writer, metrics, None)
    }

    /// Like [`RecordSink::spool`], and `observer` sees every batch once it is appended (a
    /// rollout node indexes its samples' records this way instead of re-reading the spool).
    pub fn spool_observed(
        writer: SpoolWriter,
        metrics: Arc<Metrics>,
        observer: Option<RecordObserver>,
    ) -> (RecordSink, JoinHandle<()>) {
        RecordSink::start(writer, metrics, observer, OnSpoolError::default())
    }

    /// The spool writer thread, with `on_error` deciding what happens while appends fail.
    ///
    /// Under `fail-closed` a failed batch is kept and retried (250 ms, doubling to 2 s) with
    /// everything queued behind it waiting (the bounded queue is the backpressure), and the
    /// sink's [`RecordSink::refusal`] names the cause until an append succeeds again. Under
    /// `fail-open` the batch is counted lost and the next one is tried as usual. Either way
    /// the writer recovers by itself once the disk does.
    pub fn start(
        writer: SpoolWriter,
        metrics: Arc<Metrics>,
        observer: Option<RecordObserver>,
        on_error: OnSpoolError,
    ) -> (RecordSink, JoinHandle<()>) {
        let (tx, mut rx) = mpsc::channel::<Queued>(SINK_QUEUE);
        metrics.spool_bytes.set(writer.total_bytes() as i64);
        let health = Arc::new(SpoolHealth::new(on_error));
        let mut thread = SpoolThread {
            writer,
            metrics,
            observer,
            health: health.clone(),
            failing_since: None,
            last_log: None,
            unlogged: 0,
        };
        let handle = std::thread::Builder::new()
            .name("tokentap-spool".into())
            .spawn(move || {
                // A private single-thread runtime only to wait on the queue with a deadline:
                // the interval fsync policy must sync even when no new record arrives.
                let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("spool writer runtime");
                rt.block_on(async move {
                    let mut batch = Vec::with_capacity(MAX_BATCH);
                    let mut waiters: Vec<Option<oneshot::Sender<bool>>> = Vec::with_capacity(MAX_BATCH);
                    let mut closed_at: Option<Instant> = None;
                    loop {
                        let next = match thread.writer.sync_deadline() {
                            Some(deadline) => match tokio::time::timeout_at(deadline.into(), rx.recv()).await {
                                Ok(next) => next,
                                Err(_) => {
                                    if let Err(e) = thread.writer.sync_if_due() {
                                        tracing::error!(error = %e, "spool sync failed; retrying at the next interval");
                                        thread.metrics.spool_write_errors.inc();
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
                            waiters.push(q.written);
                            if batch.len() < MAX_BATCH {
                                next = rx.try_recv().ok();
                            }
                        }
                        // Retried as it is (nothing added): the same bytes at the same offset,
                        // so a reader that glimpsed lines of a failed attempt is not misled.
                        thread
                            .settle(&mut batch, &mut waiters, || {
                                if !rx.is_closed() {
                                    return false;
                                }
                                closed_at.get_or_insert_with(Instant::now).elapsed() >= SHUTDOWN_RETRY
                            })
                            .await;
                    }
                    if let Err(e) = thread.writer.sync() {
                        tracing::error!(error = %e, "final spool sync failed");
                    }
                });
            })
            .expect("spawning the spool writer thread");
        (RecordSink::Spool(tx, health), handle)
    }

    /// Why a new call must be refused now (the spool cannot be written under `fail-closed`),
    /// if it must.
    pub fn refusal(&self) -> Option<String> {
        match self {
            RecordSink::Spool(_, health) => health.refusal(),
            RecordSink::Discard => None,
        }
    }

    /// The spool's health, shared with the writer thread (`None` without a spool).
    pub fn health(&self) -> Option<&Arc<SpoolHealth>> {
        match self {
            RecordSink::Spool(_, health) => Some(health),
            RecordSink::Discard => None,
        }
    }

    /// Hands `record` to the spool writer and returns at once.
    pub async fn send(&self, record: CaptureRecord, metrics: &Metrics) {
        if let RecordSink::Spool(tx, _) = self {
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
    /// be written is counted lost by the writer. Under `fail-closed` this waits for as long as
    /// the spool fails (the record is kept and retried).
    pub async fn commit(&self, record: CaptureRecord, metrics: &Metrics) -> bool {
        let RecordSink::Spool(tx, _) = self else {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tokentap_e2e::privileged;
    use tokentap_e2e::tmpfs::{self, Tmpfs};
    use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolItem, SpoolReader};

    #[test]
    fn the_policy_parses_and_displays() {
        for p in [OnSpoolError::FailClosed, OnSpoolError::FailOpen] {
            assert_eq!(p.to_string().parse::<OnSpoolError>(), Ok(p));
        }
        assert_eq!(OnSpoolError::default(), OnSpoolError::FailClosed);
        let e = "sometimes".parse::<OnSpoolError>().unwrap_err();
        assert!(
            e.contains("`sometimes`") && e.contains("fail-closed"),
            "{e}"
        );
    }

    #[test]
    fn only_fail_closed_refuses_and_only_while_failing() {
        let closed = SpoolHealth::new(OnSpoolError::FailClosed);
        assert_eq!(closed.refusal(), None);
        closed.set_failing("No space left on device (os error 28)".into());
        assert_eq!(
            closed.refusal().as_deref(),
            Some("No space left on device (os error 28)")
        );
        closed.set_writable();
        assert_eq!(closed.refusal(), None);
        let open = SpoolHealth::new(OnSpoolError::FailOpen);
        open.set_failing("No space left on device (os error 28)".into());
        assert!(!open.writable());
        assert_eq!(open.refusal(), None);
    }

    fn record(i: usize) -> CaptureRecord {
        let mut call = CallCapture::new(
            WireApi::ChatCompletions,
            HarnessRequest::bare("POST", &format!("/v1/chat/completions/{i}")),
            BackendInfo {
                kind: tokentap_schema::BackendKind::Vllm,
                url: "http://127.0.0.1:1".into(),
                model: "m".into(),
                policy_version: None,
                engine_weight_version: None,
                synthetic_stream: false,
            },
        );
        call.response_status = 200;
        let mut r = call.into_record();
        // Big enough that a few fill what a full tmpfs has left in its last page.
        r.request.body_text = Some("x".repeat(3000));
        r
    }

    fn spool_ids(dir: &Path) -> Vec<String> {
        SpoolReader::open(dir)
            .unwrap()
            .map(|i| match i.unwrap() {
                SpoolItem::Record(e) => e.record.record_id,
                other => panic!("not a whole record: {other:?}"),
            })
            .collect()
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn fail_closed_keeps_failed_records_refuses_and_writes_each_once_when_space_returns() {
        if !privileged::runs(tmpfs::may_mount()) {
            return;
        }
        let fs = Tmpfs::mount("128k");
        let dir = fs.path().join("spool");
        let writer = SpoolWriter::open(
            &dir,
            SpoolConfig {
                fsync: FsyncPolicy::Always,
                ..SpoolConfig::default()
            },
        )
        .unwrap();
        let metrics = Arc::new(Metrics::new());
        let (sink, handle) =
            RecordSink::start(writer, metrics.clone(), None, OnSpoolError::FailClosed);
        let records: Vec<_> = (0..20).map(record).collect();
        sink.commit(records[0].clone(), &metrics).await;
        let filler = fs.fill();
        // Durable answers wait for their record: this one waits for space, it is not dropped.
        let waiting = {
            let (sink, metrics, r) = (sink.clone(), metrics.clone(), records[1].clone());
            tokio::spawn(async move { sink.commit(r, &metrics).await })
        };
        // Queued (and failed) before the others, so the order below is the one sent.
        until("the first failed append", || {
            metrics.spool_write_errors.get() >= 1
        })
        .await;
        for r in &records[2..] {
            sink.send(r.clone(), &metrics).await;
        }
        until("the refusal", || sink.refusal().is_some()).await;
        let cause = sink.refusal().unwrap();
        assert!(cause.contains("No space left on device"), "{cause}");
        assert_eq!(metrics.spool_writable.get(), 0);
        tokio::time::sleep(Duration::from_millis(600)).await; // a few retries
        assert!(metrics.spool_write_errors.get() >= 2);
        assert!(
            !waiting.is_finished(),
            "the answer waits while the spool is full"
        );
        assert_eq!(metrics.records_lost.get(), 0);

        std::fs::remove_file(filler).unwrap();
        assert!(waiting.await.unwrap(), "written once space returned");
        until("recovery", || sink.refusal().is_none()).await;
        drop(sink);
        tokio::task::spawn_blocking(move || handle.join().unwrap())
            .await
            .unwrap();
        assert_eq!(metrics.spool_writable.get(), 1);
        assert_eq!(metrics.records_lost.get(), 0);
        let want: Vec<_> = records.iter().map(|r| r.record_id.clone()).collect();
        assert_eq!(spool_ids(&dir), want, "each record once, in order");
    }

    #[tokio::test]
    async fn fail_open_drops_and_counts_failed_batches_and_resumes_when_space_returns() {
        if !privileged::runs(tmpfs::may_mount()) {
            return;
        }
        let fs = Tmpfs::mount("128k");
        let dir = fs.path().join("spool");
        let writer = SpoolWriter::open(&dir, SpoolConfig::default()).unwrap();
        let metrics = Arc::new(Metrics::new());
        let (sink, handle) =
            RecordSink::start(writer, metrics.clone(), None, OnSpoolError::FailOpen);
        let records: Vec<_> = (0..6).map(record).collect();
        assert!(sink.commit(records[0].clone(), &metrics).await);
        let filler = fs.fill();
        for r in &records[1..5] {
            assert!(!sink.commit(r.clone(), &metrics).await, "not written");
            assert_eq!(sink.refusal(), None, "fail-open never refuses");
        }
        assert_eq!(metrics.records_lost.get(), 4);
        assert_eq!(metrics.spool_writable.get(), 0);
        std::fs::remove_file(filler).unwrap();
        assert!(sink.commit(records[5].clone(), &metrics).await);
        assert_eq!(metrics.spool_writable.get(), 1);
        drop(sink);
        tokio::task::spawn_blocking(move || handle.join().unwrap())
            .await
            .unwrap();
        assert_eq!(
            spool_ids(&dir),
            vec![records[0].record_id.clone(), records[5].record_id.clone()]
        );
    }
}
