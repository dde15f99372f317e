//! llama.cpp's `llama-server`.
//!
//! Sampled ids come with the chat completion itself: `logprobs.content[].id` (asking for
//! `top_logprobs: 1`, since 0 makes it send no logprobs at all). The chat answer carries no
//! prompt ids, so the adapter asks the same server, concurrently, to render the same request
//! with its own chat template (`/apply-template`) and tokenize it with its own tokenizer
//! (`/tokenize`), and keeps those ids only when their count matches the prompt size the engine
//! reported for the call; otherwise the record carries a gap, never a guess.

use async_stream::stream;
use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{json, Value};

use super::answer::{Answer, Choice};
use super::engine_request::{json_size_hint, to_bytes, EngineRequest, TokenParam};
use super::error::BackendError;
use super::interface::{probe_failure, Backend, CallMode, GenerationStream};
use super::openai_compat::{self, content_logprobs, EngineClient, TokenDialect};
use tokentap_schema::BackendKind;
use tokentap_wire::canonical::{ChatRequest, GenerationEvent, TokenField, TokenGap, TokenSource};
use tokentap_wire::normalize::ProbeOutcome;

pub struct LlamaCppBackend {
    client: EngineClient,
}

impl LlamaCppBackend {
    pub(crate) fn new(client: EngineClient) -> Self {
        LlamaCppBackend { client }
    }
}

pub(crate) struct LlamaCppDialect;

impl TokenDialect for LlamaCppDialect {
    /// Streamed calls also ask for prompt progress: its first event, sent before the prompt is
    /// processed, tells the prompt's token count (for answers that open with it, such as
    /// Anthropic's `message_start`), long before the final usage does.
    fn request_token_data(&self, stream: bool) -> &'static [(&'static str, TokenParam)] {
        if stream {
            &[
                ("logprobs", TokenParam::True),
                ("top_logprobs", TokenParam::Int(1)),
                ("return_progress", TokenParam::True),
            ]
        } else {
            &[
                ("logprobs", TokenParam::True),
                ("top_logprobs", TokenParam::Int(1)),
            ]
        }
    }

    fn prompt_size(&self, chunk: &Answer<'_>) -> Option<u64> {
        chunk.prompt_progress.total.0.filter(|&n| n > 0)
    }

    fn sampled_tokens(&self, choice: &mut Choice<'_>) -> Option<(Vec<u32>, Vec<Option<f32>>)> {
        let content = choice.logprobs.content.0.as_deref()?;
        let ids = content
            .iter()
            .map(|e| u32::try_from(e.id.0?).ok())
            .collect::<Option<Vec<u32>>>()?;
        Some((ids, content_logprobs(content)))
    }

    fn prompt_tokens(
        &self,
        _response: &mut Answer<'_>,
        _choice: Option<&mut Choice<'_>>,
    ) -> Option<Vec<u32>> {
        None
    }

    fn reports_prompt_ids(&self) -> bool {
        false
    }
}

/// The request as the server's `/apply-template` takes it: the chat request, unstreamed.
fn template_body(request: &ChatRequest) -> Result<Vec<u8>, BackendError> {
    to_bytes(
        &EngineRequest {
            request,
            stream: false,
            token_data: &[],
        },
        json_size_hint(request),
    )
}

/// Renders and tokenizes the request with the server's own template and tokenizer.
async fn template_prompt_ids(
    client: EngineClient,
    body: Vec<u8>,
) -> Result<Vec<u32>, BackendError> {
    let rendered = client.post_json("/apply-template", body).await?;
    let prompt = rendered
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            BackendError::Protocol("/apply-template answered without `prompt`".into())
        })?;
    let tokenize = json!({"content": prompt, "add_special": true, "parse_special": true});
    let tokens = client
        .post_json("/tokenize", to_bytes(&tokenize, prompt.len() + 64)?)
        .await?;
    openai_compat::id_array(tokens.get("tokens"))
        .ok_or_else(|| BackendError::Protocol("/tokenize answered without integer `tokens`".into()))
}

