//! The viewer's data routes over a real spool and traces files written by the real writers.

use std::path::Path;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::Value;
use tokentap_reconstruct::build_all;
use tokentap_reconstruct::synthetic::LongSession;
use tokentap_schema::{CaptureRecord, Strategy, Trace};
use tokentap_spool::{SpoolConfig, SpoolWriter};
use tokentap_viewer::{router, TokenText, TraceFiles, ViewSources};
use tower::ServiceExt;

fn session(name: &str, calls: usize) -> Vec<CaptureRecord> {
    LongSession {
        calls,
        first_prompt: 40,
        last_prompt: 120,
        sampled: 8,
        subagent_every: 100,
        subagent_calls: 0,
        subagent_prompt: 10,
    }
    .records(name, 7)
}

fn write_traces(path: &Path, records: &[CaptureRecord]) -> Vec<Trace> {
    let traces: Vec<Trace> = build_all(records, Strategy::PrefixMerge)
        .into_iter()
        .flat_map(|s| s.traces)
        .collect();
    let mut out = Vec::new();
    for t in &traces {
        out.extend(serde_json::to_vec(t).unwrap());
        out.push(b'\n');
    }
    std::fs::write(path, out).unwrap();
    traces
}

struct Fixture {
    dir: tempfile::TempDir,
    app: axum::Router,
    writer: SpoolWriter,
    records: Vec<CaptureRecord>,
    traces: Vec<Trace>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let spool = dir.path().join("spool");
    let mut writer = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
    let mut records = session("alpha", 5);
    records.extend(session("team/beta", 3));
    writer.append_batch(&records).unwrap();
    writer.sync().unwrap();
    let out = dir.path().join("traj");
    std::fs::create_dir_all(&out).unwrap();
    let traces = write_traces(&out.join("traces.jsonl"), &records);
    let app = router(
        "/view",
        ViewSources {
            spool: Some(spool),
            traces: Some(TraceFiles::Below(out)),
            text: TokenText::None,
        },
        |api| api,
    );
    Fixture {
        dir,
        app,
        writer,
        records,
        traces,
    }
}

async fn get(app: &axum::Router, uri: &str) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let r = app
        .clone()
        .oneshot(Request::get(uri).body(Body::empty()).unwrap())
        .await
        .unwrap();
    let (parts, body) = r.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, bytes.to_vec())
}

async fn json(app: &axum::Router, uri: &str) -> (StatusCode, Value) {
    let (status, _, body) = get(app, uri).await;
    (status, serde_json::from_slice(&body).unwrap())
}

fn q(id: &str) -> String {
    id.replace('/', "%2F")
}

