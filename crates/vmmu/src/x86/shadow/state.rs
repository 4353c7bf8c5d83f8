//! What `mmu_lock` protects in the shadow MMU: the shadow pages (`struct kvm_mmu_page`), the
//! page hash, the FIFO active list, the page quota, the memslot rmaps and the write-tracked
//! gfns; and the primitives KVM builds everything else from (mmu.c): SPTE set/update/clear,
//! `rmap_add`/`rmap_remove`, `__kvm_mmu_get_shadow_page()`, `__link_shadow_page()`,
//! `__kvm_mmu_prepare_zap_page()` / `kvm_mmu_commit_zap_page()`, `make_mmu_pages_available()`.

use crate::hw::page_table::{free_page_table_rcu, PageTableStats};
use crate::hw::spte::*;
use crate::kvm::memory_cache::MmuMemoryCache;
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

/// `KVM_MIN_FREE_MMU_PAGES`: a fault makes sure at least this many pages are free; eager
/// splitting refuses to run at or below it.
pub const KVM_MIN_FREE_MMU_PAGES: u64 = 5;
/// `KVM_REFILL_PAGES`: how many free pages zapping the oldest aims for.
pub const KVM_REFILL_PAGES: u64 = 25;
/// `KVM_MIN_ALLOC_MMU_PAGES`: the smallest default quota.
pub const KVM_MIN_ALLOC_MMU_PAGES: u64 = 64;
/// `KVM_MEMSLOT_PAGES_TO_MMU_PAGES_RATIO`: one shadow page of quota per 50 guest pages.
pub const KVM_MEMSLOT_PAGES_TO_MMU_PAGES_RATIO: u64 = 50;
/// `KVM_MMU_HASH_SHIFT`: 4096 hash buckets.
pub const KVM_MMU_HASH_SHIFT: u32 = 12;

/// The negative errno values KVM's shadow MMU returns where it can fail, by name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Errno {
    /// `-EPERM`: the gfn may not be mapped writable (`mmu_try_to_unsync_pages()`).
    NotPermitted,
    /// `-EEXIST`: a prefetch found a page it would have to unsync.
    Exists,
    /// `-ENOSPC`: no shadow page could be freed (`make_mmu_pages_available()`).
    NoSpace,
}

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

/// How a found unsync page is synced from the guest's table (`kvm_sync_page()`).
pub type SyncPageFn<'a> =
    dyn FnMut(&mut ShadowState, SpId, &mut Vec<SpId>, &mut Meter) -> SyncPageResult + 'a;

/// `hash_64(gfn, KVM_MMU_HASH_SHIFT)`: the bucket of `gfn` in the page hash.
pub fn kvm_page_table_hashfn(gfn: Gfn) -> usize {
    (gfn.0.wrapping_mul(0x61C8_8646_80B5_83EB) >> (64 - KVM_MMU_HASH_SHIFT)) as usize
}

/// `kvm_mmu_calculate_default_mmu_pages()`: the default quota for `nr_pages` guest pages.
pub fn default_mmu_pages(nr_pages: u64) -> u64 {
    (nr_pages / KVM_MEMSLOT_PAGES_TO_MMU_PAGES_RATIO).max(KVM_MIN_ALLOC_MMU_PAGES)
}

/// `slot->arch.rmap[]`: one rmap head per gfn (per huge page above 4K) per level.
pub struct SlotRmaps {
    /// The slot's first gfn.
    pub base_gfn: Gfn,
    /// The slot's size in pages.
    pub npages: u64,
    /// `rmap[level - 1][gfn_to_index(gfn, base_gfn, level)]`.
    pub rmap: [Vec<KvmRmapHead>; 3],
}

/// `gfn_to_index()`.
pub fn gfn_to_index(gfn: Gfn, base_gfn: Gfn, level: Level) -> usize {
    ((gfn.0 >> level.gfn_shift()) - (base_gfn.0 >> level.gfn_shift())) as usize
}

impl SlotRmaps {
    /// `memslot_rmap_alloc()`: zeroed heads for every level.
    pub fn new(slot: &Memslot) -> Self {
        let lpages = |level: Level| {
            gfn_to_index(Gfn(slot.base_gfn.0 + slot.npages - 1), slot.base_gfn, level) + 1
        };
        SlotRmaps {
            base_gfn: slot.base_gfn,
            npages: slot.npages,
            rmap: [1, 2, 3].map(|l| {
                let n = lpages(Level(l));
                // Zeroed, so untouched heads cost no memory (an all-zero head is empty).
                let mut v = Vec::with_capacity(n);
                v.resize_with(n, KvmRmapHead::default);
                v
            }),
        }
    }

    /// The slot's end gfn.
    pub fn end_gfn(&self) -> Gfn {
        Gfn(self.base_gfn.0 + self.npages)
    }

