//! Side-by-side runs: each side of a technique at each vCPU count, printed in the layout of the
//! seed cover letters' tables (rows: vCPU count; a column per side) and drawn as an SVG chart.

use crate::lab::params::DirtyLogParams;
use crate::lab::report::{fmt_ts, DirtyLogReport};
use crate::lab::{chart, LabError};
use plotters::prelude::*;
use std::fmt::Write as _;

/// Reads a time off a report (None when the run has no such phase).
pub type MetricFn = Box<dyn Fn(&DirtyLogReport) -> Option<u64>>;

/// A quantity of a `dirty-log` report: a time, by the selftest line that prints it, or a count.
pub struct Metric {
    /// The selftest line's name ("Iteration 1 dirty memory time").
    pub name: String,
    /// Reads it off a report (None when the run has no such phase).
    pub get: MetricFn,
    /// A count, printed as an integer (otherwise nanoseconds, printed as seconds).
    pub count: bool,
}

/// `CONFIG_LOCK_STAT`'s contentions of `mmu_lock` (both modes) during each iteration's dirty
/// phase, as seed 001's "number of contentions" column counts them.
pub fn contention_metrics(iterations: u32) -> Vec<Metric> {
    (1..=iterations as usize)
        .map(|i| Metric {
            name: format!("Iteration {i} mmu_lock contentions (read + write)"),
            get: Box::new(move |r: &DirtyLogReport| {
                let c = r.iterations.get(i - 1)?.dirty.counters.as_ref()?;
                Some(
                    c.get("mmu_lock_read_contended").copied().unwrap_or(0)
                        + c.get("mmu_lock_write_contended").copied().unwrap_or(0),
                )
            }),
            count: true,
        })
        .collect()
}

/// The metrics `--compare` tabulates, one per selftest line: first those of the seed's tables
/// (every iteration's dirty memory time, enabling dirty logging, the first iteration's GET and
/// CLEAR), then the rest (populating memory, the later iterations' GET and CLEAR, disabling
/// dirty logging). A CLEAR line exists only with manual protect.
pub fn dirty_log_metrics(iterations: u32) -> Vec<Metric> {
    let mut m: Vec<Metric> = (1..=iterations as usize)
        .map(|i| Metric {
            name: format!("Iteration {i} dirty memory time"),
            get: Box::new(move |r: &DirtyLogReport| {
                r.iterations.get(i - 1).map(|it| it.dirty.wall_ns)
            }),
            count: false,
        })
        .collect();
    m.push(Metric {
        name: "Enabling dirty logging time".into(),
        get: Box::new(|r| Some(r.enable.wall_ns)),
        count: false,
    });
    let harvest = |i: usize| {
        [
            Metric {
                name: format!("Iteration {i} get dirty log time"),
                get: Box::new(move |r: &DirtyLogReport| {
                    r.iterations.get(i - 1).map(|it| it.get.wall_ns)
                }),
                count: false,
            },
            Metric {
                name: format!("Iteration {i} clear dirty log time"),
                get: Box::new(move |r: &DirtyLogReport| {
                    r.iterations
                        .get(i - 1)
                        .and_then(|it| it.clear.as_ref())
                        .map(|c| c.wall_ns)
                }),
                count: false,
            },
        ]
    };
    m.extend(harvest(1));
    m.push(Metric {
        name: "Populate memory time".into(),
        get: Box::new(|r| Some(r.populate.wall_ns)),
        count: false,
    });
    for i in 2..=iterations as usize {
        m.extend(harvest(i));
    }
    m.push(Metric {
        name: "Disabling dirty logging time".into(),
        get: Box::new(|r| Some(r.disable.wall_ns)),
        count: false,
    });
    m
}

/// The runs of a comparison: per vCPU count, one report per side, in column order.
pub type CompareRuns = [(usize, Vec<DirtyLogReport>)];

