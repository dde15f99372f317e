//! Property tests over random multi-turn sessions: append-only turns, subagents, compaction,
//! retries, duplicates, re-rendered turns, calls that never reached the engine, engines that
//! do not report the end-of-turn id, and redelivered records.

use std::collections::HashMap;

use proptest::prelude::{
    any, prop, prop_assert_eq, prop_oneof, proptest, Just, ProptestConfig, Strategy,
};
use tokentap_reconstruct::{build_all, verify, Reconstructor, RecordDigest};
use tokentap_schema::Strategy as TraceStrategy;
use tokentap_schema::*;

/// What the simulated harness does next.
#[derive(Debug, Clone)]
enum Step {
    /// Continue the conversation: the answer, then `glue` tokens (tool result, user turn).
    Continue { glue: Vec<u32> },
    /// Continue, but the template renders the last answer differently.
    Rerender { glue: Vec<u32> },
    /// Send the same prompt again (after a cut-short answer, or a duplicate).
    Retry { cut_short: bool },
    /// A subagent with its own fresh prompt makes `calls` calls, interleaved with nothing.
    Subagent { calls: usize },
    /// Compaction: the conversation restarts from a short summary.
    Compact,
    /// A call that failed before the engine saw it (no token data).
    Failed,
    /// The proxy redelivers the last record.
    Redeliver,
}

fn step() -> impl Strategy<Value = Step> {
    let glue = prop::collection::vec(0u32..50_000, 0..6);
    prop_oneof![
        6 => glue.clone().prop_map(|glue| Step::Continue { glue }),
        1 => glue.prop_map(|glue| Step::Rerender { glue }),
        1 => any::<bool>().prop_map(|cut_short| Step::Retry { cut_short }),
        1 => (1usize..4).prop_map(|calls| Step::Subagent { calls }),
        1 => Just(Step::Compact),
        1 => Just(Step::Failed),
        1 => Just(Step::Redeliver),
    ]
}

/// The simulated proxy: turns steps into records, counting the traces prefix merge must make.
struct Sim {
    session: String,
    records: Vec<CaptureRecord>,
    next_id: u64,
    rng: u64,
    /// Engines like llama.cpp do not report the end-of-turn id of streamed answers.
    drops_eot: bool,
    expected_traces: usize,
    /// Unique first tokens for fresh prefixes (subagents, compaction summaries).
    next_fresh: u32,
}

const EOT: u32 = 2;

impl Sim {
    fn rand(&mut self, below: u32) -> u32 {
        // xorshift: deterministic per case, no proptest shrinking needed for token values.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % u64::from(below)) as u32
    }

    /// One call with `prompt`; returns the full answer as it reappears in the next prompt.
    fn call(&mut self, prompt: &[u32], finish: FinishReason) -> Vec<u32> {
        let n = 1 + self.rand(6) as usize;
        let mut answer: Vec<u32> = (0..n).map(|_| 100 + self.rand(40_000)).collect();
        answer.push(EOT);
        let reported: Vec<u32> = if self.drops_eot {
            answer[..n].to_vec()
        } else {
            answer.clone()
        };
        let logprobs: Vec<f32> = reported
            .iter()
            .map(|_| -(self.rand(1000) as f32) / 100.0)
            .collect();
        self.push(
            Some(prompt.to_vec()),
            Some(reported),
            Some(logprobs),
            finish,
        );
        answer
    }

    fn push(
        &mut self,
        prompt: Option<Vec<u32>>,
        completion: Option<Vec<u32>>,
        logprobs: Option<Vec<f32>>,
        finish: FinishReason,
    ) {
        self.next_id += 1;
        let mut r = record(&self.session, self.next_id);
        r.prompt_token_ids = prompt;
        r.completion_token_ids = completion;
        r.logprobs = logprobs;
        r.finish_reason = Some(finish);
        self.records.push(r);
    }

    fn fresh_prompt(&mut self) -> Vec<u32> {
        self.next_fresh += 1;
        let mut p = vec![self.next_fresh];
        p.extend((0..3 + self.rand(5)).map(|_| 100 + self.rand(40_000)));
        p
    }

