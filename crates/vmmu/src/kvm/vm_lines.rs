//! The VM-wide cache lines of KVM's MMU state that every CPU changing the MMU writes, so that
//! they move between cores when CPUs take turns under `mmu_lock`. The MMU counts its writes to
//! each; the virtual-time engine compares the counts around a critical section and charges a
//! transfer when another core wrote the line last.
//!
//! From the code (Linux 6.1), what a holder writes beyond the lock word:
//! - x86, both MMUs: `kvm->stat.pages[]`, which `kvm_update_page_stats()` updates whenever a
//!   leaf is installed or removed ([`VmLine::PageStats`]).
//! - x86 shadow MMU, creating or freeing a shadow page: `kvm_mmu_alloc_shadow_page()` and
//!   `kvm_mmu_free_shadow_page()` / `kvm_mmu_prepare_zap_page()` update
//!   `kvm->arch.n_used_mmu_pages` (with `indirect_shadow_pages` beside it) and link or unlink
//!   the page on `kvm->arch.active_mmu_pages` ([`VmLine::MmuPages`]). Simplified: the list head,
//!   32 KiB away from the counters behind `mmu_page_hash[]`, and the neighbour page's `link`
//!   move together with the counters as one line; the hash bucket, one per gfn hash, is
//!   rarely shared and not counted.
//! - x86 TDP MMU, linking or freeing a table: `tdp_account_mmu_page()` /
//!   `tdp_unaccount_mmu_page()` on `kvm->arch.tdp_mmu_pages` ([`VmLine::MmuPages`]).
//! - arm64 stage 2: none. `user_mem_abort()` allocates from the vCPU's own memory cache, and
//!   `mark_page_dirty_in_slot()` sets a bit of the memslot's bitmap for the faulting gfn (a
//!   line other vCPUs write only when their pages share it, which memstress's per-vCPU regions
//!   make rare).

use std::sync::atomic::{AtomicU64, Ordering};

/// A VM-wide line of KVM's MMU state (see the module documentation).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum VmLine {
    /// `kvm->stat.pages[]`.
    PageStats,
    /// The MMU's page accounting: the shadow MMU's `n_used_mmu_pages` and `active_mmu_pages`,
    /// or the TDP MMU's `tdp_mmu_pages`.
    MmuPages,
}

/// Number of [`VmLine`]s.
pub const NR_VM_LINES: usize = 2;

/// Writes to each [`VmLine`] so far (atomics: both engines' actors write them).
#[derive(Debug, Default)]
pub struct VmLineWrites([AtomicU64; NR_VM_LINES]);

impl VmLineWrites {
    /// The MMU wrote `line`.
    pub fn wrote(&self, line: VmLine) {
        self.wrote_n(line, 1);
    }

    /// The MMU wrote `line` `n` times.
    pub fn wrote_n(&self, line: VmLine, n: u64) {
        self.0[line as usize].fetch_add(n, Ordering::Relaxed);
    }

    /// The counts, by [`VmLine`].
    pub fn snapshot(&self) -> [u64; NR_VM_LINES] {
        std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed))
    }
}
