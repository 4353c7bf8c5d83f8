//! Calibration: [`fit_unit_costs`], the least-squares fit of per-unit costs to timed workloads,
//! and [`calibrate`], which fits a model's software costs with it (`vmmu calibrate`).

use super::file::CostError;
use super::model::{is_hardware_event, meter_counts, CostModel, NF};
use crate::kvm::meter::{Meter, METER_FIELDS};

/// Unconstrained least squares `min ‖a·x − b‖` (Householder QR); `a` is a list of rows.
/// Columns linearly dependent on earlier ones get 0.
fn least_squares(a: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let m = a.len();
    let k = a.first().map_or(0, Vec::len);
    // Column-major copy.
    let mut q: Vec<Vec<f64>> = (0..k).map(|j| a.iter().map(|r| r[j]).collect()).collect();
    let mut y = b.to_vec();
    let mut rdiag = vec![0.0; k];
    for c in 0..k.min(m) {
        let (head, tail) = q.split_at_mut(c + 1);
        let v = &mut head[c];
        let norm = v[c..].iter().map(|t| t * t).sum::<f64>().sqrt();
        if norm == 0.0 {
            continue;
        }
        let alpha = if v[c] > 0.0 { -norm } else { norm };
        v[c] -= alpha;
        let vv: f64 = v[c..].iter().map(|t| t * t).sum();
        rdiag[c] = alpha;
        if vv == 0.0 {
            continue;
        }
        for col in tail.iter_mut() {
            let f = 2.0 * (c..m).map(|i| v[i] * col[i]).sum::<f64>() / vv;
            for i in c..m {
                col[i] -= f * v[i];
            }
        }
        let f = 2.0 * (c..m).map(|i| v[i] * y[i]).sum::<f64>() / vv;
        for i in c..m {
            y[i] -= f * v[i];
        }
    }
    let rmax = rdiag.iter().fold(0.0f64, |acc, r| acc.max(r.abs()));
    let mut x = vec![0.0; k];
    for c in (0..k.min(m)).rev() {
        if rdiag[c].abs() <= 1e-12 * rmax {
            continue;
        }
        let s: f64 = (c + 1..k).map(|j| q[j][c] * x[j]).sum();
        x[c] = (y[c] - s) / rdiag[c];
    }
    x
}

/// The regularization of [`fit_unit_costs`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitWeights {
    /// Weight of the pull of each cost towards its prior:
    /// `prior · Σ_j w_j · (x_j + 1/x_j − 2)`, where `x_j = c_j / s_j` is the cost relative to
    /// the prior `s_j` (1 ns for a zero prior) and `w_j` is field `j`'s share of the workloads'
    /// time at the priors, summed over the workloads and at least [`FitWeights::MIN_SHARE`].
    ///
    /// The penalty is convex, weighs a cost 2× above its prior as much as one 2× below, and is
    /// infinite at zero, so every fitted cost stays positive. Weighting it by share makes the
    /// fields a workload cannot tell apart scale alike: they share the workload's time in
    /// proportion to their priors.
    pub prior: f64,
}

impl FitWeights {
    /// Smallest weight of a field's prior penalty, so that fields with a negligible share of
    /// every workload stay near their priors instead of absorbing noise.
    pub const MIN_SHARE: f64 = 0.25;

    /// No regularization: plain least squares of the relative residuals over positive costs.
    pub const NONE: FitWeights = FitWeights { prior: 0.0 };

    /// What [`calibrate`] uses: a field that is a tenth of one workload's time, 2× off its
    /// prior, costs `1e-3 · 0.1 · 0.5`, as much as a 0.7 % residual of that workload, and 30×
    /// off (`x + 1/x − 2 ≈ 28`) as much as a 5 % residual. So the data decide where they speak
    /// clearly, their blind spots are shared in proportion to the priors, and fields no workload
    /// exercises keep their priors.
    pub const CALIBRATION: FitWeights = FitWeights { prior: 1e-3 };
}

