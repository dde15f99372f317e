//! Engine options a caller chooses (issue 37 item 11), through the real binary in front of
//! the scripted vLLM double (which records every body it receives): on `tokentap proxy` an
//! option out of bounds — vLLM's old `chat_template_kwargs.chat_template` hole — gets a 400
//! naming it and never reaches the engine, while options within bounds arrive as sent; on a
//! rollout node (`tokentap serve`) an option outside the node's set is absent from what the
//! engine received and noted on the record, and an allowed one arrives.

use std::time::Duration;

use serde_json::{json, Value};
use tokentap_e2e::fixtures::{post_chat, post_raw, scripted_tokentap};
use tokentap_e2e::node_api;
use tokentap_e2e::procs::free_port;
use tokentap_e2e::scripted::{always, counting_replies, Reply, ScriptedBackend, Tokens};
use tokentap_e2e::sse::assert_openai_error;
use tokentap_e2e::tokentap::read_spool;
use tokentap_e2e::ErrorKind;

const SESSION: (&str, &str) = ("x-tokentap-session", "engine-options");

fn chat_with(options: Value) -> Value {
    let mut body = json!({"model": "m", "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}]});
    body.as_object_mut()
        .unwrap()
        .extend(options.as_object().unwrap().clone());
    body
}

#[tokio::test(flavor = "multi_thread")]
async fn an_option_out_of_bounds_is_refused_before_the_engine_and_options_within_arrive() {
    let (backend, tokentap) = scripted_tokentap(always(Reply::text("hi")), &[]).await;

    // A Jinja template of the caller's choosing, rendered by the engine (vLLM before it
    // filtered chat_template_kwargs).
    let template = "{% for x in range(10**9) %}{% endfor %}";
    let (status, v) = post_chat(
        &tokentap,
        &[SESSION],
        &chat_with(json!({"chat_template_kwargs": {"chat_template": template}})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let e = assert_openai_error(&v);
    assert_eq!(e["type"], "invalid_request_error");
    assert_eq!(e["param"], "chat_template_kwargs.chat_template");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("'chat_template' is not a chat template variable"),
        "{v}"
    );
    // Responses: the parameter as Codex writes it.
    let (status, v) = post_raw(
        &format!("{}/responses", tokentap.base_url()),
        &[SESSION],
        json!({"model": "m", "input": "hi", "reasoning": {"effort": "maximal"}}).to_string(),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(assert_openai_error(&v)["param"], "reasoning.effort");
    let r = tokentap.wait_record(2).await;
    assert_eq!(
        r.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::InvalidRequest)
    );
    assert!(r.backend_request.is_none());
    assert!(
        backend.requests().is_empty(),
        "a refused call reached the engine: {:?}",
        backend.requests()
    );
    assert_eq!(
        tokentap
            .metric("tokentap_engine_options_refused_total{option=\"chat_template_kwargs\"}")
            .await,
        Some(1.0)
    );

    // Within bounds, every option arrives as sent (`proxy` lets callers set all of them).
    let options = json!({
        "chat_template_kwargs": {"enable_thinking": false},
        "logit_bias": {"50256": -100, "11": 2.5},
        "response_format": {"type": "json_object"},
        "n_probs": 3,
        "repetition_penalty": 1.05,
        "reasoning_effort": "low",
    });
    let (status, v) = post_chat(&tokentap, &[SESSION], &chat_with(options.clone())).await;
    assert_eq!(status, 200, "{v}");
    let received = backend.requests();
    assert_eq!(received.len(), 1);
    for (name, value) in options.as_object().unwrap() {
        assert_eq!(&received[0][name], value, "{name} as the engine got it");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_proxy_given_engine_options_drops_the_others_and_notes_them() {
    let (backend, tokentap) = scripted_tokentap(
        always(Reply::text("hi")),
        &["--engine-option", "parallel_tool_calls"],
    )
    .await;
    let (status, v) = post_chat(
        &tokentap,
        &[SESSION],
        &chat_with(json!({"parallel_tool_calls": false, "n_probs": 5})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let received = &backend.requests()[0];
    assert_eq!(received["parallel_tool_calls"], false);
    assert!(received.get("n_probs").is_none(), "{received}");
    let r = tokentap.wait_record(1).await;
    assert!(
        r.normalizations.iter().any(|n| n.kind == "dropped_field"
            && n.detail.contains("'n_probs'")
            && n.detail.contains("not allowed")),
        "{:?}",
        r.normalizations
    );
    let sent = &r.backend_request.as_ref().unwrap().extra;
    assert!(!sent.contains_key("n_probs"), "recorded as sent: {sent:?}");
}

const TOKEN: &str = "e2e-node-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_node_sends_only_the_options_its_samples_may_set() {
    let engine = ScriptedBackend::start(Tokens::FakeChat, counting_replies()).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("project")).unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _node = node_api::start_serve(dir.path(), port, &engine.url, TOKEN, &[]).await;

    // An agent setting an option the node allows by default and two it does not.
    let body = chat_with(json!({
        "parallel_tool_calls": false,
        "logit_bias": {"5": 100},
        "chat_template_kwargs": {"enable_thinking": true},
    }))
    .to_string();
    let script = format!(
        "curl -sS --max-time 20 -o answer.json -w '%{{http_code}}' \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -H \"authorization: Bearer $OPENAI_API_KEY\" -d '{body}' > code.txt"
    );
    node_api::submit(
        &base,
        TOKEN,
        &json!({
            "task_id": "options",
            "instruction": "x",
            "workspace": {"dir": {"path": dir.path().join("project")}},
            "harness": {"name": "command", "argv": ["sh", "-c", script]},
            "evaluator": {"kind": "session-completed"},
        }),
    )
    .await;
    let done = node_api::results_within(&base, TOKEN, 0, 1, 10, Duration::from_secs(60)).await;
    let sample_id = done[0]["sample_id"].as_str().unwrap();
    let work = dir.path().join("node/samples").join(sample_id).join("work");
    let code = std::fs::read_to_string(work.join("code.txt")).unwrap_or_default();
    assert_eq!(code, "200", "{}", done[0]);

    let received = engine.requests();
    assert_eq!(received.len(), 1, "{received:?}");
    assert_eq!(received[0]["parallel_tool_calls"], false);
    for absent in ["logit_bias", "chat_template_kwargs"] {
        assert!(
            received[0].get(absent).is_none(),
            "{absent}: {}",
            received[0]
        );
    }

    let records = read_spool(&dir.path().join("node/spool"));
    assert_eq!(records.len(), 1);
    let r = &records[0];
    for dropped in ["'logit_bias'", "'chat_template_kwargs'"] {
        assert!(
            r.normalizations.iter().any(|n| n.kind == "dropped_field"
                && n.detail.contains(dropped)
                && n.detail.contains("not allowed on this node")),
            "{dropped}: {:?}",
            r.normalizations
        );
    }
    let sent = &r.backend_request.as_ref().unwrap().extra;
    assert_eq!(
        sent.keys().collect::<Vec<_>>(),
        ["parallel_tool_calls"],
        "the record shows only what was sent"
    );

    let metrics = node_api::get_text(&format!("{base}/metrics"), TOKEN).await;
    for option in ["logit_bias", "chat_template_kwargs"] {
        let line = format!("tokentap_engine_options_dropped_total{{option=\"{option}\"}} 1");
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
}
