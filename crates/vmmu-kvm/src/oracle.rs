//! The dirty-log completeness oracle for real KVM, and the bitmap helpers it needs.
//!
//! The host knows exactly which pages the memstress guest writes in each pass: the guest's
//! choices come from the selftests' `guest_random_u32()` seeded by the host, so the host
//! replays the same sequence with the model's own definitions
//! ([`vmmu::lab::memstress::GuestRandom`] and [`vmmu::lab::memstress::PassAccesses`]). Every
//! page written in a pass must show up in the harvest that follows the pass (the
//! `KVM_GET_DIRTY_LOG` bitmap, or the dirty-ring entries); a page that does not is *lost*,
//! which is exactly the bug a missing write-protect or a missed flush causes.

use vmmu::lab::report::OracleReport;

/// How many lost gfns a report lists.
pub const MAX_LOST_LISTED: usize = 16;

/// Words of a bitmap with one bit per page.
pub fn bitmap_words(pages: u64) -> usize {
    pages.div_ceil(64) as usize
}

/// Sets bit `i`; bits past the end are ignored.
pub fn set_bit(bitmap: &mut [u64], i: u64) {
    if let Some(w) = bitmap.get_mut((i / 64) as usize) {
        *w |= 1 << (i % 64);
    }
}

/// Whether bit `i` is set (false past the end).
pub fn test_bit(bitmap: &[u64], i: u64) -> bool {
    bitmap
        .get((i / 64) as usize)
        .is_some_and(|w| w & (1 << (i % 64)) != 0)
}

/// Number of set bits.
pub fn count_ones(bitmap: &[u64]) -> u64 {
    bitmap.iter().map(|w| w.count_ones() as u64).sum()
}

/// Indices of the set bits, in increasing order.
pub fn iter_ones(bitmap: &[u64]) -> impl Iterator<Item = u64> + '_ {
    bitmap.iter().enumerate().flat_map(|(wi, &w)| {
        let mut w = w;
        std::iter::from_fn(move || {
            if w == 0 {
                return None;
            }
            let b = w.trailing_zeros() as u64;
            w &= w - 1;
            Some(wi as u64 * 64 + b)
        })
    })
}

/// Copies `src` (bits `0..pages`) into `dst` starting at bit `at`.
pub fn splice_bits(dst: &mut [u64], at: u64, src: &[u64], pages: u64) {
    for i in iter_ones(src).take_while(|&i| i < pages) {
        set_bit(dst, at + i);
    }
}

/// Accumulates the oracle's verdict over a run.
#[derive(Clone, Debug, Default)]
pub struct Oracle {
    report: OracleReport,
}

impl Oracle {
    /// A fresh oracle with nothing checked.
    pub fn new() -> Self {
        Oracle::default()
    }

    /// Checks one harvest: every bit of `written` (pages written before the harvest began)
    /// must be set in `harvested`. `gfn_of` turns a bit index into the gfn reported for a
    /// lost page. Returns the number of pages lost by this harvest.
    pub fn check_harvest(
        &mut self,
        written: &[u64],
        harvested: &[u64],
        gfn_of: impl Fn(u64) -> u64,
    ) -> u64 {
        let r = &mut self.report;
        r.harvests_checked += 1;
        let mut lost = 0;
        for (wi, &w) in written.iter().enumerate() {
            r.pages_checked += w.count_ones() as u64;
            let missing = w & !harvested.get(wi).copied().unwrap_or(0);
            if missing == 0 {
                continue;
            }
            lost += missing.count_ones() as u64;
            for b in iter_ones(&[missing]) {
                if r.lost_gfns.len() < MAX_LOST_LISTED {
                    r.lost_gfns.push(gfn_of(wi as u64 * 64 + b));
                }
            }
        }
        r.lost_pages += lost;
        lost
    }

    /// Records a problem found by a consistency check other than completeness (for example
    /// guest memory that does not hold what the replay says the guest wrote).
    pub fn add_error(&mut self, msg: String) {
        self.report.invariant_errors.push(msg);
    }

    /// The verdict so far.
    pub fn report(&self) -> &OracleReport {
        &self.report
    }

    /// The verdict.
    pub fn into_report(self) -> OracleReport {
        self.report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_helpers_agree() {
        let mut bm = vec![0u64; bitmap_words(130)];
        assert_eq!(bm.len(), 3);
        for i in [0, 63, 64, 129] {
            set_bit(&mut bm, i);
        }
        set_bit(&mut bm, 10_000); // ignored
        assert!(test_bit(&bm, 63) && test_bit(&bm, 129) && !test_bit(&bm, 1));
        assert!(!test_bit(&bm, 10_000));
        assert_eq!(count_ones(&bm), 4);
        assert_eq!(iter_ones(&bm).collect::<Vec<_>>(), vec![0, 63, 64, 129]);
        let mut dst = vec![0u64; 4];
        splice_bits(&mut dst, 100, &bm, 100);
        assert_eq!(iter_ones(&dst).collect::<Vec<_>>(), vec![100, 163, 164]);
    }

    #[test]
    fn oracle_lists_lost_pages_and_counts_checks() {
        let mut o = Oracle::new();
        let written = vec![0b1011u64, 1 << 5];
        let harvested = vec![0b0011u64, 0];
        let lost = o.check_harvest(&written, &harvested, |i| 0x100000 + i);
        assert_eq!(lost, 2);
        let r = o.report();
        assert_eq!(r.lost_gfns, vec![0x100003, 0x100000 + 64 + 5]);
        assert_eq!(
            (r.pages_checked, r.harvests_checked, r.lost_pages),
            (4, 1, 2)
        );
        assert!(!r.passed());
        let mut ok = Oracle::new();
        ok.check_harvest(&written, &[u64::MAX, u64::MAX], |i| i);
        assert!(ok.report().passed());
        // Lost gfns are capped but all are counted.
        let mut many = Oracle::new();
        many.check_harvest(&[u64::MAX], &[], |i| i);
        assert_eq!(many.report().lost_gfns.len(), MAX_LOST_LISTED);
        assert_eq!(many.report().lost_pages, 64);
    }
}
