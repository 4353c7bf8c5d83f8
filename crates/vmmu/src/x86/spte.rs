//! KVM's x86 shadow page-table entry (SPTE) in EPT format: the software bits KVM keeps in
//! the bits the CPU ignores, SPTE construction, and the lockless single-entry protocols that run
//! on it (KVM's `spte.h`/`spte.c`).
//!
//! Bit layout, as KVM lays it out for EPT with A/D bits enabled:
//!
//! | bits  | meaning |
//! |-------|---------|
//! | 0,1,2 | R, W, X (hardware) |
//! | 7     | PS: a huge leaf above 4K (hardware) |
//! | 8, 9  | Accessed, Dirty (hardware sets them) |
//! | 11    | `SPTE_MMU_PRESENT_MASK`: KVM's "shadow-present" flag |
//! | 12–51 | PFN (for a non-leaf entry: the child table) |
//! | 52–53 | A/D type (`SPTE_TDP_AD_*`) |
//! | 57    | `EPT_SPTE_HOST_WRITABLE` |
//! | 58    | `EPT_SPTE_MMU_WRITABLE` |
//! | 63    | suppress #VE: `SHADOW_NONPRESENT_VALUE` |
//!
//! The protocol functions at the bottom are generic over [`SpteCell`] so the very code the MMU
//! runs is also what the model checker explores (see `tests/model_fast_pf.rs`).

use crate::hw::ept::EptGeometry;
pub use crate::hw::ept::{
    Level, X86Gfn, X86Level, PG_LEVEL_1G, PG_LEVEL_2M, PG_LEVEL_4K, PT64_ROOT_4LEVEL,
    PT_PAGE_SIZE_MASK, SPTE_ENT_PER_PAGE, SPTE_LEVEL_BITS, VMX_EPT_EXECUTABLE_MASK,
    VMX_EPT_READABLE_MASK, VMX_EPT_RWX_MASK,
};
use crate::hw::ept::{
    EPT_ADDR_MASK, VMX_EPT_ACCESS_BIT, VMX_EPT_DIRTY_BIT, VMX_EPT_SUPPRESS_VE_BIT,
    VMX_EPT_WRITABLE_MASK,
};
use crate::hw::page_table::{table_at, PageTable};
use crate::hw::pgtable::PtFormat;
pub use crate::hw::pgtable::SpteCell;
use crate::kvm::meter::Meter;
use crate::units::Gfn;
use crate::units::{Pfn, PAGE_SHIFT};
use crossbeam_epoch::Guard;

/// The largest level a leaf may sit at (`KVM_MAX_HUGEPAGE_LEVEL`).
pub const KVM_MAX_HUGEPAGE_LEVEL: Level = PG_LEVEL_1G;

/// The W bit (`PT_WRITABLE_MASK`; EPT's write permission).
pub const PT_WRITABLE_MASK: u64 = VMX_EPT_WRITABLE_MASK;
/// `shadow_accessed_mask` with EPT A/D bits enabled.
pub const SHADOW_ACCESSED_MASK: u64 = VMX_EPT_ACCESS_BIT;
/// `shadow_dirty_mask` with EPT A/D bits enabled.
pub const SHADOW_DIRTY_MASK: u64 = VMX_EPT_DIRTY_BIT;
/// KVM's software present bit: `is_shadow_present_pte()` tests only this.
pub const SPTE_MMU_PRESENT_MASK: u64 = 1 << 11;
/// The physical-address field.
pub const SPTE_BASE_ADDR_MASK: u64 = EPT_ADDR_MASK;
/// Shift of the A/D type field.
pub const SPTE_TDP_AD_SHIFT: u32 = 52;
/// The A/D type field.
pub const SPTE_TDP_AD_MASK: u64 = 3 << SPTE_TDP_AD_SHIFT;
/// A/D bits enabled (the value of the A/D type field).
pub const SPTE_TDP_AD_ENABLED: u64 = 0;
/// The host maps the page writable.
pub const EPT_SPTE_HOST_WRITABLE: u64 = 1 << 57;
/// KVM allows the page to be made writable without taking `mmu_lock` (fast page fault).
pub const EPT_SPTE_MMU_WRITABLE: u64 = 1 << 58;
/// The value of a non-present SPTE on 64-bit hosts (suppress-#VE set).
pub const SHADOW_NONPRESENT_VALUE: u64 = VMX_EPT_SUPPRESS_VE_BIT;
/// A frozen SPTE: owned by one thread that is replacing it; others back off and retry
/// (`FROZEN_SPTE`, formerly `REMOVED_SPTE`). Not present, no RWX, no PFN, and no A/D bits:
/// lockless aging clears A with an atomic AND on whatever the entry holds by then, which must
/// leave a frozen entry frozen (the value Linux moved to, from `0x5a0`, which has bit 8 set,
/// for lockless aging: "KVM: x86/mmu: Don't set A/D bits in FROZEN_SPTE"-era `0x498`).
pub const FROZEN_SPTE: u64 = SHADOW_NONPRESENT_VALUE | 0x498;

