//! The x86 TDP MMU (`arch/x86/kvm/mmu/tdp_mmu.c`): faults under the read lock with cmpxchg and
//! retry, FROZEN entries while a table is torn down, lockless `fast_page_fault()`, dirty-log
//! write protection, eager page splitting, and huge-page recovery when logging is disabled.
//!
//! Simplifications (each keeps KVM's locking, ordering and flush rules):
//! - One root shared by all vCPUs for the VM's life (KVM keys roots by role; with one address
//!   space and no SMM every vCPU uses the same one). Root invalidation
//!   (`kvm_tdp_mmu_invalidate_roots()`) is therefore not modelled; memslot deletion zaps leaves.
//! - Table metadata (`struct kvm_mmu_page`: gfn, level) is not stored: walks know both.
//! - A/D bits are always enabled; no access tracking, MMIO SPTEs or NX huge pages. With PML the
//!   dirty log clears D instead of W (`clear_dirty_gfn_range()`, `clear_dirty_pt_masked()`).
//! - `is_page_fault_stale()` checks the MMU notifier's sequence (the root is never obsolete).

use crate::hw::ept::{ept_allows, Ept, VMX_EPT_ACCESS_BIT, VMX_EPT_DIRTY_BIT};
use crate::hw::page_table::{free_page_table_rcu, PageTable};
use crate::hw::pgtable::walk::CountReads;
use crate::hw::pgtable::walk::WalkAction as IterAction;
use crate::hw::pgtable::PtFormat;
use crate::hw::walker::{
    range_walks_complete, walk, walk_leaf_run, RangeWalk, RunLeaf, WalkResult,
};
use crate::kvm::memory_cache::MmuMemoryCache;
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, Mmu, MmuJob, RetPf};
use crate::kvm::mmu_ctx::{MmuCtx, TableReads};
use crate::kvm::mmu_lock::{Held, HeldMode, LockMode, MmuLockHeld, Read, TypedHeld, Write};
use crate::kvm::vm_lines::{VmLine, VmLineWrites};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::mmu::{
    new_shadow_page_cache, topup_shadow_page_cache, FlavourVcpuMmu, KvmPageFault, X86FaultPath,
    X86Mmu,
};
use crate::x86::spte::*;
use crate::x86::tdp_iter::{for_each_tdp_pte_min_level, TdpIter};
use crossbeam_epoch::{self as epoch, Guard};
use std::ops::Range;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

/// How the TDP MMU's eager split gets the table for each huge page it splits.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SplitAlloc {
    /// Up to Linux 6.10 (`tdp_mmu_alloc_sp_for_split()`): a `GFP_NOWAIT` allocation under
    /// `mmu_lock`, dropping the lock to allocate with reclaim only when it fails. The model's
    /// host never runs out of memory, so it never fails: the lock is kept.
    #[default]
    NowaitFirst,
    /// Linux 6.11 and later: always drop `mmu_lock` (and RCU) to allocate, then restart the
    /// walk from the root.
    DropLock,
}

/// The TDP MMU of one VM.
pub struct TdpMmu {
    inner: Arc<TdpMmuInner>,
    split_alloc: SplitAlloc,
}

/// The state jobs share with the MMU.
struct TdpMmuInner {
    /// The root table, owned (allocated in `new`, freed in `Drop`).
    root: *const PageTable,
    root_level: Level,
    tables: Arc<crate::hw::page_table::PageTableStats>,
    /// Leaves mapped per level (index level-1): KVM's `kvm->stat.pages[]`.
    pages: [AtomicI64; 3],
    /// Writes to `kvm->stat.pages[]` and `kvm->arch.tdp_mmu_pages`.
    lines: VmLineWrites,
}

// SAFETY: `root` points to a heap table owned by this struct and only freed in Drop; all access
// to table contents is through atomics.
unsafe impl Send for TdpMmuInner {}
// SAFETY: as above; shared access is via `&PageTable` whose entries are atomics.
unsafe impl Sync for TdpMmuInner {}

impl TdpMmu {
    /// A TDP MMU with a 4-level root (`kvm_tdp_mmu_alloc_root()`), splitting eagerly as Linux
    /// 6.0 does.
    pub fn new(kvm: &Kvm) -> Self {
        Self::with_split_alloc(kvm, SplitAlloc::default())
    }

    /// A TDP MMU whose eager split allocates as `split_alloc` says.
    pub fn with_split_alloc(kvm: &Kvm, split_alloc: SplitAlloc) -> Self {
        let root = Box::into_raw(crate::hw::page_table::alloc_page_table(
            &kvm.tables,
            TdpSpte::INVALID,
        ));
        TdpMmu {
            inner: Arc::new(TdpMmuInner {
                root,
                root_level: PT64_ROOT_4LEVEL,
                tables: Arc::clone(&kvm.tables),
                pages: Default::default(),
                lines: VmLineWrites::default(),
            }),
            split_alloc,
        }
    }
}

impl TdpMmuInner {
    fn root(&self) -> &PageTable {
        // SAFETY: the root is allocated in TdpMmu::new and freed only when the last Arc of this
        // struct is dropped, so it outlives `&self`.
        unsafe { &*self.root }
    }

    /// `for_each_tdp_pte_min_level()` over this MMU's root: visits every entry at or above
    /// `min_level` overlapping `[start, end)` in pre-order.
    fn for_each_pte<'g, C: CountReads>(
        &'g self,
        min_level: Level,
        gfns: Range<Gfn>,
        guard: &'g Guard,
        c: &mut C,
        f: impl FnMut(&mut TdpIter<'g>, &mut C) -> IterAction,
    ) {
        for_each_tdp_pte_min_level(self.root(), self.root_level, min_level, gfns, guard, c, f)
    }

    fn account_leaf(&self, level: Level, delta: i64) {
        self.account_leaves(level, delta, 1);
    }

    /// `updates` calls of `kvm_update_page_stats()` at `level` that add up to `delta`, each
    /// a write of the stats' line.
    fn account_leaves(&self, level: Level, delta: i64, updates: u64) {
        if level <= KVM_MAX_HUGEPAGE_LEVEL {
            self.pages[level.0 as usize - 1].fetch_add(delta, Ordering::Relaxed);
            self.lines.wrote_n(VmLine::PageStats, updates);
        }
    }

    /// `handle_changed_spte()`: bookkeeping after an entry changed from `old` to `new`. A leaf
    /// must never be replaced by a leaf with another PFN; a present non-leaf replaced by a leaf
    /// or a non-present entry takes its table down with it.
    fn handle_changed_spte<M: HeldMode>(
        &self,
        ctx: &mut MmuCtx<'_, M>,
        gfn: Gfn,
        old: u64,
        new: u64,
        level: Level,
    ) {
        if old == new {
            return;
        }
        let was_present = is_shadow_present_pte(old);
        let is_present = is_shadow_present_pte(new);
        let was_leaf = was_present && is_last_spte(old, level);
        let is_leaf = is_present && is_last_spte(new, level);
        let pfn_changed = spte_to_pfn(old) != spte_to_pfn(new);
        assert!(
            !(was_leaf && is_leaf && pfn_changed),
            "{gfn:?} at {level:?}: leaf {old:#x} replaced by leaf {new:#x} with another PFN"
        );
        if is_leaf != was_leaf {
            self.account_leaf(level, if is_leaf { 1 } else { -1 });
        }
        if was_present && !was_leaf && (is_leaf || !is_present || pfn_changed) {
            // SAFETY: `old` was a present non-leaf entry of this tree read under `ctx.guard`.
            let pt = unsafe { spte_to_child_pt(old, ctx.guard) };
            self.handle_removed_pt(ctx, pt, level.below(), gfn);
        }
    }

