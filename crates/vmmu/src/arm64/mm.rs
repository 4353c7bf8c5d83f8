//! Stage-2 table pages and their reference counts: KVM/arm64's `kvm_pgtable_mm_ops` for the host
//! (`kvm_host_zalloc_pages_exact`, `kvm_host_get_page`, `kvm_host_put_page`,
//! `kvm_host_page_count`, `stage2_free_unlinked_table`) and the vCPU's memory cache.
//!
//! KVM keeps a table's reference count in its `struct page`: one reference from the allocation,
//! plus one for every entry of the table that is not zero (`stage2_pte_is_counted()`). A table
//! whose count drops to one holds nothing and is freed by the unmap walker; a count that drops
//! to zero frees the page. Here the `struct page` sits right after the table in the same
//! allocation ([`Stage2Page`]), so finding it from an entry's address is the same mask KVM's
//! `virt_to_page()` amounts to.

use crate::hw::page_table::{table_at, PageTable, PageTableStats};
use crate::hw::pgtable::{Level, PtFormat, PTES_PER_TABLE};
use crate::hw::stage2::{kvm_pte_table, Stage2};
use crate::kvm::memory_cache::{CacheObject, MmuMemoryCache};
use crossbeam_epoch::Guard;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

/// One stage-2 table page and its `struct page` reference count. The table comes first, so the
/// address a table entry stores is the table's. (Simplified: the `struct page` lives in the
/// table's allocation, which makes each table 8 KiB of host memory instead of 4 KiB plus a
/// vmemmap entry.)
#[repr(C, align(4096))]
pub struct Stage2Page {
    /// The 512 entries.
    pub table: PageTable,
    /// `page->_refcount`.
    refcount: AtomicU32,
}

/// `kvm_host_zalloc_pages_exact()`: a zeroed table with one reference (the allocation's).
pub fn zalloc_page(stats: &PageTableStats) -> Box<Stage2Page> {
    let page = Box::new(Stage2Page {
        table: PageTable {
            spt: std::array::from_fn(|_| AtomicU64::new(Stage2::INVALID)),
        },
        refcount: AtomicU32::new(1),
    });
    stats.table_allocated(page.table.addr());
    page
}

/// Frees a page nobody else has seen (an unused cache page, a table that lost a link race),
/// or a freed subtree's page past its grace period.
pub fn free_page_now(stats: &PageTableStats, page: Box<Stage2Page>) {
    stats.table_released(page.table.addr());
    drop(page);
}

/// The page holding the entry `ptep` (`virt_to_page(ptep)`).
///
/// # Safety
/// `ptep` must be an entry of a table allocated by [`zalloc_page`] that is still allocated.
#[inline]
unsafe fn page_of(ptep: &AtomicU64) -> &Stage2Page {
    let addr = ptep as *const AtomicU64 as usize & !(std::mem::size_of::<PageTable>() - 1);
    // SAFETY: a Stage2Page is 4096-aligned with its table at offset 0, so masking an entry's
    // address gives the page; the caller guarantees it is live.
    unsafe { &*(addr as *const Stage2Page) }
}

/// `mm_ops->get_page(ptep)`: one more non-zero entry in `ptep`'s table.
///
/// # Safety
/// As `page_of()`: `ptep` must be an entry of a live table from [`zalloc_page`].
#[inline]
pub unsafe fn get_page(ptep: &AtomicU64) {
    // SAFETY: the caller's contract.
    unsafe { page_of(ptep) }
        .refcount
        .fetch_add(1, Ordering::Relaxed);
}

/// `mm_ops->put_page(ptep)` for an entry that became zero: drops one reference of `ptep`'s
/// table. The table's own allocation reference keeps it above zero (a table whose count is
/// one is unlinked and freed with [`free_unlinked_table`]).
///
/// # Safety
/// As `page_of()`: `ptep` must be an entry of a live table from [`zalloc_page`].
#[inline]
pub unsafe fn put_page(ptep: &AtomicU64) {
    // SAFETY: the caller's contract.
    let old = unsafe { page_of(ptep) }
        .refcount
        .fetch_sub(1, Ordering::Relaxed);
    debug_assert!(old > 1, "an entry's reference was the table's last");
}

