//! `tokentap reconstruct` (offline: spool → trajectories) and `tokentap trajectories show`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand, ValueEnum};
use tokentap_reconstruct::{output, reconstruct_spool, TraceSink};
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
        print!("{}", render(t, args.ids, &|id| pieces.piece(id)));
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

/// A trace as text: a header, then its prompt and each run of equal mask.
pub fn render(t: &Trace, ids: usize, piece: &dyn Fn(u32) -> Option<String>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let trainable = t.trainable_tokens();
    let _ = writeln!(
        out,
        "trace {}  {}  started by {}  {} calls  prompt {} + response {} tokens ({} sampled mask=1, {} context mask=0){}",
        t.trace_id,
        t.strategy.as_str(),
        t.started_by.as_str(),
        t.calls.len(),
        t.prompt_ids.len(),
        t.response_ids.len(),
        trainable,
        t.response_ids.len() - trainable,
        if t.spans_policy_versions { "  SPANS POLICY VERSIONS" } else { "" }
    );
    let _ = writeln!(
        out,
        "  prompt   {:>6}  {}",
        t.prompt_ids.len(),
        show(&t.prompt_ids, ids, piece)
    );
    let mut i = 0;
    while i < t.response_ids.len() {
        let m = t.loss_mask[i];
        let end = (i..t.response_ids.len())
            .find(|&j| t.loss_mask[j] != m)
            .unwrap_or(t.response_ids.len());
        // A sampled run may hold several calls back to back only if nothing came between;
        // label it with the call that starts at or covers its start.
        let call = t
            .calls
            .iter()
            .rev()
            .find(|c| c.response_start as usize <= i);
        if m == 1 {
            let lp = &t.logprobs[i..end];
            let mean = lp.iter().map(|&x| f64::from(x)).sum::<f64>() / lp.len() as f64;
            let _ = writeln!(
                out,
                "  ▶ SAMPLED {:>5}  [{i}..{end})  record {}{}  mean logprob {mean:.3}\n             {}",
                end - i,
                call.map_or("?", |c| c.record_id.as_str()),
                call.and_then(|c| c.finish_reason)
                    .map(|f| format!("  finish {f:?}").to_lowercase())
                    .unwrap_or_default(),
                show(&t.response_ids[i..end], ids, piece)
            );
        } else {
            let _ = writeln!(
                out,
                "  · context {:>5}  [{i}..{end})  {}",
                end - i,
                show(&t.response_ids[i..end], ids, piece)
            );
        }
        i = end;
    }
    for g in &t.gaps {
        let _ = writeln!(out, "  gap: {g}");
    }
    out
}

/// The first and last `n` ids of a run (all when `n` is 0 or the run is short).
fn show(run: &[u32], n: usize, piece: &dyn Fn(u32) -> Option<String>) -> String {
    let one = |id: &u32| match piece(*id) {
        Some(p) => format!("{id}{p:?}"),
        None => id.to_string(),
    };
    if n == 0 || run.len() <= 2 * n {
        return run.iter().map(one).collect::<Vec<_>>().join(" ");
    }
    let head: Vec<String> = run[..n].iter().map(one).collect();
    let tail: Vec<String> = run[run.len() - n..].iter().map(one).collect();
    format!("{} … {}", head.join(" "), tail.join(" "))
}
