//! The x86 shadow MMU (`arch/x86/kvm/mmu/mmu.c` without the TDP MMU): what KVM uses with
//! `tdp_mmu=N`, for shadow paging (`ept=N`) and for nested guests.
//!
//! - **Direct mode** (EPT on, `tdp_mmu=N`): shadow pages map guest physical memory; faults run
//!   under `mmu_lock` held for write after a lockless `fast_page_fault()`; dirty logging
//!   write-protects through the memslot rmaps.
//! - **Indirect mode** (shadow paging, EPT off): shadow pages shadow the guest's own page
//!   tables ([`paging`]); faults walk the guest tables first, guest table pages are
//!   write-protected, and last-level ones may go unsync until the guest flushes its TLB.
//!
//! The state `mmu_lock` protects lives in [`state::ShadowState`], behind a mutex that is only
//! ever taken with `mmu_lock` held for write (so it is never contended): Rust's way of saying
//! "this data belongs to the write lock". Lockless readers (the hardware walk and
//! `fast_page_fault()`) only touch page tables, which are freed through RCU.
//!
//! Simplifications, each keeping KVM's locking, ordering and flush rules:
//! - One root shared by every vCPU (they all use the same root role, and in indirect mode the
//!   same guest CR3), held with one `root_count`.
//! - `kvm_mmu_zap_memslot()` serves memslot deletion (KVM's default quirk zaps everything with
//!   `kvm_mmu_zap_all_fast()` instead); there are no MMU notifiers, NX huge pages, MMIO SPTEs,
//!   access tracking or PML, and no nested guests (so `role.guest_mode` is never set).
//! - Page headers come with their table from the shadow-page cache, and `shadowed_translation`
//!   arrays are allocated in place rather than from `mmu_shadowed_info_cache`.

pub mod invariants;
pub mod jobs;
pub mod mmu_page;
pub mod pages;
pub mod paging;
pub mod rmap;
pub mod slot_rmap;
pub mod spte;
pub mod state;
pub mod unsync;
pub mod write_track;
pub mod zap;

use crate::hw::page_table::{PageTable, PageTableStats};
use crate::hw::walker::{walk, WalkResult};
use crate::kvm::memory_cache::{MmuMemoryCache, KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE};
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{FaultStart, GuestFault, Mmu, MmuJob, RetPf, VcpuMmu};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::mmu::{KvmPageFault, VcpuMmuCaches, X86Mmu};
use crate::x86::spte::*;
use crossbeam_epoch::Guard;
use mmu_page::*;
use pages::*;
use parking_lot::{Mutex, MutexGuard};
use rmap::{PteListDescCache, SPLIT_DESC_CACHE_MIN_NR_OBJECTS};
use spte::*;
use state::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The caches eager splitting allocates from (`kvm->arch.split_*_cache`), protected by
/// `slots_lock` in KVM (only the VMM thread splits), topped up with `mmu_lock` dropped.
pub struct SplitCaches {
    /// `split_desc_cache`: 513 descriptors are enough for any single split.
    pub desc: PteListDescCache,
    /// `split_shadow_page_cache` (with `split_page_header_cache`).
    pub shadow_page: MmuMemoryCache,
}

/// The shared part of the shadow MMU.
pub struct ShadowInner {
    state: Mutex<ShadowState>,
    /// The root table's address for lockless walkers (0: no root yet).
    root_table: AtomicU64,
    /// `tdp_enabled`: EPT on, direct mode.
    pub tdp_enabled: bool,
    /// Leaves per level, shared with [`ShadowState::pages`] so they can be read without the
    /// lock.
    pub pages: Arc<PageStats>,
    /// The split caches.
    pub split_caches: Mutex<SplitCaches>,
    /// Eager splits refused because at most `KVM_MIN_FREE_MMU_PAGES` pages were free.
    pub split_refused_enospc: AtomicU64,
    /// Shadow paging: the guest's CR3 (`u64::MAX` until the guest loads one).
    guest_cr3: AtomicU64,
    tables: Arc<PageTableStats>,
}