// The frozen value must look non-present to both KVM and hardware, and survive aging.
const _: () = assert!(FROZEN_SPTE & (SPTE_MMU_PRESENT_MASK | VMX_EPT_RWX_MASK) == 0);
const _: () = assert!(FROZEN_SPTE & SPTE_BASE_ADDR_MASK == 0);
const _: () = assert!(FROZEN_SPTE & (SHADOW_ACCESSED_MASK | SHADOW_DIRTY_MASK) == 0);

/// `tdp_mmu_clear_spte_bits_atomic()` for the Accessed bit (aging): an atomic AND on whatever
/// the entry holds now, which only takes A away, so it loses no concurrent change (a fault
/// relaxing permissions, the CPU setting D) and leaves a frozen entry frozen. Returns the old
/// value.
pub fn clear_accessed_spte_atomic<S: SpteCell>(sptep: &S) -> u64 {
    sptep.fetch_and(!SHADOW_ACCESSED_MASK)
}

/// One leaf of an x86 aging walk, the body both `kvm_tdp_mmu_age_gfn_range()` (TDP MMU) and
/// `kvm_age_rmap()` (shadow MMU) run on each leaf they visit: `spte` is the value the walk
/// read from `sptep`. A leaf with its Accessed bit set is young; when `young` (the notifier's
/// handler, given the leaf's first gfn and its size in pages) asks for it, the bit is
/// cleared with [`clear_accessed_spte_atomic`]. Returns whether the leaf was young.
#[inline]
pub fn age_leaf_spte<S: SpteCell>(
    sptep: &S,
    spte: u64,
    gfn: Gfn,
    pages: u64,
    young: &mut dyn FnMut(Gfn, u64) -> bool,
    meter: &mut Meter,
) -> bool {
    if !is_accessed_spte(spte) {
        return false;
    }
    if young(gfn, pages) {
        clear_accessed_spte_atomic(sptep);
        meter.sptes_aged += 1;
    }
    true
}

/// KVM's view of its own SPTEs, for KVM's walks of the TDP MMU's tree (`tdp_iter`): an entry is
/// present when KVM's shadow-present bit is set, whatever the hardware bits say, and a frozen
/// entry is not present. Tables are filled with `SHADOW_NONPRESENT_VALUE`.
pub struct TdpSpte;

impl PtFormat for TdpSpte {
    type Geometry = EptGeometry;
    const INVALID: u64 = SHADOW_NONPRESENT_VALUE;

    #[inline]
    fn is_valid(pte: u64) -> bool {
        is_shadow_present_pte(pte)
    }
    #[inline]
    fn is_leaf(pte: u64, level: Level) -> bool {
        is_shadow_present_pte(pte) && is_last_spte(pte, level)
    }
    #[inline]
    fn table_addr(pte: u64) -> u64 {
        pte & SPTE_BASE_ADDR_MASK
    }
    #[inline]
    fn leaf_pfn(pte: u64) -> Pfn {
        spte_to_pfn(pte)
    }
}

/// The child table a present non-leaf SPTE points to (`spte_to_child_pt()`).
///
/// # Safety
/// As [`table_at`]: `spte` must be a present non-leaf SPTE read, inside `guard`'s critical
/// section, from a table reachable from a live root.
pub unsafe fn spte_to_child_pt(spte: u64, guard: &Guard) -> &PageTable {
    // SAFETY: the caller's contract is table_at()'s.
    unsafe { table_at(spte & SPTE_BASE_ADDR_MASK, guard) }
}

