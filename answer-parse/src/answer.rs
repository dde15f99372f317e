//! What a parser hands out ([`Delta`]) and what the deltas add up to ([`Answer`]).

/// One tool call as the wire APIs carry it: the function's name and its arguments as the text
/// of a JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// A JSON object's text. Where the model wrote the object itself (Hermes, Llama 3,
    /// DeepSeek) it is the model's own text, byte for byte; where it wrote one parameter at a
    /// time (Qwen3-Coder, GLM) it is built from them, in the model's order.
    pub arguments: String,
}

/// A piece of the answer, in the order the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    /// A whole call, handed out when its closing marker arrives: its arguments are only known
    /// to be a JSON object then.
    ToolCall(ToolCall),
}

/// The deltas added up: what a non-streamed answer carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Answer {
    pub fn apply(&mut self, delta: &Delta) {
        match delta {
            Delta::Reasoning(text) => self.reasoning.push_str(text),
            Delta::Content(text) => self.content.push_str(text),
            Delta::ToolCall(call) => self.tool_calls.push(call.clone()),
        }
    }

    pub fn from_deltas<'a>(deltas: impl IntoIterator<Item = &'a Delta>) -> Answer {
        let mut answer = Answer::default();
        for delta in deltas {
            answer.apply(delta);
        }
        answer
    }
}
