//! Write tracking of guest page tables (`account_shadowed()` / `unaccount_shadowed()`): the gfns
//! of upper-level guest tables stay read-only (`gfn_write_track`), and a shadowed last-level
//! table forbids huge mappings over it (`lpage_info.disallow_lpage`).

use crate::units::*;
use crate::x86::mmu::KvmPageFault;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::{
    is_shadow_present_pte, Level, SpteCell, X86Level, PG_LEVEL_1G, PG_LEVEL_2M, PG_LEVEL_4K,
};
use std::collections::HashMap;
use std::sync::atomic::Ordering;

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

/// `kvm_mmu_track_write()`: the guest wrote (by emulation) 8 bytes at `gpa` in a page that holds
/// shadowed guest tables. The shadow entries the write may have changed are zapped (the next
/// fault rebuilds them from the new guest PTE); a non-leaf table written three times in a row
/// without being used by a fault is taken for a page the guest reuses, and zapped whole
/// (`detect_write_flooding()`).
pub fn track_write(mmu: &mut LockedMmu<'_>, gpa: Gpa) {
    if mmu.st.indirect_shadow_pages == 0 {
        return;
    }
    let gfn = gpa.to_gfn();
    let index = ((gpa.0 % PAGE_SIZE) / 8) as usize;
    let mut invalid_list = Vec::new();
    let mut flush = false;
    for id in mmu.st.valid_sps_with_gptes(gfn, mmu.meter) {
        if mmu.st.sp(id).role.invalid() {
            continue;
        }
        if mmu.st.sp(id).role.level() > PG_LEVEL_4K {
            let sp = mmu.st.sp_mut(id);
            sp.write_flooding_count += 1;
            if sp.write_flooding_count >= 3 {
                mmu.st.mmu_flooded += 1;
                mmu.st.prepare_zap_page(id, &mut invalid_list, mmu.meter);
                continue;
            }
        }
        let entry = SpteCell::load(mmu.st.sptep(SptepRef::new(id, index)));
        mmu.st.zap_pte(id, index, None, mmu.meter);
        flush |= is_shadow_present_pte(entry);
    }
    mmu.remote_flush_or_zap(&mut invalid_list, flush);
}

/// `x86_emulate_instruction()` for a guest store the shadow MMU refused to map writable (it hit
/// a shadowed guest table): the store goes to guest memory, and the page-track notifier zaps
/// what it changed (`kvm_mmu_track_write()`).
pub(super) fn emulate_write(mmu: &mut LockedMmu<'_>, fault: &KvmPageFault) {
    mmu.meter.pf_emulated += 1;
    let gpa = fault.gfn.to_gpa() + fault.word as u64 * 8;
    let pfn = fault.slot.gfn_to_pfn(fault.gfn);
    // emulator_write_phys() writes through the host's user mapping.
    mmu.kvm.host.host_write(pfn);
    // Release pairs with the Acquire of KVM's own guest-table reads.
    mmu.kvm
        .host
        .access_word(pfn, fault.word as u64)
        .store(fault.value, Ordering::Release);
    // emulator_write_phys() -> kvm_vcpu_write_guest(): the page is dirtied like any other.
    fault.mark_page_dirty(mmu.kvm, mmu.meter);
    track_write(mmu, gpa);
}
