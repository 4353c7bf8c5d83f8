//! `vmmu fit` on the command line: reads the measurement files, turns each selftest command
//! line into the `vmmu` one that models it, runs the model as child processes (`--jobs` at a
//! time) and prints the fit (`vmmu::lab::fit`).

use clap::Parser;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicUsize, Ordering};
use vmmu::cost::{CostModel, UNSOURCED_HARDWARE};
use vmmu::lab::fit::{self, FitOptions, FreeCost, Measurement, ModelJob, Run, RunModel, Selftest};
use vmmu::lab::LabError;

/// `vmmu fit`'s flags.
#[derive(clap::Args)]
pub struct FitArgs {
    /// Files of selftest output, each run headed by `# cmd: ./SELFTEST ARGS` (and optionally
    /// `# param: NAME=VALUE ...` for the kernel's module parameters and `# vmmu: FLAGS` for
    /// model switches the kernel's version decides); see the README's `vmmu fit` section.
    #[arg(value_name = "FILE", required = true)]
    files: Vec<PathBuf>,
    /// The host the measurements ran on: arch=x86|arm64, cpu=cascade-lake|neoverse-n1 (the CPUs
    /// the model has TLB geometries and default costs for), sockets=N, cpus=N (logical CPUs per
    /// socket), e.g. arch=x86,cpu=cascade-lake,sockets=2,cpus=48.
    #[arg(long, value_name = "DESCRIPTION")]
    host: String,
    /// The free costs, comma-separated, each NAME or NAME=LO:HI (ns) to narrow its range
    /// (default: every unsourced hardware cost the architecture uses, in its physical range).
    #[arg(long, value_name = "LIST")]
    params: Option<String>,
    /// Fit only the timings whose label contains one of these comma-separated texts (e.g.
    /// "dirty memory time,Enabling"); runs left with none are not run.
    #[arg(long, value_name = "LIST")]
    timings: Option<String>,
    /// The cost model the fit starts from and pulls towards (default: the architecture's
    /// defaults), with the host's sockets and CPUs set from --host.
    #[arg(long, value_name = "FILE")]
    cost_model: Option<PathBuf>,
    /// Linearise-and-fit rounds: 1 fits on secants from the defaults; each further round runs
    /// every configuration (free costs + 1) more times and fits again around the last result.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    rounds: u32,
    /// Weight of the pull towards the defaults (per squared log of a cost's ratio to its
    /// default, against one timing's squared log error); 0 for none.
    #[arg(long, default_value_t = 1e-3)]
    pull: f64,
    /// Model runs at once (default: the cores available).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    jobs: Option<u32>,
    /// Write the fitted cost model here (usable with --cost-model everywhere).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Write every timing against the model as CSV here.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Draw model against measured (log-log) into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
}

/// What `--host` describes.
struct HostArg {
    arm64: bool,
    sockets: u32,
    cpus: u32,
}

const HOST_HELP: &str = "write arch=x86|arm64,cpu=cascade-lake|neoverse-n1,sockets=N,cpus=N";

