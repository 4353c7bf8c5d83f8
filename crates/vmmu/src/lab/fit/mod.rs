//! `vmmu fit`: the costs no source gives, fitted to a real host's selftest output, and how well
//! the fitted model predicts what it was not fitted to.
//!
//! # Method
//!
//! The free costs are hardware costs the cost file lists as unsourced
//! ([`crate::cost::UNSOURCED_HARDWARE`]), each within a physical range. The model is a
//! simulation, so the fit is derivative-free and keeps its model runs few and counted:
//!
//! 1. Run every measured configuration at the base costs (the *defaults* column).
//! 2. For each round: run every configuration once more with each free cost doubled (halved at
//!    the top of its range), which gives each timing as a linear function of the costs around
//!    the current point ([`Surrogate`]); choose the costs that minimise
//!    `Σ ln(predicted / measured)² + pull · Σ ln(cost / default)²` on it ([`minimise`],
//!    Nelder–Mead within the ranges); run every configuration at those costs (the *fitted*
//!    column: the model itself, not the surrogate). The next round linearises there.
//! 3. Leave-one-out cross-validation: for each timing, the fit on all the others (on the last
//!    round's surrogate) predicts it (the *leave-one-out* column). It leaves out one timing,
//!    not one run: the other timings of its run (another iteration, say) stay in; and with
//!    more than one round the last linearisation point was fitted with it.
//!
//! Model runs: configurations × (1 + rounds × (free costs + 1)).
//!
//! A timing is linear in the costs where nothing contends; where vCPUs queue on a lock or on
//! DRAM it is only piecewise so, which is what the rounds are for. The leave-one-out column
//! uses the surrogate (re-running the model for each left-out timing would multiply the runs
//! by the number of timings); the report shows the surrogate's own error at the fitted point
//! beside it.

pub mod input;
pub mod report;
mod solve;

pub use input::{parse_file, parse_output, InputError, Measurement, Run, Selftest, SELFTESTS};
pub use solve::{minimise, moved, FreeCost, Surrogate};

use crate::cost::CostModel;
use crate::lab::LabError;

/// One model run a fit asks for: a measured configuration, at some costs.
pub struct ModelJob<'a> {
    /// The configuration.
    pub run: &'a Run,
    /// The costs.
    pub cost: &'a CostModel,
}

/// Whoever runs the model for a fit (the CLI runs `vmmu` itself, in parallel): each job's
/// timings, as the model printed them, in job order.
pub trait RunModel {
    /// Runs every job; a failed run is an error that names it.
    fn run_all(&self, jobs: &[ModelJob<'_>]) -> Result<Vec<Vec<Measurement>>, LabError>;
}

/// How a fit runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitOptions {
    /// Linearise-and-fit rounds (at least 1).
    pub rounds: u32,
    /// Weight of the pull towards the defaults, per squared log of a cost's ratio to its
    /// default, against a squared log error of one timing.
    pub pull: f64,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            rounds: 1,
            pull: 1e-3,
        }
    }
}

/// One fitted cost.
#[derive(Clone, Debug, PartialEq)]
pub struct FittedCost {
    /// The cost, its range and default.
    pub free: FreeCost,
    /// The fitted value, ns.
    pub value: f64,
}

/// One measured timing against the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// The run it belongs to (index into the fit's runs).
    pub run: usize,
    /// Its label and occurrence ([`Measurement::key`]).
    pub key: String,
    /// Measured, seconds.
    pub measured: f64,
    /// The model at the base costs.
    pub defaults: f64,
    /// The model at the fitted costs.
    pub fitted: f64,
    /// The last round's surrogate at the fitted costs.
    pub surrogate: f64,
    /// Predicted by a fit on every other timing.
    pub leave_one_out: f64,
}

