//! The memstress guest (KVM selftests' `memstress_guest_code()`): each pass touches the first
//! 8 bytes of every 4 KiB page of the vCPU's region, in order or at random, writing with a given
//! probability and reading otherwise.

/// The selftests' guest RNG (`guest_random_u32()`): Park–Miller with the standard constants.
#[derive(Clone, Debug)]
pub struct GuestRandom {
    seed: u32,
}

impl GuestRandom {
    /// `new_guest_random_state(seed)`.
    pub fn new(seed: u32) -> Self {
        GuestRandom { seed }
    }

    /// `guest_random_u32()`.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        self.seed = ((self.seed as u64 * PARK_MILLER_A) % PARK_MILLER_M) as u32;
        self.seed
    }

    /// `n` draws made at once: the state times `48271^n` modulo `2^31 - 1`.
    pub fn skip(&mut self, mut n: u64) {
        let (mut state, mut a) = (self.seed as u64, PARK_MILLER_A);
        while n > 0 {
            if n & 1 == 1 {
                state = state * a % PARK_MILLER_M;
            }
            a = a * a % PARK_MILLER_M;
            n >>= 1;
        }
        self.seed = state as u32;
    }
}

/// Park–Miller's multiplier (the "minimal standard" revised: 48271) and modulus.
const PARK_MILLER_A: u64 = 48271;
const PARK_MILLER_M: u64 = (1 << 31) - 1;

/// One vCPU's share of the test region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuRegion {
    /// First gfn the vCPU touches.
    pub base_gfn: u64,
    /// Pages it touches per pass.
    pub pages: u64,
}

/// `memstress_setup_vcpus()`: partitioned regions, or the whole region for every vCPU.
pub fn vcpu_regions(
    test_base_gfn: u64,
    nr_vcpus: usize,
    pages_per_vcpu: u64,
    partition: bool,
) -> Vec<VcpuRegion> {
    (0..nr_vcpus)
        .map(|i| {
            if partition {
                VcpuRegion {
                    base_gfn: test_base_gfn + i as u64 * pages_per_vcpu,
                    pages: pages_per_vcpu,
                }
            } else {
                VcpuRegion {
                    base_gfn: test_base_gfn,
                    pages: pages_per_vcpu * nr_vcpus as u64,
                }
            }
        })
        .collect()
}

/// Where a vCPU is in one pass, without borrowing its RNG (an actor that is suspended between
/// accesses keeps this and its [`GuestRandom`]).
#[derive(Clone, Debug)]
pub struct PassCursor {
    pages: u64,
    i: u64,
    random_access: bool,
    write_percent: u32,
}

impl PassCursor {
    /// The start of a pass over `pages` pages.
    pub fn new(pages: u64, random_access: bool, write_percent: u32) -> Self {
        PassCursor {
            pages,
            i: 0,
            random_access,
            write_percent,
        }
    }

    /// Where a pass whose accesses are all writes of its pages in order is: the next page's
    /// index and how many are left. `None` when its pages come at random or some accesses may
    /// read (the write draw is still made for each, and always passes).
    pub fn ascending_writes(&self) -> Option<(u64, u64)> {
        (!self.random_access && self.write_percent >= 100).then_some((self.i, self.pages - self.i))
    }

    /// The next access `(page index within the region, write?)`, drawn exactly as the guest code
    /// draws it: one RNG draw for the page when random, then one for the write decision, for
    /// every access.
    #[inline]
    pub fn next(&mut self, rng: &mut GuestRandom) -> Option<(u64, bool)> {
        if self.i == self.pages {
            return None;
        }
        let page = if self.random_access {
            rng.next_u32() as u64 % self.pages
        } else {
            self.i
        };
        self.i += 1;
        let write = rng.next_u32() % 100 < self.write_percent;
        Some((page, write))
    }

