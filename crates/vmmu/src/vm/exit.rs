//! The vCPU's exit loop: one guest access by a vCPU in guest mode, with every exit handled the
//! way `KVM_RUN` handles it (a kick: service the request and re-enter; an EPT violation: the
//! lock-free front half of the fault, then its slow half under `mmu_lock`). The loop is
//! [`exit_loop`] and [`after_slow_fault`], split where the lock is taken, so an engine can take
//! it when its clock says; [`guest_access`] takes the real lock on the calling thread, and
//! [`guest_access_with`] leaves the slow half to a callback. Every engine runs this one loop.

use crate::kvm::host_fault::HostNext;
use crate::kvm::mmu::{FaultStart, GuestFault, GuestOp, Mmu, RetPf};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::Kvm;
use crate::units::Gfn;
use crate::vm::vcpu::{AccessExit, Vcpu};
use crate::vm::VmError;

/// The slow half of a fault on this thread: take `mmu_lock` in the mode the MMU declared and
/// run the fault under it ([`locked_half`]).
pub fn complete_fault(kvm: &Kvm, mmu: &dyn Mmu, vcpu: &mut Vcpu, mode: LockMode) -> RetPf {
    let held = kvm.mmu_lock.lock(mode);
    locked_half(kvm, mmu, vcpu, &held)
}

/// What a vCPU does under the `mmu_lock` an [`AccessStep::NeedLock`] asked for: the next
/// MMU-notifier callback of the host fault it is in ([`Vcpu::host_fault`]; returns
/// [`RetPf::Continue`], and [`after_slow_fault`] goes on with the host fault), or else the slow
/// half of its fault ([`Mmu::page_fault`]). Every engine calls this under the lock it grants.
pub fn locked_half(kvm: &Kvm, mmu: &dyn Mmu, vcpu: &mut Vcpu, held: &MmuLockHeld) -> RetPf {
    if let Some((_, host)) = vcpu.host_fault.as_mut() {
        host.run_locked(kvm, mmu, held, &mut vcpu.meter);
        return RetPf::Continue;
    }
    mmu.page_fault(kvm, &mut *vcpu.mmu, held, &mut vcpu.meter)
}

/// Goes on with the host fault of `vcpu` ([`AccessStep::HostWork`]) once the engine let its
/// last step's time pass: more work, the next notifier callback (under the write lock), or,
/// when the host is done, the fault again from its front half (with the snapshot taken before
/// the host ran).
pub fn host_fault_resume(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    a: &GuestAccess,
) -> Result<AccessStep, VmError> {
    let (exit, host) = vcpu
        .host_fault
        .as_mut()
        .expect("AccessStep::HostWork without a host fault");
    match host.resume(kvm, &mut vcpu.meter) {
        HostNext::Elapse => Ok(AccessStep::HostWork),
        HostNext::NeedWriteLock => Ok(AccessStep::NeedLock(LockMode::Write)),
        HostNext::Done => {
            let exit = *exit;
            vcpu.host_fault = None;
            let start = vcpu.begin_fault(kvm, mmu, &exit)?;
            match fault_started(kvm, vcpu, a, start)? {
                Some(step) => Ok(step),
                None => {
                    vcpu.enter_guest(kvm);
                    Ok(AccessStep::Retry)
                }
            }
        }
    }
}

/// Where a fault's front half left the access: `None` when it was handled without the lock
/// and the vCPU re-enters the guest to try again.
fn fault_started(
    kvm: &Kvm,
    vcpu: &mut Vcpu,
    a: &GuestAccess,
    start: FaultStart,
) -> Result<Option<AccessStep>, VmError> {
    Ok(Some(match start {
        FaultStart::Slow(mode) => AccessStep::NeedLock(mode),
        FaultStart::Host(_) => AccessStep::HostWork,
        FaultStart::Done(RetPf::InjectNested) => {
            // A nested VM-exit: L1's translations from here (the untagged TLB is flushed, as
            // at every nested transition).
            vcpu.tlb.flush_all();
            vcpu.meter.tlb_flushes += 1;
            after_slow_fault(kvm, vcpu, a, RetPf::InjectNested)?
        }
        // No host memory: the exit ends, so reclaim can run before the retry.
        FaultStart::Done(RetPf::NoMemory) => after_slow_fault(kvm, vcpu, a, RetPf::NoMemory)?,
        FaultStart::Done(_) => return Ok(None),
    }))
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
) -> Result<u64, VmError> {
    let access = GuestAccess {
        word,
        ..GuestAccess::first_word(gfn, write, value)
    };
    guest_access_with(kvm, mmu, vcpu, access, &mut |vcpu, mode| {
        complete_fault(kvm, mmu, vcpu, mode)
    })
}

/// How a guest operation ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum OpOutcome {
    /// It completed, with the value read or written (0 for an intercepted instruction).
    Done(u64),
    /// A nested guest's access faulted in L1's tables: KVM reflected the fault to L1, which
    /// runs now; the access is L1's to fix and the nested guest's to try again.
    Reflected,
}

