//! kswapd beside a VM: the host's page reclaim ([`HostMm`]) as it reaches KVM through the MMU
//! notifier. Each step of reclaim is one [`OpPlan`], so the engine grants its `mmu_lock` jobs
//! as it grants any other and the vCPUs' faults interleave with it; kswapd runs them as a
//! [`HostThread`] ([`Engine::run_pass_beside`](crate::engine::Engine::run_pass_beside)).
//!
//! `balance_pgdat()` runs while free memory is below the high watermark, in batches:
//!
//! - **Classic LRU** (`shrink_lruvec()`): when the inactive list is low (`inactive_is_low()`),
//!   `shrink_active_list()` takes `SWAP_CLUSTER_MAX` folios from the active tail, checks each
//!   with `folio_referenced()` and deactivates them all (anonymous memory is never kept
//!   active); otherwise `shrink_inactive_list()` takes 32 from the inactive tail and
//!   `shrink_folio_list()` decides each with `folio_check_references()`: young and referenced
//!   before (or young in two mappings) → activate; young → mark referenced and keep; old →
//!   reclaim.
//! - **MGLRU** (`lru_gen_shrink_node()` → `evict_folios()`): eviction scans the oldest
//!   generation's tail (`scan_folios()`), moving folios that aging promoted (`sort_folio()`)
//!   and isolating up to `MIN_LRU_BATCH` others; with only `MIN_NR_GENS` generations left,
//!   aging (`try_to_inc_max_seq()`) walks the VMM's page tables (`walk_mm()`, PMDs filtered
//!   as the Bloom filter would) and promotes young folios to the youngest generation.
//!
//! `folio_referenced()` walks the rmap to the VMM's one PTE and asks KVM: Linux 6.2 calls
//! `ptep_clear_flush_young_notify()` per folio (after `lru_gen_look_around()` when the host
//! PTE was young), which reaches `kvm_mmu_notifier_clear_flush_young()` under the write lock;
//! with seed 003 (MGLRU and `--aging lockless` on an MMU that can), `should_look_around()`
//! asks KVM with one `test_clear_young()` on the folio, and look-around tests the 64 PTEs
//! around it in one call and clears the young ones in a second, without `mmu_lock`. The
//! aging walk uses the same two calls per 64 PTEs. Reclaiming a folio is `try_to_unmap()`,
//! which brackets the host PTE's removal with `invalidate_range_start()`/`_end()` (KVM zaps
//! and flushes under the write lock), then `pageout()` to the swap device.
//!
//! Simplified (each a departure a reader of `mm/vmscan.c` would look for):
//! - kswapd reclaims anonymous (shmem) memory only, one batch at a time, and stops at the high
//!   watermark after a batch; no swappiness, no refault (workingset) activation, no direct
//!   reclaim (a task at the min watermark waits for kswapd: [`Kvm::faultin_pfn`]);
//! - MGLRU: `should_run_aging()` has only its "out of generations" clause (not the young/old
//!   balance ones), and kswapd does not age through 6.2's `lru_gen_age_node()`; no tiers or
//!   reference-count protection; the Bloom filter is an exact set of PMDs, filled by the walk
//!   only (look-around does not add to it);
//! - the upstream ≥ 6.11 MGLRU, which calls `ptep_clear_young_notify()` per PTE, is not
//!   modelled.
//!
//! [`Kvm::faultin_pfn`]: crate::kvm::Kvm::faultin_pfn

use crate::host::lru::{HostMm, Lists, LruPolicy, MAX_NR_GENS, MIN_NR_GENS, PTES_PER_PMD};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::Mmu;
use crate::kvm::mmu_lock::{Held, Write};
use crate::kvm::mmu_notifier::{
    self, aging_lock_mode, clear_flush_young, invalidate_range_end, invalidate_range_start, Aging,
    NotifierJob, YoungBitmap,
};
use crate::kvm::op_plan::{OpPlan, OpStep, PlanCall};
use crate::kvm::Kvm;
use crate::vm::host_thread::HostThread;
use parking_lot::Mutex;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// `SWAP_CLUSTER_MAX`: folios the classic LRU isolates per batch.
pub const SWAP_CLUSTER_MAX: usize = 32;
/// `MIN_LRU_BATCH` (`BITS_PER_LONG`): folios MGLRU's eviction isolates per batch, and the PTEs
/// one look-around or one `test_clear_young()` call of the walk covers.
pub const MIN_LRU_BATCH: u64 = 64;
/// `MAX_LRU_BATCH`: folios `scan_folios()` looks at per batch, sorted or isolated.
pub const MAX_LRU_BATCH: u64 = 4096;
/// PMDs one plan of the aging walk covers (a scheduling granularity of the model, not KVM's).
const PMDS_PER_WALK_PLAN: u64 = 8;

