//! `mmu_lock` in virtual time: a holder reserves `[start, end)`; a reader starts once every
//! writer reserved so far has finished, a writer once every holder has. Requests are served in
//! the order the engine processes them, which is virtual-time order, so the queue is FIFO as
//! the kernel's queued rwlock is.

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
}

impl VirtualLock {
    /// The earliest instant a request for `mode` made at `t` can be granted.
    pub fn grant_time(&self, mode: LockMode, t: Ps) -> Ps {
        match mode {
            LockMode::Read => t.max(self.writer_until),
            LockMode::Write => t.max(self.writer_until).max(self.readers_until),
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
}
