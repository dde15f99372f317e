//! The task a trainer submits (POST /v1/rollouts): rollout/src/task.rs's `TaskSpec` parsed
//! from the body, then the node's `over_ceilings` check, as rollout/src/api.rs `submit` does.
//! task.rs (and runner.rs, which it checks commands with) is compiled in here (#[path]) rather
//! than through the rollout crate, whose other dependencies (eBPF loader, redb, …) do not parse
//! tasks.
//! Invariants: a parsed task is stored as JSON and reads back equal; a task the node admits
//! asks for 1..=max samples, budgets within the ceiling, and limits within the node's.
#![no_main]

#[allow(dead_code)]
#[path = "../../rollout/src/task.rs"]
mod task;
// task.rs checks a task's commands with the node's runner (what runs, resolved by the node).
#[allow(dead_code)]
#[path = "../../rollout/src/runner.rs"]
mod runner;

use libfuzzer_sys::fuzz_target;
use task::{NodeCeilings, TaskSpec};
use tokentap_cgroup::Limits;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = serde_json::from_slice::<TaskSpec>(data) else {
        return;
    };
    let stored = serde_json::to_vec(&spec).expect("a task serializes");
    let back: TaskSpec = serde_json::from_slice(&stored).expect("and reads back");
    assert_eq!(back, spec);

    let ceilings = NodeCeilings::default();
    let node = Limits {
        memory_mb: Some(4096),
        cpus: Some(2.0),
        pids: Some(512),
    };
    for limits in [Limits::default(), node] {
        if spec.over_ceilings(&ceilings, &limits).is_ok() {
            assert!((1..=ceilings.max_samples).contains(&spec.num_samples));
            let b = &spec.budgets;
            for v in [b.session_s, b.agent_s, b.eval_s] {
                assert!(v <= ceilings.max_budget_s);
            }
            let a = &spec.limits;
            if let (Some(x), Some(n)) = (a.memory_mb, limits.memory_mb) {
                assert!(x <= n);
            }
            if let (Some(x), Some(n)) = (a.cpus, limits.cpus) {
                assert!(x > 0.0 && x <= n);
            }
            if let (Some(x), Some(n)) = (a.pids, limits.pids) {
                assert!(x <= n);
            }
        }
    }
});
