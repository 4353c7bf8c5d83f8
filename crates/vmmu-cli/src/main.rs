//! `vmmu`: run the lab's scenarios against the model MMU (or a real `/dev/kvm`).
//!
//! Exit codes: 0 success, 1 a run failed (an oracle found lost pages or broken invariants, or the
//! run could not complete), 2 bad command line.

mod access_tracking;
mod calibrate;
mod fit;
mod lock_bench;
mod machine;
mod migrate;
mod nested_churn;
mod page_table;
mod reclaim;
mod soak;

use crate::machine::OnOff;
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};
use machine::{
    oracle_exit, print_json, Arch, Engine, HostPreemptArg, MachineArgs, MmuKind, Technique,
};
use std::path::PathBuf;
use std::process::ExitCode;
use vmmu::lab::dirty_log::oracle_failure;
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::{DirtyLogReport, PhaseEvent, PhaseSink};
use vmmu::lab::sweep::run_points;
use vmmu::units::parse_size;

#[derive(Parser)]
#[command(
    name = "vmmu",
    version,
    about = "KVM's MMU in user space, and a lab that runs KVM's benchmarks against it"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Virtual time: run a vCPU's private accesses (within gfns its guest keeps to itself,
    /// through tables its walks complete in) out of turn, up to the next step any other actor
    /// could see (on), or step every actor in turn (off, the reference). Both give the same
    /// results, byte for byte.
    #[arg(long, global = true, value_enum, default_value = "on")]
    fast_forward: OnOff,
}

#[derive(Subcommand)]
enum Command {
    /// dirty_log_perf_test: populate, enable dirty logging, dirty/get/clear iterations, disable.
    DirtyLog(DirtyLogArgs),
    /// kvm_page_table_test: create mappings, update them with dirty logging on, adjust them
    /// back to blocks, unmap the VM (seed 002's --backward-pages and table with --compare).
    PageTable(page_table::PageTableArgs),
    /// Seed 004's benchmark: L2 guests booted and destroyed repeatedly under an L1 hypervisor
    /// (nested EPT on the shadow MMU), with boot time, stale shadow pages per round and the
    /// cost of deleting memslot 0 at the end; --compare zap-orphans runs both sides.
    NestedChurn(nested_churn::NestedChurnArgs),
    /// Seed 003's benchmark: max_guest_memory_test (-c vCPUs, -m guest GiB, -s slot GiB) on a
    /// host with less memory than the guest (--host-memory), kswapd reclaiming beside the
    /// vCPUs through KVM's MMU notifier; --compare aging prints the seed's three columns.
    Reclaim(reclaim::ReclaimArgs),
    /// access_tracking_perf_test: populate, write and read guest memory, then mark it idle
    /// through page_idle (KVM's clear_young per page) and touch it again, twice; --compare
    /// aging runs clear_young under mmu_lock and without it.
    AccessTracking(access_tracking::AccessTrackingArgs),
    /// QEMU's pre-copy live migration while the guests keep working: enable dirty logging, send
    /// all memory, rounds of GET/CLEAR and send at --bandwidth until the rest fits --downtime,
    /// stop-and-copy; the destination must equal the source, and the guests' slowdown over time
    /// (>99/50/10 % spans) is measured against the same run without migration.
    Migrate(migrate::MigrateArgs),
    /// Random small configurations of every subcommand and switch, each run with every oracle
    /// on as its own process, several at a time, for --minutes; prints each failure (oracle
    /// failure, run failed, panic, crash, hang, bad configuration, unexpected exit code) with
    /// the command line that reproduces it, and the runs per subcommand.
    Soak(soak::SoakArgs),
    /// The virtual-time mmu_lock model alone: cores taking the queued rwlock or spinlock in a
    /// read/write mix; acquisitions per second, hand-off latency and line transfers by step,
    /// beside the published qrwlock figure it can be checked against.
    LockBench(lock_bench::LockBenchArgs),
    /// The tables, CSV and chart of a dirty-log sweep run as separate jobs
    /// (`vmmu dirty-log ... --emit-jobs DIR`), from the JSON reports the jobs wrote.
    Tables(TablesArgs),
    /// Measure this machine's per-unit software costs by timing the model's code, and write a
    /// cost model file (run it from a release build: cargo run --release -p vmmu-cli -- calibrate).
    Calibrate(calibrate::CalibrateArgs),
    /// Fit the hardware costs no source gives to a real host's selftest output (files headed
    /// `# cmd: ./SELFTEST ARGS`), and report how well the fitted model predicts each timing,
    /// leave-one-out; --out writes the fitted cost model.
    Fit(fit::FitArgs),
}