impl ShadowInner {
    /// The state `mmu_lock` protects; `held` must be the write lock.
    pub fn lock_state(&self, held: &MmuLockHeld) -> MutexGuard<'_, ShadowState> {
        held.assert_write();
        self.state
            .try_lock()
            .expect("mmu_lock is held for write, so nobody else holds the shadow MMU state")
    }

    /// The state, for a caller that knows no other actor runs (invariant checks, teardown).
    fn lock_state_quiescent(&self) -> MutexGuard<'_, ShadowState> {
        self.state.lock()
    }

    fn publish_root(&self, st: &ShadowState) {
        let addr = st.root.map_or(0, |r| st.sp(r).spt as u64);
        // Release pairs with the Acquire in root(): a walker that sees the new root sees its
        // initialised entries.
        self.root_table.store(addr, Ordering::Release);
    }

    /// The root table under `guard`.
    fn root<'g>(&self, _guard: &'g Guard) -> Option<&'g PageTable> {
        let addr = self.root_table.load(Ordering::Acquire);
        // SAFETY: a published root is a live table; a root replaced later is freed through RCU
        // after it is unpublished, so it outlives `_guard`.
        (addr != 0).then(|| unsafe { &*(addr as *const PageTable) })
    }
}

impl crate::x86::fast_page_fault::LastSptepWalk for ShadowInner {
    fn get_last_sptep<'g>(
        &'g self,
        gfn: Gfn,
        guard: &'g Guard,
        meter: &mut Meter,
    ) -> Option<(&'g AtomicU64, u64, Level)> {
        let root = self.root(guard)?;
        // SAFETY: the root is live under `guard` (see ShadowInner::root).
        Some(unsafe {
            crate::x86::fast_page_fault::walk_shadow_page_lockless(
                root,
                SHADOW_ROOT_LEVEL,
                gfn,
                guard,
                meter,
            )
        })
    }
}

/// The shadow MMU of one VM.
pub struct ShadowMmu {
    inner: Arc<ShadowInner>,
}

/// The root level: 4-level EPT and 4-level guest paging.
pub const SHADOW_ROOT_LEVEL: Level = PT64_ROOT_4LEVEL;

impl ShadowMmu {
    /// A shadow MMU. With `tdp_enabled` (EPT on) it maps guest physical memory directly and
    /// allocates its root now (`mmu_alloc_direct_roots()`); without, the root shadows the
    /// guest's CR3 and is allocated by [`ShadowMmu::set_guest_cr3`].
    pub fn new(kvm: &Kvm, tdp_enabled: bool) -> Self {
        let pages: Arc<PageStats> = Default::default();
        let inner = Arc::new(ShadowInner {
            state: Mutex::new(ShadowState::new(
                Arc::clone(&kvm.tables),
                Arc::clone(&pages),
                tdp_enabled,
            )),
            root_table: AtomicU64::new(0),
            tdp_enabled,
            pages,
            split_caches: Mutex::new(SplitCaches {
                desc: PteListDescCache::new(
                    SPLIT_DESC_CACHE_MIN_NR_OBJECTS + KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE,
                ),
                shadow_page: MmuMemoryCache::new(
                    KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE,
                    crate::x86::spte::SHADOW_NONPRESENT_VALUE,
                ),
            }),
            split_refused_enospc: AtomicU64::new(0),
            guest_cr3: AtomicU64::new(u64::MAX),
            tables: Arc::clone(&kvm.tables),
        });
        let mmu = ShadowMmu { inner };
        if tdp_enabled {
            let held = kvm.mmu_lock.lock(LockMode::Write);
            let mut role = KvmMmuPageRole::default();
            role.set_level(SHADOW_ROOT_LEVEL);
            role.set_direct_bit(1);
            role.set_access(ACC_ALL as u32);
            role.set_cr0_wp(1);
            mmu.alloc_root(kvm, &held, Gfn(0), role, &mut Meter::default());
        }
        mmu
    }

    /// The shared state.
    pub fn inner(&self) -> &Arc<ShadowInner> {
        &self.inner
    }

