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
//!
//! Built in time and space linear in the schemas, and bounded ([`GrammarBounds`]): each
//! subschema is rendered once (a type list's types, deduplicated, as alternatives of one walk,
//! never a copy of the subtree per type), rules are shared by their content, and an object
//! whose properties are all optional is a chain of one rule per property rather than every
//! property as a possible first one. Past a bound (nesting, subschemas, the grammar's bytes or
//! rules) no grammar is built at all: [`NoGrammar::Refused`] names the bound, and token-in mode
//! refuses the call (hostile or broken input; a grammar of megabytes would take the engine as
//! long to parse on every call as it took tokentap to write).

use std::collections::{HashMap, HashSet};
use std::fmt;

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

/// How far [`call_grammar`] goes before it refuses the tools.
///
/// The defaults leave room for any tool list seen in practice: the four harnesses' real lists
/// (Pi, Qwen Code, Codex, Claude Code; `wire/testdata/harness-wire`) nest at most 5 levels,
/// have at most 66 subschemas and make grammars of 0.9–5.7 KB in 10–34 rules, and MCP servers
/// add tools of the same kind. 32 levels is six times the deepest; 20,000 subschemas bound the
/// walk itself (each costs a few hundred bytes of grammar at most, so the walk stops near the
/// size bound rather than after it); 1 MiB of grammar is 180 times the largest and still
/// parsed by llama-server in milliseconds on every call that sends it; 8,192 rules are 240
/// times the most. A schema past these is hostile or broken, not a bigger tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrammarBounds {
    /// Subschemas nested deeper than this (a tool's parameters are level 0; each property,
    /// array item or `anyOf`/`oneOf` option one more).
    pub max_depth: usize,
    /// Subschemas walked, over all tools (an `enum`'s options count as one each).
    pub max_schema_nodes: usize,
    /// The grammar's text.
    pub max_bytes: usize,
    /// The grammar's rules.
    pub max_rules: usize,
}

impl GrammarBounds {
    pub const DEFAULT: GrammarBounds = GrammarBounds {
        max_depth: 32,
        max_schema_nodes: 20_000,
        max_bytes: 1 << 20,
        max_rules: 8_192,
    };
}

impl Default for GrammarBounds {
    fn default() -> Self {
        GrammarBounds::DEFAULT
    }
}

/// The bound a tool list goes past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarLimit {
    /// Nested deeper than this many levels.
    Depth(usize),
    /// More than this many subschemas.
    SchemaNodes(usize),
    /// A grammar of more than this many bytes.
    Bytes(usize),
    /// A grammar of more than this many rules.
    Rules(usize),
}

impl fmt::Display for GrammarLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrammarLimit::Depth(n) => {
                write!(
                    f,
                    "the tools' parameter schemas nest deeper than {n} levels"
                )
            }
            GrammarLimit::SchemaNodes(n) => {
                write!(
                    f,
                    "the tools' parameter schemas have more than {n} subschemas"
                )
            }
            GrammarLimit::Bytes(n) => write!(f, "the tools' call grammar is over {n} bytes"),
            GrammarLimit::Rules(n) => write!(f, "the tools' call grammar has over {n} rules"),
        }
    }
}

/// Why [`call_grammar`] gives no grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoGrammar {
    /// No tools offered (none in a shape with a function name): nothing to constrain.
    NoTools,
    /// The tools go past a bound: no grammar is built, the call should be refused.
    Refused(GrammarLimit),
}

impl fmt::Display for NoGrammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoGrammar::NoTools => write!(f, "no tools offered"),
            NoGrammar::Refused(limit) => write!(
                f,
                "{limit}, the bound of the call grammar tokentap builds for the engine"
            ),
        }
    }
}

impl std::error::Error for NoGrammar {}

impl From<GrammarLimit> for NoGrammar {
    fn from(limit: GrammarLimit) -> Self {
        NoGrammar::Refused(limit)
    }
}

/// The grammar of `family`'s calls to `tools` (any of the three wire APIs' shapes) within
/// [`GrammarBounds::DEFAULT`]; [`NoGrammar::NoTools`] when there are no tools.
pub fn call_grammar(family: Family, tools: &[Value]) -> Result<CallGrammar, NoGrammar> {
    call_grammar_within(family, tools, &GrammarBounds::DEFAULT)
}

/// [`call_grammar`] within `bounds`.
pub fn call_grammar_within(
    family: Family,
    tools: &[Value],
    bounds: &GrammarBounds,
) -> Result<CallGrammar, NoGrammar> {
    let any_object = serde_json::json!({"type": "object"});
    let mut rules = Rules::new(bounds);
    let mut calls = Vec::new();
    let mut calls_bytes = 0;
    for tool in tools {
        let Some((name, schema)) = crate::calls::function_of(tool) else {
            continue;
        };
        let call = call_rule(&mut rules, family, name, schema.unwrap_or(&any_object))?;
        // The `call` rule joins them all: charged as they come, not once it is written.
        calls_bytes += call.len() + 3;
        rules.fits(calls_bytes)?;
        calls.push(call);
    }
    if calls.is_empty() {
        return Err(NoGrammar::NoTools);
    }
    rules.add_fixed("call", calls.join(" | "))?;
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
    rules.add_fixed("root", root.into())?;
    Ok(CallGrammar {
        grammar: rules.text(),
        trigger: trigger.into(),
        preserved: preserved.iter().map(|p| p.to_string()).collect(),
    })
}

