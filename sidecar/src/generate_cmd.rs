//! `tokentap generate`: offline data generation. The rollout node's pipeline runs a task file
//! in batch (no HTTP), with a progress bar; its store lives in OUT/node, so an interrupted
//! run picks up where it stopped (finished samples are kept, running ones re-run). At the
//! end the accepted samples (reward at least `--min-reward`) become an SFT dataset:
//! OUT/sft.jsonl, one row per trace with its messages and token ids, and OUT/report.json
//! with the acceptance rate.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use serde_json::{json, Value};
use tokentap_rollout::pipeline::now_ms;
use tokentap_rollout::task::{Outcome, Sample, TaskSpec};

use crate::serve_cmd::NodeArgs;

#[derive(Args)]
#[command(
    after_help = "Each line of --tasks is a task spec (see `tokentap serve`'s /openapi.json); \
the flags fill or override its harness, num_samples and evaluator, and a relative workspace \
path is taken from the task file's directory.

Examples:
  tokentap generate --tasks tasks.jsonl --harness pi --samples 4 \\
      --evaluator '{\"kind\": \"command\", \"command\": \"python3 -m unittest\"}' \\
      --out ./sft --backend http://127.0.0.1:8080 --backend-kind llamacpp"
)]
pub struct GenerateArgs {
    /// Task specs, one JSON object per line.
    #[arg(long)]
    tasks: PathBuf,
    /// Harness for every task: pi, qwen-code, codex, claude-code.
    #[arg(long)]
    harness: Option<String>,
    /// Samples per task.
    #[arg(long)]
    samples: Option<u32>,
    /// Evaluator for every task, as JSON (e.g. `{"kind": "session-completed"}`).
    #[arg(long)]
    evaluator: Option<String>,
    /// A sample is accepted when it completed with at least this reward.
    #[arg(long, default_value_t = 1.0)]
    min_reward: f64,
    /// Output directory (its `node/` holds the run's state; re-run to resume).
    #[arg(long)]
    out: PathBuf,
    /// No progress bar (log lines instead).
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    node: NodeArgs,
}

pub fn run(mut args: GenerateArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.out)?;
    if args.node.data.is_none() {
        args.node.data = Some(args.out.join("node"));
    }
    if args.node.capture.spool == Path::new(crate::proxy_cmd::DEFAULT_SPOOL) {
        args.node.capture.spool = args.out.join("spool");
    }
    let specs = read_tasks(&args)?;
    let mut parts = args.node.prepare()?;
    let spool_thread = parts.spool_thread.take();
    let rt = crate::runtime::build()?;
    let report = rt.block_on(async {
        let node = args.node.start(parts).await?;
        let store = node.pipeline.store();
        // Resume: a task already submitted in this OUT is not submitted again.
        let submitted_path = args.out.join("submitted.json");
        let mut submitted: HashMap<String, String> = match std::fs::read(&submitted_path) {
            Ok(b) => serde_json::from_slice(&b)?,
            Err(_) => HashMap::new(),
        };
        for spec in specs {
            if submitted.contains_key(&spec.task_id) {
                continue;
            }
            if let Some(why) = node.pipeline.refusal(&spec) {
                anyhow::bail!("task {}: {why}", spec.task_id);
            }
            let task_id = spec.task_id.clone();
            let (rollout, samples) = store.submit(spec, now_ms())?;
            submitted.insert(task_id, rollout.rollout_id.clone());
            // Written after every submit: a crash here re-runs at most nothing twice.
            std::fs::write(&submitted_path, serde_json::to_vec_pretty(&submitted)?)?;
            node.pipeline.submit(rollout, samples);
        }
        let total: usize = submitted
            .values()
            .map(|r| store.rollout(r).map(|(_, s)| s.len()))
            .sum::<Result<usize, _>>()?;
        let bar = if args.quiet {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::new(total as u64)
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} samples ({per_sec}, eta {eta}) {msg}",
            )?
            .progress_chars("=> "),
        );
        // Listening from here on, so a Ctrl-C between two looks is not lost.
        let interrupted = crate::signals::shutdown_signal();
        tokio::pin!(interrupted);
        loop {
            // Enabled before reading, so a sample ending in between still wakes the loop.
            let notified = node.pipeline.finished.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let samples = all_samples(store, &submitted)?;
            let done = samples.iter().filter(|s| s.outcome.is_some()).count();
            let accepted = samples
                .iter()
                .filter(|s| accepted(s, args.min_reward))
                .count();
            bar.set_position(done as u64);
            bar.set_message(format!("{accepted} accepted"));
            if args.quiet {
                tracing::info!(done, total, accepted, "generate");
            }
            if done == total {
                bar.finish();
                return write_dataset(&args.out, &samples, args.min_reward);
            }
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(Duration::from_secs(if args.quiet { 10 } else { 1 })) => {}
                _ = &mut interrupted => {
                    bar.abandon_with_message("interrupted; run the same command again to resume");
                    bail!("interrupted");
                }
            }
        }
    });
    drop(rt);
    if let Some(t) = spool_thread {
        let _ = t.join();
    }
    let report = report?;
    println!(
        "accepted {} of {} samples ({:.1}%); {} SFT rows in {}",
        report["accepted"],
        report["samples"],
        report["acceptance_rate"].as_f64().unwrap_or(0.0) * 100.0,
        report["rows"],
        args.out.join("sft.jsonl").display()
    );
    Ok(())
}

