//! Golden tests for Anthropic Messages against real Claude Code traffic (testdata/harness-wire:
//! requests Claude Code really sent, and SSE bodies it accepted).

use serde_json::{json, Value};
use tokentap_wire::canonical::{Delta, FinishReason, Role, ToolCallDelta, Usage};
use tokentap_wire::messages::Messages;
use tokentap_wire::{ResponseMeta, WireCodec};

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/testdata/harness-wire/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn harness_request(name: &str) -> Value {
    serde_json::from_str(&fixture(name)).unwrap()
}

fn body(v: &Value) -> Vec<u8> {
    serde_json::to_vec(&v["body"]).unwrap()
}

/// SSE frames as (event name, data), with the per-answer message id removed.
fn frames(sse: &str) -> Vec<(String, Value)> {
    tokentap_e2e::sse::typed_events(sse)
        .into_iter()
        .map(|(event, mut data)| {
            if let Some(m) = data.get_mut("message").and_then(Value::as_object_mut) {
                assert!(m["id"].as_str().unwrap().starts_with("msg_"));
                m.remove("id");
            }
            (event, data)
        })
        .collect()
}

/// Frames compared by structure: the numbers in `message_start` usage are each server's own,
/// so only their keys count; `message_delta` may add the cumulative counts Anthropic's API adds
/// there (`input_tokens` and the cache counts) beside `output_tokens`.
fn shape(mut f: Vec<(String, Value)>) -> Vec<(String, Value)> {
    for (event, data) in &mut f {
        if event == "message_start" {
            for (_, n) in data["message"]["usage"].as_object_mut().unwrap() {
                *n = json!(0);
            }
        }
        if event == "message_delta" {
            data["usage"]
                .as_object_mut()
                .unwrap()
                .retain(|k, _| k == "output_tokens");
        }
    }
    f
}

fn meta() -> ResponseMeta {
    ResponseMeta::new("msg_0123", 1, "m")
}

fn text(s: &str) -> Delta {
    Delta {
        content: Some(s.into()),
        ..Default::default()
    }
}

fn render_hello() -> Vec<(String, Value)> {
    let mut r = Messages.stream_renderer(meta(), true);
    let mut out = Vec::new();
    r.start(&mut out);
    // The engine's prompt ids, as the relay passes them on before the first content.
    r.prompt_tokens(10);
    for piece in ["Hello ", "from ", "mock. "] {
        r.delta(&text(piece), &mut out);
    }
    r.finish(
        FinishReason::Stop,
        Some(Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            total_tokens: 15,
            reasoning_tokens: None,
        }),
        &mut out,
    );
    frames(&String::from_utf8(out).unwrap())
}

#[test]
fn streamed_answer_matches_the_full_sequence_claude_code_accepted() {
    let ours = render_hello();
    let delta = ours.iter().find(|(e, _)| e == "message_delta").unwrap();
    assert_eq!(delta.1["usage"]["input_tokens"], 10);
    // The prompt's size opens the message, as in the accepted stream.
    let start = &ours[0].1["message"]["usage"];
    let accepted = &frames(&fixture("claude-messages-full.sse"))[0].1["message"]["usage"];
    assert_eq!(start["input_tokens"], accepted["input_tokens"]);
    assert_eq!(
        shape(ours),
        shape(frames(&fixture("claude-messages-full.sse")))
    );
}

#[test]
fn every_frame_of_the_minimal_accepted_stream_is_sent_in_order() {
    let ours = shape(render_hello());
    let minimal = shape(frames(&fixture("claude-messages-minimal.sse")));
    let mut rest = ours.iter();
    for want in &minimal {
        assert!(
            rest.any(|got| got == want),
            "frame {want:?} missing (or out of order) in {ours:?}"
        );
    }
}

#[test]
fn a_tool_call_stream_has_the_documented_event_shapes() {
    let mut r = Messages.stream_renderer(meta(), true);
    let mut out = Vec::new();
    r.start(&mut out);
    r.delta(
        &Delta {
            reasoning: Some("Need a file.".into()),
            ..Default::default()
        },
        &mut out,
    );
    r.delta(&text("Writing it."), &mut out);
    r.delta(
        &Delta {
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("call_7".into()),
                name: Some("Bash".into()),
                arguments: Some("{\"command\":\"echo hi > f\"}".into()),
            }],
            ..Default::default()
        },
        &mut out,
    );
    r.finish(FinishReason::ToolCalls, None, &mut out);
    let got = frames(&String::from_utf8(out).unwrap());
    let want = vec![
        json!({"type": "message_start", "message": {"type": "message", "role": "assistant", "model": "m", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Need a file."}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "tokentap.msg_0123.0"}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Writing it."}}),
        json!({"type": "content_block_stop", "index": 1}),
        json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_call_7", "name": "Bash", "input": {}}}),
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"command\":\"echo hi > f\"}"}}),
        json!({"type": "content_block_stop", "index": 2}),
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0}}),
        json!({"type": "message_stop"}),
    ];
    assert_eq!(got.into_iter().map(|(_, d)| d).collect::<Vec<_>>(), want);
}

