//! `tokentap bench transparent`: what transparent capture costs, measured side by side.
//!
//! - Connect latency (root): a child process in a fresh cgroup times N sequential TCP connects
//!   to a local listener, three ways in the same run — no redirect (straight to the listener),
//!   the eBPF connect redirect, and nftables REDIRECT (both from 127.0.0.2:PORT to the
//!   listener). Rounds alternate the modes so drift hits all three alike.
//! - TLS: handshakes per second against the interception TLS config with the leaf already
//!   minted (closed loop, rustls client trusting the local CA), first-handshake latency for a
//!   new server name (mint + handshake) beside a cached one, and mint time alone.

use std::net::{SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use tokentap_cgroup::{cgroup2_mount, Cgroup};
use tokentap_ebpf::{NftRedirect, Redirect, RedirectConfig};
use tokentap_proxy::tls::{server_config, CertificateAuthority};

#[derive(Args)]
pub struct TransparentBenchArgs {
    /// Connects timed per mode and round.
    #[arg(long, default_value_t = 2000)]
    connects: usize,
    /// Rounds (each runs every mode once, in rotating order).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Seconds of each closed-loop TLS handshake run.
    #[arg(long, default_value_t = 3.0)]
    tls_duration: f64,
    /// New server names minted for the first-certificate figures.
    #[arg(long, default_value_t = 100)]
    mints: usize,
    /// Internal: time connects to ADDR and print the microseconds (run inside a cgroup).
    #[arg(long, hide = true)]
    connect_worker: Option<String>,
}

pub fn run(args: TransparentBenchArgs) -> anyhow::Result<()> {
    if let Some(addr) = &args.connect_worker {
        return connect_worker(addr, args.connects);
    }
    println!(
        "tokentap bench transparent — {}",
        std::env::args().collect::<Vec<_>>().join(" ")
    );
    println!();
    match connect_latency(&args) {
        Ok(()) => {}
        Err(e) => println!("connect latency: skipped ({e:#})\n"),
    }
    tls(&args)
}

/// The child side: N connects, each timed from `connect()` to its return; RST on close so no
/// TIME_WAIT piles up.
fn connect_worker(addr: &str, n: usize) -> anyhow::Result<()> {
    let addr: SocketAddr = addr.parse()?;
    let mut micros = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        micros.push(t.elapsed().as_secs_f64() * 1e6);
        let _ = socket2_linger_zero(&s);
    }
    println!("{}", serde_json::to_string(&micros)?);
    Ok(())
}

fn socket2_linger_zero(s: &TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a correctly sized linger struct.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Redirection {
    None,
    Ebpf,
    Nft,
}

impl Redirection {
    fn name(self) -> &'static str {
        match self {
            Redirection::None => "no redirect",
            Redirection::Ebpf => "eBPF connect4",
            Redirection::Nft => "nftables REDIRECT",
        }
    }
}