/// `is_shadow_present_pte()`.
#[inline]
pub fn is_shadow_present_pte(spte: u64) -> bool {
    spte & SPTE_MMU_PRESENT_MASK != 0
}

/// `is_frozen_spte()`.
#[inline]
pub fn is_frozen_spte(spte: u64) -> bool {
    spte == FROZEN_SPTE
}

/// `is_large_pte()`: the PS bit.
#[inline]
pub fn is_large_pte(spte: u64) -> bool {
    spte & PT_PAGE_SIZE_MASK != 0
}

/// `is_last_spte()`: a leaf at `level` (4K entries are always leaves).
#[inline]
pub fn is_last_spte(spte: u64, level: Level) -> bool {
    level == PG_LEVEL_4K || is_large_pte(spte)
}

/// `is_writable_pte()`: the hardware W bit.
#[inline]
pub fn is_writable_pte(spte: u64) -> bool {
    spte & PT_WRITABLE_MASK != 0
}

/// `is_mmu_writable_spte()`.
#[inline]
pub fn is_mmu_writable_spte(spte: u64) -> bool {
    spte & EPT_SPTE_MMU_WRITABLE != 0
}

/// Host-writable software bit.
#[inline]
pub fn is_host_writable_spte(spte: u64) -> bool {
    spte & EPT_SPTE_HOST_WRITABLE != 0
}

/// `is_dirty_spte()` with A/D bits enabled.
#[inline]
pub fn is_dirty_spte(spte: u64) -> bool {
    spte & SHADOW_DIRTY_MASK != 0
}

/// `is_accessed_spte()` with A/D bits enabled.
#[inline]
pub fn is_accessed_spte(spte: u64) -> bool {
    spte & SHADOW_ACCESSED_MASK != 0
}

/// `spte_to_pfn()`.
#[inline]
pub fn spte_to_pfn(spte: u64) -> Pfn {
    Pfn((spte & SPTE_BASE_ADDR_MASK) >> PAGE_SHIFT)
}

/// `make_spte()` for a direct (TDP) mapping with A/D bits enabled: readable and executable,
/// writable when the host maps the page writable, Dirty set with W, Accessed set unless the
/// mapping is a prefetch, PS above 4K.
///
/// Simplified from KVM's `make_spte()`: no memory type, no MMIO, no access tracking (A/D are
/// always enabled here), and no `mmu_try_to_unsync_pages()` because a direct MMU without nested
/// guests has no shadowed guest page tables.
pub fn make_spte(level: Level, pfn: Pfn, host_writable: bool, prefetch: bool) -> u64 {
    let mut spte = SPTE_MMU_PRESENT_MASK | SPTE_TDP_AD_ENABLED | VMX_EPT_READABLE_MASK;
    spte |= VMX_EPT_EXECUTABLE_MASK;
    if !prefetch {
        spte |= SHADOW_ACCESSED_MASK;
    }
    if level > PG_LEVEL_4K {
        spte |= PT_PAGE_SIZE_MASK;
    }
    spte |= (pfn.0 << PAGE_SHIFT) & SPTE_BASE_ADDR_MASK;
    if host_writable {
        spte |= EPT_SPTE_HOST_WRITABLE | PT_WRITABLE_MASK | EPT_SPTE_MMU_WRITABLE;
        spte |= SHADOW_DIRTY_MASK;
    }
    spte
}

/// `make_nonleaf_spte()`: points at a child table whose host address is `table_addr`
/// (4 KiB aligned). Non-leaf entries grant everything; the leaf decides.
pub fn make_nonleaf_spte(table_addr: u64) -> u64 {
    debug_assert_eq!(table_addr & 0xfff, 0, "page tables are 4 KiB aligned");
    debug_assert_eq!(
        table_addr & !SPTE_BASE_ADDR_MASK,
        0,
        "table address fits the PFN field"
    );
    table_addr | SPTE_MMU_PRESENT_MASK | VMX_EPT_RWX_MASK | SHADOW_ACCESSED_MASK
}

