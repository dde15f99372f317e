//! The worker's ingest of a shipped batch (`tokentap worker`, POST /v1/records):
//! `tokentap_schema::ship::decode_batch` on any body.
//! Invariants: every non-blank line is either a record the worker takes or named in the ack,
//! exactly once, in order; what is taken passes the worker's refusal check and re-encodes to
//! the same record, and its line (which the worker stores as it came) is one line that
//! decodes to that record; the ack's error list is capped; the ack round-trips as JSON (the shipper
//! reads it).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_schema::ndjson::{decode_line, encode_line};
use tokentap_schema::ship::{decode_batch, refusal, ShipAck, MAX_ACK_ERRORS};
use tokentap_schema::CaptureRecord;

fuzz_target!(|data: &[u8]| {
    let batch = decode_batch(data);
    let lines: Vec<&[u8]> = data.split(|b| *b == b'\n').collect();
    let non_blank = lines
        .iter()
        .filter(|l| !l.iter().all(u8::is_ascii_whitespace))
        .count();
    let ack = &batch.ack;
    assert_eq!(batch.records.len() as u64 + ack.rejected, non_blank as u64);
    assert_eq!(ack.rejected_lines.len() as u64, ack.rejected);
    assert_eq!(
        ack.errors.len(),
        (ack.rejected as usize).min(MAX_ACK_ERRORS)
    );
    assert_eq!((ack.accepted, ack.duplicates), (0, 0));
    let mut last = 0;
    for r in &ack.rejected_lines {
        assert!(r.line > last, "rejected lines in order, each once");
        last = r.line;
        let line = lines[(r.line - 1) as usize];
        assert!(!line.iter().all(u8::is_ascii_whitespace));
        assert!(!r.reason.is_empty());
    }
    assert_eq!(batch.lines.len(), batch.records.len());
    for (record, span) in batch.records.iter().zip(&batch.lines) {
        let line = &data[span.clone()];
        assert!(!line.contains(&b'\n'), "one line");
        let stored: CaptureRecord = decode_line(line).expect("the stored line decodes");
        assert_eq!(&stored, record);
        assert_eq!(refusal(record), None);
        let mut out = Vec::new();
        encode_line(record, &mut out).expect("a record encodes");
        let back: CaptureRecord = decode_line(&out[..out.len() - 1]).expect("and decodes");
        assert_eq!(&back, record);
    }
    let json = serde_json::to_vec(ack).expect("an ack serializes");
    let back: ShipAck = serde_json::from_slice(&json).expect("and reads back");
    assert_eq!(&back, ack);
});
