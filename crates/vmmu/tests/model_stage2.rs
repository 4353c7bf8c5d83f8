//! Model-checked races of arm64 stage-2 shared walks, using the very protocol functions the
//! stage-2 MMU runs (`vmmu::arm64::pgtable`): `stage2_try_lock_pte()` and
//! `stage2_publish_pte()` (the entry halves of `stage2_try_break_pte()` and `stage2_make_pte()`:
//! break-before-make with the `KVM_INVALID_PTE_LOCKED` marker), `stage2_update_leaf_attr()` (the
//! entry update of `stage2_attr_walker()`) and `stage2_pte_needs_update()`. As in
//! `model_fast_pf.rs`, shuttle explores the schedules of the threads' atomic operations:
//! exhaustively (DFS) for the two-thread models 1 and 2, with its PCT scheduler for three threads
//! and for model 3, whose schedules are too long to enumerate. The properties are about
//! interleavings, not weak-memory reordering: every operation involved is a SeqCst RMW, an
//! acquire/release pair or a lock, and the comments name the pairs.
//!
//! 1. Two vCPUs' map faults (`kvm_pgtable_stage2_map()`, a shared walk under the read lock since
//!    Linux 6.2) install a page into the same invalid entry. One locks and publishes; the other
//!    meets the lock (or an entry changed under it), returns `-EAGAIN`, and finds the page mapped
//!    when it retries.
//! 2. A write permission fault (`kvm_pgtable_stage2_relax_perms()` under the read lock: the
//!    dirty-logging fast path of 5.18–6.1 with plain stores, every fault since 6.2 with cmpxchg)
//!    racing the VMM's dirty-log harvest (under the write lock: xchg of the bitmap word, then
//!    `kvm_pgtable_stage2_wrprotect()`); and two such faults on one entry at once.
//! 3. A map fault walking into a table while another fault collapses that table into a block
//!    (`stage2_map_walk_table_pre()`) and frees it through RCU, with RCU modelled explicitly.
//!
//! Each model has a negative control: a deliberately broken variant the model checker must catch,
//! so a property that could never fail would show.
//!
//! Not modelled: TLBs, TLBI and DSB (a translation cached before a break or a write protection:
//! `tests/tlb_shootdown.rs` and `tests/model_tlbi.rs` cover those), cache maintenance, table
//! reference counts and the memory cache, and the walk above the modelled entries: each model's
//! entries are the ones the walkers reach, and the rest of the tree does not change.

mod model_common;

use model_common::{assert_model_finds, ModelSpte, RcuReader};
use shuttle::sync::atomic::{AtomicU64, Ordering};
use shuttle::sync::{Arc, RwLock};
use shuttle::thread;
use std::sync::atomic::{AtomicBool as StdAtomicBool, AtomicU64 as StdAtomicU64};
use vmmu::arm64::pgtable::{
    stage2_pte_needs_update, stage2_publish_pte, stage2_try_lock_pte, stage2_try_set_pte,
    stage2_update_leaf_attr, PgtError,
};
use vmmu::hw::pgtable::{Level, SpteCell};
use vmmu::hw::stage2::*;

const S2AP_W: u64 = KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W;
/// Level 3: 4 KiB pages.
const PAGE_LEVEL: Level = KVM_PGTABLE_LAST_LEVEL;
/// Level 2: 2 MiB blocks, or tables of 512 pages.
const BLOCK_LEVEL: Level = Level(2);
/// The first frame of the modelled memory (2 MiB aligned).
const PFN: u64 = 0x4_0000;

/// A valid leaf as `kvm_init_valid_leaf_pte(pfn, stage2_set_prot_attr(prot), level)` builds it
/// for a data abort: normal write-back memory, inner shareable, AF set, readable,
/// execute-never, and S2AP_W if `writable`.
fn leaf(pfn: u64, level: Level, writable: bool) -> u64 {
    let ty = if level == KVM_PGTABLE_LAST_LEVEL {
        KVM_PTE_TYPE // a page descriptor; a block has the type bit clear
    } else {
        0
    };
    let w = if writable { S2AP_W } else { 0 };
    (pfn << 12)
        | KVM_PTE_LEAF_ATTR_LO_S2_MEMATTR
        | KVM_PTE_LEAF_ATTR_LO_S2_SH_IS
        | KVM_PTE_LEAF_ATTR_LO_S2_AF
        | KVM_PTE_LEAF_ATTR_LO_S2_S2AP_R
        | KVM_PTE_LEAF_ATTR_HI_S2_XN
        | w
        | ty
        | KVM_PTE_VALID
}

