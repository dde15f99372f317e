//! What the three engines share: they all speak OpenAI Chat Completions. This module posts the
//! request (serialized by `engine_request`), turns the (streamed or whole) answer (decoded by
//! `answer`) into generation events, and leaves where token data lives to each engine's
//! [`TokenDialect`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_stream::try_stream;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use serde_json::Value;

use super::answer::{self, decode, Answer, Choice, Ids, LogprobEntry, Message};
use super::answer_body::{self, AnswerBody};
use super::engine_request::{json_size_hint, to_bytes, EngineRequest, TokenParam};
use super::error::truncate;
use super::error::BackendError;
use super::http1_engine::Http1Engine;
use super::interface::{BackendConfig, CallMode, GenerationStream};
use tokentap_wire::canonical::{
    ChatRequest, Delta, FinishReason, GenerationEvent, TokenField, TokenGap, TokenSource,
    ToolCallDelta, Usage,
};

/// An HTTP client bound to one engine.
#[derive(Clone)]
pub(crate) struct EngineClient {
    http: reqwest::Client,
    base: String,
    /// `base` as records and logs show it: without a password in its userinfo.
    shown: String,
    api_key: Option<String>,
    idle_timeout: Duration,
    max_answer_bytes: usize,
    /// Chat answers of an `http://` engine, read in the task that relays them.
    http1: Option<Arc<Http1Engine>>,
}

impl EngineClient {
    pub(crate) fn new(config: &BackendConfig) -> Result<EngineClient, BackendError> {
        // rustls with ring; the system's and Mozilla's roots, plus `--ca-file`.
        let mut builder = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .read_timeout(config.idle_timeout)
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .no_proxy();
        for ca in &config.ca_roots {
            builder = builder.add_root_certificate(ca.clone());
        }
        let http = builder
            .build()
            .map_err(|e| BackendError::Unavailable(format!("building HTTP client: {e}")))?;
        Ok(EngineClient {
            http,
            base: config.base_url().to_owned(),
            shown: crate::redact::url(config.base_url()).into_owned(),
            api_key: config.api_key.clone(),
            idle_timeout: config.idle_timeout,
            max_answer_bytes: config.max_answer_bytes,
            http1: Http1Engine::for_engine(config).map(Arc::new),
        })
    }

    /// The engine's base URL as records and logs may show it (`base` has the credentials
    /// its requests are sent with).
    pub(crate) fn shown(&self) -> &str {
        &self.shown
    }

    /// The longest wait for the first byte and between two chunks of an answer.
    pub(crate) fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// POSTs a JSON body (already serialized) to `path`; a non-2xx answer becomes a classified
    /// [`BackendError`].
    pub(crate) async fn post(
        &self,
        path: &str,
        body: Vec<u8>,
    ) -> Result<reqwest::Response, BackendError> {
        let mut req = self
            .http
            .post(format!("{}{}", self.base, path))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(BackendError::from_reqwest)?;
        check_status(resp).await
    }

    /// POSTs a chat request and returns the answer's body as it arrives, ending in an error
    /// past `--max-answer-bytes` (`http://` engines through Pingora's client, HTTPS ones
    /// through reqwest).
    pub(crate) async fn post_answer(
        &self,
        path: &str,
        body: Vec<u8>,
    ) -> Result<AnswerBody, BackendError> {
        let answer = match &self.http1 {
            Some(http1) => http1.post(path, body).await?,
            None => answer_body::from_reqwest(self.post(path, body).await?),
        };
        Ok(answer_body::limited(answer, self.max_answer_bytes))
    }

    /// POSTs a JSON body and reads a JSON answer (the engines' side endpoints: `/tokenize`, ...).
    pub(crate) async fn post_json(&self, path: &str, body: Vec<u8>) -> Result<Value, BackendError> {
        let resp = self.post(path, body).await?;
        self.read_json(resp).await
    }

    pub(crate) async fn get_json(&self, path: &str) -> Result<Value, BackendError> {
        let mut req = self.http.get(format!("{}{}", self.base, path));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(BackendError::from_reqwest)?;
        self.read_json(check_status(resp).await?).await
    }

    /// A side endpoint's JSON answer, read to at most `--max-answer-bytes`.
    async fn read_json(&self, resp: reqwest::Response) -> Result<Value, BackendError> {
        let body = answer_body::limited(answer_body::from_reqwest(resp), self.max_answer_bytes);
        let body = answer_body::read_whole(body, self.idle_timeout).await?;
        // Worded as `reqwest::Response::json`'s error was.
        serde_json::from_slice(&body)
            .map_err(|e| BackendError::Protocol(format!("error decoding response body: {e}")))
    }
}

async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, BackendError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = answer_body::read_error_text(answer_body::from_reqwest(resp)).await;
    Err(BackendError::from_status(status.as_u16(), &body))
}

