//! The transparent listener: where redirected connections land (eBPF connect redirect or an
//! nftables REDIRECT). For each connection it learns where it was going, peeks at its first
//! bytes without consuming them, and either
//! - intercepts it: a TLS ClientHello for a host on the intercept list is answered with a leaf
//!   minted by the local CA and the decrypted HTTP is served by the capture service, or
//! - splices it, byte for byte, to its original destination (any other host, non-TLS traffic,
//!   a client that speaks nothing first).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use pingora::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, Ssl, UniqueID, UniqueIDType,
};
use pingora::server::ShutdownWatch;
use tokentap_schema::ErrorKind;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use crate::app::CaptureService;
use crate::tls::sni::{peek_opening, Opening};
use crate::tls::{server_config, CertificateAuthority};
use tokentap_service_kit::limits::ConnectionPermit;

/// LLM API hosts intercepted by default; everything else passes through untouched.
pub const DEFAULT_INTERCEPT: &[&str] = &[
    "api.openai.com",
    "api.anthropic.com",
    "chatgpt.com",
    "generativelanguage.googleapis.com",
    "dashscope.aliyuncs.com",
];

/// Answers where a redirected connection was going, given the accepted socket and its client
/// end (our peer). `None`: not a redirected connection. For a listener that captures one
/// cgroup (`run`, `sidecar`, a rollout sample).
pub trait OriginalDestination: Send + Sync + 'static {
    fn original_destination(&self, conn: &TcpStream, peer: SocketAddr) -> Option<SocketAddr>;
}

/// Whose a redirected connection is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attribution {
    /// The listener's own (its `with_session`, else attributed per call).
    Listener,
    /// A workload captured under this session (the node agent's listener, shared by many).
    Session(String),
    /// A workload that is redirected but not captured (an unlabelled container under the
    /// agent's capture parent): its connections are passed through untouched.
    NotCaptured,
}

/// A redirected connection: where it was going and whose it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirection {
    pub destination: SocketAddr,
    pub attribution: Attribution,
}

/// What the listener asks of each accepted connection. `None`: the kernel did not redirect it.
#[async_trait]
pub trait Redirections: Send + Sync + 'static {
    async fn redirection(&self, conn: &TcpStream, peer: SocketAddr) -> Option<Redirection>;
}

#[async_trait]
impl<T: OriginalDestination> Redirections for T {
    async fn redirection(&self, conn: &TcpStream, peer: SocketAddr) -> Option<Redirection> {
        Some(Redirection {
            destination: self.original_destination(conn, peer)?,
            attribution: Attribution::Listener,
        })
    }
}

/// The line `tokentap await-capture` sends from inside a workload, and the answers. The probe
/// connects to an address on a redirected port: it reaches the agent only once the workload's
/// cgroup is attached, which is exactly what it waits for.
pub const AWAIT_CAPTURE_PROBE: &[u8] = b"TOKENTAP-AWAIT-CAPTURE\n";
/// Followed by the session and a newline.
pub const AWAIT_CAPTURE_ATTACHED: &str = "ATTACHED ";
pub const AWAIT_CAPTURE_NOT_CAPTURED: &str = "NOT-CAPTURED\n";

/// Host names to intercept: exact names, or `*.suffix` for any subdomain. Case-insensitive.
#[derive(Debug, Clone)]
pub struct InterceptList {
    names: Vec<String>,
}

impl InterceptList {
    pub fn new<S: AsRef<str>>(names: impl IntoIterator<Item = S>) -> Self {
        InterceptList {
            names: names
                .into_iter()
                .map(|s| s.as_ref().trim().trim_end_matches('.').to_ascii_lowercase())
                .filter(|s| !s.is_empty())
                .collect(),
        }
    }

    pub fn contains(&self, host: &str) -> bool {
        let host = host.trim_end_matches('.').to_ascii_lowercase();
        self.names.iter().any(|n| match n.strip_prefix("*.") {
            Some(suffix) => {
                host.len() > suffix.len() && host.ends_with(suffix) && {
                    host.as_bytes()[host.len() - suffix.len() - 1] == b'.'
                }
            }
            None => *n == host,
        })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// How a connection was handled (the label of `tokentap_transparent_connections_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Intercepted,
    PassedThrough,
    TlsFailed,
    /// Not a redirected connection and not one to intercept, or (on a shared listener) one
    /// that would leave its network namespace for ours: closed.
    Dropped,
    /// An await-capture probe, answered.
    Probe,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Intercepted => "intercepted",
            Outcome::PassedThrough => "passed_through",
            Outcome::TlsFailed => "tls_failed",
            Outcome::Dropped => "dropped",
            Outcome::Probe => "probe",
        }
    }
}