    /// `gfn_to_rmap()`.
    pub fn head(&mut self, gfn: Gfn, level: Level) -> &mut KvmRmapHead {
        let i = gfn_to_index(gfn, self.base_gfn, level);
        &mut self.rmap[level.0 as usize - 1][i]
    }
}

/// Everything `mmu_lock` protects in the shadow MMU.
pub struct ShadowState {
    sps: Vec<Option<KvmMmuPage>>,
    free_ids: Vec<u32>,
    /// `page_private(virt_to_page(spt))`: table address → its shadow page.
    page_header: HashMap<u64, SpId>,
    /// `kvm->arch.mmu_page_hash`.
    mmu_page_hash: Vec<Vec<SpId>>,
    /// Newest and oldest page of `kvm->arch.active_mmu_pages`.
    active_head: Option<SpId>,
    active_tail: Option<SpId>,
    /// `kvm->arch.n_used_mmu_pages`.
    pub n_used_mmu_pages: u64,
    /// `kvm->arch.n_max_mmu_pages`.
    pub n_max_mmu_pages: u64,
    /// `kvm->arch.n_requested_mmu_pages`: a quota userspace set (0: the default applies).
    pub n_requested_mmu_pages: u64,
    /// `kvm->arch.indirect_shadow_pages`.
    pub indirect_shadow_pages: u64,
    /// `kvm->arch.mmu_valid_gen`.
    pub mmu_valid_gen: u64,
    /// Rmaps of each memslot, by base gfn.
    pub rmaps: BTreeMap<u64, SlotRmaps>,
    /// `gfn_write_track`: gfns holding upper-level guest tables, which stay read-only.
    pub gfn_write_track: HashMap<Gfn, u32>,
    /// `lpage_info.disallow_lpage` raised by last-level guest tables: (level, huge-page index).
    pub disallow_lpage: HashMap<(u8, u64), u32>,
    /// The root shadow page every vCPU uses.
    pub root: Option<SpId>,
    /// Shadow pages ever zapped (`kvm->stat.mmu_shadow_zapped`).
    pub mmu_shadow_zapped: u64,
    /// Pages created (`kvm->stat.mmu_cache_miss`).
    pub mmu_cache_miss: u64,
    /// Pages unsync now (`kvm->stat.mmu_unsync`).
    pub mmu_unsync: u64,
    /// Largest rmap list seen (`kvm->stat.max_mmu_rmap_size`).
    pub max_mmu_rmap_size: u64,
    /// Page-table allocation counters.
    pub tables: Arc<PageTableStats>,
    /// `tdp_enabled`: EPT is on (the shadow MMU maps guest physical memory directly).
    pub tdp_enabled: bool,
}

/// Leaves per level (`kvm->stat.pages[]`), updated where KVM's `kvm_update_page_stats()` is.
pub type PageStats = [AtomicI64; 3];

fn account_leaf(pages: &PageStats, level: Level, delta: i64) {
    if level <= KVM_MAX_HUGEPAGE_LEVEL {
        pages[level.0 as usize - 1].fetch_add(delta, Ordering::Relaxed);
    }
}

/// `__set_spte()` / `mmu_spte_set()`: installs an entry over a non-present one.
pub fn mmu_spte_set(sptep: &AtomicU64, new: u64, meter: &mut Meter) {
    debug_assert!(
        !is_shadow_present_pte(SpteCell::load(sptep)),
        "mmu_spte_set over a present SPTE"
    );
    SpteCell::store(sptep, new);
    meter.spte_writes += 1;
}

/// `mmu_spte_update()`: rewrites a leaf, atomically when the fast path or the CPU may change it
/// meanwhile (`spte_needs_atomic_update()`). Returns whether the change needs a TLB flush.
pub fn mmu_spte_update(sptep: &AtomicU64, new: u64, meter: &mut Meter) -> bool {
    let old = SpteCell::load(sptep);
    if !is_shadow_present_pte(old) {
        mmu_spte_set(sptep, new, meter);
        return false;
    }
    let old = if spte_needs_atomic_update(old) {
        sptep.xchg(new)
    } else {
        SpteCell::store(sptep, new);
        old
    };
    meter.spte_writes += 1;
    debug_assert!(
        !is_shadow_present_pte(new) || spte_to_pfn(old) == spte_to_pfn(new),
        "mmu_spte_update changed the PFN"
    );
    leaf_spte_change_needs_tlb_flush(old, new)
}

/// `mmu_spte_clear_no_track()`.
pub fn mmu_spte_clear_no_track(sptep: &AtomicU64, meter: &mut Meter) {
    SpteCell::store(sptep, SHADOW_NONPRESENT_VALUE);
    meter.spte_writes += 1;
}

