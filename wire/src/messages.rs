//! Anthropic Messages: `POST /v1/messages` (Claude Code adds `?beta=true`), streamed (SSE with
//! named events) and whole.
//!
//! Where Anthropic's wire says more than the canonical request can hold, this module decides:
//!
//! - `system` (a string or text blocks) becomes one leading system message; Claude Code's
//!   `x-anthropic-billing-header: …` line (its hash changes every call) is removed and listed as a
//!   `stripped_billing_header` normalization. `role: "system"` entries inside `messages` (Claude
//!   Code sends them) stay canonical system messages in place.
//! - A user message's `tool_result` blocks become one canonical `tool` message each, in order;
//!   the message's other blocks (text, images) follow as one user message after them, so tool
//!   answers stay right behind the assistant's calls (a `reordered_content` note when text came
//!   first). `is_error` has no canonical field: the result text is kept exactly as sent (Claude
//!   Code already words failures in it) and the errored ids are listed in one
//!   `tool_result_is_error` note. A `tool_reference` block in a result becomes the text
//!   `tool_reference: <name>` (`converted_tool_reference` note).
//! - An assistant message's `thinking` blocks become `reasoning` (several are joined with a blank
//!   line; their signatures are dropped); `redacted_thinking` is dropped with a note. Its
//!   `tool_use` blocks become tool calls whose `arguments` are the JSON text of `input`.
//! - Tools with a `type` other than `custom` are Anthropic server tools the engine cannot run:
//!   dropped (`dropped_tool`). Tools marked `defer_loading` are offered like any other (the engine
//!   has no deferred loading). A `tool_choice` left without tools is dropped
//!   (`dropped_tool_choice`); `disable_parallel_tool_use: true` becomes
//!   `parallel_tool_calls: false`.
//! - `thinking` and every other field the engine has no use for (`metadata`, `output_config`,
//!   `context_management`, …) is not forwarded and is listed as `dropped_field`.
//!
//! Answers:
//! - Stop reasons: `stop` → `end_turn`, `length` → `max_tokens`, `tool_calls` → `tool_use`,
//!   `content_filter` → `refusal`. The engine does not say which stop sequence matched, so
//!   `stop_sequence` is always null and `stop_sequence` never appears as a reason.
//! - Tool-use ids are the engine's, prefixed `toolu_` unless they already are (made up from the
//!   message id when the engine gave none). In a whole answer, arguments that are not a JSON
//!   object are sent as `{}` (the capture record keeps what the model wrote); a stream passes
//!   the argument text through as `partial_json` unchanged.
//! - Thinking blocks carry the opaque signature `tokentap.<message id>.<block index>`.
//! - Streamed blocks open lazily in the order content arrives; switching kind closes the open
//!   block. A tool block opens once its name is known. Argument fragments for a tool block that
//!   was already closed (an engine interleaving two calls) cannot be sent any more and are left
//!   out of the stream.
//! - `message_start` reports zero usage (the prompt is not counted yet); `message_delta` carries
//!   `output_tokens` and, when known, `input_tokens`.
//! - Errors: `{"type":"error","error":{"type","message"}}`; a context overflow is a 400
//!   `invalid_request_error` whose message starts "prompt is too long" (so Claude Code compacts).

use std::collections::{BTreeMap, HashSet};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokentap_schema::{ErrorKind, Normalization, RawJson, WireApi};

use super::json_body::{parse_json_body, ListItem, TextOrList};
use super::{sse_event, CallError, ParsedCall, ResponseMeta, StreamRenderer, WireCodec, WireError};
use crate::canonical::{
    ChatMessage, ChatRequest, ContentPart, Delta, FinishReason, GenerationAccumulator, Role,
    SamplingParams, ToolCall, ToolSpec, Usage,
};
use crate::engine_options::EngineOption;

/// The Anthropic Messages codec.
pub struct Messages;

/// The first line of Claude Code's system prompt; its `cch=` hash changes on every call.
const BILLING_HEADER_PREFIX: &str = "x-anthropic-billing-header:";

const BLOCK_TYPES: &str = "text, image, tool_use, tool_result, thinking, redacted_thinking";

#[derive(Deserialize)]
struct WireRequest {
    model: String,
    messages: Vec<WireMessage>,
    /// Required for generation, absent from `count_tokens` requests.
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    system: Option<WireContent>,
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
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    thinking: Option<Value>,
    #[serde(flatten)]
    other: Map<String, Value>,
}

#[derive(Deserialize)]
struct WireMessage {
    role: WireRole,
    content: WireContent,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum WireRole {
    User,
    Assistant,
    System,
}

/// Message, system or tool-result content: a plain string or a list of blocks.
type WireContent = TextOrList<WireBlock>;

impl ListItem for WireBlock {
    const CONTENT_EXPECTING: &'static str = "a string or an array of content blocks";
}

/// One content block, read in one pass whatever its `type` and wherever `type` stands among
/// its keys (Claude Code sends `tool_result` blocks with `tool_use_id` first): every field any
/// supported block has, each checked against the block's type after parsing. An internally
/// tagged enum would buffer each block into a tree first; a `Value` per block was the old way.
type WireBlock = ObjectOnly<BlockFields>;

#[derive(Deserialize)]
struct BlockFields {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    source: Option<ObjectOnly<ImageSource>>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    /// A tool call's arguments: small, and re-serialized compactly as the canonical text.
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    tool_use_id: Option<String>,
    #[serde(default)]
    content: Option<WireContent>,
    #[serde(default)]
    is_error: Option<bool>,
    #[serde(default)]
    thinking: Option<String>,
    #[serde(default)]
    tool_name: Option<String>,
}

impl ObjectKind for BlockFields {
    const EXPECTING: &'static str = "a content block object";
}

#[derive(Deserialize)]
struct ImageSource {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    media_type: Option<String>,
    #[serde(default)]
    data: Option<String>,
    #[serde(default)]
    url: Option<String>,
}

impl ObjectKind for ImageSource {
    const EXPECTING: &'static str = "an image source object";
}

/// What a JSON object read as `T` is called in an error.
trait ObjectKind {
    const EXPECTING: &'static str;
}

/// `T` read from a JSON object only: a derived struct alone would also take an array of its
/// fields in order.
struct ObjectOnly<T>(T);

impl<'de, T: Deserialize<'de> + ObjectKind> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de> + ObjectKind> serde::de::Visitor<'de> for ObjectVisitor<T> {
            type Value = ObjectOnly<T>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(T::EXPECTING)
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<ObjectOnly<T>, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(ObjectOnly)
            }
        }
        d.deserialize_map(ObjectVisitor(std::marker::PhantomData))
    }
}

/// A required field of a block that the block lacks or gives as null.
fn missing(path: &str, field: &str) -> WireError {
    let at = format!("{path}.{field}");
    WireError::at(at.clone(), format!("'{at}' is required."))
}

impl BlockFields {
    /// The block's `type`.
    fn kind(&self, path: &str) -> Result<&str, WireError> {
        self.kind.as_deref().ok_or_else(|| {
            WireError::at(
                format!("{path}.type"),
                format!("'{path}' needs a string 'type'."),
            )
        })
    }
}

/// One entry of `tools`: a tool object's small fields as a `Value` (checked and reported as
/// before), its `input_schema` kept as text (no tree per schema: agents send dozens); any other
/// JSON as a `Value`, refused later with its type named.
enum WireTool {
    Object {
        fields: Map<String, Value>,
        input_schema: Option<RawJson>,
    },
    Other(Value),
}

impl<'de> Deserialize<'de> for WireTool {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ToolVisitor;
        impl<'de> serde::de::Visitor<'de> for ToolVisitor {
            type Value = WireTool;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<WireTool, A::Error> {
                let mut fields = Map::new();
                let mut input_schema = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key == "input_schema" {
                        input_schema = map.next_value::<Option<RawJson>>()?;
                    } else {
                        fields.insert(key, map.next_value()?);
                    }
                }
                Ok(WireTool::Object {
                    fields,
                    input_schema,
                })
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<WireTool, A::Error> {
                Vec::<Value>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(|v| WireTool::Other(Value::Array(v)))
            }

            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<WireTool, E> {
                Ok(WireTool::Other(Value::Bool(v)))
            }

            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<WireTool, E> {
                Ok(WireTool::Other(v.into()))
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<WireTool, E> {
                Ok(WireTool::Other(v.into()))
            }

            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<WireTool, E> {
                Ok(WireTool::Other(v.into()))
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<WireTool, E> {
                Ok(WireTool::Other(v.into()))
            }

            fn visit_unit<E: serde::de::Error>(self) -> Result<WireTool, E> {
                Ok(WireTool::Other(Value::Null))
            }
        }
        d.deserialize_any(ToolVisitor)
    }
}

#[derive(Deserialize)]
struct CustomTool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    strict: Option<bool>,
}

