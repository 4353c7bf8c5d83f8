//! The result of a `dirty-log` run, printed in dirty_log_perf_test's format (the same lines, so
//! existing scripts parse it) or as JSON. Every backend fills the same structure.

use crate::lab::params::DirtyLogParams;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Formats nanoseconds as the selftests print a `timespec`: `%ld.%.9lds`.
pub fn fmt_ts(ns: u64) -> String {
    format!("{}.{:09}s", ns / 1_000_000_000, ns % 1_000_000_000)
}

/// The oracle line's verdict on the page-table invariants: `hold`, or how often they were
/// violated.
pub fn invariants_verdict(violations: usize) -> String {
    if violations == 0 {
        "hold".to_string()
    } else {
        format!("violated {violations} times")
    }
}

/// A phase's non-zero counters as one indented line (`  [name] key=value ...`, which selftest
/// parsers skip), or `None` when it has none.
pub fn counter_line(name: &str, ph: &Phase) -> Option<String> {
    counters_line(name, ph.counters.as_ref()?)
}

/// [`counter_line`] of a bare set of counters.
pub fn counters_line(name: &str, counters: &PhaseCounters) -> Option<String> {
    let body: Vec<String> = counters
        .iter()
        .filter(|(_, v)| **v != 0)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    (!body.is_empty()).then(|| format!("  [{name}] {}", body.join(" ")))
}

/// Named counters of one phase: faults by kind, `mmu_lock` acquisitions and contentions, pages
/// split, flushes. Names are stable (they are JSON keys); the model and real KVM report different
/// sets, so this is a map rather than a struct.
pub type PhaseCounters = BTreeMap<String, u64>;

/// One timed phase of the run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Phase {
    /// Elapsed time of the phase, as the selftest measures it.
    pub wall_ns: u64,
    /// What the MMU did during the phase, when the backend can see it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters: Option<PhaseCounters>,
}

/// The counters that are gauges, the state at a phase's end (leaves mapped at each size), not
/// counts of what happened during it.
pub const GAUGE_COUNTERS: [&str; 3] = ["mapped_4k", "mapped_2m", "mapped_1g"];

impl Phase {
    /// This phase and `later` as one: times and counts added, gauges as `later` left them.
    pub fn then(&self, later: &Phase) -> Phase {
        let counters = match (&self.counters, &later.counters) {
            (Some(a), Some(b)) => {
                let mut c = a.clone();
                for (k, v) in b {
                    if GAUGE_COUNTERS.contains(&k.as_str()) {
                        c.insert(k.clone(), *v);
                    } else {
                        *c.entry(k.clone()).or_insert(0) += v;
                    }
                }
                Some(c)
            }
            (a, b) => b.clone().or_else(|| a.clone()),
        };
        Phase {
            wall_ns: self.wall_ns + later.wall_ns,
            counters,
        }
    }
}

/// How often the vCPUs met on a page: faults whose slow half found that another vCPU's fault
/// had done their work (`pf_spurious`), of every fault (`ept_violations`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meetings {
    /// Faults that found another vCPU's fault had done their work.
    pub met: u64,
    /// Every fault.
    pub faults: u64,
}

impl Meetings {
    /// Adds what `phase` counted (nothing when the backend counts nothing: real KVM).
    pub fn add(&mut self, phase: &Phase) {
        if let Some(c) = &phase.counters {
            self.add_counters(c);
        }
    }

    /// Adds what a phase's counters `c` say.
    pub fn add_counters(&mut self, c: &PhaseCounters) {
        self.met += c.get("pf_spurious").copied().unwrap_or(0);
        self.faults += c.get("ept_violations").copied().unwrap_or(0);
    }

    /// The report's line, or `None` when no fault met another.
    pub fn line(&self) -> Option<String> {
        (self.met > 0).then(|| {
            format!(
                "vCPUs met on a page: {} of {} faults found another vCPU's fault had done their work ({:.1}%)",
                self.met,
                self.faults,
                100.0 * self.met as f64 / self.faults.max(1) as f64
            )
        })
    }
}

