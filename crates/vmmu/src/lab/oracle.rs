//! The dirty-log completeness oracle: every write that completed before a harvest began must be
//! reported by that harvest or by one that began after the write started.
//!
//! A generation counter works like a seqlock: enabling logging sets it to 2; harvest `k` makes
//! it `2k+1` while it runs and `2k+2` when it ends. A write samples the counter before it starts
//! (`s`) and after it completes (`c`). At the end of harvest `j`, a write with `c <= 2j`
//! completed before `j` began, and must have been reported by a harvest numbered at least
//! `s / 2` (the first harvest that had not finished when the write started). Only the latest
//! write to each page is kept, which can hide an older write under a concurrent newer one
//! (a missed check, never a false alarm).
//!
//! When vCPUs run during harvests, KVM itself reports some writes one harvest late:
//! `fast_pf_fix_direct_spte()` sets W with cmpxchg and only then marks the page dirty, and
//! another vCPU can write through the new W in between; a harvest that takes the bitmap word in
//! that window misses the page, whose mark lands right after. A [`DirtyLogOracle::concurrent`]
//! oracle therefore defers a miss to the next harvest, which must report the page; the caller
//! runs `synchronize_srcu()` between harvests so every fault in flight (and its mark) has
//! finished. A quiescent oracle (vCPUs idle during harvests, as in dirty_log_perf_test) allows
//! no lateness at all.

use std::sync::atomic::{AtomicU32, Ordering};

/// The most harvests an oracle checks: its generations (`2k + 2` after harvest `k`) are kept in
/// 24 bits a page.
pub const MAX_HARVESTS: u32 = (1 << (GEN_BITS - 1)) - 2;

/// Bits of a write's record that hold its start generation; the rest hold how many
/// generations it spanned.
const GEN_BITS: u32 = 24;

/// A span ([`DirtyLogOracle::writes`]' low bits) this long or longer is not known: such a
/// write is not checked.
const SPAN_UNKNOWN: u32 = (1 << (32 - GEN_BITS)) - 1;

/// The oracle over a contiguous range of guest pages.
pub struct DirtyLogOracle {
    base_gfn: u64,
    gen: AtomicU32,
    harvest: AtomicU32,
    /// Per page, the latest completed write: `s << 8 | min(c - s, 255)` (4 bytes a page: 8
    /// with [`DirtyLogOracle::reported`], against 12 for `s` and `c` in full; a 64 GiB guest's
    /// oracle takes 128 MiB). A write whose start and completion are 255 generations or more
    /// apart (about 128 harvests) is not checked: a missed check, never a false alarm.
    writes: Box<[AtomicU32]>,
    /// Per page: the last harvest that reported it.
    reported: Box<[AtomicU32]>,
    /// Whether harvests race with vCPUs (misses are deferred one harvest).
    concurrent: bool,
    /// Misses deferred to the next harvest: (page index, harvest that must report it).
    deferred: parking_lot::Mutex<Vec<(usize, u32)>>,
}

/// What one check found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OracleCheck {
    /// Written pages whose report was checked.
    pub checked: u64,
    /// Gfns that should have been reported and were not.
    pub lost: Vec<u64>,
    /// Pages reported one harvest late (concurrent oracles only).
    pub late: u64,
}

impl DirtyLogOracle {
    /// An oracle for pages `[base_gfn, base_gfn + npages)` whose harvests run while vCPUs are
    /// idle: every miss is a loss.
    pub fn new(base_gfn: u64, npages: u64) -> Self {
        DirtyLogOracle {
            base_gfn,
            gen: AtomicU32::new(0),
            harvest: AtomicU32::new(0),
            writes: (0..npages).map(|_| AtomicU32::new(0)).collect(),
            reported: (0..npages).map(|_| AtomicU32::new(0)).collect(),
            concurrent: false,
            deferred: Default::default(),
        }
    }

    /// An oracle whose harvests race with running vCPUs: a miss must be reported by the next
    /// harvest (see the module documentation; the caller runs `synchronize_srcu()` between
    /// harvests).
    pub fn concurrent(base_gfn: u64, npages: u64) -> Self {
        DirtyLogOracle {
            concurrent: true,
            ..Self::new(base_gfn, npages)
        }
    }

    /// Dirty logging was enabled: writes from now on must be reported.
    pub fn logging_enabled(&self) {
        self.gen.store(2, Ordering::SeqCst);
    }

    /// Sampled before a guest write starts.
    #[inline]
    pub fn before_write(&self) -> u32 {
        self.gen.load(Ordering::SeqCst)
    }

    /// Records a completed guest write to `gfn` that started with generation `s`.
    #[inline]
    pub fn after_write(&self, gfn: u64, s: u32) {
        self.writes[(gfn - self.base_gfn) as usize].store(self.record(s), Ordering::Relaxed);
    }

