//! The one page-table walker: a pre-order cursor over any [`PtFormat`] ([`PtIter`], KVM x86's
//! `tdp_iter`), and a range walk with visitors on top of it ([`walk_range`], KVM arm64's
//! `kvm_pgtable_walk()`).
//!
//! The cursor steps down, else sideways, else up, and re-reads an entry before stepping down
//! through it, so a visitor that replaced an entry (split a huge page into a table, collapsed a
//! table into a block) is followed as it is now. It keeps `tdp_iter`'s restart bookkeeping:
//! `next_last_level_gfn` is where a walk restarted from the root would resume, and
//! `yielded_gfn` is where it last (re)started, so a walk that yields before moving past it
//! makes no forward progress ([`PtIter::made_progress`]).
//!
//! A cursor borrows an RCU guard: every table it holds a reference to stays allocated until the
//! guard is dropped, because tables are freed through RCU after they are unlinked. The one
//! exception is a walk with exclusive ownership of the tree (teardown), whose TABLE_POST visitor
//! may free the table the walk just left at once: the cursor keeps no reference to it, and such
//! a visitor must keep no entry reference (`sptep()`) of its own either. A walk that yields drops
//! its guard and keeps only the restart gfn, exactly what `tdp_iter_restart()` uses.

use super::Level;
use super::{PtFormat, PTES_PER_TABLE};
use crate::hw::page_table::{table_at, PageTable};
use crate::units::Gfn;
use crossbeam_epoch::Guard;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

/// Where a walk counts the entries it reads: KVM software counts them on its `Meter` (as
/// `spte_reads`), the hardware walker in a plain counter (`hw_walk_levels`). The cost model
/// prices reads, so the walker counts every one it does and no other.
pub trait CountReads {
    /// Entry `index` of `table` was read.
    fn pte_read(&mut self, table: &PageTable, index: usize);
}

impl CountReads for u64 {
    #[inline]
    fn pte_read(&mut self, _table: &PageTable, _index: usize) {
        *self += 1;
    }
}

/// Deepest path a cursor keeps: levels are small integers in every format (x86 1–5, arm64 0–3).
const MAX_PATH: usize = 6;

/// A pre-order cursor over the entries of one page-table tree (`struct tdp_iter`).
pub struct PtIter<'g, F: PtFormat> {
    guard: &'g Guard,
    /// Tables from the root down to the current level, indexed by level.
    pt_path: [Option<&'g PageTable>; MAX_PATH],
    /// The table of the current level (`pt_path[level]`, kept at hand: every read uses it).
    table: &'g PageTable,
    root_level: Level,
    min_level: Level,
    /// The walk is shared (`KVM_PGTABLE_WALK_SHARED`, KVM x86's read-held `mmu_lock`): visitors
    /// must change entries with cmpxchg, since others may change them concurrently.
    pub shared: bool,
    /// The gfn the walk is heading for at the lowest level; the restart point.
    pub next_last_level_gfn: Gfn,
    /// `next_last_level_gfn` when the walk last (re)started.
    pub yielded_gfn: Gfn,
    /// First gfn mapped by the current entry.
    pub gfn: Gfn,
    /// Level of the current entry.
    pub level: Level,
    /// The current entry's value as last read.
    pub old_spte: u64,
    /// False once the walk has left the root.
    pub valid: bool,
    _format: PhantomData<F>,
}

impl<'g, F: PtFormat> PtIter<'g, F> {
    /// `tdp_iter_start()`: begin at `root` (a table at `root_level`) heading for `gfn`,
    /// visiting levels down to `min_level`. Reads the first entry.
    #[inline]
    pub fn start(
        root: &'g PageTable,
        root_level: Level,
        min_level: Level,
        gfn: Gfn,
        guard: &'g Guard,
        reads: &mut impl CountReads,
    ) -> Self {
        let mut pt_path = [None; MAX_PATH];
        pt_path[root_level.0 as usize] = Some(root);
        let mut it = PtIter {
            guard,
            pt_path,
            table: root,
            root_level,
            min_level,
            shared: false,
            next_last_level_gfn: gfn,
            yielded_gfn: gfn,
            gfn: F::round(gfn, root_level),
            level: root_level,
            old_spte: 0,
            valid: true,
            _format: PhantomData,
        };
        it.old_spte = it.read(reads);
        it
    }

