//! Private anonymous memory as the host's page-fault handler sees it: what the VMM's page table
//! maps at each 4 KiB page of the region (`mm/memory.c`).
//!
//! - A page nobody touched has no PTE ([`HostPte::None`]).
//! - A read fault on it maps the shared zero page read-only (`do_anonymous_page()` without
//!   `FAULT_FLAG_WRITE`, unless `mm_forbids_zeropage()`): [`HostPte::Zero`].
//! - A write fault allocates and clears a page of its own (`do_anonymous_page()`), or, over the
//!   zero page, copies it (`do_wp_page()` → `wp_page_copy()`): [`HostPte::Private`]. The copy
//!   replaces the PTE inside `mmu_notifier_invalidate_range_start()/_end()`, which is how KVM
//!   learns that the zero page it may have mapped is gone (`kvm::host_fault`).
//!
//! With transparent huge pages, each 2 MiB of the region first has a PMD ([`HostPmd`]): a read
//! maps the huge zero folio (`do_huge_pmd_anonymous_page()` with `use_zero_page`), a write a
//! huge page of its own; the first write over the huge zero folio splits the PMD into 512 PTEs
//! of the (4 KiB) zero page (`do_huge_pmd_wp_page()` → `__split_huge_pmd()`, inside an
//! MMU-notifier invalidation of the 2 MiB), and that page is then copied as above.
//!
//! Two bits a page, in words allocated zeroed and lazily like the region's data, so a large guest
//! costs nothing until it is touched; a byte per PMD. Transitions are compare-and-exchange, as
//! the PTE and PMD locks serialise them (`vmf_pte_changed()`: a fault that finds the entry
//! changed under it backs out).

use crate::host::memory::zeroed_words;
use crate::host::HostError;
use std::sync::atomic::{AtomicU64, Ordering};

/// What the host page table maps at one page of private anonymous memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostPte {
    /// Never touched: no PTE.
    None = 0,
    /// The shared zero page, read-only.
    Zero = 1,
    /// A page of its own, writable.
    Private = 2,
}

impl HostPte {
    fn from_bits(b: u64) -> HostPte {
        match b {
            0 => HostPte::None,
            1 => HostPte::Zero,
            _ => HostPte::Private,
        }
    }
}

/// What the host page table maps at one 2 MiB of memory backed by transparent huge pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostPmd {
    /// Never touched: no PMD.
    None = 0,
    /// The huge zero folio, read-only.
    HugeZero = 1,
    /// A huge page of its own, writable.
    Huge = 2,
    /// A table of 4 KiB PTEs (split from the huge zero folio), each page as [`HostPte`] says.
    Split = 3,
}

impl HostPmd {
    fn from_u8(b: u8) -> HostPmd {
        match b {
            0 => HostPmd::None,
            1 => HostPmd::HugeZero,
            2 => HostPmd::Huge,
            _ => HostPmd::Split,
        }
    }
}

/// Pages per word (two bits each).
const PAGES_PER_WORD: u64 = 32;
/// 4 KiB pages under one PMD.
pub const PAGES_PER_PMD: u64 = 512;

/// The host PTE state of every page of one region, and its PMDs where it is backed by
/// transparent huge pages.
pub struct AnonPtes {
    words: Box<[AtomicU64]>,
    pmds: Option<Box<[std::sync::atomic::AtomicU8]>>,
}

impl AnonPtes {
    /// A region of `pages` untouched pages (in huge pages where `thp`), or an error when the
    /// host cannot reserve the state.
    pub fn new(pages: u64, thp: bool) -> Result<Self, HostError> {
        let pmds = thp.then(|| {
            (0..pages.div_ceil(PAGES_PER_PMD))
                .map(|_| std::sync::atomic::AtomicU8::new(0))
                .collect()
        });
        Ok(AnonPtes {
            words: zeroed_words(pages.div_ceil(PAGES_PER_WORD))?,
            pmds,
        })
    }

    /// The PMD over page `page`, where the region has huge pages.
    #[inline]
    pub fn pmd(&self, page: u64) -> Option<HostPmd> {
        let pmds = self.pmds.as_ref()?;
        Some(HostPmd::from_u8(
            pmds[(page / PAGES_PER_PMD) as usize].load(Ordering::Acquire),
        ))
    }

