//! `--token-mode tito` against the real llama-server on the tiny reasoning model (Qwen3's
//! tokenizer and template; every reply is `<think>Check</think>\n\nDone.` when no tool is
//! offered). One conversation of three user turns, each turn's call in another wire API and
//! mode (Chat Completions whole, Chat Completions streamed, Messages streamed), the
//! assistant's earlier turns sent back without their reasoning, as harnesses do.
//!
//! Checked: each answer is read back from the sampled ids' text (reasoning and content in the
//! wire API's own fields and events); the engine got exactly the record's prompt ids as ids
//! (`/completion`'s `prompt`), and evaluated as many; every later call extends the earlier
//! call's prompt + sampled ids (the record's `token_in` says so, and the ids show it), the
//! engine reusing its cache for that prefix; `--token-verify always` finds the full render
//! different only inside the sampled tokens, never in the frame tito wrote. The same conversation through tokentap in text
//! mode, in the same test: Qwen3's template drops the reasoning of earlier turns on each new
//! user turn, so no later prompt there extends the one before (both counts printed).

use serde_json::{json, Value};
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::sse;
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{tokentap_cli, Tokentap, TokentapConfig};
use tokentap_e2e::traces::wait_session_reports;
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{TitoBranchCause, TitoContinuation, TokenOrigin, TokenSource};

const TURNS: [&str; 3] = ["Hi.", "And now?", "Once more?"];

