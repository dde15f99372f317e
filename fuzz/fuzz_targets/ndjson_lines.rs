//! capture-schema's NDJSON framing (ndjson.rs) on any buffer: `split_lines`, then
//! `decode_line` of each complete line as a CaptureRecord.
//! Invariants: the lines tile the buffer exactly (offsets, newlines, at most one torn tail,
//! last); a complete line holds no newline; a record that decodes re-encodes as one line that
//! decodes to the same record.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_schema::ndjson::{decode_line, encode_line, split_lines, Line};
use tokentap_schema::CaptureRecord;

fuzz_target!(|data: &[u8]| {
    let mut next = 0;
    let mut torn = false;
    for line in split_lines(data) {
        assert!(!torn, "nothing after a torn tail");
        match line {
            Line::Complete { offset, bytes } => {
                assert_eq!(offset, next);
                assert!(!bytes.contains(&b'\n'));
                assert_eq!(data[offset + bytes.len()], b'\n');
                next = offset + bytes.len() + 1;
                if let Ok(record) = decode_line::<CaptureRecord>(bytes) {
                    let mut out = Vec::new();
                    encode_line(&record, &mut out).expect("a record encodes");
                    assert_eq!(out.iter().filter(|&&b| b == b'\n').count(), 1);
                    assert_eq!(out.last(), Some(&b'\n'));
                    let back: CaptureRecord =
                        decode_line(&out[..out.len() - 1]).expect("an encoded record decodes");
                    assert_eq!(back, record);
                }
            }
            Line::Torn { offset, bytes } => {
                assert_eq!(offset, next);
                assert!(!bytes.is_empty() && !bytes.contains(&b'\n'));
                next = offset + bytes.len();
                torn = true;
            }
        }
    }
    assert_eq!(next, data.len(), "the lines cover the buffer");
});
