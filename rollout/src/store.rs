//! The node's durable state (redb: one file, ACID, pure Rust): rollouts as submitted, every
//! sample's stage and outcome, and the append-only results log that `GET /v1/results?after=`
//! pages through. A node restart re-queues what was running (or fails it after too many
//! attempts); nothing accepted is silently dropped.

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::task::{Outcome, Rollout, Sample, Stage, TaskSpec};

const ROLLOUTS: TableDefinition<&str, &[u8]> = TableDefinition::new("rollouts");
const SAMPLES: TableDefinition<&str, &[u8]> = TableDefinition::new("samples");
/// Results log: cursor → sample id, in the order samples finished.
const RESULTS: TableDefinition<u64, &str> = TableDefinition::new("results");
/// Callback deliveries still owed: sample id → [`OutboxEntry`]. Written in the same
/// transaction that ends the sample, so a crash cannot lose a delivery.
const OUTBOX: TableDefinition<&str, &[u8]> = TableDefinition::new("outbox");

/// Deliveries due now (sample id, entry), and when the next later one is due.
pub type OutboxDue = (Vec<(String, OutboxEntry)>, Option<u64>);

/// A result still to be POSTed to its rollout's `callback_url`.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OutboxEntry {
    pub url: String,
    pub attempts: u32,
    /// Not before this time (unix ms).
    pub next_ms: u64,
    #[serde(default)]
    pub last_error: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store: {0}")]
    Db(#[from] redb::Error),
    #[error("store record: {0}")]
    Json(#[from] serde_json::Error),
    #[error("no such {0}")]
    NotFound(String),
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::Db(e.into())
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

/// A new rollout of `spec` and its queued samples (ids: the rollout's, then `-INDEX`).
pub fn new_rollout(spec: TaskSpec, now_ms: u64) -> (Rollout, Vec<Sample>) {
    let rollout = Rollout {
        rollout_id: format!("ro-{}", uuid::Uuid::now_v7().simple()),
        submitted_ms: now_ms,
        spec,
        cancelled: false,
    };
    let samples = (0..rollout.spec.num_samples)
        .map(|index| Sample {
            sample_id: format!("{}-{index}", rollout.rollout_id),
            rollout_id: rollout.rollout_id.clone(),
            task_id: rollout.spec.task_id.clone(),
            index,
            stage: Stage::Queued,
            stage_started_ms: [0; 4],
            stage_ended_ms: [0; 2],
            attempt: 0,
            outcome: None,
            trajectory: None,
            evaluation: None,
            callback: None,
            agent: None,
            node: None,
        })
        .collect();
    (rollout, samples)
}

pub struct Store {
    db: Database,
}

impl Store {
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        // Tasks hold prompts and callback URLs: the file is the node's alone (0600), made so
        // before redb writes a byte, and tightened if an older node left it readable.
        {
            use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
            let file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(path)
                .map_err(redb::DatabaseError::from)?;
            file.set_permissions(std::fs::Permissions::from_mode(0o600))
                .map_err(redb::DatabaseError::from)?;
        }
        let db = Database::create(path)?;
        let tx = db.begin_write()?;
        tx.open_table(ROLLOUTS)?;
        tx.open_table(SAMPLES)?;
        tx.open_table(RESULTS)?;
        tx.open_table(OUTBOX)?;
        tx.commit()?;
        Ok(Store { db })
    }

    /// Accepts a task: the rollout and its queued samples, in one transaction.
    pub fn submit(
        &self,
        spec: TaskSpec,
        now_ms: u64,
    ) -> Result<(Rollout, Vec<Sample>), StoreError> {
        let (rollout, samples) = new_rollout(spec, now_ms);
        let tx = self.db.begin_write()?;
        {
            let mut r = tx.open_table(ROLLOUTS)?;
            r.insert(
                rollout.rollout_id.as_str(),
                serde_json::to_vec(&rollout)?.as_slice(),
            )?;
            let mut s = tx.open_table(SAMPLES)?;
            for sample in &samples {
                s.insert(
                    sample.sample_id.as_str(),
                    serde_json::to_vec(sample)?.as_slice(),
                )?;
            }
        }
        tx.commit()?;
        Ok((rollout, samples))
    }

    /// Takes in one sample claimed from a cluster's queue, with its rollout, replacing what an
    /// earlier attempt here left (the claim decides the attempt, not this store).
    pub fn adopt(&self, rollout: &Rollout, sample: &Sample) -> Result<(), StoreError> {
        let tx = self.db.begin_write()?;
        {
            tx.open_table(ROLLOUTS)?.insert(
                rollout.rollout_id.as_str(),
                serde_json::to_vec(rollout)?.as_slice(),
            )?;
            tx.open_table(SAMPLES)?.insert(
                sample.sample_id.as_str(),
                serde_json::to_vec(sample)?.as_slice(),
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// A rollout and its samples.
    pub fn rollout(&self, rollout_id: &str) -> Result<(Rollout, Vec<Sample>), StoreError> {
        let tx = self.db.begin_read()?;
        let r = tx.open_table(ROLLOUTS)?;
        let rollout: Rollout = match r.get(rollout_id)? {
            Some(v) => serde_json::from_slice(v.value())?,
            None => return Err(StoreError::NotFound(format!("rollout {rollout_id}"))),
        };
        let s = tx.open_table(SAMPLES)?;
        let prefix = format!("{rollout_id}-");
        let mut samples = Vec::new();
        for item in s.range(prefix.as_str()..)? {
            let (k, v) = item?;
            if !k.value().starts_with(&prefix) {
                break;
            }
            samples.push(serde_json::from_slice::<Sample>(v.value())?);
        }
        samples.sort_by_key(|s| s.index);
        Ok((rollout, samples))
    }

    pub fn sample(&self, sample_id: &str) -> Result<Sample, StoreError> {
        let tx = self.db.begin_read()?;
        let s = tx.open_table(SAMPLES)?;
        match s.get(sample_id)? {
            Some(v) => Ok(serde_json::from_slice(v.value())?),
            None => Err(StoreError::NotFound(format!("sample {sample_id}"))),
        }
    }

    /// The `traces.jsonl` of every sample that has one (what the node's viewer shows; only
    /// files the node wrote itself, never whatever else is in a sample's directory).
    pub fn trajectory_files(&self) -> Result<Vec<std::path::PathBuf>, StoreError> {
        let tx = self.db.begin_read()?;
        let s = tx.open_table(SAMPLES)?;
        let mut out = Vec::new();
        for item in s.iter()? {
            let (_, v) = item?;
            let sample: Sample = serde_json::from_slice(v.value())?;
            if let Some(t) = sample.trajectory {
                out.push(std::path::PathBuf::from(t.path));
            }
        }
        Ok(out)
    }

    /// Moves a sample to `stage` (INIT counts an attempt).
    pub fn set_stage(
        &self,
        sample_id: &str,
        stage: Stage,
        now_ms: u64,
    ) -> Result<Sample, StoreError> {
        self.update(sample_id, |s| {
            s.stage = stage;
            match stage {
                Stage::Init => {
                    s.attempt += 1;
                    s.stage_started_ms[0] = now_ms;
                }
                Stage::Run => s.stage_started_ms[1] = now_ms,
                Stage::PostRun => s.stage_started_ms[2] = now_ms,
                Stage::Done => s.stage_started_ms[3] = now_ms,
                Stage::Queued => {}
            }
        })
        .map(|(s, _)| s)
    }

    /// Notes the end of INIT (`Stage::Init`) or RUN (`Stage::Run`).
    pub fn stage_ended(
        &self,
        sample_id: &str,
        stage: Stage,
        now_ms: u64,
    ) -> Result<(), StoreError> {
        self.update(sample_id, |s| match stage {
            Stage::Init => s.stage_ended_ms[0] = now_ms,
            Stage::Run => s.stage_ended_ms[1] = now_ms,
            _ => {}
        })
        .map(|_| ())
    }

    /// Ends a sample and appends it to the results log; returns its cursor. A sample that has
    /// already ended keeps its first outcome (and cursor).
    pub fn finish(
        &self,
        sample_id: &str,
        outcome: Outcome,
        now_ms: u64,
    ) -> Result<u64, StoreError> {
        let tx = self.db.begin_write()?;
        let cursor;
        {
            let mut s = tx.open_table(SAMPLES)?;
            let mut sample: Sample = match s.get(sample_id)? {
                Some(v) => serde_json::from_slice(v.value())?,
                None => return Err(StoreError::NotFound(format!("sample {sample_id}"))),
            };
            let mut results = tx.open_table(RESULTS)?;
            if sample.outcome.is_some() {
                let found = results
                    .iter()?
                    .filter_map(Result::ok)
                    .find(|(_, v)| v.value() == sample_id)
                    .map(|(k, _)| k.value());
                return Ok(found.unwrap_or(0));
            }
            sample.stage = Stage::Done;
            sample.stage_started_ms[3] = now_ms;
            sample.outcome = Some(outcome);
            s.insert(sample_id, serde_json::to_vec(&sample)?.as_slice())?;
            cursor = results.last()?.map_or(1, |(k, _)| k.value() + 1);
            results.insert(cursor, sample_id)?;
            let rollouts = tx.open_table(ROLLOUTS)?;
            let rollout: Option<Rollout> = match rollouts.get(sample.rollout_id.as_str())? {
                Some(v) => Some(serde_json::from_slice(v.value())?),
                None => None,
            };
            if let Some(url) = rollout.and_then(|r| r.spec.callback_url) {
                let entry = OutboxEntry {
                    url,
                    attempts: 0,
                    next_ms: now_ms,
                    last_error: None,
                };
                tx.open_table(OUTBOX)?
                    .insert(sample_id, serde_json::to_vec(&entry)?.as_slice())?;
            }
        }
        tx.commit()?;
        Ok(cursor)
    }

    /// Attaches a sample's trajectory summary.
    pub fn set_trajectory(
        &self,
        sample_id: &str,
        trajectory: crate::task::TrajectorySummary,
    ) -> Result<(), StoreError> {
        self.update(sample_id, |s| s.trajectory = Some(trajectory))
            .map(|_| ())
    }

    pub fn set_evaluation(
        &self,
        sample_id: &str,
        evaluation: crate::evaluate::Evaluation,
    ) -> Result<(), StoreError> {
        self.update(sample_id, |s| s.evaluation = Some(evaluation))
            .map(|_| ())
    }

    /// Finished samples after `cursor`, oldest first, at most `limit`.
    pub fn results_after(
        &self,
        cursor: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Sample)>, StoreError> {
        let tx = self.db.begin_read()?;
        let results = tx.open_table(RESULTS)?;
        let samples = tx.open_table(SAMPLES)?;
        let mut out = Vec::new();
        for item in results.range(cursor + 1..)? {
            let (k, v) = item?;
            if let Some(s) = samples.get(v.value())? {
                out.push((k.value(), serde_json::from_slice(s.value())?));
            }
            if out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    /// Marks a rollout cancelled and ends its samples that have not started; returns those
    /// (ended now) and the samples still running (the pipeline stops them).
    pub fn cancel(
        &self,
        rollout_id: &str,
        now_ms: u64,
    ) -> Result<(Vec<Sample>, Vec<Sample>), StoreError> {
        {
            let tx = self.db.begin_write()?;
            {
                let mut r = tx.open_table(ROLLOUTS)?;
                let mut rollout: Rollout = match r.get(rollout_id)? {
                    Some(v) => serde_json::from_slice(v.value())?,
                    None => return Err(StoreError::NotFound(format!("rollout {rollout_id}"))),
                };
                rollout.cancelled = true;
                r.insert(rollout_id, serde_json::to_vec(&rollout)?.as_slice())?;
            }
            tx.commit()?;
        }
        let (_, samples) = self.rollout(rollout_id)?;
        let (mut queued, mut running) = (Vec::new(), Vec::new());
        for s in samples {
            match s.stage {
                Stage::Queued => {
                    self.finish(&s.sample_id, Outcome::Cancelled, now_ms)?;
                    queued.push(s);
                }
                Stage::Done => {}
                _ => running.push(s),
            }
        }
        Ok((queued, running))
    }

    /// After a restart: samples that were in a stage are queued again, or failed once they
    /// have had `max_attempts`; returns every queued sample with its rollout, highest
    /// priority first, then oldest.
    pub fn recover(
        &self,
        max_attempts: u32,
        now_ms: u64,
    ) -> Result<Vec<(Rollout, Sample)>, StoreError> {
        let interrupted: Vec<Sample> = self
            .all_samples()?
            .into_iter()
            .filter(|s| matches!(s.stage, Stage::Init | Stage::Run | Stage::PostRun))
            .collect();
        for s in interrupted {
            if s.attempt >= max_attempts {
                self.finish(
                    &s.sample_id,
                    Outcome::Error {
                        reason: format!(
                            "the node restarted while this sample ran, {} times",
                            s.attempt
                        ),
                    },
                    now_ms,
                )?;
            } else {
                self.set_stage(&s.sample_id, Stage::Queued, now_ms)?;
            }
        }
        let mut queued = Vec::new();
        for s in self.all_samples()? {
            if s.stage == Stage::Queued {
                let (rollout, _) = self.rollout(&s.rollout_id)?;
                queued.push((rollout, s));
            }
        }
        queued.sort_by(|(ra, sa), (rb, sb)| {
            rb.spec
                .priority
                .cmp(&ra.spec.priority)
                .then(ra.submitted_ms.cmp(&rb.submitted_ms))
                .then(sa.sample_id.cmp(&sb.sample_id))
        });
        Ok(queued)
    }

    pub fn set_agent(
        &self,
        sample_id: &str,
        agent: crate::task::AgentReport,
    ) -> Result<(), StoreError> {
        self.update(sample_id, |s| s.agent = Some(agent))
            .map(|_| ())
    }

    /// Deliveries due at `now_ms` that `admit` takes (at most `limit`), soonest first, and
    /// when the next one not yet due is. A due delivery `admit` turns down (already in flight,
    /// or its receiver busy) is left for a later call.
    pub fn outbox_due(
        &self,
        now_ms: u64,
        limit: usize,
        mut admit: impl FnMut(&str, &OutboxEntry) -> bool,
    ) -> Result<OutboxDue, StoreError> {
        let tx = self.db.begin_read()?;
        let t = tx.open_table(OUTBOX)?;
        let mut due = Vec::new();
        let mut next: Option<u64> = None;
        for item in t.iter()? {
            let (k, v) = item?;
            let e: OutboxEntry = serde_json::from_slice(v.value())?;
            if e.next_ms > now_ms {
                next = Some(next.map_or(e.next_ms, |n| n.min(e.next_ms)));
            } else if due.len() < limit && admit(k.value(), &e) {
                due.push((k.value().to_owned(), e));
            }
        }
        due.sort_by_key(|(_, e)| e.next_ms);
        Ok((due, next))
    }

    /// Puts a delivery back for a later attempt.
    pub fn outbox_retry(&self, sample_id: &str, entry: &OutboxEntry) -> Result<(), StoreError> {
        let tx = self.db.begin_write()?;
        tx.open_table(OUTBOX)?
            .insert(sample_id, serde_json::to_vec(entry)?.as_slice())?;
        tx.commit()?;
        Ok(())
    }

    /// Ends a delivery (delivered, or given up with the reason) and notes it on the sample.
    pub fn outbox_done(
        &self,
        sample_id: &str,
        attempts: u32,
        error: Option<String>,
    ) -> Result<(), StoreError> {
        {
            let tx = self.db.begin_write()?;
            tx.open_table(OUTBOX)?.remove(sample_id)?;
            tx.commit()?;
        }
        self.update(sample_id, |s| {
            s.callback = Some(crate::task::CallbackStatus {
                delivered: error.is_none(),
                attempts,
                error,
            })
        })
        .map(|_| ())
    }

    fn all_samples(&self) -> Result<Vec<Sample>, StoreError> {
        let tx = self.db.begin_read()?;
        let s = tx.open_table(SAMPLES)?;
        let mut out = Vec::new();
        for item in s.iter()? {
            let (_, v) = item?;
            out.push(serde_json::from_slice(v.value())?);
        }
        Ok(out)
    }

    fn update(
        &self,
        sample_id: &str,
        f: impl FnOnce(&mut Sample),
    ) -> Result<(Sample, ()), StoreError> {
        let tx = self.db.begin_write()?;
        let sample;
        {
            let mut s = tx.open_table(SAMPLES)?;
            let mut current: Sample = match s.get(sample_id)? {
                Some(v) => serde_json::from_slice(v.value())?,
                None => return Err(StoreError::NotFound(format!("sample {sample_id}"))),
            };
            f(&mut current);
            s.insert(sample_id, serde_json::to_vec(&current)?.as_slice())?;
            sample = current;
        }
        tx.commit()?;
        Ok((sample, ()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::*;

    fn spec(n: u32, priority: i32) -> TaskSpec {
        serde_json::from_value(serde_json::json!({
            "task_id": "t", "instruction": "fix it",
            "workspace": {"dir": {"path": "/tmp/x"}},
            "harness": {"name": "pi"},
            "evaluator": {"kind": "session-completed"},
            "num_samples": n, "priority": priority
        }))
        .unwrap()
    }

    #[test]
    fn the_store_is_the_nodes_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.redb");
        drop(Store::open(&path).unwrap());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        // One an older node left readable is tightened.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        drop(Store::open(&path).unwrap());
        assert_eq!(mode(&path), 0o600);
    }

    #[test]
    fn accepted_work_survives_a_restart_and_running_samples_are_rerun() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.redb");
        let (low, high) = {
            let store = Store::open(&path).unwrap();
            let (low, samples) = store.submit(spec(2, 0), 1).unwrap();
            let (high, _) = store.submit(spec(1, 5), 2).unwrap();
            store
                .set_stage(&samples[0].sample_id, Stage::Init, 3)
                .unwrap();
            store
                .set_stage(&samples[0].sample_id, Stage::Run, 4)
                .unwrap();
            (low, high)
        }; // the node dies here
        let store = Store::open(&path).unwrap();
        let queued = store.recover(3, 10).unwrap();
        let order: Vec<&str> = queued.iter().map(|(_, s)| s.sample_id.as_str()).collect();
        let want = [
            format!("{}-0", high.rollout_id),
            format!("{}-0", low.rollout_id),
            format!("{}-1", low.rollout_id),
        ];
        assert_eq!(order, want.iter().map(String::as_str).collect::<Vec<_>>());
        let rerun = store.sample(&want[1]).unwrap();
        assert_eq!((rerun.stage, rerun.attempt), (Stage::Queued, 1));
    }

    #[test]
    fn a_sample_interrupted_too_often_fails_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("n.redb")).unwrap();
        let (_, samples) = store.submit(spec(1, 0), 1).unwrap();
        let id = &samples[0].sample_id;
        for _ in 0..2 {
            store.set_stage(id, Stage::Init, 2).unwrap();
            store.recover(2, 3).unwrap();
        }
        let s = store.sample(id).unwrap();
        assert_eq!(s.stage, Stage::Done);
        assert!(
            matches!(&s.outcome, Some(Outcome::Error { reason }) if reason.contains("2 times"))
        );
        assert_eq!(store.results_after(0, 10).unwrap().len(), 1);
    }

    #[test]
    fn results_page_in_finish_order_and_a_sample_ends_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("n.redb")).unwrap();
        let (_, samples) = store.submit(spec(3, 0), 1).unwrap();
        let c2 = store
            .finish(&samples[2].sample_id, Outcome::Completed { reward: 1.0 }, 5)
            .unwrap();
        let c0 = store
            .finish(&samples[0].sample_id, Outcome::Completed { reward: 0.0 }, 6)
            .unwrap();
        assert!(c0 > c2);
        let again = store
            .finish(&samples[2].sample_id, Outcome::Cancelled, 7)
            .unwrap();
        assert_eq!(again, c2, "a second finish keeps the first outcome");
        let page = store.results_after(0, 10).unwrap();
        let ids: Vec<&str> = page.iter().map(|(_, s)| s.sample_id.as_str()).collect();
        assert_eq!(
            ids,
            [samples[2].sample_id.as_str(), samples[0].sample_id.as_str()]
        );
        assert_eq!(page[0].1.outcome, Some(Outcome::Completed { reward: 1.0 }));
        assert_eq!(store.results_after(c2, 10).unwrap().len(), 1);
        assert!(store.results_after(c0, 10).unwrap().is_empty());
    }

    #[test]
    fn cancelling_ends_queued_samples_and_reports_running_ones() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("n.redb")).unwrap();
        let (r, samples) = store.submit(spec(3, 0), 1).unwrap();
        store
            .set_stage(&samples[1].sample_id, Stage::Init, 2)
            .unwrap();
        let (queued, running) = store.cancel(&r.rollout_id, 3).unwrap();
        assert_eq!((queued.len(), running.len()), (2, 1));
        assert_eq!(running[0].sample_id, samples[1].sample_id);
        let (r, samples) = store.rollout(&r.rollout_id).unwrap();
        assert!(r.cancelled);
        assert_eq!(samples[0].outcome, Some(Outcome::Cancelled));
        assert_eq!(samples[2].outcome, Some(Outcome::Cancelled));
        assert!(samples[1].outcome.is_none());
    }
}
