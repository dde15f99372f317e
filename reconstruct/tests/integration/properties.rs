//! Property tests over random multi-turn sessions: append-only turns, subagents, compaction,
//! retries, duplicates, re-rendered turns, calls that never reached the engine, engines that
//! do not report the end-of-turn id, and redelivered records.

use super::common;

use common::*;
use proptest::prelude::{any, prop, prop_assert_eq, proptest, ProptestConfig};
use tokentap_reconstruct::{build_all, verify, Reconstructor};
use tokentap_schema::Strategy as TraceStrategy;

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
