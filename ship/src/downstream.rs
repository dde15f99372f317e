//! Where captured records go after the spool: shipped to a worker (`--ship-to`), published to
//! NATS JetStream for a worker group (`--bus`), or
//! reconstructed in-process into `--traces` (local mode), or nowhere (`--no-reconstruct`).
//! Runs on its own thread, beside the proxy, reading the spool the proxy writes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::Context;
use tokentap_bus::publish::{publish_spool, PublishStop};
use tokentap_bus::BusConnect;
use tokentap_reconstruct::{LiveOptions, LiveReconstructor};
use tokentap_spool::downstream::DownstreamMetrics;

use crate::shipper::{self, BatchLimits, ShipStop, ShipTarget};

/// Where a capture's records go (the `tokentap` binary builds it from its flags).
pub struct DownstreamConfig {
    /// Ship them to a worker (`--ship-to`).
    pub ship_to: Option<ShipTarget>,
    /// Or publish them to the bus, with the partitions a new bus gets (`--bus`).
    pub bus: Option<(BusConnect, u32)>,
    /// Local mode: where traces are written; default: SPOOL/traces.
    pub traces: Option<PathBuf>,
    /// Neither shipped nor reconstructed: records stay in the spool.
    pub no_reconstruct: bool,
    /// Local mode's reconstruction.
    pub live: LiveOptions,
}

/// The running downstream thread.
pub struct Downstream {
    stop: Arc<AtomicBool>,
    finish_open: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// Starts shipping, publishing or local reconstruction of `spool` as `config` says (counting
/// on `metrics`), if it says any.
pub fn start(
    spool: &Path,
    config: DownstreamConfig,
    metrics: DownstreamMetrics,
) -> anyhow::Result<Option<Downstream>> {
    let stop = Arc::new(AtomicBool::new(false));
    let finish_open = Arc::new(AtomicBool::new(false));
    let spool = spool.to_path_buf();
    let thread = if let Some((bus, partitions)) = config.bus {
        if config.ship_to.is_some() {
            anyhow::bail!("--bus and --ship-to both say where records go: choose one");
        }
        start_publisher(&spool, bus, partitions, stop.clone(), metrics)?
    } else if let Some(target) = config.ship_to {
        let stop = ShipStop {
            drain: stop.clone(),
            drain_deadline: Duration::from_secs(10),
        };
        std::thread::Builder::new()
            .name("ship".into())
            .spawn(move || {
                if let Err(e) =
                    shipper::ship(&spool, &target, &stop, BatchLimits::default(), metrics)
                {
                    tracing::error!(error = %e, "shipping stopped");
                }
            })?
    } else if config.no_reconstruct {
        return Ok(None);
    } else {
        let out = config.traces.unwrap_or_else(|| spool.join("traces"));
        let mut live = LiveReconstructor::open(&spool, &out, config.live)
            .with_context(|| format!("opening the trace output at {}", out.display()))?;
        let (stop, finish_open) = (stop.clone(), finish_open.clone());
        tracing::info!(traces = %out.display(), "reconstructing in-process");
        std::thread::Builder::new()
            .name("reconstruct".into())
            .spawn(move || {
                let result = live
                    .run(|_| stop.load(Ordering::Relaxed), |_| {})
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

/// Starts the thread publishing `spool` to the bus; it returns once `drain` is set and the
/// spool is published (or 10 s after that if the bus is unreachable: the records wait in the
/// spool for the next start).
pub fn start_publisher(
    spool: &Path,
    bus: BusConnect,
    partitions: u32,
    drain: Arc<AtomicBool>,
    metrics: DownstreamMetrics,
) -> anyhow::Result<JoinHandle<()>> {
    let spool = spool.to_path_buf();
    let stop = PublishStop {
        drain,
        drain_deadline: Duration::from_secs(10),
    };
    Ok(std::thread::Builder::new()
        .name("bus-publish".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "publishing to the bus: no runtime");
                    return;
                }
            };
            match rt.block_on(publish_spool(&spool, &bus, partitions, &stop, metrics)) {
                Ok(t) => tracing::info!(
                    records = t.records,
                    duplicates = t.duplicates,
                    dead_lettered = t.dead_lettered,
                    retries = t.retries,
                    "publishing to the bus stopped"
                ),
                Err(e) => tracing::error!(error = %e, "publishing to the bus stopped"),
            }
        })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> DownstreamConfig {
        DownstreamConfig {
            ship_to: None,
            bus: None,
            traces: None,
            no_reconstruct: false,
            live: LiveOptions::default(),
        }
    }

    #[test]
    fn the_bus_and_a_worker_at_once_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let both = DownstreamConfig {
            ship_to: Some(ShipTarget {
                to: "http://127.0.0.1:1".into(),
                token: None,
                ca_roots: Vec::new(),
            }),
            bus: Some((
                BusConnect {
                    url: "nats://127.0.0.1:1".into(),
                    token: None,
                    user: None,
                    ca: None,
                },
                4,
            )),
            ..config()
        };
        let e = start(dir.path(), both, DownstreamMetrics::unregistered())
            .err()
            .expect("refused");
        assert!(e.to_string().contains("choose one"), "{e}");
    }

    #[test]
    fn no_reconstruct_starts_nothing_and_local_mode_writes_traces_under_the_spool() {
        let dir = tempfile::tempdir().unwrap();
        let none = DownstreamConfig {
            no_reconstruct: true,
            ..config()
        };
        assert!(start(dir.path(), none, DownstreamMetrics::unregistered())
            .unwrap()
            .is_none());
        let local = start(dir.path(), config(), DownstreamMetrics::unregistered())
            .unwrap()
            .expect("local mode");
        local.stop(true);
        assert!(dir.path().join("traces").is_dir());
    }
}
