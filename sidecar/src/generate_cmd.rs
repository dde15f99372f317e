//! `tokentap generate`: offline data generation. The rollout node's pipeline runs a task file
//! in batch (no HTTP), with a progress bar; its store lives in OUT/node, so an interrupted
//! run picks up where it stopped (finished samples are kept, running ones re-run). At the
//! end the accepted samples (reward at least `--min-reward`) become an SFT dataset:
//! OUT/sft.jsonl, one row per trace with its messages and token ids, and OUT/report.json
//! with the acceptance rate (both written by `tokentap_rollout::generate`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use tokentap_rollout::generate::{accepted, all_samples, read_tasks, write_dataset, TaskOverrides};
use tokentap_rollout::pipeline::now_ms;

use tokentap_rollout::cli::NodeArgs;

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
    if args.node.capture.spool == Path::new(tokentap_proxy::cli::DEFAULT_SPOOL) {
        args.node.capture.spool = args.out.join("spool");
    }
    let specs = read_tasks(
        &args.tasks,
        &TaskOverrides {
            harness: args.harness.clone(),
            samples: args.samples,
            evaluator: args.evaluator.clone(),
        },
    )?;
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
