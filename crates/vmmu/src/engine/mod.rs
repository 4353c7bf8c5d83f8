//! Engines: what drives actors (vCPUs, the VMM thread) over a VM. Both call down into the VM's
//! own exit loop ([`crate::vm::exit`]) and plan interpreter ([`crate::vm::plan`]); they differ
//! in who runs when and how `mmu_lock` is granted. The threads engine runs each actor on an OS
//! thread with the real `mmu_lock`; the virtual-time engine runs every actor on one thread in
//! virtual-time order, charging a cost model.
//!
//! What a vCPU's guest does is the scenario's business ([`GuestCode`]); engines only run it.

pub mod virtual_time;

use crate::units::Gfn;

/// One 8-byte guest access (the first word of the page).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GuestAccess {
    /// The page accessed.
    pub gfn: Gfn,
    /// A write (of `value`) rather than a read.
    pub write: bool,
    /// What a write stores.
    pub value: u64,
}

/// A vCPU's guest code as engines run it: passes of accesses, each ending in a `GUEST_SYNC`
/// exit to userspace. One value per vCPU; engines call it from whichever thread runs that vCPU,
/// never from two at once.
pub trait GuestCode {
    /// The host published `iteration` and the vCPU re-entered `KVM_RUN`: start that pass.
    fn start_pass(&mut self, iteration: i64);

    /// The next access of the pass, or `None` at its `GUEST_SYNC`.
    fn next_access(&mut self) -> Option<GuestAccess>;

    /// `access` (the last one [`GuestCode::next_access`] returned) completed: the guest saw it
    /// retire. Not called when `KVM_RUN` failed on it.
    fn access_done(&mut self, access: &GuestAccess);
}
