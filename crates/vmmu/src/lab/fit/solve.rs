//! The minimisation behind `vmmu fit`: a linear surrogate of each measured timing in the free
//! costs ([`Surrogate`]), and the costs within their ranges that minimise the squared error in
//! log space plus a pull towards the defaults ([`minimise`]), found by Nelder–Mead (the `argmin`
//! crate) in coordinates that keep every cost inside its range.

use argmin::core::{CostFunction, Error, Executor};
use argmin::solver::neldermead::NelderMead;

/// A cost the fit may move: its range and where it starts (the base cost model's value).
#[derive(Clone, Debug, PartialEq)]
pub struct FreeCost {
    /// The hardware cost's name (`pml_log_ns`).
    pub name: String,
    /// The lowest value the fit may choose, ns.
    pub lo: f64,
    /// The highest, ns.
    pub hi: f64,
    /// The default: where the fit starts, and what the pull pulls towards.
    pub default: f64,
}

/// Each timing as a linear function of the free costs around one point `at`:
/// `value[m] + Σ_j slope[m][j] · (c_j − at_j)`, from one model run at `at` and one with each
/// cost moved (secants). Exact where a timing is linear in the costs (a run nothing contends
/// in); a fit re-linearises around its result for as many rounds as it is given.
#[derive(Clone, Debug, PartialEq)]
pub struct Surrogate {
    /// The point it was taken at.
    pub at: Vec<f64>,
    /// Each timing there, seconds.
    pub value: Vec<f64>,
    /// Each timing's change per ns of each cost.
    pub slope: Vec<Vec<f64>>,
}

impl Surrogate {
    /// From the timings at `at` and, for each cost `j`, the timings with cost `j` moved to
    /// `moved[j]`.
    pub fn new(at: &[f64], value: Vec<f64>, moved: &[f64], moved_values: &[Vec<f64>]) -> Self {
        let slope = (0..value.len())
            .map(|m| {
                (0..at.len())
                    .map(|j| (moved_values[j][m] - value[m]) / (moved[j] - at[j]))
                    .collect()
            })
            .collect();
        Surrogate {
            at: at.to_vec(),
            value,
            slope,
        }
    }

    /// Timing `m` predicted at costs `c` (never below the selftests' nanosecond, so its log
    /// exists).
    pub fn predict(&self, m: usize, c: &[f64]) -> f64 {
        let v = self.value[m]
            + self.slope[m]
                .iter()
                .zip(c.iter().zip(&self.at))
                .map(|(s, (c, a))| s * (c - a))
                .sum::<f64>();
        v.max(super::RESOLUTION_S)
    }
}

/// Where a cost moves for its secant: twice its value, or half when twice leaves the range,
/// or, in a range narrower than that, the bound farther away.
pub fn moved(cost: &FreeCost, at: f64) -> f64 {
    if at * 2.0 <= cost.hi {
        at * 2.0
    } else if at / 2.0 >= cost.lo {
        at / 2.0
    } else if cost.hi - at >= at - cost.lo {
        cost.hi
    } else {
        cost.lo
    }
}

/// The problem Nelder–Mead sees: unconstrained coordinates `u`, each cost
/// `lo · (hi/lo)^sigmoid(u)`.
#[derive(Clone, Copy)]
struct Problem<'a> {
    surrogate: &'a Surrogate,
    measured: &'a [f64],
    /// The timings fitted (the others are left out, for cross-validation).
    used: &'a [usize],
    free: &'a [FreeCost],
    pull: f64,
}

fn sigmoid(u: f64) -> f64 {
    1.0 / (1.0 + (-u).exp())
}

fn to_cost(f: &FreeCost, u: f64) -> f64 {
    (f.lo.ln() + (f.hi.ln() - f.lo.ln()) * sigmoid(u)).exp()
}

fn to_coordinate(f: &FreeCost, c: f64) -> f64 {
    let p = ((c.ln() - f.lo.ln()) / (f.hi.ln() - f.lo.ln())).clamp(1e-6, 1.0 - 1e-6);
    (p / (1.0 - p)).ln()
}

impl Problem<'_> {
    fn costs(&self, u: &[f64]) -> Vec<f64> {
        self.free
            .iter()
            .zip(u)
            .map(|(f, u)| to_cost(f, *u))
            .collect()
    }

    fn objective(&self, c: &[f64]) -> f64 {
        let misfit: f64 = self
            .used
            .iter()
            .map(|&m| {
                (self.surrogate.predict(m, c) / self.measured[m])
                    .ln()
                    .powi(2)
            })
            .sum();
        let pull: f64 = self
            .free
            .iter()
            .zip(c)
            .map(|(f, c)| (c / f.default).ln().powi(2))
            .sum();
        misfit + self.pull * pull
    }
}

