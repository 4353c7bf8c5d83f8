//! `vmmu migrate`: QEMU's pre-copy live migration of a VM whose guests keep working, with the
//! guests' slowdown over time against the same run without migration (seed 001's metric);
//! `--compare FEATURE` runs each side of a technique.

use crate::machine::{
    oracle_exit, run_scenario, Engine, MachineArgs, RunArgs, Scenario, Technique,
};
use std::path::PathBuf;
use std::process::ExitCode;
use vmmu::lab::migrate::{
    compare_text, plot_timeline_svg, run_migrate_threads, run_migrate_virtual, MigrateParams,
    MigrateReport, CLEAR_BITMAP_SHIFT_DEFAULT,
};
use vmmu::lab::params::DirtyLogParams;
use vmmu::units::parse_size;

/// The command's flags: the VM and its guests (dirty_log_perf_test's where they mean the
/// same), the migration, and the machine.
#[derive(clap::Args)]
pub struct MigrateArgs {
    /// vCPUs.
    #[arg(short = 'v', default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::params::KVM_MAX_VCPUS as i64))]
    vcpus: u32,
    /// Guest memory per vCPU (each vCPU owns its part), e.g. 1G.
    #[arg(short = 'b', default_value = "1G", value_parser = parse_size)]
    vcpu_bytes: u64,
    /// The part of its memory each vCPU keeps touching, from the start of its part (default:
    /// all of it, memstress's loop); the rest is written once, when memory is populated.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    working_set: Option<u64>,
    /// Percentage of the guests' accesses that write (0-100).
    #[arg(short = 'w', default_value_t = 100, value_parser = clap::value_parser!(u32).range(0..=100))]
    write_percent: u32,
    /// Nanoseconds each guest computes before each access (0: memstress, which only accesses
    /// memory).
    #[arg(long, default_value_t = 0, value_name = "NS")]
    think_ns: u32,
    /// Access the working set in random order.
    #[arg(short = 'a')]
    random_access: bool,
    /// The guests' random seed.
    #[arg(short = 'r', default_value_t = 1)]
    seed: u32,
    /// Split guest memory into this many memslots.
    #[arg(short = 'x', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    slots: u32,
    /// Do not enable KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 (QEMU before 4.2): each GET re-protects
    /// what it returns, and there is no CLEAR.
    #[arg(short = 'g')]
    no_manual_protect: bool,
    /// The link's bandwidth: a number with Gbit, Mbit, Kbit or bit (per second; `/s` or `ps`
    /// may follow), or with GB, MB, KB (bytes, powers of 1000) or GiB, MiB, KiB.
    #[arg(long, default_value = "10Gbit", value_parser = parse_bandwidth)]
    bandwidth: u64,
    /// QEMU's downtime-limit: stop-and-copy starts once what is dirty can be sent within it
    /// (a duration: 300ms, 1s, 500us).
    #[arg(long, default_value = "300ms", value_parser = parse_duration)]
    downtime: u64,
    /// Rounds after the bulk one before stop-and-copy is forced (QEMU has no limit and goes on
    /// while the guest dirties memory faster than the link carries it).
    #[arg(long, default_value_t = 10)]
    max_rounds: u32,
    /// QEMU's auto-converge capability: when the guests dirty more than half of what the link
    /// carries in two sync periods (of at least a second) in a row, every vCPU is throttled:
    /// 20 %, then 10 % more each time, up to 99 % (QEMU's defaults).
    #[arg(long)]
    auto_converge: bool,
    /// Log dirty pages into per-vCPU rings of N entries (KVM_CAP_DIRTY_LOG_RING, Linux 5.11+;
    /// QEMU 6.1+'s dirty-ring-size; a power of two, 256-65536) instead of bitmaps: a vCPU whose ring
    /// reaches its soft limit exits (KVM_EXIT_DIRTY_RING_FULL) and waits for the rings to be
    /// reaped and reset; the reaper also runs once a second, and every sync reaps. Manual
    /// protect is off with it, as in QEMU.
    #[arg(long, value_name = "N")]
    dirty_ring: Option<u32>,
    /// The width of the progress buckets the slowdown is measured in.
    #[arg(long, default_value = "100ms", value_parser = parse_duration)]
    bucket: u64,
    /// How long the guests run before the migration starts (a multiple of --bucket).
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    warmup: u64,
    /// QEMU's clear-bitmap-shift (4.2+): each KVM_CLEAR_DIRTY_LOG covers 2^N pages (6-31,
    /// default 18; 31 clears a whole memslot at once, as a VMM without lazy clearing does).
    #[arg(long, value_name = "N")]
    clear_bitmap_shift: Option<u32>,
    /// Run each side of a technique and print them side by side.
    #[arg(long, value_enum)]
    compare: Option<MigrateTechnique>,
    /// Print one line per bucket: the guests' accesses, the baseline's, the slowdown and the
    /// migration's phase.
    #[arg(long)]
    timeline: bool,
    /// Draw the guests' throughput over time (percent of the run without migration) with the
    /// migration's phases marked into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// The machine: architecture, MMU, CPU features, KVM's switches, engine, output.
    #[command(flatten)]
    m: MachineArgs,
}

