//! What a spool's downstream keeps next to the spool: the shipper (`--ship-to`) and the bus
//! publisher (`--bus`) each keep a cursor (how far the destination has acknowledged) and a
//! dead-letter file (records the destination will never take). One format and one way of
//! writing them, so both survive a crash the same way.

use std::io::{self, Write};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::{owner_only, SpoolPosition};

/// What a downstream counts, whichever carries the records (the shipper's HTTP or the bus
/// publisher): the proxy's `tokentap_ship_*` series, so a dashboard reads one set.
#[derive(Clone)]
pub struct DownstreamMetrics {
    /// Records the destination acknowledged (accepted or already held).
    pub records: prometheus::IntCounter,
    /// Records written to the dead-letter file.
    pub dead_letters: prometheus::IntCounter,
    /// Spool bytes not yet acknowledged.
    pub backlog_bytes: prometheus::IntGauge,
    /// When the destination last acknowledged, Unix seconds.
    pub last_ack: prometheus::Gauge,
    /// Failed attempts (each retried).
    pub errors: prometheus::IntCounter,
}

impl DownstreamMetrics {
    /// The series under their `tokentap_ship_*` names, registered nowhere: for a caller that
    /// reads them itself (`tokentap ship`, a benchmark, a test).
    pub fn unregistered() -> DownstreamMetrics {
        let counter = |name: &str| prometheus::IntCounter::new(name, name).expect("valid counter");
        DownstreamMetrics {
            records: counter("tokentap_ship_records_total"),
            dead_letters: counter("tokentap_ship_dead_letter_total"),
            backlog_bytes: prometheus::IntGauge::new("tokentap_ship_backlog_bytes", "backlog")
                .expect("valid gauge"),
            last_ack: prometheus::Gauge::new("tokentap_ship_last_ack_timestamp_seconds", "ack")
                .expect("valid gauge"),
            errors: counter("tokentap_ship_errors_total"),
        }
    }
}

/// A cursor file's content.
#[derive(Serialize, Deserialize)]
struct Cursor {
    /// The destination the position refers to: another destination starts over.
    to: String,
    position: SpoolPosition,
}

/// Where to resume sending to `to`: the position saved at `path`, or the spool's start when
/// there is none, it cannot be read, or it was saved for another destination (the last two
/// said in the log; the destination drops what it already has by record id).
pub fn load_cursor(path: &Path, to: &str) -> SpoolPosition {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(_) => return SpoolPosition::default(),
    };
    match serde_json::from_slice::<Cursor>(&bytes) {
        Ok(c) if c.to == to => c.position,
        Ok(c) => {
            tracing::warn!(cursor = %path.display(), previous = %c.to, now = %to, "sending to a different destination: starting from the beginning of the spool");
            SpoolPosition::default()
        }
        Err(e) => {
            tracing::warn!(cursor = %path.display(), error = %e, "unreadable cursor: starting from the beginning of the spool");
            SpoolPosition::default()
        }
    }
}

/// Saves `position` for `to` at `path`, atomically (a crash leaves the old cursor or the new
/// one, never a torn file) and owner-only like the spool it points into.
pub fn save_cursor(path: &Path, to: &str, position: SpoolPosition) -> io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let _ = std::fs::remove_file(&tmp);
    let f = owner_only::options()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    serde_json::to_writer(
        &f,
        &Cursor {
            to: to.to_owned(),
            position,
        },
    )?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Appends one dead letter to `path` (created 0600) and syncs it: when, the destination
/// (`destination.0` names the field: `worker`, `bus`), the record's spool position, why, and
/// the record's own line as it was read (`null` when the line was not a record).
pub fn append_dead_letter(
    path: &Path,
    destination: (&str, &str),
    position: SpoolPosition,
    reason: &str,
    record_line: Option<&[u8]>,
) -> io::Result<()> {
    let unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut head = serde_json::Map::new();
    head.insert("dead_lettered_at_unix_ms".into(), unix_ms.into());
    head.insert(destination.0.into(), destination.1.into());
    head.insert("position".into(), position.to_string().into());
    head.insert("reason".into(), reason.into());
    let mut line = serde_json::to_vec(&head)?;
    line.pop(); // the closing brace: the record's own line follows as it was read
    line.extend_from_slice(b",\"record\":");
    match record_line {
        Some(record) => line.extend_from_slice(record.strip_suffix(b"\n").unwrap_or(record)),
        None => line.extend_from_slice(b"null"),
    }
    line.extend_from_slice(b"}\n");
    let mut f = owner_only::options().append(true).create(true).open(path)?;
    f.write_all(&line)?;
    f.sync_data()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_cursor_resumes_only_for_its_destination_and_is_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cursor.json");
        assert_eq!(load_cursor(&path, "a"), SpoolPosition::default());
        let at = SpoolPosition {
            segment: 3,
            offset: 77,
        };
        save_cursor(&path, "a", at).unwrap();
        assert_eq!(load_cursor(&path, "a"), at);
        assert_eq!(load_cursor(&path, "b"), SpoolPosition::default());
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        std::fs::write(&path, b"{\"to\":").unwrap();
        assert_eq!(load_cursor(&path, "a"), SpoolPosition::default());
    }

    #[test]
    fn dead_letters_carry_the_record_line_as_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dead.ndjson");
        let at = SpoolPosition::default();
        append_dead_letter(
            &path,
            ("bus", "nats://x"),
            at,
            "too big",
            Some(b"{\"a\":1}\n"),
        )
        .unwrap();
        append_dead_letter(&path, ("worker", "http://w"), at, "not a record", None).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let letters: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(letters[0]["record"]["a"], 1);
        assert_eq!(letters[0]["bus"], "nats://x");
        assert_eq!(letters[0]["reason"], "too big");
        assert!(letters[1]["record"].is_null());
        assert_eq!(letters[1]["worker"], "http://w");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