/// Where kswapd's time went, by the kernel function it was in (the rows of the seed's
/// profile). Each is a plan kind; `write_wait` is the part of a row spent waiting for
/// `mmu_lock` for write (`_raw_write_lock`).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProfileRow {
    /// Nanoseconds in this row.
    pub ns: u64,
    /// Of them, waiting for `mmu_lock`'s write side.
    pub write_wait_ns: u64,
}

/// One kind of kswapd work: a row of the profile (see [`Kswapd::profile`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Func {
    /// `shrink_active_list()`'s isolation and deactivation (classic).
    ShrinkActiveList,
    /// Isolating folios for `shrink_folio_list()` (`shrink_inactive_list()`, or MGLRU's
    /// `scan_folios()`) and putting back the ones kept.
    IsolateFolios,
    /// `folio_referenced()`: the rmap walk to the VMM's PTE (its KVM call is the next rows).
    FolioReferenced,
    /// `kvm_mmu_notifier_clear_flush_young()` (or `clear_young` as the seed's fallback).
    ClearFlushYoung,
    /// Seed 003's `should_look_around()` and `lru_gen_look_around()` with their
    /// `test_clear_young()` calls (6.2's look-around over host PTEs is booked under
    /// `folio_referenced`).
    LookAround,
    /// `try_to_unmap()`: the notifier's invalidation (KVM zaps under the write lock).
    TryToUnmap,
    /// `pageout()`: the swap device's write.
    Pageout,
    /// MGLRU aging: `try_to_inc_max_seq()` → `walk_mm()`.
    WalkMm,
}

impl Func {
    /// The kernel function's name, as the seed's profile prints it.
    pub fn kernel_name(self) -> &'static str {
        match self {
            Func::ShrinkActiveList => "shrink_active_list",
            Func::IsolateFolios => "isolate_folios",
            Func::FolioReferenced => "folio_referenced",
            Func::ClearFlushYoung => "kvm_mmu_notifier_clear_flush_young",
            Func::LookAround => "lru_gen_look_around",
            Func::TryToUnmap => "try_to_unmap",
            Func::Pageout => "pageout",
            Func::WalkMm => "walk_mm",
        }
    }
}

/// The part of `balance_pgdat()` a row of the profile is under.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Parent {
    /// MGLRU aging (`try_to_inc_max_seq()`).
    Aging,
    /// Classic `shrink_active_list()`.
    ShrinkActiveList,
    /// `shrink_folio_list()`: the classic inactive list's, or MGLRU's `evict_folios()`.
    ShrinkFolioList,
}

impl Parent {
    /// Every part, in the order the profile prints them.
    pub const ALL: [Parent; 3] = [
        Parent::ShrinkActiveList,
        Parent::ShrinkFolioList,
        Parent::Aging,
    ];

    /// The kernel function's name.
    pub fn kernel_name(self) -> &'static str {
        match self {
            Parent::Aging => "try_to_inc_max_seq",
            Parent::ShrinkActiveList => "shrink_active_list",
            Parent::ShrinkFolioList => "shrink_folio_list",
        }
    }
}

/// Which list the batch in progress came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Source {
    /// Classic active list (`shrink_active_list()`): every folio is deactivated.
    Active,
    /// Classic inactive list, or MGLRU's oldest generation (`shrink_folio_list()`).
    Reclaim,
}

