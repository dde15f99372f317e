//! `tokentap bench translate`: what each wire API costs per call, on the real harness requests
//! (`wire/testdata/harness-wire/`): parsing the harness request into the canonical one, and
//! rendering a realistic answer back, whole and streamed. Single-threaded, in-process, no
//! network: the codec alone.

use std::time::Instant;

use clap::Args;
use serde_json::Value;
use tokentap_proxy::backend::decode;
use tokentap_proxy::backend::BackendKind;
use tokentap_proxy::canonical::{
    Delta, FinishReason, GenerationAccumulator, GenerationEvent, ToolCallDelta, Usage,
};
use tokentap_proxy::wire::chat_completions::ChatCompletions;
use tokentap_proxy::wire::messages::Messages;
use tokentap_proxy::wire::responses::Responses;
use tokentap_proxy::wire::{ResponseMeta, WireCodec};

#[derive(Args)]
pub struct TranslateBenchArgs {
    /// Timed iterations per figure (after as many again of warm-up).
    #[arg(long, default_value_t = 2000)]
    iterations: usize,
    /// Text deltas in the rendered answer (one per sampled token, as engines stream).
    #[arg(long, default_value_t = 200)]
    deltas: usize,
}

/// The reference requests: (label, codec, request body).
fn fixtures() -> Vec<(&'static str, &'static dyn WireCodec, Vec<u8>)> {
    static CHAT: ChatCompletions = ChatCompletions;
    static RESPONSES: Responses = Responses;
    static MESSAGES: Messages = Messages;
    let body = |json: &str| {
        let v: Value = serde_json::from_str(json).expect("fixture JSON");
        serde_json::to_vec(&v["body"]).expect("serializes")
    };
    vec![
        (
            "Codex turn 1 (Responses)",
            &RESPONSES,
            body(include_str!("../../wire/testdata/harness-wire/codex.json")),
        ),
        (
            "Codex turn 2 (Responses)",
            &RESPONSES,
            body(include_str!(
                "../../wire/testdata/harness-wire/codex-turn2.json"
            )),
        ),
        (
            "Claude turn 1 (Messages)",
            &MESSAGES,
            body(include_str!("../../wire/testdata/harness-wire/claude.json")),
        ),
        (
            "Claude turn 2 (Messages)",
            &MESSAGES,
            body(include_str!(
                "../../wire/testdata/harness-wire/claude-turn2.json"
            )),
        ),
        (
            "Qwen turn 1 (Chat)",
            &CHAT,
            body(include_str!("../../wire/testdata/harness-wire/qwen.json")),
        ),
        (
            "Pi turn 1 (Chat)",
            &CHAT,
            body(include_str!("../../wire/testdata/harness-wire/pi.json")),
        ),
    ]
}

/// A generation: `n` one-token text deltas, then one tool call in three fragments.
fn generation(n: usize) -> Vec<GenerationEvent> {
    let mut ev = Vec::with_capacity(2 * n + 8);
    for i in 0..n {
        ev.push(GenerationEvent::Delta(Delta {
            content: Some(if i % 7 == 0 {
                " the".into()
            } else {
                " word".into()
            }),
            ..Delta::default()
        }));
        ev.push(GenerationEvent::SampledTokens {
            ids: vec![1000 + i as u32],
            logprobs: vec![Some(-0.25)],
        });
    }
    for (k, args) in ["{\"command\":", " \"ls -la", "\"}"].iter().enumerate() {
        ev.push(GenerationEvent::Delta(Delta {
            tool_calls: vec![ToolCallDelta {
                index: 0,
                id: (k == 0).then(|| "call_bench_0".into()),
                name: (k == 0).then(|| "shell".into()),
                arguments: Some((*args).into()),
            }],
            ..Delta::default()
        }));
    }
    ev.push(GenerationEvent::Finished {
        finish_reason: FinishReason::ToolCalls,
        usage: Some(Usage {
            prompt_tokens: 4000,
            completion_tokens: n as u64 + 8,
            total_tokens: 4008 + n as u64,
            reasoning_tokens: None,
        }),
    });
    ev
}

/// Times `f` `iterations` times (after a warm-up); p50, p99, mean in µs.
pub(crate) fn time(iterations: usize, mut f: impl FnMut()) -> (f64, f64, f64) {
    for _ in 0..iterations {
        f();
    }
    let mut us: Vec<f64> = (0..iterations)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    us.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99), us.iter().sum::<f64>() / us.len() as f64)
}

