//! Roles on the bus: a real nats-server started from deploy/'s `nats.conf` (a user per role,
//! with that role's permissions), attacked with the credential every proxy, sidecar and node
//! agent holds. With only the publisher's user, raw NATS cannot put a task on the sample queue,
//! write the rollouts or samples bucket, make a consumer of the queue, pull the nodes' tasks,
//! delete a stream, nor read the replies meant for other roles: each is refused by the server
//! (a permission violation naming the subject) and nothing of it is on the bus after. The
//! positive controls run the same attempts where they must succeed: every one of them on a
//! server with one token for all (the permissions off), and all but the stream's deletion as
//! the node user. And the roles still do their work under these permissions, without one
//! violation: a `tokentap proxy` (publisher) and a `tokentap worker` (worker) deliver traces,
//! a `tokentap serve --bus` node (node) runs a sample and calls its callback; and a publisher
//! that starts before any worker says loudly what the bus refused it, then publishes once the
//! worker has made the streams.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_bus::async_nats;
use tokentap_bus::async_nats::jetstream::consumer::pull;
use tokentap_bus::topology::{Topology, RECORDS_STREAM};
use tokentap_bus::{BusConnect, BusUser};
use tokentap_e2e::nats::NatsServer;
use tokentap_e2e::node_api::{self, callback_receiver, start_serve, TaskKeyFile};
use tokentap_e2e::procs::{free_port, http_client};
use tokentap_e2e::scripted::{counting_replies, Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::traces::record_ids_in;
use tokentap_e2e::worker::Worker;
use tokentap_rollout::cluster::bus::{
    next_message, ClusterBus, QueueOptions, QUEUE_CONSUMER, QUEUE_STREAM, QUEUE_SUBJECT,
    RESULTS_STREAM, ROLLOUTS_BUCKET, SAMPLES_BUCKET,
};

const BUS_TOKEN: &str = "e2e-bus-roles-token";
const NODE_TOKEN: &str = "e2e-bus-roles-node-token";

/// A raw client and what the server told it (its `-ERR`s, such as permission violations).
struct Raw {
    client: async_nats::Client,
    errors: Arc<Mutex<Vec<String>>>,
}

impl Raw {
    async fn connect(nats: &NatsServer, role: Option<&str>) -> Raw {
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let mut options = async_nats::ConnectOptions::new().event_callback(move |e| {
            let seen = seen.clone();
            async move {
                if let async_nats::Event::ServerError(e) = e {
                    seen.lock().unwrap().push(e.to_string());
                }
            }
        });
        options = match role {
            // As tokentap connects: its inboxes are the user's.
            Some(role) => options
                .user_and_password(role.into(), nats.password(role))
                .custom_inbox_prefix(tokentap_bus::inbox_prefix(role)),
            None => options.token(nats.token.clone()),
        };
        let client = options.connect(nats.url()).await.expect("connecting");
        Raw { client, errors }
    }

    fn js(&self) -> async_nats::jetstream::Context {
        async_nats::jetstream::ContextBuilder::new()
            .timeout(Duration::from_secs(3))
            .build(self.client.clone())
    }

    /// Whether the server refused something naming `subject` (waiting a moment for it).
    async fn violation_for(&self, subject: &str) -> bool {
        for _ in 0..20 {
            if self.errors.lock().unwrap().iter().any(|e| {
                e.to_ascii_lowercase().contains("permissions violation") && e.contains(subject)
            }) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }
}

fn bus_connect(nats: &NatsServer, role: &str) -> BusConnect {
    BusConnect {
        url: nats.url(),
        token: None,
        user: Some(BusUser {
            name: role.into(),
            password: nats.password(role),
        }),
        ca: None,
    }
}

fn queue_options() -> QueueOptions {
    QueueOptions {
        ack_wait: Duration::from_secs(30),
        max_attempts: 3,
        callback_timeout: Duration::from_secs(10),
    }
}

/// One attempt: what it was, the subject the server should name when it refuses it, and how
/// it went.
struct Attempt {
    what: &'static str,
    subject: String,
    result: Result<(), String>,
}

fn task_bytes() -> bytes::Bytes {
    serde_json::to_vec(&json!({"sample_id": "planted-0", "rollout_id": "planted"}))
        .unwrap()
        .into()
}

/// What an attacker holding `raw`'s credential tries, in order.
async fn attack(raw: &Raw) -> Vec<Attempt> {
    let js = raw.js();
    let mut out = Vec::new();
    let publish = |subject: String| {
        let js = js.clone();
        async move {
            match js.publish(subject, task_bytes()).await {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    out.push(Attempt {
        what: "a task onto the sample queue",
        subject: QUEUE_SUBJECT.into(),
        result: publish(QUEUE_SUBJECT.into()).await,
    });
    for (what, bucket) in [
        ("a rollout into the rollouts bucket", ROLLOUTS_BUCKET),
        ("a sample into the samples bucket", SAMPLES_BUCKET),
    ] {
        let subject = format!("$KV.{bucket}.planted");
        out.push(Attempt {
            what,
            result: publish(subject.clone()).await,
            subject,
        });
    }
    // A consumer of its own reading every sample's result (a work queue's stream takes no
    // second consumer beside the nodes', so the queue itself is attacked by deleting theirs).
    let results = js.get_stream_no_info(RESULTS_STREAM).await.unwrap();
    out.push(Attempt {
        what: "a consumer of the results stream",
        subject: format!("CONSUMER.CREATE.{RESULTS_STREAM}"),
        result: results
            .create_consumer(pull::Config {
                durable_name: Some("attacker".into()),
                ..Default::default()
            })
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
    });
    let queue = js.get_stream_no_info(QUEUE_STREAM).await.unwrap();
    out.push(Attempt {
        what: "a task pulled through the nodes' consumer",
        subject: format!("{QUEUE_STREAM}.{QUEUE_CONSUMER}"),
        result: match queue.get_consumer::<pull::Config>(QUEUE_CONSUMER).await {
            Err(e) => Err(e.to_string()),
            Ok(nodes) => match next_message(&nodes).await {
                Some(_) => Ok(()),
                None => Err("nothing pulled".into()),
            },
        },
    });
    // Every reply of every client: other roles' KV reads (rollouts, samples) included.
    let snooping = raw.client.subscribe("_INBOX.>").await;
    out.push(Attempt {
        what: "a subscription to every client's replies",
        subject: "_INBOX.>".into(),
        result: match snooping {
            Err(e) => Err(e.to_string()),
            Ok(_) if raw.violation_for("_INBOX.>").await => Err("refused".into()),
            Ok(_) => Ok(()),
        },
    });
    out.push(Attempt {
        what: "the nodes' consumer of the queue deleted",
        subject: format!("CONSUMER.DELETE.{QUEUE_STREAM}.{QUEUE_CONSUMER}"),
        result: match queue.delete_consumer(QUEUE_CONSUMER).await {
            Ok(r) if r.success => Ok(()),
            Ok(_) => Err("not deleted".into()),
            Err(e) => Err(e.to_string()),
        },
    });
    out.push(Attempt {
        what: "the sample queue's stream deleted",
        subject: format!("STREAM.DELETE.{QUEUE_STREAM}"),
        result: js
            .delete_stream(QUEUE_STREAM)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
    });
    out
}

fn report(attempts: &[Attempt]) -> String {
    attempts
        .iter()
        .map(|a| format!("{}: {:?}", a.what, a.result))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_the_publisher_credential_can_only_publish_records() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_roles(&dir.path().join("nats")).await;
    // The roles make what is theirs: a worker the records stream and its buckets, a node the
    // cluster's streams, buckets and consumers.
    let worker = tokentap_bus::connect_now(&bus_connect(&nats, "worker"), "worker")
        .await
        .unwrap();
    Topology::ensure(tokentap_bus::jetstream(worker), 16)
        .await
        .expect("the worker user makes the records topology");
    let node = tokentap_bus::connect_now(&bus_connect(&nats, "node"), "node")
        .await
        .unwrap();
    let cluster = ClusterBus::open(node, &queue_options())
        .await
        .expect("the node user opens the cluster's bus");

    let publisher = Raw::connect(&nats, Some("publisher")).await;
    // What it may do: publish a record under its own name, acknowledged (its JetStream
    // lookups go through the prefix its account imports; a publish is the import itself).
    publisher
        .js()
        .publish("tokentap.records.publisher.0", "{}".into())
        .await
        .unwrap()
        .await
        .expect("a publisher publishes records");
    // Not under another user's name: a worker attributes a record to the name its subject
    // carries.
    publisher
        .client
        .publish("tokentap.records.node.0", "{}".into())
        .await
        .unwrap();
    publisher.client.flush().await.unwrap();
    assert!(
        publisher.violation_for("tokentap.records.node.0").await,
        "the publisher published under the node's name: {:?}",
        publisher.errors.lock().unwrap()
    );
    // A record whose reply subject is the queue or a bucket: NATS checks no permission on a
    // reply subject and JetStream acknowledges to it. The publisher's account (AGENTS) has
    // no streams; its records reach the cluster's through a service import, so the
    // acknowledgement goes back to that name in AGENTS, where nothing listens (asserted
    // below: the queue and the bucket stay empty; the positive control, one account, is
    // `heavy_without_roles_the_same_attempts_succeed`).
    plant_acks(&publisher).await;
    publisher.client.flush().await.unwrap();

    let attempts = attack(&publisher).await;
    for a in &attempts {
        assert!(
            a.result.is_err(),
            "the publisher got {}\n{}\n{}",
            a.what,
            report(&attempts),
            nats.log_tail(30)
        );
        assert!(
            publisher.violation_for(&a.subject).await,
            "{} was not refused as a permission violation naming {}: {:?}",
            a.what,
            a.subject,
            publisher.errors.lock().unwrap()
        );
    }
    // Nothing of it is on the bus.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut queue = cluster
        .js
        .get_stream(QUEUE_STREAM)
        .await
        .expect("still there");
    let state = queue.info().await.unwrap().state.clone();
    assert_eq!(state.messages, 0, "something reached the sample queue");
    assert!(
        cluster.samples.get("reply").await.unwrap().is_none(),
        "an acknowledgement was written over a sample's key"
    );
    assert!(cluster.rollouts.get("planted").await.unwrap().is_none());
    assert!(cluster.samples.get("planted").await.unwrap().is_none());
    let results = cluster.js.get_stream(RESULTS_STREAM).await.unwrap();
    assert!(
        results.consumer_info("attacker").await.is_err(),
        "the attacker's consumer exists"
    );
    assert!(
        queue.consumer_info(QUEUE_CONSUMER).await.is_ok(),
        "the nodes' consumer is gone"
    );
    let server_log = nats.log();
    assert!(
        server_log.contains(r#"Publish Violation - User "publisher""#),
        "the server logged no violation\n{server_log}"
    );

    // Positive control 1: the node user may do all of it but delete the stream (nobody may).
    let node = Raw::connect(&nats, Some("node")).await;
    let attempts = attack(&node).await;
    for a in &attempts {
        let refused =
            a.what.contains("stream deleted") || a.what.contains("every client's replies");
        assert_eq!(
            a.result.is_err(),
            refused,
            "as the node user, {}\n{}",
            a.what,
            report(&attempts)
        );
    }
    assert!(cluster.rollouts.get("planted").await.unwrap().is_some());
    assert!(results.consumer_info("attacker").await.is_ok());
    assert!(queue.consumer_info(QUEUE_CONSUMER).await.is_err());
}

/// The permissions off (one token for all, one account, as before the roles): a record's
/// acknowledgement lands on the queue and over a bucket key its reply subject names, and
/// every attempt succeeds, so the refusals above are the permissions' and the accounts'
/// doing, not the attempts' shape.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_without_roles_the_same_attempts_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), BUS_TOKEN).await;
    let owner = Raw::connect(&nats, None).await;
    let cluster = ClusterBus::open(owner.client.clone(), &queue_options())
        .await
        .unwrap();
    Topology::ensure(tokentap_bus::jetstream(owner.client.clone()), 16)
        .await
        .unwrap();
    let attacker = Raw::connect(&nats, None).await;
    // In one account the acknowledgement of a record lands where its reply subject says.
    plant_acks(&attacker).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut queue = cluster.js.get_stream(QUEUE_STREAM).await.unwrap();
    assert_eq!(queue.info().await.unwrap().state.messages, 1);
    let ack = cluster
        .samples
        .get("reply")
        .await
        .unwrap()
        .expect("the ack");
    let ack: Value = serde_json::from_slice(&ack).unwrap();
    assert_eq!(ack["stream"], RECORDS_STREAM, "{ack}");
    queue.purge().await.unwrap();
    let attempts = attack(&attacker).await;
    for a in &attempts {
        assert!(a.result.is_ok(), "{}\n{}", a.what, report(&attempts));
    }
    assert!(attacker.errors.lock().unwrap().is_empty());
}

/// Publishes a record with the sample queue, then a key of the samples bucket, as its reply
/// subject: where JetStream's acknowledgement of it would land.
async fn plant_acks(raw: &Raw) {
    for reply in [
        QUEUE_SUBJECT.to_owned(),
        format!("$KV.{SAMPLES_BUCKET}.reply"),
    ] {
        raw.client
            .publish_with_reply(
                "tokentap.records.publisher.1",
                reply,
                "{\"run\":\"rm -rf /\"}".into(),
            )
            .await
            .unwrap();
    }
    raw.client.flush().await.unwrap();
}

/// Permission violations in the server's log by `user`.
fn violations_by(nats: &NatsServer, user: &str) -> Vec<String> {
    nats.log()
        .lines()
        .filter(|l| l.contains("Violation") && l.contains(&format!("User \"{user}\"")))
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_proxy_and_a_worker_deliver_with_their_roles_and_a_refusal_is_loud() {
    const SESSIONS: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_roles(&dir.path().join("nats")).await;
    let backend = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    // The proxy first: the bus has no records stream yet, and a publisher may not make one.
    let mut config = TokentapConfig::new(&backend.url, "vllm");
    for a in nats.role_args("publisher") {
        config = config.arg(a);
    }
    let proxy = Tokentap::start(config).await;
    let client = http_client();
    for s in 0..SESSIONS {
        let id = format!("conv-{s}");
        proxy
            .chat(&client, &id, &[json!({"role": "user", "content": id})])
            .await;
    }
    let records = proxy.wait_records(SESSIONS).await;
    // Through the prefix its account imports the cluster's JetStream API under.
    let refused = format!(
        "{}.STREAM.CREATE.{RECORDS_STREAM}",
        tokentap_bus::topology::IMPORTED_API_PREFIX
    );
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let log = proxy.log_tail(400);
        if log.contains("permission violation") && log.contains(&refused) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the proxy did not say what the bus refused it\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(proxy.metric("tokentap_ship_records_total").await, Some(0.0));

    // The worker makes the streams; the records go out and come back as traces.
    let mut w_args = nats.role_args("worker");
    w_args.extend(["--session-idle".into(), "3".into()]);
    let w_args: Vec<&str> = w_args.iter().map(String::as_str).collect();
    let worker = Worker::start(&dir.path().join("out"), &w_args).await;
    let watcher = tokentap_bus::connect_now(&bus_connect(&nats, "worker"), "test")
        .await
        .unwrap();
    let topology = Topology::ensure(tokentap_bus::jetstream(watcher), 16)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let traces = tokentap_bus::read::traces_on_the_bus(&topology)
            .await
            .expect("reading the traces stream as the worker user");
        if record_ids_in(&traces).len() >= records.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the traces cover {} of {} records\n{}\n{}\n{}",
            record_ids_in(&traces).len(),
            records.len(),
            proxy.log_tail(30),
            worker.log_tail(30),
            nats.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        proxy.metric("tokentap_ship_records_total").await,
        Some(records.len() as f64)
    );
    // What the roles did was all allowed; the publisher's only refusals were the stream's
    // creation, before the worker came.
    assert_eq!(
        violations_by(&nats, "worker"),
        Vec::<String>::new(),
        "the worker's permissions are short"
    );
    for v in violations_by(&nats, "publisher") {
        assert!(v.contains(".STREAM.CREATE."), "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_rollout_node_runs_a_sample_with_the_node_role() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_roles(&dir.path().join("nats")).await;
    let key = TaskKeyFile::new();
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let project = dir.path().join("project");
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&project).unwrap();
    std::fs::create_dir_all(&marks).unwrap();
    std::fs::write(project.join("README"), "a project").unwrap();
    // A worker, so the node's records (it publishes them as a publisher) have their stream.
    let w_args = nats.role_args("worker");
    let w_args: Vec<&str> = w_args.iter().map(String::as_str).collect();
    let worker = Worker::start(&dir.path().join("out"), &w_args).await;
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
    let _node = start_serve(&node_dir, port, &engine.url, NODE_TOKEN, &args).await;
    let base = format!("http://127.0.0.1:{port}");
    let (callback, deliveries) = callback_receiver().await;
    let task = json!({
        "task_id": "roles",
        "instruction": "x",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", format!("touch {}/ran", marks.display())]},
        "evaluator": {"kind": "command", "command": "true"},
        "budgets": {"session_s": 120, "agent_s": 60, "eval_s": 30},
        "callback_url": callback
    });
    node_api::submit(&base, NODE_TOKEN, &task).await;
    let results =
        node_api::results_within(&base, NODE_TOKEN, 0, 1, 10, Duration::from_secs(120)).await;
    assert_eq!(results[0]["outcome"]["status"], "completed", "{results:?}");
    assert!(
        marks.join("ran").exists(),
        "the sample did not run: {results:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while deliveries.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "no callback");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        violations_by(&nats, "node"),
        Vec::<String>::new(),
        "the node's permissions are short"
    );
    assert_eq!(violations_by(&nats, "worker"), Vec::<String>::new());
    drop(worker);
}
