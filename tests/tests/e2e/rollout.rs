//! `tokentap serve` as a process: a task submitted over HTTP runs under capture and comes back
//! with a rewarded trajectory; a node killed (SIGKILL) while a sample runs re-runs it after a
//! restart, so no accepted task is lost.

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::{free_port, http_client, spawn_guarded, ChildGuard, KillScope};
use tokentap_e2e::repo_tasks::{repo_task, task_policy};
use tokentap_e2e::scripted::{counting_replies, curl_agent, Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::read_spool;

const TOKEN: &str = "e2e-node-token";

async fn node(dir: &std::path::Path, port: u16, engine: &str) -> ChildGuard {
    node_with(dir, port, engine, &[]).await
}

async fn node_with(dir: &std::path::Path, port: u16, engine: &str, extra: &[&str]) -> ChildGuard {
    node_api::start_serve(dir, port, engine, TOKEN, extra).await
}

/// What a finished sample's agent wrote (for failure messages).
fn agent_log(node_dir: &std::path::Path, sample: &Value) -> String {
    let id = sample["sample_id"].as_str().unwrap_or_default();
    std::fs::read_to_string(node_dir.join("node/samples").join(id).join("agent.log"))
        .unwrap_or_default()
}

/// The sample completed with `reward` (else: the sample and its agent's log).
fn assert_completed(node_dir: &std::path::Path, sample: &Value, reward: f64) {
    assert_eq!(
        sample["outcome"],
        json!({"status": "completed", "reward": reward}),
        "{sample}\nagent log: {}",
        agent_log(node_dir, sample)
    );
}

/// A node running real harnesses (`harnesses`, on its harness path) against the scripted
/// policy, with llama-server's tokenizer for token ids.
async fn harness_node(
    harnesses: &[&str],
    extra: &[&str],
) -> (ScriptedBackend, tempfile::TempDir, String, ChildGuard) {
    let llama = LlamaServer::shared_with_tool_template().await;
    let engine = ScriptedBackend::start(Tokens::Llama(llama.tokenizer()), task_policy()).await;
    let mut path = None;
    for h in harnesses {
        path.get_or_insert(Artefacts::require_harness(h).0.harness_path());
    }
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut args = vec!["--harness-path", path.as_deref().unwrap(), "--block-egress"];
    args.extend(extra);
    let serve = node_with(dir.path(), port, &engine.url, &args).await;
    (engine, dir, format!("http://127.0.0.1:{port}"), serve)
}

/// GET with the node's token, as JSON.
async fn get_json(url: &str) -> Value {
    node_api::get_json(url, TOKEN).await
}

async fn post(url: &str, body: &Value) -> Value {
    let (status, answer) = node_api::post_json(url, TOKEN, body).await;
    assert_eq!(status, 202, "{answer}");
    answer
}

async fn results(base: &str, after: u64, want: usize) -> Vec<Value> {
    results_within(base, after, want, Duration::from_secs(60)).await
}

async fn results_within(base: &str, after: u64, want: usize, limit: Duration) -> Vec<Value> {
    node_api::results_within(base, TOKEN, after, want, 10, limit).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_runs_tasks_under_capture_and_survives_a_kill() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut serve = node(dir.path(), port, &engine.url).await;
    let task = |script: String| {
        json!({
            "task_id": "chat",
            "instruction": "chat",
            "workspace": {"dir": {"path": dir.path().join("project")}},
            "harness": {"name": "command", "argv": ["sh", "-c", script]},
            "evaluator": {"kind": "session-completed"},
            "num_samples": 2
        })
    };
    // Each agent also plants a traces file where a directory walk of the node would find it.
    let planted = dir.path().join("planted.jsonl");
    let fake = json!({
        "schema_version": 1, "trace_id": "planted-by-the-agent/0",
        "session_id": "planted-by-the-agent", "strategy": "prefix-merge", "index": 0,
        "started_by": "session_start", "prompt_ids": [1], "response_ids": [2],
        "loss_mask": [1], "logprobs": [-0.5], "calls": [], "spans_policy_versions": false,
        "messages_json": "[]", "tools_json": "[]"
    });
    serde_json::from_value::<tokentap_schema::Trace>(fake.clone()).expect("a valid trace row");
    std::fs::write(&planted, format!("{fake}\n")).unwrap();
    let plant = format!(
        "cp {p} traces.jsonl && mkdir -p deep && cp {p} deep/traces.jsonl && cp {p} ../traces.jsonl; true",
        p = planted.display()
    );
    post(&format!("{base}/v1/rollouts"), &task(curl_agent(2, &plant))).await;
    let done = results(&base, 0, 2).await;
    for s in &done {
        assert_completed(dir.path(), s, 1.0);
        let t = &s["trajectory"];
        assert_eq!(
            (t["calls"].as_u64(), t["traces"].as_u64()),
            (Some(2), Some(1)),
            "{s}"
        );
        assert_eq!(t["faithfulness_violations"], 0);
        assert_eq!(t["complete"], true);
    }
    assert_eq!(
        read_spool(&dir.path().join("node/spool")).len(),
        4,
        "the node spools under --data by default"
    );
    assert!(!dir.path().join("tokentap-spool").exists());

    // The node's viewer (/view/, behind the node's token) shows each sample's session: its two
    // calls and its trace; never what an agent left in its directory.
    let view = |path: &str| format!("{base}/view/api/{path}");
    let unauthorized = http_client().get(view("sessions")).send().await.unwrap();
    assert_eq!(unauthorized.status(), 401);
    let listed = node_api::get_json(&view("sessions"), TOKEN).await;
    for s in &done {
        let session = s["trajectory"]["session_id"].as_str().unwrap();
        let row = listed["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["session_id"] == session)
            .unwrap_or_else(|| panic!("{session} not in {listed}"));
        assert_eq!(
            (row["calls"].as_u64(), row["traces"].as_u64()),
            (Some(2), Some(1)),
            "{row}"
        );
        let one = node_api::get_json(&view(&format!("session?id={session}")), TOKEN).await;
        assert_eq!(
            one["traces"][0]["trainable_tokens"].as_u64().map(|n| n > 0),
            Some(true),
            "{one}"
        );
    }
    // The plant took: a walk of the node's directory finds it within the viewer's depth.
    fn planted_files(dir: &std::path::Path, depth: usize) -> usize {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return 0;
        };
        entries
            .flatten()
            .map(|e| match e.file_type() {
                Ok(t) if t.is_dir() && depth < 4 => planted_files(&e.path(), depth + 1),
                Ok(t) if t.is_file() && e.file_name() == "traces.jsonl" => {
                    let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                    usize::from(text.contains("planted-by-the-agent"))
                }
                _ => 0,
            })
            .sum()
    }
    assert!(
        planted_files(&dir.path().join("node"), 0) > 0,
        "the agents planted nothing"
    );
    assert!(
        !listed.to_string().contains("planted-by-the-agent"),
        "an agent's file was taken for the node's traces: {listed}"
    );

    // A slow sample, and the node dies under it.
    let slow = post(
        &format!("{base}/v1/rollouts"),
        &task(curl_agent(1, "sleep 2")),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    serve.kill();
    let _serve = node(dir.path(), port, &engine.url).await;
    let after_restart = results(&base, 2, 2).await;
    let slow_ids: Vec<&str> = slow["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for s in &after_restart {
        assert!(slow_ids.contains(&s["sample_id"].as_str().unwrap()));
        assert_completed(dir.path(), s, 1.0);
        assert_eq!(s["attempt"], 2, "re-run after the restart: {s}");
        assert_eq!(s["trajectory"]["calls"], 1, "{s}");
        // The re-run is captured under a session of its own: an offline reconstruction of the
        // node's spool never mixes it with what the interrupted attempt had sent.
        let id = s["sample_id"].as_str().unwrap();
        let rerun = format!("{id}-a2");
        assert_eq!(s["trajectory"]["session_id"], rerun.as_str(), "{s}");
        let spool = read_spool(&dir.path().join("node/spool"));
        let calls = |session: &str| spool.iter().filter(|r| r.session_id == session).count();
        assert_eq!(calls(&rerun), 1, "the re-run's one call");
        assert!(
            calls(id) <= 1,
            "the first attempt's call, if it got that far"
        );
    }
}

/// The scripted policy for the repository's tasks: it calls the harness's shell tool (Pi's,
/// Qwen Code's, Codex's or Claude Code's) once with
/// the right fix for `calc`, a wrong one for `greet`, and a command that never ends for `hang`,
/// then answers; calls without a shell tool (a harness's side requests) get a short answer.
/// The largest number of samples whose RUN stages overlapped.
fn max_concurrent_runs(samples: &[Value]) -> usize {
    let mut edges: Vec<(u64, i32)> = Vec::new();
    for s in samples {
        let t = &s["stage_started_ms"];
        edges.push((t[1].as_u64().unwrap(), 1));
        edges.push((t[2].as_u64().unwrap(), -1));
    }
    edges.sort();
    let (mut now, mut max) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        max = max.max(now);
    }
    max as usize
}

fn read_traces(sample: &Value) -> Vec<Value> {
    let path = sample["trajectory"]["path"].as_str().expect("a trajectory");
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// GRPO groups through the real Pi and Qwen Code binaries: 4 samples each of a task the policy
/// fixes (reward 1) and one it gets wrong (reward 0), run concurrently by a `tokentap serve`
/// node; every sample's tool loop comes back as a faithful merged trace carrying the reward
/// and its group. A Pi whose tool never returns is killed at its budget and its partial
/// trajectory is kept, masked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_rollout_groups_through_pi_and_qwen_code() {
    let (_engine, dir, base, _serve) = harness_node(&["pi", "qwen"], &["--run-workers", "4"]).await;
    let mut expected = std::collections::HashMap::new();
    for (task, harness, reward) in [
        ("calc", "pi", 1.0),
        ("greet", "pi", 0.0),
        ("calc", "qwen-code", 1.0),
        ("greet", "qwen-code", 0.0),
    ] {
        post(
            &format!("{base}/v1/rollouts"),
            &repo_task(task, harness, 4, 120),
        )
        .await;
        expected.insert(format!("{task}-{harness}"), reward);
    }
    let hang = post(
        &format!("{base}/v1/rollouts"),
        &repo_task("hang", "pi", 1, 8),
    )
    .await;
    let done = results_within(&base, 0, 17, Duration::from_secs(280)).await;

    let mut per_group: std::collections::HashMap<String, usize> = Default::default();
    for s in done
        .iter()
        .filter(|s| s["rollout_id"] != hang["rollout_id"])
    {
        let group = s["task_id"].as_str().unwrap().to_owned();
        let reward = expected[&group];
        *per_group.entry(group.clone()).or_default() += 1;
        assert_completed(dir.path(), s, reward);
        let t = &s["trajectory"];
        assert_eq!(t["faithfulness_violations"], 0, "{s}");
        assert_eq!(t["complete"], true, "{s}");
        let traces = read_traces(s);
        // The tool loop (tool call, then the answer) is one merged trace.
        let main = traces
            .iter()
            .max_by_key(|t| t["calls"].as_array().unwrap().len())
            .unwrap();
        assert!(main["calls"].as_array().unwrap().len() >= 2, "{main}");
        for t in &traces {
            assert_eq!(t["reward"], reward, "{s}");
            assert_eq!(t["group_id"], group, "{s}");
            assert_eq!(t["session_id"], s["sample_id"]);
        }
        let trainable = main["loss_mask"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| **m == 1)
            .count();
        assert!(trainable > 0, "a completed sample keeps its mask");
        // The evaluation saw the real test file, in a fresh copy.
        assert!(s["evaluation"]["log"].is_string(), "{s}");
    }
    assert_eq!(per_group.len(), 4, "{per_group:?}");
    assert!(per_group.values().all(|n| *n == 4), "{per_group:?}");
    assert!(
        max_concurrent_runs(&done) >= 2,
        "samples ran one after another"
    );

    let hung = done
        .iter()
        .find(|s| s["rollout_id"] == hang["rollout_id"])
        .expect("the hanging sample ended");
    assert_eq!(hung["outcome"]["status"], "timeout", "{hung}");
    let t = &hung["trajectory"];
    assert_eq!(
        t["calls"], 1,
        "the tool call was captured before the hang: {hung}"
    );
    assert_eq!(
        t["trainable_tokens"], 0,
        "an unfinished sample is not trained on"
    );
    let traces = read_traces(hung);
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0]["reward"], 0.0);
    assert!(
        !traces[0]["response_ids"].as_array().unwrap().is_empty(),
        "kept, masked"
    );
}

