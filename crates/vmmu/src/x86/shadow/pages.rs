//! The shadow pages themselves: the page hash (`kvm->arch.mmu_page_hash`), the FIFO active
//! list (`kvm->arch.active_mmu_pages`) and the page quota; allocating, finding and freeing pages
//! (`kvm_mmu_alloc_shadow_page()`, `__kvm_mmu_get_shadow_page()`, `kvm_mmu_free_shadow_page()`).

use crate::hw::page_table::free_page_table_rcu;
use crate::kvm::memory_cache::MmuMemoryCache;
use crate::kvm::meter::Meter;
use crate::kvm::vm_lines::VmLine;
use crate::units::*;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::*;
use crate::x86::shadow::state::*;
use crate::x86::shadow::unsync::*;
use crate::x86::spte::*;

impl ShadowState {
    /// `for_each_valid_sp()` over `gfn`'s bucket, filtered to `gfn`: the valid pages for `gfn`.
    pub fn valid_sps_for_gfn(&self, gfn: Gfn) -> Vec<SpId> {
        self.mmu_page_hash[kvm_page_table_hashfn(gfn)]
            .iter()
            .filter(|&&(g, id)| g == gfn && !self.is_obsolete_sp(self.sp(id)))
            .map(|&(_, id)| id)
            .collect()
    }

    /// Pages in `gfn`'s hash bucket: what a walk of it reads.
    pub fn hash_bucket_len(&self, gfn: Gfn) -> usize {
        self.mmu_page_hash[kvm_page_table_hashfn(gfn)].len()
    }

    /// `for_each_gfn_valid_sp_with_gptes()`: valid pages shadowing the guest table at `gfn`,
    /// counting the bucket walk on `meter`.
    pub fn valid_sps_with_gptes(&self, gfn: Gfn, meter: &mut Meter) -> Vec<SpId> {
        meter.sp_lookups += 1;
        meter.sp_hash_steps += self.hash_bucket_len(gfn) as u64;
        self.touch_hash_walk(gfn, meter);
        let mut v = self.valid_sps_for_gfn(gfn);
        v.retain(|&id| self.sp(id).has_gptes());
        v
    }

    /// The lines a walk of `gfn`'s whole bucket reads: the bucket, then each page's header.
    fn touch_hash_walk(&self, gfn: Gfn, meter: &mut Meter) {
        if self.caches.is_some() {
            self.touch_hash_bucket(gfn, meter);
            for &(_, id) in &self.mmu_page_hash[kvm_page_table_hashfn(gfn)] {
                self.touch_sp_header(id, meter);
            }
        }
    }

    /// `kvm_mmu_available_pages()`.
    pub fn available_pages(&self) -> u64 {
        self.n_max_mmu_pages.saturating_sub(self.n_used_mmu_pages)
    }

    pub(super) fn list_add_head(&mut self, id: SpId) {
        let old_head = self.active_head;
        {
            let sp = self.sp_mut(id);
            sp.link_prev = None;
            sp.link_next = old_head;
        }
        match old_head {
            Some(h) => self.sp_mut(h).link_prev = Some(id),
            None => self.active_tail = Some(id),
        }
        self.active_head = Some(id);
    }

    pub(super) fn list_del(&mut self, id: SpId) {
        let (prev, next) = {
            let sp = self.sp_mut(id);
            // Valid pages are on the list; a page leaves it when it is zapped.
            if sp.role.invalid() {
                return;
            }
            (sp.link_prev.take(), sp.link_next.take())
        };
        match prev {
            Some(p) => self.sp_mut(p).link_next = next,
            None => self.active_head = next,
        }
        match next {
            Some(n) => self.sp_mut(n).link_prev = prev,
            None => self.active_tail = prev,
        }
    }

    /// The active list from oldest to newest.
    pub fn active_list_oldest_first(&self) -> Vec<SpId> {
        let mut v = Vec::new();
        let mut cur = self.active_tail;
        while let Some(id) = cur {
            v.push(id);
            cur = self.sp(id).link_prev;
        }
        v
    }

    /// `kvm_mmu_free_shadow_page()`: unhash, unlist and free a zapped page; the table goes
    /// through RCU because lockless walkers (the hardware walk, `fast_page_fault()`) may still
    /// be reading it.
    pub(super) fn free_shadow_page(&mut self, id: SpId, meter: &mut Meter) {
        self.list_del(id);
        let sp = self.sps[id.0 as usize].take().expect("live shadow page");
        debug_assert!(sp.role.invalid() && sp.root_count == 0);
        debug_assert!(sp.parent_ptes.is_empty(), "freed page still has parents");
        let bucket = &mut self.mmu_page_hash[kvm_page_table_hashfn(sp.gfn)];
        if let Some(p) = bucket.iter().position(|&(_, x)| x == id) {
            bucket.swap_remove(p);
        }
        self.page_header.remove(&(sp.spt as u64));
        self.free_ids.push(id.0);
        meter.tables_freed += 1;
        let guard = crossbeam_epoch::pin();
        // SAFETY: the page was unlinked from every parent (its parent_ptes are empty) and is no
        // root, so no new walker can reach the table; it came from Box::into_raw in
        // alloc_shadow_page and is freed only here, once.
        unsafe { free_page_table_rcu(&self.tables, sp.spt, &guard) };
    }

