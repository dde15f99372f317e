//! The canonical chat request and assistant message: the lingua franca between the provider
//! wire APIs a harness speaks and the inference engine behind the proxy.
//!
//! Every wire module parses into these types and renders from them; every backend adapter
//! consumes them. They are recorded verbatim in each [`crate::CaptureRecord`], so they are part
//! of the wire format and live here.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::raw_json::RawJson;

/// A chat request as sent to the inference backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ChatRequest {
    /// The model name the backend was asked for (after `--backend-model` overrides).
    pub model: String,
    /// The conversation, in order.
    pub messages: Vec<ChatMessage>,
    /// Tools the model may call; empty when none were offered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolSpec>,
    /// The harness's `tool_choice`, passed through as given (`"auto"`, `"none"`, `"required"`
    /// or an object naming a function).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    /// Sampling parameters.
    #[serde(default)]
    pub sampling: SamplingParams,
    /// Whether the harness asked for a streamed answer.
    #[serde(default)]
    pub stream: bool,
    /// Other request fields the backend understands and the proxy passes through unchanged
    /// (e.g. `response_format`, `parallel_tool_calls`, `reasoning_effort`).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub extra: Map<String, Value>,
}

/// Sampling parameters; `None` leaves the backend's default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SamplingParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// Upper bound on sampled tokens (`max_tokens` / `max_completion_tokens` /
    /// `max_output_tokens` on the wire).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
}

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ChatMessage {
    pub role: Role,
    /// The message content as parts; a plain string on the wire is one text part. Empty for an
    /// assistant message that only calls tools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub content: Vec<ContentPart>,
    /// Reasoning text the model produced before its answer (assistant messages only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    /// Tool calls the assistant made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `tool` messages: the id of the call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Optional participant name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Whether the wire content was a plain string (rendered back as one) rather than parts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub content_was_string: bool,
}

impl ChatMessage {
    /// A message with plain-string content.
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: vec![ContentPart::Text { text: text.into() }],
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            content_was_string: true,
        }
    }

    /// The concatenated text parts.
    pub fn joined_text(&self) -> String {
        self.content
            .iter()
            .filter_map(|p| match p {
                ContentPart::Text { text } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// One part of a message's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        text: String,
    },
    /// An image by URL (including `data:` URLs).
    ImageUrl {
        url: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
}

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments, as the harness wrote it: passed to the engine as text
    /// (agents send dozens of schemas per call; building each as a tree cost a tenth of the
    /// proxy's time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<RawJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A tool call made by the assistant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments exactly as the model wrote them (normally a JSON object as text).
    pub arguments: String,
}

/// The assistant's answer, as parsed by the backend from the sampled tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AssistantMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model emitted an end-of-turn token or a stop sequence.
    Stop,
    /// The token budget ran out.
    Length,
    /// The model called tools.
    ToolCalls,
    ContentFilter,
    /// Generation was cut short by the proxy (client gone, backend error, timeout).
    Abort,
}

impl FinishReason {
    /// Parses an engine's OpenAI-style finish reason; unknown values count as `stop`.
    pub fn from_openai(s: &str) -> FinishReason {
        match s {
            "length" => FinishReason::Length,
            "tool_calls" | "function_call" => FinishReason::ToolCalls,
            "content_filter" => FinishReason::ContentFilter,
            "abort" => FinishReason::Abort,
            _ => FinishReason::Stop,
        }
    }

    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Abort => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::ContentFilter => "content_filter",
        }
    }
}

/// Token counts as reported by the engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// Of the completion, the tokens of its reasoning, where the engine counts them (vLLM's
    /// `completion_tokens_details.reasoning_tokens`, with a reasoning parser); passed on to
    /// the harness in the APIs that carry it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
}
