//! Prefix merge under the arrival orders a worker can see: records in any order, redelivered
//! copies, several sessions (or concurrent agents of one session) interleaved, and the
//! streaming reconstructor finishing sessions at arbitrary points.
//!
//! What the design promises, and so what is asserted here:
//! - Records are merged **in arrival order** (`SessionBuilder` and `Reconstructor` document
//!   "fed in spool order"); nothing sorts by `seq`. The order guarantee comes from the spool
//!   (one writer per proxy, records appended as calls end) and the shipper (the worker's spool
//!   keeps the proxy's order). So an arbitrary permutation of a session's records does *not*
//!   give the in-order traces; what it does keep is faithfulness and completeness (every
//!   record with token data in exactly one trace, every sampled token trainable exactly once),
//!   and re-sorting by `seq` restores the in-order traces exactly.
//! - Concurrent chains of one session (a main conversation and its subagents) may interleave
//!   in any order that keeps each chain's own calls in order: the traces are the same, up to
//!   their indices.
//! - Redelivered copies (same `record_id`) never change the traces of an open session.
//! - Finishing a session (idle or told) cuts it: later records start a new builder that
//!   continues the trace numbering. The streaming result is exactly the batch result of the
//!   segments between finishes; with no finish inside a session it is the batch result.

use super::common;

use std::collections::{BTreeMap, HashMap, VecDeque};

use common::*;
use proptest::prelude::{any, prop, prop_assert, prop_assert_eq, proptest, ProptestConfig};
use tokentap_reconstruct::{build_all, verify, Reconstructor, SessionBuilder};
use tokentap_schema::{CaptureRecord, Strategy as TraceStrategy, Trace};

/// A deterministic generator for shuffles and interleavings (the case's seed is shrunk by
/// proptest; the stream it drives needs no shrinking of its own).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}

fn shuffled(records: &[CaptureRecord], seed: u64) -> Vec<CaptureRecord> {
    let mut out = records.to_vec();
    let mut rng = Lcg(seed);
    for i in (1..out.len()).rev() {
        out.swap(i, rng.below(i + 1));
    }
    out
}

/// A random interleaving of `queues` that keeps each queue's own order.
fn interleave(queues: Vec<Vec<CaptureRecord>>, seed: u64) -> Vec<CaptureRecord> {
    let mut queues: Vec<VecDeque<CaptureRecord>> = queues.into_iter().map(Into::into).collect();
    let mut rng = Lcg(seed);
    let mut out = Vec::new();
    while queues.iter().any(|q| !q.is_empty()) {
        let live: Vec<usize> = (0..queues.len())
            .filter(|&i| !queues[i].is_empty())
            .collect();
        let i = live[rng.below(live.len())];
        out.push(queues[i].pop_front().unwrap());
    }
    out
}

/// A trace's content without its position in the session (index, id, split cause).
type Content = (Vec<u32>, Vec<u32>, Vec<u8>, Vec<u32>, Vec<String>);

fn content(t: &Trace) -> Content {
    (
        t.prompt_ids.clone(),
        t.response_ids.clone(),
        t.loss_mask.clone(),
        t.logprobs.iter().map(|l| l.to_bits()).collect(),
        t.calls.iter().map(|c| c.record_id.clone()).collect(),
    )
}

fn contents<'a>(traces: impl IntoIterator<Item = &'a Trace>) -> Vec<Content> {
    let mut v: Vec<Content> = traces.into_iter().map(content).collect();
    v.sort();
    v
}

