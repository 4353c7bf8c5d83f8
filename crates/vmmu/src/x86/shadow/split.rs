//! Eager page splitting (`shadow_mmu_try_split_huge_pages()`): huge leaves are split one level
//! down ahead of dirty logging, from caches the VMM thread tops up with `mmu_lock` dropped, so
//! that faults need not split them one at a time.

use crate::kvm::memslot::Memslot;
use crate::kvm::mmu_lock::{Held, Write};
use crate::units::*;
use crate::x86::shadow::caches::SplitCaches;
use crate::x86::shadow::mmu_page::SptepRef;
use crate::x86::shadow::spte::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::*;

/// What splitting one rmap head ended with.
pub(super) enum SplitStep {
    /// Nothing (more) to split here.
    Done,
    /// `-ENOSPC` ([`Errno::NoSpace`]): at most `KVM_MIN_FREE_MMU_PAGES` pages were free, so
    /// nothing more is split here.
    NoSpace,
    /// `need_topup_split_caches_or_resched()`: someone waits for the lock.
    Yield,
    /// The split caches are low: drop the lock and top them up.
    NeedTopup,
}

/// `shadow_mmu_try_split_huge_pages()` on the rmap of (`gfn`, `level`): splits each huge leaf
/// it holds that is on a valid, sync page, restarting the rmap after each split.
pub(super) fn try_split_rmap(
    mmu: &mut LockedMmu<'_>,
    slot: &Memslot,
    gfn: Gfn,
    level: Level,
    caches: &mut SplitCaches,
    held: Held<'_, Write>,
) -> SplitStep {
    loop {
        // for_each_rmap_spte() with its skips: only huge leaves of valid pages (huge pages
        // are never unsync), restarting from the head after each split.
        let candidate = mmu.st.rmap_head(gfn, level).and_then(|h| {
            h.iter().find(|&s| {
                let spte = SpteCell::load(mmu.st.sptep(s));
                let sp = mmu.st.sp(s.sp);
                is_large_pte(spte) && !sp.unsync && !sp.role.invalid()
            })
        });
        let Some(huge_sptep) = candidate else {
            return SplitStep::Done;
        };
        // shadow_mmu_try_split_huge_page(): unlike a fault, splitting never recycles pages.
        if mmu.st.available_pages() <= KVM_MIN_FREE_MMU_PAGES {
            return SplitStep::NoSpace;
        }
        if held.needbreak(mmu.meter) {
            return SplitStep::Yield;
        }
        if caches.need_topup() {
            return SplitStep::NeedTopup;
        }
        shadow_mmu_split_huge_page(mmu, slot, huge_sptep, caches);
        mmu.meter.split_eager += 1;
    }
}

/// `shadow_mmu_split_huge_page()`: gets a direct page for the huge page's range (an existing
/// one is reused), fills the entries it does not have with the huge page's pieces (same
/// permissions, so no flush), adds them to the rmaps, and links the page in place of the huge
/// leaf. A flush is needed only if a reused page had a table where a piece should go.
fn shadow_mmu_split_huge_page(
    mmu: &mut LockedMmu<'_>,
    slot: &Memslot,
    huge_sptep: SptepRef,
    caches: &mut SplitCaches,
) {
    mmu.st.touch_spte(huge_sptep, mmu.meter);
    let huge_spte = SpteCell::load(mmu.st.sptep(huge_sptep));
    // shadow_mmu_get_sp_for_split(): gfn and access from the huge page's shadowed
    // translation; splitting always builds direct pages, even under an indirect one.
    let SptepRef {
        sp: huge_id,
        index: huge_index,
    } = huge_sptep;
    let gfn = mmu.st.sp(huge_id).get_gfn(huge_index);
    let access = mmu.st.sp(huge_id).get_access(huge_index);
    let role = mmu.st.child_role(huge_id, true, access);
    let (sp, _) = mmu.get_shadow_page(&mut caches.shadow_page, gfn, role, false);
    let child_level = role.level();
    let mut flush = false;
    for index in 0..SPTE_ENT_PER_PAGE {
        if index % 8 == 0 {
            // The page's next line of eight entries.
            mmu.st.touch_spte(SptepRef::new(sp, index), mmu.meter);
        }
        let sptep = mmu.st.sptep(SptepRef::new(sp, index));
        let cur = SpteCell::load(sptep);
        mmu.meter.spte_reads += 1;
        if is_shadow_present_pte(cur) {
            // A reused page already maps this piece (the same translation: the page is
            // direct); a table here may be partly populated and must be flushed.
            flush |= !is_last_spte(cur, child_level);
            continue;
        }
        let spte = make_huge_page_split_spte(huge_spte, child_level, index);
        mmu_spte_set(sptep, spte, mmu.meter);
        let g = mmu.st.sp(sp).get_gfn(index);
        mmu.rmap_add(&mut caches.desc, slot, SptepRef::new(sp, index), g, access);
    }
    mmu.link_shadow_page(&mut caches.desc, huge_sptep, sp, flush);
}
