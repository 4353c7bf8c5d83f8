//! The VM's eager-split caches (`kvm->arch.split_*_cache`): what eager splitting allocates
//! from under `mmu_lock`, topped up with it dropped.

use crate::hw::page_table::PageTableStats;
use crate::kvm::memory_cache::{MmuMemoryCache, KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE};
use crate::kvm::meter::Meter;
use crate::kvm::Kvm;
use crate::x86::shadow::rmap::{PteListDescCache, SPLIT_DESC_CACHE_MIN_NR_OBJECTS};
use crate::x86::spte::SHADOW_NONPRESENT_VALUE;

/// The caches eager splitting allocates from (`kvm->arch.split_*_cache`), protected by
/// `slots_lock` in KVM (only the VMM thread splits), topped up with `mmu_lock` dropped.
pub struct SplitCaches {
    /// `split_desc_cache`: 513 descriptors are enough for any single split.
    pub desc: PteListDescCache,
    /// `split_shadow_page_cache` (with `split_page_header_cache`).
    pub shadow_page: MmuMemoryCache,
}

impl SplitCaches {
    /// Empty caches, sized as `kvm_mmu_init_vm()` sets them up.
    pub fn new() -> Self {
        SplitCaches {
            desc: PteListDescCache::new(
                SPLIT_DESC_CACHE_MIN_NR_OBJECTS + KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE,
            ),
            shadow_page: MmuMemoryCache::new(
                KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE,
                SHADOW_NONPRESENT_VALUE,
            ),
        }
    }

    /// `topup_split_caches()`: enough for one split, with `mmu_lock` dropped.
    pub fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        self.desc.topup(SPLIT_DESC_CACHE_MIN_NR_OBJECTS);
        meter.tables_allocated += self.shadow_page.topup(1, &kvm.tables) as u64;
    }

    /// `need_topup_split_caches_or_resched()`'s first half: too few objects for one split.
    pub(super) fn need_topup(&self) -> bool {
        self.desc.nr_objs() < SPLIT_DESC_CACHE_MIN_NR_OBJECTS || self.shadow_page.nr_objs() < 1
    }

    /// `kvm_mmu_free_eager_page_split_caches()`.
    pub fn free_all(&mut self, tables: &PageTableStats) {
        self.desc.free_all();
        self.shadow_page.free_all(tables);
    }
}

impl Default for SplitCaches {
    fn default() -> Self {
        Self::new()
    }
}
