//! Contract tests for the vLLM and SGLang adapters. Neither engine runs here (no GPU), so the
//! adapters are checked against the engines' documented answer shapes:
//! - vLLM: `vllm/entrypoints/openai/chat_completion/protocol.py` (`ChatCompletionResponse`,
//!   `ChatCompletionStreamResponse`, ...), `.../chat_completion/serving.py` (which chunk carries
//!   what; stream chunks are dumped with `exclude_unset`) and
//!   `tests/entrypoints/openai/basic/test_return_token_ids.py`.
//! - SGLang: `python/sglang/srt/entrypoints/openai/{protocol,serving_chat}.py` and its tests of
//!   `return_{input,output}_ids_in_sglext` (sglang#34488).
//!
//! The fixtures below are written the way those servers serialize; the local doubles
//! (`VllmContractDouble`, `SglangContractDouble`) answer with them, trimmed the way each server
//! trims its answer for the flags a request sets, and record every request body.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use futures::StreamExt;
use serde_json::{json, Map, Value};

use super::answer::{from_value, Answer, Choice};
use super::engine_request::TokenParam;
use super::openai_compat::TokenDialect;
use super::sglang::SglangDialect;
use super::vllm::VllmDialect;
use super::{build, BackendConfig, BackendError, BackendKind, CallMode};
use tokentap_wire::canonical::{
    ChatMessage, ChatRequest, GenerationAccumulator, GenerationEvent, Role, TokenField, TokenSource,
};

/// `<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n` in a Qwen tokenizer.
const PROMPT_IDS: [u32; 9] = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198];
/// "Hi", "!", then the end-of-turn token (no text).
const SAMPLED_IDS: [u32; 3] = [13048, 0, 151645];
const SAMPLED_LOGPROBS: [f32; 3] = [-0.25, -1.5, -0.0625];

fn sampled_logprobs() -> Vec<Option<f32>> {
    SAMPLED_LOGPROBS.iter().copied().map(Some).collect()
}

// ---------------------------------------------------------------------------------------------
// vLLM fixtures: `return_token_ids: true`, `logprobs: true`, `top_logprobs: 0`.

