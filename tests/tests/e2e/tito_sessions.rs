//! tito's state belongs to a session (issue 49): what two samples of one GRPO group do — the
//! same first call, answered with the same tool call and different reasoning — through
//! `tokentap proxy --token-mode tito` in front of the vLLM ids double (the tiny reasoning
//! model's real tokenizer and template). Each sample's second prompt holds its own sampled ids
//! only (its own reasoning), extends its own record and labels only its own ids `sampled`; a
//! session that was never answered and sends the visible conversation gets a full render with
//! no hidden reasoning, and its `count_tokens` says nothing of another session's tokens.
//!
//! Seen failing before tito kept its state per session (one `Tito` matched tips across every
//! session): sample 0's second prompt carried `SECRET-101`, sample 1's reasoning, and said it
//! extends sample 1's record; the attacker's prompt carried the victim's reasoning and its
//! count was the victim's (216 tokens against 194 for a wrong guess, in the report).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::ids_engines::{IdsEngine, IdsEngineDouble, IdsScript};
use tokentap_e2e::tokentap::Tokentap;
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{TitoBranchCause, TitoContinuation, TokenOrigin};

/// The first call of every session is answered with the same tool call; its reasoning names
/// the call's place in arrival order (`SECRET-100`, `SECRET-101`, ...). A prompt whose last
/// user turn is a tool result is answered with text.
fn script() -> IdsScript {
    let first_calls = Arc::new(AtomicU64::new(100));
    Arc::new(move |prompt: &str| {
        let last_user = prompt.rsplit("<|im_start|>user").next().unwrap_or_default();
        if last_user.contains("<tool_response>") {
            "<think>Done</think>\n\nAll done.".into()
        } else {
            let n = first_calls.fetch_add(1, Ordering::SeqCst);
            format!("<think>SECRET-{n}</think>\n\n<tool_call>\n{{\"name\": \"bash\", \"arguments\": {{\"command\": \"pwd\"}}}}\n</tool_call>")
        }
    })
}

fn parameters() -> Value {
    json!({"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]})
}

fn first_messages() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Where am I?"}),
    ]
}

/// The conversation after the call, as a harness sends it back (no reasoning).
fn second_messages() -> Vec<Value> {
    let mut messages = first_messages();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"pwd\"}"}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_1", "content": "/work"}));
    messages
}

async fn chat(tokentap: &Tokentap, session: &str, messages: Vec<Value>) -> Value {
    let r = reqwest::Client::new()
        .post(tokentap.chat_url())
        .header("x-tokentap-session", session)
        .json(&json!({"model": "m", "messages": messages, "max_tokens": 64,
            "tools": [{"type": "function", "function": {"name": "bash", "description": "Runs a command.", "parameters": parameters()}}]}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    r.json().await.unwrap()
}

/// `count_tokens` of the second conversation, in the Messages shape, for `session`.
async fn count(tokentap: &Tokentap, session: &str) -> u64 {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/messages/count_tokens", tokentap.url))
        .header("x-tokentap-session", session)
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "m", "system": "You are terse.",
            "tools": [{"name": "bash", "description": "Runs a command.", "input_schema": parameters()}],
            "messages": [
                {"role": "user", "content": "Where am I?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "bash", "input": {"command": "pwd"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "/work"}]},
            ]}))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let body: Value = r.json().await.unwrap();
    assert!(status.is_success(), "{status}: {body}");
    body["input_tokens"].as_u64().unwrap()
}

fn record_of<'a>(records: &'a [CaptureRecord], session: &str, seq: u64) -> &'a CaptureRecord {
    records
        .iter()
        .find(|r| r.session_id == session && r.seq == seq)
        .unwrap_or_else(|| panic!("no record {session}#{seq}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_of_samples_each_extends_only_its_own_sampled_ids() {
    let model = Artefacts::require_think_model();
    let (_double, tokentap) = IdsEngineDouble::behind_tito(IdsEngine::Vllm, &model, script()).await;
    let tokenizer = tokentap_chat_template::Tokenizer::open(&model).unwrap();
    let text = |ids: &[u32]| tokenizer.decode(ids).unwrap();

    // The group: both first calls, sample 0 answered first (SECRET-100), sample 1 last.
    chat(&tokentap, "sample-0", first_messages()).await;
    chat(&tokentap, "sample-1", first_messages()).await;
    // The attacker, never answered, asks for the count of the conversation it can see, then
    // sends it. Counted before sample 0's second call, while sample 0's tip is the latest.
    let attacker_count = count(&tokentap, "attacker").await;
    let victim_count = count(&tokentap, "sample-0").await;
    chat(&tokentap, "attacker", second_messages()).await;
    chat(&tokentap, "sample-0", second_messages()).await;
    chat(&tokentap, "sample-1", second_messages()).await;
    let records = tokentap.wait_records(5).await;

    for (sample, own, other) in [
        ("sample-0", "SECRET-100", "SECRET-101"),
        ("sample-1", "SECRET-101", "SECRET-100"),
    ] {
        let first = record_of(&records, sample, 0);
        let second = record_of(&records, sample, 1);
        let prompt = second.prompt_token_ids.as_ref().unwrap();
        let shown = text(prompt);
        assert!(
            shown.contains(own) && !shown.contains(other),
            "{sample}: {shown}"
        );
        let token_in = second.token_in.as_ref().unwrap();
        assert!(
            matches!(&token_in.continuation, TitoContinuation::Extends { record_id, .. } if *record_id == first.record_id),
            "{sample}: {:?}",
            token_in.continuation
        );
        // Its own prompt and sampled ids, in that order, are the start of the next prompt, and
        // exactly those sampled ids are labelled sampled.
        let mut own_ids = first.prompt_token_ids.clone().unwrap();
        own_ids.extend(first.completion_token_ids.clone().unwrap());
        assert_eq!(&prompt[..own_ids.len()], &own_ids[..], "{sample}");
        let sampled: u32 = token_in
            .origins
            .iter()
            .filter(|r| r.origin == TokenOrigin::Sampled)
            .map(|r| r.len)
            .sum();
        assert_eq!(
            sampled as usize,
            first.completion_token_ids.as_ref().unwrap().len(),
            "{sample}"
        );
    }

    // The attacker's call: a full render of what it sent, none of anyone's reasoning.
    let attacker = record_of(&records, "attacker", 0);
    let token_in = attacker.token_in.as_ref().unwrap();
    assert!(
        matches!(
            token_in.continuation,
            TitoContinuation::Branch {
                cause: TitoBranchCause::UnknownHistory,
                ..
            }
        ),
        "{:?}",
        token_in.continuation
    );
    let prompt = attacker.prompt_token_ids.as_ref().unwrap();
    assert!(!text(prompt).contains("SECRET-"), "{}", text(prompt));
    // Its count is that render's size: nothing of the victim's hidden tokens. The victim's
    // own count is its extension, longer by its reasoning (the oracle the count was).
    assert_eq!(attacker_count, prompt.len() as u64);
    let victim_prompt = record_of(&records, "sample-0", 1)
        .prompt_token_ids
        .as_ref()
        .unwrap();
    assert_eq!(victim_count, victim_prompt.len() as u64);
    assert!(
        victim_count > attacker_count,
        "{victim_count} vs {attacker_count}"
    );
}