impl ShadowState {
    /// Empty state with quota `n_max_mmu_pages`.
    pub fn new(tables: Arc<PageTableStats>, tdp_enabled: bool) -> Self {
        ShadowState {
            sps: Vec::new(),
            free_ids: Vec::new(),
            page_header: HashMap::new(),
            mmu_page_hash: vec![Vec::new(); 1 << KVM_MMU_HASH_SHIFT],
            active_head: None,
            active_tail: None,
            n_used_mmu_pages: 0,
            n_max_mmu_pages: KVM_MIN_ALLOC_MMU_PAGES,
            n_requested_mmu_pages: 0,
            indirect_shadow_pages: 0,
            mmu_valid_gen: 0,
            rmaps: BTreeMap::new(),
            gfn_write_track: HashMap::new(),
            disallow_lpage: HashMap::new(),
            root: None,
            mmu_shadow_zapped: 0,
            mmu_cache_miss: 0,
            mmu_unsync: 0,
            max_mmu_rmap_size: 0,
            tables,
            tdp_enabled,
        }
    }

    /// The page `id`.
    pub fn sp(&self, id: SpId) -> &KvmMmuPage {
        self.sps[id.0 as usize].as_ref().expect("live shadow page")
    }

    /// The page `id`, mutably.
    pub fn sp_mut(&mut self, id: SpId) -> &mut KvmMmuPage {
        self.sps[id.0 as usize].as_mut().expect("live shadow page")
    }

