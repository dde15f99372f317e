//! Names and shapes on the bus, defined once: the records and traces streams (one subject per
//! partition), the lease and progress buckets, and a session's partition.

use std::time::Duration;

use async_nats::jetstream::{self, kv, stream};

pub const RECORDS_STREAM: &str = "TOKENTAP_RECORDS";
pub const TRACES_STREAM: &str = "TOKENTAP_TRACES";
/// Worker heartbeats (`member.ID`) and partition leases (`lease.P`); entries expire after
/// [`LEASE_TTL`] unless renewed.
pub const LEASES_BUCKET: &str = "tokentap_leases";
/// Per-partition checkpoints (`partition.P`) and the group's partition count (`partitions`).
pub const PROGRESS_BUCKET: &str = "tokentap_progress";
pub const PARTITIONS_KEY: &str = "partitions";

/// Partitions when the bus has none yet: room for 16 workers.
pub const DEFAULT_PARTITIONS: u32 = 16;
/// A lease or membership not renewed for this long is gone: the bound on how long a killed
/// worker's partitions wait before another worker takes them.
pub const LEASE_TTL: Duration = Duration::from_secs(6);
/// Records and traces are kept this long (a worker group that was down replays from them).
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Publishes with a message id seen within this window are acknowledged as duplicates and not
/// stored again: a republished spool backlog, a trace republished after a takeover.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(30 * 60);

pub fn record_subject(partition: u32) -> String {
    format!("tokentap.records.{partition}")
}

pub fn trace_subject(partition: u32) -> String {
    format!("tokentap.traces.{partition}")
}

/// The partition of a session: FNV-1a of its id, stable across processes, machines and
/// versions (a worker group and its publishers must agree on it forever).
pub fn partition_of(session_id: &str, partitions: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in session_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(partitions.max(1))) as u32
}

/// The bus as this group uses it.
#[derive(Clone)]
pub struct Topology {
    pub js: jetstream::Context,
    pub partitions: u32,
    pub records: stream::Stream,
    pub traces: stream::Stream,
    pub leases: kv::Store,
    pub progress: kv::Store,
}

fn stream_config(name: &str, subjects: &str) -> stream::Config {
    stream::Config {
        name: name.to_owned(),
        subjects: vec![subjects.to_owned()],
        storage: stream::StorageType::File,
        max_age: RETENTION,
        duplicate_window: DUPLICATE_WINDOW,
        ..Default::default()
    }
}

impl Topology {
    /// Creates what does not exist yet and reads the group's partition count (`wanted` if this
    /// is the first process on the bus; the stored count otherwise, whatever `wanted` says).
    pub async fn ensure(js: jetstream::Context, wanted: u32) -> anyhow::Result<Topology> {
        let records = js
            .get_or_create_stream(stream_config(RECORDS_STREAM, "tokentap.records.*"))
            .await?;
        let traces = js
            .get_or_create_stream(stream_config(TRACES_STREAM, "tokentap.traces.*"))
            .await?;
        let leases = open_bucket(&js, LEASES_BUCKET, LEASE_TTL).await?;
        let progress = open_bucket(&js, PROGRESS_BUCKET, Duration::ZERO).await?;
        let wanted = wanted.max(1);
        let _ = progress
            .create(PARTITIONS_KEY, wanted.to_string().into())
            .await; // exists already: the first process decided
        let stored = read_partitions(&progress).await?;
        if stored != wanted {
            tracing::info!(
                partitions = stored,
                asked = wanted,
                "the bus already has a partition count; using it"
            );
        }
        Ok(Topology {
            js,
            partitions: stored,
            records,
            traces,
            leases,
            progress,
        })
    }

    pub fn partition_of(&self, session_id: &str) -> u32 {
        partition_of(session_id, self.partitions)
    }
}

