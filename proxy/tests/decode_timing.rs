//! How long decoding an engine's answer takes, for docs/benchmarks.md ("Where the proxy's time
//! goes"). Ignored by default: a timing means something only in a release build:
//! `cargo test --release -p tokentap-proxy --test decode_timing -- --ignored --nocapture`

use std::time::Instant;

use tokentap_proxy::backend::{decode, BackendKind};

/// A vLLM whole answer (`return_token_ids`, `logprobs`, `return_tokens_as_token_ids`) for a
/// prompt of `prompt` ids and `sampled` sampled tokens.
fn vllm_answer(prompt: usize, sampled: usize) -> Vec<u8> {
    let ids = |n: usize, salt: usize| -> Vec<String> {
        (0..n)
            .map(|i| ((i * 7919 + salt) % 151_000).to_string())
            .collect()
    };
    let sampled_ids = ids(sampled, 13);
    let entries: Vec<String> = sampled_ids
        .iter()
        .map(|id| {
            let token = format!("token_id:{id}");
            let bytes: Vec<String> = token.bytes().map(|b| b.to_string()).collect();
            format!(
                r#"{{"token":"{token}","logprob":-0.{id},"bytes":[{}],"top_logprobs":[]}}"#,
                bytes.join(",")
            )
        })
        .collect();
    let text = "word ".repeat(sampled);
    format!(
        r#"{{"id":"chatcmpl-1","object":"chat.completion","created":1767225600,"model":"m","choices":[{{"index":0,"message":{{"role":"assistant","content":"{text}\n","refusal":null,"annotations":null,"audio":null,"function_call":null,"tool_calls":[],"reasoning":null}},"logprobs":{{"content":[{}]}},"finish_reason":"stop","stop_reason":null,"token_ids":[{}],"routed_experts":null}}],"service_tier":null,"system_fingerprint":null,"usage":{{"prompt_tokens":{prompt},"total_tokens":{},"completion_tokens":{sampled},"prompt_tokens_details":null}},"prompt_logprobs":null,"prompt_token_ids":[{}],"prompt_text":null,"kv_transfer_params":null}}"#,
        entries.join(","),
        sampled_ids.join(","),
        prompt + sampled,
        ids(prompt, 1).join(","),
    )
    .into_bytes()
}

#[test]
#[ignore = "a timing: run in release, see the module doc"]
fn time_vllm_whole_answer_decode() {
    for (prompt, sampled) in [(10_000, 200), (10_000, 0), (1_000, 50)] {
        let body = vllm_answer(prompt, sampled);
        let events = decode::whole(BackendKind::Vllm, &body).expect("decodes");
        assert!(events.len() >= 3);
        // The best of 30 runs of 100 decodes: the minimum is what survives a busy machine.
        let best = |f: &dyn Fn()| {
            for _ in 0..100 {
                f();
            }
            (0..30)
                .map(|_| {
                    let t = Instant::now();
                    for _ in 0..100 {
                        f();
                    }
                    t.elapsed() / 100
                })
                .min()
                .unwrap()
        };
        let value_only = best(&|| {
            std::hint::black_box(
                serde_json::from_slice::<serde_json::Value>(std::hint::black_box(&body)).unwrap(),
            );
        });
        let best = best(&|| {
            std::hint::black_box(
                decode::whole(BackendKind::Vllm, std::hint::black_box(&body)).unwrap(),
            );
        });
        println!("  (a serde_json::Value parse alone: {value_only:?})");
        println!(
            "vLLM whole answer, {prompt} prompt ids + {sampled} sampled ({} KB): {best:?} per decode",
            body.len() / 1024
        );
    }
}