/// What `vmmu migrate --compare` runs side by side: the MMU's techniques, and the VMM's.
#[derive(Copy, Clone, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MigrateTechnique {
    /// Eager page splitting off and on.
    EagerSplit,
    /// arm64's mmu_lock regimes: spin, perm-fast-path-v2, perm-fast-path, parallel.
    Arm64Lock,
    /// arm64 without and with FEAT_TLBIRANGE.
    TlbiRange,
    /// x86 with EPT: write protection and Intel's PML.
    Pml,
    /// Dirty bitmaps (GET/CLEAR) and the dirty ring (--dirty-ring N entries, default 4096).
    DirtyRing,
    /// Auto-converge off and on.
    AutoConverge,
}

impl MigrateTechnique {
    /// The MMU technique of `--compare`, which the machine flags know how to vary.
    fn mmu_technique(self) -> Option<Technique> {
        match self {
            MigrateTechnique::EagerSplit => Some(Technique::EagerSplit),
            MigrateTechnique::Arm64Lock => Some(Technique::Arm64Lock),
            MigrateTechnique::TlbiRange => Some(Technique::TlbiRange),
            MigrateTechnique::Pml => Some(Technique::Pml),
            MigrateTechnique::DirtyRing | MigrateTechnique::AutoConverge => None,
        }
    }
}

/// QEMU's commonly used `dirty-ring-size`, the ring side of `--compare dirty-ring` without
/// `--dirty-ring`.
const DEFAULT_DIRTY_RING: u32 = 4096;

/// `--bandwidth`: bits per second.
fn parse_bandwidth(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("ps"))
        .unwrap_or(t);
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        format!("{s:?} is not a bandwidth: use a number and a unit such as 10Gbit, 100Mbit, 1.25GB/s or 1GiB/s")
    };
    let value: f64 = num.parse().map_err(|_| bad())?;
    let bits_per_unit: f64 = match unit.trim() {
        "Gbit" | "Gb" | "G" => 1e9,
        "Mbit" | "Mb" | "M" => 1e6,
        "Kbit" | "Kb" | "kbit" | "K" | "k" => 1e3,
        "bit" | "b" => 1.0,
        "GB" => 8e9,
        "MB" => 8e6,
        "KB" | "kB" => 8e3,
        "GiB" => 8.0 * (1u64 << 30) as f64,
        "MiB" => 8.0 * (1u64 << 20) as f64,
        "KiB" => 8.0 * 1024.0,
        _ => return Err(bad()),
    };
    let bps = (value * bits_per_unit).round();
    if !bps.is_finite() || bps >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bps as u64)
}

/// A duration: a number with ns, us, ms or s.
fn parse_duration(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || format!("{s:?} is not a duration: use a number and ns, us, ms or s (300ms, 1s)");
    let value: f64 = num.parse().map_err(|_| bad())?;
    let ns_per_unit = match unit {
        "ns" => 1.0,
        "us" => 1e3,
        "ms" => 1e6,
        "s" => 1e9,
        _ => return Err(bad()),
    };
    let ns = (value * ns_per_unit).round();
    if !ns.is_finite() || ns >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(ns as u64)
}

impl MigrateArgs {
    /// The run's parameters, before `--compare` varies them.
    fn params(&self) -> Result<MigrateParams, String> {
        Ok(MigrateParams {
            vm: self.m.vm_params(DirtyLogParams {
                vcpus: self.vcpus as usize,
                vcpu_memory_bytes: self.vcpu_bytes,
                iterations: 1,
                write_percent: self.write_percent,
                manual_protect: !self.no_manual_protect,
                slots: self.slots as usize,
                random_access: self.random_access,
                random_seed: self.seed,
                ..Default::default()
            })?,
            working_set_bytes: self.working_set.unwrap_or(self.vcpu_bytes),
            think_ns: self.think_ns,
            bandwidth_bps: self.bandwidth,
            downtime_ns: self.downtime,
            max_rounds: self.max_rounds,
            bucket_ns: self.bucket,
            warmup_ns: self.warmup,
            clear_bitmap_shift: self
                .clear_bitmap_shift
                .unwrap_or(CLEAR_BITMAP_SHIFT_DEFAULT),
            baseline: true,
            auto_converge: self.auto_converge,
            dirty_ring: self.dirty_ring,
            faults: Default::default(),
        })
    }
}