/// Where one engine puts token-level data.
pub(crate) trait TokenDialect: Send + Sync + 'static {
    /// The fields that make the engine return token ids and logprobs (they win over the
    /// request's own fields of the same name).
    fn request_token_data(&self, stream: bool) -> &'static [(&'static str, TokenParam)];

    /// Sampled ids and logprobs carried by one choice (of a whole answer or a stream chunk);
    /// takes them out of it.
    fn sampled_tokens(&self, choice: &mut Choice<'_>) -> Option<(Vec<u32>, Vec<Option<f32>>)>;

    /// Prompt ids carried by a whole answer or a stream chunk (whose first choice, taken out
    /// of it, is `choice`), if the engine puts them there; takes them out of it.
    fn prompt_tokens(
        &self,
        response: &mut Answer<'_>,
        choice: Option<&mut Choice<'_>>,
    ) -> Option<Vec<u32>>;

    /// Whether this engine reports prompt ids with the generation (else the adapter gets them
    /// some other way and no gap is reported here).
    fn reports_prompt_ids(&self) -> bool {
        true
    }

    /// The prompt's token count, when a stream chunk tells it before the prompt's ids (or
    /// without them).
    fn prompt_size(&self, _chunk: &Answer<'_>) -> Option<u64> {
        None
    }
}

/// The Chat Completions body for `request` (without any dialect's token-data fields), as the
/// JSON bytes the engine is sent: for the wire property tests and the fuzz targets. Bytes, not
/// a `Value`: a tool schema is passed through as the harness wrote it, and JSON allows numbers
/// (`1e400`) that a `Value` cannot hold.
pub fn chat_body(request: &ChatRequest, mode: CallMode) -> Vec<u8> {
    let body = EngineRequest {
        request,
        stream: mode == CallMode::Streaming,
        token_data: &[],
    };
    // Only strings, numbers, raw JSON and `Value`s go in, under string keys: it cannot fail.
    serde_json::to_vec(&body).expect("an engine request serializes")
}

/// Runs one chat completion against the engine and yields its generation events.
pub(crate) async fn generate<D: TokenDialect>(
    client: &EngineClient,
    dialect: D,
    request: &ChatRequest,
    mode: CallMode,
) -> Result<GenerationStream, BackendError> {
    let stream = mode == CallMode::Streaming;
    let body = to_bytes(
        &EngineRequest {
            request,
            stream,
            token_data: dialect.request_token_data(stream),
        },
        json_size_hint(request),
    )?;
    let answer = client.post_answer("/v1/chat/completions", body).await?;
    Ok(match mode {
        CallMode::Whole => whole_events(
            answer_body::read_whole(answer, client.idle_timeout),
            dialect,
        ),
        CallMode::Streaming => stream_events(answer, dialect, client.idle_timeout),
    })
}

/// The generation events of the whole answer `body` will be.
fn whole_events<D: TokenDialect>(
    body: impl Future<Output = Result<Bytes, BackendError>> + Send + 'static,
    dialect: D,
) -> GenerationStream {
    Box::pin(try_stream! {
        let body = body.await?;
        for event in whole_answer_events(&body, &dialect)? {
            yield event;
        }
    })
}

/// The generation events of a whole (non-streamed) answer `body`.
pub(crate) fn whole_answer_events<D: TokenDialect>(
    body: &[u8],
    dialect: &D,
) -> Result<Vec<GenerationEvent>, BackendError> {
    // Worded as `reqwest::Response::json`'s error was, when it parsed the answer.
    let mut answer: Answer = decode(body)
        .map_err(|e| BackendError::Protocol(format!("error decoding response body: {e}")))?;
    let Some(mut choice) = answer.choices.0.take() else {
        return Err(BackendError::Protocol(format!(
            "answer has no choices: {}",
            truncate(&compact_json(body), 300)
        )));
    };
    let mut events = Vec::new();
    let mut tracker = TokenTracker::default();
    if let Some(ids) = dialect.prompt_tokens(&mut answer, Some(&mut choice)) {
        tracker.prompt_seen = true;
        events.push(GenerationEvent::PromptTokens {
            ids,
            source: TokenSource::EngineResponse,
        });
    }
    let delta = parse_delta(std::mem::take(&mut choice.message), true);
    if let Some((ids, logprobs)) = dialect.sampled_tokens(&mut choice) {
        tracker.on_tokens(ids.len());
        events.push(GenerationEvent::Delta(delta));
        events.push(GenerationEvent::SampledTokens { ids, logprobs });
    } else {
        tracker.on_untokened_delta(&delta);
        events.push(GenerationEvent::Delta(delta));
    }
    let finish = choice.finish_reason.as_str().map(FinishReason::from_openai);
    let usage = parse_usage(&answer.usage);
    events.push(GenerationEvent::Finished {
        finish_reason: finish.unwrap_or(FinishReason::Stop),
        usage,
    });
    for gap in tracker.gaps(dialect.reports_prompt_ids(), usage) {
        events.push(GenerationEvent::Gap(gap));
    }
    Ok(events)
}

