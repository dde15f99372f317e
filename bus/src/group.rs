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
use tokentap_reconstruct::LiveOptions;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::partition::{run_partition, GroupMetrics, LocalOutput, PartitionError};
use crate::topology::Topology;

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
    topology: Topology,
    id: String,
    options: LiveOptions,
    out: LocalOutput,
    metrics: GroupMetrics,
    owned: HashMap<u32, Owned>,
    cooling: HashMap<u32, tokio::time::Instant>,
}

impl Member {
    /// `id` must be unique in the group (a host name and process id, say).
    pub fn new(
        topology: Topology,
        id: String,
        options: LiveOptions,
        out: LocalOutput,
        metrics: GroupMetrics,
    ) -> Member {
        Member {
            topology,
            id,
            options,
            out,
            metrics,
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
                        tracing::warn!(member = %self.id, error = %e, "a group round failed");
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
        let _ = self.topology.leases.delete(member_key(&self.id)).await;
        tracing::info!(member = %self.id, "left the group");
        Ok(())
    }

    async fn round(&mut self) -> anyhow::Result<()> {
        self.topology
            .leases
            .put(member_key(&self.id), self.id.clone().into())
            .await?;
        self.reap_finished_tasks().await;
        self.renew().await;

        let keys = self.keys().await?;
        let members = keys.iter().filter(|k| k.starts_with("member.")).count();
        let target = fair_share(self.topology.partitions, members);
        self.metrics.members.set(members as i64);

        // Hand back the surplus first: a joining member is waiting for it.
        while self.owned.len() > target {
            let Some(&p) = self.owned.keys().max() else {
                break;
            };
            tracing::info!(member = %self.id, partition = p, members, target, "handing a partition back");
            self.release(p).await;
        }
        // Then take free partitions, starting at a place of our own so members that start
        // together do not all race for partition 0.
        let now = tokio::time::Instant::now();
        self.cooling.retain(|_, until| *until > now);
        let n = self.topology.partitions;
        let start = crate::topology::partition_of(&self.id, n);
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
                .topology
                .leases
                .create(lease_key(p), self.id.clone().into())
                .await
            {
                Ok(revision) => self.take(p, revision),
                // Another member was quicker.
                Err(e) => tracing::debug!(partition = p, error = %e, "lease not taken"),
            }
        }
        self.metrics.partitions_owned.set(self.owned.len() as i64);
        Ok(())
    }

    /// The leases bucket's live keys (expired and deleted ones are not listed).
    async fn keys(&self) -> anyhow::Result<BTreeSet<String>> {
        let mut keys = BTreeSet::new();
        let mut listing = self.topology.leases.keys().await?;
        while let Some(k) = listing.next().await {
            keys.insert(k?);
        }
        Ok(keys)
    }

    fn take(&mut self, partition: u32, revision: u64) {
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run_partition(
            self.topology.clone(),
            partition,
            self.id.clone(),
            self.options.clone(),
            self.out.clone(),
            self.metrics.clone(),
            stopped,
        ));
        self.metrics.takeovers.inc();
        tracing::info!(member = %self.id, partition, "lease taken");
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
                .topology
                .leases
                .update(lease_key(p), self.id.clone().into(), owned.revision)
                .await
            {
                Ok(revision) => owned.revision = revision,
                Err(e) => {
                    tracing::warn!(member = %self.id, partition = p, error = %e, "lease lost");
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
                Ok(Err(e)) => tracing::warn!(member = %self.id, error = %e, "partition stopped"),
                Err(e) => {
                    tracing::error!(member = %self.id, partition = p, error = %e, "partition task panicked")
                }
            }
            self.cooling
                .insert(p, tokio::time::Instant::now() + COOL_OFF);
            let _ = self
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
                tracing::warn!(member = %self.id, error = %e, "partition stopped with an error")
            }
            Err(e) => {
                tracing::error!(member = %self.id, partition, error = %e, "partition task panicked")
            }
        }
        if let Err(e) = self
            .topology
            .leases
            .delete_expect_revision(lease_key(partition), Some(owned.revision))
            .await
        {
            tracing::warn!(member = %self.id, partition, error = %e, "could not free a lease (it expires by itself)");
        }
        self.metrics.partitions_owned.set(self.owned.len() as i64);
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
