//! Transparent capture under test: `tokentap run` around a command that lives in a private
//! mount namespace where hard-coded API hosts resolve to 127.0.0.x and nothing else resolves
//! at all (the network rule: a failed redirect is a refused local connect, and no name can
//! lead off the machine).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::artefacts::tokentap_bin;

/// Fake DNS for one command: a hosts file and an unusable resolver, bind-mounted over
/// `/etc/hosts` and `/etc/resolv.conf` in a private mount namespace (`unshare -m`).
pub struct FakeNet {
    _dir: tempfile::TempDir,
    wrapper: PathBuf,
}

impl FakeNet {
    /// `hosts`: (name, loopback address) pairs.
    pub fn new(hosts: &[(&str, &str)]) -> FakeNet {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut h = String::from("127.0.0.1 localhost\n::1 localhost\n");
        for (name, addr) in hosts {
            let ip: std::net::IpAddr = addr.parse().expect("an address");
            assert!(
                ip.is_loopback(),
                "{addr} is not loopback (the network rule)"
            );
            h.push_str(&format!("{addr} {name}\n"));
        }
        let hosts_file = dir.path().join("hosts");
        std::fs::write(&hosts_file, h).unwrap();
        let resolv = dir.path().join("resolv.conf");
        std::fs::write(
            &resolv,
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
        )
        .unwrap();
        let wrapper = dir.path().join("fake-net.sh");
        std::fs::write(
            &wrapper,
            format!(
                "set -e\nmount --bind {} /etc/hosts\nmount --bind {} /etc/resolv.conf\nexec \"$@\"\n",
                hosts_file.display(),
                resolv.display()
            ),
        )
        .unwrap();
        FakeNet { _dir: dir, wrapper }
    }

    /// The argv prefix that runs a command inside the fake network.
    pub fn prefix(&self) -> Vec<String> {
        vec![
            "unshare".into(),
            "-m".into(),
            "--propagation".into(),
            "private".into(),
            "sh".into(),
            self.wrapper.display().to_string(),
        ]
    }
}

/// `tokentap run --backend URL --backend-kind KIND --spool SPOOL [extra] -- <fake net> CMD…`
/// with the CA in `ca_dir`.
pub fn tokentap_run(
    backend: &str,
    kind: &str,
    spool: &Path,
    ca_dir: &Path,
    extra: &[String],
    net: &FakeNet,
    cmd: &[String],
) -> Command {
    let mut c = Command::new(tokentap_bin());
    c.arg("run")
        .args(["--backend", backend, "--backend-kind", kind])
        .arg("--spool")
        .arg(spool)
        .args(extra)
        .arg("--")
        .args(net.prefix())
        .args(cmd)
        .env("TOKENTAP_CA_DIR", ca_dir);
    c
}

/// The run cgroups tokentap has left behind whose names start with `prefix`.
pub fn leftover_cgroups(prefix: &str) -> Vec<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let Some(root) = mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(f[1]))
    }) else {
        return Vec::new();
    };
    std::fs::read_dir(root.join("tokentap"))
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(prefix))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Names of the eBPF programs loaded in the kernel right now.
pub fn loaded_bpf_programs() -> Vec<String> {
    aya::programs::loaded_programs()
        .flatten()
        .filter_map(|p| p.name_as_str().map(str::to_owned))
        .collect()
}

/// Whether this test may do what transparent capture needs (root, cgroup v2); when it may
/// not, the test fails under `TOKENTAP_REQUIRE_PRIVILEGED=1` or reports its skip
/// ([`crate::privileged::runs`]).
pub fn privileged() -> bool {
    crate::privileged::runs(crate::privileged::root_with_cgroup2())
}

/// A TLS server of the test's own (its own self-signed certificate for `name`), answering
/// every request with `body`; returns the certificate PEM clients should trust.
pub struct OwnTlsServer {
    pub cert_pem: String,
    task: tokio::task::JoinHandle<()>,
}

impl OwnTlsServer {
    pub async fn start(addr: &str, name: &str, body: &'static str) -> OwnTlsServer {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let cert_pem = cert.pem();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("binding the TLS server");
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let Ok(mut tls) = acceptor.accept(conn).await else {
                        return;
                    };
                    let mut buf = vec![0u8; 4096];
                    let _ = tls.read(&mut buf).await;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.shutdown().await;
                });
            }
        });
        OwnTlsServer { cert_pem, task }
    }
}

impl Drop for OwnTlsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