    /// `mmu_alloc_root()`: gets (or finds) the page for (`gfn`, `role`) and takes a root
    /// reference on it; it becomes the root every vCPU walks.
    fn alloc_root(
        &self,
        kvm: &Kvm,
        held: &MmuLockHeld,
        gfn: Gfn,
        role: KvmMmuPageRole,
        meter: &mut Meter,
    ) {
        let mut st = self.inner.lock_state(held);
        let mut cache = MmuMemoryCache::new(1, crate::x86::spte::SHADOW_NONPRESENT_VALUE);
        meter.tables_allocated += cache.topup(1, &kvm.tables) as u64;
        mmu_alloc_root(
            &mut LockedMmu::new(kvm, &mut st, meter),
            &self.inner,
            &mut cache,
            gfn,
            role,
        );
        cache.free_all(&kvm.tables);
    }

    /// Shadow paging: the guest loaded `cr3` (a 4-level table at that guest physical address).
    /// Loads the matching root (`kvm_mmu_new_pgd()`; a new root shadows the new table).
    pub fn set_guest_cr3(&self, kvm: &Kvm, cr3: Gpa, meter: &mut Meter) {
        assert!(
            !self.inner.tdp_enabled,
            "CR3 is the guest's own with EPT on"
        );
        self.inner.guest_cr3.store(cr3.0, Ordering::Release);
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let mut role = KvmMmuPageRole::default();
        role.set_level(SHADOW_ROOT_LEVEL);
        role.set_access(ACC_ALL as u32);
        role.set_cr0_wp(1);
        role.set_efer_nx(1);
        self.alloc_root(kvm, &held, cr3.to_gfn(), role, meter);
        // The same CR3 loaded again is also a TLB flush: sync what went unsync.
        paging::sync_roots(&self.inner, kvm, &held, meter);
    }

    /// Shadow paging: the guest flushed its TLB (INVLPG, or a CR3 load of the same table):
    /// `kvm_mmu_sync_roots()` under the write lock.
    pub fn guest_tlb_flush(&self, kvm: &Kvm, meter: &mut Meter) {
        let held = kvm.mmu_lock.lock(LockMode::Write);
        paging::sync_roots(&self.inner, kvm, &held, meter);
    }

    /// `KVM_SET_NR_MMU_PAGES`: sets the page quota (zapping the oldest pages above it); it
    /// then no longer follows the memslots.
    pub fn set_nr_mmu_pages(&self, kvm: &Kvm, n: u64) -> Result<(), String> {
        if n < KVM_MIN_ALLOC_MMU_PAGES {
            return Err(format!("KVM_SET_NR_MMU_PAGES {n}: the quota must be at least {KVM_MIN_ALLOC_MMU_PAGES} pages"));
        }
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let mut st = self.inner.lock_state(&held);
        st.n_requested_mmu_pages = n;
        LockedMmu::new(kvm, &mut st, &mut Meter::default()).change_mmu_pages(n);
        Ok(())
    }

    /// Shadow paging: the CR3 the guest loaded.
    pub fn guest_cr3(&self) -> Option<Gpa> {
        paging::guest_cr3(&self.inner)
    }
}

/// `mmu_free_root_page()`: drops a root reference; a root zapped while in use is freed with its
/// last reference.
fn put_root(mmu: &mut LockedMmu<'_>, root: SpId) {
    let sp = mmu.st.sp_mut(root);
    sp.root_count -= 1;
    if sp.root_count == 0 && sp.role.invalid() {
        let mut list = Vec::new();
        mmu.st.prepare_zap_page(root, &mut list, mmu.meter);
        mmu.commit_zap_page(&mut list);
    }
}

/// `mmu_alloc_root()`: gets (or finds, syncing it if unsync) the page for (`gfn`, `role`) from
/// `cache`, takes a root reference on it, puts the old root and publishes the new one for
/// lockless walkers.
pub(crate) fn mmu_alloc_root(
    mmu: &mut LockedMmu<'_>,
    inner: &ShadowInner,
    cache: &mut MmuMemoryCache,
    gfn: Gfn,
    role: KvmMmuPageRole,
) -> SpId {
    let (root, _) = mmu.get_shadow_page(cache, gfn, role, true);
    mmu.st.sp_mut(root).root_count += 1;
    if let Some(old) = mmu.st.root.replace(root) {
        put_root(mmu, old);
    }
    inner.publish_root(mmu.st);
    root
}

