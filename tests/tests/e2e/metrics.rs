//! The proxy's metrics answer "where does the time go" (real `tokentap proxy`, the scripted
//! engine): tokens by engine, model, harness and policy version; engine, proxy and harness
//! time per session; sessions active; errors by kind; labels a client chooses stay bounded.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{Reply, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};

/// Every sample of `name` on the proxy's `/metrics`: its labels and value.
async fn samples(proxy: &Tokentap, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let text = http_client()
        .get(format!("{}/metrics", proxy.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let (n, labels) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        if n != name {
            continue;
        }
        let labels = labels
            .split("\",")
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_owned(), v.trim_matches('"').to_owned())
            })
            .collect();
        out.push((labels, value.parse().unwrap()));
    }
    out
}

/// The value of the one sample of `name` whose labels include `want`.
async fn value(proxy: &Tokentap, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    samples(proxy, name)
        .await
        .into_iter()
        .find(|(labels, _)| {
            want.iter()
                .all(|(k, v)| labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|(_, v)| v)
}

async fn call(proxy: &Tokentap, session: &str, user_agent: &str, model: &str) -> u16 {
    http_client()
        .post(proxy.chat_url())
        .header("x-tokentap-session", session)
        .header("user-agent", user_agent)
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_tokens_and_sessions_are_counted_per_engine_model_and_harness() {
    let engine = ScriptedBackend::start(
        Tokens::FakeChat,
        Arc::new(|req: &Value, i| {
            if req["messages"][0]["content"] == "fail" {
                return Reply::Error {
                    status: 500,
                    body: json!({"error": {"message": "engine fell over"}}),
                };
            }
            Reply::Text(format!("answer {i}"))
        }),
    )
    .await;
    let config = TokentapConfig::new(&engine.url, "vllm")
        .arg("--policy-version")
        .arg("step-7");
    let proxy = Tokentap::start(config).await;
    let claude = "claude-cli/2.1.330 (external, sdk-cli)";
    // A Claude Code session: three calls, its "tools" running 400 ms between them.
    for i in 0..3 {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        assert_eq!(call(&proxy, "cc-1", claude, "whatever").await, 200);
    }
    // A Codex session with one call, and a client nobody knows.
    assert_eq!(call(&proxy, "cx-1", "codex_exec/0.169.0", "m").await, 200);
    assert_eq!(call(&proxy, "other-1", "curl/8", "m").await, 200);
    proxy.wait_records(5).await;

    let model = samples(&proxy, "tokentap_completion_tokens_total").await[0].0["model"].clone();
    let cc = [
        ("engine", "vllm"),
        ("model", model.as_str()),
        ("harness", "claude_code"),
    ];
    let completion = value(
        &proxy,
        "tokentap_completion_tokens_total",
        &[cc[0], cc[1], cc[2], ("policy_version", "step-7")],
    )
    .await
    .expect("completion tokens of Claude Code's calls");
    assert!(completion >= 3.0, "{completion}");
    assert!(value(&proxy, "tokentap_prompt_tokens_total", &cc)
        .await
        .is_some_and(|v| v > 0.0));
    for h in ["codex", "other"] {
        assert!(
            value(
                &proxy,
                "tokentap_completion_tokens_total",
                &[("harness", h)]
            )
            .await
            .is_some(),
            "{h}"
        );
    }
    // Harness time: the two 400 ms gaps of cc-1, and nothing for the one-call sessions.
    let harness = value(&proxy, "tokentap_harness_seconds_total", &cc)
        .await
        .expect("harness time of cc-1");
    assert!((0.75..5.0).contains(&harness), "{harness}");
    assert_eq!(
        value(
            &proxy,
            "tokentap_harness_seconds_total",
            &[("harness", "codex")]
        )
        .await
        .unwrap_or(0.0),
        0.0
    );
    assert!(value(&proxy, "tokentap_engine_seconds_total", &cc)
        .await
        .is_some_and(|v| v > 0.0));
    assert!(value(&proxy, "tokentap_proxy_seconds_total", &cc)
        .await
        .is_some_and(|v| v > 0.0));
    assert_eq!(
        value(&proxy, "tokentap_sessions_active", &cc).await,
        Some(1.0)
    );
    assert_eq!(
        value(&proxy, "tokentap_sessions_active", &[("harness", "codex")]).await,
        Some(1.0)
    );
    assert_eq!(
        value(
            &proxy,
            "tokentap_inflight_calls",
            &[("engine", "vllm"), ("model", model.as_str())]
        )
        .await,
        Some(0.0)
    );
    assert!(value(
        &proxy,
        "tokentap_time_to_first_token_seconds_count",
        &[("engine", "vllm"), ("wire_api", "chat_completions")]
    )
    .await
    .is_some_and(|v| v >= 5.0));

    // An engine error is counted by kind.
    let status = http_client()
        .post(proxy.chat_url())
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "fail"}]}))
        .send()
        .await
        .unwrap()
        .status();
    assert!(status.is_server_error(), "{status}");
    // Counted once the failed call is done (its answer may reach the client first): polled.
    let errors = || {
        value(
            &proxy,
            "tokentap_call_errors_total",
            &[("engine", "vllm"), ("kind", "backend_error")],
        )
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while errors().await.is_none() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(errors().await, Some(1.0));
    // Unattributed one-call sessions are not sessions.
    let active: f64 = samples(&proxy, "tokentap_sessions_active")
        .await
        .iter()
        .map(|(_, v)| v)
        .sum();
    assert_eq!(active, 3.0);
}