const VLLM_WHOLE: &str = r#"{
  "id": "chatcmpl-9f3c2d7e",
  "object": "chat.completion",
  "created": 1767225600,
  "model": "Qwen/Qwen3-0.6B",
  "choices": [
    {
      "index": 0,
      "message": {
        "role": "assistant",
        "content": "Hi!",
        "refusal": null,
        "annotations": null,
        "audio": null,
        "function_call": null,
        "reasoning": null
      },
      "logprobs": {
        "content": [
          {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []},
          {"token": "!", "logprob": -1.5, "bytes": [33], "top_logprobs": []},
          {"token": "<|im_end|>", "logprob": -0.0625, "bytes": [60, 124, 105, 109, 95, 101, 110, 100, 124, 62], "top_logprobs": []}
        ]
      },
      "finish_reason": "stop",
      "stop_reason": null,
      "token_ids": [13048, 0, 151645],
      "routed_experts": null
    }
  ],
  "service_tier": null,
  "system_fingerprint": null,
  "usage": {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": null},
  "prompt_logprobs": null,
  "prompt_token_ids": [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
  "prompt_text": null,
  "kv_transfer_params": null,
  "ec_transfer_params": null,
  "metrics": null
}"#;

/// `data:` payloads in order (`[DONE]` follows). Prompt ids ride on the first (role) chunk only.
const VLLM_STREAM: [&str; 5] = [
    r#"{"id":"chatcmpl-9f3c2d7e","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"prompt_token_ids":[151644,872,198,9707,151645,198,151644,77091,198]}"#,
    r#"{"id":"chatcmpl-9f3c2d7e","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.25,"bytes":[72,105],"top_logprobs":[]}]},"finish_reason":null,"token_ids":[13048]}]}"#,
    r#"{"id":"chatcmpl-9f3c2d7e","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":"!"},"logprobs":{"content":[{"token":"!","logprob":-1.5,"bytes":[33],"top_logprobs":[]}]},"finish_reason":null,"token_ids":[0]}]}"#,
    r#"{"id":"chatcmpl-9f3c2d7e","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-0.6B","choices":[{"index":0,"delta":{"content":""},"logprobs":{"content":[{"token":"<|im_end|>","logprob":-0.0625,"bytes":[60,124,105,109,95,101,110,100,124,62],"top_logprobs":[]}]},"finish_reason":"stop","stop_reason":null,"token_ids":[151645]}]}"#,
    r#"{"id":"chatcmpl-9f3c2d7e","object":"chat.completion.chunk","created":1767225600,"model":"Qwen/Qwen3-0.6B","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}"#,
];

// ---------------------------------------------------------------------------------------------
// SGLang fixtures. Whole: `return_prompt_token_ids`, `return_meta_info`, `logprobs: true`.
// Stream: `return_input_ids_in_sglext` and `return_output_ids_in_sglext` both set (the double
// drops what a request did not ask for).

const SGLANG_WHOLE: &str = r#"{
  "id": "5f0e6b5a2a4d4b7c",
  "object": "chat.completion",
  "created": 1767225600,
  "model": "default",
  "choices": [
    {
      "index": 0,
      "message": {"role": "assistant", "content": "Hi!", "reasoning_content": null, "tool_calls": null},
      "logprobs": {
        "content": [
          {"token": "Hi", "bytes": [72, 105], "logprob": -0.25, "top_logprobs": []},
          {"token": "!", "bytes": [33], "logprob": -1.5, "top_logprobs": []},
          {"token": "<|im_end|>", "bytes": [60, 124, 105, 109, 95, 101, 110, 100, 124, 62], "logprob": -0.0625, "top_logprobs": []}
        ]
      },
      "finish_reason": "stop",
      "matched_stop": 151645,
      "prompt_token_ids": [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
      "meta_info": {
        "id": "5f0e6b5a2a4d4b7c",
        "finish_reason": {"type": "stop", "matched": 151645},
        "prompt_tokens": 9,
        "weight_version": "default",
        "completion_tokens": 3,
        "cached_tokens": 0,
        "output_token_logprobs": [[-0.25, 13048, "Hi"], [-1.5, 0, "!"], [-0.0625, 151645, "<|im_end|>"]],
        "output_top_logprobs": [],
        "e2e_latency": 0.031
      }
    }
  ],
  "usage": {"prompt_tokens": 9, "total_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": null, "reasoning_tokens": 0},
  "metadata": {"weight_version": "default"}
}"#;

/// Logprobs ride on content chunks without ids (and the end-of-turn token, which has no text,
/// gets no chunk); the ids come once, in the `choices: []` sglext chunk after the finish chunk.
const SGLANG_STREAM: [&str; 6] = [
    r#"{"id":"5f0e6b5a2a4d4b7c","object":"chat.completion.chunk","created":1767225600,"model":"default","choices":[{"index":0,"delta":{"role":"assistant","content":"","reasoning_content":null,"tool_calls":null},"logprobs":null,"finish_reason":null,"matched_stop":null}],"usage":null}"#,
    r#"{"id":"5f0e6b5a2a4d4b7c","object":"chat.completion.chunk","created":1767225600,"model":"default","choices":[{"index":0,"delta":{"role":null,"content":"Hi","reasoning_content":null,"tool_calls":null},"logprobs":{"content":[{"token":"Hi","bytes":[72,105],"logprob":-0.25,"top_logprobs":[]}]},"finish_reason":null,"matched_stop":null}],"usage":null}"#,
    r#"{"id":"5f0e6b5a2a4d4b7c","object":"chat.completion.chunk","created":1767225600,"model":"default","choices":[{"index":0,"delta":{"role":null,"content":"!","reasoning_content":null,"tool_calls":null},"logprobs":{"content":[{"token":"!","bytes":[33],"logprob":-1.5,"top_logprobs":[]}]},"finish_reason":null,"matched_stop":null}],"usage":null}"#,
    r#"{"id":"5f0e6b5a2a4d4b7c","object":"chat.completion.chunk","created":1767225600,"model":"default","choices":[{"index":0,"delta":{"role":null,"content":null,"reasoning_content":null,"tool_calls":null},"logprobs":null,"finish_reason":"stop","matched_stop":151645}],"usage":null}"#,
    r#"{"id":"5f0e6b5a2a4d4b7c","object":"chat.completion.chunk","created":1767225600,"model":"default","choices":[],"usage":null,"sglext":{"input_ids":[151644,872,198,9707,151645,198,151644,77091,198],"output_ids":[[13048,0,151645]]}}"#,
    r#"{"id":"5f0e6b5a2a4d4b7c","object":"chat.completion.chunk","created":1767225600,"model":"default","choices":[],"usage":{"prompt_tokens":9,"total_tokens":12,"completion_tokens":3,"prompt_tokens_details":null,"reasoning_tokens":0}}"#,
];

const SGLANG_STREAM_REFUSAL: &str = r#"{"object":"error","message":"return_prompt_token_ids is not supported with streaming. Please set stream=false when using return_prompt_token_ids=true.","type":"BadRequest","param":null,"code":400}"#;

fn parse(s: &str) -> Value {
    serde_json::from_str(s).expect("fixture is JSON")
}

fn choice0(v: &Value) -> &Value {
    &v["choices"][0]
}

/// `v` (a choice) as the decoders read it.
fn typed_choice(v: &Value) -> Choice<'_> {
    from_value(v)
}

/// The prompt ids `dialect` finds in answer or chunk `v` (its first choice taken out first,
/// as the decoders do).
fn prompt_ids(dialect: &impl TokenDialect, v: &Value) -> Option<Vec<u32>> {
    let mut answer: Answer = from_value(v);
    let mut choice = answer.choices.0.take();
    dialect.prompt_tokens(&mut answer, choice.as_mut())
}

/// The sampled ids and logprobs `dialect` finds in choice `v`.
fn sampled(dialect: &impl TokenDialect, v: &Value) -> Option<(Vec<u32>, Vec<Option<f32>>)> {
    dialect.sampled_tokens(&mut typed_choice(v))
}