/// One dirty-memory iteration and the harvest that follows it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct IterationReport {
    /// 1-based iteration number, as printed.
    pub iteration: u32,
    /// vCPUs dirtying memory.
    pub dirty: Phase,
    /// `KVM_GET_DIRTY_LOG` on every slot.
    pub get: Phase,
    /// `KVM_CLEAR_DIRTY_LOG` on every slot (manual-protect mode only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clear: Option<Phase>,
    /// Pages reported dirty by this harvest.
    pub dirty_pages: u64,
}

/// What the dirty-log completeness oracle found.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OracleReport {
    /// Harvests checked.
    pub harvests_checked: u64,
    /// Written pages whose report was checked, summed over harvests.
    pub pages_checked: u64,
    /// Gfns written before a harvest began and reported by none (at most the first 16).
    pub lost_gfns: Vec<u64>,
    /// How many such pages in all.
    pub lost_pages: u64,
    /// Page-table invariant violations found at the end (empty when the check passed or did not
    /// apply to the backend).
    pub invariant_errors: Vec<String>,
}

impl OracleReport {
    /// True when nothing was lost and no invariant broke.
    pub fn passed(&self) -> bool {
        self.lost_pages == 0 && self.invariant_errors.is_empty()
    }

    /// The verdict as the text report's last line; `invariants` says whether the backend's
    /// page tables could be checked (the model's) or not (real KVM's).
    pub fn verdict_line(&self, invariants: bool) -> String {
        let checked = format!(
            "{} harvest(s) checked, {} written page(s) looked for",
            self.harvests_checked, self.pages_checked
        );
        let tables = if invariants {
            "page-table invariants checked"
        } else {
            "page tables not inspectable"
        };
        if self.passed() {
            format!("Oracle: passed: {checked}, none lost; {tables}")
        } else {
            format!(
                "Oracle: FAILED: {checked}, {} lost; {} invariant violation(s)",
                self.lost_pages,
                self.invariant_errors.len()
            )
        }
    }
}

/// The whole `dirty-log` run.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DirtyLogReport {
    /// Which backend ran it: `model` or `kvm`.
    pub backend: String,
    /// Which engine drove the model (`threads`), or empty for real KVM.
    pub engine: String,
    /// Which MMU flavour (`tdp`), or what the host kernel uses for real KVM.
    pub mmu: String,
    /// The parameters, after defaults.
    pub params: DirtyLogParams,
    /// The guest physical test memory range `[start, end)`.
    pub test_memory: (u64, u64),
    /// vCPUs faulting in memory for the first time.
    pub populate: Phase,
    /// Setting `KVM_MEM_LOG_DIRTY_PAGES` on every slot.
    pub enable: Phase,
    /// The iterations, in order.
    pub iterations: Vec<IterationReport>,
    /// Clearing `KVM_MEM_LOG_DIRTY_PAGES` on every slot.
    pub disable: Phase,
    /// The oracles' verdict.
    pub oracle: OracleReport,
    /// How often the vCPUs met on a page, over the iterations (whose counters a streamed run
    /// does not keep); the other phases add theirs in [`DirtyLogReport::meetings`].
    #[serde(default)]
    pub iteration_meetings: Meetings,
    /// Where this run sits in a comparison run as separate jobs (`--emit-jobs`), for
    /// `vmmu tables`; absent from an ordinary run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<SweepPoint>,
}

/// One point of a sweep run as a separate job: the comparison it belongs to and its column.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SweepPoint {
    /// The technique compared (`eager-split`), as `--compare` names it; empty for a plain
    /// vCPU sweep.
    pub technique: String,
    /// The column (side) this run fills (`eager_page_split=Y`).
    pub column: String,
    /// The configuration line the tables print above each table.
    pub config: String,
}

