//! Observe mode on real harnesses, with reasoning (issue 38): each harness, through tokentap
//! (`--token-mode=observe --tokenizer` the model file), against llama-server on the tiny
//! reasoning model (`scripts/make_tiny_model.py --think`: Qwen3's tokenizer and chat template;
//! every reply opens with `<think>Check</think>\n\n`, then a call to the harness's shell tool,
//! three calls in all before it answers `Done.`), llama-server parsing the block into reasoning
//! (`--reasoning-format deepseek`).
//!
//! Checked for every harness:
//! * every record's `token_observation.render` is `Equal`: tokentap's own rendering and
//!   tokenizing of the conversation gives llama-server's prompt ids, reasoning or not;
//! * every reply's sampled ids open with the `<think>` block, and the model made at least three
//!   calls before `Done.`;
//! * `reasoning_dropped` spans: per call after the first, the engine's own ids say whether the
//!   previous call's reasoning is still in the prompt (the prompt holds as many `<think>` tokens
//!   as the previous prompt and sample together) or was dropped (one fewer); tokentap reports
//!   exactly one `reasoning_dropped` span for each call whose predecessor's reasoning is gone.
//!   What each harness does is asserted too:
//!   - Qwen3's template keeps the reasoning of assistant turns after the last user message
//!     (the whole tool loop here) when the request carries it, but writes it back as
//!     `<think>\nCheck\n</think>\n\n`, not as sampled, so a harness that sends the reasoning
//!     back gets `diverges` with a non-reasoning span (`content_changed` / `merge_difference`),
//!     never `extends`;
//!   - a harness that does not send it back gets `diverges` with one `reasoning_dropped` span.

use serde_json::Value;
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::checks::{assert_complete_token_data, assert_records_match_engine};
use tokentap_e2e::harness::{run_claude, run_codex, run_pi, run_qwen, HarnessDirs, HarnessRun, Wire};
use tokentap_e2e::llama::{LlamaServer, QWEN3_END_THINK, QWEN3_THINK, QWEN3_TOOL_CALL};
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{Continuation, DriftCause, RenderComparison};

const PROMPT: &str = "Where am I? Use the shell.";
const FINAL_TEXT: &str = "Done.";
/// The calls the think model makes before answering.
const CALLS: usize = 3;

fn count(ids: &[u32], id: u32) -> usize {
    ids.iter().filter(|&&i| i == id).count()
}

/// What a session's records say about reasoning, from the engine's ids and tokentap's findings.
struct Findings {
    records: Vec<CaptureRecord>,
    /// Calls after the first whose predecessor's `<think>` block the prompt no longer holds.
    dropped_by_ids: usize,
    /// Calls after the first whose prompt still holds it.
    kept_by_ids: usize,
    /// `reasoning_dropped` spans over the session.
    dropped_spans: usize,
}

