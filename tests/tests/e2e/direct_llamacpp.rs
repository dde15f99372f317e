//! Direct Chat Completions calls through tokentap to a real llama-server (via the tee): the
//! answers have OpenAI's shapes, and every record's token ids are the engine's own.

use serde_json::{json, Value};
use tokentap_e2e::checks::assert_records_match_engine;
use tokentap_e2e::fixtures::{post_chat, post_stream};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::sse::parse_chat_stream;
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};

struct Stack {
    llama: &'static LlamaServer,
    tee: TeeProxy,
    tokentap: Tokentap,
}

/// llama-server ← tee ← tokentap (`--backend-kind llamacpp`, plus `extra` flags).
async fn stack(extra: &[&str]) -> Stack {
    let llama = LlamaServer::shared().await;
    let tee = TeeProxy::start(&llama.url).await;
    let mut config = TokentapConfig::new(tee.url.clone(), "llamacpp");
    for a in extra {
        config = config.arg(*a);
    }
    let tokentap = Tokentap::start(config).await;
    Stack {
        llama,
        tee,
        tokentap,
    }
}

fn request(stream: bool) -> Value {
    json!({
        "model": "whatever-the-harness-says",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hello and name one file."}]}
        ],
        "stream": stream,
        "max_tokens": 200,
        "temperature": 0.8
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_whole_answer_has_the_openai_shape_and_the_engines_token_ids() {
    let s = stack(&[]).await;
    let (status, v) = post_chat(&s.tokentap, &[], &request(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(
        v["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-")),
        "{v}"
    );
    assert!(v["created"].is_u64());
    assert_eq!(
        v["model"], "whatever-the-harness-says",
        "the harness's model name is echoed"
    );
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 1);
    let c = &choices[0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    let content = c["message"]["content"].as_str().expect("text content");
    assert!(
        matches!(c["finish_reason"].as_str(), Some("stop" | "length")),
        "{v}"
    );
    let usage = &v["usage"];

    let records = s.tokentap.wait_records(1).await;
    let r = &records[0];
    assert_records_match_engine(&records, &s.tee, &s.llama.tokenizer()).await;
    assert_eq!(
        r.message
            .as_ref()
            .and_then(|m| m.content.as_deref())
            .unwrap_or(""),
        content
    );
    let ids = r.completion_token_ids.as_ref().unwrap();
    assert_eq!(
        usage["prompt_tokens"].as_u64(),
        Some(r.prompt_token_ids.as_ref().unwrap().len() as u64)
    );
    assert_eq!(usage["completion_tokens"].as_u64(), Some(ids.len() as u64));
    // The engine was asked for token data; the harness did not see it.
    let sent = s.tee.chat_exchanges()[0].request_json();
    assert_eq!(
        (sent["logprobs"].clone(), sent["top_logprobs"].clone()),
        (json!(true), json!(1))
    );
    assert_eq!(sent["stream"], false);
    assert!(c["logprobs"].is_null());
    // The backend model is the engine's only one, found at start-up.
    assert_eq!(sent["model"], "tiny");
    assert_eq!(r.backend.model, "tiny");
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_stream_is_chunks_then_done_with_usage_only_when_asked() {
    let s = stack(&[]).await;
    let url = s.tokentap.chat_url();

    let mut with_usage = request(true);
    with_usage["stream_options"] = json!({"include_usage": true});
    let (status, sse) = post_stream(&url, &[], &with_usage).await;
    assert_eq!(status, 200, "{sse}");
    let a = parse_chat_stream(&sse);
    assert!(a.done && sse.ends_with("data: [DONE]\n\n"), "{sse}");
    assert!(a.errors.is_empty(), "{sse}");
    assert!(
        matches!(a.finish_reason.as_deref(), Some("stop" | "length")),
        "{sse}"
    );
    assert_eq!(a.chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        a.usage_chunks, 1,
        "include_usage gives exactly one usage chunk"
    );
    // The usage chunk comes last, after the finish chunk.
    assert!(a.chunks.last().unwrap()["choices"]
        .as_array()
        .unwrap()
        .is_empty());

    s.tokentap.wait_records(1).await; // keeps the spool in call order
    let (status, sse) = post_stream(&url, &[], &request(true)).await;
    assert_eq!(status, 200);
    let b = parse_chat_stream(&sse);
    assert!(b.done && b.finish_reason.is_some(), "{sse}");
    assert_eq!(b.usage_chunks, 0, "no usage chunk unless asked: {sse}");

    let records = s.tokentap.wait_records(2).await;
    assert_records_match_engine(&records, &s.tee, &s.llama.tokenizer()).await;
    for (r, streamed) in records.iter().zip([&a, &b]) {
        assert_eq!(
            r.message
                .as_ref()
                .and_then(|m| m.content.as_deref())
                .unwrap_or(""),
            streamed.content
        );
        assert_eq!(
            r.finish_reason.map(|f| f.as_openai()),
            streamed.finish_reason.as_deref()
        );
        assert!(!r.backend.synthetic_stream);
    }
    let usage = a.usage.unwrap();
    assert_eq!(
        usage["prompt_tokens"].as_u64(),
        Some(records[0].prompt_token_ids.as_ref().unwrap().len() as u64)
    );
    assert_eq!(
        usage["completion_tokens"].as_u64(),
        Some(records[0].usage.unwrap().completion_tokens)
    );
    // tokentap streamed from the engine too.
    assert!(s
        .tee
        .chat_exchanges()
        .iter()
        .all(|e| e.request_json()["stream"] == true));
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_synthetic_stream_plays_a_whole_engine_answer_back_as_a_stream() {
    let s = stack(&["--synthetic-stream"]).await;
    let mut req = request(true);
    req["stream_options"] = json!({"include_usage": true});
    let (status, sse) = post_stream(&s.tokentap.chat_url(), &[], &req).await;
    assert_eq!(status, 200, "{sse}");
    let a = parse_chat_stream(&sse);
    assert!(
        a.done && a.errors.is_empty() && a.finish_reason.is_some(),
        "{sse}"
    );
    assert_eq!(a.usage_chunks, 1);

    let records = s.tokentap.wait_records(1).await;
    let r = &records[0];
    assert!(
        r.backend.synthetic_stream,
        "the record says the stream was synthetic"
    );
    assert_records_match_engine(&records, &s.tee, &s.llama.tokenizer()).await;
    assert_eq!(
        r.message
            .as_ref()
            .and_then(|m| m.content.as_deref())
            .unwrap_or(""),
        a.content
    );
    assert_eq!(
        s.tee.chat_exchanges()[0].request_json()["stream"],
        false,
        "the engine was called non-streaming"
    );
}
