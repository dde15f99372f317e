//! The proxy's integration tests (replay, redaction, engine options, property tests; the wire
//! codecs' golden traffic is tokentap-wire's), one module per subject in one test binary: a
//! binary per file linked the dependency graph once each.

mod engine_options;
mod properties_redaction;
mod properties_wire;
mod replay;
