//! A trainer's side of a rollout node, as the tests use it: bearer GETs and the results long
//! poll over HTTP, or the results log of an in-process node's store.

use std::time::{Duration, Instant};

use serde_json::Value;

use tokentap_rollout::store::Store;
use tokentap_rollout::task::Sample;

use crate::artefacts::tokentap_bin;
use crate::procs::{http_client, spawn_guarded, wait_healthy, ChildGuard, KillScope};

/// GET `url` with the node's bearer `token`.
async fn get(url: &str, token: &str) -> reqwest::Response {
    http_client()
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
}

/// GET `url` with the node's bearer `token`, as JSON.
pub async fn get_json(url: &str, token: &str) -> Value {
    get(url, token).await.json().await.unwrap()
}

/// GET `url` with the node's bearer `token`, as text (`/metrics`).
pub async fn get_text(url: &str, token: &str) -> String {
    get(url, token).await.text().await.unwrap()
}

/// POST `body` as JSON to `url` with the node's bearer `token`: the status and the answer.
pub async fn post_json(url: &str, token: &str, body: &Value) -> (u16, Value) {
    let r = http_client()
        .post(url)
        .bearer_auth(token)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Submits a task to the node at `base`; its answer (rollout id, sample ids) once accepted.
pub async fn submit(base: &str, token: &str, task: &Value) -> Value {
    let (status, answer) = post_json(&format!("{base}/v1/rollouts"), token, task).await;
    assert_eq!(status, 202, "{answer}");
    answer
}

/// The next `want` finished samples after the results cursor `after`, by long poll (`wait`
/// seconds a page); fails the test after `limit`.
pub async fn results_within(
    base: &str,
    token: &str,
    after: u64,
    want: usize,
    wait: u64,
    limit: Duration,
) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = after;
    let deadline = Instant::now() + limit;
    while out.len() < want {
        assert!(Instant::now() < deadline, "{} of {want} results", out.len());
        let page = get_json(
            &format!("{base}/v1/results?after={after}&wait={wait}"),
            token,
        )
        .await;
        after = page["next"].as_u64().unwrap();
        out.extend(
            page["results"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["sample"].clone()),
        );
    }
    out
}

