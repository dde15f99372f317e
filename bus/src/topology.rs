//! Names and shapes on the bus, defined once: the records and traces streams (a subject per
//! publisher and partition), the lease and progress buckets, a session's partition, and the
//! limits every one of them is created (and kept) with.

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

/// The records stream's subjects: `tokentap.records.<publisher>.<partition>`.
pub const RECORDS_SUBJECTS: &str = "tokentap.records.*.*";
/// The publisher name of every client of a bus without users (one token for all): such a bus
/// knows no identities, so its records cannot be attributed (docs/scale-out.md, "Who
/// published a record").
pub const SHARED_PUBLISHER: &str = "shared";

/// The subject of a record that `publisher` (its bus user) publishes into `partition`. The
/// bus's permissions let each user publish under its own name only
/// (`deploy/kubernetes/components/bus/nats.conf`), so the server vouches for the name.
pub fn record_subject(publisher: &str, partition: u32) -> String {
    format!("tokentap.records.{publisher}.{partition}")
}

/// Every publisher's records of `partition` (a consumer's filter).
pub fn partition_records(partition: u32) -> String {
    format!("tokentap.records.*.{partition}")
}

/// The publisher named in a record's subject (`None`: not a record subject of this shape).
pub fn publisher_of(subject: &str) -> Option<&str> {
    let rest = subject.strip_prefix("tokentap.records.")?;
    let (publisher, partition) = rest.split_once('.')?;
    (!publisher.is_empty() && partition.parse::<u32>().is_ok()).then_some(publisher)
}

/// The name this client publishes records under: its bus user, or [`SHARED_PUBLISHER`] on a
/// bus without users. A user name that cannot be one token of a subject is refused.
pub fn publisher_name(bus: &crate::BusConnect) -> anyhow::Result<String> {
    let Some(user) = &bus.user else {
        return Ok(SHARED_PUBLISHER.to_owned());
    };
    let name = user.name.as_str();
    if name.is_empty()
        || name
            .chars()
            .any(|c| matches!(c, '.' | '*' | '>') || c.is_whitespace() || c.is_control())
    {
        anyhow::bail!(
            "the bus user {name:?} cannot name a records subject (tokentap.records.<user>.<partition>): a publisher's user name must not be empty nor contain '.', '*', '>' or spaces"
        );
    }
    Ok(name.to_owned())
}

pub fn trace_subject(partition: u32) -> String {
    format!("tokentap.traces.{partition}")
}

/// The limits of one stream (or a bucket's stream). `-1`: none. The server refuses what would
/// pass them; `discard` says whether a full stream refuses the new message (`New`: the
/// publisher gets an error and keeps the message) or drops its oldest (`Old`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    pub max_bytes: i64,
    pub max_msgs: i64,
    pub max_msg_size: i32,
    pub discard: stream::DiscardPolicy,
    /// `max_bytes` is the default, not the operator's: on a server without room for it (one
    /// with no JetStream limits keeps 75% of its free disk, and refuses a stream whose
    /// `max_bytes` it cannot reserve) the stream is made without one, bounded by the account's
    /// JetStream limit only, said in the log. A size the environment set is never dropped: it
    /// fits or the process says why not.
    pub fit_to_server: bool,
}

impl StreamLimits {
    fn apply(&self, config: &mut stream::Config) {
        config.max_bytes = self.max_bytes;
        config.max_messages = self.max_msgs;
        config.max_message_size = self.max_msg_size;
        config.discard = self.discard;
    }

    /// Whether `config` already has these limits (the server writes "none" as -1).
    fn held_by(&self, config: &stream::Config) -> bool {
        let none = |v: i64| if v <= 0 { -1 } else { v };
        none(config.max_bytes) == none(self.max_bytes)
            && none(config.max_messages) == none(self.max_msgs)
            && none(i64::from(config.max_message_size)) == none(i64::from(self.max_msg_size))
            && config.discard == self.discard
    }
}

