//! The writer on a real full or read-only file system (a small tmpfs each test mounts): a
//! failed append leaves nothing of its batch, the same batch succeeds once space returns, and
//! nothing is ever torn or duplicated. Mounting needs root: without it these tests fail under
//! `TOKENTAP_REQUIRE_PRIVILEGED=1` (CI) and say they skipped otherwise.

mod common;

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;

use common::record;
use tokentap_e2e::privileged;
use tokentap_e2e::tmpfs::{self, Tmpfs};
use tokentap_spool::segment::{list_segments, segment_path};
use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolError, SpoolItem, SpoolReader, SpoolWriter};

fn os_error(e: &SpoolError) -> Option<i32> {
    match e {
        SpoolError::Io { source, .. } => source.raw_os_error(),
        _ => None,
    }
}

/// Every item of the spool, asserting there is nothing torn or corrupt; the record ids.
fn spool_ids(dir: &Path) -> Vec<String> {
    SpoolReader::open(dir)
        .unwrap()
        .map(|item| match item.unwrap() {
            SpoolItem::Record(e) => e.record.record_id,
            other => panic!("the spool holds a torn or corrupt line: {other:?}"),
        })
        .collect()
}

fn ids(range: std::ops::Range<u64>) -> Vec<String> {
    range.map(|i| record(i, 0).record_id).collect()
}

fn last_segment_len(dir: &Path) -> u64 {
    let seq = *list_segments(dir).unwrap().last().unwrap();
    fs::metadata(segment_path(dir, seq)).unwrap().len()
}

#[test]
fn a_batch_that_half_fits_leaves_nothing_and_is_written_once_when_space_returns() {
    if !privileged::runs(tmpfs::may_mount()) {
        return;
    }
    for fsync in [FsyncPolicy::Always, FsyncPolicy::Never] {
        let fs = Tmpfs::mount("256k");
        let dir = fs.path().join("spool");
        let cfg = SpoolConfig {
            fsync,
            ..SpoolConfig::default()
        };
        let mut w = SpoolWriter::open(&dir, cfg.clone()).unwrap();
        let first: Vec<_> = (0..3).map(|i| record(i, 100)).collect();
        w.append_batch(&first).unwrap();
        let before = last_segment_len(&dir);

        // Room for a few of the batch's lines, not all: a write that lands partly.
        let filler = fs.fill_leaving(10_000);
        let batch: Vec<_> = (3..13).map(|i| record(i, 3000)).collect();
        let e = w.append_batch(&batch).unwrap_err();
        assert_eq!(os_error(&e), Some(libc::ENOSPC), "{e}");
        assert_eq!(
            last_segment_len(&dir),
            before,
            "{fsync}: the lines of a failed batch that did land were cut"
        );
        assert_eq!(spool_ids(&dir), ids(0..3));
        // Still full: the retry fails the same way, and still leaves nothing.
        assert!(w.append_batch(&batch).is_err());
        assert_eq!(spool_ids(&dir), ids(0..3));

        fs.remove_filler(filler);
        w.append_batch(&batch).unwrap();
        w.append_batch(&[record(13, 10)]).unwrap();
        assert_eq!(spool_ids(&dir), ids(0..14), "{fsync}: each record once");
        drop(w);
        // And a fresh writer (a restart) finds nothing to repair.
        let w = SpoolWriter::open(&dir, cfg).unwrap();
        assert_eq!(w.torn_bytes_dropped(), 0);
    }
}

#[test]
fn remains_of_a_failed_append_are_cut_before_the_next_one() {
    if !privileged::runs(tmpfs::may_mount()) {
        return;
    }
    let fs = Tmpfs::mount("128k");
    let dir = fs.path().join("spool");
    let mut w = SpoolWriter::open(&dir, SpoolConfig::default()).unwrap();
    w.append(&record(0, 10)).unwrap();
    let filler = fs.fill();
    assert!(w.append(&record(1, 5000)).is_err());
    fs.remove_filler(filler);
    // What a failed cut would have left: the writer let go of the file and must not trust it.
    let seg = segment_path(&dir, 0);
    let mut f = OpenOptions::new().append(true).open(&seg).unwrap();
    f.write_all(b"{\"record_id\":\"half a line").unwrap();
    drop(f);
    w.append(&record(1, 10)).unwrap();
    assert_eq!(spool_ids(&dir), ids(0..2));
}

#[test]
fn a_spool_remounted_read_only_fails_with_erofs_and_recovers_when_writable_again() {
    if !privileged::runs(tmpfs::may_mount()) {
        return;
    }
    let fs = Tmpfs::mount("256k");
    let dir = fs.path().join("spool");
    let cfg = SpoolConfig {
        fsync: FsyncPolicy::Always,
        ..SpoolConfig::default()
    };
    let mut w = SpoolWriter::open(&dir, cfg).unwrap();
    w.append(&record(0, 10)).unwrap();
    // A full disk first: after the failed append the writer holds no writable file, so the
    // file system can be remounted read-only under it (the lock file is held read-only).
    let filler = fs.fill();
    assert!(w.append(&record(1, 5000)).is_err());
    fs.remount("ro");
    let e = w.append(&record(1, 10)).unwrap_err();
    assert_eq!(os_error(&e), Some(libc::EROFS), "{e}");
    assert!(e.to_string().contains("Read-only file system"), "{e}");
    fs.remount("rw");
    fs.remove_filler(filler);
    w.append(&record(1, 10)).unwrap();
    assert_eq!(spool_ids(&dir), ids(0..2));
}

#[test]
fn a_segment_roll_that_fails_is_retried_without_losing_or_repeating_lines() {
    if !privileged::runs(tmpfs::may_mount()) {
        return;
    }
    let fs = Tmpfs::mount("256k");
    let dir = fs.path().join("spool");
    let cfg = SpoolConfig {
        segment_max_bytes: 4096,
        fsync: FsyncPolicy::Always,
    };
    let mut w = SpoolWriter::open(&dir, cfg).unwrap();
    let mut next = 0;
    // Fill most of a segment, then the disk: the next batch needs a new segment.
    while last_segment_len(&dir) < 3000 {
        w.append(&record(next, 200)).unwrap();
        next += 1;
    }
    let filler = fs.fill();
    let batch: Vec<_> = (next..next + 3).map(|i| record(i, 2000)).collect();
    for _ in 0..3 {
        let e = w.append_batch(&batch).unwrap_err();
        assert!(
            matches!(os_error(&e), Some(libc::ENOSPC)),
            "a full disk, whether the write or the roll hit it: {e}"
        );
    }
    fs.remove_filler(filler);
    w.append_batch(&batch).unwrap();
    assert_eq!(spool_ids(&dir), ids(0..next + 3));
    assert!(list_segments(&dir).unwrap().len() >= 2);
}
