//! The node's admission gate in front of the engine (a [`CallGate`] in the capture): holds new
//! generations while the trainer updates weights (`POST /v1/admin/pause`, in-flight calls
//! finish), stamps each call with the policy version in effect (`POST /v1/admin/resume` sets
//! the next), and applies each sample's task sampling parameters to its calls.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use tokentap_proxy::gate::{Admission, CallGate};
use tokentap_schema::{ChatRequest, Normalization};
use tokio::sync::Notify;

use crate::task::Sampling;

/// What a sample's calls get.
#[derive(Debug, Clone, Default)]
pub struct SessionPolicy {
    pub sampling: Sampling,
    /// The task's policy version, used when the node has none of its own.
    pub policy_version: Option<String>,
    /// The sample's harness, for the proxy's metrics.
    pub harness: Option<tokentap_proxy::harness::Harness>,
}

#[derive(Default)]
struct State {
    paused: bool,
    in_flight: usize,
    policy_version: Option<String>,
    sessions: HashMap<String, SessionPolicy>,
}

/// The gate's state as the admin API reports it.
#[derive(Debug, Clone, PartialEq, Serialize, schemars::JsonSchema)]
pub struct GateStatus {
    pub paused: bool,
    pub in_flight: usize,
    pub policy_version: Option<String>,
}

#[derive(Default)]
pub struct NodeGate {
    state: Mutex<State>,
    /// Woken on resume and whenever a call ends.
    changed: Notify,
}

impl NodeGate {
    pub fn new(policy_version: Option<String>) -> Arc<NodeGate> {
        let gate = NodeGate::default();
        gate.lock().policy_version = policy_version;
        Arc::new(gate)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `session`'s calls get `policy` until [`NodeGate::forget`].
    pub fn register(&self, session: &str, policy: SessionPolicy) {
        self.lock().sessions.insert(session.to_owned(), policy);
    }

    pub fn forget(&self, session: &str) {
        self.lock().sessions.remove(session);
    }

    pub fn status(&self) -> GateStatus {
        let s = self.lock();
        GateStatus {
            paused: s.paused,
            in_flight: s.in_flight,
            policy_version: s.policy_version.clone(),
        }
    }

    /// Holds new generations and waits (up to `wait`) for those in flight to finish.
    pub async fn pause(&self, wait: Duration) -> GateStatus {
        self.lock().paused = true;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let status = self.status();
            if status.in_flight == 0 || tokio::time::Instant::now() >= deadline {
                return status;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
    }

    /// Lets generations go on, under `policy_version` when given.
    pub fn resume(&self, policy_version: Option<String>) -> GateStatus {
        {
            let mut s = self.lock();
            s.paused = false;
            if policy_version.is_some() {
                s.policy_version = policy_version;
            }
        }
        self.changed.notify_waiters();
        self.status()
    }
}

/// Counts a call in flight until dropped.
struct InFlight(Arc<NodeGate>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.lock().in_flight -= 1;
        self.0.changed.notify_waiters();
    }
}

/// The gate as the capture sees it.
pub struct Gate(pub Arc<NodeGate>);

#[async_trait]
impl CallGate for Gate {
    async fn admit(&self, session: Option<&str>, request: &mut ChatRequest) -> Admission {
        let (permit, node_version, session_policy) = self.enter(session).await;
        let session_policy = session_policy.unwrap_or_default();
        Admission {
            normalizations: apply_sampling(&session_policy.sampling, request),
            policy_version: node_version.or(session_policy.policy_version),
            permit: Some(permit),
            harness: session_policy.harness,
        }
    }

    async fn hold(&self, session: Option<&str>) -> Option<Box<dyn Send + Sync>> {
        Some(self.enter(session).await.0)
    }
}

impl Gate {
    /// Waits while generations are held, then counts one in flight (until the permit drops);
    /// the node's policy version and the session's policy.
    async fn enter(
        &self,
        session: Option<&str>,
    ) -> (Box<dyn Send + Sync>, Option<String>, Option<SessionPolicy>) {
        let gate = &self.0;
        let (version, policy) = loop {
            let changed = gate.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut s = gate.lock();
                if !s.paused {
                    s.in_flight += 1;
                    let session_policy = session.and_then(|id| s.sessions.get(id)).cloned();
                    break (s.policy_version.clone(), session_policy);
                }
            }
            changed.await;
        };
        (Box::new(InFlight(gate.clone())), version, policy)
    }
}

