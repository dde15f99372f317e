//! The single writer of a spool: appends records as NDJSON lines, rolls segments, fsyncs per
//! policy, and repairs a torn tail left by a crash.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokentap_schema::ndjson::encode_line;
use tokentap_schema::CaptureRecord;

use crate::lock::SpoolLock;
use crate::owner_only;
use crate::recovery::truncate_torn_tail;
use crate::segment::{list_segments, segment_path};
use crate::{FsyncPolicy, LineAt, SpoolError, SpoolPosition};

/// Default size past which the writer starts a new segment: 64 MiB.
pub const DEFAULT_SEGMENT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// Default bytes of the most recent writes a durable writer leaves in the page cache: 64 MiB,
/// about a third of a second of records at 2,500 calls/s of 80 KB, which readers following
/// the spool (the shipper, live reconstruction) read long before it is released.
pub const DEFAULT_PAGE_CACHE_KEEP_BYTES: u64 = 64 * 1024 * 1024;

/// Writer settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolConfig {
    /// A new segment is started when an append would take the current one past this size.
    /// A single record (or batch) larger than this gets a segment of its own.
    pub segment_max_bytes: u64,
    /// When to fsync; see [`FsyncPolicy`].
    pub fsync: FsyncPolicy,
}

impl Default for SpoolConfig {
    fn default() -> Self {
        SpoolConfig {
            segment_max_bytes: DEFAULT_SEGMENT_MAX_BYTES,
            fsync: FsyncPolicy::default(),
        }
    }
}

/// Appends capture records to a spool directory. Synchronous (std::fs): run it on a dedicated
/// thread. Exactly one per directory, enforced with a lock on `spool.lock`.
///
/// Each append is a single `write` of complete lines on an unbuffered file, so a crash leaves
/// at most one torn line at the end of the last segment, which [`SpoolWriter::open`] removes.
///
/// A failed append (disk full, read-only file system, I/O error) leaves nothing of its batch
/// in the spool: whatever part of it landed is cut before the error is returned, or, if even
/// the cut fails, before anything else is written. After a failure the writer lets go of the
/// segment file and opens it again on the next append, so it recovers by itself once the
/// disk does (and holds no writable file on it in between, which a read-only remount needs).
/// Retrying the same batch after an error therefore never duplicates a record.
#[derive(Debug)]
pub struct SpoolWriter {
    dir: PathBuf,
    config: SpoolConfig,
    segment: u64,
    /// The current segment, open for appending; `None` after a failed append until the next
    /// one re-opens it (and cuts whatever the failure left past `segment_len`).
    file: Option<File>,
    /// Bytes of complete, acknowledged lines in the current segment: where the file must end.
    segment_len: u64,
    total_bytes: u64,
    /// `file` has bytes not yet fsynced.
    unsynced: bool,
    last_sync: Instant,
    /// Finished segments not fsynced yet (only under `Never`), so `sync()` can still cover them.
    closed_unsynced: Vec<u64>,
    /// A segment was created without fsyncing the directory (only under `Never`).
    dir_unsynced: bool,
    torn_bytes_dropped: u64,
    /// An fsync under `Interval` that failed after its lines were written: those lines stay
    /// (rewriting them would duplicate records), the error is kept for the owner to report.
    sync_error: Option<SpoolError>,
    /// Reused encoding buffer: one allocation for the writer's lifetime, not one per record.
    buf: Vec<u8>,
    /// What stays in the page cache of what was written; see [`Self::keep_in_page_cache`].
    page_cache_keep: Option<u64>,
    /// Bytes at the start of the current segment released from the page cache.
    released: u64,
    /// The previous segment and where its unreleased bytes start, until the current one holds
    /// `page_cache_keep` bytes of its own.
    previous: Option<(File, u64)>,
    _lock: SpoolLock,
}

