//! A Hugging Face chat template compiled once and rendered per request in transformers'
//! environment (`transformers.utils.chat_template_utils._cached_compile_jinja_template`):
//! `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a
//! Python `tojson`, `{% generation %}` blocks, Python's str/dict methods, and values printed
//! as Python prints them (`None`, `True`, `['a', 1]`).

use std::fmt::Write as _;
use std::sync::Arc;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, ErrorKind, UndefinedBehavior, Value};
use serde_json::{Map, Value as Json};
use tokentap_schema::ChatRequest;

use crate::messages::{alias_reasoning, hf_messages, hf_tools};
use crate::pyjson::{self, DumpOptions};

const NAME: &str = "chat_template";

/// How one request is rendered besides its conversation.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// Append the assistant's turn header (what an engine does before generating).
    pub add_generation_prompt: bool,
    /// RAG documents (`[{"title", "text"}, …]`), passed as `documents`; `None` when absent.
    pub documents: Option<Vec<Json>>,
    /// Further template variables: the tokenizer's special tokens (`bos_token`, `eos_token`,
    /// …; [`crate::Tokenizer::template_variables`]) and chat-template kwargs
    /// (`enable_thinking`, …). Applied after the request's own `chat_template_kwargs`, so
    /// these win.
    pub kwargs: Map<String, Json>,
    /// The clock `strftime_now` reads; the local time when `None`.
    pub now: Option<chrono::NaiveDateTime>,
}

/// Why a template could not be compiled or rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// The template called `raise_exception(message)`: it refuses this conversation (e.g.
    /// "Conversation roles must alternate user/assistant/user/assistant/...").
    #[error("the chat template refused the conversation: {message}")]
    Raised { message: String },
    /// The template does not compile (a syntax the renderer does not know, or no Jinja).
    #[error("the chat template does not compile{}: {message}", at(*.line, .construct))]
    Syntax {
        message: String,
        line: Option<usize>,
        construct: Option<String>,
    },
    /// Rendering failed inside the template (an unknown filter or method, a type error, an
    /// undefined attribute, …).
    #[error("the chat template failed to render{}: {message}", at(*.line, .construct))]
    Render {
        message: String,
        line: Option<usize>,
        construct: Option<String>,
    },
    /// No template fits: a named set without `default` (and without `tool_use` when tools
    /// are offered), or the tokenizer carries none.
    #[error("no chat template: {0}")]
    Missing(String),
}

impl TemplateError {
    /// The template line the error points at, when known.
    pub fn line(&self) -> Option<usize> {
        match self {
            TemplateError::Syntax { line, .. } | TemplateError::Render { line, .. } => *line,
            _ => None,
        }
    }
}

fn at(line: Option<usize>, construct: &Option<String>) -> String {
    let mut s = String::new();
    if let Some(l) = line {
        write!(s, " at line {l}").unwrap();
    }
    if let Some(c) = construct {
        write!(s, " in `{c}`").unwrap();
    }
    s
}

/// The message a template's `raise_exception` carries, kept as the error's source so that
/// it can be told from the renderer's own errors.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A compiled chat template. Cheap to share (`Clone` shares the compiled form).
#[derive(Clone)]
pub struct ChatTemplate {
    env: Arc<Environment<'static>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (a `chat_template` string).
    pub fn new(source: &str) -> Result<ChatTemplate, TemplateError> {
        let source = generation_blocks_as_ifs(source);
        let mut env = hf_environment();
        env.add_template_owned(NAME, source.clone())
            .map_err(|e| convert_error(&e, &source, true))?;
        Ok(ChatTemplate { env: Arc::new(env) })
    }

