//! What `vmmu fit` reads: files of selftest output, each run headed by the command line that
//! produced it, and the selftests' timing lines as [`Measurement`]s.
//!
//! A file holds one or more runs. Each starts with a header:
//!
//! ```text
//! # cmd: ./dirty_log_perf_test -v 8 -b 1G -i 2 -s anonymous_hugetlb_1gb
//! # param: tdp_mmu=N eager_page_split=Y enable_pml=Y
//! # vmmu: --arm64-lock spin
//! ```
//!
//! `# cmd:` (required) is the selftest and its arguments as run; `# param:` the host kernel's
//! module parameters that change what KVM does (`kvm.tdp_mmu`, `kvm.eager_page_split`,
//! `kvm_intel.ept`, `kvm_intel.enable_pml`; the module prefix is optional); `# vmmu:` model
//! switches for what the kernel's version decides and no parameter shows (which lock arm64's
//! `mmu_lock` is, for instance). The selftest's output follows, as it printed it: its timing
//! lines are the measurements, its informational lines are skipped, as are other `#` comments,
//! blank lines and kernel log lines (`[  123.456] ...`, when the console was captured with it).
//! Any other line is an error that names the file and line: a fit must not silently drop what
//! it cannot read.

use std::fmt;

/// A selftest `vmmu fit` can read, and the model runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Selftest {
    /// `dirty_log_perf_test` (`vmmu dirty-log`).
    DirtyLogPerf,
    /// `kvm_page_table_test` (`vmmu page-table`).
    KvmPageTable,
    /// `access_tracking_perf_test` (`vmmu access-tracking`).
    AccessTrackingPerf,
}

/// The selftests [`Selftest`] reads, as their programs are named.
pub const SELFTESTS: &str = "dirty_log_perf_test, kvm_page_table_test, access_tracking_perf_test";

impl Selftest {
    /// The selftest a program path names (`./dirty_log_perf_test`, `x86_64/...`).
    pub fn from_program(program: &str) -> Option<Selftest> {
        match program.rsplit('/').next().unwrap_or(program) {
            "dirty_log_perf_test" => Some(Selftest::DirtyLogPerf),
            "kvm_page_table_test" => Some(Selftest::KvmPageTable),
            "access_tracking_perf_test" => Some(Selftest::AccessTrackingPerf),
            _ => None,
        }
    }

    /// The program's name.
    pub fn program(self) -> &'static str {
        match self {
            Selftest::DirtyLogPerf => "dirty_log_perf_test",
            Selftest::KvmPageTable => "kvm_page_table_test",
            Selftest::AccessTrackingPerf => "access_tracking_perf_test",
        }
    }

    /// Whether `label` names one of this selftest's timings.
    fn is_timing(self, label: &str) -> bool {
        match self {
            Selftest::DirtyLogPerf => {
                matches!(
                    label,
                    "Populate memory time"
                        | "Enabling dirty logging time"
                        | "Disabling dirty logging time"
                ) || label
                    .strip_prefix("Iteration ")
                    .and_then(|r| r.split_once(' '))
                    .is_some_and(|(n, what)| {
                        n.parse::<u32>().is_ok()
                            && matches!(
                                what,
                                "dirty memory time" | "get dirty log time" | "clear dirty log time"
                            )
                    })
            }
            Selftest::KvmPageTable => label
                .strip_prefix("KVM_")
                .and_then(|r| r.strip_suffix(": total execution time"))
                .is_some_and(|stage| {
                    !stage.is_empty() && stage.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                }),
            Selftest::AccessTrackingPerf => matches!(
                label,
                "Populating memory"
                    | "Writing to populated memory"
                    | "Reading from populated memory"
                    | "Mark memory idle"
                    | "Writing to idle memory"
                    | "Reading from idle memory"
            ),
        }
    }

    /// Whether `line` is one of this selftest's informational lines (or the model's own
    /// annotations of its output: counters, the oracle's verdict).
    fn is_informational(self, line: &str) -> bool {
        const COMMON: &[&str] = &[
            "Testing guest mode:",
            "guest physical test memory",
            "Guest physical test memory",
            "Host  virtual  test memory",
            "Host virtual test memory",
            "Random seed:",
            "Oracle:",
            "vCPUs met on a page:",
        ];
        const DIRTY_LOG: &[&str] = &[
            "Test iterations:",
            "Get dirty log over",
            "Clear dirty log over",
        ];
        const PAGE_TABLE: &[&str] = &[
            "Adjust stage:",
            "Testing memory backing src",
            "Testing memory size",
            "Number of testing vCPUs:",
            "Started all vCPUs successfully",
            "Guest memory is",
        ];
        const ACCESS_TRACKING: &[&str] = &["WARNING: vCPU"];
        let extra: &[&str] = match self {
            Selftest::DirtyLogPerf => DIRTY_LOG,
            Selftest::KvmPageTable => PAGE_TABLE,
            Selftest::AccessTrackingPerf => ACCESS_TRACKING,
        };
        line.starts_with("  [") || COMMON.iter().chain(extra).any(|p| line.starts_with(p))
    }
}

