//! tokentap's capture proxy: a Pingora service that speaks the provider APIs harnesses use,
//! forwards each call to an inference engine asking for token-level data, answers the harness
//! in exactly the shape it expects, and emits one capture record per call.

pub mod activity;
pub mod app;
pub mod backend;
pub mod capture;
#[cfg(feature = "clap")]
pub mod cli;
pub mod gate;
pub mod harness;
pub mod metrics;
pub mod redact;
pub mod relay;
pub mod session;
pub mod tls;
pub mod transparent;

pub use app::{CaptureService, ProxyConfig};

// The codecs and the canonical request (tokentap-wire) and the shared service pieces
// (tokentap-service-kit) under the paths the proxy's modules always used.
pub use tokentap_service_kit::{capped_body, limits};
pub use tokentap_wire as wire;
pub use tokentap_wire::{canonical, engine_options, normalize, replay};
