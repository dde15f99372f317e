//! Benchmark of `tokentap node-agent` with real containers (not a test: it prints figures).
//!
//!   cargo run --release -p tokentap-e2e --example bench_node_agent [-- CONTAINERS]
//!
//! 1. Container start → attached: labelled containers started outside the capture parent (the
//!    case with a window; below the parent a container is redirected before it starts), the
//!    gap between Docker's `State.StartedAt` and the agent's `attached_at_ms`, p50/p99 over
//!    50 containers, started one after another.
//! 2. The agent's RSS and CPU while CONTAINERS (default 200) labelled containers are watched:
//!    during their start, and over 30 s idle.

use std::time::{Duration, Instant};

use tokentap_e2e::containers::{Dockerd, BASE_IMAGE};
use tokentap_e2e::node_agent::NodeAgent;
use tokentap_e2e::procs::free_port;
use tokentap_e2e::scripted::{always, Reply, ScriptedBackend, Tokens};

fn unix_ms(rfc3339: &str) -> u64 {
    let out = std::process::Command::new("date")
        .args(["-d", rfc3339, "+%s%N"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse::<u64>()
        .unwrap()
        / 1_000_000
}

/// (RSS bytes, CPU seconds) of a process.
fn usage(pid: u32) -> (u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    (rss_kb * 1024, ticks / 100.0)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let watched: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let dockerd = Dockerd::start().await;
    dockerd.import_base_image();
    let backend = ScriptedBackend::start(Tokens::Fake, always(Reply::text("x"))).await;
    let dir = tempfile::tempdir().unwrap();
    let args: Vec<String> = [
        "--source",
        "docker",
        "--docker-host",
        &dockerd.host(),
        "--listen-ip",
        &dockerd.gateway().to_string(),
        "--listen-port",
        &free_port().to_string(),
        "--backend",
        &backend.url,
        "--backend-kind",
        "vllm",
        "--docker-cgroup-parent",
        &format!("/tokentap-capture-bench-{}", std::process::id()),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let agent = NodeAgent::start(dir.path(), "agent.log", &args).await;
    let pid = agent.pid();
    let (rss0, cpu0) = usage(pid);

    let mut gaps = Vec::new();
    let started = Instant::now();
    for i in 0..watched {
        let name = format!("bench-{i}");
        dockerd.ok(&[
            "run",
            "-d",
            "--name",
            &name,
            "--label",
            "tokentap.io/capture=true",
            BASE_IMAGE,
            "sleep",
            "3600",
        ]);
        if i < 50 {
            let w = agent
                .wait_workloads("attached", Duration::from_secs(10), |w| {
                    w.iter()
                        .any(|x| x["display"] == format!("container {name}"))
                })
                .await;
            let attached = w
                .iter()
                .find(|x| x["display"] == format!("container {name}"))
                .unwrap()["attached_at_ms"]
                .as_u64()
                .unwrap();
            let started_at =
                unix_ms(&dockerd.ok(&["inspect", "-f", "{{.State.StartedAt}}", &name]));
            gaps.push(attached.saturating_sub(started_at));
        }
    }
    let churn = started.elapsed();
    agent
        .wait_workloads("all watched", Duration::from_secs(60), |w| {
            w.len() == watched
        })
        .await;
    let (rss1, cpu1) = usage(pid);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let (rss2, cpu2) = usage(pid);
    gaps.sort_unstable();
    println!(
        "container start → attached (own cgroup, {} containers): p50 {} ms, p99 {} ms, max {} ms",
        gaps.len(),
        percentile(&gaps, 0.5),
        percentile(&gaps, 0.99),
        gaps.last().unwrap()
    );
    println!("agent at start: RSS {:.1} MiB", rss0 as f64 / 1048576.0);
    println!("starting {watched} containers ({:.0} s): agent CPU {:.2} s ({:.1}% of one core), RSS {:.1} MiB", churn.as_secs_f64(), cpu1 - cpu0, 100.0 * (cpu1 - cpu0) / churn.as_secs_f64(), rss1 as f64 / 1048576.0);
    println!(
        "{watched} watched, 30 s idle: agent CPU {:.3} s ({:.2}% of one core), RSS {:.1} MiB",
        cpu2 - cpu1,
        100.0 * (cpu2 - cpu1) / 30.0,
        rss2 as f64 / 1048576.0
    );
}
