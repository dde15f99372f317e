//! The flags that say where a capture's records go (`--ship-to`, `--bus`, `--traces`,
//! `--no-reconstruct`); what each does is `tokentap_ship::downstream`.

use std::path::PathBuf;

use clap::Args;
use tokentap_ship::downstream::{Downstream, DownstreamConfig};
use tokentap_ship::shipper::ShipTarget;

use crate::bus_cmd::BusArgs;
use crate::ship_cmd::ShipAuthArgs;
use crate::worker_cmd::LiveArgs;

#[derive(Args, Clone)]
pub struct DownstreamArgs {
    /// Ship records to a reconstruction worker (`tokentap worker`) at this base URL instead
    /// of reconstructing here; at least once, resuming after restarts.
    /// Records the worker will never take go to SPOOL/dead-letter.ndjson (and count in
    /// tokentap_ship_dead_letter_total).
    #[arg(long, value_name = "URL")]
    pub ship_to: Option<String>,
    #[command(flatten)]
    pub ship_auth: ShipAuthArgs,
    /// Or publish them to NATS JetStream, for a group of `tokentap worker --bus`.
    #[command(flatten)]
    pub bus: BusArgs,
    /// Local mode: where traces are written (traces.jsonl, sessions.jsonl, parquet/);
    /// default: SPOOL/traces.
    #[arg(long)]
    pub traces: Option<PathBuf>,
    /// Do not reconstruct in-process; records stay in the spool (`tokentap reconstruct`).
    #[arg(long)]
    pub no_reconstruct: bool,
    #[command(flatten)]
    pub live: LiveArgs,
}

impl DownstreamArgs {
    /// Starts shipping (trusting `ca_roots` besides the built-in roots, counting on
    /// `metrics`) or local reconstruction of `spool`, if configured.
    pub fn start(
        &self,
        spool: &std::path::Path,
        ca_roots: Vec<reqwest::Certificate>,
        metrics: tokentap_spool::downstream::DownstreamMetrics,
    ) -> anyhow::Result<Option<Downstream>> {
        let config = DownstreamConfig {
            bus: self
                .bus
                .connect()?
                .map(|bus| (bus, self.bus.bus_partitions)),
            ship_to: self.ship_to.clone().map(|to| ShipTarget {
                to,
                token: self.ship_auth.ship_token.clone(),
                ca_roots,
            }),
            traces: self.traces.clone(),
            no_reconstruct: self.no_reconstruct,
            live: self.live.options(),
        };
        tokentap_ship::downstream::start(spool, config, metrics)
    }
}
