//! A uid of its own for each sample's sandboxed task code (a root node): the kernel counts
//! some resources per uid, not per process or sandbox — inotify instances and watches
//! (`fs.inotify.max_user_instances`, 128 by default), `RLIMIT_NPROC`, POSIX message queues,
//! pending signals, keyrings — so samples sharing one uid starve each other (one sample's 128
//! `inotify_init` calls left the next with `EMFILE`). A sample leases a uid from the node's
//! `--sandbox-uid-range` at INIT (its set-up, agent and evaluation all run as it, and the
//! trees it writes are handed to it) and gives it back when it ends, once no process of that
//! uid is left (any left is killed first; a uid that cannot be cleared is not reused).

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

/// Where the nodes of one host take their uids' locks: one file per uid, held with `flock` by
/// the node whose sample runs as it. Every node on a host starts from the same default range,
/// and a node that gives a uid back kills whatever still runs as it, so without a host-wide
/// lease two nodes' samples would share a uid and one node's end of a sample would kill the
/// other's (three nodes on one machine did). The kernel drops a dead node's locks. Root's,
/// 0700: sandboxed code cannot reach it.
pub const LOCK_DIR: &str = "/run/tokentap/sandbox-uids";

/// How often a sample waiting for a uid looks again for one another node gave back (a return
/// by this node wakes it at once).
const OTHER_NODES_POLL: Duration = Duration::from_millis(500);

/// The uids a node's samples run as, one sample at a time each, and none that another node
/// of the host holds.
pub struct UidPool {
    free: Mutex<BTreeSet<u32>>,
    returned: Notify,
    first: u32,
    last: u32,
    locks: PathBuf,
    /// Locks of uids whose processes outlived SIGKILL, held for the node's life so that no
    /// node of the host reuses them.
    stuck: Mutex<Vec<File>>,
}

impl UidPool {
    /// The pool of `first..=last`, leased host-wide through [`LOCK_DIR`]; refuses root, an
    /// empty range and one over 1,048,576 uids.
    pub fn new(first: u32, last: u32) -> anyhow::Result<Arc<UidPool>> {
        UidPool::with_lock_dir(first, last, Path::new(LOCK_DIR))
    }

    /// [`UidPool::new`] with the uids' locks in `locks` (created 0700).
    pub fn with_lock_dir(first: u32, last: u32, locks: &Path) -> anyhow::Result<Arc<UidPool>> {
        use anyhow::Context as _;
        use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
        anyhow::ensure!(
            first >= 1 && first <= last && last < u32::MAX,
            "the sandbox uid range {first}-{last} must be within 1-{}, first to last",
            u32::MAX - 1
        );
        anyhow::ensure!(
            last - first < 1 << 20,
            "the sandbox uid range {first}-{last} is over 1,048,576 uids"
        );
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(locks)
            .and_then(|()| std::fs::set_permissions(locks, std::fs::Permissions::from_mode(0o700)))
            .with_context(|| {
                format!(
                    "the sandbox uids' lock directory {} (the host's nodes lease uids through it)",
                    locks.display()
                )
            })?;
        Ok(Arc::new(UidPool {
            free: Mutex::new((first..=last).collect()),
            returned: Notify::new(),
            first,
            last,
            locks: locks.to_owned(),
            stuck: Mutex::new(Vec::new()),
        }))
    }

    /// `FIRST-LAST` (or one uid).
    pub fn parse_range(s: &str) -> Result<(u32, u32), String> {
        let (a, b) = s.split_once('-').unwrap_or((s, s));
        let n = |x: &str| {
            x.trim().parse::<u32>().map_err(|e| {
                format!("{x:?} in {s:?}: {e} (expected FIRST-LAST, e.g. 200000-200999)")
            })
        };
        Ok((n(a)?, n(b)?))
    }

    pub fn range(&self) -> (u32, u32) {
        (self.first, self.last)
    }

    /// How many uids this node is not using now (another node may hold some of them).
    pub fn free(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// The lowest uid neither this node nor another of the host uses, waiting for one when
    /// none is. Whatever a dead holder left running as it is killed first.
    pub async fn lease(self: &Arc<Self>) -> UidLease {
        loop {
            let returned = self.returned.notified();
            if let Some(lease) = self.try_lease() {
                let uid = lease.uid;
                match tokio::task::spawn_blocking(move || clear_uid(uid).map(|()| lease)).await {
                    Ok(Ok(lease)) => return lease,
                    Ok(Err(left)) => {
                        tracing::error!(uid, ?left, "processes a dead node left running as a sandbox uid outlived SIGKILL; the uid is not used");
                        continue;
                    }
                    Err(e) => panic!("clearing a sandbox uid: {e}"),
                }
            }
            tracing::info!(
                "every sandbox uid of {}-{} is in use on this host; a sample waits for one",
                self.first,
                self.last
            );
            let _ = tokio::time::timeout(OTHER_NODES_POLL, returned).await;
        }
    }

    /// The lowest uid neither this node nor another of the host uses, if any (its processes
    /// not cleared: [`UidPool::lease`] does that).
    pub fn try_lease(self: &Arc<Self>) -> Option<UidLease> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let (uid, lock) = free.iter().find_map(|&uid| Some((uid, self.lock(uid)?)))?;
        free.remove(&uid);
        Some(UidLease {
            uid,
            pool: Some(self.clone()),
            lock: Some(lock),
        })
    }

