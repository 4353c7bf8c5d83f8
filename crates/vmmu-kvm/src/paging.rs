//! Guest page tables, built by the host: a 4-level x86-64 identity map (guest virtual address
//! = guest physical address) of a few ranges, with 2 MiB or 1 GiB leaves.
//!
//! The guest never changes them. Every entry is created with Accessed (and, for leaves, Dirty)
//! already set, so the CPU (or KVM's emulator, which walks these tables on this kind of host)
//! never has to write them back; the guest page tables therefore never show up as dirty.

use crate::error::KvmError;
use std::collections::BTreeMap;

/// x86 page-table entry bits used here.
pub mod pte {
    /// Present.
    pub const P: u64 = 1 << 0;
    /// Writable.
    pub const RW: u64 = 1 << 1;
    /// Accessed.
    pub const A: u64 = 1 << 5;
    /// Dirty (leaves only).
    pub const D: u64 = 1 << 6;
    /// Page size: this PDE/PDPTE is a leaf.
    pub const PS: u64 = 1 << 7;
    /// Physical address bits 51:12.
    pub const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
}

/// The leaf size of the guest's identity map.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GuestPageSize {
    /// 2 MiB leaves in page directories.
    Size2M,
    /// 1 GiB leaves in PDPTs (needs the PDPE1GB CPUID bit in the guest).
    Size1G,
}

impl GuestPageSize {
    /// Bytes covered by one leaf.
    pub fn bytes(self) -> u64 {
        match self {
            GuestPageSize::Size2M => 2 << 20,
            GuestPageSize::Size1G => 1 << 30,
        }
    }
}

const TABLE_BYTES: u64 = 4096;
const ENTRIES: usize = 512;

/// A built set of page tables: the CR3 value and every table's guest physical address and
/// contents, ready to be copied into guest memory.
#[derive(Clone, Debug)]
pub struct PageTables {
    /// Guest physical address of the PML4 (goes in CR3).
    pub root: u64,
    /// Every table, by guest physical address.
    pub tables: BTreeMap<u64, Vec<u64>>,
}

impl PageTables {
    /// How many 4 KiB tables [`PageTables::identity_map`] needs for `ranges`, so the caller can
    /// size the memory they live in before building them.
    pub fn tables_needed(ranges: &[(u64, u64)], size: GuestPageSize) -> u64 {
        let mut pdpts = std::collections::BTreeSet::new();
        let mut pds = std::collections::BTreeSet::new();
        for &(start, len) in ranges {
            if len == 0 {
                continue;
            }
            let first = start / size.bytes();
            let last = (start + len - 1) / size.bytes();
            for leaf in first..=last {
                let addr = leaf * size.bytes();
                pdpts.insert(addr >> 39);
                if size == GuestPageSize::Size2M {
                    pds.insert(addr >> 30);
                }
            }
        }
        1 + pdpts.len() as u64 + pds.len() as u64
    }

    /// Builds an identity map of `ranges` (`(start, len)` in bytes; each is widened to whole
    /// leaves) with tables placed one after another from `table_base`, which must be 4 KiB
    /// aligned, using at most `table_limit` bytes.
    pub fn identity_map(
        ranges: &[(u64, u64)],
        size: GuestPageSize,
        table_base: u64,
        table_limit: u64,
    ) -> Result<PageTables, KvmError> {
        if !table_base.is_multiple_of(TABLE_BYTES) {
            return Err(KvmError::InvalidParams(format!(
                "page tables must start on a 4 KiB boundary, not {table_base:#x}"
            )));
        }
        let mut b = Builder {
            tables: BTreeMap::new(),
            next: table_base,
            end: table_base.saturating_add(table_limit),
        };
        let root = b.alloc()?;
        for &(start, len) in ranges {
            if len == 0 {
                continue;
            }
            let end = start
                .checked_add(len)
                .filter(|e| *e <= 1 << 48)
                .ok_or_else(|| {
                    KvmError::InvalidParams(format!(
                        "range {start:#x}+{len:#x} is beyond the 48-bit guest address space"
                    ))
                })?;
            let mut addr = start - start % size.bytes();
            while addr < end {
                b.map_leaf(root, addr, size)?;
                addr += size.bytes();
            }
        }
        Ok(PageTables {
            root,
            tables: b.tables,
        })
    }

    /// Walks the tables like the MMU does and returns the physical address `va` maps to, or
    /// `None` if it is not mapped (for tests and for diagnosing guest crashes).
    pub fn translate(&self, va: u64) -> Option<u64> {
        let mut table = self.root;
        for (level, shift) in [(4, 39), (3, 30), (2, 21)] {
            let e = self.tables.get(&table)?[((va >> shift) & 511) as usize];
            if e & pte::P == 0 {
                return None;
            }
            if e & pte::PS != 0 && level < 4 {
                let mask = (1u64 << shift) - 1;
                return Some((e & pte::ADDR_MASK & !mask) | (va & mask));
            }
            table = e & pte::ADDR_MASK;
        }
        None
    }
}