/// Fits per-unit costs `c > 0` to workloads: `counts[w][j]` units of field `j` took `times[w]`
/// ns in workload `w`. Minimizes the squared *relative* residuals of the workloads,
/// `Σ_w ((Σ_j counts[w][j]·c_j − times[w]) / times[w])²`, plus the prior penalty of `weights`
/// (see [`FitWeights`]), by Levenberg–Marquardt over `y_j = ln(c_j / s_j)`. The problem is
/// convex in `c`, so the optimum is unique (with a non-zero prior weight).
///
/// The workloads cannot separate fields that always occur in the same proportion, nor say
/// anything about fields they never exercise: such fields share their workload's time in
/// proportion to their priors (a workload that runs 2× faster than the priors predict makes each
/// of them about 2× cheaper), and fields no workload exercises keep their priors. With
/// [`FitWeights::NONE`] and independent workloads this recovers exact data.
pub fn fit_unit_costs(
    counts: &[Vec<f64>],
    times: &[f64],
    prior: &[f64],
    weights: FitWeights,
) -> Result<Vec<f64>, CostError> {
    let n = prior.len();
    if counts.len() != times.len() || counts.is_empty() {
        return Err(CostError::Fit(format!(
            "{} workloads with counts and {} with times; they must be equal and non-zero",
            counts.len(),
            times.len()
        )));
    }
    if let Some(r) = counts.iter().find(|r| r.len() != n) {
        return Err(CostError::Fit(format!(
            "a workload has {} counts for {n} fields",
            r.len()
        )));
    }
    if let Some(t) = times.iter().find(|t| !(t.is_finite() && **t > 0.0)) {
        return Err(CostError::Fit(format!(
            "a workload time is {t}: times must be positive"
        )));
    }
    if counts
        .iter()
        .flatten()
        .any(|c| !(c.is_finite() && *c >= 0.0))
    {
        return Err(CostError::Fit(
            "counts must be finite and non-negative".into(),
        ));
    }
    if prior
        .iter()
        .chain([&weights.prior])
        .any(|p| !p.is_finite() || *p < 0.0)
    {
        return Err(CostError::Fit(
            "priors and weights must be finite and non-negative".into(),
        ));
    }
    let scale: Vec<f64> = prior
        .iter()
        .map(|&p| if p > 0.0 { p } else { 1.0 })
        .collect();
    // Data rows in units of the priors: a[w][j] · x_j is field j's part of workload w's
    // predicted time, relative to its measured time.
    let a: Vec<Vec<f64>> = counts
        .iter()
        .zip(times)
        .map(|(row, &t)| row.iter().zip(&scale).map(|(c, s)| c * s / t).collect())
        .collect();
    // √(prior · w_j): the penalty is the square of this times (√x − 1/√x).
    let pull: Vec<f64> = (0..n)
        .map(|j| {
            let share: f64 = a.iter().map(|r| r[j]).sum();
            (weights.prior * share.max(FitWeights::MIN_SHARE)).sqrt()
        })
        .collect();
    // Fields no workload counts and no penalty touches stay at the prior.
    let free: Vec<usize> = (0..n)
        .filter(|&j| pull[j] > 0.0 || a.iter().any(|r| r[j] != 0.0))
        .collect();
    let residuals = |y: &[f64]| -> Vec<f64> {
        let mut r: Vec<f64> = a
            .iter()
            .map(|row| row.iter().zip(y).map(|(a, y)| a * y.exp()).sum::<f64>() - 1.0)
            .collect();
        r.extend(
            free.iter()
                .map(|&j| pull[j] * ((y[j] / 2.0).exp() - (-y[j] / 2.0).exp())),
        );
        r
    };
    let cost = |r: &[f64]| r.iter().map(|v| v * v).sum::<f64>();
    let mut y = vec![0.0; n];
    let mut r = residuals(&y);
    let mut f = cost(&r);
    let mut mu: f64 = 1e-3;
    for _ in 0..5000 {
        // Jacobian of the residuals over the free fields, damped: [J; √μ·I] δ = [−r; 0].
        let mut jac: Vec<Vec<f64>> = a
            .iter()
            .map(|row| free.iter().map(|&j| row[j] * y[j].exp()).collect())
            .collect();
        for (k, &j) in free.iter().enumerate() {
            let mut row = vec![0.0; free.len()];
            row[k] = pull[j] * ((y[j] / 2.0).exp() + (-y[j] / 2.0).exp()) / 2.0;
            jac.push(row);
        }
        let mut rhs: Vec<f64> = r.iter().map(|v| -v).collect();
        for k in 0..free.len() {
            let mut row = vec![0.0; free.len()];
            row[k] = mu.sqrt();
            jac.push(row);
            rhs.push(0.0);
        }
        let step = least_squares(&jac, &rhs);
        let mut trial = y.clone();
        for (k, &j) in free.iter().enumerate() {
            trial[j] = (y[j] + step[k].clamp(-5.0, 5.0)).clamp(-60.0, 60.0);
        }
        let rt = residuals(&trial);
        let ft = cost(&rt);
        if ft < f {
            let moved = free
                .iter()
                .map(|&j| (trial[j] - y[j]).abs())
                .fold(0.0, f64::max);
            let converged = moved < 1e-10 || f - ft <= 1e-18 * f;
            y = trial;
            r = rt;
            f = ft;
            mu = (mu / 3.0).max(1e-12);
            if converged {
                break;
            }
        } else {
            mu *= 4.0;
            if mu > 1e12 {
                break;
            }
        }
    }
    Ok(y.iter().zip(&scale).map(|(y, s)| s * y.exp()).collect())
}

