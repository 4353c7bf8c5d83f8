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
//!   `kvm_mmu_zap_all_fast()` instead, which [`ShadowMmu::set_slot_zap`] selects); there are no
//!   NX huge pages, MMIO SPTEs or access tracking (aging clears hardware Accessed bits).
//! - Nested guests ([`nested`]) have roots of their own per vCPU; L1's root is the one above.
//! - Page headers come with their table from the shadow-page cache, and `shadowed_translation`
//!   arrays are allocated in place rather than from `mmu_shadowed_info_cache`.

pub mod caches;
pub mod census;
pub mod fault;
pub mod inner;
pub mod invariants;
pub mod jobs;
pub mod mmu_page;
pub mod nested;
pub mod pages;
pub mod paging;
pub mod rmap;
pub mod root;
pub mod slot_rmap;
pub mod split;
pub mod spte;
pub mod sptep;
pub mod state;
pub mod unsync;
pub mod vcpu;
pub mod write_track;
pub mod zap;

use crate::hw::walker::{walk, WalkResult};
use crate::kvm::memory_cache::MmuMemoryCache;
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{Mmu, MmuJob, RetPf};
use crate::kvm::mmu_ctx::MmuCtx;
use crate::kvm::mmu_lock::{Held, LockMode, MmuLockHeld, Write};
use crate::kvm::vm_lines::VmLineWrites;
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::mmu::{GuestWalk, KvmPageFault, X86FaultPath, X86Mmu};
use crate::x86::shadow::vcpu::ShadowVcpuMmu;
use crate::x86::spte::*;
use caches::SplitCaches;
use crossbeam_epoch::{self as epoch, Guard};
pub use inner::{ShadowInner, SHADOW_ROOT_LEVEL};
use mmu_page::*;
use parking_lot::Mutex;
use state::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The shadow MMU of one VM.
pub struct ShadowMmu {
    inner: Arc<ShadowInner>,
}

/// `KVM_SET_NR_MMU_PAGES` below `KVM_MIN_ALLOC_MMU_PAGES`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KVM_SET_NR_MMU_PAGES {0}: the quota must be at least {KVM_MIN_ALLOC_MMU_PAGES} pages")]
pub struct QuotaTooSmall(pub u64);

