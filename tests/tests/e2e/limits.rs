//! Limits on the capture listeners, attacked: slow and half-open clients are cut off at their
//! deadlines, a connection cap closes the excess at once, and none of it stops a real harness
//! call from being served.

use std::time::{Duration, Instant};

use tokentap_e2e::fixtures::{hello_request, post_raw, scripted_tokentap};
use tokentap_e2e::harness::{run_pi, HarnessDirs, Wire};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::scripted::{always, Reply};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The start of a request head that never ends.
const PARTIAL_HEAD: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";

/// Raises this process's open-file limit to its hard limit (children inherit it), and returns
/// it: 1,000 client sockets plus the proxy's 1,000 need more than the common 1,024.
fn raise_nofile(need: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local rlimit.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < need {
            lim.rlim_cur = lim.rlim_max;
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
    lim.rlim_cur
}

/// Opens `n` connections to `port` that each send part of a head and then stall.
async fn stall(port: u16, n: usize) -> Vec<TcpStream> {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let mut s = TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("half-open connection {i}: {e}"));
        s.write_all(PARTIAL_HEAD).await.unwrap();
        held.push(s);
    }
    held
}

/// Whether the proxy closed `s` (EOF or reset) within `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout(limit, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue, // an error response before the close
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_slowloris_does_not_stop_a_real_harness_call() {
    const N: usize = 1_000;
    let nofile = raise_nofile(4 * N as u64);
    assert!(
        nofile >= 3 * N as u64,
        "the open-file limit ({nofile}) is too low for {N} half-open connections; raise the hard limit (ulimit -Hn)"
    );
    let llama = LlamaServer::shared().await;
    let tokentap = Tokentap::start(
        TokentapConfig::new(llama.url.clone(), "llamacpp").arg("--header-timeout=5s"),
    )
    .await;

    let started = Instant::now();
    let mut held = stall(tokentap.port, N).await;
    eprintln!("{N} half-open connections in {:?}", started.elapsed());

    // A real harness call is served while they are held.
    let dirs = HarnessDirs::new();
    let out = run_pi(
        &dirs,
        &tokentap.url,
        Wire::ChatCompletions,
        "sk-e2e-slowloris-4d2a",
        "m",
        "say hi",
    )
    .await;
    out.assert_success("pi under a slowloris");
    let records = tokentap.wait_records(1).await;
    assert!(records.iter().all(|r| r.error.is_none()), "{records:?}");

    // And the stalled connections are all closed by the header deadline (5 s from their
    // first byte; generous slack for a loaded 2-core machine).
    let limit = Duration::from_secs(20);
    let deadline = started + limit;
    for (i, s) in held.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            closed_within(s, left + Duration::from_millis(100)).await,
            "half-open connection {i} still open {limit:?} after it stalled"
        );
    }
    let closed = tokentap
        .metric("tokentap_connections_closed_total{limit=\"header_timeout\"}")
        .await
        .unwrap_or(0.0);
    assert!(closed >= N as f64, "header timeouts counted: {closed}");
}

#[tokio::test(flavor = "multi_thread")]
async fn excess_connections_are_closed_at_once_and_served_again_later() {
    let (_backend, tokentap) = scripted_tokentap(
        always(Reply::text("ok")),
        &["--max-connections=4", "--header-timeout=2s"],
    )
    .await;
    // The start-up probe's connection holds a place until the proxy has seen it close (on a
    // loaded machine, not at once) or its header deadline ends it: past that, the five
    // below are the only connections.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Five half-open connections against a cap of four: each takes its place in a task of
    // its own, so which one is refused is not fixed, but exactly one is, at once (well before
    // the others' 2 s header deadline).
    let mut all = Vec::new();
    for _ in 0..5 {
        let mut s = TcpStream::connect(("127.0.0.1", tokentap.port))
            .await
            .unwrap();
        // The refused one may be closed before this write lands.
        let _ = s.write_all(PARTIAL_HEAD).await;
        all.push(s);
    }
    let t = Instant::now();
    let closed_at_once = futures::future::join_all(
        all.iter_mut()
            .map(|s| closed_within(s, Duration::from_secs(1))),
    )
    .await;
    assert_eq!(
        closed_at_once.iter().filter(|c| **c).count(),
        1,
        "exactly the connection past the cap is closed at once: {closed_at_once:?}"
    );
    assert!(t.elapsed() < Duration::from_millis(1900));
    let mut held: Vec<TcpStream> = all
        .into_iter()
        .zip(closed_at_once)
        .filter_map(|(s, closed)| (!closed).then_some(s))
        .collect();
    // Once the stalled ones hit their header deadline, the proxy serves again.
    for s in &mut held {
        assert!(closed_within(s, Duration::from_secs(10)).await);
    }
    let (status, _) = post_raw(
        &tokentap.chat_url(),
        &[],
        serde_json::to_vec(&hello_request(false)).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let refused = tokentap
        .metric("tokentap_connections_closed_total{limit=\"max_connections\"}")
        .await
        .unwrap_or(0.0);
    assert!(refused >= 1.0, "refusals counted: {refused}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_that_never_arrives_gets_a_408_and_a_record() {
    let (_backend, tokentap) =
        scripted_tokentap(always(Reply::text("ok")), &["--body-timeout=2s"]).await;
    let mut s = TcpStream::connect(("127.0.0.1", tokentap.port))
        .await
        .unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let t = Instant::now();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut response)).await;
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("body-timeout"), "{text}");
    assert!(t.elapsed() >= Duration::from_millis(1_900));
    let r = tokentap.wait_record(1).await;
    assert_eq!(r.response_status, 408);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kept_alive_connection_is_closed_when_idle() {
    let (_backend, tokentap) =
        scripted_tokentap(always(Reply::text("ok")), &["--idle-timeout=1s"]).await;
    let mut s = TcpStream::connect(("127.0.0.1", tokentap.port))
        .await
        .unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let t = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await);
    let idle = t.elapsed();
    assert!(
        idle >= Duration::from_millis(800) && idle < Duration::from_secs(4),
        "closed after {idle:?}"
    );
}
