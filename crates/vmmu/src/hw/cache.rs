//! Data caches at cache-line granularity: a core's private L2 and its socket's shared
//! last-level cache, each set-associative with least-recently-used replacement, and the named
//! parts' geometries ([`CacheGeometry`]). What touches them, and what a line that misses costs,
//! is the kvm layer's (`crate::kvm::host_caches`).
//!
//! Where a line goes: a private cache indexes its sets with the line address's low bits; a
//! sliced last-level cache picks the slice with a hash of the address and the set within the
//! slice with the low bits (Skylake-SP: bits 6–16 for its 2048 sets a slice; Maurice et al.,
//! "Reverse Engineering Intel Last-Level Cache Complex Addressing Using Performance
//! Counters", RAID 2015). So lines at one offset within 4 KiB pages (bits 6–11 equal) share
//! 1/64 of every slice's sets, whatever the pages: a guest that touches the first word of each
//! page, as the selftests' memstress guest does, sweeps only that 64th of the cache. Intel's
//! slice hash is an undocumented XOR of address bits; any hash that spreads consecutive lines
//! over the slices serves here (simplified).
//!
//! Simplified: Skylake-SP's last-level cache is non-inclusive (the L2's victims fill it); here
//! every miss fills both levels, so one core sees the last-level cache's capacity, not the sum
//! of both. Dirty lines are not told apart (a write-back costs nothing here).

/// log2 of the cache line size.
pub const LINE_SHIFT: u32 = 6;

/// A cache's shape: `slices` × `sets_per_slice` sets of `ways` lines.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CacheGeometry {
    /// The part and level.
    pub name: &'static str,
    /// Slices a hash of the address chooses between (1: a private cache).
    pub slices: u32,
    /// Sets in each slice, a power of two, indexed by the line address's low bits.
    pub sets_per_slice: u32,
    /// Lines per set.
    pub ways: u32,
}

impl CacheGeometry {
    /// Capacity in bytes.
    pub const fn bytes(&self) -> u64 {
        (self.slices as u64 * self.sets_per_slice as u64 * self.ways as u64) << LINE_SHIFT
    }

    fn nr_sets(&self) -> usize {
        self.slices as usize * self.sets_per_slice as usize
    }

    /// The set `line` maps to: the slice from a hash of the whole address, the set within
    /// the slice from its low bits.
    #[inline]
    pub fn set_of(&self, line: u64) -> usize {
        let within = (line & (self.sets_per_slice as u64 - 1)) as usize;
        if self.slices == 1 {
            return within;
        }
        // A multiplicative hash of the line address (simplified: see the module docs), mapped
        // onto the slices by multiplying rather than dividing.
        let hash = line.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let slice = ((hash * self.slices as u64) >> 32) as usize;
        slice * self.sets_per_slice as usize + within
    }
}

/// A Skylake-SP / Cascade Lake core's L2: 1 MiB, 16-way (AnandTech, "The Intel Skylake-X
/// Review", Jun 2017, "I Keep My Cache Private": 1 MB 16-way, 11–13 cycles).
pub const SKYLAKE_SP_L2: CacheGeometry = CacheGeometry {
    name: "Cascade Lake L2",
    slices: 1,
    sets_per_slice: 1024,
    ways: 16,
};

/// A Xeon Platinum 8275CL socket's last-level cache: 35.75 MB in 26 slices of 1.375 MiB, 11-way
/// (Intel ARK: 35.75 MB; AnandTech, "The Intel Skylake-X Review": 1.375 MB a slice, 11-way,
/// non-inclusive), so 2048 sets a slice.
pub const CASCADE_LAKE_8275CL_LLC: CacheGeometry = CacheGeometry {
    name: "Xeon Platinum 8275CL LLC",
    slices: 26,
    sets_per_slice: 2048,
    ways: 11,
};

