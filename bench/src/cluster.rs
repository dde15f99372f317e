//! `tokentap bench cluster`: rollout nodes sharing a bus, at saturation on this machine. One
//! group of `--samples` samples of the `command` preset (curl agents against the instant
//! synthetic engine) is submitted at once, to one node alone (no bus), to one node on a real
//! nats-server, and to `--nodes` nodes on it, each node with the same agent slots. Samples
//! per hour for each, and the CPU each node process and nats-server spent per sample: on one
//! 2-core machine the nodes share the cores, so the figure that carries to N machines is a
//! node's own cost per sample, not the wall-clock speed-up.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use serde_json::json;

use super::bus::{cpu_seconds, start_nats};
use super::instant_backend::InstantBackend;
use super::report::Machine;
use super::rollout::{check_completed, command_task, figures, project, NodeSetup, StartedNode};

#[derive(Args)]
pub struct ClusterBenchArgs {
    /// Samples submitted (one group), at once.
    #[arg(long, default_value_t = 24)]
    samples: u32,
    /// Nodes sharing the bus in the last setting.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Agent slots per node.
    #[arg(long, default_value_t = 2)]
    run_workers: usize,
    /// Samples prepared ahead of a free slot, per node.
    #[arg(long, default_value_t = 1)]
    prewarm: usize,
    /// Model calls per agent.
    #[arg(long, default_value_t = 3)]
    turns: usize,
    /// Pause between an agent's calls (its tool and model time), in milliseconds.
    #[arg(long, default_value_t = 2000)]
    think_ms: u64,
    /// Python files in the task's workspace.
    #[arg(long, default_value_t = 50)]
    files: usize,
    /// The nats-server binary (2.9 or newer).
    #[arg(long, default_value = "nats-server")]
    nats_server: PathBuf,
    /// Print the figures as JSON too.
    #[arg(long)]
    json: bool,
}

struct Setting {
    name: String,
    nodes: usize,
    samples_per_hour: f64,
    wall_s: f64,
    slot_utilization: f64,
    /// CPU seconds per sample: of the node processes (all of them; agents not included) and
    /// of nats-server.
    node_cpu_per_sample: f64,
    nats_cpu_per_sample: f64,
}

pub fn run(args: ClusterBenchArgs) -> anyhow::Result<()> {
    let m = Machine::here();
    println!(
        "tokentap bench cluster — {} samples of the `command` preset ({} model calls {} ms apart, then a test), {} agent slots + {} prewarmed per node, instant synthetic engine; saturation (all submitted at once)",
        args.samples, args.turns, args.think_ms, args.run_workers, args.prewarm
    );
    println!(
        "  machine: {} cores ({}), load average at start: {}",
        m.cores, m.cpu, m.load_average
    );
    let settings = [
        measure(&args, "1 node, no bus", 1, false)?,
        measure(&args, "1 node on the bus", 1, true)?,
        measure(
            &args,
            &format!("{} nodes on the bus", args.nodes),
            args.nodes,
            true,
        )?,
    ];
    println!();
    println!(
        "  {:<22} {:>10} {:>12} {:>10} {:>22} {:>22}",
        "setting", "wall (s)", "samples/h", "slots used", "node CPU s/sample", "CPU s/sample nats"
    );
    for s in &settings {
        println!(
            "  {:<22} {:>10.1} {:>12.0} {:>9.0}% {:>22.3} {:>22.3}",
            s.name,
            s.wall_s,
            s.samples_per_hour,
            s.slot_utilization * 100.0,
            s.node_cpu_per_sample,
            s.nats_cpu_per_sample
        );
    }
    if args.json {
        let j: Vec<_> = settings
            .iter()
            .map(|s| {
                json!({
                    "setting": s.name, "nodes": s.nodes, "wall_s": s.wall_s,
                    "samples_per_hour": s.samples_per_hour,
                    "slot_utilization": s.slot_utilization,
                    "node_cpu_s_per_sample": s.node_cpu_per_sample,
                    "nats_cpu_s_per_sample": s.nats_cpu_per_sample,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&j)?);
    }
    Ok(())
}

fn measure(
    args: &ClusterBenchArgs,
    name: &str,
    nodes: usize,
    bus: bool,
) -> anyhow::Result<Setting> {
    let tmp = tempfile::tempdir()?;
    let engine = InstantBackend::start(64)?;
    let proj = tmp.path().join("project");
    project(&proj, args.files)?;
    let nats = if bus {
        Some(start_nats(&args.nats_server, &tmp.path().join("nats"))?)
    } else {
        None
    };
    let nats_cpu0 = nats
        .as_ref()
        .map_or(0.0, |n| cpu_seconds(Some(n.child.id())));
    let mut started: Vec<StartedNode> = Vec::new();
    for i in 0..nodes {
        let mut extra = Vec::new();
        if let Some(n) = &nats {
            extra.extend([
                "--bus".to_owned(),
                n.url.clone(),
                "--node-id".to_owned(),
                format!("bench-node-{i}"),
            ]);
        }
        let setup = NodeSetup {
            engine: format!("http://{}", engine.addr()),
            run_workers: args.run_workers,
            prewarm: args.prewarm,
            token: format!("bench-{}", std::process::id()),
            extra,
        };
        started.push(setup.spawn(tmp.path(), &format!("node-{i}"))?);
    }
    let cpu0: Vec<f64> = started
        .iter()
        .map(|n| cpu_seconds(Some(n.child.0.id())))
        .collect();
    let spec = command_task(&proj, args.samples, args.turns, args.think_ms);
    let samples = super::rollout::run_group(&started[0], &spec)?;
    check_completed(&samples)?;
    let node_cpu: f64 = started
        .iter()
        .zip(&cpu0)
        .map(|(n, c0)| cpu_seconds(Some(n.child.0.id())) - c0)
        .sum();
    let nats_cpu = nats
        .as_ref()
        .map_or(0.0, |n| cpu_seconds(Some(n.child.id())) - nats_cpu0);
    let f = figures(&samples, args.prewarm, args.run_workers * nodes)
        .context("computing the figures")?;
    let per_sample = |cpu: f64| cpu / samples.len().max(1) as f64;
    Ok(Setting {
        name: name.to_owned(),
        nodes,
        samples_per_hour: f.samples_per_hour,
        wall_s: f.wall_s,
        slot_utilization: f.slot_utilization,
        node_cpu_per_sample: per_sample(node_cpu),
        nats_cpu_per_sample: per_sample(nats_cpu),
    })
}
