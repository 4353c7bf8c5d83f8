//! Model-checked races on one SPTE, using the very protocol functions the TDP MMU runs. The
//! schedules of the threads' atomic operations are explored by shuttle: exhaustively (DFS) for
//! two threads, with its PCT scheduler for three. The properties are about interleavings, not
//! weak-memory reordering: every operation involved is a SeqCst RMW or an acquire/release pair.
//!
//! - a vCPU's `fast_page_fault()` (the MMUs' own `fast_page_fault_lockless()`, walking to the
//!   modelled entry) restoring W with cmpxchg and then marking the page dirty, followed by the
//!   hardware write (`hw_set_accessed_dirty()`, which sets D only on a writable entry);
//! - another vCPU writing through whatever the entry allows at that moment;
//! - the VMM's `KVM_GET_DIRTY_LOG` (xchg the bitmap word, then clear W with cmpxchg), as
//!   `kvm_get_dirty_log_protect()` and `clear_dirty_pt_masked()` do (the same
//!   `wrprot_spte_atomic()` the TDP MMU calls there and in `wrprot_gfn_range()`).
//!
//! Property (what the completeness oracle relies on): in every interleaving, a guest write
//! that landed is either in the harvest or still marked dirty for the next one, and an entry
//! left writable always has its dirty bit set (writable ⇒ tracked).
//!
//! Not modelled here: the TLB (a write through a stale cached translation before the flush);
//! `tests/dirty_log_interface.rs` covers that with the real TLB model.

mod model_common;

use model_common::ModelSpte;
use shuttle::sync::atomic::{AtomicU64, Ordering};
use shuttle::sync::Arc;
use std::sync::atomic::AtomicU64 as StdAtomicU64;
use vmmu::hw::ept::hw_set_accessed_dirty;
use vmmu::kvm::meter::Meter;
use vmmu::kvm::mmu::RetPf;
use vmmu::units::{Gfn, Pfn};
use vmmu::x86::fast_page_fault::{fast_page_fault_lockless, LastSptepWalk};
use vmmu::x86::spte::*;

fn write_protected_leaf() -> u64 {
    make_spte(PG_LEVEL_4K, Pfn(42), true, false) & !(PT_WRITABLE_MASK | SHADOW_DIRTY_MASK)
}

/// Explores every schedule of a two-thread model (bounded only by the programs' length).
fn check_all(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_dfs(f, None);
}

/// Three-thread models have too many schedules for exhaustive search; PCT (probabilistic
/// concurrency testing) finds any bug of depth <= 3 with a known probability per run, and
/// 20000 runs make a miss vanishingly unlikely.
fn check_three_threads(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_pct(f, 20_000, 3);
}

/// The lockless walk of a VM whose only mapping is the modelled 4K leaf: each walk reads it
/// again.
struct OneLeaf<'a>(&'a ModelSpte);

impl LastSptepWalk<ModelSpte> for OneLeaf<'_> {
    fn get_last_sptep<'g>(
        &'g self,
        _gfn: Gfn,
        _guard: &'g crossbeam_epoch::Guard,
        _meter: &mut Meter,
    ) -> Option<(&'g ModelSpte, u64, Level)> {
        Some((self.0, self.0.load(), PG_LEVEL_4K))
    }
}

/// A vCPU's write fault on a present entry of a logged slot through the MMUs'
/// `fast_page_fault()`, with `mark_page_dirty` for `mark_page_dirty_in_slot()`.
fn fast_page_fault(spte: &ModelSpte, mark_page_dirty: impl FnOnce()) -> RetPf {
    let mark_page_dirty = |_: &mut Meter| mark_page_dirty();
    let mut meter = Meter::default();
    fast_page_fault_lockless(
        Gfn(0),
        true,
        true,
        true,
        &OneLeaf(spte),
        mark_page_dirty,
        &mut meter,
    )
}

/// The shared world: one logged 4K leaf, its bitmap word (the page is bit 0), and which
/// guest writes landed.
struct World {
    spte: ModelSpte,
    bitmap: AtomicU64,
    // Observers, not part of the protocol: plain std atomics add no scheduling points (shuttle
    // runs one thread at a time, so they see a sequentially consistent history).
    landed_a: StdAtomicU64,
    landed_b: StdAtomicU64,
}

/// vCPU A faults on the write-protected page, fixes it on the fast path (cmpxchg, then mark, as
/// `fast_pf_fix_direct_spte()` does), and writes. vCPU B writes through whatever the entry
/// allows at that moment (a TLB fill and write, no fault of its own). The VMM runs
/// `KVM_GET_DIRTY_LOG`: take the bitmap word, then write-protect its pages
/// (`clear_dirty_pt_masked()`), with `b_before` telling whether B's write had landed when the
/// harvest took the word.
fn race(world: &Arc<World>) -> (bool, bool) {
    let a = {
        let w = world.clone();
        shuttle::thread::spawn(move || {
            fast_page_fault(&w.spte, || {
                w.bitmap.fetch_or(1, Ordering::SeqCst);
            });
            let cur = w.spte.load();
            if hw_set_accessed_dirty(&w.spte, cur, true).is_some() {
                w.landed_a.store(1, Ordering::SeqCst);
            }
        })
    };
    let b = {
        let w = world.clone();
        shuttle::thread::spawn(move || {
            let cur = w.spte.load();
            if hw_set_accessed_dirty(&w.spte, cur, true).is_some() {
                w.landed_b.store(1, Ordering::SeqCst);
            }
        })
    };
    let b_before = world.landed_b.load(Ordering::SeqCst) != 0;
    let reported = world.bitmap.swap(0, Ordering::SeqCst) & 1 != 0;
    let _ = wrprot_spte_atomic(&world.spte, PG_LEVEL_4K);
    a.join().unwrap();
    b.join().unwrap();
    (reported, b_before)
}

