//! The storage of a core's TLB: set-associative arrays with least-recently-used replacement,
//! whose entries are translations of one of four kinds (a guest access's combined translation,
//! a stage-2/EPT-only translation, a guest stage-1 walk intermediate, a stage-2 walk
//! intermediate), and the named cores' geometries ([`TlbGeometry`]). What the entries mean and
//! when they go is [`super::tlb`]'s.
//!
//! Entries are invalidated in bulk by generation: each kind belongs to a class (stage 1:
//! combined and walk entries; stage 2: stage-2 and stage-2 walk entries) whose current
//! generation an entry must carry to be valid, so `TLBI VMALLE1IS` (stage 1) and a full flush
//! are one increment each.

use super::load_window::LoadWindow;
use super::swept_windows::{SweptWindow, SweptWindows};
use crate::units::{Gfn, PageSize};

/// What a TLB entry translates.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum EntryKind {
    /// A guest access's whole translation (guest address to host frame): what an access uses.
    Combined = 0,
    /// A stage-2 (EPT) translation only: guest physical to host frame, which a combined miss
    /// uses instead of walking stage 2.
    Stage2 = 1,
    /// A guest stage-1 walk intermediate: the (host-physical) address of the guest's table one
    /// level down for a region of guest addresses, its stage-2 translation done: of the
    /// last-level table for a 2 MiB region (a miss there reads only the guest's leaf entry), of
    /// the level-2 table for a 1 GiB region.
    Walk = 2,
    /// A stage-2 (EPT) walk intermediate: the host-physical address of the last-level stage-2
    /// table for a 2 MiB region of guest-physical addresses, so translating a guest page there
    /// reads only its stage-2 leaf entry.
    Stage2Walk = 3,
}

impl EntryKind {
    /// The generation class: stage-1 kinds (combined, walk) or stage-2 kinds (stage 2, stage-2
    /// walk): the low bit of the kind.
    #[inline]
    fn class(self) -> usize {
        (self as usize) & 1
    }
}

/// One array: `sets` × `ways` entries holding the page sizes in `sizes`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TlbArray {
    /// The page sizes its entries may have.
    pub sizes: &'static [PageSize],
    /// Number of sets, a power of two (1: fully associative).
    pub sets: usize,
    /// Ways per set.
    pub ways: usize,
}

/// A core's data TLBs: the first-level arrays (combined entries, looked up first), the
/// second-level ones behind them (every kind the core keeps there), and where walk
/// intermediates (stage-1 and stage-2 walk entries) live.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TlbGeometry {
    /// The core.
    pub name: &'static str,
    /// First-level arrays (combined entries).
    pub l1: &'static [TlbArray],
    /// Second-level arrays.
    pub l2: &'static [TlbArray],
    /// A separate walk cache for stage-1 and stage-2 walk intermediates; `None`: they share
    /// the L2 arrays.
    pub walk_cache: Option<TlbArray>,
}

const ALL_SIZES: &[PageSize] = &[PageSize::Size4K, PageSize::Size2M, PageSize::Size1G];

/// Arm Neoverse-N1 (Ampere Altra, AWS Graviton2): a 48-entry fully associative L1 data TLB and a
/// 1280-entry 5-way L2 TLB holding every page size, stage-2 translations of blocks (2M, 1G: not
/// of 4K pages) and "intermediate PAs obtained during a translation table walk", of stage 1
/// and stage 2 alike (Arm Cortex-A76 TRM §A5.2.3, Table A5-3; N1 ≈ A76, per WikiChip).
pub const NEOVERSE_N1: TlbGeometry = TlbGeometry {
    name: "Neoverse-N1",
    l1: &[TlbArray {
        sizes: ALL_SIZES,
        sets: 1,
        ways: 48,
    }],
    l2: &[TlbArray {
        sizes: ALL_SIZES,
        sets: 256,
        ways: 5,
    }],
    walk_cache: None,
};

/// An Intel Cascade Lake (Skylake-SP) core: L1 DTLB 64 × 4-way for 4K, 32 × 4-way for 2M, 4 ×
/// 4-way for 1G; STLB 1536 × 12-way shared by 4K and 2M, 16 × 4-way for 1G (Intel Optimization
/// Reference Manual 248966-045, Table 2-15). The paging-structure caches — the PDE cache (a
/// 2 MiB region's page table) and the PDPTE cache (a 1 GiB region's page directory) of the
/// guest's paging, and their EPT counterparts for guest-physical addresses (SDM Vol. 3A
/// §4.10.3, Vol. 3C §29.3) — are of unpublished size; the walk cache here (32 entries, fully
/// associative, shared by both) is an estimate.
pub const CASCADE_LAKE: TlbGeometry = TlbGeometry {
    name: "Cascade Lake",
    l1: &[
        TlbArray {
            sizes: &[PageSize::Size4K],
            sets: 16,
            ways: 4,
        },
        TlbArray {
            sizes: &[PageSize::Size2M],
            sets: 8,
            ways: 4,
        },
        TlbArray {
            sizes: &[PageSize::Size1G],
            sets: 1,
            ways: 4,
        },
    ],
    l2: &[
        TlbArray {
            sizes: &[PageSize::Size4K, PageSize::Size2M],
            sets: 128,
            ways: 12,
        },
        TlbArray {
            sizes: &[PageSize::Size1G],
            sets: 4,
            ways: 4,
        },
    ],
    walk_cache: Some(TlbArray {
        sizes: &[PageSize::Size2M, PageSize::Size1G],
        sets: 1,
        ways: 32,
    }),
};

/// What an entry holds besides its tag.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Payload {
    /// The first host frame of what the entry maps.
    pub pfn: u64,
    /// Writes were allowed when it was loaded.
    pub writable: bool,
    /// A write needs no walk to set the leaf's Dirty flag.
    pub dirty: bool,
}

impl Payload {
    /// The payload in one word: the frame in the low 62 bits, the flags above (frames are
    /// below 2^52).
    #[inline]
    fn pack(self) -> u64 {
        debug_assert!(self.pfn < 1 << 62);
        self.pfn | u64::from(self.writable) << 62 | u64::from(self.dirty) << 63
    }

    /// The payload [`Payload::pack`] made `word` of.
    #[inline]
    fn unpack(word: u64) -> Self {
        Payload {
            pfn: word & ((1 << 62) - 1),
            writable: word >> 62 & 1 != 0,
            dirty: word >> 63 != 0,
        }
    }
}

/// Gfns are below 2^40 (a 52-bit guest physical address space). An entry's key is its first
/// gfn in bits 0–39, its kind in 40–41, its page size in 42–43 and its generation above: an
/// entry of a given size maps `gfn` exactly when its key equals the key that size would have,
/// so a set is searched by equality alone.
const GFN_BITS: u32 = 40;
const GFN_MASK: u64 = (1 << GFN_BITS) - 1;
const KIND_SHIFT: u32 = GFN_BITS;
const SIZE_SHIFT: u32 = GFN_BITS + 2;
const GEN_SHIFT: u32 = GFN_BITS + 4;
/// Generations count in the key's top 20 bits.
const GEN_MAX: u32 = (1 << (64 - GEN_SHIFT)) - 1;

/// The page size numbered `code` in keys.
#[inline]
fn size_of_code(code: u64) -> PageSize {
    PageSize::ALL[code as usize]
}

#[inline]
fn size_code(size: PageSize) -> u64 {
    match size {
        PageSize::Size4K => 0,
        PageSize::Size2M => 1,
        PageSize::Size1G => 2,
    }
}

/// The key of an entry of `kind` and `size` in generation `gen` that maps `gfn`.
#[inline]
fn key_of(kind: EntryKind, gen: u32, size: PageSize, gfn: Gfn) -> u64 {
    (gen as u64) << GEN_SHIFT
        | size_code(size) << SIZE_SHIFT
        | (kind as u64) << KIND_SHIFT
        | size.round(gfn).0
}

/// One array's entries, as parallel arrays so a set's keys are scanned without touching the
/// payloads.
#[derive(Clone)]
pub(crate) struct Array {
    shape: TlbArray,
    /// See [`key_of`]; 0 is empty (generation 0 is never current).
    key: Box<[u64]>,
    /// Last use, for LRU replacement; 0 for an entry invalidated by address.
    stamp: Box<[u64]>,
    /// [`Payload::pack`]ed.
    payload: Box<[u64]>,
    /// Per set, [`Array::sig_words`] words holding at least the OR of its keys'
    /// [`key_bit`]s: a key whose bit is clear is not in the set, so most searches that miss
    /// read one word instead of every way. A load adds its key's bit, and rebuilds the words
    /// from the keys once they have too many bits; an invalidation leaves them. Extra bits,
    /// and a stale generation's keys, only make a search look at the ways.
    sig: Box<[u64]>,
    /// Signature words per set: one per 16 ways (a power of two), so that a fully associative
    /// set of 48 ways keeps as few bits set, in proportion, as a 12-way set does in its one.
    sig_words: usize,
    /// Its base-2 logarithm: a set's first word is `set << sig_shift`.
    sig_shift: u32,
    /// Per set, the generations (stage 1 in the low half, stage 2 in the high) at its last
    /// load, when the entries stale by then were aged to 0 ([`Array::age_stale`]).
    seen: Box<[u64]>,
    /// A fully associative array of more than 32 ways (Neoverse-N1's 48-entry L1) keeps its
    /// ways in replacement order, so a load takes its victim from the front instead of
    /// reading every stamp. Not smaller ones: Cascade Lake's 32-way walk cache, whose entries
    /// are used far more often than replaced, costs more with it (cachegrind of an x86
    /// `dirty-log -v 8 -b 64M -i 2`: 928 M instructions with the order, 914 M without).
    order: Option<Recency>,
}

/// The ways of a one-set array in the order of their (stamp, way), least first: the order in
/// which LRU replacement with ties to the lowest way evicts them. A use gives a way the newest
/// stamp and moves it to the back; an invalidation gives it stamp 0 and moves it among the
/// other ways of stamp 0 at the front, by way.
#[derive(Clone)]
struct Recency {
    prev: Box<[u8]>,
    next: Box<[u8]>,
    /// The least and the greatest ([`NIL`] only while no way is linked).
    front: u8,
    back: u8,
}

/// No way.
const NIL: u8 = u8::MAX;

impl Recency {
    /// `ways` ways of stamp 0: by way.
    fn new(ways: usize) -> Self {
        assert!(ways < NIL as usize, "{ways} ways");
        let mut r = Recency {
            prev: vec![NIL; ways].into_boxed_slice(),
            next: vec![NIL; ways].into_boxed_slice(),
            front: NIL,
            back: NIL,
        };
        r.reset();
        r
    }

