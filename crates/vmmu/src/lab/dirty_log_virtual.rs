//! The `dirty-log` scenario in virtual time: the same VM, MMU, guest and oracles as the threads
//! engine, driven by [`VirtualTime`], so a run at 64 or 256 vCPUs on a 2-core machine gives the
//! same numbers every time. Phase times are virtual: what the [`CostModel`] says the work each
//! actor's `Meter` counted costs, with vCPUs running in parallel and waiting for each other only
//! on `mmu_lock`.

use crate::cost::CostModel;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
use crate::lab::dirty_log::{finish_report, DirtyLogGuest, PhaseClock, Setup};
use crate::lab::params::DirtyLogParams;
use crate::lab::report::{DirtyLogReport, Phase};

/// Runs the scenario in virtual time with `cost`. `progress` prints phase names to stderr.
pub fn run_dirty_log_virtual(
    p: &DirtyLogParams,
    cost: &CostModel,
    progress: bool,
) -> Result<DirtyLogReport, String> {
    crate::engine::virtual_time::check_cost_model(cost)?;
    let setup = Setup::new(p, Box::new(VirtualWaiter))?;
    let vm = &*setup.vm;
    let mut report = setup.report(p, "virtual");
    let say = |what: &str| {
        if progress {
            eprintln!("vmmu: {what}");
        }
    };
    let mut engine = VirtualTime::new(vm, cost, DirtyLogGuest::for_vcpus(&setup, p))?;
    let mut clock = PhaseClock::default();
    let lap = |clock: &mut PhaseClock, engine: &VirtualTime<'_, DirtyLogGuest>| {
        Some(clock.lap_with(vm, &engine.vcpu_meters()))
    };

    say("populating memory");
    let ns = engine.run_pass(0)?;
    report.populate = Phase {
        wall_ns: ns,
        counters: lap(&mut clock, &engine),
    };

    say("enabling dirty logging");
    let ns = engine.run_plans(setup.flags_plans(KVM_MEM_LOG_DIRTY_PAGES))?;
    setup.oracle.logging_enabled();
    report.enable = Phase {
        wall_ns: ns,
        counters: lap(&mut clock, &engine),
    };

    let mut lost = Vec::new();
    for it in 1..=p.iterations as i64 {
        say(&format!("iteration {it}"));
        let ns = engine.run_pass(it)?;
        let dirty = Phase {
            wall_ns: ns,
            counters: lap(&mut clock, &engine),
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
                let ns = engine.run_plans(plans)?;
                Ok(Phase {
                    wall_ns: ns,
                    counters: lap(&mut clock, &engine),
                })
            },
        )?;
        report.iterations.push(it_report);
    }

    say("disabling dirty logging");
    if p.run_vcpus_while_disabling {
        engine.start_background_passes(-1);
    }
    let ns = engine.run_plans(setup.flags_plans(0))?;
    // host_quit: the -e passes finish and every vCPU leaves KVM_RUN (counted in the disable
    // phase, as the threads engine counts it; the phase's time is the VMM's).
    engine.stop_vcpus()?;
    report.disable = Phase {
        wall_ns: ns,
        counters: lap(&mut clock, &engine),
    };
    drop(engine);
    finish_report(&mut report, lost, vm);
    Ok(report)
}