/// Explores every schedule of a two-thread model (bounded only by the programs' length: the
/// retry loops of the models checked this way are bounded, since DFS would follow a spin
/// forever).
fn check_all(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_dfs(f, None);
}

/// Three-thread models have too many schedules for exhaustive search; PCT finds any bug of
/// depth <= 3 with a known probability per run (as in `model_fast_pf.rs`).
fn check_three_threads(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_pct(f, 20_000, 3);
}

/// How many times a modelled vCPU takes the same fault before the model stops it (a real vCPU
/// keeps re-entering the guest and faulting until the access translates).
const FAULT_ATTEMPTS: usize = 2;

/// How a vCPU's map fault ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum FaultEnd {
    /// Its walker installed the mapping.
    Installed,
    /// Another walker's mapping serves the access.
    FoundMapped,
    /// Still faulting when the model stopped retrying.
    StillFaulting,
}

// ---------------------------------------------------------------------------------------------
// 1. Two map walkers, one invalid entry.

/// How a map walker locks (breaks) the entry.
type LockFn = fn(&ModelSpte, u64) -> bool;

/// `stage2_try_break_pte()` of a shared walk: refuses an entry another walker holds locked.
fn kvm_lock(ptep: &ModelSpte, old: u64) -> bool {
    stage2_try_lock_pte(ptep, old, true)
}

/// Broken: cmpxchg to the locked marker without first checking that `old` is not itself the
/// marker, so a walker can "lock" an entry another walker holds.
fn lock_ignoring_the_marker(ptep: &ModelSpte, old: u64) -> bool {
    stage2_try_set_pte(ptep, old, KVM_INVALID_PTE_LOCKED, true)
}

/// One 4K entry two map walkers race on.
struct MapRace {
    pte: ModelSpte,
    // Observers, not part of the protocol: plain std atomics add no scheduling points (shuttle
    // runs one thread at a time, so they see a sequentially consistent history). Shuttle
    // schedules before and after every operation on its own atomics, so an observer is not
    // updated in the same step as the operation it records: these are read only at the end.
    publishes: StdAtomicU64,
    publisher: StdAtomicU64,
}

impl MapRace {
    fn new() -> Arc<Self> {
        Arc::new(MapRace {
            pte: ModelSpte::new(0),
            publishes: StdAtomicU64::new(0),
            publisher: StdAtomicU64::new(0),
        })
    }

    /// `stage2_map_walker_try_leaf()` at the entry, its CMOs and TLBI apart: nothing to do when
    /// the entry already maps `new` up to permissions; otherwise break (lock) the entry and make
    /// it `new`. `-EAGAIN` when there is nothing to do, or another walker holds or changed the
    /// entry.
    fn try_leaf(&self, walker: u64, new: u64, lock: LockFn) -> Result<(), PgtError> {
        // ctx->old, the walk's READ_ONCE(); acquire pairs with the release store of the
        // publisher, so a walker that sees the new leaf sees everything before it.
        let old = self.pte.load();
        if !stage2_pte_needs_update(old, new) {
            return Err(PgtError::Again);
        }
        // SeqCst cmpxchg: of two walkers that read the same `old`, one wins.
        if !lock(&self.pte, old) {
            return Err(PgtError::Again);
        }
        // stage2_make_pte(): the release store that ends the break. Nobody else may write a
        // locked entry, so a plain store; its debug assertion (the entry is still locked)
        // catches a walker publishing over an entry another walker already made.
        stage2_publish_pte(&self.pte, new);
        self.publishes.fetch_add(1, Ordering::SeqCst);
        self.publisher.store(walker, Ordering::SeqCst);
        Ok(())
    }

    /// A vCPU's map fault on the page: `user_mem_abort()` → `kvm_pgtable_stage2_map()`. On
    /// `-EAGAIN` the vCPU re-enters the guest and the access faults again, unless the entry now
    /// maps the page: the model re-reads the entry, and `stage2_pte_needs_update()` saying
    /// nothing to do means the fault is over (a missing write permission is left to a
    /// permission fault, model 2); a locked or still invalid entry means another try.
    fn map_fault(&self, walker: u64, new: u64, lock: LockFn) -> FaultEnd {
        for _ in 0..FAULT_ATTEMPTS {
            match self.try_leaf(walker, new, lock) {
                Ok(()) => return FaultEnd::Installed,
                Err(PgtError::Again) => {
                    if !stage2_pte_needs_update(self.pte.load(), new) {
                        return FaultEnd::FoundMapped;
                    }
                    thread::yield_now();
                }
                Err(e) => unreachable!("a page map fails only with -EAGAIN, not {e:?}"),
            }
        }
        FaultEnd::StillFaulting
    }
}

