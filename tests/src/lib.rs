//! Support for tokentap's end-to-end tests: the real `tokentap` binary, a real llama-server,
//! a real vLLM ([`vllm::VllmServer`]), real agent harnesses, and two test-side servers (the
//! [`tee::TeeProxy`] pass-through and the [`scripted::ScriptedBackend`] test double).
//!
//! Tests whose names start with `heavy_` spawn llama-server or a harness and run one at a time
//! (`.config/nextest.toml`); the others are light and run in parallel.

pub mod artefacts;
pub mod checks;
pub mod containers;
pub mod exporter_doubles;
pub mod fixtures;
pub mod harness;
pub mod ids_engines;
pub mod kube_apiserver;
pub mod kube_validate;
pub mod llama;
pub mod nats;
pub mod node_agent;
pub mod node_api;
pub mod privileged;
pub mod procs;
pub mod repo_tasks;
pub mod scripted;
pub mod sdk;
pub mod sse;
pub mod tee;
pub mod tls_front;
pub mod tmpfs;
pub mod tokentap;
pub mod traces;
pub mod transparent;
pub mod vllm;
pub mod worker;

pub use tokentap_schema::{CaptureRecord, ErrorKind, SessionSource, TokenSource};
