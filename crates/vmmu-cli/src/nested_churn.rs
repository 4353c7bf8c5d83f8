//! `vmmu nested-churn`: seed 004's benchmark (L2 guests booted and destroyed under an L1
//! hypervisor), one run or both sides of `--zap-orphans` with `--compare`.

use crate::machine::{oracle_exit, run_scenario, OnOff, RunArgs, Scenario};
use clap::ValueEnum;
use std::path::PathBuf;
use std::process::ExitCode;
use vmmu::lab::nested_churn::{
    plot_boot_times, run_nested_churn_threads, run_nested_churn_virtual, zap_orphans_label,
    L1Alloc, NestedChurnParams, NestedChurnReport, Teardown,
};
use vmmu::units::parse_size;
use vmmu::x86::shadow::state::{SlotZap, ZapOrphans};

/// Seed 004's switch on the command line.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ZapOrphansArg {
    /// Zap a nested guest's child page left without a parent (Linux 5.9+, the merged v2).
    On,
    /// The seed's v1: zap any child left without a parent when TDP is on.
    V1,
    /// Leave it, unlinked (Linux 5.8 and earlier).
    Off,
}

impl From<ZapOrphansArg> for ZapOrphans {
    fn from(a: ZapOrphansArg) -> Self {
        match a {
            ZapOrphansArg::On => ZapOrphans::On,
            ZapOrphansArg::V1 => ZapOrphans::V1,
            ZapOrphansArg::Off => ZapOrphans::Off,
        }
    }
}

/// What deleting a memslot zaps.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum SlotZapArg {
    /// kvm_mmu_zap_all_fast(): every shadow page (KVM's default quirk; every kernel before 6.12).
    AllFast,
    /// kvm_mmu_zap_memslot(): the slot's own mappings (6.12+ with KVM_X86_QUIRK_SLOT_ZAP_ALL off).
    Memslot,
}

/// What `--compare` runs side by side.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum NestedTechnique {
    /// Seed 004: --zap-orphans off (Linux 5.8) and on (5.9+).
    ZapOrphans,
}

/// The order of the teardown writes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum TeardownArg {
    /// Root, PDPTs, PDs, then PTs (the PT pages KVM synced stay behind without seed 004).
    TopDown,
    /// PTs first (they go unsync and are reaped with their parents even without seed 004).
    BottomUp,
}

/// How L1 picks free pages.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum L1AllocArg {
    /// A seeded random free page.
    Random,
    /// The page freed last (KVM finds its old shadow pages again by hash).
    Lifo,
}

