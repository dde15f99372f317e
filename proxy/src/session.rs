//! Which session a call belongs to, and its position in it.
//!
//! Precedence: the `x-tokentap-session` header, a `/s/{session}/v1/...` path prefix, a
//! `?session=` query parameter, a session id the harness sends on its own (Codex, Claude Code:
//! one per run, so concurrent runs sharing a key stay apart), the API key (hashed: the key
//! itself never reaches a record), else a fresh id for this call alone.

use std::sync::Mutex;

use sha2::{Digest, Sha256};
use tokentap_schema::{ErrorKind, SessionSource};

use tokentap_wire::{CallError, WireError};

pub const SESSION_HEADER: &str = "x-tokentap-session";

/// Headers in which harnesses name their own run, with the prefix their sessions get.
pub const HARNESS_SESSION_HEADERS: &[(&str, &str)] = &[
    ("session-id", "codex-"),
    ("x-claude-code-session-id", "claude-"),
];

/// A call's session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    pub id: String,
    pub source: SessionSource,
}

/// Where a session name can come from, as found on one request.
#[derive(Debug, Default)]
pub struct SessionHints<'a> {
    pub header: Option<&'a str>,
    pub path_prefix: Option<&'a str>,
    pub query: Option<&'a str>,
    /// A harness's own session header: (prefix, value).
    pub harness: Option<(&'a str, &'a str)>,
    pub api_key: Option<&'a str>,
}

/// Maps the `/s/{prefix}` of a request to its session, on a listener whose clients must not
/// choose their session themselves (a rollout node's capture, where the prefix is a sample's
/// unguessable secret): header, query, harness and key hints are ignored there.
pub trait SessionResolver: Send + Sync {
    /// The session `prefix` stands for; None: refused.
    fn resolve(&self, prefix: &str) -> Option<String>;
}

/// The session a resolver gives the request's path prefix; no prefix, or one it does not
/// know, is refused (403: the call reaches no engine and joins no session).
pub fn resolve(
    resolver: &dyn SessionResolver,
    path_prefix: Option<&str>,
) -> Result<Session, CallError> {
    match path_prefix.and_then(|p| resolver.resolve(p)) {
        Some(id) => Ok(Session {
            id,
            source: SessionSource::PathPrefix,
        }),
        None => Err(CallError::new(
            ErrorKind::InvalidRequest,
            403,
            "Unknown capture session: use the base URL this run was given.",
        )),
    }
}

/// Picks the session by precedence; a named session must be a sane identifier.
pub fn attribute(
    hints: &SessionHints<'_>,
    fresh_id: impl FnOnce() -> String,
) -> Result<Session, WireError> {
    let named = [
        (hints.header, SessionSource::Header, SESSION_HEADER),
        (
            hints.path_prefix,
            SessionSource::PathPrefix,
            "/s/{session} path prefix",
        ),
        (
            hints.query,
            SessionSource::Query,
            "?session= query parameter",
        ),
    ];
    for (value, source, origin) in named {
        if let Some(v) = value {
            validate(v, origin)?;
            return Ok(Session {
                id: v.to_owned(),
                source,
            });
        }
    }
    // Not the user's configuration: an odd value is skipped, not refused.
    if let Some((prefix, v)) = hints.harness.filter(|(_, v)| validate(v, "").is_ok()) {
        return Ok(Session {
            id: format!("{prefix}{v}"),
            source: SessionSource::HarnessHeader,
        });
    }
    if let Some(key) = hints.api_key.filter(|k| !k.is_empty()) {
        let digest = Sha256::digest(key.as_bytes());
        let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        return Ok(Session {
            id: format!("key-{hex}"),
            source: SessionSource::ApiKey,
        });
    }
    Ok(Session {
        id: fresh_id(),
        source: SessionSource::Generated,
    })
}

fn validate(id: &str, origin: &str) -> Result<(), WireError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(WireError::new(format!(
            "Invalid session id from the {origin}: use 1-128 characters from A-Z a-z 0-9 - _ . :"
        )))
    }
}

/// Sessions whose counters are kept: the least recently called one is forgotten past this, so
/// endless distinct session ids cannot grow the process. A live session calls far more often
/// than this many other sessions start; one forgotten after a long idle spell restarts at
/// `seq` 0 (its records stay in arrival order in the spool).
pub const SESSION_COUNTERS_CAP: usize = 65_536;

/// What a session has used so far: the calls it began, the token counts it asked for
/// (`count_tokens`: no record, but the same work for the node), and the request body bytes it
/// sent with either.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionUse {
    pub calls: u64,
    pub token_counts: u64,
    pub request_bytes: u64,
    /// Calls refused since its budget was spent.
    pub refused: u64,
}

/// The most one session may use, on a listener whose sessions are authenticated (a rollout
/// node's samples; elsewhere a client picks its session ids, so a budget would bind nothing).
/// A call that finds its session at either bound is refused before its body is read, so a
/// session overshoots the bytes by at most one body (`max_body_bytes`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionBudget {
    pub max_calls: Option<u64>,
    pub max_request_bytes: Option<u64>,
}