/// One call to tool `name`, as `family`'s template writes it (`calls.rs` reads each back).
fn call_rule(
    rules: &mut Rules,
    family: Family,
    name: &str,
    schema: &Value,
) -> Result<String, GrammarLimit> {
    let args = || sub(&rule_name(name), "args");
    match family {
        Family::Hermes => {
            let args = rules.value(schema, &args(), 0)?;
            Ok(format!(
                "{} {args} {}",
                literal(&format!(
                    "<tool_call>\n{{\"name\": \"{name}\", \"arguments\": "
                )),
                literal("}\n</tool_call>")
            ))
        }
        Family::Llama3Json => {
            let args = rules.value(schema, &args(), 0)?;
            Ok(format!(
                "{} {args} \"}}\"",
                literal(&format!("{{\"name\": \"{name}\", \"parameters\": "))
            ))
        }
        // V3's form (`function<｜tool▁sep｜>NAME` and a ```json fence), which R1 and V3-0324
        // write; V3.1's templates write `NAME<｜tool▁sep｜>{…}` and the parser reads both.
        Family::DeepSeekV3 => {
            let args = rules.value(schema, &args(), 0)?;
            Ok(format!(
                "{} {args} {}",
                literal(&format!(
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
                )),
                literal("\n```<｜tool▁call▁end｜>")
            ))
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
            )?;
            Ok(format!("{} {params} {}", literal(&open), literal(close)))
        }
    }
}

/// The longest rule name made from a schema's path (tool name, property keys): past it the
/// name is cut and made unique by a number, so names stay short however deep the schema.
const MAX_NAME: usize = 64;

/// The grammar's rules as they are made, each once: a rule whose body is already there is
/// that rule, found by its body; every rule is charged to the bounds as it is added.
struct Rules<'b> {
    rules: Vec<(String, String)>,
    /// Body to the name of the rule that has it.
    by_body: HashMap<String, usize>,
    names: HashSet<String>,
    /// The next number to try for a name made unique.
    next_number: HashMap<String, usize>,
    bytes: usize,
    nodes: usize,
    bounds: &'b GrammarBounds,
}

impl<'b> Rules<'b> {
    fn new(bounds: &'b GrammarBounds) -> Self {
        Rules {
            rules: Vec::new(),
            by_body: HashMap::new(),
            names: HashSet::new(),
            next_number: HashMap::new(),
            bytes: 0,
            nodes: 0,
            bounds,
        }
    }

    /// Whether `more` bytes on top of the rules so far stay within the bound.
    fn fits(&self, more: usize) -> Result<(), GrammarLimit> {
        if self.bytes + more > self.bounds.max_bytes {
            return Err(GrammarLimit::Bytes(self.bounds.max_bytes));
        }
        Ok(())
    }

    /// One subschema more, at `depth`.
    fn enter(&mut self, depth: usize, nodes: usize) -> Result<(), GrammarLimit> {
        if depth > self.bounds.max_depth {
            return Err(GrammarLimit::Depth(self.bounds.max_depth));
        }
        self.nodes += nodes;
        if self.nodes > self.bounds.max_schema_nodes {
            return Err(GrammarLimit::SchemaNodes(self.bounds.max_schema_nodes));
        }
        Ok(())
    }

    fn push(&mut self, name: String, body: String) -> Result<String, GrammarLimit> {
        // `name ::= body\n`
        self.fits(name.len() + body.len() + 6)?;
        if self.rules.len() >= self.bounds.max_rules {
            return Err(GrammarLimit::Rules(self.bounds.max_rules));
        }
        self.bytes += name.len() + body.len() + 6;
        self.names.insert(name.clone());
        self.by_body.entry(body.clone()).or_insert(self.rules.len());
        self.rules.push((name.clone(), body));
        Ok(name)
    }

    /// The rule with `body`: an existing one with the same body, else a new one named
    /// `name` (made unique).
    fn add(&mut self, name: &str, body: String) -> Result<String, GrammarLimit> {
        if let Some(&i) = self.by_body.get(&body) {
            return Ok(self.rules[i].0.clone());
        }
        let mut unique = name.to_string();
        if self.names.contains(&unique) {
            let n = self.next_number.entry(name.to_string()).or_insert(2);
            loop {
                unique = format!("{name}-{n}");
                *n += 1;
                if !self.names.contains(&unique) {
                    break;
                }
            }
        }
        self.push(unique, body)
    }

    /// The rule named exactly `name` (the shared ones: `string`, `value`, `root`, …, which
    /// other rules name): the first body given it.
    fn add_fixed(&mut self, name: &str, body: String) -> Result<String, GrammarLimit> {
        if self.names.contains(name) {
            return Ok(name.to_string());
        }
        self.push(name.to_string(), body)
    }

    fn text(&self) -> String {
        let mut out = String::with_capacity(self.bytes);
        // root first, as llama.cpp's grammars are written.
        for (name, body) in self.rules.iter().rev().filter(|(n, _)| n == "root") {
            out.push_str(&format!("{name} ::= {body}\n"));
        }
        for (name, body) in self.rules.iter().filter(|(n, _)| n != "root") {
            out.push_str(&format!("{name} ::= {body}\n"));
        }
        out
    }

