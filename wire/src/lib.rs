//! Provider wire APIs. Each codec module knows one provider's JSON and SSE shapes: it parses a
//! harness request into the canonical [`ChatRequest`] and renders generation events back in
//! exactly the shape that provider's clients expect. None talks to a backend, so what rebuilds
//! a record's conversation offline ([`replay`]) needs no proxy.

pub mod canonical;
pub mod chat_completions;
pub mod engine_options;
mod error;
mod json_body;
pub mod messages;
pub mod normalize;
pub mod replay;
pub mod responses;
#[cfg(test)]
mod stream_golden;

pub use error::{CallError, WireError};

use tokentap_schema::{Normalization, RawJson, WireApi};

use crate::canonical::{ChatRequest, Delta, FinishReason, GenerationAccumulator, Usage};
use crate::engine_options::EngineOption;

/// A harness request after parsing.
#[derive(Debug, Clone)]
pub struct ParsedCall {
    pub request: ChatRequest,
    /// Whether a streamed answer should end with a usage report.
    pub include_usage: bool,
    /// What parsing changed on the way to the canonical request.
    pub normalizations: Vec<Normalization>,
    /// Request values the answer object echoes back (moved into [`ResponseMeta::echo`]).
    pub echo: Echo,
}

/// Request values an answer object echoes back, as the provider echoes them (the Responses
/// API's `instructions`, `tools`, `temperature`, …), each kept as its JSON text by field name;
/// empty for the APIs whose answers echo nothing. The renderer writes the provider's default
/// for a field the request left out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Echo(Vec<(&'static str, RawJson)>);

impl Echo {
    /// Sets `field` to `value`'s JSON.
    pub fn set<T: serde::Serialize + ?Sized>(&mut self, field: &'static str, value: &T) {
        self.set_raw(field, RawJson::of(value));
    }

    /// Sets `field` to JSON text kept as it came.
    pub fn set_raw(&mut self, field: &'static str, raw: RawJson) {
        match self.0.iter_mut().find(|(f, _)| *f == field) {
            Some(slot) => slot.1 = raw,
            None => self.0.push((field, raw)),
        }
    }

    /// The echoed JSON of `field`, if the request set it.
    pub fn get(&self, field: &str) -> Option<&RawJson> {
        self.0.iter().find(|(f, _)| *f == field).map(|(_, r)| r)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Identity of one answer as the harness sees it.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// Provider-style response id (e.g. `chatcmpl-…`).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The model name the harness asked for, echoed back.
    pub model: String,
    /// The other request values the answer echoes (see [`Echo`]).
    pub echo: Echo,
}

impl ResponseMeta {
    /// An answer's identity with nothing else echoed.
    pub fn new(id: impl Into<String>, created: u64, model: impl Into<String>) -> ResponseMeta {
        ResponseMeta {
            id: id.into(),
            created,
            model: model.into(),
            echo: Echo::default(),
        }
    }
}

/// One provider API: parse requests, render answers and errors.
pub trait WireCodec: Send + Sync {
    fn api(&self) -> WireApi;

    /// Response id prefix, e.g. `chatcmpl-`.
    fn id_prefix(&self) -> &'static str;

    fn parse(&self, body: &[u8]) -> Result<ParsedCall, WireError>;

    /// The request field an engine option comes from, as this API names it (for errors and
    /// notes about it); Chat Completions sends each under its own name.
    fn engine_option_param(&self, option: EngineOption) -> &'static str {
        option.name()
    }

    /// The whole (non-streamed) answer body.
    fn render_whole(&self, meta: &ResponseMeta, generation: &GenerationAccumulator) -> Vec<u8>;

    /// A renderer for a streamed answer.
    fn stream_renderer(&self, meta: ResponseMeta, include_usage: bool) -> Box<dyn StreamRenderer>;

    /// An error answer: HTTP status and body.
    fn render_error(&self, error: &CallError) -> (u16, Vec<u8>);
}

/// Renders one streamed answer event by event (SSE frames appended to `out`).
pub trait StreamRenderer: Send {
    /// Frames sent before any content (e.g. the role chunk).
    fn start(&mut self, out: &mut Vec<u8>);
    fn delta(&mut self, delta: &Delta, out: &mut Vec<u8>);
    fn finish(&mut self, finish_reason: FinishReason, usage: Option<Usage>, out: &mut Vec<u8>);
    /// The prompt's token count, as soon as the engine tells it (its prompt ids in the first
    /// chunk, or its usage): for answers whose opening event carries it (Anthropic's
    /// `message_start`). Writes nothing.
    fn prompt_tokens(&mut self, _count: u64) {}
    /// An error after the stream began: the provider's in-stream error frame.
    fn error(&mut self, error: &CallError, out: &mut Vec<u8>);
}

/// Appends one SSE `data:` frame.
pub(crate) fn sse_data<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, json: &T) {
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut *out, json).expect("event payloads always serialize");
    out.extend_from_slice(b"\n\n");
}

/// Appends one SSE frame with an event name: `event: <type>\ndata: <json>\n\n`.
pub(crate) fn sse_event<T: serde::Serialize + ?Sized>(out: &mut Vec<u8>, event: &str, data: &T) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(event.as_bytes());
    out.push(b'\n');
    sse_data(out, data);
}
