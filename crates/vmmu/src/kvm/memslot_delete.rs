//! Deleting a memslot (`KVM_SET_USER_MEMORY_REGION` with a size of 0, `kvm_set_memslot()` with
//! `KVM_MR_DELETE`) as an [`OpPlan`], so every engine runs and prices it: the slot leaves the
//! active memslots and SRCU readers drain (`kvm_invalidate_memslot()`), the MMU drops every
//! mapping of its gfns under the write lock (`kvm_arch_flush_shadow_memslot()`: arm64's
//! `kvm_stage2_unmap_range()`, x86's zap of the slot), a flush is made if the zap owes one, and
//! the MMU is told (`kvm_arch_commit_memory_region()`).

use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, Mmu, MmuJob};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::op_plan::{OpPlan, OpStep};
use crate::kvm::Kvm;
use std::sync::Arc;

/// `kvm_arch_flush_shadow_memslot()`: every mapping of the slot's gfns goes, under the write
/// lock, in one run. Simplified: arm64's `unmap_stage2_range()` walks 1G at a time with
/// `cond_resched_rwlock_write()` between chunks; here the walk does not yield. x86's shadow MMU
/// zaps the slot (`kvm_mmu_zap_memslot()`) or everything (`kvm_mmu_zap_all_fast()`, KVM's
/// default quirk), as its [`SlotZap`](crate::x86::shadow::state::SlotZap) says; the TDP MMU
/// zaps the slot. KVM flushes before dropping the lock and the plan right after it: the slot
/// is already invisible, so no fault can map it meanwhile.
struct FlushShadowMemslot {
    mmu: Arc<dyn Mmu>,
    slot: Arc<Memslot>,
}

impl MmuJob for FlushShadowMemslot {
    fn name(&self) -> &'static str {
        "flush_shadow_memslot"
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let (start, end) = (self.slot.base_gfn, self.slot.end_gfn());
        let flush = self
            .mmu
            .flush_shadow_memslot(kvm, start, end, held.write(), meter);
        JobStep::Done { flush }
    }
}

/// The plan that deletes `slot` from `kvm`, whose MMU is `mmu`.
pub fn delete_memslot_plan(mmu: &Arc<dyn Mmu>, slot: &Arc<Memslot>) -> OpPlan {
    let id = slot.id;
    let logged = slot.dirty_track_enabled();
    let commit = Arc::clone(mmu);
    OpPlan {
        steps: vec![
            // kvm_invalidate_memslot(): no new fault finds the slot once readers have drained.
            // Simplified: KVM first publishes the slot marked KVM_MEMSLOT_INVALID (a fault on it
            // retries) and removes it after the flush with a second swap; here it goes at once,
            // so a fault on it meanwhile finds no memslot.
            OpStep::Call(Box::new(move |kvm, _| {
                let slots = kvm.all_slots().into_iter().filter(|s| s.id != id).collect();
                kvm.publish_memslots(slots);
            })),
            OpStep::SyncSrcu,
            OpStep::Job(Box::new(FlushShadowMemslot {
                mmu: Arc::clone(mmu),
                slot: Arc::clone(slot),
            })),
            OpStep::FlushMemslotIfPending(Arc::clone(slot)),
            OpStep::Call(Box::new(move |kvm, meter| {
                // kvm_commit_memory_region(): a logging slot no longer counts, and
                // kvm_mmu_slot_apply_flags() updates the CPU's dirty logging.
                if logged {
                    kvm.count_memslot_dirty_logging(false);
                    kvm.arch().update_cpu_dirty_logging(kvm, false, meter);
                }
                commit.commit_memory_region(kvm)
            })),
        ],
    }
}
