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

use crate::ndjson::decode_line;
use crate::{CaptureRecord, CAPTURE_SCHEMA_VERSION};

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

/// A batch body as a worker reads it: the records it can take, in order, and the ack so far
/// (`rejected`, `errors`, `rejected_lines`; `accepted` and `duplicates` are the worker's to
/// count once it has de-duplicated and persisted `records`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DecodedBatch {
    pub records: Vec<CaptureRecord>,
    /// Where each of `records` is in the body: its line, without the newline. The worker
    /// stores these bytes as they came (they decoded to the record) rather than encoding the
    /// record again.
    pub lines: Vec<std::ops::Range<usize>>,
    pub ack: ShipAck,
}

/// How many reasons [`decode_batch`] copies into [`ShipAck::errors`].
pub const MAX_ACK_ERRORS: usize = 5;

/// Reads a shipped batch body: one [`CaptureRecord`] per line; blank lines are skipped, and
/// every other line that is not a record this worker can take is named in the ack. Never
/// fails: a batch's bytes come from the network.
pub fn decode_batch(body: &[u8]) -> DecodedBatch {
    let mut out = DecodedBatch::default();
    let mut start = 0;
    for (i, line) in body.split(|b| *b == b'\n').enumerate() {
        let span = start..start + line.len();
        start = span.end + 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let reason = match decode_line::<CaptureRecord>(line) {
            Ok(r) => match refusal(&r) {
                None => {
                    out.records.push(r);
                    out.lines.push(span);
                    continue;
                }
                Some(why) => why,
            },
            Err(e) => e.to_string(),
        };
        let line = i as u64 + 1;
        out.ack.rejected += 1;
        if out.ack.errors.len() < MAX_ACK_ERRORS {
            out.ack.errors.push(format!("line {line}: {reason}"));
        }
        out.ack.rejected_lines.push(RejectedLine { line, reason });
    }
    out
}

/// Why a worker cannot take a record it could parse, if it cannot.
pub fn refusal(r: &CaptureRecord) -> Option<String> {
    if r.schema_version > CAPTURE_SCHEMA_VERSION {
        return Some(format!(
            "record {} has schema version {}, newer than this worker's {CAPTURE_SCHEMA_VERSION}: \
             upgrade the worker",
            r.record_id, r.schema_version
        ));
    }
    if r.record_id.is_empty() {
        return Some("a record without a record_id cannot be de-duplicated".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_names_each_line_it_refuses_and_skips_blank_ones() {
        let body = b"\n  \nnot json\n{\"record_id\":\"\"}\n";
        let batch = decode_batch(body);
        assert!(batch.records.is_empty());
        assert_eq!(batch.ack.rejected, 2);
        let lines: Vec<u64> = batch.ack.rejected_lines.iter().map(|r| r.line).collect();
        assert_eq!(lines, vec![3, 4]);
        assert_eq!(batch.ack.errors.len(), 2);
        assert!(batch.ack.errors[0].starts_with("line 3: "));
    }
}
