//! Unsync pages: a last-level indirect page the guest may write without KVM knowing
//! (`kvm_unsync_page()`; whether a write may make it so is `mmu_try_to_unsync_pages()`, in
//! [`spte`] beside `make_spte()` that asks), the `unsync_child_bitmap`s that lead to it from the
//! root (`mark_unsync()`, `mmu_unsync_walk()`), and syncing it again from the guest table when
//! the guest flushes its TLB (`mmu_sync_children()`, `kvm_sync_page()`, and the per-entry
//! `FNAME(sync_spte)` of `paging_tmpl.h`, kept here beside its one caller so that shadow
//! paging's modules import each other without a cycle; `kvm_mmu_sync_roots()` is [`root`]'s).
//!
//! [`spte`]: crate::x86::shadow::spte
//! [`root`]: crate::x86::shadow::root

use crate::x86::guest_paging::{gpte_to_gfn_lvl, GuestMemory, Pt64, PtType};
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::spte::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::*;

/// What `kvm_sync_page()` returns for a page, and `FNAME(sync_spte)` for one of its entries
/// (an `int` in KVM).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SyncPageResult {
    /// `0`: the shadow entries match the guest table; no flush is needed.
    NoFlush,
    /// `1` (`> 0`): shadow entries were dropped or narrowed; a TLB flush is needed.
    Flush,
    /// `-1` (`< 0`): the guest table could not be read; `kvm_sync_page()` zapped the page onto
    /// the invalid list.
    Zap,
}

impl SyncPageResult {
    /// `Flush` if `flush`, else `NoFlush` (KVM's `return flush;` of a bool as an int).
    pub fn from_flush(flush: bool) -> Self {
        if flush {
            SyncPageResult::Flush
        } else {
            SyncPageResult::NoFlush
        }
    }
}

impl ShadowState {
    /// `mark_unsync()`: records, up the tree, that the entry `sptep` leads to unsync pages.
    pub fn mark_unsync(&mut self, sptep: SptepRef) {
        let SptepRef { sp: id, index } = sptep;
        let sp = self.sp_mut(id);
        let (w, b) = (index / 64, 1u64 << (index % 64));
        if sp.unsync_child_bitmap[w] & b != 0 {
            return;
        }
        sp.unsync_child_bitmap[w] |= b;
        sp.unsync_children += 1;
        if sp.unsync_children > 1 {
            return;
        }
        self.mark_parents_unsync(id);
    }

    /// `kvm_mmu_mark_parents_unsync()`.
    pub fn mark_parents_unsync(&mut self, id: SpId) {
        let parents: Vec<SptepRef> = self.sp(id).parent_ptes.iter().collect();
        for p in parents {
            self.mark_unsync(p);
        }
    }

    /// `kvm_unsync_page()`: the guest may now write the table `id` shadows without KVM
    /// knowing; its parents record the way down to it.
    pub fn unsync_page(&mut self, id: SpId) {
        debug_assert_eq!(
            self.sp(id).role.level(),
            PG_LEVEL_4K,
            "only last-level pages go unsync"
        );
        self.sp_mut(id).unsync = true;
        self.mmu_unsync += 1;
        self.mark_parents_unsync(id);
    }

    /// `kvm_unlink_unsync_page()`.
    pub fn unlink_unsync_page(&mut self, id: SpId) {
        let sp = self.sp_mut(id);
        debug_assert!(sp.unsync);
        sp.unsync = false;
        self.mmu_unsync -= 1;
    }

    /// `clear_unsync_child_bit()`: entry `index` of `id` no longer leads to unsync pages.
    pub fn clear_unsync_child_bit(&mut self, id: SpId, index: usize) {
        let sp = self.sp_mut(id);
        let (w, b) = (index / 64, 1u64 << (index % 64));
        if sp.unsync_child_bitmap[w] & b != 0 {
            sp.unsync_child_bitmap[w] &= !b;
            sp.unsync_children -= 1;
        }
    }

    /// The unsync last-level pages reachable from `id` through set unsync-child bits
    /// (`mmu_unsync_walk()`), clearing bits that lead nowhere.
    pub fn unsync_descendants(&mut self, id: SpId) -> Vec<SpId> {
        let mut out = Vec::new();
        let mut stack = vec![id];
        while let Some(p) = stack.pop() {
            if self.sp(p).unsync_children == 0 {
                continue;
            }
            for w in 0..SPTE_ENT_PER_PAGE / 64 {
                let mut bits = self.sp(p).unsync_child_bitmap[w];
                while bits != 0 {
                    let index = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let spte = SpteCell::load(self.sptep(SptepRef::new(p, index)));
                    if !is_shadow_present_pte(spte) || is_last_spte(spte, self.sp(p).role.level()) {
                        self.clear_unsync_child_bit(p, index);
                        continue;
                    }
                    let child = self.spte_to_child_sp(spte);
                    let c = self.sp(child);
                    if c.unsync_children > 0 {
                        stack.push(child);
                    } else if c.unsync {
                        out.push(child);
                    } else {
                        self.clear_unsync_child_bit(p, index);
                    }
                }
            }
        }
        out
    }
}