    /// `handle_removed_pt()`: a table was unlinked. Freeze each child so nobody can install
    /// anything under it (in shared mode with `xchg`, spinning while another thread has it
    /// frozen), recurse into child tables, and free the table after an RCU grace period.
    fn handle_removed_pt<M: HeldMode>(
        &self,
        ctx: &mut MmuCtx<'_, M>,
        pt: &PageTable,
        level: Level,
        base_gfn: Gfn,
    ) {
        let shared = ctx.shared();
        // handle_changed_spte() of a leaf child only takes it off the page stats: summed here
        // into one update of the count per table, with as many writes of the stats' line
        // (simplified: kvm_update_page_stats() per child; the count is read only where the
        // MMU is quiet, by the invariant checks and reports).
        let mut leaves = 0u64;
        for (i, sptep) in pt.spt.iter().enumerate() {
            let gfn = base_gfn + i as u64 * level.pages();
            let old = if shared {
                // A vCPU may be installing an entry here concurrently (it saw the table before
                // it was unlinked); xchg to FROZEN makes its cmpxchg fail. If another thread has
                // the entry frozen, wait for it to finish: it will write a non-frozen value.
                loop {
                    let old = sptep.xchg(FROZEN_SPTE);
                    if !is_frozen_spte(old) {
                        break old;
                    }
                    std::hint::spin_loop();
                }
            } else {
                let old = SpteCell::load(sptep);
                if !is_shadow_present_pte(old) {
                    continue;
                }
                // Under the write lock only hardware (A/D) and fast PF (W) can race; an atomic
                // exchange keeps a D bit set through a stale TLB entry.
                sptep.xchg(FROZEN_SPTE)
            };
            ctx.meter.spte_writes += 1;
            if is_shadow_present_pte(old) && is_last_spte(old, level) {
                leaves += 1;
            } else {
                self.handle_changed_spte(ctx, gfn, old, FROZEN_SPTE, level);
            }
        }
        if leaves > 0 {
            self.account_leaves(level, -(leaves as i64), leaves);
        }
        ctx.meter.tables_freed += 1;
        // tdp_unaccount_mmu_page()
        self.lines.wrote(VmLine::MmuPages);
        // SAFETY: `pt` was just unlinked from its parent (the caller replaced the parent entry)
        // and every entry is now frozen, so no new walker can reach it; it was allocated by
        // alloc_page_table and linked via Box::into_raw, and is freed only here, once.
        unsafe { free_page_table_rcu(&self.tables, pt as *const PageTable, ctx.guard) };
    }

    /// `tdp_mmu_set_spte_atomic()` (read lock): cmpxchg the current entry from `iter.old_spte`
    /// to `new`. On failure `iter.old_spte` holds the current value and the caller retries.
    fn set_spte_atomic(
        &self,
        ctx: &mut MmuCtx<'_, Read>,
        iter: &mut TdpIter,
        new: u64,
    ) -> Result<(), ()> {
        // Callers must not write over a frozen entry: its owner is replacing it.
        debug_assert!(
            !is_frozen_spte(iter.old_spte),
            "set_spte_atomic on a frozen SPTE"
        );
        match iter.sptep().cmpxchg(iter.old_spte, new) {
            Ok(_) => {
                ctx.meter.spte_writes += 1;
                self.handle_changed_spte(ctx, iter.gfn, iter.old_spte, new, iter.level);
                iter.old_spte = new;
                Ok(())
            }
            Err(cur) => {
                ctx.meter.cmpxchg_failed += 1;
                iter.old_spte = cur;
                Err(())
            }
        }
    }

    /// `tdp_mmu_iter_set_spte()` (write lock): write `new`, atomically only if someone without
    /// the lock may still change the entry (`kvm_tdp_mmu_write_spte()`).
    fn iter_set_spte(&self, ctx: &mut MmuCtx<'_, Write>, iter: &mut TdpIter, new: u64) {
        let old = if spte_needs_atomic_update(iter.old_spte) {
            iter.sptep().xchg(new)
        } else {
            SpteCell::store(iter.sptep(), new);
            iter.old_spte
        };
        ctx.meter.spte_writes += 1;
        self.handle_changed_spte(ctx, iter.gfn, old, new, iter.level);
        iter.old_spte = new;
    }

    /// `tdp_mmu_link_sp()`: install a non-leaf entry pointing at `sp`. On success the tree owns
    /// the table; on a lost race it is handed back.
    fn link_sp<M: SetSpte>(
        &self,
        ctx: &mut MmuCtx<'_, M>,
        iter: &mut TdpIter,
        sp: Box<PageTable>,
    ) -> Result<(), Box<PageTable>> {
        // Give up the Box before publishing: once linked, other threads access the table.
        let raw = Box::into_raw(sp);
        let spte = make_nonleaf_spte(raw as u64);
        if M::set_spte(self, ctx, iter, spte).is_err() {
            // SAFETY: the cmpxchg failed (only the read lock's can), so the table was never
            // published; `raw` came from Box::into_raw above and nobody else has it.
            return Err(unsafe { Box::from_raw(raw) });
        }
        // The tree owns the table now; it is freed by handle_removed_pt() or at teardown.
        // tdp_account_mmu_page()
        self.lines.wrote(VmLine::MmuPages);
        Ok(())
    }

    /// `tdp_mmu_split_huge_page()`: fill `sp` with the 512 children of the huge entry at `iter`
    /// (same permissions and A/D, so no TLB flush is needed) and link it in place of the huge
    /// entry.
    fn split_huge_page<M: SetSpte>(
        &self,
        ctx: &mut MmuCtx<'_, M>,
        iter: &mut TdpIter,
        sp: Box<PageTable>,
    ) -> Result<(), Box<PageTable>> {
        let huge = iter.old_spte;
        let child_level = iter.level.below();
        for (i, e) in sp.spt.iter().enumerate() {
            e.store(
                make_huge_page_split_spte(huge, child_level, i),
                Ordering::Relaxed,
            );
        }
        ctx.meter.spte_writes += SPTE_ENT_PER_PAGE as u64;
        self.link_sp(ctx, iter, sp)?;
        // handle_changed_spte() accounted the huge leaf going away; account its children.
        self.account_leaf(child_level, SPTE_ENT_PER_PAGE as i64);
        Ok(())
    }

    /// `tdp_mmu_iter_cond_resched()`'s decision: yield if someone waits for `mmu_lock` and the
    /// walk has made progress since it last (re)started (the forward-progress guard).
    fn should_yield<M: HeldMode>(iter: &TdpIter, ctx: &MmuCtx<'_, M>) -> bool {
        iter.made_progress() && ctx.needbreak()
    }

    /// Frees the whole tree at teardown (no other user can exist): a post-order walk frees
    /// each table after its children, then the root goes (`kvm_tdp_mmu_put_root()` of the last
    /// reference, without the zap a live VM would need).
    fn free_tree(&self) {
        use crate::hw::pgtable::walk::{walk_range, Visit, WalkFlags, WalkRange};
        let guard = epoch::pin();
        let range = WalkRange {
            root_level: self.root_level,
            min_level: PG_LEVEL_4K,
            start: Gfn(0),
            end: Gfn(u64::MAX),
            flags: WalkFlags::TABLE_POST,
        };
        let mut reads = 0u64;
        walk_range::<TdpSpte, u64>(self.root(), range, &guard, &mut reads, |it, visit, _| {
            debug_assert_eq!(visit, Visit::TablePost);
            let child = TdpSpte::table_addr(it.old_spte) as *mut PageTable;
            // SAFETY: teardown owns the tree exclusively; `child` is a table of it, allocated
            // by alloc_page_table and linked via Box::into_raw, and the walk has left it and
            // keeps no reference to it (PtIter::try_step_up), so it is freed once, here. This
            // visitor keeps no entry reference either, so nothing points into freed tables.
            let table = unsafe { Box::from_raw(child) };
            crate::hw::page_table::free_unlinked_page_table(&self.tables, table);
            IterAction::Continue
        });
        // SAFETY: as above, for the root, which no walk references any more.
        let root = unsafe { Box::from_raw(self.root as *mut PageTable) };
        crate::hw::page_table::free_unlinked_page_table(&self.tables, root);
    }
}

