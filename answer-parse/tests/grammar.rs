//! The calls' grammar for the harnesses' real tool lists (wire/testdata/harness-wire): every
//! rule it names is defined (llama-server refuses a grammar that names an undefined rule, which
//! the first version did for any tool whose parameters are an empty object: Codex's and Qwen
//! Code's lists), and each tool's call opens as the template writes it. The e2e tests
//! (`tito_harnesses`) send these grammars to the real llama-server.

use std::collections::BTreeSet;

use serde_json::Value;
use tokentap_answer_parse::{call_grammar, Family, NoGrammar};

fn tools(name: &str) -> Vec<Value> {
    let path = format!(
        "{}/../wire/testdata/harness-wire/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["body"]["tools"].as_array().cloned().unwrap_or_default()
}

/// The rule names a grammar defines and the ones its bodies use (outside literals and
/// character classes).
fn defined_and_used(grammar: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut defined, mut used) = (BTreeSet::new(), BTreeSet::new());
    for line in grammar.lines() {
        let (name, body) = line.split_once(" ::= ").expect("name ::= body");
        defined.insert(name.to_string());
        let mut chars = body.chars().peekable();
        let mut word = String::new();
        while let Some(c) = chars.next() {
            match c {
                '"' => {
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => {
                                chars.next();
                            }
                            '"' => break,
                            _ => {}
                        }
                    }
                }
                '[' => {
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => {
                                chars.next();
                            }
                            ']' => break,
                            _ => {}
                        }
                    }
                }
                '{' => {
                    for c in chars.by_ref() {
                        if c == '}' {
                            break;
                        }
                    }
                }
                c if c.is_ascii_alphanumeric() || c == '-' => word.push(c),
                _ => {
                    if !word.is_empty() {
                        used.insert(std::mem::take(&mut word));
                    }
                }
            }
        }
        if !word.is_empty() {
            used.insert(word);
        }
    }
    (defined, used)
}

/// How each family's template opens a call to `name`.
fn opening(family: Family, name: &str) -> String {
    match family {
        Family::Hermes => format!(r#""<tool_call>\n{{\"name\": \"{name}\", \"arguments\": ""#),
        Family::Qwen3Coder => format!(r#""<tool_call>\n<function={name}>\n""#),
        Family::Glm45 => format!(r#""<tool_call>{name}\n""#),
        Family::DeepSeekV3 => {
            format!(r#""<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n""#)
        }
        Family::Llama3Json => format!(r#""{{\"name\": \"{name}\", \"parameters\": ""#),
    }
}

#[test]
fn every_rule_named_is_defined_for_each_harness_and_family() {
    for harness in ["pi", "qwen", "codex", "claude"] {
        let tools = tools(harness);
        assert!(!tools.is_empty(), "{harness}");
        for family in Family::ALL {
            let g = call_grammar(family, &tools).expect("a grammar");
            let (defined, used) = defined_and_used(&g.grammar);
            let missing: Vec<_> = used.difference(&defined).collect();
            assert!(
                missing.is_empty(),
                "{harness}, {family}: undefined rules {missing:?}\n{}",
                g.grammar
            );
            assert!(g.grammar.starts_with("root ::= "), "{harness}, {family}");
            assert!(
                g.grammar
                    .contains(&format!("\"{}", g.trigger.replace('"', "\\\""))),
                "{harness}, {family}: the grammar starts at its trigger {:?}",
                g.trigger
            );
            for tool in &tools {
                let function = tool.get("function").unwrap_or(tool);
                if let Some(name) = function.get("name").and_then(Value::as_str) {
                    assert!(
                        g.grammar.contains(&opening(family, name)),
                        "{harness}, {family}: {name}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_checker_sees_an_undefined_rule() {
    // The positive control: the shape of the first version's bug.
    let (defined, used) = defined_and_used("root ::= object\nobject ::= \"{\" value \"}\"");
    assert_eq!(used.difference(&defined).collect::<Vec<_>>(), vec!["value"]);
}

#[test]
fn no_tools_no_grammar() {
    for family in Family::ALL {
        assert_eq!(call_grammar(family, &[]), Err(NoGrammar::NoTools));
    }
}
