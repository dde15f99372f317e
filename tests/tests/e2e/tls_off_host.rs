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

/// `engine` behind a TLS front with a certificate from a CA the test made, and tokentap
/// reaching it with `--ca-file` and `extra` arguments (the CA file's directory is returned to
/// be kept).
async fn behind_a_private_ca(
    engine: &ScriptedBackend,
    extra: &[&str],
) -> (TlsFront, Tokentap, tempfile::TempDir) {
    let ca = TestCa::new("tokentap test engine CA");
    let front = TlsFront::start(&ca, port_of(&engine.url)).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    ca.write_pem(&ca_file);
    let mut config = TokentapConfig::new(&front.url, "vllm")
        .arg("--ca-file")
        .arg(ca_file.to_str().unwrap());
    for a in extra {
        config = config.arg(*a);
    }
    (front, Tokentap::start(config).await, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_engine_with_a_private_ca_is_reached_with_ca_file() {
    let engine = engine().await;
    let (front, proxy, _ca_dir) =
        behind_a_private_ca(&engine, &["--backend-api-key", ENGINE_KEY]).await;
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
        seen.contains(&format!(
            "authorization: bearer {}",
            ENGINE_KEY.to_ascii_lowercase()
        )),
        "the engine did not get the key"
    );
    // ...and is in no record.
    proxy.wait_records(1).await;
    let spool = proxy.spool_bytes();
    assert!(!spool
        .windows(ENGINE_KEY.len())
        .any(|w| w == ENGINE_KEY.as_bytes()));
}

/// An HTTPS engine's answers are read by reqwest, not Pingora's client: an endless one is cut
/// off at `--max-answer-bytes` all the same, streamed or whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_https_engine_answer_is_cut_off_at_max_answer_bytes() {
    let engine = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|_req: &Value, _| Reply::Flood {
            text: "hello".into(),
            chunks: 2,
        }),
    )
    .await;
    let (_front, proxy, _ca_dir) =
        behind_a_private_ca(&engine, &["--max-answer-bytes", "1048576"]).await;
    for (n, stream) in [(1, true), (2, false)] {
        let call = http_client()
            .post(proxy.chat_url())
            .json(&json!({"model": "m", "stream": stream,
                          "messages": [{"role": "user", "content": "hi"}]}))
            .send();
        let text = tokio::time::timeout(Duration::from_secs(60), async {
            call.await.unwrap().text().await.unwrap()
        })
        .await
        .expect("the call ends");
        assert!(
            text.contains("larger than 1048576 bytes"),
            "stream={stream}: {}",
            &text[..text.len().min(2000)]
        );
        let records = proxy.wait_records(n).await;
        let err = records[n - 1].error.as_ref().expect("record error");
        assert!(err.message.contains("--max-answer-bytes"), "{err:?}");
    }
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
    assert!(message.to_ascii_lowercase().contains("certificate"), "{v}");
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

/// Polls `url` over HTTPS (trusting `client`'s roots) until it answers 200.
async fn wait_https(client: &reqwest::Client, url: &str, log: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = client.get(url).send().await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{url} never answered; log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `worker` and `serve` listen over HTTPS with `--tls-cert`/`--tls-key`: clients trusting the
/// CA get answers (and the token is still required), plain HTTP gets none, connections that
/// never finish their handshake hold up nobody, and a proxy ships to the worker over HTTPS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_and_serve_listen_over_tls_and_stalled_handshakes_block_nobody() {
    use std::process::Command;
    use tokentap_e2e::artefacts::tokentap_bin;
    use tokentap_e2e::procs::{free_port, spawn_guarded, KillScope};

    const TOKEN: &str = "tls-listener-token";
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("tokentap test listener CA");
    let (cert, key) = ca.leaf();
    let (cert_file, key_file, ca_file) = (
        dir.path().join("cert.pem"),
        dir.path().join("key.pem"),
        dir.path().join("ca.pem"),
    );
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    ca.write_pem(&ca_file);
    let trusting = reqwest::Client::builder()
        .no_proxy()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.cert_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();

    let port = free_port();
    let mut cmd = Command::new(tokentap_bin());
    cmd.args(["worker", "--listen", &format!("127.0.0.1:{port}"), "--out"])
        .arg(dir.path().join("out"))
        .args(["--token", TOKEN, "--tls-cert"])
        .arg(&cert_file)
        .arg("--tls-key")
        .arg(&key_file)
        .env("TOKENTAP_LOG", "info");
    let worker_log = dir.path().join("worker.log");
    let _worker = spawn_guarded(cmd, &worker_log, KillScope::Process, "tokentap worker").unwrap();
    let base = format!("https://localhost:{port}");
    wait_https(&trusting, &format!("{base}/health"), &worker_log).await;

    // Fifty connections that never start their handshake...
    let mut stalled = Vec::new();
    for _ in 0..50 {
        stalled.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    // ...do not keep an authenticated client out, and the token is still wanted over TLS.
    let r = trusting
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = trusting
        .get(format!("{base}/v1/ship/limits"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(stalled);
    // Plain HTTP on the TLS port gets no HTTP answer.
    let plain = http_client()
        .get(format!("http://127.0.0.1:{port}/health"))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.map_or(true, |r| r.status() != 200));

    // A proxy ships to it over HTTPS with --ca-file.
    let engine = engine().await;
    let proxy = Tokentap::start(
        TokentapConfig::new(&engine.url, "vllm")
            .arg("--ship-to")
            .arg(&base)
            .arg("--ship-token")
            .arg(TOKEN)
            .arg("--ca-file")
            .arg(ca_file.to_str().unwrap()),
    )
    .await;
    for _ in 0..2 {
        assert_eq!(chat(&proxy).await.status(), 200);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while read_spool(&dir.path().join("out/spool")).len() < 2 {
        assert!(Instant::now() < deadline, "{}", proxy.log_tail(30));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Without --ca-file the shipper does not trust the worker, and says why.
    let untrusting = Tokentap::start(
        TokentapConfig::new(&engine.url, "vllm")
            .arg("--ship-to")
            .arg(&base)
            .arg("--ship-token")
            .arg(TOKEN),
    )
    .await;
    assert_eq!(chat(&untrusting).await.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = untrusting.log_tail(50).to_ascii_lowercase();
        if log.contains("shipping failed") && log.contains("certificate") {
            break;
        }
        assert!(Instant::now() < deadline, "{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(read_spool(&dir.path().join("out/spool")).len(), 2);

    // `serve` over HTTPS.
    let port = free_port();
    let mut cmd = Command::new(tokentap_bin());
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--data"])
        .arg(dir.path().join("node"))
        .arg("--spool")
        .arg(dir.path().join("node/spool"))
        .args(["--backend", &engine.url, "--backend-kind", "vllm"])
        .args(["--token", TOKEN, "--tls-cert"])
        .arg(&cert_file)
        .arg("--tls-key")
        .arg(&key_file)
        .env("TOKENTAP_LOG", "info");
    let node_log = dir.path().join("node.log");
    let _node = spawn_guarded(cmd, &node_log, KillScope::Group, "tokentap serve").unwrap();
    let base = format!("https://localhost:{port}");
    wait_https(&trusting, &format!("{base}/health"), &node_log).await;
    let r = trusting
        .get(format!("{base}/v1/admin/status"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = trusting
        .get(format!("{base}/openapi.json"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
