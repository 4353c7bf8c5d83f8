//! `vmmu lock-bench`: the virtual-time `mmu_lock` alone ([`VirtualLock`]), hammered by cores
//! that take it in a read/write mix, hold it and think between acquisitions, as a locking
//! microbenchmark does on a real host. It prints what the lock model makes of contention:
//! acquisitions per second, the hand-off latency, and the line transfers by protocol step. A
//! check of the model against published lock measurements, not a fit.

use crate::cost::CostModel;
use crate::engine::virtual_time::lock::{Core, HoldBy, LineCost, VirtualLock};
use crate::engine::virtual_time::{ps_to_ns, Ps};
use crate::kvm::mmu_lock::{LockKind, LockMode, LockStats, LINE_STEPS};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;

/// One run of the benchmark.
#[derive(Clone, Debug)]
pub struct LockBenchParams {
    /// Cores taking the lock.
    pub cores: usize,
    /// Which lock.
    pub kind: LockKind,
    /// Read acquisitions per write acquisition of each core (0: every acquisition writes).
    /// With a spinlock every acquisition excludes the others.
    pub reads_per_write: u64,
    /// Acquisitions per core.
    pub ops_per_core: u64,
    /// How long a holder holds the lock, ns.
    pub hold_ns: f64,
    /// How long a core works between releasing the lock and asking again, ns.
    pub think_ns: f64,
}

/// What one run measured (virtual time).
#[derive(Clone, Debug, serde::Serialize)]
pub struct LockBenchResult {
    /// Cores taking the lock.
    pub cores: usize,
    /// Acquisitions, all cores.
    pub acquisitions: u64,
    /// From the first request to the last release, ns.
    pub elapsed_ns: u64,
    /// Acquisitions per second, all cores.
    pub acquisitions_per_s: f64,
    /// Mean time from a release to the next holder's start, over the hand-offs, ns.
    pub handoff_ns: f64,
    /// Acquisitions that took the slow path.
    pub contended: u64,
    /// Line transfers per acquisition.
    pub transfers_per_acquisition: f64,
    /// Line transfers by protocol step (`LINE_STEPS` order), and across sockets.
    pub transfers: Vec<(&'static str, u64)>,
    /// Line transfers that crossed sockets.
    pub remote_transfers: u64,
}

/// The mode of a core's `i`-th acquisition: one write in every `reads_per_write + 1`, the
/// cores' writes spread apart.
fn mode(p: &LockBenchParams, core: usize, i: u64) -> LockMode {
    let period = p.reads_per_write + 1;
    let offset = core as u64 * period / p.cores.max(1) as u64;
    if (i + offset) % period == p.reads_per_write {
        LockMode::Write
    } else {
        LockMode::Read
    }
}

/// Runs the benchmark: the core with the lowest clock asks next, as the virtual-time engine
/// orders requests; each core starts at 0 and its acquisitions follow one another.
pub fn run_lock_bench(p: &LockBenchParams, cost: &CostModel) -> LockBenchResult {
    let stats = LockStats::default();
    let mut lock = VirtualLock::new(p.kind, LineCost::from_cost_model(cost));
    let sockets = cost.host.vcpu_sockets(p.cores);
    let hold = (p.hold_ns * 1000.0).round() as Ps;
    let think = (p.think_ns * 1000.0).round() as Ps;
    let mut done = vec![0u64; p.cores];
    let mut ready: BinaryHeap<Reverse<(Ps, usize)>> =
        (0..p.cores).map(|c| Reverse((0, c))).collect();
    let mut last = 0;
    while let Some(Reverse((t, c))) = ready.pop() {
        let core = Core {
            actor: c,
            socket: sockets[c],
        };
        let m = mode(p, c, done[c]);
        let grant = lock.acquire(m, core, t);
        let by = HoldBy {
            mode: m,
            core,
            requested: Some(t),
        };
        let end = lock.hold(&stats, by, grant, grant.start + hold);
        last = last.max(end);
        done[c] += 1;
        if done[c] < p.ops_per_core {
            ready.push(Reverse((end + think, c)));
        }
    }
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let acquisitions = load(&stats.read_acquired) + load(&stats.write_acquired);
    let transfers: Vec<_> = LINE_STEPS
        .iter()
        .zip(&stats.line_transfers)
        .map(|((_, name), a)| (*name, load(a)))
        .collect();
    let total: u64 = transfers.iter().map(|(_, n)| n).sum();
    let handoffs = load(&stats.handoffs);
    LockBenchResult {
        cores: p.cores,
        acquisitions,
        elapsed_ns: ps_to_ns(last),
        acquisitions_per_s: acquisitions as f64 / (last as f64 / 1e12),
        handoff_ns: if handoffs == 0 {
            0.0
        } else {
            load(&stats.handoff_ns) as f64 / handoffs as f64
        },
        contended: load(&stats.read_contended) + load(&stats.write_contended),
        transfers_per_acquisition: total as f64 / acquisitions.max(1) as f64,
        transfers,
        remote_transfers: load(&stats.line_transfers_remote),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(cores: usize, reads_per_write: u64) -> LockBenchParams {
        LockBenchParams {
            cores,
            kind: LockKind::Rwlock,
            reads_per_write,
            ops_per_core: 2000,
            hold_ns: 100.0,
            think_ns: 0.0,
        }
    }

    #[test]
    fn one_core_never_contends_and_more_cores_share_the_line() {
        let cost = CostModel::default();
        let one = run_lock_bench(&params(1, 0), &cost);
        assert_eq!(one.contended, 0);
        assert_eq!(one.acquisitions, 2000);
        assert!(one.transfers_per_acquisition < 0.01);
        // Writers exclude each other: 8 cores get no more acquisitions per second than one
        // core's back-to-back holds allow.
        let writers = run_lock_bench(&params(8, 0), &cost);
        assert!(writers.acquisitions_per_s < 1e9 / 100.0);
        assert!(writers.handoff_ns > 0.0);
        // Readers share: more throughput than the writers, bounded by the line.
        let readers = run_lock_bench(&params(8, 10_000), &cost);
        assert!(readers.acquisitions_per_s > writers.acquisitions_per_s);
        assert!(readers.transfers_per_acquisition >= 1.9, "{readers:?}");
    }

    #[test]
    fn the_mix_has_the_asked_ratio() {
        let p = params(4, 3);
        let writes = (0..4)
            .flat_map(|c| (0..400).map(move |i| (c, i)))
            .filter(|&(c, i)| mode(&p, c, i) == LockMode::Write)
            .count();
        assert_eq!(writes, 4 * 100);
    }
}
