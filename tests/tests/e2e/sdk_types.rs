//! Everything tokentap writes for the three wire APIs, whole and streamed, validated by the
//! providers' own client libraries: the official `openai` and `anthropic` Python SDKs (pinned
//! in scripts/setup) validate every object and SSE event with their pydantic types, strictly
//! (no undeclared field, no coercion), check the documented event order, and run their own
//! streaming helpers against tokentap on loopback. tests/sdk/validate.py does the checking;
//! this test starts tokentap in front of the scripted engine (a test double: the tiny model
//! calls no tools and has no reasoning) and runs it.

use serde_json::{json, Value};
use tokentap_e2e::fixtures::scripted_tokentap;
use tokentap_e2e::scripted::{Reply, Script, Turn};

/// The text of the last user message the engine was sent (a string or text parts).
fn last_user_text(req: &Value) -> String {
    let Some(m) = req["messages"]
        .as_array()
        .and_then(|ms| ms.iter().rev().find(|m| m["role"] == "user"))
    else {
        return String::new();
    };
    tokentap_e2e::scripted::content_text(&m["content"])
}

fn turn(reasoning: &str, text: &str, calls: &[(&str, Value)], finish: Option<&str>) -> Reply {
    Reply::Turn(Turn {
        reasoning: reasoning.into(),
        text: text.into(),
        calls: calls
            .iter()
            .map(|(n, a)| ((*n).to_owned(), a.clone()))
            .collect(),
        finish: finish.map(str::to_owned),
    })
}

/// The engine's answer for each `scenario:NAME` marker validate.py sends.
fn scenarios() -> Script {
    std::sync::Arc::new(|req, _| {
        let text = last_user_text(req);
        let name = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("scenario:"))
            .unwrap_or("text");
        match name {
            "reasoning" => turn("The user wants a greeting.", "Hello.", &[], None),
            "tools" => turn(
                "I should look around first.",
                "Let me look.",
                &[
                    ("shell", json!({"command": "ls -la", "timeout": 5})),
                    ("read", json!({"path": "README.md", "lines": [1, 2]})),
                ],
                None,
            ),
            "length" => turn("", "Once upon a time", &[], Some("length")),
            "filter" => turn("", "I can", &[], Some("content_filter")),
            "error" => Reply::DropAfter {
                text: "Hello there".into(),
                chunks: 3,
            },
            "overflow" => Reply::vllm_context_overflow(),
            _ => turn("", "Hello there, from the engine.", &[], None),
        }
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn every_object_and_event_passes_the_official_sdks_types_and_stream_helpers() {
    let (_backend, t) = scripted_tokentap(scenarios(), &[]).await;
    let report = tokentap_e2e::sdk::validate(&t.url, None).await;
    // Every kind of object was seen (a scenario that silently stopped early would not be).
    let validated = &report["validated"];
    for model in [
        "ChatCompletion",
        "ChatCompletionChunk",
        "Response",
        "ResponseCreatedEvent",
        "ResponseInProgressEvent",
        "ResponseOutputItemAddedEvent",
        "ResponseContentPartAddedEvent",
        "ResponseTextDeltaEvent",
        "ResponseTextDoneEvent",
        "ResponseContentPartDoneEvent",
        "ResponseReasoningSummaryPartAddedEvent",
        "ResponseReasoningSummaryTextDeltaEvent",
        "ResponseReasoningSummaryTextDoneEvent",
        "ResponseReasoningSummaryPartDoneEvent",
        "ResponseFunctionCallArgumentsDeltaEvent",
        "ResponseFunctionCallArgumentsDoneEvent",
        "ResponseOutputItemDoneEvent",
        "ResponseCompletedEvent",
        "ResponseIncompleteEvent",
        "ResponseFailedEvent",
        "Message",
        "RawMessageStartEvent",
        "RawContentBlockStartEvent",
        "RawContentBlockDeltaEvent",
        "RawContentBlockStopEvent",
        "RawMessageDeltaEvent",
        "RawMessageStopEvent",
        "ErrorObject",
        "ErrorResponse",
    ] {
        assert!(
            validated[model].as_u64().unwrap_or(0) > 0,
            "no {model} was validated: {validated}"
        );
    }
    assert!(report["checks"].as_u64().unwrap() > 100, "{report}");
}
