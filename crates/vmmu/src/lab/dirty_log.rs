//! The `dirty-log` scenario (dirty_log_perf_test), written once for every backend: the model on
//! either engine ([`crate::lab::dirty_log_model`]) and real KVM (the `vmmu-kvm` crate). The
//! phases are the selftest's: populate, enable dirty logging, N × (dirty memory, GET, CLEAR),
//! disable dirty logging. The backend's completeness oracle checks every harvest; the
//! page-table invariants, where the backend can see page tables, are checked at the end (and
//! after every dirty phase in debug builds).

use crate::engine::TimeSource;
use crate::lab::report::{
    DirtyLogReport, IterationReport, OracleReport, Phase, PhaseCounters, PhaseEvent, PhaseSink,
};

/// What the dirty-log scenario asks of whatever runs it. Every operation that a phase times
/// returns its time in nanoseconds of the backend's [`TimeSource`]. A backend that cannot do
/// something the model does says so: [`DirtyLogBackend::lap`] and
/// [`DirtyLogBackend::check_invariants`] return `None`.
pub trait DirtyLogBackend {
    /// A failure that ends the run.
    type Error;

    /// The report's header (backend, engine, MMU, parameters, test memory), phases empty.
    fn report(&self) -> DirtyLogReport;

    /// What the phase times measure.
    fn time_source(&self) -> TimeSource;

    /// Every vCPU makes pass `iteration` of the memstress guest (0 populates: sequential
    /// writes of every page), from the moment the host publishes it until the last vCPU's
    /// `GUEST_SYNC`.
    fn run_pass(&mut self, iteration: u32) -> Result<u64, Self::Error>;

    /// `-e`: the vCPUs keep making passes, untimed, until [`DirtyLogBackend::stop_vcpus`].
    fn start_background_passes(&mut self) -> Result<(), Self::Error>;

    /// `host_quit`: every vCPU finishes its pass and leaves `KVM_RUN`.
    fn stop_vcpus(&mut self) -> Result<(), Self::Error>;

    /// Sets (`on`) or clears `KVM_MEM_LOG_DIRTY_PAGES` on every test memslot.
    fn set_dirty_logging(&mut self, on: bool) -> Result<u64, Self::Error>;

    /// The harvest's first half: `KVM_GET_DIRTY_LOG` of every test memslot (or whatever the
    /// backend's harvest mode reads). The backend keeps what it got for the clear and the
    /// check.
    fn get_dirty_log(&mut self) -> Result<u64, Self::Error>;

    /// The harvest's second half: `KVM_CLEAR_DIRTY_LOG` of exactly what GET returned, or
    /// `None` when the mode has no such step (manual protect off).
    fn clear_dirty_log(&mut self) -> Result<Option<u64>, Self::Error>;

    /// The completeness oracle on the harvest just made: every page written before it began
    /// must be in it. Returns the number of pages the harvest reported dirty.
    fn check_harvest(&mut self) -> u64;

    /// The counters of the phase that just ended (since the previous lap), or `None` when the
    /// backend cannot see what its MMU did.
    fn lap(&mut self) -> Option<PhaseCounters>;

    /// The page-table invariant check (no vCPU in a fault), or `None` when the backend's page
    /// tables cannot be inspected.
    fn check_invariants(&mut self) -> Option<Vec<String>>;

    /// The completeness oracle's verdict over the run (lost pages, harvests and pages checked,
    /// and any consistency errors the backend's oracle found).
    fn oracle_report(&mut self) -> OracleReport;
}

/// Runs dirty_log_perf_test's phases on `b` with `p`, checking each harvest with the backend's
/// oracle.
pub fn run_dirty_log<B: DirtyLogBackend>(
    p: &crate::lab::params::DirtyLogParams,
    b: &mut B,
) -> Result<DirtyLogReport, B::Error> {
    run_dirty_log_streamed(p, b, &mut ())
}

/// [`run_dirty_log`], telling `sink` of each phase as it ends.
pub fn run_dirty_log_streamed<B: DirtyLogBackend>(
    p: &crate::lab::params::DirtyLogParams,
    b: &mut B,
    sink: &mut dyn PhaseSink,
) -> Result<DirtyLogReport, B::Error> {
    let mut report = b.report();
    let mut invariant_errors = Vec::new();
    let ns = b.run_pass(0)?;
    report.populate = Phase {
        wall_ns: ns,
        counters: b.lap(),
    };
    sink.phase(&report, PhaseEvent::Populate(&report.populate));

    let ns = b.set_dirty_logging(true)?;
    report.enable = Phase {
        wall_ns: ns,
        counters: b.lap(),
    };
    sink.phase(&report, PhaseEvent::Enable(&report.enable));

    for it in 1..=p.iterations {
        let ns = b.run_pass(it)?;
        let dirty = Phase {
            wall_ns: ns,
            counters: b.lap(),
        };
        if cfg!(debug_assertions) {
            invariant_errors.extend(b.check_invariants().unwrap_or_default());
        }
        let ns = b.get_dirty_log()?;
        let get = Phase {
            wall_ns: ns,
            counters: b.lap(),
        };
        let clear = b.clear_dirty_log()?.map(|ns| Phase {
            wall_ns: ns,
            counters: b.lap(),
        });
        let dirty_pages = b.check_harvest();
        report.iterations.push(IterationReport {
            iteration: it,
            dirty,
            get,
            clear,
            dirty_pages,
        });
        let last = report.iterations.last().expect("just pushed");
        let mut met = report.iteration_meetings;
        met.add(&last.dirty);
        met.add(&last.get);
        if let Some(c) = &last.clear {
            met.add(c);
        }
        report.iteration_meetings = met;
        let last = report.iterations.last().expect("just pushed");
        sink.phase(&report, PhaseEvent::Iteration(last));
        if !sink.keeps_iteration_counters() {
            let last = report.iterations.last_mut().expect("just pushed");
            last.dirty.counters = None;
            last.get.counters = None;
            if let Some(c) = &mut last.clear {
                c.counters = None;
            }
        }
    }

    if p.run_vcpus_while_disabling {
        b.start_background_passes()?;
    }
    let ns = b.set_dirty_logging(false)?;
    // The -e passes finish and every vCPU leaves KVM_RUN: their work counts in the disable
    // phase; the phase's time is the VMM's.
    b.stop_vcpus()?;
    report.disable = Phase {
        wall_ns: ns,
        counters: b.lap(),
    };
    sink.phase(&report, PhaseEvent::Disable(&report.disable));

    report.oracle = b.oracle_report();
    let mut own = std::mem::take(&mut report.oracle.invariant_errors);
    invariant_errors.append(&mut own);
    invariant_errors.extend(b.check_invariants().unwrap_or_default());
    report.oracle.invariant_errors = invariant_errors;
    Ok(report)
}

/// The oracle verdict as one line, or `None` when it passed.
pub fn oracle_failure(r: &OracleReport) -> Option<String> {
    if r.lost_pages > 0 {
        let gfns: Vec<String> = r.lost_gfns.iter().map(|g| format!("{g:#x}")).collect();
        return Some(format!(
            "dirty-log oracle: {} written page(s) missing from the harvest, first gfns {}",
            r.lost_pages,
            gfns.join(" ")
        ));
    }
    if let Some(e) = r.invariant_errors.first() {
        return Some(format!(
            "page-table invariants: {} violation(s), first: {e}",
            r.invariant_errors.len()
        ));
    }
    None
}
