//! OpenAI Responses: `POST /v1/responses` (Codex CLI), streamed (typed SSE events) and whole.
//!
//! Requests are a list of typed input items (messages, function calls, their outputs,
//! reasoning). They fold into canonical chat messages: consecutive calls join the assistant
//! message before them, outputs become `tool` messages, readable reasoning rides on the next
//! assistant message.
//!
//! Codex groups some tools in `namespace` tools and routes a call by `(namespace, name)`.
//! The engine only knows flat function tools, so a namespaced function is offered as
//! `<namespace>.<name>` (a `.` never occurs in OpenAI tool names, so the split is exact) and a
//! call to such a name is rendered back as `{"namespace": …, "name": …}`.

use std::collections::HashSet;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokentap_schema::{ErrorKind, Normalization, RawJson, WireApi};

use super::chat_completions::error_json;
use super::json_body::parse_json_body;
use super::{CallError, Echo, ParsedCall, ResponseMeta, StreamRenderer, WireCodec, WireError};
use crate::canonical::{
    ChatMessage, ChatRequest, ContentPart, Delta, FinishReason, GenerationAccumulator, Role,
    SamplingParams, ToolCall, ToolSpec, Usage,
};
use crate::engine_options::EngineOption;

pub struct Responses;

/// Joins a namespace and the name of a function inside it into the flat tool name the engine
/// sees (and splits it again when the model calls it).
pub const NAMESPACE_SEPARATOR: char = '.';

/// The namespace a model may put in front of a plain function name (harmony-style
/// `functions.<name>`); it means "no namespace".
const DEFAULT_NAMESPACE: &str = "functions";

/// Request fields that are bookkeeping for OpenAI's servers: dropped with a note.
const KNOWN_DROPPED_FIELDS: &[&str] = &[
    "store",
    "include",
    "prompt_cache_key",
    "client_metadata",
    "metadata",
    "service_tier",
    "user",
    "safety_identifier",
    "truncation",
    "background",
    "top_logprobs",
    "stream_options",
    "max_tool_calls",
    "prompt",
    "prompt_cache_retention",
];

/// Request fields a Response object echoes as they were sent, besides those tokentap reads
/// (`instructions`, sampling, tools, `reasoning`, `text`).
const ECHOED_FIELDS: &[&str] = &[
    "background",
    "max_tool_calls",
    "metadata",
    "prompt_cache_key",
    "safety_identifier",
    "service_tier",
    "store",
    "top_logprobs",
    "truncation",
    "user",
];

/// Input item types OpenAI can produce that no chat template can show; dropped with a note.
const DROPPED_ITEM_TYPES: &[&str] = &[
    "web_search_call",
    "file_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "computer_call",
    "computer_call_output",
    "tool_search_call",
    "tool_search_output",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "compaction",
    "compaction_summary",
    "item_reference",
    "ghost_snapshot",
];

#[derive(Deserialize)]
struct WireRequest {
    model: String,
    input: Value,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    /// Each tool kept as its text too: the response echoes the tools as they were sent.
    #[serde(default)]
    tools: Option<Vec<RawJson>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    /// [`WireReasoningConfig`], kept as it came for the echo.
    #[serde(default)]
    reasoning: Option<Value>,
    /// [`WireTextConfig`], kept as it came for the echo.
    #[serde(default)]
    text: Option<Value>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Deserialize)]
struct WireReasoningConfig {
    #[serde(default)]
    effort: Option<String>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Deserialize)]
struct WireTextConfig {
    #[serde(default)]
    format: Option<WireTextFormat>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireTextFormat {
    Text,
    JsonObject,
    JsonSchema {
        name: String,
        schema: Value,
        #[serde(default)]
        description: Option<String>,
        #[serde(default)]
        strict: Option<bool>,
    },
}

#[derive(Deserialize)]
struct WireTool {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    description: Option<String>,
    /// Kept as text, not parsed into a tree: see [`ToolSpec::parameters`].
    #[serde(default)]
    parameters: Option<RawJson>,
    #[serde(default)]
    strict: Option<bool>,
    /// The functions of a `namespace` tool.
    #[serde(default)]
    tools: Option<Vec<WireTool>>,
}

// Input items, one struct per type (dispatched on `type` by hand so that errors keep their
// field path). Unknown fields (ids, statuses, Codex bookkeeping) are ignored.

#[derive(Deserialize)]
struct WireMessage {
    role: WireRole,
    content: Value,
}

#[derive(Deserialize)]
struct WireFunctionCall {
    call_id: String,
    name: String,
    arguments: String,
    #[serde(default)]
    namespace: Option<String>,
}

#[derive(Deserialize)]
struct WireCustomToolCall {
    call_id: String,
    name: String,
    input: String,
}

#[derive(Deserialize)]
struct WireLocalShellCall {
    #[serde(default)]
    call_id: Option<String>,
    #[serde(default)]
    id: Option<String>,
    action: Value,
}

/// `function_call_output` and `custom_tool_call_output`.
#[derive(Deserialize)]
struct WireCallOutput {
    call_id: String,
    output: Value,
}

#[derive(Deserialize)]
struct WireReasoning {
    #[serde(default)]
    summary: Vec<WireSummaryPart>,
    #[serde(default)]
    content: Option<Vec<WireReasoningPart>>,
    #[serde(default)]
    encrypted_content: Option<String>,
}

/// The item types tokentap reads.
const ITEM_TYPES: &[&str] = &[
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "local_shell_call",
    "reasoning",
];

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum WireRole {
    User,
    Assistant,
    System,
    Developer,
}

/// `input_text`, `output_text` and `text` parts.
#[derive(Deserialize)]
struct WireTextPart {
    text: String,
}

#[derive(Deserialize)]
struct WireRefusalPart {
    refusal: String,
}

#[derive(Deserialize)]
struct WireImagePart {
    #[serde(default)]
    image_url: Option<String>,
    #[serde(default)]
    detail: Option<String>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireSummaryPart {
    SummaryText { text: String },
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireReasoningPart {
    ReasoningText { text: String },
    Text { text: String },
}

/// Deserializes a nested value, naming the failing field path below `base`.
fn from_value_at<T: DeserializeOwned>(value: Value, base: &str) -> Result<T, WireError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let path = match inner.as_str() {
            "." => base.to_owned(),
            p if p.starts_with('[') => format!("{base}{p}"),
            p => format!("{base}.{p}"),
        };
        let message = e.into_inner().to_string();
        WireError::at(
            path.clone(),
            format!("Invalid value for '{path}': {message}"),
        )
    })
}

/// Deserializes a value kept as its text, naming the failing field path below `base` as
/// [`from_value_at`] does (worked out on the error path only; text a `Value` cannot hold, such
/// as `1e400`, is named at `base`).
fn from_raw_at<T: DeserializeOwned>(raw: &RawJson, base: &str) -> Result<T, WireError> {
    let direct = match serde_json::from_str(raw.get()) {
        Ok(v) => return Ok(v),
        Err(e) => e,
    };
    match serde_json::from_str::<Value>(raw.get()) {
        Ok(v) => from_value_at(v, base),
        Err(_) => Err(WireError::at(
            base.to_owned(),
            format!("Invalid value for '{base}': {direct}"),
        )),
    }
}

/// The request values a Response object echoes (OpenAI echoes what the request set, and its
/// defaults for the rest; see `response_object`).
fn echo(w: &WireRequest) -> Echo {
    let mut echo = Echo::default();
    if let Some(i) = &w.instructions {
        echo.set("instructions", i);
    }
    if let Some(n) = w.max_output_tokens {
        echo.set("max_output_tokens", &n);
    }
    if let Some(t) = w.temperature {
        echo.set("temperature", &t);
    }
    if let Some(p) = w.top_p {
        echo.set("top_p", &p);
    }
    if let Some(p) = w.parallel_tool_calls {
        echo.set("parallel_tool_calls", &p);
    }
    if let Some(tools) = &w.tools {
        echo.set("tools", tools);
    }
    if let Some(tc) = &w.tool_choice {
        echo.set("tool_choice", tc);
    }
    if let Some(r) = w.reasoning.as_ref().filter(|r| r.is_object()) {
        echo.set("reasoning", r);
    }
    if let Some(t) = w.text.as_ref().filter(|t| t.is_object()) {
        echo.set("text", t);
    }
    for &field in ECHOED_FIELDS {
        if let Some(v) = w.other.get(field).filter(|v| !v.is_null()) {
            echo.set(field, v);
        }
    }
    echo
}

fn note(notes: &mut Vec<Normalization>, kind: &str, detail: String) {
    notes.push(Normalization {
        kind: kind.into(),
        detail,
    });
}

