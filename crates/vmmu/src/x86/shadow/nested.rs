//! Nested EPT (`kvm_init_shadow_ept_mmu()`, `arch/x86/kvm/vmx/nested.c`): an L1 hypervisor keeps
//! EPT12 tables in its own memory for each of its guests (L2), and KVM shadows them as EPT02
//! pages in the same shadow MMU that maps L1 itself (EPT01, direct pages with `tdp_mmu=N`). The
//! EPT02 pages are indirect pages with `role.guest_mode` set: they live in the same page hash,
//! active list, rmaps and quota as L1's, and their EPT12 tables are write-tracked in L1's EPT01
//! mappings, as a guest's own tables are with shadow paging.
//!
//! Each vCPU keeps the roots of its nested guests ([`GuestMmu`], `vcpu->arch.guest_mmu`): the
//! current one and `KVM_MMU_NUM_PREV_ROOTS` cached ones, switched on nested VM-entry without
//! `mmu_lock` when cached (`fast_pgd_switch()`), loaded under it otherwise (`kvm_mmu_load()`);
//! `INVEPT` frees the matching ones. A root is held by a reference (`root_count`), so a root
//! zapped while cached stays allocated (invalid) until its last holder puts it.
//!
//! Simplifications, each keeping KVM's locking and zap rules:
//! - KVM frees an evicted root and loads the new one under two holds of `mmu_lock`
//!   (`kvm_mmu_free_roots()`, then `kvm_mmu_load()` at the next entry); here one hold does both.
//! - `KVM_REQ_MMU_FREE_OBSOLETE_ROOTS` is not a request: a vCPU checks its held roots at nested
//!   VM-entry (a flag the zap raises, read without the lock as KVM reads `role.invalid`), and a
//!   fault through a zapped root reloads it.
//! - The lockless root switch does not clear the root's write-flooding count
//!   (`__clear_sp_write_flooding_count()`): the count lives with the page under the lock here.
//! - Nested guests need EPT with `tdp_mmu=N` (the TDP MMU would keep EPT01 and leave EPT02 to
//!   a shadow MMU beside it, which is not modelled), and no memslot of L1 may log dirty pages
//!   (KVM's EPT12 A/D updates would dirty L1's pages): nested VM-entry is refused meanwhile.

use crate::hw::page_table::PageTable;
use crate::hw::walker::{walk, WalkResult};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{FaultError, FaultStart, GuestOp, RetPf};
use crate::kvm::mmu_ctx::MmuCtx;
use crate::kvm::mmu_lock::{Held, LockMode, Write};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::guest_paging::ept::VMX_EPTP_AD_ENABLE_BIT;
use crate::x86::mmu::KvmPageFault;
use crate::x86::shadow::inner::{ShadowInner, SHADOW_ROOT_LEVEL};
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::paging;
use crate::x86::shadow::root::put_root;
use crate::x86::shadow::state::*;
use crate::x86::shadow::unsync::mmu_sync_children;
use crate::x86::shadow::vcpu::{
    GuestMmu, KvmMmuRootInfo, Pending, VcpuMmuCaches, EPTP_PA_MASK, KVM_MMU_NUM_PREV_ROOTS,
};
use crossbeam_epoch::Guard;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// `kvm_calc_shadow_ept_root_page_role()`: a 4-level indirect root in guest mode with the
/// EPTP's A/D setting; `cr0_wp`, `efer_nx` and the other paging bits stay 0.
pub fn shadow_ept_root_role(eptp: u64) -> KvmMmuPageRole {
    let mut role = KvmMmuPageRole::default();
    role.set_level(SHADOW_ROOT_LEVEL);
    role.set_access(ACC_ALL as u32);
    role.set_guest_mode_bit(1);
    role.set_ad_disabled((eptp & VMX_EPTP_AD_ENABLE_BIT == 0) as u32);
    role
}

/// `is_root_usable()`.
fn is_root_usable(root: &Option<KvmMmuRootInfo>, pgd: u64, role: KvmMmuPageRole) -> bool {
    root.as_ref()
        .is_some_and(|r| r.pgd == pgd && r.role == role && !r.obsolete())
}

/// `nested_ept_root_matches()`: the root shadows the EPT12 table `pointer` names (bits 51:12),
/// or any with `None` (global `INVEPT`).
fn nested_ept_root_matches(r: &KvmMmuRootInfo, pointer: Option<u64>) -> bool {
    pointer.is_none_or(|p| r.pgd & EPTP_PA_MASK == p & EPTP_PA_MASK)
}