#[derive(clap::Args)]
struct TablesArgs {
    /// The jobs' JSON reports, in the order the jobs were emitted (their names sort that way).
    #[arg(required = true, value_name = "FILE")]
    files: Vec<PathBuf>,
    /// Print every table as CSV rows instead.
    #[arg(long)]
    csv: bool,
    /// Also draw the dirty memory time against vCPUs into FILE.svg.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Leave out the per-phase counters (a sweep without --compare prints each run's text).
    #[arg(long)]
    no_counters: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The modelled MMU (this project's KVM).
    Model,
    /// The host's real /dev/kvm.
    Kvm,
}

#[derive(clap::Args)]
struct DirtyLogArgs {
    /// Number of vCPUs.
    #[arg(short = 'v', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::params::KVM_MAX_VCPUS as i64))]
    vcpus: u32,
    /// Memory each vCPU dirties, e.g. 10M or 3G.
    #[arg(short = 'b', default_value = "1G", value_parser = parse_size)]
    vcpu_bytes: u64,
    /// Dirty-memory iterations (each one harvest the completeness oracle checks: at most
    /// 8,388,606).
    #[arg(short = 'i', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::oracle::MAX_HARVESTS as i64))]
    iterations: u32,
    /// Percentage of accesses that write (0-100).
    #[arg(short = 'w', default_value_t = 100, value_parser = clap::value_parser!(u32).range(0..=100))]
    write_percent: u32,
    /// Do not enable KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2: GET clears the log and writes are tracked
    /// from the moment logging is enabled.
    #[arg(short = 'g')]
    no_manual_protect: bool,
    /// Split the test memory into this many memslots.
    #[arg(short = 'x', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    slots: u32,
    /// Access pages in random order.
    #[arg(short = 'a')]
    random_access: bool,
    /// Overlap vCPU memory accesses instead of partitioning them.
    #[arg(short = 'o')]
    overlap: bool,
    /// Random seed.
    #[arg(short = 'r', default_value_t = 1)]
    seed: u32,
    /// Keep vCPUs running while dirty logging is disabled.
    #[arg(short = 'e')]
    run_while_disabling: bool,
    /// The selftest's CPU list to pin the vCPU threads to. Accepted for command-line
    /// compatibility; it changes nothing in the model (the threads engine does not pin, and
    /// the virtual-time engine places vCPUs on the cost model's host itself).
    #[arg(short = 'c', value_name = "CPUS")]
    pin_cpus: Option<String>,
    /// The selftest's nested mode (the vCPUs run an L2 guest). Not modelled: refused.
    #[arg(short = 'n')]
    nested: bool,
    /// What runs the scenario: the model, or the host's /dev/kvm.
    #[arg(long, value_enum, default_value = "model")]
    backend: Backend,
    /// With --backend kvm: harvest through KVM_CAP_DIRTY_LOG_RING rings of N entries per vCPU.
    #[arg(long, value_name = "N")]
    dirty_ring: Option<u32>,
    /// Sweep these vCPU counts (e.g. 2,4,8,16,32,64) instead of -v.
    #[arg(long = "vcpus", value_name = "LIST", value_delimiter = ',', conflicts_with = "vcpus", value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::params::KVM_MAX_VCPUS as i64))]
    vcpu_list: Option<Vec<u32>>,
    /// Run every configuration with the technique off and on, and print the seed-style tables.
    #[arg(long, value_enum)]
    compare: Option<Technique>,
    /// With --compare: draw the dirty memory time (iteration 2, or 1 with -i 1) against vCPUs
    /// into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// With --compare: print every table as CSV rows (line,vcpus,side,value; times in seconds)
    /// instead of the text tables.
    #[arg(long)]
    csv: bool,
    /// With a sweep (--vcpus LIST and/or --compare): run nothing, print one command line per
    /// sweep point instead, each writing its JSON report into DIR (for GNU parallel, a Slurm
    /// array or any batch system); `vmmu tables DIR/*.json` then prints the sweep's tables.
    #[arg(long, value_name = "DIR")]
    emit_jobs: Option<PathBuf>,
    /// Print one JSON object per line as each phase ends (populate, enable, each iteration,
    /// disable), then one with the oracle's verdict, instead of the text.
    #[arg(long)]
    json_lines: bool,
    /// Write the JSON report to FILE instead of stdout (implies --json).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// The comparison an emitted job belongs to (set by --emit-jobs).
    #[arg(long, hide = true, value_name = "TECHNIQUE")]
    sweep_technique: Option<String>,
    /// The column an emitted job fills (set by --emit-jobs).
    #[arg(long, hide = true, value_name = "NAME")]
    sweep_column: Option<String>,
    /// The machine: architecture, MMU, CPU features, KVM's switches, engine, output.
    #[command(flatten)]
    m: MachineArgs,
}

impl DirtyLogArgs {
    fn params(&self) -> Result<DirtyLogParams, String> {
        self.m.vm_params(DirtyLogParams {
            vcpus: self.vcpus as usize,
            vcpu_memory_bytes: self.vcpu_bytes,
            iterations: self.iterations,
            write_percent: self.write_percent,
            manual_protect: !self.no_manual_protect,
            slots: self.slots as usize,
            random_access: self.random_access,
            partition: !self.overlap,
            random_seed: self.seed,
            run_vcpus_while_disabling: self.run_while_disabling,
            ..Default::default()
        })
    }
}

/// Runs one configuration on the chosen backend and engine, telling `sink` of each phase as
/// it ends.
fn run_one(
    args: &DirtyLogArgs,
    p: &DirtyLogParams,
    engine: Engine,
    cost: &vmmu::cost::CostModel,
    progress: bool,
    sink: &mut dyn PhaseSink,
) -> Result<DirtyLogReport, String> {
    use vmmu::lab::dirty_log_model::{
        run_dirty_log_threads_streamed, run_dirty_log_virtual_streamed,
    };
    match args.backend {
        Backend::Model => match engine {
            Engine::Threads => Ok(run_dirty_log_threads_streamed(p, progress, sink)?),
            Engine::Virtual => Ok(run_dirty_log_virtual_streamed(p, cost, progress, sink)?),
        },
        Backend::Kvm => vmmu_kvm::run_dirty_log_streamed(
            p,
            &vmmu_kvm::KvmOptions {
                dirty_ring: args.dirty_ring,
                progress,
            },
            sink,
        )
        .map_err(|e| e.to_string()),
    }
}

/// Prints a single run as it goes: the selftest's lines of each phase as it ends, or with
/// `--json-lines` one JSON object per phase.
struct Streamer {
    json_lines: bool,
    with_counters: bool,
    header_done: bool,
}

impl PhaseSink for Streamer {
    fn phase(&mut self, report: &DirtyLogReport, event: PhaseEvent<'_>) {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        if self.json_lines {
            let mut v = match event {
                PhaseEvent::Iteration(it) => serde_json::to_value(it),
                PhaseEvent::Populate(ph) | PhaseEvent::Enable(ph) | PhaseEvent::Disable(ph) => {
                    serde_json::to_value(ph)
                }
            }
            .unwrap_or_default();
            if let Some(o) = v.as_object_mut() {
                o.insert("phase".into(), event.name().into());
                if !self.with_counters {
                    o.remove("counters");
                    for k in ["dirty", "get", "clear"] {
                        if let Some(ph) = o.get_mut(k).and_then(|p| p.as_object_mut()) {
                            ph.remove("counters");
                        }
                    }
                }
            }
            let _ = writeln!(out, "{v}");
        } else {
            if !self.header_done {
                let _ = write!(out, "{}", report.header_text());
                self.header_done = true;
            }
            let _ = write!(out, "{}", event.selftest_text(self.with_counters));
        }
        let _ = out.flush();
    }

