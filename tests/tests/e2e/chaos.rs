//! Chaos under load: harness-shaped sessions call through `tokentap proxy --ship-to worker` at a
//! steady rate while the proxy is killed (SIGKILL) twice and restarted on its spool, and the
//! worker is stopped (SIGSTOP) for 60 s — with a shipment in flight to it when the proxy dies
//! the second time. Afterwards every call a harness saw answered has exactly one record at the
//! worker, appears in exactly one trace, and the traces are faithful.
//!
//! A second test kills a rollout node (`tokentap serve`) in each stage of its samples.
//!
//! A harness retries a call that failed (its proxy died under it) with the same conversation,
//! as real ones do; each attempt carries its own `x-chaos-attempt` header, which the record
//! keeps, so the test can tell which attempt the harness saw answered.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::node_api::{self, callback_receiver};
use tokentap_e2e::procs::{http_client, ChildGuard};
use tokentap_e2e::scripted::{
    counting_replies, curl_agent, Reply, Script, ScriptedBackend, Tokens,
};
use tokentap_e2e::sse::parse_chat_stream;
use tokentap_e2e::tokentap::{read_spool, Tokentap, TokentapConfig};
use tokentap_e2e::traces::{record_ids_in, wait_session_reports};
use tokentap_e2e::worker::Worker;
use tokentap_reconstruct::output::read_traces_jsonl;
use tokentap_reconstruct::{verify, RecordDigest};

/// Concurrent harness sessions; half stream their answers.
const HARNESSES: usize = 8;
/// Turns of one conversation before its harness starts a new one (a new session).
const TURNS: usize = 10;
/// Each harness's pause between calls (its tools' time): about 8 × 6 = 48 calls/s in all.
const THINK: Duration = Duration::from_millis(150);
/// How long the worker is stopped.
const WORKER_STOPPED: Duration = Duration::from_secs(60);

/// What one harness saw: the attempts it saw answered, and how many attempts failed.
#[derive(Default)]
struct Seen {
    answered: Vec<String>,
    failed: u64,
}

