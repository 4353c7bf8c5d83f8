//! What a migration reports: its phases and rounds, the guests' slowdown spans and the
//! destination oracle's verdict, as text, a side-by-side comparison and an SVG timeline.

use super::MigrateParams;
use crate::lab::report::{counters_line, fmt_ts, PhaseCounters};
use crate::lab::{chart, LabError};
use crate::units::PAGE_SIZE;
use serde::{Deserialize, Serialize};

/// A stretch of the migration, for the timeline's marks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationPhase {
    /// "enable dirty logging", "round 0 (bulk)", "round N", "stop-and-copy".
    pub name: String,
    /// Start, in ns since the guests' workload started.
    pub start_ns: u64,
    /// End, likewise.
    pub end_ns: u64,
}

/// One round of the migration.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RoundReport {
    /// 0 is the bulk round (everything once).
    pub round: u32,
    /// Pages the round sent.
    pub pages_sent: u64,
    /// Time in the sync that ended the round (`KVM_GET_DIRTY_LOG`, or the rings' reap and
    /// `KVM_RESET_DIRTY_RINGS`).
    pub get_ns: u64,
    /// Time in `KVM_CLEAR_DIRTY_LOG` calls during the round.
    pub clear_ns: u64,
    /// `KVM_CLEAR_DIRTY_LOG` calls.
    pub clears: u64,
    /// Pages the sync that ended the round found dirty (what the next round sends).
    pub dirty_after: u64,
    /// The round's wall (or virtual) time, sync included.
    pub ns: u64,
    /// What every actor counted during the round.
    pub counters: Option<PhaseCounters>,
}

/// Time spent with the guests' throughput more than a threshold below the baseline.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// The threshold, in percent of slowdown.
    pub over_percent: u32,
    /// All buckets above it, in ns.
    pub total_ns: u64,
    /// The longest run of consecutive buckets above it, in ns.
    pub longest_ns: u64,
}

/// The destination oracle's verdict.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MigrateOracle {
    /// Pages compared.
    pub pages_compared: u64,
    /// Pages whose content differs.
    pub mismatched: u64,
    /// The first few of them.
    pub mismatched_gfns: Vec<u64>,
    /// Page-table invariant violations at the end.
    pub invariant_errors: Vec<String>,
}

/// One migration's report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MigrateReport {
    /// `threads` or `virtual`.
    pub engine: String,
    /// The MMU.
    pub mmu: String,
    /// The parameters.
    pub params: MigrateParams,
    /// The column of a `--compare` ("" otherwise).
    pub side: String,
    /// Populating memory (before the timeline starts).
    pub populate_ns: u64,
    /// The migration's stretches, in order.
    pub phases: Vec<MigrationPhase>,
    /// `memory_global_dirty_log_start()`.
    pub enable_ns: u64,
    /// Every round, the bulk one first.
    pub rounds: Vec<RoundReport>,
    /// Stop-and-copy started because the rest fit the downtime limit (not forced by the
    /// round limit).
    pub converged: bool,
    /// Pages sent during stop-and-copy.
    pub final_pages: u64,
    /// From the vCPUs' pause to the last page sent.
    pub downtime_ns: u64,
    /// Auto-converge's throttle when the vCPUs were paused, in percent.
    #[serde(default)]
    pub final_throttle_pct: u32,
    /// Dirty ring: reaps because a vCPU's ring was full, and by the once-a-second reaper.
    #[serde(default)]
    pub ring_full_reaps: u64,
    /// See `ring_full_reaps`.
    #[serde(default)]
    pub reaper_reaps: u64,
    /// From enabling dirty logging to the last page sent.
    pub total_ns: u64,
    /// Pages sent in all.
    pub pages_sent: u64,
    /// What every actor counted during stop-and-copy.
    pub stop_counters: Option<PhaseCounters>,
    /// Accesses per bucket (all vCPUs), from the workload's start to the last page sent.
    pub throughput: Vec<u64>,
    /// The same without migration.
    pub baseline: Vec<u64>,
    /// Per vCPU, accesses per bucket (`[vcpu][bucket]`).
    pub vcpu_throughput: Vec<Vec<u64>>,
    /// The buckets of the live migration, `[start, end)`: from its start to the last bucket
    /// that ends before the vCPUs are paused (empty if it was shorter than a bucket).
    pub live_buckets: (usize, usize),
    /// Over 99, 50 and 10 % slowdown, during the live migration.
    pub spans: Vec<Span>,
    /// The destination oracle.
    pub oracle: MigrateOracle,
}

impl MigrateReport {
    /// The slowdown of each bucket against the baseline (0 where the baseline did nothing).
    pub fn slowdown(&self) -> Vec<f64> {
        self.throughput
            .iter()
            .zip(&self.baseline)
            .map(|(&m, &b)| {
                if b == 0 {
                    0.0
                } else {
                    (1.0 - m as f64 / b as f64).max(0.0)
                }
            })
            .collect()
    }

