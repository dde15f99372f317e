//! `tokentap worker`: receives records shipped by proxies, keeps them durably in its own spool
//! (dropping record ids it already has), and reconstructs traces from that spool as it grows.
//!
//! Ingest and reconstruction are decoupled by the worker's spool: an ack means "durable here",
//! and the reconstruction thread follows the spool with its own checkpoint, so either can
//! restart without losing or repeating anything.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args;
use prometheus::{Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntGauge, Registry};
use serde_json::json;
use tokentap_control_plane::bearer::{self, BearerToken};
use tokentap_proxy::metrics::{counter_in, gauge_in};
use tokentap_reconstruct::{LiveOptions, LiveReconstructor, LiveStats, RecentIds};
use tokentap_schema::ship::{
    decode_batch, DecodedBatch, ShipAck, ShipLimits, SHIP_LIMITS_PATH, SHIP_PATH,
};
use tokentap_spool::{
    FsyncPolicy, Handoff, HandoffStats, SpoolConfig, SpoolItem, SpoolReader, SpoolWriter,
};

use crate::reconstruct_cmd::StrategyArg;

/// Line bytes of received records kept decoded for reconstruction (eight of the shippers'
/// default 8 MiB batches). Reconstruction keeps up with ingest, so the queue is nearly
/// always short; past this it decodes from the spool and memory stays bounded.
const HANDOFF_BYTES: u64 = 64 << 20;

#[derive(Args)]
#[command(after_help = "Examples:
  # on the worker node
  TOKENTAP_WORKER_TOKEN=... tokentap worker --listen 0.0.0.0:8900 --out ./traces
  # on each proxy node
  TOKENTAP_WORKER_TOKEN=... tokentap proxy --backend http://gpu:8000 --backend-kind vllm \
      --ship-to http://worker:8900

Output (in --out): traces.jsonl, sessions.jsonl, parquet/part-*.parquet; the received records
in --out/spool; /metrics on the listen address. Every route but /health needs the token when
one is set; a listen address beyond loopback needs one.")]
pub struct WorkerArgs {
    /// Address to receive records on (also serves /health, /metrics and /v1/ship/limits);
    /// anything but loopback needs --token.
    #[arg(long, default_value = "127.0.0.1:8900")]
    listen: SocketAddr,
    /// Bearer token required on every route but /health (shippers send it with
    /// --ship-token, or the same environment variable).
    #[arg(long, env = "TOKENTAP_WORKER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Largest batch body read, in bytes (told to shippers at /v1/ship/limits; a record
    /// bigger than this is dead-lettered by its shipper). Records hold the harness request
    /// and the engine's prompt, so leave room for about three times the proxies'
    /// --max-body-bytes. At least 1 MiB: shippers ignore a smaller limit (it would
    /// dead-letter nearly every record unsent).
    #[arg(long, default_value_t = 128 << 20, value_parser = at_least_the_shippers_floor)]
    max_body_bytes: usize,
    #[command(flatten)]
    tls: tokentap_control_plane::TlsListenArgs,
    /// Output directory for traces.
    #[arg(long)]
    out: PathBuf,
    /// Where received records are kept (default: OUT/spool).
    #[arg(long)]
    spool: Option<PathBuf>,
    #[command(flatten)]
    live: LiveArgs,
    /// Consume records from NATS JetStream as one member of a worker group (the group splits
    /// the records' partitions by lease) instead of receiving shipped batches.
    #[command(flatten)]
    bus: crate::bus_cmd::BusArgs,
    /// This worker's name in the group (unique; default: host name and process id).
    #[arg(long, requires = "bus")]
    member_id: Option<String>,
}

/// Reconstruction options shared by the worker and local mode.
#[derive(Args, Clone)]
pub struct LiveArgs {
    /// How traces are built.
    #[arg(long, value_enum, default_value = "prefix-merge")]
    pub strategy: StrategyArg,
    /// Finish a session (write its traces) once none of its calls has ended for this many
    /// seconds.
    #[arg(long, default_value_t = 60)]
    pub session_idle: u64,
}

