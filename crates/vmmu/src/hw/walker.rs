//! The page walker a vCPU runs on a TLB miss: reads each level atomically, one read per level
//! through the generic walker's descent, faults (an EPT violation) on an entry without the needed
//! permission, and sets Accessed/Dirty on the leaf with an atomic update, as the hardware does.

use crate::hw::ept::{
    ept_allows, hw_update_accessed_dirty, AdUpdate, Ept, X86Level, VMX_EPT_DIRTY_BIT,
    VMX_EPT_WRITABLE_MASK,
};
use crate::hw::page_table::PageTable;
use crate::hw::pgtable::walk::{descend, descend_to_table};
use crate::hw::pgtable::Level;
use crate::hw::pgtable::{PtFormat, PtGeometry};
use crate::units::{Gfn, PageSize, Pfn};
use crossbeam_epoch::Guard;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// What a walk of one gfn of a run ([`walk_leaf_run`]) found and did: what [`walk`] returns
/// for it as [`WalkResult::Translated`] (of a 4K leaf).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RunLeaf {
    /// The gfn walked.
    pub gfn: Gfn,
    /// The frame its leaf maps.
    pub leaf_pfn: Pfn,
    /// The leaf allows writes.
    pub writable: bool,
    /// The leaf's Dirty flag is set (after the update).
    pub dirty: bool,
    /// This walk set it (0 to 1): the event the page-modification log records.
    pub dirtied: bool,
}

/// What a run's visitor ([`leaf_run`]) did with one gfn's leaf.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RunStep {
    /// Walked; the run goes on.
    Next,
    /// Walked; the run ends here.
    Last,
    /// Not walked: the run ends before this gfn (its walk, made on its own, faults or exits).
    Refused,
}

/// The walks of the gfns `first`, `first + 1`, … `first + n - 1` one after another, as a
/// hardware walk makes them one by one while each reaches a leaf of `first`'s last-level table:
/// the descent to that table is read once (stopping where `stop` says, as the single walk
/// does), since the walks one by one would read the same entries while nothing but walks
/// changes the tables, as when vCPUs run private steps (`engine::virtual_time::fast_forward`):
/// a walk changes only a leaf's Accessed and Dirty flags, never a table entry on the way to
/// one, and another vCPU's walks change only its own leaves, which may share the last-level
/// table (each leaf here is read when its turn comes, and updated with the locked update).
/// `each` is given each gfn's leaf entry in turn, from `first`'s up to `n` of them or the
/// table's end, does to it what the walk does, and says how the run goes on. Returns how many
/// gfns were walked: 0 when `first`'s descent does not reach its last-level table. Entries
/// read are not counted: each walk reads one per level from the root.
///
/// # Safety
/// `root` must be a live root table, and `guard` must stay pinned for the whole run (tables
/// are freed through RCU after being unlinked).
pub unsafe fn leaf_run<F: PtFormat>(
    root: &PageTable,
    root_level: Level,
    first: Gfn,
    n: u64,
    guard: &Guard,
    stop: impl FnMut(u64, Level) -> bool,
    mut each: impl FnMut(Gfn, &AtomicU64, u64) -> RunStep,
) -> u64 {
    let mut reads = 0u64;
    // SAFETY: the caller's contract is descend_to_table()'s.
    let (table, index, _, level) =
        unsafe { descend_to_table::<F>(root, root_level, first, guard, &mut reads, stop) };
    if level != F::Geometry::leaf_level() {
        return 0;
    }
    let n = n.min((table.spt.len() - index) as u64);
    for i in 0..n {
        let ptep = &table.spt[index + i as usize];
        match each(Gfn(first.0 + i), ptep, ptep.load(Ordering::Acquire)) {
            RunStep::Next => {}
            RunStep::Last => return i + 1,
            RunStep::Refused => return i,
        }
    }
    n
}

