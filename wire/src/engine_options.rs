//! Engine options a caller chooses, and which of them reach the engine.
//!
//! An engine option is a request field the engine is sent as the caller gave it
//! ([`ChatRequest::extra`]: `chat_template_kwargs`, `response_format`, `logit_bias`, …). The
//! engine is shared — on a rollout node by every sample, whose agents are hostile — and these
//! fields reach its most fragile parts: the chat template renderer (vLLM once took a whole
//! Jinja `chat_template` through `chat_template_kwargs`), the structured-output compiler (a
//! huge or deep schema burns its CPU), the sampler (thousands of `logit_bias` entries) and
//! the answer (llama.cpp's `n_probs` multiplies its size). So, in one place, for every
//! listener:
//!
//! 1. each option is held to the bounds a provider holds it to ([`check`]); one out of bounds
//!    refuses the call, a 400 naming the parameter, before anything reaches the engine;
//! 2. the listener's [`EngineOptionPolicy`] says which options its callers may set at all
//!    (`--engine-option`); the others are dropped from the engine request, each with a note
//!    on the record, so the record never shows an option as sent that was not.
//!
//! Sampling parameters (`temperature`, `max_tokens`, …) are not engine options here: they are
//! typed fields of the canonical request, the caller's to choose within its budgets.

use std::collections::BTreeSet;
use std::io;

use serde_json::{Map, Value};
use tokentap_schema::Normalization;

use crate::canonical::ChatRequest;

/// An engine option callers may set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EngineOption {
    ResponseFormat,
    ParallelToolCalls,
    ReasoningEffort,
    ChatTemplateKwargs,
    RepetitionPenalty,
    LogitBias,
    NProbs,
}

impl EngineOption {
    pub const ALL: [EngineOption; 7] = [
        EngineOption::ResponseFormat,
        EngineOption::ParallelToolCalls,
        EngineOption::ReasoningEffort,
        EngineOption::ChatTemplateKwargs,
        EngineOption::RepetitionPenalty,
        EngineOption::LogitBias,
        EngineOption::NProbs,
    ];

    /// The field's name in an engine (Chat Completions) request.
    pub fn name(self) -> &'static str {
        match self {
            EngineOption::ResponseFormat => "response_format",
            EngineOption::ParallelToolCalls => "parallel_tool_calls",
            EngineOption::ReasoningEffort => "reasoning_effort",
            EngineOption::ChatTemplateKwargs => "chat_template_kwargs",
            EngineOption::RepetitionPenalty => "repetition_penalty",
            EngineOption::LogitBias => "logit_bias",
            EngineOption::NProbs => "n_probs",
        }
    }

    pub fn from_name(name: &str) -> Option<EngineOption> {
        EngineOption::ALL.into_iter().find(|o| o.name() == name)
    }
}

/// The metrics label of a field that is no engine option (a bounded label set).
pub const OTHER_LABEL: &str = "other";

/// Which engine options a listener's callers may set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptionPolicy {
    allowed: BTreeSet<EngineOption>,
}

impl Default for EngineOptionPolicy {
    /// Every option: the harness is the operator's own (`proxy`, `run`, the node agent).
    fn default() -> Self {
        EngineOptionPolicy::all()
    }
}

impl EngineOptionPolicy {
    pub fn all() -> Self {
        EngineOptionPolicy::only(EngineOption::ALL)
    }

    /// A rollout node's (`serve`, `generate`): its agents are hostile, so only what the real
    /// harnesses send — `parallel_tool_calls` (Codex; Claude Code's
    /// `disable_parallel_tool_use`) and `reasoning_effort` (Codex's `reasoning.effort`).
    pub fn rollout_default() -> Self {
        EngineOptionPolicy::only([
            EngineOption::ParallelToolCalls,
            EngineOption::ReasoningEffort,
        ])
    }

    pub fn only(options: impl IntoIterator<Item = EngineOption>) -> Self {
        EngineOptionPolicy {
            allowed: options.into_iter().collect(),
        }
    }