    /// Every way has stamp 0 again: by way.
    fn reset(&mut self) {
        let n = self.prev.len();
        for w in 0..n {
            self.prev[w] = if w == 0 { NIL } else { (w - 1) as u8 };
            self.next[w] = if w + 1 == n { NIL } else { (w + 1) as u8 };
        }
        (self.front, self.back) = (0, (n - 1) as u8);
    }

    fn unlink(&mut self, w: u8) {
        let (p, n) = (self.prev[w as usize], self.next[w as usize]);
        match p {
            NIL => self.front = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.back = p,
            n => self.prev[n as usize] = p,
        }
    }

    /// Links `w` before `at` (at the back when `at` is [`NIL`]).
    fn link_before(&mut self, w: u8, at: u8) {
        let p = match at {
            NIL => self.back,
            at => self.prev[at as usize],
        };
        self.prev[w as usize] = p;
        self.next[w as usize] = at;
        match p {
            NIL => self.front = w,
            p => self.next[p as usize] = w,
        }
        match at {
            NIL => self.back = w,
            at => self.prev[at as usize] = w,
        }
    }

    /// The front way moves to the back, `k` times (what `k` loads do to the order): the way
    /// `k % ways` from the front becomes the front, and the ways before it follow the back.
    fn rotate(&mut self, k: u64) {
        let k = k % self.prev.len() as u64;
        if k == 0 {
            return;
        }
        let mut front = self.front;
        for _ in 0..k {
            front = self.next[front as usize];
        }
        let back = self.prev[front as usize];
        self.next[self.back as usize] = self.front;
        self.prev[self.front as usize] = self.back;
        self.prev[front as usize] = NIL;
        self.next[back as usize] = NIL;
        (self.front, self.back) = (front, back);
    }

    /// `w` got the newest stamp.
    #[inline(always)]
    fn used(&mut self, w: u8) {
        if self.back != w {
            self.unlink(w);
            self.link_before(w, NIL);
        }
    }

    /// `w` got stamp 0 (`stamp` gives every way's): before the first way of a greater
    /// stamp, or of stamp 0 and a greater index.
    fn zeroed(&mut self, w: u8, stamp: &[u64]) {
        self.unlink(w);
        let mut at = self.front;
        while at != NIL && stamp[at as usize] == 0 && at < w {
            at = self.next[at as usize];
        }
        self.link_before(w, at);
    }
}

/// A key's word (of a set's [`Array::sig_words`], a power of two) and bit in its set's
/// signature ([`Array::sig`]): from a multiplicative hash of the whole key.
#[inline(always)]
fn key_bit(key: u64, words: usize) -> (usize, u64) {
    let h = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((h >> 52) as usize & (words - 1), 1 << (h >> 58))
}

/// The stamp `stamp` of the entry whose key is `key` stands for: its window's if it is
/// [`LAZY`].
#[inline]
fn swept_stamp(stamp: u64, key: u64, windows: &SweptWindows) -> u64 {
    match stamp {
        LAZY => {
            let g = key & GFN_MASK;
            windows
                .covering(g)
                .expect("a lazy stamp's gfn has a window")
                .stamp(g)
        }
        st => st,
    }
}

/// Where an entry sits: array and slot.
pub(crate) type Slot = (usize, usize);

impl Array {
    fn new(shape: TlbArray) -> Self {
        assert!(shape.sets.is_power_of_two(), "TLB sets are a power of two");
        let n = shape.sets * shape.ways;
        let sig_words = shape.ways.div_ceil(16).next_power_of_two();
        Array {
            shape,
            key: vec![0; n].into_boxed_slice(),
            stamp: vec![0; n].into_boxed_slice(),
            payload: vec![0; n].into_boxed_slice(),
            sig: vec![0; shape.sets * sig_words].into_boxed_slice(),
            sig_words,
            sig_shift: sig_words.trailing_zeros(),
            seen: vec![0; shape.sets].into_boxed_slice(),
            order: (shape.sets == 1 && shape.ways > 32).then(|| Recency::new(shape.ways)),
        }
    }

    /// Way `i` was used at `stamp`, the newest.
    #[inline(always)]
    fn stamp_used(&mut self, i: usize, stamp: u64) {
        self.stamp[i] = stamp;
        if let Some(o) = &mut self.order {
            o.used(i as u8);
        }
    }

    /// Way `i` takes the entry `key` with `payload`, used at `stamp` (the newest); the
    /// signature is the caller's.
    #[inline(always)]
    fn replace(&mut self, i: usize, key: u64, stamp: u64, payload: Payload) {
        self.key[i] = key;
        self.stamp_used(i, stamp);
        self.payload[i] = payload.pack();
    }

    /// Way `i` ages to stamp 0, the least recently used of all.
    #[inline]
    fn stamp_zero(&mut self, i: usize) {
        self.stamp[i] = 0;
        if let Some(o) = &mut self.order {
            o.zeroed(i as u8, &self.stamp);
        }
    }

    /// The way of set `set` a load replaces when no way holds its key: the least stamp, the
    /// first such way.
    #[inline]
    fn victim(&self, set: usize) -> usize {
        if let Some(o) = &self.order {
            return o.front as usize;
        }
        let ways = self.ways(set);
        let first = ways.start;
        let stamps = &self.stamp[ways];
        // Two passes the compiler vectorizes: the least stamp, then where it is.
        let least = stamps.iter().copied().min().expect("a set has ways");
        first
            + stamps
                .iter()
                .position(|st| *st == least)
                .expect("it is there")
    }

    /// [`Array::victim`] of a set that may hold entries of `windows` ([`LAZY`] stamps), in an
    /// array without a replacement order.
    fn victim_swept(&self, set: usize, windows: &SweptWindows) -> usize {
        debug_assert!(self.order.is_none());
        self.ways(set)
            .min_by_key(|&i| (swept_stamp(self.stamp[i], self.key[i], windows), i))
            .expect("a set has ways")
    }

    /// The set an entry of `size` mapping `gfn` falls in.
    #[inline]
    fn set(&self, gfn: Gfn, size: PageSize) -> usize {
        (gfn.0 >> size.gfn_shift()) as usize & (self.shape.sets - 1)
    }

    /// The slots of set `set`.
    #[inline]
    fn ways(&self, set: usize) -> std::ops::Range<usize> {
        set * self.shape.ways..(set + 1) * self.shape.ways
    }

    /// The slot in set `set` whose key is `key` (keys are unique in a set). Most searches
    /// miss, and the set's signature answers them.
    #[inline(always)]
    fn match_in_set(&self, set: usize, key: u64) -> Option<usize> {
        let (word, bit) = key_bit(key, self.sig_words);
        if self.sig[(set << self.sig_shift) + word] & bit == 0 {
            return None;
        }
        self.position(set, key)
    }

    /// The slot in set `set` whose key is `key`, searched way by way (for a caller that
    /// expects to find it: the signature would only add a load).
    #[inline(always)]
    fn position(&self, set: usize, key: u64) -> Option<usize> {
        let ways = self.ways(set);
        let first = ways.start;
        self.key[ways]
            .iter()
            .position(|k| *k == key)
            .map(|w| first + w)
    }

    /// Ages to 0 the entries of set `set` that are not of the current generation `gen` of
    /// their class (empty ones are already): the least recently used of all, as an entry
    /// invalidated by address is.
    fn age_stale(&mut self, set: usize, gen: [u32; 2]) {
        for i in self.ways(set) {
            let k = self.key[i];
            // The class is the kind's low bit (EntryKind::class).
            let class = ((k >> KIND_SHIFT) & 1) as usize;
            if (k >> GEN_SHIFT) != u64::from(gen[class]) && self.stamp[i] != 0 {
                self.stamp_zero(i);
            }
        }
    }

    /// [`Array::age_stale`] of set `set` if the generations `gen` changed since its last
    /// load (a second-level set's first load after a flush).
    #[inline(always)]
    fn age_stale_once(&mut self, set: usize, gen: [u32; 2]) {
        let gens = u64::from(gen[0]) | u64::from(gen[1]) << 32;
        if self.seen[set] != gens {
            self.age_stale(set, gen);
            self.seen[set] = gens;
        }
    }

    /// Rebuilds set `set`'s signature from its keys.
    fn rebuild_sig(&mut self, set: usize) {
        let w = self.sig_words;
        if w == 1 {
            // Most arrays: one word, folded without branches (an empty way adds no bit).
            let ways = self.ways(set);
            self.sig[set] = self.key[ways].iter().fold(0, |sig, &k| {
                sig | key_bit(k, 1).1 & u64::from(k != 0).wrapping_neg()
            });
            return;
        }
        let words = set * w..(set + 1) * w;
        self.sig[words.clone()].fill(0);
        for i in self.ways(set) {
            let k = self.key[i];
            if k != 0 {
                let (word, bit) = key_bit(k, w);
                self.sig[words.start + word] |= bit;
            }
        }
    }

    /// Adds `key`'s bit to set `set`'s signature, rebuilt from the keys (dropping the bits of
    /// keys the set no longer holds) once it has more than twice as many bits set as the set
    /// has ways (at most 32 per word).
    #[inline]
    fn add_to_sig(&mut self, set: usize, key: u64) {
        let w = self.sig_words;
        let (word, bit) = key_bit(key, w);
        let bits = if w == 1 {
            // Most arrays: one word, no loop.
            self.sig[set] |= bit;
            self.sig[set].count_ones()
        } else {
            let words = set * w..(set + 1) * w;
            self.sig[words.start + word] |= bit;
            self.sig[words].iter().map(|s| s.count_ones()).sum()
        };
        if bits as usize > 2 * self.shape.ways.min(16 * w) {
            self.rebuild_sig(set);
        }
    }

    fn holds(&self, size: PageSize) -> bool {
        self.shape.sizes.contains(&size)
    }
}

/// The stamp of a second-level 4K entry a sweep marked used: the window that covers its gfn
/// says what it stands for. While [`TlbArrays::swept`] has windows, every gfn they cover has a
/// valid combined 4K entry in [`TlbArrays::swept_array`] whose stamp is `LAZY`, and no other
/// slot holds `LAZY`. A page-table sweep goes down over nearly the same pages after each new
/// one, so a sweep looks up and marks only the pages no window covers, and the ones it passes
/// keep their stamps in what is left of their windows. Anything else that would read or write
/// such a stamp, or drop such an entry, writes every stamp first
/// ([`TlbArrays::materialize_windows`]).
const LAZY: u64 = u64::MAX;