/// [`leaf_run`] of [`walk`]s of the EPT at `root`: each gfn's 4K leaf gets its Accessed/Dirty
/// update, and `each` hears of it and says whether the run goes on. `log_room`: how many
/// Dirty-flag updates the page-modification log has room for (`u64::MAX` when it is off): the
/// run stops before the gfn whose update would find it full (its walk, made on its own, is the
/// PML-full exit).
///
/// # Safety
/// As [`walk`]: `root` must be a live root table, and `guard` must stay pinned for the whole
/// run.
#[allow(clippy::too_many_arguments)]
pub unsafe fn walk_leaf_run(
    root: &PageTable,
    root_level: Level,
    first: Gfn,
    n: u64,
    write: bool,
    mut log_room: u64,
    guard: &Guard,
    each: &mut dyn FnMut(RunLeaf) -> bool,
) -> u64 {
    let stop = |pte, _| !ept_allows(pte, write);
    // SAFETY: the caller's contract is leaf_run()'s.
    unsafe {
        leaf_run::<Ept>(root, root_level, first, n, guard, stop, |gfn, ptep, pte| {
            if !ept_allows(pte, write) {
                return RunStep::Refused;
            }
            match hw_update_accessed_dirty(ptep, pte, write, log_room == 0) {
                AdUpdate::Used { spte, dirtied } => {
                    log_room -= u64::from(dirtied && log_room != u64::MAX);
                    let leaf = RunLeaf {
                        gfn,
                        leaf_pfn: Ept::leaf_pfn(spte),
                        writable: spte & VMX_EPT_WRITABLE_MASK != 0,
                        dirty: spte & VMX_EPT_DIRTY_BIT != 0,
                        dirtied,
                    };
                    if each(leaf) {
                        RunStep::Next
                    } else {
                        RunStep::Last
                    }
                }
                // A full log: this gfn's walk exits. An entry changed under the run: walked
                // again on its own.
                AdUpdate::LogFull | AdUpdate::Denied => RunStep::Refused,
            }
        })
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
    let leaf_level = F::Geometry::leaf_level();
    // What the walk decides at an entry, with `read` entries read so far (this one included).
    let mut decide = |read: u64, visit: Visit, gfn: Gfn, level: Level, spte: u64| {
        if read > *budget {
            // Every entry before this one was read and allowed the walks through it.
            out = RangeWalk::Partial(gfn.max(range.start));
            return false;
        }
        let fine = match visit {
            Visit::Leaf => leaf_ok(spte, crate::units::GfnRange::new(gfn, F::pages(level))),
            _ => table_ok(spte),
        };
        if !fine {
            out = RangeWalk::Blocked(gfn.max(range.start));
        }
        fine
    };
    walk_range::<F, u64>(root, walk, guard, &mut reads, |it, visit, reads| {
        if it.level == leaf_level {
            // The rest of this last-level table in one loop: each entry after this one is
            // read before it is decided on, as the walk reads it.
            let (first, mut read) = (*reads, 0);
            return it.visit_along_table(range.end, reads, |gfn, _, spte| {
                read += 1;
                decide(first + read - 1, Visit::Leaf, gfn, leaf_level, spte)
            });
        }
        if decide(*reads, visit, it.gfn, it.level, it.old_spte) {
            WalkAction::Continue
        } else {
            WalkAction::Stop
        }
    });
    *budget = budget.saturating_sub(reads);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::ept::{VMX_EPT_ACCESS_BIT, VMX_EPT_READABLE_MASK, VMX_EPT_RWX_MASK};
    use crate::hw::page_table::{alloc_page_table, free_unlinked_page_table, PageTableStats};
    use crate::hw::pgtable::walk::{walk_range, Visit, WalkAction, WalkFlags, WalkRange};
    use crate::units::GfnRange;

    /// [`range_walks_complete`] deciding at each entry as the walk visits it, one by one: the
    /// reference its loop along a last-level table must match.
    fn one_by_one(
        root: &PageTable,
        range: GfnRange,
        guard: &Guard,
        budget: &mut u64,
        table_ok: impl Fn(u64) -> bool,
        leaf_ok: impl Fn(u64, GfnRange) -> bool,
    ) -> RangeWalk {
        let mut out = RangeWalk::Complete;
        let mut reads = 0u64;
        let walk = WalkRange {
            root_level: Level(3),
            min_level: Level(1),
            start: range.start,
            end: range.end,
            flags: WalkFlags::PRE_ORDER,
        };
        walk_range::<Ept, u64>(root, walk, guard, &mut reads, |it, visit, reads| {
            if *reads > *budget {
                out = RangeWalk::Partial(it.gfn.max(range.start));
                return WalkAction::Stop;
            }
            let fine = match visit {
                Visit::Leaf => leaf_ok(it.old_spte, GfnRange::new(it.gfn, Ept::pages(it.level))),
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

    #[test]
    fn a_range_check_decides_and_spends_its_budget_as_the_walk_one_entry_at_a_time() {
        // Root (level 3) → a level-2 table → two adjacent last-level tables (gfns 0–511 and
        // 512–1023), whose leaves are accessed except at 700 and absent from 1000 on.
        let stats = PageTableStats::default();
        let tables: Vec<_> = (0..4)
            .map(|_| alloc_page_table(&stats, Ept::INVALID))
            .collect();
        let link = |t: usize, i: usize, child: usize| {
            tables[t].spt[i].store(tables[child].addr() | VMX_EPT_RWX_MASK, Ordering::Relaxed)
        };
        link(0, 0, 1);
        link(1, 0, 2);
        link(1, 1, 3);
        for g in 0..1000u64 {
            let access = if g == 700 { 0 } else { VMX_EPT_ACCESS_BIT };
            let leaf = (0x8000 + g) << 12 | VMX_EPT_READABLE_MASK | access;
            tables[2 + g as usize / 512].spt[g as usize % 512].store(leaf, Ordering::Relaxed);
        }
        let guard = crossbeam_epoch::pin();
        let table_ok = |pte: u64| pte & VMX_EPT_RWX_MASK != 0;
        let accessed = |pte: u64, _: GfnRange| pte & VMX_EPT_ACCESS_BIT != 0;
        let mut seen = std::collections::HashSet::new();
        for (start, end) in [
            (0, 512),
            (5, 600),
            (500, 700),
            (600, 1024),
            (990, 1000),
            (3, 4),
        ] {
            let range = GfnRange {
                start: Gfn(start),
                end: Gfn(end),
            };
            for budget in (0..40).chain([500, 509, 510, 511, 515, 600, 2_000]) {
                let (mut a, mut b) = (budget, budget);
                let along = range_walks_complete::<Ept>(
                    &tables[0],
                    Level(3),
                    range,
                    &guard,
                    &mut a,
                    table_ok,
                    accessed,
                );
                let want = one_by_one(&tables[0], range, &guard, &mut b, table_ok, accessed);
                assert_eq!((along, a), (want, b), "{start}..{end}, budget {budget}");
                seen.insert(std::mem::discriminant(&want));
            }
        }
        assert_eq!(
            seen.len(),
            3,
            "complete, partial and blocked checks all compared"
        );
        for t in tables {
            free_unlinked_page_table(&stats, t);
        }
    }
}
