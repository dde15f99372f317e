//! Secrets and files: credentials a harness sends anywhere in a request (MCP server headers,
//! tool configs, non-JSON bodies) never reach the spool, and everything tokentap writes about
//! a capture is readable by its own user only.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use tokentap_e2e::fixtures::{post_raw, scripted_tokentap};
use tokentap_e2e::scripted::{always, Reply};

/// Secrets an attacker-or-user planted in places the old top-level redaction missed.
const MCP_BEARER: &str = "mcp0bearer0a1b2c3d4e5f6a7b8";
const MCP_AUTH_TOKEN: &str = "mcpAuthToken9f8e7d6c5b4a";
const TOOL_API_KEY: &str = "toolcfgKey1122334455";
const TEXT_KEY: &str = "sk-ant-api03-textBodySecret778899";

#[tokio::test(flavor = "multi_thread")]
async fn mcp_and_nested_credentials_never_reach_the_spool() {
    let (_backend, tokentap) = scripted_tokentap(always(Reply::text("ok")), &[]).await;
    let base = tokentap.url.clone();

    // Responses API with a remote MCP server whose headers carry a bearer token, and a
    // function tool with a credential in an extra config object.
    let responses = json!({
        "model": "m",
        "input": "hello",
        "tools": [
            {"type": "mcp", "server_label": "gh", "server_url": "https://mcp.example.test/sse",
             "headers": {"Authorization": format!("Bearer {MCP_BEARER}")}},
            {"type": "function", "name": "lookup", "parameters": {"type": "object",
             "properties": {"token": {"type": "string"}}},
             "config": {"api_key": TOOL_API_KEY}}
        ]
    });
    let (status, answer) = post_raw(
        &format!("{base}/v1/responses"),
        &[],
        serde_json::to_vec(&responses).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{answer}");

    // Anthropic Messages with an MCP connector's authorization_token.
    let messages = json!({
        "model": "m", "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        "mcp_servers": [{"type": "url", "url": "https://mcp.example.test", "name": "x",
                         "authorization_token": MCP_AUTH_TOKEN}]
    });
    let (status, answer) = post_raw(
        &format!("{base}/v1/messages"),
        &[("anthropic-version", "2023-06-01")],
        serde_json::to_vec(&messages).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{answer}");

    // A body that is not JSON at all, with a key in it: refused, and recorded redacted.
    let (status, _) = post_raw(
        &format!("{base}/v1/chat/completions"),
        &[],
        format!("model=m&note=hello&key={TEXT_KEY}\nAuthorization: Bearer {MCP_BEARER}"),
    )
    .await;
    assert_eq!(status, 400);

    let records = tokentap.wait_records(3).await;
    assert_eq!(records.len(), 3);
    let spool = String::from_utf8_lossy(&tokentap.spool_bytes()).into_owned();
    for secret in [
        MCP_BEARER,
        MCP_AUTH_TOKEN,
        TOOL_API_KEY,
        TEXT_KEY,
        "textBodySecret",
    ] {
        assert!(!spool.contains(secret), "{secret} reached the spool");
    }
    // What is not a secret is kept: the MCP server's URL, the parameter schema, the text.
    let r = &records[0];
    let body = r.request.body.as_ref().expect("JSON body kept").to_value();
    assert_eq!(
        body["tools"][0]["server_url"],
        "https://mcp.example.test/sse"
    );
    assert_eq!(body["tools"][0]["headers"]["Authorization"], "[redacted]");
    assert_eq!(
        body["tools"][1]["parameters"]["properties"]["token"]["type"],
        "string"
    );
    let text = records[2]
        .request
        .body_text
        .as_deref()
        .expect("non-JSON body kept as text");
    assert!(text.contains("note=hello"), "{text}");
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
        & 0o777
}

/// Every file under `dir` is 0600 and every directory 0700; returns how many files there were.
fn assert_owner_only(dir: &Path) -> usize {
    assert_eq!(mode(dir), 0o700, "{}", dir.display());
    let mut files = 0;
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            files += assert_owner_only(&p);
        } else {
            assert_eq!(mode(&p), 0o600, "{}", p.display());
            files += 1;
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread")]
async fn spool_and_trace_files_are_owner_only_after_a_capture() {
    let traces = tempfile::tempdir().unwrap();
    let out = traces.path().join("out");
    let (_backend, tokentap) = scripted_tokentap(
        always(Reply::text("ok")),
        &["--traces", out.to_str().unwrap(), "--session-idle", "1"],
    )
    .await;
    let (status, _) = post_raw(
        &tokentap.chat_url(),
        &[("x-tokentap-session", "modes-1")],
        serde_json::to_vec(&tokentap_e2e::fixtures::hello_request(false)).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    tokentap.wait_records(1).await;
    // The session goes idle and its traces are written (and checkpointed).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !(out.join("traces.jsonl").exists()
        && std::fs::metadata(out.join("traces.jsonl")).unwrap().len() > 0
        && out.join("checkpoint.json").exists())
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no traces written: {}",
            tokentap.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let spool_files = assert_owner_only(&tokentap.spool);
    assert!(spool_files >= 2, "a segment and the lock");
    let trace_files = assert_owner_only(&out);
    assert!(trace_files >= 3, "traces, sessions, checkpoint");
}