    /// The request's conversation and tools through the template. The request's
    /// `chat_template_kwargs` (in `extra`, as the OpenAI-compatible engines take them) are
    /// passed as variables, then `options.kwargs`.
    pub fn render(
        &self,
        request: &ChatRequest,
        options: &RenderOptions,
    ) -> Result<String, TemplateError> {
        let mut kwargs = Map::new();
        if let Some(Json::Object(k)) = request.extra.get("chat_template_kwargs") {
            kwargs.extend(k.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        kwargs.extend(options.kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        let options = RenderOptions {
            kwargs,
            ..options.clone()
        };
        self.render_dicts(
            &hf_messages(request),
            hf_tools(request).as_deref(),
            &options,
        )
    }

    /// HF message and tool dicts through the template, as transformers'
    /// `render_jinja_template(conversations=[messages], tools=tools, documents=…,
    /// add_generation_prompt=…, **kwargs)` renders them.
    pub fn render_dicts(
        &self,
        messages: &[Json],
        tools: Option<&[Json]>,
        options: &RenderOptions,
    ) -> Result<String, TemplateError> {
        let mut ctx = options.kwargs.clone();
        ctx.insert(
            "messages".into(),
            Json::Array(messages.iter().map(alias_reasoning).collect()),
        );
        ctx.insert(
            "tools".into(),
            tools.map_or(Json::Null, |t| Json::Array(t.to_vec())),
        );
        ctx.insert(
            "documents".into(),
            options
                .documents
                .as_ref()
                .map_or(Json::Null, |d| Json::Array(d.clone())),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(options.add_generation_prompt),
        );
        let mut ctx = Value::from_serialize(&ctx);
        if let Some(now) = options.now {
            // A context variable shadows the global of the same name, so the template calls
            // this render's clock without a variable of tokentap's own in its namespace.
            let clock = Value::from_function(move |format: String| strftime(now, &format));
            ctx = minijinja::context! { strftime_now => clock, ..ctx };
        }
        let template = self.env.get_template(NAME).expect("added in new()");
        template.render(ctx).map_err(|e| {
            let source = template.source();
            convert_error(&e, source, false)
        })
    }
}

/// A tokenizer_config's `chat_template`: one template, or several by name (`default`,
/// `tool_use`, `rag`, …).
#[derive(Debug, Clone)]
pub struct ChatTemplates {
    named: Vec<(String, ChatTemplate)>,
}

impl ChatTemplates {
    /// One unnamed template (it serves every request, like transformers' single string).
    pub fn single(source: &str) -> Result<ChatTemplates, TemplateError> {
        Ok(ChatTemplates {
            named: vec![("default".into(), ChatTemplate::new(source)?)],
        })
    }

    /// The `chat_template` value of a tokenizer_config.json: a string, or a list of
    /// `{"name", "template"}`.
    pub fn from_config(value: &Json) -> Result<ChatTemplates, TemplateError> {
        match value {
            Json::String(s) => ChatTemplates::single(s),
            Json::Array(items) => {
                let mut named = Vec::new();
                for item in items {
                    let (Some(name), Some(template)) = (
                        item.get("name").and_then(Json::as_str),
                        item.get("template").and_then(Json::as_str),
                    ) else {
                        return Err(TemplateError::Missing(
                            "a chat_template list entry lacks a string name or template".into(),
                        ));
                    };
                    named.push((name.to_owned(), ChatTemplate::new(template)?));
                }
                Ok(ChatTemplates { named })
            }
            _ => Err(TemplateError::Missing(
                "chat_template is neither a string nor a list of {name, template}".into(),
            )),
        }
    }

    /// The template names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.named.iter().map(|(n, _)| n.as_str())
    }

    /// The template called `name`.
    pub fn get(&self, name: &str) -> Option<&ChatTemplate> {
        self.named.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// transformers' choice: `tool_use` when tools are offered and it exists, else `default`.
    pub fn select(&self, tools_offered: bool) -> Result<&ChatTemplate, TemplateError> {
        if tools_offered {
            if let Some(t) = self.get("tool_use") {
                return Ok(t);
            }
        }
        self.get("default").ok_or_else(|| {
            TemplateError::Missing(format!(
                "the chat templates ({}) have no \"default\"",
                self.names().collect::<Vec<_>>().join(", ")
            ))
        })
    }

    /// [`ChatTemplate::render`] with the template [`ChatTemplates::select`] picks.
    pub fn render(
        &self,
        request: &ChatRequest,
        options: &RenderOptions,
    ) -> Result<String, TemplateError> {
        self.select(!request.tools.is_empty())?
            .render(request, options)
    }
}

/// transformers' Jinja environment, as far as minijinja (+ pycompat) reproduces it.
fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Jinja2 drops one trailing newline of the template source by default, as minijinja does;
    // set explicitly because a template's last byte reaches the tokenizer.
    env.set_keep_trailing_newline(false);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        out.write_str(&py_str(value))?;
        Ok(())
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: Value| py_str(&v));
    // Jinja2's trim is `str(value).strip(chars)`: a list prints as Python's repr first.
    env.add_filter("trim", |v: Value, chars: Option<String>| {
        let s = py_str(&v);
        match chars {
            Some(chars) => s.trim_matches(|c| chars.contains(c)).to_owned(),
            None => s.trim().to_owned(),
        }
    });
    // Jinja2's tests follow Python's protocols: `None is iterable` is false (minijinja would
    // iterate it as empty), a string or a dict `is sequence`, `True is number`.
    env.add_test("iterable", |v: Value| match v.kind() {
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        ValueKind::Plain | ValueKind::Invalid => v.try_iter().is_ok(),
        _ => true,
    });
    env.add_test("sequence", |v: Value| {
        matches!(
            v.kind(),
            ValueKind::Undefined | ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
    });
    env.add_test("number", |v: Value| {
        matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
    });
    env.add_function("raise_exception", |message: Value| -> Result<Value, _> {
        let message = py_str(&message);
        Err::<Value, _>(
            minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
                .with_source(Raised(message)),
        )
    });
    env.add_function("strftime_now", strftime_now);
    env
}

/// `{% generation %}…{% endgeneration %}` (transformers' AssistantTracker extension, which
/// only marks the assistant's span) written as an always-true `if`: the same output, and the
/// same whitespace handling, since both are block tags. Line numbers are unchanged.
fn generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => write!(out, "{{%{lead} if true {trail}%}}").unwrap(),
            "endgeneration" => write!(out, "{{%{lead} endif {trail}%}}").unwrap(),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn convert_error(e: &minijinja::Error, source: &str, compiling: bool) -> TemplateError {
    // The template's own raise_exception, possibly wrapped by a macro or include.
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(r) = c.downcast_ref::<Raised>() {
            return TemplateError::Raised {
                message: r.0.clone(),
            };
        }
        cause = c.source();
    }
    // The failing expression when minijinja knows its span, else the whole line.
    let construct = e
        .range()
        .and_then(|r| source.get(r))
        .or_else(|| e.line().and_then(|l| source.lines().nth(l.checked_sub(1)?)))
        .map(|s| s.trim().chars().take(200).collect::<String>());
    let message = match e.detail() {
        Some(d) => format!("{}: {d}", e.kind()),
        None => e.kind().to_string(),
    };
    if compiling || e.kind() == ErrorKind::SyntaxError {
        TemplateError::Syntax {
            message,
            line: e.line(),
            construct,
        }
    } else {
        TemplateError::Render {
            message,
            line: e.line(),
            construct,
        }
    }
}

/// `strftime_now(format)` on the local clock (a render with [`RenderOptions::now`] shadows it
/// with that time).
fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    strftime(chrono::Local::now().naive_local(), &format)
}