    /// The policy `--engine-option` values give: option names, `all`, or `none` alone.
    pub fn from_flag_values<S: AsRef<str>>(values: &[S]) -> Result<Self, String> {
        let mut allowed = BTreeSet::new();
        for v in values {
            match v.as_ref() {
                "all" => allowed.extend(EngineOption::ALL),
                "none" if values.len() == 1 => {}
                "none" => return Err("--engine-option none cannot be given with others".into()),
                name => match EngineOption::from_name(name) {
                    Some(o) => {
                        allowed.insert(o);
                    }
                    None => {
                        return Err(format!(
                            "unknown engine option '{name}' (known: {}, all, none)",
                            EngineOption::ALL.map(EngineOption::name).join(", ")
                        ))
                    }
                },
            }
        }
        Ok(EngineOptionPolicy { allowed })
    }

    pub fn allows(&self, option: EngineOption) -> bool {
        self.allowed.contains(&option)
    }

    /// The allowed options' names, for logs.
    pub fn names(&self) -> Vec<&'static str> {
        self.allowed.iter().map(|o| o.name()).collect()
    }
}

/// A call refused for an engine option out of bounds.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    /// The option's metrics label.
    pub label: &'static str,
    /// The offending parameter as the caller's API names it (e.g. `text.format`,
    /// `chat_template_kwargs.chat_template`).
    pub param: String,
    /// Names the parameter, as the provider's own messages do.
    pub message: String,
}

/// An option left out of the engine request.
#[derive(Debug, Clone, PartialEq)]
pub struct Dropped {
    /// The option's metrics label ([`OTHER_LABEL`] for a field that is none).
    pub label: &'static str,
    /// The parameter as the caller's API names it.
    pub param: String,
    /// Why it was left out.
    pub why: &'static str,
}

impl Dropped {
    /// The record's note of it (a `dropped_field`, as parsers note the fields they drop).
    pub fn normalization(&self) -> Normalization {
        Normalization {
            kind: "dropped_field".into(),
            detail: format!(
                "'{}' is not forwarded to the engine: {}",
                self.param, self.why
            ),
        }
    }
}

const NOT_ALLOWED: &str = "not allowed on this node (tokentap --engine-option)";
const NO_OPTION: &str = "not an engine option tokentap forwards";

/// Checks every engine option of `request` against its bounds, then leaves out those
/// `policy` does not allow. `param` names an option as the caller's API does (the wire
/// module knows: Responses' `response_format` is the caller's `text.format`).
pub fn screen(
    request: &mut ChatRequest,
    policy: &EngineOptionPolicy,
    param: impl Fn(EngineOption) -> &'static str,
) -> Result<Vec<Dropped>, Refusal> {
    // Every option is checked, allowed or not: a call is answered the same on every listener.
    for (key, value) in &request.extra {
        if let Some(option) = EngineOption::from_name(key) {
            check(option, value, param(option)).map_err(|Bad { at, message }| Refusal {
                label: option.name(),
                param: match at {
                    Some(at) => format!("{}.{at}", param(option)),
                    None => param(option).to_owned(),
                },
                message,
            })?;
        }
    }
    let mut dropped = Vec::new();
    let extra = std::mem::take(&mut request.extra);
    request.extra = extra
        .into_iter()
        .filter(|(key, _)| {
            let left_out = match EngineOption::from_name(key) {
                Some(option) if policy.allows(option) => return true,
                Some(option) => Dropped {
                    label: option.name(),
                    param: param(option).to_owned(),
                    why: NOT_ALLOWED,
                },
                // Parsers put only engine options here; anything else is not sent.
                None => Dropped {
                    label: OTHER_LABEL,
                    param: key.clone(),
                    why: NO_OPTION,
                },
            };
            dropped.push(left_out);
            false
        })
        .collect::<Map<_, _>>();
    Ok(dropped)
}

/// Largest serialized engine option: what `response_format` needs for a real schema
/// (OpenAI's own limits — 5,000 properties, 10 levels of nesting — come first for most).
pub const MAX_OPTION_BYTES: usize = 64 << 10;
/// Deepest nesting of objects and arrays in an option (a `response_format` schema): a schema
/// of OpenAI's 10 levels, each under `properties`, `anyOf` and `items`, stays well within it.
pub const MAX_OPTION_DEPTH: usize = 64;
/// OpenAI's limit on `logit_bias` entries.
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 300;
/// OpenAI's limit on `top_logprobs`, held to llama.cpp's `n_probs` (the same alternatives).
pub const MAX_N_PROBS: u64 = 20;
/// Longest string a `chat_template_kwargs` value may be.
pub const MAX_TEMPLATE_STRING_BYTES: usize = 256;

