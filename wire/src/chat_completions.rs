//! OpenAI Chat Completions: `POST /v1/chat/completions`, streamed (SSE) and whole.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokentap_schema::{ErrorKind, Normalization, RawJson, WireApi};

use super::json_body::{parse_json_body, ListItem, TextOrList};
use super::{sse_data, CallError, ParsedCall, ResponseMeta, StreamRenderer, WireCodec, WireError};
use crate::canonical::{
    ChatMessage, ChatRequest, ContentPart, Delta, FinishReason, GenerationAccumulator, Role,
    SamplingParams, ToolCall, ToolSpec, Usage,
};
use crate::engine_options::EngineOption;

pub struct ChatCompletions;

#[derive(Deserialize)]
struct WireRequest {
    model: String,
    messages: Vec<WireMessage>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    tools: Option<Vec<WireTool>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stop: Option<StopSpec>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopSpec {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireMessage {
    role: Role,
    #[serde(default)]
    content: Option<WireContent>,
    #[serde(default, alias = "reasoning")]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<WireToolCall>>,
    #[serde(default)]
    tool_call_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    // Accepted and ignored: provider bookkeeping some clients echo back.
    #[serde(default, rename = "refusal")]
    _refusal: Option<Value>,
    #[serde(default, rename = "annotations")]
    _annotations: Option<Value>,
    #[serde(default, rename = "audio")]
    _audio: Option<Value>,
}

/// A message's content: a string, or a list of parts.
type WireContent = TextOrList<WirePart>;

impl ListItem for WirePart {
    const CONTENT_EXPECTING: &'static str = "a string or an array of content parts";
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WirePart {
    Text { text: String },
    ImageUrl { image_url: WireImageUrl },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WireImageUrl {
    Url(String),
    Object {
        url: String,
        #[serde(default)]
        detail: Option<String>,
    },
}

#[derive(Deserialize)]
struct WireToolCall {
    id: String,
    #[serde(rename = "type", default)]
    _kind: Option<String>,
    function: WireFunctionCall,
}

#[derive(Deserialize)]
struct WireFunctionCall {
    name: String,
    arguments: String,
}

#[derive(Deserialize)]
struct WireTool {
    #[serde(rename = "type")]
    kind: String,
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    /// Kept as text, not parsed into a tree: see [`ToolSpec::parameters`].
    #[serde(default)]
    parameters: Option<RawJson>,
    #[serde(default)]
    strict: Option<bool>,
}

impl WireCodec for ChatCompletions {
    fn api(&self) -> WireApi {
        WireApi::ChatCompletions
    }

    fn id_prefix(&self) -> &'static str {
        "chatcmpl-"
    }

    fn parse(&self, body: &[u8]) -> Result<ParsedCall, WireError> {
        let w: WireRequest = parse_json_body(body)?;
        if w.n.is_some_and(|n| n != 1) {
            return Err(WireError::at(
                "n",
                "Only n=1 is supported: each call samples one answer.",
            ));
        }
        if w.messages.is_empty() {
            return Err(WireError::at(
                "messages",
                "'messages' must contain at least one message.",
            ));
        }
        let mut normalizations = Vec::new();
        let messages = w
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut tools = Vec::new();
        for (i, t) in w.tools.unwrap_or_default().into_iter().enumerate() {
            match (t.kind.as_str(), t.function) {
                ("function", Some(f)) => tools.push(ToolSpec {
                    name: f.name,
                    description: f.description,
                    parameters: f.parameters,
                    strict: f.strict,
                }),
                ("function", None) => {
                    return Err(WireError::at(
                        format!("tools[{i}].function"),
                        "A function tool needs a 'function' object.",
                    ))
                }
                (other, _) => normalizations.push(Normalization {
                    kind: "dropped_tool".into(),
                    detail: format!(
                        "tools[{i}] of type '{other}' is not a function tool the engine can call"
                    ),
                }),
            }
        }
        let mut extra = Map::new();
        for (k, v) in w.other {
            // Engine options pass through as given, to be screened (`engine_options`).
            if EngineOption::from_name(&k).is_some() {
                extra.insert(k, v);
            } else if !matches!(k.as_str(), "logprobs" | "top_logprobs") {
                normalizations.push(Normalization {
                    kind: "dropped_field".into(),
                    detail: format!("'{k}' is not forwarded to the engine"),
                });
            }
        }
        let stream = w.stream.unwrap_or(false);
        let request = ChatRequest {
            model: w.model,
            messages,
            tools,
            tool_choice: w.tool_choice,
            sampling: SamplingParams {
                temperature: w.temperature,
                top_p: w.top_p,
                top_k: w.top_k,
                min_p: w.min_p,
                max_tokens: w.max_completion_tokens.or(w.max_tokens),
                stop: match w.stop {
                    None => vec![],
                    Some(StopSpec::One(s)) => vec![s],
                    Some(StopSpec::Many(v)) => v,
                },
                seed: w.seed,
                presence_penalty: w.presence_penalty,
                frequency_penalty: w.frequency_penalty,
            },
            stream,
            extra,
        };
        let include_usage = w
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        Ok(ParsedCall {
            request,
            include_usage,
            normalizations,
            // Nothing of the request is echoed in these answers but the model.
            echo: Default::default(),
        })
    }

    fn render_whole(&self, meta: &ResponseMeta, g: &GenerationAccumulator) -> Vec<u8> {
        let mut message = Map::new();
        message.insert("role".into(), json!("assistant"));
        message.insert(
            "content".into(),
            if g.content.is_empty() && !g.tool_calls.is_empty() {
                Value::Null
            } else {
                json!(g.content)
            },
        );
        if !g.reasoning.is_empty() {
            message.insert("reasoning_content".into(), json!(g.reasoning));
        }
        if !g.tool_calls.is_empty() {
            message.insert(
                "tool_calls".into(),
                Value::Array(g.tool_calls.iter().map(tool_call_json).collect()),
            );
        }
        let (finish, usage) = g.finish.unwrap_or((FinishReason::Stop, None));
        let mut body = json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish.as_openai()}],
        });
        if let Some(u) = usage {
            body["usage"] = usage_json(u);
        }
        serde_json::to_vec(&body).expect("JSON values always serialize")
    }

    fn stream_renderer(&self, meta: ResponseMeta, include_usage: bool) -> Box<dyn StreamRenderer> {
        Box::new(ChunkRenderer {
            meta,
            include_usage,
        })
    }

    fn render_error(&self, e: &CallError) -> (u16, Vec<u8>) {
        (
            e.status,
            serde_json::to_vec(&error_json(e)).expect("JSON values always serialize"),
        )
    }
}