/// Starting guess for the model's own cost of emulating one hardware event (an access, a TLB
/// lookup, a walk step) in [`calibrate`]. Those costs are fitted so that the emulation's time is
/// not charged to the software fields, and are never written to a cost file.
pub const EMULATED_EVENT_PRIOR_NS: f64 = 5.0;

/// One timed calibration workload: the work its `Meter` counted and how long it took.
#[derive(Clone, Debug)]
pub struct Observation {
    /// Name of the workload.
    pub name: String,
    /// What the MMU counted during the timed part.
    pub meter: Meter,
    /// How long the timed part took, in ns.
    pub nanos: f64,
}

/// The fitted cost of one `Meter` field.
#[derive(Clone, Debug)]
pub struct FittedCost {
    /// The `Meter` field.
    pub field: &'static str,
    /// The field has a software cost; when false it counts a hardware event, the fitted value
    /// is this machine's cost of *emulating* it, and the cost file keeps the hardware costs.
    pub software: bool,
    /// Some workload counted the field.
    pub exercised: bool,
    /// The base model's cost (the fit's prior).
    pub prior_ns: f64,
    /// The fitted cost.
    pub fitted_ns: f64,
    /// The largest fraction of one workload's measured time that the field accounts for at the
    /// fitted cost: how much the data, rather than the prior, decide the value.
    pub max_share: f64,
}

/// How well the fitted costs explain one workload.
#[derive(Clone, Debug)]
pub struct WorkloadFit {
    /// Name of the workload.
    pub name: String,
    /// Measured time, ns.
    pub measured_ns: f64,
    /// `Σ count × fitted cost` over every field, ns.
    pub predicted_ns: f64,
}

impl WorkloadFit {
    /// `(predicted − measured) / measured`.
    pub fn residual(&self) -> f64 {
        (self.predicted_ns - self.measured_ns) / self.measured_ns
    }
}

/// The result of [`calibrate`].
#[derive(Clone, Debug)]
pub struct Calibration {
    /// The base model with the fitted software costs.
    pub model: CostModel,
    /// Every `Meter` field's fit, in `Meter` order.
    pub costs: Vec<FittedCost>,
    /// Every workload's fit, in the order given.
    pub workloads: Vec<WorkloadFit>,
}

