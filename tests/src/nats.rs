//! A real `nats-server` with JetStream (Debian's 2.9.10), on loopback, storing in a directory
//! of the test's; stoppable and restartable on the same port and store (a bus that goes down
//! and comes back).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::procs::{free_port, spawn_guarded, wait_healthy, ChildGuard, KillScope};

pub struct NatsServer {
    pub port: u16,
    monitor_port: u16,
    dir: PathBuf,
    /// The `authorization` token clients must present.
    pub token: String,
    child: Option<ChildGuard>,
}

impl NatsServer {
    /// Starts `nats-server -js` storing under `dir`, requiring `token`.
    pub async fn start(dir: &Path, token: &str) -> NatsServer {
        let mut n = NatsServer {
            port: free_port(),
            monitor_port: free_port(),
            dir: dir.to_owned(),
            token: token.to_owned(),
            child: None,
        };
        n.restart().await;
        n
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts it again after [`NatsServer::stop`]: same port, same store.
    pub async fn restart(&mut self) {
        std::fs::create_dir_all(&self.dir).expect("nats store dir");
        let mut cmd = Command::new("nats-server");
        cmd.args(["-js", "-a", "127.0.0.1"])
            .args(["-p", &self.port.to_string()])
            .args(["-m", &self.monitor_port.to_string()])
            .arg("-sd")
            .arg(&self.dir)
            .args(["--auth", &self.token]);
        let mut child = spawn_guarded(
            cmd,
            &self.dir.with_extension("log"),
            KillScope::Process,
            "nats-server",
        )
        .expect("nats-server (Debian package nats-server; scripts/setup installs it)");
        // Ready once JetStream has recovered its store.
        wait_healthy(
            &format!("http://127.0.0.1:{}/healthz", self.monitor_port),
            &mut child,
            Duration::from_secs(30),
        )
        .await
        .unwrap_or_else(|e| panic!("nats-server did not start: {e}\n{}", child.log_tail(20)));
        self.child = Some(child);
    }

    /// SIGTERM (a clean shutdown: the store is consistent), waited for.
    pub async fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            assert!(
                c.terminate(Duration::from_secs(20)).await,
                "nats-server did not stop"
            );
        }
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.child
            .as_ref()
            .map_or_else(String::new, |c| c.log_tail(n))
    }
}
