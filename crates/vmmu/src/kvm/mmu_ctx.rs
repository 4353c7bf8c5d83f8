//! What an MMU operation under `mmu_lock` works with, as one value: the VM, the hold with its
//! mode in the type ([`Held`]), the RCU read-side guard that keeps every table the walk reads
//! alive (under the read lock other walkers unlink tables; under the write lock nobody else
//! does, so there the guard only defers the holder's own frees, as KVM's `rcu_read_lock()` is
//! not taken by the shadow MMU's write-locked fault), and the actor's meter. KVM reaches all four from `kvm` and the thread it runs on;
//! here they travel together, so no walker threads them by hand, and a function that needs the
//! write lock takes an `MmuCtx<Write>` (a compile error with a read hold, as
//! `lockdep_assert_held_write()` is a run-time one in KVM).

use crate::hw::pgtable::walk::CountReads;
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{Held, HeldMode, LockMode};
use crate::kvm::Kvm;
use crossbeam_epoch::Guard;

/// The context of an MMU operation under `mmu_lock` held in mode `M`.
pub struct MmuCtx<'c, M> {
    /// The VM.
    pub kvm: &'c Kvm,
    /// The hold, its mode in the type.
    pub held: Held<'c, M>,
    /// The RCU read side: tables unlinked meanwhile are freed only after it ends.
    pub guard: &'c Guard,
    /// The actor's counters.
    pub meter: &'c mut Meter,
}

impl<'c, M: HeldMode> MmuCtx<'c, M> {
    /// A context of `held` for `kvm`, reading under `guard` and counting on `meter`.
    pub fn new(kvm: &'c Kvm, held: Held<'c, M>, guard: &'c Guard, meter: &'c mut Meter) -> Self {
        MmuCtx {
            kvm,
            held,
            guard,
            meter,
        }
    }

    /// The hold is the read lock: updates must be atomic against other readers (KVM's
    /// `shared`).
    pub fn shared(&self) -> bool {
        M::MODE == LockMode::Read
    }

    /// `rwlock_needbreak()` on the hold, with the holder's work so far.
    pub fn needbreak(&self) -> bool {
        self.held.needbreak(self.meter)
    }
}

impl<M> CountReads for MmuCtx<'_, M> {
    #[inline]
    fn pte_read(&mut self) {
        self.meter.pte_read();
    }
}