    /// The current entry (`iter->sptep`).
    #[inline]
    pub fn sptep(&self) -> &'g AtomicU64 {
        &self.table.spt[F::index(self.gfn, self.level)]
    }

    /// The guard the walk runs under: tables reached through the cursor live until it drops.
    pub fn guard(&self) -> &'g Guard {
        self.guard
    }

    /// The walk has moved past the gfn it last (re)started at, so yielding now makes forward
    /// progress (the check `tdp_mmu_iter_cond_resched()` makes before yielding).
    pub fn made_progress(&self) -> bool {
        self.next_last_level_gfn != self.yielded_gfn
    }

    #[inline]
    fn read(&self, reads: &mut impl CountReads) -> u64 {
        reads.pte_read(self.table, F::index(self.gfn, self.level));
        self.sptep().load(Ordering::Acquire)
    }

    /// Steps into the child table of the current entry, whose value `old_spte` was just read
    /// and found to be a table, and reads the entry for `next_last_level_gfn` there.
    #[inline]
    fn step_down_into_table(&mut self, reads: &mut impl CountReads) {
        debug_assert!(F::is_table(self.old_spte, self.level));
        // SAFETY: `old_spte` is a table entry read under `self.guard` from a table on the path
        // from the root (checked in debug builds); child tables are freed only after a grace
        // period that `self.guard` holds off.
        let child = unsafe { table_at(F::table_addr(self.old_spte), self.guard) };
        self.level = F::level_below(self.level);
        self.pt_path[self.level.0 as usize] = Some(child);
        self.table = child;
        self.gfn = F::round(self.next_last_level_gfn, self.level);
        self.old_spte = self.read(reads);
    }

    #[inline]
    fn try_step_down(&mut self, reads: &mut impl CountReads) -> bool {
        if self.level == self.min_level {
            return false;
        }
        // Re-read: the entry may have changed since it was last read (a huge page was split, a
        // table removed), and the walk must follow what is there now.
        self.old_spte = self.read(reads);
        if !F::is_table(self.old_spte, self.level) {
            return false;
        }
        self.step_down_into_table(reads);
        true
    }

    #[inline]
    fn try_step_side(&mut self, reads: &mut impl CountReads) -> bool {
        if F::index(self.gfn, self.level) == PTES_PER_TABLE - 1 {
            return false;
        }
        self.gfn += F::pages(self.level);
        self.next_last_level_gfn = self.gfn;
        self.old_spte = self.read(reads);
        true
    }

    fn try_step_up(&mut self) -> bool {
        if self.level == self.root_level {
            return false;
        }
        // The table just left may be freed by a TABLE_POST visitor of its parent entry: keep
        // no reference to it.
        self.pt_path[self.level.0 as usize] = None;
        self.level = F::level_above(self.level);
        self.table = self.pt_path[self.level.0 as usize].expect("table on the path");
        self.gfn = F::round(self.gfn, self.level);
        true
    }

    /// `tdp_iter_next()`: the next entry in pre-order.
    #[inline]
    pub fn next(&mut self, reads: &mut impl CountReads) {
        // Most steps are along the lowest level, where there is nothing to step down to: the
        // sideways step, inline (what `next_in_preorder` does first there too).
        if self.level == self.min_level && self.try_step_side(reads) {
            return;
        }
        self.next_in_preorder(reads);
    }

    /// What [`walk_range`] does along one table at the lowest level, in one loop: `visit(gfn,
    /// entry, value)` sees the current entry (at `min_level`), then each entry after it in its
    /// table, read and counted as [`PtIter::next`] reads it, for as long as `visit` returns true
    /// and the entry's gfn is below `end`, the end of the walk's range. Returns `Stop` where the
    /// walk ends: `visit` said so, or the entry just read lies at or past `end` (read, not
    /// visited, as the walk leaves it). Returns `Continue` at the table's last entry, visited:
    /// the walk's `next` climbs from there. It serves a visitor of many entries of one table
    /// (`clear_dirty_pt_masked()`), which the walk would dispatch one by one.
    #[inline]
    pub fn visit_along_table(
        &mut self,
        end: Gfn,
        reads: &mut impl CountReads,
        mut visit: impl FnMut(Gfn, &'g AtomicU64, u64) -> bool,
    ) -> WalkAction {
        debug_assert_eq!(self.level, self.min_level);
        let table = self.table;
        let step = F::pages(self.level);
        let mut index = F::index(self.gfn, self.level);
        loop {
            if !visit(self.gfn, &table.spt[index], self.old_spte) {
                return WalkAction::Stop;
            }
            // try_step_side(), with the table, the index and the step at hand: calling it
            // (which works the index out from the gfn for the test and again for the read)
            // cost the 8-vCPU dirty-log run 1.7 % more instructions.
            if index == PTES_PER_TABLE - 1 {
                return WalkAction::Continue;
            }
            index += 1;
            self.gfn += step;
            self.next_last_level_gfn = self.gfn;
            reads.pte_read(table, index);
            self.old_spte = table.spt[index].load(Ordering::Acquire);
            if self.gfn >= end {
                return WalkAction::Stop;
            }
        }
    }

    /// [`PtIter::next`] from any entry: down, else sideways, else up and sideways.
    fn next_in_preorder(&mut self, reads: &mut impl CountReads) {
        if self.try_step_down(reads) {
            return;
        }
        loop {
            if self.try_step_side(reads) {
                return;
            }
            if !self.try_step_up() {
                break;
            }
        }
        self.valid = false;
    }
}