/// The token-data fields `dialect` adds to a request, as a JSON object.
fn token_data(dialect: &impl TokenDialect, stream: bool) -> Map<String, Value> {
    dialect
        .request_token_data(stream)
        .iter()
        .map(|(k, v)| {
            let v = match v {
                TokenParam::True => json!(true),
                TokenParam::Int(n) => json!(n),
            };
            ((*k).to_owned(), v)
        })
        .collect()
}

fn flag(body: &Value, name: &str) -> bool {
    body.get(name) == Some(&Value::Bool(true))
}

// ---------------------------------------------------------------------------------------------
// Local engine doubles.

type Recorded = Arc<Mutex<Vec<Value>>>;

/// Serves `app` on an ephemeral loopback port; returns its base URL.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn json_response(status: StatusCode, body: Value) -> Response {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("response")
}

fn sse_response(payloads: Vec<Value>) -> Response {
    let frames: Vec<Result<String, Infallible>> = payloads
        .iter()
        .map(|p| Ok(format!("data: {p}\n\n")))
        .chain(std::iter::once(Ok("data: [DONE]\n\n".to_owned())))
        .collect();
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from_stream(futures::stream::iter(frames)))
        .expect("response")
}

/// A stand-in for vLLM's `/v1/chat/completions` (test double, not an engine).
#[derive(Clone, Copy)]
struct VllmContractDouble {
    /// vLLM >= 0.10.2 answers `return_token_ids`.
    honors_return_token_ids: bool,
    /// Spells logprob tokens `token_id:<id>` when asked.
    honors_tokens_as_token_ids: bool,
    /// Drops the stream chunk at this index, text and ids, as vllm#27482 did for chunks a
    /// tool parser buffered; the usage still counts its token.
    drops_chunk: Option<usize>,
}

impl VllmContractDouble {
    const CURRENT: Self = VllmContractDouble {
        honors_return_token_ids: true,
        honors_tokens_as_token_ids: true,
        drops_chunk: None,
    };

    async fn start(self) -> (String, Recorded) {
        let recorded = Recorded::default();
        let app = Router::new()
            .route("/v1/chat/completions", post(vllm_chat))
            .with_state((self, recorded.clone()));
        (serve(app).await, recorded)
    }

    /// Trims one fixture answer (whole answer or chunk) as vLLM would for `req`; unset
    /// fields are `null`, as vLLM serializes them.
    fn shape(&self, req: &Value, mut v: Value) -> Value {
        if let Some(choice) = v.pointer_mut("/choices/0") {
            let ids = choice.get("token_ids").cloned().unwrap_or(Value::Null);
            let as_ids = self.honors_tokens_as_token_ids && flag(req, "return_tokens_as_token_ids");
            if let (true, Some(entries), Some(ids)) = (
                as_ids,
                choice
                    .pointer_mut("/logprobs/content")
                    .and_then(Value::as_array_mut),
                ids.as_array(),
            ) {
                for (entry, id) in entries.iter_mut().zip(ids) {
                    let token = format!("token_id:{id}");
                    entry["bytes"] = json!(token.as_bytes());
                    entry["token"] = json!(token);
                }
            }
            if !flag(req, "logprobs") {
                choice["logprobs"] = Value::Null;
            }
        }
        if !(self.honors_return_token_ids && flag(req, "return_token_ids")) {
            if let Some(slot) = v.get_mut("prompt_token_ids") {
                *slot = Value::Null;
            }
            if let Some(slot) = v.pointer_mut("/choices/0/token_ids") {
                *slot = Value::Null;
            }
        }
        v
    }
}

async fn vllm_chat(
    State((double, recorded)): State<(VllmContractDouble, Recorded)>,
    Json(req): Json<Value>,
) -> Response {
    recorded.lock().unwrap().push(req.clone());
    if flag(&req, "stream") {
        let chunks = VLLM_STREAM
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != double.drops_chunk)
            .map(|(_, c)| double.shape(&req, parse(c)))
            .collect();
        sse_response(chunks)
    } else {
        json_response(StatusCode::OK, double.shape(&req, parse(VLLM_WHOLE)))
    }
}

/// A stand-in for SGLang's `/v1/chat/completions` (test double, not an engine).
#[derive(Clone, Copy, PartialEq)]
enum SglangContractDouble {
    /// Knows `return_prompt_token_ids` / `return_meta_info` (whole answers only; refused with
    /// `stream: true`) and `return_{input,output}_ids_in_sglext`.
    Current,
    /// Before any of those: logprobs without ids.
    BeforeTokenIds,
}

impl SglangContractDouble {
    async fn start(self) -> (String, Recorded) {
        let recorded = Recorded::default();
        let app = Router::new()
            .route("/v1/chat/completions", post(sglang_chat))
            .with_state((self, recorded.clone()));
        (serve(app).await, recorded)
    }