    /// `uid`'s host-wide lock, unless another node holds it.
    fn lock(&self, uid: u32) -> Option<File> {
        use std::os::unix::fs::OpenOptionsExt as _;
        let path = self.locks.join(uid.to_string());
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| tracing::error!(path = %path.display(), "a sandbox uid's lock: {e}"))
            .ok()?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => Some(file),
            Err(rustix::io::Errno::WOULDBLOCK) => None,
            Err(e) => {
                tracing::error!(path = %path.display(), "locking a sandbox uid: {e}");
                None
            }
        }
    }

    /// Puts `uid` back once no process runs as it (killing any left); a uid whose processes
    /// outlive the kill stays out of the pool, and locked for the host's other nodes.
    fn give_back(&self, uid: u32, lock: Option<File>) {
        if let Err(left) = clear_uid(uid) {
            tracing::error!(
                uid,
                ?left,
                "processes of a sample's uid outlived SIGKILL; the uid is not reused"
            );
            self.stuck
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(lock);
            return;
        }
        // Unlocked before it is free here: this node's next lease opens the file anew, and
        // flock refuses a second open of one process as it refuses another process.
        drop(lock);
        self.free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(uid);
        self.returned.notify_waiters();
        self.returned.notify_one();
    }
}

/// One sample's uid, locked host-wide, returned to its pool on drop (off the async workers:
/// the return scans `/proc`).
pub struct UidLease {
    pub uid: u32,
    pool: Option<Arc<UidPool>>,
    lock: Option<File>,
}

impl std::fmt::Debug for UidLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UidLease({})", self.uid)
    }
}

impl Drop for UidLease {
    fn drop(&mut self) {
        let (Some(pool), uid, lock) = (self.pool.take(), self.uid, self.lock.take()) else {
            return;
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn_blocking(move || pool.give_back(uid, lock));
            }
            Err(_) => pool.give_back(uid, lock),
        }
    }
}

/// The processes whose real, effective, saved or file-system uid is `uid`.
pub fn processes_of(uid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .is_some_and(|ids| ids.split_whitespace().any(|i| i == uid.to_string()))
            })
        })
        .collect()
}

/// Kills every process of `uid` until none is left (about 2 s at most); Err: those left.
fn clear_uid(uid: u32) -> Result<(), Vec<i32>> {
    for _ in 0..100 {
        let left = processes_of(uid);
        if left.is_empty() {
            return Ok(());
        }
        for pid in &left {
            // SAFETY: kill(2) on a process running as a uid of the node's pool (task code).
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match processes_of(uid) {
        left if left.is_empty() => Ok(()),
        left => Err(left),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_bad_ones_are_refused() {
        assert_eq!(UidPool::parse_range("200000-200999"), Ok((200000, 200999)));
        assert_eq!(UidPool::parse_range("65534"), Ok((65534, 65534)));
        assert!(UidPool::parse_range("a-b").is_err());
        let locks = tempfile::tempdir().unwrap();
        let pool = |a, b| UidPool::with_lock_dir(a, b, locks.path());
        assert!(pool(0, 10).is_err());
        assert!(pool(10, 9).is_err());
        assert!(pool(1, 1 << 21).is_err());
    }

    /// Concurrent samples get distinct uids; one that ends gives its uid back, and a sample
    /// waiting for a uid gets it then.
    #[tokio::test]
    async fn concurrent_samples_get_distinct_uids_and_give_them_back() {
        let locks = tempfile::tempdir().unwrap();
        let pool = UidPool::with_lock_dir(300_100, 300_101, locks.path()).unwrap();
        let a = pool.lease().await;
        let b = pool.lease().await;
        assert_eq!((a.uid, b.uid), (300_100, 300_101));
        assert!(pool.try_lease().is_none());
        let waiting = tokio::spawn({
            let pool = pool.clone();
            async move { pool.lease().await.uid }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(a);
        let got = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, 300_100);
    }

    /// Two nodes of one host (two pools over one lock directory) never lease one uid at once:
    /// the second gets the next uid, and the first's uid once the first gives it back. The
    /// control: pools with locks of their own (no host-wide lease) both take the lowest.
    #[tokio::test]
    async fn two_nodes_of_one_host_never_share_a_uid() {
        let host = tempfile::tempdir().unwrap();
        let a = UidPool::with_lock_dir(300_200, 300_201, host.path()).unwrap();
        let b = UidPool::with_lock_dir(300_200, 300_201, host.path()).unwrap();
        let on_a = a.lease().await;
        let on_b = b.lease().await;
        assert_eq!((on_a.uid, on_b.uid), (300_200, 300_201));
        assert!(
            b.try_lease().is_none(),
            "node a's uid is not node b's to take"
        );
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.lease().await.uid }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(on_a);
        let got = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got, 300_200,
            "node a's uid, once given back, found by node b's poll"
        );

        let (one, other) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = UidPool::with_lock_dir(300_300, 300_301, one.path()).unwrap();
        let b = UidPool::with_lock_dir(300_300, 300_301, other.path()).unwrap();
        assert_eq!(
            (a.lease().await.uid, b.lease().await.uid),
            (300_300, 300_300),
            "without one lock directory the host's nodes share the lowest uid"
        );
    }

    #[test]
    fn the_lock_directory_is_roots_alone() {
        use std::os::unix::fs::PermissionsExt as _;
        let host = tempfile::tempdir().unwrap();
        let dir = host.path().join("run/tokentap/sandbox-uids");
        let pool = UidPool::with_lock_dir(300_400, 300_400, &dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let lease = pool.try_lease().unwrap();
        let mode = std::fs::metadata(dir.join("300400"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        drop(lease);
    }
}
