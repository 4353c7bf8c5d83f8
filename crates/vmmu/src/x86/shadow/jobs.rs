//! The shadow MMU's long operations, all walks of a memslot's rmaps under the write lock
//! (`__walk_slot_rmaps()`), resumable at KVM's yield points: write protection for dirty
//! logging, eager page splitting, and zapping collapsible SPTEs when logging stops.

use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::shadow::mmu_page::SptepRef;
use crate::x86::shadow::pages::*;
use crate::x86::shadow::rmap::SPLIT_DESC_CACHE_MIN_NR_OBJECTS;
use crate::x86::shadow::slot_rmap::gfn_to_index;
use crate::x86::shadow::spte::*;
use crate::x86::shadow::state::*;
use crate::x86::shadow::{adjust_goal_level, ShadowInner, SplitCaches};
use crate::x86::spte::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the walk does to each non-empty rmap head.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Action {
    /// `slot_rmap_write_protect()`: clear W, keep MMU-writable (the fast path may restore it).
    WriteProtect,
    /// `kvm_mmu_zap_collapsible_spte()`: zap small leaves of direct pages that could be huge.
    ZapCollapsible,
    /// `shadow_mmu_try_split_huge_pages()`: split every huge leaf one level down.
    Split,
}

/// `__walk_slot_rmaps()` over levels (in order) and `[start, end)` of a slot, as a job whose
/// cursor is (level, rmap index).
pub struct WalkSlotRmapsJob {
    inner: Arc<ShadowInner>,
    slot: Arc<Memslot>,
    action: Action,
    levels: Vec<Level>,
    level_idx: usize,
    start: Gfn,
    end: Gfn,
    /// Next rmap index to visit at the current level (`None`: start of the level).
    cursor: Option<usize>,
    /// An SPTE of the walked range changed without a flush yet.
    flush: bool,
    flush_on_yield: bool,
    name: &'static str,
}

impl WalkSlotRmapsJob {
    fn new(
        inner: Arc<ShadowInner>,
        slot: Arc<Memslot>,
        action: Action,
        levels: Vec<Level>,
        start: Gfn,
        end: Gfn,
        flush_on_yield: bool,
        name: &'static str,
    ) -> Self {
        WalkSlotRmapsJob {
            inner,
            slot,
            action,
            levels,
            level_idx: 0,
            start,
            end,
            cursor: None,
            flush: false,
            flush_on_yield,
            name,
        }
    }

    /// What the caller owes a flush for: the range walked, if an SPTE in it changed. (The
    /// rmap walk does not track which; KVM's callers flush the whole memslot.)
    fn owed_flush(&self) -> Option<GfnRange> {
        self.flush.then_some(GfnRange {
            start: self.start,
            end: self.end,
        })
    }

    /// `kvm_mmu_slot_remove_write_access()`: levels `start_level` to 1G, no flush on yield
    /// (the caller flushes the memslot afterwards).
    pub fn write_protect(inner: Arc<ShadowInner>, slot: Arc<Memslot>, start_level: Level) -> Self {
        let levels = (start_level.0..=KVM_MAX_HUGEPAGE_LEVEL.0)
            .map(Level)
            .collect();
        let (s, e) = (slot.base_gfn, slot.end_gfn());
        Self::new(
            inner,
            slot,
            Action::WriteProtect,
            levels,
            s,
            e,
            false,
            "slot_rmap_write_protect",
        )
    }

    /// `kvm_shadow_mmu_try_split_huge_pages()`: from the largest huge level down to
    /// `target_level + 1`, so huge pages are split recursively down to the target.
    pub fn split(
        inner: Arc<ShadowInner>,
        slot: Arc<Memslot>,
        start: Gfn,
        end: Gfn,
        target_level: Level,
    ) -> Self {
        let levels = (target_level.0 + 1..=KVM_MAX_HUGEPAGE_LEVEL.0)
            .rev()
            .map(Level)
            .collect();
        Self::new(
            inner,
            slot,
            Action::Split,
            levels,
            start,
            end,
            true,
            "shadow_mmu_try_split_huge_pages",
        )
    }

    /// `kvm_rmap_zap_collapsible_sptes()`: levels 4K to 2M (1G leaves are already as huge as
    /// they get), flushing before each yield.
    pub fn zap_collapsible(inner: Arc<ShadowInner>, slot: Arc<Memslot>) -> Self {
        let levels = vec![PG_LEVEL_4K, PG_LEVEL_2M];
        let (s, e) = (slot.base_gfn, slot.end_gfn());
        Self::new(
            inner,
            slot,
            Action::ZapCollapsible,
            levels,
            s,
            e,
            true,
            "kvm_rmap_zap_collapsible_sptes",
        )
    }
}

/// What splitting one rmap head ended with.
enum SplitStep {
    /// Nothing (more) to split here, or `-ENOSPC` ([`Errno::NoSpace`]).
    Done,
    /// `need_topup_split_caches_or_resched()`: someone waits for the lock.
    Yield,
    /// The split caches are low: drop the lock and top them up.
    NeedTopup,
}

