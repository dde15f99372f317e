//! Real containers for the node agent's tests: a `dockerd` of the test's own (its own data
//! root, exec root, socket, and a bridge the test creates on a range of its own, without
//! iptables NAT, so containers reach the host's bridge address and nothing beyond), and images
//! assembled offline from a root filesystem (no registry is reachable): busybox-static, curl
//! with its libraries and the CA store, and the libraries `tokentap` needs (the binary itself
//! is bind-mounted at run time, so a rebuilt binary needs no new image).
//!
//! - [`Dockerd::start`] → [`Dockerd::import_base_image`] → [`Dockerd::docker`] (a `docker`
//!   command against this daemon) / [`Dockerd::run`].
//! - The bridge address, [`Dockerd::gateway`], is where containers reach the host: the node
//!   agent listens there, and `--add-host api.openai.com:<gateway>` fakes a hard-coded
//!   endpoint.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use crate::procs::{spawn_guarded, ChildGuard, KillScope};

/// The Debian client; an older one may sit first in PATH.
const DOCKER: &str = "/usr/bin/docker";
/// The image every test container runs.
pub const BASE_IMAGE: &str = "tokentap-test-base:1";

pub struct Dockerd {
    dir: tempfile::TempDir,
    socket: PathBuf,
    bridge: String,
    gateway: Ipv4Addr,
    child: ChildGuard,
}

/// Whether this machine can run the container tests (root, dockerd, busybox, cgroup2);
/// for [`crate::privileged::runs`].
pub fn requirement() -> Result<(), String> {
    crate::privileged::root_with_cgroup2()?;
    for (p, what) in [
        (
            "/usr/sbin/dockerd",
            "dockerd (apt docker.io; scripts/setup installs it)",
        ),
        (DOCKER, "the docker client (apt docker.io)"),
        ("/bin/busybox", "busybox-static"),
    ] {
        let found = Path::new(p).exists() || (p.ends_with("dockerd") && which("dockerd"));
        if !found {
            return Err(format!("{what} is missing"));
        }
    }
    Ok(())
}

