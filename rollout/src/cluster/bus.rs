//! What a cluster of nodes keeps on the bus, named and shaped once: the sample queue, the
//! results log, the event stream, the callback queue, the state buckets and the trace objects.

use std::time::Duration;

use async_nats::jetstream::consumer::{self, pull, AckPolicy};
use async_nats::jetstream::{self, kv, object_store, stream};
use tokentap_bus::async_nats;
use tokentap_bus::topology::{open_bucket, DUPLICATE_WINDOW, RETENTION};

/// Samples waiting for a node: a work queue (each message goes to one node, and is gone once
/// that node acknowledges it), one message per sample, the sample id as its message id.
pub const QUEUE_STREAM: &str = "TOKENTAP_SAMPLE_QUEUE";
pub const QUEUE_SUBJECT: &str = "tokentap.samples.queue";
/// The one durable consumer every node pulls the queue through.
pub const QUEUE_CONSUMER: &str = "nodes";
/// Ended samples in the order they ended (the sample id as message id, so a sample ends
/// once in the log): `GET /v1/results?after=` pages through its sequence numbers.
pub const RESULTS_STREAM: &str = "TOKENTAP_RESULTS";
pub const RESULTS_SUBJECT: &str = "tokentap.results";
/// Every rollout's progress events, a subject per rollout.
pub const EVENTS_STREAM: &str = "TOKENTAP_EVENTS";
/// Results owed to callback URLs: a work queue, delivered by whichever node pulls them.
pub const CALLBACK_STREAM: &str = "TOKENTAP_CALLBACKS";
pub const CALLBACK_SUBJECT: &str = "tokentap.callbacks";
pub const CALLBACK_CONSUMER: &str = "deliverers";
/// Callback attempts made so far (sample id → how many, once there was one that failed). A
/// job a node deferred (its receiver had that node's most in flight) comes back from the queue
/// unattempted, so the queue's delivery count is not the attempts.
pub const CALLBACK_ATTEMPTS_BUCKET: &str = "tokentap_callback_attempts";
/// Rollouts as submitted (rollout id → `Rollout`).
pub const ROLLOUTS_BUCKET: &str = "tokentap_rollouts";
/// Every sample's state (sample id → `Sample`), written by the node holding its claim, each
/// write conditional on the revision that node wrote last.
pub const SAMPLES_BUCKET: &str = "tokentap_samples";
/// Nodes' heartbeats (node id → `NodeStatus`), gone after [`NODE_TTL`] without one.
pub const NODES_BUCKET: &str = "tokentap_nodes";
/// The cluster's gate order (`gate` → `GateOrder`).
pub const CONTROL_BUCKET: &str = "tokentap_control";
pub const GATE_KEY: &str = "gate";
/// Ended samples' `traces.jsonl`, by sample id (objects are chunked, so a trajectory may be
/// larger than a message).
pub const TRACES_OBJECTS: &str = "tokentap_sample_traces";
/// Cancellations, to every node at once (core NATS: a node that is down has nothing to stop).
pub const CANCEL_SUBJECT: &str = "tokentap.control.cancel";

pub const NODE_TTL: Duration = Duration::from_secs(10);

pub fn events_subject(rollout_id: &str) -> String {
    format!("tokentap.events.{rollout_id}")
}

/// How the cluster's queues behave; the first node to create them decides.
#[derive(Debug, Clone)]
pub struct QueueOptions {
    /// A claimed sample whose node stops acknowledging progress for this long goes back to
    /// the queue (a new attempt elsewhere).
    pub ack_wait: Duration,
    /// Starts of one sample before it is failed.
    pub max_attempts: u32,
    /// A callback attempt's own time limit (the callback queue's ack wait is longer).
    pub callback_timeout: Duration,
}

/// The streams, consumers and buckets of a cluster, opened (created when missing).
#[derive(Clone)]
pub struct ClusterBus {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub queue: consumer::PullConsumer,
    pub results: stream::Stream,
    pub events: stream::Stream,
    pub callbacks: consumer::PullConsumer,
    pub callback_attempts: kv::Store,
    pub rollouts: kv::Store,
    pub samples: kv::Store,
    pub nodes: kv::Store,
    pub control: kv::Store,
    pub traces: object_store::ObjectStore,
}

