//! `ScriptedBackend`: a TEST DOUBLE of an inference engine, used only where determinism is
//! needed (tool-call turns a tiny random model would never produce, and failures on demand).
//!
//! It speaks vLLM's OpenAI protocol exactly as `proxy/src/backend/vllm.rs` reads it:
//! `prompt_token_ids` on the answer (the first chunk when streaming), `token_ids` per choice,
//! `logprobs.content[].logprob`, `usage`. Token ids are real when it is given a real
//! llama-server tokenizer: prompt ids are the server's `/apply-template` of the received
//! messages and tools, `/tokenize`d; sampled ids are the `/tokenize`d reply text (a tool call
//! in its text form `<tool_call>\n{json}\n</tool_call>`) plus the end-of-turn id 2. Logprobs
//! are a fixed fake value ([`FAKE_LOGPROB`]).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::llama::{LlamaTokenizer, END_OF_TURN};
use crate::procs::serve_on_loopback;

/// The logprob reported for every scripted token.
pub const FAKE_LOGPROB: f32 = -0.1;
/// The one model the scripted backend serves.
pub const SCRIPTED_MODEL: &str = "scripted-model";

/// What the scripted backend does with one chat call.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A text answer (finish_reason `stop`).
    Text(String),
    /// One tool call (finish_reason `tool_calls`); `arguments` is sent as its JSON text.
    ToolCall { name: String, arguments: Value },
    /// An error status with this JSON body.
    Error { status: u16, body: Value },
    /// Never answer (not even headers).
    Hang,
    /// Stream the role chunk and the first `chunks` token chunks of `text`, then drop the
    /// connection mid-stream.
    DropAfter { text: String, chunks: usize },
    /// Stream the role chunk and the first `chunks` token chunks of `text`, then send
    /// nothing more while keeping the connection open.
    StallAfter { text: String, chunks: usize },
    /// Stream one token chunk every 20 ms until the client goes away.
    Endless,
    /// Stream the role chunk and the first `chunks` token chunks of `text`, then one event
    /// that never ends (a `data:` line of 64 KiB pieces, as fast as the client reads) until
    /// the client goes away; a whole answer is such a JSON text. A runaway engine.
    Flood { text: String, chunks: usize },
    /// A whole assistant turn: reasoning, text and tool calls (see [`Turn`]).
    Turn(Turn),
}

/// An assistant turn as a reasoning model with a tool-call parser answers it (vLLM with
/// `--reasoning-parser` and `--tool-call-parser`): reasoning in `reasoning_content`, then text,
/// then each call streamed as OpenAI streams calls (its id, type and name in its first chunk,
/// its arguments in three fragments after that). Sampled ids cover the reasoning, the text and
/// each call's text form, then the end of turn.
#[derive(Debug, Clone, Default)]
pub struct Turn {
    pub reasoning: String,
    pub text: String,
    /// (name, arguments) of each call.
    pub calls: Vec<(String, Value)>,
    /// The finish reason; `tool_calls` with calls, else `stop`, when unset.
    pub finish: Option<String>,
}

impl Reply {
    pub fn text(t: &str) -> Reply {
        Reply::Text(t.to_owned())
    }

    pub fn tool_call(name: &str, arguments: Value) -> Reply {
        Reply::ToolCall {
            name: name.to_owned(),
            arguments,
        }
    }

    /// vLLM's documented 400 for a prompt over the context window.
    pub fn vllm_context_overflow() -> Reply {
        Reply::Error {
            status: 400,
            body: json!({
                "object": "error",
                "message": "This model's maximum context length is 2048 tokens. However, you requested 4096 tokens (4000 in the messages, 96 in the completion). Please reduce the length of the messages or completion.",
                "type": "BadRequestError",
                "param": null,
                "code": 400
            }),
        }
    }
}

/// Picks the reply for a call from its request body and its index (from 0).
pub type Script = Arc<dyn Fn(&Value, usize) -> Reply + Send + Sync>;

