//! The Responses and Messages APIs through the real tokentap binary, in front of the
//! ScriptedBackend test double (stand-in token ids): exact event sequences streamed and whole,
//! bad input answered with each API's own 400 (recorded, the engine never called), context
//! overflows in the shape harnesses recognise, and the endpoints around the model calls.

use serde_json::{json, Value};
use tokentap_e2e::checks::assert_complete_token_data;
use tokentap_e2e::fixtures::{post_raw, post_stream, scripted_tokentap};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{always, Reply};
use tokentap_e2e::tokentap::Tokentap;
use tokentap_e2e::ErrorKind;

const TEXT: &str = "Hello there.";

fn shell_args() -> Value {
    json!({"command": "ls"})
}

/// (event name, data) of each SSE frame; each name is its data's `type`.
fn events(sse: &str) -> Vec<(String, Value)> {
    tokentap_e2e::sse::typed_events(sse)
}

/// Consecutive duplicates collapsed (`a, b, b, b, c` → `a, b, c`).
fn shape(ev: &[(String, Value)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (n, _) in ev {
        if out.last() != Some(n) {
            out.push(n.clone());
        }
    }
    out
}

fn responses_url(t: &Tokentap) -> String {
    format!("{}/v1/responses", t.url)
}

fn messages_url(t: &Tokentap) -> String {
    format!("{}/v1/messages?beta=true", t.url)
}

const ANTHROPIC: &[(&str, &str)] = &[
    ("anthropic-version", "2023-06-01"),
    ("anthropic-beta", "interleaved-thinking-2025-05-14"),
    ("x-api-key", "sk-ant-e2e"),
];

fn responses_request(stream: bool, tools: bool) -> Value {
    let mut r = json!({
        "model": "m", "instructions": "Be brief.", "stream": stream,
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    });
    if tools {
        r["tools"] = json!([{"type": "function", "name": "shell", "description": "Run", "parameters": {"type": "object"}}]);
    }
    r
}

fn messages_request(stream: bool, tools: bool) -> Value {
    let mut r = json!({
        "model": "m", "max_tokens": 64, "stream": stream,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "hi"}],
    });
    if tools {
        r["tools"] =
            json!([{"name": "shell", "description": "Run", "input_schema": {"type": "object"}}]);
    }
    r
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_streams_the_exact_event_sequence_for_text_and_tool_calls() {
    let (_b, t) = scripted_tokentap(always(Reply::text(TEXT)), &[]).await;
    let (status, sse) = post_stream(&responses_url(&t), &[], &responses_request(true, false)).await;
    assert_eq!(status, 200, "{sse}");
    let ev = events(&sse);
    assert_eq!(
        shape(&ev),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (name, data)) in ev.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i, "sequence numbers count from 0");
    }
    let text: String = ev
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(text, TEXT);
    let done = &ev.last().unwrap().1["response"];
    assert_eq!(done["status"], "completed");
    assert!(done["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(
        done["usage"]["output_tokens"],
        TEXT.chars().count() + 1,
        "the text and the end of turn"
    );

    let (_b, t) = scripted_tokentap(always(Reply::tool_call("shell", shell_args())), &[]).await;
    let (status, sse) = post_stream(&responses_url(&t), &[], &responses_request(true, true)).await;
    assert_eq!(status, 200, "{sse}");
    let ev = events(&sse);
    assert_eq!(
        shape(&ev),
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    let item = &ev[ev.len() - 2].1["item"];
    assert_eq!(item["type"], "function_call");
    assert_eq!(item["name"], "shell");
    assert_eq!(
        serde_json::from_str::<Value>(item["arguments"].as_str().unwrap()).unwrap(),
        shell_args()
    );
    let r = t.wait_record(1).await;
    assert_eq!(r.wire_api.as_str(), "responses");
    assert_complete_token_data(&r);
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_streams_the_exact_event_sequence_for_text_and_tool_use() {
    let (_b, t) = scripted_tokentap(always(Reply::text(TEXT)), &[]).await;
    let (status, sse) =
        post_stream(&messages_url(&t), ANTHROPIC, &messages_request(true, false)).await;
    assert_eq!(status, 200, "{sse}");
    let ev = events(&sse);
    assert_eq!(
        shape(&ev),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let text: String = ev
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "text_delta");
            d["delta"]["text"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(text, TEXT);
    let delta = &ev[ev.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(
        delta["usage"]["output_tokens"],
        TEXT.chars().count() + 1,
        "the text and the end of turn"
    );

    let (_b, t) = scripted_tokentap(always(Reply::tool_call("shell", shell_args())), &[]).await;
    let (status, sse) =
        post_stream(&messages_url(&t), ANTHROPIC, &messages_request(true, true)).await;
    assert_eq!(status, 200, "{sse}");
    let ev = events(&sse);
    assert_eq!(
        shape(&ev),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let start = &ev[1].1["content_block"];
    assert_eq!(start["type"], "tool_use");
    assert_eq!(start["name"], "shell");
    assert!(start["id"].as_str().unwrap().starts_with("toolu_"));
    let json: String = ev
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&json).unwrap(), shell_args());
    assert_eq!(ev[ev.len() - 2].1["delta"]["stop_reason"], "tool_use");
    let r = t.wait_record(1).await;
    assert_eq!(r.wire_api.as_str(), "messages");
    assert_complete_token_data(&r);
}

#[tokio::test(flavor = "multi_thread")]
async fn whole_answers_have_each_apis_object_shape() {
    let (_b, t) = scripted_tokentap(always(Reply::text(TEXT)), &[]).await;
    let (status, v) = post_raw(
        &responses_url(&t),
        &[],
        serde_json::to_vec(&responses_request(false, false)).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["output"][0]["content"][0]["text"], TEXT);

    let (status, v) = post_raw(
        &messages_url(&t),
        ANTHROPIC,
        serde_json::to_vec(&messages_request(false, false)).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(v["content"][0], json!({"type": "text", "text": TEXT}));
    assert_eq!(v["stop_reason"], "end_turn");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"));
}

/// A bad request: the API's own 400 naming the problem, a record of it, and no engine call.
async fn rejected(api: &str, body: Vec<u8>, expect_param: Option<&str>, expect_in_message: &str) {
    let (backend, t) = scripted_tokentap(always(Reply::text(TEXT)), &[]).await;
    let (url, headers) = if api == "responses" {
        (responses_url(&t), &[][..])
    } else {
        (messages_url(&t), ANTHROPIC)
    };
    let (status, v) = post_raw(&url, headers, body).await;
    assert_eq!(status, 400, "{api}: {v}");
    let message = if api == "responses" {
        let e = &v["error"];
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        if let Some(p) = expect_param {
            assert_eq!(e["param"], p, "{v}");
        }
        e["message"].as_str().unwrap().to_owned()
    } else {
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        v["error"]["message"].as_str().unwrap().to_owned()
    };
    assert!(
        message.contains(expect_in_message),
        "{api}: {message:?} should mention {expect_in_message:?}"
    );
    let r = t.wait_record(1).await;
    assert_eq!(r.response_status, 400);
    assert_eq!(r.error.as_ref().unwrap().kind, ErrorKind::InvalidRequest);
    assert!(backend.requests().is_empty(), "the engine was called");
}

fn body(v: Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_bad_input_gets_openais_400_naming_the_problem() {
    let item = |i: Value| body(json!({"model": "m", "input": [i]}));
    rejected(
        "responses",
        item(json!({"type": "hologram"})),
        Some("input[0].type"),
        "hologram",
    )
    .await;
    rejected(
        "responses",
        item(json!({"type": "function_call_output", "call_id": "call_nope", "output": "x"})),
        Some("input[0].call_id"),
        "call_nope",
    )
    .await;
    rejected(
        "responses",
        item(json!({"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{not json"})),
        Some("input[0].arguments"),
        "JSON",
    )
    .await;
    rejected("responses", body(json!({"input": "hi"})), None, "model").await;
    rejected("responses", body(json!({"model": "m"})), None, "input").await;
    rejected("responses", b"{\"model\": ".to_vec(), None, "JSON").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn messages_bad_input_gets_anthropics_400_naming_the_problem() {
    let msgs = |m: Value| body(json!({"model": "m", "max_tokens": 8, "messages": m}));
    rejected(
        "messages",
        msgs(json!([{"role": "user", "content": [{"type": "video"}]}])),
        None,
        "video",
    )
    .await;
    rejected(
        "messages",
        msgs(json!([
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shell", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}
        ])),
        None,
        "toolu_9",
    )
    .await;
    rejected(
        "messages",
        msgs(json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shell", "input": "ls -la"}]}])),
        None,
        "input",
    )
    .await;
    rejected(
        "messages",
        body(json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})),
        None,
        "max_tokens",
    )
    .await;
    rejected(
        "messages",
        body(json!({"model": "m", "max_tokens": 8})),
        None,
        "messages",
    )
    .await;
    rejected("messages", b"not json".to_vec(), None, "JSON").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn context_overflow_answers_what_each_harness_recognises() {
    let (_b, t) = scripted_tokentap(always(Reply::vllm_context_overflow()), &[]).await;
    let (status, v) = post_raw(
        &responses_url(&t),
        &[],
        body(responses_request(false, false)),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exceeds the context window"),
        "{v}"
    );
    // Streamed requests too: the overflow comes before the first event, as a plain 400.
    let (status, text) =
        post_stream(&responses_url(&t), &[], &responses_request(true, false)).await;
    assert_eq!(status, 400, "{text}");

    let (status, v) = post_raw(
        &messages_url(&t),
        ANTHROPIC,
        body(messages_request(true, false)),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("prompt is too long"),
        "{v}"
    );
    let records = t.wait_records(3).await;
    assert!(records
        .iter()
        .all(|r| r.error.as_ref().unwrap().kind == ErrorKind::ContextLengthExceeded));
}

#[tokio::test(flavor = "multi_thread")]
async fn the_endpoints_around_model_calls_answer_as_harnesses_expect() {
    let (backend, t) = scripted_tokentap(always(Reply::text(TEXT)), &[]).await;
    let client = http_client();

    // count_tokens: the engine's own count, no generation, no record.
    let (status, v) = post_raw(
        &format!("{}/v1/messages/count_tokens?beta=true", t.url),
        ANTHROPIC,
        body(json!({"model": "m", "messages": [{"role": "user", "content": "count me"}]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert!(v["input_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(backend.requests().is_empty(), "count_tokens generated");

    // Claude Code's connectivity probe.
    let r = client
        .head(format!("{}/api/hello", t.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);

    // Codex's WebSocket attempt: refused with 426, in OpenAI's error shape.
    let r = client
        .get(responses_url(&t))
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 426);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("POST /v1/responses"));

    // An unknown route from an Anthropic client: Anthropic's 404 shape.
    let (status, v) = post_raw(
        &format!("{}/v1/complete", t.url),
        ANTHROPIC,
        body(json!({})),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "not_found_error");
    assert!(t.records().is_empty(), "non-call routes leave no records");
}
