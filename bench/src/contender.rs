//! `tokentap bench contender`: tokentap's capturing proxy beside LiteLLM's proxy (PyPI
//! `litellm[proxy]`), both in front of the same instant backend, in the same run, so a user can
//! reproduce the comparison on their own machine.
//!
//! The two do different work: tokentap records every call with its token ids and logprobs;
//! LiteLLM forwards the call (its default proxy: no database, no callbacks) and records
//! nothing. The figures say what each costs, not that they are alike.
//!
//! Saturated throughput first (closed loop), then latency (open loop) at one rate offered to
//! all three targets: half the slower proxy's lowest saturated throughput, so that neither is
//! measured queueing. LiteLLM's CPU is its whole process tree's (uvicorn workers).
//!
//! LiteLLM is kept on loopback: its model cost map is read from the package
//! (`LITELLM_LOCAL_MODEL_COST_MAP`), and any other HTTP(S) call it would make goes to a closed
//! loopback port (`HTTP(S)_PROXY`; loopback is exempt).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use serde::Serialize;

use super::body::{self, Api};
use super::instant_backend::InstantBackend;
use super::load::{self, Call};
use super::proxy_child::{self, ProxyChild};
use super::report::{LatencyRow, Machine, Percentiles, Throughput};

#[derive(Args)]
pub struct ContenderBenchArgs {
    /// The LiteLLM proxy's executable (`pip install 'litellm[proxy]'`).
    #[arg(long, default_value = "litellm")]
    litellm: PathBuf,
    /// LiteLLM's worker processes (`--num_workers`).
    #[arg(long, default_value_t = 1)]
    litellm_workers: usize,
    /// Ask for streamed answers (SSE) instead of whole ones.
    #[arg(long)]
    stream: bool,
    /// Concurrency levels: client connections, so the most calls in flight.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    concurrency: Vec<usize>,
    /// Size of each request body in bytes.
    #[arg(long, default_value_t = 40_000)]
    body_bytes: usize,
    /// Prompt ids the backend returns per call [default: body-bytes / 4, as `bench proxy`].
    #[arg(long)]
    prompt_ids: Option<usize>,
    #[command(flatten)]
    load: load::LoadArgs,
    /// Worker threads of tokentap's proxy.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Chat Completions only: LiteLLM (1.108.7) did not send a Messages call for an
/// OpenAI-compatible model to the engine's `/v1/chat/completions` (the instant backend, which
/// serves nothing else, answered it 404).
const API: Api = Api::Chat;

const DIRECT: &str = "direct";
const TOKENTAP: &str = "tokentap (capture on)";
const LITELLM: &str = "litellm";
const TARGETS: [&str; 3] = [DIRECT, TOKENTAP, LITELLM];

#[derive(Serialize)]
struct ContenderReport {
    command: String,
    machine: Machine,
    api: &'static str,
    stream: bool,
    body_bytes: usize,
    prompt_ids: usize,
    litellm_version: String,
    litellm_workers: usize,
    proxy_threads: usize,
    rate: f64,
    throughput: Vec<ThroughputRow>,
    latency: Vec<LatencyRow>,
}

#[derive(Serialize)]
struct ThroughputRow {
    concurrency: usize,
    target: &'static str,
    #[serde(flatten)]
    throughput: Throughput,
}

pub fn run(args: ContenderBenchArgs) -> anyhow::Result<()> {
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency needs positive levels, e.g. 1,64");
    }
    args.load.check()?;
    let version = litellm_version(&args.litellm)?;
    let chat = Bytes::from(body::chat_request(args.body_bytes, args.stream));
    let proxied = Bytes::from(API.body(&chat));
    let prompt_ids = args.prompt_ids.unwrap_or(args.body_bytes / 4);
    let backend = InstantBackend::start(prompt_ids)?;
    let dir = tempfile::Builder::new()
        .prefix("tokentap-bench-contender-")
        .tempdir()
        .context("creating a temporary directory")?;
    let mut report = ContenderReport {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::here(),
        api: API.name(),
        stream: args.stream,
        body_bytes: chat.len(),
        prompt_ids,
        litellm_version: version,
        litellm_workers: args.litellm_workers,
        proxy_threads: args.threads,
        rate: f64::NAN,
        throughput: Vec::new(),
        latency: Vec::new(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(measure(
        &args,
        &backend,
        [chat, proxied],
        dir.path(),
        &mut report,
    ))?;
    drop(rt);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

/// The three targets, each reached by its own call.
struct Targets {
    direct: Call,
    tokentap: ProxyChild,
    litellm: LiteLlm,
    /// The proxied call (its address is each proxy's).
    proxied: Call,
}

impl Targets {
    fn call(&self, target: &str) -> Call {
        let addr = match target {
            TOKENTAP => self.tokentap.addr,
            LITELLM => self.litellm.addr,
            _ => return self.direct.clone(),
        };
        Call {
            addr,
            ..self.proxied.clone()
        }
    }

    /// CPU time so far of what serves `target` (direct: this process, the load generator and
    /// the backend).
    fn cpu(&self, target: &str) -> Duration {
        match target {
            TOKENTAP => self.tokentap.cpu_time(),
            LITELLM => self.litellm.cpu_time(),
            _ => proxy_child::cpu_time_of("self"),
        }
    }

    /// A closed-loop (`rate` None) or open-loop run against `target`; its result and the CPU
    /// milliseconds per call sent.
    async fn run(
        &mut self,
        target: &str,
        conns: usize,
        rate: Option<f64>,
        warmup: Duration,
        duration: Duration,
    ) -> anyhow::Result<(load::RunResult, f64)> {
        let call = self.call(target);
        let cpu = self.cpu(target);
        let r = match rate {
            Some(rate) => load::open_loop(&call, conns, rate, warmup, duration).await?,
            None => load::closed_loop(&call, conns, warmup, duration).await?,
        };
        self.tokentap.ensure_alive()?;
        self.litellm.ensure_alive()?;
        let cpu_ms = (self.cpu(target) - cpu).as_secs_f64() * 1000.0 / r.sent.max(1) as f64;
        Ok((r, cpu_ms))
    }

    /// One call through each target: a broken set-up fails here, not as a table of errors.
    async fn check(&self) -> anyhow::Result<()> {
        for target in TARGETS {
            let (status, answer) = load::call_once(&self.call(target)).await?;
            if status != 200 || memchr::memmem::find(&answer, b"Sure").is_none() {
                bail!(
                    "a check call to {target} got {status}: {}\ntokentap's log:\n{}\nLiteLLM's log:\n{}",
                    String::from_utf8_lossy(&answer[..answer.len().min(500)]),
                    self.tokentap.log_tail(),
                    self.litellm.log_tail()
                );
            }
        }
        Ok(())
    }
}

async fn measure(
    args: &ContenderBenchArgs,
    backend: &InstantBackend,
    [chat, proxied]: [Bytes; 2],
    dir: &Path,
    report: &mut ContenderReport,
) -> anyhow::Result<()> {
    let mut tokentap = ProxyChild::spawn(backend.addr(), true, args.threads, dir, "100ms")?;
    tokentap.wait_ready(Duration::from_secs(20)).await?;
    eprintln!("bench: starting LiteLLM (about 10-30 s)");
    let mut litellm = LiteLlm::spawn(&args.litellm, args.litellm_workers, backend.addr(), dir)?;
    litellm.wait_ready(Duration::from_secs(180)).await?;
    let mut t = Targets {
        direct: Call {
            addr: backend.addr(),
            path: "/v1/chat/completions",
            body: chat,
        },
        proxied: Call {
            addr: backend.addr(),
            path: API.path(),
            body: proxied,
        },
        tokentap,
        litellm,
    };
    t.check().await?;
    let warmup = Duration::from_secs_f64(args.load.warmup);

    let duration = Duration::from_secs_f64(args.load.throughput_duration);
    for &conns in &args.concurrency {
        for target in TARGETS {
            eprintln!("bench: throughput: {target}, {conns} concurrent");
            let (r, cpu) = t.run(target, conns, None, warmup, duration).await?;
            report.throughput.push(ThroughputRow {
                concurrency: conns,
                target,
                throughput: Throughput::of(&r, cpu),
            });
        }
    }

    let slowest = report
        .throughput
        .iter()
        .filter(|r| r.target != DIRECT)
        .map(|r| r.throughput.calls_per_s)
        .fold(f64::INFINITY, f64::min);
    let rate = args.load.rate.unwrap_or(load::rate_below(slowest));
    report.rate = rate;
    let duration = Duration::from_secs_f64(args.load.duration);
    for &conns in &args.concurrency {
        let mut direct: Option<Percentiles> = None;
        for target in TARGETS {
            eprintln!("bench: latency: {target}, {conns} concurrent, {rate:.0} calls/s");
            let (r, cpu_ms_per_call) = t.run(target, conns, Some(rate), warmup, duration).await?;
            let row = LatencyRow::of(conns, target, &r, direct, cpu_ms_per_call);
            if target == DIRECT {
                direct = Some(row.latency);
            }
            report.latency.push(row);
        }
    }
    Ok(())
}

fn print_table(r: &ContenderReport) {
    println!(
        "tokentap vs LiteLLM {} ({} worker(s)): {} {}, {} B bodies, {} prompt ids, \
         tokentap on {} threads",
        r.litellm_version,
        r.litellm_workers,
        r.api,
        if r.stream { "streamed" } else { "whole" },
        r.body_bytes,
        r.prompt_ids,
        r.proxy_threads
    );
    println!("\nthroughput (closed loop, saturation)");
    println!(
        "{:>5}  {:<22} {:>9} {:>12} {:>9} {:>7}",
        "conc", "target", "calls/s", "CPU ms/call", "p50 ms", "errors"
    );
    for row in &r.throughput {
        let t = &row.throughput;
        println!(
            "{:>5}  {:<22} {:>9.0} {:>12.3} {:>9.2} {:>7}",
            row.concurrency,
            row.target,
            t.calls_per_s,
            t.cpu_ms_per_call,
            t.latency.p50_ms,
            t.errors
        );
    }
    println!("\nlatency (open loop at {:.0} calls/s)", r.rate);
    println!(
        "{:>5}  {:<22} {:>9} {:>9} {:>11} {:>11} {:>12} {:>7}",
        "conc", "target", "p50 ms", "p99 ms", "added p50", "added p99", "CPU ms/call", "errors"
    );
    let added = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:+.2}"));
    for row in &r.latency {
        println!(
            "{:>5}  {:<22} {:>9.2} {:>9.2} {:>11} {:>11} {:>12.3} {:>7}",
            row.concurrency,
            row.target,
            row.latency.p50_ms,
            row.latency.p99_ms,
            added(row.added_p50_ms),
            added(row.added_p99_ms),
            row.cpu_ms_per_call,
            row.errors + row.dropped
        );
    }
}

/// LiteLLM's version (`litellm --version`), which also checks that it is installed.
fn litellm_version(exe: &Path) -> anyhow::Result<String> {
    let out = Command::new(exe)
        .arg("--version")
        .envs(LOOPBACK_ONLY)
        .stdin(Stdio::null())
        .output()
        .with_context(|| {
            format!(
                "running {} --version (install it with pip install 'litellm[proxy]')",
                exe.display()
            )
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .split_whitespace()
        .last()
        .unwrap_or("unknown")
        .to_owned())
}

/// The environment that keeps LiteLLM on loopback: the model cost map from the package, and
/// every outgoing HTTP(S) call but loopback's to a closed loopback port. Its master key is the
/// key the load generator sends (`sk-bench`), which LiteLLM calls weak: it refuses to start
/// without a key, and this one guards a loopback listener for the run's length.
const LOOPBACK_ONLY: [(&str, &str); 10] = [
    ("LITELLM_MASTER_KEY", "sk-bench"),
    (
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY",
        "true",
    ),
    ("LITELLM_LOCAL_MODEL_COST_MAP", "True"),
    ("LITELLM_LOG", "ERROR"),
    ("HTTP_PROXY", "http://127.0.0.1:9"),
    ("HTTPS_PROXY", "http://127.0.0.1:9"),
    ("http_proxy", "http://127.0.0.1:9"),
    ("https_proxy", "http://127.0.0.1:9"),
    ("NO_PROXY", "127.0.0.1,localhost,::1"),
    ("no_proxy", "127.0.0.1,localhost,::1"),
];

/// LiteLLM's configuration: every model name goes to the backend as an OpenAI-compatible
/// model of that name.
fn litellm_config(backend: SocketAddr) -> String {
    format!(
        "model_list:\n\
         \x20 - model_name: \"*\"\n\
         \x20   litellm_params:\n\
         \x20     model: \"openai/*\"\n\
         \x20     api_base: \"http://{backend}/v1\"\n\
         \x20     api_key: \"sk-bench\"\n\
         litellm_settings:\n\
         \x20 drop_params: true\n"
    )
}

/// LiteLLM's proxy as a child process in a process group of its own (it forks uvicorn
/// workers), killed with its workers when dropped.
struct LiteLlm {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl LiteLlm {
    fn spawn(
        exe: &Path,
        workers: usize,
        backend: SocketAddr,
        dir: &Path,
    ) -> anyhow::Result<LiteLlm> {
        use std::os::unix::process::CommandExt;
        let addr = proxy_child::free_port()?;
        let config = dir.join("litellm.yaml");
        std::fs::write(&config, litellm_config(backend))?;
        let log = dir.join("litellm.log");
        let child = Command::new(exe)
            .arg("--config")
            .arg(&config)
            .args(["--host", "127.0.0.1", "--port", &addr.port().to_string()])
            .args(["--num_workers", &workers.max(1).to_string()])
            .envs(LOOPBACK_ONLY)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log)?)
            .stderr(std::fs::File::options().append(true).open(&log)?)
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        Ok(LiteLlm { child, addr, log })
    }

    /// Waits until `GET /health/liveliness` answers 200.
    async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            self.ensure_alive()?;
            if let Ok((200, _)) = load::get(self.addr, "/health/liveliness").await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "LiteLLM was not ready within {timeout:?}:\n{}",
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn ensure_alive(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait()? {
            None => Ok(()),
            Some(status) => bail!("LiteLLM exited ({status}):\n{}", self.log_tail()),
        }
    }

    /// CPU time of every process in its process group (the server and its workers).
    fn cpu_time(&self) -> Duration {
        let group = self.child.id().to_string();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return Duration::ZERO;
        };
        procs
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|pid| pid.bytes().all(|b| b.is_ascii_digit()))
            .filter(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                // After the parenthesised command name: state, ppid, pgrp.
                let rest = stat.rsplit_once(')').map_or("", |x| x.1);
                rest.split_whitespace().nth(2) == Some(group.as_str())
            })
            .map(|pid| proxy_child::cpu_time_of(&pid))
            .sum()
    }

    fn log_tail(&self) -> String {
        proxy_child::log_tail(&self.log)
    }
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the process group this child leads (not reaped yet: waited below).
        unsafe {
            libc::kill(-(self.child.id() as libc::pid_t), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration LiteLLM reads is YAML that sends every model to the backend.
    #[test]
    fn the_litellm_config_routes_every_model_to_the_backend() {
        let yaml = litellm_config("127.0.0.1:4321".parse().unwrap());
        assert_eq!(
            yaml,
            "model_list:\n  - model_name: \"*\"\n    litellm_params:\n      model: \"openai/*\"\n      \
             api_base: \"http://127.0.0.1:4321/v1\"\n      api_key: \"sk-bench\"\nlitellm_settings:\n  \
             drop_params: true\n"
        );
    }
}