/// `make_huge_page_split_spte()`: the child at `index` of a huge SPTE split one level down.
/// The child keeps every permission and the A/D bits of the huge SPTE, which is why eager
/// splitting needs no TLB flush.
pub fn make_huge_page_split_spte(huge_spte: u64, child_level: Level, index: usize) -> u64 {
    debug_assert!(is_shadow_present_pte(huge_spte) && is_large_pte(huge_spte));
    let mut child = huge_spte;
    if child_level == PG_LEVEL_4K {
        child &= !PT_PAGE_SIZE_MASK;
    }
    let pfn = spte_to_pfn(huge_spte).0 + index as u64 * child_level.pages();
    (child & !SPTE_BASE_ADDR_MASK) | ((pfn << PAGE_SHIFT) & SPTE_BASE_ADDR_MASK)
}

/// `make_huge_spte()`: a huge leaf at `level` built from one of its small leaves, used when
/// recovering huge pages after dirty logging is disabled. The PFN is rounded down to the huge
/// page; permissions and A/D come from the small leaf.
pub fn make_huge_spte(small_spte: u64, level: Level) -> u64 {
    let pfn = spte_to_pfn(small_spte).0 & !(level.pages() - 1);
    (small_spte & !SPTE_BASE_ADDR_MASK) | PT_PAGE_SIZE_MASK | (pfn << PAGE_SHIFT)
}

/// `leaf_spte_change_needs_tlb_flush()`: only taking away MMU-writability forces an immediate
/// flush; clearing W, A or D alone is batched by the caller.
pub fn leaf_spte_change_needs_tlb_flush(old: u64, new: u64) -> bool {
    is_mmu_writable_spte(old) && !is_mmu_writable_spte(new)
}

/// `spte_needs_atomic_update()`: whether a write under the write lock must still be atomic
/// because someone else may change the entry without the lock: fast page fault may set W on an
/// MMU-writable entry, and the CPU may set D on a writable entry whose D is clear.
pub fn spte_needs_atomic_update(spte: u64) -> bool {
    if !is_shadow_present_pte(spte) {
        return false;
    }
    if !is_writable_pte(spte) && is_mmu_writable_spte(spte) {
        return true;
    }
    is_writable_pte(spte) && !is_dirty_spte(spte)
}

/// A present SPTE whose (Host-writable, MMU-writable, W) triple is none of KVM's four.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpteWritableViolation {
    /// MMU-writable set, Host-writable clear.
    #[error("SPTE {0:#x}: MMU-writable without Host-writable")]
    MmuWritableWithoutHostWritable(u64),
    /// W set, MMU-writable clear.
    #[error("SPTE {0:#x}: writable without MMU-writable")]
    WritableWithoutMmuWritable(u64),
}

/// `check_spte_writable_invariants()`: the (Host-writable, MMU-writable, W) triple must be one
/// of 111, 110, 100, 000.
pub fn check_spte_writable_invariants(spte: u64) -> Result<(), SpteWritableViolation> {
    if !is_shadow_present_pte(spte) {
        return Ok(());
    }
    if is_mmu_writable_spte(spte) && !is_host_writable_spte(spte) {
        return Err(SpteWritableViolation::MmuWritableWithoutHostWritable(spte));
    }
    if is_writable_pte(spte) && !is_mmu_writable_spte(spte) {
        return Err(SpteWritableViolation::WritableWithoutMmuWritable(spte));
    }
    Ok(())
}

/// What one attempt of [`fast_page_fault_try`] did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FastPfOutcome {
    /// The access is already allowed (`RET_PF_SPURIOUS`): another vCPU fixed it first.
    Spurious,
    /// W was restored by cmpxchg; the page must be marked dirty in the memslot.
    FixedWrite,
    /// The fast path cannot fix this fault: take `mmu_lock` (`RET_PF_INVALID`).
    NeedSlowPath,
    /// The entry changed under the cmpxchg: walk again and retry (KVM retries 4 times).
    Raced,
}