const MB: i64 = 1_000_000;
const GB: i64 = 1_000_000_000;
/// A message as large as deploy's `max_payload` (8 MiB): the largest record the bus carries.
const MAX_MESSAGE: i32 = 8 * 1024 * 1024;

/// The limits of the streams and buckets a worker group keeps, which must together fit in the
/// JetStream limit of the account that holds them (deploy's `nats.conf`: `RECORDS`, 64 GB,
/// of which these reserve 60.6 GB). Each is the default unless the environment of the process
/// that creates (or opens) them says otherwise: `TOKENTAP_BUS_<STREAM>_MAX_BYTES`,
/// `_MAX_MSGS`, `_MAX_MSG_SIZE` with `<STREAM>` one of `RECORDS`, `TRACES`, `LEASES`,
/// `PROGRESS` (a number of bytes, with `K`, `M`, `G` for powers of 1000 or `KiB`, `MiB`,
/// `GiB` for powers of 1024; `none` for no limit). docs/scale-out.md, "Limits", says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusLimits {
    pub records: StreamLimits,
    pub traces: StreamLimits,
    pub leases: StreamLimits,
    pub progress: StreamLimits,
}

impl Default for BusLimits {
    fn default() -> BusLimits {
        BusLimits {
            // Full: refused, and the publisher keeps the record in its spool (its write-ahead
            // buffer) and says so, rather than the stream silently dropping records no worker
            // has read yet. 40 GB is about 530,000 records of 76 KB; the count bounds a flood
            // of tiny messages (the server indexes each one).
            records: StreamLimits {
                max_bytes: 40 * GB,
                max_msgs: 10_000_000,
                max_msg_size: MAX_MESSAGE,
                discard: stream::DiscardPolicy::New,
                fit_to_server: true,
            },
            // A feed: the workers' files keep every trace, so a full stream drops its oldest
            // rather than stopping reconstruction.
            traces: StreamLimits {
                max_bytes: 20 * GB,
                max_msgs: 10_000_000,
                max_msg_size: MAX_MESSAGE,
                discard: stream::DiscardPolicy::Old,
                fit_to_server: true,
            },
            // Buckets refuse a put past their limits (what a KV store must do). Leases: a key
            // per member and partition, each value a member id.
            leases: StreamLimits {
                max_bytes: 64 * MB,
                max_msgs: 100_000,
                max_msg_size: 64 * 1024,
                discard: stream::DiscardPolicy::New,
                fit_to_server: true,
            },
            // A checkpoint per partition (up to 1,024 finished sessions' marks each) and the
            // partition count.
            progress: StreamLimits {
                max_bytes: 512 * MB,
                max_msgs: 100_000,
                max_msg_size: MAX_MESSAGE,
                discard: stream::DiscardPolicy::New,
                fit_to_server: true,
            },
        }
    }
}

impl BusLimits {
    /// The defaults, with whatever this process's environment sets.
    pub fn from_env() -> anyhow::Result<BusLimits> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The defaults, with what `var` gives for the `TOKENTAP_BUS_*` names.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> anyhow::Result<BusLimits> {
        let mut limits = BusLimits::default();
        for (stream, l) in [
            ("RECORDS", &mut limits.records),
            ("TRACES", &mut limits.traces),
            ("LEASES", &mut limits.leases),
            ("PROGRESS", &mut limits.progress),
        ] {
            let read = |field: &str| -> anyhow::Result<Option<i64>> {
                let name = format!("TOKENTAP_BUS_{stream}_{field}");
                var(&name)
                    .map(|v| parse_size(&v).map_err(|e| anyhow::anyhow!("{name}={v:?}: {e}")))
                    .transpose()
            };
            if let Some(v) = read("MAX_BYTES")? {
                l.max_bytes = v;
                l.fit_to_server = false;
            }
            if let Some(v) = read("MAX_MSGS")? {
                l.max_msgs = v;
            }
            if let Some(v) = read("MAX_MSG_SIZE")? {
                l.max_msg_size = i32::try_from(v).map_err(|_| {
                    anyhow::anyhow!("TOKENTAP_BUS_{stream}_MAX_MSG_SIZE: {v} is over 2 GiB")
                })?;
            }
        }
        Ok(limits)
    }
}