/// A first level in replacement order that a sweep refilled, one copy per way, and that is not
/// written yet: the way at position `q` of the order (front first) holds gfn `top - q`'s 4K
/// entry, copied from the second level with stamp `stamp + 2q`. A sweep's copies are
/// overwritten by the next sweep's when that one refills every way too, as each sweep that a
/// 2 µs epoch cuts short does; anything else that reads or writes the first level, or a
/// second-level entry, writes them first ([`TlbArrays::materialize_refill`]), except
/// [`TlbArrays::first_level_free_below`] and [`TlbArrays::still_maps`], which read them as
/// they stand.
#[derive(Copy, Clone, Debug)]
struct PendingRefill {
    /// The first-level array (the copies come from [`TlbArrays::swept_array`]).
    array: usize,
    /// The gfn at the front.
    top: u64,
    /// The front way's stamp.
    stamp: u64,
}

/// Slots of second-level 4K entries, by gfn modulo its length, for the copies a sweep makes
/// into the first level: a hint, checked against the slot's key. Twice a page-table sweep's
/// 512 pages, so the pages a sweep copies were remembered when an earlier one first marked
/// them (a sweep stops at each 2 µs epoch; with 64, the `-v 128 -b 16M` page-table run took
/// 2.8 s instead of 2.4 s).
const SLOT_HINTS: usize = 1024;

/// Where a lookup of one kind looks, worked out once: (array, size) pairs of the first level and
/// of the second.
pub(crate) struct Probes {
    kind: EntryKind,
    first: Vec<(usize, PageSize)>,
    second: Vec<(usize, PageSize)>,
    /// `first` then `second` without the arrays the window's loads go into: where a combined
    /// lookup looks while a saturated window fills those ([`LoadWindow::saturated`]).
    outside_loads: Vec<(usize, PageSize)>,
    /// Every pair of `outside_loads` maps 2 MiB pages or larger, so what they answer is the
    /// same for every gfn of a 2 MiB region ([`TlbArrays::region_outside_loads_misses`]).
    outside_loads_huge: bool,
}

/// A core's TLB arrays and their generations.
#[derive(Clone)]
pub(crate) struct TlbArrays {
    arrays: Vec<Array>,
    /// `arrays[..l1]` are first-level, `arrays[l1..walk]` second-level, and `arrays[walk..]`
    /// the separate walk cache, if any.
    l1: usize,
    walk: usize,
    /// Current generation per class (stage 1, stage 2).
    gen: [u32; 2],
    clock: u64,
    /// The gfns whose 4K entries sweeps marked used without stamping them ([`LAZY`]).
    swept: SweptWindows,
    /// The second-level array that holds them.
    swept_array: usize,
    /// The first level's copies the last sweep made, if they are not written yet.
    refill: Option<PendingRefill>,
    /// Where the second-level 4K entries of recently swept gfns sat ([`SLOT_HINTS`]).
    slot_hints: [u32; SLOT_HINTS],
    /// The first-level and second-level arrays of 4K combined entries, where a core keeps
    /// its walk entries in a separate walk cache: only then do the loads of a run of misses
    /// wait in [`TlbArrays::loads`] (on a core whose second level holds the walk entries,
    /// each miss marks one used among them).
    load_arrays: Option<(usize, usize)>,
    /// Loads of 4K combined entries for ascending gfns not written into `load_arrays` yet:
    /// while it holds some, nothing else changes those two arrays (lookups, loads,
    /// invalidations and flushes write them first, [`TlbArrays::materialize_loads`]; no run
    /// that touches an entry there opens a window, [`TlbArrays::open_loads`]), and no entry
    /// of theirs that a load matched in place is among them.
    loads: LoadWindow,
    /// The first-level slot the last load of the window written last went into.
    top_slot: Option<Slot>,
}

/// The most ways an array the window's loads go into may have (their order is sorted on the
/// stack when the window is written).
const MAX_WINDOW_WAYS: usize = 16;

/// The slot a caller is handed for the last load of an unwritten [`LoadWindow`]: the
/// first-level slot it will have ([`TlbArrays::resolve`]).
pub(crate) const WINDOW_TOP: Slot = (usize::MAX, usize::MAX);

/// The entries each miss of a run loaded through the window uses
/// ([`TlbArrays::window_miss`]): the region's walk entry, and its stage-2 entry or stage-2
/// walk entry.
pub(crate) const WINDOW_MISS_USES: usize = 2;

/// A lookup without marking anything could not tell, because loads waiting in the window may
/// change the answer ([`TlbArrays::peek`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct LoadsPending;

impl TlbArrays {
    pub(crate) fn new(g: &TlbGeometry) -> Self {
        let mut arrays: Vec<Array> = g.l1.iter().chain(g.l2).map(|s| Array::new(*s)).collect();
        let walk = arrays.len();
        arrays.extend(g.walk_cache.map(Array::new));
        let holds_4k = |range: std::ops::Range<usize>| {
            range.clone().find(|&a| arrays[a].holds(PageSize::Size4K))
        };
        let load_arrays = match (
            g.walk_cache,
            holds_4k(0..g.l1.len()),
            holds_4k(g.l1.len()..walk),
        ) {
            (Some(_), Some(l1), Some(l2))
                if [l1, l2].iter().all(|&a| {
                    arrays[a].order.is_none() && arrays[a].shape.ways <= MAX_WINDOW_WAYS
                }) =>
            {
                Some((l1, l2))
            }
            _ => None,
        };
        // A set keeps its last `ways` loads: the last `sets × ways` gfns.
        let capacity = load_arrays.map_or(1, |(l1, l2)| {
            let entries = |a: usize| arrays[a].shape.sets * arrays[a].shape.ways;
            entries(l1).max(entries(l2))
        });
        TlbArrays {
            arrays,
            l1: g.l1.len(),
            walk,
            gen: [1, 1],
            clock: 0,
            swept: SweptWindows::default(),
            swept_array: 0,
            refill: None,
            slot_hints: [0; SLOT_HINTS],
            load_arrays,
            loads: LoadWindow::new(capacity),
            top_slot: None,
        }
    }

    #[inline]
    fn gen_of(&self, kind: EntryKind) -> u32 {
        self.gen[kind.class()]
    }

    /// The arrays an entry of `kind` may sit in.
    #[inline]
    fn arrays_of(&self, kind: EntryKind) -> std::ops::Range<usize> {
        match kind {
            EntryKind::Combined => 0..self.walk,
            EntryKind::Stage2 => self.l1..self.walk,
            EntryKind::Walk | EntryKind::Stage2Walk if self.walk < self.arrays.len() => {
                self.walk..self.arrays.len()
            }
            EntryKind::Walk | EntryKind::Stage2Walk => self.l1..self.walk,
        }
    }

    /// The valid entry of `kind` that maps `gfn` among `probes`.
    #[inline]
    fn find(&self, probes: &[(usize, PageSize)], kind: EntryKind, gfn: Gfn) -> Option<Slot> {
        let gen = self.gen_of(kind);
        for &(a, size) in probes {
            let arr = &self.arrays[a];
            if let Some(i) = arr.match_in_set(arr.set(gfn, size), key_of(kind, gen, size, gfn)) {
                return Some((a, i));
            }
        }
        None
    }

    /// The (array, size) pairs a lookup of `kind` among `sizes` probes: for combined entries,
    /// the first level's, then the second's.
    pub(crate) fn probes(&self, kind: EntryKind, sizes: &[PageSize]) -> Probes {
        let list = |range: std::ops::Range<usize>| -> Vec<(usize, PageSize)> {
            range
                .flat_map(|a| {
                    self.arrays[a]
                        .shape
                        .sizes
                        .iter()
                        .filter(|s| sizes.contains(s))
                        .map(move |s| (a, *s))
                })
                .collect()
        };
        let range = self.arrays_of(kind);
        match kind {
            EntryKind::Combined => {
                let (first, second) = (list(0..self.l1), list(self.l1..range.end));
                let outside_loads: Vec<_> = first
                    .iter()
                    .chain(&second)
                    .copied()
                    .filter(|&(a, _)| !self.in_load_arrays((a, 0)))
                    .collect();
                let outside_loads_huge = outside_loads
                    .iter()
                    .all(|&(_, size)| size.pages() >= PageSize::Size2M.pages());
                Probes {
                    kind,
                    first,
                    second,
                    outside_loads,
                    outside_loads_huge,
                }
            }
            _ => Probes {
                kind,
                first: Vec::new(),
                second: list(range),
                outside_loads: Vec::new(),
                outside_loads_huge: false,
            },
        }
    }

    /// Looks up a valid entry mapping `gfn` where `probes` says to look, marking it used: the
    /// slot and whether it was found in the first level.
    #[inline(always)]
    pub(crate) fn lookup(&mut self, probes: &Probes, gfn: Gfn) -> Option<(Slot, bool)> {
        if gfn.0 > GFN_MASK {
            return None;
        }
        if self.refill.is_some() && !probes.first.is_empty() {
            self.materialize_refill();
        }
        if probes.kind == EntryKind::Combined && self.loads.covers(gfn.0) {
            self.materialize_loads();
        }
        let mut found = self.find_by_level(probes, gfn);
        if let Some(((a, _), _)) = found {
            if self.loads_pending_in(a) {
                // The waiting loads may evict it.
                self.materialize_loads();
                found = self.find_by_level(probes, gfn);
            }
        }
        if let Some(((a, i), _)) = found {
            self.use_slot(a, i);
        }
        found
    }

    /// The valid entry mapping `gfn` where `probes` says to look, and whether it is in the
    /// first level.
    #[inline(always)]
    fn find_by_level(&self, probes: &Probes, gfn: Gfn) -> Option<(Slot, bool)> {
        self.find(&probes.first, probes.kind, gfn)
            .map(|s| (s, true))
            .or_else(|| {
                self.find(&probes.second, probes.kind, gfn)
                    .map(|s| (s, false))
            })
    }

    /// The valid entry mapping `gfn` where `probes` says to look, first level first, without
    /// marking it used: the slot a [`TlbArrays::lookup`] would mark, or [`LoadsPending`] where
    /// the loads waiting in the window may change the answer (a gfn among them, or an entry in
    /// the arrays they go into). Not while a sweep left anything unwritten
    /// ([`TlbArrays::lazy`]).
    #[inline]
    pub(crate) fn peek(&self, probes: &Probes, gfn: Gfn) -> Result<Option<Slot>, LoadsPending> {
        self.peek_knowing(probes, gfn, false)
    }

    /// Whether the arrays outside the window's ([`Probes`]' `outside_loads`) map none of the
    /// 2 MiB region of `gfn`, known for every gfn of the region at once: false unless they
    /// all map 2 MiB pages or larger. It stays so while nothing but loads of 4K combined
    /// entries and uses of entries changes the arrays (a run of misses in the region:
    /// [`TlbArrays::peek_knowing`]).
    pub(crate) fn region_outside_loads_misses(&self, probes: &Probes, gfn: Gfn) -> bool {
        probes.outside_loads_huge
            && gfn.0 <= GFN_MASK
            && self.find(&probes.outside_loads, probes.kind, gfn).is_none()
    }

