//! `tdp_iter`: KVM's walk of the TDP MMU's paging structure is the generic cursor over KVM's
//! view of its SPTEs ([`TdpSpte`]): pre-order, re-reading an entry before stepping down through
//! it, with the `next_last_level_gfn` / `yielded_gfn` bookkeeping that lets a walk restart from
//! the root after yielding (see [`crate::hw::pgtable::walk`]).

use crate::hw::page_table::PageTable;
use crate::hw::pgtable::walk::{walk_range, PtIter, Visit, WalkAction, WalkFlags, WalkRange};
use crate::kvm::meter::Meter;
use crate::units::Gfn;
use crate::x86::spte::Level;
use crate::x86::spte::TdpSpte;
use crossbeam_epoch::Guard;

/// `struct tdp_iter`.
pub type TdpIter<'g> = PtIter<'g, TdpSpte>;

/// `for_each_tdp_pte_min_level()` from `root`: visits, in pre-order, every entry at or above
/// `min_level` overlapping `[start, end)`, calling `f`, which says whether to go on.
#[allow(clippy::too_many_arguments)]
pub fn for_each_tdp_pte_min_level<'g>(
    root: &'g PageTable,
    root_level: Level,
    min_level: Level,
    start: Gfn,
    end: Gfn,
    guard: &'g Guard,
    meter: &mut Meter,
    mut f: impl FnMut(&mut TdpIter<'g>, &mut Meter) -> WalkAction,
) {
    let range = WalkRange {
        root_level,
        min_level,
        start,
        end,
        flags: WalkFlags::PRE_ORDER,
    };
    walk_range::<TdpSpte, Meter>(root, range, guard, meter, |it, _: Visit, m| f(it, m));
}
