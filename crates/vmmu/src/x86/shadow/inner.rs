//! The part of the shadow MMU every actor shares: the state `mmu_lock` protects, the root the
//! hardware and lockless walkers read, and the counters read without the lock.

use crate::hw::page_table::{PageTable, PageTableStats};
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{Held, Write};
use crate::units::*;
use crate::x86::shadow::caches::SplitCaches;
use crate::x86::shadow::state::{PageStats, ShadowState};
use crate::x86::spte::*;
use crossbeam_epoch::Guard;
use parking_lot::{Mutex, MutexGuard};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The root level: 4-level EPT and 4-level guest paging.
pub const SHADOW_ROOT_LEVEL: Level = PT64_ROOT_4LEVEL;

/// The shared part of the shadow MMU.
pub struct ShadowInner {
    pub(super) state: Mutex<ShadowState>,
    /// The root table's address for lockless walkers (0: no root yet).
    pub(super) root_table: AtomicU64,
    /// `tdp_enabled`: EPT on, direct mode.
    pub tdp_enabled: bool,
    /// Leaves per level, shared with [`ShadowState::pages`] so they can be read without the
    /// lock.
    pub pages: Arc<PageStats>,
    /// The split caches.
    pub split_caches: Mutex<SplitCaches>,
    /// Eager splits refused because at most `KVM_MIN_FREE_MMU_PAGES` pages were free.
    pub split_refused_enospc: AtomicU64,
    /// Shadow paging: the guest's CR3 (`u64::MAX` until the guest loads one).
    pub(super) guest_cr3: AtomicU64,
    pub(super) tables: Arc<PageTableStats>,
}

impl ShadowInner {
    /// The state `mmu_lock` protects, under its write lock: the state is borrowed no longer than
    /// the hold.
    pub fn lock_state<'h>(&'h self, _held: Held<'h, Write>) -> MutexGuard<'h, ShadowState> {
        self.state
            .try_lock()
            .expect("mmu_lock is held for write, so nobody else holds the shadow MMU state")
    }

    /// The state, for a caller that knows no other actor runs (invariant checks, teardown).
    pub(super) fn lock_state_quiescent(&self) -> MutexGuard<'_, ShadowState> {
        self.state.lock()
    }

    pub(super) fn publish_root(&self, st: &ShadowState) {
        let addr = st.root.map_or(0, |r| st.sp(r).spt as u64);
        // Release pairs with the Acquire in root(): a walker that sees the new root sees its
        // initialised entries.
        self.root_table.store(addr, Ordering::Release);
    }

    /// The root table under `guard`.
    pub(super) fn root<'g>(&self, _guard: &'g Guard) -> Option<&'g PageTable> {
        let addr = self.root_table.load(Ordering::Acquire);
        // SAFETY: a published root is a live table; a root replaced later is freed through RCU
        // after it is unpublished, so it outlives `_guard`.
        (addr != 0).then(|| unsafe { &*(addr as *const PageTable) })
    }
}

impl crate::x86::fast_page_fault::LastSptepWalk for ShadowInner {
    fn get_last_sptep<'g>(
        &'g self,
        gfn: Gfn,
        guard: &'g Guard,
        meter: &mut Meter,
    ) -> Option<(&'g AtomicU64, u64, Level)> {
        let root = self.root(guard)?;
        // SAFETY: the root is live under `guard` (see ShadowInner::root).
        Some(unsafe {
            crate::x86::fast_page_fault::walk_shadow_page_lockless(
                root,
                SHADOW_ROOT_LEVEL,
                gfn,
                guard,
                meter,
            )
        })
    }
}

impl Drop for ShadowInner {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        st.teardown();
        self.split_caches.get_mut().free_all(&self.tables);
    }
}