    /// [`TlbArrays::peek`], told whether the arrays outside the window map none of `gfn`'s
    /// 2 MiB region ([`TlbArrays::region_outside_loads_misses`], true only if so): then a
    /// saturated window's answer needs no search.
    #[inline]
    pub(crate) fn peek_knowing(
        &self,
        probes: &Probes,
        gfn: Gfn,
        region_outside_loads_misses: bool,
    ) -> Result<Option<Slot>, LoadsPending> {
        debug_assert!(!self.lazy());
        debug_assert!(
            !region_outside_loads_misses || self.region_outside_loads_misses(probes, gfn),
            "{gfn:?}: told the arrays outside the window miss its region"
        );
        if gfn.0 > GFN_MASK
            || self.misses_past_saturated_window(probes, gfn, region_outside_loads_misses)
        {
            return Ok(None);
        }
        if probes.kind == EntryKind::Combined && self.loads.pending() {
            if self.loads.covers(gfn.0) {
                return Err(LoadsPending);
            }
            if self.loads.saturated() {
                // Once written, the loads fill every way of their arrays: no entry there
                // maps a gfn outside the window.
                return Ok(self.find(&probes.outside_loads, probes.kind, gfn));
            }
        }
        match self.find_by_level(probes, gfn) {
            Some(((a, _), _)) if self.loads_pending_in(a) => Err(LoadsPending),
            found => Ok(found.map(|(s, _)| s)),
        }
    }

    /// The answer [`TlbArrays::peek_knowing`] gives `gfn` without a search, where it gives
    /// one: true when the arrays outside a saturated window are known to miss `gfn`'s region
    /// (`region_outside_loads_misses`) and the window does not cover `gfn` (once written, the
    /// window's loads fill every way of their arrays), so the peek finds nothing. False says
    /// only that the peek must look. Inline, for a run's every write; the peek asks it first.
    #[inline(always)]
    pub(crate) fn misses_past_saturated_window(
        &self,
        probes: &Probes,
        gfn: Gfn,
        region_outside_loads_misses: bool,
    ) -> bool {
        region_outside_loads_misses
            && probes.kind == EntryKind::Combined
            && self.loads.saturated()
            && !self.loads.covers(gfn.0)
    }

    /// Whether array `a` is one the window's loads wait to go into.
    #[inline(always)]
    fn loads_pending_in(&self, a: usize) -> bool {
        self.loads.pending() && self.in_load_arrays((a, 0))
    }

    /// Whether a slot is in an array the window's loads go into ([`TlbArrays::open_loads`]
    /// is for runs whose other entries are not).
    #[inline]
    pub(crate) fn in_load_arrays(&self, (a, _): Slot) -> bool {
        self.load_arrays.is_some_and(|(l1, l2)| a == l1 || a == l2)
    }

    /// Opens the window for loads of 4K combined entries from `first` up
    /// ([`TlbArrays::insert`] of `first`, then `first + 1`, … go into it), writing what an
    /// earlier one holds unless it goes on at `first`: on a core with a separate walk cache,
    /// while no sweep left anything unwritten. The caller's run touches no entry of the
    /// arrays the loads go into ([`TlbArrays::in_load_arrays`]): a touch there while loads
    /// wait could mark a slot their writing moves (asserted in debug builds).
    pub(crate) fn open_loads(&mut self, first: Gfn) {
        if self.load_arrays.is_none()
            || self.lazy()
            || first.0 > GFN_MASK
            || self.loads.next() == Some(first.0)
        {
            return;
        }
        self.materialize_loads();
        self.loads.open(first.0);
    }

    /// The load of gfn `gfn`'s 4K combined entry with payload `packed` ([`Payload::pack`], a
    /// word passed in a register) into the open window, if it extends it: the next gfn, whose
    /// key neither array holds (a load that matched a key in place would break the rounds the
    /// window's replay counts on). It takes the clock's next two ticks, as the second-level and
    /// first-level loads do.
    #[inline(never)]
    fn extend_loads(&mut self, gfn: Gfn, packed: u64) -> bool {
        if gfn.0 > GFN_MASK {
            return false;
        }
        debug_assert!(!self.lazy(), "a sweep writes the window before it starts");
        // A saturated window fills every way of both arrays with loads of lower gfns.
        if !self.loads.saturated() {
            let (l1, l2) = self.load_arrays.expect("open only with its arrays");
            let key = key_of(
                EntryKind::Combined,
                self.gen_of(EntryKind::Combined),
                PageSize::Size4K,
                gfn,
            );
            let held = |a: usize| {
                let arr = &self.arrays[a];
                arr.match_in_set(arr.set(gfn, PageSize::Size4K), key)
                    .is_some()
            };
            if held(l2) || held(l1) {
                return false;
            }
        }
        self.clock += 2;
        self.loads.push(self.clock - 1, packed);
        true
    }

    /// Whether the next `n` loads of 4K combined entries, from gfn `gfn` up, each after a
    /// use of the same two entries outside the load arrays, may go into the window at once
    /// ([`TlbArrays::window_miss`]): it is open at `gfn` and saturated (so each load extends
    /// it without a search: `extend_loads`), and the gfns have keys.
    #[inline]
    pub(crate) fn window_takes_misses(&self, gfn: Gfn, n: u64) -> bool {
        self.loads.next() == Some(gfn.0)
            && self.loads.saturated()
            && gfn.0.saturating_add(n) <= GFN_MASK
    }

    /// A miss of a run that [`TlbArrays::window_takes_misses`] allowed, on `gfn` (the
    /// window's next): the uses of the run's [`WINDOW_MISS_USES`] entries (a tick each, as
    /// [`TlbArrays::touch`] takes), then the load of its entry with `payload` into the
    /// window (two ticks, as `extend_loads`; its stamp is the first). The used entries'
    /// stamps are written once, by [`TlbArrays::end_window_misses`], to what the last miss's
    /// uses give them: nothing reads them meanwhile.
    #[inline]
    pub(crate) fn window_miss(&mut self, gfn: Gfn, payload: Payload) {
        debug_assert!(self.loads.saturated());
        debug_assert_eq!(self.loads.next(), Some(gfn.0), "not the window's next gfn");
        self.clock += WINDOW_MISS_USES as u64 + 2;
        self.loads.push(self.clock - 1, payload.pack());
    }

    /// After misses made by [`TlbArrays::window_miss`]: the entries each of them used,
    /// `used` in the order it used them, get the stamps the last one's uses gave them (the
    /// ticks before its load's two), and become their sets' most recently used in that order
    /// (as the same uses made one by one leave them: a repeated use of the same entries ends
    /// as the last one does).
    pub(crate) fn end_window_misses(&mut self, used: [Slot; WINDOW_MISS_USES]) {
        let first_use = self.clock - 2 - WINDOW_MISS_USES as u64 + 1;
        for (k, (a, i)) in used.into_iter().enumerate() {
            debug_assert!(
                !self.in_load_arrays((a, i)),
                "a used entry the loads may take"
            );
            self.arrays[a].stamp_used(i, first_use + k as u64);
        }
    }

    /// Writes the loads waiting in the window into their arrays, and closes it: per set, as
    /// [`TlbArrays::load`] makes them, each with its own stamp, when the set has no more loads
    /// than ways; else only its last `ways` loads, each into the way its number modulo `ways`
    /// gives in the set's order before them (see `super::load_window`).
    #[cold]
    pub(crate) fn materialize_loads(&mut self) {
        let Some((lo, hi)) = self.loads.close() else {
            return;
        };
        let (l1, l2) = self.load_arrays.expect("open only with its arrays");
        let gen = self.gen_of(EntryKind::Combined);
        // The first-level load is the tick after the second-level one.
        for (a, tick) in [(l2, 0), (l1, 1)] {
            let TlbArray { sets, ways, .. } = self.arrays[a].shape;
            let (sets, ways) = (sets as u64, ways as u64);
            for f in lo..lo + sets.min(hi - lo + 1) {
                // A set's loads: gfns `f`, `f + sets`, …, `n` of them.
                let n = (hi - f) / sets + 1;
                let set = self.arrays[a].set(Gfn(f), PageSize::Size4K);
                let load = |loads: &LoadWindow, j: u64| {
                    let g = f + j * sets;
                    debug_assert!(hi - g < loads.capacity(), "{g:#x} is no longer kept");
                    let (stamp, payload) = loads.load(g);
                    let key = key_of(EntryKind::Combined, gen, PageSize::Size4K, Gfn(g));
                    (g, key, stamp + tick, Payload::unpack(payload))
                };
                if n <= ways {
                    for j in 0..n {
                        let (g, key, stamp, payload) = load(&self.loads, j);
                        let i = self.load_into(a, set, key, stamp, payload);
                        if a == l1 && g == hi {
                            self.top_slot = Some((a, i));
                        }
                    }
                    continue;
                }
                // Load `j` (from 0) took the way `j % ways` places into the set's order
                // before the window (least recently used first, stale entries aged first):
                // only the last `ways` loads are left.
                let arr = &mut self.arrays[a];
                debug_assert!(arr.order.is_none() && self.swept.is_empty());
                if a >= self.l1 {
                    arr.age_stale_once(set, self.gen);
                }
                let mut order: [usize; MAX_WINDOW_WAYS] = [0; MAX_WINDOW_WAYS];
                let order = &mut order[..ways as usize];
                for (o, i) in order.iter_mut().zip(arr.ways(set)) {
                    *o = i;
                }
                order.sort_by_key(|&i| (arr.stamp[i], i));
                for j in n - ways..n {
                    let (g, key, stamp, payload) = load(&self.loads, j);
                    let i = order[(j % ways) as usize];
                    self.arrays[a].replace(i, key, stamp, payload);
                    if a == l1 && g == hi {
                        self.top_slot = Some((a, i));
                    }
                }
                self.arrays[a].rebuild_sig(set);
            }
        }
    }

    /// The slot [`WINDOW_TOP`] stands for, the window written first; any other slot as it is.
    pub(crate) fn resolve(&mut self, slot: Slot) -> Slot {
        if slot != WINDOW_TOP {
            return slot;
        }
        self.materialize_loads();
        self.top_slot.expect("the window's last load was written")
    }

    /// Sweeps left stamps or first-level copies unwritten ([`LAZY`], [`PendingRefill`]).
    #[inline]
    pub(crate) fn lazy(&self) -> bool {
        !self.swept.is_empty() || self.refill.is_some()
    }

