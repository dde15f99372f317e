//! TLS for transparent capture: the local CA and its per-name leaves (`ca`), a look at a
//! connection's ClientHello without consuming it (`sni`), and the rustls server configuration
//! that presents a minted leaf for whatever name the client asked for.

pub mod ca;
pub mod sni;

use std::sync::Arc;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

pub use ca::{CaError, CertificateAuthority};

/// Presents the CA's leaf for the client's SNI.
#[derive(Debug)]
struct MintingResolver {
    ca: Arc<CertificateAuthority>,
}

impl ResolvesServerCert for MintingResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let name = hello.server_name()?;
        match self.ca.leaf(name) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(error = %e, "no certificate for the client's server name");
                None
            }
        }
    }
}

/// The server side of intercepted connections: HTTP/1.1 only (ALPN), leaves from `ca`.
pub fn server_config(ca: Arc<CertificateAuthority>) -> Arc<rustls::ServerConfig> {
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default protocol versions")
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(MintingResolver { ca }));
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}
