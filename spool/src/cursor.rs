//! Streaming line reader over one segment file, tolerant of a writer appending concurrently.

use std::fs::File;
use std::io::{BufRead, BufReader, Seek, SeekFrom};
use std::path::PathBuf;

use crate::SpoolError;

/// Reads one segment line by line from a byte offset. An unterminated tail stays buffered in
/// `line` across calls, so a follower completes it when the rest of the line is appended.
#[derive(Debug)]
pub(crate) struct SegmentCursor {
    pub(crate) seq: u64,
    path: PathBuf,
    reader: BufReader<File>,
    /// Offset of the first byte of `line`.
    line_start: u64,
    /// The current line: complete (ends in `\n`) once returned, otherwise a partial tail.
    line: Vec<u8>,
    /// The reader has seen a later segment exist; after one more pass to EOF this segment is
    /// finished (the writer completes a segment before creating the next).
    pub(crate) successor_seen: bool,
}

impl SegmentCursor {
    pub(crate) fn open(path: PathBuf, seq: u64, offset: u64) -> Result<SegmentCursor, SpoolError> {
        let mut file = File::open(&path).map_err(SpoolError::io("open segment", &path))?;
        if offset > 0 {
            file.seek(SeekFrom::Start(offset))
                .map_err(SpoolError::io("seek in segment", &path))?;
        }
        Ok(SegmentCursor {
            seq,
            reader: BufReader::with_capacity(64 * 1024, file),
            path,
            line_start: offset,
            line: Vec::new(),
            successor_seen: false,
        })
    }

    /// The next complete line (without its `\n`) and its offset, or `None` at end of file,
    /// with any unterminated bytes kept in [`Self::partial_len`].
    pub(crate) fn next_line(&mut self) -> Result<Option<(u64, &[u8])>, SpoolError> {
        if self.line.last() == Some(&b'\n') {
            self.line_start += self.line.len() as u64;
            self.line.clear();
        }
        // read_until appends, so a partial line from an earlier call simply grows.
        self.reader
            .read_until(b'\n', &mut self.line)
            .map_err(SpoolError::io("read segment", &self.path))?;
        match self.line.split_last() {
            Some((b'\n', body)) => Ok(Some((self.line_start, body))),
            _ => Ok(None),
        }
    }

    /// The complete line last returned by [`Self::next_line`] (empty if there is none).
    pub(crate) fn line(&self) -> &[u8] {
        match self.line.split_last() {
            Some((b'\n', body)) => body,
            _ => &[],
        }
    }

    /// Where the next unreturned line starts: a safe point to resume from.
    pub(crate) fn resume_offset(&self) -> u64 {
        match self.line.last() {
            Some(b'\n') => self.line_start + self.line.len() as u64,
            _ => self.line_start,
        }
    }

    /// Length of the buffered unterminated tail (0 after a complete line).
    pub(crate) fn partial_len(&self) -> u64 {
        match self.line.last() {
            Some(b'\n') => 0,
            _ => self.line.len() as u64,
        }
    }

    /// Handles a file that shrank under us: a restarted writer truncating the torn tail we
    /// were holding. Drops the stale partial bytes and rewinds to where the file now ends, so
    /// the writer's new lines are read from their start. Returns whether that happened.
    pub(crate) fn rewind_if_truncated(&mut self) -> Result<bool, SpoolError> {
        let len = self
            .reader
            .get_ref()
            .metadata()
            .map_err(SpoolError::io("stat segment", &self.path))?
            .len();
        let read_to = self.line_start + self.line.len() as u64;
        if len >= read_to {
            return Ok(false);
        }
        let to = self.line_start.min(len);
        tracing::warn!(
            segment = %self.path.display(),
            was = read_to,
            now = len,
            "spool segment shrank while being followed (writer crash recovery?); re-reading from offset {to}"
        );
        self.reader
            .seek(SeekFrom::Start(to))
            .map_err(SpoolError::io("seek in segment", &self.path))?;
        self.line_start = to;
        self.line.clear();
        Ok(true)
    }
}