/// `time.strftime(format)`: chrono shares Python's directives for everything templates use
/// (`%d %b %Y`, `%Y-%m-%d`, `%H:%M`, …).
fn strftime(now: chrono::NaiveDateTime, format: &str) -> Result<Value, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        // chrono would panic formatting these; Python would print them unchanged.
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        ));
    }
    Ok(Value::from(
        now.format_with_items(items.into_iter()).to_string(),
    ))
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keyword arguments.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let mut options = DumpOptions::default();
    if let Some(indent) = kwargs.get::<Option<Value>>("indent")? {
        options.indent = match indent.kind() {
            ValueKind::None | ValueKind::Undefined => None,
            ValueKind::String => Some(indent.as_str().unwrap_or_default().to_owned()),
            _ => {
                let n = indent.as_i64().ok_or_else(|| {
                    minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: bad indent")
                })?;
                Some(" ".repeat(n.max(0) as usize))
            }
        };
    }
    if let Some(seps) = kwargs.get::<Option<Vec<String>>>("separators")? {
        match seps.as_slice() {
            [item, key] => options.separators = Some((item.clone(), key.clone())),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be (item_separator, key_separator)",
                ))
            }
        }
    }
    options.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    options.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let json = to_json(&value)?;
    Ok(Value::from(pyjson::dumps(&json, &options)))
}

