//! What a `nested-churn` run reports: each round's boots and teardown, the deletion of memslot
//! 0, the oracles; as text, side by side, and as a chart.

use super::*;

/// One round: its boots and its teardown.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RoundReport {
    /// 1-based.
    pub round: u32,
    /// Booting the round's L2s (all of them, concurrently).
    pub boot: Phase,
    /// Destroying them.
    pub teardown: Phase,
    /// The shadow pages after the teardown.
    pub census: PageCensus,
}

/// The oracles' verdict.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NestedOracle {
    /// L2 pages whose backing page was checked.
    pub pages_checked: u64,
    /// Of those, pages that did not hold what the L2 wrote.
    pub misplaced: u64,
    /// The first few, described.
    pub first_misplaced: Vec<String>,
    /// Page-table invariant violations after the run.
    pub invariant_errors: Vec<String>,
}

impl NestedOracle {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.misplaced == 0 && self.invariant_errors.is_empty()
    }
}

/// The whole run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NestedChurnReport {
    /// Which engine drove the model.
    pub engine: String,
    /// The parameters.
    pub params: NestedChurnParams,
    /// The page quota the run had.
    pub quota: u64,
    /// Every round.
    pub rounds: Vec<RoundReport>,
    /// Deleting memslot 0 at shutdown.
    pub delete_slot0: Phase,
    /// The shadow pages before the deletion.
    pub before_delete: PageCensus,
    /// The oracles.
    pub oracle: NestedOracle,
}

/// The switch's name in reports, with the kernel it follows.
pub fn zap_orphans_label(z: ZapOrphans) -> &'static str {
    match z {
        ZapOrphans::On => "on (Linux 5.9+)",
        ZapOrphans::V1 => "v1 (the seed's first version)",
        ZapOrphans::Off => "off (Linux 5.8 and earlier)",
    }
}

impl NestedChurnReport {
    /// A table of the rounds, the deletion and the verdict.
    pub fn to_text(&self, with_counters: bool) -> String {
        let p = &self.params;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "nested-churn: L1 {} GiB with {} vCPUs (shadow MMU, ept=Y tdp_mmu=N, quota {} pages), {} L2s of {} MiB at a time, {} rounds, zap orphans {}, {} engine",
            p.l1_memory >> 30,
            p.l1_vcpus,
            self.quota,
            p.concurrent,
            p.l2_memory >> 20,
            p.rounds,
            zap_orphans_label(p.zap_orphans),
            self.engine
        );
        let _ = writeln!(
            s,
            "round   boot time     teardown   pages used  reachable    stale  orphans  max hash  max rmap  flooded  recycled"
        );
        for r in &self.rounds {
            let c = &r.census;
            let _ = writeln!(
                s,
                "{:5}  {:>11}  {:>11}  {:11}  {:9}  {:7}  {:7}  {:8}  {:8}  {:7}  {:8}",
                r.round,
                fmt_ts(r.boot.wall_ns),
                fmt_ts(r.teardown.wall_ns),
                c.used,
                c.reachable,
                c.stale,
                c.orphans,
                c.max_hash_chain,
                c.max_rmap,
                c.flooded,
                c.recycled
            );
            if with_counters {
                for (name, ph) in [("boot", &r.boot), ("teardown", &r.teardown)] {
                    if let Some(line) = crate::lab::report::counter_line(name, ph) {
                        let _ = writeln!(s, "{line}");
                    }
                }
            }
        }
        if let (Some(first), Some(last)) = (self.rounds.first(), self.rounds.last()) {
            let a = first.boot.wall_ns as f64;
            let b = last.boot.wall_ns as f64;
            let _ = writeln!(
                s,
                "Boot time of round {} against round 1: {:+.1}%",
                last.round,
                (b / a - 1.0) * 100.0
            );
        }
        let d = &self.delete_slot0;
        let count = |k: &str| {
            d.counters
                .as_ref()
                .and_then(|c| c.get(k).copied())
                .unwrap_or(0)
        };
        let _ = writeln!(
            s,
            "Deleting memslot 0 ({}): {}, {} shadow pages zapped, {} SPTEs read, {} rmap removals walking {} extra descriptors",
            match p.slot_zap {
                SlotZap::AllFast => "kvm_mmu_zap_all_fast",
                SlotZap::Memslot => "kvm_mmu_zap_memslot",
            },
            fmt_ts(d.wall_ns),
            count("sp_zapped"),
            count("spte_reads"),
            count("rmap_removes"),
            count("rmap_desc_steps")
        );
        let mut met = crate::lab::report::Meetings::default();
        for r in &self.rounds {
            met.add(&r.boot);
            met.add(&r.teardown);
        }
        if let Some(line) = met.line() {
            let _ = writeln!(s, "{line}");
        }
        let o = &self.oracle;
        let _ = writeln!(
            s,
            "Oracle: {} L2 pages checked in L1 memory, {} misplaced; page-table invariants {}",
            o.pages_checked,
            o.misplaced,
            crate::lab::report::invariants_verdict(o.invariant_errors.len())
        );
        for e in o
            .first_misplaced
            .iter()
            .chain(o.invariant_errors.iter().take(8))
        {
            let _ = writeln!(s, "  {e}");
        }
        s
    }
}

