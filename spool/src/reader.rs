//! Reading a spool back: every record in write order, across segments, streaming, with
//! per-line problems reported instead of aborting, and a follow mode for `tail -f`.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tokentap_schema::ndjson::decode_line;
use tokentap_schema::CaptureRecord;

use crate::cursor::SegmentCursor;
use crate::segment::{list_segments, segment_path};
use crate::SpoolError;

/// A byte position in a spool: segment sequence number and offset in that segment. Positions
/// from a reader are always line starts, so they can be persisted and passed to
/// [`SpoolReader::open_at`] to resume. Ordered like the spool. Displayed as `segment:offset`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct SpoolPosition {
    pub segment: u64,
    pub offset: u64,
}

impl fmt::Display for SpoolPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.segment, self.offset)
    }
}

/// Where a record's line is: its start and its length, newline included. What
/// [`crate::SpoolWriter::append_batch_at`] returns for each record, and what
/// [`SpoolReader::next_available_with`] asks about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineAt {
    pub position: SpoolPosition,
    pub len: u64,
}

/// A record and where its line starts.
#[derive(Debug, Clone, PartialEq)]
pub struct SpoolEntry {
    pub position: SpoolPosition,
    pub record: CaptureRecord,
}

/// One thing found while reading a spool.
#[derive(Debug, Clone, PartialEq)]
// `Record` is nearly every item: boxing it to shrink the rare variants would add an allocation
// per record and save nothing.
#[allow(clippy::large_enum_variant)]
pub enum SpoolItem {
    /// A complete line holding a valid record.
    Record(SpoolEntry),
    /// A complete line that is not a valid record (or, rarely, an unterminated line at the end
    /// of a segment that is not the last, which no writer will ever finish). Skipped.
    Corrupt {
        position: SpoolPosition,
        error: String,
    },
    /// Bytes without a terminating newline at the end of the last segment: a writer mid-append,
    /// or a crash the writer has not recovered yet. Not a record; reported by the iterator
    /// only, never by [`SpoolReader::next_available`], which waits for the newline instead.
    Torn { position: SpoolPosition, len: u64 },
}

impl SpoolItem {
    /// Where the line starts.
    pub fn position(&self) -> SpoolPosition {
        match self {
            SpoolItem::Record(e) => e.position,
            SpoolItem::Corrupt { position, .. } | SpoolItem::Torn { position, .. } => *position,
        }
    }
}

/// Line-level outcome before parsing; the bytes of a `Line` are in [`SpoolReader::line`].
pub(crate) enum Event {
    Line(SpoolPosition),
    /// Unterminated bytes at the end of a finished (non-last) segment.
    Unterminated {
        position: SpoolPosition,
        len: u64,
    },
    Torn {
        position: SpoolPosition,
        len: u64,
    },
}

/// Reads a spool in write order. Never locks and never modifies the spool, so any number of
/// readers can run alongside the writer.
///
/// Two ways to consume it:
/// - as an [`Iterator`] of `Result<SpoolItem, SpoolError>`: everything currently complete,
///   then a [`SpoolItem::Torn`] if the last segment ends mid-line, then `None`. After an `Err`
///   the iterator ends.
/// - with [`SpoolReader::next_available`] for follow mode (`tail -f`): `Ok(None)` means
///   "nothing new yet"; poll again later to get lines appended since, including in new
///   segments. A partial line stays buffered until its newline arrives.
///
/// Memory use is one line plus a 64 KiB buffer, whatever the segment sizes.
#[derive(Debug)]
pub struct SpoolReader {
    dir: PathBuf,
    cursor: Option<SegmentCursor>,
    /// Lowest sequence number the next segment to open may have.
    next_min: u64,
    /// Segments after the current one, from the last directory listing, ascending.
    known: VecDeque<u64>,
    /// The torn tail already reported, so a re-polled iterator does not repeat it.
    torn_reported: Option<SpoolPosition>,
    failed: bool,
}