/// What kswapd does next; each plan's last step sets it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Next {
    /// Isolate the next batch (or sleep when balanced).
    Batch,
    /// `folio_referenced()` of this folio: the rmap walk and the host PTE.
    Referenced(u32),
    /// KVM's answer for this folio, then `folio_check_references()`.
    AskKvm(u32),
    /// `try_to_unmap()` of this folio.
    Unmap(u32),
    /// `pageout()` of this folio.
    Pageout(u32),
    /// The MGLRU aging walk, from this PMD.
    Walk(u64),
}

/// kswapd's state, shared with the closures of its plans (which run when the engine says).
struct State {
    mm: Arc<HostMm>,
    mmu: Arc<dyn Mmu>,
    aging: Aging,
    /// Seed 003's MGLRU side with its fast path: `test_clear_young()` in look-around and in
    /// the walk, without `mmu_lock` (MGLRU, `--aging lockless`, and an MMU that can).
    batched: bool,
    /// Seed 003's MGLRU side on an MMU without the fast path (the shadow MMU): it falls back
    /// to `clear_young`, which never flushes, and look-around sees host PTEs only.
    fallback: bool,
    next: Next,
    /// Folios isolated and not yet checked, and the list they came from.
    batch: VecDeque<u32>,
    from: Source,
    /// The folio being checked: references counted so far (`folio_referenced_one()`'s
    /// `referenced`: look-around counts one) and whether its PTE was young on the host.
    young: u32,
    pte_young: bool,
    /// `mmu_lock` write waits of the plan in flight (for the profile's `_raw_write_lock`).
    write_wait_ns: u64,
    /// The last isolation found nothing to isolate or age: reclaim is stuck.
    starved: bool,
    /// The negative control: swap-out without the notifier's invalidation, so KVM keeps
    /// translations of pages the host took away. The oracles must catch it.
    skip_invalidate: bool,
}

/// kswapd (see the module documentation).
pub struct Kswapd {
    state: Arc<Mutex<State>>,
    awake: bool,
    /// The row the plan in flight counts in.
    last: (Parent, Func),
    /// kswapd's time by function.
    pub profile: BTreeMap<(Parent, Func), ProfileRow>,
    /// What kswapd's plans counted.
    pub meter: Meter,
}

impl Kswapd {
    /// kswapd for the host memory `kvm.host_mm`, reaching KVM's `mmu` under `aging`.
    /// `skip_invalidate` is the negative control (never set in a real run).
    pub fn new(kvm: &Arc<Kvm>, mmu: &Arc<dyn Mmu>, aging: Aging, skip_invalidate: bool) -> Self {
        let mm = Arc::clone(
            kvm.host_mm
                .get()
                .expect("kswapd needs a host that reclaims"),
        );
        let seed = mm.policy == LruPolicy::Mglru && aging == Aging::Lockless;
        let batched = seed && mmu.lockless_test_clear_young();
        Kswapd {
            state: Arc::new(Mutex::new(State {
                mm,
                mmu: Arc::clone(mmu),
                aging,
                batched,
                fallback: seed && !batched,
                next: Next::Batch,
                batch: VecDeque::new(),
                from: Source::Reclaim,
                young: 0,
                pte_young: false,
                write_wait_ns: 0,
                starved: false,
                skip_invalidate,
            })),
            awake: false,
            last: (Parent::ShrinkFolioList, Func::IsolateFolios),
            profile: BTreeMap::new(),
            meter: Meter::default(),
        }
    }

    /// Nanoseconds kswapd ran (the sum of its profile).
    pub fn busy_ns(&self) -> u64 {
        self.profile.values().map(|r| r.ns).sum()
    }

