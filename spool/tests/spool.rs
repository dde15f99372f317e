//! End-to-end behaviour of the spool: writer, reader, crash recovery, follow mode, queries.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

mod common;

use common::{read_all, record, records_of};
use proptest::prelude::*;
use tokentap_schema::ndjson::encode_line;
use tokentap_schema::CaptureRecord;
use tokentap_spool::segment::{list_segments, segment_path};
use tokentap_spool::{
    find, stats, tail, FsyncPolicy, Handoff, HandoffStats, LineAt, SpoolConfig, SpoolEntry,
    SpoolError, SpoolItem, SpoolPosition, SpoolReader, SpoolStats, SpoolWriter,
};

fn line_of(r: &CaptureRecord) -> Vec<u8> {
    let mut buf = Vec::new();
    encode_line(r, &mut buf).unwrap();
    buf
}

/// Tests don't need durability; skipping fsync keeps them fast.
fn config(segment_max_bytes: u64) -> SpoolConfig {
    SpoolConfig {
        segment_max_bytes,
        fsync: FsyncPolicy::Never,
    }
}

fn append_raw(path: &Path, bytes: &[u8]) {
    OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

fn last_segment(dir: &Path) -> PathBuf {
    segment_path(dir, *list_segments(dir).unwrap().last().unwrap())
}

/// The entries of items that must all be records.
fn entries_of(items: Vec<SpoolItem>) -> Vec<SpoolEntry> {
    items
        .into_iter()
        .map(|i| match i {
            SpoolItem::Record(e) => e,
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

fn write_records(dir: &Path, cfg: SpoolConfig, records: &[CaptureRecord]) {
    let mut w = SpoolWriter::open(dir, cfg).unwrap();
    for r in records {
        w.append(r).unwrap();
    }
}

#[test]
fn round_trip_across_segment_rolls() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("spool"); // created by the writer
    let max = 2_000;
    let records: Vec<_> = (0..200)
        .map(|i| record(i, (i as usize * 37) % 300))
        .collect();
    let mut w = SpoolWriter::open(&dir, config(max)).unwrap();
    let mut written = 0;
    let mut starts = Vec::new();
    for r in &records {
        let n = w.append(r).unwrap();
        assert_eq!(n, line_of(r).len() as u64);
        written += n;
        let end = w.position();
        starts.push(SpoolPosition {
            segment: end.segment,
            offset: end.offset - n,
        });
    }
    assert_eq!(w.total_bytes(), written);
    drop(w);

    let segments = list_segments(&dir).unwrap();
    assert!(
        segments.len() > 10,
        "expected many rolls, got {}",
        segments.len()
    );
    assert_eq!(segments, (0..segments.len() as u64).collect::<Vec<_>>());
    for &seq in &segments {
        let len = fs::metadata(segment_path(&dir, seq)).unwrap().len();
        assert!(len > 0 && len <= max, "segment {seq} has {len} bytes");
    }

    let entries = entries_of(read_all(&dir));
    assert_eq!(
        entries.iter().map(|e| &e.record).collect::<Vec<_>>(),
        records.iter().collect::<Vec<_>>()
    );
    assert_eq!(
        entries.iter().map(|e| e.position).collect::<Vec<_>>(),
        starts
    );

    let s = stats(&dir).unwrap();
    assert_eq!(
        s,
        SpoolStats {
            segments: segments.len() as u64,
            records: 200,
            bytes: written,
            torn_tail: 0,
            corrupt_lines: 0
        }
    );

    // Reopening resumes the last segment and recounts the bytes.
    let w = SpoolWriter::open(&dir, config(max)).unwrap();
    assert_eq!(w.total_bytes(), written);
    assert_eq!(w.position().segment, *segments.last().unwrap());
    assert_eq!(w.torn_bytes_dropped(), 0);
}

#[test]
fn a_record_larger_than_a_segment_gets_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    let records = [record(0, 10), record(1, 5_000), record(2, 10)];
    write_records(tmp.path(), config(1_000), &records);
    let sizes: Vec<u64> = list_segments(tmp.path())
        .unwrap()
        .iter()
        .map(|&s| fs::metadata(segment_path(tmp.path(), s)).unwrap().len())
        .collect();
    assert_eq!(sizes.len(), 3);
    assert!(sizes[1] > 5_000);
    assert_eq!(records_of(&read_all(tmp.path())), records);
}

#[test]
fn append_batch_is_one_write_in_one_segment() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = SpoolWriter::open(
        tmp.path(),
        SpoolConfig {
            segment_max_bytes: 1_000,
            fsync: FsyncPolicy::Always,
        },
    )
    .unwrap();
    w.append(&record(0, 400)).unwrap();
    let batch: Vec<_> = (1..6).map(|i| record(i, 400)).collect();
    let n = w.append_batch(&batch).unwrap();
    assert_eq!(
        n,
        batch.iter().map(|r| line_of(r).len() as u64).sum::<u64>()
    );
    assert_eq!(w.append_batch(&[]).unwrap(), 0);
    assert!(!w.has_unsynced(), "Always syncs before returning");
    // The batch did not fit after the first record, so it went whole into segment 1.
    assert_eq!(
        w.position(),
        SpoolPosition {
            segment: 1,
            offset: n
        }
    );
    drop(w);
    let mut want = vec![record(0, 400)];
    want.extend(batch);
    assert_eq!(records_of(&read_all(tmp.path())), want);
}

#[test]
fn crash_recovery_truncates_a_torn_tail_and_keeps_everything_before_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let first: Vec<_> = (0..5).map(|i| record(i, 50)).collect();
    write_records(dir, config(1 << 20), &first);
    let seg = last_segment(dir);
    let good_len = fs::metadata(&seg).unwrap().len();

    // A crash mid-append: half a line, no newline.
    let torn = &line_of(&record(99, 50))[..70];
    append_raw(&seg, torn);

    // Readers see every complete record and report the torn tail.
    let items = read_all(dir);
    assert_eq!(records_of(&items), first);
    assert_eq!(
        items.last(),
        Some(&SpoolItem::Torn {
            position: SpoolPosition {
                segment: 0,
                offset: good_len
            },
            len: 70
        })
    );
    assert_eq!(stats(dir).unwrap().torn_tail, 70);

    // The next writer cuts it and appends after the last complete line.
    let mut w = SpoolWriter::open(dir, config(1 << 20)).unwrap();
    assert_eq!(w.torn_bytes_dropped(), 70);
    assert_eq!(fs::metadata(&seg).unwrap().len(), good_len);
    assert_eq!(w.total_bytes(), good_len);
    let more: Vec<_> = (5..8).map(|i| record(i, 50)).collect();
    for r in &more {
        w.append(r).unwrap();
    }
    drop(w);

    let items = read_all(dir);
    assert!(
        items.iter().all(|i| matches!(i, SpoolItem::Record(_))),
        "{items:?}"
    );
    assert_eq!(records_of(&items), [first, more].concat());
}