/// What a fit found.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// The runs fitted (as read, less any timings the caller left out).
    pub runs: Vec<Run>,
    /// Each free cost, fitted.
    pub costs: Vec<FittedCost>,
    /// Each timing.
    pub rows: Vec<Row>,
    /// Model runs it took.
    pub model_runs: usize,
    /// Its options.
    pub options: FitOptions,
}

/// The shortest time the selftests print (they print nanoseconds): times are compared in log
/// space, so a time of 0 (a phase with nothing to do) counts as this.
pub const RESOLUTION_S: f64 = 1e-9;

/// `ln(a / b)`, each at least [`RESOLUTION_S`].
pub fn log_ratio(a: f64, b: f64) -> f64 {
    (a.max(RESOLUTION_S) / b.max(RESOLUTION_S)).ln()
}

/// The root mean square over `rows` of `ln(a / b)` for the pair `(a, b)` each row gives.
pub fn rms_log(rows: &[Row], pair: impl Fn(&Row) -> (f64, f64)) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    let s: f64 = rows
        .iter()
        .map(|r| {
            let (a, b) = pair(r);
            log_ratio(a, b).powi(2)
        })
        .sum();
    (s / rows.len() as f64).sqrt()
}

/// The root mean square of `ln(predicted / measured)` over `rows`.
pub fn rms_log_error(rows: &[Row], predicted: impl Fn(&Row) -> f64) -> f64 {
    rms_log(rows, |r| (predicted(r), r.measured))
}

impl Fit {
    /// RMS log error of the model at the base costs.
    pub fn error_defaults(&self) -> f64 {
        rms_log_error(&self.rows, |r| r.defaults)
    }
    /// RMS log error of the model at the fitted costs.
    pub fn error_fitted(&self) -> f64 {
        rms_log_error(&self.rows, |r| r.fitted)
    }
    /// RMS log error of leave-one-out prediction.
    pub fn error_leave_one_out(&self) -> f64 {
        rms_log_error(&self.rows, |r| r.leave_one_out)
    }

    /// The base cost model with the fitted values, each with a source that says so.
    pub fn cost_model(&self, base: &CostModel, files: &[String]) -> Result<CostModel, LabError> {
        let mut m = base.clone();
        let files = files.join(", ");
        for c in &self.costs {
            let source = format!(
                "fitted by `vmmu fit` to {files}: {} timings of {} runs, leave-one-out RMS log error {:.3} (defaults {:.3}); range {}-{} ns; default {} ns",
                self.rows.len(),
                self.runs.len(),
                self.error_leave_one_out(),
                self.error_defaults(),
                c.free.lo,
                c.free.hi,
                c.free.default
            );
            m.set_hardware_ns(&c.free.name, c.value, &source)?;
        }
        m.origin = format!("fitted by `vmmu fit` to {files}, over: {}", base.origin);
        Ok(m)
    }
}

/// `base` with the free costs set to `values` (a model to run, not to keep).
fn with_costs(base: &CostModel, free: &[FreeCost], values: &[f64]) -> Result<CostModel, LabError> {
    let mut m = base.clone();
    for (f, v) in free.iter().zip(values) {
        m.set_hardware_ns(&f.name, *v, "a point of a `vmmu fit` search")?;
    }
    Ok(m)
}

/// The measured timings, in run order, as (run, key, seconds).
fn measured(runs: &[Run]) -> Vec<(usize, String, f64)> {
    runs.iter()
        .enumerate()
        .flat_map(|(i, r)| r.measurements.iter().map(move |m| (i, m.key(), m.seconds)))
        .collect()
}

