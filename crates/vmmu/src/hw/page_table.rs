//! Page-table memory: tables of 512 atomic entries, one 4 KiB page each, reached from a parent
//! entry through the table's host address (as KVM reaches `spte_to_child_pt()` through
//! `__va(pfn << PAGE_SHIFT)`), and freed only after an RCU grace period (crossbeam's epochs)
//! so that walkers without `mmu_lock` never touch freed memory.

use crate::hw::cache::LineCost;
use crate::hw::pgtable::PTES_PER_TABLE;
use crossbeam_epoch::Guard;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// One page table: 512 SPTEs, page aligned so its address fits an SPTE's PFN field.
#[repr(C, align(4096))]
pub struct PageTable {
    /// The entries (KVM's `sp->spt`).
    pub spt: [AtomicU64; PTES_PER_TABLE],
}

const _: () = assert!(std::mem::size_of::<PageTable>() == 4096);

impl PageTable {
    /// The host address of this table, as stored in a parent's non-leaf SPTE.
    pub fn addr(&self) -> u64 {
        self as *const PageTable as u64
    }
}

/// Where a VM's tables live in a model of the host's caches, and what touching their entries
/// costs there (the kvm layer's `host_caches` implements it; an engine without that model
/// installs none).
pub trait TableLines: Send + Sync + std::fmt::Debug {
    /// The running core allocated the table at host address `table` and filled it.
    fn allocated(&self, table: u64);
    /// The table at `table` is being freed (its address may be reused from now on).
    fn released(&self, table: u64);
    /// The running core reads or writes entry `index` of the table at `table`: what that costs
    /// beyond the same access from its L2 (a table allocated before the model was installed
    /// is placed on its first access).
    fn entry(&self, table: u64, index: usize) -> LineCost;
}

/// Counts tables across their life, so leaks and metadata memory can be reported, and tells
/// the host's cache model where they are ([`TableLines`]), when one is installed.
#[derive(Debug, Default)]
pub struct PageTableStats {
    /// Tables allocated and not yet freed (including those waiting for a grace period).
    pub live: AtomicI64,
    /// Tables ever allocated.
    pub allocated: AtomicU64,
    /// Tables whose memory was returned after a grace period.
    pub freed: AtomicU64,
    /// The host's cache model, once an engine installs it.
    lines: OnceLock<Arc<dyn TableLines>>,
}

impl PageTableStats {
    /// Follows the tables allocated from now on in `lines`; false if some model already does.
    pub fn install_lines(&self, lines: Arc<dyn TableLines>) -> bool {
        self.lines.set(lines).is_ok()
    }

    /// The host's cache model, if one follows these tables.
    #[inline]
    pub fn lines(&self) -> Option<&dyn TableLines> {
        self.lines.get().map(|l| &**l)
    }

    /// Counts a new table at `addr` (and places it in the cache model).
    pub fn table_allocated(&self, addr: u64) {
        self.live.fetch_add(1, Ordering::Relaxed);
        self.allocated.fetch_add(1, Ordering::Relaxed);
        if let Some(l) = self.lines() {
            l.allocated(addr);
        }
    }

    /// Counts the table at `addr` as freed. Must run before its memory is returned, so a new
    /// table at the same address is placed after this one left.
    pub fn table_released(&self, addr: u64) {
        if let Some(l) = self.lines() {
            l.released(addr);
        }
        self.live.fetch_sub(1, Ordering::Relaxed);
        self.freed.fetch_add(1, Ordering::Relaxed);
    }

    /// What touching entry `index` of `table` costs in the host's caches (`Free` without a
    /// model).
    #[inline]
    pub fn entry_cost(&self, table: &PageTable, index: usize) -> LineCost {
        match self.lines() {
            Some(l) => l.entry(table.addr(), index),
            None => LineCost::Free,
        }
    }
}