/// `kvm_mmu_hugepage_adjust()`'s shadow part: a level a last-level guest table forbids is
/// lowered (`lpage_info.disallow_lpage`).
fn adjust_goal_level(st: &ShadowState, gfn: Gfn, mut level: Level) -> Level {
    while level > PG_LEVEL_4K && st.lpage_disallowed(gfn, level) {
        level = level.below();
    }
    level
}

/// `mmu_set_spte()`: installs the leaf for `gfn` (`pfn`, `pte_access`) at entry `index` of
/// page `id`, replacing a non-leaf or a leaf with another PFN, and adds it to the rmap.
/// `fault` is `None` for a prefetch.
pub(crate) fn mmu_set_spte(
    mmu: &mut LockedMmu<'_>,
    desc_cache: &mut PteListDescCache,
    slot: &Memslot,
    id: SpId,
    index: usize,
    pte_access: u8,
    gfn: Gfn,
    pfn: Pfn,
    fault: Option<&KvmPageFault>,
) -> RetPf {
    let level = mmu.st.sp(id).role.level();
    let sptep = SptepRef::new(id, index);
    let host_writable = fault.is_none_or(|f| f.map_writable);
    let prefetch = fault.is_none();
    let write_fault = fault.is_some_and(|f| f.write);
    let logging = fault.map_or(slot.dirty_track_enabled(), |f| f.dirty_logging);
    let mut was_rmapped = false;
    let mut flush = false;
    let old = SpteCell::load(mmu.st.sptep(sptep));
    if is_shadow_present_pte(old) {
        if prefetch && is_last_spte(old, level) && pfn == spte_to_pfn(old) {
            return RetPf::Spurious;
        }
        if level > PG_LEVEL_4K && !is_large_pte(old) {
            // A huge leaf replaces a table: unlink the now unreachable child page.
            let child = mmu.st.spte_to_child_sp(old);
            mmu.st.drop_parent_pte(child, sptep, mmu.meter);
            flush = true;
        } else if pfn != spte_to_pfn(old) {
            mmu.st.drop_spte(sptep, mmu.meter);
            flush = true;
        } else {
            was_rmapped = true;
        }
    }
    let cur = SpteCell::load(mmu.st.sptep(sptep));
    let (spte, wrprot) = make_shadow_spte(
        mmu,
        slot,
        level,
        pte_access,
        gfn,
        pfn,
        cur,
        prefetch,
        false,
        host_writable,
        logging,
        fault.map(|f| f.vcpu),
    );
    let mut ret = if cur == spte {
        RetPf::Spurious
    } else {
        flush |= mmu_spte_update(mmu.st.sptep(sptep), spte, mmu.meter);
        RetPf::Fixed
    };
    if wrprot && write_fault {
        ret = RetPf::Emulated;
    }
    if flush {
        crate::x86::mmu::kvm_flush_remote_tlbs_gfn(mmu.kvm, gfn, level, mmu.meter);
    }
    if !was_rmapped {
        mmu.rmap_add(desc_cache, slot, id, index, gfn, pte_access);
    } else {
        // Already mapped, but the access may have changed (kvm_mmu_page_set_access()).
        mmu.st.sp_mut(id).set_translation(index, gfn, pte_access);
    }
    if ret == RetPf::Fixed && !prefetch {
        match level {
            PG_LEVEL_4K => mmu.meter.pf_map_4k += 1,
            PG_LEVEL_2M => mmu.meter.pf_map_2m += 1,
            _ => mmu.meter.pf_map_1g += 1,
        }
    }
    ret
}

