//! Observe mode on real harnesses, with reasoning (issue 38): each harness, through tokentap
//! (`--token-mode=observe --tokenizer` the model file), against llama-server on the tiny
//! reasoning model (`scripts/make_tiny_model.py --think`: Qwen3's tokenizer and chat template;
//! every reply opens with `<think>Check</think>\n\n`, then a call to the harness's shell tool,
//! three calls in all before it answers `Done.`), llama-server parsing the block into reasoning
//! (`--reasoning-format deepseek`). The harness runs twice in the same directories: the tool
//! loop, then a continuation of that session with a second user message (`pi -c`, `qwen
//! --continue`, `codex exec resume --last`, `claude --continue`).
//!
//! Checked for every harness:
//! * every record's `token_observation.render` is `Equal`: tokentap's own rendering and
//!   tokenizing of the conversation gives llama-server's prompt ids, reasoning or not;
//! * every reply's sampled ids open with the `<think>` block, and the model made at least three
//!   calls before `Done.`;
//! * in the tool loop all four harnesses send the reasoning back, and Qwen3's template keeps it
//!   for assistant turns after the last user message, but writes it as
//!   `<think>\nCheck\n</think>\n\n`, not as sampled: each later call `diverges` from the one
//!   before by exactly the two `\n`s the template added around the last reply's reasoning
//!   (`boundary_token`), never by a `reasoning_dropped` span;
//! * the continuation's second user message makes the template drop the reasoning of every
//!   earlier assistant turn: its first call `diverges` with one `reasoning_dropped` span per
//!   turn that had reasoning, that count taken from the engine's own ids (the `<think>` tokens
//!   of the previous prompt and sample, against none in the new prompt);
//! * no span says the content changed, except where a harness did change it: Qwen Code,
//!   resumed, drops the `<system-reminder>` with the date it had put in the first user
//!   message (one `content_changed` span, before the reasoning spans).

use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::checks::{assert_complete_token_data, assert_records_match_engine};
use tokentap_e2e::harness::{
    continue_session, run_claude, run_codex, run_pi, run_qwen, HarnessDirs, HarnessRun, Wire,
};
use tokentap_e2e::llama::{LlamaServer, QWEN3_END_THINK, QWEN3_THINK, QWEN3_TOOL_CALL};
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{Continuation, DriftCause, RenderComparison};

const PROMPT: &str = "Where am I? Use the shell.";
const FINAL_TEXT: &str = "Done.";
/// The calls the think model makes before answering.
const CALLS: usize = 3;
/// The continuation's user message.
const AGAIN: &str = "And now?";
/// `Check`, the reasoning's one token.
const CHECK: u32 = 3973;

fn count(ids: &[u32], id: u32) -> usize {
    ids.iter().filter(|&&i| i == id).count()
}