    /// The rule (or inline expression: a literal, a rule's name or a parenthesised group) for
    /// a value of `schema` at `depth`, named `name` where it needs one of its own.
    fn value(&mut self, schema: &Value, name: &str, depth: usize) -> Result<String, GrammarLimit> {
        self.enter(depth, 1)?;
        if let Some(c) = schema.get("const") {
            return Ok(literal(&json_text(c)));
        }
        if let Some(Value::Array(options)) = schema.get("enum") {
            self.enter(depth, options.len())?;
            let alts = options.iter().map(|o| literal(&json_text(o))).collect();
            return Ok(group(alts));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(Value::Array(options)) = schema.get(key) {
                let mut alts = Vec::with_capacity(options.len());
                for (i, o) in options.iter().enumerate() {
                    alts.push(self.value(o, &sub(name, &i.to_string()), depth + 1)?);
                }
                return Ok(group(alts));
            }
        }
        match schema.get("type") {
            // One walk of the schema per distinct type, each the alternative of its type.
            Some(Value::Array(types)) => {
                let mut seen = HashSet::new();
                let mut alts = Vec::new();
                for (i, t) in types.iter().enumerate() {
                    if seen.insert(t.as_str()) {
                        alts.push(self.typed(
                            schema,
                            t.as_str(),
                            &sub(name, &i.to_string()),
                            depth,
                        )?);
                    }
                }
                Ok(group(alts))
            }
            Some(Value::String(t)) => self.typed(schema, Some(t), name, depth),
            _ => self.typed(schema, None, name, depth),
        }
    }

