//! `vmmu soak`: random small configurations of every subcommand ([`generate`]), each run as
//! its own `vmmu` process with every oracle on, several at a time, for as long as asked. Each
//! run ends in one [`Class`]; every failure is printed as it happens with the command line that
//! reproduces it, and the summary counts runs per subcommand and engine.

pub mod generate;

use generate::{config, Config, SUBCOMMANDS};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// `vmmu soak`'s arguments.
#[derive(clap::Args)]
pub struct SoakArgs {
    /// How long to start new runs, in minutes (runs in flight then are finished).
    #[arg(long, default_value_t = 10.0, value_parser = positive_minutes)]
    minutes: f64,
    /// Stop after this many runs, if that comes before --minutes.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    runs: Option<u64>,
    /// Runs at a time (default: this machine's CPUs).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    jobs: Option<u32>,
    /// The generator's seed (default: from the clock; printed, so a soak can be repeated).
    #[arg(long)]
    seed: Option<u64>,
    /// A run still going after this many seconds is a hang, and is killed.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    timeout: u64,
    /// The largest multiplier of a run's sizes (vCPUs, memory): most runs are at 1, some at
    /// 2, 4 or 8, which reach contended and long-running regimes.
    #[arg(long, default_value_t = 8, value_parser = max_scale)]
    max_scale: u64,
    /// Print the command lines of runs 0..N (--runs, default 20) instead of running them.
    #[arg(long)]
    list: bool,
    /// Run each virtual-time configuration again with `--fast-forward off`: a passing run's
    /// output must be the same, byte for byte, and a run that fails only with fast-forward on
    /// is fast-forward's failure (each a failure of its own class).
    #[arg(long)]
    compare_fast_forward: bool,
}

fn max_scale(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if generate::SCALES.contains(&n) => Ok(n),
        _ => Err(format!("{s:?} is not one of 1, 2, 4, 8")),
    }
}

fn positive_minutes(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(m) if m > 0.0 && m.is_finite() => Ok(m),
        _ => Err(format!("{s:?} is not a positive number of minutes")),
    }
}

/// How a run ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// Exit 0: every oracle passed.
    Pass,
    /// Exit 1 and an oracle's verdict in the output: a lost write, a stale translation, a
    /// broken invariant.
    OracleFailure,
    /// Exit 1 without an oracle's verdict: the run could not complete (an error it reported).
    RunFailed,
    /// The process panicked.
    Panic,
    /// The process died of a signal.
    Crash,
    /// Still running at `--timeout`: killed.
    Hang,
    /// Exit 2: the generator made a command line the CLI rejects (a soak defect).
    BadConfig,
    /// Passed, but stepping every actor in turn (`--fast-forward off`) printed something else;
    /// or failed, and passes stepped in turn.
    FastForwardDiffers,
    /// Any other exit status.
    UnexpectedExit,
}

impl Class {
    fn name(self) -> &'static str {
        match self {
            Class::Pass => "pass",
            Class::OracleFailure => "oracle failure",
            Class::RunFailed => "run failed",
            Class::Panic => "panic",
            Class::Crash => "crash",
            Class::Hang => "hang",
            Class::BadConfig => "bad configuration",
            Class::FastForwardDiffers => "fast-forward changed the output",
            Class::UnexpectedExit => "unexpected exit code",
        }
    }
}

/// One run's end.
struct Outcome {
    class: Class,
    /// What it printed on stdout.
    out: String,
    /// What the process said last (the line that explains a failure).
    said: String,
    wall: Duration,
}

