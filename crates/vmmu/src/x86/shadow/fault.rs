//! The direct fault path (mmu.c): `direct_page_fault()` and `direct_map()`, which walk from the
//! root creating direct pages down to the goal level, `mmu_set_spte()`, which installs the leaf,
//! and `direct_pte_prefetch()`, which maps its neighbours. Shadow paging's `FNAME(fetch)` ends
//! in `direct_map()` below a guest huge page.

use crate::kvm::memslot::Memslot;
use crate::kvm::mmu::RetPf;
use crate::kvm::mmu_ctx::MmuCtx;
use crate::kvm::mmu_lock::Write;
use crate::units::*;
use crate::x86::mmu::KvmPageFault;
use crate::x86::shadow::inner::{ShadowInner, SHADOW_ROOT_LEVEL};
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::PTE_PREFETCH_NUM;
use crate::x86::shadow::spte::*;
use crate::x86::shadow::state::*;
use crate::x86::shadow::vcpu::VcpuMmuCaches;
use crate::x86::spte::*;

/// `kvm_mmu_hugepage_adjust()`'s shadow part: a level a last-level guest table forbids is
/// lowered (`lpage_info.disallow_lpage`).
pub(super) fn adjust_goal_level(st: &ShadowState, gfn: Gfn, mut level: Level) -> Level {
    while level > PG_LEVEL_4K && st.lpage_disallowed(gfn, level) {
        level = level.below();
    }
    level
}