    /// A value of `schema` read as of type `t` (`None`: no type named).
    fn typed(
        &mut self,
        schema: &Value,
        t: Option<&str>,
        name: &str,
        depth: usize,
    ) -> Result<String, GrammarLimit> {
        match t {
            Some("object") => self.object(schema, name, depth),
            Some("array") => {
                let item_name = sub(name, "item");
                let item = match schema.get("items") {
                    Some(items) => self.value(items, &item_name, depth + 1)?,
                    None => self.any()?,
                };
                // Named twice below: a rule's name, never its text twice.
                let item = if is_name(&item) {
                    item
                } else {
                    self.add(&item_name, item)?
                };
                self.add(name, format!("\"[\" ({item} (\", \" {item})*)? \"]\""))
            }
            Some("string") => self.string(),
            Some("integer") => self.add_fixed("integer", r#""-"? [0-9]+"#.into()),
            Some("number") => self.add_fixed("number", number_rule()),
            Some("boolean") => self.add_fixed("boolean", r#""true" | "false""#.into()),
            Some("null") => Ok(literal("null")),
            Some(_) => self.any(),
            None if schema.get("properties").is_some() => self.object(schema, name, depth),
            None => self.any(),
        }
    }

    /// Required properties in their order, then optional ones in theirs, each optional.
    fn object(&mut self, schema: &Value, name: &str, depth: usize) -> Result<String, GrammarLimit> {
        let Some(properties) = schema
            .get("properties")
            .and_then(Value::as_object)
            .filter(|p| !p.is_empty())
        else {
            // Any object: the rules for any value come with it.
            self.any()?;
            return Ok("object".into());
        };
        let required = required(schema);
        let (mut fixed, mut optional) = (Vec::new(), Vec::new());
        for pass_required in [true, false] {
            for (key, prop) in properties
                .iter()
                .filter(|(k, _)| required.contains(k.as_str()) == pass_required)
            {
                let v = self.value(prop, &sub(name, &rule_name(key)), depth + 1)?;
                let item = format!("{} {v}", literal(&format!("\"{key}\": ")));
                if pass_required {
                    fixed.push(item);
                } else {
                    optional.push(item);
                }
            }
        }
        let inner = if !fixed.is_empty() {
            // Required items come first, so each optional one brings its own separator.
            let mut inner = fixed.join(" \", \" ");
            for item in &optional {
                inner.push_str(&format!(" (\", \" {item})?"));
            }
            inner
        } else {
            // Without any required item, whichever optional item comes first has no
            // separator: the items from the k-th on, in order, at least one, are the k-th and
            // optionally more from the next on, or those from the next on without it. One
            // rule per item, each naming the next (every item as a possible first one, each
            // with the rest behind it, would be quadratic in the items).
            let mut from = optional.pop().expect("properties");
            for (k, item) in optional.iter().enumerate().rev() {
                from = self.add(
                    &sub(name, &format!("from-{k}")),
                    format!("{item} (\", \" {from})? | {from}"),
                )?;
            }
            format!("({from})?")
        };
        self.add(name, format!("\"{{\" {inner} \"}}\""))
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
    ) -> Result<String, GrammarLimit> {
        self.enter(0, 1)?;
        let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
            return Ok("\"\"".into());
        };
        let required = required(schema);
        let mut parts = Vec::new();
        for pass_required in [true, false] {
            for (key, prop) in properties
                .iter()
                .filter(|(k, _)| required.contains(k.as_str()) == pass_required)
            {
                let value = if crate::calls::declared_string(prop) {
                    self.enter(1, 1)?;
                    self.text_without(end)?
                } else {
                    self.value(prop, &sub(name, &rule_name(key)), 1)?
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
            return Ok("\"\"".into());
        }
        self.add(name, parts.join(" "))
    }

    /// Any text that does not contain `end` (whose first character occurs in it only once):
    /// characters other than that first one, and runs of it each followed by either a partial
    /// match of the rest of `end` that fails on a character that is neither the next one nor
    /// the first (consumed), or a partial match followed by another run; at the text's end, a
    /// run and partial matches of `end` without its last character.
    fn text_without(&mut self, end: &str) -> Result<String, GrammarLimit> {
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
        if self.names.contains(&base) {
            return Ok(base);
        }
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
        self.add_fixed(&run, format!("{f}+ (({failing}) | ({partial}) {run})"))?;
        self.add_fixed(&tail, format!("{f}+ (({partial}) {tail}?)?"))?;
        self.add_fixed(
            &base,
            format!("([^{}] | {run})* {tail}?", class_char(first)),
        )
    }

    fn string(&mut self) -> Result<String, GrammarLimit> {
        self.add_fixed(
            "string",
            r#""\"" ([^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\"""#.into(),
        )
    }

    /// Any JSON value.
    fn any(&mut self) -> Result<String, GrammarLimit> {
        if self.names.contains("value") {
            return Ok("value".into());
        }
        self.string()?;
        self.add_fixed("number", number_rule())?;
        self.add_fixed(
            "value",
            r#"object | array | string | number | "true" | "false" | "null""#.into(),
        )?;
        self.add_fixed("object", any_object_rule())?;
        self.add_fixed("array", r#""[" (value (", " value)*)? "]""#.into())?;
        Ok("value".into())
    }
}

/// A schema's `required` names.
fn required(schema: &Value) -> HashSet<&str> {
    schema
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Alternatives as one expression: each distinct one once, in order.
fn group(alts: Vec<String>) -> String {
    let mut seen = HashSet::new();
    let alts: Vec<String> = alts
        .into_iter()
        .filter(|a| seen.insert(a.clone()))
        .collect();
    match alts.len() {
        1 => alts.into_iter().next().expect("one"),
        _ => format!("({})", alts.join(" | ")),
    }
}

/// Whether `expr` is a rule's name.
fn is_name(expr: &str) -> bool {
    !expr.is_empty() && expr.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The name of a part of the rule `name`, cut to [`MAX_NAME`] (names are ASCII).
fn sub(name: &str, part: &str) -> String {
    let mut s = format!("{name}-{part}");
    s.truncate(MAX_NAME);
    s
}

fn number_rule() -> String {
    r#""-"? [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?"#.into()
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

#[cfg(test)]
mod tests {
    //! The grammar's language, read by a small GBNF matcher (the subset written here:
    //! literals, classes, names, groups, `? * + {n}`), and its size under the attacks of
    //! issue 49.
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;
    use std::collections::BTreeSet;

    #[derive(Debug, Clone)]
    enum Node {
        Lit(Vec<char>),
        Class(bool, Vec<(char, char)>),
        Name(String),
        Alt(Vec<Vec<Node>>),
        Rep(Box<Node>, usize, Option<usize>),
    }

    struct Parser<'a> {
        s: &'a [char],
        i: usize,
    }

    impl Parser<'_> {
        fn peek(&self) -> Option<char> {
            self.s.get(self.i).copied()
        }
        fn skip_ws(&mut self) {
            while self.peek().is_some_and(|c| c == ' ') {
                self.i += 1;
            }
        }
        fn escaped(&mut self) -> char {
            let c = self.s[self.i];
            self.i += 1;
            if c != '\\' {
                return c;
            }
            let e = self.s[self.i];
            self.i += 1;
            match e {
                'n' => '\n',
                'r' => '\r',
                't' => '\t',
                'x' => {
                    let hex: String = self.s[self.i..self.i + 2].iter().collect();
                    self.i += 2;
                    char::from_u32(u32::from_str_radix(&hex, 16).unwrap()).unwrap()
                }
                c => c,
            }
        }
        fn alt(&mut self) -> Node {
            let mut alts = vec![self.seq()];
            while self.peek() == Some('|') {
                self.i += 1;
                alts.push(self.seq());
            }
            Node::Alt(alts)
        }
        fn seq(&mut self) -> Vec<Node> {
            let mut items = Vec::new();
            loop {
                self.skip_ws();
                let Some(c) = self.peek() else { break };
                let atom = match c {
                    '|' | ')' => break,
                    '"' => {
                        self.i += 1;
                        let mut lit = Vec::new();
                        while self.peek() != Some('"') {
                            lit.push(self.escaped());
                        }
                        self.i += 1;
                        Node::Lit(lit)
                    }
                    '[' => {
                        self.i += 1;
                        let negated = self.peek() == Some('^');
                        if negated {
                            self.i += 1;
                        }
                        let mut ranges = Vec::new();
                        while self.peek() != Some(']') {
                            let a = self.escaped();
                            if self.peek() == Some('-') && self.s.get(self.i + 1) != Some(&']') {
                                self.i += 1;
                                let b = self.escaped();
                                ranges.push((a, b));
                            } else {
                                ranges.push((a, a));
                            }
                        }
                        self.i += 1;
                        Node::Class(negated, ranges)
                    }
                    '(' => {
                        self.i += 1;
                        let inner = self.alt();
                        assert_eq!(self.peek(), Some(')'));
                        self.i += 1;
                        inner
                    }
                    _ => {
                        let start = self.i;
                        while self
                            .peek()
                            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-')
                        {
                            self.i += 1;
                        }
                        assert!(self.i > start, "unexpected {c:?}");
                        Node::Name(self.s[start..self.i].iter().collect())
                    }
                };
                let atom = match self.peek() {
                    Some('?') => Node::Rep(Box::new(atom), 0, Some(1)),
                    Some('*') => Node::Rep(Box::new(atom), 0, None),
                    Some('+') => Node::Rep(Box::new(atom), 1, None),
                    Some('{') => {
                        let close = (self.i..).find(|&j| self.s[j] == '}').unwrap();
                        let n: usize = self.s[self.i + 1..close]
                            .iter()
                            .collect::<String>()
                            .parse()
                            .unwrap();
                        self.i = close;
                        Node::Rep(Box::new(atom), n, Some(n))
                    }
                    _ => {
                        items.push(atom);
                        continue;
                    }
                };
                self.i += 1;
                items.push(atom);
            }
            items
        }
    }

    struct Gbnf {
        rules: HashMap<String, Node>,
    }

    impl Gbnf {
        fn new(text: &str) -> Gbnf {
            let mut rules = HashMap::new();
            for line in text.lines() {
                let (name, body) = line.split_once(" ::= ").unwrap();
                let chars: Vec<char> = body.chars().collect();
                let mut p = Parser { s: &chars, i: 0 };
                let node = p.alt();
                assert_eq!(p.i, chars.len(), "{line}");
                assert!(
                    rules.insert(name.to_string(), node).is_none(),
                    "{name} twice"
                );
            }
            Gbnf { rules }
        }

        /// Whether `text` is exactly one `root`.
        fn accepts(&self, text: &str) -> bool {
            let input: Vec<char> = text.chars().collect();
            let mut memo = HashMap::new();
            self.name("root", 0, &input, &mut memo)
                .contains(&input.len())
        }

        fn name(
            &self,
            name: &str,
            at: usize,
            input: &[char],
            memo: &mut HashMap<(String, usize), BTreeSet<usize>>,
        ) -> BTreeSet<usize> {
            if let Some(ends) = memo.get(&(name.to_string(), at)) {
                return ends.clone();
            }
            let node = self
                .rules
                .get(name)
                .unwrap_or_else(|| panic!("no rule {name}"));
            let ends = self.node(node, at, input, memo);
            memo.insert((name.to_string(), at), ends.clone());
            ends
        }

        fn node(
            &self,
            node: &Node,
            at: usize,
            input: &[char],
            memo: &mut HashMap<(String, usize), BTreeSet<usize>>,
        ) -> BTreeSet<usize> {
            match node {
                Node::Lit(lit) => (input[at..].starts_with(lit))
                    .then_some(at + lit.len())
                    .into_iter()
                    .collect(),
                Node::Class(negated, ranges) => input
                    .get(at)
                    .filter(|c| ranges.iter().any(|(a, b)| (a..=b).contains(c)) != *negated)
                    .map(|_| at + 1)
                    .into_iter()
                    .collect(),
                Node::Name(n) => self.name(n, at, input, memo),
                Node::Alt(alts) => {
                    let mut ends = BTreeSet::new();
                    for seq in alts {
                        let mut here = BTreeSet::from([at]);
                        for item in seq {
                            let mut next = BTreeSet::new();
                            for &p in &here {
                                next.extend(self.node(item, p, input, memo));
                            }
                            here = next;
                        }
                        ends.extend(here);
                    }
                    ends
                }
                Node::Rep(inner, min, max) => {
                    let mut ends = BTreeSet::new();
                    let mut here = BTreeSet::from([at]);
                    let mut seen = BTreeSet::new();
                    for n in 0.. {
                        if n >= *min {
                            ends.extend(here.iter().copied());
                        }
                        if max.is_some_and(|m| n >= m) || here.is_empty() {
                            break;
                        }
                        let mut next = BTreeSet::new();
                        for &p in &here {
                            next.extend(self.node(inner, p, input, memo));
                        }
                        if n >= *min {
                            next.retain(|p| seen.insert(*p));
                        }
                        here = next;
                    }
                    ends
                }
            }
        }
    }

    fn tool(schema: Value) -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "f", "parameters": schema}})]
    }

