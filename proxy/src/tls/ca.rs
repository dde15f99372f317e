//! The per-installation certificate authority that transparent capture presents leaf
//! certificates from: created on first use (`ca.pem`, and `ca-key.pem` readable by its owner
//! only, in a `0700` directory), leaves minted per server name on demand and the most recently
//! used [`LEAF_CACHE_CAP`] of them kept (a client sending endless distinct SNI names cannot
//! grow the process).

use std::io::Write;
use std::num::NonZeroUsize;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca-key.pem";
const CA_NAME: &str = "tokentap local interception CA";
/// Leaf certificates kept in memory; minting one again costs about a millisecond.
pub const LEAF_CACHE_CAP: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is readable by others (mode {mode:o}); the CA key must be private to its owner: chmod 600 {path}")]
    KeyExposed { path: PathBuf, mode: u32 },
    #[error("the CA in {dir} is unusable: {message}")]
    Invalid { dir: PathBuf, message: String },
    #[error("cannot mint a certificate for '{host}': {message}")]
    Mint { host: String, message: String },
}

/// Where the CA lives unless told otherwise: `$TOKENTAP_CA_DIR`, else
/// `$XDG_DATA_HOME/tokentap/ca`, else `~/.local/share/tokentap/ca`.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TOKENTAP_CA_DIR") {
        return PathBuf::from(d);
    }
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
        .unwrap_or_else(|| PathBuf::from("."));
    data.join("tokentap/ca")
}

pub struct CertificateAuthority {
    dir: PathBuf,
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
    leaves: Mutex<lru::LruCache<String, Arc<CertifiedKey>>>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CaError {
    let path = path.to_owned();
    move |source| CaError::Io { what, path, source }
}

/// The current year, for validity windows (a day's precision is plenty).
fn this_year() -> i32 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    1970 + (secs / 31_556_952) as i32
}

impl CertificateAuthority {
    /// Loads the CA in `dir`, creating it first if there is none. Returns whether it was created.
    pub fn load_or_create(dir: &Path) -> Result<(CertificateAuthority, bool), CaError> {
        if dir.join(CA_CERT_FILE).exists() || dir.join(CA_KEY_FILE).exists() {
            return Ok((Self::load(dir)?, false));
        }
        Self::create(dir)?;
        Ok((Self::load(dir)?, true))
    }

