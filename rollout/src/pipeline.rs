//! The staged pipeline: INIT (working copy + set-up) → RUN (the harness, in its own process
//! group, killed at its budget) → POST_RUN (reconstruct, evaluate, reward, record the
//! outcome). Each stage has its own bounded pool, so slow agents never starve set-up or
//! evaluation.

use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tokio::process::Command;
use tokio::sync::{broadcast, mpsc, Mutex, Notify};

use crate::capture::NodeCapture;
pub use crate::clock::now_ms;
use crate::deliver::{self, DeliveryPolicy};
use crate::evaluate::{self, EvalPaths};
use crate::gate::{NodeGate, SessionPolicy};
use crate::metrics::StageMetrics;
use crate::preset::{self, HarnessEnv};
use crate::sample_disk::{self, SampleDisk};
use crate::sample_files::{create_fresh, write_fresh};
use crate::sandbox::{self, Mounts, Ready, SandboxConfig, TaskJail};
use crate::store::{Store, StoreError};
use crate::transparent::{SampleInterception, TransparentConfig};
use crate::uids::{UidLease, UidPool};
use crate::workspace;
use tokentap_cgroup::{LimitedCgroup, Limits};
use tokentap_reconstruct::{build_all, verify, RecordDigest};
use tokentap_schema::Trace;

use crate::task::{
    AgentReport, CaptureMode, Harness, Incomplete, NodeCeilings, Outcome, Rollout, Sample, Stage,
    TaskSpec, TokenMode, TrajectorySummary, Workspace,
};

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
    /// Samples prepared ahead of a free RUN slot (prewarmed working copies); 0: a sample's
    /// INIT starts only when a RUN slot is free for it.
    pub prewarm: usize,
    /// PATH for harnesses (node and the harness binaries first).
    pub harness_path: String,
    /// The model name harnesses are told to use (the capture maps it to the engine's).
    pub harness_model: String,
    /// Send harnesses' non-loopback HTTP(S) to a dead local proxy.
    pub block_egress: bool,
    /// How results are POSTed to callback URLs.
    pub delivery: DeliveryPolicy,
    /// The admission gate in the node's capture (pause/resume, task sampling).
    pub gate: Option<Arc<NodeGate>>,
    /// Agent limits where a task sets none; also the most a task may ask for.
    pub limits: Limits,
    /// What a task may ask for beyond the limits (samples, budgets).
    pub ceilings: NodeCeilings,
    /// How agents are sandboxed (None: this node cannot; tasks asking for it fail).
    pub sandbox: Option<SandboxConfig>,
    /// Each sample's own file system of this many MiB (`sample_disk`; root only); None: a
    /// sample writes on the data directory's file system, uncapped.
    pub disk_mb: Option<u64>,
    /// Transparent capture for agents with hard-coded endpoints (None: this node cannot;
    /// tasks asking for it fail).
    pub transparent: Option<Arc<TransparentConfig>>,
    /// Samples come from a cluster's queue on the bus (`serve --bus`): what the store holds
    /// unfinished from an earlier run is not re-run here (the bus redelivers it, to whichever
    /// node is free), and callbacks are not delivered from this node's outbox (the bus's
    /// callback queue delivers them, once across nodes).
    pub clustered: bool,
    /// A uid of its own for each sample's sandboxed task code (a root node's
    /// `--sandbox-uid-range`), leased at INIT, given back at its end; None: every sample runs
    /// as the sandbox's `run_as`.
    pub uids: Option<Arc<UidPool>>,
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
            delivery: DeliveryPolicy::default(),
            gate: None,
            limits: Limits::default(),
            ceilings: NodeCeilings::default(),
            sandbox: None,
            disk_mb: None,
            transparent: None,
            clustered: false,
            uids: None,
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
    /// When the job entered its current queue (for the time-waiting metric).
    queued_at: Instant,
    /// Its claim on a RUN slot (or a prewarm place), from INIT until RUN ends.
    slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// Its capped file system, from INIT to its end (released before the end is announced).
    disk: Option<SampleDisk>,
    /// The uid its sandboxed task code runs as, from INIT to its end (given back on drop).
    uid: Option<UidLease>,
}

