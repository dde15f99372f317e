//! `--token-mode tito`: tokentap builds each prompt's ids itself
//! (`tokentap_token_mode::Tito`: the conversation's earlier ids as the engine saw and sampled
//! them, then the new messages) and calls the engine's ids-in endpoint with them; the answer's
//! text pieces are read back into content, reasoning and tool calls by
//! `tokentap_answer_parse`, streamed as they arrive, so the harness gets its wire API's
//! answer as from the chat endpoint.
//!
//! One [`TitoBackend`] drives every engine; each engine module ([`llamacpp`], [`vllm`],
//! [`sglang`]) only writes its request and reads its answer into [`IdsChunk`]s. Every sampler
//! is sent explicitly (the engines' own defaults are not what a chat call gets). The engine's
//! own account of the prompt (the ids it echoes, else the count it evaluated) must equal the
//! ids sent; otherwise the record carries a gap, never the ids, and nothing is kept for the
//! session's next call.

mod ids;
mod llamacpp;
mod sglang;
mod vllm;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use async_stream::try_stream;
use async_trait::async_trait;
use futures::StreamExt;
use serde_json::Value;
use tokentap_answer_parse::{AnswerParser, Delta as AnswerDelta, Dialect, ToolSchemas};
use tokentap_schema::{
    BackendKind, ChatMessage, ContentPart, FinishReason, Role, TitoVerify, TokenIn, ToolCall, Usage,
};
use tokentap_token_mode::{Tito, TitoPrompt, TokenVerify};

use super::answer_body;
use super::error::BackendError;
use super::interface::{Backend, CallMode, CallScope, GenerationStream};
use super::openai_compat::EngineClient;
use tokentap_wire::canonical::{
    ChatRequest, Delta, GenerationEvent, TokenField, TokenGap, TokenSource, ToolCallDelta,
};

pub(crate) use ids::{tools_json, IdsCall, IdsChunk, IdsDecoder, IdsEngine, PromptAccount};
pub(crate) use llamacpp::LlamaCppIds;
pub(crate) use sglang::SglangIds;
pub(crate) use vllm::VllmIds;

/// `--token-mode tito` on one engine.
pub(crate) struct TitoBackend<E: IdsEngine> {
    client: EngineClient,
    tito: Arc<Tito>,
    engine: E,
    /// The model's context length (`/v1/models`' `max_model_len`), asked once.
    context: tokio::sync::OnceCell<u64>,
    /// `--token-verify`, and the calls it has been asked about.
    verify: TokenVerify,
    calls: AtomicU64,
    /// Prompts being built at once (each renders and tokenizes a whole request on a blocking
    /// thread): at most one per core and one more, so concurrent large requests queue
    /// instead of each holding its render in memory at the same time.
    builds: Arc<tokio::sync::Semaphore>,
}

