//! A worker group: members announce themselves in the leases bucket (`member.ID`, renewed every
//! [`ROUND`], gone [`LEASE_TTL`](crate::topology::LEASE_TTL) after the last renewal) and split the partitions by lease
//! (`lease.P`, created by exactly one member, renewed by compare-and-set on its revision). Each
//! member aims at `ceil(partitions / members)`: it takes free partitions up to that and hands
//! back the surplus when members join, so the group converges without a coordinator.
//!
//! A killed member stops renewing: its leases expire within [`LEASE_TTL`](crate::topology::LEASE_TTL) and the others take
//! its partitions on their next round, resuming from the partitions' checkpoints (see
//! [`crate::partition`]). Bound: a killed worker's partitions are running again within
//! `LEASE_TTL + ROUND` plus the server's expiry sweep (about 1 s).

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::partition::{run_partition, PartitionError, WorkerContext};

/// How often a member renews its leases and rebalances.
pub const ROUND: Duration = Duration::from_secs(2);
/// A partition whose task failed (bus trouble) is not taken again by this member for this long.
const COOL_OFF: Duration = Duration::from_secs(5);

pub fn member_key(member: &str) -> String {
    format!("member.{member}")
}

pub fn lease_key(partition: u32) -> String {
    format!("lease.{partition}")
}

/// How many partitions each of `members` members should hold.
pub fn fair_share(partitions: u32, members: usize) -> usize {
    (partitions as usize).div_ceil(members.max(1))
}

struct Owned {
    revision: u64,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), PartitionError>>,
}

/// One member of the group.
pub struct Member {
    w: WorkerContext,
    owned: HashMap<u32, Owned>,
    cooling: HashMap<u32, tokio::time::Instant>,
}

impl Member {
    /// `w.member` must be unique in the group (a host name and process id, say).
    pub fn new(w: WorkerContext) -> Member {
        Member {
            w,
            owned: HashMap::new(),
            cooling: HashMap::new(),
        }
    }

