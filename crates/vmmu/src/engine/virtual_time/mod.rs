//! The virtual-time engine: every actor (the vCPUs, the VMM thread) runs on one OS thread, in
//! the order of its virtual clock, and what it does costs what the [`CostModel`] says its
//! [`Meter`] counted. A run at 64 or 256 vCPUs on a 2-core machine gives the same numbers every
//! time.
//!
//! - [`scheduler`]: the actors and their clocks ([`VirtualTime`]): vCPUs run up to a horizon,
//!   the VMM runs plans at its own clock, faults and jobs hold `mmu_lock` in virtual time.
//! - [`lock`]: `mmu_lock` in virtual time ([`VirtualLock`]), Linux's queued spinlock and queued
//!   rwlock step by step, each step paying the transfers of the lock word's cache line it
//!   causes. The holder's end is its start plus its cost.
//! - [`vm_lines`]: the VM-wide lines of MMU state critical sections write, which move to the
//!   holder's core ([`vm_lines::VmLines`]).
//! - [`epoch`]: the resources vCPUs share without being actors (each socket's DRAM bandwidth,
//!   the guest's lines in the last-level caches), accounted per epoch of virtual time so that
//!   no result depends on the order in which one epoch's accesses ran ([`epoch::Epochs`]).
//! - [`drift`]: why the vCPUs do not run in lockstep: the order and spacing in which they start
//!   each pass, and the host's periodic tick ([`drift::Drift`]).
//! - [`pricer`]: picoseconds, and the cost model as a price per counted event ([`Pricer`]).
//! - [`wall`]: where the host's own wall clock goes in a run, printed on request
//!   (`VMMU_ENGINE_TIMES`).
//! - [`VirtualWaiter`]: waits on vCPUs complete at once. A kicked vCPU cannot run an access
//!   between the kick and its next step (one thread runs everything), and its next step sees
//!   the kick first and flushes its TLB; so the ack is immediate functionally, and its latency is
//!   charged to the flusher through `flush_kicks`. An SRCU grace period is immediate too: before
//!   a `synchronize_srcu()` step the VMM lets every vCPU inside a fault finish its slow half and
//!   moves its clock to where the last one ended ([`PlanPoint::BeforeSrcuSync`]). A broadcast
//!   TLBI's `DSB ISH` completes at once for the same reason as a kick: a vCPU in guest mode is
//!   between accesses while another actor runs, and its next step applies what was posted to
//!   its TLB before its next access (`TlbShootdown::sync`); so every vCPU behaves as if it had
//!   applied the invalidation at the flusher's step.
//!
//! Ordering: the actor with the lowest clock runs, until it passes the next one's; an exit
//! waits for its vCPU's clock to be the lowest, and a fault's slow half requests `mmu_lock` at
//! its own virtual time. Simplifications: a holder's functional work runs at its grant rather
//! than spread over its hold, and a fault's lockless front half (the fast path) changes the
//! page tables when its exit starts, not after the exit's price. A job's `rwlock_needbreak()`
//! brings the vCPUs up to the job's clock and is true only when a fault among them asked for
//! the lock in a conflicting mode meanwhile, so a job yields exactly to real waiters.

pub mod drift;
pub mod epoch;
pub mod fast_forward;
pub mod lock;
pub mod pricer;
pub mod scheduler;
pub mod vm_lines;
pub mod wall;

pub use lock::VirtualLock;
pub use pricer::{check_cost_model, cost_ps, ps_to_ns, Pricer, Ps};
pub use scheduler::VirtualTime;

use crate::kvm::vcpu::{VcpuShared, VcpuWaiter};
#[cfg(doc)]
use crate::{cost::CostModel, kvm::meter::Meter, vm::plan::PlanPoint};

/// The virtual-time engine's [`VcpuWaiter`] (see the module documentation).
pub struct VirtualWaiter;

impl VcpuWaiter for VirtualWaiter {
    fn wait_for_exits(&self, _vcpus: &[VcpuShared], _kicked: &[usize]) {}

    fn wait_for_tlbi(&self, _vcpus: &[VcpuShared], _seqs: &[u64]) {}

    fn synchronize_srcu(&self, vcpus: &[VcpuShared]) {
        for (i, v) in vcpus.iter().enumerate() {
            assert!(
                v.srcu_seq() % 2 == 0,
                "vCPU {i} is inside a fault at synchronize_srcu(): the VMM lets faults finish first"
            );
        }
    }
}
