//! The pipeline end to end with the `command` preset and evaluator: a tiny project with a
//! failing test, one policy that fixes it (reward 1) and one that does not (reward 0), a
//! hanging agent killed at its budget, an agent that rewrites the test file (not rewarded when
//! the task names its test files), samples running concurrently.

use std::sync::Arc;
use std::time::Duration;

use tokentap_e2e::node_api::stored_results;
use tokentap_rollout::pipeline::{now_ms, Pipeline, PipelineConfig};
use tokentap_rollout::store::Store;
use tokentap_rollout::task::{Outcome, Sample, TaskSpec};

fn project(dir: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("calc.py"), "def add(a, b):\n    return a - b\n").unwrap();
    std::fs::write(
        dir.join("test_calc.py"),
        "import unittest\nfrom calc import add\n\nclass T(unittest.TestCase):\n    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n",
    )
    .unwrap();
}

fn task(project: &std::path::Path, id: &str, script: &str, samples: u32, agent_s: u64) -> TaskSpec {
    guarded_task(project, id, script, samples, agent_s, &[])
}

/// A task whose evaluation restores `test_files` from the original workspace first.
fn guarded_task(
    project: &std::path::Path,
    id: &str,
    script: &str,
    samples: u32,
    agent_s: u64,
    test_files: &[&str],
) -> TaskSpec {
    serde_json::from_value(serde_json::json!({
        "task_id": id,
        "instruction": "make the test pass",
        "workspace": {"dir": {"path": project}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": {"kind": "command", "command": "python3 -m unittest -q", "test_files": test_files},
        "num_samples": samples,
        "budgets": {"agent_s": agent_s}
    }))
    .unwrap()
}

async fn wait_results(store: &Store, n: usize) -> Vec<Sample> {
    stored_results(store, n, Duration::from_secs(60)).await
}

const CHEAT: &str = "printf 'import unittest\\nclass T(unittest.TestCase):\\n    def test_add(self):\\n        pass\\n' > test_calc.py";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewards_follow_the_tests_and_a_hanging_agent_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("project");
    project(&proj);
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let config = PipelineConfig {
        data_dir: dir.path().join("data"),
        init_workers: 2,
        run_workers: 4,
        post_workers: 2,
        max_attempts: 2,
        capture: None,
        ..PipelineConfig::new(std::path::PathBuf::new())
    };
    let pipeline = Pipeline::start(store.clone(), config.clone())
        .await
        .unwrap();
    let fix = "sed -i 's/a - b/a + b/' calc.py";
    for spec in [
        task(&proj, "fixes", fix, 3, 60),
        task(&proj, "does-nothing", "true", 2, 60),
        task(&proj, "hangs", "sleep 30", 1, 1),
        // Rewrites the test so that it passes without fixing anything.
        guarded_task(&proj, "cheats", CHEAT, 1, 60, &["test_calc.py"]),
        task(&proj, "cheats-unguarded", CHEAT, 1, 60),
    ] {
        let (rollout, samples) = store.submit(spec, now_ms()).unwrap();
        pipeline.submit(rollout, samples);
    }
    let results = wait_results(&store, 8).await;
    let by_task = |task: &str| -> Vec<Outcome> {
        results
            .iter()
            .filter(|s| store.rollout(&s.rollout_id).unwrap().0.spec.task_id == task)
            .map(|s| s.outcome.clone().unwrap())
            .collect()
    };
    assert_eq!(
        by_task("fixes"),
        vec![Outcome::Completed { reward: 1.0 }; 3]
    );
    assert_eq!(
        by_task("does-nothing"),
        vec![Outcome::Completed { reward: 0.0 }; 2]
    );
    assert_eq!(
        by_task("cheats"),
        vec![Outcome::Completed { reward: 0.0 }],
        "the original test file is restored before evaluation"
    );
    assert_eq!(
        by_task("cheats-unguarded"),
        vec![Outcome::Completed { reward: 1.0 }],
        "without test_files the cheat works: the guard is what stops it"
    );
    let hang = by_task("hangs");
    assert!(
        matches!(&hang[..], [Outcome::Timeout { reward, reason }] if *reward == 0.0 && reason.contains("1 s agent")),
        "{hang:?}"
    );
    // Each sample worked in its own copy: the original project is untouched.
    let original = std::fs::read_to_string(proj.join("calc.py")).unwrap();
    assert!(original.contains("a - b"));
}

