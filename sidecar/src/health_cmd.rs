//! `tokentap health URL`: exits 0 when URL answers 2xx within 2 s. For exec probes and
//! HEALTHCHECKs in images without curl (the sidecar proxy listens on loopback only, where the
//! kubelet's own HTTP probes cannot reach).

use std::process::ExitCode;
use std::time::Duration;

#[derive(clap::Args)]
pub struct HealthArgs {
    /// e.g. http://127.0.0.1:15080/health
    url: String,
}

pub fn run(args: HealthArgs) -> anyhow::Result<ExitCode> {
    let client = reqwest::blocking::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()?;
    match client.get(&args.url).send() {
        Ok(r) if r.status().is_success() => Ok(ExitCode::SUCCESS),
        Ok(r) => {
            eprintln!("{}: {}", args.url, r.status());
            Ok(ExitCode::FAILURE)
        }
        Err(e) => {
            eprintln!("{}: {e}", args.url);
            Ok(ExitCode::FAILURE)
        }
    }
}
