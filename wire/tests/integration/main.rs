//! The wire codecs' golden tests against real harness traffic, one module per API in one test
//! binary.

mod wire_golden;
mod wire_messages;
mod wire_responses;
