//! `tokentap bench reconstruct`: how fast traces are rebuilt and how much they merge, on
//! synthetic long sessions (200 calls growing to 60k-token prompts, with subagents) and,
//! with `--spool`, on sessions recorded from real harness runs. Single thread, in-process.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use tokentap_reconstruct::synthetic::LongSession;
use tokentap_reconstruct::{build_all, verify, Reconstructor, RecordDigest};
use tokentap_schema::ndjson::{decode_line, encode_line};
use tokentap_schema::{CaptureRecord, Strategy};

use super::report::Machine;

#[derive(Args)]
pub struct ReconstructBenchArgs {
    /// Also measure the sessions of this spool (e.g. recorded from real harness runs).
    #[arg(long)]
    spool: Option<PathBuf>,
    /// Open sessions held at once for the memory figure.
    #[arg(long, default_value_t = 16)]
    open_sessions: usize,
    /// Repetitions of each timing (the best is reported).
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

/// Tokens a reconstruction reads: every record's prompt and completion ids.
fn tokens(records: &[CaptureRecord]) -> u64 {
    records
        .iter()
        .map(|r| {
            (r.prompt_token_ids.as_ref().map_or(0, Vec::len)
                + r.completion_token_ids.as_ref().map_or(0, Vec::len)) as u64
        })
        .sum()
}

struct Figures {
    calls: usize,
    traces: usize,
    tokens: u64,
    build_s: f64,
    verify_s: f64,
    violations: u64,
}

/// Best of `repeat` runs of prefix merge (build + finish), then the faithfulness check.
fn measure(records: &[CaptureRecord], repeat: usize) -> Figures {
    let mut best_build = f64::MAX;
    let mut best_verify = f64::MAX;
    let mut traces = 0;
    let mut violations = 0;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let sessions = build_all(records, Strategy::PrefixMerge);
        best_build = best_build.min(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let digests: HashMap<String, RecordDigest> = records
            .iter()
            .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
            .collect();
        violations = sessions
            .iter()
            .map(|s| verify(&s.traces, &digests).violations)
            .sum();
        best_verify = best_verify.min(t.elapsed().as_secs_f64());
        traces = sessions.iter().map(|s| s.traces.len()).sum();
    }
    Figures {
        calls: records
            .iter()
            .filter(|r| r.prompt_token_ids.is_some())
            .count(),
        traces,
        tokens: tokens(records),
        build_s: best_build,
        verify_s: best_verify,
        violations,
    }
}

fn row(label: &str, f: &Figures) {
    let mtok = |s: f64| f.tokens as f64 / s / 1e6;
    println!(
        "  {label:<34} {:>6} {:>6} {:>7.2}x {:>10.1} {:>10.0} {:>10.0} {:>5}",
        f.calls,
        f.traces,
        f.calls as f64 / f.traces.max(1) as f64,
        f.tokens as f64 / 1e6,
        mtok(f.build_s),
        mtok(f.build_s + f.verify_s),
        f.violations
    );
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

pub fn run(args: ReconstructBenchArgs) -> anyhow::Result<()> {
    let m = Machine::here();
    println!("tokentap bench reconstruct — prefix merge, single thread, in memory (records already parsed); best of {}", args.repeat);
    println!(
        "  machine: {} cores ({}), load average at start: {}",
        m.cores, m.cpu, m.load_average
    );
    // Memory per open session first, before other phases leave freed memory to reuse:
    // sessions fed half their calls and left open.
    let shape = LongSession::default();
    let half: Vec<Vec<CaptureRecord>> = (0..args.open_sessions)
        .map(|s| {
            let mut r = shape.records(&format!("open{s}"), 100 + s as u64);
            r.truncate(r.len() / 2);
            r
        })
        .collect();
    let before = rss_bytes();
    let mut recon = Reconstructor::new(Strategy::PrefixMerge);
    for r in half.iter().flatten() {
        recon.push(r);
    }
    let after = rss_bytes();
    let open_tokens = recon.open_tokens();
    let held = recon.held_bytes();
    let n = recon.open_sessions().max(1) as f64;
    // RSS is printed for reference only: the allocator reuses pages freed while the records
    // were generated, so it under-reads; the held figure counts the builders' capacities.
    let memory_line = format!(
        "  memory: {} open sessions, each mid-way (112 calls, a 40k-token open chain): {:.2} MB held per session ({:.1} B per open-chain token: ids, mask, logprobs, the tip's messages, digests); RSS grew {:.2} MB per session",
        recon.open_sessions(),
        held as f64 / 1e6 / n,
        held as f64 / open_tokens.max(1) as f64,
        after.saturating_sub(before) as f64 / 1e6 / n,
    );
    drop(recon);

    println!(
        "  {:<34} {:>6} {:>6} {:>8} {:>10} {:>10} {:>10} {:>5}",
        "sessions", "calls", "traces", "merge", "Mtokens", "Mtok/s", "+verify", "viol"
    );
    // Linearity: the same shape at growing lengths (prompt growth per call kept).
    for calls in [50usize, 100, 200] {
        let shape = LongSession {
            calls,
            last_prompt: 20_000 + calls * 200,
            ..LongSession::default()
        };
        let records = shape.records("synthetic", 7);
        row(
            &format!("1 × {calls} calls, to {}k prompt", shape.last_prompt / 1000),
            &measure(&records, args.repeat),
        );
    }
    let mut many = Vec::new();
    for s in 0..4 {
        many.extend(shape.records(&format!("s{s}"), 11 + s as u64));
    }
    row("4 × 200 calls, to 60k prompt", &measure(&many, args.repeat));

    // Parsing the records from their spool lines, which the worker does before any of this.
    let mut ndjson = Vec::new();
    for r in &many {
        encode_line(r, &mut ndjson)?;
    }
    let t = Instant::now();
    let mut parsed = 0usize;
    for line in ndjson.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let r: CaptureRecord = decode_line(line)?;
        parsed += r.prompt_token_ids.map_or(0, |p| p.len());
    }
    let parse_s = t.elapsed().as_secs_f64();
    println!(
        "  parsing the same {} records from NDJSON ({:.0} MB): {:.0} Mtok/s ({:.0} MB/s)",
        many.len(),
        ndjson.len() as f64 / 1e6,
        tokens(&many) as f64 / parse_s / 1e6,
        ndjson.len() as f64 / parse_s / 1e6,
    );
    let _ = parsed;
    // End to end, as a worker or a proxy's local reconstruction runs: each spool line decoded
    // once, pushed into the reconstructor, every session finished with its faithfulness check.
    let mut best = f64::MAX;
    let mut checked = (0usize, 0u64);
    for _ in 0..args.repeat.max(1) {
        let t = Instant::now();
        let mut recon = Reconstructor::new(Strategy::PrefixMerge);
        for line in ndjson.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let r: CaptureRecord = decode_line(line)?;
            recon.push(&r);
        }
        let finished = recon.finish_all();
        best = best.min(t.elapsed().as_secs_f64());
        checked = (
            finished.iter().map(|f| f.traces.len()).sum(),
            finished
                .iter()
                .map(|f| f.report.faithfulness.violations)
                .sum(),
        );
    }
    println!(
        "  end to end on the same lines (decode once + merge + faithfulness check): {:.0} Mtok/s, one core ({} traces, {} violations)",
        tokens(&many) as f64 / best / 1e6,
        checked.0,
        checked.1,
    );