#[test]
fn a_corrupt_complete_line_is_reported_and_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_records(dir, config(1 << 20), &[record(0, 10), record(1, 10)]);
    let seg = last_segment(dir);
    let bad_at = fs::metadata(&seg).unwrap().len();
    append_raw(&seg, b"this is not json\n");
    let valid_json_bad_record_at = bad_at + 17;
    append_raw(&seg, b"{\"record_id\":\"x\"}\n");
    write_records(dir, config(1 << 20), &[record(2, 10)]);

    let items = read_all(dir);
    assert_eq!(
        records_of(&items),
        [record(0, 10), record(1, 10), record(2, 10)]
    );
    let corrupt: Vec<_> = items
        .iter()
        .filter_map(|i| match i {
            SpoolItem::Corrupt { position, error } => Some((position.offset, error.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(corrupt.len(), 2, "{items:?}");
    assert_eq!(corrupt[0].0, bad_at);
    assert_eq!(corrupt[1].0, valid_json_bad_record_at);
    assert!(corrupt[1].1.contains("missing field"), "{}", corrupt[1].1);
    assert!(
        matches!(items[2], SpoolItem::Corrupt { .. }),
        "reported in order"
    );
    let s = stats(dir).unwrap();
    assert_eq!((s.records, s.corrupt_lines, s.torn_tail), (3, 2, 0));
}

#[test]
fn an_unterminated_line_inside_the_spool_is_corrupt_not_torn() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    fs::write(
        segment_path(dir, 0),
        [line_of(&record(0, 1)), b"{\"half".to_vec()].concat(),
    )
    .unwrap();
    fs::write(segment_path(dir, 1), line_of(&record(1, 1))).unwrap();
    let items = read_all(dir);
    assert_eq!(items.len(), 3, "{items:?}");
    assert!(
        matches!(&items[1], SpoolItem::Corrupt { error, .. } if error.contains("not the last"))
    );
    assert_eq!(records_of(&items), [record(0, 1), record(1, 1)]);
}

#[test]
fn follow_mode_picks_up_appends_partial_lines_and_new_segments() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Following an empty directory is fine: nothing yet.
    let mut reader = SpoolReader::open(dir).unwrap();
    assert_eq!(reader.next_available().unwrap(), None);

    write_records(dir, config(1 << 20), &[record(0, 10), record(1, 10)]);
    for i in 0..2 {
        let item = reader.next_available().unwrap().unwrap();
        assert!(
            matches!(item, SpoolItem::Record(ref e) if e.record == record(i, 10)),
            "{item:?}"
        );
    }
    assert_eq!(reader.next_available().unwrap(), None);
    let resume = reader.position();

    // One line arriving in two writes: nothing until the newline, then the record.
    let seg = last_segment(dir);
    let line = line_of(&record(2, 10));
    let (a, b) = line.split_at(line.len() / 2);
    append_raw(&seg, a);
    assert_eq!(reader.next_available().unwrap(), None);
    assert_eq!(reader.next_available().unwrap(), None);
    assert_eq!(reader.position(), resume, "a partial line is not consumed");
    append_raw(&seg, b);
    match reader.next_available().unwrap() {
        Some(SpoolItem::Record(e)) => assert_eq!((e.position, e.record), (resume, record(2, 10))),
        other => panic!("{other:?}"),
    }
    assert_eq!(reader.next_available().unwrap(), None);

    // A writer that rolls: the follower moves on to the new segments.
    let mut w = SpoolWriter::open(dir, config(1)).unwrap(); // every append rolls
    w.append(&record(3, 10)).unwrap();
    w.append(&record(4, 10)).unwrap();
    assert_eq!(w.position().segment, 2);
    for i in 3..5 {
        match reader.next_available().unwrap() {
            Some(SpoolItem::Record(e)) => {
                assert_eq!(e.record, record(i, 10));
                assert_eq!(
                    e.position,
                    SpoolPosition {
                        segment: i - 2,
                        offset: 0
                    }
                );
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(reader.next_available().unwrap(), None);
    w.append(&record(5, 10)).unwrap();
    assert!(
        matches!(reader.next_available().unwrap(), Some(SpoolItem::Record(e)) if e.record == record(5, 10))
    );
}

#[test]
fn a_follower_survives_the_writer_truncating_a_torn_tail() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    write_records(dir, config(1 << 20), &[record(0, 10)]);
    append_raw(&last_segment(dir), &line_of(&record(99, 400))[..300]); // crashed writer
    let mut reader = SpoolReader::open(dir).unwrap();
    assert!(matches!(
        reader.next_available().unwrap(),
        Some(SpoolItem::Record(_))
    ));
    assert_eq!(reader.next_available().unwrap(), None); // holding the 300 torn bytes

    let mut w = SpoolWriter::open(dir, config(1 << 20)).unwrap(); // truncates them
    assert_eq!(w.torn_bytes_dropped(), 300);
    assert_eq!(reader.next_available().unwrap(), None);
    w.append(&record(1, 10)).unwrap();
    assert!(
        matches!(reader.next_available().unwrap(), Some(SpoolItem::Record(e)) if e.record == record(1, 10))
    );
}

#[test]
fn a_second_writer_is_refused_until_the_first_closes() {
    let tmp = tempfile::tempdir().unwrap();
    let first = SpoolWriter::open(tmp.path(), config(1 << 20)).unwrap();
    let err = SpoolWriter::open(tmp.path(), config(1 << 20)).unwrap_err();
    assert!(matches!(err, SpoolError::Locked { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains(&tmp.path().display().to_string()) && msg.contains("spool.lock"),
        "{msg}"
    );
    // Readers are not affected by the lock.
    assert!(read_all(tmp.path()).is_empty());
    drop(first);
    SpoolWriter::open(tmp.path(), config(1 << 20)).unwrap();
}

/// A lock let go of a moment after the next writer asked (as when a child process forked
/// while the first writer held it execs a moment later) is taken, not refused.
#[test]
fn a_writer_waits_a_moment_for_a_lock_being_let_go() {
    let tmp = tempfile::tempdir().unwrap();
    let first = SpoolWriter::open(tmp.path(), config(1 << 20)).unwrap();
    let letting_go = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        drop(first);
    });
    SpoolWriter::open(tmp.path(), config(1 << 20)).expect("taken once let go");
    letting_go.join().unwrap();
}

#[test]
fn open_at_resumes_from_a_saved_position() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let records: Vec<_> = (0..30).map(|i| record(i, 100)).collect();
    write_records(dir, config(1_500), &records);

    let mut reader = SpoolReader::open(dir).unwrap();
    for _ in 0..17 {
        reader.next().unwrap().unwrap();
    }
    let saved = reader.position();
    let rest = records_of(
        &SpoolReader::open_at(dir, saved)
            .unwrap()
            .collect::<Result<Vec<_>, _>>()
            .unwrap(),
    );
    assert_eq!(rest, records[17..]);

    // At the very end: nothing more, and positions round-trip.
    let mut reader = SpoolReader::open(dir).unwrap();
    reader.by_ref().for_each(drop);
    let end = reader.position();
    assert_eq!(SpoolReader::open_at(dir, end).unwrap().count(), 0);

    // Mid-line and past-the-end positions are refused with the reason.
    let err = SpoolReader::open_at(
        dir,
        SpoolPosition {
            segment: 0,
            offset: 1,
        },
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("not at the start of a line"),
        "{err}"
    );
    let err = SpoolReader::open_at(
        dir,
        SpoolPosition {
            segment: 0,
            offset: 1 << 40,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("past the end"), "{err}");
    // A deleted segment: resume at the next one that exists.
    let mut resumed = SpoolReader::open_at(
        dir,
        SpoolPosition {
            segment: 999,
            offset: 5,
        },
    )
    .unwrap();
    assert!(resumed.next().is_none());

    // A deleted segment (shipped and removed) resumes at the next one, whatever the offset.
    let second = list_segments(dir).unwrap()[1];
    fs::remove_file(segment_path(dir, 0)).unwrap();
    for offset in [0, 123] {
        let mut from = SpoolReader::open_at(dir, SpoolPosition { segment: 0, offset }).unwrap();
        let first = from.next().unwrap().unwrap();
        assert_eq!(
            first.position(),
            SpoolPosition {
                segment: second,
                offset: 0
            }
        );
    }
}

#[test]
fn tail_returns_the_last_n_records_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    assert!(tail(dir, 5).unwrap().is_empty());
    let records: Vec<_> = (0..40).map(|i| record(i, 100)).collect();
    write_records(dir, config(1_000), &records);
    append_raw(&last_segment(dir), b"{\"torn");
    assert_eq!(tail(dir, 0).unwrap(), []);
    assert_eq!(tail(dir, 1).unwrap(), records[39..]);
    assert_eq!(tail(dir, 13).unwrap(), records[27..]);
    assert_eq!(tail(dir, 100).unwrap(), records);
}

#[test]
fn find_by_id_or_unique_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut records: Vec<_> = (0..20).map(|i| record(i, 10)).collect();
    records[7].record_id = "0191bbbb-only-one".into();
    write_records(dir, config(800), &records);

    assert_eq!(
        find(dir, &records[12].record_id).unwrap(),
        Some(records[12].clone())
    );
    assert_eq!(find(dir, "0191b").unwrap(), Some(records[7].clone()));
    assert_eq!(find(dir, "nope").unwrap(), None);
    match find(dir, "0190aaaa-0000-7000-8000-00000000000").unwrap_err() {
        SpoolError::AmbiguousRecordId {
            candidates, total, ..
        } => {
            assert_eq!(total, 15); // ids ...000 to ...00f except 7
            assert_eq!(candidates.len(), 10);
            assert_eq!(candidates[0], records[0].record_id);
        }
        other => panic!("{other:?}"),
    }
    let msg = find(dir, "0190").unwrap_err().to_string();
    assert!(
        msg.contains("ambiguous") && msg.contains(&records[0].record_id),
        "{msg}"
    );

    // A record written twice is still one match.
    write_records(dir, config(800), &[records[7].clone()]);
    assert_eq!(find(dir, "0191").unwrap(), Some(records[7].clone()));
}

#[test]
fn fsync_policies_track_unsynced_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let hour = FsyncPolicy::Interval(Duration::from_secs(3600));
    let mut w = SpoolWriter::open(
        tmp.path(),
        SpoolConfig {
            segment_max_bytes: 1 << 20,
            fsync: hour,
        },
    )
    .unwrap();
    assert_eq!(w.sync_deadline(), None);
    w.append(&record(0, 10)).unwrap();
    assert!(w.has_unsynced());
    assert!(w.sync_deadline().is_some());
    assert!(!w.sync_if_due().unwrap(), "not due for an hour");
    w.sync().unwrap();
    assert!(!w.has_unsynced() && w.sync_deadline().is_none());
    drop(w);

    let zero_ish = FsyncPolicy::Interval(Duration::from_nanos(1));
    let mut w = SpoolWriter::open(
        tmp.path(),
        SpoolConfig {
            segment_max_bytes: 1 << 20,
            fsync: zero_ish,
        },
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(1));
    w.append(&record(1, 10)).unwrap();
    assert!(!w.has_unsynced(), "an overdue interval syncs on append");
    drop(w);

    // Never: rolled segments stay pending until an explicit sync covers them.
    let mut w = SpoolWriter::open(tmp.path(), config(1)).unwrap();
    for i in 2..5 {
        w.append(&record(i, 10)).unwrap();
    }
    assert!(w.has_unsynced() && w.sync_deadline().is_none());
    w.sync().unwrap();
    assert!(!w.has_unsynced());
    drop(w);
    assert_eq!(records_of(&read_all(tmp.path())).len(), 5);
}