/// The task's sampling parameters over the harness's: temperature and top_p replace the
/// harness's; max_tokens caps it.
fn apply_sampling(task: &Sampling, request: &mut ChatRequest) -> Vec<Normalization> {
    let mut changed = Vec::new();
    let p = &mut request.sampling;
    if let Some(t) = task.temperature {
        if p.temperature != Some(t) {
            changed.push(format!("temperature {:?} -> {t}", p.temperature));
            p.temperature = Some(t);
        }
    }
    if let Some(t) = task.top_p {
        if p.top_p != Some(t) {
            changed.push(format!("top_p {:?} -> {t}", p.top_p));
            p.top_p = Some(t);
        }
    }
    if let Some(cap) = task.max_tokens.map(u64::from) {
        if p.max_tokens.is_none_or(|m| m > cap) {
            changed.push(format!("max_tokens {:?} -> {cap}", p.max_tokens));
            p.max_tokens = Some(cap);
        }
    }
    if changed.is_empty() {
        return Vec::new();
    }
    vec![Normalization {
        kind: "task_sampling".into(),
        detail: format!("the task's sampling parameters: {}", changed.join(", ")),
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> ChatRequest {
        serde_json::from_value(serde_json::json!({
            "model": "m", "messages": [], "sampling": {"temperature": 1.0, "max_tokens": 4096}
        }))
        .unwrap()
    }

    /// `count_tokens` and `/v1/models` reach the engine too: held while paused, counted in
    /// flight (a pause waits for them) until answered.
    #[tokio::test]
    async fn lookups_are_held_and_counted_like_calls() {
        let node = NodeGate::new(None);
        let gate = Arc::new(Gate(node.clone()));
        node.pause(Duration::ZERO).await;
        let held = tokio::spawn({
            let gate = gate.clone();
            async move { gate.hold(Some("s")).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!held.is_finished(), "a lookup waits while paused");
        node.resume(None);
        let permit = held.await.unwrap();
        assert!(permit.is_some());
        assert_eq!(node.status().in_flight, 1);
        drop(permit);
        assert_eq!(node.status().in_flight, 0);
    }

    #[tokio::test]
    async fn a_pause_holds_new_calls_until_resume_and_waits_for_those_in_flight() {
        let node = NodeGate::new(Some("v1".into()));
        let gate = Arc::new(Gate(node.clone()));
        let mut r = request();
        let first = gate.admit(Some("s"), &mut r).await;
        assert_eq!(first.policy_version.as_deref(), Some("v1"));

        // Pausing waits for the call in flight.
        let pausing = tokio::spawn({
            let node = node.clone();
            async move { node.pause(Duration::from_secs(10)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!pausing.is_finished(), "a call is still in flight");
        drop(first);
        let status = pausing.await.unwrap();
        assert_eq!((status.paused, status.in_flight), (true, 0));

        // A new call waits while paused, and runs under the version resume sets.
        let held = tokio::spawn({
            let gate = gate.clone();
            async move {
                let mut r = request();
                gate.admit(Some("s"), &mut r).await.policy_version
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!held.is_finished(), "held while paused");
        node.resume(Some("v2".into()));
        assert_eq!(held.await.unwrap().as_deref(), Some("v2"));
        assert_eq!(node.status().in_flight, 0);
    }

    #[tokio::test]
    async fn a_sessions_task_sampling_applies_to_its_calls_only() {
        let node = NodeGate::new(None);
        node.register(
            "s1",
            SessionPolicy {
                sampling: Sampling {
                    temperature: Some(0.7),
                    top_p: None,
                    max_tokens: Some(512),
                },
                policy_version: Some("task-v".into()),
                harness: None,
            },
        );
        let gate = Gate(node.clone());
        let mut r = request();
        let a = gate.admit(Some("s1"), &mut r).await;
        assert_eq!(
            (r.sampling.temperature, r.sampling.max_tokens),
            (Some(0.7), Some(512))
        );
        assert_eq!(a.normalizations[0].kind, "task_sampling");
        assert_eq!(a.policy_version.as_deref(), Some("task-v"));
        let mut other = request();
        let b = gate.admit(Some("s2"), &mut other).await;
        assert_eq!(other.sampling, request().sampling);
        assert!(b.normalizations.is_empty());
    }
}