    /// Counter `key` summed over the rounds (the live migration, before stop-and-copy).
    pub fn live_count(&self, key: &str) -> u64 {
        self.rounds
            .iter()
            .filter_map(|x| x.counters.as_ref())
            .map(|c| c.get(key).copied().unwrap_or(0))
            .sum()
    }

    /// The oracle's verdict as one line, or `None` when the destination equals the source.
    pub fn oracle_failure(&self) -> Option<String> {
        let o = &self.oracle;
        if o.mismatched > 0 {
            let gfns: Vec<String> = o
                .mismatched_gfns
                .iter()
                .map(|g| format!("{g:#x}"))
                .collect();
            return Some(format!(
                "migration oracle: {} of {} destination page(s) differ from the source, first gfns {}",
                o.mismatched,
                o.pages_compared,
                gfns.join(" ")
            ));
        }
        o.invariant_errors.first().map(|e| {
            format!(
                "page-table invariants: {} violation(s), first: {e}",
                o.invariant_errors.len()
            )
        })
    }
}

/// The spans over 99, 50 and 10 % of `slowdown[first..end]`.
pub(super) fn spans(slowdown: &[f64], (first, end): (usize, usize), bucket_ns: u64) -> Vec<Span> {
    [99, 50, 10]
        .into_iter()
        .map(|pct| {
            let (mut total, mut run, mut longest) = (0, 0, 0);
            for s in slowdown.iter().take(end).skip(first) {
                if *s * 100.0 > pct as f64 {
                    total += 1;
                    run += 1;
                    longest = longest.max(run);
                } else {
                    run = 0;
                }
            }
            Span {
                over_percent: pct,
                total_ns: total * bucket_ns,
                longest_ns: longest * bucket_ns,
            }
        })
        .collect()
}

/// A bandwidth as people write it: `10Gbit/s`, `2.5 GB/s`.
pub fn fmt_bandwidth(bps: u64) -> String {
    if bps.is_multiple_of(1_000_000_000) {
        format!("{} Gbit/s", bps / 1_000_000_000)
    } else if bps.is_multiple_of(1_000_000) {
        format!("{} Mbit/s", bps / 1_000_000)
    } else {
        format!("{bps} bit/s")
    }
}

/// Bytes as GiB with two decimals.
fn gib(pages: u64) -> String {
    format!(
        "{:.2} GiB",
        (pages * PAGE_SIZE) as f64 / (1u64 << 30) as f64
    )
}

impl MigrateReport {
    /// The run's parameters, as the header prints them.
    fn header(&self) -> String {
        let p = &self.params;
        format!(
            "Migrating {} vCPUs x {} MiB ({}), {} backing, {} engine: working set {} MiB per vCPU, {}% writes{}, think {} ns; link {}, downtime limit {} ms, at most {} rounds after the bulk one{}\n",
            p.vm.vcpus,
            p.vm.vcpu_memory_bytes >> 20,
            self.mmu,
            p.vm.backing,
            self.engine,
            p.working_set_bytes >> 20,
            p.vm.write_percent,
            if p.vm.random_access { " at random" } else { "" },
            p.think_ns,
            fmt_bandwidth(p.bandwidth_bps),
            p.downtime_ns / 1_000_000,
            p.max_rounds,
            if p.auto_converge {
                ", auto-converge"
            } else {
                ""
            }
        )
    }

