//! tokentap's capture proxy: a Pingora service that speaks the provider APIs harnesses use,
//! forwards each call to an inference engine asking for token-level data, answers the harness
//! in exactly the shape it expects, and emits one capture record per call.

pub mod activity;
pub mod app;
pub mod backend;
pub mod canonical;
pub mod capped_body;
pub mod capture;
#[cfg(feature = "clap")]
pub mod cli;
pub mod engine_options;
pub mod gate;
pub mod harness;
pub mod limits;
pub mod metrics;
pub mod normalize;
pub mod redact;
pub mod relay;
pub mod replay;
pub mod session;
pub mod tls;
pub mod transparent;
pub mod wire;

pub use app::{CaptureService, ProxyConfig};
