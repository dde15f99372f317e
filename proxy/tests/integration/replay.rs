//! A record keeps its conversation once (capture schema 2): for real harness requests of the
//! three wire APIs, the engine request rebuilt from a spooled record (`replay`) is exactly the
//! one the proxy sent, with and without the system-message fold; a body that needed redacting
//! keeps the conversation in the record instead.

use serde_json::Value;
use tokentap_proxy::capture::CallCapture;
use tokentap_proxy::normalize::{drop_orphan_tool_choice, fold_system_messages};
use tokentap_proxy::redact;
use tokentap_proxy::replay;
use tokentap_schema::{
    BackendInfo, BackendKind, CaptureRecord, ConversationSource, HarnessRequest, Normalization,
    WireApi,
};

fn harness_body(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../wire/testdata/harness-wire/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    serde_json::to_vec(&v["body"]).unwrap()
}

/// The record of a call as `CaptureService::run_call` builds it (body kept, parsed, model
/// override, orphan tool choice, the fold for a single-system template), read back from its
/// spool line; and the engine request that was sent.
fn spooled(api: WireApi, body: &[u8], fold: bool) -> (CaptureRecord, tokentap_schema::ChatRequest) {
    let backend = BackendInfo {
        kind: BackendKind::Vllm,
        url: "http://engine:8000".into(),
        model: String::new(),
        policy_version: None,
        engine_weight_version: None,
        synthetic_stream: false,
    };
    let mut call = CallCapture::new(api, HarnessRequest::bare("POST", "/v1/x"), backend);
    let kept = redact::recorded_body(body).expect("JSON");
    call.request.body = Some(kept.body);
    call.body_verbatim = kept.verbatim;
    let parsed = replay::codec(api).unwrap().parse(body).unwrap();
    call.normalizations = parsed.normalizations;
    let mut request = parsed.request;
    call.normalizations.push(Normalization {
        kind: "model_override".into(),
        detail: "to the served name".into(),
    });
    request.model = "served".into();
    call.normalizations
        .extend(drop_orphan_tool_choice(&mut request));
    if fold {
        call.normalizations
            .extend(fold_system_messages(&mut request));
    }
    call.backend.model = request.model.clone();
    call.backend_request = Some(request.clone());
    let mut line = Vec::new();
    tokentap_schema::ndjson::encode_line(&call.into_record(), &mut line).unwrap();
    let record: CaptureRecord = serde_json::from_slice(&line).unwrap();
    (record, request)
}

#[test]
fn the_engine_request_is_rebuilt_exactly_from_a_record_of_each_wire_api() {
    for (name, api) in [
        ("qwen.json", WireApi::ChatCompletions),
        ("qwen-turn2.json", WireApi::ChatCompletions),
        ("pi.json", WireApi::ChatCompletions),
        ("pi-turn2.json", WireApi::ChatCompletions),
        ("codex.json", WireApi::Responses),
        ("codex-turn2.json", WireApi::Responses),
        ("claude.json", WireApi::Messages),
        ("claude-turn2.json", WireApi::Messages),
    ] {
        let body = harness_body(name);
        for fold in [false, true] {
            let (record, sent) = spooled(api, &body, fold);
            assert_eq!(
                record.backend_conversation,
                ConversationSource::HarnessBody,
                "{name}: the conversation is kept once"
            );
            let stored = record.backend_request.as_ref().unwrap();
            assert!(stored.messages.is_empty() && stored.tools.is_empty());
            assert_eq!(
                record.request.body.as_ref().unwrap().get().as_bytes(),
                &body[..]
            );
            let rebuilt = replay::backend_request(&record).unwrap().unwrap();
            assert_eq!(rebuilt.as_ref(), &sent, "{name} (fold: {fold})");
        }
    }
}

#[test]
fn a_body_that_needed_redacting_keeps_the_conversation_in_the_record() {
    let mut v: Value = serde_json::from_slice(&harness_body("qwen.json")).unwrap();
    v["metadata"] = serde_json::json!({"api_key": "sk-abcdefghijklmnopqrstuvwx"});
    let body = serde_json::to_vec(&v).unwrap();
    let (record, sent) = spooled(WireApi::ChatCompletions, &body, false);
    assert_eq!(record.backend_conversation, ConversationSource::Recorded);
    assert!(!record
        .request
        .body
        .as_ref()
        .unwrap()
        .get()
        .contains("abcdefghijklmnop"));
    assert_eq!(
        record.backend_request.as_ref().unwrap().messages,
        sent.messages
    );
    assert_eq!(
        replay::backend_request(&record).unwrap().unwrap().as_ref(),
        &sent
    );
}

#[test]
fn a_version_1_record_reads_as_before() {
    // Token data as arrays, the body as a tree, the conversation in backend_request.
    let (record, _) = spooled(WireApi::ChatCompletions, &harness_body("pi.json"), false);
    let mut v = serde_json::to_value(&record).unwrap();
    v["schema_version"] = 1.into();
    v["prompt_token_ids"] = serde_json::json!([1, 2, 3]);
    v["backend_request"]["messages"] =
        serde_json::json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]);
    v.as_object_mut().unwrap().remove("backend_conversation");
    let old: CaptureRecord = serde_json::from_value(v).unwrap();
    assert_eq!(old.prompt_token_ids, Some(vec![1, 2, 3]));
    let rebuilt = replay::backend_request(&old).unwrap().unwrap();
    assert_eq!(rebuilt.messages.len(), 1);
}
