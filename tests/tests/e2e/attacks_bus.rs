//! Attacks over the bus. Every proxy, sidecar, node agent and worker holds the bus credential,
//! so an attacker with it (raw NATS, no node token) is assumed. It plants rollouts, samples and
//! queue messages as a node would: one without a seal, an honest rollout altered, one sealed
//! but over the node's ceilings, a sample that is not its rollout's, and a callback job to a
//! URL of its choosing. None of them runs, nothing is delivered to the attacker, each refusal
//! is counted by reason, and the node keeps running honest tasks. A rollout planted the same
//! way but sealed with the cluster's key runs: that positive control shows that the planted
//! tasks are refused for their seals, not for their shape.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_bus::async_nats;
use tokentap_e2e::nats::NatsServer;
use tokentap_e2e::node_api::{
    self, callback_receiver, start_cluster_node, TaskKeyFile, TEST_TASK_KEY,
};
use tokentap_e2e::procs::metric_with;
use tokentap_e2e::scripted::{counting_replies, ScriptedBackend, Tokens};
use tokentap_rollout::cluster::bus::{
    CALLBACK_SUBJECT, QUEUE_SUBJECT, ROLLOUTS_BUCKET, SAMPLES_BUCKET,
};
use tokentap_rollout::cluster::seal::{SealedRollout, TaskKey};

const TOKEN: &str = "e2e-bus-attack-node-token";
const BUS_TOKEN: &str = "e2e-bus-attack-bus-token";

fn task(project: &Path, marks: &Path, mark: &str, callback: &str) -> Value {
    json!({
        "task_id": mark,
        "instruction": "x",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", format!("touch {}/{mark}", marks.display())]},
        "evaluator": {"kind": "command", "command": "true"},
        "budgets": {"session_s": 120, "agent_s": 60, "eval_s": 30},
        "callback_url": callback
    })
}

/// The attacker: a plain NATS client with the bus credential.
struct Attacker {
    js: async_nats::jetstream::Context,
    rollouts: async_nats::jetstream::kv::Store,
    samples: async_nats::jetstream::kv::Store,
    planted: u32,
}

impl Attacker {
    async fn connect(nats: &NatsServer) -> Attacker {
        let client = async_nats::ConnectOptions::new()
            .token(BUS_TOKEN.into())
            .connect(nats.url())
            .await
            .unwrap();
        let js = tokentap_bus::jetstream(client);
        Attacker {
            rollouts: js.get_key_value(ROLLOUTS_BUCKET).await.unwrap(),
            samples: js.get_key_value(SAMPLES_BUCKET).await.unwrap(),
            js,
            planted: 0,
        }
    }

    async fn get(store: &async_nats::jetstream::kv::Store, key: &str) -> Value {
        serde_json::from_slice(&store.get(key).await.unwrap().expect("on the bus")).unwrap()
    }

    /// Puts `rollout` (as the bucket's value) and a fresh queued sample `index` of it, shaped
    /// like `template`, on the bus, then queues it for the nodes.
    async fn plant(&mut self, rollout: &Value, index: u32, template: &Value) -> String {
        let rollout_id = rollout["rollout_id"].as_str().unwrap();
        let sample_id = format!("{rollout_id}-{index}");
        let mut sample = template.clone();
        let fields = sample.as_object_mut().unwrap();
        for gone in ["agent", "callback", "node"] {
            fields.remove(gone);
        }
        fields.insert("sample_id".into(), json!(sample_id));
        fields.insert("rollout_id".into(), json!(rollout_id));
        fields.insert("index".into(), json!(index));
        fields.insert("stage".into(), json!("queued"));
        fields.insert("stage_started_ms".into(), json!([0, 0, 0, 0]));
        fields.insert("stage_ended_ms".into(), json!([0, 0]));
        fields.insert("attempt".into(), json!(0));
        for empty in ["outcome", "trajectory", "evaluation"] {
            fields.insert(empty.into(), Value::Null);
        }
        self.rollouts
            .put(rollout_id, serde_json::to_vec(rollout).unwrap().into())
            .await
            .unwrap();
        self.samples
            .put(&sample_id, serde_json::to_vec(&sample).unwrap().into())
            .await
            .unwrap();
        self.queue(rollout_id, &sample_id).await;
        sample_id
    }

