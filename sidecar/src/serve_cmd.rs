//! `tokentap serve`: a rollout node — the task store, the staged pipeline, in-process capture
//! with a session per sample behind the admission gate, and the HTTP control plane.
//! [`NodeArgs`] (everything but the control plane) is shared with `tokentap generate`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tokentap_rollout::api::{router, ApiState};
use tokentap_rollout::capture::{observer, NodeCapture, SessionIndex};
use tokentap_rollout::gate::{Gate, NodeGate};
use tokentap_rollout::pipeline::{Pipeline, PipelineConfig};
use tokentap_rollout::sandbox::SandboxConfig;
use tokentap_rollout::store::Store;
use tokentap_rollout::transparent::TransparentConfig;

use crate::signals::shutdown_signal;
use tokentap_proxy::cli::CaptureArgs;
use tokentap_proxy::cli::InterceptArgs;

/// A rollout node's pipeline and capture.
#[derive(Args)]
pub struct NodeArgs {
    /// The node's state (node.redb), per-sample directories and, unless --spool says
    /// otherwise, its capture spool (DATA/spool) [default: tokentap-node; OUT/node for
    /// generate].
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Samples in INIT at once (copying workspaces, set-up).
    #[arg(long, default_value_t = 2)]
    init_workers: usize,
    /// Agents running at once.
    #[arg(long, default_value_t = 4)]
    run_workers: usize,
    /// Samples in POST_RUN at once (reconstruction, evaluation).
    #[arg(long, default_value_t = 2)]
    post_workers: usize,
    /// Node restarts a running sample survives before it is failed.
    #[arg(long, default_value_t = 3)]
    max_attempts: u32,
    /// Samples prepared (workspace copied, set-up run) ahead of a free agent slot.
    #[arg(long, default_value_t = 2)]
    prewarm: usize,
    /// Directories searched first for harness binaries and node (colon-separated); the
    /// node's PATH follows.
    #[arg(long, env = "TOKENTAP_HARNESS_PATH")]
    harness_path: Option<String>,
    /// The model name harnesses are told to use (calls go to the engine's model).
    #[arg(long, default_value = "tokentap-policy")]
    harness_model: String,
    /// Send harnesses' HTTP(S) beyond loopback to a dead local proxy (no telemetry or update
    /// checks leave the node; the capture URL is loopback and unaffected).
    #[arg(long)]
    block_egress: bool,
    /// Memory limit of each agent's cgroup, in MiB, where the task sets none.
    #[arg(long)]
    sample_memory_mb: Option<u64>,
    /// CPU limit of each agent's cgroup, in cores (e.g. 0.5), where the task sets none.
    #[arg(long)]
    sample_cpus: Option<f64>,
    /// Process limit of each agent's cgroup, where the task sets none.
    #[arg(long)]
    sample_pids: Option<u64>,
    /// Give each sample a file system of its own of this many MiB (a sparse ext4 image,
    /// loop-mounted over its directory from INIT to its end): its working copy, HOME, TMPDIR,
    /// evaluation copy and logs, so a sample that writes without end gets ENOSPC, not the
    /// node's disk. Root only (loop devices, mkfs.ext4); checked at start. Unset: uncapped.
    #[arg(long, value_parser = clap::value_parser!(u64).range(tokentap_rollout::sample_disk::MIN_DISK_MB..=(1 << 24)))]
    sample_disk_mb: Option<u64>,
    /// Run every agent in a bubblewrap sandbox (no network but the capture, nothing of the
    /// node visible, only its own directories writable); without it, only tasks with
    /// `"sandbox": true` are. Set-up and evaluation commands are sandboxed whenever the node
    /// has bubblewrap.
    #[arg(long)]
    sandbox: bool,
    /// The host uid (and gid) sandboxed task code runs as when the node runs as root.
    #[arg(long, default_value_t = 65534)]
    sandbox_uid: u32,
    /// Most model calls one sample's agent may make; past it its calls are refused (400,
    /// counted in tokentap_calls_refused_total{reason="session_budget"}, not recorded).
    #[arg(long, default_value_t = 4096)]
    sample_max_calls: u64,
    /// Most bytes of requests one sample's agent may send to the capture (each call's body
    /// counts; the records a running sample holds grow with it); past it its calls are
    /// refused like past --sample-max-calls.
    #[arg(long, default_value_t = 512 << 20)]
    sample_max_request_bytes: u64,
    /// Most samples one task may ask for.
    #[arg(long, default_value_t = 1024)]
    max_samples_per_task: u32,
    /// Longest budget (session, agent or evaluation, in seconds) a task may ask for.
    #[arg(long, default_value_t = 24 * 3600)]
    max_budget_s: u64,
    /// For tasks with `"capture": "transparent"` (agents with hard-coded endpoints); the
    /// node's CA defaults to DATA/ca. Needs root and tokentap built with its eBPF program.
    #[command(flatten)]
    interception: InterceptArgs,
    #[command(flatten)]
    pub capture: CaptureArgs,
    /// Samples come from a cluster's queue (`serve --bus`), not from this node's store.
    #[arg(skip)]
    pub clustered: bool,
}

