//! The canonical conversation as the message and tool dicts Hugging Face chat templates read.
//!
//! The mapping (also in the README; `tests/golden/generate.py` writes it a second time in
//! Python and the golden test checks the two agree):
//!
//! | canonical (`tokentap_schema`) | HF dict |
//! |---|---|
//! | `role` | `"role"`: `system`, `developer`, `user`, `assistant`, `tool` as is |
//! | `content` with `content_was_string` | `"content"`: the text parts joined (a string) |
//! | `content` empty, not from a string (an assistant that only calls tools) | `"content": ""` |
//! | `content` as parts | `"content"`: `[{"type":"text","text"}…]`, images `{"type":"image","url"[,"detail"]}` |
//! | `reasoning` | `"reasoning_content"` |
//! | `tool_calls` | `"tool_calls": [{"id","type":"function","function":{"name","arguments"}}]`, `arguments` the object when the text is a JSON object, else the text |
//! | `tool_call_id`, `name` | `"tool_call_id"`, `"name"` |
//! | `tools` | `[{"type":"function","function":{"name"[,"description"][,"parameters"][,"strict"]}}]` |
//!
//! An empty content that was not a string becomes `""` rather than `None`: templates test it
//! with `is string`, `| trim` or `+`, and `None` turns those into `"None"` or errors, while
//! every template handles an empty string.

use serde_json::{Map, Value};
use tokentap_schema::{ChatMessage, ChatRequest, ContentPart, ToolCall, ToolSpec};

/// The conversation's messages as HF dicts (what one passes to `apply_chat_template`).
pub fn hf_messages(request: &ChatRequest) -> Vec<Value> {
    request.messages.iter().map(hf_message).collect()
}

/// The offered tools as HF/OpenAI tool dicts; `None` when none were offered (templates test
/// `tools is not none` or `tools`).
pub fn hf_tools(request: &ChatRequest) -> Option<Vec<Value>> {
    if request.tools.is_empty() {
        None
    } else {
        Some(request.tools.iter().map(hf_tool).collect())
    }
}

pub fn hf_message(m: &ChatMessage) -> Value {
    let mut d = Map::new();
    d.insert("role".into(), Value::from(m.role.as_str()));
    let content = if m.content_was_string || m.content.is_empty() {
        Value::from(m.joined_text())
    } else {
        Value::Array(m.content.iter().map(hf_part).collect())
    };
    d.insert("content".into(), content);
    if let Some(r) = &m.reasoning {
        d.insert("reasoning_content".into(), Value::from(r.as_str()));
    }
    if !m.tool_calls.is_empty() {
        d.insert(
            "tool_calls".into(),
            Value::Array(m.tool_calls.iter().map(hf_tool_call).collect()),
        );
    }
    if let Some(id) = &m.tool_call_id {
        d.insert("tool_call_id".into(), Value::from(id.as_str()));
    }
    if let Some(name) = &m.name {
        d.insert("name".into(), Value::from(name.as_str()));
    }
    Value::Object(d)
}

fn hf_part(p: &ContentPart) -> Value {
    let mut d = Map::new();
    match p {
        ContentPart::Text { text } => {
            d.insert("type".into(), "text".into());
            d.insert("text".into(), Value::from(text.as_str()));
        }
        ContentPart::ImageUrl { url, detail } => {
            d.insert("type".into(), "image".into());
            d.insert("url".into(), Value::from(url.as_str()));
            if let Some(detail) = detail {
                d.insert("detail".into(), Value::from(detail.as_str()));
            }
        }
    }
    Value::Object(d)
}

fn hf_tool_call(c: &ToolCall) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), Value::from(c.name.as_str()));
    f.insert("arguments".into(), hf_arguments(&c.arguments));
    let mut d = Map::new();
    d.insert("id".into(), Value::from(c.id.as_str()));
    d.insert("type".into(), "function".into());
    d.insert("function".into(), Value::Object(f));
    Value::Object(d)
}

/// Templates iterate `arguments.items()` or `tojson` it, as engines pass it (vLLM and
/// llama.cpp parse the model's JSON); text that is no JSON object stays text, which a
/// template may print as is or refuse.
fn hf_arguments(text: &str) -> Value {
    match serde_json::from_str::<Value>(text) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::from(text),
    }
}

fn hf_tool(t: &ToolSpec) -> Value {
    let mut f = Map::new();
    f.insert("name".into(), Value::from(t.name.as_str()));
    if let Some(d) = &t.description {
        f.insert("description".into(), Value::from(d.as_str()));
    }
    if let Some(p) = &t.parameters {
        f.insert("parameters".into(), p.to_value());
    }
    if let Some(s) = t.strict {
        f.insert("strict".into(), Value::from(s));
    }
    let mut d = Map::new();
    d.insert("type".into(), "function".into());
    d.insert("function".into(), Value::Object(f));
    Value::Object(d)
}

/// What transformers does to each message before rendering (`_alias_reasoning_fields`,
/// transformers 5.x): a message with reasoning gets it under `thinking` too, first (gpt-oss
/// templates read that), and `reasoning_content` set (kept in place, or added last).
pub fn alias_reasoning(message: &Value) -> Value {
    let Value::Object(m) = message else {
        return message.clone();
    };
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| m.get(*k).filter(|v| !v.is_null()));
    let Some(reasoning) = reasoning else {
        return message.clone();
    };
    let mut out = Map::new();
    out.insert("thinking".into(), reasoning.clone());
    for (k, v) in m {
        out.insert(k.clone(), v.clone());
    }
    out.insert("reasoning_content".into(), reasoning.clone());
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tokentap_schema::Role;

    #[test]
    fn tool_calls_parse_object_arguments_and_keep_other_text() {
        let mut m = ChatMessage::text(Role::Assistant, "");
        m.content.clear();
        m.content_was_string = false;
        m.reasoning = Some("think".into());
        m.tool_calls = vec![
            ToolCall {
                id: "a".into(),
                name: "f".into(),
                arguments: r#"{"z": 1, "a": 2}"#.into(),
            },
            ToolCall {
                id: "b".into(),
                name: "g".into(),
                arguments: "[1]".into(),
            },
        ];
        let v = hf_message(&m);
        assert_eq!(
            serde_json::to_string(&v).unwrap(),
            r#"{"role":"assistant","content":"","reasoning_content":"think","tool_calls":[{"id":"a","type":"function","function":{"name":"f","arguments":{"z":1,"a":2}}},{"id":"b","type":"function","function":{"name":"g","arguments":"[1]"}}]}"#
        );
        let aliased = alias_reasoning(&v);
        let keys: Vec<&String> = aliased.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "thinking",
                "role",
                "content",
                "reasoning_content",
                "tool_calls"
            ]
        );
        assert_eq!(
            alias_reasoning(&json!({"role": "user"})),
            json!({"role": "user"})
        );
    }
}