/// What [`json_kind`] says of a value kept as text.
fn raw_json_kind(raw: &RawJson) -> &'static str {
    match raw.get().as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireToolChoice {
    Auto {
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    Any {
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    Tool {
        name: String,
        #[serde(default)]
        disable_parallel_tool_use: Option<bool>,
    },
    None {},
}

#[derive(Deserialize)]
struct ThinkingConfig {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    budget_tokens: Option<u64>,
}

/// Deserializes `value` (found at `path` in the request) into `T`, naming the failing field.
fn from_value_at<T: DeserializeOwned>(value: Value, path: &str) -> Result<T, WireError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let full = if inner == "." {
            path.to_owned()
        } else {
            format!("{path}.{inner}")
        };
        let msg = e.into_inner().to_string();
        WireError::at(full.clone(), format!("Invalid value for '{full}': {msg}"))
    })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn unknown_block(kind: &str, path: &str) -> WireError {
    WireError::at(
        format!("{path}.type"),
        format!(
            "'{path}.type': unknown content block type '{kind}' (expected one of {BLOCK_TYPES})."
        ),
    )
}

fn misplaced_block(kind: &str, path: &str, role: &str) -> WireError {
    WireError::at(
        format!("{path}.type"),
        format!("'{path}': a '{kind}' block cannot appear in a {role} message."),
    )
}

fn note(kind: &str, detail: impl Into<String>) -> Normalization {
    Normalization {
        kind: kind.into(),
        detail: detail.into(),
    }
}

/// Converts the request's messages, keeping track of tool-use ids and what changed.
#[derive(Default)]
struct Conversion {
    messages: Vec<ChatMessage>,
    normalizations: Vec<Normalization>,
    tool_use_ids: HashSet<String>,
    errored_results: Vec<String>,
    redacted_thinking: Vec<String>,
}

impl Conversion {
    fn system(&mut self, content: WireContent) -> Result<(), WireError> {
        let (parts, was_string) = match content {
            WireContent::Text(s) => (
                self.strip_billing_header(s, "system").into_iter().collect(),
                true,
            ),
            WireContent::List(blocks) => {
                let mut parts = Vec::new();
                for (i, ObjectOnly(b)) in blocks.into_iter().enumerate() {
                    let path = format!("system[{i}]");
                    let kind = b.kind(&path)?;
                    if kind != "text" {
                        return Err(WireError::at(
                            format!("{path}.type"),
                            format!("'{path}': system blocks must be text, not '{kind}'."),
                        ));
                    }
                    let text = b.text.ok_or_else(|| missing(&path, "text"))?;
                    parts.extend(self.strip_billing_header(text, &path));
                }
                (parts, false)
            }
        };
        if !parts.is_empty() {
            self.messages.push(ChatMessage {
                role: Role::System,
                content: parts,
                reasoning: None,
                tool_calls: Vec::new(),
                tool_call_id: None,
                name: None,
                content_was_string: was_string,
            });
        }
        Ok(())
    }

    /// The text without its billing-header lines; `None` when nothing else was in it.
    fn strip_billing_header(&mut self, text: String, path: &str) -> Option<ContentPart> {
        if !text.contains(BILLING_HEADER_PREFIX) {
            return Some(ContentPart::Text { text });
        }
        let mut kept = String::with_capacity(text.len());
        for line in text.split_inclusive('\n') {
            if line.trim_start().starts_with(BILLING_HEADER_PREFIX) {
                self.normalizations.push(note(
                    "stripped_billing_header",
                    format!("{path}: removed '{}'", line.trim_end()),
                ));
            } else {
                kept.push_str(line);
            }
        }
        (!kept.is_empty()).then_some(ContentPart::Text { text: kept })
    }

    fn message(&mut self, i: usize, m: WireMessage) -> Result<(), WireError> {
        let path = format!("messages[{i}]");
        match m.role {
            WireRole::User => self.user(&path, m.content),
            WireRole::Assistant => self.assistant(&path, m.content),
            WireRole::System => self.mid_system(&path, m.content),
        }
    }

    fn user(&mut self, path: &str, content: WireContent) -> Result<(), WireError> {
        let blocks = match content {
            WireContent::Text(s) => {
                self.messages.push(ChatMessage::text(Role::User, s));
                return Ok(());
            }
            WireContent::List(b) => b,
        };
        let mut parts = Vec::new();
        let mut tool_messages = Vec::new();
        let mut text_before_results = false;
        for (j, ObjectOnly(b)) in blocks.into_iter().enumerate() {
            let bpath = format!("{path}.content[{j}]");
            match b.kind(&bpath)? {
                "text" => parts.push(text_part(b, &bpath)?),
                "image" => parts.push(image_part(b, &bpath)?),
                "tool_result" => {
                    text_before_results |= !parts.is_empty();
                    tool_messages.push(self.tool_result(b, &bpath)?);
                }
                kind @ ("tool_use" | "thinking" | "redacted_thinking") => {
                    return Err(misplaced_block(kind, &bpath, "user"))
                }
                other => return Err(unknown_block(other, &bpath)),
            }
        }
        if text_before_results {
            self.normalizations.push(note(
                "reordered_content",
                format!("{path}: text/image blocks placed before tool_result blocks now follow the tool messages"),
            ));
        }
        let only_results = parts.is_empty() && !tool_messages.is_empty();
        self.messages.extend(tool_messages);
        if !only_results {
            self.messages.push(ChatMessage {
                role: Role::User,
                content: parts,
                reasoning: None,
                tool_calls: Vec::new(),
                tool_call_id: None,
                name: None,
                content_was_string: false,
            });
        }
        Ok(())
    }

    fn tool_result(&mut self, b: BlockFields, path: &str) -> Result<ChatMessage, WireError> {
        let tool_use_id = b.tool_use_id.ok_or_else(|| missing(path, "tool_use_id"))?;
        if !self.tool_use_ids.contains(&tool_use_id) {
            return Err(WireError::at(
                format!("{path}.tool_use_id"),
                format!(
                    "'{path}.tool_use_id': '{tool_use_id}' matches no tool_use block of an earlier assistant message."
                ),
            ));
        }
        if b.is_error == Some(true) {
            self.errored_results.push(tool_use_id.clone());
        }
        let cpath = format!("{path}.content");
        let mut m = match b.content {
            None => ChatMessage::text(Role::Tool, ""),
            Some(WireContent::Text(s)) => ChatMessage::text(Role::Tool, s),
            Some(WireContent::List(blocks)) => {
                let mut parts = Vec::new();
                for (k, ObjectOnly(b)) in blocks.into_iter().enumerate() {
                    let bpath = format!("{cpath}[{k}]");
                    match b.kind(&bpath)? {
                        "text" => parts.push(text_part(b, &bpath)?),
                        "image" => parts.push(image_part(b, &bpath)?),
                        "tool_reference" => {
                            let name = b.tool_name.ok_or_else(|| missing(&bpath, "tool_name"))?;
                            self.normalizations.push(note(
                                "converted_tool_reference",
                                format!("{bpath}: tool_reference '{name}' sent as text"),
                            ));
                            parts.push(ContentPart::Text {
                                text: format!("tool_reference: {name}"),
                            });
                        }
                        kind @ ("tool_use" | "tool_result" | "thinking" | "redacted_thinking") => {
                            return Err(misplaced_block(kind, &bpath, "tool_result"))
                        }
                        other => return Err(unknown_block(other, &bpath)),
                    }
                }
                ChatMessage {
                    content: parts,
                    content_was_string: false,
                    ..ChatMessage::text(Role::Tool, "")
                }
            }
        };
        m.tool_call_id = Some(tool_use_id);
        Ok(m)
    }

