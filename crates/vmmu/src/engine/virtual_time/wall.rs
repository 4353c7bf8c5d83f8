//! Where the host's wall clock goes in a virtual-time run, for whoever studies the simulator's
//! own speed: with `VMMU_ENGINE_TIMES` set in the environment (to anything), the engine prints
//! one line on standard error when it is dropped, with the seconds it spent running the vCPUs
//! (passes, and background passes between the VMM's steps; of those, in parallel phases of
//! private steps: `fast_forward`) and in the VMM's plans (the vCPUs a plan brings up to its
//! clock included). What is left of a run's time is the scenario's own setup and reports.
//! Nothing is read from the clock otherwise.

use std::time::{Duration, Instant};

/// A part of a virtual-time run whose wall time is summed ([`WallTimes`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// The vCPUs running: a pass of every vCPU (`Engine::run_pass`, `Engine::run_pass_beside`,
    /// whose host thread's plans count here), or background passes up to the host's clock
    /// (`Engine::elapse`, `Engine::stop_vcpus`).
    Passes,
    /// A parallel phase of private steps, within a pass or a plan.
    Phases,
    /// The VMM's or the host threads' plans (`Engine::run_plans`, `Engine::run_host_threads`).
    Plans,
}

/// The wall time summed per [`Part`], when asked for.
#[derive(Debug, Default)]
pub struct WallTimes {
    enabled: bool,
    spent: [Duration; 3],
}

impl WallTimes {
    /// Summing when `VMMU_ENGINE_TIMES` is set.
    pub fn from_env() -> Self {
        WallTimes::new(std::env::var_os("VMMU_ENGINE_TIMES").is_some())
    }

    /// Summing if `enabled`.
    pub fn new(enabled: bool) -> Self {
        WallTimes {
            enabled,
            spent: Default::default(),
        }
    }

    /// Where a timed part starts (`None` when not summing).
    #[inline]
    pub fn start(&self) -> Option<Instant> {
        self.enabled.then(Instant::now)
    }

    /// The part `part` that started at `start` ended now.
    #[inline]
    pub fn add(&mut self, part: Part, start: Option<Instant>) {
        if let Some(t) = start {
            self.spent[part as usize] += t.elapsed();
        }
    }

    /// The wall time summed for `part`.
    pub fn spent(&self, part: Part) -> Duration {
        self.spent[part as usize]
    }

    /// The line printed at the end of the run, if summing.
    pub fn report(&self) -> Option<String> {
        self.enabled.then(|| {
            format!(
                "vmmu: engine wall clock: {:.3} s in passes ({:.3} s in parallel phases), {:.3} s in plans",
                self.spent(Part::Passes).as_secs_f64(),
                self.spent(Part::Phases).as_secs_f64(),
                self.spent(Part::Plans).as_secs_f64(),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_enabled_clock_sums_and_reports() {
        let mut off = WallTimes::new(false);
        let t = off.start();
        assert!(t.is_none());
        off.add(Part::Plans, t);
        assert_eq!(off.spent(Part::Plans), Duration::ZERO);
        assert_eq!(off.report(), None);
        let mut on = WallTimes::new(true);
        let t = on.start();
        std::thread::sleep(Duration::from_millis(2));
        on.add(Part::Passes, t);
        assert!(on.spent(Part::Passes) >= Duration::from_millis(2));
        assert_eq!(on.spent(Part::Phases), Duration::ZERO);
        let line = on.report().expect("enabled");
        assert!(
            line.contains("s in passes") && line.contains("s in plans"),
            "{line}"
        );
    }
}
