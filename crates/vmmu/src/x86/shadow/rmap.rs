//! Reverse maps (rmaps): for one guest frame at one level, the set of SPTEs that map it.
//!
//! The shadow MMU needs to find every SPTE that maps a gfn (to write-protect it, zap it, age
//! it, ...), so each memslot keeps one [`KvmRmapHead`] per gfn per level. Most gfns are mapped
//! by zero or one SPTE, so a head is a single word: empty, one SPTE, or (bit 0 set) a pointer
//! to a chain of [`PteListDesc`]s holding [`PTE_LIST_EXT`] SPTEs each. The same list also
//! records a shadow page's `parent_ptes`. KVM stores each SPTE's address; here an entry is a
//! [`SptepRef`] (page and index) packed into a word with the same properties (never zero, bit 0
//! clear), so nothing read from an rmap is ever dereferenced as a pointer.
//!
//! Everything here runs with `mmu_lock` held for write, which the borrow checker expresses as
//! `&mut KvmRmapHead`; no atomics are needed. Descriptors are allocated from a
//! [`PteListDescCache`] filled before the lock is taken, because code under the lock must not
//! allocate (in the kernel it cannot sleep there).
//!
//! The list is kept in KVM's shape, because its cost and iteration order are part of what the
//! model reproduces: new entries go into the head descriptor, a new head is pushed only when the
//! old one is full (so every tail descriptor is full and its `tail_count` never changes), and a
//! removal fills its hole with the head descriptor's last entry.

use std::collections::HashSet;
use std::fmt;
use std::num::NonZeroU64;

use crate::kvm::host_caches::{HostCaches, MetaRegion};
use crate::kvm::memslot::Memslot;
use crate::units::Gfn;
use crate::x86::mmu::PT64_ROOT_MAX_LEVEL;
use crate::x86::shadow::sptep::{SpId, SptepRef};
use crate::x86::spte::{Level, X86Level, SPTE_ENT_PER_PAGE};

/// `PTE_LIST_EXT`: SPTEs per descriptor, chosen so that a [`PteListDesc`] fills
/// exactly two 64-byte cache lines.
pub const PTE_LIST_EXT: usize = 14;

/// `PTE_PREFETCH_NUM`: SPTEs the shadow fault path may prefetch around the faulting one.
pub const PTE_PREFETCH_NUM: usize = 8;

/// How many descriptors `mmu_topup_memory_caches()` asks the vCPU's descriptor cache to hold
/// before a fault takes `mmu_lock`: one per level a fault can link a new shadow page at
/// (`parent_ptes`), one for the leaf's rmap, and one per prefetched SPTE. Each of those adds
/// at most one descriptor, so the fault never finds the cache empty. (KVM passes the
/// expression `1 + PT64_ROOT_MAX_LEVEL + PTE_PREFETCH_NUM` without naming it.)
pub const PTE_LIST_DESC_CACHE_MIN: usize = 1 + PT64_ROOT_MAX_LEVEL + PTE_PREFETCH_NUM;

/// `SPLIT_DESC_CACHE_MIN_NR_OBJECTS`: descriptors eager page splitting needs per huge page in
/// the worst case: one for each of the `SPTE_ENT_PER_PAGE` new leaf SPTEs' rmaps, plus one to
/// extend the new child page's `parent_ptes`. `need_topup_split_caches_or_resched()` drops
/// `mmu_lock` to top up when fewer remain; `topup_split_caches()` creates the cache with a
/// capacity of this plus `KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE`, so that a few aliased gfns do not
/// force an immediate refill.
pub const SPLIT_DESC_CACHE_MIN_NR_OBJECTS: usize = SPTE_ENT_PER_PAGE + 1;

/// `RMAP_RECYCLE_THRESHOLD`: when [`pte_list_add`] reports more than this many SPTEs already in
/// a gfn's rmap, `__rmap_add()` zaps the whole rmap rather than let it grow without bound.
pub const RMAP_RECYCLE_THRESHOLD: usize = 1000;

/// Bit 0 of [`KvmRmapHead`]: set when the head points to a [`PteListDesc`] rather than holding
/// a single SPTE.
pub const KVM_RMAP_MANY: u64 = 1;

/// An rmap entry: a [`SptepRef`] packed into the one word KVM stores (an SPTE's address
/// there). The packing keeps what the head encoding needs of an address: never zero, bit 0
/// clear. Bits 3..12 hold the index (where an 8-byte SPTE's address has it) and bits 12 and up
/// the page id plus one.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
struct RmapEntry(NonZeroU64);

impl RmapEntry {
    fn new(s: SptepRef) -> Self {
        assert!(
            s.index < SPTE_ENT_PER_PAGE,
            "SPTE index {} out of range",
            s.index
        );
        let word = (u64::from(s.sp.0) + 1) << 12 | (s.index as u64) << 3;
        RmapEntry(NonZeroU64::new(word).expect("the page id is stored plus one"))
    }

    /// The entry a single-entry head holds in its word.
    fn from_word(word: u64) -> Self {
        debug_assert!(word & 7 == 0 && word >> 12 != 0, "bad rmap word {word:#x}");
        RmapEntry(NonZeroU64::new(word).expect("a single-entry head is nonzero"))
    }

