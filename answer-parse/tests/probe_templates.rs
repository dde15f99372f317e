//! The probe on the real chat templates of chat-template's golden set (73 templates from the
//! llama.cpp sdist, rendered as transformers renders them): each template the issue names is
//! read back by its family, and every template the probe accepts is read back exactly.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::{Map, Value};
use tokentap_answer_parse::{probe, Family};
use tokentap_chat_template::ChatTemplate;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../chat-template/tests/golden")
}

/// The template's special-token variables, as the golden set renders it.
fn variables(name: &str) -> Map<String, Value> {
    let path = golden().join("expected").join(format!("{name}.json"));
    let Ok(text) = std::fs::read_to_string(path) else {
        return Map::new();
    };
    let expected: Value = serde_json::from_str(&text).unwrap();
    expected["variables"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}

#[test]
fn each_family_reads_its_real_templates() {
    let want: &[(&str, Family)] = &[
        ("Qwen-Qwen2.5-7B-Instruct", Family::Hermes),
        ("Qwen-Qwen3-0.6B", Family::Hermes),
        ("Qwen-QwQ-32B", Family::Hermes),
        (
            "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
            Family::Hermes,
        ),
        ("Qwen3-Coder", Family::Qwen3Coder),
        ("Qwen3.5-4B", Family::Qwen3Coder),
        ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", Family::Qwen3Coder),
        ("meta-llama-Llama-3.1-8B-Instruct", Family::Llama3Json),
        ("meta-llama-Llama-3.2-3B-Instruct", Family::Llama3Json),
        ("meta-llama-Llama-3.3-70B-Instruct", Family::Llama3Json),
        (
            "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            Family::DeepSeekV3,
        ),
        ("deepseek-ai-DeepSeek-V3.1", Family::DeepSeekV3),
        ("GLM-4.6", Family::Glm45),
        ("GLM-4.7-Flash", Family::Glm45),
    ];
    let mut names: Vec<String> = std::fs::read_dir(golden().join("templates"))
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            path.file_stem().unwrap().to_string_lossy().into_owned()
        })
        .collect();
    names.sort();
    assert!(names.len() >= 70, "the golden set's templates");
    let mut read_by: BTreeMap<String, Result<(Family, bool), String>> = BTreeMap::new();
    for name in &names {
        let source =
            std::fs::read_to_string(golden().join("templates").join(format!("{name}.jinja")))
                .unwrap();
        let result = match ChatTemplate::new(&source) {
            Ok(template) => probe(&template, &variables(name))
                .map(|d| (d.family, d.reasoning))
                .map_err(|e| e.reason),
            Err(e) => Err(format!("does not compile: {e}")),
        };
        read_by.insert(name.clone(), result);
    }
    for (name, result) in &read_by {
        match result {
            Ok((family, reasoning)) => eprintln!(
                "{name:55} {family}{}",
                if *reasoning { " +reasoning" } else { "" }
            ),
            Err(why) => eprintln!(
                "{name:55} refused: {}",
                why.chars().take(160).collect::<String>()
            ),
        }
    }
    let wrong: Vec<String> = want
        .iter()
        .filter(|(name, family)| !matches!(read_by[*name], Ok((f, _)) if f == *family))
        .map(|(name, family)| format!("{name}: want {family}, got {:?}", read_by[*name]))
        .collect();
    assert!(wrong.is_empty(), "{wrong:#?}");
    // Reasoning templates are probed with reasoning.
    for name in [
        "Qwen-Qwen3-0.6B",
        "GLM-4.6",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    ] {
        assert!(
            matches!(read_by[name], Ok((_, true))),
            "{name} reads reasoning"
        );
    }
    // A template without tool calls (Gemma 2) is refused, with the reason.
    let gemma = &read_by["google-gemma-2-2b-it"];
    assert!(gemma.is_err(), "{gemma:?}");
}
