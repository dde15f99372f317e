//! A task's `token_mode` on `tokentap serve`: a node started with `--token-mode tito` on the real
//! llama-server (the tiny reasoning model, its GGUF as `--tokenizer`) runs a task asking for
//! `tito` token in, token out (its records carry `token_in`, their prompt ids built by
//! tokentap) and one asking for `off` in text mode (neither), side by side; a task asking for a
//! mode the node was not started ready for is refused at submission, naming the flag, on that
//! node (`observe`) and on a node started in text mode (`tito`, the task the first node ran).

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::{free_port, ChildGuard};
use tokentap_e2e::scripted::curl_agent;
use tokentap_e2e::tokentap::read_spool;
use tokentap_e2e::CaptureRecord;
use tokentap_schema::TokenSource;

const TOKEN: &str = "e2e-node-token";

/// A one-call `command` task (curl, no tools: the model answers `Done.`) in `mode`.
fn task(project: &std::path::Path, id: &str, mode: &str) -> Value {
    json!({
        "task_id": id,
        "instruction": "chat",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", curl_agent(1, "true")]},
        "evaluator": {"kind": "session-completed"},
        "sampling": {"max_tokens": 64},
        "token_mode": mode
    })
}

/// `tokentap serve` in `dir` on llama-server at `engine` with `extra`: the process and its URL.
async fn node(dir: &std::path::Path, engine: &str, extra: &[&str]) -> (ChildGuard, String) {
    let port = free_port();
    let serve = node_api::start_serve_on(dir, port, (engine, "llamacpp"), TOKEN, extra).await;
    (serve, format!("http://127.0.0.1:{port}"))
}

/// Submitting `task` to the node at `base` is refused with a 400 saying `says`.
async fn assert_refused(base: &str, task: &Value, says: &str) {
    let (status, answer) = node_api::post_json(&format!("{base}/v1/rollouts"), TOKEN, task).await;
    assert_eq!(status, 400, "{answer}");
    assert_eq!(answer["error"]["type"], "invalid_task", "{answer}");
    assert_eq!(answer["error"]["message"], says, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_tito_node_runs_each_task_in_the_token_mode_it_asks_for() {
    let llama = LlamaServer::shared_think_model().await;
    let model = Artefacts::require_think_model().display().to_string();
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let tito_dir = dir.path().join("tito");
    std::fs::create_dir_all(&tito_dir).unwrap();
    let (_tito_node, base) = node(
        &tito_dir,
        &llama.url,
        &["--token-mode", "tito", "--tokenizer", &model],
    )
    .await;
    for mode in ["tito", "off"] {
        node_api::submit(&base, TOKEN, &task(&project, mode, mode)).await;
    }
    assert_refused(
        &base,
        &task(&project, "observe", "observe"),
        "token_mode \"observe\" needs a node started with --token-mode observe; this node was started with --token-mode tito and runs \"tito\" and \"off\"",
    )
    .await;

    let done =
        node_api::results_within(&base, TOKEN, 0, 2, 10, std::time::Duration::from_secs(120)).await;
    let spool = read_spool(&tito_dir.join("node/spool"));
    let records = |task_id: &str| -> Vec<&CaptureRecord> {
        let sample = done.iter().find(|s| s["task_id"] == task_id).unwrap();
        assert_eq!(
            sample["outcome"],
            json!({"status": "completed", "reward": 1.0}),
            "{sample}"
        );
        let session = sample["trajectory"]["session_id"].as_str().unwrap();
        let records: Vec<&CaptureRecord> =
            spool.iter().filter(|r| r.session_id == session).collect();
        assert_eq!(records.len(), 1, "{task_id}: {records:?}");
        // Answered (curl's exit status does not say so).
        let r = records[0];
        assert_eq!(
            (r.response_status, &r.error),
            (200, &None),
            "{task_id}: {r:?}"
        );
        assert!(r.prompt_token_ids.is_some(), "{task_id}: {r:?}");
        records
    };
    for r in records("tito") {
        assert!(r.token_in.is_some(), "tito: {r:?}");
        assert_eq!(r.token_provenance.prompt, TokenSource::Tokentap, "{r:?}");
    }
    for r in records("off") {
        assert!(r.token_in.is_none(), "off: {r:?}");
        assert_ne!(r.token_provenance.prompt, TokenSource::Tokentap, "{r:?}");
    }

    // The positive control: the task the tito node ran, refused by a node in text mode.
    let off_dir = dir.path().join("off");
    std::fs::create_dir_all(&off_dir).unwrap();
    let (_off_node, off_base) = node(&off_dir, &llama.url, &[]).await;
    assert_refused(
        &off_base,
        &task(&project, "tito", "tito"),
        "token_mode \"tito\" needs a node started with --token-mode tito; this node was started with --token-mode off and runs only \"off\"",
    )
    .await;
}