/// How a TDP MMU walk writes an entry under the hold it has: `tdp_mmu_set_spte_atomic()` under
/// the read lock (a cmpxchg that may lose a race), `tdp_mmu_iter_set_spte()` under the write
/// lock (never fails). KVM chooses by its `shared` argument; here the hold's type chooses.
trait SetSpte: HeldMode {
    fn set_spte(
        inner: &TdpMmuInner,
        ctx: &mut MmuCtx<'_, Self>,
        iter: &mut TdpIter,
        new: u64,
    ) -> Result<(), ()>;
}

impl SetSpte for Read {
    fn set_spte(
        inner: &TdpMmuInner,
        ctx: &mut MmuCtx<'_, Read>,
        iter: &mut TdpIter,
        new: u64,
    ) -> Result<(), ()> {
        inner.set_spte_atomic(ctx, iter, new)
    }
}

impl SetSpte for Write {
    fn set_spte(
        inner: &TdpMmuInner,
        ctx: &mut MmuCtx<'_, Write>,
        iter: &mut TdpIter,
        new: u64,
    ) -> Result<(), ()> {
        inner.iter_set_spte(ctx, iter, new);
        Ok(())
    }
}

impl crate::x86::fast_page_fault::LastSptepWalk for TdpMmuInner {
    /// `kvm_tdp_mmu_fast_pf_get_last_sptep()`: `tdp_mmu_for_each_pte()` to the gfn, keeping
    /// the last entry visited.
    fn get_last_sptep<'g>(
        &'g self,
        gfn: Gfn,
        guard: &'g Guard,
        meter: &mut Meter,
    ) -> Option<(&'g std::sync::atomic::AtomicU64, u64, Level)> {
        let mut last = None;
        let mut reads = TableReads::new(meter, &self.tables);
        self.for_each_pte(PG_LEVEL_4K, gfn..gfn + 1, guard, &mut reads, |it, _| {
            last = Some((it.sptep(), it.old_spte, it.level));
            IterAction::Continue
        });
        last
    }
}

impl Drop for TdpMmuInner {
    fn drop(&mut self) {
        self.free_tree();
    }
}

impl Mmu for TdpMmu {
    fn name(&self) -> &'static str {
        "tdp"
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
        // SAFETY: the root is live for the MMU's lifetime and `guard` is pinned by the caller
        // for the whole walk.
        unsafe {
            walk(
                self.inner.root(),
                self.inner.root_level,
                gfn,
                write,
                pml_full,
                guard,
                levels_read,
            )
        }
    }

    fn hw_walk_leaf_run(
        &self,
        first: Gfn,
        n: u64,
        write: bool,
        log_room: u64,
        guard: &Guard,
        each: &mut dyn FnMut(RunLeaf) -> bool,
    ) -> u64 {
        // Each walk of a 4K leaf reads one entry per level, from the root.
        if u64::from(self.inner.root_level.0) != self.stage2_walk_levels() {
            return 0;
        }
        // SAFETY: as in hw_walk(): the root is live for the MMU's lifetime and `guard` is
        // pinned by the caller for the whole run.
        unsafe {
            walk_leaf_run(
                self.inner.root(),
                self.inner.root_level,
                first,
                n,
                write,
                log_room,
                guard,
                each,
            )
        }
    }

    /// The leaves [`walk`] sets Accessed (and Dirty on a write) in: one that also maps gfns
    /// outside `range` must have them set already.
    fn range_walks_private(
        &self,
        range: GfnRange,
        check: GfnRange,
        write: bool,
        budget: &mut u64,
    ) -> RangeWalk {
        // Gfns past the root's reach have no entry to walk.
        let reach = Ept::pages(self.inner.root_level) * crate::hw::pgtable::PTES_PER_TABLE as u64;
        if check.end.0 > reach {
            return RangeWalk::Blocked(check.start);
        }
        let guard = epoch::pin();
        let used = VMX_EPT_ACCESS_BIT | if write { VMX_EPT_DIRTY_BIT } else { 0 };
        range_walks_complete::<Ept>(
            self.inner.root(),
            self.inner.root_level,
            check,
            &guard,
            budget,
            |pte| ept_allows(pte, write),
            |pte, maps| {
                let inside = maps.start >= range.start && maps.end <= range.end;
                ept_allows(pte, write) && (inside || pte & used == used)
            },
        )
    }

    crate::x86::mmu::x86_fault_entry_points!();

    fn vm_line_writes(&self) -> Option<&VmLineWrites> {
        Some(&self.inner.lines)
    }

    fn zap_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: Held<'_, Write>,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        let inner = &self.inner;
        let guard = epoch::pin();
        let mut ctx = MmuCtx::new(kvm, held, &guard, meter);
        let mut flush = None;
        // tdp_mmu_zap_leafs(), without yielding (simplified: callers zap bounded ranges).
        inner.for_each_pte(PG_LEVEL_4K, start..end, &guard, &mut ctx, |it, ctx| {
            if !is_shadow_present_pte(it.old_spte) || !is_last_spte(it.old_spte, it.level) {
                return IterAction::Continue;
            }
            inner.iter_set_spte(ctx, it, SHADOW_NONPRESENT_VALUE);
            owe_flush(&mut flush, GfnRange::new(it.gfn, it.level.pages()));
            IterAction::Continue
        });
        flush
    }

    fn age_gfn_range(
        &self,
        _kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        young: &mut dyn FnMut(Gfn, u64) -> bool,
        _held: Option<Held<'_, Write>>,
        meter: &mut Meter,
    ) -> bool {
        // kvm_tdp_mmu_age_gfn_range() / kvm_tdp_mmu_test_age_gfn(): a leaf walk under RCU. The
        // flag is cleared with an atomic AND (tdp_mmu_clear_spte_bits_atomic(), Linux 6.4+),
        // against the CPU setting A/D and, without the lock, against faults and zaps changing
        // the entry after the walk read it: clearing A on an entry just replaced is harmless,
        // and FROZEN_SPTE has no A bit, so a frozen entry stays frozen (tests/model_aging.rs).
        // The write lock is taken by the caller when aging is locked.
        let guard = epoch::pin();
        let mut any = false;
        let mut reads = TableReads::new(meter, &self.inner.tables);
        self.inner
            .for_each_pte(PG_LEVEL_4K, start..end, &guard, &mut reads, |it, r| {
                let spte = it.old_spte;
                if is_shadow_present_pte(spte) && is_last_spte(spte, it.level) {
                    let pages = it.level.pages();
                    any |= age_leaf_spte(it.sptep(), spte, it.gfn, pages, young, r.meter);
                }
                IterAction::Continue
            });
        any
    }

    fn lockless_age_range(&self) -> bool {
        true
    }

    fn lockless_test_clear_young(&self) -> bool {
        true
    }

    fn check_invariants(&self, kvm: &Kvm) -> Vec<String> {
        let mut errors = Vec::new();
        let inner = &self.inner;
        let guard = epoch::pin();
        let mut counted = [0i64; 3];
        let mut meter = Meter::default();
        let logging_bitmaps = kvm.dirty_rings.get().is_none();
        let pml = kvm.cpu_dirty_log_size() > 0;
        inner.for_each_pte(
            PG_LEVEL_4K,
            Gfn(0)..Gfn(1 << 40),
            &guard,
            &mut meter,
            |it, _| {
                let spte = it.old_spte;
                if is_frozen_spte(spte) {
                    errors.push(format!("{:?} at {:?}: left FROZEN", it.gfn, it.level));
                    return IterAction::Continue;
                }
                if !is_shadow_present_pte(spte) || !is_last_spte(spte, it.level) {
                    return IterAction::Continue;
                }
                if errors.len() > 32 {
                    return IterAction::Stop;
                }
                if let Err(e) = check_spte_writable_invariants(spte) {
                    errors.push(format!("{:?} at {:?}: {e}", it.gfn, it.level));
                }
                counted[it.level.0 as usize - 1] += 1;
                let Some(slot) = kvm.gfn_to_memslot(it.gfn, &guard) else {
                    errors.push(format!(
                        "{:?} at {:?}: leaf outside every memslot",
                        it.gfn, it.level
                    ));
                    return IterAction::Continue;
                };
                if kvm.host_pfn(slot, it.gfn) != spte_to_pfn(spte) {
                    errors.push(format!(
                        "{:?} at {:?}: leaf maps {:?}, memslot says {:?}",
                        it.gfn,
                        it.level,
                        spte_to_pfn(spte),
                        kvm.host_pfn(slot, it.gfn)
                    ));
                }
                if it.level > crate::x86::mmu::max_mapping_level(kvm, slot, it.gfn) {
                    errors.push(format!(
                        "{:?}: {:?} leaf where the memslot allows {:?}",
                        it.gfn,
                        it.level,
                        crate::x86::mmu::max_mapping_level(kvm, slot, it.gfn)
                    ));
                }
                // A writable leaf in a logged slot means writes through it are not tracked (with
                // PML, a writable 4K leaf whose D is clear is tracked: the CPU logs the write that
                // sets D; a huge one is not, since one D covers all its pages), which is only
                // allowed while its pages are still reported dirty. Checked with every vCPU out
                // of guest mode, so their PML logs are empty.
                if crate::host::memory::HostMemory::is_zero_pfn(spte_to_pfn(spte))
                    && is_writable_pte(spte)
                {
                    errors.push(format!("{:?}: maps the host's zero page writable", it.gfn));
                }
                let logged_by_pml = pml && it.level == PG_LEVEL_4K && !is_dirty_spte(spte);
                if logging_bitmaps && is_writable_pte(spte) && !logged_by_pml {
                    if let Err(e) = slot.check_writable_leaf_is_dirty(it.gfn, it.level.pages()) {
                        errors.push(e.to_string());
                    }
                }
                IterAction::Continue
            },
        );
        let stats = self.page_stats();
        if counted != stats {
            errors.push(format!(
                "page stats {stats:?} disagree with the tree {counted:?} (4K, 2M, 1G)"
            ));
        }
        errors
    }

    fn page_stats(&self) -> [i64; 3] {
        std::array::from_fn(|i| self.inner.pages[i].load(Ordering::Relaxed))
    }
}