    /// Keeps the sglext fields `req` asked for; `None` when nothing is left.
    fn sglext(&self, req: &Value, full: &Value) -> Option<Value> {
        if *self != SglangContractDouble::Current {
            return None;
        }
        let mut ext = Map::new();
        for (flag_name, field) in [
            ("return_input_ids_in_sglext", "input_ids"),
            ("return_output_ids_in_sglext", "output_ids"),
        ] {
            if flag(req, flag_name) {
                ext.insert(field.into(), full[field].clone());
            }
        }
        (!ext.is_empty()).then_some(Value::Object(ext))
    }

    fn stream(&self, req: &Value) -> Vec<Value> {
        let full_ext = parse(SGLANG_STREAM[4])["sglext"].clone();
        SGLANG_STREAM
            .iter()
            .map(|c| parse(c))
            .filter_map(|mut c| {
                if c.get("sglext").is_some() {
                    c["sglext"] = self.sglext(req, &full_ext)?;
                }
                if let Some(choice) = c.pointer_mut("/choices/0") {
                    if !flag(req, "logprobs") {
                        choice["logprobs"] = Value::Null;
                    }
                }
                Some(c)
            })
            .collect()
    }

    fn whole(&self, req: &Value) -> Value {
        let mut v = parse(SGLANG_WHOLE);
        let current = *self == SglangContractDouble::Current;
        let choice = v["choices"][0].as_object_mut().expect("choice");
        // SGLang drops these keys, rather than nulling them, when not asked for.
        if !(current && flag(req, "return_prompt_token_ids")) {
            choice.remove("prompt_token_ids");
        }
        if !(current && flag(req, "return_meta_info")) {
            choice.remove("meta_info");
        }
        if !flag(req, "logprobs") {
            choice.insert("logprobs".into(), Value::Null);
        }
        let full_ext = json!({"input_ids": PROMPT_IDS, "output_ids": [SAMPLED_IDS]});
        if let Some(ext) = self.sglext(req, &full_ext) {
            v["sglext"] = ext;
        }
        v
    }
}

async fn sglang_chat(
    State((double, recorded)): State<(SglangContractDouble, Recorded)>,
    Json(req): Json<Value>,
) -> Response {
    recorded.lock().unwrap().push(req.clone());
    if !flag(&req, "stream") {
        return json_response(StatusCode::OK, double.whole(&req));
    }
    let refused = [
        "return_prompt_token_ids",
        "return_meta_info",
        "return_token_ids",
    ];
    if double == SglangContractDouble::Current && refused.iter().any(|f| flag(&req, f)) {
        return json_response(StatusCode::BAD_REQUEST, parse(SGLANG_STREAM_REFUSAL));
    }
    sse_response(double.stream(&req))
}

// ---------------------------------------------------------------------------------------------
// Driving an adapter against a double.

fn chat_request() -> ChatRequest {
    ChatRequest {
        model: "Qwen/Qwen3-0.6B".into(),
        messages: vec![ChatMessage::text(Role::User, "Hello")],
        tools: Vec::new(),
        tool_choice: None,
        sampling: Default::default(),
        stream: false,
        extra: Map::new(),
    }
}

/// A backend of `kind` at `url` with the tests' timeouts and no key.
fn config(kind: BackendKind, url: &str) -> BackendConfig {
    BackendConfig {
        kind,
        url: url.to_owned(),
        api_key: None,
        ca_roots: Vec::new(),
        connect_timeout: Duration::from_secs(2),
        idle_timeout: Duration::from_secs(5),
        max_answer_bytes: crate::backend::DEFAULT_MAX_ANSWER_BYTES,
    }
}

async fn generate(
    kind: BackendKind,
    url: &str,
    request: &ChatRequest,
    mode: CallMode,
) -> Result<Vec<GenerationEvent>, BackendError> {
    let backend = build(config(kind, url))?;
    let events = backend.generate(request, mode).await?;
    events.collect::<Vec<_>>().await.into_iter().collect()
}

fn fold(events: &[GenerationEvent]) -> GenerationAccumulator {
    let mut acc = GenerationAccumulator::default();
    for e in events {
        acc.push(e.clone());
    }
    acc
}

fn gap_fields(acc: &GenerationAccumulator) -> Vec<TokenField> {
    acc.gaps.iter().map(|g| g.field).collect()
}

fn sampled_batches(events: &[GenerationEvent]) -> Vec<Vec<u32>> {
    events
        .iter()
        .filter_map(|e| match e {
            GenerationEvent::SampledTokens { ids, .. } => Some(ids.clone()),
            _ => None,
        })
        .collect()
}

fn prompt_events(events: &[GenerationEvent]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, GenerationEvent::PromptTokens { .. }))
        .count()
}

const MODES: [CallMode; 2] = [CallMode::Streaming, CallMode::Whole];

// ---------------------------------------------------------------------------------------------
// (a) Dialects on the documented answers.