impl SpoolReader {
    /// Reads `dir` from its first segment. Fails if `dir` cannot be listed.
    pub fn open(dir: &Path) -> Result<SpoolReader, SpoolError> {
        let known = list_segments(dir)?.into();
        Ok(SpoolReader::new(dir, None, 0, known))
    }

    /// Reads `dir` from `position`, which must be a line start (as returned by
    /// [`Self::position`] or [`SpoolItem::position`]). If that segment does not exist, reading
    /// starts at the next one that does: at or after it for offset 0, after it otherwise (it
    /// was deleted, e.g. by a shipper done with it, so nothing after that offset remains).
    pub fn open_at(dir: &Path, position: SpoolPosition) -> Result<SpoolReader, SpoolError> {
        let SpoolPosition { segment, offset } = position;
        let seqs = list_segments(dir)?;
        let invalid = |reason| SpoolError::InvalidPosition {
            dir: dir.to_owned(),
            segment,
            offset,
            reason,
        };
        if !seqs.contains(&segment) {
            let next_min = if offset == 0 { segment } else { segment + 1 };
            let known = seqs.into_iter().filter(|&s| s >= next_min).collect();
            return Ok(SpoolReader::new(dir, None, next_min, known));
        }
        let path = segment_path(dir, segment);
        if let Some(reason) = not_a_line_start(&path, offset)? {
            return Err(invalid(reason));
        }
        let cursor = SegmentCursor::open(path, segment, offset)?;
        let known = seqs.into_iter().filter(|&s| s > segment).collect();
        Ok(SpoolReader::new(dir, Some(cursor), segment + 1, known))
    }

    fn new(
        dir: &Path,
        cursor: Option<SegmentCursor>,
        next_min: u64,
        known: VecDeque<u64>,
    ) -> SpoolReader {
        SpoolReader {
            dir: dir.to_owned(),
            cursor,
            next_min,
            known,
            torn_reported: None,
            failed: false,
        }
    }

    /// The spool directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where reading would continue: just past the last item returned (a torn tail is not
    /// consumed). Persist it and pass it to [`Self::open_at`] to resume.
    pub fn position(&self) -> SpoolPosition {
        match &self.cursor {
            Some(c) => SpoolPosition {
                segment: c.seq,
                offset: c.resume_offset(),
            },
            None => SpoolPosition {
                segment: self.next_min,
                offset: 0,
            },
        }
    }

    /// Follow mode: the next complete item, or `Ok(None)` when nothing new has been written
    /// yet. Never reports [`SpoolItem::Torn`]: a partial line is kept until it completes.
    pub fn next_available(&mut self) -> Result<Option<SpoolItem>, SpoolError> {
        self.next_item(true)
    }

    /// [`Self::next_available`], asking `handed` for each line's record first (a
    /// [`crate::Handoff`]'s `take`: the record its writer queued for exactly that line) and
    /// decoding the line only when it has none.
    pub fn next_available_with(
        &mut self,
        mut handed: impl FnMut(LineAt) -> Option<CaptureRecord>,
    ) -> Result<Option<SpoolItem>, SpoolError> {
        self.next_item_with(true, &mut handed)
    }

    fn next_item(&mut self, follow: bool) -> Result<Option<SpoolItem>, SpoolError> {
        self.next_item_with(follow, &mut |_| None)
    }

    fn next_item_with(
        &mut self,
        follow: bool,
        handed: &mut dyn FnMut(LineAt) -> Option<CaptureRecord>,
    ) -> Result<Option<SpoolItem>, SpoolError> {
        Ok(self.next_event(follow)?.map(|event| match event {
            Event::Line(position) => {
                let handed = handed(LineAt {
                    position,
                    len: self.line().len() as u64 + 1,
                });
                match handed.map_or_else(|| decode_line::<CaptureRecord>(self.line()), Ok) {
                    Ok(record) => SpoolItem::Record(SpoolEntry { position, record }),
                    Err(e) => SpoolItem::Corrupt {
                        position,
                        error: e.to_string(),
                    },
                }
            }
            Event::Unterminated { position, len } => SpoolItem::Corrupt {
                position,
                error: format!(
                    "unterminated line of {len} bytes at the end of a segment that is not the last"
                ),
            },
            Event::Torn { position, len } => SpoolItem::Torn { position, len },
        }))
    }

