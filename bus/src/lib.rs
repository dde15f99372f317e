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

fn options(bus: &BusConnect, name: &str) -> async_nats::ConnectOptions {
    let mut options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5));
    if let Some(token) = &bus.token {
        options = options.token(token.clone());
    }
    if let Some(ca) = &bus.ca {
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    options
}

/// JetStream on `client`, with a publish-ack timeout that tolerates a busy 2-core host.
pub fn jetstream(client: async_nats::Client) -> async_nats::jetstream::Context {
    async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .build(client)
}
