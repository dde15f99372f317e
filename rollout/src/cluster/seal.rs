//! Tasks on the bus carry no authority of their own. Every proxy, sidecar, node agent and
//! worker holds a bus credential, so a rollout found in the bucket proves nothing about who
//! put it there. A node that accepts a task through its API seals the rollout with the
//! cluster's task key (HMAC-SHA256 over the rollout's JSON); a node about to run a sample, or
//! to deliver a callback, first checks that seal. The key lives only on the nodes (a file of
//! theirs, never on the bus), so a forged rollout has no seal and an altered one a seal that
//! no longer fits: both are refused, counted and logged, and nothing of theirs runs.
//!
//! The seal is kept beside the rollout in the bucket's value (`{...rollout, "seal": HEX}`),
//! never in [`Rollout`] itself, so the API's rollouts stay as they were.

use std::path::Path;

use anyhow::Context;
use ring::hmac;
use serde::{Deserialize, Serialize};

use crate::task::Rollout;

/// Shortest key accepted: 32 bytes, as HMAC-SHA256's own output.
pub const MIN_KEY_BYTES: usize = 32;

/// What a seal is computed over, before the rollout's JSON: a change of format is a new
/// domain, so a seal of one never verifies as another.
const DOMAIN: &[u8] = b"tokentap rollout seal v1\n";

/// The cluster's task key, shared by its rollout nodes and by nothing else.
pub struct TaskKey(hmac::Key);

impl std::fmt::Debug for TaskKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TaskKey(..)")
    }
}

/// A rollout as the bus's bucket holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SealedRollout {
    #[serde(flatten)]
    pub rollout: Rollout,
    /// HMAC-SHA256 of the rollout under the task key, hex; absent on a forged one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<String>,
}

/// Why a rollout's seal does not hold.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    #[error("the rollout has no seal (not submitted through a node of this cluster)")]
    Missing,
    #[error("the rollout's seal does not match it (forged, or altered after it was sealed)")]
    Mismatch,
}

impl TaskKey {
    /// A key from raw bytes (at least [`MIN_KEY_BYTES`]).
    pub fn new(bytes: &[u8]) -> anyhow::Result<TaskKey> {
        anyhow::ensure!(
            bytes.len() >= MIN_KEY_BYTES,
            "the task key has {} bytes; it needs at least {MIN_KEY_BYTES} (for example `head -c 32 /dev/urandom | base64 > KEY`)",
            bytes.len()
        );
        Ok(TaskKey(hmac::Key::new(hmac::HMAC_SHA256, bytes)))
    }

    /// Reads the key from `path`: a file only its owner may read (0600 or 0400), whose
    /// contents (without a trailing newline) are the key.
    pub fn from_file(path: &Path) -> anyhow::Result<TaskKey> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path)
            .with_context(|| format!("reading the task key {}", path.display()))?;
        anyhow::ensure!(
            meta.mode() & 0o077 == 0,
            "the task key {} is readable by others (mode {:o}); chmod 600 it",
            path.display(),
            meta.mode() & 0o777
        );
        let bytes = std::fs::read(path)
            .with_context(|| format!("reading the task key {}", path.display()))?;
        let trimmed = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
        TaskKey::new(trimmed).with_context(|| format!("the task key {}", path.display()))
    }

    /// The rollout with its seal, as the bucket should hold it.
    pub fn seal(&self, rollout: Rollout) -> SealedRollout {
        let seal = hex::encode(hmac::sign(&self.0, &signed_bytes(&rollout)));
        SealedRollout {
            rollout,
            seal: Some(seal),
        }
    }

    /// Whether `sealed` was sealed with this key and not changed since (in constant time).
    pub fn verify(&self, sealed: &SealedRollout) -> Result<(), SealError> {
        let seal = sealed.seal.as_deref().ok_or(SealError::Missing)?;
        let tag = hex::decode(seal).map_err(|_| SealError::Mismatch)?;
        hmac::verify(&self.0, &signed_bytes(&sealed.rollout), &tag).map_err(|_| SealError::Mismatch)
    }
}

/// What a seal is computed over: the domain, then the rollout's JSON.
fn signed_bytes(rollout: &Rollout) -> Vec<u8> {
    let mut bytes = DOMAIN.to_vec();
    serde_json::to_writer(&mut bytes, rollout).expect("plain data serializes");
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::new_rollout;
    use crate::task::TaskSpec;

    fn rollout() -> Rollout {
        let spec: TaskSpec = serde_json::from_value(serde_json::json!({
            "task_id": "t1",
            "instruction": "fix the failing test",
            "workspace": {"dir": {"path": "/tmp/project"}},
            "harness": {"name": "pi"},
            "evaluator": {"kind": "command", "command": "python3 -m unittest"},
            "limits": {"cpus": 0.1},
            "sandbox": true
        }))
        .unwrap();
        new_rollout(spec, 1).0
    }

    fn key(byte: u8) -> TaskKey {
        TaskKey::new(&[byte; 32]).unwrap()
    }

    #[test]
    fn a_sealed_rollout_verifies_through_the_bucket() {
        let sealed = key(1).seal(rollout());
        let stored = serde_json::to_vec(&sealed).unwrap();
        let read: SealedRollout = serde_json::from_slice(&stored).unwrap();
        assert_eq!(key(1).verify(&read), Ok(()));
        // The bucket's value is the rollout's own fields plus the seal, so readers that
        // know only `Rollout` still read it.
        let plain: Rollout = serde_json::from_slice(&stored).unwrap();
        assert_eq!(plain, sealed.rollout);
    }

    #[test]
    fn a_forged_or_altered_rollout_is_refused() {
        let k = key(1);
        let unsealed = SealedRollout {
            rollout: rollout(),
            seal: None,
        };
        assert_eq!(k.verify(&unsealed), Err(SealError::Missing));

        // Sealed with another key (someone guessing).
        assert_eq!(k.verify(&key(2).seal(rollout())), Err(SealError::Mismatch));

        // Each field an attacker would change, changed after sealing.
        let alter: [fn(&mut Rollout); 5] = [
            |r| r.spec.sandbox = false,
            |r| r.spec.budgets.session_s = 999_999,
            |r| r.spec.callback_url = Some("http://127.0.0.1:9/steal".into()),
            |r| r.spec.instruction.push(' '),
            |r| r.rollout_id.push('x'),
        ];
        for (i, change) in alter.iter().enumerate() {
            let mut sealed = k.seal(rollout());
            assert_eq!(k.verify(&sealed), Ok(()), "control {i}");
            change(&mut sealed.rollout);
            assert_eq!(k.verify(&sealed), Err(SealError::Mismatch), "change {i}");
        }

        // A seal that is not hex at all.
        let mut sealed = k.seal(rollout());
        sealed.seal = Some("zz".repeat(32));
        assert_eq!(k.verify(&sealed), Err(SealError::Mismatch));
    }

    #[test]
    fn a_short_or_exposed_key_file_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("task.key");
        std::fs::write(&path, "short\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(TaskKey::from_file(&path).is_err());
        std::fs::write(&path, format!("{}\n", "k".repeat(44))).unwrap();
        assert!(TaskKey::from_file(&path).is_ok());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = TaskKey::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("readable by others"), "{err}");
    }
}
