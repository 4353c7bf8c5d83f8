//! A per-vCPU TLB that caches translations *with their permissions* until invalidated.
//!
//! A write that hits a stale writable entry succeeds without consulting the page tables, exactly
//! as on hardware; that is what makes a missing flush a real bug here. Geometry (direct-mapped,
//! separate arrays per page size) is a simplification of a set-associative STLB: what matters to
//! the MMU is *whether* a stale entry can survive, not the replacement policy.
//!
//! Two ways to invalidate another PE's TLB exist, and both are modelled:
//! - by request: x86 has no broadcast invalidation of guest-physical translations, so KVM makes
//!   `KVM_REQ_TLB_FLUSH`, kicks the vCPU and waits for the IPI's ack; the vCPU flushes its own
//!   [`Tlb`] before it re-enters guest mode (`crate::kvm::Kvm::flush_remote_tlbs`);
//! - by broadcast: arm64's `TLBI IPAS2E1IS` / `TLBI RIPAS2E1IS` / `TLBI VMALLS12E1IS`, executed
//!   by the flushing PE, invalidate every PE's TLB with no software on the target, and the
//!   flusher's `DSB ISH` completes once they are done everywhere. Here each vCPU has a
//!   [`TlbShootdown`] endpoint any actor posts a [`TlbInvalidation`] to; the vCPU applies what
//!   is posted to its private [`Tlb`] before its next lookup ([`TlbShootdown::sync`]) and on
//!   guest entry, and the flusher's completion wait is `crate::kvm::Kvm::dsb_ish`.

use crate::units::{Gfn, PageSize, Pfn};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// The arrays' generation when the entry was loaded: an entry of an older generation is
    /// invalid, so a full flush is one increment (every guest-mode `TLBI VMALLE1IS` of arm64's
    /// fault path flushes every vCPU).
    gen: u32,
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

/// One set of direct-mapped arrays, one per page size.
struct Entries {
    e4k: Box<[TlbEntry]>,
    e2m: Box<[TlbEntry]>,
    e1g: Box<[TlbEntry]>,
    /// The current generation (see `TlbEntry::gen`).
    gen: u32,
}

impl Default for Entries {
    fn default() -> Self {
        Entries {
            e4k: vec![TlbEntry::default(); TLB_4K_ENTRIES].into_boxed_slice(),
            e2m: vec![TlbEntry::default(); TLB_2M_ENTRIES].into_boxed_slice(),
            e1g: vec![TlbEntry::default(); TLB_1G_ENTRIES].into_boxed_slice(),
            gen: 1,
        }
    }
}

impl Entries {
    fn array(&mut self, size: PageSize) -> &mut [TlbEntry] {
        match size {
            PageSize::Size4K => &mut self.e4k,
            PageSize::Size2M => &mut self.e2m,
            PageSize::Size1G => &mut self.e1g,
        }
    }

    /// The entry that maps `gfn`, largest page size first, with its size.
    #[inline]
    fn lookup(&self, gfn: Gfn) -> Option<(PageSize, TlbEntry)> {
        for (arr, size) in [
            (&self.e1g, PageSize::Size1G),
            (&self.e2m, PageSize::Size2M),
            (&self.e4k, PageSize::Size4K),
        ] {
            let vpn = gfn.0 >> size.gfn_shift();
            let e = &arr[(vpn as usize) % arr.len()];
            if e.tag == vpn + 1 && e.gen == self.gen {
                return Some((size, *e));
            }
        }
        None
    }

    fn insert(&mut self, gfn: Gfn, size: PageSize, leaf_pfn: Pfn, writable: bool, dirty: bool) {
        let vpn = gfn.0 >> size.gfn_shift();
        let gen = self.gen;
        let arr = self.array(size);
        let n = arr.len();
        arr[(vpn as usize) % n] = TlbEntry {
            tag: vpn + 1,
            pfn: leaf_pfn.0,
            gen,
            writable,
            dirty,
        };
    }

    fn flush(&mut self) {
        self.gen = self.gen.wrapping_add(1);
        if self.gen == 0 {
            // Wrapped: entries of every older generation could match again; clear them.
            for arr in [&mut self.e4k, &mut self.e2m, &mut self.e1g] {
                arr.iter_mut().for_each(|e| e.tag = 0);
            }
            self.gen = 1;
        }
    }