impl SpoolWriter {
    /// Opens (creating if needed) the spool in `dir` for appending, taking the writer lock.
    ///
    /// Resumes the last segment; if it ends in a torn line (a crash mid-append) that line is
    /// truncated away, logged as a warning, and counted in [`Self::torn_bytes_dropped`].
    pub fn open(dir: &Path, config: SpoolConfig) -> Result<SpoolWriter, SpoolError> {
        let durable = config.fsync != FsyncPolicy::Never;
        create_dir(dir, durable)?;
        let lock = SpoolLock::acquire(dir)?;
        let seqs = list_segments(dir)?;

        let mut dir_unsynced = false;
        let (segment, file, torn_bytes_dropped) = match seqs.last() {
            Some(&seq) => {
                let path = segment_path(dir, seq);
                let mut file = OpenOptions::new()
                    .read(true)
                    .append(true)
                    .open(&path)
                    .map_err(SpoolError::io("open segment", &path))?;
                let dropped = truncate_torn_tail(&mut file, &path, durable)?;
                (seq, file, dropped)
            }
            None => {
                let file = create_segment(dir, 0)?;
                if durable {
                    sync_dir(dir)?;
                } else {
                    dir_unsynced = true;
                }
                (0, file, 0)
            }
        };

        let path = segment_path(dir, segment);
        let segment_len = file
            .metadata()
            .map_err(SpoolError::io("stat segment", &path))?
            .len();
        let mut total_bytes = segment_len;
        for &seq in seqs.iter().filter(|&&s| s != segment) {
            let path = segment_path(dir, seq);
            match fs::metadata(&path) {
                Ok(m) => total_bytes += m.len(),
                // Deleted since the listing (e.g. by a shipper that is done with it).
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(SpoolError::io("stat segment", path)(e)),
            }
        }

        Ok(SpoolWriter {
            dir: dir.to_owned(),
            config,
            segment,
            file: Some(file),
            segment_len,
            total_bytes,
            unsynced: false,
            last_sync: Instant::now(),
            closed_unsynced: Vec::new(),
            dir_unsynced,
            torn_bytes_dropped,
            sync_error: None,
            buf: Vec::new(),
            page_cache_keep: Some(DEFAULT_PAGE_CACHE_KEEP_BYTES),
            released: 0,
            previous: None,
            _lock: lock,
        })
    }

    /// How much of what it wrote the writer leaves in the page cache: about the last `bytes`
    /// (up to twice that after a segment roll, until the new segment holds `bytes` of its
    /// own), or, with `None`, all of it, for the kernel to reclaim when it wants.
    ///
    /// A spool is written once and read soon after, and at 2,500 calls/s it writes 200 MB/s:
    /// left to the kernel, it fills the node's memory with pages nobody reads again, pushing
    /// out what the engine and harnesses use, and every write lands on a page the kernel had
    /// to find and clear. Released pages are fsynced ones (`posix_fadvise(DONTNEED)` after a
    /// sync), so under [`FsyncPolicy::Never`] nothing is released. A reader further behind
    /// than `bytes` reads from the disk instead; nothing else changes. Default:
    /// [`DEFAULT_PAGE_CACHE_KEEP_BYTES`].
    pub fn keep_in_page_cache(&mut self, bytes: Option<u64>) {
        self.page_cache_keep = bytes;
    }

    /// Appends one record as one line; returns the bytes written (including the newline).
    /// With [`FsyncPolicy::Always`] the record is on disk when this returns.
    pub fn append(&mut self, record: &CaptureRecord) -> Result<u64, SpoolError> {
        self.append_batch(std::slice::from_ref(record))
    }

    /// Appends several records with a single `write` and at most one fsync (group commit).
    /// All lines go to the same segment. Returns the bytes written.
    ///
    /// On error none of `records` is in the spool (see the type's docs), so the caller may
    /// retry the same batch, or drop it, without leaving a torn or duplicate line. Retry with
    /// exactly the same records to keep what readers may have glimpsed before a cut (the same
    /// bytes at the same offset) valid.
    pub fn append_batch(&mut self, records: &[CaptureRecord]) -> Result<u64, SpoolError> {
        let lines = self.append_batch_at(records)?;
        Ok(lines.iter().map(|l| l.len).sum())
    }

    /// [`Self::append_batch`], returning where each record's line was written (for a
    /// [`crate::Handoff`]).
    pub fn append_batch_at(
        &mut self,
        records: &[CaptureRecord],
    ) -> Result<Vec<LineAt>, SpoolError> {
        self.write_batch_at(records.len(), |i, buf, dir| {
            encode_line(&records[i], buf).map_err(|source| SpoolError::Serialize {
                dir: dir.to_owned(),
                record_id: records[i].record_id.clone(),
                source,
            })
        })
    }

    /// Appends records already encoded: each of `lines` is one record's JSON as a reader
    /// decodes it (the caller decoded it: `tokentap worker` stores received lines as they
    /// came), without its newline. A line holding a newline would be two lines to a reader,
    /// so the batch is refused whole ([`SpoolError::NotOneLine`]). Otherwise as
    /// [`Self::append_batch_at`].
    pub fn append_encoded_at(&mut self, lines: &[&[u8]]) -> Result<Vec<LineAt>, SpoolError> {
        self.write_batch_at(lines.len(), |i, buf, dir| {
            if memchr::memchr(b'\n', lines[i]).is_some() {
                return Err(SpoolError::NotOneLine {
                    dir: dir.to_owned(),
                    index: i,
                });
            }
            buf.extend_from_slice(lines[i]);
            buf.push(b'\n');
            Ok(())
        })
    }

