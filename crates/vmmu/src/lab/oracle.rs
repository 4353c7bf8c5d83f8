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

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The oracle over a contiguous range of guest pages.
pub struct DirtyLogOracle {
    base_gfn: u64,
    gen: AtomicU32,
    harvest: AtomicU32,
    /// Per page: `s << 32 | c` of the latest completed write.
    writes: Box<[AtomicU64]>,
    /// Per page: the last harvest that reported it.
    reported: Box<[AtomicU32]>,
}

/// What one check found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OracleCheck {
    /// Written pages whose report was checked.
    pub checked: u64,
    /// Gfns that should have been reported and were not.
    pub lost: Vec<u64>,
}

impl DirtyLogOracle {
    /// An oracle for pages `[base_gfn, base_gfn + npages)`.
    pub fn new(base_gfn: u64, npages: u64) -> Self {
        DirtyLogOracle {
            base_gfn,
            gen: AtomicU32::new(0),
            harvest: AtomicU32::new(0),
            writes: (0..npages).map(|_| AtomicU64::new(0)).collect(),
            reported: (0..npages).map(|_| AtomicU32::new(0)).collect(),
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
        let c = self.gen.load(Ordering::SeqCst);
        self.writes[(gfn - self.base_gfn) as usize]
            .store((s as u64) << 32 | c as u64, Ordering::Relaxed);
    }

    /// A harvest (GET, and CLEAR in manual-protect mode) begins; returns its number.
    pub fn begin_harvest(&self) -> u32 {
        let k = self.harvest.fetch_add(1, Ordering::SeqCst) + 1;
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
        for (i, w) in self.writes.iter().enumerate() {
            let w = w.load(Ordering::Relaxed);
            let (s, c) = ((w >> 32) as u32, w as u32);
            // s < 2: written before logging was enabled; c > 2k: completed after k began.
            if s < 2 || c > 2 * k {
                continue;
            }
            out.checked += 1;
            if self.reported[i].load(Ordering::Relaxed) < s / 2 {
                out.lost.push(self.base_gfn + i as u64);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
                lost: vec![1070]
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
