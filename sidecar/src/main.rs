//! `tokentap`: the command line. Parses flags and composes the crates; no domain logic here.

mod bench;
mod proxy_cmd;
mod records_cmd;

use clap::{Parser, Subcommand};

/// The proxy allocates per call (JSON values, buffers); jemalloc roughly halved its CPU per call
/// in `tokentap bench proxy` compared with glibc malloc.
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

#[derive(Subcommand)]
enum Command {
    /// Run the capture proxy in front of an inference engine.
    Proxy(proxy_cmd::ProxyArgs),
    /// Inspect the capture records in a spool.
    #[command(subcommand)]
    Records(records_cmd::RecordsCmd),
    /// Print the JSON Schema of capture records.
    Schema,
    /// Measure the proxy (prints figures; never asserts).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TOKENTAP_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Proxy(args) => proxy_cmd::run(args),
        Command::Records(cmd) => records_cmd::run(cmd),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Schema => {
            println!(
                "{}",
                serde_json::to_string_pretty(&tokentap_schema::capture_record_json_schema())?
            );
            Ok(())
        }
    }
}
