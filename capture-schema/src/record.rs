//! The capture record: one per model call that crossed the proxy.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::chat::{AssistantMessage, ChatRequest, FinishReason, Usage};
use crate::raw_json::RawJson;

/// Version of the record layout; bumped on any incompatible change. Readers take every
/// version up to this one.
///
/// - 2: token ids and logprobs as compact strings ([`crate::compact`]); the harness body as
///   received (byte for byte unless redaction changed it); the backend request's conversation
///   left out when it is the harness body's ([`ConversationSource::HarnessBody`]).
/// - 1: token data as JSON arrays; the harness body re-serialized; the conversation twice.
pub const CAPTURE_SCHEMA_VERSION: u32 = 2;

/// Everything tokentap knows about one model call: what the harness sent, what the backend was
/// asked, the exact token ids the engine saw and sampled, and how it went.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CaptureRecord {
    /// [`CAPTURE_SCHEMA_VERSION`] at the time of writing.
    pub schema_version: u32,
    /// Unique id of this record (a UUIDv7: time-ordered), assigned once when the call arrives
    /// and never changed, so redelivery can be de-duplicated.
    pub record_id: String,
    /// The session the call belongs to.
    pub session_id: String,
    /// Where the session id came from.
    pub session_source: SessionSource,
    /// Position of the call in its session as seen by this proxy process, from 0.
    pub seq: u64,
    /// Wall-clock time the request head arrived, in milliseconds since the Unix epoch.
    pub started_at_unix_ms: u64,
    /// Wall-clock time the call ended (response finished or failed), in ms since the epoch.
    pub ended_at_unix_ms: u64,
    /// The provider API the harness spoke.
    pub wire_api: WireApi,
    /// The harness request as received, with secrets removed.
    pub request: HarnessRequest,
    /// The canonical chat request sent to the backend; absent when the call failed before one
    /// could be built (e.g. malformed JSON). Its `messages` and `tools` are empty here when
    /// `backend_conversation` is `harness_body`: they are the harness body's, parsed again
    /// (`tokentap_proxy::replay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_request: Option<ChatRequest>,
    /// Where the backend request's conversation (messages and tools) is kept.
    #[serde(default, skip_serializing_if = "ConversationSource::is_recorded")]
    pub backend_conversation: ConversationSource,
    /// Changes the proxy made on the way from the harness request to the backend request.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub normalizations: Vec<Normalization>,
    /// Which engine answered.
    pub backend: BackendInfo,
    /// Token ids of the prompt exactly as the engine saw them (after its chat template).
    /// `None` when the adapter could not obtain them; `token_provenance` says why.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::compact::ids"
    )]
    #[schemars(with = "Option<crate::compact::IdsOnWire>")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Token ids the engine sampled, in order (including an end-of-turn token when the engine
    /// reports one). `None` when unavailable.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::compact::ids"
    )]
    #[schemars(with = "Option<crate::compact::IdsOnWire>")]
    pub completion_token_ids: Option<Vec<u32>>,
    /// Log-probability of each sampled token under the sampling policy, aligned index by index
    /// with `completion_token_ids`. `None` when unavailable.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::compact::logprobs"
    )]
    #[schemars(with = "Option<crate::compact::LogprobsOnWire>")]
    pub logprobs: Option<Vec<f32>>,
    /// How the token ids were obtained, and where they are missing or unverified.
    pub token_provenance: TokenProvenance,
    /// Why generation ended; absent when it never started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_reason: Option<FinishReason>,
    /// The assistant message as parsed from the sampled tokens (possibly partial on error).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<AssistantMessage>,
    /// Token counts reported by the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// Where the time went.
    pub timings: Timings,
    /// The HTTP status the harness received.
    pub response_status: u16,
    /// What went wrong, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<CaptureError>,
    /// `--token-mode observe`: tokentap's own rendering of the call compared with the
    /// engine's prompt ids and with the session's earlier calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_observation: Option<crate::token_mode::TokenObservation>,
    /// `--token-mode tito`: how tokentap built the prompt ids it sent to the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_in: Option<crate::token_mode::TokenIn>,
}

/// Where a call's session id came from, in order of precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionSource {
    /// The `x-tokentap-session` request header.
    Header,
    /// A `/s/{session}/v1/...` path prefix.
    PathPrefix,
    /// A `?session=` query parameter.
    Query,
    /// A session id the harness itself sends (Codex `session-id`, Claude Code
    /// `x-claude-code-session-id`), prefixed with the harness's name.
    HarnessHeader,
    /// A hash of the API key (the key itself is never recorded).
    ApiKey,
    /// The `tokentap run` (or sidecar) that captured the call: every call it intercepts.
    Run,
    /// None of the above: a fresh id for this call alone.
    Generated,
}

