//! Unsync bookkeeping: a last-level indirect page the guest may write without KVM knowing
//! (`kvm_unsync_page()`), and the `unsync_child_bitmap`s that lead to it from the root
//! (`mark_unsync()`, `mmu_unsync_walk()`).

use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::*;

/// What `kvm_sync_page()` returns for a page, and `FNAME(sync_spte)` for one of its entries
/// (an `int` in KVM).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SyncPageResult {
    /// `0`: the shadow entries match the guest table; no flush is needed.
    NoFlush,
    /// `1` (`> 0`): shadow entries were dropped or narrowed; a TLB flush is needed.
    Flush,
    /// `-1` (`< 0`): the guest table could not be read; `kvm_sync_page()` zapped the page onto
    /// the invalid list.
    Zap,
}

impl SyncPageResult {
    /// `Flush` if `flush`, else `NoFlush` (KVM's `return flush;` of a bool as an int).
    pub fn from_flush(flush: bool) -> Self {
        if flush {
            SyncPageResult::Flush
        } else {
            SyncPageResult::NoFlush
        }
    }
}

impl ShadowState {
    /// `mark_unsync()`: records, up the tree, that the entry `sptep` leads to unsync pages.
    pub fn mark_unsync(&mut self, sptep: SptepRef) {
        let SptepRef { sp: id, index } = sptep;
        let sp = self.sp_mut(id);
        let (w, b) = (index / 64, 1u64 << (index % 64));
        if sp.unsync_child_bitmap[w] & b != 0 {
            return;
        }
        sp.unsync_child_bitmap[w] |= b;
        sp.unsync_children += 1;
        if sp.unsync_children > 1 {
            return;
        }
        self.mark_parents_unsync(id);
    }

    /// `kvm_mmu_mark_parents_unsync()`.
    pub fn mark_parents_unsync(&mut self, id: SpId) {
        let parents: Vec<SptepRef> = self.sp(id).parent_ptes.iter().collect();
        for p in parents {
            self.mark_unsync(p);
        }
    }

    /// `kvm_unsync_page()`: the guest may now write the table `id` shadows without KVM
    /// knowing; its parents record the way down to it.
    pub fn unsync_page(&mut self, id: SpId) {
        debug_assert_eq!(
            self.sp(id).role.level(),
            PG_LEVEL_4K,
            "only last-level pages go unsync"
        );
        self.sp_mut(id).unsync = true;
        self.mmu_unsync += 1;
        self.mark_parents_unsync(id);
    }

    /// `kvm_unlink_unsync_page()`.
    pub fn unlink_unsync_page(&mut self, id: SpId) {
        let sp = self.sp_mut(id);
        debug_assert!(sp.unsync);
        sp.unsync = false;
        self.mmu_unsync -= 1;
    }

    /// `clear_unsync_child_bit()`: entry `index` of `id` no longer leads to unsync pages.
    pub fn clear_unsync_child_bit(&mut self, id: SpId, index: usize) {
        let sp = self.sp_mut(id);
        let (w, b) = (index / 64, 1u64 << (index % 64));
        if sp.unsync_child_bitmap[w] & b != 0 {
            sp.unsync_child_bitmap[w] &= !b;
            sp.unsync_children -= 1;
        }
    }

    /// The unsync last-level pages reachable from `id` through set unsync-child bits
    /// (`mmu_unsync_walk()`), clearing bits that lead nowhere.
    pub fn unsync_descendants(&mut self, id: SpId) -> Vec<SpId> {
        let mut out = Vec::new();
        let mut stack = vec![id];
        while let Some(p) = stack.pop() {
            if self.sp(p).unsync_children == 0 {
                continue;
            }
            for w in 0..SPTE_ENT_PER_PAGE / 64 {
                let mut bits = self.sp(p).unsync_child_bitmap[w];
                while bits != 0 {
                    let index = w * 64 + bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let spte = SpteCell::load(self.sptep(SptepRef::new(p, index)));
                    if !is_shadow_present_pte(spte) || is_last_spte(spte, self.sp(p).role.level()) {
                        self.clear_unsync_child_bit(p, index);
                        continue;
                    }
                    let child = self.spte_to_child_sp(spte);
                    let c = self.sp(child);
                    if c.unsync_children > 0 {
                        stack.push(child);
                    } else if c.unsync {
                        out.push(child);
                    } else {
                        self.clear_unsync_child_bit(p, index);
                    }
                }
            }
        }
        out
    }
}
