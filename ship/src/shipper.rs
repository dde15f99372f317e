//! The shipper: sends a spool's records to a reconstruction worker, at least once, resuming
//! from a cursor file after either side restarts. Runs in `tokentap proxy --ship-to URL` (and
//! `run`, `sidecar`) and as `tokentap ship`.
//!
//! It cannot stall: batches stay under the worker's advertised body limit, a record bigger than
//! a batch goes alone, and a record the worker will never take (over its limit, or rejected in
//! its ack) goes to the dead-letter file next to the cursor, loudly and counted, before the
//! cursor moves past it. Only a worker that is down or refuses the token holds the stream, and
//! that is retried until it comes back.
//!
//! What a worker says is believed only so far: a body limit below [`MIN_WORKER_LIMIT`]
//! (advertised, or in a 413) is ignored with a warning, so a worker misconfigured with a tiny
//! `--max-body-bytes` (or something else answering at its address) cannot have every record
//! dead-lettered unsent; its answers are read to at most 1 MiB; and redirects are not
//! followed, so the token and the records go only to `--to`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokentap_service_kit::capped_body::{self, MAX_BODY_READ};
use tokentap_service_kit::error_chain;

use anyhow::Context;
use prometheus::IntCounter;
use tokentap_schema::ndjson::encode_line;
use tokentap_schema::ship::{ShipAck, ShipLimits, SHIP_CONTENT_TYPE, SHIP_LIMITS_PATH, SHIP_PATH};
use tokentap_spool::downstream::{self, DownstreamMetrics};
use tokentap_spool::{SpoolItem, SpoolPosition, SpoolReader};

/// The least body limit of a worker the shipper believes. A record is tens of KB, a long
/// session's last calls a few MB; a worker that says it takes less than this is misconfigured
/// or not a worker, and believing it would dead-letter nearly every record without sending
/// it. Below it, batches are sized by the shipper's own budget and split on 413s, and only a
/// record the worker answers 413 to when sent alone is dead-lettered.
pub const MIN_WORKER_LIMIT: u64 = 1 << 20;

/// Next to the spool's segments; the spool reader ignores other files.
pub const CURSOR_FILE: &str = "ship-cursor.json";
/// Records that will never be delivered, one JSON object a line (`reason`, `worker`,
/// `position`, `record`), next to the cursor; created 0600.
pub const DEAD_LETTER_FILE: &str = "dead-letter.ndjson";

/// Where and how records are sent.
#[derive(Clone)]
pub struct ShipTarget {
    /// The worker's base URL.
    pub to: String,
    pub token: Option<String>,
    /// CA certificates trusted besides the built-in roots (`--ca-file`).
    pub ca_roots: Vec<reqwest::Certificate>,
}

/// How a shipper batches (the worker's own limit caps `max_bytes` further).
#[derive(Debug, Clone, Copy)]
pub struct BatchLimits {
    pub max_records: usize,
    pub max_bytes: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        BatchLimits {
            max_records: 256,
            max_bytes: 8 << 20,
        }
    }
}

/// Totals of one shipper run.
#[derive(Debug, Default, Clone, Copy)]
pub struct ShipTotals {
    pub batches: u64,
    pub records: u64,
    pub duplicates: u64,
    pub rejected: u64,
    pub dead_lettered: u64,
    pub retries: u64,
}

/// When a shipper stops.
#[derive(Clone)]
pub struct ShipStop {
    /// Set: ship what is in the spool, then return.
    pub drain: Arc<AtomicBool>,
    /// After `drain` is set, give up this long after it if the worker is unreachable (the
    /// cursor is saved, so nothing is lost: the next start resumes).
    pub drain_deadline: Duration,
}

/// A spool line read but not yet settled (acked or dead-lettered).
struct Pending {
    /// Where the line starts (for the dead-letter file).
    position: SpoolPosition,
    /// Just past it: the cursor once it is settled.
    end: SpoolPosition,
    /// The record's NDJSON line, or why the spool line is not a record.
    line: Result<Vec<u8>, String>,
}

