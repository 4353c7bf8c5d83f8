//! The `dirty-log` scenario in virtual time: the same VM, MMU, guest and oracles as the threads
//! engine, driven on one OS thread in virtual-time order, so a run at 64 or 256 vCPUs on a
//! 2-core machine gives the same numbers every time. Phase times are virtual: what the
//! [`CostModel`] says the work each actor's `Meter` counted costs, with vCPUs running in parallel
//! and waiting for each other only on `mmu_lock`.

use crate::cost::CostModel;
use crate::engine::virtual_time::{cost_ps, ps_to_ns, Pricer, Ps, VirtualLock, VirtualWaiter};
use crate::kvm::dirty_log::OpPlan;
use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_lock::{LockMode, LockStats};
use crate::kvm::Kvm;
use crate::lab::dirty_log::{finish_report, PhaseClock, Setup};
use crate::lab::memstress::{pass_value, vcpu_regions, GuestRandom, PassCursor, VcpuRegion};
use crate::lab::params::DirtyLogParams;
use crate::lab::report::{DirtyLogReport, Phase};
use crate::units::{Gfn, PAGE_SIZE};
use crate::vm::exit::guest_access_with;
use crate::vm::plan::{run_plan_with, PlanPoint};
use crate::vm::vcpu::Vcpu;
use crate::vm::Vm;
use std::cell::RefCell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::Ordering;

/// One vCPU thread of the selftest, as an actor.
struct VcpuActor {
    clock: Ps,
    rng: GuestRandom,
    region: VcpuRegion,
    /// The pass in progress and its iteration, or `None` while waiting for the next iteration.
    pass: Option<(PassCursor, i64)>,
    /// The last iteration whose pass completed.
    completed: i64,
}

/// Everything the vCPU actors share.
struct World<'a> {
    vm: &'a Vm,
    setup: &'a Setup,
    p: &'a DirtyLogParams,
    pricer: Pricer,
    lock: VirtualLock,
    /// The host asked the vCPUs to quit (ends `-e`'s endless passes).
    quit: bool,
}