#[test]
fn io_errors_name_the_path() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("no-such-spool");
    let err = SpoolReader::open(&missing).unwrap_err();
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    assert!(find(&missing, "x").is_err() && tail(&missing, 1).is_err() && stats(&missing).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Whatever records were written and wherever the last segment is cut (a crash at any
    /// byte), the reader returns exactly the records whose newline made it, reports a torn
    /// tail exactly when the cut is mid-line, and a reopened writer continues cleanly.
    #[test]
    fn truncating_the_last_segment_loses_only_unterminated_records(
        payloads in proptest::collection::vec(0usize..300, 0..40),
        segment_max in 200u64..3_000,
        cut in any::<prop::sample::Index>(),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let records: Vec<_> = payloads.iter().enumerate().map(|(i, &p)| record(i as u64, p)).collect();
        let mut ends = Vec::new();
        let mut w = SpoolWriter::open(dir, config(segment_max)).unwrap();
        for r in &records {
            w.append(r).unwrap();
            ends.push(w.position());
        }
        let last = w.position().segment;
        drop(w);

        let seg = segment_path(dir, last);
        let len = fs::metadata(&seg).unwrap().len();
        let cut = cut.index(len as usize + 1) as u64;
        OpenOptions::new().write(true).open(&seg).unwrap().set_len(cut).unwrap();

        let survives = |end: &SpoolPosition| end.segment < last || end.offset <= cut;
        let expected: Vec<_> = records.iter().zip(&ends).filter(|(_, e)| survives(e)).map(|(r, _)| r.clone()).collect();
        let at_boundary = cut == 0 || ends.iter().any(|e| e.segment == last && e.offset == cut);

        let items = read_all(dir);
        prop_assert_eq!(records_of(&items), expected.clone());
        let torn: Vec<_> = items.iter().filter(|i| matches!(i, SpoolItem::Torn { .. })).collect();
        prop_assert_eq!(torn.len(), usize::from(!at_boundary));
        let corrupt = items.iter().filter(|i| matches!(i, SpoolItem::Corrupt { .. })).count();
        prop_assert_eq!(corrupt, 0);

        let mut w = SpoolWriter::open(dir, config(segment_max)).unwrap();
        let extra = record(10_000, 5);
        w.append(&extra).unwrap();
        drop(w);
        let items = read_all(dir);
        let all_records = items.iter().all(|i| matches!(i, SpoolItem::Record(_)));
        prop_assert!(all_records);
        let mut want = expected;
        want.push(extra);
        prop_assert_eq!(records_of(&items), want);
    }
}

/// Records hold prompts and tool output: another user on the host can read neither the spool
/// directory nor its files, whether the spool was created now or existed with a wide mode.
#[test]
fn spool_files_are_owner_only() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o777;
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("new/spool");
    write_records(
        &dir,
        config(2_000),
        &(0..10).map(|i| record(i, 300)).collect::<Vec<_>>(),
    );
    assert_eq!(mode(&dir), 0o700);
    assert_eq!(mode(&t.path().join("new")), 0o700, "created parents too");
    let segments = list_segments(&dir).unwrap();
    assert!(segments.len() > 1, "the test rolls segments");
    for seq in segments {
        assert_eq!(mode(&segment_path(&dir, seq)), 0o600, "segment {seq}");
    }
    assert_eq!(mode(&dir.join(tokentap_spool::LOCK_FILE_NAME)), 0o600);

    // An existing world-readable spool directory is tightened when a writer opens it.
    let old = t.path().join("old");
    fs::create_dir(&old).unwrap();
    fs::set_permissions(&old, fs::Permissions::from_mode(0o755)).unwrap();
    write_records(&old, config(1 << 20), &[record(0, 10)]);
    assert_eq!(mode(&old), 0o700);
}

