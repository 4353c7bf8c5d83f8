//! `tdp_iter`: a pre-order walk of a TDP paging structure (step down, else side, else up),
//! re-reading an entry before stepping down through it, with the `next_last_level_gfn` /
//! `yielded_gfn` bookkeeping that lets a walk restart from the root after yielding.
//!
//! An iterator borrows an RCU guard: every table it holds a reference to stays allocated until
//! the guard is dropped. A job that yields drops its guard and keeps only the cursor
//! (`next_last_level_gfn`), exactly what `tdp_iter_restart()` uses.

use crate::hw::page_table::{spte_to_child_pt, PageTable};
use crate::hw::spte::{is_last_spte, is_shadow_present_pte};
use crate::kvm::meter::Meter;
use crate::units::{Gfn, Level, SPTE_ENT_PER_PAGE};
use crossbeam_epoch::Guard;
use std::sync::atomic::{AtomicU64, Ordering};

/// `struct tdp_iter`.
pub struct TdpIter<'g> {
    guard: &'g Guard,
    /// Tables from the root down to the current level, indexed by level.
    pt_path: [Option<&'g PageTable>; 6],
    root_level: Level,
    min_level: Level,
    /// The gfn the walk is heading for at the lowest level; the restart point.
    pub next_last_level_gfn: Gfn,
    /// `next_last_level_gfn` when the walk last (re)started; yielding again before moving past
    /// it would make no forward progress.
    pub yielded_gfn: Gfn,
    /// First gfn mapped by the current entry.
    pub gfn: Gfn,
    /// Level of the current entry.
    pub level: Level,
    /// The current entry's value as last read.
    pub old_spte: u64,
    /// False once the walk has left the root.
    pub valid: bool,
}

impl<'g> TdpIter<'g> {
    /// `tdp_iter_start()`: begin at `root` heading for `gfn`, visiting levels down to `min_level`.
    pub fn start(
        root: &'g PageTable,
        root_level: Level,
        min_level: Level,
        gfn: Gfn,
        guard: &'g Guard,
        meter: &mut Meter,
    ) -> Self {
        let mut pt_path = [None; 6];
        pt_path[root_level.0 as usize] = Some(root);
        let mut it = TdpIter {
            guard,
            pt_path,
            root_level,
            min_level,
            next_last_level_gfn: gfn,
            yielded_gfn: gfn,
            gfn: gfn.round_for_level(root_level),
            level: root_level,
            old_spte: 0,
            valid: true,
        };
        it.old_spte = it.read(meter);
        it
    }

    /// The current entry (`iter->sptep`).
    #[inline]
    pub fn sptep(&self) -> &'g AtomicU64 {
        let table = self.pt_path[self.level.0 as usize].expect("table on the path");
        &table.spt[self.gfn.spte_index(self.level)]
    }

    #[inline]
    fn read(&self, meter: &mut Meter) -> u64 {
        meter.spte_reads += 1;
        self.sptep().load(Ordering::Acquire)
    }

    fn try_step_down(&mut self, meter: &mut Meter) -> bool {
        if self.level == self.min_level {
            return false;
        }
        // Re-read: the entry may have changed since it was last read (e.g. a huge page was
        // split, or a table removed), and we must follow what is there now.
        self.old_spte = self.read(meter);
        if !is_shadow_present_pte(self.old_spte) || is_last_spte(self.old_spte, self.level) {
            return false;
        }
        // SAFETY: `old_spte` is a present non-leaf entry read under `self.guard` from a table on
        // the path from the root; its child is freed only after a grace period.
        let child = unsafe { spte_to_child_pt(self.old_spte, self.guard) };
        self.level = self.level.below();
        self.pt_path[self.level.0 as usize] = Some(child);
        self.gfn = self.next_last_level_gfn.round_for_level(self.level);
        self.old_spte = self.read(meter);
        true
    }

    fn try_step_side(&mut self, meter: &mut Meter) -> bool {
        if self.gfn.spte_index(self.level) == SPTE_ENT_PER_PAGE - 1 {
            return false;
        }
        self.gfn = Gfn(self.gfn.0 + self.level.pages());
        self.next_last_level_gfn = self.gfn;
        self.old_spte = self.read(meter);
        true
    }

    fn try_step_up(&mut self) -> bool {
        if self.level == self.root_level {
            return false;
        }
        self.level = self.level.above();
        self.gfn = self.gfn.round_for_level(self.level);
        true
    }

    /// `tdp_iter_next()`: the next entry in pre-order.
    pub fn next(&mut self, meter: &mut Meter) {
        if self.try_step_down(meter) {
            return;
        }
        loop {
            if self.try_step_side(meter) {
                return;
            }
            if !self.try_step_up() {
                break;
            }
        }
        self.valid = false;
    }

    /// Visits, in pre-order, every entry at or above `min_level` overlapping `[start, end)`
    /// (`for_each_tdp_pte_min_level`) calling `f`, which returns what to do next.
    pub fn walk_range(
        root: &'g PageTable,
        root_level: Level,
        min_level: Level,
        start: Gfn,
        end: Gfn,
        guard: &'g Guard,
        meter: &mut Meter,
        mut f: impl FnMut(&mut TdpIter<'g>, &mut Meter) -> IterAction,
    ) {
        let mut it = TdpIter::start(root, root_level, min_level, start, guard, meter);
        while it.valid && it.gfn < end {
            match f(&mut it, meter) {
                IterAction::Next => it.next(meter),
                IterAction::Stop => return,
            }
        }
    }
}

/// What a [`TdpIter::walk_range`] visitor wants next.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum IterAction {
    /// Go on to the next entry.
    Next,
    /// End the walk.
    Stop,
}