/// [`guest_access`] for any [`GuestOp`], with the slow half of each fault taken on this thread.
pub fn guest_op(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    access: &GuestAccess,
) -> Result<OpOutcome, VmError> {
    guest_op_with(kvm, mmu, vcpu, access, &mut |vcpu, mode| {
        complete_fault(kvm, mmu, vcpu, mode)
    })
}

/// [`guest_op`] with the slow half of each fault left to `complete`.
pub fn guest_op_with(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    access: &GuestAccess,
    complete: &mut dyn FnMut(&mut Vcpu, LockMode) -> RetPf,
) -> Result<OpOutcome, VmError> {
    let mut step = AccessStep::Retry;
    loop {
        step = match step {
            AccessStep::Done(v) => return Ok(OpOutcome::Done(v)),
            AccessStep::Reflected => return Ok(OpOutcome::Reflected),
            AccessStep::Retry => {
                let r = vcpu.try_op(kvm, mmu, access);
                exit_loop(kvm, mmu, vcpu, access, r)?
            }
            AccessStep::Stalled => {
                // Leave the CPU to reclaim before faulting again.
                std::thread::yield_now();
                vcpu.enter_guest(kvm);
                AccessStep::Retry
            }
            AccessStep::NeedLock(mode) => {
                let ret = complete(vcpu, mode);
                after_slow_fault(kvm, vcpu, access, ret)?
            }
            AccessStep::HostWork => host_fault_resume(kvm, mmu, vcpu, access)?,
        }
    }
}

/// [`guest_access`] with the slow half of each fault left to `complete`, which takes
/// `mmu_lock` however its engine grants it and runs `mmu.page_fault()` under it.
pub fn guest_access_with(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    access: GuestAccess,
    complete: &mut dyn FnMut(&mut Vcpu, LockMode) -> RetPf,
) -> Result<u64, VmError> {
    match guest_op_with(kvm, mmu, vcpu, &access, complete)? {
        OpOutcome::Done(v) => Ok(v),
        OpOutcome::Reflected => Err(VmError::ReflectedToL1 {
            vcpu: vcpu.id,
            gfn: access.gfn,
        }),
    }
}

/// One 8-byte guest access, or an instruction of a nested guest's life that KVM intercepts: what
/// a guest's code asks for, and what the exit loop carries through every exit until it
/// completes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GuestAccess {
    /// The page accessed.
    pub gfn: Gfn,
    /// The 8-byte word of the page (0 for the memstress guests, which touch the first).
    pub word: usize,
    /// A write (of `value`) rather than a read.
    pub write: bool,
    /// What a write stores.
    pub value: u64,
    /// A memory access ([`GuestOp::Access`]) or an intercepted instruction.
    pub op: GuestOp,
    /// Nanoseconds the guest computes, touching no new memory, before this access (a
    /// workload's think time; 0 for the memstress guests, which only access memory). The
    /// engines spend it; the exit loop ignores it.
    pub compute_ns: u32,
}

impl GuestAccess {
    /// A read (`write` false) or write of `value` to the first word of `gfn`.
    pub fn first_word(gfn: Gfn, write: bool, value: u64) -> Self {
        GuestAccess {
            gfn,
            word: 0,
            write,
            value,
            op: GuestOp::Access,
            compute_ns: 0,
        }
    }

    /// The intercepted instruction `op`.
    pub fn instruction(op: GuestOp) -> Self {
        GuestAccess {
            gfn: Gfn(0),
            word: 0,
            write: false,
            value: 0,
            op,
            compute_ns: 0,
        }
    }
}

/// Where the exit loop left an access.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AccessStep {
    /// It completed, with the value read or written; the vCPU is in guest mode.
    Done(u64),
    /// The slow half of a fault needs `mmu_lock` in this mode: the engine takes it (when its
    /// clock says the request is made), runs `mmu.page_fault()` under it, and goes on with
    /// [`after_slow_fault`].
    NeedLock(LockMode),
    /// The fault is handled and the vCPU back in guest mode: the access is tried again
    /// ([`Vcpu::try_op`], then [`exit_loop`]), when the engine's clock says.
    Retry,
    /// A nested guest's access faulted in L1's own tables: KVM reflected it to L1, which now
    /// runs ([`OpOutcome::Reflected`]).
    Reflected,
    /// The host had no free page for the fault ([`RetPf::NoMemory`]); the vCPU waits outside
    /// guest mode and re-enters to try again once other actors (kswapd) have run: the
    /// virtual-time engine at the vCPU's next turn, the threads engine after yielding its CPU.
    Stalled,
    /// The host is faulting the page in for the fault ([`Vcpu::host_fault`]): the work just
    /// counted on the vCPU's meter takes its time, then the engine calls
    /// [`host_fault_resume`] (the virtual-time engine when its clock gets there, in order with
    /// the other actors, so a PTE changes when the work that changes it ends).
    HostWork,
}

