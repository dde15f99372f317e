//! Shipping records from a proxy to a reconstruction worker (`tokentap proxy --ship-to URL`,
//! `tokentap ship`, `tokentap worker`).
//!
//! `POST {worker}/v1/records` with an NDJSON body of [`crate::CaptureRecord`]s (one per line,
//! as in the spool) and `Authorization: Bearer TOKEN` when the worker has a token. The worker
//! answers 200 with a [`ShipAck`] only after the batch is durable in its own spool; the shipper
//! then advances its cursor. Lines the worker refuses are named in the ack
//! ([`ShipAck::rejected_lines`]) and the shipper keeps them in its dead-letter file: an ack
//! settles every line of the batch. A body over the worker's limit ([`ShipLimits`], at
//! `GET {worker}/v1/ship/limits`) is answered 413; the shipper keeps batches under it and
//! sends a record bigger than its batch size alone. Anything else is retried with the same
//! batch, so delivery is at least once and the worker drops record ids it already has.

use serde::{Deserialize, Serialize};

/// The worker's ingest path.
pub const SHIP_PATH: &str = "/v1/records";
/// Where the worker tells its limits ([`ShipLimits`]).
pub const SHIP_LIMITS_PATH: &str = "/v1/ship/limits";
/// The body's content type.
pub const SHIP_CONTENT_TYPE: &str = "application/x-ndjson";

/// The worker's answer to one batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShipAck {
    /// New records, now durable in the worker's spool.
    pub accepted: u64,
    /// Records whose id the worker already had (redeliveries), dropped.
    pub duplicates: u64,
    /// Lines the worker refused (not a record, or one it cannot take), dropped (with the first
    /// few reasons).
    pub rejected: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
    /// Which lines of the batch (from 1) were rejected, with why: the shipper dead-letters
    /// exactly these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rejected_lines: Vec<RejectedLine>,
}

/// One refused line of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedLine {
    /// The line's number in the batch, from 1.
    pub line: u64,
    pub reason: String,
}

/// What a worker takes (`GET /v1/ship/limits`, and in its 413 answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShipLimits {
    /// The largest request body it reads, in bytes: no batch may be bigger, and a single
    /// record bigger than this cannot be delivered.
    pub max_body_bytes: u64,
}