    /// Marks way `i` of array `a` used, at the next tick of the clock.
    #[inline(always)]
    fn use_slot(&mut self, a: usize, i: usize) {
        debug_assert!(
            !self.loads_pending_in(a),
            "a slot the waiting loads may take"
        );
        // (Only the swept array's slots are lazy, and only while it has windows.)
        if !self.swept.is_empty() && self.arrays[a].stamp[i] == LAZY {
            self.materialize_windows();
        }
        self.clock += 1;
        self.arrays[a].stamp_used(i, self.clock);
    }

    /// Writes the stamps every window stands for ([`LAZY`]) and drops them: before anything
    /// reads or writes one of those stamps one by one, or drops one of those entries.
    #[cold]
    fn materialize_windows(&mut self) {
        for w in self.swept.take_all().as_slice() {
            self.stamp_swept(w);
        }
    }

    /// Writes the first level's copies a sweep left pending ([`PendingRefill`]).
    #[cold]
    fn materialize_refill(&mut self) {
        let Some(p) = self.refill.take() else {
            return;
        };
        let gen = self.gen_of(EntryKind::Combined);
        let mut w = self.arrays[p.array].order.as_ref().expect("ordered").front;
        let mut q = 0;
        while w != NIL {
            let g = p.top - q;
            let key = key_of(EntryKind::Combined, gen, PageSize::Size4K, Gfn(g));
            let i = self
                .slot_4k(self.swept_array, g, key)
                .expect("second-level entries stay while copies of them are pending");
            let payload = self.arrays[self.swept_array].payload[i];
            let arr = &mut self.arrays[p.array];
            arr.key[w as usize] = key;
            arr.stamp[w as usize] = p.stamp + 2 * q;
            arr.payload[w as usize] = payload;
            w = arr.order.as_ref().expect("ordered").next[w as usize];
            q += 1;
        }
        self.arrays[p.array].rebuild_sig(0);
    }

    /// The key at way `w` of first-level array `a`, pending copies included.
    fn first_level_key(&self, a: usize, w: usize) -> u64 {
        let arr = &self.arrays[a];
        match (self.refill, &arr.order) {
            (Some(p), Some(o)) if p.array == a => {
                // Most often the back: the last copy, which a lookup remembers.
                let (mut at, mut q) = (o.front, 0);
                if o.back as usize == w {
                    (at, q) = (o.back, arr.shape.ways as u64 - 1);
                }
                while at as usize != w {
                    (at, q) = (o.next[at as usize], q + 1);
                }
                let gen = self.gen_of(EntryKind::Combined);
                key_of(EntryKind::Combined, gen, PageSize::Size4K, Gfn(p.top - q))
            }
            _ => arr.key[w],
        }
    }

    /// Writes the stamps window `w` stands for (it is no longer among the windows).
    fn stamp_swept(&mut self, w: &SweptWindow) {
        let (a, gen) = (self.swept_array, self.gen_of(EntryKind::Combined));
        for g in w.lo..=w.hi {
            let key = key_of(EntryKind::Combined, gen, PageSize::Size4K, Gfn(g));
            let i = self
                .slot_4k(a, g, key)
                .expect("a window's entries stay until it is written");
            debug_assert_eq!(self.arrays[a].stamp[i], LAZY);
            self.arrays[a].stamp[i] = w.stamp(g);
        }
    }

    /// The slot of array `a` holding `key`, the key of gfn `g`'s 4K entry, if any: where
    /// [`SLOT_HINTS`] says when it does, else searched in its set (and remembered).
    #[inline]
    fn slot_4k(&mut self, a: usize, g: u64, key: u64) -> Option<usize> {
        let h = g as usize % SLOT_HINTS;
        let arr = &self.arrays[a];
        let hint = self.slot_hints[h] as usize;
        // Keys are unique in an array (each key has one set), so the hint is right exactly
        // when the slot holds the key.
        if arr.key.get(hint) == Some(&key) {
            return Some(hint);
        }
        let i = arr.position(arr.set(Gfn(g), PageSize::Size4K), key)?;
        self.slot_hints[h] = i as u32;
        Some(i)
    }

    /// Checks [`LAZY`]'s and [`PendingRefill`]'s invariants (for debug builds and tests).
    #[cfg(any(test, debug_assertions))]
    fn check_lazy(&self) {
        if let Some(p) = self.refill {
            let arr = &self.arrays[self.swept_array];
            let gen = self.gen_of(EntryKind::Combined);
            for q in 0..self.arrays[p.array].shape.ways as u64 {
                let g = Gfn(p.top - q);
                let key = key_of(EntryKind::Combined, gen, PageSize::Size4K, g);
                let i = arr.position(arr.set(g, PageSize::Size4K), key);
                assert!(i.is_some(), "{g:?} of {p:?}");
            }
        }
        let lazy: usize = self
            .arrays
            .iter()
            .map(|arr| arr.stamp.iter().filter(|&&st| st == LAZY).count())
            .sum();
        let windows = self.swept.as_slice();
        let covered: u64 = windows.iter().map(|w| w.len()).sum();
        assert_eq!(lazy as u64, covered, "{windows:?}");
        let gen = self.gen_of(EntryKind::Combined);
        let arr = &self.arrays[self.swept_array];
        for w in windows {
            for g in w.lo..=w.hi {
                let key = key_of(EntryKind::Combined, gen, PageSize::Size4K, Gfn(g));
                let i = arr.position(arr.set(Gfn(g), PageSize::Size4K), key);
                assert!(
                    i.is_some_and(|i| arr.stamp[i] == LAZY),
                    "gfn {g:#x} of {w:?}"
                );
            }
        }
    }

    /// Whether the entry at `slot` still maps `gfn` with the current generation (for a caller
    /// that remembers the last entry it used; [`WINDOW_TOP`] is the window's last load, or
    /// the slot it went into once written). False for a slot of an array that loads wait to
    /// go into (they may evict it): the caller looks the gfn up instead.
    #[inline]
    pub(crate) fn still_maps(&self, slot: Slot, kind: EntryKind, gfn: Gfn) -> bool {
        if slot.0 == WINDOW_TOP.0 {
            return self.top_still_maps(kind, gfn);
        }
        self.slot_still_maps(slot, kind, gfn)
    }

    /// [`TlbArrays::still_maps`] of [`WINDOW_TOP`] (apart, so that the common case inlines).
    #[inline(never)]
    fn top_still_maps(&self, kind: EntryKind, gfn: Gfn) -> bool {
        match self.loads.top() {
            Some(top) => kind == EntryKind::Combined && gfn.0 == top,
            None => self
                .top_slot
                .is_some_and(|s| self.slot_still_maps(s, kind, gfn)),
        }
    }

    /// [`TlbArrays::still_maps`] of a slot of the arrays.
    #[inline(always)]
    fn slot_still_maps(&self, (a, i): Slot, kind: EntryKind, gfn: Gfn) -> bool {
        if self.loads_pending_in(a) {
            // Perhaps not once the waiting loads are written: the caller looks it up.
            return false;
        }
        let key = if a < self.l1 && self.refill.is_some() {
            self.first_level_key(a, i)
        } else {
            self.arrays[a].key[i]
        };
        let size = size_of_code((key >> SIZE_SHIFT) & 3);
        gfn.0 <= GFN_MASK && key == key_of(kind, self.gen_of(kind), size, gfn)
    }

    /// Marks the entry at `slot` used.
    #[inline]
    pub(crate) fn touch(&mut self, (a, i): Slot) {
        if a < self.l1 && self.refill.is_some() {
            self.materialize_refill();
        }
        self.use_slot(a, i);
    }

    /// The entry at `slot`: its first gfn, page size and payload.
    #[inline]
    pub(crate) fn entry(&self, (a, i): Slot) -> (u64, PageSize, Payload) {
        debug_assert!(
            !self.loads_pending_in(a),
            "an entry is read after the lookup that writes the waiting loads"
        );
        debug_assert!(
            a >= self.l1 || self.refill.is_none(),
            "a first-level entry is read after the lookup that writes the pending copies"
        );
        let arr = &self.arrays[a];
        let key = arr.key[i];
        (
            key & GFN_MASK,
            size_of_code((key >> SIZE_SHIFT) & 3),
            Payload::unpack(arr.payload[i]),
        )
    }

    /// Loads an entry of `kind` and `size` mapping `gfn` into the first array among `range`
    /// that holds the size, replacing the same page's entry if there is one, else an empty or
    /// stale way, else the least recently used. Returns its slot.
    fn load(
        &mut self,
        range: std::ops::Range<usize>,
        kind: EntryKind,
        gfn: Gfn,
        size: PageSize,
        payload: Payload,
    ) -> Option<Slot> {
        if gfn.0 > GFN_MASK {
            // Beyond a 52-bit guest physical address space: not cacheable in this key layout.
            return None;
        }
        // A second-level load may replace the entry a pending copy comes from.
        if self.refill.is_some() {
            self.materialize_refill();
        }
        let a = range.clone().find(|&a| self.arrays[a].holds(size))?;
        if self.loads_pending_in(a) {
            self.materialize_loads();
        }
        let key = key_of(kind, self.gen_of(kind), size, gfn);
        let set = self.arrays[a].set(gfn, size);
        self.clock += 1;
        Some((a, self.load_into(a, set, key, self.clock, payload)))
    }

    /// Loads `key` with `payload` into set `set` of array `a`, used at `stamp` (the newest):
    /// into the way holding the key if one does, else an empty or stale way, else the least
    /// recently used. Returns the way's slot.
    #[inline(always)]
    fn load_into(&mut self, a: usize, set: usize, key: u64, stamp: u64, payload: Payload) -> usize {
        let second_level = a >= self.l1;
        let swept = !self.swept.is_empty() && self.swept_array == a;
        let arr = &mut self.arrays[a];
        let victim = match arr.match_in_set(set, key) {
            Some(i) => i,
            // The least recently used way goes, an empty or stale one first. A first-level
            // array holds combined entries only, one generation class: an entry a flush made
            // stale was last used before the flush, so before every live entry, and an
            // invalidated one has stamp 0, so the least stamp is the victim. A second-level
            // set mixes classes: its entries that flushes made stale since its last load age
            // to 0 first, and then the same holds.
            None => {
                if second_level {
                    arr.age_stale_once(set, self.gen);
                }
                if swept {
                    arr.victim_swept(set, &self.swept)
                } else {
                    arr.victim(set)
                }
            }
        };
        if swept && arr.stamp[victim] == LAZY {
            // The same page again, or a window's entry goes.
            self.materialize_windows();
        }
        let arr = &mut self.arrays[a];
        arr.replace(victim, key, stamp, payload);
        arr.add_to_sig(set, key);
        victim
    }