fn message(i: usize, m: WireMessage) -> Result<ChatMessage, WireError> {
    let (content, content_was_string) = match m.content {
        None => (vec![], false),
        Some(WireContent::Text(t)) => (vec![ContentPart::Text { text: t }], true),
        Some(WireContent::List(parts)) => (
            parts
                .into_iter()
                .map(|p| match p {
                    WirePart::Text { text } => ContentPart::Text { text },
                    WirePart::ImageUrl {
                        image_url: WireImageUrl::Url(url),
                    } => ContentPart::ImageUrl { url, detail: None },
                    WirePart::ImageUrl {
                        image_url: WireImageUrl::Object { url, detail },
                    } => ContentPart::ImageUrl { url, detail },
                })
                .collect(),
            false,
        ),
    };
    let tool_calls: Vec<ToolCall> = m
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .map(|c| ToolCall {
            id: c.id,
            name: c.function.name,
            arguments: c.function.arguments,
        })
        .collect();
    if m.role == Role::Tool && m.tool_call_id.is_none() {
        return Err(WireError::at(
            format!("messages[{i}].tool_call_id"),
            format!("messages[{i}] has role 'tool' but no 'tool_call_id'."),
        ));
    }
    if !tool_calls.is_empty() && m.role != Role::Assistant {
        return Err(WireError::at(
            format!("messages[{i}].tool_calls"),
            format!("messages[{i}]: only assistant messages can carry 'tool_calls'."),
        ));
    }
    Ok(ChatMessage {
        role: m.role,
        content,
        reasoning: m.reasoning_content,
        tool_calls,
        tool_call_id: m.tool_call_id,
        name: m.name,
        content_was_string,
    })
}