/// A Neoverse-N1 core's L2 as the Ampere Altra builds it: 1 MiB (AnandTech, "The Ampere Altra
/// Review", Dec 2020), 8-way (Arm Neoverse N1 TRM, "L2 memory system": 8-way set
/// associative).
pub const NEOVERSE_N1_L2: CacheGeometry = CacheGeometry {
    name: "Neoverse-N1 L2",
    slices: 1,
    sets_per_slice: 2048,
    ways: 8,
};

/// The Ampere Altra's system-level cache: 32 MB (AnandTech, "The Ampere Altra Review") in the
/// CMN-600 mesh's home nodes, whose SLC is 16-way (Arm CMN-600 TRM); 32 slices of 1 MiB is
/// an estimate of how it is split.
pub const ALTRA_SLC: CacheGeometry = CacheGeometry {
    name: "Ampere Altra SLC",
    slices: 32,
    sets_per_slice: 1024,
    ways: 16,
};

/// A host's data caches: each core's L2 and each socket's last-level cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HostCacheShape {
    /// A core's private L2.
    pub l2: &'static CacheGeometry,
    /// A socket's last-level cache.
    pub llc: &'static CacheGeometry,
}

impl HostCacheShape {
    /// The memory the model of these caches takes once used: each socket's LLC and the L2s
    /// of `cores` cores, a tag (8 bytes) and a stamp (4) a line, and a count (4) and a head (1)
    /// a set ([`Cache`]).
    pub fn model_bytes(&self, sockets: u32, cores: u32) -> u64 {
        let tags = |g: &CacheGeometry| (g.bytes() >> LINE_SHIFT) * 12 + g.nr_sets() as u64 * 5;
        sockets as u64 * tags(self.llc) + cores as u64 * tags(self.l2)
    }
}

/// The x86 hosts' caches: Cascade Lake cores (2 x Xeon Platinum 8275CL, as `cost::Host`).
pub const CASCADE_LAKE_8275CL: HostCacheShape = HostCacheShape {
    l2: &SKYLAKE_SP_L2,
    llc: &CASCADE_LAKE_8275CL_LLC,
};

/// The arm64 host's caches: an Ampere Altra's Neoverse-N1 cores and system-level cache.
pub const AMPERE_ALTRA: HostCacheShape = HostCacheShape {
    l2: &NEOVERSE_N1_L2,
    llc: &ALTRA_SLC,
};

/// One cache: `ways` line tags a set, most recently used first from the set's head and round
/// (0: an empty way), and lines nobody reads again, counted rather than tagged
/// ([`Cache::insert_anonymous`]).
///
/// Least-recently-used replacement with both kinds: a named line is still held while fewer
/// than `ways` lines were used after it, that is, the named lines before it in its set's list
/// plus the anonymous lines inserted into the set since its last use (its stamp). So the
/// guest's stream of fresh lines, which is most of what passes through the caches, costs one
/// counter per set instead of a tag shuffle, exactly as the tags would have it as long as no
/// anonymous line is read again while still held (simplified: the guest's re-reads of a line
/// the cache still holds count as new lines).
#[derive(Clone, Debug)]
pub struct Cache {
    geometry: &'static CacheGeometry,
    tags: Vec<u64>,
    /// Per tag: the set's anonymous count when the line was last used.
    stamps: Vec<u32>,
    /// Per set: anonymous lines inserted so far.
    anonymous: Vec<u32>,
    /// Per set: the way its most recently used line is in. Position `p` of the set's list (0
    /// the most recently used) is way `(head + p) % ways`, so a miss writes the new line over
    /// the least recently used one and moves the head back, and no other tag moves.
    heads: Vec<u8>,
}

impl Cache {
    /// An empty cache of `geometry`'s shape.
    pub fn new(geometry: &'static CacheGeometry) -> Self {
        debug_assert!(geometry.sets_per_slice.is_power_of_two());
        assert!(
            (1..=256).contains(&geometry.ways),
            "{}: a set's head is one byte",
            geometry.name
        );
        let lines = geometry.nr_sets() * geometry.ways as usize;
        Cache {
            geometry,
            tags: vec![0; lines],
            stamps: vec![0; lines],
            anonymous: vec![0; geometry.nr_sets()],
            heads: vec![0; geometry.nr_sets()],
        }
    }

