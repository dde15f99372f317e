//! `tokentap worker` as a child process, restartable on the same port and output directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::artefacts::tokentap_bin;
use crate::procs::{free_port, spawn_guarded, wait_healthy, ChildGuard, KillScope};

/// A `tokentap worker --listen 127.0.0.1:PORT --out DIR`; killed on drop.
pub struct Worker {
    pub url: String,
    pub port: u16,
    pub out: PathBuf,
    /// The `--token` among its arguments, for the test's own requests.
    pub token: Option<String>,
    args: Vec<String>,
    child: Option<ChildGuard>,
}

impl Worker {
    pub async fn start(out: &Path, args: &[&str]) -> Worker {
        let mut w = Worker {
            url: String::new(),
            port: free_port(),
            out: out.to_owned(),
            token: args
                .iter()
                .position(|a| *a == "--token")
                .map(|i| args[i + 1].to_owned()),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        w.url = format!("http://127.0.0.1:{}", w.port);
        w.restart().await;
        w
    }

    /// Starts it again (same port, same output) after [`Worker::kill`].
    pub async fn restart(&mut self) {
        let mut cmd = Command::new(tokentap_bin());
        cmd.arg("worker")
            .args(["--listen", &format!("127.0.0.1:{}", self.port)])
            .arg("--out")
            .arg(&self.out)
            .args(&self.args)
            .env("TOKENTAP_LOG", "info")
            .env_remove("TOKENTAP_WORKER_TOKEN");
        std::fs::create_dir_all(&self.out).expect("worker output dir");
        let log = self.out.with_extension("log");
        let mut child = spawn_guarded(cmd, &log, KillScope::Process, "tokentap worker")
            .expect("starting tokentap worker");
        wait_healthy(
            &format!("{}/health", self.url),
            &mut child,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("tokentap worker did not start: {e}"));
        self.child = Some(child);
    }

    /// SIGKILL: no shutdown path runs.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill();
        }
    }

    /// SIGSTOP: the process stays, its sockets stay open, nothing is read or answered (a hung
    /// worker, or one whose machine stalls).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT after [`Worker::pause`].
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.child.as_ref().expect("the worker is running").id();
        // SAFETY: plain kill(2) on our own child.
        assert_eq!(
            unsafe { libc::kill(pid as i32, sig) },
            0,
            "signalling the worker"
        );
    }

    /// SIGTERM, then waits for the exit (bounded); true if it exited in time.
    pub async fn terminate(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return true;
        };
        c.terminate(Duration::from_secs(20)).await
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.child.as_ref().map_or_else(
            || std::fs::read_to_string(self.out.with_extension("log")).unwrap_or_default(),
            |c| c.log_tail(n),
        )
    }

    /// The value of an unlabelled metric on `/metrics`, if present.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        crate::procs::metric_with(&self.url, name, self.token.as_deref()).await
    }
}