/// A vCPU's TDP MMU state: `mmu_shadow_page_cache`, the tables a fault links. Simplified:
/// KVM's `mmu_topup_memory_caches()` also tops up `mmu_pte_list_desc_cache` with the TDP MMU,
/// which nothing then allocates from; here it is not kept (no meter counted its top-up).
pub struct TdpVcpuMmu {
    /// `vcpu->arch.mmu_shadow_page_cache`.
    pub shadow_page_cache: MmuMemoryCache,
}

impl Default for TdpVcpuMmu {
    fn default() -> Self {
        TdpVcpuMmu {
            shadow_page_cache: new_shadow_page_cache(),
        }
    }
}

impl FlavourVcpuMmu for TdpVcpuMmu {
    fn mmu_topup_memory_caches(&mut self, kvm: &Kvm, meter: &mut Meter) {
        topup_shadow_page_cache(&mut self.shadow_page_cache, kvm, meter);
    }
    fn free_memory_caches(&mut self, kvm: &Kvm) {
        self.shadow_page_cache.free_all(&kvm.tables);
    }
}

impl X86FaultPath for TdpMmu {
    type Vcpu = TdpVcpuMmu;

    fn fast_page_fault(&self, kvm: &Kvm, fault: &KvmPageFault, meter: &mut Meter) -> RetPf {
        let inner = &self.inner;
        crate::x86::fast_page_fault::fast_page_fault(kvm, fault, meter, &**inner)
    }

    fn fault_lock_mode(&self, _fault: &KvmPageFault) -> LockMode {
        LockMode::Read
    }

    fn slow_page_fault(
        &self,
        kvm: &Kvm,
        fault: &KvmPageFault,
        held: &MmuLockHeld,
        caches: &mut TdpVcpuMmu,
        meter: &mut Meter,
    ) -> RetPf {
        // The TDP MMU's faults run under the read lock (fault_lock_mode()).
        let held = held.read();
        let inner = &self.inner;
        let guard = epoch::pin();
        let mut ctx = MmuCtx::new(kvm, held, &guard, meter);
        // kvm_tdp_mmu_map()
        let mut it = TdpIter::start(
            inner.root(),
            inner.root_level,
            PG_LEVEL_4K,
            fault.gfn,
            &guard,
            &mut ctx,
        );
        while it.valid && it.gfn.0 < fault.gfn.0 + 1 {
            // Another thread is replacing this entry: give up and let the vCPU retry, rather
            // than allocate a table that would be thrown away.
            if is_frozen_spte(it.old_spte) {
                return RetPf::Retry;
            }
            if it.level == fault.goal_level {
                return self.map_handle_target_level(&mut ctx, fault, &mut it);
            }
            // Step down into the lower level table if it exists.
            if is_shadow_present_pte(it.old_spte) && !is_large_pte(it.old_spte) {
                it.next(&mut ctx);
                continue;
            }
            // The entry is either non-present or a huge page that must be split.
            let sp = caches.shadow_page_cache.alloc(&kvm.tables);
            let r = if is_shadow_present_pte(it.old_spte) {
                let r = inner.split_huge_page(&mut ctx, &mut it, sp);
                if r.is_ok() {
                    ctx.meter.split_in_fault += 1;
                }
                r
            } else {
                inner.link_sp(&mut ctx, &mut it, sp)
            };
            if let Err(sp) = r {
                // Lost the race to link: free the table and retry the fault.
                caches.shadow_page_cache.give_back(sp, &kvm.tables);
                return RetPf::Retry;
            }
            it.next(&mut ctx);
        }
        RetPf::Retry
    }
}

impl X86Mmu for TdpMmu {
    fn try_split_huge_pages(
        &self,
        slot: &Arc<Memslot>,
        start: Gfn,
        end: Gfn,
        target_level: Level,
        mode: LockMode,
    ) -> Box<dyn MmuJob> {
        Box::new(SplitHugePagesJob {
            mmu: Arc::clone(&self.inner),
            alloc: self.split_alloc,
            end,
            target_level,
            mode,
            cursor: start,
            sp: None,
            _slot: Arc::clone(slot),
        })
    }

    fn slot_remove_write_access(&self, slot: &Arc<Memslot>, start_level: Level) -> Box<dyn MmuJob> {
        Box::new(SlotLeafJob {
            mmu: Arc::clone(&self.inner),
            slot: Arc::clone(slot),
            wrprot: true,
            min_level: start_level,
            cursor: slot.base_gfn,
            flush: None,
        })
    }

    fn slot_gfn_write_protect(
        &self,
        ctx: &mut MmuCtx<'_, Write>,
        _slot: &Memslot,
        gfn: Gfn,
        min_level: Level,
    ) -> bool {
        let inner = &self.inner;
        let mut spte_set = false;
        // write_protect_gfn()
        inner.for_each_pte(min_level, gfn..gfn + 1, ctx.guard, ctx, |it, ctx| {
            if !is_shadow_present_pte(it.old_spte) || !is_last_spte(it.old_spte, it.level) {
                return IterAction::Continue;
            }
            let new = it.old_spte & !(PT_WRITABLE_MASK | EPT_SPTE_MMU_WRITABLE);
            if new == it.old_spte {
                return IterAction::Stop;
            }
            inner.iter_set_spte(ctx, it, new);
            ctx.meter.sptes_wrprot += 1;
            spte_set = true;
            IterAction::Continue
        });
        spte_set
    }