    /// Runs the session; `prompt` is the main conversation's next prompt.
    fn run(&mut self, steps: &[Step]) {
        let mut prompt = vec![1u32, 7, 7, 7];
        self.expected_traces = 1;
        let mut answer = self.call(&prompt, FinishReason::ToolCalls);
        for s in steps {
            match s {
                Step::Continue { glue } => {
                    prompt.extend_from_slice(&answer);
                    prompt.extend_from_slice(glue);
                    answer = self.call(&prompt, FinishReason::ToolCalls);
                }
                Step::Rerender { glue } => {
                    prompt.push(answer[0] + 1);
                    prompt.extend_from_slice(&answer[1..]);
                    prompt.extend_from_slice(glue);
                    self.expected_traces += 1;
                    answer = self.call(&prompt, FinishReason::Stop);
                }
                Step::Retry { cut_short } => {
                    // The last call's answer is replaced; it becomes a trace of its own.
                    if *cut_short {
                        self.records.last_mut().unwrap().finish_reason = Some(FinishReason::Abort);
                    }
                    self.expected_traces += 1;
                    answer = self.call(&prompt, FinishReason::Stop);
                }
                Step::Subagent { calls } => {
                    let mut sub = self.fresh_prompt();
                    self.expected_traces += 1;
                    let mut sub_answer = self.call(&sub, FinishReason::ToolCalls);
                    for _ in 1..*calls {
                        sub.extend_from_slice(&sub_answer);
                        sub.push(9);
                        sub_answer = self.call(&sub, FinishReason::Stop);
                    }
                }
                Step::Compact => {
                    prompt = self.fresh_prompt();
                    self.expected_traces += 1;
                    answer = self.call(&prompt, FinishReason::Stop);
                }
                Step::Failed => self.push(None, None, None, FinishReason::Abort),
                Step::Redeliver => {
                    let again = self.records.last().unwrap().clone();
                    self.records.push(again);
                }
            }
        }
    }
}