/// The provider APIs the proxy speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WireApi {
    /// OpenAI Chat Completions, `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI Responses, `POST /v1/responses`.
    Responses,
    /// Anthropic Messages, `POST /v1/messages`.
    Messages,
    /// No request was read: the connection failed first (e.g. the client rejected the
    /// intercepting certificate).
    Unparsed,
}

impl WireApi {
    pub fn as_str(self) -> &'static str {
        match self {
            WireApi::ChatCompletions => "chat_completions",
            WireApi::Responses => "responses",
            WireApi::Messages => "messages",
            WireApi::Unparsed => "unparsed",
        }
    }
}

/// The harness request as received, secrets removed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct HarnessRequest {
    pub method: String,
    /// The path as received (including any `/s/{session}` prefix), without the query.
    pub path: String,
    /// The query string with secret-looking parameters replaced by `[redacted]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub query: Option<String>,
    /// Request headers (lower-case names); Authorization, x-api-key, cookies and other secrets
    /// are replaced by `[redacted]`.
    pub headers: BTreeMap<String, String>,
    /// Size of the body in bytes as received.
    pub body_bytes: u64,
    /// The body as JSON, as received (version 2: the harness's own bytes, its line breaks
    /// between tokens as spaces, unless redaction replaced something); absent when it was not
    /// valid JSON (see `body_text`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<RawJson>,
    /// The body as text (lossy UTF-8, at most 64 KiB) when it was not valid JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_text: Option<String>,
}

impl HarnessRequest {
    /// A request known only by its method and path: no headers, no body.
    pub fn bare(method: &str, path: &str) -> HarnessRequest {
        HarnessRequest {
            method: method.to_owned(),
            path: path.to_owned(),
            query: None,
            headers: BTreeMap::new(),
            body_bytes: 0,
            body: None,
            body_text: None,
        }
    }
}

/// Where a record keeps the conversation (messages and tools) its backend request carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConversationSource {
    /// In `backend_request` itself (every version 1 record; version 2 when the body had to be
    /// redacted, or the call never got that far).
    #[default]
    Recorded,
    /// Not stored twice: the record's harness body parsed by its wire API, with the system
    /// messages folded into one when `single_system_message` is among the normalizations.
    HarnessBody,
}

impl ConversationSource {
    pub fn is_recorded(&self) -> bool {
        *self == ConversationSource::Recorded
    }
}

/// One change the proxy made to the request on its way to the backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Normalization {
    /// A stable name, e.g. `model_override`, `dropped_tool_choice`.
    pub kind: String,
    /// What exactly changed.
    pub detail: String,
}

/// Inference engines tokentap can talk to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum BackendKind {
    Vllm,
    Sglang,
    Llamacpp,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Vllm => "vllm",
            BackendKind::Sglang => "sglang",
            BackendKind::Llamacpp => "llamacpp",
        }
    }
}

/// Which engine answered the call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct BackendInfo {
    pub kind: BackendKind,
    /// Base URL of the engine (without credentials).
    pub url: String,
    /// Model name the engine was asked for.
    pub model: String,
    /// The policy (weights) version serving the call, as configured on the proxy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<String>,
    /// The engine's own weight version, as the engine reported it around the call (vLLM's
    /// `GET /weight_info`; `tokentap proxy --engine-weight-version`): beside `policy_version`,
    /// which is what the trainer told tokentap, this is what the engine says it served.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_weight_version: Option<EngineWeightVersion>,
    /// True when the backend was called non-streaming and its answer replayed as a stream.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub synthetic_stream: bool,
}

/// The engine's weight version when tokentap sent the call and when its answer ended. They
/// differ when the weights changed while the call ran: its tokens may come from two policies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EngineWeightVersion {
    /// Read just before the call went to the engine (`None`: the engine did not say).
    pub at_start: Option<String>,
    /// Read once the answer ended: the weights that sampled its last tokens.
    pub at_end: Option<String>,
}

impl EngineWeightVersion {
    /// The weights changed while the call ran (both reads answered, and differ).
    pub fn straddles_update(&self) -> bool {
        matches!((&self.at_start, &self.at_end), (Some(a), Some(b)) if a != b)
    }
}

