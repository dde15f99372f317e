//! `tokentap bench`: measurements that print figures side by side from one run. Benchmarks
//! report; they never assert.
//!
//! Placement on the machine (2 cores in CI and on developer machines): the load generator is
//! one single-threaded tokio runtime on the main thread plus a pacing thread, the instant
//! backend is one single-threaded runtime on its own thread, and the proxy is a child process
//! with `--threads` workers. Nothing is pinned: all of them share the cores, as they would if
//! a harness, the proxy and an engine client shared a small box.

mod body;
mod bus;
mod cluster;
mod contender;
mod instant_backend;
mod load;
mod metrics;
mod proxy_child;
mod reconstruct;
mod report;
mod rollout;
mod soak;
mod token_mode;
mod translate;
mod transparent;

use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, Subcommand, ValueEnum};

use body::Api;
use instant_backend::InstantBackend;
use load::{Call, RunResult};
use proxy_child::ProxyChild;
use report::{
    progress, CaptureCheck, Config, LatencyRow, Machine, Percentiles, Report, Throughput,
    ThroughputRow, TARGET_DIRECT, TARGET_OFF, TARGET_ON,
};

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Proxy-added latency and throughput, capture on and off, against an instant synthetic
    /// vLLM-shaped backend on loopback, each proxied figure beside the direct one.
    #[command(after_help = "Examples:
  tokentap bench proxy
  tokentap bench proxy --stream --concurrency 1,64 --json > bench.json")]
    Proxy(ProxyBenchArgs),
    /// What transparent capture costs: connect latency with the eBPF redirect, without, and
    /// with nftables REDIRECT (root); TLS handshakes/s and first-certificate mint time.
    Transparent(transparent::TransparentBenchArgs),
    /// Translation cost per call of each wire API on the real harness requests: parse, and
    /// render an answer whole and streamed (in-process, single thread).
    Translate(translate::TranslateBenchArgs),
    /// Records through NATS JetStream at saturation (`--bus`): a spool of 40 KB-request
    /// records published to a real nats-server on loopback, then consumed and reconstructed
    /// by one worker-group member.
    #[command(after_help = "Examples:
  tokentap bench bus
  tokentap bench bus --sessions 200 --json > bus.json")]
    Bus(bus::BusBenchArgs),
    /// Trace reconstruction: merge ratio, tokens/s per core (linearity over session length),
    /// memory per open session, on synthetic long sessions and optionally a recorded spool.
    Reconstruct(reconstruct::ReconstructBenchArgs),
    /// A rollout node at saturation: samples per hour, agents running at once, time in each
    /// stage, and what prewarming saves, measured side by side in one run.
    #[command(after_help = "Examples:
  tokentap bench rollout
  tokentap bench rollout --samples 48 --run-workers 8 --think-ms 1000")]
    Rollout(rollout::RolloutBenchArgs),
    /// Rollout nodes sharing a bus at saturation: samples per hour with one node alone, one
    /// on a real nats-server and several on it, and each one's CPU per sample.
    #[command(after_help = "Examples:
  tokentap bench cluster
  tokentap bench cluster --samples 48 --nodes 3 --run-workers 2")]
    Cluster(cluster::ClusterBenchArgs),
    /// Many streaming multi-turn sessions through a capturing proxy for a long time: memory
    /// growth after warm-up, latency from the first window to the last, and every call's
    /// record and trace accounted for.
    #[command(after_help = "Examples:
  tokentap bench soak                                  # 256 sessions, 10 minutes
  tokentap bench soak --duration 3600 --json > soak.json")]
    Soak(soak::SoakBenchArgs),
    /// tokentap's capturing proxy beside LiteLLM's proxy (PyPI `litellm[proxy]`), both in
    /// front of the same instant backend in the same run: calls/s at saturation, CPU per call,
    /// added latency at one rate below both proxies' saturation.
    #[command(after_help = "Examples:
  pip install 'litellm[proxy]'
  tokentap bench contender
  tokentap bench contender --stream --litellm ~/venv/bin/litellm --json")]
    Contender(contender::ContenderBenchArgs),
    /// What `--token-mode observe` costs per call: the model's template rendering a whole
    /// conversation, encoding it, a whole observation of a call appending a tool result, and
    /// the ids held per open session (in-process, one thread).
    #[command(after_help = "Examples:
  tokentap bench token-mode
  tokentap bench token-mode --tokenizer ~/models/Qwen3-8B --conversation-bytes 100000")]
    TokenMode(token_mode::TokenModeBenchArgs),
    /// What the proxy's metrics cost per call (every series a finished call updates) and per
    /// scrape, in-process; set beside `bench proxy`'s CPU per call.
    Metrics(metrics::MetricsBenchArgs),
}