impl Pending {
    fn len(&self) -> usize {
        self.line.as_ref().map_or(0, Vec::len)
    }
}

/// How one batch went.
enum Sent {
    Acked(ShipAck),
    /// 413: the batch is over the worker's limit (which it may say).
    TooLarge(Option<u64>),
    /// 401/403: the token is missing or wrong. Retried: records are not at fault.
    Unauthorized(String),
    /// Another 4xx: the worker refuses this batch as such; retrying it unchanged cannot help.
    Refused(String),
    /// Transport errors, 5xx, 408, 429: worth retrying as it is.
    Transient(String),
}

/// Keeps the records the worker will never take, and counts them.
struct DeadLetters {
    path: PathBuf,
    worker: String,
    counter: IntCounter,
}

impl DeadLetters {
    fn keep(&self, p: &Pending, reason: &str) -> anyhow::Result<()> {
        tracing::error!(
            position = %p.position,
            bytes = p.len(),
            file = %self.path.display(),
            %reason,
            "a record cannot be delivered to the worker: kept in the dead-letter file"
        );
        downstream::append_dead_letter(
            &self.path,
            ("worker", &self.worker),
            p.position,
            reason,
            p.line.as_deref().ok(),
        )
        .with_context(|| format!("writing the dead-letter file {}", self.path.display()))?;
        self.counter.inc();
        Ok(())
    }
}

