//! arm64 stage-2 translation table descriptors at the 4 KiB granule, as the CPU reads them and as
//! KVM's `asm/kvm_pgtable.h` / `hyp/pgtable.c` name their bits, and the stage-2 geometry (levels
//! numbered down from the root: level 3 maps 4 KiB pages, level 2 2 MiB blocks, level 1 1 GiB
//! blocks).
//!
//! What the CPU does on an access ([`s2_allows`]): a valid leaf with S2AP_R (reads) or S2AP_W
//! (writes) and AF set translates; an invalid entry is a *translation* fault at its level, a valid
//! leaf without the permission a *permission* fault at the leaf's level, a leaf with AF clear an
//! *access flag* fault. KVM sets `VTCR_EL2.HA` where the CPU has hardware Access-flag
//! management (Neoverse-N1 does), so on such hardware the walk sets AF itself and no access-flag
//! fault happens; the model does not implement that update: its leaves are mapped with AF set,
//! AF is cleared only by `test_clear_young`, and an access then takes an access-flag fault, as
//! on a CPU without HA. (Dirty-state management, `VTCR_EL2.HD`, is not used by KVM.)

use crate::hw::pgtable::{Level, PtFormat, PtGeometry};
use crate::units::{Gfn, PageSize, Pfn};

/// `KVM_PTE_VALID`.
pub const KVM_PTE_VALID: u64 = 1 << 0;
/// `KVM_PTE_TYPE`: set in a table descriptor (levels 0–2) and in a page descriptor (level 3);
/// clear in a block descriptor.
pub const KVM_PTE_TYPE: u64 = 1 << 1;
/// `KVM_PTE_TYPE_TABLE` / `KVM_PTE_TYPE_PAGE`.
pub const KVM_PTE_TYPE_TABLE: u64 = KVM_PTE_TYPE;
/// `KVM_PTE_ADDR_MASK`: output address bits `[47:12]` at the 4K granule.
pub const KVM_PTE_ADDR_MASK: u64 = ((1 << 48) - 1) & !((1 << 12) - 1);
/// `KVM_PTE_LEAF_ATTR_LO_S2_MEMATTR`: MemAttr`[5:2]`; normal write-back memory is `0xf` with FWB
/// off (`MT_S2_NORMAL`).
pub const KVM_PTE_LEAF_ATTR_LO_S2_MEMATTR: u64 = 0xf << 2;
/// `MT_S2_FWB_NORMAL`: MemAttr of normal write-back memory with FEAT_S2FWB.
pub const MT_S2_FWB_NORMAL: u64 = 6;
/// `KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R`: stage-2 read permission.
pub const KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R: u64 = 1 << 6;
/// `KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W`: stage-2 write permission.
pub const KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W: u64 = 1 << 7;
/// `KVM_PTE_LEAF_ATTR_LO_S2_SH`: SH`[9:8]`, inner shareable (`0b11`).
pub const KVM_PTE_LEAF_ATTR_LO_S2_SH_IS: u64 = 3 << 8;
/// `KVM_PTE_LEAF_ATTR_LO_S2_AF`: the Access flag.
pub const KVM_PTE_LEAF_ATTR_LO_S2_AF: u64 = 1 << 10;
/// `KVM_PTE_LEAF_ATTR_HI_S2_XN`: execute-never (bit 54; FEAT_XNX's bit 53 unused).
pub const KVM_PTE_LEAF_ATTR_HI_S2_XN: u64 = 1 << 54;
/// `KVM_PTE_LEAF_ATTR_HI_SW`: software bits `[58:55]`.
pub const KVM_PTE_LEAF_ATTR_HI_SW: u64 = 0xf << 55;
/// `KVM_PTE_LEAF_ATTR_S2_PERMS`: the permission bits `relax_perms` and `wrprotect` change.
pub const KVM_PTE_LEAF_ATTR_S2_PERMS: u64 =
    KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R | KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W | KVM_PTE_LEAF_ATTR_HI_S2_XN;
/// `KVM_INVALID_PTE_LOCKED`: an invalid entry a shared walker broke and will make again
/// (break-before-make in progress); nobody else may change it meanwhile.
pub const KVM_INVALID_PTE_LOCKED: u64 = 1 << 10;

