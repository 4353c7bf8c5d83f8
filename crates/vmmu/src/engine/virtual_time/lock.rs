//! `mmu_lock` in virtual time: a holder reserves `[start, end)`; a reader starts once every
//! writer reserved so far has finished, a writer once every holder has. Requests are served in
//! the order the engine processes them, which is virtual-time order, so the queue is FIFO as
//! the kernel's queued rwlock is.
//!
//! Handing the lock over moves cache lines between cores ([`VirtualLock::take_line`]):
//! - The lock word: every acquire and release is an atomic on it, so when another core used it
//!   last the line moves in for the acquire and back out for the release, readers included.
//!   The line serves one transfer at a time, so under contention the lock hands over no faster
//!   than a transfer per acquire and per release — what bounds read-side scaling of a shared
//!   rwlock on a many-core machine. Simplified: both transfers of a critical section are
//!   reserved on the line when it is taken (the release's transfer happens later in reality;
//!   reserving it early keeps the line's throughput right without reordering reservations
//!   already made).
//!   A waiter that queued behind the qrwlock's `wait_lock` (a queued spinlock in the same 8
//!   bytes as the lock's counts) moves no other line on the hand-off's path: the MCS queue's
//!   own hand-off happens between waiters while the lock is held.
//! - MMU state every holder writes ([`SharedLine`]): the engine moves such a line only when
//!   another core wrote it last (`kvm->stat.pages[]`, which `kvm_update_page_stats()` updates
//!   whenever a leaf is installed or removed, by faults and by the VMM's jobs).
//!
//! Each transfer costs the in-socket or the cross-socket latency of the cost model, depending
//! on where the engine placed the two actors ([`crate::cost::Host::vcpu_sockets`]).

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
    /// The core that holds the lock word's line.
    line: SharedLine,
}

/// A cache line written by actors in turn: where it is, so a write knows whether it must move.
#[derive(Default, Debug, Clone, Copy)]
pub struct SharedLine {
    /// The actor (and its socket) whose core wrote it last (`None`: nobody yet).
    owner: Option<(usize, u32)>,
}

impl SharedLine {
    /// `actor`, running on `socket`, writes the line: `None` when its core has it already,
    /// else `Some(remote)`, whether it comes from another socket.
    pub fn write(&mut self, actor: usize, socket: u32) -> Option<bool> {
        let moved = match self.owner {
            Some((a, _)) if a == actor => None,
            Some((_, s)) => Some(s != socket),
            None => Some(false),
        };
        self.owner = Some((actor, socket));
        moved
    }
}

/// What one transfer of a line costs: in the socket, and across sockets.
#[derive(Default, Debug, Clone, Copy)]
pub struct LineCost {
    /// In-socket transfer.
    pub local: Ps,
    /// Cross-socket transfer.
    pub remote: Ps,
}

/// The line transfers one hand-off of the lock cost its new holder.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handoff {
    /// When its acquire atomic can start (after the lock word's earlier transfers).
    pub start: Ps,
    /// Transfers within the socket.
    pub local: u64,
    /// Transfers across sockets.
    pub remote: u64,
}

/// The actor number of the VMM thread for [`VirtualLock::take_line`] (vCPUs use their index).
pub const VMM_ACTOR: usize = usize::MAX;

/// The socket the VMM thread runs on.
pub const VMM_SOCKET: u32 = 0;

impl VirtualLock {
    /// The earliest instant a request for `mode` made at `t` can be granted.
    pub fn grant_time(&self, mode: LockMode, t: Ps) -> Ps {
        match mode {
            LockMode::Read => t.max(self.writer_until),
            LockMode::Write => t.max(self.writer_until).max(self.readers_until),
        }
    }

    /// The lock was granted at `granted` to `actor`, running on `socket`: returns when its
    /// acquire atomic can start and the line transfers the hand-off costs: none when this
    /// actor's core used the lock last (no other actor took it since), else the lock word in
    /// and out, two transfers reserved on the line.
    pub fn take_line(&mut self, actor: usize, socket: u32, granted: Ps, cost: LineCost) -> Handoff {
        let Some(remote) = self.line.write(actor, socket) else {
            return Handoff {
                start: granted,
                ..Handoff::default()
            };
        };
        let transfer = if remote { cost.remote } else { cost.local };
        let start = granted.max(self.line_free);
        self.line_free = start + 2 * transfer;
        Handoff {
            start,
            local: if remote { 0 } else { 2 },
            remote: if remote { 2 } else { 0 },
        }
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
        let c = LineCost {
            local: 10,
            remote: 30,
        };
        let h = |start, local, remote| Handoff {
            start,
            local,
            remote,
        };
        assert_eq!(
            l.take_line(0, 0, 100, c),
            h(100, 2, 0),
            "first use: the line comes in"
        );
        assert_eq!(
            l.take_line(0, 0, 150, c),
            h(150, 0, 0),
            "same core: stays local"
        );
        // Two other readers granted at once queue on the line: 2 transfers each.
        assert_eq!(l.take_line(1, 0, 200, c), h(200, 2, 0));
        assert_eq!(
            l.take_line(2, 0, 200, c),
            h(220, 2, 0),
            "waits for the line"
        );
        assert_eq!(
            l.take_line(VMM_ACTOR, VMM_SOCKET, 500, c),
            h(500, 2, 0),
            "a free line: no wait"
        );
        assert_eq!(
            l.take_line(3, 1, 600, c),
            h(600, 0, 2),
            "from the other socket"
        );
        assert_eq!(
            l.take_line(4, 1, 600, c),
            h(660, 2, 0),
            "after two remote transfers; in-socket now"
        );
    }

    #[test]
    fn a_shared_line_moves_only_when_another_core_wrote_it() {
        let mut line = SharedLine::default();
        assert_eq!(line.write(0, 0), Some(false));
        assert_eq!(line.write(0, 0), None);
        assert_eq!(line.write(1, 1), Some(true));
        assert_eq!(line.write(2, 1), Some(false));
    }
}