/// `mm_ops->page_count(childp)` of the table at `addr`.
///
/// # Safety
/// `addr` must be a table entry's address of a live table, read under `guard`.
pub unsafe fn page_count(addr: u64, guard: &Guard) -> u32 {
    // SAFETY: the caller's contract; the table is the first field of its Stage2Page.
    let t = unsafe { table_at(addr, guard) };
    // SAFETY: as above.
    unsafe { page_of(&t.spt[0]) }
        .refcount
        .load(Ordering::Relaxed)
}

/// `stage2_free_unlinked_table()`: a table (and the subtree below it) that a walker unlinked
/// goes back after an RCU grace period, when no walker can still be in it; the subtree is walked
/// then, dropping every table's references, because a shared walker that was inside it may have
/// linked more tables into it meanwhile. KVM frees at once after exclusive walks (the TLBI has
/// completed, no hardware walker holds it); here vCPU walks are threads reading through an
/// epoch guard, so every free waits for the grace period.
///
/// # Safety
/// `addr` must be the address of a table from [`zalloc_page`] at `level` that is no longer
/// reachable from the root, freed once.
pub unsafe fn free_unlinked_table(
    stats: &Arc<PageTableStats>,
    addr: u64,
    level: Level,
    guard: &Guard,
) {
    let stats = Arc::clone(stats);
    // SAFETY: the closure runs after a grace period, when no walker pinned before the unlink can
    // hold a reference; it owns the subtree (caller's contract).
    unsafe {
        guard.defer_unchecked(move || free_subtree(&stats, addr, level));
    }
}

/// Frees the table at `addr` and every table below it.
fn free_subtree(stats: &PageTableStats, addr: u64, level: Level) {
    // SAFETY: the subtree is unreachable and past its grace period (free_unlinked_table's
    // contract), so this is its only user.
    let page = unsafe { Box::from_raw(addr as *mut Stage2Page) };
    if level.0 < Stage2::leaf_level().0 {
        for i in 0..PTES_PER_TABLE {
            let pte = page.table.spt[i].load(Ordering::Relaxed);
            if kvm_pte_table(pte, level) {
                free_subtree(stats, Stage2::table_addr(pte), Stage2::level_below(level));
            }
        }
    }
    free_page_now(stats, page);
}

/// `struct kvm_mmu_memory_cache` of stage-2 table pages (`vcpu->arch.mmu_page_cache`, the
/// split cache), topped up before `mmu_lock` is taken.
pub type Stage2MemCache = MmuMemoryCache<Stage2Page>;

impl CacheObject for Stage2Page {
    fn alloc(stats: &PageTableStats, init_value: u64) -> Box<Self> {
        debug_assert_eq!(init_value, Stage2::INVALID, "stage-2 tables start zeroed");
        zalloc_page(stats)
    }
    fn free(stats: &PageTableStats, obj: Box<Self>) {
        free_page_now(stats, obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_finds_its_tables_refcount() {
        let stats = Arc::new(PageTableStats::default());
        let page = zalloc_page(&stats);
        assert_eq!(std::mem::size_of::<Stage2Page>(), 8192);
        let guard = crossbeam_epoch::pin();
        // SAFETY: the page is live for the whole test.
        unsafe {
            get_page(&page.table.spt[7]);
            get_page(&page.table.spt[511]);
            assert_eq!(page_count(page.table.addr(), &guard), 3);
            put_page(&page.table.spt[0]);
            assert_eq!(page_count(page.table.addr(), &guard), 2);
        }
        free_page_now(&stats, page);
        assert_eq!(stats.live.load(Ordering::Relaxed), 0);
    }
}