/// `KVM_PGTABLE_MAX_LEVELS`.
pub const KVM_PGTABLE_MAX_LEVELS: u8 = 4;
/// `KVM_PGTABLE_LAST_LEVEL`: level 3 maps 4 KiB pages.
pub const KVM_PGTABLE_LAST_LEVEL: Level = Level(3);
/// The lowest level that may hold a block at the 4K granule
/// (`KVM_PGTABLE_MIN_BLOCK_LEVEL`): level 1, 1 GiB.
pub const KVM_PGTABLE_MIN_BLOCK_LEVEL: Level = Level(1);

/// `kvm_pte_valid()`.
#[inline]
pub fn kvm_pte_valid(pte: u64) -> bool {
    pte & KVM_PTE_VALID != 0
}

/// `kvm_pte_table()`: a valid table descriptor (never at the last level, where the same type
/// bit means a page).
#[inline]
pub fn kvm_pte_table(pte: u64, level: Level) -> bool {
    level != KVM_PGTABLE_LAST_LEVEL
        && kvm_pte_valid(pte)
        && pte & KVM_PTE_TYPE == KVM_PTE_TYPE_TABLE
}

/// `stage2_pte_is_locked()`: the break-before-make marker.
#[inline]
pub fn stage2_pte_is_locked(pte: u64) -> bool {
    !kvm_pte_valid(pte) && pte & KVM_INVALID_PTE_LOCKED != 0
}

/// `kvm_granule_shift()` in gfns: how far a gfn shifts to number level-`level` entries.
#[inline]
pub fn kvm_granule_gfn_shift(level: Level) -> u32 {
    9 * (KVM_PGTABLE_LAST_LEVEL.0 - level.0) as u32
}

/// `kvm_level_supports_block_mapping()`.
#[inline]
pub fn kvm_level_supports_block_mapping(level: Level) -> bool {
    level >= KVM_PGTABLE_MIN_BLOCK_LEVEL
}

/// The page size an entry at `level` maps (levels 1–3).
#[inline]
pub fn level_page_size(level: Level) -> PageSize {
    match level.0 {
        3 => PageSize::Size4K,
        2 => PageSize::Size2M,
        1 => PageSize::Size1G,
        l => panic!("no stage-2 mapping at level {l} with 4K pages"),
    }
}

/// The level that maps a page of `size`.
#[inline]
pub fn page_size_level(size: PageSize) -> Level {
    match size {
        PageSize::Size4K => Level(3),
        PageSize::Size2M => Level(2),
        PageSize::Size1G => Level(1),
    }
}

/// `ARM64_HW_PGTABLE_LEVELS()` via `stage2_pgtable_levels()` at the 4K granule: the levels a
/// stage-2 of `ia_bits` input bits needs when up to 16 tables may be concatenated at its start
/// level.
pub fn stage2_pgtable_levels(ia_bits: u32) -> u8 {
    ((ia_bits - 4 - 4) / 9) as u8
}

/// The stage-2 level numbering at the 4K granule: down from level 0 at the root to level 3.
pub struct Stage2Geometry;

impl PtGeometry for Stage2Geometry {
    #[inline]
    fn leaf_level() -> Level {
        KVM_PGTABLE_LAST_LEVEL
    }
    #[inline]
    fn level_below(level: Level) -> Level {
        Level(level.0 + 1)
    }
    #[inline]
    fn level_above(level: Level) -> Level {
        Level(level.0 - 1)
    }
    #[inline]
    fn pages(level: Level) -> u64 {
        1 << kvm_granule_gfn_shift(level)
    }
}

/// Stage-2 descriptors as the CPU and KVM both read them (arm64 has one reading: KVM keeps no
/// present bit of its own).
pub struct Stage2;

impl PtFormat for Stage2 {
    const INVALID: u64 = 0;
    #[inline]
    fn is_valid(pte: u64) -> bool {
        kvm_pte_valid(pte)
    }
    #[inline]
    fn is_leaf(pte: u64, level: Level) -> bool {
        kvm_pte_valid(pte) && !kvm_pte_table(pte, level)
    }
    #[inline]
    fn is_table(pte: u64, level: Level) -> bool {
        kvm_pte_table(pte, level)
    }
    #[inline]
    fn table_addr(pte: u64) -> u64 {
        pte & KVM_PTE_ADDR_MASK
    }
    #[inline]
    fn leaf_pfn(pte: u64) -> Pfn {
        Pfn((pte & KVM_PTE_ADDR_MASK) >> 12)
    }
    type Geometry = Stage2Geometry;
}

