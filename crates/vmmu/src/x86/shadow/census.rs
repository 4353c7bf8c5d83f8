//! Stale-page accounting: which shadow pages a vCPU can still reach and which are orphans
//! (valid pages no root leads to, kept only by the page hash, the active list and the rmaps),
//! and how long the structures they clutter have grown. KVM keeps no such census; its effect
//! is what seed 004 measured (longer hash chains and rmaps, slower memslot deletion).

use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::pte_list_count;
use crate::x86::shadow::state::*;
use crate::x86::spte::*;
use std::collections::HashSet;

/// A census of the shadow pages (see the module documentation).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PageCensus {
    /// `n_used_mmu_pages`: pages counted against the quota.
    pub used: u64,
    /// The quota (`n_max_mmu_pages`).
    pub quota: u64,
    /// Valid pages a root (any vCPU's, current or cached, or L1's) leads to.
    pub reachable: u64,
    /// Valid pages no root leads to: orphans and the subtrees below them.
    pub stale: u64,
    /// Of those, the pages with no parent at all (the heads of the stale subtrees).
    pub orphans: u64,
    /// Stale pages by level, 4K first.
    pub stale_by_level: [u64; 4],
    /// Stale pages that are unsync.
    pub stale_unsync: u64,
    /// Pages of nested guests (`role.guest_mode`), valid.
    pub nested: u64,
    /// The longest page-hash bucket.
    pub max_hash_chain: u64,
    /// The longest rmap of any gfn at any level, now.
    pub max_rmap: u64,
    /// gfns write-tracked (upper-level guest tables shadowed).
    pub write_tracked: u64,
    /// `kvm->stat.mmu_shadow_zapped`.
    pub zapped: u64,
    /// `kvm->stat.mmu_recycled`: pages zapped by the quota.
    pub recycled: u64,
    /// `kvm->stat.mmu_flooded`: pages zapped by write flooding.
    pub flooded: u64,
}

impl ShadowState {
    /// The valid pages a root leads to: the roots with references (every vCPU's current and
    /// cached ones, L1's) and everything below them.
    pub fn reachable_sps(&self) -> HashSet<SpId> {
        let mut reachable: HashSet<SpId> = HashSet::new();
        let mut stack: Vec<SpId> = self
            .live_sps()
            .filter(|(_, sp)| sp.root_count > 0 && !self.is_obsolete_sp(sp))
            .map(|(id, _)| id)
            .collect();
        while let Some(id) = stack.pop() {
            if !reachable.insert(id) {
                continue;
            }
            let sp = self.sp(id);
            if sp.role.level() == PG_LEVEL_4K {
                continue;
            }
            for e in sp.spt().spt.iter() {
                let spte = SpteCell::load(e);
                if is_shadow_present_pte(spte) && !is_last_spte(spte, sp.role.level()) {
                    stack.push(self.spte_to_child_sp(spte));
                }
            }
        }
        reachable
    }

    /// Counts the pages (see [`PageCensus`]). Reads everything; for reports, not hot paths.
    pub fn census(&self) -> PageCensus {
        let valid = |sp: &KvmMmuPage| !self.is_obsolete_sp(sp);
        let reachable = self.reachable_sps();
        let mut c = PageCensus {
            used: self.n_used_mmu_pages,
            quota: self.n_max_mmu_pages,
            write_tracked: self.gfn_write_track.len() as u64,
            zapped: self.mmu_shadow_zapped,
            recycled: self.mmu_recycled,
            flooded: self.mmu_flooded,
            ..Default::default()
        };
        for (id, sp) in self.live_sps() {
            if !valid(sp) {
                continue;
            }
            c.nested += sp.role.guest_mode() as u64;
            if reachable.contains(&id) {
                c.reachable += 1;
                continue;
            }
            c.stale += 1;
            c.orphans += sp.parent_ptes.is_empty() as u64;
            c.stale_by_level[sp.role.level().0 as usize - 1] += 1;
            c.stale_unsync += sp.unsync as u64;
        }
        c.max_hash_chain = self
            .mmu_page_hash
            .iter()
            .map(|b| b.len())
            .max()
            .unwrap_or(0) as u64;
        c.max_rmap = self
            .rmaps
            .values()
            .flat_map(|r| r.rmap.iter().flatten())
            .filter(|h| !h.is_empty())
            .map(|h| pte_list_count(h) as u64)
            .max()
            .unwrap_or(0);
        c
    }
}
