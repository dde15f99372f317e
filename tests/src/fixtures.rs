//! Small compositions most tests start from.

use serde_json::{json, Value};

use crate::procs::http_client;
use crate::scripted::{Script, ScriptedBackend, Tokens};
use crate::tokentap::{Tokentap, TokentapConfig};

/// tokentap (`--backend-kind vllm`) in front of a [`ScriptedBackend`] with stand-in token ids:
/// no llama-server needed.
pub async fn scripted_tokentap(script: Script, extra: &[&str]) -> (ScriptedBackend, Tokentap) {
    scripted_tokentap_with(Tokens::Fake, script, extra).await
}

pub async fn scripted_tokentap_with(
    tokens: Tokens,
    script: Script,
    extra: &[&str],
) -> (ScriptedBackend, Tokentap) {
    let backend = ScriptedBackend::start(tokens, script).await;
    let mut config = TokentapConfig::new(backend.url.clone(), "vllm");
    for a in extra {
        config = config.arg(*a);
    }
    let tokentap = Tokentap::start(config).await;
    (backend, tokentap)
}

/// A minimal valid Chat Completions request.
pub fn hello_request(stream: bool) -> Value {
    json!({
        "model": "m",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        "stream": stream,
        "max_tokens": 64,
    })
}

/// POSTs `body` (raw bytes) to `url`; returns the status and the body parsed as JSON
/// (`Value::Null` if it is not JSON).
pub async fn post_raw(
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<reqwest::Body>,
) -> (u16, Value) {
    let mut req = http_client()
        .post(url)
        .header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req
        .body(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.expect("response body");
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// POSTs a JSON request to tokentap's chat route.
pub async fn post_chat(
    tokentap: &Tokentap,
    headers: &[(&str, &str)],
    body: &Value,
) -> (u16, Value) {
    post_raw(
        &tokentap.chat_url(),
        headers,
        serde_json::to_vec(body).unwrap(),
    )
    .await
}

/// POSTs a streaming request and returns the status and the whole SSE text.
pub async fn post_stream(url: &str, headers: &[(&str, &str)], body: &Value) -> (u16, String) {
    let mut req = http_client().post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = resp.status().as_u16();
    if status == 200 {
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        assert!(
            ct.starts_with("text/event-stream"),
            "stream content-type {ct:?}"
        );
    }
    (status, resp.text().await.unwrap_or_default())
}