fn connect_latency(args: &TransparentBenchArgs) -> anyhow::Result<()> {
    tokentap_ebpf::preflight(true).context("needs root, cgroup v2 and the eBPF program")?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let SocketAddr::V4(at) = listener.local_addr()? else {
        bail!("IPv4 listener expected")
    };
    // Accept and drop, on its own thread, for the whole measurement.
    std::thread::spawn(move || {
        for c in listener.incoming() {
            drop(c);
        }
    });
    // The redirected destination: nothing listens there, so a missed redirect fails loudly.
    let port = {
        let l = TcpListener::bind("127.0.0.2:0")?;
        l.local_addr()?.port()
    };
    let hard_coded = SocketAddr::from(SocketAddrV4::new("127.0.0.2".parse()?, port));
    let exe = std::env::current_exe()?;
    let root = cgroup2_mount()?;
    let modes = [Redirection::None, Redirection::Ebpf, Redirection::Nft];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for round in 0..args.rounds {
        for k in 0..modes.len() {
            let i = (k + round) % modes.len();
            let mode = modes[i];
            let cg = Cgroup::create(&format!("bench-{}-{round}-{i}", std::process::id()))?;
            let config = RedirectConfig {
                listener: at,
                listener_v6: None,
                ports: vec![port],
            };
            let (_ebpf, _nft, target) = match mode {
                Redirection::None => (None, None, SocketAddr::V4(at)),
                Redirection::Ebpf => (
                    Some(Redirect::attach(cg.path(), &config)?),
                    None,
                    hard_coded,
                ),
                Redirection::Nft => (
                    None,
                    Some(NftRedirect::install(&root, cg.path(), &[port], at.port())?),
                    hard_coded,
                ),
            };
            let procs = cg.procs_file();
            let mut cmd = std::process::Command::new(&exe);
            cmd.args(["bench", "transparent", "--connects"])
                .arg(args.connects.to_string())
                .arg("--connect-worker")
                .arg(target.to_string());
            // SAFETY: writes one file between fork and exec.
            unsafe {
                cmd.pre_exec(move || std::fs::write(&procs, "0"));
            }
            let out = cmd.output()?;
            if !out.status.success() {
                bail!(
                    "{} worker failed: {}",
                    mode.name(),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let micros: Vec<f64> = serde_json::from_slice(&out.stdout)?;
            samples[i].extend(micros);
            cg.remove()?;
        }
    }
    println!(
        "connect latency: {} sequential connects per mode ({} rounds, modes rotated), loopback",
        args.connects * args.rounds,
        args.rounds
    );
    println!(
        "  {:<20} {:>9} {:>9} {:>9} {:>14}",
        "mode", "p50 µs", "p99 µs", "mean µs", "added p50 µs"
    );
    let base = percentile(&mut samples[0].clone(), 0.5);
    for (i, mode) in modes.iter().enumerate() {
        let s = &mut samples[i];
        let (p50, p99) = (percentile(s, 0.5), percentile(s, 0.99));
        let mean = s.iter().sum::<f64>() / s.len() as f64;
        println!(
            "  {:<20} {:>9.1} {:>9.1} {:>9.1} {:>+14.1}",
            mode.name(),
            p50,
            p99,
            mean,
            p50 - base
        );
    }
    let ebpf = percentile(&mut samples[1], 0.5);
    let nft = percentile(&mut samples[2], 0.5);
    println!(
        "  targets: eBPF ≤ nftables ({}), eBPF adds ≤ 10 µs ({:+.1} µs: {})\n",
        if ebpf <= nft { "met" } else { "missed" },
        ebpf - base,
        if ebpf - base <= 10.0 { "met" } else { "missed" }
    );
    Ok(())
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn tls(args: &TransparentBenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let ca = Arc::new(CertificateAuthority::load_or_create(dir.path())?.0);

    // Mint time alone, for fresh names.
    let mut mint_ms = Vec::with_capacity(args.mints);
    for i in 0..args.mints {
        let t = Instant::now();
        ca.leaf(&format!("mint-{i}.bench.test"))?;
        mint_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let acceptor = tokio_rustls::TlsAcceptor::from(server_config(ca.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((c, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    if let Ok(mut tls) = acceptor.accept(c).await {
                        let _ = tokio::io::AsyncWriteExt::shutdown(&mut tls).await;
                    }
                });
            }
        });
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.cert_der().clone())?;
        let client = Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth(),
        );
        let connector = tokio_rustls::TlsConnector::from(client);
        let handshake = move |name: String| {
            let connector = connector.clone();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await?;
                let sni = rustls::pki_types::ServerName::try_from(name)?;
                let t = Instant::now();
                let _tls = connector.connect(sni, tcp).await?;
                anyhow::Ok(t.elapsed().as_secs_f64() * 1e3)
            }
        };

        // First handshake for a new name (mint on the server side) vs a cached one.
        let mut first = Vec::new();
        let mut cached = Vec::new();
        for i in 0..args.mints.min(50) {
            let name = format!("new-{i}.bench.test");
            first.push(handshake(name.clone()).await?);
            cached.push(handshake(name).await?);
        }

        // Closed-loop handshakes/s with the leaf cached.
        handshake("api.openai.com".into()).await?;
        println!(
            "TLS (rustls, ECDSA P-256 leaves; client and server share this machine's 2 cores)"
        );
        for conc in [1usize, 4] {
            let deadline = Instant::now() + Duration::from_secs_f64(args.tls_duration);
            let mut tasks = Vec::new();
            for _ in 0..conc {
                let h = handshake.clone();
                tasks.push(tokio::spawn(async move {
                    let mut n = 0u64;
                    while Instant::now() < deadline {
                        h("api.openai.com".into()).await?;
                        n += 1;
                    }
                    anyhow::Ok(n)
                }));
            }
            let mut total = 0;
            for t in tasks {
                total += t.await??;
            }
            println!(
                "  handshakes/s, cached leaf, {conc} concurrent: {:.0}",
                total as f64 / args.tls_duration
            );
        }
        println!(
            "  handshake latency p50: new name (mint + handshake) {:.2} ms, cached {:.2} ms",
            percentile(&mut first, 0.5),
            percentile(&mut cached, 0.5)
        );
        println!(
            "  minting a leaf for a new name: p50 {:.2} ms, p99 {:.2} ms ({} names)",
            percentile(&mut mint_ms, 0.5),
            percentile(&mut mint_ms, 0.99),
            args.mints
        );
        anyhow::Ok(())
    })
}
