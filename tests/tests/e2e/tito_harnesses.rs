//! `--token-mode tito` on real harnesses (issue 39): Pi, Qwen Code, Codex and Claude Code
//! through tokentap in tito against llama-server on the tiny reasoning model (every reply opens
//! with `<think>Check</think>\n\n`; three calls to the harness's shell tool, then `Done.`), the
//! tool loop and then the harness's own continuation of the session with a second question.
//! The calls reach the engine as ids (`/completion`), constrained by the grammar of the offered
//! tools' calls that tokentap sends (as llama-server's chat endpoint would), and tokentap reads
//! each answer back into the harness's wire API.
//!
//! Checked for every harness: the harness finishes and prints the model's answer; each reply
//! opens with the reasoning block and the loop made at least three calls; every call's prompt
//! went to the engine as the record's ids and was evaluated whole; every later call extends the
//! call before it (`token_in` and the ids agree) — except where the harness itself changes its
//! history: Qwen Code, resumed, drops the date reminder it had put in the first user message,
//! and that call branches as `edited`. Reconstructed in-process, each session has one trace
//! per branch (one for Pi, Codex and Claude Code; two for Qwen Code) and 0 faithfulness
//! violations. The same loop through tokentap in text mode, in the same
//! test: Qwen3's template re-writes each reply's reasoning, so no call there extends the one
//! before (both counts printed).

use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::harness::{
    continue_session, run_claude, run_codex, run_pi, run_qwen, HarnessDirs, HarnessRun, Wire,
};
use tokentap_e2e::llama::{LlamaServer, QWEN3_END_THINK, QWEN3_THINK};
use tokentap_e2e::sse;
use tokentap_e2e::tee::TeeProxy;
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::traces::wait_session_reports;
use tokentap_e2e::CaptureRecord;
use tokentap_schema::{TitoBranchCause, TitoContinuation};

const PROMPT: &str = "Where am I? Use the shell.";
const FINAL_TEXT: &str = "Done.";
const CALLS: usize = 3;
const AGAIN: &str = "And now?";
const CHECK: u32 = 3973;

fn extends(earlier: &CaptureRecord, later: &CaptureRecord) -> bool {
    let mut ids = earlier.prompt_token_ids.clone().unwrap_or_default();
    ids.extend(earlier.completion_token_ids.clone().unwrap_or_default());
    later
        .prompt_token_ids
        .as_ref()
        .is_some_and(|p| p.starts_with(&ids))
}

