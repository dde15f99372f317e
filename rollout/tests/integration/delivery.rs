//! Results leave the node two more ways: POSTed to a `callback_url` (a flaky receiver gets
//! every result exactly once when it dedupes by `Idempotency-Key`; a refusal is not retried
//! and is noted on the sample; a receiver that never answers holds only its own few slots),
//! and streamed as server-sent events per rollout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokentap_e2e::node_api::{callback_receiver, HeldReceiver};
use tokentap_rollout::api::{router, ApiState};
use tokentap_rollout::deliver::DeliveryPolicy;
use tokentap_rollout::pipeline::{Pipeline, PipelineConfig};
use tokentap_rollout::store::Store;

async fn node(dir: &std::path::Path) -> String {
    node_delivering(
        dir,
        DeliveryPolicy {
            first_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
            timeout: Duration::from_millis(500),
            max_attempts: 8,
            ..DeliveryPolicy::default()
        },
    )
    .await
}

async fn node_delivering(dir: &std::path::Path, delivery: DeliveryPolicy) -> String {
    let store = Arc::new(Store::open(&dir.join("node.redb")).unwrap());
    let config = PipelineConfig {
        delivery,
        ..PipelineConfig::new(dir.join("data"))
    };
    let pipeline = Arc::new(Pipeline::start(store, config).await.unwrap());
    let app = router(ApiState {
        pipeline,
        extra_metrics: None,
        cluster: None,
        token: None,
    });
    serve(app).await
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

fn task(dir: &std::path::Path, samples: u32, script: &str, callback: Option<String>) -> Value {
    std::fs::create_dir_all(dir.join("project")).unwrap();
    json!({
        "task_id": "t",
        "instruction": "x",
        "workspace": {"dir": {"path": dir.join("project")}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": {"kind": "session-completed"},
        "num_samples": samples,
        "callback_url": callback
    })
}

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn submit(url: &str, body: &Value) -> Value {
    let r = http()
        .post(format!("{url}/v1/rollouts"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    r.json().await.unwrap()
}

/// Whether every sample of a rollout (as `GET /v1/rollouts/ID` shows it) has its callback.
fn every_callback_made(v: &Value) -> bool {
    v["samples"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["callback"].is_object())
}

async fn wait_rollout<F: Fn(&Value) -> bool>(url: &str, id: &str, done: F) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v: Value = http()
            .get(format!("{url}/v1/rollouts/{id}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if done(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "{v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fails each result's first three attempts in three ways (503; 429 with `Retry-After` as an
/// HTTP date 2 s ahead; a 500 after it has already processed the body, the case only
/// deduplication saves), then takes it.
#[derive(Default)]
struct Receiver {
    attempts: HashMap<String, u32>,
    /// When the 429 was answered, and when the next attempt came, by idempotency key.
    throttled_at: HashMap<String, std::time::SystemTime>,
    after_throttle: HashMap<String, std::time::Duration>,
    /// Processed results by idempotency key, with how many times each was processed.
    processed: HashMap<String, (u32, Value)>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flaky_receiver_gets_each_result_exactly_once() {
    let dir = tempfile::tempdir().unwrap();
    let receiver = Arc::new(Mutex::new(Receiver::default()));
    let r = receiver.clone();
    let app = Router::new()
        .route(
            "/results",
            post(move |headers: HeaderMap, Json(body): Json<Value>| {
                let r = r.clone();
                async move {
                    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                    let mut r = r.lock().unwrap();
                    let n = {
                        let a = r.attempts.entry(key.clone()).or_default();
                        *a += 1;
                        *a
                    };
                    match n {
                        1 => StatusCode::SERVICE_UNAVAILABLE.into_response(),
                        2 => {
                            let now = std::time::SystemTime::now();
                            r.throttled_at.insert(key, now);
                            // Whole seconds: at least 1 s from now, whatever the sub-second.
                            let at = httpdate::fmt_http_date(now + Duration::from_secs(2));
                            (StatusCode::TOO_MANY_REQUESTS, [("retry-after", at)]).into_response()
                        }
                        _ => {
                            if n == 3 {
                                let gap = r.throttled_at[&key].elapsed().unwrap_or_default();
                                r.after_throttle.insert(key.clone(), gap);
                            }
                            // Deduplicate: a key seen before is acknowledged, not processed.
                            let e = r.processed.entry(key).or_insert((0, Value::Null));
                            if e.0 == 0 {
                                *e = (1, body);
                            }
                            if n == 3 {
                                StatusCode::INTERNAL_SERVER_ERROR.into_response()
                            } else {
                                StatusCode::OK.into_response()
                            }
                        }
                    }
                }
            }),
        )
        .route(
            "/refuses",
            post(|| async { (StatusCode::BAD_REQUEST, "no such trainer") }),
        );
    let receiver_url = serve(app).await;
    let url = node(dir.path()).await;

    let ok = submit(
        &url,
        &task(
            dir.path(),
            4,
            "true",
            Some(format!("{receiver_url}/results")),
        ),
    )
    .await;
    let refused = submit(
        &url,
        &task(
            dir.path(),
            1,
            "true",
            Some(format!("{receiver_url}/refuses")),
        ),
    )
    .await;
    let ok = wait_rollout(
        &url,
        ok["rollout_id"].as_str().unwrap(),
        every_callback_made,
    )
    .await;
    let refused = wait_rollout(
        &url,
        refused["rollout_id"].as_str().unwrap(),
        every_callback_made,
    )
    .await;

    let r = receiver.lock().unwrap();
    for s in ok["samples"].as_array().unwrap() {
        let id = s["sample_id"].as_str().unwrap();
        assert_eq!(
            s["callback"],
            json!({"delivered": true, "attempts": 4}),
            "{s}"
        );
        assert_eq!(r.attempts[id], 4, "the node stops after the first 2xx");
        // After the second failure the node's own back-off is 75–125 ms here; a Retry-After
        // date ≥1 s ahead is honoured up to the policy's cap (200 ms).
        assert!(
            r.after_throttle[id] >= Duration::from_millis(190),
            "the next attempt came {:?} after a Retry-After date ≥1 s ahead",
            r.after_throttle[id]
        );
        let (times, body) = &r.processed[id];
        assert_eq!(*times, 1);
        assert_eq!(body["sample"]["sample_id"], id);
        assert_eq!(body["sample"]["outcome"]["status"], "completed");
    }
    assert_eq!(r.processed.len(), 4);
    let s = &refused["samples"][0];
    assert_eq!(s["callback"]["delivered"], false, "{s}");
    assert_eq!(s["callback"]["attempts"], 1, "a 400 is not retried: {s}");
    assert!(
        s["callback"]["error"].as_str().unwrap().contains("400"),
        "{s}"
    );
}

/// Waits until `ready` (fails the test after `limit`, saying `what`).
async fn until(what: &str, limit: Duration, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        assert!(Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A receiver that never answers gets at most the policy's 4 callbacks at once, each waiting
/// out the 30 s timeout, and holds nothing else: another receiver's callbacks all arrive while
/// it still holds its requests. Once it answers it gets all of its own, each attempt counted
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_never_answers_holds_only_its_own_slots() {
    let dir = tempfile::tempdir().unwrap();
    let held = HeldReceiver::start().await;
    let (fast, fast_got) = callback_receiver().await;
    let policy = DeliveryPolicy::default();
    assert_eq!(
        (policy.timeout, policy.max_per_receiver),
        (Duration::from_secs(30), 4)
    );
    let url = node_delivering(dir.path(), policy).await;

    let slow = submit(&url, &task(dir.path(), 6, "true", Some(held.url.clone()))).await;
    until(
        "4 callbacks held by the receiver",
        Duration::from_secs(60),
        || held.seen().open == 4,
    )
    .await;
    submit(&url, &task(dir.path(), 3, "true", Some(fast))).await;
    until(
        "the other receiver's 3 callbacks",
        Duration::from_secs(60),
        || fast_got.lock().unwrap().len() == 3,
    )
    .await;
    let seen = held.seen();
    assert_eq!(
        (seen.open, seen.dropped, seen.answered, seen.most_open),
        (4, 0, 0, 4),
        "the other receiver's callbacks all arrived while this one's were still held, never more than 4: {seen:?}"
    );

    held.release();
    let slow = wait_rollout(
        &url,
        slow["rollout_id"].as_str().unwrap(),
        every_callback_made,
    )
    .await;
    let seen = held.seen();
    for s in slow["samples"].as_array().unwrap() {
        let id = s["sample_id"].as_str().unwrap();
        assert_eq!(
            s["callback"],
            json!({"delivered": true, "attempts": seen.arrivals[id]}),
            "{s} {seen:?}"
        );
    }
    assert_eq!(seen.arrivals.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_streams_its_progress_as_server_sent_events() {
    let dir = tempfile::tempdir().unwrap();
    let url = node(dir.path()).await;
    let r = submit(&url, &task(dir.path(), 2, "sleep 0.3", None)).await;
    let id = r["rollout_id"].as_str().unwrap();
    let resp = http()
        .get(format!("{url}/v1/rollouts/{id}/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    // The stream ends by itself after `done`.
    let text = tokio::time::timeout(Duration::from_secs(30), resp.text())
        .await
        .expect("the stream closes once every sample ended")
        .unwrap();
    let events: Vec<(String, Value)> = tokentap_e2e::sse::events(&text)
        .into_iter()
        .map(|e| (e.event, serde_json::from_str(&e.data).unwrap()))
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"snapshot"), "{names:?}");
    assert_eq!(names.last(), Some(&"done"), "{names:?}");
    for sample in r["samples"].as_array().unwrap() {
        let stages: Vec<&str> = events
            .iter()
            .filter(|(n, e)| n == "stage" && e["sample_id"] == *sample)
            .map(|(_, e)| e["stage"].as_str().unwrap())
            .collect();
        // The snapshot may already have seen INIT or RUN start; the rest come as events,
        // in order, and POST_RUN (after the agent's 0.3 s) always does.
        assert!(
            ["init", "run", "post_run"].ends_with(&stages) && stages.contains(&"post_run"),
            "{stages:?}"
        );
        let finished: Vec<&Value> = events
            .iter()
            .filter(|(n, e)| n == "finished" && e["sample_id"] == *sample)
            .map(|(_, e)| &e["outcome"])
            .collect();
        assert_eq!(finished, [&json!({"status": "completed", "reward": 1.0})]);
    }
    // A finished rollout's stream is its snapshot and `done`.
    let again = http()
        .get(format!("{url}/v1/rollouts/{id}/events"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(again.matches("event: ").count(), 2, "{again}");
}