    fn word(self) -> u64 {
        self.0.get()
    }

    fn sptep(self) -> SptepRef {
        let w = self.word();
        SptepRef::new(SpId((w >> 12) as u32 - 1), ((w & 0xfff) >> 3) as usize)
    }
}

/// `struct pte_list_desc`: one link of an rmap's chain.
///
/// The layout is KVM's: the metadata first, so that reading the counts or the first few entries
/// touches one cache line, then the entries, 128 bytes in all. Entries `0..spte_count` are
/// present and the rest are `None`.
#[repr(C)]
#[derive(Debug)]
pub struct PteListDesc {
    /// The next descriptor, which was the head before this one was pushed. Every descriptor
    /// reachable through `more` is full.
    more: Option<Box<PteListDesc>>,
    /// Entries used in this descriptor.
    spte_count: u32,
    /// Entries in all the descriptors after this one. Because tails are always full and never
    /// change size, this is fixed when the descriptor is pushed.
    tail_count: u32,
    /// The SPTEs.
    sptes: [Option<RmapEntry>; PTE_LIST_EXT],
}

// The head encoding needs bit 0 of a descriptor's address to be clear, and the cache-line
// argument for PTE_LIST_EXT = 14 needs the size to be what KVM's is.
const _: () = assert!(std::mem::align_of::<PteListDesc>() >= 2);
const _: () = assert!(std::mem::size_of::<PteListDesc>() == 128);

impl PteListDesc {
    /// A zeroed descriptor, as KVM's `__GFP_ZERO` cache hands out.
    fn new() -> Self {
        PteListDesc {
            more: None,
            spte_count: 0,
            tail_count: 0,
            sptes: [None; PTE_LIST_EXT],
        }
    }

    fn count(&self) -> usize {
        self.spte_count as usize
    }

    /// The present entries of this descriptor.
    fn entries(&self) -> impl Iterator<Item = SptepRef> + '_ {
        self.sptes[..self.count()].iter().map(|s| {
            s.expect("pte_list_desc entry below spte_count is empty")
                .sptep()
        })
    }
}

/// `struct kvm_rmap_head`: the set of SPTEs mapping one gfn at one level (or a shadow page's
/// `parent_ptes`).
///
/// One word: 0 when empty; an SPTE (bit 0 clear) when there is exactly one entry and no
/// descriptor has been allocated; otherwise the address of the head [`PteListDesc`] with
/// [`KVM_RMAP_MANY`] set. Once a descriptor is allocated, the head keeps using it down to a
/// single entry, as KVM does; it only becomes 0 again when the last entry goes.
///
/// A head owns its descriptors but does not free them when dropped (it has no `Drop`, like the
/// kernel structure it models): whoever owns an array of heads must empty each one first, with
/// [`pte_list_destroy`] or [`pte_list_free`], or the descriptors leak. For the same reason it is
/// not `Clone`; make arrays with [`KvmRmapHead::new_array`].
#[repr(transparent)]
#[derive(Default)]
pub struct KvmRmapHead {
    val: u64,
}

/// What a head holds, decoded.
enum RmapView<'a> {
    Empty,
    One(SptepRef),
    Many(&'a PteListDesc),
}

impl KvmRmapHead {
    /// An array of `n` empty heads, as `memslot_rmap_alloc()` makes with a zeroed allocation.
    pub fn new_array(n: usize) -> Box<[KvmRmapHead]> {
        std::iter::repeat_with(KvmRmapHead::default)
            .take(n)
            .collect()
    }

    /// True when no SPTE is in the rmap.
    pub fn is_empty(&self) -> bool {
        self.val == 0
    }

    /// The raw encoded word, for diagnostics.
    pub fn raw(&self) -> u64 {
        self.val
    }

