//! The worker's end over the bus (`tokentap worker --bus`): one member of a worker group
//! (`tokentap_bus::group`), reconstructing the partitions it leases into its output, with
//! `/metrics` (behind the token) and `/health` on the control plane's listener.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use prometheus::{Encoder, Registry};
use tokentap_bus::group::Member;
use tokentap_bus::partition::{GroupMetrics, WorkerContext};
use tokentap_bus::topology::Topology;
use tokentap_bus::BusConnect;
use tokentap_control_plane::bearer::{self, BearerToken};
use tokentap_reconstruct::{LiveOptions, TraceSink};
use tokentap_service_kit::metrics::{counter_in, gauge_in};

/// What `tokentap worker --bus` serves besides the group's work.
pub struct BusWorker<'a> {
    /// Resolves when the worker should stop (SIGTERM, SIGINT).
    pub shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
    pub bus: BusConnect,
    pub partitions: u32,
    pub member: String,
    pub listen: SocketAddr,
    pub token: Option<&'a str>,
    pub tls: &'a tokentap_control_plane::TlsListenArgs,
    pub out: &'a Path,
    pub live: LiveOptions,
}

/// Runs one member of the worker group until `shutdown`, then hands its partitions back
/// (checkpointed) and writes its last Parquet part.
pub fn run_worker(w: BusWorker<'_>) -> anyhow::Result<()> {
    std::fs::create_dir_all(w.out)?;
    let sink = TraceSink::open(w.out)
        .with_context(|| format!("opening the output at {}", w.out.display()))?;
    let out = Arc::new(Mutex::new(sink));
    let registry = Registry::new();
    let metrics = GroupMetrics::new(
        |name, help| counter_in(&registry, name, help),
        |name, help| gauge_in(&registry, name, help),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let group = {
        let (bus, out, live, member) =
            (w.bus.clone(), out.clone(), w.live.clone(), w.member.clone());
        let partitions = w.partitions;
        let mut stopping = stopped.clone();
        rt.spawn(async move {
            // A bus that is down at start is waited for (the HTTP side answers meanwhile).
            let joined = async {
                let client = tokentap_bus::connect(&bus, "tokentap worker").await?;
                let js = tokentap_bus::jetstream(client);
                let ensured = tokentap_bus::topology::until_reachable(
                    || Topology::ensure(js.clone(), partitions),
                    || false,
                );
                anyhow::Context::context(ensured.await, "stopped waiting for the bus")
            };
            let topology = tokio::select! {
                t = joined => t?,
                _ = stopping.wait_for(|&s| s) => return Ok(()),
            };
            tracing::info!(member = %member, partitions = topology.partitions, bus = %bus.url, "joined the worker group");
            Member::new(WorkerContext {
                topology,
                member,
                options: live,
                out,
                metrics,
            })
            .run(stopped)
            .await
        })
    };
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            BearerToken::new(w.token),
            bearer::require,
        ))
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::new(registry));
    rt.block_on(tokentap_control_plane::serve(
        w.listen,
        w.tls,
        app,
        w.shutdown,
        |listen, tls| tracing::info!(%listen, tls, out = %w.out.display(), "tokentap worker ready (bus)"),
    ))?;
    tracing::info!("shutting down: handing partitions back");
    let _ = stop.send(true);
    let result = rt.block_on(group);
    let mut sink = out
        .lock()
        .map_err(|_| anyhow::anyhow!("the trace output's lock is poisoned"))?;
    sink.flush()?;
    match result {
        Ok(r) => r,
        Err(e) => Err(anyhow::anyhow!("the worker group task failed: {e}")),
    }
}

async fn render_metrics(State(registry): State<Arc<Registry>>) -> Response {
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut out);
    ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], out).into_response()
}

/// A member id unique in the group: this host's name and process id.
pub fn default_member_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}
