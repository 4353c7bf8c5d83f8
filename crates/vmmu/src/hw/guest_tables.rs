//! The guest's own stage-1 page tables and the two-dimensional walk a TLB miss makes through
//! them.
//!
//! The selftests' guests map their memory with 4-level, 4 KiB-granule stage-1 tables
//! (`virt_map()`, one `virt_pg_map()` per page) that the library allocates in guest memory with
//! `vm_alloc_page_table()`: pages of memslot 0 (`MEM_REGION_PT`, anonymous memory, so mapped
//! at 4K at stage 2) from `KVM_GUEST_PAGE_TABLE_MIN_PADDR` (0x180000) up, in the order the
//! mapping needs them — the root first, then each level's tables as the addresses grow, so the
//! last-level tables of neighbouring 2 MiB regions are neighbouring pages.
//! [`table_gfn`] approximates that: the root, the level-1 and level-2 tables below the first
//! 2 MiB boundary and the last-level tables from there, indexed by the address modulo their
//! number, so neighbouring regions' tables are neighbouring pages as in the real layout; where
//! they sit relative to the root is not (the real allocator puts the first ~125 last-level
//! tables in the root's 2 MiB region, so a first cold walk there translates one table fewer in
//! full). Guest addresses are keyed by their gfn, as the TLB keys them: memstress maps its test
//! memory at 0xc0000000 (`DEFAULT_GUEST_TEST_MEM`) and its guest-physical base is 1 GiB-aligned
//! too, so the regions a walk entry covers are the same. A memslot placed over the tables'
//! guest-physical range (none of the scenarios does) would have range TLBIs of its own drop
//! their stage-2 walk entries, a cost and nothing else.
//!
//! A guest table is a guest-physical page, so the hardware must translate it through stage 2
//! (EPT) before it reads an entry of it: a walk that no walk entry shortens reads the root's
//! entry, the level-1 and level-2 entries and the leaf, and translates each of those four
//! tables first (Arm ARM D8.2 "Stage 2 translation of stage 1 table addresses"; SDM Vol. 3C
//! §29.3.2; up to 24 references with 4-level tables on both sides, Bhargava et al., ASPLOS
//! 2008). The caches that cut it down ([`Tlb`]):
//! - a walk entry of the address's 2 MiB region holds where its last-level table is: only the
//!   leaf is read (priced in the miss's fixed part, `tlb_miss_ns`);
//! - else one of its 1 GiB region holds where its level-2 table is: that table's entry is
//!   read, and the last-level table translated;
//! - else the walk starts at the root;
//! - a table's stage-2 translation reads its stage-2 leaf only when a stage-2 walk entry holds
//!   the last-level stage-2 table of the table's 2 MiB guest-physical region, and every level
//!   of the stage-2 walk otherwise; the TLB keeps stage-2 translations of blocks only (N1:
//!   "IPA to PA mappings for 2MB and 1GB ... block sizes"; assumed of Cascade Lake), and the
//!   tables' are 4K.
//!
//! The accessed page's own stage-2 walk reads only its leaf when a stage-2 walk entry covers its
//! 2 MiB region too (`Vcpu::access`, `hw_walk_levels`).
//!
//! Not followed: a walk entry of the root's 512 GiB region (a walk that misses the 1 GiB entry
//! reads the root's entry again); the guest's tables' A flags (set once, when the library built
//! them and the guest first walked); a nested guest's own stage-2 walk entries (its walk of the
//! nested EPT is priced at every level, and the TLB's entries are not tagged by EPTP).

use super::tlb::Tlb;
use crate::units::{Gfn, PageSize};

/// The first guest page the selftests' library allocates guest page tables from
/// (`KVM_GUEST_PAGE_TABLE_MIN_PADDR`, 0x180000).
pub const GUEST_PAGE_TABLE_MIN_GFN: u64 = 0x180000 >> 12;

/// Guest pages the layout gives the root, the level-1 and the level-2 tables: up to the first
/// 2 MiB boundary (0x200000), where the last-level tables start.
const UPPER_TABLE_PAGES: u64 = 0x200 - GUEST_PAGE_TABLE_MIN_GFN;

