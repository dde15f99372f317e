//! `--token-mode observe`: for every call, tokentap's own ids against the engine's, and the
//! engine's prompt against the session's earlier prompts and what the model sampled there.
//!
//! A session may hold several conversations at once (a harness's subagents, a compaction's
//! summary call), so each session keeps its last few calls (*tips*: prompt + sampled ids) and
//! a call is compared with the tip it shares the most with. State is bounded: tips per
//! session, sessions (least recently used go first) and tokens held in all.

use std::sync::Mutex;
use std::time::Instant;

use lru::LruCache;
use tokentap_schema::{ChatRequest, Continuation, DriftSpan, RenderComparison, TokenObservation};

use crate::drift::{common_prefix, first_span, spans};
use crate::TokenModel;

/// The sampled stretches a tip remembers (each a few numbers and its reasoning).
const MAX_SAMPLED: usize = 256;

/// The sampled stretch that holds position `at`, if any.
fn holding(sampled: &[Sampled], at: usize) -> Option<&Sampled> {
    sampled.iter().find(|s| s.start <= at && at < s.end)
}

/// Tokens of an earlier turn a prompt must keep, as sampled or as re-rendered, to go on
/// with that conversation rather than start a new one from a shared prefix.
const MIN_KEPT: usize = 4;

/// What [`Observer::continuation`] needs of the closest tip, copied out of the lock.
struct Closest {
    common: usize,
    record_id: String,
    len: usize,
    prompt_len: usize,
    rest: Option<Vec<u32>>,
    sampled: Vec<Sampled>,
}

/// Bounds on what the observer keeps.
#[derive(Debug, Clone, Copy)]
pub struct ObserverLimits {
    /// Sessions whose tips are kept; the least recently used go first.
    pub sessions: usize,
    /// Tips kept per session (its concurrent conversations).
    pub tips_per_session: usize,
    /// Token ids kept in all tips together (4 bytes each).
    pub held_tokens: usize,
}

impl Default for ObserverLimits {
    fn default() -> Self {
        ObserverLimits {
            sessions: 4096,
            tips_per_session: 8,
            // 128 MiB of ids.
            held_tokens: 32 << 20,
        }
    }
}

/// What the observer needs of one finished call.
#[derive(Debug, Clone, Copy)]
pub struct CallView<'a> {
    pub session_id: &'a str,
    pub record_id: &'a str,
    /// The canonical request the engine rendered.
    pub request: &'a ChatRequest,
    /// The engine's prompt ids, when it gave them.
    pub engine_prompt: Option<&'a [u32]>,
    /// The ids it sampled, when it gave them.
    pub completion: Option<&'a [u32]>,
    /// The reasoning parsed from the answer, if any.
    pub reasoning: Option<&'a str>,
}

/// The last call of one conversation of a session.
struct Tip {
    record_id: String,
    /// Its prompt, then the ids it sampled.
    ids: Vec<u32>,
    prompt_len: usize,
    /// Where `ids` holds sampled ids, the tip's own and those of the calls it continued
    /// (still at the same place in its prompt), in order.
    sampled: Vec<Sampled>,
}

#[derive(Clone)]
struct Sampled {
    record_id: String,
    start: usize,
    end: usize,
    reasoning: Option<String>,
}

struct State {
    sessions: LruCache<String, Vec<Tip>>,
    held: usize,
}

/// `--token-mode observe` for one proxy: the model, and every session's tips.
pub struct Observer {
    model: TokenModel,
    limits: ObserverLimits,
    state: Mutex<State>,
}

impl Observer {
    pub fn new(model: TokenModel, limits: ObserverLimits) -> Observer {
        Observer {
            model,
            limits,
            state: Mutex::new(State {
                sessions: LruCache::unbounded(),
                held: 0,
            }),
        }
    }

    pub fn model(&self) -> &TokenModel {
        &self.model
    }

