//! Zapping shadow pages: `__kvm_mmu_prepare_zap_page()` unlinks a page onto an invalid list,
//! `kvm_mmu_commit_zap_page()` flushes once and frees the list; reclaiming the oldest pages
//! when the quota runs out (`make_mmu_pages_available()`, `kvm_mmu_change_mmu_pages()`).

use crate::kvm::meter::Meter;
use crate::kvm::vm_lines::VmLine;
use crate::units::*;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::*;

impl ShadowState {
    /// `mmu_page_zap_pte()`: clears entry `index` of `id`. A child page left without a parent
    /// is zapped with it only as seed 004's merged version does ([`ZapOrphans::On`]: TDP on, a
    /// nested guest's child, and a caller that collects an invalid list); otherwise it stays,
    /// unlinked, until reused or reclaimed. Returns the number of pages zapped.
    pub fn zap_pte(
        &mut self,
        id: SpId,
        index: usize,
        invalid_list: Option<&mut Vec<SpId>>,
        meter: &mut Meter,
    ) -> u64 {
        let sptep = SptepRef::new(id, index);
        let pte = SpteCell::load(self.sptep(sptep));
        meter.spte_reads += 1;
        if !is_shadow_present_pte(pte) {
            return 0;
        }
        let level = self.sp(id).role.level();
        if is_last_spte(pte, level) {
            self.drop_spte(sptep, meter);
            return 0;
        }
        let child = self.spte_to_child_sp(pte);
        self.drop_parent_pte(child, sptep, meter);
        let c = self.sp(child);
        if let Some(list) = invalid_list {
            if self.zap_orphans == ZapOrphans::On
                && self.tdp_enabled
                && c.role.guest_mode()
                && c.parent_ptes.is_empty()
            {
                return self.prepare_zap_page(child, list, meter).1;
            }
        }
        0
    }

    /// `kvm_mmu_page_unlink_children()`: clears every entry of `id`; with the seed's v1
    /// ([`ZapOrphans::V1`]) a child left without a parent is zapped too (when TDP is on).
    /// Returns the number of pages zapped.
    fn unlink_children(
        &mut self,
        id: SpId,
        invalid_list: &mut Vec<SpId>,
        meter: &mut Meter,
    ) -> u64 {
        let mut zapped = 0;
        for i in 0..SPTE_ENT_PER_PAGE {
            let pte = SpteCell::load(self.sptep(SptepRef::new(id, i)));
            zapped += self.zap_pte(id, i, Some(invalid_list), meter);
            if self.zap_orphans != ZapOrphans::V1
                || !self.tdp_enabled
                || !is_shadow_present_pte(pte)
                || is_last_spte(pte, self.sp(id).role.level())
            {
                continue;
            }
            let child = self.spte_to_child_sp(pte);
            if self.sps[child.0 as usize].is_some()
                && !self.sp(child).role.invalid()
                && self.sp(child).parent_ptes.is_empty()
            {
                zapped += self.prepare_zap_page(child, invalid_list, meter).1;
            }
        }
        zapped
    }

    /// `kvm_mmu_unlink_parents()`.
    pub(super) fn unlink_parents(&mut self, id: SpId, meter: &mut Meter) {
        while let Some(p) = self.sp(id).parent_ptes.iter().next() {
            self.drop_parent_pte(id, p, meter);
        }
    }

    /// `mmu_zap_unsync_children()`: zaps the unsync pages below `id` (found through the unsync
    /// bitmaps). Returns how many were zapped.
    pub(super) fn zap_unsync_children(
        &mut self,
        id: SpId,
        invalid_list: &mut Vec<SpId>,
        meter: &mut Meter,
    ) -> u64 {
        if self.sp(id).role.level() == PG_LEVEL_4K {
            return 0;
        }
        let mut zapped = 0;
        for child in self.unsync_descendants(id) {
            if self.sps[child.0 as usize].is_some() && !self.sp(child).role.invalid() {
                zapped += self.prepare_zap_page(child, invalid_list, meter).1;
            }
        }
        zapped
    }

