//! Child processes that cannot outlive the test: every child is spawned from one long-lived
//! spawner thread with `PR_SET_PDEATHSIG = SIGKILL` (so it dies with the test process even if
//! its guard is never dropped, e.g. when held by a `static`), and is killed by its
//! [`ChildGuard`] on drop, including when the test panics.

use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

type SpawnRequest = (Command, mpsc::Sender<std::io::Result<Child>>);

/// The spawner thread never exits, so the parent-death signal fires only when the whole test
/// process ends (the signal is tied to the thread that forked the child).
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("e2e-child-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawning the child spawner thread");
        Mutex::new(tx)
    })
}

/// How a guarded child is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KillScope {
    /// Only the child itself.
    Process,
    /// The child's whole process group (it was made a group leader): harnesses run tools as
    /// grandchildren.
    Group,
}

/// Spawns `cmd` (stdin null; stdout and stderr appended to `log`) and guards it.
pub fn spawn_guarded(
    cmd: Command,
    log: &Path,
    scope: KillScope,
    what: &str,
) -> std::io::Result<ChildGuard> {
    spawn_guarded_split(cmd, log, log, scope, what)
}

/// Like [`spawn_guarded`], with stdout and stderr in separate files.
pub fn spawn_guarded_split(
    mut cmd: Command,
    stdout: &Path,
    stderr: &Path,
    scope: KillScope,
    what: &str,
) -> std::io::Result<ChildGuard> {
    let log = stderr;
    let out = File::options().create(true).append(true).open(stdout)?;
    let err = if stdout == stderr {
        out.try_clone()?
    } else {
        File::options().create(true).append(true).open(stderr)?
    };
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    if scope == KillScope::Group {
        cmd.process_group(0);
    }
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, tx))
        .expect("the spawner thread is alive");
    let child = rx.recv().expect("the spawner thread answers")?;
    Ok(ChildGuard {
        child: Some(child),
        scope,
        what: what.to_owned(),
        log: log.to_owned(),
    })
}

/// Kills its child (or the child's process group) on drop.
pub struct ChildGuard {
    child: Option<Child>,
    scope: KillScope,
    what: String,
    log: PathBuf,
}

impl ChildGuard {
    pub fn id(&self) -> u32 {
        self.child.as_ref().expect("not yet reaped").id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `n` lines of the child's output.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// `Some(status)` once the child has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// Waits for the child to exit, up to `limit` (a safety bound, not an assertion); kills it
    /// and returns `None` when the limit passes.
    pub async fn wait_limited(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.try_wait() {
                self.kill_group_leftovers();
                return Some(s);
            }
            if Instant::now() > deadline {
                self.kill();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn kill_group_leftovers(&self) {
        if self.scope == KillScope::Group {
            if let Some(c) = &self.child {
                // The leader has exited; stray tool processes in its group go too.
                // SAFETY: plain kill(2) on the group this guard created.
                unsafe {
                    libc::kill(-(c.id() as i32), libc::SIGKILL);
                }
            }
        }
    }

    /// SIGTERM to the child alone, then waits (bounded); true if it exited within `limit`.
    pub async fn terminate(&mut self, limit: Duration) -> bool {
        let Some(c) = self.child.as_ref() else {
            return true;
        };
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        self.wait_limited(limit).await.is_some()
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            if self.scope == KillScope::Group {
                // SAFETY: plain kill(2) on the group this guard created.
                unsafe {
                    libc::kill(-(c.id() as i32), libc::SIGKILL);
                }
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let still_running = self
            .child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none());
        if std::thread::panicking() {
            eprintln!(
                "---- last output of {} ({}) ----\n{}\n----",
                self.what,
                self.log.display(),
                self.log_tail(40)
            );
        }
        if still_running || self.scope == KillScope::Group {
            self.kill();
        } else if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

/// A port that was free a moment ago on 127.0.0.1, for child processes that must bind it
/// themselves.
///
/// Why not `bind(0)`: that hands out a port from the kernel's ephemeral range, the same range
/// every outgoing connection and every other test's `bind(0)` draws from, so between our
/// release and the child's bind another process could take it (CI saw nats-server's monitor
/// port taken that way). Ports here come from below that range, walked from a start that
/// differs per process, each handed out at most once per process and checked bindable.
pub fn free_port() -> u16 {
    static NEXT: Mutex<Option<u32>> = Mutex::new(None);
    let (low, high) = port_pool();
    let span = high - low;
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    let mut at = *next.get_or_insert_with(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        (std::process::id().wrapping_mul(7919) ^ nanos) % span
    });
    for _ in 0..span {
        let port = (low + at) as u16;
        at = (at + 1) % span;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            *next = Some(at);
            return port;
        }
    }
    panic!("no free port on 127.0.0.1 in {low}..{high}");
}

/// `[10000, start of the ephemeral range)`: ports no `bind(0)` or outgoing connection takes.
fn port_pool() -> (u32, u32) {
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    if ephemeral_low > 12000 {
        (10000, ephemeral_low)
    } else {
        // An unusual range starting low: use the ports above it instead.
        (61000, 65535)
    }
}

/// A port on 127.0.0.1 on which nothing listens (bound once, then released).
pub fn closed_port() -> u16 {
    free_port()
}

pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Serves `app` on 127.0.0.1 at a port of the system's choosing, until the task is aborted
/// (the test doubles abort it on drop); `what` names it if binding fails.
pub async fn serve_on_loopback(
    app: axum::Router,
    what: &str,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind(loopback(0))
        .await
        .unwrap_or_else(|e| panic!("binding {what}: {e}"));
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

/// Polls `GET url` until it answers 200, the child exits, or `limit` passes.
pub async fn wait_healthy(
    url: &str,
    child: &mut ChildGuard,
    limit: Duration,
) -> Result<(), String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("reqwest client");
    wait_healthy_tls(&client, url, child, limit).await
}

/// [`wait_healthy`] with a client of the caller's (its roots, its name resolution).
pub async fn wait_healthy_tls(
    client: &reqwest::Client,
    url: &str,
    child: &mut ChildGuard,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait() {
            return Err(format!(
                "exited ({status}) before {url} answered:\n{}",
                child.log_tail(30)
            ));
        }
        if let Ok(r) = client.get(url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{url} did not answer 200 within {limit:?}:\n{}",
                child.log_tail(30)
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A reqwest client for 127.0.0.1 that ignores proxy settings in the environment.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("reqwest client")
}

/// The value of an unlabelled metric on `{base}/metrics`, if present.
pub async fn metric(base: &str, name: &str) -> Option<f64> {
    metric_with(base, name, None).await
}

/// [`metric`] from a control plane that wants a bearer `token`.
pub async fn metric_with(base: &str, name: &str, token: Option<&str>) -> Option<f64> {
    let mut req = http_client().get(format!("{base}/metrics"));
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let text = req.send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}