    /// Every live page (valid or zapped-but-rooted).
    pub fn live_sps(&self) -> impl Iterator<Item = (SpId, &KvmMmuPage)> {
        self.sps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (SpId(i as u32), s)))
    }

    /// `spte_to_child_sp()`: the page a present non-leaf SPTE points to.
    pub fn spte_to_child_sp(&self, spte: u64) -> SpId {
        let addr = spte_to_pfn(spte).0 << PAGE_SHIFT;
        *self
            .page_header
            .get(&addr)
            .unwrap_or_else(|| panic!("non-leaf SPTE {spte:#x} points to no shadow page"))
    }

    /// The SPTE `sptep` names (`*sptep`); panics if its page was freed.
    pub fn sptep(&self, sptep: SptepRef) -> &AtomicU64 {
        &self.sp(sptep.sp).spt().spt[sptep.index]
    }

    /// `is_obsolete_sp()`.
    pub fn is_obsolete_sp(&self, sp: &KvmMmuPage) -> bool {
        sp.role.invalid() || sp.mmu_valid_gen != self.mmu_valid_gen
    }

    /// `for_each_valid_sp()` over `gfn`'s bucket, filtered to `gfn`: the valid pages for `gfn`.
    pub fn valid_sps_for_gfn(&self, gfn: Gfn) -> Vec<SpId> {
        self.mmu_page_hash[kvm_page_table_hashfn(gfn)]
            .iter()
            .copied()
            .filter(|&id| {
                let sp = self.sp(id);
                sp.gfn == gfn && !self.is_obsolete_sp(sp)
            })
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
        let mut v = self.valid_sps_for_gfn(gfn);
        v.retain(|&id| self.sp(id).has_gptes());
        v
    }

    /// `kvm_mmu_available_pages()`.
    pub fn available_pages(&self) -> u64 {
        self.n_max_mmu_pages.saturating_sub(self.n_used_mmu_pages)
    }

    /// The rmaps of the slot holding `gfn`.
    pub fn rmaps_for_gfn(&mut self, gfn: Gfn) -> Option<&mut SlotRmaps> {
        self.rmaps
            .range_mut(..=gfn.0)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| gfn < r.end_gfn())
    }

    /// `gfn_to_rmap()` read-only: the rmap of (`gfn`, `level`), if a memslot holds `gfn`.
    pub fn rmap_head(&self, gfn: Gfn, level: Level) -> Option<&KvmRmapHead> {
        let (_, r) = self.rmaps.range(..=gfn.0).next_back()?;
        (gfn < r.end_gfn())
            .then(|| &r.rmap[level.0 as usize - 1][gfn_to_index(gfn, r.base_gfn, level)])
    }

    /// The rmaps of `slot`, allocated on first use (`memslot_rmap_alloc()` runs when the slot
    /// is created; a slot the MMU never touched needs none).
    pub fn slot_rmaps(&mut self, slot: &Memslot) -> &mut SlotRmaps {
        self.rmaps
            .entry(slot.base_gfn.0)
            .or_insert_with(|| SlotRmaps::new(slot))
    }

    // --- the active list --------------------------------------------------------------

    fn list_add_head(&mut self, id: SpId) {
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

    fn list_del(&mut self, id: SpId) {
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

    // --- allocation -----------------------------------------------------------------

    /// `kvm_mmu_alloc_shadow_page()`: a new page for (`gfn`, `role`) from `caches`, at the
    /// head of the active list (FIFO), counted against the quota, hashed, and — if it shadows a
    /// guest table — write-tracked (`account_shadowed()`).
    pub fn alloc_shadow_page(
        &mut self,
        kvm: &Kvm,
        cache: &mut MmuMemoryCache,
        gfn: Gfn,
        role: KvmMmuPageRole,
        meter: &mut Meter,
    ) -> SpId {
        let spt = Box::into_raw(cache.alloc(&self.tables));
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
            mmu_valid_gen: self.mmu_valid_gen,
            link_prev: None,
            link_next: None,
        };
        let id = match self.free_ids.pop() {
            Some(i) => {
                self.sps[i as usize] = Some(sp);
                SpId(i)
            }
            None => {
                self.sps.push(Some(sp));
                SpId(self.sps.len() as u32 - 1)
            }
        };
        self.page_header.insert(spt as u64, id);
        self.list_add_head(id);
        self.n_used_mmu_pages += 1;
        self.mmu_page_hash[kvm_page_table_hashfn(gfn)].push(id);
        self.mmu_cache_miss += 1;
        if !role.direct() {
            self.account_shadowed(kvm, id, meter);
        }
        id
    }

    /// `kvm_mmu_free_shadow_page()`: unhash, unlist and free a zapped page; the table goes
    /// through RCU because lockless walkers (the hardware walk, `fast_page_fault()`) may still
    /// be reading it.
    fn free_shadow_page(&mut self, id: SpId, meter: &mut Meter) {
        self.list_del(id);
        let sp = self.sps[id.0 as usize].take().expect("live shadow page");
        debug_assert!(sp.role.invalid() && sp.root_count == 0);
        debug_assert!(sp.parent_ptes.is_empty(), "freed page still has parents");
        let bucket = &mut self.mmu_page_hash[kvm_page_table_hashfn(sp.gfn)];
        if let Some(p) = bucket.iter().position(|&x| x == id) {
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

    /// `account_shadowed()`: a page now shadows the guest table at its gfn. Upper-level tables
    /// are write-tracked (always read-only to the guest); a last-level table forbids huge
    /// mappings over its gfn and write-protects the existing ones.
    fn account_shadowed(&mut self, kvm: &Kvm, id: SpId, meter: &mut Meter) {
        self.indirect_shadow_pages += 1;
        let (gfn, level) = {
            let sp = self.sp(id);
            (sp.gfn, sp.role.level())
        };
        // __kvm_write_track_add_gfn() for upper levels does what a last-level table gets too
        // (kvm_mmu_gfn_disallow_lpage() and write protection), and marks the gfn tracked.
        if level > PG_LEVEL_4K {
            *self.gfn_write_track.entry(gfn).or_default() += 1;
        }
        for l in [PG_LEVEL_2M, PG_LEVEL_1G] {
            *self
                .disallow_lpage
                .entry((l.0, gfn.0 >> l.gfn_shift()))
                .or_default() += 1;
        }
        if self.gfn_write_protect(gfn, PG_LEVEL_4K, meter) {
            kvm.flush_remote_tlbs_gfn(gfn, PG_LEVEL_4K, meter);
        }
    }

    /// `unaccount_shadowed()`.
    fn unaccount_shadowed(&mut self, id: SpId) {
        self.indirect_shadow_pages -= 1;
        let (gfn, level) = {
            let sp = self.sp(id);
            (sp.gfn, sp.role.level())
        };
        fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: K) {
            if let Some(c) = m.get_mut(&k) {
                *c -= 1;
                if *c == 0 {
                    m.remove(&k);
                }
            }
        }
        if level > PG_LEVEL_4K {
            dec(&mut self.gfn_write_track, gfn);
        }
        for l in [PG_LEVEL_2M, PG_LEVEL_1G] {
            dec(&mut self.disallow_lpage, (l.0, gfn.0 >> l.gfn_shift()));
        }
    }

    /// `kvm_gfn_is_write_tracked()`.
    pub fn gfn_is_write_tracked(&self, gfn: Gfn) -> bool {
        self.gfn_write_track.contains_key(&gfn)
    }

    /// Whether a guest table forbids mapping `gfn` at `level` (`lpage_info.disallow_lpage`).
    pub fn lpage_disallowed(&self, gfn: Gfn, level: Level) -> bool {
        level > PG_LEVEL_4K
            && self
                .disallow_lpage
                .contains_key(&(level.0, gfn.0 >> level.gfn_shift()))
    }

    /// `kvm_mmu_child_role()`: the role of a page linked below the entry `index` of `parent`.
    pub fn child_role(&self, parent: SpId, direct: bool, access: u8) -> KvmMmuPageRole {
        let mut role = self.sp(parent).role;
        role.set_level(role.level().below());
        role.set_access(access as u32);
        role.set_direct_bit(direct as u32);
        role
    }

    /// `kvm_mmu_get_child_sp()`: the page to link below entry `index` of `parent` for (`gfn`,
    /// `direct`, `access`), found or created; `Err(child)` (KVM's `-EEXIST`) when a table is
    /// linked there already.
    #[allow(clippy::too_many_arguments)]
    pub fn get_child_sp(
        &mut self,
        kvm: &Kvm,
        cache: &mut MmuMemoryCache,
        parent: SpId,
        index: usize,
        gfn: Gfn,
        direct: bool,
        access: u8,
        pages: &PageStats,
        sync: Option<&mut SyncPageFn>,
        meter: &mut Meter,
    ) -> Result<SpId, SpId> {
        let spte = SpteCell::load(self.sptep(SptepRef::new(parent, index)));
        if is_shadow_present_pte(spte) && !is_large_pte(spte) {
            return Err(self.spte_to_child_sp(spte));
        }
        let role = self.child_role(parent, direct, access);
        Ok(self
            .get_shadow_page(kvm, cache, gfn, role, pages, sync, meter)
            .0)
    }

    /// `__kvm_mmu_get_shadow_page()`: the valid page for (`gfn`, `role`) if one exists
    /// (`kvm_mmu_find_shadow_page()`), else a new one. `sync` syncs an unsync match (a vCPU's
    /// lookup; eager splitting asks only for direct pages, which are never unsync).
    #[allow(clippy::too_many_arguments)]
    pub fn get_shadow_page(
        &mut self,
        kvm: &Kvm,
        cache: &mut MmuMemoryCache,
        gfn: Gfn,
        role: KvmMmuPageRole,
        pages: &PageStats,
        mut sync: Option<&mut SyncPageFn>,
        meter: &mut Meter,
    ) -> (SpId, bool) {
        meter.sp_lookups += 1;
        let mut invalid_list = Vec::new();
        let mut found = None;
        // Zapping below only queues pages (they leave the hash when committed), so the
        // bucket does not change under the walk.
        let bucket = kvm_page_table_hashfn(gfn);
        for k in 0..self.mmu_page_hash[bucket].len() {
            let id = self.mmu_page_hash[bucket][k];
            meter.sp_hash_steps += 1;
            let Some(sp) = self.sps[id.0 as usize].as_ref() else {
                continue;
            };
            if self.is_obsolete_sp(sp) || sp.gfn != gfn {
                continue;
            }
            if sp.role != role {
                // The guest is building an upper-level table where an unsync last-level one
                // was: it has almost surely stopped using it, and the new page would be
                // write-protected anyway, so the unsync page must go.
                if role.level() > PG_LEVEL_4K && sp.unsync {
                    self.prepare_zap_page(id, &mut invalid_list, pages, meter);
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
                let sync = sync
                    .as_mut()
                    .expect("only a vCPU's lookup of an indirect page meets an unsync one");
                match sync(self, id, &mut invalid_list, meter) {
                    SyncPageResult::Zap => break,
                    SyncPageResult::Flush => kvm.flush_remote_tlbs(meter),
                    SyncPageResult::NoFlush => {}
                }
            }
            self.sp_mut(id).write_flooding_count = 0;
            found = Some(id);
            break;
        }
        self.commit_zap_page(kvm, &mut invalid_list, meter);
        match found {
            Some(id) => (id, false),
            None => (self.alloc_shadow_page(kvm, cache, gfn, role, meter), true),
        }
    }

    // --- rmaps ------------------------------------------------------------------------

    /// `__rmap_add()`: records that entry `index` of page `id` maps `gfn` with `access`.
    /// A gfn with more than `RMAP_RECYCLE_THRESHOLD` mappings has them all zapped.
    #[allow(clippy::too_many_arguments)]
    pub fn rmap_add(
        &mut self,
        kvm: &Kvm,
        cache: &mut PteListDescCache,
        slot: &Memslot,
        id: SpId,
        index: usize,
        gfn: Gfn,
        access: u8,
        pages: &PageStats,
        meter: &mut Meter,
    ) {
        self.sp_mut(id).set_translation(index, gfn, access);
        let level = self.sp(id).role.level();
        account_leaf(pages, level, 1);
        let sptep = SptepRef::new(id, index);
        let head = self.slot_rmaps(slot).head(gfn, level);
        let count = pte_list_add(cache, sptep, head);
        meter.rmap_adds += 1;
        self.max_mmu_rmap_size = self.max_mmu_rmap_size.max(count as u64);
        if count > RMAP_RECYCLE_THRESHOLD {
            self.zap_rmap(gfn, level, pages, meter);
            kvm.flush_remote_tlbs_gfn(gfn, level, meter);
        }
    }

    /// `rmap_remove()`: forgets the leaf `sptep` (whose page and index give its gfn).
    fn rmap_remove(&mut self, sptep: SptepRef, meter: &mut Meter) {
        let (gfn, level) = {
            let sp = self.sp(sptep.sp);
            (sp.get_gfn(sptep.index), sp.role.level())
        };
        let rmaps = self
            .rmaps_for_gfn(gfn)
            .unwrap_or_else(|| panic!("{gfn:?} is mapped but no memslot rmap holds it"));
        pte_list_remove(sptep, rmaps.head(gfn, level));
        meter.rmap_removes += 1;
    }

    /// `mmu_spte_clear_track_bits()`: clears a leaf (atomically if it has volatile bits) and
    /// updates the page stats. Returns the old value.
    fn spte_clear_track_bits(
        &self,
        sptep: &AtomicU64,
        level: Level,
        pages: &PageStats,
        meter: &mut Meter,
    ) -> u64 {
        let old = SpteCell::load(sptep);
        let old = if !is_shadow_present_pte(old) || !spte_needs_atomic_update(old) {
            SpteCell::store(sptep, SHADOW_NONPRESENT_VALUE);
            old
        } else {
            sptep.xchg(SHADOW_NONPRESENT_VALUE)
        };
        meter.spte_writes += 1;
        if is_shadow_present_pte(old) {
            account_leaf(pages, level, -1);
        }
        old
    }

    /// `drop_spte()`: clears a leaf and removes it from its rmap.
    pub fn drop_spte(&mut self, sptep: SptepRef, pages: &PageStats, meter: &mut Meter) {
        let level = self.sp(sptep.sp).role.level();
        let old = self.spte_clear_track_bits(self.sptep(sptep), level, pages, meter);
        if is_shadow_present_pte(old) {
            self.rmap_remove(sptep, meter);
        }
    }

    /// `kvm_zap_all_rmap_sptes()`: clears every leaf in the rmap of (`gfn`, `level`).
    /// Returns whether anything was zapped.
    pub fn zap_rmap(
        &mut self,
        gfn: Gfn,
        level: Level,
        pages: &PageStats,
        meter: &mut Meter,
    ) -> bool {
        let Some(rmaps) = self.rmaps_for_gfn(gfn) else {
            return false;
        };
        let head = rmaps.head(gfn, level);
        meter.rmap_reads += 1;
        if head.is_empty() {
            return false;
        }
        let mut sptes = Vec::new();
        pte_list_destroy(head, |s| sptes.push(s));
        for s in sptes {
            self.spte_clear_track_bits(self.sptep(s), level, pages, meter);
            meter.rmap_removes += 1;
        }
        true
    }

    /// `spte_write_protect()`: clears W (and MMU-writable when `pt_protect`). Returns whether
    /// a TLB flush is needed.
    fn spte_write_protect(sptep: &AtomicU64, pt_protect: bool, meter: &mut Meter) -> bool {
        let spte = SpteCell::load(sptep);
        if !(is_writable_pte(spte) || (pt_protect && is_mmu_writable_spte(spte))) {
            return false;
        }
        let mut new = spte & !PT_WRITABLE_MASK;
        if pt_protect {
            new &= !EPT_SPTE_MMU_WRITABLE;
        }
        meter.sptes_wrprot += 1;
        mmu_spte_update(sptep, new, meter)
    }

    /// `rmap_write_protect()` of the rmap of (`gfn`, `level`). Returns whether a flush is
    /// needed.
    pub fn rmap_write_protect(
        &mut self,
        gfn: Gfn,
        level: Level,
        pt_protect: bool,
        meter: &mut Meter,
    ) -> bool {
        let Some(head) = self.rmap_head(gfn, level) else {
            return false;
        };
        meter.rmap_reads += 1;
        let mut flush = false;
        for s in head.iter() {
            meter.spte_reads += 1;
            flush |= Self::spte_write_protect(self.sptep(s), pt_protect, meter);
        }
        flush
    }

    /// `kvm_mmu_slot_gfn_write_protect()` (shadow part): write-protect (W and MMU-writable)
    /// every mapping of `gfn` at `min_level` and above.
    pub fn gfn_write_protect(&mut self, gfn: Gfn, min_level: Level, meter: &mut Meter) -> bool {
        let mut write_protected = false;
        let mut level = min_level;
        while level <= KVM_MAX_HUGEPAGE_LEVEL {
            write_protected |= self.rmap_write_protect(gfn, level, true, meter);
            level = level.above();
        }
        write_protected
    }

    // --- linking --------------------------------------------------------------------

    /// `mmu_page_add_parent_pte()`.
    fn add_parent_pte(
        &mut self,
        cache: &mut PteListDescCache,
        child: SpId,
        parent_pte: SptepRef,
        meter: &mut Meter,
    ) {
        pte_list_add(cache, parent_pte, &mut self.sp_mut(child).parent_ptes);
        meter.rmap_adds += 1;
    }

    /// `drop_parent_pte()`: unlinks `child` from the non-leaf entry `parent_pte` and clears it.
    pub fn drop_parent_pte(&mut self, child: SpId, parent_pte: SptepRef, meter: &mut Meter) {
        pte_list_remove(parent_pte, &mut self.sp_mut(child).parent_ptes);
        meter.rmap_removes += 1;
        mmu_spte_clear_no_track(self.sptep(parent_pte), meter);
    }

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

    /// `drop_large_spte()`: removes the huge leaf `sptep` before a table is linked there, with
    /// a flush of its range when `flush`.
    fn drop_large_spte(
        &mut self,
        kvm: &Kvm,
        sptep: SptepRef,
        flush: bool,
        pages: &PageStats,
        meter: &mut Meter,
    ) {
        let (level, gfn) = {
            let sp = self.sp(sptep.sp);
            (sp.role.level(), sp.get_gfn(sptep.index))
        };
        debug_assert!(level > PG_LEVEL_4K);
        self.drop_spte(sptep, pages, meter);
        if flush {
            kvm.flush_remote_tlbs_gfn(gfn, level, meter);
        }
    }

    /// `__link_shadow_page()`: points entry `index` of `parent` at `child` — dropping the huge
    /// leaf there first (with a flush when `flush`) — and records the parent.
    #[allow(clippy::too_many_arguments)]
    pub fn link_shadow_page(
        &mut self,
        kvm: &Kvm,
        cache: &mut PteListDescCache,
        parent: SpId,
        index: usize,
        child: SpId,
        flush: bool,
        pages: &PageStats,
        meter: &mut Meter,
    ) {
        let sptep = SptepRef::new(parent, index);
        // A present entry here must be a leaf, hence a huge one: drop it (and flush if asked)
        // before installing the table.
        if is_shadow_present_pte(SpteCell::load(self.sptep(sptep))) {
            self.drop_large_spte(kvm, sptep, flush, pages, meter);
        }
        let spte = make_nonleaf_spte(self.sp(child).spt as u64);
        mmu_spte_set(self.sptep(sptep), spte, meter);
        self.add_parent_pte(cache, child, sptep, meter);
        let c = self.sp(child);
        if c.unsync_children > 0 || c.unsync {
            self.mark_unsync(sptep);
        }
    }

    // --- zapping --------------------------------------------------------------------

    /// `mmu_page_zap_pte()`: clears entry `index` of `id`. A child page is zapped with it only
    /// in KVM's nested-TDP case (`tdp_enabled && child->role.guest_mode && no parent left`),
    /// which never arises here; otherwise it stays, unlinked, until reused or reclaimed.
    /// Returns the number of pages zapped.
    pub fn zap_pte(
        &mut self,
        id: SpId,
        index: usize,
        invalid_list: Option<&mut Vec<SpId>>,
        pages: &PageStats,
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
            self.drop_spte(sptep, pages, meter);
            return 0;
        }
        let child = self.spte_to_child_sp(pte);
        self.drop_parent_pte(child, sptep, meter);
        let c = self.sp(child);
        if let Some(list) = invalid_list {
            if self.tdp_enabled && c.role.guest_mode() && c.parent_ptes.is_empty() {
                return self.prepare_zap_page(child, list, pages, meter).1;
            }
        }
        0
    }

    /// `kvm_mmu_unlink_parents()`.
    fn unlink_parents(&mut self, id: SpId, meter: &mut Meter) {
        while let Some(p) = self.sp(id).parent_ptes.iter().next() {
            self.drop_parent_pte(id, p, meter);
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

    /// `mmu_zap_unsync_children()`: zaps the unsync pages below `id` (found through the unsync
    /// bitmaps). Returns how many were zapped.
    fn zap_unsync_children(
        &mut self,
        id: SpId,
        invalid_list: &mut Vec<SpId>,
        pages: &PageStats,
        meter: &mut Meter,
    ) -> u64 {
        if self.sp(id).role.level() == PG_LEVEL_4K {
            return 0;
        }
        let mut zapped = 0;
        for child in self.unsync_descendants(id) {
            if self.sps[child.0 as usize].is_some() && !self.sp(child).role.invalid() {
                zapped += self.prepare_zap_page(child, invalid_list, pages, meter).1;
            }
        }
        zapped
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

    /// `__kvm_mmu_prepare_zap_page()`: unlinks `id` from its children and parents, marks it
    /// invalid and moves it to `invalid_list` (a root stays until its last user lets go).
    /// Returns (the active list became unstable, pages zapped).
    pub fn prepare_zap_page(
        &mut self,
        id: SpId,
        invalid_list: &mut Vec<SpId>,
        pages: &PageStats,
        meter: &mut Meter,
    ) -> (bool, u64) {
        meter.sp_zapped += 1;
        self.mmu_shadow_zapped += 1;
        let mut nr_zapped = self.zap_unsync_children(id, invalid_list, pages, meter);
        for i in 0..SPTE_ENT_PER_PAGE {
            nr_zapped += self.zap_pte(id, i, Some(invalid_list), pages, meter);
        }
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
            invalid_list.push(id);
        }
        self.sp_mut(id).role.set_invalid_bit(1);
        (list_unstable, nr_zapped)
    }

    /// `kvm_mmu_commit_zap_page()`: one remote flush (which also waits out lockless walkers in
    /// KVM; here RCU does that), then the pages are freed.
    pub fn commit_zap_page(&mut self, kvm: &Kvm, invalid_list: &mut Vec<SpId>, meter: &mut Meter) {
        if invalid_list.is_empty() {
            return;
        }
        kvm.flush_remote_tlbs(meter);
        for id in invalid_list.drain(..) {
            self.free_shadow_page(id, meter);
        }
    }

    /// `kvm_mmu_remote_flush_or_zap()`: commit the list if it has pages, else flush if asked.
    /// Returns whether anything happened.
    pub fn remote_flush_or_zap(
        &mut self,
        kvm: &Kvm,
        invalid_list: &mut Vec<SpId>,
        flush: bool,
        meter: &mut Meter,
    ) -> bool {
        if !invalid_list.is_empty() {
            self.commit_zap_page(kvm, invalid_list, meter);
            return true;
        }
        if flush {
            kvm.flush_remote_tlbs(meter);
        }
        flush
    }

    /// `kvm_mmu_zap_oldest_mmu_pages()`: zaps unrooted pages from the old end of the active
    /// list until `nr_to_zap` are gone. Returns how many were zapped.
    pub fn zap_oldest_mmu_pages(
        &mut self,
        kvm: &Kvm,
        nr_to_zap: u64,
        pages: &PageStats,
        meter: &mut Meter,
    ) -> u64 {
        let mut invalid_list = Vec::new();
        let mut total = 0;
        'restart: loop {
            for id in self.active_list_oldest_first() {
                if self.sps[id.0 as usize].is_none() {
                    continue;
                }
                let sp = self.sp(id);
                if sp.root_count > 0 || sp.role.invalid() {
                    continue;
                }
                let (unstable, n) = self.prepare_zap_page(id, &mut invalid_list, pages, meter);
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
        self.commit_zap_page(kvm, &mut invalid_list, meter);
        total
    }

    /// `make_mmu_pages_available()`: before a fault allocates, make sure a few pages are free,
    /// zapping the oldest if needed.
    pub fn make_mmu_pages_available(
        &mut self,
        kvm: &Kvm,
        pages: &PageStats,
        meter: &mut Meter,
    ) -> Result<(), Errno> {
        let avail = self.available_pages();
        if avail >= KVM_MIN_FREE_MMU_PAGES {
            return Ok(());
        }
        self.zap_oldest_mmu_pages(kvm, KVM_REFILL_PAGES - avail, pages, meter);
        if self.available_pages() == 0 {
            return Err(Errno::NoSpace);
        }
        Ok(())
    }

    /// `kvm_mmu_change_mmu_pages()`: sets the quota, zapping the oldest pages above it.
    pub fn change_mmu_pages(&mut self, kvm: &Kvm, goal: u64, pages: &PageStats, meter: &mut Meter) {
        let mut goal = goal;
        if self.n_used_mmu_pages > goal {
            let n = self.n_used_mmu_pages - goal;
            self.zap_oldest_mmu_pages(kvm, n, pages, meter);
            goal = self.n_used_mmu_pages;
        }
        self.n_max_mmu_pages = goal;
    }

    /// Frees every page (VM teardown, `kvm_mmu_zap_all()` without the flush: nobody runs).
    pub fn teardown(&mut self, pages: &PageStats) {
        let mut meter = Meter::default();
        if let Some(root) = self.root.take() {
            self.sp_mut(root).root_count = 0;
        }
        let mut invalid_list = Vec::new();
        let ids: Vec<SpId> = self.live_sps().map(|(id, _)| id).collect();
        for id in ids {
            if self.sps[id.0 as usize].is_some() && !self.sp(id).role.invalid() {
                self.prepare_zap_page(id, &mut invalid_list, pages, &mut meter);
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
    }
}