/// The replies in order; the last one repeats.
pub fn sequence(replies: Vec<Reply>) -> Script {
    assert!(!replies.is_empty());
    Arc::new(move |_req, i| replies[i.min(replies.len() - 1)].clone())
}

/// The same reply for every call.
pub fn always(reply: Reply) -> Script {
    sequence(vec![reply])
}

/// An agent turn pair: while the conversation has no tool result yet and the harness offers a
/// tool named `tool`, call it with `arguments`; once a tool result is in the conversation,
/// answer `final_text`. Calls without that tool (a harness's side requests) get `side_text`.
pub fn tool_round_trip(tool: &str, arguments: Value, final_text: &str, side_text: &str) -> Script {
    let (tool, final_text, side_text) =
        (tool.to_owned(), final_text.to_owned(), side_text.to_owned());
    Arc::new(move |req, _i| {
        let offers_tool = req["tools"].as_array().is_some_and(|ts| {
            ts.iter()
                .any(|t| t["function"]["name"].as_str() == Some(tool.as_str()))
        });
        let has_result = req["messages"]
            .as_array()
            .is_some_and(|ms| ms.iter().any(|m| m["role"] == "tool"));
        match (offers_tool, has_result) {
            (true, false) => Reply::tool_call(&tool, arguments.clone()),
            (true, true) => Reply::text(&final_text),
            (false, _) => Reply::text(&side_text),
        }
    })
}

/// An engine that answers "answer to N messages", N the messages it was sent: what
/// [`curl_agent`] expects back, so its turns extend each other.
pub fn counting_replies() -> Script {
    Arc::new(|req, _| {
        let n = req["messages"].as_array().map_or(0, Vec::len);
        Reply::Text(format!("answer to {n} messages"))
    })
}

/// A shell agent for the rollout node's `command` preset: `turns` chat calls with curl to
/// `$OPENAI_BASE_URL`, each carrying [`counting_replies`]' previous answers as an agent's
/// history would, then `then`.
pub fn curl_agent(turns: usize, then: &str) -> String {
    let mut script = String::new();
    let mut messages = vec![serde_json::json!({"role": "user", "content": "task"})];
    for turn in 0..turns {
        let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
        script.push_str(&format!(
            "curl -sS --max-time 20 \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -H \"authorization: Bearer $OPENAI_API_KEY\" -d '{body}' > /dev/null && "
        ));
        let answer = format!("answer to {} messages", messages.len());
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        messages.push(serde_json::json!({"role": "user", "content": format!("go on {turn}")}));
    }
    script.push_str(then);
    script
}

/// Where the scripted backend gets token ids.
#[derive(Debug, Clone)]
pub enum Tokens {
    /// A real llama-server's template and tokenizer (the tiny model's SmolLM2 tokenizer).
    Llama(LlamaTokenizer),
    /// Deterministic stand-in ids (one per character, code point + 3), for tests where the
    /// ids' meaning does not matter.
    Fake,
    /// The same stand-in ids under a toy chat template that renders history the way the
    /// model sampled it (each message `[1] role \n content [2]`, assistant tool calls in their
    /// sampled text form, then `[1] assistant \n`), so a conversation's prompts extend each
    /// other with the sampled ids, as with a real model whose template round-trips.
    FakeChat,
}

/// Start-of-message id of [`Tokens::FakeChat`]; its end-of-message id is [`END_OF_TURN`].
pub const FAKE_CHAT_START: u32 = 1;

