//! Rewards the agent's tree cannot shadow (issue 49, item 4). The evaluation runs in a copy of
//! the tree the agent wrote; with the docs' own evaluator (`python3 -m unittest`, the test
//! file restored) and a broken `calc.py`, an agent that planted `unittest/__main__.py`
//! (`sys.exit(0)`) scored 1.0, and `-m pytest` alike (a planted `pytest.py`, a `conftest.py`
//! that exits 0). Each attack is run through a real `tokentap serve` node and scores 0 now,
//! with a correct solution scoring 1.0 as the control; each test also runs the evaluator the
//! way nodes did before (`sh -c COMMAND` in the agent's final tree) on the same tree, the
//! positive control, and sees it exit 0: what the sample would have scored.
//!
//! What the old node did (0ad9e2d's evaluate.rs ran `sh -c COMMAND` in the evaluation copy)
//! is what `as_before` runs: every plant here exits 0 that way (reward 1.0), seen in each
//! test's positive control; issue 49 saw the unittest plant score 1.0 on a real old node.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::{
    free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope,
};

const TOKEN: &str = "shadow-node-token-7a3c";

const BROKEN: &str = "def add(a, b):\n    return a - b\n";
const FIXED: &str = "def add(a, b):\n    return a + b\n";
const TEST: &str = "import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n";

/// A node (no engine calls are made: the agents are shell scripts) in a directory of its own,
/// with the broken project in `project/`.
struct Node {
    dir: tempfile::TempDir,
    base: String,
    _child: ChildGuard,
    /// The node's PATH (its harness path).
    path: String,
}

impl Node {
    async fn start() -> Node {
        Node::start_on(std::env::var("PATH").unwrap_or_default()).await
    }

    async fn start_on(path: String) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let project = dir.path().join("project");
        std::fs::create_dir_all(&project).unwrap();
        std::fs::write(project.join("calc.py"), BROKEN).unwrap();
        std::fs::write(project.join("test_calc.py"), TEST).unwrap();
        let port = free_port();
        let mut cmd = Command::new(tokentap_bin());
        cmd.current_dir(dir.path())
            .arg("serve")
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .args(["--data", "./node", "--spool", "./node/spool"])
            .args(["--backend", "http://127.0.0.1:9", "--backend-kind", "vllm"])
            .env("TOKENTAP_NODE_TOKEN", TOKEN)
            .env("PATH", &path)
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
            path,
        }
    }

    fn project(&self) -> std::path::PathBuf {
        self.dir.path().join("project")
    }

    fn sample_dir(&self, id: &str) -> std::path::PathBuf {
        self.dir.path().join("node/samples").join(id)
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

    async fn run(&self, task: &Value) -> String {
        let r = self.submit(task).await;
        assert_eq!(r.status(), 202, "{task}");
        let body: Value = r.json().await.unwrap();
        body["samples"][0].as_str().unwrap().to_owned()
    }

    async fn finished(&self, n: usize) -> std::collections::HashMap<String, Value> {
        node_api::results_within(&self.base, TOKEN, 0, n, 10, Duration::from_secs(180))
            .await
            .into_iter()
            .map(|s| (s["sample_id"].as_str().unwrap().to_owned(), s))
            .collect()
    }

    fn read(&self, id: &str, rel: &str) -> String {
        std::fs::read_to_string(self.sample_dir(id).join(rel)).unwrap_or_default()
    }
}

/// A task whose agent is `script` (run in its working copy).
fn task(project: &Path, id: &str, script: &str, evaluator: Value) -> Value {
    json!({
        "task_id": id,
        "instruction": "make the failing test pass",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": evaluator,
        "budgets": {"session_s": 120, "agent_s": 60, "eval_s": 60}
    })
}

/// Writes each `(path, text)` with a here-document (the agent's whole script).
fn planting(files: &[(&str, &str)]) -> String {
    files
        .iter()
        .map(|(path, text)| {
            let dir = Path::new(path).parent().unwrap().display().to_string();
            let mkdir = if dir.is_empty() {
                String::new()
            } else {
                format!("mkdir -p {dir} && ")
            };
            format!("{mkdir}cat > {path} <<'EOF'\n{text}EOF\n")
        })
        .collect()
}

/// The positive control: the evaluator run the way nodes ran it before (`sh -c COMMAND`, the
/// agent's final tree as the working directory, the test file as the task had it), on a copy
/// of that tree. Its exit code is what the sample scored then (0: reward 1.0).
fn as_before(node: &Node, sample: &str, command: &str) -> std::process::Output {
    let copy = tempfile::tempdir().unwrap();
    let ok = Command::new("cp")
        .arg("-a")
        .arg(format!(
            "{}/.",
            node.sample_dir(sample).join("work").display()
        ))
        .arg(copy.path())
        .status()
        .unwrap()
        .success();
    assert!(ok);
    std::fs::write(copy.path().join("test_calc.py"), TEST).unwrap();
    Command::new("sh")
        .args(["-c", command])
        .current_dir(copy.path())
        .env_clear()
        .env("PATH", &node.path)
        .env("HOME", copy.path())
        .output()
        .unwrap()
}