    fn keeps_iteration_counters(&self) -> bool {
        false
    }
}

/// Checks the combinations of options; a usage error is one line and exit 2.
fn check_options(args: &DirtyLogArgs, engine: Engine, sweep: bool) -> Result<(), String> {
    if args.m.arch == Arch::Arm64 && args.backend == Backend::Kvm {
        return Err("--backend kvm --arch arm64: this host is x86, its /dev/kvm runs x86 guests only; arm64 runs on the model (real KVM/arm64 is the reference in the QEMU anchor, see README)".into());
    }
    args.m.check(args.compare, engine)?;
    if args.nested {
        return Err("-n: dirty_log_perf_test's nested (L2) mode is not modelled; run without -n (nested guests run in 'vmmu nested-churn')".into());
    }
    if args.backend == Backend::Model && args.dirty_ring.is_some() {
        return Err("--dirty-ring is only supported with --backend kvm".into());
    }
    if let Some(n) = args.dirty_ring {
        let max = vmmu::vm::KVM_DIRTY_RING_MAX_ENTRIES;
        if !n.is_power_of_two() || !(256..=max).contains(&n) {
            return Err(format!(
                "--dirty-ring {n}: the ring size must be a power of two between 256 and {max} entries"
            ));
        }
    }
    if let Some(list) = &args.vcpu_list {
        let mut seen = std::collections::BTreeSet::new();
        if let Some(d) = list.iter().find(|&&n| !seen.insert(n)) {
            return Err(format!(
                "--vcpus: {d} is listed twice; give each vCPU count once"
            ));
        }
    }
    if args.backend == Backend::Kvm && (sweep || args.m.engine.is_some()) {
        return Err("--backend kvm runs one configuration on the host: --vcpus, --compare and --engine apply to the model".into());
    }
    if args.backend == Backend::Kvm
        && (args.m.tdp_split_alloc.is_some() || args.m.host_preempt != HostPreemptArg::Full)
    {
        return Err("--backend kvm runs on this host's kernel: --host-preempt and --tdp-split-alloc apply to the model".into());
    }
    if args.backend == Backend::Kvm && args.m.pml.is_some() {
        return Err("--backend kvm uses the host's KVM, whose enable_pml module parameter decides; --pml applies to the model".into());
    }
    if args.backend == Backend::Kvm && args.m.mmu_kind() != MmuKind::Tdp {
        return Err("--backend kvm uses the host's MMU (its tdp_mmu and ept module parameters); --mmu and --ept apply to the model".into());
    }
    if args.csv && (args.compare.is_none() || args.m.json) {
        return Err(
            "--csv prints a comparison's tables: add --compare, and leave out --json".into(),
        );
    }
    if args.plot.is_some() && args.compare.is_none() {
        return Err("--plot draws a comparison: add --compare eager-split (or arm64-lock)".into());
    }
    if args.emit_jobs.is_some() && (!sweep || engine != Engine::Virtual) {
        return Err("--emit-jobs splits a virtual-time sweep into jobs: add --vcpus LIST or --compare, and leave out --engine threads".into());
    }
    if args.emit_jobs.is_some() && (args.plot.is_some() || args.csv || args.out.is_some()) {
        return Err(
            "--emit-jobs only prints the jobs: --plot, --csv and --out belong to 'vmmu tables'"
                .into(),
        );
    }
    if args.json_lines && (sweep || args.m.json || args.out.is_some()) {
        return Err("--json-lines streams one run's phases: leave out --vcpus, --compare, --json and --out (a sweep prints --json, or splits into jobs with --emit-jobs)".into());
    }
    if args.out.is_some() && sweep {
        return Err("--out writes one run's report: a sweep prints to stdout (or split it with --emit-jobs DIR)".into());
    }
    Ok(())
}

