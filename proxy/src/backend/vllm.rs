//! vLLM's OpenAI-compatible server
//! (`vllm/entrypoints/openai/chat_completion/{protocol,serving}.py`).
//!
//! `return_token_ids` puts `prompt_token_ids` at the top level of the answer (of the first chunk
//! only, when streaming) and `token_ids` on each choice (the chunk's own ids, when streaming).
//! `logprobs` with `top_logprobs: 0` gives `logprobs.content[].logprob` for the sampled token
//! only. `return_tokens_as_token_ids` also spells each logprob token as `token_id:<id>`, the
//! only id source on servers older than `return_token_ids` (v0.10.2).

use async_trait::async_trait;
use serde_json::Value;

use super::answer::{Answer, Choice, LogprobEntry};
use super::engine_request::{json_size_hint, to_bytes, TokenParam, TokenizeChat};
use super::error::BackendError;
use super::interface::{probe_failure, Backend, CallMode, GenerationStream};
use super::openai_compat::{self, EngineClient, TokenDialect};
use tokentap_schema::BackendKind;
use tokentap_wire::canonical::ChatRequest;
use tokentap_wire::normalize::ProbeOutcome;

pub struct VllmBackend {
    client: EngineClient,
}

impl VllmBackend {
    pub(crate) fn new(client: EngineClient) -> Self {
        VllmBackend { client }
    }

    /// `POST /tokenize` with chat messages: the served template applied, then tokenized.
    async fn tokenize_chat(&self, request: &ChatRequest) -> Result<Value, BackendError> {
        let body = to_bytes(&TokenizeChat::new(request), json_size_hint(request))?;
        self.client.post_json("/tokenize", body).await
    }
}

pub(crate) struct VllmDialect;

/// vLLM writes this when it has no logprob for the sampled token, and clamps lower values to it.
pub(crate) const NO_LOGPROB: f64 = -9999.0;

impl TokenDialect for VllmDialect {
    fn request_token_data(&self, _stream: bool) -> &'static [(&'static str, TokenParam)] {
        &[
            ("logprobs", TokenParam::True),
            ("top_logprobs", TokenParam::Int(0)),
            ("return_token_ids", TokenParam::True),
            ("return_tokens_as_token_ids", TokenParam::True),
        ]
    }

    fn sampled_tokens(&self, choice: &mut Choice<'_>) -> Option<(Vec<u32>, Vec<Option<f32>>)> {
        let entries = choice.logprobs.content.0.as_deref();
        let ids = choice
            .token_ids
            .0
            .take()
            .or_else(|| entries.and_then(placeholder_ids))?;
        let logprobs = match entries {
            // Both come from the same output in vLLM; pair them only when they line up.
            Some(e) if e.len() == ids.len() => e.iter().map(entry_logprob).collect(),
            _ => vec![None; ids.len()],
        };
        Some((ids, logprobs))
    }

    fn prompt_tokens(
        &self,
        response: &mut Answer<'_>,
        _choice: Option<&mut Choice<'_>>,
    ) -> Option<Vec<u32>> {
        response.prompt_token_ids.0.take()
    }
}

/// Ids spelled `token_id:<id>` by `return_tokens_as_token_ids`; `None` unless every entry is
/// (an empty list proves nothing either).
fn placeholder_ids(entries: &[LogprobEntry<'_>]) -> Option<Vec<u32>> {
    if entries.is_empty() {
        return None;
    }
    entries
        .iter()
        .map(|e| e.token.as_str()?.strip_prefix("token_id:")?.parse().ok())
        .collect()
}

fn entry_logprob(entry: &LogprobEntry<'_>) -> Option<f32> {
    let lp = entry.logprob.0?;
    (lp > NO_LOGPROB).then_some(lp as f32)
}

#[async_trait]
impl Backend for VllmBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Vllm
    }

    fn url(&self) -> &str {
        self.client.shown()
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        openai_compat::generate(&self.client, VllmDialect, request, mode).await
    }

    /// vLLM's `POST /tokenize` renders chat messages with the served template and counts them.
    async fn count_prompt_tokens(
        &self,
        request: &ChatRequest,
        _session: Option<&str>,
    ) -> Result<u64, BackendError> {
        let answer = self.tokenize_chat(request).await?;
        answer
            .get("count")
            .and_then(Value::as_u64)
            .ok_or_else(|| BackendError::Protocol("/tokenize answered without `count`".into()))
    }

    /// `/tokenize` shows no text, only whether the template took the probe.
    async fn probe_template(&self, probe: &ChatRequest) -> ProbeOutcome {
        match self.tokenize_chat(probe).await {
            Ok(_) => ProbeOutcome::Accepted,
            Err(e) => probe_failure(e),
        }
    }

    async fn models(&self) -> Result<Value, BackendError> {
        self.client.get_json("/v1/models").await
    }
}
