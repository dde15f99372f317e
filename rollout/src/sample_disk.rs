//! A sample's own file system, capped in size (`serve --sample-disk-mb`): a sparse ext4 image
//! under `data/disks/`, loop-mounted over the sample's directory from the start of its INIT
//! to its end. Everything the sample writes — its working copy, HOME, TMPDIR, the evaluation
//! copy, the logs its agent and evaluator fill — lands in it, so a sample that writes without
//! end gets ENOSPC and the node's disk does not fill. Blocks and inodes are the image's; the
//! image takes on disk only what was written.
//!
//! At the end the node's own files worth keeping (traces, the tails of the logs) are copied
//! out, the file system is unmounted and its image removed, and the kept files are put back
//! in the (now plain) sample directory, where the API, the viewer and deliveries find them.
//!
//! Root only (mount and loop devices); `mkfs.ext4` (e2fsprogs) and `mount` (util-linux) on
//! the node. Blocking calls (mkfs, mount): run them off the async workers.

use std::fs::OpenOptions;
use std::io::{self, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

/// The node's files kept from a sample's file system when it ends.
const KEPT: &[&str] = &["traces.jsonl", "setup.log", "agent.log", "eval.log"];

/// The most of each kept log that stays (its end): a sample's logs are as long as its disk
/// allows, and what is worth reading after the end is how it ended.
const KEPT_LOG_BYTES: u64 = 4 << 20;

/// The smallest cap: ext4's own metadata and a working copy's first files need room.
pub const MIN_DISK_MB: u64 = 16;

/// Where the images live: beside the samples, never inside a sample's directory.
fn images_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("disks")
}

/// A sample's mounted file system; unmounted (its kept files put back) on [`release`] or drop.
///
/// [`release`]: SampleDisk::release
#[derive(Debug)]
pub struct SampleDisk {
    dir: PathBuf,
    image: PathBuf,
    mounted: bool,
}

impl SampleDisk {
    /// Mounts a fresh file system of `mb` MiB over `dir` (made if missing, keeping its mode),
    /// its image in `data_dir`'s `disks/`. A file system already mounted there (an earlier
    /// attempt of the same sample) is released first.
    pub fn mount(data_dir: &Path, dir: &Path, name: &str, mb: u64) -> anyhow::Result<SampleDisk> {
        if mb < MIN_DISK_MB {
            bail!("a sample disk of {mb} MiB is too small (at least {MIN_DISK_MB})");
        }
        std::fs::create_dir_all(dir)?;
        if is_mount_point(dir)? {
            unmount(dir)?;
        }
        let images = images_dir(data_dir);
        std::fs::create_dir_all(&images)?;
        std::fs::set_permissions(&images, std::fs::Permissions::from_mode(0o700))?;
        let image = images.join(format!("{name}.img"));
        let _ = std::fs::remove_file(&image);
        // Sparse: the size is the cap, not what the image takes.
        let bytes = mb
            .checked_mul(1 << 20)
            .context("the sample disk size overflows")?;
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&image)
            .and_then(|f| f.set_len(bytes))
            .with_context(|| format!("creating {}", image.display()))?;
        let mut disk = SampleDisk {
            dir: dir.to_owned(),
            image,
            mounted: false,
        };
        let mode = std::fs::metadata(dir)?.permissions().mode() & 0o7777;
        // No journal (a sample's files die with it), no blocks reserved for root (the node
        // writes its files as root), inode tables made lazily (mkfs stays fast at any size).
        run(
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-m", "0", "-O", "^has_journal"])
                .args(["-E", "lazy_itable_init=1,nodiscard,root_owner=0:0"])
                .arg(&disk.image),
            "mkfs.ext4",
        )?;
        run(
            Command::new("mount")
                .args(["-o", "loop,nosuid,nodev,noatime"])
                .arg(&disk.image)
                .arg(dir),
            "mount",
        )?;
        disk.mounted = true;
        let _ = std::fs::remove_dir(dir.join("lost+found"));
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))?;
        Ok(disk)
    }

    /// Copies out the node's files worth keeping, unmounts, removes the image and puts the
    /// kept files back into the plain directory. Idempotent.
    pub fn release(&mut self) -> anyhow::Result<()> {
        if !self.mounted {
            return Ok(());
        }
        let keep = self.image.with_extension("keep");
        let _ = std::fs::remove_dir_all(&keep);
        std::fs::create_dir(&keep)?;
        std::fs::set_permissions(&keep, std::fs::Permissions::from_mode(0o700))?;
        for name in KEPT {
            if let Err(e) = copy_kept(&self.dir.join(name), &keep.join(name)) {
                tracing::warn!(file = %self.dir.join(name).display(), error = %e, "a sample's file not kept");
            }
        }
        unmount(&self.dir)?;
        self.mounted = false;
        let _ = std::fs::remove_file(&self.image);
        for entry in std::fs::read_dir(&keep)? {
            let entry = entry?;
            std::fs::rename(entry.path(), self.dir.join(entry.file_name()))?;
        }
        std::fs::remove_dir(&keep)?;
        Ok(())
    }
}