    /// Loads an entry of `kind`: a combined entry into both levels (a copy in the second
    /// level, which serves it after the first level evicts it; the two are replaced
    /// independently), other kinds where they live.
    pub(crate) fn insert(
        &mut self,
        kind: EntryKind,
        gfn: Gfn,
        size: PageSize,
        payload: Payload,
    ) -> Option<Slot> {
        match kind {
            EntryKind::Combined => {
                // (Checked here first: the call is only for the window's next gfn.)
                if size == PageSize::Size4K
                    && self.loads.next() == Some(gfn.0)
                    && self.extend_loads(gfn, payload.pack())
                {
                    return Some(WINDOW_TOP);
                }
                self.load(self.l1..self.walk, kind, gfn, size, payload);
                self.load(0..self.l1, kind, gfn, size, payload)
            }
            _ => self.load(self.arrays_of(kind), kind, gfn, size, payload),
        }
    }

    /// Copies the second-level entry at `slot` into the first level (an L2 hit refills L1).
    pub(crate) fn promote(&mut self, slot: Slot, gfn: Gfn) -> Option<Slot> {
        let (base, size, p) = self.entry(slot);
        debug_assert_eq!(size.round(gfn).0, base);
        self.load(0..self.l1, EntryKind::Combined, gfn, size, p)
    }

    /// How many of the `n` gfns `first`, `first - 1`, … a sweep down that misses the first
    /// level at each (and loads each into it) can look up before the first one that a valid
    /// first-level entry still covers when the sweep gets there. An array in replacement
    /// order ([`Recency`]) loses its ways front first, one per load, so an entry `q` places
    /// from the front is gone before the sweep's load number `q + 1`; in any other array an
    /// entry the sweep would reach ends it.
    pub(crate) fn first_level_free_below(&self, probes: &Probes, first: Gfn, n: u64) -> u64 {
        debug_assert!(
            !self.loads.pending(),
            "a sweep reads the arrays as they are"
        );
        // Beyond the keys' gfns nothing is cached; a first-level hit on `first` ends the run
        // before it starts (most often, when the run is short enough to fit the first level).
        if first.0 > GFN_MASK
            || self.refill.is_none() && self.find(&probes.first, probes.kind, first).is_some()
        {
            return 0;
        }
        let low = (first.0 + 1).saturating_sub(n);
        let gen = u64::from(self.gen[EntryKind::Combined.class()]);
        let mut free = n;
        // How far down the sweep gets before key `k`'s entry, which is evicted after `gone`
        // loads, stops it.
        let mut limit = |k: u64, gone: u64| {
            // First-level arrays hold combined entries only; empty and stale keys carry an
            // older generation.
            if k >> GEN_SHIFT != gen {
                return;
            }
            let base = k & GFN_MASK;
            let last = base + size_of_code((k >> SIZE_SHIFT) & 3).pages() - 1;
            if last >= low && base <= first.0 {
                // The sweep reaches the entry's highest gfn in the run after `reached` loads.
                let reached = first.0 - last.min(first.0);
                if reached < gone {
                    free = free.min(reached);
                }
            }
        };
        for (a, arr) in self.arrays[..self.l1].iter().enumerate() {
            match &arr.order {
                Some(_) if self.refill.is_some_and(|p| p.array == a) => {
                    // Pending copies: gfn `top - q` at position `q`, reached after
                    // `first - top + q` loads and gone after `q + 1`, so it stops the sweep
                    // exactly when it is `first` itself.
                    let p = self.refill.expect("pending");
                    if (p.top + 1).saturating_sub(arr.shape.ways as u64) <= first.0
                        && first.0 <= p.top
                    {
                        return 0;
                    }
                }
                Some(o) => {
                    let (mut w, mut q) = (o.front, 0);
                    while w != NIL {
                        limit(arr.key[w as usize], q + 1);
                        (w, q) = (o.next[w as usize], q + 1);
                    }
                }
                None => arr.key.iter().for_each(|&k| limit(k, u64::MAX)),
            }
        }
        free
    }

    /// What [`TlbArrays::lookup`] of combined entries (`probes`) and then
    /// [`TlbArrays::promote`] do for each of the `n` gfns `first`, `first - 1`, … while the
    /// second level holds its 4K entry, given that no first-level entry covers it when its
    /// turn comes (the caller knows, [`TlbArrays::first_level_free_below`]): the entry is
    /// marked used and copied into the first level. Returns how many, and the last copy's
    /// slot.
    ///
    /// The two levels change independently. A first level of one set in replacement order
    /// takes each copy into its front way and moves that way to the back, so only the last
    /// copies, one per way, survive, and the ones before are a rotation of the order: the
    /// second level is swept first, then those copies are made, with the stamps the
    /// interleaved order gives (the second level's at odd steps of the clock, the first
    /// level's at even ones). The second level's entries are left unstamped ([`LAZY`]):
    /// a sweep looks up only the gfns no earlier sweep's window covers. Any other first level
    /// takes each copy as the lookup would.
    pub(crate) fn second_level_4k_sweep(
        &mut self,
        probes: &Probes,
        first: Gfn,
        n: u64,
    ) -> (u64, Option<Slot>) {
        debug_assert!(
            !self.loads.pending(),
            "a sweep reads the arrays as they are"
        );
        let clock = self.clock;
        let Some(l1) = (0..self.l1).find(|&a| self.arrays[a].holds(PageSize::Size4K)) else {
            return (0, None);
        };
        let gfn = |r: u64| Gfn(first.0 - r);
        if self.arrays[l1].order.is_none() {
            let mut last = None;
            let mut done = 0;
            while done < n {
                debug_assert!(self.find(&probes.first, probes.kind, gfn(done)).is_none());
                let Some((a, i)) = self.second_level_4k(probes, gfn(done)) else {
                    break;
                };
                self.use_slot(a, i);
                // As lookup() remembers it.
                last = Some(self.promote((a, i), gfn(done)).unwrap_or((a, i)));
                done += 1;
            }
            return (done, last);
        }
        // A combined lookup probes the second level's 4K entries first.
        let a2 = match probes.second.first() {
            Some(&(a, PageSize::Size4K)) if self.arrays[a].order.is_none() => a,
            _ => return (0, None),
        };
        debug_assert_eq!(probes.kind, EntryKind::Combined);
        let gen = self.gen_of(EntryKind::Combined);
        let key = |g: u64| key_of(EntryKind::Combined, gen, PageSize::Size4K, Gfn(g));
        if self.swept_array != a2 {
            // Windows and pending copies read the array they were made in.
            self.materialize_windows();
            self.materialize_refill();
        }
        self.swept_array = a2;
        let low = (first.0 + 1).saturating_sub(n);
        let mut done = 0;
        while done < n {
            let g = first.0 - done;
            if let Some(w) = self.swept.covering(g) {
                // Every gfn a window covers has its entry.
                done += g - w.lo.max(low) + 1;
                continue;
            }
            // (The first level may still hold an entry the sweep reaches only after the copies
            // before it evict it.)
            let Some(i) = self.slot_4k(a2, g, key(g)) else {
                break;
            };
            debug_assert_eq!(self.second_level_4k(probes, Gfn(g)), Some((a2, i)));
            self.arrays[a2].stamp[i] = LAZY;
            done += 1;
        }
        if done == 0 {
            return (0, None);
        }
        self.swept.take_over(SweptWindow {
            lo: first.0 + 1 - done,
            hi: first.0,
            base: clock + 2 * first.0 + 1,
        });
        while let Some(w) = self.swept.pop_excess() {
            self.stamp_swept(&w);
        }
        let ways = self.arrays[l1].shape.ways as u64;
        let skipped = done.saturating_sub(ways);
        if done < ways {
            // The copies go on top of what the first level holds.
            self.materialize_refill();
        }
        let o = self.arrays[l1].order.as_mut().expect("ordered");
        o.rotate(skipped % ways);
        let last = if done >= ways {
            // Every way takes a copy, front first, and moves to the back, which leaves the
            // order as it is: the copies are written when something reads them, and those of
            // the sweep before (if still pending) never are.
            self.refill = Some(PendingRefill {
                array: l1,
                top: first.0 - skipped,
                stamp: clock + 2 * skipped + 2,
            });
            Some((l1, o.back as usize))
        } else {
            // The copies load() would make, each key known to be absent: into the front way,
            // which moves to the back; the signature is rebuilt once at the end.
            let mut last = None;
            for r in 0..done {
                let g = first.0 - r;
                let i = self
                    .slot_4k(a2, g, key(g))
                    .expect("the window holds its entries");
                let payload = Payload::unpack(self.arrays[a2].payload[i]);
                let arr = &mut self.arrays[l1];
                let w = arr.victim(0);
                arr.replace(w, key(g), clock + 2 * r + 2, payload);
                last = Some((l1, w));
            }
            self.arrays[l1].rebuild_sig(0);
            last
        };
        self.clock = clock + 2 * done;
        #[cfg(debug_assertions)]
        self.check_lazy();
        (done, last)
    }

    /// The second-level 4K entry a combined lookup of `gfn` finds (`probes`), if the lookup
    /// finds one: when the lookup's first probe is the 4K one, its set searched way by way
    /// (in a sweep every search hits).
    #[inline]
    fn second_level_4k(&self, probes: &Probes, gfn: Gfn) -> Option<Slot> {
        let slot = match probes.second.first() {
            Some(&(a, PageSize::Size4K)) => {
                let arr = &self.arrays[a];
                let key = key_of(probes.kind, self.gen_of(probes.kind), PageSize::Size4K, gfn);
                arr.position(arr.set(gfn, PageSize::Size4K), key)
                    .map(|i| (a, i))
            }
            _ => self
                .find(&probes.second, probes.kind, gfn)
                .filter(|&s| self.entry(s).1 == PageSize::Size4K),
        };
        debug_assert!(
            slot.is_none() || self.find(&probes.second, probes.kind, gfn) == slot,
            "{gfn:?}"
        );
        slot
    }

    /// Every entry's key, stamp, frame and flags, and the clock, for tests that compare two
    /// TLBs.
    #[cfg(test)]
    pub(crate) fn state(&self) -> Vec<u64> {
        self.check_lazy();
        // What is pending, written out in a copy.
        let mut t = self.clone();
        t.materialize_loads();
        t.materialize_windows();
        t.materialize_refill();
        let mut v = vec![t.clock];
        for arr in &t.arrays {
            v.extend(arr.key.iter().chain(arr.stamp.iter()));
            v.extend(
                arr.payload
                    .iter()
                    .map(|&w| Payload::unpack(w))
                    .flat_map(|p| [p.pfn, u64::from(p.writable) | u64::from(p.dirty) << 1]),
            );
            if let Some(o) = &arr.order {
                v.push(u64::from(o.front));
                v.extend(o.next.iter().map(|&w| u64::from(w)));
            }
        }
        v
    }

    /// The slot `slot` stands for once the window is written ([`TlbArrays::resolve`]), for
    /// tests that compare two TLBs.
    #[cfg(test)]
    pub(crate) fn resolved(&self, slot: Slot) -> Slot {
        match slot {
            WINDOW_TOP => self.clone().resolve(slot),
            s => s,
        }
    }