/// A phase of a `dirty-log` run that has just ended, as a streaming caller sees it.
#[derive(Copy, Clone, Debug)]
pub enum PhaseEvent<'a> {
    /// The vCPUs populated memory.
    Populate(&'a Phase),
    /// Dirty logging was enabled.
    Enable(&'a Phase),
    /// An iteration and its harvest.
    Iteration(&'a IterationReport),
    /// Dirty logging was disabled.
    Disable(&'a Phase),
}

impl PhaseEvent<'_> {
    /// The phase's name in JSON lines (`populate`, `enable`, `iteration`, `disable`).
    pub fn name(&self) -> &'static str {
        match self {
            PhaseEvent::Populate(_) => "populate",
            PhaseEvent::Enable(_) => "enable",
            PhaseEvent::Iteration(_) => "iteration",
            PhaseEvent::Disable(_) => "disable",
        }
    }

    /// The selftest's lines for this phase, each followed by its counters' line when asked.
    pub fn selftest_text(&self, with_counters: bool) -> String {
        let mut s = String::new();
        let counters = |s: &mut String, name: &str, ph: &Phase| {
            if let (true, Some(line)) = (with_counters, counter_line(name, ph)) {
                let _ = writeln!(s, "{line}");
            }
        };
        match self {
            PhaseEvent::Populate(ph) => {
                let _ = writeln!(s, "Populate memory time: {}", fmt_ts(ph.wall_ns));
                counters(&mut s, "populate", ph);
            }
            PhaseEvent::Enable(ph) => {
                let _ = writeln!(s, "Enabling dirty logging time: {}\n", fmt_ts(ph.wall_ns));
                counters(&mut s, "enable", ph);
            }
            PhaseEvent::Iteration(it) => {
                let i = it.iteration;
                let _ = writeln!(
                    s,
                    "Iteration {i} dirty memory time: {}",
                    fmt_ts(it.dirty.wall_ns)
                );
                counters(&mut s, &format!("iteration {i} dirty"), &it.dirty);
                let _ = writeln!(
                    s,
                    "Iteration {i} get dirty log time: {}",
                    fmt_ts(it.get.wall_ns)
                );
                counters(&mut s, &format!("iteration {i} get"), &it.get);
                if let Some(c) = &it.clear {
                    let _ = writeln!(
                        s,
                        "Iteration {i} clear dirty log time: {}",
                        fmt_ts(c.wall_ns)
                    );
                    counters(&mut s, &format!("iteration {i} clear"), c);
                }
            }
            PhaseEvent::Disable(ph) => {
                let _ = writeln!(s, "Disabling dirty logging time: {}", fmt_ts(ph.wall_ns));
                counters(&mut s, "disable", ph);
            }
        }
        s
    }
}

/// Who hears of each phase as it ends: the CLI streams a run's lines this way. The report
/// holds the parameters and what ran so far.
pub trait PhaseSink {
    /// `event` just ended.
    fn phase(&mut self, report: &DirtyLogReport, event: PhaseEvent<'_>);

    /// Whether the report keeps each iteration's counters once told (a sink that printed them
    /// does not need them again, and a run of many iterations then holds only their times).
    fn keeps_iteration_counters(&self) -> bool {
        true
    }
}

/// Nobody listens.
impl PhaseSink for () {
    fn phase(&mut self, _: &DirtyLogReport, _: PhaseEvent<'_>) {}
}

impl DirtyLogReport {
    /// The selftest's lines before the first phase: iterations, guest mode, test memory, seed.
    pub fn header_text(&self) -> String {
        let mut s = String::new();
        let p = &self.params;
        let _ = writeln!(s, "Test iterations: {}", p.iterations);
        match p.guest_mode {
            Some(_) => {
                let mode = p.mode().map(|m| m.name()).unwrap_or_default();
                let _ = writeln!(s, "Testing guest mode: {mode}");
            }
            // x86's one mode maps the guest with 4K pages; under shadow paging the guest's own
            // tables may map 2M pages instead (--guest-page-size), and the line says so.
            None => {
                let page = if p.mmu.shadow_paging()
                    && p.guest_page_level == crate::x86::spte::PG_LEVEL_2M
                {
                    "2M"
                } else {
                    "4K"
                };
                let _ = writeln!(
                    s,
                    "Testing guest mode: PA-bits:ANY, VA-bits:48,  {page} pages"
                );
            }
        }
        let _ = writeln!(
            s,
            "guest physical test memory: [{:#x}, {:#x})",
            self.test_memory.0, self.test_memory.1
        );
        let _ = writeln!(s, "Random seed: {}", p.random_seed);
        s
    }

    /// How often the vCPUs met on a page over the whole run.
    pub fn meetings(&self) -> Meetings {
        let mut m = self.iteration_meetings;
        for ph in [&self.populate, &self.enable, &self.disable] {
            m.add(ph);
        }
        m
    }

    /// The selftest's lines after the last phase: the GET and CLEAR totals, how often the
    /// vCPUs met on a page, and the oracle's verdict.
    pub fn footer_text(&self) -> String {
        let mut s = String::new();
        let get_total: u64 = self.iterations.iter().map(|it| it.get.wall_ns).sum();
        let clear_total: u64 = self
            .iterations
            .iter()
            .filter_map(|it| it.clear.as_ref().map(|c| c.wall_ns))
            .sum();
        let n = self.iterations.len().max(1) as u64;
        let _ = writeln!(
            s,
            "Get dirty log over {} iterations took {}. (Avg {}/iteration)",
            self.iterations.len(),
            fmt_ts(get_total),
            fmt_ts(get_total / n)
        );
        if self.params.manual_protect {
            let _ = writeln!(
                s,
                "Clear dirty log over {} iterations took {}. (Avg {}/iteration)",
                self.iterations.len(),
                fmt_ts(clear_total),
                fmt_ts(clear_total / n)
            );
        }
        if let Some(line) = self.meetings().line() {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "{}", self.oracle.verdict_line(self.backend == "model"));
        s
    }

    /// Every phase of the run, in order.
    pub fn events(&self) -> impl Iterator<Item = PhaseEvent<'_>> {
        [
            PhaseEvent::Populate(&self.populate),
            PhaseEvent::Enable(&self.enable),
        ]
        .into_iter()
        .chain(self.iterations.iter().map(PhaseEvent::Iteration))
        .chain(std::iter::once(PhaseEvent::Disable(&self.disable)))
    }

    /// The run in dirty_log_perf_test's text format, followed by the counters of each phase
    /// (indented lines that start with two spaces, so selftest parsers skip them): the lines a
    /// streaming run prints phase by phase, at once.
    pub fn to_selftest_text(&self, with_counters: bool) -> String {
        let mut s = self.header_text();
        for ev in self.events() {
            s.push_str(&ev.selftest_text(with_counters));
        }
        s.push_str(&self.footer_text());
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_mode_line_says_which_pages_the_guest_maps() {
        let mut r = DirtyLogReport::default();
        assert!(r
            .to_selftest_text(false)
            .contains("Testing guest mode: PA-bits:ANY, VA-bits:48,  4K pages"));
        r.params.mmu = crate::vm::MmuKind::Shadow { ept: false };
        assert!(r.to_selftest_text(false).contains("VA-bits:48,  2M pages"));
        r.params.guest_page_level = crate::x86::spte::PG_LEVEL_4K;
        assert!(r.to_selftest_text(false).contains("VA-bits:48,  4K pages"));
    }

    #[test]
    fn the_verdict_line_says_what_was_checked_and_what_failed() {
        let mut o = OracleReport {
            harvests_checked: 2,
            pages_checked: 10,
            ..Default::default()
        };
        assert_eq!(
            o.verdict_line(true),
            "Oracle: passed: 2 harvest(s) checked, 10 written page(s) looked for, none lost; page-table invariants checked"
        );
        assert!(o
            .verdict_line(false)
            .ends_with("page tables not inspectable"));
        o.lost_pages = 3;
        o.invariant_errors.push("x".into());
        assert_eq!(
            o.verdict_line(true),
            "Oracle: FAILED: 2 harvest(s) checked, 10 written page(s) looked for, 3 lost; 1 invariant violation(s)"
        );
    }

    #[test]
    fn timespec_format_matches_the_selftests() {
        assert_eq!(fmt_ts(0), "0.000000000s");
        assert_eq!(fmt_ts(1_500_000_001), "1.500000001s");
    }

    #[test]
    fn text_has_every_selftest_line() {
        let r = DirtyLogReport {
            params: DirtyLogParams {
                iterations: 2,
                ..Default::default()
            },
            iterations: (1..=2)
                .map(|i| IterationReport {
                    iteration: i,
                    clear: Some(Phase::default()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        let t = r.to_selftest_text(false);
        for line in [
            "Populate memory time: ",
            "Enabling dirty logging time: ",
            "Iteration 1 dirty memory time: ",
            "Iteration 2 get dirty log time: ",
            "Iteration 2 clear dirty log time: ",
            "Disabling dirty logging time: ",
            "Get dirty log over 2 iterations took ",
            "Clear dirty log over 2 iterations took ",
        ] {
            assert!(t.contains(line), "missing {line:?} in\n{t}");
        }
    }
}
