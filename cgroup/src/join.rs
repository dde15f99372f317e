//! A child joins cgroups between fork and exec, so that nothing it starts (not even its first
//! instruction) runs outside them: the redirect and the limits apply from the start.

use std::ffi::CString;
use std::io;
use std::path::Path;

/// The `cgroup.procs` file of the cgroup at `dir`, ready for [`join_on_spawn`].
pub fn procs_file(dir: &Path) -> io::Result<CString> {
    CString::new(dir.join("cgroup.procs").as_os_str().as_encoded_bytes()).map_err(io::Error::other)
}

/// Makes a tokio command's child join the cgroups of `procs` (from [`procs_file`]) before it
/// executes anything.
pub fn join_on_spawn(cmd: &mut tokio::process::Command, procs: Vec<CString>) {
    // SAFETY: `joiner` is async-signal-safe (see there).
    unsafe {
        cmd.pre_exec(joiner(procs));
    }
}

/// [`join_on_spawn`] for a `std` command.
pub fn join_on_spawn_std(cmd: &mut std::process::Command, procs: Vec<CString>) {
    use std::os::unix::process::CommandExt;
    // SAFETY: `joiner` is async-signal-safe (see there).
    unsafe {
        cmd.pre_exec(joiner(procs));
    }
}

/// The code the forked child runs before exec. It must be async-signal-safe (the parent may
/// have held a lock at fork): it only formats into a stack buffer and calls open, write and
/// close; nothing allocates.
fn joiner(procs: Vec<CString>) -> impl FnMut() -> io::Result<()> + Send + Sync + 'static {
    move || {
        let mut buf = [0u8; 20];
        // SAFETY: getpid has no preconditions.
        let mut pid = unsafe { libc::getpid() } as u64;
        let mut i = buf.len();
        loop {
            i -= 1;
            buf[i] = b'0' + (pid % 10) as u8;
            pid /= 10;
            if pid == 0 {
                break;
            }
        }
        for p in &procs {
            // SAFETY: a valid NUL-terminated path; the fd is closed below.
            let fd = unsafe { libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: writes from a live stack buffer within its bounds.
            let n = unsafe { libc::write(fd, buf[i..].as_ptr().cast(), buf.len() - i) };
            // SAFETY: closes the fd opened above.
            unsafe { libc::close(fd) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}