async fn tito_harness(harness: &str, run: impl AsyncFn(&HarnessDirs, &str, &str) -> HarnessRun) {
    let llama = LlamaServer::shared_think_model().await;
    let model = Artefacts::require_think_model().display().to_string();
    let engine = TeeProxy::start(&llama.url).await;
    let tokentap = Tokentap::start(
        TokentapConfig::new(engine.url.clone(), "llamacpp")
            .arg("--token-mode=tito")
            .arg("--tokenizer")
            .arg(model)
            // Long enough for the harness to start its continuation within the session.
            .arg("--session-idle")
            .arg("10"),
    )
    .await;
    let dirs = HarnessDirs::new();
    let api_key = format!("sk-ant-e2e-{harness}-tito");
    let first = run(&dirs, &tokentap.url, &api_key).await;
    first.assert_success(harness);
    assert!(
        first.stdout.contains(FINAL_TEXT),
        "{harness} does not print {FINAL_TEXT:?}:\n{}",
        first.stdout
    );
    let completions = |e: &TeeProxy| {
        e.exchanges()
            .into_iter()
            .filter(|x| x.path == "/completion")
            .collect::<Vec<_>>()
    };
    let in_loop = completions(&engine).len();
    tokentap.wait_records(in_loop).await;
    let second = continue_session(harness, &dirs, &tokentap.url, &api_key, "m", AGAIN).await;
    second.assert_success(&format!("{harness} continued"));
    assert!(
        second.stdout.contains(FINAL_TEXT),
        "{harness} continued:\n{}",
        second.stdout
    );

    let exchanges = completions(&engine);
    let mut records = tokentap.wait_records(exchanges.len()).await;
    assert_eq!(
        records.len(),
        exchanges.len(),
        "{harness}: one record per engine call"
    );
    records.sort_by_key(|r| r.seq);
    for (r, x) in records.iter().zip(&exchanges) {
        let prompt = r.prompt_token_ids.as_ref().unwrap_or_else(|| {
            panic!(
                "{harness}: seq {} has no prompt ids: {:?}",
                r.seq, r.token_provenance
            )
        });
        let sent: Vec<u32> = serde_json::from_value(x.request_json()["prompt"].clone()).unwrap();
        assert_eq!(&sent, prompt, "{harness}: seq {}", r.seq);
        let last = sse::response_objects(&x.response_body).pop().unwrap();
        assert_eq!(last["tokens_evaluated"].as_u64(), Some(prompt.len() as u64));
        let ids = r.completion_token_ids.as_ref().unwrap();
        assert_eq!(
            ids.get(..3),
            Some(&[QWEN3_THINK, CHECK, QWEN3_END_THINK][..]),
            "{harness}: seq {}: {ids:?}",
            r.seq
        );
        assert!(
            r.token_provenance.gaps.is_empty(),
            "{:?}",
            r.token_provenance.gaps
        );
        let m = r.message.as_ref().unwrap();
        assert_eq!(
            m.reasoning.as_deref(),
            Some("Check"),
            "{harness}: seq {}",
            r.seq
        );
        eprintln!(
            "{harness}: seq {} prompt={} calls={} content={:?} token_in={}",
            r.seq,
            prompt.len(),
            m.tool_calls.len(),
            m.content,
            serde_json::to_string(&r.token_in.as_ref().unwrap().continuation).unwrap()
        );
    }
    let calls = records[..in_loop]
        .iter()
        .filter(|r| !r.message.as_ref().unwrap().tool_calls.is_empty())
        .count();
    assert!(calls >= CALLS, "{harness}: {calls} calls, not {CALLS}");

    let mut tito_extends = 0;
    for (i, r) in records.iter().enumerate() {
        let continuation = &r.token_in.as_ref().unwrap().continuation;
        if i == 0 {
            assert_eq!(
                continuation,
                &TitoContinuation::Branch {
                    cause: TitoBranchCause::First,
                    detail: None
                },
                "{harness}"
            );
            continue;
        }
        if harness == "qwen" && i == in_loop {
            // Qwen Code, resumed, drops the date reminder from its first user message.
            assert!(
                matches!(
                    continuation,
                    TitoContinuation::Branch {
                        cause: TitoBranchCause::Edited,
                        ..
                    }
                ),
                "{harness}: seq {}: {continuation:?}",
                r.seq
            );
            continue;
        }
        assert!(
            matches!(continuation, TitoContinuation::Extends { record_id, .. } if *record_id == records[i - 1].record_id),
            "{harness}: seq {}: {continuation:?}",
            r.seq
        );
        assert!(
            extends(&records[i - 1], r),
            "{harness}: seq {}: ids do not extend",
            r.seq
        );
        tito_extends += 1;
    }

    // Reconstructed in-process: a trace per branch (the first call, Qwen Code's edit), every
    // extension merged into the trace it extends, and nothing unfaithful.
    let sessions: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r.session_id.as_str()).collect();
    let reports = wait_session_reports(&tokentap.spool.join("traces"), sessions.len(), || {
        tokentap.log_tail(30)
    })
    .await;
    let branches = records
        .iter()
        .filter(|r| {
            matches!(
                r.token_in.as_ref().unwrap().continuation,
                TitoContinuation::Branch { .. }
            )
        })
        .count();
    let traces: usize = reports.iter().map(|r| r.stats.traces as usize).sum();
    let violations: u64 = reports.iter().map(|r| r.faithfulness.violations).sum();
    eprintln!(
        "{harness}: {} calls in {} session(s), {traces} trace(s), {branches} branch(es), {violations} faithfulness violations",
        records.len(),
        sessions.len()
    );
    assert_eq!(violations, 0, "{harness}: {reports:?}");
    assert_eq!(
        traces, branches,
        "{harness}: a trace per branch: {reports:?}"
    );

    // Text mode, the same loop.
    let text = Tokentap::start(TokentapConfig::new(llama.url.clone(), "llamacpp")).await;
    let text_dirs = HarnessDirs::new();
    run(&text_dirs, &text.url, &format!("{api_key}-text"))
        .await
        .assert_success(harness);
    let engine_calls = text.wait_records(1).await.len().max(in_loop);
    let mut text_records = text.wait_records(engine_calls).await;
    text_records.sort_by_key(|r| r.seq);
    let text_extends = text_records
        .windows(2)
        .filter(|w| extends(&w[0], &w[1]))
        .count();
    eprintln!(
        "{harness}: calls extending the one before: tito {tito_extends} of {}, text mode (loop only) {text_extends} of {}",
        records.len() - 1,
        text_records.len().saturating_sub(1)
    );
    assert_eq!(
        text_extends, 0,
        "{harness}: text mode re-writes the reasoning every call"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_tito_tool_loop() {
    tito_harness("pi", async |d, s, k| {
        run_pi(d, s, Wire::ChatCompletions, k, "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_tito_tool_loop() {
    tito_harness("qwen", async |d, s, k| {
        run_qwen(d, s, Wire::ChatCompletions, k, "m", PROMPT, true).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_codex_tito_tool_loop() {
    tito_harness("codex", async |d, s, k| {
        run_codex(d, s, k, "m", PROMPT).await
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_claude_code_tito_tool_loop() {
    tito_harness("claude", async |d, s, k| {
        run_claude(d, s, k, "m", PROMPT, true).await
    })
    .await;
}
