//! KVM's MMU notifier (`virt/kvm/kvm_main.c`): what KVM does when the host changes or ages the
//! memory behind a memslot. The host calls it with a range of its own frames (KVM's hva range:
//! here a memslot's host frames stand for its userspace mapping), and KVM turns that into gfn
//! ranges of the memslots that map them (`kvm_handle_hva_range()`).
//!
//! - **Invalidation** (`kvm_mmu_notifier_invalidate_range_start()` / `_end()`): under the write
//!   lock, `mmu_invalidate_in_progress` counts open invalidations and their gfn range grows to
//!   cover them; the range's mappings are zapped and flushed before `_start` returns. `_end`
//!   bumps `mmu_invalidate_seq`. A fault snapshots the sequence before it looks the page up and,
//!   under `mmu_lock`, gives up (`RET_PF_RETRY`) if an invalidation covering its gfn is open or
//!   one ended since (`mmu_invalidate_retry_gfn()`): so no fault installs a translation of a
//!   page the host is taking away.
//! - **Aging** (`clear_flush_young`, `clear_young`, `test_young`, and seed 003's
//!   `test_clear_young` with its bitmap): the Accessed flag of every leaf in the range is tested
//!   and cleared, under the write lock ([`Aging::Locked`]) or, where the MMU allows it, under
//!   RCU alone ([`Aging::Lockless`]). Aging never changes a PFN, so faults need no retry for it.

use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, Mmu, MmuJob};
use crate::kvm::mmu_lock::{Held, LockMode, MmuLockHeld, Write};
use crate::kvm::Kvm;
use crate::units::{Gfn, Pfn};
use std::sync::atomic::{AtomicU64, Ordering};

/// How the notifier's aging callbacks take `mmu_lock`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aging {
    /// Every callback under the write lock, and `clear_flush_young` flushes the VM's TLBs when
    /// anything was young: Linux up to 6.12 on x86 (the seed's base), and arm64 to this day.
    /// The batched `test_clear_young` is not offered (MGLRU falls back to `clear_young`).
    #[default]
    Locked,
    /// Seed 003 (v2) and, for the per-range callbacks, Linux 6.15 on x86
    /// (`CONFIG_KVM_MMU_LOCKLESS_AGING`): the Accessed flag is tested and cleared under RCU
    /// with atomics, without `mmu_lock`, wherever the MMU can (the TDP MMU; arm64 stage 2 with
    /// the seed's shared walk for `test_clear_young`); no flush on young (x86 since 6.13);
    /// `test_clear_young` takes a bitmap of pages. An MMU that cannot (the shadow MMU:
    /// `kvm_memslots_have_rmaps()`) falls back to the locked path.
    Lockless,
}

/// `kvm->mmu_invalidate_seq`, `kvm->mmu_invalidate_in_progress` and the range of the open
/// invalidations (`mmu_invalidate_range_start` / `_end`), changed under the write lock.
#[derive(Debug)]
pub struct MmuInvalidate {
    seq: AtomicU64,
    in_progress: AtomicU64,
    range_start: AtomicU64,
    range_end: AtomicU64,
    /// The negative control: faults ignore invalidations (a KVM without the retry check),
    /// which the oracles must catch. Never set in a real run.
    pub ignore_for_negative_control: std::sync::atomic::AtomicBool,
    /// The negative control of copy-on-write: the host copies the zero page without telling
    /// KVM (no invalidation, no `change_pte`), so a stage-2 entry of the zero page outlives it,
    /// which the oracles must catch. Never set in a real run.
    pub skip_cow_notifier_for_negative_control: std::sync::atomic::AtomicBool,
}

impl Default for MmuInvalidate {
    fn default() -> Self {
        MmuInvalidate {
            seq: AtomicU64::new(0),
            in_progress: AtomicU64::new(0),
            range_start: AtomicU64::new(u64::MAX),
            range_end: AtomicU64::new(0),
            ignore_for_negative_control: Default::default(),
            skip_cow_notifier_for_negative_control: Default::default(),
        }
    }
}