    /// The bytes (without newline) of the line last returned as [`Event::Line`].
    pub(crate) fn line(&self) -> &[u8] {
        self.cursor.as_ref().map_or(&[], |c| c.line())
    }

    pub(crate) fn next_event(&mut self, follow: bool) -> Result<Option<Event>, SpoolError> {
        loop {
            if self.cursor.is_none() && !self.open_next_segment()? {
                return Ok(None);
            }
            let cursor = self.cursor.as_mut().expect("opened above");
            if let Some((offset, _)) = cursor.next_line()? {
                return Ok(Some(Event::Line(SpoolPosition {
                    segment: cursor.seq,
                    offset,
                })));
            }
            // End of file for now.
            if follow && cursor.rewind_if_truncated()? {
                continue;
            }
            let seq = cursor.seq;
            let position = SpoolPosition {
                segment: seq,
                offset: cursor.resume_offset(),
            };
            let partial = cursor.partial_len();
            if cursor.successor_seen {
                // Drained after a later segment appeared: this one is finished.
                self.cursor = None;
                if partial > 0 {
                    return Ok(Some(Event::Unterminated {
                        position,
                        len: partial,
                    }));
                }
                continue;
            }
            if self.successor_exists(seq)? {
                // The writer finishes a segment before creating the next, but we may have hit
                // EOF just before its last write: read to EOF once more before moving on.
                self.cursor.as_mut().expect("still open").successor_seen = true;
                continue;
            }
            if !follow && partial > 0 && self.torn_reported != Some(position) {
                self.torn_reported = Some(position);
                return Ok(Some(Event::Torn {
                    position,
                    len: partial,
                }));
            }
            return Ok(None);
        }
    }

    fn successor_exists(&mut self, current: u64) -> Result<bool, SpoolError> {
        if self.known.is_empty() {
            self.known = list_segments(&self.dir)?
                .into_iter()
                .filter(|&s| s > current)
                .collect();
        }
        Ok(!self.known.is_empty())
    }

    fn open_next_segment(&mut self) -> Result<bool, SpoolError> {
        if self.known.is_empty() {
            self.known = list_segments(&self.dir)?.into();
        }
        while let Some(seq) = self.known.pop_front() {
            if seq < self.next_min {
                continue;
            }
            match SegmentCursor::open(segment_path(&self.dir, seq), seq, 0) {
                Ok(cursor) => {
                    self.cursor = Some(cursor);
                    self.next_min = seq + 1;
                    return Ok(true);
                }
                // Deleted since the listing (e.g. by a shipper that is done with it).
                Err(SpoolError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(false)
    }
}

impl Iterator for SpoolReader {
    type Item = Result<SpoolItem, SpoolError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        self.next_item(false)
            .inspect_err(|_| self.failed = true)
            .transpose()
    }
}

/// Why `offset` is not a line start in the segment at `path`, or `None` if it is.
fn not_a_line_start(path: &Path, offset: u64) -> Result<Option<&'static str>, SpoolError> {
    let mut file = File::open(path).map_err(SpoolError::io("open segment", path))?;
    let len = file
        .metadata()
        .map_err(SpoolError::io("stat segment", path))?
        .len();
    if offset > len {
        return Ok(Some("past the end of the segment"));
    }
    if offset > 0 {
        let mut byte = [0u8];
        file.seek(SeekFrom::Start(offset - 1))
            .and_then(|_| file.read_exact(&mut byte))
            .map_err(SpoolError::io("read segment", path))?;
        if byte[0] != b'\n' {
            return Ok(Some("not at the start of a line"));
        }
    }
    Ok(None)
}