/// A single-address descent from `root` (a table at `root_level`) towards `gfn`, one read per
/// level, stopping at the first entry that is not a table or for which `stop(entry, level)`
/// says so; returns that entry, its value and its level. It is the walk the CPU does on a TLB
/// miss and KVM's lockless lookups do (`walk_shadow_page_lockless()`,
/// `kvm_pgtable_get_leaf()`): no cursor to keep, since it never moves sideways or up.
///
/// # Safety
/// `root` must be a live root table, and `guard` must stay pinned while the returned entry is
/// used (tables are freed through RCU after being unlinked).
#[inline]
pub unsafe fn descend<'g, F: PtFormat>(
    root: &'g PageTable,
    root_level: Level,
    gfn: Gfn,
    guard: &'g Guard,
    reads: &mut impl CountReads,
    stop: impl FnMut(u64, Level) -> bool,
) -> (&'g AtomicU64, u64, Level) {
    // SAFETY: the caller's contract is descend_to_table()'s.
    let (table, index, pte, level) =
        unsafe { descend_to_table::<F>(root, root_level, gfn, guard, reads, stop) };
    (&table.spt[index], pte, level)
}

/// [`descend`], returning the table the descent stopped in and the entry's index in it (for a
/// caller that goes on to the entries beside it: `walker::walk_leaf_run`).
///
/// # Safety
/// As [`descend`]: `root` must be a live root table, and `guard` must stay pinned while the
/// returned table is used.
#[inline]
pub unsafe fn descend_to_table<'g, F: PtFormat>(
    root: &'g PageTable,
    root_level: Level,
    gfn: Gfn,
    guard: &'g Guard,
    reads: &mut impl CountReads,
    mut stop: impl FnMut(u64, Level) -> bool,
) -> (&'g PageTable, usize, u64, Level) {
    let mut table = root;
    let mut level = root_level;
    loop {
        let index = F::index(gfn, level);
        let ptep = &table.spt[index];
        reads.pte_read(table, index);
        let pte = ptep.load(Ordering::Acquire);
        if stop(pte, level) || !F::is_table(pte, level) {
            return (table, index, pte, level);
        }
        // SAFETY: a table entry read under `guard` from a table reachable from the live root
        // (the caller's contract); its table is freed only after a grace period `guard` holds
        // off.
        table = unsafe { table_at(F::table_addr(pte), guard) };
        level = F::level_below(level);
    }
}

/// Which entries a [`walk_range`] visitor sees (`enum kvm_pgtable_walk_flags`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct WalkFlags(u8);

