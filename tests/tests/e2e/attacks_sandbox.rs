//! The rollout node against hostile task code (issue 12). Each attack is a task — an agent, a
//! set-up or an evaluator, all shell scripts — run by a real `tokentap serve` node, and each
//! test asserts the attack failed and that the node kept serving the other samples: reading the
//! node's CA key, spool, files and token (from the environment and /proc), another sample's
//! files and capture session, writing outside through planted links and through the evaluation
//! copy, reaching the network, exhausting the node, remounting `/` read-write.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::nats::NatsServer;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::{
    free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope,
};
use tokentap_e2e::scripted::{counting_replies, curl_agent, ScriptedBackend, Tokens};

const TOKEN: &str = "attack-node-token-4f1e";
const BUS_TOKEN: &str = "attack-bus-token-9c2d";
const ENGINE_KEY: &str = "attack-engine-key-9c2d";

/// Root and bubblewrap: what the sandboxed attacks need.
fn sandbox_available() -> bool {
    tokentap_e2e::privileged::runs(tokentap_e2e::privileged::root_with_bwrap())
}

/// A `tokentap serve` node started in its own directory with a relative `--data ./node`, the
/// node token and an engine key in its environment.
struct Node {
    dir: tempfile::TempDir,
    base: String,
    child: ChildGuard,
    engine: ScriptedBackend,
}

impl Node {
    async fn start(extra: &[&str], path: Option<&str>) -> Node {
        Node::start_with(extra, path, &[]).await
    }

    /// With more environment (a bus token).
    async fn start_with(extra: &[&str], path: Option<&str>, env: &[(&str, &str)]) -> Node {
        let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("project")).unwrap();
        let port = free_port();
        let mut cmd = Command::new(tokentap_bin());
        cmd.current_dir(dir.path())
            .arg("serve")
            .args(extra)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--data", "./node", "--spool", "./node/spool"])
            .args(["--backend", &engine.url, "--backend-kind", "vllm"])
            .env("TOKENTAP_NODE_TOKEN", TOKEN)
            .env("TOKENTAP_BACKEND_API_KEY", ENGINE_KEY)
            .env("TOKENTAP_LOG", "info")
            .envs(env.iter().copied());
        if let Some(p) = path {
            cmd.env("PATH", p);
        }
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
            child,
            engine,
        }
    }

    /// The node's data directory, absolute.
    fn data(&self) -> PathBuf {
        self.dir.path().join("node")
    }

    fn project(&self) -> PathBuf {
        self.dir.path().join("project")
    }

    fn sample_dir(&self, id: &str) -> PathBuf {
        self.data().join("samples").join(id)
    }

    async fn submit(&self, task: &Value) -> reqwest::Response {
        http_client()
            .post(format!("{}/v1/rollouts", self.base))
            .bearer_auth(TOKEN)
            .json(task)
            .send()
            .await
            .unwrap()
    }

    /// Submits `task`; its sample ids.
    async fn run(&self, task: &Value) -> Vec<String> {
        let r = self.submit(task).await;
        assert_eq!(r.status(), 202, "{task}");
        let body: Value = r.json().await.unwrap();
        body["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect()
    }

    /// The finished samples by id, once `n` have finished.
    async fn finished(&self, n: usize) -> std::collections::HashMap<String, Value> {
        node_api::results_within(&self.base, TOKEN, 0, n, 10, Duration::from_secs(120))
            .await
            .into_iter()
            .map(|s| (s["sample_id"].as_str().unwrap().to_owned(), s))
            .collect()
    }

    async fn healthy(&mut self) -> bool {
        self.child.try_wait().is_none()
            && http_client()
                .get(format!("{}/health", self.base))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
    }

    fn read(&self, id: &str, rel: &str) -> String {
        std::fs::read_to_string(self.sample_dir(id).join(rel)).unwrap_or_default()
    }
}

fn task(project: &Path, id: &str, script: &str, evaluator: Value) -> Value {
    json!({
        "task_id": id,
        "instruction": "x",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": evaluator,
        "budgets": {"session_s": 120, "agent_s": 60, "eval_s": 30}
    })
}

/// An interface of the test's own (a bridge without ports: no traffic leaves the machine)
/// with a non-loopback address on the host, removed on drop.
struct DummyInterface {
    name: String,
}

impl DummyInterface {
    fn create(name: &str, addr: &str) -> DummyInterface {
        let ip = |args: &[&str]| {
            let ok = Command::new("ip").args(args).status().unwrap().success();
            assert!(ok, "ip {args:?}");
        };
        let _ = Command::new("ip").args(["link", "del", name]).status();
        ip(&["link", "add", name, "type", "bridge"]);
        let iface = DummyInterface { name: name.into() };
        ip(&["addr", "add", &format!("{addr}/32"), "dev", name]);
        ip(&["link", "set", name, "up"]);
        iface
    }
}

impl Drop for DummyInterface {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .status();
    }
}

/// Probes run by task code (the agent, then the evaluator; `sh probe.sh VICTIM_SAMPLE_ID`):
/// one line per probe, `NAME: blocked` or `NAME: LEAK ...`. With `OUTSIDE` set (the test's
/// own run on the host, the positive control) the two that would change the host are left out.
fn probe_script(data: &Path, host_addr: &str, bus_port: u16) -> String {
    let d = data.display();
    format!(
        r#"probe() {{ name=$1; shift; if out=$(sh -c "$*" 2>/dev/null) && [ -n "$out" ]; then echo "$name: LEAK $(echo "$out" | head -c 200 | tr '\n' ' ')"; else echo "$name: blocked"; fi; }}
probe ca-key "cat {d}/ca/ca-key.pem"
probe node-file "cat {d}/visible.txt"
probe spool "ls {d}/spool"
probe store "ls {d}/node.redb"
probe other-sample "cat {d}/samples/$1/work/victim.txt"
probe other-samples "ls -A {d}/samples/$1"
probe env-token "env | grep -e {TOKEN} -e {ENGINE_KEY} -e {BUS_TOKEN}"
probe proc-environ "cat /proc/*/environ | tr '\0' '\n' | grep -e {TOKEN} -e {ENGINE_KEY} -e {BUS_TOKEN}"
probe proc-1-environ "cat /proc/1/environ | tr '\0' '\n'"
probe root-profile "cat /root/.profile"
probe root-bashrc "cat /root/.bashrc"
probe root-gitconfig "cat /root/.gitconfig"
probe root-npmrc "cat /root/.npmrc"
probe shadow "cat /etc/shadow"
probe other-proc-cwd "ls -l /proc/[0-9]*/cwd 2>/dev/null | grep -F samples/$1/"
probe pid-count 'n=$(ls -d /proc/[0-9]* | wc -l); [ "$n" -gt 30 ] && echo "$n processes"'
[ -n "$OUTSIDE" ] || probe remount "mount -o remount,rw / && echo remounted"
[ -n "$OUTSIDE" ] || probe write-usr "touch /usr/tokentap-probe && echo wrote"
probe interfaces "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | grep -v '^lo$'"
probe host-address "curl -s -m 3 http://{host_addr}/ && echo reached"
probe bus "curl -s -m 3 telnet://127.0.0.1:{bus_port} </dev/null | head -c 100"
echo "uid: $(id -u)"
"#
    )
}

