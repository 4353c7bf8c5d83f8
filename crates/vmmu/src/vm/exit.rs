//! The vCPU's exit loop: one guest access by a vCPU in guest mode, with every exit handled the
//! way `KVM_RUN` handles it (a kick: service the request and re-enter; an EPT violation: the
//! lock-free front half of the fault, then its slow half under `mmu_lock`). [`guest_access`]
//! takes the real lock on the calling thread; [`guest_access_with`] leaves the slow half to its
//! caller, so every engine runs this one loop.

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
/// `mmu_lock` however its engine grants it and runs `mmu.page_fault()` under it. This is the one
/// exit-handling loop every engine uses.
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
    let first = vcpu.access(kvm, mmu, gfn, word, write, value);
    guest_access_after(kvm, mmu, vcpu, first, gfn, word, write, value, complete)
}

/// [`guest_access_with`] after the vCPU's first try of the access (`first`, what
/// [`Vcpu::access`] returned), for an engine that tries it on its own first.
#[allow(clippy::too_many_arguments)]
pub fn guest_access_after(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    vcpu: &mut Vcpu,
    first: Result<u64, AccessExit>,
    gfn: Gfn,
    word: usize,
    write: bool,
    value: u64,
    complete: &mut dyn FnMut(&mut Vcpu, LockMode) -> RetPf,
) -> Result<u64, String> {
    let mut attempt = Some(first);
    loop {
        let r = match attempt.take() {
            Some(r) => r,
            None => vcpu.access(kvm, mmu, gfn, word, write, value),
        };
        match r {
            Ok(v) => return Ok(v),
            Err(AccessExit::Kicked) => {
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
                    word,
                    value,
                    write,
                    present,
                    level,
                    access_flag,
                    vcpu: vcpu.id,
                };
                if let FaultStart::Slow(mode) = vcpu.begin_fault(kvm, mmu, &exit)? {
                    match complete(vcpu, mode) {
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