impl World<'_> {
    /// The access pattern of `iteration` (dirty_log_perf_test populates, iteration 0, with
    /// sequential 100% writes).
    fn pattern(&self, iteration: i64) -> (bool, u32) {
        if iteration == 0 {
            (false, 100)
        } else {
            (self.p.random_access, self.p.write_percent)
        }
    }

    /// Starts `iteration`'s pass on every vCPU at `now` (the host bumped `iteration`; each vCPU
    /// re-enters KVM_RUN when it notices).
    fn start_pass(
        &self,
        actors: &mut [VcpuActor],
        vcpus: &mut [parking_lot::MutexGuard<'_, Vcpu>],
        iteration: i64,
        now: Ps,
    ) {
        let kvm = &*self.vm.kvm;
        let (random, write_percent) = self.pattern(iteration);
        for (a, v) in actors.iter_mut().zip(vcpus.iter_mut()) {
            a.clock = a.clock.max(now);
            let before = v.meter.clone();
            v.run_begin(kvm);
            v.enter_guest(kvm);
            a.clock += self.pricer.ps(&before, &v.meter);
            a.pass = Some((
                PassCursor::new(a.region.pages, random, write_percent),
                iteration,
            ));
        }
    }

    /// Runs vCPU actors in virtual-time order until none has work left before `until`.
    fn run_vcpus(
        &mut self,
        actors: &mut [VcpuActor],
        vcpus: &mut [parking_lot::MutexGuard<'_, Vcpu>],
        until: Ps,
    ) -> Result<(), String> {
        let mut heap: BinaryHeap<Reverse<(Ps, usize)>> = actors
            .iter()
            .enumerate()
            .filter(|(_, a)| a.pass.is_some() && a.clock < until)
            .map(|(i, a)| Reverse((a.clock, i)))
            .collect();
        while let Some(Reverse((_, i))) = heap.pop() {
            // Run this actor until it passes the next actor's clock: nothing it does before
            // then can be affected by what the others do later.
            let horizon = heap.peek().map_or(until, |Reverse((t, _))| (*t).min(until));
            self.step(&mut actors[i], &mut vcpus[i], horizon)?;
            let a = &actors[i];
            if a.pass.is_some() && a.clock < until {
                heap.push(Reverse((a.clock, i)));
            }
        }
        Ok(())
    }

    /// Runs one vCPU's accesses while its clock is at or before `horizon`.
    fn step(&mut self, a: &mut VcpuActor, v: &mut Vcpu, horizon: Ps) -> Result<(), String> {
        let kvm = &*self.vm.kvm;
        let mmu = &*self.vm.mmu;
        let oracle = &self.setup.oracle;
        while a.clock <= horizon {
            let Some((cursor, iteration)) = a.pass.as_mut() else {
                return Ok(());
            };
            let iteration = *iteration;
            let Some((page, write)) = cursor.next(&mut a.rng) else {
                // GUEST_SYNC: exit to userspace; wait for the next iteration.
                let before = v.meter.clone();
                v.exit_guest(kvm);
                a.clock += self.pricer.ps(&before, &v.meter);
                a.completed = iteration;
                if iteration < 0 && !self.quit {
                    // -e: the selftest's vCPUs keep running passes while logging is disabled.
                    let (random, write_percent) = self.pattern(iteration);
                    let before = v.meter.clone();
                    v.enter_guest(kvm);
                    a.clock += self.pricer.ps(&before, &v.meter);
                    a.pass = Some((
                        PassCursor::new(a.region.pages, random, write_percent),
                        iteration,
                    ));
                    continue;
                }
                v.run_end(kvm);
                a.pass = None;
                return Ok(());
            };
            let gfn = Gfn(a.region.base_gfn + page);
            let value = pass_value(iteration, v.id);
            let s = if write { oracle.before_write() } else { 0 };
            // The access, with its exits handled by the threads engine's loop; only the slow
            // half of a fault differs: the lock is granted in virtual time, and the work before
            // the request and under the lock is priced separately.
            let mut mark = v.meter.clone();
            let (lock, pricer, clock) = (&mut self.lock, &self.pricer, &mut a.clock);
            let r = guest_access_with(kvm, mmu, v, gfn, 0, write, value, &mut |v, fault| {
                *clock += pricer.ps(&mark, &v.meter);
                let mode = mmu.fault_lock_mode(fault);
                let granted = lock.grant_time(mode, *clock);
                let held = kvm.mmu_lock.virtual_grant(mode);
                let before = v.meter.clone();
                let r = mmu.page_fault(kvm, fault, &held, &mut v.caches, &mut v.meter);
                drop(held);
                let end = granted + pricer.ps(&before, &v.meter);
                lock.hold(mode, *clock, granted, end, true, &kvm.mmu_lock.stats);
                *clock = end;
                mark = v.meter.clone();
                r
            });
            *clock += pricer.ps(&mark, &v.meter);
            if let Err(e) = r {
                // KVM_RUN fails: leave it, and this vCPU runs no more.
                v.run_end(kvm);
                a.pass = None;
                return Err(e);
            }
            if write {
                oracle.after_write(gfn.0, s);
            }
        }
        Ok(())
    }
}

/// The VMM thread: runs plans at its own clock. Before each step the running vCPUs (with `-e`)
/// are advanced up to the VMM's clock; a job holds `mmu_lock` in virtual time from its grant for
/// as long as its work costs.
///
/// While vCPUs run, a write-held job stops at every yield point (the virtual lock reports a
/// waiter), so the vCPUs are advanced to the job's clock in between: a vCPU that asks for the
/// lock in the meantime is granted it when the job stops (the job's `cond_resched_rwlock_*()`
/// let it in, counted in `lock_yields`), and the job re-queues behind it. A stop where nobody
/// asked keeps the lock but costs the job a walk from the root to its cursor, which a kernel
/// job would not pay. A read-held job never stops: it only conflicts with write-held requests,
/// and vCPU faults are readers in the TDP MMU (the shadow MMU's jobs are all write-held).
fn vmm_run(
    world: &mut World,
    actors: &mut [VcpuActor],
    vcpus: &mut [parking_lot::MutexGuard<'_, Vcpu>],
    clock: &mut Ps,
    plans: Vec<OpPlan>,
) -> Result<u64, String> {
    let start = *clock;
    let vm = world.vm;
    let kvm = &*vm.kvm;
    let state = RefCell::new((world, actors, vcpus, clock, None::<String>));
    for plan in plans {
        let mut meter = Meter::default();
        let mut step_start = (0, Meter::default());
        run_plan_with(
            kvm,
            plan,
            &mut meter,
            &mut |point, m| {
                let mut st = state.borrow_mut();
                let (world, actors, vcpus, clock, err) = &mut *st;
                match point {
                    PlanPoint::Before(_) => {
                        if let Err(e) = world.run_vcpus(actors, vcpus, **clock) {
                            err.get_or_insert(e);
                        }
                        step_start = (**clock, m.clone());
                    }
                    // Jobs account for themselves below.
                    PlanPoint::After(Some(_)) => {}
                    PlanPoint::After(None) => **clock += world.pricer.ps(&step_start.1, m),
                }
            },
            &mut |kvm: &Kvm, job: &mut dyn MmuJob, meter: &mut Meter| {
                let mut st = state.borrow_mut();
                let (world, actors, vcpus, clock, err) = &mut *st;
                let mode = job.lock_mode();
                // Whether this job resumes after a stop where nobody took the lock: then it
                // never released it, and the chunk is not a new acquisition.
                let mut resumed = false;
                loop {
                    if let Err(e) = world.run_vcpus(actors, vcpus, **clock) {
                        err.get_or_insert(e);
                    }
                    let requested = **clock;
                    let granted = world.lock.grant_time(mode, requested);
                    // Only a running vCPU whose fault conflicts with this job can wait for it:
                    // TDP faults are readers, so only a write-held job stops for them.
                    let conflict =
                        mode == LockMode::Write && actors.iter().any(|a| a.pass.is_some());
                    kvm.mmu_lock.set_virtual_waiters(conflict as u32);
                    let held = kvm.mmu_lock.virtual_grant(mode);
                    let before = meter.clone();
                    let step = job.run(kvm, &held, meter);
                    drop(held);
                    kvm.mmu_lock.set_virtual_waiters(0);
                    let end = granted + world.pricer.ps(&before, meter);
                    world
                        .lock
                        .hold(mode, requested, granted, end, !resumed, &kvm.mmu_lock.stats);
                    **clock = end;
                    resumed = false;
                    match step {
                        JobStep::Done { flush } => return flush,
                        JobStep::Yield => {
                            // Let the vCPUs catch up; if one took the lock meanwhile, the job
                            // really yielded (cond_resched_rwlock_write() let it in).
                            let acquired = |st: &LockStats| {
                                st.read_acquired.load(Ordering::Relaxed)
                                    + st.write_acquired.load(Ordering::Relaxed)
                            };
                            let seen = acquired(&kvm.mmu_lock.stats);
                            if let Err(e) = world.run_vcpus(actors, vcpus, end) {
                                err.get_or_insert(e);
                            }
                            if acquired(&kvm.mmu_lock.stats) != seen {
                                let before = meter.clone();
                                meter.lock_yields += 1;
                                **clock += world.pricer.ps(&before, meter);
                            } else {
                                resumed = true;
                            }
                        }
                        JobStep::NeedTopup => {
                            let before = meter.clone();
                            meter.lock_drops_for_alloc += 1;
                            job.topup(kvm, meter);
                            **clock += world.pricer.ps(&before, meter);
                        }
                    }
                }
            },
        );
        vm.add_vmm_meter(&meter);
        if let Some(e) = state.borrow_mut().4.take() {
            return Err(e);
        }
    }
    let end = *state.borrow().3;
    Ok(ps_to_ns(end - start))
}

/// Refuses cost models under which virtual time cannot advance (a guest access that costs
/// nothing would let a vCPU run forever at one instant) or would overflow (one unit of some work
/// costing more than a second).
fn check_cost_model(cost: &CostModel) -> Result<(), String> {
    let access = Meter {
        tlb_hits: 1,
        guest_writes: 1,
        ..Default::default()
    };
    if cost_ps(cost, &access) == 0 {
        return Err("cost model: a guest access (tlb_hit_ns + guest_memory_access_ns) costs 0 ns, so virtual time cannot advance; give one of them a positive value".into());
    }
    let everything = Meter::from_counts([1; crate::kvm::meter::NR_METER_FIELDS]);
    if cost.nanos_f64(&everything) > 1e9 {
        return Err("cost model: one unit of every counted event costs more than a second; costs are in nanoseconds".into());
    }
    Ok(())
}

/// Runs the scenario in virtual time with `cost`. `progress` prints phase names to stderr.
pub fn run_dirty_log_virtual(
    p: &DirtyLogParams,
    cost: &CostModel,
    progress: bool,
) -> Result<DirtyLogReport, String> {
    check_cost_model(cost)?;
    let setup = Setup::new(p, Box::new(VirtualWaiter))?;
    let vm = &*setup.vm;
    let mut report = setup.report(p, "virtual");
    let say = |what: &str| {
        if progress {
            eprintln!("vmmu: {what}");
        }
    };
    let regions = vcpu_regions(
        setup.base_gfn,
        p.vcpus,
        p.vcpu_memory_bytes / PAGE_SIZE,
        p.partition,
    );
    let mut actors: Vec<VcpuActor> = regions
        .into_iter()
        .enumerate()
        .map(|(i, region)| VcpuActor {
            clock: 0,
            rng: GuestRandom::new(p.random_seed.wrapping_add(i as u32)),
            region,
            pass: None,
            completed: -1,
        })
        .collect();
    let mut vcpus: Vec<_> = (0..p.vcpus).map(|i| vm.vcpu(i)).collect();
    let mut world = World {
        vm,
        setup: &setup,
        p,
        pricer: Pricer::new(cost),
        lock: VirtualLock::default(),
        quit: false,
    };
    let mut clock = PhaseClock::default();
    let lap = |clock: &mut PhaseClock, vcpus: &[parking_lot::MutexGuard<'_, Vcpu>]| {
        let meters: Vec<Meter> = vcpus.iter().map(|v| v.meter.clone()).collect();
        Some(clock.lap_with(vm, &meters))
    };
    let mut now: Ps = 0;
    // A pass: start every vCPU at `now`, run them all to the end of the pass; the host sees the
    // last one finish.
    let pass = |world: &mut World,
                actors: &mut [VcpuActor],
                vcpus: &mut [parking_lot::MutexGuard<'_, Vcpu>],
                it: i64,
                now: &mut Ps|
     -> Result<u64, String> {
        let start = *now;
        world.start_pass(actors, vcpus, it, start);
        world.run_vcpus(actors, vcpus, Ps::MAX)?;
        debug_assert!(actors.iter().all(|a| a.completed == it));
        *now = actors.iter().map(|a| a.clock).max().unwrap_or(start);
        Ok(ps_to_ns(*now - start))
    };

    say("populating memory");
    let ns = pass(&mut world, &mut actors, &mut vcpus, 0, &mut now)?;
    report.populate = Phase {
        wall_ns: ns,
        counters: lap(&mut clock, &vcpus),
    };

    say("enabling dirty logging");
    let ns = vmm_run(
        &mut world,
        &mut actors,
        &mut vcpus,
        &mut now,
        setup.flags_plans(KVM_MEM_LOG_DIRTY_PAGES),
    )?;
    setup.oracle.logging_enabled();
    report.enable = Phase {
        wall_ns: ns,
        counters: lap(&mut clock, &vcpus),
    };

    let mut lost = Vec::new();
    for it in 1..=p.iterations as i64 {
        say(&format!("iteration {it}"));
        let ns = pass(&mut world, &mut actors, &mut vcpus, it, &mut now)?;
        let dirty = Phase {
            wall_ns: ns,
            counters: lap(&mut clock, &vcpus),
        };
        if cfg!(debug_assertions) {
            report.oracle.invariant_errors.extend(vm.check_invariants());
        }
        let it_report = setup.harvest(
            p,
            it as u32,
            dirty,
            &mut report.oracle,
            &mut lost,
            &mut |plans| {
                let ns = vmm_run(&mut world, &mut actors, &mut vcpus, &mut now, plans)?;
                Ok(Phase {
                    wall_ns: ns,
                    counters: lap(&mut clock, &vcpus),
                })
            },
        )?;
        report.iterations.push(it_report);
    }

    say("disabling dirty logging");
    if p.run_vcpus_while_disabling {
        world.start_pass(&mut actors, &mut vcpus, -1, now);
    }
    let ns = vmm_run(
        &mut world,
        &mut actors,
        &mut vcpus,
        &mut now,
        setup.flags_plans(0),
    )?;
    if p.run_vcpus_while_disabling {
        // host_quit: the -e passes finish and every vCPU leaves KVM_RUN (counted in the disable
        // phase, as the threads engine counts it; the phase's time is the VMM's).
        world.quit = true;
        world.run_vcpus(&mut actors, &mut vcpus, Ps::MAX)?;
    }
    report.disable = Phase {
        wall_ns: ns,
        counters: lap(&mut clock, &vcpus),
    };
    drop(vcpus);
    finish_report(&mut report, lost, vm);
    Ok(report)
}
