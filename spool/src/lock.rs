//! The one-writer rule: an advisory `flock` on `DIR/spool.lock`.
//!
//! Two writers appending to one segment would interleave and tear each other's lines, so the
//! writer takes an exclusive lock for its lifetime. Readers never lock: they only ever trust
//! complete lines. The lock is advisory (it does not stop `echo >> segment`) and, being
//! `flock`, may not work across machines on network filesystems.

use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};

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
        match file.try_lock() {
            Ok(()) => Ok(SpoolLock { _file: file }),
            Err(TryLockError::WouldBlock) => Err(SpoolError::Locked {
                dir: dir.to_owned(),
                lock: path,
            }),
            Err(TryLockError::Error(e)) => Err(SpoolError::io("lock", path)(e)),
        }
    }
}