/// Reads everything now available, taking records from `handoff` where it can.
fn read_available_from(reader: &mut SpoolReader, handoff: &Handoff) -> Vec<SpoolEntry> {
    let mut out = Vec::new();
    while let Some(item) = reader.next_available_with(|l| handoff.take(l)).unwrap() {
        let SpoolItem::Record(e) = item else {
            panic!("not a record: {item:?}")
        };
        out.push(e);
    }
    out
}

#[test]
fn a_handoff_gives_the_reader_each_record_as_its_line_holds_it() {
    let tmp = tempfile::tempdir().unwrap();
    // Small segments: batches roll, and positions cross segments.
    let mut w = SpoolWriter::open(tmp.path(), config(2_000)).unwrap();
    let handoff = Handoff::new(1 << 20);
    let mut reader = SpoolReader::open(tmp.path()).unwrap();
    let mut want = Vec::new();
    let mut got = Vec::new();
    for b in 0..6u64 {
        let batch: Vec<_> = (0..3)
            .map(|i| record(b * 3 + i, 300 + 50 * i as usize))
            .collect();
        want.extend(batch.clone());
        handoff.append(&mut w, batch).unwrap();
        // The reader keeps up with some batches and lags behind others.
        if b % 2 == 1 {
            got.extend(read_available_from(&mut reader, &handoff));
        }
    }
    got.extend(read_available_from(&mut reader, &handoff));
    let read_plain = entries_of(read_all(tmp.path()));
    assert_eq!(
        got, read_plain,
        "handed records equal the decoded lines, at their positions"
    );
    assert_eq!(records_of(&read_all(tmp.path())), want);
    assert!(list_segments(tmp.path()).unwrap().len() > 3);
    assert_eq!(
        handoff.stats(),
        HandoffStats {
            taken: 18,
            refused: 0
        },
        "every line's record came from the handoff"
    );
}

