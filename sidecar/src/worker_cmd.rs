//! `tokentap worker`: its flags, and the composition of the worker: the ingest of shipped
//! records (`tokentap_ship::receive`) or, with `--bus`, a member of the worker group, behind
//! the control plane's listener.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tokentap_control_plane::bearer::BearerToken;
use tokentap_reconstruct::LiveOptions;
use tokentap_ship::receive::{Receiver, ReceiverConfig};

use crate::reconstruct_cmd::StrategyArg;

#[derive(Args)]
#[command(after_help = "Examples:
  # on the worker node
  TOKENTAP_WORKER_TOKEN=... tokentap worker --listen 0.0.0.0:8900 --out ./traces
  # on each proxy node
  TOKENTAP_WORKER_TOKEN=... tokentap proxy --backend http://gpu:8000 --backend-kind vllm \
      --ship-to http://worker:8900

Output (in --out): traces.jsonl, sessions.jsonl, parquet/part-*.parquet; the received records
in --out/spool; /metrics on the listen address. Every route but /health needs the token when
one is set; a listen address beyond loopback needs one.")]
pub struct WorkerArgs {
    /// Address to receive records on (also serves /health, /metrics and /v1/ship/limits);
    /// anything but loopback needs --token.
    #[arg(long, default_value = "127.0.0.1:8900")]
    listen: SocketAddr,
    /// Bearer token required on every route but /health (shippers send it with
    /// --ship-token, or the same environment variable).
    #[arg(long, env = "TOKENTAP_WORKER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Largest batch body read, in bytes (told to shippers at /v1/ship/limits; a record
    /// bigger than this is dead-lettered by its shipper). Records hold the harness request
    /// and the engine's prompt, so leave room for about three times the proxies'
    /// --max-body-bytes. At least 1 MiB: shippers ignore a smaller limit (it would
    /// dead-letter nearly every record unsent).
    #[arg(long, default_value_t = 128 << 20, value_parser = at_least_the_shippers_floor)]
    max_body_bytes: usize,
    #[command(flatten)]
    tls: tokentap_control_plane::TlsListenArgs,
    /// Output directory for traces.
    #[arg(long)]
    out: PathBuf,
    /// Where received records are kept (default: OUT/spool).
    #[arg(long)]
    spool: Option<PathBuf>,
    #[command(flatten)]
    live: LiveArgs,
    /// Consume records from NATS JetStream as one member of a worker group (the group splits
    /// the records' partitions by lease) instead of receiving shipped batches.
    #[command(flatten)]
    bus: crate::bus_cmd::BusArgs,
    /// This worker's name in the group (unique; default: host name and process id).
    #[arg(long, requires = "bus")]
    member_id: Option<String>,
}

/// Reconstruction options shared by the worker and local mode.
#[derive(Args, Clone)]
pub struct LiveArgs {
    /// How traces are built.
    #[arg(long, value_enum, default_value = "prefix-merge")]
    pub strategy: StrategyArg,
    /// Finish a session (write its traces) once none of its calls has ended for this many
    /// seconds.
    #[arg(long, default_value_t = 60)]
    pub session_idle: u64,
}

impl LiveArgs {
    pub fn options(&self) -> LiveOptions {
        LiveOptions {
            strategy: self.strategy.into(),
            session_idle: Duration::from_secs(self.session_idle),
            ..LiveOptions::default()
        }
    }
}

pub fn run(args: WorkerArgs) -> anyhow::Result<()> {
    tokentap_control_plane::check_exposure(
        args.listen,
        args.token.as_deref(),
        "--token",
        "TOKENTAP_WORKER_TOKEN",
    )?;
    if let Some(bus) = args.bus.connect()? {
        return tokentap_ship::bus_worker::run_worker(tokentap_ship::bus_worker::BusWorker {
            shutdown: Box::pin(crate::signals::shutdown_signal()),
            bus,
            partitions: args.bus.bus_partitions,
            member: args
                .member_id
                .clone()
                .unwrap_or_else(tokentap_ship::bus_worker::default_member_id),
            listen: args.listen,
            token: args.token.as_deref(),
            tls: &args.tls,
            out: &args.out,
            live: args.live.options(),
        });
    }
    let receiver = Receiver::open(
        &ReceiverConfig {
            spool: args.spool.clone().unwrap_or_else(|| args.out.join("spool")),
            out: args.out.clone(),
            live: args.live.options(),
            max_body_bytes: args.max_body_bytes,
        },
        BearerToken::new(args.token.as_deref()),
    )?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(tokentap_control_plane::serve(
        args.listen,
        &args.tls,
        receiver.router(),
        shutdown_signal(),
        |listen, tls| tracing::info!(%listen, tls, out = %args.out.display(), "tokentap worker ready"),
    ))?;
    receiver.stop()?;
    tracing::info!("tokentap worker stopped");
    Ok(())
}

/// `--max-body-bytes`, refused below [`tokentap_ship::shipper::MIN_WORKER_LIMIT`], the least limit a
/// shipper believes.
fn at_least_the_shippers_floor(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if (n as u64) < tokentap_ship::shipper::MIN_WORKER_LIMIT {
        return Err(format!(
            "{n} is below {} bytes, the least body limit a shipper believes; a record is tens of KB, a long session's calls a few MB",
            tokentap_ship::shipper::MIN_WORKER_LIMIT
        ));
    }
    Ok(n)
}

async fn shutdown_signal() {
    crate::signals::shutdown_signal().await;
    tracing::info!("shutting down: finishing in-flight batches, checkpointing reconstruction");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker cannot be started with a body limit its shippers would not believe (and
    /// would, before, have dead-lettered nearly every record for).
    #[test]
    fn a_body_limit_under_the_shippers_floor_is_refused() {
        let floor = tokentap_ship::shipper::MIN_WORKER_LIMIT as usize;
        let err = at_least_the_shippers_floor("1000").unwrap_err();
        assert!(
            err.contains("1000") && err.contains(&floor.to_string()),
            "{err}"
        );
        assert!(at_least_the_shippers_floor(&(floor - 1).to_string()).is_err());
        assert_eq!(at_least_the_shippers_floor(&floor.to_string()), Ok(floor));
        assert!(at_least_the_shippers_floor("lots").is_err());
    }
}