impl LiveArgs {
    pub fn options(&self) -> LiveOptions {
        LiveOptions {
            strategy: self.strategy.into(),
            session_idle: Duration::from_secs(self.session_idle),
            ..LiveOptions::default()
        }
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

pub fn run(args: WorkerArgs) -> anyhow::Result<()> {
    tokentap_control_plane::check_exposure(
        args.listen,
        args.token.as_deref(),
        "--token",
        "TOKENTAP_WORKER_TOKEN",
    )?;
    if let Some(bus) = args.bus.connect()? {
        return crate::bus_cmd::run_worker(crate::bus_cmd::BusWorker {
            bus,
            partitions: args.bus.bus_partitions,
            member: args
                .member_id
                .clone()
                .unwrap_or_else(crate::bus_cmd::default_member_id),
            listen: args.listen,
            token: args.token.as_deref(),
            tls: &args.tls,
            out: &args.out,
            live: args.live.options(),
        });
    }
    let spool = args.spool.clone().unwrap_or_else(|| args.out.join("spool"));
    std::fs::create_dir_all(&args.out)?;
    // Every id already received: a redelivery after a restart is still a duplicate.
    let mut seen = RecentIds::default();
    if spool.exists() {
        for item in SpoolReader::open(&spool)? {
            if let SpoolItem::Record(e) = item? {
                seen.insert(e.record.record_id);
            }
        }
    }
    let writer = SpoolWriter::open(
        &spool,
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
    let live = LiveReconstructor::open(&spool, &args.out, args.live.options())
        .with_context(|| format!("opening the output at {}", args.out.display()))?
        .with_handoff(handoff.clone());
    let live_thread = {
        let (stop, metrics, ingest) = (stop.clone(), metrics.clone(), ingest.clone());
        std::thread::Builder::new()
            .name("reconstruct".into())
            .spawn(move || reconstruct_loop(live, &stop, &metrics, &ingest, &handoff))?
    };

    let state = AppState {
        ingest,
        metrics: metrics.clone(),
        limits: ShipLimits {
            max_body_bytes: args.max_body_bytes as u64,
        },
    };
    let app = router(
        state,
        BearerToken::new(args.token.as_deref()),
        args.max_body_bytes,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(tokentap_control_plane::serve(
        args.listen,
        &args.tls,
        app,
        shutdown_signal(),
        |listen, tls| tracing::info!(%listen, tls, out = %args.out.display(), "tokentap worker ready"),
    ))?;
    stop.store(true, Ordering::Relaxed);
    live_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the reconstruction thread panicked"))??;
    tracing::info!("tokentap worker stopped");
    Ok(())
}

/// `--max-body-bytes`, refused below [`tokentap_ship::shipper::MIN_WORKER_LIMIT`], the least limit a
/// shipper believes.
fn at_least_the_shippers_floor(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if (n as u64) < tokentap_ship::shipper::MIN_WORKER_LIMIT {
        return Err(format!(
            "{n} is below {} bytes, the least body limit a shipper believes; a record is tens of KB, a long session's calls a few MB",
            tokentap_ship::shipper::MIN_WORKER_LIMIT
        ));
    }
    Ok(n)
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

async fn shutdown_signal() {
    crate::signals::shutdown_signal().await;
    tracing::info!("shutting down: finishing in-flight batches, checkpointing reconstruction");
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker cannot be started with a body limit its shippers would not believe (and
    /// would, before, have dead-lettered nearly every record for).
    #[test]
    fn a_body_limit_under_the_shippers_floor_is_refused() {
        let floor = tokentap_ship::shipper::MIN_WORKER_LIMIT as usize;
        let err = at_least_the_shippers_floor("1000").unwrap_err();
        assert!(
            err.contains("1000") && err.contains(&floor.to_string()),
            "{err}"
        );
        assert!(at_least_the_shippers_floor(&(floor - 1).to_string()).is_err());
        assert_eq!(at_least_the_shippers_floor(&floor.to_string()), Ok(floor));
        assert!(at_least_the_shippers_floor("lots").is_err());
    }
}
