//! The threads engine: one OS thread per vCPU running its [`GuestCode`], and the calling thread
//! as the VMM thread, all on the real `mmu_lock`. Times are wall-clock.
//!
//! The host and the vCPU threads coordinate as dirty_log_perf_test's do: the host publishes an
//! iteration number, each vCPU thread makes one pass for it and records it as its last completed
//! iteration, then waits for the next (or, for background passes, goes straight on). Idle
//! threads wait on a condition variable rather than spin, so on a small host they leave the CPU
//! to the vCPUs being measured.

use crate::engine::EngineError;
use crate::engine::{Engine, GuestCode, HostThread, TimeSource};
use crate::kvm::meter::Meter;
use crate::kvm::op_plan::OpPlan;
use crate::vm::exit::{guest_op, OpOutcome};
use crate::vm::plan::run_plan;
use crate::vm::vcpu::Vcpu;
use crate::vm::Vm;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Coordination between the VMM thread and the vCPU threads (the selftest's `iteration`,
/// `vcpu_last_completed_iteration[]` and `host_quit`).
struct Control {
    iteration: AtomicI64,
    /// vCPUs go straight on to another pass of the same iteration (set before `iteration`).
    background: AtomicBool,
    quit: AtomicBool,
    completed: Vec<AtomicI64>,
    lock: Mutex<()>,
    cv: Condvar,
    /// Each vCPU's meter as of its last completed pass.
    meters: Vec<Mutex<Meter>>,
    /// First error a vCPU hit (a fault it could not handle).
    error: Mutex<Option<EngineError>>,
}

impl Control {
    /// Wakes every waiter. Taking the lock orders the notification after a waiter's check of
    /// the condition, so a store made before `notify()` is never missed.
    fn notify(&self) {
        let _g = self.lock.lock();
        self.cv.notify_all();
    }
}

/// A VM's vCPUs on OS threads (see the module documentation).
pub struct Threads<G> {
    vm: Arc<Vm>,
    ctl: Arc<Control>,
    /// The guests, until the vCPU threads start at the first pass.
    guests: Vec<G>,
    handles: Vec<JoinHandle<()>>,
}

impl<G: GuestCode + Send + 'static> Threads<G> {
    /// The vCPUs of `vm` (built with [`SpinWaiter`](crate::vm::waiter::SpinWaiter)), vCPU `i`
    /// running `guests[i]`. Their threads start with the first pass.
    pub fn new(vm: Arc<Vm>, guests: Vec<G>) -> Self {
        assert_eq!(guests.len(), vm.nr_vcpus(), "one guest per vCPU");
        let n = guests.len();
        Threads {
            vm,
            ctl: Arc::new(Control {
                iteration: AtomicI64::new(0),
                background: AtomicBool::new(false),
                quit: AtomicBool::new(false),
                completed: (0..n).map(|_| AtomicI64::new(-1)).collect(),
                lock: Mutex::new(()),
                cv: Condvar::new(),
                meters: (0..n).map(|_| Mutex::new(Meter::default())).collect(),
                error: Mutex::new(None),
            }),
            guests,
            handles: Vec::new(),
        }
    }

    /// Starts one thread per vCPU; they begin with the published iteration.
    fn spawn(&mut self) -> Result<(), EngineError> {
        for (i, guest) in std::mem::take(&mut self.guests).into_iter().enumerate() {
            let (vm, ctl) = (Arc::clone(&self.vm), Arc::clone(&self.ctl));
            let h = std::thread::Builder::new()
                .name(format!("vcpu{i}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    // A vCPU that dies must not leave the VMM waiting for it forever.
                    let run = std::panic::AssertUnwindSafe(|| vcpu_worker(&vm, &ctl, guest, i));
                    if let Err(panic) = std::panic::catch_unwind(run) {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        ctl.error.lock().get_or_insert(EngineError::Thread(format!(
                            "vCPU {i} panicked: {msg}"
                        )));
                        ctl.quit.store(true, Ordering::SeqCst);
                        ctl.notify();
                    }
                })
                .map_err(|e| EngineError::Thread(format!("cannot start vCPU thread {i}: {e}")))?;
            self.handles.push(h);
        }
        Ok(())
    }

    /// Waits until every vCPU has completed iteration `it`, or one failed.
    fn wait_all(&self, it: i64) -> Result<(), EngineError> {
        let ctl = &*self.ctl;
        let mut g = ctl.lock.lock();
        while !ctl
            .completed
            .iter()
            .all(|c| c.load(Ordering::Acquire) == it)
        {
            if ctl.quit.load(Ordering::Acquire) {
                break;
            }
            ctl.cv.wait(&mut g);
        }
        drop(g);
        match ctl.error.lock().clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Publishes iteration `it` to the vCPU threads (as passes to repeat when `background`),
    /// starting them the first time. Both stores happen under the lock a waiting vCPU checks
    /// them under, so no vCPU sees `background` with the previous iteration.
    fn publish(&mut self, it: i64, background: bool) -> Result<(), EngineError> {
        {
            let _g = self.ctl.lock.lock();
            self.ctl.background.store(background, Ordering::Release);
            self.ctl.iteration.store(it, Ordering::Release);
            self.ctl.cv.notify_all();
        }
        if !self.guests.is_empty() {
            return self.spawn();
        }
        Ok(())
    }
}

impl<G: GuestCode + Send + 'static> Engine for Threads<G> {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn time_source(&self) -> TimeSource {
        TimeSource::Wall
    }

    fn run_pass(&mut self, iteration: i64) -> Result<u64, EngineError> {
        // As in the selftest, the first pass's clock starts before the vCPU threads do.
        let start = Instant::now();
        self.publish(iteration, false)?;
        self.wait_all(iteration)?;
        Ok(start.elapsed().as_nanos() as u64)
    }

    fn start_background_passes(&mut self, iteration: i64) {
        if let Err(e) = self.publish(iteration, true) {
            self.ctl.error.lock().get_or_insert(e);
        }
    }

    fn stop_vcpus(&mut self) -> Result<(), EngineError> {
        self.finish();
        match self.ctl.error.lock().clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn run_plans(&mut self, plans: Vec<OpPlan>) -> Result<u64, EngineError> {
        let start = Instant::now();
        for plan in plans {
            let mut m = Meter::default();
            run_plan(&self.vm.kvm, plan, &mut m);
            self.vm.add_vmm_meter(&m);
        }
        Ok(start.elapsed().as_nanos() as u64)
    }

    fn vcpu_meters(&self) -> Vec<Meter> {
        self.ctl.meters.iter().map(|m| m.lock().clone()).collect()
    }

    /// The calling thread sleeps for `ns`; returns how long it slept.
    fn elapse(&mut self, ns: u64) -> Result<u64, EngineError> {
        let t0 = Instant::now();
        std::thread::sleep(std::time::Duration::from_nanos(ns));
        match self.ctl.error.lock().clone() {
            Some(e) => Err(e),
            None => Ok(t0.elapsed().as_nanos() as u64),
        }
    }

    /// The calling thread becomes the host thread while the vCPU threads make the pass: it
    /// runs `host`'s plans on the real `mmu_lock`, and sleeps in short naps until its wake
    /// flag is raised or the pass is over.
    fn run_pass_beside(
        &mut self,
        iteration: i64,
        host: &mut dyn HostThread,
    ) -> Result<u64, EngineError> {
        let start = Instant::now();
        self.publish(iteration, false)?;
        let kvm = &*self.vm.kvm;
        let wake = host.wake_flag();
        let ctl = &*self.ctl;
        let done = || {
            ctl.quit.load(Ordering::Acquire)
                || ctl
                    .completed
                    .iter()
                    .all(|c| c.load(Ordering::Acquire) == iteration)
        };
        while !done() {
            match host.next_plan(kvm) {
                Some(plan) => {
                    let t0 = Instant::now();
                    let mut m = Meter::default();
                    run_plan(kvm, plan, &mut m);
                    host.plan_done(t0.elapsed().as_nanos() as u64, &m);
                }
                None => {
                    while !wake.load(Ordering::Acquire) && !done() {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                }
            }
        }
        self.wait_all(iteration)?;
        Ok(start.elapsed().as_nanos() as u64)
    }

    /// One OS thread per host thread, each running its plans on the real `mmu_lock`.
    fn run_host_threads(
        &mut self,
        threads: &mut [&mut (dyn HostThread + Send)],
    ) -> Result<u64, EngineError> {
        let start = Instant::now();
        let kvm = &*self.vm.kvm;
        std::thread::scope(|scope| {
            for t in threads.iter_mut() {
                scope.spawn(move || {
                    while let Some(plan) = t.next_plan(kvm) {
                        let t0 = Instant::now();
                        let mut m = Meter::default();
                        run_plan(kvm, plan, &mut m);
                        t.plan_done(t0.elapsed().as_nanos() as u64, &m);
                    }
                });
            }
        });
        Ok(start.elapsed().as_nanos() as u64)
    }
}

impl<G> Threads<G> {
    /// `host_quit`, and joins every vCPU thread.
    fn finish(&mut self) {
        self.ctl.quit.store(true, Ordering::SeqCst);
        self.ctl.notify();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

impl<G> Drop for Threads<G> {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Runs `guest` on vCPU `idx` until told to quit.
fn vcpu_worker<G: GuestCode>(vm: &Vm, ctl: &Control, mut guest: G, idx: usize) {
    let kvm = &*vm.kvm;
    let mut vcpu = vm.vcpu(idx);
    loop {
        let cur = ctl.iteration.load(Ordering::Acquire);
        // KVM_RUN until the guest's GUEST_SYNC at the end of one pass.
        vcpu.run_begin(kvm);
        let r = guest_pass(vm, &mut vcpu, &mut guest, cur, &ctl.quit);
        vcpu.run_end(kvm);
        if let Err(e) = r {
            ctl.error.lock().get_or_insert(e);
            ctl.quit.store(true, Ordering::SeqCst);
        }
        *ctl.meters[idx].lock() = vcpu.meter.clone();
        ctl.completed[idx].store(cur, Ordering::Release);
        ctl.notify();
        // Wait for the next iteration, unless passes go on in the background.
        let mut g = ctl.lock.lock();
        while cur == ctl.iteration.load(Ordering::Acquire)
            && !ctl.background.load(Ordering::Acquire)
            && !ctl.quit.load(Ordering::Acquire)
        {
            ctl.cv.wait(&mut g);
        }
        drop(g);
        if ctl.quit.load(Ordering::Acquire) {
            return;
        }
    }
}

/// One pass of `guest` in guest mode, handling exits as `KVM_RUN` would.
fn guest_pass<G: GuestCode>(
    vm: &Vm,
    vcpu: &mut Vcpu,
    guest: &mut G,
    iteration: i64,
    quit: &AtomicBool,
) -> Result<(), EngineError> {
    let kvm = &*vm.kvm;
    let mmu = &*vm.mmu;
    vcpu.enter_guest(kvm);
    guest.start_pass(iteration);
    loop {
        // kvm_dirty_ring_check_request(): a ring at its soft limit exits to userspace
        // (KVM_EXIT_DIRTY_RING_FULL); the thread waits out of the guest until the ring is
        // reset, or leaves at host_quit. It goes back in once no KVM_RESET_DIRTY_RINGS is in
        // progress, as QEMU's reaping vCPU thread returns from the ioctl first.
        if kvm.dirty_ring_full(vcpu.id) && !quit.load(Ordering::Acquire) {
            // KVM_RUN returns to userspace, dropping SRCU (kvm_arch_vcpu_ioctl_run()'s
            // kvm_vcpu_srcu_read_unlock()), so a memslot change meanwhile does not wait for
            // this vCPU; it takes SRCU again when it re-enters KVM_RUN.
            vcpu.exit_guest(kvm);
            vcpu.run_end(kvm);
            while !kvm.dirty_ring_released(vcpu.id) && !quit.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_micros(20));
            }
            vcpu.run_begin(kvm);
            vcpu.enter_guest(kvm);
        }
        let Some(a) = guest.next_access() else {
            break;
        };
        if a.compute_ns > 0 {
            // The guest's own work: it keeps the CPU, as guest code would.
            let t0 = Instant::now();
            while t0.elapsed().as_nanos() < a.compute_ns as u128 {
                std::hint::spin_loop();
            }
        }
        match guest_op(kvm, mmu, vcpu, &a)? {
            OpOutcome::Done(_) => guest.access_done(&a),
            OpOutcome::Reflected => guest.access_reflected(&a),
        }
    }
    // GUEST_SYNC: a VM exit to userspace.
    vcpu.exit_guest(kvm);
    Ok(())
}
