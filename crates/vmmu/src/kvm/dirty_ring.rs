//! The per-vCPU dirty ring (`KVM_CAP_DIRTY_LOG_RING`, `virt/kvm/dirty_ring.c`): dirtied pages
//! are pushed as `{slot, offset}` entries; userspace harvests them (flagging each entry RESET),
//! and `KVM_RESET_DIRTY_RINGS` re-protects the harvested pages.

use parking_lot::Mutex;
use std::collections::VecDeque;

/// `KVM_DIRTY_RING_RSVD_ENTRIES`: entries kept free so a vCPU can finish what it is doing after
/// the soft limit is reached.
pub const KVM_DIRTY_RING_RSVD_ENTRIES: u32 = 64;

#[derive(Default)]
struct RingState {
    /// Pushed and not yet reset, oldest first: (slot, offset, harvested).
    entries: VecDeque<(u32, u64, bool)>,
}

/// One vCPU's ring.
pub struct DirtyRing {
    size: u32,
    state: Mutex<RingState>,
}

impl DirtyRing {
    /// A ring of `size` entries (a power of two, checked by the caller).
    pub fn new(size: u32) -> Self {
        DirtyRing {
            size,
            state: Mutex::new(RingState::default()),
        }
    }

    /// `kvm_dirty_ring_get_rsvd_entries()`-based soft limit.
    pub fn soft_limit(&self) -> u32 {
        self.size.saturating_sub(KVM_DIRTY_RING_RSVD_ENTRIES)
    }

    /// `kvm_dirty_ring_push()`.
    pub fn push(&self, slot: u32, offset: u64) {
        self.state.lock().entries.push_back((slot, offset, false));
    }

    /// `kvm_dirty_ring_soft_full()`: the vCPU must exit with `KVM_EXIT_DIRTY_RING_FULL`.
    pub fn soft_full(&self) -> bool {
        self.state.lock().entries.len() as u32 >= self.soft_limit()
    }

    /// Userspace's harvest: every entry not yet harvested, oldest first, now flagged RESET.
    pub fn harvest(&self) -> Vec<(u32, u64)> {
        let mut st = self.state.lock();
        st.entries
            .iter_mut()
            .filter(|e| !e.2)
            .map(|e| {
                e.2 = true;
                (e.0, e.1)
            })
            .collect()
    }

    /// The reset half of `kvm_dirty_ring_reset()`: removes the harvested prefix of the ring and
    /// returns it for re-protection (a ring resets only up to the first unharvested entry).
    pub fn take_harvested(&self) -> Vec<(u32, u64)> {
        let mut st = self.state.lock();
        let n = st.entries.iter().take_while(|e| e.2).count();
        st.entries.drain(..n).map(|e| (e.0, e.1)).collect()
    }
}

/// Coalesces ring entries into `(slot, first offset, 64-page mask)` runs the way
/// `kvm_dirty_ring_reset()` does: consecutive entries of one slot within 64 pages of the current
/// run's base join it; anything else flushes the run.
pub fn coalesce_ring_entries(entries: &[(u32, u64)]) -> Vec<(u32, u64, u64)> {
    let mut out = Vec::new();
    let mut cur: Option<(u32, u64, u64)> = None;
    for &(slot, off) in entries {
        if let Some((s, base, mask)) = cur.as_mut() {
            if *s == slot && off >= *base && off - *base < 64 {
                *mask |= 1 << (off - *base);
                continue;
            }
            if *s == slot
                && off < *base
                && *base - off < 64
                && (*mask << (*base - off)) >> (*base - off) == *mask
            {
                *mask = (*mask << (*base - off)) | 1;
                *base = off;
                continue;
            }
        }
        if let Some(run) = cur.take() {
            out.push(run);
        }
        cur = Some((slot, off, 1));
    }
    out.extend(cur);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn harvest_then_reset_takes_only_harvested_entries() {
        let r = DirtyRing::new(4096);
        r.push(1, 5);
        r.push(1, 6);
        assert_eq!(r.harvest(), vec![(1, 5), (1, 6)]);
        r.push(1, 7);
        assert_eq!(r.take_harvested(), vec![(1, 5), (1, 6)]);
        assert_eq!(r.harvest(), vec![(1, 7)]);
        assert!(!r.soft_full());
        assert_eq!(r.soft_limit(), 4096 - 64);
    }

    #[test]
    fn entries_coalesce_into_64_page_masks() {
        let runs = coalesce_ring_entries(&[(0, 10), (0, 12), (0, 73), (0, 74), (1, 74), (0, 9)]);
        assert_eq!(
            runs,
            vec![(0, 10, 0b101 | 1 << 63), (0, 74, 1), (1, 74, 1), (0, 9, 1)]
        );
        assert_eq!(
            coalesce_ring_entries(&[(0, 10), (0, 9)]),
            vec![(0, 9, 0b11)]
        );
    }
}