/// Runs the command; exit 0, 1 (a run or the oracle failed) or 2 (bad command line).
pub fn migrate(args: &MigrateArgs) -> ExitCode {
    let usage = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu migrate --help')");
        ExitCode::from(2)
    };
    let engine = args.m.engine.unwrap_or(Engine::Virtual);
    let mmu_compare = args.compare.and_then(MigrateTechnique::mmu_technique);
    if let Err(e) = args.m.check(mmu_compare, engine) {
        return usage(e);
    }
    if args.compare == Some(MigrateTechnique::AutoConverge) && args.auto_converge {
        return usage("--compare auto-converge runs both sides; leave out --auto-converge".into());
    }
    let base = match args
        .params()
        .and_then(|p| p.validate().map(|_| p).map_err(String::from))
    {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    let run = RunArgs {
        engine,
        cost_model: args.m.cost_model.clone(),
        json: args.m.json,
        no_counters: args.m.no_counters,
        quiet: args.m.quiet,
        jobs: args.m.jobs,
    };
    let cost = match args.m.cost_model() {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let sides: Vec<(String, MigrateParams)> = match args.compare {
        Some(MigrateTechnique::DirtyRing) => vec![
            (
                "dirty bitmap".to_string(),
                MigrateParams {
                    dirty_ring: None,
                    ..base.clone()
                },
            ),
            (
                "dirty ring".to_string(),
                MigrateParams {
                    dirty_ring: Some(base.dirty_ring.unwrap_or(DEFAULT_DIRTY_RING)),
                    ..base.clone()
                },
            ),
        ],
        Some(MigrateTechnique::AutoConverge) => [false, true]
            .into_iter()
            .map(|on| {
                let name = if on {
                    "auto-converge on"
                } else {
                    "auto-converge off"
                };
                (
                    name.to_string(),
                    MigrateParams {
                        auto_converge: on,
                        ..base.clone()
                    },
                )
            })
            .collect(),
        _ => args
            .m
            .sides(mmu_compare, base.vm.mmu, base.vm.eager_split, base.vm.pml)
            .into_iter()
            .map(|s| {
                let mut p = base.clone();
                p.vm.mmu = s.mmu;
                p.vm.eager_split = s.eager_split;
                p.vm.pml = s.pml;
                (s.name, p)
            })
            .collect(),
    };
    if let Some((_, p)) = sides.iter().find(|(_, p)| p.validate().is_err()) {
        return usage(p.validate().unwrap_err().to_string());
    }
    if args.clear_bitmap_shift.is_some()
        && (args.no_manual_protect || args.dirty_ring.is_some())
        && args.compare != Some(MigrateTechnique::DirtyRing)
    {
        return usage(
            "--clear-bitmap-shift sizes KVM_CLEAR_DIRTY_LOG calls, which -g and --dirty-ring do not make"
                .into(),
        );
    }
    if let Some(path) = &args.plot {
        if let Err(e) = std::fs::File::create(path) {
            return usage(format!("cannot write the chart to {}: {e}", path.display()));
        }
    }
    let timeline = args.timeline;
    let name_side = |name: &str, mut r: MigrateReport| {
        r.side = name.to_string();
        r
    };
    let scenario = Scenario {
        threads: |(name, p): &(String, MigrateParams), progress| {
            run_migrate_threads(p, progress).map(|r| name_side(name, r))
        },
        virtual_time: |(name, p): &(String, MigrateParams),
                       cost: &vmmu::cost::CostModel,
                       progress| {
            run_migrate_virtual(p, cost, progress).map(|r| name_side(name, r))
        },
        one: |r: &MigrateReport, counters| r.to_text(counters, timeline),
        many: |rs: &[MigrateReport], _| compare_text(rs),
    };
    let reports = match run_scenario(
        &sides,
        &run,
        &cost,
        |(name, p)| format!("{} vCPUs {name}", p.vm.vcpus),
        scenario,
    ) {
        Ok(r) => r,
        Err(code) => return code,
    };
    if let Some(path) = &args.plot {
        let title = format!(
            "live migration: {} vCPUs x {} MiB, {}, {}",
            base.vm.vcpus,
            base.vm.vcpu_memory_bytes >> 20,
            args.m.describe(base.vm.mmu, mmu_compare),
            vmmu::lab::migrate::fmt_bandwidth(base.bandwidth_bps)
        );
        if let Err(e) = plot_timeline_svg(path, &title, &reports) {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    }
    oracle_exit(reports.iter().filter_map(|r| {
        r.oracle_failure().map(|e| {
            if r.side.is_empty() {
                e
            } else {
                format!("{}: {e}", r.side)
            }
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_and_durations_parse_with_their_units() {
        assert_eq!(parse_bandwidth("10Gbit").unwrap(), 10_000_000_000);
        assert_eq!(parse_bandwidth("10Gbit/s").unwrap(), 10_000_000_000);
        assert_eq!(parse_bandwidth("25Gbps").unwrap(), 25_000_000_000);
        assert_eq!(parse_bandwidth("1.25GB/s").unwrap(), 10_000_000_000);
        assert_eq!(parse_bandwidth("128MiB/s").unwrap(), 1_073_741_824);
        assert!(parse_bandwidth("fast").is_err());
        assert!(parse_bandwidth("10").is_err());
        assert_eq!(parse_bandwidth("0Gbit").unwrap(), 0);
        assert_eq!(parse_duration("300ms").unwrap(), 300_000_000);
        assert_eq!(parse_duration("1.5s").unwrap(), 1_500_000_000);
        assert_eq!(parse_duration("250us").unwrap(), 250_000);
        assert!(parse_duration("300").is_err());
        assert!(parse_duration("ms").is_err());
    }
}