/// The Codex and Claude Code presets through a node: each fixes `calc` with its own shell
/// tool (Codex speaking Responses, Claude Code speaking Messages to the node's capture), the
/// fix is rewarded 1, and the sample's calls come back as faithful traces of its group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_rollout_through_codex_and_claude_code_presets() {
    let (_engine, dir, base, _serve) = harness_node(&["codex", "claude"], &[]).await;
    for harness in ["codex", "claude-code"] {
        post(
            &format!("{base}/v1/rollouts"),
            &repo_task("calc", harness, 1, 120),
        )
        .await;
    }
    let done = results_within(&base, 0, 2, Duration::from_secs(240)).await;
    for s in &done {
        let group = s["task_id"].as_str().unwrap();
        assert_completed(dir.path(), s, 1.0);
        let t = &s["trajectory"];
        assert_eq!(t["faithfulness_violations"], 0, "{s}");
        assert_eq!(t["complete"], true, "{s}");
        assert!(
            t["calls"].as_u64().unwrap() >= 2,
            "the tool call and the answer after it: {s}"
        );
        let traces = read_traces(s);
        // The tool loop (tool call, then the answer) is one merged trace.
        assert!(
            traces
                .iter()
                .any(|t| t["calls"].as_array().unwrap().len() >= 2),
            "{s}"
        );
        for t in &traces {
            assert_eq!(t["reward"], 1.0, "{s}");
            assert_eq!(t["group_id"], group, "{s}");
        }
        let trainable: u64 = t["trainable_tokens"].as_u64().unwrap();
        assert!(trainable > 0, "{s}");
    }
    let wires: Vec<String> = read_spool(&dir.path().join("node/spool"))
        .iter()
        .map(|r| r.request.path.clone())
        .collect();
    assert!(
        wires.iter().any(|p| p.ends_with("/v1/responses")),
        "{wires:?}"
    );
    assert!(
        wires.iter().any(|p| p.ends_with("/v1/messages")),
        "{wires:?}"
    );
}

