//! What a vCPU keeps for the shadow MMU (`struct kvm_vcpu_arch`'s part of it): the memory caches
//! it tops up before taking `mmu_lock`, and its nested guests' roots (`vcpu->arch.guest_mmu`).

use crate::kvm::memory_cache::{MmuMemoryCache, KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE};
use crate::kvm::meter::Meter;
use crate::kvm::Kvm;
use crate::x86::mmu::{new_shadow_page_cache, topup_shadow_page_cache, FlavourVcpuMmu};
use crate::x86::shadow::mmu_page::{KvmMmuPageRole, SpId};
use crate::x86::shadow::rmap::{PteListDescCache, PTE_LIST_DESC_CACHE_MIN};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The objects a vCPU tops up before taking `mmu_lock` (`vcpu->arch.mmu_*_cache`).
pub struct VcpuMmuCaches {
    /// `mmu_shadow_page_cache`: page tables.
    pub shadow_page_cache: MmuMemoryCache,
    /// `mmu_pte_list_desc_cache`: rmap list descriptors.
    pub pte_list_desc_cache: PteListDescCache,
}

impl VcpuMmuCaches {
    /// `mmu_topup_memory_caches()`: before a fault takes `mmu_lock`, enough rmap descriptors
    /// (`1 + PT64_ROOT_MAX_LEVEL + PTE_PREFETCH_NUM`) and page tables (`PT64_ROOT_MAX_LEVEL`)
    /// for any one fault.
    pub fn mmu_topup_memory_caches(&mut self, kvm: &Kvm, meter: &mut Meter) {
        self.pte_list_desc_cache.topup(PTE_LIST_DESC_CACHE_MIN);
        topup_shadow_page_cache(&mut self.shadow_page_cache, kvm, meter);
    }
}

impl Default for VcpuMmuCaches {
    fn default() -> Self {
        VcpuMmuCaches {
            shadow_page_cache: new_shadow_page_cache(),
            pte_list_desc_cache: PteListDescCache::new(KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE),
        }
    }
}

/// A vCPU's shadow MMU state.
#[derive(Default)]
pub struct ShadowVcpuMmu {
    /// `vcpu->arch.mmu_*_cache`.
    pub caches: VcpuMmuCaches,
    /// Whether it runs a nested guest, and that guest's roots (`vcpu->arch.guest_mmu`).
    pub nested: GuestMmu,
}

impl FlavourVcpuMmu for ShadowVcpuMmu {
    fn mmu_topup_memory_caches(&mut self, kvm: &Kvm, meter: &mut Meter) {
        self.caches.mmu_topup_memory_caches(kvm, meter);
    }
    fn free_memory_caches(&mut self, kvm: &Kvm) {
        self.caches.shadow_page_cache.free_all(&kvm.tables);
        self.caches.pte_list_desc_cache.free_all();
    }
    fn nested_root(&self) -> Option<u64> {
        self.nested.hw_root()
    }
}

/// `KVM_MMU_NUM_PREV_ROOTS`: roots a vCPU keeps besides the current one.
pub const KVM_MMU_NUM_PREV_ROOTS: usize = 3;

/// `EPTP_PA_MASK`: the root table's address in an EPTP (bits 51:12).
pub const EPTP_PA_MASK: u64 = ((1 << 52) - 1) & !0xfff;

/// `struct kvm_mmu_root_info`: a root a vCPU holds a reference on.
#[derive(Clone, Debug)]
pub struct KvmMmuRootInfo {
    /// `pgd`: the EPTP it shadows.
    pub pgd: u64,
    /// `hpa`: the root shadow page.
    pub sp: SpId,
    /// The root's table, for the hardware walk.
    pub table: u64,
    /// The page's role when it was loaded: `is_root_usable()` compares `role.word`.
    pub role: KvmMmuPageRole,
    /// Raised when the page is zapped (`KvmMmuPage::root_invalid`): KVM reads
    /// `root_to_sp(hpa)->role.invalid` without the lock, and this is that bit.
    pub(super) invalid: Arc<AtomicBool>,
}

impl KvmMmuRootInfo {
    /// `is_obsolete_root()`: the page was zapped since it was loaded. Acquire pairs with the
    /// Release of the zap.
    pub fn obsolete(&self) -> bool {
        self.invalid.load(Ordering::Acquire)
    }
}

/// What the locked half of a nested instruction must do.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(super) enum Pending {
    /// Free obsolete roots, then switch to the vmcs12 EPTP's root, putting the least recently
    /// used one and loading it on a miss. `rotated`: the lockless half already missed and
    /// rotated the cache, leaving the least recently used root current.
    LoadRoot { rotated: bool },
    /// `handle_invept()`: free the roots of one EPTP, or all.
    Invept(Option<u64>),
}

/// The nested part of a vCPU's MMU state: `is_guest_mode()`, vmcs12's EPTP and
/// `vcpu->arch.guest_mmu`'s roots.
#[derive(Debug, Default)]
pub struct GuestMmu {
    /// The vCPU runs the nested guest (`is_guest_mode()`).
    pub guest_mode: bool,
    /// The EPTP L1 gave the nested guest it runs or last ran.
    pub eptp: u64,
    /// `root`: the current root.
    pub root: Option<KvmMmuRootInfo>,
    /// `prev_roots[]`, most recent first.
    pub prev_roots: [Option<KvmMmuRootInfo>; KVM_MMU_NUM_PREV_ROOTS],
    /// Work for the locked half.
    pub(super) pending: Option<Pending>,
}

impl GuestMmu {
    /// The table the hardware walks while the nested guest runs (0: no root loaded; the walk
    /// faults and the fault loads one).
    pub fn hw_root(&self) -> Option<u64> {
        self.guest_mode
            .then(|| self.root.as_ref().map_or(0, |r| r.table))
    }

    /// Every root the vCPU holds, current first.
    pub fn held_roots(&self) -> impl Iterator<Item = &KvmMmuRootInfo> + '_ {
        self.root.iter().chain(self.prev_roots.iter().flatten())
    }
}
