//! The vCPU's exit loop: one guest access by a vCPU in guest mode, with every exit handled the
//! way `KVM_RUN` handles it (a kick: service the request and re-enter; an EPT violation: the
//! lock-free front half of the fault, then its slow half under `mmu_lock`). The loop is
//! [`exit_loop`] and [`after_slow_fault`], split where the lock is taken, so an engine can take
//! it when its clock says; [`guest_access`] takes the real lock on the calling thread, and
//! [`guest_access_with`] leaves the slow half to a callback. Every engine runs this one loop.

use crate::kvm::mmu::{FaultStart, GuestFault, Mmu, RetPf};
use crate::kvm::mmu_lock::LockMode;
use crate::kvm::Kvm;
use crate::units::Gfn;
use crate::vm::vcpu::{AccessExit, Vcpu};

/// The slow half of a fault on this thread: take `mmu_lock` in the mode the MMU declared and
/// run the fault under it.
pub fn complete_fault(kvm: &Kvm, mmu: &dyn Mmu, vcpu: &mut Vcpu, mode: LockMode) -> RetPf {
    let held = kvm.mmu_lock.lock(mode);
    mmu.page_fault(kvm, &mut *vcpu.mmu, &held, &mut vcpu.meter)
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
        &mut |vcpu, mode| complete_fault(kvm, mmu, vcpu, mode),
    )
}

/// [`guest_access`] with the slow half of each fault left to `complete`, which takes
/// `mmu_lock` however its engine grants it and runs `mmu.page_fault()` under it.
pub fn guest_access_with(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    gfn: Gfn,
    word: usize,
    write: bool,
    value: u64,
    complete: &mut dyn FnMut(&mut Vcpu, LockMode) -> RetPf,
) -> Result<u64, String> {
    let access = InFlight {
        gfn,
        word,
        write,
        value,
    };
    let mut step = AccessStep::Retry;
    loop {
        step = match step {
            AccessStep::Done(v) => return Ok(v),
            AccessStep::Retry => {
                let r = vcpu.access(kvm, mmu, gfn, word, write, value);
                exit_loop(kvm, mmu, vcpu, &access, r)?
            }
            AccessStep::NeedLock(mode) => {
                let ret = complete(vcpu, mode);
                after_slow_fault(kvm, vcpu, &access, ret)?
            }
        }
    }
}

/// A guest access in progress through the exit loop.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct InFlight {
    /// The page.
    pub gfn: Gfn,
    /// The 8-byte word of the page.
    pub word: usize,
    /// A write (of `value`).
    pub write: bool,
    /// What a write stores.
    pub value: u64,
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
    /// ([`Vcpu::access`], then [`exit_loop`]), when the engine's clock says.
    Retry,
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
    a: &InFlight,
    mut r: Result<u64, AccessExit>,
) -> Result<AccessStep, String> {
    loop {
        match r {
            Ok(v) => return Ok(AccessStep::Done(v)),
            Err(AccessExit::Kicked) => {
                vcpu.exit_guest(kvm);
                vcpu.enter_guest(kvm);
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
                };
                if let FaultStart::Slow(mode) = vcpu.begin_fault(kvm, mmu, &exit)? {
                    return Ok(AccessStep::NeedLock(mode));
                }
                vcpu.enter_guest(kvm);
            }
        }
        r = vcpu.access(kvm, mmu, a.gfn, a.word, a.write, a.value);
    }
}

/// The rest of the exit once the slow half of the fault returned `ret`: account for it and
/// re-enter guest mode; the access is then done (an emulated write) or to be tried again.
pub fn after_slow_fault(
    kvm: &Kvm,
    vcpu: &mut Vcpu,
    a: &InFlight,
    ret: RetPf,
) -> Result<AccessStep, String> {
    match ret {
        RetPf::Retry => vcpu.meter.pf_retry += 1,
        RetPf::Fixed | RetPf::Spurious => {}
        // The write was emulated: the access is done.
        RetPf::Emulated => {
            vcpu.meter.guest_writes += 1;
            vcpu.enter_guest(kvm);
            return Ok(AccessStep::Done(a.value));
        }
        RetPf::NoSpace => {
            return Err(format!("vCPU {}: KVM_RUN failed with -ENOSPC: the shadow MMU found no shadow page to free for a fault on {:?}", vcpu.id, a.gfn));
        }
        RetPf::Continue => {
            unreachable!("the slow path of a fault always decides")
        }
    }
    vcpu.enter_guest(kvm);
    Ok(AccessStep::Retry)
}
