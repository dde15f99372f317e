//! The system under test: the real `tokentap` binary, run as a child process, and its spool.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tokentap_schema::CaptureRecord;
use tokentap_spool::{SpoolItem, SpoolReader};

use crate::artefacts::tokentap_bin;
use crate::procs::{
    free_port, spawn_guarded, spawn_guarded_split, wait_healthy, ChildGuard, KillScope,
};

/// How to start `tokentap proxy`.
#[derive(Debug, Clone)]
pub struct TokentapConfig {
    pub backend: String,
    pub backend_kind: &'static str,
    pub extra_args: Vec<String>,
    /// Use this spool (e.g. a killed proxy's, to restart on it) instead of a fresh one.
    pub spool: Option<PathBuf>,
}

impl TokentapConfig {
    pub fn new(backend: impl Into<String>, backend_kind: &'static str) -> Self {
        TokentapConfig {
            backend: backend.into(),
            backend_kind,
            extra_args: Vec::new(),
            spool: None,
        }
    }

    pub fn arg(mut self, a: impl Into<String>) -> Self {
        self.extra_args.push(a.into());
        self
    }
}

/// A running `tokentap proxy` with its own temporary spool; killed on drop.
pub struct Tokentap {
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub port: u16,
    pub spool: PathBuf,
    child: ChildGuard,
    dir: tempfile::TempDir,
}

impl Tokentap {
    /// `tokentap proxy --listen 127.0.0.1:P --backend URL --backend-kind K --spool DIR [extra]`,
    /// waiting for `/health`.
    pub async fn start(config: TokentapConfig) -> Tokentap {
        let bin = tokentap_bin();
        let dir = tempfile::tempdir().expect("temp dir");
        let spool = config
            .spool
            .clone()
            .unwrap_or_else(|| dir.path().join("spool"));
        let mut last_err = String::new();
        for _attempt in 0..3 {
            let port = free_port();
            let log = dir.path().join(format!("tokentap-{port}.log"));
            let mut cmd = Command::new(&bin);
            cmd.arg("proxy")
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .args(["--backend", &config.backend])
                .args(["--backend-kind", config.backend_kind])
                .arg("--spool")
                .arg(&spool)
                .args(&config.extra_args)
                .env("TOKENTAP_LOG", "info")
                .env_remove("TOKENTAP_BACKEND_API_KEY");
            let mut child = spawn_guarded(cmd, &log, KillScope::Process, "tokentap proxy")
                .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
            let url = format!("http://127.0.0.1:{port}");
            match wait_healthy(
                &format!("{url}/health"),
                &mut child,
                Duration::from_secs(30),
            )
            .await
            {
                Ok(()) => {
                    return Tokentap {
                        url,
                        port,
                        spool,
                        child,
                        dir,
                    }
                }
                Err(e) => last_err = e,
            }
        }
        panic!("tokentap proxy did not start: {last_err}");
    }

    /// The OpenAI base URL a harness uses.
    pub fn base_url(&self) -> String {
        format!("{}/v1", self.url)
    }