fn reward(s: &Value) -> Value {
    s["outcome"]["reward"].clone()
}

/// `python3 -m unittest`: a planted `unittest/__main__.py` that prints `OK (planted)` and
/// exits 0 scores 0 (the tree is last on `sys.path`, the stdlib's unittest runs and the real
/// test fails); the fixed `calc.py` scores 1.0. Before: the plant scored 1.0 (the control).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_planted_unittest_module_does_not_change_the_reward() {
    let node = Node::start().await;
    let command = "python3 -m unittest";
    let evaluator = json!({"kind": "command", "command": command, "test_files": ["test_calc.py"]});
    let project = node.project();
    let plant = "import sys\nprint(\"OK (planted)\")\nsys.exit(0)\n";
    let planted = node
        .run(&task(
            &project,
            "planted-unittest",
            &planting(&[
                ("unittest/__main__.py", plant),
                ("unittest/__init__.py", ""),
            ]),
            evaluator.clone(),
        ))
        .await;
    let fixed = node
        .run(&task(
            &project,
            "fixed",
            &planting(&[("calc.py", FIXED)]),
            evaluator.clone(),
        ))
        .await;
    let done = node.finished(2).await;
    let log = node.read(&planted, "eval.log");
    assert_eq!(
        reward(&done[&planted]),
        json!(0.0),
        "{}\n{log}",
        done[&planted]
    );
    assert!(
        !log.contains("OK (planted)") && log.contains("FAILED"),
        "the stdlib's unittest ran the real test: {log}"
    );
    assert!(
        log.contains("# run by the node as: ") && log.contains(" -I -c BOOTSTRAP m unittest"),
        "the log shows what the node ran: {log}"
    );
    assert!(
        done[&planted]["evaluation"].get("shadowable").is_none(),
        "{}",
        done[&planted]
    );
    assert_eq!(
        reward(&done[&fixed]),
        json!(1.0),
        "the control: {}\n{}",
        done[&fixed],
        node.read(&fixed, "eval.log")
    );

    let before = as_before(&node, &planted, command);
    assert!(
        before.status.success() && String::from_utf8_lossy(&before.stdout).contains("OK (planted)"),
        "the positive control: run as before, the plant passes: {before:?}"
    );
}

/// `python3 -m pytest` and `pytest`: a planted `pytest.py` (exits 0) and a planted
/// `conftest.py` (`os._exit(0)` when pytest loads it) score 0; a `pytest.ini` with
/// `addopts` is not read; the fixed `calc.py` scores 1.0 under both forms, and a
/// `conftest.py` the task restores still runs (it leaves a mark). Before: each plant scored
/// 1.0 (the controls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_planted_pytest_module_or_conftest_does_not_change_the_reward() {
    // scripts/setup installs pytest in its virtualenv: the node's harness path starts there
    // (the sandbox mounts a virtualenv's root for its bin).
    let cache = std::env::var("TOKENTAP_CACHE")
        .unwrap_or_else(|_| format!("{}/.cache/tokentap", std::env::var("HOME").unwrap()));
    let venv_bin = format!("{cache}/venv/bin");
    let path = format!("{venv_bin}:{}", std::env::var("PATH").unwrap_or_default());
    let has_pytest = Command::new(format!("{venv_bin}/python3"))
        .args(["-c", "import pytest"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_pytest,
        "{venv_bin}/python3 needs pytest (scripts/setup installs it there)"
    );
    let node = Node::start_on(path).await;
    let project = node.project();
    // The task's own conftest (restored from test_files) leaves a mark when loaded.
    std::fs::write(
        project.join("conftest.py"),
        "open('task-conftest-loaded', 'w').close()\n",
    )
    .unwrap();
    let evaluator = |command: &str, files: &[&str]| json!({"kind": "command", "command": command, "test_files": files});
    let exits = "import os\nos._exit(0)\n";
    let cases = [
        (
            "planted-pytest",
            "python3 -m pytest -q",
            planting(&[(
                "pytest.py",
                "import sys\nprint('planted pytest')\nsys.exit(0)\n",
            )]),
            vec!["test_calc.py"],
            0.0,
        ),
        (
            "planted-conftest",
            "python3 -m pytest -q",
            planting(&[("conftest.py", exits)]),
            vec!["test_calc.py"],
            0.0,
        ),
        (
            "planted-sub-conftest",
            "pytest -q",
            planting(&[
                ("sub/conftest.py", exits),
                ("sub/test_sub.py", "def test_x():\n    pass\n"),
            ]),
            vec!["test_calc.py", "conftest.py"],
            0.0,
        ),
        (
            "planted-ini",
            "pytest -q",
            planting(&[("pytest.ini", "[pytest]\naddopts = --co\n")]),
            vec!["test_calc.py"],
            0.0,
        ),
        (
            "fixed-m",
            "python3 -m pytest -q",
            planting(&[("calc.py", FIXED)]),
            vec!["test_calc.py", "conftest.py"],
            1.0,
        ),
        (
            "fixed-script",
            "pytest -q",
            planting(&[("calc.py", FIXED)]),
            vec!["test_calc.py"],
            1.0,
        ),
    ];
    let mut ids = Vec::new();
    for (name, command, script, files, want) in &cases {
        let id = node
            .run(&task(&project, name, script, evaluator(command, files)))
            .await;
        ids.push((id, *name, *command, *want));
    }
    let done = node.finished(ids.len()).await;
    for (id, name, _, want) in &ids {
        let log = node.read(id, "eval.log");
        assert_eq!(
            reward(&done[id]),
            json!(want),
            "{name}: {}\n{log}",
            done[id]
        );
        assert!(!log.contains("planted pytest"), "{name}: {log}");
    }
    let log = |name: &str| {
        let (id, ..) = ids.iter().find(|(_, n, ..)| *n == name).unwrap();
        node.read(id, "eval.log")
    };
    let (fixed_m, ..) = ids.iter().find(|(_, n, ..)| *n == "fixed-m").unwrap();
    assert!(
        node.sample_dir(fixed_m)
            .join("eval/task-conftest-loaded")
            .exists(),
        "a restored conftest.py still runs: {}",
        log("fixed-m")
    );
    assert!(
        log("planted-sub-conftest").contains("FAILED") && log("planted-ini").contains("FAILED"),
        "the real test ran and failed: {}\n{}",
        log("planted-sub-conftest"),
        log("planted-ini")
    );
    // The positive controls: as evaluators ran before, each plant passes.
    for (id, name, command, want) in &ids {
        if *want == 0.0 {
            let before = as_before(&node, id, command);
            assert!(
                before.status.success(),
                "{name}: run as before, the plant passes: {before:?}"
            );
        }
    }
}