impl fmt::Display for Selftest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.program())
    }
}

/// One timing a selftest printed: `label` (e.g. `Iteration 1 dirty memory time`), its
/// occurrence among the run's lines with that label (1 for the first; access_tracking prints
/// `Mark memory idle` twice), and the seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// The line's label, as the selftest prints it (trailing padding removed).
    pub label: String,
    /// 1 for the first line with this label in the run, 2 for the second, ...
    pub nth: u32,
    /// The time printed, in seconds.
    pub seconds: f64,
}

impl Measurement {
    /// The label with its occurrence when it is not the first (`Mark memory idle #2`).
    pub fn key(&self) -> String {
        if self.nth == 1 {
            self.label.clone()
        } else {
            format!("{} #{}", self.label, self.nth)
        }
    }
}

/// One measured run: the command line, the kernel's parameters and what it printed.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// The file it was read from.
    pub file: String,
    /// The line of its `# cmd:` header.
    pub line: usize,
    /// The selftest.
    pub test: Selftest,
    /// Its arguments, after the program.
    pub args: Vec<String>,
    /// The kernel's module parameters from `# param:` (module prefix removed), in file order.
    pub params: Vec<(String, String)>,
    /// Model switches from `# vmmu:`.
    pub vmmu_flags: Vec<String>,
    /// Its timings, in the order printed.
    pub measurements: Vec<Measurement>,
}