    /// The addresses of the rmap's descriptors, head first: where the model keeps them, which
    /// stays the same while they are in the chain.
    pub fn desc_addrs(&self) -> impl Iterator<Item = u64> + '_ {
        let first = match self.view() {
            RmapView::Many(d) => Some(d),
            _ => None,
        };
        std::iter::successors(first, |d| d.more.as_deref()).map(|d| d as *const PteListDesc as u64)
    }

    /// How many descriptors `pte_list_remove()` reads to find `spte`: the head one through the
    /// one holding it (all of them if none does).
    pub fn descs_to(&self, spte: SptepRef) -> usize {
        let first = match self.view() {
            RmapView::Many(d) => Some(d),
            _ => None,
        };
        let mut n = 0;
        for d in std::iter::successors(first, |d| d.more.as_deref()) {
            n += 1;
            if d.entries().any(|s| s == spte) {
                break;
            }
        }
        n
    }

    /// The SPTEs in KVM's order (`for_each_rmap_spte`): the head descriptor's entries from
    /// index 0 up, then each older descriptor's.
    pub fn iter(&self) -> RmapIterator<'_> {
        match self.view() {
            RmapView::Empty => RmapIterator {
                single: None,
                desc: None,
                pos: 0,
            },
            RmapView::One(s) => RmapIterator {
                single: Some(s),
                desc: None,
                pos: 0,
            },
            RmapView::Many(d) => RmapIterator {
                single: None,
                desc: Some(d),
                pos: 0,
            },
        }
    }

    /// `rmap_get_first()`: the first SPTE in iteration order. Loops that remove the entry they
    /// are looking at (e.g. zapping one SPTE at a time) call this again after each removal,
    /// because removal moves entries around.
    pub fn first(&self) -> Option<SptepRef> {
        self.iter().next()
    }

    fn view(&self) -> RmapView<'_> {
        if self.val == 0 {
            RmapView::Empty
        } else if self.val & KVM_RMAP_MANY == 0 {
            RmapView::One(RmapEntry::from_word(self.val).sptep())
        } else {
            // SAFETY: with bit 0 set, `val` is a pointer made by `Box::into_raw` in `set_desc`,
            // and the descriptor it points to is owned by this head alone (heads are not Clone,
            // `val` is private, and only `take_desc` gives ownership back). It is freed only
            // through `&mut self`, so it outlives this shared borrow of `self`.
            RmapView::Many(unsafe {
                &*((self.val & !KVM_RMAP_MANY) as usize as *const PteListDesc)
            })
        }
    }

    /// The head descriptor, mutably. Only for a head holding descriptors.
    fn head_desc_mut(&mut self) -> &mut PteListDesc {
        assert!(self.val & KVM_RMAP_MANY != 0);
        // SAFETY: as in `view`: the pointer came from `Box::into_raw` and is owned by this head
        // alone; `&mut self` makes this the only reference to it for the borrow's length.
        unsafe { &mut *((self.val & !KVM_RMAP_MANY) as usize as *mut PteListDesc) }
    }

    /// Takes the descriptor chain out of the head, leaving it empty. Only for a head holding
    /// descriptors.
    fn take_desc(&mut self) -> Box<PteListDesc> {
        assert!(self.val & KVM_RMAP_MANY != 0);
        let raw = (self.val & !KVM_RMAP_MANY) as usize as *mut PteListDesc;
        self.val = 0;
        // SAFETY: the pointer came from `Box::into_raw` in `set_desc` and the head owned it; the
        // head was cleared above, so ownership moves back to exactly one Box.
        unsafe { Box::from_raw(raw) }
    }

    /// Makes `desc` the head descriptor. The head must not hold a descriptor already (it would
    /// leak).
    fn set_desc(&mut self, desc: Box<PteListDesc>) {
        debug_assert!(self.val & KVM_RMAP_MANY == 0);
        self.val = Box::into_raw(desc) as usize as u64 | KVM_RMAP_MANY;
    }
}

impl fmt::Debug for KvmRmapHead {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// KVM's `struct rmap_iterator` with `rmap_get_first()`/`rmap_get_next()`: walks an rmap's
/// SPTEs without changing it.
pub struct RmapIterator<'a> {
    single: Option<SptepRef>,
    desc: Option<&'a PteListDesc>,
    pos: usize,
}

impl Iterator for RmapIterator<'_> {
    type Item = SptepRef;

    fn next(&mut self) -> Option<SptepRef> {
        if let Some(s) = self.single.take() {
            return Some(s);
        }
        while let Some(d) = self.desc {
            if self.pos < d.count() {
                self.pos += 1;
                return d.sptes[self.pos - 1].map(RmapEntry::sptep);
            }
            self.desc = d.more.as_deref();
            self.pos = 0;
        }
        None
    }
}

/// `kvm_mmu_memory_cache` specialised to descriptors (`mmu_pte_list_desc_cache`, and eager
/// split's `split_desc_cache`): descriptors allocated before `mmu_lock` is taken so that
/// [`pte_list_add`] never allocates under it. Freed descriptors are not returned here; like
/// `mmu_free_pte_list_desc()` they go straight back to the allocator.
pub struct PteListDescCache {
    // The boxes are the point: each is a heap allocation made ahead of time, which `alloc`
    // hands out under `mmu_lock` without allocating. A `Vec<PteListDesc>` would have to box on
    // the way out.
    #[allow(clippy::vec_box)]
    objs: Vec<Box<PteListDesc>>,
    capacity: usize,
    /// Allocations that found the cache empty. KVM WARNs and falls back to an atomic
    /// allocation; here it is counted so a test can assert that top-ups were big enough.
    pub empty_allocs: u64,
}

impl PteListDescCache {
    /// An empty cache that a top-up fills to `capacity` descriptors.
    pub fn new(capacity: usize) -> Self {
        PteListDescCache {
            objs: Vec::with_capacity(capacity),
            capacity,
            empty_allocs: 0,
        }
    }

    /// Descriptors in the cache.
    pub fn nr_objs(&self) -> usize {
        self.objs.len()
    }

