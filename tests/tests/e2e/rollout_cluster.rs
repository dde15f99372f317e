//! Rollout nodes sharing a bus (`tokentap serve --bus`, a real nats-server on loopback): three
//! nodes run 24 samples of three tasks through the real Pi; one node is killed (SIGKILL) while
//! its samples run, and they run again elsewhere as new attempts; a cancel through one node
//! stops samples running on another; every sample ends once, every callback arrives once, and
//! a node that ran none of them answers for all of them.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::nats::NatsServer;
use tokentap_e2e::node_api::{self, callback_receiver, start_cluster_node, TaskKeyFile};
use tokentap_e2e::procs::{free_port, http_client, metric_with, ChildGuard};
use tokentap_e2e::repo_tasks::{repo_task, task_policy};
use tokentap_e2e::scripted::{ScriptedBackend, Tokens};

const TOKEN: &str = "e2e-cluster-node-token";
const BUS_TOKEN: &str = "e2e-cluster-bus-token";

struct ClusterNode {
    base: String,
    process: ChildGuard,
}

async fn start_node(
    dir: &std::path::Path,
    id: &str,
    engine: &str,
    nats: &NatsServer,
    key: &TaskKeyFile,
    harness_path: &str,
) -> ClusterNode {
    let (process, base) = start_cluster_node(
        dir,
        id,
        engine,
        TOKEN,
        nats,
        key,
        &[
            // Short, so a killed node's samples come back soon (the default is 30 s).
            "--sample-ack-wait",
            "6",
            "--run-workers",
            "2",
            "--prewarm",
            "1",
            "--harness-path",
            harness_path,
            "--block-egress",
        ],
    )
    .await;
    ClusterNode { base, process }
}

async fn get_json(url: &str) -> Value {
    node_api::get_json(url, TOKEN).await
}