/// The text of a message's content: a string, or its text parts joined.
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn fake_chat_prompt(req: &Value) -> Vec<u32> {
    let mut ids = Vec::new();
    for m in req["messages"].as_array().into_iter().flatten() {
        ids.push(FAKE_CHAT_START);
        ids.extend(fake_ids(m["role"].as_str().unwrap_or("")));
        ids.extend(fake_ids("\n"));
        let mut text = content_text(&m["content"]);
        for call in m["tool_calls"].as_array().into_iter().flatten() {
            let f = &call["function"];
            let args = f["arguments"]
                .as_str()
                .and_then(|a| serde_json::from_str(a).ok())
                .unwrap_or(Value::Null);
            text.push_str(&tool_call_text(f["name"].as_str().unwrap_or(""), &args));
        }
        ids.extend(fake_ids(&text));
        ids.push(END_OF_TURN);
    }
    ids.push(FAKE_CHAT_START);
    ids.extend(fake_ids("assistant\n"));
    ids
}

/// A tokenized reply: ids with their text pieces.
type Pieces = Vec<(u32, String)>;

impl Tokens {
    async fn prompt_ids(&self, req: &Value) -> Vec<u32> {
        match self {
            Tokens::Llama(t) => {
                let mut body = serde_json::Map::new();
                for k in [
                    "messages",
                    "tools",
                    "tool_choice",
                    "parallel_tool_calls",
                    "chat_template_kwargs",
                ] {
                    if let Some(v) = req.get(k) {
                        body.insert(k.into(), v.clone());
                    }
                }
                t.tokenize(&t.apply_template(&Value::Object(body)).await)
                    .await
            }
            Tokens::Fake => fake_ids(&req["messages"].to_string()),
            Tokens::FakeChat => fake_chat_prompt(req),
        }
    }

    async fn pieces(&self, text: &str) -> Pieces {
        match self {
            Tokens::Llama(t) => {
                let pieces = t.tokenize_with_pieces(text, false).await;
                let joined: Option<String> = pieces.iter().map(|(_, p)| p.clone()).collect();
                match joined {
                    // Stream one token per chunk when the pieces spell the text exactly.
                    Some(j) if j == text => pieces
                        .into_iter()
                        .map(|(id, p)| (id, p.unwrap_or_default()))
                        .collect(),
                    // Otherwise the whole text rides on the first id.
                    _ => pieces
                        .iter()
                        .enumerate()
                        .map(|(i, (id, _))| {
                            (
                                *id,
                                if i == 0 {
                                    text.to_owned()
                                } else {
                                    String::new()
                                },
                            )
                        })
                        .collect(),
                }
            }
            Tokens::Fake | Tokens::FakeChat => text
                .chars()
                .map(|c| (c as u32 + 3, c.to_string()))
                .collect(),
        }
    }
}

fn fake_ids(text: &str) -> Vec<u32> {
    text.chars().map(|c| c as u32 + 3).collect()
}

/// The text form of a tool call, as a Hermes-style model (Qwen2.5) samples it: JSON with
/// Python's `json.dumps` separators (`", "`, `": "`), which is also how its chat template
/// (`tojson`) renders the call back into the history.
pub fn tool_call_text(name: &str, arguments: &Value) -> String {
    format!(
        "<tool_call>\n{}\n</tool_call>",
        python_json(&json!({"name": name, "arguments": arguments}))
    )
}

