//! tokentap's own prompt ids for each call, from the model's chat template and tokenizer
//! (`tokentap-chat-template`), and what they show about the engine's.
//!
//! - [`TokenModel`]: `--tokenizer PATH` loaded once; [`TokenModel::prompt_ids`] per call.
//! - [`drift`]: where two id sequences part, and why (reasoning dropped, a boundary token, a
//!   merge difference, changed content), classified per span from the decoded text.
//! - [`Observer`]: `--token-mode observe`, per call: tokentap's ids against the engine's, and
//!   the engine's prompt against the session's earlier prompts + sampled ids (bounded state).
//! - [`Tito`]: `--token-mode tito`, per call: the prompt ids built from the conversation's
//!   earlier ids (prompt + sampled) and the new messages, or a full render with the cause.
//! - [`verify`]: `--token-verify`, a tito prompt against the full render, each difference
//!   content drift (expected) or boundary drift (a bug).

pub mod drift;
mod model;
mod observer;
mod tito;
mod verify;

pub use model::{EngineDialect, TokenMode, TokenModel};
pub use observer::{CallView, Observer, ObserverLimits};
pub use tito::{SampledEnd, Tito, TitoLimits, TitoPrompt};
pub use verify::{verify, TokenVerify};