    fn clear_pt_masked(
        &self,
        ctx: &mut MmuCtx<'_, Write>,
        slot: &Memslot,
        gfn_offset: u64,
        mask: u64,
        wrprot: bool,
    ) -> bool {
        self.clear_dirty_pt_masked(ctx, slot, gfn_offset, mask, wrprot)
    }

    fn slot_leaf_clear_dirty(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob> {
        Box::new(SlotLeafJob {
            mmu: Arc::clone(&self.inner),
            slot: Arc::clone(slot),
            wrprot: false,
            min_level: PG_LEVEL_4K,
            cursor: slot.base_gfn,
            flush: None,
        })
    }

    fn recover_huge_pages(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob> {
        Box::new(RecoverHugePagesJob {
            mmu: Arc::clone(&self.inner),
            slot: Arc::clone(slot),
            cursor: slot.base_gfn,
            flush: false,
        })
    }
}

impl TdpMmu {
    /// `kvm_tdp_mmu_clear_dirty_pt_masked()` (write lock): on the 4K leaves of the 64 pages from
    /// `slot.base_gfn + gfn_offset` selected by `mask`, clear W (`wrprot`: dirty logging by
    /// write protection) or D (PML). Huge leaves at the ends were write-protected by the caller
    /// (`kvm_mmu_slot_gfn_write_protect()`). Returns whether an entry changed.
    fn clear_dirty_pt_masked(
        &self,
        ctx: &mut MmuCtx<'_, Write>,
        slot: &Memslot,
        gfn_offset: u64,
        mut mask: u64,
        wrprot: bool,
    ) -> bool {
        if mask == 0 {
            return false;
        }
        let inner = &self.inner;
        let gfn = slot.base_gfn + gfn_offset;
        let mut spte_set = false;
        let first = gfn + mask.trailing_zeros() as u64;
        let end = gfn + 64;
        // tdp_root_for_each_leaf_pte() passes over entries that are not present leaves before
        // the body looks at the mask: the walk ends at the first present leaf it meets once
        // the mask is empty (or at the range's end), not at the next entry.
        inner.for_each_pte(PG_LEVEL_4K, first..end, ctx.guard, ctx, |it, ctx| {
            // Above the 4K level: a table, or a huge leaf, which is not the mask's.
            if it.level > PG_LEVEL_4K {
                let present_leaf =
                    is_shadow_present_pte(it.old_spte) && is_last_spte(it.old_spte, it.level);
                return if present_leaf && mask == 0 {
                    IterAction::Stop
                } else {
                    IterAction::Continue
                };
            }
            // This table's 4K leaves, each visited as the walk would visit it, counted on the
            // meter once the table is done.
            let mut leaves = ClearedLeaves::default();
            let action = it.visit_along_table(end, ctx, |at, sptep, old| {
                if !is_shadow_present_pte(old) {
                    return true;
                }
                if mask == 0 {
                    return false;
                }
                // The walk covers gfn + __ffs(mask) up to gfn + 64.
                let bit = 1u64 << (at.0 - gfn.0);
                if mask & bit == 0 {
                    return true;
                }
                mask &= !bit;
                leaves.clear(sptep, PG_LEVEL_4K, wrprot, LockMode::Write);
                true
            });
            spte_set |= leaves.cleared > 0;
            leaves.count(wrprot, ctx.meter);
            action
        });
        spte_set
    }

    /// `tdp_mmu_map_handle_target_level()`: install the leaf for the fault.
    fn map_handle_target_level(
        &self,
        ctx: &mut MmuCtx<'_, Read>,
        fault: &KvmPageFault,
        it: &mut TdpIter,
    ) -> RetPf {
        let kvm = ctx.kvm;
        let new_spte = make_spte(it.level, fault.pfn, fault.map_writable, false);
        if new_spte == it.old_spte {
            return RetPf::Spurious;
        }
        // make_spte() marks a writable mapping dirty in a logged slot (WARN if huge: logging
        // restricts the fault to 4K in kvm_mmu_hugepage_adjust()).
        if is_writable_pte(new_spte) && fault.dirty_logging {
            debug_assert_eq!(it.level, PG_LEVEL_4K);
            fault.mark_page_dirty(kvm, ctx.meter);
        }
        let old = it.old_spte;
        if self.inner.set_spte_atomic(ctx, it, new_spte).is_err() {
            return RetPf::Retry;
        }
        let meter = &mut *ctx.meter;
        // Replacing a table with a huge leaf: vCPUs may still cache translations through the
        // old table.
        if is_shadow_present_pte(old) && !is_last_spte(old, it.level) {
            crate::x86::mmu::kvm_flush_remote_tlbs_gfn(kvm, it.gfn, it.level, meter);
        }
        match it.level.0 {
            1 => meter.pf_map_4k += 1,
            2 => meter.pf_map_2m += 1,
            _ => meter.pf_map_1g += 1,
        }
        RetPf::Fixed
    }
}

/// `kvm_tdp_mmu_try_split_huge_pages()` as a resumable job.
struct SplitHugePagesJob {
    mmu: Arc<TdpMmuInner>,
    alloc: SplitAlloc,
    end: Gfn,
    target_level: Level,
    mode: LockMode,
    /// Restart point (`next_last_level_gfn`).
    cursor: Gfn,
    /// The table preallocated for the next split (allocated with the lock dropped).
    sp: Option<Box<PageTable>>,
    _slot: Arc<Memslot>,
}

impl MmuJob for SplitHugePagesJob {
    fn name(&self) -> &'static str {
        "tdp_mmu_split_huge_pages"
    }
    fn lock_mode(&self) -> LockMode {
        self.mode
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        debug_assert_eq!(held.mode(), self.mode);
        let guard = epoch::pin();
        match held.typed() {
            TypedHeld::Read(h) => self.split(&mut MmuCtx::new(kvm, h, &guard, meter)),
            TypedHeld::Write(h) => self.split(&mut MmuCtx::new(kvm, h, &guard, meter)),
        }
    }
    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if self.sp.is_none() {
            meter.tables_allocated += 1;
            self.sp = Some(crate::hw::page_table::alloc_page_table(
                &kvm.tables,
                TdpSpte::INVALID,
            ));
        }
    }
}

impl SplitHugePagesJob {
    /// [`MmuJob::run`] under the hold `ctx` carries: the read lock at enable time, the write
    /// lock inside `KVM_CLEAR_DIRTY_LOG`.
    fn split<M: SetSpte>(&mut self, ctx: &mut MmuCtx<'_, M>) -> JobStep {
        let inner = &*self.mmu;
        let mut it = TdpIter::start(
            inner.root(),
            inner.root_level,
            self.target_level.above(),
            self.cursor,
            ctx.guard,
            ctx,
        );
        // tdp_mmu_split_huge_pages_root(): pre-order, so a 1G page splits into 2M pages that are
        // split in turn as the walk steps down into the new table.
        while it.valid && it.gfn < self.end {
            if TdpMmuInner::should_yield(&it, ctx) {
                self.cursor = it.next_last_level_gfn;
                return JobStep::Yield;
            }
            if !is_shadow_present_pte(it.old_spte) || !is_large_pte(it.old_spte) {
                it.next(ctx);
                continue;
            }
            if self.sp.is_none() && self.alloc == SplitAlloc::NowaitFirst {
                // GFP_NOWAIT under the lock, which succeeds (no memory pressure).
                ctx.meter.tables_allocated += 1;
                self.sp = Some(crate::hw::page_table::alloc_page_table(
                    &inner.tables,
                    TdpSpte::INVALID,
                ));
            }
            let Some(sp) = self.sp.take() else {
                // Drop RCU and mmu_lock, allocate, retake, and restart from the root at this
                // gfn (the iterator is marked yielded in KVM).
                self.cursor = it.next_last_level_gfn;
                return JobStep::NeedTopup;
            };
            match inner.split_huge_page(ctx, &mut it, sp) {
                Ok(()) => {
                    ctx.meter.split_eager += 1;
                    it.next(ctx);
                }
                // Lost a race (read lock only): old_spte is fresh; look at the entry again.
                Err(sp) => self.sp = Some(sp),
            }
        }
        // tdp_mmu_free_sp() of a leftover table.
        if let Some(sp) = self.sp.take() {
            crate::hw::page_table::free_unlinked_page_table(&inner.tables, sp);
        }
        JobStep::Done { flush: None }
    }
}

