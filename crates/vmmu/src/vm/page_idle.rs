//! Idle page tracking (`mm/page_idle.c`, `/sys/kernel/mm/page_idle/bitmap`) as
//! access_tracking_perf_test drives it, reaching KVM through the MMU notifier: one
//! [`PageIdleMarker`] per vCPU thread marks that vCPU's pages idle, a page at a time, as the
//! selftest's `mark_vcpu_memory_idle()` does.
//!
//! For each page: `/proc/self/pagemap` gives its PFN (none when the host swapped it out);
//! reading its bit reads the 8-byte word of 64 frames (`page_idle_bitmap_read()`), which checks
//! every folio of the word already marked idle through the rmap, `ptep_clear_young_notify()`
//! on the VMM's PTE: KVM's `clear_young`, which never flushes; a young folio loses its idle
//! mark. So marking page `k` of a word first re-checks the `k` pages marked before it. A page
//! still idle is counted; any other is marked (`page_idle_bitmap_write()`): the rmap walk
//! again, then `folio_set_idle()`. Simplified: `page_idle_get_folio()`'s per-frame lookup is
//! not priced, and the rmap walk's `anon_vma` lock, which the marking threads share, is priced
//! as uncontended.
//!
//! KVM's `clear_young` takes `mmu_lock` for write (`--aging locked`: Linux up to 6.14 on x86,
//! and arm64) or none where the MMU ages locklessly (`--aging lockless`: the TDP MMU on
//! Linux 6.15+), so the marking threads serialize on the lock, or not.

use crate::host::lru::HostMm;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::Mmu;
use crate::kvm::mmu_lock::{Held, Write};
use crate::kvm::mmu_notifier::{age_range, aging_lock_mode, AgeOp, Aging, NotifierJob};
use crate::kvm::op_plan::{OpPlan, OpStep, PlanCall};
use crate::kvm::Kvm;
use crate::units::Pfn;
use crate::vm::host_thread::HostThread;
use parking_lot::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// What one marking pass found, per vCPU thread (the selftest's counts).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MarkStats {
    /// Pages whose PFN `/proc/self/pagemap` did not give (not present on the host).
    pub no_pfn: u64,
    /// Pages still idle from the previous marking (the guest did not touch them, or its
    /// accesses hit translations the TLB kept).
    pub still_idle: u64,
    /// Pages marked idle.
    pub marked: u64,
}

/// Where a marker is with the page in hand.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Step {
    /// Read the page's bit (and first look its PFN up).
    Read,
    /// Set the page's bit.
    Mark,
}

/// The marker's state, shared with the closures of its plans.
struct State {
    mm: Arc<HostMm>,
    mmu: Arc<dyn Mmu>,
    aging: Aging,
    /// The frames left to mark, and the one in hand.
    next: u64,
    end: u64,
    step: Step,
    /// Whether KVM's `clear_young` found the page in hand young.
    young: bool,
    stats: MarkStats,
    /// `mmu_lock` write waits of the plan in flight.
    write_wait_ns: u64,
}

/// One vCPU thread marking its pages idle (see the module documentation).
pub struct PageIdleMarker {
    state: Arc<Mutex<State>>,
    /// What its plans counted.
    pub meter: Meter,
    /// Of them, waiting for `mmu_lock`'s write side.
    pub write_wait_ns: u64,
}

impl PageIdleMarker {
    /// A marker for the host frames `[first, first + pages)` of `kvm.host_mm`, reaching KVM's
    /// `mmu` under `aging`.
    pub fn new(kvm: &Arc<Kvm>, mmu: &Arc<dyn Mmu>, aging: Aging, first: Pfn, pages: u64) -> Self {
        let mm = Arc::clone(
            kvm.host_mm
                .get()
                .expect("page_idle needs the host's folios"),
        );
        let first = mm.index(first).expect("the frames are the host's") as u64;
        PageIdleMarker {
            state: Arc::new(Mutex::new(State {
                mm,
                mmu: Arc::clone(mmu),
                aging,
                next: first,
                end: first + pages,
                step: Step::Read,
                young: false,
                stats: MarkStats::default(),
                write_wait_ns: 0,
            })),
            meter: Meter::default(),
            write_wait_ns: 0,
        }
    }

    /// What the pass found.
    pub fn stats(&self) -> MarkStats {
        self.state.lock().stats.clone()
    }
}

