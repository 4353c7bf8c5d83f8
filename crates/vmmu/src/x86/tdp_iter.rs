//! `tdp_iter`: KVM's walk of the TDP MMU's paging structure is the generic cursor over KVM's
//! view of its SPTEs ([`TdpSpte`]): pre-order, re-reading an entry before stepping down through
//! it, with the `next_last_level_gfn` / `yielded_gfn` bookkeeping that lets a walk restart from
//! the root after yielding (see [`crate::hw::pgtable::walk`]).

use crate::hw::page_table::PageTable;
use crate::hw::pgtable::walk::{
    walk_range, CountReads, PtIter, Visit, WalkAction, WalkFlags, WalkRange,
};
use crate::units::Gfn;
use crate::x86::spte::Level;
use crate::x86::spte::TdpSpte;
use crossbeam_epoch::Guard;
use std::ops::Range;

/// `struct tdp_iter`.
pub type TdpIter<'g> = PtIter<'g, TdpSpte>;

/// `for_each_tdp_pte_min_level()` from `root`: visits, in pre-order, every entry at or above
/// `min_level` overlapping `gfns`, calling `f` with the walk's context `c` (which counts the
/// entries read), and `f` says whether to go on.
pub fn for_each_tdp_pte_min_level<'g, C: CountReads>(
    root: &'g PageTable,
    root_level: Level,
    min_level: Level,
    gfns: Range<Gfn>,
    guard: &'g Guard,
    c: &mut C,
    mut f: impl FnMut(&mut TdpIter<'g>, &mut C) -> WalkAction,
) {
    let range = WalkRange {
        root_level,
        min_level,
        start: gfns.start,
        end: gfns.end,
        flags: WalkFlags::PRE_ORDER,
    };
    walk_range::<TdpSpte, C>(root, range, guard, c, |it, _: Visit, c| f(it, c));
}