    /// Drops every entry of the class of `kind` (a generation increment).
    pub(crate) fn flush_class(&mut self, kind: EntryKind) {
        // The windows' entries go stale with their class; their stamps stay what they were.
        self.materialize_loads();
        self.materialize_windows();
        self.materialize_refill();
        let c = kind.class();
        self.gen[c] = (self.gen[c] + 1) & GEN_MAX;
        if self.gen[c] == 0 {
            // Wrapped: entries of an old generation could match again; empty the arrays.
            for arr in &mut self.arrays {
                arr.key.iter_mut().for_each(|k| *k = 0);
                arr.stamp.iter_mut().for_each(|st| *st = 0);
                if let Some(o) = &mut arr.order {
                    o.reset();
                }
            }
            self.gen = [1, 1];
        }
    }

    /// Drops the entries of the kinds in `kinds` that overlap `[start, start + pages)`, in one
    /// pass over the arrays.
    pub(crate) fn invalidate(&mut self, kinds: &[EntryKind], start: Gfn, pages: u64) {
        if pages == 0 {
            return;
        }
        let end = start.0.saturating_add(pages);
        self.materialize_loads();
        self.materialize_refill();
        if kinds.contains(&EntryKind::Combined) && self.swept.overlaps(start.0, end - 1) {
            self.materialize_windows();
        }
        // Per kind code, the generation and kind bits a live entry of it carries; a kind not
        // in `kinds` keeps a tag no masked key equals (its gfn and size bits are set).
        let mut tags = [u64::MAX; 4];
        for &kind in kinds {
            tags[kind as usize] =
                (self.gen_of(kind) as u64) << GEN_SHIFT | (kind as u64) << KIND_SHIFT;
        }
        let tag_mask = !((3 << SIZE_SHIFT) | GFN_MASK);
        for arr in &mut self.arrays {
            for i in 0..arr.key.len() {
                let k = arr.key[i];
                if k & tag_mask == tags[((k >> KIND_SHIFT) & 3) as usize] {
                    let first = k & GFN_MASK;
                    let last = first + size_of_code((k >> SIZE_SHIFT) & 3).pages() - 1;
                    if first < end && start.0 <= last {
                        arr.key[i] = 0;
                        arr.stamp_zero(i);
                    }
                }
            }
        }
    }

