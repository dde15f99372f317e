//! `tokentap`: the command line. Parses flags and composes the crates; no domain logic here.

mod await_capture_cmd;
mod bus_cmd;
mod ca_cmd;
mod downstream;
mod generate_cmd;
mod health_cmd;
mod node_agent_cmd;
mod proxy_cmd;
mod reconstruct_cmd;
mod records_cmd;
mod run_cmd;
mod runtime;
mod serve_cmd;
mod ship_cmd;
mod signals;
mod view_cmd;
mod webhook_cmd;
mod worker_cmd;

use clap::{Parser, Subcommand};

/// The proxy allocates per call (JSON values, buffers); jemalloc roughly halved its CPU per call
/// in `tokentap bench proxy` compared with glibc malloc. On by default (the `jemalloc`
/// feature); only scripts/demo's first build leaves it out, as its C build is the longest step
/// of that build.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "tokentap",
    version,
    about = "Capture token-faithful LLM traffic from any agent harness for RL training",
    long_about = "tokentap sits on the model API between an agent harness and an inference engine, \
answers the harness in exactly the provider shape it expects, and records the exact prompt and \
sampled token ids (with logprobs) of every call."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct SandboxShimArgs {
    /// Forward this loopback address (the capture's) to `--unix`.
    #[arg(long, requires = "unix")]
    listen: Option<std::net::SocketAddr>,
    #[arg(long)]
    unix: Option<std::path::PathBuf>,
    /// Run the command as this uid (and `--gid`).
    #[arg(long, requires = "gid")]
    uid: Option<u32>,
    #[arg(long)]
    gid: Option<u32>,
    /// Write one byte here once the sandbox is up.
    #[arg(long)]
    ready_fd: Option<i32>,
    #[arg(last = true, required = true)]
    command: Vec<std::ffi::OsString>,
}

#[derive(Subcommand)]
enum Command {
    /// Run the capture proxy in front of an inference engine.
    Proxy(proxy_cmd::ProxyArgs),
    /// Run a command with its model traffic captured transparently (eBPF redirect + TLS
    /// interception; root): no base URL needed, even for hard-coded endpoints.
    Run(run_cmd::RunArgs),
    /// Capture an existing cgroup's model traffic transparently (e.g. a pod's), until stopped.
    Sidecar(run_cmd::SidecarArgs),
    /// One per host: capture the containers and pods marked for it (Docker Engine API,
    /// Kubernetes API), attaching the redirect to each one's cgroup (root).
    NodeAgent(node_agent_cmd::NodeAgentArgs),
    /// In a pod's init container: wait until the node agent captures this pod.
    AwaitCapture(await_capture_cmd::AwaitCaptureArgs),
    /// The mutating admission webhook that injects capture into pods, and its certificate.
    #[command(subcommand)]
    Webhook(webhook_cmd::WebhookCmd),
    /// Exit 0 when a URL answers 2xx (exec probes in images without curl).
    Health(health_cmd::HealthArgs),
    /// The local CA transparent capture mints certificates from.
    Ca(ca_cmd::CaArgs),
    /// Inspect the capture records in a spool.
    #[command(subcommand)]
    Records(records_cmd::RecordsCmd),
    /// A rollout node: tasks in over HTTP, samples run under capture, rewarded trajectories
    /// out.
    Serve(serve_cmd::ServeArgs),
    /// Offline data generation: a task file through the rollout pipeline in batch; accepted
    /// samples become an SFT dataset (resumable).
    Generate(generate_cmd::GenerateArgs),
    /// Inside a rollout sandbox: forwards the capture port to the node's socket while the
    /// agent runs (started by the node, not by hand).
    #[command(hide = true)]
    SandboxShim(SandboxShimArgs),
    /// Receive records shipped by proxies (--ship-to) and rebuild trajectories as they arrive.
    Worker(worker_cmd::WorkerArgs),
    /// Ship a spool's records to a worker (what `proxy --ship-to` does, for an existing spool).
    Ship(ship_cmd::ShipArgs),
    /// Rebuild token-faithful trajectories from a spool (offline).
    Reconstruct(reconstruct_cmd::ReconstructArgs),
    /// Inspect trajectory files.
    #[command(subcommand)]
    Trajectories(reconstruct_cmd::TrajectoriesCmd),
    /// The trajectory viewer in the browser: sessions, timelines, traces' tokens, each call.
    View(view_cmd::ViewArgs),
    /// Print the JSON Schema of capture records (or of trace rows with --trace).
    Schema {
        /// The schema of one row of traces.jsonl instead.
        #[arg(long)]
        trace: bool,
    },
    /// Measure the proxy (prints figures; never asserts).
    #[command(subcommand)]
    Bench(tokentap_bench::BenchCmd),
}

