//! Host memory behind guest memory. Each memslot gets a region; a host frame number encodes the
//! region in its high bits so that translating a PFN to memory is two array indexes.
//!
//! A region stores either one 8-byte word per 4 KiB page or the whole page (512 words). One word
//! is what the memstress guest writes (the first 8 bytes of the page), which is all the dirty-log
//! and migration oracles need to compare content, and it keeps large guests cheap. Memory that
//! holds guest page tables needs every entry of the page, so such a region stores full pages.

use crate::host::anon::{AnonPtes, HostPmd, HostPte, PAGES_PER_PMD};
use crate::host::HostError;
use crate::units::{Pfn, PAGE_SIZE};
use std::alloc::Layout;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::OnceLock;

/// Parses `MemAvailable` (in bytes) out of the text of `/proc/meminfo`.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The host's `MemAvailable`, when `/proc/meminfo` can be read.
pub fn mem_available_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .as_deref()
        .and_then(parse_mem_available)
}

/// Bits of a PFN that index a page inside its region (16 TiB per region).
pub const REGION_PFN_BITS: u32 = 32;
/// How many regions the host can hold (the PFN field has 40 bits); the first two are the zero
/// page's and the huge zero folio's (arm64 stage-2 entries hold 36 bits of PFN, so only the
/// first 16 regions can be mapped there).
pub const MAX_REGIONS: usize = 256;
/// The host's shared zero page (`ZERO_PAGE(0)`, `my_zero_pfn()`): the one page every read of
/// untouched private anonymous memory maps, the only page of region 0.
pub const ZERO_PFN: Pfn = Pfn(0);
/// The first page of the host's huge zero folio (`huge_zero_folio`), which a read of untouched
/// memory backed by transparent huge pages maps: the 512 pages of region 1.
pub const HUGE_ZERO_PFN: Pfn = Pfn(1 << REGION_PFN_BITS);
/// The first region a memslot's memory may take.
const FIRST_MEMORY_REGION: usize = 2;
/// The 8-byte words in a full 4 KiB page.
pub const WORDS_PER_FULL_PAGE: u64 = PAGE_SIZE / 8;

/// One region: `pages << shift` words, where `shift` is log2 of the words kept per page.
struct Region {
    words: Box<[AtomicU64]>,
    shift: u32,
    /// The host page table over private anonymous memory, where the host models it
    /// ([`HostMemory::alloc_anon_region`]); `None` where every page is mapped from the start.
    ptes: Option<AnonPtes>,
    /// The NUMA node of each page, plus one (0: not placed yet), from its first touch
    /// ([`HostMemory::place_first_touch`]); allocated when the first page is placed.
    homes: OnceLock<Box<[AtomicU8]>>,
}

impl Region {
    /// Word `index` (already within the words kept per page) of page `pfn` of this region.
    #[inline]
    fn word(&self, pfn: Pfn, index: u64) -> &AtomicU64 {
        let page = pfn.0 & ((1 << REGION_PFN_BITS) - 1);
        &self.words[((page << self.shift) | index) as usize]
    }
}

/// Host memory: regions of page words, allocated lazily (zeroed pages cost no RSS until written).
pub struct HostMemory {
    regions: Box<[OnceLock<Region>]>,
    next: std::sync::Mutex<usize>,
}

impl Default for HostMemory {
    fn default() -> Self {
        let regions: Box<[OnceLock<Region>]> = (0..MAX_REGIONS).map(|_| OnceLock::new()).collect();
        // The zero page keeps all its words, so an access to any word of it reads zero.
        let zero = Region {
            words: (0..WORDS_PER_FULL_PAGE)
                .map(|_| AtomicU64::new(0))
                .collect(),
            shift: WORDS_PER_FULL_PAGE.trailing_zeros(),
            ptes: None,
            homes: OnceLock::new(),
        };
        let _ = regions[0].set(zero);
        let huge_zero = Region {
            words: (0..PAGES_PER_PMD).map(|_| AtomicU64::new(0)).collect(),
            shift: 0,
            ptes: None,
            homes: OnceLock::new(),
        };
        let _ = regions[1].set(huge_zero);
        HostMemory {
            regions,
            next: std::sync::Mutex::new(FIRST_MEMORY_REGION),
        }
    }
}