    /// `kvm_mmu_child_role()`: the role of a page linked below the entry `index` of `parent`.
    pub fn child_role(&self, parent: SpId, direct: bool, access: u8) -> KvmMmuPageRole {
        let mut role = self.sp(parent).role;
        role.set_level(role.level().below());
        role.set_access(access as u32);
        role.set_direct_bit(direct as u32);
        role
    }
}

impl LockedMmu<'_> {
    /// `kvm_mmu_alloc_shadow_page()`: a new page for (`gfn`, `role`) from `caches`, at the
    /// head of the active list (FIFO), counted against the quota, hashed, and — if it shadows a
    /// guest table — write-tracked (`account_shadowed()`).
    pub fn alloc_shadow_page(
        &mut self,
        cache: &mut MmuMemoryCache,
        gfn: Gfn,
        role: KvmMmuPageRole,
    ) -> SpId {
        let spt = Box::into_raw(cache.alloc(&self.st.tables));
        // kmem_cache_zalloc() of the header, on this core (from the vCPU's
        // mmu_page_header_cache, topped up before the lock).
        let header = match &self.st.caches {
            Some(caches) => self.st.header_slab.zalloc(caches),
            None => Default::default(),
        };
        let shadowed_translation = (!role.direct() && role.level() <= KVM_MAX_HUGEPAGE_LEVEL)
            // Simplified: KVM takes this from the vCPU's mmu_shadowed_info_cache, topped up
            // before the lock; here it is allocated in place.
            .then(|| Box::new([0u64; SPTE_ENT_PER_PAGE]));
        let sp = KvmMmuPage {
            role,
            gfn,
            spt,
            shadowed_translation,
            parent_ptes: KvmRmapHead::default(),
            root_count: 0,
            unsync: false,
            unsync_children: 0,
            unsync_child_bitmap: [0; SPTE_ENT_PER_PAGE / 64],
            write_flooding_count: 0,
            mmu_valid_gen: self.st.mmu_valid_gen,
            root_invalid: None,
            header,
            link_prev: None,
            link_next: None,
        };
        let id = match self.st.free_ids.pop() {
            Some(i) => {
                self.st.sps[i as usize] = Some(sp);
                SpId(i)
            }
            None => {
                self.st.sps.push(Some(sp));
                SpId(self.st.sps.len() as u32 - 1)
            }
        };
        self.st.page_header.insert(spt as u64, id);
        self.st.list_add_head(id);
        self.st.n_used_mmu_pages += 1;
        self.st.pages.lines.wrote(VmLine::MmuPages);
        // hlist_add_head(): the bucket's head now points to this page.
        self.st.touch_hash_bucket(gfn, self.meter);
        self.st.mmu_page_hash[kvm_page_table_hashfn(gfn)].push((gfn, id));
        self.st.mmu_cache_miss += 1;
        if !role.direct() {
            self.account_shadowed(id);
        }
        id
    }

    /// `__kvm_mmu_get_shadow_page()`: the valid page for (`gfn`, `role`) if one exists
    /// (`kvm_mmu_find_shadow_page()`), else a new one. `from_vcpu` (KVM's `vcpu` is not NULL)
    /// allows syncing an unsync match (`kvm_sync_page()`); eager splitting passes false and asks
    /// only for direct pages, which are never unsync.
    pub fn get_shadow_page(
        &mut self,
        cache: &mut MmuMemoryCache,
        gfn: Gfn,
        role: KvmMmuPageRole,
        from_vcpu: bool,
    ) -> (SpId, bool) {
        self.meter.sp_lookups += 1;
        let mut invalid_list = Vec::new();
        let mut found = None;
        // Zapping below only queues pages (they leave the hash when committed), so the
        // bucket does not change under the walk.
        let bucket = kvm_page_table_hashfn(gfn);
        self.st.touch_hash_bucket(gfn, self.meter);
        for k in 0..self.st.mmu_page_hash[bucket].len() {
            let (g, id) = self.st.mmu_page_hash[bucket][k];
            self.meter.sp_hash_steps += 1;
            if self.st.sps[id.0 as usize].is_some() {
                self.st.touch_sp_header(id, self.meter);
            }
            if g != gfn {
                continue;
            }
            let Some(sp) = self.st.sps[id.0 as usize].as_ref() else {
                continue;
            };
            if self.st.is_obsolete_sp(sp) {
                continue;
            }
            if sp.role != role {
                // The guest is building an upper-level table where an unsync last-level one
                // was: it has almost surely stopped using it, and the new page would be
                // write-protected anyway, so the unsync page must go.
                if role.level() > PG_LEVEL_4K && sp.unsync {
                    self.st.prepare_zap_page(id, &mut invalid_list, self.meter);
                }
                continue;
            }
            // Unsync and write flooding only apply to indirect pages.
            if sp.role.direct() {
                found = Some(id);
                break;
            }
            if sp.unsync {
                // The page is good but stale: refresh it from the guest table without
                // write-protecting it (that waits for the guest's TLB flush).
                // KVM_BUG_ON(!vcpu): eager splitting asks only for direct pages.
                assert!(
                    from_vcpu,
                    "only a vCPU's lookup of an indirect page meets an unsync one"
                );
                match sync_page(self, id, &mut invalid_list) {
                    SyncPageResult::Zap => break,
                    SyncPageResult::Flush => self.kvm.flush_remote_tlbs(self.meter),
                    SyncPageResult::NoFlush => {}
                }
            }
            self.st.sp_mut(id).write_flooding_count = 0;
            found = Some(id);
            break;
        }
        self.commit_zap_page(&mut invalid_list);
        match found {
            Some(id) => (id, false),
            None => (self.alloc_shadow_page(cache, gfn, role), true),
        }
    }
}

