//! The proxy under test: this same executable's `tokentap proxy`, run as a child process so
//! that it is measured exactly as deployed (its own runtime and threads), and killed when
//! the guard is dropped, on success, error or panic alike.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::instant_backend::MODEL;
use super::load;

pub struct ProxyChild {
    child: Child,
    pub addr: SocketAddr,
    /// The spool directory, when capturing.
    pub spool: Option<PathBuf>,
    log: PathBuf,
}

impl ProxyChild {
    /// Starts `tokentap proxy` in front of `backend`, logging to a file in `dir`.
    /// `fsync` is the capture-on proxy's spool policy (`always` also holds each answer's end
    /// until its record is on disk).
    pub fn spawn(
        backend: SocketAddr,
        capture: bool,
        threads: usize,
        dir: &Path,
        fsync: &str,
    ) -> anyhow::Result<ProxyChild> {
        // The proxy alone: in-process reconstruction is a separate consumer of the spool
        // (about 0.5 ms of one core per 143 KB record, mostly JSON parsing), measured by
        // `tokentap bench reconstruct`.
        let mut extra = vec!["--no-reconstruct", "--fsync", fsync];
        if !capture {
            extra.push("--no-capture");
        }
        let name = if capture { "capture-on" } else { "capture-off" };
        let mut child = ProxyChild::spawn_with(backend, threads, dir, name, &extra)?;
        if !capture {
            child.spool = None;
        }
        Ok(child)
    }

    /// Starts `tokentap proxy` in front of `backend` with `extra` arguments, its spool and log
    /// in `dir` named after `name`.
    pub fn spawn_with(
        backend: SocketAddr,
        threads: usize,
        dir: &Path,
        name: &str,
        extra: &[&str],
    ) -> anyhow::Result<ProxyChild> {
        let addr = free_port()?;
        let spool = dir.join(format!("spool-{name}"));
        let log = dir.join(format!("proxy-{name}.log"));
        let exe = std::env::current_exe().context("finding this executable")?;
        let mut cmd = Command::new(exe);
        cmd.arg("proxy")
            .args(["--listen", &addr.to_string()])
            .args(["--backend", &format!("http://{backend}")])
            .args(["--backend-kind", "vllm", "--backend-model", MODEL])
            .args(["--threads", &threads.to_string()])
            .arg("--spool")
            .arg(&spool)
            .args(extra);
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting tokentap proxy")?;
        Ok(ProxyChild {
            child,
            addr,
            spool: Some(spool),
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until `GET /health` answers 200.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!(
                    "the proxy exited ({status}) at start-up:\n{}",
                    self.log_tail()
                );
            }
            if let Ok((200, _)) = load::get(self.addr, "/health").await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "the proxy was not ready within {timeout:?}:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Resident memory of the proxy now, in bytes (`VmRSS` in `/proc/PID/status`).
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    /// CPU time (user + system) the proxy has used so far.
    pub fn cpu_time(&self) -> Duration {
        cpu_time_of(&self.child.id().to_string())
    }

    /// Fails with the end of its log if the proxy has exited.
    pub fn ensure_alive(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => bail!(
                "the proxy (pid {}) exited during the run ({status}):\n{}",
                self.child.id(),
                self.log_tail()
            ),
        }
    }

    /// Stops the proxy gracefully (SIGTERM), so that the spool writer drains and syncs before
    /// records are counted; kills it if it takes too long.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        // SAFETY: kill(2) on our own child's pid, which has not been reaped yet.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.kill()?;
        self.child.wait()?;
        bail!("the proxy did not stop within 15 s of SIGTERM; killed it")
    }

    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }
}

impl Drop for ProxyChild {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last 20 lines of a child's log file (for an error saying why it failed).
pub fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// CPU time (user + system) of a process, from `/proc/PID/stat` ("self" for this one).
pub fn cpu_time_of(pid: &str) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let rest = stat.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Duration::from_secs_f64(f.iter().sum::<u64>() as f64 / hz)
}

/// A port that was free a moment ago (the proxy binds it itself).
pub(crate) fn free_port() -> anyhow::Result<SocketAddr> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?)
}

/// Records (lines) and bytes in a spool, counted from the segment files.
pub fn count_spool_lines(spool: &Path) -> anyhow::Result<(u64, u64)> {
    let (mut lines, mut total) = (0, 0);
    for seq in tokentap_spool::segment::list_segments(spool)? {
        let bytes = std::fs::read(tokentap_spool::segment::segment_path(spool, seq))?;
        lines += memchr::memchr_iter(b'\n', &bytes).count() as u64;
        total += bytes.len() as u64;
    }
    Ok((lines, total))
}