/// One table in the seed layout: `config` is the header line, `columns` name the sides, `runs`
/// holds each row's reports in column order.
pub fn seed_table(
    config: &str,
    metric: &Metric,
    columns: &[&str],
    runs: &CompareRuns,
) -> Option<String> {
    let rows: Vec<(usize, Vec<u64>)> = runs
        .iter()
        .filter_map(|(n, sides)| {
            let v: Option<Vec<u64>> = sides.iter().map(|r| (metric.get)(r)).collect();
            Some((*n, v?))
        })
        .collect();
    if rows.is_empty() {
        return None;
    }
    let k = columns.len();
    let mut s = String::new();
    // The seed's box is 55 wide (two 26-wide columns); a longer config line widens it.
    let c = (55.max(config.len() + 8) - 2) / 2;
    let w = k * c + 3 * (k - 1);
    let _ = writeln!(s, "             | {:<w$} |", format!("Config: {config}"));
    let _ = writeln!(s, "             | {:<w$} |", metric.name);
    let _ = writeln!(s, "             | {} |", "-".repeat(w));
    let head: Vec<String> = columns.iter().map(|h| format!("{h:<c$}")).collect();
    let _ = writeln!(s, "vCPU Count   | {} |", head.join(" | "));
    let _ = writeln!(s, "------------ | {} |", vec!["-".repeat(c); k].join(" | "));
    for (n, vals) in rows {
        let cells: Vec<String> = vals
            .iter()
            .map(|&v| {
                let t = if metric.count {
                    v.to_string()
                } else {
                    fmt_ts(v)
                };
                format!("{t:<c$}")
            })
            .collect();
        let _ = writeln!(s, "{:<12} | {} |", n, cells.join(" | "));
    }
    Some(s)
}

/// Every metric of a comparison as CSV: a header, then one row per metric, vCPU count and side
/// (`line,vcpus,side,value`; times in seconds with nanosecond digits, counts as integers).
/// Metrics a run lacks are left out, as the tables leave them out.
pub fn csv(metrics: &[Metric], columns: &[&str], runs: &CompareRuns) -> String {
    let mut s = String::from("line,vcpus,side,value\n");
    for m in metrics {
        for (n, sides) in runs {
            for (side, r) in columns.iter().zip(sides) {
                if let Some(v) = (m.get)(r) {
                    let value = if m.count {
                        v.to_string()
                    } else {
                        fmt_ts(v).trim_end_matches('s').to_string()
                    };
                    let _ = writeln!(s, "{},{n},{side},{value}", m.name);
                }
            }
        }
    }
    s
}

