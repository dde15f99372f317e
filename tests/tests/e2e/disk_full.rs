//! A spool that cannot be written (real `tokentap proxy`, the scripted engine, the spool on a
//! small tmpfs each test mounts): a full disk and a read-only remount under a running proxy.
//!
//! - `--on-spool-error fail-closed` (the default): new calls get a provider-shaped 503 naming
//!   the cause, before the engine; no answered call's record is lost; calls are answered again
//!   by themselves once space returns; every answered call ends with exactly one record.
//! - `--on-spool-error fail-open`: calls are answered, the records that cannot be written are
//!   counted in `tokentap_records_lost_total`, writing resumes by itself.
//!
//! Mounting needs root: `tokentap_e2e::privileged` fails these tests in CI without it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::privileged;
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tmpfs::{self, Tmpfs};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_spool::{SpoolItem, SpoolReader};

async fn engine() -> ScriptedBackend {
    ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await
}

/// The proxy with its spool on `fs` and the given `--on-spool-error`. No in-process
/// reconstruction: its trace files would share the tmpfs (and hold it open for writing).
async fn proxy(engine: &ScriptedBackend, fs: &Tmpfs, policy: &str) -> Tokentap {
    let mut config = TokentapConfig::new(&engine.url, "vllm")
        .arg("--no-reconstruct")
        .arg("--on-spool-error")
        .arg(policy);
    config.spool = Some(fs.path().join("spool"));
    Tokentap::start(config).await
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    Chat,
    Messages,
}

/// One call in session `session`: its status and body. The prompt is padded past a page, so
/// no record fits in what a full tmpfs leaves of the segment's last page.
async fn call(proxy: &Tokentap, api: Api, session: &str) -> (u16, Value) {
    let content = format!("hello from {session}: {}", "x".repeat(5000));
    let req = match api {
        Api::Chat => http_client().post(proxy.chat_url()).json(&json!({
            "model": "m",
            "messages": [{"role": "user", "content": content}],
        })),
        Api::Messages => http_client()
            .post(format!("{}/v1/messages", proxy.url))
            .header("anthropic-version", "2023-06-01")
            .json(&json!({
                "model": "m",
                "max_tokens": 16,
                "messages": [{"role": "user", "content": content}],
            })),
    };
    let r = req
        .header("x-tokentap-session", session)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("calling the proxy");
    let status = r.status().as_u16();
    let body = r.json().await.unwrap_or(Value::Null);
    (status, body)
}

/// The calls a test made and which of them were answered.
#[derive(Default)]
struct Calls {
    n: usize,
    answered: Vec<String>,
}

impl Calls {
    /// Makes a call in a session of its own; its status and body.
    async fn make(&mut self, proxy: &Tokentap, api: Api) -> (u16, Value) {
        self.n += 1;
        let session = format!("disk-full-{}", self.n);
        let (status, body) = call(proxy, api, &session).await;
        match status {
            200 => self.answered.push(session),
            503 => {}
            other => panic!("call {session}: unexpected {other}: {body}"),
        }
        (status, body)
    }

