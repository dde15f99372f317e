//! The Chat Completions request sent to an engine, serialized straight from the canonical
//! request it borrows: no `serde_json::Value` copy of a conversation that may be tens of KB.

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::Value;
use tokentap_schema::RawJson;

use tokentap_wire::canonical::{ChatMessage, ChatRequest, ContentPart, ToolCall, ToolSpec};

/// A value a dialect sets to make its engine return token data.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum TokenParam {
    True,
    Int(u8),
}

impl Serialize for TokenParam {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            TokenParam::True => s.serialize_bool(true),
            TokenParam::Int(n) => s.serialize_u8(*n),
        }
    }
}

/// The engine request for `request`: its fields, then `request.extra`'s (passed through, but
/// never over a field the proxy sets), `stream`, and the dialect's token-data fields.
pub(crate) struct EngineRequest<'a> {
    pub(crate) request: &'a ChatRequest,
    pub(crate) stream: bool,
    pub(crate) token_data: &'a [(&'static str, TokenParam)],
}

impl EngineRequest<'_> {
    /// Whether the proxy sets `key` itself (so an `extra` entry of that name is left out:
    /// a JSON object must not name a key twice).
    fn sets(&self, key: &str) -> bool {
        let r = self.request;
        let s = &r.sampling;
        let known = match key {
            "model" | "messages" | "stream" => true,
            "tools" => !r.tools.is_empty(),
            "tool_choice" => r.tool_choice.is_some(),
            "temperature" => s.temperature.is_some(),
            "top_p" => s.top_p.is_some(),
            "top_k" => s.top_k.is_some(),
            "min_p" => s.min_p.is_some(),
            "max_tokens" => s.max_tokens.is_some(),
            "seed" => s.seed.is_some(),
            "presence_penalty" => s.presence_penalty.is_some(),
            "frequency_penalty" => s.frequency_penalty.is_some(),
            "stop" => !s.stop.is_empty(),
            "stream_options" => self.stream,
            _ => false,
        };
        known || self.token_data.iter().any(|(k, _)| *k == key)
    }
}

#[derive(Serialize)]
struct StreamOptions {
    include_usage: bool,
}

impl Serialize for EngineRequest<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        fn some<M: SerializeMap, T: Serialize>(
            m: &mut M,
            key: &str,
            v: &Option<T>,
        ) -> Result<(), M::Error> {
            match v {
                Some(v) => m.serialize_entry(key, v),
                None => Ok(()),
            }
        }
        let r = self.request;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("model", &r.model)?;
        m.serialize_entry("messages", &Messages(&r.messages))?;
        if !r.tools.is_empty() {
            m.serialize_entry("tools", &Tools(&r.tools))?;
        }
        some(&mut m, "tool_choice", &r.tool_choice)?;
        let sp = &r.sampling;
        some(&mut m, "temperature", &sp.temperature)?;
        some(&mut m, "top_p", &sp.top_p)?;
        some(&mut m, "top_k", &sp.top_k)?;
        some(&mut m, "min_p", &sp.min_p)?;
        some(&mut m, "max_tokens", &sp.max_tokens)?;
        some(&mut m, "seed", &sp.seed)?;
        some(&mut m, "presence_penalty", &sp.presence_penalty)?;
        some(&mut m, "frequency_penalty", &sp.frequency_penalty)?;
        if !sp.stop.is_empty() {
            m.serialize_entry("stop", &sp.stop)?;
        }
        for (k, v) in &r.extra {
            if !self.sets(k) {
                m.serialize_entry(k, v)?;
            }
        }
        m.serialize_entry("stream", &self.stream)?;
        if self.stream {
            m.serialize_entry(
                "stream_options",
                &StreamOptions {
                    include_usage: true,
                },
            )?;
        }
        for (k, v) in self.token_data {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// The conversation as Chat Completions `messages`.
pub(crate) struct Messages<'a>(pub(crate) &'a [ChatMessage]);

impl Serialize for Messages<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(MessageOut::from))
    }
}

#[derive(Serialize)]
struct MessageOut<'a> {
    role: &'static str,
    content: Content<'a>,
    #[serde(rename = "reasoning_content", skip_serializing_if = "Option::is_none")]
    reasoning: Option<&'a str>,
    #[serde(skip_serializing_if = "ToolCalls::is_empty")]
    tool_calls: ToolCalls<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

impl<'a> From<&'a ChatMessage> for MessageOut<'a> {
    fn from(m: &'a ChatMessage) -> Self {
        MessageOut {
            role: m.role.as_str(),
            content: Content(m),
            reasoning: m.reasoning.as_deref(),
            tool_calls: ToolCalls(&m.tool_calls),
            tool_call_id: m.tool_call_id.as_deref(),
            name: m.name.as_deref(),
        }
    }
}

/// A message's `content`: `null` (tool calls only), a string (as the harness sent it) or parts.
struct Content<'a>(&'a ChatMessage);

