//! The proxy's integration tests (golden wire traffic, replay, property tests), one module
//! per subject in one test binary: a binary per file linked the dependency graph once each.

mod engine_options;
mod properties_redaction;
mod properties_wire;
mod replay;
mod wire_golden;
mod wire_messages;
mod wire_responses;