impl CostFunction for Problem<'_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, u: &Self::Param) -> Result<f64, Error> {
        Ok(self.objective(&self.costs(u)))
    }
}

/// The costs within their ranges that minimise, over the timings `used`,
/// `Σ ln(predicted / measured)² + pull · Σ_j ln(c_j / default_j)²`, starting from the
/// surrogate's point.
pub fn minimise(
    surrogate: &Surrogate,
    measured: &[f64],
    used: &[usize],
    free: &[FreeCost],
    pull: f64,
) -> Vec<f64> {
    let problem = Problem {
        surrogate,
        measured,
        used,
        free,
        pull,
    };
    let mut best: Vec<f64> = free
        .iter()
        .zip(&surrogate.at)
        .map(|(f, c)| to_coordinate(f, *c))
        .collect();
    // Nelder–Mead can stall on a ridge: restart from its result until it stops improving.
    let mut best_value = problem.objective(&problem.costs(&best));
    for _ in 0..4 {
        let mut simplex = vec![best.clone()];
        for j in 0..best.len() {
            let mut v = best.clone();
            v[j] += 1.0;
            simplex.push(v);
        }
        let solver = NelderMead::new(simplex)
            .with_sd_tolerance(1e-14)
            .expect("a finite tolerance");
        let Ok(result) = Executor::new(problem, solver)
            .configure(|s| s.max_iters(4000))
            .run()
        else {
            break;
        };
        let (Some(u), value) = (result.state.best_param, result.state.best_cost) else {
            break;
        };
        if value > best_value {
            break;
        }
        let stalled = value >= best_value * (1.0 - 1e-9) - 1e-15;
        (best, best_value) = (u, value);
        if stalled {
            break;
        }
    }
    problem.costs(&best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free(name: &str, default: f64) -> FreeCost {
        FreeCost {
            name: name.into(),
            lo: 0.1,
            hi: 1000.0,
            default,
        }
    }

    #[test]
    fn a_linear_model_is_recovered_exactly() {
        // Timings t = 1 + 3a + 5b (seconds per ns of cost), true a = 7, b = 2.
        let f = [free("a", 10.0), free("b", 10.0)];
        let at = [10.0, 10.0];
        let t = |a: f64, b: f64| vec![1.0 + 3.0 * a + 5.0 * b, 2.0 + a, 4.0 + 7.0 * b];
        let moved: Vec<f64> = f.iter().map(|c| moved(c, c.default)).collect();
        let s = Surrogate::new(&at, t(10.0, 10.0), &moved, &[t(20.0, 10.0), t(10.0, 20.0)]);
        let measured = t(7.0, 2.0);
        let c = minimise(&s, &measured, &[0, 1, 2], &f, 0.0);
        assert!(
            (c[0] - 7.0).abs() < 1e-4 && (c[1] - 2.0).abs() < 1e-4,
            "{c:?}"
        );
    }

    #[test]
    fn costs_stay_in_their_ranges_and_the_pull_holds_an_unmeasured_cost() {
        // Timing 0 wants a below its range; b affects nothing, so the pull keeps its default.
        let f = [
            FreeCost {
                name: "a".into(),
                lo: 5.0,
                hi: 50.0,
                default: 10.0,
            },
            free("b", 3.0),
        ];
        let s = Surrogate {
            at: vec![10.0, 3.0],
            value: vec![10.0],
            slope: vec![vec![1.0, 0.0]],
        };
        let c = minimise(&s, &[1.0], &[0], &f, 1e-3);
        assert!(c[0] >= 5.0 && c[0] < 5.01, "{c:?}");
        assert!((c[1] - 3.0).abs() < 1e-3, "{c:?}");
    }

    #[test]
    fn a_secant_moves_a_cost_within_its_range() {
        let c = free("a", 600.0);
        assert_eq!(moved(&c, 600.0), 300.0);
        assert_eq!(moved(&c, 10.0), 20.0);
        let narrow = FreeCost {
            name: "b".into(),
            lo: 8.0,
            hi: 12.0,
            default: 10.0,
        };
        assert_eq!(moved(&narrow, 10.0), 12.0);
        assert_eq!(moved(&narrow, 11.0), 8.0);
    }
}
