//! The answer read as it is sampled: text in, in any chunks, [`Delta`]s out. Every decision
//! waits until the text seen so far settles it (a marker's first bytes, the whitespace before
//! a call), so the deltas add up to the same [`Answer`] however the text was cut: whole, per
//! token, byte by byte (the fuzz target `answer_parse` checks exactly that).

use crate::answer::{Answer, Delta};
use crate::calls::{llama3_calls, read_call, ToolSchemas, PYTHON_TAG};
use crate::family::{Dialect, Family, Markers, THINK_CLOSE, THINK_OPEN};

/// The longest call body (or held Llama 3 answer) read as a call; a longer one is handed out as
/// content, as sampled. Bounds what one answer holds back.
pub const DEFAULT_MAX_CALL_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing yet: a `<think>` may open the answer.
    Start,
    Reasoning,
    /// Right after the reasoning (its trailing whitespace is dropped), or the start of an answer
    /// without any. Llama 3's answer is a call if it starts with `{` or `<|python_tag|>`.
    AnswerStart {
        drop_space: bool,
    },
    Text,
    /// Between DeepSeek's `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`.
    Section,
    Call,
    /// After a call's end: whitespace before the next call is only a separator.
    AfterCall,
    /// A Llama 3 answer that may be a call: read when it ends.
    LlamaHeld,
}

/// One answer's parser. `push` each piece of sampled text as it arrives (after the engine's
/// stop token is taken off), then `finish`.
#[derive(Debug, Clone)]
pub struct AnswerParser {
    dialect: Dialect,
    markers: Markers,
    schemas: ToolSchemas,
    state: State,
    buf: String,
    /// The whitespace dropped before the call being read: handed back if it is not one.
    separator: String,
    max_call_bytes: usize,
    /// The whitespace between `</think>` and the answer's text stays in the content (vLLM's
    /// reasoning parsers keep it: `"\n\nDone."`); llama.cpp's drops it (`"Done."`). Before a
    /// call it is the template's separator either way.
    keep_space_after_reasoning: bool,
}

impl AnswerParser {
    pub fn new(dialect: Dialect, schemas: ToolSchemas) -> AnswerParser {
        AnswerParser {
            dialect,
            markers: dialect.family.markers(),
            schemas,
            state: State::Start,
            buf: String::new(),
            separator: String::new(),
            max_call_bytes: DEFAULT_MAX_CALL_BYTES,
            keep_space_after_reasoning: false,
        }
    }

    /// Parses as an engine whose reasoning parser leaves the whitespace after `</think>` in
    /// the content (vLLM's), so that tito's answer equals that engine's own in text mode.
    pub fn keeping_space_after_reasoning(mut self, keep: bool) -> AnswerParser {
        self.keep_space_after_reasoning = keep;
        self
    }

    pub fn with_max_call_bytes(mut self, max: usize) -> AnswerParser {
        self.max_call_bytes = max;
        self
    }