    /// The next `n` accesses of a pass of writes in order ([`PassCursor::ascending_writes`]
    /// says how many are left), skipped: their draws are made at once.
    pub fn skip_ascending_writes(&mut self, n: u64, rng: &mut GuestRandom) {
        debug_assert!(self.ascending_writes().is_some_and(|(_, left)| n <= left));
        self.i += n;
        rng.skip(n);
    }
}

/// The access sequence of one pass as an iterator over a borrowed RNG.
pub struct PassAccesses<'a> {
    rng: &'a mut GuestRandom,
    cursor: PassCursor,
}

impl<'a> PassAccesses<'a> {
    /// The accesses of one pass over `pages` pages.
    pub fn new(
        rng: &'a mut GuestRandom,
        pages: u64,
        random_access: bool,
        write_percent: u32,
    ) -> Self {
        PassAccesses {
            rng,
            cursor: PassCursor::new(pages, random_access, write_percent),
        }
    }
}

impl Iterator for PassAccesses<'_> {
    type Item = (u64, bool);
    #[inline]
    fn next(&mut self) -> Option<(u64, bool)> {
        self.cursor.next(self.rng)
    }
}

/// The value a vCPU writes in a pass: changes every pass so lost updates are visible to the
/// content oracles (the selftest writes a constant; nothing else differs).
pub fn pass_value(iteration: i64, vcpu: usize) -> u64 {
    ((iteration as u64 & 0xffff_ffff) << 32) | (vcpu as u64 & 0xffff) << 16 | 0x5a5a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn park_miller_matches_the_selftest_constants() {
        let mut r = GuestRandom::new(1);
        assert_eq!(r.next_u32(), 48271);
        assert_eq!(r.next_u32(), 182605794);
    }

    #[test]
    fn draws_skipped_at_once_are_the_draws_one_by_one() {
        for (seed, n) in [
            (1, 0),
            (1, 1),
            (7, 2),
            (12345, 63),
            (u32::MAX >> 1, 1_000_003),
        ] {
            let (mut one, mut skipped) = (GuestRandom::new(seed), GuestRandom::new(seed));
            (0..n).for_each(|_| {
                one.next_u32();
            });
            skipped.skip(n);
            assert_eq!(skipped.next_u32(), one.next_u32(), "seed {seed}, {n} draws");
        }
        let mut cursor = PassCursor::new(100, false, 100);
        let (mut rng, mut other) = (GuestRandom::new(3), GuestRandom::new(3));
        cursor.skip_ascending_writes(40, &mut rng);
        let mut one = PassCursor::new(100, false, 100);
        (0..40).for_each(|_| {
            one.next(&mut other);
        });
        assert_eq!(cursor.next(&mut rng), one.next(&mut other));
        assert_eq!(rng.next_u32(), other.next_u32());
    }

    #[test]
    fn regions_partition_or_overlap() {
        let p = vcpu_regions(100, 3, 10, true);
        assert_eq!(
            p[2],
            VcpuRegion {
                base_gfn: 120,
                pages: 10
            }
        );
        let o = vcpu_regions(100, 3, 10, false);
        assert!(o.iter().all(|r| *r
            == VcpuRegion {
                base_gfn: 100,
                pages: 30
            }));
    }

    #[test]
    fn sequential_pass_visits_every_page_once_and_write_percent_holds() {
        let mut rng = GuestRandom::new(7);
        let acc: Vec<_> = PassAccesses::new(&mut rng, 1000, false, 100).collect();
        assert_eq!(acc.len(), 1000);
        assert!(acc
            .iter()
            .enumerate()
            .all(|(i, (p, w))| *p == i as u64 && *w));
        let writes = PassAccesses::new(&mut rng, 10000, true, 30)
            .filter(|a| a.1)
            .count();
        assert!(
            (2500..3500).contains(&writes),
            "{writes} writes of 10000 at 30%"
        );
        assert_eq!(
            PassAccesses::new(&mut rng, 100, true, 0)
                .filter(|a| a.1)
                .count(),
            0
        );
    }
}
