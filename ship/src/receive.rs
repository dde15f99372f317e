//! The worker's side of shipping (`tokentap worker`): receives the batches shippers send,
//! keeps them durably in the worker's own spool (dropping record ids it already has), and
//! reconstructs traces from that spool as it grows.
//!
//! Ingest and reconstruction are decoupled by the worker's spool: an ack means "durable here",
//! and the reconstruction thread follows the spool with its own checkpoint, so either can
//! restart without losing or repeating anything. Here beside the shipper, the two ends of one
//! protocol (`tokentap_schema::ship`) are tested against each other.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus::{Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Registry};
use serde_json::json;
use tokentap_control_plane::bearer::{self, BearerToken};
use tokentap_reconstruct::{LiveOptions, LiveReconstructor, LiveStats, RecentIds};
use tokentap_schema::ship::{
    decode_batch, DecodedBatch, ShipAck, ShipLimits, SHIP_LIMITS_PATH, SHIP_PATH,
};
use tokentap_service_kit::metrics::{counter_in, gauge_in};
use tokentap_spool::{
    FsyncPolicy, Handoff, HandoffStats, SpoolConfig, SpoolItem, SpoolReader, SpoolWriter,
};

/// Line bytes of received records kept decoded for reconstruction (eight of the shippers'
/// default 8 MiB batches). Reconstruction keeps up with ingest, so the queue is nearly
/// always short; past this it decodes from the spool and memory stays bounded.
const HANDOFF_BYTES: u64 = 64 << 20;

/// A worker's ingest, as its flags set it.
pub struct ReceiverConfig {
    /// Where received records are kept.
    pub spool: PathBuf,
    /// Where traces are written.
    pub out: PathBuf,
    pub live: LiveOptions,
    /// Largest batch body read, told to shippers at `/v1/ship/limits`.
    pub max_body_bytes: usize,
}

/// A worker's ingest, open: its spool, the reconstruction thread following it, and the HTTP
/// routes ([`Receiver::router`]) to serve.
pub struct Receiver {
    app: Router,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<anyhow::Result<()>>,
}

impl Receiver {
    /// Opens the worker's spool (creating `out`), remembers the ids it holds, and starts
    /// reconstruction; every route but `/health` will need `token`.
    pub fn open(config: &ReceiverConfig, token: BearerToken) -> anyhow::Result<Receiver> {
        let spool = &config.spool;
        std::fs::create_dir_all(&config.out)?;
        // Every id already received: a redelivery after a restart is still a duplicate.
        let mut seen = RecentIds::default();
        if spool.exists() {
            for item in SpoolReader::open(spool)? {
                if let SpoolItem::Record(e) = item? {
                    seen.insert(e.record.record_id);
                }
            }
        }
        let writer = SpoolWriter::open(
            spool,
            SpoolConfig {
                // The ack promises durability; batches are synced explicitly before it.
                fsync: FsyncPolicy::Never,
                ..SpoolConfig::default()
            },
        )
        .with_context(|| format!("opening the worker's spool at {}", spool.display()))?;
        tracing::info!(records = seen.len(), spool = %spool.display(), "worker spool opened");
        let metrics = Arc::new(WorkerMetrics::new());
        let handoff = Handoff::new(HANDOFF_BYTES);
        let ingest = Arc::new(Mutex::new(Ingest {
            writer,
            seen,
            accepted: 0,
            handoff: handoff.clone(),
        }));

        let stop = Arc::new(AtomicBool::new(false));
        let live = LiveReconstructor::open(spool, &config.out, config.live.clone())
            .with_context(|| format!("opening the output at {}", config.out.display()))?
            .with_handoff(handoff.clone());
        let thread = {
            let (stop, metrics, ingest) = (stop.clone(), metrics.clone(), ingest.clone());
            std::thread::Builder::new()
                .name("reconstruct".into())
                .spawn(move || reconstruct_loop(live, &stop, &metrics, &ingest, &handoff))?
        };

        let state = AppState {
            ingest,
            metrics,
            limits: ShipLimits {
                max_body_bytes: config.max_body_bytes as u64,
            },
        };
        Ok(Receiver {
            app: router(state, token, config.max_body_bytes),
            stop,
            thread,
        })
    }

