//! Units: guest frame numbers, guest physical addresses, host page frame numbers, page-table
//! levels and page sizes. Arithmetic only; no policy lives here.
//!
//! Levels follow KVM's numbering (`PG_LEVEL_4K == 1`), so a rule quoted from `arch/x86/kvm/mmu/`
//! reads the same here.

use serde::{Deserialize, Serialize};
use std::fmt;

/// log2 of the base page size (4 KiB).
pub const PAGE_SHIFT: u32 = 12;
/// The base page size in bytes.
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;
/// Entries in one page table (KVM's `SPTE_ENT_PER_PAGE`).
pub const SPTE_ENT_PER_PAGE: usize = 512;
/// Bits of a gfn consumed by one level of page table (KVM's `SPTE_LEVEL_BITS`).
pub const SPTE_LEVEL_BITS: u32 = 9;

/// A guest frame number: a guest physical address shifted right by [`PAGE_SHIFT`].
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Gfn(pub u64);

/// A guest physical address.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Gpa(pub u64);

/// A host page frame number: an index into the host's backing memory in 4 KiB units.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Pfn(pub u64);

impl Gfn {
    /// The guest physical address of the first byte of this frame.
    pub fn to_gpa(self) -> Gpa {
        Gpa(self.0 << PAGE_SHIFT)
    }
    /// This gfn rounded down to the first gfn of the `level` page containing it
    /// (KVM's `gfn_round_for_level()`).
    pub fn round_for_level(self, level: Level) -> Gfn {
        Gfn(self.0 & !(level.pages() - 1))
    }
    /// The index of this gfn's entry in a table at `level` (KVM's `SPTE_INDEX()`).
    pub fn spte_index(self, level: Level) -> usize {
        ((self.0 >> level.gfn_shift()) & (SPTE_ENT_PER_PAGE as u64 - 1)) as usize
    }
}

/// A range of guest frames `[start, end)`: what a caller owes a TLB flush for.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct GfnRange {
    /// First gfn.
    pub start: Gfn,
    /// One past the last gfn.
    pub end: Gfn,
}

impl GfnRange {
    /// `pages` frames from `start`.
    pub fn new(start: Gfn, pages: u64) -> Self {
        GfnRange {
            start,
            end: Gfn(start.0 + pages),
        }
    }
    /// Frames in the range.
    pub fn pages(self) -> u64 {
        self.end.0 - self.start.0
    }
    /// The smallest range covering both.
    pub fn union(self, other: GfnRange) -> GfnRange {
        GfnRange {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

/// Adds `range` to what `owed` covers (a caller's pending flush; `None`: nothing owed).
pub fn owe_flush(owed: &mut Option<GfnRange>, range: GfnRange) {
    *owed = Some(owed.map_or(range, |o| o.union(range)));
}

impl Gpa {
    /// The frame holding this address.
    pub fn to_gfn(self) -> Gfn {
        Gfn(self.0 >> PAGE_SHIFT)
    }
}

impl fmt::Debug for Gfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gfn {:#x}", self.0)
    }
}
impl fmt::Display for Gfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}
impl fmt::Debug for Gpa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpa {:#x}", self.0)
    }
}
impl fmt::Debug for Pfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pfn {:#x}", self.0)
    }
}

/// A page-table level, numbered as KVM numbers them: 1 maps 4 KiB, 2 maps 2 MiB, 3 maps 1 GiB,
/// 4 is the root of a 4-level EPT hierarchy.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Level(pub u8);

/// KVM's `PG_LEVEL_4K`.
pub const PG_LEVEL_4K: Level = Level(1);
/// KVM's `PG_LEVEL_2M`.
pub const PG_LEVEL_2M: Level = Level(2);
/// KVM's `PG_LEVEL_1G`.
pub const PG_LEVEL_1G: Level = Level(3);
/// The root level of 4-level EPT (`PT64_ROOT_4LEVEL`).
pub const PT64_ROOT_4LEVEL: Level = Level(4);
/// The largest level a leaf may sit at (`KVM_MAX_HUGEPAGE_LEVEL`).
pub const KVM_MAX_HUGEPAGE_LEVEL: Level = PG_LEVEL_1G;

impl Level {
    /// How far a gfn is shifted to index a table at this level.
    pub fn gfn_shift(self) -> u32 {
        (self.0 as u32 - 1) * SPTE_LEVEL_BITS
    }
    /// 4 KiB pages mapped by one entry at this level (KVM's `KVM_PAGES_PER_HPAGE()`).
    pub fn pages(self) -> u64 {
        1 << self.gfn_shift()
    }
    /// Bytes mapped by one entry at this level.
    pub fn bytes(self) -> u64 {
        self.pages() << PAGE_SHIFT
    }
    /// The next level down. Panics on 4K, which has none: callers check first.
    pub fn below(self) -> Level {
        assert!(self.0 > 1, "no level below 4K");
        Level(self.0 - 1)
    }
    /// The next level up.
    pub fn above(self) -> Level {
        Level(self.0 + 1)
    }
    /// A short human name: "4K", "2M", "1G", "512G".
    pub fn name(self) -> &'static str {
        match self.0 {
            1 => "4K",
            2 => "2M",
            3 => "1G",
            4 => "512G",
            _ => "?",
        }
    }
}

impl fmt::Debug for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses a size the way KVM selftests' `parse_size()` does: a number, optionally followed by one
/// of `k`, `m`, `g`, `t` (either case, powers of 1024). Returns a one-line error on bad input.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_lowercase() {
                'b' => 1u64,
                'k' => 1 << 10,
                'm' => 1 << 20,
                'g' => 1 << 30,
                't' => 1 << 40,
                _ => {
                    return Err(format!(
                        "size '{s}' has an unknown suffix: use a number with optional K, M, G or T"
                    ))
                }
            };
            (&t[..t.len() - 1], m)
        }
        _ => (t, 1),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("size '{s}' is not a number with optional K, M, G or T suffix"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("size '{s}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_geometry_matches_kvm() {
        assert_eq!(PG_LEVEL_4K.pages(), 1);
        assert_eq!(PG_LEVEL_2M.pages(), 512);
        assert_eq!(PG_LEVEL_1G.pages(), 512 * 512);
        assert_eq!(PG_LEVEL_1G.bytes(), 1 << 30);
        let gfn = Gfn(0x4_0203);
        assert_eq!(gfn.spte_index(PG_LEVEL_4K), 0x003);
        assert_eq!(gfn.spte_index(PG_LEVEL_2M), 0x001);
        assert_eq!(gfn.spte_index(PG_LEVEL_1G), 0x001);
        assert_eq!(gfn.round_for_level(PG_LEVEL_2M), Gfn(0x4_0200));
        assert_eq!(gfn.round_for_level(PG_LEVEL_1G), Gfn(0x4_0000));
    }

    #[test]
    fn parse_size_accepts_selftest_forms_and_rejects_garbage() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10M").unwrap(), 10 << 20);
        assert_eq!(parse_size("3g").unwrap(), 3 << 30);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
