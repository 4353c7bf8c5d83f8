//! `fast_page_fault()` (mmu.c), shared by the TDP MMU and the shadow MMU's direct mode: fix a
//! write to a leaf that is write-protected only for dirty logging without taking `mmu_lock`.

use crate::hw::page_table::{spte_to_child_pt, PageTable};
use crate::hw::spte::*;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{KvmPageFault, RetPf};
use crate::kvm::Kvm;
use crate::units::{Gfn, Level, PG_LEVEL_4K};
use crossbeam_epoch::Guard;
use std::sync::atomic::AtomicU64;

/// `walk_shadow_page_lockless()` / `kvm_tdp_mmu_fast_pf_get_last_sptep()`: the lowest entry on
/// the path from `root` to `gfn` (the first non-present entry or the leaf), read without
/// `mmu_lock`.
///
/// # Safety
/// `root` must be a live root table and `guard` pinned for as long as the result is used: tables
/// are freed through RCU after they are unlinked.
pub unsafe fn get_last_sptep<'g>(
    root: &'g PageTable,
    root_level: Level,
    gfn: Gfn,
    guard: &'g Guard,
    meter: &mut Meter,
) -> (&'g AtomicU64, u64, Level) {
    let mut table = root;
    let mut level = root_level;
    loop {
        let sptep = &table.spt[gfn.spte_index(level)];
        let spte = SpteCell::load(sptep);
        meter.spte_reads += 1;
        if level == PG_LEVEL_4K || !is_shadow_present_pte(spte) || is_last_spte(spte, level) {
            return (sptep, spte, level);
        }
        // SAFETY: a present non-leaf entry read under `guard` from a table reachable from the
        // live root (caller's contract).
        table = unsafe { spte_to_child_pt(spte, guard) };
        level = level.below();
    }
}

/// `fast_page_fault()` for a direct MMU with A/D bits enabled. `root` gives the root table and
/// its level under the guard it is passed (the shadow MMU's root can change); the table must
/// stay allocated while that guard is pinned. Returns `Continue` when the slow path must handle
/// the fault.
pub fn fast_page_fault(
    kvm: &Kvm,
    fault: &KvmPageFault,
    meter: &mut Meter,
    root: impl Fn(&Guard) -> Option<(*const PageTable, Level)>,
) -> RetPf {
    // page_fault_can_be_fast(): with A/D bits enabled only a write to a present entry can be
    // fixed without the lock.
    if !(fault.write && fault.present) {
        return RetPf::Continue;
    }
    let mut retries = 0;
    loop {
        let guard = crossbeam_epoch::pin();
        let Some((root, root_level)) = root(&guard) else {
            return RetPf::Continue;
        };
        // SAFETY: `root` is live while `guard` is pinned (the closure's contract).
        let root = unsafe { &*root };
        // Walked again on every retry: the entry may have been split or zapped meanwhile.
        // SAFETY: `root` is live under `guard` (the closure's contract) and `guard` outlives
        // every use of the result below.
        let (sptep, spte, level) =
            unsafe { get_last_sptep(root, root_level, fault.gfn, &guard, meter) };
        match fast_page_fault_try(sptep, spte, level, fault.write, fault.dirty_logging) {
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
                kvm.mark_page_dirty_in_slot(
                    &fault.slot,
                    fault.gfn,
                    fault.dirty_logging,
                    Some(fault.vcpu),
                    meter,
                );
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