/// `12345`, `40G`, `8MiB`, `none` (-1).
fn parse_size(v: &str) -> anyhow::Result<i64> {
    let v = v.trim();
    if v.eq_ignore_ascii_case("none") || v == "-1" {
        return Ok(-1);
    }
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (digits, unit) = v.split_at(split);
    let n: i64 = digits.parse().map_err(|_| {
        anyhow::anyhow!("not a size (a number of bytes, K/M/G, KiB/MiB/GiB, or none)")
    })?;
    let scale: i64 = match unit.trim() {
        "" => 1,
        "K" | "KB" => 1_000,
        "M" | "MB" => MB,
        "G" | "GB" => GB,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => anyhow::bail!("unknown unit {other:?} (K, M, G, KiB, MiB, GiB)"),
    };
    match n.checked_mul(scale) {
        Some(0) => Ok(-1),
        Some(n) => Ok(n),
        None => anyhow::bail!("too large"),
    }
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

fn stream_config(name: &str, subjects: &str, limits: &StreamLimits) -> stream::Config {
    let mut config = stream::Config {
        name: name.to_owned(),
        subjects: vec![subjects.to_owned()],
        storage: stream::StorageType::File,
        max_age: RETENTION,
        duplicate_window: DUPLICATE_WINDOW,
        ..Default::default()
    };
    limits.apply(&mut config);
    config
}

impl Topology {
    /// Creates what does not exist yet, brings what exists to this process's limits
    /// ([`BusLimits::from_env`]), and reads the group's partition count (`wanted` if this is
    /// the first process on the bus; the stored count otherwise, whatever `wanted` says).
    pub async fn ensure(js: jetstream::Context, wanted: u32) -> anyhow::Result<Topology> {
        Self::ensure_with(js, wanted, &BusLimits::from_env()?).await
    }

    /// [`Topology::ensure`] with these limits.
    pub async fn ensure_with(
        js: jetstream::Context,
        wanted: u32,
        limits: &BusLimits,
    ) -> anyhow::Result<Topology> {
        let records = ensure_stream(
            &js,
            stream_config(RECORDS_STREAM, RECORDS_SUBJECTS, &limits.records),
            limits.records.fit_to_server,
        )
        .await?;
        let traces = ensure_stream(
            &js,
            stream_config(TRACES_STREAM, "tokentap.traces.*", &limits.traces),
            limits.traces.fit_to_server,
        )
        .await?;
        let leases =
            open_bucket_limited(&js, LEASES_BUCKET, LEASE_TTL, Some(&limits.leases)).await?;
        let progress =
            open_bucket_limited(&js, PROGRESS_BUCKET, Duration::ZERO, Some(&limits.progress))
                .await?;
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

/// The stream `wanted` names: created as `wanted` if missing; if it exists with other
/// subjects or limits (made by an earlier version, or under other limits), updated to
/// `wanted`'s, or an error saying what the operator must do.
async fn ensure_stream(
    js: &jetstream::Context,
    wanted: stream::Config,
    fit_to_server: bool,
) -> anyhow::Result<stream::Stream> {
    let name = wanted.name.clone();
    let mut wanted = wanted;
    let existing = loop {
        match js.get_or_create_stream(wanted.clone()).await {
            Ok(s) => break s,
            Err(e) if fit_to_server && shrink_to_fit(&name, &mut wanted, &e.to_string()) => {}
            Err(e) => anyhow::bail!(
                "the stream {name}: {e}{}",
                no_room_hint(&name, &e.to_string())
            ),
        }
    };
    let have = existing.cached_info().config.clone();
    // A stream made smaller than the default (by an operator, by hand) is kept at its size
    // rather than grown past what the server gave it.
    if fit_to_server && have.max_bytes > 0 && have.max_bytes < wanted.max_bytes {
        wanted.max_bytes = have.max_bytes;
    }
    let limits = StreamLimits {
        max_bytes: wanted.max_bytes,
        max_msgs: wanted.max_messages,
        max_msg_size: wanted.max_message_size,
        discard: wanted.discard,
        fit_to_server,
    };
    if limits.held_by(&have) && have.subjects == wanted.subjects {
        return Ok(existing);
    }
    let mut updated = have.clone();
    updated.subjects = wanted.subjects.clone();
    limits.apply(&mut updated);
    tracing::warn!(
        stream = %name,
        subjects = ?have.subjects, max_bytes = have.max_bytes, max_msgs = have.max_messages,
        max_msg_size = have.max_message_size, discard = ?have.discard,
        to_subjects = ?updated.subjects, to_max_bytes = updated.max_bytes,
        to_max_msgs = updated.max_messages, to_max_msg_size = updated.max_message_size,
        to_discard = ?updated.discard,
        "the stream has other subjects or limits than this process's: updating it"
    );
    loop {
        match js.update_stream(&updated).await {
            Ok(_) => break,
            Err(e) if fit_to_server && shrink_to_fit(&name, &mut updated, &e.to_string()) => {}
            Err(e) => anyhow::bail!(
                "the stream {name} has other subjects or limits than this process's (subjects {:?}, max_bytes {}, max_msgs {}, max_msg_size {}, discard {:?}; wanted {:?}, {}, {}, {}, {:?}) and updating it failed: {e}{} (the worker's bus user needs $JS.API.STREAM.UPDATE.{name}, as in deploy's nats.conf; or set the TOKENTAP_BUS_* limits to the stream's, or update the stream by hand: docs/scale-out.md, \"Limits\")",
                have.subjects, have.max_bytes, have.max_messages, have.max_message_size, have.discard,
                updated.subjects, updated.max_bytes, updated.max_messages, updated.max_message_size, updated.discard,
                no_room_hint(&name, &e.to_string()),
            ),
        }
    }
    js.get_stream(&name)
        .await
        .map_err(|e| anyhow::anyhow!("the stream {name}, updated: {e}"))
}

/// Whether the server refused a stream for want of room to reserve its `max_bytes`.
fn no_room(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("insufficient storage") || e.contains("10047")
}

fn no_room_hint(name: &str, error: &str) -> String {
    if !no_room(error) {
        return String::new();
    }
    let env = name
        .strip_prefix("TOKENTAP_")
        .or_else(|| name.strip_prefix("KV_tokentap_"))
        .unwrap_or(name)
        .to_ascii_uppercase();
    format!(
        " (the server cannot reserve the stream's max_bytes: give it more JetStream storage, its max_file_store or the account's limit, or set TOKENTAP_BUS_{env}_MAX_BYTES lower)"
    )
}

/// Drops a default `max_bytes` the server had no room to reserve: the stream is then bounded
/// by the account's (or the server's) JetStream limit alone, as before streams had limits of
/// their own, said in the log. (Halving until it fitted was tried: on servers without
/// configured limits the reservations did not add up, and the buckets made after the streams
/// found no room at any size.) False when the refusal was for something else or there is no
/// size to drop.
fn shrink_to_fit(name: &str, config: &mut stream::Config, error: &str) -> bool {
    if !no_room(error) || config.max_bytes <= 0 {
        return false;
    }
    tracing::warn!(
        stream = %name,
        max_bytes = config.max_bytes,
        "the bus has no room to reserve the stream's default max_bytes: made without one, bounded by the account's JetStream limit only (set TOKENTAP_BUS_*_MAX_BYTES, or give the server the storage deploy's nats.conf does: docs/scale-out.md, \"Limits\")"
    );
    config.max_bytes = -1;
    true
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
    /// The records stream's `max_msg_size` (`None`: none): a record larger than this will
    /// never be stored, so it is dead-lettered rather than retried.
    pub max_msg_size: Option<usize>,
}

/// The API prefix under which a publisher's account imports the records account's JetStream
/// lookups (deploy's `nats.conf`: the publisher's `AGENTS` account has no JetStream, and the
/// nodes' `CLUSTER` account has its own without the records stream; the records live in
/// `RECORDS`, kept apart so that no reply subject a publisher names reaches another account's
/// streams and no publisher's records take the room of the cluster's).
pub const IMPORTED_API_PREFIX: &str = "tokentap.jsapi";

impl PublishTopology {
    pub async fn open(js: jetstream::Context, wanted: u32) -> anyhow::Result<PublishTopology> {
        let mut js = js;
        let mut looked_up = Self::look_up(&js).await;
        let own_error = |code: jetstream::ErrorCode| {
            looked_up
                .as_ref()
                .is_err_and(|e| e.to_string().contains(&format!("error code {}", code.0)))
        };
        let not_enabled = own_error(jetstream::ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT);
        if not_enabled || own_error(jetstream::ErrorCode::STREAM_NOT_FOUND) {
            // An account without JetStream, or with JetStream but not the records stream: the
            // records account's, through the imported prefix (when this account imports it).
            let imported = jetstream::ContextBuilder::new()
                .timeout(Duration::from_secs(10))
                .api_prefix(IMPORTED_API_PREFIX)
                .build(js.client());
            let through_import = Self::look_up(&imported).await;
            // The import answered (found it, or said what is missing): the records are there.
            let answered = match &through_import {
                Ok(_) => true,
                Err(e) => e.to_string().contains("error code"),
            };
            if not_enabled || answered {
                looked_up = through_import;
                js = imported;
            }
        }
        let (partitions, max_msg_size) = match looked_up {
            Ok(found) => found,
            Err(missing) => match Topology::ensure(js.clone(), wanted).await {
                Ok(t) => (
                    t.partitions,
                    message_size_limit(&t.records.cached_info().config),
                ),
                Err(creating) => anyhow::bail!(
                    "{missing}; creating them: {creating} (on a bus with roles a publisher may not create them: they appear when a worker of the group starts)"
                ),
            },
        };
        Ok(PublishTopology {
            js,
            partitions,
            max_msg_size,
        })
    }

    /// The records stream's info and the partition count, looked up.
    async fn look_up(js: &jetstream::Context) -> anyhow::Result<(u32, Option<usize>)> {
        let records = js
            .get_stream(RECORDS_STREAM)
            .await
            .map_err(|e| anyhow::anyhow!("the records stream {RECORDS_STREAM}: {e}"))?;
        let progress = js
            .get_key_value(PROGRESS_BUCKET)
            .await
            .map_err(|e| anyhow::anyhow!("the bucket {PROGRESS_BUCKET}: {e}"))?;
        Ok((
            read_partitions(&progress).await?,
            message_size_limit(&records.cached_info().config),
        ))
    }

    pub fn partition_of(&self, session_id: &str) -> u32 {
        partition_of(session_id, self.partitions)
    }
}

fn message_size_limit(config: &stream::Config) -> Option<usize> {
    usize::try_from(config.max_message_size)
        .ok()
        .filter(|&n| n > 0)
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
/// info, whose 2.9 form the 0.51 client cannot parse. Without limits of its own (the account's
/// JetStream limit bounds it); [`open_bucket_limited`] gives it some.
pub async fn open_bucket(
    js: &jetstream::Context,
    name: &str,
    max_age: Duration,
) -> anyhow::Result<kv::Store> {
    open_bucket_limited(js, name, max_age, None).await
}

/// [`open_bucket`], the bucket created with `limits` and an existing one brought to them
/// (`None`: created without limits, an existing one left as it is).
pub async fn open_bucket_limited(
    js: &jetstream::Context,
    name: &str,
    max_age: Duration,
    limits: Option<&StreamLimits>,
) -> anyhow::Result<kv::Store> {
    if let Ok(store) = js.get_key_value(name).await {
        if let Some(limits) = limits {
            let mut stream = js
                .get_stream(format!("KV_{name}"))
                .await
                .map_err(|e| anyhow::anyhow!("the bucket {name}'s stream: {e}"))?;
            let info = stream.info().await?;
            if !limits.held_by(&info.config) {
                let mut wanted = info.config.clone();
                limits.apply(&mut wanted);
                ensure_stream(js, wanted, limits.fit_to_server).await?;
            }
        }
        return Ok(store);
    }
    let mut config = stream::Config {
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
    };
    if let Some(limits) = limits {
        limits.apply(&mut config);
    }
    let fit = limits.is_some_and(|l| l.fit_to_server);
    let created = loop {
        match js.create_stream(config.clone()).await {
            Err(e) if fit && shrink_to_fit(&config.name.clone(), &mut config, &e.to_string()) => {}
            created => break created,
        }
    };
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

    #[test]
    fn record_subjects_name_their_publisher() {
        assert_eq!(
            record_subject("publisher", 3),
            "tokentap.records.publisher.3"
        );
        assert_eq!(
            publisher_of("tokentap.records.publisher.3"),
            Some("publisher")
        );
        assert_eq!(
            publisher_of("tokentap.records.3"),
            None,
            "the old shape names no one"
        );
        assert_eq!(publisher_of("tokentap.records.a.b"), None);
        assert_eq!(publisher_of("tokentap.traces.a.1"), None);
        let bus = |name: &str| crate::BusConnect {
            url: String::new(),
            token: None,
            user: Some(crate::BusUser {
                name: name.into(),
                password: String::new(),
            }),
            ca: None,
        };
        assert_eq!(publisher_name(&bus("host-7")).unwrap(), "host-7");
        for bad in ["", "a.b", "a*", ">", "a b"] {
            assert!(publisher_name(&bus(bad)).is_err(), "{bad:?}");
        }
        let token = crate::BusConnect {
            user: None,
            ..bus("x")
        };
        assert_eq!(publisher_name(&token).unwrap(), SHARED_PUBLISHER);
    }

    #[test]
    fn limits_come_from_the_environment_over_the_defaults() {
        let defaults = BusLimits::default();
        // They fit in deploy's RECORDS account (64 GB), with room to spare.
        let reserved: i64 = [
            defaults.records,
            defaults.traces,
            defaults.leases,
            defaults.progress,
        ]
        .iter()
        .map(|l| l.max_bytes)
        .sum();
        assert!(reserved <= 61 * GB, "{reserved}");
        assert_eq!(defaults.records.discard, stream::DiscardPolicy::New);
        let vars = [
            ("TOKENTAP_BUS_RECORDS_MAX_BYTES", "4MiB"),
            ("TOKENTAP_BUS_RECORDS_MAX_MSG_SIZE", "256K"),
            ("TOKENTAP_BUS_TRACES_MAX_MSGS", "none"),
            ("TOKENTAP_BUS_PROGRESS_MAX_BYTES", "2G"),
        ];
        let get = |n: &str| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        };
        let l = BusLimits::from_vars(get).unwrap();
        assert_eq!(l.records.max_bytes, 4 << 20);
        assert!(
            !l.records.fit_to_server && l.traces.fit_to_server,
            "a size the operator set is never shrunk to fit"
        );
        assert_eq!(l.records.max_msg_size, 256_000);
        assert_eq!(l.records.max_msgs, defaults.records.max_msgs);
        assert_eq!(l.traces.max_msgs, -1);
        assert_eq!(l.progress.max_bytes, 2 * GB);
        assert_eq!(l.leases, defaults.leases);
        let bad = |v: &'static str| {
            move |n: &str| (n == "TOKENTAP_BUS_LEASES_MAX_BYTES").then(|| v.to_string())
        };
        for v in ["lots", "5 TB", "-3", "99999999999999999999"] {
            assert!(BusLimits::from_vars(bad(v)).is_err(), "{v}");
        }
    }
}