/// `tokentap generate` over the repository's task file with the real Pi: killed (SIGKILL)
/// once a sample has finished, then run again, it finishes the rest without redoing what was
/// done, and keeps the accepted samples (the `calc` group; `greet` is fixed wrongly) as SFT
/// rows with token ids and a mask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_generate_is_resumable_and_keeps_accepted_samples() {
    let llama = LlamaServer::shared_with_tool_template().await;
    let engine = ScriptedBackend::start(Tokens::Llama(llama.tokenizer()), task_policy()).await;
    let (a, _) = Artefacts::require_harness("pi");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let tasks = tokentap_e2e::artefacts::workspace_root().join("tests/fixtures/tasks/tasks.jsonl");
    let generate = |log: &str| {
        let mut cmd = Command::new(tokentap_bin());
        cmd.arg("generate")
            .arg("--tasks")
            .arg(&tasks)
            .args(["--harness", "pi", "--samples", "2", "--quiet"])
            .arg("--out")
            .arg(&out)
            .args(["--harness-path", &a.harness_path(), "--block-egress"])
            .args(["--run-workers", "2"])
            .args(["--backend", &engine.url, "--backend-kind", "vllm"]);
        spawn_guarded(
            cmd,
            &dir.path().join(log),
            KillScope::Group,
            "tokentap generate",
        )
        .unwrap()
    };
    let mut first = generate("generate-1.log");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    // Its progress lines say when a sample has ended (recorded in its store).
    while !first.log_tail(50).contains("done=1") && !first.log_tail(50).contains("done=2") {
        assert!(
            std::time::Instant::now() < deadline && first.try_wait().is_none(),
            "no sample finished: {}",
            first.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    first.kill();
    // What the killed run had finished, from its store, with its traces' modification times.
    let done_before: Vec<(std::path::PathBuf, std::time::SystemTime)> = {
        let store = tokentap_rollout::store::Store::open(&out.join("node/node.redb")).unwrap();
        store
            .results_after(0, 100)
            .unwrap()
            .into_iter()
            .filter_map(|(_, s)| {
                let p = std::path::PathBuf::from(s.trajectory?.path);
                let m = p.metadata().ok()?.modified().ok()?;
                Some((p, m))
            })
            .collect()
    };
    assert!(!done_before.is_empty());

    let mut second = generate("generate-2.log");
    let status = second.wait_limited(Duration::from_secs(240)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}: {}",
        second.log_tail(40)
    );
    for (path, modified) in &done_before {
        assert_eq!(
            &path.metadata().unwrap().modified().unwrap(),
            modified,
            "{} was redone after the restart",
            path.display()
        );
    }
    let report: Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["samples"], 4, "{report}");
    assert_eq!(report["accepted"], 2, "the calc group: {report}");
    assert_eq!(report["acceptance_rate"], 0.5);
    let rows: Vec<Value> = std::fs::read_to_string(out.join("sft.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(rows.len() >= 2, "{rows:?}");
    let mut samples = std::collections::HashSet::new();
    for r in &rows {
        assert_eq!(r["task_id"], "calc");
        assert_eq!(r["reward"], 1.0);
        samples.insert(r["sample_id"].as_str().unwrap().to_owned());
        let (ids, mask) = (
            r["input_ids"].as_array().unwrap(),
            r["loss_mask"].as_array().unwrap(),
        );
        assert_eq!(ids.len(), mask.len());
        assert!(mask.iter().any(|m| m == 1), "sampled tokens are trainable");
        assert!(
            r["messages"].as_array().is_some_and(|m| m.len() >= 3),
            "{r}"
        );
    }
    assert_eq!(samples.len(), 2, "both accepted samples, once each");
}

/// The client's whole surface in a loop (a real trainer's loop is `scripts/train_demo.py`, e2e
/// `train_loop`): each step submits every task as a group under the current version, waits
/// for the groups, turns rewards into group-normalized advantages, reads the trajectories as
/// NumPy arrays, then pauses and resumes the node under the next version; one JSON line per step.
/// argv: NODE TOKEN SAMPLES STEPS TASKS.jsonl
const CLIENT_LOOP: &str = r#"
import json, sys
import numpy as np
from tokentap_client import Node, group_advantages, groups, reward_of
url, token, n, steps, path = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
node = Node(url, token=token)
tasks = [json.loads(l) for l in open(path) if l.strip()]
version = node.resume()["policy_version"] or "v0"
for step in range(steps):
    rollouts = [node.submit(dict(t, num_samples=n, policy_version=version)) for t in tasks]
    samples = [s for r in rollouts for s in node.wait(r["rollout_id"], timeout=600)]
    batch = []
    for _, group in sorted(groups(samples).items()):
        for sample, adv in zip(group, group_advantages([reward_of(s) for s in group])):
            batch += [(a, adv) for a in node.trajectories(sample, numpy=True)]
    trainable = sum(int(a["loss_mask"].sum()) for a, _ in batch)
    weighted = float(sum(adv * float(a["loss_mask"].sum()) for a, adv in batch))
    sampled = [a["logprobs"][a["loss_mask"][a["response_start"]:] == 1] for a, _ in batch]
    paused = node.pause()
    version = f"v{step + 1}"
    node.resume(policy_version=version)
    print(json.dumps({"step": step, "samples": len(samples),
        "groups": {g: [reward_of(s) for s in ss] for g, ss in sorted(groups(samples).items())},
        "traces": len(batch), "trainable_tokens": trainable, "advantage_weighted_tokens": weighted,
        "mean_sampled_logprob": float(np.mean(np.concatenate(sampled))) if trainable else 0.0,
        "paused_in_flight": paused["in_flight"], "next_policy_version": version}), flush=True)
"#;

/// The Python client (`clients/python`, pip-installed) against a live node: a loop over the
/// client's API ([`CLIENT_LOOP`]) submits two task groups per step, waits on the event streams, turns rewards into
/// group-normalized advantages, reads the trajectories as NumPy arrays, and pauses and
/// resumes the node under a new policy version; the node's OpenAPI document validates; then
/// the client's own pytest suite passes against the same node, and mypy --strict is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_round_trips_against_a_live_node() {
    let python = Artefacts::require_python();
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _serve = node_with(dir.path(), port, &engine.url, &["--policy-version", "v0"]).await;

    // Install the client as a user would (pip, from the directory), into a private target;
    // from a copy, since building leaves build/ and egg-info next to the sources.
    let site = dir.path().join("site");
    let root = tokentap_e2e::artefacts::workspace_root();
    let src = dir.path().join("client-src");
    let copied = Command::new("cp")
        .arg("-r")
        .arg(root.join("clients/python"))
        .arg(&src)
        .status()
        .unwrap();
    assert!(copied.success());
    let pip = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
        ])
        .arg(&site)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        pip.status.success(),
        "{}",
        String::from_utf8_lossy(&pip.stderr)
    );

    // Samples 0 and 2 of each group succeed, 1 and 3 fail: advantages of ±1.
    let agent = format!(
        "{}case \"$TOKENTAP_SESSION\" in *-0|*-2) touch ok;; esac",
        curl_agent(2, "")
    );
    let tasks = dir.path().join("tasks.jsonl");
    let task = |id: &str| {
        json!({
            "task_id": id,
            "instruction": "chat",
            "workspace": {"dir": {"path": dir.path().join("project")}},
            "harness": {"name": "command", "argv": ["sh", "-c", agent]},
            "evaluator": {"kind": "command", "command": "test -f ok"}
        })
        .to_string()
    };
    std::fs::write(&tasks, format!("{}\n{}\n", task("alpha"), task("beta"))).unwrap();
    let out = Command::new(&python)
        .args(["-c", CLIENT_LOOP, &base, TOKEN, "4", "2"])
        .arg(&tasks)
        .env("PYTHONPATH", &site)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let steps: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 2);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["samples"], 8, "{s}");
        for g in ["alpha", "beta"] {
            let mut rewards: Vec<f64> = s["groups"][g]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_f64().unwrap())
                .collect();
            rewards.sort_by(f64::total_cmp);
            assert_eq!(rewards, [0.0, 0.0, 1.0, 1.0], "{s}");
        }
        // Two merged calls per sample, every sampled token trainable in the winners, none
        // in the losers... which still count (reward 0 is a completed sample's reward).
        assert_eq!(s["traces"], 8, "{s}");
        assert!(s["trainable_tokens"].as_u64().unwrap() > 0);
        // Advantages are ±1 with equal token counts per sample: they cancel.
        assert!(
            s["advantage_weighted_tokens"].as_f64().unwrap().abs() < 1e-3,
            "{s}"
        );
        assert!(s["mean_sampled_logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(s["paused_in_flight"], 0);
        assert_eq!(s["next_policy_version"], format!("v{}", i + 1));
    }
    // The second step's samples ran under v1: the records and traces say so.
    let page = get_json(&format!("{base}/v1/results?after=8&limit=1")).await;
    let sample_id = page["results"][0]["sample"]["sample_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let traces = http_client()
        .get(format!("{base}/v1/samples/{sample_id}/traces"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let trace: Value = serde_json::from_str(traces.lines().next().unwrap()).unwrap();
    assert!(
        trace["calls"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["policy_version"] == "v1"),
        "{trace}"
    );

    let check = Command::new(&python)
        .args([
            "-c",
            "import sys\nfrom openapi_spec_validator import validate\nfrom tokentap_client import Node\nvalidate(Node(sys.argv[1], token=sys.argv[2]).openapi())\nprint('valid')",
            &base,
            TOKEN,
        ])
        .env("PYTHONPATH", &site)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&check.stdout).contains("valid"),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );

    // The client's own pytest suite against this live node (after the loop above, whose
    // result cursors it assumes), then its types (mypy --strict, as pyproject.toml says).
    let pytest = Command::new(&python)
        .args([
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "tests",
        ])
        .current_dir(&src)
        .env("TOKENTAP_NODE_URL", &base)
        .env("TOKENTAP_NODE_TOKEN", TOKEN)
        .env("TOKENTAP_TEST_PROJECT", dir.path().join("project"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&pytest.stdout);
    assert!(
        pytest.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&pytest.stderr)
    );
    let summary = report.lines().last().unwrap_or_default();
    assert!(
        summary.contains(" passed") && !summary.contains("skipped"),
        "every test ran: {summary}"
    );
    let mypy = Command::new(&python)
        .args(["-m", "mypy", "--strict", "--cache-dir"])
        .arg(dir.path().join("mypy-cache"))
        .current_dir(&src)
        .output()
        .unwrap();
    assert!(
        mypy.status.success(),
        "{}{}",
        String::from_utf8_lossy(&mypy.stdout),
        String::from_utf8_lossy(&mypy.stderr)
    );
}

/// A sandboxed sample (bubblewrap): its model calls still reach the capture on the usual
/// base URL, but nothing else on the host's network does (a listener on the host's loopback
/// is unreachable from inside), and it cannot write outside its own directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandboxed_sample_reaches_only_the_capture() {
    let engine = ScriptedBackend::start(
        Tokens::FakeChat,
        std::sync::Arc::new(|_: &Value, _| Reply::text("hi")),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    // Something on the host's loopback the agent must not reach.
    let host_only = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let host_port = host_only.local_addr().unwrap().port();
    // Outside the sample's directory: /var/tmp is not there in the sandbox, /tmp a private
    // tmpfs (the host's /tmp, where this test's files are, stays untouched).
    let port = free_port();
    let read_only = format!("/var/tmp/tokentap-sandbox-probe-{port}");
    let private = std::path::PathBuf::from(format!("/tmp/tokentap-sandbox-private-{port}"));
    let base = format!("http://127.0.0.1:{port}");
    let _serve = node(dir.path(), port, &engine.url).await;
    let script = format!(
        "{}(curl -s -m 3 http://127.0.0.1:{host_port}/ >/dev/null && echo reached || echo blocked) > net.txt; \
         (touch {read_only} 2>/dev/null && echo wrote || echo read-only) > fs.txt; \
         touch {}",
        curl_agent(1, ""),
        private.display()
    );
    let r = post(
        &format!("{base}/v1/rollouts"),
        &json!({
            "task_id": "boxed",
            "instruction": "x",
            "workspace": {"dir": {"path": dir.path().join("project")}},
            "harness": {"name": "command", "argv": ["sh", "-c", script]},
            "evaluator": {"kind": "session-completed"},
            "sandbox": true
        }),
    )
    .await;
    let done = results(&base, 0, 1).await;
    let s = &done[0];
    let sample_dir = dir
        .path()
        .join("node/samples")
        .join(r["samples"][0].as_str().unwrap());
    let agent_log = std::fs::read_to_string(sample_dir.join("agent.log")).unwrap_or_default();
    assert_eq!(s["agent"]["exit_code"], 0, "{s}\nagent log:\n{agent_log}");
    assert_eq!(s["trajectory"]["calls"], 1, "the capture is reachable: {s}");
    let work = sample_dir.join("work");
    let read = |f: &str| std::fs::read_to_string(work.join(f)).unwrap();
    assert_eq!(read("net.txt").trim(), "blocked");
    assert_eq!(read("fs.txt").trim(), "read-only");
    assert!(!std::path::Path::new(&read_only).exists());
    assert!(!private.exists(), "the sandbox's /tmp is its own");
}

/// A closed binary's hard-coded endpoint, captured by a node: a `command` agent that ignores
/// the base URL it is given and calls `https://api.openai.com` itself (resolved to 127.0.0.2
/// in its private mount namespace) is redirected by eBPF on its own cgroup, intercepted with
/// the node's CA under its sample's session, and rebuilt like any other sample. The node's own
/// connection to the engine is never redirected, and nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_transparent_a_node_captures_an_agent_with_a_hard_coded_endpoint() {
    a_node_captures_a_hard_coded_endpoint_at("127.0.0.2").await;
}