/// A template value as the JSON value Python's `json.dumps` would see.
fn to_json(v: &Value) -> Result<Json, minijinja::Error> {
    let unserializable = |what: &str| {
        minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("Object of type {what} is not JSON serializable"),
        )
    };
    Ok(match v.kind() {
        ValueKind::Undefined => return Err(unserializable("Undefined")),
        ValueKind::None => Json::Null,
        ValueKind::Bool => Json::Bool(v.is_true()),
        ValueKind::Number => {
            if v.is_integer() {
                if let Some(i) = v.as_i64() {
                    Json::from(i)
                } else if let Ok(u) = u64::try_from(v.clone()) {
                    Json::from(u)
                } else {
                    // Beyond 64 bits: Python would print every digit; serde_json has no
                    // such integer (see README).
                    Json::from(f64::try_from(v.clone()).unwrap_or(f64::NAN))
                }
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(Json::Number)
                    .unwrap_or_else(|| Json::String(pyjson::float_json(f)))
            }
        }
        ValueKind::String => Json::String(v.as_str().unwrap_or_default().to_owned()),
        ValueKind::Bytes => return Err(unserializable("bytes")),
        ValueKind::Seq | ValueKind::Iterable => Json::Array(
            v.try_iter()?
                .map(|i| to_json(&i))
                .collect::<Result<_, _>>()?,
        ),
        ValueKind::Map => {
            let mut m = Map::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                let key = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_owned(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => if key.is_true() { "true" } else { "false" }.into(),
                    ValueKind::Number => pyjson::dumps(&to_json(&key)?, &DumpOptions::default()),
                    _ => return Err(unserializable("key")),
                };
                m.insert(key, to_json(&item)?);
            }
            Json::Object(m)
        }
        _ => return Err(unserializable(&v.kind().to_string())),
    })
}

/// `str(value)` in Python: what `{{ value }}` prints under Jinja2.
pub(crate) fn py_str(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => v.as_str().unwrap_or_default().to_owned(),
        _ => py_repr(v),
    }
}

/// `repr(value)` in Python, for values inside containers (`['a', 1, None]`).
fn py_repr(v: &Value) -> String {
    match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => {
            if v.is_integer() {
                v.to_string()
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_nan() {
                    "nan".into()
                } else if f.is_infinite() {
                    if f > 0.0 { "inf" } else { "-inf" }.into()
                } else {
                    pyjson::float_repr(f)
                }
            }
        }
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default()),
        ValueKind::Seq => match v.try_iter() {
            Ok(items) => format!(
                "[{}]",
                items.map(|i| py_repr(&i)).collect::<Vec<_>>().join(", ")
            ),
            Err(_) => v.to_string(),
        },
        ValueKind::Map => match v.try_iter() {
            Ok(keys) => format!(
                "{{{}}}",
                keys.map(|k| {
                    let item = v.get_item(&k).unwrap_or_default();
                    format!("{}: {}", py_repr(&k), py_repr(&item))
                })
                .collect::<Vec<_>>()
                .join(", ")
            ),
            Err(_) => v.to_string(),
        },
        _ => v.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text holds `'` and no `"`; backslash
