//! SGLang's OpenAI-compatible server (`sglang/srt/entrypoints/openai/{protocol,serving_chat}.py`).
//!
//! Whole answers: `return_prompt_token_ids` puts `prompt_token_ids` on the choice and
//! `return_meta_info` puts the request's `meta_info` there, whose `output_token_logprobs` lists
//! `[logprob, token_id, text]` for each sampled token (with `logprobs: true`).
//! Streams: SGLang refuses those flags (and `return_token_ids`) with HTTP 400, and its chunks
//! carry logprobs without ids. Since sglang#34488, `return_input_ids_in_sglext` sends the
//! prompt ids once, in a trailing `choices: []` chunk's `sglext.input_ids`; the sampled ids can
//! follow there too (`sglext.output_ids`), but a choice-less chunk is out of the dialect's
//! reach, so they are not asked for and the shared code records the gap.
//! Talk to workers directly: SGLang's router may drop token metadata.

use async_trait::async_trait;
use serde_json::Value;

use super::answer::{Answer, Choice};
use super::engine_request::TokenParam;
use super::error::BackendError;
use super::interface::{Backend, CallMode, GenerationStream};
use super::openai_compat::{self, EngineClient, TokenDialect};
use tokentap_schema::BackendKind;
use tokentap_wire::canonical::ChatRequest;

pub struct SglangBackend {
    client: EngineClient,
}

impl SglangBackend {
    pub(crate) fn new(client: EngineClient) -> Self {
        SglangBackend { client }
    }
}

pub(crate) struct SglangDialect;

impl TokenDialect for SglangDialect {
    fn request_token_data(&self, stream: bool) -> &'static [(&'static str, TokenParam)] {
        if stream {
            &[
                ("logprobs", TokenParam::True),
                ("top_logprobs", TokenParam::Int(0)),
                ("return_input_ids_in_sglext", TokenParam::True),
            ]
        } else {
            &[
                ("logprobs", TokenParam::True),
                ("top_logprobs", TokenParam::Int(0)),
                ("return_prompt_token_ids", TokenParam::True),
                ("return_meta_info", TokenParam::True),
            ]
        }
    }

    fn sampled_tokens(&self, choice: &mut Choice<'_>) -> Option<(Vec<u32>, Vec<Option<f32>>)> {
        let entries = choice.meta_info.output_token_logprobs.0.as_deref()?;
        let mut ids = Vec::with_capacity(entries.len());
        let mut logprobs = Vec::with_capacity(entries.len());
        for e in entries {
            ids.push(u32::try_from(e.id.0?).ok()?);
            logprobs.push(e.logprob.0.map(|x| x as f32));
        }
        Some((ids, logprobs))
    }

    fn prompt_tokens(
        &self,
        response: &mut Answer<'_>,
        choice: Option<&mut Choice<'_>>,
    ) -> Option<Vec<u32>> {
        choice
            .and_then(|c| c.prompt_token_ids.0.take())
            .or_else(|| response.sglext.input_ids.0.take())
    }
}

#[async_trait]
impl Backend for SglangBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Sglang
    }

    fn url(&self) -> &str {
        self.client.shown()
    }

    fn call_mode(
        &self,
        _request: &ChatRequest,
        _wanted: CallMode,
    ) -> (CallMode, Option<&'static str>) {
        // SGLang's streamed chat chunks carry no sampled token ids (and drop the logprob of
        // steps without new text); a whole answer has them all in meta_info.
        (
            CallMode::Whole,
            Some("SGLang streams carry no sampled token ids"),
        )
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        openai_compat::generate(&self.client, SglangDialect, request, mode).await
    }

    async fn models(&self) -> Result<Value, BackendError> {
        self.client.get_json("/v1/models").await
    }
}
