//! `tokentap serve` as a process: a task submitted over HTTP runs under capture and comes back
//! with a rewarded trajectory; a node killed (SIGKILL) while a sample runs re-runs it after a
//! restart, so no accepted task is lost.

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::procs::{
    free_port, http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope,
};
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};

const TOKEN: &str = "e2e-node-token";

async fn node(dir: &std::path::Path, port: u16, engine: &str) -> ChildGuard {
    let mut cmd = Command::new(tokentap_bin());
    cmd.arg("serve")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--data")
        .arg(dir.join("node"))
        .arg("--spool")
        .arg(dir.join("node/spool"))
        .args(["--backend", engine, "--backend-kind", "vllm"])
        .env("TOKENTAP_NODE_TOKEN", TOKEN)
        .env("TOKENTAP_LOG", "info");
    let log = dir.join(format!("node-{port}.log"));
    let mut child = spawn_guarded(cmd, &log, KillScope::Group, "tokentap serve").unwrap();
    wait_healthy(
        &format!("http://127.0.0.1:{port}/health"),
        &mut child,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    child
}

/// `turns` chat calls with curl through the sample's base URL, each carrying the last answer.
fn agent(turns: usize, then: &str) -> String {
    let mut script = String::new();
    let mut messages = vec![json!({"role": "user", "content": "task"})];
    for turn in 0..turns {
        let body = json!({"model": "m", "messages": messages}).to_string();
        script.push_str(&format!(
            "curl -sS --max-time 20 \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -d '{body}' > /dev/null && "
        ));
        messages.push(json!({"role": "assistant", "content": format!("answer to {} messages", messages.len())}));
        messages.push(json!({"role": "user", "content": format!("go on {turn}")}));
    }
    script.push_str(then);
    script
}

async fn post(url: &str, body: &Value) -> Value {
    let r = http_client()
        .post(url)
        .bearer_auth(TOKEN)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    r.json().await.unwrap()
}

async fn results(base: &str, after: u64, want: usize) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = after;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while out.len() < want {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {want} results",
            out.len()
        );
        let page: Value = http_client()
            .get(format!("{base}/v1/results?after={after}&wait=10"))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        after = page["next"].as_u64().unwrap();
        out.extend(
            page["results"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["sample"].clone()),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_runs_tasks_under_capture_and_survives_a_kill() {
    let engine = ScriptedBackend::start(
        Tokens::FakeChat,
        std::sync::Arc::new(|req: &Value, _| {
            let n = req["messages"].as_array().map_or(0, Vec::len);
            Reply::Text(format!("answer to {n} messages"))
        }),
    )
    .await;
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
    post(&format!("{base}/v1/rollouts"), &task(agent(2, "true"))).await;
    let done = results(&base, 0, 2).await;
    for s in &done {
        assert_eq!(
            s["outcome"],
            json!({"status": "completed", "reward": 1.0}),
            "{s}"
        );
        let t = &s["trajectory"];
        assert_eq!(
            (t["calls"].as_u64(), t["traces"].as_u64()),
            (Some(2), Some(1)),
            "{s}"
        );
        assert_eq!(t["faithfulness_violations"], 0);
        assert_eq!(t["complete"], true);
    }

    // A slow sample, and the node dies under it.
    let slow = post(&format!("{base}/v1/rollouts"), &task(agent(1, "sleep 2"))).await;
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
        assert_eq!(
            s["outcome"],
            json!({"status": "completed", "reward": 1.0}),
            "{s}"
        );
        assert_eq!(s["attempt"], 2, "re-run after the restart: {s}");
        assert_eq!(s["trajectory"]["calls"], 1, "{s}");
    }
}