/// Every JSON value `v` can become by replacing one of its nodes with an odd value (the
/// types the decoders read leniently), plus `v` itself.
fn variants(v: &serde_json::Value) -> Vec<serde_json::Value> {
    use serde_json::{json, Value};
    let odd = [
        json!(null),
        json!(true),
        json!(7),
        json!(-1),
        json!(1.5),
        json!(4294967296u64),
        json!("s"),
        json!("token_id:5"),
        json!([]),
        json!({}),
        json!([1, 2]),
        json!([[-0.5, 3, "x"]]),
        json!({"prompt_tokens": 3, "code": 404}),
    ];
    fn paths(v: &Value, here: &mut Vec<String>, out: &mut Vec<String>) {
        out.push(here.iter().map(|p| format!("/{p}")).collect());
        match v {
            Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    here.push(i.to_string());
                    paths(x, here, out);
                    here.pop();
                }
            }
            Value::Object(o) => {
                for (k, x) in o {
                    here.push(k.replace('~', "~0").replace('/', "~1"));
                    paths(x, here, out);
                    here.pop();
                }
            }
            _ => {}
        }
    }
    let mut all = Vec::new();
    paths(v, &mut Vec::new(), &mut all);
    let mut out = vec![v.clone()];
    for p in all {
        for o in &odd {
            let mut w = v.clone();
            *w.pointer_mut(&p).unwrap() = o.clone();
            out.push(w);
        }
        // The node removed from its object.
        if let Some((parent, key)) = p.rsplit_once('/') {
            let mut w = v.clone();
            if let Some(Value::Object(m)) = w.pointer_mut(parent) {
                m.shift_remove(&key.replace("~1", "/").replace("~0", "~"));
                out.push(w);
            }
        }
    }
    out
}

/// Writes what the decoders make of many engine answers (the fuzz seeds and every one-node
/// variant of them) to `$DECODE_DUMP`: run at two commits and diff, to see that a decoder
/// change keeps behaviour.
#[test]
#[ignore = "a differential dump: see the doc"]
fn dump_decodes() {
    use std::fmt::Write;
    let Ok(out_path) = std::env::var("DECODE_DUMP") else {
        return;
    };
    let seeds = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds");
    let kinds = [
        BackendKind::Vllm,
        BackendKind::Sglang,
        BackendKind::Llamacpp,
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let mut out = String::new();
    let mut n = 0usize;
    let mut dirs: Vec<_> = [
        "vllm_answer",
        "sglang_answer",
        "llamacpp_answer",
        "openai_compat_chunk",
    ]
    .iter()
    .flat_map(|d| std::fs::read_dir(format!("{seeds}/{d}")).unwrap())
    .map(|e| e.unwrap().path())
    .collect();
    dirs.sort();
    for path in dirs {
        let data = std::fs::read(&path).unwrap();
        let text = String::from_utf8_lossy(&data).into_owned();
        let stream: Vec<&str> = text
            .split("\n\n")
            .filter_map(|f| {
                f.trim_start_matches(|c: char| c != 'd')
                    .strip_prefix("data: ")
            })
            .collect();
        if stream.is_empty() {
            // A whole answer: after the fuzz framing byte, if any.
            let body = if data.first() == Some(&b'{') {
                &data[..]
            } else {
                &data[1..]
            };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
                continue;
            };
            let mut bodies: Vec<Vec<u8>> = variants(&v)
                .iter()
                .map(|w| serde_json::to_vec(w).unwrap())
                .collect();
            for cut in (0..body.len()).step_by(37) {
                bodies.push(body[..cut].to_vec());
            }
            for b in &bodies {
                for kind in kinds {
                    n += 1;
                    writeln!(out, "{n} {kind:?} {:?}", decode::whole(kind, b)).unwrap();
                }
                if let Ok(v) = serde_json::from_slice::<serde_json::Value>(b) {
                    for whole in [true, false] {
                        writeln!(out, "delta {:?}", decode::delta(&v, whole)).unwrap();
                    }
                    writeln!(out, "usage {:?}", decode::usage(&v)).unwrap();
                    for key in ["token_ids", "prompt_token_ids", "tokens"] {
                        writeln!(out, "ids {:?}", decode::id_array(v.get(key))).unwrap();
                    }
                }
            }
        } else {
            for (i, chunk) in stream.iter().enumerate() {
                let mut chunk_variants = vec![chunk.to_string()];
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(chunk) {
                    chunk_variants.extend(variants(&v).iter().map(|w| w.to_string()));
                }
                for cv in chunk_variants {
                    let mut frames = stream.clone();
                    frames[i] = &cv;
                    let body: String = frames.iter().map(|f| format!("data: {f}\n\n")).collect();
                    for kind in kinds {
                        n += 1;
                        let events: Vec<_> = rt.block_on(futures::StreamExt::collect::<Vec<_>>(
                            decode::stream(kind, vec![body.clone().into_bytes()]),
                        ));
                        writeln!(out, "{n} {kind:?} {events:?}").unwrap();
                    }
                }
            }
        }
    }
    std::fs::write(out_path, out).unwrap();
    println!("{n} decodes");
}

