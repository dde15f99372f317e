//! Offline generation's files (`tokentap generate`): the task file in, and out the SFT
//! dataset of the accepted samples: OUT/sft.jsonl, one row per trace with its messages and
//! token ids (prompt and response joined, the loss mask 0 over the prompt), and
//! OUT/report.json with the acceptance rate and the outcomes.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use crate::store::Store;
use crate::task::{Outcome, Sample, TaskSpec};

/// What `tokentap generate`'s flags fill in or override in every task of the file.
#[derive(Debug, Clone, Default)]
pub struct TaskOverrides {
    /// The harness's name (`--harness`).
    pub harness: Option<String>,
    /// Samples per task (`--samples`).
    pub samples: Option<u32>,
    /// The evaluator, as JSON text (`--evaluator`).
    pub evaluator: Option<String>,
}

/// The task specs of `tasks` (one JSON object a line), with `overrides` applied and a
/// relative workspace path taken from the file's directory; task ids must be unique.
pub fn read_tasks(tasks: &Path, overrides: &TaskOverrides) -> anyhow::Result<Vec<TaskSpec>> {
    let text =
        std::fs::read_to_string(tasks).with_context(|| format!("reading {}", tasks.display()))?;
    let base = tasks.parent().map(Path::to_path_buf).unwrap_or_default();
    let evaluator: Option<Value> = match &overrides.evaluator {
        Some(e) => Some(serde_json::from_str(e).context("--evaluator is not JSON")?),
        None => None,
    };
    let mut specs = Vec::new();
    let mut seen = HashSet::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", tasks.display(), i + 1);
        let mut v: Value = serde_json::from_str(line).with_context(at)?;
        let o = v
            .as_object_mut()
            .with_context(|| format!("{}: not an object", at()))?;
        if let Some(h) = &overrides.harness {
            o.insert("harness".into(), json!({"name": h}));
        }
        if let Some(n) = overrides.samples {
            o.insert("num_samples".into(), json!(n));
        }
        if let Some(e) = &evaluator {
            o.insert("evaluator".into(), e.clone());
        }
        if let Some(Value::String(p)) = o
            .get_mut("workspace")
            .and_then(|w| w.get_mut("dir"))
            .and_then(|d| d.get_mut("path"))
        {
            if Path::new(p.as_str()).is_relative() {
                *p = base.join(&*p).display().to_string();
            }
        }
        let spec: TaskSpec = serde_json::from_value(v).with_context(at)?;
        if !seen.insert(spec.task_id.clone()) {
            bail!("{}: task_id {} appears twice", at(), spec.task_id);
        }
        specs.push(spec);
    }
    if specs.is_empty() {
        bail!("{} has no tasks", tasks.display());
    }
    Ok(specs)
}

/// Every sample of the rollouts `submitted` (task id → rollout id), by sample id.
pub fn all_samples(
    store: &Store,
    submitted: &HashMap<String, String>,
) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    for r in submitted.values() {
        out.extend(store.rollout(r)?.1);
    }
    out.sort_by(|a, b| a.sample_id.cmp(&b.sample_id));
    Ok(out)
}

/// Whether a sample goes into the dataset: completed with at least `min_reward`.
pub fn accepted(s: &Sample, min_reward: f64) -> bool {
    matches!(s.outcome, Some(Outcome::Completed { reward }) if reward >= min_reward)
}