/// Faithful, complete, and numbered 0.. without holes, whatever the arrival order was.
fn assert_faithful_and_complete(
    traces: &[Trace],
    records: &[CaptureRecord],
) -> Result<(), proptest::test_runner::TestCaseError> {
    let digests = digests(records);
    let f = verify(traces, &digests);
    prop_assert_eq!(f.violations, 0, "{:?}", f.examples);
    let mut in_traces: Vec<&str> = traces
        .iter()
        .flat_map(|t| t.calls.iter().map(|c| c.record_id.as_str()))
        .collect();
    in_traces.sort();
    let mut with_tokens: Vec<&str> = records
        .iter()
        .filter(|r| r.prompt_token_ids.is_some())
        .map(|r| r.record_id.as_str())
        .collect();
    with_tokens.sort();
    with_tokens.dedup();
    prop_assert_eq!(&in_traces, &with_tokens);
    let sampled: u64 = with_tokens
        .iter()
        .map(|id| digests[*id].completion_len() as u64)
        .sum();
    prop_assert_eq!(f.trainable_tokens, sampled);
    let indices: Vec<u32> = traces.iter().map(|t| t.index).collect();
    prop_assert_eq!(indices, (0..traces.len() as u32).collect::<Vec<_>>());
    Ok(())
}

/// Makes every copy of a record identical to its first. A redelivered record is the same
/// bytes, but the simulation's `Retry { cut_short }` right after a `Redeliver` marks the copy
/// (the last record) as aborted, leaving two different records under one id; in spool order
/// the copy is ignored, so this only matters once the order is shuffled.
fn same_copies(records: &mut [CaptureRecord]) {
    let mut first: HashMap<String, CaptureRecord> = HashMap::new();
    for r in records.iter_mut() {
        match first.get(&r.record_id) {
            Some(f) => *r = f.clone(),
            None => {
                first.insert(r.record_id.clone(), r.clone());
            }
        }
    }
}

