//! The small pieces every tokentap service shares, whether or not it captures: reading a peer's
//! body to a cap, the listeners' connection gate and deadlines, metric registration, and an
//! error with its causes. Kept apart from the proxy so that a service that only needs these
//! (the shipper, the control plane) does not compile and link Pingora.

pub mod capped_body;
pub mod limits;
pub mod metrics;

/// An error with its causes, `: `-joined (reqwest and rustls say why only in the sources:
/// "error sending request: … invalid peer certificate: UnknownIssuer").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