    /// Puts `n` lines into the buffer with `line` (given the spool's directory for its error;
    /// one that fails writes nothing), then writes them with one `write`; returns where each
    /// line was written.
    fn write_batch_at(
        &mut self,
        n: usize,
        mut line: impl FnMut(usize, &mut Vec<u8>, &Path) -> Result<(), SpoolError>,
    ) -> Result<Vec<LineAt>, SpoolError> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        let mut lens = Vec::with_capacity(n);
        for i in 0..n {
            let start = buf.len();
            if let Err(e) = line(i, &mut buf, &self.dir) {
                self.buf = buf;
                return Err(e);
            }
            lens.push((buf.len() - start) as u64);
        }
        let result = self.write_lines(&buf);
        self.buf = buf;
        result?;
        // The batch went to one segment and ends where the writer now stands.
        let end = self.position();
        let mut offset = end.offset - lens.iter().sum::<u64>();
        Ok(lens
            .into_iter()
            .map(|len| {
                let at = LineAt {
                    position: SpoolPosition {
                        segment: end.segment,
                        offset,
                    },
                    len,
                };
                offset += len;
                at
            })
            .collect())
    }

    fn write_lines(&mut self, lines: &[u8]) -> Result<u64, SpoolError> {
        let len = lines.len() as u64;
        if len == 0 {
            return Ok(0);
        }
        let result = self.try_write_lines(lines);
        if result.is_err() {
            // Cut now what may have landed, so readers see it for as short a time as possible;
            // if the cut fails too, `reopen` repeats it before the next write. Either way let go
            // of the file: it may be the thing that broke (and a read-only remount waits for
            // every writable file on the file system to close).
            if let Some(file) = self.file.take() {
                let _ = file.set_len(self.segment_len);
            }
        }
        result
    }

    fn try_write_lines(&mut self, lines: &[u8]) -> Result<u64, SpoolError> {
        let len = lines.len() as u64;
        self.reopen()?;
        if self.segment_len > 0 && self.segment_len + len > self.config.segment_max_bytes {
            self.roll()?;
        }
        let path = self.segment_path();
        let file = self.file.as_mut().expect("reopen or roll left a file open");
        file.write_all(lines)
            .map_err(SpoolError::io("write segment", &path))?;
        match self.config.fsync {
            // The batch counts as written only once it is on disk. If the fsync fails, the
            // caller is told the batch failed and the lines are cut (by `write_lines`): after
            // a failed fsync Linux may drop the dirty pages and report the next fsync clean,
            // so only writing the bytes again makes them durable, and without the cut that
            // retry would duplicate them.
            FsyncPolicy::Always => {
                file.sync_data().map_err(SpoolError::io("fsync", &path))?;
                self.unsynced = false;
                self.last_sync = Instant::now();
                self.release_page_cache(self.segment_len + len);
            }
            FsyncPolicy::Interval(_) => self.unsynced = true,
            FsyncPolicy::Never => self.unsynced = true,
        }
        self.segment_len += len;
        self.total_bytes += len;
        if matches!(self.config.fsync, FsyncPolicy::Interval(_)) {
            // These lines are written, whatever the fsync says: failing the append would make
            // the caller write them again. A failed sync is kept for `take_sync_error`, and
            // retried one interval later.
            if let Err(e) = self.sync_if_due() {
                self.sync_error = Some(e);
            }
        }
        Ok(len)
    }

    /// After a failed append: opens the current segment again and cuts it back to the end of
    /// its last acknowledged line, and makes a new segment's directory entry durable if that
    /// failed before. Nothing to do while the writer is healthy.
    fn reopen(&mut self) -> Result<(), SpoolError> {
        let durable = self.config.fsync != FsyncPolicy::Never;
        if durable && self.dir_unsynced {
            sync_dir(&self.dir)?;
            self.dir_unsynced = false;
        }
        if self.file.is_some() {
            return Ok(());
        }
        let path = self.segment_path();
        let mut file = match OpenOptions::new().read(true).append(true).open(&path) {
            Ok(f) => f,
            // Removed while we were not holding it (by hand: the shipper removes only
            // finished segments): start it again rather than fail forever.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                tracing::warn!(segment = %path.display(), "the current spool segment disappeared; starting it again");
                self.total_bytes = self.total_bytes.saturating_sub(self.segment_len);
                self.segment_len = 0;
                let file = create_segment(&self.dir, self.segment)?;
                self.file = Some(file);
                self.dir_unsynced = true;
                if durable {
                    sync_dir(&self.dir)?;
                    self.dir_unsynced = false;
                }
                return Ok(());
            }
            Err(e) => return Err(SpoolError::io("open segment", &path)(e)),
        };
        let len = file
            .metadata()
            .map_err(SpoolError::io("stat segment", &path))?
            .len();
        if len > self.segment_len {
            // What a failed append left behind (complete lines or not): not acknowledged, so
            // not records; the caller retries or counts them lost.
            file.set_len(self.segment_len)
                .map_err(SpoolError::io("cut a failed append from", &path))?;
            if durable {
                file.sync_data().map_err(SpoolError::io("fsync", &path))?;
            }
            tracing::info!(segment = %path.display(), cut_bytes = len - self.segment_len, "cut the remains of a failed spool append");
        } else if len < self.segment_len {
            // Shortened by someone else: trust the file, keeping it on a line boundary.
            let dropped = truncate_torn_tail(&mut file, &path, durable)?;
            let now = len - dropped;
            tracing::warn!(segment = %path.display(), expected = self.segment_len, found = now, "the current spool segment is shorter than written; continuing after its last line");
            self.total_bytes = self.total_bytes.saturating_sub(self.segment_len - now);
            self.segment_len = now;
        }
        self.file = Some(file);
        Ok(())
    }

    /// Closes the current segment and starts the next one.
    fn roll(&mut self) -> Result<(), SpoolError> {
        let durable = self.config.fsync != FsyncPolicy::Never;
        if self.unsynced {
            // Under Always/Interval a finished segment is complete on disk before its successor
            // exists, so readers and recovery only ever see a torn line in the last segment.
            if durable {
                self.sync_current()?;
            } else {
                self.closed_unsynced.push(self.segment);
            }
        }
        let next = self.segment + 1;
        let file = create_segment(&self.dir, next)?;
        if durable && self.page_cache_keep.is_some() {
            // Synced above: its unreleased tail is released once the next segment holds
            // enough of its own.
            let older = std::mem::replace(
                &mut self.previous,
                self.file.take().map(|f| (f, self.released)),
            );
            if let Some((file, from)) = older {
                drop_cached(&file, from, 0);
            }
        }
        // Switch to the new segment as soon as it exists, before its directory entry is
        // synced: if that sync fails, `reopen` repeats it before the next write, whereas
        // staying on the old segment would try to create the existing file again forever.
        self.switch_to(next, file);
        self.dir_unsynced = true;
        if durable {
            sync_dir(&self.dir)?;
            self.dir_unsynced = false;
        }
        Ok(())
    }

    fn switch_to(&mut self, segment: u64, file: File) {
        self.file = Some(file);
        self.segment = segment;
        self.segment_len = 0;
        self.released = 0;
        self.unsynced = false;
    }

    /// Releases from the page cache what was written (and fsynced: `synced_len` bytes of the
    /// current segment) before the last `page_cache_keep` bytes. Advice only: the kernel
    /// drops what is clean and unmapped, and a failure changes nothing but memory.
    fn release_page_cache(&mut self, synced_len: u64) {
        let Some(keep) = self.page_cache_keep else {
            return;
        };
        if synced_len >= keep {
            if let Some((file, from)) = self.previous.take() {
                drop_cached(&file, from, 0);
            }
        }
        // In whole mebibytes: the kernel drops only whole pages (and whole large folios),
        // and one call per mebibyte written is plenty.
        let upto = synced_len.saturating_sub(keep) & !(RELEASE_ALIGN - 1);
        if upto > self.released {
            if let Some(file) = &self.file {
                drop_cached(file, self.released, upto - self.released);
                self.released = upto;
            }
        }
    }

    /// Makes everything appended so far durable (all segments and the directory entries),
    /// whatever the policy. Call it on shutdown; drop does it too except under `Never`.
    pub fn sync(&mut self) -> Result<(), SpoolError> {
        while let Some(&seq) = self.closed_unsynced.first() {
            let path = segment_path(&self.dir, seq);
            match File::open(&path).and_then(|f| f.sync_data()) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(SpoolError::io("fsync", path)(e)),
            }
            self.closed_unsynced.remove(0);
        }
        if self.unsynced {
            self.sync_current()?;
        }
        if self.dir_unsynced {
            sync_dir(&self.dir)?;
            self.dir_unsynced = false;
        }
        Ok(())
    }

    /// Under [`FsyncPolicy::Interval`], fsyncs if there are unsynced bytes and the interval
    /// since the last fsync has passed; returns whether it did. Call this when idle (e.g. on a
    /// channel receive timeout of [`Self::sync_deadline`]) so the last records before a lull
    /// do not stay unsynced until the next append.
    pub fn sync_if_due(&mut self) -> Result<bool, SpoolError> {
        match self.sync_deadline() {
            Some(deadline) if Instant::now() >= deadline => {
                self.sync_current()?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// When [`Self::sync_if_due`] will next have work: `Some` only under `Interval` with
    /// unsynced bytes.
    pub fn sync_deadline(&self) -> Option<Instant> {
        match self.config.fsync {
            FsyncPolicy::Interval(d) if self.unsynced => {
                Some(self.last_sync.checked_add(d).unwrap_or_else(Instant::now))
            }
            _ => None,
        }
    }

    fn sync_current(&mut self) -> Result<(), SpoolError> {
        // fdatasync: the file size is data for this purpose, timestamps are not worth a flush.
        let path = self.segment_path();
        let result = match &self.file {
            Some(f) => f.sync_data(),
            // Let go of after a failed append; the page cache still holds what it had.
            None => File::open(&path).and_then(|f| f.sync_data()),
        };
        // Also after a failure: the next attempt comes one interval later, not in a busy loop.
        self.last_sync = Instant::now();
        result.map_err(SpoolError::io("fsync", path))?;
        self.unsynced = false;
        self.release_page_cache(self.segment_len);
        Ok(())
    }

    fn segment_path(&self) -> PathBuf {
        segment_path(&self.dir, self.segment)
    }

    /// The spool directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The settings the writer was opened with.
    pub fn config(&self) -> &SpoolConfig {
        &self.config
    }

    /// Bytes in all segments (as found at open plus everything appended since), for a metric.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Where the next byte would go if no roll happens: the current segment and its length.
    pub fn position(&self) -> SpoolPosition {
        SpoolPosition {
            segment: self.segment,
            offset: self.segment_len,
        }
    }

    /// Bytes of a torn final line removed by crash recovery in [`Self::open`] (0 if none).
    pub fn torn_bytes_dropped(&self) -> u64 {
        self.torn_bytes_dropped
    }

    /// The error of an interval fsync that failed inside an append that still succeeded (its
    /// lines are in the segment; only their durability is in doubt), once. The sync is
    /// retried one interval later.
    pub fn take_sync_error(&mut self) -> Option<SpoolError> {
        self.sync_error.take()
    }

    /// Whether anything appended is still waiting for an fsync.
    pub fn has_unsynced(&self) -> bool {
        self.unsynced || !self.closed_unsynced.is_empty()
    }
}

impl Drop for SpoolWriter {
    fn drop(&mut self) {
        if self.config.fsync != FsyncPolicy::Never {
            if let Err(e) = self.sync() {
                tracing::warn!(error = %e, "fsync of spool on close failed");
            }
        }
    }
}

/// Creates the spool directory if missing (`0700`, or tightens an existing one of ours); fsyncs its parent so the directory itself survives.
fn create_dir(dir: &Path, durable: bool) -> Result<(), SpoolError> {
    if dir.is_dir() {
        return owner_only::tighten_dir(dir)
            .map_err(SpoolError::io("tighten spool directory", dir));
    }
    owner_only::create_dir_all(dir).map_err(SpoolError::io("create spool directory", dir))?;
    if durable {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            sync_dir(parent)?;
        }
    }
    Ok(())
}

/// Creates segment `seq` (it must not exist). The caller makes its directory entry durable
/// (`sync_dir`), without which a power loss could lose the whole file even after its data was
/// fsynced.
fn create_segment(dir: &Path, seq: u64) -> Result<File, SpoolError> {
    let path = segment_path(dir, seq);
    owner_only::options()
        .read(true)
        .append(true)
        .create_new(true)
        .open(&path)
        .map_err(SpoolError::io("create segment", &path))
}

/// Releases are made in steps of this many bytes (a multiple of any page size), so a
/// writer releases once per 1 MiB written at most.
const RELEASE_ALIGN: u64 = 1024 * 1024;

/// `posix_fadvise(DONTNEED)` of `len` bytes of `file` from `from` (`len` 0: to its end).
fn drop_cached(file: &File, from: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(from), Ok(len)) = (libc::off_t::try_from(from), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: plain syscall on a file descriptor this `File` owns for the call's duration.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), from, len, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        tracing::debug!(error = %io::Error::from_raw_os_error(rc), "releasing written spool pages failed");
    }
}

fn sync_dir(dir: &Path) -> Result<(), SpoolError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(SpoolError::io("fsync directory", dir))
}