fn parse_host(s: &str) -> Result<HostArg, String> {
    let (mut arch, mut cpu, mut sockets, mut cpus) = (None, None, None, None);
    for kv in s.split(',') {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("--host: `{kv}` is not KEY=VALUE; {HOST_HELP}"))?;
        let count = |v: &str| {
            v.parse::<u32>()
                .ok()
                .filter(|n| (1..=4096).contains(n))
                .ok_or_else(|| format!("--host: {k}={v}: a whole number from 1 to 4096"))
        };
        match k {
            "arch" => arch = Some(v.to_string()),
            "cpu" => cpu = Some(v.to_string()),
            "sockets" => sockets = Some(count(v)?),
            "cpus" => cpus = Some(count(v)?),
            _ => return Err(format!("--host: unknown key `{k}`; {HOST_HELP}")),
        }
    }
    let arm64 = match arch.as_deref() {
        Some("x86") => false,
        Some("arm64") => true,
        Some(a) => return Err(format!("--host: arch={a}: the model runs x86 or arm64")),
        None => return Err(format!("--host names no arch; {HOST_HELP}")),
    };
    match (arm64, cpu.as_deref()) {
        (false, Some("cascade-lake")) | (true, Some("neoverse-n1")) => {}
        (_, Some(c)) => {
            return Err(format!(
                "--host: cpu={c}: the model knows cascade-lake (x86) and neoverse-n1 (arm64)"
            ))
        }
        (_, None) => return Err(format!("--host names no cpu; {HOST_HELP}")),
    }
    Ok(HostArg {
        arm64,
        sockets: sockets.ok_or_else(|| format!("--host names no sockets; {HOST_HELP}"))?,
        cpus: cpus.ok_or_else(|| format!("--host names no cpus; {HOST_HELP}"))?,
    })
}

