//! chat-template's renderer and tokenizer on arbitrary conversations and text.
//! Input: byte 0 picks a real template (low 3 bits), whether to add the generation prompt
//! (bit 3) and the pre-tokenizer (bits 4-5); the rest is a canonical ChatRequest as JSON, or,
//! when it is not one, a conversation built from its bytes (0x00-separated messages whose
//! first byte picks role and shape).
//! Invariants: no panic; rendering is deterministic (the same text, or the same error, twice);
//! the fast encoder gives the `tokenizers` pipeline's ids on the rendering and on the raw input
//! text, and those ids decode back to the text. And `--token-mode observe`'s observer (Qwen3's
//! template on the first vocabulary) never panics on the conversation with arbitrary engine
//! prompt ids and sampled ids (from the input's bytes) over two calls of one session.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tokentap_chat_template::gguf::GgufVocabulary;
use tokentap_chat_template::{ChatTemplate, RenderOptions, Tokenizer};
use tokentap_schema::{ChatMessage, ChatRequest, Role, ToolCall};
use tokentap_token_mode::{CallView, EngineDialect, Observer, ObserverLimits, TokenModel};

const TEMPLATES: [&str; 8] = [
    include_str!("../../chat-template/tests/golden/templates/Qwen-Qwen3-0.6B.jinja"),
    include_str!(
        "../../chat-template/tests/golden/templates/meta-llama-Llama-3.1-8B-Instruct.jinja"
    ),
    include_str!("../../chat-template/tests/golden/templates/openai-gpt-oss-120b.jinja"),
    include_str!(
        "../../chat-template/tests/golden/templates/Mistral-Small-3.2-24B-Instruct-2506.jinja"
    ),
    include_str!("../../chat-template/tests/golden/templates/deepseek-ai-DeepSeek-V3.1.jinja"),
    include_str!("../../chat-template/tests/golden/templates/GLM-4.6.jinja"),
    include_str!("../../chat-template/tests/golden/templates/Kimi-K2-Thinking.jinja"),
    include_str!("../../chat-template/tests/golden/templates/google-gemma-4-31B-it.jinja"),
];
const PRES: [&str; 4] = ["qwen2", "llama-bpe", "gpt-2", "deepseek-llm"];

fn templates() -> &'static Vec<ChatTemplate> {
    static T: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        TEMPLATES
            .iter()
            .map(|s| ChatTemplate::new(s).unwrap())
            .collect()
    })
}

/// GPT-2's byte-to-character table, as byte-level vocabularies spell bytes.
fn byte_chars() -> Vec<char> {
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
                b as char
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// A small byte-level vocabulary: every byte, merges of common pairs (some nested), and the
/// chat templates' special tokens as control tokens.
fn tokenizers() -> &'static Vec<Tokenizer> {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        PRES.iter()
            .map(|pre| {
                let v = GgufVocabulary {
                    model: Some("gpt2".into()),
                    pre: Some((*pre).into()),
                    ..vocabulary()
                };
                Tokenizer::from_gguf_vocabulary(&v).unwrap()
            })
            .collect()
    })
}

/// The vocabulary of [`tokenizers`]: tokens, merges and token types.
fn vocabulary() -> GgufVocabulary {
    let chars = byte_chars();
    let mut tokens: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i64; tokens.len()];
    let mut merges = Vec::new();
    let g = |s: &str| -> String { s.bytes().map(|b| chars[b as usize]).collect() };
    for (a, b) in [
        (" ", "t"),
        ("h", "e"),
        (" t", "he"),
        ("i", "n"),
        ("e", "r"),
        (" ", "a"),
        ("o", "n"),
        ("\n", "\n"),
        (" ", " "),
        ("  ", "  "),
        ("{", "\""),
        ("\"", ":"),
        ("in", "g"),
        (" ", "s"),
        ("r", "e"),
        ("<", "/"),
        ("1", "2"),
    ] {
        let (ga, gb) = (g(a), g(b));
        merges.push(format!("{ga} {gb}"));
        let joined = format!("{ga}{gb}");
        if !tokens.contains(&joined) {
            tokens.push(joined);
            types.push(1);
        }
    }
    // A multi-byte character as one token: é is C3 A9.
    merges.push(format!("{} {}", chars[0xC3], chars[0xA9]));
    tokens.push(format!("{}{}", chars[0xC3], chars[0xA9]));
    types.push(1);
    for special in [
        "<|im_start|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<think>",
        "</think>",
        "<|start|>",
        "<|end|>",
    ] {
        tokens.push(special.into());
        types.push(3);
    }
    GgufVocabulary {
        tokens,
        merges,
        token_types: types,
        ..Default::default()
    }
}

