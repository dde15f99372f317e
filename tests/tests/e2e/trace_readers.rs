//! Trainer-side readers take tokentap's trace files with no custom code: pandas reads the
//! JSONL and the Parquet parts, Hugging Face `datasets` loads the Parquet parts, and the values
//! they see are the ones tokentap wrote (ids, mask, logprobs as float32).

use std::process::Command;

use serde_json::Value;
use tokentap_e2e::artefacts::Artefacts;
use tokentap_e2e::tokentap::tokentap_cli;
use tokentap_reconstruct::output::read_traces_jsonl;
use tokentap_reconstruct::synthetic::LongSession;
use tokentap_spool::{SpoolConfig, SpoolWriter};

const READER: &str = r#"
import json, sys
import pandas as pd
import datasets
out = sys.argv[1]
jl = pd.read_json(out + "/traces.jsonl", lines=True, dtype=False)
pq = pd.read_parquet(out + "/parquet")
ds = datasets.load_dataset("parquet", data_files=out + "/parquet/*.parquet", split="train")
row = ds.sort("trace_id")[0]
print(json.dumps({
    "jsonl_rows": len(jl), "parquet_rows": len(pq), "dataset_rows": len(ds),
    "columns": sorted(pq.columns),
    "trace_id": row["trace_id"],
    "response_ids": row["response_ids"], "loss_mask": row["loss_mask"],
    "logprobs": row["logprobs"], "prompt_len": len(row["prompt_ids"]),
    "jsonl_trace_ids": sorted(jl["trace_id"]),
}))
"#;

#[tokio::test(flavor = "multi_thread")]
async fn heavy_pandas_and_hf_datasets_read_the_traces() {
    let python = Artefacts::require_python();
    let dir = tempfile::tempdir().unwrap();
    let (spool, out) = (dir.path().join("spool"), dir.path().join("out"));
    let shape = LongSession {
        calls: 12,
        first_prompt: 300,
        last_prompt: 900,
        sampled: 8,
        subagent_every: 5,
        subagent_calls: 2,
        subagent_prompt: 50,
    };
    let mut w = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
    w.append_batch(&shape.records("s-a", 1)).unwrap();
    w.append_batch(&shape.records("s-b", 2)).unwrap();
    w.sync().unwrap();
    drop(w);
    let (s, o) = (spool.to_str().unwrap(), out.to_str().unwrap());
    let cli = tokentap_cli(&["reconstruct", "--spool", s, "--out", o]).await;
    assert!(cli.success, "{}", cli.stderr);
    let mut traces = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
    traces.sort_by(|a, b| a.trace_id.cmp(&b.trace_id));
    assert_eq!(
        traces.len(),
        2 * (1 + 2),
        "per session: the conversation and two subagents"
    );

    let cache = dir.path().join("hf-cache");
    let result = Command::new(&python)
        .args(["-c", READER, o])
        // Local files only: never reach the Hub.
        .env("HF_HOME", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        result.status.success(),
        "python readers failed: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    let seen: Value = serde_json::from_slice(&result.stdout).unwrap();
    for k in ["jsonl_rows", "parquet_rows", "dataset_rows"] {
        assert_eq!(seen[k], traces.len(), "{k}");
    }
    let want: Vec<&str> = traces.iter().map(|t| t.trace_id.as_str()).collect();
    assert_eq!(seen["jsonl_trace_ids"], serde_json::json!(want));
    for col in [
        "trace_id",
        "session_id",
        "prompt_ids",
        "response_ids",
        "loss_mask",
        "logprobs",
        "calls",
        "started_by",
        "reward",
        "gaps",
    ] {
        assert!(
            seen["columns"].as_array().unwrap().iter().any(|c| c == col),
            "column {col} missing: {}",
            seen["columns"]
        );
    }
    let t = &traces[0];
    assert_eq!(seen["trace_id"], t.trace_id);
    assert_eq!(seen["prompt_len"], t.prompt_ids.len());
    assert_eq!(seen["response_ids"], serde_json::json!(t.response_ids));
    assert_eq!(seen["loss_mask"], serde_json::json!(t.loss_mask));
    // float32 in Parquet: Python sees the same value, widened to a double.
    let lp: Vec<f32> = seen["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(lp, t.logprobs);
}
