//! The repository tasks rollout tests submit (tests/fixtures/tasks: `calc`, which the scripted
//! policy fixes, `greet`, which it gets wrong, and `hang`, whose tool never returns) and that
//! policy, for every harness's shell tool.

use serde_json::{json, Value};

use crate::scripted::{Reply, Script};

/// The scripted policy of the repository tasks: reads the file first where the harness
/// insists (Qwen Code), runs the task's shell command with the harness's own tool, then
/// says it is done.
pub fn task_policy() -> Script {
    std::sync::Arc::new(|req: &Value, _| {
        let offered = |name: &str| {
            req["tools"].as_array().is_some_and(|ts| {
                ts.iter()
                    .any(|t| t["function"]["name"].as_str() == Some(name))
            })
        };
        // Each harness's shell tool and the name of its command argument.
        let Some((tool, arg)) = [
            ("bash", "command"),
            ("run_shell_command", "command"),
            ("exec_command", "cmd"),
            ("Bash", "command"),
        ]
        .into_iter()
        .find(|(t, _)| offered(t)) else {
            return Reply::text("ok");
        };
        let messages = req["messages"].as_array().cloned().unwrap_or_default();
        let tool_results = messages.iter().filter(|m| m["role"] == "tool").count();
        let user = messages
            .iter()
            .filter(|m| m["role"] == "user")
            .map(|m| m["content"].to_string())
            .collect::<String>();
        let (file, command) = if user.contains("TASK calc") {
            ("calc.py", "sed -i 's/a - b/a + b/' calc.py")
        } else if user.contains("TASK greet") {
            // Wrong: the test wants "Hello, Ada!".
            ("greet.py", "sed -i 's/Hello /Hi /' greet.py")
        } else {
            ("calc.py", "sleep 600")
        };
        // Qwen Code refuses to let a command edit a file its read_file tool has not read in
        // the session: read it first, by absolute path under the project root its prompt
        // names, as a model would.
        let reads_first = offered("read_file");
        match (reads_first, tool_results) {
            (true, 0) => Reply::tool_call(
                "read_file",
                json!({ "file_path": format!("{}/{file}", project_root(&req["messages"])) }),
            ),
            (false, 0) | (true, 1) => Reply::tool_call(tool, json!({ arg: command })),
            _ => Reply::text("Done."),
        }
    })
}

/// The sample's working directory as the harness's prompt names it (`/…/samples/ID/work`).
pub fn project_root(messages: &Value) -> String {
    fn strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::String(s) => out.push(s),
            Value::Array(a) => a.iter().for_each(|v| strings(v, out)),
            Value::Object(o) => o.values().for_each(|v| strings(v, out)),
            _ => {}
        }
    }
    let mut texts = Vec::new();
    strings(messages, &mut texts);
    let path_char = |c: char| c.is_ascii_alphanumeric() || "/._-".contains(c);
    for t in texts {
        for (i, _) in t.match_indices("/work") {
            let end = i + "/work".len();
            if t[end..].starts_with(path_char) {
                continue;
            }
            let start = t[..i].rfind(|c| !path_char(c)).map_or(0, |j| j + 1);
            if t[start..].starts_with('/') {
                return t[start..end].to_owned();
            }
        }
    }
    panic!("the prompt names no project root")
}

pub fn repo_task(name: &str, harness: &str, samples: u32, agent_s: u64) -> Value {
    // The hanging task works on calc's project; the policy keys on the instruction.
    let project = if name == "hang" { "calc" } else { name };
    let dir = crate::artefacts::workspace_root()
        .join("tests/fixtures/tasks")
        .join(project);
    json!({
        "task_id": format!("{name}-{harness}"),
        "instruction": format!("TASK {name}: make the failing unit test pass by fixing the code. Use the shell."),
        "workspace": {"dir": {"path": dir}},
        "harness": {"name": harness},
        "num_samples": samples,
        "budgets": {"agent_s": agent_s},
        "evaluator": {
            "kind": "command",
            "command": "python3 -m unittest -q",
            "test_files": [format!("test_{project}.py")]
        }
    })
}
