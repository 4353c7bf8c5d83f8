//! A per-vCPU TLB that caches translations *with their permissions* until invalidated.
//!
//! A write that hits a stale writable entry succeeds without consulting the page tables, exactly
//! as on hardware; that is what makes a missing flush a real bug here. Geometry (direct-mapped,
//! separate arrays per page size) is a simplification of a set-associative STLB: what matters to
//! the MMU is *whether* a stale entry can survive, not the replacement policy.

use crate::hw::ept::{Level, X86Level, PG_LEVEL_1G, PG_LEVEL_2M, PG_LEVEL_4K};
use crate::units::{Gfn, Pfn};

/// 4 KiB entries (order of a modern STLB's 1536).
pub const TLB_4K_ENTRIES: usize = 1024;
/// 2 MiB entries.
pub const TLB_2M_ENTRIES: usize = 256;
/// 1 GiB entries (a modern core has 16).
pub const TLB_1G_ENTRIES: usize = 16;

#[derive(Copy, Clone, Default)]
struct TlbEntry {
    /// `(gfn >> level shift) + 1`; 0 means invalid.
    tag: u64,
    /// PFN of the first 4 KiB page the entry maps.
    pfn: u64,
    writable: bool,
    dirty: bool,
}

/// A cached translation for one gfn.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Translation {
    /// Host frame backing the gfn.
    pub pfn: Pfn,
    /// The cached leaf allowed writes when it was loaded.
    pub writable: bool,
    /// The cached leaf already had its Dirty flag set (a write needs no page-walk to set D).
    pub dirty: bool,
}

/// One vCPU's TLB. Owned by the vCPU; other actors invalidate it only by request
/// (`KVM_REQ_TLB_FLUSH`), as on hardware.
pub struct Tlb {
    e4k: Box<[TlbEntry]>,
    e2m: Box<[TlbEntry]>,
    e1g: Box<[TlbEntry]>,
}

impl Default for Tlb {
    fn default() -> Self {
        Tlb {
            e4k: vec![TlbEntry::default(); TLB_4K_ENTRIES].into_boxed_slice(),
            e2m: vec![TlbEntry::default(); TLB_2M_ENTRIES].into_boxed_slice(),
            e1g: vec![TlbEntry::default(); TLB_1G_ENTRIES].into_boxed_slice(),
        }
    }
}

impl Tlb {
    fn array(&mut self, level: Level) -> &mut [TlbEntry] {
        match level {
            PG_LEVEL_4K => &mut self.e4k,
            PG_LEVEL_2M => &mut self.e2m,
            _ => &mut self.e1g,
        }
    }

    /// Looks `gfn` up, largest page size first.
    #[inline]
    pub fn lookup(&self, gfn: Gfn) -> Option<Translation> {
        for (arr, level) in [
            (&self.e1g, PG_LEVEL_1G),
            (&self.e2m, PG_LEVEL_2M),
            (&self.e4k, PG_LEVEL_4K),
        ] {
            let vpn = gfn.0 >> level.gfn_shift();
            let e = &arr[(vpn as usize) % arr.len()];
            if e.tag == vpn + 1 {
                return Some(Translation {
                    pfn: Pfn(e.pfn + (gfn.0 & (level.pages() - 1))),
                    writable: e.writable,
                    dirty: e.dirty,
                });
            }
        }
        None
    }

    /// Caches the leaf at `level` that maps `gfn`; `leaf_pfn` is the leaf's first frame.
    pub fn insert(&mut self, gfn: Gfn, level: Level, leaf_pfn: Pfn, writable: bool, dirty: bool) {
        let vpn = gfn.0 >> level.gfn_shift();
        let arr = self.array(level);
        let n = arr.len();
        arr[(vpn as usize) % n] = TlbEntry {
            tag: vpn + 1,
            pfn: leaf_pfn.0,
            writable,
            dirty,
        };
    }

    /// Drops every cached translation (what `KVM_REQ_TLB_FLUSH` does on the vCPU).
    pub fn flush_all(&mut self) {
        for arr in [&mut self.e4k, &mut self.e2m, &mut self.e1g] {
            arr.iter_mut().for_each(|e| e.tag = 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_entries_survive_until_flushed() {
        let mut tlb = Tlb::default();
        assert_eq!(tlb.lookup(Gfn(5)), None);
        tlb.insert(Gfn(0x200 + 5), PG_LEVEL_2M, Pfn(0x1000), true, true);
        let t = tlb.lookup(Gfn(0x205)).unwrap();
        assert_eq!(t.pfn, Pfn(0x1005));
        assert!(t.writable, "a cached writable entry keeps allowing writes");
        tlb.flush_all();
        assert_eq!(tlb.lookup(Gfn(0x205)), None);
    }

    #[test]
    fn conflicting_entries_evict_each_other() {
        let mut tlb = Tlb::default();
        tlb.insert(Gfn(1), PG_LEVEL_4K, Pfn(10), false, false);
        tlb.insert(
            Gfn(1 + TLB_4K_ENTRIES as u64),
            PG_LEVEL_4K,
            Pfn(20),
            false,
            false,
        );
        assert_eq!(tlb.lookup(Gfn(1)), None);
        assert_eq!(
            tlb.lookup(Gfn(1 + TLB_4K_ENTRIES as u64)).unwrap().pfn,
            Pfn(20)
        );
    }
}
