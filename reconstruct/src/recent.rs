//! A bounded set of recently seen record ids, for dropping redelivered records.
//!
//! A shipper redelivers only what it sent but did not see acknowledged (its unacked batches,
//! or the tail after its cursor when it restarts), so duplicates are always among the most
//! recent records. The set keeps the last [`RECENT_IDS_WINDOW`] ids; a duplicate of an older
//! record would be accepted again (and reconstruction drops a record id it already holds in an
//! open session).

use std::num::NonZeroUsize;

/// Record ids remembered (about 120 bytes each: some 30 MB at this size).
pub const RECENT_IDS_WINDOW: usize = 262_144;

pub struct RecentIds {
    ids: lru::LruCache<String, ()>,
}

impl Default for RecentIds {
    fn default() -> Self {
        RecentIds::with_window(RECENT_IDS_WINDOW)
    }
}

impl RecentIds {
    pub fn with_window(window: usize) -> Self {
        RecentIds {
            ids: lru::LruCache::new(NonZeroUsize::new(window.max(1)).expect("at least 1")),
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        self.ids.contains(id)
    }

    /// Remembers `id` (forgetting the oldest past the window); false if it was already known.
    pub fn insert(&mut self, id: String) -> bool {
        self.ids.put(id, ()).is_none()
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

impl Extend<String> for RecentIds {
    fn extend<T: IntoIterator<Item = String>>(&mut self, iter: T) {
        for id in iter {
            self.insert(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_bounded_and_keeps_the_newest() {
        let mut r = RecentIds::with_window(1_000);
        for i in 0..10_000 {
            assert!(r.insert(format!("id-{i}")));
        }
        assert_eq!(r.len(), 1_000);
        assert!(r.contains("id-9999") && r.contains("id-9000"));
        assert!(!r.contains("id-8999"), "older than the window");
        assert!(!r.insert("id-9999".into()), "a recent duplicate is known");
    }
}
