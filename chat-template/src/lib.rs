//! Hugging Face chat templates rendered as transformers renders them, from tokentap's
//! canonical conversation, and the result tokenized as the engine tokenizes it.
//!
//! - [`ChatTemplate`] / [`ChatTemplates`]: compile once, [`ChatTemplate::render`] per request.
//! - [`messages`]: the canonical [`tokentap_schema::ChatRequest`] as HF message and tool dicts.
//! - [`pyjson`]: `json.dumps` byte for byte (the `tojson` filter).
//! - [`Tokenizer`]: a `tokenizer.json` (+ `tokenizer_config.json`) or a GGUF vocabulary
//!   ([`gguf`]) through the `tokenizers` crate; [`Tokenizer::encode`] the rendered prompt.

mod fast_bpe;
pub mod gguf;
pub mod messages;
pub mod pyjson;
mod template;
mod tokenizer;

pub use template::{ChatTemplate, ChatTemplates, RenderOptions, TemplateError};
pub use tokenizer::{Tokenizer, TokenizerError};