impl ShadowMmu {
    /// A shadow MMU. With `tdp_enabled` (EPT on) it maps guest physical memory directly and
    /// allocates its root now (`mmu_alloc_direct_roots()`); without, the root shadows the
    /// guest's CR3 and is allocated by [`ShadowMmu::set_guest_cr3`].
    pub fn new(kvm: &Kvm, tdp_enabled: bool) -> Self {
        let pages: Arc<PageStats> = Default::default();
        let state = ShadowState::new(Arc::clone(&kvm.tables), Arc::clone(&pages), tdp_enabled);
        let inner = Arc::new(ShadowInner {
            state: Mutex::new(state),
            root_table: AtomicU64::new(0),
            tdp_enabled,
            pages,
            split_caches: Mutex::new(SplitCaches::new()),
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
            mmu.alloc_root(kvm, held.write(), Gfn(0), role, &mut Meter::default());
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
        held: Held<'_, Write>,
        gfn: Gfn,
        role: KvmMmuPageRole,
        meter: &mut Meter,
    ) {
        let mut st = self.inner.lock_state(held);
        let mut cache = MmuMemoryCache::new(1, crate::x86::spte::SHADOW_NONPRESENT_VALUE);
        meter.tables_allocated += cache.topup(1, &kvm.tables) as u64;
        root::mmu_alloc_root(
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
        self.alloc_root(kvm, held.write(), cr3.to_gfn(), role, meter);
        // The same CR3 loaded again is also a TLB flush: sync what went unsync.
        root::sync_roots(&self.inner, kvm, held.write(), meter);
    }

    /// Shadow paging: the guest flushed its TLB (INVLPG, or a CR3 load of the same table):
    /// `kvm_mmu_sync_roots()` under the write lock.
    pub fn guest_tlb_flush(&self, kvm: &Kvm, meter: &mut Meter) {
        let held = kvm.mmu_lock.lock(LockMode::Write);
        root::sync_roots(&self.inner, kvm, held.write(), meter);
    }

    /// `KVM_SET_NR_MMU_PAGES`: sets the page quota (zapping the oldest pages above it); it
    /// then no longer follows the memslots.
    pub fn set_nr_mmu_pages(&self, kvm: &Kvm, n: u64) -> Result<(), QuotaTooSmall> {
        if n < KVM_MIN_ALLOC_MMU_PAGES {
            return Err(QuotaTooSmall(n));
        }
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let mut st = self.inner.lock_state(held.write());
        st.n_requested_mmu_pages = n;
        LockedMmu::new(kvm, &mut st, &mut Meter::default()).change_mmu_pages(n);
        Ok(())
    }

    /// Seed 004's switch: what zapping a page does with the nested-TDP children it leaves
    /// without a parent. Set it before guests run.
    pub fn set_zap_orphans(&self, kvm: &Kvm, v: ZapOrphans) {
        let held = kvm.mmu_lock.lock(LockMode::Write);
        self.inner.lock_state(held.write()).zap_orphans = v;
    }

    /// A negative control: with `false`, guest tables KVM shadows from now on are neither
    /// write-protected nor tracked, so KVM misses the guest's writes to them (a broken KVM the
    /// oracles must catch). Never set in a real run.
    pub fn set_write_tracking(&self, kvm: &Kvm, on: bool) {
        let held = kvm.mmu_lock.lock(LockMode::Write);
        self.inner.lock_state(held.write()).write_tracking = on;
    }

    /// What deleting a memslot zaps from now on (`KVM_X86_QUIRK_SLOT_ZAP_ALL`).
    pub fn set_slot_zap(&self, kvm: &Kvm, v: SlotZap) {
        let held = kvm.mmu_lock.lock(LockMode::Write);
        self.inner.lock_state(held.write()).slot_zap = v;
    }

    /// A census of the shadow pages: reachable, stale, orphaned, and the longest hash chain and
    /// rmap. For reports between phases (takes the state quiescent).
    pub fn census(&self) -> census::PageCensus {
        self.inner.lock_state_quiescent().census()
    }

    /// Shadow paging: the CR3 the guest loaded.
    pub fn guest_cr3(&self) -> Option<Gpa> {
        paging::guest_cr3(&self.inner)
    }
}

impl Mmu for ShadowMmu {
    fn name(&self) -> &'static str {
        "shadow"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn hw_walk(
        &self,
        gfn: Gfn,
        write: bool,
        pml_full: bool,
        guard: &Guard,
        levels_read: &mut u64,
    ) -> WalkResult {
        match self.inner.root(guard) {
            // SAFETY: the root is live under `guard` (see ShadowInner::root) and the caller
            // keeps `guard` pinned for the whole walk.
            Some(root) => unsafe {
                walk(
                    root,
                    SHADOW_ROOT_LEVEL,
                    gfn,
                    write,
                    pml_full,
                    guard,
                    levels_read,
                )
            },
            None => WalkResult::Violation {
                level: SHADOW_ROOT_LEVEL,
                present: false,
                access_flag: false,
            },
        }
    }

    unsafe fn hw_walk_nested(
        &self,
        root_table: u64,
        gfn: Gfn,
        write: bool,
        guard: &Guard,
        levels_read: &mut u64,
    ) -> WalkResult {
        // SAFETY: the caller's contract (Mmu::hw_walk_nested) is nested::hw_walk's.
        unsafe { nested::hw_walk(root_table, gfn, write, guard, levels_read) }
    }

    fn tlb_caches_stage2(&self) -> bool {
        // With EPT, the shadow MMU's tables are the EPT tables; without, they map guest
        // virtual addresses directly.
        self.inner.tdp_enabled
    }

    crate::x86::mmu::x86_fault_entry_points!();

    fn vm_line_writes(&self) -> Option<&VmLineWrites> {
        Some(&self.inner.pages.lines)
    }

    fn zap_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: Held<'_, Write>,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        let mut st = self.inner.lock_state(held);
        LockedMmu::new(kvm, &mut st, meter).zap_memslot(start, end);
        // kvm_mmu_remote_flush_or_zap() flushed what it zapped: the caller owes nothing.
        None
    }

    fn flush_shadow_memslot(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: Held<'_, Write>,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        let mut st = self.inner.lock_state(held);
        let mut mmu = LockedMmu::new(kvm, &mut st, meter);
        match mmu.st.slot_zap {
            SlotZap::Memslot => mmu.zap_memslot(start, end),
            SlotZap::AllFast => {
                mmu.zap_all_fast();
            }
        }
        // Both flushed what they zapped.
        None
    }

    fn age_gfn_range(
        &self,
        _kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        young: &mut dyn FnMut(Gfn, u64) -> bool,
        held: Option<Held<'_, Write>>,
        meter: &mut Meter,
    ) -> bool {
        // kvm_age_rmap() / kvm_test_age_rmap(): the memslot rmaps at every level, under the
        // write lock; the shadow MMU has no lockless aging (kvm_memslots_have_rmaps() makes
        // the seed's fast path refuse, and 6.15 takes the lock for rmaps).
        let held = held.expect("the shadow MMU ages under mmu_lock");
        let st = self.inner.lock_state(held);
        let mut any = false;
        for level in [PG_LEVEL_4K, PG_LEVEL_2M, PG_LEVEL_1G] {
            let mut gfn = start.round_for_level(level);
            while gfn < end {
                meter.rmap_reads += 1;
                if let Some(head) = st.rmap_head(gfn, level) {
                    for sptep in head.iter() {
                        let cell = st.sptep(sptep);
                        meter.spte_reads += 1;
                        let spte = SpteCell::load(cell);
                        any |= age_leaf_spte(cell, spte, gfn, level.pages(), young, meter);
                    }
                }
                gfn += level.pages();
            }
        }
        any
    }

    fn check_invariants(&self, kvm: &Kvm) -> Vec<String> {
        invariants::check(&self.inner, kvm)
    }

    fn page_stats(&self) -> [i64; 3] {
        [0, 1, 2].map(|i| self.inner.pages.leaves[i].load(Ordering::Relaxed))
    }

    fn commit_memory_region(&self, kvm: &Kvm) {
        let slots = kvm.all_slots();
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let mut st = self.inner.lock_state(held.write());
        let mut meter = Meter::default();
        st.free_stale_slot_rmaps(&slots);
        for s in &slots {
            let rmaps = st.slot_rmaps(s);
            if let Some(caches) = kvm.caches() {
                rmaps.place(caches);
            }
        }
        if st.n_requested_mmu_pages == 0 {
            let nr_pages: u64 = slots.iter().map(|s| s.npages).sum();
            LockedMmu::new(kvm, &mut st, &mut meter).change_mmu_pages(default_mmu_pages(nr_pages));
        }
    }

    fn place_metadata(&self, kvm: &Kvm) {
        let Some(caches) = kvm.caches() else {
            return;
        };
        // Called before any actor runs: no lock is taken, so lock_stat counts nothing.
        let mut st = self.inner.lock_state_quiescent();
        for rmaps in st.rmaps.values_mut() {
            rmaps.place(caches);
        }
        if let Some(caches) = kvm.caches_arc() {
            st.place_in(&caches);
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

impl X86FaultPath for ShadowMmu {
    type Vcpu = ShadowVcpuMmu;

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
        vcpu: &mut ShadowVcpuMmu,
        addr: Gfn,
        write: bool,
        meter: &mut Meter,
    ) -> GuestWalk {
        let g = &mut vcpu.nested;
        // A nested guest's fault walks L1's EPT12 tables (ept_page_fault()); when they do not
        // map the address the fault is L1's: KVM reflects it (nested_ept_inject_page_fault())
        // with a nested VM-exit.
        if g.guest_mode {
            let w = crate::x86::guest_paging::walk_addr_ept(
                kvm,
                g.eptp,
                addr.to_gpa().0,
                write,
                &mut meter.guest_pte_reads,
            );
            return match w {
                Ok(walker) => GuestWalk::Walked {
                    walker,
                    guest_mode: true,
                },
                Err(_) => {
                    meter.nested_transitions += 1;
                    g.guest_mode = false;
                    GuestWalk::Reflected
                }
            };
        }
        if self.inner.tdp_enabled {
            return GuestWalk::Direct;
        }
        let Some(cr3) = paging::guest_cr3(&self.inner) else {
            return GuestWalk::Failed("shadow paging: the guest has not loaded CR3".into());
        };
        match crate::x86::guest_paging::walk_addr(
            kvm,
            cr3,
            addr.to_gpa().0,
            write,
            &mut meter.guest_pte_reads,
        ) {
            Ok(walker) => GuestWalk::Walked {
                walker,
                guest_mode: false,
            },
            Err(f) => GuestWalk::Failed(format!(
                "{f} (the guest's own page faults are not modelled)"
            )),
        }
    }

    fn fault_lock_mode(&self, _fault: &KvmPageFault) -> LockMode {
        LockMode::Write
    }

    fn slow_page_fault(
        &self,
        kvm: &Kvm,
        fault: &KvmPageFault,
        held: &MmuLockHeld,
        vcpu: &mut ShadowVcpuMmu,
        meter: &mut Meter,
    ) -> RetPf {
        // The shadow MMU's faults run under the write lock (fault_lock_mode()).
        let guard = epoch::pin();
        let ctx = &mut MmuCtx::new(kvm, held.write(), &guard, meter);
        let inner = &*self.inner;
        let ShadowVcpuMmu { caches, nested } = vcpu;
        if fault.guest_mode {
            nested::page_fault(inner, ctx, fault, nested, caches)
        } else if inner.tdp_enabled {
            fault::direct_page_fault(inner, ctx, fault, caches)
        } else {
            paging::page_fault(inner, ctx, fault, caches, &mut |mmu, caches| {
                root::ensure_root(mmu, caches, inner).ok_or(RetPf::Retry)
            })
        }
    }

    fn nested_op_begin(
        &self,
        kvm: &Kvm,
        vcpu: &mut ShadowVcpuMmu,
        op: crate::kvm::mmu::GuestOp,
        meter: &mut Meter,
    ) -> Result<crate::kvm::mmu::FaultStart, crate::kvm::mmu::FaultError> {
        nested::begin_op(
            &self.inner,
            kvm,
            &mut vcpu.nested,
            &mut vcpu.caches,
            op,
            meter,
        )
    }

    fn nested_op_locked(
        &self,
        kvm: &Kvm,
        vcpu: &mut ShadowVcpuMmu,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> Option<RetPf> {
        let held = held.write();
        nested::has_pending_op(&vcpu.nested).then(|| {
            nested::locked_op(
                &self.inner,
                kvm,
                &mut vcpu.nested,
                &mut vcpu.caches,
                held,
                meter,
            )
        })
    }
}

impl X86Mmu for ShadowMmu {
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
        ctx: &mut MmuCtx<'_, Write>,
        _slot: &Memslot,
        gfn: Gfn,
        min_level: Level,
    ) -> bool {
        let mut st = self.inner.lock_state(ctx.held);
        st.gfn_write_protect(gfn, min_level, ctx.meter)
    }

    fn clear_pt_masked(
        &self,
        ctx: &mut MmuCtx<'_, Write>,
        slot: &Memslot,
        gfn_offset: u64,
        mask: u64,
        wrprot: bool,
    ) -> bool {
        let mut st = self.inner.lock_state(ctx.held);
        st.clear_pt_masked(slot, gfn_offset, mask, wrprot, ctx.kvm.caches(), ctx.meter)
    }

    fn slot_leaf_clear_dirty(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob> {
        Box::new(jobs::WalkSlotRmapsJob::clear_dirty(
            Arc::clone(&self.inner),
            Arc::clone(slot),
        ))
    }

    fn recover_huge_pages(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob> {
        Box::new(jobs::WalkSlotRmapsJob::zap_collapsible(
            Arc::clone(&self.inner),
            Arc::clone(slot),
        ))
    }
}
