//! `mmu_lock` in virtual time: a holder reserves `[start, end)`; a reader starts once every
//! writer reserved so far has finished, a writer once every holder has. Requests are served in
//! the order the engine processes them, which is virtual-time order, so the queue is FIFO as
//! the kernel's queued rwlock is.
//!
//! The lock word is a cache line, and every acquire and release is an atomic on it
//! ([`VirtualLock::take_line`]): when another core used it last, the line must move to this
//! core first, readers included. The line serves one transfer at a time, so under contention
//! the lock hands over no faster than a transfer per acquire and per release — what bounds
//! read-side scaling of a shared rwlock on a many-core machine. Simplified: both transfers of a
//! critical section are reserved on the line when it is taken (the release's transfer happens
//! later in reality; reserving it early keeps the line's throughput right without reordering
//! reservations already made).

use super::pricer::{ps_to_ns, Ps};
use crate::kvm::mmu_lock::{LockMode, LockStats};
use std::sync::atomic::Ordering;

/// `mmu_lock` as reservations in virtual time.
#[derive(Default, Debug)]
pub struct VirtualLock {
    /// When the last reader reserved so far is done.
    readers_until: Ps,
    /// When the last writer reserved so far is done.
    writer_until: Ps,
    /// When the lock word's cache line is free for the next transfer.
    line_free: Ps,
    /// The actor whose core holds the line (`None`: no one has taken the lock yet).
    line_owner: Option<usize>,
}

/// The actor number of the VMM thread for [`VirtualLock::take_line`] (vCPUs use their index).
pub const VMM_ACTOR: usize = usize::MAX;

impl VirtualLock {
    /// The earliest instant a request for `mode` made at `t` can be granted.
    pub fn grant_time(&self, mode: LockMode, t: Ps) -> Ps {
        match mode {
            LockMode::Read => t.max(self.writer_until),
            LockMode::Write => t.max(self.writer_until).max(self.readers_until),
        }
    }

    /// The lock was granted to `actor` at `granted`: returns when its acquire atomic can start
    /// (after the line's earlier transfers) and how many line transfers the critical section
    /// costs: none when this actor's core used the line last (no other actor took the lock
    /// since), else two (the acquire and the release), each `transfer` long on the line.
    pub fn take_line(&mut self, actor: usize, granted: Ps, transfer: Ps) -> (Ps, u64) {
        if self.line_owner == Some(actor) {
            return (granted, 0);
        }
        let start = granted.max(self.line_free);
        self.line_free = start + 2 * transfer;
        self.line_owner = Some(actor);
        (start, 2)
    }

    /// Reserves the lock in `mode` for `[start, end)`. A `new` acquisition is counted in
    /// `stats` as lock_stat would (with the contention and the wait when the request at
    /// `requested` had to wait); a job resuming a lock it never released is not.
    pub fn hold(
        &mut self,
        mode: LockMode,
        requested: Ps,
        start: Ps,
        end: Ps,
        new: bool,
        stats: &LockStats,
    ) {
        let (acq, cont, wait) = match mode {
            LockMode::Read => (
                &stats.read_acquired,
                &stats.read_contended,
                &stats.read_wait_ns,
            ),
            LockMode::Write => (
                &stats.write_acquired,
                &stats.write_contended,
                &stats.write_wait_ns,
            ),
        };
        if new {
            acq.fetch_add(1, Ordering::Relaxed);
        }
        if new && start > requested {
            cont.fetch_add(1, Ordering::Relaxed);
            wait.fetch_add(ps_to_ns(start - requested), Ordering::Relaxed);
        }
        match mode {
            LockMode::Read => self.readers_until = self.readers_until.max(end),
            LockMode::Write => self.writer_until = end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_share_writers_exclude_and_waits_are_counted() {
        let stats = LockStats::default();
        let mut l = VirtualLock::default();
        assert_eq!(l.grant_time(LockMode::Read, 10), 10);
        l.hold(LockMode::Read, 10, 10, 50, true, &stats);
        assert_eq!(l.grant_time(LockMode::Read, 20), 20, "readers share");
        l.hold(LockMode::Read, 20, 20, 60, true, &stats);
        assert_eq!(
            l.grant_time(LockMode::Write, 30),
            60,
            "a writer waits for every reader"
        );
        l.hold(LockMode::Write, 30, 60, 100, true, &stats);
        l.hold(LockMode::Write, 100, 100, 120, false, &stats);
        assert_eq!(
            l.grant_time(LockMode::Read, 70),
            120,
            "a reader queues behind the writer and its resumed chunk"
        );
        assert_eq!(stats.write_contended.load(Ordering::Relaxed), 1);
        assert_eq!(
            stats.write_acquired.load(Ordering::Relaxed),
            1,
            "a resumed chunk is not an acquisition"
        );
        assert_eq!(l.grant_time(LockMode::Read, 110), 120);
        assert_eq!(stats.read_acquired.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn the_lock_line_moves_only_between_actors_and_serializes_its_transfers() {
        let mut l = VirtualLock::default();
        assert_eq!(
            l.take_line(0, 100, 10),
            (100, 2),
            "first use: the line comes in"
        );
        assert_eq!(l.take_line(0, 150, 10), (150, 0), "same core: stays local");
        // Two other readers granted at once queue on the line: 2 transfers each.
        assert_eq!(l.take_line(1, 200, 10), (200, 2));
        assert_eq!(l.take_line(2, 200, 10), (220, 2), "waits for the line");
        assert_eq!(
            l.take_line(VMM_ACTOR, 500, 10),
            (500, 2),
            "a free line: no wait"
        );
    }
}
