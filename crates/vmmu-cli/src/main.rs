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
    /// Eager page splitting (x86: KVM's eager_page_split; arm64: KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE).
    EagerSplit,
    /// arm64's mmu_lock regimes side by side: spin, perm-fast-path, parallel.
    Arm64Lock,
    /// arm64 without and with FEAT_TLBIRANGE (range TLB invalidation, Linux 6.6).
    TlbiRange,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Arch {
    /// x86 with EPT (or shadow paging): the TDP MMU or the shadow MMU.
    X86,
    /// arm64: KVM/arm64's stage-2 MMU at the 4K granule.
    Arm64,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum RelaxFlushArg {
    /// Linux up to 6.4: __kvm_tlb_flush_vmid_ipa(), broadcast and waited for.
    Broadcast,
    /// Linux 6.5 and later: __kvm_tlb_flush_vmid_ipa_nsh(), on the faulting PE only.
    Local,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Arm64LockArg {
    /// Linux 5.17 and earlier: mmu_lock is a spinlock; every fault holds it.
    Spin,
    /// Linux 5.18-6.1 (seed 001): an rwlock; write-permission faults on pages during dirty
    /// logging are relaxed under the read lock, every other fault takes the write lock.
    PermFastPath,
    /// Linux 6.2 and later: every stage-2 fault under the read lock, with cmpxchg
    /// break-before-make.
    Parallel,
}

impl Arm64LockArg {
    fn regime(self) -> vmmu::arm64::Arm64Lock {
        match self {
            Arm64LockArg::Spin => vmmu::arm64::Arm64Lock::Spin,
            Arm64LockArg::PermFastPath => vmmu::arm64::Arm64Lock::PermFastPath,
            Arm64LockArg::Parallel => vmmu::arm64::Arm64Lock::Parallel,
        }
    }
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
    /// Eager page splitting: on x86 KVM's eager_page_split module parameter (default on); on
    /// arm64 KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE set to --split-chunk (Linux 6.4; default off, as
    /// KVM leaves it until the VMM sets it).
    #[arg(long, value_enum)]
    eager_split: Option<OnOff>,
    /// The architecture the model runs.
    #[arg(long, value_enum, default_value = "x86")]
    arch: Arch,
    /// With --arch arm64: how stage-2 faults take mmu_lock (default parallel).
    #[arg(long, value_enum, value_name = "REGIME")]
    arm64_lock: Option<Arm64LockArg>,
    /// With --arch arm64: the guest mode (the selftests' -m): 2-7 and 11-14; 2 is PA-bits:48,
    /// VA-bits:48, 4K pages (default 5, PA-bits:40, 4K pages, aarch64's VM_MODE_DEFAULT).
    #[arg(short = 'm', value_name = "MODE")]
    guest_mode: Option<u32>,
    /// With --arch arm64: the CPU has FEAT_TLBIRANGE, so KVM (6.6+) invalidates ranges instead
    /// of the whole VMID (default off, as on the Neoverse-N1 of an Ampere Altra).
    #[arg(long, value_enum)]
    tlbi_range: Option<OnOff>,
    /// With --arch arm64: the CPU has FEAT_S2FWB, so KVM does no cache maintenance before
    /// mapping a page, and with FEAT_TLBIRANGE defers an unmap's TLBIs to one range flush
    /// (default off, as on Neoverse-N1).
    #[arg(long, value_enum)]
    fwb: Option<OnOff>,
    /// With --arch arm64: how a relaxed permission is invalidated: broadcast to every PE (Linux
    /// up to 6.4, default) or on the faulting PE only (6.5 and later).
    #[arg(long, value_enum)]
    relax_flush: Option<RelaxFlushArg>,
    /// With --arch arm64 and eager splitting on: the split chunk size, a block size the 4K
    /// granule supports (4K, 2M or 1G; default 2M).
    #[arg(long, value_name = "SIZE")]
    split_chunk: Option<String>,
    /// Which x86 MMU to model (default tdp).
    #[arg(long, value_enum)]
    mmu: Option<MmuKind>,
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
    /// defaults of the architecture otherwise (arm64: an Ampere Altra's hardware costs).
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
    /// The x86 MMU the flags select.
    fn mmu_kind(&self) -> MmuKind {
        self.mmu.unwrap_or(MmuKind::Tdp)
    }

    /// `--split-chunk` in 4 KiB pages (2M when not given).
    fn split_chunk_pages(&self) -> Result<u64, String> {
        let Some(s) = &self.split_chunk else {
            return Ok(vmmu::units::PageSize::Size2M.pages());
        };
        let bytes = parse_size(s).map_err(|e| format!("--split-chunk {s}: {e}"))?;
        vmmu::units::PageSize::ALL
            .iter()
            .find(|p| p.pages() * vmmu::units::PAGE_SIZE == bytes)
            .map(|p| p.pages())
            .ok_or_else(|| {
                format!(
                    "--split-chunk {s}: not a block size the 4K granule supports; use 4K, 2M or 1G"
                )
            })
    }

    fn params(&self) -> Result<DirtyLogParams, String> {
        let (mmu, guest_mode) = match self.arch {
            Arch::X86 => (
                match self.mmu_kind() {
                    MmuKind::Tdp => vmmu::vm::MmuKind::Tdp,
                    MmuKind::Shadow => vmmu::vm::MmuKind::Shadow {
                        ept: self.ept == OnOff::On,
                    },
                },
                None,
            ),
            Arch::Arm64 => {
                let mode = self
                    .guest_mode
                    .unwrap_or(vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE);
                let m = vmmu::lab::params::GuestMode::arm64(mode)?;
                (
                    vmmu::vm::MmuKind::Stage2 {
                        lock: self.arm64_lock.unwrap_or(Arm64LockArg::Parallel).regime(),
                        ia_bits: m.pa_bits,
                        split_chunk_pages: self.split_chunk_pages()?,
                        cpu: vmmu::arm64::Arm64Cpu {
                            tlbi_range: self.tlbi_range == Some(OnOff::On),
                            fwb: self.fwb == Some(OnOff::On),
                        },
                        relax_flush: match self.relax_flush {
                            Some(RelaxFlushArg::Local) => vmmu::arm64::RelaxFlush::Local,
                            _ => vmmu::arm64::RelaxFlush::Broadcast,
                        },
                    },
                    Some(mode),
                )
            }
        };
        let eager_default = self.arch == Arch::X86;
        Ok(DirtyLogParams {
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
            eager_split: self.eager_split.map_or(eager_default, |e| e == OnOff::On),
            mmu,
            guest_page_level: match self.guest_page_size {
                GuestPageSize::Size4k => vmmu::x86::spte::PG_LEVEL_4K,
                GuestPageSize::Size2m => vmmu::x86::spte::PG_LEVEL_2M,
            },
            guest_mode,
        })
    }
}

/// `p` with its arm64 stage 2's lock regime or CPU features changed by `change` (an x86 `p` is
/// returned as it is).
fn stage2_variant(
    p: &DirtyLogParams,
    change: impl Fn(&mut vmmu::arm64::Arm64Lock, &mut vmmu::arm64::Arm64Cpu),
) -> DirtyLogParams {
    let mut q = p.clone();
    if let vmmu::vm::MmuKind::Stage2 { lock, cpu, .. } = &mut q.mmu {
        change(lock, cpu);
    }
    q
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
    if args.arch == Arch::Arm64 {
        if args.backend == Backend::Kvm {
            return Err("--backend kvm --arch arm64: this host is x86, its /dev/kvm runs x86 guests only; arm64 runs on the model (real KVM/arm64 is the reference in the QEMU anchor, see README)".into());
        }
        if args.mmu.is_some() {
            return Err(
                "--mmu selects an x86 MMU (tdp or shadow); --arch arm64 has one, the stage-2 MMU"
                    .into(),
            );
        }
        if args.ept == OnOff::Off {
            return Err(
                "--ept is x86's; arm64 always translates guest physical addresses through stage 2"
                    .into(),
            );
        }
    } else {
        if args.arm64_lock.is_some() {
            return Err("--arm64-lock applies to --arch arm64 (x86's TDP MMU faults under the read lock, its shadow MMU under the write lock)".into());
        }
        if args.guest_mode.is_some() {
            return Err("-m: x86 has one guest mode (PA-bits:ANY, VA-bits:48, 4K pages); -m applies to --arch arm64".into());
        }
        if args.split_chunk.is_some() {
            return Err(
                "--split-chunk is KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE and applies to --arch arm64"
                    .into(),
            );
        }
        if args.compare == Some(Technique::Arm64Lock) {
            return Err(
                "--compare arm64-lock compares arm64's lock regimes: add --arch arm64".into(),
            );
        }
        if args.relax_flush.is_some() {
            return Err("--relax-flush is KVM/arm64's invalidation after a permission relaxation: add --arch arm64".into());
        }
        if args.tlbi_range.is_some()
            || args.fwb.is_some()
            || args.compare == Some(Technique::TlbiRange)
        {
            return Err("--tlbi-range and --fwb are arm64 CPU features (FEAT_TLBIRANGE, FEAT_S2FWB): add --arch arm64".into());
        }
    }
    if args.compare == Some(Technique::Arm64Lock) && args.arm64_lock.is_some() {
        return Err("--compare arm64-lock runs every regime; leave out --arm64-lock".into());
    }
    if args.compare == Some(Technique::TlbiRange) && args.tlbi_range.is_some() {
        return Err("--compare tlbi-range runs both sides; leave out --tlbi-range".into());
    }
    if args.compare == Some(Technique::EagerSplit) && args.eager_split.is_some() {
        return Err("--compare eager-split runs both sides; leave out --eager-split".into());
    }
    if args.split_chunk.is_some()
        && args.eager_split != Some(OnOff::On)
        && args.compare != Some(Technique::EagerSplit)
    {
        return Err("--split-chunk sizes eager splitting, which is off by default on arm64: add --eager-split on".into());
    }
    if args.backend == Backend::Model && args.dirty_ring.is_some() {
        return Err("--dirty-ring is only supported with --backend kvm".into());
    }
    if args.backend == Backend::Kvm && (sweep || args.engine.is_some()) {
        return Err("--backend kvm runs one configuration on the host: --vcpus, --compare and --engine apply to the model".into());
    }
    if args.ept == OnOff::Off && args.mmu_kind() != MmuKind::Shadow {
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
    if args.backend == Backend::Kvm && args.mmu_kind() != MmuKind::Tdp {
        return Err("--backend kvm uses the host's MMU (its tdp_mmu and ept module parameters); --mmu and --ept apply to the model".into());
    }
    if engine == Engine::Threads && args.cost_model.is_some() {
        return Err("--cost-model applies to --engine virtual only".into());
    }
    if args.plot.is_some() && args.compare.is_none() {
        return Err("--plot draws a comparison: add --compare eager-split (or arm64-lock)".into());
    }
    Ok(())
}

fn dirty_log(args: &DirtyLogArgs) -> ExitCode {
    let p = match args.params().and_then(|p| p.validate().map(|_| p)) {
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
        None if args.arch == Arch::Arm64 => vmmu::cost::CostModel::default_arm64(),
        None => vmmu::cost::CostModel::default(),
    };
    let progress = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // The sides of the comparison: a column name and what it changes in the parameters.
    let sides: Vec<(String, DirtyLogParams)> = match args.compare {
        None => vec![(String::new(), p.clone())],
        Some(Technique::EagerSplit) => [false, true]
            .iter()
            .map(|&on| {
                let name = match (args.arch, on) {
                    (Arch::X86, false) => "eager_page_split=N".to_string(),
                    (Arch::X86, true) => "eager_page_split=Y".to_string(),
                    (Arch::Arm64, false) => "eager split off".to_string(),
                    (Arch::Arm64, true) => "eager split on".to_string(),
                };
                (
                    name,
                    DirtyLogParams {
                        eager_split: on,
                        ..p.clone()
                    },
                )
            })
            .collect(),
        Some(Technique::Arm64Lock) => vmmu::arm64::Arm64Lock::ALL
            .iter()
            .map(|&regime| {
                let q = stage2_variant(&p, |lock, _| *lock = regime);
                (regime.name().to_string(), q)
            })
            .collect(),
        Some(Technique::TlbiRange) => [false, true]
            .iter()
            .map(|&on| {
                let q = stage2_variant(&p, |_, cpu| cpu.tlbi_range = on);
                let name = if on {
                    "tlbi-range on"
                } else {
                    "tlbi-range off"
                };
                (name.to_string(), q)
            })
            .collect(),
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
    // Every point of the sweep, in table order.
    let points: Vec<(String, DirtyLogParams)> = counts
        .iter()
        .flat_map(|&n| {
            sides.iter().map(move |(side, q)| {
                let q = DirtyLogParams {
                    vcpus: n as usize,
                    ..q.clone()
                };
                (side.clone(), q)
            })
        })
        .collect();
    // Virtual-time points are independent and deterministic: they run on every core at once,
    // largest first, and are reported in table order, so the output is a serial run's. The
    // threads engine measures this machine, so its points run one at a time.
    let workers = if engine == Engine::Virtual && points.len() > 1 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        1
    };
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(points[i].1.vcpus));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<DirtyLogReport, String>>>> =
        (0..points.len()).map(|_| Default::default()).collect();
    std::thread::scope(|scope| {
        for _ in 0..workers.min(points.len()) {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&i) = order.get(k) else { break };
                let (side, q) = &points[i];
                let r = run_one(args, q, engine, &cost, progress && !sweep);
                let failed = r.is_err();
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                let d = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                if sweep && progress {
                    eprintln!(
                        "vmmu: done {d}/{total}: {} vCPUs{}{side}",
                        q.vcpus,
                        if side.is_empty() { "" } else { ", " }
                    );
                }
                if failed {
                    // Stop handing out points: the run fails with this error.
                    next.store(order.len(), std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    let mut reports = Vec::new();
    for r in results {
        match r.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(r)) => reports.push(r),
            Some(Err(e)) => {
                eprintln!("vmmu: {e}");
                return ExitCode::from(1);
            }
            // Not run because another point failed first; its error was printed above.
            None => {}
        }
    }
    let columns: Vec<&str> = sides.iter().map(|(name, _)| name.as_str()).collect();
    let runs: Vec<(usize, Vec<DirtyLogReport>)> = if args.compare.is_some() {
        reports
            .chunks(sides.len())
            .map(|c| (c[0].params.vcpus, c.to_vec()))
            .collect()
    } else {
        Vec::new()
    };
    let mmu_desc = match p.mmu {
        vmmu::vm::MmuKind::Tdp => "ept=Y, tdp_mmu=Y".to_string(),
        vmmu::vm::MmuKind::Shadow { ept: true } => "ept=Y, tdp_mmu=N".to_string(),
        vmmu::vm::MmuKind::Shadow { ept: false } => "ept=N, tdp_mmu=N".to_string(),
        vmmu::vm::MmuKind::Stage2 { lock, cpu, .. } => format!(
            "arm64 -m {}{}{}{}",
            p.guest_mode.unwrap_or_default(),
            if args.compare == Some(Technique::Arm64Lock) {
                String::new()
            } else {
                format!(", {}", lock.name())
            },
            if cpu.tlbi_range && args.compare != Some(Technique::TlbiRange) {
                ", FEAT_TLBIRANGE"
            } else {
                ""
            },
            if cpu.fwb { ", FEAT_S2FWB" } else { "" }
        ),
    };
    let config = format!(
        "{} engine, {mmu_desc}, {}% writes, {}{}",
        if engine == Engine::Virtual {
            "virtual-time"
        } else {
            "threads"
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
        let mut metrics = vmmu::lab::compare::dirty_log_metrics(p.iterations);
        if args.compare == Some(Technique::Arm64Lock) {
            metrics.extend(vmmu::lab::compare::contention_metrics(p.iterations));
        }
        for m in metrics {
            if let Some(t) = vmmu::lab::compare::seed_table(&config, &m, &columns, &runs) {
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
        if let Err(e) = vmmu::lab::compare::plot_svg(path, &config, m, &columns, &runs) {
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