/// Where a 10,000-id array's decode time goes: the answer decoders against a `Value` parse, a
/// derived `Vec<u32>` and a bare digit loop over the same bytes.
#[test]
#[ignore = "a timing: run in release, see the module doc"]
fn time_id_array_parsers() {
    let ids: Vec<String> = (0..10_000)
        .map(|i| ((i * 7919 + 1) % 151_000).to_string())
        .collect();
    let body = format!(
        r#"{{"choices":[{{}}],"prompt_token_ids":[{}]}}"#,
        ids.join(",")
    )
    .into_bytes();
    let best = |name: &str, f: &dyn Fn()| {
        for _ in 0..100 {
            f();
        }
        let t = (0..30)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..100 {
                    f();
                }
                t.elapsed() / 100
            })
            .min()
            .unwrap();
        println!("{name}: {t:?}");
    };
    #[derive(serde::Deserialize)]
    struct Derived {
        #[allow(dead_code)]
        prompt_token_ids: Vec<u32>,
    }
    best("serde_json::Value", &|| {
        std::hint::black_box(
            serde_json::from_slice::<serde_json::Value>(std::hint::black_box(&body)).unwrap(),
        );
    });
    best("decode::whole (vLLM)", &|| {
        std::hint::black_box(
            decode::whole(BackendKind::Vllm, std::hint::black_box(&body)).unwrap(),
        );
    });
    best("derived Vec<u32>", &|| {
        std::hint::black_box(
            serde_json::from_slice::<Derived>(std::hint::black_box(&body)).unwrap(),
        );
    });
    struct AnyId;
    impl<'de> serde::de::Visitor<'de> for AnyId {
        type Value = Option<u64>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("id")
        }
        fn visit_u64<E>(self, v: u64) -> Result<Option<u64>, E> {
            Ok(Some(v))
        }
    }
    struct AnyIdSeed;
    impl<'de> serde::de::DeserializeSeed<'de> for AnyIdSeed {
        type Value = Option<u64>;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Option<u64>, D::Error> {
            d.deserialize_any(AnyId)
        }
    }
    struct AnyIds;
    impl<'de> serde::de::Visitor<'de> for AnyIds {
        type Value = Vec<u32>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("ids")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u32>, A::Error> {
            let mut v = Vec::new();
            while let Some(x) = seq.next_element_seed(AnyIdSeed)? {
                v.push(x.unwrap() as u32);
            }
            Ok(v)
        }
    }
    let ids_only = format!("[{}]", ids.join(",")).into_bytes();
    best("array via deserialize_any elements", &|| {
        use serde::Deserializer;
        let mut de = serde_json::Deserializer::from_slice(std::hint::black_box(&ids_only));
        std::hint::black_box((&mut de).deserialize_any(AnyIds).unwrap());
    });
    best("array via Vec<u32>", &|| {
        std::hint::black_box(
            serde_json::from_slice::<Vec<u32>>(std::hint::black_box(&ids_only)).unwrap(),
        );
    });
    best("digit loop", &|| {
        let b = std::hint::black_box(&body);
        let mut ids = Vec::new();
        let mut n: u32 = 0;
        let mut in_num = false;
        for &c in b.iter() {
            if c.is_ascii_digit() {
                n = n * 10 + u32::from(c - b'0');
                in_num = true;
            } else if in_num {
                ids.push(n);
                n = 0;
                in_num = false;
            }
        }
        std::hint::black_box(ids);
    });
}
