//! What the shuttle models share: a page-table entry on shuttle's atomics, so the MMUs' own
//! single-entry protocol functions (generic over `SpteCell`) run under the model checker.

// Each model uses a part of this module.
#![allow(dead_code)]

use shuttle::sync::atomic::{AtomicU64, Ordering};
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
}