/// Waits until `check` holds for the rollout's samples as `node` shows them.
async fn wait_samples(
    node: &ClusterNode,
    rollout: &str,
    what: &str,
    limit: Duration,
    check: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let deadline = Instant::now() + limit;
    loop {
        let v = get_json(&format!("{}/v1/rollouts/{rollout}", node.base)).await;
        let samples = v["samples"].as_array().cloned().unwrap_or_default();
        if check(&samples) {
            return samples;
        }
        assert!(Instant::now() < deadline, "{what}: {v:#}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Submits 8 samples of the repository task `name` through Pi to `node`; the rollout's id.
async fn submit_group(node: &ClusterNode, name: &str, agent_s: u64, callback: &str) -> String {
    let mut task = repo_task(name, "pi", 8, agent_s);
    task["callback_url"] = json!(callback);
    let answer = node_api::submit(&node.base, TOKEN, &task).await;
    answer["rollout_id"].as_str().unwrap().to_owned()
}

fn running_on<'a>(samples: &'a [Value], node: &str) -> Vec<&'a Value> {
    samples
        .iter()
        .filter(|s| s["node"] == node && s["stage"] == "run")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_three_nodes_share_24_samples_through_a_kill_and_a_cancel() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), BUS_TOKEN).await;
    let key = TaskKeyFile::new();
    let llama = LlamaServer::shared_with_tool_template().await;
    let engine = ScriptedBackend::start(Tokens::Llama(llama.tokenizer()), task_policy()).await;
    let harness_path = Artefacts::require_harness("pi").0.harness_path();
    let (callback, deliveries) = callback_receiver().await;
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b", "node-c"] {
        nodes.push(start_node(dir.path(), id, &engine.url, &nats, &key, &harness_path).await);
    }

    // Two groups of 8 through node a: the policy fixes calc (reward 1), gets greet wrong (0).
    let calc_id = submit_group(&nodes[0], "calc", 120, &callback).await;
    let greet_id = submit_group(&nodes[0], "greet", 120, &callback).await;

    // Node c is killed while one of its samples runs its agent.
    let killed = wait_samples(
        &nodes[0],
        &calc_id,
        "node-c running a calc sample",
        Duration::from_secs(90),
        |s| !running_on(s, "node-c").is_empty(),
    )
    .await;
    let mut victim = nodes.remove(2);
    victim.process.kill();
    // What node c held when it died: claimed, not ended on the bus.
    let mut on_c: HashSet<String> = HashSet::new();
    for rollout in [&calc_id, &greet_id] {
        let v = get_json(&format!("{}/v1/rollouts/{rollout}", nodes[0].base)).await;
        for s in v["samples"].as_array().unwrap() {
            if s["node"] == "node-c" && s["outcome"].is_null() {
                on_c.insert(s["sample_id"].as_str().unwrap().to_owned());
            }
        }
    }
    assert!(!running_on(&killed, "node-c").is_empty());
    assert!(!on_c.is_empty());

    let first16 =
        node_api::results_within(&nodes[1].base, TOKEN, 0, 16, 10, Duration::from_secs(300)).await;
    assert_eq!(first16.len(), 16);

    // A third group whose tool never returns, submitted through node b and cancelled through
    // node a once node b runs some of it.
    let hang_id = submit_group(&nodes[1], "hang", 300, &callback).await;
    // Its events, followed through node a while node b runs it, until the stream says done.
    let events = tokio::spawn({
        let url = format!("{}/v1/rollouts/{hang_id}/events", nodes[0].base);
        async move {
            let body = http_client()
                .get(url)
                .bearer_auth(TOKEN)
                .timeout(Duration::from_secs(120))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            tokentap_e2e::sse::events(&body)
        }
    });
    wait_samples(
        &nodes[0],
        &hang_id,
        "node-b running a hang sample",
        Duration::from_secs(90),
        |s| !running_on(s, "node-b").is_empty(),
    )
    .await;
    let cancelled_at = Instant::now();
    let r = http_client()
        .delete(format!("{}/v1/rollouts/{hang_id}", nodes[0].base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let stopping: Value = r.json().await.unwrap();
    assert!(stopping["stopping"].as_u64().unwrap() >= 1, "{stopping}");
    wait_samples(
        &nodes[1],
        &hang_id,
        "every hang sample ended",
        Duration::from_secs(60),
        |s| s.iter().all(|s| !s["outcome"].is_null()),
    )
    .await;
    eprintln!(
        "the cancel through node a ended node b's samples in {:?}",
        cancelled_at.elapsed()
    );
    let events = events.await.unwrap();
    let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(names.first(), Some(&"snapshot"), "{names:?}");
    assert_eq!(names.last(), Some(&"done"), "{names:?}");
    let finished: HashSet<String> = events
        .iter()
        .filter(|e| e.event == "finished")
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            assert_eq!(v["outcome"]["status"], "cancelled", "{v}");
            v["sample_id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert!(
        names.contains(&"stage") && !finished.is_empty(),
        "node b's progress reached node a's event stream: {names:?}"
    );

    // A node that ran none of them answers for all of them.
    let late = start_node(
        dir.path(),
        "node-d",
        &engine.url,
        &nats,
        &key,
        &harness_path,
    )
    .await;
    let all = node_api::results_within(&late.base, TOKEN, 0, 24, 5, Duration::from_secs(60)).await;
    let ids: Vec<&str> = all
        .iter()
        .map(|s| s["sample_id"].as_str().unwrap())
        .collect();
    let distinct: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(
        (ids.len(), distinct.len()),
        (24, 24),
        "each sample ends once: {ids:?}"
    );
    let page = get_json(&format!("{}/v1/results?after=0&limit=1000", late.base)).await;
    assert_eq!(page["results"].as_array().unwrap().len(), 24);
    let next = page["next"].as_u64().unwrap();
    let after = get_json(&format!("{}/v1/results?after={next}&wait=2", late.base)).await;
    assert_eq!(after["results"], json!([]), "nothing after the 24");

    let mut per_rollout: HashMap<String, Vec<&Value>> = HashMap::new();
    for s in &all {
        per_rollout
            .entry(s["rollout_id"].as_str().unwrap().to_owned())
            .or_default()
            .push(s);
        assert_ne!(s["node"], "node-d", "the late node ran nothing");
    }
    for (rollout, reward) in [(&calc_id, 1.0), (&greet_id, 0.0)] {
        for s in &per_rollout[rollout.as_str()] {
            assert_eq!(
                s["outcome"],
                json!({"status": "completed", "reward": reward}),
                "{s}"
            );
            let t = &s["trajectory"];
            assert_eq!(t["faithfulness_violations"], 0, "{s}");
            assert_eq!(t["complete"], true, "{s}");
            let id = s["sample_id"].as_str().unwrap();
            if on_c.contains(id) {
                // Run again elsewhere, as a new attempt under a new capture session.
                assert_ne!(s["node"], "node-c", "{s}");
                assert!(s["attempt"].as_u64().unwrap() >= 2, "{s}");
                assert!(
                    t["session_id"]
                        .as_str()
                        .unwrap()
                        .ends_with(&format!("-a{}", s["attempt"])),
                    "{s}"
                );
            } else {
                assert_eq!(s["attempt"], 1, "{s}");
            }
        }
    }
    let hang_samples = &per_rollout[hang_id.as_str()];
    assert!(hang_samples
        .iter()
        .all(|s| s["outcome"]["status"] == "cancelled"));
    assert!(
        hang_samples.iter().any(|s| s["node"] == "node-b"),
        "some were running on node b when node a cancelled them"
    );

    // A sample's traces through the node that did not run it, as the node that ran it wrote them.
    let sample = per_rollout[calc_id.as_str()]
        .iter()
        .find(|s| s["node"] == "node-a")
        .or_else(|| per_rollout[calc_id.as_str()].first())
        .unwrap();
    let id = sample["sample_id"].as_str().unwrap();
    let body = http_client()
        .get(format!("{}/v1/samples/{id}/traces", late.base))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let on_disk = std::fs::read_to_string(sample["trajectory"]["path"].as_str().unwrap()).unwrap();
    assert_eq!(body, on_disk);

    // The nodes' capture records are on the bus too, for a worker group: at least every call of
    // the 16 completed samples.
    let calls: u64 = [&calc_id, &greet_id]
        .iter()
        .flat_map(|r| per_rollout[r.as_str()].iter())
        .map(|s| s["trajectory"]["calls"].as_u64().unwrap())
        .sum();
    let client = tokentap_bus::connect(
        &tokentap_bus::BusConnect {
            url: nats.url(),
            token: Some(nats.token.clone()),
            user: None,
            ca: None,
        },
        "test",
    )
    .await
    .unwrap();
    let mut records = tokentap_bus::jetstream(client)
        .get_stream(tokentap_bus::topology::RECORDS_STREAM)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let on_bus = records.info().await.unwrap().state.messages;
        if on_bus >= calls {
            break;
        }
        assert!(Instant::now() < deadline, "{on_bus} of {calls} records");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // Every callback once: 24 deliveries, one per sample, each with that sample's result.
    let deadline = Instant::now() + Duration::from_secs(30);
    while deliveries.lock().unwrap().len() < 24 {
        assert!(
            Instant::now() < deadline,
            "{} callbacks",
            deliveries.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let got = deliveries.lock().unwrap().clone();
    let keys: Vec<&str> = got.iter().map(|(k, _)| k.as_str()).collect();
    let distinct_keys: HashSet<&str> = keys.iter().copied().collect();
    assert_eq!((keys.len(), distinct_keys), (24, distinct), "{keys:?}");
    for (key, body) in &got {
        assert_eq!(body["sample"]["sample_id"], *key);
        assert!(!body["sample"]["outcome"].is_null(), "{body}");
    }

    // The nodes' metrics say the same: node c's samples claimed again by the others, every
    // callback delivered once.
    let (mut reruns, mut delivered) = (0.0, 0.0);
    for base in [&nodes[0].base, &nodes[1].base, &late.base] {
        let m = |name: &'static str| metric_with(base, name, Some(TOKEN));
        reruns += m("tokentap_cluster_claims_total{attempt=\"rerun\"}")
            .await
            .unwrap_or(0.0);
        delivered += m("tokentap_cluster_callbacks_total{outcome=\"delivered\"}")
            .await
            .unwrap_or(0.0);
    }
    assert!(reruns >= on_c.len() as f64, "{reruns} re-runs of {on_c:?}");
    assert_eq!(delivered, 24.0);

    // Pause and resume reach every live node, once node c's heartbeat is gone.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let status = get_json(&format!("{}/v1/admin/status", late.base)).await;
        let ids: Vec<&str> = status["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["node_id"].as_str().unwrap())
            .collect();
        if ids == ["node-a", "node-b", "node-d"] {
            break;
        }
        assert!(Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (_, paused) = node_api::post_json(
        &format!("{}/v1/admin/pause?wait=30", late.base),
        TOKEN,
        &json!({}),
    )
    .await;
    assert_eq!(paused["paused"], true, "{paused}");
    assert_eq!(paused["in_flight"], 0, "{paused}");
    let live: Vec<&str> = paused["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["node_id"].as_str().unwrap())
        .collect();
    assert_eq!(live, ["node-a", "node-b", "node-d"], "{paused}");
    let status = get_json(&format!("{}/v1/admin/status", nodes[0].base)).await;
    assert!(
        status["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["paused"] == true),
        "{status}"
    );
    let (_, resumed) = node_api::post_json(
        &format!("{}/v1/admin/resume", nodes[1].base),
        TOKEN,
        &json!({"policy_version": "step-2"}),
    )
    .await;
    assert_eq!(resumed["paused"], false, "{resumed}");
    assert!(
        resumed["nodes"]
            .as_array()
            .unwrap()
            .iter()
            .all(|n| n["paused"] == false && n["policy_version"] == "step-2"),
        "{resumed}"
    );
}

/// Without the bus's token a node cannot join: it says so and stops, it never serves alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_node_without_the_bus_token_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), BUS_TOKEN).await;
    let key = TaskKeyFile::new();
    let engine =
        ScriptedBackend::start(Tokens::FakeChat, tokentap_e2e::scripted::counting_replies()).await;
    let out = std::process::Command::new(tokentap_e2e::artefacts::tokentap_bin())
        .args(["serve", "--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data")
        .arg(dir.path().join("node"))
        .args(["--backend", &engine.url, "--backend-kind", "vllm"])
        .args(["--bus", &nats.url(), "--bus-token", "guess"])
        // Everything else a node needs, so what stops it is the token.
        .arg("--task-key-file")
        .arg(&key.path)
        .env("TOKENTAP_NODE_TOKEN", TOKEN)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("connecting to the bus") || stderr.contains("authorization"),
        "{stderr}"
    );
}