    async fn queue(&mut self, rollout_id: &str, sample_id: &str) {
        self.planted += 1;
        let item = json!({"rollout_id": rollout_id, "sample_id": sample_id});
        // A message id of its own, so the queue's de-duplication cannot drop it.
        let message = async_nats::jetstream::message::PublishMessage::build()
            .payload(serde_json::to_vec(&item).unwrap().into())
            .message_id(format!("attack-{}", self.planted));
        self.js
            .send_publish(QUEUE_SUBJECT, message)
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

/// `rollout` (an honest one's bucket value) as another rollout `id` whose agent touches `mark`.
fn variant(rollout: &Value, id: &str, marks: &Path, mark: &str) -> Value {
    let mut r = rollout.clone();
    r["rollout_id"] = json!(id);
    r["spec"]["task_id"] = json!(mark);
    r["spec"]["harness"]["argv"][2] = json!(format!("touch {}/{mark}", marks.display()));
    r
}

fn sealed_with_cluster_key(rollout: &Value) -> Value {
    let key = TaskKey::new(TEST_TASK_KEY.as_bytes()).unwrap();
    let mut plain = rollout.clone();
    plain.as_object_mut().unwrap().remove("seal");
    let sealed = key.seal(serde_json::from_value(plain).unwrap());
    serde_json::to_value::<SealedRollout>(sealed).unwrap()
}

async fn refused(base: &str, reason: &str) -> f64 {
    let name = format!("tokentap_cluster_tasks_refused_total{{reason=\"{reason}\"}}");
    metric_with(base, &name, Some(TOKEN)).await.unwrap_or(0.0)
}

async fn wait_for(what: &str, limit: Duration, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check().await {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_planted_on_the_bus_never_runs_and_honest_ones_still_do() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), BUS_TOKEN).await;
    let key = TaskKeyFile::new();
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let project = dir.path().join("project");
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::create_dir_all(&marks).unwrap();
    std::fs::write(project.join("README"), "a project").unwrap();
    let (_node, base) = start_cluster_node(
        dir.path(),
        "n1",
        &engine.url,
        TOKEN,
        &nats,
        &key,
        &["--max-budget-s", "600"],
    )
    .await;
    let (callback, deliveries) = callback_receiver().await;
    let (stolen_url, stolen) = callback_receiver().await;
    let mark = |name: &str| marks.join(name).exists();

    // An honest task through the node's API runs.
    let answer =
        node_api::submit(&base, TOKEN, &task(&project, &marks, "honest-1", &callback)).await;
    let honest_id = answer["rollout_id"].as_str().unwrap().to_owned();
    node_api::results_within(&base, TOKEN, 0, 1, 10, Duration::from_secs(120)).await;
    assert!(mark("honest-1"), "the honest task did not run");

    let mut attacker = Attacker::connect(&nats).await;
    let honest = Attacker::get(&attacker.rollouts, &honest_id).await;
    assert!(honest["seal"].is_string(), "not sealed: {honest}");
    let template = Attacker::get(&attacker.samples, &format!("{honest_id}-0")).await;

    // 1. Forged: no seal at all.
    let mut forged = variant(&honest, "forgedrollout", &marks, "forged");
    forged.as_object_mut().unwrap().remove("seal");
    attacker.plant(&forged, 0, &template).await;
    // 2. Altered: the honest rollout, seal kept, its command changed and its sample queued
    //    again.
    let altered = variant(&honest, &honest_id, &marks, "altered");
    attacker.plant(&altered, 0, &template).await;
    // 3. Sealed with the cluster's key, but over this node's ceilings (a node with other
    //    ceilings could have sealed it).
    let mut over = variant(&honest, "overrollout", &marks, "over");
    over["spec"]["budgets"]["session_s"] = json!(999_999);
    attacker
        .plant(&sealed_with_cluster_key(&over), 0, &template)
        .await;
    // 4. Sealed, but the queued sample is not one of the rollout's (index past num_samples).
    let foreign = sealed_with_cluster_key(&variant(&honest, "foreignrollout", &marks, "foreign"));
    attacker.plant(&foreign, 5, &template).await;
    // 5. Positive control: planted the same way, sealed with the cluster's key: it runs.
    let control = sealed_with_cluster_key(&variant(&honest, "controlrollout", &marks, "control"));
    let control_sample = attacker.plant(&control, 0, &template).await;

    // The queue is pulled in order: once the control has ended, every attack was looked at.
    wait_for(
        "the sealed control did not run",
        Duration::from_secs(120),
        async || Attacker::get(&attacker.samples, &control_sample).await["outcome"].is_object(),
    )
    .await;
    assert!(
        mark("control"),
        "the sealed control ended without running its agent"
    );
    for (name, reason) in [
        ("forged", "unsealed"),
        ("altered", "seal_mismatch"),
        ("over", "over_ceilings"),
        ("foreign", "foreign_sample"),
    ] {
        assert!(!mark(name), "the {name} task ran");
        assert_eq!(refused(&base, reason).await, 1.0, "refusals for {reason}");
    }

    // 6. A callback job for the control's sample, to the attacker's URL: never called. The
    //    control's own callback (its sealed URL) is.
    let job = json!({"sample_id": control_sample, "url": stolen_url});
    let message = async_nats::jetstream::message::PublishMessage::build()
        .payload(serde_json::to_vec(&job).unwrap().into())
        .message_id("attack-callback");
    attacker
        .js
        .send_publish(CALLBACK_SUBJECT, message)
        .await
        .unwrap()
        .await
        .unwrap();
    wait_for(
        "the forged callback job was not refused",
        Duration::from_secs(60),
        async || refused(&base, "callback_unsealed").await >= 1.0,
    )
    .await;
    wait_for(
        "the control's callback did not arrive",
        Duration::from_secs(60),
        async || {
            deliveries
                .lock()
                .unwrap()
                .iter()
                .any(|(k, _)| *k == control_sample)
        },
    )
    .await;
    assert!(
        stolen.lock().unwrap().is_empty(),
        "the attacker's URL was called"
    );

    // The node keeps serving honest tasks.
    node_api::submit(&base, TOKEN, &task(&project, &marks, "honest-2", &callback)).await;
    wait_for(
        "the second honest task did not run",
        Duration::from_secs(120),
        async || mark("honest-2"),
    )
    .await;
}
