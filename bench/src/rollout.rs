//! `tokentap bench rollout`: a rollout node at saturation on this machine. One group of
//! `--samples` samples is submitted at once to a node — this executable's `tokentap serve`,
//! run as a child process so it is measured as deployed — whose engine is the instant
//! synthetic backend; each agent is the
//! `command` preset making `--turns` model calls with curl, `--think-ms` apart (tool time),
//! then passing its test. The same workload runs without prewarming and with it, side by
//! side: samples per hour, concurrent samples sustained, time in each stage, and how long a
//! free agent slot waits for its next sample (INIT on the critical path, or not).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};
use tokentap_rollout::task::{Outcome, Sample};

use super::instant_backend::InstantBackend;
use super::proxy_child::free_port;
use super::report::Machine;

#[derive(Args)]
pub struct RolloutBenchArgs {
    /// Samples submitted (one group), at once.
    #[arg(long, default_value_t = 12)]
    samples: u32,
    /// Agents running at once.
    #[arg(long, default_value_t = 4)]
    run_workers: usize,
    /// Model calls per agent.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Pause between an agent's calls (its tool and model time), in milliseconds.
    #[arg(long, default_value_t = 2000)]
    think_ms: u64,
    /// Python files in the task's workspace (INIT copies it and byte-compiles it).
    #[arg(long, default_value_t = 150)]
    files: usize,
    /// Prewarm settings compared, in this order [default: 0 and --run-workers].
    #[arg(long, value_delimiter = ',')]
    prewarm: Vec<usize>,
    /// Print the figures as JSON too.
    #[arg(long)]
    json: bool,
}

/// A node under test; killed when dropped, on success, error or panic alike.
pub(crate) struct NodeChild(pub Child);

impl Drop for NodeChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) struct Figures {
    pub prewarm: usize,
    pub wall_s: f64,
    pub completed: usize,
    pub samples_per_hour: f64,
    pub mean_running: f64,
    pub max_running: usize,
    pub slot_utilization: f64,
    /// p50 and p95, seconds: queued, INIT, RUN, POST_RUN.
    pub stages: [(f64, f64); 4],
    /// How long a free agent slot waited for its next sample to start, p50 and mean (s).
    pub slot_gap: (f64, f64),
}