    /// Drops the entries of `size` overlapping `[start, start + pages)`. The arrays are
    /// direct-mapped, so the entry of page `vpn` can only sit in slot `vpn % len`: a short range
    /// checks its own slots, a long one scans the array.
    fn invalidate_size(&mut self, size: PageSize, start: Gfn, pages: u64) {
        if pages == 0 {
            return;
        }
        let shift = size.gfn_shift();
        let first = start.0 >> shift;
        let last = start.0.saturating_add(pages - 1) >> shift;
        let arr = self.array(size);
        let n = arr.len() as u64;
        if last - first < n {
            for vpn in first..=last {
                let e = &mut arr[(vpn % n) as usize];
                // Wrapping: at the top of the gfn space the tag wraps to 0, an invalid entry.
                if e.tag == vpn.wrapping_add(1) {
                    e.tag = 0;
                }
            }
        } else {
            for e in arr.iter_mut() {
                if e.tag != 0 && (first..=last).contains(&(e.tag - 1)) {
                    e.tag = 0;
                }
            }
        }
    }
}

/// A stage-2-only entry: what the TLB keeps of an IPA's stage-2 leaf.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Stage2Entry {
    /// The size the stage-2 leaf maps.
    pub size: PageSize,
    /// The leaf's first frame.
    pub leaf_pfn: Pfn,
    /// The leaf allowed writes when it was loaded.
    pub writable: bool,
    /// A write needs no walk to update the leaf.
    pub dirty: bool,
}

/// One vCPU's TLB. Owned by the vCPU; other actors invalidate it by request
/// (`KVM_REQ_TLB_FLUSH`) or through its vCPU's [`TlbShootdown`], as on hardware.
///
/// It holds *combined* entries (guest address to host frame, what an access uses) and, for
/// arm64, *stage-2* entries (IPA to host frame: what a walk of stage 2 would find), which a
/// combined miss consults before walking stage 2. Invalidation by IPA or range drops both
/// kinds for the addresses it covers (a combined entry built from a stage-2 entry goes with
/// it, the lenient reading of the architecture); `TLBI VMALLE1IS` drops every combined entry
/// and keeps the stage-2 ones; a full flush drops both.
#[derive(Default)]
pub struct Tlb {
    combined: Entries,
    stage2: Entries,
    /// The sequence number of the last broadcast invalidation applied from the vCPU's
    /// [`TlbShootdown`] (see [`TlbShootdown::sync`]).
    synced: u64,
}

impl Tlb {
    /// Looks `gfn` up in the combined entries, largest page size first.
    #[inline]
    pub fn lookup(&self, gfn: Gfn) -> Option<Translation> {
        self.combined.lookup(gfn).map(|(size, e)| Translation {
            pfn: Pfn(e.pfn + (gfn.0 & (size.pages() - 1))),
            writable: e.writable,
            dirty: e.dirty,
        })
    }

    /// Looks `gfn`'s stage-2 entry up.
    #[inline]
    pub fn lookup_stage2(&self, gfn: Gfn) -> Option<Stage2Entry> {
        self.stage2.lookup(gfn).map(|(size, e)| Stage2Entry {
            size,
            leaf_pfn: Pfn(e.pfn),
            writable: e.writable,
            dirty: e.dirty,
        })
    }

    /// Caches the leaf of `size` that maps `gfn` as a combined entry; `leaf_pfn` is the leaf's
    /// first frame.
    pub fn insert(&mut self, gfn: Gfn, size: PageSize, leaf_pfn: Pfn, writable: bool, dirty: bool) {
        self.combined.insert(gfn, size, leaf_pfn, writable, dirty);
    }

    /// Caches the stage-2 leaf of `size` that maps `gfn`.
    pub fn insert_stage2(&mut self, gfn: Gfn, e: Stage2Entry) {
        self.stage2
            .insert(gfn, e.size, e.leaf_pfn, e.writable, e.dirty);
    }