    /// Records completed guest writes to the `n` gfns from `first`, each started with
    /// generation `s`, as [`DirtyLogOracle::after_write`] of each would while no harvest
    /// begins or ends.
    pub fn after_writes(&self, first: u64, n: u64, s: u32) {
        let record = self.record(s);
        let i = (first - self.base_gfn) as usize;
        for w in &self.writes[i..i + n as usize] {
            w.store(record, Ordering::Relaxed);
        }
    }

    /// The record of a write that started with generation `s` and completes now (a write in
    /// flight when logging was enabled again, whose generation went back, spans "unknown").
    #[inline]
    fn record(&self, s: u32) -> u32 {
        let c = self.gen.load(Ordering::SeqCst);
        s << (32 - GEN_BITS) | c.wrapping_sub(s).min(SPAN_UNKNOWN)
    }

    /// A record's start generation and span ([`DirtyLogOracle::record`]'s fields).
    #[inline]
    fn fields(record: u32) -> (u32, u32) {
        (record >> (32 - GEN_BITS), record & SPAN_UNKNOWN)
    }

    /// A harvest (GET, and CLEAR in manual-protect mode) begins; returns its number. Panics
    /// past [`MAX_HARVESTS`] (callers bound their harvests by it).
    pub fn begin_harvest(&self) -> u32 {
        let k = self.harvest.fetch_add(1, Ordering::SeqCst) + 1;
        assert!(
            k <= MAX_HARVESTS,
            "harvest {k}: the dirty-log oracle checks at most {MAX_HARVESTS} harvests"
        );
        self.gen.store(2 * k + 1, Ordering::SeqCst);
        k
    }

    /// Harvest `k` reported the pages set in `bitmap`, whose bit 0 is `first_gfn`.
    pub fn record_report(&self, k: u32, first_gfn: u64, bitmap: &[u64]) {
        for (wi, &w) in bitmap.iter().enumerate() {
            let mut bits = w;
            while bits != 0 {
                let b = bits.trailing_zeros() as u64;
                bits &= bits - 1;
                let gfn = first_gfn + wi as u64 * 64 + b;
                if let Some(r) = gfn
                    .checked_sub(self.base_gfn)
                    .and_then(|i| self.reported.get(i as usize))
                {
                    r.store(k, Ordering::Relaxed);
                }
            }
        }
    }

