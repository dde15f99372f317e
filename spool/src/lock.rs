//! The one-writer rule: an advisory `flock` on `DIR/spool.lock`.
//!
//! Two writers appending to one segment would interleave and tear each other's lines, so the
//! writer takes an exclusive lock for its lifetime. Readers never lock: they only ever trust
//! complete lines. The lock is advisory (it does not stop `echo >> segment`) and, being
//! `flock`, may not work across machines on network filesystems.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::SpoolError;

/// Name of the lock file inside a spool directory.
pub const LOCK_FILE_NAME: &str = "spool.lock";

/// Held for the lifetime of a writer; the OS releases the lock when the file is closed,
/// including when the process dies, so a crash never leaves a stale lock behind.
#[derive(Debug)]
pub(crate) struct SpoolLock {
    _file: File,
}

impl SpoolLock {
    pub(crate) fn acquire(dir: &Path) -> Result<SpoolLock, SpoolError> {
        let path: PathBuf = dir.join(LOCK_FILE_NAME);
        // Held open read-only (flock needs no write access): a file open for writing on a file
        // system blocks remounting it read-only, and the writer lets go of its segment after a
        // failed append precisely so that the spool's file system can be remounted.
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                crate::owner_only::options()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .map_err(SpoolError::io("create lock file", &path))?;
                File::open(&path).map_err(SpoolError::io("open lock file", &path))?
            }
            Err(e) => return Err(SpoolError::io("open lock file", &path)(e)),
        };
        // A lock its writer let go of can still be held for a moment: a `flock` belongs to the
        // open file, and a child process forked (by any thread) while the writer held it keeps
        // a copy of the descriptor until it execs. So a writer reopening its spool while the
        // process starts a program (a harness, `mount`) could be refused by itself; a real
        // second writer holds on, and is refused after the grace period.
        let deadline = Instant::now() + RELEASE_GRACE;
        loop {
            match file.try_lock() {
                Ok(()) => return Ok(SpoolLock { _file: file }),
                Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(TryLockError::WouldBlock) => {
                    return Err(SpoolError::Locked {
                        dir: dir.to_owned(),
                        lock: path,
                    })
                }
                Err(TryLockError::Error(e)) => return Err(SpoolError::io("lock", path)(e)),
            }
        }
    }
}

/// How long a held lock is tried again before the writer is refused.
const RELEASE_GRACE: Duration = Duration::from_millis(250);