/// `direct_pte_prefetch()`: after a 4K fault on entry `index` of the direct page `id`, maps the
/// other non-present entries of its aligned group of `PTE_PREFETCH_NUM` speculatively (without
/// the Accessed bit), unless the memory logs dirty pages: a prefetched writable leaf would
/// dirty a page the guest never wrote.
pub(crate) fn direct_pte_prefetch(
    mmu: &mut LockedMmu<'_>,
    desc_cache: &mut PteListDescCache,
    id: SpId,
    index: usize,
) {
    let sp = mmu.st.sp(id);
    if sp.role.level() > PG_LEVEL_4K || !sp.role.direct() || sp.role.ad_disabled() != 0 {
        return;
    }
    let first = index & !(rmap::PTE_PREFETCH_NUM - 1);
    let mut run: Option<usize> = None;
    for i in first..=first + rmap::PTE_PREFETCH_NUM {
        let stop = i == first + rmap::PTE_PREFETCH_NUM
            || i == index
            || is_shadow_present_pte(SpteCell::load(mmu.st.sptep(SptepRef::new(id, i))));
        if !stop {
            run.get_or_insert(i);
            continue;
        }
        let Some(start) = run.take() else {
            continue;
        };
        // direct_pte_prefetch_many()
        let access = mmu.st.sp(id).role.access() as u8;
        let gfn = mmu.st.sp(id).get_gfn(start);
        let Some(slot) = mmu.kvm.slot_by_gfn(gfn) else {
            return;
        };
        let readonly = slot.flags() & crate::kvm::memslot::KVM_MEM_READONLY != 0;
        if readonly || (access & ACC_WRITE_MASK != 0 && slot.dirty_track_enabled()) {
            return;
        }
        // kvm_prefetch_pages() maps nothing when the run does not fit in the memslot.
        if !slot.contains(mmu.st.sp(id).get_gfn(i - 1)) {
            return;
        }
        for j in start..i {
            let g = mmu.st.sp(id).get_gfn(j);
            mmu_set_spte(
                mmu,
                desc_cache,
                &slot,
                id,
                j,
                access,
                g,
                slot.gfn_to_pfn(g),
                None,
            );
        }
    }
}

/// `make_spte()` for the shadow MMU: the leaf for `pfn` with `pte_access`. A writable mapping
/// of a gfn that holds a shadowed guest table is refused (`mmu_try_to_unsync_pages()` fails:
/// the gfn is write-tracked, or its last-level page cannot go unsync) and the returned
/// `wrprot` is true. A writable leaf in a logging slot marks the page dirty.
// KVM's make_spte() takes the same inputs one by one.
#[allow(clippy::too_many_arguments)]
pub(crate) fn make_shadow_spte(
    mmu: &mut LockedMmu<'_>,
    slot: &Memslot,
    level: Level,
    pte_access: u8,
    gfn: Gfn,
    pfn: Pfn,
    old_spte: u64,
    prefetch: bool,
    synchronizing: bool,
    host_writable: bool,
    logging: bool,
    vcpu: Option<usize>,
) -> (u64, bool) {
    let mut spte = make_spte(level, pfn, host_writable, prefetch);
    // make_spte() sets W, MMU-writable and D whenever the host page is writable; the shadow
    // MMU grants W only when the guest's access allows it.
    let mut wrprot = false;
    let mut writable = host_writable && pte_access & ACC_WRITE_MASK != 0;
    if pte_access & ACC_EXEC_MASK == 0 {
        spte &= !VMX_EPT_EXECUTABLE_MASK;
    }
    // Only if the old leaf was not already writable: then any relevant page is unsync already
    // and the hash lookup can be skipped.
    if writable
        && !(is_shadow_present_pte(old_spte) && is_writable_pte(old_spte))
        && paging::mmu_try_to_unsync_pages(mmu.st, gfn, synchronizing, prefetch, mmu.meter).is_err()
    {
        wrprot = true;
        writable = false;
    }
    if !writable {
        spte &= !(PT_WRITABLE_MASK | EPT_SPTE_MMU_WRITABLE | SHADOW_DIRTY_MASK);
    }
    if spte & PT_WRITABLE_MASK != 0 {
        debug_assert!(
            !logging || level == PG_LEVEL_4K,
            "a writable huge leaf in a logged slot"
        );
        mmu.kvm
            .mark_page_dirty_in_slot(slot, gfn, logging, vcpu, mmu.meter);
    }
    (spte, wrprot)
}

