//! Intel EPT entries as the CPU reads them: the permission, page-size, Accessed/Dirty and
//! address bits the hardware walk uses (SDM Vol. 3C, "EPT Paging-Structure Entries"), the
//! hardware's view of an entry as a [`PtFormat`], and the locked Accessed/Dirty update the CPU
//! does on a leaf. KVM's software bits and SPTE construction live with KVM's x86 MMU
//! (`x86::spte`).

use crate::hw::pgtable::{PtFormat, SpteCell};
use crate::units::{Gfn, Level, Pfn, PAGE_SHIFT, PG_LEVEL_4K};

/// EPT read permission; the CPU treats an entry with none of R/W/X as not present.
pub const VMX_EPT_READABLE_MASK: u64 = 1 << 0;
/// EPT write permission.
pub const VMX_EPT_WRITABLE_MASK: u64 = 1 << 1;
/// EPT execute permission.
pub const VMX_EPT_EXECUTABLE_MASK: u64 = 1 << 2;
/// All three permission bits.
pub const VMX_EPT_RWX_MASK: u64 =
    VMX_EPT_READABLE_MASK | VMX_EPT_WRITABLE_MASK | VMX_EPT_EXECUTABLE_MASK;
/// A leaf above 4K (`PT_PAGE_SIZE_MASK`, bit 7).
pub const PT_PAGE_SIZE_MASK: u64 = 1 << 7;
/// The Accessed flag the CPU sets on every entry it uses (with EPT A/D enabled).
pub const VMX_EPT_ACCESS_BIT: u64 = 1 << 8;
/// The Dirty flag the CPU sets on a leaf it writes through.
pub const VMX_EPT_DIRTY_BIT: u64 = 1 << 9;
/// The physical-address field (bits 12–51): the mapped frame, or the child table.
pub const EPT_ADDR_MASK: u64 = ((1 << 52) - 1) & !((1 << PAGE_SHIFT) - 1);
/// Suppress #VE: an EPT violation on a non-present entry with this bit causes a VM exit, not a
/// virtualization exception.
pub const VMX_EPT_SUPPRESS_VE_BIT: u64 = 1 << 63;

/// The CPU's view of an EPT hierarchy, for the hardware page walk: an entry is present when any
/// of R/W/X is set; a present entry at 4K, or with PS above it, is a leaf.
pub struct Ept;

impl PtFormat for Ept {
    const INVALID: u64 = 0;

    #[inline]
    fn is_valid(pte: u64) -> bool {
        pte & VMX_EPT_RWX_MASK != 0
    }
    #[inline]
    fn is_leaf(pte: u64, level: Level) -> bool {
        Self::is_valid(pte) && (level == PG_LEVEL_4K || pte & PT_PAGE_SIZE_MASK != 0)
    }
    #[inline]
    fn table_addr(pte: u64) -> u64 {
        pte & EPT_ADDR_MASK
    }
    #[inline]
    fn leaf_pfn(pte: u64) -> Pfn {
        Pfn((pte & EPT_ADDR_MASK) >> PAGE_SHIFT)
    }
    #[inline]
    fn leaf_level() -> Level {
        PG_LEVEL_4K
    }
    #[inline]
    fn level_below(level: Level) -> Level {
        level.below()
    }
    #[inline]
    fn level_above(level: Level) -> Level {
        level.above()
    }
    #[inline]
    fn pages(level: Level) -> u64 {
        level.pages()
    }
    #[inline]
    fn index(gfn: Gfn, level: Level) -> usize {
        gfn.spte_index(level)
    }
    #[inline]
    fn round(gfn: Gfn, level: Level) -> Gfn {
        gfn.round_for_level(level)
    }
}

/// The entry allows the access: present, and writable for a write.
#[inline]
pub fn ept_allows(pte: u64, write: bool) -> bool {
    Ept::is_valid(pte) && (!write || pte & VMX_EPT_WRITABLE_MASK != 0)
}

/// What the page walker does to a leaf on an access: sets Accessed, and Dirty on a write, with
/// one locked update that only succeeds if the entry still allows the access (the CPU never
/// sets D on an entry that is not writable). Returns the entry as used, or `None` when the entry
/// no longer allows the access (the walk restarts or faults).
pub fn hw_set_accessed_dirty<S: SpteCell>(sptep: &S, mut spte: u64, write: bool) -> Option<u64> {
    let want = VMX_EPT_ACCESS_BIT | if write { VMX_EPT_DIRTY_BIT } else { 0 };
    loop {
        if !ept_allows(spte, write) {
            return None;
        }
        if spte & want == want {
            return Some(spte);
        }
        match sptep.cmpxchg(spte, spte | want) {
            Ok(_) => return Some(spte | want),
            Err(cur) => spte = cur,
        }
    }
}