fn which(name: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

impl Dockerd {
    /// Starts the daemon on a bridge of its own and waits until it answers.
    pub async fn start() -> Dockerd {
        let dir = tempfile::Builder::new()
            .prefix("ttd")
            .tempdir_in("/tmp")
            .expect("temp dir");
        // A range and a bridge name of this process's own (names are at most 15 bytes).
        let n = std::process::id() % 200 + 20;
        let bridge = format!("ttbr{}", std::process::id() % 100_000);
        let gateway = Ipv4Addr::new(10, 213, n as u8, 1);
        let _ = sh(&format!("ip link del {bridge}"));
        for c in [
            format!("ip link add {bridge} type bridge"),
            format!("ip addr add {gateway}/24 dev {bridge}"),
            format!("ip link set {bridge} up"),
        ] {
            let out = sh(&c);
            assert!(
                out.status.success(),
                "{c}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let socket = dir.path().join("docker.sock");
        let mut cmd = Command::new("dockerd");
        cmd.arg("--data-root")
            .arg(dir.path().join("data"))
            .arg("--exec-root")
            .arg(dir.path().join("exec"))
            .arg("--pidfile")
            .arg(dir.path().join("dockerd.pid"))
            .arg("-H")
            .arg(format!("unix://{}", socket.display()))
            .args(["--bridge", &bridge, "--iptables=false", "--ip-masq=false"])
            .args(["--exec-opt", "native.cgroupdriver=cgroupfs"])
            .args(["--storage-driver", "overlay2"]);
        let log = dir.path().join("dockerd.log");
        let child =
            spawn_guarded(cmd, &log, KillScope::Process, "dockerd").expect("starting dockerd");
        let mut d = Dockerd {
            dir,
            socket,
            bridge,
            gateway,
            child,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if d.docker()
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
            {
                break;
            }
            if let Some(status) = d.child.try_wait() {
                panic!("dockerd exited ({status}):\n{}", d.child.log_tail(30));
            }
            assert!(
                Instant::now() < deadline,
                "dockerd did not answer within 30 s:\n{}",
                d.child.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        d
    }

    /// `unix:///…/docker.sock`, for `--docker-host`.
    pub fn host(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// The host's address on the test's bridge.
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// A `docker` command against this daemon.
    pub fn docker(&self) -> Command {
        let mut c = Command::new(DOCKER);
        c.arg("-H").arg(self.host());
        c
    }

    /// `docker ARGS`, asserting success; stdout, trimmed.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.docker().args(args).output().expect("running docker");
        assert!(
            out.status.success(),
            "docker {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// `docker ARGS` as it ends.
    pub fn run(&self, args: &[&str]) -> Output {
        self.docker().args(args).output().expect("running docker")
    }

    /// Imports [`BASE_IMAGE`]: busybox-static with its applets, curl and its libraries, the
    /// system CA store, and the libraries of `tokentap` (bind-mount the binary itself).
    pub fn import_base_image(&self) {
        let root = self.dir.path().join("rootfs");
        let bin = root.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        std::fs::create_dir_all(root.join("tmp")).unwrap();
        std::fs::create_dir_all(root.join("etc/ssl/certs")).unwrap();
        std::fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
        for applet in [
            "sh", "sleep", "cat", "echo", "ls", "env", "mkdir", "true", "wc",
        ] {
            std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
        }
        let curl = PathBuf::from("/usr/bin/curl");
        std::fs::copy(&curl, bin.join("curl")).unwrap();
        for exe in [curl, crate::artefacts::tokentap_bin()] {
            for lib in libraries(&exe) {
                let to = root.join(lib.strip_prefix("/").unwrap());
                std::fs::create_dir_all(to.parent().unwrap()).unwrap();
                if !to.exists() {
                    std::fs::copy(&lib, &to).unwrap();
                }
            }
        }
        let _ = std::fs::copy(
            "/etc/ssl/certs/ca-certificates.crt",
            root.join("etc/ssl/certs/ca-certificates.crt"),
        );
        std::fs::write(
            root.join("etc/passwd"),
            "root:x:0:0::/tmp:/bin/sh\nnobody:x:65534:65534::/tmp:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(root.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n").unwrap();
        let tar = self.dir.path().join("rootfs.tar");
        let out = Command::new("tar")
            .arg("-C")
            .arg(&root)
            .arg("-cf")
            .arg(&tar)
            .arg(".")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tar: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        self.ok(&[
            "import",
            "-c",
            "CMD [\"/bin/sh\"]",
            tar.to_str().unwrap(),
            BASE_IMAGE,
        ]);
    }

    /// The full id of a container.
    pub fn id_of(&self, name: &str) -> String {
        self.ok(&["inspect", "-f", "{{.Id}}", name])
    }

    pub fn log_tail(&self, n: usize) -> String {
        self.child.log_tail(n)
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let ids = self.run(&["ps", "-aq"]);
        let ids = String::from_utf8_lossy(&ids.stdout).to_string();
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if !ids.is_empty() {
            let _ = self.docker().args(["rm", "-f"]).args(&ids).output();
        }
        // SIGTERM lets dockerd unmount its overlays and stop its containerd.
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = sh(&format!("ip link del {}", self.bridge));
        let _ = sh(&format!(
            "umount -R {} 2>/dev/null; true",
            self.dir.path().join("data").display()
        ));
    }
}

/// The shared libraries (and the loader) an executable needs, from `ldd`.
fn libraries(exe: &Path) -> Vec<PathBuf> {
    let out = Command::new("ldd").arg(exe).output().expect("ldd");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

fn sh(c: &str) -> Output {
    Command::new("sh").args(["-c", c]).output().expect("sh")
}
