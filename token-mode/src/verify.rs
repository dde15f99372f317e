//! `--token-verify`: a shadow full render of a tito call's conversation, as text mode would
//! send it, compared with the ids tito built. Every difference is a span
//! ([`crate::drift::spans`]), classified by where it falls in tito's prompt: inside the
//! tokens the model sampled it is content drift, what tito exists to keep (the template
//! drops or rewrites earlier reasoning, the harness re-serializes a call); touching tokens
//! tito rendered or added as a turn's boundary with only special tokens or whitespace
//! differing, it is boundary drift: tito wrote the template's frame other than the template
//! does, a bug, counted and logged.

use std::sync::atomic::{AtomicU64, Ordering};

use tokentap_schema::{ChatRequest, DriftCause, TitoVerify, TokenOrigin, TokenOriginRun};

use crate::{drift, TokenModel};

/// Examples of drift kept on a record, boundary drift first.
const EXAMPLES: usize = 4;

/// Which tito calls get a shadow render.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum TokenVerify {
    #[default]
    Off,
    /// This share of calls (0 < share ≤ 1), spread evenly over them.
    Sample(f64),
    Always,
}

impl std::str::FromStr for TokenVerify {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            format!(
                "unknown --token-verify {s:?}: give `off`, `always` or `sample:N%` (0 < N ≤ 100)"
            )
        };
        match s {
            "off" => Ok(TokenVerify::Off),
            "always" => Ok(TokenVerify::Always),
            _ => {
                let pct: f64 = s
                    .strip_prefix("sample:")
                    .and_then(|p| p.strip_suffix('%'))
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(bad)?;
                if !(pct > 0.0 && pct <= 100.0) {
                    return Err(bad());
                }
                Ok(TokenVerify::Sample(pct / 100.0))
            }
        }
    }
}

impl TokenVerify {
    /// Whether call number `calls` (counted by the caller from 0) is verified: a sample of
    /// N% verifies the calls where the running count of N% crosses a whole number, so any
    /// run of calls has its share, without a random source.
    pub fn picks(&self, calls: &AtomicU64) -> bool {
        match *self {
            TokenVerify::Off => false,
            TokenVerify::Always => true,
            TokenVerify::Sample(share) => {
                let n = calls.fetch_add(1, Ordering::Relaxed) as f64;
                ((n + 1.0) * share).floor() > (n * share).floor()
            }
        }
    }
}

/// The full render of `request` against tito's `ids` (with their `origins`).
pub fn verify(
    model: &TokenModel,
    request: &ChatRequest,
    ids: &[u32],
    origins: &[TokenOriginRun],
) -> Result<TitoVerify, String> {
    let rendered = model.prompt_ids(request)?;
    if rendered == ids {
        return Ok(TitoVerify {
            rendered_tokens: rendered.len() as u32,
            content_spans: 0,
            boundary_spans: 0,
            examples: Vec::new(),
        });
    }
    // Spans index tito's prompt (`at`), so each can be placed among its origins.
    let found = drift::spans(model, &rendered, ids, |_| None);
    let mut verdict = TitoVerify {
        rendered_tokens: rendered.len() as u32,
        content_spans: 0,
        boundary_spans: 0,
        examples: Vec::new(),
    };
    let mut content_examples = Vec::new();
    for span in found.spans {
        let range = span.at as usize..(span.at + span.prompt_len.max(1)) as usize;
        let frame = touches_frame(origins, range);
        if span.cause == DriftCause::BoundaryToken && frame {
            verdict.boundary_spans += 1;
            if verdict.examples.len() < EXAMPLES {
                verdict.examples.push(span);
            }
        } else {
            verdict.content_spans += 1;
            content_examples.push(span);
        }
    }
    let room = EXAMPLES - verdict.examples.len();
    verdict
        .examples
        .extend(content_examples.into_iter().take(room));
    Ok(verdict)
}

/// Whether any token of `range` is one tito did not take from the model's samples.
fn touches_frame(origins: &[TokenOriginRun], range: std::ops::Range<usize>) -> bool {
    let mut at = 0;
    for run in origins {
        let run_range = at..at + run.len as usize;
        at = run_range.end;
        if run.origin != TokenOrigin::Sampled
            && run_range.start < range.end
            && range.start < run_range.end
        {
            return true;
        }
    }
    // Past the runs: nothing to say it was sampled.
    range.end > at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_reads_off_always_and_a_share() {
        assert_eq!("off".parse(), Ok(TokenVerify::Off));
        assert_eq!("always".parse(), Ok(TokenVerify::Always));
        assert_eq!("sample:5%".parse(), Ok(TokenVerify::Sample(0.05)));
        for bad in ["sample:0%", "sample:101%", "sample:5", "5%", "sometimes"] {
            assert!(bad.parse::<TokenVerify>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_sample_picks_its_share_of_any_run_of_calls() {
        let calls = AtomicU64::new(0);
        let v = TokenVerify::Sample(0.25);
        let picked: Vec<bool> = (0..8).map(|_| v.picks(&calls)).collect();
        assert_eq!(
            picked,
            [false, false, false, true, false, false, false, true]
        );
        assert!(!TokenVerify::Off.picks(&calls));
        assert!(TokenVerify::Always.picks(&calls));
    }

    #[test]
    fn only_non_sampled_tokens_are_the_frame() {
        let run = |origin, len| TokenOriginRun { origin, len };
        let origins = [
            run(TokenOrigin::Rendered, 10),
            run(TokenOrigin::Sampled, 5),
            run(TokenOrigin::Boundary, 1),
            run(TokenOrigin::Rendered, 4),
        ];
        assert!(!touches_frame(&origins, 10..15));
        assert!(touches_frame(&origins, 14..16), "the boundary token");
        assert!(touches_frame(&origins, 8..11));
        assert!(touches_frame(&origins, 20..21), "past the runs");
    }
}
