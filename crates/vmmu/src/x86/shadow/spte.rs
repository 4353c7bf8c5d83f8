//! SPTE primitives (mmu.c): making a leaf (`make_spte()`), setting, updating and clearing one
//! SPTE, dropping a leaf, and linking a shadow page below a non-leaf SPTE (`parent_ptes`).

use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::units::*;
use crate::x86::mmu::KvmPageFault;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::*;
use std::sync::atomic::AtomicU64;

/// The inputs of [`make_shadow_spte`], KVM's `make_spte()` arguments in its order (its `vcpu`
/// is the caller's `mmu`, its `new_spte` the result), plus `fault`: KVM's
/// `mark_page_dirty_in_slot()` finds the running vCPU itself.
pub(crate) struct MakeSpte<'a> {
    /// The shadow page the leaf goes in.
    pub sp: SpId,
    /// The memslot of `gfn`.
    pub slot: &'a Memslot,
    /// The access the guest's tables allow (`ACC_*`).
    pub pte_access: u8,
    /// The guest frame mapped.
    pub gfn: Gfn,
    /// The host frame it maps to.
    pub pfn: Pfn,
    /// The entry's current value.
    pub old_spte: u64,
    /// A prefetch, not a fault: the leaf starts without Accessed.
    pub prefetch: bool,
    /// From `FNAME(sync_spte)`: a page being synced is not made unsync again.
    pub synchronizing: bool,
    /// The host maps the page writable.
    pub host_writable: bool,
    /// The fault being handled, if any.
    pub fault: Option<&'a KvmPageFault>,
}

/// `make_spte()` for the shadow MMU: the leaf for `pfn` with `pte_access`. A writable mapping
/// of a gfn that holds a shadowed guest table is refused (`mmu_try_to_unsync_pages()` fails:
/// the gfn is write-tracked, or its last-level page cannot go unsync) and the returned
/// `wrprot` is true. A writable leaf in a logging slot marks the page dirty, in the memslot
/// version `fault` looked up and for its vCPU's dirty ring; without a fault (a prefetch, a
/// sync), in the memslot as it is now and in its bitmap.
pub(crate) fn make_shadow_spte(mmu: &mut LockedMmu<'_>, req: &MakeSpte<'_>) -> (u64, bool) {
    let MakeSpte {
        sp,
        slot,
        pte_access,
        gfn,
        pfn,
        old_spte,
        prefetch,
        synchronizing,
        host_writable,
        fault,
    } = *req;
    let level = mmu.st.sp(sp).role.level();
    let logging = fault.map_or(slot.dirty_track_enabled(), |f| f.dirty_logging);
    let vcpu = fault.map(|f| f.vcpu);
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
        && mmu_try_to_unsync_pages(mmu.st, gfn, synchronizing, prefetch, mmu.meter).is_err()
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
    /// `mmu_spte_clear_track_bits()`: clears a leaf (atomically if it has volatile bits) and
    /// updates the page stats. Returns the old value.
    pub(super) fn spte_clear_track_bits(
        &self,
        sptep: &AtomicU64,
        level: Level,
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
            account_leaf(&self.pages, level, -1);
        }
        old
    }

    /// `drop_spte()`: clears a leaf and removes it from its rmap.
    pub fn drop_spte(&mut self, sptep: SptepRef, meter: &mut Meter) {
        let level = self.sp(sptep.sp).role.level();
        let old = self.spte_clear_track_bits(self.sptep(sptep), level, meter);
        if is_shadow_present_pte(old) {
            self.rmap_remove(sptep, meter);
        }
    }

    /// `spte_write_protect()`: clears W (and MMU-writable when `pt_protect`). Returns whether
    /// a TLB flush is needed.
    pub(super) fn spte_write_protect(
        sptep: &AtomicU64,
        pt_protect: bool,
        meter: &mut Meter,
    ) -> bool {
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

    /// `spte_clear_dirty()`: clears D with one atomic bit clear (`test_and_clear_bit()`, as
    /// `__rmap_clear_dirty()` does since Linux 6.13). Linux 6.0 rewrites every leaf through
    /// `mmu_spte_update()`, whether D is set or not (an xchg when the CPU may change the leaf);
    /// the entries it leaves are the same, and only a leaf whose D was set is counted here.
    /// Returns whether D was set.
    pub(super) fn spte_clear_dirty(sptep: &AtomicU64, meter: &mut Meter) -> bool {
        let old = sptep.fetch_and(!SHADOW_DIRTY_MASK, std::sync::atomic::Ordering::SeqCst);
        if old & SHADOW_DIRTY_MASK == 0 {
            return false;
        }
        meter.spte_writes += 1;
        meter.sptes_dirty_cleared += 1;
        true
    }

    /// `mmu_page_add_parent_pte()`.
    pub(super) fn add_parent_pte(
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
        meter.rmap_desc_steps +=
            pte_list_remove(parent_pte, &mut self.sp_mut(child).parent_ptes) as u64;
        meter.rmap_removes += 1;
        mmu_spte_clear_no_track(self.sptep(parent_pte), meter);
    }
}

