//! A small tmpfs a test mounts for itself, to fill or make read-only under a running spool
//! writer. Mounting needs root: check with `privileged::runs(tmpfs::may_mount())` first.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Whether this process may mount (root), for [`crate::privileged::runs`].
pub fn may_mount() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("mounting a tmpfs needs root".into());
    }
    Ok(())
}

/// A tmpfs of a given size on a fresh temp dir (mode 0700); unmounted on drop, also when
/// the test fails.
pub struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// Mounts one of `size` (`mount -o size=…`: `128k`, `1m`).
    pub fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("temp dir");
        let out = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
            ])
            .arg(dir.path())
            .output()
            .expect("running mount");
        assert!(
            out.status.success(),
            "mount -t tmpfs: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `mount -o remount,MODE`. Read-only is refused (EBUSY) while any file on the tmpfs is
    /// open for writing; a failing spool writer holds none except for an instant per retry,
    /// so this tries for a few seconds.
    pub fn remount(&self, mode: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let out = Command::new("mount")
                .args(["-o", &format!("remount,{mode}")])
                .arg(self.path())
                .output()
                .expect("running mount");
            if out.status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "remount,{mode}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Removes a filler and waits until its space is free again. An unlinked file's space
    /// returns when its last descriptor closes, and a child process forked meanwhile by any
    /// thread of the test binary (another test mounting its tmpfs) holds a copy of every
    /// descriptor until it execs.
    pub fn remove_filler(&self, filler: PathBuf) {
        let before = self.free_bytes();
        std::fs::remove_file(&filler).expect("removing the filler");
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.free_bytes() <= before {
            assert!(
                Instant::now() < deadline,
                "the filler's space never came back"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Bytes free on the file system (`statvfs`).
    fn free_bytes(&self) -> u64 {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(self.path().as_os_str().as_bytes()).expect("no NUL");
        // SAFETY: statvfs writes only into the struct it is given; `path` is NUL-terminated.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
        assert_eq!(rc, 0, "statvfs: {}", std::io::Error::last_os_error());
        st.f_bfree as u64 * st.f_frsize as u64
    }

    /// Fills the file system to the last byte with a filler file; its path.
    pub fn fill(&self) -> PathBuf {
        self.fill_leaving(0)
    }

    /// Fills the file system, then frees `keep` bytes by shrinking the filler; its path.
    pub fn fill_leaving(&self, keep: u64) -> PathBuf {
        let path = self.path().join("filler");
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("creating the filler");
        let chunk = vec![0u8; 4096];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling the tmpfs: {e}"),
            }
        }
        if keep > 0 {
            let len = f.metadata().expect("filler metadata").len();
            f.set_len(len.saturating_sub(keep))
                .expect("shrinking the filler");
        }
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: a proxy may still be running when a failed test unwinds.
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}
