//! `tokentap bench token-mode`: what `--token-mode observe` costs per call, in-process, one
//! thread: the model's chat template rendering a whole conversation, the tokenizer encoding
//! it, and a whole observation (render + encode + comparison with the session's last call +
//! drift spans) of a call that appends a tool result; plus the ids held per open session.
//! The conversation is the reference Qwen Code request (wire/testdata/harness-wire) grown
//! with tool rounds to the size asked for; the model is a GGUF or Hugging Face directory.

use std::path::PathBuf;
use std::time::Instant;

use crate::translate::time;
use clap::Args;
use serde_json::Value;
use tokentap_proxy::wire::chat_completions::ChatCompletions;
use tokentap_proxy::wire::WireCodec;
use tokentap_schema::{ChatMessage, ChatRequest, Role, ToolCall};
use tokentap_token_mode::{
    CallView, EngineDialect, Observer, ObserverLimits, SampledEnd, Tito, TitoLimits, TokenModel,
};

#[derive(Args)]
pub struct TokenModeBenchArgs {
    /// The model's tokenizer and template (a GGUF, a tokenizer.json or an HF directory)
    /// [default: $TOKENTAP_MODEL_TINY_TOOLS, else the cache's tiny-qwen3-tools.gguf: Qwen3's
    /// tokenizer and template].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Size of the whole conversation, in bytes of message text.
    #[arg(long, default_value_t = 40_000)]
    conversation_bytes: usize,
    /// Size of the appended tool result, in bytes.
    #[arg(long, default_value_t = 2_000)]
    append_bytes: usize,
    /// Timed iterations per figure (after as many again of warm-up).
    #[arg(long, default_value_t = 200)]
    iterations: usize,
}

/// Text of about `bytes` bytes that reads like a tool's output (paths, code, numbers).
fn tool_output(bytes: usize, salt: usize) -> String {
    let mut s = String::with_capacity(bytes + 80);
    let mut i = 0;
    while s.len() < bytes {
        s.push_str(&format!(
            "src/module_{salt}_{i}.rs:{}: let value_{i} = compute(&input[{i}..], {}); // ok\n",
            i * 7 + 1,
            i * 13 % 97
        ));
        i += 1;
    }
    s
}

fn tool_round(req: &mut ChatRequest, k: usize, output: String) {
    let id = format!("call_{k}");
    req.messages.push(ChatMessage {
        tool_calls: vec![ToolCall {
            id: id.clone(),
            name: "run_shell_command".into(),
            arguments: format!("{{\"command\": \"grep -rn value src/ | head -{k}\"}}"),
        }],
        content: Vec::new(),
        content_was_string: false,
        ..ChatMessage::text(Role::Assistant, "")
    });
    req.messages.push(ChatMessage {
        tool_call_id: Some(id),
        ..ChatMessage::text(Role::Tool, output)
    });
}