/// Two vCPUs fault on the same unmapped page (walker 1 for a read, walker 2 for a write) and run
/// the map walk concurrently with `lock`, walker 1 on the main thread. Returns the race and how
/// each fault ended.
fn two_map_faults(lock: LockFn) -> (Arc<MapRace>, [u64; 2], [FaultEnd; 2]) {
    let race = MapRace::new();
    let news = [leaf(PFN, PAGE_LEVEL, false), leaf(PFN, PAGE_LEVEL, true)];
    let other = {
        let race = race.clone();
        thread::spawn(move || race.map_fault(2, news[1], lock))
    };
    let mine = race.map_fault(1, news[0], lock);
    let theirs = other.join().unwrap();
    (race, news, [mine, theirs])
}

/// The race: two shared map walkers (`kvm_pgtable_stage2_map()` under the read lock, Linux 6.2+)
/// install a page into the same invalid entry with `stage2_try_break_pte()` then
/// `stage2_make_pte()`. A walker whose lock attempt fails returns `-EAGAIN` and its vCPU retries
/// (a bounded number of times).
///
/// Properties: exactly one walker published (so none stored over an entry it had not locked:
/// each publish follows a lock, and only one lock succeeds); the final entry is its leaf, valid
/// and not locked; the other vCPU's retried fault found that leaf (its differing write
/// permission is left to a permission fault) or was still being retried.
#[test]
fn a_walker_that_meets_a_locked_entry_retries() {
    check_all(|| map_race_properties(kvm_lock));
}

/// Runs [`two_map_faults`] with `lock` and asserts the race's properties (see above).
fn map_race_properties(lock: LockFn) {
    let (race, news, ends) = two_map_faults(lock);
    assert_eq!(
        race.publishes.load(Ordering::SeqCst),
        1,
        "exactly one walker publishes"
    );
    let publisher = race.publisher.load(Ordering::SeqCst) as usize;
    let final_pte = race.pte.load();
    assert_eq!(final_pte, news[publisher - 1], "the publisher's leaf");
    assert!(kvm_pte_valid(final_pte) && !stage2_pte_is_locked(final_pte));
    assert_eq!(ends[publisher - 1], FaultEnd::Installed);
    assert_ne!(ends[2 - publisher], FaultEnd::Installed);
}

/// Negative control: a walker that takes the lock without `stage2_try_lock_pte()`'s check for
/// the locked marker (cmpxchg from the marker to the marker succeeds) turns a held lock into a
/// shared one, and both walkers publish. The model checker must find that: either the second
/// publish finds the entry no longer locked (the debug assertion of `stage2_publish_pte()`,
/// in debug builds) or the race's properties find two publishes (in every build).
#[test]
fn a_walker_that_ignores_the_locked_marker_is_caught() {
    assert_model_finds(
        &[
            "stage2_make_pte() on an entry that was not broken",
            "exactly one walker publishes",
        ],
        || check_all(|| map_race_properties(lock_ignoring_the_marker)),
    );
}

// ---------------------------------------------------------------------------------------------
// 2. relax_perms and dirty-log write protection.

/// When a vCPU's write permission fault marks the page dirty.
#[derive(Copy, Clone, PartialEq, Eq)]
enum MarkDirty {
    /// `user_mem_abort()`: after the relaxation succeeded, before `mmu_lock` is released.
    AfterRelaxing,
    /// Broken: before taking `mmu_lock`, whatever the relaxation then does.
    BeforeLocking,
}

/// One logged 4K leaf, write-protected by the previous harvest; its dirty-bitmap word (the page
/// is bit 0); `mmu_lock`; and which guest writes landed.
struct DirtyLog {
    pte: ModelSpte,
    bitmap: AtomicU64,
    mmu_lock: RwLock<()>,
    // Observers, not part of the protocol (see MapRace). `harvested` is also read while the
    // threads run: the harvest sets it after its last step and a write reads it before its
    // walk, so a write counted as after the harvest certainly came after it.
    /// The harvest is over: it took the word and write-protected what the word named (from
    /// then on, userspace copies the reported pages).
    harvested: StdAtomicBool,
    landed_before_harvest: StdAtomicU64,
    landed_after_harvest: StdAtomicU64,
}

