//! A real `nats-server` with JetStream (Debian's 2.9.10), on loopback, storing in a directory
//! of the test's; stoppable and restartable on the same port and store (a bus that goes down
//! and comes back). Either with one token for every client, or with deploy/'s `nats.conf`: a
//! user per role (publisher, worker, node) with that role's permissions.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::procs::{free_port, spawn_guarded, wait_healthy, ChildGuard, KillScope};

pub struct NatsServer {
    pub port: u16,
    monitor_port: u16,
    dir: PathBuf,
    /// The `authorization` token clients must present (empty with roles).
    pub token: String,
    /// Started from deploy/kubernetes/components/bus/nats.conf: users, not a token.
    roles: bool,
    /// With roles: (text of deploy's nats.conf, what the test puts in its place).
    edits: Vec<(String, String)>,
    /// Without roles: JetStream's `max_file_store` (else the server's default, 75% of the
    /// disk's free space).
    max_file_store: Option<String>,
    child: Option<ChildGuard>,
}

/// The users of deploy/'s `nats.conf`.
pub const ROLES: [&str; 3] = ["publisher", "worker", "node"];

/// deploy/'s server configuration, users and permissions included.
pub fn deployed_conf() -> PathBuf {
    crate::artefacts::workspace_root().join("deploy/kubernetes/components/bus/nats.conf")
}

impl NatsServer {
    /// Starts `nats-server -js` storing under `dir`, requiring `token`.
    pub async fn start(dir: &Path, token: &str) -> NatsServer {
        Self::start_token(dir, token, None).await
    }

    /// [`NatsServer::start`] with JetStream's file storage limited to `max_file_store` (`1GB`).
    pub async fn start_with_file_store(
        dir: &Path,
        token: &str,
        max_file_store: &str,
    ) -> NatsServer {
        Self::start_token(dir, token, Some(max_file_store.to_owned())).await
    }

    async fn start_token(dir: &Path, token: &str, max_file_store: Option<String>) -> NatsServer {
        let mut n = NatsServer {
            port: free_port(),
            monitor_port: free_port(),
            dir: dir.to_owned(),
            token: token.to_owned(),
            roles: false,
            edits: Vec::new(),
            max_file_store,
            child: None,
        };
        n.first_start().await;
        n
    }

    /// Starts `nats-server` with deploy/'s `nats.conf` (its users and their permissions as
    /// deployed; only the listen and monitoring addresses and the store directory are the
    /// test's), each role's password [`NatsServer::password`] from the server's environment.
    pub async fn start_with_roles(dir: &Path) -> NatsServer {
        Self::start_with_roles_edited(dir, Vec::new()).await
    }

    /// [`NatsServer::start_with_roles`] with `edits` to deploy's `nats.conf`: each (a text it
    /// must contain, what replaces it), such as [`agent_host_user`].
    pub async fn start_with_roles_edited(dir: &Path, edits: Vec<(String, String)>) -> NatsServer {
        let mut n = NatsServer {
            port: free_port(),
            monitor_port: free_port(),
            dir: dir.to_owned(),
            token: String::new(),
            roles: true,
            edits,
            max_file_store: None,
            child: None,
        };
        n.first_start().await;
        n
    }

    /// The password of `role` (one of [`ROLES`]) on a server started with roles.
    pub fn password(&self, role: &str) -> String {
        format!("e2e-{role}-bus-password-{}", self.port)
    }

    /// A file (0600) holding the password of `role`, for `--bus-password-file`.
    pub fn password_file(&self, role: &str) -> PathBuf {
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.dir.with_extension(format!("{role}.password"));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .expect("password file");
        std::io::Write::write_all(&mut f, format!("{}\n", self.password(role)).as_bytes())
            .expect("password file");
        path
    }

    /// `--bus URL --bus-user ROLE --bus-password-file FILE`.
    pub fn role_args(&self, role: &str) -> Vec<String> {
        vec![
            "--bus".into(),
            self.url(),
            "--bus-user".into(),
            role.into(),
            "--bus-password-file".into(),
            self.password_file(role).display().to_string(),
        ]
    }

