//! `tokentap run -- CMD` and `tokentap sidecar --cgroup PATH`: transparent capture. A cgroup
//! gets the eBPF connect redirect; its TCP connects to the redirected ports land on a local
//! listener that intercepts TLS for LLM API hosts (with certificates from the local CA) and
//! passes everything else through to where it was going.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokentap_cgroup::{cgroup2_mount, join_on_spawn_std, procs_file, Cgroup};
use tokentap_ebpf::{
    conntrack_original_destination, NftRedirect, Redirect, RedirectConfig, RedirectError,
};
use tokentap_proxy::cli::{CaptureArgs, InterceptArgs};
use tokentap_proxy::tls::{ca, CertificateAuthority};
use tokentap_proxy::transparent::{OriginalDestination, TransparentListener};

use crate::downstream::DownstreamArgs;
use tokentap_ship::downstream::Downstream;

/// What `run` and `sidecar` share.
#[derive(Args, Clone)]
pub struct TransparentArgs {
    #[command(flatten)]
    capture: CaptureArgs,
    #[command(flatten)]
    downstream: DownstreamArgs,
    #[command(flatten)]
    interception: InterceptArgs,
    /// How connects are redirected: eBPF (auto falls back to nftables when eBPF is refused).
    #[arg(long, value_enum, default_value = "auto")]
    redirect: RedirectMode,
}

#[derive(Args)]
#[command(after_help = "Example:
  tokentap run --backend http://127.0.0.1:8080 --backend-kind llamacpp --spool ./spool -- codex exec \"fix the test\"
  # Codex keeps its default https://api.openai.com; tokentap intercepts it, answers from the engine, and records every call.")]
pub struct RunArgs {
    #[command(flatten)]
    transparent: TransparentArgs,
    /// Session every call of this run is recorded under (default: run-<id>).
    #[arg(long)]
    session: Option<String>,
    /// The command to run under capture, after `--`.
    #[arg(required = true, last = true)]
    command: Vec<String>,
}

#[derive(Args)]
pub struct SidecarArgs {
    #[command(flatten)]
    transparent: TransparentArgs,
    /// The cgroup (v2 directory) whose processes are captured, e.g. a pod's.
    #[arg(long)]
    cgroup: PathBuf,
    /// Record every call under this session instead of attributing per call.
    #[arg(long)]
    session: Option<String>,
}

/// How the cgroup's connects are sent to the listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RedirectMode {
    /// eBPF, falling back to nftables when the kernel refuses eBPF (with a warning).
    Auto,
    /// eBPF cgroup connect programs only.
    Ebpf,
    /// nftables REDIRECT matching the cgroup (needs the `nft` command and conntrack).
    Nft,
}

/// The installed redirect, as the listener's answer to "where was this going?".
enum Installed {
    /// The eBPF map.
    Ebpf(Box<Redirect>),
    /// conntrack, behind an nftables rule (kept alive here; removed on drop).
    Nft { _rule: NftRedirect },
}

impl OriginalDestination for Installed {
    fn original_destination(
        &self,
        conn: &tokio::net::TcpStream,
        peer: SocketAddr,
    ) -> Option<SocketAddr> {
        match self {
            Installed::Ebpf(r) => r.original_destination(peer),
            Installed::Nft { .. } => {
                let dest = conntrack_original_destination(conn, peer)?;
                // A connection made to the listener itself has itself as "original" destination.
                (Some(dest) != conn.local_addr().ok()).then_some(dest)
            }
        }
    }
}

/// A running transparent capture: listener, redirect, service.
struct Capture {
    runtime: tokio::runtime::Runtime,
    shutdown: tokio::sync::watch::Sender<bool>,
    spool_thread: Option<std::thread::JoinHandle<()>>,
    downstream: Option<Downstream>,
    ca: Arc<CertificateAuthority>,
}

