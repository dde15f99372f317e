//! The faithfulness check: traces against the records they came from, independently of how
//! the builder made them.
//!
//! For every call of every trace: the tokens before the call's response start are exactly the
//! prompt the engine saw; a trainable call's tokens are exactly its sampled ids with their
//! logprobs, bit for bit; and mask 1 appears nowhere else.

use std::collections::HashMap;
use std::hash::Hasher;

use twox_hash::XxHash3_64;

use tokentap_schema::{CaptureRecord, Faithfulness, Trace};

/// How many violations are described in a report.
const EXAMPLES: usize = 10;

/// What the check needs of a record: its prompt as a length and a hash (so an open session
/// does not hold every prompt twice), its sampled ids and logprobs in full.
#[derive(Debug, Clone)]
pub struct RecordDigest {
    prompt_len: usize,
    prompt_hash: u64,
    completion: Vec<u32>,
    logprobs: Option<Vec<f32>>,
}

impl RecordDigest {
    pub fn of(r: &CaptureRecord) -> RecordDigest {
        let prompt = r.prompt_token_ids.as_deref().unwrap_or(&[]);
        let mut h = TokenHasher::default();
        h.write(prompt);
        RecordDigest {
            prompt_len: prompt.len(),
            prompt_hash: h.finish(),
            completion: r.completion_token_ids.clone().unwrap_or_default(),
            logprobs: r.logprobs.clone(),
        }
    }

    /// Number of sampled ids the record holds.
    pub fn completion_len(&self) -> usize {
        self.completion.len()
    }
}

/// Hashes a token sequence written in any number of pieces: XXH3 over the ids' little-endian
/// bytes, a streaming hash (the same sequence in other pieces hashes the same) several times
/// faster than SipHash fed id by id, which made the check the slowest step after parsing.
#[derive(Default, Clone)]
struct TokenHasher(XxHash3_64);

impl TokenHasher {
    fn write(&mut self, ids: &[u32]) {
        let mut buf = [0u8; 4096];
        for chunk in ids.chunks(buf.len() / 4) {
            for (b, id) in buf.chunks_exact_mut(4).zip(chunk) {
                b.copy_from_slice(&id.to_le_bytes());
            }
            self.0.write(&buf[..chunk.len() * 4]);
        }
    }

    fn finish(&self) -> u64 {
        self.0.finish()
    }
}

/// Checks `traces` against the digests of their records (by record id).
pub fn verify(traces: &[Trace], records: &HashMap<String, RecordDigest>) -> Faithfulness {
    let mut f = Faithfulness::default();
    for t in traces {
        verify_trace(t, records, &mut f);
    }
    f
}

fn verify_trace(t: &Trace, records: &HashMap<String, RecordDigest>, f: &mut Faithfulness) {
    let violation = |f: &mut Faithfulness, what: String| {
        f.violations += 1;
        if f.examples.len() < EXAMPLES {
            f.examples.push(format!("{}: {what}", t.trace_id));
        }
    };
    let n = t.response_ids.len();
    if t.loss_mask.len() != n || t.logprobs.len() != n {
        violation(
            f,
            format!(
                "fields misaligned: {n} response ids, {} mask entries, {} logprobs",
                t.loss_mask.len(),
                t.logprobs.len()
            ),
        );
        return;
    }
    let mut covered = vec![false; n];
    // The hash of the trace's tokens up to `hashed_to` in the response.
    let mut context = TokenHasher::default();
    context.write(&t.prompt_ids);
    let mut hashed_to = 0;
    for call in &t.calls {
        let Some(r) = records.get(call.record_id.as_str()) else {
            violation(f, format!("record {} is not in the input", call.record_id));
            continue;
        };
        let start = call.response_start as usize;
        let len = call.sampled_len as usize;
        if start + len > n {
            violation(f, format!("call {} runs past the response", call.record_id));
            continue;
        }
        if start < hashed_to {
            violation(
                f,
                format!("call {} starts before the previous one", call.record_id),
            );
            continue;
        }
        context.write(&t.response_ids[hashed_to..start]);
        hashed_to = start;
        let context_ok =
            r.prompt_len == t.prompt_ids.len() + start && r.prompt_hash == context.finish();
        if !context_ok {
            violation(
                f,
                format!(
                    "the context before call {} is not the prompt the engine saw",
                    call.record_id
                ),
            );
        }
        if t.response_ids[start..start + len] != r.completion[..] {
            violation(
                f,
                format!(
                    "call {}: tokens differ from the sampled ids",
                    call.record_id
                ),
            );
        }
        if !call.trainable {
            continue;
        }
        let logprobs = r.logprobs.as_deref().unwrap_or(&[]);
        let same_logprobs = logprobs.len() == len
            && t.logprobs[start..start + len]
                .iter()
                .zip(logprobs)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same_logprobs {
            violation(
                f,
                format!("call {}: logprobs differ from the record's", call.record_id),
            );
        }
        covered[start..start + len].fill(true);
    }
    for (i, (&mask, &sampled)) in t.loss_mask.iter().zip(&covered).enumerate().take(n) {
        match (mask, sampled) {
            (1, true) => f.trainable_tokens += 1,
            (0, false) => {
                f.masked_tokens += 1;
                if t.logprobs[i] != 0.0 {
                    violation(f, format!("masked token {i} carries a logprob"));
                }
            }
            (1, false) => violation(f, format!("token {i} has mask 1 but was not sampled there")),
            (0, true) => violation(f, format!("sampled token {i} has mask 0")),
            (m, _) => violation(f, format!("token {i} has mask {m}")),
        }
    }
}