async fn observe_reasoning(
    what: &str,
    run: impl AsyncFnOnce(&HarnessDirs, &str) -> HarnessRun,
) -> Findings {
    let llama = LlamaServer::shared_think_model().await;
    let tok = llama.tokenizer();
    let engine = TeeProxy::start(&llama.url).await;
    let config = TokentapConfig::new(engine.url.clone(), "llamacpp")
        .arg("--token-mode=observe")
        .arg("--tokenizer")
        .arg(Artefacts::require_think_model().display().to_string());
    let tokentap = Tokentap::start(config).await;
    let dirs = HarnessDirs::new();
    let out = run(&dirs, &tokentap.url).await;
    out.assert_success(what);
    assert!(
        out.stdout.contains(FINAL_TEXT),
        "{what} does not print the model's final answer {FINAL_TEXT:?}:\n{}",
        out.stdout
    );

    let calls = engine.chat_exchanges();
    let mut records = tokentap.wait_records(calls.len()).await;
    assert_eq!(records.len(), calls.len(), "{what}: one record per engine call");
    records.iter().for_each(assert_complete_token_data);
    assert_records_match_engine(&records, &engine, &tok).await;
    records.sort_by_key(|r| r.seq);
    for r in &records {
        let o = r.token_observation.as_ref();
        eprintln!(
            "{what}: seq {} session {} prompt={} sampled={:?} content={:?} continuation={}",
            r.seq,
            r.session_id,
            r.prompt_token_ids.as_ref().map_or(0, Vec::len),
            r.completion_token_ids.as_ref().map(|c| &c[..c.len().min(6)]),
            r.message.as_ref().and_then(|m| m.content.as_deref()),
            o.map(|o| serde_json::to_string(&o.continuation).unwrap()).unwrap_or_default(),
        );
    }

    // tokentap's ids are llama-server's, on every call.
    for r in &records {
        let o = r
            .token_observation
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: seq {} has no token observation", r.seq));
        assert_eq!(
            o.render,
            RenderComparison::Equal {
                tokens: r.prompt_token_ids.as_ref().unwrap().len() as u32
            },
            "{what}: seq {}: tokentap's ids are not llama-server's",
            r.seq
        );
    }

    // The tool loop's calls: each reply opens with the reasoning block, the model called the
    // shell tool at least three times, then answered.
    let in_loop: Vec<&CaptureRecord> = records
        .iter()
        .filter(|r| {
            r.request
                .body
                .as_ref()
                .is_some_and(|b| b.to_value()["tools"].as_array().is_some_and(|t| !t.is_empty()))
        })
        .collect();
    let with_call = in_loop
        .iter()
        .filter(|r| r.message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()))
        .count();
    assert!(with_call >= CALLS, "{what}: {with_call} calls, not {CALLS}");
    for r in &in_loop {
        let ids = r.completion_token_ids.as_ref().unwrap();
        assert_eq!(
            ids.get(..3),
            Some(&[QWEN3_THINK, 3973, QWEN3_END_THINK][..]),
            "{what}: seq {}: the reply does not open with <think>Check</think>: {ids:?}",
            r.seq
        );
        let m = r.message.as_ref().unwrap();
        if m.tool_calls.is_empty() {
            assert_eq!(m.content.as_deref(), Some(FINAL_TEXT), "{what}: seq {}", r.seq);
        } else {
            assert_eq!(ids.get(4), Some(&QWEN3_TOOL_CALL), "{what}: {ids:?}");
        }
    }

    // Reasoning kept or dropped, by the engine's ids, against tokentap's spans.
    let by_id = |id: &str| records.iter().find(|r| r.record_id == id);
    let (mut dropped_by_ids, mut kept_by_ids, mut dropped_spans) = (0, 0, 0);
    for r in &records {
        let o = r.token_observation.as_ref().unwrap();
        let (earlier, spans) = match &o.continuation {
            Continuation::Extends { record_id, .. } => (by_id(record_id), vec![]),
            Continuation::Diverges { record_id, spans } => (by_id(record_id), spans.clone()),
            _ => (None, vec![]),
        };
        let n = spans
            .iter()
            .filter(|s| s.cause == DriftCause::ReasoningDropped)
            .count();
        dropped_spans += n;
        let Some(e) = earlier else { continue };
        let before = count(e.prompt_token_ids.as_ref().unwrap(), QWEN3_THINK)
            + count(e.completion_token_ids.as_ref().unwrap(), QWEN3_THINK);
        let now = count(r.prompt_token_ids.as_ref().unwrap(), QWEN3_THINK);
        if count(e.completion_token_ids.as_ref().unwrap(), QWEN3_THINK) == 0 {
            continue;
        }
        if now < before {
            dropped_by_ids += 1;
            assert_eq!(n, before - now, "{what}: seq {}: {:?}", r.seq, o.continuation);
        } else {
            kept_by_ids += 1;
            assert_eq!(n, 0, "{what}: seq {}: {:?}", r.seq, o.continuation);
        }
    }
    eprintln!("{what}: dropped {dropped_by_ids} kept {kept_by_ids} spans {dropped_spans}");
    assert_eq!(dropped_spans, dropped_by_ids, "{what}");
    let _: Option<Value> = None;
    Findings {
        records,
        dropped_by_ids,
        kept_by_ids,
        dropped_spans,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_observe_reasoning_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    let f = observe_reasoning("pi -p", async |d, s| {
        run_pi(d, s, wire, "sk-e2e-pi-think", "m", PROMPT).await
    })
    .await;
    eprintln!("pi: {} records", f.records.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_observe_reasoning_over_chat_completions() {
    let wire = Wire::ChatCompletions;
    let f = observe_reasoning("qwen", async |d, s| {
        run_qwen(d, s, wire, "sk-e2e-qwen-think", "m", PROMPT, true).await
    })
    .await;
    eprintln!("qwen: {} records", f.records.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_observe_reasoning() {
    let f = observe_reasoning("codex exec", async |d, s| {
        run_codex(d, s, "sk-e2e-codex-think", "m", PROMPT).await
    })
    .await;
    eprintln!("codex: {} records", f.records.len());
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_claude_code_observe_reasoning() {
    let f = observe_reasoning("claude -p", async |d, s| {
        run_claude(d, s, "sk-ant-e2e-claude-think", "m", PROMPT, true).await
    })
    .await;
    eprintln!("claude: {} records", f.records.len());
}
