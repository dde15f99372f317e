//! The samples this node holds claims on: each one's queue message, the revision of its state
//! this node wrote last, and its room on this node.

use std::collections::HashMap;
use std::sync::Mutex;

use async_nats::jetstream;
use tokentap_bus::async_nats;
use tokio::sync::OwnedSemaphorePermit;

/// A sample claimed here: its queue message (acknowledged when its result is on the bus),
/// the revision of its state this node wrote last, and its room on this node.
pub(crate) struct Ticket {
    pub message: jetstream::Message,
    pub revision: u64,
    pub _room: OwnedSemaphorePermit,
}

/// The samples this node holds claims on.
#[derive(Default)]
pub struct Claims {
    tickets: Mutex<HashMap<String, Ticket>>,
    /// One state write at a time (the event stream and the keep-alive both write).
    pub(crate) writing: tokio::sync::Mutex<()>,
}

impl Claims {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Ticket>> {
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn revision(&self, sample_id: &str) -> Option<u64> {
        self.lock().get(sample_id).map(|t| t.revision)
    }

    pub(crate) fn set_revision(&self, sample_id: &str, revision: u64) {
        if let Some(t) = self.lock().get_mut(sample_id) {
            t.revision = revision;
        }
    }

    pub(crate) fn messages(&self) -> Vec<(String, jetstream::Message)> {
        self.lock()
            .iter()
            .map(|(id, t)| (id.clone(), t.message.clone()))
            .collect()
    }
}