/// Runs `vmmu soak`.
pub fn soak(a: &SoakArgs) -> ExitCode {
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    if a.list {
        // A reader that stops early (`| head`) ends the list.
        let mut out = std::io::stdout().lock();
        for i in 0..a.runs.unwrap_or(20) {
            if writeln!(out, "{}", config(seed, i, a.max_scale).command_line()).is_err() {
                break;
            }
        }
        return ExitCode::SUCCESS;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("vmmu: soak cannot find its own executable: {e}");
            return ExitCode::from(1);
        }
    };
    let jobs = a.jobs.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |j| j as usize,
    );
    let deadline = Instant::now() + Duration::from_secs_f64(a.minutes * 60.0);
    let limit = a.runs.unwrap_or(u64::MAX);
    let timeout = Duration::from_secs(a.timeout);
    eprintln!(
        "vmmu soak: seed {seed}, {jobs} at a time, for {} min{}, each run killed as hung after {} s",
        a.minutes,
        a.runs.map_or(String::new(), |n| format!(" or {n} runs")),
        a.timeout
    );
    let next = AtomicU64::new(0);
    let max_scale = a.max_scale;
    let compare_ff = a.compare_fast_forward;
    let (tx, rx) = mpsc::channel::<(u64, Config, Outcome)>();
    let mut tally = Tally::default();
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs {
            let tx = tx.clone();
            let (next, exe) = (&next, &exe);
            s.spawn(move || loop {
                if Instant::now() >= deadline {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= limit {
                    return;
                }
                let c = config(seed, i, max_scale);
                let o = run_compared(exe, &c, timeout, compare_ff);
                if tx.send((i, c, o)).is_err() {
                    return;
                }
            });
        }
        drop(tx);
        let mut last_report = Instant::now();
        for (i, c, o) in rx {
            if o.class != Class::Pass {
                println!(
                    "FAIL [{}] run {i} after {:.1} s: {}\n     {}",
                    o.class.name(),
                    o.wall.as_secs_f64(),
                    c.command_line(),
                    o.said
                );
            }
            tally.add(&c, &o);
            if last_report.elapsed() >= Duration::from_secs(30) {
                last_report = Instant::now();
                eprintln!(
                    "vmmu soak: {} runs in {:.0} s, {} failed",
                    tally.runs(),
                    started.elapsed().as_secs_f64(),
                    tally.failures.len()
                );
            }
        }
    });
    print!("{}", tally.summary(seed, started.elapsed()));
    if tally.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// Runs one configuration ([`run_one`]); with `compare_ff`, a virtual-time one runs again
/// stepping every actor in turn: one that passed must print the same, and one that failed
/// (other than a command line the CLI rejects) is fast-forward's failure when the run in
/// turn passes.
fn run_compared(exe: &std::path::Path, c: &Config, timeout: Duration, compare_ff: bool) -> Outcome {
    let mut o = run_one(exe, c, timeout, &[]);
    if !compare_ff || c.engine != "virtual" || o.class == Class::BadConfig {
        return o;
    }
    let off = run_one(exe, c, timeout, &["--fast-forward", "off"]);
    o.wall += off.wall;
    if o.class == Class::Pass && (off.class != Class::Pass || off.out != o.out) {
        o.class = Class::FastForwardDiffers;
        o.said = format!(
            "with --fast-forward off: {} ({})",
            off.class.name(),
            first_difference(&o.out, &off.out)
        );
    } else if o.class != Class::Pass && off.class == Class::Pass {
        o.said = format!("only with fast-forward on: {}: {}", o.class.name(), o.said);
        o.class = Class::FastForwardDiffers;
    }
    o
}

/// Where two outputs first differ: the line number and both lines.
fn first_difference(a: &str, b: &str) -> String {
    let (mut la, mut lb) = (a.lines(), b.lines());
    for n in 1.. {
        match (la.next(), lb.next()) {
            (None, None) => break,
            (x, y) if x == y => {}
            (x, y) => {
                return format!(
                    "line {n}: {:?} against {:?}",
                    x.unwrap_or(""),
                    y.unwrap_or("")
                )
            }
        }
    }
    "the same lines".to_string()
}