#[test]
fn a_handoff_never_stands_in_for_a_line_it_was_not_given_for() {
    let tmp = tempfile::tempdir().unwrap();
    let other = tempfile::tempdir().unwrap();
    let handoff = Handoff::new(1 << 20);
    // Records handed for one spool, while the reader reads another whose lines start at the
    // same positions but are longer: none may be taken.
    let mut w = SpoolWriter::open(tmp.path(), config(1 << 20)).unwrap();
    handoff
        .append(&mut w, (0..4).map(|i| record(i, 100)).collect())
        .unwrap();
    let longer: Vec<_> = (0..4).map(|i| record(i, 101)).collect();
    write_records(other.path(), config(1 << 20), &longer);
    let mut reader = SpoolReader::open(other.path()).unwrap();
    let got = read_available_from(&mut reader, &handoff);
    assert_eq!(
        got.into_iter().map(|e| e.record).collect::<Vec<_>>(),
        longer
    );
    assert_eq!(handoff.stats().taken, 0);

    // A batch past the handoff's size is refused whole and read from its lines.
    let small = Handoff::new(2_000);
    let third = tempfile::tempdir().unwrap();
    let mut w = SpoolWriter::open(third.path(), config(1 << 20)).unwrap();
    small
        .append(&mut w, (0..2).map(|i| record(i, 100)).collect())
        .unwrap();
    let big: Vec<_> = (2..6).map(|i| record(i, 500)).collect();
    small.append(&mut w, big).unwrap();
    let mut reader = SpoolReader::open(third.path()).unwrap();
    let got = read_available_from(&mut reader, &small);
    assert_eq!(
        got.into_iter().map(|e| e.record).collect::<Vec<_>>(),
        (0..6)
            .map(|i| record(i, if i < 2 { 100 } else { 500 }))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        small.stats(),
        HandoffStats {
            taken: 2,
            refused: 4
        }
    );
}