    /// Sessions with tips kept.
    pub fn sessions(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Token ids held in all sessions' tips.
    pub fn held_tokens(&self) -> usize {
        self.lock().held
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Renders and tokenizes the call, compares, and remembers it as a tip of its session.
    pub fn observe(&self, call: CallView<'_>) -> TokenObservation {
        let started = Instant::now();
        let ours = self.model.prompt_ids(call.request);
        let render_us = started.elapsed().as_micros() as u64;
        let render = match (&ours, call.engine_prompt) {
            (Err(e), _) => RenderComparison::Unavailable {
                reason: format!("tokentap could not render the conversation: {e}"),
            },
            (Ok(_), None) => RenderComparison::Unavailable {
                reason: "the engine gave no prompt ids".into(),
            },
            (Ok(ours), Some(engine)) if ours.as_slice() == engine => RenderComparison::Equal {
                tokens: ours.len() as u32,
            },
            (Ok(ours), Some(engine)) => {
                let at = common_prefix(ours, engine);
                RenderComparison::Differs {
                    at: at as u32,
                    ours_len: ours.len() as u32,
                    engine_len: engine.len() as u32,
                    span: first_span(&self.model, ours, engine, at),
                }
            }
        };
        let continuation = match call.engine_prompt {
            Some(prompt) => self.continuation(call, prompt),
            None => Continuation::Unavailable {
                reason: "the engine gave no prompt ids".into(),
            },
        };
        TokenObservation {
            render,
            continuation,
            render_us,
        }
    }

    fn continuation(&self, call: CallView<'_>, prompt: &[u32]) -> Continuation {
        // Under the lock: only the choice of tip (a prefix scan) and a copy of the part of it
        // the prompt did not keep; the diff runs outside.
        let closest = {
            let mut state = self.lock();
            state.sessions.get(call.session_id).and_then(|tips| {
                tips.iter()
                    .map(|t| (common_prefix(&t.ids, prompt), t))
                    .max_by_key(|(common, _)| *common)
                    .map(|(common, t)| Closest {
                        common,
                        record_id: t.record_id.clone(),
                        len: t.ids.len(),
                        prompt_len: t.prompt_len,
                        // Where sampled ids follow the parting point, the rest of the tip,
                        // for the diff that says whether the prompt still holds them.
                        rest: t
                            .sampled
                            .iter()
                            .any(|s| s.end > common)
                            .then(|| t.ids[common..].to_vec()),
                        sampled: t.sampled.clone(),
                    })
            })
        };
        let Some(c) = closest else {
            self.remember(call, prompt, None, Vec::new());
            return Continuation::First;
        };
        let kept = |c: &Closest| -> Vec<Sampled> {
            c.sampled
                .iter()
                .filter(|s| s.end <= c.common)
                .cloned()
                .collect()
        };
        let (continuation, replaces, sampled) = if c.common == c.len && prompt.len() > c.len {
            (
                Continuation::Extends {
                    record_id: c.record_id.clone(),
                    appended: (prompt.len() - c.len) as u32,
                },
                Some(c.record_id.clone()),
                c.sampled.clone(),
            )
        } else if c.common == c.prompt_len && prompt.len() == c.prompt_len {
            (
                Continuation::Repeats {
                    record_id: c.record_id.clone(),
                },
                Some(c.record_id.clone()),
                kept(&c),
            )
        } else {
            let parted = c
                .rest
                .as_ref()
                .and_then(|rest| self.parted(&c, rest, prompt));
            match parted {
                Some((spans, carried)) => {
                    let parted_in = holding(&c.sampled, c.common)
                        .map_or_else(|| c.record_id.clone(), |s| s.record_id.clone());
                    (
                        Continuation::Diverges {
                            record_id: parted_in,
                            spans,
                        },
                        Some(c.record_id.clone()),
                        carried,
                    )
                }
                None => (
                    Continuation::NewPrefix {
                        closest_record_id: Some(c.record_id.clone()),
                        common: c.common as u32,
                    },
                    None,
                    kept(&c),
                ),
            }
        };
        self.remember(call, prompt, replaces, sampled);
        continuation
    }

    /// Where the prompt parts from the tip `c` (its `rest` after the common prefix), when it
    /// still holds some of the ids the tip's calls sampled after that point (the template
    /// re-rendered them, or the harness edited something before them): the spans, and the
    /// sampled stretches carried over to the prompt. `None` when it holds none of them: a new
    /// prefix, not this conversation going on.
    fn parted(
        &self,
        c: &Closest,
        rest: &[u32],
        prompt: &[u32],
    ) -> Option<(Vec<DriftSpan>, Vec<Sampled>)> {
        let reasoning_in = |r: std::ops::Range<usize>| {
            let r = c.common + r.start..c.common + r.end;
            c.sampled
                .iter()
                .find(|s| s.start < r.end && r.start < s.end)
                .and_then(|s| s.reasoning.as_deref())
        };
        let drift = spans(&self.model, rest, &prompt[c.common..], reasoning_in);
        let local = |s: &Sampled| s.start.saturating_sub(c.common)..s.end - c.common;
        let inside = holding(&c.sampled, c.common).is_some();
        // Most of a turn, not the few tokens a diff of two other conversations also matches
        // (`<|im_end|>`, newlines).
        let kept_some = c.sampled.iter().filter(|s| s.end > c.common).any(|s| {
            let r = local(s);
            let kept = drift.alignment.kept(r.clone());
            kept >= MIN_KEPT && 2 * kept >= r.len()
        });
        if !inside && !kept_some {
            return None;
        }
        let spans = drift
            .spans
            .into_iter()
            .map(|mut s| {
                s.at += c.common as u32;
                s
            })
            .collect();
        // The turns the prompt re-rendered stay the turns their calls sampled, where the diff
        // puts them: a later call that drops their reasoning still parts from them.
        let at = |i: usize| c.common + drift.alignment.position(i - c.common);
        let carried = c
            .sampled
            .iter()
            .filter_map(|s| {
                if s.end <= c.common {
                    return Some(s.clone());
                }
                let start = if s.start < c.common {
                    s.start
                } else {
                    at(s.start)
                };
                let end = at(s.end);
                (start < end).then(|| Sampled {
                    start,
                    end,
                    ..s.clone()
                })
            })
            .collect();
        Some((spans, carried))
    }

    /// The call becomes a tip of its session, in place of the tip it continued.
    fn remember(
        &self,
        call: CallView<'_>,
        prompt: &[u32],
        replaces: Option<String>,
        mut sampled: Vec<Sampled>,
    ) {
        let mut ids = prompt.to_vec();
        ids.extend_from_slice(call.completion.unwrap_or_default());
        sampled.push(Sampled {
            record_id: call.record_id.to_owned(),
            start: prompt.len(),
            end: ids.len(),
            reasoning: call.reasoning.map(str::to_owned),
        });
        // Only calls still within the prompt; long sessions keep the latest.
        if sampled.len() > MAX_SAMPLED {
            sampled.drain(..sampled.len() - MAX_SAMPLED);
        }
        let tip = Tip {
            record_id: call.record_id.to_owned(),
            prompt_len: prompt.len(),
            ids,
            sampled,
        };
        let limits = self.limits;
        let mut guard = self.lock();
        let state = &mut *guard;
        let mut freed = 0;
        let added = tip.ids.len();
        {
            let tips = state
                .sessions
                .get_or_insert_mut(call.session_id.to_owned(), Vec::new);
            if let Some(i) = replaces
                .as_deref()
                .and_then(|r| tips.iter().position(|t| t.record_id == r))
            {
                freed += tips.remove(i).ids.len();
            }
            if tips.len() >= limits.tips_per_session.max(1) {
                freed += tips.remove(0).ids.len();
            }
            tips.push(tip);
        }
        state.held = state.held + added - freed;
        while state.sessions.len() > limits.sessions.max(1) || state.held > limits.held_tokens {
            match state.sessions.pop_lru() {
                Some((_, tips)) => state.held -= tips.iter().map(|t| t.ids.len()).sum::<usize>(),
                None => break,
            }
        }
    }
}