#[test]
fn real_claude_code_requests_parse() {
    for name in ["claude.json", "claude-turn2.json"] {
        let req = harness_request(name);
        assert!(req["path"].as_str().unwrap().starts_with("/v1/messages"));
        let parsed = Messages
            .parse(&body(&req))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = &parsed.request;
        assert!(r.stream && parsed.include_usage, "{name}");
        assert_eq!(r.model, "mock-model");
        assert_eq!(r.sampling.max_tokens, Some(32000), "{name}");
        assert_eq!(r.tools.len(), 12, "{name}");
        assert!(r.tools.iter().all(|t| t.parameters.is_some()));

        // The billing header is gone from the leading system message, and listed.
        let system = &r.messages[0];
        assert_eq!(system.role, Role::System, "{name}");
        let sys_text = system.joined_text();
        assert!(
            sys_text.starts_with("You are a Claude agent"),
            "{name}: {sys_text:.80}"
        );
        assert!(!serde_json::to_string(r)
            .unwrap()
            .contains("x-anthropic-billing-header"));
        let billing: Vec<_> = parsed
            .normalizations
            .iter()
            .filter(|n| n.kind == "stripped_billing_header")
            .collect();
        assert_eq!(billing.len(), 1, "{name}");
        assert!(billing[0].detail.contains("cc_version="), "{name}");

        // Claude Code's mid-conversation system message stays in place.
        assert_eq!(r.messages[1].role, Role::User);
        assert_eq!(r.messages[1].content.len(), 2);
        assert_eq!(r.messages[2].role, Role::System, "{name}");
        assert!(r.messages[2].joined_text().starts_with("# Environment"));

        for field in [
            "metadata",
            "context_management",
            "output_config",
            "thinking",
        ] {
            assert!(
                parsed
                    .normalizations
                    .iter()
                    .any(|n| n.kind == "dropped_field" && n.detail.contains(field)),
                "{name}: no note for {field}: {:?}",
                parsed.normalizations
            );
        }
    }

    let turn2 = Messages
        .parse(&body(&harness_request("claude-turn2.json")))
        .unwrap()
        .request;
    assert_eq!(turn2.messages.len(), 5);
    let call = &turn2.messages[3].tool_calls[0];
    assert_eq!(turn2.messages[3].role, Role::Assistant);
    assert_eq!(call.name, "Bash");
    assert_eq!(
        serde_json::from_str::<Value>(&call.arguments).unwrap(),
        json!({"command": "echo hi > mock_tool_ran.txt", "description": "write file"})
    );
    // Key order is the harness's, not alphabetical.
    assert!(call.arguments.starts_with("{\"command\""));
    let result = &turn2.messages[4];
    assert_eq!(result.role, Role::Tool);
    assert_eq!(result.tool_call_id.as_deref(), Some(call.id.as_str()));
    assert_eq!(result.joined_text(), "(Bash completed with no output)");
}

#[test]
fn claude_codes_compaction_turn_drops_tool_choice_without_tools() {
    let mut req = harness_request("claude.json");
    req["body"]["tools"] = json!([]);
    req["body"]["tool_choice"] = json!({"type": "auto"});
    let parsed = Messages.parse(&body(&req)).unwrap();
    assert!(parsed.request.tools.is_empty());
    assert_eq!(parsed.request.tool_choice, None);
    assert!(parsed
        .normalizations
        .iter()
        .any(|n| n.kind == "dropped_tool_choice"));
}

#[test]
fn a_tool_result_for_an_unknown_tool_use_is_rejected_with_its_path() {
    let mut req = harness_request("claude-turn2.json");
    req["body"]["messages"][3]["content"][0]["tool_use_id"] = json!("toolu_other");
    let e = Messages.parse(&body(&req)).unwrap_err();
    assert_eq!(
        e.param.as_deref(),
        Some("messages[3].content[0].tool_use_id")
    );
    let (status, b) = Messages.render_error(&e.into());
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(status, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("toolu_other"));
}
