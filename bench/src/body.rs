//! The benchmark's request: a Chat Completions body shaped like Qwen Code's first request
//! (long system prompt, 15 tool definitions with JSON schemas, one user message made of
//! system reminders and the task), padded to an exact size.
//!
//! Size matters more than wording: the proxy's cost grows with the bytes it parses, redacts,
//! re-serializes and records, so the body is brought to `--body-bytes` exactly.

use clap::ValueEnum;
use serde_json::{json, Value};

const TOOLS: &str = include_str!("qwen_tools.json");

const SYSTEM_HEAD: &str =
    "You are Qwen Code, a non-interactive CLI agent specializing in software \
engineering tasks. Your primary goal is to help users safely and efficiently, adhering strictly \
to the following instructions and utilizing your available tools.\n\n# Core Mandates\n\n";

/// Guideline paragraphs cycled to fill the system prompt to size, as real agent prompts do.
const GUIDELINES: [&str; 8] = [
    "- **Conventions:** Rigorously adhere to existing project conventions when reading or \
modifying code. Analyze surrounding code, tests, and configuration first.\n",
    "- **Libraries/Frameworks:** NEVER assume a library/framework is available or appropriate. \
Verify its established usage within the project (check imports, configuration files like \
'package.json', 'Cargo.toml', 'requirements.txt', 'build.gradle', etc., or observe neighboring \
files) before employing it.\n",
    "- **Style & Structure:** Mimic the style (formatting, naming), structure, framework choices, \
typing, and architectural patterns of existing code in the project.\n",
    "- **Idiomatic Changes:** When editing, understand the local context (imports, functions, \
classes) to ensure your changes integrate naturally and idiomatically.\n",
    "- **Comments:** Add code comments sparingly. Focus on *why* something is done, especially \
for complex logic, rather than *what* is done. Only add high-value comments if necessary for \
clarity or if requested by the user. Do not edit comments that are separate from the code you \
are changing.\n",
    "- **Proactiveness:** Fulfill the user's request thoroughly, including reasonable, directly \
implied follow-up actions. Confirm ambiguity with the user; do not take significant actions \
beyond the clear scope of the request without confirming.\n",
    "- **Path Construction:** Before using any file system tool (e.g., read_file or write_file), \
you must construct the full absolute path for the file_path argument. Always combine the \
absolute path of the project's root directory with the file's path relative to the root.\n",
    "- **Verification:** After making code changes, execute the project-specific build, linting \
and type-checking commands (e.g., 'tsc', 'npm run lint', 'cargo clippy') that you have \
identified for this project. This ensures code quality and adherence to standards.\n\n",
];

const REMINDERS: [&str; 3] = [
    "<system-reminder>\nThe following skills are available for use with the Skill tool.\n\n\
<available_skills>\n<skill>\n<name>\nbatch\n</name>\n<description>\nExecute batch operations \
on multiple files in parallel. Automatically discovers files, splits into chunks, and \
processes with parallel worker agents.\n</description>\n</skill>\n<skill>\n<name>\nreview\n\
</name>\n<description>\nReview the current diff for correctness, style and missing tests.\n\
</description>\n</skill>\n</available_skills>\n</system-reminder>",
    "<system-reminder>\nThis is the Qwen Code. We are setting up the context for our chat.\n\
Today's date is Sunday, November 22, 2026.\nMy operating system is: linux\nI'm currently \
working in the directory: /home/user/qwen\nHere is the folder structure of the current \
working directories:\n\nShowing up to 20 items:\n\n/home/user/qwen/\n</system-reminder>",
    "<system-reminder>\nThe current date is: Sunday, November 22, 2026.\n</system-reminder>",
];

/// A Chat Completions body of `target` bytes (or the unpadded skeleton, if that is larger).
pub fn chat_request(target: usize, stream: bool) -> Vec<u8> {
    let tools: Value = serde_json::from_str(TOOLS).expect("the bundled tool list is valid JSON");
    let mut user: Vec<Value> = REMINDERS
        .iter()
        .map(|t| json!({"type": "text", "text": t}))
        .collect();
    user.push(json!({"type": "text", "text": "Write hi to a file"}));
    let build = |system: &str| {
        let mut body = json!({
            "model": "qwen3-coder-plus",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": 32000,
            "stream": stream,
            "tools": tools,
        });
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        serde_json::to_vec(&body).expect("JSON values always serialize")
    };

    let mut system = String::from(SYSTEM_HEAD);
    let skeleton = build(&system).len();
    if skeleton >= target {
        return build(&system);
    }
    // Grow past the target, then trim: each character's escaped JSON length is known.
    let mut len = skeleton;
    for g in GUIDELINES.iter().cycle() {
        if len >= target {
            break;
        }
        system.push_str(g);
        len += escaped_len(g);
    }
    while len > target {
        let c = system.pop().expect("the system prompt outgrew the padding");
        len -= escaped_len(c.encode_utf8(&mut [0; 4]));
    }
    while len < target {
        system.push(' ');
        len += 1;
    }
    let body = build(&system);
    debug_assert_eq!(body.len(), target);
    body
}