/// An agent with a memory limit runs in its own cgroup (it can see it) and is OOM-killed past
/// the limit; the sample says so and scores 0 with `session-completed`. The limits apply to
/// everything the agent starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_put_each_agent_in_its_own_cgroup() {
    let dir = tempfile::tempdir().unwrap();
    let proj = dir.path().join("project");
    std::fs::create_dir_all(&proj).unwrap();
    let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
    let config = PipelineConfig::new(dir.path().join("data"));
    let pipeline = Pipeline::start(store.clone(), config).await.unwrap();
    let spec = |id: &str, script: &str| -> TaskSpec {
        serde_json::from_value(serde_json::json!({
            "task_id": id,
            "instruction": "x",
            "workspace": {"dir": {"path": proj}},
            "harness": {"name": "command", "argv": ["sh", "-c", script]},
            "evaluator": {"kind": "session-completed"},
            "limits": {"memory_mb": 64, "pids": 64}
        }))
        .unwrap()
    };
    for s in [
        spec("fits", "cat /proc/self/cgroup > cgroup.txt"),
        spec(
            "hog",
            "python3 -c \"b = b'x' * (300 << 20); print(len(b))\"",
        ),
    ] {
        let (rollout, samples) = store.submit(s, now_ms()).unwrap();
        pipeline.submit(rollout, samples);
    }
    let results = wait_results(&store, 2).await;
    for s in &results {
        let agent = s.agent.clone().expect("an agent report");
        match s.task_id.as_str() {
            "fits" => {
                assert_eq!(s.outcome, Some(Outcome::Completed { reward: 1.0 }));
                assert!(!agent.oom_killed);
                let seen = std::fs::read_to_string(
                    dir.path()
                        .join("data/samples")
                        .join(&s.sample_id)
                        .join("work/cgroup.txt"),
                )
                .unwrap();
                assert!(
                    seen.contains(&format!("tokentap-{}", s.sample_id)),
                    "{seen}"
                );
            }
            "hog" => {
                assert_eq!(s.outcome, Some(Outcome::Completed { reward: 0.0 }));
                assert!(agent.oom_killed, "{agent:?}");
                assert_ne!(agent.exit_code, Some(0));
                let peak = agent.peak_memory_bytes.unwrap();
                assert!(peak <= 64 << 20, "peak {peak}");
            }
            other => panic!("{other}"),
        }
    }
    // The cgroups went with their samples.
    for s in &results {
        let found = std::process::Command::new("find")
            .args(["/sys/fs/cgroup", "-maxdepth", "6", "-name"])
            .arg(format!("tokentap-{}", s.sample_id))
            .output()
            .unwrap();
        assert!(
            found.stdout.is_empty(),
            "{}",
            String::from_utf8_lossy(&found.stdout)
        );
    }
}

/// Prewarming: with one RUN slot and `prewarm = 1`, the next sample's working copy is made
/// while the current agent runs; with `prewarm = 0`, only once the slot is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_prepares_the_next_sample_while_the_agent_runs() {
    for prewarm in [0, 1] {
        let dir = tempfile::tempdir().unwrap();
        let proj = dir.path().join("project");
        project(&proj);
        let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
        let config = PipelineConfig {
            run_workers: 1,
            prewarm,
            ..PipelineConfig::new(dir.path().join("data"))
        };
        let pipeline = Pipeline::start(store.clone(), config).await.unwrap();
        let (rollout, samples) = store
            .submit(task(&proj, "t", "sleep 0.5", 2, 60), now_ms())
            .unwrap();
        pipeline.submit(rollout, samples);
        let mut r = wait_results(&store, 2).await;
        r.sort_by_key(|s| s.stage_started_ms[1]);
        let (first_run_end, second_init) = (r[0].stage_ended_ms[1], r[1].stage_started_ms[0]);
        if prewarm == 0 {
            assert!(second_init >= first_run_end, "prewarm 0: {r:?}");
        } else {
            assert!(second_init < first_run_end, "prewarm 1: {r:?}");
        }
    }
}