    /// The deltas this text settles; text that may still turn out to be a marker is held.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        self.advance(false)
    }

    /// The end of the answer: everything held is handed out (an unfinished call as the text
    /// it is, for a length cut-off leaves it so).
    pub fn finish(&mut self) -> Vec<Delta> {
        let out = self.advance(true);
        debug_assert!(self.buf.is_empty());
        self.state = State::Start;
        out
    }

    /// The whole answer at once: the same deltas, added up.
    pub fn parse_whole(dialect: Dialect, schemas: ToolSchemas, text: &str) -> Answer {
        let mut parser = AnswerParser::new(dialect, schemas);
        let mut deltas = parser.push(text);
        deltas.extend(parser.finish());
        Answer::from_deltas(&deltas)
    }

    /// Bytes held back, waiting for more text.
    pub fn held(&self) -> usize {
        self.buf.len()
    }

    fn advance(&mut self, at_end: bool) -> Vec<Delta> {
        let mut out = Out::default();
        while self.step(at_end, &mut out) {}
        out.0
    }

    /// One decision; false when it needs more text (or, at the end, when all is handed out).
    fn step(&mut self, at_end: bool, out: &mut Out) -> bool {
        let b = self.buf.as_str();
        match self.state {
            State::Start => {
                if !self.dialect.reasoning {
                    self.state = State::AnswerStart { drop_space: false };
                } else if self.dialect.starts_in_reasoning {
                    self.state = State::Reasoning;
                } else {
                    let t = b.trim_start();
                    if t.starts_with(THINK_OPEN) {
                        self.drain(b.len() - t.len() + THINK_OPEN.len());
                        self.state = State::Reasoning;
                    } else if !at_end && THINK_OPEN.starts_with(t) {
                        return false;
                    } else {
                        self.state = State::AnswerStart { drop_space: false };
                    }
                }
                true
            }
            State::Reasoning => {
                if let Some(i) = b.find(THINK_CLOSE) {
                    out.reasoning(&b[..i]);
                    self.drain(i + THINK_CLOSE.len());
                    self.state = State::AnswerStart {
                        drop_space: !self.keep_space_after_reasoning,
                    };
                    return true;
                }
                let keep = if at_end {
                    0
                } else {
                    partial_suffix(b, &[THINK_CLOSE])
                };
                out.reasoning(&b[..b.len() - keep]);
                self.drain(b.len() - keep);
                false
            }
            State::AnswerStart { drop_space } => {
                let t = b.trim_start();
                if t.is_empty() && !at_end {
                    return false;
                }
                let space = b.len() - t.len();
                if self.dialect.family == Family::Llama3Json {
                    if t.starts_with('{') || t.starts_with(PYTHON_TAG) {
                        self.state = State::LlamaHeld;
                        return true;
                    }
                    if !at_end && PYTHON_TAG.starts_with(t) {
                        return false;
                    }
                }
                if drop_space {
                    self.drain(space);
                }
                self.state = State::Text;
                true
            }
            State::Text => {
                let opener = match (self.markers.section, self.markers.call) {
                    (Some((open, _)), _) | (None, Some((open, _))) => open,
                    (None, None) => {
                        out.content(b);
                        self.buf.clear();
                        return false;
                    }
                };
                if let Some(i) = b.find(opener) {
                    // The whitespace before a call is the template's separator, not content.
                    let text = b[..i].trim_end();
                    out.content(text);
                    self.separator = b[text.len()..i].to_string();
                    self.drain(i + opener.len());
                    self.state = if self.markers.section.is_some() {
                        State::Section
                    } else {
                        State::Call
                    };
                    return true;
                }
                let settled = if at_end {
                    b.len()
                } else {
                    // Held: a marker's first bytes and the whitespace before them.
                    b[..b.len() - partial_suffix(b, &[opener])].trim_end().len()
                };
                out.content(&b[..settled]);
                self.drain(settled);
                false
            }
            State::Section => {
                let (Some((_, section_close)), Some((call_open, _))) =
                    (self.markers.section, self.markers.call)
                else {
                    unreachable!("a section only in families with section and call markers")
                };
                let t = b.trim_start();
                let space = b.len() - t.len();
                if t.starts_with(call_open) {
                    self.separator = b[..space].to_string();
                    self.drain(space + call_open.len());
                    self.state = State::Call;
                } else if t.starts_with(section_close) {
                    self.drain(space + section_close.len());
                    self.state = State::AnswerStart { drop_space: true };
                } else if !at_end && (call_open.starts_with(t) || section_close.starts_with(t)) {
                    return false;
                } else {
                    // Text the section does not allow: the rest is content.
                    self.drain(space);
                    self.state = State::Text;
                }
                true
            }
            State::Call => {
                let Some((open, close)) = self.markers.call else {
                    unreachable!("a call only in families with call markers")
                };
                match b.find(close) {
                    Some(i) if i <= self.max_call_bytes => {
                        match read_call(self.dialect.family, &b[..i], &self.schemas) {
                            Ok(call) => out.call(call),
                            // Not a call after all: the model's text, markers and all.
                            Err(_) => out.content(&format!(
                                "{}{open}{}",
                                self.separator,
                                &b[..i + close.len()]
                            )),
                        }
                        self.drain(i + close.len());
                        self.state = if self.markers.section.is_some() {
                            State::Section
                        } else {
                            State::AfterCall
                        };
                    }
                    // Too long to be read as a call (the end marker, if any, follows as text).
                    Some(_) => self.give_up_call(open, self.max_call_bytes, out),
                    None if b.len() > self.max_call_bytes + close.len() => {
                        self.give_up_call(open, self.max_call_bytes, out)
                    }
                    // Cut off before its end: the text as sampled.
                    None if at_end => self.give_up_call(open, b.len(), out),
                    None => return false,
                }
                true
            }
            State::AfterCall => {
                let Some((call_open, _)) = self.markers.call else {
                    unreachable!("after a call only in families with call markers")
                };
                let t = b.trim_start();
                let space = b.len() - t.len();
                if t.starts_with(call_open) {
                    self.separator = b[..space].to_string();
                    self.drain(space + call_open.len());
                    self.state = State::Call;
                } else if !at_end && call_open.starts_with(t) {
                    return false;
                } else {
                    self.drain(space);
                    self.state = State::Text;
                }
                true
            }
            State::LlamaHeld => {
                if b.len() > self.max_call_bytes {
                    self.state = State::Text;
                    return true;
                }
                if !at_end {
                    return false;
                }
                match llama3_calls(b) {
                    Ok(calls) => calls.into_iter().for_each(|c| out.call(c)),
                    Err(_) => out.content(b),
                }
                self.buf.clear();
                self.state = State::Text;
                true
            }
        }
    }

    /// Hands out the opener and `len` bytes of the body as content; the rest is read as text.
    fn give_up_call(&mut self, open: &str, len: usize, out: &mut Out) {
        let mut len = len.min(self.buf.len());
        while !self.buf.is_char_boundary(len) {
            len -= 1;
        }
        out.content(&format!("{}{open}{}", self.separator, &self.buf[..len]));
        self.drain(len);
        self.state = State::Text;
    }

    fn drain(&mut self, len: usize) {
        self.buf.drain(..len);
    }
}

/// The deltas of one push, neighbours of one kind joined.
#[derive(Default)]
struct Out(Vec<Delta>);

impl Out {
    fn reasoning(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some(Delta::Reasoning(last)) => last.push_str(text),
            _ => self.0.push(Delta::Reasoning(text.to_string())),
        }
    }

    fn content(&mut self, text: &str) {
        if text.is_empty() {
            return;
        }
        match self.0.last_mut() {
            Some(Delta::Content(last)) => last.push_str(text),
            _ => self.0.push(Delta::Content(text.to_string())),
        }
    }

    fn call(&mut self, call: crate::answer::ToolCall) {
        self.0.push(Delta::ToolCall(call));
    }
}

/// The length of the longest end of `text` that is the start (not the whole) of a marker.
fn partial_suffix(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .flat_map(|m| {
            (1..m.len())
                .rev()
                .filter(|&k| m.is_char_boundary(k) && text.ends_with(&m[..k]))
                .take(1)
        })
        .max()
        .unwrap_or(0)
}