#[tokio::test]
async fn sessions_calls_records_and_traces_come_from_the_spool_and_traces_files() {
    let f = fixture();
    let (status, list) = json(&f.app, "/view/api/sessions").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["total"], 2);
    let by_id = |id: &str| {
        list["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["session_id"] == id)
            .cloned()
            .unwrap()
    };
    assert_eq!(by_id("alpha")["calls"], 5);
    assert_eq!(by_id("team/beta")["calls"], 3);
    let alpha_traces = f.traces.iter().filter(|t| t.session_id == "alpha").count();
    assert_eq!(by_id("alpha")["traces"], alpha_traces);

    let (status, s) = json(&f.app, &format!("/view/api/session?id={}", q("team/beta"))).await;
    assert_eq!(status, StatusCode::OK);
    let calls = s["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 3);
    let starts: Vec<u64> = calls
        .iter()
        .map(|c| c["started_at_unix_ms"].as_u64().unwrap())
        .collect();
    assert!(
        starts.windows(2).all(|w| w[0] <= w[1]),
        "start order: {starts:?}"
    );
    assert!(calls.iter().all(|c| c["token_data"] == true));

    let want = &f.records[6];
    let (status, r) = json(&f.app, &format!("/view/api/record?id={}", want.record_id)).await;
    assert_eq!(status, StatusCode::OK);
    let got: CaptureRecord = serde_json::from_value(r).unwrap();
    assert_eq!(&got, want);

    let t = &f.traces[0];
    let (status, body) = json(&f.app, &format!("/view/api/trace?id={}", q(&t.trace_id))).await;
    assert_eq!(status, StatusCode::OK);
    let got: Trace = serde_json::from_value(body["trace"].clone()).unwrap();
    assert_eq!(&got, t);
    assert_eq!(
        body["pieces"],
        serde_json::json!({}),
        "no token text configured"
    );
}

#[tokio::test]
async fn what_is_written_later_shows_on_the_next_request() {
    let mut f = fixture();
    let more = session("gamma", 2);
    f.writer.append_batch(&more).unwrap();
    f.writer.sync().unwrap();
    let (_, list) = json(&f.app, "/view/api/sessions").await;
    assert_eq!(list["total"], 3);
    // A traces file replaced by a new one (a re-run) is read again, not appended to.
    let path = f.dir.path().join("traj/traces.jsonl");
    let tmp = f.dir.path().join("traj/new.tmp");
    let mut all = f.records.clone();
    all.extend(more);
    let traces = write_traces(&tmp, &all);
    std::fs::rename(&tmp, &path).unwrap();
    let (_, s) = json(&f.app, "/view/api/session?id=gamma").await;
    let gamma = traces.iter().filter(|t| t.session_id == "gamma").count();
    assert!(gamma > 0);
    assert_eq!(s["traces"].as_array().unwrap().len(), gamma);
    let (_, s) = json(&f.app, "/view/api/session?id=alpha").await;
    let alpha = traces.iter().filter(|t| t.session_id == "alpha").count();
    assert_eq!(
        s["traces"].as_array().unwrap().len(),
        alpha,
        "nothing counted twice"
    );
}

#[tokio::test]
async fn unknown_and_oversized_ids_get_clear_errors() {
    let f = fixture();
    for uri in [
        "/view/api/session?id=nope",
        "/view/api/record?id=nope",
        "/view/api/trace?id=nope",
        // Ids are looked up, never used as paths.
        "/view/api/trace?id=..%2F..%2F..%2Fetc%2Fpasswd",
    ] {
        let (status, body) = json(&f.app, uri).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{uri}");
        assert_eq!(body["error"]["type"], "not_found", "{uri}");
    }
    let long = "x".repeat(5000);
    let (status, body) = json(&f.app, &format!("/view/api/session?id={long}")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["type"], "invalid_request");
    for uri in ["/view/api/session", "/view/api/sessions?limit=many"] {
        let (status, body) = json(&f.app, uri).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{uri}");
        assert_eq!(body["error"]["type"], "invalid_request", "{uri}");
    }
}

#[tokio::test]
async fn every_response_carries_the_security_headers() {
    let f = fixture();
    for uri in [
        "/view/",
        "/view/viewer.js",
        "/view/viewer.css",
        "/view/api/sessions",
        "/view/api/session?id=nope",
    ] {
        let (_, headers, _) = get(&f.app, uri).await;
        let csp = headers["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("script-src 'self'"), "{uri}: {csp}");
        assert!(!csp.contains("unsafe-inline"), "{uri}: {csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "{uri}: {csp}");
        assert_eq!(headers["x-content-type-options"], "nosniff", "{uri}");
        assert_eq!(headers["cache-control"], "no-store", "{uri}");
    }
    let (status, headers, _) = get(&f.app, "/view").await;
    assert!(status.is_redirection());
    assert_eq!(headers["location"], "/view/");
}

#[tokio::test]
async fn traces_files_behind_symbolic_links_are_not_read() {
    let f = fixture();
    // Elsewhere on disk, a traces file the operator did not point the viewer at.
    let outside = tempfile::tempdir().unwrap();
    let other = session("secret-session", 2);
    write_traces(&outside.path().join("traces.jsonl"), &other);
    let inside = f.dir.path().join("traj/linked");
    std::fs::create_dir_all(&inside).unwrap();
    std::os::unix::fs::symlink(
        outside.path().join("traces.jsonl"),
        inside.join("traces.jsonl"),
    )
    .unwrap();
    std::os::unix::fs::symlink(outside.path(), f.dir.path().join("traj/linked-dir")).unwrap();
    let (status, _) = json(&f.app, "/view/api/session?id=secret-session").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}
