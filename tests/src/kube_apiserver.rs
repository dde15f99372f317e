//! A named test double of the Kubernetes API server, for the node agent's Kubernetes source
//! (no API server can run here). It serves what the real one serves for the two requests a
//! pod watcher makes (https://kubernetes.io/docs/reference/using-api/api-concepts/):
//! - `GET /api/v1/pods?fieldSelector=spec.nodeName=N[&limit&resourceVersion]`: a `PodList`
//!   whose `metadata.resourceVersion` is the collection's current version;
//! - `GET /api/v1/pods?watch=true&resourceVersion=RV&fieldSelector=…[&timeoutSeconds]`: a
//!   stream of newline-delimited `{"type":"ADDED|MODIFIED|DELETED","object":Pod}` for every
//!   change after RV, each object carrying its new `metadata.resourceVersion`, held open until
//!   `timeoutSeconds` or until the test drops it.
//! - a watch from a resourceVersion this server never issued (a client of a restarted or
//!   restored server) gets the ERROR event `410 Expired`, upon which clients list again.
//!
//! Left out: pagination (every list fits one page), bookmarks, compaction, authentication
//! (plain HTTP on 127.0.0.1), and every other resource.
//!
//! [`KubeApiDouble::pod`] shapes pods like real ones (uid, namespace, annotations,
//! spec.nodeName, status.phase, status.qosClass).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, watch};

pub struct KubeApiDouble {
    pub url: String,
    pub addr: std::net::SocketAddr,
    state: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

struct Shared {
    inner: Mutex<Inner>,
    changes: broadcast::Sender<Change>,
    /// Bumped to end every open watch.
    generation: watch::Sender<u64>,
    /// Set by [`KubeApiDouble::stop`]: connections clients keep alive get a 503 and are
    /// closed, so they reconnect to whatever listens next.
    stopped: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Inner {
    version: u64,
    pods: BTreeMap<String, Value>,
    log: Vec<Change>,
}

#[derive(Clone)]
struct Change {
    version: u64,
    kind: &'static str,
    pod: Value,
}

impl KubeApiDouble {
    pub async fn start() -> KubeApiDouble {
        KubeApiDouble::start_at("127.0.0.1:0".parse().unwrap()).await
    }

    /// On a given address (to bring a stopped double back where clients expect it).
    pub async fn start_at(addr: std::net::SocketAddr) -> KubeApiDouble {
        let (changes, _) = broadcast::channel(1024);
        let (generation, _) = watch::channel(0);
        let state = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            changes,
            generation,
            stopped: std::sync::atomic::AtomicBool::new(false),
        });
        let app = Router::new()
            .route("/api/v1/pods", get(pods))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("binding the API double");
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        KubeApiDouble {
            url: format!("http://{addr}"),
            addr,
            state,
            task,
        }
    }

