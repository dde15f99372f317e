//! Session attribution over the wire: the `x-tokentap-session` header, a `/s/{id}/v1/...` path
//! prefix, `?session=`, the API key (hashed), or a fresh id; `seq` counts per session.

use std::collections::HashMap;

use tokentap_e2e::fixtures::{hello_request, post_raw, scripted_tokentap};
use tokentap_e2e::scripted::{always, Reply};
use tokentap_e2e::sse::assert_openai_error;
use tokentap_e2e::{CaptureRecord, ErrorKind, SessionSource};

/// (url, headers, which session the call belongs to)
type Call<'a> = (String, Vec<(&'a str, &'a str)>, &'a str);

#[tokio::test(flavor = "multi_thread")]
async fn each_session_source_lands_in_its_session_with_per_session_seq() {
    let (_backend, tokentap) = scripted_tokentap(always(Reply::text("ok")), &[]).await;
    let body = serde_json::to_vec(&hello_request(false)).unwrap();
    let base = tokentap.url.clone();
    let chat = format!("{base}/v1/chat/completions");
    let calls: Vec<Call> = vec![
        // (url, headers, label)
        (
            chat.clone(),
            vec![("x-tokentap-session", "run-h")],
            "header",
        ),
        (
            format!("{base}/s/run-p/v1/chat/completions"),
            vec![],
            "path",
        ),
        (format!("{chat}?session=run-q"), vec![], "query"),
        (
            chat.clone(),
            vec![("authorization", "Bearer sk-e2e-key-one")],
            "key1",
        ),
        (chat.clone(), vec![], "fresh"),
        (
            chat.clone(),
            vec![("x-tokentap-session", "run-h")],
            "header",
        ),
        (format!("{base}/s/run-p/chat/completions"), vec![], "path"),
        // Percent-encoded ("%2D" is "-"): the same session as the plain spelling above.
        (format!("{chat}?beta=true&session=run%2Dq"), vec![], "query"),
        (
            chat.clone(),
            vec![("authorization", "Bearer sk-e2e-key-one")],
            "key1",
        ),
        (
            chat.clone(),
            vec![("authorization", "Bearer sk-e2e-key-two")],
            "key2",
        ),
        (chat.clone(), vec![], "fresh"),
        // The header wins over everything else.
        (
            format!("{base}/s/run-p/v1/chat/completions?session=run-q"),
            vec![
                ("x-tokentap-session", "run-h"),
                ("authorization", "Bearer sk-e2e-key-one"),
            ],
            "header",
        ),
        // A path prefix wins over the query and the key.
        (
            format!("{base}/s/run-p/v1/chat/completions?session=run-q"),
            vec![("x-api-key", "sk-e2e-key-one")],
            "path",
        ),
        (chat.clone(), vec![("x-api-key", "sk-e2e-key-one")], "key1"),
    ];
    for (i, (url, headers, label)) in calls.iter().enumerate() {
        let (status, v) = post_raw(url, headers, body.clone()).await;
        assert_eq!(status, 200, "call {i} ({label}) to {url}: {v}");
        // Awaiting each record before the next call keeps the spool in call order.
        tokentap.wait_records(i + 1).await;
    }
    let records = tokentap.wait_records(calls.len()).await;
    assert_eq!(records.len(), calls.len());
    let by_label: Vec<(&str, &CaptureRecord)> =
        calls.iter().map(|c| c.2).zip(records.iter()).collect();

    let expect_source = |label: &str| match label {
        "header" => SessionSource::Header,
        "path" => SessionSource::PathPrefix,
        "query" => SessionSource::Query,
        "key1" | "key2" => SessionSource::ApiKey,
        _ => SessionSource::Generated,
    };
    let mut ids: HashMap<&str, &str> = HashMap::new();
    let mut next_seq: HashMap<&str, u64> = HashMap::new();
    let mut fresh_ids = Vec::new();
    for (label, r) in &by_label {
        assert_eq!(
            r.session_source,
            expect_source(label),
            "{label}: {}",
            r.session_id
        );
        match *label {
            "header" => assert_eq!(r.session_id, "run-h"),
            "path" => assert_eq!(r.session_id, "run-p"),
            "query" => assert_eq!(r.session_id, "run-q"),
            "key1" | "key2" => {
                assert!(r.session_id.starts_with("key-"), "{}", r.session_id);
                assert!(
                    !r.session_id.contains("sk-e2e"),
                    "the key itself must not name the session"
                );
            }
            _ => {}
        }
        if *label == "fresh" {
            assert_eq!(r.seq, 0, "a fresh session holds one call");
            fresh_ids.push(r.session_id.clone());
            continue;
        }
        // The same source value always maps to the same session id.
        let id = ids.entry(label).or_insert(r.session_id.as_str());
        assert_eq!(*id, r.session_id, "{label}");
        let seq = next_seq.entry(label).or_insert(0);
        assert_eq!(r.seq, *seq, "{label}: seq counts per session");
        *seq += 1;
    }
    assert_ne!(
        ids["key1"], ids["key2"],
        "different keys, different sessions"
    );
    assert_eq!(fresh_ids.len(), 2);
    assert_ne!(fresh_ids[0], fresh_ids[1], "fresh ids are unique");
    assert_eq!(next_seq["header"], 3);
    assert_eq!(next_seq["key1"], 3);
    // The path is recorded as received, prefix included.
    assert_eq!(by_label[1].1.request.path, "/s/run-p/v1/chat/completions");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_invalid_session_name_is_a_400_with_a_record() {
    let (backend, tokentap) = scripted_tokentap(always(Reply::text("ok")), &[]).await;
    let body = serde_json::to_vec(&hello_request(false)).unwrap();
    let (status, v) = post_raw(
        &tokentap.chat_url(),
        &[("x-tokentap-session", "a b/c")],
        body.clone(),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    let msg = assert_openai_error(&v)["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        msg.contains("session") && msg.contains("x-tokentap-session"),
        "{msg}"
    );
    let r = tokentap.wait_record(1).await;
    assert_eq!(r.error.map(|e| e.kind), Some(ErrorKind::InvalidRequest));
    assert!(backend.requests().is_empty());
}