#[async_trait]
impl Backend for LlamaCppBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Llamacpp
    }

    fn url(&self) -> &str {
        self.client.shown()
    }

    fn call_mode(
        &self,
        request: &ChatRequest,
        wanted: CallMode,
    ) -> (CallMode, Option<&'static str>) {
        if wanted == CallMode::Streaming && !request.tools.is_empty() {
            // llama-server rejects `logprobs` with tools + stream; a whole answer keeps the ids.
            (
                CallMode::Whole,
                Some("llama.cpp returns no logprobs for streamed calls with tools"),
            )
        } else {
            (wanted, None)
        }
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        let prompt_ids = tokio::spawn(template_prompt_ids(
            self.client.clone(),
            template_body(request)?,
        ));
        let mut inner =
            openai_compat::generate(&self.client, LlamaCppDialect, request, mode).await?;
        Ok(Box::pin(stream! {
            let mut reported_prompt = None;
            while let Some(event) = inner.next().await {
                if let Ok(GenerationEvent::Finished { usage, .. }) = &event {
                    reported_prompt = usage.map(|u| u.prompt_tokens);
                }
                let failed = event.is_err();
                yield event;
                if failed {
                    return;
                }
            }
            let outcome = prompt_ids.await.map_err(|e| BackendError::Protocol(e.to_string())).and_then(|r| r);
            yield Ok(verified_prompt(outcome, reported_prompt));
        }))
    }

    async fn probe_template(&self, probe: &ChatRequest) -> ProbeOutcome {
        let answer = match template_body(probe) {
            Ok(body) => self.client.post_json("/apply-template", body).await,
            Err(e) => Err(e),
        };
        match answer {
            Ok(v) => match v.get("prompt").and_then(Value::as_str) {
                Some(p) => ProbeOutcome::Rendered(p.to_owned()),
                None => ProbeOutcome::Unreachable,
            },
            Err(e) => probe_failure(e),
        }
    }

    async fn count_prompt_tokens(
        &self,
        request: &ChatRequest,
        _session: Option<&str>,
    ) -> Result<u64, BackendError> {
        let body = template_body(request)?;
        Ok(template_prompt_ids(self.client.clone(), body).await?.len() as u64)
    }

    async fn models(&self) -> Result<Value, BackendError> {
        self.client.get_json("/v1/models").await
    }

    async fn model_file(&self) -> Option<String> {
        let props = self.client.get_json("/props").await.ok()?;
        props.get("model_path")?.as_str().map(str::to_owned)
    }
}

