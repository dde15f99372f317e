//! The proxy ships records to a reconstruction worker (`--ship-to`); the worker is killed
//! (SIGKILL) in the middle of the stream and restarted, and so is the proxy (restarted on its
//! spool, so its shipper resumes from its cursor). Nothing may be lost or repeated: the
//! worker's spool holds each of the proxy's records exactly once, and its traces cover each
//! record exactly once, faithfully, with append-only conversations merged.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{read_spool, Tokentap, TokentapConfig};
use tokentap_e2e::traces::{record_ids_in, wait_session_reports};
use tokentap_e2e::worker::Worker;
use tokentap_reconstruct::output::read_traces_jsonl;
use tokentap_reconstruct::{verify, RecordDigest};
use tokentap_schema::SplitCause;

const SESSIONS: usize = 4;
const TURNS: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_and_a_proxy_killed_mid_stream_lose_and_repeat_nothing() {
    let backend = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let mut worker = Worker::start(&out, &["--session-idle", "4"]).await;
    let config = TokentapConfig::new(&backend.url, "vllm")
        .arg("--ship-to")
        .arg(&worker.url);
    let mut proxy = Tokentap::start(config.clone()).await;
    let mut retired = Vec::new();
    let client = http_client();
    let mut conversations: Vec<Vec<Value>> = (0..SESSIONS)
        .map(|s| vec![json!({"role": "user", "content": format!("task {s}")})])
        .collect();
    for turn in 0..TURNS {
        for (s, messages) in conversations.iter_mut().enumerate() {
            let answer = proxy.chat(&client, &format!("conv-{s}"), messages).await;
            messages.push(json!({"role": "assistant", "content": answer}));
            messages.push(json!({"role": "user", "content": format!("go on ({turn})")}));
        }
        if turn == 2 {
            // Let some records reach the worker, then kill it without warning.
            proxy.wait_records(SESSIONS * 3).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            worker.kill();
        }
        if turn == 5 {
            worker.restart().await;
        }
        if turn == 6 {
            // Every answered call is in the spool; then the proxy dies without warning and
            // comes back on the same spool.
            proxy.wait_records(SESSIONS * 7).await;
            let spool = proxy.spool.clone();
            proxy.kill();
            let mut again = config.clone();
            again.spool = Some(spool);
            // The killed proxy's temp dir holds the spool: keep it to the end of the test.
            retired.push(std::mem::replace(&mut proxy, Tokentap::start(again).await));
        }
    }
    let sent = proxy.wait_records(SESSIONS * TURNS).await;
    assert_eq!(sent.len(), SESSIONS * TURNS);

    // Every record reaches the worker's spool exactly once.
    let worker_spool = out.join("spool");
    let deadline = Instant::now() + Duration::from_secs(30);
    let received = loop {
        let r = read_spool(&worker_spool);
        if r.len() >= sent.len() || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let sent_ids: HashSet<&str> = sent.iter().map(|r| r.record_id.as_str()).collect();
    let mut received_ids: Vec<&str> = received.iter().map(|r| r.record_id.as_str()).collect();
    received_ids.sort();
    let unique: HashSet<&str> = received_ids.iter().copied().collect();
    assert_eq!(
        unique.len(),
        received_ids.len(),
        "a record was stored twice"
    );
    assert_eq!(unique, sent_ids, "worker log:\n{}", worker.log_tail(30));

    // Sessions go idle after 4 s; their traces are written then.
    let reports = wait_session_reports(&out, SESSIONS, || worker.log_tail(30)).await;
    assert!(reports.iter().all(|r| r.faithfulness.violations == 0));
    let metric = worker
        .metric("tokentap_worker_sessions_finished_total")
        .await;
    assert!(metric.is_some_and(|m| m >= 1.0), "{metric:?}");
    assert!(
        worker.terminate().await,
        "the worker did not stop on SIGTERM"
    );

    let traces = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
    let trace_ids: HashSet<&str> = traces.iter().map(|t| t.trace_id.as_str()).collect();
    assert_eq!(trace_ids.len(), traces.len(), "a trace was written twice");
    let in_traces = record_ids_in(&traces);
    assert_eq!(in_traces, received_ids, "each record in exactly one trace");
    let digests: HashMap<String, RecordDigest> = sent
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    let f = verify(&traces, &digests);
    assert_eq!(f.violations, 0, "{:?}", f.examples);
    assert_eq!(
        f.trainable_tokens,
        sent.iter()
            .map(|r| r.completion_token_ids.as_ref().unwrap().len() as u64)
            .sum::<u64>(),
        "every sampled token is trainable"
    );
    // Append-only conversations: one trace each, all turns merged.
    for s in 0..SESSIONS {
        let mine: Vec<_> = traces
            .iter()
            .filter(|t| t.session_id == format!("conv-{s}"))
            .collect();
        assert_eq!(
            mine.len(),
            1,
            "conv-{s}: {:?}",
            mine.iter().map(|t| t.started_by).collect::<Vec<_>>()
        );
        assert_eq!(mine[0].calls.len(), TURNS);
        assert_eq!(mine[0].started_by, SplitCause::SessionStart);
    }
}

/// The ingest contract: a batch is acked with what was new, what was a redelivery and what was
/// not a record; `tokentap ship` resumes from its cursor and, without it, resends everything,
/// which the worker drops as duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_acks_new_duplicate_and_rejected_lines_and_ship_resumes() {
    use tokentap_e2e::tokentap::tokentap_cli;
    use tokentap_reconstruct::synthetic::LongSession;
    use tokentap_schema::ndjson::encode_line;
    use tokentap_schema::ship::ShipAck;
    use tokentap_spool::{SpoolConfig, SpoolWriter};

    let dir = tempfile::tempdir().unwrap();
    let worker = Worker::start(&dir.path().join("out"), &["--session-idle", "600"]).await;
    let shape = LongSession {
        calls: 6,
        first_prompt: 50,
        last_prompt: 100,
        sampled: 4,
        subagent_every: 0,
        subagent_calls: 0,
        subagent_prompt: 0,
    };
    let records = shape.records("ingest", 5);
    let mut body = Vec::new();
    for r in &records[..3] {
        encode_line(r, &mut body).unwrap();
    }
    let client = http_client();
    let post = |body: Vec<u8>| {
        let client = client.clone();
        let url = format!("{}/v1/records", worker.url);
        async move {
            let r = client.post(url).body(body).send().await.unwrap();
            assert!(r.status().is_success(), "{}", r.status());
            r.json::<ShipAck>().await.unwrap()
        }
    };
    let first = post(body.clone()).await;
    assert_eq!(
        (first.accepted, first.duplicates, first.rejected),
        (3, 0, 0)
    );
    let mut again = body.clone();
    again.extend_from_slice(b"{\"not\": \"a record\"}\n");
    let second = post(again).await;
    assert_eq!(
        (second.accepted, second.duplicates, second.rejected),
        (0, 3, 1)
    );
    assert!(
        second.errors[0].starts_with("line 4:"),
        "{:?}",
        second.errors
    );
    assert_eq!(
        worker
            .metric("tokentap_worker_duplicates_dropped_total")
            .await,
        Some(3.0)
    );
    assert_eq!(
        worker
            .metric("tokentap_worker_records_received_total")
            .await,
        Some(6.0)
    );

    // `tokentap ship` of a spool holding all six: three new, three already there.
    let spool = dir.path().join("proxy-spool");
    let mut w = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
    w.append_batch(&records).unwrap();
    w.sync().unwrap();
    drop(w);
    let s = spool.to_str().unwrap();
    let ship = tokentap_cli(&["ship", "--spool", s, "--to", &worker.url]).await;
    assert!(ship.success, "{}", ship.stderr);
    assert!(ship.stdout.contains("shipped 3 records"), "{}", ship.stdout);
    assert!(ship.stdout.contains("3 duplicates"), "{}", ship.stdout);
    // From the cursor: nothing left to send.
    let ship = tokentap_cli(&["ship", "--spool", s, "--to", &worker.url]).await;
    assert!(
        ship.stdout.contains("shipped 0 records in 0 batches"),
        "{}",
        ship.stdout
    );
    // Without it: everything again, all of it dropped as duplicates.
    std::fs::remove_file(spool.join("ship-cursor.json")).unwrap();
    let ship = tokentap_cli(&["ship", "--spool", s, "--to", &worker.url]).await;
    assert!(ship.stdout.contains("shipped 0 records"), "{}", ship.stdout);
    assert!(ship.stdout.contains("6 duplicates"), "{}", ship.stdout);
    let stored = read_spool(&dir.path().join("out/spool"));
    assert_eq!(stored.len(), 6);

    // Each record was decoded once, at ingest: reconstruction took all six as ingest had
    // decoded them, not from their spool lines.
    let deadline = Instant::now() + Duration::from_secs(20);
    while worker
        .metric("tokentap_worker_records_reconstructed_total")
        .await
        != Some(6.0)
    {
        assert!(Instant::now() < deadline, "{}", worker.log_tail(20));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        worker
            .metric("tokentap_worker_records_handed_over_total")
            .await,
        Some(6.0)
    );
}

