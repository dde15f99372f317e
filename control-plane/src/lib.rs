//! What tokentap's HTTP control planes share (`serve`, `worker`, `view`, `node-agent`,
//! `webhook`): no open port beyond loopback without a token ([`check_exposure`]), the token
//! check itself ([`bearer`]), and the listener ([`serve`]: plain TCP, or TLS with
//! `--tls-cert`/`--tls-key`), with a connection cap, a TLS handshake deadline and request head
//! and idle deadlines ([`guarded_conn`]).

pub mod bearer;
pub mod guarded_conn;

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokentap_service_kit::limits::ConnectionGate;

use guarded_conn::{Conn, Deadlines, GuardedConn};

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

/// TLS for a control plane's own listener (with the `clap` feature, its flags).
#[cfg_attr(feature = "clap", derive(clap::Args))]
#[derive(Clone, Default)]
pub struct TlsListenArgs {
    /// Serve over HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    #[cfg_attr(feature = "clap", arg(long, requires = "tls_key", value_name = "PEM"))]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[cfg_attr(feature = "clap", arg(long, requires = "tls_cert", value_name = "PEM"))]
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

    #[test]
    fn only_refusals_before_the_body_say_the_connection_closes() {
        use axum::http::{header, StatusCode};
        use axum::response::IntoResponse;
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        for (status, closes) in [
            (StatusCode::PAYLOAD_TOO_LARGE, true),
            (StatusCode::UNAUTHORIZED, true),
            (StatusCode::OK, false),
            (StatusCode::BAD_REQUEST, false),
        ] {
            let r = rt.block_on(close_after_refusal(status.into_response()));
            let close = r.headers().get(header::CONNECTION);
            assert_eq!(close.is_some_and(|v| v == "close"), closes, "{status}");
        }
    }

    /// Starts `app` under [`serve`] on a loopback port: that port, and the runtime serving it.
    fn served(app: axum::Router) -> (tokio::runtime::Runtime, SocketAddr) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            let tls = TlsListenArgs::default();
            let ready = move |addr, tls| tx.send((addr, tls)).unwrap();
            serve(
                "127.0.0.1:0".parse().unwrap(),
                &tls,
                app,
                std::future::pending(),
                ready,
            )
            .await
        });
        let (addr, tls) = rx.recv().unwrap();
        assert!(!tls, "no --tls-cert: plain");
        (rt, addr)
    }

    /// Sends `request` on a connection of its own and reads the answer until the server
    /// closes it.
    fn exchange(rt: &tokio::runtime::Runtime, addr: SocketAddr, request: &[u8]) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        rt.block_on(async {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(request).await.unwrap();
            let mut answer = Vec::new();
            tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut answer))
                .await
                .expect("the server closes the connection")
                .unwrap();
            String::from_utf8_lossy(&answer).into_owned()
        })
    }

    /// The token check and a body limit as a control plane stacks them, driven through the
    /// listener: a request without the token, or with a body over the limit, is refused and
    /// its connection closed; `/health` stays open.
    #[test]
    fn the_token_and_the_body_limit_refuse_and_close() {
        use axum::routing::{get, post};
        let guarded = axum::Router::new()
            .route(
                "/data",
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
            )
            .route_layer(axum::middleware::from_fn_with_state(
                bearer::BearerToken::new(Some("s3cret")),
                bearer::require,
            ));
        let app = axum::Router::new()
            .merge(guarded)
            .route("/health", get(|| async { "ok" }))
            .layer(axum::extract::DefaultBodyLimit::max(16));
        let (rt, addr) = served(app);

        let unauthorized = exchange(
            &rt,
            addr,
            b"POST /data HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nhi",
        );
        assert!(unauthorized.starts_with("HTTP/1.1 401"), "{unauthorized}");
        assert!(
            unauthorized
                .to_ascii_lowercase()
                .contains("connection: close"),
            "{unauthorized}"
        );
        assert!(unauthorized.contains("unauthorized"), "{unauthorized}");

        let big = format!(
            "POST /data HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer s3cret\r\nContent-Length: 64\r\n\r\n{}",
            "x".repeat(64)
        );
        let too_large = exchange(&rt, addr, big.as_bytes());
        assert!(too_large.starts_with("HTTP/1.1 413"), "{too_large}");
        assert!(
            too_large.to_ascii_lowercase().contains("connection: close"),
            "{too_large}"
        );

        let fits = exchange(
            &rt,
            addr,
            b"POST /data HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer s3cret\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
        );
        assert!(
            fits.starts_with("HTTP/1.1 200") && fits.ends_with("\r\n\r\n2"),
            "{fits}"
        );

        let health = exchange(
            &rt,
            addr,
            b"GET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        );
        assert!(
            health.starts_with("HTTP/1.1 200") && health.ends_with("ok"),
            "{health}"
        );
    }

    #[test]
    fn an_unreadable_tls_pair_is_an_error_naming_the_flag() {
        let dir = std::env::temp_dir().join(format!("tokentap-cp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = TlsListenArgs {
            tls_cert: Some(dir.join("absent.pem")),
            tls_key: Some(dir.join("absent.key")),
        };
        let e = missing.server_config().expect_err("no such file");
        assert!(e.to_string().contains("--tls-cert"), "{e}");
        let not_pem = dir.join("not.pem");
        std::fs::write(&not_pem, "no certificate here").unwrap();
        let empty = TlsListenArgs {
            tls_cert: Some(not_pem.clone()),
            tls_key: Some(not_pem),
        };
        let e = empty.server_config().expect_err("no certificate");
        assert!(e.to_string().contains("no certificate"), "{e}");
        assert!(TlsListenArgs::default().server_config().unwrap().is_none());
        let _ = std::fs::remove_dir_all(dir);
    }
}
