//! Shipping that cannot stall (real `tokentap proxy --ship-to` and real `tokentap worker`
//! processes on loopback, the scripted engine behind the proxy): a 40 MB record, a backlog
//! bigger than the worker's body limit, a record over that limit and a record the worker
//! rejects. Each is delivered or dead-lettered (file and counter), and the records after it
//! keep flowing.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{read_spool, Tokentap, TokentapConfig};
use tokentap_e2e::worker::Worker;
use tokentap_e2e::CaptureRecord;

const TOKEN: &str = "shipping-test-token";

async fn engine() -> ScriptedBackend {
    ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await
}

fn shipping_proxy(engine: &ScriptedBackend, worker: &Worker) -> TokentapConfig {
    TokentapConfig::new(&engine.url, "vllm")
        .arg("--ship-to")
        .arg(&worker.url)
        .arg("--ship-token")
        .arg(TOKEN)
}

/// An Anthropic Messages call whose body carries `pad` bytes the engine never sees
/// (`metadata.user_id`): the record keeps the request as received, so it is that big.
async fn call(proxy: &Tokentap, session: &str, pad: usize) {
    let body = json!({
        "model": "m",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": format!("hello from {session}")}],
        "metadata": {"user_id": "u".repeat(pad)},
    });
    let r = http_client()
        .post(format!("{}/v1/messages", proxy.url))
        .header("x-tokentap-session", session)
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .expect("calling the proxy");
    let status = r.status();
    assert!(
        status.is_success(),
        "{status}: {}",
        r.text().await.unwrap_or_default()
    );
}

/// Waits (bounded) until the worker's spool holds every id in `ids`; returns its records.
async fn wait_delivered(out: &Path, ids: &HashSet<String>, proxy: &Tokentap) -> Vec<CaptureRecord> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let got = read_spool(&out.join("spool"));
        let have: HashSet<&str> = got.iter().map(|r| r.record_id.as_str()).collect();
        if ids.iter().all(|id| have.contains(id.as_str())) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} records delivered; proxy log:\n{}",
            ids.iter().filter(|id| have.contains(id.as_str())).count(),
            ids.len(),
            proxy.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn dead_letters(spool: &Path) -> Vec<Value> {
    std::fs::read_to_string(spool.join("dead-letter.ndjson"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a dead-letter line is JSON"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_40_mb_record_is_delivered_alone_and_later_records_keep_flowing() {
    let engine = engine().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let worker = Worker::start(&out, &["--token", TOKEN]).await;
    let proxy = Tokentap::start(
        shipping_proxy(&engine, &worker)
            .arg("--max-body-bytes")
            .arg((64u64 << 20).to_string()),
    )
    .await;
    call(&proxy, "before-1", 10).await;
    call(&proxy, "before-2", 10).await;
    call(&proxy, "big", 40_000_000).await;
    call(&proxy, "after-1", 10).await;
    call(&proxy, "after-2", 10).await;
    let sent = proxy.wait_records(5).await;
    let ids: HashSet<String> = sent.iter().map(|r| r.record_id.clone()).collect();
    let got = wait_delivered(&out, &ids, &proxy).await;
    let big = got
        .iter()
        .find(|r| r.session_id == "big")
        .expect("the big record");
    assert!(
        big.request.body_bytes > 40_000_000,
        "{}",
        big.request.body_bytes
    );
    // Bigger than the shipper's batches (8 MiB), under the worker's limit: sent alone.
    assert!(dead_letters(&proxy.spool).is_empty());
    assert_eq!(
        proxy.metric("tokentap_ship_dead_letter_total").await,
        Some(0.0)
    );
    assert_eq!(got.len(), 5, "each record once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_over_the_worker_limit_is_split_and_a_record_over_it_is_dead_lettered() {
    // The least limit a worker takes (and a shipper believes).
    const LIMIT: usize = 1 << 20;
    let engine = engine().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let mut worker = Worker::start(
        &out,
        &["--token", TOKEN, "--max-body-bytes", &LIMIT.to_string()],
    )
    .await;
    let proxy = Tokentap::start(shipping_proxy(&engine, &worker)).await;
    // A backlog builds while the worker is down: ten records of ~250 KB, 2.5 MB together,
    // far over the worker's 1 MiB (and under the shipper's own 8 MiB batches).
    worker.kill();
    for i in 0..10 {
        call(&proxy, &format!("backlog-{i}"), 250_000).await;
    }
    // One record the worker can never take, then more that must not wait behind it.
    call(&proxy, "too-big", 2 * LIMIT).await;
    for i in 0..3 {
        call(&proxy, &format!("after-{i}"), 10).await;
    }
    let sent = proxy.wait_records(14).await;
    worker.restart().await;
    let too_big = sent
        .iter()
        .find(|r| r.session_id == "too-big")
        .unwrap()
        .record_id
        .clone();
    let deliverable: HashSet<String> = sent
        .iter()
        .map(|r| r.record_id.clone())
        .filter(|id| *id != too_big)
        .collect();
    let got = wait_delivered(&out, &deliverable, &proxy).await;
    assert_eq!(got.len(), 13, "each deliverable record once");
    assert!(got.iter().all(|r| r.record_id != too_big));

    let dead = dead_letters(&proxy.spool);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["record"]["record_id"], too_big.as_str());
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(reason.contains("limit"), "{reason}");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(proxy.spool.join("dead-letter.ndjson"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(
        proxy.metric("tokentap_ship_dead_letter_total").await,
        Some(1.0)
    );
    assert!(
        proxy.log_tail(400).contains("dead-letter"),
        "the proxy did not say so loudly"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_worker_rejects_lands_in_the_dead_letter_file() {
    use tokentap_reconstruct::synthetic::LongSession;
    use tokentap_spool::{SpoolConfig, SpoolWriter};

    let engine = engine().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let worker = Worker::start(&out, &["--token", TOKEN]).await;
    // The proxy's spool already holds a record from a newer tokentap between two good ones.
    let spool = dir.path().join("spool");
    let mut seeded = LongSession {
        calls: 3,
        first_prompt: 20,
        last_prompt: 40,
        sampled: 4,
        subagent_every: 0,
        subagent_calls: 0,
        subagent_prompt: 0,
    }
    .records("seeded", 7);
    seeded[1].schema_version = 99;
    let rejected = seeded[1].record_id.clone();
    let mut w = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
    w.append_batch(&seeded).unwrap();
    w.sync().unwrap();
    drop(w);

    let mut config = shipping_proxy(&engine, &worker);
    config.spool = Some(spool.clone());
    let proxy = Tokentap::start(config).await;
    call(&proxy, "live-1", 10).await;
    call(&proxy, "live-2", 10).await;
    let sent = proxy.wait_records(5).await;
    let good: HashSet<String> = sent
        .iter()
        .map(|r| r.record_id.clone())
        .filter(|id| *id != rejected)
        .collect();
    let got = wait_delivered(&out, &good, &proxy).await;
    assert_eq!(got.len(), 4);

    let dead = dead_letters(&spool);
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["record"]["record_id"], rejected.as_str());
    assert_eq!(dead[0]["record"]["schema_version"], 99);
    let reason = dead[0]["reason"].as_str().unwrap();
    assert!(reason.contains("schema version"), "{reason}");
    assert_eq!(
        proxy.metric("tokentap_ship_dead_letter_total").await,
        Some(1.0)
    );
    assert_eq!(
        worker.metric("tokentap_worker_rejected_lines_total").await,
        Some(1.0)
    );
}