impl WalkFlags {
    /// `KVM_PGTABLE_WALK_LEAF`: entries that are not tables, invalid ones included.
    pub const LEAF: WalkFlags = WalkFlags(1);
    /// `KVM_PGTABLE_WALK_TABLE_PRE`: table entries, before their children.
    pub const TABLE_PRE: WalkFlags = WalkFlags(2);
    /// `KVM_PGTABLE_WALK_TABLE_POST`: table entries, after their children.
    pub const TABLE_POST: WalkFlags = WalkFlags(4);
    /// `KVM_PGTABLE_WALK_SHARED`: others walk and change the tree concurrently (visitors use
    /// cmpxchg, tables are freed through RCU).
    pub const SHARED: WalkFlags = WalkFlags(8);
    /// Every entry in pre-order, as `for_each_tdp_pte_min_level()` visits them.
    pub const PRE_ORDER: WalkFlags = WalkFlags(1 | 2);

    /// Both sets of flags.
    pub const fn union(self, other: WalkFlags) -> WalkFlags {
        WalkFlags(self.0 | other.0)
    }

    /// Every flag of `other` is set.
    pub const fn contains(self, other: WalkFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

/// Why a visitor is called (`KVM_PGTABLE_WALK_LEAF` / `_TABLE_PRE` / `_TABLE_POST`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Visit {
    /// An entry that is not a table when visited: a leaf or an invalid entry.
    Leaf,
    /// A table entry, before the walk steps into it.
    TablePre,
    /// A table entry, after the walk left its table; the cursor holds the entry re-read.
    TablePost,
}

/// What a [`walk_range`] visitor wants next.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum WalkAction {
    /// Go on to the next entry.
    Continue,
    /// End the walk (a visitor's error in `kvm_pgtable_walk()`; a found entry in KVM x86).
    Stop,
}

/// The range and the entries a [`walk_range`] covers.
#[derive(Copy, Clone, Debug)]
pub struct WalkRange {
    /// Level of the root table.
    pub root_level: Level,
    /// The walk does not step below this level.
    pub min_level: Level,
    /// First gfn.
    pub start: Gfn,
    /// One past the last gfn.
    pub end: Gfn,
    /// Which entries the visitor sees, and whether the walk is shared.
    pub flags: WalkFlags,
}