    /// A pod as the API returns it.
    pub fn pod(
        uid: &str,
        namespace: &str,
        name: &str,
        node: &str,
        annotations: &[(&str, &str)],
        phase: &str,
        qos: &str,
    ) -> Value {
        let annotations: serde_json::Map<String, Value> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "creationTimestamp": "2026-11-24T00:00:00Z",
                "annotations": annotations,
                "labels": {"app": name},
            },
            "spec": {
                "nodeName": node,
                "containers": [{"name": "agent", "image": "tokentap-test-base:1"}],
            },
            "status": {"phase": phase, "qosClass": qos},
        })
    }

    /// Creates or replaces a pod (by uid): ADDED or MODIFIED to watchers.
    pub fn apply(&self, mut pod: Value) {
        let uid = pod["metadata"]["uid"]
            .as_str()
            .expect("a pod uid")
            .to_owned();
        let mut inner = self.state.inner.lock().unwrap();
        inner.version += 1;
        pod["metadata"]["resourceVersion"] = Value::String(inner.version.to_string());
        let kind = if inner.pods.contains_key(&uid) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        inner.pods.insert(uid, pod.clone());
        let change = Change {
            version: inner.version,
            kind,
            pod,
        };
        inner.log.push(change.clone());
        let _ = self.state.changes.send(change);
    }

    /// Deletes a pod: DELETED to watchers.
    pub fn delete(&self, uid: &str) {
        let mut inner = self.state.inner.lock().unwrap();
        let Some(mut pod) = inner.pods.remove(uid) else {
            return;
        };
        inner.version += 1;
        pod["metadata"]["resourceVersion"] = Value::String(inner.version.to_string());
        let change = Change {
            version: inner.version,
            kind: "DELETED",
            pod,
        };
        inner.log.push(change.clone());
        let _ = self.state.changes.send(change);
    }

    /// Ends every open watch (as an API server restart or a load balancer would).
    pub fn drop_watches(&self) {
        self.state.generation.send_modify(|g| *g += 1);
    }

    /// Stops serving (connections refused until a new double starts on the same address).
    pub fn stop(self) {
        self.state
            .stopped
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.drop_watches();
        self.task.abort();
    }

    /// A kubeconfig for this double, written in `dir`.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: double\n  cluster:\n    server: {}\ncontexts:\n- name: double\n  context:\n    cluster: double\n    user: agent\ncurrent-context: double\nusers:\n- name: agent\n  user:\n    token: test-double-token\n",
            self.url
        );
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for KubeApiDouble {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `spec.nodeName=N` (or `==`) from a field selector.
fn node_selector(q: &HashMap<String, String>) -> Option<String> {
    let s = q.get("fieldSelector")?;
    s.split(',').find_map(|term| {
        let v = term
            .strip_prefix("spec.nodeName==")
            .or_else(|| term.strip_prefix("spec.nodeName="))?;
        Some(v.to_owned())
    })
}

fn selected(pod: &Value, node: &Option<String>) -> bool {
    match node {
        Some(n) => pod["spec"]["nodeName"] == Value::String(n.clone()),
        None => true,
    }
}

async fn pods(
    State(state): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if state.stopped.load(std::sync::atomic::Ordering::SeqCst) {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            [("connection", "close"), ("content-type", "application/json")],
            r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"shutting down","reason":"ServiceUnavailable","code":503}"#,
        )
            .into_response();
    }
    let node = node_selector(&q);
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if !watching {
        let inner = state.inner.lock().unwrap();
        let items: Vec<Value> = inner
            .pods
            .values()
            .filter(|p| selected(p, &node))
            .cloned()
            .collect();
        let body = json!({
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": inner.version.to_string()},
            "items": items,
        });
        return ([("content-type", "application/json")], body.to_string()).into_response();
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(300u64);
    let current = state.inner.lock().unwrap().version;
    if from > current {
        let gone = json!({"type": "ERROR", "object": {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("too old resource version: {from} ({current})"),
            "reason": "Expired", "code": 410,
        }});
        return ([("content-type", "application/json")], format!("{gone}\n")).into_response();
    }
    // Subscribed before the backlog is read: nothing falls between.
    let mut live = state.changes.subscribe();
    let backlog: Vec<Change> = {
        let inner = state.inner.lock().unwrap();
        inner
            .log
            .iter()
            .filter(|c| c.version > from)
            .cloned()
            .collect()
    };
    let mut generation = state.generation.subscribe();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let line = |c: &Change| {
            let mut s = json!({"type": c.kind, "object": c.pod}).to_string();
            s.push('\n');
            bytes::Bytes::from(s)
        };
        let mut last = from;
        for c in &backlog {
            if selected(&c.pod, &node) && tx.send(Ok(line(c))).await.is_err() {
                return;
            }
            last = last.max(c.version);
        }
        let end = tokio::time::sleep(Duration::from_secs(timeout));
        tokio::pin!(end);
        loop {
            tokio::select! {
                change = live.recv() => match change {
                    Ok(c) if c.version > last => {
                        last = c.version;
                        if selected(&c.pod, &node) && tx.send(Ok(line(&c))).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => return,
                },
                _ = generation.changed() => return,
                _ = &mut end => return,
            }
        }
    });
    let stream = tokio_stream_from(rx);
    (
        [("content-type", "application/json")],
        Body::from_stream(stream),
    )
        .into_response()
}

fn tokio_stream_from(
    mut rx: tokio::sync::mpsc::Receiver<Result<bytes::Bytes, std::io::Error>>,
) -> impl futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}