    /// Harvest `k` ended: check every page.
    pub fn end_harvest(&self, k: u32) -> OracleCheck {
        self.gen.store(2 * k + 2, Ordering::SeqCst);
        let mut out = OracleCheck::default();
        // Misses deferred from harvest k-1 must have been reported now.
        let mut judged = std::collections::HashSet::new();
        for (i, must) in std::mem::take(&mut *self.deferred.lock()) {
            judged.insert(i);
            if self.reported[i].load(Ordering::Relaxed) >= must {
                out.late += 1;
            } else {
                out.lost.push(self.base_gfn + i as u64);
            }
        }
        let mut deferred = Vec::new();
        let pages = self.writes.iter().zip(self.reported.iter()).enumerate();
        for (i, (w, reported)) in pages {
            let (s, span) = Self::fields(w.load(Ordering::Relaxed));
            // s < 2: written before logging was enabled; c > 2k: completed after k began.
            if s < 2 || span == SPAN_UNKNOWN || s + span > 2 * k || judged.contains(&i) {
                continue;
            }
            out.checked += 1;
            if reported.load(Ordering::Relaxed) < s / 2 {
                if self.concurrent {
                    deferred.push((i, k + 1));
                } else {
                    out.lost.push(self.base_gfn + i as u64);
                }
            }
        }
        *self.deferred.lock() = deferred;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pages_missing_in_a_large_harvest_are_found_in_order() {
        // Misses far apart, the first and last page among them.
        let npages = 200_100;
        let missing = [0, 5, 70_000, 140_001, npages - 1];
        let o = DirtyLogOracle::new(1 << 20, npages);
        o.logging_enabled();
        let s = o.before_write();
        o.after_writes(1 << 20, npages, s);
        let k = o.begin_harvest();
        let mut bitmap = vec![!0u64; npages.div_ceil(64) as usize];
        for i in missing {
            bitmap[(i / 64) as usize] &= !(1 << (i % 64));
        }
        o.record_report(k, 1 << 20, &bitmap);
        let c = o.end_harvest(k);
        assert_eq!(c.checked, npages);
        assert_eq!(c.lost, missing.map(|i| (1 << 20) + i));
    }

    #[test]
    fn a_write_missing_from_the_harvest_is_lost() {
        let o = DirtyLogOracle::new(1000, 128);
        let s = o.before_write();
        o.after_write(1000, s); // before logging: not checked
        o.logging_enabled();
        for g in [1001, 1070] {
            let s = o.before_write();
            o.after_write(g, s);
        }
        let k = o.begin_harvest();
        o.record_report(k, 1000, &[0b10, 0]);
        let c = o.end_harvest(k);
        assert_eq!(
            c,
            OracleCheck {
                checked: 2,
                lost: vec![1070],
                late: 0
            }
        );
    }

    #[test]
    fn an_old_report_does_not_cover_a_new_write() {
        let o = DirtyLogOracle::new(0, 64);
        o.logging_enabled();
        let s = o.before_write();
        o.after_write(5, s);
        let k = o.begin_harvest();
        o.record_report(k, 0, &[1 << 5]);
        assert!(o.end_harvest(k).lost.is_empty());
        let s = o.before_write();
        o.after_write(5, s);
        let k = o.begin_harvest();
        o.record_report(k, 0, &[0]);
        assert_eq!(
            o.end_harvest(k).lost,
            vec![5],
            "harvest 1's report predates the write"
        );
    }

    #[test]
    fn a_concurrent_oracle_allows_one_harvest_of_lateness_and_no_more() {
        for reported_late in [true, false] {
            let o = DirtyLogOracle::concurrent(0, 64);
            o.logging_enabled();
            let s = o.before_write();
            o.after_write(7, s);
            let k = o.begin_harvest();
            o.record_report(k, 0, &[0]);
            assert_eq!(
                o.end_harvest(k),
                OracleCheck {
                    checked: 1,
                    lost: vec![],
                    late: 0
                },
                "deferred"
            );
            let k = o.begin_harvest();
            o.record_report(k, 0, &[if reported_late { 1 << 7 } else { 0 }]);
            let c = o.end_harvest(k);
            if reported_late {
                assert_eq!((c.late, c.lost.len()), (1, 0));
            } else {
                assert_eq!(c.lost, vec![7]);
            }
        }
    }

    #[test]
    fn a_write_spanning_too_many_harvests_is_not_checked_and_one_spanning_a_few_is() {
        // A harvest moves the generation by 2: 127 harvests are a span of 254, 128 of 256.
        for (span, checked) in [(3, true), (127, true), (128, false), (200, false)] {
            let o = DirtyLogOracle::new(0, 64);
            o.logging_enabled();
            let s = o.before_write();
            for _ in 0..span {
                let k = o.begin_harvest();
                o.record_report(k, 0, &[0]);
                o.end_harvest(k);
            }
            o.after_write(3, s);
            let k = o.begin_harvest();
            o.record_report(k, 0, &[0]);
            let c = o.end_harvest(k);
            assert_eq!(c.checked, u64::from(checked), "{span} harvests");
            assert_eq!(c.lost, if checked { vec![3] } else { vec![] }, "{span}");
        }
    }

    #[test]
    #[should_panic(expected = "harvest 8388607: the dirty-log oracle checks at most 8388606")]
    fn a_harvest_past_the_last_generation_fails_loudly() {
        let o = DirtyLogOracle::new(0, 64);
        o.logging_enabled();
        o.harvest.store(MAX_HARVESTS - 1, Ordering::SeqCst);
        let k = o.begin_harvest();
        assert_eq!(k, MAX_HARVESTS);
        let s = o.before_write();
        assert_eq!(s, 2 * MAX_HARVESTS + 1);
        o.after_write(1, s);
        let w = o.writes[1].load(Ordering::Relaxed);
        assert_eq!(DirtyLogOracle::fields(w).0, s, "the last generation fits");
        o.end_harvest(k);
        o.begin_harvest();
    }

    #[test]
    fn writes_recorded_at_once_are_the_writes_recorded_one_by_one() {
        let (one, many) = (DirtyLogOracle::new(100, 64), DirtyLogOracle::new(100, 64));
        for o in [&one, &many] {
            o.logging_enabled();
            let k = o.begin_harvest();
            o.record_report(k, 100, &[0]);
            o.end_harvest(k);
        }
        let s = one.before_write();
        (110..150).for_each(|g| one.after_write(g, s));
        many.after_writes(110, 40, many.before_write());
        let records = |o: &DirtyLogOracle| -> Vec<u32> {
            o.writes.iter().map(|w| w.load(Ordering::Relaxed)).collect()
        };
        assert_eq!(records(&one), records(&many));
        assert!(records(&many)[9] == 0 && records(&many)[10] != 0 && records(&many)[50] == 0);
        // Logging enabled again while a write was in flight: its span is not known.
        let s = many.before_write();
        many.logging_enabled();
        many.after_write(120, s);
        let w = many.writes[20].load(Ordering::Relaxed);
        assert_eq!(DirtyLogOracle::fields(w).1, SPAN_UNKNOWN);
    }

    #[test]
    fn a_write_racing_a_harvest_may_be_reported_by_it() {
        let o = DirtyLogOracle::new(0, 64);
        o.logging_enabled();
        let k = o.begin_harvest();
        let s = o.before_write();
        o.after_write(9, s);
        o.record_report(k, 0, &[1 << 9]);
        assert!(o.end_harvest(k).lost.is_empty());
        let k2 = o.begin_harvest();
        o.record_report(k2, 0, &[0]);
        assert!(
            o.end_harvest(k2).lost.is_empty(),
            "covered by the harvest it raced with"
        );
    }
}
