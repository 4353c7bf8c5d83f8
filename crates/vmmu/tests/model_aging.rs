//! Model-checked lockless aging (seed 003, Linux 6.15's x86 TDP MMU): the host's aging clears
//! a leaf's Accessed bit under RCU alone, with the MMU's own `clear_accessed_spte_atomic()`,
//! while a vCPU's fault under the read lock relaxes the same leaf with cmpxchg and a zap under
//! the read lock unlinks its table (`tdp_mmu_zap_spte_atomic()`: freeze the parent, then
//! `handle_removed_pt()` freezes each child entry) and frees it after a grace period. The
//! schedules of the three threads' atomic operations are sampled by shuttle's PCT scheduler.
//!
//! Properties, in every schedule: nobody touches the table after it was freed; a frozen entry
//! stays frozen until its owner is done with it (so no fault can install a leaf into a table
//! being torn down); and a permission the fault granted is never lost to the aging (the zap
//! sees it, or the final entry has it).
//!
//! Negative controls: the frozen value Linux used before lockless aging (`0x5a0`, which has the
//! EPT Accessed bit set, so an atomic AND turns it into a value nobody recognises as frozen);
//! and aging that rewrites the entry with a plain store of what it read without A
//! (`WRITE_ONCE(old & ~A)`), which loses the fault's change.

mod model_common;

use model_common::{assert_model_finds, ModelSpte, RcuReader};
use shuttle::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use shuttle::sync::Arc;
use shuttle::thread;
use vmmu::hw::pgtable::SpteCell;
use vmmu::units::Pfn;
use vmmu::x86::spte::*;

/// The parent entry's value while it links the table (any value that is present and not a
/// leaf does: only equality matters to the model).
const TABLE: u64 = 0x8000_1000 | SPTE_MMU_PRESENT_MASK | VMX_EPT_RWX_MASK;

/// How the modelled aging clears the Accessed bit.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Clear {
    /// The MMU's `clear_accessed_spte_atomic()` (an atomic AND).
    Atomic,
    /// Broken: `WRITE_ONCE(*sptep, old & ~A)` of the value the walk read.
    PlainStore,
}

struct Vm {
    parent: ModelSpte,
    leaf: ModelSpte,
    freed: AtomicBool,
    /// The value the zapper freezes entries with.
    frozen: u64,
    ager_rcu: RcuReader,
    fault_rcu: RcuReader,
    /// The fault's cmpxchg granted W.
    relaxed: AtomicBool,
    /// What the zapper's freeze of the leaf took out (0: no zap yet).
    zapped_leaf: AtomicU64,
}

impl Vm {
    fn new(frozen: u64) -> Arc<Self> {
        // A young, read-only 4K leaf.
        let leaf = make_spte(PG_LEVEL_4K, Pfn(42), true, false)
            & !(PT_WRITABLE_MASK | SHADOW_DIRTY_MASK)
            | SHADOW_ACCESSED_MASK;
        Arc::new(Vm {
            parent: ModelSpte::new(TABLE),
            leaf: ModelSpte::new(leaf),
            freed: AtomicBool::new(false),
            frozen,
            ager_rcu: RcuReader(AtomicU64::new(0)),
            fault_rcu: RcuReader(AtomicU64::new(0)),
            relaxed: AtomicBool::new(false),
            zapped_leaf: AtomicU64::new(0),
        })
    }

    /// An access to the child table, checked against its free (see `model_stage2.rs`).
    fn access<R>(&self, f: impl FnOnce(&ModelSpte) -> R) -> R {
        let r = f(&self.leaf);
        assert!(
            !self.freed.load(Ordering::SeqCst),
            "use after free: a lockless walker touched the freed table"
        );
        r
    }

    /// `kvm_tdp_mmu_age_gfn_range()` without `mmu_lock`: under RCU, read the parent, walk to
    /// the leaf and clear its Accessed bit if set.
    fn age(&self, clear: Clear) {
        self.ager_rcu.read_lock();
        if self.parent.load() == TABLE {
            let old = self.access(|l| l.load());
            if is_shadow_present_pte(old) && is_last_spte(old, PG_LEVEL_4K) && is_accessed_spte(old)
            {
                self.access(|l| match clear {
                    Clear::Atomic => {
                        clear_accessed_spte_atomic(l);
                    }
                    Clear::PlainStore => l.store(old & !SHADOW_ACCESSED_MASK),
                });
            }
        }
        self.ager_rcu.read_unlock();
    }