/// `kvm_sync_page()`: syncs every mapped entry of the unsync page `id`; on failure the page is
/// zapped onto `invalid_list`.
pub fn sync_page(
    mmu: &mut LockedMmu<'_>,
    id: SpId,
    invalid_list: &mut Vec<SpId>,
) -> SyncPageResult {
    let mut flush = false;
    for i in 0..SPTE_ENT_PER_PAGE {
        if SpteCell::load(mmu.st.sptep(SptepRef::new(id, i))) == SHADOW_NONPRESENT_VALUE {
            continue;
        }
        match sync_spte(mmu, id, i) {
            SyncPageResult::Zap => {
                mmu.st.prepare_zap_page(id, invalid_list, mmu.meter);
                return SyncPageResult::Zap;
            }
            SyncPageResult::Flush => flush = true,
            SyncPageResult::NoFlush => {}
        }
    }
    SyncPageResult::from_flush(flush)
}

/// `mmu_sync_children()`: write-protects every unsync page below `parent` again, then syncs
/// each from the guest table.
pub fn mmu_sync_children(mmu: &mut LockedMmu<'_>, parent: SpId) {
    let mut invalid_list = Vec::new();
    let mut flush = false;
    loop {
        let unsync = mmu.st.unsync_descendants(parent);
        if unsync.is_empty() {
            break;
        }
        let mut protected = false;
        for &id in &unsync {
            let gfn = mmu.st.sp(id).gfn;
            protected |= mmu.st.gfn_write_protect(gfn, PG_LEVEL_4K, mmu.meter);
        }
        if protected {
            // kvm_mmu_remote_flush_or_zap(): the flush also commits what was zapped so far.
            mmu.remote_flush_or_zap(&mut invalid_list, true);
            flush = false;
        }
        for id in unsync {
            if mmu.st.sp(id).role.invalid() || !mmu.st.sp(id).unsync {
                continue;
            }
            mmu.st.unlink_unsync_page(id);
            flush |= sync_page(mmu, id, &mut invalid_list) == SyncPageResult::Flush;
        }
    }
    mmu.remote_flush_or_zap(&mut invalid_list, flush);
}

/// `FNAME(sync_spte)`: re-reads the guest PTE behind entry `i` of the unsync page `id` and
/// brings the SPTE in line: dropped if the guest PTE is gone or maps another frame, narrowed if
/// its access changed. Returns `Zap` if the guest table could not be read. Simplified from `FNAME(prefetch_invalid_gpte)`: only a non-present guest PTE drops
/// the SPTE; its reserved-bit check (the builder never sets reserved bits) and its Accessed-bit
/// check (KVM also drops an SPTE whose guest PTE has A clear; here it is kept) are left out.
pub(super) fn sync_spte(mmu: &mut LockedMmu<'_>, id: SpId, i: usize) -> SyncPageResult {
    mmu.meter.sptes_synced += 1;
    let sp = mmu.st.sp(id);
    let pte_gpa = sp.gfn.to_gpa() + i as u64 * 8;
    mmu.meter.guest_pte_reads += 1;
    let Some(gpte) = mmu.kvm.read_gpa_u64(pte_gpa) else {
        return SyncPageResult::Zap;
    };
    let sptep = SptepRef::new(id, i);
    // The page's role says which format its guest table has: EPT12 for a nested guest's.
    let ept = ept12_format(sp.role);
    let pt: &dyn PtType = if sp.role.guest_mode() { &ept } else { &Pt64 };
    if !pt.is_present(gpte) {
        mmu.st.drop_spte(sptep, mmu.meter);
        return SyncPageResult::Flush;
    }
    let gfn = gpte_to_gfn_lvl(gpte, PG_LEVEL_4K);
    let mut pte_access = sp.role.access() as u8 & pt.access(gpte);
    pt.protect_clean_gpte(&mut pte_access, gpte);
    if gfn != sp.get_gfn(i) {
        mmu.st.drop_spte(sptep, mmu.meter);
        return SyncPageResult::Flush;
    }
    if sp.get_access(i) == pte_access {
        return SyncPageResult::NoFlush;
    }
    mmu.st.sp_mut(id).set_translation(i, gfn, pte_access);
    let spte = SpteCell::load(mmu.st.sptep(sptep));
    let Some(slot) = mmu.kvm.slot_by_gfn(gfn) else {
        mmu.st.drop_spte(sptep, mmu.meter);
        return SyncPageResult::Flush;
    };
    let req = MakeSpte {
        sp: id,
        slot: &slot,
        pte_access,
        gfn,
        pfn: spte_to_pfn(spte),
        old_spte: spte,
        prefetch: true,
        synchronizing: true,
        host_writable: is_host_writable_spte(spte),
        fault: None,
    };
    let (new, _) = make_shadow_spte(mmu, &req);
    SyncPageResult::from_flush(mmu_spte_update(
        mmu.st.sptep(sptep),
        new | (spte & SHADOW_ACCESSED_MASK),
        mmu.meter,
    ))
}
