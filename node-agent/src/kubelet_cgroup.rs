//! Where kubelet puts a pod's cgroup. Kubelet names pod cgroups after the pod's UID under a
//! QoS-class parent, in one of two layouts (its `--cgroup-driver`):
//! - cgroupfs: `kubepods/pod<uid>` (Guaranteed), `kubepods/burstable/pod<uid>`,
//!   `kubepods/besteffort/pod<uid>`;
//! - systemd: `kubepods.slice/kubepods-pod<uid_>.slice`,
//!   `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice`, … with the
//!   UID's dashes as underscores.
//!
//! The same relative paths hold in a cgroup v2 mount and in a v1-hybrid host's unified
//! hierarchy (`/sys/fs/cgroup/unified`), which is where the redirect attaches. Which layout a
//! node uses is found by looking, and distributions that move the root (kind, k3s) are covered
//! by a bounded scan for the pod's directory name.

use std::path::{Path, PathBuf};

/// A pod's QoS class (`status.qosClass`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl QosClass {
    pub fn parse(s: &str) -> Option<QosClass> {
        match s {
            "Guaranteed" => Some(QosClass::Guaranteed),
            "Burstable" => Some(QosClass::Burstable),
            "BestEffort" => Some(QosClass::BestEffort),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PodCgroupError {
    #[error("pod UID {0:?} is not a UID (only hex digits and dashes)")]
    BadUid(String),
    #[error("cgroup not found for pod {uid} under {root}: tried {tried}, and no directory named after it within {depth} levels")]
    NotFound {
        uid: String,
        root: String,
        tried: String,
        depth: usize,
    },
}

/// How deep the fallback scan looks (kind/k3s put kubepods one or two levels down).
const SCAN_DEPTH: usize = 4;
/// Directories the fallback scan visits at most.
const SCAN_LIMIT: usize = 20_000;

/// The candidate paths (relative to the cgroup2 mount) for a pod, most likely first.
pub fn candidates(uid: &str, qos: Option<QosClass>) -> Result<Vec<PathBuf>, PodCgroupError> {
    check_uid(uid)?;
    let u = uid.replace('-', "_");
    let one = |q: QosClass| -> [String; 2] {
        match q {
            QosClass::Guaranteed => [
                format!("kubepods/pod{uid}"),
                format!("kubepods.slice/kubepods-pod{u}.slice"),
            ],
            QosClass::Burstable => [
                format!("kubepods/burstable/pod{uid}"),
                format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
            ],
            QosClass::BestEffort => [
                format!("kubepods/besteffort/pod{uid}"),
                format!(
                    "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"
                ),
            ],
        }
    };
    let order: Vec<QosClass> = match qos {
        Some(q) => vec![q],
        None => vec![
            QosClass::Burstable,
            QosClass::BestEffort,
            QosClass::Guaranteed,
        ],
    };
    Ok(order.into_iter().flat_map(one).map(PathBuf::from).collect())
}

/// The pod's cgroup directory relative to `root` (the cgroup2 mount): the first candidate that
/// exists, else a directory named after the pod found by a bounded scan.
pub fn find_pod_cgroup(
    root: &Path,
    uid: &str,
    qos: Option<QosClass>,
) -> Result<PathBuf, PodCgroupError> {
    let tried = candidates(uid, qos)?;
    if let Some(found) = tried.iter().find(|c| root.join(c).is_dir()) {
        return Ok(found.clone());
    }
    let u = uid.replace('-', "_");
    let names = [format!("pod{uid}"), format!("pod{u}.slice")];
    if let Some(found) = scan(root, &names) {
        return Ok(found);
    }
    Err(PodCgroupError::NotFound {
        uid: uid.to_owned(),
        root: root.display().to_string(),
        tried: tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        depth: SCAN_DEPTH,
    })
}

fn check_uid(uid: &str) -> Result<(), PodCgroupError> {
    // Pod UIDs come from the API; they become path components, so nothing but a UID's
    // characters may pass.
    let ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(PodCgroupError::BadUid(uid.to_owned()))
    }
}

/// A directory (relative to `root`) whose name is `pod<uid>` or ends with `-pod<uid_>.slice`.
fn scan(root: &Path, names: &[String; 2]) -> Option<PathBuf> {
    let mut visited = 0;
    let mut stack = vec![(root.to_owned(), 0usize)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            visited += 1;
            if visited > SCAN_LIMIT {
                return None;
            }
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name == names[0] || name.ends_with(&format!("-{}", names[1])) {
                return e.path().strip_prefix(root).ok().map(Path::to_owned);
            }
            if depth + 1 < SCAN_DEPTH {
                stack.push((e.path(), depth + 1));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "8d3c6b2e-1f4a-4c5d-9e7f-0a1b2c3d4e5f";

    #[test]
    fn each_layout_and_qos_class_is_found() {
        let u = UID.replace('-', "_");
        let layouts = [
            (Some(QosClass::Guaranteed), format!("kubepods/pod{UID}")),
            (
                Some(QosClass::Burstable),
                format!("kubepods/burstable/pod{UID}"),
            ),
            (
                Some(QosClass::BestEffort),
                format!("kubepods/besteffort/pod{UID}"),
            ),
            (
                Some(QosClass::Guaranteed),
                format!("kubepods.slice/kubepods-pod{u}.slice"),
            ),
            (
                Some(QosClass::Burstable),
                format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"),
            ),
            (
                Some(QosClass::BestEffort),
                format!(
                    "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice"
                ),
            ),
        ];
        for (qos, layout) in layouts {
            // A v2 mount, and a v1-hybrid host's unified hierarchy: the same relative paths.
            for mount in ["", "unified"] {
                let tmp = tempfile::tempdir().unwrap();
                let root = tmp.path().join(mount);
                std::fs::create_dir_all(root.join(&layout)).unwrap();
                assert_eq!(
                    find_pod_cgroup(&root, UID, qos).unwrap(),
                    PathBuf::from(&layout)
                );
                // Unknown QoS class: found among all candidates.
                assert_eq!(
                    find_pod_cgroup(&root, UID, None).unwrap(),
                    PathBuf::from(&layout)
                );
            }
        }
    }

    #[test]
    fn a_moved_kubepods_root_is_found_by_scanning() {
        let tmp = tempfile::tempdir().unwrap();
        let u = UID.replace('-', "_");
        let layout = format!(
            "kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{u}.slice"
        );
        std::fs::create_dir_all(tmp.path().join(&layout)).unwrap();
        assert_eq!(
            find_pod_cgroup(tmp.path(), UID, Some(QosClass::BestEffort)).unwrap(),
            PathBuf::from(layout)
        );
    }

    #[test]
    fn not_found_names_what_was_tried_and_bad_uids_never_become_paths() {
        let tmp = tempfile::tempdir().unwrap();
        let e = find_pod_cgroup(tmp.path(), UID, Some(QosClass::Burstable))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cgroup not found") && e.contains(&format!("kubepods/burstable/pod{UID}")),
            "{e}"
        );
        for bad in ["../../etc", "abc/def", "", "pod x", &"a".repeat(65)] {
            assert!(
                matches!(
                    find_pod_cgroup(tmp.path(), bad, None),
                    Err(PodCgroupError::BadUid(_))
                ),
                "{bad:?}"
            );
        }
    }
}
