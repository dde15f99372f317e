//! Limits on the capture listeners, so that a slow or hostile client (an agent holding
//! connections half-open, trickling a header, never finishing a TLS handshake) cannot starve
//! the harness calls the proxy is there to serve.
//!
//! Every connection holds a [`ConnectionPermit`] for its life; past `max_connections` new
//! connections are closed at once (the accept loop never waits). Each phase of a connection
//! has a deadline: the TLS handshake, the request head (from the first byte on a new
//! connection), the body, and the wait for the next request on a kept-alive one.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Deadlines and the connection cap shared by every listener of one capture service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerLimits {
    /// A new connection's request head must arrive whole within this.
    pub header_timeout: Duration,
    /// A request body must arrive whole within this.
    pub body_timeout: Duration,
    /// A TLS handshake (transparent interception) must finish within this.
    pub tls_handshake_timeout: Duration,
    /// A kept-alive connection is closed when its next request head has not arrived within this.
    pub idle_timeout: Duration,
    /// Connections open at once, over all listeners of the service.
    pub max_connections: usize,
    /// A request's head (target and headers) larger than this is refused with a 431 before
    /// anything else is done with it.
    pub max_header_bytes: usize,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        ListenerLimits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(60),
            tls_handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_header_bytes: 64 << 10,
        }
    }
}

/// A connection's place under the cap; released when dropped (the connection closed).
#[derive(Debug)]
pub struct ConnectionPermit(#[allow(dead_code)] OwnedSemaphorePermit);

/// Hands out [`ConnectionPermit`]s up to the cap, without waiting.
#[derive(Debug, Clone)]
pub struct ConnectionGate {
    slots: Arc<Semaphore>,
    max: usize,
}

impl ConnectionGate {
    pub fn new(max_connections: usize) -> Self {
        let max = max_connections.clamp(1, Semaphore::MAX_PERMITS);
        ConnectionGate {
            slots: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A permit, or `None` when `max_connections` are open (the caller closes the connection).
    pub fn admit(&self) -> Option<ConnectionPermit> {
        self.slots
            .clone()
            .try_acquire_owned()
            .ok()
            .map(ConnectionPermit)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_refuses_past_the_cap_and_frees_on_drop() {
        let gate = ConnectionGate::new(3);
        let held: Vec<_> = (0..3)
            .map(|_| gate.admit().expect("under the cap"))
            .collect();
        assert_eq!(gate.open(), 3);
        assert!(gate.admit().is_none(), "a fourth connection is refused");
        drop(held);
        assert_eq!(gate.open(), 0);
        assert!(gate.admit().is_some());
    }
}
