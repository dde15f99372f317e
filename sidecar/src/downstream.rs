//! Where captured records go after the spool: shipped to a worker (`--ship-to`), published to
//! NATS JetStream for a worker group (`--bus`), or
//! reconstructed in-process into `--traces` (local mode), or nowhere (`--no-reconstruct`).
//! Runs on its own thread, beside the proxy, reading the spool the proxy writes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokentap_reconstruct::LiveReconstructor;

use crate::bus_cmd::{self, BusArgs};
use crate::ship::{self, BatchLimits, ShipAuthArgs, ShipStop, ShipTarget};
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

/// The running downstream thread.
pub struct Downstream {
    stop: Arc<AtomicBool>,
    finish_open: Arc<AtomicBool>,
    thread: JoinHandle<()>,
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
        let stop = Arc::new(AtomicBool::new(false));
        let finish_open = Arc::new(AtomicBool::new(false));
        let spool = spool.to_path_buf();
        let thread = if let Some(bus) = self.bus.connect()? {
            if self.ship_to.is_some() {
                anyhow::bail!("--bus and --ship-to both say where records go: choose one");
            }
            bus_cmd::start_publisher(&spool, bus, self.bus.bus_partitions, stop.clone(), metrics)?
        } else if let Some(url) = self.ship_to.clone() {
            let target = ShipTarget {
                to: url,
                token: self.ship_auth.ship_token.clone(),
                ca_roots,
            };
            let stop = ShipStop {
                drain: stop.clone(),
                drain_deadline: Duration::from_secs(10),
            };
            std::thread::Builder::new()
                .name("ship".into())
                .spawn(move || {
                    if let Err(e) =
                        ship::ship(&spool, &target, &stop, BatchLimits::default(), metrics)
                    {
                        tracing::error!(error = %e, "shipping stopped");
                    }
                })?
        } else if self.no_reconstruct {
            return Ok(None);
        } else {
            let out = self.traces.clone().unwrap_or_else(|| spool.join("traces"));
            let mut live = LiveReconstructor::open(&spool, &out, self.live.options())
                .with_context(|| format!("opening the trace output at {}", out.display()))?;
            let (stop, finish_open) = (stop.clone(), finish_open.clone());
            tracing::info!(traces = %out.display(), "reconstructing in-process");
            std::thread::Builder::new()
                .name("reconstruct".into())
                .spawn(move || {
                    let result =
                        live.run(|_| stop.load(Ordering::Relaxed), |_| {})
                            .and_then(|()| {
                                if finish_open.load(Ordering::Relaxed) {
                                    live.finish_all()?;
                                    live.checkpoint(true)?;
                                }
                                Ok(())
                            });
                    let s = live.stats();
                    match result {
                        Ok(()) => tracing::info!(
                            traces_dir = %live.out_dir().display(),
                            sessions = s.sessions_finished,
                            traces = s.traces_emitted,
                            merge_ratio = format!("{:.2}", s.merge_ratio()),
                            open_sessions = s.open_sessions,
                            violations = s.violations,
                            "reconstruction stopped"
                        ),
                        Err(e) => tracing::error!(error = %e, "reconstruction failed"),
                    }
                })?
        };
        Ok(Some(Downstream {
            stop,
            finish_open,
            thread,
        }))
    }
}

impl Downstream {
    /// Call after the spool writer has finished: ships or reconstructs what is left, then
    /// returns. With `finish_open_sessions`, local mode writes the traces of sessions still
    /// open (the end of a one-off run); otherwise they resume at the next start.
    pub fn stop(self, finish_open_sessions: bool) {
        self.finish_open
            .store(finish_open_sessions, Ordering::Relaxed);
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.join();
    }
}