    /// The cache's shape.
    pub fn geometry(&self) -> &'static CacheGeometry {
        self.geometry
    }

    /// The set `line` maps to ([`CacheGeometry::set_of`]).
    #[inline]
    fn set_of(&self, line: u64) -> usize {
        self.geometry.set_of(line)
    }

    /// The index in `tags` of position `pos` of set `set`'s list.
    #[inline]
    fn slot(&self, set: usize, pos: usize) -> usize {
        let ways = self.geometry.ways as usize;
        let way = self.heads[set] as usize + pos;
        set * ways + if way >= ways { way - ways } else { way }
    }

    /// Where `tag` is in set `set`: its list position and its index in `tags`.
    #[inline]
    fn find(&self, set: usize, tag: u64) -> Option<(usize, usize)> {
        let ways = self.geometry.ways as usize;
        let base = set * ways;
        let way = self.tags[base..base + ways]
            .iter()
            .position(|&t| t == tag)?;
        let head = self.heads[set] as usize;
        let pos = if way >= head {
            way - head
        } else {
            way + ways - head
        };
        Some((pos, base + way))
    }

    /// Whether the line at list position `pos` of set `set` (index `i` in `tags`) is still
    /// held: fewer than `ways` named lines before it and anonymous lines since its last use.
    #[inline]
    fn valid(&self, set: usize, pos: usize, i: usize) -> bool {
        let since = self.anonymous[set].wrapping_sub(self.stamps[i]) as usize;
        self.tags[i] != 0 && pos + since < self.geometry.ways as usize
    }

    /// An access to `line` (a byte address shifted by [`LINE_SHIFT`]): true when the cache
    /// held it. Either way it is the set's most recently used line afterwards; a miss evicts
    /// the least recently used one.
    #[inline]
    pub fn access(&mut self, line: u64) -> bool {
        let tag = line + 1;
        let set = self.set_of(line);
        let ways = self.geometry.ways as usize;
        let found = self.find(set, tag);
        let hit = found.is_some_and(|(pos, i)| self.valid(set, pos, i));
        match found {
            Some((pos, _)) if pos < ways - 1 => {
                // Move the positions before it down one.
                for p in (1..=pos).rev() {
                    let (to, from) = (self.slot(set, p), self.slot(set, p - 1));
                    self.tags[to] = self.tags[from];
                    self.stamps[to] = self.stamps[from];
                }
                let first = self.slot(set, 0);
                self.tags[first] = tag;
                self.stamps[first] = self.anonymous[set];
            }
            // A miss, or a hit in the last position.
            _ => self.replace_last(set, tag),
        }
        hit
    }

    /// The last position of `set` becomes the first, holding `tag` (the head moves back one
    /// way): an access that misses (evicting the least recently used line), or that hits
    /// the last position.
    #[inline]
    fn replace_last(&mut self, set: usize, tag: u64) {
        let ways = self.geometry.ways as usize;
        let head = self.heads[set] as usize;
        self.heads[set] = if head == 0 { ways - 1 } else { head - 1 } as u8;
        let first = self.slot(set, 0);
        self.tags[first] = tag;
        self.stamps[first] = self.anonymous[set];
    }

    /// [`Cache::access`] of a line no access has named before (so the cache cannot hold
    /// it): it misses and becomes its set's most recently used line, without the search.
    #[inline]
    pub fn insert_new(&mut self, line: u64) {
        let set = self.set_of(line);
        debug_assert!(
            self.find(set, line + 1).is_none(),
            "line {line:#x} was named before"
        );
        self.replace_last(set, line + 1);
    }

    /// A line nobody will read again while the cache holds it enters as the most recently
    /// used one (a guest's fresh line): counted in its set, pushing the named lines down.
    #[inline]
    pub fn insert_anonymous(&mut self, line: u64) {
        self.insert_anonymous_in(self.set_of(line));
    }

    /// [`Cache::insert_anonymous`] of a line of set `set` ([`CacheGeometry::set_of`]): only
    /// the set matters, and the count commutes with every other line's.
    #[inline]
    pub fn insert_anonymous_in(&mut self, set: usize) {
        self.anonymous[set] = self.anonymous[set].wrapping_add(1);
    }

    /// Whether the cache holds `line`, without using it.
    pub fn holds(&self, line: u64) -> bool {
        let set = self.set_of(line);
        self.find(set, line + 1)
            .is_some_and(|(pos, i)| self.valid(set, pos, i))
    }
}

