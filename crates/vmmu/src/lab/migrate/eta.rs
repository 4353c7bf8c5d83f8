//! How long a migration run will take, said before the migration starts and shown as it goes
//! (progress lines on stderr): the guest time it simulates follows from the memory, the
//! working set and the link; the simulated accesses from the guests' rate in the warm-up;
//! the wall time from how fast this machine simulated the warm-up.

use super::MigrateParams;
use crate::units::PAGE_SIZE;
use std::time::{Duration, Instant};

/// How often a progress line is printed, at most.
const EVERY: Duration = Duration::from_secs(2);

impl MigrateParams {
    /// The guest time the migration takes, from the guests' start, as a range in
    /// nanoseconds: at least the warm-up, the bulk round (all memory over the link) and a
    /// stop-and-copy within the downtime limit; at most that plus `max_rounds` rounds and a
    /// forced stop-and-copy that each resend the whole working set.
    pub fn guest_time_estimate_ns(&self) -> (u64, u64) {
        let vm = &self.vm;
        // A guest dirties one 4 KiB page of each guest page it writes.
        let ws_pages = vm.vcpus as u64
            * (self.working_set_bytes.min(vm.vcpu_memory_bytes)
                / PAGE_SIZE
                / vm.guest_page_stride());
        let least = self.warmup_ns + self.wire_ns(vm.guest_pages()) + self.downtime_ns;
        let most = least + u64::from(self.max_rounds + 1) * self.wire_ns(ws_pages);
        (least, most)
    }
}

/// The wall clock of one migration run and its estimate.
pub(super) struct Eta {
    /// When the guests started their loop.
    start: Instant,
    /// The guests' accesses then (populating memory), left out of the warm-up's rate.
    base: u64,
    /// When the last progress line was printed.
    last: Instant,
    /// The estimated guest time of the migration (see
    /// [`MigrateParams::guest_time_estimate_ns`]), once the warm-up has measured the rates.
    estimate_ns: Option<(u64, u64)>,
}

impl Eta {
    /// A run starting now, with no estimate yet.
    pub(super) fn new() -> Self {
        let now = Instant::now();
        Eta {
            start: now,
            base: 0,
            last: now,
            estimate_ns: None,
        }
    }

    /// The guests start their loop, having made `accesses` (populating memory): the warm-up
    /// is measured from here.
    pub(super) fn guests_started(&mut self, accesses: u64) {
        self.start = Instant::now();
        self.base = accesses;
    }

    /// The estimate, from the warm-up's accesses (`accesses` counts from the start of the run)
    /// in `warmup_ns` of guest time: the guest
    /// time, the simulated accesses and the wall time of the migration and (`baseline`) of the
    /// run without it that follows.
    pub(super) fn after_warmup(
        &mut self,
        p: &MigrateParams,
        accesses: u64,
        warmup_ns: u64,
    ) -> String {
        let accesses = accesses.saturating_sub(self.base);
        let (least, most) = p.guest_time_estimate_ns();
        self.estimate_ns = Some((least, most));
        let runs = if p.baseline { 2.0 } else { 1.0 };
        let wall = self.start.elapsed().as_secs_f64().max(1e-6);
        let per_guest_ns = accesses as f64 / warmup_ns.max(1) as f64;
        let acc = |ns: u64| ns as f64 * per_guest_ns * runs;
        let wall_for = |ns: u64| acc(ns) / accesses.max(1) as f64 * wall;
        format!(
            "estimate: {:.3}-{:.3} s of guest time{}, {:.1}-{:.1} M simulated guest accesses ({:.1} M/s in the warm-up), about {:.0}-{:.0} s of wall time",
            least as f64 / 1e9,
            most as f64 / 1e9,
            if p.baseline { ", twice (with the baseline)" } else { "" },
            acc(least) / 1e6,
            acc(most) / 1e6,
            accesses as f64 / wall / 1e6,
            wall_for(least),
            wall_for(most)
        )
    }

    /// A run that ends at `end_ns` of guest time (the baseline runs as long as the migration).
    pub(super) fn ends_at(&mut self, end_ns: u64) {
        self.estimate_ns = Some((end_ns, end_ns));
    }

    /// A progress line, at most every [`EVERY`] of wall time: where the run is in guest time
    /// against the estimate, the accesses so far and the wall time.
    pub(super) fn tick(&mut self, what: &str, now_ns: u64, accesses: u64) -> Option<String> {
        if self.last.elapsed() < EVERY {
            return None;
        }
        self.last = Instant::now();
        let of = match self.estimate_ns {
            None => String::new(),
            Some((least, most)) if least == most => format!(" (of {:.3} s)", most as f64 / 1e9),
            Some((_, most)) => format!(" (of at most {:.3} s)", most as f64 / 1e9),
        };
        Some(format!(
            "{what}: {:.3} s of guest time{of}, {:.1} M guest accesses, {:.0} s of wall time",
            now_ns as f64 / 1e9,
            accesses as f64 / 1e6,
            self.start.elapsed().as_secs_f64()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_time_is_the_bulk_round_plus_at_most_every_round_s_working_set() {
        let p = MigrateParams {
            working_set_bytes: 1 << 20,
            bandwidth_bps: 8 << 20,
            downtime_ns: 0,
            warmup_ns: 0,
            max_rounds: 3,
            vm: crate::lab::params::DirtyLogParams {
                vcpus: 2,
                vcpu_memory_bytes: 4 << 20,
                ..Default::default()
            },
            ..Default::default()
        };
        // 8 MiB at 1 MiB/s, then 3 rounds and a stop-and-copy of 2 MiB each.
        assert_eq!(p.guest_time_estimate_ns(), (8_000_000_000, 16_000_000_000));
    }
}
