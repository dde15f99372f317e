//! tokentap's records after the spool, over HTTP: one job, getting a capture's records from
//! its spool to reconstruction.
//!
//! - [`shipper`]: a spool → a worker, at least once, with a cursor and a dead-letter file
//!   (`tokentap ship`, `proxy --ship-to`).
//! - [`downstream`]: what a capture does with its spool: ship it, publish it to the bus, or
//!   reconstruct it in-process.
//!
//! The shipping protocol (`ShipAck`, the paths) is in `tokentap-schema`; the flags are the
//! `tokentap` binary's.

pub mod downstream;
pub mod shipper;
