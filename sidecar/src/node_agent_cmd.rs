//! `tokentap node-agent`: one per host. Watches the container runtime and/or the Kubernetes API
//! for workloads marked for capture, keeps the eBPF redirect attached to each one's cgroup
//! (`tokentap_node_agent::agent`), and serves every redirected connection on one shared
//! listener that intercepts the allow-listed hosts into one capture, spooled and shipped as
//! `proxy` does. A status plane (`/health`, `/metrics`, `/v1/workloads`) sits on its own port.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokentap_cgroup::cgroup2_mount;
use tokentap_control_plane::bearer::BearerToken;
use tokentap_ebpf::{Redirect, RedirectConfig};
use tokentap_node_agent::agent::Agent;
use tokentap_node_agent::sources::{self, Source, SourceOptions};
use tokentap_node_agent::status::{status_router, AgentMetrics, StatusState};
use tokentap_node_agent::WorkloadEvent;
use tokentap_proxy::cli::{CaptureArgs, InterceptArgs};
use tokentap_proxy::tls::ca;
use tokentap_proxy::transparent::TransparentListener;

use crate::downstream::DownstreamArgs;

#[derive(Args)]
#[command(after_help = "Examples:
  # a Docker host: containers started with --cgroup-parent /tokentap --label tokentap.io/capture=true
  tokentap node-agent --source docker --listen-ip 172.17.0.1 --backend http://127.0.0.1:8000 --backend-kind vllm --spool /var/lib/tokentap/spool
  # a Kubernetes node (the DaemonSet in deploy/kubernetes): pods annotated tokentap.io/capture: \"true\"
  tokentap node-agent --source kubernetes --node-name $NODE_NAME --listen-ip $NODE_IP --cgroup-root /host/cgroup …")]
pub struct NodeAgentArgs {
    /// Where workloads come from (repeatable).
    #[arg(long = "source", value_enum, required = true)]
    sources: Vec<Source>,
    /// The Docker Engine API (or Podman's compatible socket).
    #[arg(
        long,
        env = "DOCKER_HOST",
        default_value = "unix:///var/run/docker.sock"
    )]
    docker_host: String,
    /// The cgroup (relative to the cgroup2 mount) the agent creates and attaches before any
    /// container starts: containers run with `--cgroup-parent` set to it are redirected from
    /// their first instruction.
    #[arg(long, default_value = "/tokentap-capture")]
    docker_cgroup_parent: PathBuf,
    /// This node's name (Kubernetes source: pods with spec.nodeName equal to it).
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// A kubeconfig (default: the in-cluster service account, else ~/.kube/config).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The host's cgroup2 mount (default: found in /proc/mounts; in the DaemonSet, where the
    /// host's is mounted).
    #[arg(long)]
    cgroup_root: Option<PathBuf>,
    /// The address workloads' connects are redirected to: one they can reach (the Docker
    /// bridge's gateway, the node IP; 127.0.0.1 serves only host-network workloads).
    #[arg(long, env = "NODE_IP", default_value = "127.0.0.1")]
    listen_ip: Ipv4Addr,
    /// The IPv6 address for IPv6 connects (default: [::1] when --listen-ip is loopback;
    /// otherwise IPv6 connects are left alone).
    #[arg(long)]
    listen_ip6: Option<Ipv6Addr>,
    /// The redirect listener's port (IPv4 and IPv6).
    #[arg(long, default_value_t = 15001)]
    listen_port: u16,
    /// The status plane: /health, /metrics, /v1/workloads.
    #[arg(long, default_value = "127.0.0.1:15002")]
    status_listen: SocketAddr,
    /// Bearer token for the status plane (required when it is not on loopback).
    #[arg(long, env = "TOKENTAP_AGENT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    #[command(flatten)]
    tls: tokentap_control_plane::TlsListenArgs,
    #[command(flatten)]
    capture: CaptureArgs,
    #[command(flatten)]
    downstream: DownstreamArgs,
    #[command(flatten)]
    interception: InterceptArgs,
}

