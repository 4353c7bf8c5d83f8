//! The interface between KVM core and an MMU flavour: the page-fault description, fault return
//! codes, resumable jobs with yield points, and the [`Mmu`] trait.

use crate::hw::walker::WalkResult;
use crate::kvm::memory_cache::MmuMemoryCache;
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::Kvm;
use crate::units::{Gfn, Level, Pfn};
use crate::x86::shadow::rmap::PteListDescCache;
use crossbeam_epoch::Guard;
use std::sync::Arc;

/// `struct kvm_page_fault`: what a vCPU's EPT violation asks of the MMU.
#[derive(Clone)]
pub struct KvmPageFault {
    /// The faulting page in the address space the vCPU translates: a guest frame with EPT,
    /// a guest-virtual page with shadow paging (`fault->addr`).
    pub addr: Gfn,
    /// The 8-byte word of the page the access touched, and the value a write stores: what
    /// KVM's emulator decodes from the instruction when it must emulate the write.
    pub word: usize,
    /// The value of a write.
    pub value: u64,
    /// Shadow paging: the walk of the guest's tables that found `gfn` (`struct guest_walker`).
    pub guest: Option<Box<crate::x86::guest_paging::GuestWalker>>,
    /// Faulting gfn.
    pub gfn: Gfn,
    /// The access was a write.
    pub write: bool,
    /// The EPT violation reported a present entry (a permission fault).
    pub present: bool,
    /// The vCPU that faulted (for its dirty ring).
    pub vcpu: usize,
    /// The memslot holding `gfn`.
    pub slot: Arc<Memslot>,
    /// The slot logged dirty pages when the fault looked it up. KVM's fault holds a pointer to
    /// one memslot version for its whole life (SRCU); here the flags change in place, so the
    /// fault keeps this snapshot and every decision it makes uses it.
    pub dirty_logging: bool,
    /// Level the fault will map at (`kvm_mmu_hugepage_adjust()`: the largest the host backing
    /// and the slot's alignment allow, 4K while the slot logs dirty pages).
    pub goal_level: Level,
    /// Host frame of `gfn`, rounded down to `goal_level`.
    pub pfn: Pfn,
    /// The host maps the page writable (`fault->map_writable`).
    pub map_writable: bool,
}

/// `RET_PF_*`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RetPf {
    /// `RET_PF_CONTINUE`: not handled yet (also the fast path's "take the slow path").
    Continue,
    /// `RET_PF_RETRY`: let the vCPU re-execute and fault again.
    Retry,
    /// `RET_PF_FIXED`: a new or changed SPTE was installed.
    Fixed,
    /// `RET_PF_SPURIOUS`: the access is already allowed.
    Spurious,
    /// `RET_PF_EMULATE` / `RET_PF_WRITE_PROTECTED`: the write hit a write-protected guest page
    /// table and was emulated; the access is complete.
    Emulated,
    /// `-ENOSPC`: the shadow MMU could not free a shadow page for the fault; `KVM_RUN` fails.
    NoSpace,
}

/// The objects a vCPU tops up before taking `mmu_lock` (`vcpu->arch.mmu_*_cache`).
pub struct VcpuMmuCaches {
    /// `mmu_shadow_page_cache`: page tables.
    pub shadow_page_cache: MmuMemoryCache,
    /// `mmu_pte_list_desc_cache`: rmap list descriptors (shadow MMU only).
    pub pte_list_desc_cache: PteListDescCache,
}

impl VcpuMmuCaches {
    /// `mmu_topup_memory_caches()`: before a fault takes `mmu_lock`, enough rmap descriptors
    /// (`1 + PT64_ROOT_MAX_LEVEL + PTE_PREFETCH_NUM`) and page tables (`PT64_ROOT_MAX_LEVEL`)
    /// for any one fault. KVM tops up both whichever MMU is in use.
    pub fn mmu_topup_memory_caches(&mut self, kvm: &Kvm, meter: &mut Meter) {
        self.pte_list_desc_cache
            .topup(crate::x86::shadow::rmap::PTE_LIST_DESC_CACHE_MIN);
        let n = self
            .shadow_page_cache
            .topup(crate::kvm::memory_cache::PT64_ROOT_MAX_LEVEL, &kvm.tables);
        meter.tables_allocated += n as u64;
    }
}

impl Default for VcpuMmuCaches {
    fn default() -> Self {
        VcpuMmuCaches {
            shadow_page_cache: MmuMemoryCache::new(
                crate::kvm::memory_cache::KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE,
                crate::x86::spte::SHADOW_NONPRESENT_VALUE,
            ),
            pte_list_desc_cache: PteListDescCache::new(
                crate::kvm::memory_cache::KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE,
            ),
        }
    }
}

/// What one run of a job under the lock ended with.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum JobStep {
    /// Finished; `flush` says the caller owes a TLB flush.
    Done {
        /// A remote TLB flush is pending.
        flush: bool,
    },
    /// Someone waits for `mmu_lock` (`cond_resched_rwlock_*()`): release it, let others in,
    /// retake it and run again; the job restarts from its cursor.
    Yield,
    /// The job needs memory: release the lock, call [`MmuJob::topup`], retake and run again.
    NeedTopup,
}

