//! The load generator: one HTTP/1.1 keep-alive connection per concurrent client, two ways of
//! offering load.
//!
//! - [`open_loop`] (latency): requests are due on a fixed schedule whatever the answers do,
//!   and each latency is taken from the request's *due* time, so time spent waiting for a free
//!   connection counts (no coordinated omission). A plain thread paces the schedule because
//!   tokio's timer only ticks every millisecond, too coarse for sub-millisecond overheads.
//! - [`closed_loop`] (throughput): each client sends its next request as soon as the last one
//!   is answered, which saturates the target.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::sync::Semaphore;

/// How long each run lasts and the rate the latency runs offer: the options `bench proxy` and
/// `bench contender` share.
#[derive(Args)]
pub struct LoadArgs {
    /// Seconds measured in each latency (open-loop) run, after the warm-up.
    #[arg(long, default_value_t = 5.0)]
    pub duration: f64,
    /// Seconds measured in each throughput (closed-loop) run, after the warm-up.
    #[arg(long, default_value_t = 3.0)]
    pub throughput_duration: f64,
    /// Seconds of unmeasured warm-up before each run.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Calls per second offered in the latency runs; keep it well below saturation
    /// [default: half the lowest saturated throughput of the proxy under test (`contender`:
    /// of the slower proxy), at most 500].
    #[arg(long)]
    pub rate: Option<f64>,
}

impl LoadArgs {
    /// Fails on a rate or duration that is not positive, or a warm-up that is negative.
    pub fn check(&self) -> anyhow::Result<()> {
        if !(self.rate.unwrap_or(1.0) > 0.0
            && self.duration > 0.0
            && self.throughput_duration > 0.0)
        {
            bail!("--rate, --duration and --throughput-duration must be positive");
        }
        if !(self.warmup >= 0.0 && self.warmup.is_finite()) {
            bail!("--warmup must be zero or more seconds");
        }
        Ok(())
    }
}

/// The default offered rate of latency runs: half of `saturated` (a proxy's lowest saturated
/// throughput), at most 500 calls/s. Latency measured near or past saturation is queueing,
/// not overhead.
pub fn rate_below(saturated: f64) -> f64 {
    (saturated * 0.5).clamp(1.0, 500.0)
}

/// What one run measured.
pub struct RunResult {
    /// Latencies in microseconds of the calls inside the measured window.
    pub latency_us: Histogram<u64>,
    /// Calls answered 200 inside the measured window.
    pub ok: u64,
    /// Failed calls (error status, broken connection) inside the measured window.
    pub errors: u64,
    /// Open loop only: calls due but never sent because the target fell too far behind.
    pub dropped: u64,
    /// Every call sent, warm-up included.
    pub sent: u64,
    /// Length of the measured window, seconds.
    pub window_s: f64,
}

impl RunResult {
    fn new(window: Duration) -> RunResult {
        RunResult {
            latency_us: new_histogram(),
            ok: 0,
            errors: 0,
            dropped: 0,
            sent: 0,
            window_s: window.as_secs_f64(),
        }
    }

    fn merge(&mut self, other: &RunResult) {
        self.latency_us
            .add(&other.latency_us)
            .expect("histograms share bounds");
        self.ok += other.ok;
        self.errors += other.errors;
        self.dropped += other.dropped;
        self.sent += other.sent;
    }

    pub fn calls_per_s(&self) -> f64 {
        self.ok as f64 / self.window_s
    }
}

fn new_histogram() -> Histogram<u64> {
    // 1 µs to 100 s at 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid histogram bounds")
}

/// One client's connection.
struct Conn {
    addr: SocketAddr,
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    async fn open(addr: SocketAddr) -> anyhow::Result<Conn> {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        Ok(Conn { addr, sender })
    }

    /// One call: whether it was answered 200 with the whole body read.
    async fn call(&mut self, req: Request<Full<Bytes>>) -> bool {
        let ok = async {
            self.sender.ready().await.ok()?;
            let resp = self.sender.send_request(req).await.ok()?;
            let status = resp.status();
            resp.into_body().collect().await.ok()?;
            Some(status == 200)
        }
        .await;
        match ok {
            Some(ok) => ok,
            None => {
                // The connection broke: the next call gets a fresh one.
                if let Ok(c) = Conn::open(self.addr).await {
                    *self = c;
                }
                false
            }
        }
    }
}

/// A `GET path` on a fresh connection; the status and body.
pub async fn get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, Bytes)> {
    let mut c = Conn::open(addr).await?;
    let req = Request::get(path)
        .header(hyper::header::HOST, addr.to_string())
        .body(Full::new(Bytes::new()))?;
    let resp = c.sender.send_request(req).await?;
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}

/// What to send.
#[derive(Clone)]
pub struct Call {
    pub addr: SocketAddr,
    /// The endpoint, e.g. `/v1/chat/completions`.
    pub path: &'static str,
    pub body: Bytes,
}

impl Call {
    fn request(&self) -> Request<Full<Bytes>> {
        Request::post(self.path)
            .header(hyper::header::HOST, self.addr.to_string())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(hyper::header::AUTHORIZATION, "Bearer sk-bench")
            .header("anthropic-version", "2023-06-01")
            .body(Full::new(self.body.clone()))
            .expect("a valid request")
    }
}