/// A started node (inside a tokio runtime).
pub struct Node {
    pub pipeline: Arc<Pipeline>,
    pub capture: Arc<NodeCapture>,
}

/// What must be built before the runtime (model discovery runs its own small one).
pub struct NodeParts {
    service: tokentap_proxy::CaptureService,
    index: Arc<SessionIndex>,
    gate: Arc<NodeGate>,
    store: Arc<Store>,
    pub spool_thread: Option<std::thread::JoinHandle<()>>,
}

impl NodeParts {
    /// The capture's metrics (what a downstream of the node's spool counts on).
    pub fn metrics(&self) -> &tokentap_proxy::metrics::Metrics {
        self.service.metrics()
    }
}

impl NodeArgs {
    /// The data directory, absolute (sandboxes and task code are given its paths from other
    /// working directories).
    pub fn data_dir(&self) -> PathBuf {
        let dir = self
            .data
            .clone()
            .unwrap_or_else(|| PathBuf::from("tokentap-node"));
        std::path::absolute(&dir).unwrap_or(dir)
    }

    pub fn prepare(&mut self) -> anyhow::Result<NodeParts> {
        let data = self.data_dir();
        tokentap_spool::owner_only::create_dir_all(&data)?;
        // A node keeps everything under its data directory, never in the working directory.
        if self.capture.spool == Path::new(tokentap_proxy::cli::DEFAULT_SPOOL) {
            self.capture.spool = data.join("spool");
        }
        let index = Arc::new(SessionIndex::of_spool(&self.capture.spool));
        let (service, spool_thread) = self
            .capture
            .build_observed(None, Some(observer(index.clone())))?;
        let gate = NodeGate::new(self.capture.policy_version.clone());
        let service = service
            .with_gate(Arc::new(Gate(gate.clone())))
            .with_session_budget(tokentap_proxy::session::SessionBudget {
                max_calls: Some(self.sample_max_calls),
                max_request_bytes: Some(self.sample_max_request_bytes),
            })
            // Agents are hostile here: only the options real harnesses send, by default.
            .with_engine_options(self.capture.engine_option_policy(
                tokentap_proxy::engine_options::EngineOptionPolicy::rollout_default(),
            )?);
        let store = Arc::new(
            Store::open(&data.join("node.redb"))
                .with_context(|| format!("opening the node's store in {}", data.display()))?,
        );
        Ok(NodeParts {
            service,
            index,
            gate,
            store,
            spool_thread,
        })
    }

