//! Which workload a cgroup id belongs to. The kernel program reports the cgroup of the task that
//! connected (the cgroup v2 id, which is its directory's inode number); that is the workload's
//! own cgroup or one below it (a pod's container, a process that made a child cgroup). Found by
//! walking the tracked directories ([`tokentap_cgroup::walk`]), then cached.

use std::collections::HashMap;

use crate::workload::WorkloadKey;

/// Cached ids; past it the cache starts over (ids of ended workloads are also dropped with them).
const MAX_CACHED: usize = 65536;

/// Who owns a cgroup id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    Workload(WorkloadKey),
    /// Below the capture parent but not to be captured (an unlabelled container).
    NotCaptured,
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

#[cfg(test)]
mod tests {
    use super::*;

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
