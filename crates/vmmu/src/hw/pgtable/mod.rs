//! Page-table formats behind one trait, and one walker for all of them.
//!
//! The shape is arm64's `pgtable.c`: a format says what an entry means (invalid value, valid,
//! table or leaf, where a table entry points, how many pages an entry at a level spans, how a
//! gfn indexes a table), and one walker ([`walk`]) does every walk over any format, as a
//! resumable cursor ([`walk::PtIter`], which carries `tdp_iter`'s yield and restart rules) or
//! as a range walk with visitors ([`walk::walk_range`], with `kvm_pgtable_walk()`'s LEAF,
//! TABLE_PRE and TABLE_POST flags and its SHARED mode).
//!
//! A format here describes *how the walk proceeds*, not who wrote the entries: the hardware's
//! view of EPT ([`crate::hw::ept::Ept`], an entry is valid when any of R/W/X is set) and KVM's
//! view of its own SPTEs (`x86::spte::TdpSpte`, valid when KVM's shadow-present bit is set)
//! are two formats over the same bits, as KVM's `is_shadow_present_pte()` and the CPU's EPT
//! walk are two readings of one entry.
//!
//! Levels are opaque to the walker: it only asks the format for the level below or above, how
//! many 4 KiB pages an entry at a level spans, and the index of a gfn in a table at a level.
//! x86 numbers levels up from the leaf (`PG_LEVEL_4K == 1`), arm64 down from the root (level 3
//! maps 4 KiB); each format keeps its architecture's numbering.

pub mod walk;

use crate::units::{Gfn, Pfn};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// A page-table level, numbered as its format numbers them (x86 up from the leaf, arm64 down
/// from the root): the walker never does arithmetic on it, it asks the format.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Level(pub u8);

impl fmt::Debug for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "level {}", self.0)
    }
}

/// Entries in one 4 KiB page table of 64-bit entries (x86's `SPTE_ENT_PER_PAGE`, arm64's
/// `PTRS_PER_PTE` at the 4K granule).
pub const PTES_PER_TABLE: usize = 512;

/// What an entry of one page-table format means. Every method is a pure function of the entry
/// value (and the level it sits at), so formats are zero-sized types.
pub trait PtFormat: 'static {
    /// The value of an entry that maps nothing, as freshly allocated tables are filled with it.
    const INVALID: u64;

    /// The entry maps something or points to a table (x86 `is_shadow_present_pte()` or the
    /// CPU's R/W/X test; arm64 `kvm_pte_valid()`).
    fn is_valid(pte: u64) -> bool;

    /// The entry at `level` is a valid leaf: a page or a block (x86 `is_last_spte()` on a
    /// present entry; arm64 a valid entry that is not `kvm_pte_table()`).
    fn is_leaf(pte: u64, level: Level) -> bool;

    /// The entry at `level` points to a child table (x86 present non-leaf; arm64
    /// `kvm_pte_table()`).
    fn is_table(pte: u64, level: Level) -> bool {
        Self::is_valid(pte) && !Self::is_leaf(pte, level)
    }

    /// The host address of the child table a table entry points to (x86 `spte_to_child_pt()`,
    /// arm64 `kvm_pte_follow()`).
    fn table_addr(pte: u64) -> u64;

    /// The first host frame a leaf maps (x86 `spte_to_pfn()`, arm64 `kvm_pte_to_phys()`).
    fn leaf_pfn(pte: u64) -> Pfn;

    /// How the format's levels step and index: formats over the same tables share one.
    type Geometry: PtGeometry;

    /// The lowest level, whose entries are always leaves (4 KiB pages).
    #[inline]
    fn leaf_level() -> Level {
        Self::Geometry::leaf_level()
    }
    /// The level one step towards the leaves.
    #[inline]
    fn level_below(level: Level) -> Level {
        Self::Geometry::level_below(level)
    }
    /// The level one step towards the root.
    #[inline]
    fn level_above(level: Level) -> Level {
        Self::Geometry::level_above(level)
    }
    /// 4 KiB pages mapped by one entry at `level`.
    #[inline]
    fn pages(level: Level) -> u64 {
        Self::Geometry::pages(level)
    }
    /// The index of `gfn`'s entry in a table at `level`.
    #[inline]
    fn index(gfn: Gfn, level: Level) -> usize {
        Self::Geometry::index(gfn, level)
    }
    /// `gfn` rounded down to the first gfn of the entry at `level` that maps it.
    #[inline]
    fn round(gfn: Gfn, level: Level) -> Gfn {
        Self::Geometry::round(gfn, level)
    }
}

/// A hierarchy's shape: how its levels are numbered and step, how many pages an entry at a
/// level spans, and how a gfn indexes a table. It is the architecture's (x86 counts up from the
/// leaf, arm64 down from the root); the entry formats over it say what entries mean.
pub trait PtGeometry: 'static {
    /// The lowest level, whose entries are always leaves (4 KiB pages).
    fn leaf_level() -> Level;

    /// The level one step towards the leaves.
    fn level_below(level: Level) -> Level;

    /// The level one step towards the root.
    fn level_above(level: Level) -> Level;

    /// 4 KiB pages mapped by one entry at `level` (`KVM_PAGES_PER_HPAGE()`,
    /// `kvm_granule_size() >> PAGE_SHIFT`).
    fn pages(level: Level) -> u64;

    /// The index of `gfn`'s entry in a table at `level` (x86 `SPTE_INDEX()`, arm64
    /// `kvm_pgtable_idx()`).
    fn index(gfn: Gfn, level: Level) -> usize {
        ((gfn.0 / Self::pages(level)) % PTES_PER_TABLE as u64) as usize
    }

    /// `gfn` rounded down to the first gfn of the entry at `level` that maps it.
    fn round(gfn: Gfn, level: Level) -> Gfn {
        Gfn(gfn.0 & !(Self::pages(level) - 1))
    }
}

/// One 64-bit entry cell. Page tables use [`AtomicU64`]; a model checker plugs in its own
/// atomic so the very protocol functions the MMUs run are the ones it explores.
pub trait SpteCell {
    /// `READ_ONCE()` of the entry.
    fn load(&self) -> u64;
    /// `WRITE_ONCE()` of the entry (only for entries nobody else may change).
    fn store(&self, v: u64);
    /// `try_cmpxchg64()`: `Ok(old)` when the entry still held `old`, else `Err(current)`.
    fn cmpxchg(&self, old: u64, new: u64) -> Result<u64, u64>;
    /// `xchg()`.
    fn xchg(&self, v: u64) -> u64;
    /// `atomic64_fetch_and()`: clears the bits `mask` does not keep, returns the old value.
    fn fetch_and(&self, mask: u64) -> u64;
}

impl SpteCell for AtomicU64 {
    #[inline]
    fn load(&self) -> u64 {
        // Acquire pairs with the SeqCst RMW that linked a child table, so the child's
        // initialised entries are visible before a walker steps into it.
        self.load(Ordering::Acquire)
    }
    #[inline]
    fn store(&self, v: u64) {
        self.store(v, Ordering::Release)
    }
    #[inline]
    fn cmpxchg(&self, old: u64, new: u64) -> Result<u64, u64> {
        self.compare_exchange(old, new, Ordering::SeqCst, Ordering::Acquire)
    }
    #[inline]
    fn xchg(&self, v: u64) -> u64 {
        self.swap(v, Ordering::SeqCst)
    }
    #[inline]
    fn fetch_and(&self, mask: u64) -> u64 {
        AtomicU64::fetch_and(self, mask, Ordering::SeqCst)
    }
}
