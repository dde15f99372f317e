//! Where a session's time goes: the engine answering, the proxy, or the harness and its tools
//! between one call's end and the session's next call. Counted per call when its record is
//! made, from the record's own wall-clock times, so concurrent calls of one session (subagents)
//! never count harness time while one of them is with the engine.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{CounterVec, IntGaugeVec, Opts};

/// A gap longer than this is the session resting (or over), not its harness working.
pub const HARNESS_GAP_LIMIT: Duration = Duration::from_secs(300);
/// Sessions remembered at once; the least recently used is forgotten past this (its next call
/// then counts no harness time, which only under-counts).
const SESSIONS_CAP: usize = 65_536;

/// The labels of one call's time: `[engine, model, harness]`.
pub type TimeLabels = [String; 3];

struct SessionState {
    /// Calls begun and not yet ended.
    in_flight: u32,
    /// The latest end of any of its calls, ms since the epoch.
    last_end_ms: u64,
    labels: TimeLabels,
}

/// Per-session activity, and the `tokentap_sessions_active` gauge computed from it whenever
/// metrics are gathered (a collector: nothing to refresh by hand).
pub struct SessionActivity {
    sessions: Mutex<lru::LruCache<String, SessionState>>,
    harness_seconds: CounterVec,
    active: IntGaugeVec,
}

impl SessionActivity {
    pub fn new(harness_seconds: CounterVec) -> SessionActivity {
        let active = IntGaugeVec::new(
            Opts::new(
                "tokentap_sessions_active",
                "Sessions with a call in flight or one that ended in the last 300 s",
            ),
            &["engine", "model", "harness"],
        )
        .expect("valid gauge");
        SessionActivity {
            sessions: Mutex::new(lru::LruCache::new(
                std::num::NonZeroUsize::new(SESSIONS_CAP).expect("nonzero"),
            )),
            harness_seconds,
            active,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, lru::LruCache<String, SessionState>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A call of `session` began (it is with the proxy or the engine from now on).
    pub fn begin(&self, session: &str, labels: TimeLabels) {
        let mut sessions = self.lock();
        let state = sessions.get_or_insert_mut(session.to_owned(), || SessionState {
            in_flight: 0,
            last_end_ms: 0,
            labels: labels.clone(),
        });
        state.in_flight += 1;
        state.labels = labels;
    }

    /// A call of `session` that ran from `started_ms` to `ended_ms` is over: the time since
    /// the session's previous call ended, if no other of its calls was running meanwhile, was
    /// the harness's. Returns that time.
    pub fn end(&self, session: &str, labels: TimeLabels, started_ms: u64, ended_ms: u64) -> f64 {
        let mut sessions = self.lock();
        let state = sessions.get_or_insert_mut(session.to_owned(), || SessionState {
            in_flight: 1,
            last_end_ms: 0,
            labels: labels.clone(),
        });
        state.in_flight = state.in_flight.saturating_sub(1);
        let gap_ms = if state.last_end_ms == 0 {
            0 // the session's first call: what came before is not known
        } else {
            started_ms.saturating_sub(state.last_end_ms)
        };
        // An overlapping call (gap 0) is the engine's time, already counted.
        let harness = if gap_ms > 0 && gap_ms <= HARNESS_GAP_LIMIT.as_millis() as u64 {
            gap_ms as f64 / 1000.0
        } else {
            0.0
        };
        state.last_end_ms = state.last_end_ms.max(ended_ms);
        state.labels = labels;
        if harness > 0.0 {
            let [engine, model, h] = &state.labels;
            self.harness_seconds
                .with_label_values(&[engine, model, h])
                .inc_by(harness);
        }
        harness
    }

    /// Sessions active now, by labels.
    fn count_active(&self, now_ms: u64) -> HashMap<TimeLabels, i64> {
        let limit = HARNESS_GAP_LIMIT.as_millis() as u64;
        let mut counts = HashMap::new();
        for (_, s) in self.lock().iter() {
            if s.in_flight > 0 || now_ms.saturating_sub(s.last_end_ms) <= limit {
                *counts.entry(s.labels.clone()).or_insert(0) += 1;
            }
        }
        counts
    }
}

impl Collector for SessionActivity {
    fn desc(&self) -> Vec<&Desc> {
        self.active.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        // Label sets with no active session drop out rather than linger at 0.
        self.active.reset();
        for (labels, n) in self.count_active(now_ms) {
            let [engine, model, harness] = &labels;
            self.active
                .with_label_values(&[engine, model, harness])
                .set(n);
        }
        self.active.collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> TimeLabels {
        ["llamacpp".into(), "m".into(), "codex".into()]
    }

    fn activity() -> SessionActivity {
        let c = CounterVec::new(Opts::new("h", "h"), &["engine", "model", "harness"]).unwrap();
        SessionActivity::new(c)
    }

    #[test]
    fn the_gap_between_a_sessions_calls_is_the_harnesses() {
        let a = activity();
        a.begin("s", labels());
        assert_eq!(a.end("s", labels(), 1_000, 3_000), 0.0, "first call");
        a.begin("s", labels());
        assert_eq!(a.end("s", labels(), 4_500, 6_000), 1.5);
        // Another session's calls do not make this one's gaps.
        a.begin("t", labels());
        assert_eq!(a.end("t", labels(), 6_500, 7_000), 0.0);
        a.begin("s", labels());
        assert_eq!(a.end("s", labels(), 8_000, 9_000), 2.0);
        assert_eq!(
            a.harness_seconds
                .with_label_values(&["llamacpp", "m", "codex"])
                .get(),
            3.5
        );
    }

    #[test]
    fn overlapping_calls_and_long_rests_are_not_harness_time() {
        let a = activity();
        a.begin("s", labels());
        a.end("s", labels(), 0, 10_000);
        // Two subagent calls at once: the second began before the first ended.
        a.begin("s", labels());
        a.begin("s", labels());
        assert_eq!(a.end("s", labels(), 11_000, 20_000), 1.0);
        assert_eq!(a.end("s", labels(), 12_000, 15_000), 0.0);
        // Back after ten minutes: resting, not working.
        a.begin("s", labels());
        assert_eq!(a.end("s", labels(), 620_000, 621_000), 0.0);
    }

    #[test]
    fn sessions_are_active_while_a_call_runs_and_for_a_while_after() {
        let a = activity();
        a.begin("running", labels());
        a.begin("done", labels());
        a.end("done", labels(), 0, 1_000);
        let counts = a.count_active(100_000);
        assert_eq!(counts.get(&labels()), Some(&2));
        let counts = a.count_active(1_000 + 301_000);
        assert_eq!(counts.get(&labels()), Some(&1), "only the running one");
        let families = a.collect();
        assert_eq!(families[0].name(), "tokentap_sessions_active");
    }
}