impl DirtyLog {
    fn new() -> Arc<Self> {
        Arc::new(DirtyLog {
            pte: ModelSpte::new(leaf(PFN, PAGE_LEVEL, false)),
            bitmap: AtomicU64::new(0),
            mmu_lock: RwLock::new(()),
            harvested: StdAtomicBool::new(false),
            landed_before_harvest: StdAtomicU64::new(0),
            landed_after_harvest: StdAtomicU64::new(0),
        })
    }

    /// `mark_page_dirty_in_slot()`: `set_bit_le()`, an atomic RMW (pairs with the harvest's
    /// xchg).
    fn mark_page_dirty(&self) {
        self.bitmap.fetch_or(1, Ordering::SeqCst);
    }

    /// A vCPU's write permission fault on the page at its own size (`user_mem_abort()` →
    /// `kvm_pgtable_stage2_relax_perms()` with `KVM_PGTABLE_PROT_W`; `shared`: the 6.2+ shared
    /// walk with cmpxchg, else 6.1's plain store), followed by the guest's retried write.
    /// Returns what the relaxation returned.
    fn write_fault(&self, shared: bool, mark: MarkDirty) -> Result<bool, PgtError> {
        if mark == MarkDirty::BeforeLocking {
            self.mark_page_dirty();
        }
        let ret = {
            // read_lock(&kvm->mmu_lock): excludes the harvest, which holds it for write, so
            // the relaxation and the mark are one step to the harvest (the lock's release and
            // acquire pair with the harvest's).
            let _read = self.mmu_lock.read().unwrap();
            let old = self.pte.load();
            let ret = stage2_update_leaf_attr(&self.pte, old, S2AP_W, 0, shared);
            // "Mark the page dirty only if the fault is handled successfully": Ok(false) too,
            // when another vCPU's relaxation got there first.
            if ret.is_ok() && mark == MarkDirty::AfterRelaxing {
                self.mark_page_dirty();
            }
            ret
            // read_unlock(); the TLBI of the IPA that follows is not modelled.
        };
        self.guest_write();
        ret
    }

    /// The guest's write, retried after the fault: the CPU's stage-2 walk lets it through only
    /// if the entry is writable at that moment (`s2_allows()`; its acquire load pairs with the
    /// relaxation's store). A write that does not land faults again, which the model leaves out.
    fn guest_write(&self) {
        // Read before the walk: a write counted as after the harvest certainly is. One counted
        // as before may have landed after it too; its property is the weaker one.
        let after = self.harvested.load(Ordering::SeqCst);
        if s2_allows(self.pte.load(), true) != S2Outcome::Allowed {
            return;
        }
        let landed = if after {
            &self.landed_after_harvest
        } else {
            &self.landed_before_harvest
        };
        landed.fetch_add(1, Ordering::SeqCst);
    }

    /// The VMM's `KVM_GET_DIRTY_LOG` for the page's word (`kvm_get_dirty_log_protect()`; the
    /// manual-protect `KVM_CLEAR_DIRTY_LOG` takes the word's bits the same way): under the write
    /// lock, xchg the word to 0 and write-protect the pages it names
    /// (`kvm_arch_mmu_enable_log_dirty_pt_masked()` → `stage2_wp_range()` →
    /// `kvm_pgtable_stage2_wrprotect()`, an exclusive walk: a plain store). The TLB flush after
    /// the lock is released is not modelled. Returns whether the page was reported dirty.
    fn harvest(&self) -> bool {
        let _write = self.mmu_lock.write().unwrap();
        let word = self.bitmap.swap(0, Ordering::SeqCst);
        let reported = word & 1 != 0;
        if reported {
            let old = self.pte.load();
            let ret = stage2_update_leaf_attr(&self.pte, old, 0, S2AP_W, false);
            assert!(
                ret.is_ok(),
                "an exclusive attribute update never fails on a valid leaf"
            );
        }
        self.harvested.store(true, Ordering::SeqCst);
        reported
    }

