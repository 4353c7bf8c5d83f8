//! Intel EPT entries as the CPU reads them: the permission, page-size, Accessed/Dirty and
//! address bits the hardware walk uses (SDM Vol. 3C, "EPT Paging-Structure Entries"), the
//! hardware's view of an entry as a [`PtFormat`], and the locked Accessed/Dirty update the CPU
//! does on a leaf. KVM's software bits and SPTE construction live with KVM's x86 MMU
//! (`x86::spte`).

pub use crate::hw::pgtable::Level;
use crate::hw::pgtable::{PtFormat, PtGeometry, SpteCell, PTES_PER_TABLE};
use crate::units::{Gfn, PageSize, Pfn, PAGE_SHIFT};

/// Entries in one table (KVM's `SPTE_ENT_PER_PAGE`).
pub const SPTE_ENT_PER_PAGE: usize = PTES_PER_TABLE;
/// Bits of a gfn consumed by one level of table (KVM's `SPTE_LEVEL_BITS`).
pub const SPTE_LEVEL_BITS: u32 = 9;

/// x86's `PG_LEVEL_4K`: levels count up from the leaf, as KVM's x86 MMU numbers them.
pub const PG_LEVEL_4K: Level = Level(1);
/// x86's `PG_LEVEL_2M`.
pub const PG_LEVEL_2M: Level = Level(2);
/// x86's `PG_LEVEL_1G`.
pub const PG_LEVEL_1G: Level = Level(3);
/// The root level of 4-level EPT (`PT64_ROOT_4LEVEL`).
pub const PT64_ROOT_4LEVEL: Level = Level(4);

/// x86's level arithmetic (`PG_LEVEL_4K == 1`, 9 gfn bits a level), so a rule quoted from
/// `arch/x86/kvm/mmu/` reads the same here.
pub trait X86Level: Copy {
    /// How far a gfn is shifted to index a table at this level.
    fn gfn_shift(self) -> u32;
    /// 4 KiB pages mapped by one entry at this level (`KVM_PAGES_PER_HPAGE()`).
    fn pages(self) -> u64;
    /// Bytes mapped by one entry at this level.
    fn bytes(self) -> u64;
    /// The next level down. Panics on 4K, which has none: callers check first.
    fn below(self) -> Level;
    /// The next level up.
    fn above(self) -> Level;
    /// A short human name: "4K", "2M", "1G", "512G".
    fn name(self) -> &'static str;
    /// The page size a leaf at this level maps (4K, 2M or 1G).
    fn page_size(self) -> PageSize;
    /// The level whose leaves map `size`.
    fn from_page_size(size: PageSize) -> Level;
}

impl X86Level for Level {
    #[inline]
    fn gfn_shift(self) -> u32 {
        (self.0 as u32 - 1) * SPTE_LEVEL_BITS
    }
    #[inline]
    fn pages(self) -> u64 {
        1 << self.gfn_shift()
    }
    #[inline]
    fn bytes(self) -> u64 {
        self.pages() << PAGE_SHIFT
    }
    #[inline]
    fn below(self) -> Level {
        assert!(self.0 > 1, "no level below 4K");
        Level(self.0 - 1)
    }
    #[inline]
    fn above(self) -> Level {
        Level(self.0 + 1)
    }
    fn name(self) -> &'static str {
        match self.0 {
            1 => "4K",
            2 => "2M",
            3 => "1G",
            4 => "512G",
            _ => "?",
        }
    }
    fn page_size(self) -> PageSize {
        match self {
            PG_LEVEL_4K => PageSize::Size4K,
            PG_LEVEL_2M => PageSize::Size2M,
            _ => PageSize::Size1G,
        }
    }
    fn from_page_size(size: PageSize) -> Level {
        match size {
            PageSize::Size4K => PG_LEVEL_4K,
            PageSize::Size2M => PG_LEVEL_2M,
            PageSize::Size1G => PG_LEVEL_1G,
        }
    }
}

/// x86's gfn arithmetic by level.
pub trait X86Gfn: Copy {
    /// This gfn rounded down to the first gfn of the `level` page containing it
    /// (`gfn_round_for_level()`).
    fn round_for_level(self, level: Level) -> Gfn;
    /// The index of this gfn's entry in a table at `level` (`SPTE_INDEX()`).
    fn spte_index(self, level: Level) -> usize;
}

impl X86Gfn for Gfn {
    #[inline]
    fn round_for_level(self, level: Level) -> Gfn {
        Gfn(self.0 & !(level.pages() - 1))
    }
    #[inline]
    fn spte_index(self, level: Level) -> usize {
        ((self.0 >> level.gfn_shift()) & (SPTE_ENT_PER_PAGE as u64 - 1)) as usize
    }
}

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

/// The shape of an EPT hierarchy (and of KVM's x86 shadow page tables): levels counted up from
/// the 4K leaf, 512 entries a table, 9 gfn bits a level.
pub struct EptGeometry;

impl PtGeometry for EptGeometry {
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

/// The CPU's view of an EPT hierarchy, for the hardware page walk: an entry is present when any
/// of R/W/X is set; a present entry at 4K, or with PS above it, is a leaf.
pub struct Ept;

impl PtFormat for Ept {
    type Geometry = EptGeometry;
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
pub fn hw_set_accessed_dirty<S: SpteCell>(sptep: &S, spte: u64, write: bool) -> Option<u64> {
    match hw_update_accessed_dirty(sptep, spte, write, false) {
        AdUpdate::Used { spte, .. } => Some(spte),
        AdUpdate::Denied | AdUpdate::LogFull => None,
    }
}

/// What the CPU's locked Accessed/Dirty update of a leaf did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AdUpdate {
    /// The access goes on through the entry as used (`spte`); `dirtied` when this update set D
    /// (0 to 1), the event the page-modification log records.
    Used {
        /// The entry as the access used it.
        spte: u64,
        /// This update set the Dirty flag.
        dirtied: bool,
    },
    /// The entry no longer allows the access.
    Denied,
    /// Setting D needs a page-modification-log entry and the log is full: the PML-full VM exit
    /// happens before the flag is set (SDM), and nothing changed.
    LogFull,
}

/// [`hw_set_accessed_dirty`], telling whether the update set D, and stopping before it when
/// `log_full` (PML is on and its log has no room: see [`crate::hw::pml`]).
pub fn hw_update_accessed_dirty<S: SpteCell>(
    sptep: &S,
    mut spte: u64,
    write: bool,
    log_full: bool,
) -> AdUpdate {
    let want = VMX_EPT_ACCESS_BIT | if write { VMX_EPT_DIRTY_BIT } else { 0 };
    loop {
        if !ept_allows(spte, write) {
            return AdUpdate::Denied;
        }
        if spte & want == want {
            return AdUpdate::Used {
                spte,
                dirtied: false,
            };
        }
        let dirtied = write && spte & VMX_EPT_DIRTY_BIT == 0;
        if dirtied && log_full {
            return AdUpdate::LogFull;
        }
        match sptep.cmpxchg(spte, spte | want) {
            Ok(_) => {
                return AdUpdate::Used {
                    spte: spte | want,
                    dirtied,
                }
            }
            Err(cur) => spte = cur,
        }
    }
}
