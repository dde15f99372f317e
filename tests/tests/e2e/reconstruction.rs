//! Real harness sessions reconstructed into traces: Pi and Qwen Code run a scripted tool loop
//! through tokentap (local mode: the proxy reconstructs in-process into SPOOL/traces), with
//! real token ids from llama-server's tokenizer under a chat template that renders tool calls
//! back as sampled. The conversation must come out as one merged trace whose mask-1 tokens
//! are exactly the sampled ids; side calls with their own prompt form their own chains.

use std::collections::HashMap;

use serde_json::json;
use tokentap_e2e::harness::{
    run_pi, run_qwen, run_qwen_with_memory, HarnessDirs, HarnessRun, Wire,
};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::scripted::{tool_round_trip, Reply, Script, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{tokentap_cli, Tokentap, TokentapConfig};
use tokentap_e2e::traces::{record_ids_in, wait_session_reports};
use tokentap_e2e::CaptureRecord;
use tokentap_reconstruct::output::{read_traces_jsonl, read_traces_parquet};
use tokentap_reconstruct::{verify, RecordDigest};
use tokentap_schema::{SessionReport, SplitCause, Trace};

const MARKER_FILE: &str = "tokentap_tool_ran.txt";
const FINAL_TEXT: &str = "Done: the file is written.";
const PROMPT: &str = "Write hi to a file";

struct Session {
    records: Vec<CaptureRecord>,
    traces: Vec<Trace>,
    reports: Vec<SessionReport>,
    tokentap: Tokentap,
    dirs: HarnessDirs,
}

/// Runs `run` against tokentap in front of the scripted tool loop, waits for the proxy's
/// in-process reconstruction to finish every session, and returns records and traces.
async fn session(
    what: &str,
    script: Script,
    run: impl AsyncFnOnce(&HarnessDirs, &str) -> HarnessRun,
) -> Session {
    let llama = LlamaServer::shared_with_tool_template().await;
    let backend = ScriptedBackend::start(Tokens::Llama(llama.tokenizer()), script).await;
    let tokentap = Tokentap::start(
        TokentapConfig::new(backend.url.clone(), "vllm")
            .arg("--session-idle")
            .arg("1"),
    )
    .await;
    let dirs = HarnessDirs::new();
    run(&dirs, &tokentap.url).await.assert_success(what);
    let records = tokentap.wait_records(backend.requests().len()).await;
    let sessions: std::collections::HashSet<&str> =
        records.iter().map(|r| r.session_id.as_str()).collect();
    let out = tokentap.spool.join("traces");
    let reports = wait_session_reports(&out, sessions.len(), || tokentap.log_tail(30)).await;
    let traces = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
    Session {
        records,
        traces,
        reports,
        tokentap,
        dirs,
    }
}

/// The scripted shell round trip: call `tool` once, then answer [`FINAL_TEXT`].
fn tool_loop(tool: &str) -> Script {
    tool_round_trip(
        tool,
        json!({"command": format!("echo hi > {MARKER_FILE}")}),
        FINAL_TEXT,
        "ok",
    )
}

/// What holds for every reconstruction: faithful, complete, each record once.
/// The harness really ran the scripted shell call in its working directory.
fn assert_tool_ran(what: &str, s: &Session) {
    assert!(
        s.dirs.work().join(MARKER_FILE).exists(),
        "{what}: the scripted tool call did not run"
    );
}

fn assert_faithful(what: &str, s: &Session) {
    let digests: HashMap<String, RecordDigest> = s
        .records
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    let f = verify(&s.traces, &digests);
    assert_eq!(f.violations, 0, "{what}: {:?}", f.examples);
    for r in &s.reports {
        assert_eq!(r.faithfulness.violations, 0, "{what}: {r:?}");
    }
    let in_traces = record_ids_in(&s.traces);
    let mut ids: Vec<&str> = s.records.iter().map(|r| r.record_id.as_str()).collect();
    ids.sort();
    assert_eq!(in_traces, ids, "{what}: each record in exactly one trace");
    // Every sampled token is trainable: this engine (vLLM protocol) reports every id.
    let sampled: usize = s
        .records
        .iter()
        .map(|r| r.completion_token_ids.as_ref().map_or(0, Vec::len))
        .sum();
    assert_eq!(f.trainable_tokens as usize, sampled, "{what}");
}

/// The trace holding the scripted tool call and its follow-up.
fn conversation<'a>(what: &str, s: &'a Session) -> &'a Trace {
    let with_call = s
        .records
        .iter()
        .find(|r| r.message.as_ref().is_some_and(|m| !m.tool_calls.is_empty()))
        .unwrap_or_else(|| panic!("{what}: no record holds the tool call"));
    s.traces
        .iter()
        .find(|t| t.calls.iter().any(|c| c.record_id == with_call.record_id))
        .unwrap()
}

