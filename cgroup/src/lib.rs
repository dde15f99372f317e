//! cgroups, in one place, for everything in tokentap that puts processes in them or looks
//! them up: the eBPF connect redirect (attached to a run's or a workload's cgroup v2
//! directory), the rollout node's per-sample resource limits (v2, or the v1 per-controller
//! hierarchies of hybrid hosts), and the node agent's cgroup-id → workload lookup.
//!
//! - [`hierarchy`]: where the hierarchies are mounted and where this process sits in them;
//! - [`dir`]: a cgroup directory's processes, taking one down, names that carry their
//!   creator's pid and the removal of those a killed process left;
//! - [`run_cgroup`]: a v2 cgroup made for one run (`<cgroup2>/tokentap/<name>`) or an existing
//!   one (a pod's);
//! - [`limited`]: a cgroup with memory, CPU and process limits, on whichever hierarchy offers
//!   each controller;
//! - [`join`]: a child joins cgroups between fork and exec, so nothing it starts escapes;
//! - [`walk`]: cgroup v2 ids (directory inodes) and finding one below a directory.

pub mod dir;
pub mod hierarchy;
pub mod join;
pub mod limited;
pub mod run_cgroup;
pub mod walk;

pub use dir::creator_pid;
pub use hierarchy::{cgroup2_mount, own_cgroup};
pub use join::{join_on_spawn, join_on_spawn_std, procs_file};
pub use limited::{LimitedCgroup, Limits};
pub use run_cgroup::{Cgroup, CgroupError};