    /// Changes the PMD over page `page` from `from` to `to`; `Err` with what it is when another
    /// fault changed it first. Splitting ([`HostPmd::Split`]) fills the table with zero-page
    /// PTEs first (`__split_huge_zero_page_pmd()`), so no fault sees the split without them.
    pub fn change_pmd(&self, page: u64, from: HostPmd, to: HostPmd) -> Result<(), HostPmd> {
        let pmds = self
            .pmds
            .as_ref()
            .expect("a PMD change in a region without huge pages");
        let first = page / PAGES_PER_PMD * PAGES_PER_PMD;
        if to == HostPmd::Split {
            // Two bits of Zero (01) for each of the 512 pages: 16 words. Only the fault that
            // wins the PMD below may publish them, but until then no fault reads them (the PMD
            // is not Split), so writing them first is safe.
            let pattern = 0x5555_5555_5555_5555;
            for w in 0..PAGES_PER_PMD / PAGES_PER_WORD {
                self.words[((first / PAGES_PER_WORD) + w) as usize]
                    .store(pattern, Ordering::Relaxed);
            }
        }
        // AcqRel pairs with the Acquire of pmd(): a fault that sees Split sees the PTEs.
        pmds[(page / PAGES_PER_PMD) as usize]
            .compare_exchange(from as u8, to as u8, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(HostPmd::from_u8)
    }

    fn slot(&self, page: u64) -> (&AtomicU64, u32) {
        (
            &self.words[(page / PAGES_PER_WORD) as usize],
            ((page % PAGES_PER_WORD) * 2) as u32,
        )
    }

    /// What page `page` (index in the region) maps now.
    #[inline]
    pub fn get(&self, page: u64) -> HostPte {
        let (w, shift) = self.slot(page);
        HostPte::from_bits((w.load(Ordering::Acquire) >> shift) & 3)
    }

    /// Changes page `page` from `from` to `to`, as the fault handler does under the PTE lock;
    /// `Err` with what the page maps when another fault changed it first.
    pub fn change(&self, page: u64, from: HostPte, to: HostPte) -> Result<(), HostPte> {
        let (w, shift) = self.slot(page);
        let mut cur = w.load(Ordering::Acquire);
        loop {
            let now = HostPte::from_bits((cur >> shift) & 3);
            if now != from {
                return Err(now);
            }
            let new = (cur & !(3 << shift)) | ((to as u64) << shift);
            // AcqRel: pairs with the Acquire of get(), so a fault that sees the new PTE sees
            // what the handler did before it (the copied page).
            match w.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(c) => cur = c,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_start_untouched_and_change_only_from_what_they_map() {
        let p = AnonPtes::new(100, false).unwrap();
        assert_eq!(p.pmd(0), None);
        assert_eq!(p.get(0), HostPte::None);
        assert_eq!(p.get(99), HostPte::None);
        p.change(33, HostPte::None, HostPte::Zero).unwrap();
        assert_eq!(p.get(33), HostPte::Zero);
        assert_eq!((p.get(32), p.get(34)), (HostPte::None, HostPte::None));
        // A write fault that planned on an untouched page finds the zero page.
        assert_eq!(
            p.change(33, HostPte::None, HostPte::Private),
            Err(HostPte::Zero)
        );
        p.change(33, HostPte::Zero, HostPte::Private).unwrap();
        assert_eq!(p.get(33), HostPte::Private);
        p.change(31, HostPte::None, HostPte::Private).unwrap();
        assert_eq!(p.get(31), HostPte::Private);
        assert_eq!(p.get(33), HostPte::Private);
    }

    #[test]
    fn a_huge_zero_folio_splits_into_zero_page_ptes() {
        let p = AnonPtes::new(1024, true).unwrap();
        assert_eq!(p.pmd(700), Some(HostPmd::None));
        p.change_pmd(700, HostPmd::None, HostPmd::HugeZero).unwrap();
        assert_eq!(p.pmd(512), Some(HostPmd::HugeZero));
        assert_eq!(p.pmd(511), Some(HostPmd::None));
        assert_eq!(
            p.change_pmd(600, HostPmd::None, HostPmd::Huge),
            Err(HostPmd::HugeZero)
        );
        p.change_pmd(513, HostPmd::HugeZero, HostPmd::Split)
            .unwrap();
        assert!((512..1024).all(|pg| p.get(pg) == HostPte::Zero));
        assert!((0..512).all(|pg| p.get(pg) == HostPte::None));
        p.change(700, HostPte::Zero, HostPte::Private).unwrap();
        assert_eq!((p.get(699), p.get(700)), (HostPte::Zero, HostPte::Private));
    }

    /// The stress test of the packed states: on every page, a reader (None to Zero) and a
    /// writer (None to Private, or Zero to Private once it finds the zero page) race, while
    /// other threads do the same on the neighbouring pages of the same words. Every page ends
    /// Private, and each reader saw either its own Zero or the writer's Private: no update to a
    /// neighbour is lost to the word's compare-and-exchange.
    #[test]
    fn racing_faults_on_neighbouring_pages_lose_no_update() {
        const PAGES: u64 = 4096;
        let p = AnonPtes::new(PAGES, false).unwrap();
        let zeros = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (p, zeros) = (&p, &zeros);
                s.spawn(move || {
                    // Threads 0 and 1 share odd and even pages; 2 and 3 take the other role.
                    for page in (0..PAGES).filter(|pg| pg % 2 == t % 2) {
                        if t < 2 {
                            match p.change(page, HostPte::None, HostPte::Zero) {
                                Ok(()) => {
                                    zeros.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(now) => assert_eq!(now, HostPte::Private),
                            }
                        } else {
                            match p.change(page, HostPte::None, HostPte::Private) {
                                Ok(()) => {}
                                Err(HostPte::Zero) => {
                                    p.change(page, HostPte::Zero, HostPte::Private).unwrap()
                                }
                                Err(now) => panic!("page {page}: {now:?}"),
                            }
                        }
                    }
                });
            }
        });
        assert!((0..PAGES).all(|pg| p.get(pg) == HostPte::Private));
        assert!(zeros.load(Ordering::Relaxed) <= PAGES);
    }
}
