//! A host that runs out of memory: the frames of one shared-memory file (the memfd a VMM maps as
//! guest memory, as max_guest_memory_test does), what the host's page reclaim knows of each, a
//! free-page count with the zone's watermarks, and a swap device.
//!
//! - **Frames.** A frame is resident (its folio holds the page), swapped out (its content is in
//!   the swap device), or never populated. Guest content lives in [`HostMemory`]'s word of the
//!   frame while resident and in the swap slot while swapped out; swap-out poisons the frame, so
//!   a write through a translation that survived the swap-out is lost and the content check at
//!   the end of a run finds it.
//! - **LRU.** Two policies ([`LruPolicy`]): the classic active/inactive lists and the
//!   multi-generational LRU (MGLRU). Both keep lists of frame indexes; reclaim takes folios from
//!   a list's tail and puts them back at a head, as `list_move()` does, so a `VecDeque` holds
//!   each list. The policies' decisions (which list, which generation) are made by kswapd
//!   (`vm::kswapd`), which also reaches KVM; this module only keeps the state and its rules.
//! - **Allocation.** [`HostMm::faultin`] is the host half of a guest fault on a frame that is not
//!   resident (`handle_mm_fault()` → `shmem_fault()` → swap-in, or a zeroed page): it takes a
//!   free page, wakes kswapd below the low watermark (`wakeup_kswapd()`), and fails at the min
//!   watermark, where the faulting task would reclaim directly.
//!
//! Simplifications: one zone and one memory cgroup; the lists are anonymous only (shmem counts
//! as anon); `lru_lock` is a mutex whose contention is not priced; pages are freed as soon as
//! swap-out copies them (zram's synchronous writes).

use crate::host::memory::{zeroed_words, HostMemory};
use crate::host::HostError;
use crate::units::Pfn;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;

/// The host's page-reclaim policy.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LruPolicy {
    /// The active/inactive lists (`shrink_active_list()`, `shrink_inactive_list()`): MGLRU off.
    Classic,
    /// The multi-generational LRU (Linux 6.1+, `CONFIG_LRU_GEN_ENABLED`): generations aged by
    /// walking the VMM's page tables, evicted oldest first with look-around.
    #[default]
    Mglru,
}

impl LruPolicy {
    /// The `--lru` value.
    pub fn name(self) -> &'static str {
        match self {
            LruPolicy::Classic => "classic",
            LruPolicy::Mglru => "mglru",
        }
    }
}

impl std::str::FromStr for LruPolicy {
    type Err = HostError;
    fn from_str(s: &str) -> Result<Self, HostError> {
        match s {
            "classic" => Ok(LruPolicy::Classic),
            "mglru" => Ok(LruPolicy::Mglru),
            _ => Err(HostError::UnknownLruPolicy(s.into())),
        }
    }
}

/// `MAX_NR_GENS`: MGLRU generations that can exist at once.
pub const MAX_NR_GENS: u64 = 4;
/// `MIN_NR_GENS`: with only this many generations left, eviction waits for aging.
pub const MIN_NR_GENS: u64 = 2;
/// Pages under one PMD (the unit of MGLRU's Bloom filter and of look-around).
pub const PTES_PER_PMD: u64 = 512;

/// The zone's watermarks in pages (`zone->_watermark[]`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Watermarks {
    /// `WMARK_MIN`: below it an allocation reclaims directly.
    pub min: u64,
    /// `WMARK_LOW`: an allocation below it wakes kswapd.
    pub low: u64,
    /// `WMARK_HIGH`: kswapd reclaims until free memory reaches it (`balance_pgdat()`).
    pub high: u64,
}

