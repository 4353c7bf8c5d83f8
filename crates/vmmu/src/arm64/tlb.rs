//! KVM/arm64's stage-2 TLB maintenance (`arch/arm64/kvm/hyp/vhe/tlb.c`, `mmu.c`): broadcast
//! TLBIs by IPA, by range (FEAT_TLBIRANGE, since Linux 6.6) and by VMID, each completed by a
//! `DSB ISH`. No IPIs: the other PEs' TLBs are invalidated by the hardware broadcast
//! ([`Kvm::tlbi_is`], [`Kvm::dsb_ish`]). Each operand is encoded as the architecture encodes
//! it ([`crate::hw::tlbi`]) and the TLB model applies what the operand says.
//!
//! The model's TLB caches combined translations (guest virtual = guest physical, stage 1 and
//! stage 2 in one entry) and stage-2-only ones: `TLBI VMALLE1IS` drops every combined entry of
//! the VMID and keeps the stage-2 ones, which only a TLBI by IPA, by range or of the whole
//! VMID (`VMALLS12E1IS`) removes.

use crate::arm64::Arm64Cpu;
use crate::hw::pgtable::Level;
use crate::hw::tlb::TlbInvalidation;
use crate::hw::tlbi::{flush_s2_tlb_range_op, tlbi_vaddr, TlbiIpa, MAX_TLBI_RANGE_PAGES};
use crate::kvm::meter::Meter;
use crate::kvm::vcpu::with_tlbi_pending;
use crate::kvm::Kvm;
use crate::units::Gfn;

/// `__kvm_tlb_flush_vmid_ipa(mmu, ipa, level)`: `TLBI IPAS2E1IS` for the IPA with the level as
/// TTL hint, `DSB ISH` (the stage-2 invalidation must complete before stage 1 is invalidated,
/// or another PE could refill a combined entry from the old stage-2 entry), then
/// `TLBI VMALLE1IS` and `DSB ISH`.
pub fn kvm_tlb_flush_vmid_ipa(kvm: &Kvm, gfn: Gfn, level: Level, meter: &mut Meter) {
    // The TTL field hints the level of the leaf; level 0 holds no leaf at the 4K granule, so no
    // hint is given there.
    let op = TlbiIpa::Ipas2e1is(tlbi_vaddr(gfn, Some(level)));
    stage2_then_stage1(kvm, meter, |post| post(op.invalidation()));
}

/// The shape of every broadcast stage-2 flush: the stage-2 operations `ops` posts, `DSB ISH`,
/// then `TLBI VMALLE1IS` (every stage-1 entry of the VMID, which may combine what stage 2 no
/// longer maps) and its `DSB ISH`.
fn stage2_then_stage1(
    kvm: &Kvm,
    meter: &mut Meter,
    ops: impl FnOnce(&mut dyn FnMut(TlbInvalidation)),
) {
    with_tlbi_pending(|pending| {
        ops(&mut |inv| kvm.tlbi_is(inv, pending, meter));
        kvm.dsb_ish(pending, meter);
    });
    kvm.tlbi_broadcast(TlbInvalidation::Stage1All, meter);
}

/// `__kvm_tlb_flush_vmid_ipa_nsh(mmu, ipa, level)` (Linux 6.5): the same two invalidations,
/// non-shareable, on vCPU `vcpu`'s PE only.
pub fn kvm_tlb_flush_vmid_ipa_nsh(
    kvm: &Kvm,
    vcpu: usize,
    gfn: Gfn,
    level: Level,
    meter: &mut Meter,
) {
    let op = TlbiIpa::Ipas2e1is(tlbi_vaddr(gfn, Some(level)));
    kvm.tlbi_local(vcpu, op.invalidation(), meter);
    kvm.tlbi_local(vcpu, TlbInvalidation::Stage1All, meter);
}

/// `__kvm_tlb_flush_vmid(mmu)`: `TLBI VMALLS12E1IS; DSB ISH` — every translation of the VMID.
pub fn kvm_tlb_flush_vmid(kvm: &Kvm, meter: &mut Meter) {
    kvm.tlbi_broadcast(TlbInvalidation::All, meter);
}

/// `__kvm_tlb_flush_vmid_range(mmu, start, pages)` (Linux 6.6): the range operations of
/// `__flush_s2_tlb_range_op(ipas2e1is, ...)` with no level hint, `DSB ISH`, then
/// `TLBI VMALLE1IS` and `DSB ISH`. At most [`MAX_TLBI_RANGE_PAGES`].
fn kvm_tlb_flush_vmid_range_op(kvm: &Kvm, start: Gfn, pages: u64, meter: &mut Meter) {
    stage2_then_stage1(kvm, meter, |post| {
        flush_s2_tlb_range_op(start, pages, true, 0, |op| post(op.invalidation()))
    });
}

/// `kvm_tlb_flush_vmid_range(mmu, addr, size)` (Linux 6.6): without FEAT_TLBIRANGE the whole
/// VMID; with it, range operations in chunks of at most [`MAX_TLBI_RANGE_PAGES`].
pub fn kvm_tlb_flush_vmid_range(
    kvm: &Kvm,
    cpu: Arm64Cpu,
    start: Gfn,
    pages: u64,
    meter: &mut Meter,
) {
    if !cpu.tlbi_range {
        kvm_tlb_flush_vmid(kvm, meter);
        return;
    }
    let mut at = start;
    let mut left = pages;
    while left > 0 {
        let n = left.min(MAX_TLBI_RANGE_PAGES);
        kvm_tlb_flush_vmid_range_op(kvm, at, n, meter);
        at += n;
        left -= n;
    }
}
