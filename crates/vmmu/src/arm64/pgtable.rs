//! KVM/arm64's stage-2 page-table code (`arch/arm64/kvm/hyp/pgtable.c`): `struct kvm_pgtable`
//! with its concatenated start-level tables, `kvm_pgtable_walk()` over the generic walker, and
//! the operations as small visitors: `kvm_pgtable_stage2_map`, `_unmap`, `_wrprotect`,
//! `_relax_perms`, `_mkyoung`, `_test_clear_young` and `_split`, with break-before-make
//! (`stage2_try_break_pte()` / `stage2_make_pte()`) and table pages counted by reference.
//!
//! One code path serves exclusive walks (under the write lock: plain stores) and shared walks
//! (`KVM_PGTABLE_WALK_SHARED`, under the read lock: cmpxchg, the `KVM_INVALID_PTE_LOCKED`
//! marker while an entry is broken, tables freed through RCU), as it does since Linux 6.2.
//! Linux 6.1's exclusive-only walker differs in form, not in effect: it collapsed a table into a
//! block with an "anchor" entry cleared before the subtree was unmapped, and flushed the VMID
//! the same way.

use crate::arm64::mm::{
    free_unlinked_table, get_page, page_count, put_page, zalloc_page, Stage2MemCache, Stage2Page,
};
use crate::arm64::tlb::{
    kvm_tlb_flush_vmid_ipa, kvm_tlb_flush_vmid_ipa_nsh, kvm_tlb_flush_vmid_range,
};
use crate::arm64::{Arm64Cpu, RelaxFlush};
use crate::hw::page_table::{table_at, PageTable, PageTableStats};
use crate::hw::pgtable::walk::{walk_range, PtIter, Visit, WalkAction, WalkFlags, WalkRange};
use crate::hw::pgtable::{Level, PtFormat, PtGeometry, SpteCell, PTES_PER_TABLE};
use crate::hw::stage2::*;
use crate::hw::walker::{range_walks_complete, RangeWalk};
use crate::kvm::meter::Meter;
use crate::kvm::mmu_ctx::TableReads;
use crate::kvm::Kvm;
use crate::units::{Gfn, GfnRange, PageSize, Pfn};
use crossbeam_epoch::Guard;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Why an operation did not complete (the kernel's negative errnos).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PgtError {
    /// `-EAGAIN`: raced with another walker, or nothing to do at this entry; retry the access.
    Again,
    /// `-ENOMEM`: the memory cache was empty.
    NoMem,
    /// `-E2BIG` (inside the map walker only): no leaf can be installed at this level.
    TooBig,
    /// `-EINVAL`: a request the walker cannot satisfy (a leaf needed below the last level).
    Invalid,
}

/// `KVM_CREATE_VM` with an IPA size stage 2 at the 4K granule cannot have.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a {0}-bit IPA space: stage 2 at the 4K granule supports 32 to 48 bits")]
pub struct IpaSizeError(pub u32);

/// `enum kvm_pgtable_prot`: the permissions a mapping grants.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct KvmPgtableProt {
    /// `KVM_PGTABLE_PROT_R`.
    pub r: bool,
    /// `KVM_PGTABLE_PROT_W`.
    pub w: bool,
    /// `KVM_PGTABLE_PROT_X`.
    pub x: bool,
}

/// What [`KvmPgtable::kvm_pgtable_stage2_map`] maps: `kvm_pgtable_stage2_map()`'s `addr`,
/// `size`, `phys` and `prot`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Stage2Mapping {
    /// First guest frame (`addr`).
    pub gfn: Gfn,
    /// How much (`size`).
    pub size: PageSize,
    /// First host frame (`phys`).
    pub pfn: Pfn,
    /// The permissions granted.
    pub prot: KvmPgtableProt,
}

/// How [`KvmPgtable::kvm_pgtable_stage2_relax_perms`] writes the leaf and invalidates it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RelaxBy {
    /// A shared walk with cmpxchg (6.2+, every fault under the read lock).
    pub shared: bool,
    /// Which invalidation follows.
    pub flush: RelaxFlush,
    /// The faulting vCPU, whose PE a local invalidation runs on.
    pub vcpu: usize,
}

/// The attribute bits [`KvmPgtable::stage2_update_leaf_attrs`] sets and clears in each leaf.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct LeafAttrs {
    set: u64,
    clr: u64,
}

/// `stage2_set_prot_attr()`: the leaf attributes for `prot` on normal memory (MemAttr
/// `MT_S2_NORMAL`, or `MT_S2_FWB_NORMAL` with FEAT_S2FWB).
fn stage2_set_prot_attr(prot: KvmPgtableProt, fwb: bool) -> u64 {
    let memattr = if fwb {
        MT_S2_FWB_NORMAL << 2
    } else {
        KVM_PTE_LEAF_ATTR_LO_S2_MEMATTR
    };
    let mut attr = memattr | KVM_PTE_LEAF_ATTR_LO_S2_SH_IS;
    if !prot.x {
        attr |= KVM_PTE_LEAF_ATTR_HI_S2_XN;
    }
    if prot.r {
        attr |= KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R;
    }
    if prot.w {
        attr |= KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W;
    }
    attr | KVM_PTE_LEAF_ATTR_LO_S2_AF
}

/// `kvm_init_valid_leaf_pte()`.
fn kvm_init_valid_leaf_pte(pfn: Pfn, attr: u64, level: Level) -> u64 {
    let ty = if level == KVM_PGTABLE_LAST_LEVEL {
        KVM_PTE_TYPE_TABLE // KVM_PTE_TYPE_PAGE: the same bit
    } else {
        0 // KVM_PTE_TYPE_BLOCK
    };
    (pfn.0 << 12) | attr | ty | KVM_PTE_VALID
}

/// `kvm_init_table_pte()`.
fn kvm_init_table_pte(table_addr: u64) -> u64 {
    table_addr | KVM_PTE_TYPE_TABLE | KVM_PTE_VALID
}

/// `stage2_pte_is_counted()`: every non-zero entry holds a reference on its table.
#[inline]
fn stage2_pte_is_counted(pte: u64) -> bool {
    pte != 0
}

/// `stage2_pte_needs_update()`: a leaf that differs only in permissions is left to
/// `relax_perms` (the map walker returns `-EAGAIN`).
pub fn stage2_pte_needs_update(old: u64, new: u64) -> bool {
    if !kvm_pte_valid(old) || !kvm_pte_valid(new) {
        return true;
    }
    (old ^ new) & !KVM_PTE_LEAF_ATTR_S2_PERMS != 0
}

