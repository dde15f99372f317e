//! The simulated proxy shared by the property tests: random multi-turn sessions turned into
//! capture records, with the number of traces prefix merge must make.
#![allow(dead_code)]

use std::collections::HashMap;

use proptest::prelude::{any, prop, prop_oneof, Just, Strategy};
use tokentap_reconstruct::RecordDigest;
use tokentap_schema::*;

/// What the simulated harness does next.
#[derive(Debug, Clone)]
pub enum Step {
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

pub fn step() -> impl Strategy<Value = Step> {
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
pub struct Sim {
    pub session: String,
    pub records: Vec<CaptureRecord>,
    pub next_id: u64,
    pub rng: u64,
    /// Engines like llama.cpp do not report the end-of-turn id of streamed answers.
    pub drops_eot: bool,
    pub expected_traces: usize,
    /// Unique first tokens for fresh prefixes (subagents, compaction summaries).
    pub next_fresh: u32,
}

pub const EOT: u32 = 2;

impl Sim {
    pub fn rand(&mut self, below: u32) -> u32 {
        // xorshift: deterministic per case, no proptest shrinking needed for token values.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % u64::from(below)) as u32
    }

    /// One call with `prompt`; returns the full answer as it reappears in the next prompt.
    pub fn call(&mut self, prompt: &[u32], finish: FinishReason) -> Vec<u32> {
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

    pub fn push(
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

    pub fn fresh_prompt(&mut self) -> Vec<u32> {
        self.next_fresh += 1;
        let mut p = vec![self.next_fresh];
        p.extend((0..3 + self.rand(5)).map(|_| 100 + self.rand(40_000)));
        p
    }

    /// Runs the session; `prompt` is the main conversation's next prompt.
    pub fn run(&mut self, steps: &[Step]) {
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

/// A record with the given ids and no token data yet.
pub fn record(session: &str, n: u64) -> CaptureRecord {
    tokentap_reconstruct::synthetic::record(session, &format!("{session}-rec-{n:06}"), n)
}

pub fn simulate(steps: &[Step], seed: u64, drops_eot: bool) -> Sim {
    simulate_session("s", steps, seed, drops_eot)
}

pub fn simulate_session(session: &str, steps: &[Step], seed: u64, drops_eot: bool) -> Sim {
    let mut sim = Sim {
        session: session.into(),
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

pub fn digests(records: &[CaptureRecord]) -> HashMap<String, RecordDigest> {
    records
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect()
}