    /// The properties, once every thread is done: a write that landed after the harvest is
    /// still pending for the next harvest (one that landed between the xchg and the write
    /// protection is in the pages userspace copies afterwards); one that landed before it is
    /// reported or pending; a writable entry has its dirty bit pending (writable ⇒ tracked); and
    /// nothing but S2AP_W ever changed.
    fn check(&self, reported: bool) {
        let pending = self.bitmap.load(Ordering::SeqCst) & 1 != 0;
        if self.landed_after_harvest.load(Ordering::SeqCst) != 0 {
            assert!(
                pending,
                "a write landed after the harvest but is not pending for the next one"
            );
        }
        if self.landed_before_harvest.load(Ordering::SeqCst) != 0 {
            assert!(
                reported || pending,
                "a write landed before the harvest but is neither reported nor pending"
            );
        }
        let final_pte = self.pte.load();
        if final_pte & S2AP_W != 0 {
            assert!(pending, "a writable entry without a pending dirty bit");
        }
        assert_eq!(
            final_pte & !S2AP_W,
            leaf(PFN, PAGE_LEVEL, false),
            "a bit other than S2AP_W changed"
        );
    }
}

/// One vCPU's write permission fault against the VMM's harvest on the main thread.
fn relax_vs_harvest(shared: bool, mark: MarkDirty) {
    let log = DirtyLog::new();
    let vcpu = {
        let log = log.clone();
        thread::spawn(move || log.write_fault(shared, mark))
    };
    let reported = log.harvest();
    let ret = vcpu.join().unwrap();
    // Alone under the read lock, the relaxation cannot lose a cmpxchg.
    assert_eq!(ret, Ok(true), "the only relaxation changes the entry");
    log.check(reported);
}

/// The race (Linux 6.2+): a vCPU's write permission fault relaxes the leaf with a shared
/// `stage2_attr_walker()` (cmpxchg) under the read lock and marks the page dirty before
/// unlocking, then writes; the VMM's `KVM_GET_DIRTY_LOG` / `KVM_CLEAR_DIRTY_LOG` takes the
/// bitmap word and write-protects with `kvm_pgtable_stage2_wrprotect()` under the write lock.
///
/// Property: a guest write that landed is in the harvested word or still pending (pending if it
/// landed after the harvest), and a writable entry always has its dirty bit pending.
#[test]
fn relax_perms_with_cmpxchg_vs_dirty_log_harvest_never_loses_a_write() {
    check_all(|| relax_vs_harvest(true, MarkDirty::AfterRelaxing));
}

/// The same race in Linux 5.18–6.1, whose dirty-logging fast path relaxes under the read lock
/// with the exclusive walker's plain store: safe against the harvest, which takes the lock for
/// write. Same property.
#[test]
fn relax_perms_with_plain_stores_vs_dirty_log_harvest_never_loses_a_write() {
    check_all(|| relax_vs_harvest(false, MarkDirty::AfterRelaxing));
}

/// Negative control: a vCPU that marks the page dirty before taking the lock lets the harvest
/// take the mark and write-protect, after which the relaxation makes the page writable with
/// nothing pending: the write that follows is lost to every later harvest. The model checker
/// must find that schedule.
#[test]
fn marking_dirty_before_relaxing_is_caught() {
    assert_model_finds(
        &["a write landed after the harvest but is not pending for the next one"],
        || check_all(|| relax_vs_harvest(true, MarkDirty::BeforeLocking)),
    );
}

/// The race (Linux 5.18–6.1): two vCPUs take write permission faults on the same page at once,
/// both relax it under the read lock with plain stores (`stage2_attr_walker()` without
/// `KVM_PGTABLE_WALK_SHARED`), mark it dirty and write, while the VMM harvests.
///
/// Properties: both relaxations succeed (a plain store cannot fail, and the two store the same
/// value, so neither loses a bit of the other's); if the harvest ran first (reported nothing),
/// the final entry is writable and both writes landed; and model 2's property: no landed write
/// is lost, writable ⇒ pending, nothing but S2AP_W changed.
#[test]
fn two_relax_perms_with_plain_stores_both_succeed() {
    check_three_threads(|| {
        let log = DirtyLog::new();
        let vcpus: Vec<_> = (0..2)
            .map(|_| {
                let log = log.clone();
                thread::spawn(move || log.write_fault(false, MarkDirty::AfterRelaxing))
            })
            .collect();
        let reported = log.harvest();
        for vcpu in vcpus {
            let ret = vcpu.join().unwrap();
            assert!(ret.is_ok(), "a plain-store relaxation failed: {ret:?}");
        }
        log.check(reported);
        if !reported {
            assert!(
                log.pte.load() & S2AP_W != 0,
                "both relaxed after the harvest"
            );
            assert_eq!(log.landed_after_harvest.load(Ordering::SeqCst), 2);
        }
    });
}

