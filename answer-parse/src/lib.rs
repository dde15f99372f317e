//! The model's answer read back from the text it sampled: reasoning, content and tool calls,
//! for each template family token-in mode serves (`Family`), streamed as the engine generates.
//!
//! In token-in mode tokentap asks the engine for ids, so the engine's own parsers (llama.cpp's
//! chat parsers, vLLM's and SGLang's tool parsers) never run: tokentap answers the harness
//! itself, in its wire API, from the sampled ids' text. Text in, because every family's
//! markers are text the tokenizer writes back exactly (`<tool_call>`, `<think>`, DeepSeek's
//! `<｜tool▁call▁begin｜>`); the ids themselves are never re-encoded.

mod answer;
mod calls;
mod family;
mod grammar;
mod probe;
mod stream;

pub use answer::{Answer, Delta, ToolCall};
pub use calls::ToolSchemas;
pub use family::{Dialect, Family, THINK_CLOSE, THINK_OPEN};
pub use grammar::{
    call_grammar, call_grammar_within, CallGrammar, GrammarBounds, GrammarLimit, NoGrammar,
};
pub use probe::{probe, probe_tools, Unreadable};
pub use stream::{AnswerParser, DEFAULT_MAX_CALL_BYTES};
