//! tokentap on the real vLLM (issue 50): vLLM 0.32 for CPU (`scripts/setup`'s `vllm` step)
//! serving the tiny reasoning model's Hugging Face directory (`scripts/tiny_model_hf.py`:
//! Qwen3's tokenizer and template, `<think>Check</think>\n\n` first, `Done.` when no tool call
//! is due) with `--reasoning-parser qwen3 --tool-call-parser hermes`, started on loopback by
//! the test ([`VllmServer`]). One start (about a minute with the warm-up) serves every check
//! here:
//!
//! * text mode (`--backend-kind vllm`), Chat Completions whole and streamed, Messages, Responses:
//!   the record's prompt ids are the ones vLLM reported, equal to its `/tokenize` of the
//!   request tokentap sent; one logprob per sampled id, no gap; the reasoning (vLLM's
//!   `reasoning` field) reaches the caller as each API spells it; with a tool offered and no
//!   grammar (vLLM applies none under `tool_choice: auto`) the streamed chunks whose delta is
//!   empty while the hermes parser buffers still carry their ids;
//! * tito (`--token-mode tito --tokenizer DIR`) on `/v1/completions`: a three-call
//!   append-only session is one trace, each prompt extending the one before with its sampled
//!   ids, and vLLM echoes exactly the ids tokentap sent; the content is text mode's, the
//!   `"\n\n"` after `</think>` kept as vLLM's reasoning parser keeps it;
//! * bad input: a prompt over `--max-model-len` reaches the caller as OpenAI's
//!   `context_length_exceeded`, and is recorded.

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::llama::{QWEN3_END_OF_TURN, QWEN3_END_THINK, QWEN3_THINK};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::sse;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::vllm::{VllmOptions, VllmServer, MAX_MODEL_LEN};
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{TitoBranchCause, TitoContinuation, TokenSource};

/// `Check` and `Done`: the reasoning model's two words.
const CHECK: u32 = 3973;
const DONE: u32 = 17453;
/// `<think>Check</think>\n\nDone.<|im_end|>`: every answer with no tool call due.
const ANSWER_IDS: [u32; 7] = [
    QWEN3_THINK,
    CHECK,
    QWEN3_END_THINK,
    271,
    DONE,
    13,
    QWEN3_END_OF_TURN,
];

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}])
}

/// A finished tool loop as a harness sends it back: three `pwd` calls (compact arguments,
/// `content: null`) and their results; the model answers `Done.` after the third.
fn after_three_results() -> Vec<Value> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "where am I?"}),
    ];
    for i in 0..3 {
        let id = format!("call_{i}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"pwd\"}"}}]}));
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": "/home/user"}));
    }
    messages
}

async fn post(url: &str, session: &str, body: &Value) -> (u16, Vec<u8>) {
    let r = http_client()
        .post(url)
        .header("x-tokentap-session", session)
        .json(body)
        .send()
        .await
        .expect("calling tokentap");
    let status = r.status().as_u16();
    (status, r.bytes().await.expect("an answer body").to_vec())
}

/// What every text-mode record on vLLM holds: the engine's prompt ids, equal to vLLM's own
/// `/tokenize` of `chat` (the call as a Chat Completions body: messages and tools), and the
/// sampled ids each with a logprob, no gap.
async fn check_engine_ids(vllm: &VllmServer, r: &CaptureRecord, what: &str, chat: &Value) {
    let prompt = r
        .prompt_token_ids
        .as_ref()
        .unwrap_or_else(|| panic!("{what}: no prompt ids: {:?}", r.token_provenance));
    assert_eq!(
        r.token_provenance.prompt,
        TokenSource::EngineResponse,
        "{what}"
    );
    assert_eq!(
        r.token_provenance.completion,
        TokenSource::EngineResponse,
        "{what}"
    );
    assert!(
        r.token_provenance.gaps.is_empty(),
        "{what}: {:?}",
        r.token_provenance.gaps
    );
    assert_eq!(
        &vllm.tokenize_chat(chat).await,
        prompt,
        "{what}: vLLM's /tokenize of the same conversation"
    );
    let sampled = r.completion_token_ids.as_ref().expect("sampled ids");
    let logprobs = r.logprobs.as_ref().expect("logprobs");
    assert_eq!(logprobs.len(), sampled.len(), "{what}: one logprob per id");
    assert!(
        logprobs.iter().all(|l| l.is_finite() && *l <= 0.0),
        "{what}: {logprobs:?}"
    );
    let usage = r.usage.expect("usage");
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens),
        (prompt.len() as u64, sampled.len() as u64),
        "{what}"
    );
}

