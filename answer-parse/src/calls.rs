//! One call's body, between its markers, read into a [`ToolCall`] for each family. A body that
//! does not read is an error with its reason; the stream then hands the raw text out as
//! content (what the model wrote stays visible, never silently dropped).

use std::collections::HashMap;

use serde_json::value::RawValue;
use serde_json::Value;

use crate::answer::ToolCall;
use crate::family::Family;

/// What each offered tool's parameters are declared as, for the families that write each
/// parameter as bare text (Qwen3-Coder, GLM): a parameter declared `string` is that text; one
/// declared otherwise is read as JSON (the templates write such values with `tojson`), and
/// stays text if it is not JSON. A tool or parameter the request did not declare is text, as
/// vLLM and SGLang read it.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas {
    non_string: HashMap<String, Vec<String>>,
}

impl ToolSchemas {
    /// From the request's `tools`, in any of the three wire APIs' shapes: Chat Completions'
    /// `{"type": "function", "function": {"name", "parameters"}}`, Responses'
    /// `{"type": "function", "name", "parameters"}`, Messages' `{"name", "input_schema"}`.
    pub fn from_tools(tools: &[Value]) -> ToolSchemas {
        let mut non_string = HashMap::new();
        for tool in tools {
            let Some((name, schema)) = function_of(tool) else {
                continue;
            };
            let Some(properties) = schema
                .and_then(|s| s.get("properties"))
                .and_then(Value::as_object)
            else {
                continue;
            };
            let keys = properties
                .iter()
                .filter(|(_, p)| !declared_string(p))
                .map(|(k, _)| k.clone())
                .collect();
            non_string.insert(name.to_string(), keys);
        }
        ToolSchemas { non_string }
    }

    fn is_json(&self, tool: &str, parameter: &str) -> bool {
        self.non_string
            .get(tool)
            .is_some_and(|keys| keys.iter().any(|k| k == parameter))
    }
}

/// A tool's function name and parameters' schema, in any of the three wire APIs' shapes.
pub(crate) fn function_of(tool: &Value) -> Option<(&str, Option<&Value>)> {
    let function = tool.get("function").unwrap_or(tool);
    let name = function.get("name").and_then(Value::as_str)?;
    let schema = function
        .get("parameters")
        .or_else(|| function.get("input_schema"));
    Some((name, schema))
}

/// `"type": "string"`, `["string", "null"]`, or no type at all (anything goes: keep the text).
pub(crate) fn declared_string(property: &Value) -> bool {
    match property.get("type") {
        None => true,
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(types)) => types
            .iter()
            .filter(|t| t.as_str() != Some("null"))
            .all(|t| t.as_str() == Some("string")),
        Some(_) => true,
    }
}

pub(crate) fn read_call(
    family: Family,
    body: &str,
    schemas: &ToolSchemas,
) -> Result<ToolCall, String> {
    match family {
        Family::Hermes => hermes(body),
        Family::Qwen3Coder => qwen3_coder(body, schemas),
        Family::Glm45 => glm45(body, schemas),
        Family::DeepSeekV3 => deepseek(body),
        Family::Llama3Json => Err("Llama 3 calls are read from the whole answer".into()),
    }
}

/// `{"name": "…", "arguments": {…}}`; the arguments' own text is kept.
fn hermes(body: &str) -> Result<ToolCall, String> {
    #[derive(serde::Deserialize)]
    struct Call<'a> {
        name: String,
        #[serde(borrow, default)]
        arguments: Option<&'a RawValue>,
    }
    let call: Call = serde_json::from_str(body.trim()).map_err(|e| format!("call JSON: {e}"))?;
    Ok(ToolCall {
        name: call.name,
        arguments: arguments_object(call.arguments.map(RawValue::get))?,
    })
}

/// The arguments as a JSON object's text: an object as written, a JSON string holding an
/// object (a template that wrote OpenAI's string arguments with `tojson`) unwrapped, nothing
/// as `{}`.
fn arguments_object(raw: Option<&str>) -> Result<String, String> {
    let Some(raw) = raw else {
        return Ok("{}".into());
    };
    let raw = raw.trim();
    match serde_json::from_str::<Value>(raw) {
        Ok(Value::Object(_)) => Ok(raw.to_string()),
        Ok(Value::String(inner))
            if matches!(serde_json::from_str(&inner), Ok(Value::Object(_))) =>
        {
            Ok(inner)
        }
        Ok(other) => Err(format!("arguments are not an object: {other}")),
        Err(e) => Err(format!("arguments JSON: {e}")),
    }
}

