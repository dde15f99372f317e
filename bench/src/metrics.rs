//! What the proxy's metrics cost per call: `Metrics::record_call` (every series a finished call
//! updates, session activity included) and a scrape, timed in-process on one thread over
//! sessions and harnesses shaped like a rollout's. Set the result beside the proxy's CPU per
//! call from `tokentap bench proxy` in the same run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clap::Args;
use tokentap_proxy::capture::CallCapture;
use tokentap_proxy::harness::Harness;
use tokentap_proxy::metrics::Metrics;
use tokentap_schema::{BackendInfo, BackendKind, HarnessRequest, Usage, WireApi};

#[derive(Args)]
pub struct MetricsBenchArgs {
    /// Calls to count.
    #[arg(long, default_value_t = 1_000_000)]
    pub calls: usize,
    /// Sessions the calls rotate through (the activity map's size).
    #[arg(long, default_value_t = 1_000)]
    pub sessions: usize,
    /// Print the figures as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: MetricsBenchArgs) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let agents = [
        "codex_exec/0.169.0",
        "claude-cli/2.1.330 (external, sdk-cli)",
        "QwenCode/0.24.4 (linux; x64)",
        "OpenAI/JS 6.26.0",
    ];
    // One record per session, re-stamped per call: building records is not what is measured.
    let mut records: Vec<_> = (0..args.sessions.max(1))
        .map(|i| {
            let mut request = HarnessRequest::bare("POST", "/v1/chat/completions");
            request.headers =
                BTreeMap::from([("user-agent".to_owned(), agents[i % agents.len()].to_owned())]);
            let mut call = CallCapture::new(
                WireApi::ChatCompletions,
                request,
                BackendInfo {
                    kind: BackendKind::Vllm,
                    url: "http://127.0.0.1:1".into(),
                    model: "Qwen/Qwen3-8B".into(),
                    policy_version: Some("step-12".into()),
                    engine_weight_version: None,
                    synthetic_stream: false,
                },
            );
            call.response_status = 200;
            let mut r = call.into_record();
            r.session_id = format!("sample-{i}");
            r.usage = Some(Usage {
                prompt_tokens: 12_000,
                completion_tokens: 400,
                total_tokens: 12_400,
                reasoning_tokens: None,
            });
            r.timings.backend_ms = 900.0;
            r.timings.proxy_overhead_ms = 0.8;
            r.timings.time_to_first_token_ms = Some(120.0);
            r
        })
        .collect();
    let start_ms = records[0].started_at_unix_ms;
    let n = records.len();
    let t = Instant::now();
    for i in 0..args.calls {
        let r = &mut records[i % n];
        // Each session's next call starts 2 s after its last one ended.
        let turn = (i / n) as u64;
        r.started_at_unix_ms = start_ms + turn * 3_000;
        r.ended_at_unix_ms = r.started_at_unix_ms + 1_000;
        let harness = (i % 7 == 0).then_some(Harness::Pi);
        metrics.activity.begin(
            &r.session_id,
            ["vllm".into(), "Qwen/Qwen3-8B".into(), "other".into()],
        );
        metrics.record_call(r, harness, true);
    }
    let per_call = t.elapsed() / args.calls.max(1) as u32;
    let t = Instant::now();
    let scrapes = 100;
    let mut bytes = 0;
    for _ in 0..scrapes {
        bytes = metrics.render().len();
    }
    let per_scrape = t.elapsed() / scrapes;
    report(&args, per_call, per_scrape, bytes);
    Ok(())
}

fn report(args: &MetricsBenchArgs, per_call: Duration, per_scrape: Duration, bytes: usize) {
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "calls": args.calls,
                "sessions": args.sessions,
                "record_call_ns": per_call.as_nanos() as u64,
                "scrape_us": per_scrape.as_micros() as u64,
                "scrape_bytes": bytes,
            })
        );
        return;
    }
    println!(
        "metrics per call: {:.2} µs ({} calls over {} sessions, one thread)",
        per_call.as_nanos() as f64 / 1000.0,
        args.calls,
        args.sessions
    );
    println!(
        "one scrape: {:.0} µs, {} bytes",
        per_scrape.as_nanos() as f64 / 1000.0,
        bytes
    );
}