/// Clears W (`wrprot`) or D on the leaf at `it` (neither change needs `handle_changed_spte()`),
/// with `mmu_lock` held in mode `held` ([`ClearedLeaves::clear`]), and counts it on `meter`.
/// Returns whether this call cleared the bit.
#[inline]
fn clear_leaf_bit(it: &TdpIter, wrprot: bool, held: LockMode, meter: &mut Meter) -> bool {
    let mut leaves = ClearedLeaves::default();
    let cleared = leaves.clear(it.sptep(), it.level, wrprot, held);
    leaves.count(wrprot, meter);
    cleared
}

/// Leaves whose W or D bit a walk cleared, and the cmpxchg retries that took: counted on the
/// actor's meter once ([`ClearedLeaves::count`]), which sums as counting each would.
#[derive(Default)]
struct ClearedLeaves {
    /// Leaves whose bit was cleared.
    cleared: u64,
    /// Failed cmpxchgs.
    retries: u64,
}

impl ClearedLeaves {
    /// Clears W (`wrprot`) or D on the leaf `sptep` at `level`, with `mmu_lock` held in mode
    /// `held`: under the write lock as `tdp_mmu_clear_spte_bits()` does, atomically only where
    /// someone without the lock may change the entry ([`clear_leaf_bit_locked`]); under the read
    /// lock always with cmpxchg, since the CPU may set D and the fast path may set W
    /// concurrently. Returns whether this call cleared the bit.
    #[inline]
    fn clear(&mut self, sptep: &AtomicU64, level: Level, wrprot: bool, held: LockMode) -> bool {
        let (cleared, retries) = match (held, wrprot) {
            (LockMode::Write, _) => clear_leaf_bit_locked(sptep, level, wrprot),
            (LockMode::Read, true) => wrprot_spte_atomic(sptep, level),
            (LockMode::Read, false) => clear_dirty_spte_atomic(sptep, level),
        };
        self.retries += retries as u64;
        self.cleared += cleared.is_some() as u64;
        cleared.is_some()
    }

    /// Counts the cleared leaves (entries written: write-protected or cleaned) and the retries
    /// on `meter`.
    #[inline]
    fn count(&self, wrprot: bool, meter: &mut Meter) {
        meter.cmpxchg_failed += self.retries;
        meter.spte_writes += self.cleared;
        if wrprot {
            meter.sptes_wrprot += self.cleared;
        } else {
            meter.sptes_dirty_cleared += self.cleared;
        }
    }
}

/// A walk of a slot's leaves under the read lock that clears one bit in each:
/// `kvm_tdp_mmu_wrprot_slot()` → `wrprot_gfn_range()` (clear W, keep MMU-writable; leaves at
/// `min_level` and above) or `kvm_tdp_mmu_clear_dirty_slot()` → `clear_dirty_gfn_range()`
/// (clear D on every leaf, so the CPU logs the next write to it: PML).
struct SlotLeafJob {
    mmu: Arc<TdpMmuInner>,
    slot: Arc<Memslot>,
    /// Clear W (else D).
    wrprot: bool,
    min_level: Level,
    cursor: Gfn,
    /// The leaves changed so far, owed a flush by the caller.
    flush: Option<GfnRange>,
}

impl MmuJob for SlotLeafJob {
    fn name(&self) -> &'static str {
        if self.wrprot {
            "tdp_mmu_wrprot_slot"
        } else {
            "tdp_mmu_clear_dirty_slot"
        }
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Read
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let inner = &*self.mmu;
        let guard = epoch::pin();
        let ctx = &mut MmuCtx::new(kvm, held.read(), &guard, meter);
        let end = self.slot.end_gfn();
        let mut it = TdpIter::start(
            inner.root(),
            inner.root_level,
            self.min_level,
            self.cursor,
            &guard,
            ctx,
        );
        while it.valid && it.gfn < end {
            // No flush before yielding: clearing W alone keeps MMU-writable, and writes through
            // stale writable or dirty TLB entries go untracked only until the caller's memslot
            // flush, which comes before the ioctl returns.
            if TdpMmuInner::should_yield(&it, ctx) {
                self.cursor = it.next_last_level_gfn;
                return JobStep::Yield;
            }
            if it.level <= KVM_MAX_HUGEPAGE_LEVEL
                && clear_leaf_bit(&it, self.wrprot, LockMode::Read, ctx.meter)
            {
                owe_flush(&mut self.flush, GfnRange::new(it.gfn, it.level.pages()));
            }
            it.next(ctx);
        }
        JobStep::Done { flush: self.flush }
    }
}

/// `kvm_tdp_mmu_recover_huge_pages()` (read lock): replace each table whose range may be mapped
/// huge again by a huge leaf built from one of its leaves, freeing the table through RCU; one
/// memslot flush at the end (or before a yield).
struct RecoverHugePagesJob {
    mmu: Arc<TdpMmuInner>,
    slot: Arc<Memslot>,
    cursor: Gfn,
    flush: bool,
}

impl RecoverHugePagesJob {
    /// `tdp_mmu_make_huge_spte()`: the first present leaf under the table at `it`.
    fn make_huge_spte_from_child(it: &TdpIter, ctx: &mut MmuCtx<'_, Read>) -> ChildLeaf {
        // SAFETY: `it.old_spte` is a present non-leaf entry read under `ctx.guard`.
        let child = unsafe { spte_to_child_pt(it.old_spte, ctx.guard) };
        let mut found = ChildLeaf::None;
        // The holder's work as of entering the table: what the virtual-time engine reads the
        // holder's clock from (the walk below adds at most a table's reads to it).
        let at = ctx.meter.clone();
        let held = ctx.held;
        for_each_tdp_pte_min_level(
            child,
            it.level.below(),
            PG_LEVEL_4K,
            it.gfn..it.gfn + it.level.pages(),
            ctx.guard,
            &mut TableReads::new(&mut *ctx.meter, &ctx.kvm.tables),
            |c, _| {
                // Checked against the parent iterator, so the caller's forward-progress guard
                // decides (KVM's -EAGAIN from tdp_mmu_make_huge_spte()).
                if it.made_progress() && held.needbreak(&at) {
                    found = ChildLeaf::Yield;
                    return IterAction::Stop;
                }
                if is_shadow_present_pte(c.old_spte) && is_last_spte(c.old_spte, c.level) {
                    found = ChildLeaf::Huge(make_huge_spte(c.old_spte, it.level));
                    return IterAction::Stop;
                }
                IterAction::Continue
            },
        );
        found
    }
}

/// What `tdp_mmu_make_huge_spte()` found under a table.
enum ChildLeaf {
    /// A huge SPTE built from the first present leaf.
    Huge(u64),
    /// No present leaf (`-ENOENT`).
    None,
    /// Someone waits for the lock (`-EAGAIN`): yield first.
    Yield,
}

