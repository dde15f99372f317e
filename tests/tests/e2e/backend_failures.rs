//! Engine failures reach the harness as OpenAI-shaped errors with the right status, every
//! failed call leaves a record saying what happened, and tokentap keeps serving afterwards.

use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use tokentap_e2e::fixtures::{hello_request, post_chat, post_stream, scripted_tokentap};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::procs::{closed_port, http_client};
use tokentap_e2e::scripted::{sequence, Reply, FAKE_LOGPROB};
use tokentap_e2e::sse::{assert_openai_error, parse_chat_stream};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::ErrorKind;

/// A normal call succeeds (the proxy survived whatever came before).
async fn assert_still_serving(tokentap: &Tokentap) {
    let (status, v) = post_chat(tokentap, &[], &hello_request(false)).await;
    assert_eq!(status, 200, "tokentap no longer answers a normal call: {v}");
    assert_eq!(v["object"], "chat.completion");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_backend_is_a_502_backend_unavailable() {
    let port = closed_port();
    let tokentap = Tokentap::start(TokentapConfig::new(
        format!("http://127.0.0.1:{port}"),
        "vllm",
    ))
    .await;
    for (n, stream) in [(1, false), (2, true)] {
        let (status, v) = post_chat(&tokentap, &[], &hello_request(stream)).await;
        assert_eq!(status, 502, "stream={stream}: {v}");
        let e = assert_openai_error(&v);
        assert_eq!(e["type"], "server_error");
        assert!(
            e["message"].as_str().unwrap().contains("unavailable"),
            "{v}"
        );
        let r = tokentap.wait_record(n).await;
        let err = r.error.as_ref().expect("record error");
        assert_eq!(err.kind, ErrorKind::BackendUnavailable, "stream={stream}");
        assert_eq!(err.backend_status, None);
        assert_eq!(r.response_status, 502);
        assert!(
            r.backend_request.is_some(),
            "the request that was attempted is kept"
        );
        assert!(r.completion_token_ids.is_none());
    }
    let health = http_client()
        .get(format!("{}/health", tokentap.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backend_500_is_a_502_backend_error_with_the_backend_status() {
    let boom = Reply::Error {
        status: 500,
        body: json!({"object": "error", "message": "scripted engine failure", "type": "InternalServerError", "code": 500}),
    };
    let (_backend, tokentap) =
        scripted_tokentap(sequence(vec![boom.clone(), boom, Reply::text("ok")]), &[]).await;
    for (n, stream) in [(1, false), (2, true)] {
        let (status, v) = post_chat(&tokentap, &[], &hello_request(stream)).await;
        assert_eq!(status, 502, "stream={stream}: {v}");
        let e = assert_openai_error(&v);
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("scripted engine failure"),
            "{v}"
        );
        let r = tokentap.wait_record(n).await;
        let err = r.error.as_ref().expect("record error");
        assert_eq!(err.kind, ErrorKind::BackendError);
        assert_eq!(err.backend_status, Some(500));
        assert_eq!(r.response_status, 502);
    }
    assert_still_serving(&tokentap).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hanging_backend_is_a_504_backend_timeout() {
    let (backend, tokentap) = scripted_tokentap(
        sequence(vec![Reply::Hang, Reply::Hang, Reply::text("ok")]),
        &["--backend-timeout", "2"],
    )
    .await;
    for (n, stream) in [(1, false), (2, true)] {
        let (status, v) = post_chat(&tokentap, &[], &hello_request(stream)).await;
        assert_eq!(status, 504, "stream={stream}: {v}");
        let e = assert_openai_error(&v);
        assert_eq!(e["code"], "timeout", "{v}");
        let r = tokentap.wait_record(n).await;
        let err = r.error.as_ref().expect("record error");
        assert_eq!(err.kind, ErrorKind::BackendTimeout);
        assert_eq!(r.response_status, 504);
    }
    assert_eq!(backend.requests().len(), 2);
    assert_still_serving(&tokentap).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_backend_that_stalls_mid_stream_times_out_with_an_in_stream_error() {
    let (_backend, tokentap) = scripted_tokentap(
        sequence(vec![
            Reply::StallAfter {
                text: "hello".into(),
                chunks: 2,
            },
            Reply::text("ok"),
        ]),
        &["--backend-timeout", "2"],
    )
    .await;
    let (status, sse) = post_stream(&tokentap.chat_url(), &[], &hello_request(true)).await;
    assert_eq!(
        status, 200,
        "headers were already sent when the engine stalled"
    );
    let s = parse_chat_stream(&sse);
    assert_eq!(s.content, "he");
    assert_eq!(s.finish_reason, None, "{sse}");
    assert_eq!(s.errors.len(), 1, "one in-stream error frame: {sse}");
    assert_eq!(
        assert_openai_error(&s.errors[0])["code"],
        "timeout",
        "{sse}"
    );
    let r = tokentap.wait_record(1).await;
    assert_eq!(
        r.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::BackendTimeout)
    );
    let partial: Vec<u32> = "he".chars().map(|c| c as u32 + 3).collect();
    assert_eq!(r.completion_token_ids, Some(partial));
    assert_still_serving(&tokentap).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stream_dropped_mid_way_ends_in_an_error_and_keeps_the_partial_ids() {
    let text = "hello there";
    let (_backend, tokentap) = scripted_tokentap(
        sequence(vec![
            Reply::DropAfter {
                text: text.into(),
                chunks: 3,
            },
            Reply::DropAfter {
                text: text.into(),
                chunks: 3,
            },
            Reply::text("ok"),
        ]),
        &[],
    )
    .await;
    let (status, sse) = post_stream(&tokentap.chat_url(), &[], &hello_request(true)).await;
    assert_eq!(
        status, 200,
        "headers were already sent when the engine failed"
    );
    let s = parse_chat_stream(&sse);
    assert_ne!(
        s.finish_reason.as_deref(),
        Some("stop"),
        "a broken answer must not look complete: {sse}"
    );
    assert!(
        !s.errors.is_empty() || !s.done,
        "the harness must see an in-stream error frame or an unterminated stream: {sse}"
    );
    for e in &s.errors {
        assert_openai_error(e);
    }
    assert_eq!(
        s.content, "hel",
        "the three chunks that did arrive were relayed"
    );

    let r = tokentap.wait_record(1).await;
    let err = r.error.as_ref().expect("record error");
    assert!(
        matches!(
            err.kind,
            ErrorKind::BackendError | ErrorKind::BackendUnavailable
        ),
        "{err:?}"
    );
    // Stand-in ids are code point + 3: the three tokens that arrived, and their logprobs.
    let partial: Vec<u32> = "hel".chars().map(|c| c as u32 + 3).collect();
    assert_eq!(r.completion_token_ids.as_ref(), Some(&partial));
    assert_eq!(r.logprobs, Some(vec![FAKE_LOGPROB; 3]));
    assert_eq!(
        r.message.as_ref().and_then(|m| m.content.as_deref()),
        Some("hel")
    );
    assert!(
        r.prompt_token_ids.is_some(),
        "prompt ids came with the first chunk"
    );

    // The same failure on a whole (non-streamed) call is a 502.
    let (status, v) = post_chat(&tokentap, &[], &hello_request(false)).await;
    assert_eq!(status, 502, "{v}");
    assert_openai_error(&v);
    let r = tokentap.wait_record(2).await;
    assert!(r.error.is_some());
    assert_still_serving(&tokentap).await;
}

/// An engine that never ends its answer (one endless SSE line, or an endless whole body) is
/// cut off at `--max-answer-bytes` (its connection closed) instead of growing the proxy's
/// memory while the idle timeout never fires: the harness gets an error, the record keeps the
/// tokens that came before, and the proxy serves on.
#[tokio::test(flavor = "multi_thread")]
async fn an_endless_engine_answer_is_cut_off_at_max_answer_bytes() {
    const LIMIT: &str = "1048576";
    let flood = || Reply::Flood {
        text: "hello".into(),
        chunks: 2,
    };
    let (backend, tokentap) = scripted_tokentap(
        sequence(vec![flood(), flood(), Reply::text("ok")]),
        &["--max-answer-bytes", LIMIT],
    )
    .await;
    let bounded = Duration::from_secs(60);
    let (status, sse) = tokio::time::timeout(
        bounded,
        post_stream(&tokentap.chat_url(), &[], &hello_request(true)),
    )
    .await
    .expect("the streamed call ends");
    assert_eq!(status, 200, "headers were sent before the flood");
    let s = parse_chat_stream(&sse);
    assert_eq!(s.content, "he", "the chunks before the flood were relayed");
    assert_eq!(s.finish_reason, None, "{sse}");
    assert_eq!(s.errors.len(), 1, "one in-stream error frame: {sse}");
    let message = assert_openai_error(&s.errors[0])["message"]
        .as_str()
        .unwrap();
    assert!(
        message.contains(&format!("larger than {LIMIT} bytes")),
        "{message}"
    );
    let r = tokentap.wait_record(1).await;
    let err = r.error.as_ref().expect("record error");
    assert_eq!(err.kind, ErrorKind::BackendError, "{err:?}");
    assert!(err.message.contains("--max-answer-bytes"), "{err:?}");
    let partial: Vec<u32> = "he".chars().map(|c| c as u32 + 3).collect();
    assert_eq!(r.completion_token_ids, Some(partial));
    assert!(r.prompt_token_ids.is_some(), "prompt ids came first");

    let (status, v) =
        tokio::time::timeout(bounded, post_chat(&tokentap, &[], &hello_request(false)))
            .await
            .expect("the whole call ends");
    assert_eq!(status, 502, "{v}");
    let message = assert_openai_error(&v)["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("larger than {LIMIT} bytes")),
        "{message}"
    );
    let r = tokentap.wait_record(2).await;
    assert_eq!(
        r.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::BackendError)
    );

    // Both floods' connections were closed by the proxy (the engine saw its client go).
    let closed = async {
        while backend.disconnects() < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert!(
        tokio::time::timeout(Duration::from_secs(20), closed)
            .await
            .is_ok(),
        "{} of 2 flooding connections closed",
        backend.disconnects()
    );
    assert_still_serving(&tokentap).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_disconnect_mid_stream_is_recorded_and_cancels_the_backend_call() {
    let (backend, tokentap) =
        scripted_tokentap(sequence(vec![Reply::Endless, Reply::text("ok")]), &[]).await;
    let resp = http_client()
        .post(tokentap.chat_url())
        .json(&hello_request(true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.bytes_stream();
    let first = body.next().await.expect("a first chunk").expect("chunk");
    assert!(first.starts_with(b"data: "), "{first:?}");
    drop(body); // the harness goes away mid-answer

    let r = tokentap.wait_record(1).await;
    let err = r.error.as_ref().expect("record error");
    assert_eq!(err.kind, ErrorKind::ClientDisconnected, "{err:?}");
    assert!(
        r.completion_token_ids
            .as_ref()
            .is_some_and(|ids| !ids.is_empty()),
        "the tokens sampled before the disconnect are kept"
    );
    assert!(
        backend.wait_disconnect(Duration::from_secs(20)).await,
        "tokentap must close its engine connection when the harness goes away"
    );
    assert_still_serving(&tokentap).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vllm_context_overflow_is_a_400_context_length_exceeded() {
    let (_backend, tokentap) = scripted_tokentap(
        sequence(vec![
            Reply::vllm_context_overflow(),
            Reply::vllm_context_overflow(),
            Reply::text("ok"),
        ]),
        &[],
    )
    .await;
    for (n, stream) in [(1, false), (2, true)] {
        let (status, v) = post_chat(&tokentap, &[], &hello_request(stream)).await;
        assert_eq!(status, 400, "{v}");
        let e = assert_openai_error(&v);
        assert_eq!(e["code"], "context_length_exceeded", "{v}");
        assert_eq!(e["type"], "invalid_request_error");
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("maximum context length"),
            "{v}"
        );
        let r = tokentap.wait_record(n).await;
        let err = r.error.as_ref().expect("record error");
        assert_eq!(err.kind, ErrorKind::ContextLengthExceeded);
        assert_eq!(err.backend_status, Some(400));
    }
    assert_still_serving(&tokentap).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_llama_server_context_overflow_is_a_400_context_length_exceeded() {
    let llama = LlamaServer::start(256).await;
    let tokentap = Tokentap::start(TokentapConfig::new(llama.url.clone(), "llamacpp")).await;
    let mut long = hello_request(false);
    long["messages"][1]["content"] =
        json!("tell me about the weather in the mountains ".repeat(100));
    for (n, stream) in [(1, false), (2, true)] {
        long["stream"] = json!(stream);
        let (status, v) = post_chat(&tokentap, &[], &long).await;
        assert_eq!(status, 400, "stream={stream}: {v}");
        let e = assert_openai_error(&v);
        assert_eq!(e["code"], "context_length_exceeded", "{v}");
        let r = tokentap.wait_record(n).await;
        let err = r.error.as_ref().expect("record error");
        assert_eq!(err.kind, ErrorKind::ContextLengthExceeded, "{err:?}");
        assert_eq!(err.backend_status, Some(400));
    }
    // A prompt that fits still works on the same small-context engine.
    let mut short = hello_request(false);
    short["max_tokens"] = json!(16);
    let (status, v) = post_chat(&tokentap, &[], &short).await;
    assert_eq!(status, 200, "{v}");
}

/// An engine that fails mid-stream ends the harness's stream with the API's error event, a
/// complete response, and the connection stays usable: the harness's next request on it is
/// answered. (Closing it unannounced, as tokentap once did, made a client that reused the
/// kept-alive connection fail its next call: "server disconnected without sending a
/// response".) Raw HTTP/1.1 on one connection, so the reuse is certain.
#[tokio::test(flavor = "multi_thread")]
async fn after_a_stream_the_engine_broke_the_connection_serves_the_next_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_backend, tokentap) = scripted_tokentap(
        sequence(vec![
            Reply::DropAfter {
                text: "Hello there".into(),
                chunks: 2,
            },
            Reply::text("Fine."),
        ]),
        &[],
    )
    .await;
    let addr = tokentap.url.trim_start_matches("http://").to_string();
    let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let request = |stream: bool| {
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
            .to_string();
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // The broken stream, read to its chunked end.
    conn.write_all(request(true).as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 8192];
    while !seen.ends_with(b"0\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut buf))
            .await
            .expect("the stream ends")
            .unwrap();
        assert!(
            n > 0,
            "closed before the stream's end: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let first = String::from_utf8_lossy(&seen);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(
        first.contains("error"),
        "the stream ends with an error event: {first}"
    );
    assert!(
        !first.to_ascii_lowercase().contains("connection: close"),
        "{first}"
    );
    // The next request on the same connection.
    conn.write_all(request(false).as_bytes()).await.unwrap();
    let mut second = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut buf))
            .await
            .expect("an answer to the second request")
            .unwrap();
        second.extend_from_slice(&buf[..n]);
        if n == 0 || String::from_utf8_lossy(&second).contains("Fine.") {
            break;
        }
    }
    let second = String::from_utf8_lossy(&second);
    assert!(
        second.starts_with("HTTP/1.1 200") && second.contains("Fine."),
        "the kept-alive connection answered the next request: {second:?}"
    );
}