/// Allocates a table with every entry set to `init_value`, the format's invalid entry (KVM's
/// `kvm_mmu_memory_cache.init_value`: x86 pre-fills shadow pages with
/// `SHADOW_NONPRESENT_VALUE`, so a table is linked already valid; arm64 uses zeroed pages).
pub fn alloc_page_table(stats: &PageTableStats, init_value: u64) -> Box<PageTable> {
    let table = Box::new(PageTable {
        spt: std::array::from_fn(|_| AtomicU64::new(init_value)),
    });
    stats.table_allocated(table.addr());
    table
}

/// Frees a table that was never linked (an unused cache entry or a lost link race): nobody else
/// can have seen it, so no grace period is needed.
pub fn free_unlinked_page_table(stats: &PageTableStats, table: Box<PageTable>) {
    stats.table_released(table.addr());
    drop(table);
}

/// The table at host address `addr`, as a table entry stores it (the walkers reach a child
/// through it, as KVM does through `__va()` of the entry's address).
///
/// # Safety
/// `addr` must come from a table entry read, inside `guard`'s critical section, from a table
/// that was itself reachable from a live root, and that entry must point to a table. Tables are
/// only freed through [`free_page_table_rcu`] after they are unlinked, and that free waits until
/// every guard pinned before the unlink is dropped; so the table outlives `guard`.
pub unsafe fn table_at(addr: u64, _guard: &Guard) -> &PageTable {
    // SAFETY: the caller guarantees `addr` is the address of a `PageTable` created by
    // `alloc_page_table` (via `Box::into_raw`) that stays allocated while `guard` is pinned.
    unsafe { &*(addr as *const PageTable) }
}

/// Hands a table that has been unlinked to RCU: its memory is returned once every walker that
/// might still see it has left its critical section (`call_rcu(tdp_mmu_free_sp_rcu_callback)`).
///
/// # Safety
/// `table` must come from `Box::into_raw` of a table from [`alloc_page_table`], must no longer be
/// reachable from any root, and must not be freed twice.
pub unsafe fn free_page_table_rcu(
    stats: &Arc<PageTableStats>,
    table: *const PageTable,
    guard: &Guard,
) {
    let addr = table as usize;
    let stats = Arc::clone(stats);
    // SAFETY: the closure only runs after a grace period, when no pinned walker can still hold a
    // reference obtained before the unlink (caller's contract); it owns the only pointer.
    unsafe {
        guard.defer_unchecked(move || {
            stats.table_released(addr as u64);
            drop(Box::from_raw(addr as *mut PageTable));
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const INVALID: u64 = 1 << 63;

    #[test]
    fn tables_are_page_aligned_nonpresent_and_freed_after_a_grace_period() {
        let stats = Arc::new(PageTableStats::default());
        let t = alloc_page_table(&stats, INVALID);
        assert_eq!(t.addr() & 0xfff, 0);
        assert!(t.spt.iter().all(|e| e.load(Ordering::Relaxed) == INVALID));
        let raw = Box::into_raw(t);
        // SAFETY: raw came from Box::into_raw just above.
        let addr = unsafe { &*raw }.addr();
        // A private collector: its epochs advance only with this test's pins.
        let collector = crossbeam_epoch::Collector::new();
        let walker = collector.register();
        let freer = collector.register();
        let reader = walker.pin();
        // SAFETY: the table is live and is not freed before the grace period below.
        let child = unsafe { table_at(addr, &reader) };
        assert_eq!(child.addr(), raw as u64);
        {
            let guard = freer.pin();
            // SAFETY: unreachable from anything, freed once.
            unsafe { free_page_table_rcu(&stats, raw, &guard) };
            guard.flush();
        }
        for _ in 0..8 {
            freer.pin().flush();
        }
        assert_eq!(
            stats.freed.load(Ordering::Relaxed),
            0,
            "a walker still holds its guard"
        );
        assert_eq!(child.spt[0].load(Ordering::Relaxed), INVALID);
        drop(reader);
        for _ in 0..8 {
            freer.pin().flush();
        }
        assert_eq!(
            stats.freed.load(Ordering::Relaxed),
            1,
            "freed once the walker left"
        );
        assert_eq!(stats.live.load(Ordering::Relaxed), 0);
    }
}
