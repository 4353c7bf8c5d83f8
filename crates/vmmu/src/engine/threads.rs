//! The threads engine's drivers: run a job or a plan on the calling OS thread with the real
//! `mmu_lock`, and complete a vCPU's fault.

use crate::kvm::dirty_log::{OpPlan, OpStep};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, KvmPageFault, Mmu, MmuJob, RetPf};
use crate::kvm::mmu_lock::LockMode;
use crate::kvm::vcpu::{VcpuShared, VcpuWaiter};
use crate::kvm::Kvm;
use crate::units::Gfn;
use crate::vm::vcpu::{AccessExit, FaultStart, Vcpu};
use std::time::{Duration, Instant};

/// Runs `job` to completion: take the lock in the job's mode, run, and on a yield release the
/// lock and let the waiters in (`cond_resched_rwlock_*()`), on a top-up release it and
/// allocate. Returns whether a flush is pending.
pub fn run_job(kvm: &Kvm, job: &mut dyn MmuJob, meter: &mut Meter) -> bool {
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
/// whether a flush is pending.
pub type JobRunner<'a> = dyn FnMut(&Kvm, &mut dyn MmuJob, &mut Meter) -> bool + 'a;

/// Where [`run_plan_with`] is in a plan, for an engine that accounts for each step.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PlanPoint {
    /// A step is about to run; `Some(mode)` when it takes `mmu_lock`.
    Before(Option<LockMode>),
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
    let mut pending = false;
    for step in plan.steps {
        let mode = match &step {
            OpStep::Job(job) => Some(job.lock_mode()),
            _ => None,
        };
        hook(PlanPoint::Before(mode), meter);
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
        hook(PlanPoint::After(mode), meter);
    }
}

/// The slow half of a fault on this thread: take `mmu_lock` in the mode the MMU declared and
/// run the fault under it.
pub fn complete_fault(kvm: &Kvm, mmu: &dyn Mmu, vcpu: &mut Vcpu, fault: &KvmPageFault) -> RetPf {
    let held = kvm.mmu_lock.lock(mmu.fault_lock_mode(fault));
    mmu.page_fault(kvm, fault, &held, &mut vcpu.caches, &mut vcpu.meter)
}

/// One guest access by a vCPU already in guest mode, handling every exit on this thread the way
/// `KVM_RUN` would (a kick: service requests and re-enter; an EPT violation: fast path, or the
/// slow path under `mmu_lock`, then re-enter) until the access completes. Returns the value
/// read or written (the 8-byte `word` of the page), with the vCPU still in guest mode; an error
/// is a fault KVM could not handle (no memslot, no shadow page left), and leaves the vCPU
/// outside guest mode.
pub fn guest_access(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    gfn: Gfn,
    word: usize,
    write: bool,
    value: u64,
) -> Result<u64, String> {
    guest_access_with(
        kvm,
        mmu,
        vcpu,
        gfn,
        word,
        write,
        value,
        &mut |vcpu, fault| complete_fault(kvm, mmu, vcpu, fault),
    )
}

/// [`guest_access`] with the slow half of each fault left to `complete`, which takes
/// `mmu_lock` however its engine grants it and runs `mmu.page_fault()` under it. This is the one
/// exit-handling loop both engines use.
pub fn guest_access_with(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    gfn: Gfn,
    word: usize,
    write: bool,
    value: u64,
    complete: &mut dyn FnMut(&mut Vcpu, &KvmPageFault) -> RetPf,
) -> Result<u64, String> {
    loop {
        match vcpu.access(kvm, mmu, gfn, word, write, value) {
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
                // On an error the vCPU stays out of guest mode (KVM_RUN returns to userspace).
                if let FaultStart::Slow(fault) =
                    vcpu.begin_fault(kvm, mmu, gfn, word, write, value, present)?
                {
                    match complete(vcpu, &fault) {
                        RetPf::Retry => vcpu.meter.pf_retry += 1,
                        RetPf::Fixed | RetPf::Spurious => {}
                        // The write was emulated: the access is done.
                        RetPf::Emulated => {
                            vcpu.meter.guest_writes += 1;
                            vcpu.enter_guest(kvm);
                            return Ok(value);
                        }
                        RetPf::NoSpace => {
                            return Err(format!("vCPU {}: KVM_RUN failed with -ENOSPC: the shadow MMU found no shadow page to free for a fault on {gfn:?}", vcpu.id));
                        }
                        RetPf::Continue => {
                            unreachable!("the slow path of a fault always decides")
                        }
                    }
                }
                vcpu.enter_guest(kvm);
            }
        }
    }
}

/// How long a wait on vCPUs may last before it is reported as a stall (like the kernel's RCU
/// stall detector): a vCPU thread that died inside an SRCU read section, or never acknowledges
/// a kick, would otherwise hang the run.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(20);

/// The threads engine's [`VcpuWaiter`]: spins, then yields the CPU, on the shared vCPU state,
/// and panics with a diagnosis after [`STALL_TIMEOUT`].
pub struct SpinWaiter;

fn wait_until(what: impl Fn() -> String, done: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        if spins.is_multiple_of(1024) && start.elapsed() > STALL_TIMEOUT {
            panic!("stall: {} for more than {:?}", what(), STALL_TIMEOUT);
        }
    }
}

impl VcpuWaiter for SpinWaiter {
    fn wait_for_exits(&self, vcpus: &[VcpuShared], kicked: &[usize]) {
        for &i in kicked {
            wait_until(
                || format!("vCPU {i} has not acknowledged a kick"),
                || !vcpus[i].exiting(),
            );
        }
    }

    fn wait_for_tlbi(&self, vcpus: &[VcpuShared], seqs: &[u64]) {
        for (i, &seq) in seqs.iter().enumerate().filter(|(_, &s)| s != 0) {
            wait_until(
                || format!("DSB ISH: vCPU {i} has not applied broadcast TLBI {seq}"),
                || vcpus[i].tlbi_complete(seq),
            );
        }
    }

    fn synchronize_srcu(&self, vcpus: &[VcpuShared]) {
        // Pairs with the fence in srcu_read_lock(): the update (memslot flags, the new memslot
        // set) is visible before the readers' counts are sampled.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let snap: Vec<u64> = vcpus.iter().map(|v| v.srcu_seq()).collect();
        for (i, (v, s)) in vcpus.iter().zip(snap).enumerate() {
            if s % 2 == 1 {
                wait_until(
                    || format!("synchronize_srcu(): vCPU {i} has not left its read section"),
                    || v.srcu_seq() != s,
                );
            }
        }
    }
}