    /// The spans line: `>99%: 12.300000000s (longest 5.100000000s)` for each threshold.
    pub fn spans_text(&self) -> String {
        self.spans
            .iter()
            .map(|s| {
                format!(
                    ">{}%: {} (longest {})",
                    s.over_percent,
                    fmt_ts(s.total_ns),
                    fmt_ts(s.longest_ns)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The report as text: the phases as they happened, the totals, the guest slowdown and
    /// the oracle; with `counters`, what each round counted; with `timeline`, one line per
    /// bucket.
    pub fn to_text(&self, counters: bool, timeline: bool) -> String {
        use std::fmt::Write as _;
        let mut s = self.header();
        let _ = writeln!(s, "Populate memory time: {}", fmt_ts(self.populate_ns));
        let _ = writeln!(s, "Enabling dirty logging time: {}", fmt_ts(self.enable_ns));
        for r in &self.rounds {
            let _ = writeln!(
                s,
                "Round {}{}: {} sent {} pages, {} CLEAR calls {}, sync {}, then {} pages dirty",
                r.round,
                if r.round == 0 { " (bulk)" } else { "" },
                fmt_ts(r.ns),
                r.pages_sent,
                r.clears,
                fmt_ts(r.clear_ns),
                fmt_ts(r.get_ns),
                r.dirty_after
            );
            if let Some(line) = r
                .counters
                .as_ref()
                .filter(|_| counters)
                .and_then(|c| counters_line(&format!("round {}", r.round), c))
            {
                let _ = writeln!(s, "{line}");
            }
        }
        if let Some(entries) = self.params.dirty_ring {
            let _ = writeln!(
                s,
                "Dirty ring ({entries} entries per vCPU): {} reaps for a full ring, {} by the reaper thread",
                self.ring_full_reaps,
                self.reaper_reaps
            );
        }
        if self.final_throttle_pct > 0 {
            let _ = writeln!(
                s,
                "Auto-converge: vCPUs throttled {}% at the end",
                self.final_throttle_pct
            );
        }
        let _ = writeln!(
            s,
            "Stop-and-copy ({}): {} pages, downtime {}",
            if self.converged {
                "converged"
            } else {
                "forced by the round limit"
            },
            self.final_pages,
            fmt_ts(self.downtime_ns)
        );
        if let Some(line) = self
            .stop_counters
            .as_ref()
            .filter(|_| counters)
            .and_then(|c| counters_line("stop-and-copy", c))
        {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s, "Total migration time: {}", fmt_ts(self.total_ns));
        let _ = writeln!(
            s,
            "Pages sent: {} ({}), rounds: {}",
            self.pages_sent,
            gib(self.pages_sent),
            self.rounds.len()
        );
        if !self.baseline.is_empty() {
            let _ = writeln!(
                s,
                "Guest slowdown during the live migration ({} buckets against the same run without migration): {}",
                fmt_ts(self.params.bucket_ns),
                self.spans_text()
            );
        }
        if timeline {
            let slow = self.slowdown();
            let _ = writeln!(s, "time          accesses   baseline   slowdown  phase");
            for (b, &m) in self.throughput.iter().enumerate() {
                let t = b as u64 * self.params.bucket_ns;
                let phase = self
                    .phases
                    .iter()
                    .find(|ph| ph.start_ns <= t && t < ph.end_ns.max(ph.start_ns + 1))
                    .map_or("", |ph| ph.name.as_str());
                let _ = writeln!(
                    s,
                    "{:>12}  {:>9}  {:>9}  {:>7.1}%  {}",
                    fmt_ts(t),
                    m,
                    self.baseline.get(b).copied().unwrap_or(0),
                    slow.get(b).copied().unwrap_or(0.0) * 100.0,
                    phase
                );
            }
        }
        // How often the vCPUs met on a page while the rounds ran.
        let mut met = crate::lab::report::Meetings::default();
        for c in self.rounds.iter().filter_map(|r| r.counters.as_ref()) {
            met.add_counters(c);
        }
        if let Some(line) = met.line() {
            let _ = writeln!(s, "{line}");
        }
        match self.oracle_failure() {
            None => {
                let _ = writeln!(
                    s,
                    "Oracle: the destination equals the source ({} pages compared)",
                    self.oracle.pages_compared
                );
            }
            Some(e) => {
                let _ = writeln!(s, "Oracle: FAILED: {e}");
            }
        }
        s
    }
}

/// Several runs side by side: a row per quantity, a column per side.
pub fn compare_text(reports: &[MigrateReport]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    if let Some(r) = reports.first() {
        s.push_str(&r.header());
    }
    let span = |r: &MigrateReport, i: usize, longest: bool| {
        r.spans.get(i).map_or("-".to_string(), |x| {
            fmt_ts(if longest { x.longest_ns } else { x.total_ns })
        })
    };
    type Row = (&'static str, Box<dyn Fn(&MigrateReport) -> String>);
    let rows: Vec<Row> = vec![
        ("Total migration time", Box::new(|r| fmt_ts(r.total_ns))),
        ("Rounds", Box::new(|r| r.rounds.len().to_string())),
        (
            "Converged",
            Box::new(|r| if r.converged { "yes" } else { "no" }.into()),
        ),
        ("Pages sent", Box::new(|r| r.pages_sent.to_string())),
        ("Downtime", Box::new(|r| fmt_ts(r.downtime_ns))),
        (
            "Dirty ring reaps (ring full + reaper)",
            Box::new(|r| format!("{} + {}", r.ring_full_reaps, r.reaper_reaps)),
        ),
        (
            "Auto-converge throttle at the end",
            Box::new(|r| format!("{}%", r.final_throttle_pct)),
        ),
        (
            "Enabling dirty logging time",
            Box::new(|r| fmt_ts(r.enable_ns)),
        ),
        (
            "Slowdown >99% (total)",
            Box::new(move |r| span(r, 0, false)),
        ),
        (
            "Slowdown >99% (longest)",
            Box::new(move |r| span(r, 0, true)),
        ),
        (
            "Slowdown >50% (total)",
            Box::new(move |r| span(r, 1, false)),
        ),
        (
            "Slowdown >10% (total)",
            Box::new(move |r| span(r, 2, false)),
        ),
        (
            "Faults (exits to KVM's fault handler)",
            Box::new(|r| r.live_count("ept_violations").to_string()),
        ),
        (
            "PML-full exits",
            Box::new(|r| r.live_count("pml_full_exits").to_string()),
        ),
        (
            "mmu_lock contentions (read + write)",
            Box::new(|r| {
                (r.live_count("mmu_lock_read_contended") + r.live_count("mmu_lock_write_contended"))
                    .to_string()
            }),
        ),
        (
            "mmu_lock waits, summed (read + write)",
            Box::new(|r| {
                fmt_ts(
                    r.live_count("mmu_lock_read_wait_ns") + r.live_count("mmu_lock_write_wait_ns"),
                )
            }),
        ),
        (
            "Oracle",
            Box::new(|r| {
                if r.oracle_failure().is_none() {
                    "ok"
                } else {
                    "FAILED"
                }
                .into()
            }),
        ),
    ];
    let width = reports
        .iter()
        .map(|r| r.side.len())
        .max()
        .unwrap_or(0)
        .max(16);
    let _ = write!(s, "{:<38}", "");
    for r in reports {
        let _ = write!(s, "| {:<width$} ", r.side);
    }
    let _ = writeln!(s, "|");
    for (name, f) in &rows {
        let _ = write!(s, "{name:<38}");
        for r in reports {
            let _ = write!(s, "| {:<width$} ", f(r));
        }
        let _ = writeln!(s, "|");
    }
    s
}

/// Draws each side's guest throughput (percent of the baseline, per bucket) over time into an
/// SVG file, with the migration's phases marked: a shaded band for enabling dirty logging and
/// for stop-and-copy, a dashed line where each round ends.
pub fn plot_timeline_svg(
    path: &std::path::Path,
    title: &str,
    reports: &[MigrateReport],
) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| chart::draw_error(path, e);
    let x_max = reports
        .iter()
        .map(|r| r.throughput.len() as f64 * r.params.bucket_ns as f64 / 1e9)
        .fold(0.0, f64::max)
        .max(1e-3);
    let root = chart::svg_area(path, (1000, 560))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..110.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the guests started")
        .y_desc("guest throughput, % of the run without migration")
        .draw()
        .map_err(|e| err(&e))?;
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    for (r, color) in reports.iter().zip(colors.into_iter().cycle()) {
        let w = r.params.bucket_ns as f64 / 1e9;
        let band = |a: u64, b: u64| {
            Rectangle::new(
                [(a as f64 / 1e9, 0.0), (b as f64 / 1e9, 110.0)],
                color.mix(0.08).filled(),
            )
        };
        let bands: Vec<_> = r
            .phases
            .iter()
            .filter(|p| p.name.starts_with("enable") || p.name.starts_with("stop"))
            .map(|p| band(p.start_ns, p.end_ns))
            .collect();
        chart.draw_series(bands).map_err(|e| err(&e))?;
        for p in r.phases.iter().filter(|p| p.name.starts_with("round")) {
            let x = p.end_ns as f64 / 1e9;
            chart
                .draw_series(DashedLineSeries::new(
                    vec![(x, 0.0), (x, 110.0)],
                    4,
                    4,
                    color.mix(0.5).stroke_width(1),
                ))
                .map_err(|e| err(&e))?;
        }
        let pts: Vec<(f64, f64)> = r
            .throughput
            .iter()
            .zip(&r.baseline)
            .enumerate()
            .map(|(b, (&m, &base))| {
                let pct = if base == 0 {
                    100.0
                } else {
                    100.0 * m as f64 / base as f64
                };
                ((b as f64 + 0.5) * w, pct.min(110.0))
            })
            .collect();
        let name = if r.side.is_empty() {
            "migration".to_string()
        } else {
            r.side.clone()
        };
        chart::labelled_line(&mut chart, pts, color, name).map_err(|e| err(&e))?;
    }
    chart::legend(&mut chart, Some(SeriesLabelPosition::LowerRight)).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_count_buckets_over_each_threshold_in_the_live_window() {
        let slow = [1.0, 0.995, 0.995, 0.6, 0.995, 0.2, 0.05, 1.0];
        let s = spans(&slow, (1, 7), 100);
        assert_eq!(
            s[0],
            Span {
                over_percent: 99,
                total_ns: 300,
                longest_ns: 200
            }
        );
        assert_eq!(s[1].total_ns, 400);
        assert_eq!(s[1].longest_ns, 400);
        assert_eq!(s[2].total_ns, 500);
    }
}