/// The entry half of `stage2_try_set_pte()`: a plain store in an exclusive walk, a cmpxchg
/// against `old` (the value the walk read) in a shared one. False: another walker changed the
/// entry first.
#[inline]
pub fn stage2_try_set_pte<C: SpteCell + ?Sized>(
    ptep: &C,
    old: u64,
    new: u64,
    shared: bool,
) -> bool {
    if !shared {
        ptep.store(new);
        true
    } else {
        ptep.cmpxchg(old, new).is_ok()
    }
}

/// The entry half of `stage2_try_break_pte()`: replaces `old` with the locked invalid marker.
/// False when another walker holds the entry broken (it will make it; the caller returns
/// `-EAGAIN`) or changed it first. A shared walker backs off a locked entry; an exclusive one
/// meets one only when it runs under the read lock beside another exclusive walker (seed 001
/// v2's block split, [`MapWalker::ExclusiveUnderReadLock`]) and, as that kernel's walker did
/// with the cleared entry it would have read, takes it for invalid and stores over it.
#[inline]
pub fn stage2_try_lock_pte<C: SpteCell + ?Sized>(ptep: &C, old: u64, shared: bool) -> bool {
    if shared && stage2_pte_is_locked(old) {
        return false;
    }
    stage2_try_set_pte(ptep, old, KVM_INVALID_PTE_LOCKED, shared)
}

/// The entry half of `stage2_make_pte()`: publishes `new` over an entry this walker locked,
/// with a release store (pairs with the acquire load of walkers that step through it, so a new
/// table's zeroed entries are visible first). Nobody else writes a locked entry, so no
/// cmpxchg is needed.
#[inline]
pub fn stage2_publish_pte<C: SpteCell + ?Sized>(ptep: &C, new: u64) {
    debug_assert!(
        stage2_pte_is_locked(ptep.load()),
        "stage2_make_pte() on an entry that was not broken"
    );
    ptep.store(new);
}

/// The entry update of `stage2_attr_walker()`: sets `set` and clears `clr` in the valid leaf
/// `old`. `Ok(true)` when the entry changed, `Ok(false)` when it already had them,
/// `Err(Again)` when it is not a valid leaf (invalid or broken) or another walker changed it.
#[inline]
pub fn stage2_update_leaf_attr<C: SpteCell + ?Sized>(
    ptep: &C,
    old: u64,
    set: u64,
    clr: u64,
    shared: bool,
) -> Result<bool, PgtError> {
    if !kvm_pte_valid(old) {
        return Err(PgtError::Again);
    }
    let new = (old & !clr) | set;
    if new == old {
        return Ok(false);
    }
    if !stage2_try_set_pte(ptep, old, new, shared) {
        return Err(PgtError::Again);
    }
    Ok(true)
}

/// `struct kvm_pgtable` for a stage 2: its input size, start level, the concatenated start-level
/// tables (`pgd`), and the environment (`mm_ops`: here the table statistics).
pub struct KvmPgtable {
    /// `ia_bits`: the IPA size.
    pub ia_bits: u32,
    /// `start_level`.
    pub start_level: Level,
    /// The concatenated start-level tables (`kvm_pgd_pages()` of them), owned by this struct.
    pgd: Box<[*mut Stage2Page]>,
    /// Tables allocated and freed.
    pub stats: Arc<PageTableStats>,
    /// Changes of a valid leaf's output address without a break in between (must stay 0).
    bbm_violations: AtomicU64,
    /// Stores of exclusive walkers over an entry that held something else than what the walker
    /// read: another walker changed it in between (must stay 0; see [`LostUpdates`]).
    lost_updates: LostUpdates,
    /// The table links made by exclusive walkers under the read lock whose holds may still be
    /// open in virtual time (see [`RacyLinks`]).
    racy_links: RacyLinks,
    /// What the CPU has: without FEAT_S2FWB KVM cleans a page to the point of coherency before
    /// mapping it (`mm_ops->dcache_clean_inval_poc`); with FEAT_TLBIRANGE it invalidates
    /// ranges, and with both the unmap walk defers its TLBIs to one range flush.
    pub cpu: Arm64Cpu,
    /// Test hook, a negative control for the TLB coherence oracle: the unmap walk skips the
    /// range flush it deferred. Never set outside tests.
    #[doc(hidden)]
    pub skip_deferred_unmap_flush: std::sync::atomic::AtomicBool,
}

// SAFETY: the PGD pages are heap pages owned by this struct, freed only in Drop; every access
// to their entries is atomic.
unsafe impl Send for KvmPgtable {}
// SAFETY: as above.
unsafe impl Sync for KvmPgtable {}

/// How a map walk may write the entries it changes, by who else may be writing them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MapWalker {
    /// Under the write lock: nobody else walks, plain stores.
    Exclusive,
    /// Under the read lock (`KVM_PGTABLE_WALK_SHARED`, Linux 6.2+): cmpxchg, break-before-make
    /// with the locked marker, tables freed through RCU.
    Shared,
    /// Under the read lock with the exclusive walker's plain stores: seed 001 as posted (v2)
    /// and merged in 5.18-rc1, whose write-permission fault on a *block* while logging split it
    /// this way until "KVM: arm64: Don't split hugepages outside of MMU write lock" (5.18-rc)
    /// required the 4K fault granule. Unsafe: two faults on one block both split it, and the
    /// second's stores overwrite the first's table ([`KvmPgtable::lost_updates`] reports it).
    ExclusiveUnderReadLock(RacyHold),
}

impl MapWalker {
    /// `KVM_PGTABLE_WALK_SHARED`.
    pub fn shared(self) -> bool {
        self == MapWalker::Shared
    }
}

/// The hold an [`MapWalker::ExclusiveUnderReadLock`] walk runs in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct RacyHold {
    /// The faulting vCPU.
    pub vcpu: usize,
    /// The virtual time (ps) the read lock was granted at; `None` on real threads, where the
    /// walkers race for real.
    pub virtual_start: Option<u64>,
}

/// The lost-update oracle of exclusive walkers: before each plain store an exclusive walker
/// compares the entry with what it read (its `old_spte`, or for `stage2_make_pte()` the locked
/// marker it stored). Under the write lock they are always equal; under the read lock
/// ([`MapWalker::ExclusiveUnderReadLock`]) another fault may have changed the entry in between,
/// and the store then drops what that fault linked: a table leaks with the leaves in it, a
/// leaf is lost. The kernel's `kvm_set_table_pte()` caught one case of it with
/// `WARN_ON(kvm_pte_valid(old))` (the WARN in `stage2_map_walk_leaf()` upstream hit).
#[derive(Debug, Default)]
struct LostUpdates {
    count: AtomicU64,
    /// The first, described.
    first: parking_lot::Mutex<Option<String>>,
}