/// Ships `spool` to `target` until the spool is drained and `stop.drain` is set. Records it
/// progress is counted on `metrics`.
pub fn ship(
    spool: &Path,
    target: &ShipTarget,
    stop: &ShipStop,
    limits: BatchLimits,
    metrics: DownstreamMetrics,
) -> anyhow::Result<ShipTotals> {
    let cursor_path = spool.join(CURSOR_FILE);
    let to = target.to.trim_end_matches('/').to_owned();
    let start = downstream::load_cursor(&cursor_path, &to);
    let mut reader = SpoolReader::open_at(spool, start)
        .with_context(|| format!("opening the spool at {}", spool.display()))?;
    let mut builder = reqwest::blocking::Client::builder()
        // The worker's API never redirects; following one would send the token (kept by
        // reqwest on the same host and port, even from https to http) and the records to
        // wherever it points.
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(5))
        // Room for a batch of the worker's largest body over a slow link.
        .timeout(Duration::from_secs(300));
    for ca in &target.ca_roots {
        builder = builder.add_root_certificate(ca.clone());
    }
    let client = Worker {
        http: builder
            .build()
            .context("building the shipper's HTTP client")?,
        to: to.clone(),
        token: target.token.clone(),
    };
    let dead = DeadLetters {
        path: spool.join(DEAD_LETTER_FILE),
        worker: to.clone(),
        counter: metrics.dead_letters.clone(),
    };
    // The backlog is measured at most this often (it lists and stats the segments).
    let mut backlog_measured: Option<Instant> = None;
    let save = |position: SpoolPosition| {
        downstream::save_cursor(&cursor_path, &to, position)
            .with_context(|| format!("saving the cursor {}", cursor_path.display()))
    };
    let mut totals = ShipTotals::default();
    let mut drain_since: Option<Instant> = None;
    let mut pending: VecDeque<Pending> = VecDeque::new();
    let mut pending_bytes = 0usize;
    // The worker's body limit: asked for, or told in a 413; None until known.
    let mut worker_max: Option<u64> = None;
    let mut limits_asked: Option<Instant> = None;
    // After a 413 or a refused batch: try at most this many records next.
    let mut split_cap: Option<usize> = None;
    let mut backoff = Duration::from_millis(100);
    tracing::info!(spool = %spool.display(), worker = %to, from = %start, "shipping records");
    loop {
        let draining = stop.drain.load(Ordering::Relaxed);
        if draining && drain_since.is_none() {
            drain_since = Some(Instant::now());
        }
        if worker_max.is_none()
            && limits_asked.is_none_or(|t| t.elapsed() > Duration::from_secs(30))
        {
            limits_asked = Some(Instant::now());
            worker_max = client.limits();
        }
        if backlog_measured.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            backlog_measured = Some(Instant::now());
            // Read and unacked, plus not yet read.
            if let Ok(unread) = tokentap_spool::bytes_after(spool, reader.position()) {
                metrics
                    .backlog_bytes
                    .set((unread + pending_bytes as u64) as i64);
            }
        }
        let budget = worker_max.map_or(limits.max_bytes, |m| limits.max_bytes.min(m as usize));
        while pending.len() < limits.max_records && pending_bytes < budget {
            let line = match reader.next_available()? {
                Some(SpoolItem::Record(e)) => {
                    let mut line = Vec::new();
                    encode_line(&e.record, &mut line)?;
                    (e.position, Ok(line))
                }
                Some(SpoolItem::Corrupt { position, error }) => (position, Err(error)),
                Some(SpoolItem::Torn { .. }) => continue, // never from next_available
                None => break,                            // caught up
            };
            let p = Pending {
                position: line.0,
                end: reader.position(),
                line: line.1,
            };
            pending_bytes += p.len();
            pending.push_back(p);
        }
        let Some(front) = pending.front() else {
            if draining {
                if let Ok(unread) = tokentap_spool::bytes_after(spool, reader.position()) {
                    metrics.backlog_bytes.set(unread as i64);
                }
                tracing::info!(?totals, "shipper drained");
                return Ok(totals);
            }
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };

        // Lines that will never be delivered are settled here, one at a time.
        let undeliverable = match &front.line {
            Err(e) => Some(format!("the spool line is not a record: {e}")),
            Ok(l) => worker_max.filter(|&m| l.len() as u64 > m).map(|m| {
                format!(
                    "the record is {} bytes, over the worker's limit of {m} (its --max-body-bytes)",
                    l.len()
                )
            }),
        };
        if let Some(reason) = undeliverable {
            let p = pending.pop_front().expect("front exists");
            pending_bytes -= p.len();
            dead.keep(&p, &reason)?;
            totals.dead_lettered += 1;
            save(p.end)?;
            continue;
        }

        // The batch: records from the front, under the budget (the first one alone may be
        // over it), never past a line that is not a record.
        let mut n = 0;
        let mut bytes = 0;
        let cap = split_cap.unwrap_or(limits.max_records).max(1);
        for p in pending.iter().take(cap) {
            let Ok(l) = &p.line else { break };
            if n > 0 && bytes + l.len() > budget {
                break;
            }
            bytes += l.len();
            n += 1;
        }
        let mut body = Vec::with_capacity(bytes);
        for p in pending.iter().take(n) {
            body.extend_from_slice(p.line.as_ref().expect("records only"));
        }
        let transient = match client.send(&body) {
            Sent::Acked(ack) => {
                metrics.records.inc_by(ack.accepted + ack.duplicates);
                metrics.last_ack.set(unix_ms() as f64 / 1000.0);
                backoff = Duration::from_millis(100);
                split_cap = None;
                totals.batches += 1;
                totals.records += ack.accepted;
                totals.duplicates += ack.duplicates;
                totals.rejected += ack.rejected;
                let batch: Vec<Pending> = pending.drain(..n).collect();
                pending_bytes -= bytes;
                for r in &ack.rejected_lines {
                    match batch.get((r.line as usize).wrapping_sub(1)) {
                        Some(p) => {
                            dead.keep(p, &format!("the worker rejected it: {}", r.reason))?;
                            totals.dead_lettered += 1;
                        }
                        None => {
                            tracing::error!(line = r.line, reason = %r.reason, "the worker rejected a line the batch does not have")
                        }
                    }
                }
                if ack.rejected as usize > ack.rejected_lines.len() {
                    // A worker that does not say which lines: keep the whole batch, so none
                    // of the rejected records is lost (the accepted ones are kept twice).
                    tracing::error!(rejected = ack.rejected, errors = ?ack.errors, "the worker rejected records without saying which: the whole batch goes to the dead-letter file");
                    for p in &batch {
                        dead.keep(
                            p,
                            &format!(
                                "in a batch the worker rejected {} lines of: {:?}",
                                ack.rejected, ack.errors
                            ),
                        )?;
                        totals.dead_lettered += 1;
                    }
                }
                save(batch.last().expect("a batch has a record").end)?;
                None
            }
            Sent::TooLarge(max) => {
                let known = max
                    .and_then(|m| believed(m, "in its 413"))
                    .or_else(|| client.limits());
                tracing::warn!(batch_bytes = bytes, records = n, worker_limit = ?known, "the worker found the batch too large; sending fewer records");
                if known.is_some() {
                    worker_max = known;
                }
                if n == 1 {
                    // One record the worker will not read, whatever it says its limit is.
                    let p = pending.pop_front().expect("front exists");
                    pending_bytes -= p.len();
                    dead.keep(
                        &p,
                        &format!(
                            "the worker answered 413 to this record alone ({} bytes)",
                            p.len()
                        ),
                    )?;
                    totals.dead_lettered += 1;
                    save(p.end)?;
                } else {
                    split_cap = Some(n / 2);
                }
                None
            }
            Sent::Refused(why) if n == 1 => {
                let p = pending.pop_front().expect("front exists");
                pending_bytes -= p.len();
                dead.keep(&p, &format!("the worker refused it: {why}"))?;
                totals.dead_lettered += 1;
                save(p.end)?;
                split_cap = None;
                None
            }
            Sent::Refused(why) => {
                tracing::warn!(%why, records = n, "the worker refused the batch; sending its records in smaller batches to find the one at fault");
                split_cap = Some(n / 2);
                None
            }
            Sent::Unauthorized(why) => {
                tracing::error!(%why, "the worker refused the shipper's token: set --ship-token (or TOKENTAP_WORKER_TOKEN) to the worker's --token; retrying");
                Some(why)
            }
            Sent::Transient(why) => Some(why),
        };
        if let Some(e) = transient {
            totals.retries += 1;
            metrics.errors.inc();
            let gave_up = drain_since.is_some_and(|t| t.elapsed() >= stop.drain_deadline);
            if gave_up {
                tracing::warn!(error = %e, "worker unreachable at shutdown; the cursor is saved and the next start resumes");
                return Ok(totals);
            }
            tracing::warn!(error = %e, retry_in = ?backoff, "shipping failed; retrying the same batch");
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_secs(5));
            if worker_max.is_none() {
                limits_asked = None; // the worker may be back: ask again
            }
        }
    }
}