impl Run {
    /// The command line as the header gave it (program name without its directory).
    pub fn command(&self) -> String {
        std::iter::once(self.test.program().to_string())
            .chain(self.args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// A line `vmmu fit` cannot use: the file, the line (1-based) and what is wrong.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{file}:{line}: {what}")]
pub struct InputError {
    /// The file.
    pub file: String,
    /// The line, 1-based.
    pub line: usize,
    /// What is wrong, and what is allowed.
    pub what: String,
}

/// Reads one line of `test`'s output into `out`: a timing is added (repeated labels
/// numbered), informational lines are skipped; a line `test` never prints is an error that says
/// what is allowed.
fn read_output_line(test: Selftest, raw: &str, out: &mut Vec<Measurement>) -> Result<(), String> {
    let line = raw.trim_end();
    if line.trim().is_empty() || is_kernel_log(line) || test.is_informational(line) {
        return Ok(());
    }
    if let Some((label, value)) = line.rsplit_once(": ") {
        let label = label.trim_end();
        // Newer access_tracking_perf_test names its idle-marking mode; the model marks memory
        // idle through page_idle only.
        let label = match label {
            "Mark memory idle (page_idle)" if test == Selftest::AccessTrackingPerf => {
                "Mark memory idle"
            }
            "Mark memory idle (lru_gen)" if test == Selftest::AccessTrackingPerf => {
                return Err(format!(
                    "`{}`: the model marks memory idle through page_idle only, not MGLRU's lru_gen",
                    line.trim()
                ))
            }
            l => l,
        };
        if test.is_timing(label) {
            if let Some(seconds) = value
                .trim()
                .strip_suffix('s')
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
            {
                let label = label.to_string();
                let nth = out.iter().filter(|m| m.label == label).count() as u32 + 1;
                out.push(Measurement {
                    label,
                    nth,
                    seconds,
                });
                return Ok(());
            }
        }
    }
    Err(format!(
        "`{}` is not a line {test} prints (a timing `LABEL: SECONDSs` or one of its informational lines)",
        line.trim()
    ))
}

/// A kernel log line on the console: `[  428.372525] text`.
fn is_kernel_log(line: &str) -> bool {
    line.strip_prefix('[')
        .and_then(|r| r.split_once(']'))
        .is_some_and(|(t, _)| {
            let t = t.trim();
            !t.is_empty() && t.chars().all(|c| c.is_ascii_digit() || c == '.')
        })
}

/// The timings in `text`, the output of one run of `test` (the model's own output reads the
/// same way). Errors: the 1-based line and what is wrong.
pub fn parse_output(test: Selftest, text: &str) -> Result<Vec<Measurement>, (usize, String)> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        read_output_line(test, raw, &mut out).map_err(|e| (i + 1, e))?;
    }
    Ok(out)
}

/// The runs in `text`, the contents of the file named `file`.
pub fn parse_file(file: &str, text: &str) -> Result<Vec<Run>, InputError> {
    let err = |line: usize, what: String| InputError {
        file: file.to_string(),
        line,
        what,
    };
    let mut runs: Vec<Run> = Vec::new();
    // Whether the last run's output has begun: its `# param:` and `# vmmu:` lines must come
    // before it, right under its `# cmd:`, so that none can be read as the next run's.
    let mut output_begun = false;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim();
        if let Some(cmd) = line.strip_prefix("# cmd:") {
            let mut words = cmd.split_whitespace();
            let program = words
                .next()
                .ok_or_else(|| err(n, "`# cmd:` names no selftest".into()))?;
            let test = Selftest::from_program(program).ok_or_else(|| {
                err(
                    n,
                    format!("`{program}` is not a selftest vmmu fit reads; it reads {SELFTESTS}"),
                )
            })?;
            runs.push(Run {
                file: file.to_string(),
                line: n,
                test,
                args: words.map(str::to_string).collect(),
                params: Vec::new(),
                vmmu_flags: Vec::new(),
                measurements: Vec::new(),
            });
            output_begun = false;
            continue;
        }
        if is_header(line) && (runs.is_empty() || output_begun) {
            return Err(err(
                n,
                "a `# param:` or `# vmmu:` line belongs right under its run's `# cmd:` line, before the run's output".into(),
            ));
        }
        let Some(run) = runs.last_mut() else {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            return Err(err(
                n,
                "selftest output before any `# cmd: ./SELFTEST ARGS` line: each run needs the command line that produced it".into(),
            ));
        };
        if let Some(params) = line.strip_prefix("# param:") {
            for p in params.split_whitespace() {
                let (k, v) = p.split_once('=').ok_or_else(|| {
                    err(
                        n,
                        format!("`{p}` is not a module parameter: write NAME=VALUE"),
                    )
                })?;
                let k = k.rsplit('.').next().unwrap_or(k);
                run.params.push((k.to_string(), v.to_string()));
            }
        } else if let Some(flags) = line.strip_prefix("# vmmu:") {
            run.vmmu_flags
                .extend(flags.split_whitespace().map(str::to_string));
        } else if !line.starts_with('#') {
            output_begun |= !line.is_empty();
            read_output_line(run.test, raw, &mut run.measurements).map_err(|e| err(n, e))?;
        }
    }
    if runs.is_empty() {
        return Err(err(
            1,
            "no `# cmd: ./SELFTEST ARGS` line: each run needs the command line that produced it"
                .into(),
        ));
    }
    if let Some(r) = runs.iter().find(|r| r.measurements.is_empty()) {
        return Err(err(
            r.line,
            format!("the run of `{}` has no timing line", r.command()),
        ));
    }
    Ok(runs)
}