    /// The next plan and its profile row, or `None` when kswapd has nothing to do: free memory
    /// is at the high watermark with no batch in progress (`pgdat_balanced()`), or nothing is
    /// left to reclaim.
    fn next_work(&mut self) -> Option<(Func, OpPlan)> {
        let mut st = self.state.lock();
        let state = Arc::clone(&self.state);
        Some(match st.next {
            Next::Batch => {
                if !st.mm.needs_reclaim() || std::mem::take(&mut st.starved) {
                    return None;
                }
                let func = match st.mm.policy {
                    LruPolicy::Classic if inactive_is_low(&st.mm) => Func::ShrinkActiveList,
                    _ => Func::IsolateFolios,
                };
                (func, call(state, isolate))
            }
            Next::Referenced(i) => (
                Func::FolioReferenced,
                call(state, move |st, _, meter| {
                    meter.rmap_walks += 1;
                    folio_referenced_host(st, i, meter);
                    st.next = Next::AskKvm(i);
                }),
            ),
            Next::AskKvm(i) => ask_kvm(&st, state, i),
            Next::Unmap(i) => (Func::TryToUnmap, try_to_unmap(&st, state, i)),
            Next::Pageout(_) => (
                Func::Pageout,
                call(state, move |st, _, meter| {
                    // pageout() through zram's synchronous write; the folio is freed at once.
                    meter.swap_outs += 1;
                    st.mm.free_page();
                    st.mm.with_lists(|_, s| s.pgsteal += 1);
                    st.next = next_in_batch(st);
                }),
            ),
            Next::Walk(pmd) => (
                Func::WalkMm,
                call(state, move |st, kvm, m| walk_mm(st, kvm, pmd, m)),
            ),
        })
    }
}

impl HostThread for Kswapd {
    fn next_plan(&mut self, _kvm: &Kvm) -> Option<OpPlan> {
        if !self.awake {
            let mm = Arc::clone(&self.state.lock().mm);
            if !mm.take_kswapd_wake() {
                return None;
            }
            self.awake = true;
            mm.with_lists(|_, s| s.kswapd_wakeups += 1);
        }
        let Some((func, plan)) = self.next_work() else {
            // balance_pgdat() is done: kswapd_try_to_sleep(). A wake-up an allocation posted
            // while kswapd was awake is spent (wakeup_kswapd() skips a balanced node).
            self.awake = false;
            self.state.lock().mm.take_kswapd_wake();
            return None;
        };
        let parent = match (func, self.state.lock().from) {
            (Func::WalkMm, _) => Parent::Aging,
            (Func::ShrinkActiveList, _) => Parent::ShrinkActiveList,
            (Func::IsolateFolios, _) => Parent::ShrinkFolioList,
            (_, Source::Active) => Parent::ShrinkActiveList,
            _ => Parent::ShrinkFolioList,
        };
        self.last = (parent, func);
        Some(plan)
    }

    fn wake_flag(&self) -> Arc<AtomicBool> {
        self.state.lock().mm.kswapd_wake_flag()
    }

    fn plan_done(&mut self, ns: u64, meter: &Meter) {
        let wait = std::mem::take(&mut self.state.lock().write_wait_ns);
        let row = self.profile.entry(self.last).or_default();
        row.ns += ns;
        row.write_wait_ns += wait;
        self.meter.add(meter);
    }
}

/// A plan of one lockless step running `f` on kswapd's state.
fn call(
    state: Arc<Mutex<State>>,
    f: impl FnOnce(&mut State, &Kvm, &mut Meter) + Send + 'static,
) -> OpPlan {
    OpPlan {
        steps: vec![lockless(state, f)],
    }
}

/// A lockless plan step running `f` on kswapd's state.
fn lockless(
    state: Arc<Mutex<State>>,
    f: impl FnOnce(&mut State, &Kvm, &mut Meter) + Send + 'static,
) -> OpStep {
    OpStep::Call(
        Box::new(move |kvm: &Kvm, meter: &mut Meter| f(&mut state.lock(), kvm, meter)) as PlanCall,
    )
}

/// A plan step under the write lock running `f` on kswapd's state (one MMU notifier callback).
fn write_locked(
    state: Arc<Mutex<State>>,
    name: &'static str,
    f: impl FnOnce(&mut State, &Kvm, Held<'_, Write>, &mut Meter) + Send + 'static,
) -> OpStep {
    OpStep::Job(Box::new(NotifierJob::new(
        name,
        Box::new(move |kvm: &Kvm, held: Held<'_, Write>, meter: &mut Meter| {
            let mut st = state.lock();
            st.write_wait_ns += held.waited_ns();
            f(&mut st, kvm, held, meter)
        }),
    )))
}