/// Runs one configuration as its own process (with `--quiet` and `extra`), killing it at
/// `timeout`.
fn run_one(exe: &std::path::Path, c: &Config, timeout: Duration, extra: &[&str]) -> Outcome {
    let start = Instant::now();
    let child = Command::new(exe)
        .arg(c.subcommand)
        .args(&c.args)
        .args(extra)
        .arg("--quiet")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(ch) => ch,
        Err(e) => {
            return Outcome {
                class: Class::UnexpectedExit,
                out: String::new(),
                said: format!("could not start: {e}"),
                wall: start.elapsed(),
            }
        }
    };
    // Drain both pipes beside the wait, so a talkative run never blocks on a full pipe.
    let drain = |p: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = p {
                let _ = p.read_to_end(&mut buf);
            }
            String::from_utf8_lossy(&buf).into_owned()
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Outcome {
                    class: Class::UnexpectedExit,
                    out: String::new(),
                    said: format!("could not wait for the run: {e}"),
                    wall: start.elapsed(),
                };
            }
        }
    };
    let wall = start.elapsed();
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    let last = |s: &str| {
        s.lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .map(str::to_string)
    };
    // A failed oracle is said on stderr as `vmmu: oracle failed: ...` (`oracle_exit()`).
    let oracle_line = err
        .lines()
        .find(|l| l.contains(crate::machine::ORACLE_FAILED))
        .map(str::to_string);
    let said = last(&err).or_else(|| last(&out)).unwrap_or_default();
    let class = match status {
        None => Class::Hang,
        Some(st) => match st.code() {
            Some(0) => Class::Pass,
            Some(1) if oracle_line.is_some() => Class::OracleFailure,
            Some(1) => Class::RunFailed,
            Some(2) => Class::BadConfig,
            Some(101) => Class::Panic,
            Some(_) => Class::UnexpectedExit,
            None if err.contains("panicked") => Class::Panic,
            None => Class::Crash,
        },
    };
    let said = match (class, oracle_line) {
        (Class::Hang, _) => format!("killed after {} s; last said: {said}", timeout.as_secs()),
        (Class::OracleFailure, Some(o)) => o,
        _ => said,
    };
    Outcome {
        class,
        out,
        said,
        wall,
    }
}

/// What the soak has seen so far.
#[derive(Default)]
struct Tally {
    /// (subcommand, engine) → runs by class.
    by: BTreeMap<(&'static str, &'static str), BTreeMap<Class, u64>>,
    /// Wall seconds per subcommand.
    wall: BTreeMap<&'static str, f64>,
    /// Every failure: class and command line.
    failures: Vec<(Class, String)>,
}

impl Tally {
    fn add(&mut self, c: &Config, o: &Outcome) {
        *self
            .by
            .entry((c.subcommand, c.engine))
            .or_default()
            .entry(o.class)
            .or_default() += 1;
        *self.wall.entry(c.subcommand).or_default() += o.wall.as_secs_f64();
        if o.class != Class::Pass {
            self.failures.push((o.class, c.command_line()));
        }
    }

    fn runs(&self) -> u64 {
        self.by.values().flat_map(|m| m.values()).sum()
    }