#[test]
fn append_batch_at_says_where_each_line_starts() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = SpoolWriter::open(tmp.path(), config(1_500)).unwrap();
    let mut at = Vec::new();
    for b in 0..4u64 {
        let batch: Vec<_> = (0..2)
            .map(|i| record(b * 2 + i, 200 * (i as usize + 1)))
            .collect();
        at.extend(w.append_batch_at(&batch).unwrap());
    }
    let lines: Vec<LineAt> = entries_of(read_all(tmp.path()))
        .into_iter()
        .map(|e| LineAt {
            position: e.position,
            len: line_of(&e.record).len() as u64,
        })
        .collect();
    assert_eq!(at, lines);
}

#[test]
fn lines_appended_as_they_came_are_read_as_their_records() {
    let tmp = tempfile::tempdir().unwrap();
    let mut w = SpoolWriter::open(tmp.path(), config(1_500)).unwrap();
    let handoff = Handoff::new(1 << 20);
    let records: Vec<_> = (0..6).map(|i| record(i, 100 * (i as usize + 1))).collect();
    // Received lines need not be this writer's encoding: spaces, a CR before the newline.
    let received: Vec<Vec<u8>> = records
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let mut line = serde_json::to_vec_pretty(r).unwrap();
            line.retain(|b| *b != b'\n');
            if i % 2 == 0 {
                line.push(b'\r');
            }
            line
        })
        .collect();
    for pair in records.chunks(2).zip(received.chunks(2)) {
        let lines: Vec<&[u8]> = pair.1.iter().map(Vec::as_slice).collect();
        handoff
            .append_encoded(&mut w, pair.0.to_vec(), &lines)
            .unwrap();
    }
    let mut reader = SpoolReader::open(tmp.path()).unwrap();
    let handed = read_available_from(&mut reader, &handoff);
    assert_eq!(handoff.stats().taken, 6);
    let decoded = entries_of(read_all(tmp.path()));
    assert_eq!(
        handed, decoded,
        "each line decodes to the record handed for it"
    );
    assert_eq!(
        decoded.into_iter().map(|e| e.record).collect::<Vec<_>>(),
        records
    );

    // A "line" holding a newline would be two lines to a reader: the batch is refused whole.
    let before = w.position();
    let two = [received[0].as_slice(), b"{}\n{}".as_slice()];
    let e = w.append_encoded_at(&two).unwrap_err();
    assert!(matches!(e, SpoolError::NotOneLine { index: 1, .. }), "{e}");
    assert_eq!(w.position(), before, "nothing of it written");
}

