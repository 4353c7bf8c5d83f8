//! KVM/arm64: the stage-2 MMU (`arch/arm64/kvm/mmu.c` and `hyp/pgtable.c`) on the generic
//! walker, with the three `mmu_lock` regimes KVM/arm64 went through, its TLB maintenance by IPA,
//! by VMID and (with FEAT_TLBIRANGE, since 6.6) by range, dirty logging by write protection
//! (arm64 has no PML), and eager splitting (`KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE`).
//!
//! Modules: table pages and their reference counts (`mm`), TLB maintenance (`tlb`), the page
//! tables and their visitors (`pgtable`), the fault handler behind KVM core's `Mmu` trait
//! (`mmu`), and the architecture hooks for dirty logging and flushes (`arch`).

pub mod arch;
pub mod mm;
pub mod mmu;
pub mod pgtable;
pub mod tlb;

use serde::{Deserialize, Serialize};

/// The CPU features KVM/arm64's stage-2 code asks about. The default is the Neoverse-N1 of an
/// Ampere Altra (Armv8.2): neither.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arm64Cpu {
    /// FEAT_TLBIRANGE (`system_supports_tlb_range()`, Armv8.4): range TLBIs.
    pub tlbi_range: bool,
    /// FEAT_S2FWB (`stage2_has_fwb()`, Armv8.4): stage 2 forces write-back, so KVM needs no
    /// cache maintenance before mapping a page.
    pub fwb: bool,
}

/// How a relaxed permission is invalidated (`kvm_pgtable_stage2_relax_perms()`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RelaxFlush {
    /// Linux up to 6.4: `__kvm_tlb_flush_vmid_ipa()`, broadcast to every PE, waited for.
    #[default]
    Broadcast,
    /// Linux 6.5 and later: `__kvm_tlb_flush_vmid_ipa_nsh()` on the faulting PE only, also
    /// after `-EAGAIN`. Other PEs may keep the stricter translation; an access through it faults
    /// again, finds the permission relaxed and flushes its own TLB.
    Local,
}

/// How stage-2 faults take `mmu_lock`: the three regimes of KVM/arm64's history.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Arm64Lock {
    /// Linux 5.17 and earlier: `mmu_lock` is a spinlock (`qspinlock`) and every fault holds it
    /// (the write side, which excludes everyone, of a lock the virtual-time engine runs as a
    /// queued spinlock).
    Spin,
    /// Seed 001 as posted (v2, "Removed unnecessary check for fault_granule to use readlock")
    /// and as merged in 5.18-rc1: every write-permission fault while logging takes the read
    /// lock, so one on a *block* splits it with `kvm_pgtable_stage2_map()`'s exclusive walker
    /// under the read lock. Never in a release: "KVM: arm64: Don't split hugepages outside of
    /// MMU write lock" (5.18-rc) added the 4K-granule check after `kvm_page_table_test` with
    /// 2M HugeTLB hit a WARN in `stage2_map_walk_leaf()`. Unsafe, kept to show that race.
    PermFastPathV2,
    /// Linux 5.18–6.1 (seed 001, "KVM: arm64: Add fast path to handle permission relaxation
    /// during dirty logging", with the 5.18-rc fix requiring the 4K fault granule): `mmu_lock`
    /// is an rwlock; a write-permission fault on a page during dirty logging is relaxed under
    /// the read lock, every other fault takes the write lock.
    PermFastPath,
    /// Linux 6.2 and later ("KVM: arm64: Parallel stage-2 fault handling"): every stage-2 fault
    /// takes the read lock and walks shared, with cmpxchg break-before-make and tables freed
    /// through RCU.
    Parallel,
}

impl Arm64Lock {
    /// Every regime, oldest first.
    pub const ALL: [Arm64Lock; 4] = [
        Arm64Lock::Spin,
        Arm64Lock::PermFastPathV2,
        Arm64Lock::PermFastPath,
        Arm64Lock::Parallel,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Arm64Lock::Spin => "spin",
            Arm64Lock::PermFastPathV2 => "perm-fast-path-v2",
            Arm64Lock::PermFastPath => "perm-fast-path",
            Arm64Lock::Parallel => "parallel",
        }
    }
}