/// One iteration of `fast_page_fault()`'s loop for a direct MMU with A/D bits enabled, on the
/// last entry `spte` (at `level`) a lockless walk found at `sptep`: a present leaf that is
/// write-protected only for dirty logging (MMU-writable, W clear) gets W back with one cmpxchg
/// (`fast_pf_fix_direct_spte()`). A huge leaf in a dirty-logged slot (`logging`) is never made
/// writable here: it must be split so writes are tracked at 4K.
pub fn fast_page_fault_try<S: SpteCell>(
    sptep: &S,
    spte: u64,
    level: Level,
    write: bool,
    logging: bool,
) -> FastPfOutcome {
    if !is_shadow_present_pte(spte) || !is_last_spte(spte, level) {
        return FastPfOutcome::NeedSlowPath;
    }
    // is_access_allowed(): a read needs a present leaf, a write needs W.
    if !write || is_writable_pte(spte) {
        return FastPfOutcome::Spurious;
    }
    if !is_mmu_writable_spte(spte) || (level > PG_LEVEL_4K && logging) {
        return FastPfOutcome::NeedSlowPath;
    }
    // The cmpxchg is what makes this safe against a concurrent write-protect, which clears W
    // with its own cmpxchg (wrprot_spte_atomic()): exactly one of them wins.
    match sptep.cmpxchg(spte, spte | PT_WRITABLE_MASK) {
        Ok(_) => FastPfOutcome::FixedWrite,
        Err(_) => FastPfOutcome::Raced,
    }
}

/// Clears W on a present writable leaf with cmpxchg, keeping MMU-writable so the fast path may
/// restore it: `wrprot_gfn_range()` under the read lock. Returns `Some(old)` when this call
/// cleared W, `None` when the entry was not a writable present leaf, and the cmpxchg attempts
/// that lost a race.
pub fn wrprot_spte_atomic<S: SpteCell>(sptep: &S, level: Level) -> (Option<u64>, u32) {
    clear_leaf_bits_atomic(sptep, level, PT_WRITABLE_MASK)
}

/// Clears D on a present dirty leaf with cmpxchg, so the CPU sets it again, and logs the page
/// (PML), on the next write: `clear_dirty_gfn_range()` under the read lock. Returns as
/// [`wrprot_spte_atomic`].
pub fn clear_dirty_spte_atomic<S: SpteCell>(sptep: &S, level: Level) -> (Option<u64>, u32) {
    clear_leaf_bits_atomic(sptep, level, SHADOW_DIRTY_MASK)
}

/// `tdp_mmu_clear_spte_bits()` under the write lock (`clear_dirty_pt_masked()`): clears W
/// (`wrprot`) or D of a present leaf at `level` as [`wrprot_spte_atomic`] and
/// [`clear_dirty_spte_atomic`] do, but with a plain store where nobody without the lock may
/// change the entry (`kvm_tdp_mmu_spte_need_atomic_update()` false: the CPU sets D only where
/// it is clear, and the fast path sets W only on an MMU-writable entry whose W is clear; such
/// a store may clobber an Accessed flag the CPU sets meanwhile on an entry aging cleared, a
/// wrong age KVM tolerates). Returns as [`wrprot_spte_atomic`].
pub fn clear_leaf_bit_locked<S: SpteCell>(
    sptep: &S,
    level: Level,
    wrprot: bool,
) -> (Option<u64>, u32) {
    let bits = if wrprot {
        PT_WRITABLE_MASK
    } else {
        SHADOW_DIRTY_MASK
    };
    let old = sptep.load();
    if !is_shadow_present_pte(old) || !is_last_spte(old, level) || old & bits == 0 {
        return (None, 0);
    }
    if spte_needs_atomic_update(old) {
        return clear_leaf_bits_atomic(sptep, level, bits);
    }
    sptep.store(old & !bits);
    (Some(old), 0)
}