impl WireCodec for Responses {
    fn api(&self) -> WireApi {
        WireApi::Responses
    }

    fn id_prefix(&self) -> &'static str {
        "resp_"
    }

    fn engine_option_param(&self, option: EngineOption) -> &'static str {
        match option {
            EngineOption::ResponseFormat => "text.format",
            EngineOption::ReasoningEffort => "reasoning.effort",
            other => other.name(),
        }
    }

    fn parse(&self, body: &[u8]) -> Result<ParsedCall, WireError> {
        let w: WireRequest = parse_json_body(body)?;
        let mut notes = Vec::new();
        if w.previous_response_id.is_some() {
            return Err(WireError::at(
                "previous_response_id",
                "tokentap does not store responses, so 'previous_response_id' cannot be resolved; send the whole conversation in 'input' (store: false).",
            ));
        }

        let echo = echo(&w);
        let mut history = History::new(&mut notes);
        if let Some(instructions) = w.instructions.filter(|s| !s.is_empty()) {
            history
                .messages
                .push(ChatMessage::text(Role::System, instructions));
        }
        match w.input {
            Value::String(text) => history.messages.push(ChatMessage::text(Role::User, text)),
            Value::Array(items) if items.is_empty() => {
                return Err(WireError::at(
                    "input",
                    "'input' must contain at least one item.",
                ))
            }
            Value::Array(items) => {
                for (i, item) in items.into_iter().enumerate() {
                    history.item(i, item)?;
                }
                history.finish();
            }
            _ => {
                return Err(WireError::at(
                    "input",
                    "'input' must be a string or an array of input items.",
                ))
            }
        }
        let messages = history.messages;

        let wire_tools = w
            .tools
            .unwrap_or_default()
            .iter()
            .enumerate()
            .map(|(i, raw)| from_raw_at(raw, &format!("tools[{i}]")))
            .collect::<Result<Vec<WireTool>, _>>()?;
        let tools = tools(wire_tools, &mut notes)?;
        let tool_choice = match w.tool_choice {
            None => None,
            Some(_) if tools.is_empty() => {
                note(
                    &mut notes,
                    "dropped_tool_choice",
                    "'tool_choice' dropped: no tool the engine can call remains".into(),
                );
                None
            }
            Some(tc) => tool_choice(tc, &mut notes)?,
        };

        let mut extra = Map::new();
        if let Some(p) = w.parallel_tool_calls {
            extra.insert("parallel_tool_calls".into(), json!(p));
        }
        if let Some(r) = w.reasoning {
            let r: WireReasoningConfig = from_value_at(r, "reasoning")?;
            if let Some(effort) = r.effort {
                extra.insert("reasoning_effort".into(), json!(effort));
            }
            for k in r.other.keys() {
                note(
                    &mut notes,
                    "dropped_field",
                    format!("'reasoning.{k}' is not forwarded to the engine"),
                );
            }
        }
        if let Some(t) = w.text {
            let t: WireTextConfig = from_value_at(t, "text")?;
            match t.format {
                None | Some(WireTextFormat::Text) => {}
                Some(WireTextFormat::JsonObject) => {
                    extra.insert("response_format".into(), json!({"type": "json_object"}));
                }
                Some(WireTextFormat::JsonSchema {
                    name,
                    schema,
                    description,
                    strict,
                }) => {
                    let mut js = Map::new();
                    js.insert("name".into(), json!(name));
                    if let Some(d) = description {
                        js.insert("description".into(), json!(d));
                    }
                    js.insert("schema".into(), schema);
                    if let Some(s) = strict {
                        js.insert("strict".into(), json!(s));
                    }
                    extra.insert(
                        "response_format".into(),
                        json!({"type": "json_schema", "json_schema": js}),
                    );
                }
            }
            for k in t.other.keys() {
                note(
                    &mut notes,
                    "dropped_field",
                    format!("'text.{k}' is not forwarded to the engine"),
                );
            }
        }
        for k in w.other.keys() {
            let detail = if KNOWN_DROPPED_FIELDS.contains(&k.as_str()) {
                format!("'{k}' is not forwarded to the engine")
            } else {
                format!("'{k}' is not a field tokentap forwards to the engine")
            };
            note(&mut notes, "dropped_field", detail);
        }

        let request = ChatRequest {
            model: w.model,
            messages,
            tools,
            tool_choice,
            sampling: SamplingParams {
                temperature: w.temperature,
                top_p: w.top_p,
                max_tokens: w.max_output_tokens,
                ..SamplingParams::default()
            },
            stream: w.stream.unwrap_or(false),
            extra,
        };
        Ok(ParsedCall {
            request,
            // Usage always travels in `response.completed`.
            include_usage: true,
            normalizations: notes,
            echo,
        })
    }

    fn render_whole(&self, meta: &ResponseMeta, g: &GenerationAccumulator) -> Vec<u8> {
        let ids = ItemIds::new(&meta.id);
        let mut output = Vec::new();
        if !g.reasoning.is_empty() {
            output.push(reasoning_item(&ids.reasoning(output.len()), &g.reasoning));
        }
        if !g.content.is_empty() {
            output.push(message_item(
                &ids.message(output.len()),
                &g.content,
                "completed",
            ));
        }
        for call in &g.tool_calls {
            let i = output.len();
            output.push(function_call_item(
                &ids.function_call(i),
                &ids.call_id(&call.id, i),
                &call.name,
                &call.arguments,
                "completed",
            ));
        }
        let (finish, usage) = g.finish.unwrap_or((FinishReason::Stop, None));
        let body = response_object(
            meta,
            Terminal::from(finish).status(),
            &output,
            Some(usage_json(usage.unwrap_or_default())),
            Terminal::from(finish).incomplete_details(),
            Value::Null,
        );
        serde_json::to_vec(&body).expect("JSON values always serialize")
    }

    fn stream_renderer(&self, meta: ResponseMeta, _include_usage: bool) -> Box<dyn StreamRenderer> {
        Box::new(EventRenderer::new(meta))
    }

    fn render_error(&self, e: &CallError) -> (u16, Vec<u8>) {
        (
            e.status,
            serde_json::to_vec(&error_json(e)).expect("JSON values always serialize"),
        )
    }
}

/// Folds input items into chat messages.
struct History<'a> {
    messages: Vec<ChatMessage>,
    /// The last message is an assistant message that following calls join.
    open_assistant: bool,
    /// Readable reasoning waiting for the assistant message it precedes, with its item index.
    pending_reasoning: Option<(usize, String)>,
    call_ids: HashSet<String>,
    notes: &'a mut Vec<Normalization>,
}

impl<'a> History<'a> {
    fn new(notes: &'a mut Vec<Normalization>) -> Self {
        History {
            messages: Vec::new(),
            open_assistant: false,
            pending_reasoning: None,
            call_ids: HashSet::new(),
            notes,
        }
    }