fn new_world() -> Arc<World> {
    Arc::new(World {
        spte: ModelSpte(AtomicU64::new(write_protected_leaf())),
        bitmap: AtomicU64::new(0),
        landed_a: StdAtomicU64::new(0),
        landed_b: StdAtomicU64::new(0),
    })
}

#[test]
fn fast_page_fault_vs_get_dirty_log_never_loses_a_write() {
    check_three_threads(|| {
        let w = new_world();
        let (reported, _) = race(&w);
        let final_spte = w.spte.load();
        let pending = w.bitmap.load(Ordering::SeqCst) & 1 != 0;
        // writable => tracked: the next harvest will re-protect it.
        if is_writable_pte(final_spte) {
            assert!(pending, "writable entry without a pending dirty bit");
        }
        // Every write that landed is in this harvest or pending for the next.
        if w.landed_a.load(Ordering::SeqCst) + w.landed_b.load(Ordering::SeqCst) != 0 {
            assert!(
                reported || pending,
                "a write landed but is neither reported nor pending"
            );
        }
        check_spte_writable_invariants(final_spte).unwrap();
        assert!(
            is_mmu_writable_spte(final_spte),
            "dirty-log write protection keeps MMU-writable"
        );
    });
}

/// KVM's ordering (cmpxchg, then mark) lets B's write land before the harvest takes the word
/// while A's mark is still to come: the strict property "a write that landed before the
/// harvest began is in it" fails for KVM itself, which is why the stress test's oracle allows
/// one harvest of lateness. The model checker must find that schedule.
#[test]
fn a_write_racing_a_fast_path_fix_can_be_reported_one_harvest_late() {
    let strict = std::panic::catch_unwind(|| {
        check_three_threads(|| {
            let w = new_world();
            let (reported, b_before) = race(&w);
            if b_before {
                assert!(reported, "landed before the harvest, missing from it");
            }
        })
    });
    assert!(
        strict.is_err(),
        "the model checker must find the late-report schedule"
    );
}

/// The negative control: a harvest that write-protects *before* taking the bitmap word lets a
/// fast-path fix slip in between, leaving a writable entry whose dirty bit the harvest then
/// takes away. The model checker must find that schedule.
#[test]
fn reprotecting_before_taking_the_bitmap_word_is_caught() {
    let broken = std::panic::catch_unwind(|| {
        check_all(|| {
            let spte = Arc::new(ModelSpte(AtomicU64::new(write_protected_leaf())));
            let bitmap = Arc::new(AtomicU64::new(0));
            let vcpu = {
                let (spte, bitmap) = (spte.clone(), bitmap.clone());
                shuttle::thread::spawn(move || {
                    fast_page_fault(&spte, || {
                        bitmap.fetch_or(1, Ordering::SeqCst);
                    });
                })
            };
            let _ = wrprot_spte_atomic(&*spte, PG_LEVEL_4K);
            let _reported = bitmap.swap(0, Ordering::SeqCst);
            vcpu.join().unwrap();
            if is_writable_pte(spte.load()) {
                assert!(
                    bitmap.load(Ordering::SeqCst) & 1 != 0,
                    "writable but untracked"
                );
            }
        })
    });
    assert!(
        broken.is_err(),
        "the model checker must find the lost-dirty-bit schedule"
    );
}

/// Two vCPUs fault on the same entry at once: exactly one restores W (and marks the page
/// dirty), the other sees a spurious fault or loses the cmpxchg and re-reads.
#[test]
fn concurrent_fast_page_faults_fix_once() {
    check_all(|| {
        let spte = Arc::new(ModelSpte(AtomicU64::new(write_protected_leaf())));
        // Observers, not part of the protocol (see World).
        let marks = Arc::new(StdAtomicU64::new(0));
        let fixes = Arc::new(StdAtomicU64::new(0));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (spte, marks, fixes) = (spte.clone(), marks.clone(), fixes.clone());
                shuttle::thread::spawn(move || {
                    let outcome = fast_page_fault(&spte, || {
                        marks.fetch_add(1, Ordering::SeqCst);
                    });
                    assert!(
                        matches!(outcome, RetPf::Fixed | RetPf::Spurious),
                        "{outcome:?}"
                    );
                    if outcome == RetPf::Fixed {
                        fixes.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(fixes.load(Ordering::SeqCst), 1);
        assert_eq!(
            marks.load(Ordering::SeqCst),
            1,
            "marked dirty by the fix only"
        );
        assert!(is_writable_pte(spte.load()));
    });
}
