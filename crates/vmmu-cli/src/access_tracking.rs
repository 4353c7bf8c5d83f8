//! `vmmu access-tracking`: KVM's access_tracking_perf_test (page_idle mode) on the model, one
//! run or both sides of `--aging` with `--compare aging`.

use crate::machine::{
    oracle_exit, parse_backing, run_scenario, AgingArg, HostMachineArgs, RunArgs, Scenario,
};
use clap::ValueEnum;
use std::process::ExitCode;
use vmmu::host::backing::Backing;
use vmmu::kvm::mmu_notifier::Aging;
use vmmu::lab::access_tracking::{
    run_access_tracking_threads, run_access_tracking_virtual, AccessTrackingParams,
    AccessTrackingReport,
};
use vmmu::lab::reclaim::aging_label;
use vmmu::units::parse_size;

/// What `--compare` runs side by side.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum AccessTrackingTechnique {
    /// clear_young under mmu_lock for write, then without it.
    Aging,
}

/// The selftest's flags (-v, -b, -o, -s) and the model's.
#[derive(clap::Args)]
pub struct AccessTrackingArgs {
    /// vCPUs.
    #[arg(short = 'v', default_value_t = 1)]
    vcpus: usize,
    /// Memory per vCPU (e.g. 10M or 3G).
    #[arg(short = 'b', default_value = "1G", value_parser = parse_size)]
    vcpu_bytes: u64,
    /// Every vCPU touches all of the memory (vCPU 0 alone marks it idle).
    #[arg(short = 'o')]
    overlap: bool,
    /// The backing source.
    #[arg(short = 's', default_value = "anonymous", value_parser = parse_backing)]
    backing: Backing,
    /// How KVM's clear_young takes mmu_lock (default locked).
    #[arg(long, value_enum)]
    aging: Option<AgingArg>,
    /// Run both sides of --aging.
    #[arg(long, value_enum)]
    compare: Option<AccessTrackingTechnique>,
    #[command(flatten)]
    machine: HostMachineArgs,
    #[command(flatten)]
    run: RunArgs,
}

/// Runs the command; exit 0, 1 (a run or an oracle failed) or 2 (bad command line).
pub fn access_tracking(args: &AccessTrackingArgs) -> ExitCode {
    let usage = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu access-tracking --help')");
        ExitCode::from(2)
    };
    let mmu = match args.machine.vm_kind() {
        Ok(m) => m,
        Err(e) => return usage(e),
    };
    let base = AccessTrackingParams {
        vcpus: args.vcpus,
        vcpu_bytes: args.vcpu_bytes,
        overlap: args.overlap,
        backing: args.backing,
        aging: args.aging.unwrap_or(AgingArg::Locked).into(),
        mmu,
        guest_mode: args.machine.guest_mode(),
    };
    if let Err(e) = base.validate() {
        return usage(e.to_string());
    }
    if args.compare.is_some() && args.aging.is_some() {
        return usage("--compare aging runs both --aging sides; leave --aging out".into());
    }
    let cost = match args.run.cost_model(|| args.machine.default_cost()) {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let sides: Vec<AccessTrackingParams> = match args.compare {
        None => vec![base.clone()],
        Some(AccessTrackingTechnique::Aging) => [Aging::Locked, Aging::Lockless]
            .into_iter()
            .map(|aging| AccessTrackingParams {
                aging,
                ..base.clone()
            })
            .collect(),
    };
    let scenario = Scenario {
        threads: run_access_tracking_threads,
        virtual_time: run_access_tracking_virtual,
        one: |r: &AccessTrackingReport, counters| r.to_text(counters),
        many: |rs: &[AccessTrackingReport], _| vmmu::lab::access_tracking::compare_text(rs),
    };
    let label = |p: &AccessTrackingParams| format!("--aging {}", aging_label(p.aging));
    let reports = match run_scenario(&sides, &args.run, &cost, label, scenario) {
        Ok(r) => r,
        Err(code) => return code,
    };
    oracle_exit(reports.iter().filter(|r| !r.oracle.passed()).map(|r| {
        format!(
            "access-tracking with --aging {}: {} lost writes, {} invariant violations",
            aging_label(r.params.aging),
            r.oracle.lost_writes,
            r.oracle.invariant_errors.len()
        )
    }))
}