impl TransparentArgs {
    /// Starts the service and the listener, and attaches the redirect to `cgroup`.
    fn start(&self, cgroup: &Cgroup, session: Option<String>) -> anyhow::Result<Capture> {
        let ca = self.interception.ca(ca::default_dir())?;
        // Built before the runtime: model discovery runs its own small one.
        let (service, spool_thread) = self.capture.build(session)?;
        let downstream = if self.capture.no_capture {
            None
        } else {
            self.downstream.start(
                &self.capture.spool,
                self.capture.ca_roots()?,
                service.metrics().downstream(),
            )?
        };
        let service = Arc::new(service);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))?;
        let SocketAddr::V4(at) = listener.local_addr()? else {
            unreachable!("bound to IPv4")
        };
        // IPv6 connects land on [::1] at the same port, when the host has IPv6 loopback.
        let listener6 = runtime
            .block_on(tokio::net::TcpListener::bind((
                Ipv6Addr::LOCALHOST,
                at.port(),
            )))
            .ok();
        let config = RedirectConfig {
            listener: SocketAddrV4::new(*at.ip(), at.port()),
            listener_v6: listener6.as_ref().map(|_| Ipv6Addr::LOCALHOST),
            ports: self.interception.ports(),
        };
        let nft = || -> anyhow::Result<Installed> {
            let root = cgroup2_mount()?;
            let rule = NftRedirect::install(&root, cgroup.path(), &config.ports, at.port())?;
            Ok(Installed::Nft { _rule: rule })
        };
        let installed = match self.redirect {
            RedirectMode::Ebpf => {
                Installed::Ebpf(Box::new(Redirect::attach(cgroup.path(), &config)?))
            }
            RedirectMode::Nft => nft()?,
            RedirectMode::Auto => match Redirect::attach(cgroup.path(), &config) {
                Ok(r) => Installed::Ebpf(Box::new(r)),
                Err(e @ (RedirectError::Refused(_) | RedirectError::NotBuilt)) => {
                    tracing::warn!(error = %e, "eBPF redirect unavailable; falling back to nftables REDIRECT");
                    nft().context("the nftables fallback failed too")?
                }
                Err(e) => return Err(e.into()),
            },
        };
        let front = Arc::new(TransparentListener::new(
            service,
            ca.clone(),
            Arc::new(installed),
            self.interception.intercept_list(),
        ));
        let (shutdown, watch) = tokio::sync::watch::channel(false);
        runtime.spawn(front.clone().serve(listener, watch.clone()));
        if let Some(l6) = listener6 {
            runtime.spawn(front.serve(l6, watch));
        }
        tracing::info!(listener = %at, cgroup = %cgroup.path().display(), "transparent capture on; the listener serves only connections the kernel redirected from the cgroup (a direct dial is dropped), so it takes no token");
        Ok(Capture {
            runtime,
            shutdown,
            spool_thread,
            downstream,
            ca,
        })
    }
}

impl Capture {
    /// Stops accepting, detaches (the redirect is dropped with the listener's tasks), and
    /// flushes the spool.
    /// With `finish_sessions`, local reconstruction writes the traces of every session
    /// still open (the run is over); otherwise they resume at the next start.
    fn stop(self, finish_sessions: bool) {
        let _ = self.shutdown.send(true);
        // Dropping the runtime cancels connection tasks and with them the last references to
        // the service (and so to the spool sink and the redirect).
        self.runtime.shutdown_timeout(Duration::from_secs(2));
        if let Some(t) = self.spool_thread {
            let _ = t.join();
        }
        if let Some(d) = self.downstream {
            d.stop(finish_sessions);
        }
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    tokentap_ebpf::preflight(args.transparent.redirect == RedirectMode::Ebpf)?;
    let session = args
        .session
        .clone()
        .unwrap_or_else(|| format!("run-{}", uuid::Uuid::now_v7().simple()));
    tokentap_ebpf::remove_stale_interception();
    let cgroup = Cgroup::create_for_this_process(&session).context("creating the run's cgroup")?;
    let capture = args.transparent.start(&cgroup, Some(session.clone()))?;
    let scratch = tempfile::tempdir()?;
    let bundle = scratch.path().join("ca-bundle.pem");
    capture.ca.write_bundle(&bundle)?;

    let mut cmd = std::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..])
        .envs(capture.ca.trust_env(&bundle))
        .env("TOKENTAP_SESSION", &session);
    join_on_spawn_std(&mut cmd, vec![procs_file(cgroup.path())?]);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", args.command[0]))?;
    let pid = child.id() as libc::pid_t;

    // Ctrl-C / SIGTERM reach tokentap: pass them on and keep going until the command is done,
    // so clean-up always runs.
    let forward = capture.runtime.spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (mut int, mut term) = (
            signal(SignalKind::interrupt()).expect("SIGINT handler"),
            signal(SignalKind::terminate()).expect("SIGTERM handler"),
        );
        loop {
            let sig = tokio::select! {
                _ = int.recv() => libc::SIGINT,
                _ = term.recv() => libc::SIGTERM,
            };
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(pid, sig) };
        }
    });
    let status = child.wait()?;
    forward.abort();

    capture.stop(true);
    let path = cgroup.path().to_owned();
    if let Err(e) = cgroup.remove() {
        tracing::warn!(error = %e, cgroup = %path.display(), "could not remove the run's cgroup");
    }
    Ok(exit_code(status))
}

/// The command's own exit status (128 + signal when it was killed).
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => ExitCode::from(c.clamp(0, 255) as u8),
        (None, Some(sig)) => ExitCode::from((128 + sig).clamp(0, 255) as u8),
        _ => ExitCode::FAILURE,
    }
}

pub fn sidecar(args: SidecarArgs) -> anyhow::Result<ExitCode> {
    tokentap_ebpf::preflight(args.transparent.redirect == RedirectMode::Ebpf)?;
    let cgroup = Cgroup::existing(&args.cgroup)?;
    cgroup.ensure_outside()?;
    tokentap_ebpf::remove_stale_interception();
    let capture = args.transparent.start(&cgroup, args.session.clone())?;
    capture.runtime.block_on(crate::signals::shutdown_signal());
    tracing::info!("stopping transparent capture");
    capture.stop(false);
    Ok(ExitCode::SUCCESS)
}
