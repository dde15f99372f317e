//! `TeeProxy`: a real pass-through between tokentap and llama-server that forwards every
//! request and response byte for byte (streaming as it arrives) and keeps a copy of each, so a
//! test can compare a capture record with what the engine itself said.

use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Router;
use futures::StreamExt;
use serde_json::Value;

use crate::procs::serve_on_loopback;
use crate::sse;

/// One request/response pair that crossed the tee.
#[derive(Debug, Clone, Default)]
pub struct Exchange {
    pub method: String,
    pub path: String,
    pub request_body: Bytes,
    pub status: u16,
    pub response_body: Vec<u8>,
    /// The upstream answer was read to its end.
    pub complete: bool,
}

impl Exchange {
    pub fn request_json(&self) -> Value {
        serde_json::from_slice(&self.request_body).unwrap_or(Value::Null)
    }

    /// Sampled token ids llama-server reported (`choices[0].logprobs.content[].id`, across all
    /// SSE chunks or in the whole answer).
    pub fn reported_ids(&self) -> Vec<u32> {
        self.reported_tokens()
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    }

    /// Sampled ids with their logprobs as llama-server reported them.
    pub fn reported_tokens(&self) -> Vec<(u32, f64)> {
        sse::response_objects(&self.response_body)
            .iter()
            .flat_map(|v| {
                v["choices"][0]["logprobs"]["content"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|e| {
                (
                    e["id"].as_u64().expect("logprob entry with an id") as u32,
                    e["logprob"].as_f64().expect("logprob entry with a logprob"),
                )
            })
            .collect()
    }

    /// `usage` as llama-server reported it (the last object carrying one).
    pub fn reported_usage(&self) -> Option<Value> {
        sse::response_objects(&self.response_body)
            .into_iter()
            .filter_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
            .next_back()
    }
}

struct Shared {
    upstream: String,
    client: reqwest::Client,
    exchanges: Mutex<Vec<Exchange>>,
}

/// The tee, serving on 127.0.0.1 until dropped.
pub struct TeeProxy {
    pub url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for TeeProxy {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl TeeProxy {
    pub async fn start(upstream: &str) -> TeeProxy {
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            client: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("client"),
            exchanges: Mutex::new(Vec::new()),
        });
        let app = Router::new().fallback(forward).with_state(shared.clone());
        let (addr, server) = serve_on_loopback(app, "the tee").await;
        let url = format!("http://{addr}");
        TeeProxy {
            url,
            shared,
            server,
        }
    }

    pub fn exchanges(&self) -> Vec<Exchange> {
        self.shared.exchanges.lock().unwrap().clone()
    }

    /// The `POST /v1/chat/completions` exchanges, in arrival order.
    pub fn chat_exchanges(&self) -> Vec<Exchange> {
        self.exchanges()
            .into_iter()
            .filter(|e| e.method == "POST" && e.path == "/v1/chat/completions")
            .collect()
    }
}

const HOP_BY_HOP: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
];

async fn forward(State(shared): State<Arc<Shared>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let Ok(body) = axum::body::to_bytes(body, usize::MAX).await else {
        return (StatusCode::BAD_REQUEST, "tee: unreadable request body").into_response();
    };
    let path = parts.uri.path().to_owned();
    let path_and_query = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| path.clone());
    let index = {
        let mut all = shared.exchanges.lock().unwrap();
        all.push(Exchange {
            method: parts.method.to_string(),
            path,
            request_body: body.clone(),
            ..Default::default()
        });
        all.len() - 1
    };
    let method = reqwest::Method::from_bytes(parts.method.as_str().as_bytes()).expect("method");
    let mut up = shared
        .client
        .request(method, format!("{}{path_and_query}", shared.upstream))
        .body(body);
    for (k, v) in parts.headers.iter() {
        if !HOP_BY_HOP.contains(&k.as_str()) {
            up = up.header(k.as_str(), v.as_bytes());
        }
    }
    let resp = match up.send().await {
        Ok(r) => r,
        Err(e) => {
            return (
                StatusCode::BAD_GATEWAY,
                format!("tee: upstream failed: {e}"),
            )
                .into_response()
        }
    };
    let status = resp.status().as_u16();
    shared.exchanges.lock().unwrap()[index].status = status;
    let mut builder = Response::builder().status(status);
    for (k, v) in resp.headers().iter() {
        if !HOP_BY_HOP.contains(&k.as_str()) {
            builder = builder.header(k.as_str(), v.as_bytes());
        }
    }
    let tee = shared.clone();
    let mut upstream = resp.bytes_stream();
    let body = async_stream_like(move |tx| async move {
        while let Some(chunk) = upstream.next().await {
            match chunk {
                Ok(b) => {
                    tee.exchanges.lock().unwrap()[index]
                        .response_body
                        .extend_from_slice(&b);
                    if tx.send(Ok(b)).await.is_err() {
                        return; // the client (tokentap) went away; drop the upstream too
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(std::io::Error::other(e))).await;
                    return;
                }
            }
        }
        tee.exchanges.lock().unwrap()[index].complete = true;
    });
    builder.body(body).expect("response")
}

/// A body fed by a task through a channel (the task stops when the body is dropped).
fn async_stream_like<F, Fut>(f: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Bytes, std::io::Error>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(f(tx));
    Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    }))
}