    fn item(&mut self, i: usize, mut value: Value) -> Result<(), WireError> {
        let path = format!("input[{i}]");
        let Some(obj) = value.as_object_mut() else {
            return Err(WireError::at(
                path.clone(),
                format!("{path} must be an object (an input item)."),
            ));
        };
        let kind = match obj.get("type") {
            Some(Value::String(t)) => t.clone(),
            None | Some(Value::Null) if obj.contains_key("role") => {
                obj.insert("type".into(), json!("message"));
                "message".into()
            }
            None | Some(Value::Null) => {
                return Err(WireError::at(
                    format!("{path}.type"),
                    format!("{path} has neither a 'type' nor a 'role'."),
                ))
            }
            Some(other) => {
                return Err(WireError::at(
                    format!("{path}.type"),
                    format!("Invalid value for '{path}.type': expected a string, got {other}"),
                ))
            }
        };
        if DROPPED_ITEM_TYPES.contains(&kind.as_str()) {
            note(
                self.notes,
                "dropped_item",
                format!("{path} of type '{kind}' has no equivalent the engine can read"),
            );
            return Ok(());
        }
        if !ITEM_TYPES.contains(&kind.as_str()) {
            return Err(WireError::at(
                format!("{path}.type"),
                format!(
                    "{path} has unknown item type '{kind}'; tokentap reads {}.",
                    ITEM_TYPES.join(", ")
                ),
            ));
        }
        match kind.as_str() {
            "message" => {
                let w: WireMessage = from_value_at(value, &path)?;
                let (content, content_was_string) =
                    content_parts(w.content, &format!("{path}.content"))?;
                let mut m = ChatMessage {
                    role: match w.role {
                        WireRole::User => Role::User,
                        WireRole::Assistant => Role::Assistant,
                        WireRole::System => Role::System,
                        WireRole::Developer => Role::Developer,
                    },
                    content,
                    reasoning: None,
                    tool_calls: Vec::new(),
                    tool_call_id: None,
                    name: None,
                    content_was_string,
                };
                if m.role == Role::Assistant {
                    m.reasoning = self.pending_reasoning.take().map(|(_, r)| r);
                    self.messages.push(m);
                    self.open_assistant = true;
                } else {
                    self.close(i);
                    self.messages.push(m);
                }
            }
            "function_call" => {
                let w: WireFunctionCall = from_value_at(value, &path)?;
                if !w.arguments.trim().is_empty()
                    && serde_json::from_str::<serde::de::IgnoredAny>(&w.arguments).is_err()
                {
                    return Err(WireError::at(
                        format!("{path}.arguments"),
                        format!(
                            "{path}.arguments must be JSON text (the function's arguments), got {:?}.",
                            w.arguments
                        ),
                    ));
                }
                let name = match w.namespace.filter(|ns| !ns.is_empty()) {
                    Some(ns) => format!("{ns}{NAMESPACE_SEPARATOR}{}", w.name),
                    None => w.name,
                };
                self.call(w.call_id, name, w.arguments);
            }
            "custom_tool_call" => {
                let w: WireCustomToolCall = from_value_at(value, &path)?;
                note(
                    self.notes,
                    "custom_tool_call",
                    format!(
                        "{path}: the free-form input of custom tool '{}' is sent as the JSON arguments {{\"input\": …}}",
                        w.name
                    ),
                );
                self.call(w.call_id, w.name, json!({ "input": w.input }).to_string());
            }
            "local_shell_call" => {
                let w: WireLocalShellCall = from_value_at(value, &path)?;
                let Some(call_id) = w.call_id.or(w.id) else {
                    return Err(WireError::at(
                        format!("{path}.call_id"),
                        format!("{path} (local_shell_call) has no 'call_id'."),
                    ));
                };
                note(
                    self.notes,
                    "local_shell_call",
                    format!("{path}: local_shell_call sent as a call to a 'local_shell' function"),
                );
                self.call(call_id, "local_shell".into(), w.action.to_string());
            }
            "function_call_output" | "custom_tool_call_output" => {
                let w: WireCallOutput = from_value_at(value, &path)?;
                if !self.call_ids.contains(&w.call_id) {
                    return Err(WireError::at(
                        format!("{path}.call_id"),
                        format!(
                            "{path} answers call_id '{}', but no earlier call in 'input' has that call_id.",
                            w.call_id
                        ),
                    ));
                }
                let (content, content_was_string) =
                    content_parts(w.output, &format!("{path}.output"))?;
                self.close(i);
                self.messages.push(ChatMessage {
                    role: Role::Tool,
                    content,
                    reasoning: None,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(w.call_id),
                    name: None,
                    content_was_string,
                });
            }
            _ => {
                debug_assert_eq!(kind, "reasoning", "checked against ITEM_TYPES above");
                let w: WireReasoning = from_value_at(value, &path)?;
                let text = match w.content.filter(|c| !c.is_empty()) {
                    Some(parts) => parts
                        .into_iter()
                        .map(|p| match p {
                            WireReasoningPart::ReasoningText { text }
                            | WireReasoningPart::Text { text } => text,
                        })
                        .collect::<String>(),
                    None => w
                        .summary
                        .into_iter()
                        .map(|WireSummaryPart::SummaryText { text }| text)
                        .collect::<Vec<_>>()
                        .join("\n\n"),
                };
                if text.is_empty() {
                    if w.encrypted_content.is_some() {
                        note(
                            self.notes,
                            "dropped_reasoning",
                            format!("{path} carries only encrypted reasoning, which the engine cannot read"),
                        );
                    }
                    return Ok(());
                }
                self.open_assistant = false;
                self.pending_reasoning = Some(match self.pending_reasoning.take() {
                    Some((first, before)) => (first, format!("{before}\n\n{text}")),
                    None => (i, text),
                });
            }
        }
        Ok(())
    }

    /// A call joins the open assistant message or starts one.
    fn call(&mut self, call_id: String, name: String, arguments: String) {
        if !self.open_assistant {
            self.messages.push(ChatMessage {
                role: Role::Assistant,
                content: Vec::new(),
                reasoning: self.pending_reasoning.take().map(|(_, r)| r),
                tool_calls: Vec::new(),
                tool_call_id: None,
                name: None,
                content_was_string: false,
            });
            self.open_assistant = true;
        }
        self.call_ids.insert(call_id.clone());
        self.messages
            .last_mut()
            .expect("an assistant message is open")
            .tool_calls
            .push(ToolCall {
                id: call_id,
                name,
                arguments,
            });
    }

    /// A non-assistant item ends the assistant turn; reasoning with no answer after it is lost.
    fn close(&mut self, next: usize) {
        self.open_assistant = false;
        if let Some((i, _)) = self.pending_reasoning.take() {
            note(
                self.notes,
                "dropped_reasoning",
                format!("input[{i}] is reasoning followed by input[{next}] rather than an assistant message or call"),
            );
        }
    }

    fn finish(&mut self) {
        if let Some((i, _)) = self.pending_reasoning.take() {
            note(
                self.notes,
                "dropped_reasoning",
                format!("input[{i}] is reasoning at the end of the input, with no assistant message after it"),
            );
        }
    }
}

/// Message content or call output: a string or a list of content parts. `path` names the
/// field (`input[3].content`).
fn content_parts(content: Value, path: &str) -> Result<(Vec<ContentPart>, bool), WireError> {
    let parts = match content {
        Value::String(text) => return Ok((vec![ContentPart::Text { text }], true)),
        Value::Array(parts) => parts,
        other => {
            return Err(WireError::at(
                path,
                format!("Invalid value for '{path}': expected a string or an array of content parts, got {other}"),
            ))
        }
    };
    let mut out = Vec::with_capacity(parts.len());
    for (j, part) in parts.into_iter().enumerate() {
        let p = format!("{path}[{j}]");
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        out.push(match kind {
            "input_text" | "output_text" | "text" => ContentPart::Text {
                text: from_value_at::<WireTextPart>(part, &p)?.text,
            },
            "refusal" => ContentPart::Text {
                text: from_value_at::<WireRefusalPart>(part, &p)?.refusal,
            },
            "input_image" => match from_value_at::<WireImagePart>(part, &p)? {
                WireImagePart {
                    image_url: Some(url),
                    detail,
                } => ContentPart::ImageUrl { url, detail },
                WireImagePart {
                    image_url: None, ..
                } => {
                    return Err(WireError::at(
                        format!("{p}.image_url"),
                        format!("{p}: an input_image needs an 'image_url' (a URL or data: URL); tokentap cannot resolve file ids."),
                    ))
                }
            },
            other => {
                return Err(WireError::at(
                    format!("{p}.type"),
                    format!("{p} has content part type '{other}'; tokentap reads input_text, output_text, refusal and input_image (by image_url)."),
                ))
            }
        });
    }
    Ok((out, false))
}

fn tools(list: Vec<WireTool>, notes: &mut Vec<Normalization>) -> Result<Vec<ToolSpec>, WireError> {
    let mut out = Vec::new();
    for (i, t) in list.into_iter().enumerate() {
        let path = format!("tools[{i}]");
        match t.kind.as_str() {
            "function" => out.push(function_spec(t, &path)?),
            "namespace" => {
                let Some(ns) = t.name.filter(|n| !n.is_empty()) else {
                    return Err(WireError::at(
                        format!("{path}.name"),
                        format!("{path} is a namespace tool without a 'name'."),
                    ));
                };
                let mut flattened = 0;
                for (j, inner) in t.tools.unwrap_or_default().into_iter().enumerate() {
                    let inner_path = format!("{path}.tools[{j}]");
                    if inner.kind == "function" {
                        let mut spec = function_spec(inner, &inner_path)?;
                        spec.name = format!("{ns}{NAMESPACE_SEPARATOR}{}", spec.name);
                        out.push(spec);
                        flattened += 1;
                    } else {
                        note(
                            notes,
                            "dropped_tool",
                            format!("{inner_path} of type '{}' in namespace '{ns}' is not a function tool the engine can call", inner.kind),
                        );
                    }
                }
                note(
                    notes,
                    "flattened_tool_namespace",
                    format!("{path}: namespace '{ns}' offered as {flattened} function tool(s) named '{ns}{NAMESPACE_SEPARATOR}<name>'"),
                );
            }
            other => note(
                notes,
                "dropped_tool",
                format!("{path} of type '{other}' is not a function tool the engine can call"),
            ),
        }
    }
    Ok(out)
}