/// `<function=NAME>` then `<parameter=KEY>\nVALUE\n</parameter>` each, then `</function>`.
fn qwen3_coder(body: &str, schemas: &ToolSchemas) -> Result<ToolCall, String> {
    let rest = body.trim();
    let rest = rest
        .strip_prefix("<function=")
        .ok_or("no <function=NAME>")?;
    let (name, mut rest) = rest.split_once('>').ok_or("unclosed <function=")?;
    let name = name.trim();
    let mut params = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return Err("text after </function>".into());
            }
            break;
        }
        let after = rest
            .strip_prefix("<parameter=")
            .ok_or("expected <parameter=KEY> or </function>")?;
        let (key, after) = after.split_once('>').ok_or("unclosed <parameter=")?;
        let (value, after) = after
            .split_once("</parameter>")
            .ok_or("unclosed <parameter>")?;
        params.push((key.trim(), one_newline_each_side(value)));
        rest = after;
    }
    object_from_parameters(name, &params, schemas)
}

/// `NAME`, then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` each.
fn glm45(body: &str, schemas: &ToolSchemas) -> Result<ToolCall, String> {
    let (name, mut rest) = match body.find("<arg_key>") {
        Some(at) => (&body[..at], &body[at..]),
        None => (body, ""),
    };
    let mut params = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix("<arg_key>").ok_or("expected <arg_key>")?;
        let (key, after) = after.split_once("</arg_key>").ok_or("unclosed <arg_key>")?;
        let after = after
            .trim_start()
            .strip_prefix("<arg_value>")
            .ok_or("<arg_key> without <arg_value>")?;
        let (value, after) = after
            .split_once("</arg_value>")
            .ok_or("unclosed <arg_value>")?;
        params.push((key.trim(), value));
        rest = after;
    }
    object_from_parameters(name.trim(), &params, schemas)
}

/// Qwen3-Coder writes each value between two newlines of its own.
fn one_newline_each_side(value: &str) -> &str {
    let value = value.strip_prefix('\n').unwrap_or(value);
    value.strip_suffix('\n').unwrap_or(value)
}

fn object_from_parameters(
    name: &str,
    params: &[(&str, &str)],
    schemas: &ToolSchemas,
) -> Result<ToolCall, String> {
    if name.is_empty() || name.contains(['<', '>', '\n']) {
        return Err(format!("not a function name: {name:?}"));
    }
    let mut arguments = String::from("{");
    for (i, (key, value)) in params.iter().enumerate() {
        if i > 0 {
            arguments.push(',');
        }
        arguments.push_str(&Value::String(key.to_string()).to_string());
        arguments.push(':');
        let trimmed = value.trim();
        if schemas.is_json(name, key) && serde_json::from_str::<Value>(trimmed).is_ok() {
            arguments.push_str(trimmed);
        } else {
            arguments.push_str(&Value::String(value.to_string()).to_string());
        }
    }
    arguments.push('}');
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

const TOOL_SEP: &str = "<｜tool▁sep｜>";

/// V3: `function<｜tool▁sep｜>NAME\n```json\n{…}\n````; V3.1: `NAME<｜tool▁sep｜>{…}`.
fn deepseek(body: &str) -> Result<ToolCall, String> {
    let (left, right) = body.split_once(TOOL_SEP).ok_or("no <｜tool▁sep｜>")?;
    let (name, arguments) = if left.trim() == "function" {
        let (name, fenced) = right.split_once('\n').ok_or("no newline after the name")?;
        let inner = fenced
            .trim()
            .strip_prefix("```json")
            .and_then(|s| s.strip_suffix("```"))
            .ok_or("arguments not in a ```json fence")?;
        (name.trim(), inner)
    } else {
        (left.trim(), right)
    };
    if name.is_empty() {
        return Err("empty function name".into());
    }
    Ok(ToolCall {
        name: name.to_string(),
        arguments: arguments_object(Some(arguments))?,
    })
}

/// Llama 3: the answer (after `<|python_tag|>`) is one or more `{"name": …, "parameters": {…}}`
/// objects, separated by `;`. Anything else is not a call.
pub(crate) fn llama3_calls(text: &str) -> Result<Vec<ToolCall>, String> {
    #[derive(serde::Deserialize)]
    struct Call<'a> {
        name: String,
        #[serde(borrow, default)]
        parameters: Option<&'a RawValue>,
        #[serde(borrow, default)]
        arguments: Option<&'a RawValue>,
    }
    let text = text.trim_start();
    let mut rest = text.strip_prefix(PYTHON_TAG).unwrap_or(text);
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Call>();
        let call = match stream.next() {
            Some(Ok(call)) => call,
            Some(Err(e)) => return Err(format!("call JSON: {e}")),
            None => return Err("no call".into()),
        };
        calls.push(ToolCall {
            name: call.name,
            arguments: arguments_object(call.parameters.or(call.arguments).map(RawValue::get))?,
        });
        rest = rest[stream.byte_offset()..].trim_start();
        match rest.strip_prefix(';') {
            _ if rest.is_empty() => return Ok(calls),
            Some(after) if !after.trim().is_empty() => rest = after,
            Some(_) => return Ok(calls),
            None => {
                return Err(format!(
                    "text after a call: {:?}",
                    rest.chars().take(20).collect::<String>()
                ))
            }
        }
    }
}

pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