/// One table link of an [`MapWalker::ExclusiveUnderReadLock`] walk in virtual time.
#[derive(Copy, Clone, Debug)]
struct RacyLink {
    /// The entry (its address).
    ptep: usize,
    /// What the walk read there (the block it split).
    read: u64,
    /// What it linked (the table entry).
    linked: u64,
    /// The vCPU whose fault linked it.
    vcpu: usize,
    /// Its hold, in virtual ps: `end` is `u64::MAX` until the engine closes it.
    start: u64,
    end: u64,
}

/// The virtual-time view of exclusive walks under the read lock. The virtual-time engine runs a
/// holder's work at its grant, so two read holds that overlap in time would never interleave:
/// the later fault would find the earlier one's table and map into it. Real walkers read and
/// write throughout their holds; the model takes the widest window, a hold's stores landing at
/// its end and its reads at its start: a fault granted while another's hold is open reads, for
/// each table link that hold made, the block it replaced, and so splits that block again over
/// the other's table, as the kernel's race did. Holds of other regimes never record here.
#[derive(Debug, Default)]
struct RacyLinks(parking_lot::Mutex<Vec<RacyLink>>);

/// Walk options beyond [`WalkFlags`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Stage2Walk {
    /// Which entries the visitor sees, and `KVM_PGTABLE_WALK_SHARED`.
    pub flags: WalkFlags,
    /// `KVM_PGTABLE_WALK_HANDLE_FAULT`: a visitor's `-EAGAIN` ends the walk (a fault returns
    /// it so the vCPU retries) instead of being skipped.
    pub handle_fault: bool,
}

impl Stage2Walk {
    /// A walk of the leaves, shared (`KVM_PGTABLE_WALK_SHARED`) or not, with or without
    /// `KVM_PGTABLE_WALK_HANDLE_FAULT`.
    fn leaves(shared: bool, handle_fault: bool) -> Self {
        let mut flags = WalkFlags::LEAF;
        if shared {
            flags = flags.union(WalkFlags::SHARED);
        }
        Stage2Walk {
            flags,
            handle_fault,
        }
    }
}

impl KvmPgtable {
    /// `kvm_pgtable_stage2_init()`: an empty stage 2 for `ia_bits` of IPA
    /// (`KVM_VM_TYPE_ARM_IPA_SIZE`), its start level from `stage2_pgtable_levels()`, with up to
    /// 16 concatenated start-level tables.
    pub fn new(ia_bits: u32, stats: Arc<PageTableStats>) -> Result<Self, IpaSizeError> {
        if !(32..=48).contains(&ia_bits) {
            return Err(IpaSizeError(ia_bits));
        }
        let levels = stage2_pgtable_levels(ia_bits);
        let start_level = Level(KVM_PGTABLE_MAX_LEVELS - levels);
        let span_bits = 12 + kvm_granule_gfn_shift(start_level) + 9;
        let pages = 1usize << ia_bits.saturating_sub(span_bits);
        let pgd = (0..pages)
            .map(|_| Box::into_raw(zalloc_page(&stats)))
            .collect();
        Ok(KvmPgtable {
            ia_bits,
            start_level,
            pgd,
            stats,
            bbm_violations: AtomicU64::new(0),
            lost_updates: LostUpdates::default(),
            racy_links: RacyLinks::default(),
            cpu: Arm64Cpu::default(),
            skip_deferred_unmap_flush: Default::default(),
        })
    }

    /// One past the last gfn of the IPA space.
    pub fn end_gfn(&self) -> Gfn {
        Gfn(1 << (self.ia_bits - 12))
    }

    /// Whether every gfn of `range` within the IPA space is mapped by a leaf `leaf_ok` accepts,
    /// read PGD page by PGD page ([`range_walks_complete`]), at most `*budget` entries.
    pub fn range_walks_complete(
        &self,
        range: GfnRange,
        guard: &Guard,
        budget: &mut u64,
        leaf_ok: impl Fn(u64) -> bool,
    ) -> RangeWalk {
        if range.end > self.end_gfn() {
            return RangeWalk::Blocked(range.start);
        }
        let mut covered = range.start;
        for (root, part) in self.pgd_pages(range) {
            match range_walks_complete::<Stage2>(
                root,
                self.start_level,
                part,
                guard,
                budget,
                kvm_pte_valid,
                |pte, _| leaf_ok(pte),
            ) {
                RangeWalk::Complete => covered = part.end,
                stopped => return stopped,
            }
        }
        if covered >= range.end {
            RangeWalk::Complete
        } else {
            RangeWalk::Blocked(covered)
        }
    }