impl ShadowMmu {
    /// `direct_page_fault()` under the write lock: `make_mmu_pages_available()`, then
    /// `direct_map()`: walk from the root, creating (or finding) a direct page below every
    /// level above the goal, then install the leaf.
    fn direct_page_fault(
        &self,
        kvm: &Kvm,
        fault: &KvmPageFault,
        held: &MmuLockHeld,
        caches: &mut VcpuMmuCaches,
        meter: &mut Meter,
    ) -> RetPf {
        let inner = &self.inner;
        let mut st = inner.lock_state(held);
        let mut mmu = LockedMmu::new(kvm, &mut st, meter);
        if mmu.make_mmu_pages_available().is_err() {
            return RetPf::NoSpace;
        }
        let Some(root) = mmu.st.root else {
            return RetPf::Retry;
        };
        let goal_level = adjust_goal_level(mmu.st, fault.gfn, fault.goal_level);
        direct_map(
            &mut mmu,
            caches,
            fault,
            (root, SHADOW_ROOT_LEVEL),
            goal_level,
            ACC_ALL,
        )
    }
}

/// `direct_map()`, and the second loop of `FNAME(fetch)` below a guest huge page: from the
/// page and level `from` down to `goal_level`, finds or creates a direct page of `access`
/// below each level (a table of other access is dropped first, `validate_direct_spte()`; a
/// huge leaf in the way is split by the link), installs the leaf and prefetches its
/// neighbours.
pub(crate) fn direct_map(
    mmu: &mut LockedMmu<'_>,
    caches: &mut VcpuMmuCaches,
    fault: &KvmPageFault,
    from: (SpId, Level),
    goal_level: Level,
    access: u8,
) -> RetPf {
    let (mut id, mut level) = from;
    loop {
        mmu.meter.spte_reads += 1;
        let index = fault.addr.spte_index(level);
        let base_gfn = fault.gfn.round_for_level(level);
        if level == goal_level {
            let pfn = fault.slot.gfn_to_pfn(base_gfn);
            let r = mmu_set_spte(
                mmu,
                &mut caches.pte_list_desc_cache,
                &fault.slot,
                id,
                index,
                access,
                base_gfn,
                pfn,
                Some(fault),
            );
            if r != RetPf::Spurious {
                direct_pte_prefetch(mmu, &mut caches.pte_list_desc_cache, id, index);
            }
            return r;
        }
        let sptep = SptepRef::new(id, index);
        let spte = SpteCell::load(mmu.st.sptep(sptep));
        if is_shadow_present_pte(spte) && !is_large_pte(spte) {
            let child = mmu.st.spte_to_child_sp(spte);
            if mmu.st.sp(child).role.access() as u8 == access {
                id = child;
                level = level.below();
                continue;
            }
            mmu.st.drop_parent_pte(child, sptep, mmu.meter);
            crate::x86::mmu::kvm_flush_remote_tlbs_gfn(mmu.kvm, base_gfn, level, mmu.meter);
        }
        let Ok(child) = mmu.get_child_sp(
            &mut caches.shadow_page_cache,
            id,
            index,
            base_gfn,
            true,
            access,
            false,
        ) else {
            unreachable!("no table is linked here any more");
        };
        if is_large_pte(spte) {
            // A huge leaf is split by the fault: link_shadow_page() drops it and flushes.
            mmu.meter.split_in_fault += 1;
        }
        mmu.link_shadow_page(&mut caches.pte_list_desc_cache, id, index, child, true);
        id = child;
        level = level.below();
    }
}

