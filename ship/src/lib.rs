//! tokentap's records after the spool, over HTTP: one job, getting a capture's records from
//! its spool to reconstruction.
//!
//! - [`shipper`]: a spool → a worker, at least once, with a cursor and a dead-letter file
//!   (`tokentap ship`, `proxy --ship-to`).
//! - [`downstream`]: what a capture does with its spool: ship it, publish it to the bus, or
//!   reconstruct it in-process.
//! - [`bus_worker`]: the worker's end over the bus: a member of the worker group.
//! - [`receive`]: the worker's end (`tokentap worker`): batches in, deduplicated and durable
//!   in the worker's spool before the ack, reconstructed from there as they arrive.
//!
//! The shipping protocol (`ShipAck`, the paths) is in `tokentap-schema`; the flags are the
//! `tokentap` binary's.

pub mod bus_worker;
pub mod downstream;
pub mod receive;
pub mod shipper;