/// How long a prompt may take to build before its call is answered with an error (the work
/// itself still holds its place in [`TitoBackend::builds`] until it ends). Rendering and
/// tokenizing are linear in the request, which the body limit bounds: a prompt of the largest
/// body takes well under a second.
const PROMPT_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl<E: IdsEngine> TitoBackend<E> {
    pub(crate) fn new(
        client: EngineClient,
        tito: Arc<Tito>,
        engine: E,
        verify: TokenVerify,
    ) -> Self {
        TitoBackend {
            client,
            tito,
            engine,
            context: tokio::sync::OnceCell::new(),
            verify,
            calls: AtomicU64::new(0),
            builds: Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get() + 1),
            )),
        }
    }

    /// The prompt from tito for a call of `session`, and its shadow full render when
    /// `--token-verify` picks the call: rendering a long conversation takes milliseconds, so
    /// not on this worker thread, and never more of them at once than
    /// [`TitoBackend::builds`] allows, nor longer than [`PROMPT_DEADLINE`].
    async fn prompt(
        &self,
        session: Option<&str>,
        request: &ChatRequest,
        verify: bool,
    ) -> Result<Result<(TitoPrompt, Option<TitoVerify>), String>, BackendError> {
        let tito = self.tito.clone();
        let owned = request.clone();
        let session = session.map(str::to_owned);
        let built = async {
            let permit = self
                .builds
                .clone()
                .acquire_owned()
                .await
                .map_err(|e| BackendError::Protocol(format!("tito failed: {e}")))?;
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                build_prompt(&tito, session.as_deref(), &owned, verify)
            })
            .await
            .map_err(|e| BackendError::Protocol(format!("tito failed: {e}")))
        };
        match tokio::time::timeout(PROMPT_DEADLINE, built).await {
            Ok(r) => r,
            Err(_) => Ok(Err(format!(
                "building this call's prompt took over {PROMPT_DEADLINE:?}; the request is too large for tito"
            ))),
        }
    }

    /// The call's own limit; else, for engines whose default is short, the rest of the context.
    async fn max_tokens(
        &self,
        request: &ChatRequest,
        prompt: usize,
    ) -> Result<Option<u64>, BackendError> {
        if let Some(n) = request.sampling.max_tokens {
            return Ok(Some(n));
        }
        if !E::NEEDS_AN_EXPLICIT_LIMIT {
            return Ok(None);
        }
        let context = *self
            .context
            .get_or_try_init(|| async {
                let models = self.client.get_json("/v1/models").await?;
                models["data"][0]["max_model_len"].as_u64().ok_or_else(|| {
                    BackendError::Protocol(
                        "the engine's /v1/models names no max_model_len, so tokentap cannot tell how long an answer may be; set max_tokens on the call".into(),
                    )
                })
            })
            .await?;
        match context.saturating_sub(prompt as u64) {
            // Its own kind, so each wire API answers as harnesses recognise (and compact).
            0 => Err(BackendError::ContextLengthExceeded {
                message: format!(
                    "This model's maximum context length is {context} tokens. However, this conversation's prompt is {prompt} tokens. Please reduce the length of the messages."
                ),
            }),
            left => Ok(Some(left)),
        }
    }
}

/// The prompt for a call of `session`, and its shadow full render when `verify`.
fn build_prompt(
    tito: &Tito,
    session: Option<&str>,
    request: &ChatRequest,
    verify: bool,
) -> Result<(TitoPrompt, Option<TitoVerify>), String> {
    let prompt = tito.prompt(session, request)?;
    let verdict = if verify {
        tokentap_token_mode::verify(tito.model(), request, &prompt.ids, &prompt.origins)
            .map_err(|e| tracing::debug!(error = %e, "--token-verify: no full render"))
            .ok()
    } else {
        None
    };
    Ok((prompt, verdict))
}

/// How to read the answer to `prompt`: the model's dialect, starting inside the reasoning if
/// the generation prompt opened a `<think>` block (Qwen3 thinking models).
pub(crate) fn answer_dialect(tito: &Tito, prompt: &[u32]) -> Dialect {
    let dialect = tito.dialect();
    if !dialect.reasoning {
        return dialect;
    }
    dialect.with_reasoning_after(&tito.model().text(&prompt[prompt.len().saturating_sub(8)..]))
}

/// Folds an answer's [`IdsChunk`]s into generation events for the harness and the record.
pub(crate) struct AnswerReader {
    parser: AnswerParser,
    prompt: TitoPrompt,
    sampled: Vec<u32>,
    calls: u32,
    call_prefix: String,
    /// The answer as the harness gets it: what the next call's conversation must hold.
    answer: ChatMessage,
    /// The engine evaluated exactly the ids sent, and the answer ended.
    complete: bool,
}

impl AnswerReader {
    /// `dialect` as the prompt leaves it (see [`answer_dialect`]).
    /// `tools`: the request's, as JSON ([`tools_json`]).
    /// `keep_space_after_reasoning`: the engine's convention ([`IdsEngine::KEEPS_SPACE_AFTER_REASONING`]).
    pub(crate) fn new(
        dialect: Dialect,
        tools: &[Value],
        prompt: TitoPrompt,
        keep_space_after_reasoning: bool,
    ) -> Self {
        AnswerReader {
            parser: AnswerParser::new(dialect, ToolSchemas::from_tools(tools))
                .keeping_space_after_reasoning(keep_space_after_reasoning),
            prompt,
            sampled: Vec::new(),
            calls: 0,
            call_prefix: format!("call_{}", uuid::Uuid::now_v7().simple()),
            answer: ChatMessage::text(Role::Assistant, ""),
            complete: false,
        }
    }

