//! `fast_page_fault()` (mmu.c), shared by the TDP MMU and the shadow MMU's direct mode: fix a
//! write to a leaf that is write-protected only for dirty logging without taking `mmu_lock`.

use crate::hw::page_table::PageTable;
use crate::hw::pgtable::walk::descend;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::RetPf;
use crate::kvm::Kvm;
use crate::units::Gfn;
use crate::x86::mmu::KvmPageFault;
use crate::x86::spte::*;
use crossbeam_epoch::Guard;
use std::sync::atomic::AtomicU64;

/// How an MMU finds the lowest entry on the path to a gfn without `mmu_lock`: the first
/// non-present entry or the leaf, read under an RCU guard (tables are freed through RCU after
/// they are unlinked, so everything reached stays allocated while the guard is pinned).
///
/// Generic over the entry's cell `S` so that a model checker can run [`fast_page_fault_lockless`]
/// on entries whose atomics it schedules; the MMUs' entries are `AtomicU64`.
pub trait LastSptepWalk<S: SpteCell = AtomicU64> {
    /// `kvm_tdp_mmu_fast_pf_get_last_sptep()` / `walk_shadow_page_lockless()`; `None` when
    /// there is no root to walk.
    fn get_last_sptep<'g>(
        &'g self,
        gfn: Gfn,
        guard: &'g Guard,
        meter: &mut Meter,
    ) -> Option<(&'g S, u64, Level)>;
}

/// `walk_shadow_page_lockless()`: one read per level from `root` down to the first non-present
/// entry or the leaf, through the generic walker's [`descend`].
///
/// # Safety
/// `root` must be a live root table reached under `guard`.
pub unsafe fn walk_shadow_page_lockless<'g>(
    root: &'g PageTable,
    root_level: Level,
    gfn: Gfn,
    guard: &'g Guard,
    meter: &mut Meter,
) -> (&'g AtomicU64, u64, Level) {
    // SAFETY: the caller's contract is descend()'s.
    unsafe { descend::<TdpSpte>(root, root_level, gfn, guard, meter, |_, _| false) }
}

/// `fast_page_fault()` for a direct MMU with A/D bits enabled, over `mmu`'s lockless walk.
/// Returns `Continue` when the slow path must handle the fault.
pub fn fast_page_fault(
    kvm: &Kvm,
    fault: &KvmPageFault,
    meter: &mut Meter,
    mmu: &impl LastSptepWalk,
) -> RetPf {
    let mark_page_dirty = |meter: &mut Meter| fault.mark_page_dirty(kvm, meter);
    fast_page_fault_lockless(
        fault.gfn,
        fault.write,
        fault.present,
        fault.dirty_logging,
        mmu,
        mark_page_dirty,
        meter,
    )
}

/// The body of [`fast_page_fault`]: the fault on `gfn` (a write or not, to a `present` entry,
/// in a slot `logging` dirty pages), `mmu`'s lockless walk to the entry, and
/// `mark_page_dirty`, which `fast_pf_fix_direct_spte()` calls once its cmpxchg restored W
/// (`mark_page_dirty_in_slot()`). Generic over the entry's cell and the dirty mark so that the
/// model checker runs this very code (`tests/model_fast_pf.rs`).
pub fn fast_page_fault_lockless<S: SpteCell>(
    gfn: Gfn,
    write: bool,
    present: bool,
    logging: bool,
    mmu: &impl LastSptepWalk<S>,
    mark_page_dirty: impl FnOnce(&mut Meter),
    meter: &mut Meter,
) -> RetPf {
    // page_fault_can_be_fast(): with A/D bits enabled only a write to a present entry can be
    // fixed without the lock.
    if !(write && present) {
        return RetPf::Continue;
    }
    let mut retries = 0;
    loop {
        let guard = crossbeam_epoch::pin();
        // Walked again on every retry: the entry may have been split or zapped meanwhile.
        let Some((sptep, spte, level)) = mmu.get_last_sptep(gfn, &guard, meter) else {
            return RetPf::Continue;
        };
        match fast_page_fault_try(sptep, spte, level, write, logging) {
            FastPfOutcome::Spurious => {
                meter.pf_spurious += 1;
                return RetPf::Spurious;
            }
            FastPfOutcome::FixedWrite => {
                meter.pf_fast_fixed += 1;
                meter.spte_writes += 1;
                // W went 0 -> 1: the write must be logged (fast_pf_fix_direct_spte()). The
                // order is KVM's: another vCPU may write through the new W before this mark
                // lands, and a harvest in that window reports the page one harvest late.
                mark_page_dirty(meter);
                return RetPf::Fixed;
            }
            FastPfOutcome::NeedSlowPath => return RetPf::Continue,
            FastPfOutcome::Raced => {
                meter.cmpxchg_failed += 1;
                retries += 1;
                if retries > 4 {
                    return RetPf::Continue;
                }
            }
        }
    }
}
