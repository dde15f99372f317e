//! `--token-mode tito` on the engines that take ids but cannot run here, vLLM
//! (`/v1/completions`) and SGLang (`/generate`), each a test double in its server's shape
//! (`tokentap_e2e::ids_engines`) sampling with the tiny reasoning model's real tokenizer:
//! a tool loop of three calls through Chat Completions, streamed and whole, the harness's
//! history sent back without reasoning.
//!
//! Checked for each engine: the engine gets the record's prompt ids as ids on its own
//! endpoint, every sampler explicit and a length limit (the rest of `max_model_len`; the
//! engines' own defaults are 16 and 128 tokens); the harness gets the reasoning, the tool call
//! and the text read back from the sampled text; the records carry the sampled ids with their
//! logprobs; every later prompt extends the one before with its sampled ids. The positive
//! control of the engine's account of the prompt: a double that reports another prompt gets
//! a record with a gap in place of the prompt ids, and the harness still its answer.

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::ids_engines::{
    IdsEngine, IdsEngineDouble, IdsScript, DOUBLE_LOGPROB, MAX_MODEL_LEN,
};
use tokentap_e2e::sse;
use tokentap_e2e::tokentap::Tokentap;
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{TitoBranchCause, TitoContinuation, TokenSource};

const CALL: &str =
    "<think>Check</think>\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call>";
const AFTER_TOOL: &str = "<think>Done</think>\n\nAll done.";
const AFTER_THANKS: &str = "<think>Ok</think>\n\nYou are welcome.";

/// Answers by the last user turn of the prompt (Qwen3's template writes tool results as a
/// user turn of `<tool_response>` blocks).
fn script() -> IdsScript {
    std::sync::Arc::new(|prompt: &str| {
        let last_user = prompt.rsplit("<|im_start|>user").next().unwrap_or_default();
        if last_user.contains("<tool_response>") {
            AFTER_TOOL.into()
        } else if last_user.contains("Thanks") {
            AFTER_THANKS.into()
        } else {
            CALL.into()
        }
    })
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "bash", "description": "Runs a command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}])
}

/// What the harness got: reasoning, content, tool calls.
#[derive(Debug, Default)]
struct Got {
    reasoning: String,
    content: String,
    calls: Vec<(String, String, String)>,
}

async fn call(tokentap: &Tokentap, session: &str, messages: &[Value], stream: bool) -> Got {
    let r = reqwest::Client::new()
        .post(tokentap.chat_url())
        .header("x-tokentap-session", session)
        .json(&json!({"model": "m", "messages": messages, "tools": tools(), "stream": stream}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let body = r.bytes().await.unwrap();
    let mut got = Got::default();
    if !stream {
        let v: Value = serde_json::from_slice(&body).unwrap();
        let m = &v["choices"][0]["message"];
        got.reasoning = m["reasoning_content"].as_str().unwrap_or_default().into();
        got.content = m["content"].as_str().unwrap_or_default().into();
        for c in m["tool_calls"].as_array().into_iter().flatten() {
            got.calls.push((
                c["id"].as_str().unwrap().into(),
                c["function"]["name"].as_str().unwrap().into(),
                c["function"]["arguments"].as_str().unwrap().into(),
            ));
        }
        return got;
    }
    for chunk in sse::response_objects(&body) {
        let d = &chunk["choices"][0]["delta"];
        got.reasoning += d["reasoning_content"].as_str().unwrap_or_default();
        got.content += d["content"].as_str().unwrap_or_default();
        for c in d["tool_calls"].as_array().into_iter().flatten() {
            let i = c["index"].as_u64().unwrap() as usize;
            if got.calls.len() <= i {
                got.calls.push(Default::default());
            }
            let call = &mut got.calls[i];
            call.0 += c["id"].as_str().unwrap_or_default();
            call.1 += c["function"]["name"].as_str().unwrap_or_default();
            call.2 += c["function"]["arguments"].as_str().unwrap_or_default();
        }
    }
    got
}

/// The tool loop: a call answered with a tool call (streamed), the tool's result (whole), a
/// thank-you (streamed). The records in order. `after_reasoning`: the whitespace after
/// `</think>` the engine's own parser leaves in the content (vLLM's keeps `"\n\n"`,
/// llama.cpp's and SGLang's none), which tito's answer keeps alike.
async fn tool_loop(
    tokentap: &Tokentap,
    session: &str,
    after_reasoning: &str,
) -> Vec<CaptureRecord> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Where am I?"}),
    ];
    let first = call(tokentap, session, &messages, true).await;
    assert_eq!(first.reasoning, "Check");
    assert_eq!(first.calls.len(), 1, "{first:?}");
    let (id, name, arguments) = first.calls[0].clone();
    assert_eq!(name, "bash");
    assert_eq!(
        serde_json::from_str::<Value>(&arguments).unwrap(),
        json!({"command": "pwd"})
    );
    // Sent back as harnesses do: the call, not the reasoning.
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": "/work"}));
    let second = call(tokentap, session, &messages, false).await;
    assert_eq!(
        (second.reasoning.as_str(), second.content.as_str()),
        ("Done", format!("{after_reasoning}All done.").as_str())
    );
    messages.push(json!({"role": "assistant", "content": second.content}));
    messages.push(json!({"role": "user", "content": "Thanks."}));
    let third = call(tokentap, session, &messages, true).await;
    assert_eq!(third.content, format!("{after_reasoning}You are welcome."));
    let mut records = tokentap.wait_records(3).await;
    records.sort_by_key(|r| r.seq);
    records
}