    /// Drops every cached translation (what `KVM_REQ_TLB_FLUSH` does on the vCPU, and
    /// `TLBI VMALLS12E1`).
    pub fn flush_all(&mut self) {
        self.combined.flush();
        self.stage2.flush();
    }

    /// Drops every combined entry and keeps the stage-2 ones (`TLBI VMALLE1`).
    pub fn flush_stage1(&mut self) {
        self.combined.flush();
    }

    /// Drops the translation of `gfn` (`TLBI IPAS2E1`): without a hint, the entry of any page
    /// size that maps `gfn`; with `size` (the TTL hint), only an entry of that page size. A
    /// wrong hint leaves the entry in place: the architecture does not promise to invalidate
    /// entries the hint does not describe, and this TLB takes it at its word.
    pub fn invalidate_gfn(&mut self, gfn: Gfn, size: Option<PageSize>) {
        for s in PageSize::ALL {
            if size.is_none_or(|h| h == s) {
                self.combined.invalidate_size(s, gfn, 1);
                self.stage2.invalidate_size(s, gfn, 1);
            }
        }
    }

    /// Drops every translation of any page size that maps a gfn in `[start, start + pages)`
    /// (`TLBI RIPAS2E1`): an entry of a huge page that only overlaps the range goes too.
    pub fn invalidate_range(&mut self, start: Gfn, pages: u64) {
        for s in PageSize::ALL {
            self.combined.invalidate_size(s, start, pages);
            self.stage2.invalidate_size(s, start, pages);
        }
    }

    /// Applies one invalidation.
    pub fn invalidate(&mut self, inv: TlbInvalidation) {
        match inv {
            TlbInvalidation::Gfn { gfn, size } => self.invalidate_gfn(gfn, size),
            TlbInvalidation::Range { start, pages } => self.invalidate_range(start, pages),
            TlbInvalidation::Stage1All => self.flush_stage1(),
            TlbInvalidation::All => self.flush_all(),
        }
    }
}

/// One broadcast invalidation of guest-physical (stage-2) translations.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TlbInvalidation {
    /// `TLBI IPAS2E1IS`: the translation of one gfn, with an optional level hint (the TTL
    /// field): see [`Tlb::invalidate_gfn`].
    Gfn {
        /// The gfn whose translation goes.
        gfn: Gfn,
        /// The page size of the leaf that maps it, when the flusher knows it (the TTL hint).
        size: Option<PageSize>,
    },
    /// `TLBI RIPAS2E1IS`: every translation overlapping `[start, start + pages)`.
    Range {
        /// First gfn of the range.
        start: Gfn,
        /// Number of 4 KiB pages.
        pages: u64,
    },
    /// `TLBI VMALLE1IS`: every stage-1 (so every combined) translation of the VM; stage-2
    /// entries stay.
    Stage1All,
    /// `TLBI VMALLS12E1IS`: every translation of the VM.
    All,
}

/// How many invalidations a vCPU's queue holds before it collapses them into one
/// [`TlbInvalidation::All`] (as arm64 falls back to `TLBI VMALLS12E1IS` past
/// `MAX_TLBI_OPS`).
pub const TLB_SHOOTDOWN_QUEUE: usize = 64;

/// Invalidations posted and not yet applied.
#[derive(Default)]
struct ShootdownQueue {
    posted: Vec<TlbInvalidation>,
    /// Overflowed, or `TLBI VMALLS12E1IS` posted: everything goes.
    all: bool,
    /// `TLBI VMALLE1IS` posted: every combined entry goes. Invalidations applied together
    /// commute (each only drops entries), so one flag stands for any number of them.
    stage1_all: bool,
}

/// The broadcast-invalidation endpoint of one vCPU's TLB: any actor posts to it
/// ([`TlbShootdown::post`]); the vCPU applies what was posted to its private [`Tlb`]
/// ([`TlbShootdown::sync`]) before each lookup and on guest entry, and publishes how far it got
/// ([`TlbShootdown::applied`]) for the flusher's completion wait.
///
/// Invalidations are numbered in the order they are posted (the queue lock orders posters), so
/// "applied up to n" means every invalidation numbered n or less has been applied.
#[derive(Default)]
pub struct TlbShootdown {
    /// Number of invalidations posted so far; written under `queue`'s lock.
    posted: AtomicU64,
    /// Number of invalidations the vCPU has applied; written only by the vCPU.
    applied: AtomicU64,
    queue: Mutex<ShootdownQueue>,
}