/// A redelivery that certainly happens: the proxy is killed (SIGKILL) after the worker acked
/// its last shipments but before its cursor moved past them — the cursor file is put back to
/// what it was before those shipments, which is exactly what a kill in that window leaves.
/// The restarted proxy resends them; the worker counts every one as a duplicate and stores,
/// reconstructs and traces none of them twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_killed_between_the_workers_ack_and_its_cursor_redelivers_and_nothing_doubles() {
    const FIRST: usize = 4;
    const THEN: usize = 5;
    let backend = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let mut worker = Worker::start(&out, &["--session-idle", "3"]).await;
    let config = TokentapConfig::new(&backend.url, "vllm")
        .arg("--ship-to")
        .arg(&worker.url);
    let mut proxy = Tokentap::start(config.clone()).await;
    let cursor = proxy.spool.join("ship-cursor.json");
    let client = http_client();
    // One append-only conversation: each turn is the last prompt, its answer and a new ask.
    let mut messages = vec![json!({"role": "user", "content": "task"})];
    async fn turn(client: &reqwest::Client, proxy: &Tokentap, messages: &mut Vec<Value>) {
        let answer = proxy.chat(client, "redelivered", messages).await;
        messages.push(json!({"role": "assistant", "content": answer}));
        messages.push(json!({"role": "user", "content": "go on"}));
    }
    for _ in 0..FIRST {
        turn(&client, &proxy, &mut messages).await;
    }
    let before = settled(&proxy, &worker, &cursor, FIRST, FIRST).await;
    for _ in 0..THEN {
        turn(&client, &proxy, &mut messages).await;
    }
    let after = settled(&proxy, &worker, &cursor, FIRST + THEN, FIRST + THEN).await;
    assert_ne!(before, after, "the cursor moved with the acks");

    proxy.kill();
    std::fs::write(&cursor, &before).unwrap();
    let mut again = config.clone();
    again.spool = Some(proxy.spool.clone());
    let _killed = std::mem::replace(&mut proxy, Tokentap::start(again).await);
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker
        .metric("tokentap_worker_duplicates_dropped_total")
        .await
        .unwrap_or(0.0)
        < THEN as f64
    {
        assert!(
            Instant::now() < deadline,
            "the restarted proxy did not redeliver; proxy log:\n{}",
            proxy.log_tail(20)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // One more turn after the restart: new records still flow.
    turn(&client, &proxy, &mut messages).await;
    // The restarted proxy shipped the resent records and the new one.
    settled(&proxy, &worker, &cursor, FIRST + THEN + THEN + 1, THEN + 1).await;
    assert_eq!(
        worker
            .metric("tokentap_worker_duplicates_dropped_total")
            .await,
        Some(THEN as f64),
        "exactly the resent records are duplicates"
    );

    let sent = proxy.wait_records(FIRST + THEN + 1).await;
    let stored = read_spool(&out.join("spool"));
    let stored_ids: Vec<&str> = stored.iter().map(|r| r.record_id.as_str()).collect();
    let sent_ids: Vec<&str> = sent.iter().map(|r| r.record_id.as_str()).collect();
    assert_eq!(stored_ids, sent_ids, "each record stored once, in order");
    wait_session_reports(&out, 1, || worker.log_tail(30)).await;
    assert!(worker.terminate().await, "the worker stops on SIGTERM");
    let traces = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
    let in_traces = record_ids_in(&traces);
    let mut want = sent_ids.clone();
    want.sort_unstable();
    assert_eq!(in_traces, want, "each record in exactly one trace");
    assert_eq!(traces.len(), 1, "one append-only conversation, one trace");
}

/// Records the worker received (redeliveries counted too).
async fn received(worker: &Worker) -> usize {
    tokentap_e2e::procs::metric(&worker.url, "tokentap_worker_records_received_total")
        .await
        .unwrap_or(0.0) as usize
}

/// The shipper's cursor once `want` records reached the worker, `acked` were acknowledged to
/// this proxy process, and the cursor stopped moving (saved past the last ack): polled, never
/// a fixed wait, which a loaded machine outlasts.
async fn settled(
    proxy: &Tokentap,
    worker: &Worker,
    cursor: &std::path::Path,
    want: usize,
    acked: usize,
) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let shipped = || async {
        proxy
            .metric("tokentap_ship_records_total")
            .await
            .unwrap_or(0.0) as usize
    };
    while received(worker).await < want || !cursor.exists() {
        assert!(
            Instant::now() < deadline,
            "{want} records never reached the worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut last = std::fs::read(cursor).unwrap();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = std::fs::read(cursor).unwrap();
        if now == last && shipped().await >= acked {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "the cursor never settled past {want} acknowledged records"
        );
        last = now;
    }
}