    // The worker's path on the same lines, in shipper-sized batches: decoded at ingest, made
    // durable in its spool, reconstructed from that spool (keeping up, as its thread does).
    for path in [
        WorkerPath::DecodedTwice,
        WorkerPath::DecodedOnce,
        WorkerPath::StoredAsReceived,
    ] {
        let mut best = f64::MAX;
        let mut taken = 0;
        for _ in 0..args.repeat.max(1) {
            let (seconds, t) = worker_path(&ndjson, path)?;
            best = best.min(seconds);
            taken = t;
        }
        println!(
            "  the worker's path, {}: {:.0} Mtok/s, one core ({} of {} records taken decoded from ingest)",
            path.label(),
            tokens(&many) as f64 / best / 1e6,
            taken,
            many.len(),
        );
    }

    if let Some(spool) = &args.spool {
        let t = Instant::now();
        let mut records = Vec::new();
        for item in tokentap_spool::SpoolReader::open(spool)? {
            if let tokentap_spool::SpoolItem::Record(e) = item? {
                records.push(e.record);
            }
        }
        let read_s = t.elapsed().as_secs_f64();
        let sessions = build_all(&records, Strategy::PrefixMerge).len();
        let f = measure(&records, args.repeat);
        row(
            &format!("{} recorded sessions ({})", sessions, spool.display()),
            &f,
        );
        println!(
            "  reading that spool: {:.3} s ({:.1} Mtok/s)",
            read_s,
            f.tokens as f64 / read_s / 1e6
        );
    }
    println!("{memory_line}");
    println!("  merge = calls with token data / traces (request-level traces per merged trace); Mtok/s = prompt + completion ids of the records / s, one core");
    Ok(())
}

