//! Bad harness input: each malformed call gets the right 4xx in OpenAI's error shape with a
//! message naming the problem, still leaves a record with `error` set (unknown routes are not
//! model calls and leave none), and tokentap keeps serving.

use serde_json::{json, Value};
use tokentap_e2e::fixtures::{hello_request, post_chat, post_raw, scripted_tokentap};
use tokentap_e2e::procs::http_client;
use tokentap_e2e::scripted::{always, Reply};
use tokentap_e2e::sse::assert_openai_error;
use tokentap_e2e::ErrorKind;

const SESSION: (&str, &str) = ("x-tokentap-session", "bad-input");

#[tokio::test(flavor = "multi_thread")]
async fn malformed_requests_get_openai_400s_and_error_records() {
    let (backend, tokentap) = scripted_tokentap(always(Reply::text("hi")), &[]).await;
    // (body, expected `param`, words the message must contain)
    let cases: Vec<(Vec<u8>, Option<&str>, &[&str])> = vec![
        (b"{\"model\": \"m\", \"messages\": [".to_vec(), None, &["not valid JSON"]),
        (b"[1, 2]".to_vec(), None, &["JSON object"]),
        (json!({"model": "m", "messages": "hi"}).to_string().into_bytes(), Some("messages"), &["messages"]),
        (
            json!({"model": "m", "messages": [{"role": 5, "content": "x"}]}).to_string().into_bytes(),
            Some("messages[0].role"),
            &["messages[0].role"],
        ),
        (
            json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(),
            Some("messages[0].role"),
            &["wizard"],
        ),
        (json!({"messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(), None, &["model"]),
        (json!({"model": "m", "messages": []}).to_string().into_bytes(), Some("messages"), &["at least one"]),
        (
            json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"})
                .to_string()
                .into_bytes(),
            Some("max_tokens"),
            &["max_tokens"],
        ),
        (
            json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}).to_string().into_bytes(),
            Some("messages[0].tool_call_id"),
            &["tool_call_id"],
        ),
    ];
    for (i, (body, param, words)) in cases.iter().enumerate() {
        let shown = String::from_utf8_lossy(body).into_owned();
        let (status, v) = post_raw(&tokentap.chat_url(), &[SESSION], body.clone()).await;
        assert_eq!(status, 400, "{shown} → {v}");
        let e = assert_openai_error(&v);
        assert_eq!(e["type"], "invalid_request_error", "{shown} → {v}");
        assert_eq!(e["param"].as_str(), *param, "{shown} → {v}");
        let msg = e["message"].as_str().unwrap();
        for w in *words {
            assert!(
                msg.contains(w),
                "message for {shown} should mention {w:?}: {msg}"
            );
        }

        let r = tokentap.wait_record(i + 1).await;
        assert_eq!((r.session_id.as_str(), r.seq), ("bad-input", i as u64));
        let err = r
            .error
            .as_ref()
            .unwrap_or_else(|| panic!("no error on the record of {shown}"));
        assert_eq!(err.kind, ErrorKind::InvalidRequest, "{shown}");
        assert_eq!(
            err.message, msg,
            "the record keeps the message the harness got"
        );
        assert_eq!(r.response_status, 400);
        assert!(r.backend_request.is_none() && r.completion_token_ids.is_none());
        assert_eq!(r.request.body_bytes as usize, body.len());
        // What arrived is kept: parsed when it was JSON, as text when it was not.
        assert!(r.request.body.is_some() || r.request.body_text.as_deref() == Some(shown.as_str()));
    }
    assert!(
        backend.requests().is_empty(),
        "no bad request may reach the engine"
    );

    // Still serving, on the same process.
    let (status, v) = post_chat(&tokentap, &[SESSION], &hello_request(false)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "hi");
    let r = tokentap.wait_record(cases.len() + 1).await;
    assert!(r.error.is_none() && r.seq == cases.len() as u64);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_over_max_body_bytes_is_413_and_tokentap_keeps_serving() {
    let (backend, tokentap) =
        scripted_tokentap(always(Reply::text("hi")), &["--max-body-bytes", "1000"]).await;
    let mut big = hello_request(false);
    big["messages"][1]["content"] = json!("x".repeat(2000));
    let body = serde_json::to_vec(&big).unwrap();
    assert!(body.len() > 2000);
    let (status, v) = post_raw(&tokentap.chat_url(), &[], body.clone()).await;
    assert_eq!(status, 413, "{v}");
    let e = assert_openai_error(&v);
    assert_eq!(e["code"], "request_too_large");
    let msg = e["message"].as_str().unwrap();
    assert!(
        msg.contains("1000") && msg.contains("--max-body-bytes"),
        "{msg}"
    );
    let r = tokentap.wait_record(1).await;
    assert_eq!(
        r.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::BodyTooLarge)
    );
    assert_eq!(r.response_status, 413);

    // A chunked body (no content-length) over the limit is cut off too.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(300).map(|c| Ok(c.to_vec())).collect();
    let (status, v) = post_raw(
        &tokentap.chat_url(),
        &[],
        reqwest::Body::wrap_stream(futures::stream::iter(chunks)),
    )
    .await;
    assert_eq!(status, 413, "{v}");
    let r = tokentap.wait_record(2).await;
    assert_eq!(
        r.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::BodyTooLarge)
    );

    // A body under the limit still works.
    let small = hello_request(false);
    assert!(serde_json::to_vec(&small).unwrap().len() < 1000);
    let (status, v) = post_chat(&tokentap, &[], &small).await;
    assert_eq!(status, 200, "{v}");
    assert!(tokentap.wait_record(3).await.error.is_none());
    assert_eq!(
        backend.requests().len(),
        1,
        "only the small request reached the engine"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_default_body_limit_is_32_mib() {
    let (_backend, tokentap) = scripted_tokentap(always(Reply::text("hi")), &[]).await;
    let mut big = hello_request(false);
    big["messages"][1]["content"] = json!("x".repeat(33 << 20));
    let (status, v) = post_chat(&tokentap, &[], &big).await;
    assert_eq!(status, 413, "{v}");
    let msg = assert_openai_error(&v)["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(msg.contains(&(32u64 << 20).to_string()), "{msg}");
    let r = tokentap.wait_record(1).await;
    assert_eq!(
        r.error.as_ref().map(|e| e.kind),
        Some(ErrorKind::BodyTooLarge)
    );

    let (status, _) = post_chat(&tokentap, &[], &hello_request(false)).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_routes_are_openai_404s_and_leave_no_record() {
    let (_backend, tokentap) = scripted_tokentap(always(Reply::text("hi")), &[]).await;
    let client = http_client();
    for (method, path) in [
        ("POST", "/v1/completions"),
        ("POST", "/v2/chat/completions"),
        ("GET", "/v1/chat/completions"),
        ("POST", "/s/only-a-session"),
        ("DELETE", "/v1/models"),
    ] {
        let resp = client
            .request(method.parse().unwrap(), format!("{}{path}", tokentap.url))
            .header("content-type", "application/json")
            .body(hello_request(false).to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 404, "{method} {path}");
        let v: Value = resp.json().await.expect("JSON error body");
        let e = assert_openai_error(&v);
        assert_eq!(e["code"], "unknown_url", "{v}");
        let msg = e["message"].as_str().unwrap();
        assert!(msg.contains(method) && msg.contains(path), "{msg}");
    }
    // Only model calls are recorded: the good call afterwards is the first record.
    let (status, _) = post_chat(&tokentap, &[], &hello_request(false)).await;
    assert_eq!(status, 200);
    let records = tokentap.wait_records(1).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let records_after = tokentap.records();
    assert_eq!(
        records_after.len(),
        1,
        "unknown routes left records: {records_after:#?}"
    );
    assert_eq!(records[0].request.path, "/v1/chat/completions");
}