    /// The PGD pages `range` lies in, each with the part of `range` it maps, in order; ends
    /// early at a gfn no PGD page holds.
    fn pgd_pages(&self, range: GfnRange) -> impl Iterator<Item = (&PageTable, GfnRange)> + '_ {
        let span = self.pgd_span();
        let mut at = range.start;
        std::iter::from_fn(move || {
            if at >= range.end {
                return None;
            }
            let root = self.pgd_for(at)?;
            let end = Gfn((at.0 / span + 1) * span).min(range.end);
            let part = GfnRange { start: at, end };
            at = end;
            Some((root, part))
        })
    }

    /// Gfns covered by one PGD page.
    fn pgd_span(&self) -> u64 {
        PTES_PER_TABLE as u64 * Stage2Geometry::pages(self.start_level)
    }

    /// The start-level table holding `gfn`'s entry (`kvm_pgd_page_idx()`), if `gfn` is within
    /// the IPA space.
    pub fn pgd_for(&self, gfn: Gfn) -> Option<&PageTable> {
        let i = (gfn.0 / self.pgd_span()) as usize;
        // SAFETY: PGD pages live as long as `self`.
        self.pgd.get(i).map(|p| unsafe { &(**p).table })
    }

    /// Valid leaves changed to another output address without break-before-make so far.
    pub fn bbm_violations(&self) -> u64 {
        self.bbm_violations.load(Ordering::Relaxed)
    }

    /// Stores of exclusive walkers over an entry another walker changed since they read it,
    /// and the first of them described: before each plain store an exclusive walker compares
    /// the entry with what it read (the lost-update oracle; 0 under the write lock).
    pub fn lost_updates(&self) -> (u64, Option<String>) {
        let n = self.lost_updates.count.load(Ordering::Relaxed);
        (n, self.lost_updates.first.lock().clone())
    }

    /// The virtual-time engine closes `vcpu`'s read hold at `end` (ps): faults granted from
    /// then on see the tables that hold linked.
    pub fn racy_hold_ended(&self, vcpu: usize, end: u64) {
        let mut links = self.racy_links.0.lock();
        for l in links
            .iter_mut()
            .filter(|l| l.vcpu == vcpu && l.end == u64::MAX)
        {
            l.end = end;
        }
    }

    /// Before an exclusive walker's plain store to the entry at `it`: whether it still holds
    /// `expected`, the value the walker believes is there; if not, the store loses another
    /// walker's update ([`LostUpdates`]).
    fn check_exclusive_store(&self, it: &PtIter<'_, Stage2>, expected: u64, what: &str) {
        let actual = it.sptep().load(Ordering::Acquire);
        // The access flag aside: lockless aging (the seed's `kvm_arch_test_clear_young()`)
        // clears it with a cmpxchg beside exclusive walkers, and KVM accepts that a plain store
        // may bring it back.
        if actual == expected
            || (kvm_pte_valid(actual)
                && kvm_pte_valid(expected)
                && actual ^ expected == KVM_PTE_LEAF_ATTR_LO_S2_AF)
        {
            return;
        }
        let n = self.lost_updates.count.fetch_add(1, Ordering::Relaxed);
        if n == 0 {
            let kind = |pte: u64| {
                if kvm_pte_table(pte, it.level) {
                    "a table"
                } else if kvm_pte_valid(pte) {
                    "a leaf"
                } else if stage2_pte_is_locked(pte) {
                    "the locked marker"
                } else {
                    "an invalid entry"
                }
            };
            let lost = if kvm_pte_table(actual, it.level) {
                "another fault's table, which leaks with every leaf in it"
            } else if kvm_pte_valid(actual) {
                "another fault's leaf, a mapping lost"
            } else if stage2_pte_is_locked(actual) {
                "another walker's locked marker, in the middle of its own break-before-make"
            } else {
                "an entry another walker cleared"
            };
            *self.lost_updates.first.lock() = Some(format!(
                "gfn {:#x} at level {}: an exclusive walker {what} over {lost} (it expected {}, the entry held {}): two walkers changed one entry under the read lock, as in the race upstream's WARN in stage2_map_walk_leaf() caught with seed 001 v2",
                it.gfn.0,
                it.level.0,
                kind(expected),
                kind(actual)
            ));
        }
    }

    /// For a fault granted at virtual `at` (ps) whose walk under the read lock is at a table
    /// entry: the block another fault's open hold read there before linking this table, if any
    /// ([`RacyLinks`]).
    fn racy_view(&self, it: &PtIter<'_, Stage2>, hold: RacyHold, at: u64) -> Option<u64> {
        let ptep = it.sptep() as *const _ as *const u8 as usize;
        let links = self.racy_links.0.lock();
        links
            .iter()
            .find(|l| {
                l.ptep == ptep
                    && l.vcpu != hold.vcpu
                    && l.start <= at
                    && at < l.end
                    && l.linked == it.old_spte
            })
            .map(|l| l.read)
    }

    /// Records a table link of a fault's exclusive walk under the read lock, granted at `at`.
    fn record_racy_link(&self, it: &PtIter<'_, Stage2>, hold: RacyHold, at: u64, read: u64) {
        let mut links = self.racy_links.0.lock();
        // Holds closed before this grant can no longer hide anything from later grants.
        links.retain(|l| l.end > at);
        links.push(RacyLink {
            ptep: it.sptep() as *const _ as *const u8 as usize,
            read,
            linked: it.old_spte,
            vcpu: hold.vcpu,
            start: at,
            end: u64::MAX,
        });
    }

    /// `kvm_pgtable_walk()`: visits the entries overlapping `[start, end)` as `walk` selects,
    /// page after page of the concatenated PGD. A visitor's error ends the walk and is returned,
    /// except `-EAGAIN` without `handle_fault`, which moves on.
    pub fn walk<'g>(
        &'g self,
        start: Gfn,
        end: Gfn,
        walk: Stage2Walk,
        guard: &'g Guard,
        m: &mut Meter,
        mut visit: impl FnMut(&mut PtIter<'g, Stage2>, Visit, &mut Meter) -> Result<(), PgtError>,
    ) -> Result<(), PgtError> {
        let end = Gfn(end.0.min(self.end_gfn().0));
        let mut err = None;
        let mut reads = TableReads::new(m, &self.stats);
        for (root, part) in self.pgd_pages(GfnRange { start, end }) {
            if err.is_some() {
                break;
            }
            let range = WalkRange {
                root_level: self.start_level,
                min_level: KVM_PGTABLE_LAST_LEVEL,
                start: part.start,
                end: part.end,
                flags: walk.flags,
            };
            walk_range::<Stage2, TableReads>(
                root,
                range,
                guard,
                &mut reads,
                |it, v, r| match visit(it, v, r.meter) {
                    Ok(()) => WalkAction::Continue,
                    Err(PgtError::Again) if !walk.handle_fault => WalkAction::Continue,
                    Err(e) => {
                        err = Some(e);
                        WalkAction::Stop
                    }
                },
            );
        }
        err.map_or(Ok(()), Err)
    }

    /// `stage2_try_set_pte()`: a plain store in an exclusive walk, a cmpxchg against the value
    /// the walk read in a shared one (false: someone else changed the entry).
    fn stage2_try_set_pte(&self, it: &mut PtIter<'_, Stage2>, new: u64, m: &mut Meter) -> bool {
        let old = it.old_spte;
        if !it.shared {
            self.check_exclusive_store(it, old, "stored");
        }
        if !stage2_try_set_pte(it.sptep(), old, new, it.shared) {
            m.cmpxchg_failed += 1;
            return false;
        }
        m.spte_writes += 1;
        if kvm_pte_valid(old)
            && kvm_pte_valid(new)
            && Stage2::is_leaf(old, it.level)
            && (old ^ new) & KVM_PTE_ADDR_MASK != 0
        {
            self.bbm_violations.fetch_add(1, Ordering::Relaxed);
        }
        it.old_spte = new;
        true
    }

    /// `stage2_try_break_pte()`: replaces the entry with the locked invalid marker, invalidates
    /// what the TLBs may hold for it (a table: its span, which without FEAT_TLBIRANGE is the
    /// whole VMID; a valid leaf: its IPA at its level), and drops the entry's reference. False when another
    /// walker holds the entry broken or changed it first (`-EAGAIN` for the caller).
    fn stage2_try_break_pte(&self, it: &mut PtIter<'_, Stage2>, kvm: &Kvm, m: &mut Meter) -> bool {
        let old = it.old_spte;
        if !it.shared {
            self.check_exclusive_store(it, old, "broke");
        }
        if !stage2_try_lock_pte(it.sptep(), old, it.shared) {
            if !stage2_pte_is_locked(old) {
                m.cmpxchg_failed += 1;
            }
            return false;
        }
        m.spte_writes += 1;
        if kvm_pte_table(old, it.level) {
            // The table's span (Linux 6.6; the whole VMID before, and without FEAT_TLBIRANGE).
            let span = Stage2Geometry::pages(it.level);
            kvm_tlb_flush_vmid_range(kvm, self.cpu, it.gfn, span, m);
        } else if kvm_pte_valid(old) {
            kvm_tlb_flush_vmid_ipa(kvm, it.gfn, it.level, m);
        }
        // A locked marker holds no reference: the walker that stored it took the entry's
        // (an exclusive walker under the read lock meets one only in a race).
        if stage2_pte_is_counted(old) && !stage2_pte_is_locked(old) {
            // SAFETY: the entry belongs to a live table of this tree, reached under the guard.
            unsafe { put_page(it.sptep()) };
        }
        true
    }

    /// `stage2_make_pte()`: installs `new` over an entry this walker broke, taking a reference
    /// for it, with a release store (pairs with the acquire load of walkers that step through
    /// it, so a new table's zeroed entries are seen).
    fn stage2_make_pte(&self, it: &mut PtIter<'_, Stage2>, new: u64, m: &mut Meter) {
        if stage2_pte_is_counted(new) {
            // SAFETY: as in stage2_try_break_pte().
            unsafe { get_page(it.sptep()) };
        }
        if it.shared {
            stage2_publish_pte(it.sptep(), new);
        } else {
            // The plain store of an exclusive walker, over the marker it stored itself unless
            // another walker got in between (only under the read lock).
            self.check_exclusive_store(it, KVM_INVALID_PTE_LOCKED, "made an entry");
            it.sptep().store(new, Ordering::Release);
        }
        m.spte_writes += 1;
        it.old_spte = new;
    }

    /// `kvm_block_mapping_supported()` / `stage2_leaf_mapping_allowed()` for the map data.
    fn leaf_mapping_allowed(it: &PtIter<'_, Stage2>, d: &MapData) -> bool {
        let level = it.level;
        let granule = Stage2Geometry::pages(level);
        if level != KVM_PGTABLE_LAST_LEVEL && !kvm_level_supports_block_mapping(level) {
            return false;
        }
        if it.gfn < d.start || it.gfn.0 + granule > d.end.0 {
            return false;
        }
        d.phys(it.gfn).0.is_multiple_of(granule)
    }

    /// `stage2_map_walker_try_leaf()`.
    fn stage2_map_walker_try_leaf(
        &self,
        it: &mut PtIter<'_, Stage2>,
        d: &MapData,
        kvm: &Kvm,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        if !Self::leaf_mapping_allowed(it, d) {
            return Err(PgtError::TooBig);
        }
        let new = kvm_init_valid_leaf_pte(d.phys(it.gfn), d.attr, it.level);
        if !stage2_pte_needs_update(it.old_spte, new) {
            return Err(PgtError::Again);
        }
        if !self.stage2_try_break_pte(it, kvm, m) {
            return Err(PgtError::Again);
        }
        // Cache maintenance before the guest can see the page through stage 2 (normal memory
        // is cacheable): clean and invalidate the whole granule to the point of coherency.
        if !self.cpu.fwb {
            m.cmo_lines += Stage2Geometry::pages(it.level) * (4096 / 64);
        }
        self.stage2_make_pte(it, new, m);
        match level_page_size(it.level) {
            PageSize::Size4K => m.pf_map_4k += 1,
            PageSize::Size2M => m.pf_map_2m += 1,
            PageSize::Size1G => m.pf_map_1g += 1,
        }
        Ok(())
    }

    /// `stage2_map_walk_table_pre()`: where a block can replace a table, collapse it; the old
    /// table goes to RCU.
    fn stage2_map_walk_table_pre(
        &self,
        it: &mut PtIter<'_, Stage2>,
        d: &MapData,
        kvm: &Kvm,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        if !Self::leaf_mapping_allowed(it, d) {
            return Ok(());
        }
        let childp = Stage2::table_addr(it.old_spte);
        self.stage2_map_walker_try_leaf(it, d, kvm, m)?;
        // SAFETY: the table was unlinked by the break just above and is freed once.
        unsafe {
            free_unlinked_table(
                &self.stats,
                childp,
                Stage2::level_below(it.level),
                it.guard(),
            )
        };
        m.tables_freed += 1;
        m.huge_recovered += 1;
        Ok(())
    }

    /// `stage2_map_walk_leaf()`: a leaf if one fits here, else a table from the memory cache
    /// (replacing a block: a split on fault), which the walk then descends into.
    fn stage2_map_walk_leaf(
        &self,
        it: &mut PtIter<'_, Stage2>,
        d: &MapData,
        mc: &mut Stage2MemCache,
        kvm: &Kvm,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        match self.stage2_map_walker_try_leaf(it, d, kvm, m) {
            Err(PgtError::TooBig) => {}
            r => return r,
        }
        if it.level == KVM_PGTABLE_LAST_LEVEL {
            return Err(PgtError::Invalid);
        }
        let Some(child) = mc.try_alloc() else {
            return Err(PgtError::NoMem);
        };
        let read = it.old_spte;
        let was_block = kvm_pte_valid(read);
        if !self.stage2_try_break_pte(it, kvm, m) {
            // KVM puts the page, freeing it; the model returns it to the cache.
            mc.give_back(child, &self.stats);
            return Err(PgtError::Again);
        }
        let child = Box::into_raw(child);
        // SAFETY: `child` was just allocated; the tree owns it from here.
        let addr = unsafe { (*child).table.addr() };
        self.stage2_make_pte(it, kvm_init_table_pte(addr), m);
        if was_block {
            m.split_in_fault += 1;
            if let MapWalker::ExclusiveUnderReadLock(
                hold @ RacyHold {
                    virtual_start: Some(at),
                    ..
                },
            ) = d.walker
            {
                self.record_racy_link(it, hold, at, read);
            }
        }
        Ok(())
    }

    /// `kvm_pgtable_stage2_map()`: maps `map` (its `size` at `gfn` to `pfn` with `prot`), allocating tables
    /// from `mc`; collapses tables into a block and splits a block into a table as needed.
    /// `walker`: how it writes (a fault under the read lock since 6.2 walks shared,
    /// `KVM_PGTABLE_WALK_SHARED | HANDLE_FAULT`).
    pub fn kvm_pgtable_stage2_map(
        &self,
        kvm: &Kvm,
        map: Stage2Mapping,
        mc: &mut Stage2MemCache,
        walker: MapWalker,
        guard: &Guard,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        let Stage2Mapping {
            gfn,
            size,
            pfn,
            prot,
        } = map;
        let d = MapData {
            start: gfn,
            end: (gfn + size.pages()),
            pfn,
            attr: stage2_set_prot_attr(prot, self.cpu.fwb),
            walker,
        };
        let mut flags = WalkFlags::TABLE_PRE.union(WalkFlags::LEAF);
        if walker.shared() {
            flags = flags.union(WalkFlags::SHARED);
        }
        let walk = Stage2Walk {
            flags,
            handle_fault: true,
        };
        self.walk(d.start, d.end, walk, guard, m, |it, v, m| match v {
            Visit::TablePre => {
                // In virtual time, a table another fault's still-open hold linked over a block
                // is, to this fault, still that block ([`RacyLinks`]): it splits it again.
                if let MapWalker::ExclusiveUnderReadLock(
                    hold @ RacyHold {
                        virtual_start: Some(at),
                        ..
                    },
                ) = d.walker
                {
                    if let Some(block) = self.racy_view(it, hold, at) {
                        it.old_spte = block;
                        return self.stage2_map_walk_leaf(it, &d, mc, kvm, m);
                    }
                }
                self.stage2_map_walk_table_pre(it, &d, kvm, m)
            }
            Visit::Leaf => self.stage2_map_walk_leaf(it, &d, mc, kvm, m),
            Visit::TablePost => Ok(()),
        })
    }

    /// `kvm_pgtable_stage2_unmap()`: clears every leaf overlapping the range (a partly covered
    /// block goes whole) and frees tables left empty. Exclusive (write lock). Each cleared
    /// leaf is followed by a TLBI of its IPA, unless the CPU has FEAT_TLBIRANGE and FEAT_S2FWB
    /// (`stage2_unmap_defer_tlb_flush()`, Linux 6.6): then one range flush covers the walk after
    /// it ends. A cleared table entry is always invalidated at once.
    pub fn kvm_pgtable_stage2_unmap(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        guard: &Guard,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        let walk = Stage2Walk {
            flags: WalkFlags::LEAF.union(WalkFlags::TABLE_POST),
            handle_fault: false,
        };
        let defer = self.cpu.tlbi_range && self.cpu.fwb;
        let r = self.walk(start, end, walk, guard, m, |it, _, m| {
            let old = it.old_spte;
            if !kvm_pte_valid(old) {
                if stage2_pte_is_counted(old) {
                    it.sptep().store(0, Ordering::Release);
                    // SAFETY: an entry of a live table of this tree.
                    unsafe { put_page(it.sptep()) };
                    it.old_spte = 0;
                }
                return Ok(());
            }
            let childp = if kvm_pte_table(old, it.level) {
                let c = Stage2::table_addr(old);
                // SAFETY: a table entry read under the guard, of a table of this tree.
                if unsafe { page_count(c, it.guard()) } != 1 {
                    return Ok(());
                }
                Some(c)
            } else {
                None
            };
            // stage2_unmap_put_pte(): clear, invalidate the IPA now unless deferred, drop the
            // reference.
            it.sptep().store(0, Ordering::Release);
            m.spte_writes += 1;
            it.old_spte = 0;
            if childp.is_some() && self.cpu.tlbi_range {
                // A cleared table: its whole span at once, never deferred (Linux 6.9, "Don't
                // defer TLB invalidation when zapping table entries": one IPA TLBI with the
                // table's level as its TTL hint would not cover the leaves below it).
                let span = Stage2Geometry::pages(it.level);
                kvm_tlb_flush_vmid_range(kvm, self.cpu, it.gfn, span, m);
            } else if childp.is_some() || !defer {
                kvm_tlb_flush_vmid_ipa(kvm, it.gfn, it.level, m);
            }
            // Without FWB a cleared cacheable leaf is cleaned to the point of coherency.
            if childp.is_none() && !self.cpu.fwb {
                m.cmo_lines += Stage2Geometry::pages(it.level) * (4096 / 64);
            }
            // SAFETY: as above.
            unsafe { put_page(it.sptep()) };
            if let Some(c) = childp {
                // SAFETY: unlinked just above, freed once.
                unsafe {
                    free_unlinked_table(&self.stats, c, Stage2::level_below(it.level), it.guard())
                };
                m.tables_freed += 1;
            }
            Ok(())
        });
        if defer && !self.skip_deferred_unmap_flush.load(Ordering::Relaxed) {
            let end = Gfn(end.0.min(self.end_gfn().0));
            kvm_tlb_flush_vmid_range(kvm, self.cpu, start, end.0.saturating_sub(start.0), m);
        }
        r
    }

    /// `stage2_update_leaf_attrs()` (`stage2_attr_walker`): sets `attrs.set` and clears
    /// `attrs.clr` in every valid leaf in `gfns`; an invalid entry is `-EAGAIN` (skipped, or
    /// returned with `walk.handle_fault`), as since Linux 6.2 (6.1's walker returned 0 there, so a permission fault
    /// racing an unmap was reported fixed and the page marked dirty; the vCPU refaulted either
    /// way). Returns the level and the value of the last leaf visited, and how many
    /// leaves changed.
    fn stage2_update_leaf_attrs(
        &self,
        gfns: Range<Gfn>,
        attrs: LeafAttrs,
        walk: Stage2Walk,
        guard: &Guard,
        m: &mut Meter,
    ) -> Result<(Option<(Level, u64)>, u64), PgtError> {
        let LeafAttrs { set, clr } = attrs;
        let mut last = None;
        let mut changed = 0;
        self.walk(gfns.start, gfns.end, walk, guard, m, |it, _, m| {
            let old = it.old_spte;
            if kvm_pte_valid(old) {
                last = Some((it.level, old));
            }
            match stage2_update_leaf_attr(it.sptep(), old, set, clr, it.shared) {
                Ok(true) => {
                    m.spte_writes += 1;
                    it.old_spte = (old & !clr) | set;
                    changed += 1;
                    Ok(())
                }
                Ok(false) => Ok(()),
                Err(e) => {
                    if kvm_pte_valid(old) {
                        m.cmpxchg_failed += 1;
                    }
                    Err(e)
                }
            }
        })?;
        Ok((last, changed))
    }

    /// `kvm_pgtable_stage2_wrprotect()`: clears S2AP_W on every leaf in the range, with no TLB
    /// invalidation (the caller flushes). Exclusive. Returns the leaves changed.
    pub fn kvm_pgtable_stage2_wrprotect(
        &self,
        start: Gfn,
        end: Gfn,
        guard: &Guard,
        m: &mut Meter,
    ) -> u64 {
        let (_, changed) = self
            .stage2_update_leaf_attrs(
                start..end,
                LeafAttrs {
                    set: 0,
                    clr: KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W,
                },
                Stage2Walk::leaves(false, false),
                guard,
                m,
            )
            .expect("an exclusive attribute walk skips what it cannot change");
        m.sptes_wrprot += changed;
        changed
    }

    /// `kvm_pgtable_stage2_relax_perms()`: grants `prot` on the leaf mapping `gfn`, then
    /// invalidates that IPA: on every PE, waited for, as Linux up to 6.4 does
    /// (`__kvm_tlb_flush_vmid_ipa`), or on the faulting vCPU's PE only, also after `-EAGAIN`,
    /// as 6.5 does (`__kvm_tlb_flush_vmid_ipa_nsh`). `how.shared`: a shared walk with cmpxchg (6.2+,
    /// every fault under the read lock); 6.1's fast path under the read lock used plain stores,
    /// safe because only permission relaxations run under the read lock there. Returns
    /// whether the leaf changed (KVM does not tell: it returns 0 either way; a leaf that
    /// already allowed `prot` was relaxed by another vCPU's fault first).
    pub fn kvm_pgtable_stage2_relax_perms(
        &self,
        kvm: &Kvm,
        gfn: Gfn,
        prot: KvmPgtableProt,
        how: RelaxBy,
        guard: &Guard,
        m: &mut Meter,
    ) -> Result<bool, PgtError> {
        let mut set = 0;
        let mut clr = 0;
        if prot.r {
            set |= KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R;
        }
        if prot.w {
            set |= KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W;
        }
        if prot.x {
            clr |= KVM_PTE_LEAF_ATTR_HI_S2_XN;
        }
        let attrs = LeafAttrs { set, clr };
        let walk = Stage2Walk::leaves(how.shared, true);
        let r = self.stage2_update_leaf_attrs(gfn..gfn + 1, attrs, walk, guard, m);
        match (how.flush, r) {
            (RelaxFlush::Broadcast, Ok((last, changed))) => {
                let (level, _) = last.expect("a successful leaf walk visited a leaf");
                kvm_tlb_flush_vmid_ipa(kvm, gfn, level, m);
                Ok(changed > 0)
            }
            (RelaxFlush::Local, Ok((last, changed))) => {
                let (level, _) = last.expect("a successful leaf walk visited a leaf");
                kvm_tlb_flush_vmid_ipa_nsh(kvm, how.vcpu, gfn, level, m);
                Ok(changed > 0)
            }
            (RelaxFlush::Local, Err(PgtError::Again)) => {
                // The leaf's level is unknown: no TTL hint.
                kvm_tlb_flush_vmid_ipa_nsh(kvm, how.vcpu, gfn, Level(0), m);
                Err(PgtError::Again)
            }
            (_, Err(e)) => Err(e),
        }
    }

    /// `kvm_pgtable_stage2_mkyoung()`: sets AF on the leaf mapping `gfn` (an access-flag fault),
    /// with no TLB invalidation. `shared`: under the read lock (6.2+); the write lock before.
    pub fn kvm_pgtable_stage2_mkyoung(
        &self,
        gfn: Gfn,
        shared: bool,
        guard: &Guard,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        self.stage2_update_leaf_attrs(
            gfn..gfn + 1,
            LeafAttrs {
                set: KVM_PTE_LEAF_ATTR_LO_S2_AF,
                clr: 0,
            },
            Stage2Walk::leaves(shared, true),
            guard,
            m,
        )
        .map(|_| ())
    }

    /// `kvm_pgtable_stage2_test_clear_young()`: whether any leaf in the range has AF set, and
    /// with `mkold` clears it (no TLB invalidation). Exclusive (write lock) as upstream.
    pub fn kvm_pgtable_stage2_test_clear_young(
        &self,
        start: Gfn,
        end: Gfn,
        mkold: bool,
        guard: &Guard,
        m: &mut Meter,
    ) -> bool {
        self.stage2_age_range(start, end, false, &mut |_, _| mkold, guard, m)
    }

    /// The aging walk: for every valid leaf in the range with AF set, `young(gfn, pages)` says
    /// whether to clear it. `shared`: the seed's lockless walk (`KVM_PGTABLE_WALK_SHARED`
    /// under RCU, AF cleared with `stage2_try_set_pte()`'s cmpxchg, which loses to a racing
    /// fault or unmap and then leaves the entry alone); otherwise exclusive, under the write
    /// lock. Returns whether any leaf was young.
    pub fn stage2_age_range(
        &self,
        start: Gfn,
        end: Gfn,
        shared: bool,
        young: &mut dyn FnMut(Gfn, u64) -> bool,
        guard: &Guard,
        m: &mut Meter,
    ) -> bool {
        let mut any = false;
        let mut flags = WalkFlags::LEAF;
        if shared {
            flags = flags.union(WalkFlags::SHARED);
        }
        let walk = Stage2Walk {
            flags,
            handle_fault: false,
        };
        let _ = self.walk(start, end, walk, guard, m, |it, _, m| {
            let old = it.old_spte;
            if !kvm_pte_valid(old) || old & KVM_PTE_LEAF_ATTR_LO_S2_AF == 0 {
                return Ok(());
            }
            any = true;
            if young(it.gfn, Stage2::pages(it.level))
                && self.stage2_try_set_pte(it, old & !KVM_PTE_LEAF_ATTR_LO_S2_AF, m)
            {
                m.sptes_aged += 1;
            }
            Ok(())
        });
        any
    }

    /// `kvm_mmu_split_nr_page_tables()` for one block: tables a full split of a block at
    /// `level` needs (a 1 GiB block 1 + 512, a 2 MiB block 1).
    pub fn split_nr_page_tables(level: Level) -> usize {
        let mut n = 0;
        let mut per = 1;
        let mut l = level;
        while l < KVM_PGTABLE_LAST_LEVEL {
            n += per;
            per *= PTES_PER_TABLE;
            l = Stage2::level_below(l);
        }
        n
    }

    /// `kvm_pgtable_stage2_split()` (Linux 6.4): replaces every block overlapping the range with
    /// tables of pages mapping the same memory with the same attributes. When `mc` holds enough
    /// pages the whole subtree is built unlinked (`kvm_pgtable_stage2_create_unlinked()`, no
    /// TLBI inside) and swapped in with one break (one TLBI of the block's IPA); otherwise the
    /// block is split one level and the walk descends into the new table. Exclusive (write
    /// lock). `Err(NoMem)` when `mc` ran dry: top up and call again.
    pub fn kvm_pgtable_stage2_split(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        mc: &mut Stage2MemCache,
        guard: &Guard,
        m: &mut Meter,
    ) -> Result<(), PgtError> {
        let walk = Stage2Walk {
            flags: WalkFlags::LEAF,
            handle_fault: false,
        };
        self.walk(start, end, walk, guard, m, |it, _, m| {
            let old = it.old_spte;
            if it.level == KVM_PGTABLE_LAST_LEVEL || !kvm_pte_valid(old) {
                return Ok(());
            }
            let need = Self::split_nr_page_tables(it.level);
            let full = mc.nr_objs() >= need;
            if mc.nr_objs() == 0 {
                return Err(PgtError::NoMem);
            }
            let child_level = Stage2::level_below(it.level);
            let child_pages = Stage2Geometry::pages(child_level);
            // The children get the block's permissions and memory attributes with AF set and no
            // software bits, as KVM rebuilds them (kvm_pgtable_stage2_pte_prot() and
            // stage2_set_prot_attr()).
            let attr = (old
                & !(KVM_PTE_ADDR_MASK | KVM_PTE_TYPE | KVM_PTE_VALID | KVM_PTE_LEAF_ATTR_HI_SW))
                | KVM_PTE_LEAF_ATTR_LO_S2_AF;
            let base = Stage2::leaf_pfn(old);
            let table = mc.try_alloc().expect("checked above");
            // Built unlinked: plain stores, no TLBI (SKIP_BBM_TLBI | SKIP_CMO).
            for i in 0..PTES_PER_TABLE {
                let pfn = base + i as u64 * child_pages;
                let pte = if full && child_level != KVM_PGTABLE_LAST_LEVEL {
                    let sub =
                        self.create_unlinked(pfn, attr, Stage2::level_below(child_level), mc, m);
                    kvm_init_table_pte(sub)
                } else {
                    kvm_init_valid_leaf_pte(pfn, attr, child_level)
                };
                table.table.spt[i].store(pte, Ordering::Relaxed);
                // SAFETY: an entry of the page just allocated.
                unsafe { get_page(&table.table.spt[i]) };
                m.spte_writes += 1;
            }
            if !self.stage2_try_break_pte(it, kvm, m) {
                unreachable!("an exclusive walk cannot lose a break");
            }
            let table = Box::into_raw(table);
            // SAFETY: just allocated; the tree owns it from here.
            let addr = unsafe { (*table).table.addr() };
            self.stage2_make_pte(it, kvm_init_table_pte(addr), m);
            m.split_eager += 1;
            Ok(())
        })
    }

    /// Builds an unlinked table at `level` of leaves mapping 512 granules from `pfn`, and tables
    /// below it down to pages; returns its address.
    fn create_unlinked(
        &self,
        pfn: Pfn,
        attr: u64,
        level: Level,
        mc: &mut Stage2MemCache,
        m: &mut Meter,
    ) -> u64 {
        let table = mc
            .try_alloc()
            .expect("the caller counted the tables a full split needs");
        let pages = Stage2Geometry::pages(level);
        for i in 0..PTES_PER_TABLE {
            let pfn = pfn + i as u64 * pages;
            let pte = if level == KVM_PGTABLE_LAST_LEVEL {
                kvm_init_valid_leaf_pte(pfn, attr, level)
            } else {
                kvm_init_table_pte(self.create_unlinked(
                    pfn,
                    attr,
                    Stage2::level_below(level),
                    mc,
                    m,
                ))
            };
            table.table.spt[i].store(pte, Ordering::Relaxed);
            // SAFETY: an entry of the page just allocated.
            unsafe { get_page(&table.table.spt[i]) };
            m.spte_writes += 1;
        }
        // SAFETY: the page stays allocated; ownership passes to the entry that will point to it.
        unsafe { (*Box::into_raw(table)).table.addr() }
    }

    /// Visits every entry of the tree with `f(gfn, level, pte, table_refcount_ok)`; for each
    /// table, checks that its reference count is its non-zero entries plus one. Returns the
    /// description of each table whose count is wrong. Must run with no other walker active.
    pub fn for_each_entry(&self, mut f: impl FnMut(Gfn, Level, u64)) -> Vec<String> {
        let guard = crossbeam_epoch::pin();
        let mut errors = Vec::new();
        for (i, p) in self.pgd.iter().enumerate() {
            // SAFETY: PGD pages live as long as `self`.
            let page = unsafe { &**p };
            let base = Gfn(i as u64 * self.pgd_span());
            self.check_table(page, base, self.start_level, &guard, &mut f, &mut errors);
        }
        errors
    }

    fn check_table(
        &self,
        page: &Stage2Page,
        base: Gfn,
        level: Level,
        guard: &Guard,
        f: &mut impl FnMut(Gfn, Level, u64),
        errors: &mut Vec<String>,
    ) {
        let mut counted = 1;
        for (i, e) in page.table.spt.iter().enumerate() {
            let pte = e.load(Ordering::Acquire);
            let gfn = base + i as u64 * Stage2Geometry::pages(level);
            if stage2_pte_is_counted(pte) {
                counted += 1;
            }
            f(gfn, level, pte);
            if kvm_pte_table(pte, level) {
                // SAFETY: a table entry of the live tree, read under `guard`.
                let child = unsafe { table_at(Stage2::table_addr(pte), guard) };
                // SAFETY: every table of the tree is the first field of a Stage2Page.
                let child = unsafe { &*(child as *const PageTable as *const Stage2Page) };
                self.check_table(child, gfn, Stage2::level_below(level), guard, f, errors);
            }
        }
        // SAFETY: `page` is live.
        let rc = unsafe { page_count(page.table.addr(), guard) };
        if rc != counted {
            errors.push(format!(
                "stage-2 table at level {} for gfn {:#x}: reference count {rc}, but {} non-zero entries plus one",
                level.0,
                base.0,
                counted - 1
            ));
        }
    }
}

impl Drop for KvmPgtable {
    fn drop(&mut self) {
        let guard = crossbeam_epoch::pin();
        for p in self.pgd.iter() {
            // SAFETY: owned by `self`; the subtree below is reachable only from here.
            unsafe {
                free_unlinked_table(&self.stats, (**p).table.addr(), self.start_level, &guard)
            };
        }
        guard.flush();
    }
}

/// `struct stage2_map_data`: what the map walker installs.
struct MapData {
    /// First gfn mapped.
    start: Gfn,
    /// One past the last.
    end: Gfn,
    /// The frame `start` maps to.
    pfn: Pfn,
    /// Leaf attributes.
    attr: u64,
    /// How the walk writes.
    walker: MapWalker,
}

impl MapData {
    /// The frame `gfn` maps to.
    fn phys(&self, gfn: Gfn) -> Pfn {
        self.pfn + (gfn.0 - self.start.0)
    }
}