// ---------------------------------------------------------------------------------------------
// 3. A fault walking into a table that another fault collapses and frees under RCU.

/// The table's address in the level-2 table descriptor (any page-aligned value).
const CHILD_ADDR: u64 = 0x8765_4000;
/// The child entry the faulting walker maps (entry 0 maps a page already).
const FAULT_INDEX: usize = 1;

/// A level-3 table and whether it was freed.
struct ChildTable {
    ptes: [ModelSpte; 2],
    freed: StdAtomicBool,
}

impl ChildTable {
    /// An access by the faulting walker to entry `i`, checked against the free. `freed` is set
    /// once and never cleared, so a check after the access catches every access the free
    /// overlaps or precedes. It also catches a free that came just after the access but before
    /// the check (shuttle may schedule right after an atomic operation): a free while the
    /// walker is still inside its read-side section, which the grace period must prevent too.
    fn access<R>(&self, i: usize, access: impl FnOnce(&ModelSpte) -> R) -> R {
        let r = access(&self.ptes[i]);
        assert!(
            !self.freed.load(Ordering::SeqCst),
            "use after free: a walker accessed the freed table"
        );
        r
    }
}

/// Whether the collapsing walker waits for a grace period before freeing the table.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Free {
    /// `stage2_free_unlinked_table()` of a shared walk: `call_rcu()`, whose callback runs
    /// after a grace period (the model waits in the collapsing walker's thread).
    AfterGracePeriod,
    /// Broken: frees the table as soon as it is unlinked.
    Immediately,
}

/// A level-2 entry pointing to a table of pages, the table, and the faulting walker's RCU state.
struct Collapse {
    parent: ModelSpte,
    child: ChildTable,
    reader: RcuReader,
    // Observer, not part of the protocol: what the free walk found in the faulted entry.
    freed_entry: StdAtomicU64,
}

impl Collapse {
    fn new() -> Arc<Self> {
        Arc::new(Collapse {
            parent: ModelSpte::new(CHILD_ADDR | KVM_PTE_TYPE_TABLE | KVM_PTE_VALID),
            child: ChildTable {
                ptes: [
                    ModelSpte::new(leaf(PFN, PAGE_LEVEL, true)),
                    ModelSpte::new(0),
                ],
                freed: StdAtomicBool::new(false),
            },
            reader: RcuReader(AtomicU64::new(0)),
            freed_entry: StdAtomicU64::new(0),
        })
    }

    /// The faulting walker's shared map walk (`kvm_pgtable_stage2_map()` for page `new`), from
    /// the parent entry down: `None` for `-EAGAIN` (the parent is locked: the walker would
    /// visit it as an invalid leaf, and its attempt to break it for a table fails; or the child
    /// entry changed under it).
    fn walk(&self, new: u64) -> Option<FaultEnd> {
        // Acquire pairs with the collapsing walker's release store of the block.
        let parent = self.parent.load();
        if stage2_pte_is_locked(parent) {
            return None;
        }
        if !kvm_pte_table(parent, BLOCK_LEVEL) {
            // The block replaced the table: the retried access translates through it.
            assert!(kvm_pte_valid(parent), "only a block replaces the table");
            return Some(FaultEnd::FoundMapped);
        }
        assert_eq!(parent & KVM_PTE_ADDR_MASK, CHILD_ADDR, "one child table");
        // Into the child: every access is checked against the free.
        let old = self.child.access(FAULT_INDEX, |p| p.load());
        if !stage2_pte_needs_update(old, new) {
            return Some(FaultEnd::FoundMapped);
        }
        if !self
            .child
            .access(FAULT_INDEX, |p| stage2_try_lock_pte(p, old, true))
        {
            return None;
        }
        self.child
            .access(FAULT_INDEX, |p| stage2_publish_pte(p, new));
        Some(FaultEnd::Installed)
    }