fn record(session: &str, n: u64) -> CaptureRecord {
    CaptureRecord {
        schema_version: CAPTURE_SCHEMA_VERSION,
        record_id: format!("rec-{n:06}"),
        session_id: session.to_string(),
        session_source: SessionSource::Header,
        seq: n,
        started_at_unix_ms: 1_000 + n,
        ended_at_unix_ms: 1_000 + n,
        wire_api: WireApi::ChatCompletions,
        request: HarnessRequest {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            query: None,
            headers: Default::default(),
            body_bytes: 0,
            body: None,
            body_text: None,
        },
        backend_request: None,
        normalizations: vec![],
        backend: BackendInfo {
            kind: BackendKind::Vllm,
            url: "http://127.0.0.1:1".into(),
            model: "m".into(),
            policy_version: None,
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
    }
}

fn simulate(steps: &[Step], seed: u64, drops_eot: bool) -> Sim {
    let mut sim = Sim {
        session: "s".into(),
        records: Vec::new(),
        next_id: 0,
        rng: seed | 1,
        drops_eot,
        expected_traces: 0,
        next_fresh: 60_000,
    };
    sim.run(steps);
    sim
}

fn digests(records: &[CaptureRecord]) -> HashMap<String, RecordDigest> {
    records
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Mask-1 tokens are exactly the sampled ids with their logprobs; every record with token
    /// data is in exactly one trace; splits happen exactly where the session forked.
    #[test]
    fn traces_are_faithful_and_complete(
        steps in prop::collection::vec(step(), 0..30),
        seed in any::<u64>(),
        drops_eot in any::<bool>(),
    ) {
        let sim = simulate(&steps, seed, drops_eot);
        let digests = digests(&sim.records);
        for strategy in [TraceStrategy::PrefixMerge, TraceStrategy::PerRequest] {
            let sessions = build_all(&sim.records, strategy);
            prop_assert_eq!(sessions.len(), 1);
            let s = &sessions[0];
            let f = verify(&s.traces, &digests);
            prop_assert_eq!(f.violations, 0, "{:?}", f.examples);

            // Every record with prompt ids appears in exactly one trace, once.
            let mut in_traces: Vec<&str> = s.traces.iter()
                .flat_map(|t| t.calls.iter().map(|c| c.record_id.as_str())).collect();
            in_traces.sort();
            let mut with_tokens: Vec<&str> = sim.records.iter()
                .filter(|r| r.prompt_token_ids.is_some())
                .map(|r| r.record_id.as_str()).collect();
            with_tokens.sort();
            with_tokens.dedup();
            prop_assert_eq!(&in_traces, &with_tokens);

            // All sampled tokens are trainable, exactly once.
            let sampled: u64 = with_tokens.iter()
                .map(|id| digests[*id].completion_len() as u64).sum();
            prop_assert_eq!(f.trainable_tokens, sampled);

            let redelivered = steps.iter().filter(|s| matches!(s, Step::Redeliver)).count();
            prop_assert_eq!(s.stats.duplicate_records as usize, redelivered);
            match strategy {
                TraceStrategy::PrefixMerge => prop_assert_eq!(s.traces.len(), sim.expected_traces),
                TraceStrategy::PerRequest => prop_assert_eq!(s.traces.len(), with_tokens.len()),
            }
        }
    }

    /// An append-only conversation is one trace: its last prompt plus its last answer.
    #[test]
    fn append_only_chain_is_last_prompt_plus_last_answer(
        glues in prop::collection::vec(prop::collection::vec(0u32..50_000, 0..6), 0..20),
        seed in any::<u64>(),
        drops_eot in any::<bool>(),
    ) {
        let steps: Vec<Step> = glues.into_iter().map(|glue| Step::Continue { glue }).collect();
        let sim = simulate(&steps, seed, drops_eot);
        let sessions = build_all(&sim.records, TraceStrategy::PrefixMerge);
        let t = &sessions[0].traces;
        prop_assert_eq!(t.len(), 1);
        let last = sim.records.last().unwrap();
        let mut whole = t[0].prompt_ids.clone();
        whole.extend_from_slice(&t[0].response_ids);
        let mut expected = last.prompt_token_ids.clone().unwrap();
        expected.extend_from_slice(last.completion_token_ids.as_deref().unwrap());
        prop_assert_eq!(whole, expected);
        prop_assert_eq!(sessions[0].stats.merged_calls as usize, steps.len());
    }

    /// Feeding records one by one through the streaming reconstructor, finishing sessions
    /// when idle, gives the same traces as building each session at once.
    #[test]
    fn streaming_equals_batch(
        steps in prop::collection::vec(step(), 0..20),
        seed in any::<u64>(),
    ) {
        let sim = simulate(&steps, seed, false);
        let batch = build_all(&sim.records, TraceStrategy::PrefixMerge);
        let mut r = Reconstructor::new(TraceStrategy::PrefixMerge);
        for rec in &sim.records {
            r.push(rec);
        }
        let streamed = r.finish_all();
        prop_assert_eq!(streamed.len(), 1);
        prop_assert_eq!(&streamed[0].traces, &batch[0].traces);
        prop_assert_eq!(streamed[0].report.faithfulness.violations, 0);
    }
}

/// A session spanning two policy versions is flagged, on the session and on the trace.
#[test]
fn policy_version_change_is_flagged() {
    let steps: Vec<Step> = (0..3).map(|_| Step::Continue { glue: vec![5] }).collect();
    let mut sim = simulate(&steps, 42, false);
    for (i, r) in sim.records.iter_mut().enumerate() {
        r.backend.policy_version = Some(if i < 2 { "v1" } else { "v2" }.into());
    }
    let s = &build_all(&sim.records, TraceStrategy::PrefixMerge)[0];
    assert!(s.stats.spans_policy_versions);
    assert!(s.traces[0].spans_policy_versions);
}

/// Sampled ids without logprobs are never trained on: masked, and the gap named.
#[test]
fn tokens_without_logprobs_are_masked_with_a_gap() {
    let steps = vec![Step::Continue { glue: vec![5, 6] }];
    let mut sim = simulate(&steps, 7, false);
    sim.records[0].logprobs = None;
    let s = &build_all(&sim.records, TraceStrategy::PrefixMerge)[0];
    let t = &s.traces[0];
    assert!(!t.calls[0].trainable);
    assert_eq!(t.loss_mask[0], 0);
    assert!(t
        .gaps
        .iter()
        .any(|g| g.contains("without aligned logprobs")));
    assert_eq!(s.stats.calls_with_token_gaps, 1);
    let f = verify(&s.traces, &digests(&sim.records));
    assert_eq!(f.violations, 0, "{:?}", f.examples);
}

/// The check is not vacuous: a flipped token, a flipped logprob or a stray mask bit is caught.
#[test]
fn verify_catches_tampering() {
    let steps: Vec<Step> = (0..2).map(|_| Step::Continue { glue: vec![5] }).collect();
    let sim = simulate(&steps, 3, false);
    let d = digests(&sim.records);
    let good = build_all(&sim.records, TraceStrategy::PrefixMerge)[0]
        .traces
        .clone();
    assert_eq!(verify(&good, &d).violations, 0);

    let mut t = good.clone();
    t[0].response_ids[0] += 1;
    assert!(verify(&t, &d).violations > 0, "a changed sampled token");
    let mut t = good.clone();
    t[0].logprobs[0] -= 0.5;
    assert!(verify(&t, &d).violations > 0, "a changed logprob");
    let mut t = good.clone();
    let glue = t[0].loss_mask.iter().position(|&m| m == 0).unwrap();
    t[0].loss_mask[glue] = 1;
    assert!(verify(&t, &d).violations > 0, "mask 1 on context");
    let mut t = good.clone();
    t[0].prompt_ids[1] += 1;
    assert!(verify(&t, &d).violations > 0, "a changed context");
}