fn read_tasks(args: &GenerateArgs) -> anyhow::Result<Vec<TaskSpec>> {
    let text = std::fs::read_to_string(&args.tasks)
        .with_context(|| format!("reading {}", args.tasks.display()))?;
    let base = args
        .tasks
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let evaluator: Option<Value> = match &args.evaluator {
        Some(e) => Some(serde_json::from_str(e).context("--evaluator is not JSON")?),
        None => None,
    };
    let mut specs = Vec::new();
    let mut seen = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", args.tasks.display(), i + 1);
        let mut v: Value = serde_json::from_str(line).with_context(at)?;
        let o = v
            .as_object_mut()
            .with_context(|| format!("{}: not an object", at()))?;
        if let Some(h) = &args.harness {
            o.insert("harness".into(), json!({"name": h}));
        }
        if let Some(n) = args.samples {
            o.insert("num_samples".into(), json!(n));
        }
        if let Some(e) = &evaluator {
            o.insert("evaluator".into(), e.clone());
        }
        if let Some(Value::String(p)) = o
            .get_mut("workspace")
            .and_then(|w| w.get_mut("dir"))
            .and_then(|d| d.get_mut("path"))
        {
            if Path::new(p.as_str()).is_relative() {
                *p = base.join(&*p).display().to_string();
            }
        }
        let spec: TaskSpec = serde_json::from_value(v).with_context(at)?;
        if !seen.insert(spec.task_id.clone()) {
            bail!("{}: task_id {} appears twice", at(), spec.task_id);
        }
        specs.push(spec);
    }
    if specs.is_empty() {
        bail!("{} has no tasks", args.tasks.display());
    }
    Ok(specs)
}

fn all_samples(
    store: &tokentap_rollout::store::Store,
    submitted: &HashMap<String, String>,
) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    for r in submitted.values() {
        out.extend(store.rollout(r)?.1);
    }
    out.sort_by(|a, b| a.sample_id.cmp(&b.sample_id));
    Ok(out)
}

fn accepted(s: &Sample, min_reward: f64) -> bool {
    matches!(s.outcome, Some(Outcome::Completed { reward }) if reward >= min_reward)
}

/// OUT/sft.jsonl (rewritten whole from the store, so a resumed run never duplicates rows) and
/// OUT/report.json.
fn write_dataset(out: &Path, samples: &[Sample], min_reward: f64) -> anyhow::Result<Value> {
    let tmp = out.join("sft.jsonl.tmp");
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    let (mut rows, mut accepted_n) = (0u64, 0u64);
    let mut outcomes: HashMap<&str, u64> = HashMap::new();
    for s in samples {
        let kind = match &s.outcome {
            Some(Outcome::Completed { .. }) => "completed",
            Some(Outcome::Timeout { .. }) => "timeout",
            Some(Outcome::Error { .. }) => "error",
            Some(Outcome::Cancelled) => "cancelled",
            None => "unfinished",
        };
        *outcomes.entry(kind).or_default() += 1;
        if !accepted(s, min_reward) {
            continue;
        }
        accepted_n += 1;
        let Some(t) = &s.trajectory else { continue };
        let text =
            std::fs::read_to_string(&t.path).with_context(|| format!("reading {}", t.path))?;
        for line in text.lines() {
            let trace: tokentap_schema::Trace = serde_json::from_str(line)?;
            let messages: Value = serde_json::from_str(&trace.messages_json).unwrap_or(Value::Null);
            let tools: Value = serde_json::from_str(&trace.tools_json).unwrap_or(Value::Null);
            let mut input_ids = trace.prompt_ids.clone();
            input_ids.extend(&trace.response_ids);
            let mut mask = vec![0u8; trace.prompt_ids.len()];
            mask.extend(&trace.loss_mask);
            serde_json::to_writer(
                &mut w,
                &json!({
                    "task_id": s.task_id,
                    "sample_id": s.sample_id,
                    "trace_id": trace.trace_id,
                    "reward": trace.reward,
                    "messages": messages,
                    "tools": tools,
                    "input_ids": input_ids,
                    "loss_mask": mask,
                    "prompt_len": trace.prompt_ids.len(),
                    "logprobs": trace.logprobs,
                }),
            )?;
            w.write_all(b"\n")?;
            rows += 1;
        }
    }
    w.flush()?;
    drop(w);
    std::fs::rename(&tmp, out.join("sft.jsonl"))?;
    let n = samples.len() as u64;
    let report = json!({
        "samples": n,
        "accepted": accepted_n,
        "acceptance_rate": if n == 0 { 0.0 } else { accepted_n as f64 / n as f64 },
        "min_reward": min_reward,
        "rows": rows,
        "outcomes": outcomes,
    });
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    Ok(report)
}