struct Builder {
    tables: BTreeMap<u64, Vec<u64>>,
    next: u64,
    end: u64,
}

impl Builder {
    fn alloc(&mut self) -> Result<u64, KvmError> {
        if self.next + TABLE_BYTES > self.end {
            return Err(KvmError::InvalidParams(
                "the guest page tables do not fit in the space reserved for them".into(),
            ));
        }
        let gpa = self.next;
        self.next += TABLE_BYTES;
        self.tables.insert(gpa, vec![0; ENTRIES]);
        Ok(gpa)
    }

    /// Returns the table the entry at `index` of `table` points to, creating it if absent.
    fn child(&mut self, table: u64, index: usize) -> Result<u64, KvmError> {
        let e = self.tables[&table][index];
        if e & pte::P != 0 {
            return Ok(e & pte::ADDR_MASK);
        }
        let child = self.alloc()?;
        if let Some(t) = self.tables.get_mut(&table) {
            t[index] = child | pte::P | pte::RW | pte::A;
        }
        Ok(child)
    }

    fn map_leaf(&mut self, root: u64, addr: u64, size: GuestPageSize) -> Result<(), KvmError> {
        let pdpt = self.child(root, ((addr >> 39) & 511) as usize)?;
        let (table, index) = match size {
            GuestPageSize::Size1G => (pdpt, ((addr >> 30) & 511) as usize),
            GuestPageSize::Size2M => {
                let pd = self.child(pdpt, ((addr >> 30) & 511) as usize)?;
                (pd, ((addr >> 21) & 511) as usize)
            }
        };
        if let Some(t) = self.tables.get_mut(&table) {
            t[index] = addr | pte::P | pte::RW | pte::A | pte::D | pte::PS;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    #[test]
    fn identity_map_with_2m_leaves_translates_every_mapped_address() {
        let ranges = [(0, 2 << 20), (4 * G, 3 * G + 4096)];
        let need = PageTables::tables_needed(&ranges, GuestPageSize::Size2M);
        // PML4 + one PDPT + PDs for [0,1G) and [4G,8G).
        assert_eq!(need, 1 + 1 + 1 + 4);
        let pt =
            PageTables::identity_map(&ranges, GuestPageSize::Size2M, 0x10000, need * 4096).unwrap();
        assert_eq!(pt.tables.len() as u64, need);
        assert_eq!(pt.root, 0x10000);
        for va in [
            0,
            0x1234,
            (2 << 20) - 8,
            4 * G,
            5 * G + 0x2345,
            7 * G + 4096,
        ] {
            assert_eq!(pt.translate(va), Some(va), "{va:#x}");
        }
        assert_eq!(pt.translate(2 * G), None);
        assert_eq!(pt.translate(8 * G), None);
        let pde = pt
            .tables
            .values()
            .flatten()
            .find(|e| **e & pte::PS != 0)
            .unwrap();
        assert_eq!(pde & (pte::P | pte::RW | pte::A | pte::D), 0x63);
    }

    #[test]
    fn identity_map_with_1g_leaves_needs_no_page_directories() {
        let ranges = [(0, 4096), (4 * G, 64 * G)];
        let need = PageTables::tables_needed(&ranges, GuestPageSize::Size1G);
        assert_eq!(need, 2);
        let pt = PageTables::identity_map(&ranges, GuestPageSize::Size1G, 0x1000, 8192).unwrap();
        assert_eq!(pt.translate(67 * G + 77), Some(67 * G + 77));
        assert_eq!(pt.translate(68 * G), None);
    }

    #[test]
    fn ranges_past_512g_get_a_second_pdpt_and_too_little_space_is_an_error() {
        let ranges = [(0, 4096), (511 * G, 2 * G)];
        assert_eq!(PageTables::tables_needed(&ranges, GuestPageSize::Size1G), 3);
        let pt = PageTables::identity_map(&ranges, GuestPageSize::Size1G, 0, 3 * 4096).unwrap();
        assert_eq!(pt.translate(512 * G + 5), Some(512 * G + 5));
        assert!(PageTables::identity_map(&ranges, GuestPageSize::Size1G, 0, 2 * 4096).is_err());
        assert!(PageTables::identity_map(&ranges, GuestPageSize::Size1G, 12, 1 << 20).is_err());
        assert!(
            PageTables::identity_map(&[(1 << 48, 1)], GuestPageSize::Size2M, 0, 1 << 20).is_err()
        );
    }
}
