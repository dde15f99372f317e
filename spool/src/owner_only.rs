//! Files and directories only the node's own user may read: records and traces hold prompts,
//! tool output and sometimes secrets, and the CA key can impersonate any host to the agents.
//!
//! Files are created `0600` and directories `0700` (the mode is set at creation, so there is
//! no window in which another user could open them). An existing directory is tightened to
//! `0700` when it is ours; a shared one (sticky, like `/tmp`, or another user's) is left as it is.

use std::fs::{DirBuilder, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

pub const FILE_MODE: u32 = 0o600;
pub const DIR_MODE: u32 = 0o700;

/// `OpenOptions` that create files `0600` (existing files keep their mode).
pub fn options() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(FILE_MODE);
    o
}

/// Creates `dir` and its missing parents `0700`, and tightens `dir` itself to `0700` if it
/// already existed with a wider mode and belongs to this user.
pub fn create_dir_all(dir: &Path) -> io::Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)?;
    tighten_dir(dir)
}

/// Sets an existing directory of ours to `0700`. Leaves sticky (shared, e.g. `/tmp`) and other
/// users' directories alone.
pub fn tighten_dir(dir: &Path) -> io::Result<()> {
    let meta = std::fs::metadata(dir)?;
    let mode = meta.mode() & 0o7777;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let ours = meta.uid() == unsafe { libc::geteuid() };
    if mode & 0o077 == 0 || !ours || mode & 0o1000 != 0 {
        return Ok(());
    }
    tracing::info!(
        dir = %dir.display(),
        from = format!("{mode:o}"),
        "directory tightened to 0700: it holds captured data"
    );
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & !0o077))
}

/// Writes `bytes` to `path`, creating it `0600` (an existing file is truncated and set to
/// `0600` too).
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let mut f = options()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    f.write_all(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().mode() & 0o777
    }

    #[test]
    fn created_owner_only_and_existing_dirs_tightened() {
        let t = tempfile::tempdir().unwrap();
        let deep = t.path().join("a/b/c");
        create_dir_all(&deep).unwrap();
        assert_eq!(mode(&t.path().join("a")), 0o700);
        assert_eq!(mode(&deep), 0o700);

        let wide = t.path().join("wide");
        std::fs::create_dir(&wide).unwrap();
        std::fs::set_permissions(&wide, std::fs::Permissions::from_mode(0o755)).unwrap();
        create_dir_all(&wide).unwrap();
        assert_eq!(mode(&wide), 0o700);

        let sticky = t.path().join("shared");
        std::fs::create_dir(&sticky).unwrap();
        std::fs::set_permissions(&sticky, std::fs::Permissions::from_mode(0o1777)).unwrap();
        create_dir_all(&sticky).unwrap();
        assert_eq!(
            std::fs::metadata(&sticky).unwrap().mode() & 0o7777,
            0o1777,
            "a shared sticky directory is left alone"
        );

        let f = deep.join("f");
        std::fs::write(&f, b"old").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        write(&f, b"new").unwrap();
        assert_eq!(mode(&f), 0o600);
        options()
            .write(true)
            .create_new(true)
            .open(deep.join("g"))
            .unwrap();
        assert_eq!(mode(&deep.join("g")), 0o600);
    }
}