/// The same over IPv6: the endpoint resolves to `::1`, the agent's connect6 is redirected to
/// the sample's interception listener on `[::1]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_transparent_a_node_captures_an_agent_with_a_hard_coded_ipv6_endpoint() {
    a_node_captures_a_hard_coded_endpoint_at("::1").await;
}

async fn a_node_captures_a_hard_coded_endpoint_at(address: &str) {
    if !tokentap_e2e::transparent::privileged() {
        return;
    }
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    let net = tokentap_e2e::transparent::FakeNet::new(&[("api.openai.com", address)]);
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    // --block-egress would point HTTPS_PROXY at a dead port: a transparent sample goes without.
    let _serve = node_with(dir.path(), port, &engine.url, &["--block-egress"]).await;
    let body = json!({"model": "gpt-5", "messages": [{"role": "user", "content": "task"}]});
    let script = format!(
        "curl -sS --fail --max-time 20 https://api.openai.com/v1/chat/completions -H 'content-type: application/json' -H 'authorization: Bearer sk-closed-binary-key' -d '{body}' > answer.json && grep -q 'answer to 1 messages' answer.json"
    );
    let mut argv = net.prefix();
    argv.extend(["sh".to_owned(), "-c".to_owned(), script]);
    let submitted = post(
        &format!("{base}/v1/rollouts"),
        &json!({
            "task_id": "closed-binary",
            "instruction": "chat",
            "workspace": {"dir": {"path": dir.path().join("project")}},
            "harness": {"name": "command", "argv": argv},
            "capture": "transparent",
            "evaluator": {"kind": "session-completed"},
            "num_samples": 2
        }),
    )
    .await;
    assert!(submitted["rollout_id"].is_string(), "{submitted}");
    let done = results(&base, 0, 2).await;
    let spool = read_spool(&dir.path().join("node/spool"));
    for s in &done {
        assert_completed(dir.path(), s, 1.0);
        let t = &s["trajectory"];
        assert_eq!(
            (t["calls"].as_u64(), t["traces"].as_u64()),
            (Some(1), Some(1)),
            "{s}"
        );
        assert_eq!(t["faithfulness_violations"], 0, "{s}");
        let mine: Vec<_> = spool
            .iter()
            .filter(|r| r.session_id == s["sample_id"].as_str().unwrap())
            .collect();
        assert_eq!(mine.len(), 1, "{s}");
        let r = mine[0];
        assert_eq!(r.request.headers["host"], "api.openai.com");
        assert_eq!(r.response_status, 200, "{:?}", r.error);
        let raw = serde_json::to_string(r).unwrap();
        assert!(
            !raw.contains("sk-closed-binary-key"),
            "the key never reaches a record"
        );
    }
    assert_eq!(spool.len(), 2, "only the two agents' calls were captured");
    assert_eq!(engine.requests().len(), 2);
    assert!(
        tokentap_e2e::transparent::leftover_cgroups("sample-").is_empty(),
        "each sample's redirect cgroup is removed"
    );
}
