//! What every engine's ids-in adapter shares with the tito backend: the request's parts
//! ([`IdsCall`]), the answer as read ([`IdsChunk`]), and the engine's account of the prompt
//! ([`PromptAccount`]). Apart from `mod.rs` so that the engine modules and the backend both
//! depend on it, not on each other.

use serde_json::Value;
use tokentap_answer_parse::Family;
use tokentap_schema::{BackendKind, FinishReason};

use crate::backend::error::BackendError;
use tokentap_wire::canonical::ChatRequest;

/// One engine's ids-in endpoint: its request and a reader of its answer.
pub(crate) trait IdsEngine: Clone + Send + Sync + 'static {
    const KIND: BackendKind;
    /// The endpoint that takes the prompt as ids.
    const PATH: &'static str;
    /// Whether the engine's default answer length is short (vLLM's `/v1/completions` stops at
    /// 16 tokens, SGLang's `/generate` at 128): then a call that sets none gets what the chat
    /// endpoint would allow, the rest of the context (`max_model_len` less the prompt).
    const NEEDS_AN_EXPLICIT_LIMIT: bool;
    /// Whether `/props` names the model's file (llama.cpp), tito's default `--tokenizer`.
    const NAMES_ITS_MODEL_FILE: bool;
    /// Whether the engine's own reasoning parser leaves the whitespace after `</think>` in the
    /// content (vLLM's does): tito's answer then keeps it too, so it equals the engine's
    /// text-mode answer for the same ids.
    const KEEPS_SPACE_AFTER_REASONING: bool;
    type Decoder: IdsDecoder + Send + 'static;

    /// The engine's request body, or why the call is refused (a message for a 400: the
    /// request goes past a bound of what tokentap builds for it, such as llama.cpp's call
    /// grammar).
    fn body(&self, call: &IdsCall<'_>) -> Result<Value, String>;
    fn decoder(&self) -> Self::Decoder;
}

/// What the engine's request is made of.
pub(crate) struct IdsCall<'a> {
    pub request: &'a ChatRequest,
    /// The request's tools as JSON ([`tools_json`]).
    pub tools: &'a [Value],
    pub family: Family,
    pub ids: &'a [u32],
    pub stream: bool,
    /// The answer's length limit, when the call or the engine needs one.
    pub max_tokens: Option<u64>,
}

/// The parts of `request` an engine's body reads (every field but the conversation and the
/// tools, which the body takes as ids and as JSON): what a body built off the async runtime
/// needs of it, without a copy of the whole conversation.
pub(crate) fn body_request(request: &ChatRequest) -> ChatRequest {
    ChatRequest {
        model: request.model.clone(),
        messages: Vec::new(),
        tools: Vec::new(),
        tool_choice: request.tool_choice.clone(),
        sampling: request.sampling.clone(),
        stream: request.stream,
        extra: request.extra.clone(),
    }
}

/// Reads one call's answer, whole or streamed, into [`IdsChunk`]s.
pub(crate) trait IdsDecoder {
    /// A whole answer's body: one chunk with its end.
    fn whole(&mut self, body: &[u8]) -> Result<IdsChunk, BackendError>;
    /// One stream event's data: `None` for events with nothing for tito (`[DONE]`, a
    /// usage-only chunk).
    fn event(&mut self, data: &[u8]) -> Result<Option<IdsChunk>, BackendError>;
}

/// Part of an answer as every engine gives it: the text and ids it adds, and on the last one
/// how it ended.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct IdsChunk {
    pub text: String,
    pub tokens: Vec<u32>,
    /// The sampled token's logprob for each of `tokens` (`None` where the engine gave none).
    pub logprobs: Vec<Option<f32>>,
    pub end: Option<IdsEnd>,
}

/// How the answer ended, and what the engine says it was prompted with.
#[derive(Debug, PartialEq)]
pub(crate) struct IdsEnd {
    /// `Stop`, `Length` or `Abort` (tool calls are the reader's to see).
    pub finish: FinishReason,
    pub prompt: PromptAccount,
}

/// The engine's own account of the prompt it ran.
#[derive(Debug, PartialEq)]
pub(crate) enum PromptAccount {
    /// The ids themselves (vLLM's `prompt_token_ids`).
    Echoed(Vec<u32>),
    /// How many it evaluated (llama.cpp's `tokens_evaluated`, SGLang's `prompt_tokens`).
    Evaluated(u64),
    Unreported,
}

impl PromptAccount {
    /// `None` when it matches the ids sent, else why not.
    pub(crate) fn mismatch(&self, sent: &[u32]) -> Option<String> {
        let n = sent.len();
        match self {
            PromptAccount::Echoed(ids) if ids == sent => None,
            PromptAccount::Echoed(ids) => {
                let at = ids.iter().zip(sent).take_while(|(a, b)| a == b).count();
                Some(format!(
                    "tokentap sent {n} prompt ids but the engine echoed {} that differ from position {at}",
                    ids.len()
                ))
            }
            PromptAccount::Evaluated(e) if *e as usize == n => None,
            PromptAccount::Evaluated(e) => Some(format!(
                "tokentap sent {n} prompt ids but the engine evaluated {e}"
            )),
            PromptAccount::Unreported => Some(format!(
                "tokentap sent {n} prompt ids but the engine evaluated an unreported number"
            )),
        }
    }
}

pub(crate) fn protocol_error(engine: &str, e: impl std::fmt::Display, data: &[u8]) -> BackendError {
    BackendError::Protocol(format!(
        "unreadable {engine} answer ({e}): {}",
        String::from_utf8_lossy(&data[..data.len().min(300)])
    ))
}

/// The request's tools as JSON, once per call: the grammar and the answer's parameter types
/// both read them.
pub(crate) fn tools_json(request: &ChatRequest) -> Vec<Value> {
    request
        .tools
        .iter()
        .filter_map(|t| serde_json::to_value(t).ok())
        .collect()
}

/// The samplers vLLM and SGLang both take (the same names in `/v1/completions`' body and
/// `/generate`'s `sampling_params`), every one explicit: the request's value, else the
/// distribution itself (their own defaults come from the model's generation_config.json,
/// which no harness asked for); special tokens kept in the text, where a family's call
/// markers may be special tokens. Each engine adds its own fields.
pub(crate) fn transformers_samplers(call: &IdsCall<'_>) -> serde_json::Map<String, Value> {
    let s = &call.request.sampling;
    let Value::Object(samplers) = serde_json::json!({
        "temperature": s.temperature.unwrap_or(1.0),
        "top_p": s.top_p.unwrap_or(1.0),
        "top_k": s.top_k.unwrap_or(-1),
        "min_p": s.min_p.unwrap_or(0.0),
        "presence_penalty": s.presence_penalty.unwrap_or(0.0),
        "frequency_penalty": s.frequency_penalty.unwrap_or(0.0),
        "repetition_penalty": 1.0,
        "stop": s.stop,
        "skip_special_tokens": false,
        "spaces_between_special_tokens": false,
    }) else {
        unreachable!("a JSON object literal")
    };
    samplers
}

/// An engine's body for a request given as JSON (the canonical request's shape), in tests.
#[cfg(test)]
pub(crate) fn body_for<E: IdsEngine>(
    engine: &E,
    request: Value,
    ids: &[u32],
    stream: bool,
    max_tokens: Option<u64>,
) -> Value {
    let request: ChatRequest = serde_json::from_value(request).unwrap();
    let tools = tools_json(&request);
    engine
        .body(&IdsCall {
            request: &request,
            tools: &tools,
            family: Family::Hermes,
            ids,
            stream,
            max_tokens,
        })
        .expect("a body")
}