pub fn run(args: TranslateBenchArgs) -> anyhow::Result<()> {
    let events = generation(args.deltas);
    let mut acc = GenerationAccumulator::default();
    for e in &events {
        acc.push(e.clone());
    }
    println!(
        "tokentap bench translate — per call, single thread, {} iterations after warm-up; answer = {} text deltas + 1 tool call",
        args.iterations, args.deltas
    );
    println!(
        "  {:<26} {:>8} {:>20} {:>20} {:>20}",
        "request", "bytes", "parse p50/p99 µs", "render whole p50/p99", "render stream p50/p99"
    );
    for (label, codec, body) in fixtures() {
        // Fail loudly if a fixture stopped parsing: a benchmark of errors measures nothing.
        let parsed = codec
            .parse(&body)
            .map_err(|e| anyhow::anyhow!("{label}: {e}"))?;
        let meta = ResponseMeta {
            echo: parsed.echo.clone(),
            ..ResponseMeta::new(
                format!("{}bench", codec.id_prefix()),
                0,
                &parsed.request.model,
            )
        };
        let parse = time(args.iterations, || {
            std::hint::black_box(codec.parse(std::hint::black_box(&body)).ok());
        });
        let whole = time(args.iterations, || {
            std::hint::black_box(codec.render_whole(&meta, &acc));
        });
        let stream = time(args.iterations, || {
            let mut r = codec.stream_renderer(meta.clone(), true);
            let mut out = Vec::with_capacity(64 << 10);
            r.start(&mut out);
            for e in &events {
                match e {
                    GenerationEvent::Delta(d) => r.delta(d, &mut out),
                    GenerationEvent::Finished {
                        finish_reason,
                        usage,
                    } => r.finish(*finish_reason, *usage, &mut out),
                    _ => {}
                }
            }
            std::hint::black_box(out);
        });
        println!(
            "  {:<26} {:>8} {:>10.1} / {:>7.1} {:>10.1} / {:>7.1} {:>10.1} / {:>7.1}",
            label,
            body.len(),
            parse.0,
            parse.1,
            whole.0,
            whole.1,
            stream.0,
            stream.1
        );
    }
    // The harness body as the record keeps it: one scan and the bytes (now), against the tree
    // a version 1 record built (parse, redact, serialize).
    println!();
    println!(
        "  {:<26} {:>8} {:>22} {:>22}",
        "record body", "bytes", "kept as is p50/p99 µs", "as a tree p50/p99 µs"
    );
    for (label, _, body) in fixtures() {
        let kept = tokentap_proxy::redact::recorded_body(&body)
            .ok_or_else(|| anyhow::anyhow!("{label}: not JSON"))?;
        let scan = time(args.iterations, || {
            std::hint::black_box(tokentap_proxy::redact::recorded_body(std::hint::black_box(
                &body,
            )));
        });
        let tree = time(args.iterations, || {
            let v: serde_json::Value =
                serde_json::from_slice(std::hint::black_box(&body)).unwrap_or_default();
            std::hint::black_box(serde_json::to_vec(&tokentap_proxy::redact::body(v)).ok());
        });
        println!(
            "  {:<26} {:>8} {:>12.1} / {:>7.1} {:>12.1} / {:>7.1}{}",
            label,
            body.len(),
            scan.0,
            scan.1,
            tree.0,
            tree.1,
            if kept.verbatim {
                ""
            } else {
                "  (redacted: a tree either way)"
            }
        );
    }
    // The engine's answer, decoded into the events the proxy renders and records.
    println!();
    println!(
        "  {:<48} {:>8} {:>20}",
        "engine answer", "bytes", "decode p50/p99 µs"
    );
    for prompt_ids in [1_000, 10_000] {
        let body = crate::instant_backend::whole_answer(prompt_ids);
        let label = format!(
            "vLLM whole answer, {prompt_ids} prompt ids + {} sampled",
            crate::instant_backend::ANSWER.len()
        );
        // Fail loudly if the answer stopped decoding into ids.
        let events = decode::whole(BackendKind::Vllm, &body)
            .map_err(|e| anyhow::anyhow!("{label}: {e:?}"))?;
        anyhow::ensure!(
            events
                .iter()
                .any(|e| matches!(e, GenerationEvent::PromptTokens { ids, .. } if ids.len() == prompt_ids)),
            "{label}: no prompt ids decoded"
        );
        let t = time(args.iterations, || {
            std::hint::black_box(
                decode::whole(BackendKind::Vllm, std::hint::black_box(&body)).ok(),
            );
        });
        println!(
            "  {:<48} {:>8} {:>10.1} / {:>7.1}",
            label,
            body.len(),
            t.0,
            t.1
        );
    }
    Ok(())
}