fn function_spec(t: WireTool, path: &str) -> Result<ToolSpec, WireError> {
    let Some(name) = t.name.filter(|n| !n.is_empty()) else {
        return Err(WireError::at(
            format!("{path}.name"),
            format!("{path} is a function tool without a 'name'."),
        ));
    };
    Ok(ToolSpec {
        name,
        description: t.description,
        parameters: t.parameters,
        strict: t.strict,
    })
}

/// Responses `tool_choice` in the Chat Completions shape the engines take.
fn tool_choice(tc: Value, notes: &mut Vec<Normalization>) -> Result<Option<Value>, WireError> {
    match &tc {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => Ok(Some(tc)),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("function") => match o.get("name").and_then(Value::as_str) {
                Some(name) => Ok(Some(json!({"type": "function", "function": {"name": name}}))),
                None => Err(WireError::at(
                    "tool_choice.name",
                    "A function 'tool_choice' needs a 'name'.",
                )),
            },
            Some("allowed_tools") => {
                let mode = o.get("mode").and_then(Value::as_str).unwrap_or("auto");
                note(
                    notes,
                    "dropped_tool_choice",
                    format!("'tool_choice' allowed_tools sent as '{mode}': the engine cannot restrict calls to a subset of the tools"),
                );
                Ok(Some(json!(mode)))
            }
            other => {
                note(
                    notes,
                    "dropped_tool_choice",
                    format!(
                        "'tool_choice' of type '{}' names a tool the engine cannot call",
                        other.unwrap_or("?")
                    ),
                );
                Ok(None)
            }
        },
        _ => Err(WireError::at(
            "tool_choice",
            format!("Invalid value for 'tool_choice': expected \"auto\", \"none\", \"required\" or an object, got {tc}"),
        )),
    }
}

/// Splits a flat tool name into Codex's `(namespace, name)`.
fn split_tool_name(flat: &str) -> (Option<&str>, &str) {
    if let Some(rest) = flat.strip_prefix(DEFAULT_NAMESPACE) {
        if let Some(name) = rest.strip_prefix(NAMESPACE_SEPARATOR) {
            return (None, name);
        }
    }
    match flat.split_once(NAMESPACE_SEPARATOR) {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() => (Some(ns), name),
        _ => (None, flat),
    }
}

/// Output item ids, derived from the response id.
struct ItemIds {
    suffix: String,
}

impl ItemIds {
    fn new(response_id: &str) -> Self {
        ItemIds {
            suffix: response_id
                .strip_prefix("resp_")
                .unwrap_or(response_id)
                .to_owned(),
        }
    }

    fn reasoning(&self, output_index: usize) -> String {
        format!("rs_{}_{output_index}", self.suffix)
    }

    fn message(&self, output_index: usize) -> String {
        format!("msg_{}_{output_index}", self.suffix)
    }

    fn function_call(&self, output_index: usize) -> String {
        format!("fc_{}_{output_index}", self.suffix)
    }

    /// The engine's tool call id, or one made up when the engine sent none.
    fn call_id(&self, engine_id: &str, output_index: usize) -> String {
        if engine_id.is_empty() {
            format!("call_{}_{output_index}", self.suffix)
        } else {
            engine_id.to_owned()
        }
    }
}

fn output_text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([output_text_part(text)])
    };
    json!({"type": "message", "id": id, "role": "assistant", "status": status, "content": content})
}

fn reasoning_item(id: &str, text: &str) -> Value {
    let summary = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "summary_text", "text": text}])
    };
    json!({"type": "reasoning", "id": id, "summary": summary})
}

fn function_call_item(
    id: &str,
    call_id: &str,
    flat_name: &str,
    arguments: &str,
    status: &str,
) -> Value {
    let (namespace, name) = split_tool_name(flat_name);
    let mut item = json!({
        "type": "function_call",
        "id": id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    });
    if let Some(ns) = namespace {
        item["namespace"] = json!(ns);
    }
    item
}

fn usage_json(u: Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        // The SDK's type requires the field; 0 where the engine did not count them.
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens.unwrap_or(0)},
        "total_tokens": u.total_tokens,
    })
}

/// How an answer ended, in Responses terms.
#[derive(Clone, Copy)]
enum Terminal {
    Completed,
    Incomplete(&'static str),
}

impl From<FinishReason> for Terminal {
    fn from(f: FinishReason) -> Self {
        match f {
            FinishReason::Length => Terminal::Incomplete("max_output_tokens"),
            FinishReason::ContentFilter => Terminal::Incomplete("content_filter"),
            FinishReason::Stop | FinishReason::ToolCalls | FinishReason::Abort => {
                Terminal::Completed
            }
        }
    }
}

impl Terminal {
    fn status(self) -> &'static str {
        match self {
            Terminal::Completed => "completed",
            Terminal::Incomplete(_) => "incomplete",
        }
    }

    fn incomplete_details(self) -> Value {
        match self {
            Terminal::Completed => Value::Null,
            Terminal::Incomplete(reason) => json!({ "reason": reason }),
        }
    }
}

/// The `response` object. Request values are echoed as OpenAI echoes them: what the request
/// set, else OpenAI's default (or null where the default is the engine's, unknown here).
fn response_object<'a>(
    meta: &'a ResponseMeta,
    status: &'a str,
    output: &'a [Value],
    usage: Option<Value>,
    incomplete_details: Value,
    error: Value,
) -> ResponseObject<'a> {
    let echo = |field: &'static str, default: &'static str| Echoed(meta.echo.get(field), default);
    ResponseObject {
        id: &meta.id,
        object: "response",
        created_at: meta.created,
        status,
        background: echo("background", "false"),
        error,
        incomplete_details,
        instructions: echo("instructions", "null"),
        max_output_tokens: echo("max_output_tokens", "null"),
        max_tool_calls: echo("max_tool_calls", "null"),
        model: &meta.model,
        output,
        parallel_tool_calls: echo("parallel_tool_calls", "true"),
        previous_response_id: None,
        prompt_cache_key: echo("prompt_cache_key", "null"),
        reasoning: echo("reasoning", r#"{"effort":null,"summary":null}"#),
        safety_identifier: echo("safety_identifier", "null"),
        service_tier: echo("service_tier", "null"),
        store: echo("store", "false"),
        temperature: echo("temperature", "null"),
        text: echo("text", r#"{"format":{"type":"text"}}"#),
        tool_choice: echo("tool_choice", r#""auto""#),
        tools: echo("tools", "[]"),
        top_logprobs: echo("top_logprobs", "null"),
        top_p: echo("top_p", "null"),
        truncation: echo("truncation", r#""disabled""#),
        usage,
        user: echo("user", "null"),
        metadata: echo("metadata", "{}"),
    }
}

/// An echoed request value: the request's JSON, else the default (JSON text).
struct Echoed<'a>(Option<&'a RawJson>, &'static str);

impl Serialize for Echoed<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Some(raw) => raw.serialize(s),
            None => {
                let default: &serde_json::value::RawValue =
                    serde_json::from_str(self.1).expect("defaults are JSON");
                default.serialize(s)
            }
        }
    }
}

/// The `response` object as it is written (a typed struct: it goes out two or three times in
/// every streamed answer, and building it as a `Value` tree each time was a tenth of the
/// renderer's cost). Fields in the order OpenAI writes them.
#[derive(Serialize)]
struct ResponseObject<'a> {
    id: &'a str,
    object: &'static str,
    created_at: u64,
    status: &'a str,
    background: Echoed<'a>,
    error: Value,
    incomplete_details: Value,
    instructions: Echoed<'a>,
    max_output_tokens: Echoed<'a>,
    max_tool_calls: Echoed<'a>,
    model: &'a str,
    output: &'a [Value],
    parallel_tool_calls: Echoed<'a>,
    previous_response_id: Option<()>,
    prompt_cache_key: Echoed<'a>,
    reasoning: Echoed<'a>,
    safety_identifier: Echoed<'a>,
    service_tier: Echoed<'a>,
    store: Echoed<'a>,
    temperature: Echoed<'a>,
    text: Echoed<'a>,
    tool_choice: Echoed<'a>,
    tools: Echoed<'a>,
    top_logprobs: Echoed<'a>,
    top_p: Echoed<'a>,
    truncation: Echoed<'a>,
    usage: Option<Value>,
    user: Echoed<'a>,
    metadata: Echoed<'a>,
}

/// The payload of the `response.*` lifecycle events.
#[derive(Serialize)]
struct ResponseEvent<'a> {
    response: &'a ResponseObject<'a>,
}