/// `json` as `serde_json::Value::to_string` writes it (for error messages, which quoted the
/// parsed answer when answers were parsed into a `Value`).
fn compact_json(json: &[u8]) -> String {
    serde_json::from_slice::<Value>(json)
        .map(|v| v.to_string())
        .unwrap_or_else(|_| String::from_utf8_lossy(json).into_owned())
}

/// The generation events of a streamed answer, read as SSE from the answer's body chunks.
pub(crate) fn stream_events<D: TokenDialect>(
    body: AnswerBody,
    dialect: D,
    idle: Duration,
) -> GenerationStream {
    Box::pin(try_stream! {
        // sse-stream reads each chunk once (a 60 KB first event with 10,000 prompt ids is
        // copied once into its data; eventsource-stream copied the rest of the buffer after
        // every line it parsed).
        let mut events = Box::pin(sse_stream::SseByteStream::new(body));
        let mut finish: Option<FinishReason> = None;
        let mut usage: Option<Usage> = None;
        let mut tracker = TokenTracker::default();
        loop {
            let next = tokio::time::timeout(idle, events.next()).await
                .map_err(|_| BackendError::Timeout(format!("no data from the backend for {idle:?}")))?;
            let Some(event) = next else { break };
            let event = event.map_err(|e| {
                // The client's read timeout fired mid-stream (the engine went quiet), or the
                // answer passed its limit.
                let read = match &e {
                    sse_stream::Error::Body(t) => t.downcast_ref::<std::io::Error>(),
                    _ => None,
                };
                read.and_then(|r| answer_body::timeout_or_limit(r, idle))
                    .unwrap_or_else(|| BackendError::Protocol(format!("reading the event stream: {e}")))
            })?;
            let data = event.data.as_deref().unwrap_or_default().trim();
            if data.is_empty() {
                continue;
            }
            if data == "[DONE]" {
                finish_body(events);
                break;
            }
            let mut chunk: Answer = decode(data.as_bytes()).map_err(|e| {
                BackendError::Protocol(format!("unparseable stream chunk ({e}): {}", truncate(data, 300)))
            })?;
            if let Some(err) = &chunk.error.0 {
                let status = err.code.0.unwrap_or(500) as u16;
                Err(BackendError::from_status(status, &compact_json(data.as_bytes())))?;
            }
            if let Some(u) = parse_usage(&chunk.usage) {
                usage = Some(u);
            }
            let mut choice = chunk.choices.0.take();
            if !tracker.prompt_size_told && !tracker.prompt_seen {
                if let Some(n) = dialect.prompt_size(&chunk) {
                    tracker.prompt_size_told = true;
                    yield GenerationEvent::PromptSize(n);
                }
            }
            if !tracker.prompt_seen {
                if let Some(ids) = dialect.prompt_tokens(&mut chunk, choice.as_mut()) {
                    tracker.prompt_seen = true;
                    yield GenerationEvent::PromptTokens { ids, source: TokenSource::EngineResponse };
                }
            }
            let Some(mut choice) = choice else { continue };
            let delta = parse_delta(std::mem::take(&mut choice.delta), false);
            let tokens = dialect.sampled_tokens(&mut choice);
            match &tokens {
                Some((ids, _)) => tracker.on_tokens(ids.len()),
                None => tracker.on_untokened_delta(&delta),
            }
            if !delta.is_empty() {
                yield GenerationEvent::Delta(delta);
            }
            if let Some((ids, logprobs)) = tokens {
                if !ids.is_empty() {
                    yield GenerationEvent::SampledTokens { ids, logprobs };
                }
            }
            if let Some(f) = choice.finish_reason.as_str() {
                finish = Some(FinishReason::from_openai(f));
            }
        }
        let Some(finish_reason) = finish else {
            Err(BackendError::Protocol("the backend stream ended without a finish_reason".into()))?;
            unreachable!()
        };
        yield GenerationEvent::Finished { finish_reason, usage };
        for gap in tracker.gaps(dialect.reports_prompt_ids(), usage) {
            yield GenerationEvent::Gap(gap);
        }
    })
}

/// Reads an answer's body past its `[DONE]` to the body's end, so that its kept-alive
/// connection goes back to the engine client's pool: a body dropped before its end takes its
/// connection with it, and the next call would open a new one (the reader of the events stops
/// at the terminal event, and never asks for the end). The end (a chunked body's last chunk)
/// has usually arrived with `[DONE]` and is read at once; otherwise a task waits for it, at most
/// [`DRAIN_AFTER_DONE`]: the generation is over, so nothing is cancelled by waiting.
fn finish_body<S>(mut events: std::pin::Pin<Box<S>>)
where
    S: futures::Stream + Send + 'static,
{
    if let Some(None) = events.next().now_or_never() {
        return;
    }
    tokio::spawn(async move {
        let drain = async { while events.next().await.is_some() {} };
        let _ = tokio::time::timeout(DRAIN_AFTER_DONE, drain).await;
    });
}

