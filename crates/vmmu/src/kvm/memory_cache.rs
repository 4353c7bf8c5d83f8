//! `kvm_mmu_memory_cache`: page tables allocated *before* `mmu_lock` is taken, so that code
//! under the lock never allocates (it cannot sleep there in the kernel).

use crate::hw::page_table::{
    alloc_page_table, free_unlinked_page_table, PageTable, PageTableStats,
};

/// `KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE`: the default capacity.
pub const KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE: usize = 40;

/// What a cache holds: a page-table page as its architecture allocates it (x86 a bare
/// [`PageTable`]; arm64 a table with its `struct page` reference count).
pub trait CacheObject: Sized {
    /// A new page with every entry `init_value`, counted in `stats`.
    fn alloc(stats: &PageTableStats, init_value: u64) -> Box<Self>;
    /// Frees a page nobody has seen, counted in `stats`.
    fn free(stats: &PageTableStats, obj: Box<Self>);
}

impl CacheObject for PageTable {
    fn alloc(stats: &PageTableStats, init_value: u64) -> Box<Self> {
        alloc_page_table(stats, init_value)
    }
    fn free(stats: &PageTableStats, obj: Box<Self>) {
        free_unlinked_page_table(stats, obj)
    }
}

/// A cache of pre-allocated page tables.
pub struct MmuMemoryCache<T: CacheObject = PageTable> {
    objs: Vec<Box<T>>,
    capacity: usize,
    /// The value every entry of a new table holds (`init_value`: the format's invalid entry).
    init_value: u64,
    /// Allocations that found the cache empty (KVM WARNs and falls back to an atomic
    /// allocation; here it is counted so a test can assert it never happens).
    pub empty_allocs: u64,
}

impl<T: CacheObject> MmuMemoryCache<T> {
    /// An empty cache holding at most `capacity` tables whose entries start as `init_value`.
    pub fn new(capacity: usize, init_value: u64) -> Self {
        MmuMemoryCache {
            objs: Vec::with_capacity(capacity),
            capacity,
            init_value,
            empty_allocs: 0,
        }
    }

    /// Tables in the cache.
    pub fn nr_objs(&self) -> usize {
        self.objs.len()
    }

    /// `kvm_mmu_topup_memory_cache()`: returns at once if at least `min` tables are cached,
    /// otherwise fills to capacity. Returns the number of tables allocated.
    pub fn topup(&mut self, min: usize, stats: &PageTableStats) -> usize {
        if self.objs.len() >= min {
            return 0;
        }
        let n = self.capacity.max(min) - self.objs.len();
        for _ in 0..n {
            self.objs.push(T::alloc(stats, self.init_value));
        }
        n
    }

    /// `kvm_mmu_memory_cache_alloc()`: takes a table; an empty cache is a bug in the caller's
    /// top-up, counted in `empty_allocs` and served by a direct allocation.
    pub fn alloc(&mut self, stats: &PageTableStats) -> Box<T> {
        match self.objs.pop() {
            Some(t) => t,
            None => {
                self.empty_allocs += 1;
                T::alloc(stats, self.init_value)
            }
        }
    }

    /// A table, or `None` when the cache is empty (where KVM's walker returns `-ENOMEM`
    /// instead of allocating under the lock, as arm64's map walker does).
    pub fn try_alloc(&mut self) -> Option<Box<T>> {
        self.objs.pop()
    }

    /// Returns an unused table to the cache (or frees it when the cache is full).
    pub fn give_back(&mut self, t: Box<T>, stats: &PageTableStats) {
        if self.objs.len() < self.capacity {
            self.objs.push(t);
        } else {
            T::free(stats, t);
        }
    }

    /// `kvm_mmu_free_memory_cache()`.
    pub fn free_all(&mut self, stats: &PageTableStats) {
        for t in self.objs.drain(..) {
            T::free(stats, t);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topup_fills_to_capacity_only_below_min() {
        let stats = PageTableStats::default();
        let mut c: MmuMemoryCache = MmuMemoryCache::new(KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE, 0);
        assert_eq!(c.topup(5, &stats), 40);
        for _ in 0..35 {
            let _ = c.alloc(&stats);
        }
        assert_eq!(c.topup(5, &stats), 0, "5 left: at min, nothing to do");
        let _ = c.alloc(&stats);
        assert_eq!(c.topup(5, &stats), 36);
        c.free_all(&stats);
        assert_eq!(c.nr_objs(), 0);
        let _ = c.alloc(&stats);
        assert_eq!(c.empty_allocs, 1);
    }
}