    /// `kvm_mmu_topup_memory_cache()`: returns at once if at least `min` descriptors are
    /// cached, otherwise fills to the larger of the capacity and `min`. Returns the number of
    /// descriptors allocated.
    pub fn topup(&mut self, min: usize) -> usize {
        if self.objs.len() >= min {
            return 0;
        }
        let n = self.capacity.max(min) - self.objs.len();
        self.objs
            .extend(std::iter::repeat_with(|| Box::new(PteListDesc::new())).take(n));
        n
    }

    /// `kvm_mmu_memory_cache_alloc()`: a zeroed descriptor from the cache. An empty cache means
    /// the caller's top-up was too small; that is counted in `empty_allocs` and served by a
    /// direct allocation.
    pub fn alloc(&mut self) -> Box<PteListDesc> {
        match self.objs.pop() {
            Some(d) => d,
            None => {
                self.empty_allocs += 1;
                Box::new(PteListDesc::new())
            }
        }
    }

    /// `kvm_mmu_free_memory_cache()`: frees every cached descriptor.
    pub fn free_all(&mut self) {
        self.objs.clear();
    }
}

/// `pte_list_add()`: adds `spte` to the rmap at `head`, taking a descriptor from `cache` when
/// one is needed. `spte` must not already be in the rmap.
///
/// Returns the number of SPTEs that were in the rmap *before* this one was added; `__rmap_add()`
/// compares it with [`RMAP_RECYCLE_THRESHOLD`].
pub fn pte_list_add(cache: &mut PteListDescCache, spte: SptepRef, head: &mut KvmRmapHead) -> usize {
    let spte = RmapEntry::new(spte);
    if head.val == 0 {
        head.val = spte.word();
        return 0;
    }
    if head.val & KVM_RMAP_MANY == 0 {
        // The second entry: move the single one into a fresh descriptor next to the new one.
        let mut desc = cache.alloc();
        desc.sptes[0] = Some(RmapEntry::from_word(head.val));
        desc.sptes[1] = Some(spte);
        desc.spte_count = 2;
        desc.tail_count = 0;
        desc.more = None;
        head.val = 0;
        head.set_desc(desc);
        return 1;
    }
    let cur = head.head_desc_mut();
    let count = cur.tail_count as usize + cur.count();
    if cur.count() == PTE_LIST_EXT {
        // Push a new head rather than grow the full one: tails must stay full.
        let mut desc = cache.alloc();
        desc.more = Some(head.take_desc());
        desc.spte_count = 0;
        desc.tail_count = count as u32;
        desc.sptes = [None; PTE_LIST_EXT];
        head.set_desc(desc);
    }
    let desc = head.head_desc_mut();
    desc.sptes[desc.count()] = Some(spte);
    desc.spte_count += 1;
    count
}

/// `pte_list_desc_remove_entry()`: removes entry `i` of the descriptor `depth` links after the
/// head descriptor, filling the hole with the head descriptor's last entry so that tails stay
/// full, and frees the head descriptor if that leaves it empty.
fn pte_list_desc_remove_entry(head: &mut KvmRmapHead, depth: usize, i: usize) {
    let head_desc = head.head_desc_mut();
    // A head descriptor is never empty: it is pushed only to take an entry and popped as soon
    // as it loses its last one.
    assert!(
        head_desc.spte_count > 0,
        "rmap corrupted: empty head pte_list_desc"
    );
    let j = head_desc.count() - 1;
    let last = head_desc.sptes[j];

    let mut desc = head_desc;
    for _ in 0..depth {
        desc = desc
            .more
            .as_deref_mut()
            .expect("rmap entry found beyond the chain");
    }
    desc.sptes[i] = last;

    // Cleared after the move so that removing the head's last entry itself (i == j at depth 0)
    // leaves the slot empty.
    let head_desc = head.head_desc_mut();
    head_desc.sptes[j] = None;
    head_desc.spte_count -= 1;
    if head_desc.spte_count > 0 {
        return;
    }

    // The head descriptor is empty: the next one (if any) becomes the head, and the old head
    // is freed.
    let mut old = head.take_desc();
    if let Some(next) = old.more.take() {
        head.set_desc(next);
    }
}

/// `pte_list_remove()`: removes `spte` from the rmap at `head`. Descriptors that become empty
/// are freed.
///
/// Panics, naming the SPTE, if `spte` is not in the rmap: KVM treats that as data corruption
/// (`KVM_BUG_ON_DATA_CORRUPTION`). Returns how many descriptors past the head one the search
/// visited (the cost of a long rmap).
pub fn pte_list_remove(spte: SptepRef, head: &mut KvmRmapHead) -> usize {
    match head.view() {
        RmapView::Empty => panic!("pte_list_remove: SPTE {spte:?} not found: rmap is empty"),
        RmapView::One(only) => {
            assert!(
                only == spte,
                "pte_list_remove: SPTE {spte:?} not found: rmap holds only {only:?}"
            );
            head.val = 0;
            0
        }
        RmapView::Many(first) => {
            let mut found = None;
            let mut desc = Some(first);
            let mut depth = 0;
            while let Some(d) = desc {
                if let Some(i) = d.entries().position(|s| s == spte) {
                    found = Some((depth, i));
                    break;
                }
                desc = d.more.as_deref();
                depth += 1;
            }
            match found {
                Some((depth, i)) => {
                    pte_list_desc_remove_entry(head, depth, i);
                    depth
                }
                None => panic!("pte_list_remove: SPTE {spte:?} not found in rmap"),
            }
        }
    }
}

