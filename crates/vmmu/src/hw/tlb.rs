//! A per-vCPU TLB that caches translations *with their permissions* until invalidated, with a
//! named core's capacity and associativity ([`TlbGeometry`]).
//!
//! A write that hits a stale writable entry succeeds without consulting the page tables, exactly
//! as on hardware; that is what makes a missing flush a real bug here, and the TLB the
//! coherence oracle's instrument: a stale entry is used until an invalidation covering it
//! completes (or it is evicted).
//!
//! What it keeps, as a core with two-dimensional translation does:
//! - *combined* entries (guest address to host frame), what an access uses, in a first-level
//!   array backed by the second level; an entry maps the smaller of the guest's stage-1 page and
//!   the stage-2 (EPT) leaf, so a guest that maps its memory with 4K pages (the selftests' guests
//!   do) needs one entry per 4K page even over 1G stage-2 blocks;
//! - *stage-2* entries (guest physical to host frame) of block leaves (2M, 1G), in the second
//!   level, which a combined miss uses instead of walking stage 2 (N1's L2 TLB keeps "IPA→PA for
//!   stage-2 2M/1G blocks"; Intel's STLB keeps guest-physical mappings, SDM §28.3.1);
//! - *walk* entries, where the guest's next table down sits in host memory for a region of
//!   guest addresses: the last-level table of a 2 MiB region (a combined miss there reads only
//!   the guest's leaf entry) and the level-2 table of a 1 GiB region (N1 keeps them in the L2
//!   TLB; Intel's PDE and PDPTE caches, of unpublished size);
//! - *stage-2 walk* entries, where the last-level stage-2 (EPT) table of a 2 MiB region of
//!   guest-physical addresses sits, so translating a page there reads only its stage-2 leaf
//!   (N1's L2 TLB again; Intel's EPT paging-structure caches).
//!
//! A miss walks the guest's own tables two-dimensionally ([`super::guest_tables`]): each guest
//! table it reads is a guest-physical page that needs its own stage-2 translation first.
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

