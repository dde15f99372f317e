//! Which workload a cgroup id belongs to. The kernel program reports the cgroup of the task that
//! connected (the cgroup v2 id, which is its directory's inode number); that is the workload's
//! own cgroup or one below it (a pod's container, a process that made a child cgroup). Found by
//! walking the tracked directories, then cached.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::workload::WorkloadKey;

/// How deep below a tracked cgroup a connecting task's cgroup is looked for (pod → container
/// → a runtime's own sub-cgroups).
const MAX_DEPTH: usize = 6;
/// Directories looked at per walk, so a workload that makes cgroups without end cannot make
/// each lookup slow.
const MAX_VISITED: usize = 4096;
/// Cached ids; past it the cache starts over (ids of ended workloads are also dropped with them).
const MAX_CACHED: usize = 65536;

/// Who owns a cgroup id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    Workload(WorkloadKey),
    /// Below the capture parent but not to be captured (an unlabelled container).
    NotCaptured,
}

/// The cgroup id of a directory.
pub fn cgroup_id(dir: &Path) -> std::io::Result<u64> {
    Ok(std::fs::metadata(dir)?.ino())
}

/// Cgroup ids seen, by owner.
#[derive(Default)]
pub struct CgroupIds {
    owners: HashMap<u64, Owner>,
}

impl CgroupIds {
    pub fn get(&self, id: u64) -> Option<&Owner> {
        self.owners.get(&id)
    }

    pub fn insert(&mut self, id: u64, owner: Owner) {
        if self.owners.len() >= MAX_CACHED {
            self.owners.clear();
        }
        self.owners.insert(id, owner);
    }

    /// Forgets every id of `key` (the workload ended; its ids may be reused).
    pub fn forget(&mut self, key: &WorkloadKey) {
        self.owners
            .retain(|_, o| !matches!(o, Owner::Workload(k) if k == key));
    }
}

/// Finds the directory with cgroup id `id` at or below `top`: the path of the first level
/// below `top` it sits in (or `top` itself), and its own path.
pub fn find_below(top: &Path, id: u64) -> Option<(PathBuf, PathBuf)> {
    if cgroup_id(top).ok()? == id {
        return Some((top.to_owned(), top.to_owned()));
    }
    let mut visited = 0;
    let mut stack: Vec<(PathBuf, PathBuf, usize)> = children(top)
        .into_iter()
        .map(|c| (c.clone(), c, 1))
        .collect();
    while let Some((first, dir, depth)) = stack.pop() {
        visited += 1;
        if visited > MAX_VISITED {
            return None;
        }
        if cgroup_id(&dir).ok() == Some(id) {
            return Some((first, dir));
        }
        if depth < MAX_DEPTH {
            stack.extend(
                children(&dir)
                    .into_iter()
                    .map(|c| (first.clone(), c, depth + 1)),
            );
        }
    }
    None
}

/// The sub-directories (child cgroups) of `dir`; symlinks are not followed.
fn children(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nested_directory_is_found_with_its_first_level() {
        let root = tempfile::tempdir().unwrap();
        let pod = root.path().join("pod1");
        let leaf = pod.join("c1/inner");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::create_dir_all(pod.join("c2")).unwrap();
        let id = cgroup_id(&leaf).unwrap();
        let (first, found) = find_below(root.path(), id).unwrap();
        assert_eq!(first, pod);
        assert_eq!(found, leaf);
        assert_eq!(
            find_below(&pod, cgroup_id(&pod).unwrap()).unwrap().1,
            pod,
            "the top itself"
        );
        assert!(find_below(&pod.join("c2"), id).is_none());
    }

    #[test]
    fn forgetting_a_workload_drops_only_its_ids() {
        let (a, b) = (WorkloadKey::pod("a"), WorkloadKey::pod("b"));
        let mut ids = CgroupIds::default();
        ids.insert(1, Owner::Workload(a.clone()));
        ids.insert(2, Owner::Workload(a.clone()));
        ids.insert(3, Owner::Workload(b.clone()));
        ids.insert(4, Owner::NotCaptured);
        ids.forget(&a);
        assert_eq!(ids.get(1), None);
        assert_eq!(ids.get(3), Some(&Owner::Workload(b)));
        assert_eq!(ids.get(4), Some(&Owner::NotCaptured));
    }
}