/// The `chat_template_kwargs` callers may set: plain variables real chat templates read to
/// switch modes (Qwen3, GLM and SmolLM3 `enable_thinking`; DeepSeek-V3.1 and Granite
/// `thinking`; gpt-oss `reasoning_effort` and `model_identity`; Seed-OSS `thinking_budget`;
/// Qwen2-VL `add_vision_id`). Never what `apply_chat_template` itself takes (`chat_template`,
/// `tokenize`, `add_generation_prompt`, `continue_final_message`, `documents`, `tools`,
/// `return_dict`, `tokenizer`, …): those change what the engine renders or how, not a mode
/// of the template.
pub const TEMPLATE_VARIABLES: &[&str] = &[
    "enable_thinking",
    "thinking",
    "reasoning_effort",
    "thinking_budget",
    "model_identity",
    "add_vision_id",
];

/// OpenAI's `reasoning_effort` values.
pub const REASONING_EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh"];

/// The `response_format` types OpenAI takes.
const RESPONSE_FORMAT_TYPES: &[&str] = &["text", "json_object", "json_schema"];

/// What is wrong with an option: where inside it (a key of an object option), and the
/// message.
struct Bad {
    at: Option<String>,
    message: String,
}

impl Bad {
    fn new(message: String) -> Bad {
        Bad { at: None, message }
    }
}

/// Whether `value` is within the bounds of `option` (`name`: as the caller's API calls it).
/// `null` is "not given", as providers take it.
fn check(option: EngineOption, value: &Value, name: &str) -> Result<(), Bad> {
    if value.is_null() {
        return Ok(());
    }
    let size = serialized_size(value, MAX_OPTION_BYTES);
    if size > MAX_OPTION_BYTES {
        return Err(Bad::new(format!(
            "Invalid '{name}': it is over {MAX_OPTION_BYTES} bytes as JSON; at most {MAX_OPTION_BYTES} are accepted."
        )));
    }
    if nesting(value, MAX_OPTION_DEPTH) > MAX_OPTION_DEPTH {
        return Err(Bad::new(format!(
            "Invalid '{name}': it nests objects and arrays more than {MAX_OPTION_DEPTH} levels deep."
        )));
    }
    match option {
        EngineOption::ParallelToolCalls => match value {
            Value::Bool(_) => Ok(()),
            other => Err(wrong_type(name, "a boolean", other)),
        },
        EngineOption::ReasoningEffort => match value {
            Value::String(s) if REASONING_EFFORTS.contains(&s.as_str()) => Ok(()),
            Value::String(s) => Err(Bad::new(format!(
                "Invalid value for '{name}': '{}'. Supported values are: {}.",
                excerpt(s),
                quoted_list(REASONING_EFFORTS)
            ))),
            other => Err(wrong_type(name, "a string", other)),
        },
        EngineOption::ResponseFormat => response_format(value, name),
        EngineOption::ChatTemplateKwargs => template_kwargs(value, name),
        EngineOption::RepetitionPenalty => match value.as_f64() {
            Some(p) if p > 0.0 => Ok(()),
            Some(_) => Err(Bad::new(format!(
                "Invalid value for '{name}': it must be greater than 0."
            ))),
            None => Err(wrong_type(name, "a number", value)),
        },
        EngineOption::LogitBias => logit_bias(value, name),
        EngineOption::NProbs => match value.as_u64() {
            Some(n) if n <= MAX_N_PROBS => Ok(()),
            _ if value.is_number() => Err(Bad::new(format!(
                "Invalid value for '{name}': expected an integer from 0 to {MAX_N_PROBS}, but got {value}."
            ))),
            _ => Err(wrong_type(name, "an integer", value)),
        },
    }
}

fn response_format(value: &Value, name: &str) -> Result<(), Bad> {
    let Value::Object(format) = value else {
        return Err(wrong_type(name, "an object", value));
    };
    match format.get("type") {
        Some(Value::String(t)) if RESPONSE_FORMAT_TYPES.contains(&t.as_str()) => {
            if t == "json_schema" && !format.get("json_schema").is_some_and(Value::is_object) {
                return Err(Bad {
                    at: Some("json_schema".into()),
                    message: format!(
                        "Missing required parameter: '{name}.json_schema' (an object holding the schema)."
                    ),
                });
            }
            Ok(())
        }
        Some(Value::String(t)) => Err(Bad {
            at: Some("type".into()),
            message: format!(
                "Invalid value for '{name}.type': '{}'. Supported values are: {}.",
                excerpt(t),
                quoted_list(RESPONSE_FORMAT_TYPES)
            ),
        }),
        Some(other) => Err(Bad {
            at: Some("type".into()),
            ..wrong_type(&format!("{name}.type"), "a string", other)
        }),
        None => Err(Bad {
            at: Some("type".into()),
            message: format!("Missing required parameter: '{name}.type'."),
        }),
    }
}