/// One call; the answer's text if the harness got all of it.
async fn call(
    client: &reqwest::Client,
    url: &str,
    session: &str,
    attempt: &str,
    messages: &[Value],
    stream: bool,
) -> Result<String, String> {
    let r = client
        .post(format!("{url}/v1/chat/completions"))
        .header("x-tokentap-session", session)
        .header("x-chaos-attempt", attempt)
        .timeout(Duration::from_secs(20))
        .json(&json!({"model": "m", "messages": messages, "max_tokens": 64, "stream": stream}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !r.status().is_success() {
        return Err(format!("status {}", r.status()));
    }
    let body = r.text().await.map_err(|e| e.to_string())?;
    if stream {
        let s = parse_chat_stream(&body);
        if !s.done || !s.errors.is_empty() || s.finish_reason.is_none() {
            return Err(format!("incomplete stream: {body}"));
        }
        Ok(s.content)
    } else {
        let v: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
        v["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| format!("no answer in {body}"))
    }
}

/// A harness: conversations of [`TURNS`] calls, each call retried until answered, until `stop`.
async fn harness(h: usize, url: Arc<RwLock<String>>, stop: Arc<AtomicBool>) -> Seen {
    let client = http_client();
    let mut seen = Seen::default();
    for conversation in 0.. {
        let session = format!("chaos-{h}-{conversation}");
        let mut messages =
            vec![json!({"role": "user", "content": format!("task {h}.{conversation}")})];
        for turn in 0..TURNS {
            for attempt in 0.. {
                if stop.load(Ordering::Relaxed) {
                    return seen;
                }
                let key = format!("{session}/{turn}/{attempt}");
                let base = url.read().unwrap().clone();
                match call(
                    &client,
                    &base,
                    &session,
                    &key,
                    &messages,
                    h.is_multiple_of(2),
                )
                .await
                {
                    Ok(answer) => {
                        seen.answered.push(key);
                        messages.push(json!({"role": "assistant", "content": answer}));
                        messages
                            .push(json!({"role": "user", "content": format!("go on ({turn})")}));
                        break;
                    }
                    Err(_) => {
                        seen.failed += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            tokio::time::sleep(THINK).await;
        }
    }
    seen
}

/// The first message of the call [`kill_and_restart`] holds open at the engine.
const HELD: &str = "held across the kill";

/// [`counting_replies`], except that the engine never answers a call whose first message is
/// [`HELD`]: the one call certain to be in flight when the proxy dies.
fn counting_replies_holding_one() -> Script {
    let counting = counting_replies();
    Arc::new(move |req, i| {
        if req["messages"][0]["content"] == HELD {
            Reply::Hang
        } else {
            counting(req, i)
        }
    })
}

/// SIGKILL, then a new proxy on the same spool; harnesses call the new one from then on.
/// Whether a harness's call happens to be in flight at that instant is chance (they spend most
/// of their time thinking), so the kill lands while a held call is certainly in flight, and
/// that call must fail: the kill is seen to cut calls mid-way.
async fn kill_and_restart(
    proxy: &mut Tokentap,
    retired: &mut Vec<Tokentap>,
    backend: &ScriptedBackend,
    config: &TokentapConfig,
    spool: &std::path::Path,
    url: &RwLock<String>,
) {
    let held_before = held_calls(backend);
    // No client timeout: without the kill this call would wait for ever.
    let held = tokio::spawn({
        let (client, base) = (http_client(), proxy.url.clone());
        async move {
            let body = json!({"model": "m", "messages": [{"role": "user", "content": HELD}], "stream": true});
            let r = client
                .post(format!("{base}/v1/chat/completions"))
                .json(&body)
                .send()
                .await?;
            r.text().await
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while held_calls(backend) == held_before {
        assert!(
            Instant::now() < deadline,
            "the held call reached the engine"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.kill();
    let outcome = tokio::time::timeout(Duration::from_secs(60), held)
        .await
        .expect("the held call ends when its proxy dies")
        .unwrap();
    assert!(
        outcome.is_err(),
        "a call in flight when the proxy is killed fails: {outcome:?}"
    );
    let mut again = config.clone();
    again.spool = Some(spool.to_owned());
    let fresh = Tokentap::start(again).await;
    *url.write().unwrap() = fresh.url.clone();
    retired.push(std::mem::replace(proxy, fresh));
}

/// How many held calls the engine has received.
fn held_calls(backend: &ScriptedBackend) -> usize {
    backend
        .requests()
        .iter()
        .filter(|r| r["messages"][0]["content"] == HELD)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_chaos_a_killed_proxy_and_a_stopped_worker_lose_no_answered_call() {
    let backend = ScriptedBackend::start(Tokens::FakeChat, counting_replies_holding_one()).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let mut worker = Worker::start(&out, &["--session-idle", "3"]).await;
    let config = TokentapConfig::new(&backend.url, "vllm")
        .arg("--ship-to")
        .arg(&worker.url)
        .arg("--fsync")
        .arg("always");
    let mut proxy = Tokentap::start(config.clone()).await;
    let spool = proxy.spool.clone();
    let url = Arc::new(RwLock::new(proxy.url.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let harnesses: Vec<_> = (0..HARNESSES)
        .map(|h| tokio::spawn(harness(h, url.clone(), stop.clone())))
        .collect();
    // Killed proxies' temp dirs (the spool lives in the first one) stay to the end.
    let mut retired = Vec::new();
    tokio::time::sleep(Duration::from_secs(4)).await;
    kill_and_restart(&mut proxy, &mut retired, &backend, &config, &spool, &url).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    worker.pause();
    let stopped_at = Instant::now();
    // Halfway through the stop, the proxy dies with a shipment sent to the stopped worker.
    tokio::time::sleep(WORKER_STOPPED / 2).await;
    let before_second_kill = read_spool(&spool).len();
    kill_and_restart(&mut proxy, &mut retired, &backend, &config, &spool, &url).await;
    tokio::time::sleep(WORKER_STOPPED.saturating_sub(stopped_at.elapsed())).await;
    worker.resume();
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let mut answered = Vec::new();
    let mut failed = 0;
    for h in harnesses {
        let seen = h.await.unwrap();
        answered.extend(seen.answered);
        failed += seen.failed;
    }
    let sent = read_spool(&spool);
    eprintln!(
        "{} calls answered, {failed} failed attempts (retried), {} records spooled ({before_second_kill} before the second kill), 2 proxy restarts",
        answered.len(),
        sent.len(),
    );
    assert!(
        answered.len() > 1000,
        "the load ran ({} calls answered)",
        answered.len()
    );

    // Every record the proxy wrote reaches the worker exactly once.
    let deadline = Instant::now() + Duration::from_secs(60);
    let received = loop {
        let r = read_spool(&out.join("spool"));
        if r.len() >= sent.len() || Instant::now() > deadline {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut received_ids: Vec<&str> = received.iter().map(|r| r.record_id.as_str()).collect();
    received_ids.sort_unstable();
    let unique: HashSet<&str> = received_ids.iter().copied().collect();
    assert_eq!(unique.len(), received_ids.len(), "a record stored twice");
    let sent_ids: HashSet<&str> = sent.iter().map(|r| r.record_id.as_str()).collect();
    assert_eq!(
        unique,
        sent_ids,
        "the worker's records are the proxy's\nproxy log:\n{}\nworker log:\n{}",
        proxy.log_tail(20),
        worker.log_tail(20)
    );

    // Every answered call: exactly one record, a complete one.
    let by_attempt: HashMap<&str, Vec<_>> = received.iter().fold(HashMap::new(), |mut m, r| {
        if let Some(a) = r.request.headers.get("x-chaos-attempt") {
            m.entry(a.as_str()).or_insert_with(Vec::new).push(r);
        }
        m
    });
    let mut lost = Vec::new();
    for key in &answered {
        match by_attempt.get(key.as_str()).map(Vec::as_slice) {
            Some([r]) => {
                assert_eq!(r.response_status, 200, "{key}: {:?}", r.error);
                assert!(r.error.is_none(), "{key}: {:?}", r.error);
                assert!(r.completion_token_ids.is_some(), "{key}: token ids");
            }
            Some(many) => panic!("{key}: {} records", many.len()),
            None => lost.push(key.clone()),
        }
    }
    assert!(
        lost.is_empty(),
        "{} answered calls without a record, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    let duplicates = worker
        .metric("tokentap_worker_duplicates_dropped_total")
        .await
        .unwrap_or(0.0);
    eprintln!("the worker dropped {duplicates} redelivered records");

    // Traces: every record with token data in exactly one trace, faithfully.
    let sessions: HashSet<&str> = received.iter().map(|r| r.session_id.as_str()).collect();
    wait_session_reports(&out, sessions.len(), || worker.log_tail(30)).await;
    assert!(worker.terminate().await, "the worker stops on SIGTERM");
    let traces = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
    let in_traces = record_ids_in(&traces);
    let mut with_tokens: Vec<&str> = received
        .iter()
        .filter(|r| r.prompt_token_ids.is_some())
        .map(|r| r.record_id.as_str())
        .collect();
    with_tokens.sort_unstable();
    assert_eq!(in_traces, with_tokens, "each record in exactly one trace");
    let digests: HashMap<String, RecordDigest> = received
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    let f = verify(&traces, &digests);
    assert_eq!(f.violations, 0, "{:?}", f.examples);
    drop(retired);
}

/// Why a kill -9 cannot lose an answered call under `--fsync always`: the moment a harness
/// has its whole answer, streamed or not, in any wire API, the record is already in the spool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fsync_always_an_answer_never_arrives_before_its_record() {
    let backend = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let config = TokentapConfig::new(&backend.url, "vllm")
        .arg("--fsync")
        .arg("always");
    let proxy = Tokentap::start(config).await;
    let client = http_client();
    let messages = [json!({"role": "user", "content": "hello"})];
    for i in 0..40 {
        let key = format!("durable/{i}");
        let answer = call(&client, &proxy.url, "durable", &key, &messages, i % 2 == 0).await;
        assert!(answer.is_ok(), "{answer:?}");
        // Read at once: no waiting for the spool writer.
        let records = read_spool(&proxy.spool);
        let mine: Vec<_> = records
            .iter()
            .filter(|r| r.request.headers.get("x-chaos-attempt") == Some(&key))
            .collect();
        assert_eq!(
            mine.len(),
            1,
            "call {i}: the record is on disk when the answer is"
        );
        assert_eq!(mine[0].response_status, 200);
        assert!(mine[0].completion_token_ids.is_some());
    }
    for (api, path, body) in [
        (
            "Messages",
            "/v1/messages",
            json!({"model": "m", "max_tokens": 32, "stream": true,
                   "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "Responses",
            "/v1/responses",
            json!({"model": "m", "stream": true, "input": "hi"}),
        ),
    ] {
        let before = read_spool(&proxy.spool).len();
        let r = client
            .post(format!("{}{path}", proxy.url))
            .header("x-tokentap-session", "durable")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{api}: {}", r.status());
        r.text().await.unwrap();
        assert_eq!(read_spool(&proxy.spool).len(), before + 1, "{api}");
    }
}

const NODE_TOKEN: &str = "chaos-node-token";

/// `tokentap serve` on `port` with its data under `dir/node`.
async fn start_node(dir: &std::path::Path, port: u16, engine: &str) -> ChildGuard {
    // Three kills below, each may interrupt the same sample: one attempt more than that (at
    // the default of 3, a sample whose every attempt a restart cut short fails, so a sample
    // that crashes its node cannot crash it forever).
    node_api::start_serve(dir, port, engine, NODE_TOKEN, &["--max-attempts", "4"]).await
}

/// The stages of a rollout's samples now.
async fn stages(base: &str, rollout: &str) -> Vec<String> {
    let v = node_api::get_json(&format!("{base}/v1/rollouts/{rollout}"), NODE_TOKEN).await;
    v["samples"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|s| s["stage"].as_str().unwrap_or_default().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A node is killed (SIGKILL) while its samples are in each stage in turn — setting up the
/// workspace, running the agent, evaluating — and restarted on its data each time. Every
/// accepted sample ends exactly once in the results, completed, the interrupted ones on a
/// later attempt; every sample's callback
/// arrives, each delivery of a sample carries the same result, and the trainer, deduplicating
/// by `Idempotency-Key` as the API documents, sees each sample once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_chaos_a_node_killed_in_every_stage_finishes_each_sample_once() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    let (callback, deliveries) = callback_receiver().await;
    let port = tokentap_e2e::procs::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut node = start_node(dir.path(), port, &engine.url).await;
    const SAMPLES: usize = 6;
    let task = json!({
        "task_id": "chaos",
        "instruction": "chat",
        "workspace": {"dir": {"path": dir.path().join("project"), "setup": "sleep 1"}},
        "harness": {"name": "command", "argv": ["sh", "-c", curl_agent(2, "sleep 1")]},
        "evaluator": {"kind": "command", "command": "sleep 1"},
        "num_samples": SAMPLES,
        "callback_url": callback,
    });
    let r = http_client()
        .post(format!("{base}/v1/rollouts"))
        .bearer_auth(NODE_TOKEN)
        .json(&task)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let accepted: Value = r.json().await.unwrap();
    let rollout = accepted["rollout_id"].as_str().unwrap().to_owned();
    let mut killed_in = Vec::new();
    for stage in ["init", "run", "post_run"] {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let now = stages(&base, &rollout).await;
            if now.iter().any(|s| s == stage) {
                killed_in.push(now);
                break;
            }
            assert!(
                Instant::now() < deadline,
                "no sample reached {stage}: {now:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        node.kill();
        node = start_node(dir.path(), port, &engine.url).await;
    }
    let results =
        node_api::results_within(&base, NODE_TOKEN, 0, SAMPLES, 10, Duration::from_secs(120)).await;
    eprintln!("killed while the samples were in {killed_in:?}");

    // Each accepted sample exactly once in the results, completed.
    let accepted_ids: HashSet<String> = accepted["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    let mut result_ids: Vec<String> = results
        .iter()
        .map(|s| s["sample_id"].as_str().unwrap().to_owned())
        .collect();
    result_ids.sort();
    let unique: HashSet<String> = result_ids.iter().cloned().collect();
    assert_eq!(
        unique.len(),
        result_ids.len(),
        "a sample finished twice: {result_ids:?}"
    );
    assert_eq!(unique, accepted_ids);
    for s in &results {
        assert_eq!(s["outcome"]["status"], "completed", "{s}");
    }
    // Each kill cut short at least one running sample, which ran again.
    let reruns: u64 = results
        .iter()
        .map(|s| s["attempt"].as_u64().unwrap() - 1)
        .sum();
    assert!(reruns >= 3, "{results:?}");
    // Nothing more arrives later.
    let later = node_api::get_json(
        &format!("{base}/v1/results?after={SAMPLES}&wait=2"),
        NODE_TOKEN,
    )
    .await;
    assert_eq!(later["results"], json!([]), "{later}");

    // Callbacks: every sample's arrives; redeliveries repeat the same result.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let keys: HashSet<String> = deliveries
            .lock()
            .unwrap()
            .iter()
            .map(|(k, _)| k.clone())
            .collect();
        if keys == accepted_ids {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "callbacks for {keys:?} of {accepted_ids:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = deliveries.lock().unwrap().clone();
    let mut first: HashMap<&str, &Value> = HashMap::new();
    for (key, body) in &got {
        assert_eq!(
            body["sample"]["sample_id"],
            key.as_str(),
            "the key is the sample id"
        );
        let seen = first.entry(key.as_str()).or_insert(body);
        assert_eq!(
            seen["sample"]["outcome"], body["sample"]["outcome"],
            "a redelivery with another result"
        );
    }
    eprintln!(
        "{} callback deliveries for {} samples",
        got.len(),
        accepted_ids.len()
    );
}