impl MmuInvalidate {
    /// A fault's `mmu_seq = kvm->mmu_invalidate_seq; smp_rmb()`, taken before it looks up the
    /// page. Acquire pairs with the Release of [`MmuInvalidate::end`].
    pub fn snapshot(&self) -> u64 {
        self.seq.load(Ordering::Acquire)
    }

    /// `kvm_mmu_invalidate_begin()`, write lock held: one more open invalidation; the first
    /// resets the range.
    pub fn begin(&self, _held: Held<'_, Write>) {
        if self.in_progress.fetch_add(1, Ordering::Relaxed) == 0 {
            self.range_start.store(u64::MAX, Ordering::Relaxed);
            self.range_end.store(0, Ordering::Relaxed);
        }
    }

    /// `kvm_mmu_invalidate_range_add()`, write lock held: the open range grows to cover
    /// `[start, end)`.
    pub fn range_add(&self, start: Gfn, end: Gfn, _held: Held<'_, Write>) {
        self.range_start.fetch_min(start.0, Ordering::Relaxed);
        self.range_end.fetch_max(end.0, Ordering::Relaxed);
    }

    /// `kvm_mmu_invalidate_end()`, write lock held: the sequence moves on (Release, KVM's
    /// `smp_wmb()`, before the count drops), and one invalidation closes.
    pub fn end(&self, _held: Held<'_, Write>) {
        self.seq.fetch_add(1, Ordering::Release);
        let was = self.in_progress.fetch_sub(1, Ordering::Relaxed);
        assert!(was > 0, "mmu_invalidate_end() without a begin");
    }

    /// `mmu_invalidate_retry_gfn()`, under `mmu_lock`: the fault that snapshotted `mmu_seq` must
    /// not install a translation of `gfn` (an open invalidation covers it, or one ended since
    /// the snapshot).
    pub fn retry_gfn(&self, mmu_seq: u64, gfn: Gfn) -> bool {
        if self.ignore_for_negative_control.load(Ordering::Relaxed) {
            return false;
        }
        if self.in_progress.load(Ordering::Relaxed) > 0 {
            let (s, e) = (
                self.range_start.load(Ordering::Relaxed),
                self.range_end.load(Ordering::Relaxed),
            );
            if gfn.0 >= s && gfn.0 < e {
                return true;
            }
        }
        self.seq.load(Ordering::Relaxed) != mmu_seq
    }

    /// Whether an open invalidation covers `gfn` (the first half of
    /// [`MmuInvalidate::retry_gfn`], without the sequence).
    pub fn in_progress_covers(&self, gfn: Gfn) -> bool {
        self.in_progress.load(Ordering::Relaxed) > 0
            && gfn.0 >= self.range_start.load(Ordering::Relaxed)
            && gfn.0 < self.range_end.load(Ordering::Relaxed)
    }

    /// `mmu_invalidate_retry()` (arm64's check, with no gfn): any open invalidation, or one
    /// ended since the snapshot.
    pub fn retry(&self, mmu_seq: u64) -> bool {
        if self.ignore_for_negative_control.load(Ordering::Relaxed) {
            return false;
        }
        self.in_progress.load(Ordering::Relaxed) > 0 || self.seq.load(Ordering::Relaxed) != mmu_seq
    }

    /// Whether the copy-on-write negative control is on (see
    /// [`MmuInvalidate::skip_cow_notifier_for_negative_control`]).
    pub fn skip_cow_for_negative_control(&self) -> bool {
        self.skip_cow_notifier_for_negative_control
            .load(Ordering::Relaxed)
    }

    /// Open invalidations (`mmu_invalidate_in_progress`).
    pub fn in_progress(&self) -> u64 {
        self.in_progress.load(Ordering::Relaxed)
    }
}