fn template_kwargs(value: &Value, name: &str) -> Result<(), Bad> {
    let Value::Object(kwargs) = value else {
        return Err(wrong_type(name, "an object", value));
    };
    for (key, v) in kwargs {
        let at = |message: String| Bad {
            at: Some(key.clone()),
            message,
        };
        if !TEMPLATE_VARIABLES.contains(&key.as_str()) {
            return Err(at(format!(
                "Invalid '{name}': '{}' is not a chat template variable callers may set (allowed: {}).",
                excerpt(key),
                TEMPLATE_VARIABLES.join(", ")
            )));
        }
        match v {
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
            Value::String(s) if s.len() <= MAX_TEMPLATE_STRING_BYTES => {}
            Value::String(_) => {
                return Err(at(format!(
                    "Invalid value for '{name}.{key}': a string of at most {MAX_TEMPLATE_STRING_BYTES} bytes is accepted."
                )))
            }
            other => {
                return Err(at(wrong_type(
                    &format!("{name}.{key}"),
                    "a boolean, number or string",
                    other,
                )
                .message))
            }
        }
    }
    Ok(())
}

fn logit_bias(value: &Value, name: &str) -> Result<(), Bad> {
    let Value::Object(biases) = value else {
        return Err(wrong_type(
            name,
            "an object mapping token ids to biases",
            value,
        ));
    };
    if biases.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(Bad::new(format!(
            "Invalid '{name}': at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, but {} were given.",
            biases.len()
        )));
    }
    for (key, bias) in biases {
        let at = |message: String| Bad {
            at: Some(key.clone()),
            message,
        };
        let token_id = !key.is_empty()
            && key.bytes().all(|b| b.is_ascii_digit())
            && key.parse::<u32>().is_ok();
        if !token_id {
            return Err(at(format!(
                "Invalid key in '{name}': '{}'. Keys must be token ids (non-negative integers).",
                excerpt(key)
            )));
        }
        match bias.as_f64() {
            Some(b) if (-100.0..=100.0).contains(&b) => {}
            Some(_) => {
                return Err(at(format!(
                    "Invalid value for '{name}.{key}': {bias}. Biases must be from -100 to 100."
                )))
            }
            None => {
                return Err(at(
                    wrong_type(&format!("{name}.{key}"), "a number", bias).message
                ))
            }
        }
    }
    Ok(())
}

/// OpenAI's wording for a parameter of the wrong JSON type.
fn wrong_type(name: &str, expected: &str, got: &Value) -> Bad {
    let got = match got {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    };
    Bad::new(format!(
        "Invalid type for '{name}': expected {expected}, but got {got} instead."
    ))
}