#[derive(Clone, Copy, PartialEq)]
enum WorkerPath {
    /// Records encoded again for the spool, and decoded again from it (before the handoff).
    DecodedTwice,
    /// Encoded again for the spool, taken decoded from the handoff.
    DecodedOnce,
    /// Stored as received, taken decoded from the handoff (`tokentap worker` now).
    StoredAsReceived,
}

impl WorkerPath {
    fn label(self) -> &'static str {
        match self {
            WorkerPath::DecodedTwice => "records encoded again and decoded twice",
            WorkerPath::DecodedOnce => "encoded again, decoded once (handoff)",
            WorkerPath::StoredAsReceived => "stored as received, decoded once (now)",
        }
    }
}

/// Seconds for `tokentap worker`'s path over `ndjson`: batches of at most 256 records or
/// 8 MiB (the shippers' defaults) decoded as ingest decodes them, appended to a spool (no
/// fsync), and after each batch the live reconstructor reads what is new; then every session
/// is finished and the traces written. Returns the seconds and the records taken from the
/// handoff.
fn worker_path(ndjson: &[u8], path: WorkerPath) -> anyhow::Result<(f64, u64)> {
    use tokentap_reconstruct::{LiveOptions, LiveReconstructor};
    use tokentap_schema::ship::decode_batch;
    use tokentap_spool::{FsyncPolicy, Handoff, SpoolConfig, SpoolWriter};

    let dir = tempfile::tempdir()?;
    let (spool, out) = (dir.path().join("spool"), dir.path().join("out"));
    let mut batches: Vec<&[u8]> = Vec::new();
    let (mut start, mut lines) = (0, 0);
    for (i, b) in ndjson.iter().enumerate() {
        if *b == b'\n' {
            lines += 1;
            if lines == 256 || i + 1 - start >= 8 << 20 {
                batches.push(&ndjson[start..=i]);
                (start, lines) = (i + 1, 0);
            }
        }
    }
    if start < ndjson.len() {
        batches.push(&ndjson[start..]);
    }
    let t = Instant::now();
    let mut writer = SpoolWriter::open(
        &spool,
        SpoolConfig {
            fsync: FsyncPolicy::Never,
            ..SpoolConfig::default()
        },
    )?;
    let handoff = Handoff::new(64 << 20);
    // Sessions end at `finish_all`, not by idling (the records' clock is not the bench's).
    let options = LiveOptions {
        session_idle: std::time::Duration::from_secs(u64::from(u32::MAX)),
        ..LiveOptions::default()
    };
    let mut live = LiveReconstructor::open(&spool, &out, options)?;
    if path != WorkerPath::DecodedTwice {
        live = live.with_handoff(handoff.clone());
    }
    for batch in batches {
        let decoded = decode_batch(batch);
        anyhow::ensure!(decoded.ack.rejected == 0, "{:?}", decoded.ack.errors);
        match path {
            WorkerPath::DecodedTwice => _ = writer.append_batch(&decoded.records)?,
            WorkerPath::DecodedOnce => _ = handoff.append(&mut writer, decoded.records)?,
            WorkerPath::StoredAsReceived => {
                let lines: Vec<&[u8]> = decoded.lines.iter().map(|l| &batch[l.clone()]).collect();
                handoff.append_encoded(&mut writer, decoded.records, &lines)?;
            }
        }
        while !live.poll(4096)?.1 {}
    }
    live.finish_all()?;
    live.checkpoint(true)?;
    anyhow::ensure!(live.stats().violations == 0, "faithfulness violations");
    Ok((t.elapsed().as_secs_f64(), handoff.stats().taken))
}
