//! `vmmu reclaim`: seed 003's benchmark (KVM's max_guest_memory_test with a host that runs
//! out of memory and reclaims beside the vCPUs), one run or the seed's three columns with
//! `--compare aging`.

use crate::machine::{oracle_exit, run_scenario, AgingArg, HostMachineArgs, RunArgs, Scenario};
use clap::ValueEnum;
use std::process::ExitCode;
use vmmu::host::lru::LruPolicy;
use vmmu::kvm::mmu_notifier::Aging;
use vmmu::lab::reclaim::{
    aging_label, run_reclaim_threads, run_reclaim_virtual, ReclaimParams, ReclaimReport,
};
use vmmu::units::parse_size;

/// The host's reclaim policy on the command line.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LruArg {
    /// The active/inactive lists (MGLRU off: every kernel, and 6.1+ without
    /// CONFIG_LRU_GEN_ENABLED).
    Classic,
    /// The multi-generational LRU (Linux 6.1+).
    Mglru,
}

/// What `--compare` runs side by side.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReclaimTechnique {
    /// The seed's three columns: MGLRU before (locked), MGLRU with the series (lockless), and
    /// MGLRU off (classic LRU, locked).
    Aging,
}

/// The benchmark's flags (max_guest_memory_test's -c, -m and -s, and the host's).
#[derive(clap::Args)]
pub struct ReclaimArgs {
    /// vCPUs (the selftest's default is 3/4 of the host's CPUs; the seed used 64).
    #[arg(short = 'c', default_value_t = 8)]
    vcpus: usize,
    /// Guest memory: a number of GiB as the selftest takes it (the seed used 256), or a size
    /// with a unit (512M).
    #[arg(short = 'm', default_value = "8", value_parser = parse_gib)]
    max_mem: u64,
    /// Memslot size, GiB or a size with a unit: the size of the one memfd every memslot maps
    /// (the seed: 256, one slot as large as the host's memory).
    #[arg(short = 's', default_value = "8", value_parser = parse_gib)]
    slot_size: u64,
    /// The host's memory, at or below the memfd's size so kswapd works (e.g. 6G).
    #[arg(long, default_value = "6G", value_parser = parse_size)]
    host_memory: u64,
    /// The host's page reclaim (default mglru).
    #[arg(long, value_enum)]
    lru: Option<LruArg>,
    /// How KVM ages its mappings for the host (default locked).
    #[arg(long, value_enum)]
    aging: Option<AgingArg>,
    /// Run the seed's three columns side by side.
    #[arg(long, value_enum)]
    compare: Option<ReclaimTechnique>,
    #[command(flatten)]
    machine: HostMachineArgs,
    #[command(flatten)]
    run: RunArgs,
}

/// `-m` and `-s`: a plain number counts GiB, as the selftest's flags do; a size with a unit
/// (`512M`) is taken as given.
fn parse_gib(s: &str) -> Result<u64, String> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse::<u64>()
            .ok()
            .and_then(|g| g.checked_mul(1 << 30))
            .ok_or_else(|| format!("{s} GiB is too large"));
    }
    parse_size(s).map_err(|e| e.to_string())
}

/// A column's label.
fn label(p: &ReclaimParams) -> String {
    format!("--lru {} --aging {}", p.lru.name(), aging_label(p.aging))
}

/// Runs the command; exit 0, 1 (a run or an oracle failed) or 2 (bad command line).
pub fn reclaim(args: &ReclaimArgs) -> ExitCode {
    let usage = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu reclaim --help')");
        ExitCode::from(2)
    };
    let mmu = match args.machine.vm_kind() {
        Ok(m) => m,
        Err(e) => return usage(e),
    };
    let base = ReclaimParams {
        vcpus: args.vcpus,
        max_mem: args.max_mem,
        slot_size: args.slot_size,
        host_memory: args.host_memory,
        lru: match args.lru.unwrap_or(LruArg::Mglru) {
            LruArg::Classic => LruPolicy::Classic,
            LruArg::Mglru => LruPolicy::Mglru,
        },
        aging: args.aging.unwrap_or(AgingArg::Locked).into(),
        mmu,
        skip_invalidate_for_negative_control: false,
    };
    if let Err(e) = base.validate() {
        return usage(e.to_string());
    }
    if args.compare.is_some() && (args.lru.is_some() || args.aging.is_some()) {
        return usage(
            "--compare aging sets --lru and --aging for each column; leave them out".into(),
        );
    }
    let cost = match args.run.cost_model(|| args.machine.default_cost()) {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let sides: Vec<ReclaimParams> = match args.compare {
        None => vec![base.clone()],
        Some(ReclaimTechnique::Aging) => [
            (LruPolicy::Mglru, Aging::Locked),
            (LruPolicy::Mglru, Aging::Lockless),
            (LruPolicy::Classic, Aging::Locked),
        ]
        .into_iter()
        .map(|(lru, aging)| ReclaimParams {
            lru,
            aging,
            ..base.clone()
        })
        .collect(),
    };
    let scenario = Scenario {
        threads: run_reclaim_threads,
        virtual_time: run_reclaim_virtual,
        one: |r: &ReclaimReport, counters| r.to_text(counters),
        many: vmmu::lab::reclaim::compare_text,
    };
    let reports = match run_scenario(&sides, &args.run, &cost, label, scenario) {
        Ok(r) => r,
        Err(code) => return code,
    };
    oracle_exit(reports.iter().filter(|r| !r.oracle.passed()).map(|r| {
        format!(
            "reclaim with {}: {} lost writes, {} stray writes, {} stale translations, {} pages mapped after munmap, {} invariant violations",
            label(&r.params),
            r.oracle.lost_writes,
            r.oracle.stray_writes,
            r.oracle.stale_translations,
            r.oracle.mapped_after_munmap,
            r.oracle.invariant_errors.len()
        )
    }))
}