    pub async fn start(&self, parts: NodeParts) -> anyhow::Result<Node> {
        let capture = Arc::new(NodeCapture::start(parts.service, parts.index).await?);
        let mut config = PipelineConfig::new(self.data_dir());
        config.init_workers = self.init_workers;
        config.run_workers = self.run_workers;
        config.post_workers = self.post_workers;
        config.max_attempts = self.max_attempts;
        config.capture = Some(capture.clone());
        config.gate = Some(parts.gate);
        config.prewarm = self.prewarm;
        config.delivery.ca_roots = self.capture.ca_roots()?;
        config.harness_model = self.harness_model.clone();
        config.block_egress = self.block_egress;
        config.limits = tokentap_cgroup::Limits {
            memory_mb: self.sample_memory_mb,
            cpus: self.sample_cpus,
            pids: self.sample_pids,
        };
        config.disk_mb = self.sample_disk_mb;
        match self.sample_disk_mb {
            Some(mb) => {
                let data = self.data_dir();
                tokio::task::spawn_blocking(move || {
                    tokentap_rollout::sample_disk::check_available(&data)
                })
                .await??;
                tracing::info!(mb, "each sample writes on a file system of its own");
            }
            None => tracing::info!(
                "samples' disk use is not capped (--sample-disk-mb gives each its own file system)"
            ),
        }
        config.ceilings = tokentap_rollout::task::NodeCeilings {
            max_samples: self.max_samples_per_task,
            max_budget_s: self.max_budget_s,
        };
        config.sandbox = match tokentap_rollout::preset::on_path(
            "bwrap",
            &std::env::var("PATH").unwrap_or_default(),
        ) {
            Some(bwrap) => Some(tokentap_rollout::sandbox::SandboxConfig {
                bwrap,
                shim: std::env::current_exe()?,
                always: self.sandbox,
                data_dir: self.data_dir(),
                // SAFETY: geteuid(2) cannot fail.
                run_as: SandboxConfig::run_as_for(unsafe { libc::geteuid() }, self.sandbox_uid),
            }),
            None if self.sandbox => {
                anyhow::bail!("--sandbox needs bubblewrap (`bwrap`) on PATH")
            }
            None => None,
        };
        config.transparent = match tokentap_ebpf::preflight(true) {
            Ok(_) => {
                crate::run_cmd::remove_stale_interception();
                let ca = self.interception.ca(self.data_dir().join("ca"))?;
                let bundle = self.data_dir().join("ca-bundle.pem");
                ca.write_bundle(&bundle)?;
                Some(Arc::new(TransparentConfig {
                    ca,
                    intercept: self.interception.intercept_list(),
                    ports: self.interception.ports(),
                    bundle,
                }))
            }
            Err(e) => {
                tracing::info!(reason = %e, "no transparent capture on this node");
                None
            }
        };
        if let Some(extra) = &self.harness_path {
            config.harness_path = format!("{extra}:{}", config.harness_path);
        }
        config.clustered = self.clustered;
        let pipeline = Arc::new(Pipeline::start(parts.store, config).await?);
        Ok(Node { pipeline, capture })
    }
}

#[derive(Args)]
#[command(after_help = "Examples:
  tokentap serve --backend http://gpu:8000 --backend-kind vllm --data ./node --spool ./node/spool
  curl -H 'authorization: Bearer $TOKENTAP_NODE_TOKEN' -d @task.json http://127.0.0.1:8700/v1/rollouts
  curl -H 'authorization: Bearer $TOKENTAP_NODE_TOKEN' 'http://127.0.0.1:8700/v1/results?after=0&wait=30'
  curl -H 'authorization: Bearer $TOKENTAP_NODE_TOKEN' http://127.0.0.1:8700/openapi.json

Every route but /health (/metrics and /openapi.json included) needs the token when one is set;
a listen address beyond loopback needs one.")]
pub struct ServeArgs {
    /// Address of the control plane; anything but loopback needs --token.
    #[arg(long, default_value = "127.0.0.1:8700")]
    listen: SocketAddr,
    /// Bearer token required on every route of the control plane but /health.
    #[arg(long, env = "TOKENTAP_NODE_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(flatten)]
    tls: tokentap_control_plane::TlsListenArgs,
    /// The viewer at /view/ (behind --token) shows token text from the engine's /detokenize
    /// (llama.cpp, vLLM) unless one of these says otherwise.
    #[command(flatten)]
    view_text: crate::view_cmd::TokenTextArgs,
    /// Share the work with the other nodes on this bus (NATS JetStream): samples from one
    /// queue, state, results, events, callbacks and pause/resume shared, any node's API
    /// answering for all; the node's records are published to the bus too.
    #[command(flatten)]
    bus: crate::bus_cmd::BusArgs,
    /// This node's name in the cluster [default: HOSTNAME-PID].
    #[arg(long, requires = "bus")]
    node_id: Option<String>,
    /// A claimed sample whose node stops confirming progress for this long is given to
    /// another node (a new attempt). Set by the first node on a new bus.
    #[arg(long, value_name = "SECONDS", default_value_t = 30, requires = "bus")]
    sample_ack_wait: u64,
    /// The cluster's task key (required with --bus): a file only its owner reads (0600), at
    /// least 32 bytes, held by every rollout node of the bus and by nothing else. A node seals
    /// the rollouts it accepts with it and runs only those whose seal holds, since everything
    /// that holds the bus credential (proxies, sidecars, workers) can put tasks on the bus.
    /// Make one with `head -c 32 /dev/urandom | base64 > KEY && chmod 600 KEY`.
    #[arg(
        long,
        value_name = "FILE",
        env = "TOKENTAP_TASK_KEY_FILE",
        requires = "bus"
    )]
    task_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub node: NodeArgs,
}

