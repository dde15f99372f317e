//! `tokentap bench soak`: many streaming multi-turn sessions through one capturing proxy (with
//! in-process reconstruction, as deployed) for a long time, against the instant backend with
//! prompts that grow turn by turn. It reports what a long run would reveal and a short one
//! hides: resident memory over time (growth after warm-up), latency per window from the first
//! to the last, and whether every call sent has its record and every record its trace.
//!
//! A benchmark: it reports figures and verdicts against the targets, and fails only when it
//! could not run.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::{json, Value};

use crate::instant_backend::{InstantBackend, ANSWER, MODEL};
use crate::proxy_child::{count_spool_lines, ProxyChild};
use crate::report::Machine;
use tokentap_reconstruct::verify::RecordDigest;

#[derive(Args)]
pub struct SoakBenchArgs {
    /// Concurrent sessions (each a harness: a call, its think time, the next call).
    #[arg(long, default_value_t = 256)]
    sessions: usize,
    /// Seconds measured after the warm-up.
    #[arg(long, default_value_t = 600.0)]
    duration: f64,
    /// Seconds of load before measuring (the memory baseline is the window after it).
    #[arg(long, default_value_t = 60.0)]
    warmup: f64,
    /// Seconds per latency window (the first and last are compared).
    #[arg(long, default_value_t = 60.0)]
    window: f64,
    /// Calls per conversation; then the session ends and its harness starts a new one.
    #[arg(long, default_value_t = 16)]
    turns: usize,
    /// Bytes of each user message (a tool result); the prompt grows by about a quarter as
    /// many ids per turn.
    #[arg(long, default_value_t = 1024)]
    user_bytes: usize,
    /// Each session's pause between an answer and its next call (its tools' time), ms.
    #[arg(long, default_value_t = 1000)]
    think_ms: u64,
    /// Worker threads of the proxy.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Seconds between memory samples.
    #[arg(long, default_value_t = 5.0)]
    sample_every: f64,
    /// A session's traces are written once it has been idle this many seconds.
    #[arg(long, default_value_t = 10)]
    session_idle: u64,
    /// Keep the temporary directory (spool, traces, proxy log) and print its path.
    #[arg(long)]
    keep_temp: bool,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Targets from issue 17.
const TARGET_RSS_GROWTH: f64 = 0.05;
const TARGET_P99_RATIO: f64 = 1.25;

#[derive(Serialize)]
struct SoakReport {
    command: String,
    machine: Machine,
    sessions: usize,
    warmup_s: f64,
    duration_s: f64,
    window_s: f64,
    turns: usize,
    user_bytes: usize,
    think_ms: u64,
    proxy_threads: usize,
    /// Every call sent, warm-up included.
    calls: u64,
    /// Calls that failed (status, broken stream, timeout), warm-up included.
    errors: u64,
    /// Records in the spool after the proxy stopped (distinct record ids).
    records: u64,
    /// Calls sent without a record.
    records_lost: i64,
    /// Spool lines holding a record id already seen (a record written twice).
    duplicate_records: u64,
    /// Spool lines that are not a record (corrupt or torn).
    corrupt_lines: u64,
    spool_bytes: u64,
    /// Spool records found in the written traces (distinct record ids).
    traced_records: u64,
    /// Spool records in no trace.
    untraced_records: u64,
    /// Trace calls naming a record id the spool does not hold.
    traced_unknown_records: u64,
    /// Records in more than one trace call.
    traced_twice: u64,
    traces: u64,
    /// Violations the reconstruction reported (`sessions.jsonl`).
    faithfulness_violations: u64,
    /// Violations found here, checking every trace against the spool's records' digests
    /// (prompt ids, sampled ids, logprobs) independently of the reconstruction's own check.
    digest_violations: u64,
    windows: Vec<Window>,
    memory: Vec<MemorySample>,
    /// Lowest RSS in the first window after the warm-up.
    rss_baseline_mib: f64,
    /// Lowest RSS in the last window.
    rss_end_mib: f64,
    rss_max_mib: f64,
    rss_growth: f64,
    p99_last_over_first: f64,
    verdicts: Vec<Verdict>,
}

#[derive(Serialize)]
struct Window {
    /// Seconds after the warm-up at which the window starts.
    start_s: f64,
    calls: u64,
    errors: u64,
    calls_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

#[derive(Serialize, Clone, Copy)]
struct MemorySample {
    /// Seconds since the load began.
    t_s: f64,
    rss_mib: f64,
}

#[derive(Serialize)]
struct Verdict {
    what: &'static str,
    target: String,
    measured: String,
    met: bool,
}

/// Latencies and counts of one window.
struct Bucket {
    latency_us: Histogram<u64>,
    calls: u64,
    errors: u64,
}

impl Bucket {
    fn new() -> Bucket {
        Bucket {
            latency_us: Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid bounds"),
            calls: 0,
            errors: 0,
        }
    }
}

/// What every session task adds to.
struct Tally {
    start: Instant,
    warmup: Duration,
    window: Duration,
    warm: Bucket,
    windows: Vec<Bucket>,
}

impl Tally {
    fn add(&mut self, sent_at: Instant, latency: Duration, ok: bool) {
        let since = sent_at.duration_since(self.start);
        let bucket = match since.checked_sub(self.warmup) {
            None => &mut self.warm,
            Some(after) => {
                let i = (after.as_secs_f64() / self.window.as_secs_f64()) as usize;
                while self.windows.len() <= i {
                    self.windows.push(Bucket::new());
                }
                &mut self.windows[i]
            }
        };
        bucket.calls += 1;
        if ok {
            let us = latency.as_micros().clamp(1, 100_000_000) as u64;
            bucket.latency_us.record(us).expect("within bounds");
        } else {
            bucket.errors += 1;
        }
    }
}

pub fn run(args: SoakBenchArgs) -> anyhow::Result<()> {
    if args.sessions == 0 || args.turns == 0 {
        bail!("--sessions and --turns must be positive");
    }
    if !(args.duration > 0.0 && args.window > 0.0 && args.sample_every > 0.0 && args.warmup >= 0.0)
    {
        bail!("--duration, --window and --sample-every must be positive, --warmup not negative");
    }
    let backend = InstantBackend::start_growing((args.user_bytes / 4).max(1))?;
    let dir = tempfile::Builder::new()
        .prefix("tokentap-soak-")
        .tempdir()
        .context("creating a temporary directory")?;
    let idle = args.session_idle.to_string();
    let mut proxy = ProxyChild::spawn_with(
        backend.addr(),
        args.threads,
        dir.path(),
        "soak",
        &["--session-idle", &idle],
    )?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let measured = rt.block_on(load(&args, &mut proxy));
    drop(rt);
    let result = measured.and_then(|(tally, memory)| {
        // Every session is idle now: once `--session-idle` has passed, all are traced (a
        // proxy stopped earlier keeps open sessions for its next start).
        let spool = proxy.spool.clone().expect("the soak proxy captures");
        let (records, _) = count_spool_lines(&spool)?;
        crate::report::progress(&format!(
            "waiting for the {records} records' sessions to go idle and be traced"
        ));
        let deadline = Instant::now() + Duration::from_secs(3 * args.session_idle + 60);
        while traced_so_far(&spool.join("traces")) < records && Instant::now() < deadline {
            proxy.ensure_alive()?;
            std::thread::sleep(Duration::from_secs(1));
        }
        crate::report::progress("stopping the proxy");
        proxy.stop()?;
        summarize(&args, &proxy, tally, memory)
    });
    if args.keep_temp {
        crate::report::progress(&format!("kept {}", dir.keep().display()));
    }
    let report = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// Runs the sessions until the end of the measured time; the tally and the memory samples.
async fn load(
    args: &SoakBenchArgs,
    proxy: &mut ProxyChild,
) -> anyhow::Result<(Tally, Vec<MemorySample>)> {
    proxy.wait_ready(Duration::from_secs(20)).await?;
    crate::report::progress(&format!(
        "proxy pid {} on {}: {} sessions, {} s warm-up, {} s measured",
        proxy.pid(),
        proxy.addr,
        args.sessions,
        args.warmup,
        args.duration
    ));
    let start = Instant::now();
    let warmup = Duration::from_secs_f64(args.warmup);
    let end = start + warmup + Duration::from_secs_f64(args.duration);
    let tally = Arc::new(Mutex::new(Tally {
        start,
        warmup,
        window: Duration::from_secs_f64(args.window),
        warm: Bucket::new(),
        windows: Vec::new(),
    }));
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.sessions)
        .timeout(Duration::from_secs(30))
        .build()?;
    let url = format!("http://{}/v1/chat/completions", proxy.addr);
    let think = Duration::from_millis(args.think_ms);
    let local = tokio::task::LocalSet::new();
    for s in 0..args.sessions {
        let (client, url, tally) = (client.clone(), url.clone(), tally.clone());
        let (turns, user_bytes) = (args.turns, args.user_bytes);
        // Spread the sessions' first calls over one think time, so they do not move in step.
        let offset = think.mul_f64(s as f64 / args.sessions as f64);
        local.spawn_local(async move {
            tokio::time::sleep(offset).await;
            session(s, &client, &url, &tally, turns, user_bytes, think, end).await;
        });
    }
    let every = Duration::from_secs_f64(args.sample_every);
    let mut memory = Vec::new();
    local
        .run_until(async {
            while Instant::now() < end {
                proxy.ensure_alive()?;
                memory.push(MemorySample {
                    t_s: start.elapsed().as_secs_f64(),
                    rss_mib: mib(proxy.rss_bytes()),
                });
                tokio::time::sleep(every.min(end.saturating_duration_since(Instant::now()))).await;
            }
            anyhow::Ok(())
        })
        .await?;
    // The sessions finish the calls they have in flight.
    local.await;
    memory.push(MemorySample {
        t_s: start.elapsed().as_secs_f64(),
        rss_mib: mib(proxy.rss_bytes()),
    });
    let tally = Arc::try_unwrap(tally)
        .map_err(|_| anyhow::anyhow!("a session outlived the run"))?
        .into_inner()
        .expect("not poisoned");
    Ok((tally, memory))
}

/// One harness: conversations of `turns` streamed calls with growing prompts, until `end`.
#[allow(clippy::too_many_arguments)]
async fn session(
    s: usize,
    client: &reqwest::Client,
    url: &str,
    tally: &Mutex<Tally>,
    turns: usize,
    user_bytes: usize,
    think: Duration,
    end: Instant,
) {
    let filler: String = "the tool printed this line of output; "
        .chars()
        .cycle()
        .take(user_bytes)
        .collect();
    for conversation in 0.. {
        let id = format!("soak-{s}-{conversation}");
        let mut messages = vec![json!({"role": "user", "content": format!("{id}: {filler}")})];
        for turn in 0..turns {
            if Instant::now() >= end {
                return;
            }
            let body =
                json!({"model": MODEL, "messages": messages, "stream": true, "max_tokens": 64});
            let sent = Instant::now();
            let ok = call(client, url, &id, &body).await;
            tally
                .lock()
                .expect("not poisoned")
                .add(sent, sent.elapsed(), ok);
            messages.push(json!({"role": "assistant", "content": ANSWER.concat()}));
            messages.push(json!({"role": "user", "content": format!("{turn}: {filler}")}));
            tokio::time::sleep(think).await;
        }
    }
}

/// One streamed call: whether it was answered 200 with the whole stream.
async fn call(client: &reqwest::Client, url: &str, session: &str, body: &Value) -> bool {
    let Ok(resp) = client
        .post(url)
        .header("x-tokentap-session", session)
        .bearer_auth("sk-soak")
        .json(body)
        .send()
        .await
    else {
        return false;
    };
    if resp.status() != 200 {
        return false;
    }
    resp.bytes()
        .await
        .is_ok_and(|b| b.ends_with(b"data: [DONE]\n\n"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn summarize(
    args: &SoakBenchArgs,
    proxy: &ProxyChild,
    tally: Tally,
    memory: Vec<MemorySample>,
) -> anyhow::Result<SoakReport> {
    let spool = proxy.spool.as_deref().expect("the soak proxy captures");
    let (_, spool_bytes) = count_spool_lines(spool)?;
    let spooled = spooled(spool)?;
    let records = spooled.digests.len() as u64;
    let tr = traced(&spool.join("traces"), &spooled)?;
    let calls = tally.warm.calls + tally.windows.iter().map(|w| w.calls).sum::<u64>();
    let errors = tally.warm.errors + tally.windows.iter().map(|w| w.errors).sum::<u64>();
    let windows: Vec<Window> = tally
        .windows
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let ms = |q: f64| b.latency_us.value_at_quantile(q) as f64 / 1000.0;
            Window {
                start_s: i as f64 * args.window,
                calls: b.calls,
                errors: b.errors,
                calls_per_s: b.calls as f64 / args.window,
                p50_ms: ms(0.5),
                p99_ms: ms(0.99),
                max_ms: b.latency_us.max() as f64 / 1000.0,
            }
        })
        .collect();
    // Memory saws up and down as sessions open and are traced, so compare floors: the
    // lowest sample of the first window after the warm-up with the lowest of the last window.
    // A leak raises the floor; a sawtooth does not.
    let in_window = |from: f64, to: f64| -> Vec<f64> {
        memory
            .iter()
            .filter(|m| m.t_s >= from && m.t_s <= to)
            .map(|m| m.rss_mib)
            .collect()
    };
    let end_s = args.warmup + args.duration;
    let first = in_window(args.warmup, args.warmup + args.window);
    let last = in_window(end_s - args.window, f64::INFINITY);
    let floor = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let (baseline, end) = (floor(&first), floor(&last));
    let max = in_window(args.warmup, f64::INFINITY)
        .into_iter()
        .fold(0.0, f64::max);
    let rss_growth = if baseline.is_finite() && end.is_finite() && baseline > 0.0 {
        (end - baseline) / baseline
    } else {
        f64::NAN
    };
    // A last window shorter than half a window (the tail of the run) is too thin to compare.
    let full: Vec<&Window> = windows
        .iter()
        .filter(|w| w.calls as f64 >= 0.5 * windows[0].calls as f64)
        .collect();
    let p99_ratio = match (full.first(), full.last()) {
        (Some(first), Some(last)) if first.p99_ms > 0.0 => last.p99_ms / first.p99_ms,
        _ => f64::NAN,
    };
    let records_lost = calls as i64 - records as i64;
    let verdicts = vec![
        Verdict {
            what: "records lost (calls sent without a record)",
            target: "0".into(),
            measured: records_lost.to_string(),
            met: records_lost == 0,
        },
        Verdict {
            what: "records traced, each once, and faithful to the spool",
            target: format!("{records}"),
            measured: tr.traced_records.to_string(),
            met: tr.traced_records == records
                && tr.traced_unknown_records == 0
                && tr.traced_twice == 0
                && tr.faithfulness_violations == 0
                && tr.digest_violations == 0
                && spooled.duplicates == 0
                && spooled.corrupt == 0,
        },
        Verdict {
            what: "RSS floor growth, first window after warm-up to last",
            target: format!("< {:.0} %", TARGET_RSS_GROWTH * 100.0),
            measured: format!("{:+.1} %", rss_growth * 100.0),
            met: rss_growth < TARGET_RSS_GROWTH,
        },
        Verdict {
            what: "p99, last window over first",
            target: format!("<= {TARGET_P99_RATIO}"),
            measured: format!("{p99_ratio:.2}"),
            met: p99_ratio <= TARGET_P99_RATIO,
        },
        Verdict {
            what: "failed calls",
            target: "0".into(),
            measured: errors.to_string(),
            met: errors == 0,
        },
    ];
    Ok(SoakReport {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::here(),
        sessions: args.sessions,
        warmup_s: args.warmup,
        duration_s: args.duration,
        window_s: args.window,
        turns: args.turns,
        user_bytes: args.user_bytes,
        think_ms: args.think_ms,
        proxy_threads: args.threads,
        calls,
        errors,
        records,
        records_lost,
        duplicate_records: spooled.duplicates,
        corrupt_lines: spooled.corrupt,
        spool_bytes,
        traced_records: tr.traced_records,
        untraced_records: records.saturating_sub(tr.traced_records),
        traced_unknown_records: tr.traced_unknown_records,
        traced_twice: tr.traced_twice,
        traces: tr.traces,
        faithfulness_violations: tr.faithfulness_violations,
        digest_violations: tr.digest_violations,
        windows,
        memory,
        rss_baseline_mib: baseline,
        rss_end_mib: end,
        rss_max_mib: max,
        rss_growth,
        p99_last_over_first: p99_ratio,
        verdicts,
    })
}

/// What the spool holds: each record's digest by id, and what is not one record once.
struct Spooled {
    digests: HashMap<String, RecordDigest>,
    duplicates: u64,
    corrupt: u64,
}

/// Reads every record of the spool (ids compared as sets below: a lost record and a
/// duplicated one must not cancel out, as they would in a line count).
fn spooled(spool: &Path) -> anyhow::Result<Spooled> {
    let mut out = Spooled {
        digests: HashMap::new(),
        duplicates: 0,
        corrupt: 0,
    };
    for item in tokentap_spool::SpoolReader::open(spool)? {
        match item? {
            tokentap_spool::SpoolItem::Record(e) => {
                let digest = RecordDigest::of(&e.record);
                if out.digests.insert(e.record.record_id, digest).is_some() {
                    out.duplicates += 1;
                }
            }
            _ => out.corrupt += 1,
        }
    }
    Ok(out)
}

/// Calls in the traces written to `dir` so far (0 before the first): what the wait for the
/// last sessions watches; the verdicts come from [`traced`].
fn traced_so_far(dir: &Path) -> u64 {
    tokentap_reconstruct::output::read_traces_jsonl(&dir.join("traces.jsonl"))
        .map(|traces| traces.iter().map(|t| t.calls.len() as u64).sum())
        .unwrap_or(0)
}

/// The written traces against the spool.
struct Traced {
    traced_records: u64,
    traced_unknown_records: u64,
    traced_twice: u64,
    traces: u64,
    faithfulness_violations: u64,
    digest_violations: u64,
}

/// Reads the traces and the session reports written to `dir` (both must be there when there
/// are records: a missing report is an error, never "no violations"), and checks every trace
/// against the spool's digests.
fn traced(dir: &Path, spooled: &Spooled) -> anyhow::Result<Traced> {
    let traces_file = dir.join("traces.jsonl");
    if !traces_file.exists() {
        if spooled.digests.is_empty() {
            return Ok(Traced {
                traced_records: 0,
                traced_unknown_records: 0,
                traced_twice: 0,
                traces: 0,
                faithfulness_violations: 0,
                digest_violations: 0,
            });
        }
        bail!(
            "{} records but no {}",
            spooled.digests.len(),
            traces_file.display()
        );
    }
    let traces = tokentap_reconstruct::output::read_traces_jsonl(&traces_file)
        .with_context(|| format!("reading {}", traces_file.display()))?;
    let reports = dir.join("sessions.jsonl");
    let sessions = std::fs::read_to_string(&reports)
        .with_context(|| format!("reading {}", reports.display()))?;
    let mut faithfulness_violations = 0;
    for (i, line) in sessions.lines().enumerate() {
        let r: tokentap_schema::SessionReport = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", reports.display(), i + 1))?;
        faithfulness_violations += r.faithfulness.violations;
    }
    let mut seen: HashSet<&str> = HashSet::new();
    let (mut unknown, mut twice) = (0, 0);
    for c in traces.iter().flat_map(|t| &t.calls) {
        if !spooled.digests.contains_key(&c.record_id) {
            unknown += 1;
        } else if !seen.insert(&c.record_id) {
            twice += 1;
        }
    }
    let digest_violations =
        tokentap_reconstruct::verify::verify(&traces, &spooled.digests).violations;
    Ok(Traced {
        traced_records: seen.len() as u64,
        traced_unknown_records: unknown,
        traced_twice: twice,
        traces: traces.len() as u64,
        faithfulness_violations,
        digest_violations,
    })
}

fn print_table(r: &SoakReport) {
    println!(
        "soak: {} sessions, {} turns each, {} B user messages, {} ms think; {} s warm-up, {} s measured; proxy on {} threads",
        r.sessions, r.turns, r.user_bytes, r.think_ms, r.warmup_s, r.duration_s, r.proxy_threads
    );
    println!(
        "machine: {} cores, {}, load average at start {}",
        r.machine.cores, r.machine.cpu, r.machine.load_average
    );
    println!();
    println!("window (s after warm-up)  calls   calls/s  errors  p50 ms  p99 ms  max ms");
    for w in &r.windows {
        println!(
            "{:>24}  {:>6}  {:>8.1}  {:>6}  {:>6.2}  {:>6.2}  {:>6.1}",
            format!("{:.0}–{:.0}", w.start_s, w.start_s + r.window_s),
            w.calls,
            w.calls_per_s,
            w.errors,
            w.p50_ms,
            w.p99_ms,
            w.max_ms
        );
    }
    println!();
    println!(
        "proxy RSS: floor {:.1} MiB in the first window after warm-up, {:.1} MiB in the last; max {:.1} MiB",
        r.rss_baseline_mib, r.rss_end_mib, r.rss_max_mib
    );
    println!(
        "calls {} (errors {}), records {} ({} bytes of spool; {} duplicated, {} corrupt lines), traced {} in {} traces ({} untraced, {} unknown, {} twice), violations {} reported, {} against the spool's digests",
        r.calls, r.errors, r.records, r.spool_bytes, r.duplicate_records, r.corrupt_lines,
        r.traced_records, r.traces, r.untraced_records, r.traced_unknown_records, r.traced_twice,
        r.faithfulness_violations, r.digest_violations
    );
    println!();
    for v in &r.verdicts {
        println!(
            "{} {}: {} (target {})",
            if v.met { "MET   " } else { "MISSED" },
            v.what,
            v.measured,
            v.target
        );
    }
}
