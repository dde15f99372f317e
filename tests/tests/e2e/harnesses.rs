//! Every real harness, in every wire API it speaks, through tokentap to a real llama-server
//! (via the tee, tiny model): the harness exits 0, and every record holds exactly the token
//! ids llama-server saw and sampled, in one session per harness key, with the key nowhere in
//! the spool.

use tokentap_e2e::checks::{
    assert_complete_token_data, assert_key_absent, assert_records_match_engine,
    assert_secret_redacted,
};
use tokentap_e2e::harness::{
    run_claude, run_codex, run_codex_builtin, run_pi, run_qwen, HarnessDirs, HarnessRun, Wire,
};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::SessionSource;

const PROMPT: &str = "say hi";

/// Runs one harness (given tokentap's root URL and a key) and checks its records.
async fn say_hi(
    what: &str,
    wire: Wire,
    key: &str,
    source: SessionSource,
    run: impl AsyncFnOnce(&HarnessDirs, &str, &str) -> HarnessRun,
) -> Tokentap {
    let llama = LlamaServer::shared().await;
    let tee = TeeProxy::start(&llama.url).await;
    let tokentap = Tokentap::start(TokentapConfig::new(tee.url.clone(), "llamacpp")).await;
    let dirs = HarnessDirs::new();

    let out = run(&dirs, &tokentap.url, key).await;
    out.assert_success(what);

    let calls = tee.chat_exchanges().len();
    assert!(calls >= 1, "{what} made no model call through tokentap");
    eprintln!("{what} made {calls} model call(s)");
    let records = tokentap.wait_records(calls).await;
    assert_eq!(records.len(), calls, "one record per engine call");
    // Complete token data, no gaps (harnesses send tools, so tokentap makes whole engine
    // calls, whose answers carry every sampled id including the end of turn).
    records.iter().for_each(assert_complete_token_data);
    assert_records_match_engine(&records, &tee, &llama.tokenizer()).await;
    // Codex's built-in provider sends no key at all to a custom base URL.
    if source == SessionSource::HarnessHeader && what.contains("built-in") {
        assert!(records
            .iter()
            .all(|r| !r.request.headers.contains_key("authorization")));
        assert_key_absent(&tokentap.spool_bytes(), key);
    } else {
        assert_secret_redacted(&records, &tokentap.spool_bytes(), key);
    }

    // One run, one session (the harness's own id, else its key), numbered 0..n; every call in
    // the wire API the harness was set to.
    let mut seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    seqs.sort();
    assert_eq!(seqs, (0..calls as u64).collect::<Vec<_>>());
    for r in &records {
        // For the compatibility matrix: what each call looked like.
        let body = r.request.body.as_ref().map(|b| b.to_value());
        let body = body.as_ref();
        let notes: Vec<&str> = r.normalizations.iter().map(|n| n.kind.as_str()).collect();
        eprintln!(
            "{what}: {} {} stream={} tools={} prompt={} completion={} normalizations={notes:?}",
            r.request.method,
            r.request.path,
            body.is_some_and(|b| b["stream"] == true),
            body.and_then(|b| b["tools"].as_array().map(Vec::len))
                .unwrap_or(0),
            r.prompt_token_ids.as_ref().map_or(0, Vec::len),
            r.completion_token_ids.as_ref().map_or(0, Vec::len),
        );
        assert_eq!(r.session_source, source, "{what}");
        assert_eq!(r.session_id, records[0].session_id);
        assert_eq!(r.request.path, wire.path(), "{what}");
        assert_eq!(r.response_status, 200, "{what}: {:?}", r.error);
    }
    assert!(
        records.iter().any(|r| r
            .request
            .body
            .as_ref()
            .is_some_and(|b| b.get().contains(PROMPT))),
        "no record of {what} carries the user's prompt"
    );
    tokentap
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_say_hi_over_responses() {
    let wire = Wire::Responses;
    say_hi(
        "codex exec",
        wire,
        "sk-e2e-codex-3b7f19a2",
        SessionSource::HarnessHeader,
        async |d, s, k| run_codex(d, s, k, "m", PROMPT).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_claude_code_say_hi_over_messages() {
    let wire = Wire::Messages;
    say_hi(
        "claude -p",
        wire,
        "sk-ant-e2e-claude-9c2d44e1",
        SessionSource::HarnessHeader,
        async |d, s, k| run_claude(d, s, k, "m", PROMPT, false).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_say_hi_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    say_hi(
        "pi -p",
        wire,
        "sk-e2e-pi-7d41c9e0b2",
        SessionSource::ApiKey,
        async |d, s, k| run_pi(d, s, wire, k, "m", PROMPT).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_say_hi_over_responses() {
    let wire = Wire::Responses;
    say_hi(
        "pi -p (openai-responses)",
        wire,
        "sk-e2e-pi-resp-51c0",
        SessionSource::ApiKey,
        async |d, s, k| run_pi(d, s, wire, k, "m", PROMPT).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_say_hi_over_messages() {
    let wire = Wire::Messages;
    say_hi(
        "pi -p (anthropic-messages)",
        wire,
        "sk-e2e-pi-msg-8e2a",
        SessionSource::ApiKey,
        async |d, s, k| run_pi(d, s, wire, k, "m", PROMPT).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_say_hi_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    say_hi(
        "qwen",
        wire,
        "sk-e2e-qwen-5a8e31f6c4",
        SessionSource::ApiKey,
        async |d, s, k| run_qwen(d, s, wire, k, "m", PROMPT, true).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_say_hi_over_responses() {
    let wire = Wire::Responses;
    say_hi(
        "qwen (openai-responses)",
        wire,
        "sk-e2e-qwen-resp-2f90",
        SessionSource::ApiKey,
        async |d, s, k| run_qwen(d, s, wire, k, "m", PROMPT, true).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_say_hi_over_messages() {
    let wire = Wire::Messages;
    say_hi(
        "qwen (anthropic)",
        wire,
        "sk-ant-e2e-qwen-msg-77d1",
        SessionSource::ApiKey,
        async |d, s, k| run_qwen(d, s, wire, k, "m", PROMPT, true).await,
    )
    .await;
}

/// Codex's built-in `openai` provider pointed at tokentap (`openai_base_url`) tries a
/// WebSocket first; the 426 answer makes it fall back to SSE after one attempt instead of
/// retrying (it sends no key this way, so each call is its own session unless Codex names it).
#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_builtin_provider_falls_back_from_websocket_at_once() {
    let wire = Wire::Responses;
    let tokentap = say_hi(
        "codex exec (built-in openai provider)",
        wire,
        "sk-e2e-codex-builtin-61aa",
        SessionSource::HarnessHeader,
        async |d, s, k| run_codex_builtin(d, s, k, "m", PROMPT).await,
    )
    .await;
    let refused = tokentap
        .metric("tokentap_websocket_upgrades_refused_total")
        .await;
    assert_eq!(refused, Some(1.0), "one WebSocket attempt, then SSE");
}