async fn text_mode(vllm: &VllmServer) {
    let tokentap = Tokentap::start(TokentapConfig::new(vllm.url.clone(), "vllm")).await;
    let chat = tokentap.chat_url();

    // 1. Chat Completions, whole: a finished tool loop, tools offered. The reasoning comes back.
    let body = json!({"model": "m", "messages": after_three_results(), "tools": tools(),
        "temperature": 0, "max_tokens": 32});
    let (status, answer) = post(&chat, "vllm-chat", &body).await;
    let v: Value = serde_json::from_slice(&answer).expect("JSON");
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "Check", "{v}");
    assert_eq!(
        m["content"], "\n\nDone.",
        "vLLM's content, passed through: {v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let r = tokentap.wait_seq("vllm-chat", 0).await;
    check_engine_ids(vllm, &r, "chat whole", &body).await;
    assert_eq!(r.completion_token_ids.as_deref(), Some(&ANSWER_IDS[..]));
    // vLLM's own answer to the same request: the same prompt ids as the harness's request
    // (vLLM re-serializes the compact arguments itself, so both render alike).
    let direct = vllm.chat_direct(&body).await;
    assert_eq!(
        r.prompt_token_ids.as_ref(),
        Some(&tokentap_e2e::vllm::ids(&direct["prompt_token_ids"])),
        "the record's prompt ids are the ones vLLM gives the harness's own request"
    );
    assert_eq!(
        vllm.tokenize_chat(&body).await,
        tokentap_e2e::vllm::ids(&direct["prompt_token_ids"])
    );
    assert_eq!(
        direct["usage"]["completion_tokens_details"]["reasoning_tokens"], 1,
        "{direct}"
    );
    assert_eq!(
        v["usage"]["completion_tokens_details"]["reasoning_tokens"], 1,
        "vLLM's reasoning count passed on to the harness: {v}"
    );
    assert_eq!(
        r.usage.and_then(|u| u.reasoning_tokens),
        Some(1),
        "and kept in the record"
    );

    // 2. The same, streamed.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, answer) = post(&chat, "vllm-chat-stream", &streamed).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&answer);
    let s = sse::parse_chat_stream(&text);
    let reasoning: String = s
        .chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(
        (reasoning.as_str(), s.content.as_str()),
        ("Check", "\n\nDone."),
        "{text}"
    );
    assert_eq!(s.finish_reason.as_deref(), Some("stop"));
    let r = tokentap.wait_seq("vllm-chat-stream", 0).await;
    check_engine_ids(vllm, &r, "chat streamed", &body).await;
    assert_eq!(r.completion_token_ids.as_deref(), Some(&ANSWER_IDS[..]));

    // 3. A tool offered, no result yet, streamed: vLLM constrains nothing under
    // `tool_choice: auto`, so the model's `<tool_call>` opener comes without the JSON a grammar
    // would force, the hermes parser buffers it (chunks with an empty delta and their ids) and
    // the call runs to its limit. Every sampled id still lands in the record.
    let mut opener = json!({"model": "m", "messages": [{"role": "user", "content": "where am I?"}],
        "tools": tools(), "temperature": 0, "max_tokens": 16, "stream": true,
        "stream_options": {"include_usage": true}});
    let (status, answer) = post(&chat, "vllm-tool-opener", &opener).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let s = sse::parse_chat_stream(&String::from_utf8_lossy(&answer));
    assert_eq!(s.finish_reason.as_deref(), Some("length"));
    let r = tokentap.wait_seq("vllm-tool-opener", 0).await;
    check_engine_ids(vllm, &r, "tool opener streamed", &opener).await;
    let sampled = r.completion_token_ids.as_ref().unwrap();
    assert_eq!(sampled.len(), 16);
    assert_eq!(&sampled[..4], &ANSWER_IDS[..4], "the reasoning block first");
    opener["stream"] = json!(false);
    opener.as_object_mut().unwrap().remove("stream_options");
    let direct = vllm.chat_direct(&opener).await;
    assert_eq!(
        Some(&tokentap_e2e::vllm::ids(&direct["choices"][0]["token_ids"])),
        r.completion_token_ids.as_ref(),
        "greedy: the same ids straight from vLLM"
    );

    // 4. Messages, whole and streamed: the reasoning as a thinking block.
    let one_question = json!({"messages": [{"role": "user", "content": "where am I?"}]});
    let messages_url = format!("{}/v1/messages", tokentap.url);
    let body = json!({"model": "m", "max_tokens": 32, "temperature": 0,
        "messages": [{"role": "user", "content": "where am I?"}]});
    let (status, answer) = post(&messages_url, "vllm-messages", &body).await;
    let v: Value = serde_json::from_slice(&answer).expect("JSON");
    assert_eq!(status, 200, "{v}");
    let blocks = v["content"].as_array().expect("content blocks");
    assert_eq!(blocks[0]["type"], "thinking", "{v}");
    assert_eq!(blocks[0]["thinking"], "Check", "{v}");
    let text: String = blocks
        .iter()
        .filter(|b| b["type"] == "text")
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert!(text.ends_with("Done."), "{v}");
    let r = tokentap.wait_seq("vllm-messages", 0).await;
    check_engine_ids(vllm, &r, "messages whole", &one_question).await;
    assert_eq!(r.completion_token_ids.as_deref(), Some(&ANSWER_IDS[..]));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, answer) = post(&messages_url, "vllm-messages-stream", &streamed).await;
    assert_eq!(status, 200);
    let events = sse::typed_events(&String::from_utf8_lossy(&answer));
    let thinking: String = events
        .iter()
        .filter_map(|(_, e)| e["delta"]["thinking"].as_str())
        .collect();
    assert_eq!(thinking, "Check", "{events:?}");
    let r = tokentap.wait_seq("vllm-messages-stream", 0).await;
    check_engine_ids(vllm, &r, "messages streamed", &one_question).await;

    // 5. Responses, streamed: a reasoning item before the message.
    let body = json!({"model": "m", "input": "where am I?", "stream": true, "temperature": 0,
        "max_output_tokens": 32});
    let (status, answer) = post(
        &format!("{}/v1/responses", tokentap.url),
        "vllm-responses",
        &body,
    )
    .await;
    assert_eq!(status, 200);
    let events = sse::typed_events(&String::from_utf8_lossy(&answer));
    let completed = events
        .iter()
        .find(|(t, _)| t == "response.completed")
        .map(|(_, e)| e["response"].clone())
        .unwrap_or_else(|| panic!("no response.completed: {events:?}"));
    let output = completed["output"].as_array().expect("output items");
    let reasoning = output
        .iter()
        .find(|i| i["type"] == "reasoning")
        .unwrap_or_else(|| panic!("no reasoning item: {completed}"));
    let reasoning_text: String = reasoning["content"]
        .as_array()
        .into_iter()
        .chain(reasoning["summary"].as_array())
        .flatten()
        .filter_map(|p| p["text"].as_str())
        .collect();
    assert!(reasoning_text.contains("Check"), "{completed}");
    let r = tokentap.wait_seq("vllm-responses", 0).await;
    check_engine_ids(vllm, &r, "responses streamed", &one_question).await;
    assert_eq!(r.completion_token_ids.as_deref(), Some(&ANSWER_IDS[..]));

    // 6. Bad input: a prompt over --max-model-len. vLLM refuses it with a 400; the caller
    // gets OpenAI's context_length_exceeded, and the call is recorded.
    let long = "hello ".repeat(MAX_MODEL_LEN as usize + 100);
    let body =
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": long}]});
    let (status, answer) = post(&chat, "vllm-too-long", &body).await;
    let v: Value = serde_json::from_slice(&answer).expect("JSON");
    assert_eq!(status, 400, "{v}");
    let e = sse::assert_openai_error(&v);
    assert_eq!(e["code"], "context_length_exceeded", "{v}");
    let r = tokentap.wait_seq("vllm-too-long", 0).await;
    assert_eq!(r.response_status, 400);
    assert!(r.error.is_some(), "the refusal is recorded");
}