/// The last-level tables are indexed by the address's 2 MiB region modulo this many (1 GiB of
/// tables, enough for 512 GiB of guest memory before two regions' tables share a page).
const LAST_LEVEL_TABLES: u64 = 1 << 18;

/// The guest page that holds the stage-1 table of `level` (0: the root; 3: the last level)
/// on the walk of guest address page `gfn` (see the module documentation): the root, then 32
/// level-1 tables (512 GiB each) and 64 level-2 tables (1 GiB each) indexed by the address
/// modulo their number, then the last-level tables.
pub fn table_gfn(level: u32, gfn: Gfn) -> Gfn {
    let base = GUEST_PAGE_TABLE_MIN_GFN;
    Gfn(match level {
        0 => base,
        1 => base + 1 + ((gfn.0 >> 27) & 0x1f),
        2 => base + 0x21 + ((gfn.0 >> 18) & 0x3f),
        _ => base + UPPER_TABLE_PAGES + ((gfn.0 >> 9) & (LAST_LEVEL_TABLES - 1)),
    })
}

/// What one stage-1 walk read besides the leaf entry.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestWalk {
    /// Guest stage-1 entries read above the leaf (`s1_walk_levels`).
    pub s1_levels: u64,
    /// Stage-2 entries read to translate the guest tables the walk read
    /// (`s1_table_s2_levels`).
    pub s2_levels: u64,
}

/// The guest's stage-1 walk of a combined miss on guest address page `gfn`, through `tlb`'s
/// walk entries, translating each guest table it reads through stage 2 (whose walk reads
/// `stage2_levels` entries from the root); loads the walk entries it filled. The leaf's own
/// entry is not counted (the miss's fixed price).
#[inline]
pub fn walk_guest_tables(tlb: &mut Tlb, gfn: Gfn, stage2_levels: u64) -> GuestWalk {
    let mut w = GuestWalk::default();
    if tlb.lookup_walk(gfn, PageSize::Size2M) {
        return w;
    }
    if !tlb.lookup_walk(gfn, PageSize::Size1G) {
        // From the root: translate it and read its entry, then the level-1 table's.
        for level in 0..2 {
            w.s2_levels += translate_table(tlb, table_gfn(level, gfn), stage2_levels);
            w.s1_levels += 1;
        }
        // Where the level-2 table is: translated now, and cached for the 1 GiB region.
        w.s2_levels += translate_table(tlb, table_gfn(2, gfn), stage2_levels);
        tlb.insert_walk(gfn, PageSize::Size1G);
    }
    // The level-2 entry, then the last-level table's translation, cached for the 2 MiB region.
    w.s1_levels += 1;
    w.s2_levels += translate_table(tlb, table_gfn(3, gfn), stage2_levels);
    tlb.insert_walk(gfn, PageSize::Size2M);
    w
}

