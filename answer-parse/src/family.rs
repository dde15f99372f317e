//! The template families: how each writes reasoning and tool calls into the text it samples.

use std::fmt;

/// How a model family writes tool calls. Each is named after the template that defines it;
/// the markers are the ones the family's own chat template renders for an assistant turn with
/// calls, so a model trained on it samples them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call: Qwen2.5,
    /// Qwen3, QwQ, Hermes 2 Pro / 3, MiMo, Granite 4.
    Hermes,
    /// `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`:
    /// Qwen3-Coder, Qwen3.5, Nemotron 3 Nano.
    Qwen3Coder,
    /// The whole answer is `{"name": …, "parameters": {…}}` (after `<|python_tag|>` if the
    /// model writes it), calls separated by `;`: Llama 3.1, 3.2, 3.3.
    Llama3Json,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{…}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`
    /// (DeepSeek V3, R1) or `…<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…`
    /// (V3.1).
    DeepSeekV3,
    /// `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>`, with or
    /// without newlines between: GLM-4.5, 4.6, 4.7.
    Glm45,
}

impl Family {
    /// Every family, in the order a probe tries them (the stricter call bodies first, so
    /// Hermes' JSON is never read out of a Qwen3-Coder or GLM block).
    pub const ALL: [Family; 5] = [
        Family::Qwen3Coder,
        Family::Glm45,
        Family::DeepSeekV3,
        Family::Hermes,
        Family::Llama3Json,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::Hermes => "hermes",
            Family::Qwen3Coder => "qwen3_coder",
            Family::Llama3Json => "llama3_json",
            Family::DeepSeekV3 => "deepseek_v3",
            Family::Glm45 => "glm45",
        }
    }

    pub fn from_name(name: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.name() == name)
    }

    pub(crate) fn markers(self) -> Markers {
        match self {
            Family::Hermes | Family::Qwen3Coder | Family::Glm45 => Markers {
                section: None,
                call: Some(("<tool_call>", "</tool_call>")),
            },
            Family::DeepSeekV3 => Markers {
                section: Some(("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")),
                call: Some(("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")),
            },
            // The answer as a whole is the call: no markers to find within the text.
            Family::Llama3Json => Markers {
                section: None,
                call: None,
            },
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The literal strings around calls. `section` wraps all the calls of one answer (DeepSeek);
/// `call` wraps each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Markers {
    pub section: Option<(&'static str, &'static str)>,
    pub call: Option<(&'static str, &'static str)>,
}

/// The reasoning block's markers, as every family here writes them.
pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

/// How to read one model's answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dialect {
    pub family: Family,
    /// The template knows `<think>` blocks: an answer that opens with one has reasoning.
    pub reasoning: bool,
    /// The generation prompt already opened the block (DeepSeek R1, Qwen3 thinking models):
    /// the answer starts inside the reasoning and its `</think>` ends it.
    pub starts_in_reasoning: bool,
}

impl Dialect {
    pub fn new(family: Family) -> Dialect {
        Dialect {
            family,
            reasoning: false,
            starts_in_reasoning: false,
        }
    }

    /// With reasoning read from `<think>` blocks, and whether this prompt left one open: a
    /// generation prompt that opened `<think>` without closing it (its last `<think>` after
    /// its last `</think>`).
    pub fn with_reasoning_after(mut self, prompt_text: &str) -> Dialect {
        self.reasoning = true;
        self.starts_in_reasoning = match (
            prompt_text.rfind(THINK_OPEN),
            prompt_text.rfind(THINK_CLOSE),
        ) {
            (Some(open), Some(close)) => open > close,
            (Some(_), None) => true,
            _ => false,
        };
        self
    }
}