/// The samples in an in-process node's results log, once there are at least `n`; fails the
/// test after `limit`.
pub async fn stored_results(store: &Store, n: usize, limit: Duration) -> Vec<Sample> {
    let deadline = Instant::now() + limit;
    loop {
        let r = store.results_after(0, 1000).unwrap();
        if r.len() >= n {
            return r.into_iter().map(|(_, s)| s).collect();
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} samples ended",
            r.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `tokentap serve` as node `id` of the cluster on `nats` (its token), sealing tasks with
/// `key`, in `dir/id`, with `extra` arguments: the process and its base URL.
pub async fn start_cluster_node(
    dir: &std::path::Path,
    id: &str,
    engine: &str,
    token: &str,
    nats: &crate::nats::NatsServer,
    key: &TaskKeyFile,
    extra: &[&str],
) -> (ChildGuard, String) {
    let data = dir.join(id);
    std::fs::create_dir_all(&data).unwrap();
    let port = crate::procs::free_port();
    let url = nats.url();
    let mut args = vec![
        "--bus",
        &url,
        "--bus-token",
        &nats.token,
        "--node-id",
        id,
        "--task-key-file",
        key.arg(),
    ];
    args.extend_from_slice(extra);
    let process = start_serve(&data, port, engine, token, &args).await;
    (process, format!("http://127.0.0.1:{port}"))
}

/// `tokentap serve` on `127.0.0.1:port` with `extra` arguments, its data under `dir/node` and
/// `dir` as its working directory, `token` as its bearer token, `engine` a vLLM API; returns
/// once `/health` answers. Each start logs to a file of its own in `dir`, so a killed node's
/// log stays beside its successor's.
pub async fn start_serve(
    dir: &std::path::Path,
    port: u16,
    engine: &str,
    token: &str,
    extra: &[&str],
) -> ChildGuard {
    start_serve_on(dir, port, (engine, "vllm"), token, extra).await
}

/// [`start_serve`] on an engine of another kind: `engine` is (its URL, its `--backend-kind`).
pub async fn start_serve_on(
    dir: &std::path::Path,
    port: u16,
    (engine, kind): (&str, &str),
    token: &str,
    extra: &[&str],
) -> ChildGuard {
    let mut cmd = std::process::Command::new(tokentap_bin());
    cmd.arg("serve")
        .args(extra)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .arg("--data")
        .arg(dir.join("node"))
        // No --spool: a node's spool is DATA/spool, never in the working directory.
        .current_dir(dir)
        .args(["--backend", engine, "--backend-kind", kind])
        .env("TOKENTAP_NODE_TOKEN", token)
        .env("TOKENTAP_LOG", "info");
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let log = dir.join(format!("node-{port}-{started}.log"));
    let mut child = spawn_guarded(cmd, &log, KillScope::Group, "tokentap serve").unwrap();
    wait_healthy(
        &format!("http://127.0.0.1:{port}/health"),
        &mut child,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    child
}

/// A trainer's callback endpoint: every delivery, in arrival order, as (Idempotency-Key, body).
pub async fn callback_receiver() -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<(String, Value)>>>,
) {
    let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = got.clone();
    let app = axum::Router::new().route(
        "/results",
        axum::routing::post(
            move |headers: axum::http::HeaderMap, axum::Json(body): axum::Json<Value>| {
                let sink = sink.clone();
                async move {
                    let key = headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    sink.lock().unwrap().push((key, body));
                    axum::http::StatusCode::OK
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/results", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, got)
}

/// A cluster's task key (`serve --task-key-file`): one file per test cluster, 0600, removed
/// with the guard. Every node of the cluster is given the same path.
pub struct TaskKeyFile {
    _dir: tempfile::TempDir,
    pub path: std::path::PathBuf,
}

/// The key's bytes in every test cluster (tests that forge a seal use them too).
pub const TEST_TASK_KEY: &str = "e2e-cluster-task-key-0123456789abcdef0123456789";

impl TaskKeyFile {
    pub fn new() -> TaskKeyFile {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("task.key");
        std::fs::write(&path, format!("{TEST_TASK_KEY}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        TaskKeyFile { _dir: dir, path }
    }

    pub fn arg(&self) -> &str {
        self.path.to_str().unwrap()
    }
}

impl Default for TaskKeyFile {
    fn default() -> Self {
        TaskKeyFile::new()
    }
}

/// A request's head and body off `s`; None if the caller closed first.
async fn read_request(s: &mut tokio::net::TcpStream) -> Option<(String, Vec<u8>)> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&got[..head_end]).into_owned();
    let length: usize = header(&head, "content-length").map_or(0, |v| v.parse().unwrap_or(0));
    let mut body = got.split_off(head_end);
    while body.len() < length {
        match s.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => body.extend_from_slice(&buf[..n]),
        }
    }
    Some((head, body))
}

/// A header's value in a request head (`name` in lowercase).
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// What a [`HeldReceiver`] has seen.
#[derive(Debug, Default, Clone)]
pub struct Held {
    /// Requests held unanswered now, and the most at once.
    pub open: usize,
    pub most_open: usize,
    /// Requests whose caller gave up (closed the connection) before an answer.
    pub dropped: usize,
    /// Requests answered 200 (after the release).
    pub answered: usize,
    /// Requests by Idempotency-Key (the sample id).
    pub arrivals: std::collections::HashMap<String, u32>,
}

/// A callback receiver that never answers until [`HeldReceiver::release`]: it reads each
/// request whole and holds it; from the release on it answers every request 200.
pub struct HeldReceiver {
    pub url: String,
    seen: std::sync::Arc<std::sync::Mutex<Held>>,
    release: tokio::sync::watch::Sender<bool>,
}

impl HeldReceiver {
    pub async fn start() -> HeldReceiver {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/results", listener.local_addr().unwrap());
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Held::default()));
        let (release, released) = tokio::sync::watch::channel(false);
        let state = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                let (seen, mut released) = (state.clone(), released.clone());
                tokio::spawn(async move {
                    let Some((head, _)) = read_request(&mut s).await else {
                        return;
                    };
                    {
                        let mut seen = seen.lock().unwrap();
                        let key = header(&head, "idempotency-key").unwrap_or_default();
                        *seen.arrivals.entry(key.to_owned()).or_default() += 1;
                        seen.open += 1;
                        seen.most_open = seen.most_open.max(seen.open);
                    }
                    let mut buf = [0u8; 1024];
                    let answered = tokio::select! {
                        _ = async { released.wait_for(|r| *r).await.map(|_| ()) } => {
                            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                                .await
                                .is_ok()
                        }
                        // The caller closed (its timeout) or sent something else: either way,
                        // it gave this request up.
                        _ = s.read(&mut buf) => false,
                    };
                    let mut seen = seen.lock().unwrap();
                    seen.open -= 1;
                    if answered {
                        seen.answered += 1;
                    } else {
                        seen.dropped += 1;
                    }
                });
            }
        });
        HeldReceiver { url, seen, release }
    }

    pub fn seen(&self) -> Held {
        self.seen.lock().unwrap().clone()
    }

    /// Answers the requests held and every one after.
    pub fn release(&self) {
        self.release.send_replace(true);
    }
}

/// A callback receiver answering every request 500 with a 1 GiB body (as its content-length
/// says), written from one 64 KiB buffer for as long as the caller reads: the bytes written to
/// each connection the caller closed, in the order they closed.
pub async fn flooding_receiver() -> (String, std::sync::Arc<std::sync::Mutex<Vec<u64>>>) {
    use tokio::io::AsyncWriteExt;
    const GIB: u64 = 1 << 30;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/results", listener.local_addr().unwrap());
    let written = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let closed = written.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let closed = closed.clone();
            tokio::spawn(async move {
                if read_request(&mut s).await.is_none() {
                    return;
                }
                let head = format!(
                    "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: {GIB}\r\n\r\n"
                );
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b'x'; 64 << 10];
                let mut sent = 0u64;
                while sent < GIB {
                    if s.write_all(&chunk).await.is_err() {
                        break;
                    }
                    sent += chunk.len() as u64;
                }
                closed.lock().unwrap().push(sent);
            });
        }
    });
    (url, written)
}

/// A process's peak resident memory (`VmHWM`), in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kb << 10
}
