//! Traces as text for people (`tokentap trajectories show`): a header, the prompt, and each
//! run of equal loss mask (context or sampled, with its record and logprobs).

use tokentap_schema::Trace;

/// A trace as text: a header, then its prompt and each run of equal mask.
pub fn render(t: &Trace, ids: usize, piece: &dyn Fn(u32) -> Option<String>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let trainable = t.trainable_tokens();
    let _ = writeln!(
        out,
        "trace {}  {}  started by {}  {} calls  prompt {} + response {} tokens ({} sampled mask=1, {} context mask=0){}",
        t.trace_id,
        t.strategy.as_str(),
        t.started_by.as_str(),
        t.calls.len(),
        t.prompt_ids.len(),
        t.response_ids.len(),
        trainable,
        t.response_ids.len() - trainable,
        if t.spans_policy_versions { "  SPANS POLICY VERSIONS" } else { "" }
    );
    let _ = writeln!(
        out,
        "  prompt   {:>6}  {}",
        t.prompt_ids.len(),
        show(&t.prompt_ids, ids, piece)
    );
    let mut i = 0;
    while i < t.response_ids.len() {
        let m = t.loss_mask[i];
        let end = (i..t.response_ids.len())
            .find(|&j| t.loss_mask[j] != m)
            .unwrap_or(t.response_ids.len());
        // A sampled run may hold several calls back to back only if nothing came between;
        // label it with the call that starts at or covers its start.
        let call = t
            .calls
            .iter()
            .rev()
            .find(|c| c.response_start as usize <= i);
        if m == 1 {
            let lp = &t.logprobs[i..end];
            let mean = lp.iter().map(|&x| f64::from(x)).sum::<f64>() / lp.len() as f64;
            let _ = writeln!(
                out,
                "  ▶ SAMPLED {:>5}  [{i}..{end})  record {}{}  mean logprob {mean:.3}\n             {}",
                end - i,
                call.map_or("?", |c| c.record_id.as_str()),
                call.and_then(|c| c.finish_reason)
                    .map(|f| format!("  finish {f:?}").to_lowercase())
                    .unwrap_or_default(),
                show(&t.response_ids[i..end], ids, piece)
            );
        } else {
            let _ = writeln!(
                out,
                "  · context {:>5}  [{i}..{end})  {}",
                end - i,
                show(&t.response_ids[i..end], ids, piece)
            );
        }
        i = end;
    }
    for g in &t.gaps {
        let _ = writeln!(out, "  gap: {g}");
    }
    out
}

/// The first and last `n` ids of a run (all when `n` is 0 or the run is short).
fn show(run: &[u32], n: usize, piece: &dyn Fn(u32) -> Option<String>) -> String {
    let one = |id: &u32| match piece(*id) {
        Some(p) => format!("{id}{p:?}"),
        None => id.to_string(),
    };
    if n == 0 || run.len() <= 2 * n {
        return run.iter().map(one).collect::<Vec<_>>().join(" ");
    }
    let head: Vec<String> = run[..n].iter().map(one).collect();
    let tail: Vec<String> = run[run.len() - n..].iter().map(one).collect();
    format!("{} … {}", head.join(" "), tail.join(" "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::LongSession;

    #[test]
    fn runs_of_equal_mask_are_shown_with_their_record_and_ends() {
        let records = LongSession {
            calls: 3,
            first_prompt: 40,
            last_prompt: 60,
            sampled: 30,
            subagent_every: 0,
            subagent_calls: 0,
            subagent_prompt: 0,
        }
        .records("shown", 7);
        let sessions = crate::build_all(&records, tokentap_schema::Strategy::PrefixMerge);
        let t = &sessions[0].traces[0];
        let text = render(t, 4, &|id| {
            (id == t.response_ids[0]).then(|| "piece".to_owned())
        });
        assert!(
            text.starts_with(&format!("trace {}  prefix-merge", t.trace_id)),
            "{text}"
        );
        assert!(text.contains("  ▶ SAMPLED "), "{text}");
        assert!(
            text.contains(&format!("record {}", records[0].record_id)),
            "{text}"
        );
        assert!(
            text.contains("\"piece\""),
            "a piece shown beside its id: {text}"
        );
        // Long runs are cut to their ends; 0 shows all.
        assert!(text.contains(" … "), "{text}");
        assert!(!render(t, 0, &|_| None).contains(" … "));
        assert_eq!(show(&[1, 2, 3], 1, &|_| None), "1 … 3");
        assert_eq!(show(&[1, 2], 1, &|_| None), "1 2");
    }
}