impl Mmu for ShadowMmu {
    fn name(&self) -> &'static str {
        "shadow"
    }

    fn hw_walk(&self, gfn: Gfn, write: bool, guard: &Guard, levels_read: &mut u64) -> WalkResult {
        match self.inner.root(guard) {
            // SAFETY: the root is live under `guard` (see ShadowInner::root) and the caller
            // keeps `guard` pinned for the whole walk.
            Some(root) => unsafe { walk(root, SHADOW_ROOT_LEVEL, gfn, write, guard, levels_read) },
            None => WalkResult::Violation {
                level: SHADOW_ROOT_LEVEL,
                spte: SHADOW_NONPRESENT_VALUE,
                present: false,
            },
        }
    }

    fn create_vcpu_mmu(&self) -> Box<dyn VcpuMmu> {
        crate::x86::mmu::create_vcpu_mmu()
    }

    fn begin_fault(
        &self,
        kvm: &Kvm,
        vcpu_mmu: &mut dyn VcpuMmu,
        exit: &GuestFault,
        meter: &mut Meter,
    ) -> Result<FaultStart, String> {
        crate::x86::mmu::kvm_mmu_begin_fault(self, kvm, vcpu_mmu, exit, meter)
    }

    fn page_fault(
        &self,
        kvm: &Kvm,
        vcpu_mmu: &mut dyn VcpuMmu,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> RetPf {
        crate::x86::mmu::kvm_mmu_slow_page_fault(self, kvm, vcpu_mmu, held, meter)
    }

    fn zap_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        // kvm_mmu_zap_memslot(): unmap every leaf of the range (kvm_unmap_gfn_range() ->
        // kvm_zap_rmap() at every level), then zap every shadow page whose gfn is in it.
        let inner = &self.inner;
        let mut st = inner.lock_state(held);
        let mut flush = false;
        for level in [PG_LEVEL_4K, PG_LEVEL_2M, PG_LEVEL_1G] {
            let mut gfn = start.round_for_level(level);
            while gfn < end {
                flush |= st.zap_rmap(gfn.max(start), level, meter);
                gfn = Gfn(gfn.0 + level.pages());
            }
        }
        // kvm_mmu_zap_memslot_pages_and_flush(): only pages shadowing guest tables on the
        // slot's gfns go; direct pages stay (empty now), as they do in KVM. A zapped root
        // stays until put, and the next fault loads a new one (ensure_root()).
        let mut invalid_list = Vec::new();
        let victims: Vec<SpId> = st
            .live_sps()
            .filter(|(_, sp)| {
                sp.has_gptes() && sp.gfn >= start && sp.gfn < end && !st.is_obsolete_sp(sp)
            })
            .map(|(id, _)| id)
            .collect();
        for id in victims {
            if !st.sp(id).role.invalid() {
                st.prepare_zap_page(id, &mut invalid_list, meter);
            }
        }
        // kvm_mmu_remote_flush_or_zap() flushed what it zapped: the caller owes nothing.
        LockedMmu::new(kvm, &mut st, meter).remote_flush_or_zap(&mut invalid_list, flush);
        None
    }

    fn check_invariants(&self, kvm: &Kvm) -> Vec<String> {
        invariants::check(&self.inner, kvm)
    }

    fn page_stats(&self) -> [i64; 3] {
        [0, 1, 2].map(|i| self.inner.pages[i].load(Ordering::Relaxed))
    }

    fn commit_memory_region(&self, kvm: &Kvm) {
        let slots = kvm.all_slots();
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let mut st = self.inner.lock_state(&held);
        let mut meter = Meter::default();
        // Drop the rmaps of slots that no longer exist (kvm_arch_free_memslot()); they are
        // empty because the slot was zapped before it was deleted.
        let live: Vec<u64> = slots.iter().map(|s| s.base_gfn.0).collect();
        let gone: Vec<u64> = st
            .rmaps
            .keys()
            .copied()
            .filter(|k| !live.contains(k))
            .collect();
        for k in gone {
            let mut r = st.rmaps.remove(&k).expect("listed");
            for level in r.rmap.iter_mut() {
                for h in level.iter_mut() {
                    debug_assert!(
                        h.is_empty(),
                        "rmap of a deleted memslot still maps something"
                    );
                    rmap::pte_list_free(h);
                }
            }
        }
        for s in &slots {
            st.slot_rmaps(s);
        }
        if st.n_requested_mmu_pages == 0 {
            let nr_pages: u64 = slots.iter().map(|s| s.npages).sum();
            LockedMmu::new(kvm, &mut st, &mut meter).change_mmu_pages(default_mmu_pages(nr_pages));
        }
    }

    fn mmu_stats(&self) -> Vec<(&'static str, u64)> {
        let st = self.inner.lock_state_quiescent();
        vec![
            ("mmu_pages_used", st.n_used_mmu_pages),
            ("mmu_pages_max", st.n_max_mmu_pages),
            ("mmu_shadow_zapped", st.mmu_shadow_zapped),
            ("mmu_cache_miss", st.mmu_cache_miss),
            ("mmu_unsync", st.mmu_unsync),
            ("max_mmu_rmap_size", st.max_mmu_rmap_size),
            (
                "split_refused_enospc",
                self.inner.split_refused_enospc.load(Ordering::Relaxed),
            ),
        ]
    }
}

