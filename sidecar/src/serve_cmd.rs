//! `tokentap serve`: a rollout node (work in progress, issue 6): the task store, the staged
//! pipeline, in-process capture with a session per sample, and the HTTP control plane.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tokentap_rollout::api::{router, ApiState};
use tokentap_rollout::capture::{observer, NodeCapture, SessionIndex};
use tokentap_rollout::gate::{Gate, NodeGate};
use tokentap_rollout::pipeline::{Pipeline, PipelineConfig};
use tokentap_rollout::store::Store;

use crate::proxy_cmd::CaptureArgs;

#[derive(Args)]
#[command(after_help = "Examples:
  tokentap serve --backend http://gpu:8000 --backend-kind vllm --data ./node --spool ./node/spool
  curl -H 'authorization: Bearer $TOKENTAP_NODE_TOKEN' -d @task.json http://127.0.0.1:8700/v1/rollouts
  curl -H 'authorization: Bearer $TOKENTAP_NODE_TOKEN' 'http://127.0.0.1:8700/v1/results?after=0&wait=30'")]
pub struct ServeArgs {
    /// Address of the control plane.
    #[arg(long, default_value = "127.0.0.1:8700")]
    listen: SocketAddr,
    /// The node's state (node.redb) and per-sample directories.
    #[arg(long, default_value = "tokentap-node")]
    data: PathBuf,
    /// Bearer token required on the control plane.
    #[arg(long, env = "TOKENTAP_NODE_TOKEN", hide_env_values = true)]
    token: Option<String>,
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
    #[command(flatten)]
    capture: CaptureArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data)?;
    let index = Arc::new(SessionIndex::default());
    // Built before the runtime: model discovery runs its own small one.
    let (service, spool_thread) = args
        .capture
        .build_observed(None, Some(observer(index.clone())))?;
    let gate = NodeGate::new(args.capture.policy_version.clone());
    let service = service.with_gate(Arc::new(Gate(gate.clone())));
    let store = Arc::new(
        Store::open(&args.data.join("node.redb"))
            .with_context(|| format!("opening the node's store in {}", args.data.display()))?,
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let capture = Arc::new(NodeCapture::start(service, index).await?);
        let mut config = PipelineConfig::new(args.data.clone());
        config.init_workers = args.init_workers;
        config.run_workers = args.run_workers;
        config.post_workers = args.post_workers;
        config.max_attempts = args.max_attempts;
        config.capture = Some(capture.clone());
        config.gate = Some(gate.clone());
        config.prewarm = args.prewarm;
        config.harness_model = args.harness_model.clone();
        config.block_egress = args.block_egress;
        if let Some(extra) = &args.harness_path {
            config.harness_path = format!("{extra}:{}", config.harness_path);
        }
        let pipeline = Arc::new(Pipeline::start(store, config).await?);
        let app = router(ApiState {
            pipeline,
            extra_metrics: Some(Arc::new({
                let service = capture.service.clone();
                move || service.metrics().render()
            })),
            token: args.token.clone(),
        });
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("listening on {}", args.listen))?;
        tracing::info!(
            listen = %listener.local_addr()?,
            capture = %capture.addr,
            data = %args.data.display(),
            "tokentap rollout node ready"
        );
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                use tokio::signal::unix::{signal, SignalKind};
                let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            })
            .await?;
        anyhow::Ok(())
    })?;
    // Running samples are re-run after the next start (the store says where they were).
    drop(rt);
    if let Some(t) = spool_thread {
        let _ = t.join();
    }
    Ok(())
}