fn tool_call_json(c: &ToolCall) -> Value {
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

fn usage_json(u: Usage) -> Value {
    let mut v = json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens});
    // Only where the engine counted them: a harness reads an absent count as unknown, a 0 as none.
    if let Some(n) = u.reasoning_tokens {
        v["completion_tokens_details"] = json!({"reasoning_tokens": n});
    }
    v
}

/// OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.
pub(crate) fn error_json(e: &CallError) -> Value {
    let (kind, code) = match e.kind {
        ErrorKind::ContextLengthExceeded => {
            ("invalid_request_error", Some("context_length_exceeded"))
        }
        ErrorKind::BodyTooLarge => ("invalid_request_error", Some("request_too_large")),
        ErrorKind::InvalidRequest if e.status == 404 => {
            ("invalid_request_error", Some("unknown_url"))
        }
        ErrorKind::InvalidRequest => ("invalid_request_error", None),
        _ if e.status == 429 => ("rate_limit_error", None),
        ErrorKind::BackendTimeout => ("server_error", Some("timeout")),
        _ => ("server_error", None),
    };
    let message = if e.kind == ErrorKind::ContextLengthExceeded {
        // OpenAI's own wording first: harnesses match it to decide to compact.
        format!(
            "Your input exceeds the context window of this model. ({})",
            e.message
        )
    } else {
        e.message.clone()
    };
    json!({"error": {"message": message, "type": kind, "param": e.param, "code": code}})
}

/// Renders `chat.completion.chunk` frames.
struct ChunkRenderer {
    meta: ResponseMeta,
    include_usage: bool,
}

impl ChunkRenderer {
    fn chunk<'a, D: Serialize>(
        &'a self,
        delta: &'a D,
        finish: Option<FinishReason>,
    ) -> Chunk<'a, D> {
        Chunk {
            id: &self.meta.id,
            object: "chat.completion.chunk",
            created: self.meta.created,
            model: &self.meta.model,
            choices: [ChunkChoice {
                index: 0,
                delta,
                logprobs: None,
                finish_reason: finish.map(FinishReason::as_openai),
            }],
        }
    }
}

/// A `chat.completion.chunk`, written from borrowed fields (one goes out per sampled token;
/// building each as a `Value` tree cost more than writing it).
#[derive(Serialize)]
struct Chunk<'a, D> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChunkChoice<'a, D>; 1],
}

#[derive(Serialize)]
struct ChunkChoice<'a, D> {
    index: u32,
    delta: &'a D,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

/// The deltas of text chunks.
#[derive(Serialize)]
struct RoleDelta {
    role: &'static str,
    content: &'static str,
}

#[derive(Serialize)]
struct ContentDelta<'a> {
    content: &'a str,
}

#[derive(Serialize)]
struct ReasoningDelta<'a> {
    reasoning_content: &'a str,
}

#[derive(Serialize)]
struct NoDelta {}

impl StreamRenderer for ChunkRenderer {
    fn start(&mut self, out: &mut Vec<u8>) {
        let delta = RoleDelta {
            role: "assistant",
            content: "",
        };
        sse_data(out, &self.chunk(&delta, None));
    }