/// A zeroed slice of `len` words, or an error when the host cannot reserve it. Goes through the
/// allocator directly rather than `Box::new_zeroed_slice()` because that aborts the process on
/// failure, and a slot too large for the host is a user error, not a crash.
pub(crate) fn zeroed_words(len: u64) -> Result<Box<[AtomicU64]>, HostError> {
    zeroed_slice(len)
}

/// Atomic integers, for which an all-zero bit pattern is a valid value (zero).
trait ZeroIsValid {}
impl ZeroIsValid for AtomicU64 {}
impl ZeroIsValid for AtomicU8 {}

/// A zeroed slice of `len` atomics (see [`zeroed_words`]).
fn zeroed_slice<T: ZeroIsValid>(len: u64) -> Result<Box<[T]>, HostError> {
    let too_large = || HostError::CannotReserve {
        bytes: len.saturating_mul(std::mem::size_of::<T>() as u64),
    };
    let len = usize::try_from(len).map_err(|_| too_large())?;
    if len == 0 {
        return Ok(Box::new([]));
    }
    let layout = Layout::array::<T>(len).map_err(|_| too_large())?;
    // SAFETY: `layout` has a non-zero size (len > 0 and both atomics have a non-zero size).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut T;
    if ptr.is_null() {
        return Err(too_large());
    }
    // SAFETY: `ptr` is a live allocation from the global allocator with the layout of
    // `[T; len]`, which is what `Box<[T]>` frees it with; it is zeroed, and an all-zero bit
    // pattern is a valid `T` (`ZeroIsValid`: atomic integers, zero); nothing else owns it.
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) })
}

impl HostMemory {
    /// Allocates a region of `pages` 4 KiB pages that keeps one word per page, and returns the
    /// PFN of its first page (see [`HostMemory::alloc_region_words`]).
    pub fn alloc_region(&self, pages: u64) -> Result<Pfn, HostError> {
        self.alloc_region_words(pages, 1)
    }

    /// Allocates a region of `pages` 4 KiB pages keeping `words_per_page` words of each (1, or
    /// [`WORDS_PER_FULL_PAGE`] for the whole page), and returns the PFN of its first page, which
    /// is aligned to every page size (so huge mappings depend only on the guest side's alignment).
    pub fn alloc_region_words(&self, pages: u64, words_per_page: u64) -> Result<Pfn, HostError> {
        self.alloc(pages, words_per_page, None)
    }

    /// [`HostMemory::alloc_region_words`] for private anonymous memory whose host page table
    /// the host models, in transparent huge pages where `thp`: every page starts untouched,
    /// and [`HostMemory::host_pte`] and [`HostMemory::host_pmd`] say what it maps.
    pub fn alloc_anon_region(
        &self,
        pages: u64,
        words_per_page: u64,
        thp: bool,
    ) -> Result<Pfn, HostError> {
        self.alloc(pages, words_per_page, Some(thp))
    }

    fn alloc(&self, pages: u64, words_per_page: u64, anon: Option<bool>) -> Result<Pfn, HostError> {
        let shift = match words_per_page {
            1 => 0,
            WORDS_PER_FULL_PAGE => WORDS_PER_FULL_PAGE.trailing_zeros(),
            _ => {
                return Err(HostError::WordsPerPage {
                    full: WORDS_PER_FULL_PAGE,
                    asked: words_per_page,
                })
            }
        };
        if pages >= 1 << REGION_PFN_BITS {
            return Err(HostError::RegionTooLarge {
                pages,
                max: 1 << REGION_PFN_BITS,
            });
        }
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        if *next >= MAX_REGIONS {
            return Err(HostError::NoRegionLeft {
                max: MAX_REGIONS - 1,
            });
        }
        let idx = *next;
        // `pages < 2^32` and `shift <= 9`, so this cannot overflow; the allocator decides whether
        // the host can reserve that much. The allocation is zeroed and lazy: pages cost no RSS
        // until the guest writes them.
        let words = zeroed_words(pages << shift)?;
        let ptes = match anon {
            Some(thp) => Some(AnonPtes::new(pages, thp)?),
            None => None,
        };
        // `next` is taken under its lock and only grows: each region is set once.
        assert!(
            self.regions[idx]
                .set(Region {
                    words,
                    shift,
                    ptes,
                    homes: OnceLock::new()
                })
                .is_ok(),
            "host memory region allocated twice"
        );
        *next += 1;
        Ok(Pfn((idx as u64) << REGION_PFN_BITS))
    }