impl SessionBudget {
    /// Why a session that has used `used` may begin no more calls, if it may not.
    pub fn spent(&self, used: SessionUse) -> Option<String> {
        let calls = used.calls.saturating_add(used.token_counts);
        if let Some(max) = self.max_calls.filter(|&m| calls >= m) {
            return Some(match used.token_counts {
                0 => format!(
                    "this session's capture budget is spent: it has made {} calls, of at most {max}",
                    used.calls
                ),
                n => format!(
                    "this session's capture budget is spent: it has made {} calls and {n} token counts, of at most {max}",
                    used.calls
                ),
            });
        }
        if let Some(max) = self.max_request_bytes.filter(|&m| used.request_bytes >= m) {
            return Some(format!(
                "this session's capture budget is spent: it has sent {} bytes of requests, of at most {max}",
                used.request_bytes
            ));
        }
        None
    }
}

/// Hands out per-session sequence numbers (from 0, in arrival order) and counts what each
/// session used.
pub struct SessionCounters {
    next: Mutex<lru::LruCache<String, SessionUse>>,
}

impl Default for SessionCounters {
    fn default() -> Self {
        SessionCounters::with_cap(SESSION_COUNTERS_CAP)
    }
}

impl SessionCounters {
    pub fn with_cap(cap: usize) -> Self {
        let cap = std::num::NonZeroUsize::new(cap.max(1)).expect("at least 1");
        SessionCounters {
            next: Mutex::new(lru::LruCache::new(cap)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, lru::LruCache<String, SessionUse>> {
        self.next.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn next_seq(&self, session: &Session) -> u64 {
        if session.source == SessionSource::Generated {
            return 0; // a generated session holds exactly one call
        }
        let mut map = self.lock();
        let used = map.get_or_insert_mut(session.id.clone(), SessionUse::default);
        let seq = used.calls;
        used.calls += 1;
        seq
    }

    /// Counts `bytes` of request body against the session `id`.
    pub fn add_request_bytes(&self, id: &str, bytes: u64) {
        if let Some(used) = self.lock().get_mut(id) {
            used.request_bytes = used.request_bytes.saturating_add(bytes);
        }
    }

    /// Counts a token count (`count_tokens`) of the session `id` against its call budget; its
    /// sequence numbers are left alone (a count makes no record).
    pub fn add_token_count(&self, id: &str) {
        let mut map = self.lock();
        let used = map.get_or_insert_mut(id.to_owned(), SessionUse::default);
        used.token_counts += 1;
    }

    /// Counts a call of the session `id` refused for its budget; returns how many so far.
    pub fn note_refused(&self, id: &str) -> u64 {
        let mut map = self.lock();
        let used = map.get_or_insert_mut(id.to_owned(), SessionUse::default);
        used.refused += 1;
        used.refused
    }

    /// Calls begun so far in the session `id` (asking does not count as use).
    pub fn calls(&self, id: &str) -> u64 {
        self.used(id).calls
    }

    /// What the session `id` has used (asking does not count as use).
    pub fn used(&self, id: &str) -> SessionUse {
        self.lock().peek(id).copied().unwrap_or_default()
    }

    /// Sessions whose counters are held.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session's calls and bytes count against its budget; at either bound it is spent
    /// (and without bounds never).
    #[test]
    fn a_budget_is_spent_at_either_bound() {
        let counters = SessionCounters::default();
        let s = Session {
            id: "sample-1".into(),
            source: SessionSource::PathPrefix,
        };
        let budget = SessionBudget {
            max_calls: Some(2),
            max_request_bytes: Some(100),
        };
        assert_eq!(budget.spent(counters.used("sample-1")), None);
        counters.next_seq(&s);
        counters.add_request_bytes("sample-1", 60);
        assert_eq!(budget.spent(counters.used("sample-1")), None);
        counters.next_seq(&s);
        let why = budget.spent(counters.used("sample-1")).unwrap();
        assert!(why.contains("2 calls, of at most 2"), "{why}");
        let bytes_only = SessionBudget {
            max_calls: None,
            ..budget
        };
        assert_eq!(bytes_only.spent(counters.used("sample-1")), None);
        counters.add_request_bytes("sample-1", 40);
        assert!(bytes_only
            .spent(counters.used("sample-1"))
            .unwrap()
            .contains("100 bytes of requests, of at most 100"));
        assert_eq!(
            SessionBudget::default().spent(counters.used("sample-1")),
            None
        );
        assert_eq!(counters.note_refused("sample-1"), 1);
        assert_eq!(counters.note_refused("sample-1"), 2);
        // Bytes of a session never begun are not counted (nor is it remembered).
        counters.add_request_bytes("other", 10);
        assert_eq!(counters.used("other"), SessionUse::default());
    }

    fn fresh() -> String {
        "gen-1".into()
    }

    #[test]
    fn precedence_is_header_path_query_harness_key_fresh() {
        let all = SessionHints {
            header: Some("h"),
            path_prefix: Some("p"),
            query: Some("q"),
            harness: Some(("codex-", "01a2-b3")),
            api_key: Some("k"),
        };
        assert_eq!(
            attribute(&all, fresh).unwrap(),
            Session {
                id: "h".into(),
                source: SessionSource::Header
            }
        );
        let no_header = SessionHints {
            header: None,
            ..all
        };
        assert_eq!(
            attribute(&no_header, fresh).unwrap().source,
            SessionSource::PathPrefix
        );
        let only_query_key = SessionHints {
            query: Some("q"),
            api_key: Some("k"),
            ..Default::default()
        };
        assert_eq!(attribute(&only_query_key, fresh).unwrap().id, "q");
        let harness_key = SessionHints {
            harness: Some(("codex-", "01a2-b3")),
            api_key: Some("k"),
            ..Default::default()
        };
        assert_eq!(
            attribute(&harness_key, fresh).unwrap(),
            Session {
                id: "codex-01a2-b3".into(),
                source: SessionSource::HarnessHeader
            }
        );
        // A harness id that is no sane identifier is skipped, not refused.
        let odd = SessionHints {
            harness: Some(("claude-", "a b/c")),
            api_key: Some("k"),
            ..Default::default()
        };
        assert_eq!(
            attribute(&odd, fresh).unwrap().source,
            SessionSource::ApiKey
        );
        let only_key = SessionHints {
            api_key: Some("sk-secret"),
            ..Default::default()
        };
        let s = attribute(&only_key, fresh).unwrap();
        assert_eq!(s.source, SessionSource::ApiKey);
        assert!(s.id.starts_with("key-") && !s.id.contains("secret"));
        assert_eq!(
            attribute(&Default::default(), fresh).unwrap(),
            Session {
                id: "gen-1".into(),
                source: SessionSource::Generated
            }
        );
    }

    #[test]
    fn the_same_key_always_names_the_same_session() {
        let a = attribute(
            &SessionHints {
                api_key: Some("k1"),
                ..Default::default()
            },
            fresh,
        )
        .unwrap();
        let b = attribute(
            &SessionHints {
                api_key: Some("k1"),
                ..Default::default()
            },
            fresh,
        )
        .unwrap();
        let c = attribute(
            &SessionHints {
                api_key: Some("k2"),
                ..Default::default()
            },
            fresh,
        )
        .unwrap();
        assert_eq!(a, b);
        assert_ne!(a.id, c.id);
    }

    #[test]
    fn bad_session_names_are_rejected() {
        for bad in ["", "a b", "x/y", &"z".repeat(129)] {
            assert!(
                attribute(
                    &SessionHints {
                        header: Some(bad),
                        ..Default::default()
                    },
                    fresh
                )
                .is_err(),
                "{bad:?}"
            );
        }
    }

    struct OneSecret;
    impl SessionResolver for OneSecret {
        fn resolve(&self, prefix: &str) -> Option<String> {
            (prefix == "s3cret").then(|| "sample-1".to_owned())
        }
    }

    #[test]
    fn a_resolver_maps_only_the_secrets_it_knows() {
        let s = resolve(&OneSecret, Some("s3cret")).unwrap();
        assert_eq!(
            (s.id.as_str(), s.source),
            ("sample-1", SessionSource::PathPrefix)
        );
        for bad in [None, Some("sample-1"), Some("s3cre"), Some("")] {
            let e = resolve(&OneSecret, bad).unwrap_err();
            assert_eq!(e.status, 403, "{bad:?}");
        }
    }

    #[test]
    fn sequence_numbers_count_per_session() {
        let c = SessionCounters::default();
        let a = Session {
            id: "a".into(),
            source: SessionSource::Header,
        };
        let b = Session {
            id: "b".into(),
            source: SessionSource::Header,
        };
        assert_eq!(
            (
                c.next_seq(&a),
                c.next_seq(&a),
                c.next_seq(&b),
                c.next_seq(&a)
            ),
            (0, 1, 0, 2)
        );
    }

    #[test]
    fn counters_are_bounded_and_keep_live_sessions() {
        let c = SessionCounters::with_cap(100);
        let s = |id: String| Session {
            id,
            source: SessionSource::Header,
        };
        let live = s("live".into());
        c.next_seq(&live);
        for i in 0..1_000 {
            c.next_seq(&s(format!("s{i}")));
            if i % 50 == 0 {
                c.next_seq(&live); // a live session keeps calling
            }
        }
        assert_eq!(c.len(), 100, "held past the cap");
        assert_eq!(c.calls("live"), 21, "the live session's count survived");
        assert_eq!(c.calls("s0"), 0, "a long-idle session was forgotten");
        assert_eq!(c.calls("s999"), 1);
    }
}