pub struct TransparentListener {
    service: Arc<CaptureService>,
    acceptor: TlsAcceptor,
    redirections: Arc<dyn Redirections>,
    intercept: InterceptList,
    /// Serves many workloads (the node agent's): see [`TransparentListener::shared_by_workloads`].
    shared: bool,
    /// How long to wait for a client's first bytes before treating it as server-speaks-first.
    peek_wait: Duration,
    /// The session of every call intercepted here (one rollout sample's listener).
    session: Option<String>,
}

impl TransparentListener {
    pub fn new(
        service: Arc<CaptureService>,
        ca: Arc<CertificateAuthority>,
        redirections: Arc<dyn Redirections>,
        intercept: InterceptList,
    ) -> Self {
        TransparentListener {
            service,
            acceptor: TlsAcceptor::from(server_config(ca)),
            redirections,
            intercept,
            shared: false,
            peek_wait: Duration::from_secs(1),
            session: None,
        }
    }

    /// Records every call intercepted by this listener under `session`.
    pub fn with_session(mut self, session: String) -> Self {
        self.session = Some(session);
        self
    }

    /// For a listener on an address other networks reach (the node agent's, on a bridge or the
    /// node IP), shared by many workloads: it serves only connections the kernel redirected
    /// (anything else is closed, so it needs no token), never carries a connection from another
    /// network namespace to a loopback destination (that would be ours, not the workload's),
    /// and answers await-capture probes.
    pub fn shared_by_workloads(mut self) -> Self {
        self.shared = true;
        self
    }

    /// Accepts until `shutdown` turns true.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, mut shutdown: ShutdownWatch) {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((conn, peer)) => {
                        // Past the cap the connection is closed at once: accepting never waits.
                        let Some(permit) = self.service.admit_connection() else {
                            tracing::debug!(%peer, "transparent connection closed: at --max-connections");
                            continue;
                        };
                        let this = self.clone();
                        let watch = shutdown.clone();
                        tokio::spawn(async move { this.handle(conn, peer, watch, permit).await });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "transparent accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        return;
                    }
                }
            }
        }
    }

    async fn handle(
        self: Arc<Self>,
        conn: TcpStream,
        peer: SocketAddr,
        shutdown: ShutdownWatch,
        permit: ConnectionPermit,
    ) {
        let _ = conn.set_nodelay(true);
        let redirection = self.redirections.redirection(&conn, peer).await;
        let opening = match peek_opening(&conn, self.peek_wait).await {
            Ok(o) => o,
            Err(e) => {
                tracing::debug!(error = %e, %peer, "peeking a redirected connection failed");
                return;
            }
        };
        let session = match redirection.as_ref().map(|r| &r.attribution) {
            Some(Attribution::Session(s)) => Some(s.as_str()),
            Some(Attribution::NotCaptured) => None,
            Some(Attribution::Listener) | None => self.session.as_deref(),
        };
        let captured = !matches!(
            redirection.as_ref().map(|r| &r.attribution),
            Some(Attribution::NotCaptured)
        );
        let outcome = match (opening, &redirection) {
            // Only what the kernel redirected from a captured cgroup is served: a local
            // process dialling the listener directly (its port is no secret) must not get its
            // calls into a capture's session and the engine's credentials.
            (_, None) => Outcome::Dropped,
            (
                Opening::TlsClientHello {
                    server_name: Some(host),
                },
                _,
            ) if captured && self.intercept.contains(&host) => {
                let session = session.map(str::to_owned);
                self.intercept(conn, &host, session.as_deref(), shutdown, permit)
                    .await
            }
            (Opening::Other, Some(r)) if self.shared && is_probe(&conn).await => {
                answer_probe(conn, &r.attribution).await
            }
            (_, Some(r)) if self.shared && leaves_its_namespace(&conn, peer, r.destination) => {
                Outcome::Dropped
            }
            (_, Some(r)) => splice(conn, r.destination).await,
        };
        self.service
            .metrics()
            .transparent
            .with_label_values(&[outcome.as_str()])
            .inc();
        tracing::debug!(%peer, ?redirection, outcome = outcome.as_str(), "transparent connection");
    }

    async fn intercept(
        &self,
        conn: TcpStream,
        host: &str,
        session: Option<&str>,
        shutdown: ShutdownWatch,
        permit: ConnectionPermit,
    ) -> Outcome {
        let id = std::os::fd::AsRawFd::as_raw_fd(&conn);
        let deadline = self.service.limits().tls_handshake_timeout;
        match tokio::time::timeout(deadline, self.acceptor.accept(conn)).await {
            Err(_) => {
                // A stalled handshake is a slow or hostile client, not a rejected certificate:
                // counted, not recorded (records of it could flood the spool).
                self.service.closed_by("tls_handshake_timeout");
                tracing::debug!(
                    host,
                    ?deadline,
                    "TLS handshake not finished in time; closed"
                );
                Outcome::TlsFailed
            }
            Ok(Ok(tls)) => {
                let stream = Box::new(InterceptedStream { tls, id });
                self.service
                    .serve_admitted_stream(stream, &shutdown, session, permit)
                    .await;
                Outcome::Intercepted
            }
            Ok(Err(e)) => {
                let message = format!(
                    "TLS handshake for {host} failed: {e}. The client does not accept tokentap's certificate (it may pin its certificates, or not trust the CA: see `tokentap ca path`); leave {host} off the intercept list to let it through untouched."
                );
                tracing::warn!("{message}");
                self.service
                    .record_connection_failure(
                        host,
                        ErrorKind::TlsHandshakeFailed,
                        message,
                        session,
                    )
                    .await;
                Outcome::TlsFailed
            }
        }
    }
}