use super::tlb_array::{EntryKind, Payload, Probes, Slot, TlbArrays, WINDOW_TOP};
pub use super::tlb_array::{TlbArray, TlbGeometry, CASCADE_LAKE, NEOVERSE_N1};
use crate::units::{Gfn, PageSize, Pfn};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A cached translation for one gfn.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Translation {
    /// Host frame backing the gfn.
    pub pfn: Pfn,
    /// The cached leaf allowed writes when it was loaded.
    pub writable: bool,
    /// The cached leaf already had its Dirty flag set (a write needs no page-walk to set D).
    pub dirty: bool,
    /// Found in the first level (else the second level's hit latency is paid).
    pub first_level: bool,
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

/// The entries a run of combined misses in one 2 MiB region goes through ([`Tlb::miss_run`]).
#[derive(Copy, Clone, Debug)]
pub(crate) struct MissRun {
    /// The walk entry of the region.
    walk_2m: Slot,
    /// How each miss translates the region at stage 2.
    stage2: MissStage2,
    /// The region's first gfn (for the debug builds' check that the run stays in it).
    region: Gfn,
    /// The combined arrays outside the load window map none of the region
    /// (`TlbArrays::region_outside_loads_misses`), as when the run started: the run changes
    /// none of them.
    outside_loads_miss: bool,
}

impl MissRun {
    /// The entry of the TLB through which each miss translates the region at stage 2: the
    /// stage-2 entry, or the stage-2 walk entry.
    fn stage2_slot(&self) -> Slot {
        match self.stage2 {
            MissStage2::Entry(slot, _) | MissStage2::Walk(slot) => slot,
        }
    }

    /// The stage-2 entry that translates the run's region, if one does: else each miss walks
    /// the stage-2 tables.
    pub(crate) fn stage2_entry(&self) -> Option<Stage2Entry> {
        match self.stage2 {
            MissStage2::Entry(_, e) => Some(e),
            MissStage2::Walk(_) => None,
        }
    }
}

/// How the misses of a [`MissRun`] translate their region at stage 2.
#[derive(Copy, Clone, Debug)]
enum MissStage2 {
    /// Through this stage-2 entry (a block's), which allows writes and has its Dirty flag.
    Entry(Slot, Stage2Entry),
    /// By walking the stage-2 tables, whose last-level table of the region this stage-2 walk
    /// entry holds.
    Walk(Slot),
}

/// One vCPU's TLB. Owned by the vCPU; other actors invalidate it by request
/// (`KVM_REQ_TLB_FLUSH`) or through its vCPU's [`TlbShootdown`], as on hardware.
///
/// Invalidation by IPA or range drops combined, stage-2 and stage-2 walk entries over what it
/// covers (a combined entry built from a stage-2 entry goes with it, the lenient reading of the
/// architecture; `TLBI IPAS2E1IS` without the last-level qualifier invalidates every level of
/// the stage-2 walk of the address) and keeps walk entries (stage-1 intermediates, which KVM's
/// following `TLBI VMALLE1IS` drops); `TLBI VMALLE1IS` drops every combined and walk entry and
/// keeps the stage-2 and stage-2 walk ones; a full flush (`TLBI VMALLS12E1IS`,
/// `KVM_REQ_TLB_FLUSH`'s `INVEPT`) drops everything.
pub struct Tlb {
    arrays: TlbArrays,
    /// The sizes combined entries can have (only the guest's page when translation is
    /// two-dimensional): lookups probe only their sets.
    combined_sizes: &'static [PageSize],
    /// Where each kind's lookup looks.
    combined: Probes,
    stage2: Probes,
    /// Walk entries of 2 MiB regions (the guest's last-level tables), of 1 GiB regions (its
    /// level-2 tables), and stage-2 walk entries of 2 MiB regions.
    walk_2m: Probes,
    walk_1g: Probes,
    stage2_walk: Probes,
    /// The combined entry that last hit: looked at first, so a run of accesses through one
    /// translation costs one comparison (what hits is unchanged: it is checked to be valid).
    last: Option<Slot>,
    /// The same shortcut for the 2 MiB walk entry and the stage-2 walk entry a miss used last
    /// (a sweep's misses fall in one 2 MiB region 512 times in a row).
    last_walk_2m: Option<Slot>,
    last_stage2_walk: Option<Slot>,
    /// The sequence number of the last broadcast invalidation applied from the vCPU's
    /// [`TlbShootdown`] (see [`TlbShootdown::sync`]).
    synced: u64,
}

impl Default for Tlb {
    fn default() -> Self {
        Tlb::new(&CASCADE_LAKE)
    }
}

/// The stage-2 leaf sizes the cores keep stage-2-only entries for (blocks).
const STAGE2_ENTRY_SIZES: [PageSize; 2] = [PageSize::Size2M, PageSize::Size1G];

impl Tlb {
    /// An empty TLB of `geometry`'s shape.
    pub fn new(geometry: &'static TlbGeometry) -> Self {
        let arrays = TlbArrays::new(geometry);
        Tlb {
            combined: arrays.probes(EntryKind::Combined, &PageSize::ALL),
            stage2: arrays.probes(EntryKind::Stage2, &STAGE2_ENTRY_SIZES),
            walk_2m: arrays.probes(EntryKind::Walk, &[PageSize::Size2M]),
            walk_1g: arrays.probes(EntryKind::Walk, &[PageSize::Size1G]),
            stage2_walk: arrays.probes(EntryKind::Stage2Walk, &[PageSize::Size2M]),
            arrays,
            combined_sizes: &PageSize::ALL,
            last: None,
            last_walk_2m: None,
            last_stage2_walk: None,
            synced: 0,
        }
    }

    /// Combined entries will be at most `max` (the guest's stage-1 page): lookups probe only
    /// the sets of the sizes up to it.
    pub fn cap_combined_size(&mut self, max: PageSize) {
        let n = PageSize::ALL.iter().filter(|s| **s <= max).count();
        self.combined_sizes = &PageSize::ALL[..n];
        self.combined = self.arrays.probes(EntryKind::Combined, self.combined_sizes);
    }

    /// Looks `gfn` up in the combined entries: the last entry that hit, then the first level,
    /// then the second (whose hit refills the first). Marks the entry used.
    #[inline]
    pub fn lookup(&mut self, gfn: Gfn) -> Option<Translation> {
        let (slot, first_level) = match self.last {
            Some(s) if self.arrays.still_maps(s, EntryKind::Combined, gfn) => {
                // (The last load of a window once it is written.)
                let s = self.arrays.resolve(s);
                self.arrays.touch(s);
                (s, true)
            }
            _ => {
                let (s, l1) = self.arrays.lookup(&self.combined, gfn)?;
                let s = if l1 {
                    s
                } else {
                    let promoted = self.arrays.promote(s, gfn);
                    debug_assert!(promoted.is_some(), "every core's L1 holds the guest's page");
                    promoted.unwrap_or(s)
                };
                (s, l1)
            }
        };
        self.last = Some(slot);
        let (base, _, p) = self.arrays.entry(slot);
        Some(Translation {
            pfn: Pfn(p.pfn + (gfn.0 - base)),
            writable: p.writable,
            dirty: p.dirty,
            first_level,
        })
    }

    /// [`Tlb::lookup`]s of the `n` gfns `first`, `first - 1`, … for as long as each hits a
    /// 4K entry in the second level only (a sweep down through pages the first level no
    /// longer holds): the same entries marked used and copied into the first level, in the
    /// same order. Returns how many it looked up (at most `first + 1`).
    pub fn second_level_read_run(&mut self, first: Gfn, n: u64) -> u64 {
        // Sweeps read the arrays as they are.
        self.arrays.materialize_loads();
        // Copies go in only for gfns above the one looked up next, so none that was free
        // when the run began becomes covered before it is looked up.
        let n = self.arrays.first_level_free_below(
            &self.combined,
            first,
            n.min(first.0.saturating_add(1)),
        );
        // The shortcut `lookup` tries first: after the first lookup it is the copy of the
        // gfn above, which maps no gfn of the run.
        if n == 0
            || self
                .last
                .is_some_and(|s| self.arrays.still_maps(s, EntryKind::Combined, first))
        {
            return 0;
        }
        let (done, last) = self.arrays.second_level_4k_sweep(&self.combined, first, n);
        if done > 0 {
            self.last = last;
        }
        done
    }

    /// What a run of combined misses in `gfn`'s 2 MiB region from `gfn` on uses of the TLB's
    /// other entries, if each miss's walks go through entries the TLB holds now: the walk entry
    /// of the region (the guest's walk reads only its leaf entry), and the stage-2 entry that
    /// translates the region when one does and allows a write (no stage-2 walk), else the
    /// stage-2 walk entry of the region (the stage-2 walk reads only its leaf entry). `None`
    /// when one is missing (the first miss in the region loads them). Not while the TLB is
    /// [`Tlb::lazy`]. A miss loads only its own combined entry, which on a core
    /// whose second level also holds these entries (Neoverse-N1) may share their set: they
    /// stay, since each miss has just marked them used and a set has more than two ways. So
    /// they serve the whole run ([`Tlb::use_miss_run`]), as long as nothing else changes the
    /// TLB meanwhile.
    pub(crate) fn miss_run(&self, gfn: Gfn) -> Option<MissRun> {
        // Where the window's waiting loads may change an answer, the misses go one by one.
        let walk_2m = self.arrays.peek(&self.walk_2m, gfn).ok()??;
        let stage2 = match self.arrays.peek(&self.stage2, gfn).ok()? {
            Some(slot) => {
                let e = self.stage2_entry(slot);
                if !(e.writable && e.dirty) {
                    // The write walks, and loads the entry again after.
                    return None;
                }
                MissStage2::Entry(slot, e)
            }
            None => MissStage2::Walk(self.arrays.peek(&self.stage2_walk, gfn).ok()??),
        };
        Some(MissRun {
            walk_2m,
            stage2,
            region: PageSize::Size2M.round(gfn),
            outside_loads_miss: self.arrays.region_outside_loads_misses(&self.combined, gfn),
        })
    }

    /// Lets the combined entries `run`'s misses load from `first` on wait in the arrays'
    /// window instead of being loaded one by one (`TlbArrays::open_loads`), when none of the
    /// run's other entries is in the arrays they go into: those are written when anything
    /// else reads or changes the arrays.
    pub(crate) fn open_loads(&mut self, run: &MissRun, first: Gfn) {
        let stage2 = run.stage2_slot();
        if !self.arrays.in_load_arrays(run.walk_2m) && !self.arrays.in_load_arrays(stage2) {
            self.arrays.open_loads(first);
        } else {
            // Closed, so that no load of this run waits while it touches those arrays (the
            // run's peeks saw no loads waiting).
            self.arrays.materialize_loads();
        }
    }

    /// Sweeps left entries or stamps unwritten, which [`Tlb::misses`] and [`Tlb::miss_run`]
    /// do not read.
    #[inline]
    pub(crate) fn lazy(&self) -> bool {
        self.arrays.lazy()
    }

    /// Whether no combined entry maps `gfn`: an access to it misses. False where loads waiting
    /// in the arrays' window may change the answer (`TlbArrays::peek`). Not while the TLB is
    /// [`Tlb::lazy`].
    #[inline]
    pub(crate) fn misses(&self, gfn: Gfn) -> bool {
        // Where waiting loads may change the answer, not known to miss: a run stops there.
        matches!(self.arrays.peek(&self.combined, gfn), Ok(None))
    }

    /// [`Tlb::misses`] of `gfn` in the region of `run` ([`Tlb::miss_run`]) while the run
    /// goes on: the arrays outside the load window are searched once a run, when it starts.
    #[inline]
    pub(crate) fn misses_in_run(&self, run: &MissRun, gfn: Gfn) -> bool {
        debug_assert_eq!(
            PageSize::Size2M.round(gfn),
            run.region,
            "outside the run's region"
        );
        let known = run.outside_loads_miss;
        self.arrays
            .misses_past_saturated_window(&self.combined, gfn, known)
            || matches!(
                self.arrays.peek_knowing(&self.combined, gfn, known),
                Ok(None)
            )
    }

    /// One miss of `run` ([`Tlb::miss_run`]) on `gfn` goes through its entries, as
    /// [`Tlb::lookup_walk`] of the region, then [`Tlb::lookup_stage2`] (when a stage-2 entry
    /// translates it) or [`Tlb::lookup_stage2_walk`] (after the stage-2 walk), mark them used,
    /// and leaves them where those lookups look first.
    #[inline]
    pub(crate) fn use_miss_run(&mut self, run: &MissRun, gfn: Gfn) {
        debug_assert!(
            self.arrays.still_maps(run.walk_2m, EntryKind::Walk, gfn),
            "{gfn:?}: the run's walk entry went"
        );
        self.arrays.touch(run.walk_2m);
        self.last_walk_2m = Some(run.walk_2m);
        match run.stage2 {
            MissStage2::Entry(slot, _) => self.arrays.touch(slot),
            MissStage2::Walk(slot) => {
                self.arrays.touch(slot);
                self.last_stage2_walk = Some(slot);
            }
        }
    }

    /// Whether the next `n` misses of `run`, from `gfn` up, may load their 4K combined
    /// entries in one go ([`Tlb::window_miss`]): their loads go into the arrays' saturated
    /// window without a search, and the arrays outside it are known to miss the region, so
    /// each next gfn misses too ([`Tlb::misses_in_run`] says so without looking).
    #[inline]
    pub(crate) fn window_takes_misses(&self, run: &MissRun, gfn: Gfn, n: u64) -> bool {
        run.outside_loads_miss && self.arrays.window_takes_misses(gfn, n)
    }

    /// One miss of a run that [`Tlb::window_takes_misses`] allowed, on `gfn` (the gfn the
    /// window takes next), translated to frame `pfn`: what [`Tlb::use_miss_run`] and
    /// [`Tlb::insert`] of its 4K combined entry do, the uses' stamps written by
    /// [`Tlb::end_window_misses`].
    #[inline]
    pub(crate) fn window_miss(&mut self, gfn: Gfn, pfn: Pfn, writable: bool, dirty: bool) {
        let payload = Payload {
            pfn: pfn.0,
            writable,
            dirty,
        };
        self.arrays.window_miss(gfn, payload);
    }

    /// Ends misses of `run` made by [`Tlb::window_miss`] (at least one): the entries they
    /// used take the stamps the last one gave them, and the TLB's shortcuts are where the
    /// last miss left them.
    pub(crate) fn end_window_misses(&mut self, run: &MissRun) {
        if let MissStage2::Walk(slot) = run.stage2 {
            self.last_stage2_walk = Some(slot);
        }
        self.arrays
            .end_window_misses([run.walk_2m, run.stage2_slot()]);
        self.last_walk_2m = Some(run.walk_2m);
        self.last = Some(WINDOW_TOP);
    }

    /// Every entry's key, stamp, frame and flags, the clock, and the entries lookups try
    /// first, for tests that compare two TLBs.
    #[cfg(test)]
    pub(crate) fn state(&self) -> (Vec<u64>, [Option<Slot>; 3]) {
        let last = [self.last, self.last_walk_2m, self.last_stage2_walk]
            .map(|s| s.map(|s| self.arrays.resolved(s)));
        (self.arrays.state(), last)
    }

    /// Looks `gfn`'s stage-2 entry up (marking it used).
    #[inline]
    pub fn lookup_stage2(&mut self, gfn: Gfn) -> Option<Stage2Entry> {
        let (slot, _) = self.arrays.lookup(&self.stage2, gfn)?;
        Some(self.stage2_entry(slot))
    }

    /// The stage-2 entry at `slot`.
    fn stage2_entry(&self, slot: Slot) -> Stage2Entry {
        let (_, size, p) = self.arrays.entry(slot);
        Stage2Entry {
            size,
            leaf_pfn: Pfn(p.pfn),
            writable: p.writable,
            dirty: p.dirty,
        }
    }

    /// Whether a walk entry covers `gfn`'s region of guest addresses of `size` (2M: the guest's
    /// last-level table is known; 1G: its level-2 table), marking it used.
    #[inline]
    pub fn lookup_walk(&mut self, gfn: Gfn, size: PageSize) -> bool {
        debug_assert!(size != PageSize::Size4K, "no walk entry for a leaf");
        match size {
            PageSize::Size2M => Self::lookup_via(
                &mut self.arrays,
                &self.walk_2m,
                &mut self.last_walk_2m,
                EntryKind::Walk,
                gfn,
            ),
            PageSize::Size1G => self.arrays.lookup(&self.walk_1g, gfn).is_some(),
            PageSize::Size4K => false,
        }
    }

    /// Caches where the guest's table one level down sits for `gfn`'s region of `size` (2M or
    /// 1G).
    pub fn insert_walk(&mut self, gfn: Gfn, size: PageSize) {
        debug_assert!(size != PageSize::Size4K, "no walk entry for a leaf");
        let slot = self
            .arrays
            .insert(EntryKind::Walk, gfn, size, Payload::default());
        if size == PageSize::Size2M {
            self.last_walk_2m = slot;
        }
    }

    /// A lookup of 2 MiB entries of `kind` that first tries the entry `last` remembers (valid,
    /// of the same kind, size and generation, mapping `gfn`: then marked used as a lookup
    /// would), and remembers what it finds. Finds exactly what the lookup through `probes`
    /// (2 MiB entries only) finds.
    #[inline]
    fn lookup_via(
        arrays: &mut TlbArrays,
        probes: &Probes,
        last: &mut Option<Slot>,
        kind: EntryKind,
        gfn: Gfn,
    ) -> bool {
        if let Some(s) = *last {
            if arrays.still_maps(s, kind, gfn) && arrays.entry(s).1 == PageSize::Size2M {
                arrays.touch(s);
                return true;
            }
        }
        *last = arrays.lookup(probes, gfn).map(|(s, _)| s);
        last.is_some()
    }

    /// Whether a stage-2 walk entry covers guest-physical page `gfn`'s 2 MiB region (its
    /// last-level stage-2 table is known), marking it used.
    #[inline]
    pub fn lookup_stage2_walk(&mut self, gfn: Gfn) -> bool {
        Self::lookup_via(
            &mut self.arrays,
            &self.stage2_walk,
            &mut self.last_stage2_walk,
            EntryKind::Stage2Walk,
            gfn,
        )
    }

    /// Caches where the last-level stage-2 table of `gfn`'s 2 MiB region sits.
    pub fn insert_stage2_walk(&mut self, gfn: Gfn) {
        self.last_stage2_walk = self.arrays.insert(
            EntryKind::Stage2Walk,
            gfn,
            PageSize::Size2M,
            Payload::default(),
        );
    }

    /// Caches a combined translation of `size` covering `gfn`; `pfn` is the frame of its first
    /// page.
    #[inline]
    pub fn insert(&mut self, gfn: Gfn, size: PageSize, pfn: Pfn, writable: bool, dirty: bool) {
        debug_assert!(
            self.combined_sizes.contains(&size),
            "{size:?} above the cap"
        );
        self.last = self.arrays.insert(
            EntryKind::Combined,
            gfn,
            size,
            Payload {
                pfn: pfn.0,
                writable,
                dirty,
            },
        );
    }

    /// Caches the stage-2 leaf of `e.size` that maps `gfn`, if the core keeps stage-2 entries
    /// of that size (blocks).
    pub fn insert_stage2(&mut self, gfn: Gfn, e: Stage2Entry) {
        if STAGE2_ENTRY_SIZES.contains(&e.size) {
            self.arrays.insert(
                EntryKind::Stage2,
                gfn,
                e.size,
                Payload {
                    pfn: e.leaf_pfn.0,
                    writable: e.writable,
                    dirty: e.dirty,
                },
            );
        }
    }

    /// Drops every cached translation (what `KVM_REQ_TLB_FLUSH` does on the vCPU, and
    /// `TLBI VMALLS12E1`).
    pub fn flush_all(&mut self) {
        self.arrays.flush_class(EntryKind::Combined);
        self.arrays.flush_class(EntryKind::Stage2);
    }

    /// Drops every combined and walk entry and keeps the stage-2 and stage-2 walk ones
    /// (`TLBI VMALLE1`).
    pub fn flush_stage1(&mut self) {
        self.arrays.flush_class(EntryKind::Combined);
    }

    /// Drops the translation of `gfn` (`TLBI IPAS2E1`): without a hint, the entry of any page
    /// size that maps `gfn`; with `size` (the TTL hint), only an entry of that page size. A
    /// wrong hint leaves the entry in place: the architecture does not promise to invalidate
    /// entries the hint does not describe, and this TLB takes it at its word.
    pub fn invalidate_gfn(&mut self, gfn: Gfn, size: Option<PageSize>) {
        let all = PageSize::ALL;
        let sizes: &[PageSize] = match &size {
            Some(s) => std::slice::from_ref(s),
            None => &all,
        };
        for kind in [EntryKind::Combined, EntryKind::Stage2] {
            self.arrays.invalidate_gfn(kind, gfn, sizes);
        }
        // The walk of the address at every level: its last-level stage-2 table's entry goes
        // whatever the hint (the hint describes the leaf).
        self.arrays
            .invalidate_gfn(EntryKind::Stage2Walk, gfn, &[PageSize::Size2M]);
    }

    /// Drops every translation of any page size that maps a gfn in `[start, start + pages)`
    /// (`TLBI RIPAS2E1`), and the stage-2 walk entries of the 2 MiB regions it overlaps: an
    /// entry of a huge page that only overlaps the range goes too.
    pub fn invalidate_range(&mut self, start: Gfn, pages: u64) {
        self.arrays.invalidate(
            &[
                EntryKind::Combined,
                EntryKind::Stage2,
                EntryKind::Stage2Walk,
            ],
            start,
            pages,
        );
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
    /// `TLBI VMALLE1IS`: every stage-1 (so every combined) translation and stage-1 walk entry
    /// of the VM; stage-2 and stage-2 walk entries stay.
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
    fn cached(tlb: &mut Tlb) -> (bool, bool, bool) {
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
            assert_eq!(cached(&mut tlb), left, "gfn {gfn:#x}");
        }
    }

    #[test]
    fn a_size_hint_limits_the_invalidation_to_that_page_size() {
        let mut tlb = three_sizes();
        tlb.invalidate_gfn(Gfn(0x401), Some(PageSize::Size4K));
        tlb.invalidate_gfn(Gfn(0x5_0000), Some(PageSize::Size2M));
        assert_eq!(
            cached(&mut tlb),
            (true, true, true),
            "a wrong hint drops nothing"
        );
        tlb.invalidate_gfn(Gfn(0x401), Some(PageSize::Size2M));
        tlb.invalidate_gfn(Gfn(0x5_0000), Some(PageSize::Size1G));
        tlb.invalidate_gfn(Gfn(0x3), Some(PageSize::Size4K));
        assert_eq!(cached(&mut tlb), (false, false, false));
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
            assert_eq!(cached(&mut tlb), left, "range {start:#x}+{pages:#x}");
        }
    }

    #[test]
    fn a_long_range_scans_and_drops_only_what_it_covers() {
        let mut tlb = Tlb::default();
        let base = 10_240;
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
        assert_eq!(cached(&mut tlb), (false, false, false));
    }

    #[test]
    fn posted_invalidations_apply_in_order_and_overflow_to_all() {
        let sd = TlbShootdown::default();
        let mut tlb = three_sizes();
        sd.sync(&mut tlb);
        assert_eq!(cached(&mut tlb), (true, true, true), "nothing posted");
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
        assert_eq!(
            cached(&mut tlb),
            (true, true, true),
            "not applied before sync"
        );
        sd.sync(&mut tlb);
        assert_eq!(sd.applied(), 2);
        assert_eq!(cached(&mut tlb), (false, false, true));
        // An entry loaded after the sync is not touched by what was applied before it.
        tlb.insert(Gfn(0x3), PageSize::Size4K, Pfn(0x10), true, true);
        sd.sync(&mut tlb);
        assert_eq!(cached(&mut tlb), (true, false, true));
        for _ in 0..=TLB_SHOOTDOWN_QUEUE {
            sd.post(TlbInvalidation::Gfn {
                gfn: Gfn(0x9_0000),
                size: None,
            });
        }
        sd.sync(&mut tlb);
        assert_eq!(sd.applied(), 3 + TLB_SHOOTDOWN_QUEUE as u64);
        assert_eq!(
            cached(&mut tlb),
            (false, false, false),
            "overflow flushes all"
        );
    }

    #[test]
    fn a_set_keeps_its_ways_and_evicts_the_least_recently_used() {
        // Cascade Lake: 4K entries go to an L1 set of 4 ways (16 sets) and an STLB set of 12
        // ways (128 sets); pages 128 apart share both sets.
        let mut tlb = Tlb::new(&CASCADE_LAKE);
        let page = |k: u64| Gfn(7 + 128 * k);
        for k in 0..12 {
            tlb.insert(page(k), PageSize::Size4K, Pfn(100 + k), false, false);
        }
        let t = tlb.lookup(page(11)).unwrap();
        assert!(t.first_level, "the last four loaded are in L1");
        let t = tlb.lookup(page(0)).unwrap();
        assert!(!t.first_level, "an older one hits in the STLB");
        assert!(
            tlb.lookup(page(0)).unwrap().first_level,
            "and was copied to L1"
        );
        // Page 0 was used last: loading a 13th evicts page 1, the least recently used.
        tlb.insert(page(12), PageSize::Size4K, Pfn(112), false, false);
        assert!(tlb.lookup(page(1)).is_none());
        assert_eq!(tlb.lookup(page(0)).unwrap().pfn, Pfn(100));
        assert_eq!(tlb.lookup(page(12)).unwrap().pfn, Pfn(112));
        // A page in another set is not affected.
        tlb.insert(Gfn(8), PageSize::Size4K, Pfn(5), false, false);
        assert!(tlb.lookup(page(2)).is_some());
    }

    /// The last-hit shortcut (a run of accesses through one entry costs one comparison)
    /// changes nothing: a TLB that forgets its last hit before every lookup translates, hits
    /// and misses in the same levels, and evicts the same entries, over a random mix of
    /// lookups, loads and invalidations. Loads first drop what overlaps them, as
    /// break-before-make guarantees: two entries of different sizes mapping one address are a
    /// TLB conflict (arm64 may take a TLB conflict abort), and which one a lookup returns is
    /// then not defined, here as on hardware.
    #[test]
    fn the_last_hit_shortcut_changes_no_result() {
        let mut rng = crate::lab::memstress::GuestRandom::new(7);
        for geometry in [&NEOVERSE_N1, &CASCADE_LAKE] {
            let (mut fast, mut slow) = (Tlb::new(geometry), Tlb::new(geometry));
            for _ in 0..200_000 {
                let r = rng.next_u32();
                // Runs on a few pages, with sizes that overlap.
                let gfn =
                    Gfn((rng.next_u32() % 4096) as u64
                        + if r.is_multiple_of(7) { 0x4_0000 } else { 0 });
                match r % 16 {
                    0..=10 => {
                        slow.last = None;
                        assert_eq!(fast.lookup(gfn), slow.lookup(gfn), "{gfn:?}");
                    }
                    11..=13 => {
                        let size = PageSize::ALL[(r as usize / 16) % 3];
                        let base = size.round(gfn);
                        for t in [&mut fast, &mut slow] {
                            t.invalidate_range(base, size.pages());
                            t.insert(
                                base,
                                size,
                                Pfn(base.0 + 7),
                                r.is_multiple_of(2),
                                r.is_multiple_of(4),
                            );
                        }
                    }
                    14 => {
                        for t in [&mut fast, &mut slow] {
                            t.invalidate_gfn(gfn, None);
                        }
                    }
                    _ => {
                        for t in [&mut fast, &mut slow] {
                            t.invalidate_range(gfn, 1 + (r as u64 >> 8) % 1024);
                        }
                    }
                }
            }
        }
    }

    /// A run of reads made in one step ([`Tlb::second_level_read_run`]) leaves the TLB exactly
    /// as the same lookups made one by one do, each of them a second-level hit of a 4K entry,
    /// and on Neoverse-N1 the lookup after the run would not have been one: over sweeps down
    /// behind a new page (page-table's pattern) and random runs, among lookups, loads of every
    /// size and invalidations.
    #[test]
    fn a_run_of_second_level_hits_is_the_same_lookups_one_by_one() {
        let mut rng = crate::lab::memstress::GuestRandom::new(11);
        for geometry in [&NEOVERSE_N1, &CASCADE_LAKE] {
            let (mut run, mut one) = (Tlb::new(geometry), Tlb::new(geometry));
            let (mut runs, mut cursor) = (0, 0);
            for _ in 0..80_000 {
                let r = rng.next_u32();
                let gfn = Gfn((rng.next_u32() % 700) as u64);
                match r % 32 {
                    0..=9 | 21..=28 => {
                        // Mostly page-table's pattern: a new page, then a sweep down behind it.
                        let (gfn, n) = if r % 64 < 48 {
                            cursor = (cursor + 1) % 700;
                            let page = Gfn(cursor);
                            if run.lookup(page).is_none() {
                                for t in [&mut run, &mut one] {
                                    t.insert(page, PageSize::Size4K, Pfn(page.0 + 3), true, false);
                                }
                            } else {
                                one.lookup(page);
                            }
                            (Gfn(cursor.saturating_sub(1)), 1 + (r as u64 >> 8) % 512)
                        } else {
                            (gfn, 1 + (r as u64 >> 8) % 600)
                        };
                        let done = run.second_level_read_run(gfn, n);
                        assert!(done <= n.min(gfn.0 + 1));
                        for k in 0..done {
                            let t = one.lookup(Gfn(gfn.0 - k)).expect("a hit");
                            assert!(!t.first_level, "{gfn:?} - {k}: a first-level hit");
                        }
                        assert_eq!(run.arrays.state(), one.arrays.state(), "{gfn:?} {n}");
                        runs += (done > 48) as u32;
                        if done < n.min(gfn.0 + 1) {
                            let next = Gfn(gfn.0 - done);
                            let (a, b) = (run.lookup(next), one.lookup(next));
                            assert_eq!(a, b);
                            // Exact where the first level is one set in replacement order;
                            // elsewhere a run ends at any entry it would reach.
                            assert!(
                                a.is_none_or(|t| t.first_level) || geometry != &NEOVERSE_N1,
                                "{next:?} hit the L2 only"
                            );
                        }
                    }
                    10..=13 => assert_eq!(run.lookup(gfn), one.lookup(gfn), "{gfn:?}"),
                    14..=20 => {
                        // Mostly 4K entries; loads first drop what overlaps them. Some come
                        // six at a time into one set, evicting what a sweep used there.
                        let size = PageSize::ALL[usize::from(r % 1024 < 16)];
                        let burst = if r.is_multiple_of(8) { 6 } else { 1 };
                        for k in 0..burst {
                            let base = size.round(Gfn(gfn.0 + 256 * k));
                            for t in [&mut run, &mut one] {
                                t.invalidate_range(base, size.pages());
                                t.insert(base, size, Pfn(base.0 + 3), true, false);
                            }
                        }
                    }
                    29 => {
                        for t in [&mut run, &mut one] {
                            t.invalidate_gfn(gfn, None);
                        }
                    }
                    30 if r % 256 < 32 => {
                        for t in [&mut run, &mut one] {
                            t.flush_stage1();
                        }
                    }
                    _ => {
                        let pages = 1 + (r as u64 >> 8) % 16;
                        for t in [&mut run, &mut one] {
                            t.invalidate_range(gfn, pages);
                        }
                    }
                }
            }
            assert_eq!(run.arrays.state(), one.arrays.state());
            assert!(runs > 0, "{}: no run of over 48 hits", geometry.name);
        }
    }

    /// page-table's adjust stage on Neoverse-N1, as the engine runs it: each new page, then the
    /// reads down behind it in runs that an epoch cuts short, and between them what else
    /// reaches the TLB (stage-2 and walk loads into the second level, lookups of the pages
    /// just read, invalidations, flushes). The TLB is the same as after the same lookups one
    /// by one, after every step: what sweeps leave unstamped or unwritten (their windows, the
    /// first level's pending copies) included.
    #[test]
    fn sweeps_cut_into_pieces_are_the_lookups_one_by_one() {
        let mut rng = crate::lab::memstress::GuestRandom::new(29);
        let (mut run, mut one) = (Tlb::new(&NEOVERSE_N1), Tlb::new(&NEOVERSE_N1));
        for t in [&mut run, &mut one] {
            t.cap_combined_size(PageSize::Size4K);
        }
        let (mut page, mut next, mut left) = (0u64, 0u64, 0u64);
        let (mut swept, mut runs) = (0, 0);
        for _ in 0..20_000 {
            let r = rng.next_u32();
            if left == 0 {
                page = page % 3000 + 1;
                let (a, b) = (run.lookup(Gfn(page)), one.lookup(Gfn(page)));
                assert_eq!(a, b, "page {page}");
                if a.is_none() {
                    for t in [&mut run, &mut one] {
                        t.insert(Gfn(page), PageSize::Size4K, Pfn(page + 7), true, false);
                    }
                }
                (next, left) = (page - 1, page.min(512));
            }
            let near = Gfn(next.saturating_sub(64) + u64::from(r >> 8) % 128);
            match r % 32 {
                0 => {
                    let e = Stage2Entry {
                        size: PageSize::Size2M,
                        leaf_pfn: Pfn(near.0),
                        writable: true,
                        dirty: r % 64 < 32,
                    };
                    for t in [&mut run, &mut one] {
                        t.insert_stage2(PageSize::Size2M.round(near), e);
                    }
                }
                1 => {
                    for t in [&mut run, &mut one] {
                        t.insert_walk(near, PageSize::Size2M);
                    }
                }
                2 => assert_eq!(
                    run.lookup_walk(near, PageSize::Size2M),
                    one.lookup_walk(near, PageSize::Size2M)
                ),
                3 | 4 => assert_eq!(run.lookup(near), one.lookup(near), "{near:?}"),
                5 if r % 256 < 16 => {
                    for t in [&mut run, &mut one] {
                        t.invalidate_gfn(near, None);
                    }
                }
                6 if r % 1024 < 8 => {
                    for t in [&mut run, &mut one] {
                        t.flush_stage1();
                    }
                }
                7 => {
                    // A walk entry for six 2 MiB regions in the set of the page read last: they
                    // evict what was read there last.
                    for k in 0..6 {
                        let region =
                            Gfn((((next + 1) & 255) + 256 * (k + u64::from(r >> 8) % 8)) << 9);
                        for t in [&mut run, &mut one] {
                            t.insert_walk(region, PageSize::Size2M);
                        }
                    }
                }
                8 => {
                    // The sweep goes on from higher up (among the last copies).
                    next = (next + 1 + u64::from(r >> 8) % 64).min(page - 1);
                    left = left.clamp(1, next + 1);
                }
                _ => {}
            }
            // An epoch's worth of the sweep, and the read it stopped at (if any) in turn.
            let n = (1 + u64::from(r >> 12) % 200).min(left);
            let done = run.second_level_read_run(Gfn(next), n);
            for k in 0..done {
                let t = one.lookup(Gfn(next - k)).expect("a hit");
                assert!(!t.first_level, "{next} - {k}: a first-level hit");
            }
            (swept, runs) = (swept + done, runs + u64::from(done >= 48));
            (next, left) = (next.saturating_sub(done), left - done);
            if done < n {
                let g = Gfn(next);
                let (a, b) = (run.lookup(g), one.lookup(g));
                assert_eq!(a, b, "{g:?}");
                if a.is_none() {
                    for t in [&mut run, &mut one] {
                        t.insert(g, PageSize::Size4K, Pfn(g.0 + 7), true, false);
                    }
                }
                (next, left) = (next.saturating_sub(1), left - 1);
            }
            assert_eq!(
                run.arrays.state(),
                one.arrays.state(),
                "page {page}, {next}"
            );
        }
        assert!(
            swept > 400_000 && runs > 3_000,
            "{swept} swept, {runs} runs"
        );
    }

    #[test]
    fn neoverse_n1_holds_48_entries_in_l1_and_every_size_in_one_l2() {
        let mut tlb = Tlb::new(&NEOVERSE_N1);
        for k in 0..49 {
            tlb.insert(Gfn(k), PageSize::Size4K, Pfn(k), false, false);
        }
        assert!(
            !tlb.lookup(Gfn(0)).unwrap().first_level,
            "49 entries overflow the L1"
        );
        assert!(tlb.lookup(Gfn(48)).unwrap().first_level);
        // A 1G entry shares the L2 with 4K ones.
        tlb.insert(Gfn(1 << 18), PageSize::Size1G, Pfn(1 << 18), true, true);
        assert_eq!(
            tlb.lookup(Gfn((1 << 18) + 5)).unwrap().pfn,
            Pfn((1 << 18) + 5)
        );
    }

    #[test]
    fn stage2_entries_are_kept_for_blocks_and_walk_entries_until_a_stage1_flush() {
        let mut tlb = Tlb::new(&NEOVERSE_N1);
        let s2 = |size| Stage2Entry {
            size,
            leaf_pfn: Pfn(0x200),
            writable: true,
            dirty: true,
        };
        tlb.insert_stage2(Gfn(0x3), s2(PageSize::Size4K));
        assert!(
            tlb.lookup_stage2(Gfn(0x3)).is_none(),
            "4K stage-2 leaves are not kept"
        );
        tlb.insert_stage2(Gfn(0x205), s2(PageSize::Size2M));
        assert_eq!(
            tlb.lookup_stage2(Gfn(0x3ff)).unwrap().size,
            PageSize::Size2M
        );
        tlb.insert_walk(Gfn(0x205), PageSize::Size2M);
        assert!(
            tlb.lookup_walk(Gfn(0x3ff), PageSize::Size2M)
                && !tlb.lookup_walk(Gfn(0x400), PageSize::Size2M)
        );
        tlb.invalidate_range(Gfn(0x200), 0x200);
        assert!(
            tlb.lookup_walk(Gfn(0x205), PageSize::Size2M),
            "an IPA range keeps stage-1 walk entries"
        );
        assert!(tlb.lookup_stage2(Gfn(0x205)).is_none());
        tlb.flush_stage1();
        assert!(
            !tlb.lookup_walk(Gfn(0x205), PageSize::Size2M),
            "VMALLE1IS drops them"
        );
    }

    #[test]
    fn an_ipa_tlbi_drops_the_stage2_walk_entry_of_its_region_whatever_its_hint() {
        let mut tlb = Tlb::new(&NEOVERSE_N1);
        tlb.insert_stage2_walk(Gfn(0x205));
        tlb.insert_stage2_walk(Gfn(0x405));
        tlb.invalidate_gfn(Gfn(0x3ff), Some(PageSize::Size4K));
        assert!(!tlb.lookup_stage2_walk(Gfn(0x200)));
        assert!(tlb.lookup_stage2_walk(Gfn(0x400)), "another region");
        tlb.invalidate(TlbInvalidation::Stage1All);
        assert!(tlb.lookup_stage2_walk(Gfn(0x400)), "VMALLE1IS keeps it");
        tlb.invalidate(TlbInvalidation::All);
        assert!(!tlb.lookup_stage2_walk(Gfn(0x400)));
    }

    #[test]
    fn posted_stage1_flushes_keep_stage2_entries_that_no_ipa_invalidation_covered() {
        let sd = TlbShootdown::default();
        let mut tlb = three_sizes();
        let s2 = |gfn: u64| Stage2Entry {
            size: PageSize::Size2M,
            leaf_pfn: Pfn(gfn),
            writable: true,
            dirty: true,
        };
        tlb.insert_stage2(Gfn(0x800), s2(0x800));
        tlb.insert_stage2(Gfn(0xa00), s2(0xa00));
        sd.post(TlbInvalidation::Gfn {
            gfn: Gfn(0xa00),
            size: None,
        });
        sd.post(TlbInvalidation::Stage1All);
        sd.post(TlbInvalidation::Stage1All);
        sd.sync(&mut tlb);
        assert_eq!(sd.applied(), 3);
        assert_eq!(
            cached(&mut tlb),
            (false, false, false),
            "VMALLE1IS drops combined entries"
        );
        assert!(tlb.lookup_stage2(Gfn(0x800)).is_some(), "kept");
        assert!(
            tlb.lookup_stage2(Gfn(0xa00)).is_none(),
            "the IPA TLBI dropped it"
        );
        sd.post(TlbInvalidation::All);
        sd.sync(&mut tlb);
        assert!(
            tlb.lookup_stage2(Gfn(0x800)).is_none(),
            "VMALLS12E1IS drops everything"
        );
    }
}