/// The command line of each point of a sweep (`--emit-jobs DIR`): this command's own arguments
/// without the sweep's (`--vcpus`, `--compare`, the output and engine options), then the
/// point's vCPU count and side, virtual time, and its JSON report into `DIR/point-NNNN.json`.
fn emit_jobs(
    dir: &std::path::Path,
    compare: Option<Technique>,
    points: &[(String, DirtyLogParams)],
) -> Vec<String> {
    // Options of this command that the jobs set themselves (with the value they take, if any).
    const DROP: &[(&str, bool)] = &[
        ("--vcpus", true),
        ("--compare", true),
        ("--emit-jobs", true),
        ("--jobs", true),
        ("--engine", true),
        ("--plot", true),
        ("--out", true),
        ("--csv", false),
        ("--json", false),
        ("--quiet", false),
        ("--eager-split", true),
        ("--pml", true),
        ("--arm64-lock", true),
        ("--tlbi-range", true),
    ];
    let argv: Vec<String> = std::env::args().collect();
    let mut base = vec![argv[0].clone()];
    let mut i = 1;
    while i < argv.len() {
        let a = &argv[i];
        let name = a.split('=').next().unwrap_or(a);
        match DROP.iter().find(|(d, _)| *d == name) {
            Some((_, takes_value)) => {
                i += if *takes_value && !a.contains('=') {
                    2
                } else {
                    1
                }
            }
            None => {
                base.push(a.clone());
                i += 1;
            }
        }
    }
    let quote = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    points
        .iter()
        .enumerate()
        .map(|(k, (column, q))| {
            let mut line: Vec<String> = base.iter().map(|a| quote(a)).collect();
            line.push(format!("-v {}", q.vcpus));
            let on_off = |b: bool| if b { "on" } else { "off" };
            match compare {
                Some(Technique::EagerSplit) => {
                    line.push(format!("--eager-split {}", on_off(q.eager_split)))
                }
                Some(Technique::Pml) => line.push(format!("--pml {}", on_off(q.pml))),
                Some(Technique::Arm64Lock) | Some(Technique::TlbiRange) => {
                    if let vmmu::vm::MmuKind::Stage2 { lock, cpu, .. } = q.mmu {
                        line.push(format!("--arm64-lock {}", lock.name()));
                        line.push(format!("--tlbi-range {}", on_off(cpu.tlbi_range)));
                    }
                }
                None => {}
            }
            let technique = compare
                .and_then(|t| t.to_possible_value())
                .map_or(String::new(), |v| v.get_name().to_string());
            line.push(format!(
                "--engine virtual --quiet --sweep-technique {} --sweep-column {} --out {}",
                quote(&technique),
                quote(column),
                quote(&dir.join(format!("point-{k:04}.json")).display().to_string())
            ));
            line.join(" ")
        })
        .collect()
}

