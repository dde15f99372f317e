//! HTTPS in front of a plain-HTTP server the test runs (the scripted engine, a worker): a real
//! rustls server on 127.0.0.1 with a certificate for `localhost` and `127.0.0.1` from a CA of
//! the test's own (rcgen), forwarding each decrypted connection to the plain server. It keeps
//! what clients sent (the first 64 KiB of each connection), so a test can see the headers that
//! crossed TLS.

use std::path::Path;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A private CA: what `--ca-file` is for.
pub struct TestCa {
    pub cert_pem: String,
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let key = rcgen::KeyPair::generate().expect("a CA key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let cert = params.self_signed(&key).expect("a self-signed CA");
        TestCa {
            cert_pem: cert.pem(),
            cert,
            key,
        }
    }

    /// Writes the CA certificate (PEM) to `path`.
    pub fn write_pem(&self, path: &Path) {
        std::fs::write(path, &self.cert_pem).expect("writing the CA PEM");
    }

    /// A server certificate for `localhost` and 127.0.0.1 signed by this CA: (cert PEM, key
    /// PEM).
    pub fn leaf(&self) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("a leaf key");
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("leaf params");
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress([127, 0, 0, 1].into()));
        let issuer =
            rcgen::Issuer::from_ca_cert_der(self.cert.der(), &self.key).expect("the CA as issuer");
        let cert = params.signed_by(&key, &issuer).expect("a signed leaf");
        (cert.pem(), key.serialize_pem())
    }
}

/// An HTTPS front for `http://127.0.0.1:{upstream}`; stopped on drop.
pub struct TlsFront {
    /// `https://localhost:PORT`
    pub url: String,
    pub port: u16,
    seen: Arc<Mutex<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsFront {
    pub async fn start(ca: &TestCa, upstream: u16) -> TlsFront {
        let (cert_pem, key_pem) = ca.leaf();
        let certs = rustls_pemfile_certs(&cert_pem);
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(
            rcgen::KeyPair::from_pem(&key_pem)
                .expect("leaf key")
                .serialize_der()
                .into(),
        );
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("the leaf certificate");
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the TLS front");
        let port = listener.local_addr().expect("local addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = seen.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let (acceptor, kept) = (acceptor.clone(), kept.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(conn).await else {
                        return; // e.g. a client that does not trust the CA
                    };
                    let Ok(plain) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await
                    else {
                        return;
                    };
                    let (mut tls_r, mut tls_w) = tokio::io::split(tls);
                    let (mut up_r, mut up_w) = plain.into_split();
                    let up = async {
                        let mut buf = vec![0u8; 64 << 10];
                        let mut logged = 0usize;
                        loop {
                            let n = match tls_r.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if logged < 64 << 10 {
                                let take = n.min((64 << 10) - logged);
                                kept.lock().unwrap().extend_from_slice(&buf[..take]);
                                logged += take;
                            }
                            if up_w.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        let _ = up_w.shutdown().await;
                    };
                    let down = async {
                        let _ = tokio::io::copy(&mut up_r, &mut tls_w).await;
                        let _ = tls_w.shutdown().await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        TlsFront {
            url: format!("https://localhost:{port}"),
            port,
            seen,
            task,
        }
    }

    /// What clients sent through it so far (decrypted, the first 64 KiB of each connection),
    /// as text.
    pub fn seen(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The certificates of a PEM text.
fn rustls_pemfile_certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<_, _>>()
        .expect("PEM certificates")
}