pub fn run(args: RolloutBenchArgs) -> anyhow::Result<()> {
    let m = Machine::here();
    println!(
        "tokentap bench rollout — {} samples of the `command` preset ({} model calls {} ms apart, then a test) on a {}-file workspace, {} agent slots, instant synthetic engine; saturation (all submitted at once); each setting run twice (A B B A) and averaged",
        args.samples, args.turns, args.think_ms, args.files, args.run_workers
    );
    println!(
        "  machine: {} cores ({}), load average at start: {}",
        m.cores, m.cpu, m.load_average
    );
    let settings = if args.prewarm.len() == 2 {
        [args.prewarm[0], args.prewarm[1]]
    } else {
        [0, args.run_workers]
    };
    // A B B A: this VM's speed drifts under sustained load (disk writeback, CPU credit), so
    // each setting is run once early and once late and the two are averaged.
    let mut runs = Vec::new();
    for prewarm in [settings[0], settings[1], settings[1], settings[0]] {
        runs.push(measure(&args, prewarm)?);
    }
    let all = [average(&runs[0], &runs[3]), average(&runs[1], &runs[2])];
    let (a, b) = (&all[0], &all[1]);
    let row = |name: &str, x: String, y: String, ratio: String| {
        println!("  {name:<34} {x:>14} {y:>14} {ratio:>8}");
    };
    println!();
    row(
        "",
        format!("prewarm {}", a.prewarm),
        format!("prewarm {}", b.prewarm),
        "ratio".into(),
    );
    row(
        "samples completed (2 runs)",
        a.completed.to_string(),
        b.completed.to_string(),
        String::new(),
    );
    row(
        "wall time (s)",
        format!("{:.2}", a.wall_s),
        format!("{:.2}", b.wall_s),
        format!("{:.2}", b.wall_s / a.wall_s),
    );
    row(
        "samples per hour",
        format!("{:.0}", a.samples_per_hour),
        format!("{:.0}", b.samples_per_hour),
        format!("{:.2}", b.samples_per_hour / a.samples_per_hour),
    );
    row(
        "agents running, mean / max",
        format!("{:.2} / {}", a.mean_running, a.max_running),
        format!("{:.2} / {}", b.mean_running, b.max_running),
        format!("{:.2}", b.mean_running / a.mean_running),
    );
    row(
        "agent slot utilization",
        format!("{:.0}%", a.slot_utilization * 100.0),
        format!("{:.0}%", b.slot_utilization * 100.0),
        String::new(),
    );
    row(
        "free slot waits for next agent p50/mean (ms)",
        format!("{:.0} / {:.0}", a.slot_gap.0 * 1e3, a.slot_gap.1 * 1e3),
        format!("{:.0} / {:.0}", b.slot_gap.0 * 1e3, b.slot_gap.1 * 1e3),
        String::new(),
    );
    for (i, stage) in ["queued", "INIT", "RUN", "POST_RUN"].iter().enumerate() {
        row(
            &format!("{stage} p50 / p95 (ms)"),
            format!("{:.0} / {:.0}", a.stages[i].0 * 1e3, a.stages[i].1 * 1e3),
            format!("{:.0} / {:.0}", b.stages[i].0 * 1e3, b.stages[i].1 * 1e3),
            String::new(),
        );
    }
    if args.json {
        let j: Vec<_> = all
            .iter()
            .map(|f| {
                json!({
                    "prewarm": f.prewarm, "wall_s": f.wall_s, "completed": f.completed,
                    "samples_per_hour": f.samples_per_hour, "mean_running": f.mean_running,
                    "max_running": f.max_running, "slot_utilization": f.slot_utilization,
                    "stages_p50_p95_s": {"queued": f.stages[0], "init": f.stages[1], "run": f.stages[2], "post_run": f.stages[3]},
                    "slot_gap_p50_mean_s": f.slot_gap,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&j)?);
    }
    Ok(())
}

pub(crate) fn project(dir: &Path, files: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for i in 0..files {
        let body: String = (0..60)
            .map(|j| format!("def f_{i}_{j}(x):\n    return x * {j} + {i}\n\n"))
            .collect();
        std::fs::write(dir.join(format!("mod_{i}.py")), body)?;
    }
    Ok(())
}

fn measure(args: &RolloutBenchArgs, prewarm: usize) -> anyhow::Result<Figures> {
    let tmp = tempfile::tempdir()?;
    let engine = InstantBackend::start(64)?;
    let proj = tmp.path().join("project");
    project(&proj, args.files)?;
    let token = format!("bench-{}", std::process::id());
    let node = NodeSetup {
        engine: format!("http://{}", engine.addr()),
        run_workers: args.run_workers,
        prewarm,
        token: token.clone(),
        extra: Vec::new(),
    }
    .spawn(tmp.path(), "node")?;
    let spec = command_task(&proj, args.samples, args.turns, args.think_ms);
    let samples = run_group(&node, &spec)?;
    drop(node);
    check_completed(&samples)?;
    figures(&samples, prewarm, args.run_workers).context("computing the figures")
}

/// How a node under test is started.
pub(crate) struct NodeSetup {
    pub engine: String,
    pub run_workers: usize,
    pub prewarm: usize,
    pub token: String,
    /// More arguments (`--bus …` for a cluster).
    pub extra: Vec<String>,
}

/// A started node, with where it answers and logs.
pub(crate) struct StartedNode {
    pub child: NodeChild,
    pub base: String,
    pub token: String,
    pub log: std::path::PathBuf,
}

impl StartedNode {
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl NodeSetup {
    /// Starts this executable's `tokentap serve` with its data under `dir/name`; returns
    /// once it answers `/health`.
    pub fn spawn(&self, dir: &Path, name: &str) -> anyhow::Result<StartedNode> {
        let addr = free_port()?;
        let log = dir.join(format!("{name}.log"));
        let exe = std::env::current_exe().context("finding this executable")?;
        let child = NodeChild(
            Command::new(exe)
                .arg("serve")
                .args(["--listen", &addr.to_string()])
                .arg("--data")
                .arg(dir.join(name))
                .arg("--spool")
                .arg(dir.join(format!("{name}-spool")))
                .args(["--backend", &self.engine])
                .args(["--backend-kind", "vllm"])
                .args(["--run-workers", &self.run_workers.to_string()])
                .args(["--prewarm", &self.prewarm.to_string()])
                .args(["--init-workers", "2", "--post-workers", "2"])
                .args(&self.extra)
                .env("TOKENTAP_NODE_TOKEN", &self.token)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?)
                .spawn()
                .context("starting tokentap serve")?,
        );
        let mut node = StartedNode {
            child,
            base: format!("http://{addr}"),
            token: self.token.clone(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(addr).is_err() {
            if let Some(status) = node.child.0.try_wait()? {
                bail!(
                    "the node exited ({status}) at start-up:\n{}",
                    node.log_tail()
                );
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the node was not ready within 30 s:\n{}",
                node.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(node)
    }
}

/// A group of `samples` samples of the `command` preset: `turns` model calls with curl,
/// `think_ms` apart, then a test that passes.
pub(crate) fn command_task(project: &Path, samples: u32, turns: usize, think_ms: u64) -> Value {
    let mut script = String::new();
    for t in 0..turns {
        if t > 0 {
            script.push_str(&format!("sleep {:.3} && ", think_ms as f64 / 1000.0));
        }
        script.push_str(&format!(
            "curl -sS -m 30 \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -d '{}' > /dev/null && ",
            json!({"model": "m", "messages": [{"role": "user", "content": format!("turn {t}")}]})
        ));
    }
    script.push_str("touch ok");
    json!({
        "task_id": "bench",
        "instruction": "bench",
        "workspace": {"dir": {"path": project, "setup": "python3 -m compileall -q ."}},
        "harness": {"name": "command", "argv": ["sh", "-c", script]},
        "evaluator": {"kind": "command", "command": "test -f ok"},
        "num_samples": samples,
    })
}

/// Submits `spec` to `node` and waits for every sample to end (as `node` reports them).
pub(crate) fn run_group(node: &StartedNode, spec: &Value) -> anyhow::Result<Vec<Sample>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (base, token) = (&node.base, &node.token);
    rt.block_on(async {
        let http = reqwest::Client::builder().no_proxy().build()?;
        let submitted: Value = http
            .post(format!("{base}/v1/rollouts"))
            .bearer_auth(token)
            .json(spec)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let id = submitted["rollout_id"]
            .as_str()
            .context("the node's answer to the submission has no rollout_id")?;
        let deadline = Instant::now() + Duration::from_secs(1800);
        loop {
            let mut page: Value = http
                .get(format!("{base}/v1/rollouts/{id}"))
                .bearer_auth(token)
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            let samples: Vec<Sample> = serde_json::from_value(page["samples"].take())?;
            if samples.iter().all(|s| s.outcome.is_some()) {
                return anyhow::Ok(samples);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "the run did not finish in 30 min:\n{}",
                node.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// Every sample completed with reward 1 (the bench's agents always pass).
pub(crate) fn check_completed(samples: &[Sample]) -> anyhow::Result<()> {
    let completed = samples
        .iter()
        .filter(|s| matches!(s.outcome, Some(Outcome::Completed { reward }) if reward == 1.0))
        .count();
    anyhow::ensure!(
        completed == samples.len(),
        "{} of {} samples completed with reward 1; first other: {:?}",
        completed,
        samples.len(),
        samples
            .iter()
            .find(|s| s.outcome != Some(Outcome::Completed { reward: 1.0 }))
    );
    Ok(())
}

fn average(a: &Figures, b: &Figures) -> Figures {
    let m = |x: f64, y: f64| (x + y) / 2.0;
    Figures {
        prewarm: a.prewarm,
        wall_s: m(a.wall_s, b.wall_s),
        completed: a.completed + b.completed,
        samples_per_hour: m(a.samples_per_hour, b.samples_per_hour),
        mean_running: m(a.mean_running, b.mean_running),
        max_running: a.max_running.max(b.max_running),
        slot_utilization: m(a.slot_utilization, b.slot_utilization),
        stages: [0, 1, 2, 3].map(|i| {
            (
                m(a.stages[i].0, b.stages[i].0),
                m(a.stages[i].1, b.stages[i].1),
            )
        }),
        slot_gap: (m(a.slot_gap.0, b.slot_gap.0), m(a.slot_gap.1, b.slot_gap.1)),
    }
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

pub(crate) fn figures(samples: &[Sample], prewarm: usize, slots: usize) -> Option<Figures> {
    let s = |ms: u64| ms as f64 / 1000.0;
    let start = samples.iter().map(|x| x.stage_started_ms[0]).min()?;
    let end = samples.iter().map(|x| x.stage_started_ms[3]).max()?;
    let wall_s = s(end - start);
    // The group was submitted at once, just before the first sample started INIT.
    let span = |from: u64, to: u64| s(to.saturating_sub(from));
    let stage = |f: &dyn Fn(&Sample) -> f64| -> (f64, f64) {
        let v: Vec<f64> = samples.iter().map(f).collect();
        (pct(v.clone(), 0.5), pct(v, 0.95))
    };
    let stages = [
        stage(&|x| span(start, x.stage_started_ms[0])),
        stage(&|x| span(x.stage_started_ms[0], x.stage_ended_ms[0])),
        stage(&|x| span(x.stage_started_ms[1], x.stage_ended_ms[1])),
        stage(&|x| span(x.stage_started_ms[2], x.stage_started_ms[3])),
    ];
    let runs: Vec<(u64, u64)> = samples
        .iter()
        .map(|x| (x.stage_started_ms[1], x.stage_ended_ms[1]))
        .collect();
    let busy: f64 = runs.iter().map(|(a, b)| span(*a, *b)).sum();
    let mut edges: Vec<(u64, i32)> = runs.iter().flat_map(|(a, b)| [(*b, -1), (*a, 1)]).collect();
    edges.sort();
    let (mut now, mut max_running) = (0i32, 0i32);
    for (_, d) in edges {
        now += d;
        max_running = max_running.max(now);
    }
    // Agent slots, greedily: each RUN takes the slot that freed first; the gap is how long
    // that slot sat idle before this agent started (0 for a slot's first agent).
    let mut sorted = runs.clone();
    sorted.sort();
    let mut free: Vec<Option<u64>> = vec![None; slots];
    let mut gaps = Vec::new();
    for (a, b) in sorted {
        let i = (0..slots)
            .min_by_key(|i| free[*i].unwrap_or(0))
            .unwrap_or(0);
        if let Some(f) = free[i] {
            gaps.push(span(f, a));
        }
        free[i] = Some(b);
    }
    let gap_mean = gaps.iter().sum::<f64>() / gaps.len().max(1) as f64;
    Some(Figures {
        prewarm,
        wall_s,
        completed: samples.len(),
        samples_per_hour: samples.len() as f64 / wall_s * 3600.0,
        mean_running: busy / wall_s,
        max_running: max_running as usize,
        slot_utilization: busy / (wall_s * slots as f64),
        stages,
        slot_gap: (pct(gaps, 0.5), gap_mean),
    })
}