/// Fits this machine's software costs to timed workloads with [`fit_unit_costs`], using
/// `base`'s software costs as the prior ([`EMULATED_EVENT_PRIOR_NS`] for the fields that count
/// hardware events, whose fitted emulation costs are reported but not kept). Fields no workload
/// exercises keep `base`'s cost; hardware costs are `base`'s. Fitted costs are rounded to
/// 0.001 ns.
pub fn calibrate(
    observations: &[Observation],
    base: &CostModel,
    origin: &str,
) -> Result<Calibration, CostError> {
    let counts: Vec<Vec<f64>> = observations
        .iter()
        .map(|o| meter_counts(&o.meter).iter().map(|&c| c as f64).collect())
        .collect();
    let times: Vec<f64> = observations.iter().map(|o| o.nanos).collect();
    let prior: Vec<f64> = (0..NF)
        .map(|i| {
            if is_hardware_event(i) {
                EMULATED_EVENT_PRIOR_NS
            } else {
                base.software[i]
            }
        })
        .collect();
    let fitted: Vec<f64> = fit_unit_costs(&counts, &times, &prior, FitWeights::CALIBRATION)?
        .into_iter()
        .map(|c| (c * 1000.0).round() / 1000.0)
        .collect();
    let mut model = base.clone();
    model.origin = origin.to_string();
    let names: Vec<&str> = observations.iter().map(|o| o.name.as_str()).collect();
    let mut costs = Vec::with_capacity(NF);
    for i in 0..NF {
        let field = METER_FIELDS[i];
        let exercised = counts.iter().any(|r| r[i] > 0.0);
        let max_share = counts
            .iter()
            .zip(&times)
            .map(|(r, t)| r[i] * fitted[i] / t)
            .fold(0.0, f64::max);
        let software = !is_hardware_event(i);
        if software && exercised {
            model.software[i] = fitted[i];
            let used: Vec<&str> = names
                .iter()
                .zip(&counts)
                .filter(|(_, r)| r[i] > 0.0)
                .map(|(n, _)| *n)
                .collect();
            model.sources.insert(
                format!("software.{field}"),
                format!(
                    "fitted by vmmu calibrate ({origin}) from workloads {}",
                    used.join(", ")
                ),
            );
        } else if software {
            let key = format!("software.{field}");
            let was = base.sources.get(&key).cloned().unwrap_or_default();
            model.sources.insert(
                key,
                format!("not exercised by vmmu calibrate; kept from the base model: {was}"),
            );
        }
        costs.push(FittedCost {
            field,
            software,
            exercised,
            prior_ns: prior[i],
            fitted_ns: if software && !exercised {
                base.software[i]
            } else {
                fitted[i]
            },
            max_share,
        });
    }
    let workloads = observations
        .iter()
        .zip(&counts)
        .map(|(o, r)| WorkloadFit {
            name: o.name.clone(),
            measured_ns: o.nanos,
            predicted_ns: r.iter().zip(&fitted).map(|(c, f)| c * f).sum(),
        })
        .collect();
    Ok(Calibration {
        model,
        costs,
        workloads,
    })
}

#[cfg(test)]
mod tests {
    use super::super::model::{field_index, meter_from_counts};
    use super::*;

