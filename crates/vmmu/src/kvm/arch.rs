//! The architecture hooks KVM core calls (`kvm_arch_*()`): what an architecture does on its own
//! terms where generic KVM code leaves it a choice. Each architecture provides one
//! [`KvmArch`], installed in [`crate::kvm::Kvm`] when the VM is created
//! (`kvm_arch_init_vm()`); KVM core never names an architecture.

use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::JobStep;
use crate::kvm::mmu_lock::MmuLockHeld;
use crate::kvm::op_plan::OpStep;
use crate::kvm::Kvm;
use crate::units::Gfn;
use std::sync::Arc;

/// One architecture's hooks.
pub trait KvmArch: Send + Sync {
    /// `kvm_arch_flush_remote_tlbs()`: flush every vCPU's TLB for this VM by the
    /// architecture's own means and return true (arm64: a broadcast TLBI of the VMID), or
    /// return false to have KVM core make `KVM_REQ_TLB_FLUSH` on every vCPU and kick them (x86
    /// without Hyper-V's enlightenment: `-EOPNOTSUPP`).
    fn flush_remote_tlbs(&self, kvm: &Kvm, meter: &mut Meter) -> bool;

    /// `kvm_arch_flush_remote_tlbs_range()`: flush the translations of `pages` pages from
    /// `start` and return true, or return false for a full [`KvmArch::flush_remote_tlbs`].
    fn flush_remote_tlbs_range(&self, kvm: &Kvm, start: Gfn, pages: u64, meter: &mut Meter)
        -> bool;

    /// `kvm_mmu_slot_apply_flags()` (from `kvm_arch_commit_memory_region()`): what the MMU
    /// does when a flags-only change of `slot` from `old_flags` to `new_flags` (dirty logging
    /// starting or stopping) has been published and waited out, as plan steps.
    fn mmu_slot_apply_flags(
        &self,
        kvm: &Kvm,
        slot: &Arc<Memslot>,
        old_flags: u32,
        new_flags: u32,
    ) -> Vec<OpStep>;

    /// `kvm_mmu_update_cpu_dirty_logging()` (x86, from `kvm_mmu_slot_apply_flags()` on every
    /// change that starts or stops a memslot's logging, creation and deletion included): turn
    /// the CPU's own dirty log on with the first logging memslot and off with the last. Called
    /// after [`Kvm::count_memslot_dirty_logging`]. Nothing by default.
    fn update_cpu_dirty_logging(&self, _kvm: &Kvm, _enable: bool, _meter: &mut Meter) {}

    /// `kvm_arch_sync_dirty_log()`: before GET and CLEAR read a memslot's bitmap, bring in what
    /// the CPUs logged themselves (x86 with PML kicks every vCPU so that its exit empties its
    /// log, without waiting). Nothing by default.
    fn sync_dirty_log(&self, _kvm: &Kvm, _slot: &Memslot, _meter: &mut Meter) {}

    /// A reusable `kvm_arch_mmu_enable_log_dirty_pt_masked()`: re-protect 64-page masks of a
    /// slot under the write lock, so writes to them are logged again.
    fn enable_log_dirty_pt_masked(&self) -> Box<dyn EnableLogDirtyPtMasked>;
}

/// `kvm_arch_mmu_enable_log_dirty_pt_masked()` for one mask at a time, resumable because an
/// architecture may split huge pages inside it and yield `mmu_lock` (write) when contended.
pub trait EnableLogDirtyPtMasked: Send {
    /// Begins the mask of the 64 pages from `slot.base_gfn + gfn_offset`.
    fn start(&mut self, slot: &Arc<Memslot>, gfn_offset: u64, mask: u64);
    /// Runs under the write lock until done or a yield point says to stop; `Done` carries the
    /// range the caller owes a flush for.
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep;
    /// Allocates what [`JobStep::NeedTopup`] asked for; runs without the lock.
    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter);
}