impl MmuJob for RecoverHugePagesJob {
    fn name(&self) -> &'static str {
        "tdp_mmu_recover_huge_pages"
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Read
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let inner = &*self.mmu;
        let guard = epoch::pin();
        let ctx = &mut MmuCtx::new(kvm, held.read(), &guard, meter);
        let (start, end) = (self.slot.base_gfn, self.slot.end_gfn());
        let mut it = TdpIter::start(
            inner.root(),
            inner.root_level,
            PG_LEVEL_2M,
            self.cursor,
            &guard,
            ctx,
        );
        while it.valid && it.gfn < end {
            if TdpMmuInner::should_yield(&it, ctx) {
                // Flush before letting others in: they must not see the tables freed while
                // vCPUs still cache translations through them (tdp_mmu_iter_cond_resched(flush)).
                if self.flush {
                    kvm.flush_remote_tlbs_memslot(&self.slot, ctx.meter);
                    self.flush = false;
                }
                self.cursor = it.next_last_level_gfn;
                return JobStep::Yield;
            }
            let skip = it.level > KVM_MAX_HUGEPAGE_LEVEL
                || !is_shadow_present_pte(it.old_spte)
                // A leaf that could be huge would have had its parent recovered instead.
                || is_last_spte(it.old_spte, it.level)
                // A page only partly in the slot can't be made huge.
                || it.gfn < start
                || (it.gfn + it.level.pages()) > end
                || self.slot.dirty_track_enabled()
                || crate::x86::mmu::max_mapping_level(kvm, &self.slot, it.gfn) < it.level;
            if skip {
                it.next(ctx);
                continue;
            }
            let huge = match Self::make_huge_spte_from_child(&it, ctx) {
                ChildLeaf::Huge(huge) => huge,
                // Back to the top of the loop, whose yield check fires.
                ChildLeaf::Yield => continue,
                ChildLeaf::None => {
                    it.next(ctx);
                    continue;
                }
            };
            if inner.set_spte_atomic(ctx, &mut it, huge).is_err() {
                continue; // retry with the fresh old_spte
            }
            ctx.meter.huge_recovered += 1;
            self.flush = true;
            it.next(ctx);
        }
        // recover_huge_pages_range() flushes before dropping the lock and leaving RCU, so no
        // vCPU keeps using translations through the tables just handed to RCU.
        if std::mem::take(&mut self.flush) {
            kvm.flush_remote_tlbs_memslot(&self.slot, ctx.meter);
        }
        JobStep::Done { flush: None }
    }
}

/// `handle_removed_pt()` on tables built by hand: what it freezes, what it accounts, when the
/// tables are freed, and that a vCPU still holding the old entry cannot install under it.
#[cfg(test)]
mod handle_removed_pt_tests {
    use super::*;
    use crate::hw::page_table::{alloc_page_table, PageTableStats};
    use crate::kvm::vcpu::NoWait;

    /// `handle_removed_pt()` of the level-2M table `pt` at `BASE`, under the read lock
    /// (`shared`) or the write lock.
    fn remove(mmu: &TdpMmuInner, pt: &PageTable, shared: bool, guard: &Guard, meter: &mut Meter) {
        let kvm = Kvm::new(1, Box::new(NoWait), false);
        let mode = if shared {
            LockMode::Read
        } else {
            LockMode::Write
        };
        let held = kvm.mmu_lock.lock(mode);
        match held.typed() {
            TypedHeld::Read(h) => mmu.handle_removed_pt(
                &mut MmuCtx::new(&kvm, h, guard, meter),
                pt,
                PG_LEVEL_2M,
                BASE,
            ),
            TypedHeld::Write(h) => mmu.handle_removed_pt(
                &mut MmuCtx::new(&kvm, h, guard, meter),
                pt,
                PG_LEVEL_2M,
                BASE,
            ),
        }
    }

    /// A TDP MMU with an empty root and its own table counters.
    fn mmu() -> (TdpMmuInner, Arc<PageTableStats>) {
        let tables = Arc::new(PageTableStats::default());
        let root = Box::into_raw(alloc_page_table(&tables, TdpSpte::INVALID));
        let inner = TdpMmuInner {
            root,
            root_level: PT64_ROOT_4LEVEL,
            tables: Arc::clone(&tables),
            pages: Default::default(),
            lines: VmLineWrites::default(),
        };
        (inner, tables)
    }

    /// Where the removed table maps: the first 1G of guest memory.
    const BASE: Gfn = Gfn(0);

    /// A leaf as a fault would install it, accounted in the page stats.
    fn leaf(mmu: &TdpMmuInner, level: Level, gfn: u64) -> u64 {
        mmu.account_leaf(level, 1);
        make_spte(level, Pfn(0x10_0000 + gfn), true, false)
    }

    /// An unlinked 2M-level table (as its parent entry was just replaced): 2M leaves at 0 and
    /// 7, a 4K table at 3 holding 4K leaves at 0, 1 and 511, the rest non-present. Returns the
    /// table and its child.
    fn two_level_table(mmu: &TdpMmuInner) -> (*mut PageTable, *mut PageTable) {
        let child = Box::into_raw(alloc_page_table(&mmu.tables, TdpSpte::INVALID));
        // SAFETY: just allocated, not shared yet.
        let c = unsafe { &*child };
        for i in [0, 1, 511] {
            c.spt[i].store(
                leaf(mmu, PG_LEVEL_4K, 3 * 512 + i as u64),
                Ordering::Relaxed,
            );
        }
        let pt = Box::into_raw(alloc_page_table(&mmu.tables, TdpSpte::INVALID));
        // SAFETY: as above.
        let p = unsafe { &*pt };
        p.spt[0].store(leaf(mmu, PG_LEVEL_2M, 0), Ordering::Relaxed);
        p.spt[7].store(leaf(mmu, PG_LEVEL_2M, 7 * 512), Ordering::Relaxed);
        p.spt[3].store(make_nonleaf_spte(child as u64), Ordering::Relaxed);
        (pt, child)
    }

    /// Pins and flushes until the table counters say `n` tables were freed. Other tests pinned
    /// in the same process delay the global epoch but cannot stop it for good.
    fn wait_for_frees(tables: &PageTableStats, n: u64) {
        for _ in 0..1_000_000 {
            if tables.freed.load(Ordering::Relaxed) >= n {
                break;
            }
            epoch::pin().flush();
            std::thread::yield_now();
        }
        assert_eq!(tables.freed.load(Ordering::Relaxed), n);
    }

    fn removes_a_table_holding_leaves_and_a_nested_table(shared: bool) {
        let (mmu, tables) = mmu();
        let (pt, child) = two_level_table(&mmu);
        assert_eq!(mmu.pages_now(), [3, 2, 0]);
        assert_eq!(tables.live.load(Ordering::Relaxed), 3);
        let mut meter = Meter::default();
        {
            let guard = epoch::pin();
            // SAFETY: `pt` is unlinked (never linked) and handed over once.
            remove(&mmu, unsafe { &*pt }, shared, &guard, &mut meter);
            assert_eq!(mmu.pages_now(), [0, 0, 0], "every leaf accounted as gone");
            assert_eq!(meter.tables_freed, 2, "the table and its child");
            // Frozen in place; still readable while this guard is pinned.
            // SAFETY: freed only after `guard` is dropped.
            let (p, c) = unsafe { (&*pt, &*child) };
            for (t, present) in [(p, &[0, 3, 7][..]), (c, &[0, 1, 511][..])] {
                for (i, e) in t.spt.iter().enumerate() {
                    let v = e.load(Ordering::Relaxed);
                    if shared || present.contains(&i) {
                        assert_eq!(v, FROZEN_SPTE, "entry {i}");
                    } else {
                        // Under the write lock nobody can install: non-present entries stay.
                        assert_eq!(v, SHADOW_NONPRESENT_VALUE, "entry {i}");
                    }
                }
            }
            let frozen = if shared { 2 * 512 } else { 6 };
            assert_eq!(meter.spte_writes, frozen);
            guard.flush();
            assert_eq!(
                tables.freed.load(Ordering::Relaxed),
                0,
                "not freed while a walker that may have seen them is pinned"
            );
        }
        wait_for_frees(&tables, 2);
        assert_eq!(
            tables.live.load(Ordering::Relaxed),
            1,
            "only the root is left"
        );
    }

    impl TdpMmuInner {
        fn pages_now(&self) -> [i64; 3] {
            std::array::from_fn(|i| self.pages[i].load(Ordering::Relaxed))
        }
    }

