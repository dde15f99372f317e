//! Where two token sequences part, and why.
//!
//! Only ids are compared; text (decoded from ids, never re-encoded) serves to name the cause
//! of each span: the model's reasoning missing on the prompt's side, only special tokens or
//! whitespace differing, the same text cut into different ids, or different text.

use std::time::{Duration, Instant};

use similar::{capture_diff_deadline, Algorithm, DiffOp};
use tokentap_schema::{DriftCause, DriftSpan};

use crate::TokenModel;

/// Longest prefix `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How long one diff may take before it settles for a coarser answer.
const DIFF_DEADLINE: Duration = Duration::from_millis(20);
/// A span's text is cut to this many characters in the record.
const TEXT_CHARS: usize = 200;
/// Equal tokens between two changes that still make them one span.
const JOIN_GAP: usize = 2;
/// Spans kept per comparison (a long conversation re-rendered at every turn has one each).
pub const MAX_SPANS: usize = 64;

/// The spans where `old` is not found in `prompt`, until `old` is used up: what the prompt
/// holds instead of each part of `old` it lacks (span positions index `prompt`). Tokens the
/// prompt adds after the whole of `old` (the new turn) are not drift. `reasoning_in(r)` is
/// the reasoning the model sampled in a turn overlapping `old[r]`, if any (from that call's
/// parsed answer). At most [`MAX_SPANS`] spans.
pub fn spans<'r>(
    model: &TokenModel,
    old: &[u32],
    prompt: &[u32],
    reasoning_in: impl Fn(std::ops::Range<usize>) -> Option<&'r str>,
) -> Drift {
    // The prompt's part that stands in for `old`: what it kept of it, plus what replaced the
    // rest. Replacements longer than this show as a span cut short, not as a slow diff.
    let new = &prompt[..(old.len() * 2 + 64).min(prompt.len())];
    let ops = capture_diff_deadline(
        Algorithm::Myers,
        old,
        0..old.len(),
        new,
        0..new.len(),
        Some(Instant::now() + DIFF_DEADLINE),
    );
    // Consecutive non-equal ops that touch `old` become one span, and so do two separated by
    // no more than JOIN_GAP equal tokens: a dropped `<think>\nx\n</think>\n\n` after a
    // newline may be diffed as two deletions around the newline, but it is one drift.
    let mut spans = Vec::new();
    let alignment = Alignment { ops };
    let mut open: Option<(usize, usize, usize, usize)> = None; // old start, old end, new start, new end
    let mut gap = false; // `open` is followed by a short equal run, not yet part of it
    let close = |open: &mut Option<(usize, usize, usize, usize)>, spans: &mut Vec<DriftSpan>| {
        if let Some((os, oe, ns, mut ne)) = open.take() {
            if oe == old.len() {
                // The diff cannot tell where what replaced the end of `old` stops and the new
                // turn begins; keep only what stands in for it.
                ne = ns + standing_in(model, &old[os..oe], &new[ns..ne]);
            }
            if spans.len() < MAX_SPANS {
                let reasoning = reasoning_in(os..oe);
                spans.push(span(model, &old[os..oe], &new[ns..ne], ns, reasoning));
            }
        }
    };
    for op in &alignment.ops {
        let (o, n) = (op.old_range(), op.new_range());
        match *op {
            DiffOp::Equal { len, .. } if len <= JOIN_GAP && open.is_some() && !gap => gap = true,
            DiffOp::Equal { .. } => {
                gap = false;
                close(&mut open, &mut spans)
            }
            // Tokens inserted after all of `old` are the new turn.
            DiffOp::Insert { old_index, .. } if old_index >= old.len() => break,
            _ => {
                gap = false;
                open = Some(match open {
                    Some((os, _, ns, _)) => (os, o.end, ns, n.end),
                    None => (o.start, o.end, n.start, n.end),
                })
            }
        }
    }
    close(&mut open, &mut spans);
    Drift { spans, alignment }
}

/// What [`spans`] finds: the spans, and where each part of `old` went in the prompt.
pub struct Drift {
    pub spans: Vec<DriftSpan>,
    pub alignment: Alignment,
}

/// The diff behind a [`Drift`], to carry positions in `old` over to the prompt.
pub struct Alignment {
    ops: Vec<DiffOp>,
}

impl Alignment {
    /// How many tokens of `old[r]` the prompt kept as they were.
    pub fn kept(&self, r: std::ops::Range<usize>) -> usize {
        self.ops
            .iter()
            .filter(|op| matches!(op, DiffOp::Equal { .. }))
            .map(|op| {
                let o = op.old_range();
                o.end.min(r.end).saturating_sub(o.start.max(r.start))
            })
            .sum()
    }