/// OUT/sft.jsonl (rewritten whole from the store, so a resumed run never duplicates rows) and
/// OUT/report.json.
pub fn write_dataset(out: &Path, samples: &[Sample], min_reward: f64) -> anyhow::Result<Value> {
    let tmp = out.join("sft.jsonl.tmp");
    let mut w = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    let (mut rows, mut accepted_n) = (0u64, 0u64);
    let mut outcomes: HashMap<&str, u64> = HashMap::new();
    for s in samples {
        let kind = match &s.outcome {
            Some(Outcome::Completed { .. }) => "completed",
            Some(Outcome::Timeout { .. }) => "timeout",
            Some(Outcome::Error { .. }) => "error",
            Some(Outcome::Cancelled) => "cancelled",
            None => "unfinished",
        };
        *outcomes.entry(kind).or_default() += 1;
        if !accepted(s, min_reward) {
            continue;
        }
        accepted_n += 1;
        let Some(t) = &s.trajectory else { continue };
        let text =
            std::fs::read_to_string(&t.path).with_context(|| format!("reading {}", t.path))?;
        for line in text.lines() {
            let trace: tokentap_schema::Trace = serde_json::from_str(line)?;
            let messages: Value = serde_json::from_str(&trace.messages_json).unwrap_or(Value::Null);
            let tools: Value = serde_json::from_str(&trace.tools_json).unwrap_or(Value::Null);
            let mut input_ids = trace.prompt_ids.clone();
            input_ids.extend(&trace.response_ids);
            let mut mask = vec![0u8; trace.prompt_ids.len()];
            mask.extend(&trace.loss_mask);
            serde_json::to_writer(
                &mut w,
                &json!({
                    "task_id": s.task_id,
                    "sample_id": s.sample_id,
                    "trace_id": trace.trace_id,
                    "reward": trace.reward,
                    "messages": messages,
                    "tools": tools,
                    "input_ids": input_ids,
                    "loss_mask": mask,
                    "prompt_len": trace.prompt_ids.len(),
                    "logprobs": trace.logprobs,
                }),
            )?;
            w.write_all(b"\n")?;
            rows += 1;
        }
    }
    w.flush()?;
    drop(w);
    std::fs::rename(&tmp, out.join("sft.jsonl"))?;
    let n = samples.len() as u64;
    let report = json!({
        "samples": n,
        "accepted": accepted_n,
        "acceptance_rate": if n == 0 { 0.0 } else { accepted_n as f64 / n as f64 },
        "min_reward": min_reward,
        "rows": rows,
        "outcomes": outcomes,
    });
    std::fs::write(out.join("report.json"), serde_json::to_vec_pretty(&report)?)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TASK: &str = r#"{"task_id": "t1", "instruction": "fix it", "workspace": {"dir": {"path": "proj"}}, "harness": {"name": "pi"}, "evaluator": {"kind": "session-completed"}}"#;

    #[test]
    fn flags_fill_every_task_and_a_relative_workspace_is_the_files_neighbour() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tasks.jsonl");
        std::fs::write(&file, format!("{TASK}\n\n")).unwrap();
        let overrides = TaskOverrides {
            harness: Some("qwen-code".into()),
            samples: Some(4),
            evaluator: Some(r#"{"kind": "command", "command": "true"}"#.into()),
        };
        let specs = read_tasks(&file, &overrides).unwrap();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].num_samples, 4);
        let v = serde_json::to_value(&specs[0]).unwrap();
        assert_eq!(v["harness"]["name"], "qwen-code", "{v}");
        assert_eq!(v["evaluator"]["kind"], "command", "{v}");
        let path = dir.path().join("proj").display().to_string();
        assert_eq!(v["workspace"]["dir"]["path"], path.as_str(), "{v}");

        std::fs::write(&file, format!("{TASK}\n{TASK}\n")).unwrap();
        let twice = read_tasks(&file, &TaskOverrides::default()).unwrap_err();
        assert!(
            twice.to_string().contains(":2: task_id t1 appears twice"),
            "{twice}"
        );
        std::fs::write(&file, "\n").unwrap();
        let none = read_tasks(&file, &TaskOverrides::default()).unwrap_err();
        assert!(none.to_string().ends_with("has no tasks"), "{none}");
        let bad = TaskOverrides {
            evaluator: Some("{".into()),
            ..TaskOverrides::default()
        };
        let e = read_tasks(&file, &bad).unwrap_err();
        assert!(e.to_string().contains("--evaluator is not JSON"), "{e}");
    }

    #[test]
    fn no_samples_make_an_empty_dataset_and_a_report_saying_so() {
        let dir = tempfile::tempdir().unwrap();
        let report = write_dataset(dir.path(), &[], 1.0).unwrap();
        assert_eq!(report["samples"], 0);
        assert_eq!(report["acceptance_rate"], 0.0);
        assert_eq!(
            std::fs::read_to_string(dir.path().join("sft.jsonl")).unwrap(),
            ""
        );
        let written: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("report.json")).unwrap())
                .unwrap();
        assert_eq!(written, report);
    }
}