/// Clears `bits` of a present leaf at `level` with cmpxchg (`tdp_mmu_clear_spte_bits()`),
/// retrying when someone changed the entry. `Some(old)` when any of `bits` was set.
fn clear_leaf_bits_atomic<S: SpteCell>(sptep: &S, level: Level, bits: u64) -> (Option<u64>, u32) {
    let mut retries = 0;
    let mut old = sptep.load();
    loop {
        if !is_shadow_present_pte(old) || !is_last_spte(old, level) || old & bits == 0 {
            return (None, retries);
        }
        match sptep.cmpxchg(old, old & !bits) {
            Ok(_) => return (Some(old), retries),
            Err(cur) => {
                retries += 1;
                old = cur;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::ept::hw_set_accessed_dirty;
    use crate::hw::ept::{PG_LEVEL_1G, PG_LEVEL_2M};
    use std::sync::atomic::{AtomicU64, Ordering};

    #[test]
    fn a_locked_clear_stores_plainly_only_where_nobody_else_may_change_the_entry() {
        let dirty = make_spte(PG_LEVEL_4K, Pfn(7), true, false);
        assert!(
            !spte_needs_atomic_update(dirty),
            "W and D set: the CPU changes nothing"
        );
        let cell = AtomicU64::new(dirty);
        assert_eq!(
            clear_leaf_bit_locked(&cell, PG_LEVEL_4K, false),
            (Some(dirty), 0)
        );
        let clean = cell.load(Ordering::Relaxed);
        assert_eq!(clean, dirty & !SHADOW_DIRTY_MASK);
        assert!(
            spte_needs_atomic_update(clean),
            "W without D: the CPU may set D"
        );
        assert_eq!(clear_leaf_bit_locked(&cell, PG_LEVEL_4K, false), (None, 0));
        // Write-protecting the clean entry goes through cmpxchg, and keeps MMU-writable.
        assert_eq!(
            clear_leaf_bit_locked(&cell, PG_LEVEL_4K, true),
            (Some(clean), 0)
        );
        let wrprot = cell.load(Ordering::Relaxed);
        assert!(!is_writable_pte(wrprot) && is_mmu_writable_spte(wrprot));
        assert_eq!(clear_leaf_bit_locked(&cell, PG_LEVEL_4K, true), (None, 0));
        let table = AtomicU64::new(make_nonleaf_spte(0x1000));
        assert_eq!(clear_leaf_bit_locked(&table, PG_LEVEL_2M, false), (None, 0));
    }

    #[test]
    fn new_writable_spte_satisfies_invariants_and_has_dirty() {
        let s = make_spte(PG_LEVEL_4K, Pfn(0x1234), true, false);
        assert!(is_shadow_present_pte(s) && is_writable_pte(s) && is_mmu_writable_spte(s));
        assert!(is_dirty_spte(s) && is_accessed_spte(s) && !is_large_pte(s));
        assert_eq!(spte_to_pfn(s), Pfn(0x1234));
        check_spte_writable_invariants(s).unwrap();
        let ro = make_spte(PG_LEVEL_2M, Pfn(0x200), false, true);
        assert!(!is_writable_pte(ro) && !is_mmu_writable_spte(ro) && is_large_pte(ro));
        assert!(
            !is_accessed_spte(ro),
            "prefetched SPTEs start without Accessed"
        );
        check_spte_writable_invariants(ro).unwrap();
    }

    #[test]
    fn invalid_writable_triples_are_caught() {
        let s = make_spte(PG_LEVEL_4K, Pfn(1), true, false);
        assert!(check_spte_writable_invariants(s & !EPT_SPTE_MMU_WRITABLE).is_err());
        assert!(check_spte_writable_invariants(s & !EPT_SPTE_HOST_WRITABLE).is_err());
        // 110 (dirty-log write protection) and 100 (shadowed gfn) are valid.
        check_spte_writable_invariants(s & !PT_WRITABLE_MASK).unwrap();
        check_spte_writable_invariants(s & !(PT_WRITABLE_MASK | EPT_SPTE_MMU_WRITABLE)).unwrap();
        // Non-present entries are never checked.
        check_spte_writable_invariants(FROZEN_SPTE).unwrap();
    }

    #[test]
    fn split_children_keep_permissions_and_cover_the_huge_page() {
        let huge = make_spte(PG_LEVEL_1G, Pfn(0x40000), true, false) & !PT_WRITABLE_MASK;
        for (i, child_level) in [(0, PG_LEVEL_2M), (511, PG_LEVEL_2M)] {
            let c = make_huge_page_split_spte(huge, child_level, i);
            assert_eq!(spte_to_pfn(c), Pfn(0x40000 + i as u64 * 512));
            assert!(is_large_pte(c));
            assert_eq!(c & !SPTE_BASE_ADDR_MASK, huge & !SPTE_BASE_ADDR_MASK);
        }
        let c = make_huge_page_split_spte(
            make_spte(PG_LEVEL_2M, Pfn(0x200), true, false),
            PG_LEVEL_4K,
            7,
        );
        assert!(!is_large_pte(c) && is_writable_pte(c) && is_dirty_spte(c));
        assert_eq!(spte_to_pfn(c), Pfn(0x207));
        assert!(!leaf_spte_change_needs_tlb_flush(
            make_spte(PG_LEVEL_2M, Pfn(0x200), true, false),
            c
        ));
        let back = make_huge_spte(c, PG_LEVEL_2M);
        assert_eq!(spte_to_pfn(back), Pfn(0x200));
        assert!(is_large_pte(back));
    }

    #[test]
    fn flush_rule_and_atomic_update_rule() {
        let w = make_spte(PG_LEVEL_4K, Pfn(1), true, false);
        assert!(!leaf_spte_change_needs_tlb_flush(w, w & !PT_WRITABLE_MASK));
        assert!(leaf_spte_change_needs_tlb_flush(
            w,
            w & !(PT_WRITABLE_MASK | EPT_SPTE_MMU_WRITABLE)
        ));
        assert!(
            spte_needs_atomic_update(w & !PT_WRITABLE_MASK),
            "fast PF may set W"
        );
        assert!(
            spte_needs_atomic_update(w & !SHADOW_DIRTY_MASK),
            "CPU may set D"
        );
        assert!(
            !spte_needs_atomic_update(w),
            "W and D already set: nothing volatile"
        );
        assert!(!spte_needs_atomic_update(SHADOW_NONPRESENT_VALUE));
    }

    #[test]
    fn fast_pf_fixes_only_dirty_log_write_protection() {
        let try_on = |cell: &AtomicU64, level, logging| {
            fast_page_fault_try(cell, cell.load(Ordering::Relaxed), level, true, logging)
        };
        let w = make_spte(PG_LEVEL_4K, Pfn(9), true, false);
        let cell = AtomicU64::new(w & !PT_WRITABLE_MASK);
        assert_eq!(try_on(&cell, PG_LEVEL_4K, true), FastPfOutcome::FixedWrite);
        assert!(is_writable_pte(cell.load(Ordering::Relaxed)));
        assert_eq!(try_on(&cell, PG_LEVEL_4K, true), FastPfOutcome::Spurious);
        let shadowed = AtomicU64::new(w & !(PT_WRITABLE_MASK | EPT_SPTE_MMU_WRITABLE));
        assert_eq!(
            try_on(&shadowed, PG_LEVEL_4K, true),
            FastPfOutcome::NeedSlowPath
        );
        let huge = AtomicU64::new(make_spte(PG_LEVEL_2M, Pfn(0), true, false) & !PT_WRITABLE_MASK);
        assert_eq!(
            try_on(&huge, PG_LEVEL_2M, true),
            FastPfOutcome::NeedSlowPath
        );
        assert_eq!(
            try_on(&huge, PG_LEVEL_2M, false),
            FastPfOutcome::FixedWrite,
            "not logging: a huge leaf may be fixed"
        );
        let absent = AtomicU64::new(SHADOW_NONPRESENT_VALUE);
        assert_eq!(
            try_on(&absent, PG_LEVEL_4K, false),
            FastPfOutcome::NeedSlowPath
        );
        let table = AtomicU64::new(make_nonleaf_spte(0x1000));
        assert_eq!(
            try_on(&table, PG_LEVEL_2M, false),
            FastPfOutcome::NeedSlowPath,
            "the walk stopped at a table"
        );
        let stale = AtomicU64::new(w);
        assert_eq!(
            fast_page_fault_try(&stale, w & !PT_WRITABLE_MASK, PG_LEVEL_4K, true, true),
            FastPfOutcome::Raced
        );
    }

    #[test]
    fn hardware_never_sets_dirty_on_a_read_only_entry() {
        let w = make_spte(PG_LEVEL_4K, Pfn(9), true, false)
            & !(SHADOW_DIRTY_MASK | SHADOW_ACCESSED_MASK);
        let cell = AtomicU64::new(w & !PT_WRITABLE_MASK);
        assert_eq!(
            hw_set_accessed_dirty(&cell, cell.load(Ordering::Relaxed), true),
            None
        );
        let got = hw_set_accessed_dirty(&cell, cell.load(Ordering::Relaxed), false).unwrap();
        assert!(is_accessed_spte(got) && !is_dirty_spte(got));
        let cell = AtomicU64::new(w);
        let got = hw_set_accessed_dirty(&cell, w, true).unwrap();
        assert!(is_dirty_spte(got) && is_dirty_spte(cell.load(Ordering::Relaxed)));
    }
}
