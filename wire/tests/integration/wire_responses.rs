//! Golden tests for the OpenAI Responses wire module against real Codex traffic
//! (testdata/harness-wire/codex*: requests Codex CLI really sent and SSE bodies it accepted).

use serde_json::Value;
use tokentap_wire::canonical::{Delta, FinishReason, Role, ToolCallDelta, Usage};
use tokentap_wire::responses::Responses;
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

/// Keys whose values differ per answer (ids, timestamps).
const VOLATILE: &[&str] = &["id", "item_id", "created_at"];

/// Drops volatile keys and trailing whitespace of strings (the reference mock trimmed its
/// final text but not its deltas), recursively.
fn normalize(v: &mut Value) {
    match v {
        Value::Object(o) => {
            for k in VOLATILE {
                o.remove(*k);
            }
            o.values_mut().for_each(normalize);
        }
        Value::Array(a) => a.iter_mut().for_each(normalize),
        Value::String(s) => *s = s.trim_end().to_owned(),
        _ => {}
    }
}

/// SSE frames as (event name, normalized JSON); each frame's `event:` must match its `type`.
fn frames(sse: &str) -> Vec<(String, Value)> {
    tokentap_e2e::sse::typed_events(sse)
        .into_iter()
        .map(|(event, mut v)| {
            normalize(&mut v);
            (event, v)
        })
        .collect()
}

/// Whether every field of `want` is in `got` with the same value (arrays element-wise, same
/// length). Our objects may carry more fields than the reference mock sent.
fn contains(got: &Value, want: &Value, path: &str) -> Result<(), String> {
    match (got, want) {
        (Value::Object(g), Value::Object(w)) => w.iter().try_for_each(|(k, wv)| match g.get(k) {
            Some(gv) => contains(gv, wv, &format!("{path}.{k}")),
            None => Err(format!("{path}.{k} missing")),
        }),
        (Value::Array(g), Value::Array(w)) if g.len() == w.len() => g
            .iter()
            .zip(w)
            .enumerate()
            .try_for_each(|(i, (gv, wv))| contains(gv, wv, &format!("{path}[{i}]"))),
        _ if got == want => Ok(()),
        _ => Err(format!("{path}: got {got}, want {want}")),
    }
}

/// Our stream must have exactly the reference's events, in order, each a superset of it.
fn assert_matches_reference(ours: &str, reference: &str) {
    let (ours, reference) = (frames(ours), frames(reference));
    let names = |f: &[(String, Value)]| f.iter().map(|(e, _)| e.clone()).collect::<Vec<_>>();
    assert_eq!(names(&ours), names(&reference));
    for ((event, got), (_, want)) in ours.iter().zip(&reference) {
        if let Err(e) = contains(got, want, event) {
            panic!("{e}\nours: {got}\nreference: {want}");
        }
    }
}

fn meta() -> ResponseMeta {
    ResponseMeta::new("resp_1", 1, "m")
}

fn usage() -> Option<Usage> {
    Some(Usage {
        prompt_tokens: 10,
        completion_tokens: 5,
        total_tokens: 15,
        reasoning_tokens: None,
    })
}

fn text_stream() -> String {
    let mut r = Responses.stream_renderer(meta(), true);
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
    r.finish(FinishReason::Stop, usage(), &mut out);
    String::from_utf8(out).unwrap()
}

#[test]
fn streamed_text_matches_the_sequence_codex_accepted() {
    assert_matches_reference(&text_stream(), &fixture("codex-responses-full.sse"));
}

#[test]
fn streamed_text_carries_what_the_minimal_reference_needed() {
    // The minimal body Codex accepted: just the finished item and response.completed.
    let ours = frames(&text_stream());
    for (event, want) in frames(&fixture("codex-responses-minimal.sse")) {
        let found = ours
            .iter()
            .filter(|(e, _)| *e == event)
            .any(|(_, got)| contains(got, &want, &event).is_ok());
        assert!(found, "no {event} like {want}");
    }
}

#[test]
fn streamed_tool_call_matches_the_sequence_codex_accepted() {
    let mut r = Responses.stream_renderer(meta(), true);
    let mut out = Vec::new();
    r.start(&mut out);
    r.delta(
        &Delta {
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("call_mock_1".into()),
                name: Some("exec_command".into()),
                arguments: Some("{\"cmd\": \"echo hi > mock_tool_ran.txt\"}".into()),
            }],
            ..Default::default()
        },
        &mut out,
    );
    r.finish(FinishReason::ToolCalls, usage(), &mut out);
    assert_matches_reference(
        &String::from_utf8(out).unwrap(),
        &fixture("codex-responses-toolcall.sse"),
    );
}

#[test]
fn real_codex_requests_parse() {
    for name in ["codex.json", "codex-turn2.json"] {
        let parsed = Responses
            .parse(&harness_body(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let r = &parsed.request;
        assert!(r.stream && parsed.include_usage, "{name}");
        assert!(r.tools.iter().any(|t| t.name == "exec_command"), "{name}");
        assert!(
            r.tools
                .iter()
                .any(|t| t.name == "multi_agent_v1.wait_agent"),
            "{name}"
        );
        assert_eq!(r.messages[0].role, Role::Developer, "{name}");
        assert!(
            parsed
                .normalizations
                .iter()
                .any(|n| n.kind == "dropped_tool" && n.detail.contains("web_search")),
            "{name}"
        );
    }
    let turn2 = Responses
        .parse(&harness_body("codex-turn2.json"))
        .unwrap()
        .request;
    let n = turn2.messages.len();
    let call = &turn2.messages[n - 2].tool_calls[0];
    let result = &turn2.messages[n - 1];
    assert_eq!(call.name, "exec_command");
    assert_eq!(result.role, Role::Tool);
    assert_eq!(result.tool_call_id.as_deref(), Some(call.id.as_str()));
}

#[test]
fn a_whole_answer_is_the_completed_response_of_the_stream() {
    // render_whole and the stream's response.completed describe the same answer.
    let mut g = tokentap_wire::canonical::GenerationAccumulator::default();
    for piece in ["Hello ", "from ", "mock. "] {
        g.push(tokentap_wire::canonical::GenerationEvent::Delta(Delta {
            content: Some(piece.into()),
            ..Default::default()
        }));
    }
    g.push(tokentap_wire::canonical::GenerationEvent::Finished {
        finish_reason: FinishReason::Stop,
        usage: usage(),
    });
    let mut whole: Value = serde_json::from_slice(&Responses.render_whole(&meta(), &g)).unwrap();
    normalize(&mut whole);
    let streamed = frames(&text_stream()).pop().unwrap().1;
    assert_eq!(whole, streamed["response"]);
    let reference = frames(&fixture("codex-responses-full.sse"))
        .pop()
        .unwrap()
        .1;
    contains(&whole, &reference["response"], "response").unwrap();
}