pub fn run(args: TokenModeBenchArgs) -> anyhow::Result<()> {
    let path = args
        .tokenizer
        .clone()
        .or_else(|| std::env::var_os("TOKENTAP_MODEL_TINY_TOOLS").map(PathBuf::from))
        .or_else(|| {
            let home = std::env::var_os("HOME")?;
            Some(PathBuf::from(home).join(".cache/tokentap/models/tiny-qwen3-tools.gguf"))
        })
        .filter(|p| p.exists())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "give --tokenizer PATH (or run scripts/setup, which makes the tiny tool model)"
            )
        })?;
    let model = TokenModel::open(&path, EngineDialect::LlamaCpp).map_err(anyhow::Error::msg)?;
    let body: Value =
        serde_json::from_str(include_str!("../../wire/testdata/harness-wire/qwen.json"))?;
    let mut before = ChatCompletions
        .parse(&serde_json::to_vec(&body["body"])?)
        .map_err(|e| anyhow::anyhow!("the Qwen Code fixture: {e}"))?
        .request;
    let text_bytes =
        |r: &ChatRequest| -> usize { r.messages.iter().map(|m| m.joined_text().len()).sum() };
    let mut k = 0;
    while text_bytes(&before) < args.conversation_bytes {
        tool_round(&mut before, k, tool_output(2_000, k));
        k += 1;
    }
    let mut after = before.clone();
    tool_round(&mut after, k, tool_output(args.append_bytes, k));

    let text = model.prompt_text(&before).map_err(anyhow::Error::msg)?;
    let ids = model.prompt_ids(&before).map_err(anyhow::Error::msg)?;
    let after_text = model.prompt_text(&after).map_err(anyhow::Error::msg)?;
    let appended = &after_text[common_prefix_len(&text, &after_text)..];
    let tok = model.tokenizer();

    let render = time(args.iterations, || {
        std::hint::black_box(model.prompt_text(std::hint::black_box(&before)).ok());
    });
    let encode = time(args.iterations, || {
        std::hint::black_box(tok.encode(std::hint::black_box(&text)).ok());
    });
    let encode_appended = time(args.iterations, || {
        std::hint::black_box(tok.encode(std::hint::black_box(appended)).ok());
    });
    // A whole observation of the appending call, against a session whose last call is
    // `before` (with 200 sampled ids, which the template writes back unchanged here).
    let after_ids = model.prompt_ids(&after).map_err(anyhow::Error::msg)?;
    let sampled = &after_ids[ids.len()..ids.len() + 200.min(after_ids.len() - ids.len())];
    let observer = Observer::new(model, ObserverLimits::default());
    // Warm-up rounds, then timed ones; only the appending call is timed.
    let mut second: Vec<f64> = (0..2 * args.iterations)
        .map(|i| {
            let session = format!("t{i}");
            observer.observe(CallView {
                session_id: &session,
                record_id: "before",
                request: &before,
                engine_prompt: Some(&ids),
                completion: Some(sampled),
                reasoning: None,
            });
            let t = Instant::now();
            std::hint::black_box(observer.observe(CallView {
                session_id: &session,
                record_id: "after",
                request: &after,
                engine_prompt: Some(&after_ids),
                completion: None,
                reasoning: None,
            }));
            t.elapsed().as_secs_f64() * 1e6
        })
        .skip(args.iterations)
        .collect();
    second.sort_by(|a, b| a.total_cmp(b));
    let p = |q: f64| second[((second.len() - 1) as f64 * q).round() as usize];
    let sessions = observer.sessions().max(1);
    let held_per_session = observer.held_tokens() as f64 * 4.0 / sessions as f64;

    // `--token-mode tito`: the appending call's prompt built from the call before (its prompt
    // and 200 sampled ids, answered with the appending call's assistant turn), and keeping the
    // answered call for the next; what tito adds to a call's CPU besides reading the answer.
    let tito = Tito::new(
        TokenModel::open(&path, EngineDialect::LlamaCpp).map_err(anyhow::Error::msg)?,
        TitoLimits::default(),
    )
    .map_err(anyhow::Error::msg)?;
    let answer = after.messages[before.messages.len()].clone();
    let before_prompt = tito
        .prompt(Some("bench"), &before)
        .map_err(anyhow::Error::msg)?;
    let (mut build, mut keep) = (Vec::new(), Vec::new());
    for i in 0..2 * args.iterations {
        let t = Instant::now();
        tito.answered(
            Some("bench"),
            &before,
            &before_prompt,
            sampled,
            SampledEnd::StopToken,
            &answer,
            "before",
        );
        let kept = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let prompt = std::hint::black_box(
            tito.prompt(Some("bench"), &after)
                .map_err(anyhow::Error::msg)?,
        );
        let built = t.elapsed().as_secs_f64() * 1e6;
        anyhow::ensure!(
            matches!(
                prompt.continuation,
                tokentap_schema::TitoContinuation::Extends { .. }
            ),
            "the appending call did not extend: {:?}",
            prompt.continuation
        );
        if i >= args.iterations {
            keep.push(kept);
            build.push(built);
        }
    }
    let pct = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * q).round() as usize]
    };

    // `--token-verify`: the appending call's full render compared with tito's ids.
    let after_prompt = tito
        .prompt(Some("bench"), &after)
        .map_err(anyhow::Error::msg)?;
    let verify_once = || {
        tokentap_token_mode::verify(
            tito.model(),
            &after,
            &after_prompt.ids,
            &after_prompt.origins,
        )
    };
    verify_once().map_err(anyhow::Error::msg)?;
    let verify = time(args.iterations, || {
        std::hint::black_box(verify_once().ok());
    });

    // Reading an answer back: reasoning, text and a tool call, fed one token's text at a time
    // as the engine streams it; per token.
    let answer_text = format!(
        "<think>\n{}\n</think>\n\n{}\n<tool_call>\n{{\"name\": \"bash\", \"arguments\": {{\"command\": \"ls -la /tmp && cat README.md\"}}}}\n</tool_call>",
        "Let me look at the files first, then read the README to see what it says. ".repeat(6),
        "I will list the directory."
    );
    let answer_ids = tito
        .model()
        .tokenizer()
        .encode(&answer_text)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pieces: Vec<String> = answer_ids
        .iter()
        .map(|id| tito.model().text(std::slice::from_ref(id)))
        .collect();
    // The calls read back from the whole answer.
    let read_back = || {
        let mut parser = tokentap_answer_parse::AnswerParser::new(
            tito.dialect(),
            tokentap_answer_parse::ToolSchemas::default(),
        );
        let mut calls = 0;
        for piece in &pieces {
            calls += parser
                .push(piece)
                .iter()
                .filter(|d| matches!(d, tokentap_answer_parse::Delta::ToolCall(_)))
                .count();
        }
        parser.finish();
        calls
    };
    anyhow::ensure!(read_back() == 1, "the answer's call was not read back");
    let read = time(args.iterations, || {
        std::hint::black_box(read_back());
    });
    let per_token = |us: f64| us / pieces.len() as f64;

    println!(
        "tokentap bench token-mode — one thread, {} iterations after warm-up; model {}",
        args.iterations,
        path.display()
    );
    println!(
        "  conversation: {} messages, {} bytes of text, {} bytes rendered, {} tokens; appended: {} bytes rendered",
        before.messages.len(),
        text_bytes(&before),
        text.len(),
        ids.len(),
        appended.len()
    );
    println!("  {:<44} {:>10} {:>10}", "", "p50 µs", "p99 µs");
    println!(
        "  {:<44} {:>10.0} {:>10.0}",
        "render whole conversation", render.0, render.1
    );
    println!(
        "  {:<44} {:>10.0} {:>10.0}",
        "encode whole conversation", encode.0, encode.1
    );
    println!(
        "  {:<44} {:>10.1} {:>10.1}",
        "encode the appended tool result alone", encode_appended.0, encode_appended.1
    );
    println!(
        "  {:<44} {:>10.0} {:>10.0}",
        "observe the appending call (whole)",
        p(0.5),
        p(0.99)
    );
    println!(
        "  {:<44} {:>10.1} {:>10.1}",
        "tito: build the appending call's prompt",
        pct(&mut build, 0.5),
        pct(&mut build, 0.99)
    );
    println!(
        "  {:<44} {:>10.1} {:>10.1}",
        "tito: keep the answered call",
        pct(&mut keep, 0.5),
        pct(&mut keep, 0.99)
    );
    println!(
        "  {:<44} {:>10.1} {:>10.1}",
        "tito: --token-verify the appending call", verify.0, verify.1
    );
    println!(
        "  {:<44} {:>10.2} {:>10.2}",
        format!("tito: read the answer back, per token ({})", pieces.len()),
        per_token(read.0),
        per_token(read.1)
    );
    println!(
        "  ids held per open session: {:.0} KiB (prompt + sampled ids of its last call)",
        held_per_session / 1024.0
    );
    Ok(())
}

fn common_prefix_len(a: &str, b: &str) -> usize {
    let n = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    // Back to a character boundary.
    (0..=n).rev().find(|&i| a.is_char_boundary(i)).unwrap_or(0)
}