/// How long an answer's body is read after its `[DONE]` for the body's end (an engine that
/// keeps the body open past it loses the connection instead).
const DRAIN_AFTER_DONE: Duration = Duration::from_secs(1);

/// Notices token data the engine failed to send, so the record can say so.
#[derive(Default)]
struct TokenTracker {
    prompt_seen: bool,
    /// A `PromptSize` event went out.
    prompt_size_told: bool,
    sampled: usize,
    untokened_deltas: usize,
}

impl TokenTracker {
    fn on_tokens(&mut self, n: usize) {
        self.sampled += n;
    }

    fn on_untokened_delta(&mut self, d: &Delta) {
        if !d.is_empty() {
            self.untokened_deltas += 1;
        }
    }

    fn gaps(&self, expect_prompt: bool, usage: Option<Usage>) -> Vec<TokenGap> {
        let mut gaps = Vec::new();
        if expect_prompt && !self.prompt_seen {
            gaps.push(TokenGap {
                field: TokenField::PromptTokenIds,
                reason: "the engine returned no prompt token ids".into(),
            });
        }
        if self.untokened_deltas > 0 {
            gaps.push(TokenGap {
                field: TokenField::CompletionTokenIds,
                reason: format!(
                    "{} content fragment(s) arrived without token ids ({} ids received)",
                    self.untokened_deltas, self.sampled
                ),
            });
        }
        // The engine's own count is the check that no sampled token went unreported (llama.cpp,
        // for one, does not stream the end-of-turn token's id).
        if let Some(u) = usage {
            if self.sampled > 0 && u.completion_tokens != self.sampled as u64 {
                gaps.push(TokenGap {
                    field: TokenField::CompletionTokenIds,
                    reason: format!(
                        "the engine reported {} completion tokens but sent ids for {}",
                        u.completion_tokens, self.sampled
                    ),
                });
            }
        }
        gaps
    }
}

/// A whole answer's `message` (`whole`) or a stream chunk's `delta`.
pub(crate) fn parse_delta(m: Message<'_>, whole: bool) -> Delta {
    let tool_calls = m
        .tool_calls
        .0
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, c)| ToolCallDelta {
            // A whole message lists calls in order; stream deltas carry an index.
            index: if whole {
                i as u32
            } else {
                c.index.0.unwrap_or(i as u64) as u32
            },
            id: c.id.into_string(),
            name: c.function.name.into_string(),
            arguments: c.function.arguments.into_string(),
        })
        .collect();
    Delta {
        content: m.content.into_string(),
        reasoning: m
            .reasoning_content
            .into_string()
            .or_else(|| m.reasoning.into_string()),
        tool_calls,
    }
}

/// The counts of a `usage` object; `None` without a `prompt_tokens` count.
pub(crate) fn parse_usage(u: &answer::Usage) -> Option<Usage> {
    let prompt_tokens = u.prompt_tokens.0?;
    let completion_tokens = u.completion_tokens.0.unwrap_or(0);
    Some(Usage {
        prompt_tokens,
        completion_tokens,
        // Saturating: counts are the engine's word, and absurd ones must not panic.
        total_tokens: u
            .total_tokens
            .0
            .unwrap_or_else(|| prompt_tokens.saturating_add(completion_tokens)),
        reasoning_tokens: u.completion_tokens_details.reasoning_tokens.0,
    })
}

/// Token ids from a JSON array of integers; `None` unless every element is an id (an integer
/// that fits a `u32`: a larger one is never truncated into some other token's id).
pub(crate) fn id_array(v: Option<&Value>) -> Option<Vec<u32>> {
    answer::from_value::<Ids>(v?).0
}

