//! The shadow MMU's long operations, all walks of a memslot's rmaps under the write lock
//! (`__walk_slot_rmaps()`), resumable at KVM's yield points: write protection for dirty
//! logging, eager page splitting ([`split`]), and zapping collapsible SPTEs when logging stops.
//!
//! [`split`]: crate::x86::shadow::split

use crate::kvm::host_caches::{HostCaches, MetaRegion};
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::shadow::fault::adjust_goal_level;
use crate::x86::shadow::inner::ShadowInner;
use crate::x86::shadow::rmap::{gfn_to_index, KvmRmapHead};
use crate::x86::shadow::split::{try_split_rmap, SplitStep};
use crate::x86::shadow::state::*;
use crate::x86::spte::*;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the walk does to each non-empty rmap head.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Action {
    /// `slot_rmap_write_protect()`: clear W, keep MMU-writable (the fast path may restore it).
    WriteProtect,
    /// `__rmap_clear_dirty()`: clear D so the CPU logs the next write (PML).
    ClearDirty,
    /// `kvm_mmu_zap_collapsible_spte()`: zap small leaves of direct pages that could be huge.
    ZapCollapsible,
    /// `shadow_mmu_try_split_huge_pages()`: split every huge leaf one level down.
    Split,
}

impl Action {
    /// The KVM function the walk runs for each rmap head: the job's name.
    fn name(self) -> &'static str {
        match self {
            Action::WriteProtect => "slot_rmap_write_protect",
            Action::ClearDirty => "rmap_clear_dirty",
            Action::ZapCollapsible => "kvm_rmap_zap_collapsible_sptes",
            Action::Split => "shadow_mmu_try_split_huge_pages",
        }
    }

    /// `__walk_slot_rmaps()`'s `flush_on_yield`: whether SPTEs changed so far are flushed
    /// before the lock is dropped. Not for write protection or clearing D: their caller flushes
    /// the memslot afterwards.
    fn flush_on_yield(self) -> bool {
        !matches!(self, Action::WriteProtect | Action::ClearDirty)
    }
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
}

impl WalkSlotRmapsJob {
    fn new(
        inner: Arc<ShadowInner>,
        slot: Arc<Memslot>,
        action: Action,
        levels: Vec<Level>,
        start: Gfn,
        end: Gfn,
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
        Self::new(inner, slot, Action::WriteProtect, levels, s, e)
    }

    /// `kvm_mmu_slot_leaf_clear_dirty()` (shadow part): `walk_slot_rmaps_4k()` with
    /// `__rmap_clear_dirty()`, no flush on yield (the caller flushes the memslot afterwards).
    pub fn clear_dirty(inner: Arc<ShadowInner>, slot: Arc<Memslot>) -> Self {
        let (s, e) = (slot.base_gfn, slot.end_gfn());
        Self::new(inner, slot, Action::ClearDirty, vec![PG_LEVEL_4K], s, e)
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
        Self::new(inner, slot, Action::Split, levels, start, end)
    }

    /// `kvm_rmap_zap_collapsible_sptes()`: levels 4K to 2M (1G leaves are already as huge as
    /// they get), flushing before each yield.
    pub fn zap_collapsible(inner: Arc<ShadowInner>, slot: Arc<Memslot>) -> Self {
        let levels = vec![PG_LEVEL_4K, PG_LEVEL_2M];
        let (s, e) = (slot.base_gfn, slot.end_gfn());
        Self::new(inner, slot, Action::ZapCollapsible, levels, s, e)
    }
}

/// The reads of one level's rmap heads by a walk: each counts in `rmap_reads`, and each new
/// line of the array is the next line of a sequential scan in the host's caches
/// (`crate::kvm::host_caches`), when they are modelled.
struct RmapScan<'a> {
    caches: Option<&'a HostCaches>,
    meta: MetaRegion,
    line: u64,
}

impl<'a> RmapScan<'a> {
    fn new(kvm: &'a Kvm, meta: MetaRegion) -> Self {
        RmapScan {
            caches: kvm.caches().filter(|_| !meta.is_unplaced()),
            meta,
            line: u64::MAX,
        }
    }

    /// The walk reads head `idx`.
    #[inline]
    fn read(&mut self, idx: usize, meter: &mut Meter) {
        meter.rmap_reads += 1;
        if let Some(caches) = self.caches {
            let line = self
                .meta
                .line_of((idx * std::mem::size_of::<KvmRmapHead>()) as u64);
            if line.line != self.line {
                self.line = line.line;
                caches.read_line(line, meter);
            }
        }
    }
}

impl MmuJob for WalkSlotRmapsJob {
    fn name(&self) -> &'static str {
        self.action.name()
    }

    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }

    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let inner = Arc::clone(&self.inner);
        let mut split_caches = (self.action == Action::Split).then(|| inner.split_caches.lock());
        let held = held.write();
        let mut st = inner.lock_state(held);
        let base = self.slot.base_gfn;
        if !st.rmaps.contains_key(&base.0) || self.start >= self.end {
            return JobStep::Done {
                flush: self.owed_flush(),
            };
        }
        let last = self.end - 1;
        while self.level_idx < self.levels.len() {
            let level = self.levels[self.level_idx];
            let end_idx = gfn_to_index(last, base, level);
            let mut idx = *self
                .cursor
                .get_or_insert(gfn_to_index(self.start, base, level));
            // The walk reads the level's array in ascending order: a sequential scan of its
            // lines through the running core's caches, when they are modelled.
            let mut scan = RmapScan::new(kvm, st.rmaps[&base.0].meta[level.0 as usize - 1]);
            while idx <= end_idx {
                // slot_rmap_walk_next(): empty heads are skipped without a yield check.
                {
                    let heads = &st.rmaps[&base.0].rmap[level.0 as usize - 1];
                    while idx <= end_idx && heads[idx].is_empty() {
                        scan.read(idx, meter);
                        idx += 1;
                    }
                }
                if idx > end_idx {
                    break;
                }
                scan.read(idx, meter);
                let gfn = Gfn(((base.0 >> level.gfn_shift()) + idx as u64) << level.gfn_shift());
                match self.action {
                    Action::WriteProtect => {
                        self.flush |= st.rmap_write_protect(gfn.max(base), level, false, meter);
                    }
                    Action::ClearDirty => {
                        self.flush |= st.rmap_clear_dirty(gfn.max(base), level, meter);
                    }
                    Action::ZapCollapsible => {
                        self.flush |= zap_collapsible_spte(
                            kvm,
                            &mut st,
                            &self.slot,
                            gfn.max(base),
                            level,
                            meter,
                        );
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
                        ) {
                            SplitStep::Done => {}
                            SplitStep::NoSpace => {
                                inner.split_refused_enospc.fetch_add(1, Ordering::Relaxed);
                            }
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
                if held.needbreak(meter) && idx <= end_idx {
                    self.cursor = Some(idx);
                    if self.flush && self.action.flush_on_yield() {
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
        self.inner.split_caches.lock().topup(kvm, meter);
    }
}

/// `kvm_mmu_zap_collapsible_spte()`: zaps each small leaf of a direct page in the rmap of
/// (`gfn`, `level`) whose range could now be mapped by a larger page. Returns whether a flush
/// is needed.
fn zap_collapsible_spte(
    kvm: &Kvm,
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
                            crate::x86::mmu::max_mapping_level(kvm, slot, sp.gfn),
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
