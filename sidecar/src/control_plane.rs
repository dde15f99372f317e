//! What `tokentap serve` and `tokentap worker` share about their HTTP control plane: no
//! open port beyond loopback, and the listener (plain TCP, or TLS with `--tls-cert`).

use std::net::SocketAddr;

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