/// Runs `harness` (first through `run`, then [`continue_session`]) and checks what the
/// module's doc says.
async fn observe_reasoning(
    harness: &str,
    run: impl AsyncFnOnce(&HarnessDirs, &str, &str) -> HarnessRun,
) {
    let llama = LlamaServer::shared_think_model().await;
    let tok = llama.tokenizer();
    let engine = TeeProxy::start(&llama.url).await;
    let config = TokentapConfig::new(engine.url.clone(), "llamacpp")
        .arg("--token-mode=observe")
        .arg("--tokenizer")
        .arg(Artefacts::require_think_model().display().to_string());
    let tokentap = Tokentap::start(config).await;
    let dirs = HarnessDirs::new();

    // One key for both runs: Pi's and Qwen Code's sessions are told apart by it.
    let api_key = format!("sk-ant-e2e-{harness}-think");
    let first = run(&dirs, &tokentap.url, &api_key).await;
    first.assert_success(harness);
    assert!(
        first.stdout.contains(FINAL_TEXT),
        "{harness} does not print the model's final answer {FINAL_TEXT:?}:\n{}",
        first.stdout
    );
    // The loop's records are written (observed) before the continuation's first call.
    let in_loop = engine.chat_exchanges().len();
    tokentap.wait_records(in_loop).await;
    let second = continue_session(harness, &dirs, &tokentap.url, &api_key, "m", AGAIN).await;
    second.assert_success(&format!("{harness} continued"));
    assert!(
        second.stdout.contains(FINAL_TEXT),
        "{harness} continued does not print {FINAL_TEXT:?}:\n{}",
        second.stdout
    );

    let calls = engine.chat_exchanges();
    let mut records = tokentap.wait_records(calls.len()).await;
    assert_eq!(
        records.len(),
        calls.len(),
        "{harness}: one record per engine call"
    );
    records.iter().for_each(assert_complete_token_data);
    assert_records_match_engine(&records, &engine, &tok).await;
    records.sort_by_key(|r| r.seq);
    for r in &records {
        eprintln!(
            "{harness}: seq {} session {} prompt={} <think>s={} content={:?} continuation={}",
            r.seq,
            r.session_id,
            r.prompt_token_ids.as_ref().map_or(0, Vec::len),
            count(
                r.prompt_token_ids.as_deref().unwrap_or_default(),
                QWEN3_THINK
            ),
            r.message.as_ref().and_then(|m| m.content.as_deref()),
            r.token_observation
                .as_ref()
                .map(|o| serde_json::to_string(&o.continuation).unwrap())
                .unwrap_or_default(),
        );
    }

    // tokentap's ids are llama-server's, on every call.
    for r in &records {
        let o = r
            .token_observation
            .as_ref()
            .unwrap_or_else(|| panic!("{harness}: seq {} has no token observation", r.seq));
        assert_eq!(
            o.render,
            RenderComparison::Equal {
                tokens: r.prompt_token_ids.as_ref().unwrap().len() as u32
            },
            "{harness}: seq {}: tokentap's ids are not llama-server's",
            r.seq
        );
    }

    // Every reply opens with the reasoning block; the loop called the shell tool at least
    // three times, then answered; the continuation answered at once.
    for r in &records {
        let ids = r.completion_token_ids.as_ref().unwrap();
        assert_eq!(
            ids.get(..3),
            Some(&[QWEN3_THINK, CHECK, QWEN3_END_THINK][..]),
            "{harness}: seq {}: the reply does not open with <think>Check</think>: {ids:?}",
            r.seq
        );
        let m = r.message.as_ref().unwrap();
        if m.tool_calls.is_empty() {
            assert_eq!(
                m.content.as_deref(),
                Some(FINAL_TEXT),
                "{harness}: seq {}",
                r.seq
            );
        } else {
            assert_eq!(ids.get(4), Some(&QWEN3_TOOL_CALL), "{harness}: {ids:?}");
        }
    }
    let (looped, continued) = records.split_at(in_loop);
    let with_call = |rs: &[CaptureRecord]| {
        rs.iter()
            .filter(|r| r.message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()))
            .count()
    };
    assert!(
        with_call(looped) >= CALLS,
        "{harness}: {} calls, not {CALLS}",
        with_call(looped)
    );
    assert_eq!(
        with_call(continued),
        0,
        "{harness}: the continuation called a tool"
    );

    // Each call against the one it continues: the reasoning the engine's ids lost, and
    // tokentap's spans.
    let think_in = |r: &CaptureRecord| {
        count(r.prompt_token_ids.as_ref().unwrap(), QWEN3_THINK)
            + count(r.completion_token_ids.as_ref().unwrap(), QWEN3_THINK)
    };
    for (i, r) in records.iter().enumerate() {
        let o = r.token_observation.as_ref().unwrap();
        if i == 0 {
            assert_eq!(o.continuation, Continuation::First, "{harness}");
            continue;
        }
        let Continuation::Diverges { record_id, spans } = &o.continuation else {
            panic!(
                "{harness}: seq {}: {:?}, not diverges",
                r.seq, o.continuation
            )
        };
        let earlier = &records[i - 1];
        // Where it parts: in the reply before (the loop); in the first reply for the
        // continuation, which drops every turn's reasoning, the first one's first; but Qwen
        // Code, resumed, also drops the date reminder it had added to the first user message:
        // a harness edit before any sampled id, so the prompt parts from the call before
        // there.
        let harness_edits = harness == "qwen" && i == in_loop;
        let parted_in = if i < in_loop || harness_edits {
            earlier
        } else {
            &records[0]
        };
        assert_eq!(record_id, &parted_in.record_id, "{harness}: seq {}", r.seq);
        let edits: Vec<_> = spans
            .iter()
            .filter(|s| s.cause == DriftCause::ContentChanged)
            .collect();
        if harness_edits {
            assert_eq!(edits.len(), 1, "{harness}: {spans:?}");
            assert!(
                edits[0].before_text.contains("The current date is"),
                "{edits:?}"
            );
            assert_eq!(edits[0].prompt_len, 0, "{edits:?}");
        } else {
            assert_eq!(
                edits,
                Vec::<&tokentap_schema::DriftSpan>::new(),
                "{harness}: seq {}",
                r.seq
            );
        }
        let now = count(r.prompt_token_ids.as_ref().unwrap(), QWEN3_THINK);
        let dropped = spans
            .iter()
            .filter(|s| s.cause == DriftCause::ReasoningDropped);
        if i < in_loop {
            // The loop: the reasoning is all still there, re-written with newlines.
            assert_eq!(
                now,
                think_in(earlier),
                "{harness}: seq {}: reasoning lost",
                r.seq
            );
            assert_eq!(dropped.count(), 0, "{harness}: seq {}: {spans:?}", r.seq);
            assert!(!spans.is_empty(), "{harness}: seq {}", r.seq);
            for s in spans {
                assert_eq!(s.cause, DriftCause::BoundaryToken, "{harness}: {spans:?}");
                assert_eq!(s.before_text.trim(), s.prompt_text.trim(), "{spans:?}");
            }
        } else if i == in_loop {
            // The second user message: every turn that had reasoning lost it, one span each.
            let had = think_in(earlier);
            assert_eq!(had, in_loop, "{harness}: every loop reply had reasoning");
            assert_eq!(now, 0, "{harness}: seq {}: reasoning kept", r.seq);
            assert_eq!(dropped.count(), had, "{harness}: seq {}: {spans:?}", r.seq);
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_observe_reasoning_over_chat_completions() {
    observe_reasoning("pi", async |d, s, k| {
        run_pi(d, s, Wire::ChatCompletions, k, "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_observe_reasoning_over_chat_completions() {
    observe_reasoning("qwen", async |d, s, k| {
        run_qwen(d, s, Wire::ChatCompletions, k, "m", PROMPT, true).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_observe_reasoning() {
    observe_reasoning("codex", async |d, s, k| {
        run_codex(d, s, k, "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_claude_code_observe_reasoning() {
    observe_reasoning("claude", async |d, s, k| {
        run_claude(d, s, k, "m", PROMPT, true).await
    })
    .await;
}
