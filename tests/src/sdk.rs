//! tests/sdk/validate.py: everything tokentap writes for the three wire APIs, checked by the
//! providers' own SDKs (their pydantic types strictly, the documented event order, their
//! streaming helpers). Run against a tokentap on loopback by the `sdk_types` and
//! `tito_engines` e2e tests.

use serde_json::Value;

use crate::artefacts::Artefacts;

/// Runs validate.py against `base` for `scenarios` (all when `None`); its report, once
/// asserted free of failures.
pub async fn validate(base: &str, scenarios: Option<&str>) -> Value {
    let python = Artefacts::require_python();
    let probe = std::process::Command::new(&python)
        .args(["-c", "import openai, anthropic"])
        .output()
        .unwrap();
    assert!(
        probe.status.success(),
        "the venv lacks the openai/anthropic SDKs (run scripts/setup): {}",
        String::from_utf8_lossy(&probe.stderr)
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/validate.py");
    let mut args = vec![script, "--base", base];
    if let Some(s) = scenarios {
        args.extend(["--scenarios", s]);
    }
    let out = tokio::process::Command::new(&python)
        .args(&args)
        // The SDKs talk to tokentap on loopback only.
        .env("NO_PROXY", "*")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("ANTHROPIC_BASE_URL")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("validate.py wrote no report ({e}):\n{stdout}\n{stderr}"));
    let failures = report["failures"].as_array().unwrap();
    assert!(
        failures.is_empty() && out.status.success(),
        "{} failure(s) against the SDKs' types:\n{}\n(report: {})\n{stderr}",
        failures.len(),
        failures
            .iter()
            .map(|f| format!("- {}", f.as_str().unwrap_or_default()))
            .collect::<Vec<_>>()
            .join("\n"),
        serde_json::to_string(&report["validated"]).unwrap(),
    );
    report
}