/// `json.dumps(v)` with default separators (ASCII-only input assumed, as in the tests).
fn python_json(v: &Value) -> String {
    match v {
        Value::Array(items) => format!(
            "[{}]",
            items.iter().map(python_json).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(map) => format!(
            "{{{}}}",
            map.iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), python_json(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

struct Shared {
    script: Script,
    tokens: Tokens,
    requests: Mutex<Vec<Value>>,
    /// Requests to `/v1/models` and `/tokenize` (the engine calls that are not generations).
    lookups: Mutex<Vec<String>>,
    /// Streams that ended because the client went away.
    disconnects: AtomicUsize,
    disconnected: Notify,
}

/// The scripted engine, serving on 127.0.0.1 until dropped.
pub struct ScriptedBackend {
    pub url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedBackend {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl ScriptedBackend {
    pub async fn start(tokens: Tokens, script: Script) -> ScriptedBackend {
        let shared = Arc::new(Shared {
            script,
            tokens,
            requests: Mutex::new(Vec::new()),
            lookups: Mutex::new(Vec::new()),
            disconnects: AtomicUsize::new(0),
            disconnected: Notify::new(),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/v1/models", get(models))
            .route("/tokenize", post(tokenize))
            .fallback(|| async { (StatusCode::NOT_FOUND, "scripted backend: no such route") })
            .with_state(shared.clone());
        let (addr, server) = serve_on_loopback(app, "the scripted backend").await;
        let url = format!("http://{addr}");
        ScriptedBackend {
            url,
            shared,
            server,
        }
    }

    /// Every chat request body received, in arrival order.
    pub fn requests(&self) -> Vec<Value> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// The paths of every `/v1/models` and `/tokenize` request received, in arrival order.
    pub fn lookups(&self) -> Vec<String> {
        self.shared.lookups.lock().unwrap().clone()
    }

    /// How many streams ended because the client (tokentap) closed the connection.
    pub fn disconnects(&self) -> usize {
        self.shared.disconnects.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until at least one stream saw its client go away; false if none did.
    pub async fn wait_disconnect(&self, limit: Duration) -> bool {
        let wait = async {
            loop {
                let notified = self.shared.disconnected.notified();
                if self.disconnects() > 0 {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }
}

/// vLLM's `POST /tokenize` with chat messages: the prompt ids the chat call would use.
async fn tokenize(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    shared.lookups.lock().unwrap().push("/tokenize".into());
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return (
            StatusCode::BAD_REQUEST,
            "scripted backend: body is not JSON",
        )
            .into_response();
    };
    let ids = shared.tokens.prompt_ids(&req).await;
    axum::Json(json!({"count": ids.len(), "max_model_len": 8192, "tokens": ids})).into_response()
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    shared.lookups.lock().unwrap().push("/v1/models".into());
    axum::Json(json!({"object": "list", "data": [{"id": SCRIPTED_MODEL, "object": "model", "owned_by": "tokentap-e2e"}]}))
        .into_response()
}

fn frame(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn logprob_entries(pieces: &[(u32, String)]) -> Value {
    Value::Array(
        pieces
            .iter()
            .map(|(_, p)| json!({"token": p, "logprob": FAKE_LOGPROB, "bytes": p.as_bytes(), "top_logprobs": []}))
            .collect(),
    )
}

/// Lives inside an endless stream: the stream is dropped only when the client goes away,
/// and the drop is counted as a disconnect.
struct DisconnectGuard {
    shared: Arc<Shared>,
}

impl Drop for DisconnectGuard {
    fn drop(&mut self) {
        self.shared.disconnects.fetch_add(1, Ordering::SeqCst);
        self.shared.disconnected.notify_waiters();
    }
}

async fn chat(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return (
            StatusCode::BAD_REQUEST,
            "scripted backend: body is not JSON",
        )
            .into_response();
    };
    let index = {
        let mut all = shared.requests.lock().unwrap();
        all.push(req.clone());
        all.len() - 1
    };
    let reply = (shared.script)(&req, index);
    let stream = req["stream"].as_bool().unwrap_or(false);
    let model = req["model"].as_str().unwrap_or(SCRIPTED_MODEL).to_owned();
    let id = format!("chatcmpl-scripted-{index}");
    let include_usage = req["stream_options"]["include_usage"]
        .as_bool()
        .unwrap_or(false);

    let (text, tool) = match &reply {
        Reply::Turn(turn) => {
            let prompt_ids = shared.tokens.prompt_ids(&req).await;
            return turn_answer(
                &shared.tokens,
                turn,
                prompt_ids,
                stream,
                include_usage,
                &model,
                &id,
                index,
            )
            .await;
        }
        Reply::Error { status, body } => {
            return (
                StatusCode::from_u16(*status).expect("status"),
                axum::Json(body.clone()),
            )
                .into_response()
        }
        Reply::Hang => {
            std::future::pending::<()>().await;
            unreachable!()
        }
        Reply::Text(t)
        | Reply::DropAfter { text: t, .. }
        | Reply::StallAfter { text: t, .. }
        | Reply::Flood { text: t, .. } => (t.clone(), None),
        Reply::Endless => ("la ".to_owned(), None),
        Reply::ToolCall { name, arguments } => (
            tool_call_text(name, arguments),
            Some((
                format!("call_scripted_{index}"),
                name.clone(),
                arguments.to_string(),
            )),
        ),
    };
    let prompt_ids = shared.tokens.prompt_ids(&req).await;
    let pieces = shared.tokens.pieces(&text).await;
    let finish = if tool.is_some() { "tool_calls" } else { "stop" };
    let eot = (END_OF_TURN, String::new());
    let n_completion = pieces.len() as u64 + 1;
    let usage = json!({"prompt_tokens": prompt_ids.len(), "completion_tokens": n_completion, "total_tokens": prompt_ids.len() as u64 + n_completion});

    if !stream {
        let mut all = pieces.clone();
        all.push(eot);
        let message = match &tool {
            Some((cid, name, args)) => json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]}),
            None => json!({"role": "assistant", "content": text}),
        };
        if let Reply::Flood { .. } = reply {
            let body = flood(b"{\"id\":\"", shared.clone());
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(body))
                .expect("response");
        }
        if matches!(
            reply,
            Reply::DropAfter { .. } | Reply::StallAfter { .. } | Reply::Endless
        ) {
            // Headers, then the connection drops before the body is complete.
            let s = futures::stream::iter(vec![
                Ok(Bytes::from_static(b"{\"id\":")),
                Err(std::io::Error::other("scripted drop")),
            ]);
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(s))
                .expect("response");
        }
        return whole_answer(&id, &model, message, finish, &all, &usage, &prompt_ids);
    }

    let chunker = Chunker {
        id: id.clone(),
        model: model.clone(),
    };
    let chunk = |delta: Value, finish: Option<&str>, toks: &[(u32, String)]| {
        chunker.chunk(delta, finish, toks)
    };
    let mut first = chunk(json!({"role": "assistant", "content": ""}), None, &[]);
    first["prompt_token_ids"] = json!(prompt_ids);
    let mut frames: Vec<Bytes> = vec![frame(&first)];
    match &tool {
        Some((cid, name, args)) => {
            let half = pieces.len() / 2;
            frames.push(frame(&chunk(
                json!({"tool_calls": [{"index": 0, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                None,
                &pieces[..half],
            )));
            frames.push(frame(&chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": args}}]}),
                None,
                &pieces[half..],
            )));
        }
        None => {
            for p in &pieces {
                frames.push(frame(&chunk(
                    json!({"content": p.1}),
                    None,
                    std::slice::from_ref(p),
                )));
            }
        }
    }
    match reply {
        Reply::DropAfter { chunks, .. } => {
            frames.truncate(1 + chunks);
            let items: Vec<Result<Bytes, std::io::Error>> = frames.into_iter().map(Ok).collect();
            // Pause first so hyper flushes the head and the chunks; then break the connection.
            let drop = futures::stream::once(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err::<Bytes, _>(std::io::Error::other("scripted drop"))
            });
            sse_response(Body::from_stream(futures::stream::iter(items).chain(drop)))
        }
        Reply::StallAfter { chunks, .. } => {
            frames.truncate(1 + chunks);
            let items: Vec<Result<Bytes, std::io::Error>> = frames.into_iter().map(Ok).collect();
            let stall = futures::stream::once(async {
                std::future::pending::<()>().await;
                Ok::<Bytes, std::io::Error>(Bytes::new())
            });
            sse_response(Body::from_stream(futures::stream::iter(items).chain(stall)))
        }
        Reply::Endless => {
            let piece = pieces.first().cloned().unwrap_or((300, "la ".into()));
            let head = futures::stream::iter(vec![Ok::<_, std::io::Error>(frames.remove(0))]);
            let chunker = chunker.clone();
            let guard = DisconnectGuard {
                shared: shared.clone(),
            };
            let tail = futures::stream::unfold(guard, move |g| {
                let c = chunker.chunk(
                    json!({"content": piece.1}),
                    None,
                    std::slice::from_ref(&piece),
                );
                async move {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Some((Ok(frame(&c)), g))
                }
            });
            sse_response(Body::from_stream(head.chain(tail)))
        }
        Reply::Flood { chunks, .. } => {
            frames.truncate(1 + chunks);
            let head = futures::stream::iter(frames.into_iter().map(Ok::<_, std::io::Error>));
            let line = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"";
            let body = flood(line, shared.clone());
            sse_response(Body::from_stream(head.chain(body)))
        }
        _ => {
            frames.push(frame(&chunk(json!({}), Some(finish), &[eot])));
            if include_usage {
                frames.push(frame(&json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage})));
            }
            frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
            let items: Vec<Result<Bytes, std::io::Error>> = frames.into_iter().map(Ok).collect();
            sse_response(Body::from_stream(futures::stream::iter(items)))
        }
    }
}

/// `start`, then 64 KiB pieces of `a` without end, as fast as the client reads them; the
/// client going away is counted as a disconnect.
fn flood(
    start: &'static [u8],
    shared: Arc<Shared>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let piece = Bytes::from(vec![b'a'; 64 << 10]);
    let start = futures::stream::iter([Ok::<_, std::io::Error>(Bytes::from_static(start))]);
    let guard = DisconnectGuard { shared };
    let tail = futures::stream::unfold(guard, move |g| {
        let piece = piece.clone();
        async move { Some((Ok(piece), g)) }
    });
    start.chain(tail)
}

/// Builds `chat.completion.chunk` objects of one answer.
#[derive(Clone)]
struct Chunker {
    id: String,
    model: String,
}

impl Chunker {
    fn chunk(&self, delta: Value, finish: Option<&str>, toks: &[(u32, String)]) -> Value {
        let mut choice =
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish});
        if !toks.is_empty() {
            choice["token_ids"] = json!(toks.iter().map(|(i, _)| *i).collect::<Vec<_>>());
            choice["logprobs"] = json!({"content": logprob_entries(toks)});
        }
        json!({"id": self.id, "object": "chat.completion.chunk", "created": 1, "model": self.model, "choices": [choice]})
    }
}

fn sse_response(body: Body) -> Response {
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(body)
        .expect("response")
}

/// `text` cut into `n` pieces of about equal length (at character boundaries; some may be empty).
fn split_text(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let per = chars.len().div_ceil(n.max(1)).max(1);
    let mut parts: Vec<String> = chars.chunks(per).map(|c| c.iter().collect()).collect();
    parts.resize(n, String::new());
    parts
}

/// `items` cut into `n` runs of about equal length (some may be empty).
fn split_runs<T: Clone>(items: &[T], n: usize) -> Vec<Vec<T>> {
    let per = items.len().div_ceil(n.max(1)).max(1);
    let mut runs: Vec<Vec<T>> = items.chunks(per).map(<[T]>::to_vec).collect();
    runs.resize(n, Vec::new());
    runs
}

/// A whole (not streamed) Chat Completions answer as vLLM writes it: the sampled pieces' ids
/// and logprobs, and the prompt's ids.
fn whole_answer(
    id: &str,
    model: &str,
    message: Value,
    finish: &str,
    all: &[(u32, String)],
    usage: &Value,
    prompt_ids: &[u32],
) -> Response {
    let body = json!({
        "id": id, "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish,
            "logprobs": {"content": logprob_entries(all)},
            "token_ids": all.iter().map(|(i, _)| *i).collect::<Vec<_>>()}],
        "usage": usage,
        "prompt_token_ids": prompt_ids,
    });
    axum::Json(body).into_response()
}

/// The answer to a [`Reply::Turn`], whole or streamed.
#[allow(clippy::too_many_arguments)]
async fn turn_answer(
    tokens: &Tokens,
    turn: &Turn,
    prompt_ids: Vec<u32>,
    stream: bool,
    include_usage: bool,
    model: &str,
    id: &str,
    index: usize,
) -> Response {
    let reasoning = tokens.pieces(&turn.reasoning).await;
    let text = tokens.pieces(&turn.text).await;
    let mut calls = Vec::new();
    for (i, (name, arguments)) in turn.calls.iter().enumerate() {
        let pieces = tokens.pieces(&tool_call_text(name, arguments)).await;
        calls.push((
            format!("call_scripted_{index}_{i}"),
            name.clone(),
            arguments.to_string(),
            pieces,
        ));
    }
    let finish = turn.finish.clone().unwrap_or_else(|| {
        if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        }
        .to_owned()
    });
    let eot = (END_OF_TURN, String::new());
    let mut all: Pieces = reasoning.iter().chain(&text).cloned().collect();
    for (_, _, _, p) in &calls {
        all.extend(p.iter().cloned());
    }
    all.push(eot.clone());
    let n = all.len() as u64;
    let usage = json!({"prompt_tokens": prompt_ids.len(), "completion_tokens": n, "total_tokens": prompt_ids.len() as u64 + n});

    if !stream {
        let mut message = json!({"role": "assistant", "content": turn.text});
        if !turn.reasoning.is_empty() {
            message["reasoning_content"] = json!(turn.reasoning);
        }
        if !calls.is_empty() {
            if turn.text.is_empty() {
                message["content"] = Value::Null;
            }
            message["tool_calls"] = json!(calls
                .iter()
                .map(|(cid, name, args, _)| json!({"id": cid, "type": "function", "function": {"name": name, "arguments": args}}))
                .collect::<Vec<_>>());
        }
        return whole_answer(id, model, message, &finish, &all, &usage, &prompt_ids);
    }

    let chunker = Chunker {
        id: id.to_owned(),
        model: model.to_owned(),
    };
    let mut first = chunker.chunk(json!({"role": "assistant", "content": ""}), None, &[]);
    first["prompt_token_ids"] = json!(prompt_ids);
    let mut frames: Vec<Bytes> = vec![frame(&first)];
    for p in &reasoning {
        frames.push(frame(&chunker.chunk(
            json!({"reasoning_content": p.1}),
            None,
            std::slice::from_ref(p),
        )));
    }
    for p in &text {
        frames.push(frame(&chunker.chunk(
            json!({"content": p.1}),
            None,
            std::slice::from_ref(p),
        )));
    }
    for (i, (cid, name, args, pieces)) in calls.iter().enumerate() {
        let runs = split_runs(pieces, 4);
        frames.push(frame(&chunker.chunk(
            json!({"tool_calls": [{"index": i, "id": cid, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            None,
            &runs[0],
        )));
        for (fragment, run) in split_text(args, 3).iter().zip(&runs[1..]) {
            frames.push(frame(&chunker.chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": fragment}}]}),
                None,
                run,
            )));
        }
    }
    frames.push(frame(&chunker.chunk(json!({}), Some(&finish), &[eot])));
    if include_usage {
        frames.push(frame(&json!({"id": id, "object": "chat.completion.chunk", "created": 1, "model": model, "choices": [], "usage": usage})));
    }
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    let items: Vec<Result<Bytes, std::io::Error>> = frames.into_iter().map(Ok).collect();
    sse_response(Body::from_stream(futures::stream::iter(items)))
}