/// A command that runs a file of the agent's tree as its test runner is refused at
/// submission with a 400 naming the file; restored by `test_files`, the same command is
/// accepted; shell syntax the node does not analyse is accepted and flagged on the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_an_evaluator_the_agents_tree_can_shadow_is_refused_or_flagged() {
    let node = Node::start().await;
    let project = node.project();
    std::fs::write(project.join("run_tests.sh"), "python3 -m unittest\n").unwrap();
    for (command, files, names) in [
        ("sh run_tests.sh", vec![], "`run_tests.sh`"),
        ("./run_tests.sh", vec!["test_calc.py"], "`./run_tests.sh`"),
        ("python3 run_tests.py", vec![], "`run_tests.py`"),
        ("make test", vec!["test_calc.py"], "`Makefile`"),
    ] {
        let r = node
            .submit(&task(
                &project,
                "refused",
                "true",
                json!({"kind": "command", "command": command, "test_files": files}),
            ))
            .await;
        assert_eq!(r.status(), 400, "{command}");
        let body: Value = r.json().await.unwrap();
        let msg = body["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(body["error"]["type"], "invalid_task", "{body}");
        assert!(
            msg.contains(names) && msg.contains("test_files") && msg.contains("agent's tree"),
            "{command}: {msg}"
        );
    }
    let swebench = node
        .submit(&task(
            &project,
            "refused",
            "true",
            json!({"kind": "swebench", "test_command": "sh run_tests.sh {test}",
                   "fail_to_pass": ["t"], "pass_to_pass": []}),
        ))
        .await;
    assert_eq!(swebench.status(), 400);

    let restored = node
        .run(&task(
            &project,
            "restored",
            &format!("{}rm run_tests.sh", planting(&[("calc.py", FIXED)])),
            json!({"kind": "command", "command": "sh run_tests.sh",
                   "test_files": ["test_calc.py", "run_tests.sh"]}),
        ))
        .await;
    let flagged = node
        .run(&task(
            &project,
            "flagged",
            &planting(&[("calc.py", FIXED)]),
            json!({"kind": "command", "command": "python3 -m unittest 2>&1",
                   "test_files": ["test_calc.py"]}),
        ))
        .await;
    let done = node.finished(2).await;
    assert_eq!(
        reward(&done[&restored]),
        json!(1.0),
        "{}\n{}",
        done[&restored],
        node.read(&restored, "eval.log")
    );
    assert!(done[&restored]["evaluation"].get("shadowable").is_none());
    let f = &done[&flagged];
    assert_eq!(reward(f), json!(1.0), "{f}");
    let why = f["evaluation"]["shadowable"].as_str().unwrap_or_default();
    assert!(why.contains("as written") && why.contains("`>`"), "{f}");
}