    /// The region holding `pfn`. Panics on a PFN no region holds: the MMU only installs PFNs it
    /// got from a memslot, so that would be an MMU bug.
    #[inline]
    fn region(&self, pfn: Pfn) -> &Region {
        self.regions[(pfn.0 >> REGION_PFN_BITS) as usize]
            .get()
            .expect("PFN in an allocated region")
    }

    /// First-touch NUMA placement: the host allocates a page on the node of the CPU whose
    /// fault first needs it (the default memory policy's `numa_node_id()` in
    /// `alloc_pages_vma()`; `dequeue_hugetlb_folio_vma()` takes a pool page from that node
    /// first), so the host page of `pages` 4 KiB pages from `first` lives on `socket` unless
    /// an earlier fault placed it. Simplified: the node always has a free page, and a page
    /// swapped out and read back in keeps its node.
    pub fn place_first_touch(&self, first: Pfn, pages: u64, socket: u32) {
        let r = self.region(first);
        let homes = r.homes.get_or_init(|| {
            let pages = r.words.len() as u64 >> r.shift;
            zeroed_slice(pages).unwrap_or_else(|e| panic!("the NUMA map of a region: {e}"))
        });
        let at = (first.0 & ((1 << REGION_PFN_BITS) - 1)) as usize;
        // A huge page may run past the region's end (a slot not a whole number of them).
        let end = (at + pages as usize).min(homes.len());
        let Some(span) = homes.get(at..end).filter(|s| !s.is_empty()) else {
            return;
        };
        if span[0].load(Ordering::Relaxed) != 0 {
            return;
        }
        let home = (socket.min(u8::MAX as u32 - 1) + 1) as u8;
        for h in span {
            h.store(home, Ordering::Relaxed);
        }
    }

    /// The socket whose memory holds `pfn`'s page, if a fault placed it
    /// ([`HostMemory::place_first_touch`]).
    #[inline]
    pub fn home(&self, pfn: Pfn) -> Option<u32> {
        let r = self.regions[(pfn.0 >> REGION_PFN_BITS) as usize].get()?;
        let at = (pfn.0 & ((1 << REGION_PFN_BITS) - 1)) as usize;
        match r.homes.get()?.get(at)?.load(Ordering::Relaxed) {
            0 => None,
            h => Some(h as u32 - 1),
        }
    }

    /// What the host page table maps at `pfn`'s page, where the host models it (a region from
    /// [`HostMemory::alloc_anon_region`]); `None` where the page is always mapped. Under a
    /// PMD that is not split, the PMD's answer: untouched, the (huge) zero page, or its own.
    #[inline]
    pub fn host_pte(&self, pfn: Pfn) -> Option<HostPte> {
        let ptes = self.region(pfn).ptes.as_ref()?;
        let page = pfn.0 & ((1 << REGION_PFN_BITS) - 1);
        Some(match ptes.pmd(page) {
            None | Some(HostPmd::Split) => ptes.get(page),
            Some(HostPmd::None) => HostPte::None,
            Some(HostPmd::HugeZero) => HostPte::Zero,
            Some(HostPmd::Huge) => HostPte::Private,
        })
    }

    /// The PMD over `pfn`'s page, where the region is backed by transparent huge pages whose
    /// host page table the host models.
    #[inline]
    pub fn host_pmd(&self, pfn: Pfn) -> Option<HostPmd> {
        self.region(pfn)
            .ptes
            .as_ref()?
            .pmd(pfn.0 & ((1 << REGION_PFN_BITS) - 1))
    }

    /// Changes the PMD over `pfn`'s page (see [`AnonPtes::change_pmd`]). Panics where the
    /// region has no modelled PMDs: callers ask [`HostMemory::host_pmd`] first.
    pub fn change_host_pmd(&self, pfn: Pfn, from: HostPmd, to: HostPmd) -> Result<(), HostPmd> {
        self.region(pfn)
            .ptes
            .as_ref()
            .expect("a host PMD change on a page the host always maps")
            .change_pmd(pfn.0 & ((1 << REGION_PFN_BITS) - 1), from, to)
    }

    /// Whether `pfn` is the zero page or a page of the huge zero folio.
    #[inline]
    pub fn is_zero_pfn(pfn: Pfn) -> bool {
        pfn == ZERO_PFN || pfn.0 >> REGION_PFN_BITS == HUGE_ZERO_PFN.0 >> REGION_PFN_BITS
    }