#[derive(Args)]
pub struct ProxyBenchArgs {
    #[command(flatten)]
    load: load::LoadArgs,
    /// Concurrency levels: client connections, so the most calls in flight.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    concurrency: Vec<usize>,
    /// Size of each request body in bytes (the reference Qwen Code request is about 40 KB).
    #[arg(long, default_value_t = 40_000)]
    body_bytes: usize,
    /// Prompt ids the backend returns per call [default: body-bytes / 4, about one token per
    /// 4 bytes, as a real engine would return for that prompt].
    #[arg(long)]
    prompt_ids: Option<usize>,
    /// The wire API the proxied calls speak (the direct calls always speak Chat Completions,
    /// which is what the proxy itself sends the backend).
    #[arg(long, value_enum, default_value = "chat")]
    api: Api,
    /// Ask for streamed answers (SSE) instead of whole ones.
    #[arg(long)]
    stream: bool,
    /// Worker threads of the proxy under test.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The capture-on proxy's spool fsync policy: `always` also holds each answer's end until
    /// its record is on disk (durable answers), which is what it costs.
    #[arg(long, default_value = "100ms")]
    fsync: String,
    /// Which measurements to run.
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// Keep the temporary directory (spool and proxy logs) and print its path.
    #[arg(long)]
    keep_temp: bool,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Latency,
    Throughput,
    Both,
}

pub fn run(cmd: BenchCmd) -> anyhow::Result<()> {
    match cmd {
        BenchCmd::Proxy(args) => bench_proxy(args),
        BenchCmd::Bus(args) => bus::run(args),
        BenchCmd::Transparent(args) => transparent::run(args),
        BenchCmd::Translate(args) => translate::run(args),
        BenchCmd::Reconstruct(args) => reconstruct::run(args),
        BenchCmd::Rollout(args) => rollout::run(args),
        BenchCmd::Cluster(args) => cluster::run(args),
        BenchCmd::Soak(args) => soak::run(args),
        BenchCmd::Metrics(args) => metrics::run(args),
        BenchCmd::TokenMode(args) => token_mode::run(args),
        BenchCmd::Contender(args) => contender::run(args),
    }
}

fn bench_proxy(args: ProxyBenchArgs) -> anyhow::Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs positive levels, e.g. 1,64,256");
    }
    args.load.check()?;
    let prompt_ids = args.prompt_ids.unwrap_or(args.body_bytes / 4);
    let body = Bytes::from(body::chat_request(args.body_bytes, args.stream));
    let proxied_body = Bytes::from(args.api.body(&body));
    let backend = InstantBackend::start(prompt_ids)?;
    let dir = tempfile::Builder::new()
        .prefix("tokentap-bench-")
        .tempdir()
        .context("creating a temporary directory")?;
    let mut report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::here(),
        config: Config {
            duration_s: args.load.duration,
            throughput_duration_s: args.load.throughput_duration,
            warmup_s: args.load.warmup,
            rate: args.load.rate.unwrap_or(f64::NAN),
            rate_auto: args.load.rate.is_none(),
            concurrency: args.concurrency.clone(),
            body_bytes: body.len(),
            api: args.api.name(),
            proxied_body_bytes: proxied_body.len(),
            prompt_ids,
            stream: args.stream,
            proxy_threads: args.threads,
            fsync: args.fsync.clone(),
        },
        latency: Vec::new(),
        throughput: Vec::new(),
        targets: Vec::new(),
        capture: None,
    };

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let measured = rt.block_on(measure(
        &args,
        &backend,
        [body, proxied_body],
        dir.path(),
        &mut report,
    ));
    drop(rt);
    if args.keep_temp {
        progress(&format!("kept {}", dir.keep().display()));
    }
    measured?;
    report.check_targets();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print_table();
    }
    Ok(())
}

/// The three targets of every comparison and what is counted across runs.
struct Targets {
    backend: std::net::SocketAddr,
    off: ProxyChild,
    on: ProxyChild,
    /// The direct call's Chat Completions body.
    body: Bytes,
    /// The proxied calls' body and endpoint, in the benchmarked wire API.
    proxied_body: Bytes,
    path: &'static str,
    /// Calls sent to the capture-on proxy, to compare with its spool.
    sent_on: u64,
}

const TARGETS: [&str; 3] = [TARGET_DIRECT, TARGET_OFF, TARGET_ON];