/// Whether the client sent exactly the await-capture probe line.
async fn is_probe(conn: &TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(conn.peek(&mut buf).await, Ok(n) if &buf[..n] == AWAIT_CAPTURE_PROBE)
}

/// Tells an await-capture probe whether its workload is captured, and under which session.
async fn answer_probe(mut conn: TcpStream, attribution: &Attribution) -> Outcome {
    use tokio::io::AsyncWriteExt;
    let answer = match attribution {
        Attribution::Session(s) => format!("{AWAIT_CAPTURE_ATTACHED}{s}\n"),
        Attribution::Listener => format!("{AWAIT_CAPTURE_ATTACHED}\n"),
        Attribution::NotCaptured => AWAIT_CAPTURE_NOT_CAPTURED.to_owned(),
    };
    let mut probe = [0u8; AWAIT_CAPTURE_PROBE.len()];
    let _ = tokio::io::AsyncReadExt::read_exact(&mut conn, &mut probe).await;
    let _ = conn.write_all(answer.as_bytes()).await;
    let _ = conn.shutdown().await;
    Outcome::Probe
}

/// A loopback destination means the workload's own loopback when it connected from another
/// network namespace (a container on a bridge, a pod): splicing it to ours would hand the
/// workload the host's loopback services. Peers in our namespace connect from loopback or from
/// the listener's own address.
fn leaves_its_namespace(conn: &TcpStream, peer: SocketAddr, dest: SocketAddr) -> bool {
    let ours =
        peer.ip().is_loopback() || conn.local_addr().is_ok_and(|local| local.ip() == peer.ip());
    dest.ip().is_loopback() && !ours
}

/// Connects to `dest` (from outside the redirected cgroup, so never redirected again) and copies
/// both ways until either side closes.
async fn splice(mut conn: TcpStream, dest: SocketAddr) -> Outcome {
    match TcpStream::connect(dest).await {
        Ok(mut upstream) => {
            let _ = upstream.set_nodelay(true);
            let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
        }
        Err(e) => {
            // The client sees the refusal as a reset, as it would have without us.
            tracing::debug!(error = %e, %dest, "pass-through connect failed");
        }
    }
    Outcome::PassedThrough
}

/// A decrypted client connection, in the shape Pingora's HTTP session reads.
#[derive(Debug)]
struct InterceptedStream {
    tls: TlsStream<TcpStream>,
    id: UniqueIDType,
}

impl AsyncRead for InterceptedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_read(cx, buf)
    }
}

impl AsyncWrite for InterceptedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tls).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tls).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for InterceptedStream {
    async fn shutdown(&mut self) {
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut self.tls).await;
    }
}

impl UniqueID for InterceptedStream {
    fn id(&self) -> UniqueIDType {
        self.id
    }
}

impl Ssl for InterceptedStream {}

impl GetTimingDigest for InterceptedStream {
    fn get_timing_digest(&self) -> Vec<Option<pingora::protocols::TimingDigest>> {
        Vec::new()
    }
}

impl GetProxyDigest for InterceptedStream {
    fn get_proxy_digest(&self) -> Option<Arc<pingora::protocols::raw_connect::ProxyDigest>> {
        None
    }
}

impl GetSocketDigest for InterceptedStream {
    fn get_socket_digest(&self) -> Option<Arc<pingora::protocols::SocketDigest>> {
        None
    }
}

#[async_trait]
impl Peek for InterceptedStream {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_intercept_list_matches_names_and_wildcards_exactly() {
        let l = InterceptList::new(["api.openai.com", "*.example.org", "API.Anthropic.com."]);
        assert!(l.contains("api.openai.com"));
        assert!(l.contains("API.OPENAI.COM."));
        assert!(l.contains("api.anthropic.com"));
        assert!(!l.contains("openai.com"));
        assert!(!l.contains("evilapi.openai.com"));
        assert!(!l.contains("api.openai.com.evil.net"));
        assert!(l.contains("a.example.org") && l.contains("a.b.example.org"));
        assert!(!l.contains("example.org") && !l.contains("badexample.org"));
        let d = InterceptList::new(DEFAULT_INTERCEPT);
        assert!(d.contains("chatgpt.com") && !d.contains("github.com"));
    }
}