impl Watermarks {
    /// The watermarks Linux gives one zone of `managed` pages when it is all the memory there
    /// is: `calculate_min_free_kbytes()` sets `min_free_kbytes = int_sqrt(lowmem_kbytes * 16)`,
    /// clamped to [128, 262144]; `__setup_per_zone_wmarks()` sets min to that, and low and high
    /// to min plus one and two times `max(min / 4, managed * watermark_scale_factor / 10000)`
    /// with the default `watermark_scale_factor` of 10.
    pub fn for_zone(managed: u64) -> Self {
        let kbytes = managed * 4;
        let min_free_kbytes = ((kbytes * 16) as f64).sqrt() as u64;
        let min = min_free_kbytes.clamp(128, 262_144) / 4;
        let gap = (min / 4).max(managed * 10 / 10_000);
        Watermarks {
            min,
            low: min + gap,
            high: min + 2 * gap,
        }
    }
}

// Per-frame flags (`folio->flags` and the host PTE, as far as reclaim reads them).
/// The frame holds the page.
const RESIDENT: u16 = 1 << 0;
/// The page is in the swap device.
const SWAPPED: u16 = 1 << 1;
/// On an LRU list (not isolated by reclaim, not swapped out).
const ON_LRU: u16 = 1 << 2;
/// `PG_active` (classic LRU).
const ACTIVE: u16 = 1 << 3;
/// `PG_referenced`.
const REFERENCED: u16 = 1 << 4;
/// The VMM's host PTE has its Accessed bit set.
const HOST_YOUNG: u16 = 1 << 5;
/// The MGLRU generation (`seq % MAX_NR_GENS`) in two bits.
const GEN_SHIFT: u32 = 6;
const GEN_MASK: u16 = 3 << GEN_SHIFT;
/// `PG_idle` (page_idle's mark, `CONFIG_IDLE_PAGE_TRACKING`).
const IDLE: u16 = 1 << 8;

/// The value a frame holds after its page was swapped out: a write that lands on it anyway went
/// through a translation the swap-out should have removed.
pub const SWAPPED_OUT_POISON: u64 = 0x5a5a_dead_5a5a_dead;

/// The result of the host half of a fault ([`HostMm::faultin`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Faultin {
    /// The page was resident (or is not reclaimable memory): nothing to do.
    Resident,
    /// The page was read back from swap into a new frame.
    SwappedIn,
    /// A zeroed page was allocated for a first touch.
    Populated,
    /// No free page above the min watermark: the fault is retried once reclaim freed some.
    NoMemory,
}

/// The lists, under `lru_lock`.
#[derive(Debug, Default)]
pub struct Lists {
    /// Classic inactive list; the front is the head (newest).
    pub inactive: VecDeque<u32>,
    /// Classic active list.
    pub active: VecDeque<u32>,
    /// MGLRU lists, indexed by `seq % MAX_NR_GENS`; the front is the head.
    pub gens: [VecDeque<u32>; MAX_NR_GENS as usize],
    /// `lrugen->min_seq`: the oldest generation.
    pub min_seq: u64,
    /// `lrugen->max_seq`: the youngest generation.
    pub max_seq: u64,
    /// MGLRU's Bloom filter of PMDs worth walking (`update_bloom_filter()`), one bit per PMD,
    /// for the current walk; `None` until the first walk, which scans every PMD. An exact set
    /// rather than a Bloom filter: no false positives (a simplification).
    pub walk_filter: Option<Vec<u64>>,
    /// The filter the current walk fills for the next one.
    pub next_filter: Vec<u64>,
}

impl Lists {
    /// Generations that exist (`max_seq - min_seq + 1`).
    pub fn nr_gens(&self) -> u64 {
        self.max_seq - self.min_seq + 1
    }
}

/// Counters of host memory activity (`/proc/vmstat` names where there are some).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct VmStat {
    /// `pswpout`: pages swapped out.
    pub pswpout: u64,
    /// `pswpin`: pages swapped in.
    pub pswpin: u64,
    /// `pgscan_kswapd`: folios reclaim isolated and checked.
    pub pgscan: u64,
    /// `pgsteal_kswapd`: folios reclaimed.
    pub pgsteal: u64,
    /// `pgactivate`: folios (re)activated or promoted because they were young.
    pub pgactivate: u64,
    /// `pgdeactivate`: folios moved from the active to the inactive list.
    pub pgdeactivate: u64,
    /// `kswapd_wakeups` (`pageoutrun`-like): times kswapd was woken.
    pub kswapd_wakeups: u64,
    /// `allocstall`: allocations that found memory at the min watermark.
    pub allocstall: u64,
    /// MGLRU generations created by aging (`inc_max_seq()`).
    pub mglru_aging: u64,
    /// Pages first populated (zeroed) by a fault.
    pub pgpopulated: u64,
}