/// `kvm_mmu_free_roots()` of the roots `which` selects, write lock held: each is put
/// (`mmu_free_root_page()`) and its slot emptied.
fn free_roots(mmu: &mut LockedMmu<'_>, g: &mut GuestMmu, which: impl Fn(&KvmMmuRootInfo) -> bool) {
    for slot in std::iter::once(&mut g.root).chain(g.prev_roots.iter_mut()) {
        if slot.as_ref().is_some_and(&which) {
            put_root(mmu, slot.take().expect("checked").sp);
        }
    }
}

/// `fast_pgd_switch()` without the lock: makes the root for `pgd` current if it is cached,
/// rotating the cache as `cached_root_find_and_keep_current()` does (or bubbling it up as
/// `cached_root_find_without_current()` does). On a miss the least recently used root is left
/// current, for the locked half to put.
fn fast_pgd_switch(g: &mut GuestMmu, pgd: u64, role: KvmMmuPageRole) -> bool {
    if g.root.is_none() {
        let Some(i) = g
            .prev_roots
            .iter()
            .position(|r| is_root_usable(r, pgd, role))
        else {
            return false;
        };
        g.root = g.prev_roots[i].take();
        g.prev_roots[i..].rotate_left(1);
        return true;
    }
    if is_root_usable(&g.root, pgd, role) {
        return true;
    }
    for i in 0..KVM_MMU_NUM_PREV_ROOTS {
        std::mem::swap(&mut g.root, &mut g.prev_roots[i]);
        if is_root_usable(&g.root, pgd, role) {
            return true;
        }
    }
    false
}

/// `kvm_mmu_free_obsolete_roots()`: puts every held root that was zapped.
fn free_obsolete_roots(mmu: &mut LockedMmu<'_>, g: &mut GuestMmu) {
    free_roots(mmu, g, KvmMmuRootInfo::obsolete);
}

/// `mmu_alloc_shadow_roots()` then `kvm_mmu_sync_roots()`, for the vmcs12 EPTP: finds (or
/// creates) the root page for the EPTP's table, takes a reference, and syncs what went unsync
/// below it. Fails with `-ENOSPC` when no page can be freed.
fn load_root(
    mmu: &mut LockedMmu<'_>,
    g: &mut GuestMmu,
    caches: &mut VcpuMmuCaches,
) -> Result<KvmMmuRootInfo, Errno> {
    debug_assert!(g.root.is_none());
    mmu.make_mmu_pages_available()?;
    let role = shadow_ept_root_role(g.eptp);
    let gfn = Gfn((g.eptp & EPTP_PA_MASK) >> PAGE_SHIFT);
    let (sp, _) = mmu.get_shadow_page(&mut caches.shadow_page_cache, gfn, role, true);
    let page = mmu.st.sp_mut(sp);
    page.root_count += 1;
    let invalid = Arc::clone(
        page.root_invalid
            .get_or_insert_with(|| Arc::new(AtomicBool::new(false))),
    );
    let info = KvmMmuRootInfo {
        pgd: g.eptp,
        sp,
        table: page.spt as u64,
        role,
        invalid,
    };
    g.root = Some(info.clone());
    if mmu.st.sp(sp).unsync_children > 0 {
        mmu_sync_children(mmu, sp);
    }
    Ok(info)
}

/// The current root, reloaded if it was zapped: what `kvm_mmu_free_obsolete_roots()` and
/// `kvm_mmu_reload()` do at the entry after `KVM_REQ_MMU_FREE_OBSOLETE_ROOTS`. `-ENOSPC` when
/// no page can be freed for a new root (KVM_RUN fails).
fn current_root(
    mmu: &mut LockedMmu<'_>,
    g: &mut GuestMmu,
    caches: &mut VcpuMmuCaches,
) -> Result<SpId, Errno> {
    free_obsolete_roots(mmu, g);
    match &g.root {
        Some(r) => Ok(r.sp),
        None => Ok(load_root(mmu, g, caches)?.sp),
    }
}

