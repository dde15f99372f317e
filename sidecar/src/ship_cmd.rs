//! `tokentap ship`: its flags, and the worker token flag of every command that ships
//! (`--ship-token`). The shipper itself is `tokentap_ship::shipper`.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use tokentap_proxy::cli::load_ca_file;
use tokentap_ship::shipper::{ship, BatchLimits, ShipStop, ShipTarget, DEAD_LETTER_FILE};
use tokentap_spool::downstream::DownstreamMetrics;

use crate::signals::signal_sets;

#[derive(Args)]
#[command(after_help = "Examples:
  # ship what a proxy captured to a worker, then keep following the spool
  TOKENTAP_WORKER_TOKEN=... tokentap ship --spool ./spool --to https://worker:8900 --follow

Records the worker will never take are kept in SPOOL/dead-letter.ndjson.")]
pub struct ShipArgs {
    /// The spool to ship.
    #[arg(long, default_value = "tokentap-spool")]
    spool: PathBuf,
    /// The worker's base URL.
    #[arg(long)]
    to: String,
    /// Keep following the spool for new records (until SIGINT/SIGTERM).
    #[arg(long)]
    follow: bool,
    #[command(flatten)]
    auth: ShipAuthArgs,
    /// A PEM file of CA certificates to trust (besides the system's) for an https:// worker.
    #[arg(long, env = "TOKENTAP_CA_FILE")]
    ca_file: Option<PathBuf>,
}

/// The worker's token, wherever records are shipped from.
#[derive(Args, Clone)]
pub struct ShipAuthArgs {
    /// Bearer token of the worker (its --token).
    #[arg(long, env = "TOKENTAP_WORKER_TOKEN", hide_env_values = true)]
    pub ship_token: Option<String>,
}

/// `tokentap ship`.
pub fn run(args: ShipArgs) -> anyhow::Result<()> {
    let drain = Arc::new(AtomicBool::new(!args.follow));
    for signal in [libc::SIGINT, libc::SIGTERM] {
        signal_sets(signal, drain.clone());
    }
    let target = ShipTarget {
        to: args.to.clone(),
        token: args.auth.ship_token.clone(),
        ca_roots: load_ca_file(args.ca_file.as_deref())?,
    };
    let totals = ship(
        &args.spool,
        &target,
        &ShipStop {
            drain,
            drain_deadline: Duration::from_secs(if args.follow { 10 } else { 60 }),
        },
        BatchLimits::default(),
        DownstreamMetrics::unregistered(),
    )?;
    println!(
        "shipped {} records in {} batches ({} duplicates dropped by the worker, {} rejected, {} dead-lettered, {} retries)",
        totals.records,
        totals.batches,
        totals.duplicates,
        totals.rejected,
        totals.dead_lettered,
        totals.retries
    );
    if totals.dead_lettered > 0 {
        eprintln!(
            "{} records could not be delivered; they are in {}",
            totals.dead_lettered,
            args.spool.join(DEAD_LETTER_FILE).display()
        );
    }
    Ok(())
}