    /// Loads an existing CA; refuses a key file others can read, and tightens a directory of
    /// ours others can read to `0700`.
    pub fn load(dir: &Path) -> Result<CertificateAuthority, CaError> {
        tokentap_spool::owner_only::tighten_dir(dir).map_err(io("tightening", dir))?;
        let key_path = dir.join(CA_KEY_FILE);
        let cert_path = dir.join(CA_CERT_FILE);
        let meta = std::fs::metadata(&key_path).map_err(io("reading", &key_path))?;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(CaError::KeyExposed {
                path: key_path,
                mode,
            });
        }
        let key_pem = std::fs::read_to_string(&key_path).map_err(io("reading", &key_path))?;
        let cert_pem = std::fs::read_to_string(&cert_path).map_err(io("reading", &cert_path))?;
        let invalid = |m: String| CaError::Invalid {
            dir: dir.to_owned(),
            message: m,
        };
        let key =
            KeyPair::from_pem(&key_pem).map_err(|e| invalid(format!("{CA_KEY_FILE}: {e}")))?;
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
            .map_err(|e| invalid(format!("{CA_CERT_FILE}: {e}")))?;
        let cert_der = rustls::pki_types::pem::PemObject::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| invalid(format!("{CA_CERT_FILE}: {e}")))?;
        Ok(CertificateAuthority {
            dir: dir.to_owned(),
            cert_pem,
            cert_der,
            issuer,
            leaves: Mutex::new(lru::LruCache::new(
                NonZeroUsize::new(LEAF_CACHE_CAP).expect("non-zero"),
            )),
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        })
    }

    fn create(dir: &Path) -> Result<(), CaError> {
        tokentap_spool::owner_only::create_dir_all(dir).map_err(io("creating", dir))?;
        let mint = |m: rcgen::Error| CaError::Invalid {
            dir: dir.to_owned(),
            message: m.to_string(),
        };
        let key = KeyPair::generate().map_err(mint)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(mint)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, CA_NAME);
        dn.push(DnType::OrganizationName, "tokentap");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let year = this_year();
        params.not_before = date_time_ymd(year - 1, 1, 1);
        params.not_after = date_time_ymd(year + 10, 1, 1);
        let cert = params.self_signed(&key).map_err(mint)?;

        // The key is written 0600 from its first byte (never briefly readable by others).
        let key_path = dir.join(CA_KEY_FILE);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key_path)
            .map_err(io("creating", &key_path))?;
        f.write_all(key.serialize_pem().as_bytes())
            .map_err(io("writing", &key_path))?;
        let cert_path = dir.join(CA_CERT_FILE);
        std::fs::write(&cert_path, cert.pem()).map_err(io("writing", &cert_path))?;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn cert_path(&self) -> PathBuf {
        self.dir.join(CA_CERT_FILE)
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The leaf certificate and key for `host`, minted on first use and cached (least recently
    /// used evicted past [`LEAF_CACHE_CAP`]).
    pub fn leaf(&self, host: &str) -> Result<Arc<CertifiedKey>, CaError> {
        let host = host.to_ascii_lowercase();
        if let Some(k) = self
            .leaves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&host)
        {
            return Ok(k.clone());
        }
        let minted = Arc::new(self.mint(&host)?);
        let mut leaves = self.leaves.lock().unwrap_or_else(|e| e.into_inner());
        Ok(leaves.get_or_insert(host, || minted).clone())
    }

    fn mint(&self, host: &str) -> Result<CertifiedKey, CaError> {
        let err = |m: String| CaError::Mint {
            host: host.to_owned(),
            message: m,
        };
        let key = KeyPair::generate().map_err(|e| err(e.to_string()))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(|e| err(e.to_string()))?;
        params.subject_alt_names = vec![match host.parse::<std::net::IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                host.try_into()
                    .map_err(|e: rcgen::Error| err(e.to_string()))?,
            ),
        }];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, host);
        params.distinguished_name = dn;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let year = this_year();
        params.not_before = date_time_ymd(year - 1, 1, 1);
        params.not_after = date_time_ymd(year + 1, 1, 1);
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(|e| err(e.to_string()))?;
        let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signing = self
            .provider
            .key_provider
            .load_private_key(key_der)
            .map_err(|e| err(e.to_string()))?;
        Ok(CertifiedKey::new(
            vec![cert.der().clone(), self.cert_der.clone()],
            signing,
        ))
    }

    /// Writes the system's trust store followed by this CA to `path`: a bundle for clients
    /// whose CA setting replaces the system store (`SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`).
    pub fn write_bundle(&self, path: &Path) -> Result<(), CaError> {
        let mut bundle = String::new();
        for system in [
            "/etc/ssl/certs/ca-certificates.crt",
            "/etc/pki/tls/certs/ca-bundle.crt",
            "/etc/ssl/cert.pem",
        ] {
            if let Ok(s) = std::fs::read_to_string(system) {
                bundle.push_str(&s);
                if !bundle.ends_with('\n') {
                    bundle.push('\n');
                }
                break;
            }
        }
        bundle.push_str(&self.cert_pem);
        std::fs::write(path, bundle).map_err(io("writing", path))
    }

    /// Environment that makes common clients (Node, Python, curl, OpenSSL,
    /// rustls-native-certs, Codex) trust this CA, given a bundle from [`Self::write_bundle`].
    pub fn trust_env(&self, bundle: &Path) -> Vec<(&'static str, String)> {
        let ca_pem = self.cert_path().display().to_string();
        let bundle = bundle.display().to_string();
        vec![
            ("SSL_CERT_FILE", bundle.clone()),
            ("REQUESTS_CA_BUNDLE", bundle.clone()),
            ("CURL_CA_BUNDLE", bundle),
            ("NODE_EXTRA_CA_CERTS", ca_pem.clone()),
            ("NODE_USE_SYSTEM_CA", "1".into()),
            ("CODEX_CA_CERTIFICATE", ca_pem),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_created_once_with_a_private_key_and_reloaded() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("ca");
        let (ca, created) = CertificateAuthority::load_or_create(&d).unwrap();
        assert!(created);
        let mode = std::fs::metadata(d.join(CA_KEY_FILE))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600);
        assert!(ca.cert_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        let (again, created) = CertificateAuthority::load_or_create(&d).unwrap();
        assert!(!created);
        assert_eq!(again.cert_pem(), ca.cert_pem());
    }

    #[test]
    fn a_key_readable_by_others_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        CertificateAuthority::load_or_create(dir.path()).unwrap();
        let key = dir.path().join(CA_KEY_FILE);
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = CertificateAuthority::load(dir.path()).unwrap_err();
        assert!(matches!(e, CaError::KeyExposed { mode: 0o644, .. }), "{e}");
        assert!(e.to_string().contains("chmod 600"));
    }

    #[test]
    fn leaves_chain_to_the_ca_and_are_cached_per_name() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, _) = CertificateAuthority::load_or_create(dir.path()).unwrap();
        let a = ca.leaf("api.openai.com").unwrap();
        let b = ca.leaf("API.OpenAI.com").unwrap();
        assert!(Arc::ptr_eq(&a, &b), "cached by lowercase name");
        let c = ca.leaf("api.anthropic.com").unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(a.cert.len(), 2);
        assert_eq!(&a.cert[1], ca.cert_der());

        // A real verifier that trusts only this CA accepts the leaf for its name, and no other.
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca.cert_der().clone()).unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        use rustls::client::danger::ServerCertVerifier;
        let now = rustls::pki_types::UnixTime::now();
        let name = rustls::pki_types::ServerName::try_from("api.openai.com").unwrap();
        verifier
            .verify_server_cert(&a.cert[0], &a.cert[1..], &name, &[], now)
            .expect("the minted leaf verifies");
        let other = rustls::pki_types::ServerName::try_from("example.com").unwrap();
        assert!(verifier
            .verify_server_cert(&a.cert[0], &a.cert[1..], &other, &[], now)
            .is_err());
    }

    #[test]
    fn the_leaf_cache_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, _) = CertificateAuthority::load_or_create(dir.path()).unwrap();
        let first = ca.leaf("h0.test").unwrap();
        for i in 1..LEAF_CACHE_CAP + 50 {
            ca.leaf(&format!("h{i}.test")).unwrap();
        }
        assert_eq!(ca.leaves.lock().unwrap().len(), LEAF_CACHE_CAP);
        // The oldest name was evicted: asking again mints a new leaf, still valid for it.
        let again = ca.leaf("h0.test").unwrap();
        assert!(!Arc::ptr_eq(&first, &again));
        assert_eq!(ca.leaves.lock().unwrap().len(), LEAF_CACHE_CAP);
    }

    #[test]
    fn the_ca_directory_is_owner_only() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("share/ca");
        CertificateAuthority::load_or_create(&d).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&d), 0o700);
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        CertificateAuthority::load(&d).unwrap();
        assert_eq!(
            mode(&d),
            0o700,
            "a widened CA directory is tightened on load"
        );
    }
}
