//! Hugging Face chat templates rendered as transformers renders them, from tokentap's
//! canonical conversation, and the result tokenized as the engine tokenizes it.
//!
//! - [`ChatTemplate`] / [`ChatTemplates`]: compile once, [`ChatTemplate::render`] per request.
//! - [`messages`]: the canonical [`tokentap_schema::ChatRequest`] as HF message and tool dicts.
//! - [`pyjson`]: `json.dumps` byte for byte (the `tojson` filter).

pub mod messages;
pub mod pyjson;
mod template;

pub use template::{ChatTemplate, ChatTemplates, RenderOptions, TemplateError};
