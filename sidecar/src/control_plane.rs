//! What `tokentap serve` and `tokentap worker` share about their HTTP control plane: no
//! open port beyond loopback without a token, and the listener (plain TCP, or TLS with
//! `--tls-cert`/`--tls-key`), with a connection cap, a TLS handshake deadline and request head
//! and idle deadlines.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokentap_proxy::limits::ConnectionGate;

use crate::guarded_conn::{Conn, Deadlines, GuardedConn};

/// How long a client has to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections accepted (and, with TLS, through their handshake) but not yet taken by the
/// server.
const HANDSHAKE_BACKLOG: usize = 64;
/// Connections open at once; past it new ones are closed at once. A control plane serves a
/// few trainers, proxies or shippers, each with a handful of connections.
const MAX_CONNECTIONS: usize = 1024;
/// A request head must arrive within `head`; a kept-alive connection may then sit `idle`
/// (long enough for the node's longest answer, a pause's 600 s wait, to be read and followed).
const DEADLINES: Deadlines = Deadlines {
    head: Duration::from_secs(10),
    idle: Duration::from_secs(120),
};

/// TLS for a control plane's own listener.
#[derive(Args, Clone)]
pub struct TlsListenArgs {
    /// Serve over HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[arg(long, requires = "tls_key", value_name = "PEM")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert", value_name = "PEM")]
    pub tls_key: Option<PathBuf>,
}

impl TlsListenArgs {
    fn server_config(&self) -> anyhow::Result<Option<Arc<rustls::ServerConfig>>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let read = |p: &Path, what: &str| {
            std::fs::read(p).with_context(|| format!("reading {what} {}", p.display()))
        };
        let chain = CertificateDer::pem_slice_iter(&read(cert, "--tls-cert")?)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("--tls-cert {}: not PEM certificates", cert.display()))?;
        if chain.is_empty() {
            anyhow::bail!("--tls-cert {}: no certificate in it", cert.display());
        }
        let key = PrivateKeyDer::from_pem_slice(&read(key, "--tls-key")?)
            .with_context(|| format!("--tls-key {}: no PEM private key", key.display()))?;
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("--tls-cert and --tls-key do not make a usable pair")?;
        Ok(Some(Arc::new(config)))
    }
}

/// Serves `app` on `listen` (over TLS when `tls` says so) until `shutdown` completes.
pub async fn serve(
    listen: SocketAddr,
    tls: &TlsListenArgs,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(SocketAddr, bool),
) -> anyhow::Result<()> {
    let config = tls.server_config()?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("listening on {listen}"))?;
    let local = listener.local_addr()?;
    ready(local, config.is_some());
    let app = app.layer(axum::middleware::map_response(close_after_refusal));
    axum::serve(LimitedListener::start(listener, config), app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(Into::into)
}

/// A request refused before its body was read (too large, or no valid token) leaves that
/// body unread on the connection, and hyper closes it after the answer. Saying so
/// (`Connection: close`) keeps a client from sending its next request down a connection that
/// is about to close.
async fn close_after_refusal(mut response: axum::response::Response) -> axum::response::Response {
    use axum::http::{header, HeaderValue, StatusCode};
    if matches!(
        response.status(),
        StatusCode::PAYLOAD_TOO_LARGE | StatusCode::UNAUTHORIZED
    ) {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Accepts TCP connections and hands axum those admitted under the cap and, with TLS, whose
/// handshake completed in time. Past [`MAX_CONNECTIONS`] a connection is closed at once;
/// handshakes run in their own tasks: a client that stalls in one holds up nobody. Each
/// connection handed on is a [`GuardedConn`] (request head and idle deadlines).
struct LimitedListener {
    local: SocketAddr,
    ready: tokio::sync::mpsc::Receiver<(GuardedConn, SocketAddr)>,
}

impl LimitedListener {
    fn start(
        listener: tokio::net::TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> LimitedListener {
        let local = listener.local_addr().expect("a bound listener");
        let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
        let gate = ConnectionGate::new(MAX_CONNECTIONS);
        let (tx, ready) = tokio::sync::mpsc::channel(HANDSHAKE_BACKLOG);
        tokio::spawn(async move {
            loop {
                let (tcp, peer) = match listener.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // Out of descriptors and the like: wait instead of spinning.
                        tracing::warn!(error = %e, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(permit) = gate.admit() else {
                    tracing::warn!(%peer, max = MAX_CONNECTIONS, "too many connections: closed at once");
                    continue;
                };
                let (acceptor, handed) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let io: Box<dyn Conn> = match acceptor {
                        None => Box::new(tcp),
                        Some(acceptor) => {
                            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
                                .await
                            {
                                Ok(Ok(tls)) => Box::new(tls),
                                Ok(Err(e)) => {
                                    return tracing::debug!(%peer, error = %e, "TLS handshake failed")
                                }
                                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
                            }
                        }
                    };
                    let conn = GuardedConn::new(io, permit, DEADLINES);
                    let _ = handed.send((conn, peer)).await;
                });
                if tx.is_closed() {
                    return;
                }
            }
        });
        LimitedListener { local, ready }
    }
}

impl axum::serve::Listener for LimitedListener {
    type Io = GuardedConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The accept loop is gone (it never returns while this listener lives).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

/// Refuses to expose an unauthenticated control plane: a listen address that is not loopback
/// needs a token. `flag` and `env` name where the token comes from, for the error.
pub fn check_exposure(
    listen: SocketAddr,
    token: Option<&str>,
    flag: &str,
    env: &str,
) -> anyhow::Result<()> {
    if token.is_some_and(|t| t.trim().is_empty()) {
        anyhow::bail!("{flag} (or {env}) is empty; give a real token or none");
    }
    if token.is_none() && !listen.ip().is_loopback() {
        anyhow::bail!(
            "refusing to listen on {listen} without a token: anyone who can reach it could use \
             this control plane. Set {flag} TOKEN (or the {env} environment variable), or listen \
             on a loopback address (127.0.0.1, [::1])"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_may_stay_open_anything_else_needs_a_token() {
        let ok = |a: &str, t: Option<&str>| check_exposure(a.parse().unwrap(), t, "--token", "T");
        assert!(ok("127.0.0.1:1", None).is_ok());
        assert!(ok("[::1]:1", None).is_ok());
        for open in ["0.0.0.0:1", "[::]:1", "10.1.2.3:1", "[fe80::1]:1"] {
            let e = ok(open, None).unwrap_err().to_string();
            assert!(e.contains("--token") && e.contains("T"), "{e}");
            assert!(ok(open, Some("t")).is_ok());
        }
        assert!(ok("127.0.0.1:1", Some(" ")).is_err());
    }
}
