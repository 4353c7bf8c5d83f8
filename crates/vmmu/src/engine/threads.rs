//! The threads engine's drivers: run a job or a plan on the calling OS thread with the real
//! `mmu_lock`, and complete a vCPU's fault.

use crate::kvm::dirty_log::{OpPlan, OpStep};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, Mmu, MmuJob, RetPf};
use crate::kvm::Kvm;
use crate::units::Gfn;
use crate::vm::vcpu::{AccessExit, FaultStart, Vcpu};

/// Runs `job` to completion: take the lock in the job's mode, run, and on a yield release the
/// lock and let the waiters in (`cond_resched_rwlock_*()`), on a top-up release it and
/// allocate. Returns whether a flush is pending.
pub fn run_job(kvm: &Kvm, job: &mut dyn MmuJob, meter: &mut Meter) -> bool {
    loop {
        let held = kvm.mmu_lock.lock(job.lock_mode());
        let step = job.run(kvm, &held, meter);
        drop(held);
        match step {
            JobStep::Done { flush } => return flush,
            JobStep::Yield => std::thread::yield_now(),
            JobStep::NeedTopup => job.topup(kvm, meter),
        }
    }
}

/// Executes a plan step by step on this thread.
pub fn run_plan(kvm: &Kvm, plan: OpPlan, meter: &mut Meter) {
    let mut pending = false;
    for step in plan.steps {
        match step {
            OpStep::Call(f) => f(kvm, meter),
            OpStep::SyncSrcu => kvm.synchronize_srcu(),
            OpStep::Job(mut job) => pending |= run_job(kvm, &mut *job, meter),
            OpStep::FlushMemslotIfPending(slot) => {
                if std::mem::take(&mut pending) {
                    kvm.flush_remote_tlbs_memslot(&slot, meter);
                }
            }
            OpStep::FlushIfPending => {
                if std::mem::take(&mut pending) {
                    kvm.flush_remote_tlbs(meter);
                }
            }
            OpStep::FlushMemslot(slot) => {
                pending = false;
                kvm.flush_remote_tlbs_memslot(&slot, meter);
            }
        }
    }
}

/// The slow half of a fault on this thread: take `mmu_lock` in the mode the MMU declared and
/// run the fault under it.
pub fn complete_fault(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    fault: &crate::kvm::mmu::KvmPageFault,
) -> RetPf {
    let held = kvm.mmu_lock.lock(mmu.fault_lock_mode(fault));
    mmu.page_fault(kvm, fault, &held, &mut vcpu.caches, &mut vcpu.meter)
}

/// One guest access by a vCPU already in guest mode, handling every exit on this thread the way
/// `KVM_RUN` would (a kick: service requests and re-enter; an EPT violation: fast path, or the
/// slow path under `mmu_lock`, then re-enter) until the access completes. Returns the value
/// read or written; an error is a fault KVM could not handle (no memslot).
pub fn guest_access(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    gfn: Gfn,
    write: bool,
    value: u64,
) -> Result<u64, String> {
    loop {
        match vcpu.access(kvm, mmu, gfn, write, value) {
            Ok(v) => return Ok(v),
            Err(AccessExit::Kicked) => {
                vcpu.exit_guest(kvm);
                vcpu.enter_guest(kvm);
            }
            Err(AccessExit::EptViolation {
                gfn,
                write,
                present,
            }) => {
                vcpu.exit_guest(kvm);
                let r = vcpu.begin_fault(kvm, mmu, gfn, write, present);
                if let Ok(FaultStart::Slow(fault)) = &r {
                    if complete_fault(kvm, mmu, vcpu, fault) == RetPf::Retry {
                        vcpu.meter.pf_retry += 1;
                    }
                }
                vcpu.enter_guest(kvm);
                r?;
            }
        }
    }
}