    fn assistant(&mut self, path: &str, content: WireContent) -> Result<(), WireError> {
        let blocks = match content {
            WireContent::Text(s) => {
                self.messages.push(ChatMessage::text(Role::Assistant, s));
                return Ok(());
            }
            WireContent::List(b) => b,
        };
        let mut parts = Vec::new();
        let mut reasoning: Vec<String> = Vec::new();
        let mut tool_calls = Vec::new();
        for (j, ObjectOnly(b)) in blocks.into_iter().enumerate() {
            let bpath = format!("{path}.content[{j}]");
            match b.kind(&bpath)? {
                "text" => parts.push(text_part(b, &bpath)?),
                "thinking" => {
                    reasoning.push(b.thinking.ok_or_else(|| missing(&bpath, "thinking"))?);
                }
                "redacted_thinking" => self.redacted_thinking.push(bpath),
                "tool_use" => tool_calls.push(tool_call(b, &bpath)?),
                kind @ ("image" | "tool_result") => {
                    return Err(misplaced_block(kind, &bpath, "assistant"))
                }
                other => return Err(unknown_block(other, &bpath)),
            }
        }
        self.tool_use_ids
            .extend(tool_calls.iter().map(|c| c.id.clone()));
        self.messages.push(ChatMessage {
            role: Role::Assistant,
            content: parts,
            reasoning: (!reasoning.is_empty()).then(|| reasoning.join("\n\n")),
            tool_calls,
            tool_call_id: None,
            name: None,
            content_was_string: false,
        });
        Ok(())
    }

    fn mid_system(&mut self, path: &str, content: WireContent) -> Result<(), WireError> {
        let m = match content {
            WireContent::Text(s) => ChatMessage::text(Role::System, s),
            WireContent::List(blocks) => {
                let mut parts = Vec::new();
                for (j, ObjectOnly(b)) in blocks.into_iter().enumerate() {
                    let bpath = format!("{path}.content[{j}]");
                    match b.kind(&bpath)? {
                        "text" => parts.push(text_part(b, &bpath)?),
                        kind @ ("image" | "tool_use" | "tool_result" | "thinking"
                        | "redacted_thinking") => {
                            return Err(misplaced_block(kind, &bpath, "system"))
                        }
                        other => return Err(unknown_block(other, &bpath)),
                    }
                }
                ChatMessage {
                    content: parts,
                    content_was_string: false,
                    ..ChatMessage::text(Role::System, "")
                }
            }
        };
        self.messages.push(m);
        Ok(())
    }
}

fn text_part(b: BlockFields, path: &str) -> Result<ContentPart, WireError> {
    let text = b.text.ok_or_else(|| missing(path, "text"))?;
    Ok(ContentPart::Text { text })
}

fn image_part(b: BlockFields, path: &str) -> Result<ContentPart, WireError> {
    let ObjectOnly(source) = b.source.ok_or_else(|| missing(path, "source"))?;
    let spath = format!("{path}.source");
    let url = match source.kind.as_deref() {
        Some("base64") => {
            let media_type = source
                .media_type
                .ok_or_else(|| missing(&spath, "media_type"))?;
            let data = source.data.ok_or_else(|| missing(&spath, "data"))?;
            format!("data:{media_type};base64,{data}")
        }
        Some("url") => source.url.ok_or_else(|| missing(&spath, "url"))?,
        Some(other) => {
            return Err(WireError::at(
                format!("{spath}.type"),
                format!(
                "'{spath}.type': image source '{other}' is not supported (use 'base64' or 'url')."
            ),
            ))
        }
        None => {
            return Err(WireError::at(
                format!("{spath}.type"),
                format!("'{spath}' needs a string 'type' ('base64' or 'url')."),
            ))
        }
    };
    Ok(ContentPart::ImageUrl { url, detail: None })
}

/// A `tool_use` block as a canonical tool call, its `input` object as compact JSON text.
fn tool_call(b: BlockFields, path: &str) -> Result<ToolCall, WireError> {
    let id = b.id.ok_or_else(|| missing(path, "id"))?;
    let name = b.name.ok_or_else(|| missing(path, "name"))?;
    let input = b.input.ok_or_else(|| missing(path, "input"))?;
    if !input.is_object() {
        return Err(WireError::at(
            format!("{path}.input"),
            format!(
                "'{path}.input' must be a JSON object, got {}.",
                json_kind(&input)
            ),
        ));
    }
    Ok(ToolCall {
        id,
        name,
        arguments: serde_json::to_string(&input).expect("JSON values always serialize"),
    })
}

/// Converts `tools`; server tools are dropped (and their names returned).
fn tools(
    list: Vec<WireTool>,
    normalizations: &mut Vec<Normalization>,
) -> Result<(Vec<ToolSpec>, Vec<String>), WireError> {
    let mut specs = Vec::new();
    let mut dropped = Vec::new();
    for (i, t) in list.into_iter().enumerate() {
        let path = format!("tools[{i}]");
        let (t, input_schema) = match t {
            WireTool::Object {
                fields,
                input_schema,
            } => (Value::Object(fields), input_schema),
            WireTool::Other(v) => (v, None),
        };
        if !t.is_object() {
            return Err(WireError::at(
                path.clone(),
                format!(
                    "Invalid value for '{path}': expected a tool object, got {}.",
                    json_kind(&t)
                ),
            ));
        }
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(k)) if k == "custom" => {}
            Some(Value::String(k)) => {
                let name = t
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned();
                normalizations.push(note(
                    "dropped_tool",
                    format!("{path} '{name}' of type '{k}' is an Anthropic server tool the engine cannot run"),
                ));
                dropped.push(name);
                continue;
            }
            Some(other) => {
                return Err(WireError::at(
                    format!("{path}.type"),
                    format!(
                        "Invalid value for '{path}.type': expected a string, got {}.",
                        json_kind(other)
                    ),
                ))
            }
        }
        let c: CustomTool = from_value_at(t, &path)?;
        if let Some(s) = &input_schema {
            let kind = raw_json_kind(s);
            if kind != "an object" {
                return Err(WireError::at(
                    format!("{path}.input_schema"),
                    format!("'{path}.input_schema' must be a JSON Schema object, got {kind}."),
                ));
            }
        }
        specs.push(ToolSpec {
            name: c.name,
            description: c.description,
            parameters: input_schema,
            strict: c.strict,
        });
    }
    Ok((specs, dropped))
}

/// The OpenAI-style `tool_choice` (and whether parallel calls were disabled), or `None` when it
/// was dropped.
fn tool_choice(
    value: Value,
    tools: &[ToolSpec],
    dropped_tools: &[String],
    normalizations: &mut Vec<Normalization>,
) -> Result<Option<(Value, bool)>, WireError> {
    let choice: WireToolChoice = from_value_at(value, "tool_choice")?;
    let (mapped, no_parallel, label) = match choice {
        WireToolChoice::Auto {
            disable_parallel_tool_use,
        } => (json!("auto"), disable_parallel_tool_use, "auto".to_owned()),
        WireToolChoice::Any {
            disable_parallel_tool_use,
        } => (
            json!("required"),
            disable_parallel_tool_use,
            "any".to_owned(),
        ),
        WireToolChoice::None {} => (json!("none"), None, "none".to_owned()),
        WireToolChoice::Tool {
            name,
            disable_parallel_tool_use,
        } => {
            if !tools.iter().any(|t| t.name == name) {
                if dropped_tools.contains(&name) {
                    normalizations.push(note(
                        "dropped_tool_choice",
                        format!("tool_choice names '{name}', a server tool that was dropped"),
                    ));
                    return Ok(None);
                }
                return Err(WireError::at(
                    "tool_choice.name",
                    format!("'tool_choice.name': no tool named '{name}' is in 'tools'."),
                ));
            }
            let label = format!("tool '{name}'");
            (
                json!({"type": "function", "function": {"name": name}}),
                disable_parallel_tool_use,
                label,
            )
        }
    };
    if tools.is_empty() {
        normalizations.push(note(
            "dropped_tool_choice",
            format!("tool_choice {label} dropped: no tools the engine can call remain"),
        ));
        return Ok(None);
    }
    Ok(Some((mapped, no_parallel == Some(true))))
}

