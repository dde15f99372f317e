//! The webhook's serving certificate: `tokentap webhook cert` makes a CA and a certificate
//! for the Service's DNS names (what the API server checks against `caBundle`), and `serve`
//! refuses one that is expired or not yet valid, and warns when one is about to expire.

use std::path::Path;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("{0}")]
    Generate(String),
    #[error("{path}: {message}")]
    Invalid { path: String, message: String },
}

/// A CA and a serving certificate, as PEM.
pub struct ServingCert {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// The names the API server may dial the Service by.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// A new CA and a serving certificate for `names`, valid for `days`.
pub fn generate(names: &[String], days: u32) -> Result<ServingCert, CertError> {
    let err = |e: rcgen::Error| CertError::Generate(e.to_string());
    let now = time::OffsetDateTime::now_utc();
    let until = now + time::Duration::days(days.into());
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca_params = CertificateParams::default();
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "tokentap webhook CA");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca_params.not_before = now - time::Duration::minutes(5);
    ca_params.not_after = until;
    let ca = ca_params.self_signed(&ca_key).map_err(err)?;
    let key = KeyPair::generate().map_err(err)?;
    let mut params = CertificateParams::new(names.to_vec()).map_err(err)?;
    params.distinguished_name.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_default(),
    );
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = until;
    let issuer = rcgen::Issuer::new(ca_params, &ca_key);
    let cert = params.signed_by(&key, &issuer).map_err(err)?;
    Ok(ServingCert {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// How long the first certificate in the PEM file at `path` remains valid. An expired or
/// not-yet-valid certificate is an error naming its dates.
pub fn remaining_validity(path: &Path) -> Result<Duration, CertError> {
    let invalid = |message: String| CertError::Invalid {
        path: path.display().to_string(),
        message,
    };
    let pem = std::fs::read(path).map_err(|e| invalid(e.to_string()))?;
    let (_, pem) =
        x509_parser::pem::parse_x509_pem(&pem).map_err(|e| invalid(format!("not PEM: {e}")))?;
    let cert = pem
        .parse_x509()
        .map_err(|e| invalid(format!("not a certificate: {e}")))?;
    let validity = cert.validity();
    let now = x509_parser::time::ASN1Time::now();
    if now < validity.not_before {
        return Err(invalid(format!(
            "the certificate is not valid before {} (the clock, or a certificate made for later)",
            validity.not_before
        )));
    }
    match validity.time_to_expiration() {
        Some(left) => Ok(Duration::from_secs(left.whole_seconds().max(0) as u64)),
        None => Err(invalid(format!(
            "the certificate expired on {}: make a new one (`tokentap webhook cert`, or let cert-manager renew it) and update the MutatingWebhookConfiguration's caBundle",
            validity.not_after
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_certificate_names_the_service_and_is_valid_for_its_days() {
        let names = service_names("tokentap-webhook", "tokentap");
        let c = generate(&names, 30).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tls.crt");
        std::fs::write(&p, &c.cert_pem).unwrap();
        let left = remaining_validity(&p).unwrap();
        assert!(left > Duration::from_secs(29 * 86400) && left <= Duration::from_secs(30 * 86400));
        let (_, pem) = x509_parser::pem::parse_x509_pem(c.cert_pem.as_bytes()).unwrap();
        let cert = pem.parse_x509().unwrap();
        let san = cert.subject_alternative_name().unwrap().unwrap();
        let text = format!("{:?}", san.value);
        assert!(text.contains("tokentap-webhook.tokentap.svc"), "{text}");
    }
}
