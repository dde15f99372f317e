//! Records a process has just appended, handed to a reader of the same spool in that process
//! already decoded, so that a record received decoded is not decoded again from its line
//! (`reader.next_available_with(|line| handoff.take(line))`).
//!
//! `tokentap worker` decodes every record it receives (to validate and de-duplicate it),
//! appends it to its spool, and reconstructs from that spool. Without a handoff its
//! reconstruction decodes each line a second time; with one, the reader still reads every
//! line in spool order (the spool stays the one source of order and of truth after a
//! restart) but takes the decoded record from here when one was handed for exactly that line:
//! same position, same length. Anything else (a batch refused because the handoff was full, a
//! replay after a restart, another writer's spool) is decoded from its line as before, so the
//! handoff can only save work, never change what is read.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokentap_schema::CaptureRecord;

use crate::{LineAt, SpoolError, SpoolWriter};

/// A bounded queue of decoded records in spool order, shared by one writer side and one
/// reader side (cheap to clone: both hold the same queue).
#[derive(Debug, Clone)]
pub struct Handoff {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    queue: Mutex<Queue>,
    /// Line bytes the queue may hold; a batch that would pass it is refused whole.
    capacity_bytes: u64,
    taken: AtomicU64,
    refused: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    entries: VecDeque<(LineAt, CaptureRecord)>,
    bytes: u64,
}

/// Counts, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HandoffStats {
    /// Records a reader took from the handoff instead of decoding their line.
    pub taken: u64,
    /// Records not queued because the queue was full (their lines are decoded instead).
    pub refused: u64,
}

impl Handoff {
    /// A handoff holding at most `capacity_bytes` of line bytes (decoded records take about
    /// as much memory as their lines: ids as 4-byte integers, text as it was).
    pub fn new(capacity_bytes: u64) -> Handoff {
        Handoff {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue::default()),
                capacity_bytes,
                taken: AtomicU64::new(0),
                refused: AtomicU64::new(0),
            }),
        }
    }

    /// Appends `records` with [`SpoolWriter::append_batch`] and queues them, decoded, for the
    /// reader; returns the bytes written. The queue stays locked from before the write until
    /// the records are in it, so a reader that sees their lines finds them here (it waits
    /// for the lock rather than decoding a line whose record is on its way). A batch that
    /// would not fit is refused whole: a reader that far behind decodes it from the spool.
    pub fn append(
        &self,
        writer: &mut SpoolWriter,
        records: Vec<CaptureRecord>,
    ) -> Result<u64, SpoolError> {
        self.queue_written(records, |records| writer.append_batch_at(records))
    }

    /// [`Self::append`] for records whose lines the caller holds as they came
    /// ([`SpoolWriter::append_encoded_at`]): `encoded[i]` is the line `records[i]` was
    /// decoded from.
    pub fn append_encoded(
        &self,
        writer: &mut SpoolWriter,
        records: Vec<CaptureRecord>,
        encoded: &[&[u8]],
    ) -> Result<u64, SpoolError> {
        debug_assert_eq!(records.len(), encoded.len());
        self.queue_written(records, |_| writer.append_encoded_at(encoded))
    }

    fn queue_written(
        &self,
        records: Vec<CaptureRecord>,
        write: impl FnOnce(&[CaptureRecord]) -> Result<Vec<LineAt>, SpoolError>,
    ) -> Result<u64, SpoolError> {
        let mut q = self.lock();
        let lines = write(&records)?;
        let bytes: u64 = lines.iter().map(|l| l.len).sum();
        if q.bytes + bytes > self.shared.capacity_bytes {
            self.shared
                .refused
                .fetch_add(records.len() as u64, Ordering::Relaxed);
        } else {
            q.bytes += bytes;
            q.entries.extend(lines.into_iter().zip(records));
        }
        Ok(bytes)
    }

    /// The decoded record of the line at `line`, if one was handed for exactly it. Entries
    /// before it are dropped: the reader has passed them (it decoded them itself). For
    /// [`crate::SpoolReader::next_available_with`].
    pub fn take(&self, line: LineAt) -> Option<CaptureRecord> {
        let mut q = self.lock();
        while let Some((at, _)) = q.entries.front() {
            if at.position > line.position {
                return None;
            }
            let (at, record) = q.entries.pop_front().expect("front exists");
            q.bytes -= at.len;
            if at == line {
                self.shared.taken.fetch_add(1, Ordering::Relaxed);
                return Some(record);
            }
        }
        None
    }

    pub fn stats(&self) -> HandoffStats {
        HandoffStats {
            taken: self.shared.taken.load(Ordering::Relaxed),
            refused: self.shared.refused.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A panic while holding the lock leaves the queue consistent (every change is one
        // push or pop), so a poisoned lock is still usable.
        self.shared
            .queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
