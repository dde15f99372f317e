//! What a durable spool writer leaves in the page cache. A test binary of its own: it starts
//! `fincore` many times, and each child process holds a copy of every descriptor of the
//! binary (other tests' spool locks and files) until it execs.

mod common;

use std::fs;
use std::path::Path;

use common::{read_all, record, records_of};
use tokentap_spool::segment::{list_segments, segment_path};
use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolWriter};

/// Bytes of `path` in the page cache, by util-linux's `fincore`.
fn cached_bytes(path: &Path) -> u64 {
    let out = std::process::Command::new("fincore")
        .args(["--bytes", "--noheadings", "--output", "RES"])
        .arg(path)
        .output()
        .expect("fincore (util-linux) runs");
    assert!(out.status.success(), "fincore: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// Writes 10 MiB of 256 KiB records (fsync per batch) into 4 MiB segments under `keep`;
/// returns each segment's cached bytes.
fn cached_after_writing(keep: Option<u64>) -> (tempfile::TempDir, Vec<u64>) {
    // On the disk: a tmpfs page is the file itself and is never released.
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let cfg = SpoolConfig {
        segment_max_bytes: 4 << 20,
        fsync: FsyncPolicy::Always,
    };
    let mut w = SpoolWriter::open(tmp.path(), cfg).unwrap();
    w.keep_in_page_cache(keep);
    for i in 0..40 {
        w.append(&record(i, 256 << 10)).unwrap();
    }
    drop(w);
    let segments = list_segments(tmp.path()).unwrap();
    assert_eq!(segments.len(), 3, "{segments:?}");
    let cached = segments
        .iter()
        .map(|&s| cached_bytes(&segment_path(tmp.path(), s)))
        .collect();
    (tmp, cached)
}

/// A durable writer releases what it wrote from the page cache, all but the last `keep`
/// bytes; the records read back whole.
#[test]
fn a_durable_writer_leaves_only_its_last_writes_in_the_page_cache() {
    // Control: left to the kernel, the pages just written are all still cached (so the
    // figures below are the writer's doing, not a file system that caches nothing).
    let (_kept, cached) = cached_after_writing(None);
    assert!(cached.iter().all(|&c| c >= 2 << 20), "{cached:?}");

    let keep = 1 << 20;
    let (tmp, cached) = cached_after_writing(Some(keep));
    let last = *list_segments(tmp.path()).unwrap().last().unwrap();
    let last_len = fs::metadata(segment_path(tmp.path(), last)).unwrap().len();
    // Rolled segments: released once the last one held `keep` bytes of its own.
    assert_eq!(cached[..2], [0, 0], "{cached:?}");
    // The last segment (about 2.6 MB): its last `keep` bytes stay, the rest is released in
    // whole mebibytes.
    assert!(
        cached[2] >= keep && cached[2] <= keep + (1 << 20) && cached[2] < last_len,
        "{cached:?} of {last_len}"
    );
    let records = records_of(&read_all(tmp.path()));
    assert_eq!(records.len(), 40);
    assert_eq!(records[7], record(7, 256 << 10));
}