fn stream_config(name: &str, subject: &str, work_queue: bool) -> stream::Config {
    stream::Config {
        name: name.into(),
        subjects: vec![subject.into()],
        storage: stream::StorageType::File,
        max_age: RETENTION,
        duplicate_window: DUPLICATE_WINDOW,
        retention: if work_queue {
            stream::RetentionPolicy::WorkQueue
        } else {
            stream::RetentionPolicy::Limits
        },
        ..Default::default()
    }
}

impl ClusterBus {
    pub async fn open(
        client: async_nats::Client,
        options: &QueueOptions,
    ) -> anyhow::Result<ClusterBus> {
        let js = tokentap_bus::jetstream(client.clone());
        let queue_stream = js
            .get_or_create_stream(stream_config(QUEUE_STREAM, QUEUE_SUBJECT, true))
            .await?;
        let queue = queue_stream
            .get_or_create_consumer(
                QUEUE_CONSUMER,
                pull::Config {
                    durable_name: Some(QUEUE_CONSUMER.into()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: options.ack_wait,
                    // One delivery more than the attempts: the last one only records that
                    // the sample ran out of them.
                    max_deliver: i64::from(options.max_attempts) + 1,
                    ..Default::default()
                },
            )
            .await?;
        let results = js
            .get_or_create_stream(stream_config(RESULTS_STREAM, RESULTS_SUBJECT, false))
            .await?;
        let events = js
            .get_or_create_stream(stream_config(EVENTS_STREAM, "tokentap.events.*", false))
            .await?;
        let callback_stream = js
            .get_or_create_stream(stream_config(CALLBACK_STREAM, CALLBACK_SUBJECT, true))
            .await?;
        let callbacks = callback_stream
            .get_or_create_consumer(
                CALLBACK_CONSUMER,
                pull::Config {
                    durable_name: Some(CALLBACK_CONSUMER.into()),
                    ack_policy: AckPolicy::Explicit,
                    // Longer than one attempt, so a slow receiver is not sent it twice.
                    ack_wait: options.callback_timeout + Duration::from_secs(30),
                    ..Default::default()
                },
            )
            .await?;
        let traces = match js.get_object_store(TRACES_OBJECTS).await {
            Ok(store) => store,
            Err(_) => {
                let created = js
                    .create_object_store(object_store::Config {
                        bucket: TRACES_OBJECTS.into(),
                        max_age: RETENTION,
                        storage: stream::StorageType::File,
                        ..Default::default()
                    })
                    .await;
                match created {
                    Ok(store) => store,
                    // Another node created it at the same moment.
                    Err(_) => js.get_object_store(TRACES_OBJECTS).await?,
                }
            }
        };
        Ok(ClusterBus {
            queue,
            results,
            events,
            callbacks,
            callback_attempts: open_bucket(&js, CALLBACK_ATTEMPTS_BUCKET, RETENTION).await?,
            rollouts: open_bucket(&js, ROLLOUTS_BUCKET, RETENTION).await?,
            samples: open_bucket(&js, SAMPLES_BUCKET, RETENTION).await?,
            nodes: open_bucket(&js, NODES_BUCKET, NODE_TTL).await?,
            control: open_bucket(&js, CONTROL_BUCKET, Duration::ZERO).await?,
            traces,
            js,
            client,
        })
    }
}

/// The next message of a queue's consumer, waiting up to a few seconds for one (None: none
/// came, or the bus is unreachable just now; both are simply tried again).
pub async fn next_message(consumer: &consumer::PullConsumer) -> Option<jetstream::Message> {
    use futures::StreamExt;
    let batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(5))
        .messages()
        .await;
    let mut batch = match batch {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "pulling from the bus");
            tokio::time::sleep(Duration::from_secs(1)).await;
            return None;
        }
    };
    match batch.next().await {
        Some(Ok(m)) => Some(m),
        Some(Err(e)) => {
            tracing::debug!(error = %e, "pulling from the bus");
            None
        }
        None => None,
    }
}
