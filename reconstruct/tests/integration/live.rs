//! Live reconstruction across crashes: records are appended to a real spool in bursts while a
//! `LiveReconstructor` follows it; at random points the reconstructor is dropped (a crash,
//! with or without a checkpoint first) and reopened. The output must be what one
//! uninterrupted batch run produces: no trace lost, none written twice, Parquet = JSONL.

use super::common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use common::*;
use proptest::prelude::{any, prop, prop_assert, prop_assert_eq, proptest, ProptestConfig};
use tokentap_reconstruct::output::{read_traces_jsonl, read_traces_parquet, PARQUET_DIR};
use tokentap_reconstruct::{build_all, verify, LiveOptions, LiveReconstructor};
use tokentap_schema::{CaptureRecord, Strategy as TraceStrategy, Trace};
use tokentap_spool::{FsyncPolicy, SpoolConfig, SpoolWriter};

/// Three interleaved sessions.
fn interleaved(steps: &[Vec<Step>], seed: u64) -> Vec<CaptureRecord> {
    let sims: Vec<Sim> = steps
        .iter()
        .enumerate()
        .map(|(i, s)| simulate_session(&format!("session-{i}"), s, seed + i as u64, false))
        .collect();
    let mut queues: Vec<std::collections::VecDeque<CaptureRecord>> =
        sims.into_iter().map(|s| s.records.into()).collect();
    let mut out = Vec::new();
    let mut k = seed;
    while queues.iter().any(|q| !q.is_empty()) {
        k = k
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let i = (k >> 33) as usize % queues.len();
        if let Some(r) = queues[i].pop_front() {
            out.push(r);
        }
    }
    out
}

fn parquet_rows(out: &std::path::Path) -> Vec<Trace> {
    let mut parts: Vec<_> = std::fs::read_dir(out.join(PARQUET_DIR))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "parquet"))
        .collect();
    parts.sort();
    parts
        .iter()
        .flat_map(|p| read_traces_parquet(p).unwrap())
        .collect()
}

/// What a burst of work does before the next one.
#[derive(Debug, Clone, Copy)]
enum Interrupt {
    /// Keep going.
    None,
    /// Crash right away: whatever was not checkpointed is redone.
    Crash,
    /// Checkpoint (writing a Parquet part or not), then crash.
    CheckpointThenCrash { part: bool },
}

