//! Records over a real NATS JetStream (`nats-server -js`, Debian's 2.9.10, on loopback with its
//! store in the test's directory): proxies publish their spools (`--bus`), `tokentap worker
//! --bus` instances split the partitions by lease. A worker joining takes half the partitions
//! from the other (handed back checkpointed), a worker killed with SIGKILL has its partitions
//! taken over, and the traces on the bus equal one offline `tokentap reconstruct` of the same
//! records, each trace once. A bus that is down for 30 s costs the harnesses nothing: the
//! proxies answer, the records wait in their spools and go out when the bus is back.
//!
//! The engine is the scripted backend (a test double: the bus is what is under test here).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_bus::topology::Topology;
use tokentap_bus::BusConnect;
use tokentap_e2e::nats::NatsServer;
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{tokentap_cli, Tokentap, TokentapConfig};
use tokentap_e2e::traces::record_ids_in;
use tokentap_e2e::worker::Worker;
use tokentap_reconstruct::output::read_traces_jsonl;
use tokentap_reconstruct::{verify, RecordDigest};
use tokentap_schema::{CaptureRecord, Trace};

const TOKEN: &str = "bus-test-token-7f3a";

/// Conversations that grow by one turn per call (append-only: one merged trace each).
struct Conversations {
    sessions: Vec<(usize, String, Vec<Value>)>,
}

impl Conversations {
    fn new(proxies: usize, per_proxy: usize) -> Conversations {
        let mut sessions = Vec::new();
        for p in 0..proxies {
            for s in 0..per_proxy {
                let id = format!("p{p}-conv-{s}");
                sessions.push((
                    p,
                    id.clone(),
                    vec![json!({"role": "user", "content": format!("task {id}")})],
                ));
            }
        }
        Conversations { sessions }
    }

    async fn turn(&mut self, client: &reqwest::Client, proxies: &[Tokentap], turn: usize) {
        for (p, id, messages) in self.sessions.iter_mut() {
            let answer = proxies[*p].chat(client, id, messages).await;
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": format!("go on ({turn})")}));
        }
    }
}

fn bus_args(nats: &NatsServer) -> Vec<String> {
    vec![
        "--bus".into(),
        nats.url(),
        "--bus-token".into(),
        nats.token.clone(),
    ]
}

async fn topology(nats: &NatsServer) -> Topology {
    let bus = BusConnect {
        url: nats.url(),
        token: Some(nats.token.clone()),
        user: None,
        ca: None,
    };
    let client = tokentap_bus::connect(&bus, "test")
        .await
        .expect("connecting to the bus");
    Topology::ensure(tokentap_bus::jetstream(client), 16)
        .await
        .expect("the bus's topology")
}