fn dirty_log(args: &DirtyLogArgs) -> ExitCode {
    let p = match args
        .params()
        .and_then(|p| p.validate().map(|_| p).map_err(String::from))
    {
        Ok(p) => p,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(2);
        }
    };
    // Sorted and de-duplicated, so tables and charts read left to right.
    let mut counts = args
        .vcpu_list
        .clone()
        .unwrap_or_else(|| vec![p.vcpus as u32]);
    counts.sort_unstable();
    counts.dedup();
    let sweep = args.vcpu_list.is_some() || args.compare.is_some();
    // Virtual time is the default for sweeps: a 2-core machine cannot show 64 vCPUs in threads.
    let engine = args.m.engine.unwrap_or(if sweep {
        Engine::Virtual
    } else {
        Engine::Threads
    });
    if let Err(e) = check_options(args, engine, sweep) {
        eprintln!("vmmu: {e}");
        return ExitCode::from(2);
    }
    let cost = match args.m.cost_model() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(2);
        }
    };
    let progress = !args.m.quiet;
    let sides = args.m.sides(args.compare, p.mmu, p.eager_split, p.pml);
    // Every point of the sweep, in table order; every configuration is checked before the
    // first one runs.
    let points = match vmmu::lab::sweep::dirty_log_points(&p, &counts, &sides) {
        Ok(points) => points,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(path) = &args.plot {
        if let Err(e) = std::fs::File::create(path) {
            eprintln!("vmmu: cannot write the chart to {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    if let Some(dir) = &args.emit_jobs {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("vmmu: cannot create {}: {e}", dir.display());
            return ExitCode::from(2);
        }
        for line in emit_jobs(dir, args.compare, &points) {
            println!("{line}");
        }
        return ExitCode::SUCCESS;
    }
    // One run printed as text or JSON lines: each phase is printed as it ends.
    if points.len() == 1 && !args.m.json && args.out.is_none() {
        return stream_one(args, &points[0].1, engine, &cost, progress);
    }
    let reports = match run_points(
        &points,
        machine::jobs(args.m.jobs, engine),
        |(_, q)| q.vcpus as u64,
        |(side, q)| {
            format!(
                "{} vCPUs{}{side}",
                q.vcpus,
                if side.is_empty() { "" } else { ", " }
            )
        },
        progress,
        |(_, q)| run_one(args, q, engine, &cost, progress && !sweep, &mut ()),
    ) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    };
    let mut reports = reports;
    let columns: Vec<&str> = sides.iter().map(|s| s.name.as_str()).collect();
    let runs = if args.compare.is_some() {
        vmmu::lab::sweep::by_vcpus(&reports, sides.len())
    } else {
        Vec::new()
    };
    let mmu_desc = args.m.describe(p.mmu, args.compare);
    let config = vmmu::lab::compare::config_line(engine == Engine::Virtual, &mmu_desc, &p);
    // A job of a sweep split by --emit-jobs: the report says where it belongs. The table's
    // header describes the MMU without the compared technique, as the whole sweep's does.
    if let (Some(technique), Some(column)) = (&args.sweep_technique, &args.sweep_column) {
        let compared = Technique::from_str(technique, false).ok();
        let mmu_desc = args.m.describe(p.mmu, compared);
        let config = config.replacen(&args.m.describe(p.mmu, args.compare), &mmu_desc, 1);
        for r in &mut reports {
            r.sweep = Some(vmmu::lab::report::SweepPoint {
                technique: technique.clone(),
                column: column.clone(),
                config: config.clone(),
            });
        }
    }
    if let Some(path) = &args.out {
        let json = match serde_json::to_string_pretty(&reports[0]) {
            Ok(j) => j,
            Err(e) => {
                eprintln!("vmmu: {e}");
                return ExitCode::from(1);
            }
        };
        if let Err(e) = std::fs::write(path, json + "\n") {
            eprintln!("vmmu: cannot write {}: {e}", path.display());
            return ExitCode::from(1);
        }
    } else if args.m.json {
        if let Err(code) = print_json(&reports, !args.m.no_counters) {
            return code;
        }
    } else if let Some(t) = args.compare {
        print_comparison(t, p.iterations, &config, &columns, &runs, args.csv);
    } else {
        print_runs(&reports, !args.m.no_counters);
    }
    // The chart is drawn whatever the text output (the path was checked before the runs).
    if let Some(path) = &args.plot {
        if let Err(e) = plot_comparison(path, p.iterations, &config, &columns, &runs) {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    }
    oracle_exit(reports.iter().filter_map(|r| {
        oracle_failure(&r.oracle).map(|m| format!("{} vCPUs: {m}", r.params.vcpus))
    }))
}

/// One run, each phase printed as it ends (text or JSON lines), then the oracle's verdict.
fn stream_one(
    args: &DirtyLogArgs,
    p: &DirtyLogParams,
    engine: Engine,
    cost: &vmmu::cost::CostModel,
    progress: bool,
) -> ExitCode {
    let mut streamer = Streamer {
        json_lines: args.json_lines,
        with_counters: !args.m.no_counters,
        header_done: false,
    };
    let r = match run_one(args, p, engine, cost, progress, &mut streamer) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    };
    if args.json_lines {
        let mut v = serde_json::to_value(&r.oracle).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("phase".into(), "oracle".into());
        }
        println!("{v}");
    } else {
        print!("{}", r.footer_text());
    }
    oracle_exit(oracle_failure(&r.oracle).into_iter())
}