/// A caller's string as an error message quotes it: at most 64 characters.
fn excerpt(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

fn quoted_list(values: &[&str]) -> String {
    values
        .iter()
        .map(|v| format!("'{v}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The size of `value` as compact JSON, counted up to just past `limit` (a 30 MB option is
/// not serialized whole to be refused).
fn serialized_size(value: &Value, limit: usize) -> usize {
    struct Count {
        bytes: usize,
        limit: usize,
    }
    impl io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.bytes += buf.len();
            if self.bytes > self.limit {
                return Err(io::Error::other("over the limit"));
            }
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count { bytes: 0, limit };
    // The only error is the count passing the limit.
    let _ = serde_json::to_writer(&mut count, value);
    count.bytes
}

/// How deep `value` nests objects and arrays (a scalar: 0), counted up to just past `limit`.
fn nesting(value: &Value, limit: usize) -> usize {
    let children: Box<dyn Iterator<Item = &Value>> = match value {
        Value::Object(o) => Box::new(o.values()),
        Value::Array(a) => Box::new(a.iter()),
        _ => return 0,
    };
    if limit == 0 {
        return 1;
    }
    let mut deepest = 0;
    for child in children {
        deepest = deepest.max(nesting(child, limit - 1));
        if deepest >= limit {
            break;
        }
    }
    1 + deepest
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::canonical::ChatMessage;
    use crate::canonical::Role;

    fn request(extra: Value) -> ChatRequest {
        let Value::Object(extra) = extra else {
            panic!("extra must be an object")
        };
        ChatRequest {
            model: "m".into(),
            messages: vec![ChatMessage::text(Role::User, "hi")],
            tools: vec![],
            tool_choice: None,
            sampling: Default::default(),
            stream: false,
            extra,
        }
    }

    /// Screens `extra` with every option allowed; the refusal, if any.
    fn refusal(extra: Value) -> Option<Refusal> {
        screen(
            &mut request(extra),
            &EngineOptionPolicy::all(),
            EngineOption::name,
        )
        .err()
    }

    #[track_caller]
    fn refused(extra: Value, param: &str, words: &[&str]) {
        let r = refusal(extra.clone()).unwrap_or_else(|| panic!("{extra} was accepted"));
        assert_eq!(r.param, param, "{r:?}");
        for w in words {
            assert!(r.message.contains(w), "{r:?} does not say {w:?}");
        }
    }

    #[track_caller]
    fn accepted(extra: Value) {
        assert_eq!(refusal(extra.clone()), None, "{extra}");
    }

    #[test]
    fn logit_bias_takes_300_token_ids_biased_from_minus_100_to_100() {
        let biases = |n: usize| {
            Value::Object(
                (0..n)
                    .map(|i| (i.to_string(), json!(if i % 2 == 0 { -100 } else { 100 })))
                    .collect(),
            )
        };
        accepted(json!({"logit_bias": biases(300)}));
        accepted(json!({"logit_bias": {"50256": -100, "11": 0.5, "4294967295": 1}}));
        refused(
            json!({"logit_bias": biases(301)}),
            "logit_bias",
            &["'logit_bias'", "at most 300", "301"],
        );
        for key in ["abc", "-1", "+5", "", "1.5", "4294967296", " 7"] {
            refused(
                json!({"logit_bias": {key: 1}}),
                &format!("logit_bias.{key}"),
                &["Invalid key in 'logit_bias'", "token ids"],
            );
        }
        for bias in [json!(100.5), json!(-101), json!(1e9)] {
            refused(
                json!({"logit_bias": {"5": bias}}),
                "logit_bias.5",
                &["'logit_bias.5'", "-100 to 100"],
            );
        }
        refused(
            json!({"logit_bias": {"5": "ban"}}),
            "logit_bias.5",
            &["expected a number", "got a string"],
        );
        // llama.cpp's own list form is not the API's.
        refused(
            json!({"logit_bias": [[5, -100]]}),
            "logit_bias",
            &["Invalid type for 'logit_bias'", "got an array"],
        );
    }

    #[test]
    fn chat_template_kwargs_take_only_plain_template_variables_with_scalar_values() {
        accepted(json!({"chat_template_kwargs": {
            "enable_thinking": false, "thinking": true, "reasoning_effort": "high",
            "thinking_budget": 512, "model_identity": "You are a helper.", "add_vision_id": null,
        }}));
        refused(
            json!({"chat_template_kwargs": {"chat_template": "{{ raise_exception('x') }}"}}),
            "chat_template_kwargs.chat_template",
            &[
                "'chat_template_kwargs'",
                "'chat_template'",
                "enable_thinking",
            ],
        );
        for key in [
            "tokenize",
            "add_generation_prompt",
            "continue_final_message",
            "documents",
            "tools",
            "return_dict",
            "tokenizer",
            "conversation",
            "mm_processor_kwargs",
            "return_assistant_tokens_mask",
        ] {
            refused(
                json!({"chat_template_kwargs": {"enable_thinking": true, key: true}}),
                &format!("chat_template_kwargs.{key}"),
                &[&format!("'{key}' is not a chat template variable")],
            );
        }
        refused(
            json!({"chat_template_kwargs": {"enable_thinking": {"nested": [1]}}}),
            "chat_template_kwargs.enable_thinking",
            &[
                "'chat_template_kwargs.enable_thinking'",
                "a boolean, number or string",
            ],
        );
        refused(
            json!({"chat_template_kwargs": {"model_identity": "x".repeat(257)}}),
            "chat_template_kwargs.model_identity",
            &["at most 256 bytes"],
        );
        accepted(json!({"chat_template_kwargs": {"model_identity": "x".repeat(256)}}));
        refused(
            json!({"chat_template_kwargs": "enable_thinking"}),
            "chat_template_kwargs",
            &["expected an object", "got a string"],
        );
    }

    /// A JSON schema `levels` objects deep, inside a `response_format`.
    fn nested_schema(levels: usize) -> Value {
        let mut schema = json!({"type": "string"});
        for _ in 0..levels {
            schema = json!({"type": "object", "properties": {"x": schema}});
        }
        json!({"type": "json_schema", "json_schema": {"name": "out", "schema": schema}})
    }

    #[test]
    fn response_format_is_bounded_in_size_and_depth_and_has_openai_types() {
        for ok in [
            json!({"type": "text"}),
            json!({"type": "json_object"}),
            // llama.cpp's JSON mode with a schema.
            json!({"type": "json_object", "schema": {"type": "object"}}),
            // OpenAI's documented limit: 10 levels of nesting.
            nested_schema(10),
            // 2 JSON levels per schema level, 3 for the envelope.
            nested_schema(30),
        ] {
            accepted(json!({ "response_format": ok }));
        }
        refused(
            json!({ "response_format": nested_schema(31) }),
            "response_format",
            &["'response_format'", "more than 64 levels"],
        );
        let properties: Map<String, Value> = (0..3000)
            .map(|i| (format!("property_{i}"), json!({"type": "string"})))
            .collect();
        let huge = json!({"type": "json_schema", "json_schema": {"name": "out",
            "schema": {"type": "object", "properties": properties}}});
        assert!(serde_json::to_vec(&huge).unwrap().len() > MAX_OPTION_BYTES);
        refused(
            json!({ "response_format": huge }),
            "response_format",
            &["'response_format'", "65536 bytes"],
        );
        refused(
            json!({"response_format": {"type": "structural_tag", "structures": []}}),
            "response_format.type",
            &[
                "'response_format.type'",
                "'structural_tag'",
                "'json_schema'",
            ],
        );
        refused(
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
            &["'response_format.json_schema'"],
        );
        refused(
            json!({"response_format": {"schema": {}}}),
            "response_format.type",
            &["Missing required parameter: 'response_format.type'"],
        );
        refused(
            json!({"response_format": {"type": 1}}),
            "response_format.type",
            &["Invalid type for 'response_format.type'"],
        );
        refused(
            json!({"response_format": "json"}),
            "response_format",
            &["expected an object"],
        );
    }

    #[test]
    fn n_probs_is_at_most_20_like_openai_top_logprobs() {
        accepted(json!({"n_probs": 0}));
        accepted(json!({"n_probs": 20}));
        for n in [json!(21), json!(-1), json!(1.5), json!(100000)] {
            refused(
                json!({ "n_probs": n }),
                "n_probs",
                &["'n_probs'", "0 to 20"],
            );
        }
        refused(json!({"n_probs": "5"}), "n_probs", &["expected an integer"]);
    }

    #[test]
    fn scalar_options_have_their_types_and_values() {
        accepted(
            json!({"parallel_tool_calls": false, "reasoning_effort": "minimal",
            "repetition_penalty": 1.1}),
        );
        for effort in REASONING_EFFORTS {
            accepted(json!({ "reasoning_effort": effort }));
        }
        refused(
            json!({"parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
            &["Invalid type for 'parallel_tool_calls': expected a boolean, but got a string instead."],
        );
        refused(
            json!({"reasoning_effort": "extreme"}),
            "reasoning_effort",
            &["Invalid value for 'reasoning_effort': 'extreme'", "'xhigh'"],
        );
        refused(
            json!({"reasoning_effort": 3}),
            "reasoning_effort",
            &["expected a string"],
        );
        refused(
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
            &["greater than 0"],
        );
        refused(
            json!({"repetition_penalty": [1]}),
            "repetition_penalty",
            &["expected a number"],
        );
    }

    #[test]
    fn any_option_is_bounded_in_size_and_quoted_short() {
        let long = "x".repeat(MAX_OPTION_BYTES + 1);
        refused(
            json!({ "reasoning_effort": long }),
            "reasoning_effort",
            &["65536 bytes"],
        );
        // A caller's long value is not echoed whole in the message.
        let r = refusal(json!({"reasoning_effort": "y".repeat(10_000)})).unwrap();
        assert!(r.message.len() < 300, "{}", r.message);
        // `null` is "not given".
        for o in EngineOption::ALL {
            accepted(json!({ o.name(): null }));
        }
    }

    #[test]
    fn the_size_and_depth_counts_stop_past_their_limit() {
        // Past the limit, serializing stops: 100,000 entries are not all written to be refused.
        let big = json!(vec!["x"; 100_000]);
        let counted = serialized_size(&big, 100);
        assert!((101..1000).contains(&counted), "{counted}");
        let small = json!({"a": [1, 2]});
        assert_eq!(serialized_size(&small, 100), r#"{"a":[1,2]}"#.len());
        let mut deep = json!(1);
        for _ in 0..100 {
            deep = json!([deep]);
        }
        assert_eq!(nesting(&deep, 10), 11);
        assert_eq!(nesting(&deep, 1000), 100);
        assert_eq!(nesting(&json!("s"), 0), 0);
        assert_eq!(nesting(&json!({}), 0), 1);
    }

    #[test]
    fn a_policy_drops_the_options_it_does_not_allow_and_notes_each() {
        let mut r = request(json!({
            "parallel_tool_calls": true,
            "logit_bias": {"5": 1},
            "reasoning_effort": "low",
            "chat_template_kwargs": {"enable_thinking": true},
        }));
        let dropped = screen(
            &mut r,
            &EngineOptionPolicy::rollout_default(),
            EngineOption::name,
        )
        .unwrap();
        assert_eq!(
            r.extra.keys().collect::<Vec<_>>(),
            ["parallel_tool_calls", "reasoning_effort"]
        );
        assert_eq!(
            dropped.iter().map(|d| d.label).collect::<Vec<_>>(),
            ["logit_bias", "chat_template_kwargs"]
        );
        let note = dropped[0].normalization();
        assert_eq!(note.kind, "dropped_field");
        assert!(
            note.detail.contains("'logit_bias'")
                && note.detail.contains("not allowed on this node"),
            "{}",
            note.detail
        );
        // The caller's API names the parameter.
        let mut r = request(json!({"response_format": {"type": "json_object"}}));
        let dropped = screen(&mut r, &EngineOptionPolicy::only([]), |o| match o {
            EngineOption::ResponseFormat => "text.format",
            o => o.name(),
        })
        .unwrap();
        assert!(r.extra.is_empty());
        assert!(dropped[0].normalization().detail.contains("'text.format'"));
    }

    #[test]
    fn bounds_hold_for_options_a_policy_would_drop() {
        let mut r = request(json!({"chat_template_kwargs": {"chat_template": "{{x}}"}}));
        let refused = screen(
            &mut r,
            &EngineOptionPolicy::rollout_default(),
            EngineOption::name,
        );
        assert_eq!(
            refused.unwrap_err().param,
            "chat_template_kwargs.chat_template"
        );
    }

    #[test]
    fn a_field_that_is_no_engine_option_never_reaches_the_engine() {
        let mut r = request(json!({"chat_template": "{{x}}", "parallel_tool_calls": true}));
        let dropped = screen(&mut r, &EngineOptionPolicy::all(), EngineOption::name).unwrap();
        assert_eq!(r.extra.keys().collect::<Vec<_>>(), ["parallel_tool_calls"]);
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].label, OTHER_LABEL);
        assert!(dropped[0]
            .normalization()
            .detail
            .contains("not an engine option"));
    }

    #[test]
    fn the_flag_values_name_options_all_or_none() {
        let policy = |v: &[&str]| EngineOptionPolicy::from_flag_values(v);
        assert_eq!(policy(&["all"]).unwrap(), EngineOptionPolicy::all());
        assert_eq!(policy(&["none"]).unwrap(), EngineOptionPolicy::only([]));
        assert_eq!(
            policy(&["logit_bias", "n_probs", "logit_bias"]).unwrap(),
            EngineOptionPolicy::only([EngineOption::LogitBias, EngineOption::NProbs])
        );
        assert!(policy(&["none", "n_probs"]).is_err());
        let unknown = policy(&["chat_template"]).unwrap_err();
        assert!(unknown.contains("'chat_template'") && unknown.contains("response_format"));
        for o in EngineOption::ALL {
            assert_eq!(EngineOption::from_name(o.name()), Some(o));
        }
        assert_eq!(
            EngineOptionPolicy::rollout_default().names(),
            ["parallel_tool_calls", "reasoning_effort"]
        );
    }
}
