//! `vmmu lock-bench`: the virtual-time `mmu_lock` model alone, under a read/write mix from a
//! sweep of core counts, beside the published measurement it can be checked against.

use clap::ValueEnum;
use std::path::PathBuf;
use std::process::ExitCode;
use vmmu::cost::CostModel;
use vmmu::kvm::mmu_lock::LockKind;
use vmmu::lab::lock_bench::{run_lock_bench, LockBenchParams, LockBenchResult};

/// Which of Linux's locks.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LockArg {
    /// The queued rwlock (kernel/locking/qrwlock.c): x86's mmu_lock, arm64's from 5.18.
    Rwlock,
    /// The queued spinlock (kernel/locking/qspinlock.c): arm64's mmu_lock up to 5.17.
    Spinlock,
}

/// Whose default costs price the line transfers.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum HostArg {
    /// The x86 defaults: a 2-socket Cascade Lake, 48 ns in a socket and 135 ns across.
    X86,
    /// The arm64 defaults: a 1-socket 80-core Ampere Altra, 47 ns.
    Arm64,
}

/// The benchmark's flags.
#[derive(clap::Args)]
pub struct LockBenchArgs {
    /// Core counts to run, one run each.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "1,2,4,10,16,32,64",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    cores: Vec<u32>,
    /// Which lock.
    #[arg(long, value_enum, default_value = "rwlock")]
    lock: LockArg,
    /// Read acquisitions per write acquisition of each core (0: every acquisition writes). The
    /// default is the queued-rwlock series' mostly-reader test.
    #[arg(long, default_value_t = 10_000)]
    reads_per_write: u64,
    /// Acquisitions per core.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    ops_per_core: u64,
    /// How long each holder holds the lock, ns (0: a lock/unlock loop).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    hold_ns: f64,
    /// How long each core works between a release and its next request, ns.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    think_ns: f64,
    /// The default costs of which host price the transfers.
    #[arg(long, value_enum, default_value = "x86")]
    host: HostArg,
    /// A cost model file instead of the host's defaults.
    #[arg(long, value_name = "FILE")]
    cost_model: Option<PathBuf>,
    /// Print JSON instead of the table.
    #[arg(long)]
    json: bool,
}

/// The published figure the default mix can be compared to.
const PUBLISHED: &str = "published, qrwlock, 10 threads, 10,000:1, Haswell-EX (commit \
\"locking/qrwlock: Reduce reader/writer to reader lock transfer latency\", 2015): \
15,063,081/s on Linux 4.1.1 and 17,241,552/s with the patch (4.2+, this model's read path)";

/// Runs the command; exit 0, or 2 (bad command line).
pub fn lock_bench(args: &LockBenchArgs) -> ExitCode {
    let usage = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu lock-bench --help')");
        ExitCode::from(2)
    };
    for (name, v) in [("--hold-ns", args.hold_ns), ("--think-ns", args.think_ns)] {
        if !(0.0..=1e9).contains(&v) {
            return usage(format!("{name} {v}: must be from 0 to 1e9 ns"));
        }
    }
    let cost = match &args.cost_model {
        Some(f) => match CostModel::load(f) {
            Ok(c) => c,
            Err(e) => return usage(e.to_string()),
        },
        None if args.host == HostArg::Arm64 => CostModel::default_arm64(),
        None => CostModel::default(),
    };
    let kind = match args.lock {
        LockArg::Rwlock => LockKind::Rwlock,
        LockArg::Spinlock => LockKind::Spinlock,
    };
    let results: Vec<LockBenchResult> = args
        .cores
        .iter()
        .map(|&cores| {
            let p = LockBenchParams {
                cores: cores as usize,
                kind,
                reads_per_write: args.reads_per_write,
                ops_per_core: args.ops_per_core,
                hold_ns: args.hold_ns,
                think_ns: args.think_ns,
            };
            run_lock_bench(&p, &cost)
        })
        .collect();
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&results).expect("results serialize")
        );
        return ExitCode::SUCCESS;
    }
    print!("{}", table(args, &results));
    ExitCode::SUCCESS
}

/// The results as a table, one row per core count.
fn table(args: &LockBenchArgs, results: &[LockBenchResult]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "lock-bench: {:?}, {} reads per write, {} acquisitions per core, hold {} ns, think {} ns (virtual time)",
        args.lock, args.reads_per_write, args.ops_per_core, args.hold_ns, args.think_ns
    );
    let steps: Vec<&str> = results
        .first()
        .map(|r| r.transfers.iter().map(|(n, _)| *n).collect())
        .unwrap_or_default();
    let _ = write!(
        out,
        "{:>6} {:>14} {:>11} {:>10} {:>9} {:>8}",
        "cores", "acquisitions/s", "hand-off ns", "contended", "xfer/acq", "remote"
    );
    for s in &steps {
        let _ = write!(out, " {s:>9}");
    }
    out.push('\n');
    for r in results {
        let total: u64 = r.transfers.iter().map(|(_, n)| n).sum();
        // The model prices line transfers, holds and think time, not an atomic on a line the
        // core has: a lone core with no hold and no think time takes no time to speak of.
        let rate = if r.elapsed_ns < r.acquisitions {
            "-".to_string()
        } else {
            format!("{:.0}", r.acquisitions_per_s)
        };
        let _ = write!(
            out,
            "{:>6} {:>14} {:>11.1} {:>9.1}% {:>9.2} {:>7.1}%",
            r.cores,
            rate,
            r.handoff_ns,
            100.0 * r.contended as f64 / r.acquisitions.max(1) as f64,
            r.transfers_per_acquisition,
            100.0 * r.remote_transfers as f64 / total.max(1) as f64,
        );
        for (_, n) in &r.transfers {
            let _ = write!(out, " {n:>9}");
        }
        out.push('\n');
    }
    let _ = writeln!(out, "{PUBLISHED}");
    out
}