async fn tito_on(engine: IdsEngine) {
    let model = Artefacts::require_think_model();
    let (double, tokentap) = IdsEngineDouble::behind_tito(engine, &model, script()).await;
    let after_reasoning = match engine {
        IdsEngine::Vllm => "\n\n",
        IdsEngine::Sglang => "",
    };
    let records = tool_loop(&tokentap, "tito-engine", after_reasoning).await;
    let requests = double.requests();
    assert_eq!(requests.len(), 3, "every call went to the ids endpoint");

    for ((r, request), answer) in
        records
            .iter()
            .zip(&requests)
            .zip([CALL, AFTER_TOOL, AFTER_THANKS])
    {
        let prompt = r.prompt_token_ids.as_ref().expect("prompt ids");
        assert_eq!(r.token_provenance.prompt, TokenSource::Tokentap);
        assert!(
            r.token_provenance.gaps.is_empty(),
            "{:?}",
            r.token_provenance.gaps
        );
        assert_eq!(
            engine.prompt_ids(request).as_ref(),
            Some(prompt),
            "seq {}: the engine got the record's ids",
            r.seq
        );
        // The harness set no limit: the rest of the context, not the engine's short default.
        assert_eq!(
            engine.max_tokens(request),
            Some(MAX_MODEL_LEN - prompt.len() as u64)
        );
        let samplers = match engine {
            IdsEngine::Vllm => request.clone(),
            IdsEngine::Sglang => request["sampling_params"].clone(),
        };
        for key in [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
        ] {
            assert!(samplers.get(key).is_some(), "{key} not sent: {request}");
        }
        match engine {
            IdsEngine::Vllm => {
                assert_eq!(
                    (
                        request["logprobs"].clone(),
                        request["return_token_ids"].clone()
                    ),
                    (json!(0), json!(true))
                );
            }
            IdsEngine::Sglang => assert_eq!(request["return_logprob"], true),
        }
        // The sampled ids, the end of turn included, each with its logprob.
        assert_eq!(
            r.completion_token_ids.as_ref(),
            Some(&double.sampled_ids(answer))
        );
        let logprobs = r.logprobs.as_ref().expect("logprobs");
        assert!(
            logprobs.iter().all(|l| *l == DOUBLE_LOGPROB),
            "{logprobs:?}"
        );
    }
    let continuations: Vec<&TitoContinuation> = records
        .iter()
        .map(|r| &r.token_in.as_ref().expect("token_in").continuation)
        .collect();
    assert_eq!(
        continuations[0],
        &TitoContinuation::Branch {
            cause: TitoBranchCause::First,
            detail: None
        }
    );
    for i in 1..3 {
        assert!(
            matches!(continuations[i], TitoContinuation::Extends { record_id, .. } if *record_id == records[i - 1].record_id),
            "seq {}: {:?}",
            records[i].seq,
            continuations[i]
        );
        let mut earlier = records[i - 1].prompt_token_ids.clone().unwrap();
        earlier.extend(records[i - 1].completion_token_ids.clone().unwrap());
        assert!(records[i]
            .prompt_token_ids
            .as_ref()
            .unwrap()
            .starts_with(&earlier));
    }

    // The control: an engine that reports another prompt than the one sent.
    double.misreport_prompt();
    let got = call(
        &tokentap,
        "tito-engine-misreport",
        &[json!({"role": "user", "content": "Where am I?"})],
        false,
    )
    .await;
    assert_eq!(got.calls.len(), 1, "the harness still gets its answer");
    let records = tokentap.wait_records(4).await;
    let r = records
        .iter()
        .find(|r| r.session_id == "tito-engine-misreport")
        .expect("the misreported call's record");
    assert_eq!(r.prompt_token_ids, None, "no prompt ids the engine disowns");
    let reason = match engine {
        IdsEngine::Vllm => "but the engine echoed",
        IdsEngine::Sglang => "but the engine evaluated",
    };
    assert!(
        r.token_provenance
            .gaps
            .iter()
            .any(|g| g.reason.contains(reason)),
        "{:?}",
        r.token_provenance.gaps
    );
    assert!(
        r.completion_token_ids.is_some(),
        "the sampled ids are still the engine's"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tito_on_vllm_sends_ids_to_completions_and_extends_every_turn() {
    tito_on(IdsEngine::Vllm).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tito_on_sglang_sends_input_ids_to_generate_and_extends_every_turn() {
    tito_on(IdsEngine::Sglang).await;
}

/// What the model samples for each `scenario:NAME` of tests/sdk/validate.py, in Qwen3's
/// format; `length` runs past the 256 tokens the validator allows.
fn sdk_scenarios() -> IdsScript {
    std::sync::Arc::new(|prompt: &str| {
        let last_user = prompt.rsplit("<|im_start|>user").next().unwrap_or_default();
        let name = last_user
            .split_whitespace()
            .find_map(|w| w.strip_prefix("scenario:"))
            .unwrap_or("text");
        match name {
            "reasoning" => "<think>The user wants a greeting.</think>\n\nHello.".into(),
            "tools" => concat!(
                "<think>I should look around first.</think>\n\nLet me look.\n",
                "<tool_call>\n{\"name\": \"shell\", \"arguments\": {\"command\": \"ls -la\", \"timeout\": 5}}\n</tool_call>\n",
                "<tool_call>\n{\"name\": \"read\", \"arguments\": {\"path\": \"README.md\", \"lines\": [1, 2]}}\n</tool_call>"
            )
            .into(),
            "length" => "Once upon a time ".repeat(200),
            _ => "Hello there, from the engine.".into(),
        }
    })
}

/// tito's answers, read back from sampled ids, in the three wire APIs whole and streamed,
/// pass the providers' own SDK types, event order and streaming helpers (tests/sdk/validate.py,
/// as the `sdk_types` e2e runs it for text mode) for the scenarios an engine answers: text,
/// reasoning, two tool calls, a length cut.
#[tokio::test(flavor = "multi_thread")]
async fn tito_answers_pass_the_official_sdks_types_and_stream_helpers() {
    let model = Artefacts::require_think_model();
    let (double, tokentap) =
        IdsEngineDouble::behind_tito(IdsEngine::Vllm, &model, sdk_scenarios()).await;
    let report =
        tokentap_e2e::sdk::validate(&tokentap.url, Some("text,reasoning,tools,length")).await;
    // The scenarios ran: reasoning, tool-call and length events were seen and validated.
    for model in [
        "ChatCompletionChunk",
        "ResponseReasoningSummaryTextDeltaEvent",
        "ResponseFunctionCallArgumentsDoneEvent",
        "ResponseIncompleteEvent",
        "RawContentBlockDeltaEvent",
        "Message",
    ] {
        assert!(
            report["validated"][model].as_u64().unwrap_or(0) > 0,
            "no {model} validated: {}",
            report["validated"]
        );
    }
    // Every call went to the engine as ids.
    assert!(double
        .requests()
        .iter()
        .all(|r| IdsEngine::Vllm.prompt_ids(r).is_some()));
}
