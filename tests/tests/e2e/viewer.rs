//! The trajectory viewer on a real captured session: Pi runs a tool loop through tokentap
//! (tokens from llama-server's tokenizer of the tiny SmolLM2 model), the proxy reconstructs it,
//! `tokentap view` serves spool and traces with token text from the model's GGUF, and headless
//! Chromium (playwright-core) clicks through the page. The prompt carries HTML that would run
//! script if the page ever parsed captured text as markup.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokentap_e2e::artefacts::{tokentap_bin, Artefacts};
use tokentap_e2e::harness::{run_pi, HarnessDirs, Wire};
use tokentap_e2e::llama::LlamaServer;
use tokentap_e2e::procs::{free_port, http_client, spawn_guarded_split, ChildGuard, KillScope};
use tokentap_e2e::scripted::{tool_round_trip, ScriptedBackend, Tokens};
use tokentap_e2e::tokentap::{Tokentap, TokentapConfig};
use tokentap_e2e::traces::wait_session_reports;
use tokentap_reconstruct::output::read_traces_jsonl;

const API_KEY: &str = "sk-e2e-viewer-secret";
/// Markup that runs script if it is ever parsed as HTML (and CSP let it).
const HOSTILE: &str =
    r#"<img src=x onerror="window.__pwned='img'"><script>window.__pwned='script'</script>"#;

/// `tokentap view` on a free port; the address it printed (with its token).
struct Viewer {
    /// What to open: `http://HOST:PORT/view/#token=…`.
    address: String,
    /// `http://HOST:PORT`.
    base: String,
    token: String,
    _child: ChildGuard,
    _dir: tempfile::TempDir,
}