    /// Rows of counts whose columns are independent: each row is dominated by one column
    /// (1000 units) with a sparse, deterministic spread of 1-3 units of the others.
    fn synthetic_counts(rows: usize, n: usize) -> Vec<Vec<f64>> {
        (0..rows)
            .map(|w| {
                (0..n)
                    .map(|j| match (w * 31 + j * 17) % 11 {
                        _ if w % n == j => 1000.0,
                        k @ 0..=2 => k as f64 + 1.0,
                        _ => 0.0,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_fit_recovers_known_costs_from_exact_data() {
        let truth = [3.0, 50.0, 200.0, 7.5, 0.25, 1000.0, 0.01];
        let n = truth.len();
        let counts = synthetic_counts(10, n);
        let times: Vec<f64> = counts
            .iter()
            .map(|r| r.iter().zip(&truth).map(|(c, t)| c * t).sum())
            .collect();
        // Without penalties: plain least squares, exact.
        let exact = fit_unit_costs(&counts, &times, &[10.0; 7], FitWeights::NONE).unwrap();
        for (f, t) in exact.iter().zip(&truth) {
            assert!((f - t).abs() <= 1e-6 * t, "{exact:?} vs {truth:?}");
        }
        // With calibrate's prior pull and priors 2x off: within 1 % (0.01 ns for tiny costs).
        let prior: Vec<f64> = truth.iter().map(|t| 2.0 * t).collect();
        let fitted = fit_unit_costs(&counts, &times, &prior, FitWeights::CALIBRATION).unwrap();
        for (f, t) in fitted.iter().zip(&truth) {
            assert!(
                (f - t).abs() <= 1e-2 * t.max(1.0),
                "{fitted:?} vs {truth:?}"
            );
        }
    }

    #[test]
    fn the_fit_keeps_costs_positive_and_the_prior_where_data_say_nothing() {
        // Column 1 never occurs; columns 2 and 3 always occur together.
        let counts = vec![
            vec![10.0, 0.0, 5.0, 5.0, 0.0],
            vec![20.0, 0.0, 0.0, 0.0, 10.0],
            vec![0.0, 0.0, 1.0, 1.0, 0.0],
        ];
        let times = vec![100.0, 180.0, 3.0];
        let prior = vec![1.0, 42.0, 1.0, 2.0, 1.0];
        let c = fit_unit_costs(&counts, &times, &prior, FitWeights::CALIBRATION).unwrap();
        assert!(c.iter().all(|v| *v > 0.0 && v.is_finite()), "{c:?}");
        assert!((c[1] - 42.0).abs() < 1e-9, "{c:?}");
        assert!((c[2] + c[3] - 3.0).abs() < 1e-2, "{c:?}");
        // Fields the data cannot separate share in proportion to their priors.
        assert!((c[3] / c[2] - 2.0).abs() < 0.05, "{c:?}");
        assert!(
            (c[0] - 8.5).abs() < 0.1 && (c[4] - 1.0).abs() < 0.1,
            "{c:?}"
        );
        // Data whose unconstrained solution is (2, -1): the second cost goes towards 0, never
        // below, and the first minimizes the relative residuals, (c0 - 1)^2 + (c0 / 2 - 1)^2
        // at c0 = 1.2.
        let rows = [vec![1.0, 1.0], vec![1.0, 0.0]];
        let c = fit_unit_costs(&rows, &[1.0, 2.0], &[1.0; 2], FitWeights::NONE).unwrap();
        assert!(
            (c[0] - 1.2).abs() < 1e-6 && c[1] >= 0.0 && c[1] < 1e-6,
            "{c:?}"
        );
        let e = fit_unit_costs(&counts, &[1.0, 0.0, 1.0], &prior, FitWeights::NONE).unwrap_err();
        assert!(e.to_string().contains("times must be positive"), "{e}");
    }

    #[test]
    fn calibrate_recovers_software_costs_and_keeps_hardware() {
        let mut truth = CostModel::default();
        for (k, f) in CostModel::software_fields().enumerate() {
            truth.set_software_ns(f, 1.0 + 3.0 * k as f64).unwrap();
        }
        let emulated = |i: usize| 2.0 + i as f64 / 4.0;
        // Leave one software field unexercised.
        let skip = field_index("lock_yields").unwrap();
        // At least one workload dominated by each field.
        let counts = synthetic_counts(2 * NF, NF);
        let observations: Vec<Observation> = counts
            .iter()
            .enumerate()
            .map(|(w, r)| {
                let mut c = [0u64; NF];
                for j in 0..NF {
                    c[j] = if j == skip { 0 } else { r[j] as u64 };
                }
                let nanos = (0..NF)
                    .map(|j| {
                        let unit = if is_hardware_event(j) {
                            emulated(j)
                        } else {
                            truth.software[j]
                        };
                        c[j] as f64 * unit
                    })
                    .sum();
                Observation {
                    name: format!("w{w}"),
                    meter: meter_from_counts(c),
                    nanos,
                }
            })
            .collect();
        // Priors 2x off the truth.
        let mut base = CostModel::default();
        for f in CostModel::software_fields() {
            base.set_software_ns(f, 2.0 * truth.software_ns(f).unwrap())
                .unwrap();
        }
        let cal = calibrate(&observations, &base, "synthetic").unwrap();
        for f in &cal.costs {
            let i = field_index(f.field).unwrap();
            let want = if i == skip {
                base.software[i]
            } else if f.software {
                truth.software[i]
            } else {
                emulated(i)
            };
            assert!(
                (f.fitted_ns - want).abs() <= 0.03 * want,
                "{}: {} vs {want}",
                f.field,
                f.fitted_ns
            );
            assert_eq!(f.exercised, i != skip);
        }
        for w in &cal.workloads {
            assert!(w.residual().abs() < 1e-2, "{}: {}", w.name, w.residual());
        }
        assert_eq!(cal.model.hardware, base.hardware);
        assert_eq!(cal.model.origin, "synthetic");
        let back = CostModel::from_json_str(&cal.model.to_json_string()).unwrap();
        assert_eq!(back, cal.model);
        assert!(cal
            .model
            .source("software.pf_slow")
            .unwrap()
            .contains("fitted"));
        assert!(cal
            .model
            .source("software.lock_yields")
            .unwrap()
            .contains("not exercised"));
    }
}