    /// Once the answer ended with the engine's count of the prompt checked: the conversation,
    /// ids and answer for [`Tito::answered`].
    pub(crate) fn answered(&self) -> Option<(&TitoPrompt, &[u32], &ChatMessage)> {
        self.complete
            .then_some((&self.prompt, &self.sampled[..], &self.answer))
    }

    /// The events one chunk settles; the one with its end ends the generation.
    pub(crate) fn chunk(&mut self, chunk: IdsChunk) -> Vec<GenerationEvent> {
        let mut events = Vec::new();
        if !chunk.tokens.is_empty() {
            self.sampled.extend_from_slice(&chunk.tokens);
            events.push(GenerationEvent::SampledTokens {
                ids: chunk.tokens,
                logprobs: chunk.logprobs,
            });
        }
        let mut deltas = self.parser.push(&chunk.text);
        if chunk.end.is_some() {
            deltas.extend(self.parser.finish());
        }
        self.deltas(deltas, &mut events);
        let Some(end) = chunk.end else {
            return events;
        };
        let sent = self.prompt.ids.len() as u64;
        let prompt_tokens = match end.prompt.mismatch(&self.prompt.ids) {
            None => {
                self.complete = true;
                events.push(GenerationEvent::PromptTokens {
                    ids: self.prompt.ids.clone(),
                    source: TokenSource::Tokentap,
                });
                sent
            }
            Some(reason) => {
                events.push(GenerationEvent::Gap(TokenGap {
                    field: TokenField::PromptTokenIds,
                    reason,
                }));
                match end.prompt {
                    PromptAccount::Echoed(ids) => ids.len() as u64,
                    PromptAccount::Evaluated(n) => n,
                    PromptAccount::Unreported => 0,
                }
            }
        };
        let finish_reason = match end.finish {
            FinishReason::Stop if self.calls > 0 => FinishReason::ToolCalls,
            other => other,
        };
        let completion_tokens = self.sampled.len() as u64;
        events.push(GenerationEvent::Finished {
            finish_reason,
            usage: Some(Usage {
                prompt_tokens,
                completion_tokens,
                total_tokens: prompt_tokens + completion_tokens,
                // The engine's own count is of its parser's split; tito's answer is parsed here.
                reasoning_tokens: None,
            }),
        });
        events
    }

    fn deltas(&mut self, deltas: Vec<AnswerDelta>, events: &mut Vec<GenerationEvent>) {
        for d in deltas {
            let delta = match d {
                AnswerDelta::Content(text) => {
                    match self.answer.content.first_mut() {
                        Some(ContentPart::Text { text: all }) => all.push_str(&text),
                        _ => self.answer.content = vec![ContentPart::Text { text: text.clone() }],
                    }
                    Delta {
                        content: Some(text),
                        ..Default::default()
                    }
                }
                AnswerDelta::Reasoning(text) => {
                    self.answer
                        .reasoning
                        .get_or_insert_with(String::new)
                        .push_str(&text);
                    Delta {
                        reasoning: Some(text),
                        ..Default::default()
                    }
                }
                AnswerDelta::ToolCall(call) => {
                    let index = self.calls;
                    self.calls += 1;
                    let id = format!("{}_{index}", self.call_prefix);
                    self.answer.tool_calls.push(ToolCall {
                        id: id.clone(),
                        name: call.name.clone(),
                        arguments: call.arguments.clone(),
                    });
                    Delta {
                        tool_calls: vec![ToolCallDelta {
                            index,
                            id: Some(id),
                            name: Some(call.name),
                            arguments: Some(call.arguments),
                        }],
                        ..Default::default()
                    }
                }
            };
            events.push(GenerationEvent::Delta(delta));
        }
    }
}

#[async_trait]
impl<E: IdsEngine> Backend for TitoBackend<E> {
    fn kind(&self) -> BackendKind {
        E::KIND
    }

    fn url(&self) -> &str {
        self.client.shown()
    }

    // Tools and streaming together are fine: tokentap reads the calls itself.