/// Draws `metric` against the vCPU count for each side into an SVG file.
pub fn plot_svg(
    path: &std::path::Path,
    title: &str,
    metric: &Metric,
    columns: &[&str],
    runs: &CompareRuns,
) -> Result<(), LabError> {
    let series: Vec<Vec<(f64, f64)>> = (0..columns.len())
        .map(|side| {
            runs.iter()
                .filter_map(|(n, sides)| {
                    (metric.get)(&sides[side]).map(|ns| (*n as f64, ns as f64 / 1e9))
                })
                .collect()
        })
        .collect();
    let x_max = runs.iter().map(|r| r.0).max().unwrap_or(1) as f64;
    let x_min = runs.iter().map(|r| r.0).min().unwrap_or(1).max(1) as f64;
    let y_max = series
        .iter()
        .flatten()
        .map(|p| p.1)
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let (width, height) = (800u32, 520u32);
    let root = chart::svg_area(path, (width, height))?;
    let err = |e: &dyn std::fmt::Display| chart::draw_error(path, e);
    // The title in two lines, each in the largest font (up to 18 and 13 px) that fits the
    // width: the selftest line, then the configuration.
    let (top, body) = root.split_vertically(54);
    let fit =
        |text: &str, max: f64| max.min(0.95 * width as f64 / (0.56 * text.len().max(1) as f64));
    for (text, y, max) in [(metric.name.as_str(), 6, 18.0), (title, 30, 13.0)] {
        let style = TextStyle::from(("sans-serif", fit(text, max)).into_font()).pos(
            plotters::style::text_anchor::Pos::new(
                plotters::style::text_anchor::HPos::Center,
                plotters::style::text_anchor::VPos::Top,
            ),
        );
        top.draw_text(text, &style, (width as i32 / 2, y))
            .map_err(|e| err(&e))?;
    }
    // vCPU counts double from point to point in a sweep: a log2 axis spaces them evenly.
    let mut chart = ChartBuilder::on(&body)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x_min / 1.25..x_max * 1.25).log_scale().base(2.0),
            0.0..y_max,
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("vCPUs (log2 scale)")
        .y_desc("seconds")
        .x_label_formatter(&|x| format!("{}", x.round()))
        .draw()
        .map_err(|e| err(&e))?;
    for (side, color) in [RED, BLUE, GREEN, MAGENTA]
        .into_iter()
        .take(columns.len())
        .enumerate()
    {
        let pts = series[side].clone();
        chart::labelled_line(&mut chart, pts.clone(), color, columns[side]).map_err(|e| err(&e))?;
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart::legend(&mut chart, None).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::report::{IterationReport, Phase};

    fn report(dirty_ns: u64) -> DirtyLogReport {
        DirtyLogReport {
            iterations: vec![IterationReport {
                iteration: 1,
                dirty: Phase {
                    wall_ns: dirty_ns,
                    counters: None,
                },
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn the_table_has_the_seed_layout() {
        let runs = vec![
            (2, vec![report(326_340_139), report(58_645_119)]),
            (4, vec![report(1), report(2)]),
        ];
        let m = &dirty_log_metrics(1)[0];
        let t = seed_table(
            "tdp_mmu=Y, 100% writes",
            m,
            &["eager_page_split=N", "eager_page_split=Y"],
            &runs,
        )
        .unwrap();
        assert!(t.contains("| Iteration 1 dirty memory time"), "{t}");
        assert!(
            t.contains("vCPU Count   | eager_page_split=N         | eager_page_split=Y         |"),
            "{t}"
        );
        assert!(
            t.contains("2            | 0.326340139s               | 0.058645119s               |"),
            "{t}"
        );
        assert!(
            seed_table("x", &dirty_log_metrics(1)[3], &["a", "b"], &runs).is_none(),
            "no CLEAR phase"
        );
    }

    #[test]
    fn the_chart_is_written() {
        let dir = std::env::temp_dir().join(format!("vmmu-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.svg");
        let runs = vec![
            (2, vec![report(3), report(1), report(1)]),
            (8, vec![report(9), report(2), report(1)]),
        ];
        plot_svg(
            &path,
            "t",
            &dirty_log_metrics(1)[0],
            &["a", "b", "c"],
            &runs,
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("vCPUs (log2 scale)"));
        // Both title lines, centred; the vCPU counts as ticks of the log2 axis.
        assert!(
            svg.contains(">\nIteration 1 dirty memory time\n</text>")
                || svg.contains(">Iteration 1 dirty memory time<")
        );
        let ticks =
            |n: &str| svg.contains(&format!(">\n{n}\n</text>")) || svg.contains(&format!(">{n}<"));
        assert!(ticks("2") && ticks("4") && ticks("8"), "{svg}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// The configuration line of a `dirty-log` sweep's tables and chart: the engine, the MMU as
/// `mmu_desc` names it, the write percentage, the backing, and `-g` without manual protect.
pub fn config_line(virtual_time: bool, mmu_desc: &str, p: &DirtyLogParams) -> String {
    format!(
        "{} engine, {mmu_desc}, {}% writes, {}{}",
        if virtual_time {
            "virtual-time"
        } else {
            "threads"
        },
        p.write_percent,
        p.backing,
        if p.manual_protect { "" } else { ", -g" }
    )
}

/// The one layout of a scenario's `--compare` text: a label column, then one column per side,
/// a header row naming the sides and a row per quantity (each cell after `sep`).
#[derive(Copy, Clone, Debug)]
pub struct SideBySide<'a> {
    /// Width of the label column.
    pub label: usize,
    /// Width of a side's name in the header.
    pub head: usize,
    /// Width of a side's cell in a row.
    pub cell: usize,
    /// What goes before each side's name or cell.
    pub sep: &'a str,
}

impl SideBySide<'_> {
    /// The header row: an empty label and the sides' names.
    pub fn header<'n>(&self, s: &mut String, names: impl IntoIterator<Item = &'n str>) {
        let _ = write!(s, "{:<w$}", "", w = self.label);
        for n in names {
            let _ = write!(s, "{}{n:>w$}", self.sep, w = self.head);
        }
        let _ = writeln!(s);
    }

    /// A row: `label`, then each side's cell.
    pub fn row(&self, s: &mut String, label: &str, cells: impl IntoIterator<Item = String>) {
        let _ = write!(s, "{label:<w$}", w = self.label);
        for c in cells {
            let _ = write!(s, "{}{c:>w$}", self.sep, w = self.cell);
        }
        let _ = writeln!(s);
    }
}