impl Serialize for Content<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let m = self.0;
        match m.content.as_slice() {
            [] if !m.content_was_string => s.serialize_unit(),
            [ContentPart::Text { text }] if m.content_was_string => s.serialize_str(text),
            parts => s.collect_seq(parts.iter().map(PartOut::from)),
        }
    }
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum PartOut<'a> {
    Text { text: &'a str },
    ImageUrl { image_url: ImageUrlOut<'a> },
}

#[derive(Serialize)]
struct ImageUrlOut<'a> {
    url: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
}

impl<'a> From<&'a ContentPart> for PartOut<'a> {
    fn from(p: &'a ContentPart) -> Self {
        match p {
            ContentPart::Text { text } => PartOut::Text { text },
            ContentPart::ImageUrl { url, detail } => PartOut::ImageUrl {
                image_url: ImageUrlOut {
                    url,
                    detail: detail.as_deref(),
                },
            },
        }
    }
}

struct ToolCalls<'a>(&'a [ToolCall]);

impl ToolCalls<'_> {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Serialize for ToolCalls<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|c| ToolCallOut {
            id: &c.id,
            kind: "function",
            function: CalledFunction {
                name: &c.name,
                arguments: &c.arguments,
            },
        }))
    }
}

#[derive(Serialize)]
struct ToolCallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: CalledFunction<'a>,
}

#[derive(Serialize)]
struct CalledFunction<'a> {
    name: &'a str,
    arguments: &'a str,
}

/// The offered tools as Chat Completions `tools`.
pub(crate) struct Tools<'a>(pub(crate) &'a [ToolSpec]);

impl Serialize for Tools<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|t| ToolOut {
            kind: "function",
            function: FunctionSpec {
                name: &t.name,
                description: t.description.as_deref(),
                parameters: t.parameters.as_ref(),
                strict: t.strict,
            },
        }))
    }
}

#[derive(Serialize)]
struct ToolOut<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionSpec<'a>,
}

#[derive(Serialize)]
struct FunctionSpec<'a> {
    name: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    description: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parameters: Option<&'a RawJson>,
    #[serde(skip_serializing_if = "Option::is_none")]
    strict: Option<bool>,
}

/// vLLM's `POST /tokenize` with chat messages: the served template applied, then tokenized.
#[derive(Serialize)]
pub(crate) struct TokenizeChat<'a> {
    pub(crate) model: &'a str,
    pub(crate) messages: Messages<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tools: Option<TokenizeTools<'a>>,
    pub(crate) add_generation_prompt: bool,
}

impl<'a> TokenizeChat<'a> {
    /// The chat request's `model`, `messages` and `tools` (as the engine request has them:
    /// an `extra` `tools` stands when no tool was offered).
    pub(crate) fn new(request: &'a ChatRequest) -> Self {
        let tools = if request.tools.is_empty() {
            request.extra.get("tools").map(TokenizeTools::Extra)
        } else {
            Some(TokenizeTools::Offered(Tools(&request.tools)))
        };
        TokenizeChat {
            model: &request.model,
            messages: Messages(&request.messages),
            tools,
            add_generation_prompt: true,
        }
    }
}

#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum TokenizeTools<'a> {
    Offered(Tools<'a>),
    Extra(&'a Value),
}

/// `body` as JSON bytes, written into a buffer of `size_hint` bytes to start with (a 40 KB
/// conversation written into an empty buffer was grown and copied a dozen times).
pub(crate) fn to_bytes<T: Serialize>(
    body: &T,
    size_hint: usize,
) -> Result<Vec<u8>, super::BackendError> {
    let mut out = Vec::with_capacity(size_hint);
    serde_json::to_writer(&mut out, body).map_err(|e| {
        super::BackendError::Protocol(format!("serializing the engine request: {e}"))
    })?;
    Ok(out)
}

/// About how many bytes `request` takes as JSON: its texts and schemas, which are nearly all
/// of it, a sixteenth more of text for its escapes (newlines and quotes are a few percent of
/// a prompt), and a little for each message's and tool's keys. `extra` is not counted: a
/// request with a large one grows its buffer.
pub(crate) fn json_size_hint(request: &ChatRequest) -> usize {
    let messages: usize = request
        .messages
        .iter()
        .map(|m| {
            let content: usize = m
                .content
                .iter()
                .map(|p| match p {
                    ContentPart::Text { text } => text.len() + text.len() / 16 + 32,
                    ContentPart::ImageUrl { url, .. } => url.len() + 64,
                })
                .sum();
            let calls: usize = m
                .tool_calls
                .iter()
                .map(|c| c.id.len() + c.name.len() + c.arguments.len() + 64)
                .sum();
            content + calls + m.reasoning.as_ref().map_or(0, String::len) + 64
        })
        .sum();
    let tools: usize = request
        .tools
        .iter()
        .map(|t| {
            t.name.len()
                + t.description.as_ref().map_or(0, String::len)
                + t.parameters.as_ref().map_or(0, |p| p.get().len())
                + 64
        })
        .sum();
    messages + tools + 1024
}
