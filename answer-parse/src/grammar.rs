//! The calls a family writes, as a llama.cpp grammar (GBNF) for the engine: what llama-server's
//! chat endpoint applies to a request with tools, which `/completion` (token-in mode) only
//! applies when sent one. Lazy: free text and reasoning until the call's opening marker, then
//! only calls to the offered tools with arguments that fit their schemas, written as the
//! family's template writes them (`", "` and `": "` between JSON items), so the sampled call
//! is the text the template would render for it.
//!
//! Schemas are read for what shapes the text: objects (required properties in order, then any
//! optional ones, in order), strings, numbers, integers, booleans, null, arrays, `enum`,
//! `const`, `anyOf`/`oneOf` and type lists; anything else (`$ref`, `allOf`, patterns) is any
//! JSON value of the declared type.

use serde_json::Value;

use crate::family::Family;

/// What llama.cpp's `/completion` takes to constrain the calls: `grammar`, `grammar_lazy`,
/// `grammar_triggers` (type 1: a word) and `preserved_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct CallGrammar {
    pub grammar: String,
    /// The text that starts the grammar (a special token in the family's vocabulary).
    pub trigger: String,
    /// Tokens the grammar names that must reach it as themselves.
    pub preserved: Vec<String>,
}

impl CallGrammar {
    /// The request fields, for `/completion`'s body.
    pub fn completion_fields(&self) -> Value {
        serde_json::json!({
            "grammar": self.grammar,
            "grammar_lazy": true,
            "grammar_triggers": [{"type": 1, "value": self.trigger}],
            "preserved_tokens": self.preserved,
        })
    }
}

/// The grammar of `family`'s calls to `tools` (any of the three wire APIs' shapes), or `None`
/// when there are no tools or the family's calls are not constrained yet (only Hermes' are).
pub fn call_grammar(family: Family, tools: &[Value]) -> Option<CallGrammar> {
    if family != Family::Hermes {
        return None;
    }
    let mut rules = Rules::default();
    let mut calls = Vec::new();
    for tool in tools {
        let Some((name, schema)) = crate::calls::function_of(tool) else {
            continue;
        };
        let schema = schema
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}));
        let args = rules.value(&schema, &format!("{}-args", rule_name(name)));
        calls.push(format!(
            "{} {args} {}",
            literal(&format!(
                "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": "
            )),
            literal("}\n</tool_call>")
        ));
    }
    if calls.is_empty() {
        return None;
    }
    rules.add("call", calls.join(" | "));
    rules.add("root", "call (\"\\n\" call)*".into());
    Some(CallGrammar {
        grammar: rules.text(),
        trigger: "<tool_call>".into(),
        preserved: vec!["<tool_call>".into(), "</tool_call>".into()],
    })
}

#[derive(Default)]
struct Rules {
    rules: Vec<(String, String)>,
}

impl Rules {
    fn add(&mut self, name: &str, body: String) -> String {
        if !self.rules.iter().any(|(n, _)| n == name) {
            self.rules.push((name.to_string(), body));
        }
        name.to_string()
    }

    fn text(&self) -> String {
        let mut out = String::new();
        // root first, as llama.cpp's grammars are written.
        for (name, body) in self.rules.iter().rev().filter(|(n, _)| n == "root") {
            out.push_str(&format!("{name} ::= {body}\n"));
        }
        for (name, body) in self.rules.iter().filter(|(n, _)| n != "root") {
            out.push_str(&format!("{name} ::= {body}\n"));
        }
        out
    }