    /// `__kvm_mmu_prepare_zap_page()`: unlinks `id` from its children and parents, marks it
    /// invalid and moves it to `invalid_list` (a root stays until its last user lets go).
    /// Returns (the active list became unstable, pages zapped).
    pub fn prepare_zap_page(
        &mut self,
        id: SpId,
        invalid_list: &mut Vec<SpId>,
        meter: &mut Meter,
    ) -> (bool, u64) {
        meter.sp_zapped += 1;
        self.mmu_shadow_zapped += 1;
        let mut nr_zapped = self.zap_unsync_children(id, invalid_list, meter);
        nr_zapped += self.unlink_children(id, invalid_list, meter);
        self.unlink_parents(id, meter);
        let list_unstable = nr_zapped > 0;
        let (invalid, has_gptes, unsync, root_count) = {
            let sp = self.sp(id);
            (sp.role.invalid(), sp.has_gptes(), sp.unsync, sp.root_count)
        };
        if !invalid && has_gptes {
            self.unaccount_shadowed(id);
        }
        if unsync {
            self.unlink_unsync_page(id);
        }
        // Off the active list either way; a root in use stays counted until its last user
        // puts it (mmu_free_root_page()), which zaps it again.
        self.list_del(id);
        if root_count == 0 {
            nr_zapped += 1;
            self.n_used_mmu_pages -= 1;
            self.pages.lines.wrote(VmLine::MmuPages);
            invalid_list.push(id);
        }
        let sp = self.sp_mut(id);
        sp.role.set_invalid_bit(1);
        // KVM_REQ_MMU_FREE_OBSOLETE_ROOTS: the vCPUs holding it as a root must put it. Release
        // pairs with the Acquire of KvmMmuRootInfo::obsolete().
        if let Some(flag) = &sp.root_invalid {
            flag.store(true, std::sync::atomic::Ordering::Release);
        }
        (list_unstable, nr_zapped)
    }

    /// Frees every page (VM teardown, `kvm_mmu_zap_all()` without the flush: nobody runs).
    pub fn teardown(&mut self) {
        let mut meter = Meter::default();
        self.root = None;
        // Every root reference goes with its vCPU (free_nested() and the vCPUs' MMU teardown).
        for sp in self.sps.iter_mut().flatten() {
            sp.root_count = 0;
        }
        let mut invalid_list = Vec::new();
        let ids: Vec<SpId> = self.live_sps().map(|(id, _)| id).collect();
        for id in ids {
            if self.sps[id.0 as usize].is_some() && !self.sp(id).role.invalid() {
                self.prepare_zap_page(id, &mut invalid_list, &mut meter);
            }
        }
        for id in invalid_list.drain(..) {
            self.free_shadow_page(id, &mut meter);
        }
        for r in self.rmaps.values_mut() {
            for level in r.rmap.iter_mut() {
                for h in level.iter_mut() {
                    pte_list_free(h);
                }
            }
        }
        self.rmaps.clear();
        self.desc_meta.clear();
    }
}