/// The benchmark's flags.
#[derive(clap::Args)]
pub struct NestedChurnArgs {
    /// L1's memory, 4 KiB pages (tdp_mmu=N: EPT01 is direct shadow pages): memslot 0 backs its
    /// L2s, memslot 1 (--l1-table-memory) holds its EPT12 tables; the seed used 64G.
    #[arg(long, default_value = "16G", value_parser = parse_size)]
    l1_memory: u64,
    /// Of --l1-memory, what L1 allocates EPT12 tables from (memslot 1, the rest backing L2s);
    /// default a quarter. The smaller, the sooner L1 reuses a table page KVM still shadows.
    #[arg(long, value_parser = parse_size)]
    l1_table_memory: Option<u64>,
    /// Each L2's memory, all of it written at boot; the seed used 2G.
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    l2_memory: u64,
    /// L2s booted at a time (the seed: 10).
    #[arg(long, default_value_t = 10)]
    concurrent: u32,
    /// Rounds of boots and teardowns (the seed: 20).
    #[arg(long, default_value_t = 20)]
    rounds: u32,
    /// L1's vCPUs; each runs L2s round-robin from one queue.
    #[arg(long, default_value_t = 4)]
    l1_vcpus: usize,
    /// L2 pages an L1 vCPU runs before its timer switches it to the next L2.
    #[arg(long, default_value_t = 4096)]
    quantum: u64,
    /// Seed 004: zap a nested guest's page table when its only parent is zapped. on: Linux
    /// 5.9+ (the merged v2, nested pages only); v1: the seed's first version; off: 5.8 and
    /// earlier.
    #[arg(long, value_enum, default_value = "on")]
    zap_orphans: ZapOrphansArg,
    /// Run with the technique off and on, side by side.
    #[arg(long, value_enum)]
    compare: Option<NestedTechnique>,
    /// What deleting memslot 0 zaps at the end.
    #[arg(long, value_enum, default_value = "all-fast")]
    slot_zap: SlotZapArg,
    /// KVM_SET_NR_MMU_PAGES: the shadow-page quota (default: KVM's, 1 page per 50 of memory).
    #[arg(long, value_name = "N")]
    mmu_pages: Option<u64>,
    /// The order L1 writes zeros over a dead L2's EPT12 tables.
    #[arg(long, value_enum, default_value = "top-down")]
    teardown: TeardownArg,
    /// How L1 picks the free pages it gives out.
    #[arg(long, value_enum, default_value = "random")]
    l1_alloc: L1AllocArg,
    /// L1 enables EPT accessed/dirty bits in its EPTPs (EPTP bit 6).
    #[arg(long, value_enum, default_value = "on")]
    ept_ad: OnOff,
    /// The seed of L1's allocator.
    #[arg(long, default_value_t = 1)]
    seed: u32,
    #[command(flatten)]
    run: RunArgs,
    /// Draw the boot time of every round (each side with --compare) into FILE.svg.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

/// Runs the command; exit 0, 1 (a run or an oracle failed) or 2 (bad command line).
pub fn nested_churn(args: &NestedChurnArgs) -> ExitCode {
    let usage = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu nested-churn --help')");
        ExitCode::from(2)
    };
    let base = NestedChurnParams {
        l1_memory: args.l1_memory,
        table_memory: args.l1_table_memory.unwrap_or(0),
        l2_memory: args.l2_memory,
        concurrent: args.concurrent,
        rounds: args.rounds,
        l1_vcpus: args.l1_vcpus,
        quantum: args.quantum,
        zap_orphans: args.zap_orphans.into(),
        slot_zap: match args.slot_zap {
            SlotZapArg::AllFast => SlotZap::AllFast,
            SlotZapArg::Memslot => SlotZap::Memslot,
        },
        mmu_pages: args.mmu_pages,
        teardown: match args.teardown {
            TeardownArg::TopDown => Teardown::TopDown,
            TeardownArg::BottomUp => Teardown::BottomUp,
        },
        l1_alloc: match args.l1_alloc {
            L1AllocArg::Random => L1Alloc::Random,
            L1AllocArg::Lifo => L1Alloc::Lifo,
        },
        ept_ad: args.ept_ad == OnOff::On,
        seed: args.seed,
        write_tracking: true,
    };
    if let Err(e) = base.validate() {
        return usage(e.to_string());
    }
    let cost = match args.run.cost_model(Default::default) {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let sides: Vec<NestedChurnParams> = match args.compare {
        None => vec![base.clone()],
        Some(NestedTechnique::ZapOrphans) => [ZapOrphans::Off, ZapOrphans::On]
            .into_iter()
            .map(|z| NestedChurnParams {
                zap_orphans: z,
                ..base.clone()
            })
            .collect(),
    };
    let scenario = Scenario {
        threads: run_nested_churn_threads,
        virtual_time: run_nested_churn_virtual,
        one: |r: &NestedChurnReport, counters| r.to_text(counters),
        many: |rs: &[NestedChurnReport], _| vmmu::lab::nested_churn::compare_text(rs),
    };
    let label =
        |p: &NestedChurnParams| format!("--zap-orphans {}", zap_orphans_label(p.zap_orphans));
    let reports = match run_scenario(&sides, &args.run, &cost, label, scenario) {
        Ok(r) => r,
        Err(code) => return code,
    };
    if let Some(path) = &args.plot {
        if let Err(e) = plot_boot_times(path, &reports) {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    }
    oracle_exit(reports.iter().filter(|r| !r.oracle.passed()).map(|r| {
        format!(
            "nested-churn with --zap-orphans {}: {} misplaced L2 pages, {} invariant violations",
            zap_orphans_label(r.params.zap_orphans),
            r.oracle.misplaced,
            r.oracle.invariant_errors.len()
        )
    }))
}