    /// The rule for a value of `schema`, named `name` where it needs one of its own.
    fn value(&mut self, schema: &Value, name: &str) -> String {
        if let Some(c) = schema.get("const") {
            return literal(&json_text(c));
        }
        if let Some(Value::Array(options)) = schema.get("enum") {
            let alts: Vec<String> = options.iter().map(|o| literal(&json_text(o))).collect();
            return format!("({})", alts.join(" | "));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(options)) = schema.get(key) {
                let alts: Vec<String> = options
                    .iter()
                    .enumerate()
                    .map(|(i, o)| self.value(o, &format!("{name}-{i}")))
                    .collect();
                return format!("({})", alts.join(" | "));
            }
        }
        match schema.get("type") {
            Some(Value::Array(types)) => {
                let alts: Vec<String> = types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        let mut one = schema.clone();
                        one["type"] = t.clone();
                        self.value(&one, &format!("{name}-{i}"))
                    })
                    .collect();
                format!("({})", alts.join(" | "))
            }
            Some(Value::String(t)) => match t.as_str() {
                "object" => self.object(schema, name),
                "array" => {
                    let item = match schema.get("items") {
                        Some(items) => self.value(items, &format!("{name}-item")),
                        None => self.any(),
                    };
                    self.add(name, format!("\"[\" ({item} (\", \" {item})*)? \"]\""))
                }
                "string" => self.string(),
                "integer" => self.add("integer", r#""-"? [0-9]+"#.into()),
                "number" => self.add(
                    "number",
                    r#""-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?"#.into(),
                ),
                "boolean" => self.add("boolean", r#""true" | "false""#.into()),
                "null" => literal("null"),
                _ => self.any(),
            },
            _ if schema.get("properties").is_some() => self.object(schema, name),
            _ => self.any(),
        }
    }

    /// Required properties in their order, then optional ones in theirs, each optional.
    fn object(&mut self, schema: &Value, name: &str) -> String {
        let properties = schema
            .get("properties")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        if properties.is_empty() {
            // Any object: the rules for any value come with it.
            self.any();
            return "object".into();
        }
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut items: Vec<(String, bool)> = Vec::new();
        for (key, prop) in properties
            .iter()
            .filter(|(k, _)| required.contains(&k.as_str()))
        {
            let v = self.value(prop, &format!("{name}-{}", rule_name(key)));
            items.push((format!("{} {v}", literal(&format!("\"{key}\": "))), true));
        }
        for (key, prop) in properties
            .iter()
            .filter(|(k, _)| !required.contains(&k.as_str()))
        {
            let v = self.value(prop, &format!("{name}-{}", rule_name(key)));
            items.push((format!("{} {v}", literal(&format!("\"{key}\": "))), false));
        }
        // Required items come first, so each optional one brings its own separator; without
        // any required item, whichever optional item comes first has none.
        let (fixed, optional): (Vec<_>, Vec<_>) = items.into_iter().partition(|(_, r)| *r);
        let fixed: Vec<String> = fixed.into_iter().map(|(i, _)| i).collect();
        let optional: Vec<String> = optional.into_iter().map(|(i, _)| i).collect();
        let tail = |from: usize| -> String {
            optional[from..]
                .iter()
                .map(|i| format!("(\", \" {i})? "))
                .collect()
        };
        let inner = if !fixed.is_empty() {
            format!("{} {}", fixed.join(" \", \" "), tail(0))
        } else {
            let firsts: Vec<String> = (0..optional.len())
                .map(|k| format!("{} {}", optional[k], tail(k + 1)))
                .collect();
            format!("({})?", firsts.join(" | "))
        };
        let body = format!("\"{{\" {inner} \"}}\"");
        self.add(name, body)
    }

    fn string(&mut self) -> String {
        self.add(
            "string",
            r#""\"" ([^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\"""#.into(),
        )
    }

    /// Any JSON value.
    fn any(&mut self) -> String {
        self.string();
        self.add(
            "number",
            r#""-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?"#.into(),
        );
        self.add(
            "value",
            r#"object | array | string | number | "true" | "false" | "null""#.into(),
        );
        self.add("object", any_object_rule());
        self.add("array", r#""[" (value (", " value)*)? "]""#.into());
        "value".into()
    }
}

fn any_object_rule() -> String {
    r#""{" (string ": " value (", " string ": " value)*)? "}""#.into()
}

/// A GBNF string literal of `text`.
fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// JSON text as the templates' `tojson` writes it (Python's `json.dumps`: `", "`, `": "`).
fn json_text(v: &Value) -> String {
    tokentap_chat_template::pyjson::dumps(v, &Default::default())
}

/// A rule name from any string: letters, digits and `-`.
fn rule_name(s: &str) -> String {
    let name: String = s
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("t-{name}")
}