impl Drop for SampleDisk {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::error!(dir = %self.dir.display(), error = %format!("{e:#}"), "releasing a sample's disk");
        }
    }
}

/// Copies the end of `from` (at most [`KEPT_LOG_BYTES`], a regular file, no link followed:
/// task code could write where the node's files are) to a new `to` (0600).
fn copy_kept(from: &Path, to: &Path) -> io::Result<()> {
    let mut f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(from)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let is_log = from.extension().is_some_and(|e| e == "log");
    if is_log && meta.len() > KEPT_LOG_BYTES {
        f.seek(SeekFrom::End(-(KEPT_LOG_BYTES as i64)))?;
    }
    let mut out = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)?;
    if is_log && meta.len() > KEPT_LOG_BYTES {
        writeln!(
            out,
            "[tokentap: the first {} bytes of this log were not kept]",
            meta.len() - KEPT_LOG_BYTES
        )?;
    }
    io::copy(&mut f, &mut out)?;
    Ok(())
}

/// Whether something is mounted at `dir` (it is in this process's mount table).
fn is_mount_point(dir: &Path) -> io::Result<bool> {
    let canonical = std::fs::canonicalize(dir)?;
    Ok(mount_points()?.iter().any(|m| m == &canonical))
}

/// Every mount point in this process's mount namespace (`/proc/self/mountinfo`, field 5,
/// with its octal escapes undone).
fn mount_points() -> io::Result<Vec<PathBuf>> {
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount_path)
        .collect())
}

