//! Test doubles of the engines that take a prompt as token ids and cannot run here (no GPU,
//! no CPU wheel): vLLM's `/v1/completions` and SGLang's `/generate`. Each answers in its
//! server's documented shape — vLLM's `CompletionResponse` / `CompletionStreamResponse` with
//! `return_token_ids` (`vllm/entrypoints/openai/completion/protocol.py`), SGLang's tokenizer
//! manager out dicts (`text`, `output_ids`, `meta_info`; cumulative when streaming, its
//! default) — and serves `/v1/models` with `max_model_len`, as both do.
//!
//! "Sampling" is a script: the answer text the script gives for the prompt's decoded text,
//! encoded by the model's real tokenizer, then the end-of-turn token; each sampled token's
//! logprob is [`DOUBLE_LOGPROB`]. Like the real servers, a request without a length limit
//! gets the engine's default (vLLM 16 tokens, SGLang 128) and a prompt that is not ids is a
//! 400.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokentap_chat_template::Tokenizer;

use crate::procs::serve_on_loopback;

/// The context length the doubles report.
pub const MAX_MODEL_LEN: u64 = 4096;
/// Each sampled token's logprob.
pub const DOUBLE_LOGPROB: f32 = -0.5;
/// The one model the doubles serve.
pub const DOUBLE_MODEL: &str = "ids-double-model";

/// Which engine the double is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdsEngine {
    Vllm,
    Sglang,
}

impl IdsEngine {
    /// `--backend` for tokentap.
    pub fn backend(self) -> &'static str {
        match self {
            IdsEngine::Vllm => "vllm",
            IdsEngine::Sglang => "sglang",
        }
    }

    /// The request's prompt ids (vLLM's `prompt`, SGLang's `input_ids`).
    pub fn prompt_ids(self, request: &Value) -> Option<Vec<u32>> {
        let field = match self {
            IdsEngine::Vllm => &request["prompt"],
            IdsEngine::Sglang => &request["input_ids"],
        };
        serde_json::from_value(field.clone()).ok()
    }

    /// The request's length limit (vLLM's `max_tokens`, SGLang's `max_new_tokens`).
    pub fn max_tokens(self, request: &Value) -> Option<u64> {
        match self {
            IdsEngine::Vllm => request["max_tokens"].as_u64(),
            IdsEngine::Sglang => request["sampling_params"]["max_new_tokens"].as_u64(),
        }
    }

    fn default_max_tokens(self) -> u64 {
        match self {
            IdsEngine::Vllm => 16,
            IdsEngine::Sglang => 128,
        }
    }
}

/// The answer text for a prompt's text.
pub type IdsScript = Arc<dyn Fn(&str) -> String + Send + Sync>;

struct Shared {
    engine: IdsEngine,
    tokenizer: Tokenizer,
    end_of_turn: u32,
    script: IdsScript,
    requests: Mutex<Vec<Value>>,
    /// Report a prompt other than the one received (the echo check's positive control).
    misreport_prompt: AtomicBool,
    calls: AtomicU64,
}