/// Records read back by the positions their batches were written at: across segments, in the
/// order asked, and a position whose segment is gone or that is not a line's start is an error
/// in its place, not a wrong record.
#[test]
fn records_read_back_by_their_positions() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = SpoolWriter::open(dir.path(), config(4 << 10)).unwrap();
    let mut written: Vec<(CaptureRecord, LineAt)> = Vec::new();
    for batch in 0..6u64 {
        let records: Vec<CaptureRecord> = (0..3).map(|i| record(batch * 3 + i, 900)).collect();
        let lines = w.append_batch_at(&records).unwrap();
        written.extend(records.into_iter().zip(lines));
    }
    assert!(
        list_segments(dir.path()).unwrap().len() > 2,
        "several segments"
    );
    let wanted: Vec<&(CaptureRecord, LineAt)> = written.iter().rev().step_by(2).collect();
    let lines: Vec<LineAt> = wanted.iter().map(|(_, at)| *at).collect();
    let got: Vec<CaptureRecord> = tokentap_spool::read_lines(dir.path(), &lines)
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        got,
        wanted.iter().map(|(r, _)| r.clone()).collect::<Vec<_>>()
    );

    let first = written[0].1;
    let off_by_one = LineAt {
        position: SpoolPosition {
            offset: first.position.offset + 1,
            ..first.position
        },
        ..first
    };
    fs::remove_file(segment_path(dir.path(), written[0].1.position.segment)).ok();
    let last = written.last().unwrap().1;
    let read = tokentap_spool::read_lines(dir.path(), &[first, off_by_one, last]);
    assert!(
        matches!(read[0], Err(SpoolError::Io { .. })),
        "{:?}",
        read[0]
    );
    assert!(read[1].is_err());
    assert_eq!(read[2].as_ref().unwrap(), &written.last().unwrap().0);
}