/// `folio_idle_clear_pte_refs()` on the frame in hand: the rmap walk to the VMM's PTE, then
/// KVM's `clear_young` through the notifier (the host PTE's own Accessed bit is tested and
/// cleared with it).
fn clear_pte_refs(
    st: &State,
    state: &Arc<Mutex<State>>,
    frame: u32,
    then: impl FnOnce(&mut State) + Send + 'static,
) -> Vec<OpStep> {
    let pfn = st.mm.pfn(frame);
    let end = pfn + 1;
    let s = Arc::clone(state);
    let rmap = OpStep::Call(Box::new(move |_: &Kvm, meter: &mut Meter| {
        let mut st = s.lock();
        meter.rmap_walks += 1;
        st.young = st.mm.test_and_clear_host_young(frame);
    }) as PlanCall);
    let s = Arc::clone(state);
    let s2 = Arc::clone(state);
    let body = move |kvm: &Kvm, held: Option<Held<'_, Write>>, meter: &mut Meter| {
        let mut st = s.lock();
        let mmu = Arc::clone(&st.mmu);
        // kvm_mmu_notifier_clear_young(): no flush, young or not.
        st.young |= age_range(kvm, &*mmu, pfn, end, AgeOp::Clear, held, meter);
        then(&mut st);
    };
    let notify = match aging_lock_mode(&*st.mmu, st.aging) {
        Some(_) => OpStep::Job(Box::new(NotifierJob::new(
            "clear_young",
            Box::new(move |kvm: &Kvm, held: Held<'_, Write>, m: &mut Meter| {
                s2.lock().write_wait_ns += held.waited_ns();
                body(kvm, Some(held), m)
            }),
        ))),
        None => {
            OpStep::Call(Box::new(move |kvm: &Kvm, m: &mut Meter| body(kvm, None, m)) as PlanCall)
        }
    };
    vec![rmap, notify]
}

/// Moves on to the next page.
fn next_page(st: &mut State) {
    st.next += 1;
    st.step = Step::Read;
}

impl HostThread for PageIdleMarker {
    fn next_plan(&mut self, _kvm: &Kvm) -> Option<OpPlan> {
        let state = Arc::clone(&self.state);
        let mut st = self.state.lock();
        if st.next >= st.end {
            return None;
        }
        let i = st.next as u32;
        let steps = match st.step {
            Step::Read => {
                // pagemap and the bitmap's pread(): two system calls.
                let lookup = OpStep::Call(
                    Box::new(|_: &Kvm, m: &mut Meter| m.host_syscalls += 2) as PlanCall
                );
                if !st.mm.resident(i) {
                    st.stats.no_pfn += 1;
                    next_page(&mut st);
                    vec![lookup]
                } else {
                    // page_idle_bitmap_read() of the 8-byte word holding the page's bit: for
                    // each of its 64 frames whose folio is idle, the references are checked
                    // (a young folio is no longer idle). Then the page itself: still idle is
                    // counted, anything else the test marks.
                    let mut steps = vec![lookup];
                    let first = i / 64 * 64;
                    let last = (first as u64 + 64).min(st.mm.npages) as u32;
                    for j in first..last {
                        if st.mm.resident(j) && st.mm.idle(j) {
                            steps.extend(clear_pte_refs(&st, &state, j, move |st| {
                                if st.young {
                                    st.mm.set_idle(j, false);
                                }
                            }));
                        }
                    }
                    steps.push(OpStep::Call(Box::new({
                        let s = Arc::clone(&state);
                        move |_: &Kvm, _: &mut Meter| {
                            let mut st = s.lock();
                            if st.mm.idle(i) {
                                st.stats.still_idle += 1;
                                next_page(&mut st);
                            } else {
                                st.step = Step::Mark;
                            }
                        }
                    }) as PlanCall));
                    steps
                }
            }
            Step::Mark => {
                // page_idle_bitmap_write(): pwrite(), the references cleared, the folio marked.
                let mut steps =
                    vec![OpStep::Call(
                        Box::new(|_: &Kvm, m: &mut Meter| m.host_syscalls += 1) as PlanCall,
                    )];
                steps.extend(clear_pte_refs(&st, &state, i, move |st| {
                    st.mm.set_idle(i, true);
                    st.stats.marked += 1;
                    next_page(st);
                }));
                steps
            }
        };
        Some(OpPlan { steps })
    }

    fn wake_flag(&self) -> Arc<AtomicBool> {
        // A marker never sleeps: it runs to the end of its pages.
        Arc::new(AtomicBool::new(false))
    }

    fn plan_done(&mut self, _ns: u64, meter: &Meter) {
        let wait = std::mem::take(&mut self.state.lock().write_wait_ns);
        self.meter.add(meter);
        self.write_wait_ns += wait;
    }
}