fn unescape_mount_path(field: &str) -> PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Unmounts `dir` (lazily when something still holds it: the sample's processes are dead by
/// now, a file handle in a dying one is not worth failing the sample for).
fn unmount(dir: &Path) -> anyhow::Result<()> {
    if run(Command::new("umount").arg(dir), "umount").is_err() {
        run(Command::new("umount").arg("-l").arg(dir), "umount -l")?;
    }
    Ok(())
}

/// Unmounts every sample file system a killed node left under `data_dir`'s `samples/` and
/// removes every image (nothing runs in them any more: their samples are re-queued and get
/// fresh ones). Returns the directories unmounted.
pub fn release_stale(data_dir: &Path) -> Vec<PathBuf> {
    let samples = match std::fs::canonicalize(data_dir.join("samples")) {
        Ok(s) => s,
        Err(_) => return Vec::new(),
    };
    let mut released = Vec::new();
    for m in mount_points().unwrap_or_default() {
        if m.starts_with(&samples) && m != samples {
            match unmount(&m) {
                Ok(()) => released.push(m),
                Err(e) => {
                    tracing::error!(dir = %m.display(), error = %format!("{e:#}"), "unmounting a stale sample disk")
                }
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(images_dir(data_dir)) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                let _ = std::fs::remove_dir_all(&p);
            } else {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
    released
}

/// Checks that this node can give samples capped disks (root, loop devices, mkfs.ext4): a
/// small one made, mounted and released under `data_dir`, so `serve` fails at start, not at
/// every sample.
pub fn check_available(data_dir: &Path) -> anyhow::Result<()> {
    let probe = data_dir.join("samples").join(".disk-probe");
    let mut disk = SampleDisk::mount(data_dir, &probe, ".disk-probe", MIN_DISK_MB)
        .context("--sample-disk-mb needs a root node with loop devices, mkfs.ext4 and mount")?;
    disk.release()?;
    let _ = std::fs::remove_dir(&probe);
    Ok(())
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(
            unescape_mount_path(r"/data/a\040b/samples/x\134y"),
            PathBuf::from(r"/data/a b/samples/x\y")
        );
        assert_eq!(unescape_mount_path(r"/a\04"), PathBuf::from(r"/a\04"));
    }

    /// Root (mount, loop devices): a test that cannot have it says so (a failure in CI).
    fn root() -> bool {
        tokentap_e2e::privileged::runs(
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } == 0 {
                Ok(())
            } else {
                Err("sample disks need root".into())
            },
        )
    }

    /// Writes past the cap fail with ENOSPC inside the disk, and nothing lands on the data
    /// directory's file system; at the end the logs' tails and the traces are kept, nothing
    /// else, and the image is gone. Positive control: the same write on the plain directory
    /// succeeds.
    #[test]
    fn a_sample_disk_caps_what_the_sample_writes_and_keeps_the_nodes_files() {
        if !root() {
            return;
        }
        let data = tempfile::tempdir().unwrap();
        let dir = data.path().join("samples").join("s1");
        let write_mb = |at: &Path, mb: usize| -> io::Result<()> {
            let mut f = std::fs::File::create(at)?;
            let chunk = vec![7u8; 1 << 20];
            for _ in 0..mb {
                f.write_all(&chunk)?;
            }
            f.sync_all()
        };
        // Positive control: the plain directory takes it.
        std::fs::create_dir_all(&dir).unwrap();
        write_mb(&dir.join("big"), 40).unwrap();
        std::fs::remove_file(dir.join("big")).unwrap();

        let mut disk = SampleDisk::mount(data.path(), &dir, "s1", 24).unwrap();
        assert!(is_mount_point(&dir).unwrap());
        let err = write_mb(&dir.join("big"), 40).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        let image = data.path().join("disks/s1.img");
        let on_disk = std::fs::metadata(&image).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert!(on_disk.blocks() * 512 <= 25 << 20, "{}", on_disk.blocks());
        std::fs::remove_file(dir.join("big")).unwrap();
        std::fs::write(dir.join("traces.jsonl"), "{}\n").unwrap();
        write_mb(&dir.join("agent.log"), 6).unwrap();
        std::fs::create_dir(dir.join("work")).unwrap();
        std::fs::write(dir.join("work/answer.txt"), "x").unwrap();
        // A link where a kept file goes is not followed.
        std::os::unix::fs::symlink("/etc/hostname", dir.join("eval.log")).unwrap();

        disk.release().unwrap();
        assert!(!is_mount_point(&dir).unwrap());
        assert!(!image.exists());
        let mut kept: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        kept.sort();
        assert_eq!(kept, ["agent.log", "traces.jsonl"]);
        assert_eq!(
            std::fs::read_to_string(dir.join("traces.jsonl")).unwrap(),
            "{}\n"
        );
        let log = std::fs::read(dir.join("agent.log")).unwrap();
        assert!(log.starts_with(b"[tokentap: the first 2097152 bytes"));
        assert!(log.len() < (KEPT_LOG_BYTES as usize) + 100);
        // Released twice is once.
        disk.release().unwrap();
        drop(disk);
    }

    /// A node killed with sample disks mounted: the next start unmounts them and removes
    /// their images.
    #[test]
    fn stale_sample_disks_are_released_at_start() {
        if !root() {
            return;
        }
        let data = tempfile::tempdir().unwrap();
        let dir = data.path().join("samples").join("s2");
        let disk = SampleDisk::mount(data.path(), &dir, "s2", 16).unwrap();
        std::mem::forget(disk); // as a killed node leaves it
        assert!(is_mount_point(&dir).unwrap());
        let released = release_stale(data.path());
        assert_eq!(released, [std::fs::canonicalize(&dir).unwrap()]);
        assert!(!is_mount_point(&dir).unwrap());
        assert_eq!(
            std::fs::read_dir(data.path().join("disks"))
                .unwrap()
                .count(),
            0
        );
    }
}
