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
/// when there are no tools.
pub fn call_grammar(family: Family, tools: &[Value]) -> Option<CallGrammar> {
    let mut rules = Rules::default();
    let mut calls = Vec::new();
    for tool in tools {
        let Some((name, schema)) = crate::calls::function_of(tool) else {
            continue;
        };
        let schema = schema
            .cloned()
            .unwrap_or_else(|| serde_json::json!({"type": "object"}));
        calls.push(call_rule(&mut rules, family, name, &schema));
    }
    if calls.is_empty() {
        return None;
    }
    rules.add("call", calls.join(" | "));
    let (root, trigger, preserved): (&str, &str, &[&str]) = match family {
        Family::Hermes | Family::Qwen3Coder | Family::Glm45 => (
            "call (\"\\n\" call)*",
            "<tool_call>",
            &["<tool_call>", "</tool_call>"],
        ),
        Family::DeepSeekV3 => (
            "\"<｜tool▁calls▁begin｜>\" call (\"\\n\" call)* \"<｜tool▁calls▁end｜>\"",
            "<｜tool▁calls▁begin｜>",
            &[
                "<｜tool▁calls▁begin｜>",
                "<｜tool▁call▁begin｜>",
                "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>",
            ],
        ),
        Family::Llama3Json => ("call (\"; \" call)*", "{\"name\": \"", &[]),
    };
    rules.add("root", root.into());
    Some(CallGrammar {
        grammar: rules.text(),
        trigger: trigger.into(),
        preserved: preserved.iter().map(|p| p.to_string()).collect(),
    })
}

/// One call to tool `name`, as `family`'s template writes it (`calls.rs` reads each back).
fn call_rule(rules: &mut Rules, family: Family, name: &str, schema: &Value) -> String {
    let args = || format!("{}-args", rule_name(name));
    match family {
        Family::Hermes => {
            let args = rules.value(schema, &args());
            format!(
                "{} {args} {}",
                literal(&format!(
                    "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": "
                )),
                literal("}\n</tool_call>")
            )
        }
        Family::Llama3Json => {
            let args = rules.value(schema, &args());
            format!(
                "{} {args} \"}}\"",
                literal(&format!("{{\"name\": \"{name}\", \"parameters\": "))
            )
        }
        // V3's form (`function<｜tool▁sep｜>NAME` and a ```json fence), which R1 and V3-0324
        // write; V3.1's templates write `NAME<｜tool▁sep｜>{…}` and the parser reads both.
        Family::DeepSeekV3 => {
            let args = rules.value(schema, &args());
            format!(
                "{} {args} {}",
                literal(&format!(
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
                )),
                literal("\n```<｜tool▁call▁end｜>")
            )
        }
        // Both write each parameter bare between their markers: (the call's opening, the
        // parameter's opening, the marker that closes a value, the text after it, the call's
        // close).
        Family::Qwen3Coder | Family::Glm45 => {
            let (open, key_open, value_end, after_value, close) = match family {
                Family::Qwen3Coder => (
                    format!("<tool_call>\n<function={name}>\n"),
                    ("<parameter=", ">\n"),
                    "</parameter>",
                    "\n</parameter>\n",
                    "</function>\n</tool_call>",
                ),
                _ => (
                    format!("<tool_call>{name}\n"),
                    ("<arg_key>", "</arg_key>\n<arg_value>"),
                    "</arg_value>",
                    "</arg_value>\n",
                    "</tool_call>",
                ),
            };
            let params = rules.bare_parameters(
                schema,
                &args(),
                |key, value| {
                    format!(
                        "{} {value} {}",
                        literal(&format!("{}{key}{}", key_open.0, key_open.1)),
                        literal(after_value)
                    )
                },
                value_end,
            );
            format!("{} {params} {}", literal(&open), literal(close))
        }
    }
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

    /// The parameters of a family that writes each as bare text between markers (Qwen3-Coder,
    /// GLM): required ones in order, then optional ones in order, each `item(key, value)`;
    /// a string parameter's value is any text without `end` (the marker that closes it), any
    /// other is JSON of its schema, as the templates write it (`tojson`).
    fn bare_parameters(
        &mut self,
        schema: &Value,
        name: &str,
        item: impl Fn(&str, &str) -> String,
        end: &str,
    ) -> String {
        let properties = schema
            .get("properties")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut parts = Vec::new();
        for pass_required in [true, false] {
            for (key, prop) in properties
                .iter()
                .filter(|(k, _)| required.contains(&k.as_str()) == pass_required)
            {
                let value = if crate::calls::declared_string(prop) {
                    self.text_without(end)
                } else {
                    self.value(prop, &format!("{name}-{}", rule_name(key)))
                };
                let one = item(key, &value);
                parts.push(if pass_required {
                    one
                } else {
                    format!("({one})?")
                });
            }
        }
        if parts.is_empty() {
            return "\"\"".into();
        }
        self.add(name, parts.join(" "))
    }

    /// Any text that does not contain `end` (whose first character occurs in it only once):
    /// characters other than that first one, and runs of it each followed by either a partial
    /// match of the rest of `end` that fails on a character that is neither the next one nor
    /// the first (consumed), or a partial match followed by another run; at the text's end, a
    /// run and partial matches of `end` without its last character.
    fn text_without(&mut self, end: &str) -> String {
        let chars: Vec<char> = end.chars().collect();
        let (first, rest) = (chars[0], &chars[1..]);
        debug_assert!(rest.len() >= 2 && !rest.contains(&first));
        let words: String = end
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { ' ' })
            .collect();
        let base = format!(
            "text-until-{}",
            words.split_whitespace().collect::<Vec<_>>().join("-")
        );
        let lit = |c: char| literal(&c.to_string());
        let not = |c: char| format!("[^{}{}]", class_char(c), class_char(first));
        // A failing continuation: `rest[..i]` then a character other than `rest[i]`.
        let mut failing = not(rest[rest.len() - 1]);
        for i in (0..rest.len() - 1).rev() {
            failing = format!("{} | {} ({failing})", not(rest[i]), lit(rest[i]));
        }
        // A nonempty partial match that stops short of `end`: `rest[..i]`, 1 ≤ i < len.
        let mut partial = String::new();
        for i in (0..rest.len() - 1).rev() {
            partial = if partial.is_empty() {
                lit(rest[i])
            } else {
                format!("{} ({partial})?", lit(rest[i]))
            };
        }
        let f = lit(first);
        let run = format!("{base}-run");
        let tail = format!("{base}-end");
        self.add(&run, format!("{f}+ (({failing}) | ({partial}) {run})"));
        self.add(&tail, format!("{f}+ (({partial}) {tail}?)?"));
        self.add(
            &base,
            format!("([^{}] | {run})* {tail}?", class_char(first)),
        )
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

/// A character as it stands in a GBNF character class.
fn class_char(c: char) -> String {
    match c {
        '\\' | ']' | '[' | '^' | '-' => format!("\\{c}"),
        '\n' => "\\n".into(),
        c => c.to_string(),
    }
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
