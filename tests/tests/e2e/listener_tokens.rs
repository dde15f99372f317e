//! A capture proxy that is not loopback-only requires a client token: without one it does not
//! start; with one, every route but `/health` refuses a caller without it (401, in the shape
//! of the API the caller speaks), before any engine call or record.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::artefacts::tokentap_bin;
use tokentap_e2e::procs::{free_port, http_client};
use tokentap_e2e::scripted::{counting_replies, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};

const CLIENT_TOKEN: &str = "e2e-client-token-0123456789";

/// Whether `tokentap proxy --listen LISTEN [extra]` is still running after a few seconds
/// (it is killed then); otherwise its stderr.
fn proxy_stays_up(listen: &str, extra: &[&str]) -> Result<(), String> {
    let spool = tempfile::tempdir().unwrap();
    let mut child = Command::new(tokentap_bin())
        .args(["proxy", "--listen", listen])
        .args(["--backend", "http://127.0.0.1:9", "--backend-kind", "vllm"])
        .arg("--spool")
        .arg(spool.path())
        .args(extra)
        .env_remove("TOKENTAP_CLIENT_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    Ok(())
}

#[test]
fn a_proxy_off_loopback_without_a_client_token_does_not_start() {
    // Positive control: the same proxy on loopback stays up.
    let loopback = format!("127.0.0.1:{}", free_port());
    proxy_stays_up(&loopback, &[]).expect("a loopback proxy without a token starts");
    for listen in [
        format!("0.0.0.0:{}", free_port()),
        format!("[::]:{}", free_port()),
        format!("localhost:{}", free_port()),
    ] {
        let err = proxy_stays_up(&listen, &[]).expect_err(&format!("{listen} started open"));
        assert!(
            err.contains("--client-token") && err.contains("TOKENTAP_CLIENT_TOKEN"),
            "{listen}: {err}"
        );
    }
    // With a token it may listen there (bound on every address of this machine only for
    // the few seconds of the check; nothing is sent to it).
    let open = format!("0.0.0.0:{}", free_port());
    proxy_stays_up(&open, &["--client-token", CLIENT_TOKEN])
        .expect("a proxy with a client token starts on 0.0.0.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_token_guards_every_route_but_health() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let tt = Tokentap::start(
        TokentapConfig::new(engine.url.clone(), "vllm")
            .arg("--client-token")
            .arg(CLIENT_TOKEN),
    )
    .await;
    let client = http_client();
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let messages =
        json!({"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]});
    let base = tt.url.clone();
    let send =
        |method: reqwest::Method, path: &str, key: Option<(&str, String)>, body: Option<&Value>| {
            let mut r = client.request(method, format!("{base}{path}"));
            if path.starts_with("/v1/messages") {
                r = r.header("anthropic-version", "2023-06-01");
            }
            if let Some((name, value)) = key {
                r = r.header(name, value);
            }
            if let Some(b) = body {
                r = r.json(b);
            }
            r.send()
        };
    let wrong = "not-the-token".to_owned();
    let keys = [
        None,
        Some(("authorization", format!("Bearer {wrong}"))),
        Some(("x-api-key", wrong.clone())),
    ];
    for key in keys {
        let what = format!("{key:?}");
        let r = send(
            reqwest::Method::POST,
            "/v1/chat/completions",
            key.clone(),
            Some(&chat),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 401, "chat {what}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("client token"),
            "OpenAI-shaped: {v}"
        );
        let r = send(
            reqwest::Method::POST,
            "/v1/messages",
            key.clone(),
            Some(&messages),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 401, "messages {what}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["type"], "error", "Anthropic-shaped: {v}");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        for (method, path) in [
            (reqwest::Method::GET, "/v1/models"),
            (reqwest::Method::GET, "/metrics"),
            (reqwest::Method::POST, "/v1/messages/count_tokens"),
            (reqwest::Method::POST, "/v1/responses"),
        ] {
            let r = send(method, path, key.clone(), Some(&messages))
                .await
                .unwrap();
            assert_eq!(r.status(), 401, "{path} {what}");
        }
    }
    // Health stays open (liveness probes); the token admits calls in either header.
    let r = send(reqwest::Method::GET, "/health", None, None)
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let bearer = Some(("authorization", format!("Bearer {CLIENT_TOKEN}")));
    let r = send(
        reqwest::Method::POST,
        "/v1/chat/completions",
        bearer,
        Some(&chat),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let x_api_key = Some(("x-api-key", CLIENT_TOKEN.to_owned()));
    let r = send(
        reqwest::Method::POST,
        "/v1/messages",
        x_api_key,
        Some(&messages),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    // Only the two admitted calls were recorded; no refusal reached the spool.
    let records = tt.wait_records(2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(tt.records().len(), 2, "{records:?}");
}