/// The payload of a text delta event (`response.output_text.delta`,
/// `response.reasoning_summary_text.delta`, `response.function_call_arguments.delta`): the
/// events every sampled token makes, written from borrowed fields.
#[derive(Serialize)]
struct DeltaEvent<'a> {
    item_id: &'a str,
    output_index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    summary_index: Option<u32>,
    delta: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<[(); 0]>,
}

/// The `error` of a failed response: OpenAI's error codes where one applies.
fn failed_error(e: &CallError) -> Value {
    let chat = error_json(e);
    let code = match (e.kind, chat["error"]["code"].as_str()) {
        (ErrorKind::ContextLengthExceeded, _) => "context_length_exceeded",
        _ if e.status == 429 => "rate_limit_exceeded",
        (_, Some(code)) => code,
        (ErrorKind::InvalidRequest | ErrorKind::BodyTooLarge, None) => "invalid_request",
        (_, None) => "server_error",
    };
    json!({"code": code, "message": e.message})
}

/// Appends one `event:`/`data:` frame of the typed stream; `type` and `sequence_number` (the
/// next of `sequence`) lead the payload, then `fields` (a JSON object), written in place: the
/// payload is not built as a tree.
fn write_event<T: Serialize + ?Sized>(
    sequence: &mut u64,
    out: &mut Vec<u8>,
    kind: &str,
    fields: &T,
) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: {\"type\":");
    serde_json::to_writer(&mut *out, kind).expect("a string always serializes");
    out.extend_from_slice(b",\"sequence_number\":");
    serde_json::to_writer(&mut *out, &*sequence).expect("a number always serializes");
    *sequence += 1;
    // `fields` is written as its own object, whose `{` then becomes the `,` that joins it
    // to the payload's first keys (`{}` becomes the payload's `}`).
    let at = out.len();
    serde_json::to_writer(&mut *out, fields).expect("event fields always serialize");
    debug_assert_eq!(out.get(at), Some(&b'{'), "event fields are a JSON object");
    if out.len() == at + 2 {
        out.truncate(at);
        out.push(b'}');
    } else {
        out[at] = b',';
    }
    out.extend_from_slice(b"\n\n");
}

/// The item being streamed.
enum Open {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        /// Which call of the canonical message this is.
        index: u32,
        call_id: String,
        name: String,
        arguments: String,
        /// Whether `response.output_item.added` went out (it waits for the name).
        announced: bool,
    },
}

/// Renders the typed `response.*` SSE events.
struct EventRenderer {
    meta: ResponseMeta,
    ids: ItemIds,
    sequence: u64,
    /// Finished output items, in order; the open item's index is `output.len()`.
    output: Vec<Value>,
    open: Option<Open>,
    done: bool,
}

impl EventRenderer {
    fn new(meta: ResponseMeta) -> Self {
        EventRenderer {
            ids: ItemIds::new(&meta.id),
            meta,
            sequence: 0,
            output: Vec::new(),
            open: None,
            done: false,
        }
    }