    /// The log so far (where the server's permission violations are).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.with_extension("log")).unwrap_or_default()
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts it again after [`NatsServer::stop`]: same port, same store.
    pub async fn restart(&mut self) {
        if let Err(e) = self.launch().await {
            panic!("nats-server did not start: {e}");
        }
    }

    /// The first start: on a port another process took between [`free_port`] and the
    /// server's bind, new ports and another try (a restart keeps its ports, so it cannot).
    async fn first_start(&mut self) {
        for _ in 0..3 {
            match self.launch().await {
                Ok(()) => return,
                Err(e) if e.contains("address already in use") => {
                    eprintln!("nats-server: a port was taken, trying others:\n{e}");
                    self.port = free_port();
                    self.monitor_port = free_port();
                }
                Err(e) => panic!("nats-server did not start: {e}"),
            }
        }
        panic!("nats-server did not start: three pairs of ports were taken");
    }

    async fn launch(&mut self) -> Result<(), String> {
        std::fs::create_dir_all(&self.dir).expect("nats store dir");
        let mut cmd = Command::new("nats-server");
        if self.roles {
            let mut conf = std::fs::read_to_string(deployed_conf()).expect("deploy's nats.conf");
            for (line, ours) in [
                (
                    "listen: 0.0.0.0:4222",
                    format!("listen: 127.0.0.1:{}", self.port),
                ),
                (
                    "http: 0.0.0.0:8222",
                    format!("http: 127.0.0.1:{}", self.monitor_port),
                ),
                ("store_dir: /data", format!("store_dir: {:?}", self.dir)),
            ]
            .into_iter()
            .chain(self.edits.iter().map(|(l, o)| (l.as_str(), o.clone())))
            {
                assert!(conf.contains(line), "deploy's nats.conf has no `{line}`");
                conf = conf.replace(line, &ours);
            }
            let path = self.dir.with_extension("conf");
            std::fs::write(&path, conf).expect("nats.conf");
            cmd.arg("-c").arg(&path);
            for role in ROLES {
                cmd.env(
                    format!("TOKENTAP_BUS_{}_PASSWORD", role.to_uppercase()),
                    self.password(role),
                );
            }
        } else {
            cmd.args(["-js", "-a", "127.0.0.1"])
                .args(["-p", &self.port.to_string()])
                .args(["-m", &self.monitor_port.to_string()])
                .arg("-sd")
                .arg(&self.dir)
                .args(["--auth", &self.token]);
            if let Some(limit) = &self.max_file_store {
                let path = self.dir.with_extension("conf");
                std::fs::write(&path, format!("jetstream {{ max_file_store: {limit} }}\n"))
                    .expect("nats.conf");
                cmd.arg("-c").arg(&path);
            }
        }
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
        .map_err(|e| format!("{e}\n{}", child.log_tail(20)))?;
        self.child = Some(child);
        Ok(())
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

/// The edit to deploy's `nats.conf` its comment describes for another agent host: a user
/// `name` (password `password`, in the file: for tests only) in the publishers' account, who
/// may publish records under its own name only.
pub fn agent_host_user(name: &str, password: &str) -> (String, String) {
    let anchor = "        # More agent hosts: one user each";
    let user = format!(
        r#"        {{
          user: {name}
          password: "{password}"
          permissions: {{
            publish: {{
              allow: [
                "tokentap.records.{name}.*",
                "$JS.API.STREAM.INFO.TOKENTAP_RECORDS",
                "tokentap.jsapi.STREAM.INFO.TOKENTAP_RECORDS",
                "tokentap.jsapi.STREAM.INFO.KV_tokentap_progress",
                "tokentap.jsapi.DIRECT.GET.KV_tokentap_progress.$KV.tokentap_progress.partitions"
              ]
            }}
            subscribe: {{ allow: ["_INBOX.{name}.>"] }}
          }}
        }}
"#
    );
    (anchor.to_owned(), format!("{user}{anchor}"))
}