impl MmuJob for WalkSlotRmapsJob {
    fn name(&self) -> &'static str {
        self.name
    }

    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }

    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let inner = Arc::clone(&self.inner);
        let mut split_caches = (self.action == Action::Split).then(|| inner.split_caches.lock());
        let mut st = inner.lock_state(held);
        let base = self.slot.base_gfn;
        if !st.rmaps.contains_key(&base.0) || self.start >= self.end {
            return JobStep::Done {
                flush: self.owed_flush(),
            };
        }
        let last = Gfn(self.end.0 - 1);
        while self.level_idx < self.levels.len() {
            let level = self.levels[self.level_idx];
            let end_idx = gfn_to_index(last, base, level);
            let mut idx = *self
                .cursor
                .get_or_insert(gfn_to_index(self.start, base, level));
            while idx <= end_idx {
                // slot_rmap_walk_next(): empty heads are skipped without a yield check.
                {
                    let heads = &st.rmaps[&base.0].rmap[level.0 as usize - 1];
                    while idx <= end_idx && heads[idx].is_empty() {
                        meter.rmap_reads += 1;
                        idx += 1;
                    }
                }
                if idx > end_idx {
                    break;
                }
                meter.rmap_reads += 1;
                let gfn = Gfn(((base.0 >> level.gfn_shift()) + idx as u64) << level.gfn_shift());
                match self.action {
                    Action::WriteProtect => {
                        self.flush |= st.rmap_write_protect(gfn.max(base), level, false, meter);
                    }
                    Action::ZapCollapsible => {
                        self.flush |=
                            zap_collapsible_spte(&mut st, &self.slot, gfn.max(base), level, meter);
                    }
                    Action::Split => {
                        let caches = split_caches.as_mut().expect("split holds its caches");
                        match try_split_rmap(
                            &mut LockedMmu::new(kvm, &mut st, meter),
                            &self.slot,
                            gfn.max(base),
                            level,
                            caches,
                            held,
                            &inner,
                        ) {
                            SplitStep::Done => {}
                            SplitStep::Yield => {
                                self.cursor = Some(idx);
                                return JobStep::Yield;
                            }
                            SplitStep::NeedTopup => {
                                self.cursor = Some(idx);
                                return JobStep::NeedTopup;
                            }
                        }
                    }
                }
                idx += 1;
                if held.needbreak() && idx <= end_idx {
                    self.cursor = Some(idx);
                    if self.flush && self.flush_on_yield {
                        kvm.flush_remote_tlbs_range(self.slot.base_gfn, self.slot.npages, meter);
                        self.flush = false;
                    }
                    return JobStep::Yield;
                }
            }
            self.level_idx += 1;
            self.cursor = None;
        }
        JobStep::Done {
            flush: self.owed_flush(),
        }
    }

    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        // topup_split_caches(), with slots_lock held and mmu_lock dropped.
        let mut c = self.inner.split_caches.lock();
        c.desc.topup(SPLIT_DESC_CACHE_MIN_NR_OBJECTS);
        meter.tables_allocated += c.shadow_page.topup(1, &kvm.tables) as u64;
    }
}

/// `kvm_mmu_zap_collapsible_spte()`: zaps each small leaf of a direct page in the rmap of
/// (`gfn`, `level`) whose range could now be mapped by a larger page. Returns whether a flush
/// is needed.
fn zap_collapsible_spte(
    st: &mut ShadowState,
    slot: &Memslot,
    gfn: Gfn,
    level: Level,
    meter: &mut Meter,
) -> bool {
    let mut need_flush = false;
    // for_each_rmap_spte() with `goto restart` after each zap.
    loop {
        let collapsible = st.rmap_head(gfn, level).and_then(|h| {
            h.iter().find(|&s| {
                meter.spte_reads += 1;
                let sp = st.sp(s.sp);
                // Indirect last-level pages shadow a guest table that maps 4K: never
                // collapsible.
                sp.role.direct()
                    && sp.role.level()
                        < adjust_goal_level(
                            st,
                            sp.gfn,
                            crate::x86::mmu::max_mapping_level(slot, sp.gfn),
                        )
            })
        });
        let Some(sptep) = collapsible else {
            return need_flush;
        };
        st.drop_spte(sptep, meter);
        need_flush = true;
    }
}

/// `shadow_mmu_try_split_huge_pages()` on the rmap of (`gfn`, `level`): splits each huge leaf
/// it holds that is on a valid, sync page, restarting the rmap after each split.
fn try_split_rmap(
    mmu: &mut LockedMmu<'_>,
    slot: &Memslot,
    gfn: Gfn,
    level: Level,
    caches: &mut SplitCaches,
    held: &MmuLockHeld,
    inner: &ShadowInner,
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
            inner.split_refused_enospc.fetch_add(1, Ordering::Relaxed);
            return SplitStep::Done;
        }
        if held.needbreak() {
            return SplitStep::Yield;
        }
        if caches.desc.nr_objs() < SPLIT_DESC_CACHE_MIN_NR_OBJECTS
            || caches.shadow_page.nr_objs() < 1
        {
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
        mmu.rmap_add(&mut caches.desc, slot, sp, index, g, access);
    }
    mmu.link_shadow_page(&mut caches.desc, huge_id, huge_index, sp, flush);
}
