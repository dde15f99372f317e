//! What the spool's test binaries share: a record to write, and reading a spool back.

// Each test binary compiles this module and uses part of it.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;

use tokentap_schema::{
    BackendInfo, BackendKind, CaptureRecord, HarnessRequest, SessionSource, Timings,
    TokenProvenance, TokenSource, WireApi, CAPTURE_SCHEMA_VERSION,
};
use tokentap_spool::{SpoolItem, SpoolReader};

/// A minimal valid record; `payload` bytes of body text make its line longer.
pub fn record(i: u64, payload: usize) -> CaptureRecord {
    CaptureRecord {
        schema_version: CAPTURE_SCHEMA_VERSION,
        record_id: format!("0190aaaa-0000-7000-8000-{i:012x}"),
        session_id: "session-1".into(),
        session_source: SessionSource::Header,
        seq: i,
        started_at_unix_ms: 1_700_000_000_000 + i,
        ended_at_unix_ms: 1_700_000_000_100 + i,
        wire_api: WireApi::ChatCompletions,
        request: HarnessRequest {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            query: None,
            headers: BTreeMap::from([("content-type".into(), "application/json".into())]),
            body_bytes: payload as u64,
            body: None,
            body_text: Some("x".repeat(payload)),
        },
        backend_request: None,
        backend_conversation: Default::default(),
        normalizations: Vec::new(),
        backend: BackendInfo {
            kind: BackendKind::Vllm,
            url: "http://127.0.0.1:8000".into(),
            model: "test-model".into(),
            policy_version: None,
            engine_weight_version: None,
            synthetic_stream: false,
        },
        prompt_token_ids: Some(vec![1, 2, 3]),
        completion_token_ids: Some(vec![4, 5]),
        logprobs: None,
        token_provenance: TokenProvenance {
            prompt: TokenSource::EngineResponse,
            completion: TokenSource::EngineResponse,
            gaps: Vec::new(),
        },
        finish_reason: None,
        message: None,
        usage: None,
        timings: Timings {
            time_to_first_token_ms: None,
            total_ms: 12.5,
            backend_ms: 12.0,
            proxy_overhead_ms: 0.5,
        },
        response_status: 200,
        error: None,
        token_observation: None,
        token_in: None,
    }
}

pub fn read_all(dir: &Path) -> Vec<SpoolItem> {
    SpoolReader::open(dir)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

pub fn records_of(items: &[SpoolItem]) -> Vec<CaptureRecord> {
    items
        .iter()
        .filter_map(|i| match i {
            SpoolItem::Record(e) => Some(e.record.clone()),
            _ => None,
        })
        .collect()
}
