//! What `vmmu fit` prints: the fitted costs, each timing against the model at the defaults, at
//! the fitted costs and predicted leave-one-out, the errors; as text, CSV and an SVG of
//! predicted against measured (log–log).

use super::{Fit, Row};
use crate::lab::chart;
use crate::lab::LabError;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;

/// An RMS log error as the percentage a typical timing is off by (`e^rms − 1`).
fn percent(rms: f64) -> String {
    format!("{:.1} %", (rms.exp() - 1.0) * 100.0)
}

/// The fit as text: costs, timings, errors, and what the errors say.
pub fn text(fit: &Fit) -> String {
    let mut s = String::new();
    let files: std::collections::BTreeSet<&str> =
        fit.runs.iter().map(|r| r.file.as_str()).collect();
    let _ = writeln!(
        s,
        "vmmu fit: {} timings of {} runs from {} file(s); {} free cost(s); {} model runs ({} round(s), pull {})",
        fit.rows.len(),
        fit.runs.len(),
        files.len(),
        fit.costs.len(),
        fit.model_runs,
        fit.options.rounds,
        fit.options.pull
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<20} {:>12} {:>12} {:>18} {:>9}",
        "cost", "default ns", "fitted ns", "range ns", "moved"
    );
    for c in &fit.costs {
        let _ = writeln!(
            s,
            "{:<20} {:>12} {:>12.3} {:>18} {:>8.2}x",
            c.free.name,
            c.free.default,
            c.value,
            format!("{}-{}", c.free.lo, c.free.hi),
            c.value / c.free.default
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<28} {:<34} {:>12} {:>12} {:>12} {:>12}",
        "run (file:line)", "timing", "measured s", "defaults s", "fitted s", "left out s"
    );
    for r in &fit.rows {
        let run = &fit.runs[r.run];
        let _ = writeln!(
            s,
            "{:<28} {:<34} {:>12.6} {:>12.6} {:>12.6} {:>12.6}",
            format!("{}:{}", short(&run.file), run.line),
            r.key,
            r.measured,
            r.defaults,
            r.fitted,
            r.leave_one_out
        );
    }
    let _ = writeln!(s);
    let (d, f, l) = (
        fit.error_defaults(),
        fit.error_fitted(),
        fit.error_leave_one_out(),
    );
    let _ = writeln!(
        s,
        "error (RMS of ln(model / measured), as a typical factor off): defaults {}, fitted {}, leave-one-out {}",
        percent(d),
        percent(f),
        percent(l)
    );
    let surrogate = super::rms_log_error(&fit.rows, |r| r.surrogate);
    let gap = super::rms_log(&fit.rows, |r| (r.surrogate, r.fitted));
    let _ = writeln!(
        s,
        "the last round's surrogate at the fitted costs: {} against the measurements, {} from the model itself",
        percent(surrogate),
        percent(gap)
    );
    let verdict = if f >= d {
        format!(
            "The fit does not improve on the defaults ({} fitted against {} with the defaults): the free costs cannot explain what the model misses.",
            percent(f),
            percent(d)
        )
    } else if l >= d {
        format!(
            "The fit improves the fitted timings ({} -> {}) but not the cross-validated error ({} >= {} with the defaults): its values do not predict what they were not fitted to.",
            percent(d),
            percent(f),
            percent(l),
            percent(d)
        )
    } else {
        format!(
            "Leave-one-out, the fitted model predicts the timings better than the defaults ({} against {}).",
            percent(l),
            percent(d)
        )
    };
    let _ = writeln!(s, "{verdict}");
    s
}

fn short(file: &str) -> &str {
    file.rsplit('/').next().unwrap_or(file)
}

/// `text` as one CSV field: in double quotes, a quote doubled.
fn quoted(text: &str) -> String {
    format!("\"{}\"", text.replace('"', "\"\""))
}

/// The timings as CSV: `file,line,command,timing,measured_s,defaults_s,fitted_s,leave_one_out_s`.
pub fn csv(fit: &Fit) -> String {
    let mut s =
        String::from("file,line,command,timing,measured_s,defaults_s,fitted_s,leave_one_out_s\n");
    for r in &fit.rows {
        let run = &fit.runs[r.run];
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{}",
            quoted(&run.file),
            run.line,
            quoted(&run.command()),
            quoted(&r.key),
            r.measured,
            r.defaults,
            r.fitted,
            r.leave_one_out
        );
    }
    s
}

/// Draws predicted against measured, log–log, for the defaults, the fit and leave-one-out,
/// with the diagonal where they would agree.
pub fn plot_svg(fit: &Fit, path: &Path) -> Result<(), LabError> {
    let err = |e: &dyn std::fmt::Display| chart::draw_error(path, e);
    let all = fit
        .rows
        .iter()
        .flat_map(|r| [r.measured, r.defaults, r.fitted, r.leave_one_out])
        .filter(|v| *v > 0.0);
    let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let (lo, hi) = if lo <= hi {
        (lo / 1.5, hi * 1.5)
    } else {
        (1e-3, 1.0)
    };
    let root = chart::svg_area(path, (720, 640))?;
    let mut c = ChartBuilder::on(&root)
        .caption(
            "vmmu fit: model against measured (seconds)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())
        .map_err(|e| err(&e))?;
    c.configure_mesh()
        .x_desc("measured")
        .y_desc("model")
        .draw()
        .map_err(|e| err(&e))?;
    chart::labelled_line(
        &mut c,
        vec![(lo, lo), (hi, hi)],
        BLACK.mix(0.4),
        "agreement",
    )
    .map_err(|e| err(&e))?;
    type Column = fn(&Row) -> f64;
    let series: [(&str, RGBColor, Column); 3] = [
        ("defaults", RGBColor(150, 150, 150), |r| r.defaults),
        ("fitted", BLUE, |r| r.fitted),
        ("leave-one-out", RED, |r| r.leave_one_out),
    ];
    for (label, color, value) in series {
        c.draw_series(
            fit.rows
                .iter()
                .map(|r| Circle::new((r.measured, value(r)), 4, color.filled())),
        )
        .map_err(|e| err(&e))?
        .label(label)
        .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
    }
    chart::legend(&mut c, Some(SeriesLabelPosition::UpperLeft)).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
