//! A rollout node's flags as clap arguments (the `clap` feature, for the `tokentap` binary's
//! `serve` and `generate`): [`NodeArgs`], and the node they build — the capture behind the
//! gate ([`NodeArgs::prepare`]), then the pipeline with its limits, sandbox and transparent
//! capture ([`NodeArgs::start`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tokentap_proxy::cli::{CaptureArgs, InterceptArgs, DEFAULT_SPOOL};

use crate::capture::{observer, NodeCapture, SessionIndex, TextModeSamples};
use crate::gate::{Gate, NodeGate};
use crate::pipeline::{Pipeline, PipelineConfig};
use crate::sandbox::SandboxConfig;
use crate::store::Store;
use crate::task::TokenMode;
use crate::transparent::TransparentConfig;

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
    #[arg(long, value_parser = clap::value_parser!(u64).range(crate::sample_disk::MIN_DISK_MB..=(1 << 24)))]
    sample_disk_mb: Option<u64>,
    /// Run every agent in a bubblewrap sandbox (no network but the capture, nothing of the
    /// node visible, only its own directories writable); without it, only tasks with
    /// `"sandbox": true` are. Set-up and evaluation commands are sandboxed whenever the node
    /// has bubblewrap.
    #[arg(long)]
    sandbox: bool,
    /// The host uids (and gids) sandboxed task code runs as when the node runs as root, one
    /// per sample at a time (FIRST-LAST): the kernel counts inotify instances, processes and
    /// more per uid, so samples sharing one would starve each other. A sample leases the
    /// lowest free uid at INIT and gives it back at its end, once no process of it is left;
    /// with all in use, the next sample's INIT waits. The nodes of one host lease through
    /// locks in /run/tokentap/sandbox-uids, so they never share a uid whatever their ranges.
    /// Keep the range free of other users.
    #[arg(long, default_value = "200000-200999", value_parser = crate::uids::UidPool::parse_range)]
    sandbox_uid_range: (u32, u32),
    /// Run every sample's sandboxed task code as this one uid instead of a uid per sample
    /// (what nodes did before --sandbox-uid-range; samples then share per-uid limits).
    #[arg(long, conflicts_with = "sandbox_uid_range")]
    sandbox_uid: Option<u32>,
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
    text_mode: Arc<TextModeSamples>,
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
        if self.capture.spool == Path::new(DEFAULT_SPOOL) {
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
        let text_mode = Arc::new(TextModeSamples::default());
        let service = self.with_text_mode_tasks(service, &text_mode)?;
        let store = Arc::new(
            Store::open(&data.join("node.redb"))
                .with_context(|| format!("opening the node's store in {}", data.display()))?,
        );
        Ok(NodeParts {
            service,
            index,
            text_mode,
            gate,
            store,
            spool_thread,
        })
    }

    /// On a node started in a token mode, tasks asking for `"token_mode": "off"` run in text
    /// mode: their samples' calls go to the engine called with text, unobserved. A node in
    /// text mode runs every call so already.
    fn with_text_mode_tasks(
        &self,
        service: tokentap_proxy::CaptureService,
        samples: &Arc<TextModeSamples>,
    ) -> anyhow::Result<tokentap_proxy::CaptureService> {
        if TokenMode::from(self.capture.token_mode()) == TokenMode::Off {
            return Ok(service);
        }
        Ok(service.with_text_mode_sessions(self.capture.text_backend()?, samples.clone()))
    }

    pub async fn start(&self, parts: NodeParts) -> anyhow::Result<Node> {
        let capture =
            Arc::new(NodeCapture::start(parts.service, parts.index, parts.text_mode).await?);
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
                tokio::task::spawn_blocking(move || crate::sample_disk::check_available(&data))
                    .await??;
                tracing::info!(mb, "each sample writes on a file system of its own");
            }
            None => tracing::info!(
                "samples' disk use is not capped (--sample-disk-mb gives each its own file system)"
            ),
        }
        config.ceilings = crate::task::NodeCeilings {
            max_samples: self.max_samples_per_task,
            max_budget_s: self.max_budget_s,
            token_mode: self.capture.token_mode().into(),
        };
        // SAFETY: geteuid(2) cannot fail.
        let euid = unsafe { libc::geteuid() };
        config.sandbox =
            match crate::runner::on_path("bwrap", &std::env::var("PATH").unwrap_or_default()) {
                Some(bwrap) => Some(SandboxConfig {
                    bwrap,
                    shim: std::env::current_exe()?,
                    always: self.sandbox,
                    data_dir: self.data_dir(),
                    run_as: SandboxConfig::run_as_for(
                        euid,
                        self.sandbox_uid.unwrap_or(self.sandbox_uid_range.0),
                    ),
                }),
                None if self.sandbox => {
                    anyhow::bail!("--sandbox needs bubblewrap (`bwrap`) on PATH")
                }
                None => None,
            };
        let root_sandbox = config.sandbox.as_ref().is_some_and(|s| s.run_as.is_some());
        if root_sandbox && self.sandbox_uid.is_none() {
            let (first, last) = self.sandbox_uid_range;
            let pool = crate::uids::UidPool::new(first, last)?;
            let held = self.run_workers.max(1) + self.prewarm;
            if (last - first + 1) as usize <= held {
                tracing::warn!(first, last, held, "the sandbox uid range is no larger than the samples a node holds at once; samples will wait for a uid");
            }
            tracing::info!(
                first,
                last,
                "each sample's sandboxed task code runs as a uid of its own"
            );
            config.uids = Some(pool);
        }
        config.transparent = match tokentap_ebpf::preflight(true) {
            Ok(_) => {
                tokentap_ebpf::remove_stale_interception();
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        node: NodeArgs,
    }

    /// A node's flags with an engine nothing listens at (its model given, so none is asked).
    fn node(extra: &[&str]) -> Result<NodeArgs, clap::Error> {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let engine = format!("http://{}", closed.local_addr().unwrap());
        let base = ["tokentap", "--backend", &engine, "--backend-kind", "vllm"];
        let args = base
            .iter()
            .chain(["--backend-model", "m"].iter())
            .chain(extra);
        Cmd::try_parse_from(args).map(|c| c.node)
    }

    #[test]
    fn the_data_directory_is_absolute_and_holds_the_spool_by_default() {
        let args = node(&[]).unwrap();
        assert_eq!(
            args.data_dir(),
            std::path::absolute("tokentap-node").unwrap()
        );
        assert_eq!((args.init_workers, args.run_workers), (2, 4));
        assert!(!args.clustered);

        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("node");
        let mut args = node(&["--data", data.to_str().unwrap()]).unwrap();
        let mut parts = args.prepare().unwrap();
        assert_eq!(args.capture.spool, data.join("spool"));
        assert!(data.join("spool").is_dir() && data.join("node.redb").is_file());
        assert!(!parts.metrics().render().is_empty());
        // The spool writer ends once the capture service is gone.
        let spool_thread = parts.spool_thread.take().unwrap();
        drop(parts);
        spool_thread.join().unwrap();
    }

    #[test]
    fn a_spool_given_stays_where_it_was_given() {
        let dir = tempfile::tempdir().unwrap();
        let spool = dir.path().join("elsewhere");
        let data = dir.path().join("node");
        let (data_flag, spool_flag) = (data.to_str().unwrap(), spool.to_str().unwrap());
        let mut args = node(&["--data", data_flag, "--spool", spool_flag]).unwrap();
        let _parts = args.prepare().unwrap();
        assert_eq!(args.capture.spool, spool);
        assert!(spool.is_dir() && !data.join("spool").exists());
    }

    #[test]
    fn a_sample_disk_below_the_least_is_refused() {
        let too_small = (crate::sample_disk::MIN_DISK_MB - 1).to_string();
        let e = node(&["--sample-disk-mb", &too_small]).err().unwrap();
        assert!(e.to_string().contains("--sample-disk-mb"), "{e}");
        let least = crate::sample_disk::MIN_DISK_MB.to_string();
        assert_eq!(
            node(&["--sample-disk-mb", &least]).unwrap().sample_disk_mb,
            Some(crate::sample_disk::MIN_DISK_MB)
        );
    }

    #[test]
    fn a_started_node_runs_with_the_flags_it_was_given() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("node");
        let mut args = node(&["--data", data.to_str().unwrap(), "--max-attempts", "5"]).unwrap();
        let parts = args.prepare().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let node = rt.block_on(args.start(parts)).unwrap();
        assert_eq!(node.pipeline.max_attempts(), 5);
        assert!(node.capture.addr.ip().is_loopback());
    }
}
