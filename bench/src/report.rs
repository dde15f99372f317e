//! The benchmark's results: a table for people, JSON for machines. Targets are shown beside
//! the figures as PASS/MISS; nothing here fails the run.

use serde::Serialize;

use super::load::RunResult;

/// Progress goes to stderr, so that `--json` output stays clean.
pub fn progress(msg: &str) {
    eprintln!("bench: {msg}");
}

/// The targets.
pub const ADDED_P50_MS: f64 = 0.5;
pub const ADDED_P99_MS: f64 = 2.0;
pub const MIN_CALLS_PER_S: f64 = 2500.0;
pub const MAX_OFF_ON_RATIO: f64 = 1.10;
/// CPU of the capture-on proxy per call at saturation, ms.
pub const MAX_CPU_MS_PER_CALL: f64 = 0.5;
/// A record's size: at most this many times the harness request …
pub const MAX_RECORD_PER_REQUEST: f64 = 1.3;
/// … plus this many bytes per token id it carries.
pub const MAX_RECORD_BYTES_PER_TOKEN: f64 = 4.0;

#[derive(Serialize)]
pub struct Report {
    pub command: String,
    pub machine: Machine,
    pub config: Config,
    /// Open loop at a fixed offered rate: latency.
    pub latency: Vec<LatencyRow>,
    /// Closed loop at saturation: throughput.
    pub throughput: Vec<ThroughputRow>,
    pub targets: Vec<TargetCheck>,
    pub capture: Option<CaptureCheck>,
}

#[derive(Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu: String,
    pub kernel: String,
    /// 1, 5 and 15 minute load averages when the run began: other work skews the figures.
    pub load_average: String,
    pub unix_time: u64,
}

impl Machine {
    pub fn here() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|x| x.1))
            .unwrap_or("unknown")
            .trim()
            .to_owned();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        let load_average = std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ");
        Machine {
            load_average,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu,
            kernel,
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

#[derive(Serialize)]
pub struct Config {
    pub duration_s: f64,
    pub throughput_duration_s: f64,
    pub warmup_s: f64,
    /// Offered rate of the latency runs, calls/s.
    pub rate: f64,
    /// Whether it was derived from the measured saturation rather than given.
    pub rate_auto: bool,
    pub concurrency: Vec<usize>,
    pub body_bytes: usize,
    /// The wire API of the proxied calls and their body size.
    pub api: &'static str,
    pub proxied_body_bytes: usize,
    pub prompt_ids: usize,
    pub stream: bool,
    pub proxy_threads: usize,
    /// The capture-on proxy's spool fsync policy.
    pub fsync: String,
}

/// Latency percentiles of one run, in milliseconds.
#[derive(Serialize, Clone, Copy, Default)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    pub fn of(r: &RunResult) -> Percentiles {
        let h = &r.latency_us;
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        Percentiles {
            p50_ms: ms(0.5),
            p90_ms: ms(0.9),
            p99_ms: ms(0.99),
            max_ms: h.max() as f64 / 1000.0,
        }
    }
}

#[derive(Serialize)]
pub struct LatencyRow {
    pub concurrency: usize,
    pub target: &'static str,
    #[serde(flatten)]
    pub latency: Percentiles,
    /// Proxied minus direct at the same concurrency, same run.
    pub added_p50_ms: Option<f64>,
    pub added_p99_ms: Option<f64>,
    pub ok: u64,
    pub errors: u64,
    pub dropped: u64,
    pub achieved_rate: f64,
    /// As in [`Throughput::cpu_ms_per_call`].
    pub cpu_ms_per_call: f64,
}

impl LatencyRow {
    /// The row of run `r` against `target`; `direct` is the direct run's percentiles at the
    /// same concurrency (none for the direct run itself), for the added latency.
    pub fn of(
        concurrency: usize,
        target: &'static str,
        r: &RunResult,
        direct: Option<Percentiles>,
        cpu_ms_per_call: f64,
    ) -> LatencyRow {
        let p = Percentiles::of(r);
        LatencyRow {
            concurrency,
            target,
            latency: p,
            added_p50_ms: direct.map(|d| p.p50_ms - d.p50_ms),
            added_p99_ms: direct.map(|d| p.p99_ms - d.p99_ms),
            ok: r.ok,
            errors: r.errors,
            dropped: r.dropped,
            achieved_rate: r.calls_per_s(),
            cpu_ms_per_call,
        }
    }
}

#[derive(Serialize)]
pub struct Throughput {
    pub calls_per_s: f64,
    /// CPU time per call of the process under test (for `direct`: this process, i.e. the
    /// load generator and the backend), over the whole run.
    pub cpu_ms_per_call: f64,
    #[serde(flatten)]
    pub latency: Percentiles,
    pub errors: u64,
}

impl Throughput {
    pub fn of(r: &RunResult, cpu_ms_per_call: f64) -> Throughput {
        Throughput {
            calls_per_s: r.calls_per_s(),
            cpu_ms_per_call,
            latency: Percentiles::of(r),
            errors: r.errors,
        }
    }
}