fn is_header(line: &str) -> bool {
    ["# cmd:", "# param:", "# vmmu:"]
        .iter()
        .any(|h| line.starts_with(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dirty_log_run_reads_every_timing_and_skips_the_rest() {
        let text = "# cmd: ./dirty_log_perf_test -v 2 -b 1G -i 2\n# param: kvm.tdp_mmu=N eager_page_split=Y\n\
Test iterations: 2\nTesting guest mode: PA-bits:ANY, VA-bits:48,  4K pages\n\
[  428.372525] hrtimer: interrupt took 20407088 ns\n\
Populate memory time: 0.5s\nEnabling dirty logging time: 0.001618723s\n\n\
Iteration 1 dirty memory time: 0.326340139s\nIteration 1 get dirty log time: 0.000032768s\n\
Get dirty log over 1 iterations took 0.000032768s. (Avg 0.000032768s/iteration)\n";
        let runs = parse_file("f.txt", text).unwrap();
        assert_eq!(runs.len(), 1);
        let r = &runs[0];
        assert_eq!(r.test, Selftest::DirtyLogPerf);
        assert_eq!(r.args, ["-v", "2", "-b", "1G", "-i", "2"]);
        assert_eq!(
            r.params,
            [
                ("tdp_mmu".to_string(), "N".to_string()),
                ("eager_page_split".to_string(), "Y".to_string())
            ]
        );
        let keys: Vec<_> = r.measurements.iter().map(Measurement::key).collect();
        assert_eq!(
            keys,
            [
                "Populate memory time",
                "Enabling dirty logging time",
                "Iteration 1 dirty memory time",
                "Iteration 1 get dirty log time"
            ]
        );
        assert_eq!(r.measurements[2].seconds, 0.326340139);
    }

    #[test]
    fn repeated_labels_are_numbered() {
        let out = "Populating memory             : 0.02s\nMark memory idle              : 0.19s\n\
Writing to idle memory        : 0.0005s\nMark memory idle              : 0.2s\n";
        let m = parse_output(Selftest::AccessTrackingPerf, out).unwrap();
        assert_eq!(m[3].key(), "Mark memory idle #2");
        assert_eq!(m[3].seconds, 0.2);
    }

    #[test]
    fn page_table_stages_are_timings() {
        let out =
            "Number of testing vCPUs: 1\nKVM_CREATE_MAPPINGS: total execution time: 0.0186s\n\n\
KVM_UNMAP_VM_DELETE_MEMSLOT: total execution time: 0.0017s\n\
vCPUs met on a page: 9 of 10 faults found another vCPU's fault had done their work (90.0%)\n";
        let m = parse_output(Selftest::KvmPageTable, out).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(
            m[1].label,
            "KVM_UNMAP_VM_DELETE_MEMSLOT: total execution time"
        );
    }

    #[test]
    fn unknown_lines_and_missing_headers_are_errors_that_name_the_line() {
        let e = parse_file(
            "a.txt",
            "# cmd: ./dirty_log_perf_test -v 1\nPopulate memory time: 1s\nsomething else\n",
        )
        .unwrap_err();
        assert_eq!((e.file.as_str(), e.line), ("a.txt", 3));
        assert!(e
            .to_string()
            .starts_with("a.txt:3: `something else` is not a line dirty_log_perf_test prints"));
        let e = parse_file("b.txt", "Populate memory time: 1s\n").unwrap_err();
        assert_eq!(e.line, 1);
        assert!(e.what.contains("# cmd:"));
        let e = parse_file("c.txt", "# cmd: ./mmu_stress_test -v 2\n").unwrap_err();
        assert!(e.what.contains("not a selftest vmmu fit reads"), "{e}");
        let e = parse_file(
            "d.txt",
            "# cmd: ./dirty_log_perf_test\nTest iterations: 2\n",
        )
        .unwrap_err();
        assert!(e.what.contains("no timing line"), "{e}");
        let e =
            parse_file("e.txt", "# cmd: ./dirty_log_perf_test\n# param: tdp_mmu\n").unwrap_err();
        assert_eq!(e.line, 2);
        let e = parse_file(
            "g.txt",
            "# cmd: ./dirty_log_perf_test\nPopulate memory time: 1s\n# param: tdp_mmu=N\n",
        )
        .unwrap_err();
        assert_eq!(e.line, 3);
        assert!(e.what.contains("right under its run's `# cmd:`"), "{e}");
        let e =
            parse_file("h.txt", "# vmmu: --hz 100\n# cmd: ./dirty_log_perf_test\n").unwrap_err();
        assert_eq!(e.line, 1);
        let e = parse_output(
            Selftest::AccessTrackingPerf,
            "Mark memory idle (lru_gen)    : 1s\n",
        )
        .unwrap_err();
        assert!(e.1.contains("page_idle only"), "{e:?}");
        let m = parse_output(
            Selftest::AccessTrackingPerf,
            "Mark memory idle (page_idle)  : 1s\n",
        )
        .unwrap();
        assert_eq!(m[0].label, "Mark memory idle");
        // A timing of another selftest is not this one's.
        let e = parse_file(
            "f.txt",
            "# cmd: ./dirty_log_perf_test\nKVM_CREATE_MAPPINGS: total execution time: 1s\n",
        )
        .unwrap_err();
        assert_eq!(e.line, 2);
    }
}