async fn start_viewer(args: &[&str]) -> Viewer {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let listen = format!("127.0.0.1:{}", free_port());
    let mut cmd = Command::new(tokentap_bin());
    cmd.arg("view").args(args).args(["--listen", &listen]);
    cmd.env_remove("TOKENTAP_VIEW_TOKEN");
    let child = spawn_guarded_split(cmd, &out, &err, KillScope::Process, "tokentap view").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let printed = std::fs::read_to_string(&out).unwrap_or_default();
        if let Some(line) = printed.lines().find(|l| l.contains("#token=")) {
            let address = line.rsplit(' ').next().unwrap().to_owned();
            let (page, token) = address.split_once("#token=").unwrap();
            let base = page.strip_suffix("/view/").expect("the page is at /view/");
            return Viewer {
                base: base.to_owned(),
                token: token.to_owned(),
                address,
                _child: child,
                _dir: dir,
            };
        }
        assert!(
            Instant::now() < deadline,
            "tokentap view printed no address: {}",
            std::fs::read_to_string(&err).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Viewer {
    async fn get(&self, path: &str, token: Option<&str>) -> (u16, String) {
        let mut r = http_client().get(format!("{}{path}", self.base));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }

    async fn api(&self, path: &str) -> Value {
        let (status, body) = self.get(path, Some(&self.token)).await;
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }
}

fn playwright_core() -> PathBuf {
    let cache = Artefacts::require_llama().cache;
    let dir = std::env::var_os("TOKENTAP_PLAYWRIGHT")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache.join("playwright/node_modules/playwright-core"));
    assert!(
        dir.join("package.json").is_file() && Path::new("/usr/bin/chromium").is_file(),
        "playwright-core ({}) or /usr/bin/chromium missing: run scripts/setup",
        dir.display()
    );
    dir
}

/// `s` as a query value (ids hold `/`, `#` and the like).
fn q(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn heavy_the_viewer_shows_a_real_pi_session_in_headless_chromium() {
    let playwright = playwright_core();
    // --- capture a real session -------------------------------------------------------------
    let llama = LlamaServer::shared_with_tool_template().await;
    let script = tool_round_trip(
        "bash",
        json!({"command": "echo hi > viewer.txt"}),
        "Done: the file is written.",
        "ok",
    );
    let backend = ScriptedBackend::start(Tokens::Llama(llama.tokenizer()), script).await;
    let tokentap = Tokentap::start(
        TokentapConfig::new(backend.url.clone(), "vllm")
            .arg("--session-idle")
            .arg("1"),
    )
    .await;
    let dirs = HarnessDirs::new();
    let prompt = format!("Write hi to a file {HOSTILE}");
    run_pi(
        &dirs,
        &tokentap.url,
        Wire::ChatCompletions,
        API_KEY,
        "m",
        &prompt,
    )
    .await
    .assert_success("pi");
    let records = tokentap.wait_records(backend.requests().len()).await;
    assert!(records.len() >= 2, "pi made {} calls", records.len());
    let out = tokentap.spool.join("traces");
    wait_session_reports(&out, 1, || tokentap.log_tail(30)).await;
    let traces = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
    let session = records[0].session_id.clone();
    let calls = records.iter().filter(|r| r.session_id == session).count();
    let trace = traces
        .iter()
        .filter(|t| t.session_id == session)
        .max_by_key(|t| t.calls.len())
        .expect("a trace of the session");

    // --- serve it -------------------------------------------------------------------------
    let model = Artefacts::require_llama().model_tiny;
    let spool = tokentap.spool.to_str().unwrap().to_owned();
    let viewer = start_viewer(&[
        "--spool",
        &spool,
        "--traces",
        out.to_str().unwrap(),
        "--tokenizer",
        model.to_str().unwrap(),
    ])
    .await;

    // The data needs the token; the page itself holds none.
    for path in [
        "/view/api/overview".to_owned(),
        "/view/api/sessions".to_owned(),
        format!("/view/api/session?id={}", q(&session)),
        format!("/view/api/record?id={}", records[0].record_id),
        format!("/view/api/trace?id={}", q(&trace.trace_id)),
    ] {
        for token in [None, Some("wrong"), Some("")] {
            let (status, body) = viewer.get(&path, token).await;
            assert_eq!(status, 401, "{path} with {token:?}: {body}");
            assert!(!body.contains(&session), "{path} leaked the session");
        }
    }
    let (status, page) = viewer.get("/view/", None).await;
    assert_eq!(status, 200);
    assert!(!page.contains(&session) && !page.contains("Write hi"));

    // No API key reaches the viewer's answers.
    let record = viewer
        .api(&format!("/view/api/record?id={}", records[0].record_id))
        .await;
    assert_eq!(record["record_id"], records[0].record_id.as_str());
    assert!(
        !record.to_string().contains(API_KEY),
        "the API key reached the viewer"
    );

    // Token text from the GGUF equals the engine's own /detokenize, id by id.
    let shown = viewer
        .api(&format!("/view/api/trace?id={}", q(&trace.trace_id)))
        .await;
    let pieces = shown["pieces"].as_object().unwrap();
    let ids: BTreeSet<u32> = trace
        .prompt_ids
        .iter()
        .chain(&trace.response_ids)
        .copied()
        .collect();
    let tokenizer = llama.tokenizer();
    let mut compared = 0;
    for id in &ids {
        let ours = pieces
            .get(&id.to_string())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no text for id {id}"));
        let engine = tokenizer.detokenize(&[*id]).await;
        if ours.contains('\u{FFFD}') || engine.contains('\u{FFFD}') || ours.is_empty() {
            continue; // part of a multi-byte character: not text on its own
        }
        assert_eq!(ours, engine, "token {id}");
        compared += 1;
    }
    assert!(compared >= 50, "only {compared} ids compared");

    // --- the page in headless Chromium ------------------------------------------------------
    let shots = tempfile::tempdir().unwrap();
    let call = records
        .iter()
        .find(|r| {
            r.session_id == session && r.message.as_ref().is_some_and(|m| !m.tool_calls.is_empty())
        })
        .unwrap_or(&records[0]);
    let node = Artefacts::require_harness("pi").0.path_dirs[0].join("node");
    let output = tokio::process::Command::new(node)
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/viewer/page.mjs"))
        .env("PLAYWRIGHT_CORE", &playwright)
        .env("VIEW_URL", &viewer.address)
        .env("SESSION", &session)
        .env("RECORD", &call.record_id)
        .env("TRACE", &trace.trace_id)
        .env("SHOTS", shots.path())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), output)
        .await
        .expect("the page test finished within 120 s")
        .unwrap();
    assert!(
        output.status.success(),
        "page.mjs failed: {}\n{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    let seen: Value = serde_json::from_slice(&output.stdout).unwrap();
    let n = |k: &str| seen[k].as_u64().unwrap_or_else(|| panic!("{k}: {seen}"));

    assert_eq!(seen["console_errors"], json!([]), "{seen}");
    assert_eq!(seen["page_errors"], json!([]), "{seen}");
    assert_eq!(seen["failed_requests"], json!([]), "{seen}");
    // The token left the address bar once read.
    assert!(!seen["address_after_load"]
        .as_str()
        .unwrap()
        .contains("token"));
    let sessions: BTreeSet<&str> = records.iter().map(|r| r.session_id.as_str()).collect();
    assert_eq!(n("session_rows"), sessions.len() as u64);
    assert_eq!(n("call_bars"), calls as u64, "one bar per call");
    assert_eq!(n("call_rows"), calls as u64);
    assert_eq!(
        n("trace_rows"),
        traces.iter().filter(|t| t.session_id == session).count() as u64
    );
    assert_eq!(
        n("sampled_tokens"),
        trace.trainable_tokens() as u64,
        "{seen}"
    );
    assert_eq!(
        n("context_tokens") + n("sampled_tokens"),
        trace.response_ids.len() as u64
    );
    assert_eq!(n("prompt_tokens"), trace.prompt_ids.len() as u64);
    assert_eq!(
        seen["stats_trainable"],
        trace.trainable_tokens().to_string()
    );
    // Hover names the first sampled token: its id, text and logprob.
    let first = trace.loss_mask.iter().position(|&m| m == 1).unwrap();
    let (id, lp) = (trace.response_ids[first], trace.logprobs[first]);
    let hover = seen["hover"].as_str().unwrap();
    assert!(hover.contains(&format!("id {id} ")), "{hover}");
    assert!(hover.contains(&format!("logprob {lp:.4}")), "{hover}");
    assert_eq!(
        seen["first_sampled"]["text"].as_str().unwrap(),
        pieces[&id.to_string()].as_str().unwrap()
    );
    // The call's request and answer, with the hostile markup shown as text and inert.
    let panel = seen["record_panel"].as_str().unwrap();
    assert!(panel.contains(&call.record_id), "{panel}");
    assert!(
        panel.contains(HOSTILE),
        "the prompt's markup is shown as text: {panel}"
    );
    for k in ["img_elements", "img_elements_after"] {
        assert_eq!(n(k), 0, "{k}: captured markup became elements");
    }
    assert_eq!(n("script_elements"), 1, "only the viewer's own script");
    assert_eq!(seen["pwned"], Value::Null);
    assert_eq!(seen["pwned_after"], Value::Null);
    assert!(
        seen["without_token"]
            .as_str()
            .unwrap()
            .contains("needs its token"),
        "{seen}"
    );

    // Screenshots for docs/viewer.md (written there with TOKENTAP_UPDATE_SCREENSHOTS=1).
    let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/viewer");
    for shot in ["sessions.png", "session.png", "trace.png"] {
        let png = std::fs::read(shots.path().join(shot)).unwrap();
        assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{shot}");
        if std::env::var_os("TOKENTAP_UPDATE_SCREENSHOTS").is_some() {
            std::fs::create_dir_all(&docs).unwrap();
            std::fs::write(docs.join(shot), png).unwrap();
        }
    }
}