/// A long MMU operation with a cursor and explicit yield points, where KVM has
/// `tdp_mmu_iter_cond_resched()` / `cond_resched_rwlock_*()`.
pub trait MmuJob: Send {
    /// Name for traces and reports.
    fn name(&self) -> &'static str;
    /// The lock mode every run needs.
    fn lock_mode(&self) -> LockMode;
    /// Runs under `held` from the cursor until done or a yield point says to stop.
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep;
    /// Allocates what [`JobStep::NeedTopup`] asked for; runs without the lock.
    fn topup(&mut self, _kvm: &Kvm, _meter: &mut Meter) {}
}

/// An MMU flavour (TDP MMU, shadow MMU, arm64 stage-2) behind KVM core.
pub trait Mmu: Send + Sync {
    /// Short name (`tdp`).
    fn name(&self) -> &'static str;

    /// The hardware page walk a vCPU does on a TLB miss, against this MMU's root.
    fn hw_walk(&self, gfn: Gfn, write: bool, guard: &Guard, levels_read: &mut u64) -> WalkResult;

    /// `fast_page_fault()`: tries to fix the fault without `mmu_lock`; `Continue` means take
    /// the slow path.
    fn fast_page_fault(&self, kvm: &Kvm, fault: &KvmPageFault, meter: &mut Meter) -> RetPf;

    /// Shadow paging: `FNAME(walk_addr)` of the guest's own tables for the guest-virtual page
    /// `addr`, before any lock is taken. `None` when this MMU maps guest physical addresses;
    /// `Some(Err)` for a fault the guest itself would take (not modelled: the run stops).
    fn walk_guest(
        &self,
        _kvm: &Kvm,
        _addr: Gfn,
        _write: bool,
        _meter: &mut Meter,
    ) -> Option<Result<crate::x86::guest_paging::GuestWalker, String>> {
        None
    }

    /// The lock mode the slow path of `fault` needs, declared before taking it.
    fn fault_lock_mode(&self, fault: &KvmPageFault) -> LockMode;

    /// The slow path of a fault, under `held`.
    fn page_fault(
        &self,
        kvm: &Kvm,
        fault: &KvmPageFault,
        held: &MmuLockHeld,
        caches: &mut VcpuMmuCaches,
        meter: &mut Meter,
    ) -> RetPf;

    /// Eager page splitting of `[start, end)` of `slot` down to `target_level`, under the lock
    /// mode given (read at enable time, write inside CLEAR_DIRTY_LOG).
    fn try_split_huge_pages(
        &self,
        slot: &Arc<Memslot>,
        start: Gfn,
        end: Gfn,
        target_level: Level,
        mode: LockMode,
    ) -> Box<dyn MmuJob>;

    /// `kvm_mmu_slot_remove_write_access()`: clear W on every leaf at or above `start_level`.
    fn slot_remove_write_access(&self, slot: &Arc<Memslot>, start_level: Level) -> Box<dyn MmuJob>;

    /// `kvm_mmu_slot_gfn_write_protect()`: write-protect (W and MMU-writable) the leaves at or
    /// above `min_level` mapping `gfn`. Write lock. Returns true if anything changed.
    fn slot_gfn_write_protect(
        &self,
        kvm: &Kvm,
        slot: &Memslot,
        gfn: Gfn,
        min_level: Level,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> bool;

    /// `kvm_mmu_write_protect_pt_masked()`: clear W on the 4K leaves of the 64 pages from
    /// `slot.base_gfn + gfn_offset` selected by `mask`. Write lock.
    fn write_protect_pt_masked(
        &self,
        kvm: &Kvm,
        slot: &Memslot,
        gfn_offset: u64,
        mask: u64,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> bool;

    /// `kvm_mmu_recover_huge_pages()`: after dirty logging is disabled, map huge again.
    fn recover_huge_pages(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob>;

    /// `kvm_tdp_mmu_zap_leafs()` / `kvm_unmap_gfn_range()`: remove every leaf in the range.
    /// Write lock. Returns true if a flush is owed.
    fn zap_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> bool;

    /// Page-table invariants (writable triples, leaf PFNs match memslots, mapping levels within
    /// what the slot allows, stats match the tree, writable leaves in logged slots are dirty).
    /// Must run with no other actor active.
    fn check_invariants(&self, kvm: &Kvm) -> Vec<String>;

    /// Leaves currently mapped at 4K, 2M and 1G (KVM's `pages_4k/2m/1g` stats).
    fn page_stats(&self) -> [i64; 3];

    /// `kvm_arch_commit_memory_region()` for a memslot created or deleted: the shadow MMU
    /// sizes its page quota from the memslots (`kvm_mmu_change_mmu_pages()`) and drops the
    /// rmaps of deleted slots. A deleted slot was zapped with [`Mmu::zap_gfn_range`] first.
    fn commit_memory_region(&self, _kvm: &Kvm) {}

    /// Counters specific to this MMU (the shadow MMU's page quota and page counts), for
    /// reports.
    fn mmu_stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