    #[test]
    fn shared_removal_freezes_every_entry_recurses_accounts_and_frees_after_a_grace_period() {
        removes_a_table_holding_leaves_and_a_nested_table(true);
    }

    #[test]
    fn exclusive_removal_freezes_only_present_entries() {
        removes_a_table_holding_leaves_and_a_nested_table(false);
    }

    /// A vCPU that read an entry of the table before it was unlinked (non-present, or the
    /// child table it was about to split) and then tries to install a leaf with cmpxchg finds
    /// the entry frozen and fails; nothing is left mapped in freed memory.
    #[test]
    fn in_shared_mode_an_installer_that_saw_the_old_entry_fails_its_cmpxchg() {
        let (mmu, tables) = mmu();
        let (pt, child) = two_level_table(&mmu);
        // SAFETY: live until the removal below hands them to RCU, and this test's guard is
        // pinned until it is done with them.
        let (p, c) = unsafe { (&*pt, &*child) };
        let guard = epoch::pin();
        let seen_empty = p.spt[5].load(Ordering::Relaxed);
        let seen_child_empty = c.spt[9].load(Ordering::Relaxed);
        let mut meter = Meter::default();
        remove(&mmu, p, true, &guard, &mut meter);
        let new = make_spte(PG_LEVEL_2M, Pfn(0x20_0000), true, false);
        assert_eq!(p.spt[5].cmpxchg(seen_empty, new), Err(FROZEN_SPTE));
        assert_eq!(c.spt[9].cmpxchg(seen_child_empty, new), Err(FROZEN_SPTE));
        drop(guard);
        assert_eq!(mmu.pages_now(), [0, 0, 0]);
        wait_for_frees(&tables, 2);
    }

    /// An installer racing the removal either wins before the freeze (and the removal accounts
    /// its leaf as gone) or finds the entry frozen; the stats balance either way.
    #[test]
    fn an_installer_racing_a_shared_removal_wins_before_the_freeze_or_fails() {
        let new = make_spte(PG_LEVEL_4K, Pfn(0x30_0000), true, false);
        for _ in 0..200 {
            let (mmu, _) = mmu();
            let (pt, child) = two_level_table(&mmu);
            let (pt, child) = (pt as usize, child as usize);
            let installed = std::thread::scope(|s| {
                let mmu = &mmu;
                let installer = s.spawn(move || {
                    let _guard = epoch::pin();
                    // SAFETY: the removal hands the child to RCU; the test's guard below and
                    // this one keep it allocated while it is touched.
                    let c = unsafe { &*(child as *const PageTable) };
                    let seen = c.spt[2].load(Ordering::Relaxed);
                    // A fault that reads a frozen entry retries instead (kvm_tdp_mmu_map()).
                    let won = !is_frozen_spte(seen) && c.spt[2].cmpxchg(seen, new).is_ok();
                    if won {
                        mmu.account_leaf(PG_LEVEL_4K, 1);
                    }
                    won
                });
                let guard = epoch::pin();
                let mut meter = Meter::default();
                // SAFETY: unlinked, handed over once.
                let p = unsafe { &*(pt as *const PageTable) };
                remove(mmu, p, true, &guard, &mut meter);
                installer.join().unwrap()
            });
            assert_eq!(mmu.pages_now(), [0, 0, 0], "installed: {installed}");
        }
    }

    /// An entry another thread holds frozen is waited for: the removal takes the value the
    /// owner finally writes, and accounts it.
    #[test]
    fn shared_removal_waits_for_an_entry_frozen_by_another_thread() {
        let (mmu, tables) = mmu();
        let (pt, _) = two_level_table(&mmu);
        // SAFETY: live until the removal hands it to RCU; read only while pinned.
        let p = unsafe { &*pt };
        p.spt[7].store(FROZEN_SPTE, Ordering::Relaxed);
        mmu.account_leaf(PG_LEVEL_2M, -1);
        let owner_value = leaf(&mmu, PG_LEVEL_2M, 7 * 512);
        std::thread::scope(|s| {
            let mmu = &mmu;
            let remover = s.spawn(move || {
                let guard = epoch::pin();
                let mut meter = Meter::default();
                remove(mmu, p, true, &guard, &mut meter);
            });
            // Entries are frozen in order: once 6 is, the remover is at 7, where it must wait.
            while p.spt[6].load(Ordering::SeqCst) != FROZEN_SPTE && !remover.is_finished() {
                std::hint::spin_loop();
            }
            for _ in 0..10_000 {
                assert_ne!(
                    p.spt[8].load(Ordering::SeqCst),
                    FROZEN_SPTE,
                    "went past an entry another thread holds frozen"
                );
                std::thread::yield_now();
            }
            // The owner finishes its update.
            p.spt[7].store(owner_value, Ordering::SeqCst);
            remover.join().unwrap();
        });
        assert_eq!(
            mmu.pages_now(),
            [0, 0, 0],
            "the owner's leaf was taken down"
        );
        wait_for_frees(&tables, 2);
    }
}

#[cfg(test)]
mod clear_dirty_pt_masked_tests {
    use super::*;
    use crate::hw::page_table::{alloc_page_table, PageTableStats};
    use crate::kvm::vcpu::NoWait;

    /// `tdp_root_for_each_leaf_pte()` looks at the mask only at present leaves: once the mask
    /// is empty the walk reads on over entries that are not present up to the next present
    /// leaf, where it breaks.
    #[test]
    fn an_empty_mask_ends_the_walk_at_the_next_present_leaf() {
        // Root (level 4) → level 3 → level 2 → a 4K table for gfns 0–511, whose dirty leaves
        // are at 0, 1, 2 and 40 (nothing between 3 and 39).
        let tables = Arc::new(PageTableStats::default());
        let root = Box::into_raw(alloc_page_table(&tables, TdpSpte::INVALID));
        let mut parent = root as *const PageTable;
        for _ in 0..3 {
            let child = Box::into_raw(alloc_page_table(&tables, TdpSpte::INVALID));
            // SAFETY: `parent` is a table allocated just above and owned by this tree, which
            // the MMU's teardown frees (children through the entries linked here).
            unsafe { &*parent }.spt[0].store(make_nonleaf_spte(child as u64), Ordering::Relaxed);
            parent = child;
        }
        // SAFETY: as above; the last table is the 4K one.
        let leaves = unsafe { &*parent };
        for g in [0u64, 1, 2, 40] {
            let spte = make_spte(PG_LEVEL_4K, Pfn(0x1000 + g), true, false) | SHADOW_DIRTY_MASK;
            leaves.spt[g as usize].store(spte, Ordering::Relaxed);
        }
        let mmu = TdpMmu {
            inner: Arc::new(TdpMmuInner {
                root,
                root_level: PT64_ROOT_4LEVEL,
                tables,
                pages: Default::default(),
                lines: VmLineWrites::default(),
            }),
            split_alloc: SplitAlloc::default(),
        };
        let slot = Memslot::new(
            0,
            Gfn(0),
            512,
            crate::host::backing::Backing::Anonymous,
            Pfn(0x1000),
            0,
        );
        let kvm = Kvm::new(1, Box::new(NoWait), false);
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let guard = epoch::pin();
        let mut meter = Meter::default();
        let ctx = &mut MmuCtx::new(&kvm, held.write(), &guard, &mut meter);
        assert!(mmu.clear_dirty_pt_masked(ctx, &slot, 0, 0b111, false));
        assert_eq!(meter.sptes_dirty_cleared, 3);
        // The descent reads the 3 entries above the 4K table twice each (tdp_iter_next()
        // re-reads an entry before it steps through it), then entries 0 to 40 are read; with
        // the mask looked at on every entry the walk would end after reading entry 3.
        assert_eq!(meter.spte_reads, 6 + 41);
        assert!(leaves.spt[40].load(Ordering::Relaxed) & SHADOW_DIRTY_MASK != 0);
    }
}