fn thinking_note(value: Value) -> Result<Normalization, WireError> {
    let t: ThinkingConfig = from_value_at(value, "thinking")?;
    let what = match (t.kind.as_str(), t.budget_tokens) {
        (kind, Some(b)) => format!("{kind}, budget_tokens {b}"),
        (kind, None) => kind.to_owned(),
    };
    Ok(note(
        "dropped_field",
        format!(
            "'thinking' ({what}) is not forwarded: the engine reasons as its chat template decides"
        ),
    ))
}

/// Maps a `missing field` error at the top level to the field's path.
fn name_missing_field(e: WireError) -> WireError {
    if e.param.is_some() {
        return e;
    }
    let field = e
        .message
        .split_once("missing field `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(f, _)| f.to_owned());
    match field {
        Some(f) => WireError::at(f.clone(), format!("'{f}' is required.")),
        None => e,
    }
}

impl Messages {
    /// Parses a `POST /v1/messages/count_tokens` body: a Messages request without `max_tokens`.
    pub fn parse_count_tokens(&self, body: &[u8]) -> Result<ParsedCall, WireError> {
        self.convert(body, false)
    }

    fn convert(&self, body: &[u8], generate: bool) -> Result<ParsedCall, WireError> {
        let w: WireRequest = parse_json_body(body).map_err(name_missing_field)?;
        if generate && w.max_tokens.is_none() {
            return Err(WireError::at("max_tokens", "'max_tokens' is required."));
        }
        if w.messages.is_empty() {
            return Err(WireError::at(
                "messages",
                "'messages' must contain at least one message.",
            ));
        }
        let mut conv = Conversion::default();
        if let Some(system) = w.system {
            conv.system(system)?;
        }
        for (i, m) in w.messages.into_iter().enumerate() {
            conv.message(i, m)?;
        }
        if !conv.errored_results.is_empty() {
            let detail = format!(
                "tool results marked is_error (kept as sent; the canonical tool message has no error flag): {}",
                conv.errored_results.join(", ")
            );
            conv.normalizations
                .push(note("tool_result_is_error", detail));
        }
        if !conv.redacted_thinking.is_empty() {
            let detail = format!(
                "redacted_thinking blocks dropped (encrypted, unreadable by the engine): {}",
                conv.redacted_thinking.join(", ")
            );
            conv.normalizations
                .push(note("dropped_redacted_thinking", detail));
        }
        let mut normalizations = conv.normalizations;

        let (tools, dropped_tools) = tools(w.tools.unwrap_or_default(), &mut normalizations)?;
        let mut extra = Map::new();
        let tool_choice = match w.tool_choice {
            None | Some(Value::Null) => None,
            Some(v) => match tool_choice(v, &tools, &dropped_tools, &mut normalizations)? {
                None => None,
                Some((choice, no_parallel)) => {
                    if no_parallel {
                        extra.insert("parallel_tool_calls".into(), json!(false));
                    }
                    Some(choice)
                }
            },
        };
        if let Some(t) = w.thinking.filter(|t| !t.is_null()) {
            normalizations.push(thinking_note(t)?);
        }
        for k in w.other.keys() {
            normalizations.push(note(
                "dropped_field",
                format!("'{k}' is not forwarded to the engine"),
            ));
        }
        let request = ChatRequest {
            model: w.model,
            messages: conv.messages,
            tools,
            tool_choice,
            sampling: SamplingParams {
                temperature: w.temperature,
                top_p: w.top_p,
                top_k: w.top_k,
                max_tokens: w.max_tokens,
                stop: w.stop_sequences.unwrap_or_default(),
                ..SamplingParams::default()
            },
            stream: w.stream.unwrap_or(false),
            extra,
        };
        Ok(ParsedCall {
            request,
            include_usage: true,
            normalizations,
            // Nothing of the request is echoed in these answers but the model.
            echo: Default::default(),
        })
    }
}

impl WireCodec for Messages {
    fn api(&self) -> WireApi {
        WireApi::Messages
    }

    fn id_prefix(&self) -> &'static str {
        "msg_"
    }

    fn engine_option_param(&self, option: EngineOption) -> &'static str {
        match option {
            EngineOption::ParallelToolCalls => "tool_choice.disable_parallel_tool_use",
            other => other.name(),
        }
    }

    fn parse(&self, body: &[u8]) -> Result<ParsedCall, WireError> {
        self.convert(body, true)
    }

    fn render_whole(&self, meta: &ResponseMeta, g: &GenerationAccumulator) -> Vec<u8> {
        let mut content = Vec::new();
        if !g.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": g.reasoning, "signature": signature(&meta.id, 0)}));
        }
        if !g.content.is_empty() {
            content.push(json!({"type": "text", "text": g.content}));
        }
        for (i, c) in g.tool_calls.iter().enumerate() {
            content.push(json!({
                "type": "tool_use",
                "id": tool_use_id(&c.id, &meta.id, i as u32),
                "name": c.name,
                "input": input_object(&c.arguments),
            }));
        }
        let (finish, usage) = g.finish.unwrap_or((FinishReason::Stop, None));
        let u = usage.unwrap_or_default();
        let body = json!({
            "id": meta.id,
            "type": "message",
            "role": "assistant",
            "model": meta.model,
            "content": content,
            "stop_reason": stop_reason(finish),
            "stop_sequence": null,
            "usage": {
                "input_tokens": u.prompt_tokens,
                "output_tokens": u.completion_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        });
        serde_json::to_vec(&body).expect("JSON values always serialize")
    }

    fn stream_renderer(&self, meta: ResponseMeta, _include_usage: bool) -> Box<dyn StreamRenderer> {
        Box::new(EventRenderer {
            meta,
            next_index: 0,
            open: None,
            tools: BTreeMap::new(),
            finished: false,
            started: false,
            prompt_tokens: None,
        })
    }

    fn render_error(&self, e: &CallError) -> (u16, Vec<u8>) {
        let status = if e.kind == ErrorKind::ContextLengthExceeded {
            400
        } else {
            e.status
        };
        (
            status,
            serde_json::to_vec(&error_json(e)).expect("JSON values always serialize"),
        )
    }
}

fn stop_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop | FinishReason::Abort => "end_turn",
        FinishReason::Length => "max_tokens",
        FinishReason::ToolCalls => "tool_use",
        FinishReason::ContentFilter => "refusal",
    }
}

/// The engine's tool-call id as Anthropic clients expect it (`toolu_…`).
fn tool_use_id(engine_id: &str, message_id: &str, call_index: u32) -> String {
    if engine_id.starts_with("toolu_") {
        engine_id.to_owned()
    } else if engine_id.is_empty() {
        format!(
            "toolu_{}_{call_index}",
            message_id.strip_prefix("msg_").unwrap_or(message_id)
        )
    } else {
        format!("toolu_{engine_id}")
    }
}

/// An opaque, non-empty thinking signature (clients only echo it back).
fn signature(message_id: &str, block_index: u32) -> String {
    format!("tokentap.{message_id}.{block_index}")
}

/// Tool arguments as the `input` object; `{}` when the model's text is not a JSON object.
fn input_object(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            if !arguments.trim().is_empty() {
                tracing::warn!(
                    arguments,
                    "tool-call arguments are not a JSON object; sent to the harness as {{}}"
                );
            }
            json!({})
        }
    }
}

/// Anthropic's error type for a failed call.
fn error_type(e: &CallError) -> &'static str {
    match e.kind {
        ErrorKind::ContextLengthExceeded => "invalid_request_error",
        ErrorKind::BodyTooLarge => "request_too_large",
        ErrorKind::BackendTimeout => "timeout_error",
        _ => match e.status {
            401 => "authentication_error",
            402 => "billing_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            504 => "timeout_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        },
    }
}

/// `{"type":"error","error":{"type","message"}}`; the field path leads the message when the
/// message does not name it already.
fn error_json(e: &CallError) -> Value {
    let message = if e.kind == ErrorKind::ContextLengthExceeded {
        prompt_too_long(&e.message)
    } else {
        match &e.param {
            Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
            _ => e.message.clone(),
        }
    };
    json!({"type": "error", "error": {"type": error_type(e), "message": message}})
}

