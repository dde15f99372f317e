//! Reading what reconstruction wrote, from a test.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use tokentap_schema::{SessionReport, Trace};

/// Waits (bounded, asserted: 30 s) until `out/sessions.jsonl` reports `sessions` distinct
/// sessions, and returns its reports; `log` explains a timeout.
pub async fn wait_session_reports(
    out: &Path,
    sessions: usize,
    log: impl Fn() -> String,
) -> Vec<SessionReport> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(out.join("sessions.jsonl")).unwrap_or_default();
        let reports: Vec<SessionReport> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("a session report"))
            .collect();
        let seen: HashSet<&str> = reports.iter().map(|r| r.session_id.as_str()).collect();
        if seen.len() >= sessions {
            return reports;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {sessions} sessions reconstructed in {}: {seen:?}\n{}",
            seen.len(),
            out.display(),
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The record ids every trace covers, sorted: equal to the sorted ids of the records when each
/// record is in exactly one trace.
pub fn record_ids_in(traces: &[Trace]) -> Vec<&str> {
    let mut ids: Vec<&str> = traces
        .iter()
        .flat_map(|t| t.calls.iter().map(|c| c.record_id.as_str()))
        .collect();
    ids.sort_unstable();
    ids
}