/// An observer on the first pre-tokenizer's vocabulary with Qwen3's template, its state kept
/// small so every run exercises eviction too.
fn observer() -> &'static Observer {
    static O: OnceLock<Observer> = OnceLock::new();
    O.get_or_init(|| {
        let v = GgufVocabulary {
            model: Some("gpt2".into()),
            pre: Some(PRES[0].into()),
            chat_templates: vec![("default".into(), TEMPLATES[0].into())],
            ..vocabulary()
        };
        let tok = Tokenizer::from_gguf_vocabulary(&v).unwrap();
        let model = TokenModel::new(tok, "fuzz".into(), EngineDialect::LlamaCpp).unwrap();
        Observer::new(
            model,
            ObserverLimits {
                sessions: 4,
                tips_per_session: 3,
                held_tokens: 1 << 16,
            },
        )
    })
}

/// Ids from bytes, within the vocabulary (and a few beyond it).
fn ids(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks(2)
        .map(|c| u32::from(c[0]) * 3 + u32::from(*c.get(1).unwrap_or(&0)) % 3)
        .collect()
}

/// A conversation from bytes: 0x00 separates messages; a message's first byte picks its
/// shape, the rest is its text.
fn conversation(data: &[u8]) -> ChatRequest {
    let mut messages = Vec::new();
    for chunk in data.split(|&b| b == 0).take(32) {
        let Some((&kind, text)) = chunk.split_first() else {
            continue;
        };
        let text = String::from_utf8_lossy(text).into_owned();
        let role = [
            Role::System,
            Role::User,
            Role::Assistant,
            Role::Tool,
            Role::Developer,
        ][kind as usize % 5];
        let mut m = ChatMessage::text(role, text.clone());
        if kind & 0x08 != 0 && role == Role::Assistant {
            m.tool_calls.push(ToolCall {
                id: format!("call{kind:05}"),
                name: "f".into(),
                arguments: text.clone(),
            });
        }
        if kind & 0x10 != 0 {
            m.reasoning = Some(text.chars().rev().collect());
        }
        if kind & 0x20 != 0 {
            m.content_was_string = false;
        }
        if role == Role::Tool {
            m.tool_call_id = Some(format!("call{kind:05}"));
        }
        messages.push(m);
    }
    ChatRequest {
        model: "fuzz".into(),
        messages,
        tools: Vec::new(),
        tool_choice: None,
        sampling: Default::default(),
        stream: false,
        extra: Default::default(),
    }
}

fn check_tokens(tok: &Tokenizer, text: &str) {
    let fast = tok.encode(text).expect("encodes");
    assert_eq!(
        fast,
        tok.encode_reference(text).expect("encodes"),
        "{text:?}"
    );
    assert_eq!(tok.decode(&fast).expect("decodes"), text);
}

fuzz_target!(|data: &[u8]| {
    let Some((&head, rest)) = data.split_first() else {
        return;
    };
    let template = &templates()[(head & 7) as usize];
    let tok = &tokenizers()[((head >> 4) & 3) as usize];
    let request =
        serde_json::from_slice::<ChatRequest>(rest).unwrap_or_else(|_| conversation(rest));
    let options = RenderOptions {
        add_generation_prompt: head & 8 != 0,
        kwargs: serde_json::json!({"bos_token": "<s>", "eos_token": "<|im_end|>"})
            .as_object()
            .unwrap()
            .clone(),
        // A fixed clock, so that `strftime_now` cannot make two renders differ.
        now: chrono::DateTime::from_timestamp(1_741_944_413, 0).map(|d| d.naive_utc()),
        ..Default::default()
    };
    let first = template.render(&request, &options);
    let second = template.render(&request, &options);
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("rendered once and failed once: {first:?} / {second:?}"),
    }
    if let Ok(text) = first {
        check_tokens(tok, &text);
    }
    // Two calls of one session: the engine's prompt the template's own ids (so the tips
    // line up) with the input's ids spliced in, sampled ids from the input.
    let o = observer();
    let own = o.model().prompt_ids(&request).unwrap_or_default();
    let (a, b) = rest.split_at(rest.len() / 2);
    let mut prompt = own.clone();
    prompt.truncate(own.len() * usize::from(head & 3) / 3);
    prompt.extend(ids(a));
    let sampled = ids(b);
    let session = format!("s{}", head >> 6);
    o.observe(CallView {
        session_id: &session,
        record_id: "first",
        request: &request,
        engine_prompt: Some(&prompt),
        completion: Some(&sampled),
        reasoning: Some(&String::from_utf8_lossy(b)),
    });
    let mut next = prompt.clone();
    next.extend(sampled.iter().rev().take(b.len() % 7));
    next.extend(ids(a).iter().rev());
    o.observe(CallView {
        session_id: &session,
        record_id: "second",
        request: &request,
        engine_prompt: Some(&next),
        completion: None,
        reasoning: None,
    });
    check_tokens(tok, &String::from_utf8_lossy(rest));
});
