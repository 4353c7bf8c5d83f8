//! The root every vCPU walks: allocating it (`mmu_alloc_root()`), reloading it when it was
//! zapped (`kvm_mmu_load()`), and putting the old one (`mmu_free_root_page()`). One root serves
//! every vCPU; [`ShadowInner`] publishes it for lockless walkers.

use crate::kvm::memory_cache::MmuMemoryCache;
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{Held, Write};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::shadow::inner::ShadowInner;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::state::*;
use crate::x86::shadow::unsync::mmu_sync_children;
use crate::x86::shadow::vcpu::VcpuMmuCaches;

/// `mmu_free_root_page()`: drops a root reference; a root zapped while in use is freed with its
/// last reference.
pub(super) fn put_root(mmu: &mut LockedMmu<'_>, root: SpId) {
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

/// The root every vCPU walks, reloaded if it was zapped (`kvm_mmu_free_obsolete_roots()` then
/// `kvm_mmu_load()`).
pub(super) fn ensure_root(
    mmu: &mut LockedMmu<'_>,
    caches: &mut VcpuMmuCaches,
    inner: &ShadowInner,
) -> Option<SpId> {
    let root = mmu.st.root?;
    if !mmu.st.sp(root).role.invalid() {
        return Some(root);
    }
    let (gfn, mut role) = (mmu.st.sp(root).gfn, mmu.st.sp(root).role);
    role.set_invalid_bit(0);
    Some(mmu_alloc_root(
        mmu,
        inner,
        &mut caches.shadow_page_cache,
        gfn,
        role,
    ))
}

/// `kvm_mmu_sync_roots()`: the guest flushed its TLB (a CR3 load or INVLPG; both sync every
/// unsync page here): every unsync page reachable from the root is synced and protected again.
pub fn sync_roots(inner: &ShadowInner, kvm: &Kvm, held: Held<'_, Write>, meter: &mut Meter) {
    let mut st = inner.lock_state(held);
    let Some(root) = st.root else {
        return;
    };
    if st.sp(root).unsync_children == 0 {
        return;
    }
    mmu_sync_children(&mut LockedMmu::new(kvm, &mut st, meter), root);
}