/// The lockless part of a nested guest's intercepted instruction, on the vCPU that ran it:
/// nested VM-entry (`nested_vmx_run()`, whose `kvm_mmu_new_pgd()` switches roots without the
/// lock when the EPTP's is cached), a reflected exit (`nested_vmx_vmexit()`), `INVEPT`
/// (`handle_invept()`, which needs the lock only when it frees a root).
pub fn begin_op(
    inner: &ShadowInner,
    kvm: &Kvm,
    g: &mut GuestMmu,
    caches: &mut VcpuMmuCaches,
    op: GuestOp,
    meter: &mut Meter,
) -> Result<FaultStart, FaultError> {
    if !inner.tdp_enabled {
        return Err(FaultError::NestedUnsupported {
            op,
            why: "need EPT (the shadow MMU with --ept on)",
        });
    }
    match op {
        GuestOp::Access => unreachable!("an access is a fault, not an instruction"),
        GuestOp::EnterNested { root_pointer } => {
            if kvm.nr_memslots_dirty_logging() > 0 {
                return Err(FaultError::NestedUnsupported {
                    op,
                    why: "are not modelled while L1 logs dirty pages (KVM's EPT12 A/D updates would dirty L1's memory)",
                });
            }
            meter.nested_transitions += 1;
            g.guest_mode = true;
            g.eptp = root_pointer;
            let role = shadow_ept_root_role(root_pointer);
            // kvm_mmu_free_obsolete_roots() takes the lock only for a zapped root.
            let obsolete = g.held_roots().any(KvmMmuRootInfo::obsolete);
            if !obsolete && fast_pgd_switch(g, root_pointer, role) {
                return Ok(FaultStart::Done(RetPf::Handled));
            }
            caches.mmu_topup_memory_caches(kvm, meter);
            g.pending = Some(Pending::LoadRoot { rotated: !obsolete });
            Ok(FaultStart::Slow(LockMode::Write))
        }
        GuestOp::ExitNested => {
            meter.nested_transitions += 1;
            g.guest_mode = false;
            Ok(FaultStart::Done(RetPf::Handled))
        }
        GuestOp::InvalidateNested { root_pointer } => {
            if !g
                .held_roots()
                .any(|r| nested_ept_root_matches(r, root_pointer))
            {
                return Ok(FaultStart::Done(RetPf::Handled));
            }
            g.pending = Some(Pending::Invept(root_pointer));
            Ok(FaultStart::Slow(LockMode::Write))
        }
    }
}

/// Whether the vCPU left its instruction's locked half pending.
pub fn has_pending_op(g: &GuestMmu) -> bool {
    g.pending.is_some()
}

/// The locked half of [`begin_op`], under the write lock.
pub fn locked_op(
    inner: &ShadowInner,
    kvm: &Kvm,
    g: &mut GuestMmu,
    caches: &mut VcpuMmuCaches,
    held: Held<'_, Write>,
    meter: &mut Meter,
) -> RetPf {
    let pending = g
        .pending
        .take()
        .expect("a nested instruction's locked half");
    let mut st = inner.lock_state(held);
    let mut mmu = LockedMmu::new(kvm, &mut st, meter);
    match pending {
        Pending::LoadRoot { rotated } => {
            free_obsolete_roots(&mut mmu, g);
            let role = shadow_ept_root_role(g.eptp);
            // One miss is one rotation: when the lockless half missed, the cache is rotated
            // already and its least recently used root is current.
            let hit = !rotated && fast_pgd_switch(g, g.eptp, role);
            if !hit {
                // kvm_mmu_free_roots(KVM_MMU_ROOT_CURRENT): the least recently used root.
                if let Some(lru) = g.root.take() {
                    put_root(&mut mmu, lru.sp);
                }
                if load_root(&mut mmu, g, caches).is_err() {
                    return RetPf::NoSpace;
                }
            }
        }
        Pending::Invept(pointer) => {
            free_roots(&mut mmu, g, |r| nested_ept_root_matches(r, pointer));
        }
    }
    RetPf::Handled
}

/// `ept_page_fault()` -> `FNAME(page_fault)` for `PTTYPE_EPT` under the write lock: the nested
/// guest's fault, whose EPT12 walk the front half did, maps through the vCPU's current root
/// (reloaded if it was zapped).
pub fn page_fault(
    inner: &ShadowInner,
    ctx: &mut MmuCtx<'_, Write>,
    fault: &KvmPageFault,
    g: &mut GuestMmu,
    caches: &mut VcpuMmuCaches,
) -> RetPf {
    paging::page_fault(inner, ctx, fault, caches, &mut |mmu, caches| {
        current_root(mmu, g, caches).map_err(|_| RetPf::NoSpace)
    })
}