    /// Runs rounds until `stop` turns true, then releases every partition (each checkpointed)
    /// and leaves the group.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) -> anyhow::Result<()> {
        let mut tick = tokio::time::interval(ROUND);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Err(e) = self.round().await {
                        // The bus is unreachable: the partitions' tasks keep what they have
                        // until their own bus calls fail; leases that expire meanwhile are
                        // noticed on the next successful round.
                        tracing::warn!(member = %self.w.member, error = %e, "a group round failed");
                    }
                }
                changed = stop.changed() => {
                    if changed.is_err() || *stop.borrow() {
                        break;
                    }
                }
            }
        }
        let partitions: Vec<u32> = self.owned.keys().copied().collect();
        for p in partitions {
            self.release(p).await;
        }
        let _ = self
            .w
            .topology
            .leases
            .delete(member_key(&self.w.member))
            .await;
        tracing::info!(member = %self.w.member, "left the group");
        Ok(())
    }

    async fn round(&mut self) -> anyhow::Result<()> {
        self.w
            .topology
            .leases
            .put(member_key(&self.w.member), self.w.member.clone().into())
            .await?;
        self.reap_finished_tasks().await;
        self.renew().await;

        let keys = self.keys().await?;
        let members = keys.iter().filter(|k| k.starts_with("member.")).count();
        let target = fair_share(self.w.topology.partitions, members);
        self.w.metrics.members.set(members as i64);

        // Hand back the surplus first: a joining member is waiting for it.
        while self.owned.len() > target {
            let Some(&p) = self.owned.keys().max() else {
                break;
            };
            tracing::info!(member = %self.w.member, partition = p, members, target, "handing a partition back");
            self.release(p).await;
        }
        // Then take free partitions, starting at a place of our own so members that start
        // together do not all race for partition 0.
        let now = tokio::time::Instant::now();
        self.cooling.retain(|_, until| *until > now);
        let n = self.w.topology.partitions;
        let start = crate::topology::partition_of(&self.w.member, n);
        for i in 0..n {
            if self.owned.len() >= target {
                break;
            }
            let p = (start + i) % n;
            if self.owned.contains_key(&p)
                || self.cooling.contains_key(&p)
                || keys.contains(&lease_key(p))
            {
                continue;
            }
            match self
                .w
                .topology
                .leases
                .create(lease_key(p), self.w.member.clone().into())
                .await
            {
                Ok(revision) => self.take(p, revision),
                // Another member was quicker.
                Err(e) => tracing::debug!(partition = p, error = %e, "lease not taken"),
            }
        }
        self.w.metrics.partitions_owned.set(self.owned.len() as i64);
        Ok(())
    }

    /// The leases bucket's live keys (expired and deleted ones are not listed).
    async fn keys(&self) -> anyhow::Result<BTreeSet<String>> {
        let mut keys = BTreeSet::new();
        let mut listing = self.w.topology.leases.keys().await?;
        while let Some(k) = listing.next().await {
            keys.insert(k?);
        }
        Ok(keys)
    }

    fn take(&mut self, partition: u32, revision: u64) {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run_partition(self.w.clone(), partition, stopped));
        self.w.metrics.takeovers.inc();
        tracing::info!(member = %self.w.member, partition, "lease taken");
        self.owned.insert(
            partition,
            Owned {
                revision,
                stop,
                task,
            },
        );
    }

    /// Renews every lease held; a lease that cannot be renewed at its revision was lost (it
    /// expired while this member was stalled, and another took it): its task is stopped.
    async fn renew(&mut self) {
        let mut lost = Vec::new();
        for (&p, owned) in self.owned.iter_mut() {
            match self
                .w
                .topology
                .leases
                .update(lease_key(p), self.w.member.clone().into(), owned.revision)
                .await
            {
                Ok(revision) => owned.revision = revision,
                Err(e) => {
                    tracing::warn!(member = %self.w.member, partition = p, error = %e, "lease lost");
                    lost.push(p);
                }
            }
        }
        for p in lost {
            if let Some(owned) = self.owned.remove(&p) {
                let _ = owned.stop.send(true);
                // Its checkpoint is fenced by the progress revision: nothing it writes now
                // overrides the new owner's.
                let _ = owned.task.await;
            }
        }
    }

    /// Partitions whose task ended by itself (fenced, or the bus failed under it): the lease
    /// is given up and the partition left alone for a while.
    async fn reap_finished_tasks(&mut self) {
        let done: Vec<u32> = self
            .owned
            .iter()
            .filter(|(_, o)| o.task.is_finished())
            .map(|(&p, _)| p)
            .collect();
        for p in done {
            let owned = self.owned.remove(&p).expect("listed");
            match owned.task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(member = %self.w.member, error = %e, "partition stopped")
                }
                Err(e) => {
                    tracing::error!(member = %self.w.member, partition = p, error = %e, "partition task panicked")
                }
            }
            self.cooling
                .insert(p, tokio::time::Instant::now() + COOL_OFF);
            let _ = self
                .w
                .topology
                .leases
                .delete_expect_revision(lease_key(p), Some(owned.revision))
                .await;
        }
    }

    /// Stops a partition (it checkpoints), then frees its lease for the next owner.
    async fn release(&mut self, partition: u32) {
        let Some(owned) = self.owned.remove(&partition) else {
            return;
        };
        let _ = owned.stop.send(true);
        match owned.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(member = %self.w.member, error = %e, "partition stopped with an error")
            }
            Err(e) => {
                tracing::error!(member = %self.w.member, partition, error = %e, "partition task panicked")
            }
        }
        if let Err(e) = self
            .w
            .topology
            .leases
            .delete_expect_revision(lease_key(partition), Some(owned.revision))
            .await
        {
            tracing::warn!(member = %self.w.member, partition, error = %e, "could not free a lease (it expires by itself)");
        }
        self.w.metrics.partitions_owned.set(self.owned.len() as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_partition() {
        assert_eq!(fair_share(16, 1), 16);
        assert_eq!(fair_share(16, 2), 8);
        assert_eq!(fair_share(16, 3), 6);
        assert_eq!(fair_share(16, 0), 16);
        for members in 1..40 {
            assert!(fair_share(16, members) * members >= 16);
        }
    }
}
