//! Test support: every event shape a wire API's stream renderer writes, and the golden files
//! that hold the exact bytes (written by the renderers that built each event as a
//! `serde_json::Value`; the typed renderers that replaced them must write the same bytes).

use tokentap_schema::ErrorKind;

use super::{CallError, ResponseMeta, WireCodec};
use crate::canonical::{Delta, FinishReason, ToolCallDelta, Usage};

/// A delta with one piece of tool call `index`.
pub(crate) fn call_delta(index: u32, id: Option<&str>, name: Option<&str>, args: &str) -> Delta {
    Delta {
        tool_calls: vec![ToolCallDelta {
            index,
            id: id.map(Into::into),
            name: name.map(Into::into),
            arguments: Some(args.into()),
        }],
        ..Default::default()
    }
}

/// Three answers rendered by `codec`: one with reasoning, text and tool calls (one of them
/// namespaced, one in two pieces) that finishes with usage; one cut at its length; one that
/// fails mid-text.
pub(crate) fn every_event_shape(codec: &dyn WireCodec, meta: ResponseMeta) -> Vec<u8> {
    let text = |t: &str| Delta {
        content: Some(t.into()),
        ..Default::default()
    };
    let mut out = Vec::new();
    let mut r = codec.stream_renderer(meta.clone(), true);
    r.start(&mut out);
    for d in [
        Delta {
            reasoning: Some("Let me \"see\".".into()),
            ..Default::default()
        },
        text("Calling\n\u{1F600}."),
        call_delta(0, Some("c1"), Some("ls"), "{\"a\""),
        call_delta(0, None, None, ":1}"),
        call_delta(1, None, Some("multi_agent_v1.spawn_agent"), "{}"),
    ] {
        r.delta(&d, &mut out);
    }
    let usage = Usage {
        prompt_tokens: 7,
        completion_tokens: 3,
        total_tokens: 10,
        reasoning_tokens: None,
    };
    r.finish(FinishReason::ToolCalls, Some(usage), &mut out);
    let mut r = codec.stream_renderer(meta.clone(), false);
    r.start(&mut out);
    r.delta(&text("cut"), &mut out);
    r.finish(FinishReason::Length, None, &mut out);
    let mut r = codec.stream_renderer(meta, false);
    r.start(&mut out);
    r.delta(&text("half"), &mut out);
    let e = CallError::new(ErrorKind::ContextLengthExceeded, 400, "too long");
    r.error(&e, &mut out);
    out
}

/// Asserts that `out` is the golden file `testdata/<name>` byte for byte (with
/// `TOKENTAP_WRITE_GOLDEN` set, writes it first: only ever from the renderer being replaced).
pub(crate) fn assert_golden(name: &str, out: Vec<u8>) {
    let golden = format!("{}/testdata/{name}", env!("CARGO_MANIFEST_DIR"));
    let out = String::from_utf8(out).expect("SSE is UTF-8");
    if std::env::var_os("TOKENTAP_WRITE_GOLDEN").is_some() {
        std::fs::write(&golden, &out).expect("golden file written");
    }
    let expected = std::fs::read_to_string(&golden).expect("golden file read");
    assert_eq!(out, expected, "{name}");
}