    async fn count_prompt_tokens(
        &self,
        request: &ChatRequest,
        session: Option<&str>,
    ) -> Result<u64, BackendError> {
        self.prompt(session, request, false)
            .await?
            .map(|(p, _)| p.ids.len() as u64)
            .map_err(BackendError::Refused)
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        self.generate_call(request, mode, CallScope::default())
            .await
    }

    /// The prompt from tito, the answer read back; a complete answer is left with tito in the
    /// call's session (before the harness gets its end, so its next call finds it) under its
    /// record id.
    async fn generate_call(
        &self,
        request: &ChatRequest,
        mode: CallMode,
        call: CallScope<'_>,
    ) -> Result<GenerationStream, BackendError> {
        let verify = self.verify.picks(&self.calls);
        let (prompt, verdict) = self
            .prompt(call.session, request, verify)
            .await?
            .map_err(|e| {
                BackendError::Refused(format!(
                    "tokentap could not render this conversation with the model's chat template: {e}"
                ))
            })?;
        let stream = mode == CallMode::Streaming;
        let tools = tools_json(request);
        let max_tokens = self.max_tokens(request, prompt.ids.len()).await?;
        // The engine's body (llama.cpp's holds the call grammar of the tools, which grows with
        // their schemas, within bounds) off this worker thread and within a deadline, so no
        // request stalls the runtime; tools past the grammar's bounds are refused with a 400.
        const BODY_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
        let (engine, family) = (self.engine.clone(), self.tito.dialect().family);
        let (parts, ids) = (ids::body_request(request), prompt.ids.clone());
        let built = tokio::task::spawn_blocking(move || {
            let call = IdsCall {
                request: &parts,
                tools: &tools,
                family,
                ids: &ids,
                stream,
                max_tokens,
            };
            let body = engine.body(&call).map(|b| serde_json::to_vec(&b));
            (body, tools)
        });
        let (body, tools) = tokio::time::timeout(BODY_DEADLINE, built)
            .await
            .map_err(|_| BackendError::Refused(format!("tokentap refuses this call: building the engine's request (its tools' call grammar) took over {BODY_DEADLINE:?}")))?
            .map_err(|e| BackendError::Protocol(format!("tito failed: {e}")))?;
        let body = body
            .map_err(BackendError::Refused)?
            .map_err(|e| BackendError::Protocol(e.to_string()))?;
        let answer = self.client.post_answer(E::PATH, body).await?;
        if let Some(v) = verdict.as_ref().filter(|v| v.boundary_spans > 0) {
            tracing::warn!(
                boundary_spans = v.boundary_spans,
                examples = ?v.examples,
                "--token-verify: tito wrote the template's frame other than the full render does"
            );
        }
        let token_in = TokenIn {
            continuation: prompt.continuation.clone(),
            origins: prompt.origins.clone(),
            build_us: prompt.build_us,
            verify: verdict,
        };
        let sent = prompt.ids.len() as u64;
        let dialect = answer_dialect(&self.tito, &prompt.ids);
        let mut reader = AnswerReader::new(dialect, &tools, prompt, E::KEEPS_SPACE_AFTER_REASONING);
        let mut decoder = self.engine.decoder();
        let idle = self.client.idle_timeout();
        let tito = self.tito.clone();
        let request = request.clone();
        let record_id = call.record_id.to_string();
        let session = call.session.map(str::to_owned);
        let keep = move |reader: &AnswerReader| {
            if let Some((prompt, sampled, answer)) = reader.answered() {
                let end = tito.sampled_end(sampled);
                tito.answered(
                    session.as_deref(),
                    &request,
                    prompt,
                    sampled,
                    end,
                    answer,
                    &record_id,
                );
            }
        };
        Ok(Box::pin(try_stream! {
            yield GenerationEvent::TokenIn(token_in);
            yield GenerationEvent::PromptSize(sent);
            if !stream {
                let whole = answer_body::read_whole(answer, idle).await?;
                let chunk = decoder.whole(&whole)?;
                if chunk.end.is_none() {
                    Err(BackendError::Protocol("the engine's answer says nothing of how it ended".into()))?;
                }
                let events = reader.chunk(chunk);
                keep(&reader);
                for event in events {
                    yield event;
                }
                return;
            }
            let mut events = Box::pin(sse_stream::SseByteStream::new(answer));
            loop {
                let next = tokio::time::timeout(idle, events.next()).await
                    .map_err(|_| BackendError::Timeout(format!("no data from the backend for {idle:?}")))?;
                let Some(event) = next else {
                    Err(BackendError::Protocol("the engine ended the stream before its last chunk".into()))?;
                    return;
                };
                let event = event.map_err(|e| BackendError::Protocol(format!("reading the event stream: {e}")))?;
                let data = event.data.as_deref().unwrap_or_default().trim();
                if data.is_empty() {
                    continue;
                }
                let Some(chunk) = decoder.event(data.as_bytes())? else {
                    continue;
                };
                let last = chunk.end.is_some();
                let events = reader.chunk(chunk);
                if last {
                    keep(&reader);
                }
                for event in events {
                    yield event;
                }
                if last {
                    return;
                }
            }
        }))
    }