/// `mmu_set_spte()`: installs the leaf for `gfn` (`pfn`, `pte_access`) at `sptep`, replacing
/// a non-leaf or a leaf with another PFN, and adds it to the rmap. `fault` is `None` for a
/// prefetch.
// KVM's mmu_set_spte() takes the same arguments in the same order.
pub(crate) fn mmu_set_spte(
    vcpu: &mut LockedVcpu<'_>,
    slot: &Memslot,
    sptep: SptepRef,
    pte_access: u8,
    gfn: Gfn,
    pfn: Pfn,
    fault: Option<&KvmPageFault>,
) -> RetPf {
    let LockedVcpu { mmu, caches } = vcpu;
    let level = mmu.st.sp(sptep.sp).role.level();
    let host_writable = fault.is_none_or(|f| f.map_writable);
    let prefetch = fault.is_none();
    let write_fault = fault.is_some_and(|f| f.write);
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
    let req = MakeSpte {
        sp: sptep.sp,
        slot,
        pte_access,
        gfn,
        pfn,
        old_spte: cur,
        prefetch,
        synchronizing: false,
        host_writable,
        fault,
    };
    let (spte, wrprot) = make_shadow_spte(mmu, &req);
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
        mmu.rmap_add(
            &mut caches.pte_list_desc_cache,
            slot,
            sptep,
            gfn,
            pte_access,
        );
    } else {
        // Already mapped, but the access may have changed (kvm_mmu_page_set_access()).
        mmu.st
            .sp_mut(sptep.sp)
            .set_translation(sptep.index, gfn, pte_access);
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

/// `direct_pte_prefetch()`: after a 4K fault on `sptep` in a direct page, maps the other
/// non-present entries of its aligned group of `PTE_PREFETCH_NUM` speculatively (without the
/// Accessed bit), unless the memory logs dirty pages: a prefetched writable leaf would dirty a
/// page the guest never wrote.
pub(crate) fn direct_pte_prefetch(vcpu: &mut LockedVcpu<'_>, sptep: SptepRef) {
    let SptepRef { sp: id, index } = sptep;
    let sp = vcpu.mmu.st.sp(id);
    if sp.role.level() > PG_LEVEL_4K || !sp.role.direct() || sp.role.ad_disabled() != 0 {
        return;
    }
    let first = index & !(PTE_PREFETCH_NUM - 1);
    let mut run: Option<usize> = None;
    for i in first..=first + PTE_PREFETCH_NUM {
        let stop = i == first + PTE_PREFETCH_NUM
            || i == index
            || is_shadow_present_pte(SpteCell::load(vcpu.mmu.st.sptep(SptepRef::new(id, i))));
        if !stop {
            run.get_or_insert(i);
            continue;
        }
        let Some(start) = run.take() else {
            continue;
        };
        // direct_pte_prefetch_many()
        let access = vcpu.mmu.st.sp(id).role.access() as u8;
        let gfn = vcpu.mmu.st.sp(id).get_gfn(start);
        let Some(slot) = vcpu.mmu.kvm.slot_by_gfn(gfn) else {
            return;
        };
        let readonly = slot.flags() & crate::kvm::memslot::KVM_MEM_READONLY != 0;
        if readonly || (access & ACC_WRITE_MASK != 0 && slot.dirty_track_enabled()) {
            return;
        }
        // kvm_prefetch_pages() maps nothing when the run does not fit in the memslot.
        if !slot.contains(vcpu.mmu.st.sp(id).get_gfn(i - 1)) {
            return;
        }
        for j in start..i {
            let g = vcpu.mmu.st.sp(id).get_gfn(j);
            let pfn = slot.gfn_to_pfn(g);
            // kvm_prefetch_pages() takes pages with get_user_pages_fast_only(): it stops at the
            // first page the host does not map (swapped out), or whose mapping an open
            // invalidation is removing; those stay unmapped until they fault.
            if !vcpu.mmu.kvm.host_page_mapped(pfn, g) {
                return;
            }
            mmu_set_spte(vcpu, &slot, SptepRef::new(id, j), access, g, pfn, None);
        }
    }
}

/// `direct_page_fault()` under the write lock: `make_mmu_pages_available()`, then
/// `direct_map()`: walk from the root, creating (or finding) a direct page below every
/// level above the goal, then install the leaf.
pub(super) fn direct_page_fault(
    inner: &ShadowInner,
    ctx: &mut MmuCtx<'_, Write>,
    fault: &KvmPageFault,
    caches: &mut VcpuMmuCaches,
) -> RetPf {
    locked_page_fault(
        inner,
        ctx,
        fault,
        caches,
        // A root zapped by kvm_mmu_zap_all_fast() is put and a new one loaded.
        &mut |mmu, caches| {
            crate::x86::shadow::root::ensure_root(mmu, caches, inner).ok_or(RetPf::Retry)
        },
        &mut |vcpu, root| {
            let goal_level = adjust_goal_level(vcpu.mmu.st, fault.gfn, fault.goal_level);
            direct_map(vcpu, fault, (root, SHADOW_ROOT_LEVEL), goal_level, ACC_ALL)
        },
    )
}

/// The locked part of a shadow-MMU fault, as `direct_page_fault()` and `FNAME(page_fault)`
/// both run it: `page_fault_handle_page_track()` (a write to a write-tracked gfn, an upper-level
/// guest table, is emulated rather than mapped), `make_mmu_pages_available()`, the root
/// `root_of` gives, then `map` from it; a write the mapping refused (`RET_PF_WRITE_PROTECTED`)
/// is emulated too.
pub(super) fn locked_page_fault(
    inner: &ShadowInner,
    ctx: &mut MmuCtx<'_, Write>,
    fault: &KvmPageFault,
    caches: &mut VcpuMmuCaches,
    root_of: &mut dyn FnMut(&mut LockedMmu<'_>, &mut VcpuMmuCaches) -> Result<SpId, RetPf>,
    map: &mut dyn FnMut(&mut LockedVcpu<'_>, SpId) -> RetPf,
) -> RetPf {
    let (kvm, meter) = (ctx.kvm, &mut *ctx.meter);
    let mut st = inner.lock_state(ctx.held);
    let ret = if fault.write && st.gfn_is_write_tracked(fault.gfn) {
        RetPf::Emulated
    } else {
        let mut mmu = LockedMmu::new(kvm, &mut st, meter);
        if mmu.make_mmu_pages_available().is_err() {
            return RetPf::NoSpace;
        }
        let root = match root_of(&mut mmu, caches) {
            Ok(root) => root,
            Err(ret) => return ret,
        };
        map(&mut LockedVcpu::new(mmu, caches), root)
    };
    if ret == RetPf::Emulated {
        crate::x86::shadow::write_track::emulate_write(
            &mut LockedMmu::new(kvm, &mut st, meter),
            fault,
        );
    }
    ret
}

/// `direct_map()`, and the second loop of `FNAME(fetch)` below a guest huge page: from the
/// page and level `from` down to `goal_level`, finds or creates a direct page of `access`
/// below each level (a table of other access is dropped first, `validate_direct_spte()`; a
/// huge leaf in the way is split by the link), installs the leaf and prefetches its
/// neighbours.
pub(crate) fn direct_map(
    vcpu: &mut LockedVcpu<'_>,
    fault: &KvmPageFault,
    from: (SpId, Level),
    goal_level: Level,
    access: u8,
) -> RetPf {
    let (mut id, mut level) = from;
    loop {
        vcpu.mmu.meter.spte_reads += 1;
        let index = fault.addr.spte_index(level);
        let base_gfn = fault.gfn.round_for_level(level);
        let sptep = SptepRef::new(id, index);
        vcpu.mmu.st.touch_spte(sptep, vcpu.mmu.meter);
        if level == goal_level {
            // The frame kvm_faultin_pfn() returned: for a read of memory nobody wrote, the
            // (huge) zero page's, as the host maps it at the leaf's first page; else the
            // slot's frame of the leaf's first page.
            let pfn = if crate::host::memory::HostMemory::is_zero_pfn(fault.pfn) {
                vcpu.mmu.kvm.host_pfn(&fault.slot, base_gfn)
            } else {
                fault.slot.gfn_to_pfn(base_gfn)
            };
            let r = mmu_set_spte(vcpu, &fault.slot, sptep, access, base_gfn, pfn, Some(fault));
            if r != RetPf::Spurious {
                direct_pte_prefetch(vcpu, sptep);
            }
            return r;
        }
        let spte = SpteCell::load(vcpu.mmu.st.sptep(sptep));
        if is_shadow_present_pte(spte) && !is_large_pte(spte) {
            let child = vcpu.mmu.st.spte_to_child_sp(spte);
            if vcpu.mmu.st.sp(child).role.access() as u8 == access {
                id = child;
                level = level.below();
                continue;
            }
            vcpu.mmu.st.drop_parent_pte(child, sptep, vcpu.mmu.meter);
            crate::x86::mmu::kvm_flush_remote_tlbs_gfn(
                vcpu.mmu.kvm,
                base_gfn,
                level,
                vcpu.mmu.meter,
            );
        }
        let Ok(child) = vcpu.get_child_sp(sptep, base_gfn, true, access) else {
            unreachable!("no table is linked here any more");
        };
        if is_large_pte(spte) {
            // A huge leaf is split by the fault: link_shadow_page() drops it and flushes.
            vcpu.mmu.meter.split_in_fault += 1;
        }
        vcpu.link_shadow_page(sptep, child);
        id = child;
        level = level.below();
    }
}