/// One call of the conversation in `api`; the answer's (reasoning, content).
async fn call(
    client: &reqwest::Client,
    tokentap: &Tokentap,
    api: &str,
    messages: &[Value],
) -> (String, String) {
    let session = ("x-tokentap-session", "tito-e2e");
    match api {
        "chat" | "chat-stream" => {
            let stream = api == "chat-stream";
            let r = client
                .post(tokentap.chat_url())
                .header(session.0, session.1)
                .json(&json!({"model": "m", "messages": messages, "max_tokens": 64, "stream": stream}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{api}: {}", r.status());
            let body = r.bytes().await.unwrap();
            if !stream {
                let v: Value = serde_json::from_slice(&body).unwrap();
                let m = &v["choices"][0]["message"];
                return (
                    m["reasoning_content"].as_str().unwrap_or_default().into(),
                    m["content"].as_str().unwrap_or_default().into(),
                );
            }
            let (mut reasoning, mut content) = (String::new(), String::new());
            for chunk in sse::response_objects(&body) {
                let d = &chunk["choices"][0]["delta"];
                reasoning += d["reasoning_content"].as_str().unwrap_or_default();
                content += d["content"].as_str().unwrap_or_default();
            }
            (reasoning, content)
        }
        "messages-stream" => {
            let r = client
                .post(format!("{}/v1/messages", tokentap.url))
                .header(session.0, session.1)
                .header("anthropic-version", "2023-06-01")
                .json(&json!({"model": "m", "max_tokens": 64, "stream": true,
                    "system": "You are terse.",
                    "messages": messages.iter().filter(|m| m["role"] != "system").collect::<Vec<_>>()}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{api}: {}", r.status());
            let body = r.text().await.unwrap();
            let (mut reasoning, mut content) = (String::new(), String::new());
            for (_, event) in sse::typed_events(&body) {
                let d = &event["delta"];
                reasoning += d["thinking"].as_str().unwrap_or_default();
                content += d["text"].as_str().unwrap_or_default();
            }
            (reasoning, content)
        }
        other => panic!("{other}"),
    }
}

/// Runs the conversation through `tokentap`; its records in order.
async fn conversation(tokentap: &Tokentap, apis: [&str; 3]) -> Vec<CaptureRecord> {
    let client = reqwest::Client::new();
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for (turn, api) in TURNS.iter().zip(apis) {
        messages.push(json!({"role": "user", "content": turn}));
        let (reasoning, content) = call(&client, tokentap, api, &messages).await;
        assert_eq!(
            (reasoning.as_str(), content.as_str()),
            ("Check", "Done."),
            "{api}"
        );
        // Sent back as harnesses do: the content, not the reasoning.
        messages.push(json!({"role": "assistant", "content": content}));
    }
    let mut records = tokentap.wait_records(3).await;
    records.sort_by_key(|r| r.seq);
    records
}

/// How many prompt tokens llama.cpp took from its cache for the exchange's call (`timings`
/// of the whole answer or of the stream's last chunk).
fn cache_n(exchange: &tokentap_e2e::tee::Exchange) -> u64 {
    sse::response_objects(&exchange.response_body)
        .iter()
        .rev()
        .find_map(|o| o["timings"]["cache_n"].as_u64())
        .unwrap_or_else(|| {
            panic!(
                "no timings.cache_n in {}",
                String::from_utf8_lossy(&exchange.response_body)
            )
        })
}

/// What of `earlier`'s call the engine's cache can hold for the next: its prompt and sampled
/// ids but the last (sampled, never evaluated).
fn reusable_prefix(earlier: &CaptureRecord) -> u64 {
    (earlier.prompt_token_ids.as_ref().unwrap().len()
        + earlier.completion_token_ids.as_ref().unwrap().len()
        - 1) as u64
}

/// The record's `--token-verify` verdict.
fn verdict(r: &CaptureRecord) -> &tokentap_schema::TitoVerify {
    r.token_in
        .as_ref()
        .unwrap()
        .verify
        .as_ref()
        .expect("verified")
}

/// How many calls' prompts extend the previous call's prompt + sampled ids.
fn extensions(records: &[CaptureRecord]) -> usize {
    records
        .windows(2)
        .filter(|w| {
            let mut earlier = w[0].prompt_token_ids.clone().unwrap();
            earlier.extend(w[0].completion_token_ids.clone().unwrap());
            w[1].prompt_token_ids
                .as_ref()
                .unwrap()
                .starts_with(&earlier)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_tito_extends_every_turn_where_text_mode_splits() {
    let llama = LlamaServer::shared_think_model().await;
    let model = Artefacts::require_think_model().display().to_string();
    let engine = TeeProxy::start(&llama.url).await;
    let tito = Tokentap::start(
        TokentapConfig::new(engine.url.clone(), "llamacpp")
            .arg("--token-mode=tito")
            .arg("--token-verify=always")
            .arg("--tokenizer")
            .arg(model.clone())
            .arg("--session-idle")
            .arg("5"),
    )
    .await;
    let records = conversation(&tito, ["chat", "chat-stream", "messages-stream"]).await;
    // The start-up probe's report, construct by construct, in the log.
    let log = tito.log_tail(400);
    for finding in [
        "the template: a tool result after an answered call: appends",
        "the template: a user message after an answered call: appends",
        "the template: an earlier turn's reasoning: the template drops it",
    ] {
        assert!(log.contains(finding), "{finding} not in:\n{log}");
    }

    let mut tito_cache = Vec::new();
    let completions: Vec<_> = engine
        .exchanges()
        .into_iter()
        .filter(|e| e.path == "/completion")
        .collect();
    assert_eq!(completions.len(), 3, "every call went to /completion");
    for (r, exchange) in records.iter().zip(&completions) {
        let prompt = r.prompt_token_ids.as_ref().expect("prompt ids");
        assert_eq!(r.token_provenance.prompt, TokenSource::Tokentap);
        // The engine got the ids themselves, and evaluated that many.
        let sent: Vec<u32> =
            serde_json::from_value(exchange.request_json()["prompt"].clone()).unwrap();
        assert_eq!(
            &sent, prompt,
            "seq {}: the ids sent are the record's",
            r.seq
        );
        let last = sse::response_objects(&exchange.response_body)
            .pop()
            .unwrap();
        assert_eq!(last["tokens_evaluated"].as_u64(), Some(prompt.len() as u64));
        // Sampled ids with a logprob each, the stop token included.
        let sampled = r.completion_token_ids.as_ref().unwrap();
        assert_eq!(sampled.last(), Some(&151645), "<|im_end|> sampled and kept");
        assert_eq!(r.logprobs.as_ref().map(Vec::len), Some(sampled.len()));
        assert!(
            r.token_provenance.gaps.is_empty(),
            "{:?}",
            r.token_provenance.gaps
        );
    }
    let token_in: Vec<&TitoContinuation> = records
        .iter()
        .map(|r| &r.token_in.as_ref().expect("token_in").continuation)
        .collect();
    assert_eq!(
        token_in[0],
        &TitoContinuation::Branch {
            cause: TitoBranchCause::First,
            detail: None
        }
    );
    for i in 1..3 {
        assert!(
            matches!(token_in[i], TitoContinuation::Extends { record_id, .. } if *record_id == records[i - 1].record_id),
            "seq {}: {:?}",
            records[i].seq,
            token_in[i]
        );
        let origins = &records[i].token_in.as_ref().unwrap().origins;
        assert_eq!(
            origins
                .iter()
                .filter(|o| o.origin == TokenOrigin::Sampled)
                .count(),
            i
        );
        // The engine reused its cache for the whole extended prefix: the earlier prompt and
        // every sampled id but the last (sampled, never evaluated).
        let cached = cache_n(&completions[i]);
        let reusable = reusable_prefix(&records[i - 1]);
        assert!(
            cached >= reusable,
            "seq {}: {cached} prompt tokens from the cache, {reusable} reusable",
            records[i].seq
        );
        tito_cache.push((cached, reusable));
    }
    // --token-verify: the full render differs only inside the sampled tokens (the reasoning
    // Qwen3's template drops); tito wrote every frame token as the template does.
    for (i, r) in records.iter().enumerate() {
        let v = verdict(r);
        assert_eq!(v.boundary_spans, 0, "seq {}: {v:?}", r.seq);
        assert_eq!(v.content_spans > 0, i > 0, "seq {}: {v:?}", r.seq);
    }
    let tito_extends = extensions(&records);
    assert_eq!(tito_extends, 2);
    // The same in `records summary`, verified calls included.
    let summary = tokentap_cli(&[
        "records",
        "summary",
        "--spool",
        tito.spool.to_str().unwrap(),
    ])
    .await;
    assert!(summary.success, "{}", summary.stderr);
    assert!(
        summary.stdout.contains(
            "tito: calls 3  extended 2 of 2 (100%)  branches 1 (first 1)  verified 3 (boundary drift in 0)"
        ),
        "{}",
        summary.stdout
    );
    // Reconstruction: the session is one trace, faithful.
    let tito_report = session_report(&tito).await;
    assert_eq!(
        (tito_report.stats.calls, tito_report.stats.traces),
        (3, 1),
        "{tito_report:?}"
    );
    assert_eq!(tito_report.faithfulness.violations, 0, "{tito_report:?}");

    // Text mode, the same conversation.
    let text_engine = TeeProxy::start(&llama.url).await;
    let text = Tokentap::start(
        TokentapConfig::new(text_engine.url.clone(), "llamacpp")
            .arg("--session-idle")
            .arg("5"),
    )
    .await;
    let text_records = conversation(&text, ["chat", "chat-stream", "chat-stream"]).await;
    // llama.cpp's prompt cache in text mode: the re-rendered turn parts from what was
    // sampled, so the cache serves only up to there.
    let chats: Vec<_> = text_engine
        .exchanges()
        .into_iter()
        .filter(|e| e.path == "/v1/chat/completions")
        .collect();
    assert_eq!(chats.len(), 3);
    let text_cache: Vec<(u64, u64)> = (1..3)
        .map(|i| (cache_n(&chats[i]), reusable_prefix(&text_records[i - 1])))
        .collect();
    eprintln!(
        "llama.cpp prompt tokens served from its cache (of the earlier call's prompt + sampled ids): tito {tito_cache:?}, text mode {text_cache:?}"
    );
    for (cached, reusable) in &text_cache {
        assert!(cached < reusable, "text mode: {cached} of {reusable}");
    }
    let text_extends = extensions(&text_records);
    let text_report = session_report(&text).await;
    eprintln!(
        "calls extending the one before: tito {tito_extends} of 2, text mode {text_extends} of 2; traces of the 3 calls: tito {}, text mode {}",
        tito_report.stats.traces, text_report.stats.traces
    );
    assert_eq!(
        text_extends, 0,
        "Qwen3's template drops the earlier reasoning in text mode"
    );
    assert_eq!(
        (text_report.stats.calls, text_report.stats.traces),
        (3, 3),
        "text mode: each call its own trace"
    );
}

/// The reconstruction's report of the one session (closed by `--session-idle`, which is
/// longer than any pause between the conversation's calls, so one report holds them all).
async fn session_report(t: &Tokentap) -> tokentap_schema::SessionReport {
    let out = t.spool.join("traces");
    let log = || t.log_tail(30);
    wait_session_reports(&out, 1, log).await.pop().unwrap()
}

/// The turns that end without the model's end of turn, and a rewritten history, through the
/// real llama-server in tito (`--token-verify always`): a length cut-off and a stop-string stop
/// each close the turn with the template's end of turn as `boundary` tokens and the next call
/// still extends; a compacted history (the earlier turns replaced by a summary) branches as
/// `compacted`. Reconstructed, the session is two traces (before and after the compaction),
/// faithful, and no call shows boundary drift against the full render.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_tito_cut_offs_close_the_turn_and_a_compaction_branches() {
    let llama = LlamaServer::shared_think_model().await;
    let model = Artefacts::require_think_model().display().to_string();
    let tito = Tokentap::start(
        TokentapConfig::new(llama.url.clone(), "llamacpp")
            .arg("--token-mode=tito")
            .arg("--token-verify=always")
            .arg("--tokenizer")
            .arg(model)
            .arg("--session-idle")
            .arg("5"),
    )
    .await;
    let client = reqwest::Client::new();
    let call = |messages: Vec<Value>, extra: Value| {
        let mut body = json!({"model": "m", "messages": messages});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let r = client
            .post(tito.chat_url())
            .header("x-tokentap-session", "tito-divergence")
            .json(&body)
            .send();
        async move {
            let r = r.await.unwrap();
            assert!(r.status().is_success(), "{}", r.status());
            let v: Value = r.json().await.unwrap();
            let choice = &v["choices"][0];
            (
                choice["finish_reason"].as_str().unwrap().to_owned(),
                choice["message"]["content"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        }
    };
    let mut messages = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Hi."}),
    ];
    // 1: cut off by the length limit inside the reasoning.
    let (finish, content) = call(messages.clone(), json!({"max_tokens": 2})).await;
    assert_eq!(finish, "length");
    messages.push(json!({"role": "assistant", "content": content}));
    messages.push(json!({"role": "user", "content": "Go on."}));
    // 2: stopped by a stop string in the answer.
    let (finish, content) = call(messages.clone(), json!({"stop": ["one"]})).await;
    assert_eq!(finish, "stop");
    assert!(!content.contains("Done"), "{content:?}");
    messages.push(json!({"role": "assistant", "content": content}));
    messages.push(json!({"role": "user", "content": "And now?"}));
    // 3: an ordinary turn.
    let (_, content) = call(messages.clone(), json!({})).await;
    assert_eq!(content, "Done.");
    // 4: the harness compacts: a summary instead of the turns so far.
    let compacted = vec![
        json!({"role": "system", "content": "You are terse."}),
        json!({"role": "user", "content": "Summary of the conversation so far: greetings."}),
        json!({"role": "assistant", "content": content}),
        json!({"role": "user", "content": "Once more?"}),
    ];
    call(compacted, json!({})).await;

    let mut records = tito.wait_records(4).await;
    records.sort_by_key(|r| r.seq);
    let token_in: Vec<_> = records
        .iter()
        .map(|r| r.token_in.clone().unwrap())
        .collect();
    for r in &records {
        let v = verdict(r);
        eprintln!(
            "seq {}: {:?} {:?} verify content {} boundary {} {:?}",
            r.seq,
            r.finish_reason,
            r.token_in.as_ref().unwrap().continuation,
            v.content_spans,
            v.boundary_spans,
            v.examples
        );
    }
    for (i, t) in token_in.iter().enumerate().take(3).skip(1) {
        assert!(
            matches!(&t.continuation, TitoContinuation::Extends { record_id, .. } if *record_id == records[i - 1].record_id),
            "seq {}: {:?}",
            records[i].seq,
            t.continuation
        );
        // The turn before ended without the model's end of turn: tito closed it.
        assert!(
            t.origins.iter().any(|o| o.origin == TokenOrigin::Boundary),
            "seq {}: {:?}",
            records[i].seq,
            t.origins
        );
    }
    assert!(
        matches!(
            token_in[3].continuation,
            TitoContinuation::Branch {
                cause: TitoBranchCause::Compacted,
                ..
            }
        ),
        "{:?}",
        token_in[3].continuation
    );
    for r in &records {
        let v = verdict(r);
        assert_eq!(v.boundary_spans, 0, "seq {}: {v:?}", r.seq);
    }
    let report = session_report(&tito).await;
    assert_eq!(
        (report.stats.calls, report.stats.traces),
        (4, 2),
        "{report:?}"
    );
    assert_eq!(report.faithfulness.violations, 0, "{report:?}");
}

/// Every family's call grammar, for each harness's real tool list, is accepted by the real
/// llama-server (a grammar it cannot parse fails the whole call) and enforced: sent whole
/// rather than lazy, the model's first tokens are the family's call opening. For a tool whose
/// arguments the grammar pins to a few values, the forced answer reads back, through the
/// family's own parser, as a call to it with arguments of its schema.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_every_familys_call_grammar_is_accepted_and_read_back() {
    use tokentap_answer_parse::{call_grammar, AnswerParser, Delta, Dialect, Family, ToolSchemas};
    let llama = LlamaServer::shared_think_model().await;
    let client = reqwest::Client::new();
    let prompt = llama
        .tokenizer()
        .tokenize("<|im_start|>user\nHi.<|im_end|>\n<|im_start|>assistant\n")
        .await;
    let complete = |grammar: &str, n_predict: u32| {
        let body = json!({"prompt": prompt, "grammar": grammar, "n_predict": n_predict,
            "temperature": 0.0, "cache_prompt": false});
        let r = client
            .post(format!("{}/completion", llama.url))
            .json(&body)
            .send();
        async move {
            let r = r.await.unwrap();
            let status = r.status();
            let v: Value = r.json().await.unwrap();
            assert!(status.is_success(), "{status}: {v}");
            v["content"].as_str().unwrap().to_owned()
        }
    };
    let harness_tools = |name: &str| -> Vec<Value> {
        let path = format!(
            "{}/../wire/testdata/harness-wire/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["body"]["tools"].as_array().cloned().unwrap()
    };
    let pinned = vec![
        json!({"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "required": ["flag", "level"],
        "properties": {"flag": {"type": "boolean"}, "level": {"type": "integer", "enum": [1, 2]}}}}}),
    ];
    for family in Family::ALL {
        for harness in ["pi", "qwen", "codex", "claude"] {
            let g = call_grammar(family, &harness_tools(harness)).unwrap();
            let text = complete(&g.grammar, 8).await;
            let trigger_start: String = g.trigger.chars().take(2).collect();
            assert!(
                text.starts_with(&trigger_start) || g.trigger.starts_with(&text),
                "{family}, {harness}: the grammar holds the answer to a call: {text:?}"
            );
        }
        let g = call_grammar(family, &pinned).unwrap();
        let text = complete(&g.grammar, 200).await;
        let mut parser = AnswerParser::new(Dialect::new(family), ToolSchemas::from_tools(&pinned));
        let mut deltas = parser.push(&text);
        deltas.extend(parser.finish());
        let call = deltas
            .iter()
            .find_map(|d| match d {
                Delta::ToolCall(c) => Some(c),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{family}: no call read back from {text:?}"));
        assert_eq!(call.name, "pick", "{family}");
        let args: Value = serde_json::from_str(&call.arguments).unwrap();
        assert!(args["flag"].is_boolean(), "{family}: {args}");
        assert!(
            [json!(1), json!(2)].contains(&args["level"]),
            "{family}: {args}"
        );
        eprintln!("{family}: {text:?} -> {}({})", call.name, call.arguments);
    }
}
