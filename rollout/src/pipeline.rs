//! The staged pipeline: INIT (working copy + set-up) → RUN (the harness, in its own process
//! group, killed at its budget) → POST_RUN (evaluate, reward, record the outcome). Each stage
//! has its own bounded pool, so slow agents never starve set-up or evaluation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::process::Command;
use tokio::sync::{mpsc, Mutex, Notify};

use crate::capture::NodeCapture;
use crate::evaluate::{self, EvalPaths};
use crate::preset::{self, HarnessEnv};
use crate::store::{Store, StoreError};
use crate::workspace;
use tokentap_reconstruct::{build_all, verify, RecordDigest};
use tokentap_schema::Trace;

use crate::task::{Outcome, Rollout, Sample, Stage, TrajectorySummary, Workspace};

/// How a node runs its stages.
#[derive(Clone)]
pub struct PipelineConfig {
    /// Per-sample directories live here.
    pub data_dir: PathBuf,
    pub init_workers: usize,
    pub run_workers: usize,
    pub post_workers: usize,
    /// Restarts a sample survives before it is failed.
    pub max_attempts: u32,
    /// Where samples' model calls are captured (None: not captured, no trajectories).
    pub capture: Option<Arc<NodeCapture>>,
    /// Samples prepared ahead of a free RUN slot (prewarmed working copies).
    pub prewarm: usize,
    /// PATH for harnesses (node and the harness binaries first).
    pub harness_path: String,
    /// The model name harnesses are told to use (the capture maps it to the engine's).
    pub harness_model: String,
    /// Send harnesses' non-loopback HTTP(S) to a dead local proxy.
    pub block_egress: bool,
}

impl PipelineConfig {
    /// A node's defaults for everything but where its data lives.
    pub fn new(data_dir: PathBuf) -> PipelineConfig {
        PipelineConfig {
            data_dir,
            init_workers: 2,
            run_workers: 4,
            post_workers: 2,
            max_attempts: 3,
            capture: None,
            prewarm: 2,
            harness_path: std::env::var("PATH")
                .unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
            harness_model: "tokentap-policy".into(),
            block_egress: false,
        }
    }
}

/// A sample on its way through the stages.
struct Job {
    rollout: Arc<Rollout>,
    sample: Sample,
    dir: PathBuf,
    /// What RUN saw, for POST_RUN.
    run: Option<RunResult>,
}

#[derive(Debug, Clone)]
struct RunResult {
    exit_code: Option<i32>,
    timed_out: bool,
}

