//! `InstantBackend`: a synthetic stand-in for vLLM that answers at once, so that what a
//! benchmark measures is the proxy, not the engine.
//!
//! It speaks vLLM's OpenAI-compatible shape with token data (`prompt_token_ids`, per-choice
//! `token_ids`, `logprobs.content`), streamed or whole. It does not tokenize: the prompt ids
//! and the short answer are fixed and rendered once, so each call costs only reading the
//! request body and writing pre-built bytes.
//!
//! With [`InstantBackend::start_growing`] the prompt ids grow with the conversation instead: a
//! request of n messages gets the ids of n blocks (a user message's block, then the answer's
//! ids for an assistant message), so each turn's prompt extends the last turn's prompt and
//! answer, as an engine's would, and a session's calls merge into one trace. Answers are built
//! once per message count.
//!
//! It runs on its own thread with a single-threaded tokio runtime: one core's worth at most,
//! leaving the rest of the 2-core machine to the proxy and the load generator.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::oneshot;

/// The model name the backend serves and reports.
pub const MODEL: &str = "bench";

/// The fixed answer, one string per sampled token.
pub const ANSWER: [&str; 8] = ["Sure", ",", " I", " will", " write", " the", " file", "."];

type Chunks = futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>;
type Body = Either<Full<Bytes>, StreamBody<Chunks>>;

/// Calls served, by kind (to check that traffic went where it was meant to).
#[derive(Default)]
pub struct Served {
    pub whole: AtomicU64,
    pub streamed: AtomicU64,
    pub asked_token_ids: AtomicU64,
}