impl LockedMmu<'_> {
    /// `kvm_mmu_commit_zap_page()`: one remote flush (which also waits out lockless walkers in
    /// KVM; here RCU does that), then the pages are freed.
    pub fn commit_zap_page(&mut self, invalid_list: &mut Vec<SpId>) {
        if invalid_list.is_empty() {
            return;
        }
        self.kvm.flush_remote_tlbs(self.meter);
        for id in invalid_list.drain(..) {
            self.st.free_shadow_page(id, self.meter);
        }
    }

    /// `kvm_mmu_remote_flush_or_zap()`: commit the list if it has pages, else flush if asked.
    /// Returns whether anything happened.
    pub fn remote_flush_or_zap(&mut self, invalid_list: &mut Vec<SpId>, flush: bool) -> bool {
        if !invalid_list.is_empty() {
            self.commit_zap_page(invalid_list);
            return true;
        }
        if flush {
            self.kvm.flush_remote_tlbs(self.meter);
        }
        flush
    }

    /// `kvm_mmu_zap_oldest_mmu_pages()`: zaps unrooted pages from the old end of the active
    /// list until `nr_to_zap` are gone. Returns how many were zapped.
    pub fn zap_oldest_mmu_pages(&mut self, nr_to_zap: u64) -> u64 {
        let mut invalid_list = Vec::new();
        let mut total = 0;
        'restart: loop {
            for id in self.st.active_list_oldest_first() {
                if self.st.sps[id.0 as usize].is_none() {
                    continue;
                }
                let sp = self.st.sp(id);
                if sp.root_count > 0 || sp.role.invalid() {
                    continue;
                }
                let (unstable, n) = self.st.prepare_zap_page(id, &mut invalid_list, self.meter);
                total += n;
                if total >= nr_to_zap {
                    break 'restart;
                }
                if unstable {
                    continue 'restart;
                }
            }
            break;
        }
        self.commit_zap_page(&mut invalid_list);
        self.st.mmu_recycled += total;
        total
    }

    /// `kvm_mmu_zap_all_fast()` (memslot deletion under the default `KVM_X86_QUIRK_SLOT_ZAP_ALL`):
    /// every page of the old generation becomes obsolete at once (`mmu_valid_gen` flips, and
    /// vCPUs put the roots they hold), then `kvm_zap_obsolete_pages()` zaps them from the old
    /// end of the active list, restarting when a zap made the list unstable, and commits them
    /// with one flush. Returns the pages zapped.
    ///
    /// Simplified: KVM breaks the lock every `BATCH_ZAP_PAGES` zaps if someone waits
    /// (`cond_resched_rwlock_write()`); here it runs in one hold (nothing else runs at VM
    /// shutdown, where the scenarios delete memslots).
    pub fn zap_all_fast(&mut self) -> u64 {
        // Every page becomes obsolete; the zaps below raise the flags of held roots
        // (KVM_REQ_MMU_FREE_OBSOLETE_ROOTS).
        self.st.mmu_valid_gen += 1;
        let mut invalid_list = Vec::new();
        let mut zapped = 0;
        'restart: loop {
            let mut cur = self.st.active_tail;
            while let Some(id) = cur {
                let sp = self.st.sp(id);
                // The list is FIFO: no obsolete page comes after a page of this generation.
                if !self.st.is_obsolete_sp(sp) {
                    break 'restart;
                }
                cur = sp.link_prev;
                let (unstable, n) = self.st.prepare_zap_page(id, &mut invalid_list, self.meter);
                zapped += n;
                if unstable {
                    continue 'restart;
                }
            }
            break;
        }
        self.commit_zap_page(&mut invalid_list);
        zapped
    }

    /// `kvm_mmu_zap_memslot()`: unmaps every leaf of `[start, end)` (`kvm_unmap_gfn_range()`
    /// -> `kvm_zap_rmap()` at every level), then zaps every shadow page of a guest table in it,
    /// and flushes (`kvm_mmu_remote_flush_or_zap()`).
    pub fn zap_memslot(&mut self, start: Gfn, end: Gfn) {
        let mut flush = false;
        for level in [PG_LEVEL_4K, PG_LEVEL_2M, PG_LEVEL_1G] {
            let mut gfn = start.round_for_level(level);
            while gfn < end {
                flush |= self.st.zap_rmap(gfn.max(start), level, self.meter);
                gfn += level.pages();
            }
        }
        // kvm_mmu_zap_memslot_pages_and_flush(): only pages shadowing guest tables on the
        // slot's gfns go; direct pages stay (empty now), as they do in KVM. A zapped root
        // stays until put, and the next fault loads a new one (ensure_root()).
        let mut invalid_list = Vec::new();
        let st = &*self.st;
        let victims: Vec<SpId> = st
            .live_sps()
            .filter(|(_, sp)| {
                sp.has_gptes() && sp.gfn >= start && sp.gfn < end && !st.is_obsolete_sp(sp)
            })
            .map(|(id, _)| id)
            .collect();
        for id in victims {
            if !self.st.sp(id).role.invalid() {
                self.st.prepare_zap_page(id, &mut invalid_list, self.meter);
            }
        }
        self.remote_flush_or_zap(&mut invalid_list, flush);
    }

    /// `make_mmu_pages_available()`: before a fault allocates, make sure a few pages are free,
    /// zapping the oldest if needed.
    pub fn make_mmu_pages_available(&mut self) -> Result<(), Errno> {
        let avail = self.st.available_pages();
        if avail >= KVM_MIN_FREE_MMU_PAGES {
            return Ok(());
        }
        self.zap_oldest_mmu_pages(KVM_REFILL_PAGES - avail);
        if self.st.available_pages() == 0 {
            return Err(Errno::NoSpace);
        }
        Ok(())
    }

    /// `kvm_mmu_change_mmu_pages()`: sets the quota, zapping the oldest pages above it.
    pub fn change_mmu_pages(&mut self, goal: u64) {
        let mut goal = goal;
        if self.st.n_used_mmu_pages > goal {
            let n = self.st.n_used_mmu_pages - goal;
            self.zap_oldest_mmu_pages(n);
            goal = self.st.n_used_mmu_pages;
        }
        self.st.n_max_mmu_pages = goal;
    }
}