fn interrupt() -> impl proptest::strategy::Strategy<Value = Interrupt> {
    use proptest::prelude::Strategy;
    (0u8..4, any::<bool>()).prop_map(|(k, part)| match k {
        0 | 1 => Interrupt::None,
        2 => Interrupt::Crash,
        _ => Interrupt::CheckpointThenCrash { part },
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn restarts_lose_nothing_and_repeat_nothing(
        steps in prop::collection::vec(prop::collection::vec(step(), 0..12), 3),
        seed in any::<u64>(),
        bursts in prop::collection::vec((1usize..8, any::<bool>(), interrupt()), 1..12),
    ) {
        let records = interleaved(&steps, seed);
        // Index of each session's last record: once it is read the test finishes the session,
        // as a rollout does when its episode ends.
        let mut last_of: HashMap<String, usize> = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            last_of.insert(r.session_id.clone(), i);
        }
        let tmp = tempfile::tempdir().unwrap();
        let (spool, out) = (tmp.path().join("spool"), tmp.path().join("out"));
        let mut writer = SpoolWriter::open(
            &spool,
            SpoolConfig { segment_max_bytes: 4096, fsync: FsyncPolicy::Never },
        ).unwrap();
        let options = LiveOptions {
            // Sessions finish only when told, so the result is comparable with one batch.
            session_idle: Duration::from_secs(1 << 40),
            part_rows: 3,
            ..LiveOptions::default()
        };
        let mut live = Some(LiveReconstructor::open(&spool, &out, options.clone()).unwrap());
        let mut next = 0;
        for (n, drain, what) in &bursts {
            let end = (next + n).min(records.len());
            writer.append_batch(&records[next..end]).unwrap();
            next = end;
            let l = live.as_mut().unwrap();
            l.poll(2).unwrap();
            if *drain {
                while !l.poll(1000).unwrap().1 {}
                for (session, last) in &last_of {
                    if *last < next {
                        l.finish_session(session).unwrap();
                    }
                }
            }
            match what {
                Interrupt::None => {}
                Interrupt::Crash => live = None,
                Interrupt::CheckpointThenCrash { part } => {
                    l.checkpoint(*part).unwrap();
                    live = None;
                }
            }
            if live.is_none() {
                live = Some(LiveReconstructor::open(&spool, &out, options.clone()).unwrap());
            }
        }
        writer.append_batch(&records[next..]).unwrap();
        writer.sync().unwrap();
        let mut l = live.take().unwrap();
        while !l.poll(1000).unwrap().1 {}
        l.finish_all().unwrap();
        l.checkpoint(true).unwrap();
        drop(l);

        let written = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
        let mut expected: Vec<Trace> = build_all(&records, TraceStrategy::PrefixMerge)
            .into_iter()
            .flat_map(|s| s.traces)
            .collect();
        let key = |t: &Trace| t.trace_id.clone();
        let mut got = written.clone();
        got.sort_by_key(key);
        expected.sort_by_key(key);
        prop_assert_eq!(&got, &expected);

        let ids: HashSet<&str> = written.iter().map(|t| t.trace_id.as_str()).collect();
        prop_assert_eq!(ids.len(), written.len(), "a trace id was written twice");
        let mut rows = parquet_rows(&out);
        rows.sort_by_key(key);
        prop_assert_eq!(&rows, &got);

        let digests: HashMap<_, _> = digests(&records);
        let f = verify(&written, &digests);
        prop_assert_eq!(f.violations, 0, "{:?}", f.examples);
        let sessions = std::fs::read_to_string(out.join("sessions.jsonl")).unwrap();
        prop_assert_eq!(sessions.lines().count(), 3);
    }

    /// With idle finishing, late records of a finished session continue it under new trace
    /// ids; every record with tokens still lands in exactly one trace.
    #[test]
    fn late_records_continue_a_finished_session(
        steps in prop::collection::vec(prop::collection::vec(step(), 0..10), 3),
        seed in any::<u64>(),
        cut in 0usize..40,
    ) {
        let records = interleaved(&steps, seed);
        let tmp = tempfile::tempdir().unwrap();
        let (spool, out) = (tmp.path().join("spool"), tmp.path().join("out"));
        let mut writer = SpoolWriter::open(&spool, SpoolConfig::default()).unwrap();
        // Records carry ancient timestamps: every session is idle as soon as it is read.
        let options = LiveOptions { session_idle: Duration::from_secs(1), ..LiveOptions::default() };
        let cut = cut.min(records.len());
        writer.append_batch(&records[..cut]).unwrap();
        let mut l = LiveReconstructor::open(&spool, &out, options.clone()).unwrap();
        while !l.poll(1000).unwrap().1 {}
        l.checkpoint(false).unwrap();
        drop(l);
        writer.append_batch(&records[cut..]).unwrap();
        let mut l = LiveReconstructor::open(&spool, &out, options).unwrap();
        while !l.poll(1000).unwrap().1 {}
        l.checkpoint(true).unwrap();
        drop(l);

        let written = read_traces_jsonl(&out.join("traces.jsonl")).unwrap();
        let ids: HashSet<&str> = written.iter().map(|t| t.trace_id.as_str()).collect();
        prop_assert_eq!(ids.len(), written.len(), "a trace id was written twice");
        let mut in_traces: Vec<&str> = written.iter()
            .flat_map(|t| t.calls.iter().map(|c| c.record_id.as_str())).collect();
        in_traces.sort();
        let mut with_tokens: Vec<&str> = records.iter()
            .filter(|r| r.prompt_token_ids.is_some())
            .map(|r| r.record_id.as_str()).collect();
        with_tokens.sort();
        with_tokens.dedup();
        // A redelivered record whose session finished in between is a second copy; the
        // worker's ingest drops those before they reach its spool.
        let dup_across_cut = {
            let before: HashSet<&str> = records[..cut].iter().map(|r| r.record_id.as_str()).collect();
            records[cut..].iter().filter(|r| before.contains(r.record_id.as_str())).count()
        };
        if dup_across_cut == 0 {
            prop_assert_eq!(&in_traces, &with_tokens);
        } else {
            prop_assert!(in_traces.len() >= with_tokens.len());
        }
        let f = verify(&written, &digests(&records));
        prop_assert_eq!(f.violations, 0, "{:?}", f.examples);
    }
}