impl TlbShootdown {
    /// Posts `inv` (the target's half of a `TLBI ...IS`) and returns its sequence number: the
    /// invalidation is complete on this vCPU once [`TlbShootdown::applied`] reaches it.
    ///
    /// The caller must order this post before reading whether the vCPU is in guest mode with a
    /// full barrier (as `crate::kvm::vcpu::VcpuShared::post_tlbi` does): a vCPU that
    /// enters guest mode after that read sees the post when it syncs on entry.
    pub fn post(&self, inv: TlbInvalidation) -> u64 {
        let mut q = self.queue.lock();
        if q.posted.len() == TLB_SHOOTDOWN_QUEUE || inv == TlbInvalidation::All {
            q.posted.clear();
            q.all = true;
        }
        if inv == TlbInvalidation::Stage1All {
            q.stage1_all = true;
        } else if !q.all {
            q.posted.push(inv);
        }
        // Counted under the lock: a vCPU whose Relaxed load in sync() sees this number then
        // takes the lock, which publishes the entry to it. SeqCst, and followed by the
        // caller's full barrier (VcpuShared::post_tlbi), so the count is ordered before the
        // caller's read of the vCPU's mode; pairs with the barrier after the vCPU publishes
        // guest mode (VcpuShared::try_enter_guest) and the load in sync() that follows it.
        self.posted.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// How many posted invalidations the vCPU has applied to its TLB. Acquire: pairs with the
    /// Release store in [`TlbShootdown::sync`], so the vCPU's accesses through the
    /// translations it dropped happen before whatever the flusher does once it sees them
    /// applied (`DSB ISH`: the old translations are no longer in use).
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Acquire)
    }

    /// Applies to `tlb` (this vCPU's) every invalidation posted so far. The fast path, on every
    /// guest access, is one Relaxed load: a post made while the vCPU is in guest mode is
    /// waited for through [`TlbShootdown::applied`], so it only needs to be seen eventually,
    /// and one made before it entered guest mode is ordered by the entry's full barrier. The
    /// slow path takes the queue lock, which orders the poster's earlier page-table writes
    /// before the refills that follow.
    #[inline]
    pub fn sync(&self, tlb: &mut Tlb) {
        if self.posted.load(Ordering::Relaxed) != tlb.synced {
            self.apply(tlb);
        }
    }

    #[cold]
    #[inline(never)]
    fn apply(&self, tlb: &mut Tlb) {
        // Applied under the lock, so the queue keeps its capacity (no allocation per post once
        // it has grown); posters wait at most for one vCPU's TLB update.
        let upto = {
            let mut q = self.queue.lock();
            let stage1_all = std::mem::take(&mut q.stage1_all);
            if std::mem::take(&mut q.all) {
                q.posted.clear();
                tlb.flush_all();
            } else {
                q.posted.drain(..).for_each(|inv| tlb.invalidate(inv));
                if stage1_all {
                    tlb.flush_stage1();
                }
            }
            // Under the lock: every invalidation numbered up to here has been applied.
            self.posted.load(Ordering::Relaxed)
        };
        tlb.synced = upto;
        // Release: the invalidations (and every access made through the translations they
        // dropped) happen before a flusher's Acquire load in applied() that sees `upto`.
        self.applied.store(upto, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_entries_survive_until_flushed() {
        let mut tlb = Tlb::default();
        assert_eq!(tlb.lookup(Gfn(5)), None);
        tlb.insert(Gfn(0x200 + 5), PageSize::Size2M, Pfn(0x1000), true, true);
        let t = tlb.lookup(Gfn(0x205)).unwrap();
        assert_eq!(t.pfn, Pfn(0x1005));
        assert!(t.writable, "a cached writable entry keeps allowing writes");
        tlb.flush_all();
        assert_eq!(tlb.lookup(Gfn(0x205)), None);
    }

    /// A TLB holding one entry of each size: 4K at gfn 0x3, 2M at gfn 0x400 (covering
    /// 0x400..0x600), 1G at gfn 0x4_0000 (covering 0x4_0000..0x8_0000).
    fn three_sizes() -> Tlb {
        let mut tlb = Tlb::default();
        tlb.insert(Gfn(0x3), PageSize::Size4K, Pfn(0x10), true, true);
        tlb.insert(Gfn(0x400), PageSize::Size2M, Pfn(0x200), true, true);
        tlb.insert(Gfn(0x4_0000), PageSize::Size1G, Pfn(0x4_0000), true, true);
        tlb
    }

    /// Which of [`three_sizes`]'s entries are still cached: (4K, 2M, 1G).
    fn cached(tlb: &Tlb) -> (bool, bool, bool) {
        (
            tlb.lookup(Gfn(0x3)).is_some(),
            tlb.lookup(Gfn(0x5ff)).is_some(),
            tlb.lookup(Gfn(0x7_ffff)).is_some(),
        )
    }

    #[test]
    fn invalidating_a_gfn_drops_the_entry_of_any_size_that_maps_it() {
        for (gfn, left) in [
            (0x3, (false, true, true)),
            (0x4, (true, true, true)),
            (0x401, (true, false, true)),
            (0x600, (true, true, true)),
            (0x5_1234, (true, true, false)),
            (0x8_0000, (true, true, true)),
        ] {
            let mut tlb = three_sizes();
            tlb.invalidate_gfn(Gfn(gfn), None);
            assert_eq!(cached(&tlb), left, "gfn {gfn:#x}");
        }
    }

    #[test]
    fn a_size_hint_limits_the_invalidation_to_that_page_size() {
        let mut tlb = three_sizes();
        tlb.invalidate_gfn(Gfn(0x401), Some(PageSize::Size4K));
        tlb.invalidate_gfn(Gfn(0x5_0000), Some(PageSize::Size2M));
        assert_eq!(
            cached(&tlb),
            (true, true, true),
            "a wrong hint drops nothing"
        );
        tlb.invalidate_gfn(Gfn(0x401), Some(PageSize::Size2M));
        tlb.invalidate_gfn(Gfn(0x5_0000), Some(PageSize::Size1G));
        tlb.invalidate_gfn(Gfn(0x3), Some(PageSize::Size4K));
        assert_eq!(cached(&tlb), (false, false, false));
    }

    #[test]
    fn a_range_drops_every_entry_it_overlaps() {
        for (start, pages, left) in [
            (0x0, 3, (true, true, true)),
            (0x0, 4, (false, true, true)),
            (0x4, 0x3fc, (true, true, true)),
            // The last page of the 2M entry, the first of the 1G one.
            (0x5ff, 1, (true, false, true)),
            (0x3_ffff, 2, (true, true, false)),
            // Crossing both huge pages from inside them.
            (0x5ff, 0x3_fa02, (true, false, false)),
            (0x0, 1 << 40, (false, false, false)),
            (0x8_0000, 1 << 20, (true, true, true)),
            (0x3, 0, (true, true, true)),
            (u64::MAX - 4, 8, (true, true, true)),
        ] {
            let mut tlb = three_sizes();
            tlb.invalidate_range(Gfn(start), pages);
            assert_eq!(cached(&tlb), left, "range {start:#x}+{pages:#x}");
        }
    }

    #[test]
    fn a_long_range_scans_and_drops_only_what_it_covers() {
        let mut tlb = Tlb::default();
        // More 4K pages than the array has slots, so the range is handled by a scan.
        let base = 10 * TLB_4K_ENTRIES as u64;
        for g in [base - 1, base, base + 2000, base + 4000] {
            tlb.insert(Gfn(g), PageSize::Size4K, Pfn(g), false, false);
        }
        tlb.invalidate_range(Gfn(base), 4000);
        assert!(tlb.lookup(Gfn(base - 1)).is_some());
        assert!(tlb.lookup(Gfn(base)).is_none());
        assert!(tlb.lookup(Gfn(base + 2000)).is_none());
        assert!(tlb.lookup(Gfn(base + 4000)).is_some());
    }

    #[test]
    fn invalidate_all_drops_every_size() {
        let mut tlb = three_sizes();
        tlb.invalidate(TlbInvalidation::All);
        assert_eq!(cached(&tlb), (false, false, false));
    }

    #[test]
    fn posted_invalidations_apply_in_order_and_overflow_to_all() {
        let sd = TlbShootdown::default();
        let mut tlb = three_sizes();
        sd.sync(&mut tlb);
        assert_eq!(cached(&tlb), (true, true, true), "nothing posted");
        assert_eq!(
            sd.post(TlbInvalidation::Gfn {
                gfn: Gfn(0x3),
                size: None
            }),
            1
        );
        assert_eq!(
            sd.post(TlbInvalidation::Range {
                start: Gfn(0x500),
                pages: 1
            }),
            2
        );
        assert_eq!(sd.applied(), 0);
        assert_eq!(cached(&tlb), (true, true, true), "not applied before sync");
        sd.sync(&mut tlb);
        assert_eq!(sd.applied(), 2);
        assert_eq!(cached(&tlb), (false, false, true));
        // An entry loaded after the sync is not touched by what was applied before it.
        tlb.insert(Gfn(0x3), PageSize::Size4K, Pfn(0x10), true, true);
        sd.sync(&mut tlb);
        assert_eq!(cached(&tlb), (true, false, true));
        for _ in 0..=TLB_SHOOTDOWN_QUEUE {
            sd.post(TlbInvalidation::Gfn {
                gfn: Gfn(0x9_0000),
                size: None,
            });
        }
        sd.sync(&mut tlb);
        assert_eq!(sd.applied(), 3 + TLB_SHOOTDOWN_QUEUE as u64);
        assert_eq!(cached(&tlb), (false, false, false), "overflow flushes all");
    }

    #[test]
    fn conflicting_entries_evict_each_other() {
        let mut tlb = Tlb::default();
        tlb.insert(Gfn(1), PageSize::Size4K, Pfn(10), false, false);
        tlb.insert(
            Gfn(1 + TLB_4K_ENTRIES as u64),
            PageSize::Size4K,
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

    #[test]
    fn a_full_flush_is_a_generation_and_survives_wrapping() {
        let mut tlb = three_sizes();
        tlb.combined.gen = u32::MAX;
        tlb.insert(Gfn(0x3), PageSize::Size4K, Pfn(0x10), true, true);
        assert!(tlb.lookup(Gfn(0x3)).is_some());
        tlb.flush_all();
        assert_eq!(tlb.combined.gen, 1, "wrapped past 0");
        assert_eq!(
            cached(&tlb),
            (false, false, false),
            "entries of every generation gone"
        );
        tlb.insert(Gfn(0x3), PageSize::Size4K, Pfn(0x10), true, true);
        assert!(tlb.lookup(Gfn(0x3)).is_some());
    }

    #[test]
    fn posted_stage1_flushes_keep_stage2_entries_that_no_ipa_invalidation_covered() {
        let sd = TlbShootdown::default();
        let mut tlb = three_sizes();
        let s2 = |gfn: u64| Stage2Entry {
            size: PageSize::Size4K,
            leaf_pfn: Pfn(gfn),
            writable: true,
            dirty: true,
        };
        tlb.insert_stage2(Gfn(0x3), s2(0x3));
        tlb.insert_stage2(Gfn(0x7), s2(0x7));
        sd.post(TlbInvalidation::Gfn {
            gfn: Gfn(0x7),
            size: None,
        });
        sd.post(TlbInvalidation::Stage1All);
        sd.post(TlbInvalidation::Stage1All);
        sd.sync(&mut tlb);
        assert_eq!(sd.applied(), 3);
        assert_eq!(
            cached(&tlb),
            (false, false, false),
            "VMALLE1IS drops combined entries"
        );
        assert!(tlb.lookup_stage2(Gfn(0x3)).is_some(), "kept");
        assert!(
            tlb.lookup_stage2(Gfn(0x7)).is_none(),
            "the IPA TLBI dropped it"
        );
        sd.post(TlbInvalidation::All);
        sd.sync(&mut tlb);
        assert!(
            tlb.lookup_stage2(Gfn(0x3)).is_none(),
            "VMALLS12E1IS drops everything"
        );
    }
}