pub struct InstantBackend {
    addr: SocketAddr,
    served: Arc<Served>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl InstantBackend {
    /// Starts serving on 127.0.0.1 (any free port), answering with `prompt_ids` prompt ids.
    pub fn start(prompt_ids: usize) -> anyhow::Result<InstantBackend> {
        InstantBackend::serve(Prompts::Fixed(Arc::new(Answers::new(prompt_ids))))
    }

    /// Starts serving with prompts that grow with the conversation, `user_ids` ids per user
    /// message (see the module's documentation).
    pub fn start_growing(user_ids: usize) -> anyhow::Result<InstantBackend> {
        InstantBackend::serve(Prompts::Growing {
            user_ids,
            by_messages: Mutex::new(HashMap::new()),
        })
    }

    fn serve(prompts: Prompts) -> anyhow::Result<InstantBackend> {
        let answers = Arc::new(prompts);
        let served = Arc::new(Served::default());
        let std_listener =
            std::net::TcpListener::bind("127.0.0.1:0").context("binding the instant backend")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop, stopped) = oneshot::channel();
        let served2 = served.clone();
        let thread = std::thread::Builder::new()
            .name("instant-backend".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("building the instant backend's runtime");
                rt.block_on(async move {
                    let listener = tokio::net::TcpListener::from_std(std_listener)
                        .expect("registering the backend listener");
                    tokio::select! {
                        _ = accept_loop(listener, answers, served2) => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(InstantBackend {
            addr,
            served,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn served(&self) -> &Served {
        &self.served
    }
}

impl Drop for InstantBackend {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    answers: Arc<Prompts>,
    served: Arc<Served>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        // Small answers written at once: without this, Nagle would hold the tail back.
        let _ = stream.set_nodelay(true);
        let answers = answers.clone();
        let served = served.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let answers = answers.clone();
                let served = served.clone();
                async move { Ok::<_, Infallible>(answer(req, &answers, &served).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn answer(req: Request<Incoming>, prompts: &Prompts, served: &Served) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/models") => json_response(StatusCode::OK, prompts.models()),
        (&Method::POST, "/v1/chat/completions") => {
            let Ok(body) = req.into_body().collect().await.map(|b| b.to_bytes()) else {
                return json_response(StatusCode::BAD_REQUEST, Bytes::from_static(b"{}"));
            };
            let answers = prompts.for_body(&body);
            // A byte search, not a JSON parse: the double must stay cheap next to the proxy.
            // Inside a JSON string the quotes are escaped, so these only match the real key.
            let stream = memchr::memmem::find(&body, b"\"stream\":true").is_some()
                || memchr::memmem::find(&body, b"\"stream\": true").is_some();
            if memchr::memmem::find(&body, b"\"return_token_ids\":true").is_some() {
                served.asked_token_ids.fetch_add(1, Ordering::Relaxed);
            }
            if stream {
                served.streamed.fetch_add(1, Ordering::Relaxed);
                let frames: Vec<_> = answers
                    .stream
                    .iter()
                    .map(|c| Ok(Frame::data(c.clone())))
                    .collect();
                let mut resp = Response::new(Either::Right(StreamBody::new(
                    futures::stream::iter(frames),
                )));
                resp.headers_mut().insert(
                    hyper::header::CONTENT_TYPE,
                    hyper::header::HeaderValue::from_static("text/event-stream"),
                );
                resp
            } else {
                served.whole.fetch_add(1, Ordering::Relaxed);
                json_response(StatusCode::OK, answers.whole.clone())
            }
        }
        _ => json_response(
            StatusCode::NOT_FOUND,
            Bytes::from_static(br#"{"error":{"message":"not found"}}"#),
        ),
    }
}

fn json_response(status: StatusCode, body: Bytes) -> Response<Body> {
    let mut resp = Response::new(Either::Left(Full::new(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// Which prompt ids a request gets.
enum Prompts {
    /// The same for every request.
    Fixed(Arc<Answers>),
    /// By the request's message count, built on first use.
    Growing {
        user_ids: usize,
        by_messages: Mutex<HashMap<usize, Arc<Answers>>>,
    },
}

impl Prompts {
    fn for_body(&self, body: &[u8]) -> Arc<Answers> {
        match self {
            Prompts::Fixed(a) => a.clone(),
            Prompts::Growing {
                user_ids,
                by_messages,
            } => {
                // One `"role"` key per message (a byte count, not a parse, as above).
                let n = memchr::memmem::find_iter(body, b"\"role\"").count();
                by_messages
                    .lock()
                    .expect("not poisoned")
                    .entry(n)
                    .or_insert_with(|| Arc::new(Answers::with_prompt(growing_prompt(n, *user_ids))))
                    .clone()
            }
        }
    }

    fn models(&self) -> Bytes {
        match self {
            Prompts::Fixed(a) => a.models.clone(),
            Prompts::Growing { .. } => Answers::with_prompt(Vec::new()).models,
        }
    }
}

/// The prompt of a conversation of `messages` messages, alternating user and assistant from a
/// user message: a user block of `user_ids` ids each (different per turn), the answer's ids
/// for each assistant message.
fn growing_prompt(messages: usize, user_ids: usize) -> Vec<u32> {
    let mut ids = Vec::new();
    for m in 0..messages {
        if m % 2 == 0 {
            ids.extend(
                (0..user_ids).map(|j| 1000 + (((m * user_ids + j) as u32) * 7919) % 150_000),
            );
        } else {
            ids.extend(answer_ids());
        }
    }
    ids
}

/// The ids of [`ANSWER`]'s tokens.
fn answer_ids() -> Vec<u32> {
    (0..ANSWER.len() as u32).map(|i| 40_000 + i).collect()
}

/// The whole (unstreamed) answer the backend gives for a prompt of `prompt_ids` ids: what
/// `bench translate` times the engine-answer decode on.
pub fn whole_answer(prompt_ids: usize) -> Bytes {
    Answers::new(prompt_ids).whole
}

/// Every answer, rendered once.
struct Answers {
    whole: Bytes,
    stream: Vec<Bytes>,
    models: Bytes,
}

impl Answers {
    fn new(prompt_ids: usize) -> Answers {
        // Plausible ids in a Qwen-sized vocabulary; nothing reads their meaning.
        Answers::with_prompt(
            (0..prompt_ids as u32)
                .map(|i| 1000 + (i * 7919) % 150_000)
                .collect(),
        )
    }

    fn with_prompt(prompt: Vec<u32>) -> Answers {
        let prompt_ids = prompt.len();
        let answer_ids = answer_ids();
        let logprob =
            |t: &str| json!({"token": t, "logprob": -0.1, "bytes": null, "top_logprobs": []});
        let usage = json!({
            "prompt_tokens": prompt_ids,
            "completion_tokens": ANSWER.len(),
            "total_tokens": prompt_ids + ANSWER.len(),
        });
        let (id, created) = ("chatcmpl-bench0000000000000000", 1_760_000_000u64);

        let whole = json!({
            "id": id, "object": "chat.completion", "created": created, "model": MODEL,
            "prompt_token_ids": prompt,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": ANSWER.concat(), "tool_calls": []},
                "token_ids": answer_ids,
                "logprobs": {"content": ANSWER.iter().map(|t| logprob(t)).collect::<Vec<_>>()},
                "finish_reason": "stop",
                "stop_reason": null,
            }],
            "usage": usage,
        });

        let chunk = |choices: Value| {
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": MODEL,
                   "choices": choices})
        };
        let mut events = Vec::new();
        let mut first = chunk(json!([{
            "index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null,
        }]));
        first["prompt_token_ids"] = json!(prompt);
        events.push(first);
        for (t, id) in ANSWER.iter().zip(&answer_ids) {
            events.push(chunk(json!([{
                "index": 0, "delta": {"content": t},
                "logprobs": {"content": [logprob(t)]},
                "finish_reason": null, "token_ids": [id],
            }])));
        }
        events.push(chunk(json!([{
            "index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop", "token_ids": [],
        }])));
        let mut usage_chunk = chunk(json!([]));
        usage_chunk["usage"] = usage;
        events.push(usage_chunk);
        let mut stream: Vec<Bytes> = events
            .iter()
            .map(|e| Bytes::from(format!("data: {e}\n\n")))
            .collect();
        stream.push(Bytes::from_static(b"data: [DONE]\n\n"));

        let models = json!({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": created, "owned_by": "tokentap-bench",
             "max_model_len": 131072}
        ]});
        Answers {
            whole: Bytes::from(whole.to_string()),
            stream,
            models: Bytes::from(models.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_carry_vllm_token_data() {
        let a = Answers::new(5);
        let whole: Value = serde_json::from_slice(&a.whole).unwrap();
        assert_eq!(whole["prompt_token_ids"].as_array().unwrap().len(), 5);
        let choice = &whole["choices"][0];
        assert_eq!(choice["token_ids"].as_array().unwrap().len(), ANSWER.len());
        assert_eq!(
            choice["logprobs"]["content"].as_array().unwrap().len(),
            ANSWER.len()
        );
        assert_eq!(choice["message"]["content"], json!(ANSWER.concat()));

        let body: String = a
            .stream
            .iter()
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        let events: Vec<Value> = tokentap_e2e::sse::data_frames(&body)
            .iter()
            .filter_map(|d| d.parse::<Value>().ok())
            .collect();
        assert_eq!(events[0]["prompt_token_ids"].as_array().unwrap().len(), 5);
        let ids: usize = events
            .iter()
            .filter_map(|e| e["choices"][0]["token_ids"].as_array())
            .map(Vec::len)
            .sum();
        assert_eq!(ids, ANSWER.len());
        assert!(events
            .iter()
            .any(|e| e["choices"][0]["finish_reason"] == json!("stop")));
        assert!(events.last().unwrap()["usage"].is_object());
        assert_eq!(a.stream.last().unwrap().as_ref(), b"data: [DONE]\n\n");
    }

    #[test]
    fn growing_prompts_extend_the_last_prompt_and_answer() {
        let three = growing_prompt(3, 4);
        let five = growing_prompt(5, 4);
        assert_eq!(three.len(), 4 + ANSWER.len() + 4);
        let mut expected = three.clone();
        expected.extend(answer_ids());
        assert_eq!(&five[..expected.len()], &expected[..]);
        assert_ne!(
            &five[expected.len()..],
            &three[..4],
            "each user block differs"
        );

        let p = Prompts::Growing {
            user_ids: 4,
            by_messages: Mutex::new(HashMap::new()),
        };
        let body = br#"{"messages":[{"role":"user","content":"a"},{"role":"assistant","content":"b"},{"role":"user","content":"c"}]}"#;
        let whole: Value = serde_json::from_slice(&p.for_body(body).whole).unwrap();
        assert_eq!(whole["prompt_token_ids"], json!(three));
    }
}