/// Keeps template ids only when they match the engine's own count for this call.
fn verified_prompt(ids: Result<Vec<u32>, BackendError>, reported: Option<u64>) -> GenerationEvent {
    let gap = |reason: String| {
        GenerationEvent::Gap(TokenGap {
            field: TokenField::PromptTokenIds,
            reason,
        })
    };
    match (ids, reported) {
        (Err(e), _) => gap(format!("could not render the prompt with the engine's template: {e}")),
        (Ok(_), None) => gap("the engine reported no prompt size to verify the template ids against".into()),
        (Ok(ids), Some(n)) if ids.len() as u64 == n => {
            GenerationEvent::PromptTokens { ids, source: TokenSource::EngineTemplate }
        }
        (Ok(ids), Some(n)) => gap(format!(
            "the engine's template rendered {} prompt ids but the engine reported {n} prompt tokens",
            ids.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::answer::from_value;

    #[test]
    fn sampled_ids_and_logprobs_come_from_chat_logprobs() {
        let choice = json!({"logprobs": {"content": [
            {"id": 28, "token": "a", "logprob": -0.5, "top_logprobs": []},
            {"id": 2, "token": "", "logprob": -1.25, "top_logprobs": []}
        ]}});
        let (ids, lps) = LlamaCppDialect
            .sampled_tokens(&mut from_value(&choice))
            .unwrap();
        assert_eq!(ids, vec![28, 2]);
        assert_eq!(lps, vec![Some(-0.5), Some(-1.25)]);
    }

    #[test]
    fn a_logprob_entry_without_an_id_gives_no_ids_rather_than_a_guess() {
        let choice = json!({"logprobs": {"content": [{"token": "a", "logprob": -0.5}]}});
        assert!(LlamaCppDialect
            .sampled_tokens(&mut from_value(&choice))
            .is_none());
    }

    /// Found by fuzzing (fuzz/fuzz_targets/openai_compat_chunk.rs, the same cast in
    /// `id_array`): an id past `u32::MAX` was truncated into another token's id.
    #[test]
    fn a_logprob_entry_with_an_id_past_u32_gives_no_ids_rather_than_a_truncated_one() {
        let choice = json!({"logprobs": {"content": [
            {"id": 4294967296u64, "token": "a", "logprob": -0.5, "top_logprobs": []}
        ]}});
        assert!(LlamaCppDialect
            .sampled_tokens(&mut from_value(&choice))
            .is_none());
    }

    /// llama-server's streamed chat chunks with `return_progress`: progress chunks (the role
    /// delta) before the first token, each telling the prompt's size.
    #[tokio::test]
    async fn a_stream_tells_the_prompts_size_from_its_first_progress_chunk() {
        assert!(LlamaCppDialect
            .request_token_data(true)
            .iter()
            .any(|(k, _)| *k == "return_progress"));
        assert!(!LlamaCppDialect
            .request_token_data(false)
            .iter()
            .any(|(k, _)| *k == "return_progress"));
        let progress = |processed: u64| {
            format!(
                "data: {}\n\n",
                json!({"choices": [{"finish_reason": null, "index": 0, "delta": {"role": "assistant", "content": null}}],
                       "object": "chat.completion.chunk", "id": "c", "model": "m", "created": 1,
                       "prompt_progress": {"total": 12, "cache": 0, "processed": processed, "time_ms": 0}})
            )
        };
        let token = format!(
            "data: {}\n\n",
            json!({"choices": [{"finish_reason": null, "index": 0, "delta": {"content": "a"},
                   "logprobs": {"content": [{"id": 28, "token": "a", "logprob": -0.5, "top_logprobs": []}]}}],
                   "object": "chat.completion.chunk", "id": "c", "model": "m", "created": 1})
        );
        let end = format!(
            "data: {}\n\ndata: [DONE]\n\n",
            json!({"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
                   "object": "chat.completion.chunk", "id": "c", "model": "m", "created": 1,
                   "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}})
        );
        let chunks = [progress(0), progress(12), token, end];
        let body =
            futures::stream::iter(chunks.map(|c| Ok::<_, std::io::Error>(bytes::Bytes::from(c))));
        let events: Vec<GenerationEvent> = openai_compat::stream_events(
            Box::pin(body),
            LlamaCppDialect,
            std::time::Duration::from_secs(60),
        )
        .map(|e| e.unwrap())
        .collect()
        .await;
        assert_eq!(events[0], GenerationEvent::PromptSize(12), "{events:?}");
        assert_eq!(
            events
                .iter()
                .filter(|e| matches!(e, GenerationEvent::PromptSize(_)))
                .count(),
            1,
            "told once: {events:?}"
        );
        assert!(matches!(events[1], GenerationEvent::Delta(_)), "{events:?}");
    }

    #[test]
    fn template_ids_are_kept_only_when_the_count_matches() {
        let ok = verified_prompt(Ok(vec![1, 2, 3]), Some(3));
        assert_eq!(
            ok,
            GenerationEvent::PromptTokens {
                ids: vec![1, 2, 3],
                source: TokenSource::EngineTemplate
            }
        );
        match verified_prompt(Ok(vec![1, 2, 3]), Some(4)) {
            GenerationEvent::Gap(g) => {
                assert_eq!(g.field, TokenField::PromptTokenIds);
                assert!(
                    g.reason.contains("3 prompt ids") && g.reason.contains("4 prompt tokens"),
                    "{}",
                    g.reason
                );
            }
            other => panic!("expected a gap, got {other:?}"),
        }
        assert!(matches!(
            verified_prompt(Ok(vec![1]), None),
            GenerationEvent::Gap(_)
        ));
        assert!(matches!(
            verified_prompt(Err(BackendError::Timeout("x".into())), Some(1)),
            GenerationEvent::Gap(_)
        ));
    }
}