impl Targets {
    fn call(&self, target: &str) -> Call {
        let addr = match target {
            TARGET_OFF => self.off.addr,
            TARGET_ON => self.on.addr,
            _ => {
                return Call {
                    addr: self.backend,
                    path: "/v1/chat/completions",
                    body: self.body.clone(),
                }
            }
        };
        Call {
            addr,
            path: self.path,
            body: self.proxied_body.clone(),
        }
    }

    /// CPU time so far of the process serving `target` (for direct: this process, which is
    /// the load generator and the backend).
    fn cpu(&self, target: &str) -> Duration {
        match target {
            TARGET_OFF => self.off.cpu_time(),
            TARGET_ON => self.on.cpu_time(),
            _ => proxy_child::cpu_time_of("self"),
        }
    }

    /// One run against `target`; its result and the CPU milliseconds per call sent.
    async fn run(&mut self, target: &str, run: Run) -> anyhow::Result<(RunResult, f64)> {
        let call = self.call(target);
        let cpu = self.cpu(target);
        let r = match run {
            Run::Open {
                conns,
                rate,
                warmup,
                duration,
            } => load::open_loop(&call, conns, rate, warmup, duration).await?,
            Run::Closed {
                conns,
                warmup,
                duration,
            } => load::closed_loop(&call, conns, warmup, duration).await?,
        };
        self.off.ensure_alive()?;
        self.on.ensure_alive()?;
        let cpu_ms = (self.cpu(target) - cpu).as_secs_f64() * 1000.0 / r.sent.max(1) as f64;
        if target == TARGET_ON {
            self.sent_on += r.sent;
        }
        Ok((r, cpu_ms))
    }

