//! A uid of its own for each sample's sandboxed task code (issue 49, item 6): the kernel counts
//! inotify instances per uid (`fs.inotify.max_user_instances`, 128 by default), so with every
//! sandbox running as one uid, one sample that opened 128 left the next with `EMFILE`. Two
//! concurrent sandboxed samples on a real root node: one exhausts its inotify instances and
//! holds them; the other, started while they are held, still gets one. The positive control
//! is the same pair on a node started with `--sandbox-uid 65534` (one uid for all, what nodes
//! did before): there the second sample gets `EMFILE` (seen failing that way).

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::{
    free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope,
};

const TOKEN: &str = "uids-node-token-51e0";

/// Root (the uid drop) and bubblewrap.
fn sandbox_available() -> bool {
    tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_bwrap())
}

fn inotify_limit() -> usize {
    std::fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Opens inotify instances until refused (`HOG`), or one (`ONE`); prints how many it got and
/// the errno that stopped it, then, for the hog, holds them for `HOLD` seconds.
const PROBE: &str = r#"
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
mode, hold = sys.argv[1], float(sys.argv[2])
fds, err = [], 0
while True:
    fd = libc.inotify_init1(0)
    if fd < 0:
        err = ctypes.get_errno()
        break
    fds.append(fd)
    if mode == "one" or len(fds) >= 100000:
        break
print("uid=%d got=%d errno=%s" % (os.getuid(), len(fds), os.strerror(err) if err else "none"), flush=True)
time.sleep(hold)
"#;

struct Node {
    dir: tempfile::TempDir,
    base: String,
    _child: ChildGuard,
}

impl Node {
    async fn start(extra: &[&str]) -> Node {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("project")).unwrap();
        std::fs::write(dir.path().join("project/probe.py"), PROBE).unwrap();
        let port = free_port();
        let mut cmd = Command::new(tokentap_bin());
        cmd.current_dir(dir.path())
            .arg("serve")
            .args(["--sandbox", "--run-workers", "2"])
            .args(extra)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--data", "./node", "--spool", "./node/spool"])
            .args(["--backend", "http://127.0.0.1:9", "--backend-kind", "vllm"])
            .env("TOKENTAP_NODE_TOKEN", TOKEN)
            .env("TOKENTAP_LOG", "info");
        let log = dir.path().join("node.log");
        let mut child = spawn_guarded(cmd, &log, KillScope::Group, "tokentap serve").unwrap();
        let base = format!("http://127.0.0.1:{port}");
        wait_healthy(
            &format!("{base}/health"),
            &mut child,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        Node {
            dir,
            base,
            _child: child,
        }
    }

    async fn run(&self, id: &str, args: &str) -> String {
        let task = json!({
            "task_id": id,
            "instruction": "x",
            "workspace": {"dir": {"path": self.dir.path().join("project")}},
            "harness": {"name": "command",
                        "argv": ["sh", "-c", format!("python3 probe.py {args} > probe.txt 2>&1")]},
            "evaluator": {"kind": "session-completed"},
            "budgets": {"session_s": 120, "agent_s": 60, "eval_s": 30}
        });
        let r = http_client()
            .post(format!("{}/v1/rollouts", self.base))
            .bearer_auth(TOKEN)
            .json(&task)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
        let body: Value = r.json().await.unwrap();
        body["samples"][0].as_str().unwrap().to_owned()
    }

    /// The two samples' probe lines (hog, next), once both finished.
    async fn pair(&self) -> (String, String) {
        let hog = self.run("hog", "hog 12").await;
        // The hog's instances are taken well before the second sample opens its one.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let hog_out = self
            .dir
            .path()
            .join("node/samples")
            .join(&hog)
            .join("work/probe.txt");
        while !std::fs::read_to_string(&hog_out).is_ok_and(|s| s.contains("got=")) {
            assert!(
                std::time::Instant::now() < deadline,
                "the hog never reported"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let next = self.run("next", "one 0").await;
        let done =
            node_api::results_within(&self.base, TOKEN, 0, 2, 10, Duration::from_secs(120)).await;
        assert_eq!(done.len(), 2, "{done:?}");
        for s in &done {
            assert_eq!(s["outcome"]["status"], "completed", "{s}");
        }
        let read = |id: &str| {
            std::fs::read_to_string(
                self.dir
                    .path()
                    .join("node/samples")
                    .join(id)
                    .join("work/probe.txt"),
            )
            .unwrap_or_default()
            .trim()
            .to_owned()
        };
        (read(&hog), read(&next))
    }
}

fn uid_of(line: &str) -> u32 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("uid="))
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("no uid in {line:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_sample_that_exhausts_inotify_leaves_the_next_sample_its_own() {
    if !sandbox_available() {
        return;
    }
    let limit = inotify_limit();
    let node = Node::start(&[]).await;
    let (hog, next) = node.pair().await;
    eprintln!("uid per sample: hog {hog:?}, next {next:?} (max_user_instances {limit})");
    assert!(
        hog.contains("Too many open files"),
        "the hog took every instance its uid may have: {hog}"
    );
    assert!(
        next.contains("got=1 errno=none"),
        "the next sample still got an inotify instance: {next}"
    );
    let (a, b) = (uid_of(&hog), uid_of(&next));
    assert_ne!(a, b, "each sample ran as a uid of its own");
    for u in [a, b] {
        assert!(
            (200000..=200999).contains(&u),
            "from the default range: {u}"
        );
    }

    // The positive control: one uid for every sample, as before.
    let shared = Node::start(&["--sandbox-uid", "65534"]).await;
    let (hog, next) = shared.pair().await;
    eprintln!("one uid for all: hog {hog:?}, next {next:?}");
    assert_eq!((uid_of(&hog), uid_of(&next)), (65534, 65534));
    assert!(
        next.contains("got=0") && next.contains("Too many open files"),
        "with one uid the hog starves the next sample: {next}"
    );
}
