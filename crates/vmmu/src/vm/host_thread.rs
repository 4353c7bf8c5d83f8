//! A host thread beside the VM (kswapd, a page-idle marker): a source of [`OpPlan`]s that an
//! engine runs one at a time, beside the vCPUs or with other host threads.

use crate::kvm::meter::Meter;
use crate::kvm::op_plan::OpPlan;
use crate::kvm::Kvm;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// A host thread that runs beside the vCPUs ([`Engine::run_pass_beside`](crate::engine::Engine::run_pass_beside)), or with other host
/// threads ([`Engine::run_host_threads`](crate::engine::Engine::run_host_threads)): its work comes one
/// [`OpPlan`] at a time, so its `mmu_lock` jobs are granted as the engine grants any job, and
/// it sleeps until something raises its wake flag.
pub trait HostThread {
    /// The next plan to run, or `None` to sleep until the wake flag is raised.
    fn next_plan(&mut self, kvm: &Kvm) -> Option<OpPlan>;

    /// The flag that wakes the thread (raised by vCPUs' faults; read after their exits).
    fn wake_flag(&self) -> Arc<AtomicBool>;

    /// The plan [`HostThread::next_plan`] gave last took `ns` of the engine's time and
    /// counted `meter`.
    fn plan_done(&mut self, ns: u64, meter: &Meter);
}
