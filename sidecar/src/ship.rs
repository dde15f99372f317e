//! The shipper: sends a spool's records to a reconstruction worker, at least once, resuming
//! from a cursor file after either side restarts. Runs in `tokentap proxy --ship-to URL` and as
//! `tokentap ship`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde::{Deserialize, Serialize};
use tokentap_schema::ndjson::encode_line;
use tokentap_schema::ship::{ShipAck, SHIP_CONTENT_TYPE, SHIP_PATH};
use tokentap_spool::{SpoolItem, SpoolPosition, SpoolReader};

/// Next to the spool's segments; the spool reader ignores other files.
pub const CURSOR_FILE: &str = "ship-cursor.json";

#[derive(Debug, Serialize, Deserialize)]
struct Cursor {
    /// The worker the position refers to: shipping to another worker starts over.
    to: String,
    position: SpoolPosition,
}

#[derive(Args)]
#[command(after_help = "Examples:
  # ship what a proxy captured to a worker, then keep following the spool
  tokentap ship --spool ./spool --to http://worker:8900 --follow")]
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
}

/// How a shipper batches.
#[derive(Debug, Clone, Copy)]
pub struct ShipLimits {
    pub max_records: usize,
    pub max_bytes: usize,
}

impl Default for ShipLimits {
    fn default() -> Self {
        ShipLimits {
            max_records: 256,
            max_bytes: 8 << 20,
        }
    }
}

/// Totals of one shipper run.
#[derive(Debug, Default, Clone, Copy)]
pub struct ShipTotals {
    pub batches: u64,
    pub records: u64,
    pub duplicates: u64,
    pub rejected: u64,
    pub retries: u64,
}

/// When a shipper stops.
#[derive(Clone)]
pub struct ShipStop {
    /// Set: ship what is in the spool, then return.
    pub drain: Arc<AtomicBool>,
    /// After `drain` is set, give up this long after it if the worker is unreachable (the
    /// cursor is saved, so nothing is lost: the next start resumes).
    pub drain_deadline: Duration,
}

/// Ships `spool` to `to` until the spool is drained and `stop.drain` is set.
pub fn ship(
    spool: &Path,
    to: &str,
    stop: &ShipStop,
    limits: ShipLimits,
) -> anyhow::Result<ShipTotals> {
    let cursor_path = spool.join(CURSOR_FILE);
    let to = to.trim_end_matches('/').to_owned();
    let start = match std::fs::read(&cursor_path) {
        Ok(b) => match serde_json::from_slice::<Cursor>(&b) {
            Ok(c) if c.to == to => c.position,
            Ok(c) => {
                tracing::warn!(previous = %c.to, now = %to, "shipping to a different worker: starting from the beginning of the spool");
                SpoolPosition::default()
            }
            Err(e) => {
                tracing::warn!(error = %e, "unreadable ship cursor: starting from the beginning of the spool (the worker drops what it already has)");
                SpoolPosition::default()
            }
        },
        Err(_) => SpoolPosition::default(),
    };
    let mut reader = SpoolReader::open_at(spool, start)
        .with_context(|| format!("opening the spool at {}", spool.display()))?;
    let client = reqwest::blocking::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(60))
        .build()?;
    let url = format!("{to}{SHIP_PATH}");
    let mut totals = ShipTotals::default();
    let mut drain_since: Option<Instant> = None;
    tracing::info!(spool = %spool.display(), worker = %to, from = %start, "shipping records");
    loop {
        let draining = stop.drain.load(Ordering::Relaxed);
        if draining && drain_since.is_none() {
            drain_since = Some(Instant::now());
        }
        let mut body = Vec::new();
        let mut n = 0;
        let mut caught_up = false;
        while n < limits.max_records && body.len() < limits.max_bytes {
            match reader.next_available()? {
                Some(SpoolItem::Record(e)) => {
                    encode_line(&e.record, &mut body)?;
                    n += 1;
                }
                Some(_) => {} // corrupt line: the reader reports it; nothing to ship
                None => {
                    caught_up = true;
                    break;
                }
            }
        }
        if n > 0 {
            let mut backoff = Duration::from_millis(100);
            loop {
                match send(&client, &url, &body) {
                    Ok(ack) => {
                        totals.batches += 1;
                        totals.records += ack.accepted;
                        totals.duplicates += ack.duplicates;
                        totals.rejected += ack.rejected;
                        if ack.rejected > 0 {
                            tracing::warn!(rejected = ack.rejected, errors = ?ack.errors, "the worker rejected records");
                        }
                        break;
                    }
                    Err(e) => {
                        totals.retries += 1;
                        let gave_up =
                            drain_since.is_some_and(|t| t.elapsed() >= stop.drain_deadline);
                        if gave_up {
                            tracing::warn!(error = %e, "worker unreachable at shutdown; the cursor is saved and the next start resumes");
                            return Ok(totals);
                        }
                        tracing::warn!(error = %e, retry_in = ?backoff, "shipping failed; retrying the same batch");
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                        if drain_since.is_none() && stop.drain.load(Ordering::Relaxed) {
                            drain_since = Some(Instant::now());
                        }
                    }
                }
            }
            save_cursor(
                &cursor_path,
                &Cursor {
                    to: to.clone(),
                    position: reader.position(),
                },
            )?;
        }
        if caught_up {
            if draining {
                tracing::info!(?totals, "shipper drained");
                return Ok(totals);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn send(client: &reqwest::blocking::Client, url: &str, body: &[u8]) -> anyhow::Result<ShipAck> {
    let response = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, SHIP_CONTENT_TYPE)
        .body(body.to_vec())
        .send()?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().unwrap_or_default();
        anyhow::bail!(
            "worker answered {status}: {}",
            text.chars().take(300).collect::<String>()
        );
    }
    Ok(response.json()?)
}

fn save_cursor(path: &Path, cursor: &Cursor) -> anyhow::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let f = std::fs::File::create(&tmp)?;
    serde_json::to_writer(&f, cursor)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// `tokentap ship`.
pub fn run(args: ShipArgs) -> anyhow::Result<()> {
    let drain = Arc::new(AtomicBool::new(!args.follow));
    for signal in [libc::SIGINT, libc::SIGTERM] {
        signal_sets(signal, drain.clone());
    }
    let totals = ship(
        &args.spool,
        &args.to,
        &ShipStop {
            drain,
            drain_deadline: Duration::from_secs(if args.follow { 10 } else { 60 }),
        },
        ShipLimits::default(),
    )?;
    println!(
        "shipped {} records in {} batches ({} duplicates dropped by the worker, {} rejected, {} retries)",
        totals.records, totals.batches, totals.duplicates, totals.rejected, totals.retries
    );
    Ok(())
}

/// Sets `flag` when `signal` arrives (a thread waits on the signal through tokio).
pub fn signal_sets(signal: libc::c_int, flag: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a signal runtime");
        rt.block_on(async {
            use tokio::signal::unix::{signal as on, SignalKind};
            if let Ok(mut s) = on(SignalKind::from_raw(signal)) {
                s.recv().await;
                flag.store(true, Ordering::Relaxed);
            }
        });
    });
}