/// The runs of a sweep without `--compare`, one after another.
fn print_runs(reports: &[DirtyLogReport], with_counters: bool) {
    for r in reports {
        if reports.len() > 1 {
            println!("== {} vCPUs ==", r.params.vcpus);
        }
        print!("{}", r.to_selftest_text(with_counters));
    }
}

/// The tables (or CSV rows) of a `--compare technique` sweep: a table per selftest line, a row
/// per vCPU count, a column per side.
fn print_comparison(
    technique: Technique,
    iterations: u32,
    config: &str,
    columns: &[&str],
    runs: &[(usize, Vec<DirtyLogReport>)],
    csv: bool,
) {
    let mut metrics = vmmu::lab::compare::dirty_log_metrics(iterations);
    if technique == Technique::Arm64Lock {
        metrics.extend(vmmu::lab::compare::contention_metrics(iterations));
    }
    if csv {
        print!("{}", vmmu::lab::compare::csv(&metrics, columns, runs));
    } else {
        for m in metrics {
            if let Some(t) = vmmu::lab::compare::seed_table(config, &m, columns, runs) {
                println!("{t}");
            }
        }
    }
}

/// The chart of a comparison: the dirty memory time of iteration 2 (1 with `-i 1`).
fn plot_comparison(
    path: &std::path::Path,
    iterations: u32,
    config: &str,
    columns: &[&str],
    runs: &[(usize, Vec<DirtyLogReport>)],
) -> Result<(), String> {
    let metrics = vmmu::lab::compare::dirty_log_metrics(iterations);
    let m = &metrics[(iterations.min(2) - 1) as usize];
    Ok(vmmu::lab::compare::plot_svg(
        path, config, m, columns, runs,
    )?)
}

