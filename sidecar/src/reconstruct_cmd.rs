//! `tokentap reconstruct` (offline: spool → trajectories) and `tokentap trajectories show`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use tokentap_reconstruct::{output, reconstruct_spool, show, TraceSink};
use tokentap_schema::{Strategy, Trace};

use crate::records_cmd::Detokenizer;

/// The builder strategies, as a flag.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum StrategyArg {
    /// One trace per call.
    PerRequest,
    /// Append-only conversations become one trace; subagents, compaction and rewritten
    /// prompts split.
    PrefixMerge,
}

impl From<StrategyArg> for Strategy {
    fn from(s: StrategyArg) -> Strategy {
        match s {
            StrategyArg::PerRequest => Strategy::PerRequest,
            StrategyArg::PrefixMerge => Strategy::PrefixMerge,
        }
    }
}

#[derive(Args)]
#[command(after_help = "Examples:
  tokentap reconstruct --spool ./spool --out ./traj
  tokentap reconstruct --spool ./spool --strategy per-request --out ./traj-requests

Writes OUT/traces.jsonl, OUT/parquet/part-NNNNN.parquet (one row per trace) and
OUT/sessions.jsonl (statistics and the faithfulness report of each session).")]
pub struct ReconstructArgs {
    /// The spool directory the proxy wrote.
    #[arg(long)]
    spool: PathBuf,
    /// How calls become traces.
    #[arg(long, value_enum, default_value = "prefix-merge")]
    strategy: StrategyArg,
    /// Output directory (created; existing files are appended to).
    #[arg(long)]
    out: PathBuf,
}

pub fn reconstruct(args: ReconstructArgs) -> anyhow::Result<std::process::ExitCode> {
    let (sessions, read) = reconstruct_spool(&args.spool, args.strategy.into())
        .with_context(|| format!("reading the spool in {}", args.spool.display()))?;
    let mut sink = TraceSink::open(&args.out)
        .with_context(|| format!("opening the output directory {}", args.out.display()))?;
    let (mut traces, mut calls, mut violations, mut trainable) = (0usize, 0u64, 0u64, 0u64);
    for s in sessions {
        traces += s.traces.len();
        calls += u64::from(s.report.stats.calls);
        violations += s.report.faithfulness.violations;
        trainable += s.report.faithfulness.trainable_tokens;
        for e in &s.report.faithfulness.examples {
            eprintln!("faithfulness violation: {e}");
        }
        sink.write_session(
            tokentap_reconstruct::EncodedTraces::new(s.traces)?,
            &s.report,
        )?;
    }
    sink.flush()?;
    println!(
        "{} records ({} unreadable lines skipped) → {traces} traces from {calls} calls ({:.2} calls per trace), {trainable} trainable tokens, {violations} faithfulness violations; written to {}",
        read.records,
        read.unreadable,
        calls as f64 / traces.max(1) as f64,
        args.out.display()
    );
    Ok(if violations == 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    })
}

#[derive(Subcommand)]
pub enum TrajectoriesCmd {
    /// Print traces with their mask boundaries made visible: context runs (mask 0) and
    /// sampled runs (mask 1, with their record and logprobs).
    #[command(after_help = "Examples:
  tokentap trajectories show traj/traces.jsonl
  tokentap trajectories show traj/parquet/part-00000.parquet --trace pi-1/0 --ids 40
  tokentap trajectories show traj/traces.jsonl --detokenize http://127.0.0.1:8080")]
    Show(ShowArgs),
}

#[derive(Args)]
pub struct ShowArgs {
    /// A traces.jsonl or a Parquet part.
    file: PathBuf,
    /// Only the trace with this id (`SESSION/INDEX`), or whose id starts with it.
    #[arg(long)]
    trace: Option<String>,
    /// Token ids shown at each end of a run (0: all).
    #[arg(long, default_value_t = 8)]
    ids: usize,
    /// A llama-server URL used only to show each token id's text piece (display only).
    #[arg(long)]
    detokenize: Option<String>,
}

pub fn trajectories(cmd: TrajectoriesCmd) -> anyhow::Result<()> {
    let TrajectoriesCmd::Show(args) = cmd;
    let traces = read_traces(&args.file)?;
    let pieces = Detokenizer::new(args.detokenize.as_deref());
    let mut shown = 0;
    for t in traces.iter().filter(|t| {
        args.trace
            .as_ref()
            .is_none_or(|p| t.trace_id.starts_with(p.as_str()))
    }) {
        print!("{}", show::render(t, args.ids, &|id| pieces.piece(id)));
        shown += 1;
    }
    if shown == 0 {
        bail!("no trace matched in {}", args.file.display());
    }
    Ok(())
}

fn read_traces(file: &Path) -> anyhow::Result<Vec<Trace>> {
    let parquet = file.extension().is_some_and(|e| e == "parquet");
    let traces = if parquet {
        output::read_traces_parquet(file)
    } else {
        output::read_traces_jsonl(file)
    };
    traces.with_context(|| format!("reading traces from {}", file.display()))
}