    fn grammar(family: Family, schema: Value) -> Gbnf {
        Gbnf::new(&call_grammar(family, &tool(schema)).unwrap().grammar)
    }

    /// Hermes' call of `f` with `args` (JSON text as the template writes it).
    fn hermes(args: &str) -> String {
        format!("<tool_call>\n{{\"name\": \"f\", \"arguments\": {args}}}\n</tool_call>")
    }

    /// The object of `items` (indices into `keys`, each `"k": 1`) in that order.
    fn object_of(keys: &[&str], items: &[usize]) -> String {
        let parts: Vec<String> = items
            .iter()
            .map(|&i| format!("\"{}\": 1", keys[i]))
            .collect();
        format!("{{{}}}", parts.join(", "))
    }

    /// Every sequence of distinct items of `n` (each subset in each order).
    fn sequences(n: usize) -> Vec<Vec<usize>> {
        let mut out = vec![vec![]];
        let mut frontier = vec![vec![]];
        for _ in 0..n {
            let mut next = Vec::new();
            for s in &frontier {
                for i in 0..n {
                    if !s.contains(&i) {
                        let mut t = s.clone();
                        t.push(i);
                        next.push(t);
                    }
                }
            }
            out.extend(next.iter().cloned());
            frontier = next;
        }
        out
    }