    /// Drops the entries of `kind` that map `gfn`, of the sizes `sizes`, looking only where
    /// such an entry can sit.
    pub(crate) fn invalidate_gfn(&mut self, kind: EntryKind, gfn: Gfn, sizes: &[PageSize]) {
        if gfn.0 > GFN_MASK {
            return;
        }
        self.materialize_loads();
        self.materialize_refill();
        if kind == EntryKind::Combined
            && sizes.contains(&PageSize::Size4K)
            && self.swept.covering(gfn.0).is_some()
        {
            self.materialize_windows();
        }
        let gen = self.gen_of(kind);
        for a in self.arrays_of(kind) {
            let arr = &mut self.arrays[a];
            for &size in sizes {
                if !arr.holds(size) {
                    continue;
                }
                let key = key_of(kind, gen, size, gfn);
                for i in arr.ways(arr.set(gfn, size)) {
                    if arr.key[i] == key {
                        arr.key[i] = 0;
                        arr.stamp_zero(i);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `t` has a valid entry of `kind` mapping `gfn`, of any size.
    fn found(t: &mut TlbArrays, kind: EntryKind, gfn: u64) -> bool {
        let probes = t.probes(kind, ALL_SIZES);
        t.lookup(&probes, Gfn(gfn)).is_some()
    }

    #[test]
    fn a_flush_is_a_generation_and_survives_wrapping() {
        let mut t = TlbArrays::new(&NEOVERSE_N1);
        let p = Payload::default();
        t.insert(EntryKind::Combined, Gfn(3), PageSize::Size4K, p);
        t.insert(EntryKind::Stage2, Gfn(0x200), PageSize::Size2M, p);
        t.insert(EntryKind::Stage2Walk, Gfn(0x400), PageSize::Size2M, p);
        t.gen[0] = GEN_MAX;
        t.insert(EntryKind::Combined, Gfn(4), PageSize::Size4K, p);
        assert!(found(&mut t, EntryKind::Combined, 4));
        t.flush_class(EntryKind::Combined);
        assert_eq!(t.gen, [1, 1], "wrapped past 0: every class starts again");
        for (kind, gfn) in [
            (EntryKind::Combined, 3),
            (EntryKind::Combined, 4),
            (EntryKind::Stage2, 0x200),
            (EntryKind::Stage2Walk, 0x400),
        ] {
            assert!(!found(&mut t, kind, gfn), "{kind:?} {gfn:#x}");
        }
        t.insert(EntryKind::Combined, Gfn(3), PageSize::Size4K, p);
        assert!(found(&mut t, EntryKind::Combined, 3));
    }

    #[test]
    fn kinds_do_not_match_each_other() {
        let mut t = TlbArrays::new(&CASCADE_LAKE);
        let p = Payload::default();
        t.insert(EntryKind::Stage2, Gfn(0x200), PageSize::Size2M, p);
        t.insert(EntryKind::Walk, Gfn(0x400), PageSize::Size2M, p);
        assert!(!found(&mut t, EntryKind::Combined, 0x200));
        assert!(!found(&mut t, EntryKind::Stage2, 0x400));
        assert!(found(&mut t, EntryKind::Walk, 0x401));
        t.insert(EntryKind::Stage2Walk, Gfn(0x600), PageSize::Size2M, p);
        assert!(!found(&mut t, EntryKind::Walk, 0x600));
        assert!(!found(&mut t, EntryKind::Stage2, 0x600));
        assert!(!found(&mut t, EntryKind::Stage2Walk, 0x400));
        assert!(found(&mut t, EntryKind::Stage2Walk, 0x7ff));
        t.flush_class(EntryKind::Combined);
        assert!(!found(&mut t, EntryKind::Walk, 0x401), "stage-1 class");
        assert!(found(&mut t, EntryKind::Stage2, 0x200));
        assert!(found(&mut t, EntryKind::Stage2Walk, 0x600), "stage-2 class");
        t.flush_class(EntryKind::Stage2);
        assert!(
            !found(&mut t, EntryKind::Stage2Walk, 0x600),
            "stage-2 class"
        );
    }

    /// The victim of a load as the rule reads without aging stale entries: the way already
    /// holding the key, else the first way of the least age, where a way's age is its stamp,
    /// in a second-level array only if its key is of its class's current generation (0 if
    /// not; a first-level array's stale entries are older than its live ones anyway).
    fn victim_by_liveness(t: &TlbArrays, a: usize, set: usize, key: u64) -> usize {
        let arr = &t.arrays[a];
        let ways = arr.ways(set);
        if let Some(i) = arr.key[ways.clone()].iter().position(|k| *k == key) {
            return ways.start + i;
        }
        let live = |k: u64| {
            let gen = (k >> GEN_SHIFT) as u32;
            a < t.l1 || gen != 0 && gen == t.gen[((k >> KIND_SHIFT) & 1) as usize]
        };
        let age = |i: &usize| if live(arr.key[*i]) { arr.stamp[*i] } else { 0 };
        ways.min_by_key(age).expect("a set has ways")
    }

    /// Every key in a set has its bit in the set's signature, whatever loads, invalidations
    /// and flushes came before (a clear bit answers "not here" without reading the ways); a
    /// lookup finds what a plain scan of the sets finds; and a load replaces the way the rule
    /// without aging ([`victim_by_liveness`]) picks.
    #[test]
    fn a_sets_signature_covers_every_key_in_it() {
        let mut rng = crate::lab::memstress::GuestRandom::new(11);
        let kinds = [
            EntryKind::Combined,
            EntryKind::Stage2,
            EntryKind::Walk,
            EntryKind::Stage2Walk,
        ];
        for geometry in [&NEOVERSE_N1, &CASCADE_LAKE] {
            let mut t = TlbArrays::new(geometry);
            for _ in 0..50_000 {
                let r = rng.next_u32();
                let kind = kinds[(r % 4) as usize];
                let size = ALL_SIZES[(r as usize / 4) % 3];
                let gfn = Gfn(u64::from(rng.next_u32() % 8192));
                match r / 16 % 8 {
                    0..=4 => {
                        // As `insert` does: a combined entry into the second level, then the
                        // first.
                        let ranges = match kind {
                            EntryKind::Combined => vec![t.l1..t.walk, 0..t.l1],
                            _ => vec![t.arrays_of(kind)],
                        };
                        for range in ranges {
                            let Some(a) = range.clone().find(|&a| t.arrays[a].holds(size)) else {
                                continue;
                            };
                            let set = t.arrays[a].set(gfn, size);
                            let key = key_of(kind, t.gen_of(kind), size, gfn);
                            let want = victim_by_liveness(&t, a, set, key);
                            let slot = t.load(range, kind, gfn, size, Payload::default());
                            assert_eq!(slot, Some((a, want)), "{kind:?} {gfn:?} {size:?}");
                        }
                    }
                    5 => t.invalidate(&[kind], gfn, 1 + u64::from(r >> 8) % 64),
                    6 => t.invalidate_gfn(kind, gfn, ALL_SIZES),
                    _ => t.flush_class(kind),
                }
                for arr in &t.arrays {
                    // A one-set array's replacement order is its ways by (stamp, way).
                    if let Some(o) = &arr.order {
                        let mut listed = Vec::new();
                        let mut w = o.front;
                        while w != NIL {
                            listed.push(w as usize);
                            w = o.next[w as usize];
                        }
                        let mut by_stamp: Vec<usize> = (0..arr.shape.ways).collect();
                        by_stamp.sort_by_key(|&w| (arr.stamp[w], w));
                        assert_eq!(listed, by_stamp);
                    }
                    for set in 0..arr.shape.sets {
                        for &k in &arr.key[arr.ways(set)] {
                            let (word, bit) = key_bit(k, arr.sig_words);
                            let sig = arr.sig[set * arr.sig_words + word];
                            assert!(k == 0 || sig & bit != 0, "{k:#x}");
                        }
                    }
                }
                let probes = t.probes(kind, ALL_SIZES);
                let plain = probes.second.iter().chain(&probes.first).any(|&(a, size)| {
                    let arr = &t.arrays[a];
                    let key = key_of(kind, t.gen_of(kind), size, gfn);
                    arr.key[arr.ways(arr.set(gfn, size))].contains(&key)
                });
                assert_eq!(t.lookup(&probes, gfn).is_some(), plain, "{kind:?} {gfn:?}");
            }
        }
    }

    /// Ascending 4K combined loads that wait in the window (`win`) leave the arrays as the
    /// same loads made one by one (`one`), whatever comes between them: lookups of pages
    /// loaded lately and long ago, loads of every other kind and of pages already held,
    /// invalidations and flushes, and runs of any length (past twice the second level's
    /// entries, so sets replay from a later round). The whole state is compared after every
    /// step, and every exact answer a peek gives is the lookup's. A peek that knows what the
    /// arrays outside the window hold of its 2 MiB region, as a run learns it when it starts
    /// there, answers as one that does not (some regions hold a 2M entry ahead there).
    #[test]
    fn loads_that_wait_in_the_window_are_the_loads_one_by_one() {
        let mut rng = crate::lab::memstress::GuestRandom::new(29);
        let (mut win, mut one) = (TlbArrays::new(&CASCADE_LAKE), TlbArrays::new(&CASCADE_LAKE));
        let combined = win.probes(EntryKind::Combined, &[PageSize::Size4K, PageSize::Size2M]);
        let stage2 = win.probes(EntryKind::Stage2, &[PageSize::Size2M, PageSize::Size1G]);
        let payload = |g: u64| Payload {
            pfn: g ^ 0x5a5a,
            writable: !g.is_multiple_of(3),
            dirty: !g.is_multiple_of(5),
        };
        let (mut next, mut waited, mut exact_peeks) = (0x1000u64, 0u64, 0u64);
        let (mut outside_known, mut saturated_knowing, mut outside_held) = (0u64, 0u64, 0u64);
        let mut answered_inline = 0u64;
        let mut found_outside = 0u64;
        for step in 0..2_000 {
            let r = rng.next_u32();
            match r % 16 {
                0..=9 => {
                    // A run: on from where the last stopped, or somewhere else.
                    if r.is_multiple_of(7) {
                        next = 0x1000 + u64::from(rng.next_u32() % 0x8000);
                    } else if r.is_multiple_of(5) {
                        // Back over pages loaded lately, which a load then finds in place.
                        next -= 1 + u64::from(rng.next_u32() % 200);
                    }
                    let mut n = match r / 16 % 8 {
                        0 => 3_000 + u64::from(rng.next_u32() % 2_000),
                        _ => 1 + u64::from(rng.next_u32() % 90),
                    };
                    if r.is_multiple_of(11) {
                        // The page the run's load number `capacity` is of, loaded just before:
                        // the last way of its set that the window has not filled yet holds it.
                        // Or one a round of the second level's sets earlier, which the run
                        // reaches while two ways of its set are not filled yet.
                        let early = if (r / 16).is_multiple_of(2) { 0 } else { 129 };
                        let g = next + win.loads.capacity() - 1 - early;
                        let (p, g) = (payload(g), Gfn(g));
                        let w = win.insert(EntryKind::Combined, g, PageSize::Size4K, p);
                        assert_eq!(w, one.insert(EntryKind::Combined, g, PageSize::Size4K, p));
                        n = n.max(win.loads.capacity() + 10);
                    }
                    win.open_loads(Gfn(next));
                    let (mut w, mut o) = (None, None);
                    let mut region_known = false;
                    for g in next..next + n {
                        if g == next || g % 512 == 0 {
                            // What a run that starts here knows of its 2 MiB region.
                            region_known = win.region_outside_loads_misses(&combined, Gfn(g));
                            outside_known += u64::from(region_known);
                            outside_held += u64::from(!region_known);
                        }
                        if g % 4 != 0 {
                            // As a run looks the next page up before its write.
                            let seen = win.peek(&combined, Gfn(g));
                            assert!(seen.is_err() || seen == one.peek(&combined, Gfn(g)));
                            let knowing = win.peek_knowing(&combined, Gfn(g), region_known);
                            assert_eq!(knowing, seen, "{g:#x}: known {region_known}");
                            if win.misses_past_saturated_window(&combined, Gfn(g), region_known) {
                                assert_eq!(seen, Ok(None), "{g:#x}: answered without a search");
                                answered_inline += 1;
                            }
                            let saturated = win.loads.saturated();
                            saturated_knowing += u64::from(region_known && saturated);
                            found_outside += u64::from(saturated && matches!(seen, Ok(Some(_))));
                        }
                        w = win.insert(EntryKind::Combined, Gfn(g), PageSize::Size4K, payload(g));
                        o = one.insert(EntryKind::Combined, Gfn(g), PageSize::Size4K, payload(g));
                        waited += u64::from(w == Some(WINDOW_TOP));
                        if w == Some(WINDOW_TOP) {
                            // A page the window holds is never answered without a search.
                            let inline =
                                win.misses_past_saturated_window(&combined, Gfn(g), region_known);
                            assert!(!inline, "{g:#x} waits in the window");
                        }
                    }
                    // The last load's slot, as a lookup that remembers it would use it.
                    assert_eq!(w.map(|s| win.resolved(s)), o);
                    next += n;
                }
                10 | 11 => {
                    // A lookup, mostly of a page loaded lately; a peek first.
                    let back =
                        u64::from(rng.next_u32()) % if r.is_multiple_of(2) { 80 } else { 5_000 };
                    let g = Gfn(next.saturating_sub(back + 1) + u64::from(r / 16 % 3));
                    if let Ok(found) = win.peek(&combined, g) {
                        assert_eq!(found, one.peek(&combined, g).expect("nothing waits"));
                        exact_peeks += 1;
                    }
                    assert_eq!(win.lookup(&combined, g), one.lookup(&combined, g), "{g:?}");
                }
                12 => {
                    // Another kind's load: the walk cache, the second level, or a 2M combined
                    // entry ahead (its first-level copy is outside the window's arrays).
                    let g = Gfn(next + u64::from(rng.next_u32() % 0x4000));
                    let (kind, size) = [
                        (EntryKind::Walk, PageSize::Size2M),
                        (EntryKind::Stage2Walk, PageSize::Size2M),
                        (EntryKind::Stage2, PageSize::Size2M),
                        (EntryKind::Stage2, PageSize::Size1G),
                        (EntryKind::Combined, PageSize::Size2M),
                    ][(r / 16 % 5) as usize];
                    let p = Payload::default();
                    assert_eq!(win.insert(kind, g, size, p), one.insert(kind, g, size, p));
                    assert_eq!(win.lookup(&stage2, g), one.lookup(&stage2, g));
                }
                13 => {
                    // A page already held, loaded again (in place).
                    let g = next.saturating_sub(1 + u64::from(rng.next_u32() % 40));
                    let (p, g) = (payload(g + 1), Gfn(g));
                    let w = win.insert(EntryKind::Combined, g, PageSize::Size4K, p);
                    let o = one.insert(EntryKind::Combined, g, PageSize::Size4K, p);
                    assert_eq!(w, o);
                }
                14 => {
                    let g = Gfn(next.saturating_sub(u64::from(rng.next_u32() % 3_000)));
                    match r / 16 % 3 {
                        0 => win.invalidate_gfn(EntryKind::Combined, g, ALL_SIZES),
                        1 => win.invalidate(&[EntryKind::Combined], g, 1 + u64::from(r >> 20)),
                        _ => win.invalidate_gfn(EntryKind::Stage2Walk, g, &[PageSize::Size2M]),
                    }
                    match r / 16 % 3 {
                        0 => one.invalidate_gfn(EntryKind::Combined, g, ALL_SIZES),
                        1 => one.invalidate(&[EntryKind::Combined], g, 1 + u64::from(r >> 20)),
                        _ => one.invalidate_gfn(EntryKind::Stage2Walk, g, &[PageSize::Size2M]),
                    }
                }
                _ => {
                    let kind = [EntryKind::Combined, EntryKind::Stage2][(r / 16 % 2) as usize];
                    win.flush_class(kind);
                    one.flush_class(kind);
                }
            }
            assert_eq!(win.state(), one.state(), "step {step}");
        }
        assert!(waited > 50_000, "{waited} loads waited");
        assert!(exact_peeks > 100, "{exact_peeks} exact peeks");
        // Both answers of what a run knows of its region, and peeks that use it.
        assert!(
            outside_held > 5,
            "{outside_held} regions held outside the window"
        );
        assert!(
            outside_known > 1_000,
            "{outside_known} regions missed outside the window"
        );
        assert!(
            saturated_knowing > 10_000,
            "{saturated_knowing} peeks that knew"
        );
        assert!(
            found_outside > 100,
            "{found_outside} saturated peeks found an entry outside"
        );
        assert!(
            answered_inline > 10_000,
            "{answered_inline} peeks answered without a search"
        );
    }

    /// What the arrays outside the window hold of a 2 MiB region is known for the whole region
    /// only where they all map 2 MiB pages or larger: on Cascade Lake (a 2M combined entry
    /// held answers for its region and no other), never on Neoverse-N1, whose arrays outside
    /// any window (it opens none) hold 4K entries.
    #[test]
    fn only_huge_arrays_outside_the_window_answer_for_a_whole_region() {
        let mut cl = TlbArrays::new(&CASCADE_LAKE);
        let combined = cl.probes(EntryKind::Combined, &PageSize::ALL);
        assert!(cl.region_outside_loads_misses(&combined, Gfn(0x1234)));
        let p = Payload::default();
        cl.insert(EntryKind::Combined, Gfn(0x1200), PageSize::Size2M, p);
        assert!(!cl.region_outside_loads_misses(&combined, Gfn(0x13ff)));
        assert!(cl.region_outside_loads_misses(&combined, Gfn(0x1400)));
        let n1 = TlbArrays::new(&NEOVERSE_N1);
        let combined = n1.probes(EntryKind::Combined, &PageSize::ALL);
        assert!(!n1.region_outside_loads_misses(&combined, Gfn(0x1234)));
    }

    #[test]
    fn a_range_drops_every_kind_asked_for_in_one_pass_and_no_other() {
        let mut t = TlbArrays::new(&NEOVERSE_N1);
        let p = Payload::default();
        t.insert(EntryKind::Combined, Gfn(0x205), PageSize::Size4K, p);
        t.insert(EntryKind::Stage2, Gfn(0x200), PageSize::Size2M, p);
        t.insert(EntryKind::Walk, Gfn(0x200), PageSize::Size2M, p);
        t.insert(EntryKind::Stage2Walk, Gfn(0x200), PageSize::Size2M, p);
        t.invalidate(&[EntryKind::Stage2, EntryKind::Stage2Walk], Gfn(0x3ff), 1);
        assert!(found(&mut t, EntryKind::Combined, 0x205));
        assert!(found(&mut t, EntryKind::Walk, 0x205));
        assert!(!found(&mut t, EntryKind::Stage2, 0x205));
        assert!(!found(&mut t, EntryKind::Stage2Walk, 0x205));
    }
}
