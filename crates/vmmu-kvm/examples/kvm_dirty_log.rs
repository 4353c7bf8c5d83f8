//! Runs the `dirty-log` scenario on `/dev/kvm` with a few of dirty_log_perf_test's flags and
//! prints the selftest-format report, the oracle's verdict and the wall time of the whole run.
//!
//! `cargo run --release -p vmmu-kvm --example kvm_dirty_log -- -v 2 -b 256M -i 3 [-w N] [-a]
//! [-o] [-g] [-e] [-x N] [-r N] [-s BACKING] [--dirty-ring N] [--counters]`

use std::process::ExitCode;
use std::time::Instant;
use vmmu::lab::params::DirtyLogParams;
use vmmu_kvm::{run_dirty_log, KvmOptions};

fn parse_size(s: &str) -> Result<u64, String> {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| format!("bad size '{s}'"))
}

fn parse(args: &[String]) -> Result<(DirtyLogParams, KvmOptions, bool), String> {
    let mut p = DirtyLogParams::default();
    let mut o = KvmOptions {
        progress: true,
        ..Default::default()
    };
    let mut counters = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{a} needs a value"))
        };
        let num = |s: String| {
            s.parse::<u64>()
                .map_err(|_| format!("{a}: bad number '{s}'"))
        };
        match a.as_str() {
            "-v" => p.vcpus = num(val()?)? as usize,
            "-b" => p.vcpu_memory_bytes = parse_size(&val()?)?,
            "-i" => p.iterations = num(val()?)? as u32,
            "-w" => p.write_percent = num(val()?)? as u32,
            "-x" => p.slots = num(val()?)? as usize,
            "-r" => p.random_seed = num(val()?)? as u32,
            "-s" => p.backing = val()?.parse()?,
            "-a" => p.random_access = true,
            "-o" => p.partition = false,
            "-g" => p.manual_protect = false,
            "-e" => p.run_vcpus_while_disabling = true,
            "--dirty-ring" => o.dirty_ring = Some(num(val()?)? as u32),
            "--counters" => counters = true,
            "-q" => o.progress = false,
            _ => return Err(format!("unknown argument '{a}'")),
        }
    }
    Ok((p, o, counters))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (params, opts, counters) = match parse(&args) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let t = Instant::now();
    match run_dirty_log(&params, &opts) {
        Ok(r) => {
            print!("{}", r.to_selftest_text(counters));
            println!(
                "Oracle: {} ({} harvests, {} pages checked, {} lost{})",
                if r.oracle.passed() {
                    "passed"
                } else {
                    "FAILED"
                },
                r.oracle.harvests_checked,
                r.oracle.pages_checked,
                r.oracle.lost_pages,
                r.oracle
                    .invariant_errors
                    .first()
                    .map(|e| format!("; {e}"))
                    .unwrap_or_default()
            );
            println!("Total wall time: {:.3}s", t.elapsed().as_secs_f64());
            if r.oracle.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
