//! The soak's CI form: `tokentap bench soak` for half a minute (the documented run is 10
//! minutes and more; its figures are in docs/reliability.md). What a benchmark reports as
//! verdicts on speed and memory stays a report; what must hold at any length is asserted:
//! every call sent was answered, has its record (ids compared as sets), and every record is
//! in exactly one trace, faithful to the spool's record.

use std::time::Duration;

use serde_json::Value;

use tokentap_e2e::tokentap::tokentap_cli_within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heavy_soak_short_run_answers_records_and_traces_every_call() {
    let args = "bench soak --sessions 64 --warmup 5 --duration 25 --window 5 --turns 8 \
                --think-ms 300 --session-idle 3 --json";
    let args: Vec<&str> = args.split_whitespace().collect();
    // About 40 s on an idle machine; the bound only stops a hung run.
    let out = tokentap_cli_within(&args, Duration::from_secs(240)).await;
    assert!(out.success, "the soak did not run:\n{}", out.stderr);
    let r: Value = serde_json::from_str(&out.stdout).expect("the soak's JSON report");
    let calls = r["calls"].as_u64().unwrap();
    assert!(calls > 1000, "the load ran: {calls} calls");
    assert_eq!(r["errors"], 0, "every call answered: {r}");
    // Record ids compared as sets: a lost record and a duplicated one do not cancel out.
    assert_eq!(
        r["records"], calls,
        "every call has its record (distinct ids): {r}"
    );
    assert_eq!(r["duplicate_records"], 0, "{r}");
    assert_eq!(r["corrupt_lines"], 0, "{r}");
    assert_eq!(r["traced_records"], calls, "every record traced: {r}");
    assert_eq!(r["untraced_records"], 0, "{r}");
    assert_eq!(r["traced_unknown_records"], 0, "{r}");
    assert_eq!(r["traced_twice"], 0, "{r}");
    // The reconstruction's own report, and this run's check of every trace against the
    // spool's records (prompt ids, sampled ids, logprobs).
    assert_eq!(r["faithfulness_violations"], 0, "{r}");
    assert_eq!(r["digest_violations"], 0, "{r}");
    assert!(
        r["traces"].as_u64().unwrap() >= 64,
        "conversations merged: {r}"
    );
    // Memory was sampled through the run (the figure itself is the benchmark's to judge).
    assert!(r["memory"].as_array().unwrap().len() >= 5, "{r}");
}
