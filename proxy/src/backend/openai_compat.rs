//! What the three engines share: they all speak OpenAI Chat Completions. This module builds
//! the request body, posts it, decodes the (streamed or whole) answer into generation events,
//! and leaves where token data lives to each engine's [`TokenDialect`].

use std::time::Duration;

use async_stream::try_stream;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::{json, Map, Value};

use super::error::truncate;
use super::error::BackendError;
use super::interface::{BackendConfig, CallMode, GenerationStream};
use crate::canonical::{
    ChatMessage, ChatRequest, ContentPart, Delta, FinishReason, GenerationEvent, TokenField,
    TokenGap, TokenSource, ToolCallDelta, Usage,
};

/// An HTTP client bound to one engine.
#[derive(Clone)]
pub(crate) struct EngineClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    idle_timeout: Duration,
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
        let base = config.url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base).to_owned();
        Ok(EngineClient {
            http,
            base,
            api_key: config.api_key.clone(),
            idle_timeout: config.idle_timeout,
        })
    }

    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// POSTs JSON to `path`; a non-2xx answer becomes a classified [`BackendError`].
    pub(crate) async fn post(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<reqwest::Response, BackendError> {
        let mut req = self.http.post(format!("{}{}", self.base, path)).json(body);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(BackendError::from_reqwest)?;
        check_status(resp).await
    }

    pub(crate) async fn post_json(&self, path: &str, body: &Value) -> Result<Value, BackendError> {
        let resp = self.post(path, body).await?;
        resp.json().await.map_err(BackendError::from_reqwest)
    }

    pub(crate) async fn get_json(&self, path: &str) -> Result<Value, BackendError> {
        let mut req = self.http.get(format!("{}{}", self.base, path));
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key);
        }
        let resp = req.send().await.map_err(BackendError::from_reqwest)?;
        check_status(resp)
            .await?
            .json()
            .await
            .map_err(BackendError::from_reqwest)
    }
}

async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, BackendError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = resp.text().await.unwrap_or_default();
    Err(BackendError::from_status(status.as_u16(), &body))
}

/// Where one engine puts token-level data.
pub(crate) trait TokenDialect: Send + Sync + 'static {
    /// Adds the fields that make the engine return token ids and logprobs.
    fn request_token_data(&self, body: &mut Map<String, Value>);

    /// Sampled ids and logprobs carried by one choice (of a whole answer or a stream chunk).
    fn sampled_tokens(&self, choice: &Value) -> Option<(Vec<u32>, Vec<Option<f32>>)>;

    /// Prompt ids carried by a whole answer or a stream chunk, if the engine puts them there.
    fn prompt_tokens(&self, response: &Value, choice: Option<&Value>) -> Option<Vec<u32>>;

    /// Whether this engine reports prompt ids with the generation (else the adapter gets them
    /// some other way and no gap is reported here).
    fn reports_prompt_ids(&self) -> bool {
        true
    }
}

/// The Chat Completions body for `request`.
pub fn chat_body(request: &ChatRequest, mode: CallMode) -> Map<String, Value> {
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
                    f.insert("parameters".into(), p.clone());
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
    body
}

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

/// Runs one chat completion against the engine and yields its generation events.
pub(crate) async fn generate<D: TokenDialect>(
    client: &EngineClient,
    dialect: D,
    request: &ChatRequest,
    mode: CallMode,
) -> Result<GenerationStream, BackendError> {
    let mut body = chat_body(request, mode);
    dialect.request_token_data(&mut body);
    let resp = client
        .post("/v1/chat/completions", &Value::Object(body))
        .await?;
    Ok(match mode {
        CallMode::Whole => whole_events(resp, dialect),
        CallMode::Streaming => stream_events(resp.bytes_stream(), dialect, client.idle_timeout),
    })
}

fn whole_events<D: TokenDialect>(resp: reqwest::Response, dialect: D) -> GenerationStream {
    Box::pin(try_stream! {
        let v: Value = resp.json().await.map_err(BackendError::from_reqwest)?;
        for event in whole_answer_events(&v, &dialect)? {
            yield event;
        }
    })
}

/// The generation events of a whole (non-streamed) answer.
pub(crate) fn whole_answer_events<D: TokenDialect>(
    v: &Value,
    dialect: &D,
) -> Result<Vec<GenerationEvent>, BackendError> {
    let mut events = Vec::new();
    let choice = first_choice(v)?;
    let message = choice.get("message").cloned().unwrap_or(Value::Null);
    let mut tracker = TokenTracker::default();
    if let Some(ids) = dialect.prompt_tokens(v, Some(choice)) {
        tracker.prompt_seen = true;
        events.push(GenerationEvent::PromptTokens {
            ids,
            source: TokenSource::EngineResponse,
        });
    }
    let delta = parse_delta(&message, true);
    if let Some((ids, logprobs)) = dialect.sampled_tokens(choice) {
        tracker.on_tokens(ids.len());
        events.push(GenerationEvent::Delta(delta));
        events.push(GenerationEvent::SampledTokens { ids, logprobs });
    } else {
        tracker.on_untokened_delta(&delta);
        events.push(GenerationEvent::Delta(delta));
    }
    let finish = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .map(FinishReason::from_openai);
    events.push(GenerationEvent::Finished {
        finish_reason: finish.unwrap_or(FinishReason::Stop),
        usage: parse_usage(v),
    });
    for gap in tracker.gaps(dialect.reports_prompt_ids(), parse_usage(v)) {
        events.push(GenerationEvent::Gap(gap));
    }
    Ok(events)
}

