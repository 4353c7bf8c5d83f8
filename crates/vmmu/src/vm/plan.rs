//! The VMM side of an ioctl: a KVM operation's [`OpPlan`] executed step by step, and the
//! `mmu_lock` jobs in it run to completion. [`run_plan`] and [`run_job`] take the real lock on
//! the calling thread; [`run_plan_with`] leaves the lock to its caller, so an engine that grants
//! it differently (in virtual time) executes the very same steps in the very same order.

use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_lock::LockMode;
use crate::kvm::op_plan::{OpPlan, OpStep};
use crate::kvm::Kvm;
use crate::units::{owe_flush, GfnRange};

/// Runs `job` to completion: take the lock in the job's mode, run, and on a yield release the
/// lock and let the waiters in (`cond_resched_rwlock_*()`), on a top-up release it and
/// allocate. Returns the range the job owes a flush for.
pub fn run_job(kvm: &Kvm, job: &mut dyn MmuJob, meter: &mut Meter) -> Option<GfnRange> {
    loop {
        let held = kvm.mmu_lock.lock(job.lock_mode());
        let step = job.run(kvm, &held, meter);
        match step {
            // cond_resched_rwlock_*() on a queued rwlock: the waiters get the lock first.
            JobStep::Yield => held.unlock_fair(),
            _ => drop(held),
        }
        // The engine, not the job, counts lock releases: another engine may stop a job at a
        // yield point without releasing the lock (a scheduling pause, not a yield).
        match step {
            JobStep::Done { flush } => return flush,
            JobStep::Yield => {
                meter.lock_yields += 1;
                std::thread::yield_now();
            }
            JobStep::NeedTopup => {
                meter.lock_drops_for_alloc += 1;
                job.topup(kvm, meter);
            }
        }
    }
}

/// Executes a plan step by step on this thread.
pub fn run_plan(kvm: &Kvm, plan: OpPlan, meter: &mut Meter) {
    run_plan_with(kvm, plan, meter, &mut |_, _| {}, &mut |kvm, job, meter| {
        run_job(kvm, job, meter)
    });
}

/// Runs one job under `mmu_lock` to completion, however the engine grants the lock; returns
/// the range it owes a flush for.
pub type JobRunner<'a> = dyn FnMut(&Kvm, &mut dyn MmuJob, &mut Meter) -> Option<GfnRange> + 'a;

/// Where [`run_plan_with`] is in a plan, for an engine that accounts for each step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PlanPoint {
    /// A step is about to run; `Some(mode)` when it takes `mmu_lock`.
    Before(Option<LockMode>),
    /// A `synchronize_srcu()` is about to run: it waits for every vCPU inside `KVM_RUN`'s SRCU
    /// read side, a fault in flight included.
    BeforeSrcuSync,
    /// That step has run.
    After(Option<LockMode>),
}

/// [`run_plan`], calling `hook` around every step with the meter as it stands (so an engine can
/// advance other actors before a step and charge its cost after it) and running jobs with
/// `run_job`.
pub fn run_plan_with(
    kvm: &Kvm,
    plan: OpPlan,
    meter: &mut Meter,
    hook: &mut dyn FnMut(PlanPoint, &Meter),
    run_job: &mut JobRunner,
) {
    // What the plan's jobs owe a flush for; the flush steps flush as KVM's callers do (the
    // memslot, or everything), whatever the range.
    let mut pending: Option<GfnRange> = None;
    let mut steps: std::collections::VecDeque<OpStep> = plan.steps.into();
    while let Some(step) = steps.pop_front() {
        let mode = match &step {
            OpStep::Job(job) => Some(job.lock_mode()),
            _ => None,
        };
        hook(
            if matches!(step, OpStep::SyncSrcu) {
                PlanPoint::BeforeSrcuSync
            } else {
                PlanPoint::Before(mode)
            },
            meter,
        );
        match step {
            OpStep::Call(f) => f(kvm, meter),
            OpStep::Expand(f) => {
                for s in f(kvm, meter).into_iter().rev() {
                    steps.push_front(s);
                }
            }
            OpStep::SyncSrcu => kvm.synchronize_srcu(),
            OpStep::Job(mut job) => {
                if let Some(range) = run_job(kvm, &mut *job, meter) {
                    owe_flush(&mut pending, range);
                }
            }
            OpStep::FlushMemslotIfPending(slot) => {
                if pending.take().is_some() {
                    kvm.flush_remote_tlbs_memslot(&slot, meter);
                }
            }
            OpStep::FlushIfPending => {
                if pending.take().is_some() {
                    kvm.flush_remote_tlbs(meter);
                }
            }
            OpStep::FlushMemslot(slot) => {
                pending = None;
                kvm.flush_remote_tlbs_memslot(&slot, meter);
            }
        }
        hook(PlanPoint::After(mode), meter);
    }
}
