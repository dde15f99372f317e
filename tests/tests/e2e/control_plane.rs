//! Attacks on the control planes of `tokentap serve` and `tokentap worker` (real processes on
//! loopback): every route but `/health` refuses a missing, wrong or mangled token with the JSON
//! 401; the right token gets through; neither starts on a non-loopback address without a
//! token; a shipper without the worker's token delivers nothing and dead-letters nothing.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::procs::{
    free_port, http_client, spawn_guarded, spawn_guarded_split, wait_healthy, KillScope,
};
use tokentap_e2e::scripted::{always, Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{read_spool, Tokentap, TokentapConfig};
use tokentap_e2e::worker::Worker;
use tokentap_schema::ship::{SHIP_LIMITS_PATH, SHIP_PATH};

const TOKEN: &str = "control-plane-test-token";

/// Authorization headers an attacker might try (None: no header).
fn wrong_credentials() -> Vec<Option<String>> {
    vec![
        None,
        Some("Bearer wrong-token".into()),
        Some(format!("Bearer {TOKEN}x")),
        Some(format!("Bearer {}", &TOKEN[..TOKEN.len() - 1])),
        Some("Bearer ".into()),
        Some(format!("Basic {TOKEN}")),
        Some(TOKEN.into()),
        Some(format!("Bearer {}", TOKEN.to_uppercase())),
    ]
}

/// Tries every route with every wrong credential (and every method on each path: a route's
/// other methods must not be a way around the check), then with the right one.
async fn attack(base: &str, routes: &[(&str, &str)]) {
    let http = http_client();
    for (method, path) in routes {
        let path = path.replace("{id}", "no-such-id");
        let url = format!("{base}{path}?wait=0");
        if path == "/health" {
            let r = http.get(&url).send().await.unwrap();
            assert_eq!(r.status(), 200, "/health stays open");
            continue;
        }
        for auth in wrong_credentials() {
            for m in ["GET", "POST", "DELETE", "PUT"] {
                let mut req = http
                    .request(m.parse().unwrap(), &url)
                    .header("content-type", "application/json")
                    .body("{}");
                if let Some(a) = &auth {
                    req = req.header("authorization", a);
                }
                let r = req.send().await.unwrap();
                let status = r.status().as_u16();
                if m == *method {
                    assert_eq!(status, 401, "{m} {path} with {auth:?}");
                    let body: Value = r.json().await.expect("a JSON 401");
                    assert_eq!(body["error"]["type"], "unauthorized", "{m} {path}: {body}");
                } else {
                    // Another method on the same path: refused, or not served at all.
                    assert!(
                        status == 401 || status == 405,
                        "{m} {path} with {auth:?}: {status}"
                    );
                }
            }
        }
        // The right token gets through (whatever the route then answers, it is not a 401).
        let r = http
            .request(method.parse().unwrap(), &url)
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_ne!(r.status(), 401, "{method} {path} with the right token");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_serve_refuses_a_missing_or_wrong_token() {
    // The routes are the router's own list; the OpenAPI document's must all be on it.
    let routes = tokentap_rollout::api::ALL_ROUTES;
    for (m, p) in tokentap_rollout::openapi::ROUTES {
        assert!(
            routes
                .iter()
                .any(|(rm, rp)| rm.eq_ignore_ascii_case(m) && rp == p),
            "{m} {p} missing from api::ALL_ROUTES"
        );
    }
    assert!(routes.contains(&("GET", "/metrics")));
    assert!(routes.contains(&("GET", "/openapi.json")));

    let engine = ScriptedBackend::start(Tokens::FakeChat, always(Reply::text("hi"))).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = Command::new(tokentap_bin());
    cmd.arg("serve")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--data")
        .arg(dir.path().join("node"))
        .arg("--spool")
        .arg(dir.path().join("node/spool"))
        .args(["--backend", &engine.url, "--backend-kind", "vllm"])
        .env("TOKENTAP_NODE_TOKEN", TOKEN)
        .env("TOKENTAP_LOG", "info");
    let mut node = spawn_guarded(
        cmd,
        &dir.path().join("node.log"),
        KillScope::Group,
        "tokentap serve",
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    wait_healthy(
        &format!("{base}/health"),
        &mut node,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    attack(&base, routes).await;
    // The viewer's data routes, on the same listener, behind the same token.
    let view: Vec<String> = tokentap_viewer::api::ROUTES
        .iter()
        .map(|r| format!("/view{r}"))
        .collect();
    let view: Vec<(&str, &str)> = view.iter().map(|p| ("GET", p.as_str())).collect();
    attack(&base, &view).await;
    // Metrics with the token: the node's and its capture's.
    let text = http_client()
        .get(format!("{base}/metrics"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("tokentap_"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_of_the_worker_refuses_a_missing_or_wrong_token() {
    let dir = tempfile::tempdir().unwrap();
    let worker = Worker::start(&dir.path().join("out"), &["--token", TOKEN]).await;
    let routes = [
        ("GET", "/health"),
        ("POST", SHIP_PATH),
        ("GET", SHIP_LIMITS_PATH),
        ("GET", "/metrics"),
    ];
    attack(&worker.url, &routes).await;
    // Nothing an unauthenticated client sent was stored.
    assert!(read_spool(&dir.path().join("out/spool")).is_empty());
    // A body is not even read before the token is checked: a request announcing 200 MB that
    // sends only its first KB is answered 401 at once (a worker that read the body first
    // would wait for the rest, and this read would time out).
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = worker.url.trim_start_matches("http://").to_owned();
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let head = format!(
            "POST {SHIP_PATH} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/x-ndjson\r\ncontent-length: {}\r\n\r\n",
            200u64 << 20
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&[b'x'; 1024]).await.unwrap();
        let mut answer = vec![0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut answer))
            .await
            .expect("no answer before the body: the worker waited for it")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }
    let limits: Value = http_client()
        .get(format!("{}{SHIP_LIMITS_PATH}", worker.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(limits["max_body_bytes"], 128u64 << 20, "{limits}");
}

/// Runs `tokentap ARGS` with `env` and no token in the environment; (success, stderr).
async fn run_briefly(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    let mut cmd = Command::new(tokentap_bin());
    cmd.args(args)
        .current_dir(dir.path())
        .env_remove("TOKENTAP_NODE_TOKEN")
        .env_remove("TOKENTAP_WORKER_TOKEN")
        .env("TOKENTAP_LOG", "warn");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = spawn_guarded_split(cmd, &out, &err, KillScope::Group, "tokentap").unwrap();
    let status = child
        .wait_limited(Duration::from_secs(20))
        .await
        .unwrap_or_else(|| panic!("tokentap {args:?} kept running: it did not refuse"));
    (
        status.success(),
        std::fs::read_to_string(&err).unwrap_or_default(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_and_worker_refuse_a_non_loopback_listen_without_a_token() {
    // Binding a wildcard address is local; no traffic leaves (nothing connects to it).
    for listen in ["0.0.0.0:0", "[::]:0"] {
        let (ok, err) = run_briefly(
            &[
                "serve",
                "--listen",
                listen,
                "--data",
                "node",
                "--backend",
                "http://127.0.0.1:9",
                "--backend-kind",
                "vllm",
            ],
            &[],
        )
        .await;
        assert!(!ok, "serve on {listen} without a token started");
        assert!(
            err.contains("--token") && err.contains("TOKENTAP_NODE_TOKEN"),
            "{err}"
        );
        let (ok, err) = run_briefly(&["worker", "--listen", listen, "--out", "out"], &[]).await;
        assert!(!ok, "worker on {listen} without a token started");
        assert!(
            err.contains("--token") && err.contains("TOKENTAP_WORKER_TOKEN"),
            "{err}"
        );
        // An empty token is no token.
        let (ok, _) = run_briefly(
            &["worker", "--listen", listen, "--out", "out"],
            &[("TOKENTAP_WORKER_TOKEN", "")],
        )
        .await;
        assert!(!ok, "worker on {listen} with an empty token started");
    }

    // With a token it starts, and still wants it.
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = Command::new(tokentap_bin());
    cmd.args(["worker", "--listen", &format!("0.0.0.0:{port}"), "--out"])
        .arg(dir.path().join("out"))
        .env("TOKENTAP_WORKER_TOKEN", TOKEN);
    let mut worker = spawn_guarded(
        cmd,
        &dir.path().join("w.log"),
        KillScope::Process,
        "tokentap worker",
    )
    .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    wait_healthy(
        &format!("{base}/health"),
        &mut worker,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let r = http_client()
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
}

/// A proxy shipping without the worker's token (or with a wrong one) delivers nothing, and
/// does not give its records up either: nothing is dead-lettered, and with the right token
/// (a restart on the same spool) every record arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipping_without_the_worker_token_delivers_nothing_and_loses_nothing() {
    let engine = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let worker = Worker::start(&out, &["--token", TOKEN]).await;
    let client = http_client();
    for (n, token) in [(0, None), (1, Some("not-the-token"))] {
        let mut config = TokentapConfig::new(&engine.url, "vllm")
            .arg("--ship-to")
            .arg(&worker.url);
        if let Some(t) = token {
            config = config.arg("--ship-token").arg(t);
        }
        config.spool = Some(dir.path().join("spool"));
        let mut proxy = Tokentap::start(config).await;
        let r = client
            .post(proxy.chat_url())
            .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": format!("hi {n}")}]}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        proxy.wait_records(n + 1).await;
        // The shipper's first attempt and its refusal come after the record: polled.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let log = proxy.log_tail(200);
            if log.contains("--ship-token") && log.contains("401") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the proxy did not say why shipping fails:\n{log}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(read_spool(&out.join("spool")).is_empty());
        assert!(!dir.path().join("spool/dead-letter.ndjson").exists());
        assert_eq!(
            proxy.metric("tokentap_ship_dead_letter_total").await,
            Some(0.0)
        );
        // SIGKILL: the record is in the spool already, and a stop would wait out the
        // shipper's drain deadline against a worker that keeps refusing.
        proxy.kill();
    }
    let config = TokentapConfig::new(&engine.url, "vllm")
        .arg("--ship-to")
        .arg(&worker.url)
        .arg("--ship-token")
        .arg(TOKEN);
    let mut config = config;
    config.spool = Some(dir.path().join("spool"));
    let proxy = Tokentap::start(config).await;
    let sent = proxy.records();
    assert_eq!(sent.len(), 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while read_spool(&out.join("spool")).len() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            proxy.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A slowloris against a control plane: 300 connections that send part of a request head and
/// stall do not keep an authenticated client from being served, and each is closed once the
/// head deadline (10 s) passes; a connection that never sends a byte is closed too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_heads_on_the_worker_are_closed_and_block_nobody() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let worker = Worker::start(&dir.path().join("out"), &["--token", TOKEN]).await;
    let addr = format!("127.0.0.1:{}", worker.port);
    let mut stalled = Vec::new();
    for i in 0..300 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        if i % 2 == 0 {
            s.write_all(b"POST /v1/ship HTTP/1.1\r\nhost: x\r\n")
                .await
                .unwrap();
        }
        stalled.push(s);
    }
    let started = std::time::Instant::now();
    let limits = http_client()
        .get(format!("{}{SHIP_LIMITS_PATH}", worker.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(limits.status(), 200);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "served while stalled heads wait"
    );
    // Every stalled connection is closed by the worker (EOF or reset), none later than the
    // deadline plus slack.
    for mut s in stalled {
        let mut buf = [0u8; 256];
        let closed = tokio::time::timeout(Duration::from_secs(20), s.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "a stalled connection was left open: {closed:?}"
        );
    }
}
