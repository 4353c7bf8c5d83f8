//! Shadow paging (`paging_tmpl.h` and the indirect half of mmu.c): faults that walk the guest's
//! own page tables first (`FNAME(page_fault)`, `FNAME(fetch)`), shadow pages for guest tables,
//! write protection of guest table pages with emulation of the writes that hit them
//! (`kvm_mmu_track_write()`), and the resync of one entry of an unsync page from its guest PTE
//! (`FNAME(sync_spte)`; syncing whole pages is [`unsync`]'s).
//!
//! [`unsync`]: crate::x86::shadow::unsync
//!
//! Simplifications: 4-level 64-bit guest paging only; no prefetch of neighbouring guest PTEs
//! (`FNAME(pte_prefetch)`); an emulated write is performed and tracked under the same hold of
//! `mmu_lock` as the fault that found it (KVM releases the lock, emulates, then takes it again
//! in `kvm_mmu_track_write()`), and is never unprotected-and-retried
//! (`kvm_mmu_write_protect_fault()`); the write-tracking check of
//! `page_fault_handle_page_track()` runs under the lock.

use crate::kvm::meter::Meter;
use crate::kvm::mmu::RetPf;
use crate::kvm::mmu_ctx::MmuCtx;
use crate::kvm::mmu_lock::Write;
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::guest_paging::{gpte_to_gfn_lvl, GuestMemory, GuestWalker, Pt64, PtType};
use crate::x86::mmu::KvmPageFault;
use crate::x86::shadow::fault::{adjust_goal_level, direct_map};
use crate::x86::shadow::inner::{ShadowInner, SHADOW_ROOT_LEVEL};
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::spte::*;
use crate::x86::shadow::state::*;
use crate::x86::shadow::unsync::*;
use crate::x86::shadow::vcpu::VcpuMmuCaches;
use crate::x86::spte::*;
use std::sync::atomic::Ordering;

/// `FNAME(sync_spte)`: re-reads the guest PTE behind entry `i` of the unsync page `id` and
/// brings the SPTE in line: dropped if the guest PTE is gone or maps another frame, narrowed if
/// its access changed. Returns `Zap` if the guest table could not be read. Simplified from `FNAME(prefetch_invalid_gpte)`: only a non-present guest PTE drops
/// the SPTE; its reserved-bit check (the builder never sets reserved bits) and its Accessed-bit
/// check (KVM also drops an SPTE whose guest PTE has A clear; here it is kept) are left out.
pub(super) fn sync_spte(mmu: &mut LockedMmu<'_>, id: SpId, i: usize) -> SyncPageResult {
    mmu.meter.sptes_synced += 1;
    let sp = mmu.st.sp(id);
    let pte_gpa = sp.gfn.to_gpa() + i as u64 * 8;
    mmu.meter.guest_pte_reads += 1;
    let Some(gpte) = mmu.kvm.read_gpa_u64(pte_gpa) else {
        return SyncPageResult::Zap;
    };
    let sptep = SptepRef::new(id, i);
    // The page's role says which format its guest table has: EPT12 for a nested guest's.
    let ept = crate::x86::shadow::nested::ept12_format(sp.role);
    let pt: &dyn PtType = if sp.role.guest_mode() { &ept } else { &Pt64 };
    if !pt.is_present(gpte) {
        mmu.st.drop_spte(sptep, mmu.meter);
        return SyncPageResult::Flush;
    }
    let gfn = gpte_to_gfn_lvl(gpte, PG_LEVEL_4K);
    let mut pte_access = sp.role.access() as u8 & pt.access(gpte);
    pt.protect_clean_gpte(&mut pte_access, gpte);
    if gfn != sp.get_gfn(i) {
        mmu.st.drop_spte(sptep, mmu.meter);
        return SyncPageResult::Flush;
    }
    if sp.get_access(i) == pte_access {
        return SyncPageResult::NoFlush;
    }
    mmu.st.sp_mut(id).set_translation(i, gfn, pte_access);
    let spte = SpteCell::load(mmu.st.sptep(sptep));
    let Some(slot) = mmu.kvm.slot_by_gfn(gfn) else {
        mmu.st.drop_spte(sptep, mmu.meter);
        return SyncPageResult::Flush;
    };
    let req = MakeSpte {
        sp: id,
        slot: &slot,
        pte_access,
        gfn,
        pfn: spte_to_pfn(spte),
        old_spte: spte,
        prefetch: true,
        synchronizing: true,
        host_writable: is_host_writable_spte(spte),
        fault: None,
    };
    let (new, _) = make_shadow_spte(mmu, &req);
    SyncPageResult::from_flush(mmu_spte_update(
        mmu.st.sptep(sptep),
        new | (spte & SHADOW_ACCESSED_MASK),
        mmu.meter,
    ))
}