/// The generation events of a streamed answer, read as SSE from the answer's body chunks.
pub(crate) fn stream_events<D, S>(body: S, dialect: D, idle: Duration) -> GenerationStream
where
    D: TokenDialect,
    S: futures::Stream<Item = Result<bytes::Bytes, reqwest::Error>> + Send + 'static,
{
    Box::pin(try_stream! {
        let mut events = std::pin::pin!(body.eventsource());
        let mut finish: Option<FinishReason> = None;
        let mut usage: Option<Usage> = None;
        let mut tracker = TokenTracker::default();
        loop {
            let next = tokio::time::timeout(idle, events.next()).await
                .map_err(|_| BackendError::Timeout(format!("no data from the backend for {idle:?}")))?;
            let Some(event) = next else { break };
            let event = event.map_err(|e| match e {
                // The client's read timeout fired mid-stream: the engine went quiet.
                eventsource_stream::EventStreamError::Transport(t) if t.is_timeout() => {
                    BackendError::Timeout(format!("no data from the backend for {idle:?}: {t}"))
                }
                e => BackendError::Protocol(format!("reading the event stream: {e}")),
            })?;
            let data = event.data.trim();
            if data.is_empty() {
                continue;
            }
            if data == "[DONE]" {
                break;
            }
            let chunk: Value = serde_json::from_str(data).map_err(|e| {
                BackendError::Protocol(format!("unparseable stream chunk ({e}): {}", truncate(data, 300)))
            })?;
            if let Some(err) = chunk.get("error") {
                let status = err.get("code").and_then(Value::as_u64).unwrap_or(500) as u16;
                Err(BackendError::from_status(status, &chunk.to_string()))?;
            }
            if let Some(u) = parse_usage(&chunk) {
                usage = Some(u);
            }
            let choice = chunk.get("choices").and_then(|c| c.get(0));
            if !tracker.prompt_seen {
                if let Some(ids) = dialect.prompt_tokens(&chunk, choice) {
                    tracker.prompt_seen = true;
                    yield GenerationEvent::PromptTokens { ids, source: TokenSource::EngineResponse };
                }
            }
            let Some(choice) = choice else { continue };
            let delta = choice.get("delta").map(|d| parse_delta(d, false)).unwrap_or_default();
            let tokens = dialect.sampled_tokens(choice);
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
            if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
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

/// Notices token data the engine failed to send, so the record can say so.
#[derive(Default)]
struct TokenTracker {
    prompt_seen: bool,
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

fn first_choice(v: &Value) -> Result<&Value, BackendError> {
    v.get("choices").and_then(|c| c.get(0)).ok_or_else(|| {
        BackendError::Protocol(format!(
            "answer has no choices: {}",
            truncate(&v.to_string(), 300)
        ))
    })
}

/// Parses a `message` (whole answer) or `delta` (stream chunk) object.
pub(crate) fn parse_delta(v: &Value, whole: bool) -> Delta {
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    let tool_calls = v
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    let f = c.get("function");
                    let fs = |k: &str| {
                        f.and_then(|f| f.get(k))
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    };
                    ToolCallDelta {
                        // A whole message lists calls in order; stream deltas carry an index.
                        index: if whole {
                            i as u32
                        } else {
                            c.get("index").and_then(Value::as_u64).unwrap_or(i as u64) as u32
                        },
                        id: c.get("id").and_then(Value::as_str).map(str::to_owned),
                        name: fs("name"),
                        arguments: fs("arguments"),
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    Delta {
        content: text("content"),
        reasoning: text("reasoning_content").or_else(|| text("reasoning")),
        tool_calls,
    }
}

pub(crate) fn parse_usage(v: &Value) -> Option<Usage> {
    let u = v.get("usage").filter(|u| u.is_object())?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64);
    let prompt_tokens = n("prompt_tokens")?;
    let completion_tokens = n("completion_tokens").unwrap_or(0);
    Some(Usage {
        prompt_tokens,
        completion_tokens,
        // Saturating: counts are the engine's word, and absurd ones must not panic.
        total_tokens: n("total_tokens")
            .unwrap_or_else(|| prompt_tokens.saturating_add(completion_tokens)),
    })
}

/// Token ids from a JSON array of integers; `None` unless every element is an id (an integer
/// that fits a `u32`: a larger one is never truncated into some other token's id).
pub(crate) fn id_array(v: Option<&Value>) -> Option<Vec<u32>> {
    v?.as_array()?.iter().map(token_id).collect()
}

/// One token id: a JSON integer that fits a `u32`.
pub(crate) fn token_id(v: &Value) -> Option<u32> {
    u32::try_from(v.as_u64()?).ok()
}

/// Logprobs from OpenAI-style `logprobs.content[]` entries.
pub(crate) fn content_logprobs(choice: &Value) -> Option<Vec<Option<f32>>> {
    let content = choice.get("logprobs")?.get("content")?.as_array()?;
    Some(
        content
            .iter()
            .map(|e| e.get("logprob").and_then(Value::as_f64).map(|x| x as f32))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let u = parse_usage(&v).unwrap();
        assert_eq!(u.total_tokens, u64::MAX);
    }
}
