//! Records and traces as text for people. A trace (`tokentap trajectories show`): a header,
//! the prompt, and each run of equal loss mask (context or sampled, with its record and
//! logprobs). A record (`tokentap records`): one line, or JSON with token data as plain
//! arrays and the engine request whole; a spool's summary.

use std::fmt::Write;
use std::path::Path;

use tokentap_schema::{CaptureRecord, Trace};

/// A trace as text: a header, then its prompt and each run of equal mask.
pub fn render(t: &Trace, ids: usize, piece: &dyn Fn(u32) -> Option<String>) -> String {
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

/// A record as JSON for people and dataframes: token data as plain arrays, and the engine
/// request with its conversation, which the spool keeps once, in the harness body.
pub fn readable(r: &CaptureRecord) -> Result<serde_json::Value, String> {
    let json = |e: serde_json::Error| e.to_string();
    let mut v =
        tokentap_schema::compact::expand_token_fields(serde_json::to_value(r).map_err(json)?);
    if let Some(request) = tokentap_wire::replay::backend_request(r)? {
        v["backend_request"] = serde_json::to_value(request.as_ref()).map_err(json)?;
        if let Some(o) = v.as_object_mut() {
            o.remove("backend_conversation");
        }
    }
    Ok(v)
}

/// `id  session#seq  api  status  prompt→completion tokens  finish  ms  text`
pub fn one_line(r: &CaptureRecord) -> String {
    let count = |ids: &Option<Vec<u32>>| {
        ids.as_ref()
            .map_or("?".to_string(), |v| v.len().to_string())
    };
    let text = r
        .message
        .as_ref()
        .map(|m| {
            let mut t = m.content.clone().unwrap_or_default();
            for c in &m.tool_calls {
                t.push_str(&format!(" [call {}({})]", c.name, c.arguments));
            }
            t
        })
        .unwrap_or_default();
    let text: String = text.chars().take(60).collect::<String>().replace('\n', "⏎");
    let outcome = match &r.error {
        Some(e) => format!("error:{}", e.kind.as_str()),
        None => r
            .finish_reason
            .map_or("-".into(), |f| format!("{f:?}").to_lowercase()),
    };
    format!(
        "{}  {}#{}  {}  {}  {}→{} tok  {}  {:.0} ms  {}",
        r.record_id,
        r.session_id,
        r.seq,
        r.wire_api.as_str(),
        r.response_status,
        count(&r.prompt_token_ids),
        count(&r.completion_token_ids),
        outcome,
        r.timings.total_ms,
        text
    )
}

/// `tokentap records summary`: calls, sessions, tokens, then each call's line with its gaps
/// and its first `show_tokens` sampled tokens with their logprobs (`piece`: a token id's text,
/// for display only). `problems`: the spool's unreadable lines.
pub fn spool_summary(
    spool: &Path,
    records: &[CaptureRecord],
    problems: usize,
    show_tokens: usize,
    piece: &dyn Fn(u32) -> Option<String>,
) -> String {
    let mut out = String::new();
    let sessions: std::collections::BTreeSet<&str> =
        records.iter().map(|r| r.session_id.as_str()).collect();
    let prompt: usize = records
        .iter()
        .filter_map(|r| r.prompt_token_ids.as_ref())
        .map(Vec::len)
        .sum();
    let completion: usize = records
        .iter()
        .filter_map(|r| r.completion_token_ids.as_ref())
        .map(Vec::len)
        .sum();
    let with_ids = records
        .iter()
        .filter(|r| {
            r.prompt_token_ids.is_some() && r.completion_token_ids.is_some() && r.logprobs.is_some()
        })
        .count();
    let errors = records.iter().filter(|r| r.error.is_some()).count();
    let _ = writeln!(out, "spool {}", spool.display());
    let _ = writeln!(
        out,
        "calls {}  sessions {}  with full token data {}  errors {}  unreadable lines {}",
        records.len(),
        sessions.len(),
        with_ids,
        errors,
        problems
    );
    let _ = writeln!(
        out,
        "prompt tokens {prompt}  completion tokens {completion}"
    );
    let mut tally = tokentap_schema::TokenModeTally::default();
    for o in records.iter().filter_map(|r| r.token_observation.as_ref()) {
        tally.add(o);
    }
    if tally.observed > 0 {
        let _ = writeln!(out, "token mode: {}", tally.line());
    }
    let mut tito = tokentap_schema::TitoTally::default();
    for t in records.iter().filter_map(|r| r.token_in.as_ref()) {
        tito.add(t);
    }
    if tito.calls > 0 {
        for line in tito.lines() {
            let _ = writeln!(out, "tito: {line}");
        }
    }
    for r in records {
        let _ = writeln!(out, "\n{}", one_line(r));
        for gap in &r.token_provenance.gaps {
            let _ = writeln!(out, "    gap in {:?}: {}", gap.field, gap.reason);
        }
        if let Some(o) = &r.token_observation {
            for line in token_drift_lines(o) {
                let _ = writeln!(out, "    {line}");
            }
        }
        if let Some(line) = r.token_in.as_ref().and_then(tito_branch_line) {
            let _ = writeln!(out, "    {line}");
        }
        let (Some(ids), Some(lps)) = (&r.completion_token_ids, &r.logprobs) else {
            continue;
        };
        let shown: Vec<String> = ids
            .iter()
            .zip(lps)
            .take(show_tokens)
            .map(|(id, lp)| match piece(*id) {
                Some(p) => format!("{id} {p:?} ({lp:.3})"),
                None => format!("{id} ({lp:.3})"),
            })
            .collect();
        let _ = writeln!(out, "    first sampled tokens: {}", shown.join(", "));
    }
    out
}

/// What `--token-mode observe` found about one call, when it is not plain agreement.
fn token_drift_lines(o: &tokentap_schema::TokenObservation) -> Vec<String> {
    use tokentap_schema::{Continuation, RenderComparison};
    let mut lines = Vec::new();
    let span = |s: &tokentap_schema::DriftSpan| {
        format!(
            "{} at token {} ({} tokens -> {}): {:?} -> {:?}",
            s.cause.as_str(),
            s.at,
            s.before_len,
            s.prompt_len,
            s.before_text,
            s.prompt_text
        )
    };
    match &o.render {
        RenderComparison::Differs { span: s, .. } => lines.push(format!(
            "tokentap's ids differ from the engine's: {}",
            span(s)
        )),
        RenderComparison::Unavailable { reason } => {
            lines.push(format!("tokentap's ids: unavailable: {reason}"))
        }
        RenderComparison::Equal { .. } => {}
    }
    match &o.continuation {
        Continuation::Diverges { record_id, spans } => {
            lines.push(format!("re-rendered where {record_id} sampled:"));
            lines.extend(spans.iter().map(|s| format!("  {}", span(s))));
        }
        Continuation::NewPrefix {
            closest_record_id,
            common,
        } => lines.push(format!(
            "new prefix: {common} tokens in common with {}",
            closest_record_id.as_deref().unwrap_or("no earlier call")
        )),
        _ => {}
    }
    lines
}

/// Why tito rendered a call whole, when it is not a conversation's first call (the calls that
/// start a new trace where one was expected to go on).
fn tito_branch_line(t: &tokentap_schema::TokenIn) -> Option<String> {
    use tokentap_schema::{TitoBranchCause, TitoContinuation};
    match &t.continuation {
        TitoContinuation::Branch { cause, detail } if *cause != TitoBranchCause::First => {
            Some(match detail {
                Some(d) => format!("tito branch: {}: {d}", cause.as_str()),
                None => format!("tito branch: {}", cause.as_str()),
            })
        }
        _ => None,
    }
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

    #[test]
    fn a_spool_summary_counts_and_shows_each_call() {
        let records = LongSession {
            calls: 2,
            first_prompt: 10,
            last_prompt: 20,
            sampled: 5,
            subagent_every: 0,
            subagent_calls: 0,
            subagent_prompt: 0,
        }
        .records("summed", 3);
        let text = spool_summary(Path::new("/s"), &records, 1, 2, &|id| {
            (id % 2 == 0).then(|| "p".to_owned())
        });
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some("spool /s"));
        let calls = lines.next().unwrap();
        assert!(
            calls.starts_with(
                "calls 2  sessions 1  with full token data 2  errors 0  unreadable lines 1"
            ),
            "{calls}"
        );
        let prompt: usize = records
            .iter()
            .map(|r| r.prompt_token_ids.as_ref().unwrap().len())
            .sum();
        assert_eq!(
            lines.next().unwrap(),
            format!("prompt tokens {prompt}  completion tokens 10")
        );
        assert!(
            text.contains(&format!("\n\n{}\n", one_line(&records[1]))),
            "{text}"
        );
        assert_eq!(
            text.matches("    first sampled tokens: ").count(),
            2,
            "{text}"
        );
        let line = one_line(&records[0]);
        assert!(
            line.starts_with(&format!("{}  summed#", records[0].record_id)),
            "{line}"
        );
        assert!(line.contains("→5 tok"), "{line}");
        let v = readable(&records[0]).unwrap();
        assert!(v["completion_token_ids"].is_array(), "{v}");
    }

    #[test]
    fn a_spool_summary_counts_tito_calls_and_says_why_each_branched() {
        use tokentap_schema::{
            TitoBranchCause, TitoContinuation, TokenIn, TokenOrigin, TokenOriginRun,
        };
        let token_in = |continuation, origins: &[(TokenOrigin, u32)]| TokenIn {
            continuation,
            origins: origins
                .iter()
                .map(|&(origin, len)| TokenOriginRun { origin, len })
                .collect(),
            build_us: 50,
            verify: None,
        };
        let branch = |cause, detail: Option<&str>| TitoContinuation::Branch {
            cause,
            detail: detail.map(str::to_owned),
        };
        let extends = || TitoContinuation::Extends {
            record_id: "r".into(),
            appended: 4,
        };
        let mut records: Vec<CaptureRecord> = (0..5)
            .map(|n| crate::synthetic::record("mixed", &format!("t{n}"), n))
            .collect();
        records[0].token_in = Some(token_in(
            branch(TitoBranchCause::First, None),
            &[(TokenOrigin::Rendered, 20)],
        ));
        records[1].token_in = Some(token_in(
            extends(),
            &[(TokenOrigin::Sampled, 25), (TokenOrigin::Rendered, 4)],
        ));
        records[2].token_in = Some(token_in(
            extends(),
            &[
                (TokenOrigin::Sampled, 30),
                (TokenOrigin::Boundary, 1),
                (TokenOrigin::Rendered, 3),
            ],
        ));
        records[3].token_in = Some(token_in(
            branch(TitoBranchCause::Edited, Some("message 2 changed")),
            &[(TokenOrigin::Rendered, 40)],
        ));
        // records[4]: a text-mode call of the same spool, in no tito count.
        let text = spool_summary(Path::new("/s"), &records, 0, 2, &|_| None);
        assert!(
            text.contains(
                "\ntito: calls 4  extended 2 of 3 (67%)  branches 2 (first 1, edited 1)\n\
                 tito: prompt tokens by origin: sampled 55  rendered 67  boundary 1\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "\n{}\n    tito branch: edited: message 2 changed\n",
                one_line(&records[3])
            )),
            "{text}"
        );
        assert_eq!(text.matches("tito branch").count(), 1, "{text}");
        // Without token_in there are no tito lines at all.
        let text = spool_summary(Path::new("/s"), &records[4..], 0, 2, &|_| None);
        assert!(!text.contains("tito"), "{text}");
    }
}