/// `kvm_mmu_track_write()`: the guest wrote (by emulation) 8 bytes at `gpa` in a page that holds
/// shadowed guest tables. The shadow entries the write may have changed are zapped (the next
/// fault rebuilds them from the new guest PTE); a non-leaf table written three times in a row
/// without being used by a fault is taken for a page the guest reuses, and zapped whole
/// (`detect_write_flooding()`).
pub fn track_write(mmu: &mut LockedMmu<'_>, gpa: Gpa) {
    if mmu.st.indirect_shadow_pages == 0 {
        return;
    }
    let gfn = gpa.to_gfn();
    let index = ((gpa.0 % PAGE_SIZE) / 8) as usize;
    let mut invalid_list = Vec::new();
    let mut flush = false;
    for id in mmu.st.valid_sps_with_gptes(gfn, mmu.meter) {
        if mmu.st.sp(id).role.invalid() {
            continue;
        }
        if mmu.st.sp(id).role.level() > PG_LEVEL_4K {
            let sp = mmu.st.sp_mut(id);
            sp.write_flooding_count += 1;
            if sp.write_flooding_count >= 3 {
                mmu.st.mmu_flooded += 1;
                mmu.st.prepare_zap_page(id, &mut invalid_list, mmu.meter);
                continue;
            }
        }
        let entry = SpteCell::load(mmu.st.sptep(SptepRef::new(id, index)));
        mmu.st.zap_pte(id, index, None, mmu.meter);
        flush |= is_shadow_present_pte(entry);
    }
    mmu.remote_flush_or_zap(&mut invalid_list, flush);
}

/// `FNAME(gpte_changed)`: the guest PTE the walk read at `level` is no longer there.
fn gpte_changed(kvm: &Kvm, gw: &GuestWalker, level: Level, meter: &mut Meter) -> bool {
    meter.guest_pte_reads += 1;
    kvm.read_gpa_u64(gw.pte_gpa[level.0 as usize]) != Some(gw.ptes[level.0 as usize])
}