#[derive(Serialize)]
pub struct ThroughputRow {
    pub concurrency: usize,
    pub direct: Throughput,
    pub capture_off: Throughput,
    pub capture_on: Throughput,
    /// capture-off calls/s over capture-on calls/s.
    pub off_on_ratio: f64,
}

#[derive(Serialize)]
pub struct TargetCheck {
    pub name: String,
    pub target: String,
    pub measured: f64,
    pub pass: bool,
}

#[derive(Serialize)]
pub struct CaptureCheck {
    /// Calls sent to the capture-on proxy, warm-up and checks included.
    pub calls_sent: u64,
    /// Lines in its spool after it stopped.
    pub spool_records: u64,
    /// Average record size.
    pub bytes_per_record: u64,
    /// How many of the last records were read back, and how many of them hold the complete
    /// token data the backend sent (all prompt ids, completion ids and logprobs, no error).
    pub sampled: usize,
    pub sampled_complete: usize,
    /// Medians over the last records of the proxy's own timing split.
    pub median_proxy_overhead_ms: f64,
    pub median_backend_ms: f64,
}

impl Report {
    /// Fills in the target checks from the rows (at the highest concurrency measured).
    pub fn check_targets(&mut self) {
        let top = self.config.concurrency.iter().copied().max().unwrap_or(0);
        let mut checks = Vec::new();
        if let Some(r) = self
            .latency
            .iter()
            .find(|r| r.concurrency == top && r.target == TARGET_ON)
        {
            if let (Some(p50), Some(p99)) = (r.added_p50_ms, r.added_p99_ms) {
                checks.push(check(
                    format!("added p50 latency, capture on, {top} concurrent (ms)"),
                    format!("<= {ADDED_P50_MS}"),
                    p50,
                    p50 <= ADDED_P50_MS,
                ));
                checks.push(check(
                    format!("added p99 latency, capture on, {top} concurrent (ms)"),
                    format!("<= {ADDED_P99_MS}"),
                    p99,
                    p99 <= ADDED_P99_MS,
                ));
            }
        }
        if let Some(r) = self.throughput.iter().find(|r| r.concurrency == top) {
            let on = r.capture_on.calls_per_s;
            checks.push(check(
                format!("throughput, capture on, {top} concurrent (calls/s)"),
                format!(">= {MIN_CALLS_PER_S}"),
                on,
                on >= MIN_CALLS_PER_S,
            ));
            checks.push(check(
                format!("capture-off/capture-on throughput, {top} concurrent"),
                format!("<= {MAX_OFF_ON_RATIO}"),
                r.off_on_ratio,
                r.off_on_ratio <= MAX_OFF_ON_RATIO,
            ));
            let cpu = r.capture_on.cpu_ms_per_call;
            checks.push(check(
                format!("proxy CPU per call, capture on, {top} concurrent (ms)"),
                format!("<= {MAX_CPU_MS_PER_CALL}"),
                cpu,
                cpu <= MAX_CPU_MS_PER_CALL,
            ));
        }
        if let Some(cap) = &self.capture {
            // The instant backend's answer: prompt ids plus 8 sampled tokens.
            let tokens = self.config.prompt_ids as f64 + 8.0;
            let limit = MAX_RECORD_PER_REQUEST * self.config.proxied_body_bytes as f64
                + MAX_RECORD_BYTES_PER_TOKEN * tokens;
            checks.push(check(
                "bytes per record".into(),
                format!(
                    "<= {limit:.0} ({MAX_RECORD_PER_REQUEST} x request + {MAX_RECORD_BYTES_PER_TOKEN} B x {tokens:.0} tokens)"
                ),
                cap.bytes_per_record as f64,
                cap.bytes_per_record as f64 <= limit,
            ));
        }
        self.targets = checks;
    }