/// `inactive_is_low()` under `lru_lock`.
fn inactive_is_low(mm: &HostMm) -> bool {
    mm.with_lists(|l, _| inactive_is_low_lists(l))
}

/// The next folio of the batch, or the next batch.
fn next_in_batch(st: &mut State) -> Next {
    match st.batch.pop_front() {
        Some(i) => Next::Referenced(i),
        None => Next::Batch,
    }
}

/// Isolates the next batch: classic `shrink_active_list()` (when the inactive list is low)
/// or `shrink_inactive_list()`, `SWAP_CLUSTER_MAX` folios from the list's tail; MGLRU's
/// `scan_folios()` on the oldest generation, sorting promoted folios to their generation,
/// or aging first when only `MIN_NR_GENS` generations are left.
fn isolate(st: &mut State, _kvm: &Kvm, meter: &mut Meter) {
    let mm = Arc::clone(&st.mm);
    let (batch, from, next) = mm.with_lists(|l, stat| match mm.policy {
        LruPolicy::Classic => {
            let from = if inactive_is_low_lists(l) {
                Source::Active
            } else {
                Source::Reclaim
            };
            let list = match from {
                Source::Active => &mut l.active,
                Source::Reclaim => &mut l.inactive,
            };
            let mut batch = VecDeque::new();
            while batch.len() < SWAP_CLUSTER_MAX {
                let Some(i) = list.pop_back() else { break };
                mm.isolate(i);
                batch.push_back(i);
            }
            meter.lru_folios_scanned += batch.len() as u64;
            stat.pgscan += batch.len() as u64;
            (batch, from, None)
        }
        LruPolicy::Mglru => {
            if l.nr_gens() <= MIN_NR_GENS {
                // should_run_aging(): try_to_inc_max_seq() walks the mm first.
                return (VecDeque::new(), Source::Reclaim, Some(Next::Walk(0)));
            }
            let mut batch = VecDeque::new();
            let min_gen = l.min_seq % MAX_NR_GENS;
            let mut scanned = 0;
            while (batch.len() as u64) < MIN_LRU_BATCH && scanned < MAX_LRU_BATCH {
                let Some(i) = l.gens[min_gen as usize].pop_back() else {
                    // try_to_inc_min_seq(): the oldest generation is empty.
                    l.min_seq += 1;
                    break;
                };
                scanned += 1;
                let gen = mm.gen(i);
                if gen != min_gen {
                    // sort_folio(): aging or look-around promoted it.
                    l.gens[gen as usize].push_front(i);
                    continue;
                }
                mm.isolate(i);
                batch.push_back(i);
            }
            meter.lru_folios_scanned += scanned;
            stat.pgscan += batch.len() as u64;
            (batch, Source::Reclaim, None)
        }
    });
    st.batch = batch;
    st.from = from;
    st.next = match next {
        Some(n) => n,
        None => {
            if st.batch.is_empty() && mm.with_lists(|l, _| lists_empty(l)) {
                st.starved = true;
            }
            next_in_batch(st)
        }
    };
}

/// `inactive_is_low()`: the inactive list is smaller than the active one over
/// `inactive_ratio` = `int_sqrt(10 * gigabytes)` (1 below 1 GiB).
fn inactive_is_low_lists(l: &Lists) -> bool {
    let (inactive, active) = (l.inactive.len() as u64, l.active.len() as u64);
    let gb = (inactive + active) >> 18;
    let ratio = if gb > 0 {
        ((10 * gb) as f64).sqrt() as u64
    } else {
        1
    };
    inactive * ratio < active
}

/// Whether no folio is on any list.
fn lists_empty(l: &Lists) -> bool {
    l.inactive.is_empty() && l.active.is_empty() && l.gens.iter().all(|g| g.is_empty())
}

