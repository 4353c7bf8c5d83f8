//! `vmmu page-table`: kvm_page_table_test on the model, one run or seed 002's table (memory
//! sizes by rows, `--compare` sides by columns).

use crate::machine::{oracle_exit, print_json, Engine, MachineArgs, Technique};
use std::process::ExitCode;
use vmmu::lab::page_table::{
    header_text, run_page_table_threads, run_page_table_virtual, seed_table, PageTableParams,
    PageTableReport, StageEvent, UNMAP_VM,
};
use vmmu::lab::sweep::run_points;
use vmmu::units::parse_size;

/// kvm_page_table_test's flags, the machine, and seed 002's modification.
#[derive(clap::Args)]
pub struct PageTableArgs {
    /// Number of vCPUs; every vCPU walks the whole test region, as in the test.
    #[arg(short = 'v', default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=vmmu::lab::params::KVM_MAX_VCPUS as i64))]
    vcpus: u32,
    /// Size of the test memory region, e.g. 10M or 3G (aligned up to the backing's page size, as
    /// the test does); a comma-separated list runs each size, one row of the table per size.
    #[arg(short = 'b', default_value = "1G", value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<u64>,
    /// Seed 002's modification: in KVM_ADJUST_MAPPINGS each new page is followed by reads of up
    /// to N pages behind it (the seed used 512; 0 is the stock test).
    #[arg(long, value_name = "N", default_value_t = 0)]
    backward_pages: u64,
    /// Run every size with the technique off and on, and print seed 002's table (adjust and
    /// unmap times).
    #[arg(long, value_enum)]
    compare: Option<Technique>,
    /// The machine: architecture, MMU, CPU features, KVM's switches, engine, output.
    #[command(flatten)]
    m: MachineArgs,
}

/// Runs the command; exit 0, 1 (a run or an oracle failed) or 2 (bad command line).
pub fn page_table(args: &PageTableArgs) -> ExitCode {
    let usage = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu page-table --help')");
        ExitCode::from(2)
    };
    let (mmu, guest_mode) = match args.m.vm_kind() {
        Ok(k) => k,
        Err(e) => return usage(e),
    };
    let sweep = args.sizes.len() > 1 || args.compare.is_some();
    let engine = args.m.engine.unwrap_or(if sweep {
        Engine::Virtual
    } else {
        Engine::Threads
    });
    if let Err(e) = args.m.check(args.compare, engine) {
        return usage(e);
    }
    let cost = match args.m.cost_model() {
        Ok(c) => c,
        Err(e) => return usage(e),
    };
    let base = PageTableParams {
        vcpus: args.vcpus as usize,
        test_mem_bytes: args.sizes[0],
        backing: args.m.backing,
        mmu,
        guest_mode,
        eager_split: args.m.eager_split(),
        pml: args.m.pml(),
        kernel: args.m.kernel(),
        guest_page_level: args.m.guest_page_level(),
        backward_pages: args.backward_pages,
    };
    let sides = args.m.sides(args.compare, mmu, base.eager_split, base.pml);
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let points: Vec<(String, PageTableParams)> = sizes
        .iter()
        .flat_map(|&bytes| {
            let base = &base;
            sides.iter().map(move |side| {
                (
                    side.name.clone(),
                    PageTableParams {
                        test_mem_bytes: bytes,
                        mmu: side.mmu,
                        eager_split: side.eager_split,
                        pml: side.pml,
                        ..base.clone()
                    },
                )
            })
        })
        .collect();
    // Every configuration is checked before the first one runs.
    for (_, q) in &points {
        if let Err(e) = q.validate() {
            return usage(e.to_string());
        }
    }
    let progress = !args.m.quiet;
    // One run printed as text: the header once the vCPUs started, each stage as it ends.
    if points.len() == 1 && !args.m.json {
        let with_counters = !args.m.no_counters;
        let mut print = |ev: StageEvent<'_>| {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let _ = match ev {
                StageEvent::Started {
                    params,
                    test_memory,
                } => write!(out, "{}", header_text(params, test_memory)),
                StageEvent::Stage(st) => write!(out, "{}", st.selftest_text(with_counters)),
            };
            let _ = out.flush();
        };
        let q = &points[0].1;
        let r = match engine {
            Engine::Threads => run_page_table_threads(q, progress, &mut print),
            Engine::Virtual => run_page_table_virtual(q, &cost, progress, &mut print),
        };
        return match r {
            Ok(r) => {
                if let Some(line) = r.met_line() {
                    println!("{line}");
                }
                oracle_exit(page_table_failure(&r).into_iter())
            }
            Err(e) => {
                eprintln!("vmmu: {e}");
                ExitCode::from(1)
            }
        };
    }
    let reports = match run_points(
        &points,
        crate::machine::jobs(args.m.jobs, engine),
        |(_, q)| q.aligned_bytes(),
        |(side, q)| {
            format!(
                "-b {}{}{side}",
                q.test_mem_bytes,
                if side.is_empty() { "" } else { ", " }
            )
        },
        progress,
        |(_, q)| match engine {
            Engine::Threads => run_page_table_threads(q, progress && !sweep, &mut |_| {}),
            Engine::Virtual => run_page_table_virtual(q, &cost, progress && !sweep, &mut |_| {}),
        },
    ) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    };
    if args.m.json {
        if let Err(code) = print_json(&reports, !args.m.no_counters) {
            return code;
        }
    } else if args.compare.is_some() {
        let names: Vec<String> = sides.iter().map(|s| s.name.clone()).collect();
        let rows: Vec<(u64, Vec<PageTableReport>)> = reports
            .chunks(sides.len())
            .map(|c| (c[0].params.aligned_bytes(), c.to_vec()))
            .collect();
        println!(
            "kvm_page_table_test -v {} -s {}{}: {} engine, {}",
            args.vcpus,
            args.m.backing,
            if args.backward_pages > 0 {
                format!(" --backward-pages {}", args.backward_pages)
            } else {
                String::new()
            },
            if engine == Engine::Virtual {
                "virtual-time"
            } else {
                "threads"
            },
            args.m.describe(mmu, args.compare)
        );
        print!(
            "{}",
            seed_table(&names, &["KVM_ADJUST_MAPPINGS", UNMAP_VM], &rows)
        );
    } else {
        for r in &reports {
            if reports.len() > 1 {
                println!("== -b {:#x} ==", r.params.aligned_bytes());
            }
            print!("{}", r.to_selftest_text(!args.m.no_counters));
        }
    }
    oracle_exit(reports.iter().filter_map(page_table_failure))
}

/// A run's failed oracle, as one line naming its size.
fn page_table_failure(r: &PageTableReport) -> Option<String> {
    vmmu::lab::dirty_log::oracle_failure(&r.oracle)
        .map(|m| format!("-b {:#x}: {m}", r.params.aligned_bytes()))
}