fn main() -> anyhow::Result<std::process::ExitCode> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TOKENTAP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal: logs in files stay greppable.
        .with_ansi(
            std::io::IsTerminal::is_terminal(&std::io::stderr())
                && std::env::var_os("NO_COLOR").is_none(),
        )
        .init();
    let ok = std::process::ExitCode::SUCCESS;
    match Cli::parse().command {
        Command::Proxy(args) => proxy_cmd::run(args).map(|()| ok),
        Command::Run(args) => run_cmd::run(args),
        Command::Sidecar(args) => run_cmd::sidecar(args),
        Command::NodeAgent(args) => node_agent_cmd::run(args).map(|()| ok),
        Command::AwaitCapture(args) => await_capture_cmd::run(args),
        Command::Webhook(cmd) => webhook_cmd::run(cmd).map(|()| ok),
        Command::Health(args) => health_cmd::run(args),
        Command::Ca(args) => ca_cmd::run(args).map(|()| ok),
        Command::Records(cmd) => records_cmd::run(cmd).map(|()| ok),
        Command::Bench(cmd) => tokentap_bench::run(cmd).map(|()| ok),
        Command::Serve(args) => serve_cmd::run(args).map(|()| ok),
        Command::Generate(args) => generate_cmd::run(args).map(|()| ok),
        Command::SandboxShim(args) => {
            // Checked before the runtime opens descriptors of its own: were the ready fd not
            // handed over, its number could be the runtime's, which the shim would close.
            if let Some(fd) = args.ready_fd {
                // SAFETY: F_GETFD only reads the descriptor's flags.
                if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                    anyhow::bail!("sandbox-shim: --ready-fd {fd} is not an open descriptor");
                }
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let code = rt.block_on(tokentap_rollout::sandbox::shim(
                tokentap_rollout::sandbox::ShimArgs {
                    capture: args.listen.zip(args.unix),
                    run_as: args.uid.zip(args.gid),
                    ready_fd: args.ready_fd,
                    command: args.command,
                },
            ))?;
            std::process::exit(code);
        }
        Command::Worker(args) => worker_cmd::run(args).map(|()| ok),
        Command::Ship(args) => ship_cmd::run(args).map(|()| ok),
        Command::Reconstruct(args) => reconstruct_cmd::reconstruct(args),
        Command::Trajectories(cmd) => reconstruct_cmd::trajectories(cmd).map(|()| ok),
        Command::View(args) => view_cmd::run(args).map(|()| ok),
        Command::Schema { trace } => {
            let schema = if trace {
                tokentap_schema::trace_json_schema()
            } else {
                tokentap_schema::capture_record_json_schema()
            };
            println!("{}", serde_json::to_string_pretty(&schema)?);
            Ok(ok)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// clap's own consistency checks over every command (unique argument names, valid
    /// `requires`/`conflicts_with`, …), which release builds skip: `serve` once had two
    /// `--tokenizer`s (the viewer's and token mode's) and panicked on start in debug builds.
    #[test]
    fn every_command_line_is_consistent() {
        super::Cli::command().debug_assert();
    }
}
