//! `--token-mode tito` on llama.cpp: tokentap builds each prompt's ids itself
//! (`tokentap_token_mode::Tito`: the conversation's earlier ids as the engine saw and sampled
//! them, then the new messages) and calls the engine's `/completion` with them; the answer's
//! text pieces are read back into content, reasoning and tool calls by
//! `tokentap_answer_parse`, streamed as they arrive, so the harness gets its wire API's
//! answer as from the chat endpoint.
//!
//! Every sampler is sent explicitly (llama-server's defaults are top-k 40, top-p 0.95, min-p
//! 0.05, which no harness asked for): the request's values, else the distribution itself
//! (temperature 1, no truncation). `n_probs: 1` returns each sampled token's logprob, and
//! `return_tokens` the sampled ids, the stop token included when the model sampled one.
//! The engine's count of the prompt it evaluated must equal the ids sent; otherwise the
//! record carries a gap, never the ids.

use std::sync::Arc;

use async_stream::try_stream;
use async_trait::async_trait;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokentap_answer_parse::{
    call_grammar, AnswerParser, Delta as AnswerDelta, Dialect, Family, ToolSchemas,
};
use tokentap_schema::{
    BackendKind, ChatMessage, ContentPart, FinishReason, Role, TokenIn, ToolCall, Usage,
};
use tokentap_token_mode::{Tito, TitoPrompt};

use super::answer_body;
use super::error::BackendError;
use super::interface::{Backend, CallMode, GenerationStream};
use super::openai_compat::EngineClient;
use crate::canonical::{
    ChatRequest, Delta, GenerationEvent, TokenField, TokenGap, TokenSource, ToolCallDelta,
};

pub struct TitoLlamaCppBackend {
    client: EngineClient,
    tito: Arc<Tito>,
}

impl TitoLlamaCppBackend {
    pub(crate) fn new(client: EngineClient, tito: Arc<Tito>) -> Self {
        TitoLlamaCppBackend { client, tito }
    }
}