/// The conversation trace: the tool call and the final answer merged, mask 1 exactly on the
/// two sampled spans, and the whole equal to the last call's prompt plus its answer.
fn assert_merged_tool_loop(what: &str, s: &Session, t: &Trace) {
    assert!(t.calls.len() >= 2, "{what}: {:?}", t.calls);
    let last = s
        .records
        .iter()
        .find(|r| r.record_id == t.calls.last().unwrap().record_id)
        .unwrap();
    let mut whole = t.prompt_ids.clone();
    whole.extend_from_slice(&t.response_ids);
    let mut expected = last.prompt_token_ids.clone().unwrap();
    expected.extend_from_slice(last.completion_token_ids.as_ref().unwrap());
    assert_eq!(whole, expected, "{what}: trace = last prompt + last answer");
    let runs = t
        .loss_mask
        .windows(2)
        .filter(|w| w[0] == 0 && w[1] == 1)
        .count()
        + usize::from(t.loss_mask.first() == Some(&1));
    assert_eq!(runs, t.calls.len(), "{what}: one mask-1 run per call");
    assert!(
        t.response_ids
            .iter()
            .zip(&t.loss_mask)
            .filter(|(_, m)| **m == 1)
            .count()
            == t.calls
                .iter()
                .map(|c| c.sampled_len as usize)
                .sum::<usize>()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pi_tool_loop_reconstructs_as_one_merged_trace() {
    let what = "pi";
    let s = session(what, tool_loop("bash"), async |d, url| {
        run_pi(
            d,
            url,
            Wire::ChatCompletions,
            "sk-e2e-recon-pi",
            "m",
            PROMPT,
        )
        .await
    })
    .await;
    assert_faithful(what, &s);
    assert_eq!(
        s.records.len(),
        2,
        "pi makes the tool call and the follow-up"
    );
    assert_eq!(s.traces.len(), 1, "{:?}", s.reports);
    let t = conversation(what, &s);
    assert_eq!(t.started_by, SplitCause::SessionStart, "{what}");
    assert_merged_tool_loop(what, &s, t);
    assert_eq!(s.reports[0].stats.merged_calls, 1);

    // The same output as Parquet (written at the latest when the proxy stops), and the
    // offline command agrees with the live one.
    let mut s = s;
    assert!(
        s.tokentap.terminate().await,
        "the proxy did not stop on SIGTERM"
    );
    let parts = std::fs::read_dir(s.tokentap.spool.join("traces/parquet"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect::<Vec<_>>();
    let rows: Vec<Trace> = parts
        .iter()
        .flat_map(|p| read_traces_parquet(p).unwrap())
        .collect();
    assert_eq!(rows, s.traces);
    let offline = tempfile::tempdir().unwrap();
    let spool = s.tokentap.spool.to_str().unwrap();
    let out = offline.path().to_str().unwrap();
    let cli = tokentap_cli(&["reconstruct", "--spool", spool, "--out", out]).await;
    assert!(cli.success, "{}", cli.stderr);
    assert_eq!(
        read_traces_jsonl(&offline.path().join("traces.jsonl")).unwrap(),
        s.traces
    );
    // `trajectories show` makes the mask boundaries visible.
    let path = offline.path().join("traces.jsonl");
    let show = tokentap_cli(&["trajectories", "show", path.to_str().unwrap()]).await;
    assert!(show.success, "{}", show.stderr);
    assert!(show.stdout.contains("SAMPLED"), "{}", show.stdout);
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_session_reconstructs_into_its_chains() {
    let what = "qwen";
    let s = session(what, tool_loop("run_shell_command"), async |d, url| {
        run_qwen(
            d,
            url,
            Wire::ChatCompletions,
            "sk-e2e-recon-qwen",
            "m",
            PROMPT,
            true,
        )
        .await
    })
    .await;
    assert_tool_ran(what, &s);
    assert_faithful(what, &s);
    assert_eq!(s.traces.len(), 1, "{:?}", s.reports);
    let t = conversation(what, &s);
    assert_eq!(t.started_by, SplitCause::SessionStart, "{what}");
    assert_merged_tool_loop(what, &s, t);
}

/// Qwen Code's managed auto-memory: after a turn that ends on the user's query, a forked
/// memory-extraction agent (its own system prompt, the conversation as extra history) makes
/// calls of its own. Here the main turn is a plain answer (the extractor runs only after a turn
/// that ends on the user's query, not on a tool result) and the extractor gets the scripted
/// shell call: its calls extend no chain of the conversation, so they form a second chain, in
/// which its tool loop merges.
#[tokio::test(flavor = "multi_thread")]
async fn heavy_qwen_code_memory_extraction_is_a_second_chain() {
    let what = "qwen (auto-memory)";
    let loop_ = tool_loop("run_shell_command");
    let script: Script = std::sync::Arc::new(move |req, i| {
        if i == 0 {
            Reply::text("A token is a unit of text.")
        } else {
            loop_(req, i)
        }
    });
    let s = session(what, script, async |d, url| {
        run_qwen_with_memory(
            d,
            url,
            Wire::ChatCompletions,
            "sk-e2e-recon-qwen-mem",
            "m",
            "What is a token?",
            true,
            true,
        )
        .await
    })
    .await;
    // The main answer, then the extractor's tool call and its follow-up (the extractor runs
    // its shell in the memory directory, not the project).
    assert_eq!(s.records.len(), 3, "{:?}", s.reports);
    assert_faithful(what, &s);
    assert_eq!(s.traces.len(), 2, "{:?}", s.reports);
    let main = s
        .traces
        .iter()
        .find(|t| t.started_by == SplitCause::SessionStart)
        .unwrap();
    assert_eq!(main.calls.len(), 1);
    let extractor = conversation(what, &s);
    assert_eq!(extractor.started_by, SplitCause::NewPrefix);
    assert_merged_tool_loop(what, &s, extractor);
    assert!(!extractor.prompt_ids.starts_with(&main.prompt_ids));
}