/// How a stage-2 walk for an access ends, as the fault status code in `ESR_EL2` reports it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum S2Outcome {
    /// The leaf allows the access.
    Allowed,
    /// `ESR_ELx_FSC_FAULT`: translation fault (an invalid entry, locked ones included).
    Translation,
    /// `ESR_ELx_FSC_PERM`: permission fault on a valid leaf.
    Permission,
    /// `ESR_ELx_FSC_ACCESS`: access flag fault (AF clear, no hardware AF management).
    AccessFlag,
}

/// What the CPU makes of the entry its walk stopped at for a read or a write.
#[inline]
pub fn s2_allows(pte: u64, write: bool) -> S2Outcome {
    if !kvm_pte_valid(pte) {
        return S2Outcome::Translation;
    }
    let need = if write {
        KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W
    } else {
        KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R
    };
    if pte & need == 0 {
        return S2Outcome::Permission;
    }
    if pte & KVM_PTE_LEAF_ATTR_LO_S2_AF == 0 {
        return S2Outcome::AccessFlag;
    }
    S2Outcome::Allowed
}

/// The input address a gfn stands for at stage 2 (an IPA).
#[inline]
pub fn ipa(gfn: Gfn) -> u64 {
    gfn.0 << 12
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_page_and_block_descriptors_are_told_apart_by_level() {
        let table = 0x1234_5000 | KVM_PTE_VALID | KVM_PTE_TYPE_TABLE;
        assert!(Stage2::is_table(table, Level(0)) && Stage2::is_table(table, Level(2)));
        assert!(
            Stage2::is_leaf(table, Level(3)),
            "the same bits are a page at level 3"
        );
        let block = 0x4000_0000 | KVM_PTE_VALID | KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R;
        assert!(Stage2::is_leaf(block, Level(1)));
        assert_eq!(Stage2::leaf_pfn(block), Pfn(0x4_0000));
        assert!(!Stage2::is_valid(KVM_INVALID_PTE_LOCKED));
        assert!(stage2_pte_is_locked(KVM_INVALID_PTE_LOCKED));
        assert!(!stage2_pte_is_locked(block | KVM_PTE_LEAF_ATTR_LO_S2_AF));
    }

    #[test]
    fn geometry_of_the_4k_granule() {
        assert_eq!(Stage2Geometry::pages(Level(3)), 1);
        assert_eq!(Stage2Geometry::pages(Level(2)), 512);
        assert_eq!(Stage2Geometry::pages(Level(1)), 1 << 18);
        assert_eq!(Stage2Geometry::pages(Level(0)), 1 << 27);
        assert_eq!(
            Stage2Geometry::index(Gfn((3 << 18) | (5 << 9) | 7), Level(2)),
            5
        );
        assert_eq!(stage2_pgtable_levels(48), 4);
        assert_eq!(stage2_pgtable_levels(40), 3);
        assert_eq!(stage2_pgtable_levels(36), 3);
        assert_eq!(stage2_pgtable_levels(32), 2);
    }

    #[test]
    fn the_cpu_faults_by_kind() {
        let ro = KVM_PTE_VALID
            | KVM_PTE_TYPE
            | KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R
            | KVM_PTE_LEAF_ATTR_LO_S2_AF;
        assert_eq!(s2_allows(ro, false), S2Outcome::Allowed);
        assert_eq!(s2_allows(ro, true), S2Outcome::Permission);
        assert_eq!(
            s2_allows(ro | KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W, true),
            S2Outcome::Allowed
        );
        assert_eq!(
            s2_allows(ro & !KVM_PTE_LEAF_ATTR_LO_S2_AF, false),
            S2Outcome::AccessFlag
        );
        assert_eq!(
            s2_allows(KVM_INVALID_PTE_LOCKED, false),
            S2Outcome::Translation
        );
    }
}