/// The gfn ranges of the memslots that map the host frames `[start, end)`
/// (`kvm_handle_hva_range()`'s walk of the memslot interval tree).
pub fn gfn_ranges_of(kvm: &Kvm, start: Pfn, end: Pfn) -> Vec<(Gfn, Gfn)> {
    kvm.all_slots()
        .iter()
        .filter_map(|s| {
            let base = s.gfn_to_pfn(s.base_gfn).0;
            let (lo, hi) = (start.0.max(base), end.0.min(base + s.npages));
            (lo < hi).then(|| ((s.base_gfn + lo - base), (s.base_gfn + hi - base)))
        })
        .collect()
}

/// `kvm_mmu_notifier_invalidate_range_start()` for the host frames `[start, end)`, write lock
/// held: opens an invalidation, and zaps and flushes the memslots' mappings of those frames
/// (`kvm_mmu_unmap_gfn_range()`). Returns whether any memslot maps them.
pub fn invalidate_range_start(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    start: Pfn,
    end: Pfn,
    held: Held<'_, Write>,
    meter: &mut Meter,
) -> bool {
    kvm.mmu_invalidate.begin(held);
    let ranges = gfn_ranges_of(kvm, start, end);
    for &(s, e) in &ranges {
        kvm.mmu_invalidate.range_add(s, e, held);
        if let Some(flush) = mmu.zap_gfn_range(kvm, s, e, held, meter) {
            kvm.flush_remote_tlbs_range(flush.start, flush.pages(), meter);
        }
    }
    meter.mmu_notifier_calls += 1;
    !ranges.is_empty()
}

/// `kvm_mmu_notifier_invalidate_range_end()`, write lock held: closes the invalidation.
pub fn invalidate_range_end(kvm: &Kvm, held: Held<'_, Write>, meter: &mut Meter) {
    kvm.mmu_invalidate.end(held);
    meter.mmu_notifier_calls += 1;
}

/// What an aging callback asks of each young leaf.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AgeOp {
    /// `kvm_test_age_gfn()`: report it, leave it.
    Test,
    /// `kvm_age_gfn()`: report it and clear its Accessed flag.
    Clear,
}

/// Whether the per-range callbacks (`clear_flush_young`, `clear_young`, `test_young`) run
/// without `mmu_lock` on `mmu` under `aging`.
pub fn lockless(mmu: &dyn Mmu, aging: Aging) -> bool {
    aging == Aging::Lockless && mmu.lockless_age_range()
}

/// The body of `clear_young` (`Clear`) and `test_young` (`Test`) over the host frames
/// `[start, end)`: every memslot mapping them, each leaf visited by [`Mmu::age_gfn_range`].
/// `held` is the write lock when the callback is locked, `None` when lockless. Returns whether
/// any leaf was young.
pub fn age_range(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    start: Pfn,
    end: Pfn,
    op: AgeOp,
    held: Option<Held<'_, Write>>,
    meter: &mut Meter,
) -> bool {
    meter.mmu_notifier_calls += 1;
    let mut young = false;
    for (s, e) in gfn_ranges_of(kvm, start, end) {
        young |= mmu.age_gfn_range(kvm, s, e, &mut |_, _| op == AgeOp::Clear, held, meter);
    }
    young
}

/// The lock an aging callback needs under `aging` on `mmu` (`None`: none, lockless).
pub fn aging_lock_mode(mmu: &dyn Mmu, aging: Aging) -> Option<LockMode> {
    (!lockless(mmu, aging)).then_some(LockMode::Write)
}

/// `kvm_mmu_notifier_clear_flush_young()`: [`age_range`] clearing, then, when anything was
/// young and the callback is locked, a flush of the VM's TLBs (x86 stopped flushing in 6.13,
/// which lockless aging follows; arm64, never lockless here, still flushes).
pub fn clear_flush_young(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    start: Pfn,
    end: Pfn,
    aging: Aging,
    held: Option<Held<'_, Write>>,
    meter: &mut Meter,
) -> bool {
    let young = age_range(kvm, mmu, start, end, AgeOp::Clear, held, meter);
    if young && !lockless(mmu, aging) {
        kvm.flush_remote_tlbs(meter);
    }
    young
}

