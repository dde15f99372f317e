//! Records and traces over NATS JetStream, for more than one machine: proxies publish their
//! spools' records (the spool stays the write-ahead buffer; its bus cursor moves only on the
//! server's ack), and `tokentap worker --bus` instances form a group that splits the record
//! partitions among themselves by lease, so each session's records reach one worker at a time.
//!
//! - [`topology`]: stream, subject and bucket names; a session's partition; creating them.
//! - [`publish`]: a spool → the records stream, at least once, de-duplicated by record id.
//! - [`group`]: membership and partition leases in JetStream KV; rebalancing; takeover.
//! - [`partition`]: one owned partition → traces, checkpointed in KV so another worker can
//!   take it over exactly where this one stopped.
//! - [`read`]: the traces on the bus, for whoever consumes them there.

/// The client this crate speaks JetStream with, for callers that build on it.
pub use async_nats;

pub mod group;
pub mod partition;
pub mod publish;
pub mod read;
pub mod topology;

use std::time::Duration;

/// Where the bus is and how to prove who we are to it.
#[derive(Debug, Clone)]
pub struct BusConnect {
    /// `nats://HOST:PORT`, or `tls://HOST:PORT` for TLS.
    pub url: String,
    /// The server's `authorization { token }`, if it has one.
    pub token: Option<String>,
    /// A user of the server's `authorization { users }` and its password: the role this
    /// process has on the bus (`deploy/kubernetes/components/bus/nats.conf`: publisher, worker, node),
    /// each allowed only the subjects that role needs. The client's reply inboxes are
    /// `_INBOX.<user>.…`, so a role's permissions can keep other roles' replies from it.
    pub user: Option<BusUser>,
    /// A PEM file of CA certificates the server's certificate may chain to (besides the
    /// system's roots); TLS is required when set.
    pub ca: Option<std::path::PathBuf>,
}

/// Connects to the NATS server, retrying the first connection (a bus that is down at start is
/// waited for, like one that goes down later).
pub async fn connect(
    bus: &BusConnect,
    name: &str,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    options(bus, name)
        .retry_on_initial_connect()
        .connect(bus.url.as_str())
        .await
}

/// Connects to the NATS server once, now: an unreachable bus or a refused token is an error
/// at once (for processes that cannot do anything without the bus, such as a cluster's
/// rollout node; it reconnects by itself after that first connection).
pub async fn connect_now(
    bus: &BusConnect,
    name: &str,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    options(bus, name).connect(bus.url.as_str()).await
}

/// A NATS user and its password (the password is never printed).
#[derive(Clone)]
pub struct BusUser {
    pub name: String,
    pub password: String,
}

impl std::fmt::Debug for BusUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusUser")
            .field("name", &self.name)
            .field("password", &"…")
            .finish()
    }
}

/// The reply-inbox prefix of a client that is `user` on the bus.
pub fn inbox_prefix(user: &str) -> String {
    format!("_INBOX.{user}")
}

fn options(bus: &BusConnect, name: &str) -> async_nats::ConnectOptions {
    let url = bus.url.clone();
    let client = name.to_owned();
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .event_callback(move |event| {
            let (url, client) = (url.clone(), client.clone());
            async move { log_event(&url, &client, event) }
        });
    if let Some(token) = &bus.token {
        options = options.token(token.clone());
    }
    if let Some(user) = &bus.user {
        options = options
            .user_and_password(user.name.clone(), user.password.clone())
            .custom_inbox_prefix(inbox_prefix(&user.name));
    }
    if let Some(ca) = &bus.ca {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    options
}

/// What the server tells a client about itself, logged. A permission violation (the server's
/// `-ERR 'Permissions Violation for Publish to "SUBJECT"'`) is an error with its subject: the
/// request it refused would otherwise only time out, and the process would seem to hang.
fn log_event(url: &str, client: &str, event: async_nats::Event) {
    use async_nats::{Event, ServerError};
    match event {
        Event::ServerError(ServerError::Other(e))
            if e.to_ascii_lowercase().contains("permissions violation") =>
        {
            tracing::error!(bus = %url, client, refused = %e, "the bus refused this: a permission violation (this process's bus user is not allowed that subject; see docs/scale-out.md, \"Roles on the bus\")");
        }
        Event::ServerError(ServerError::AuthorizationViolation) => {
            tracing::error!(bus = %url, client, "the bus refused our credentials (authorization violation)");
        }
        Event::ServerError(e) => {
            tracing::warn!(bus = %url, client, error = %e, "the bus reported an error")
        }
        Event::ClientError(e) => tracing::warn!(bus = %url, client, error = %e, "bus client error"),
        Event::SlowConsumer(sid) => {
            tracing::warn!(bus = %url, client, sid, "slow consumer on the bus")
        }
        Event::Disconnected => tracing::info!(bus = %url, client, "disconnected from the bus"),
        Event::Connected => tracing::debug!(bus = %url, client, "connected to the bus"),
        other => tracing::debug!(bus = %url, client, event = %other, "bus event"),
    }
}

/// JetStream on `client`, with a publish-ack timeout that tolerates a busy 2-core host.
pub fn jetstream(client: async_nats::Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .build(client)
}