#[derive(Debug, Clone)]
struct RunResult {
    exit_code: Option<i32>,
    timed_out: bool,
}

/// Progress of a rollout's samples, as `GET /v1/rollouts/{id}/events` streams it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    Stage {
        rollout_id: String,
        sample_id: String,
        stage: Stage,
        at_ms: u64,
    },
    Finished {
        rollout_id: String,
        sample_id: String,
        outcome: Outcome,
    },
}

impl Event {
    pub fn rollout_id(&self) -> &str {
        match self {
            Event::Stage { rollout_id, .. } | Event::Finished { rollout_id, .. } => rollout_id,
        }
    }
}

/// What every stage worker shares.
struct Shared {
    store: Arc<Store>,
    cfg: PipelineConfig,
    /// Process groups of the agents running now, by sample id.
    running: StdMutex<HashMap<String, i32>>,
    events: broadcast::Sender<Event>,
    finished: Arc<Notify>,
    metrics: StageMetrics,
}

impl Shared {
    fn enter(&self, job: &mut Job, stage: Stage) -> Result<(), StoreError> {
        let at_ms = now_ms();
        job.sample = self.store.set_stage(&job.sample.sample_id, stage, at_ms)?;
        let _ = self.events.send(Event::Stage {
            rollout_id: job.sample.rollout_id.clone(),
            sample_id: job.sample.sample_id.clone(),
            stage,
            at_ms,
        });
        Ok(())
    }

    fn finish(&self, sample: &Sample, outcome: Outcome) {
        if let Err(e) = self
            .store
            .finish(&sample.sample_id, outcome.clone(), now_ms())
        {
            tracing::error!(sample = %sample.sample_id, error = %e, "recording a sample's end");
        }
        self.announce_end(sample, outcome);
    }

    /// Tells metrics, event streams and result waiters that a (stored) sample ended.
    fn announce_end(&self, sample: &Sample, outcome: Outcome) {
        self.metrics.ended(&sample.task_id, &outcome);
        let _ = self.events.send(Event::Finished {
            rollout_id: sample.rollout_id.clone(),
            sample_id: sample.sample_id.clone(),
            outcome,
        });
        self.finished.notify_waiters();
    }

    fn fail(&self, job: &Job, reason: String) {
        tracing::warn!(sample = %job.sample.sample_id, %reason, "sample failed");
        self.finish(&job.sample, Outcome::Error { reason });
    }
}

/// Samples waiting for INIT: highest priority first, then in submission order.
#[derive(Default)]
struct InitQueue {
    heap: StdMutex<BinaryHeap<Queued>>,
    ready: Notify,
    seq: AtomicU64,
}

struct Queued {
    priority: i32,
    seq: u64,
    job: Job,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        (self.priority, self.seq) == (o.priority, o.seq)
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.priority.cmp(&o.priority).then(o.seq.cmp(&self.seq))
    }
}

impl InitQueue {
    fn push(&self, job: Job) -> usize {
        let q = Queued {
            priority: job.rollout.spec.priority,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            job,
        };
        let len = {
            let mut heap = self.heap.lock().unwrap_or_else(|e| e.into_inner());
            heap.push(q);
            heap.len()
        };
        self.ready.notify_one();
        len
    }

    async fn pop(&self) -> (Job, usize) {
        loop {
            {
                let mut heap = self.heap.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(q) = heap.pop() {
                    return (q.job, heap.len());
                }
            }
            self.ready.notified().await;
        }
    }
}

/// The running pipeline; `submit` queues a rollout's samples.
pub struct Pipeline {
    shared: Arc<Shared>,
    init_queue: Arc<InitQueue>,
    /// Woken whenever a sample ends (long-polling readers of the results log wait on it).
    pub finished: Arc<Notify>,
}