/// The same request in the OpenAI Responses shape (as Codex sends it: `instructions`, input
/// items, flat function tools).
pub fn responses_request(chat: &[u8]) -> Vec<u8> {
    let c: Value = serde_json::from_slice(chat).expect("chat_request makes valid JSON");
    let tools: Vec<Value> = c["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let f = &t["function"];
            json!({"type": "function", "name": f["name"], "description": f["description"],
                   "parameters": f["parameters"], "strict": false})
        })
        .collect();
    let content: Vec<Value> = parts(&c)
        .map(|t| json!({"type": "input_text", "text": t}))
        .collect();
    let body = json!({
        "model": c["model"],
        "instructions": c["messages"][0]["content"],
        "input": [{"type": "message", "role": "user", "content": content}],
        "tools": tools,
        "tool_choice": "auto",
        "parallel_tool_calls": false,
        "stream": c["stream"],
        "store": false,
    });
    serde_json::to_vec(&body).expect("JSON values always serialize")
}

/// The same request in the Anthropic Messages shape (as Claude Code sends it: system blocks,
/// content blocks, `input_schema` tools).
pub fn messages_request(chat: &[u8]) -> Vec<u8> {
    let c: Value = serde_json::from_slice(chat).expect("chat_request makes valid JSON");
    let tools: Vec<Value> = c["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            let f = &t["function"];
            json!({"name": f["name"], "description": f["description"], "input_schema": f["parameters"]})
        })
        .collect();
    let content: Vec<Value> = parts(&c)
        .map(|t| json!({"type": "text", "text": t}))
        .collect();
    let body = json!({
        "model": "claude-sonnet-4-5",
        "system": [{"type": "text", "text": c["messages"][0]["content"]}],
        "messages": [{"role": "user", "content": content}],
        "tools": tools,
        "max_tokens": 32000,
        "stream": c["stream"],
    });
    serde_json::to_vec(&body).expect("JSON values always serialize")
}

/// The user message's text parts.
fn parts(chat: &Value) -> impl Iterator<Item = &Value> {
    chat["messages"][1]["content"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| &p["text"])
}

/// Bytes `s` takes inside a JSON string (the padding text is ASCII).
fn escaped_len(s: &str) -> usize {
    s.bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\t' | b'\r' => 2,
            _ => 1,
        })
        .sum()
}

/// The wire API a benchmark's proxied calls speak.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Api {
    /// OpenAI Chat Completions (`/v1/chat/completions`).
    Chat,
    /// OpenAI Responses (`/v1/responses`), as Codex speaks it.
    Responses,
    /// Anthropic Messages (`/v1/messages`), as Claude Code speaks it.
    Messages,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Api::Chat => "Chat Completions",
            Api::Responses => "Responses",
            Api::Messages => "Messages",
        }
    }

    /// The proxied request body for the Chat Completions body `chat`.
    pub fn body(self, chat: &[u8]) -> Vec<u8> {
        match self {
            Api::Chat => chat.to_vec(),
            Api::Responses => responses_request(chat),
            Api::Messages => messages_request(chat),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_requested_size_and_shape() {
        for stream in [false, true] {
            let body = chat_request(40_000, stream);
            assert_eq!(body.len(), 40_000);
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(v["stream"], json!(stream));
            assert_eq!(v["tools"].as_array().unwrap().len(), 15);
            assert_eq!(v["messages"].as_array().unwrap().len(), 2);
        }
    }

    #[test]
    fn other_api_shapes_carry_the_same_content() {
        let chat = chat_request(40_000, true);
        let system = serde_json::from_slice::<Value>(&chat).unwrap()["messages"][0]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(system.len() > 10_000);
        let r: Value = serde_json::from_slice(&responses_request(&chat)).unwrap();
        assert_eq!(r["tools"].as_array().unwrap().len(), 15);
        assert_eq!(r["tools"][0]["type"], "function");
        assert_eq!(r["input"][0]["content"].as_array().unwrap().len(), 4);
        assert_eq!(r["instructions"].as_str().unwrap(), system);
        assert_eq!(r["stream"], true);
        let m: Value = serde_json::from_slice(&messages_request(&chat)).unwrap();
        assert_eq!(m["tools"][0]["input_schema"]["type"], "object");
        assert_eq!(m["messages"][0]["content"][3]["text"], "Write hi to a file");
        assert_eq!(m["system"][0]["text"].as_str().unwrap(), system);
    }
}