pub fn run(args: NodeAgentArgs) -> anyhow::Result<()> {
    tokentap_control_plane::check_exposure(
        args.status_listen,
        args.token.as_deref(),
        "--token",
        "TOKENTAP_AGENT_TOKEN",
    )?;
    tokentap_ebpf::preflight(true)?;
    let root = match &args.cgroup_root {
        Some(r) => r.clone(),
        None => cgroup2_mount()?,
    };
    if !root.join("cgroup.procs").exists() {
        anyhow::bail!(
            "--cgroup-root {}: not a cgroup2 mount (no cgroup.procs); give the host's cgroup2 \
             mount (/sys/fs/cgroup, or /sys/fs/cgroup/unified on v1-hybrid hosts)",
            root.display()
        );
    }
    if args.sources.contains(&Source::Kubernetes) && args.node_name.is_none() {
        anyhow::bail!("--source kubernetes needs --node-name (or NODE_NAME): the agent watches only this node's pods");
    }
    let ca = args.interception.ca(ca::default_dir())?;
    let (service, spool_thread) = args.capture.build(None)?;
    let downstream = if args.capture.no_capture {
        None
    } else {
        args.downstream.start(
            &args.capture.spool,
            args.capture.ca_roots()?,
            service.metrics().downstream(),
        )?
    };
    let service = Arc::new(service);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let listen6 = args
        .listen_ip6
        .or(args.listen_ip.is_loopback().then_some(Ipv6Addr::LOCALHOST));
    let at = SocketAddrV4::new(args.listen_ip, args.listen_port);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(at))
        .with_context(|| format!("listening on {at} (--listen-ip/--listen-port)"))?;
    let at = match listener.local_addr()? {
        SocketAddr::V4(a) => a,
        SocketAddr::V6(_) => unreachable!("bound to IPv4"),
    };
    let listener6 = match listen6 {
        Some(ip) => Some(
            rt.block_on(tokio::net::TcpListener::bind((ip, at.port())))
                .with_context(|| format!("listening on [{ip}]:{} (--listen-ip6)", at.port()))?,
        ),
        None => None,
    };
    let redirect = Redirect::load(&RedirectConfig {
        listener: at,
        listener_v6: listener6.as_ref().and(listen6),
        ports: args.interception.ports(),
    })?;
    let mut agent = Agent::new(redirect, root.clone());
    let metrics = Arc::new(AgentMetrics::new()?);

    let (events_tx, mut events) = tokio::sync::mpsc::channel::<(Source, WorkloadEvent)>(1024);
    let sources = rt.block_on(sources::start(
        &args.sources,
        &SourceOptions {
            docker_host: args.docker_host.clone(),
            node_name: args.node_name.clone(),
            kubeconfig: args.kubeconfig.clone(),
            cgroup_root: root.clone(),
        },
        events_tx,
    ))?;
    if let Some(lookup) = sources.container_lookup.clone() {
        agent = agent
            .with_capture_parent(&args.docker_cgroup_parent, lookup)
            .context("--docker-cgroup-parent")?;
        tracing::info!(
            parent = %agent.capture_parent().map(|p| p.display().to_string()).unwrap_or_default(),
            "containers started with --cgroup-parent {} are redirected from their first connect",
            args.docker_cgroup_parent.display()
        );
    }
    let agent = Arc::new(agent);

    let front = Arc::new(
        TransparentListener::new(
            service.clone(),
            ca.clone(),
            agent.clone(),
            args.interception.intercept_list(),
        )
        .shared_by_workloads(),
    );
    let (shutdown, watch) = tokio::sync::watch::channel(false);
    rt.spawn(front.clone().serve(listener, watch.clone()));
    if let Some(l6) = listener6 {
        rt.spawn(front.serve(l6, watch));
    }
    {
        let (agent, metrics) = (agent.clone(), metrics.clone());
        rt.spawn(async move {
            while let Some((source, event)) = events.recv().await {
                let kind = match source {
                    Source::Docker => "docker:",
                    Source::Kubernetes => "pod:",
                };
                let applying = agent.clone();
                // Attaching is a few syscalls; off the runtime's workers all the same.
                let _ = tokio::task::spawn_blocking(move || applying.apply(kind, event)).await;
                metrics.observe(&agent);
            }
        });
    }
    tracing::info!(
        listener = %at,
        listener6 = ?listen6,
        cgroup_root = %root.display(),
        sources = ?args.sources,
        "tokentap node-agent capturing; the redirect listener serves only connections the kernel redirected from a captured workload's cgroup (a direct dial is dropped), so it takes no token"
    );

    let state = StatusState {
        agent: agent.clone(),
        service: service.clone(),
        metrics,
    };
    let app = status_router(state, BearerToken::new(args.token.as_deref()));
    let served = rt.block_on(tokentap_control_plane::serve(
        args.status_listen,
        &args.tls,
        app,
        crate::signals::shutdown_signal(),
        |listen, tls| tracing::info!(%listen, tls, "status plane ready"),
    ));
    tracing::info!("stopping: detaching every workload");
    let _ = shutdown.send(true);
    drop(sources);
    let parent = agent.capture_parent().map(|p| p.to_owned());
    drop(agent);
    if let Some(p) = parent {
        // Gone only when no container is left below it (rmdir refuses otherwise).
        let _ = std::fs::remove_dir(p);
    }
    rt.shutdown_timeout(Duration::from_secs(2));
    drop(service);
    if let Some(t) = spool_thread {
        let _ = t.join();
    }
    if let Some(d) = downstream {
        d.stop(false);
    }
    served
}