    async fn models(&self) -> Result<Value, BackendError> {
        self.client.get_json("/v1/models").await
    }

    async fn model_file(&self) -> Option<String> {
        if !E::NAMES_ITS_MODEL_FILE {
            return None;
        }
        let props = self.client.get_json("/props").await.ok()?;
        props.get("model_path")?.as_str().map(str::to_owned)
    }
}

#[cfg(test)]
mod tests {
    use super::ids::IdsEnd;
    use super::*;
    use serde_json::json;
    use tokentap_answer_parse::Family;
    use tokentap_schema::{TitoBranchCause, TitoContinuation};

    fn prompt(ids: Vec<u32>) -> TitoPrompt {
        TitoPrompt::new(
            ids,
            Vec::new(),
            TitoContinuation::Branch {
                cause: TitoBranchCause::First,
                detail: None,
            },
        )
    }

    fn qwen3() -> Dialect {
        Dialect::new(Family::Hermes).with_reasoning_after("<|im_start|>assistant\n")
    }

    fn request(tools: serde_json::Value) -> ChatRequest {
        serde_json::from_value(json!({"model": "m", "messages": [], "tools": tools})).unwrap()
    }

    /// llama-server's streamed `/completion` chunks for the tiny think model's final answer,
    /// as it sent them (return_tokens, n_probs 1), the last with the stop and the counts.
    fn think_model_stream() -> Vec<IdsChunk> {
        let chunk = |content: &str, id: u32| {
            json!({"index": 0, "content": content, "tokens": [id], "stop": false,
                "tokens_predicted": 1, "tokens_evaluated": 9,
                "completion_probabilities": [{"id": id, "token": content, "logprob": -0.25, "top_logprobs": []}]})
        };
        let events = [
            chunk("<think>", 151667),
            chunk("Check", 3973),
            chunk("</think>", 151668),
            chunk("\n\n", 271),
            chunk("Done", 17453),
            chunk(".", 13),
            chunk("", 151645),
            json!({"index": 0, "content": "", "tokens": [], "stop": true,
                "stop_type": "eos", "stopping_word": "", "tokens_evaluated": 9, "tokens_cached": 15,
                "tokens_predicted": 7}),
        ];
        let mut decoder = LlamaCppIds.decoder();
        events
            .iter()
            .map(|e| decoder.event(e.to_string().as_bytes()).unwrap().unwrap())
            .collect()
    }

    fn fold(
        reader: &mut AnswerReader,
        chunks: Vec<IdsChunk>,
    ) -> tokentap_wire::canonical::GenerationAccumulator {
        let mut acc = tokentap_wire::canonical::GenerationAccumulator::default();
        for c in chunks {
            for e in reader.chunk(c) {
                acc.push(e);
            }
        }
        acc
    }

    fn end(finish: FinishReason, prompt: PromptAccount) -> IdsChunk {
        IdsChunk {
            end: Some(IdsEnd { finish, prompt }),
            ..Default::default()
        }
    }