/// A scripted vLLM or SGLang serving on 127.0.0.1 until dropped.
pub struct IdsEngineDouble {
    pub url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for IdsEngineDouble {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl IdsEngineDouble {
    /// `model`: the model's tokenizer (a GGUF or a Hugging Face directory); `end_of_turn`: the
    /// token the model samples to end its turn (Qwen3's `<|im_end|>`).
    pub async fn start(
        engine: IdsEngine,
        model: &Path,
        end_of_turn: &str,
        script: IdsScript,
    ) -> IdsEngineDouble {
        let tokenizer = Tokenizer::open(model).expect("the model's tokenizer");
        let end_of_turn = match tokenizer.encode(end_of_turn).expect("encoding")[..] {
            [id] => id,
            ref ids => panic!("{end_of_turn} is {} tokens, not one", ids.len()),
        };
        let shared = Arc::new(Shared {
            engine,
            tokenizer,
            end_of_turn,
            script,
            requests: Mutex::new(Vec::new()),
            misreport_prompt: AtomicBool::new(false),
            calls: AtomicU64::new(0),
        });
        let path = match engine {
            IdsEngine::Vllm => "/v1/completions",
            IdsEngine::Sglang => "/generate",
        };
        let app = Router::new()
            .route("/v1/models", get(models))
            .route(path, post(generate))
            .fallback(|| async { (StatusCode::NOT_FOUND, "ids engine double: no such route") })
            .with_state(shared.clone());
        let (addr, server) = serve_on_loopback(app, "the ids engine double").await;
        let url = format!("http://{addr}");
        IdsEngineDouble {
            url,
            shared,
            server,
        }
    }

    /// A double of `engine` sampling with `model`'s tokenizer (Qwen3's `<|im_end|>` ends a
    /// turn), and a `tokentap proxy --token-mode tito` in front of it with the same tokenizer.
    pub async fn behind_tito(
        engine: IdsEngine,
        model: &Path,
        script: IdsScript,
    ) -> (IdsEngineDouble, crate::tokentap::Tokentap) {
        let double = IdsEngineDouble::start(engine, model, "<|im_end|>", script).await;
        let tokentap = crate::tokentap::Tokentap::start(
            crate::tokentap::TokentapConfig::new(double.url.clone(), engine.backend())
                .arg("--token-mode=tito")
                .arg("--tokenizer")
                .arg(model.display().to_string()),
        )
        .await;
        (double, tokentap)
    }

    /// Every generation request body received, in arrival order.
    pub fn requests(&self) -> Vec<Value> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// From now on, report a prompt other than the one received.
    pub fn misreport_prompt(&self) {
        self.shared.misreport_prompt.store(true, Ordering::SeqCst);
    }

    /// The ids the double samples for `answer`: its encoding, then the end of turn.
    pub fn sampled_ids(&self, answer: &str) -> Vec<u32> {
        let mut ids = self.shared.tokenizer.encode(answer).expect("encoding");
        ids.push(self.shared.end_of_turn);
        ids
    }
}

async fn models(State(shared): State<Arc<Shared>>) -> Json<Value> {
    let owned_by = match shared.engine {
        IdsEngine::Vllm => "vllm",
        IdsEngine::Sglang => "sglang",
    };
    Json(
        json!({"object": "list", "data": [{"id": DOUBLE_MODEL, "object": "model", "created": 1,
        "owned_by": owned_by, "root": DOUBLE_MODEL, "parent": null, "max_model_len": MAX_MODEL_LEN}]}),
    )
}

/// One sampled answer: ids, each id's text, and how it ended.
struct Sampled {
    ids: Vec<u32>,
    pieces: Vec<String>,
    length_cut: bool,
}

impl Shared {
    fn sample(&self, prompt: &[u32], max_tokens: u64) -> Sampled {
        let text = self.tokenizer.decode(prompt).expect("decoding the prompt");
        let mut ids = self
            .tokenizer
            .encode(&(self.script)(&text))
            .expect("encoding");
        ids.push(self.end_of_turn);
        let length_cut = ids.len() as u64 > max_tokens;
        ids.truncate(max_tokens as usize);
        // Each id's own text, as an incremental detokenizer writes it; the end of turn's text
        // is never written (both engines drop the stop token's text).
        let mut pieces = Vec::new();
        let mut before = String::new();
        for i in 0..ids.len() {
            if ids[i] == self.end_of_turn {
                pieces.push(String::new());
                continue;
            }
            let upto = self.tokenizer.decode(&ids[..=i]).expect("decoding");
            pieces.push(upto[before.len()..].to_owned());
            before = upto;
        }
        Sampled {
            ids,
            pieces,
            length_cut,
        }
    }

    fn reported_prompt(&self, prompt: &[u32]) -> Vec<u32> {
        let mut p = prompt.to_vec();
        if self.misreport_prompt.load(Ordering::SeqCst) {
            p[0] = p[0].wrapping_add(1);
            p.push(0);
        }
        p
    }
}

async fn generate(State(shared): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    shared.requests.lock().unwrap().push(body.clone());
    let engine = shared.engine;
    let Some(prompt) = engine.prompt_ids(&body).filter(|p| !p.is_empty()) else {
        let message = "the prompt must be a non-empty list of token ids";
        return (
            StatusCode::BAD_REQUEST,
            Json(match engine {
                IdsEngine::Vllm => json!({"object": "error", "message": message, "type": "BadRequestError", "param": null, "code": 400}),
                IdsEngine::Sglang => json!({"error": {"message": message}}),
            }),
        )
            .into_response();
    };
    let max_tokens = engine
        .max_tokens(&body)
        .unwrap_or(engine.default_max_tokens());
    let sampled = shared.sample(&prompt, max_tokens);
    let n = shared.calls.fetch_add(1, Ordering::SeqCst);
    let stream = body["stream"].as_bool().unwrap_or(false);
    let frames = match engine {
        IdsEngine::Vllm => vllm_answer(&shared, n, &prompt, &sampled, stream, &body),
        IdsEngine::Sglang => sglang_answer(&shared, n, &prompt, &sampled, stream),
    };
    match frames {
        Answer::Whole(v) => Json(v).into_response(),
        Answer::Stream(events) => {
            let mut body = String::new();
            for e in events {
                body.push_str(&format!("data: {e}\n\n"));
            }
            body.push_str("data: [DONE]\n\n");
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from(Bytes::from(body)))
                .expect("response")
        }
    }
}

enum Answer {
    Whole(Value),
    Stream(Vec<Value>),
}

fn vllm_logprobs(ids: &[u32], pieces: &[String]) -> Value {
    let mut offset = 0;
    let mut offsets = Vec::new();
    for p in pieces {
        offsets.push(offset);
        offset += p.len();
    }
    json!({
        "text_offset": offsets,
        "token_logprobs": ids.iter().map(|_| DOUBLE_LOGPROB).collect::<Vec<_>>(),
        "tokens": ids.iter().map(|id| format!("token_id:{id}")).collect::<Vec<_>>(),
        "top_logprobs": ids.iter().map(|id| json!({format!("token_id:{id}"): DOUBLE_LOGPROB})).collect::<Vec<_>>(),
    })
}

fn vllm_answer(
    shared: &Shared,
    n: u64,
    prompt: &[u32],
    s: &Sampled,
    stream: bool,
    request: &Value,
) -> Answer {
    let finish = if s.length_cut { "length" } else { "stop" };
    let id = format!("cmpl-double{n}");
    let usage = json!({"prompt_tokens": prompt.len(), "total_tokens": prompt.len() + s.ids.len(),
        "completion_tokens": s.ids.len(), "prompt_tokens_details": null});
    let echoed = shared.reported_prompt(prompt);
    if !stream {
        return Answer::Whole(json!({
            "id": id, "object": "text_completion", "created": 1, "model": DOUBLE_MODEL,
            "choices": [{"index": 0, "text": s.pieces.concat(), "logprobs": vllm_logprobs(&s.ids, &s.pieces),
                "finish_reason": finish, "stop_reason": null, "token_ids": s.ids,
                "prompt_logprobs": null, "prompt_token_ids": echoed}],
            "service_tier": null, "system_fingerprint": null, "usage": usage, "kv_transfer_params": null,
        }));
    }
    let mut events = Vec::new();
    for (i, (tok, piece)) in s.ids.iter().zip(&s.pieces).enumerate() {
        let last = i + 1 == s.ids.len();
        let mut choice = json!({"index": 0, "text": piece,
            "logprobs": vllm_logprobs(&[*tok], std::slice::from_ref(piece)),
            "finish_reason": if last { json!(finish) } else { Value::Null }, "stop_reason": null,
            "token_ids": [tok]});
        if i == 0 {
            choice["prompt_token_ids"] = json!(echoed);
        }
        events.push(json!({"id": id, "object": "text_completion", "created": 1,
            "model": DOUBLE_MODEL, "choices": [choice]}));
    }
    if request["stream_options"]["include_usage"] == true {
        events.push(json!({"id": id, "object": "text_completion", "created": 1,
            "model": DOUBLE_MODEL, "choices": [], "usage": usage}));
    }
    Answer::Stream(events)
}

fn sglang_answer(shared: &Shared, n: u64, prompt: &[u32], s: &Sampled, stream: bool) -> Answer {
    let meta = |upto: usize| {
        let done = upto == s.ids.len();
        let finish = match (done, s.length_cut) {
            (false, _) => Value::Null,
            (true, true) => json!({"type": "length", "length": s.ids.len()}),
            (true, false) => json!({"type": "stop", "matched": shared.end_of_turn}),
        };
        json!({"id": format!("double{n}"), "finish_reason": finish,
            "prompt_tokens": shared.reported_prompt(prompt).len(), "weight_version": "default",
            "num_retractions": 0,
            "output_token_logprobs": s.ids[..upto].iter().map(|id| json!([DOUBLE_LOGPROB, id, null])).collect::<Vec<_>>(),
            "reasoning_tokens": 0, "completion_tokens": upto, "cached_tokens": 0, "e2e_latency": 0.01})
    };
    let out = |upto: usize| json!({"text": s.pieces[..upto].concat(), "output_ids": s.ids[..upto], "meta_info": meta(upto)});
    if !stream {
        return Answer::Whole(out(s.ids.len()));
    }
    // SGLang's default stream: each chunk holds everything so far.
    Answer::Stream((1..=s.ids.len()).map(out).collect())
}