/// Logprobs from OpenAI-style `logprobs.content[]` entries.
pub(crate) fn content_logprobs(entries: &[LogprobEntry<'_>]) -> Vec<Option<f32>> {
    entries
        .iter()
        .map(|e| e.logprob.0.map(|x| x as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Map};

    use super::answer::{from_value, Lenient};
    use super::*;
    use crate::backend::decode::whole as decode_whole;
    use crate::backend::llamacpp::LlamaCppDialect;
    use crate::backend::sglang::SglangDialect;
    use crate::backend::vllm::VllmDialect;
    use crate::backend::BackendKind;
    use tokentap_schema::RawJson;
    use tokentap_wire::canonical::{
        ChatMessage, ContentPart, Role, SamplingParams, ToolCall, ToolSpec,
    };

    /// Found by fuzz/fuzz_targets/openai_compat_chunk.rs: an id past `u32::MAX` was cast, so
    /// 15500000001954555 was recorded as token 4196569851.
    #[test]
    fn an_id_array_with_an_id_past_u32_is_no_ids_rather_than_truncated_ones() {
        let v = json!({"token_ids": [15500000001954555u64], "ok": [0, 4294967295u64]});
        assert_eq!(id_array(v.get("token_ids")), None);
        assert_eq!(id_array(v.get("ok")), Some(vec![0, u32::MAX]));
    }

    /// Seen while writing the fuzz target for usage: counts whose sum overflows a u64
    /// panicked (debug builds) or wrapped to a tiny total (release).
    #[test]
    fn a_usage_whose_counts_overflow_a_total_saturates() {
        let v = json!({"usage": {"prompt_tokens": u64::MAX, "completion_tokens": 2}});
        let u = parse_usage(&from_value::<Answer>(&v).usage).unwrap();
        assert_eq!(u.total_tokens, u64::MAX);
    }

    /// An id list decoded from bytes, and from the same JSON parsed into a `Value`.
    fn ids(json: &str) -> Option<Vec<u32>> {
        let from_bytes = decode::<Ids>(json.as_bytes()).expect("valid JSON").0;
        let v: Value = serde_json::from_str(json).unwrap();
        assert_eq!(from_value::<Ids>(&v).0, from_bytes, "{json}");
        from_bytes
    }

    #[test]
    fn an_id_list_is_every_element_a_u32_or_no_ids() {
        assert_eq!(ids("[0, 7, 4294967295]"), Some(vec![0, 7, u32::MAX]));
        assert_eq!(ids("[]"), Some(vec![]));
        for no_ids in [
            "[4294967296]",
            "[1, 4294967296, 2]",
            r#"[1, "2"]"#,
            "[1, [2]]",
            "[[1, 2]]",
            "[1, -1]",
            "[1, 2.0]",
            "[1, null]",
            r#"[1, {"id": 2}]"#,
            "[1e3]",
            r#""1, 2""#,
            r#"{"0": 1}"#,
            "7",
            "null",
        ] {
            assert_eq!(ids(no_ids), None, "{no_ids}");
        }
    }

    /// What today's decoders made of an answer whose fields have unexpected types: each such
    /// field reads as absent and the rest of the answer comes through.
    #[test]
    fn odd_typed_fields_read_as_absent_and_never_fail_the_answer() {
        let body = br#"{
            "choices": [{
                "message": {"content": 7, "reasoning_content": null, "reasoning": "why",
                    "tool_calls": [{"id": 3, "function": "f"}, "call", {"function": {"name": "g", "arguments": ["x"]}}]},
                "finish_reason": {"type": "length"},
                "token_ids": "13048 0",
                "logprobs": {"content": [{"logprob": "-0.5", "token": 13048}, 7]}
            }, "a second choice"],
            "usage": [9, 3, 12],
            "prompt_token_ids": {"ids": [1, 2]},
            "created": "yesterday"
        }"#;
        let events = decode_whole(BackendKind::Vllm, body).unwrap();
        let delta = Delta {
            content: None,
            reasoning: Some("why".into()),
            tool_calls: vec![
                ToolCallDelta {
                    index: 0,
                    ..Default::default()
                },
                ToolCallDelta {
                    index: 1,
                    ..Default::default()
                },
                ToolCallDelta {
                    index: 2,
                    name: Some("g".into()),
                    ..Default::default()
                },
            ],
        };
        assert_eq!(events[0], GenerationEvent::Delta(delta));
        assert_eq!(
            events[1],
            GenerationEvent::Finished {
                finish_reason: FinishReason::Stop,
                usage: None
            }
        );
        let gaps: Vec<_> = events[2..]
            .iter()
            .map(|e| match e {
                GenerationEvent::Gap(g) => g.field,
                other => panic!("expected gaps, got {other:?}"),
            })
            .collect();
        assert_eq!(
            gaps,
            [TokenField::PromptTokenIds, TokenField::CompletionTokenIds]
        );
        // `choices` of another type, or empty, is still no answer.
        for body in [
            &br#"{"choices": {"0": {}}}"#[..],
            br#"{"choices": []}"#,
            b"[1]",
        ] {
            let err = decode_whole(BackendKind::Vllm, body).unwrap_err();
            assert!(err.to_string().contains("answer has no choices"), "{err}");
        }
        // A choice of another type is an empty one.
        let events = decode_whole(BackendKind::Sglang, br#"{"choices": [null]}"#).unwrap();
        assert_eq!(events[0], GenerationEvent::Delta(Delta::default()));
    }

    #[test]
    fn a_repeated_key_means_its_last_value_as_in_a_parsed_value() {
        let body = br#"{"choices": [{"message": {"content": "a", "content": "b"}}],
            "usage": {"prompt_tokens": 1}, "usage": {"prompt_tokens": 2, "completion_tokens": 0}}"#;
        let events = decode_whole(BackendKind::Llamacpp, body).unwrap();
        assert_eq!(
            events[0],
            GenerationEvent::Delta(Delta {
                content: Some("b".into()),
                ..Default::default()
            })
        );
        assert!(matches!(
            events[1],
            GenerationEvent::Finished {
                usage: Some(Usage {
                    prompt_tokens: 2,
                    ..
                }),
                ..
            }
        ));
    }

    /// The fields the proxy never reads are still checked as a `Value` parse checked them.
    #[test]
    fn an_answer_that_is_not_json_is_a_protocol_error_even_in_unread_fields() {
        let bad: [&[u8]; 5] = [
            br#"{"choices": [{}], "created": 1e400}"#,
            br#"{"choices": [{}], "id": "\ud800"}"#,
            b"{\"choices\": [{}], \"id\": \"\xff\"}",
            br#"{"choices": [{}]} trailing"#,
            br#"{"choices": [{"message": {"content": "unterminated}}]}"#,
        ];
        for body in bad {
            let old = serde_json::from_slice::<Value>(body).unwrap_err();
            match decode_whole(BackendKind::Vllm, body) {
                Err(BackendError::Protocol(m)) => {
                    assert_eq!(m, format!("error decoding response body: {old}"))
                }
                other => panic!("{}: {other:?}", String::from_utf8_lossy(body)),
            }
        }
    }

    /// An `error` key in a stream chunk ends the stream whatever its value (`null` too), with
    /// its `code` as the status when it is an integer (else 500) and the chunk, re-serialized
    /// compactly as the `Value` it was parsed into, as the body.
    #[tokio::test]
    async fn an_error_in_a_stream_chunk_ends_the_stream_as_before() {
        use futures::StreamExt;
        let cases = [
            (r#"{"error": null}"#, 500),
            (
                r#"{"error": "boom", "choices": [{"delta": {"content": "x"}}]}"#,
                500,
            ),
            (
                r#"{"id": 1, "error": {"code": 404, "message": "no such model"}}"#,
                404,
            ),
            (
                r#"{"error": {"code": "404", "message": "a string code"}}"#,
                500,
            ),
            (r#"{"error": {"code": 70000}}"#, 70000u64 as u16),
            (
                r#"{"error": {"message": "This model's maximum context length is 8 tokens", "code": 400}}"#,
                400,
            ),
        ];
        for (chunk, status) in cases {
            let body = format!("data: {chunk}\n\ndata: [DONE]\n\n").into_bytes();
            let events: Vec<_> = crate::backend::decode::stream(BackendKind::Vllm, vec![body])
                .collect()
                .await;
            let reserialized = serde_json::from_str::<Value>(chunk).unwrap().to_string();
            let expected = BackendError::from_status(status, &reserialized);
            match events.as_slice() {
                [Err(e)] => assert_eq!(e.to_string(), expected.to_string(), "{chunk}"),
                other => panic!("{chunk}: {other:?}"),
            }
        }
    }

    /// The engine request as `chat_body` + `request_token_data` built it before it was
    /// serialized from the canonical request directly: the reference the new body must equal.
    fn map_built_body(request: &ChatRequest, mode: CallMode, kind: &str) -> Value {
        fn message_json(m: &ChatMessage) -> Value {
            let mut o = Map::new();
            o.insert("role".into(), json!(m.role.as_str()));
            let content = match m.content.as_slice() {
                [] if !m.content_was_string => Value::Null,
                [ContentPart::Text { text }] if m.content_was_string => json!(text),
                parts => Value::Array(
                    parts
                        .iter()
                        .map(|p| match p {
                            ContentPart::Text { text } => json!({"type": "text", "text": text}),
                            ContentPart::ImageUrl { url, detail } => {
                                let mut img = Map::new();
                                img.insert("url".into(), json!(url));
                                if let Some(d) = detail {
                                    img.insert("detail".into(), json!(d));
                                }
                                json!({"type": "image_url", "image_url": img})
                            }
                        })
                        .collect(),
                ),
            };
            o.insert("content".into(), content);
            if let Some(r) = &m.reasoning {
                o.insert("reasoning_content".into(), json!(r));
            }
            if !m.tool_calls.is_empty() {
                let calls = m
                    .tool_calls
                    .iter()
                    .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                    .collect();
                o.insert("tool_calls".into(), Value::Array(calls));
            }
            if let Some(id) = &m.tool_call_id {
                o.insert("tool_call_id".into(), json!(id));
            }
            if let Some(n) = &m.name {
                o.insert("name".into(), json!(n));
            }
            Value::Object(o)
        }

        let mut body = Map::new();
        body.insert("model".into(), json!(request.model));
        body.insert(
            "messages".into(),
            Value::Array(request.messages.iter().map(message_json).collect()),
        );
        if !request.tools.is_empty() {
            let tools = request
                .tools
                .iter()
                .map(|t| {
                    let mut f = Map::new();
                    f.insert("name".into(), json!(t.name));
                    if let Some(d) = &t.description {
                        f.insert("description".into(), json!(d));
                    }
                    if let Some(p) = &t.parameters {
                        f.insert("parameters".into(), p.to_value());
                    }
                    if let Some(s) = t.strict {
                        f.insert("strict".into(), json!(s));
                    }
                    json!({"type": "function", "function": f})
                })
                .collect();
            body.insert("tools".into(), Value::Array(tools));
        }
        if let Some(tc) = &request.tool_choice {
            body.insert("tool_choice".into(), tc.clone());
        }
        let s = &request.sampling;
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                body.insert(k.into(), v);
            }
        };
        put("temperature", s.temperature.map(|v| json!(v)));
        put("top_p", s.top_p.map(|v| json!(v)));
        put("top_k", s.top_k.map(|v| json!(v)));
        put("min_p", s.min_p.map(|v| json!(v)));
        put("max_tokens", s.max_tokens.map(|v| json!(v)));
        put("seed", s.seed.map(|v| json!(v)));
        put("presence_penalty", s.presence_penalty.map(|v| json!(v)));
        put("frequency_penalty", s.frequency_penalty.map(|v| json!(v)));
        if !s.stop.is_empty() {
            body.insert("stop".into(), json!(s.stop));
        }
        for (k, v) in &request.extra {
            body.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let stream = mode == CallMode::Streaming;
        body.insert("stream".into(), json!(stream));
        if stream {
            body.insert("stream_options".into(), json!({"include_usage": true}));
        }
        let mut set = |k: &str, v: Value| {
            body.insert(k.into(), v);
        };
        match kind {
            "vllm" => {
                set("logprobs", json!(true));
                set("top_logprobs", json!(0));
                set("return_token_ids", json!(true));
                set("return_tokens_as_token_ids", json!(true));
            }
            "sglang" => {
                set("logprobs", json!(true));
                set("top_logprobs", json!(0));
                if stream {
                    set("return_input_ids_in_sglext", json!(true));
                } else {
                    set("return_prompt_token_ids", json!(true));
                    set("return_meta_info", json!(true));
                }
            }
            "llamacpp" => {
                set("logprobs", json!(true));
                set("top_logprobs", json!(1));
                if stream {
                    set("return_progress", json!(true));
                }
            }
            _ => {}
        }
        Value::Object(body)
    }

    fn rich_request() -> ChatRequest {
        let mut assistant = ChatMessage::text(Role::Assistant, "");
        assistant.content.clear();
        assistant.content_was_string = false;
        assistant.reasoning = Some("The user wants \"weather\".\n".into());
        assistant.tool_calls = vec![ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Zürich"}"#.into(),
        }];
        let mut tool = ChatMessage::text(Role::Tool, "{\"temp\": 21.5}");
        tool.tool_call_id = Some("call_1".into());
        tool.name = Some("get_weather".into());
        let mut user = ChatMessage::text(Role::User, "");
        user.content = vec![
            ContentPart::Text {
                text: "What is in this picture? \u{1F600}".into(),
            },
            ContentPart::ImageUrl {
                url: "data:image/png;base64,iVBORw0KGgo=".into(),
                detail: Some("high".into()),
            },
            ContentPart::ImageUrl {
                url: "https://example.com/a.png".into(),
                detail: None,
            },
        ];
        user.content_was_string = false;
        let mut extra = Map::new();
        // Colliding with a sampling field, `stream`, `stream_options`, a token-data field and
        // `tools`: the proxy's own win. The rest pass through.
        extra.insert("temperature".into(), json!(2.0));
        extra.insert("stream".into(), json!("yes"));
        extra.insert("stream_options".into(), json!({"include_usage": false}));
        extra.insert("logprobs".into(), json!(false));
        extra.insert("top_logprobs".into(), json!(5));
        extra.insert("tools".into(), json!([]));
        extra.insert("response_format".into(), json!({"type": "json_object"}));
        extra.insert("parallel_tool_calls".into(), json!(false));
        extra.insert("reasoning_effort".into(), json!("high"));
        ChatRequest {
            model: "Qwen/Qwen3-0.6B".into(),
            messages: vec![
                ChatMessage::text(Role::System, "Be brief."),
                ChatMessage::text(Role::User, "Weather in Zürich?"),
                assistant,
                tool,
                user,
            ],
            tools: vec![
                ToolSpec {
                    name: "get_weather".into(),
                    description: Some("Current weather".into()),
                    parameters: Some(RawJson::from_value(
                        &json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                    )),
                    strict: Some(true),
                },
                ToolSpec {
                    name: "noop".into(),
                    description: None,
                    parameters: None,
                    strict: None,
                },
            ],
            tool_choice: Some(json!({"type": "function", "function": {"name": "get_weather"}})),
            sampling: SamplingParams {
                temperature: Some(0.7),
                top_p: Some(0.1 + 0.2),
                top_k: Some(-1),
                min_p: Some(1e-7),
                max_tokens: Some(4096),
                stop: vec!["</s>".into(), "\n\nUser:".into()],
                seed: Some(-42),
                presence_penalty: Some(0.0),
                frequency_penalty: Some(-0.5),
            },
            stream: true,
            extra,
        }
    }

    /// The top-level keys of a JSON object, repeats included (a `Value` would hide them).
    fn keys(json: &[u8]) -> Vec<String> {
        #[derive(Default)]
        struct Keys(Vec<String>);
        impl<'de> Lenient<'de> for Keys {
            fn map<A: serde::de::MapAccess<'de>>(mut map: A) -> Result<Self, A::Error> {
                let mut keys = Vec::new();
                while let Some(answer::Text(Some(k))) =
                    map.next_key_seed(answer::Seed::<answer::Text>::NEW)?
                {
                    keys.push(k.into_owned());
                    map.next_value_seed(answer::Seed::<answer::Skip>::NEW)?;
                }
                Ok(Keys(keys))
            }
        }
        decode::<Keys>(json).unwrap().0
    }

    #[test]
    fn the_engine_request_is_the_map_built_one_field_for_field() {
        let rich = rich_request();
        let mut plain = rich.clone();
        plain.tools.clear();
        plain.tool_choice = None;
        plain.sampling = SamplingParams::default();
        type TokenData = &'static [(&'static str, TokenParam)];
        let dialects: [(&str, &dyn Fn(bool) -> TokenData); 4] = [
            ("vllm", &|s| VllmDialect.request_token_data(s)),
            ("sglang", &|s| SglangDialect.request_token_data(s)),
            ("llamacpp", &|s| LlamaCppDialect.request_token_data(s)),
            ("none", &|_| &[]),
        ];
        for request in [&rich, &plain] {
            for mode in [CallMode::Streaming, CallMode::Whole] {
                for (kind, token_data) in &dialects {
                    let stream = mode == CallMode::Streaming;
                    let bytes = to_bytes(
                        &EngineRequest {
                            request,
                            stream,
                            token_data: token_data(stream),
                        },
                        json_size_hint(request),
                    )
                    .unwrap();
                    let new: Value = serde_json::from_slice(&bytes).unwrap();
                    assert_eq!(new, map_built_body(request, mode, kind), "{kind} {mode:?}");
                    // The buffer was big enough from the start (not grown and copied).
                    assert!(bytes.len() <= json_size_hint(request), "{}", bytes.len());
                    let keys = keys(&bytes);
                    let mut unique = keys.clone();
                    unique.sort();
                    unique.dedup();
                    assert_eq!(keys.len(), unique.len(), "a key twice: {keys:?}");
                    if *kind == "none" {
                        assert_eq!(chat_body(request, mode), bytes);
                    }
                }
            }
        }
        // Sampling values are written so they read back exactly.
        let new: Value = serde_json::from_slice(
            &to_bytes(
                &EngineRequest {
                    request: &rich,
                    stream: false,
                    token_data: &[],
                },
                0,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(new["top_p"].as_f64(), Some(0.1 + 0.2));
        assert_eq!(new["min_p"].as_f64(), Some(1e-7));
    }

    /// A tool schema holding a number JSON allows but no f64 holds (`1e400`) reaches the engine
    /// as the harness wrote it, and the engine body is Chat Completions that parses back to the
    /// same tools (the fuzzer found `chat_body` panicking on one).
    #[test]
    fn a_schema_number_no_f64_holds_passes_through_to_the_engine() {
        use tokentap_wire::chat_completions::ChatCompletions;
        use tokentap_wire::messages::Messages;
        use tokentap_wire::WireCodec;
        let body = br#"{"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"n": {"maximum": 1e400}}}}]}"#;
        let request = Messages.parse(body).unwrap().request;
        let engine = chat_body(&request, CallMode::Whole);
        assert!(
            String::from_utf8_lossy(&engine).contains(r#""maximum": 1e400"#),
            "{}",
            String::from_utf8_lossy(&engine)
        );
        let again = ChatCompletions.parse(&engine).unwrap().request;
        assert_eq!(again.tools, request.tools);
    }

    /// vLLM's `/tokenize` body: `model`, `messages` and `tools` as the engine request has them.
    #[test]
    fn the_tokenize_body_takes_the_engine_requests_fields() {
        use super::super::engine_request::TokenizeChat;
        let mut plain = rich_request();
        plain.tools.clear();
        for request in [&rich_request(), &plain] {
            let chat: Map<String, Value> =
                serde_json::from_slice(&chat_body(request, CallMode::Whole)).unwrap();
            let mut old = Map::new();
            for key in ["model", "messages", "tools"] {
                if let Some(v) = chat.get(key) {
                    old.insert(key.into(), v.clone());
                }
            }
            old.insert("add_generation_prompt".into(), json!(true));
            let new: Value =
                serde_json::from_slice(&to_bytes(&TokenizeChat::new(request), 0).unwrap()).unwrap();
            assert_eq!(new, Value::Object(old));
        }
    }
}