    /// The value of an unlabelled metric on `/metrics`, if present.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        crate::procs::metric(&self.url, name).await
    }

    pub fn chat_url(&self) -> String {
        format!("{}/v1/chat/completions", self.url)
    }

    /// One Chat Completions call of `session` (asserted to succeed); the answer's text.
    pub async fn chat(
        &self,
        client: &reqwest::Client,
        session: &str,
        messages: &[serde_json::Value],
    ) -> String {
        let r = client
            .post(self.chat_url())
            .header("x-tokentap-session", session)
            .json(&serde_json::json!({"model": "m", "messages": messages, "max_tokens": 64}))
            .send()
            .await
            .expect("calling the proxy");
        assert!(r.status().is_success(), "{}", r.status());
        let v: serde_json::Value = r.json().await.expect("a JSON answer");
        v["choices"][0]["message"]["content"]
            .as_str()
            .expect("an answer's text")
            .to_owned()
    }

    /// A scratch directory that lives as long as this proxy.
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.child.log_tail(n)
    }

    /// Stops the proxy with SIGTERM (its shutdown path: spool drained, downstream flushed);
    /// true if it exited within 20 s.
    pub async fn terminate(&mut self) -> bool {
        self.child.terminate(Duration::from_secs(20)).await
    }

    /// SIGKILL: no shutdown path runs (the spool keeps what was written).
    pub fn kill(&mut self) {
        self.child.kill();
    }

    /// Whether the proxy process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().is_none()
    }

    /// Every record in the spool now, in write order.
    pub fn records(&self) -> Vec<CaptureRecord> {
        read_spool(&self.spool)
    }

    /// Waits (bounded, not asserted) until the spool holds at least `n` records, and returns
    /// them all. Records are written after the answer, so a test polls for them.
    pub async fn wait_records(&self, n: usize) -> Vec<CaptureRecord> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let records = self.records();
            if records.len() >= n {
                return records;
            }
            assert!(
                Instant::now() < deadline,
                "expected at least {n} records in {}, found {}; proxy log:\n{}",
                self.spool.display(),
                records.len(),
                self.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The `n`-th record (from 1). Only meaningful when the test waited for each earlier
    /// call's record before making the next call: otherwise calls may end, and be appended,
    /// in another order than they were made.
    pub async fn wait_record(&self, n: usize) -> CaptureRecord {
        self.wait_records(n).await.swap_remove(n - 1)
    }

    /// Waits (bounded) for a record matching `pred` and returns it. Records are appended when
    /// calls end, which need not be the order the calls were made in: tests find a call's
    /// record by what identifies it (session and seq, a header), never by position.
    pub async fn wait_for(
        &self,
        what: &str,
        pred: impl Fn(&CaptureRecord) -> bool,
    ) -> CaptureRecord {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let records = self.records();
            if let Some(r) = records.iter().find(|r| pred(r)) {
                return r.clone();
            }
            assert!(
                Instant::now() < deadline,
                "no record {what} in {} ({} records); proxy log:\n{}",
                self.spool.display(),
                records.len(),
                self.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The record of call `seq` of session `session`.
    pub async fn wait_seq(&self, session: &str, seq: u64) -> CaptureRecord {
        self.wait_for(&format!("{session}#{seq}"), |r| {
            r.session_id == session && r.seq == seq
        })
        .await
    }

    /// Every byte of every spool file, for secret scans.
    pub fn spool_bytes(&self) -> Vec<u8> {
        let mut all = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.spool) {
            for e in entries.flatten() {
                if let Ok(b) = std::fs::read(e.path()) {
                    all.extend(b);
                }
            }
        }
        all
    }
}

/// Every record in a spool directory (none if it does not exist yet); a corrupt line fails.
pub fn read_spool(dir: &Path) -> Vec<CaptureRecord> {
    if !dir.exists() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for item in SpoolReader::open(dir).expect("opening the spool") {
        match item.expect("reading the spool") {
            SpoolItem::Record(e) => out.push(e.record),
            SpoolItem::Torn { .. } => {} // a record mid-append; the next poll sees it whole
            SpoolItem::Corrupt { position, error } => {
                panic!("corrupt spool line at {position}: {error}")
            }
        }
    }
    out
}

/// Output of a `tokentap` CLI run.
#[derive(Debug)]
pub struct CliOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `tokentap ARGS...` to completion (for the `records` subcommands), guarded like every
/// other child.
pub async fn tokentap_cli(args: &[&str]) -> CliOutput {
    tokentap_cli_within(args, Duration::from_secs(60)).await
}

/// [`tokentap_cli`] for a longer run (a benchmark's CI form): killed and failed after `limit`.
pub async fn tokentap_cli_within(args: &[&str], limit: Duration) -> CliOutput {
    let dir = tempfile::tempdir().expect("temp dir");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut cmd = Command::new(tokentap_bin());
    cmd.args(args).env("TOKENTAP_LOG", "warn");
    let mut child = spawn_guarded_split(cmd, &out, &err, KillScope::Process, "tokentap cli")
        .expect("running tokentap");
    let status = child
        .wait_limited(limit)
        .await
        .unwrap_or_else(|| panic!("tokentap {args:?} did not finish within {limit:?}"));
    CliOutput {
        success: status.success(),
        stdout: std::fs::read_to_string(&out).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err).unwrap_or_default(),
    }
}
