//! Shipping records from a proxy to a reconstruction worker (`tokentap proxy --ship-to URL`,
//! `tokentap ship`, `tokentap worker`).
//!
//! `POST {worker}/v1/records` with an NDJSON body of [`crate::CaptureRecord`]s (one per line,
//! as in the spool). The worker answers 200 with a [`ShipAck`] only after the batch is durable
//! in its own spool; the shipper then advances its cursor. Anything else is retried with the
//! same batch, so delivery is at least once and the worker drops record ids it already has.

use serde::{Deserialize, Serialize};

/// The worker's ingest path.
pub const SHIP_PATH: &str = "/v1/records";
/// The body's content type.
pub const SHIP_CONTENT_TYPE: &str = "application/x-ndjson";

/// The worker's answer to one batch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShipAck {
    /// New records, now durable in the worker's spool.
    pub accepted: u64,
    /// Records whose id the worker already had (redeliveries), dropped.
    pub duplicates: u64,
    /// Lines that are not valid records, dropped (with the first few reasons).
    pub rejected: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}
