//! Transparent capture of one sample, for agents whose endpoints are hard-coded (closed
//! binaries): the eBPF connect redirect on the sample's cgroup (v2) sends its connects to
//! the redirected ports to a listener of its own, which intercepts the allow-listed LLM hosts
//! with certificates from the node's CA into the node's capture, under the sample's session,
//! and passes everything else through untouched. The node's own connections are outside the
//! cgroup and never redirected.

use std::ffi::CString;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokentap_cgroup::{join_on_spawn, procs_file, Cgroup};
use tokentap_ebpf::{Redirect, RedirectConfig};
use tokentap_proxy::tls::CertificateAuthority;
use tokentap_proxy::transparent::{InterceptList, OriginalDestination, TransparentListener};
use tokentap_proxy::CaptureService;

/// What a node's transparent capture uses for every sample.
pub struct TransparentConfig {
    pub ca: Arc<CertificateAuthority>,
    pub intercept: InterceptList,
    /// Destination ports whose TCP connects are redirected (443 by default).
    pub ports: Vec<u16>,
    /// The system's trust store plus the CA ([`CertificateAuthority::write_bundle`]), written
    /// once for every sample.
    pub bundle: PathBuf,
}

/// One sample's interception; stops, detaches and removes its cgroup on drop.
pub struct SampleInterception {
    shutdown: tokio::sync::watch::Sender<bool>,
    /// The cgroup the redirect is attached to, when it is not the sample's limits cgroup,
    /// with its `cgroup.procs` for the agent to join.
    own_cgroup: Option<(Cgroup, CString)>,
    trust_env: Vec<(&'static str, String)>,
}

struct Destinations(Redirect);

impl OriginalDestination for Destinations {
    fn original_destination(
        &self,
        _conn: &tokio::net::TcpStream,
        peer: SocketAddr,
    ) -> Option<SocketAddr> {
        self.0.original_destination(peer)
    }
}

impl SampleInterception {
    /// Starts intercepting for `session`. `v2_cgroup`: the sample's limits cgroup when it is
    /// on the unified hierarchy (the agent can be in only one v2 cgroup); otherwise a cgroup
    /// of its own is made.
    pub async fn start(
        config: &TransparentConfig,
        service: Arc<CaptureService>,
        session: &str,
        v2_cgroup: Option<&Path>,
    ) -> anyhow::Result<SampleInterception> {
        let (own_cgroup, dir) = match v2_cgroup {
            Some(dir) => (None, dir.to_owned()),
            None => {
                let c = Cgroup::create_for_this_process(&format!("sample-{session}"))?;
                let dir = c.path().to_owned();
                (Some((c, procs_file(&dir)?)), dir)
            }
        };
        let (listener, listener6, at) = bind_loopback_pair().await?;
        let redirect = Redirect::attach(
            &dir,
            &RedirectConfig {
                listener: at,
                // IPv6 connects (connect6) land on [::1] at the same port, when the host has
                // IPv6 loopback; otherwise they are left alone.
                listener_v6: listener6.as_ref().map(|_| Ipv6Addr::LOCALHOST),
                ports: config.ports.clone(),
            },
        )?;
        let front = Arc::new(
            TransparentListener::new(
                service,
                config.ca.clone(),
                Arc::new(Destinations(redirect)),
                config.intercept.clone(),
            )
            .with_session(session.to_owned()),
        );
        let (shutdown, watch) = tokio::sync::watch::channel(false);
        if let Some(l6) = listener6 {
            tokio::spawn(front.clone().serve(l6, watch.clone()));
        }
        tokio::spawn(front.serve(listener, watch));
        Ok(SampleInterception {
            shutdown,
            own_cgroup,
            trust_env: config.ca.trust_env(&config.bundle),
        })
    }

    /// Makes the agent trust the CA and, when the redirect has a cgroup of its own, join it
    /// between fork and exec.
    pub fn prepare(&self, cmd: &mut tokio::process::Command) {
        cmd.envs(self.trust_env.iter().map(|(k, v)| (k, v)));
        if let Some((_, procs)) = &self.own_cgroup {
            join_on_spawn(cmd, vec![procs.clone()]);
        }
    }
}

/// A listener on 127.0.0.1 and, when the host has IPv6 loopback, one on [::1] at the same
/// port (the redirect sends both families to one port).
async fn bind_loopback_pair() -> std::io::Result<(
    tokio::net::TcpListener,
    Option<tokio::net::TcpListener>,
    SocketAddrV4,
)> {
    let mut last = None;
    for _ in 0..8 {
        let listener = tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let SocketAddr::V4(at) = listener.local_addr()? else {
            unreachable!("bound to IPv4")
        };
        match tokio::net::TcpListener::bind((Ipv6Addr::LOCALHOST, at.port())).await {
            Ok(l6) => return Ok((listener, Some(l6), at)),
            // The port is taken on [::1]: try another.
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => last = Some((listener, at)),
            // No IPv6 loopback here: IPv4 only.
            Err(e) => {
                tracing::debug!(error = %e, "no IPv6 loopback; IPv6 connects are not intercepted");
                return Ok((listener, None, at));
            }
        }
    }
    let (listener, at) = last.expect("the loop ran");
    tracing::warn!("no port free on both 127.0.0.1 and [::1]; IPv6 connects are not intercepted");
    Ok((listener, None, at))
}

impl Drop for SampleInterception {
    fn drop(&mut self) {
        // The listener stops accepting; the redirect is detached once its connections end.
        let _ = self.shutdown.send(true);
        if let Some((c, _)) = self.own_cgroup.take() {
            let path = c.path().to_owned();
            if let Err(e) = c.remove() {
                tracing::warn!(error = %e, cgroup = %path.display(), "could not remove a sample's cgroup");
            }
        }
    }
}