/// The worker, as the shipper talks to it.
struct Worker {
    http: reqwest::blocking::Client,
    to: String,
    token: Option<String>,
}

impl Worker {
    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::blocking::RequestBuilder {
        let req = self.http.request(method, format!("{}{path}", self.to));
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    /// The worker's body limit, when it tells it (an older worker does not) and it is
    /// [`believed`].
    fn limits(&self) -> Option<u64> {
        let r = self.request(reqwest::Method::GET, SHIP_LIMITS_PATH).send();
        match r {
            Ok(r) if r.status().is_success() => {
                match capped_body::read_sync_json::<ShipLimits>(r, MAX_BODY_READ) {
                    Ok(l) => {
                        tracing::info!(max_body_bytes = l.max_body_bytes, "the worker's limits");
                        believed(l.max_body_bytes, "at /v1/ship/limits")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "unreadable worker limits");
                        None
                    }
                }
            }
            Ok(r) => {
                tracing::warn!(status = %r.status(), "the worker did not tell its limits");
                None
            }
            Err(e) => {
                tracing::debug!(error = %error_chain(&e), "asking the worker's limits");
                None
            }
        }
    }

    fn send(&self, body: &[u8]) -> Sent {
        let sent = self
            .request(reqwest::Method::POST, SHIP_PATH)
            .header(reqwest::header::CONTENT_TYPE, SHIP_CONTENT_TYPE)
            .body(body.to_vec())
            .send();
        let response = match sent {
            Ok(r) => r,
            Err(e) => return Sent::Transient(error_chain(&e)),
        };
        let status = response.status();
        if status.is_success() {
            return match capped_body::read_sync_json::<ShipAck>(response, MAX_BODY_READ) {
                Ok(ack) => Sent::Acked(ack),
                Err(e) => Sent::Transient(format!("unreadable ack: {e}")),
            };
        }
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .map(|l| String::from_utf8_lossy(l.as_bytes()).into_owned());
        let excerpt = capped_body::read_sync(response, MAX_BODY_READ).unwrap_or_default();
        let text = excerpt.text();
        let why = format!(
            "worker answered {status}: {}",
            text.chars().take(300).collect::<String>()
        );
        match status.as_u16() {
            413 => Sent::TooLarge(
                excerpt
                    .json::<serde_json::Value>()
                    .ok()
                    .and_then(|v| v["max_body_bytes"].as_u64()),
            ),
            401 | 403 => Sent::Unauthorized(why),
            300..=399 => Sent::Transient(format!(
                "worker answered {status} to {location:?}: not followed (the token and records go only to --to)",
                location = location.unwrap_or_default()
            )),
            408 | 425 | 429 => Sent::Transient(why),
            400..=499 => Sent::Refused(why),
            _ => Sent::Transient(why),
        }
    }
}