    /// Calls until one is refused (at most `max`); the refusal's body.
    async fn until_refused(&mut self, proxy: &Tokentap, api: Api, max: usize) -> Value {
        for _ in 0..max {
            let (status, body) = self.make(proxy, api).await;
            if status == 503 {
                return body;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "no call refused after {max} calls on a full spool; proxy log:\n{}",
            proxy.log_tail(30)
        );
    }

    /// Calls (every 100 ms) until one is answered, within `limit`; how long it took.
    async fn until_answered(&mut self, proxy: &Tokentap, api: Api, limit: Duration) -> Duration {
        let t = Instant::now();
        loop {
            if self.make(proxy, api).await.0 == 200 {
                return t.elapsed();
            }
            assert!(
                t.elapsed() < limit,
                "calls still refused {limit:?} after the spool became writable; proxy log:\n{}",
                proxy.log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The 503 in the API's own error shape, naming `cause`.
fn assert_refusal(api: Api, body: &Value, cause: &str) {
    let (message, kind) = match api {
        Api::Chat => (&body["error"]["message"], &body["error"]["type"]),
        Api::Messages => {
            assert_eq!(body["type"], "error", "{body}");
            (&body["error"]["message"], &body["error"]["type"])
        }
    };
    let message = message
        .as_str()
        .unwrap_or_else(|| panic!("{api:?}: {body}"));
    let want_kind = match api {
        Api::Chat => "server_error",
        // Claude Code retries an overloaded API.
        Api::Messages => "overloaded_error",
    };
    assert_eq!(kind, want_kind, "{api:?}: {body}");
    assert!(
        message.contains("cannot write its capture spool")
            && message.contains(cause)
            && message.contains("not sent to the engine"),
        "{api:?}: {message}"
    );
}

/// Every line of the spool is a whole record (nothing torn or corrupt; read after the proxy
/// stopped); the number of records per session.
fn records_per_session(spool: &Path) -> HashMap<String, usize> {
    let mut per_session = HashMap::new();
    let mut ids = std::collections::HashSet::new();
    for item in SpoolReader::open(spool).expect("opening the spool") {
        match item.expect("reading the spool") {
            SpoolItem::Record(e) => {
                assert!(
                    ids.insert(e.record.record_id.clone()),
                    "duplicate record {}",
                    e.record.record_id
                );
                *per_session.entry(e.record.session_id).or_insert(0) += 1;
            }
            other => panic!("the spool holds a line that is not a whole record: {other:?}"),
        }
    }
    per_session
}

async fn metric(proxy: &Tokentap, name: &str) -> f64 {
    proxy
        .metric(name)
        .await
        .unwrap_or_else(|| panic!("no metric {name}"))
}

async fn wait_metric(proxy: &Tokentap, name: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while proxy.metric(name).await != Some(want) {
        assert!(Instant::now() < deadline, "{name} never became {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

const REFUSED: &str = "tokentap_calls_refused_total{reason=\"spool_unwritable\"}";

/// A proxy under `policy` with its spool on a fresh 256 KiB tmpfs, one call answered and
/// recorded; `None` when mounting is not allowed (reported by `privileged::runs`).
async fn running(policy: &str) -> Option<(Tmpfs, ScriptedBackend, Tokentap, Calls)> {
    if !privileged::runs(tmpfs::may_mount()) {
        return None;
    }
    let fs = Tmpfs::mount("256k");
    let engine = engine().await;
    let proxy = proxy(&engine, &fs, policy).await;
    let mut calls = Calls::default();
    assert_eq!(calls.make(&proxy, Api::Chat).await.0, 200);
    proxy.wait_records(1).await;
    Some((fs, engine, proxy, calls))
}

#[tokio::test]
async fn heavy_fail_closed_refuses_calls_while_the_disk_is_full_and_loses_no_answered_call() {
    let Some((fs, engine, mut proxy, mut calls)) = running("fail-closed").await else {
        return;
    };
    assert_eq!(calls.make(&proxy, Api::Messages).await.0, 200);
    proxy.wait_records(2).await;

    let filler = fs.fill();
    for api in [Api::Chat, Api::Messages] {
        let body = calls.until_refused(&proxy, api, 50).await;
        assert_refusal(api, &body, "No space left on device");
    }
    assert_eq!(metric(&proxy, "tokentap_spool_writable").await, 0.0);
    assert!(metric(&proxy, REFUSED).await >= 2.0);
    assert_eq!(metric(&proxy, "tokentap_records_lost_total").await, 0.0);
    let engine_calls = engine.requests().len();
    assert_eq!(
        calls.make(&proxy, Api::Chat).await.0,
        503,
        "still refused while full"
    );
    assert_eq!(
        engine.requests().len(),
        engine_calls,
        "a refused call never reaches the engine"
    );

    std::fs::remove_file(filler).expect("freeing space");
    for api in [Api::Chat, Api::Messages] {
        let took = calls
            .until_answered(&proxy, api, Duration::from_secs(5))
            .await;
        eprintln!("{api:?} answered again {took:?} after space returned");
    }
    wait_metric(&proxy, "tokentap_spool_writable", 1.0).await;
    assert_eq!(metric(&proxy, "tokentap_records_lost_total").await, 0.0);

    assert!(proxy.terminate().await, "the proxy stops cleanly");
    let per_session = records_per_session(&fs.path().join("spool"));
    for s in &calls.answered {
        assert_eq!(
            per_session.get(s),
            Some(&1),
            "answered call {s} has exactly one record"
        );
    }
    assert_eq!(
        per_session.len(),
        calls.answered.len(),
        "refused calls have no record: {per_session:?}"
    );
}

#[tokio::test]
async fn heavy_fail_open_answers_while_the_disk_is_full_and_counts_records_lost() {
    let Some((fs, _engine, mut proxy, mut calls)) = running("fail-open").await else {
        return;
    };

    let filler = fs.fill();
    for i in 0..6 {
        let api = [Api::Chat, Api::Messages][i % 2];
        assert_eq!(
            calls.make(&proxy, api).await.0,
            200,
            "fail-open answers on a full disk"
        );
    }
    // Each record is either written (a small one may still fit in the segment's last page)
    // or counted lost; the full disk must have cost some.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let written = metric(&proxy, "tokentap_records_written_total").await;
        let lost = metric(&proxy, "tokentap_records_lost_total").await;
        if written + lost >= 7.0 {
            assert!(lost >= 1.0, "nothing lost on a full disk");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "records neither written nor counted lost ({written} written, {lost} lost); proxy log:\n{}",
            proxy.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&proxy, "tokentap_spool_writable").await, 0.0);
    assert_eq!(proxy.metric(REFUSED).await.unwrap_or(0.0), 0.0);

    std::fs::remove_file(filler).expect("freeing space");
    for api in [Api::Chat, Api::Messages] {
        assert_eq!(calls.make(&proxy, api).await.0, 200);
    }
    wait_metric(&proxy, "tokentap_spool_writable", 1.0).await;
    let lost = metric(&proxy, "tokentap_records_lost_total").await as usize;
    assert!(proxy.terminate().await, "the proxy stops cleanly");

    let per_session = records_per_session(&fs.path().join("spool"));
    assert!(per_session.values().all(|&n| n == 1), "{per_session:?}");
    assert_eq!(
        per_session.len() + lost,
        calls.answered.len(),
        "every answered call is either in the spool or counted lost: {per_session:?}, {lost} lost"
    );
    let first = &calls.answered[0];
    let last = calls.answered.last().unwrap();
    assert!(
        per_session.contains_key(first) && per_session.contains_key(last),
        "written before the disk filled and after space returned"
    );
}

#[tokio::test]
async fn heavy_fail_closed_refuses_calls_while_the_spool_is_read_only_and_recovers_on_remount_rw() {
    let Some((fs, _engine, mut proxy, mut calls)) = running("fail-closed").await else {
        return;
    };

    // A healthy writer holds its segment open for writing, and Linux refuses to remount a
    // file system read-only under an open writable file (EBUSY); a filesystem that errors
    // goes read-only by itself, which a tmpfs cannot. So the disk fills first: a failing
    // writer lets go of its segment between retries, and the remount goes through.
    let filler = fs.fill();
    calls.until_refused(&proxy, Api::Chat, 50).await;
    fs.remount("ro");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = calls.make(&proxy, Api::Messages).await;
        assert_eq!(status, 503, "answered on a read-only spool: {body}");
        if body.to_string().contains("Read-only file system") {
            assert_refusal(Api::Messages, &body, "Read-only file system");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the refusal never named EROFS: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = calls.make(&proxy, Api::Chat).await;
    assert_eq!(status, 503);
    assert_refusal(Api::Chat, &body, "Read-only file system");

    fs.remount("rw");
    std::fs::remove_file(filler).expect("freeing space");
    calls
        .until_answered(&proxy, Api::Chat, Duration::from_secs(5))
        .await;
    assert_eq!(calls.make(&proxy, Api::Messages).await.0, 200);
    wait_metric(&proxy, "tokentap_spool_writable", 1.0).await;

    assert!(proxy.terminate().await, "the proxy stops cleanly");
    let per_session = records_per_session(&fs.path().join("spool"));
    for s in &calls.answered {
        assert_eq!(per_session.get(s), Some(&1), "answered call {s}");
    }
    assert_eq!(per_session.len(), calls.answered.len(), "{per_session:?}");
}