/// Waits (bounded, asserted) until the traces on the bus cover `records` records.
async fn wait_traces_on_bus(t: &Topology, records: usize, log: impl Fn() -> String) -> Vec<Trace> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let traces = tokentap_bus::read::traces_on_the_bus(t)
            .await
            .expect("reading the traces stream");
        let covered = record_ids_in(&traces).len();
        if covered >= records {
            return traces;
        }
        assert!(
            Instant::now() < deadline,
            "the bus's traces cover {covered} of {records} records\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Waits (bounded, asserted) until `worker` holds `n` partitions.
async fn wait_partitions(worker: &Worker, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let owned = worker.metric("tokentap_worker_bus_partitions_owned").await;
        if owned == Some(n) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "worker holds {owned:?} partitions, not {n}\n{}",
            worker.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The offline reconstruction of `records`, one `tokentap reconstruct` over a spool holding
/// them all.
async fn offline(records: &[CaptureRecord], dir: &Path) -> Vec<Trace> {
    use tokentap_spool::{SpoolConfig, SpoolWriter};
    let spool = dir.join("all-records");
    let mut w = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
    w.append_batch(records).unwrap();
    w.sync().unwrap();
    drop(w);
    let out = dir.join("offline");
    let cli = tokentap_cli(&[
        "reconstruct",
        "--spool",
        spool.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
    .await;
    assert!(cli.success, "{}", cli.stderr);
    read_traces_jsonl(&out.join("traces.jsonl")).unwrap()
}

/// What training reads from a trace: prompt ids, response ids, loss mask, logprobs.
type Trainable = (Vec<u32>, Vec<u32>, Vec<u8>, Vec<f32>);

/// Trace id → what training reads from it.
fn by_id(traces: &[Trace]) -> BTreeMap<String, Trainable> {
    traces
        .iter()
        .map(|t| {
            (
                t.trace_id.clone(),
                (
                    t.prompt_ids.clone(),
                    t.response_ids.clone(),
                    t.loss_mask.clone(),
                    t.logprobs.clone(),
                ),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_three_proxies_and_a_worker_group_over_jetstream_match_an_offline_reconstruction_through_a_join_and_a_kill(
) {
    const PROXIES: usize = 3;
    const PER_PROXY: usize = 4;
    const TURNS: usize = 6;
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), TOKEN).await;
    let backend = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    let mut proxies = Vec::new();
    for _ in 0..PROXIES {
        let mut config = TokentapConfig::new(&backend.url, "vllm");
        for a in bus_args(&nats) {
            config = config.arg(a);
        }
        proxies.push(Tokentap::start(config).await);
    }
    let worker_args = |member: &str| {
        let mut a = bus_args(&nats);
        a.extend([
            "--member-id".into(),
            member.into(),
            // Well above the longest gap between two turns of a session here (the 3 s pause
            // before the kill, and the takeover itself), so that only the end of the
            // conversations ends a session, as in the offline reconstruction.
            "--session-idle".into(),
            "10".into(),
        ]);
        a
    };
    let a_args = worker_args("worker-a");
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let mut worker_a = Worker::start(&dir.path().join("out-a"), &a_args).await;
    wait_partitions(&worker_a, 16.0).await;

    let client = http_client();
    let mut conversations = Conversations::new(PROXIES, PER_PROXY);
    conversations.turn(&client, &proxies, 0).await;
    conversations.turn(&client, &proxies, 1).await;

    // A second worker joins with sessions open: the first hands half its partitions back
    // (checkpointed), the second resumes them from their checkpoints.
    let b_args = worker_args("worker-b");
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let mut worker_b = Worker::start(&dir.path().join("out-b"), &b_args).await;
    wait_partitions(&worker_b, 8.0).await;
    wait_partitions(&worker_a, 8.0).await;
    conversations.turn(&client, &proxies, 2).await;
    conversations.turn(&client, &proxies, 3).await;
    // Let the second worker read and checkpoint some of them, then kill it without warning.
    tokio::time::sleep(Duration::from_secs(3)).await;
    worker_b.kill();
    let killed_at = Instant::now();
    for turn in 4..TURNS {
        conversations.turn(&client, &proxies, turn).await;
    }
    wait_partitions(&worker_a, 16.0).await;
    let takeover = killed_at.elapsed();
    eprintln!(
        "the killed worker's partitions were all running again on the other after {takeover:?}"
    );
    assert!(
        takeover < Duration::from_secs(15),
        "takeover took {takeover:?}"
    );

    let mut records = Vec::new();
    for p in &proxies {
        records.extend(p.wait_records(PER_PROXY * TURNS).await);
    }
    assert_eq!(records.len(), PROXIES * PER_PROXY * TURNS);
    let t = topology(&nats).await;
    let on_bus = wait_traces_on_bus(&t, records.len(), || worker_a.log_tail(40)).await;

    // Each trace once on the bus; each record in exactly one trace; all faithful.
    let ids: HashSet<&str> = on_bus.iter().map(|t| t.trace_id.as_str()).collect();
    assert_eq!(ids.len(), on_bus.len(), "a trace is on the bus twice");
    let mut sent: Vec<&str> = records.iter().map(|r| r.record_id.as_str()).collect();
    sent.sort();
    assert_eq!(
        record_ids_in(&on_bus),
        sent,
        "each record in exactly one trace"
    );
    let digests = records
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    let f = verify(&on_bus, &digests);
    assert_eq!(f.violations, 0, "{:?}", f.examples);

    // The same traces as one offline reconstruction of all the proxies' records: ids, tokens,
    // masks and logprobs.
    let offline = offline(&records, dir.path()).await;
    assert_eq!(
        offline.len(),
        PROXIES * PER_PROXY,
        "append-only conversations: one trace each"
    );
    let (bus_ids, offline_ids): (Vec<_>, Vec<_>) = (
        by_id(&on_bus).into_keys().collect(),
        by_id(&offline).into_keys().collect(),
    );
    assert_eq!(bus_ids, offline_ids);
    assert!(
        by_id(&on_bus) == by_id(&offline),
        "the bus's traces differ from the offline ones in tokens, masks or logprobs"
    );

    // The workers' own files (flushed when the survivor stops): each trace once across both.
    let taken = worker_a
        .metric("tokentap_worker_bus_partitions_taken_total")
        .await;
    assert!(
        taken.is_some_and(|n| n >= 24.0),
        "16 at start, 8 back after the kill: {taken:?}"
    );
    assert!(
        worker_a.terminate().await,
        "the worker did not stop on SIGTERM"
    );
    let mut written = Vec::new();
    for out in ["out-a", "out-b"] {
        let path = dir.path().join(out).join("traces.jsonl");
        if path.exists() {
            written.extend(read_traces_jsonl(&path).unwrap());
        }
    }
    let written_ids: Vec<&str> = written.iter().map(|t| t.trace_id.as_str()).collect();
    assert_eq!(
        written_ids.len(),
        offline.len(),
        "the workers' files hold each trace once: {written_ids:?}"
    );
    assert!(
        by_id(&written) == by_id(&offline),
        "the workers' files differ from the offline traces"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_bus_down_for_30_seconds_costs_the_harnesses_nothing_and_the_backlog_goes_out_after(
) {
    const SESSIONS: usize = 3;
    let dir = tempfile::tempdir().unwrap();
    let mut nats = NatsServer::start(&dir.path().join("nats"), TOKEN).await;
    let backend = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    let mut config = TokentapConfig::new(&backend.url, "vllm");
    for a in bus_args(&nats) {
        config = config.arg(a);
    }
    let proxy = Tokentap::start(config).await;
    let mut w_args = bus_args(&nats);
    w_args.extend(["--session-idle".into(), "4".into()]);
    let w_args: Vec<&str> = w_args.iter().map(String::as_str).collect();
    let worker = Worker::start(&dir.path().join("out"), &w_args).await;
    let client = http_client();
    let mut conversations = Conversations::new(1, SESSIONS);
    let proxies = [proxy];
    conversations.turn(&client, &proxies, 0).await;
    let proxy = &proxies[0];
    let before = proxy.wait_records(SESSIONS).await.len();
    let deadline = Instant::now() + Duration::from_secs(20);
    while proxy.metric("tokentap_ship_records_total").await < Some(before as f64) {
        assert!(
            Instant::now() < deadline,
            "the first records were not published\n{}",
            proxy.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    nats.stop().await;
    let down = Instant::now();
    let mut turn = 1;
    while down.elapsed() < Duration::from_secs(30) {
        // Every call is answered while the bus is down.
        conversations.turn(&client, &proxies, turn).await;
        turn += 1;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let all = proxy.wait_records(SESSIONS * turn).await;
    assert!(all.len() > before);
    let backlog = proxy.metric("tokentap_ship_backlog_bytes").await;
    assert!(
        backlog.is_some_and(|b| b > 0.0),
        "records wait in the spool: {backlog:?}"
    );
    nats.restart().await;

    let t = topology(&nats).await;
    let on_bus = wait_traces_on_bus(&t, all.len(), || {
        format!("{}\n{}", worker.log_tail(30), proxy.log_tail(30))
    })
    .await;
    let mut sent: Vec<&str> = all.iter().map(|r| r.record_id.as_str()).collect();
    sent.sort();
    assert_eq!(
        record_ids_in(&on_bus),
        sent,
        "each record in exactly one trace, none lost"
    );
    let digests = all
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    assert_eq!(verify(&on_bus, &digests).violations, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.metric("tokentap_ship_backlog_bytes").await != Some(0.0) {
        assert!(
            Instant::now() < deadline,
            "the backlog gauge did not return to 0"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The bus requires its token: a client without it (an agent that found the bus's address)
/// can neither publish records nor join the worker group. And a group member's /metrics
/// requires the member's own token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_the_bus_refuses_clients_without_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), TOKEN).await;
    for token in [None, Some("guess")] {
        let mut options = tokentap_bus::async_nats::ConnectOptions::new();
        if let Some(t) = token {
            options = options.token(t.into());
        }
        let refused = options.connect(nats.url()).await;
        assert!(refused.is_err(), "connected with {token:?}");
    }
    // A group member's own listener names the group's progress in /metrics: its token first.
    let mut args = bus_args(&nats);
    args.extend(["--token".into(), "worker-metrics-token".into()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = Worker::start(&dir.path().join("out"), &args).await;
    let client = http_client();
    for token in [None, Some("guess")] {
        let mut get = client.get(format!("{}/metrics", worker.url));
        if let Some(t) = token {
            get = get.bearer_auth(t);
        }
        assert_eq!(get.send().await.unwrap().status(), 401, "{token:?}");
    }
    assert!(worker
        .metric("tokentap_worker_bus_partitions_owned")
        .await
        .is_some());

    // The same against deploy's own server configuration (a user per role): no credential,
    // a token, a wrong password for each role and a role's password under another name are
    // refused; each role's own password connects (the positive control).
    let deployed = NatsServer::start_with_roles(&dir.path().join("nats-roles")).await;
    let refused = |options: tokentap_bus::async_nats::ConnectOptions| {
        let url = deployed.url();
        async move { options.connect(url).await.is_err() }
    };
    use tokentap_bus::async_nats::ConnectOptions;
    assert!(refused(ConnectOptions::new()).await, "no credential");
    assert!(
        refused(ConnectOptions::new().token(TOKEN.into())).await,
        "a token"
    );
    for (i, role) in tokentap_e2e::nats::ROLES.iter().enumerate() {
        let other = tokentap_e2e::nats::ROLES[(i + 1) % tokentap_e2e::nats::ROLES.len()];
        assert!(
            refused(ConnectOptions::new().user_and_password((*role).into(), "guess".into())).await,
            "{role} with a guessed password"
        );
        assert!(
            refused(
                ConnectOptions::new().user_and_password((*role).into(), deployed.password(other))
            )
            .await,
            "{role} with {other}'s password"
        );
        assert!(
            !refused(
                ConnectOptions::new().user_and_password((*role).into(), deployed.password(role))
            )
            .await,
            "{role} with its own password"
        );
    }
}

/// A spool with a backlog larger than the publisher's window (256 unacknowledged) is published
/// whole when the publisher is told to drain (a proxy stopping with a backlog), and a second
/// publish of the same spool from scratch stores nothing twice (record id as message id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_a_drained_publisher_sends_its_whole_backlog_and_a_republish_stores_nothing_twice() {
    use std::sync::atomic::AtomicBool;
    use tokentap_bus::publish::{publish_spool, PublishStop, CURSOR_FILE};
    use tokentap_reconstruct::synthetic::LongSession;
    use tokentap_spool::downstream::DownstreamMetrics;
    use tokentap_spool::{SpoolConfig, SpoolWriter};

    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start(&dir.path().join("nats"), TOKEN).await;
    let spool = dir.path().join("spool");
    let mut w = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
    let shape = LongSession {
        calls: 100,
        first_prompt: 20,
        last_prompt: 40,
        sampled: 4,
        subagent_every: 0,
        subagent_calls: 0,
        subagent_prompt: 0,
    };
    let mut written = 0;
    for s in 0..7 {
        let records = shape.records(&format!("backlog-{s}"), s + 1);
        written += records.len() as u64;
        w.append_batch(&records).unwrap();
    }
    w.sync().unwrap();
    drop(w);
    let bus = BusConnect {
        url: nats.url(),
        token: Some(nats.token.clone()),
        user: None,
        ca: None,
    };
    let stop = PublishStop {
        drain: Arc::new(AtomicBool::new(true)),
        drain_deadline: Duration::from_secs(30),
    };
    let first = publish_spool(&spool, &bus, 16, &stop, DownstreamMetrics::unregistered())
        .await
        .unwrap();
    assert_eq!((first.records, first.duplicates), (written, 0), "{first:?}");
    let t = topology(&nats).await;
    let mut records = t.records.clone();
    assert_eq!(records.info().await.unwrap().state.messages, written);

    // The cursor gone (a new disk, a restored backup): everything is sent again, and the
    // stream keeps one copy of each.
    std::fs::remove_file(spool.join(CURSOR_FILE)).unwrap();
    let again = publish_spool(&spool, &bus, 16, &stop, DownstreamMetrics::unregistered())
        .await
        .unwrap();
    assert_eq!(
        (again.records, again.duplicates),
        (written, written),
        "{again:?}"
    );
    assert_eq!(records.info().await.unwrap().state.messages, written);
}

/// A server with less JetStream storage than the defaults reserve (the 2 GB here; a development
/// server keeps 75% of its disk's free space) still gets every stream and bucket, the two large
/// streams without a `max_bytes` of their own (bounded by the server's limit), and a second
/// worker starts on them too. The
/// control: a size the operator set (`TOKENTAP_BUS_RECORDS_MAX_BYTES=40G`) is never shrunk,
/// and the start fails saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_the_default_limits_fit_a_server_with_little_storage() {
    use tokentap_bus::topology::BusLimits;
    let dir = tempfile::tempdir().unwrap();
    let nats = NatsServer::start_with_file_store(&dir.path().join("nats"), TOKEN, "2GB").await;
    let connect = |server: &NatsServer| {
        let bus = BusConnect {
            url: server.url(),
            token: Some(TOKEN.into()),
            user: None,
            ca: None,
        };
        async move {
            let client = tokentap_bus::connect(&bus, "test").await.unwrap();
            tokentap_bus::jetstream(client)
        }
    };
    let t = Topology::ensure_with(connect(&nats).await, 16, &BusLimits::default())
        .await
        .expect("the defaults fit the server");
    let (records, traces) = (
        t.records.cached_info().config.max_bytes,
        t.traces.cached_info().config.max_bytes,
    );
    eprintln!("fitted: records {records} B, traces {traces} B");
    assert_eq!((records, traces), (-1, -1));
    let again = Topology::ensure_with(connect(&nats).await, 16, &BusLimits::default())
        .await
        .expect("a second worker starts on them");
    assert_eq!(again.records.cached_info().config.max_bytes, -1);

    let set = BusLimits::from_vars(|name| {
        (name == "TOKENTAP_BUS_RECORDS_MAX_BYTES").then(|| "40G".to_owned())
    })
    .unwrap();
    let other = NatsServer::start_with_file_store(&dir.path().join("nats2"), TOKEN, "2GB").await;
    let refused = Topology::ensure_with(connect(&other).await, 16, &set)
        .await
        .err()
        .expect("a size the operator set is not dropped");
    assert!(
        refused
            .to_string()
            .contains("TOKENTAP_BUS_RECORDS_MAX_BYTES"),
        "{refused}"
    );
}