/// `vmmu tables`: the reports of a sweep's jobs, grouped back into its tables.
fn tables(args: &TablesArgs) -> ExitCode {
    let mut reports = Vec::new();
    for f in &args.files {
        let r: Result<DirtyLogReport, String> = std::fs::read_to_string(f)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()));
        match r {
            Ok(r) if r.sweep.is_some() => reports.push(r),
            Ok(_) => {
                eprintln!("vmmu: {}: not a report of a job from 'vmmu dirty-log ... --emit-jobs' (see 'vmmu tables --help')", f.display());
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("vmmu: {}: {e} (see 'vmmu tables --help')", f.display());
                return ExitCode::from(2);
            }
        }
    }
    let first = reports[0].sweep.clone().expect("checked");
    if let Some(r) = reports.iter().find(|r| {
        let s = r.sweep.as_ref().expect("checked");
        s.technique != first.technique || s.config != first.config
    }) {
        eprintln!(
            "vmmu: the reports come from different sweeps ({:?} and {:?}): give the files of one",
            first.config,
            r.sweep.as_ref().expect("checked").config
        );
        return ExitCode::from(2);
    }
    let iterations = reports[0].params.iterations;
    let Ok(technique) = Technique::from_str(&first.technique, false) else {
        // A plain vCPU sweep: its runs in order.
        reports.sort_by_key(|r| r.params.vcpus);
        print_runs(&reports, !args.no_counters);
        return ExitCode::SUCCESS;
    };
    let mut columns: Vec<String> = Vec::new();
    for r in &reports {
        let c = &r.sweep.as_ref().expect("checked").column;
        if !columns.contains(c) {
            columns.push(c.clone());
        }
    }
    let mut counts: Vec<usize> = reports.iter().map(|r| r.params.vcpus).collect();
    counts.sort_unstable();
    counts.dedup();
    let mut runs = Vec::new();
    for n in counts {
        let mut row = Vec::new();
        for c in &columns {
            let found = reports
                .iter()
                .find(|r| r.params.vcpus == n && &r.sweep.as_ref().expect("checked").column == c);
            match found {
                Some(r) => row.push(r.clone()),
                None => {
                    eprintln!("vmmu: no report for {n} vCPUs, {c}: a job is missing or failed");
                    return ExitCode::from(1);
                }
            }
        }
        runs.push((n, row));
    }
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
    print_comparison(
        technique,
        iterations,
        &first.config,
        &columns,
        &runs,
        args.csv,
    );
    if let Some(path) = &args.plot {
        if let Err(e) = plot_comparison(path, iterations, &first.config, &columns, &runs) {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    }
    oracle_exit(reports.iter().filter_map(|r| {
        oracle_failure(&r.oracle).map(|m| format!("{} vCPUs: {m}", r.params.vcpus))
    }))
}

