//! The dirty-log completeness oracle for real KVM, and the bitmap helpers it needs.
//!
//! The host knows exactly which pages the memstress guest writes in each pass: the guest's
//! choices come from a 32-bit LCG whose seed the host gave it, so the host replays the same
//! sequence ([`GuestReplay`]). Every page written in a pass must show up in the harvest that
//! follows the pass (the `KVM_GET_DIRTY_LOG` bitmap, or the dirty-ring entries); a page that
//! does not is *lost*, which is exactly the bug a missing write-protect or a missed flush
//! causes.

use crate::guest::lcg_next;
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

/// The host's replay of one vCPU's memstress guest: the same LCG, seeded the same way
/// (`random_seed + vcpu_idx`), stepped the same number of times per page.
#[derive(Clone, Debug)]
pub struct GuestReplay {
    state: u32,
}

impl GuestReplay {
    /// The replay of vCPU `vcpu` for a run with `random_seed`.
    pub fn new(random_seed: u32, vcpu: usize) -> Self {
        GuestReplay {
            state: random_seed.wrapping_add(vcpu as u32),
        }
    }

    /// The LCG state now (what the guest's EBX holds between passes).
    pub fn state(&self) -> u32 {
        self.state
    }

    /// Replays one pass over `pages` pages, calling `access(page, is_write)` for every access
    /// in the guest's order.
    pub fn pass(
        &mut self,
        pages: u32,
        write_percent: u32,
        random: bool,
        mut access: impl FnMut(u64, bool),
    ) {
        for i in 0..pages {
            let page = if random {
                self.state = lcg_next(self.state);
                self.state % pages
            } else {
                i
            };
            self.state = lcg_next(self.state);
            access(page as u64, self.state % 100 < write_percent);
        }
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
    fn sequential_full_write_replay_touches_every_page_once() {
        let mut r = GuestReplay::new(1, 0);
        let mut seen = vec![];
        r.pass(5, 100, false, |p, w| {
            assert!(w);
            seen.push(p)
        });
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);
        // One LCG step per page in sequential mode.
        let mut s = 1u32;
        for _ in 0..5 {
            s = lcg_next(s);
        }
        assert_eq!(r.state(), s);
    }

    #[test]
    fn random_replay_steps_twice_per_page_and_respects_write_percent() {
        let mut r = GuestReplay::new(7, 2);
        let (mut writes, mut reads) = (0, 0);
        r.pass(1000, 30, true, |p, w| {
            assert!(p < 1000);
            if w {
                writes += 1
            } else {
                reads += 1
            }
        });
        assert_eq!(writes + reads, 1000);
        assert!((200..400).contains(&writes), "{writes}");
        let mut s = 9u32;
        for _ in 0..2000 {
            s = lcg_next(s);
        }
        assert_eq!(r.state(), s);
        let mut none = GuestReplay::new(1, 0);
        none.pass(100, 0, false, |_, w| assert!(!w));
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