#[test]
fn vllm_whole_answer_gives_top_level_prompt_ids_and_choice_token_ids() {
    let v = parse(VLLM_WHOLE);
    let (ids, logprobs) = sampled(&VllmDialect, choice0(&v)).expect("ids");
    assert_eq!(ids, SAMPLED_IDS);
    assert_eq!(logprobs, sampled_logprobs());
    assert_eq!(prompt_ids(&VllmDialect, &v), Some(PROMPT_IDS.to_vec()));
    // Prompt ids live on the answer, never on the choice.
    let mut moved = v.clone();
    moved["choices"][0]["prompt_token_ids"] = moved["prompt_token_ids"].take();
    assert_eq!(prompt_ids(&VllmDialect, &moved), None);
}

#[test]
fn vllm_stream_chunks_give_prompt_ids_first_and_each_chunks_own_ids() {
    let chunks: Vec<Value> = VLLM_STREAM.iter().map(|c| parse(c)).collect();
    assert_eq!(
        prompt_ids(&VllmDialect, &chunks[0]),
        Some(PROMPT_IDS.to_vec())
    );
    assert_eq!(sampled(&VllmDialect, choice0(&chunks[0])), None);
    for (chunk, (id, lp)) in chunks[1..4]
        .iter()
        .zip(SAMPLED_IDS.iter().zip(SAMPLED_LOGPROBS))
    {
        assert_eq!(prompt_ids(&VllmDialect, chunk), None);
        assert_eq!(
            sampled(&VllmDialect, choice0(chunk)),
            Some((vec![*id], vec![Some(lp)]))
        );
    }
    assert!(chunks[4]["choices"].as_array().unwrap().is_empty());
    assert_eq!(prompt_ids(&VllmDialect, &chunks[4]), None);
}

