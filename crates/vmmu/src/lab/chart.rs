//! What every SVG chart of the lab shares: the file's drawing area on a white background, the
//! one-line error a failed draw becomes, a series drawn as a line with its legend entry, and the
//! legend box.

use crate::lab::LabError;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// The drawing area of an SVG file `path` of `size` pixels, filled white.
pub fn svg_area(
    path: &Path,
    size: (u32, u32),
) -> Result<DrawingArea<SVGBackend<'_>, Shift>, LabError> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw_error(path, &e))?;
    Ok(root)
}

/// A failed draw into `path`, as the one line the command prints.
pub fn draw_error(path: &Path, e: &dyn std::fmt::Display) -> LabError {
    LabError::Report(format!("cannot draw {}: {e}", path.display()))
}

/// Draws `points` as a line of `color`, two pixels wide, with the legend entry `label`.
pub fn labelled_line<'a, DB, CT, C>(
    chart: &mut ChartContext<'a, DB, CT>,
    points: Vec<CT::From>,
    color: C,
    label: impl Into<String>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
    CT::From: Clone + 'static,
    C: Color + Copy + 'static,
{
    chart
        .draw_series(LineSeries::new(points, color.stroke_width(2)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    Ok(())
}

/// The legend box of the labelled series, at `position` (plotters' default, upper right, with
/// `None`).
pub fn legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: Option<SeriesLabelPosition>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    let mut labels = chart.configure_series_labels();
    if let Some(p) = position {
        labels.position(p);
    }
    labels
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
}
