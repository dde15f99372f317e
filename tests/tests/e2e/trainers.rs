//! The trainer adapters of the Python client against their real packages: `tokentap_client.verl`
//! in verl 0.9.1's venv and `tokentap_client.skyrl` in skyrl 0.3.0's (scripts/setup's
//! `trainers` step, under ~/.cache/tokentap/trainers), each over a live `tokentap serve` in
//! front of llama-server on the tiny test model. The Python side (clients/python/tests_trainers)
//! drives the trainers' own code: verl's `AgentLoopWorker.generate_sequences` and its v1
//! TransferQueue worker, SkyRL's `validate_generator_output` and
//! `convert_prompts_responses_to_batch_tensors`, and checks every row against the node's traces.

use std::path::PathBuf;
use std::process::Command;

use tokentap_e2e::artefacts::{tokentap_bin, workspace_root};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::node_api;
use tokentap_e2e::procs::free_port;

const TOKEN: &str = "e2e-trainers-token";

/// A trainer venv's python; fails (never skips) when setup has not made it.
fn trainer_python(name: &str) -> PathBuf {
    let cache = std::env::var_os("TOKENTAP_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/tokentap")
        });
    let py = cache
        .join("trainers")
        .join(format!("{name}-venv/bin/python"));
    assert!(
        py.is_file(),
        "{} not found: run scripts/setup --only trainers (it installs {name} in its own venv)",
        py.display()
    );
    py
}

/// Runs `clients/python/tests_trainers/FILE` with the venv `name` against a fresh node in front
/// of the tiny model (policy version "7"); every test must pass, none may skip.
async fn pytest_in(name: &str, file: &str) {
    let python = trainer_python(name);
    let llama = LlamaServer::shared().await;
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let port = free_port();
    let _node = node_api::start_serve_on(
        dir.path(),
        port,
        (llama.url.as_str(), "llamacpp"),
        TOKEN,
        &["--policy-version", "7"],
    )
    .await;
    let out = Command::new(&python)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x"])
        .arg(format!("tests_trainers/{file}"))
        .current_dir(workspace_root().join("clients/python"))
        .env("TOKENTAP_NODE_URL", format!("http://127.0.0.1:{port}"))
        .env("TOKENTAP_NODE_TOKEN", TOKEN)
        .env("TOKENTAP_TEST_PROJECT", &project)
        .env("TOKENTAP_ENGINE_URL", &llama.url)
        .env("TOKENTAP_BIN", tokentap_bin())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = report.lines().last().unwrap_or_default();
    assert!(
        summary.contains(" passed") && !summary.contains("skipped"),
        "every test ran: {summary}"
    );
}

/// verl 0.9.1 on CPU: groups of rows run as tokentap samples through verl's own agent loop
/// worker and post-processing (padding, masks, rm_scores), the v1 trainer's one output per
/// trace, failed / empty / timed-out samples, clipping at the response length, and nodes the
/// loop starts itself at the addresses verl's (Ray) router holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_verl_agent_loop_over_a_real_node_and_engine() {
    pytest_in("verl", "test_verl.py").await;
}

/// skyrl 0.3.0: `TokentapGenerator.generate` rows accepted by SkyRL's own validation and
/// tensor conversion, step-wise rows, failed / empty / timed-out samples, clipping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_skyrl_generator_over_a_real_node_and_engine() {
    pytest_in("skyrl", "test_skyrl.py").await;
}