/// The host side of `folio_referenced_one()` on the VMM's PTE of folio `i`: Linux 6.2's MGLRU
/// (and the seed's fallback) first runs `lru_gen_look_around()` over the host PTEs around a
/// young one (KVM is not asked there), which counts a reference; then
/// `ptep_clear_flush_young_notify()` tests and clears the host PTE's Accessed bit, ORed with
/// KVM's answer ([`ask_kvm`]) into one more reference. With the seed's fast path the host PTE
/// is tested in `should_look_around()` instead ([`seed_look_around`]).
fn folio_referenced_host(st: &mut State, i: u32, meter: &mut Meter) {
    let mm = Arc::clone(&st.mm);
    st.young = 0;
    st.pte_young = false;
    if st.batched {
        return;
    }
    if mm.policy == LruPolicy::Mglru && mm.host_young(i) {
        let max_seq = mm.with_lists(|l, _| l.max_seq);
        for j in look_around_window(&mm, i) {
            meter.host_ptes_scanned += 1;
            if mm.resident(j) && mm.test_and_clear_host_young(j) {
                mm.update_gen(j, max_seq);
            }
        }
        st.young += 1;
    }
    // After look-around (which cleared it), the notify call finds the host PTE old.
    st.pte_young = mm.test_and_clear_host_young(i);
}

/// The PTEs `lru_gen_look_around()` checks around folio `i`: up to `MIN_LRU_BATCH`, centred
/// on it within its PMD (the VMA is the whole memfd).
fn look_around_window(mm: &HostMm, i: u32) -> std::ops::Range<u32> {
    let pmd_start = i as u64 / PTES_PER_PMD * PTES_PER_PMD;
    let pmd_end = (pmd_start + PTES_PER_PMD).min(mm.npages);
    let start = (i as u64).saturating_sub(MIN_LRU_BATCH / 2).max(pmd_start);
    let end = (start + MIN_LRU_BATCH).min(pmd_end);
    let start = end.saturating_sub(MIN_LRU_BATCH).max(pmd_start);
    start as u32..end as u32
}

/// KVM's part of `folio_referenced()` for folio `i`, then `folio_check_references()` in a
/// step of its own (outside `mmu_lock`, as in Linux): `kvm_mmu_notifier_clear_flush_young()`
/// (locked, or lockless where the MMU ages so), the seed's fallback `clear_young`, or the
/// seed's `should_look_around()` and look-around through `test_clear_young()`.
fn ask_kvm(st: &State, state: Arc<Mutex<State>>, i: u32) -> (Func, OpPlan) {
    let pfn = st.mm.pfn(i);
    let end = pfn + 1;
    let decide_step = lockless(Arc::clone(&state), move |st, _, meter| decide(st, i, meter));
    if st.batched {
        let step = lockless(state, move |st, kvm, meter| {
            let young = seed_look_around(st, kvm, i, meter);
            st.young += young;
        });
        return (
            Func::LookAround,
            OpPlan {
                steps: vec![step, decide_step],
            },
        );
    }
    let fallback = st.fallback;
    let body =
        move |st: &mut State, kvm: &Kvm, held: Option<Held<'_, Write>>, meter: &mut Meter| {
            let mmu = Arc::clone(&st.mmu);
            let kvm_young = if fallback {
                mmu_notifier::age_range(
                    kvm,
                    &*mmu,
                    pfn,
                    end,
                    mmu_notifier::AgeOp::Clear,
                    held,
                    meter,
                )
            } else {
                clear_flush_young(kvm, &*mmu, pfn, end, st.aging, held, meter)
            };
            // ptep_clear_flush_young_notify(): the host PTE's bit ORed with KVM's, one reference.
            st.young += (st.pte_young || kvm_young) as u32;
        };
    let notify = match aging_lock_mode(&*st.mmu, st.aging) {
        Some(_) => write_locked(state, "clear_flush_young", move |st, kvm, held, m| {
            body(st, kvm, Some(held), m)
        }),
        None => lockless(state, move |st, kvm, m| body(st, kvm, None, m)),
    };
    (
        Func::ClearFlushYoung,
        OpPlan {
            steps: vec![notify, decide_step],
        },
    )
}

