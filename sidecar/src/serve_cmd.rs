//! `tokentap serve`: a rollout node — the task store, the staged pipeline, in-process capture
//! with a session per sample behind the admission gate, and the HTTP control plane.
//! [`NodeArgs`] (everything but the control plane; `tokentap_rollout::cli`) is shared with
//! `tokentap generate`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use tokentap_rollout::api::{router, ApiState};
use tokentap_rollout::cli::NodeArgs;

use crate::signals::shutdown_signal;

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
    /// The viewer at /view/ (behind --token) shows token text from --tokenizer when given
    /// (the model token mode uses), else from the engine's /detokenize (llama.cpp, vLLM)
    /// unless these say otherwise.
    #[command(flatten)]
    view_text: crate::view_cmd::DetokenizeArgs,
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
        .token_text(
            args.node.capture.tokenizer(),
            args.node.capture.detokenizer(),
        )
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