/// Runs every configuration at each of `points` (cost vectors) and returns, per point, every
/// measured timing as the model printed it (in [`measured`] order).
fn evaluate(
    runs: &[Run],
    base: &CostModel,
    free: &[FreeCost],
    points: &[Vec<f64>],
    model: &dyn RunModel,
    model_runs: &mut usize,
) -> Result<Vec<Vec<f64>>, LabError> {
    let costs = points
        .iter()
        .map(|p| with_costs(base, free, p))
        .collect::<Result<Vec<_>, _>>()?;
    let jobs: Vec<ModelJob<'_>> = costs
        .iter()
        .flat_map(|cost| runs.iter().map(move |run| ModelJob { run, cost }))
        .collect();
    *model_runs += jobs.len();
    let out = model.run_all(&jobs)?;
    if out.len() != jobs.len() {
        return Err(LabError::Check(format!(
            "the model returned {} results for {} runs",
            out.len(),
            jobs.len()
        )));
    }
    let mut per_point = Vec::with_capacity(points.len());
    for chunk in out.chunks(runs.len()) {
        let mut values = Vec::new();
        for (run, printed) in runs.iter().zip(chunk) {
            for m in &run.measurements {
                let hit = printed
                    .iter()
                    .find(|p| p.label == m.label && p.nth == m.nth)
                    .ok_or_else(|| {
                        LabError::Invalid(format!(
                            "{}:{}: the model's run of `{}` printed no `{}`",
                            run.file,
                            run.line,
                            run.command(),
                            m.key()
                        ))
                    })?;
                values.push(hit.seconds);
            }
        }
        per_point.push(values);
    }
    Ok(per_point)
}