/// Seed 003's `should_look_around()` and `lru_gen_look_around()` for folio `i`: one
/// `test_clear_young()` that tests and clears the folio's own KVM Accessed bit; when it or
/// the host PTE was young, one call that tests the `MIN_LRU_BATCH` pages around it into a
/// bitmap, promotion of the young ones to the youngest generation, and one call that clears
/// them. Returns the references found (0 or 1).
fn seed_look_around(st: &mut State, kvm: &Kvm, i: u32, meter: &mut Meter) -> u32 {
    let mm = Arc::clone(&st.mm);
    let mmu = Arc::clone(&st.mmu);
    let one = [1u64];
    let kvm_young = mmu_notifier::test_clear_young(
        kvm,
        &*mmu,
        mm.pfn(i),
        1,
        YoungBitmap::Clear(&one),
        st.aging,
        meter,
    )
    .is_some_and(|r| r.young);
    let host_young = mm.test_and_clear_host_young(i);
    if !kvm_young && !host_young {
        return 0;
    }
    let window = look_around_window(&mm, i);
    let max_seq = mm.with_lists(|l, _| l.max_seq);
    promote_young(kvm, &*mmu, &mm, window, max_seq, st.aging, meter);
    1
}

/// The seed's batched check of the pages `window` (at most 64): one `test_clear_young()` call
/// tests KVM's Accessed bits into a bitmap; each page young there or in the host PTE moves
/// to generation `seq`; one more call clears KVM's bits of the young pages. Returns how many
/// were young.
fn promote_young(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    mm: &HostMm,
    window: std::ops::Range<u32>,
    seq: u64,
    aging: Aging,
    meter: &mut Meter,
) -> u64 {
    let n = (window.end - window.start) as u64;
    let first = mm.pfn(window.start);
    let mut bitmap = [0u64];
    // test_spte_young(): one test call for the chunk.
    mmu_notifier::test_clear_young(
        kvm,
        mmu,
        first,
        n,
        YoungBitmap::Fill(&mut bitmap),
        aging,
        meter,
    );
    let mut young = 0;
    for j in window.clone() {
        meter.host_ptes_scanned += 1;
        if !mm.resident(j) {
            continue;
        }
        let (w, b) = mmu_notifier::young_bit(n, (j - window.start) as u64);
        let kvm_young = bitmap[w] & b != 0;
        if mm.test_and_clear_host_young(j) || kvm_young {
            mm.update_gen(j, seq);
            young += 1;
        } else {
            // skip_spte_young(): a page not taken is not cleared.
            bitmap[w] &= !b;
        }
    }
    if bitmap[0] != 0 {
        // clear_spte_young(): one clear call for the young pages of the chunk.
        mmu_notifier::test_clear_young(
            kvm,
            mmu,
            first,
            n,
            YoungBitmap::Clear(&bitmap),
            aging,
            meter,
        );
    }
    young
}

/// `folio_check_references()` for folio `i` with `st.young` references, and what follows in
/// `shrink_folio_list()` (or `shrink_active_list()`'s deactivation).
fn decide(st: &mut State, i: u32, meter: &mut Meter) {
    let mm = Arc::clone(&st.mm);
    let referenced_ptes = std::mem::take(&mut st.young);
    meter.lru_folios_scanned += 1;
    if st.from == Source::Active {
        // shrink_active_list(): anonymous folios are deactivated, young or not.
        mm.with_lists(|l, s| {
            mm.putback(l, i, false, None);
            s.pgdeactivate += 1;
        });
        st.next = next_in_batch(st);
        return;
    }
    let referenced_folio = mm.test_and_clear_referenced(i);
    if referenced_ptes == 0 {
        st.next = Next::Unmap(i);
        return;
    }
    mm.set_referenced(i);
    let activate = referenced_folio || referenced_ptes > 1;
    mm.with_lists(|l, s| {
        let seq = match mm.policy {
            LruPolicy::Classic => None,
            // evict_folios() sets PG_active on the folios it did not reclaim (Linux 6.1-6.2),
            // so lru_gen_add_folio() puts kept and activated ones in the youngest generation.
            LruPolicy::Mglru => Some(l.max_seq),
        };
        mm.putback(l, i, activate, seq);
        s.pgactivate += activate as u64;
    });
    st.next = next_in_batch(st);
}