/// Where an access found its line.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// The core's own L2 (or closer).
    L2,
    /// The socket's last-level cache.
    Llc,
    /// Memory.
    Memory,
}

/// What reading one line of KVM's data costs beyond a read from the core's L2 (the software
/// costs are measured with their data there), as the kvm layer's model of the host's caches
/// prices it: each variant but `Free` is one count of a `Meter` field of the same name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LineCost {
    /// Found in the core's L2, or in flight from the LLC behind a running prefetch stream.
    Free,
    /// `llc_hits`: from the socket's LLC at its latency.
    LlcHit,
    /// `memory_lines`: from the socket's own memory at its latency.
    Memory,
    /// `memory_lines_streamed`: from the socket's memory behind a running prefetch stream.
    MemoryStreamed,
    /// `remote_memory_lines`: from the other socket's memory at its latency.
    RemoteMemory,
    /// `remote_memory_lines_streamed`: the same behind a running prefetch stream.
    RemoteMemoryStreamed,
}

/// The host's caches: each socket's last-level cache and the L2 of every core that touched
/// something, created on its first access.
#[derive(Debug)]
pub struct CacheHierarchy {
    l2_geometry: &'static CacheGeometry,
    l2: Vec<Option<Cache>>,
    llc: Vec<Cache>,
}

impl CacheHierarchy {
    /// Empty caches: an L2 of `l2`'s shape for each core, an LLC of `llc`'s for each of
    /// `sockets` sockets.
    pub fn new(l2: &'static CacheGeometry, llc: &'static CacheGeometry, sockets: usize) -> Self {
        CacheHierarchy {
            l2_geometry: l2,
            l2: Vec::new(),
            llc: (0..sockets.max(1)).map(|_| Cache::new(llc)).collect(),
        }
    }

    /// Core `core` of socket `socket` accesses `line`: its L2, then its socket's LLC, then
    /// memory; the line is in both caches afterwards.
    pub fn access(&mut self, core: usize, socket: usize, line: u64) -> Served {
        let (l2, llc) = self.levels(core, socket);
        if l2.access(line) {
            // Both levels are filled on a miss (module docs); an L2 hit does not reach the
            // LLC, whose replacement state it leaves as it was (as a non-inclusive LLC's is).
            return Served::L2;
        }
        if llc.access(line) {
            Served::Llc
        } else {
            Served::Memory
        }
    }

    /// [`CacheHierarchy::access`] by `core` of a line no access has named before: it
    /// misses both levels and fills both ([`Cache::insert_new`]), as it comes from memory.
    pub fn insert_new(&mut self, core: usize, socket: usize, line: u64) {
        let (l2, llc) = self.levels(core, socket);
        l2.insert_new(line);
        llc.insert_new(line);
    }

    /// The L2 of `core` (made on its first use) and the LLC of `socket` (a socket the caches
    /// were not built with shares the last one's).
    #[inline]
    fn levels(&mut self, core: usize, socket: usize) -> (&mut Cache, &mut Cache) {
        let socket = socket.min(self.llc.len() - 1);
        if core >= self.l2.len() {
            self.l2.resize_with(core + 1, || None);
        }
        let geometry = self.l2_geometry;
        let l2 = self.l2[core].get_or_insert_with(|| Cache::new(geometry));
        (l2, &mut self.llc[socket])
    }