/// The exit loop `KVM_RUN` runs around an access, from `r`, the result of a try
/// ([`Vcpu::access`]): a kick is serviced and the access retried; a fault exits, takes its
/// lockless front half (the fast path may fix it) and is retried, until the access completes or
/// a fault needs `mmu_lock`. This is the one exit-handling loop every engine uses, split where
/// the lock is taken so an engine can take it later. An error is a fault KVM could not handle
/// (no memslot, no shadow page left), and leaves the vCPU outside guest mode.
pub fn exit_loop(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    a: &GuestAccess,
    mut r: Result<u64, AccessExit>,
) -> Result<AccessStep, VmError> {
    loop {
        match r {
            Ok(v) => return Ok(AccessStep::Done(v)),
            Err(AccessExit::Kicked) => {
                vcpu.exit_guest(kvm);
                vcpu.enter_guest(kvm);
            }
            Err(AccessExit::Intercept) => {
                vcpu.exit_guest(kvm);
                // Nested transitions switch the MMU context. Simplified: the model's TLB has
                // no EP4TA/VPID tags, so it is flushed where hardware would switch tags.
                if matches!(a.op, GuestOp::EnterNested { .. } | GuestOp::ExitNested) {
                    vcpu.tlb.flush_all();
                    vcpu.meter.tlb_flushes += 1;
                }
                let exit = GuestFault {
                    addr: a.gfn,
                    word: a.word,
                    value: a.value,
                    write: a.write,
                    present: false,
                    level: crate::hw::pgtable::Level(0),
                    access_flag: false,
                    vcpu: vcpu.id,
                    op: a.op,
                    after_host_fault: None,
                };
                return match vcpu.begin_intercept(kvm, mmu, &exit)? {
                    FaultStart::Slow(mode) => Ok(AccessStep::NeedLock(mode)),
                    FaultStart::Done(ret) => after_slow_fault(kvm, vcpu, a, ret),
                    FaultStart::Host(_) => {
                        unreachable!("an intercepted instruction faulted a host page in")
                    }
                };
            }
            // handle_pml_full(): nothing left to do, the exit emptied the log.
            Err(AccessExit::PmlFull) => {
                vcpu.meter.pml_full_exits += 1;
                vcpu.exit_guest(kvm);
                vcpu.enter_guest(kvm);
            }
            Err(AccessExit::Fault {
                gfn,
                write,
                present,
                level,
                access_flag,
            }) => {
                vcpu.exit_guest(kvm);
                // On an error the vCPU stays out of guest mode (KVM_RUN returns to userspace).
                let exit = GuestFault {
                    addr: gfn,
                    word: a.word,
                    value: a.value,
                    write,
                    present,
                    level,
                    access_flag,
                    vcpu: vcpu.id,
                    op: GuestOp::Access,
                    after_host_fault: None,
                };
                let start = vcpu.begin_fault(kvm, mmu, &exit)?;
                if let Some(step) = fault_started(kvm, vcpu, a, start)? {
                    return Ok(step);
                }
                vcpu.enter_guest(kvm);
            }
        }
        r = vcpu.try_op(kvm, mmu, a);
    }
}

/// The rest of the exit once the slow half of the fault returned `ret`: account for it and
/// re-enter guest mode; the access is then done (an emulated write) or to be tried again.
pub fn after_slow_fault(
    kvm: &Kvm,
    vcpu: &mut Vcpu,
    a: &GuestAccess,
    ret: RetPf,
) -> Result<AccessStep, VmError> {
    match ret {
        RetPf::Retry => vcpu.meter.pf_retry += 1,
        // Counted as alloc_stalls by the fault. The vCPU waits inside KVM_RUN, outside
        // guest mode (remote flushes do not kick it); it re-enters when it retries.
        RetPf::NoMemory => return Ok(AccessStep::Stalled),
        RetPf::Fixed => {}
        // Another vCPU's fault on the page got there first: the vCPUs met on it.
        RetPf::Spurious => vcpu.meter.pf_spurious += 1,
        // The write was emulated: the access is done.
        RetPf::Emulated => {
            vcpu.meter.guest_writes += 1;
            vcpu.enter_guest(kvm);
            return Ok(AccessStep::Done(a.value));
        }
        // An intercepted instruction was executed: it is done.
        RetPf::Handled => {
            vcpu.enter_guest(kvm);
            return Ok(AccessStep::Done(0));
        }
        // nested_vmx_vmexit(): L1 runs and handles the EPT violation.
        RetPf::InjectNested => {
            vcpu.enter_guest(kvm);
            return Ok(AccessStep::Reflected);
        }
        RetPf::NoSpace => {
            return Err(VmError::NoShadowPage {
                vcpu: vcpu.id,
                gfn: a.gfn,
            });
        }
        // A notifier callback of the host fault ran under the lock: the host goes on.
        RetPf::Continue if vcpu.host_fault.is_some() => return Ok(AccessStep::HostWork),
        RetPf::Continue => {
            unreachable!("the slow path of a fault always decides")
        }
    }
    vcpu.enter_guest(kvm);
    Ok(AccessStep::Retry)
}