/// `try_to_unmap()` of folio `i`: `mmu_notifier_invalidate_range_start()` (KVM zaps and
/// flushes under the write lock), the host PTE replaced by a swap entry (the content moves
/// to the swap device), `mmu_notifier_invalidate_range_end()`.
fn try_to_unmap(st: &State, state: Arc<Mutex<State>>, i: u32) -> OpPlan {
    let pfn = st.mm.pfn(i);
    let end = pfn + 1;
    let clear_pte = lockless(Arc::clone(&state), move |st, kvm, meter| {
        meter.rmap_walks += 1;
        st.mm.unmap_to_swap(i, &kvm.host);
        st.next = Next::Pageout(i);
    });
    if st.skip_invalidate {
        return OpPlan {
            steps: vec![clear_pte],
        };
    }
    let mmu = Arc::clone(&st.mmu);
    OpPlan {
        steps: vec![
            write_locked(
                Arc::clone(&state),
                "invalidate_range_start",
                move |_, kvm, held, meter| {
                    invalidate_range_start(kvm, &*mmu, pfn, end, held, meter);
                },
            ),
            clear_pte,
            write_locked(state, "invalidate_range_end", move |_, kvm, held, meter| {
                invalidate_range_end(kvm, held, meter)
            }),
        ],
    }
}

/// MGLRU aging from PMD `pmd` (`walk_mm()` → `walk_pmd_range()` → `walk_pte_range()`), a few
/// PMDs per plan: PMDs outside the filter are skipped; each present PTE whose page is young
/// (the host PTE's Accessed bit; with the seed, KVM's too, two `test_clear_young()` calls per
/// 64 PTEs) moves its folio to the youngest generation; a PMD with at least one young PTE
/// per eight (`suitable_to_scan()`) goes into the next filter. After the last PMD,
/// `inc_max_seq()` opens a new generation.
fn walk_mm(st: &mut State, kvm: &Kvm, pmd: u64, meter: &mut Meter) {
    let mm = Arc::clone(&st.mm);
    let mmu = Arc::clone(&st.mmu);
    let nr_pmds = mm.npages.div_ceil(PTES_PER_PMD);
    let (filter, max_seq) = mm.with_lists(|l, _| (l.walk_filter.clone(), l.max_seq));
    let end_pmd = (pmd + PMDS_PER_WALK_PLAN).min(nr_pmds);
    let use_kvm = st.batched && mmu.lockless_test_clear_young();
    let mut suitable = Vec::new();
    for p in pmd..end_pmd {
        // The PMD entry itself.
        meter.host_ptes_scanned += 1;
        if filter
            .as_ref()
            .is_some_and(|f| f[(p / 64) as usize] & (1 << (p % 64)) == 0)
        {
            continue;
        }
        let first = p * PTES_PER_PMD;
        let last = (first + PTES_PER_PMD).min(mm.npages);
        let (mut young, mut total) = (0, 0);
        let mut chunk = first;
        while chunk < last {
            let window = chunk as u32..(chunk + MIN_LRU_BATCH).min(last) as u32;
            // walk_pte_range() counts every PTE it visits.
            total += (window.end - window.start) as u64;
            if use_kvm {
                young += promote_young(kvm, &*mmu, &mm, window, max_seq, st.aging, meter);
            } else {
                for j in window {
                    meter.host_ptes_scanned += 1;
                    if mm.resident(j) && mm.test_and_clear_host_young(j) {
                        mm.update_gen(j, max_seq);
                        young += 1;
                    }
                }
            }
            chunk += MIN_LRU_BATCH;
        }
        if total > 0 && young * 8 >= total {
            suitable.push(p);
        }
    }
    let done = end_pmd == nr_pmds;
    mm.with_lists(|l, s| {
        for p in suitable {
            l.next_filter[(p / 64) as usize] |= 1 << (p % 64);
        }
        if done {
            // inc_max_seq(), and the filter filled by this walk serves the next.
            l.max_seq += 1;
            let len = l.next_filter.len();
            let next = std::mem::replace(&mut l.next_filter, vec![0; len]);
            l.walk_filter = Some(next);
            s.mglru_aging += 1;
        }
    });
    st.next = if done {
        Next::Batch
    } else {
        Next::Walk(end_pmd)
    };
}