pub fn run(mut args: ServeArgs) -> anyhow::Result<()> {
    tokentap_control_plane::check_exposure(
        args.listen,
        args.token.as_deref(),
        "--token",
        "TOKENTAP_NODE_TOKEN",
    )?;
    let token_text = args
        .view_text
        .token_text(args.node.capture.detokenizer())
        .context("the viewer's token text")?;
    // Every sample's connections count against one limit: the soft default (often 1024) is
    // the first thing a flood would reach.
    match tokentap_rollout::accept::raise_open_files_limit() {
        Ok(limit) => tracing::debug!(limit, "open files"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
    }
    let bus = args.bus.connect()?;
    let task_key = match (&bus, &args.task_key_file) {
        (Some(_), Some(path)) => Some(tokentap_rollout::cluster::TaskKey::from_file(path)?),
        (Some(_), None) => anyhow::bail!(
            "--bus needs --task-key-file (TOKENTAP_TASK_KEY_FILE): the key every rollout node of the cluster seals and checks tasks with; without it anything holding the bus credential could run commands on this node"
        ),
        (None, _) => None,
    };
    args.node.clustered = bus.is_some();
    let mut parts = args.node.prepare()?;
    let spool_thread = parts.spool_thread.take();
    // The node's records go to the bus's records stream too, for its worker group.
    let drain = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let publisher = match &bus {
        Some(bus) => Some(tokentap_ship::downstream::start_publisher(
            &args.node.capture.spool,
            bus.clone(),
            args.bus.bus_partitions,
            drain.clone(),
            parts.metrics().downstream(),
        )?),
        None => None,
    };
    let rt = crate::runtime::build()?;
    rt.block_on(async {
        let node = args.node.start(parts).await?;
        let cluster = match &bus {
            Some(bus) => {
                // A cluster node can do nothing without its bus: no bus, no node.
                let client = tokentap_bus::connect_now(bus, "tokentap serve")
                    .await
                    .with_context(|| format!("connecting to the bus at {}", bus.url))?;
                let node_id = args
                    .node_id
                    .clone()
                    .unwrap_or_else(tokentap_ship::bus_worker::default_member_id);
                let options = tokentap_rollout::cluster::QueueOptions {
                    ack_wait: std::time::Duration::from_secs(args.sample_ack_wait.max(1)),
                    max_attempts: node.pipeline.max_attempts(),
                    callback_timeout: node.pipeline.delivery().timeout,
                };
                Some(
                    tokentap_rollout::cluster::join(
                        client,
                        node_id,
                        node.pipeline.clone(),
                        options,
                        task_key.expect("checked with the bus above"),
                    )
                    .await
                    .context("joining the cluster on the bus")?,
                )
            }
            None => None,
        };
        let service = node.capture.service.clone();
        let pipeline = node.pipeline.clone();
        let view = tokentap_viewer::ViewSources {
            spool: Some(args.node.capture.spool.clone()),
            traces: Some(tokentap_viewer::TraceFiles::Listed(Box::new(move || {
                pipeline.store().trajectory_files().unwrap_or_default()
            }))),
            text: token_text,
        };
        let app = router(ApiState {
            pipeline: node.pipeline.clone(),
            token: args.token.clone(),
            extra_metrics: Some(Arc::new(move || service.metrics().render())),
            cluster,
        })
        .merge(crate::view_cmd::routes(view, args.token.as_deref()));
        let (capture, data) = (node.capture.addr, args.node.data_dir());
        tokentap_control_plane::serve(args.listen, &args.tls, app, shutdown_signal(), |listen, tls| {
            tracing::info!(%listen, tls, %capture, data = %data.display(), "tokentap rollout node ready")
        })
        .await
    })?;
    // Running samples are re-run after the next start (the store says where they were), or,
    // on a cluster, by whichever node the bus gives them to.
    drop(rt);
    if let Some(t) = spool_thread {
        let _ = t.join();
    }
    drain.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(p) = publisher {
        let _ = p.join();
    }
    Ok(())
}