/// A command-line error as one line: what was wrong, the values allowed where clap knows them,
/// and the help of the subcommand it concerns.
fn usage_error_line(e: &clap::Error) -> String {
    use clap::error::{ContextKind, ContextValue};
    let text = e.render().to_string();
    let mut line = text
        .lines()
        .next()
        .unwrap_or("invalid command line")
        .trim_start_matches("error: ")
        .to_string();
    if let Some(ContextValue::Strings(valid)) = e.get(ContextKind::ValidValue) {
        line.push_str(&format!("; possible values: {}", valid.join(", ")));
    }
    // clap lists missing arguments on the lines below its first: name them on this one.
    if e.kind() == clap::error::ErrorKind::MissingRequiredArgument {
        if let Some(ContextValue::Strings(missing)) = e.get(ContextKind::InvalidArg) {
            line = format!("{line} {}", missing.join(", "));
        }
    }
    let names: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    let subcommand = std::env::args().skip(1).find(|a| names.contains(a));
    match subcommand {
        Some(c) => format!("{line} (see 'vmmu {c} --help')"),
        None => format!("{line} (see 'vmmu --help')"),
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // `vmmu` alone: the help, on stderr, and the usage error's status.
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                eprint!("{}", e.render());
                return ExitCode::from(2);
            }
            eprintln!("vmmu: {}", usage_error_line(&e));
            return ExitCode::from(2);
        }
    };
    vmmu::engine::virtual_time::scheduler::set_fast_forward_default(cli.fast_forward == OnOff::On);
    match &cli.command {
        Command::DirtyLog(a) => dirty_log(a),
        Command::PageTable(a) => page_table::page_table(a),
        Command::NestedChurn(a) => nested_churn::nested_churn(a),
        Command::Reclaim(a) => reclaim::reclaim(a),
        Command::Migrate(a) => migrate::migrate(a),
        Command::AccessTracking(a) => access_tracking::access_tracking(a),
        Command::Soak(a) => soak::soak(a),
        Command::LockBench(a) => lock_bench::lock_bench(a),
        Command::Tables(a) => tables(a),
        Command::Calibrate(a) => calibrate::calibrate(a),
        Command::Fit(a) => fit::fit(a),
    }
}
