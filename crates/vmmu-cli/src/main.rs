//! `vmmu`: run the lab's scenarios against the model MMU (or a real `/dev/kvm`).
//!
//! Exit codes: 0 success, 1 a run failed (an oracle found lost pages or broken invariants, or the
//! run could not complete), 2 bad command line.

mod calibrate;

use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::process::ExitCode;
use vmmu::host::backing::Backing;
use vmmu::lab::dirty_log::oracle_failure;
use vmmu::lab::dirty_log_model::run_dirty_log_threads;
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::DirtyLogReport;
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
}

#[derive(Subcommand)]
enum Command {
    /// dirty_log_perf_test: populate, enable dirty logging, dirty/get/clear iterations, disable.
    DirtyLog(DirtyLogArgs),
    /// Measure this machine's per-unit software costs by timing the model's code, and write a
    /// cost model file (run it from a release build: cargo run --release -p vmmu-cli -- calibrate).
    Calibrate(CalibrateArgs),
}

#[derive(clap::Args)]
struct CalibrateArgs {
    /// The cost model file to write.
    #[arg(long, value_name = "FILE", default_value = "cost-model.json")]
    out: PathBuf,
    /// Overwrite FILE if it exists.
    #[arg(long)]
    force: bool,
    /// A fast, less precise run (a few seconds at most).
    #[arg(long)]
    quick: bool,
    /// Also print what each workload's Meter counted.
    #[arg(long)]
    counts: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Engine {
    /// One OS thread per vCPU, real locks and atomics; times are this machine's.
    Threads,
    /// Every actor on one thread in virtual-time order; times come from the cost model and are
    /// the same on every run.
    Virtual,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Technique {
    /// Eager page splitting (KVM's eager_page_split).
    EagerSplit,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// The modelled MMU (this project's KVM).
    Model,
    /// The host's real /dev/kvm.
    Kvm,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum MmuKind {
    /// The x86 TDP MMU (tdp_mmu=Y).
    Tdp,
    /// The x86 shadow MMU (tdp_mmu=N): direct with EPT, shadow paging with --ept off.
    Shadow,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum GuestPageSize {
    /// 4 KiB guest pages.
    #[value(name = "4k")]
    Size4k,
    /// 2 MiB guest pages.
    #[value(name = "2m")]
    Size2m,
}

#[derive(clap::Args)]
struct DirtyLogArgs {
    /// Number of vCPUs.
    #[arg(short = 'v', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::params::KVM_MAX_VCPUS as i64))]
    vcpus: u32,
    /// Memory each vCPU dirties, e.g. 10M or 3G.
    #[arg(short = 'b', default_value = "1G", value_parser = parse_size)]
    vcpu_bytes: u64,
    /// Dirty-memory iterations.
    #[arg(short = 'i', default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    iterations: u32,
    /// Backing source of guest memory: anonymous, anonymous_thp, anonymous_hugetlb_2mb, anonymous_hugetlb_1gb.
    #[arg(short = 's', default_value = "anonymous", value_parser = parse_backing)]
    backing: Backing,
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
    /// KVM's eager_page_split module parameter.
    #[arg(long, value_enum, default_value = "on")]
    eager_split: OnOff,
    /// Which MMU to model.
    #[arg(long, value_enum, default_value = "tdp")]
    mmu: MmuKind,
    /// KVM's ept module parameter; off means shadow paging (needs --mmu shadow).
    #[arg(long, value_enum, default_value = "on")]
    ept: OnOff,
    /// With --ept off: the page size the guest maps its memory with in its own page tables.
    #[arg(long, value_enum, default_value = "2m")]
    guest_page_size: GuestPageSize,
    /// What runs the scenario: the model, or the host's /dev/kvm.
    #[arg(long, value_enum, default_value = "model")]
    backend: Backend,
    /// With --backend kvm: harvest through KVM_CAP_DIRTY_LOG_RING rings of N entries per vCPU.
    #[arg(long, value_name = "N")]
    dirty_ring: Option<u32>,
    /// Which engine drives the model (default: threads for one run, virtual for --vcpus lists
    /// and --compare).
    #[arg(long, value_enum)]
    engine: Option<Engine>,
    /// Sweep these vCPU counts (e.g. 2,4,8,16,32,64) instead of -v.
    #[arg(long = "vcpus", value_name = "LIST", value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::params::KVM_MAX_VCPUS as i64))]
    vcpu_list: Option<Vec<u32>>,
    /// Run every configuration with the technique off and on, and print the seed-style tables.
    #[arg(long, value_enum)]
    compare: Option<Technique>,
    /// With --compare: draw the dirty memory time (iteration 2, or 1 with -i 1) against vCPUs
    /// into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// With --engine virtual: the cost model file (as `vmmu calibrate` writes it); the built-in
    /// defaults otherwise.
    #[arg(long, value_name = "FILE")]
    cost_model: Option<PathBuf>,
    /// Print the report as JSON instead of the selftest's text.
    #[arg(long)]
    json: bool,
    /// Leave out the per-phase counter lines of the text output.
    #[arg(long)]
    no_counters: bool,
}

fn parse_backing(s: &str) -> Result<Backing, String> {
    s.parse()
}

impl DirtyLogArgs {
    fn params(&self) -> DirtyLogParams {
        DirtyLogParams {
            vcpus: self.vcpus as usize,
            vcpu_memory_bytes: self.vcpu_bytes,
            iterations: self.iterations,
            backing: self.backing,
            write_percent: self.write_percent,
            manual_protect: !self.no_manual_protect,
            slots: self.slots as usize,
            random_access: self.random_access,
            partition: !self.overlap,
            random_seed: self.seed,
            run_vcpus_while_disabling: self.run_while_disabling,
            eager_split: self.eager_split == OnOff::On,
            mmu: match self.mmu {
                MmuKind::Tdp => vmmu::vm::MmuKind::Tdp,
                MmuKind::Shadow => vmmu::vm::MmuKind::Shadow {
                    ept: self.ept == OnOff::On,
                },
            },
            guest_page_level: match self.guest_page_size {
                GuestPageSize::Size4k => vmmu::x86::spte::PG_LEVEL_4K,
                GuestPageSize::Size2m => vmmu::x86::spte::PG_LEVEL_2M,
            },
        }
    }
}

/// Runs one configuration on the chosen backend and engine.
fn run_one(
    args: &DirtyLogArgs,
    p: &DirtyLogParams,
    engine: Engine,
    cost: &vmmu::cost::CostModel,
    progress: bool,
) -> Result<DirtyLogReport, String> {
    match args.backend {
        Backend::Model => match engine {
            Engine::Threads => run_dirty_log_threads(p, progress),
            Engine::Virtual => vmmu::lab::dirty_log_model::run_dirty_log_virtual(p, cost, progress),
        },
        Backend::Kvm => vmmu_kvm::run_dirty_log(
            p,
            &vmmu_kvm::KvmOptions {
                dirty_ring: args.dirty_ring,
                progress,
            },
        )
        .map_err(|e| e.to_string()),
    }
}

/// Checks the combinations of options; a usage error is one line and exit 2.
fn check_options(args: &DirtyLogArgs, engine: Engine, sweep: bool) -> Result<(), String> {
    if args.backend == Backend::Model && args.dirty_ring.is_some() {
        return Err("--dirty-ring is only supported with --backend kvm".into());
    }
    if args.backend == Backend::Kvm && (sweep || args.engine.is_some()) {
        return Err("--backend kvm runs one configuration on the host: --vcpus, --compare and --engine apply to the model".into());
    }
    if args.ept == OnOff::Off && args.mmu != MmuKind::Shadow {
        return Err(
            "--ept off means shadow paging, which only the shadow MMU does: add --mmu shadow"
                .into(),
        );
    }
    if args.guest_page_size != GuestPageSize::Size2m && args.ept == OnOff::On {
        return Err(
            "--guest-page-size applies to shadow paging only (--mmu shadow --ept off)".into(),
        );
    }
    if args.backend == Backend::Kvm && args.mmu != MmuKind::Tdp {
        return Err("--backend kvm uses the host's MMU (its tdp_mmu and ept module parameters); --mmu and --ept apply to the model".into());
    }
    if engine == Engine::Threads && args.cost_model.is_some() {
        return Err("--cost-model applies to --engine virtual only".into());
    }
    if args.plot.is_some() && args.compare.is_none() {
        return Err("--plot draws a comparison: add --compare eager-split".into());
    }
    Ok(())
}

fn dirty_log(args: &DirtyLogArgs) -> ExitCode {
    let p = args.params();
    if let Err(e) = p.validate() {
        eprintln!("vmmu: {e}");
        return ExitCode::from(2);
    }
    // Sorted and de-duplicated, so tables and charts read left to right.
    let mut counts = args
        .vcpu_list
        .clone()
        .unwrap_or_else(|| vec![p.vcpus as u32]);
    counts.sort_unstable();
    counts.dedup();
    let sweep = args.vcpu_list.is_some() || args.compare.is_some();
    // Virtual time is the default for sweeps: a 2-core machine cannot show 64 vCPUs in threads.
    let engine = args.engine.unwrap_or(if sweep {
        Engine::Virtual
    } else {
        Engine::Threads
    });
    if let Err(e) = check_options(args, engine, sweep) {
        eprintln!("vmmu: {e}");
        return ExitCode::from(2);
    }
    let cost = match &args.cost_model {
        Some(f) => match vmmu::cost::CostModel::load(f) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("vmmu: {e}");
                return ExitCode::from(2);
            }
        },
        None => vmmu::cost::CostModel::default(),
    };
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let sides: Vec<bool> = if args.compare.is_some() {
        vec![false, true]
    } else {
        vec![p.eager_split]
    };
    let total = counts.len() * sides.len();
    // Every configuration is checked before the first one runs.
    for &n in &counts {
        if let Err(e) = (DirtyLogParams {
            vcpus: n as usize,
            ..p.clone()
        })
        .validate()
        {
            eprintln!("vmmu: with {n} vCPUs: {e}");
            return ExitCode::from(2);
        }
    }
    if let Some(path) = &args.plot {
        if let Err(e) = std::fs::File::create(path) {
            eprintln!("vmmu: cannot write the chart to {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    let mut reports = Vec::new();
    for &n in &counts {
        for &eager_split in &sides {
            let q = DirtyLogParams {
                vcpus: n as usize,
                eager_split,
                ..p.clone()
            };
            if sweep && progress {
                eprintln!(
                    "vmmu: run {}/{total}: {n} vCPUs, eager_page_split={}",
                    reports.len() + 1,
                    if eager_split { "Y" } else { "N" }
                );
            }
            match run_one(args, &q, engine, &cost, progress && !sweep) {
                Ok(r) => reports.push(r),
                Err(e) => {
                    eprintln!("vmmu: {e}");
                    return ExitCode::from(1);
                }
            }
        }
    }
    let columns = ["eager_page_split=N", "eager_page_split=Y"];
    let runs: Vec<(usize, DirtyLogReport, DirtyLogReport)> = if args.compare.is_some() {
        reports
            .chunks(2)
            .map(|c| (c[0].params.vcpus, c[0].clone(), c[1].clone()))
            .collect()
    } else {
        Vec::new()
    };
    let config = format!(
        "{} engine, {}, {}% writes, {}{}",
        if engine == Engine::Virtual {
            "virtual-time"
        } else {
            "threads"
        },
        match p.mmu {
            vmmu::vm::MmuKind::Tdp => "ept=Y, tdp_mmu=Y",
            vmmu::vm::MmuKind::Shadow { ept: true } => "ept=Y, tdp_mmu=N",
            vmmu::vm::MmuKind::Shadow { ept: false } => "ept=N, tdp_mmu=N",
        },
        p.write_percent,
        p.backing,
        if p.manual_protect { "" } else { ", -g" }
    );
    if args.json {
        let out = if reports.len() == 1 {
            serde_json::to_string_pretty(&reports[0])
        } else {
            serde_json::to_string_pretty(&reports)
        };
        match out {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("vmmu: cannot encode the report as JSON: {e}");
                return ExitCode::from(1);
            }
        }
    } else if args.compare.is_some() {
        for m in vmmu::lab::compare::dirty_log_metrics(p.iterations) {
            if let Some(t) = vmmu::lab::compare::seed_table(&config, &m, columns, &runs) {
                println!("{t}");
            }
        }
    } else {
        for r in &reports {
            if reports.len() > 1 {
                println!("== {} vCPUs ==", r.params.vcpus);
            }
            print!("{}", r.to_selftest_text(!args.no_counters));
        }
    }
    // The chart is drawn whatever the text output (the path was checked before the runs).
    if let Some(path) = &args.plot {
        let metrics = vmmu::lab::compare::dirty_log_metrics(p.iterations);
        let m = &metrics[(p.iterations.min(2) - 1) as usize];
        if let Err(e) = vmmu::lab::compare::plot_svg(path, &config, m, columns, &runs) {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    }
    let failures: Vec<String> = reports
        .iter()
        .filter_map(|r| oracle_failure(&r.oracle).map(|m| format!("{} vCPUs: {m}", r.params.vcpus)))
        .collect();
    match failures.first() {
        Some(msg) => {
            eprintln!("vmmu: {msg}");
            ExitCode::from(1)
        }
        None => ExitCode::SUCCESS,
    }
}

fn calibrate_cmd(args: &CalibrateArgs) -> ExitCode {
    if args.out.exists() && !args.force {
        eprintln!(
            "vmmu: {} already exists; pass --force to overwrite it, or --out FILE to write elsewhere",
            args.out.display()
        );
        return ExitCode::from(2);
    }
    if cfg!(debug_assertions) {
        eprintln!("vmmu: calibrate: this build has debug assertions, so its timings are not a release build's; run `cargo run --release -p vmmu-cli -- calibrate`");
    }
    let sizes = if args.quick {
        calibrate::Sizes::quick()
    } else {
        calibrate::Sizes::full()
    };
    let (observations, cal) = match calibrate::run(&sizes, args.quick, calibrate::show_progress()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    };
    if let Err(e) = cal.model.save(&args.out) {
        eprintln!("vmmu: {e}");
        return ExitCode::from(1);
    }
    // A closed stdout (`| head`) must not lose the file, which is already written.
    use std::io::Write;
    let _ = writeln!(
        std::io::stdout(),
        "{}Wrote {}.",
        calibrate::report(&observations, &cal, &sizes, args.counts),
        args.out.display()
    );
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line: what was wrong and what is allowed.
            let text = e.render().to_string();
            let line = text
                .lines()
                .next()
                .unwrap_or("invalid command line")
                .trim_start_matches("error: ");
            eprintln!("vmmu: {line} (see 'vmmu --help')");
            return ExitCode::from(2);
        }
    };
    match &cli.command {
        Command::DirtyLog(a) => dirty_log(a),
        Command::Calibrate(a) => calibrate_cmd(a),
    }
}
