//! One-shot queries for the CLI (`tokentap records tail|show`, spool stats).

use std::borrow::Cow;
use std::collections::{HashSet, VecDeque};
use std::io;
use std::path::Path;

use serde::Deserialize;
use tokentap_schema::ndjson::decode_line;
use tokentap_schema::CaptureRecord;

use crate::reader::Event;
use crate::segment::{list_segments, segment_path};
use crate::{LineAt, SpoolError, SpoolItem, SpoolPosition, SpoolReader};

/// How many matching ids an ambiguity error lists.
const MAX_CANDIDATES: usize = 10;

/// The last `n` records, oldest first. Reads segments newest first and stops once it has
/// `n`, holding at most `n` records at a time. Corrupt and torn lines are skipped.
pub fn tail(dir: &Path, n: usize) -> Result<Vec<CaptureRecord>, SpoolError> {
    let mut newest_first: Vec<VecDeque<CaptureRecord>> = Vec::new();
    let mut have = 0;
    for &seq in list_segments(dir)?.iter().rev() {
        if have == n {
            break;
        }
        let need = n - have;
        let mut last = VecDeque::new();
        // A missing segment (deleted since the listing) makes the reader start past it.
        for item in SpoolReader::open_at(
            dir,
            SpoolPosition {
                segment: seq,
                offset: 0,
            },
        )? {
            match item? {
                item if item.position().segment != seq => break,
                SpoolItem::Record(entry) => {
                    if last.len() == need {
                        last.pop_front();
                    }
                    last.push_back(entry.record);
                }
                SpoolItem::Corrupt { .. } | SpoolItem::Torn { .. } => {}
            }
        }
        have += last.len();
        newest_first.push(last);
    }
    Ok(newest_first.into_iter().rev().flatten().collect())
}

/// The record whose `record_id` is `id`, or else the one whose id starts with `id`.
/// `Ok(None)` if nothing matches; [`SpoolError::AmbiguousRecordId`] if the prefix matches
/// several distinct ids. Scans the whole spool, parsing only the id of each line.
pub fn find(dir: &Path, id: &str) -> Result<Option<CaptureRecord>, SpoolError> {
    /// Just the id: serde skips the rest of the line without building it.
    #[derive(Deserialize)]
    struct IdOnly<'a> {
        #[serde(borrow)]
        record_id: Cow<'a, str>,
    }

    let mut reader = SpoolReader::open(dir)?;
    let mut found: Option<CaptureRecord> = None;
    // Distinct matching ids: the same record written twice is not an ambiguity.
    let mut matched: HashSet<String> = HashSet::new();
    let mut candidates: Vec<String> = Vec::new();
    while let Some(event) = reader.next_event(false)? {
        let Event::Line(_) = event else { continue };
        let Ok(IdOnly { record_id }) = serde_json::from_slice::<IdOnly>(reader.line()) else {
            continue;
        };
        if !record_id.starts_with(id) || matched.contains(record_id.as_ref()) {
            continue;
        }
        // Only a line that is a whole valid record counts as a match.
        let Ok(record) = decode_line::<CaptureRecord>(reader.line()) else {
            continue;
        };
        if record_id == id {
            return Ok(Some(record));
        }
        if candidates.len() < MAX_CANDIDATES {
            candidates.push(record_id.to_string());
        }
        matched.insert(record_id.into_owned());
        found.get_or_insert(record);
    }
    let total = matched.len();
    if total > 1 {
        return Err(SpoolError::AmbiguousRecordId {
            dir: dir.to_owned(),
            prefix: id.to_owned(),
            candidates,
            total,
        });
    }
    Ok(found)
}

/// A summary of a spool, for `tokentap records stats` and health checks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpoolStats {
    /// Segment files.
    pub segments: u64,
    /// Valid records.
    pub records: u64,
    /// Bytes in all segments.
    pub bytes: u64,
    /// Bytes of an unterminated final line (0 if none): a writer mid-append or an unrecovered crash.
    pub torn_tail: u64,
    /// Complete lines that are not valid records.
    pub corrupt_lines: u64,
}

/// Scans the whole spool (every record is parsed, so a line is counted as a record only if a
/// reader would yield it).
pub fn stats(dir: &Path) -> Result<SpoolStats, SpoolError> {
    let mut stats = SpoolStats::default();
    for seq in list_segments(dir)? {
        let path = segment_path(dir, seq);
        match std::fs::metadata(&path) {
            Ok(m) => {
                stats.segments += 1;
                stats.bytes += m.len();
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(SpoolError::io("stat segment", path)(e)),
        }
    }
    for item in SpoolReader::open(dir)? {
        match item? {
            SpoolItem::Record(_) => stats.records += 1,
            SpoolItem::Corrupt { .. } => stats.corrupt_lines += 1,
            SpoolItem::Torn { len, .. } => stats.torn_tail = len,
        }
    }
    Ok(stats)
}

/// Bytes the spool holds after `position` (a reader's or a shipper's): what is still to read.
/// Segments that vanish meanwhile count as empty.
pub fn bytes_after(dir: &Path, position: SpoolPosition) -> Result<u64, SpoolError> {
    let mut total = 0;
    for seq in list_segments(dir)? {
        if seq < position.segment {
            continue;
        }
        let len = std::fs::metadata(segment_path(dir, seq)).map_or(0, |m| m.len());
        total += if seq == position.segment {
            len.saturating_sub(position.offset)
        } else {
            len
        };
    }
    Ok(total)
}

/// The records at `lines` (as [`crate::SpoolWriter::append_batch_at`] returned them), in that
/// order, each read alone (one open file per segment): for a holder of positions that wants
/// its records back without keeping them in memory meanwhile. A line that is gone (its
/// segment removed) or is not a record there is an error in its place.
pub fn read_lines(dir: &Path, lines: &[LineAt]) -> Vec<Result<CaptureRecord, SpoolError>> {
    use std::os::unix::fs::FileExt;
    let mut open: Option<(u64, std::fs::File)> = None;
    let mut buf = Vec::new();
    lines
        .iter()
        .map(|at| {
            let SpoolPosition { segment, offset } = at.position;
            let path = segment_path(dir, segment);
            if open.as_ref().is_none_or(|(s, _)| *s != segment) {
                let file =
                    std::fs::File::open(&path).map_err(SpoolError::io("open segment", &path))?;
                open = Some((segment, file));
            }
            let (_, file) = open.as_ref().expect("opened above");
            buf.resize(at.len as usize, 0);
            file.read_exact_at(&mut buf, offset)
                .map_err(SpoolError::io("read segment", &path))?;
            let invalid = |reason| SpoolError::InvalidPosition {
                dir: dir.to_owned(),
                segment,
                offset,
                reason,
            };
            let line = buf
                .strip_suffix(b"\n")
                .ok_or_else(|| invalid("not a whole line"))?;
            decode_line::<CaptureRecord>(line).map_err(|_| invalid("not a record's line"))
        })
        .collect()
}
