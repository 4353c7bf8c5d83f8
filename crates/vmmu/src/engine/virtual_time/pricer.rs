//! Virtual time's currency: picoseconds, and a [`CostModel`] turned into a price per counted
//! event. A clock advances by the price of what an actor's [`Meter`] counted since it last
//! looked, so the MMU code never reads a clock.

use crate::cost::CostModel;
use crate::engine::EngineError;
use crate::kvm::meter::Meter;

/// Picoseconds: virtual clocks count in ps so that sub-nanosecond costs (a TLB hit) add up.
pub type Ps = u64;

/// The cost of `delta` in picoseconds.
pub fn cost_ps(cost: &CostModel, delta: &Meter) -> Ps {
    (cost.nanos_f64(delta) * 1000.0).round() as Ps
}

/// A cost model turned into per-unit picoseconds once, for the engine's hot path (every guest
/// access is priced).
pub struct Pricer {
    unit_ps: [f64; crate::kvm::meter::NR_METER_FIELDS],
    /// The same in whole picoseconds, when every unit cost is one (the defaults and any cost
    /// given to the picosecond): integer arithmetic prices a delta exactly and several times
    /// faster than converting each count to floating point.
    unit_ps_int: Option<[u64; crate::kvm::meter::NR_METER_FIELDS]>,
}

impl Pricer {
    /// Prices with `cost`.
    pub fn new(cost: &CostModel) -> Self {
        let unit_ps = cost.unit_costs().map(|ns| ns * 1000.0);
        // A cost in ns with up to three decimals is a whole number of ps up to the error of
        // its binary representation (3.7 ns is 3700.0000000000005 ps).
        let integral = unit_ps
            .iter()
            .all(|&ps| (0.0..1e15).contains(&ps) && (ps - ps.round()).abs() < 1e-6);
        Pricer {
            unit_ps,
            unit_ps_int: integral.then(|| unit_ps.map(|ps| ps.round() as u64)),
        }
    }

    /// Every unit cost is a whole number of picoseconds, so prices are integers and the price of
    /// a sum of work is the sum of its prices.
    pub fn is_integral(&self) -> bool {
        self.unit_ps_int.is_some()
    }

    /// The cost of the work counted between `before` and `after`, in picoseconds (the same
    /// value as [`cost_ps`] of the difference).
    #[inline]
    pub fn ps(&self, before: &Meter, after: &Meter) -> Ps {
        if let Some(unit) = &self.unit_ps_int {
            // Exact: the float sum below is exact too while it stays under 2^53 ps (104 days).
            // The sum of (after - before) x price is taken as the difference of the two
            // meters' sums: equal in wrapping arithmetic, and each reads its fields in place.
            return after
                .wrapping_dot(unit)
                .wrapping_sub(before.wrapping_dot(unit));
        }
        let (b, a) = (before.counts(), after.counts());
        let mut sum = 0.0;
        for i in 0..a.len() {
            sum += (a[i] - b[i]) as f64 * self.unit_ps[i];
        }
        sum.round() as Ps
    }
}

/// Picoseconds to nanoseconds (rounded down).
pub fn ps_to_ns(ps: Ps) -> u64 {
    ps / 1000
}

/// Refuses cost models under which virtual time cannot advance (a guest access that costs
/// nothing would let a vCPU run forever at one instant) or would overflow (one unit of some work
/// costing more than a second).
pub fn check_cost_model(cost: &CostModel) -> Result<(), EngineError> {
    // A read hit and a write hit: either at 0 ns would let a vCPU's clock stop.
    for (what, access) in [
        (
            "read",
            Meter {
                tlb_hits: 1,
                guest_reads: 1,
                ..Default::default()
            },
        ),
        (
            "write",
            Meter {
                tlb_hits: 1,
                guest_writes: 1,
                ..Default::default()
            },
        ),
    ] {
        if cost_ps(cost, &access) == 0 {
            return Err(EngineError::CostModel(format!("cost model: a guest {what} that hits the TLB (tlb_hit_ns + guest_memory_access_ns) costs 0 ns, so virtual time cannot advance; give one of them a positive value")));
        }
    }
    let everything = Meter::from_counts([1; crate::kvm::meter::NR_METER_FIELDS]);
    if cost.nanos_f64(&everything) > 1e9 {
        return Err(EngineError::CostModel("cost model: one unit of every counted event costs more than a second; costs are in nanoseconds".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pricer_agrees_with_the_cost_model() {
        let cost = CostModel::default();
        let before = Meter {
            tlb_hits: 3,
            ..Default::default()
        };
        let after = Meter {
            tlb_hits: 10,
            guest_writes: 7,
            ept_violations: 2,
            spte_writes: 5,
            ..Default::default()
        };
        // Whole picoseconds (the defaults of both architectures): the integer path.
        for cost in [cost, CostModel::default_arm64()] {
            let p = Pricer::new(&cost);
            assert!(p.unit_ps_int.is_some());
            assert_eq!(p.ps(&before, &after), cost_ps(&cost, &after.since(&before)));
        }
        // A fitted cost with a fraction of a picosecond: the floating-point path, same result.
        let mut fitted = CostModel::default();
        fitted.set_software_ns("spte_writes", 3.0001234).unwrap();
        let p = Pricer::new(&fitted);
        assert!(p.unit_ps_int.is_none());
        assert_eq!(
            p.ps(&before, &after),
            cost_ps(&fitted, &after.since(&before))
        );
    }
}
