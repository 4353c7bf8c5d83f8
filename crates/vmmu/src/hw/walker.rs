//! The page walker a vCPU runs on a TLB miss: reads each level atomically, faults (an EPT
//! violation) on an entry without the needed permission, and sets Accessed/Dirty on the leaf with
//! an atomic update, as the hardware does.

use crate::hw::page_table::{spte_to_child_pt, PageTable};
use crate::hw::spte::{
    hw_present, hw_set_accessed_dirty, is_last_spte, is_writable_pte, spte_to_pfn,
};
use crate::units::{Gfn, Level, Pfn};
use crossbeam_epoch::Guard;

/// The outcome of one hardware walk.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WalkResult {
    /// A leaf maps the gfn with enough permission.
    Translated {
        /// Level of the leaf.
        level: Level,
        /// First frame of the leaf.
        leaf_pfn: Pfn,
        /// The leaf as used (after A/D were set).
        spte: u64,
    },
    /// EPT violation: the entry at `level` is missing or lacks the permission.
    Violation {
        /// Level where the walk stopped.
        level: Level,
        /// The entry found there.
        spte: u64,
    },
}

/// Walks `root` (a table at `root_level`) for `gfn`. `levels_read` counts entries read, for the
/// cost model.
///
/// # Safety
/// `root` must be a live root table, and `guard` must stay pinned for the whole walk so that no
/// table reached through it is freed (tables are freed through RCU after being unlinked).
pub unsafe fn walk(
    root: &PageTable,
    root_level: Level,
    gfn: Gfn,
    write: bool,
    guard: &Guard,
    levels_read: &mut u64,
) -> WalkResult {
    'restart: loop {
        let mut table = root;
        let mut level = root_level;
        loop {
            let sptep = &table.spt[gfn.spte_index(level)];
            let spte = sptep.load(std::sync::atomic::Ordering::Acquire);
            *levels_read += 1;
            if !hw_present(spte) || (write && !is_writable_pte(spte)) {
                return WalkResult::Violation { level, spte };
            }
            if is_last_spte(spte, level) {
                match hw_set_accessed_dirty(sptep, spte, write) {
                    Some(used) => {
                        return WalkResult::Translated {
                            level,
                            leaf_pfn: spte_to_pfn(used),
                            spte: used,
                        }
                    }
                    // The entry changed under us; hardware re-walks.
                    None => continue 'restart,
                }
            }
            // SAFETY: `spte` is a present non-leaf entry read under `guard` from a table reachable
            // from the live root (caller's contract), so its child is not freed before `guard`.
            table = unsafe { spte_to_child_pt(spte, guard) };
            level = level.below();
        }
    }
}