/// `pte_list_count()`: the number of SPTEs in the rmap, in O(1) from the head descriptor's
/// counts.
pub fn pte_list_count(head: &KvmRmapHead) -> usize {
    match head.view() {
        RmapView::Empty => 0,
        RmapView::One(_) => 1,
        RmapView::Many(d) => d.tail_count as usize + d.count(),
    }
}

/// The list walk of `kvm_zap_all_rmap_sptes()`: calls `f` on every SPTE in iteration order,
/// frees every descriptor and leaves the head empty. Returns true if there was at least one
/// SPTE.
///
/// The caller's `f` does what KVM does per entry (clear the SPTE and track its A/D bits). Use
/// [`pte_list_free`] when the SPTEs need no attention.
pub fn pte_list_destroy(head: &mut KvmRmapHead, mut f: impl FnMut(SptepRef)) -> bool {
    // The head is emptied before any callback runs, unlike KVM which clears it at the end: if
    // `f` panics, the head must not be left pointing at descriptors that unwinding frees.
    match std::mem::take(head).view_owned() {
        Owned::Empty => false,
        Owned::One(s) => {
            f(s);
            true
        }
        Owned::Many(mut desc) => {
            loop {
                desc.entries().for_each(&mut f);
                // Unlink before dropping so a long chain is freed iteratively, not by nested
                // drops.
                match desc.more.take() {
                    Some(next) => desc = next,
                    None => break,
                }
            }
            true
        }
    }
}

/// Frees every descriptor of the rmap and leaves it empty, without looking at the SPTEs: for
/// teardown, when the page tables are going away anyway.
pub fn pte_list_free(head: &mut KvmRmapHead) {
    pte_list_destroy(head, |_| {});
}

/// A head's contents with ownership of the descriptors.
enum Owned {
    Empty,
    One(SptepRef),
    Many(Box<PteListDesc>),
}

impl KvmRmapHead {
    fn view_owned(mut self) -> Owned {
        if self.val == 0 {
            Owned::Empty
        } else if self.val & KVM_RMAP_MANY == 0 {
            Owned::One(RmapEntry::from_word(self.val).sptep())
        } else {
            Owned::Many(self.take_desc())
        }
    }
}

/// What [`check_rmap`] found wrong with an rmap's structure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RmapCorruption(pub String);

/// Checks an rmap's structure: the head descriptor holds 1..=[`PTE_LIST_EXT`] entries, every
/// tail descriptor is full, each `tail_count` equals the entries after it, entries past
/// `spte_count` are empty, and no SPTE appears twice. Returns the number of SPTEs, or what is
/// wrong.
pub fn check_rmap(head: &KvmRmapHead) -> Result<usize, RmapCorruption> {
    let first = match head.view() {
        RmapView::Empty => return Ok(0),
        RmapView::One(_) => return Ok(1),
        RmapView::Many(d) => d,
    };

    let mut descs = Vec::new();
    let mut desc = Some(first);
    while let Some(d) = desc {
        descs.push(d);
        desc = d.more.as_deref();
    }

    let mut seen = HashSet::new();
    let mut after = 0usize;
    // From the oldest descriptor back to the head, so that `after` is each one's tail count.
    for (idx, d) in descs.iter().enumerate().rev() {
        let n = d.count();
        if idx == 0 {
            if !(1..=PTE_LIST_EXT).contains(&n) {
                return Err(RmapCorruption(format!(
                    "head pte_list_desc has spte_count {n}"
                )));
            }
        } else if n != PTE_LIST_EXT {
            return Err(RmapCorruption(format!(
                "tail pte_list_desc {idx} is not full: spte_count {n}"
            )));
        }
        if d.tail_count as usize != after {
            return Err(RmapCorruption(format!(
                "pte_list_desc {idx} has tail_count {} but {after} entries follow it",
                d.tail_count
            )));
        }
        for (i, s) in d.sptes.iter().enumerate() {
            match (i < n, s) {
                (true, None) => {
                    return Err(RmapCorruption(format!(
                        "pte_list_desc {idx} entry {i} is empty"
                    )));
                }
                (false, Some(s)) => {
                    return Err(RmapCorruption(format!(
                        "pte_list_desc {idx} entry {i} ({:?}) is past spte_count {n}",
                        s.sptep()
                    )));
                }
                (true, Some(s)) => {
                    if !seen.insert(*s) {
                        return Err(RmapCorruption(format!(
                            "SPTE {:?} is in the rmap twice",
                            s.sptep()
                        )));
                    }
                }
                (false, None) => {}
            }
        }
        after += n;
    }
    Ok(after)
}