async fn tito_mode(vllm: &VllmServer, a: &tokentap_e2e::artefacts::VllmArtefacts) {
    let tokentap = Tokentap::start(
        TokentapConfig::new(vllm.url.clone(), "vllm")
            .arg("--token-mode=tito")
            .arg("--tokenizer")
            .arg(a.think_hf.display().to_string()),
    )
    .await;
    let chat = tokentap.chat_url();
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "where am I?"}),
    ];
    let mut answers = Vec::new();
    for (seq, next) in ["thanks", "and now?", ""].iter().enumerate() {
        let stream = seq == 1;
        let body = json!({"model": "m", "messages": messages, "temperature": 0, "max_tokens": 32, "stream": stream});
        let (status, answer) = post(&chat, "vllm-tito", &body).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
        let (content, reasoning) = if stream {
            let text = String::from_utf8_lossy(&answer);
            let s = sse::parse_chat_stream(&text);
            let reasoning: String = s
                .chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str())
                .collect();
            (s.content, reasoning)
        } else {
            let v: Value = serde_json::from_slice(&answer).unwrap();
            let m = &v["choices"][0]["message"];
            (
                m["content"].as_str().unwrap_or_default().to_owned(),
                m["reasoning_content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        };
        assert_eq!(reasoning, "Check", "seq {seq}");
        answers.push(content.clone());
        let r = tokentap.wait_seq("vllm-tito", seq as u64).await;
        assert_eq!(
            r.completion_token_ids.as_deref(),
            Some(&ANSWER_IDS[..]),
            "seq {seq}"
        );
        // Sent back as a harness does: the answer, not the reasoning.
        messages.push(json!({"role": "assistant", "content": content}));
        if !next.is_empty() {
            messages.push(json!({"role": "user", "content": next}));
        }
    }
    let mut records = tokentap.wait_records(3).await;
    records.retain(|r| r.session_id == "vllm-tito");
    records.sort_by_key(|r| r.seq);
    for (i, r) in records.iter().enumerate() {
        let prompt = r.prompt_token_ids.as_ref().expect("prompt ids");
        assert_eq!(r.token_provenance.prompt, TokenSource::Tokentap);
        assert!(
            r.token_provenance.gaps.is_empty(),
            "seq {i}: vLLM echoed other ids than sent: {:?}",
            r.token_provenance.gaps
        );
        let logprobs = r.logprobs.as_ref().expect("logprobs");
        assert_eq!(logprobs.len(), ANSWER_IDS.len());
        if i == 0 {
            assert_eq!(
                r.token_in.as_ref().expect("token_in").continuation,
                TitoContinuation::Branch {
                    cause: TitoBranchCause::First,
                    detail: None
                }
            );
            continue;
        }
        let earlier = &records[i - 1];
        assert!(
            matches!(&r.token_in.as_ref().expect("token_in").continuation,
                TitoContinuation::Extends { record_id, .. } if *record_id == earlier.record_id),
            "seq {i}: {:?}",
            r.token_in
        );
        let mut before = earlier.prompt_token_ids.clone().unwrap();
        before.extend(earlier.completion_token_ids.clone().unwrap());
        assert!(prompt.starts_with(&before), "seq {i} extends seq {}", i - 1);
    }
    // The same sampled ids give tito the content vLLM's own parser gives text mode (above):
    // the whitespace after `</think>` kept, as vLLM's qwen3 reasoning parser keeps it.
    for (i, content) in answers.iter().enumerate() {
        assert_eq!(content, "\n\nDone.", "seq {i}: tito's content");
    }
}

/// Text mode, tito and a refused prompt, all on one real vLLM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_real_vllm_text_mode_tito_and_a_refused_prompt() {
    let a = Artefacts::require_vllm();
    let vllm = VllmServer::start(VllmOptions::think(&a)).await;
    text_mode(&vllm).await;
    tito_mode(&vllm, &a).await;
    eprintln!(
        "vLLM: started in {:.1} s, warm-up {:.1} s, RSS now {} MiB",
        vllm.start_secs,
        vllm.warmup_secs,
        vllm.rss_kib() / 1024
    );
}
