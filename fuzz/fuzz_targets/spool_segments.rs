//! The spool reader (spool/src/reader.rs) over segment files this target writes into a
//! temporary directory (the input cut into 1–4 segments at fuzzer-chosen points, some sequence
//! numbers skipped), then the writer's torn-tail recovery (SpoolWriter::open) and a second read.
//! Invariants, against a model built with capture-schema's split_lines:
//! - every complete line comes out exactly once, in order, at its own position: a Record when
//!   it decodes, else Corrupt; an unterminated end of a non-last segment is Corrupt; the
//!   unterminated end of the last segment is Torn, and never a record;
//! - after recovery the last segment ends at its last newline, and a second read gives the
//!   same items, without the torn tail.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tokentap_schema::ndjson::{decode_line, split_lines, Line};
use tokentap_schema::CaptureRecord;
use tokentap_spool::segment::segment_path;
use tokentap_spool::{
    FsyncPolicy, SpoolConfig, SpoolItem, SpoolPosition, SpoolReader, SpoolWriter,
};

/// What a reader must say about a line, without the error text.
#[derive(Debug, PartialEq)]
enum Expect {
    Record(SpoolPosition, Box<CaptureRecord>),
    Corrupt(SpoolPosition),
    Torn(SpoolPosition, u64),
}

fn seen(item: SpoolItem) -> Expect {
    match item {
        SpoolItem::Record(e) => Expect::Record(e.position, Box::new(e.record)),
        SpoolItem::Corrupt { position, .. } => Expect::Corrupt(position),
        SpoolItem::Torn { position, len } => Expect::Torn(position, len),
    }
}

fn read(dir: &std::path::Path) -> Vec<Expect> {
    SpoolReader::open(dir)
        .expect("the spool opens")
        .map(|item| seen(item.expect("reading a spool of plain files never fails")))
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let (flags, cuts, body) = tokentap_fuzz::cuts(data);
    let segments = tokentap_fuzz::chunks(body, &cuts[..cuts.len().min(3)]);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut seqs = Vec::new();
    let mut expected = Vec::new();
    let mut seq = 0u64;
    for (i, bytes) in segments.iter().enumerate() {
        // Sequence numbers need not be contiguous (a shipper deletes finished segments).
        seq += 1 + u64::from((flags >> i) & 1);
        seqs.push(seq);
        std::fs::write(segment_path(dir.path(), seq), bytes).expect("write a segment");
        let last = i + 1 == segments.len();
        for line in split_lines(bytes) {
            match line {
                Line::Complete { offset, bytes } => {
                    let position = SpoolPosition {
                        segment: seq,
                        offset: offset as u64,
                    };
                    expected.push(match decode_line::<CaptureRecord>(bytes) {
                        Ok(r) => Expect::Record(position, Box::new(r)),
                        Err(_) => Expect::Corrupt(position),
                    });
                }
                Line::Torn { offset, bytes } => {
                    let position = SpoolPosition {
                        segment: seq,
                        offset: offset as u64,
                    };
                    expected.push(if last {
                        Expect::Torn(position, bytes.len() as u64)
                    } else {
                        Expect::Corrupt(position)
                    });
                }
            }
        }
    }
    let first = read(dir.path());
    assert_eq!(first, expected);

    let config = SpoolConfig {
        fsync: FsyncPolicy::Never,
        ..SpoolConfig::default()
    };
    drop(SpoolWriter::open(dir.path(), config).expect("the writer opens the spool"));
    let last = std::fs::read(segment_path(dir.path(), *seqs.last().unwrap())).unwrap();
    assert!(
        last.is_empty() || last.ends_with(b"\n"),
        "the torn tail is cut"
    );
    let mut without_torn = expected;
    if matches!(without_torn.last(), Some(Expect::Torn(..))) {
        without_torn.pop();
    }
    assert_eq!(read(dir.path()), without_torn);
});