/// The free costs `--params` names (or every unsourced one the architecture pays), with the
/// base model's values as defaults.
fn free_costs(list: Option<&str>, base: &CostModel, arm64: bool) -> Result<Vec<FreeCost>, String> {
    let names: Vec<String> = match list {
        Some(l) => l.split(',').map(str::to_string).collect(),
        None => UNSOURCED_HARDWARE
            .iter()
            .filter(|u| u.paid_by.paid_on(arm64))
            .map(|u| u.name.to_string())
            .collect(),
    };
    let allowed = || {
        UNSOURCED_HARDWARE
            .iter()
            .map(|u| u.name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out: Vec<FreeCost> = Vec::new();
    for item in names {
        let (name, range) = match item.split_once('=') {
            Some((n, r)) => (n.to_string(), Some(r.to_string())),
            None => (item.clone(), None),
        };
        let Some(u) = UNSOURCED_HARDWARE.iter().find(|u| u.name == name) else {
            return Err(format!(
                "--params: `{name}` is not an unsourced hardware cost; a fit may move only {}",
                allowed()
            ));
        };
        if !u.paid_by.paid_on(arm64) {
            return Err(format!(
                "--params: {name} is not paid on {}: no run of this host's architecture could tell its value",
                if arm64 { "arm64" } else { "x86" }
            ));
        }
        if out.iter().any(|f| f.name == name) {
            return Err(format!("--params: `{name}` is named twice"));
        }
        let (lo, hi) = match range {
            None => (u.lo, u.hi),
            Some(r) => {
                let parsed = r
                    .split_once(':')
                    .and_then(|(a, b)| Some((a.parse::<f64>().ok()?, b.parse::<f64>().ok()?)));
                match parsed {
                    Some((lo, hi)) if u.lo <= lo && lo < hi && hi <= u.hi => (lo, hi),
                    _ => {
                        return Err(format!(
                            "--params: {name}={r}: a range is LO:HI in ns that narrows {name}'s physical range, {}-{} ns ({})",
                            u.lo, u.hi, u.why
                        ))
                    }
                }
            }
        };
        let default = base
            .hardware
            .get(&name)
            .expect("UNSOURCED_HARDWARE names hardware costs");
        if !(lo..=hi).contains(&default) {
            return Err(format!(
                "--params: {name}'s range {lo}-{hi} ns excludes its default {default} ns; a fit starts from and pulls towards the default"
            ));
        }
        out.push(FreeCost {
            name,
            lo,
            hi,
            default,
        });
    }
    Ok(out)
}

/// The `vmmu` command line (without the cost model) that models `run` on the host.
fn model_args(run: &Run, arm64: bool) -> Result<Vec<String>, String> {
    let sub = match run.test {
        Selftest::DirtyLogPerf => "dirty-log",
        Selftest::KvmPageTable => "page-table",
        Selftest::AccessTrackingPerf => "access-tracking",
    };
    let mut a: Vec<String> = vec![sub.into()];
    a.extend(run.args.iter().cloned());
    a.extend(["--arch", if arm64 { "arm64" } else { "x86" }].map(String::from));
    let at = |what: String| format!("{}:{}: {what}", run.file, run.line);
    let yes = |k: &str, v: &str| match v {
        "Y" | "y" | "1" | "true" => Ok(true),
        "N" | "n" | "0" | "false" => Ok(false),
        _ => Err(at(format!(
            "`{k}={v}`: a module parameter's value is Y or N"
        ))),
    };
    let (mut tdp_mmu, mut ept, mut eager_split, mut pml) = (None, None, None, None);
    for (k, v) in &run.params {
        let slot = match k.as_str() {
            "tdp_mmu" => &mut tdp_mmu,
            "ept" => &mut ept,
            "eager_page_split" => &mut eager_split,
            "enable_pml" | "pml" => &mut pml,
            _ => {
                return Err(at(format!(
                    "unknown module parameter `{k}`; vmmu fit models tdp_mmu, eager_page_split, ept and enable_pml"
                )))
            }
        };
        *slot = Some(yes(k, v)?);
    }
    if arm64 && !run.params.is_empty() {
        return Err(at(
            "the module parameters vmmu fit reads are x86's (kvm, kvm_intel); on arm64 give model switches in `# vmmu:` (eager splitting is the VMM's KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE: `# vmmu: --eager-split on`)".into(),
        ));
    }
    let on_off = |b: bool| if b { "on" } else { "off" }.to_string();
    if run.test == Selftest::AccessTrackingPerf {
        // access_tracking_perf_test neither logs dirty pages nor splits: eager splitting and PML
        // do not change what it measures, and the model runs it with EPT.
        if ept == Some(false) {
            return Err(at(
                "the model runs access_tracking_perf_test with EPT only (ept=Y)".into(),
            ));
        }
        if let Some(t) = tdp_mmu {
            a.extend(["--mmu".into(), if t { "tdp" } else { "shadow" }.into()]);
        }
    } else if ept == Some(false) {
        // Without EPT KVM uses the shadow MMU whatever tdp_mmu says (kvm_configure_mmu():
        // tdp_mmu_enabled = tdp_mmu_allowed && tdp_enabled), and forces enable_pml off
        // (vmx_hardware_setup()).
        a.extend(["--mmu", "shadow", "--ept", "off"].map(String::from));
        if let Some(e) = eager_split {
            a.extend(["--eager-split".into(), on_off(e)]);
        }
    } else {
        if let Some(t) = tdp_mmu {
            a.extend(["--mmu".into(), if t { "tdp" } else { "shadow" }.into()]);
        }
        if let Some(e) = eager_split {
            a.extend(["--eager-split".into(), on_off(e)]);
        }
        if let Some(p) = pml {
            a.extend(["--pml".into(), on_off(p)]);
        }
    }
    a.extend(run.vmmu_flags.iter().cloned());
    a.extend(["--engine", "virtual", "--no-counters", "--quiet"].map(String::from));
    Ok(a)
}

/// [`model_args`], checked to be a command line vmmu's parser takes (before any run starts).
fn checked_model_args(run: &Run, arm64: bool) -> Result<Vec<String>, String> {
    let a = model_args(run, arm64)?;
    let argv = std::iter::once("vmmu".to_string())
        .chain(a.iter().cloned())
        .chain(["--cost-model", "cost.json"].map(String::from));
    if let Err(e) = crate::Cli::try_parse_from(argv) {
        let line = e.render().to_string();
        let first = line
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches("error: ");
        return Err(format!(
            "{}:{}: the model cannot run `{}` as `vmmu {}`: {first}",
            run.file,
            run.line,
            run.command(),
            a.join(" ")
        ));
    }
    Ok(a)
}

/// How much simulation a run is, to start the heaviest first: its vCPUs times its memory (each
/// vCPU's in dirty_log_perf_test, the region every vCPU walks in the others).
fn weight(run: &Run) -> u64 {
    let arg = |flag: &str| {
        run.args
            .iter()
            .position(|a| a == flag)
            .and_then(|i| run.args.get(i + 1))
    };
    let vcpus = arg("-v").and_then(|v| v.parse::<u64>().ok()).unwrap_or(1);
    let bytes = arg("-b")
        .and_then(|b| vmmu::units::parse_size(b).ok())
        .unwrap_or(1 << 30);
    vcpus.saturating_mul(bytes >> 20)
}

/// Runs the model as child processes of this binary, `jobs` at a time
/// ([`vmmu::lab::sweep::run_points`]).
struct Children {
    exe: PathBuf,
    dir: PathBuf,
    arm64: bool,
    jobs: usize,
    quiet: bool,
    /// Cost files written so far (each distinct cost model of a batch gets one).
    written: AtomicUsize,
}

impl Children {
    fn run_one(&self, job: &ModelJob<'_>, cost_file: &Path) -> Result<Vec<Measurement>, LabError> {
        // Checked by fit() before any run: building it again is a few string copies.
        let args = model_args(job.run, self.arm64).map_err(LabError::Invalid)?;
        let out = Command::new(&self.exe)
            .args(&args)
            .arg("--cost-model")
            .arg(cost_file)
            .output()
            .map_err(|e| LabError::Check(format!("cannot run {}: {e}", self.exe.display())))?;
        let shown = format!(
            "vmmu {} --cost-model {}",
            args.join(" "),
            cost_file.display()
        );
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let why = err
                .lines()
                .last()
                .unwrap_or("")
                .trim_start_matches("vmmu: ");
            // Exit 2 is the model refusing the configuration: the input's fault.
            if out.status.code() == Some(2) {
                return Err(LabError::Invalid(format!(
                    "{}:{}: the model does not run `{}` as `{shown}`: {why}",
                    job.run.file,
                    job.run.line,
                    job.run.command()
                )));
            }
            return Err(LabError::Check(format!(
                "{}:{}: `{shown}` failed ({}): {why}",
                job.run.file, job.run.line, out.status
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        fit::parse_output(job.run.test, &text).map_err(|(line, what)| {
            LabError::Check(format!("the output of `{shown}`, line {line}: {what}"))
        })
    }

    /// Writes each distinct cost model of `jobs` to a file once: each job's file.
    fn cost_files(&self, jobs: &[ModelJob<'_>]) -> Result<Vec<PathBuf>, LabError> {
        let mut written: Vec<(&CostModel, PathBuf)> = Vec::new();
        let mut out = Vec::with_capacity(jobs.len());
        for j in jobs {
            let path = match written.iter().find(|(c, _)| *c == j.cost) {
                Some((_, p)) => p.clone(),
                None => {
                    let n = self.written.fetch_add(1, Ordering::Relaxed);
                    let p = self.dir.join(format!("cost-{n}.json"));
                    j.cost.save(&p)?;
                    written.push((j.cost, p.clone()));
                    p
                }
            };
            out.push(path);
        }
        Ok(out)
    }
}

impl RunModel for Children {
    fn run_all(&self, jobs: &[ModelJob<'_>]) -> Result<Vec<Vec<Measurement>>, LabError> {
        let files = self.cost_files(jobs)?;
        let points: Vec<(&ModelJob<'_>, &PathBuf)> = jobs.iter().zip(&files).collect();
        vmmu::lab::sweep::run_points(
            &points,
            self.jobs,
            |(j, _)| weight(j.run),
            |(j, _)| j.run.command(),
            !self.quiet,
            |(j, f)| self.run_one(j, f),
        )
    }
}

/// Runs `vmmu fit`.
pub fn fit(args: &FitArgs) -> ExitCode {
    let bad = |e: String| {
        eprintln!("vmmu: {e} (see 'vmmu fit --help')");
        ExitCode::from(2)
    };
    let host = match parse_host(&args.host) {
        Ok(h) => h,
        Err(e) => return bad(e),
    };
    if !(args.pull.is_finite() && args.pull >= 0.0) {
        return bad(format!("--pull {}: a finite weight, 0 or more", args.pull));
    }
    let mut base = match &args.cost_model {
        Some(p) => match CostModel::load(p) {
            Ok(m) => m,
            Err(e) => return bad(e.to_string()),
        },
        None if host.arm64 => CostModel::default_arm64(),
        None => CostModel::default(),
    };
    base.host.sockets = host.sockets;
    base.host.cpus_per_socket = host.cpus;
    let free = match free_costs(args.params.as_deref(), &base, host.arm64) {
        Ok(f) => f,
        Err(e) => return bad(e),
    };
    let mut runs = Vec::new();
    let mut names = Vec::new();
    for f in &args.files {
        let name = f.display().to_string();
        let text = match std::fs::read_to_string(f) {
            Ok(t) => t,
            Err(e) => return bad(format!("{name}: cannot read it: {e}")),
        };
        match fit::parse_file(&name, &text) {
            Ok(r) => runs.extend(r),
            Err(e) => return bad(e.to_string()),
        }
        names.push(name);
    }
    if let Some(list) = &args.timings {
        let wanted: Vec<&str> = list.split(',').filter(|w| !w.is_empty()).collect();
        for r in &mut runs {
            r.measurements
                .retain(|m| wanted.iter().any(|w| m.label.contains(w)));
        }
        runs.retain(|r| !r.measurements.is_empty());
        if runs.is_empty() {
            return bad(format!(
                "--timings {list}: no timing of the files has such a label"
            ));
        }
    }
    for r in &runs {
        if let Err(e) = checked_model_args(r, host.arm64) {
            return bad(e);
        }
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("vmmu: cannot find this program to run the model: {e}");
            return ExitCode::from(1);
        }
    };
    let dir = std::env::temp_dir().join(format!("vmmu-fit-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("vmmu: cannot create {}: {e}", dir.display());
        return ExitCode::from(1);
    }
    let options = FitOptions {
        rounds: args.rounds,
        pull: args.pull,
    };
    let model = Children {
        exe,
        dir: dir.clone(),
        arm64: host.arm64,
        jobs: args.jobs.map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |n| n as usize,
        ),
        quiet: args.quiet,
        written: AtomicUsize::new(0),
    };
    let result = fit::fit(runs, &base, &free, options, &model);
    let _ = std::fs::remove_dir_all(&dir);
    let fitted = match result {
        Ok(f) => f,
        Err(e @ LabError::Invalid(_)) => return bad(e.to_string()),
        Err(e) => {
            eprintln!("vmmu: {e}");
            return ExitCode::from(1);
        }
    };
    print!("{}", fit::report::text(&fitted));
    let written = (|| -> Result<(), String> {
        if let Some(p) = &args.out {
            fitted
                .cost_model(&base, &names)?
                .save(p)
                .map_err(|e| e.to_string())?;
            println!("Wrote the fitted cost model to {}.", p.display());
        }
        if let Some(p) = &args.csv {
            std::fs::write(p, fit::report::csv(&fitted))
                .map_err(|e| format!("cannot write {}: {e}", p.display()))?;
        }
        if let Some(p) = &args.plot {
            fit::report::plot_svg(&fitted, p)?;
        }
        Ok(())
    })();
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmmu: {e}");
            ExitCode::from(1)
        }
    }
}

/// Used by tests: the parse of `--host`.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_parse_and_bad_ones_say_what_is_allowed() {
        let h = parse_host("arch=x86,cpu=cascade-lake,sockets=2,cpus=48").unwrap();
        assert!(!h.arm64 && h.sockets == 2 && h.cpus == 48);
        assert!(
            parse_host("arch=arm64,cpu=neoverse-n1,sockets=1,cpus=80")
                .unwrap()
                .arm64
        );
        for (bad, says) in [
            ("arch=riscv,cpu=x,sockets=1,cpus=1", "x86 or arm64"),
            (
                "arch=x86,cpu=neoverse-n1,sockets=1,cpus=1",
                "the model knows",
            ),
            (
                "arch=x86,cpu=cascade-lake,sockets=0,cpus=1",
                "from 1 to 4096",
            ),
            ("arch=x86,cpu=cascade-lake,cpus=1", "names no sockets"),
            ("x86", "is not KEY=VALUE"),
        ] {
            let e = parse_host(bad).err().unwrap();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn ranges_must_hold_their_defaults() {
        let base = CostModel::default();
        let f = free_costs(Some("pml_log_ns=1:100,tlbi_ns"), &base, false).unwrap();
        assert_eq!((f[0].lo, f[0].hi, f[0].default), (1.0, 100.0, 5.0));
        let e = free_costs(Some("pml_log_ns=10:100"), &base, false).unwrap_err();
        assert!(e.contains("excludes its default 5 ns"), "{e}");
        let e = free_costs(Some("vm_exit_entry_ns"), &base, false).unwrap_err();
        assert!(e.contains("not an unsourced hardware cost"), "{e}");
        let e = free_costs(Some("pml_log_ns=0.1:100"), &base, false).unwrap_err();
        assert!(e.contains("narrows pml_log_ns's physical range"), "{e}");
        let e = free_costs(Some("tlbi_is_ns"), &base, false).unwrap_err();
        assert!(e.contains("not paid on x86"), "{e}");
        let all = free_costs(None, &base, false).unwrap();
        assert!(all.iter().any(|c| c.name == "pml_log_ns"));
        assert!(all.iter().all(|c| c.name != "dsb_ish_ns"));
    }

    fn run(test: &str, params: &str) -> Run {
        let text = format!("# cmd: ./{test} -v 1\n# param: {params}\nPopulating memory : 1s\nPopulate memory time: 1s\n");
        // Only the lines the selftest prints count; the other one is skipped by the test below.
        let text: String = text
            .lines()
            .filter(|l| !(test == "dirty_log_perf_test" && l.starts_with("Populating")))
            .filter(|l| !(test == "access_tracking_perf_test" && l.starts_with("Populate ")))
            .map(|l| format!("{l}\n"))
            .collect();
        fit::parse_file("f", &text).unwrap().remove(0)
    }

    #[test]
    fn module_parameters_become_the_flags_of_the_mmu_kvm_would_run() {
        let a = model_args(
            &run(
                "dirty_log_perf_test",
                "kvm.tdp_mmu=Y kvm_intel.ept=N kvm_intel.enable_pml=Y",
            ),
            false,
        )
        .unwrap();
        let a = a.join(" ");
        assert!(
            a.contains("--mmu shadow --ept off") && !a.contains("--pml"),
            "{a}"
        );
        let a = model_args(
            &run(
                "dirty_log_perf_test",
                "tdp_mmu=N eager_page_split=Y enable_pml=N",
            ),
            false,
        )
        .unwrap()
        .join(" ");
        assert!(a.contains("--mmu shadow --eager-split on --pml off"), "{a}");
        let a = model_args(
            &run(
                "access_tracking_perf_test",
                "eager_page_split=Y enable_pml=Y",
            ),
            false,
        )
        .unwrap()
        .join(" ");
        assert!(!a.contains("--eager-split") && !a.contains("--pml"), "{a}");
        let e = model_args(&run("dirty_log_perf_test", "eager_page_split=Y"), true).unwrap_err();
        assert!(e.contains("on arm64 give model switches"), "{e}");
        let e = model_args(&run("dirty_log_perf_test", "ept=maybe"), false).unwrap_err();
        assert!(e.contains("is Y or N"), "{e}");
    }
}