    /// A vCPU's map fault: each try is a shared walk inside `rcu_read_lock()`
    /// (`kvm_pgtable_walk_begin()` / `_end()`), retried on `-EAGAIN`.
    fn map_fault(&self, new: u64) -> FaultEnd {
        for _ in 0..FAULT_ATTEMPTS {
            self.reader.read_lock();
            let end = self.walk(new);
            self.reader.read_unlock();
            if let Some(end) = end {
                return end;
            }
            thread::yield_now();
        }
        FaultEnd::StillFaulting
    }

    /// `stage2_map_walk_table_pre()` replacing the table with `block` in a shared walk: lock the
    /// parent entry (`stage2_try_break_pte()`; its TLBI of the VMID is not modelled), publish the
    /// block (`stage2_make_pte()`), then `free_unlinked_table()`. The walk itself runs inside
    /// `rcu_read_lock()` too, but nobody waits for it here.
    fn collapse(&self, block: u64, free: Free) {
        let old = self.parent.load();
        assert!(kvm_pte_table(old, BLOCK_LEVEL));
        assert!(stage2_pte_needs_update(old, block));
        assert!(
            stage2_try_lock_pte(&self.parent, old, true),
            "only this walker changes the parent entry"
        );
        // Unlinked from here: a walker that reads the parent entry now cannot reach the table.
        stage2_publish_pte(&self.parent, block);
        if free == Free::AfterGracePeriod {
            self.reader.synchronize();
        }
        self.free_child();
    }

    /// `stage2_free_unlinked_table()` (the RCU callback `stage2_free_unlinked_table_rcu_cb()`
    /// for a shared walk): walks the table's entries, dropping the references they hold, then
    /// frees the page. The table is the free path's from the start: a walker's store after the
    /// free walk read the entry would be missed (its reference leaked) as surely as one after
    /// the page went back to the allocator would corrupt it.
    fn free_child(&self) {
        self.child.freed.store(true, Ordering::SeqCst);
        for (i, pte) in self.child.ptes.iter().enumerate() {
            let v = pte.load();
            if i == FAULT_INDEX {
                self.freed_entry.store(v, Ordering::SeqCst);
            }
        }
    }
}

/// Two threads, but each schedule is long (every atomic operation is two scheduling points in
/// shuttle, and the walks retry): exhaustive search is out of reach, so schedules are sampled
/// with PCT as for three threads.
fn check_rcu_model(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_pct(f, 20_000, 3);
}

/// The faulting walker on a spawned thread, the collapsing walker on the main thread.
fn fault_vs_collapse(free: Free) {
    let w = Collapse::new();
    let page = leaf(PFN + FAULT_INDEX as u64, PAGE_LEVEL, true);
    let block = leaf(PFN, BLOCK_LEVEL, true);
    let vcpu = {
        let w = w.clone();
        thread::spawn(move || w.map_fault(page))
    };
    w.collapse(block, free);
    let end = vcpu.join().unwrap();
    assert_eq!(w.parent.load(), block, "the block replaced the table");
    if end == FaultEnd::Installed {
        // The page went into the unlinked table and is lost with it; the vCPU's next access
        // translates through the block. The free walk, which waited for the walker's
        // read-side section, saw the page (and dropped its reference).
        assert_eq!(
            w.freed_entry.load(Ordering::SeqCst),
            page,
            "the free walk missed a page published under RCU"
        );
    }
}

/// The race (Linux 6.2+, both under the read lock): a shared map walker A reads the level-2
/// entry, follows it to the table of pages and installs a page there with
/// `stage2_try_break_pte()` / `stage2_make_pte()`, all inside `rcu_read_lock()`; a walker B
/// collapses the table into a block (`stage2_map_walk_table_pre()`: break the level-2 entry,
/// make it a block, `stage2_free_unlinked_table()` through `call_rcu()`), the table freed only
/// after a grace period.
///
/// Properties: A never touches the table after it was freed; the final level-2 entry is B's
/// block; a page A installed into the unlinked table is simply lost with it (A's access goes
/// through the block), and the free walk saw it.
#[test]
fn a_fault_racing_a_collapse_never_touches_the_freed_table() {
    check_rcu_model(|| fault_vs_collapse(Free::AfterGracePeriod));
}

/// Negative control: B frees the table right after unlinking it, without waiting for a grace
/// period; the model checker must find A touching the freed table.
#[test]
fn freeing_the_table_without_a_grace_period_is_caught() {
    assert_model_finds(&["use after free"], || {
        check_rcu_model(|| fault_vs_collapse(Free::Immediately))
    });
}
