//! `--bus`: records over NATS JetStream instead of a direct ship. The flags; the publisher
//! side (proxy, run, sidecar, node agent) is `tokentap_ship::downstream`; the worker side is
//! `tokentap worker --bus`, one member of a group that splits the partitions.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use clap::Args;
use prometheus::{Encoder, Registry};
use tokentap_bus::group::Member;
use tokentap_bus::partition::{GroupMetrics, WorkerContext};
use tokentap_bus::topology::{Topology, DEFAULT_PARTITIONS};
use tokentap_bus::{BusConnect, BusUser};
use tokentap_control_plane::bearer::{self, BearerToken};
use tokentap_proxy::metrics::{counter_in, gauge_in};
use tokentap_reconstruct::{LiveOptions, TraceSink};

#[derive(Args, Clone, Default)]
pub struct BusArgs {
    /// Publish records to (or, for `worker`, consume them from) NATS JetStream at this URL
    /// (`nats://HOST:PORT`, or `tls://HOST:PORT`); NATS Server 2.9 or newer with JetStream
    /// enabled (`nats-server -js`).
    #[arg(long, value_name = "URL", env = "TOKENTAP_BUS")]
    pub bus: Option<String>,
    /// The NATS server's authorization token.
    #[arg(
        long,
        env = "TOKENTAP_BUS_TOKEN",
        hide_env_values = true,
        requires = "bus"
    )]
    pub bus_token: Option<String>,
    /// This process's user on the bus (a role of the server's `authorization { users }`:
    /// `publisher` for proxies, sidecars and node agents, `worker` for workers, `node` for
    /// rollout nodes; docs/scale-out.md, "Roles on the bus"). Its password comes from
    /// --bus-password-file or TOKENTAP_BUS_PASSWORD.
    #[arg(
        long,
        value_name = "USER",
        env = "TOKENTAP_BUS_USER",
        requires = "bus",
        conflicts_with = "bus_token"
    )]
    pub bus_user: Option<String>,
    /// A file holding the password of --bus-user (one line; a trailing newline is ignored).
    #[arg(
        long,
        value_name = "FILE",
        env = "TOKENTAP_BUS_PASSWORD_FILE",
        requires = "bus_user"
    )]
    pub bus_password_file: Option<PathBuf>,
    /// The password of --bus-user, from the environment only (a command line is readable by
    /// every user of the machine).
    #[arg(
        long,
        env = "TOKENTAP_BUS_PASSWORD",
        hide_env_values = true,
        hide = true,
        requires = "bus_user",
        conflicts_with = "bus_password_file"
    )]
    pub bus_password: Option<String>,
    /// CA certificates (PEM) the bus's TLS certificate chains to; requires TLS.
    #[arg(long, value_name = "PEM", requires = "bus")]
    pub bus_ca: Option<PathBuf>,
    /// Partitions of the records stream, used by the first process on a new bus (the bus
    /// keeps the count; later values are ignored). More partitions than workers, always.
    #[arg(long, default_value_t = DEFAULT_PARTITIONS, requires = "bus")]
    pub bus_partitions: u32,
}

impl BusArgs {
    /// Where the bus is and the credentials to present there (None: no --bus).
    pub fn connect(&self) -> anyhow::Result<Option<BusConnect>> {
        let Some(url) = &self.bus else {
            return Ok(None);
        };
        let user = match &self.bus_user {
            None => None,
            Some(name) => {
                let password = match (&self.bus_password_file, &self.bus_password) {
                    (Some(file), _) => {
                        let text = std::fs::read_to_string(file).with_context(|| {
                            format!("reading --bus-password-file {}", file.display())
                        })?;
                        text.trim_end_matches(['\r', '\n']).to_owned()
                    }
                    (None, Some(password)) => password.clone(),
                    (None, None) => anyhow::bail!(
                        "--bus-user needs its password: --bus-password-file FILE or TOKENTAP_BUS_PASSWORD"
                    ),
                };
                if password.is_empty() {
                    anyhow::bail!("the password of --bus-user {name} is empty");
                }
                Some(BusUser {
                    name: name.clone(),
                    password,
                })
            }
        };
        Ok(Some(BusConnect {
            url: url.clone(),
            token: self.bus_token.clone(),
            user,
            ca: self.bus_ca.clone(),
        }))
    }
}

/// What `tokentap worker --bus` serves besides the group's work.
pub struct BusWorker<'a> {
    pub bus: BusConnect,
    pub partitions: u32,
    pub member: String,
    pub listen: SocketAddr,
    pub token: Option<&'a str>,
    pub tls: &'a tokentap_control_plane::TlsListenArgs,
    pub out: &'a Path,
    pub live: LiveOptions,
}

/// Runs one member of the worker group until SIGTERM/SIGINT, then hands its partitions back
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
        crate::signals::shutdown_signal(),
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