impl X86Mmu for ShadowMmu {
    fn fast_page_fault(&self, kvm: &Kvm, fault: &KvmPageFault, meter: &mut Meter) -> RetPf {
        // Shadow paging has no fast path (FNAME(page_fault) never calls it): an indirect
        // page's gfn is not stable without the lock.
        if !self.inner.tdp_enabled {
            return RetPf::Continue;
        }
        let inner = &self.inner;
        crate::x86::fast_page_fault::fast_page_fault(kvm, fault, meter, &**inner)
    }

    fn walk_guest(
        &self,
        kvm: &Kvm,
        addr: Gfn,
        write: bool,
        meter: &mut Meter,
    ) -> Option<Result<crate::x86::guest_paging::GuestWalker, String>> {
        if self.inner.tdp_enabled {
            return None;
        }
        let Some(cr3) = paging::guest_cr3(&self.inner) else {
            return Some(Err("shadow paging: the guest has not loaded CR3".into()));
        };
        Some(
            crate::x86::guest_paging::walk_addr(
                kvm,
                cr3,
                addr.to_gpa().0,
                write,
                &mut meter.guest_pte_reads,
            )
            .map_err(|f| format!("{f} (the guest's own page faults are not modelled)")),
        )
    }

    fn fault_lock_mode(&self, _fault: &KvmPageFault) -> LockMode {
        LockMode::Write
    }

    fn slow_page_fault(
        &self,
        kvm: &Kvm,
        fault: &KvmPageFault,
        held: &MmuLockHeld,
        caches: &mut VcpuMmuCaches,
        meter: &mut Meter,
    ) -> RetPf {
        if self.inner.tdp_enabled {
            self.direct_page_fault(kvm, fault, held, caches, meter)
        } else {
            paging::page_fault(&self.inner, kvm, fault, held, caches, meter)
        }
    }

    fn try_split_huge_pages(
        &self,
        slot: &Arc<Memslot>,
        start: Gfn,
        end: Gfn,
        target_level: Level,
        _mode: LockMode,
    ) -> Box<dyn MmuJob> {
        // kvm_shadow_mmu_try_split_huge_pages(): always under the write lock (the enable path
        // takes it; the CLEAR path already holds it). This is seed 000's behaviour (v3 of
        // "Extend Eager Page Splitting to the shadow MMU"), which splits with tdp_mmu=N too;
        // upstream merged it for nested MMUs only: kvm_mmu_slot_try_split_huge_pages() and
        // kvm_mmu_try_split_huge_pages() return at once when the TDP MMU is off.
        Box::new(jobs::WalkSlotRmapsJob::split(
            Arc::clone(&self.inner),
            Arc::clone(slot),
            start,
            end,
            target_level,
        ))
    }

    fn slot_remove_write_access(&self, slot: &Arc<Memslot>, start_level: Level) -> Box<dyn MmuJob> {
        Box::new(jobs::WalkSlotRmapsJob::write_protect(
            Arc::clone(&self.inner),
            Arc::clone(slot),
            start_level,
        ))
    }

    fn slot_gfn_write_protect(
        &self,
        _kvm: &Kvm,
        _slot: &Memslot,
        gfn: Gfn,
        min_level: Level,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> bool {
        let mut st = self.inner.lock_state(held);
        st.gfn_write_protect(gfn, min_level, meter)
    }

    fn write_protect_pt_masked(
        &self,
        _kvm: &Kvm,
        slot: &Memslot,
        gfn_offset: u64,
        mask: u64,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> bool {
        let mut st = self.inner.lock_state(held);
        let mut flush = false;
        let mut mask = mask;
        while mask != 0 {
            let gfn = Gfn(slot.base_gfn.0 + gfn_offset + mask.trailing_zeros() as u64);
            flush |= st.rmap_write_protect(gfn, PG_LEVEL_4K, false, meter);
            mask &= mask - 1;
        }
        flush
    }

    fn recover_huge_pages(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob> {
        Box::new(jobs::WalkSlotRmapsJob::zap_collapsible(
            Arc::clone(&self.inner),
            Arc::clone(slot),
        ))
    }
}

impl Drop for ShadowInner {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        st.teardown();
        let sc = self.split_caches.get_mut();
        sc.desc.free_all();
        sc.shadow_page.free_all(&self.tables);
    }
}