    fn delta(&mut self, d: &Delta, out: &mut Vec<u8>) {
        if let Some(r) = d.reasoning.as_deref().filter(|r| !r.is_empty()) {
            let delta = ReasoningDelta {
                reasoning_content: r,
            };
            sse_data(out, &self.chunk(&delta, None));
        }
        if let Some(c) = d.content.as_deref().filter(|c| !c.is_empty()) {
            sse_data(out, &self.chunk(&ContentDelta { content: c }, None));
        }
        if !d.tool_calls.is_empty() {
            let calls: Vec<Value> = d
                .tool_calls
                .iter()
                .map(|tc| {
                    let mut call = Map::new();
                    call.insert("index".into(), json!(tc.index));
                    if let Some(id) = &tc.id {
                        call.insert("id".into(), json!(id));
                        call.insert("type".into(), json!("function"));
                    }
                    let mut f = Map::new();
                    if let Some(n) = &tc.name {
                        f.insert("name".into(), json!(n));
                    }
                    f.insert(
                        "arguments".into(),
                        json!(tc.arguments.as_deref().unwrap_or("")),
                    );
                    call.insert("function".into(), Value::Object(f));
                    Value::Object(call)
                })
                .collect();
            sse_data(out, &self.chunk(&json!({"tool_calls": calls}), None));
        }
    }