/// `slot->arch.rmap[]`: one rmap head per gfn (per huge page above 4K) per level.
pub struct SlotRmaps {
    /// The slot's first gfn.
    pub base_gfn: Gfn,
    /// The slot's size in pages.
    pub npages: u64,
    /// `rmap[level - 1][gfn_to_index(gfn, base_gfn, level)]`.
    pub rmap: [Vec<KvmRmapHead>; 3],
    /// Where each level's array lives in host memory, once the host's caches are modelled
    /// ([`SlotRmaps::place`]).
    pub meta: [MetaRegion; 3],
}

/// `gfn_to_index()`.
pub fn gfn_to_index(gfn: Gfn, base_gfn: Gfn, level: Level) -> usize {
    ((gfn.0 >> level.gfn_shift()) - (base_gfn.0 >> level.gfn_shift())) as usize
}

impl SlotRmaps {
    /// `memslot_rmap_alloc()`: zeroed heads for every level.
    pub fn new(slot: &Memslot) -> Self {
        let lpages =
            |level: Level| gfn_to_index(slot.base_gfn + slot.npages - 1, slot.base_gfn, level) + 1;
        SlotRmaps {
            base_gfn: slot.base_gfn,
            npages: slot.npages,
            rmap: [1, 2, 3].map(|l| {
                let n = lpages(Level(l));
                // Zeroed, so untouched heads cost no memory (an all-zero head is empty).
                let mut v = Vec::with_capacity(n);
                v.resize_with(n, KvmRmapHead::default);
                v
            }),
            meta: [MetaRegion::default(); 3],
        }
    }

    /// Gives each level's array its host memory in `caches`, as `memslot_rmap_alloc()`
    /// allocates them (4K level first) with `__vcalloc()` in the VMM thread's
    /// `KVM_SET_USER_MEMORY_REGION`, whose zeroing passes every line through that core's
    /// caches. Arrays placed already keep their place.
    pub fn place(&mut self, caches: &HostCaches) {
        for (heads, meta) in self.rmap.iter().zip(&mut self.meta) {
            if meta.is_unplaced() {
                let vmm = caches.vmm_cpu();
                *meta = caches.alloc(vmm, std::mem::size_of_val::<[KvmRmapHead]>(heads) as u64);
                caches.zeroed(vmm, *meta);
            }
        }
    }

    /// The slot's end gfn.
    pub fn end_gfn(&self) -> Gfn {
        self.base_gfn + self.npages
    }

