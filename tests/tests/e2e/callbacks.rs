//! Callback receivers that misbehave, against `tokentap serve` as a process: one answering 500
//! with a 1 GiB body costs the node a 1 MiB read per attempt, not the body; on a cluster node,
//! one that never answers holds 4 of the node's callbacks and nothing else (the single-node
//! case is `rollout/tests/integration/delivery.rs`).

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::nats::NatsServer;
use tokentap_e2e::node_api::{
    self, callback_receiver, flooding_receiver, peak_rss, start_cluster_node, start_serve,
    HeldReceiver, TaskKeyFile,
};
use tokentap_e2e::procs::{free_port, metric_with};
use tokentap_e2e::scripted::{counting_replies, ScriptedBackend, Tokens};

const TOKEN: &str = "e2e-callbacks-node-token";
const BUS_TOKEN: &str = "e2e-callbacks-bus-token";

fn task(project: &Path, samples: u32, callback: &str) -> Value {
    json!({
        "task_id": "t",
        "instruction": "x",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", "true"]},
        "evaluator": {"kind": "session-completed"},
        "num_samples": samples,
        "callback_url": callback
    })
}

/// Waits until `ready` (fails the test after `limit`, saying `what`).
async fn until(what: &str, limit: Duration, mut ready: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receivers_gigabyte_error_body_costs_the_node_a_bounded_read() {
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let node = start_serve(dir.path(), port, &engine.url, TOKEN, &[]).await;
    let (flood, written) = flooding_receiver().await;

    let started = peak_rss(node.id());
    node_api::submit(&base, TOKEN, &task(&project, 2, &flood)).await;
    // Each sample's first attempt and its first retry (after 0.5 s): 4 answers of 1 GiB.
    until(
        "4 attempts the node stopped reading",
        Duration::from_secs(120),
        async || written.lock().unwrap().len() >= 4,
    )
    .await;
    let peak = peak_rss(node.id());
    let written = written.lock().unwrap().clone();
    assert!(
        peak < started + (256 << 20),
        "the node's peak RSS went from {} MiB to {} MiB",
        started >> 20,
        peak >> 20
    );
    // What the receiver got into the sockets before the node closed them: the node's 1 MiB
    // and the loopback's buffers.
    assert!(
        written.iter().all(|&w| w < 64 << 20),
        "bytes written before the node closed each connection: {written:?}"
    );
}

/// On a cluster node (a real nats-server): a receiver that never answers holds at most 4 of the
/// node's callbacks and waits out their 30 s timeout; the node defers its other jobs rather than
/// wait for it, so another receiver's callbacks all arrive while those 4 are still held. Once it
/// answers it gets all of its own, each with as many attempts noted as it saw requests: the
/// deferrals (the queue delivered those jobs more than once) are not attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_receiver_that_never_answers_holds_only_its_own_callbacks() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), BUS_TOKEN).await;
    let key = TaskKeyFile::new();
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let project = dir.path().join("project");
    std::fs::create_dir_all(&project).unwrap();
    let (_node, base) =
        start_cluster_node(dir.path(), "n1", &engine.url, TOKEN, &nats, &key, &[]).await;
    let held = HeldReceiver::start().await;
    let (fast, fast_got) = callback_receiver().await;
    let deferred = async || {
        metric_with(
            &base,
            "tokentap_cluster_callbacks_total{outcome=\"deferred\"}",
            Some(TOKEN),
        )
        .await
        .unwrap_or(0.0)
    };

    let slow = node_api::submit(&base, TOKEN, &task(&project, 6, &held.url)).await;
    until(
        "4 callbacks held and a fifth deferred",
        Duration::from_secs(60),
        async || held.seen().open == 4 && deferred().await >= 1.0,
    )
    .await;
    node_api::submit(&base, TOKEN, &task(&project, 3, &fast)).await;
    until(
        "the other receiver's 3 callbacks",
        Duration::from_secs(60),
        async || fast_got.lock().unwrap().len() == 3,
    )
    .await;
    let seen = held.seen();
    assert_eq!(
        (seen.open, seen.dropped, seen.answered, seen.most_open),
        (4, 0, 0, 4),
        "the other receiver's callbacks all arrived while this one's were still held, never more than 4: {seen:?}"
    );

    held.release();
    let slow_id = slow["rollout_id"].as_str().unwrap();
    let mut rollout = Value::Null;
    until(
        "every held receiver's callback delivered",
        Duration::from_secs(120),
        async || {
            rollout = node_api::get_json(&format!("{base}/v1/rollouts/{slow_id}"), TOKEN).await;
            rollout["samples"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s["callback"].is_object())
        },
    )
    .await;
    let seen = held.seen();
    assert_eq!(seen.arrivals.len(), 6, "{seen:?}");
    for s in rollout["samples"].as_array().unwrap() {
        let id = s["sample_id"].as_str().unwrap();
        assert_eq!(
            s["callback"],
            json!({"delivered": true, "attempts": seen.arrivals[id]}),
            "{s} {seen:?}"
        );
    }
}