    /// Appends one `event:`/`data:` frame (see [`write_event`]).
    fn emit<T: Serialize + ?Sized>(&mut self, out: &mut Vec<u8>, kind: &str, fields: &T) {
        write_event(&mut self.sequence, out, kind, fields);
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    fn reasoning(&mut self, delta: &str, out: &mut Vec<u8>) {
        if !matches!(self.open, Some(Open::Reasoning { .. })) {
            self.close(out);
            let (i, id) = (self.index(), self.ids.reasoning(self.index()));
            self.emit(
                out,
                "response.output_item.added",
                &json!({"output_index": i, "item": reasoning_item(&id, "")}),
            );
            self.emit(
                out,
                "response.reasoning_summary_part.added",
                &json!({"item_id": id, "output_index": i, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
            );
            self.open = Some(Open::Reasoning {
                id,
                text: String::new(),
            });
        }
        let i = self.index();
        let Some(Open::Reasoning { id, text }) = &mut self.open else {
            unreachable!("opened above")
        };
        text.push_str(delta);
        let fields = DeltaEvent {
            item_id: id,
            output_index: i,
            content_index: None,
            summary_index: Some(0),
            delta,
            logprobs: None,
        };
        let kind = "response.reasoning_summary_text.delta";
        write_event(&mut self.sequence, out, kind, &fields);
    }

    fn text(&mut self, delta: &str, out: &mut Vec<u8>) {
        if !matches!(self.open, Some(Open::Message { .. })) {
            self.close(out);
            let (i, id) = (self.index(), self.ids.message(self.index()));
            self.emit(
                out,
                "response.output_item.added",
                &json!({"output_index": i, "item": message_item(&id, "", "in_progress")}),
            );
            self.emit(
                out,
                "response.content_part.added",
                &json!({"item_id": id, "output_index": i, "content_index": 0, "part": output_text_part("")}),
            );
            self.open = Some(Open::Message {
                id,
                text: String::new(),
            });
        }
        let i = self.index();
        let Some(Open::Message { id, text }) = &mut self.open else {
            unreachable!("opened above")
        };
        text.push_str(delta);
        let fields = DeltaEvent {
            item_id: id,
            output_index: i,
            content_index: Some(0),
            summary_index: None,
            delta,
            logprobs: Some([]),
        };
        write_event(
            &mut self.sequence,
            out,
            "response.output_text.delta",
            &fields,
        );
    }

    fn tool_call(&mut self, tc: &crate::canonical::ToolCallDelta, out: &mut Vec<u8>) {
        if !matches!(&self.open, Some(Open::Call { index, .. }) if *index == tc.index) {
            self.close(out);
            self.open = Some(Open::Call {
                id: self.ids.function_call(self.index()),
                index: tc.index,
                call_id: String::new(),
                name: String::new(),
                arguments: String::new(),
                announced: false,
            });
        }
        let Some(Open::Call {
            call_id,
            name,
            arguments,
            announced,
            ..
        }) = &mut self.open
        else {
            unreachable!("opened above")
        };
        call_id.push_str(tc.id.as_deref().unwrap_or(""));
        name.push_str(tc.name.as_deref().unwrap_or(""));
        let fragment = tc.arguments.as_deref().unwrap_or("");
        arguments.push_str(fragment);
        if !*announced {
            if !name.is_empty() {
                self.announce(out);
            }
        } else if !fragment.is_empty() {
            self.arguments_delta(fragment, out);
        }
    }

    /// Sends `response.output_item.added` for the open call, then the arguments so far.
    fn announce(&mut self, out: &mut Vec<u8>) {
        let i = self.index();
        let Some(Open::Call {
            id,
            call_id,
            name,
            arguments,
            announced,
            ..
        }) = &mut self.open
        else {
            return;
        };
        *announced = true;
        *call_id = self.ids.call_id(call_id, i);
        let item = function_call_item(id, call_id, name, "", "in_progress");
        let pending = arguments.clone();
        self.emit(
            out,
            "response.output_item.added",
            &json!({"output_index": i, "item": item}),
        );
        if !pending.is_empty() {
            self.arguments_delta(&pending, out);
        }
    }

    fn arguments_delta(&mut self, fragment: &str, out: &mut Vec<u8>) {
        let i = self.index();
        let Some(Open::Call { id, .. }) = &self.open else {
            return;
        };
        let fields = DeltaEvent {
            item_id: id,
            output_index: i,
            content_index: None,
            summary_index: None,
            delta: fragment,
            logprobs: None,
        };
        let kind = "response.function_call_arguments.delta";
        write_event(&mut self.sequence, out, kind, &fields);
    }

    /// Ends the open item: its `.done` events, then `response.output_item.done`.
    fn close(&mut self, out: &mut Vec<u8>) {
        if matches!(
            &self.open,
            Some(Open::Call {
                announced: false,
                ..
            })
        ) {
            self.announce(out);
        }
        let i = self.index();
        let item = match self.open.take() {
            None => return,
            Some(Open::Reasoning { id, text }) => {
                self.emit(
                    out,
                    "response.reasoning_summary_text.done",
                    &json!({"item_id": id, "output_index": i, "summary_index": 0, "text": text}),
                );
                self.emit(
                    out,
                    "response.reasoning_summary_part.done",
                    &json!({"item_id": id, "output_index": i, "summary_index": 0, "part": {"type": "summary_text", "text": text}}),
                );
                reasoning_item(&id, &text)
            }
            Some(Open::Message { id, text }) => {
                self.emit(
                    out,
                    "response.output_text.done",
                    &json!({"item_id": id, "output_index": i, "content_index": 0, "text": text, "logprobs": []}),
                );
                self.emit(
                    out,
                    "response.content_part.done",
                    &json!({"item_id": id, "output_index": i, "content_index": 0, "part": output_text_part(&text)}),
                );
                message_item(&id, &text, "completed")
            }
            Some(Open::Call {
                id,
                call_id,
                name,
                arguments,
                ..
            }) => {
                self.emit(
                    out,
                    "response.function_call_arguments.done",
                    &json!({"item_id": id, "output_index": i, "arguments": arguments}),
                );
                function_call_item(&id, &call_id, &name, &arguments, "completed")
            }
        };
        self.emit(
            out,
            "response.output_item.done",
            &json!({"output_index": i, "item": item}),
        );
        self.output.push(item);
    }
}

impl StreamRenderer for EventRenderer {
    fn start(&mut self, out: &mut Vec<u8>) {
        let response = response_object(
            &self.meta,
            "in_progress",
            &[],
            None,
            Value::Null,
            Value::Null,
        );
        let event = ResponseEvent {
            response: &response,
        };
        write_event(&mut self.sequence, out, "response.created", &event);
        write_event(&mut self.sequence, out, "response.in_progress", &event);
    }

    fn delta(&mut self, d: &Delta, out: &mut Vec<u8>) {
        if self.done {
            return;
        }
        if let Some(r) = d.reasoning.as_deref().filter(|r| !r.is_empty()) {
            self.reasoning(r, out);
        }
        if let Some(c) = d.content.as_deref().filter(|c| !c.is_empty()) {
            self.text(c, out);
        }
        for tc in &d.tool_calls {
            self.tool_call(tc, out);
        }
    }

    fn finish(&mut self, finish_reason: FinishReason, usage: Option<Usage>, out: &mut Vec<u8>) {
        if self.done {
            return;
        }
        self.close(out);
        self.done = true;
        let terminal = Terminal::from(finish_reason);
        let response = response_object(
            &self.meta,
            terminal.status(),
            &self.output,
            Some(usage_json(usage.unwrap_or_default())),
            terminal.incomplete_details(),
            Value::Null,
        );
        let kind = match terminal {
            Terminal::Completed => "response.completed",
            Terminal::Incomplete(_) => "response.incomplete",
        };
        write_event(
            &mut self.sequence,
            out,
            kind,
            &ResponseEvent {
                response: &response,
            },
        );
    }

    fn error(&mut self, e: &CallError, out: &mut Vec<u8>) {
        if self.done {
            return;
        }
        self.done = true;
        self.open = None;
        let response = response_object(
            &self.meta,
            "failed",
            &self.output,
            None,
            Value::Null,
            failed_error(e),
        );
        self.emit(out, "response.failed", &json!({ "response": response }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::GenerationEvent;
    use crate::stream_golden::call_delta;

    fn parse(v: Value) -> Result<ParsedCall, WireError> {
        Responses.parse(&serde_json::to_vec(&v).unwrap())
    }

    fn fixture_body(name: &str) -> Vec<u8> {
        let path = format!(
            "{}/testdata/harness-wire/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        serde_json::to_vec(&v["body"]).unwrap()
    }

    fn meta() -> ResponseMeta {
        ResponseMeta::new("resp_abc", 7, "m")
    }

    /// The stream is written byte for byte as the `Value`-built renderer wrote it.
    #[test]
    fn the_stream_is_written_byte_for_byte_as_before() {
        let out = crate::stream_golden::every_event_shape(&Responses, meta());
        crate::stream_golden::assert_golden("responses-stream.golden.sse", out);
    }

    fn kinds(notes: &[Normalization], kind: &str) -> Vec<String> {
        notes
            .iter()
            .filter(|n| n.kind == kind)
            .map(|n| n.detail.clone())
            .collect()
    }

    /// SSE frames as (event name, JSON payload); checks each frame's name matches its type.
    fn frames(out: &[u8]) -> Vec<(String, Value)> {
        tokentap_e2e::sse::typed_events(std::str::from_utf8(out).unwrap())
    }

    #[test]
    fn the_real_codex_request_parses() {
        let p = Responses.parse(&fixture_body("codex.json")).unwrap();
        let r = &p.request;
        assert_eq!(r.model, "mock-model");
        assert!(r.stream && p.include_usage);
        let roles: Vec<Role> = r.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [Role::Developer, Role::Developer, Role::User, Role::User]
        );
        assert_eq!(r.messages[1].content.len(), 2);
        assert_eq!(r.messages[3].joined_text(), "Write hi to a file");
        let names: Vec<&str> = r.tools.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names[0], "exec_command");
        assert!(names.contains(&"multi_agent_v1.spawn_agent"), "{names:?}");
        assert!(names.contains(&"get_goal"), "{names:?}");
        assert_eq!(names.len(), 4 + 5 + 3, "{names:?}");
        assert_eq!(r.tool_choice, Some(json!("auto")));
        assert_eq!(r.extra.get("parallel_tool_calls"), Some(&json!(true)));
        assert!(!r.extra.contains_key("reasoning_effort"));
        let dropped_tools = kinds(&p.normalizations, "dropped_tool");
        assert_eq!(dropped_tools.len(), 1, "{dropped_tools:?}");
        assert!(dropped_tools[0].contains("web_search"));
        let dropped = kinds(&p.normalizations, "dropped_field").join("\n");
        for field in [
            "store",
            "include",
            "prompt_cache_key",
            "client_metadata",
            "reasoning.summary",
        ] {
            assert!(
                dropped.contains(&format!("'{field}'")),
                "{field}: {dropped}"
            );
        }
    }

    #[test]
    fn codex_turn_two_pairs_the_call_with_its_output() {
        let p = Responses.parse(&fixture_body("codex-turn2.json")).unwrap();
        let m = &p.request.messages;
        assert_eq!(m.len(), 6);
        let call = &m[4];
        assert_eq!(call.role, Role::Assistant);
        assert!(call.content.is_empty());
        assert_eq!(
            call.tool_calls,
            vec![ToolCall {
                id: "call_mock_1".into(),
                name: "exec_command".into(),
                arguments: "{\"cmd\": \"echo hi > mock_tool_ran.txt\"}".into(),
            }]
        );
        let result = &m[5];
        assert_eq!(result.role, Role::Tool);
        assert_eq!(result.tool_call_id.as_deref(), Some("call_mock_1"));
        assert!(result.content_was_string);
        assert!(result.joined_text().starts_with("Chunk ID"));
    }

    #[test]
    fn instructions_string_input_and_sampling_map_to_the_canonical_request() {
        let p = parse(json!({
            "model": "m", "instructions": "Be brief.", "input": "hi",
            "temperature": 0.2, "top_p": 0.9, "max_output_tokens": 64,
            "reasoning": {"effort": "high"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": true}, "verbosity": "low"},
        }))
        .unwrap();
        let r = &p.request;
        assert_eq!(r.messages[0], ChatMessage::text(Role::System, "Be brief."));
        assert_eq!(r.messages[1], ChatMessage::text(Role::User, "hi"));
        assert!(!r.stream && p.include_usage);
        assert_eq!(
            (
                r.sampling.temperature,
                r.sampling.top_p,
                r.sampling.max_tokens
            ),
            (Some(0.2), Some(0.9), Some(64))
        );
        assert_eq!(r.extra["reasoning_effort"], "high");
        assert_eq!(
            r.extra["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}})
        );
        assert_eq!(
            kinds(&p.normalizations, "dropped_field"),
            vec!["'text.verbosity' is not forwarded to the engine"]
        );
    }

    #[test]
    fn parallel_calls_join_the_assistant_message_before_them() {
        let p = parse(json!({"model": "m", "input": [
            {"role": "user", "content": "list and count"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Two tools."}], "encrypted_content": null},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running both."}]},
            {"type": "function_call", "call_id": "a", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "b", "name": "spawn_agent", "namespace": "multi_agent_v1", "arguments": "{\"n\":1}"},
            {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "x"}]},
            {"type": "function_call_output", "call_id": "b", "output": "ok"},
            {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"},
            {"type": "function_call", "call_id": "c", "name": "ls", "arguments": ""},
            {"type": "function_call_output", "call_id": "c", "output": "y"},
        ]}))
        .unwrap();
        let m = &p.request.messages;
        assert_eq!(m.len(), 6, "{m:#?}");
        assert_eq!(m[0].role, Role::User);
        assert_eq!(m[1].role, Role::Assistant);
        assert_eq!(m[1].reasoning.as_deref(), Some("Two tools."));
        assert_eq!(m[1].joined_text(), "Running both.");
        let ids: Vec<(&str, &str)> = m[1]
            .tool_calls
            .iter()
            .map(|c| (c.id.as_str(), c.name.as_str()))
            .collect();
        assert_eq!(ids, [("a", "ls"), ("b", "multi_agent_v1.spawn_agent")]);
        assert_eq!(
            (m[2].tool_call_id.as_deref(), m[2].content_was_string),
            (Some("a"), false)
        );
        assert_eq!(m[3].tool_call_id.as_deref(), Some("b"));
        assert_eq!(m[4].tool_calls[0].id, "c");
        assert_eq!(m[4].reasoning, None);
        assert_eq!(m[5].tool_call_id.as_deref(), Some("c"));
        assert_eq!(kinds(&p.normalizations, "dropped_reasoning").len(), 1);
    }

    #[test]
    fn custom_and_local_shell_calls_are_kept_as_calls() {
        let p = parse(json!({"model": "m", "input": [
            {"role": "user", "content": "patch it"},
            {"type": "custom_tool_call", "call_id": "p", "name": "apply_patch", "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "p", "output": "done"},
            {"type": "local_shell_call", "call_id": "s", "status": "completed", "action": {"type": "exec", "command": ["ls"]}},
            {"type": "function_call_output", "call_id": "s", "output": "a.txt"},
            {"type": "web_search_call", "id": "ws", "status": "completed", "action": {"type": "search", "query": "q"}},
        ]}))
        .unwrap();
        let m = &p.request.messages;
        assert_eq!(m.len(), 5, "{m:#?}");
        assert_eq!(
            m[1].tool_calls[0].arguments,
            json!({"input": "*** Begin Patch"}).to_string()
        );
        assert_eq!(m[3].tool_calls[0].name, "local_shell");
        assert_eq!(m[4].tool_call_id.as_deref(), Some("s"));
        assert_eq!(kinds(&p.normalizations, "dropped_item").len(), 1);
    }

    #[test]
    fn unusable_tools_are_flattened_or_dropped_never_fatal() {
        let p = parse(
            json!({"model": "m", "input": "x", "tool_choice": "required", "tools": [
                {"type": "web_search", "external_web_access": true},
                {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
                {"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "c"}]},
            ]}),
        )
        .unwrap();
        assert!(p.request.tools.is_empty());
        assert_eq!(p.request.tool_choice, None);
        assert_eq!(kinds(&p.normalizations, "dropped_tool").len(), 3);
        assert_eq!(kinds(&p.normalizations, "dropped_tool_choice").len(), 1);

        let p = parse(json!({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true}]}))
        .unwrap();
        assert_eq!(
            p.request.tools,
            vec![ToolSpec {
                name: "f".into(),
                description: None,
                parameters: Some(RawJson::from_value(&json!({"type": "object"}))),
                strict: Some(true),
            }]
        );
        assert_eq!(
            p.request.tool_choice,
            Some(json!({"type": "function", "function": {"name": "f"}}))
        );
    }

    #[test]
    fn bad_input_names_the_field() {
        let e = parse(json!({"input": "x"})).unwrap_err();
        assert!(e.message.contains("model"), "{e}");
        let e = parse(json!({"model": "m"})).unwrap_err();
        assert!(e.message.contains("input"), "{e}");
        let e = parse(json!({"model": "m", "input": 3})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = parse(json!({"model": "m", "input": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = parse(json!({"model": "m", "input": [{"type": "hologram"}]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].type"));
        assert!(e.message.contains("hologram"), "{e}");
        let e = parse(json!({"model": "m", "input": [{"role": "wizard", "content": "x"}]}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].role"), "{e}");
        assert!(e.message.contains("wizard"), "{e}");
        let e = parse(json!({"model": "m", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": 5}]}]}))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].content[0].text"), "{e}");
        let e = parse(json!({"model": "m", "input": [
            {"type": "function_call_output", "call_id": "nope", "output": "x"}]}))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].call_id"));
        assert!(e.message.contains("nope"), "{e}");
        let e = parse(json!({"model": "m", "input": [
            {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{not json"}]}))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].arguments"));
        let e = parse(json!({"model": "m", "input": "x", "temperature": "hot"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = parse(json!({"model": "m", "input": "x", "tools": [{"type": "function"}]}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].name"));
        let e = parse(json!({"model": "m", "input": "x", "previous_response_id": "resp_1"}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("previous_response_id"));
        let e = parse(json!({"model": "m", "input": [
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input[0].content[0].image_url"));
    }

    #[test]
    fn errors_have_the_openai_shape() {
        let (status, body) = Responses.render_error(&WireError::at("input", "bad").into());
        assert_eq!(status, 400);
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "input", "code": null}})
        );
        let overflow = CallError::context_overflow("too long");
        let v: Value = serde_json::from_slice(&Responses.render_error(&overflow).1).unwrap();
        assert_eq!(v["error"]["code"], "context_length_exceeded");
    }

    fn accumulate(events: &[GenerationEvent]) -> GenerationAccumulator {
        let mut g = GenerationAccumulator::default();
        for e in events {
            g.push(e.clone());
        }
        g
    }

    #[test]
    fn a_whole_answer_lists_reasoning_message_and_calls() {
        let g = accumulate(&[
            GenerationEvent::Delta(Delta {
                reasoning: Some("think".into()),
                content: Some("Sure.".into()),
                ..Default::default()
            }),
            GenerationEvent::Delta(call_delta(0, Some("c1"), Some("ls"), "{}")),
            GenerationEvent::Delta(call_delta(
                1,
                Some("c2"),
                Some("multi_agent_v1.wait_agent"),
                "{\"t\":1}",
            )),
            GenerationEvent::Finished {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 4,
                    total_tokens: 7,
                    reasoning_tokens: None,
                }),
            },
        ]);
        let v: Value = serde_json::from_slice(&Responses.render_whole(&meta(), &g)).unwrap();
        assert_eq!(v["id"], "resp_abc");
        assert_eq!(v["object"], "response");
        assert_eq!(v["status"], "completed");
        assert_eq!(v["incomplete_details"], Value::Null);
        assert_eq!(v["created_at"], 7);
        let out = v["output"].as_array().unwrap();
        assert_eq!(
            out[0],
            json!({"type": "reasoning", "id": "rs_abc_0", "summary": [{"type": "summary_text", "text": "think"}]})
        );
        assert_eq!(
            out[1],
            json!({"type": "message", "id": "msg_abc_1", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Sure.", "annotations": [], "logprobs": []}]})
        );
        assert_eq!(
            out[2],
            json!({"type": "function_call", "id": "fc_abc_2", "call_id": "c1", "name": "ls", "arguments": "{}", "status": "completed"})
        );
        assert_eq!(out[3]["name"], "wait_agent");
        assert_eq!(out[3]["namespace"], "multi_agent_v1");
        assert_eq!(
            v["usage"],
            json!({"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens": 4,
                   "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7})
        );
    }

    /// What OpenAI echoes of a request in its Response object, in every copy of it.
    const ECHOED: &[&str] = &[
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "reasoning",
        "text",
        "metadata",
        "store",
        "user",
        "truncation",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "background",
        "max_tool_calls",
        "top_logprobs",
    ];

    #[test]
    fn a_response_echoes_the_request_values_as_openai_does() {
        let request = json!({"model": "m", "input": "hi", "instructions": "Be brief.",
            "max_output_tokens": 256, "temperature": 0.5, "top_p": 0.9,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": true},
                      {"type": "web_search", "external_web_access": true}],
            "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": false,
            "reasoning": {"effort": "low", "summary": "auto"},
            "text": {"format": {"type": "text"}, "verbosity": "low"},
            "metadata": {"run": "7"}, "store": false, "user": "u-1", "truncation": "auto",
            "service_tier": "flex", "prompt_cache_key": "k", "safety_identifier": "s",
            "background": false, "max_tool_calls": 3, "top_logprobs": 2});
        let p = parse(request.clone()).unwrap();
        let meta = ResponseMeta {
            echo: p.echo,
            ..meta()
        };
        let g = accumulate(&[GenerationEvent::Delta(Delta {
            content: Some("ok".into()),
            ..Default::default()
        })]);
        let whole: Value = serde_json::from_slice(&Responses.render_whole(&meta, &g)).unwrap();
        let mut r = Responses.stream_renderer(meta, true);
        let mut out = Vec::new();
        r.start(&mut out);
        r.delta(
            &Delta {
                content: Some("ok".into()),
                ..Default::default()
            },
            &mut out,
        );
        r.finish(FinishReason::Stop, None, &mut out);
        let f = frames(&out);
        let lifecycle = f.iter().filter(|(e, _)| {
            [
                "response.created",
                "response.in_progress",
                "response.completed",
            ]
            .contains(&e.as_str())
        });
        for response in std::iter::once(&whole).chain(lifecycle.map(|(_, v)| &v["response"])) {
            for &field in ECHOED {
                assert_eq!(response[field], request[field], "{field} in {response}");
            }
            assert_eq!(response["previous_response_id"], Value::Null);
        }
    }

    #[test]
    fn a_response_to_a_bare_request_has_openais_defaults() {
        let p = parse(json!({"model": "m", "input": "hi"})).unwrap();
        assert!(p.echo.is_empty());
        let g = accumulate(&[]);
        let v: Value = serde_json::from_slice(&Responses.render_whole(&meta(), &g)).unwrap();
        let defaults = json!({"instructions": null, "max_output_tokens": null, "temperature": null,
            "top_p": null, "tools": [], "tool_choice": "auto", "parallel_tool_calls": true,
            "reasoning": {"effort": null, "summary": null}, "text": {"format": {"type": "text"}},
            "metadata": {}, "store": false, "user": null, "truncation": "disabled",
            "service_tier": null, "prompt_cache_key": null, "safety_identifier": null,
            "background": false, "max_tool_calls": null, "top_logprobs": null});
        for &field in ECHOED {
            assert_eq!(v[field], defaults[field], "{field}");
        }
    }

    #[test]
    fn echoed_tools_keep_each_sse_event_on_one_line() {
        // A pretty-printed request: its tools are echoed as sent, but never with a line break
        // (a `data:` line would end there).
        let body = b"{\"model\": \"m\", \"input\": \"hi\",\n \"tools\": [\n  {\"type\": \"function\",\n   \"name\": \"f\"}\n ]\n}";
        let p = Responses.parse(body).unwrap();
        let mut r = Responses.stream_renderer(
            ResponseMeta {
                echo: p.echo,
                ..meta()
            },
            true,
        );
        let mut out = Vec::new();
        r.start(&mut out);
        let f = frames(&out);
        assert_eq!(f.len(), 2);
        assert_eq!(
            f[0].1["response"]["tools"],
            json!([{"type": "function", "name": "f"}])
        );
        let tool_errors =
            parse(json!({"model": "m", "input": "x", "tools": [{"type": "function", "name": 5}]}))
                .unwrap_err();
        assert_eq!(
            tool_errors.param.as_deref(),
            Some("tools[0].name"),
            "{tool_errors}"
        );
        assert!(
            tool_errors
                .message
                .starts_with("Invalid value for 'tools[0].name': "),
            "{tool_errors}"
        );
        // A bad tool holding a number no `Value` holds is an error, not a panic.
        let e = Responses
            .parse(br#"{"model": "m", "input": "x", "tools": [{"type": "function", "name": 5, "parameters": {"max": 1e400}}]}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"), "{e}");
        let e = parse(json!({"model": "m", "input": "x", "reasoning": {"effort": 3}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("reasoning.effort"), "{e}");
        let e = parse(json!({"model": "m", "input": "x", "text": {"format": {"type": "nope"}}}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text.format.type"), "{e}");
    }

    #[test]
    fn a_whole_answer_cut_by_length_is_incomplete() {
        let g = accumulate(&[
            GenerationEvent::Delta(Delta {
                content: Some("Once upon".into()),
                ..Default::default()
            }),
            GenerationEvent::Finished {
                finish_reason: FinishReason::Length,
                usage: None,
            },
        ]);
        let v: Value = serde_json::from_slice(&Responses.render_whole(&meta(), &g)).unwrap();
        assert_eq!(v["status"], "incomplete");
        assert_eq!(
            v["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(v["usage"]["total_tokens"], 0);
    }

    #[test]
    fn a_stream_opens_items_lazily_and_closes_them_on_switch() {
        let mut r = Responses.stream_renderer(meta(), false);
        let mut out = Vec::new();
        r.start(&mut out);
        for d in [
            Delta {
                reasoning: Some("Let me ".into()),
                ..Default::default()
            },
            Delta {
                reasoning: Some("see.".into()),
                ..Default::default()
            },
            Delta {
                content: Some("Calling.".into()),
                ..Default::default()
            },
            call_delta(0, Some("c1"), Some("ls"), "{\"a\""),
            call_delta(0, None, None, ":1}"),
            call_delta(1, Some("c2"), Some("multi_agent_v1.spawn_agent"), "{}"),
        ] {
            r.delta(&d, &mut out);
        }
        r.finish(FinishReason::ToolCalls, None, &mut out);
        let f = frames(&out);
        let names: Vec<&str> = f.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.reasoning_summary_part.added",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, (_, v)) in f.iter().enumerate() {
            assert_eq!(v["sequence_number"], i as u64);
        }
        assert_eq!(f[4].1["item_id"], "rs_abc_0");
        assert_eq!(f[4].1["summary_index"], 0);
        assert_eq!(f[6].1["text"], "Let me see.");
        assert_eq!(f[11].1["output_index"], 1);
        assert_eq!(f[11].1["item_id"], "msg_abc_1");
        assert_eq!(f[15].1["item"]["arguments"], "");
        assert_eq!(f[15].1["item"]["status"], "in_progress");
        assert_eq!(f[18].1["arguments"], "{\"a\":1}");
        assert_eq!(f[20].1["item"]["namespace"], "multi_agent_v1");
        assert_eq!(f[20].1["item"]["name"], "spawn_agent");
        let done = &f[24].1["response"];
        assert_eq!(done["status"], "completed");
        let output = done["output"].as_array().unwrap();
        assert_eq!(output.len(), 4);
        assert_eq!(output[2]["call_id"], "c1");
        assert_eq!(output[2]["arguments"], "{\"a\":1}");
        assert_eq!(done["usage"]["total_tokens"], 0);
    }

    #[test]
    fn a_call_without_a_name_yet_waits_before_it_is_announced() {
        let mut r = Responses.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.delta(&call_delta(0, None, None, "{\"x\""), &mut out);
        assert!(out.is_empty());
        r.delta(&call_delta(0, None, Some("f"), ":2}"), &mut out);
        r.finish(FinishReason::ToolCalls, None, &mut out);
        let f = frames(&out);
        assert_eq!(f[0].0, "response.output_item.added");
        assert_eq!(f[0].1["item"]["call_id"], "call_abc_0");
        assert_eq!(f[1].1["delta"], "{\"x\":2}");
        assert_eq!(f[2].0, "response.function_call_arguments.done");
    }

    #[test]
    fn length_ends_in_response_incomplete_and_errors_in_response_failed() {
        let mut r = Responses.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.delta(
            &Delta {
                content: Some("Once".into()),
                ..Default::default()
            },
            &mut out,
        );
        r.finish(FinishReason::Length, None, &mut out);
        let f = frames(&out);
        let (event, last) = f.last().unwrap();
        assert_eq!(event, "response.incomplete");
        assert_eq!(last["response"]["status"], "incomplete");
        assert_eq!(
            last["response"]["incomplete_details"]["reason"],
            "max_output_tokens"
        );

        let mut r = Responses.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        r.delta(
            &Delta {
                content: Some("Once".into()),
                ..Default::default()
            },
            &mut out,
        );
        let overflow = CallError::context_overflow("too long");
        r.error(&overflow, &mut out);
        r.finish(FinishReason::Stop, None, &mut out);
        let f = frames(&out);
        let (event, last) = f.last().unwrap();
        assert_eq!(event, "response.failed");
        assert_eq!(last["response"]["status"], "failed");
        assert_eq!(
            last["response"]["error"],
            json!({"code": "context_length_exceeded", "message": overflow.message})
        );
        let timeout = CallError::new(ErrorKind::BackendTimeout, 504, "slow");
        assert_eq!(failed_error(&timeout)["code"], "timeout");
        let down = CallError::new(ErrorKind::BackendUnavailable, 502, "down");
        assert_eq!(failed_error(&down)["code"], "server_error");
    }

    #[test]
    fn flat_names_split_into_codex_namespaces() {
        assert_eq!(
            split_tool_name("multi_agent_v1.spawn_agent"),
            (Some("multi_agent_v1"), "spawn_agent")
        );
        assert_eq!(
            split_tool_name("mcp__srv__.tool.x"),
            (Some("mcp__srv__"), "tool.x")
        );
        assert_eq!(
            split_tool_name("functions.exec_command"),
            (None, "exec_command")
        );
        assert_eq!(split_tool_name("exec_command"), (None, "exec_command"));
        assert_eq!(split_tool_name(".x"), (None, ".x"));
    }
}