/// Draws the boot time of every round, one line per report (a side of a comparison), into the
/// SVG file `path`.
pub fn plot_boot_times(
    path: &std::path::Path,
    reports: &[NestedChurnReport],
) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| chart::draw_error(path, e);
    let rounds = reports
        .iter()
        .map(|r| r.rounds.len())
        .max()
        .unwrap_or(1)
        .max(2) as u32;
    let y_max = reports
        .iter()
        .flat_map(|r| r.rounds.iter().map(|x| x.boot.wall_ns as f64 / 1e9))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let root = chart::svg_area(path, (800, 520))?;
    let p = &reports[0].params;
    let title = format!(
        "nested-churn: {} L2s of {} MiB per round under a {} GiB L1",
        p.concurrent,
        p.l2_memory >> 20,
        p.l1_memory >> 30
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(1u32..rounds, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("round")
        .y_desc("boot time of the round's L2s (s)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(u32, f64)> = r
            .rounds
            .iter()
            .map(|x| (x.round, x.boot.wall_ns as f64 / 1e9))
            .collect();
        let label = format!("zap orphans {}", zap_orphans_label(r.params.zap_orphans));
        chart::labelled_line(&mut chart, points.clone(), color, label).map_err(|e| err(&e))?;
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart::legend(&mut chart, None).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// The sides of a comparison: boot time and stale pages per round, then the deletion.
pub fn compare_text(reports: &[NestedChurnReport]) -> String {
    let mut s = String::new();
    let p = &reports[0].params;
    let _ = writeln!(
        s,
        "nested-churn --compare zap-orphans: L1 {} GiB with {} vCPUs, {} L2s of {} MiB at a time, {} rounds, {} engine",
        p.l1_memory >> 30,
        p.l1_vcpus,
        p.concurrent,
        p.l2_memory >> 20,
        p.rounds,
        reports[0].engine
    );
    let names: Vec<&str> = reports
        .iter()
        .map(|r| match r.params.zap_orphans {
            ZapOrphans::On => "on",
            ZapOrphans::V1 => "v1",
            ZapOrphans::Off => "off",
        })
        .collect();
    let _ = write!(s, "round");
    for n in &names {
        let _ = write!(s, "  boot ({n:>3})  stale ({n:>3})");
    }
    let _ = writeln!(s);
    for i in 0..reports[0].rounds.len() {
        let _ = write!(s, "{:5}", i + 1);
        for r in reports {
            let round = &r.rounds[i];
            let _ = write!(
                s,
                "  {:>10}  {:11}",
                crate::lab::report::fmt_ts(round.boot.wall_ns),
                round.census.stale
            );
        }
        let _ = writeln!(s);
    }
    for (r, n) in reports.iter().zip(&names) {
        let first = r.rounds.first().map_or(1, |x| x.boot.wall_ns) as f64;
        let last = r.rounds.last().map_or(1, |x| x.boot.wall_ns) as f64;
        let zapped = r
            .delete_slot0
            .counters
            .as_ref()
            .and_then(|c| c.get("sp_zapped").copied())
            .unwrap_or(0);
        let _ = writeln!(
            s,
            "zap orphans {n}: boot time of the last round {:+.1}% against the first; deleting memslot 0 took {} ({} shadow pages zapped); max hash chain {}, max rmap {}",
            (last / first - 1.0) * 100.0,
            crate::lab::report::fmt_ts(r.delete_slot0.wall_ns),
            zapped,
            r.before_delete.max_hash_chain,
            r.before_delete.max_rmap
        );
    }
    let checked: u64 = reports.iter().map(|r| r.oracle.pages_checked).sum();
    let misplaced: u64 = reports.iter().map(|r| r.oracle.misplaced).sum();
    let inv: usize = reports
        .iter()
        .map(|r| r.oracle.invariant_errors.len())
        .sum();
    let _ = writeln!(
        s,
        "Oracle: {checked} L2 pages checked in L1 memory, {misplaced} misplaced; page-table invariants {}",
        crate::lab::report::invariants_verdict(inv)
    );
    s
}