/// `/completion`'s body: the ids, every sampler explicit, token data asked for, and the
/// grammar of the family's calls to the offered tools as llama-server's chat endpoint applies
/// it (lazy: from the call's opening marker on), unless the request says `tool_choice: none`.
pub(crate) fn completion_body(
    request: &ChatRequest,
    tools: &[Value],
    family: Family,
    ids: &[u32],
    stream: bool,
) -> Value {
    let s = &request.sampling;
    let mut body = json!({
        "prompt": ids,
        "stream": stream,
        "n_predict": s.max_tokens.map_or(-1, |n| n as i64),
        "return_tokens": true,
        "n_probs": 1,
        "cache_prompt": true,
        "temperature": s.temperature.unwrap_or(1.0),
        "top_p": s.top_p.unwrap_or(1.0),
        "top_k": s.top_k.unwrap_or(0),
        "min_p": s.min_p.unwrap_or(0.0),
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "presence_penalty": s.presence_penalty.unwrap_or(0.0),
        "frequency_penalty": s.frequency_penalty.unwrap_or(0.0),
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "mirostat": 0,
        "stop": s.stop,
    });
    if let Some(seed) = s.seed {
        body["seed"] = json!(seed);
    }
    let calls_allowed = request.tool_choice.as_ref().and_then(Value::as_str) != Some("none");
    if calls_allowed {
        if let Some(grammar) = call_grammar(family, tools) {
            if let (Value::Object(body), Value::Object(fields)) =
                (&mut body, grammar.completion_fields())
            {
                body.extend(fields);
            }
        }
    }
    body
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

/// One `/completion` answer, whole or one stream chunk (the fields tito reads).
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct CompletionChunk {
    pub content: String,
    pub tokens: Vec<u32>,
    pub completion_probabilities: Vec<TokenProb>,
    pub stop: bool,
    pub stop_type: Option<String>,
    pub tokens_evaluated: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(crate) struct TokenProb {
    pub id: Option<u32>,
    pub logprob: Option<f32>,
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

/// Folds `/completion` chunks into generation events for the harness and the record.
pub(crate) struct CompletionReader {
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

impl CompletionReader {
    /// `dialect` as the prompt leaves it (see [`answer_dialect`]).
    /// `tools`: the request's, as JSON ([`tools_json`]).
    pub(crate) fn new(dialect: Dialect, tools: &[Value], prompt: TitoPrompt) -> Self {
        CompletionReader {
            parser: AnswerParser::new(dialect, ToolSchemas::from_tools(tools)),
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

    /// The events one chunk settles; the last chunk (`stop`) ends the generation.
    pub(crate) fn chunk(&mut self, chunk: CompletionChunk) -> Vec<GenerationEvent> {
        let mut events = Vec::new();
        if !chunk.tokens.is_empty() {
            // Each entry is the sampled token's own (n_probs 1 lists it first); one that names
            // another id is no logprob of this token.
            let logprobs = chunk
                .tokens
                .iter()
                .enumerate()
                .map(|(i, id)| {
                    let p = chunk.completion_probabilities.get(i)?;
                    (p.id == Some(*id)).then_some(p.logprob).flatten()
                })
                .collect();
            self.sampled.extend_from_slice(&chunk.tokens);
            events.push(GenerationEvent::SampledTokens {
                ids: chunk.tokens,
                logprobs,
            });
        }
        let mut deltas = self.parser.push(&chunk.content);
        if chunk.stop {
            deltas.extend(self.parser.finish());
        }
        self.deltas(deltas, &mut events);
        if chunk.stop {
            let sent = self.prompt.ids.len();
            events.push(match chunk.tokens_evaluated {
                Some(n) if n as usize == sent => {
                    self.complete = true;
                    GenerationEvent::PromptTokens {
                        ids: self.prompt.ids.clone(),
                        source: TokenSource::Tokentap,
                    }
                }
                evaluated => GenerationEvent::Gap(TokenGap {
                    field: TokenField::PromptTokenIds,
                    reason: format!(
                        "tokentap sent {sent} prompt ids but the engine evaluated {}",
                        evaluated.map_or("an unreported number".into(), |n| n.to_string())
                    ),
                }),
            });
            let finish_reason = match chunk.stop_type.as_deref() {
                Some("limit") => FinishReason::Length,
                _ if self.calls > 0 => FinishReason::ToolCalls,
                _ => FinishReason::Stop,
            };
            let prompt_tokens = chunk.tokens_evaluated.unwrap_or(0);
            events.push(GenerationEvent::Finished {
                finish_reason,
                usage: Some(Usage {
                    prompt_tokens,
                    completion_tokens: self.sampled.len() as u64,
                    total_tokens: prompt_tokens + self.sampled.len() as u64,
                }),
            });
        }
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

fn decode_chunk(data: &[u8]) -> Result<CompletionChunk, BackendError> {
    serde_json::from_slice(data).map_err(|e| {
        BackendError::Protocol(format!(
            "unreadable /completion answer ({e}): {}",
            String::from_utf8_lossy(&data[..data.len().min(300)])
        ))
    })
}

#[async_trait]
impl Backend for TitoLlamaCppBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Llamacpp
    }

    fn url(&self) -> &str {
        self.client.shown()
    }

    // Tools and streaming together are fine: tokentap reads the calls itself.

    async fn count_prompt_tokens(&self, request: &ChatRequest) -> Result<u64, BackendError> {
        let tito = self.tito.clone();
        let owned = request.clone();
        let prompt = tokio::task::spawn_blocking(move || tito.prompt(&owned))
            .await
            .map_err(|e| BackendError::Protocol(format!("tito failed: {e}")))?;
        prompt
            .map(|p| p.ids.len() as u64)
            .map_err(|message| BackendError::Status {
                status: 400,
                message,
            })
    }

    async fn generate(
        &self,
        request: &ChatRequest,
        mode: CallMode,
    ) -> Result<GenerationStream, BackendError> {
        self.generate_call(request, mode, "").await
    }

    /// The prompt from tito, the answer read back; a complete answer is left with tito (before
    /// the harness gets its end, so its next call finds it) under `record_id`.
    async fn generate_call(
        &self,
        request: &ChatRequest,
        mode: CallMode,
        record_id: &str,
    ) -> Result<GenerationStream, BackendError> {
        // Rendering a long conversation takes milliseconds: not on this worker thread.
        let tito = self.tito.clone();
        let owned = request.clone();
        let prompt: TitoPrompt = tokio::task::spawn_blocking(move || tito.prompt(&owned))
            .await
            .map_err(|e| BackendError::Protocol(format!("tito failed: {e}")))?
            .map_err(|e| BackendError::Status {
                status: 400,
                message: format!("tokentap could not render this conversation with the model's chat template: {e}"),
            })?;
        let stream = mode == CallMode::Streaming;
        let family = self.tito.dialect().family;
        let tools = tools_json(request);
        let body = serde_json::to_vec(&completion_body(
            request,
            &tools,
            family,
            &prompt.ids,
            stream,
        ))
        .map_err(|e| BackendError::Protocol(e.to_string()))?;
        let answer = self.client.post_answer("/completion", body).await?;
        let token_in = TokenIn {
            continuation: prompt.continuation.clone(),
            origins: prompt.origins.clone(),
            build_us: prompt.build_us,
        };
        let sent = prompt.ids.len() as u64;
        let dialect = answer_dialect(&self.tito, &prompt.ids);
        let mut reader = CompletionReader::new(dialect, &tools, prompt);
        let idle = self.client.idle_timeout();
        let tito = self.tito.clone();
        let request = request.clone();
        let record_id = record_id.to_string();
        let keep = move |reader: &CompletionReader| {
            if let Some((prompt, sampled, answer)) = reader.answered() {
                let end = tito.sampled_end(sampled);
                tito.answered(&request, prompt, sampled, end, answer, &record_id);
            }
        };
        Ok(Box::pin(try_stream! {
            yield GenerationEvent::TokenIn(token_in);
            yield GenerationEvent::PromptSize(sent);
            if !stream {
                let whole = answer_body::read_whole(answer, idle).await?;
                let mut chunk = decode_chunk(&whole)?;
                chunk.stop = true;
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
                let chunk = decode_chunk(data.as_bytes())?;
                let last = chunk.stop;
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
        let props = self.client.get_json("/props").await.ok()?;
        props.get("model_path")?.as_str().map(str::to_owned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
    fn think_model_stream() -> Vec<CompletionChunk> {
        let chunk = |content: &str, id: u32| {
            serde_json::from_value(json!({"index": 0, "content": content, "tokens": [id], "stop": false,
                "tokens_predicted": 1, "tokens_evaluated": 9,
                "completion_probabilities": [{"id": id, "token": content, "logprob": -0.25, "top_logprobs": []}]}))
            .unwrap()
        };
        vec![
            chunk("<think>", 151667),
            chunk("Check", 3973),
            chunk("</think>", 151668),
            chunk("\n\n", 271),
            chunk("Done", 17453),
            chunk(".", 13),
            chunk("", 151645),
            serde_json::from_value(
                json!({"index": 0, "content": "", "tokens": [], "stop": true,
                "stop_type": "eos", "stopping_word": "", "tokens_evaluated": 9, "tokens_cached": 15,
                "tokens_predicted": 7}),
            )
            .unwrap(),
        ]
    }

    fn fold(
        reader: &mut CompletionReader,
        chunks: Vec<CompletionChunk>,
    ) -> crate::canonical::GenerationAccumulator {
        let mut acc = crate::canonical::GenerationAccumulator::default();
        for c in chunks {
            for e in reader.chunk(c) {
                acc.push(e);
            }
        }
        acc
    }

    #[test]
    fn a_streamed_answer_is_read_back_with_its_ids_and_logprobs() {
        let mut reader = CompletionReader::new(qwen3(), &[], prompt(vec![1; 9]));
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
        let mut reader = CompletionReader::new(qwen3(), &[], prompt(vec![1; 10]));
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
    fn a_tool_call_split_across_chunks_is_one_call_with_an_id() {
        let text = "<think>Check</think>\n\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call>";
        let mut chunks: Vec<CompletionChunk> = text
            .as_bytes()
            .chunks(5)
            .map(|c| CompletionChunk {
                content: String::from_utf8(c.to_vec()).unwrap(),
                ..Default::default()
            })
            .collect();
        chunks.push(CompletionChunk {
            stop: true,
            stop_type: Some("eos".into()),
            tokens_evaluated: Some(3),
            ..Default::default()
        });
        let tools = json!([{"name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]);
        let mut reader =
            CompletionReader::new(qwen3(), &tools_json(&request(tools)), prompt(vec![1, 2, 3]));
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
        let mut reader = CompletionReader::new(qwen3(), &[], prompt(vec![1]));
        let chunks = vec![
            CompletionChunk {
                content: "<think>Che".into(),
                tokens: vec![151667, 3973],
                ..Default::default()
            },
            CompletionChunk {
                stop: true,
                stop_type: Some("limit".into()),
                tokens_evaluated: Some(1),
                ..Default::default()
            },
        ];
        let acc = fold(&mut reader, chunks);
        assert_eq!(acc.finish.unwrap().0, FinishReason::Length);
        assert_eq!(acc.reasoning, "Che");
    }

    #[test]
    fn every_sampler_is_explicit() {
        let body = completion_body(&request(json!([])), &[], Family::Hermes, &[1, 2], true);
        for key in [
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "typical_p",
            "repeat_penalty",
            "dry_multiplier",
            "xtc_probability",
            "mirostat",
            "n_probs",
            "return_tokens",
        ] {
            assert!(body.get(key).is_some(), "{key} not sent");
        }
        assert_eq!(body["top_k"], 0);
        assert_eq!(body["prompt"], json!([1, 2]));
        assert!(body.get("grammar").is_none(), "no tools, no grammar");
    }

    #[test]
    fn offered_tools_bring_the_calls_grammar_unless_refused() {
        let tools = json!([{"name": "bash", "parameters": {"type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"]}}]);
        let with_tools = request(tools.clone());
        let body = completion_body(
            &with_tools,
            &tools_json(&with_tools),
            Family::Hermes,
            &[1],
            false,
        );
        let grammar = body["grammar"].as_str().unwrap();
        assert!(
            grammar.contains(r#""<tool_call>\n{\"name\": \"bash\", \"arguments\": ""#),
            "{grammar}"
        );
        assert_eq!(body["grammar_lazy"], true);
        assert_eq!(
            body["grammar_triggers"],
            json!([{"type": 1, "value": "<tool_call>"}])
        );
        let mut none = request(tools);
        none.tool_choice = Some(json!("none"));
        assert!(
            completion_body(&none, &tools_json(&none), Family::Hermes, &[1], false)
                .get("grammar")
                .is_none()
        );
    }
}
