//! What the shuttle models share: a page-table entry on shuttle's atomics, so the MMUs' own
//! single-entry protocol functions (generic over `SpteCell`) run under the model checker.

// Each model uses a part of this module.
#![allow(dead_code)]

use shuttle::sync::atomic::{AtomicU64, Ordering};
use std::panic::{catch_unwind, AssertUnwindSafe};
use vmmu::hw::pgtable::SpteCell;

/// One entry whose every access is a scheduling point for shuttle.
pub struct ModelSpte(pub AtomicU64);

impl ModelSpte {
    /// An entry holding `v`.
    pub fn new(v: u64) -> Self {
        ModelSpte(AtomicU64::new(v))
    }
}

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
    fn fetch_and(&self, mask: u64) -> u64 {
        self.0.fetch_and(mask, Ordering::SeqCst)
    }
}

/// One walker's RCU read side: a counter bumped by `rcu_read_lock()` and by
/// `rcu_read_unlock()`, odd while inside a read-side critical section. Its SeqCst RMWs stand for
/// the full barriers a grace period implies: the pattern is store buffering (the reader writes
/// the counter, then reads the parent entry; the updater writes the parent entry, then reads the
/// counter), so one of the two must see the other's write.
pub struct RcuReader(pub AtomicU64);

impl RcuReader {
    pub fn read_lock(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    pub fn read_unlock(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    /// `synchronize_rcu()` for this reader: spins until the read-side critical section it is
    /// in, if any, has ended. A section it enters later reads the parent entry after the
    /// unlink (pairs with `read_lock()`), so cannot reach the unlinked table.
    pub fn synchronize(&self) {
        let snapshot = self.0.load(Ordering::SeqCst);
        if snapshot.is_multiple_of(2) {
            return;
        }
        while self.0.load(Ordering::SeqCst) == snapshot {
            shuttle::thread::yield_now();
        }
    }
}

/// Runs a model that must fail, and checks that it failed with one of `expected` in its message:
/// the model checker found a schedule breaking that property (and not some other panic).
pub fn assert_model_finds(expected: &[&str], model: impl FnOnce()) {
    let err = catch_unwind(AssertUnwindSafe(model))
        .expect_err("the model checker must find a schedule that breaks the property");
    // shuttle keeps a `&str` payload as it is and prefixes a `String` one with the schedule.
    let msg = err
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| err.downcast_ref::<&str>().copied())
        .unwrap_or("");
    assert!(
        expected.iter().any(|e| msg.contains(e)),
        "expected a violation of one of {expected:?}, the model failed with {msg:?}"
    );
}