/// The running pipeline; `submit` queues a rollout's samples.
pub struct Pipeline {
    store: Arc<Store>,
    init_tx: mpsc::Sender<Job>,
    /// Process groups of the agents running now, by sample id.
    running: Arc<StdMutex<HashMap<String, i32>>>,
    /// Woken whenever a sample ends (long-polling readers of the results log wait on it).
    pub finished: Arc<Notify>,
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Pipeline {
    /// Starts the pools and re-queues what a previous run of the node left unfinished.
    pub async fn start(store: Arc<Store>, config: PipelineConfig) -> Result<Pipeline, StoreError> {
        let finished = Arc::new(Notify::new());
        let running: Arc<StdMutex<HashMap<String, i32>>> = Arc::default();
        let (init_tx, init_rx) = mpsc::channel::<Job>(1024);
        let (run_tx, run_rx) = mpsc::channel::<Job>(config.prewarm.max(1));
        let (post_tx, post_rx) = mpsc::channel::<Job>(1024);
        let (init_rx, run_rx, post_rx) = (
            Arc::new(Mutex::new(init_rx)),
            Arc::new(Mutex::new(run_rx)),
            Arc::new(Mutex::new(post_rx)),
        );
        for _ in 0..config.init_workers.max(1) {
            let (rx, tx, store, cfg) = (
                init_rx.clone(),
                run_tx.clone(),
                store.clone(),
                config.clone(),
            );
            tokio::spawn(async move {
                while let Some(mut job) = next(&rx).await {
                    match init(&store, &cfg, &mut job).await {
                        Ok(true) => {
                            let _ = tx.send(job).await;
                        }
                        Ok(false) => {} // ended while queued (cancelled)
                        Err(e) => fail(&store, &job, format!("init: {e}")),
                    }
                }
            });
        }
        for _ in 0..config.run_workers.max(1) {
            let (rx, tx, store, running, cfg) = (
                run_rx.clone(),
                post_tx.clone(),
                store.clone(),
                running.clone(),
                config.clone(),
            );
            tokio::spawn(async move {
                while let Some(mut job) = next(&rx).await {
                    match run(&store, &cfg, &running, &mut job).await {
                        Ok(()) => {
                            let _ = tx.send(job).await;
                        }
                        Err(e) => fail(&store, &job, format!("run: {e}")),
                    }
                }
            });
        }
        for _ in 0..config.post_workers.max(1) {
            let (rx, store, finished, cfg) = (
                post_rx.clone(),
                store.clone(),
                finished.clone(),
                config.clone(),
            );
            tokio::spawn(async move {
                while let Some(job) = next(&rx).await {
                    match post_run(&store, &cfg, &job).await {
                        Ok(outcome) => {
                            let _ = store.finish(&job.sample.sample_id, outcome, now_ms());
                        }
                        Err(e) => fail(&store, &job, format!("post-run: {e}")),
                    }
                    finished.notify_waiters();
                }
            });
        }
        let pipeline = Pipeline {
            store: store.clone(),
            init_tx,
            running,
            finished,
        };
        for (rollout, sample) in store.recover(config.max_attempts, now_ms())? {
            pipeline
                .enqueue(Arc::new(rollout), sample, &config.data_dir)
                .await;
        }
        Ok(pipeline)
    }

    /// Queues every sample of a freshly stored rollout.
    pub async fn submit(&self, rollout: Rollout, samples: Vec<Sample>, data_dir: &Path) {
        let rollout = Arc::new(rollout);
        for s in samples {
            self.enqueue(rollout.clone(), s, data_dir).await;
        }
    }

    async fn enqueue(&self, rollout: Arc<Rollout>, sample: Sample, data_dir: &Path) {
        let dir = data_dir.join("samples").join(&sample.sample_id);
        let _ = self
            .init_tx
            .send(Job {
                rollout,
                sample,
                dir,
                run: None,
            })
            .await;
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Kills the agents of these samples (a cancelled rollout); they end `cancelled`.
    pub fn cancel_running(&self, samples: &[Sample]) {
        let running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        for s in samples {
            if let Some(pgid) = running.get(&s.sample_id) {
                // SAFETY: kill(2) on a process group one of our agents leads.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
            }
        }
    }
}

async fn next(rx: &Mutex<mpsc::Receiver<Job>>) -> Option<Job> {
    rx.lock().await.recv().await
}

fn fail(store: &Store, job: &Job, reason: String) {
    tracing::warn!(sample = %job.sample.sample_id, %reason, "sample failed");
    let _ = store.finish(&job.sample.sample_id, Outcome::Error { reason }, now_ms());
}

/// Prepares the working copy; false when the sample ended while queued.
async fn init(store: &Store, cfg: &PipelineConfig, job: &mut Job) -> anyhow::Result<bool> {
    let current = store.sample(&job.sample.sample_id)?;
    if current.stage == Stage::Done {
        return Ok(false);
    }
    job.sample = store.set_stage(&job.sample.sample_id, Stage::Init, now_ms())?;
    tokio::fs::create_dir_all(&job.dir).await?;
    let spec = &job.rollout.spec;
    let original = workspace::snapshot(&spec.workspace, &rollout_dir(cfg, &job.rollout)).await?;
    let setup = match &spec.workspace {
        Workspace::Dir { setup, .. } | Workspace::Git { setup, .. } => setup.as_deref(),
    };
    workspace::working_copy(
        &original,
        &job.dir.join("work"),
        setup,
        &job.dir.join("setup.log"),
    )
    .await?;
    for d in ["home", "tmp"] {
        let d = job.dir.join(d);
        if d.exists() {
            tokio::fs::remove_dir_all(&d).await?;
        }
        tokio::fs::create_dir_all(&d).await?;
    }
    Ok(true)
}

fn rollout_dir(cfg: &PipelineConfig, rollout: &Rollout) -> PathBuf {
    cfg.data_dir.join("rollouts").join(&rollout.rollout_id)
}

/// What is left of the sample's session budget (from the start of INIT).
fn session_left(job: &Job) -> Duration {
    let started = job.sample.stage_started_ms[0];
    let used = Duration::from_millis(now_ms().saturating_sub(started));
    Duration::from_secs(job.rollout.spec.budgets.session_s).saturating_sub(used)
}

async fn run(
    store: &Store,
    cfg: &PipelineConfig,
    running: &StdMutex<HashMap<String, i32>>,
    job: &mut Job,
) -> anyhow::Result<()> {
    job.sample = store.set_stage(&job.sample.sample_id, Stage::Run, now_ms())?;
    let spec = &job.rollout.spec;
    let session = job.sample.sample_id.clone();
    let server = match &cfg.capture {
        Some(c) => {
            c.index.watch(&session);
            c.server(&session)
        }
        None => preset::DEAD_PROXY.to_owned(),
    };
    let env = HarnessEnv {
        home: job.dir.join("home"),
        work: job.dir.join("work"),
        tmp: job.dir.join("tmp"),
        path: cfg.harness_path.clone(),
        server,
        // A placeholder: the engine's credentials never reach the agent.
        api_key: "tokentap".into(),
        model: cfg.harness_model.clone(),
        block_egress: cfg.block_egress,
    };
    if let Some(exe) = preset::executable(&spec.harness) {
        if preset::on_path(exe, &env.path).is_none() {
            anyhow::bail!(
                "the {exe} harness is not installed on the node's harness path ({})",
                env.path
            );
        }
    }
    let log = std::fs::File::create(job.dir.join("agent.log"))?;
    let mut cmd = Command::from(preset::for_sample(
        &spec.harness,
        &env,
        &spec.instruction,
        &session,
    )?);
    let mut child = cmd
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .kill_on_drop(true)
        .spawn()?;
    let pgid = child.id().map(|p| p as i32);
    if let Some(pgid) = pgid {
        running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(job.sample.sample_id.clone(), pgid);
        // A cancel that came while the sample was in INIT, or just before the line above,
        // found no process group to kill: look again now that it is registered.
        if store.rollout(&job.sample.rollout_id)?.0.cancelled {
            // SAFETY: kill(2) on the process group this child leads.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }
    let budget = Duration::from_secs(spec.budgets.agent_s).min(session_left(job));
    let result = match tokio::time::timeout(budget, child.wait()).await {
        Ok(status) => RunResult {
            exit_code: status?.code(),
            timed_out: false,
        },
        Err(_) => RunResult {
            exit_code: None,
            timed_out: true,
        },
    };
    if let Some(pgid) = pgid {
        // At the budget the whole group goes; after a normal exit, so do the tools the agent
        // left running in the background.
        // SAFETY: kill(2) on the process group this child led.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
    let _ = child.wait().await;
    running
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&job.sample.sample_id);
    job.run = Some(result);
    Ok(())
}

async fn post_run(store: &Store, cfg: &PipelineConfig, job: &Job) -> anyhow::Result<Outcome> {
    store.set_stage(&job.sample.sample_id, Stage::PostRun, now_ms())?;
    let outcome = outcome(store, cfg, job).await?;
    if let Some(c) = &cfg.capture {
        let summary = trajectory(c, job, &outcome).await?;
        store.set_trajectory(&job.sample.sample_id, summary)?;
    }
    Ok(outcome)
}

/// The sample's records → traces with the outcome's reward, in `traces.jsonl` of its
/// directory. A sample that did not complete keeps its traces with reward 0 and every mask
/// bit cleared: nothing of it is trained on, but nothing captured is lost.
async fn trajectory(
    capture: &NodeCapture,
    job: &Job,
    outcome: &Outcome,
) -> anyhow::Result<TrajectorySummary> {
    let session = &job.sample.sample_id;
    let (records, complete) = capture.collect(session, Duration::from_secs(30)).await;
    let strategy = job.rollout.spec.strategy;
    let mut traces: Vec<Trace> = build_all(&records, strategy)
        .into_iter()
        .flat_map(|s| s.traces)
        .collect();
    let digests: HashMap<String, RecordDigest> = records
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    let faithfulness = verify(&traces, &digests);
    let (reward, keep_mask) = match outcome {
        Outcome::Completed { reward } => (*reward, true),
        _ => (0.0, false),
    };
    for t in &mut traces {
        t.reward = Some(reward);
        t.group_id = Some(job.rollout.spec.task_id.clone());
        if !keep_mask {
            t.loss_mask.iter_mut().for_each(|m| *m = 0);
        }
    }
    let path = job.dir.join("traces.jsonl");
    let mut out = Vec::new();
    for t in &traces {
        serde_json::to_writer(&mut out, t)?;
        out.push(b'\n');
    }
    tokio::fs::write(&path, out).await?;
    Ok(TrajectorySummary {
        path: path.display().to_string(),
        calls: records.len() as u32,
        traces: traces.len() as u32,
        trainable_tokens: traces
            .iter()
            .map(|t| t.loss_mask.iter().filter(|m| **m == 1).count() as u64)
            .sum(),
        faithfulness_violations: faithfulness.violations,
        complete,
    })
}

async fn outcome(store: &Store, cfg: &PipelineConfig, job: &Job) -> anyhow::Result<Outcome> {
    if store.rollout(&job.sample.rollout_id)?.0.cancelled {
        return Ok(Outcome::Cancelled);
    }
    let run = job.run.clone().unwrap_or(RunResult {
        exit_code: None,
        timed_out: false,
    });
    let spec = &job.rollout.spec;
    if run.timed_out {
        // Not evaluated: the agent did not finish; its partial trajectory is still kept.
        return Ok(Outcome::Timeout {
            reward: 0.0,
            reason: format!(
                "the agent ran over its budget ({} s agent, {} s session)",
                spec.budgets.agent_s, spec.budgets.session_s
            ),
        });
    }
    let original = rollout_dir(cfg, &job.rollout).join("original");
    let budget = Duration::from_secs(spec.budgets.eval_s)
        .min(session_left(job))
        .max(Duration::from_secs(1));
    let evaluation = evaluate::evaluate(
        &spec.evaluator,
        run.exit_code == Some(0),
        &EvalPaths {
            work: &job.dir.join("work"),
            original: &original,
            sample_dir: &job.dir,
        },
        budget,
    )
    .await?;
    let reward = evaluation.reward;
    store.set_evaluation(&job.sample.sample_id, evaluation)?;
    Ok(Outcome::Completed { reward })
}
