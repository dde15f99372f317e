//! TLS off-host: an HTTPS engine and an HTTPS worker, each a real rustls server on 127.0.0.1
//! with a certificate from a CA the test made (rcgen). tokentap reaches them with `--ca-file`
//! and refuses them without it, saying why.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tls_front::{TestCa, TlsFront};
use tokentap_e2e::tokentap::{read_spool, Tokentap, TokentapConfig};
use tokentap_e2e::worker::Worker;

const ENGINE_KEY: &str = "sk-engine-key-never-recorded";

fn port_of(url: &str) -> u16 {
    url.rsplit(':').next().unwrap().parse().unwrap()
}

async fn engine() -> ScriptedBackend {
    ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, i| Reply::Text(format!("answer {i}"))),
    )
    .await
}

async fn chat(proxy: &Tokentap) -> reqwest::Response {
    http_client()
        .post(proxy.chat_url())
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_engine_with_a_private_ca_is_reached_with_ca_file() {
    let engine = engine().await;
    let ca = TestCa::new("tokentap test engine CA");
    let front = TlsFront::start(&ca, port_of(&engine.url)).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    ca.write_pem(&ca_file);
    let proxy = Tokentap::start(
        TokentapConfig::new(&front.url, "vllm")
            .arg("--ca-file")
            .arg(ca_file.to_str().unwrap())
            .arg("--backend-api-key")
            .arg(ENGINE_KEY),
    )
    .await;
    let r = chat(&proxy).await;
    assert_eq!(r.status(), 200, "{}", proxy.log_tail(20));
    let v: Value = r.json().await.unwrap();
    assert!(v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .starts_with("answer"));
    // The key crossed TLS to the engine...
    let seen = front.seen().to_ascii_lowercase();
    assert!(
        seen.contains(&format!("authorization: bearer {}", ENGINE_KEY.to_ascii_lowercase())),
        "the engine did not get the key"
    );
    // ...and is in no record.
    proxy.wait_records(1).await;
    let spool = proxy.spool_bytes();
    assert!(!spool
        .windows(ENGINE_KEY.len())
        .any(|w| w == ENGINE_KEY.as_bytes()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_ca_file_an_https_engine_is_refused_with_a_502_naming_the_certificate() {
    let engine = engine().await;
    let ca = TestCa::new("a CA nobody trusts");
    let front = TlsFront::start(&ca, port_of(&engine.url)).await;
    let proxy = Tokentap::start(
        TokentapConfig::new(&front.url, "vllm")
            .arg("--backend-api-key")
            .arg(ENGINE_KEY),
    )
    .await;
    let r = chat(&proxy).await;
    assert_eq!(r.status(), 502);
    let v: Value = r.json().await.expect("a provider-shaped JSON error");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.to_ascii_lowercase().contains("certificate"),
        "{v}"
    );
    // Nothing reached the engine: the handshake failed before any request was sent.
    assert!(!front.seen().contains("authorization"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_ship_over_https_to_a_worker_with_ca_file() {
    let engine = engine().await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("worker-out");
    let worker = Worker::start(&out, &["--token", "tls-ship-token"]).await;
    let ca = TestCa::new("tokentap test worker CA");
    let front = TlsFront::start(&ca, worker.port).await;
    let ca_file = dir.path().join("ca.pem");
    ca.write_pem(&ca_file);
    let proxy = Tokentap::start(
        TokentapConfig::new(&engine.url, "vllm")
            .arg("--ship-to")
            .arg(&front.url)
            .arg("--ship-token")
            .arg("tls-ship-token")
            .arg("--ca-file")
            .arg(ca_file.to_str().unwrap()),
    )
    .await;
    for _ in 0..3 {
        assert_eq!(chat(&proxy).await.status(), 200);
    }
    proxy.wait_records(3).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_spool(&out.join("spool")).len() < 3 {
        assert!(Instant::now() < deadline, "{}", proxy.log_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The token went inside TLS.
    assert!(front.seen().contains("tls-ship-token"));
}
