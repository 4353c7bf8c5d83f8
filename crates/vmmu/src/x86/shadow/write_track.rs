//! Write tracking of guest page tables (`account_shadowed()` / `unaccount_shadowed()`): the gfns
//! of upper-level guest tables stay read-only (`gfn_write_track`), and a shadowed last-level
//! table forbids huge mappings over it (`lpage_info.disallow_lpage`).

use crate::units::*;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::{Level, X86Level, PG_LEVEL_1G, PG_LEVEL_2M, PG_LEVEL_4K};
use std::collections::HashMap;

impl ShadowState {
    /// `unaccount_shadowed()`.
    pub(super) fn unaccount_shadowed(&mut self, id: SpId) {
        self.indirect_shadow_pages -= 1;
        if !self.write_tracking {
            return;
        }
        let (gfn, level) = {
            let sp = self.sp(id);
            (sp.gfn, sp.role.level())
        };
        fn dec<K: std::hash::Hash + Eq>(m: &mut HashMap<K, u32>, k: K) {
            if let Some(c) = m.get_mut(&k) {
                *c -= 1;
                if *c == 0 {
                    m.remove(&k);
                }
            }
        }
        if level > PG_LEVEL_4K {
            dec(&mut self.gfn_write_track, gfn);
        }
        for l in [PG_LEVEL_2M, PG_LEVEL_1G] {
            dec(&mut self.disallow_lpage, (l.0, gfn.0 >> l.gfn_shift()));
        }
    }

    /// `kvm_gfn_is_write_tracked()`.
    pub fn gfn_is_write_tracked(&self, gfn: Gfn) -> bool {
        self.gfn_write_track.contains_key(&gfn)
    }

    /// Whether a guest table forbids mapping `gfn` at `level` (`lpage_info.disallow_lpage`).
    pub fn lpage_disallowed(&self, gfn: Gfn, level: Level) -> bool {
        level > PG_LEVEL_4K
            && self
                .disallow_lpage
                .contains_key(&(level.0, gfn.0 >> level.gfn_shift()))
    }
}

impl LockedMmu<'_> {
    /// `account_shadowed()`: a page now shadows the guest table at its gfn. Upper-level tables
    /// are write-tracked (always read-only to the guest); a last-level table forbids huge
    /// mappings over its gfn and write-protects the existing ones.
    pub(super) fn account_shadowed(&mut self, id: SpId) {
        self.st.indirect_shadow_pages += 1;
        let (gfn, level) = {
            let sp = self.st.sp(id);
            (sp.gfn, sp.role.level())
        };
        if !self.st.write_tracking {
            // The negative control: the table is shadowed but left writable and untracked.
            return;
        }
        // __kvm_write_track_add_gfn() for upper levels does what a last-level table gets too
        // (kvm_mmu_gfn_disallow_lpage() and write protection), and marks the gfn tracked.
        if level > PG_LEVEL_4K {
            *self.st.gfn_write_track.entry(gfn).or_default() += 1;
        }
        for l in [PG_LEVEL_2M, PG_LEVEL_1G] {
            *self
                .st
                .disallow_lpage
                .entry((l.0, gfn.0 >> l.gfn_shift()))
                .or_default() += 1;
        }
        if self.st.gfn_write_protect(gfn, PG_LEVEL_4K, self.meter) {
            crate::x86::mmu::kvm_flush_remote_tlbs_gfn(self.kvm, gfn, PG_LEVEL_4K, self.meter);
        }
    }
}