    /// `gfn_to_rmap()`.
    pub fn head(&mut self, gfn: Gfn, level: Level) -> &mut KvmRmapHead {
        let i = gfn_to_index(gfn, self.base_gfn, level);
        &mut self.rmap[level.0 as usize - 1][i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The `i`th SPTE of consecutive pages: distinct for distinct `i`.
    fn sp(i: u64) -> SptepRef {
        let n = SPTE_ENT_PER_PAGE as u64;
        SptepRef::new(SpId((i / n) as u32), (i % n) as usize)
    }

    /// Descriptor entry counts from the head onwards.
    fn shape(head: &KvmRmapHead) -> Vec<usize> {
        let mut out = Vec::new();
        if let RmapView::Many(d) = head.view() {
            let mut desc = Some(d);
            while let Some(d) = desc {
                out.push(d.count());
                desc = d.more.as_deref();
            }
        }
        out
    }

    fn addrs(head: &KvmRmapHead) -> Vec<SptepRef> {
        head.iter().collect()
    }

    fn fill(cache: &mut PteListDescCache, head: &mut KvmRmapHead, n: u64) {
        for i in 0..n {
            assert_eq!(pte_list_add(cache, sp(i), head), i as usize);
        }
    }

    #[test]
    fn constants_match_kvm() {
        assert_eq!(PTE_LIST_DESC_CACHE_MIN, 14);
        assert_eq!(SPLIT_DESC_CACHE_MIN_NR_OBJECTS, 513);
        assert_eq!(std::mem::size_of::<KvmRmapHead>(), 8);
    }

    #[test]
    fn rmap_entry_round_trips_and_keeps_bit_0_clear() {
        for s in [
            SptepRef::new(SpId(0), 0),
            SptepRef::new(SpId(0), SPTE_ENT_PER_PAGE - 1),
            SptepRef::new(SpId(u32::MAX - 1), 7),
        ] {
            let e = RmapEntry::new(s);
            assert_ne!(e.word(), 0);
            assert_eq!(e.word() & KVM_RMAP_MANY, 0);
            assert_eq!(e.sptep(), s);
            assert_eq!(RmapEntry::from_word(e.word()), e);
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn rmap_entry_rejects_an_index_past_the_table() {
        RmapEntry::new(SptepRef {
            sp: SpId(1),
            index: SPTE_ENT_PER_PAGE,
        });
    }

    #[test]
    fn single_becomes_desc_of_two() {
        let mut cache = PteListDescCache::new(4);
        cache.topup(4);
        let mut head = KvmRmapHead::default();
        assert!(head.is_empty());

        assert_eq!(pte_list_add(&mut cache, sp(0), &mut head), 0);
        assert_eq!(
            head.raw(),
            RmapEntry::new(sp(0)).word(),
            "one entry is stored inline"
        );
        assert_eq!(pte_list_count(&head), 1);
        assert_eq!(cache.nr_objs(), 4, "no descriptor for a single entry");

        assert_eq!(pte_list_add(&mut cache, sp(1), &mut head), 1);
        assert_eq!(head.raw() & KVM_RMAP_MANY, KVM_RMAP_MANY);
        assert_eq!(shape(&head), vec![2]);
        assert_eq!(pte_list_count(&head), 2);
        assert_eq!(addrs(&head), vec![sp(0), sp(1)]);
        assert_eq!(cache.nr_objs(), 3);
        assert_eq!(check_rmap(&head), Ok(2));
        pte_list_free(&mut head);
    }

    #[test]
    fn new_head_only_when_full() {
        let mut cache = PteListDescCache::new(8);
        cache.topup(8);
        let mut head = KvmRmapHead::default();
        fill(&mut cache, &mut head, PTE_LIST_EXT as u64);
        assert_eq!(shape(&head), vec![PTE_LIST_EXT]);

        assert_eq!(
            pte_list_add(&mut cache, sp(PTE_LIST_EXT as u64), &mut head),
            PTE_LIST_EXT
        );
        assert_eq!(shape(&head), vec![1, PTE_LIST_EXT]);
        if let RmapView::Many(d) = head.view() {
            assert_eq!(d.tail_count as usize, PTE_LIST_EXT);
        }
        assert_eq!(pte_list_count(&head), PTE_LIST_EXT + 1);

        // Fill the new head, then one more pushes a third descriptor.
        for i in PTE_LIST_EXT + 1..2 * PTE_LIST_EXT {
            pte_list_add(&mut cache, sp(i as u64), &mut head);
        }
        assert_eq!(shape(&head), vec![PTE_LIST_EXT, PTE_LIST_EXT]);
        pte_list_add(&mut cache, sp(99), &mut head);
        assert_eq!(shape(&head), vec![1, PTE_LIST_EXT, PTE_LIST_EXT]);
        assert_eq!(check_rmap(&head), Ok(2 * PTE_LIST_EXT + 1));

        // Head descriptor first, index 0 up, then the older ones.
        let mut want = vec![sp(99)];
        want.extend((PTE_LIST_EXT..2 * PTE_LIST_EXT).map(|i| sp(i as u64)));
        want.extend((0..PTE_LIST_EXT).map(|i| sp(i as u64)));
        assert_eq!(addrs(&head), want);
        assert_eq!(head.first(), Some(sp(99)));
        pte_list_free(&mut head);
    }

    #[test]
    fn removal_fills_hole_from_head_and_frees_empty_head() {
        let mut cache = PteListDescCache::new(4);
        let mut head = KvmRmapHead::default();
        // Head descriptor [14, 15], tail [0..=13].
        fill(&mut cache, &mut head, PTE_LIST_EXT as u64 + 2);
        assert_eq!(shape(&head), vec![2, PTE_LIST_EXT]);

        // A hole in the tail is filled with the head's last entry (15).
        pte_list_remove(sp(3), &mut head);
        assert_eq!(shape(&head), vec![1, PTE_LIST_EXT]);
        let mut want: Vec<SptepRef> = vec![sp(14)];
        want.extend((0..PTE_LIST_EXT as u64).map(|i| if i == 3 { sp(15) } else { sp(i) }));
        assert_eq!(addrs(&head), want);

        // Emptying the head descriptor frees it; the full tail becomes the head.
        pte_list_remove(sp(14), &mut head);
        assert_eq!(shape(&head), vec![PTE_LIST_EXT]);
        if let RmapView::Many(d) = head.view() {
            assert_eq!(d.tail_count, 0);
        }
        assert_eq!(check_rmap(&head), Ok(PTE_LIST_EXT));

        // Removing the head's own last entry leaves no stale slot behind.
        pte_list_remove(sp(13), &mut head);
        assert_eq!(check_rmap(&head), Ok(PTE_LIST_EXT - 1));
        assert_eq!(addrs(&head).last(), Some(&sp(12)));

        // Down to one entry the descriptor stays: no conversion back to the inline form.
        let left: Vec<SptepRef> = head.iter().collect();
        for s in &left[1..] {
            pte_list_remove(*s, &mut head);
        }
        assert_eq!(shape(&head), vec![1]);
        assert_eq!(head.raw() & KVM_RMAP_MANY, KVM_RMAP_MANY);
        assert_eq!(pte_list_count(&head), 1);

        pte_list_remove(left[0], &mut head);
        assert!(head.is_empty());
        assert_eq!(head.raw(), 0);
    }

    #[test]
    fn single_entry_remove() {
        let mut cache = PteListDescCache::new(1);
        let mut head = KvmRmapHead::default();
        pte_list_add(&mut cache, sp(7), &mut head);
        pte_list_remove(sp(7), &mut head);
        assert!(head.is_empty());
    }

    #[test]
    #[should_panic(expected = "SPTE SpId(0)[10] not found")]
    fn removing_absent_spte_panics_with_address() {
        let mut cache = PteListDescCache::new(4);
        let mut head = KvmRmapHead::default();
        fill(&mut cache, &mut head, 5);
        pte_list_remove(sp(10), &mut head);
    }

    #[test]
    #[should_panic(expected = "SPTE SpId(0)[1] not found")]
    fn removing_from_single_mismatch_panics() {
        let mut cache = PteListDescCache::new(1);
        let mut head = KvmRmapHead::default();
        pte_list_add(&mut cache, sp(0), &mut head);
        pte_list_remove(sp(1), &mut head);
    }

    #[test]
    #[should_panic(expected = "rmap is empty")]
    fn removing_from_empty_panics() {
        pte_list_remove(sp(1), &mut KvmRmapHead::default());
    }

    #[test]
    fn destroy_visits_each_once_and_empties() {
        let mut cache = PteListDescCache::new(8);
        for n in [0u64, 1, 2, PTE_LIST_EXT as u64, 40] {
            let mut head = KvmRmapHead::default();
            fill(&mut cache, &mut head, n);
            let mut seen = Vec::new();
            let any = pte_list_destroy(&mut head, |s| seen.push(s));
            assert_eq!(any, n > 0);
            let mut want: Vec<SptepRef> = (0..n).map(sp).collect();
            seen.sort_unstable();
            want.sort_unstable();
            assert_eq!(seen, want);
            assert!(head.is_empty());
            assert_eq!(pte_list_count(&head), 0);
            assert_eq!(check_rmap(&head), Ok(0));
        }
    }

    #[test]
    fn cache_topup_rule_and_empty_allocs() {
        let mut cache = PteListDescCache::new(40);
        assert_eq!(cache.topup(PTE_LIST_DESC_CACHE_MIN), 40);
        for _ in 0..26 {
            drop(cache.alloc());
        }
        assert_eq!(cache.topup(PTE_LIST_DESC_CACHE_MIN), 0, "14 left: at min");
        drop(cache.alloc());
        assert_eq!(cache.topup(PTE_LIST_DESC_CACHE_MIN), 27);
        assert_eq!(cache.nr_objs(), 40);
        // A minimum above the capacity wins.
        let mut split = PteListDescCache::new(8);
        assert_eq!(split.topup(SPLIT_DESC_CACHE_MIN_NR_OBJECTS), 513);
        cache.free_all();
        assert_eq!(cache.nr_objs(), 0);
        assert_eq!(cache.empty_allocs, 0);

        let mut head = KvmRmapHead::default();
        pte_list_add(&mut cache, sp(0), &mut head);
        assert_eq!(cache.empty_allocs, 0, "an inline entry needs no descriptor");
        pte_list_add(&mut cache, sp(1), &mut head);
        assert_eq!(cache.empty_allocs, 1);
        assert_eq!(check_rmap(&head), Ok(2));
        pte_list_free(&mut head);
    }

    #[test]
    fn new_array_is_empty() {
        let heads = KvmRmapHead::new_array(3);
        assert_eq!(heads.len(), 3);
        assert!(heads
            .iter()
            .all(|h| h.is_empty() && h.iter().next().is_none()));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Add,
        Remove(prop::sample::Index),
        Destroy,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            // Adds outweigh removes so that rmaps grow several descriptors deep; a rare destroy
            // starts over from empty.
            60 => Just(Op::Add),
            40 => any::<prop::sample::Index>().prop_map(Op::Remove),
            1 => Just(Op::Destroy),
        ]
    }

    proptest! {
        #[test]
        fn matches_a_set_model(ops in prop::collection::vec(op(), 1..300)) {
            let mut cache = PteListDescCache::new(PTE_LIST_DESC_CACHE_MIN);
            let mut head = KvmRmapHead::default();
            let mut model: Vec<SptepRef> = Vec::new();
            let mut next = 0u64;
            for op in ops {
                match op {
                    Op::Add => {
                        // Spread the addresses so they do not come in order.
                        let s = sp(next.wrapping_mul(0x9e37_79b9) % (1 << 30));
                        next += 1;
                        cache.topup(PTE_LIST_DESC_CACHE_MIN);
                        prop_assert_eq!(pte_list_add(&mut cache, s, &mut head), model.len());
                        model.push(s);
                    }
                    Op::Remove(idx) => {
                        if model.is_empty() {
                            continue;
                        }
                        let a = model.swap_remove(idx.index(model.len()));
                        pte_list_remove(a, &mut head);
                    }
                    Op::Destroy => {
                        let mut seen = Vec::new();
                        prop_assert_eq!(
                            pte_list_destroy(&mut head, |s| seen.push(s)),
                            !model.is_empty()
                        );
                        seen.sort_unstable();
                        model.sort_unstable();
                        prop_assert_eq!(&seen, &model);
                        model.clear();
                    }
                }
                prop_assert_eq!(check_rmap(&head), Ok(model.len()));
                prop_assert_eq!(pte_list_count(&head), model.len());
                let mut got = addrs(&head);
                got.sort_unstable();
                let mut want = model.clone();
                want.sort_unstable();
                prop_assert_eq!(got, want);
            }
            prop_assert_eq!(cache.empty_allocs, 0);
            pte_list_free(&mut head);
        }
    }
}