    /// One call through each target: a broken set-up fails here, not as a table of errors.
    async fn check(&mut self) -> anyhow::Result<()> {
        for target in TARGETS {
            let (status, answer) = load::call_once(&self.call(target)).await?;
            if target == TARGET_ON {
                self.sent_on += 1;
            }
            if status != 200 || memchr::memmem::find(&answer, b"Sure").is_none() {
                let log = [&self.off, &self.on].map(|p| p.log_tail()).join("\n");
                bail!(
                    "a check call to {target} got {status}: {}\nproxy logs:\n{log}",
                    String::from_utf8_lossy(&answer[..answer.len().min(500)])
                );
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Run {
    Open {
        conns: usize,
        rate: f64,
        warmup: Duration,
        duration: Duration,
    },
    Closed {
        conns: usize,
        warmup: Duration,
        duration: Duration,
    },
}

async fn measure(
    args: &ProxyBenchArgs,
    backend: &InstantBackend,
    [body, proxied_body]: [Bytes; 2],
    dir: &std::path::Path,
    report: &mut Report,
) -> anyhow::Result<()> {
    let mut t = Targets {
        backend: backend.addr(),
        off: ProxyChild::spawn(backend.addr(), false, args.threads, dir, &args.fsync)?,
        on: ProxyChild::spawn(backend.addr(), true, args.threads, dir, &args.fsync)?,
        body,
        proxied_body,
        path: args.api.path(),
        sent_on: 0,
    };
    t.off.wait_ready(Duration::from_secs(20)).await?;
    t.on.wait_ready(Duration::from_secs(20)).await?;
    progress(&format!(
        "proxy capture-off pid {} on {}, capture-on pid {} on {}, backend on {}",
        t.off.pid(),
        t.off.addr,
        t.on.pid(),
        t.on.addr,
        t.backend
    ));
    t.check().await?;

    let warmup = Duration::from_secs_f64(args.load.warmup);
    // Throughput first: the latency runs' default rate is derived from it.
    if args.mode != Mode::Latency {
        throughput_runs(&mut t, args, warmup, report).await?;
    }
    if args.mode != Mode::Throughput {
        let rate = match args.load.rate {
            Some(r) => r,
            None => auto_rate(&mut t, args, report).await?,
        };
        report.config.rate = rate;
        latency_runs(&mut t, args, rate, warmup, report).await?;
    }

    progress("stopping the proxies; counting the capture-on spool");
    t.off.stop()?;
    t.on.stop()?;
    report.capture = Some(check_capture(&t.on, t.sent_on, report.config.prompt_ids)?);
    let served = backend.served();
    progress(&format!(
        "backend served {} whole and {} streamed calls ({} asked for token ids)",
        served.whole.load(std::sync::atomic::Ordering::Relaxed),
        served.streamed.load(std::sync::atomic::Ordering::Relaxed),
        served
            .asked_token_ids
            .load(std::sync::atomic::Ordering::Relaxed),
    ));
    Ok(())
}

/// Closed loop at each concurrency level against each target.
async fn throughput_runs(
    t: &mut Targets,
    args: &ProxyBenchArgs,
    warmup: Duration,
    report: &mut Report,
) -> anyhow::Result<()> {
    let duration = Duration::from_secs_f64(args.load.throughput_duration);
    for &conns in &args.concurrency {
        let mut runs = Vec::new();
        for target in TARGETS {
            progress(&format!("throughput: {target}, {conns} concurrent"));
            let run = Run::Closed {
                conns,
                warmup,
                duration,
            };
            let (r, cpu) = t.run(target, run).await?;
            runs.push(Throughput::of(&r, cpu));
        }
        let [direct, capture_off, capture_on] =
            <[Throughput; 3]>::try_from(runs).map_err(|_| anyhow::anyhow!("three runs"))?;
        report.throughput.push(ThroughputRow {
            concurrency: conns,
            off_on_ratio: capture_off.calls_per_s / capture_on.calls_per_s,
            direct,
            capture_off,
            capture_on,
        });
    }
    Ok(())
}

/// Open loop at `rate` at each concurrency level against each target; the proxied rows
/// carry their difference to the direct one.
async fn latency_runs(
    t: &mut Targets,
    args: &ProxyBenchArgs,
    rate: f64,
    warmup: Duration,
    report: &mut Report,
) -> anyhow::Result<()> {
    let duration = Duration::from_secs_f64(args.load.duration);
    for &conns in &args.concurrency {
        let mut direct: Option<Percentiles> = None;
        for target in TARGETS {
            progress(&format!(
                "latency: {target}, {conns} concurrent, {rate:.0} calls/s"
            ));
            let run = Run::Open {
                conns,
                rate,
                warmup,
                duration,
            };
            let (r, cpu_ms_per_call) = t.run(target, run).await?;
            let row = LatencyRow::of(conns, target, &r, direct, cpu_ms_per_call);
            if target == TARGET_DIRECT {
                direct = Some(row.latency);
            }
            report.latency.push(row);
        }
    }
    Ok(())
}

/// The default offered rate: half the capture-on proxy's lowest saturated throughput (from
/// the throughput runs, else from a short probe), at most 500 calls/s. Latency measured near
/// or past saturation is queueing, not overhead.
async fn auto_rate(t: &mut Targets, args: &ProxyBenchArgs, report: &Report) -> anyhow::Result<f64> {
    let mut saturated = report
        .throughput
        .iter()
        .map(|r| r.capture_on.calls_per_s)
        .fold(f64::INFINITY, f64::min);
    if !saturated.is_finite() {
        progress("probing the capture-on proxy's saturated throughput for the offered rate");
        let mut lowest = f64::INFINITY;
        for &conns in &args.concurrency {
            let run = Run::Closed {
                conns,
                warmup: Duration::from_millis(300),
                duration: Duration::from_secs(1),
            };
            lowest = lowest.min(t.run(TARGET_ON, run).await?.0.calls_per_s());
        }
        saturated = lowest;
    }
    Ok(load::rate_below(saturated))
}

/// Counts the capture-on spool and looks at its last records.
fn check_capture(
    on: &ProxyChild,
    calls_sent: u64,
    prompt_ids: usize,
) -> anyhow::Result<CaptureCheck> {
    let spool = on
        .spool
        .as_deref()
        .expect("the capture-on proxy has a spool");
    let (spool_records, spool_bytes) = proxy_child::count_spool_lines(spool)?;
    let last = tokentap_spool::tail(spool, 200).context("reading the spool's last records")?;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    // Complete: the answer was given and every token field the instant backend sends is there.
    let complete = last
        .iter()
        .filter(|r| {
            r.error.is_none()
                && r.prompt_token_ids
                    .as_ref()
                    .is_some_and(|p| p.len() == prompt_ids)
                && r.completion_token_ids
                    .as_ref()
                    .is_some_and(|c| c.len() == instant_backend::ANSWER.len())
                && r.logprobs
                    .as_ref()
                    .is_some_and(|l| l.len() == instant_backend::ANSWER.len())
        })
        .count();
    Ok(CaptureCheck {
        calls_sent,
        spool_records,
        bytes_per_record: spool_bytes / spool_records.max(1),
        sampled: last.len(),
        sampled_complete: complete,
        median_proxy_overhead_ms: median(
            last.iter().map(|r| r.timings.proxy_overhead_ms).collect(),
        ),
        median_backend_ms: median(last.iter().map(|r| r.timings.backend_ms).collect()),
    })
}