    pub fn print_table(&self) {
        let m = &self.machine;
        let c = &self.config;
        println!("tokentap bench proxy");
        println!("  command:  {}", self.command);
        println!(
            "  machine:  {} cores ({}), Linux {}; load generator, proxy and backend share them",
            m.cores, m.cpu, m.kernel
        );
        println!(
            "            load average at start: {} (other work on the machine skews these figures)",
            m.load_average
        );
        println!(
            "  request:  {} B Chat Completions body (Qwen Code-like), {}; backend answers {} prompt ids + 8 tokens",
            c.body_bytes,
            if c.stream { "streaming" } else { "non-streaming" },
            c.prompt_ids
        );
        if c.api != "Chat Completions" {
            println!(
                "            proxied calls speak {}: the same content as a {} B body; direct calls stay Chat Completions",
                c.api, c.proxied_body_bytes
            );
        }
        println!(
            "  proxy:    tokentap proxy --backend-kind vllm --threads {} --no-reconstruct (capture on: spool in a temp dir, fsync {})",
            c.proxy_threads, c.fsync
        );
        if !self.latency.is_empty() {
            println!();
            println!(
                "LATENCY: open loop, {:.0} calls/s offered{} on a fixed schedule; latency from each call's scheduled send time;",
                c.rate,
                if c.rate_auto {
                    " (half the capture-on proxy's lowest saturated throughput, at most 500)"
                } else {
                    ""
                }
            );
            println!(
                "         {} s measured after {} s warm-up; concurrency = client connections = most calls in flight",
                c.duration_s, c.warmup_s
            );
            println!(
                "{:>5}  {:<18} {:>8} {:>8} {:>8} {:>8}  {:>9} {:>9}  {:>8} {:>6} {:>7}  {:>11}",
                "conc",
                "target",
                "p50 ms",
                "p90 ms",
                "p99 ms",
                "max ms",
                "+p50 ms",
                "+p99 ms",
                "calls/s",
                "errors",
                "dropped",
                "CPU ms/call"
            );
            for r in &self.latency {
                let l = &r.latency;
                println!(
                    "{:>5}  {:<18} {:>8.3} {:>8.3} {:>8.3} {:>8.3}  {:>9} {:>9}  {:>8.0} {:>6} {:>7}  {:>11.3}",
                    r.concurrency,
                    r.target,
                    l.p50_ms,
                    l.p90_ms,
                    l.p99_ms,
                    l.max_ms,
                    opt(r.added_p50_ms),
                    opt(r.added_p99_ms),
                    r.achieved_rate,
                    r.errors,
                    r.dropped,
                    r.cpu_ms_per_call
                );
            }
        }
        if !self.throughput.is_empty() {
            println!();
            println!(
                "THROUGHPUT: closed loop at saturation (each client sends its next call when the last is answered);"
            );
            println!(
                "            {} s measured after {} s warm-up",
                c.throughput_duration_s, c.warmup_s
            );
            println!(
                "{:>5}  {:>14} {:>17} {:>16}  {:>7}  {:>22}  {:>25}",
                "conc",
                "direct call/s",
                "capture-off call/s",
                "capture-on call/s",
                "off/on",
                "p50 ms direct/off/on",
                "CPU ms/call direct/off/on"
            );
            for r in &self.throughput {
                println!(
                    "{:>5}  {:>14.0} {:>17.0} {:>16.0}  {:>7.3}  {:>6.2} /{:>6.2} /{:>6.2}  {:>7.3} /{:>7.3} /{:>7.3}",
                    r.concurrency,
                    r.direct.calls_per_s,
                    r.capture_off.calls_per_s,
                    r.capture_on.calls_per_s,
                    r.off_on_ratio,
                    r.direct.latency.p50_ms,
                    r.capture_off.latency.p50_ms,
                    r.capture_on.latency.p50_ms,
                    r.direct.cpu_ms_per_call,
                    r.capture_off.cpu_ms_per_call,
                    r.capture_on.cpu_ms_per_call
                );
            }
            let errors: u64 = self
                .throughput
                .iter()
                .map(|r| r.direct.errors + r.capture_off.errors + r.capture_on.errors)
                .sum();
            if errors > 0 {
                println!("  ({errors} failed calls in the throughput runs)");
            }
            println!(
                "  CPU ms/call: CPU time of the process serving the calls over the run, per call sent; for"
            );
            println!(
                "  direct that is this process (load generator + instant backend); for the proxies, the proxy alone"
            );
        }
        if let Some(cap) = &self.capture {
            println!();
            println!(
                "CAPTURE: {} calls sent to the capture-on proxy, {} records in its spool ({} KB each);",
                cap.calls_sent,
                cap.spool_records,
                cap.bytes_per_record / 1000
            );
            println!(
                "         of the last {} records, {} hold all the token data the backend sent",
                cap.sampled, cap.sampled_complete
            );
            println!(
                "         the proxy's own split (median of last records): {:.3} ms in the proxy, {:.3} ms waiting on the backend",
                cap.median_proxy_overhead_ms, cap.median_backend_ms
            );
        }
        if !self.targets.is_empty() {
            println!();
            println!("TARGETS (informational)");
            for t in &self.targets {
                println!(
                    "  {:<4} {:<58} {:>10.3}  (target {})",
                    if t.pass { "PASS" } else { "MISS" },
                    t.name,
                    t.measured,
                    t.target
                );
            }
            println!(
                "  for comparison: LiteLLM's published proxy overhead is 2/8/13 ms p50/p95/p99"
            );
        }
    }
}

pub const TARGET_DIRECT: &str = "direct";
pub const TARGET_OFF: &str = "proxy capture-off";
pub const TARGET_ON: &str = "proxy capture-on";

fn check(name: String, target: String, measured: f64, pass: bool) -> TargetCheck {
    TargetCheck {
        name,
        target,
        measured,
        pass,
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:+.3}"))
}
