//! A KVM operation as a plan: the ordered steps (lockless calls, SRCU waits, jobs under
//! `mmu_lock`, flushes) that KVM performs for an ioctl or a host event, which any engine
//! executes with the VM layer's plan interpreter (`crate::vm::plan`).

use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::MmuJob;
use crate::kvm::Kvm;
use std::sync::Arc;

/// A lockless action inside a plan.
pub type PlanCall = Box<dyn FnOnce(&Kvm, &mut Meter) + Send>;

/// Steps decided when the plan gets to them: a lockless action that returns the steps to run
/// next (they depend on the state then, e.g. the ring entries a reset takes).
pub type PlanExpand = Box<dyn FnOnce(&Kvm, &mut Meter) -> Vec<OpStep> + Send>;

/// One step of a KVM operation.
pub enum OpStep {
    /// Run a closure without `mmu_lock` (flag updates, bitmap copies).
    Call(PlanCall),
    /// Run a closure without `mmu_lock` that says what the plan does next: its steps run
    /// before the rest of the plan.
    Expand(PlanExpand),
    /// `synchronize_srcu()`.
    SyncSrcu,
    /// Run a job under `mmu_lock`, yielding when it asks to.
    Job(Box<dyn MmuJob>),
    /// `kvm_flush_remote_tlbs_memslot()` if an earlier job left a flush pending.
    FlushMemslotIfPending(Arc<Memslot>),
    /// `kvm_flush_remote_tlbs()` if an earlier job left a flush pending.
    FlushIfPending,
    /// `kvm_flush_remote_tlbs_memslot()` unconditionally.
    FlushMemslot(Arc<Memslot>),
}

/// A KVM operation as an ordered list of steps. Engines execute it with
/// the VM layer's plan interpreter, on any engine.
#[derive(Default)]
pub struct OpPlan {
    /// The steps, in order.
    pub steps: Vec<OpStep>,
}

impl OpPlan {
    /// Appends `s`.
    pub fn push(&mut self, s: OpStep) -> &mut Self {
        self.steps.push(s);
        self
    }
}