    /// The routes: `POST /v1/ship`, `GET /v1/ship/limits`, `/metrics` (behind the token) and
    /// `/health`.
    pub fn router(&self) -> Router {
        self.app.clone()
    }

    /// Stops reconstruction (checkpointed) once serving has stopped.
    pub fn stop(self) -> anyhow::Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the reconstruction thread panicked"))?
    }
}

struct WorkerMetrics {
    registry: Registry,
    received: IntCounter,
    duplicates: IntCounter,
    rejected: IntCounter,
    reconstructed: IntCounter,
    open_sessions: IntGauge,
    sessions_finished: IntCounter,
    traces: IntCounter,
    merge_ratio: Gauge,
    violations: IntCounter,
    backlog: IntGauge,
    handed_over: IntCounter,
    ingest_lag: Histogram,
}

impl WorkerMetrics {
    fn new() -> WorkerMetrics {
        let registry = Registry::new();
        let counter = |name: &str, help: &str| counter_in(&registry, name, help);
        let gauge = |name: &str, help: &str| gauge_in(&registry, name, help);
        let merge_ratio = Gauge::new(
            "tokentap_worker_merge_ratio",
            "Request-level traces per emitted trace, over finished sessions",
        )
        .expect("valid gauge");
        registry
            .register(Box::new(merge_ratio.clone()))
            .expect("unique");
        let ingest_lag = Histogram::with_opts(
            HistogramOpts::new(
                "tokentap_worker_ingest_lag_seconds",
                "From a call's end at the proxy to its record being durable at the worker",
            )
            .buckets(vec![
                0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0,
            ]),
        )
        .expect("valid histogram");
        registry
            .register(Box::new(ingest_lag.clone()))
            .expect("unique");
        WorkerMetrics {
            received: counter(
                "tokentap_worker_records_received_total",
                "Records received, duplicates included",
            ),
            duplicates: counter(
                "tokentap_worker_duplicates_dropped_total",
                "Received records whose id the worker already had",
            ),
            rejected: counter(
                "tokentap_worker_rejected_lines_total",
                "Received lines that were not valid records",
            ),
            reconstructed: counter(
                "tokentap_worker_records_reconstructed_total",
                "Records fed to reconstruction",
            ),
            open_sessions: gauge(
                "tokentap_worker_open_sessions",
                "Sessions with records but no traces written yet",
            ),
            sessions_finished: counter(
                "tokentap_worker_sessions_finished_total",
                "Sessions whose traces were written",
            ),
            traces: counter("tokentap_worker_traces_emitted_total", "Traces written"),
            violations: counter(
                "tokentap_worker_faithfulness_violations_total",
                "Faithfulness violations found in written traces (should stay 0)",
            ),
            backlog: gauge(
                "tokentap_worker_reconstruct_backlog_records",
                "Records durable in the worker's spool but not yet reconstructed",
            ),
            handed_over: counter(
                "tokentap_worker_records_handed_over_total",
                "Records reconstruction took as ingest had decoded them (the rest it decoded \
                 from the spool: a replay after a restart, or a backlog past the handoff's size)",
            ),
            merge_ratio,
            ingest_lag,
            registry,
        }
    }

    /// Brings the reconstruction figures up to `s` and `handoff` (counters only move
    /// forward).
    fn observe(&self, s: &LiveStats, last: &mut LiveStats, handoff: &HandoffStats) {
        self.handed_over
            .inc_by(handoff.taken.saturating_sub(self.handed_over.get()));
        self.reconstructed
            .inc_by(s.records.saturating_sub(last.records));
        self.sessions_finished
            .inc_by(s.sessions_finished.saturating_sub(last.sessions_finished));
        self.traces
            .inc_by(s.traces_emitted.saturating_sub(last.traces_emitted));
        self.violations
            .inc_by(s.violations.saturating_sub(last.violations));
        self.open_sessions.set(s.open_sessions as i64);
        self.merge_ratio.set(s.merge_ratio());
        *last = *s;
    }
}

struct Ingest {
    writer: SpoolWriter,
    /// Recently received record ids (a bounded window: redeliveries are always recent).
    seen: RecentIds,
    /// Records made durable since start (for the backlog gauge).
    accepted: u64,
    /// The durable records, decoded, for reconstruction to take instead of decoding them again.
    handoff: Handoff,
}

