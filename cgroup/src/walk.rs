//! cgroup v2 ids: a cgroup's id is its directory's inode number (what the kernel's
//! `bpf_get_current_cgroup_id` reports). Finding which directory below a tree has an id walks
//! it, bounded in depth and in directories visited, so a workload that makes cgroups without
//! end cannot make each lookup slow.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// How deep below the top a cgroup is looked for (pod → container → a runtime's own
/// sub-cgroups).
pub const MAX_DEPTH: usize = 6;
/// Directories looked at per walk.
pub const MAX_VISITED: usize = 4096;

/// The cgroup id of a directory.
pub fn cgroup_id(dir: &Path) -> std::io::Result<u64> {
    Ok(std::fs::metadata(dir)?.ino())
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
    fn the_walk_stops_at_its_depth() {
        let root = tempfile::tempdir().unwrap();
        let mut deep = root.path().to_owned();
        for i in 0..=MAX_DEPTH {
            deep = deep.join(format!("d{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        assert!(find_below(root.path(), cgroup_id(&deep).unwrap()).is_none());
        let shallower = deep.parent().unwrap();
        assert!(find_below(root.path(), cgroup_id(shallower).unwrap()).is_some());
    }
}