/// Fits the `free` costs of `base` to the timings of `runs` (see the module documentation).
pub fn fit(
    runs: Vec<Run>,
    base: &CostModel,
    free: &[FreeCost],
    options: FitOptions,
    model: &dyn RunModel,
) -> Result<Fit, LabError> {
    if free.is_empty() {
        return Err(LabError::Invalid(
            "a fit needs at least one free cost".into(),
        ));
    }
    if runs.is_empty() {
        return Err(LabError::Invalid(
            "a fit needs at least one measured run".into(),
        ));
    }
    if options.rounds == 0 {
        return Err(LabError::Invalid("a fit needs at least one round".into()));
    }
    let targets = measured(&runs);
    let y: Vec<f64> = targets.iter().map(|t| t.2.max(RESOLUTION_S)).collect();
    let all: Vec<usize> = (0..y.len()).collect();
    let mut model_runs = 0;
    let mut at: Vec<f64> = free.iter().map(|f| f.default).collect();
    let mut at_values =
        evaluate(&runs, base, free, &[at.clone()], model, &mut model_runs)?.remove(0);
    let defaults = at_values.clone();
    let mut surrogate = None;
    for _ in 0..options.rounds {
        let moved_to: Vec<f64> = free.iter().zip(&at).map(|(f, a)| moved(f, *a)).collect();
        let points: Vec<Vec<f64>> = (0..free.len())
            .map(|j| {
                let mut p = at.clone();
                p[j] = moved_to[j];
                p
            })
            .collect();
        let moved_values = evaluate(&runs, base, free, &points, model, &mut model_runs)?;
        let s = Surrogate::new(&at, at_values.clone(), &moved_to, &moved_values);
        let next = minimise(&s, &y, &all, free, options.pull);
        at_values = evaluate(
            &runs,
            base,
            free,
            std::slice::from_ref(&next),
            model,
            &mut model_runs,
        )?
        .remove(0);
        at = next;
        surrogate = Some(s);
    }
    let s = surrogate.expect("at least one round");
    let rows = targets
        .iter()
        .enumerate()
        .map(|(m, (run, key, measured))| {
            let others: Vec<usize> = all.iter().copied().filter(|&i| i != m).collect();
            let loo = if others.is_empty() {
                s.predict(m, &s.at)
            } else {
                s.predict(m, &minimise(&s, &y, &others, free, options.pull))
            };
            Row {
                run: *run,
                key: key.clone(),
                measured: *measured,
                defaults: defaults[m],
                fitted: at_values[m],
                surrogate: s.predict(m, &at),
                leave_one_out: loo,
            }
        })
        .collect();
    Ok(Fit {
        runs,
        costs: free
            .iter()
            .zip(&at)
            .map(|(f, v)| FittedCost {
                free: f.clone(),
                value: *v,
            })
            .collect(),
        rows,
        model_runs,
        options,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvm::meter::Meter;

    /// A model whose timings are linear in two costs: every run's `Populate memory time` is
    /// the price of `n` million TLB misses and `2n + (n mod 3) / 2` million TLB flushes, for
    /// the run's `-v n`.
    struct Linear;

    impl RunModel for Linear {
        fn run_all(&self, jobs: &[ModelJob<'_>]) -> Result<Vec<Vec<Measurement>>, LabError> {
            Ok(jobs
                .iter()
                .map(|j| {
                    let n: f64 = j.run.args[1].parse().unwrap();
                    let m = Meter {
                        hw_walks: n as u64 * 1_000_000,
                        tlb_flushes: 2 * n as u64 * 1_000_000 + (n as u64 % 3) * 500_000,
                        ..Meter::default()
                    };
                    vec![Measurement {
                        label: "Populate memory time".into(),
                        nth: 1,
                        seconds: j.cost.nanos_f64(&m) / 1e9,
                    }]
                })
                .collect())
        }
    }

    fn runs(truth: &CostModel) -> Vec<Run> {
        (1..=4)
            .map(|n| {
                let mut r = parse_file(
                    "synthetic",
                    &format!("# cmd: ./dirty_log_perf_test -v {n}\nPopulate memory time: 1s\n"),
                )
                .unwrap()
                .remove(0);
                r.measurements = Linear
                    .run_all(&[ModelJob {
                        run: &r,
                        cost: truth,
                    }])
                    .unwrap()
                    .remove(0);
                r
            })
            .collect()
    }

    #[test]
    fn known_costs_are_recovered_and_counted_runs_match() {
        let base = CostModel::default();
        let free = ["tlb_miss_ns", "tlbi_ns"].map(|n| FreeCost {
            name: n.into(),
            lo: 1.0,
            hi: 5000.0,
            default: base.hardware.get(n).unwrap(),
        });
        let mut truth = base.clone();
        truth.set_hardware_ns("tlb_miss_ns", 17.0, "").unwrap();
        truth.set_hardware_ns("tlbi_ns", 240.0, "").unwrap();
        let f = fit(
            runs(&truth),
            &base,
            &free,
            FitOptions {
                rounds: 1,
                pull: 0.0,
            },
            &Linear,
        )
        .unwrap();
        assert!(
            (f.costs[0].value / 17.0 - 1.0).abs() < 1e-3,
            "{:?}",
            f.costs
        );
        assert!(
            (f.costs[1].value / 240.0 - 1.0).abs() < 1e-3,
            "{:?}",
            f.costs
        );
        assert_eq!(f.model_runs, 4 * (1 + 3));
        assert!(f.error_fitted() < 1e-4 && f.error_leave_one_out() < 1e-3);
        assert!(f.error_defaults() > 0.1);
        let m = f.cost_model(&base, &["synthetic".into()]).unwrap();
        assert!(m
            .source("hardware.tlbi_ns")
            .unwrap()
            .starts_with("fitted by `vmmu fit` to synthetic"));
        assert_eq!(m.hardware.get("tlbi_ns"), Some(f.costs[1].value));
    }

    #[test]
    fn a_timing_the_model_does_not_print_is_an_error_naming_the_run() {
        let base = CostModel::default();
        let mut r = runs(&base);
        r[1].measurements[0].label = "Iteration 9 dirty memory time".into();
        let free = [FreeCost {
            name: "tlbi_ns".into(),
            lo: 1.0,
            hi: 5000.0,
            default: 100.0,
        }];
        let e = fit(r, &base, &free, FitOptions::default(), &Linear).unwrap_err();
        assert_eq!(
            e.to_string(),
            "synthetic:1: the model's run of `dirty_log_perf_test -v 2` printed no `Iteration 9 dirty memory time`"
        );
    }
}