    /// Changes the host PTE of `pfn`'s page from `from` to `to` (the fault handler's update
    /// under the PTE lock); `Err` with what it maps when another fault changed it first. Panics
    /// on a page whose host page table is not modelled: callers ask [`HostMemory::host_pte`]
    /// first.
    pub fn change_host_pte(&self, pfn: Pfn, from: HostPte, to: HostPte) -> Result<(), HostPte> {
        self.region(pfn)
            .ptes
            .as_ref()
            .expect("a host PTE change on a page the host always maps")
            .change(pfn.0 & ((1 << REGION_PFN_BITS) - 1), from, to)
    }

    /// A write by the host itself (the VMM, or KVM through the user mapping) to `pfn`'s page:
    /// where the host page table is modelled, the page becomes the page's own (populated, or
    /// copied from the zero page). Simplified: the copy of a zero page done this way tells no
    /// MMU notifier, which is right only while nothing maps the zero page there; the model's
    /// host writes are to pages the guest has not read before (the guest page tables a VMM
    /// builds, and KVM's updates of the gPTEs the guest wrote).
    pub fn host_write(&self, pfn: Pfn) {
        let Some(ptes) = self.region(pfn).ptes.as_ref() else {
            return;
        };
        let page = pfn.0 & ((1 << REGION_PFN_BITS) - 1);
        // A huge page: allocated (over the huge zero folio too, simplified: not split).
        while let Some(now @ (HostPmd::None | HostPmd::HugeZero)) = ptes.pmd(page) {
            let _ = ptes.change_pmd(page, now, HostPmd::Huge);
        }
        if matches!(ptes.pmd(page), None | Some(HostPmd::Split)) {
            while let now @ (HostPte::None | HostPte::Zero) = ptes.get(page) {
                let _ = ptes.change(page, now, HostPte::Private);
            }
        }
    }

    /// The first word of the zero page that is not zero, if any: something wrote through a
    /// mapping of it, which the host maps read-only everywhere (the oracles check this).
    pub fn zero_page_written(&self) -> Option<(u64, u64)> {
        let huge = (0..PAGES_PER_PMD).map(|p| HUGE_ZERO_PFN + p);
        (0..WORDS_PER_FULL_PAGE)
            .map(|i| self.page_word(ZERO_PFN, i))
            .chain(huge.map(|pfn| self.page_word(pfn, 0)))
            .enumerate()
            .map(|(i, w)| (i as u64, w.load(Ordering::Relaxed)))
            .find(|&(_, v)| v != 0)
    }

    /// How many words of each page the region holding `pfn` keeps (1 or
    /// [`WORDS_PER_FULL_PAGE`]).
    pub fn words_per_page(&self, pfn: Pfn) -> u64 {
        1 << self.region(pfn).shift
    }

    /// Word `index` of page `pfn` (the bytes `[8 * index, 8 * index + 8)` of the page). Panics on
    /// a PFN no region holds or an `index` the region does not keep: callers check
    /// [`HostMemory::words_per_page`] first, so either is a bug.
    #[inline]
    pub fn page_word(&self, pfn: Pfn, index: u64) -> &AtomicU64 {
        let region = self.region(pfn);
        assert!(
            index < 1 << region.shift,
            "word {index} of {pfn:?}: its region keeps {} words per page",
            1u64 << region.shift
        );
        region.word(pfn, index)
    }

    /// The word a guest access to word `index` of page `pfn` reaches: that word in a region
    /// keeping whole pages; in a region keeping one word per page, that one word, which stands
    /// for the whole page's content (the workloads compare pages by it).
    #[inline]
    pub fn access_word(&self, pfn: Pfn, index: u64) -> &AtomicU64 {
        let region = self.region(pfn);
        // One word per page (shift 0) masks every index to 0.
        region.word(pfn, index & ((1 << region.shift) - 1))
    }

    /// The first word of page `pfn` (the word the memstress guest reads and writes). Panics on a
    /// PFN no region holds (see [`HostMemory::page_word`]).
    #[inline]
    pub fn word(&self, pfn: Pfn) -> &AtomicU64 {
        self.page_word(pfn, 0)
    }

    /// Reads the guest-visible word of `pfn`.
    pub fn read(&self, pfn: Pfn) -> u64 {
        self.word(pfn).load(Ordering::Relaxed)
    }

