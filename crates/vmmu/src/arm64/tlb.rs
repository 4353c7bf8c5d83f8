//! KVM/arm64's stage-2 TLB maintenance as it was before range invalidation
//! (`arch/arm64/kvm/hyp/vhe/tlb.c`): broadcast TLBIs by IPA and by VMID, each completed by a
//! `DSB ISH`. No IPIs: the other PEs' TLBs are invalidated by the hardware broadcast
//! ([`Kvm::tlbi_is`], [`Kvm::dsb_ish`]).
//!
//! The model's TLB caches combined translations (guest virtual = guest physical, stage 1 and
//! stage 2 in one entry), as the hardware's combined TLB entries do; so `TLBI VMALLE1IS`, which
//! drops every stage-1 (hence every combined) entry of the VMID, is a full invalidation here.

use crate::hw::pgtable::Level;
use crate::hw::stage2::level_page_size;
use crate::hw::tlb::TlbInvalidation;
use crate::kvm::meter::Meter;
use crate::kvm::vcpu::TlbiPending;
use crate::kvm::Kvm;
use crate::units::Gfn;

/// `__kvm_tlb_flush_vmid_ipa(mmu, ipa, level)`: `TLBI IPAS2E1IS` for the IPA with the level as
/// TTL hint, `DSB ISH` (the stage-2 invalidation must complete before stage 1 is invalidated,
/// or another PE could refill a combined entry from the old stage-2 entry), then
/// `TLBI VMALLE1IS` and `DSB ISH`.
pub fn kvm_tlb_flush_vmid_ipa(kvm: &Kvm, gfn: Gfn, level: Level, meter: &mut Meter) {
    // The TTL field hints the level of the leaf; level 0 holds no leaf at the 4K granule, so no
    // hint is given there.
    let size = (level.0 >= 1).then(|| level_page_size(level));
    let mut pending = TlbiPending::default();
    kvm.tlbi_is(TlbInvalidation::Gfn { gfn, size }, &mut pending, meter);
    kvm.dsb_ish(pending, meter);
    // TLBI VMALLE1IS: every stage-1 entry of the VMID.
    kvm.tlbi_broadcast(TlbInvalidation::All, meter);
}

/// `__kvm_tlb_flush_vmid(mmu)`: `TLBI VMALLS12E1IS; DSB ISH` — every translation of the VMID.
pub fn kvm_tlb_flush_vmid(kvm: &Kvm, meter: &mut Meter) {
    kvm.tlbi_broadcast(TlbInvalidation::All, meter);
}
