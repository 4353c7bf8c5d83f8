//! Shadow paging (`paging_tmpl.h` and the indirect half of mmu.c): faults that walk the guest's
//! own page tables first (`FNAME(page_fault)`, `FNAME(fetch)`) and shadow pages for guest
//! tables. The writes that hit write-protected guest tables are emulated in [`write_track`]
//! (`kvm_mmu_track_write()`); the resync of an unsync page's entries (`FNAME(sync_spte)`) is in
//! [`unsync`].
//!
//! [`unsync`]: crate::x86::shadow::unsync
//! [`write_track`]: crate::x86::shadow::write_track
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
use crate::x86::guest_paging::{GuestMemory, GuestWalker};
use crate::x86::mmu::KvmPageFault;
use crate::x86::shadow::fault::{adjust_goal_level, direct_map};
use crate::x86::shadow::inner::{ShadowInner, SHADOW_ROOT_LEVEL};
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::state::*;
use crate::x86::shadow::unsync::*;
use crate::x86::shadow::vcpu::VcpuMmuCaches;
use crate::x86::spte::*;
use std::sync::atomic::Ordering;

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