impl LockedMmu<'_> {
    /// `drop_large_spte()`: removes the huge leaf `sptep` before a table is linked there, with
    /// a flush of its range when `flush`.
    pub(super) fn drop_large_spte(&mut self, sptep: SptepRef, flush: bool) {
        let (level, gfn) = {
            let sp = self.st.sp(sptep.sp);
            (sp.role.level(), sp.get_gfn(sptep.index))
        };
        debug_assert!(level > PG_LEVEL_4K);
        self.st.drop_spte(sptep, self.meter);
        if flush {
            crate::x86::mmu::kvm_flush_remote_tlbs_gfn(self.kvm, gfn, level, self.meter);
        }
    }

    /// `__link_shadow_page()`: points the non-leaf `sptep` at `child` — dropping the huge leaf
    /// there first (with a flush when `flush`) — and records the parent.
    pub fn link_shadow_page(
        &mut self,
        cache: &mut PteListDescCache,
        sptep: SptepRef,
        child: SpId,
        flush: bool,
    ) {
        // A present entry here must be a leaf, hence a huge one: drop it (and flush if asked)
        // before installing the table.
        if is_shadow_present_pte(SpteCell::load(self.st.sptep(sptep))) {
            self.drop_large_spte(sptep, flush);
        }
        let spte = make_nonleaf_spte(self.st.sp(child).spt as u64);
        mmu_spte_set(self.st.sptep(sptep), spte, self.meter);
        self.st.add_parent_pte(cache, child, sptep, self.meter);
        let c = self.st.sp(child);
        if c.unsync_children > 0 || c.unsync {
            self.st.mark_unsync(sptep);
        }
    }
}

impl LockedVcpu<'_> {
    /// `link_shadow_page()`: `__link_shadow_page()` from the vCPU's descriptor cache, flushing
    /// the huge leaf it replaces.
    pub fn link_shadow_page(&mut self, sptep: SptepRef, child: SpId) {
        let cache = &mut self.caches.pte_list_desc_cache;
        self.mmu.link_shadow_page(cache, sptep, child, true);
    }
}

/// `mmu_try_to_unsync_pages()`: may `gfn` be mapped writable? Not if it holds an upper-level
/// guest table (write-tracked), nor while an unsync page is being synchronized; otherwise the
/// last-level pages shadowing it go unsync (the guest may now change that table freely until
/// its next TLB flush). A prefetch never unsyncs.
pub fn mmu_try_to_unsync_pages(
    st: &mut ShadowState,
    gfn: Gfn,
    synchronizing: bool,
    prefetch: bool,
    meter: &mut Meter,
) -> Result<(), Errno> {
    if st.gfn_is_write_tracked(gfn) {
        return Err(Errno::NotPermitted);
    }
    if !st.write_tracking {
        // The negative control: shadowed tables are mapped writable as if nothing shadowed them.
        return Ok(());
    }
    // for_each_gfn_valid_sp_with_gptes(): a walk of the gfn's hash bucket on every writable
    // mapping of a page that was not writable.
    for id in st.valid_sps_with_gptes(gfn, meter) {
        if synchronizing {
            return Err(Errno::NotPermitted);
        }
        if st.sp(id).unsync {
            continue;
        }
        if prefetch {
            return Err(Errno::Exists);
        }
        st.unsync_page(id);
    }
    Ok(())
}