#[test]
fn vllm_logprob_tokens_spelled_as_ids_are_the_fallback_id_source() {
    // A server older than `return_token_ids` (or one that nulls it) with
    // `return_tokens_as_token_ids`.
    let chunk = json!({"index": 0, "delta": {"content": "Hi"}, "finish_reason": null,
        "logprobs": {"content": [{"token": "token_id:13048", "logprob": -0.25,
            "bytes": [116, 111, 107, 101, 110, 95, 105, 100, 58, 49, 51, 48, 52, 56], "top_logprobs": []}]}});
    assert_eq!(
        sampled(&VllmDialect, &chunk),
        Some((vec![13048], vec![Some(-0.25)]))
    );
    // `token_ids` wins when both are there.
    let mut both = chunk.clone();
    both["token_ids"] = json!([7]);
    assert_eq!(sampled(&VllmDialect, &both).unwrap().0, vec![7]);
    // Token text is not an id, nor is an empty list.
    let empty = json!({"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []}});
    assert_eq!(sampled(&VllmDialect, &empty), None);
    let v = parse(VLLM_WHOLE);
    let mut text_only = choice0(&v).clone();
    text_only["token_ids"] = Value::Null;
    assert_eq!(sampled(&VllmDialect, &text_only), None);
}

#[test]
fn vllm_logprobs_that_do_not_line_up_or_are_the_sentinel_are_left_out() {
    let v = parse(VLLM_WHOLE);
    let mut short = choice0(&v).clone();
    short["logprobs"]["content"].as_array_mut().unwrap().pop();
    assert_eq!(
        sampled(&VllmDialect, &short),
        Some((SAMPLED_IDS.to_vec(), vec![None; 3]))
    );
    let mut sentinel = choice0(&v).clone();
    sentinel["logprobs"]["content"][1]["logprob"] = json!(-9999.0);
    assert_eq!(
        sampled(&VllmDialect, &sentinel).unwrap().1,
        vec![Some(-0.25), None, Some(-0.0625)]
    );
    let mut no_logprobs = choice0(&v).clone();
    no_logprobs["logprobs"] = Value::Null;
    assert_eq!(
        sampled(&VllmDialect, &no_logprobs),
        Some((SAMPLED_IDS.to_vec(), vec![None; 3]))
    );
}

#[test]
fn vllm_request_asks_for_ids_and_only_the_sampled_logprob() {
    for stream in [true, false] {
        let body = token_data(&VllmDialect, stream);
        assert_eq!(body["return_token_ids"], json!(true));
        assert_eq!(body["return_tokens_as_token_ids"], json!(true));
        assert_eq!(body["logprobs"], json!(true));
        assert_eq!(body["top_logprobs"], json!(0));
    }
}

#[test]
fn sglang_whole_answer_gives_meta_info_ids_and_choice_prompt_ids() {
    let v = parse(SGLANG_WHOLE);
    let (ids, logprobs) = sampled(&SglangDialect, choice0(&v)).expect("ids");
    assert_eq!(ids, SAMPLED_IDS);
    assert_eq!(logprobs, sampled_logprobs());
    assert_eq!(prompt_ids(&SglangDialect, &v), Some(PROMPT_IDS.to_vec()));
    // `logprobs.content` has no ids: without `meta_info` there is nothing to read.
    let mut plain = choice0(&v).clone();
    plain.as_object_mut().unwrap().remove("meta_info");
    assert_eq!(sampled(&SglangDialect, &plain), None);
    // An entry without an id gives no ids rather than a shorter list.
    let mut broken = choice0(&v).clone();
    broken["meta_info"]["output_token_logprobs"][1] = json!([-1.5, null, "!"]);
    assert_eq!(sampled(&SglangDialect, &broken), None);
}

#[test]
fn sglang_stream_chunks_give_no_sampled_ids_and_prompt_ids_only_in_the_sglext_trailer() {
    let chunks: Vec<Value> = SGLANG_STREAM.iter().map(|c| parse(c)).collect();
    for chunk in &chunks[..4] {
        assert_eq!(sampled(&SglangDialect, choice0(chunk)), None);
        assert_eq!(prompt_ids(&SglangDialect, chunk), None);
    }
    assert_eq!(
        prompt_ids(&SglangDialect, &chunks[4]),
        Some(PROMPT_IDS.to_vec())
    );
    assert_eq!(prompt_ids(&SglangDialect, &chunks[5]), None);
}

#[test]
fn sglang_request_avoids_the_flags_sglang_refuses_when_streaming() {
    let streamed = token_data(&SglangDialect, true);
    assert_eq!(streamed["logprobs"], json!(true));
    assert_eq!(streamed["top_logprobs"], json!(0));
    assert_eq!(streamed["return_input_ids_in_sglext"], json!(true));
    for refused in [
        "return_prompt_token_ids",
        "return_meta_info",
        "return_token_ids",
    ] {
        assert!(!streamed.contains_key(refused), "{refused}");
    }

    let whole = token_data(&SglangDialect, false);
    assert_eq!(whole["logprobs"], json!(true));
    assert_eq!(whole["top_logprobs"], json!(0));
    assert_eq!(whole["return_prompt_token_ids"], json!(true));
    assert_eq!(whole["return_meta_info"], json!(true));
}

// ---------------------------------------------------------------------------------------------
// (b) Adapters end to end against the doubles.

#[tokio::test]
async fn vllm_contract_double_tokens_come_through_in_both_modes() {
    let (url, recorded) = VllmContractDouble::CURRENT.start().await;
    for mode in MODES {
        let events = generate(BackendKind::Vllm, &url, &chat_request(), mode)
            .await
            .unwrap();
        let body = recorded.lock().unwrap().pop().expect("request recorded");
        assert_eq!(body["stream"], json!(mode == CallMode::Streaming));
        assert_eq!(body["return_token_ids"], json!(true));
        assert_eq!(body["return_tokens_as_token_ids"], json!(true));
        assert_eq!(body["logprobs"], json!(true));
        assert_eq!(body["top_logprobs"], json!(0));

        let acc = fold(&events);
        assert_eq!(prompt_events(&events), 1, "{mode:?}");
        assert_eq!(
            acc.prompt,
            Some((PROMPT_IDS.to_vec(), TokenSource::EngineResponse)),
            "{mode:?}"
        );
        assert_eq!(acc.completion_ids, SAMPLED_IDS, "{mode:?}");
        assert_eq!(acc.logprobs, sampled_logprobs(), "{mode:?}");
        assert!(acc.gaps.is_empty(), "{mode:?}: {:?}", acc.gaps);
        assert_eq!(acc.content, "Hi!");
        if mode == CallMode::Streaming {
            assert_eq!(
                sampled_batches(&events),
                vec![vec![13048], vec![0], vec![151645]]
            );
        }
    }
}

#[tokio::test]
async fn vllm_contract_double_ids_come_from_whichever_field_the_server_fills() {
    // Only `token_ids` (logprob tokens stay text), then only `token_id:<id>` logprob tokens
    // (a server older than `return_token_ids`: no prompt ids either).
    let token_ids_only = VllmContractDouble {
        honors_tokens_as_token_ids: false,
        ..VllmContractDouble::CURRENT
    };
    let placeholders_only = VllmContractDouble {
        honors_return_token_ids: false,
        ..VllmContractDouble::CURRENT
    };
    for (double, prompt_known) in [(token_ids_only, true), (placeholders_only, false)] {
        let (url, _) = double.start().await;
        for mode in MODES {
            let events = generate(BackendKind::Vllm, &url, &chat_request(), mode)
                .await
                .unwrap();
            let acc = fold(&events);
            assert_eq!(acc.completion_ids, SAMPLED_IDS, "{mode:?}");
            assert_eq!(acc.logprobs, sampled_logprobs(), "{mode:?}");
            if prompt_known {
                assert_eq!(
                    acc.prompt,
                    Some((PROMPT_IDS.to_vec(), TokenSource::EngineResponse))
                );
                assert!(acc.gaps.is_empty(), "{mode:?}: {:?}", acc.gaps);
            } else {
                assert_eq!(acc.prompt, None);
                assert_eq!(
                    gap_fields(&acc),
                    vec![TokenField::PromptTokenIds],
                    "{mode:?}"
                );
            }
        }
    }
}

#[tokio::test]
async fn vllm_contract_double_without_token_data_gives_gaps_never_ids() {
    let (url, _) = VllmContractDouble {
        honors_return_token_ids: false,
        honors_tokens_as_token_ids: false,
        drops_chunk: None,
    }
    .start()
    .await;
    for mode in MODES {
        let events = generate(BackendKind::Vllm, &url, &chat_request(), mode)
            .await
            .unwrap();
        let acc = fold(&events);
        assert_eq!(prompt_events(&events), 0, "{mode:?}");
        assert!(sampled_batches(&events).is_empty(), "{mode:?}");
        assert_eq!(
            gap_fields(&acc),
            vec![TokenField::PromptTokenIds, TokenField::CompletionTokenIds],
            "{mode:?}"
        );
        assert_eq!(acc.content, "Hi!");
    }
}

#[tokio::test]
async fn vllm_contract_double_dropping_a_chunks_ids_gives_a_gap() {
    // The "!" chunk never arrives, but the usage still counts its token (vllm#27482); the
    // shared count check must catch it.
    let (url, _) = VllmContractDouble {
        drops_chunk: Some(2),
        ..VllmContractDouble::CURRENT
    }
    .start()
    .await;
    let events = generate(
        BackendKind::Vllm,
        &url,
        &chat_request(),
        CallMode::Streaming,
    )
    .await
    .unwrap();
    let acc = fold(&events);
    assert_eq!(acc.completion_ids, vec![13048, 151645]);
    assert_eq!(gap_fields(&acc), vec![TokenField::CompletionTokenIds]);
    assert!(
        acc.gaps[0].reason.contains("3 completion tokens"),
        "{}",
        acc.gaps[0].reason
    );
}

#[tokio::test]
async fn sglang_contract_double_whole_answer_tokens_come_through() {
    let (url, recorded) = SglangContractDouble::Current.start().await;
    let events = generate(BackendKind::Sglang, &url, &chat_request(), CallMode::Whole)
        .await
        .unwrap();
    let body = recorded.lock().unwrap().pop().expect("request recorded");
    assert_eq!(body["stream"], json!(false));
    assert_eq!(body["logprobs"], json!(true));
    assert_eq!(body["top_logprobs"], json!(0));
    assert_eq!(body["return_prompt_token_ids"], json!(true));
    assert_eq!(body["return_meta_info"], json!(true));

    let acc = fold(&events);
    assert_eq!(prompt_events(&events), 1);
    assert_eq!(
        acc.prompt,
        Some((PROMPT_IDS.to_vec(), TokenSource::EngineResponse))
    );
    assert_eq!(acc.completion_ids, SAMPLED_IDS);
    assert_eq!(acc.logprobs, sampled_logprobs());
    assert!(acc.gaps.is_empty(), "{:?}", acc.gaps);
    assert_eq!(acc.content, "Hi!");
}

#[tokio::test]
async fn sglang_contract_double_stream_gives_prompt_ids_and_a_gap_for_sampled_ids() {
    let (url, recorded) = SglangContractDouble::Current.start().await;
    let events = generate(
        BackendKind::Sglang,
        &url,
        &chat_request(),
        CallMode::Streaming,
    )
    .await
    .unwrap();
    let body = recorded.lock().unwrap().pop().expect("request recorded");
    assert_eq!(body["stream"], json!(true));
    assert_eq!(body["logprobs"], json!(true));
    assert_eq!(body["top_logprobs"], json!(0));
    assert_eq!(body["return_input_ids_in_sglext"], json!(true));

    let acc = fold(&events);
    assert_eq!(prompt_events(&events), 1);
    assert_eq!(
        acc.prompt,
        Some((PROMPT_IDS.to_vec(), TokenSource::EngineResponse))
    );
    // SGLang's stream chunks carry no ids; the shared code records that, nothing is guessed.
    assert!(sampled_batches(&events).is_empty());
    assert_eq!(gap_fields(&acc), vec![TokenField::CompletionTokenIds]);
    assert_eq!(acc.content, "Hi!");
}

#[tokio::test]
async fn sglang_contract_double_refuses_whole_answer_flags_on_streams() {
    // Checks the double itself: the streaming test above passes only because the adapter
    // leaves these flags out.
    let (url, _) = SglangContractDouble::Current.start().await;
    let mut request = chat_request();
    request.extra.insert("return_meta_info".into(), json!(true));
    let err = generate(BackendKind::Sglang, &url, &request, CallMode::Streaming)
        .await
        .expect_err("SGLang refuses return_meta_info on streams");
    assert!(
        err.to_string().contains("not supported with streaming"),
        "{err}"
    );
}

#[tokio::test]
async fn sglang_contract_double_without_token_data_gives_gaps_never_ids() {
    let (url, _) = SglangContractDouble::BeforeTokenIds.start().await;
    for mode in MODES {
        let events = generate(BackendKind::Sglang, &url, &chat_request(), mode)
            .await
            .unwrap();
        let acc = fold(&events);
        assert_eq!(prompt_events(&events), 0, "{mode:?}");
        assert!(sampled_batches(&events).is_empty(), "{mode:?}");
        assert_eq!(
            gap_fields(&acc),
            vec![TokenField::PromptTokenIds, TokenField::CompletionTokenIds],
            "{mode:?}"
        );
        assert_eq!(acc.content, "Hi!");
    }
}

/// Issue 37 item 9: a password in the engine URL's userinfo reached every record's
/// `backend.url` (and the proxy's start-up log, which prints the same URL through
/// `redact::url`).
#[test]
fn the_engine_url_is_shown_without_its_password() {
    for kind in [
        BackendKind::Vllm,
        BackendKind::Sglang,
        BackendKind::Llamacpp,
    ] {
        for (url, shown) in [
            (
                "https://app:s3cr3t-pw@engine.example:8443/v1",
                "https://app:[redacted]@engine.example:8443",
            ),
            (
                "http://0123456789abcdef0123@10.0.0.5:8000/",
                "http://[redacted]@10.0.0.5:8000",
            ),
            ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ] {
            let backend = build(config(kind, url)).unwrap();
            assert_eq!(backend.url(), shown, "{kind:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// (c) `--engine-weight-version`: vLLM's `GET /weight_info` read around each call.

/// The vLLM double with vLLM's `/weight_info` beside it (`{"weight_version": …}`, as vLLM 0.32
/// answers in dev mode). With `updates_during_call`, the chat route moves the version on
/// before it answers: a trainer's update landing while the call runs. Without
/// `serves_weight_info`, the route is absent (an engine not in dev mode: 404).
async fn weight_versioned_double(
    version: Arc<std::sync::atomic::AtomicU64>,
    updates_during_call: bool,
    serves_weight_info: bool,
) -> String {
    use std::sync::atomic::Ordering;
    type ChatState = (
        VllmContractDouble,
        Recorded,
        Arc<std::sync::atomic::AtomicU64>,
        bool,
    );
    async fn chat(
        State((double, recorded, version, updates)): State<ChatState>,
        req: Json<Value>,
    ) -> Response {
        if updates {
            version.fetch_add(1, Ordering::SeqCst);
        }
        vllm_chat(State((double, recorded)), req).await
    }
    async fn weight_info(State(version): State<Arc<std::sync::atomic::AtomicU64>>) -> Response {
        json_response(
            StatusCode::OK,
            json!({"weight_version": version.load(Ordering::SeqCst).to_string()}),
        )
    }
    let mut app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .with_state((
            VllmContractDouble::CURRENT,
            Recorded::default(),
            version.clone(),
            updates_during_call,
        ));
    if serves_weight_info {
        app = app.merge(
            Router::new()
                .route("/weight_info", axum::routing::get(weight_info))
                .with_state(version),
        );
    }
    serve(app).await
}

async fn versioned_generate(url: &str, mode: CallMode) -> Vec<GenerationEvent> {
    let cfg = config(BackendKind::Vllm, url);
    let inner: Arc<dyn super::Backend> = Arc::from(build(cfg.clone()).unwrap());
    let backend = super::with_engine_weight_version(inner, &cfg).unwrap();
    let events = backend.generate(&chat_request(), mode).await.unwrap();
    events
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap()
}

#[tokio::test]
async fn the_engine_weight_version_is_read_before_and_after_each_call() {
    use std::sync::atomic::{AtomicU64, Ordering};
    for mode in MODES {
        // Steady weights: the same version on both sides, no straddle; the answer whole.
        let version = Arc::new(AtomicU64::new(7));
        let url = weight_versioned_double(version.clone(), false, true).await;
        let acc = fold(&versioned_generate(&url, mode).await);
        let v = acc.engine_weight_version.clone().expect("versions read");
        assert_eq!(
            (v.at_start.as_deref(), v.at_end.as_deref()),
            (Some("7"), Some("7")),
            "{mode:?}"
        );
        assert!(!v.straddles_update(), "{mode:?}");
        assert_eq!(acc.completion_ids, SAMPLED_IDS, "{mode:?}");

        // The positive control: an update lands while the call runs, and the call says so.
        let url = weight_versioned_double(version.clone(), true, true).await;
        let v = fold(&versioned_generate(&url, mode).await)
            .engine_weight_version
            .expect("versions read");
        assert_eq!(
            (v.at_start.as_deref(), v.at_end.as_deref()),
            (Some("7"), Some("8")),
            "{mode:?}"
        );
        assert!(v.straddles_update(), "{mode:?}");
        assert_eq!(version.load(Ordering::SeqCst), 8);
    }
}

#[tokio::test]
async fn an_engine_that_names_no_weight_version_leaves_it_unknown_and_answers_whole() {
    let version = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let url = weight_versioned_double(version, false, false).await;
    for mode in MODES {
        let acc = fold(&versioned_generate(&url, mode).await);
        let v = acc
            .engine_weight_version
            .clone()
            .expect("the event is there");
        assert_eq!((v.at_start, v.at_end), (None, None), "{mode:?}");
        assert_eq!(acc.completion_ids, SAMPLED_IDS, "{mode:?}");
        assert!(acc.gaps.is_empty(), "{mode:?}");
    }
    // Only vLLM names its weights: the flag on another engine is refused at start.
    let cfg = config(BackendKind::Llamacpp, "http://127.0.0.1:9");
    let inner: Arc<dyn super::Backend> = Arc::from(build(cfg.clone()).unwrap());
    let err = super::with_engine_weight_version(inner, &cfg)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("/weight_info"), "{err}");
}
