//! A running `tokentap node-agent` for the tests: its status plane on a loopback port, its
//! spool and CA in the test's temp dir; killed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::artefacts::tokentap_bin;
use crate::procs::{free_port, spawn_guarded, wait_healthy, ChildGuard, KillScope};
use crate::CaptureRecord;

pub struct NodeAgent {
    /// `http://127.0.0.1:PORT` (the status plane).
    pub status: String,
    pub spool: PathBuf,
    pub ca_dir: PathBuf,
    child: ChildGuard,
}

impl NodeAgent {
    /// `tokentap node-agent ARGS --status-listen 127.0.0.1:P --spool DIR/spool --ca-dir
    /// DIR/ca`, waiting for `/health`. `log` names the log file (in `dir`).
    pub async fn start(dir: &Path, log: &str, args: &[String]) -> NodeAgent {
        let spool = dir.join("spool");
        let ca_dir = dir.join("ca");
        let port = free_port();
        let mut cmd = Command::new(tokentap_bin());
        cmd.arg("node-agent")
            .args(args)
            .args(["--status-listen", &format!("127.0.0.1:{port}")])
            .arg("--spool")
            .arg(&spool)
            .arg("--ca-dir")
            .arg(&ca_dir)
            .env("TOKENTAP_LOG", "info,tokentap_node_agent=debug");
        let mut child = spawn_guarded(cmd, &dir.join(log), KillScope::Process, "node-agent")
            .expect("starting tokentap node-agent");
        let status = format!("http://127.0.0.1:{port}");
        wait_healthy(
            &format!("{status}/health"),
            &mut child,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("tokentap node-agent did not start: {e}"));
        NodeAgent {
            status,
            spool,
            ca_dir,
            child,
        }
    }

    /// `/v1/workloads`.
    pub async fn workloads(&self) -> Vec<serde_json::Value> {
        let v: serde_json::Value = reqwest::get(format!("{}/v1/workloads", self.status))
            .await
            .expect("GET /v1/workloads")
            .json()
            .await
            .expect("workloads JSON");
        v["workloads"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until `pred` holds for the workload list; panics with the list after `limit`.
    pub async fn wait_workloads(
        &self,
        what: &str,
        limit: Duration,
        pred: impl Fn(&[serde_json::Value]) -> bool,
    ) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + limit;
        loop {
            let w = self.workloads().await;
            if pred(&w) {
                return w;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: workloads {w:#?}\n{}",
                self.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The records in its spool so far.
    pub fn records(&self) -> Vec<CaptureRecord> {
        crate::tokentap::read_spool(&self.spool)
    }

    /// Waits until the spool holds at least `n` records.
    pub async fn wait_records(&self, n: usize) -> Vec<CaptureRecord> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let r = self.records();
            if r.len() >= n {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {n} records:\n{}",
                r.len(),
                self.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill(&mut self) {
        // SAFETY: kill has no memory preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.child.try_wait().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub async fn terminate(&mut self) -> bool {
        self.child.terminate(Duration::from_secs(10)).await
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.child.log_tail(n)
    }
}