impl LockedVcpu<'_> {
    /// `kvm_mmu_get_child_sp()`: the page to link below `sptep` for (`gfn`, `direct`,
    /// `access`), found or created from the vCPU's cache; `Err(child)` (KVM's `-EEXIST`) when
    /// a table is linked there already.
    pub fn get_child_sp(
        &mut self,
        sptep: SptepRef,
        gfn: Gfn,
        direct: bool,
        access: u8,
    ) -> Result<SpId, SpId> {
        let spte = SpteCell::load(self.mmu.st.sptep(sptep));
        if is_shadow_present_pte(spte) && !is_large_pte(spte) {
            return Err(self.mmu.st.spte_to_child_sp(spte));
        }
        let role = self.mmu.st.child_role(sptep.sp, direct, access);
        let cache = &mut self.caches.shadow_page_cache;
        Ok(self.mmu.get_shadow_page(cache, gfn, role, true).0)
    }
}

#[cfg(test)]
mod tests {
    use crate::host::backing::Backing;
    use crate::hw::cache::CASCADE_LAKE_8275CL;
    use crate::kvm::host_caches::HostCaches;
    use crate::kvm::memory_cache::MmuMemoryCache;
    use crate::kvm::meter::Meter;
    use crate::vm::{MmuKind, Vm, VmConfig};
    use crate::x86::shadow::state::{kvm_page_table_hashfn, LockedMmu, KVM_MMU_PAGE_BYTES};
    use crate::x86::spte::{PG_LEVEL_4K, SHADOW_NONPRESENT_VALUE};

    #[test]
    fn a_hash_walk_reads_the_bucket_and_each_header_where_their_cores_put_them() {
        let vm = Vm::new(VmConfig {
            mmu: MmuKind::Shadow { ept: true },
            ..Default::default()
        });
        vm.set_user_memory_region(1, 1 << 30, 8 << 20, Backing::Anonymous, 0)
            .unwrap();
        let caches = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        assert!(vm.kvm.install_caches(caches));
        vm.mmu.place_metadata(&vm.kvm);
        // vCPU 0 (socket 0) maps four 2 MiB regions: a leaf shadow page each, their headers
        // packed one after another in its slab page.
        for i in 0..4u64 {
            vm.vcpu_write(0, (1 << 30) + (i << 21), 1).unwrap();
        }
        let inner = vm.shadow().unwrap().inner();
        let mut st = inner.lock_state_quiescent();
        let leaves: Vec<_> = (0..st.sps.len() as u32)
            .map(crate::x86::shadow::mmu_page::SpId)
            .filter(|&id| {
                st.sps[id.0 as usize]
                    .as_ref()
                    .is_some_and(|sp| sp.role.level() == PG_LEVEL_4K)
            })
            .collect();
        assert_eq!(leaves.len(), 4);
        let [a, b] = [0, 1].map(|i| st.sp(leaves[i]).header);
        assert_eq!(
            b.line_of(0),
            a.line_of(KVM_MMU_PAGE_BYTES),
            "the next object of the same slab page"
        );
        // A core of socket 1 looks the first leaf up: the bucket (in struct kvm, on the
        // VMM's socket 0) and the header's lines the walk reads come from socket 0's memory.
        let (gfn, role) = {
            let sp = st.sp(leaves[0]);
            (sp.gfn, sp.role)
        };
        let caches = vm.kvm.caches().unwrap();
        caches.run_on(caches.vcpu_cpu(1));
        let mut meter = Meter::default();
        let mut cache = MmuMemoryCache::new(4, SHADOW_NONPRESENT_VALUE);
        let (found, created) = LockedMmu::new(&vm.kvm, &mut st, &mut meter)
            .get_shadow_page(&mut cache, gfn, role, false);
        assert_eq!((found, created), (leaves[0], false));
        let bucket_len = st.mmu_page_hash[kvm_page_table_hashfn(gfn)].len() as u64;
        assert_eq!(meter.sp_hash_steps, bucket_len);
        let remote = meter.remote_memory_lines + meter.remote_memory_lines_streamed;
        assert!(
            (1 + bucket_len..=1 + 2 * bucket_len).contains(&remote),
            "{remote} lines for a bucket of {bucket_len}"
        );
        assert_eq!(meter.memory_lines + meter.llc_hits, 0);
    }
}
