//! Optional sandbox for a sample's agent (bubblewrap): its own network namespace with nothing
//! but loopback, the whole filesystem read-only except the sample's directory, its own PID,
//! IPC and UTS namespaces. The one way out is the capture: inside, a shim (`tokentap
//! sandbox-shim`) listens on the capture's loopback port and forwards each connection over a
//! Unix socket in the sample's directory to the node, which forwards it to the capture. The
//! harness's base URL is unchanged.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// The socket name in a sample's directory.
pub const SOCKET: &str = "capture.sock";

/// What a node needs to sandbox agents.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// `bwrap`.
    pub bwrap: PathBuf,
    /// The binary with the `sandbox-shim` subcommand (the node's own `tokentap`).
    pub shim: PathBuf,
    /// Sandbox every sample, not only those whose task asks.
    pub always: bool,
}

/// `cmd` (a preset's command: clean environment, working directory) run inside bubblewrap,
/// with `sample_dir` the only writable place and `capture` reachable on its usual address.
pub fn wrap(
    cmd: &std::process::Command,
    cfg: &SandboxConfig,
    sample_dir: &Path,
    capture: SocketAddr,
) -> std::process::Command {
    let mut b = std::process::Command::new(&cfg.bwrap);
    b.env_clear();
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            b.env(k, v);
        }
    }
    if let Some(d) = cmd.get_current_dir() {
        b.current_dir(d);
    }
    let dir = sample_dir.as_os_str();
    b.args([
        "--die-with-parent",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
    ])
    .args([
        "--unshare-uts",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
    ])
    .args(["--tmpfs", "/tmp"]);
    // The private /tmp hides the host's: what the agent must still run from there (the shim,
    // PATH entries) is mounted back, read-only.
    let path = cmd
        .get_envs()
        .find(|(k, _)| *k == "PATH")
        .and_then(|(_, v)| v.map(ToOwned::to_owned))
        .unwrap_or_default();
    let mut visible: Vec<PathBuf> = std::env::split_paths(&path).collect();
    visible.push(cfg.shim.clone());
    for p in visible {
        if p.starts_with("/tmp") && p.exists() && !p.starts_with(sample_dir) {
            b.arg("--ro-bind").arg(&p).arg(&p);
        }
    }
    b.arg("--bind").arg(dir).arg(dir);
    if let Some(d) = cmd.get_current_dir() {
        b.arg("--chdir").arg(d);
    }
    b.arg("--")
        .arg(&cfg.shim)
        .arg("sandbox-shim")
        .arg("--listen")
        .arg(capture.to_string())
        .arg("--unix")
        .arg(sample_dir.join(SOCKET))
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args().collect::<Vec<_>>());
    b
}

/// The node's end: serves `sample_dir/capture.sock`, forwarding each connection to `capture`,
/// until the returned task is aborted.
pub fn serve_socket(
    sample_dir: &Path,
    capture: SocketAddr,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let path = sample_dir.join(SOCKET);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    Ok(tokio::spawn(async move {
        while let Ok((mut inner, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outer) = TcpStream::connect(capture).await {
                    let _ = tokio::io::copy_bidirectional(&mut inner, &mut outer).await;
                }
            });
        }
    }))
}

/// The sandbox's end (`tokentap sandbox-shim`): forwards `listen` to the Unix socket while
/// `command` runs; returns its exit code.
pub async fn shim(
    listen: SocketAddr,
    unix: PathBuf,
    command: Vec<OsString>,
) -> std::io::Result<i32> {
    let listener = TcpListener::bind(listen).await?;
    let forward = tokio::spawn(async move {
        while let Ok((mut outer, _)) = listener.accept().await {
            let unix = unix.clone();
            tokio::spawn(async move {
                if let Ok(mut inner) = UnixStream::connect(&unix).await {
                    let _ = tokio::io::copy_bidirectional(&mut outer, &mut inner).await;
                }
            });
        }
    });
    let Some((program, args)) = command.split_first() else {
        return Err(std::io::Error::other("sandbox-shim: no command"));
    };
    let status = tokio::process::Command::new(program)
        .args(args)
        .status()
        .await?;
    forward.abort();
    Ok(status.code().unwrap_or(128 + 9))
}