/// One call on a fresh connection; the status and body.
pub async fn call_once(call: &Call) -> anyhow::Result<(u16, Bytes)> {
    let mut c = Conn::open(call.addr).await?;
    let resp = c.sender.send_request(call.request()).await?;
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}

async fn connect_all(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<Conn>> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(Conn::open(addr).await?);
    }
    Ok(conns)
}

/// Open loop: `rate` calls/s due on a fixed schedule over `conns` connections (at most
/// `conns` in flight); calls due in the first `warmup` are not measured.
pub async fn open_loop(
    call: &Call,
    conns: usize,
    rate: f64,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<RunResult> {
    let clients = connect_all(call.addr, conns).await?;
    let total = ((warmup + duration).as_secs_f64() * rate).round() as u64;
    let start = Instant::now() + Duration::from_millis(20);
    let measure_from = start + warmup;
    // Past this, a target that has fallen behind gets no more calls: they count as dropped.
    let give_up = start + warmup + duration + Duration::from_secs(5);
    let due = move |i: u64| start + Duration::from_secs_f64(i as f64 / rate);

    // The pacer releases one permit per call as it falls due, then one per client to stop them.
    let permits = Arc::new(Semaphore::new(0));
    let pacer = {
        let permits = permits.clone();
        std::thread::Builder::new()
            .name("bench-pacer".into())
            .spawn(move || {
                // The default 50 µs timer slack would show up in every latency.
                // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack.
                unsafe {
                    libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
                }
                let mut released = 0u64;
                while released < total {
                    let now = Instant::now();
                    if now >= start {
                        let n = (((now - start).as_secs_f64() * rate) as u64 + 1).min(total);
                        if n > released {
                            permits.add_permits((n - released) as usize);
                            released = n;
                        }
                    }
                    let next = due(released);
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    }
                }
                permits.add_permits(conns);
            })?
    };

    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for mut conn in clients {
        let (permits, next, call) = (permits.clone(), next.clone(), call.clone());
        tasks.spawn(async move {
            let mut r = RunResult::new(duration);
            loop {
                let Ok(p) = permits.acquire().await else {
                    break;
                };
                p.forget();
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let due = due(i);
                if Instant::now() > give_up {
                    r.dropped += 1;
                    continue;
                }
                r.sent += 1;
                let ok = conn.call(call.request()).await;
                if due < measure_from {
                    continue;
                }
                if ok {
                    r.ok += 1;
                    let us = due.elapsed().as_micros() as u64;
                    r.latency_us.saturating_record(us.max(1));
                } else {
                    r.errors += 1;
                }
            }
            r
        });
    }
    let mut all = RunResult::new(duration);
    while let Some(r) = tasks.join_next().await {
        all.merge(&r?);
    }
    let _ = pacer.join();
    Ok(all)
}

/// Closed loop: `conns` clients each calling back to back; counts the calls answered
/// within `duration` after `warmup`.
pub async fn closed_loop(
    call: &Call,
    conns: usize,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<RunResult> {
    let clients = connect_all(call.addr, conns).await?;
    let start = Instant::now();
    let measure_from = start + warmup;
    let end = measure_from + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for mut conn in clients {
        let call = call.clone();
        tasks.spawn(async move {
            let mut r = RunResult::new(duration);
            loop {
                let began = Instant::now();
                if began >= end {
                    break;
                }
                r.sent += 1;
                let ok = conn.call(call.request()).await;
                let done = Instant::now();
                if done < measure_from || done > end {
                    continue;
                }
                if ok {
                    r.ok += 1;
                    let us = (done - began).as_micros() as u64;
                    r.latency_us.saturating_record(us.max(1));
                } else {
                    r.errors += 1;
                }
            }
            r
        });
    }
    let mut all = RunResult::new(duration);
    while let Some(r) = tasks.join_next().await {
        all.merge(&r?);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::super::{body, instant_backend::InstantBackend};
    use super::*;

    // Checks that calls go through and are counted; no timing is asserted.
    #[tokio::test]
    async fn both_loops_complete_calls_against_the_instant_backend() {
        let backend = InstantBackend::start(10).unwrap();
        for stream in [false, true] {
            let call = Call {
                addr: backend.addr(),
                path: "/v1/chat/completions",
                body: Bytes::from(body::chat_request(2_000, stream)),
            };
            let (status, answer) = call_once(&call).await.unwrap();
            assert_eq!(status, 200);
            assert!(memchr::memmem::find(&answer, b"Sure").is_some());
            let r = closed_loop(&call, 2, Duration::ZERO, Duration::from_millis(100))
                .await
                .unwrap();
            assert!(r.ok > 0 && r.errors == 0);
            let r = open_loop(&call, 2, 200.0, Duration::ZERO, Duration::from_millis(100))
                .await
                .unwrap();
            assert_eq!(r.errors, 0);
            assert_eq!(r.sent + r.dropped, 20);
        }
    }
}
