//! The page walker a vCPU runs on a TLB miss: reads each level atomically, one read per level
//! through the generic walker's descent, faults (an EPT violation) on an entry without the needed
//! permission, and sets Accessed/Dirty on the leaf with an atomic update, as the hardware does.

use crate::hw::ept::{
    ept_allows, hw_update_accessed_dirty, AdUpdate, Ept, X86Level, VMX_EPT_DIRTY_BIT,
    VMX_EPT_WRITABLE_MASK,
};
use crate::hw::page_table::PageTable;
use crate::hw::pgtable::walk::descend;
use crate::hw::pgtable::Level;
use crate::hw::pgtable::PtFormat;
use crate::units::{Gfn, PageSize, Pfn};
use crossbeam_epoch::Guard;

/// The outcome of one hardware walk.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WalkResult {
    /// A leaf maps the gfn with enough permission.
    Translated {
        /// The size the leaf maps: what the TLB entry covers.
        size: PageSize,
        /// First frame of the leaf.
        leaf_pfn: Pfn,
        /// The leaf allows writes.
        writable: bool,
        /// A write through the cached entry needs no walk to update the leaf (x86: D is set;
        /// arm64 without hardware dirty-bit management: always, since nothing is updated).
        dirty: bool,
        /// This walk set the leaf's Dirty flag (0 to 1): with PML on, the CPU logs the access's
        /// guest-physical address. Never on arm64 (hardware dirty-bit management is not
        /// modelled).
        dirtied: bool,
    },
    /// The walk would set a leaf's Dirty flag while the vCPU's page-modification log is full:
    /// a PML-full VM exit, before the flag is set; the access is retried after it.
    PmlFull,
    /// The walk faulted (an EPT violation, a stage-2 abort): the entry at `level` is missing
    /// or lacks the permission.
    Violation {
        /// Level where the walk stopped, in the format's numbering (arm64 reports it in the
        /// ESR's fault status code).
        level: Level,
        /// The entry was present: the violation is a permission fault (the exit
        /// qualification's "EPT entry readable/writable/executable" bits are not all clear;
        /// arm64's permission fault status code rather than a translation fault).
        present: bool,
        /// The entry allowed the access but lacked its Access flag: arm64's access-flag fault
        /// status code (never on x86, whose walk sets A).
        access_flag: bool,
    },
}

/// Walks the EPT hierarchy at `root` (a table at `root_level`) for `gfn`. `levels_read` counts
/// entries read, for the cost model. `pml_full`: PML is on and its log has no room, so a walk
/// that would set a Dirty flag stops with [`WalkResult::PmlFull`].
///
/// # Safety
/// `root` must be a live root table, and `guard` must stay pinned for the whole walk so that no
/// table reached through it is freed (tables are freed through RCU after being unlinked).
pub unsafe fn walk(
    root: &PageTable,
    root_level: Level,
    gfn: Gfn,
    write: bool,
    pml_full: bool,
    guard: &Guard,
    levels_read: &mut u64,
) -> WalkResult {
    loop {
        // SAFETY: the caller's contract is descend()'s.
        let (ptep, pte, level) = unsafe {
            descend::<Ept>(root, root_level, gfn, guard, levels_read, |pte, _| {
                !ept_allows(pte, write)
            })
        };
        if !ept_allows(pte, write) {
            return WalkResult::Violation {
                level,
                present: Ept::is_valid(pte),
                access_flag: false,
            };
        }
        match hw_update_accessed_dirty(ptep, pte, write, pml_full) {
            AdUpdate::Used {
                spte: used,
                dirtied,
            } => {
                return WalkResult::Translated {
                    size: level.page_size(),
                    leaf_pfn: Ept::leaf_pfn(used),
                    writable: used & VMX_EPT_WRITABLE_MASK != 0,
                    dirty: used & VMX_EPT_DIRTY_BIT != 0,
                    dirtied,
                }
            }
            AdUpdate::LogFull => return WalkResult::PmlFull,
            // The entry changed under us; hardware re-walks.
            AdUpdate::Denied => continue,
        }
    }
}

/// How far a read-only check of a range's walks got ([`range_walks_complete`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RangeWalk {
    /// A walk of every gfn of the range completes.
    Complete,
    /// An entry on the way to this gfn does not allow its walk (or the range is not wholly
    /// mapped by the tables looked at): the walks of the gfns before it complete. The range's
    /// first gfn where nothing is known.
    Blocked(Gfn),
    /// The budget was spent first: the walks of the gfns before this one complete.
    Partial(Gfn),
}

/// Whether a hardware walk of every gfn of `range` under `root` (a table at `root_level`)
/// would complete, read without changing anything: `table_ok` must hold for each table entry
/// on the way and `leaf_ok` for each entry that is not a table (invalid ones included), with
/// the gfns it maps. Reads at most `*budget` entries, counting them off, and says where it
/// stopped once they are spent. The virtual-time engine asks this before it runs a vCPU's
/// accesses out of turn (`engine::virtual_time::fast_forward`).
pub fn range_walks_complete<F: PtFormat>(
    root: &PageTable,
    root_level: Level,
    range: crate::units::GfnRange,
    guard: &Guard,
    budget: &mut u64,
    table_ok: impl Fn(u64) -> bool,
    leaf_ok: impl Fn(u64, crate::units::GfnRange) -> bool,
) -> RangeWalk {
    use crate::hw::pgtable::walk::{walk_range, Visit, WalkAction, WalkFlags, WalkRange};
    use crate::hw::pgtable::PtGeometry;
    let mut out = RangeWalk::Complete;
    let mut reads = 0u64;
    let walk = WalkRange {
        root_level,
        min_level: F::Geometry::leaf_level(),
        start: range.start,
        end: range.end,
        flags: WalkFlags::PRE_ORDER,
    };
    walk_range::<F, u64>(root, walk, guard, &mut reads, |it, visit, reads| {
        if *reads > *budget {
            // Every entry before this one was read and allowed the walks through it.
            out = RangeWalk::Partial(it.gfn.max(range.start));
            return WalkAction::Stop;
        }
        let fine = match visit {
            Visit::Leaf => leaf_ok(
                it.old_spte,
                crate::units::GfnRange::new(it.gfn, F::pages(it.level)),
            ),
            _ => table_ok(it.old_spte),
        };
        if fine {
            WalkAction::Continue
        } else {
            out = RangeWalk::Blocked(it.gfn.max(range.start));
            WalkAction::Stop
        }
    });
    *budget = budget.saturating_sub(reads);
    out
}
