//! Model-checked races on one SPTE, using the very protocol functions the TDP MMU runs. Every
//! interleaving of the threads' atomic operations is explored (shuttle's exhaustive DFS
//! scheduler; the properties are about interleavings, not weak-memory reordering: every
//! operation involved is a SeqCst RMW or an acquire/release pair).
//!
//! - a vCPU's `fast_page_fault()` restoring W with cmpxchg and then marking the page dirty,
//!   followed by the hardware write (which sets D only on a writable entry);
//! - the VMM's `KVM_GET_DIRTY_LOG` (xchg the bitmap word, then clear W with cmpxchg), as
//!   `kvm_get_dirty_log_protect()` and `wrprot_gfn_range()` do.
//!
//! Property (what the completeness oracle relies on): in every interleaving, a guest write
//! that landed is either in the harvest or still marked dirty for the next one, and an entry
//! left writable always has its dirty bit set (writable ⇒ tracked).

use shuttle::sync::atomic::{AtomicU64, Ordering};
use shuttle::sync::Arc;
use vmmu::hw::spte::*;
use vmmu::units::{Pfn, PG_LEVEL_4K};

struct ModelSpte(AtomicU64);

impl SpteCell for ModelSpte {
    fn load(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
    fn store(&self, v: u64) {
        self.0.store(v, Ordering::Release)
    }
    fn cmpxchg(&self, old: u64, new: u64) -> Result<u64, u64> {
        self.0
            .compare_exchange(old, new, Ordering::SeqCst, Ordering::Acquire)
    }
    fn xchg(&self, v: u64) -> u64 {
        self.0.swap(v, Ordering::SeqCst)
    }
}

fn write_protected_leaf() -> u64 {
    make_spte(PG_LEVEL_4K, Pfn(42), true, false) & !(PT_WRITABLE_MASK | SHADOW_DIRTY_MASK)
}

/// Explores every schedule (bounded only by the programs' own length).
fn check_all(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_dfs(f, None);
}

#[test]
fn fast_page_fault_vs_get_dirty_log_never_loses_a_write() {
    check_all(|| {
        let spte = Arc::new(ModelSpte(AtomicU64::new(write_protected_leaf())));
        // One word of the memslot's dirty bitmap; the page is bit 0.
        let bitmap = Arc::new(AtomicU64::new(0));
        let landed = Arc::new(AtomicU64::new(0));

        let vcpu = {
            let (spte, bitmap, landed) = (spte.clone(), bitmap.clone(), landed.clone());
            shuttle::thread::spawn(move || {
                // EPT violation on a write-protected entry: the fast path.
                let (outcome, _) = fast_page_fault_spte(&*spte, true, false);
                if outcome == FastPfOutcome::FixedWrite {
                    // fast_pf_fix_direct_spte(): mark_page_dirty_in_slot() after the cmpxchg.
                    bitmap.fetch_or(1, Ordering::SeqCst);
                }
                // The vCPU retries the access: the hardware walk succeeds only on a writable
                // entry, and sets D as it writes.
                let cur = spte.load();
                if hw_set_accessed_dirty(&*spte, cur, true).is_some() {
                    landed.store(1, Ordering::SeqCst);
                }
            })
        };

        // KVM_GET_DIRTY_LOG without manual protect: take the word, then re-protect its pages.
        let reported = bitmap.swap(0, Ordering::SeqCst) & 1 != 0;
        let (cleared, _) = wrprot_spte_atomic(&*spte, PG_LEVEL_4K);
        vcpu.join().unwrap();

        let final_spte = spte.load();
        let pending = bitmap.load(Ordering::SeqCst) & 1 != 0;
        if landed.load(Ordering::SeqCst) != 0 {
            assert!(
                reported || pending,
                "a write landed but is neither reported nor pending"
            );
        }
        if is_writable_pte(final_spte) {
            assert!(pending, "writable entry without a pending dirty bit");
        }
        check_spte_writable_invariants(final_spte).unwrap();
        if cleared.is_some() {
            assert!(
                is_mmu_writable_spte(final_spte),
                "dirty-log write protection keeps MMU-writable"
            );
        }
    });
}

/// The negative control: a harvest that re-protects *before* taking the bitmap word lets a
/// fast-path fix slip in between, leaving a writable entry whose dirty bit the harvest then
/// takes away. The model checker must find that interleaving.
#[test]
fn reprotecting_before_taking_the_bitmap_word_is_caught() {
    let broken = std::panic::catch_unwind(|| {
        check_all(|| {
            let spte = Arc::new(ModelSpte(AtomicU64::new(write_protected_leaf())));
            let bitmap = Arc::new(AtomicU64::new(0));
            let vcpu = {
                let (spte, bitmap) = (spte.clone(), bitmap.clone());
                shuttle::thread::spawn(move || {
                    if fast_page_fault_spte(&*spte, true, false).0 == FastPfOutcome::FixedWrite {
                        bitmap.fetch_or(1, Ordering::SeqCst);
                    }
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
        "the model checker must find the lost-dirty-bit interleaving"
    );
}

/// Two vCPUs fault on the same entry at once: exactly one restores W, the other sees a
/// spurious fault or loses the cmpxchg and re-reads; the page is marked dirty exactly once.
#[test]
fn concurrent_fast_page_faults_fix_once() {
    check_all(|| {
        let spte = Arc::new(ModelSpte(AtomicU64::new(write_protected_leaf())));
        let fixes = Arc::new(AtomicU64::new(0));
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (spte, fixes) = (spte.clone(), fixes.clone());
                shuttle::thread::spawn(move || {
                    let (outcome, _) = fast_page_fault_spte(&*spte, true, false);
                    assert_ne!(outcome, FastPfOutcome::NeedSlowPath);
                    if outcome == FastPfOutcome::FixedWrite {
                        fixes.fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(fixes.load(Ordering::SeqCst), 1);
        assert!(is_writable_pte(spte.load()));
    });
}