/// Visits, in pre-order, the entries at or above `range.min_level` that overlap
/// `[range.start, range.end)` (`kvm_pgtable_walk()`, `for_each_tdp_pte_min_level()`), calling
/// `visit` for those `range.flags` selects. The visitor gets the cursor, so it can change the
/// current entry (and must store what it wrote in `old_spte`); a table it installs is walked
/// into, a table it replaced is not. With TABLE_POST, each table entry the walk stepped into is
/// visited again, re-read, after its table, also when the walk ends at `range.end` inside it.
///
/// Inline: the lockless fast-path walk runs on every write fault, and whether the compiler
/// inlines a generic walk into it otherwise depends on how the crate falls into codegen units.
#[inline]
pub fn walk_range<'g, F: PtFormat, M: CountReads>(
    root: &'g PageTable,
    range: WalkRange,
    guard: &'g Guard,
    m: &mut M,
    mut visit: impl FnMut(&mut PtIter<'g, F>, Visit, &mut M) -> WalkAction,
) {
    let flags = range.flags;
    let mut it = PtIter::<F>::start(
        root,
        range.root_level,
        range.min_level,
        range.start,
        guard,
        m,
    );
    it.shared = flags.contains(WalkFlags::SHARED);
    let post = flags.contains(WalkFlags::TABLE_POST);
    while it.valid && it.gfn < range.end {
        let (kind, wanted) = if F::is_table(it.old_spte, it.level) {
            (Visit::TablePre, WalkFlags::TABLE_PRE)
        } else {
            (Visit::Leaf, WalkFlags::LEAF)
        };
        if flags.contains(wanted) && visit(&mut it, kind, m) == WalkAction::Stop {
            return;
        }
        if !post {
            it.next(m);
            continue;
        }
        // tdp_iter_next() with a post-order visit of each table entry the walk leaves.
        if it.try_step_down(m) {
            continue;
        }
        loop {
            if it.try_step_side(m) {
                break;
            }
            if !it.try_step_up() {
                return;
            }
            it.old_spte = it.read(m);
            if visit(&mut it, Visit::TablePost, m) == WalkAction::Stop {
                return;
            }
        }
    }
    // Ended at `range.end` inside tables the walk stepped into: they end here too.
    while post && it.valid && it.try_step_up() {
        it.old_spte = it.read(m);
        if visit(&mut it, Visit::TablePost, m) == WalkAction::Stop {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::ept::{Ept, PT_PAGE_SIZE_MASK, VMX_EPT_READABLE_MASK, VMX_EPT_RWX_MASK};
    use crate::hw::ept::{PG_LEVEL_2M, PG_LEVEL_4K};
    use crate::hw::page_table::{alloc_page_table, PageTableStats};

    const L3: Level = Level(3);

    /// A three-level EPT tree: root (level 3) entry 0 → a level-2 table whose entry 0 is a
    /// 2M leaf and entry 1 → a level-1 table with 4K leaves at indices 0 and 2.
    struct Tree {
        stats: PageTableStats,
        tables: Vec<Box<PageTable>>,
    }

    impl Tree {
        fn new() -> Tree {
            let stats = PageTableStats::default();
            let tables: Vec<_> = (0..3)
                .map(|_| alloc_page_table(&stats, Ept::INVALID))
                .collect();
            let t = Tree { stats, tables };
            t.set(0, 0, t.table_entry(1));
            t.set(
                1,
                0,
                (0x200 << 12) | VMX_EPT_READABLE_MASK | PT_PAGE_SIZE_MASK,
            );
            t.set(1, 1, t.table_entry(2));
            t.set(2, 0, (0x400 << 12) | VMX_EPT_READABLE_MASK);
            t.set(2, 2, (0x402 << 12) | VMX_EPT_READABLE_MASK);
            t
        }
        fn table_entry(&self, i: usize) -> u64 {
            self.tables[i].addr() | VMX_EPT_RWX_MASK
        }
        fn set(&self, table: usize, index: usize, v: u64) {
            self.tables[table].spt[index].store(v, Ordering::Relaxed);
        }
        fn walk(&self, start: u64, end: u64, flags: WalkFlags) -> (Vec<(Visit, u8, u64)>, u64) {
            let guard = crossbeam_epoch::pin();
            let mut seen = Vec::new();
            let mut reads = 0u64;
            let range = WalkRange {
                root_level: L3,
                min_level: PG_LEVEL_4K,
                start: Gfn(start),
                end: Gfn(end),
                flags,
            };
            walk_range::<Ept, u64>(&self.tables[0], range, &guard, &mut reads, |it, v, _| {
                seen.push((v, it.level.0, it.gfn.0));
                WalkAction::Continue
            });
            (seen, reads)
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            for t in self.tables.drain(..) {
                crate::hw::page_table::free_unlinked_page_table(&self.stats, t);
            }
        }
    }

    #[test]
    fn pre_order_visits_tables_before_their_children_and_leaves_including_invalid_ones() {
        let t = Tree::new();
        let (seen, _) = t.walk(0, 0x203, WalkFlags::PRE_ORDER);
        let want = [
            (Visit::TablePre, 3, 0),
            (Visit::Leaf, 2, 0),
            (Visit::TablePre, 2, 0x200),
            (Visit::Leaf, 1, 0x200),
            (Visit::Leaf, 1, 0x201),
            (Visit::Leaf, 1, 0x202),
        ];
        assert_eq!(seen, want);
        let (leaves, _) = t.walk(0, 0x203, WalkFlags::LEAF);
        assert_eq!(leaves.len(), 4, "only the leaf and invalid entries");
        assert!(leaves.iter().all(|v| v.0 == Visit::Leaf));
    }

    #[test]
    fn table_post_follows_the_children_also_when_the_range_ends_inside() {
        let t = Tree::new();
        let flags = WalkFlags::LEAF.union(WalkFlags::TABLE_POST);
        // Ends inside the level-1 table: both tables on the path get their post visit.
        let (seen, _) = t.walk(0x200, 0x202, flags);
        assert_eq!(
            seen,
            [
                (Visit::Leaf, 1, 0x200),
                (Visit::Leaf, 1, 0x201),
                (Visit::TablePost, 2, 0x200),
                (Visit::TablePost, 3, 0),
            ]
        );
        // The whole tree: the level-1 table's post visit comes before its siblings'.
        let (seen, _) = t.walk(0, 1 << 27, WalkFlags::TABLE_POST);
        assert_eq!(
            seen,
            [(Visit::TablePost, 2, 0x200), (Visit::TablePost, 3, 0)]
        );
    }

    #[test]
    fn the_walk_follows_what_a_visitor_installed_and_not_what_it_replaced() {
        let t = Tree::new();
        let guard = crossbeam_epoch::pin();
        let mut reads = 0u64;
        let mut seen = Vec::new();
        let range = WalkRange {
            root_level: L3,
            min_level: PG_LEVEL_4K,
            start: Gfn(0),
            end: Gfn(0x400),
            flags: WalkFlags::PRE_ORDER,
        };
        let table2 = t.table_entry(2);
        walk_range::<Ept, u64>(&t.tables[0], range, &guard, &mut reads, |it, v, _| {
            seen.push((v, it.level.0, it.gfn.0));
            match (it.level, it.gfn.0) {
                // Split the 2M leaf: point it at the level-1 table.
                (PG_LEVEL_2M, 0) if v == Visit::Leaf => {
                    it.sptep().store(table2, Ordering::Relaxed);
                    it.old_spte = table2;
                }
                // Collapse the second table into a 2M leaf.
                (PG_LEVEL_2M, 0x200) => {
                    let leaf = (0x200 << 12) | VMX_EPT_READABLE_MASK | PT_PAGE_SIZE_MASK;
                    it.sptep().store(leaf, Ordering::Relaxed);
                    it.old_spte = leaf;
                }
                _ => {}
            }
            WalkAction::Continue
        });
        assert_eq!(
            seen[..3],
            [
                (Visit::TablePre, 3, 0),
                (Visit::Leaf, 2, 0),
                (Visit::Leaf, 1, 0),
            ]
        );
        assert_eq!(
            seen.iter().filter(|s| s.1 == 1).count(),
            512,
            "the installed table is walked whole"
        );
        assert_eq!(
            *seen.last().unwrap(),
            (Visit::TablePre, 2, 0x200),
            "the collapsed table is not walked into"
        );
        t.set(0, 0, t.table_entry(1));
    }

    #[test]
    fn a_restarted_cursor_resumes_at_its_restart_gfn_and_knows_its_progress() {
        let t = Tree::new();
        let guard = crossbeam_epoch::pin();
        let mut reads = 0u64;
        let mut it = PtIter::<Ept>::start(
            &t.tables[0],
            L3,
            PG_LEVEL_4K,
            Gfn(0x201),
            &guard,
            &mut reads,
        );
        assert!(!it.made_progress());
        while it.level != PG_LEVEL_4K {
            it.next(&mut reads);
        }
        assert_eq!((it.gfn, it.level), (Gfn(0x201), PG_LEVEL_4K));
        assert!(!it.made_progress(), "still at the start gfn");
        it.next(&mut reads);
        assert_eq!(it.gfn, Gfn(0x202));
        assert!(it.made_progress());
        // Yield: keep only the restart point, start again from the root.
        let cursor = it.next_last_level_gfn;
        let mut again =
            PtIter::<Ept>::start(&t.tables[0], L3, PG_LEVEL_4K, cursor, &guard, &mut reads);
        while again.level != PG_LEVEL_4K {
            again.next(&mut reads);
        }
        assert_eq!(again.gfn, Gfn(0x202));
        assert_eq!(Ept::leaf_pfn(again.old_spte).0, 0x402);
    }

    #[test]
    fn the_hardware_step_reads_one_entry_per_level_and_the_software_step_rereads() {
        let t = Tree::new();
        let guard = crossbeam_epoch::pin();
        let mut hw = 0u64;
        let mut it =
            PtIter::<Ept>::start(&t.tables[0], L3, PG_LEVEL_4K, Gfn(0x202), &guard, &mut hw);
        it.step_down_into_table(&mut hw);
        it.step_down_into_table(&mut hw);
        assert_eq!((hw, Ept::leaf_pfn(it.old_spte).0), (3, 0x402));
        let mut sw = 0u64;
        let mut it =
            PtIter::<Ept>::start(&t.tables[0], L3, PG_LEVEL_4K, Gfn(0x202), &guard, &mut sw);
        it.next(&mut sw);
        it.next(&mut sw);
        assert_eq!(
            (sw, it.level),
            (5, PG_LEVEL_4K),
            "tdp_iter re-reads each entry before stepping through it"
        );
    }

    /// Every entry read, in order (a walk's `CountReads`).
    #[derive(Default)]
    struct ReadLog(Vec<(u64, usize)>);

    impl CountReads for ReadLog {
        fn pte_read(&mut self, table: &PageTable, index: usize) {
            self.0.push((table.addr(), index));
        }
    }

    #[test]
    fn a_visit_along_a_table_reads_and_visits_as_the_walk_does_one_entry_at_a_time() {
        // Two adjacent level-1 tables (gfns 0x200–0x3ff and 0x400–0x5ff), so that runs meet a
        // table's last entry and the walk climbs on from there.
        let t = Tree::new();
        let stats = PageTableStats::default();
        let next = alloc_page_table(&stats, Ept::INVALID);
        t.set(1, 2, next.addr() | VMX_EPT_RWX_MASK);
        for i in (0..512).step_by(3) {
            t.set(2, i, ((0x400 + i as u64) << 12) | VMX_EPT_READABLE_MASK);
            next.spt[i].store(
                ((0x600 + i as u64) << 12) | VMX_EPT_READABLE_MASK,
                Ordering::Relaxed,
            );
        }
        let guard = crossbeam_epoch::pin();
        // A visitor that stops at the first entry it sees after `budget` leaves at level 1
        // (as clear_dirty_pt_masked() stops once its mask is empty).
        let walk = |start: u64, end: u64, budget: usize, along: bool| {
            let mut reads = ReadLog::default();
            let mut seen = Vec::new();
            let mut calls = 0;
            let range = WalkRange {
                root_level: L3,
                min_level: PG_LEVEL_4K,
                start: Gfn(start),
                end: Gfn(end),
                flags: WalkFlags::PRE_ORDER,
            };
            walk_range::<Ept, ReadLog>(&t.tables[0], range, &guard, &mut reads, |it, _, r| {
                let mut visit = |gfn: Gfn, value: u64| {
                    if seen.len() == budget {
                        return false;
                    }
                    seen.push((gfn.0, value));
                    true
                };
                if it.level != PG_LEVEL_4K {
                    return WalkAction::Continue;
                }
                if along {
                    calls += 1;
                    it.visit_along_table(Gfn(end), r, |gfn, _, value| visit(gfn, value))
                } else if visit(it.gfn, it.old_spte) {
                    WalkAction::Continue
                } else {
                    WalkAction::Stop
                }
            });
            (seen, reads.0, calls)
        };
        let mut runs = 0;
        for (start, end) in [
            (0x200, 0x240),
            (0x3c0, 0x400),
            (0x3f0, 0x410),
            (0x3fe, 0x600),
            (0x201, 0x202),
            (0x380, 0x5ff),
        ] {
            for budget in [0, 1, 2, 15, 16, 17, 40, 300, usize::MAX] {
                let one_by_one = walk(start, end, budget, false);
                let along = walk(start, end, budget, true);
                assert_eq!(
                    along.0, one_by_one.0,
                    "visits of {start:#x}..{end:#x}, {budget}"
                );
                assert_eq!(
                    along.1, one_by_one.1,
                    "reads of {start:#x}..{end:#x}, {budget}"
                );
                runs += (along.2 < along.0.len()) as usize;
            }
        }
        assert!(
            runs > 20,
            "only {runs} walks visited more than one entry a call"
        );
        crate::hw::page_table::free_unlinked_page_table(&stats, next);
    }
}