/// escapes for quotes, `\\`, `\n`, `\r`, `\t` and other unprintable characters.
fn py_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            // Unprintable by Python's str.isprintable: controls, and the separators and format
            // characters Python escapes most often (an approximation beyond these).
            c if (c as u32) < 0x20 || (0x7f..=0xa0).contains(&(c as u32)) || c == '\u{ad}' => {
                write!(out, "\\x{:02x}", c as u32).unwrap()
            }
            '\u{2028}' | '\u{2029}' | '\u{200b}'..='\u{200f}' | '\u{feff}' => {
                write!(out, "\\u{:04x}", c as u32).unwrap()
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: Json) -> Result<String, TemplateError> {
        let t = ChatTemplate::new(src)?;
        t.render_dicts(
            messages.as_array().unwrap(),
            None,
            &RenderOptions::default(),
        )
    }

    #[test]
    fn generation_blocks_keep_their_body_and_whitespace() {
        assert_eq!(
            generation_blocks_as_ifs("a{%- generation -%}b{% endgeneration %}c{% if x %}"),
            "a{%- if true -%}b{% endif %}c{% if x %}"
        );
        let out = render(
            "{% for m in messages %}\n  {% generation %}\n[{{ m.content }}]\n  {% endgeneration %}\n{% endfor %}",
            json!([{"role": "user", "content": "hi"}]),
        )
        .unwrap();
        assert_eq!(out, "[hi]\n");
    }

    #[test]
    fn prints_values_as_python_does() {
        let out = render(
            "{{ messages[0].x }}|{{ messages[0].y }}|{{ messages[0].z }}|{{ messages[0].w }}|{{ messages[0].missing }}|{{ none }}|{{ 1.0 }}|{{ messages[0].x|string }}",
            json!([{"x": null, "y": true, "z": ["a", 1, 2.5, {"k": "it's"}], "w": "plain"}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "None|True|['a', 1, 2.5, {'k': \"it's\"}]|plain||None|1.0|None"
        );
    }

    #[test]
    fn raise_exception_and_errors_say_where() {
        let err = render(
            "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}",
            json!([{}, {}]),
        )
        .unwrap_err();
        assert_eq!(
            err,
            TemplateError::Raised {
                message: "only one message".into()
            }
        );
        // minijinja looks filters up when rendering (Jinja2 when compiling): either way the
        // error names the line and the construct.
        let err = render("line one\n{{ messages|nosuchfilter }}", json!([])).unwrap_err();
        assert_eq!(err.line(), Some(2), "{err}");
        assert!(err.to_string().contains("in `nosuchfilter`"), "{err}");
        let err = render("{% for %}", json!([])).unwrap_err();
        assert!(
            matches!(err, TemplateError::Syntax { line: Some(1), .. }),
            "{err}"
        );
        let err = render("a\nb\n{{ messages.append(1) }}", json!([])).unwrap_err();
        assert!(
            matches!(err, TemplateError::Render { line: Some(3), .. }),
            "{err}"
        );
        assert!(err.to_string().contains("append"), "{err}");
    }

    #[test]
    fn tojson_takes_pythons_keyword_arguments() {
        let out = render(
            "{{ messages[0]|tojson }}|{{ messages[0]|tojson(indent=2) }}|{{ messages[0]|tojson(separators=(',', ':'), sort_keys=true) }}|{{ messages[0].b|tojson(ensure_ascii=true) }}",
            json!([{"z": [1.0, 1e-7], "b": "é<&>"}]),
        )
        .unwrap();
        assert_eq!(
            out,
            "{\"z\": [1.0, 1e-07], \"b\": \"é<&>\"}|{\n  \"z\": [\n    1.0,\n    1e-07\n  ],\n  \"b\": \"é<&>\"\n}|{\"b\":\"é<&>\",\"z\":[1.0,1e-07]}|\"\\u00e9<&>\""
        );
        assert!(render("{{ nothing|tojson }}", json!([])).is_err());
    }

    #[test]
    fn strftime_now_reads_the_given_clock() {
        let t = ChatTemplate::new(
            "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d %H:%M') }}",
        )
        .unwrap();
        let opts = RenderOptions {
            now: Some(
                chrono::NaiveDate::from_ymd_opt(2025, 3, 4)
                    .unwrap()
                    .and_hms_opt(9, 5, 0)
                    .unwrap(),
            ),
            ..Default::default()
        };
        assert_eq!(
            t.render_dicts(&[], None, &opts).unwrap(),
            "04 Mar 2025|2025-03-04 09:05"
        );
        let bad = ChatTemplate::new("{{ strftime_now('%Q') }}").unwrap();
        assert!(bad.render_dicts(&[], None, &opts).is_err());
    }

    #[test]
    fn tests_follow_python_and_request_kwargs_reach_the_template() {
        let out = render(
            "{{ none is iterable }} {{ 'ab' is sequence }} {{ {} is sequence }} {{ true is number }} {{ [] is iterable }} {{ 3 is iterable }}",
            json!([]),
        )
        .unwrap();
        assert_eq!(out, "False True True True True False");
        let t = ChatTemplate::new("{{ enable_thinking }} {{ bos_token }}").unwrap();
        let mut req: ChatRequest =
            serde_json::from_value(json!({"model": "m", "messages": []})).unwrap();
        req.extra.insert(
            "chat_template_kwargs".into(),
            json!({"enable_thinking": false, "bos_token": "<from request>"}),
        );
        let mut opts = RenderOptions::default();
        assert_eq!(t.render(&req, &opts).unwrap(), "False <from request>");
        opts.kwargs.insert("bos_token".into(), json!("<s>"));
        assert_eq!(t.render(&req, &opts).unwrap(), "False <s>");
    }

    #[test]
    fn named_templates_pick_tool_use_when_tools_are_offered() {
        let set = ChatTemplates::from_config(&json!([
            {"name": "default", "template": "D"},
            {"name": "tool_use", "template": "T"},
        ]))
        .unwrap();
        let opts = RenderOptions::default();
        assert_eq!(
            set.select(true)
                .unwrap()
                .render_dicts(&[], None, &opts)
                .unwrap(),
            "T"
        );
        assert_eq!(
            set.select(false)
                .unwrap()
                .render_dicts(&[], None, &opts)
                .unwrap(),
            "D"
        );
        let only_rag =
            ChatTemplates::from_config(&json!([{"name": "rag", "template": "R"}])).unwrap();
        assert!(matches!(
            only_rag.select(false),
            Err(TemplateError::Missing(_))
        ));
    }
}
