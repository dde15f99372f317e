//! `tokentap bench bus`: records through NATS JetStream at saturation, the spool in front. A
//! spool of sessions whose records each carry a 40 KB harness request is published by the
//! product's publisher (record id as message id, cursor on ack) to a real `nats-server -js`
//! started here on loopback; then one worker-group member (the product's) consumes every
//! partition and reconstructs the sessions. Reported: records/s and MB/s for each phase, and
//! the CPU seconds of this process and of nats-server.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;
use tokentap_bus::group::Member;
use tokentap_bus::partition::{GroupMetrics, WorkerContext};
use tokentap_bus::publish::{publish_spool, PublishStop};
use tokentap_bus::topology::Topology;
use tokentap_bus::BusConnect;
use tokentap_proxy::metrics::{counter_in, gauge_in};
use tokentap_reconstruct::synthetic::LongSession;
use tokentap_reconstruct::{LiveOptions, TraceSink};
use tokentap_spool::downstream::DownstreamMetrics;
use tokentap_spool::{SpoolConfig, SpoolWriter};

use super::report::Machine;

#[derive(Args)]
pub struct BusBenchArgs {
    /// Sessions in the spool (each of `--calls` records).
    #[arg(long, default_value_t = 100)]
    sessions: usize,
    /// Calls per session.
    #[arg(long, default_value_t = 20)]
    calls: usize,
    /// Size of each record's harness request body in bytes.
    #[arg(long, default_value_t = 40_000)]
    body_bytes: usize,
    /// The nats-server binary (2.9 or newer).
    #[arg(long, default_value = "nats-server")]
    nats_server: PathBuf,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Phase {
    records: u64,
    seconds: f64,
    records_per_s: f64,
    mb_per_s: f64,
    /// CPU seconds of this process (publisher or worker) during the phase.
    cpu_s_tokentap: f64,
    /// CPU seconds of nats-server during the phase.
    cpu_s_nats: f64,
}

#[derive(Serialize)]
struct BusReport {
    command: String,
    machine: Machine,
    records: usize,
    record_bytes_mean: u64,
    publish: Phase,
    consume: Phase,
}

pub(crate) struct Nats {
    pub child: Child,
    pub url: String,
}

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

pub(crate) fn start_nats(bin: &Path, dir: &Path) -> anyhow::Result<Nats> {
    let port = free_port()?;
    let child = Command::new(bin)
        .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string()])
        .arg("-sd")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {} (Debian: nats-server)", bin.display()))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nats-server did not listen on 127.0.0.1:{port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(Nats {
        child,
        url: format!("nats://127.0.0.1:{port}"),
    })
}

/// User + system CPU seconds of process `pid` (this process with `None`).
pub(crate) fn cpu_seconds(pid: Option<u32>) -> f64 {
    let path = pid.map_or("/proc/self/stat".to_owned(), |p| format!("/proc/{p}/stat"));
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    // Fields after the parenthesised command: utime and stime are the 12th and 13th.
    let rest = stat.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / ticks.max(1.0)
}