/// A body limit a worker told (`source`: where), if it is at least [`MIN_WORKER_LIMIT`].
fn believed(max_body_bytes: u64, source: &str) -> Option<u64> {
    if max_body_bytes >= MIN_WORKER_LIMIT {
        return Some(max_body_bytes);
    }
    tracing::warn!(
        max_body_bytes,
        floor = MIN_WORKER_LIMIT,
        "the worker's body limit {source} is below the least the shipper believes: ignored (batches are split on 413s instead); raise the worker's --max-body-bytes"
    );
    None
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::extract::DefaultBodyLimit;
    use serde_json::json;
    use std::sync::Mutex;
    use tokentap_reconstruct::synthetic::LongSession;
    use tokentap_spool::{SpoolConfig, SpoolWriter};

    /// A runtime with `app` served on loopback: its base URL.
    fn serve(app: axum::Router) -> (tokio::runtime::Runtime, String) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let url = rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            tokio::spawn(async move { axum::serve(listener, app).await });
            url
        });
        (rt, url)
    }

    /// A spool of `n` small records (a few KB each).
    fn spool_of(dir: &Path, n: usize) -> Vec<tokentap_schema::CaptureRecord> {
        let records = LongSession {
            calls: n,
            first_prompt: 200,
            last_prompt: 400,
            sampled: 8,
            subagent_every: 0,
            subagent_calls: 0,
            subagent_prompt: 0,
        }
        .records("spooled", 3);
        let mut w = SpoolWriter::open(dir, SpoolConfig::default()).unwrap();
        w.append_batch(&records).unwrap();
        w.sync().unwrap();
        records
    }

    /// A worker at `url` taking records without a token.
    fn tokenless(url: String) -> ShipTarget {
        ShipTarget {
            to: url,
            token: None,
            ca_roots: Vec::new(),
        }
    }

    fn drained(deadline: Duration) -> ShipStop {
        ShipStop {
            drain: Arc::new(AtomicBool::new(true)),
            drain_deadline: deadline,
        }
    }

    /// A worker that says it takes 16 bytes (at `/v1/ship/limits`, and 10 in a 413 to the
    /// first batch) but takes what it is sent: the shipper does not believe a limit that
    /// small, so nothing is dead-lettered unsent and every record arrives.
    #[test]
    fn a_tiny_advertised_limit_is_not_believed() {
        use axum::response::IntoResponse;
        let received: Arc<Mutex<Vec<String>>> = Arc::default();
        let first = Arc::new(AtomicBool::new(true));
        let sink = received.clone();
        let app = axum::Router::new()
            .route(
                SHIP_LIMITS_PATH,
                axum::routing::get(|| async { axum::Json(ShipLimits { max_body_bytes: 16 }) }),
            )
            .route(
                SHIP_PATH,
                axum::routing::post(move |body: axum::body::Bytes| async move {
                    if first.swap(false, Ordering::SeqCst) {
                        let limit = axum::Json(ShipLimits { max_body_bytes: 10 });
                        return (axum::http::StatusCode::PAYLOAD_TOO_LARGE, limit).into_response();
                    }
                    let mut ack = ShipAck::default();
                    for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                        let r: tokentap_schema::CaptureRecord =
                            serde_json::from_slice(line).unwrap();
                        sink.lock().unwrap().push(r.record_id);
                        ack.accepted += 1;
                    }
                    axum::Json(ack).into_response()
                }),
            );
        let (_rt, url) = serve(app);
        let dir = tempfile::tempdir().unwrap();
        let records = spool_of(dir.path(), 20);
        let target = tokenless(url);
        let totals = ship(
            dir.path(),
            &target,
            &drained(Duration::from_secs(5)),
            BatchLimits::default(),
            DownstreamMetrics::unregistered(),
        )
        .unwrap();
        assert_eq!(totals.dead_lettered, 0, "{totals:?}");
        let want: Vec<String> = records.iter().map(|r| r.record_id.clone()).collect();
        assert_eq!(*received.lock().unwrap(), want);
        assert!(!dir.path().join(DEAD_LETTER_FILE).exists());
    }

    /// A "worker" that redirects both its routes elsewhere: the shipper follows neither, so
    /// the place they point to never sees the token, nor the records; it retries, and a drain
    /// gives up at its deadline with the cursor where it was.
    #[test]
    fn redirects_are_not_followed_with_the_token() {
        let elsewhere: Arc<Mutex<Vec<String>>> = Arc::default();
        let seen = elsewhere.clone();
        let (_rt_elsewhere, elsewhere_url) = serve(axum::Router::new().fallback(
            move |headers: axum::http::HeaderMap, uri: axum::http::Uri| async move {
                let auth = headers
                    .get("authorization")
                    .map(|v| v.to_str().unwrap_or_default().to_owned());
                seen.lock().unwrap().push(format!("{uri} {auth:?}"));
                axum::Json(ShipLimits {
                    max_body_bytes: 64 << 20,
                })
            },
        ));
        let to = elsewhere_url.clone();
        let (_rt, url) = serve(axum::Router::new().fallback(move |uri: axum::http::Uri| {
            let to = to.clone();
            async move {
                (
                    axum::http::StatusCode::TEMPORARY_REDIRECT,
                    [("location", format!("{to}{uri}"))],
                )
            }
        }));
        let dir = tempfile::tempdir().unwrap();
        spool_of(dir.path(), 3);
        let target = ShipTarget {
            to: url,
            token: Some("the-worker-token".into()),
            ca_roots: Vec::new(),
        };
        let totals = ship(
            dir.path(),
            &target,
            &drained(Duration::from_secs(1)),
            BatchLimits::default(),
            DownstreamMetrics::unregistered(),
        )
        .unwrap();
        assert_eq!(*elsewhere.lock().unwrap(), Vec::<String>::new());
        assert!(totals.retries > 0, "{totals:?}");
        assert_eq!((totals.records, totals.dead_lettered), (0, 0));
    }

    /// A worker of an older kind: no `/v1/ship/limits`, and a bare 413 (no limit in it) for
    /// a body over `limit`. The shipper must still get every record through that fits, and
    /// dead-letter the one that does not, by splitting on 413s alone.
    #[test]
    fn without_advertised_limits_413s_split_batches_down_to_the_record_at_fault() {
        const LIMIT: usize = 16 << 10;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let received: Arc<Mutex<Vec<String>>> = Arc::default();
        let bodies: Arc<Mutex<Vec<usize>>> = Arc::default();
        let url = {
            let (received, bodies) = (received.clone(), bodies.clone());
            rt.block_on(async move {
                let app = axum::Router::new()
                    .route(
                        SHIP_PATH,
                        axum::routing::post(move |body: axum::body::Bytes| async move {
                            bodies.lock().unwrap().push(body.len());
                            let mut ack = ShipAck::default();
                            for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                                let r: tokentap_schema::CaptureRecord =
                                    serde_json::from_slice(line).unwrap();
                                received.lock().unwrap().push(r.record_id);
                                ack.accepted += 1;
                            }
                            axum::Json(ack)
                        }),
                    )
                    .layer(DefaultBodyLimit::max(LIMIT));
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let url = format!("http://{}", listener.local_addr().unwrap());
                tokio::spawn(async move { axum::serve(listener, app).await });
                url
            })
        };

        let dir = tempfile::tempdir().unwrap();
        let mut records = LongSession {
            calls: 40,
            first_prompt: 200,
            last_prompt: 400,
            sampled: 8,
            subagent_every: 0,
            subagent_calls: 0,
            subagent_prompt: 0,
        }
        .records("old-worker", 3);
        // One record no batch of this worker can hold.
        records[17].request.body = Some(tokentap_schema::RawJson::from_value(
            &json!({"padding": "p".repeat(2 * LIMIT)}),
        ));
        let too_big = records[17].record_id.clone();
        let mut w = SpoolWriter::open(dir.path(), SpoolConfig::default()).unwrap();
        w.append_batch(&records).unwrap();
        w.sync().unwrap();
        drop(w);

        let metrics = DownstreamMetrics::unregistered();
        let dead = metrics.dead_letters.clone();
        let target = tokenless(url);
        let totals = ship(
            dir.path(),
            &target,
            &drained(Duration::from_secs(5)),
            BatchLimits::default(),
            metrics.clone(),
        )
        .unwrap();

        let got = received.lock().unwrap().clone();
        let want: Vec<String> = records
            .iter()
            .map(|r| r.record_id.clone())
            .filter(|id| *id != too_big)
            .collect();
        assert_eq!(got, want, "every record that fits, once, in order");
        assert_eq!(dead.get(), 1);
        assert_eq!(totals.dead_lettered, 1);
        assert_eq!(
            metrics.records.get(),
            totals.records,
            "acked records counted"
        );
        assert_eq!(
            metrics.backlog_bytes.get(),
            0,
            "drained: nothing left to ship"
        );
        assert!(metrics.last_ack.get() > 1.7e9, "an ack's time in seconds");
        let letters = std::fs::read_to_string(dir.path().join(DEAD_LETTER_FILE)).unwrap();
        let letter: serde_json::Value = serde_json::from_str(letters.trim()).unwrap();
        assert_eq!(letter["record"]["record_id"], too_big.as_str());
        assert!(
            letter["reason"].as_str().unwrap().contains("413"),
            "{letter}"
        );
        // Everything settled: a second run from the cursor sends nothing.
        let before = bodies.lock().unwrap().len();
        let again = ship(
            dir.path(),
            &target,
            &drained(Duration::from_secs(1)),
            BatchLimits::default(),
            metrics.clone(),
        )
        .unwrap();
        assert_eq!((again.records, again.dead_lettered), (0, 0));
        assert_eq!(bodies.lock().unwrap().len(), before);
        // And no body the worker read was over its limit.
        assert!(bodies.lock().unwrap().iter().all(|&b| b <= LIMIT));
    }
}