    #[test]
    fn objects_take_required_properties_in_order_then_optional_ones_in_order() {
        let keys = ["a", "b", "c", "d"];
        let props: serde_json::Map<String, Value> = keys
            .iter()
            .map(|k| (k.to_string(), json!({"type": "integer"})))
            .collect();
        // Every required set of the four (the chain of optional ones when none is required),
        // against every sequence of distinct properties, in every order.
        for mask in 0..16u32 {
            let required: Vec<usize> = (0..4).filter(|i| mask & (1 << i) != 0).collect();
            let names: Vec<&str> = required.iter().map(|&i| keys[i]).collect();
            let g = grammar(
                Family::Hermes,
                json!({"type": "object", "properties": props, "required": names}),
            );
            for seq in sequences(4) {
                let (req, opt) = seq.split_at(required.len().min(seq.len()));
                let expected = req == required.as_slice()
                    && opt.windows(2).all(|w| w[0] < w[1])
                    && opt.iter().all(|i| !required.contains(i));
                let text = hermes(&object_of(&keys, &seq));
                assert_eq!(g.accepts(&text), expected, "required {names:?}: {text}");
            }
            // Separators: none doubled, none leading or trailing.
            for bad in [
                r#"{, "a": 1}"#,
                r#"{"a": 1,}"#,
                r#"{"a": 1, , "b": 1}"#,
                r#"{"a": 1 "b": 1}"#,
            ] {
                assert!(!g.accepts(&hermes(bad)), "{names:?}: {bad}");
            }
        }
    }

    #[test]
    fn values_of_each_kind_read_as_before() {
        let g = grammar(
            Family::Hermes,
            json!({"type": "object", "required": ["t"], "properties": {
                "t": {"type": ["object", "null", "object"], "properties": {"n": {"type": ["integer", "string"]}}},
                "e": {"type": "array", "items": {"enum": ["x", 2]}},
                "o": {"anyOf": [{"type": "boolean"}, {"const": {"k": [1]}}]},
                "a": {},
                "s": {"type": "string"}}}),
        );
        for ok in [
            r#"{"t": null}"#,
            r#"{"t": {}}"#,
            r#"{"t": {"n": -3}}"#,
            r#"{"t": {"n": "x\"y"}}"#,
            r#"{"t": null, "e": []}"#,
            r#"{"t": null, "e": ["x", 2, "x"]}"#,
            r#"{"t": null, "o": true}"#,
            r#"{"t": null, "o": {"k": [1]}}"#,
            r#"{"t": null, "a": {"any": [1.5e3, null, "z"]}}"#,
            r#"{"t": null, "e": [2], "o": false, "a": 1, "s": "\u00e9"}"#,
        ] {
            assert!(g.accepts(&hermes(ok)), "{ok}");
        }
        for bad in [
            r#"{}"#,
            r#"{"t": {"n": true}}"#,
            r#"{"t": null, "e": ["y"]}"#,
            r#"{"t": null, "o": 1}"#,
            r#"{"t": null, "s": 1}"#,
            r#"{"t": null, "s": "a", "e": []}"#,
        ] {
            assert!(!g.accepts(&hermes(bad)), "{bad}");
        }
    }

    #[test]
    fn bare_parameters_are_text_without_their_closing_marker() {
        let g = grammar(
            Family::Qwen3Coder,
            json!({"type": "object", "required": ["cmd"], "properties": {
                "n": {"type": "integer"}, "cmd": {"type": "string"}}}),
        );
        let call =
            |params: &str| format!("<tool_call>\n<function=f>\n{params}</function>\n</tool_call>");
        let cmd = |v: &str| format!("<parameter=cmd>\n{v}\n</parameter>\n");
        assert!(g.accepts(&call(&cmd("ls -l </param"))));
        assert!(g.accepts(&call(&format!(
            "{}<parameter=n>\n7\n</parameter>\n",
            cmd("<p>")
        ))));
        assert!(!g.accepts(&call(&cmd("a </parameter> b"))));
        assert!(!g.accepts(&call("<parameter=n>\n7\n</parameter>\n")));
    }