    /// Fresh lines of LLC sets `sets` ([`CacheGeometry::set_of`]) that bypass the L2s (the
    /// guest's, see `crate::kvm::host_caches`) fill socket `socket`'s LLC as anonymous lines
    /// ([`Cache::insert_anonymous`]).
    pub fn insert_llc_anonymous_in(&mut self, socket: usize, sets: &[u32]) {
        let socket = socket.min(self.llc.len() - 1);
        let llc = &mut self.llc[socket];
        for &set in sets {
            llc.insert_anonymous_in(set as usize);
        }
    }

    /// Whether socket `socket`'s LLC holds `line` (tests and reports).
    pub fn llc_holds(&self, socket: usize, line: u64) -> bool {
        self.llc[socket].holds(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: CacheGeometry = CacheGeometry {
        name: "tiny",
        slices: 1,
        sets_per_slice: 4,
        ways: 2,
    };

    #[test]
    fn a_new_line_fills_its_set_as_an_access_that_misses_does() {
        let g: &'static CacheGeometry = Box::leak(Box::new(CacheGeometry {
            name: "11-way, 3 slices",
            slices: 3,
            sets_per_slice: 4,
            ways: 11,
        }));
        let (mut accessed, mut inserted) = (Cache::new(g), Cache::new(g));
        let mut rng = crate::lab::memstress::GuestRandom::new(5);
        // Lines below `next` were named before; `next` is new.
        let mut next = 0u64;
        for _ in 0..20_000 {
            let r = rng.next_u32();
            match r % 4 {
                0 | 1 => {
                    assert!(!accessed.access(next), "a new line misses");
                    inserted.insert_new(next);
                    next += 1;
                }
                2 if next > 0 => {
                    let line = u64::from(r >> 8) % next;
                    assert_eq!(accessed.access(line), inserted.access(line), "line {line}");
                }
                _ => {
                    accessed.insert_anonymous(u64::from(r >> 8));
                    inserted.insert_anonymous(u64::from(r >> 8));
                }
            }
        }
        assert!((0..next).all(|l| accessed.holds(l) == inserted.holds(l)));
        assert!((0..next).filter(|&l| accessed.holds(l)).count() > 50);
    }

    #[test]
    fn the_ways_and_heads_replace_as_a_list_moved_whole_does() {
        for g in [
            TINY,
            CacheGeometry {
                name: "16-way",
                slices: 1,
                sets_per_slice: 2,
                ways: 16,
            },
            CacheGeometry {
                name: "11-way",
                slices: 1,
                sets_per_slice: 4,
                ways: 11,
            },
        ] {
            let g: &'static CacheGeometry = Box::leak(Box::new(g));
            let (ways, sets) = (g.ways as usize, g.nr_sets());
            let mut c = Cache::new(g);
            // The replacement as a list per set, most recently used first, moved whole on
            // every access, kept full (an empty way is a line nobody uses, never held).
            let mut lists: Vec<Vec<(u64, u32, bool)>> = vec![vec![(0, 0, false); ways]; sets];
            let mut anonymous = vec![0u32; sets];
            let mut rng = crate::lab::memstress::GuestRandom::new(11);
            for step in 0..200_000 {
                let r = rng.next_u32();
                let line = u64::from(r >> 8) % (ways as u64 * sets as u64 * 2);
                let set = c.set_of(line);
                if r.is_multiple_of(8) {
                    c.insert_anonymous(line);
                    anonymous[set] = anonymous[set].wrapping_add(1);
                    continue;
                }
                let list = &mut lists[set];
                let found = list.iter().position(|&(t, _, named)| named && t == line);
                let held =
                    |p: usize, stamp: u32| p + (anonymous[set].wrapping_sub(stamp) as usize) < ways;
                let hit = found.is_some_and(|p| held(p, list[p].1));
                list.remove(found.unwrap_or(ways - 1));
                list.insert(0, (line, anonymous[set], true));
                assert_eq!(c.access(line), hit, "{} step {step}: line {line}", g.name);
                if r.is_multiple_of(5) {
                    for l in 0..ways as u64 * sets as u64 * 2 {
                        let s = c.set_of(l);
                        let want = lists[s]
                            .iter()
                            .position(|&(t, _, n)| n && t == l)
                            .is_some_and(|p| {
                                p + (anonymous[s].wrapping_sub(lists[s][p].1) as usize) < ways
                            });
                        assert_eq!(c.holds(l), want, "{} step {step}: holds {l}", g.name);
                    }
                }
            }
        }
    }

    #[test]
    fn lru_within_a_set_evicts_the_least_recently_used_line() {
        let mut c = Cache::new(&TINY);
        // Lines 0, 4 and 8 share set 0.
        assert!(!c.access(0));
        assert!(!c.access(4));
        assert!(c.access(0), "still there");
        assert!(!c.access(8), "evicts 4, the least recently used");
        assert!(c.holds(0) && c.holds(8) && !c.holds(4));
        assert!(!c.holds(1), "other sets are untouched");
    }

    #[test]
    fn anonymous_lines_push_named_ones_out_as_tags_would() {
        let mut c = Cache::new(&TINY);
        // Set 0 holds 0 and 4; one fresh line makes 4 (the older) the least recently used
        // of three, so it is gone; 0 is still held, and using it again makes it the newest.
        c.access(4);
        c.access(0);
        c.insert_anonymous(8);
        assert!(c.holds(0) && !c.holds(4));
        assert!(c.access(0));
        c.insert_anonymous(12);
        assert!(c.holds(0), "one line used since: still held");
        c.insert_anonymous(16);
        assert!(!c.holds(0), "two lines since, in a 2-way set");
        assert!(!c.access(0));
        assert!(c.holds(0), "back as the newest");
        c.insert_anonymous(1);
        assert!(c.holds(0), "another set's line changes nothing here");
    }

    #[test]
    fn a_region_that_fits_stays_and_one_that_does_not_misses_every_line_on_a_rescan() {
        let mut c = Cache::new(&TINY);
        let lines = TINY.bytes() >> LINE_SHIFT;
        for l in 0..lines {
            c.access(l);
        }
        assert!((0..lines).all(|l| c.access(l)), "fits: every line hits");
        let mut c = Cache::new(&TINY);
        for l in 0..lines + 4 {
            c.access(l);
        }
        // One line a set too many: a sequential rescan evicts each line just before it is
        // needed again (LRU's worst case).
        assert!((0..lines + 4).all(|l| !c.access(l)));
    }

    #[test]
    fn lines_at_one_page_offset_use_one_64th_of_a_sliced_caches_sets() {
        let mut c = Cache::new(&CASCADE_LAKE_8275CL_LLC);
        let sets: std::collections::HashSet<usize> =
            (0..100_000u64).map(|page| c.set_of(page << 6)).collect();
        let g = CASCADE_LAKE_8275CL_LLC;
        assert_eq!(sets.len(), g.nr_sets() / 64);
        // A region of consecutive lines spreads evenly enough to fill the cache.
        let lines = g.bytes() >> LINE_SHIFT;
        let fill = lines * 9 / 10;
        for l in 0..fill {
            c.access(l);
        }
        let kept = (0..fill).filter(|&l| c.holds(l)).count() as u64;
        assert!(kept * 100 >= fill * 99, "{kept} of {fill} lines kept");
    }

    #[test]
    fn a_hierarchy_serves_from_l2_then_llc_then_memory() {
        let mut h = CacheHierarchy::new(&TINY, &CASCADE_LAKE_8275CL_LLC, 2);
        assert_eq!(h.access(0, 0, 100), Served::Memory);
        assert_eq!(h.access(0, 0, 100), Served::L2);
        assert_eq!(
            h.access(1, 0, 100),
            Served::Llc,
            "another core of the socket"
        );
        assert_eq!(h.access(2, 1, 100), Served::Memory, "another socket");
        assert!(h.llc_holds(0, 100) && h.llc_holds(1, 100));
    }
}