    /// The closing table: runs per subcommand on each engine, failures by class.
    fn summary(&self, seed: u64, took: Duration) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Soak (seed {seed}): {} runs in {:.0} s, {} failed",
            self.runs(),
            took.as_secs_f64(),
            self.failures.len()
        );
        let _ = writeln!(
            s,
            "{:<16} {:>8} {:>8} {:>8} {:>10}",
            "subcommand", "threads", "virtual", "failed", "mean wall"
        );
        for sub in SUBCOMMANDS {
            let n = |engine| -> u64 { self.by.get(&(sub, engine)).map_or(0, |m| m.values().sum()) };
            let failed: u64 = ["threads", "virtual"]
                .iter()
                .filter_map(|e| self.by.get(&(sub, *e)))
                .flat_map(|m| m.iter().filter(|(c, _)| **c != Class::Pass).map(|(_, n)| n))
                .sum();
            let runs = n("threads") + n("virtual");
            let mean = if runs == 0 {
                0.0
            } else {
                self.wall.get(sub).copied().unwrap_or(0.0) / runs as f64
            };
            let _ = writeln!(
                s,
                "{sub:<16} {:>8} {:>8} {failed:>8} {:>9.1}s",
                n("threads"),
                n("virtual"),
                mean
            );
        }
        for (class, line) in &self.failures {
            let _ = writeln!(s, "  [{}] {line}", class.name());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The harness's own negative controls: each way a run can end is classified as such
    /// (a shell stands in for `vmmu`: `sh -c SCRIPT --quiet`).
    #[test]
    fn every_way_a_run_ends_is_classified() {
        let sh = std::path::Path::new("/bin/sh");
        let run = |script: &str, timeout_ms: u64| {
            let c = Config {
                subcommand: "-c",
                args: vec![script.to_string()],
                engine: "virtual",
            };
            run_one(sh, &c, Duration::from_millis(timeout_ms), &[])
        };
        for (script, class) in [
            ("echo 'Oracle: passed'; exit 0", Class::Pass),
            (
                "echo 'Oracle: FAILED: 3 lost'; echo 'vmmu: oracle failed: 3 lost' >&2; exit 1",
                Class::OracleFailure,
            ),
            // A report whose oracles passed, then another failure.
            (
                "echo 'Oracle: passed'; echo 'vmmu: cannot write x.svg' >&2; exit 1",
                Class::RunFailed,
            ),
            ("echo 'vmmu: KVM_RUN failed' >&2; exit 1", Class::RunFailed),
            ("echo 'vmmu: -x 3: bad' >&2; exit 2", Class::BadConfig),
            (
                "echo 'thread main panicked at x' >&2; exit 101",
                Class::Panic,
            ),
            ("kill -SEGV $$", Class::Crash),
            ("exit 7", Class::UnexpectedExit),
        ] {
            let o = run(script, 20_000);
            assert_eq!(o.class, class, "{script}: {}", o.said);
        }
        let o = run("echo started >&2; exec sleep 5", 300);
        assert_eq!(o.class, Class::Hang);
        assert!(o.said.contains("last said: started"), "{}", o.said);
        assert!(o.wall < Duration::from_secs(4), "killed at the timeout");
        let o = run(
            "echo 'vmmu: oracle failed: 3 lost' >&2; echo 'vmmu: done' >&2; exit 1",
            20_000,
        );
        assert_eq!(o.said, "vmmu: oracle failed: 3 lost");
    }

    /// The fast-forward comparison's negative control: a run whose output depends on its
    /// arguments (a shell printing its `$0`, `--fast-forward` the second time) is caught,
    /// with the lines that differ; one that prints the same passes.
    #[test]
    fn a_run_that_prints_otherwise_when_stepped_in_turn_fails() {
        let sh = std::path::Path::new("/bin/sh");
        let c = |script: &str, engine| Config {
            subcommand: "-c",
            args: vec![script.to_string()],
            engine,
        };
        let t = Duration::from_secs(20);
        let o = run_compared(sh, &c("echo $0", "virtual"), t, true);
        assert_eq!(o.class, Class::FastForwardDiffers);
        assert!(
            o.said
                .contains(r#"line 1: "--quiet" against "--fast-forward""#),
            "{}",
            o.said
        );
        for (script, engine, compare) in [
            ("echo same", "virtual", true),
            ("echo $0", "threads", true),
            ("echo $0", "virtual", false),
        ] {
            let o = run_compared(sh, &c(script, engine), t, compare);
            assert_eq!(o.class, Class::Pass, "{script} on {engine}: {}", o.said);
        }
        // A run that fails only with fast-forward on (its `$0` is `--quiet` then) is
        // fast-forward's failure; one that fails both ways is an ordinary one.
        let only_on = r#"[ "$0" = --quiet ] && { echo 'vmmu: stalled' >&2; exit 1; }; echo ok"#;
        let o = run_compared(sh, &c(only_on, "virtual"), t, true);
        assert_eq!(o.class, Class::FastForwardDiffers);
        assert_eq!(
            o.said,
            "only with fast-forward on: run failed: vmmu: stalled"
        );
        let o = run_compared(sh, &c("exit 1", "virtual"), t, true);
        assert_eq!(o.class, Class::RunFailed);
    }
}