/// The host memory behind one memfd and its reclaim state (see the module documentation).
pub struct HostMm {
    /// The memfd's first frame.
    pub base: Pfn,
    /// Frames in the memfd.
    pub npages: u64,
    /// The policy.
    pub policy: LruPolicy,
    /// The zone's watermarks.
    pub watermarks: Watermarks,
    /// Pages of host memory in all.
    pub total_pages: u64,
    flags: Box<[AtomicU16]>,
    swap: Box<[AtomicU64]>,
    free: AtomicU64,
    /// `lru_lock`, and the counters changed under it.
    lists: Mutex<(Lists, VmStat)>,
    /// `pgdat->kswapd_wait`: an allocation found free memory below the low watermark.
    kswapd_wake: Arc<AtomicBool>,
}

impl HostMm {
    /// A host of `total_pages` pages behind the memfd of `npages` frames from `base`, nothing
    /// populated yet. Errors when the host cannot reserve the swap device's bookkeeping.
    pub fn new(
        base: Pfn,
        npages: u64,
        total_pages: u64,
        policy: LruPolicy,
    ) -> Result<Self, HostError> {
        let lists = Lists {
            // lru_gen_init_lruvec(): a fresh lruvec has min_seq 0 and max_seq MIN_NR_GENS + 1.
            min_seq: 0,
            max_seq: MIN_NR_GENS + 1,
            next_filter: vec![0; npages.div_ceil(PTES_PER_PMD).div_ceil(64) as usize],
            ..Default::default()
        };
        Ok(HostMm {
            base,
            npages,
            policy,
            watermarks: Watermarks::for_zone(total_pages),
            total_pages,
            flags: (0..npages).map(|_| AtomicU16::new(0)).collect(),
            swap: zeroed_words(npages)?,
            free: AtomicU64::new(total_pages),
            lists: Mutex::new((lists, VmStat::default())),
            kswapd_wake: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The memfd's frame index of `pfn`, or `None` for memory reclaim does not manage.
    #[inline]
    pub fn index(&self, pfn: Pfn) -> Option<u32> {
        let i = pfn.0.wrapping_sub(self.base.0);
        (i < self.npages).then_some(i as u32)
    }

    /// The frame of index `i`.
    pub fn pfn(&self, i: u32) -> Pfn {
        self.base + i as u64
    }

    /// Free pages now.
    pub fn free_pages(&self) -> u64 {
        self.free.load(Ordering::Relaxed)
    }

    /// Whether frame `i` holds its page.
    #[inline]
    pub fn resident(&self, i: u32) -> bool {
        self.flags[i as usize].load(Ordering::Acquire) & RESIDENT != 0
    }

    /// Whether frame `i`'s page is in the swap device.
    pub fn swapped(&self, i: u32) -> bool {
        self.flags[i as usize].load(Ordering::Acquire) & SWAPPED != 0
    }

    /// The guest content of frame `i`: the frame's word while resident, the swap slot's while
    /// swapped out (what a read after swap-in would see).
    pub fn content(&self, i: u32, host: &HostMemory) -> u64 {
        if self.swapped(i) {
            self.swap[i as usize].load(Ordering::Acquire)
        } else {
            host.read(self.pfn(i))
        }
    }

    /// Takes the kswapd wake-up: true once after an allocation went below the low watermark.
    pub fn take_kswapd_wake(&self) -> bool {
        self.kswapd_wake.swap(false, Ordering::AcqRel)
    }

    /// The flag an allocation raises to wake kswapd (`pgdat->kswapd_wait`).
    pub fn kswapd_wake_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.kswapd_wake)
    }

    /// Whether an allocation woke kswapd and it has not noticed yet.
    pub fn kswapd_woken(&self) -> bool {
        self.kswapd_wake.load(Ordering::Acquire)
    }

    /// Whether free memory is below the high watermark (kswapd has work:
    /// `pgdat_balanced()` is false).
    pub fn needs_reclaim(&self) -> bool {
        self.free_pages() < self.watermarks.high
    }

    /// The host half of a fault on frame `pfn`: a resident page needs nothing (a host access,
    /// `host_access`, such as the VMM's prefault, sets its PTE's Accessed bit; KVM's
    /// `get_user_pages()` does not); otherwise a free page is taken (failing at the min
    /// watermark), filled from swap or zeroed, mapped young, and added to the LRU where a new folio goes
    /// (the classic inactive list; MGLRU's youngest generation). Wakes kswapd below the low
    /// watermark. The caller counts the swap-in or population on its meter.
    pub fn faultin(&self, pfn: Pfn, host: &HostMemory, host_access: bool) -> Faultin {
        let Some(i) = self.index(pfn) else {
            return Faultin::Resident;
        };
        if self.resident(i) {
            if host_access {
                self.flags[i as usize].fetch_or(HOST_YOUNG, Ordering::Relaxed);
            }
            return Faultin::Resident;
        }
        let mut g = self.lists.lock();
        let (lists, stat) = &mut *g;
        let f = &self.flags[i as usize];
        let old = f.load(Ordering::Acquire);
        if old & RESIDENT != 0 {
            return Faultin::Resident;
        }
        // __alloc_pages(): the fast path takes a page above the low watermark; below it
        // kswapd is woken, and the slow path still succeeds above min. Reclaim frees pages
        // without lru_lock (free_page()), so the count is taken with a compare-and-swap.
        let mut free = self.free.load(Ordering::Relaxed);
        loop {
            if free <= self.watermarks.low {
                self.kswapd_wake.store(true, Ordering::Release);
            }
            if free <= self.watermarks.min {
                stat.allocstall += 1;
                return Faultin::NoMemory;
            }
            match self.free.compare_exchange_weak(
                free,
                free - 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => free = now,
            }
        }
        let swapped = old & SWAPPED != 0;
        let word = host.word(pfn);
        if swapped {
            word.store(
                self.swap[i as usize].load(Ordering::Acquire),
                Ordering::Release,
            );
            stat.pswpin += 1;
        } else {
            word.store(0, Ordering::Release);
            stat.pgpopulated += 1;
        }
        // The PTE the fault installs is young (x86's vm_page_prot has _PAGE_ACCESSED).
        let mut new = RESIDENT | ON_LRU | HOST_YOUNG;
        match self.policy {
            LruPolicy::Classic => lists.inactive.push_front(i),
            // lru_gen_add_folio(): a folio added during a fault (lru_gen_in_fault(), which
            // folio_add_lru() treats as active) joins the youngest generation.
            LruPolicy::Mglru => {
                let seq = lists.max_seq;
                new |= gen_bits(seq);
                lists.gens[(seq % MAX_NR_GENS) as usize].push_front(i);
            }
        }
        f.store(new, Ordering::Release);
        if swapped {
            Faultin::SwappedIn
        } else {
            Faultin::Populated
        }
    }

    /// Runs `f` on the lists and counters under `lru_lock`.
    pub fn with_lists<R>(&self, f: impl FnOnce(&mut Lists, &mut VmStat) -> R) -> R {
        let mut g = self.lists.lock();
        let (l, s) = &mut *g;
        f(l, s)
    }

    /// The counters so far.
    pub fn vmstat(&self) -> VmStat {
        self.lists.lock().1.clone()
    }

    /// Frame `i`'s flags.
    #[inline]
    fn flags(&self, i: u32) -> u16 {
        self.flags[i as usize].load(Ordering::Acquire)
    }

    /// Whether reclaim may take frame `i` off a list now: on an LRU list and resident.
    pub fn on_lru(&self, i: u32) -> bool {
        self.flags(i) & ON_LRU != 0
    }

    /// `PG_active`.
    pub fn active(&self, i: u32) -> bool {
        self.flags(i) & ACTIVE != 0
    }

    /// The MGLRU generation index (`seq % MAX_NR_GENS`) frame `i` belongs to.
    pub fn gen(&self, i: u32) -> u64 {
        ((self.flags(i) & GEN_MASK) >> GEN_SHIFT) as u64
    }

    /// `folio_update_gen()`: moves frame `i` to generation `seq` without moving it between
    /// lists (eviction sorts it later). Returns whether it changed.
    pub fn update_gen(&self, i: u32, seq: u64) -> bool {
        let f = &self.flags[i as usize];
        let old = f.load(Ordering::Acquire);
        if old & ON_LRU == 0 || old & GEN_MASK == gen_bits(seq) {
            return false;
        }
        f.store((old & !GEN_MASK) | gen_bits(seq), Ordering::Release);
        true
    }

    /// `ptep_test_and_clear_young()` on the VMM's PTE of frame `i`: whether it was young.
    pub fn test_and_clear_host_young(&self, i: u32) -> bool {
        self.flags[i as usize].fetch_and(!HOST_YOUNG, Ordering::AcqRel) & HOST_YOUNG != 0
    }

    /// Whether the VMM's PTE of frame `i` is young, without clearing it.
    pub fn host_young(&self, i: u32) -> bool {
        self.flags(i) & HOST_YOUNG != 0
    }

    /// Isolates frame `i` from its list (reclaim now owns it: `folio_isolate_lru()`); the
    /// caller has taken it off the list.
    pub fn isolate(&self, i: u32) {
        self.flags[i as usize].fetch_and(!ON_LRU, Ordering::AcqRel);
    }

    /// `folio_test_idle()`.
    pub fn idle(&self, i: u32) -> bool {
        self.flags(i) & IDLE != 0
    }

    /// `folio_set_idle()` (`set` true) or `folio_clear_idle()`.
    pub fn set_idle(&self, i: u32, set: bool) {
        if set {
            self.flags[i as usize].fetch_or(IDLE, Ordering::AcqRel);
        } else {
            self.flags[i as usize].fetch_and(!IDLE, Ordering::AcqRel);
        }
    }

    /// `test_and_clear(PG_referenced)`.
    pub fn test_and_clear_referenced(&self, i: u32) -> bool {
        self.flags[i as usize].fetch_and(!REFERENCED, Ordering::AcqRel) & REFERENCED != 0
    }

    /// `folio_set_referenced()`.
    pub fn set_referenced(&self, i: u32) {
        self.flags[i as usize].fetch_or(REFERENCED, Ordering::AcqRel);
    }

    /// Puts isolated frame `i` back on a list under `lru_lock` (`move_folios_to_lru()`): the
    /// classic active or inactive head (`active`), or the head of MGLRU generation `seq`.
    pub fn putback(&self, lists: &mut Lists, i: u32, active: bool, seq: Option<u64>) {
        let f = &self.flags[i as usize];
        let mut v = f.load(Ordering::Acquire) | ON_LRU;
        match seq {
            Some(seq) => {
                v = (v & !GEN_MASK) | gen_bits(seq);
                lists.gens[(seq % MAX_NR_GENS) as usize].push_front(i);
            }
            None if active => {
                v |= ACTIVE;
                lists.active.push_front(i);
            }
            None => {
                v &= !ACTIVE;
                lists.inactive.push_front(i);
            }
        }
        f.store(v, Ordering::Release);
    }

    /// The host PTE of isolated frame `i` replaced by a swap entry (`try_to_unmap_one()` on an
    /// anonymous or shmem folio being swapped out): its content moves to the swap device and
    /// the frame is poisoned. The caller has removed KVM's translations (the MMU notifier's
    /// invalidation brackets this). The page is freed by [`HostMm::free_page`] once written.
    pub fn unmap_to_swap(&self, i: u32, host: &HostMemory) {
        let word = host.word(self.pfn(i));
        self.swap[i as usize].store(
            word.swap(SWAPPED_OUT_POISON, Ordering::AcqRel),
            Ordering::Release,
        );
        self.flags[i as usize].store(SWAPPED, Ordering::Release);
        self.lists.lock().1.pswpout += 1;
    }

    /// A reclaimed page returns to the free pages (after `pageout()`).
    pub fn free_page(&self) {
        self.free.fetch_add(1, Ordering::Relaxed);
    }
}

/// The flag bits of MGLRU generation `seq`.
fn gen_bits(seq: u64) -> u16 {
    ((seq % MAX_NR_GENS) as u16) << GEN_SHIFT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_follow_the_kernel_formulas() {
        // 6 GiB: min_free_kbytes = sqrt(6 GiB in KiB * 16) = 10,033 KiB, 2,508 pages; the gap
        // is 0.1 % of the zone (1,572 pages), larger than min / 4.
        let w = Watermarks::for_zone(6 << 18);
        assert_eq!(w.min, 10_033 / 4);
        assert_eq!(w.low, w.min + (6u64 << 18) / 1000);
        assert_eq!(w.high, w.min + 2 * ((6u64 << 18) / 1000));
        // A tiny zone clamps min_free_kbytes to 128 KiB.
        assert_eq!(Watermarks::for_zone(256).min, 32);
    }

    #[test]
    fn a_swapped_out_page_comes_back_with_its_content_and_joins_the_lru() {
        let host = HostMemory::default();
        let base = host.alloc_region(8).unwrap();
        let mm = HostMm::new(base, 8, 100_000, LruPolicy::Mglru).unwrap();
        assert_eq!(mm.faultin(base, &host, true), Faultin::Populated);
        host.write(base, 42);
        mm.with_lists(|l, _| {
            // A fault's folio joins the youngest generation.
            let i = l.gens[(l.max_seq % MAX_NR_GENS) as usize]
                .pop_back()
                .unwrap();
            assert_eq!(i, 0);
        });
        mm.isolate(0);
        let free = mm.free_pages();
        mm.unmap_to_swap(0, &host);
        mm.free_page();
        assert_eq!(mm.free_pages(), free + 1);
        assert_eq!(host.read(base), SWAPPED_OUT_POISON);
        assert_eq!(mm.content(0, &host), 42);
        assert_eq!(mm.faultin(base, &host, false), Faultin::SwappedIn);
        assert_eq!(host.read(base), 42);
        assert!(mm.on_lru(0) && mm.resident(0));
        let s = mm.vmstat();
        assert_eq!((s.pswpout, s.pswpin, s.pgpopulated), (1, 1, 1));
    }

    #[test]
    fn allocation_wakes_kswapd_at_low_and_fails_at_min() {
        let host = HostMemory::default();
        let base = host.alloc_region(4096).unwrap();
        let mm = HostMm::new(base, 4096, 300, LruPolicy::Classic).unwrap();
        let w = mm.watermarks;
        let mut i = 0;
        while mm.free_pages() > w.low {
            assert_eq!(mm.faultin(base + i, &host, false), Faultin::Populated);
            assert!(!mm.kswapd_woken());
            i += 1;
        }
        while mm.free_pages() > w.min {
            mm.faultin(base + i, &host, false);
            i += 1;
        }
        assert!(mm.take_kswapd_wake());
        assert_eq!(mm.faultin(base + i, &host, false), Faultin::NoMemory);
        assert_eq!(mm.vmstat().allocstall, 1);
        // Memory that reclaim does not manage is always there.
        assert_eq!(
            mm.faultin(base + 1_000_000, &host, false),
            Faultin::Resident
        );
    }
}