/// The overflow message Claude Code recognises: `prompt is too long: N tokens > M maximum` when
/// the engine's message gives both counts, else the engine's message after the prefix.
fn prompt_too_long(engine_message: &str) -> String {
    match overflow_counts(engine_message) {
        Some((n, m)) => format!("prompt is too long: {n} tokens > {m} maximum"),
        None => format!("prompt is too long: {engine_message}"),
    }
}

/// (prompt tokens, context size) from an engine's overflow message (llama.cpp, vLLM, SGLang
/// wordings): the context size is the first number after the last "context"; the prompt size is
/// the first other number followed by "tokens" / "input tokens", and must exceed it.
fn overflow_counts(message: &str) -> Option<(u64, u64)> {
    let lower = message.to_ascii_lowercase();
    let numbers = numbers(&lower);
    let ctx = lower.rfind("context")?;
    let &(m_start, _, m) = numbers.iter().find(|(start, _, _)| *start > ctx)?;
    numbers
        .iter()
        .filter(|(start, _, _)| *start != m_start)
        .find(|(_, end, _)| {
            let rest = lower[*end..].trim_start_matches([' ', '(']);
            rest.starts_with("tokens") || rest.starts_with("input tokens")
        })
        .map(|&(_, _, n)| (n, m))
        .filter(|&(n, m)| n > m)
}

/// Runs of ASCII digits: (start, end, value).
fn numbers(s: &str) -> Vec<(usize, usize, u64)> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if let Ok(v) = s[start..i].parse() {
                out.push((start, i, v));
            }
        } else {
            i += 1;
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockKind {
    Thinking,
    Text,
    /// A tool call, by its index among the message's calls.
    Tool(u32),
}

#[derive(Debug, Clone, Copy)]
struct OpenBlock {
    index: u32,
    kind: BlockKind,
}

/// One streamed tool call.
#[derive(Default)]
struct ToolStream {
    id: String,
    name: String,
    /// Argument text not yet sent.
    pending: String,
    /// The content block it was given, once opened.
    block: Option<u32>,
}

/// Renders `message_start` … `message_stop` events.
///
/// `message_start` carries the prompt's token count, which tokentap learns from the engine (its
/// prompt ids in the first chunk, or its usage): the event waits for the engine's first content
/// (or end, or failure), by when the count is known wherever the engine reports it early.
struct EventRenderer {
    meta: ResponseMeta,
    next_index: u32,
    open: Option<OpenBlock>,
    tools: BTreeMap<u32, ToolStream>,
    finished: bool,
    /// `message_start` was written.
    started: bool,
    /// The prompt's token count, once known.
    prompt_tokens: Option<u64>,
}

impl EventRenderer {
    /// Writes `message_start` if it has not gone out yet.
    fn message_start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        sse_event(
            out,
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": self.meta.id,
                "type": "message",
                "role": "assistant",
                "model": self.meta.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {
                    "input_tokens": self.prompt_tokens.unwrap_or(0),
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 0,
                },
            }}),
        );
    }

    fn close(&mut self, out: &mut Vec<u8>) {
        if let Some(b) = self.open.take() {
            if b.kind == BlockKind::Thinking {
                sse_event(
                    out,
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": b.index, "delta": {"type": "signature_delta", "signature": signature(&self.meta.id, b.index)}}),
                );
            }
            sse_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": b.index}),
            );
        }
    }

    /// Makes `kind` the open block, closing another one first.
    fn ensure(&mut self, kind: BlockKind, out: &mut Vec<u8>) -> u32 {
        if let Some(b) = self.open.filter(|b| b.kind == kind) {
            return b.index;
        }
        self.close(out);
        let index = self.next_index;
        self.next_index += 1;
        let block = match kind {
            BlockKind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            BlockKind::Text => json!({"type": "text", "text": ""}),
            BlockKind::Tool(call) => {
                let t = self.tools.entry(call).or_default();
                t.block = Some(index);
                json!({"type": "tool_use", "id": tool_use_id(&t.id, &self.meta.id, call), "name": t.name, "input": {}})
            }
        };
        sse_event(
            out,
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        );
        self.open = Some(OpenBlock { index, kind });
        index
    }

    fn block_delta<D: Serialize>(out: &mut Vec<u8>, index: u32, delta: &D) {
        let event = BlockDelta {
            kind: "content_block_delta",
            index,
            delta,
        };
        sse_event(out, "content_block_delta", &event);
    }

    /// Opens tool call `call` (if not yet) and sends its pending argument text.
    fn flush_tool(&mut self, call: u32, out: &mut Vec<u8>) {
        let opened = self.tools.get(&call).and_then(|t| t.block);
        let index = match opened {
            None => self.ensure(BlockKind::Tool(call), out),
            Some(i) if self.open.is_some_and(|b| b.index == i) => i,
            // Closed already: the stream cannot carry more of it.
            Some(_) => return,
        };
        let t = self.tools.get_mut(&call).expect("tool call state exists");
        if !t.pending.is_empty() {
            let partial = std::mem::take(&mut t.pending);
            Self::block_delta(
                out,
                index,
                &json!({"type": "input_json_delta", "partial_json": partial}),
            );
        }
    }
}

/// A `content_block_delta` event, written from borrowed fields (one goes out per sampled
/// token; building each as a `Value` tree cost more than writing it).
#[derive(Serialize)]
struct BlockDelta<'a, D> {
    #[serde(rename = "type")]
    kind: &'static str,
    index: u32,
    delta: &'a D,
}

#[derive(Serialize)]
struct TextDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
}

#[derive(Serialize)]
struct ThinkingDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    thinking: &'a str,
}

impl StreamRenderer for EventRenderer {
    /// Nothing yet: `message_start` waits for the prompt's token count (see [`EventRenderer`]).
    fn start(&mut self, _out: &mut Vec<u8>) {}

    fn prompt_tokens(&mut self, count: u64) {
        self.prompt_tokens.get_or_insert(count);
    }

    fn delta(&mut self, d: &Delta, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.message_start(out);
        if let Some(r) = d.reasoning.as_deref().filter(|r| !r.is_empty()) {
            let index = self.ensure(BlockKind::Thinking, out);
            let delta = ThinkingDelta {
                kind: "thinking_delta",
                thinking: r,
            };
            Self::block_delta(out, index, &delta);
        }
        if let Some(c) = d.content.as_deref().filter(|c| !c.is_empty()) {
            let index = self.ensure(BlockKind::Text, out);
            let delta = TextDelta {
                kind: "text_delta",
                text: c,
            };
            Self::block_delta(out, index, &delta);
        }
        for tc in &d.tool_calls {
            let t = self.tools.entry(tc.index).or_default();
            if t.block.is_none() {
                if let Some(id) = &tc.id {
                    t.id.push_str(id);
                }
                if let Some(name) = &tc.name {
                    t.name.push_str(name);
                }
            }
            if let Some(args) = &tc.arguments {
                t.pending.push_str(args);
            }
            if t.block.is_some() || !t.name.is_empty() {
                self.flush_tool(tc.index, out);
            }
        }
    }

