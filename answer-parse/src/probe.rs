//! Which family reads back what a chat template writes: the template renders an assistant turn
//! with two tool calls (one with content, one with reasoning), and a family is the model's
//! only if its parser gives back those calls, that content and that reasoning. The probe uses
//! the real template, so a template no family reads is refused by name before any call.

use serde_json::{json, Map, Value};
use tokentap_chat_template::{ChatTemplate, RenderOptions};

use crate::answer::Answer;
use crate::calls::ToolSchemas;
use crate::family::{Dialect, Family, THINK_CLOSE, THINK_OPEN};
use crate::stream::AnswerParser;

/// Text a template may put after an assistant turn (its end-of-turn token and what follows):
/// the engine stops at it, so it is never part of the sampled answer.
const TURN_ENDS: [&str; 7] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<｜end▁of▁sentence｜>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
];

/// The probe's offered tool: one string and one integer parameter, so a family that writes
/// parameters as text is seen reading them by the declared type.
pub fn probe_tools() -> Vec<Value> {
    vec![json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"}
                },
                "required": ["city"]
            }
        }
    })]
}

/// The answer each probe conversation's last turn carries.
pub struct ProbeTurn {
    pub content: &'static str,
    pub reasoning: Option<&'static str>,
    pub calls: Vec<(&'static str, Value)>,
}

pub fn probe_turns() -> Vec<ProbeTurn> {
    vec![
        ProbeTurn {
            content: "",
            reasoning: None,
            calls: vec![
                ("get_weather", json!({"city": "Paris", "days": 3})),
                (
                    "get_weather",
                    json!({"city": "Zürich \"centre\"", "days": 1}),
                ),
            ],
        },
        ProbeTurn {
            content: "Let me check.",
            reasoning: Some("The user wants the weather."),
            calls: vec![("get_weather", json!({"city": "Oslo"}))],
        },
    ]
}

/// Why no family reads a template's tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unreadable {
    pub reason: String,
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// The family that reads back every probe turn the template renders, with reasoning if the
/// template writes `<think>`. `variables` are the tokenizer's (`bos_token`, `eos_token`, …).
pub fn probe(
    template: &ChatTemplate,
    variables: &Map<String, Value>,
) -> Result<Dialect, Unreadable> {
    let tools = probe_tools();
    let schemas = ToolSchemas::from_tools(&tools);
    let mut rendered = Vec::new();
    let mut refused = None;
    for turn in probe_turns() {
        // A template may refuse one probe turn (Llama 3: one call at a time); it must take one.
        match render_turn(template, variables, &tools, &turn) {
            Ok((prompt, answer)) => rendered.push((turn, prompt, answer)),
            Err(e) if rendered.is_empty() && turn.calls.len() > 1 => refused = Some(e),
            Err(e) => return Err(e),
        }
    }
    if rendered.is_empty() {
        return Err(refused.expect("a turn was refused"));
    }
    let mut tried = Vec::new();
    for family in Family::ALL {
        let mut reads_all = true;
        for (turn, prompt, answer) in &rendered {
            let dialect = dialect_for(family, prompt, answer);
            let mut sample = answer.clone();
            if dialect.starts_in_reasoning && !sample.contains(THINK_CLOSE) {
                // The history dropped the reasoning the prompt opened: the sample closes it.
                sample.insert_str(0, THINK_CLOSE);
            }
            let got = AnswerParser::parse_whole(dialect, schemas.clone(), &sample);
            if let Err(why) = same_answer(turn, &got, answer) {
                tried.push(format!("{family}: {why}"));
                reads_all = false;
                break;
            }
        }
        if reads_all {
            let (_, prompt, answer) = &rendered[rendered.len() - 1];
            return Ok(dialect_for(family, prompt, answer));
        }
    }
    Err(Unreadable {
        reason: format!(
            "no parser reads the tool calls this chat template writes (tried {}); its first call renders as {:?}",
            tried.join("; "),
            rendered[0].2.chars().take(200).collect::<String>()
        ),
    })
}

/// With reasoning when the template writes `<think>` blocks.
fn dialect_for(family: Family, prompt: &str, answer: &str) -> Dialect {
    let dialect = Dialect::new(family);
    if prompt.contains(THINK_OPEN) || answer.contains(THINK_CLOSE) {
        dialect.with_reasoning_after(prompt)
    } else {
        dialect
    }
}

/// The prompt (with the generation prompt) and the answer the template writes for `turn`: the
/// full conversation's rendering less the prompt's, less the end of the turn.
fn render_turn(
    template: &ChatTemplate,
    variables: &Map<String, Value>,
    tools: &[Value],
    turn: &ProbeTurn,
) -> Result<(String, String), Unreadable> {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a helpful assistant."}),
        json!({"role": "user", "content": "What is the weather?"}),
    ];
    let calls: Vec<Value> = turn
        .calls
        .iter()
        .enumerate()
        .map(|(i, (name, args))| {
            json!({"id": format!("call_{i}"), "type": "function",
                   "function": {"name": name, "arguments": args}})
        })
        .collect();
    let mut assistant = json!({"role": "assistant", "content": turn.content, "tool_calls": calls});
    if let Some(reasoning) = turn.reasoning {
        assistant["reasoning_content"] = json!(reasoning);
    }
    let render = |messages: &[Value], generation: bool| {
        template
            .render_dicts(
                messages,
                Some(tools),
                &RenderOptions {
                    add_generation_prompt: generation,
                    kwargs: variables.clone(),
                    ..Default::default()
                },
            )
            .map_err(|e| Unreadable {
                reason: format!("the chat template refuses the probe conversation: {e}"),
            })
    };
    let prompt = render(&messages, true)?;
    let history = render(&messages, false)?;
    messages.push(assistant);
    let full = render(&messages, false)?;
    let (Some(generation), Some(turn)) =
        (prompt.strip_prefix(&history), full.strip_prefix(&history))
    else {
        return Err(Unreadable {
            reason: "the chat template renders the conversation before the assistant turn differently once the turn is added".into(),
        });
    };
    // The model samples after the whole generation prompt. A template may write more there
    // than it keeps in the turn's history (`<think>\n</think>`, thinking off): the sample is
    // then what follows the part both share, cut back to a marker's end.
    let shared = generation
        .char_indices()
        .zip(turn.chars())
        .find(|((_, a), b)| a != b)
        .map_or(generation.len().min(turn.len()), |((at, _), _)| at);
    let mut answer = if shared == generation.len() {
        &turn[shared..]
    } else {
        let cut = turn[..shared].rfind(['\n', '>']).map_or(0, |at| at + 1);
        &turn[cut..]
    };
    // The engine stops at the first end of turn: nothing after it is sampled.
    if let Some(end) = TURN_ENDS.iter().filter_map(|e| answer.find(e)).min() {
        answer = &answer[..end];
    }
    let answer = answer.trim_end();
    Ok((prompt, answer.to_string()))
}