    #[test]
    fn rules_are_shared_by_content_and_names_never_collide() {
        let schema = json!({"type": "object", "properties": {"x": {"type": "object",
            "properties": {"y": {"type": "integer"}}}}});
        let two = vec![
            json!({"name": "a-b", "parameters": schema}),
            json!({"name": "a_b", "parameters": schema}),
        ];
        let g = call_grammar(Family::Hermes, &two).unwrap().grammar;
        // One rule per distinct body: the two tools' arguments are one rule.
        assert_eq!(
            g.matches("\"{\" (\"\\\"y\\\": \" integer)? \"}\"").count(),
            1,
            "{g}"
        );
        // Two tools whose names read alike, with other schemas: two rules, not the first
        // one's twice (the old code kept the first body given a name).
        let other = vec![
            json!({"name": "a-b", "parameters": {"type": "object", "properties": {"p": {"type": "integer"}}}}),
            json!({"name": "a_b", "parameters": {"type": "object", "properties": {"q": {"type": "integer"}}}}),
        ];
        let g = Gbnf::new(&call_grammar(Family::Hermes, &other).unwrap().grammar);
        let call = |name: &str, args: &str| {
            format!("<tool_call>\n{{\"name\": \"{name}\", \"arguments\": {args}}}\n</tool_call>")
        };
        assert!(g.accepts(&call("a-b", r#"{"p": 1}"#)));
        assert!(g.accepts(&call("a_b", r#"{"q": 1}"#)));
        assert!(!g.accepts(&call("a_b", r#"{"p": 1}"#)));
    }

    /// `levels` of `{"type": ["object", "object"], "properties": {"a": <next>}}` around a
    /// string (issue 49: 14 of them, 939 bytes, made a 6.5 MB grammar).
    fn nested(levels: usize) -> Value {
        let mut s = json!({"type": "string"});
        for _ in 0..levels {
            s = json!({"type": ["object", "object"], "properties": {"a": s}});
        }
        s
    }

    /// An object of `n` optional integer properties (issue 49: 8,000 made an 896 MB grammar).
    fn optional(n: usize) -> Value {
        let props: serde_json::Map<String, Value> = (0..n)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        json!({"type": "object", "properties": props})
    }

    fn rule_count(g: &CallGrammar) -> usize {
        g.grammar.lines().count()
    }

    /// The attack that doubled the grammar per level. The old code (2^levels renders of the
    /// innermost schema) made, for Hermes: 10 levels 306,313 bytes in 2,049 rules, 14 levels
    /// 6,471,817 bytes in 32,769 rules (1.9 s), 16 levels 29 MB in 131,073 rules (56 s), so
    /// these size bounds fail on it; the control is that the grammar still holds the nesting
    /// (the innermost string is reachable: the call with 14 `a`s reads).
    #[test]
    fn listed_types_nested_fourteen_and_eighteen_deep_make_a_small_grammar() {
        for family in Family::ALL {
            for levels in [14, 18] {
                let g = call_grammar(family, &tool(nested(levels))).unwrap();
                assert!(
                    g.grammar.len() < 8 * 1024,
                    "{family} {levels}: {} bytes",
                    g.grammar.len()
                );
                assert!(
                    rule_count(&g) <= levels + 16,
                    "{family} {levels}: {} rules",
                    rule_count(&g)
                );
            }
        }
        let g = grammar(Family::Hermes, nested(14));
        let mut args = "\"deep\"".to_string();
        for _ in 0..14 {
            args = format!("{{\"a\": {args}}}");
        }
        assert!(g.accepts(&hermes(&args)));
        assert!(g.accepts(&hermes(r#"{"a": {}}"#)));
        assert!(!g.accepts(&hermes(r#"{"a": {"a": 1}}"#)));
    }

    #[test]
    fn schemas_nested_past_the_depth_bound_are_refused() {
        let bound = GrammarBounds::DEFAULT.max_depth;
        assert!(call_grammar(Family::Hermes, &tool(nested(bound))).is_ok());
        for family in Family::ALL {
            assert_eq!(
                call_grammar(family, &tool(nested(bound + 1))),
                Err(NoGrammar::Refused(GrammarLimit::Depth(bound))),
                "{family}"
            );
        }
    }

    /// The attack that made every optional property a possible first one, each with the rest
    /// behind it. The old code made, for Hermes: 1,000 properties 14.5 MB, 4,000 240 MB, 8,000
    /// 960 MB (12 s, 3.7 GB resident), so the size bounds here fail on it; now one rule per
    /// property (Hermes, DeepSeek, Llama 3) or one item each in one rule (Qwen3-Coder, GLM):
    /// 8,000 make a grammar within the bounds, 12,000 are past the rule bound for the JSON
    /// families (refused before the grammar is written), and with the bounds raised (the
    /// control that the grammar is linear, not merely cut off) 8,000 make under 200 bytes each.
    #[test]
    fn eight_thousand_optional_properties_make_a_grammar_within_the_bounds() {
        let b = GrammarBounds::DEFAULT;
        let attack = tool(optional(8_000));
        for family in Family::ALL {
            let g = call_grammar(family, &attack).unwrap();
            assert!(
                g.grammar.len() <= b.max_bytes,
                "{family}: {} bytes",
                g.grammar.len()
            );
            assert!(
                rule_count(&g) <= b.max_rules,
                "{family}: {} rules",
                rule_count(&g)
            );
            eprintln!(
                "{family}: 8,000 optional properties, {} bytes in {} rules",
                g.grammar.len(),
                rule_count(&g)
            );
        }
        for family in [Family::Hermes, Family::DeepSeekV3, Family::Llama3Json] {
            assert_eq!(
                call_grammar(family, &tool(optional(12_000))),
                Err(NoGrammar::Refused(GrammarLimit::Rules(b.max_rules))),
                "{family}"
            );
        }
        for family in [Family::Qwen3Coder, Family::Glm45] {
            let g = call_grammar(family, &tool(optional(12_000))).unwrap();
            assert!(
                g.grammar.len() <= b.max_bytes,
                "{family}: {} bytes",
                g.grammar.len()
            );
        }
        let unbounded = GrammarBounds {
            max_bytes: 64 << 20,
            max_rules: 1 << 20,
            ..GrammarBounds::DEFAULT
        };
        for family in Family::ALL {
            let g = call_grammar_within(family, &attack, &unbounded).unwrap();
            assert!(
                g.grammar.len() < 8_000 * 200,
                "{family}: {} bytes",
                g.grammar.len()
            );
            assert!(
                rule_count(&g) < 8_000 + 16,
                "{family}: {} rules",
                rule_count(&g)
            );
        }
        // And 500 are within the default bounds; the chain reads as the properties in order.
        let g = call_grammar(Family::Hermes, &tool(optional(500))).unwrap();
        assert!(g.grammar.len() < 500 * 200, "{} bytes", g.grammar.len());
        let g = grammar(Family::Hermes, optional(40));
        assert!(g.accepts(&hermes(r#"{"p0": 1, "p20": 2, "p39": 3}"#)));
        assert!(g.accepts(&hermes(r#"{"p39": 3}"#)));
        assert!(!g.accepts(&hermes(r#"{"p20": 2, "p0": 1}"#)));
    }

    #[test]
    fn the_walk_and_the_grammar_are_bounded_whatever_the_shape() {
        let b = GrammarBounds::DEFAULT;
        // Many subschemas: wide, not deep.
        let wide: serde_json::Map<String, Value> = (0..b.max_schema_nodes + 1)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        let wide = json!({"type": "object", "properties": wide, "required": ["p0"]});
        assert!(matches!(
            call_grammar(Family::Hermes, &tool(wide)),
            Err(NoGrammar::Refused(
                GrammarLimit::SchemaNodes(_) | GrammarLimit::Bytes(_)
            ))
        ));
        let huge_enum = json!({"enum": (0..b.max_schema_nodes + 1).collect::<Vec<_>>()});
        assert_eq!(
            call_grammar(Family::Hermes, &tool(huge_enum)),
            Err(NoGrammar::Refused(GrammarLimit::SchemaNodes(
                b.max_schema_nodes
            )))
        );
        // A few long names: bytes.
        let long =
            json!({"type": "object", "properties": {"x".repeat(1 << 20): {"type": "integer"}}});
        assert_eq!(
            call_grammar(Family::Hermes, &tool(long)),
            Err(NoGrammar::Refused(GrammarLimit::Bytes(b.max_bytes)))
        );
        let tools: Vec<Value> = (0..2_000)
            .map(|i| json!({"name": format!("{i}{}", "n".repeat(1000)), "parameters": {}}))
            .collect();
        assert_eq!(
            call_grammar(Family::Hermes, &tools),
            Err(NoGrammar::Refused(GrammarLimit::Bytes(b.max_bytes)))
        );
        assert_eq!(call_grammar(Family::Hermes, &[]), Err(NoGrammar::NoTools));
    }

    /// A small random schema: objects (some properties required), arrays, type lists (with
    /// repeats), `anyOf`, `enum`, `const` and scalars.
    fn schema() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(json!({"type": "string"})),
            Just(json!({"type": "integer"})),
            Just(json!({"type": ["number", "null", "number"]})),
            Just(json!({"type": "boolean"})),
            Just(json!({})),
            Just(json!({"enum": ["a", 1, null]})),
            Just(json!({"const": "k"})),
        ];
        leaf.prop_recursive(6, 64, 6, |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 1..6), any::<u8>()).prop_map(
                    |(props, req)| {
                        let names: Vec<String> =
                            (0..props.len()).map(|i| format!("k{i}")).collect();
                        let required: Vec<&String> = names
                            .iter()
                            .enumerate()
                            .filter(|(i, _)| req & (1 << i) != 0)
                            .map(|(_, n)| n)
                            .collect();
                        let props: serde_json::Map<String, Value> =
                            names.iter().cloned().zip(props).collect();
                        json!({"type": "object", "properties": props, "required": required})
                    }
                ),
                (prop::collection::vec(inner.clone(), 1..6), any::<bool>()).prop_map(
                    |(props, twice)| {
                        let props: serde_json::Map<String, Value> = props
                            .into_iter()
                            .enumerate()
                            .map(|(i, p)| (format!("k{i}"), p))
                            .collect();
                        let types = if twice {
                            json!(["object", "object"])
                        } else {
                            json!(["object", "null"])
                        };
                        json!({"type": types, "properties": props})
                    }
                ),
                inner
                    .clone()
                    .prop_map(|items| json!({"type": ["array", "array"], "items": items})),
                prop::collection::vec(inner, 1..4).prop_map(|options| json!({"anyOf": options})),
            ]
        })
    }

    proptest! {
        /// The grammar is within a constant of the schema's size (the old code's grew with
        /// 2 to the nesting of type lists and with the square of optional properties).
        #[test]
        fn a_grammar_is_linear_in_its_schema(schema in schema()) {
            let bytes = serde_json::to_string(&schema).unwrap().len();
            for family in Family::ALL {
                let g = call_grammar(family, &tool(schema.clone())).unwrap();
                prop_assert!(
                    g.grammar.len() <= 2_048 + 40 * bytes,
                    "{family}: {} bytes of grammar for {bytes} of schema", g.grammar.len()
                );
                prop_assert!(rule_count(&g) <= 16 + bytes / 8, "{family}: {} rules", rule_count(&g));
                // Every rule named is one defined (the matcher panics on an undefined one).
                let gbnf = Gbnf::new(&g.grammar);
                for rule in gbnf.rules.values() {
                    names_defined(&gbnf, rule);
                }
            }
        }
    }

    fn names_defined(g: &Gbnf, node: &Node) {
        match node {
            Node::Name(n) => assert!(g.rules.contains_key(n), "no rule {n}"),
            Node::Alt(alts) => alts.iter().flatten().for_each(|n| names_defined(g, n)),
            Node::Rep(n, _, _) => names_defined(g, n),
            _ => {}
        }
    }
}
