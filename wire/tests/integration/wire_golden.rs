//! Golden tests against real harness traffic (testdata/harness-wire, copied from requests the
//! harnesses really sent and SSE bodies they accepted).

use serde_json::Value;
use tokentap_wire::canonical::{Delta, FinishReason, Role, Usage};
use tokentap_wire::chat_completions::ChatCompletions;
use tokentap_wire::{ResponseMeta, WireCodec};

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!(
        "{}/testdata/harness-wire/{name}",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap()
}

fn harness_body(name: &str) -> Vec<u8> {
    let v: Value = serde_json::from_str(&fixture(name)).unwrap();
    serde_json::to_vec(&v["body"]).unwrap()
}

/// SSE frames as JSON, without the fields that differ per answer (and the `logprobs: null`
/// that OpenAI sends and the reference mock left out).
fn frames(sse: &str) -> Vec<Value> {
    tokentap_e2e::sse::canonical_events(sse)
        .into_iter()
        .map(|e| {
            assert_eq!(
                e.event, "message",
                "a Chat Completions stream names no events"
            );
            if e.data == "[DONE]" {
                return Value::String("[DONE]".into());
            }
            let mut v: Value = serde_json::from_str(&e.data).unwrap();
            for k in ["id", "created", "model"] {
                v.as_object_mut().unwrap().remove(k);
            }
            for c in v["choices"].as_array_mut().unwrap() {
                if c.get("logprobs") == Some(&Value::Null) {
                    c.as_object_mut().unwrap().remove("logprobs");
                }
            }
            v
        })
        .collect()
}

#[test]
fn streamed_answer_matches_the_sequence_harnesses_accepted() {
    let meta = ResponseMeta::new("chatcmpl-1", 1, "m");
    let mut r = ChatCompletions.stream_renderer(meta, true);
    let mut out = Vec::new();
    r.start(&mut out);
    for piece in ["Hello ", "from ", "mock. "] {
        r.delta(
            &Delta {
                content: Some(piece.into()),
                ..Default::default()
            },
            &mut out,
        );
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
    assert_eq!(
        frames(&String::from_utf8(out).unwrap()),
        frames(&fixture("chat-completions-full.sse"))
    );
}

#[test]
fn real_pi_and_qwen_requests_parse() {
    for name in ["pi.json", "pi-turn2.json", "qwen.json", "qwen-turn2.json"] {
        let parsed = ChatCompletions
            .parse(&harness_body(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = &parsed.request;
        assert!(r.stream && parsed.include_usage, "{name}");
        assert!(!r.tools.is_empty(), "{name}");
        assert_eq!(r.messages[0].role, Role::System, "{name}");
        assert!(r.sampling.max_tokens.is_some(), "{name}");
    }
    let turn2 = ChatCompletions
        .parse(&harness_body("qwen-turn2.json"))
        .unwrap()
        .request;
    let call = &turn2.messages[2].tool_calls[0];
    let result = &turn2.messages[3];
    assert_eq!(result.role, Role::Tool);
    assert_eq!(result.tool_call_id.as_deref(), Some(call.id.as_str()));
}