pub fn run(args: BusBenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let spool = dir.path().join("spool");
    let body = serde_json::from_slice::<serde_json::Value>(&super::body::chat_request(
        args.body_bytes,
        false,
    ))?;
    let shape = LongSession {
        calls: args.calls,
        first_prompt: 2_000,
        last_prompt: 10_000,
        sampled: 200,
        subagent_every: 0,
        subagent_calls: 0,
        subagent_prompt: 0,
    };
    let mut writer = SpoolWriter::open(&spool, SpoolConfig::default())?;
    let mut records = 0usize;
    let mut bytes = 0u64;
    for s in 0..args.sessions {
        let mut batch = shape.records(&format!("bench-{s}"), s as u64 + 1);
        for r in &mut batch {
            r.request.body = Some(tokentap_schema::RawJson::from_value(&body));
            r.request.body_bytes = args.body_bytes as u64;
            let mut line = Vec::new();
            tokentap_schema::ndjson::encode_line(r, &mut line)?;
            bytes += line.len() as u64;
        }
        records += batch.len();
        writer.append_batch(&batch)?;
    }
    writer.sync()?;
    drop(writer);
    let nats = start_nats(&args.nats_server, &dir.path().join("nats"))?;
    let nats_pid = nats.child.id();
    let bus = BusConnect {
        url: nats.url.clone(),
        token: None,
        user: None,
        ca: None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let registry = prometheus::Registry::new();
    let group_metrics = GroupMetrics::new(
        |name, help| counter_in(&registry, name, help),
        |name, help| gauge_in(&registry, name, help),
    );
    let mb = bytes as f64 / 1e6;

    // Publish: the spool, drained.
    let stop = PublishStop {
        drain: Arc::new(AtomicBool::new(true)),
        drain_deadline: Duration::from_secs(60),
    };
    let (cpu0, ncpu0, t0) = (
        cpu_seconds(None),
        cpu_seconds(Some(nats_pid)),
        Instant::now(),
    );
    let totals = rt.block_on(publish_spool(
        &spool,
        &bus,
        16,
        &stop,
        DownstreamMetrics::unregistered(),
    ))?;
    let seconds = t0.elapsed().as_secs_f64();
    let publish = Phase {
        records: totals.records,
        seconds,
        records_per_s: totals.records as f64 / seconds,
        mb_per_s: mb / seconds,
        cpu_s_tokentap: cpu_seconds(None) - cpu0,
        cpu_s_nats: cpu_seconds(Some(nats_pid)) - ncpu0,
    };

    // Consume: one member takes every partition and reconstructs (sessions finished as soon
    // as their records are read: idle 0 by record time).
    let out = Arc::new(Mutex::new(TraceSink::open(&dir.path().join("traces"))?));
    let live = LiveOptions {
        session_idle: Duration::ZERO,
        ..LiveOptions::default()
    };
    let consumed = group_metrics.records.clone();
    let finished = group_metrics.sessions_finished.clone();
    let (cpu0, ncpu0, t0) = (
        cpu_seconds(None),
        cpu_seconds(Some(nats_pid)),
        Instant::now(),
    );
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let member = rt.block_on(async {
        let client = tokentap_bus::connect(&bus, "bench").await?;
        let topology = Topology::ensure(tokentap_bus::jetstream(client), 16).await?;
        anyhow::Ok(Member::new(WorkerContext {
            topology,
            member: "bench".into(),
            options: live,
            out,
            metrics: group_metrics,
        }))
    })?;
    let task = rt.spawn(member.run(stop_rx));
    let deadline = Instant::now() + Duration::from_secs(600);
    while consumed.get() < records as u64 || finished.get() < args.sessions as u64 {
        if Instant::now() > deadline {
            bail!("consumed {} of {records} records in 600 s", consumed.get());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let seconds = t0.elapsed().as_secs_f64();
    let consume = Phase {
        records: consumed.get(),
        seconds,
        records_per_s: consumed.get() as f64 / seconds,
        mb_per_s: mb / seconds,
        cpu_s_tokentap: cpu_seconds(None) - cpu0,
        cpu_s_nats: cpu_seconds(Some(nats_pid)) - ncpu0,
    };
    let _ = stop_tx.send(true);
    rt.block_on(task)??;

    let report = BusReport {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        machine: Machine::here(),
        records,
        record_bytes_mean: bytes / records.max(1) as u64,
        publish,
        consume,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} records of {} sessions, {:.1} KB each ({:.0} MB), {}-byte requests; {} cores, load {}",
        report.records,
        args.sessions,
        report.record_bytes_mean as f64 / 1e3,
        mb,
        args.body_bytes,
        report.machine.cores,
        report.machine.load_average
    );
    println!("phase      records/s   MB/s   seconds   CPU s tokentap   CPU s nats-server");
    for (name, p) in [("publish", &report.publish), ("consume", &report.consume)] {
        println!(
            "{name:<9} {:>10.0} {:>6.1} {:>9.2} {:>16.2} {:>19.2}",
            p.records_per_s, p.mb_per_s, p.seconds, p.cpu_s_tokentap, p.cpu_s_nats
        );
    }
    println!("(throughput at saturation: the spool published as fast as the server acks; one worker consuming all 16 partitions until every session's traces are published and written)");
    Ok(())
}