#[derive(Clone)]
struct AppState {
    ingest: Arc<Mutex<Ingest>>,
    metrics: Arc<WorkerMetrics>,
    limits: ShipLimits,
}

fn router(state: AppState, token: BearerToken, max_body_bytes: usize) -> Router {
    let guarded = Router::new()
        .route(SHIP_PATH, post(receive))
        .route(SHIP_LIMITS_PATH, get(limits))
        .route("/metrics", get(render_metrics))
        // Before any body is read: an unauthenticated client cannot make the worker buffer
        // one.
        .route_layer(axum::middleware::from_fn_with_state(token, bearer::require));
    Router::new()
        .merge(guarded)
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

async fn limits(State(state): State<AppState>) -> Response {
    Json(state.limits).into_response()
}

fn reconstruct_loop(
    mut live: LiveReconstructor,
    stop: &AtomicBool,
    metrics: &WorkerMetrics,
    ingest: &Mutex<Ingest>,
    handoff: &Handoff,
) -> anyhow::Result<()> {
    let mut last = LiveStats::default();
    let result = live.run(
        |_| stop.load(Ordering::Relaxed),
        |s| {
            metrics.observe(s, &mut last, &handoff.stats());
            let accepted = ingest.lock().map_or(0, |i| i.accepted);
            metrics
                .backlog
                .set(accepted.saturating_sub(s.records + s.replayed_skipped) as i64);
        },
    );
    if let Err(e) = &result {
        tracing::error!(error = %e, "reconstruction stopped");
    }
    Ok(result?)
}

async fn receive(State(state): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(BytesRejection::FailedToBufferBody(e))
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE =>
        {
            // Says the limit, so a shipper of another version can still split its batches.
            let max = state.limits.max_body_bytes;
            return (
                StatusCode::PAYLOAD_TOO_LARGE,
                Json(json!({
                    "error": {
                        "type": "body_too_large",
                        "message": format!("a batch may hold at most {max} bytes (--max-body-bytes)"),
                    },
                    "max_body_bytes": max,
                })),
            )
                .into_response();
        }
        Err(e) => return e.into_response(),
    };
    let received_at = unix_ms();
    // Decoding lives in the schema crate (fuzzed there: fuzz/fuzz_targets/ship_batch.rs).
    let DecodedBatch {
        records,
        lines,
        mut ack,
    } = decode_batch(&body);
    let metrics = state.metrics.clone();
    let ingest = state.ingest.clone();
    let result = tokio::task::spawn_blocking(move || -> anyhow::Result<ShipAck> {
        let mut ingest = ingest
            .lock()
            .map_err(|_| anyhow::anyhow!("ingest lock poisoned"))?;
        let mut fresh = Vec::with_capacity(records.len());
        let mut fresh_lines: Vec<&[u8]> = Vec::with_capacity(records.len());
        let mut batch_ids = HashSet::new();
        for (r, line) in records.into_iter().zip(lines) {
            if ingest.seen.contains(&r.record_id) || !batch_ids.insert(r.record_id.clone()) {
                ack.duplicates += 1;
            } else {
                fresh.push(r);
                fresh_lines.push(&body[line]);
            }
        }
        if fresh.is_empty() {
            return Ok(ack);
        }
        let ids: Vec<String> = fresh.iter().map(|r| r.record_id.clone()).collect();
        let ended: Vec<u64> = fresh.iter().map(|r| r.ended_at_unix_ms).collect();
        // Durable before the ack: the proxy moves its cursor past these on a 200. Stored as
        // they came: each line decoded to its record, so encoding it again would only cost.
        let Ingest {
            writer, handoff, ..
        } = &mut *ingest;
        handoff.append_encoded(writer, fresh, &fresh_lines)?;
        writer.sync()?;
        ack.accepted = ids.len() as u64;
        ingest.accepted += ack.accepted;
        for ended_at in ended {
            metrics
                .ingest_lag
                .observe(received_at.saturating_sub(ended_at) as f64 / 1000.0);
        }
        ingest.seen.extend(ids);
        Ok(ack)
    })
    .await;
    let m = &state.metrics;
    match result {
        Ok(Ok(ack)) => {
            m.received.inc_by(ack.accepted + ack.duplicates);
            m.duplicates.inc_by(ack.duplicates);
            m.rejected.inc_by(ack.rejected);
            if ack.rejected > 0 {
                tracing::warn!(rejected = ack.rejected, errors = ?ack.errors, "rejected lines of a batch (the shipper keeps them in its dead-letter file)");
            }
            Json(ack).into_response()
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "could not persist a received batch");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("could not persist the batch: {e}"),
            )
                .into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn render_metrics(State(state): State<AppState>) -> Response {
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&state.metrics.registry.gather(), &mut out);
    ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], out).into_response()
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shipper::{ship, BatchLimits, ShipStop, ShipTarget};
    use std::time::Duration;
    use tokentap_reconstruct::synthetic::LongSession;
    use tokentap_spool::downstream::DownstreamMetrics;

    /// The shipper against the worker's own ingest, in one process: every record arrives
    /// once, durable in the worker's spool; a second shipment of the same records (a
    /// shipper that lost its cursor) is all duplicates; a shipper without the token is
    /// refused and gives up at its drain deadline with nothing sent.
    #[test]
    fn the_shipper_and_the_worker_agree() {
        let worker_dir = tempfile::tempdir().unwrap();
        let config = ReceiverConfig {
            spool: worker_dir.path().join("spool"),
            out: worker_dir.path().to_path_buf(),
            live: LiveOptions::default(),
            max_body_bytes: 1 << 20,
        };
        let receiver = Receiver::open(&config, BearerToken::new(Some("t0ken"))).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let app = receiver.router();
        let url = rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let url = format!("http://{}", listener.local_addr().unwrap());
            tokio::spawn(async move { axum::serve(listener, app).await });
            url
        });

        let spool = tempfile::tempdir().unwrap();
        let records = LongSession {
            calls: 30,
            first_prompt: 200,
            last_prompt: 400,
            sampled: 8,
            subagent_every: 0,
            subagent_calls: 0,
            subagent_prompt: 0,
        }
        .records("shipped", 5);
        let mut w = SpoolWriter::open(spool.path(), SpoolConfig::default()).unwrap();
        w.append_batch(&records).unwrap();
        w.sync().unwrap();
        drop(w);
        let run = |token: Option<&str>, deadline: u64| {
            let target = ShipTarget {
                to: url.clone(),
                token: token.map(str::to_owned),
                ca_roots: Vec::new(),
            };
            let stop = ShipStop {
                drain: Arc::new(AtomicBool::new(true)),
                drain_deadline: Duration::from_secs(deadline),
            };
            // Small batches: several round trips.
            let limits = BatchLimits {
                max_records: 7,
                ..BatchLimits::default()
            };
            ship(
                spool.path(),
                &target,
                &stop,
                limits,
                DownstreamMetrics::unregistered(),
            )
            .unwrap()
        };

        let refused = run(None, 1);
        assert_eq!((refused.records, refused.batches), (0, 0), "{refused:?}");
        assert!(refused.retries > 0, "{refused:?}");

        let first = run(Some("t0ken"), 10);
        assert_eq!(first.records, records.len() as u64, "{first:?}");
        assert_eq!((first.duplicates, first.dead_lettered), (0, 0), "{first:?}");
        assert!(first.batches >= 5, "{first:?}");
        std::fs::remove_file(spool.path().join(crate::shipper::CURSOR_FILE)).unwrap();
        let again = run(Some("t0ken"), 10);
        assert_eq!((again.records, again.duplicates), (0, records.len() as u64));

        let kept: Vec<String> = SpoolReader::open(&config.spool)
            .unwrap()
            .map(|item| match item.unwrap() {
                SpoolItem::Record(e) => e.record.record_id,
                _ => panic!("a line of the worker's spool is not a record"),
            })
            .collect();
        let sent: Vec<String> = records.iter().map(|r| r.record_id.clone()).collect();
        assert_eq!(
            kept, sent,
            "each record once, in order, durable at the worker"
        );
        drop(rt);
        receiver.stop().unwrap();
    }
}
