//! The virtual-time engine's primitives: every actor runs on one OS thread, in the order of its
//! virtual clock, and what it does costs what the [`CostModel`] says its [`Meter`] counted.
//!
//! - [`VirtualWaiter`]: waits on vCPUs complete at once. A kicked vCPU cannot run an access
//!   between the kick and its next step (one thread runs everything), and its next step sees
//!   the kick first and flushes its TLB; so the ack is immediate functionally, and its latency is
//!   charged to the flusher through `flush_kicks`. No vCPU is ever inside a fault at a VMM step
//!   (faults run whole within a vCPU step), so an SRCU grace period is immediate too. A
//!   broadcast TLBI's `DSB ISH` completes at once for the same reason: a vCPU in guest mode is
//!   between accesses while another actor runs, and its next step applies what was posted to
//!   its TLB before its first access (`TlbShootdown::sync`); so every vCPU behaves as if it
//!   had applied the invalidation at the flusher's step.
//! - [`VirtualLock`]: `mmu_lock` as reservations in virtual time. A holder reserves
//!   `[start, end)`; a reader starts once every writer reserved so far has finished, a writer
//!   once every holder has. Requests are served in the order the engine processes them, which
//!   is virtual-time order, so the queue is FIFO as the kernel's queued rwlock is. The
//!   holder's end is its start plus its cost.
//!
//! Simplifications: a holder's functional work runs when its request is processed, even when
//! its grant comes later (a request that waits sees the page tables as of its request, and
//! actors running in between see its effects early). With the TDP MMU in `dirty-log` no request
//! ever waits (faults are readers, and write-held jobs run while vCPUs are idle); shadow-MMU
//! faults take the write lock and do wait. Requests are processed in virtual-time order, so the
//! functional order is still the FIFO grant order; only the moment others see an effect is
//! early. A write-held job stops at each yield point while vCPUs run so they can catch up; a
//! read-held job runs whole.

use crate::cost::CostModel;
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{LockMode, LockStats};
use crate::kvm::vcpu::{VcpuShared, VcpuWaiter};
use std::sync::atomic::Ordering;

/// Picoseconds: virtual clocks count in ps so that sub-nanosecond costs (a TLB hit) add up.
pub type Ps = u64;

/// The cost of `delta` in picoseconds.
pub fn cost_ps(cost: &CostModel, delta: &Meter) -> Ps {
    (cost.nanos_f64(delta) * 1000.0).round() as Ps
}

/// A cost model turned into per-unit picoseconds once, for the engine's hot path (every guest
/// access is priced).
pub struct Pricer {
    unit_ps: [f64; crate::kvm::meter::NR_METER_FIELDS],
}

impl Pricer {
    /// Prices with `cost`.
    pub fn new(cost: &CostModel) -> Self {
        Pricer {
            unit_ps: cost.unit_costs().map(|ns| ns * 1000.0),
        }
    }

    /// The cost of the work counted between `before` and `after`, in picoseconds (the same
    /// value as [`cost_ps`] of the difference).
    #[inline]
    pub fn ps(&self, before: &Meter, after: &Meter) -> Ps {
        let (b, a) = (before.counts(), after.counts());
        let mut sum = 0.0;
        for i in 0..a.len() {
            sum += (a[i] - b[i]) as f64 * self.unit_ps[i];
        }
        sum.round() as Ps
    }
}

/// Picoseconds to nanoseconds (rounded down).
pub fn ps_to_ns(ps: Ps) -> u64 {
    ps / 1000
}

/// The virtual-time engine's [`VcpuWaiter`] (see the module documentation).
pub struct VirtualWaiter;

impl VcpuWaiter for VirtualWaiter {
    fn wait_for_exits(&self, _vcpus: &[VcpuShared], _kicked: &[usize]) {}

    fn wait_for_tlbi(&self, _vcpus: &[VcpuShared], _seqs: &[u64]) {}

    fn synchronize_srcu(&self, vcpus: &[VcpuShared]) {
        for (i, v) in vcpus.iter().enumerate() {
            assert!(
                v.srcu_seq() % 2 == 0,
                "vCPU {i} is inside a fault at a VMM step: not possible in virtual time"
            );
        }
    }
}

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
    fn the_pricer_agrees_with_the_cost_model() {
        let cost = CostModel::default();
        let before = Meter {
            tlb_hits: 3,
            ..Default::default()
        };
        let after = Meter {
            tlb_hits: 10,
            guest_writes: 7,
            ept_violations: 2,
            spte_writes: 5,
            ..Default::default()
        };
        assert_eq!(
            Pricer::new(&cost).ps(&before, &after),
            cost_ps(&cost, &after.since(&before))
        );
    }

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