    fn finish(&mut self, finish_reason: FinishReason, usage: Option<Usage>, out: &mut Vec<u8>) {
        if self.finished {
            return;
        }
        self.finished = true;
        if let Some(u) = usage {
            self.prompt_tokens.get_or_insert(u.prompt_tokens);
        }
        self.message_start(out);
        // Calls whose name never arrived still reach the harness.
        let unopened: Vec<u32> = self
            .tools
            .iter()
            .filter(|(_, t)| t.block.is_none())
            .map(|(i, _)| *i)
            .collect();
        for call in unopened {
            self.flush_tool(call, out);
        }
        self.close(out);
        // Cumulative, as Anthropic's: the prompt's count again, the cache (tokentap reports
        // none), the sampled tokens.
        let mut u = Map::new();
        if let Some(n) = self.prompt_tokens {
            u.insert("input_tokens".into(), json!(n));
        }
        u.insert("cache_creation_input_tokens".into(), json!(0));
        u.insert("cache_read_input_tokens".into(), json!(0));
        u.insert(
            "output_tokens".into(),
            json!(usage.map_or(0, |u| u.completion_tokens)),
        );
        sse_event(
            out,
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(finish_reason), "stop_sequence": null}, "usage": u}),
        );
        sse_event(out, "message_stop", &json!({"type": "message_stop"}));
    }

    fn error(&mut self, e: &CallError, out: &mut Vec<u8>) {
        self.message_start(out);
        self.finished = true;
        sse_event(out, "error", &error_json(e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::{GenerationEvent, ToolCallDelta};

    fn parse(v: Value) -> Result<ParsedCall, WireError> {
        Messages.parse(&serde_json::to_vec(&v).unwrap())
    }

    fn meta() -> ResponseMeta {
        ResponseMeta::new("msg_1", 7, "m")
    }

    /// The stream is written byte for byte as the `Value`-built renderer wrote it.
    #[test]
    fn the_stream_is_written_byte_for_byte_as_before() {
        let out = crate::stream_golden::every_event_shape(&Messages, meta());
        crate::stream_golden::assert_golden("messages-stream.golden.sse", out);
    }

    fn kinds(p: &ParsedCall) -> Vec<&str> {
        p.normalizations.iter().map(|n| n.kind.as_str()).collect()
    }

    /// SSE frames as (event, data).
    fn frames(out: &[u8]) -> Vec<(String, Value)> {
        tokentap_e2e::sse::typed_events(std::str::from_utf8(out).unwrap())
    }

    fn events(f: &[(String, Value)]) -> Vec<String> {
        f.iter()
            .map(|(e, d)| match d["delta"]["type"].as_str() {
                Some(t) if e == "content_block_delta" => format!("{e}/{t}"),
                _ => match d["content_block"]["type"].as_str() {
                    Some(t) => format!("{e}/{t}"),
                    None => e.clone(),
                },
            })
            .collect()
    }

    #[test]
    fn a_full_conversation_maps_to_canonical_messages() {
        let p = parse(json!({
            "model": "claude-x",
            "max_tokens": 1000,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                {"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}
            ],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Look"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
                    {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
                ]},
                {"role": "system", "content": "env info"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xx"},
                    {"type": "text", "text": "Running"},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"z": 1, "a": "b"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok", "is_error": false},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no such file"}], "is_error": true},
                    {"type": "text", "text": "continue"}
                ]}
            ],
            "tools": [
                {"name": "Bash", "description": "run", "input_schema": {"type": "object"}},
                {"name": "Read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
                {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
            ],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "temperature": 0.5, "top_p": 0.9, "top_k": 40,
            "stop_sequences": ["END"],
            "stream": true,
            "thinking": {"type": "enabled", "budget_tokens": 512},
            "metadata": {"user_id": "u"}
        }))
        .unwrap();
        let r = &p.request;
        assert!(p.include_usage && r.stream);
        assert_eq!(r.model, "claude-x");
        assert_eq!(r.sampling.max_tokens, Some(1000));
        assert_eq!(r.sampling.temperature, Some(0.5));
        assert_eq!(r.sampling.top_k, Some(40));
        assert_eq!(r.sampling.stop, vec!["END".to_owned()]);
        let roles: Vec<Role> = r.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                Role::System,
                Role::User,
                Role::System,
                Role::Assistant,
                Role::Tool,
                Role::Tool,
                Role::User
            ]
        );
        assert_eq!(
            r.messages[0].content,
            vec![ContentPart::Text {
                text: "You are helpful.".into()
            }]
        );
        assert_eq!(
            r.messages[1].content[1],
            ContentPart::ImageUrl {
                url: "data:image/png;base64,iVBO".into(),
                detail: None
            }
        );
        assert_eq!(
            r.messages[1].content[2],
            ContentPart::ImageUrl {
                url: "https://x/y.png".into(),
                detail: None
            }
        );
        assert!(r.messages[2].content_was_string);
        let a = &r.messages[3];
        assert_eq!(a.reasoning.as_deref(), Some("hmm"));
        assert_eq!(a.joined_text(), "Running");
        assert_eq!(a.tool_calls[0].arguments, r#"{"z":1,"a":"b"}"#);
        assert_eq!(a.tool_calls[1].arguments, "{}");
        assert_eq!(r.messages[4].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(r.messages[4].joined_text(), "ok");
        assert_eq!(r.messages[5].tool_call_id.as_deref(), Some("toolu_2"));
        assert_eq!(r.messages[5].joined_text(), "no such file");
        assert_eq!(r.messages[6].joined_text(), "continue");
        assert_eq!(r.tools.len(), 2);
        assert_eq!(
            r.tools[0].parameters,
            Some(RawJson::from_value(&json!({"type": "object"})))
        );
        assert_eq!(r.tool_choice, Some(json!("required")));
        assert_eq!(r.extra.get("parallel_tool_calls"), Some(&json!(false)));
        let k = kinds(&p);
        for want in [
            "stripped_billing_header",
            "tool_result_is_error",
            "dropped_redacted_thinking",
            "dropped_tool",
            "dropped_field",
        ] {
            assert!(k.contains(&want), "{want} missing from {k:?}");
        }
        let details: Vec<&str> = p.normalizations.iter().map(|n| n.detail.as_str()).collect();
        assert!(details.iter().any(|d| d.contains("toolu_2")), "{details:?}");
        assert!(details.iter().any(|d| d.contains("metadata")));
        assert!(details.iter().any(|d| d.contains("budget_tokens 512")));
        assert!(details.iter().any(|d| d.contains("cch=abc")));
    }

    #[test]
    fn billing_header_lines_are_cut_from_string_systems_and_longer_blocks() {
        let p = parse(json!({"model": "m", "max_tokens": 5,
            "system": "x-anthropic-billing-header: cch=1;\nYou are a bot.",
            "messages": [{"role": "user", "content": "hi"}]}))
        .unwrap();
        assert_eq!(p.request.messages[0].joined_text(), "You are a bot.");
        assert!(p.request.messages[0].content_was_string);
        let p = parse(json!({"model": "m", "max_tokens": 5,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}],
            "messages": [{"role": "user", "content": "hi"}]}))
        .unwrap();
        assert_eq!(p.request.messages.len(), 1, "an emptied system is dropped");
        assert_eq!(p.request.messages[0].role, Role::User);
    }

    #[test]
    fn tool_choice_maps_and_is_dropped_without_tools() {
        let base = |choice: Value, tools: Value| {
            parse(
                json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": choice}),
            )
        };
        let bash = json!([{"name": "Bash", "input_schema": {"type": "object"}}]);
        assert_eq!(
            base(json!({"type": "auto"}), bash.clone())
                .unwrap()
                .request
                .tool_choice,
            Some(json!("auto"))
        );
        assert_eq!(
            base(json!({"type": "none"}), bash.clone())
                .unwrap()
                .request
                .tool_choice,
            Some(json!("none"))
        );
        assert_eq!(
            base(json!({"type": "tool", "name": "Bash"}), bash.clone())
                .unwrap()
                .request
                .tool_choice,
            Some(json!({"type": "function", "function": {"name": "Bash"}}))
        );
        let p = base(json!({"type": "auto"}), json!([])).unwrap();
        assert_eq!(p.request.tool_choice, None);
        assert_eq!(kinds(&p), ["dropped_tool_choice"]);
        let p = base(
            json!({"type": "tool", "name": "web_search"}),
            json!([{"type": "web_search_20250305", "name": "web_search"}]),
        )
        .unwrap();
        assert_eq!(p.request.tool_choice, None);
        assert!(p.request.tools.is_empty());
        assert_eq!(kinds(&p), ["dropped_tool", "dropped_tool_choice"]);
        let e = base(json!({"type": "tool", "name": "Nope"}), bash.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice.name"));
        let e = base(json!({"type": "maybe"}), bash).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice.type"), "{e}");
        assert!(e.message.contains("maybe"), "{e}");
    }

    #[test]
    fn bad_input_names_the_field() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let e = parse(json!({"model": "m", "messages": msgs})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e}");
        let e = parse(json!({"max_tokens": 5, "messages": msgs})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": 5})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": "5", "messages": msgs})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": [{"role": "wizard", "content": "x"}]}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"), "{e}");
        let e = parse(
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": 5}]}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}))
            .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].type"),
            "{e}"
        );
        assert!(
            e.message.contains("unknown content block type 'video'"),
            "{e}"
        );
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}))
            .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].text"),
            "{e}"
        );
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": "ls"}]}
        ]}))
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].input"),
            "{e}"
        );
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}
        ]}))
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[1].content[0].tool_use_id"),
            "{e}"
        );
        assert!(e.message.contains("toolu_9"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}
        ]}))
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].type"),
            "{e}"
        );
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": msgs, "tools": [{"name": "f", "input_schema": "x"}]}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0].input_schema"), "{e}");
        let e = parse(json!({"model": "m", "max_tokens": 5, "messages": msgs, "tools": [{"description": "f"}]}))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[0]"), "{e}");
        assert!(e.message.contains("name"), "{e}");
        let e = parse(
            json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
        )
        .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].source.type"),
            "{e}"
        );
        let e = Messages.parse(b"[1]").unwrap_err();
        assert!(e.message.contains("JSON object"), "{e}");
    }

    /// Blocks are read in one pass whatever the order of their keys; a block must be an
    /// object with its type's fields; a repeated key counts once, the last (as a `Value` did).
    #[test]
    fn blocks_are_objects_read_in_any_key_order() {
        let body = br#"{"model":"m","max_tokens":5,"messages":[
            {"role":"assistant","content":[{"input":{"b":1,"a":2},"name":"f","id":"toolu_1","type":"tool_use"}]},
            {"role":"user","content":[
                {"tool_use_id":"toolu_1","content":[{"text":"out","type":"text"}],"type":"tool_result","is_error":true},
                {"text":"first","type":"text","text":"last"},
                {"source":{"data":"QQ==","media_type":"image/png","type":"base64"},"type":"image"}
            ]}]}"#;
        let p = Messages.parse(body).unwrap();
        let m = &p.request.messages;
        assert_eq!(m[0].tool_calls[0].arguments, r#"{"b":1,"a":2}"#);
        assert_eq!(m[1].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(m[1].joined_text(), "out");
        assert_eq!(m[2].joined_text(), "last");
        assert_eq!(
            m[2].content[1],
            ContentPart::ImageUrl {
                url: "data:image/png;base64,QQ==".into(),
                detail: None
            }
        );
        assert!(kinds(&p).contains(&"tool_result_is_error"));

        let user = |content: Value| {
            parse(json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": content}]}))
                .unwrap_err()
        };
        let e = user(json!([["text", "hi"]]));
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0]"), "{e}");
        assert!(e.message.contains("a content block object"), "{e}");
        for text in [json!(null), json!("absent")] {
            let mut block = json!({"type": "text", "text": text});
            if block["text"] == "absent" {
                block.as_object_mut().unwrap().remove("text");
            }
            let e = user(json!([block]));
            assert_eq!(
                e.param.as_deref(),
                Some("messages[0].content[0].text"),
                "{e}"
            );
            assert!(e.message.contains("is required"), "{e}");
        }
        let e = user(json!([{"text": "hi"}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].type"),
            "{e}"
        );
        let e = user(json!([{"type": 7, "text": "hi"}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].type"),
            "{e}"
        );
        let e = user(json!([{"type": "image", "source": ["base64", "image/png", "QQ=="]}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].source"),
            "{e}"
        );
        let e = user(json!([{"type": "image", "source": {"type": "base64", "data": "QQ=="}}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].source.media_type"),
            "{e}"
        );
        let e = user(json!([{"type": "tool_result", "content": "x"}]));
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].tool_use_id"),
            "{e}"
        );
        let e = parse(
            json!({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": 1}],
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("system[0].text"), "{e}");
    }

    #[test]
    fn text_before_tool_results_moves_after_them() {
        let p = parse(json!({"model": "m", "max_tokens": 5, "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "note"},
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "a"},
                    {"type": "tool_reference", "tool_name": "Grep"}
                ]}
            ]}
        ]}))
        .unwrap();
        let m = &p.request.messages;
        assert_eq!(m[1].role, Role::Tool);
        assert_eq!(m[1].joined_text(), "atool_reference: Grep");
        assert_eq!(m[2].role, Role::User);
        assert_eq!(m[2].joined_text(), "note");
        assert_eq!(kinds(&p), ["converted_tool_reference", "reordered_content"]);
    }

    fn acc(events: Vec<GenerationEvent>) -> GenerationAccumulator {
        let mut g = GenerationAccumulator::default();
        for e in events {
            g.push(e);
        }
        g
    }

    #[test]
    fn a_whole_answer_has_thinking_text_and_tool_use_blocks() {
        let g = acc(vec![
            GenerationEvent::Delta(Delta {
                reasoning: Some("think".into()),
                content: Some("Doing it".into()),
                tool_calls: vec![
                    ToolCallDelta {
                        index: 0,
                        id: Some("call_a".into()),
                        name: Some("Bash".into()),
                        arguments: Some(r#"{"command":"ls"}"#.into()),
                    },
                    ToolCallDelta {
                        index: 1,
                        id: None,
                        name: Some("Read".into()),
                        arguments: Some("not json".into()),
                    },
                ],
            }),
            GenerationEvent::Finished {
                finish_reason: FinishReason::ToolCalls,
                usage: Some(Usage {
                    prompt_tokens: 11,
                    completion_tokens: 4,
                    total_tokens: 15,
                    reasoning_tokens: None,
                }),
            },
        ]);
        let v: Value = serde_json::from_slice(&Messages.render_whole(&meta(), &g)).unwrap();
        assert_eq!(
            v,
            json!({
                "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                "content": [
                    {"type": "thinking", "thinking": "think", "signature": "tokentap.msg_1.0"},
                    {"type": "text", "text": "Doing it"},
                    {"type": "tool_use", "id": "toolu_call_a", "name": "Bash", "input": {"command": "ls"}},
                    {"type": "tool_use", "id": "toolu_1_1", "name": "Read", "input": {}}
                ],
                "stop_reason": "tool_use", "stop_sequence": null,
                "usage": {"input_tokens": 11, "output_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
            })
        );
        let g = acc(vec![GenerationEvent::Finished {
            finish_reason: FinishReason::Length,
            usage: None,
        }]);
        let v: Value = serde_json::from_slice(&Messages.render_whole(&meta(), &g)).unwrap();
        assert_eq!(v["content"], json!([]));
        assert_eq!(v["stop_reason"], "max_tokens");
        assert_eq!(v["usage"]["output_tokens"], 0);
    }

    #[test]
    fn a_stream_opens_blocks_lazily_and_closes_on_switch() {
        let mut r = Messages.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        let d = |reasoning: Option<&str>, content: Option<&str>, tc: Vec<ToolCallDelta>| Delta {
            reasoning: reasoning.map(Into::into),
            content: content.map(Into::into),
            tool_calls: tc,
        };
        r.delta(&d(Some("a"), None, vec![]), &mut out);
        r.delta(&d(Some("b"), Some("Hi"), vec![]), &mut out);
        r.delta(&d(None, Some(""), vec![]), &mut out);
        r.delta(
            &d(
                None,
                None,
                vec![ToolCallDelta {
                    index: 0,
                    id: Some("toolu_x".into()),
                    name: Some("Bash".into()),
                    arguments: Some("".into()),
                }],
            ),
            &mut out,
        );
        r.delta(
            &d(
                None,
                None,
                vec![
                    ToolCallDelta {
                        index: 0,
                        arguments: Some("{\"c\":".into()),
                        ..Default::default()
                    },
                    ToolCallDelta {
                        index: 0,
                        arguments: Some("1}".into()),
                        ..Default::default()
                    },
                ],
            ),
            &mut out,
        );
        // The second call's name arrives after its first argument fragment.
        r.delta(
            &d(
                None,
                None,
                vec![ToolCallDelta {
                    index: 1,
                    id: Some("c2".into()),
                    arguments: Some("{".into()),
                    ..Default::default()
                }],
            ),
            &mut out,
        );
        r.delta(
            &d(
                None,
                None,
                vec![ToolCallDelta {
                    index: 1,
                    name: Some("Read".into()),
                    arguments: Some("}".into()),
                    ..Default::default()
                }],
            ),
            &mut out,
        );
        r.finish(
            FinishReason::ToolCalls,
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 3,
                total_tokens: 12,
                reasoning_tokens: None,
            }),
            &mut out,
        );
        let f = frames(&out);
        assert_eq!(
            events(&f),
            [
                "message_start",
                "content_block_start/thinking",
                "content_block_delta/thinking_delta",
                "content_block_delta/thinking_delta",
                "content_block_delta/signature_delta",
                "content_block_stop",
                "content_block_start/text",
                "content_block_delta/text_delta",
                "content_block_stop",
                "content_block_start/tool_use",
                "content_block_delta/input_json_delta",
                "content_block_delta/input_json_delta",
                "content_block_stop",
                "content_block_start/tool_use",
                "content_block_delta/input_json_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        let idx: Vec<Value> = f.iter().map(|(_, d)| d["index"].clone()).collect();
        assert_eq!(idx[1..16].iter().filter_map(Value::as_u64).max(), Some(3));
        assert_eq!(f[0].1["message"]["content"], json!([]));
        // Nothing told the renderer the prompt's size before the content began.
        assert_eq!(f[0].1["message"]["usage"]["input_tokens"], 0);
        assert_eq!(
            f[1].1["content_block"],
            json!({"type": "thinking", "thinking": "", "signature": ""})
        );
        assert_eq!(f[4].1["delta"]["signature"], "tokentap.msg_1.0");
        assert_eq!(f[6].1["index"], 1);
        assert_eq!(
            f[9].1["content_block"],
            json!({"type": "tool_use", "id": "toolu_x", "name": "Bash", "input": {}})
        );
        assert_eq!(f[10].1["delta"]["partial_json"], "{\"c\":");
        assert_eq!(f[11].1["delta"]["partial_json"], "1}");
        assert_eq!(
            f[13].1["content_block"],
            json!({"type": "tool_use", "id": "toolu_c2", "name": "Read", "input": {}})
        );
        assert_eq!(f[14].1["delta"]["partial_json"], "{}");
        assert_eq!(f[15].1["index"], 3);
        assert_eq!(
            f[16].1,
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                   "usage": {"input_tokens": 9, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 3}})
        );
    }

    #[test]
    fn message_start_waits_for_the_engine_and_carries_the_prompts_token_count() {
        let text = Delta {
            content: Some("Hi".into()),
            ..Default::default()
        };
        let usage = Usage {
            prompt_tokens: 42,
            completion_tokens: 2,
            total_tokens: 44,
            reasoning_tokens: None,
        };
        // The prompt ids come with the engine's first chunk (vLLM, SGLang).
        let mut r = Messages.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        assert!(out.is_empty(), "message_start waits for the engine");
        r.prompt_tokens(42);
        assert!(out.is_empty());
        r.delta(&text, &mut out);
        r.finish(FinishReason::Stop, Some(usage), &mut out);
        let f = frames(&out);
        assert_eq!(f[0].0, "message_start");
        assert_eq!(
            f[0].1["message"]["usage"],
            json!({"input_tokens": 42, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0})
        );
        let delta = &f[f.len() - 2].1;
        assert_eq!(delta["usage"]["input_tokens"], 42);
        assert_eq!(delta["usage"]["output_tokens"], 2);

        // An answer with no content before its end takes the count from the engine's usage.
        let mut r = Messages.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        r.finish(FinishReason::Stop, Some(usage), &mut out);
        let f = frames(&out);
        assert_eq!(
            events(&f),
            ["message_start", "message_delta", "message_stop"]
        );
        assert_eq!(f[0].1["message"]["usage"]["input_tokens"], 42);

        // A failure before any content still opens the message first.
        let mut r = Messages.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        r.prompt_tokens(7);
        r.error(
            &CallError::new(ErrorKind::BackendUnavailable, 502, "down"),
            &mut out,
        );
        let f = frames(&out);
        assert_eq!(events(&f), ["message_start", "error"]);
        assert_eq!(f[0].1["message"]["usage"]["input_tokens"], 7);
    }

    #[test]
    fn a_stream_without_content_still_ends_properly() {
        let mut r = Messages.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.start(&mut out);
        r.finish(FinishReason::Length, None, &mut out);
        let f = frames(&out);
        assert_eq!(
            events(&f),
            ["message_start", "message_delta", "message_stop"]
        );
        assert_eq!(f[1].1["delta"]["stop_reason"], "max_tokens");
        assert_eq!(
            f[1].1["usage"],
            json!({"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0})
        );
    }

    #[test]
    fn errors_have_the_anthropic_shape_and_type_per_status() {
        let body = |e: &CallError| {
            let (s, b) = Messages.render_error(e);
            (s, serde_json::from_slice::<Value>(&b).unwrap())
        };
        let (s, v) = body(
            &WireError::at("messages", "'messages' must contain at least one message.").into(),
        );
        assert_eq!(s, 400);
        assert_eq!(
            v,
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "'messages' must contain at least one message."}})
        );
        let (_, v) = body(&WireError::at("max_tokens", "bad").into());
        assert_eq!(v["error"]["message"], "max_tokens: bad");
        let cases = [
            (ErrorKind::InvalidRequest, 401, "authentication_error"),
            (ErrorKind::InvalidRequest, 403, "permission_error"),
            (ErrorKind::InvalidRequest, 404, "not_found_error"),
            (ErrorKind::BodyTooLarge, 413, "request_too_large"),
            (ErrorKind::BackendError, 429, "rate_limit_error"),
            (ErrorKind::BackendError, 502, "api_error"),
            (ErrorKind::BackendUnavailable, 502, "api_error"),
            (ErrorKind::BackendUnavailable, 503, "overloaded_error"),
            (ErrorKind::BackendTimeout, 504, "timeout_error"),
            (ErrorKind::Internal, 500, "api_error"),
        ];
        for (kind, status, want) in cases {
            let (s, v) = body(&CallError::new(kind, status, "x"));
            assert_eq!((s, v["error"]["type"].as_str()), (status, Some(want)));
        }
        let (s, v) = body(&CallError::new(
            ErrorKind::BackendTimeout,
            504,
            "backend timed out: t",
        ));
        assert_eq!(
            (s, v["error"]["type"].as_str()),
            (504, Some("timeout_error"))
        );
    }

    #[test]
    fn a_context_overflow_says_prompt_is_too_long() {
        let overflow = |m: &str| {
            let e = CallError::context_overflow(m);
            let (s, b) = Messages.render_error(&e);
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(s, 400);
            assert_eq!(v["error"]["type"], "invalid_request_error");
            v["error"]["message"].as_str().unwrap().to_owned()
        };
        assert_eq!(
            overflow("request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it"),
            "prompt is too long: 5000 tokens > 4096 maximum"
        );
        assert_eq!(
            overflow("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in the messages, 1000 in the completion)."),
            "prompt is too long: 5000 tokens > 4096 maximum"
        );
        assert_eq!(
            overflow(
                "The input (9000 tokens) is longer than the model's context length (8192 tokens)."
            ),
            "prompt is too long: 9000 tokens > 8192 maximum"
        );
        let m = overflow("the request exceeds the available context size");
        assert!(m.starts_with("prompt is too long: "), "{m}");
        assert!(
            m.ends_with("the request exceeds the available context size"),
            "{m}"
        );
        // Counts that do not show an overflow are not trusted.
        let m = overflow("maximum context length is 4096 tokens and your request has 3500 input tokens (1000 > 4096 - 3500)");
        assert!(m.contains("your request has 3500"), "{m}");
        // In-stream errors use the same body under `event: error`.
        let mut r = Messages.stream_renderer(meta(), true);
        let mut out = Vec::new();
        r.error(
            &CallError::new(ErrorKind::BackendUnavailable, 503, "engine busy"),
            &mut out,
        );
        assert_eq!(
            frames(&out).pop(),
            Some((
                "error".to_owned(),
                json!({"type": "error", "error": {"type": "overloaded_error", "message": "engine busy"}})
            ))
        );
    }
}