    /// Writes the guest-visible word of `pfn`.
    pub fn write(&self, pfn: Pfn, value: u64) {
        self.word(pfn).store(value, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_page_lives_on_the_socket_of_its_first_fault() {
        let m = HostMemory::default();
        let base = m.alloc_region(4096).unwrap();
        assert_eq!(m.home(base), None, "not placed yet");
        // A 2 MiB page first faulted from socket 1: all its 512 pages live there, and a later
        // fault from socket 0 does not move it.
        m.place_first_touch(base + 512, 512, 1);
        m.place_first_touch(base + 512, 512, 0);
        assert_eq!(m.home(base + 512), Some(1));
        assert_eq!(m.home(base + 1023), Some(1));
        assert_eq!(m.home(base + 1024), None);
        m.place_first_touch(base, 1, 0);
        assert_eq!(m.home(base), Some(0));
        assert_eq!(m.home(ZERO_PFN), None, "the zero page is nobody's");
        // A huge page running past the region's end is placed up to it (and does not panic).
        m.place_first_touch(base + 4095, 2, 0);
        assert_eq!(m.home(base + 4095), Some(0));
        m.place_first_touch(base + 4096, 1, 0);
    }

    #[test]
    fn mem_available_is_parsed_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(t), Some(2 << 20));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn regions_are_zeroed_and_addressed_by_pfn() {
        let m = HostMemory::default();
        let a = m.alloc_region(10).unwrap();
        let b = m.alloc_region(10).unwrap();
        assert_ne!(a, b);
        m.write(b + 3, 7);
        assert_eq!(m.read(b + 3), 7);
        assert_eq!(m.read(a + 3), 0);
        assert_eq!(m.words_per_page(a), 1);
    }

    #[test]
    fn full_page_regions_keep_every_word_of_every_page() {
        let m = HostMemory::default();
        let one = m.alloc_region(4).unwrap();
        let full = m.alloc_region_words(4, WORDS_PER_FULL_PAGE).unwrap();
        assert_eq!(m.words_per_page(full), 512);
        assert_eq!(m.words_per_page(one), 1);
        // Neighbouring words of one page and the same word of neighbouring pages are distinct.
        m.page_word(full + 1, 511).store(11, Ordering::Relaxed);
        m.page_word(full + 2, 0).store(20, Ordering::Relaxed);
        m.page_word(full + 2, 1).store(21, Ordering::Relaxed);
        assert_eq!(m.page_word(full + 1, 511).load(Ordering::Relaxed), 11);
        assert_eq!(m.page_word(full + 1, 510).load(Ordering::Relaxed), 0);
        assert_eq!(m.read(full + 2), 20, "word() is word 0");
        assert_eq!(m.page_word(full + 2, 1).load(Ordering::Relaxed), 21);
        assert_eq!(m.read(full + 3), 0);
        m.write(full + 3, 30);
        assert_eq!(m.page_word(full + 3, 0).load(Ordering::Relaxed), 30);
        // The last word of the last page is in range.
        m.page_word(full + 3, 511).store(1, Ordering::Relaxed);
    }

    #[test]
    #[should_panic(expected = "keeps 1 words per page")]
    fn a_word_past_the_region_s_words_per_page_is_a_bug() {
        let m = HostMemory::default();
        let one = m.alloc_region(4).unwrap();
        m.page_word(one, 1);
    }

    #[test]
    fn bad_region_shapes_are_errors() {
        let m = HostMemory::default();
        for wpp in [0, 2, 8, 511, 513, 4096] {
            let e = m.alloc_region_words(1, wpp).unwrap_err();
            let e = e.to_string();
            assert!(!e.contains('\n') && e.contains(&wpp.to_string()), "{e}");
        }
        assert!(m.alloc_region_words(1 << REGION_PFN_BITS, 1).is_err());
        assert!(m.alloc_region_words(1 << REGION_PFN_BITS, 512).is_err());
        // The largest region: 2^32 full pages is 16 TiB of address space, which the host may
        // refuse; either way the answer is an error or a region, never a crash.
        let big = m.alloc_region_words((1 << REGION_PFN_BITS) - 1, WORDS_PER_FULL_PAGE);
        if let Err(e) = &big {
            assert!(e.to_string().contains("cannot reserve"), "{e}");
        }
        // Failed attempts do not use up region slots: the next region is the first one, or the
        // second if the big one was granted.
        let r = m.alloc_region_words(0, WORDS_PER_FULL_PAGE).unwrap();
        // (Regions 0 and 1 are the zero page's and the huge zero folio's.)
        assert_eq!(r.0 >> REGION_PFN_BITS, 2 + big.is_ok() as u64);
        assert_eq!(m.words_per_page(r), 512);
    }
}