/// `FNAME(page_fault)` under the write lock: `make_mmu_pages_available()`, the write-tracking
/// check, then `FNAME(fetch)` from the root `root_of` gives (shadow paging's one root, or a
/// nested guest's current root); a write the shadow MMU refuses (a guest table) is emulated.
/// The guest walk (64-bit or EPT12) was done by the front half.
pub fn page_fault(
    inner: &ShadowInner,
    ctx: &mut MmuCtx<'_, Write>,
    fault: &KvmPageFault,
    caches: &mut VcpuMmuCaches,
    root_of: &mut dyn FnMut(&mut LockedMmu<'_>, &mut VcpuMmuCaches) -> Result<SpId, RetPf>,
) -> RetPf {
    let gw = fault
        .guest
        .as_ref()
        .expect("shadow paging faults carry their guest walk");
    crate::x86::shadow::fault::locked_page_fault(
        inner,
        ctx,
        fault,
        caches,
        root_of,
        &mut |vcpu, root| fetch(vcpu, root, fault, gw),
    )
}

/// `x86_emulate_instruction()` for a guest store the shadow MMU refused to map writable (it hit
/// a shadowed guest table): the store goes to guest memory, and the page-track notifier zaps
/// what it changed (`kvm_mmu_track_write()`).
pub(super) fn emulate_write(mmu: &mut LockedMmu<'_>, fault: &KvmPageFault) {
    mmu.meter.pf_emulated += 1;
    let gpa = fault.gfn.to_gpa() + fault.word as u64 * 8;
    let pfn = fault.slot.gfn_to_pfn(fault.gfn);
    // emulator_write_phys() writes through the host's user mapping.
    mmu.kvm.host.host_write(pfn);
    // Release pairs with the Acquire of KVM's own guest-table reads.
    mmu.kvm
        .host
        .access_word(pfn, fault.word as u64)
        .store(fault.value, Ordering::Release);
    // emulator_write_phys() -> kvm_vcpu_write_guest(): the page is dirtied like any other.
    fault.mark_page_dirty(mmu.kvm, mmu.meter);
    track_write(mmu, gpa);
}

/// `FNAME(fetch)`: walks the shadow tables for `fault.addr`, finding or creating an indirect
/// page for each guest table above the guest's leaf (checking after each that the guest PTE
/// that led to it is unchanged), then direct pages below a guest huge page down to the level
/// the host allows, and installs the leaf with the walk's access.
fn fetch(vcpu: &mut LockedVcpu<'_>, root: SpId, fault: &KvmPageFault, gw: &GuestWalker) -> RetPf {
    // The root is write-protected (or about to be zapped): its gpte cannot change under us.
    if gpte_changed(vcpu.mmu.kvm, gw, SHADOW_ROOT_LEVEL, vcpu.mmu.meter) {
        return RetPf::Retry;
    }
    let (mut id, mut level) = (root, SHADOW_ROOT_LEVEL);
    // Indirect pages, one per guest table.
    while level > gw.level {
        vcpu.mmu.st.sp_mut(id).write_flooding_count = 0;
        vcpu.mmu.meter.spte_reads += 1;
        let index = fault.addr.spte_index(level);
        let child_level = level.below();
        let table_gfn = gw.table_gfn[child_level.0 as usize];
        let access = gw.pt_access[child_level.0 as usize];
        let sptep = SptepRef::new(id, index);
        let child = vcpu.get_child_sp(sptep, table_gfn, false, access);
        // The guest needs no TLB flush to make a PTE present, so a table with unsync pages
        // below it must be synced before it is linked.
        if let Ok(c) = child {
            if vcpu.mmu.st.sp(c).unsync_children > 0 {
                mmu_sync_children(&mut vcpu.mmu, c);
            }
        }
        // Whether the table was just shadowed (and so write-protected) or was linked already,
        // check the PTE that led here is still what the walk read: another vCPU may have
        // synced an unsync table since the walk ran without the lock.
        if gpte_changed(vcpu.mmu.kvm, gw, child_level, vcpu.mmu.meter) {
            return RetPf::Retry;
        }
        let child = match child {
            Ok(child) => child,
            Err(existing) => {
                id = existing;
                level = child_level;
                continue;
            }
        };
        vcpu.link_shadow_page(sptep, child);
        id = child;
        level = child_level;
    }
    // clear_sp_write_flooding_count() for the page holding the guest's leaf, too.
    vcpu.mmu.st.sp_mut(id).write_flooding_count = 0;
    // Below a guest huge page: direct pages, down to what the host and the shadowed guest
    // tables allow (kvm_mmu_hugepage_adjust() after the indirect pages exist).
    let goal_level = adjust_goal_level(vcpu.mmu.st, fault.gfn, fault.goal_level.min(gw.level));
    direct_map(vcpu, fault, (id, level), goal_level, gw.pte_access)
}

/// The CR3 the guest loaded, if any.
pub(crate) fn guest_cr3(inner: &ShadowInner) -> Option<Gpa> {
    let v = inner.guest_cr3.load(Ordering::Acquire);
    (v != u64::MAX).then_some(Gpa(v))
}