/// `sims` as independent agents of one session `s`: each agent's prompts get a first token of
/// their own (every prompt of a simulated session starts with its chain's first token, 1 or a
/// fresh 60_000+k, so shifting it keeps the agent's structure and separates the agents).
fn agents_of_one_session(steps: &[Vec<Step>], seed: u64) -> Vec<Vec<CaptureRecord>> {
    steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut sim = simulate_session(&format!("agent{i}"), s, seed + i as u64, false);
            for r in &mut sim.records {
                r.session_id = "s".into();
                if let Some(p) = r.prompt_token_ids.as_mut() {
                    p[0] += 100_000 * (i as u32 + 1);
                }
            }
            sim.records
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// (a) Any arrival order: faithful and complete; and ordering by `seq` (what the spool
    /// order is) gives back exactly the in-order traces.
    #[test]
    fn any_arrival_order_is_faithful_and_complete(
        steps in prop::collection::vec(step(), 0..25),
        seed in any::<u64>(),
        order in any::<u64>(),
        drops_eot in any::<bool>(),
    ) {
        let mut sim = simulate(&steps, seed, drops_eot);
        same_copies(&mut sim.records);
        let in_order = &build_all(&sim.records, TraceStrategy::PrefixMerge)[0];
        let mut arrived = shuffled(&sim.records, order);
        let s = &build_all(&arrived, TraceStrategy::PrefixMerge)[0];
        assert_faithful_and_complete(&s.traces, &sim.records)?;
        let redelivered = steps.iter().filter(|s| matches!(s, Step::Redeliver)).count();
        prop_assert_eq!(s.stats.duplicate_records as usize, redelivered);

        arrived.sort_by_key(|r| r.seq);
        let resorted = &build_all(&arrived, TraceStrategy::PrefixMerge)[0];
        prop_assert_eq!(&resorted.traces, &in_order.traces);
    }

    /// (a') Concurrent agents of one session interleaved in any order that keeps each agent's
    /// calls in order: the same traces as each agent alone, up to indices.
    #[test]
    fn concurrent_chains_interleave_freely(
        steps in prop::collection::vec(prop::collection::vec(step(), 0..12), 1..4),
        seed in any::<u64>(),
        order in any::<u64>(),
    ) {
        let agents = agents_of_one_session(&steps, seed);
        let alone: Vec<Content> = contents(agents.iter().flat_map(|records| {
            build_all(records, TraceStrategy::PrefixMerge).remove(0).traces
        }).collect::<Vec<_>>().iter());
        let all: Vec<CaptureRecord> = agents.iter().flatten().cloned().collect();
        let together = build_all(&interleave(agents, order), TraceStrategy::PrefixMerge);
        prop_assert_eq!(together.len(), 1);
        prop_assert_eq!(contents(&together[0].traces), alone);
        assert_faithful_and_complete(&together[0].traces, &all)?;
    }

    /// (b) Redelivered copies, anywhere after their original, never change the traces (batch
    /// and streaming), and are counted.
    #[test]
    fn redelivery_never_changes_traces(
        steps in prop::collection::vec(step(), 0..25),
        seed in any::<u64>(),
        copies in prop::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>()), 0..8),
    ) {
        let sim = simulate(&steps, seed, false);
        let before = &build_all(&sim.records, TraceStrategy::PrefixMerge)[0];
        let mut records = sim.records.clone();
        for (which, at) in &copies {
            let i = which.index(records.len());
            let copy = records[i].clone();
            // A redelivery comes after the original: somewhere in (i, len].
            let pos = i + 1 + at.index(records.len() - i);
            records.insert(pos, copy);
        }
        let after = &build_all(&records, TraceStrategy::PrefixMerge)[0];
        prop_assert_eq!(&after.traces, &before.traces);
        prop_assert_eq!(
            after.stats.duplicate_records,
            before.stats.duplicate_records + copies.len() as u32
        );
        let mut r = Reconstructor::new(TraceStrategy::PrefixMerge);
        for rec in &records {
            r.push(rec);
        }
        let streamed = r.finish_all();
        prop_assert_eq!(&streamed[0].traces, &before.traces);
    }

    /// (c) Interleaved sessions never mix: each session's traces are those it makes alone,
    /// and every call of a trace is a record of that trace's session.
    #[test]
    fn interleaved_sessions_never_mix(
        steps in prop::collection::vec(prop::collection::vec(step(), 0..12), 1..5),
        seed in any::<u64>(),
        order in any::<u64>(),
    ) {
        let sims: Vec<Sim> = steps.iter().enumerate()
            .map(|(i, s)| simulate_session(&format!("session-{i}"), s, seed, false))
            .collect();
        let alone: BTreeMap<String, Vec<Trace>> = sims.iter()
            .map(|s| (s.session.clone(), build_all(&s.records, TraceStrategy::PrefixMerge).remove(0).traces))
            .collect();
        let owner: HashMap<&str, &str> = sims.iter()
            .flat_map(|s| s.records.iter().map(|r| (r.record_id.as_str(), s.session.as_str())))
            .collect();
        let mixed = interleave(sims.iter().map(|s| s.records.clone()).collect(), order);

        let batch = build_all(&mixed, TraceStrategy::PrefixMerge);
        let mut r = Reconstructor::new(TraceStrategy::PrefixMerge);
        for rec in &mixed {
            r.push(rec);
        }
        let streamed = r.finish_all();
        prop_assert_eq!(batch.len(), sims.len());
        prop_assert_eq!(streamed.len(), sims.len());
        for s in &batch {
            prop_assert_eq!(&s.traces, &alone[&s.session_id]);
        }
        for s in &streamed {
            prop_assert_eq!(&s.traces, &alone[&s.report.session_id]);
            for t in &s.traces {
                prop_assert_eq!(&t.session_id, &s.report.session_id);
                let prefix = format!("{}/", t.session_id);
                prop_assert!(t.trace_id.starts_with(&prefix), "{}", t.trace_id);
                for c in &t.calls {
                    prop_assert_eq!(owner[c.record_id.as_str()], t.session_id.as_str());
                }
            }
        }
    }

    /// (d) The streaming reconstructor, fed any arrival order with sessions finished at random
    /// points, gives exactly the batch traces of each session's segments between finishes
    /// (numbered on across them); with no finish inside a session, the batch result. Trace
    /// ids stay unique, and the traces stay faithful.
    #[test]
    fn streaming_with_random_finishes_is_batch_per_segment(
        steps in prop::collection::vec(prop::collection::vec(step(), 0..12), 1..4),
        seed in any::<u64>(),
        order in any::<u64>(),
        shuffle_all in any::<bool>(),
        flushes in prop::collection::vec((any::<prop::sample::Index>(), 0u8..3, any::<prop::sample::Index>()), 0..6),
    ) {
        let sims: Vec<Sim> = steps.iter().enumerate()
            .map(|(i, s)| simulate_session(&format!("session-{i}"), s, seed, false))
            .collect();
        let mut records = interleave(sims.iter().map(|s| s.records.clone()).collect(), order);
        if shuffle_all {
            records = shuffled(&records, order);
        }
        let sessions: Vec<String> = sims.iter().map(|s| s.session.clone()).collect();
        // flush_at[k]: after the k-th record, finish these sessions (None: finish_all).
        let mut flush_at: BTreeMap<usize, Vec<Option<String>>> = BTreeMap::new();
        for (at, kind, which) in &flushes {
            let k = at.index(records.len() + 1);
            let what = match kind {
                0 => None,
                _ => Some(sessions[which.index(sessions.len())].clone()),
            };
            flush_at.entry(k).or_default().push(what);
        }

        // The model: per session, segments of its arrival order cut where it was finished
        // while open, each built alone and numbered on from the last.
        let mut segments: BTreeMap<String, Vec<Vec<CaptureRecord>>> = BTreeMap::new();
        let mut open: HashMap<String, bool> = HashMap::new();
        let cut = |segments: &mut BTreeMap<String, Vec<Vec<CaptureRecord>>>, open: &mut HashMap<String, bool>, s: &str| {
            if open.insert(s.to_owned(), false) == Some(true) {
                segments.get_mut(s).unwrap().push(Vec::new());
            }
        };
        for k in 0..=records.len() {
            for f in flush_at.get(&k).into_iter().flatten() {
                match f {
                    None => for s in &sessions { cut(&mut segments, &mut open, s) },
                    Some(s) => cut(&mut segments, &mut open, s),
                }
            }
            if let Some(r) = records.get(k) {
                let segs = segments.entry(r.session_id.clone()).or_insert_with(|| vec![Vec::new()]);
                segs.last_mut().unwrap().push(r.clone());
                open.insert(r.session_id.clone(), true);
            }
        }
        let mut expected: BTreeMap<String, Vec<Trace>> = BTreeMap::new();
        for (s, segs) in &segments {
            let mut next = 0;
            let out = expected.entry(s.clone()).or_default();
            for seg in segs.iter().filter(|seg| !seg.is_empty()) {
                let mut b = SessionBuilder::continuing(s, TraceStrategy::PrefixMerge, next);
                for r in seg {
                    b.push(r);
                }
                let traces = b.finish().traces;
                if let Some(last) = traces.iter().map(|t| t.index).max() {
                    next = last + 1;
                }
                out.extend(traces);
            }
        }

        let mut r = Reconstructor::new(TraceStrategy::PrefixMerge);
        let mut got: BTreeMap<String, Vec<Trace>> = BTreeMap::new();
        let mut keep = |done: Vec<tokentap_reconstruct::FinishedSession>| {
            for f in done {
                got.entry(f.report.session_id.clone()).or_default().extend(f.traces);
            }
        };
        for k in 0..=records.len() {
            for f in flush_at.get(&k).into_iter().flatten() {
                match f {
                    None => keep(r.finish_all()),
                    Some(s) => keep(r.finish(s).into_iter().collect()),
                }
            }
            if let Some(rec) = records.get(k) {
                r.push(rec);
            }
        }
        keep(r.finish_all());
        prop_assert_eq!(&got, &expected);

        // No finish inside any session's span and arrival in spool order: the batch result.
        if flush_at.keys().all(|&k| k == 0 || k == records.len()) {
            for s in build_all(&records, TraceStrategy::PrefixMerge) {
                prop_assert_eq!(&got[&s.session_id], &s.traces);
            }
        }
        let all: Vec<&Trace> = got.values().flatten().collect();
        let mut ids: Vec<&str> = all.iter().map(|t| t.trace_id.as_str()).collect();
        ids.sort();
        let n = ids.len();
        ids.dedup();
        prop_assert_eq!(ids.len(), n, "a trace id was made twice");
        let owned: Vec<Trace> = all.into_iter().cloned().collect();
        let f = verify(&owned, &digests(&records));
        prop_assert_eq!(f.violations, 0, "{:?}", f.examples);
    }
}