    /// The prompt position that stands where position `i` of `old` (a boundary between
    /// tokens, `0..=old.len()`) stood: exact inside what the prompt kept; the start of the
    /// replacement inside what it replaced or dropped.
    pub fn position(&self, i: usize) -> usize {
        let mut last = 0;
        for op in &self.ops {
            let (o, n) = (op.old_range(), op.new_range());
            match op {
                DiffOp::Equal { .. } if o.start <= i && i <= o.end => {
                    return n.start + (i - o.start)
                }
                // What the prompt added stands for no position of `old` (at its end: the new
                // turn).
                DiffOp::Insert { .. } => continue,
                _ if o.start <= i && i < o.end => return n.start,
                _ if o.end <= i => last = n.end,
                _ => {}
            }
        }
        last
    }
}

/// The first stretch where `ours` and `engine` part (both from `at`, their common prefix).
pub fn first_span(model: &TokenModel, ours: &[u32], engine: &[u32], at: usize) -> DriftSpan {
    let (a, b) = (&ours[at.min(ours.len())..], &engine[at.min(engine.len())..]);
    // Meet again where both have the same suffix, within a bounded look-ahead.
    let limit = 4096.min(a.len()).min(b.len());
    let suffix = a
        .iter()
        .rev()
        .zip(b.iter().rev())
        .take(limit)
        .take_while(|(x, y)| x == y)
        .count();
    let (a, b) = (&a[..a.len() - suffix], &b[..b.len() - suffix]);
    let ops = capture_diff_deadline(
        Algorithm::Myers,
        a,
        0..a.len().min(4096),
        b,
        0..b.len().min(4096),
        Some(Instant::now() + DIFF_DEADLINE),
    );
    let (mut os, mut oe, mut ns, mut ne) = (None, 0, None, 0);
    for op in ops {
        if let DiffOp::Equal { .. } = op {
            if os.is_some() || ns.is_some() {
                break;
            }
            continue;
        }
        let (o, n) = (op.old_range(), op.new_range());
        os.get_or_insert(o.start);
        ns.get_or_insert(n.start);
        oe = o.end;
        ne = n.end;
    }
    let (os, ns) = (os.unwrap_or(0), ns.unwrap_or(0));
    span(model, &a[os..oe.max(os)], &b[ns..ne.max(ns)], at + ns, None)
}

/// How many of `new`'s first ids stand in for `old` at the end of a sampled turn: as long as
/// their text (without special tokens and whitespace) is a start of `old`'s, so a different
/// stop token or separator keeps the turn's closing tokens and not the next turn's text. When
/// even the first differs, as many ids as `old` has.
fn standing_in(model: &TokenModel, old: &[u32], new: &[u32]) -> usize {
    let target = plain_text(model, old);
    let mut k = 0;
    while k < new.len().min(256) && target.starts_with(&plain_text(model, &new[..k + 1])) {
        k += 1;
    }
    if k == 0 {
        old.len().min(new.len())
    } else {
        k
    }
}

fn span(
    model: &TokenModel,
    before: &[u32],
    prompt: &[u32],
    at: usize,
    reasoning: Option<&str>,
) -> DriftSpan {
    let before_text = model.text(before);
    let prompt_text = model.text(prompt);
    let cause = classify(model, before, prompt, &before_text, &prompt_text, reasoning);
    DriftSpan {
        at: at as u32,
        before_len: before.len() as u32,
        prompt_len: prompt.len() as u32,
        cause,
        before_text: cut(&before_text),
        prompt_text: cut(&prompt_text),
    }
}

fn classify(
    model: &TokenModel,
    before: &[u32],
    prompt: &[u32],
    before_text: &str,
    prompt_text: &str,
    reasoning: Option<&str>,
) -> DriftCause {
    if before_text == prompt_text {
        return DriftCause::MergeDifference;
    }
    if let Some(r) = reasoning.map(str::trim).filter(|r| !r.is_empty()) {
        let lost = before_text.trim();
        // The span held the reasoning (or a piece of it) and the prompt does not.
        let held = !lost.is_empty() && (lost.contains(r) || r.contains(lost));
        if held && !prompt_text.contains(lost) && !prompt_text.contains(r) {
            return DriftCause::ReasoningDropped;
        }
    }
    if plain_text(model, before) == plain_text(model, prompt) {
        return DriftCause::BoundaryToken;
    }
    DriftCause::ContentChanged
}

/// The text of `ids` without special tokens and whitespace: what is left when only turn
/// boundaries and separators differ.
fn plain_text(model: &TokenModel, ids: &[u32]) -> String {
    model
        .text_without_special(ids)
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect()
}

fn cut(text: &str) -> String {
    match text.char_indices().nth(TEXT_CHARS) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_owned(),
    }
}