    /// A vCPU's fault under the read lock (RCU): relax the present leaf to writable with
    /// cmpxchg (`tdp_mmu_set_spte_atomic()`), backing off from a frozen entry.
    fn fault(&self) {
        self.fault_rcu.read_lock();
        if self.parent.load() == TABLE {
            let old = self.access(|l| l.load());
            if old != self.frozen && is_shadow_present_pte(old) {
                let new = old | PT_WRITABLE_MASK;
                if self.access(|l| l.cmpxchg(old, new)).is_ok() {
                    self.relaxed.store(true, Ordering::SeqCst);
                }
            } else if old != self.frozen {
                // A non-present entry that is not frozen: the fault would install a leaf.
                // Into a table being torn down, that is the bug the frozen value prevents.
                assert!(
                    self.zapped_leaf.load(Ordering::SeqCst) == 0,
                    "a fault found a corrupted frozen entry and could install a leaf into a table being freed"
                );
            }
        }
        self.fault_rcu.read_unlock();
    }

    /// `tdp_mmu_zap_spte_atomic()` on the parent under the read lock: freeze it, freeze the
    /// leaf (`handle_removed_pt()`), free the table after a grace period, clear the parent.
    fn zap(&self) {
        if self.parent.cmpxchg(TABLE, self.frozen).is_err() {
            return;
        }
        let old = self.leaf.xchg(self.frozen);
        self.zapped_leaf.store(old, Ordering::SeqCst);
        // call_rcu(): the table is freed once every reader that might see it has left.
        self.ager_rcu.synchronize();
        self.fault_rcu.synchronize();
        assert_eq!(
            self.leaf.load(),
            self.frozen,
            "a frozen entry changed under its owner (lockless aging wrote it)"
        );
        self.freed.store(true, Ordering::SeqCst);
        self.parent.store(SHADOW_NONPRESENT_VALUE);
    }
}

fn aging_vs_fault_vs_zap(frozen: u64, clear: Clear) {
    let vm = Vm::new(frozen);
    let ager = {
        let vm = Arc::clone(&vm);
        thread::spawn(move || vm.age(clear))
    };
    let fault = {
        let vm = Arc::clone(&vm);
        thread::spawn(move || vm.fault())
    };
    vm.zap();
    ager.join().unwrap();
    fault.join().unwrap();
    // The fault's W is never lost: either the zap took it out of the entry, or (had the zap
    // come first) the fault never got it.
    if vm.relaxed.load(Ordering::SeqCst) {
        let zapped = vm.zapped_leaf.load(Ordering::SeqCst);
        assert!(
            zapped & PT_WRITABLE_MASK != 0,
            "lost update: the fault made the leaf writable and the aging wrote it back read-only ({zapped:#x})"
        );
    }
}

/// The model explores schedules of three threads with PCT (see `model_fast_pf.rs`).
fn check(f: impl Fn() + Send + Sync + 'static) {
    shuttle::check_pct(f, 20_000, 3);
}

#[test]
fn lockless_aging_never_touches_freed_tables_frozen_entries_or_other_changes() {
    check(|| aging_vs_fault_vs_zap(FROZEN_SPTE, Clear::Atomic));
}

/// Negative control: the frozen value before lockless aging had the EPT Accessed bit.
#[test]
fn a_frozen_value_with_the_accessed_bit_is_caught() {
    const OLD_FROZEN_SPTE: u64 = SHADOW_NONPRESENT_VALUE | 0x5a0;
    const { assert!(OLD_FROZEN_SPTE & SHADOW_ACCESSED_MASK != 0) };
    assert_model_finds(&["frozen"], || {
        check(|| aging_vs_fault_vs_zap(OLD_FROZEN_SPTE, Clear::Atomic))
    });
}

/// Negative control: aging that writes back what it read loses the fault's change, or brings
/// back a leaf the zap froze.
#[test]
fn aging_with_a_plain_store_is_caught() {
    assert_model_finds(&["lost update", "frozen entry changed"], || {
        check(|| aging_vs_fault_vs_zap(FROZEN_SPTE, Clear::PlainStore))
    });
}
