//! x86's KVM architecture hooks ([`KvmArch`]): no range or self-served TLB flush (without
//! Hyper-V's enlightenment KVM falls back to `KVM_REQ_TLB_FLUSH` on every vCPU), what
//! `kvm_mmu_slot_apply_flags()` does when dirty logging starts or stops,
//! `kvm_arch_mmu_enable_log_dirty_pt_masked()` (write protection, or with PML clearing D, with
//! eager splitting on the first CLEAR under initially-all-set), and `kvm_arch_sync_dirty_log()`
//! (with PML, kick every vCPU so its exit empties its log).

use crate::kvm::arch::{EnableLogDirtyPtMasked, KvmArch};
use crate::kvm::memslot::{
    dirty_logging_change, Memslot, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_ctx::MmuCtx;
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::op_plan::OpStep;
use crate::kvm::{Kvm, KVM_REQ_UPDATE_CPU_DIRTY_LOGGING};
use crate::units::{Gfn, GfnRange};
use crate::x86::mmu::X86Mmu;
use crate::x86::spte::{X86Level, PG_LEVEL_2M, PG_LEVEL_4K};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// x86's hooks over the VM's MMU (TDP or shadow).
pub struct X86Arch {
    mmu: Arc<dyn X86Mmu>,
}

impl X86Arch {
    /// The hooks of a VM whose MMU is `mmu`.
    pub fn new(mmu: Arc<dyn X86Mmu>) -> Self {
        X86Arch { mmu }
    }
}

impl KvmArch for X86Arch {
    fn flush_remote_tlbs(&self, _kvm: &Kvm, _meter: &mut Meter) -> bool {
        // kvm_arch_flush_remote_tlbs(): -EOPNOTSUPP without kvm_x86_ops.flush_remote_tlbs
        // (only Hyper-V provides it), so KVM core requests KVM_REQ_TLB_FLUSH.
        false
    }

    fn flush_remote_tlbs_range(
        &self,
        _kvm: &Kvm,
        _start: Gfn,
        _pages: u64,
        _meter: &mut Meter,
    ) -> bool {
        // kvm_arch_flush_remote_tlbs_range(): -EOPNOTSUPP without Hyper-V's range flush; KVM
        // core flushes everything.
        false
    }

    fn mmu_slot_apply_flags(
        &self,
        kvm: &Kvm,
        slot: &Arc<Memslot>,
        old_flags: u32,
        new_flags: u32,
    ) -> Vec<OpStep> {
        let mut steps = Vec::new();
        let (enable, disable) = dirty_logging_change(old_flags, new_flags);
        let pml = kvm.cpu_dirty_log_size() > 0;
        if pml && (old_flags ^ new_flags) & KVM_MEM_LOG_DIRTY_PAGES != 0 {
            steps.push(OpStep::Call(Box::new(
                move |kvm: &Kvm, meter: &mut Meter| {
                    kvm.arch().update_cpu_dirty_logging(kvm, enable, meter)
                },
            )));
        }
        // Read-only slots have nothing to split, protect or recover.
        if new_flags & KVM_MEM_READONLY != 0 {
            return steps;
        }
        if enable {
            // With initially-all-set nothing is protected or split now: the first CLEAR does it.
            if !kvm.dirty_log_manual_protect_and_init_set() {
                if kvm.eager_page_split.load(Ordering::Relaxed) {
                    // kvm_mmu_slot_try_split_huge_pages(): TDP MMU under the read lock.
                    steps.push(OpStep::Job(self.mmu.try_split_huge_pages(
                        slot,
                        slot.base_gfn,
                        slot.end_gfn(),
                        PG_LEVEL_4K,
                        LockMode::Read,
                    )));
                }
                if pml {
                    // The CPU logs the first write through a leaf whose D is clear. D is per
                    // leaf, so after one write to a huge leaf the writes to its other pages would
                    // go unlogged: huge leaves are write-protected instead, and split on fault.
                    steps.push(OpStep::Job(self.mmu.slot_leaf_clear_dirty(slot)));
                    steps.push(OpStep::Job(
                        self.mmu.slot_remove_write_access(slot, PG_LEVEL_2M),
                    ));
                } else {
                    steps.push(OpStep::Job(
                        self.mmu.slot_remove_write_access(slot, PG_LEVEL_4K),
                    ));
                }
                // Flushed unconditionally after enabling (see kvm_mmu_slot_apply_flags()).
                steps.push(OpStep::FlushMemslot(Arc::clone(slot)));
            }
        } else if disable {
            // The job flushes before it releases the lock.
            steps.push(OpStep::Job(self.mmu.recover_huge_pages(slot)));
        }
        steps
    }

    fn update_cpu_dirty_logging(&self, kvm: &Kvm, enable: bool, meter: &mut Meter) {
        // PML goes on with the first logging memslot and off with the last. The request waits
        // until every vCPU in guest mode has left it, so none runs with the old setting once
        // the caller clears the leaves' D bits.
        if kvm.cpu_dirty_log_size() == 0 {
            return;
        }
        let nr_slots = kvm.nr_memslots_dirty_logging();
        if (enable && nr_slots == 1) || nr_slots == 0 {
            kvm.make_all_cpus_request(KVM_REQ_UPDATE_CPU_DIRTY_LOGGING, meter);
        }
    }

    fn sync_dirty_log(&self, kvm: &Kvm, _slot: &Memslot, meter: &mut Meter) {
        // KVM empties a vCPU's PML log on every exit, so kicking the vCPUs in guest mode is
        // enough; it does not wait for them. A page a vCPU logged before the kick but empties
        // only after GET or CLEAR read the bitmap is reported by the next harvest.
        if kvm.cpu_dirty_log_size() > 0 {
            kvm.kick_all_vcpus(meter);
        }
    }

    fn enable_log_dirty_pt_masked(&self) -> Box<dyn EnableLogDirtyPtMasked> {
        Box::new(MaskedReprotect {
            mmu: Arc::clone(&self.mmu),
            slot: None,
            gfn_offset: 0,
            mask: 0,
            split: None,
            split_done: false,
        })
    }
}

/// `kvm_arch_mmu_enable_log_dirty_pt_masked()` for one 64-page mask, resumable because the
/// eager split inside it yields `mmu_lock` (write) when contended.
struct MaskedReprotect {
    mmu: Arc<dyn X86Mmu>,
    slot: Option<Arc<Memslot>>,
    gfn_offset: u64,
    mask: u64,
    split: Option<Box<dyn MmuJob>>,
    split_done: bool,
}

impl EnableLogDirtyPtMasked for MaskedReprotect {
    fn start(&mut self, slot: &Arc<Memslot>, gfn_offset: u64, mask: u64) {
        self.slot = Some(Arc::clone(slot));
        self.gfn_offset = gfn_offset;
        self.mask = mask;
        self.split = None;
        self.split_done = false;
    }

    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let held = held.write();
        let guard = crossbeam_epoch::pin();
        let slot_arc = self.slot.as_ref().expect("start() before run()");
        let slot = &**slot_arc;
        let mmu = &*self.mmu;
        if kvm.dirty_log_manual_protect_and_init_set() {
            let base = slot.base_gfn.0 + self.gfn_offset;
            let start = Gfn(base + self.mask.trailing_zeros() as u64);
            let end = Gfn(base + 63 - self.mask.leading_zeros() as u64);
            if kvm.eager_page_split.load(Ordering::Relaxed) && !self.split_done {
                // kvm_mmu_try_split_huge_pages(): the write lock is already held.
                let job = self.split.get_or_insert_with(|| {
                    mmu.try_split_huge_pages(slot_arc, start, end + 1, PG_LEVEL_4K, LockMode::Write)
                });
                match job.run(kvm, &held, meter) {
                    JobStep::Done { .. } => self.split_done = true,
                    other => return other,
                }
            }
            // Huge pages that remain (split off or refused) are write-protected at both ends.
            let ctx = &mut MmuCtx::new(kvm, held, &guard, meter);
            mmu.slot_gfn_write_protect(ctx, slot, start, PG_LEVEL_2M);
            if start.0 & !(PG_LEVEL_2M.pages() - 1) != end.0 & !(PG_LEVEL_2M.pages() - 1) {
                mmu.slot_gfn_write_protect(ctx, slot, end, PG_LEVEL_2M);
            }
        }
        // Clear D (PML) or write-protect the 4K pages of the mask.
        let wrprot = kvm.cpu_dirty_log_size() == 0;
        let ctx = &mut MmuCtx::new(kvm, held, &guard, meter);
        mmu.clear_pt_masked(ctx, slot, self.gfn_offset, self.mask, wrprot);
        // The mask's pages are owed a flush (the caller flushes the memslot, as KVM does).
        let base = slot.base_gfn.0 + self.gfn_offset;
        JobStep::Done {
            flush: Some(GfnRange {
                start: Gfn(base + self.mask.trailing_zeros() as u64),
                end: Gfn(base + 64 - self.mask.leading_zeros() as u64),
            }),
        }
    }

    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if let Some(j) = self.split.as_mut() {
            j.topup(kvm, meter);
        }
    }
}