/// Stage-2 entries read to translate guest table page `table`: its leaf when a stage-2 walk
/// entry covers its 2 MiB region, else the whole stage-2 walk (whose last-level table is then
/// cached).
#[inline]
fn translate_table(tlb: &mut Tlb, table: Gfn, stage2_levels: u64) -> u64 {
    if tlb.lookup_stage2_walk(table) {
        1
    } else {
        tlb.insert_stage2_walk(table);
        stage2_levels
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::tlb::TlbInvalidation;

    /// A 4-level stage 2 (x86 EPT; arm64 with 48 bits of IPA).
    const S2: u64 = 4;

    #[test]
    fn a_cold_walk_reads_four_levels_and_translates_four_tables() {
        let mut tlb = Tlb::default();
        let g = Gfn(0x3_0000_0000 >> 12);
        // The root, level-1 and level-2 tables share a 2 MiB region: the first walks stage 2
        // in full, the two after it read only their leaves; the last-level table is in the
        // next region.
        assert_eq!(
            walk_guest_tables(&mut tlb, g, S2),
            GuestWalk {
                s1_levels: 3,
                s2_levels: S2 + 1 + 1 + S2
            }
        );
        // The same 2 MiB region: the leaf only.
        assert_eq!(
            walk_guest_tables(&mut tlb, Gfn(g.0 + 7), S2),
            GuestWalk::default()
        );
        // The next 2 MiB region: the level-2 entry, and a last-level table whose stage-2 walk
        // entry is cached.
        assert_eq!(
            walk_guest_tables(&mut tlb, Gfn(g.0 + 512), S2),
            GuestWalk {
                s1_levels: 1,
                s2_levels: 1
            }
        );
    }

    #[test]
    fn vmalls12e1is_costs_the_refill_that_an_ipa_range_and_vmalle1is_leave_cached() {
        let g = Gfn(0x3_0000_0000 >> 12);
        let warm = || {
            let mut tlb = Tlb::default();
            walk_guest_tables(&mut tlb, g, S2);
            tlb
        };
        // KVM's range flush of the test memory: the stage-2 walk entries of the guest's
        // tables (memslot 0) stay, so the walk from the root reads one stage-2 leaf per table.
        let mut range = warm();
        range.invalidate(TlbInvalidation::Range {
            start: Gfn(g.0 - 512),
            pages: 1024,
        });
        range.invalidate(TlbInvalidation::Stage1All);
        assert_eq!(
            walk_guest_tables(&mut range, g, S2),
            GuestWalk {
                s1_levels: 3,
                s2_levels: 4
            }
        );
        // VMALLS12E1IS: every table's stage-2 translation is walked again.
        let mut all = warm();
        all.invalidate(TlbInvalidation::All);
        assert_eq!(
            walk_guest_tables(&mut all, g, S2),
            GuestWalk {
                s1_levels: 3,
                s2_levels: S2 + 1 + 1 + S2
            }
        );
        // An IPA range over the guest's tables drops their stage-2 walk entries too.
        let mut over_tables = warm();
        over_tables.invalidate(TlbInvalidation::Range {
            start: Gfn(GUEST_PAGE_TABLE_MIN_GFN),
            pages: 1 << 20,
        });
        over_tables.invalidate(TlbInvalidation::Stage1All);
        assert_eq!(
            walk_guest_tables(&mut over_tables, g, S2).s2_levels,
            2 * S2 + 2
        );
    }

    #[test]
    fn neoverse_n1_keeps_both_walk_kinds_in_its_l2() {
        // A 40-bit IPA's stage 2: 3 levels.
        let mut tlb = Tlb::new(&crate::hw::tlb::NEOVERSE_N1);
        let g = Gfn(0xff_c000_0000 >> 12);
        assert_eq!(
            walk_guest_tables(&mut tlb, g, 3),
            GuestWalk {
                s1_levels: 3,
                s2_levels: 3 + 1 + 1 + 3
            }
        );
        assert_eq!(
            walk_guest_tables(&mut tlb, Gfn(g.0 + 512), 3),
            GuestWalk {
                s1_levels: 1,
                s2_levels: 1
            }
        );
        tlb.invalidate(TlbInvalidation::Stage1All);
        assert_eq!(
            walk_guest_tables(&mut tlb, g, 3),
            GuestWalk {
                s1_levels: 3,
                s2_levels: 4
            }
        );
    }

    #[test]
    fn the_tables_are_laid_out_in_address_order_apart_from_the_test_memory() {
        let g = Gfn(0x3fef_c000_0000 >> 12);
        assert_eq!(table_gfn(0, g), Gfn(GUEST_PAGE_TABLE_MIN_GFN));
        let (a, b) = (table_gfn(3, g), table_gfn(3, Gfn(g.0 + 512)));
        assert_eq!(b.0, a.0 + 1, "neighbouring regions, neighbouring tables");
        for level in 0..4 {
            let t = table_gfn(level, g).0;
            assert!((GUEST_PAGE_TABLE_MIN_GFN
                ..GUEST_PAGE_TABLE_MIN_GFN + UPPER_TABLE_PAGES + LAST_LEVEL_TABLES)
                .contains(&t));
            assert_eq!(level < 3, t < GUEST_PAGE_TABLE_MIN_GFN + UPPER_TABLE_PAGES);
        }
    }
}