fn same_answer(turn: &ProbeTurn, got: &Answer, text: &str) -> Result<(), String> {
    if got.tool_calls.len() != turn.calls.len() {
        return Err(format!(
            "{} calls read, {} written",
            got.tool_calls.len(),
            turn.calls.len()
        ));
    }
    for (call, (name, args)) in got.tool_calls.iter().zip(&turn.calls) {
        let read: Value = serde_json::from_str(&call.arguments).map_err(|e| e.to_string())?;
        if call.name != *name || read != *args {
            return Err(format!(
                "read {}({}), written {name}({args})",
                call.name, call.arguments
            ));
        }
    }
    // A template may leave the content out beside calls (Hermes 3, Llama 3); where it writes
    // it, it must come back as content.
    if text.contains(turn.content) && got.content.trim() != turn.content {
        return Err(format!(
            "content read {:?}, written {:?}",
            got.content, turn.content
        ));
    }
    // A template may leave the reasoning out; where it writes it, it must come back as reasoning.
    if let Some(reasoning) = turn.reasoning {
        let written = text.contains(reasoning);
        if written && got.reasoning.trim() != reasoning {
            return Err(format!(
                "reasoning read {:?}, written {reasoning:?}",
                got.reasoning
            ));
        }
    }
    Ok(())
}