/// Retries `attempt` once a second until it succeeds: a bus whose streams are not reachable
/// yet (the server still starting, or no worker has created them) is waited for, by publishers
/// and workers alike. `give_up` is asked after each failure; when it says so, `None`.
pub async fn until_reachable<T, Fut>(
    mut attempt: impl FnMut() -> Fut,
    mut give_up: impl FnMut() -> bool,
) -> Option<T>
where
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    loop {
        match attempt().await {
            Ok(t) => return Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "the bus's streams are not reachable yet; retrying");
                if give_up() {
                    return None;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// What a publisher needs of the bus: JetStream and the partition count. A publisher only
/// looks these up (the records stream's info, the `partitions` key of the progress bucket):
/// on a bus with roles (`deploy/kubernetes/components/bus/nats.conf`) its user may create nothing, and
/// the worker group creates the streams and decides the count. On a bus without roles (one
/// token for all), a publisher that comes first still creates them, as it always did.
#[derive(Clone)]
pub struct PublishTopology {
    pub js: jetstream::Context,
    pub partitions: u32,
}

/// The API prefix under which a publisher's account imports the cluster's JetStream lookups
/// when it has no JetStream of its own (deploy's `nats.conf`: the publisher's `AGENTS`
/// account, kept apart so that no reply subject it names reaches the cluster's streams).
pub const IMPORTED_API_PREFIX: &str = "tokentap.jsapi";

impl PublishTopology {
    pub async fn open(js: jetstream::Context, wanted: u32) -> anyhow::Result<PublishTopology> {
        let mut js = js;
        let mut looked_up = Self::look_up(&js).await;
        if looked_up.as_ref().is_err_and(|e| {
            e.to_string().contains(&format!(
                "error code {}",
                jetstream::ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT.0
            ))
        }) {
            // An account without JetStream: the cluster's, through the imported prefix.
            let imported = jetstream::ContextBuilder::new()
                .timeout(Duration::from_secs(10))
                .api_prefix(IMPORTED_API_PREFIX)
                .build(js.client());
            looked_up = Self::look_up(&imported).await;
            js = imported;
        }
        let partitions = match looked_up {
            Ok(n) => n,
            Err(missing) => match Topology::ensure(js.clone(), wanted).await {
                Ok(t) => t.partitions,
                Err(creating) => anyhow::bail!(
                    "{missing}; creating them: {creating} (on a bus with roles a publisher may not create them: they appear when a worker of the group starts)"
                ),
            },
        };
        Ok(PublishTopology { js, partitions })
    }

    /// The records stream's info and the partition count, looked up.
    async fn look_up(js: &jetstream::Context) -> anyhow::Result<u32> {
        js.get_stream(RECORDS_STREAM)
            .await
            .map_err(|e| anyhow::anyhow!("the records stream {RECORDS_STREAM}: {e}"))?;
        let progress = js
            .get_key_value(PROGRESS_BUCKET)
            .await
            .map_err(|e| anyhow::anyhow!("the bucket {PROGRESS_BUCKET}: {e}"))?;
        read_partitions(&progress).await
    }

    pub fn partition_of(&self, session_id: &str) -> u32 {
        partition_of(session_id, self.partitions)
    }
}

async fn read_partitions(progress: &kv::Store) -> anyhow::Result<u32> {
    progress
        .get(PARTITIONS_KEY)
        .await?
        .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u32>().ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| anyhow::anyhow!("the bus's partition count is unreadable"))
}

/// Opens (creating) a KV bucket of one value per key. The bucket's stream is created here, the
/// way `async_nats`'s `create_key_value` shapes it, because that call first reads the account
/// info, whose 2.9 form the 0.51 client cannot parse.
pub async fn open_bucket(
    js: &jetstream::Context,
    name: &str,
    max_age: Duration,
) -> anyhow::Result<kv::Store> {
    if let Ok(store) = js.get_key_value(name).await {
        return Ok(store);
    }
    let created = js
        .create_stream(stream::Config {
            name: format!("KV_{name}"),
            subjects: vec![format!("$KV.{name}.>")],
            max_messages_per_subject: 1,
            max_age,
            storage: stream::StorageType::File,
            allow_rollup: true,
            deny_delete: true,
            allow_direct: true,
            discard: stream::DiscardPolicy::New,
            num_replicas: 1,
            ..Default::default()
        })
        .await;
    match js.get_key_value(name).await {
        Ok(store) => Ok(store),
        // Creating it failed (another process creating it at once is not a failure: the
        // second `get_key_value` finds theirs).
        Err(e) => Err(match created {
            Err(created) => anyhow::anyhow!("creating the bucket {name}: {created}"),
            Ok(_) => anyhow::anyhow!("opening the bucket {name}: {e}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_stable_and_spread() {
        // Fixed forever: publishers and workers of different versions must agree.
        assert_eq!(partition_of("", 16), (0xcbf2_9ce4_8422_2325u64 % 16) as u32);
        assert_eq!(partition_of("session-a", 16), partition_of("session-a", 16));
        let mut counts = [0usize; 16];
        for i in 0..16_000 {
            counts[partition_of(&format!("s-{i}"), 16) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (700..1300).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(partition_of("x", 0), 0, "no partitions means one");
    }
}