/// The hardware walk of the EPT02 root at `root_table` ([`GuestMmu::hw_root`]).
///
/// # Safety
///
/// `root_table` is 0 or the table of a root the walking vCPU holds a reference on
/// ([`KvmMmuRootInfo::table`]), which keeps the page, and so its table, allocated.
pub unsafe fn hw_walk(
    root_table: u64,
    gfn: Gfn,
    write: bool,
    guard: &Guard,
    levels_read: &mut u64,
) -> WalkResult {
    if root_table == 0 {
        return WalkResult::Violation {
            level: SHADOW_ROOT_LEVEL,
            present: false,
            access_flag: false,
        };
    }
    // SAFETY: by this function's contract the vCPU holds a root reference on the page that
    // owns this table, and a page with references is never freed (put_root() frees it only at
    // zero), so the table is live for the whole walk; the caller keeps `guard` pinned.
    unsafe {
        walk(
            &*(root_table as *const PageTable),
            SHADOW_ROOT_LEVEL,
            gfn,
            write,
            false,
            guard,
            levels_read,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    fn info(pgd: u64, sp: u32) -> Option<KvmMmuRootInfo> {
        Some(KvmMmuRootInfo {
            pgd,
            sp: SpId(sp),
            table: 0,
            role: shadow_ept_root_role(pgd),
            invalid: Arc::new(AtomicBool::new(false)),
        })
    }

    /// `fast_pgd_switch()` to the EPT root at `pgd`, with the role an L2 entry computes for it.
    fn switch_to(g: &mut GuestMmu, pgd: u64) -> bool {
        fast_pgd_switch(g, pgd, shadow_ept_root_role(pgd))
    }

    #[test]
    fn the_root_cache_rotates_as_kvm_documents() {
        // C 0 1 2 on entry; a hit on prev[1] leaves it current and C, 0 ahead of 2.
        let mut g = GuestMmu {
            root: info(0xc000, 9),
            prev_roots: [info(0x1000, 1), info(0x2000, 2), info(0x3000, 3)],
            ..Default::default()
        };
        assert!(switch_to(&mut g, 0x2000));
        let order: Vec<u64> = g.held_roots().map(|r| r.pgd).collect();
        assert_eq!(order, [0x2000, 0xc000, 0x1000, 0x3000]);
        // A miss rotates everything and leaves the least recently used root current.
        assert!(!switch_to(&mut g, 0x5000));
        assert_eq!(g.root.as_ref().unwrap().pgd, 0x3000);
        let prev: Vec<u64> = g.prev_roots.iter().flatten().map(|r| r.pgd).collect();
        assert_eq!(prev, [0x2000, 0xc000, 0x1000]);
    }

    #[test]
    fn a_zapped_root_is_never_switched_to() {
        let mut g = GuestMmu {
            prev_roots: [info(0x1000, 1), None, None],
            ..Default::default()
        };
        g.prev_roots[0]
            .as_ref()
            .unwrap()
            .invalid
            .store(true, Ordering::Release);
        assert!(!switch_to(&mut g, 0x1000));
        assert!(g.held_roots().any(KvmMmuRootInfo::obsolete));
    }

    #[test]
    fn without_a_current_root_a_cached_one_bubbles_up() {
        let mut g = GuestMmu {
            prev_roots: [info(0x1000, 1), info(0x2000, 2), info(0x3000, 3)],
            ..Default::default()
        };
        assert!(switch_to(&mut g, 0x2000));
        assert_eq!(g.root.as_ref().unwrap().pgd, 0x2000);
        let prev: Vec<Option<u64>> = g
            .prev_roots
            .iter()
            .map(|r| r.as_ref().map(|r| r.pgd))
            .collect();
        assert_eq!(prev, [Some(0x1000), Some(0x3000), None]);
        // The same table with A/D enabled is another role: the root is not usable for it.
        let ad = shadow_ept_root_role(0x2000 | VMX_EPTP_AD_ENABLE_BIT);
        assert!(is_root_usable(
            &g.root,
            0x2000,
            shadow_ept_root_role(0x2000)
        ));
        assert!(!is_root_usable(&g.root, 0x2000, ad));
    }
}
