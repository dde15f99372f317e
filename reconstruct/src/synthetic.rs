//! Synthetic sessions, for benchmarks and tests: records shaped like a long agent session
//! (a growing conversation with subagents and a compaction), with made-up token ids.

use tokentap_schema::*;

/// A bare record of `session` with id `record_id` and seq `n` (ended at `1000 + n` ms),
/// without token data: callers fill in prompt ids, completion ids, logprobs, finish reason.
pub fn record(session: &str, record_id: &str, n: u64) -> CaptureRecord {
    CaptureRecord {
        schema_version: CAPTURE_SCHEMA_VERSION,
        record_id: record_id.to_string(),
        session_id: session.to_string(),
        session_source: SessionSource::Header,
        seq: n,
        started_at_unix_ms: 1_000 + n,
        ended_at_unix_ms: 1_000 + n,
        wire_api: WireApi::ChatCompletions,
        request: HarnessRequest::bare("POST", "/v1/chat/completions"),
        backend_request: None,
        backend_conversation: Default::default(),
        normalizations: vec![],
        backend: BackendInfo {
            kind: BackendKind::Vllm,
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            policy_version: None,
            engine_weight_version: None,
            synthetic_stream: false,
        },
        prompt_token_ids: None,
        completion_token_ids: None,
        logprobs: None,
        token_provenance: TokenProvenance {
            prompt: TokenSource::EngineResponse,
            completion: TokenSource::EngineResponse,
            gaps: vec![],
        },
        finish_reason: None,
        message: None,
        usage: None,
        timings: Timings::default(),
        response_status: 200,
        error: None,
        token_observation: None,
        token_in: None,
    }
}

/// The shape of a synthetic long session.
#[derive(Debug, Clone, Copy)]
pub struct LongSession {
    /// Calls of the main conversation.
    pub calls: usize,
    /// Prompt tokens of the first call …
    pub first_prompt: usize,
    /// … growing linearly to this many in the last.
    pub last_prompt: usize,
    /// Sampled tokens per call (the end-of-turn id included).
    pub sampled: usize,
    /// Every this many main calls, a subagent with a fresh prompt makes `subagent_calls` calls.
    pub subagent_every: usize,
    pub subagent_calls: usize,
    pub subagent_prompt: usize,
}

impl Default for LongSession {
    /// 200 calls growing to a 60k-token prompt, a 3-call subagent every 25 calls.
    fn default() -> Self {
        LongSession {
            calls: 200,
            first_prompt: 20_000,
            last_prompt: 60_000,
            sampled: 120,
            subagent_every: 25,
            subagent_calls: 3,
            subagent_prompt: 8_000,
        }
    }
}

impl LongSession {
    /// The session's records in the order a proxy would write them; ids are deterministic.
    pub fn records(&self, session: &str, seed: u64) -> Vec<CaptureRecord> {
        let mut rng = seed | 1;
        let mut next = move |below: u32| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng % u64::from(below)) as u32
        };
        let mut out = Vec::new();
        let mut n = 0u64;
        let mut call =
            |prompt: &[u32], next: &mut dyn FnMut(u32) -> u32, out: &mut Vec<CaptureRecord>| {
                let mut r = record(session, &format!("{session}-{n:06}"), n);
                n += 1;
                let mut answer: Vec<u32> = (1..self.sampled).map(|_| 100 + next(40_000)).collect();
                answer.push(2);
                r.logprobs = Some(
                    answer
                        .iter()
                        .map(|_| -(next(1000) as f32) / 100.0)
                        .collect(),
                );
                r.prompt_token_ids = Some(prompt.to_vec());
                r.completion_token_ids = Some(answer.clone());
                r.finish_reason = Some(FinishReason::ToolCalls);
                out.push(r);
                answer
            };
        let grow = (self.last_prompt.saturating_sub(self.first_prompt)) / self.calls.max(1);
        let mut prompt: Vec<u32> = (0..self.first_prompt).map(|_| 100 + next(40_000)).collect();
        for i in 0..self.calls {
            let answer = call(&prompt, &mut next, &mut out);
            if self.subagent_every > 0 && i % self.subagent_every == self.subagent_every - 1 {
                let mut sub: Vec<u32> = vec![50_000 + i as u32];
                sub.extend((1..self.subagent_prompt).map(|_| 100 + next(40_000)));
                for _ in 0..self.subagent_calls {
                    let a = call(&sub, &mut next, &mut out);
                    sub.extend(a);
                    sub.extend((0..40).map(|_| 100 + next(40_000)));
                }
            }
            prompt.extend(answer);
            let glue = grow.saturating_sub(self.sampled).max(1);
            prompt.extend((0..glue).map(|_| 100 + next(40_000)));
        }
        out
    }
}