    #[test]
    fn a_streamed_answer_is_read_back_with_its_ids_and_logprobs() {
        let mut reader = AnswerReader::new(qwen3(), &[], prompt(vec![1; 9]), false);
        let acc = fold(&mut reader, think_model_stream());
        assert_eq!(
            (acc.reasoning.as_str(), acc.content.as_str()),
            ("Check", "Done.")
        );
        assert_eq!(
            acc.completion_ids,
            vec![151667, 3973, 151668, 271, 17453, 13, 151645]
        );
        assert!(acc.logprobs.iter().all(|l| *l == Some(-0.25)));
        assert_eq!(acc.prompt, Some((vec![1; 9], TokenSource::Tokentap)));
        let (reason, usage) = acc.finish.unwrap();
        assert_eq!(reason, FinishReason::Stop);
        assert_eq!(usage.unwrap().completion_tokens, 7);
        let (_, sampled, answer) = reader.answered().expect("complete");
        assert_eq!(sampled.len(), 7);
        assert_eq!(answer.reasoning.as_deref(), Some("Check"));
    }

    #[test]
    fn a_prompt_count_that_differs_from_what_was_sent_is_a_gap_not_ids() {
        // The control: 9 sent, 9 evaluated (above). Here 10 were sent.
        let mut reader = AnswerReader::new(qwen3(), &[], prompt(vec![1; 10]), false);
        let acc = fold(&mut reader, think_model_stream());
        assert_eq!(acc.prompt, None);
        assert!(
            acc.gaps
                .iter()
                .any(|g| g.field == TokenField::PromptTokenIds
                    && g.reason
                        .contains("sent 10 prompt ids but the engine evaluated 9")),
            "{:?}",
            acc.gaps
        );
        assert!(
            reader.answered().is_none(),
            "nothing kept for the next call"
        );
    }

    #[test]
    fn echoed_prompt_ids_must_be_the_ids_sent() {
        let ok = PromptAccount::Echoed(vec![1, 2, 3]);
        assert_eq!(ok.mismatch(&[1, 2, 3]), None);
        let mut reader = AnswerReader::new(qwen3(), &[], prompt(vec![1, 2, 3]), false);
        let acc = fold(
            &mut reader,
            vec![end(
                FinishReason::Stop,
                PromptAccount::Echoed(vec![1, 9, 3]),
            )],
        );
        assert_eq!(acc.prompt, None);
        assert_eq!(
            acc.gaps[0].reason,
            "tokentap sent 3 prompt ids but the engine echoed 3 that differ from position 1"
        );
        assert!(reader.answered().is_none());
    }

    #[test]
    fn a_tool_call_split_across_chunks_is_one_call_with_an_id() {
        let text = "<think>Check</think>\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call>";
        let mut chunks: Vec<IdsChunk> = text
            .as_bytes()
            .chunks(5)
            .map(|c| IdsChunk {
                text: String::from_utf8(c.to_vec()).unwrap(),
                ..Default::default()
            })
            .collect();
        chunks.push(end(FinishReason::Stop, PromptAccount::Evaluated(3)));
        let tools = json!([{"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]);
        let mut reader = AnswerReader::new(
            qwen3(),
            &tools_json(&request(tools)),
            prompt(vec![1, 2, 3]),
            false,
        );
        let acc = fold(&mut reader, chunks);
        assert_eq!(acc.tool_calls.len(), 1);
        assert_eq!(acc.tool_calls[0].name, "bash");
        assert_eq!(acc.tool_calls[0].arguments, "{\"command\": \"pwd\"}");
        assert!(acc.tool_calls[0].id.starts_with("call_"));
        assert_eq!(acc.finish.unwrap().0, FinishReason::ToolCalls);
        assert_eq!(acc.content, "");
    }

    #[test]
    fn the_limit_is_a_length_finish() {
        let mut reader = AnswerReader::new(qwen3(), &[], prompt(vec![1]), false);
        let chunks = vec![
            IdsChunk {
                text: "<think>Che".into(),
                tokens: vec![151667, 3973],
                logprobs: vec![None, None],
                end: None,
            },
            end(FinishReason::Length, PromptAccount::Evaluated(1)),
        ];
        let acc = fold(&mut reader, chunks);
        assert_eq!(acc.finish.unwrap().0, FinishReason::Length);
        assert_eq!(acc.reasoning, "Che");
    }
}