    fn finish(&mut self, finish_reason: FinishReason, usage: Option<Usage>, out: &mut Vec<u8>) {
        sse_data(out, &self.chunk(&NoDelta {}, Some(finish_reason)));
        if self.include_usage {
            let u = usage.unwrap_or_default();
            sse_data(
                out,
                &json!({
                    "id": self.meta.id,
                    "object": "chat.completion.chunk",
                    "created": self.meta.created,
                    "model": self.meta.model,
                    "choices": [],
                    "usage": usage_json(u),
                }),
            );
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
    }

    fn error(&mut self, e: &CallError, out: &mut Vec<u8>) {
        sse_data(out, &error_json(e));
        out.extend_from_slice(b"data: [DONE]\n\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::ToolCallDelta;

    fn parse(v: Value) -> Result<ParsedCall, WireError> {
        ChatCompletions.parse(&serde_json::to_vec(&v).unwrap())
    }

    fn meta() -> ResponseMeta {
        ResponseMeta::new("chatcmpl-1", 7, "m")
    }

    /// The stream is written byte for byte as the `Value`-built renderer wrote it.
    #[test]
    fn the_stream_is_written_byte_for_byte_as_before() {
        let out = crate::stream_golden::every_event_shape(&ChatCompletions, meta());
        crate::stream_golden::assert_golden("chat-stream.golden.sse", out);
    }

    #[test]
    fn pi_turn_two_parses_with_tool_calls_and_results() {
        let p = parse(json!({
            "model": "mock-model",
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "Write hi to a file"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"echo hi\"}"}}]},
                {"role": "tool", "content": "(no output)", "tool_call_id": "call_1"}
            ],
            "stream": true, "stream_options": {"include_usage": true}, "store": false,
            "max_completion_tokens": 16384,
            "tools": [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}, "strict": false}}]
        }))
        .unwrap();
        let r = &p.request;
        assert!(r.stream && p.include_usage);
        assert_eq!(r.sampling.max_tokens, Some(16384));
        assert_eq!(r.messages.len(), 4);
        assert!(r.messages[0].content_was_string && !r.messages[1].content_was_string);
        assert_eq!(
            r.messages[2].tool_calls,
            vec![ToolCall {
                id: "call_1".into(),
                name: "bash".into(),
                arguments: "{\"command\":\"echo hi\"}".into()
            }]
        );
        assert!(r.messages[2].content.is_empty());
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(r.tools[0].name, "bash");
        assert!(p
            .normalizations
            .iter()
            .any(|n| n.kind == "dropped_field" && n.detail.contains("store")));
    }

    #[test]
    fn wrong_types_name_the_field() {
        let e =
            parse(json!({"model": "m", "messages": [{"role": "user", "content": 5}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"), "{e}");
        let e = parse(json!({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}))
            .unwrap_err();
        assert!(
            e.message.contains("messages[0].role") && e.message.contains("wizard"),
            "{e}"
        );
        // Read from bytes, serde_json calls a number where an enum goes a syntax error
        // ("expected value"); the body is valid JSON, so it is the field's error.
        let e =
            parse(json!({"model": "m", "messages": [{"role": 5, "content": "x"}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"), "{e}");
        assert!(e.message.contains("invalid type: integer `5`"), "{e}");
        // A repeated key: the last one counts, as a `Value` parse had it.
        let e = ChatCompletions
            .parse(br#"{"model": "m", "model": 5, "messages": [{"role": "user", "content": "x"}]}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"), "{e}");
        let two =
            br#"{"model": "a", "model": "b", "messages": [{"role": "user", "content": "x"}]}"#;
        assert_eq!(ChatCompletions.parse(two).unwrap().request.model, "b");
        let e = parse(json!({"messages": []})).unwrap_err();
        assert!(e.message.contains("model"), "{e}");
        let e = parse(json!({"model": "m", "messages": "hi"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = ChatCompletions.parse(b"{not json").unwrap_err();
        assert!(
            e.message.starts_with("Request body is not valid JSON"),
            "{e}"
        );
        let e = parse(json!({"model": "m", "messages": [{"role": "tool", "content": "x"}]}))
            .unwrap_err();
        assert!(e.message.contains("tool_call_id"), "{e}");
        let e =
            parse(json!({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}))
                .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
    }

    #[test]
    fn errors_have_the_openai_shape() {
        let (status, body) = ChatCompletions.render_error(&WireError::at("messages", "bad").into());
        assert_eq!(status, 400);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "messages", "code": null}})
        );
        let overflow = CallError::context_overflow("too long");
        let (status, body) = ChatCompletions.render_error(&overflow);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (400, Some("context_length_exceeded"))
        );
    }

    #[test]
    fn a_stream_renders_role_content_tool_calls_finish_usage_done() {
        let mut r = ChatCompletions.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        r.delta(
            &Delta {
                content: Some("Hi".into()),
                ..Default::default()
            },
            &mut out,
        );
        r.delta(
            &Delta {
                tool_calls: vec![ToolCallDelta {
                    index: 0,
                    id: Some("c1".into()),
                    name: Some("bash".into()),
                    arguments: Some("{\"a\"".into()),
                }],
                ..Default::default()
            },
            &mut out,
        );
        r.finish(
            FinishReason::ToolCalls,
            Some(Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                total_tokens: 5,
                reasoning_tokens: None,
            }),
            &mut out,
        );
        let text = String::from_utf8(out).unwrap();
        let frames = tokentap_e2e::sse::canonical_events(&text);
        assert_eq!(frames.len(), 6, "{text}");
        assert!(
            frames.iter().all(|f| f.event == "message"),
            "unnamed events"
        );
        let chunk = |i: usize| serde_json::from_str::<Value>(&frames[i].data).unwrap();
        assert_eq!(
            chunk(0)["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(chunk(1)["choices"][0]["delta"]["content"], "Hi");
        assert_eq!(
            chunk(2)["choices"][0]["delta"]["tool_calls"][0],
            json!({"index": 0, "id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"a\""}})
        );
        assert_eq!(chunk(3)["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(chunk(4)["choices"], json!([]));
        assert_eq!(chunk(4)["usage"]["total_tokens"], 5);
        assert_eq!(frames[5].data, "[DONE]");
        for i in 0..5 {
            assert_eq!(chunk(i)["object"], "chat.completion.chunk");
            assert_eq!(chunk(i)["id"], "chatcmpl-1");
        }
    }

    #[test]
    fn without_include_usage_no_usage_chunk_is_sent() {
        let mut r = ChatCompletions.stream_renderer(meta(), false);
        let mut out = Vec::new();
        r.finish(FinishReason::Stop, Some(Usage::default()), &mut out);
        let text = String::from_utf8(out).unwrap();
        assert!(!text.contains("usage"), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"));
    }

    #[test]
    fn a_whole_answer_with_only_tool_calls_has_null_content() {
        let mut g = GenerationAccumulator::default();
        g.push(crate::canonical::GenerationEvent::Delta(Delta {
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: Some("c".into()),
                name: Some("f".into()),
                arguments: Some("{}".into()),
            }],
            ..Default::default()
        }));
        g.push(crate::canonical::GenerationEvent::Finished {
            finish_reason: FinishReason::ToolCalls,
            usage: None,
        });
        let v: Value = serde_json::from_slice(&ChatCompletions.render_whole(&meta(), &g)).unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
            "f"
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    }
}
