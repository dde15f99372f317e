//! Attacks over the bus. Every proxy, sidecar, node agent and worker holds the bus credential,
//! so an attacker with it (raw NATS, no node token) is assumed. It plants rollouts, samples and
//! queue messages as a node would: one without a seal, an honest rollout altered, one sealed
//! but over the node's ceilings, a sample that is not its rollout's, and a callback job to a
//! URL of its choosing. None of them runs, nothing is delivered to the attacker, each refusal
//! is counted by reason, and the node keeps running honest tasks. A rollout planted the same
//! way but sealed with the cluster's key runs: that positive control shows that the planted
//! tasks are refused for their seals, not for their shape.
//!
//! And with the credential an agent host holds (the bus's `publisher` user, deploy's
//! `nats.conf`): a flood of records stops at the records stream's limit, the publisher told
//! so, while the rollout nodes' streams and buckets (another account) and the worker group's
//! buckets (room reserved beside the records) keep working; and a record published into a
//! session whose records another bus user began is dropped by the worker and counted.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_bus::async_nats;
use tokentap_bus::topology::{
    partition_of, record_subject, BusLimits, Topology, LEASES_BUCKET, RECORDS_STREAM,
};
use tokentap_bus::{BusConnect, BusUser};
use tokentap_e2e::nats::{agent_host_user, NatsServer};
use tokentap_e2e::node_api::{
    self, callback_receiver, start_cluster_node, start_serve, TaskKeyFile, TEST_TASK_KEY,
};
use tokentap_e2e::procs::{free_port, http_client, metric_with};
use tokentap_e2e::scripted::{counting_replies, Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::traces::record_ids_in;
use tokentap_e2e::worker::Worker;
use tokentap_rollout::cluster::bus::{
    CALLBACK_SUBJECT, NODES_BUCKET, QUEUE_SUBJECT, ROLLOUTS_BUCKET, SAMPLES_BUCKET,
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

/// A client of a server with roles, as `user`.
async fn connect_as(nats: &NatsServer, user: &str, password: &str) -> async_nats::Client {
    tokentap_bus::connect_now(
        &BusConnect {
            url: nats.url(),
            token: None,
            user: Some(BusUser {
                name: user.into(),
                password: password.into(),
            }),
            ca: None,
        },
        "test",
    )
    .await
    .unwrap_or_else(|e| panic!("connecting as {user}: {e}"))
}

/// The records stream's limit in this test (the default is 40 GB).
const FLOOD_LIMIT: i64 = 4 << 20;

/// The issue's attack, at a test's scale: the publisher's credential publishes records as fast
/// as the server acknowledges them (256 KB ones, then 4 KB and 256 B ones to fill the rest).
/// Without the defence (deploy's `nats.conf` before it, one account for records and rollouts,
/// its JetStream limited to 40 MB here, the records stream without `max_bytes`) the flood
/// filled the account: 39.98 MB stored before the publisher got "resource limits exceeded for
/// account" (10002), and then `POST /v1/rollouts` answered 503 `bus_unavailable` with the
/// same error, the issue's finding at 360 MB (there 10023, a server without account limits).
/// With it the flood stops at the stream's 4 MiB (the
/// publisher gets "maximum bytes exceeded"), and a rollout submitted afterwards runs, the
/// node's heartbeat goes on, and the worker group's buckets still take writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_flood_stops_at_its_stream_limit_and_rollouts_still_run() {
    let dir = tempfile::tempdir().unwrap();
    // The accounts' JetStream limits at a test's scale (64 GB and 24 GB deployed): without the
    // stream's own limit the flood below would fill RECORDS, never CLUSTER.
    let nats = NatsServer::start_with_roles_edited(
        &dir.path().join("nats"),
        vec![
            ("max_file: 64G".into(), "max_file: 40M".into()),
            ("max_file: 24G".into(), "max_file: 40M".into()),
        ],
    )
    .await;
    // The worker group's streams and buckets, with the records stream's limit lowered (every
    // figure from the environment a worker runs in; here given directly).
    let mut limits = BusLimits::default();
    limits.records.max_bytes = FLOOD_LIMIT;
    limits.traces.max_bytes = 4 << 20;
    limits.leases.max_bytes = 1 << 20;
    limits.progress.max_bytes = 4 << 20;
    let worker = connect_as(&nats, "worker", &nats.password("worker")).await;
    let topology = Topology::ensure_with(tokentap_bus::jetstream(worker), 16, &limits)
        .await
        .expect("the worker makes the records topology");

    let key = TaskKeyFile::new();
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let project = dir.path().join("project");
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::create_dir_all(&marks).unwrap();
    std::fs::write(project.join("README"), "a project").unwrap();
    let node_dir = dir.path().join("n1");
    std::fs::create_dir_all(&node_dir).unwrap();
    let port = free_port();
    let mut args = nats.role_args("node");
    args.extend(
        [
            "--node-id",
            "n1",
            "--task-key-file",
            key.arg(),
            "--max-budget-s",
            "600",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _node = start_serve(&node_dir, port, &engine.url, TOKEN, &args).await;
    let base = format!("http://127.0.0.1:{port}");
    let node = connect_as(&nats, "node", &nats.password("node")).await;
    let nodes = tokentap_bus::jetstream(node)
        .get_key_value(NODES_BUCKET)
        .await
        .unwrap();

    // The flood: 256 KB records, each acknowledged, to four times the stream's limit, then
    // smaller ones to fill whatever room is left to the byte, as an attacker would.
    let publisher = connect_as(&nats, "publisher", &nats.password("publisher")).await;
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .api_prefix(tokentap_bus::topology::IMPORTED_API_PREFIX)
        .build(publisher);
    let (mut stored, mut refused, mut sent) = (0i64, Vec::new(), 0u32);
    let started = Instant::now();
    for (size, count) in [(256 * 1024, 160), (4096, 100), (256, 100)] {
        let payload = bytes::Bytes::from(vec![b'x'; size]);
        for _ in 0..count {
            sent += 1;
            let message = async_nats::jetstream::message::PublishMessage::build()
                .payload(payload.clone())
                .message_id(format!("flood-{sent}"));
            let acked = match js
                .send_publish(record_subject("publisher", sent % 16), message)
                .await
            {
                Ok(ack) => ack.await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            match acked {
                Ok(_) => stored += size as i64,
                Err(e) => refused.push(e),
            }
        }
    }
    eprintln!(
        "flood: {stored} bytes stored, {} of {sent} publishes refused, in {:?}; first refusal: {:?}",
        refused.len(),
        started.elapsed(),
        refused.first()
    );
    assert!(
        stored <= FLOOD_LIMIT,
        "the flood stored {stored} bytes, over the stream's {FLOOD_LIMIT}"
    );
    assert!(refused.len() >= 150, "{} refusals", refused.len());
    for e in &refused {
        assert!(
            tokentap_bus::publish::stream_is_full(e),
            "the publisher was not told the stream is full: {e}"
        );
    }
    let mut records = topology.js.get_stream(RECORDS_STREAM).await.unwrap();
    let state = records.info().await.unwrap().state.clone();
    assert!(state.bytes <= FLOOD_LIMIT as u64, "{state:?}");

    // The cluster goes on: a rollout is accepted and runs, the node's heartbeat is renewed,
    // and the worker group's heartbeats (the leases bucket, beside the full records stream)
    // are written.
    let beat = nodes
        .entry("n1")
        .await
        .unwrap()
        .expect("the node's heartbeat");
    let task = task(&project, &marks, "after-flood", "");
    let mut task = task;
    task.as_object_mut().unwrap().remove("callback_url");
    let answer = node_api::submit(&base, TOKEN, &task).await;
    let results = node_api::results_within(&base, TOKEN, 0, 1, 10, Duration::from_secs(120)).await;
    assert_eq!(
        results[0]["outcome"]["status"], "completed",
        "{results:?} {answer}"
    );
    assert!(marks.join("after-flood").exists(), "the sample did not run");
    wait_for(
        "the node's heartbeat was not renewed after the flood",
        Duration::from_secs(30),
        async || {
            nodes
                .entry("n1")
                .await
                .ok()
                .flatten()
                .is_some_and(|e| e.revision > beat.revision)
        },
    )
    .await;
    let leases = topology.js.get_key_value(LEASES_BUCKET).await.unwrap();
    leases
        .put("member.after-flood", "test".into())
        .await
        .expect("the worker group's heartbeat after the flood");
}

const INTRUDER: &str = "intruder";
const INTRUDER_PASSWORD: &str = "e2e-intruder-bus-password";

/// Two agent hosts, each its own bus user (the `publisher` and an `intruder` added the way
/// deploy's `nats.conf` says). The intruder publishes a record into the publisher's session
/// `victim`: under its own name, the only records subject the server lets it publish to (the
/// publisher's is refused, a permission violation), so the worker knows whose it is and drops
/// it, counted in `tokentap_worker_bus_foreign_records_dropped_total`; the victim's traces hold
/// only the publisher's records. The positive control: the same forged record in a session of
/// the intruder's own is reconstructed, so the drop is the ownership's doing, not the record's
/// shape. Without the check (the worker's ownership test removed) the forged record was
/// reconstructed into `victim`'s trace: its record ids were the publisher's and
/// `forged-into-victim`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_forged_into_another_publishers_session_is_dropped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_roles_edited(
        &dir.path().join("nats"),
        vec![agent_host_user(INTRUDER, INTRUDER_PASSWORD)],
    )
    .await;
    let mut w_args = nats.role_args("worker");
    w_args.extend(["--session-idle".into(), "3".into()]);
    let w_args: Vec<&str> = w_args.iter().map(String::as_str).collect();
    let worker = Worker::start(&dir.path().join("out"), &w_args).await;
    let backend = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    let mut config = TokentapConfig::new(&backend.url, "vllm");
    for a in nats.role_args("publisher") {
        config = config.arg(a);
    }
    let proxy = Tokentap::start(config).await;
    let client = http_client();
    proxy
        .chat(
            &client,
            "victim",
            &[json!({"role": "user", "content": "hello"})],
        )
        .await;
    let honest = proxy.wait_records(1).await;
    wait_for(
        "the proxy's record did not reach the bus",
        Duration::from_secs(60),
        async || proxy.metric("tokentap_ship_records_total").await == Some(1.0),
    )
    .await;

    // The intruder: the victim's record, its answer altered, under a new id.
    let intruder = connect_as(&nats, INTRUDER, INTRUDER_PASSWORD).await;
    let js = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(3))
        .api_prefix(tokentap_bus::topology::IMPORTED_API_PREFIX)
        .build(intruder);
    let forge = |session: &str, id: &str| {
        let mut r = serde_json::to_value(&honest[0]).unwrap();
        r["record_id"] = json!(id);
        r["session_id"] = json!(session);
        serde_json::to_vec(&r).unwrap()
    };
    let publish = |subject: String, body: Vec<u8>, id: &'static str| {
        let js = js.clone();
        async move {
            let message = async_nats::jetstream::message::PublishMessage::build()
                .payload(body.into())
                .message_id(id);
            match js.send_publish(subject, message).await {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    let p = partition_of("victim", 16);
    // Under the publisher's name: refused by the server.
    let as_publisher = publish(
        record_subject("publisher", p),
        forge("victim", "forged-as-publisher"),
        "forged-as-publisher",
    )
    .await;
    assert!(
        as_publisher.is_err(),
        "the intruder published as the publisher"
    );
    assert!(
        nats.log()
            .contains(&format!(r#"Publish Violation - User "{INTRUDER}""#)),
        "{}",
        nats.log_tail(20)
    );
    // Under its own name: stored, then dropped by the worker.
    publish(
        record_subject(INTRUDER, p),
        forge("victim", "forged-into-victim"),
        "forged-into-victim",
    )
    .await
    .expect("the intruder's own subject takes its records");
    // The positive control: its own session.
    let own = "intruder-own";
    publish(
        record_subject(INTRUDER, partition_of(own, 16)),
        forge(own, "forged-own"),
        "forged-own",
    )
    .await
    .unwrap();

    let watcher = connect_as(&nats, "worker", &nats.password("worker")).await;
    let topology = Topology::ensure(tokentap_bus::jetstream(watcher), 16)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let traces = loop {
        let traces = tokentap_bus::read::traces_on_the_bus(&topology)
            .await
            .unwrap();
        let sessions: Vec<&str> = traces.iter().map(|t| t.session_id.as_str()).collect();
        if sessions.contains(&"victim") && sessions.contains(&own) {
            break traces;
        }
        assert!(
            Instant::now() < deadline,
            "sessions on the bus: {sessions:?}\n{}",
            worker.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let of = |session: &str| {
        let mine: Vec<_> = traces
            .iter()
            .filter(|t| t.session_id == session)
            .cloned()
            .collect();
        record_ids_in(&mine)
            .into_iter()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        of("victim"),
        vec![honest[0].record_id.clone()],
        "the victim's traces hold a record the publisher never made"
    );
    assert_eq!(of(own), vec!["forged-own".to_owned()], "the control");
    assert_eq!(
        worker
            .metric("tokentap_worker_bus_foreign_records_dropped_total")
            .await,
        Some(1.0)
    );
    assert!(
        worker.log_tail(200).contains("another publisher owns"),
        "{}",
        worker.log_tail(30)
    );
}