/// How a list of token ids was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TokenSource {
    /// Returned by the engine with the generation itself (vLLM `return_token_ids`, SGLang
    /// `meta_info`, llama.cpp chat logprobs `id`).
    EngineResponse,
    /// Rendered and tokenized by the same engine's own chat template and tokenizer
    /// (llama.cpp `/apply-template` + `/tokenize`) and checked against the engine's reported
    /// prompt token count.
    EngineTemplate,
    /// Built by tokentap (`--token-mode tito`: the earlier calls' ids and the new messages
    /// rendered) and sent to the engine as ids, its count checked against the engine's own.
    Tokentap,
    /// Not available; the ids field is absent and `gaps` says why.
    Unavailable,
}

/// Provenance of a record's token data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenProvenance {
    pub prompt: TokenSource,
    pub completion: TokenSource,
    /// Missing or doubtful token data, each with a reason. Never filled by re-tokenizing text.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gaps: Vec<TokenGap>,
}

/// A hole in a record's token data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TokenGap {
    pub field: TokenField,
    pub reason: String,
}

/// The token fields of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TokenField {
    PromptTokenIds,
    CompletionTokenIds,
    Logprobs,
}

/// Where the time of a call went, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Timings {
    /// From request arrival to the first content byte sent to the harness.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_first_token_ms: Option<f64>,
    /// From request arrival to the end of the call.
    pub total_ms: f64,
    /// Time spent waiting on the backend (request sent to last byte received).
    pub backend_ms: f64,
    /// `total_ms - backend_ms`: what the proxy itself added.
    pub proxy_overhead_ms: f64,
}

/// An error attached to a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CaptureError {
    pub kind: ErrorKind,
    pub message: String,
    /// The backend's HTTP status, when the backend answered with an error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend_status: Option<u16>,
}

/// Classes of failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The harness request was malformed or unsupported.
    InvalidRequest,
    /// The request body exceeded the configured limit.
    BodyTooLarge,
    /// The backend could not be reached.
    BackendUnavailable,
    /// The backend answered with an error status or an unparseable body.
    BackendError,
    /// The backend did not answer in time.
    BackendTimeout,
    /// The prompt did not fit the model's context.
    ContextLengthExceeded,
    /// The harness went away before the answer was complete.
    ClientDisconnected,
    /// A bug or I/O failure inside the proxy.
    Internal,
    /// An intercepted connection's TLS handshake failed (typically a client that pins its
    /// certificates or does not trust tokentap's CA).
    TlsHandshakeFailed,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request",
            ErrorKind::BodyTooLarge => "body_too_large",
            ErrorKind::BackendUnavailable => "backend_unavailable",
            ErrorKind::BackendError => "backend_error",
            ErrorKind::BackendTimeout => "backend_timeout",
            ErrorKind::ContextLengthExceeded => "context_length_exceeded",
            ErrorKind::ClientDisconnected => "client_disconnected",
            ErrorKind::Internal => "internal",
            ErrorKind::TlsHandshakeFailed => "tls_handshake_failed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ndjson;
    use serde_json::Value;

    /// Found by the Qwen Code over Messages end-to-end test: a harness that sends its body
    /// pretty-printed put raw line breaks into the record's line, and the spool reader saw a
    /// torn record.
    #[test]
    fn a_pretty_printed_body_stays_on_the_records_line_with_the_same_value() {
        let pretty = "{\r\n  \"model\": \"m\",\n  \"messages\": [\n    {\"role\": \"user\", \"content\": \"a\\nb\"}\n  ]\n}\n";
        let body = RawJson::from_json(pretty.to_owned()).unwrap();
        assert!(!body.get().contains(['\n', '\r']), "{}", body.get());
        let value: Value = serde_json::from_str(pretty).unwrap();
        assert_eq!(body.to_value(), value);
        // One line of NDJSON, read back as the same body.
        let mut request = HarnessRequest::bare("POST", "/v1/chat/completions");
        request.body = Some(body.clone());
        let mut line = Vec::new();
        ndjson::encode_line(&request, &mut line).unwrap();
        assert_eq!(line.iter().filter(|b| **b == b'\n').count(), 1);
        let back: HarnessRequest = ndjson::decode_line(&line).unwrap();
        assert_eq!(back.body, Some(body.clone()));
        // A record someone pretty-printed reads back on one line too, and as the same body.
        let shown = serde_json::to_string_pretty(&request).unwrap();
        let read: HarnessRequest = serde_json::from_str(&shown).unwrap();
        let read = read.body.unwrap();
        assert!(!read.get().contains(['\n', '\r']), "{}", read.get());
        assert_eq!(read, body);
        assert_ne!(read, RawJson::from_json("{}".to_owned()).unwrap());
        // Invalid JSON is still refused, line breaks or not.
        assert!(RawJson::from_json("{\"a\":\n}".to_owned()).is_err());
        assert!(RawJson::from_json("\"a\nb\"".to_owned()).is_err());
    }
}