/// Bits of the seed's `test_clear_young()` result (`MMU_NOTIFIER_RANGE_LOCKLESS` and
/// `MMU_NOTIFIER_RANGE_YOUNG`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct TestClearYoung {
    /// The fast path handled the range without `mmu_lock`.
    pub lockless: bool,
    /// Some leaf in the range was young.
    pub young: bool,
}

/// The bit of frame `start + i` in a `test_clear_young()` bitmap of `npages` frames: the seed
/// counts from the end of the range (`(end - addr) / PAGE_SIZE - 1`).
pub fn young_bit(npages: u64, i: u64) -> (usize, u64) {
    let b = npages - 1 - i;
    ((b / 64) as usize, 1 << (b % 64))
}

/// What seed 003's `test_clear_young()` does with its bitmap ([`young_bit`] numbering).
pub enum YoungBitmap<'b> {
    /// Test: set the bit of every young leaf.
    Fill(&'b mut [u64]),
    /// Clear the Accessed flag of the young leaves whose bit is set.
    Clear(&'b [u64]),
}

impl YoungBitmap<'_> {
    fn words(&self) -> usize {
        match self {
            YoungBitmap::Fill(b) => b.len(),
            YoungBitmap::Clear(b) => b.len(),
        }
    }
}

/// Seed 003's `kvm_mmu_notifier_test_clear_young()` (v2) over `npages` host frames from
/// `start`, without `mmu_lock`: fills or applies `bitmap` ([`YoungBitmap`]). As
/// `kvm_should_clear_young()`, a leaf counts by its first gfn (clamped into the range), so a
/// huge leaf has one bit. `None` when aging is locked or the MMU cannot do it locklessly:
/// the caller falls back to `clear_young` when it has no bitmap to fill, or gives up.
pub fn test_clear_young(
    kvm: &Kvm,
    mmu: &dyn Mmu,
    start: Pfn,
    npages: u64,
    mut bitmap: YoungBitmap<'_>,
    aging: Aging,
    meter: &mut Meter,
) -> Option<TestClearYoung> {
    if aging != Aging::Lockless || !mmu.lockless_test_clear_young() {
        return None;
    }
    assert!(bitmap.words() as u64 * 64 >= npages, "bitmap too short");
    meter.mmu_notifier_calls += 1;
    let mut young = false;
    for (s, e) in gfn_ranges_of(kvm, start, start + npages) {
        let slot = kvm.slot_by_gfn(s).expect("the range came from a memslot");
        let first = slot.gfn_to_pfn(s).0 - start.0;
        let mut visit = |gfn: Gfn, _pages: u64| {
            let (w, b) = young_bit(npages, first + gfn.0.max(s.0) - s.0);
            match &mut bitmap {
                YoungBitmap::Clear(bits) => bits[w] & b != 0,
                YoungBitmap::Fill(bits) => {
                    bits[w] |= b;
                    false
                }
            }
        };
        young |= mmu.age_gfn_range(kvm, s, e, &mut visit, None, meter);
    }
    Some(TestClearYoung {
        lockless: true,
        young,
    })
}

/// The body of a notifier callback that runs under the write lock.
pub type LockedCallback = Box<dyn FnOnce(&Kvm, Held<'_, Write>, &mut Meter) + Send>;

/// One MMU notifier callback that takes `mmu_lock` for write (`KVM_MMU_LOCK()` in
/// `kvm_handle_hva_range()`), as a job a host thread's plan runs: it runs once and never
/// yields (the host's ranges here are small: a folio, or a teardown with nobody running).
pub struct NotifierJob {
    name: &'static str,
    f: Option<LockedCallback>,
}

impl NotifierJob {
    /// The callback `f`, named `name` in traces.
    pub fn new(name: &'static str, f: LockedCallback) -> Self {
        NotifierJob { name, f: Some(f) }
    }
}

impl MmuJob for NotifierJob {
    fn name(&self) -> &'static str {
        self.name
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        // The job declared the write lock (lock_mode()): the callback gets it as such.
        (self.f.take().expect("a notifier job runs once"))(kvm, held.write(), meter);
        JobStep::Done { flush: None }
    }
}