impl Pipeline {
    /// Starts the pools and the callback deliverer, and re-queues what a previous run of the
    /// node left unfinished.
    pub async fn start(store: Arc<Store>, config: PipelineConfig) -> Result<Pipeline, StoreError> {
        // A killed node's agents may still run in its sample cgroups: end them before the
        // samples they belonged to are re-queued; then the disks they wrote on can go.
        tokentap_cgroup::limited::remove_stale_limited();
        for d in sample_disk::release_stale(&config.data_dir) {
            tracing::info!(dir = %d.display(), "released a sample disk a stopped node left mounted");
        }
        let finished = Arc::new(Notify::new());
        let shared = Arc::new(Shared {
            store: store.clone(),
            cfg: config.clone(),
            running: StdMutex::default(),
            events: broadcast::channel(4096).0,
            finished: finished.clone(),
            metrics: StageMetrics::new(),
        });
        let init_queue = Arc::new(InitQueue::default());
        // INIT runs ahead of RUN by at most `prewarm` samples: a sample claims a slot before
        // its INIT and gives it back when its RUN ends.
        let slots = Arc::new(tokio::sync::Semaphore::new(
            config.run_workers.max(1) + config.prewarm,
        ));
        let (run_tx, run_rx) = mpsc::channel::<Job>(1024);
        let (post_tx, post_rx) = mpsc::channel::<Job>(1024);
        let (run_rx, post_rx) = (Arc::new(Mutex::new(run_rx)), Arc::new(Mutex::new(post_rx)));
        for _ in 0..config.init_workers.max(1) {
            let (queue, tx, sh, slots) = (
                init_queue.clone(),
                run_tx.clone(),
                shared.clone(),
                slots.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Ok(slot) = slots.clone().acquire_owned().await else {
                        return;
                    };
                    let (mut job, depth) = queue.pop().await;
                    job.slot = Some(slot);
                    sh.metrics.depth(Stage::Queued, depth);
                    sh.metrics.waited(Stage::Queued, job.queued_at);
                    let t = sh.metrics.enter(Stage::Init);
                    let r = init(&sh, &mut job).await;
                    t.done();
                    match r {
                        Ok(true) => {
                            let _ =
                                sh.store
                                    .stage_ended(&job.sample.sample_id, Stage::Init, now_ms());
                            job.queued_at = Instant::now();
                            sh.metrics.inc_depth(Stage::Init);
                            let _ = tx.send(job).await;
                        }
                        Ok(false) => {} // ended while queued (cancelled)
                        Err(e) => {
                            release_disk(&mut job).await;
                            sh.fail(&job, format!("init: {e:#}"))
                        }
                    }
                }
            });
        }
        for _ in 0..config.run_workers.max(1) {
            let (rx, tx, sh) = (run_rx.clone(), post_tx.clone(), shared.clone());
            tokio::spawn(async move {
                while let Some(mut job) = next(&rx).await {
                    sh.metrics.dec_depth(Stage::Init);
                    sh.metrics.waited(Stage::Init, job.queued_at);
                    let t = sh.metrics.enter(Stage::Run);
                    let r = run(&sh, &mut job).await;
                    let _ = sh
                        .store
                        .stage_ended(&job.sample.sample_id, Stage::Run, now_ms());
                    job.slot = None;
                    t.done();
                    match r {
                        Ok(()) => {
                            job.queued_at = Instant::now();
                            sh.metrics.inc_depth(Stage::Run);
                            let _ = tx.send(job).await;
                        }
                        Err(e) => {
                            release_disk(&mut job).await;
                            sh.fail(&job, format!("run: {e:#}"))
                        }
                    }
                }
            });
        }
        for _ in 0..config.post_workers.max(1) {
            let (rx, sh) = (post_rx.clone(), shared.clone());
            tokio::spawn(async move {
                while let Some(mut job) = next(&rx).await {
                    sh.metrics.dec_depth(Stage::Run);
                    sh.metrics.waited(Stage::Run, job.queued_at);
                    let t = sh.metrics.enter(Stage::PostRun);
                    let r = post_run(&sh, &mut job).await;
                    t.done();
                    // Before the end is announced: what then reads the sample's traces finds
                    // them in its plain directory.
                    release_disk(&mut job).await;
                    match r {
                        Ok(outcome) => sh.finish(&job.sample, outcome),
                        Err(e) => sh.fail(&job, format!("post-run: {e:#}")),
                    }
                }
            });
        }
        if !config.clustered {
            tokio::spawn(deliver::run(
                store.clone(),
                finished.clone(),
                config.delivery.clone(),
            ));
        }
        let pipeline = Pipeline {
            shared,
            init_queue,
            finished,
        };
        if !config.clustered {
            for (rollout, sample) in store.recover(config.max_attempts, now_ms())? {
                pipeline.enqueue(Arc::new(rollout), sample);
            }
        }
        Ok(pipeline)
    }

    /// Queues every sample of a freshly stored rollout.
    pub fn submit(&self, rollout: Rollout, samples: Vec<Sample>) {
        let rollout = Arc::new(rollout);
        for s in samples {
            self.enqueue(rollout.clone(), s);
        }
    }

    /// Queues one sample this node claimed from a cluster's queue (stored here already with
    /// [`Store::adopt`]).
    pub fn run_claimed(&self, rollout: Rollout, sample: Sample) {
        self.enqueue(Arc::new(rollout), sample);
    }

    /// How many samples this node holds at once: its RUN slots and the prewarmed ahead of
    /// them (a cluster node claims no more than this from the queue).
    pub fn capacity(&self) -> usize {
        self.shared.cfg.run_workers.max(1) + self.shared.cfg.prewarm
    }

    /// The most times a sample is started before it is failed.
    pub fn max_attempts(&self) -> u32 {
        self.shared.cfg.max_attempts
    }

    /// How results are POSTed to callback URLs.
    pub fn delivery(&self) -> &DeliveryPolicy {
        &self.shared.cfg.delivery
    }

    /// Kills one sample's agent, if it runs here (a cluster node that lost its claim on it).
    pub fn kill_agent(&self, sample_id: &str) {
        let pgids = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(pgid) = pgids.get(sample_id) {
            // SAFETY: kill(2) on a process group one of our agents leads.
            unsafe { libc::kill(-pgid, libc::SIGKILL) };
        }
    }

    fn enqueue(&self, rollout: Arc<Rollout>, sample: Sample) {
        let dir = self
            .shared
            .cfg
            .data_dir
            .join("samples")
            .join(&sample.sample_id);
        let depth = self.init_queue.push(Job {
            rollout,
            sample,
            dir,
            run: None,
            queued_at: Instant::now(),
            slot: None,
            disk: None,
            uid: None,
        });
        self.shared.metrics.depth(Stage::Queued, depth);
    }

    pub fn store(&self) -> &Store {
        &self.shared.store
    }

    /// Why this node refuses `spec` (over its ceilings), if it does.
    pub fn refusal(&self, spec: &TaskSpec) -> Option<String> {
        spec.over_ceilings(&self.shared.cfg.ceilings, &self.shared.cfg.limits)
            .err()
    }

    /// Progress events of every rollout, from now on.
    pub fn events(&self) -> broadcast::Receiver<Event> {
        self.shared.events.subscribe()
    }

    /// The node's admission gate, when its capture has one.
    pub fn gate(&self) -> Option<&Arc<NodeGate>> {
        self.shared.cfg.gate.as_ref()
    }

    /// The stage metrics, in Prometheus text format.
    pub fn render_metrics(&self) -> Vec<u8> {
        self.shared.metrics.render()
    }

    /// Cancels a rollout: queued samples end at once, running agents are killed (their
    /// samples end `cancelled` after POST_RUN keeps what they captured). Returns how many
    /// were running.
    pub fn cancel(&self, rollout_id: &str) -> Result<usize, StoreError> {
        let (queued, running) = self.shared.store.cancel(rollout_id, now_ms())?;
        for s in &queued {
            self.shared.announce_end(s, Outcome::Cancelled);
        }
        let pgids = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for s in &running {
            if let Some(pgid) = pgids.get(&s.sample_id) {
                // SAFETY: kill(2) on a process group one of our agents leads.
                unsafe { libc::kill(-pgid, libc::SIGKILL) };
            }
        }
        Ok(running.len())
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn next(rx: &Mutex<mpsc::Receiver<Job>>) -> Option<Job> {
    rx.lock().await.recv().await
}

/// Prepares the working copy; false when the sample ended while queued.
async fn init(sh: &Shared, job: &mut Job) -> anyhow::Result<bool> {
    let current = sh.store.sample(&job.sample.sample_id)?;
    if current.stage == Stage::Done {
        return Ok(false);
    }
    sh.enter(job, Stage::Init)?;
    let cfg = &sh.cfg;
    let root_sandbox = cfg.sandbox.as_ref().is_some_and(|s| s.run_as.is_some());
    if let (Some(pool), true, None) = (&cfg.uids, root_sandbox, &job.uid) {
        job.uid = Some(pool.lease().await);
    }
    tokio::fs::create_dir_all(&job.dir).await?;
    if let Some(mb) = cfg.disk_mb {
        let (data, dir, name) = (
            cfg.data_dir.clone(),
            job.dir.clone(),
            job.sample.sample_id.clone(),
        );
        let disk = tokio::task::spawn_blocking(move || SampleDisk::mount(&data, &dir, &name, mb))
            .await?
            .context("giving the sample its disk")?;
        job.disk = Some(disk);
    }
    let spec = &job.rollout.spec;
    let original = workspace::snapshot(&spec.workspace, &rollout_dir(cfg, &job.rollout)).await?;
    let setup = match &spec.workspace {
        Workspace::Dir { setup, .. } | Workspace::Git { setup, .. } => setup.as_deref(),
    };
    let (home, tmp) = (job.dir.join("home"), job.dir.join("tmp"));
    for d in [&home, &tmp] {
        if d.exists() {
            tokio::fs::remove_dir_all(d).await?;
        }
        tokio::fs::create_dir_all(d).await?;
    }
    workspace::working_copy(
        &original,
        &workspace::SetupPaths {
            work: &job.dir.join("work"),
            home: &home,
            tmp: &tmp,
            log: &job.dir.join("setup.log"),
        },
        setup,
        &task_jail(cfg, job),
        session_left(job).max(Duration::from_secs(1)),
    )
    .await?;
    Ok(true)
}

/// Unmounts the sample's disk, its kept files put back (off the async workers: umount and
/// the copies block).
async fn release_disk(job: &mut Job) {
    let Some(mut disk) = job.disk.take() else {
        return;
    };
    let released = tokio::task::spawn_blocking(move || disk.release()).await;
    if let Err(e) = released.map_err(anyhow::Error::from).and_then(|r| r) {
        tracing::error!(sample = %job.sample.sample_id, error = %format!("{e:#}"), "releasing a sample's disk");
    }
}

/// The node's sandbox for this sample: its task code runs as the uid it leased, if any.
fn sandbox_for(cfg: &PipelineConfig, job: &Job) -> Option<SandboxConfig> {
    let mut sb = cfg.sandbox.clone()?;
    if let (Some(_), Some(lease)) = (sb.run_as, &job.uid) {
        sb.run_as = Some((lease.uid, lease.uid));
    }
    Some(sb)
}

/// How the sample's set-up and evaluation commands are confined.
fn task_jail(cfg: &PipelineConfig, job: &Job) -> TaskJail {
    TaskJail {
        sandbox: sandbox_for(cfg, job),
        limits: job.rollout.spec.limits.or(&cfg.limits),
        path: cfg.harness_path.clone(),
        name: job.sample.capture_session(),
    }
}

/// Withdraws a sample's capture secret when its run ends, however it ends.
struct SecretGuard(Option<(Arc<NodeCapture>, String)>);

impl Drop for SecretGuard {
    fn drop(&mut self) {
        if let Some((c, s)) = &self.0 {
            c.secrets.forget(s);
        }
    }
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

async fn run(sh: &Shared, job: &mut Job) -> anyhow::Result<()> {
    sh.enter(job, Stage::Run)?;
    let (store, cfg, running) = (&sh.store, &sh.cfg, &sh.running);
    let spec = &job.rollout.spec;
    let session = job.sample.capture_session();
    // Refusals first, before anything is registered for the session.
    if let Some(exe) = preset::executable(&spec.harness) {
        if crate::runner::on_path(exe, &cfg.harness_path).is_none() {
            anyhow::bail!(
                "the {exe} harness is not installed on the node's harness path ({})",
                cfg.harness_path
            );
        }
    }
    let sandbox = sandbox_for(cfg, job);
    let sandboxed = sandbox.as_ref().filter(|s| s.always || spec.sandbox);
    if spec.sandbox && sandboxed.is_none() {
        anyhow::bail!("the task asks for a sandbox and this node has none (bubblewrap)");
    }
    let transparent = spec.capture == CaptureMode::Transparent;
    let intercepting = match (&cfg.transparent, &cfg.capture) {
        _ if !transparent => None,
        (Some(t), Some(c)) if sandboxed.is_none() => Some((t, c)),
        (_, _) if sandboxed.is_some() => anyhow::bail!(
            "transparent capture and the sandbox do not go together (the sandbox has no network to redirect)"
        ),
        _ => anyhow::bail!(
            "the task asks for transparent capture and this node has none (it needs root, cgroup v2 and tokentap built with its eBPF program)"
        ),
    };
    // A sandboxed agent's socket is its session; any other gets a secret for its base URL.
    let secret = SecretGuard(match (&cfg.capture, sandboxed) {
        (Some(c), None) => Some((c.clone(), c.secrets.issue(&session))),
        _ => None,
    });
    // Absent, the node's own mode; it was checked against the node's at submission.
    let text_mode = spec.token_mode == Some(TokenMode::Off);
    let server = match (&cfg.capture, &secret.0) {
        (Some(c), Some((_, s))) => {
            c.open_session(&session, text_mode);
            c.server(s)
        }
        (Some(c), None) => {
            c.open_session(&session, text_mode);
            c.server(&session)
        }
        (None, _) => preset::DEAD_PROXY.to_owned(),
    };
    if let Some(gate) = &cfg.gate {
        gate.register(
            &session,
            SessionPolicy {
                sampling: spec.sampling.clone(),
                policy_version: spec.policy_version.clone(),
                harness: Some(metrics_harness(&spec.harness)),
            },
        );
    }
    let env = HarnessEnv {
        home: job.dir.join("home"),
        work: job.dir.join("work"),
        tmp: job.dir.join("tmp"),
        path: cfg.harness_path.clone(),
        server,
        // A placeholder: the engine's credentials never reach the agent.
        api_key: "tokentap".into(),
        model: cfg.harness_model.clone(),
        // A proxy setting would take the agent's connects away from the redirect.
        block_egress: cfg.block_egress && !transparent,
    };
    let agent_log = job.dir.join("agent.log");
    let log = create_fresh(&agent_log)?;
    let mut cmd = preset::for_sample(&spec.harness, &env, &spec.instruction, &session)?;
    // Aborted when this function returns (the guard), so the socket lives as long as the agent.
    let mut _socket = None;
    if let Some(sb) = sandboxed {
        // The preset wrote the harness's configuration into its home.
        task_jail(cfg, job)
            .give(&[&env.home], session_left(job))
            .await?;
        let mut mounts = Mounts {
            writable: vec![env.work.clone(), env.home.clone(), env.tmp.clone()],
            ..Mounts::default()
        };
        // Without a capture the agent's base URL is the dead proxy, and inside nothing
        // listens there either.
        if let Some(c) = &cfg.capture {
            let dir = job.dir.join("sock");
            tokio::fs::create_dir_all(&dir).await?;
            let socket = dir.join(sandbox::SOCKET);
            let serve = sandbox::serve_socket(&socket, c.service.clone(), session.clone())?;
            _socket = Some(AbortOnDrop(serve));
            mounts.capture = Some((c.addr, socket));
        }
        cmd = sandbox::wrap(&cmd, sb, &mounts);
    }
    let mut cmd = Command::from(cmd);
    let ready = match sandboxed {
        Some(_) => Some(Ready::attach(&mut cmd)?),
        None => None,
    };
    let limits = spec.limits.or(&cfg.limits);
    let cgroup = LimitedCgroup::create(&session, &limits)
        .map_err(|e| anyhow::anyhow!("applying the limits {limits:?}: {e}"))?;
    if let Some(cg) = &cgroup {
        cg.enter_on_spawn(&mut cmd);
    }
    // Held until the agent is done: dropping it detaches the redirect.
    let interception = match intercepting {
        Some((t, c)) => {
            let v2 = cgroup.as_ref().and_then(LimitedCgroup::v2_dir);
            let i = SampleInterception::start(t, c.service.clone(), &session, v2)
                .await
                .map_err(|e| anyhow::anyhow!("starting transparent capture: {e:#}"))?;
            i.prepare(&mut cmd);
            Some(i)
        }
        None => None,
    };
    let started = Instant::now();
    let mut child = cmd
        // Never the node's stdin (a terminal, when a node is run by hand).
        .stdin(std::process::Stdio::null())
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
    let report = AgentReport {
        exit_code: result.exit_code,
        timed_out: result.timed_out,
        duration_ms: started.elapsed().as_millis() as u64,
        peak_memory_bytes: cgroup.as_ref().and_then(LimitedCgroup::memory_peak),
        oom_killed: cgroup.as_ref().is_some_and(LimitedCgroup::oom_killed),
        pids_limit_hit: cgroup.as_ref().is_some_and(LimitedCgroup::pids_limit_hit),
    };
    // Dropping the cgroups kills what is left in them and removes them.
    drop(interception);
    drop(cgroup);
    store.set_agent(&job.sample.sample_id, report)?;
    running
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&job.sample.sample_id);
    if let Some(gate) = &cfg.gate {
        gate.forget(&session);
    }
    drop(cmd);
    if ready.as_ref().is_some_and(|r| !r.started()) {
        let tail = std::fs::read_to_string(&agent_log).unwrap_or_default();
        let tail: Vec<&str> = tail.lines().rev().take(5).collect();
        anyhow::bail!(
            "the agent's sandbox did not start: {}",
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        );
    }
    job.run = Some(result);
    Ok(())
}

async fn post_run(sh: &Shared, job: &mut Job) -> anyhow::Result<Outcome> {
    sh.enter(job, Stage::PostRun)?;
    // Traces first, so that the evaluator can see them and reward them one by one.
    let built = match &sh.cfg.capture {
        Some(c) => Some(build_traces(c, job).await?),
        None => None,
    };
    // Shown to the evaluator unrewarded, when it reads them.
    let traces = match &built {
        Some(b) if job.rollout.spec.evaluator.reads_traces() => Some(encode_traces(&b.traces)?),
        _ => None,
    };
    let (outcome, trace_rewards) = outcome(&sh.store, &sh.cfg, job, traces.as_deref()).await?;
    if let Some(built) = built {
        let summary = reward_traces(built, job, &outcome, &trace_rewards).await?;
        sh.store.set_trajectory(&job.sample.sample_id, summary)?;
    }
    Ok(outcome)
}

/// The traces of a sample's captured calls, not yet rewarded; they go to `traces.jsonl` of its
/// directory.
struct BuiltTraces {
    traces: Vec<Trace>,
    calls: u32,
    faithfulness_violations: u64,
    complete: bool,
    path: PathBuf,
}

async fn build_traces(capture: &NodeCapture, job: &Job) -> anyhow::Result<BuiltTraces> {
    let session = job.sample.capture_session();
    let (records, complete) = capture.collect(&session, Duration::from_secs(30)).await;
    let mut traces: Vec<Trace> = build_all(&records, job.rollout.spec.strategy)
        .into_iter()
        .flat_map(|s| s.traces)
        .collect();
    let digests: HashMap<String, RecordDigest> = records
        .iter()
        .map(|r| (r.record_id.clone(), RecordDigest::of(r)))
        .collect();
    let faithfulness = verify(&traces, &digests);
    for t in &mut traces {
        t.group_id = Some(job.rollout.spec.task_id.clone());
    }
    Ok(BuiltTraces {
        traces,
        calls: records.len() as u32,
        faithfulness_violations: faithfulness.violations,
        complete,
        path: job.dir.join("traces.jsonl"),
    })
}

/// Puts the outcome's reward on every trace (or the evaluator's own reward on the traces it
/// named). A sample that did not complete gets reward 0 and its traces follow the task's
/// `incomplete` policy (by default kept with every mask bit cleared: nothing of it is trained
/// on, but nothing captured is lost).
async fn reward_traces(
    built: BuiltTraces,
    job: &Job,
    outcome: &Outcome,
    trace_rewards: &BTreeMap<String, f64>,
) -> anyhow::Result<TrajectorySummary> {
    let mut traces = built.traces;
    let (reward, keep_mask) = match (outcome, job.rollout.spec.incomplete) {
        (Outcome::Completed { reward }, _) => (*reward, true),
        (_, Incomplete::ZeroMask) => (0.0, false),
        (_, Incomplete::Keep) => (0.0, true),
        (_, Incomplete::Drop) => {
            // The records stay in the node's spool; only the sample's output goes.
            traces.clear();
            (0.0, false)
        }
    };
    for t in &mut traces {
        t.reward = Some(trace_rewards.get(&t.trace_id).copied().unwrap_or(reward));
        if !keep_mask {
            t.loss_mask.iter_mut().for_each(|m| *m = 0);
        }
    }
    let unknown: Vec<&String> = trace_rewards
        .keys()
        .filter(|id| !traces.iter().any(|t| &t.trace_id == *id))
        .collect();
    if !unknown.is_empty() {
        tracing::warn!(sample = %job.sample.sample_id, ?unknown, "the evaluator rewarded traces the sample does not have");
    }
    write_traces(&built.path, &traces).await?;
    Ok(TrajectorySummary {
        path: built.path.display().to_string(),
        session_id: job.sample.capture_session(),
        calls: built.calls,
        traces: traces.len() as u32,
        trainable_tokens: traces
            .iter()
            .map(|t| t.loss_mask.iter().filter(|m| **m == 1).count() as u64)
            .sum(),
        faithfulness_violations: built.faithfulness_violations,
        complete: built.complete,
    })
}

fn encode_traces(traces: &[Trace]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    for t in traces {
        tokentap_schema::ndjson::encode_line(t, &mut out)?;
    }
    Ok(out)
}

async fn write_traces(path: &Path, traces: &[Trace]) -> anyhow::Result<()> {
    write_fresh(path, &encode_traces(traces)?)?;
    Ok(())
}

/// How the sample ended, evaluated when the agent finished; with the evaluator's rewards for
/// single traces, if it gave any.
async fn outcome(
    store: &Store,
    cfg: &PipelineConfig,
    job: &Job,
    traces: Option<&[u8]>,
) -> anyhow::Result<(Outcome, BTreeMap<String, f64>)> {
    if store.rollout(&job.sample.rollout_id)?.0.cancelled {
        return Ok((Outcome::Cancelled, BTreeMap::new()));
    }
    let run = job.run.clone().unwrap_or(RunResult {
        exit_code: None,
        timed_out: false,
    });
    let spec = &job.rollout.spec;
    if run.timed_out {
        // Not evaluated: the agent did not finish; its partial trajectory is still kept.
        let reason = format!(
            "the agent ran over its budget ({} s agent, {} s session)",
            spec.budgets.agent_s, spec.budgets.session_s
        );
        return Ok((
            Outcome::Timeout {
                reward: 0.0,
                reason,
            },
            BTreeMap::new(),
        ));
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
            traces,
        },
        &task_jail(cfg, job),
        budget,
    )
    .await?;
    let (reward, trace_rewards) = (evaluation.reward, evaluation.trace_rewards.clone());
    store.set_evaluation(&job.sample.sample_id, evaluation)?;
    Ok((Outcome::Completed { reward }, trace_rewards))
}

/// The proxy metrics' `harness` label for a task's harness.
fn metrics_harness(harness: &Harness) -> tokentap_proxy::harness::Harness {
    use tokentap_proxy::harness::Harness as Label;
    match harness {
        Harness::Codex => Label::Codex,
        Harness::ClaudeCode => Label::ClaudeCode,
        Harness::QwenCode => Label::QwenCode,
        Harness::Pi => Label::Pi,
        Harness::Command { .. } => Label::Other,
    }
}