/// The sandbox against everything a sample's agent and evaluator might try on a root node:
/// every probe is blocked, the calls it makes in another sample's name land in its own
/// session, links it plants are not followed, the evaluation copy will not restore through a
/// link, a fork bomb and a memory hog stay inside their limits, and the victim sample next to
/// them completes normally. The node runs with a relative `--data`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_sandboxed_task_code_cannot_touch_the_node_or_other_samples() {
    if !sandbox_available() {
        return;
    }
    // Reachable from the host, not from a sandbox.
    let dummy_addr = "10.254.77.1";
    let _dummy = DummyInterface::create("ttsbx0", dummy_addr);
    let host_only = tokio::net::TcpListener::bind((dummy_addr, 0))
        .await
        .unwrap();
    let host_addr = host_only.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = host_only.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = c
                .write_all(b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello")
                .await;
        }
    });
    let from_host = Command::new("curl")
        .args(["-s", "-m", "3", &format!("http://{host_addr}/")])
        .output()
        .unwrap();
    assert_eq!(
        from_host.stdout, b"hello",
        "the host reaches its own address"
    );

    // The node is one of a cluster: its bus (on the host's loopback) and the bus's token (in
    // its environment) are two more things task code must not reach.
    let nats_dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&nats_dir.path().join("nats"), BUS_TOKEN).await;
    let bus_url = nats.url();
    let bus_port: u16 = bus_url.rsplit(':').next().unwrap().parse().unwrap();
    let key = tokentap_e2e::node_api::TaskKeyFile::new();
    let mut node = Node::start_with(
        &["--sandbox", "--bus", &bus_url, "--task-key-file", key.arg()],
        None,
        &[("TOKENTAP_BUS_TOKEN", BUS_TOKEN)],
    )
    .await;
    let data = node.data();
    // What the node holds that task code must not see: a CA key (0600) and a world-readable
    // file (hidden by the mounts alone).
    std::fs::create_dir_all(data.join("ca")).unwrap();
    std::fs::write(data.join("ca/ca-key.pem"), "CA-SECRET").unwrap();
    std::fs::write(data.join("visible.txt"), "NODE-FILE").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        data.join("ca/ca-key.pem"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::fs::set_permissions(
        data.join("visible.txt"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let outside = node.dir.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("test_x.py"), "untouched").unwrap();
    let project = node.project();
    std::fs::write(
        project.join("probe.sh"),
        probe_script(&data, &host_addr, bus_port),
    )
    .unwrap();
    std::fs::create_dir_all(project.join("tests")).unwrap();
    std::fs::write(project.join("tests/test_x.py"), "the real test").unwrap();

    // The victim: one call, a file of its own, alive while the others attack.
    let victim = node
        .run(&task(
            &project,
            "victim",
            &curl_agent(1, "echo VICTIM-SECRET > victim.txt && sleep 4"),
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    // The positive control: the same probes on the host (as root, beside the running victim)
    // leak, each that can: a probe that cannot fail would pass in the sandbox for nothing.
    let victim_file = node.sample_dir(&victim).join("work/victim.txt");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !victim_file.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the victim never wrote its file"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let on_host = Command::new("sh")
        .args(["probe.sh", &victim])
        .current_dir(&project)
        .env("OUTSIDE", "1")
        .output()
        .unwrap();
    let on_host = String::from_utf8_lossy(&on_host.stdout).into_owned();
    // (Not proc-1-environ: the host's init may have an empty environment; in the sandbox its
    // PID 1 is bubblewrap's.)
    let mut must_leak = vec![
        "ca-key",
        "node-file",
        "spool",
        "store",
        "other-sample",
        "other-samples",
        "proc-environ",
        "shadow",
        "interfaces",
        "host-address",
        "bus",
        "other-proc-cwd",
        "pid-count",
    ];
    for (name, file) in [
        ("root-profile", ".profile"),
        ("root-bashrc", ".bashrc"),
        ("root-gitconfig", ".gitconfig"),
        ("root-npmrc", ".npmrc"),
    ] {
        if std::fs::metadata(Path::new("/root").join(file)).is_ok_and(|m| m.len() > 0) {
            must_leak.push(name);
        }
    }
    for name in &must_leak {
        assert!(
            on_host.contains(&format!("{name}: LEAK")),
            "positive control: {name} leaks outside the sandbox:\n{on_host}"
        );
    }

    // The attacker: probes, calls in the victim's name (header, path, query), links planted
    // where the node writes; its evaluator probes again and rewards 1 only if all failed.
    let chat = |extra: &str, url: &str| {
        format!(
            "curl -sS -m 10 -o /dev/null -w '%{{http_code}}\\n' {url} -H 'content-type: application/json' {extra} -d '{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"task\"}}]}}' >> calls.txt; "
        )
    };
    let root = "${OPENAI_BASE_URL%/s/*}";
    let attacker_script = format!(
        "sh probe.sh {victim} > probes.txt; \
         touch \"$HOME/.config-probe\" \"$TMPDIR/probe\" && echo writable > own-dirs.txt; \
         {}{}{}\
         for f in traces.jsonl eval.log agent.log setup.log reward; do ln -sf {node_file} ../$f 2>/dev/null; done; \
         ln -sf {node_file} eval.log; true",
        chat(
            &format!("-H 'x-tokentap-session: {victim}'"),
            "\"$OPENAI_BASE_URL/chat/completions\""
        ),
        chat("", &format!("\"{root}/s/{victim}/v1/chat/completions\"")),
        chat("", &format!("\"$OPENAI_BASE_URL/chat/completions?session={victim}\"")),
        node_file = data.join("visible.txt").display(),
    );
    let evaluator = json!({
        "kind": "command",
        "command": format!(
            "sh probe.sh {victim} > \"$HOME/p.txt\"; cat \"$HOME/p.txt\"; ln -sf {} ../eval.log 2>/dev/null; \
             ! grep -q LEAK \"$HOME/p.txt\"",
            data.join("visible.txt").display()
        )
    });
    let attacker = node
        .run(&task(&project, "attacker", &attacker_script, evaluator))
        .await
        .remove(0);

    // The escape: `tests` becomes a link out of the workspace before evaluation restores
    // `tests/test_x.py` into it.
    let mut escape_task = task(
        &project,
        "escape",
        &format!("rm -rf tests && ln -s {} tests", outside.display()),
        json!({"kind": "command", "command": "true", "test_files": ["tests/test_x.py"]}),
    );
    escape_task["workspace"]["dir"]["setup"] = json!("ls > setup-ran.txt");
    let escape = node.run(&escape_task).await.remove(0);

    // The hog: memory past its limit, then a fork bomb, until its budget.
    let mut hog_task = task(
        &project,
        "hog",
        "head -c 1G /dev/zero | tail > /dev/null; echo $? > mem.txt; b() { b | b & }; b; sleep 30",
        json!({"kind": "session-completed"}),
    );
    hog_task["limits"] = json!({"memory_mb": 128, "pids": 64});
    hog_task["budgets"]["agent_s"] = json!(6);
    let hog = node.run(&hog_task).await.remove(0);

    let done = node.finished(4).await;
    assert!(node.healthy().await, "the node keeps serving");

    let v = &done[&victim];
    assert_eq!(
        v["outcome"],
        json!({"status": "completed", "reward": 1.0}),
        "{v}"
    );
    assert_eq!(
        v["trajectory"]["calls"], 1,
        "only the victim's own call: {v}"
    );

    let a = &done[&attacker];
    let probes = node.read(&attacker, "work/probes.txt");
    assert!(
        probes.contains("host-address:") && probes.contains("bus:"),
        "the probes ran: {probes}\n{}",
        node.read(&attacker, "agent.log")
    );
    assert!(!probes.contains("LEAK"), "agent probes:\n{probes}");
    assert_eq!(
        node.read(&attacker, "work/own-dirs.txt").trim(),
        "writable",
        "its HOME and TMPDIR are its own"
    );
    // A uid of the node's pool (--sandbox-uid-range, 200000-200999 by default): each sample
    // its own, never root.
    let uid: u32 = probes
        .lines()
        .find_map(|l| l.strip_prefix("uid: "))
        .and_then(|u| u.trim().parse().ok())
        .unwrap_or_else(|| panic!("no uid line:\n{probes}"));
    assert!(
        (200_000..=200_999).contains(&uid),
        "the agent runs as a sandbox uid of the pool:\n{probes}"
    );
    assert_eq!(
        a["outcome"],
        json!({"status": "completed", "reward": 1.0}),
        "the evaluator's probes:\n{}\n{a}",
        node.read(&attacker, "eval.log")
    );
    let codes = node.read(&attacker, "work/calls.txt");
    assert_eq!(codes.lines().collect::<Vec<_>>(), ["200"; 3], "{codes}");
    assert_eq!(
        a["trajectory"]["calls"], 3,
        "all three calls in its own session: {a}"
    );
    assert_eq!(
        std::fs::read_to_string(data.join("visible.txt")).unwrap(),
        "NODE-FILE",
        "nothing written through a planted link"
    );
    for f in ["traces.jsonl", "eval.log", "agent.log"] {
        let m = std::fs::symlink_metadata(node.sample_dir(&attacker).join(f)).unwrap();
        assert!(m.is_file(), "{f} is the node's own file");
    }

    let e = &done[&escape];
    let reason = e["outcome"]["reason"].as_str().unwrap_or_default();
    assert!(
        e["outcome"]["status"] == "error" && reason.contains("link"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(outside.join("test_x.py")).unwrap(),
        "untouched"
    );
    assert!(
        node.read(&escape, "work/setup-ran.txt")
            .contains("probe.sh"),
        "the set-up ran (sandboxed) in the working copy"
    );

    let h = &done[&hog];
    assert_eq!(
        node.read(&hog, "work/mem.txt").trim(),
        "137",
        "the memory hog was killed: {h}"
    );
    assert!(h["agent"]["oom_killed"].as_bool().unwrap_or(false), "{h}");
    assert_eq!(
        h["agent"]["pids_limit_hit"], true,
        "the fork bomb met its limit: {h}"
    );
    assert!(node.healthy().await);
}

/// One sample floods its capture with 2,000 connections while another sample's call
/// completes: the flooder's socket holds at most `MAX_CONNECTIONS_PER_SAMPLE` connections on
/// the node (the node's open descriptors stay bounded, the figure is printed), the node keeps
/// listening, and the other sample ends completed with its call captured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_sample_flooding_its_capture_starves_only_itself() {
    use tokentap_rollout::accept::MAX_CONNECTIONS_PER_SAMPLE;
    if !sandbox_available() {
        return;
    }
    let mut node = Node::start(&["--sandbox"], None).await;
    let project = node.project();
    let node_pid = node.child.id();
    let open_fds = move || {
        std::fs::read_dir(format!("/proc/{node_pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let before = open_fds();
    let flood = r#"/usr/bin/python3 - <<'PY'
import os, socket, time, urllib.parse
u = urllib.parse.urlparse(os.environ["OPENAI_BASE_URL"])
held = []
for _ in range(2000):
    try:
        held.append(socket.create_connection((u.hostname, u.port), timeout=2))
    except OSError:
        pass
open("opened.txt", "w").write(str(len(held)))
time.sleep(12)
PY"#;
    let flooder = node
        .run(&task(
            &project,
            "flooder",
            flood,
            json!({"kind": "command", "command": "true"}),
        ))
        .await
        .remove(0);
    // The node's descriptors, sampled while the flood lasts.
    let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (most, stop) = (most.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                most.fetch_max(open_fds(), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while node.read(&flooder, "work/opened.txt").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the flood never ended: {}\n{}",
            node_api::get_json(
                &format!(
                    "{}/v1/rollouts/{}",
                    node.base,
                    flooder.rsplit_once('-').unwrap().0
                ),
                TOKEN
            )
            .await,
            node.read(&flooder, "agent.log")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let opened: usize = node
        .read(&flooder, "work/opened.txt")
        .trim()
        .parse()
        .unwrap();
    // While the flooder still holds what it opened, another sample calls the model.
    let victim = node
        .run(&task(
            &project,
            "victim",
            &curl_agent(1, "true"),
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let done = node.finished(2).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let most = most.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "flooder opened {opened} connections; node descriptors {before} before, at most {most} during"
    );
    assert!(
        opened >= 500,
        "the flood did not happen: {opened} connections"
    );
    assert_eq!(
        done[&victim]["outcome"]["status"], "completed",
        "{}",
        done[&victim]
    );
    assert_eq!(
        done[&victim]["trajectory"]["calls"], 1,
        "the victim's call was not captured: {}",
        done[&victim]
    );
    // The flooder's share (64), the victim's few connections and the node's own churn; a
    // fixed bound, not the product's constant: with no cap the flood takes about 2,000.
    const { assert!(MAX_CONNECTIONS_PER_SAMPLE <= 64) };
    assert!(
        most <= before + 200,
        "the node held {most} descriptors during the flood ({before} before)"
    );
    assert!(node.healthy().await);
}

/// An unauthenticated local client (here an unsandboxed agent) on the node's capture port:
/// `/v1/models`, `count_tokens`, `/metrics` and calls without the sample's secret, or with a
/// wrong one, are refused (403) before the engine is asked, counted in
/// `tokentap_calls_refused_total{reason="unknown_session"}` and never recorded (100 of them
/// with 30 KB headers leave the spool as it was); a head over 64 KiB is refused (431) even
/// with the secret, and on `/health`, which needs none. With the secret, `/v1/models` and `count_tokens` are answered, and the
/// sample's record keeps its path without the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_capture_route_needs_the_samples_secret() {
    let node = Node::start(&[], None).await;
    // The node's own lookups at start (its engine check), before any sample.
    let before = node.engine.lookups().len();
    let project = node.project();
    let code = |url: &str, extra: &str| {
        format!(
            "curl -sS -m 10 -o /dev/null -w '%{{http_code}}\\n' {extra} \"{url}\" >> codes.txt; "
        )
    };
    let count_body = r#"-H 'content-type: application/json' -d '{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}'"#;
    let root = "${OPENAI_BASE_URL%/s/*}";
    let pad = "x".repeat(30 << 10);
    let script = [
        // With its secret: answered.
        code("$OPENAI_BASE_URL/models", ""),
        code("$ANTHROPIC_BASE_URL/v1/messages/count_tokens", count_body),
        // Without it, or with a wrong one: refused.
        code(&format!("{root}/v1/models"), ""),
        code(&format!("{root}/s/not-a-secret/v1/models"), ""),
        code(&format!("{root}/v1/messages/count_tokens"), count_body),
        code(&format!("{root}/metrics"), ""),
        code(&format!("{root}/s/not-a-secret/metrics"), ""),
        // A head over the limit, even with the secret.
        "printf 'x-pad: %070000d\\n' 0 > pad.h; ".to_owned(),
        code("$OPENAI_BASE_URL/models", "-H @pad.h"),
        // `/health` needs no secret, but its head is bounded too (a 200 KB head was answered
        // 200 before).
        code(&format!("{root}/health"), ""),
        code(&format!("{root}/health"), "-H @pad.h"),
        // 100 refused calls with 30 KB headers: nothing recorded.
        format!("for i in $(seq 100); do curl -s -m 10 -o /dev/null \"{root}/v1/chat/completions\" -H 'x-pad: {pad}' -H 'content-type: application/json' -d '{{}}'; done; "),
        curl_agent(1, "true"),
    ]
    .concat();
    let id = node
        .run(&task(
            &project,
            "prober",
            &script,
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let done = node.finished(1).await;
    let s = &done[&id];
    let codes = node.read(&id, "work/codes.txt");
    assert_eq!(
        codes.lines().collect::<Vec<_>>(),
        ["200", "200", "403", "403", "403", "403", "403", "431", "200", "431"],
        "{codes}\n{}",
        node.read(&id, "agent.log")
    );
    assert_eq!(s["trajectory"]["calls"], 1, "{s}");
    // The engine saw the two admitted lookups (and perhaps the capture's one template probe).
    let lookups = node.engine.lookups().split_off(before);
    assert_eq!(
        lookups.iter().filter(|p| *p == "/v1/models").count(),
        1,
        "{lookups:?}"
    );
    assert!(
        lookups.iter().filter(|p| *p == "/tokenize").count() <= 2,
        "{lookups:?}"
    );
    let records = tokentap_e2e::tokentap::read_spool(&node.data().join("spool"));
    assert_eq!(
        records.len(),
        1,
        "only the admitted call is recorded: {:?}",
        records.iter().map(|r| &r.session_id).collect::<Vec<_>>()
    );
    let path = &records[0].request.path;
    assert_eq!(
        path, "/s/[redacted]/v1/chat/completions",
        "the secret is not kept"
    );
    let metrics = node_api::get_text(&format!("{}/metrics", node.base), TOKEN).await;
    let refused = metrics
        .lines()
        .find(|l| l.starts_with("tokentap_calls_refused_total{reason=\"unknown_session\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(refused, Some(105.0), "{metrics}");
}

/// A sample cannot grow the node at the rate it sends bytes (issue 37 item 5). One sample sends
/// three 20 MB bodies that are JSON but no request (each answered 400, no engine call): their
/// records keep a 64 KiB excerpt, not the body, and once it has sent 50 MB
/// (`--sample-max-request-bytes`) its next call is refused before its body is read. Another
/// sample, meanwhile, makes six calls against `--sample-max-calls 4`: four are answered, two
/// refused. Refusals are counted, never recorded. The spool's growth and the node's peak RSS
/// are printed (the bound is a benchmark's, not this test's). Seen failing with the excerpt
/// off (the spool held the three bodies whole, 60 MB), with no budget (all six answered) and
/// with `count_tokens` not charged (its five counts and the call after them all answered 200).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_is_bounded_in_calls_and_bytes_and_failed_bodies_are_excerpts() {
    let node = Node::start(
        &[
            "--sample-max-calls",
            "4",
            "--sample-max-request-bytes",
            "50000000",
        ],
        None,
    )
    .await;
    let project = node.project();
    let post = |body: &str, out: &str| {
        format!(
            "curl -sS -m 60 -o {out} -w '%{{http_code}}\\n' \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -H \"authorization: Bearer $OPENAI_API_KEY\" {body} >> codes.txt; "
        )
    };
    let fat = [
        "printf '{\"model\":\"m\",\"messages\":7,\"pad\":\"' > big.json; ".to_owned(),
        "head -c 20000000 /dev/zero | tr '\\0' x >> big.json; printf '\"}' >> big.json; "
            .to_owned(),
        "for i in 1 2 3; do ".to_owned(),
        post("--data-binary @big.json", "/dev/null"),
        "done; ".to_owned(),
        post(
            r#"-d '{"model":"m","messages":[{"role":"user","content":"hi"}]}'"#,
            "refused.json",
        ),
    ]
    .concat();
    // `count_tokens` does a call's work for the node (tito renders and tokenizes it all): it is
    // charged like one. Four counts spend the call budget; three 20 MB counts the bytes.
    let count = |body: &str, out: &str| {
        format!(
            "curl -sS -m 60 -o {out} -w '%{{http_code}}\\n' \"$ANTHROPIC_BASE_URL/v1/messages/count_tokens\" -H 'content-type: application/json' -H \"x-api-key: $ANTHROPIC_API_KEY\" {body} >> codes.txt; "
        )
    };
    let counter = [
        "for i in 1 2 3 4; do ".to_owned(),
        count(
            r#"-d '{"model":"m","messages":[{"role":"user","content":"hi"}]}'"#,
            "/dev/null",
        ),
        "done; ".to_owned(),
        count(
            r#"-d '{"model":"m","messages":[{"role":"user","content":"hi"}]}'"#,
            "refused-count.json",
        ),
        post(
            r#"-d '{"model":"m","messages":[{"role":"user","content":"hi"}]}'"#,
            "refused.json",
        ),
    ]
    .concat();
    let fat_counter = [
        "printf '{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"' > big.json; "
            .to_owned(),
        "head -c 20000000 /dev/zero | tr '\\0' x >> big.json; printf '\"}]}' >> big.json; "
            .to_owned(),
        "for i in 1 2 3; do ".to_owned(),
        count("--data-binary @big.json", "count-$i.json"),
        "done; ".to_owned(),
        post(
            r#"-d '{"model":"m","messages":[{"role":"user","content":"hi"}]}'"#,
            "refused.json",
        ),
    ]
    .concat();
    let chatty = [
        "for i in 1 2 3 4 5 6; do ".to_owned(),
        post(
            r#"-d "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi $i\"}]}""#,
            "refused.json",
        ),
        "done".to_owned(),
    ]
    .concat();
    let fat_id = node
        .run(&task(
            &project,
            "fat",
            &fat,
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let chatty_id = node
        .run(&task(
            &project,
            "chatty",
            &chatty,
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let counter_id = node
        .run(&task(
            &project,
            "counter",
            &counter,
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let fat_counter_id = node
        .run(&task(
            &project,
            "fat-counter",
            &fat_counter,
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let done = node.finished(4).await;

    let codes = node.read(&counter_id, "work/codes.txt");
    assert_eq!(
        codes.lines().collect::<Vec<_>>(),
        ["200", "200", "200", "200", "400", "400"],
        "counts are charged to the call budget: {codes}\n{}",
        node.read(&counter_id, "agent.log")
    );
    let refused = node.read(&counter_id, "work/refused-count.json");
    assert!(
        refused.contains("4 token counts") && refused.contains("at most 4"),
        "{refused}"
    );
    assert!(
        refused.contains("\"type\":\"error\""),
        "refused in the Messages error shape: {refused}"
    );
    // The three 20 MB counts are admitted: each reaches the scripted engine's /tokenize, which
    // answers a body that size with a 413 (relayed as a 400) or by closing the connection
    // (a 502), whichever comes first; the call after them finds the bytes spent.
    let codes = node.read(&fat_counter_id, "work/codes.txt");
    let codes: Vec<&str> = codes.lines().collect();
    assert_eq!(codes.len(), 4, "{codes:?}");
    for i in 1..=3 {
        let answer = node.read(&fat_counter_id, &format!("work/count-{i}.json"));
        assert!(
            answer.contains("backend") && !answer.contains("50000000"),
            "count {i} was admitted and reached the engine: {codes:?} {answer}"
        );
    }
    assert_eq!(
        codes[3],
        "400",
        "count bytes are charged to the byte budget: {codes:?}\n{}",
        node.read(&fat_counter_id, "agent.log")
    );
    let refused = node.read(&fat_counter_id, "work/refused.json");
    assert!(refused.contains("50000000"), "{refused}");

    let codes = node.read(&fat_id, "work/codes.txt");
    assert_eq!(
        codes.lines().collect::<Vec<_>>(),
        ["400", "400", "400", "400"],
        "{codes}\n{}",
        node.read(&fat_id, "agent.log")
    );
    let refused = node.read(&fat_id, "work/refused.json");
    assert!(
        refused.contains("capture budget is spent") && refused.contains("50000000"),
        "{refused}"
    );
    let codes = node.read(&chatty_id, "work/codes.txt");
    assert_eq!(
        codes.lines().collect::<Vec<_>>(),
        ["200", "200", "200", "200", "400", "400"],
        "{codes}"
    );
    let refused = node.read(&chatty_id, "work/refused.json");
    assert!(refused.contains("at most 4"), "{refused}");
    assert_eq!(
        done[&chatty_id]["trajectory"]["calls"], 4,
        "{}",
        done[&chatty_id]
    );

    let spool = node.data().join("spool");
    let records = tokentap_e2e::tokentap::read_spool(&spool);
    assert_eq!(records.len(), 7, "3 failed + 4 answered, no refusal");
    let failed: Vec<_> = records
        .iter()
        .filter(|r| r.request.body_bytes > 1_000_000)
        .collect();
    assert_eq!(failed.len(), 3);
    for r in &failed {
        assert!(r.request.body.is_none(), "the 20 MB body is not kept whole");
        let excerpt = r.request.body_text.as_deref().unwrap_or_default();
        assert!(
            excerpt.starts_with("{\"model\":\"m\",\"messages\":7") && excerpt.len() <= 64 << 10,
            "{}",
            excerpt.len()
        );
    }
    let spool_bytes: u64 = std::fs::read_dir(&spool)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    let rss = node_api::peak_rss(node.child.id());
    eprintln!(
        "spool after 60 MB of failed bodies and 2 refused calls: {spool_bytes} bytes; node peak RSS {} MiB",
        rss >> 20
    );
    assert!(spool_bytes < 2 << 20, "{spool_bytes}");
    let metrics = node_api::get_text(&format!("{}/metrics", node.base), TOKEN).await;
    let refusals = metrics
        .lines()
        .find(|l| l.starts_with("tokentap_calls_refused_total{reason=\"session_budget\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert_eq!(refusals, Some(6.0), "{metrics}");
}

/// Set-up (task code, sandboxed) plants links where the node then writes the harness's
/// configuration as root: `$HOME/.pi` to a directory outside holding a root-owned 0600
/// `agent/models.json`. The node's write stays in the sample's HOME (the planted link is
/// replaced by a directory of its own), the file outside is untouched, and the real harness
/// runs on the node's config. The positive control: the same link followed by the plain
/// write the preset used reaches the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_set_up_links_never_carry_the_nodes_config_write_outside() {
    use std::os::unix::fs::PermissionsExt;
    if !sandbox_available() {
        return;
    }
    let pi_path = tokentap_e2e::artefacts::Artefacts::require_harness("pi")
        .0
        .harness_path();
    let mut node = Node::start(
        &["--sandbox", "--harness-path", &pi_path, "--block-egress"],
        None,
    )
    .await;
    let outside = node.dir.path().join("outside");
    let victim = outside.join("agent/models.json");
    std::fs::create_dir_all(victim.parent().unwrap()).unwrap();
    std::fs::write(&victim, "ROOT-OWNED").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut t = task(
        &node.project(),
        "plant",
        "true",
        json!({"kind": "session-completed"}),
    );
    t["harness"] = json!({"name": "pi"});
    t["workspace"]["dir"]["setup"] = json!(format!(
        "ln -s {} \"$HOME/.pi\" && ls -la \"$HOME\"",
        outside.display()
    ));
    let id = node.run(&t).await.remove(0);
    let done = node.finished(1).await;
    let s = &done[&id];
    assert!(
        node.read(&id, "setup.log").contains(".pi ->"),
        "the set-up planted its link: {}",
        node.read(&id, "setup.log")
    );
    assert_eq!(
        std::fs::read_to_string(&victim).unwrap(),
        "ROOT-OWNED",
        "the node wrote through the planted link: {s}"
    );
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    let pi_dir = node.sample_dir(&id).join("home/.pi");
    assert!(
        std::fs::symlink_metadata(&pi_dir).unwrap().is_dir(),
        "the link is replaced by the node's own directory"
    );
    let config = std::fs::read_to_string(pi_dir.join("agent/models.json")).unwrap();
    assert!(config.contains("baseUrl"), "{config}");
    assert_eq!(s["outcome"]["status"], "completed", "{s}");
    assert!(
        s["trajectory"]["calls"].as_u64().unwrap_or(0) >= 1,
        "the harness ran on the node's config and called the model: {s}"
    );
    assert!(node.healthy().await);

    // The positive control: the write the presets made before follows the same link.
    let home = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&outside, home.path().join(".pi")).unwrap();
    std::fs::write(home.path().join(".pi/agent/models.json"), "{}").unwrap();
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "{}");
}

/// The agent plants a test the evaluation runs (`test_hack.py`, discovered by `unittest`)
/// that writes 1 to every reward file it can name, leaves a process behind to write one
/// later, and hunts for the node's `reward-io`; the real test fails. Sandboxed on a real node:
/// without `reward_overrides_failure` the sample scores 0 and the reward command never runs;
/// with it, the reward command's own file decides (0.25), not the planted test. The positive
/// control: the planted test, handed a reward file as evaluators were before, writes 1 to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_planted_test_cannot_write_the_reward() {
    if !sandbox_available() {
        return;
    }
    let mut node = Node::start(&["--sandbox"], None).await;
    let hack = r#"import os, subprocess, unittest
class Hack(unittest.TestCase):
    def test_hack(self):
        for f in [os.environ.get("TOKENTAP_REWARD_FILE", ""), "../reward-io/reward",
                  "../eval-io/reward", os.path.expanduser("~/reward")]:
            try:
                os.makedirs(os.path.dirname(f) or ".", exist_ok=True)
                open(f, "w").write("1")
            except OSError:
                pass
        found = subprocess.run("timeout 10 find / -name reward -path '*reward-io*' 2>/dev/null", shell=True,
                               capture_output=True, text=True).stdout.split()
        for f in found:
            try:
                open(f, "w").write("1")
            except OSError:
                pass
        subprocess.Popen(["setsid", "sh", "-c", "sleep 2; echo 1 > ../reward-io/reward"])
"#;
    let agent = format!(
        "cat > test_hack.py <<'PY'\n{hack}PY\nprintf 'import unittest\\nclass Real(unittest.TestCase):\\n    def test_real(self):\\n        self.fail()\\n' > test_real.py"
    );
    let reward = r#"sleep 3; [ -e "$TOKENTAP_REWARD_FILE" ] && exit 4; [ "$TOKENTAP_EVAL_EXIT_CODE" = 0 ] && echo 1 > "$TOKENTAP_REWARD_FILE" || echo 0.25 > "$TOKENTAP_REWARD_FILE""#;
    let evaluator = |overrides: bool| {
        json!({"kind": "command", "command": "python3 -m unittest -v",
               "reward_command": reward, "reward_overrides_failure": overrides})
    };
    let project = node.project();
    let strict = node
        .run(&task(&project, "strict", &agent, evaluator(false)))
        .await
        .remove(0);
    let overriding = node
        .run(&task(&project, "overriding", &agent, evaluator(true)))
        .await
        .remove(0);
    let done = node.finished(2).await;
    for (id, want) in [(&strict, 0.0), (&overriding, 0.25)] {
        let s = &done[id];
        let log = node.read(id, "eval.log");
        assert!(
            log.contains("test_hack") && log.contains("FAILED"),
            "the planted test ran and the real one failed: {log}"
        );
        assert_eq!(
            s["outcome"],
            json!({"status": "completed", "reward": want}),
            "{s}\n{log}"
        );
    }
    assert!(
        !node.read(&strict, "eval.log").contains("sleep 3"),
        "the reward command does not run after a failure the task did not let it override"
    );
    assert!(node.healthy().await);

    // The positive control: handed a reward file, the planted test sets the reward.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("test_hack.py"), hack).unwrap();
    let reward_file = dir.path().join("handed-reward");
    let out = Command::new("python3")
        .args(["-m", "unittest", "-q", "test_hack"])
        .current_dir(dir.path())
        .env("TOKENTAP_REWARD_FILE", &reward_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read_to_string(&reward_file).unwrap(), "1");
}

/// An agent that posts in another sample's name (header, path, query) without a sandbox:
/// its base URL carries an unguessable secret; the header and query are ignored (its calls
/// stay in its session) and a path naming the other session is refused with a provider-shaped
/// 403. The other sample's trajectory holds its own call only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sample_posts_only_into_its_own_session() {
    let mut node = Node::start(&[], None).await;
    let project = node.project();
    let victim = node
        .run(&task(
            &project,
            "victim",
            &curl_agent(1, "sleep 2"),
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let body = r#"{"model":"m","messages":[{"role":"user","content":"task"}]}"#;
    let call = |extra: &str, url: &str| {
        format!("curl -sS -m 10 -o /dev/null -w '%{{http_code}}\\n' {url} -H 'content-type: application/json' {extra} -d '{body}' >> calls.txt; ")
    };
    let root = "${OPENAI_BASE_URL%/s/*}";
    let script = [
        call(&format!("-H 'x-tokentap-session: {victim}'"), "\"$OPENAI_BASE_URL/chat/completions\""),
        call("", &format!("\"$OPENAI_BASE_URL/chat/completions?session={victim}\"")),
        call("", &format!("\"{root}/s/{victim}/v1/chat/completions\"")),
        call(&format!("-H 'x-tokentap-session: {victim}'"), &format!("\"{root}/v1/chat/completions\"")),
        format!("curl -sS -m 10 \"{root}/s/{victim}/v1/chat/completions\" -H 'content-type: application/json' -d '{body}' > refusal.json; true"),
    ]
    .concat();
    let attacker = node
        .run(&task(
            &project,
            "attacker",
            &script,
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let done = node.finished(2).await;
    assert!(node.healthy().await);
    let codes = node.read(&attacker, "work/calls.txt");
    assert_eq!(
        codes.lines().collect::<Vec<_>>(),
        ["200", "200", "403", "403"],
        "{codes}"
    );
    let refusal: Value = serde_json::from_str(&node.read(&attacker, "work/refusal.json")).unwrap();
    assert!(
        refusal["error"]["message"]
            .as_str()
            .unwrap()
            .contains("capture session"),
        "{refusal}"
    );
    assert_eq!(done[&victim]["trajectory"]["calls"], 1, "{}", done[&victim]);
    assert_eq!(
        done[&attacker]["trajectory"]["calls"], 2,
        "{}",
        done[&attacker]
    );
}

/// A sandbox that cannot start (here a bubblewrap that fails at once, as a missing mount
/// source makes it) fails its sample with the reason; it does not end `completed` with a
/// reward, and the node goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_that_cannot_start_fails_the_sample() {
    let bin = tempfile::tempdir().unwrap();
    let bwrap = bin.path().join("bwrap");
    std::fs::write(
        &bwrap,
        "#!/bin/sh\necho \"bwrap: Can't find source path node/samples: No such file or directory\" >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bwrap, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        bin.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut node = Node::start(&["--sandbox"], Some(&path)).await;
    let id = node
        .run(&task(
            &node.project(),
            "boxed",
            "true",
            json!({"kind": "session-completed"}),
        ))
        .await
        .remove(0);
    let done = node.finished(1).await;
    let s = &done[&id];
    assert_eq!(s["outcome"]["status"], "error", "{s}");
    let reason = s["outcome"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("sandbox did not start") && reason.contains("find source path"),
        "{reason}"
    );
    assert!(node.healthy().await);
}

/// Tasks over the node's ceilings are refused with a 400 in the API's error shape: too many
/// samples, a budget past `--max-budget-s`, limits past the node's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_over_the_nodes_ceilings_is_refused() {
    let node = Node::start(
        &[
            "--max-samples-per-task",
            "16",
            "--max-budget-s",
            "600",
            "--sample-memory-mb",
            "512",
            "--sample-pids",
            "256",
        ],
        None,
    )
    .await;
    let base = task(
        &node.project(),
        "t",
        "true",
        json!({"kind": "session-completed"}),
    );
    let with = |k: &str, v: Value| {
        let mut t = base.clone();
        t[k] = v;
        t
    };
    let cases = [
        (with("num_samples", json!(17)), "num_samples"),
        (with("num_samples", json!(4_000_000_000u64)), "num_samples"),
        (with("budgets", json!({"session_s": 601})), "session_s"),
        (with("limits", json!({"memory_mb": 513})), "memory_mb"),
        (with("limits", json!({"pids": 100000})), "pids"),
    ];
    for (t, says) in cases {
        let r = node.submit(&t).await;
        assert_eq!(r.status(), 400, "{t}");
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], "invalid_task", "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(says),
            "{body}"
        );
    }
    let ok = with("limits", json!({"memory_mb": 256}));
    assert_eq!(node.submit(&ok).await.status(), 202);
}

/// Runs `cmd` with a pseudo-terminal of the test's as its controlling terminal and stdin, as
/// a node started by hand in a terminal would run its children; its stdout.
fn under_a_terminal(mut cmd: Command) -> String {
    use std::os::unix::process::CommandExt;
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty with valid out-pointers and no name, termios or window size.
    let opened = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(opened, 0, "openpty");
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0
                || libc::ioctl(slave, libc::TIOCSCTTY, 0) < 0
                || libc::dup2(slave, 0) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    // SAFETY: closing the two descriptors openpty gave us.
    unsafe {
        libc::close(master);
        libc::close(slave);
    }
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The node's sandbox as `tokentap serve` configures it on this machine, task code running
/// as `uid`, with an (empty) data directory of its own, removed with the returned guard.
fn a_sandbox_running_as(uid: u32) -> (tempfile::TempDir, tokentap_rollout::sandbox::SandboxConfig) {
    use tokentap_rollout::sandbox::SandboxConfig;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let path = std::env::var("PATH").unwrap_or_default();
    let cfg = SandboxConfig {
        bwrap: tokentap_rollout::runner::on_path("bwrap", &path).unwrap(),
        shim: tokentap_bin(),
        always: true,
        data_dir: data,
        // SAFETY: geteuid has no preconditions.
        run_as: SandboxConfig::run_as_for(unsafe { libc::geteuid() }, uid),
    };
    (dir, cfg)
}

/// `cmd` (a [`wrap`]ped command) with a descriptor where the shim reports readiness, as the
/// node gives it (`/dev/null` here: the tests read the command's output instead).
///
/// [`wrap`]: tokentap_rollout::sandbox::wrap
fn handed_a_ready_fd(mut cmd: Command) -> Command {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let null = std::fs::File::create("/dev/null").unwrap();
    // SAFETY: dup2 only, async-signal-safe, between fork and exec; `null` lives in the closure.
    unsafe {
        cmd.pre_exec(move || {
            let (fd, ready) = (null.as_raw_fd(), tokentap_rollout::sandbox::READY_FD);
            // dup2 onto itself would keep close-on-exec.
            let r = match fd == ready {
                true => libc::fcntl(fd, libc::F_SETFD, 0),
                false => libc::dup2(fd, ready),
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Task code cannot reach the terminal of a node run by hand (`generate`, a node started in a
/// shell): every sandboxed command runs in a session of its own, with no controlling
/// terminal, so it cannot open `/dev/tty` to push keystrokes into the operator's shell
/// (TIOCSTI). The same probe outside the sandbox, under the same terminal, opens it: the
/// positive control.
#[test]
fn sandboxed_code_has_no_controlling_terminal() {
    use tokentap_rollout::sandbox::{wrap, Mounts};
    if !sandbox_available() {
        return;
    }
    let probe = "if (exec 3</dev/tty) 2>/dev/null; then echo tty-open; else echo no-tty; fi";
    let probe_command = || {
        let mut c = Command::new("sh");
        c.args(["-c", probe])
            .env_clear()
            .env("PATH", "/usr/bin:/bin");
        c
    };
    assert_eq!(
        under_a_terminal(probe_command()),
        "tty-open",
        "positive control: the terminal is reachable outside the sandbox"
    );
    let (_dir, cfg) = a_sandbox_running_as(65534);
    let sandboxed = handed_a_ready_fd(wrap(&probe_command(), &cfg, &Mounts::default()));
    assert_eq!(under_a_terminal(sandboxed), "no-tty");
}

/// What the sandbox's seccomp filters refuse, tried by task code: a user namespace, a kernel
/// keyring, a perf counter on itself, and TIOCSTI into a terminal it made its own (allowed to
/// any process on its own controlling terminal, so no terminal of the test's is needed). Run
/// once as the sandbox's uid outside the sandbox, each works (the positive control: without
/// the filters nothing else here stops them); inside, each is refused with EPERM, and the
/// probe itself (python, threads and all) still runs.
#[test]
fn sandboxed_code_is_refused_the_filtered_system_calls() {
    use std::os::unix::process::CommandExt;
    use tokentap_rollout::sandbox::{wrap, Mounts};
    if !sandbox_available() {
        return;
    }
    const PROBE: &str = r#"
import ctypes, fcntl, os, termios, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def report(name, r):
    print(name, "ok" if r >= 0 else "errno %d" % ctypes.get_errno())
def unshare_user():
    return libc.syscall(272, 0x10000000)
def keyctl():
    return libc.syscall(250, 1, 0)
def perf():
    attr = (ctypes.c_uint64 * 16)()
    attr[0] = 1 | (128 << 32)
    attr[5] = 1 | (1 << 5) | (1 << 6)
    return libc.syscall(298, attr, 0, -1, -1, 0)
def tiocsti():
    master, slave = os.openpty()
    os.setsid()
    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
    try:
        fcntl.ioctl(slave, termios.TIOCSTI, b"x")
        return 0
    except OSError as e:
        ctypes.set_errno(e.errno)
        return -1
for name, probe in [("unshare-user", unshare_user), ("keyctl", keyctl), ("perf", perf)]:
    report(name, probe())
t = threading.Thread(target=lambda: report("tiocsti", tiocsti()))
t.start(); t.join()
"#;
    assert_eq!(
        std::env::consts::ARCH,
        "x86_64",
        "the probe's system call numbers are x86_64's"
    );
    let nobody = 65534;
    let probe_command = || {
        let mut c = Command::new("python3");
        c.args(["-c", PROBE])
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .current_dir("/");
        c
    };
    let run = |mut c: Command| {
        let out = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{out:?}");
        stdout
    };
    let mut outside = probe_command();
    outside.uid(nobody).gid(nobody);
    let outside = run(outside);
    assert_eq!(
        outside.lines().collect::<Vec<_>>(),
        ["unshare-user ok", "keyctl ok", "perf ok", "tiocsti ok"],
        "positive control: each call works for the sandbox's uid outside the sandbox"
    );
    let (_dir, cfg) = a_sandbox_running_as(nobody);
    let inside = run(handed_a_ready_fd(wrap(
        &probe_command(),
        &cfg,
        &Mounts::default(),
    )));
    let eperm = libc::EPERM;
    assert_eq!(
        inside.lines().collect::<Vec<_>>(),
        [
            format!("unshare-user errno {eperm}"),
            format!("keyctl errno {eperm}"),
            format!("perf errno {eperm}"),
            format!("tiocsti errno {eperm}"),
        ],
    );
}

/// A sample that writes without end on a node with `--sample-disk-mb`: its writes stop at
/// its own disk (ENOSPC), its log is cut there too, a sample beside it completes, and at
/// the end the disk is unmounted and gone, the node's files (log tail, traces) kept. The
/// positive control: the same write on the data directory's file system succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_sample_writing_without_end_fills_only_its_own_disk() {
    if !sandbox_available() {
        return;
    }
    let mut node = Node::start(&["--sandbox", "--sample-disk-mb", "64"], None).await;
    let fill = |at: &str| format!("dd if=/dev/zero of={at} bs=1M count=200 2>&1; echo dd-exit=$?");
    // Positive control, beside the node's data directory.
    let control = Command::new("sh")
        .args([
            "-c",
            &fill(&node.dir.path().join("control-fill").display().to_string()),
        ])
        .output()
        .unwrap();
    let control = String::from_utf8_lossy(&control.stdout).into_owned();
    assert!(control.contains("dd-exit=0"), "{control}");
    std::fs::remove_file(node.dir.path().join("control-fill")).unwrap();

    let project = node.project();
    let agent = format!(
        "{}; rm -f \"$HOME/fill\"; {}; yes spam | head -c 200000000; echo after-spam",
        fill("\"$HOME/fill\""),
        fill("work-fill")
    );
    let filler = node
        .run(&task(
            &project,
            "filler",
            &agent,
            json!({"kind": "command", "command": "true"}),
        ))
        .await
        .remove(0);
    let bystander = node
        .run(&task(
            &project,
            "bystander",
            "echo ok > ok.txt",
            json!({"kind": "command", "command": "test -f ok.txt"}),
        ))
        .await
        .remove(0);
    let done = node.finished(2).await;
    assert_eq!(
        done[&bystander]["outcome"],
        json!({"status": "completed", "reward": 1.0}),
        "{}",
        done[&bystander]
    );
    let log = node.read(&filler, "agent.log");
    assert!(log.contains("No space left on device"), "{log:.2000}");
    assert!(
        !log.contains("dd-exit=0"),
        "a 200 MB write fit a 64 MiB disk: {log:.2000}"
    );
    let log_len = std::fs::metadata(node.sample_dir(&filler).join("agent.log"))
        .unwrap()
        .len();
    assert!(
        log_len <= (4 << 20) + 200,
        "the kept log is its tail: {log_len}"
    );
    // Unmounted, the image removed, only the node's kept files left.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let data = std::fs::canonicalize(node.data()).unwrap();
    assert!(
        !mounts.contains(&data.display().to_string()),
        "a sample disk is still mounted: {mounts}"
    );
    let images: Vec<_> = std::fs::read_dir(node.data().join("disks"))
        .unwrap()
        .collect();
    assert!(images.is_empty(), "{images:?}");
    let mut kept: Vec<String> = std::fs::read_dir(node.sample_dir(&filler))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    kept.sort();
    assert!(
        kept.iter()
            .all(|f| ["agent.log", "eval.log", "setup.log", "traces.jsonl"].contains(&f.as_str())),
        "{kept:?}"
    );
    assert!(node.healthy().await);
}
