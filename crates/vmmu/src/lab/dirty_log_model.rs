//! The model as a [`DirtyLogBackend`]: a VM set up as memstress sets it up, its vCPUs running the
//! memstress guest (`DirtyLogGuest`) on an [`Engine`], the VMM's ioctls run as plans on the
//! same engine, and the completeness oracle recording every guest write as it retires.
//! [`run_dirty_log_threads`] and [`run_dirty_log_virtual`] run the one scenario
//! ([`crate::lab::dirty_log::run_dirty_log`]) on each engine.

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::drift::PassStart;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{AscendingWrites, Engine, GuestAccess, GuestCode, PrivateGfns, TimeSource};
use crate::kvm::dirty_log::{clear_dirty_log_plan, get_dirty_log_plan};
use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
use crate::kvm::op_plan::OpPlan;
use crate::lab::dirty_log::{run_dirty_log_streamed, DirtyLogBackend};
use crate::lab::memstress::{pass_value, vcpu_regions, GuestRandom, PassCursor, VcpuRegion};
use crate::lab::oracle::DirtyLogOracle;
use crate::lab::params::DirtyLogParams;
use crate::lab::report::{DirtyLogReport, OracleReport, PhaseCounters, PhaseSink};
use crate::lab::test_vm::{PhaseClock, Setup};
use crate::lab::LabError;
use crate::units::{Gfn, GfnRange, PAGE_SIZE};
use crate::vm::waiter::SpinWaiter;
use parking_lot::Mutex;
use std::sync::Arc;

/// Where a GET plan leaves the bitmap it copied out.
pub(crate) type BitmapOut = Arc<Mutex<Vec<u64>>>;

/// What the dirty-log scenario does with the VM memstress built.
impl Setup {
    /// The report skeleton for a run of `p` by `engine`.
    pub(crate) fn report(&self, p: &DirtyLogParams, engine: &str) -> DirtyLogReport {
        DirtyLogReport {
            backend: "model".into(),
            engine: engine.into(),
            mmu: self.vm.mmu.name().into(),
            params: p.clone(),
            test_memory: (self.gpa, self.gpa + p.guest_pages() * PAGE_SIZE),
            ..Default::default()
        }
    }

    /// `KVM_GET_DIRTY_LOG` plans for every test slot, and where their bitmaps land.
    pub(crate) fn get_plans(&self) -> (Vec<OpPlan>, Vec<BitmapOut>) {
        self.slots
            .iter()
            .map(|s| {
                let out = Arc::new(Mutex::new(Vec::new()));
                (get_dirty_log_plan(&self.vm.kvm, s, Arc::clone(&out)), out)
            })
            .unzip()
    }

    /// `KVM_CLEAR_DIRTY_LOG` plans that clear what GET returned, whole slot by whole slot.
    fn clear_plans(&self, bitmaps: &[Vec<u64>]) -> Result<Vec<OpPlan>, LabError> {
        self.slots
            .iter()
            .zip(bitmaps)
            .map(|(s, bm)| Ok(clear_dirty_log_plan(&self.vm.kvm, s, 0, s.npages, bm)?))
            .collect()
    }

    /// Records harvest `k`'s bitmaps with the oracle and checks it; returns the pages reported.
    fn check_harvest(
        &self,
        k: u32,
        bitmaps: &[Vec<u64>],
        oracle: &mut OracleReport,
        lost: &mut Vec<u64>,
    ) -> u64 {
        let mut dirty_pages = 0;
        for (s, bm) in self.slots.iter().zip(bitmaps) {
            self.oracle.record_report(k, s.base_gfn.0, bm);
            dirty_pages += bm.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        }
        let check = self.oracle.end_harvest(k);
        oracle.harvests_checked += 1;
        oracle.pages_checked += check.checked;
        lost.extend(check.lost);
        dirty_pages
    }
}

/// The memstress guest of one vCPU with the dirty-log oracle around its writes: what every
/// engine runs on vCPU `vcpu`. The oracle records each write's sequence before the access and
/// the page after it retires, so a harvest that began in between is not expected to see it.
pub(crate) struct DirtyLogGuest {
    vcpu: usize,
    region: VcpuRegion,
    rng: GuestRandom,
    random_access: bool,
    write_percent: u32,
    oracle: Arc<DirtyLogOracle>,
    /// 4 KiB pages per guest page: the guest touches the first of each.
    stride: u64,
    cursor: PassCursor,
    value: u64,
    /// The oracle's sequence for the write in flight.
    write_seq: u32,
    /// Its region is its own (memstress partitions the memory unless told to overlap).
    partitioned: bool,
    /// The pass in progress may write.
    writes: bool,
}

impl DirtyLogGuest {
    /// The guests of every vCPU of `setup`'s VM, seeded as the selftest seeds them.
    pub(crate) fn for_vcpus(setup: &Setup, p: &DirtyLogParams) -> Vec<DirtyLogGuest> {
        vcpu_regions(
            setup.base_gfn,
            p.vcpus,
            p.vcpu_memory_bytes / PAGE_SIZE,
            p.partition,
        )
        .into_iter()
        .enumerate()
        .map(|(i, mut region)| {
            // The guest counts its own pages: one access per guest page.
            region.pages /= p.guest_page_stride();
            (i, region)
        })
        .map(|(i, region)| DirtyLogGuest {
            vcpu: i,
            stride: p.guest_page_stride(),
            cursor: PassCursor::new(0, false, 0),
            region,
            rng: GuestRandom::new(p.random_seed.wrapping_add(i as u32)),
            random_access: p.random_access,
            write_percent: p.write_percent,
            oracle: Arc::clone(&setup.oracle),
            value: 0,
            write_seq: 0,
            partitioned: p.partition,
            writes: true,
        })
        .collect()
    }
}

impl GuestCode for DirtyLogGuest {
    fn start_pass(&mut self, iteration: i64) {
        // dirty_log_perf_test populates (iteration 0) with sequential 100% writes so every page
        // is mapped, then switches to the requested pattern.
        let (random, write_percent) = if iteration == 0 {
            (false, 100)
        } else {
            (self.random_access, self.write_percent)
        };
        self.cursor = PassCursor::new(self.region.pages, random, write_percent);
        self.writes = write_percent > 0;
        self.value = pass_value(iteration, self.vcpu);
    }

    #[inline]
    fn next_access(&mut self) -> Option<GuestAccess> {
        let (page, write) = self.cursor.next(&mut self.rng)?;
        if write {
            self.write_seq = self.oracle.before_write();
        }
        Some(GuestAccess::first_word(
            Gfn(self.region.base_gfn + page * self.stride),
            write,
            self.value,
        ))
    }

    #[inline]
    fn access_done(&mut self, access: &GuestAccess) {
        if access.write {
            self.oracle.after_write(access.gfn.0, self.write_seq);
        }
    }

    /// A pass of writes in order, over one 4 KiB page per guest page.
    fn ascending_writes(&self) -> Option<AscendingWrites> {
        let (next, left) = self.cursor.ascending_writes()?;
        (self.stride == 1 && left > 0).then_some(AscendingWrites {
            first: Gfn(self.region.base_gfn + next),
            len: left,
            value: self.value,
        })
    }

    fn skip_accesses(&mut self, n: u64) {
        if let Some(run) = self.ascending_writes().filter(|run| n <= run.len) {
            // As each write would sample the generation before and after: no harvest runs
            // between the accesses skipped.
            self.write_seq = self.oracle.before_write();
            self.oracle.after_writes(run.first.0, n, self.write_seq);
            self.cursor.skip_ascending_writes(n, &mut self.rng);
            return;
        }
        for _ in 0..n {
            let access = self
                .next_access()
                .expect("the pass has the accesses it announced");
            self.access_done(&access);
        }
    }

    /// Its partition of the memory (the oracle's record of each page is the page's own).
    fn private_gfns(&self) -> Option<PrivateGfns> {
        self.partitioned.then(|| PrivateGfns {
            range: GfnRange::new(Gfn(self.region.base_gfn), self.region.pages * self.stride),
            write: self.writes,
        })
    }
}

/// The model on engine `E`, as the scenario's backend.
pub(crate) struct ModelBackend<'a, E> {
    setup: &'a Setup,
    p: &'a DirtyLogParams,
    engine: E,
    clock: PhaseClock,
    progress: bool,
    /// The oracle's number for the harvest in progress, and what its GET returned.
    harvest: Option<(u32, Vec<Vec<u64>>)>,
    oracle: OracleReport,
    lost: Vec<u64>,
}

impl<'a, E: Engine> ModelBackend<'a, E> {
    /// Backend over `setup`'s VM driven by `engine`; `progress` prints phase names to stderr.
    pub(crate) fn new(setup: &'a Setup, p: &'a DirtyLogParams, engine: E, progress: bool) -> Self {
        ModelBackend {
            setup,
            p,
            engine,
            clock: PhaseClock::default(),
            progress,
            harvest: None,
            oracle: OracleReport::default(),
            lost: Vec::new(),
        }
    }

    fn say(&self, what: &str) {
        if self.progress {
            eprintln!("vmmu: {what}");
        }
    }
}

impl<E: Engine> DirtyLogBackend for ModelBackend<'_, E> {
    type Error = LabError;

    fn report(&self) -> DirtyLogReport {
        self.setup.report(self.p, self.engine.name())
    }

    fn time_source(&self) -> TimeSource {
        self.engine.time_source()
    }

    fn run_pass(&mut self, iteration: u32) -> Result<u64, LabError> {
        self.say(&if iteration == 0 {
            "populating memory".to_string()
        } else {
            format!("iteration {iteration}")
        });
        Ok(self.engine.run_pass(iteration as i64)?)
    }

    fn start_background_passes(&mut self) -> Result<(), LabError> {
        // The selftest's `iteration = -1`: passes go on until host_quit.
        self.engine.start_background_passes(-1);
        Ok(())
    }

    fn stop_vcpus(&mut self) -> Result<(), LabError> {
        Ok(self.engine.stop_vcpus()?)
    }

    fn set_dirty_logging(&mut self, on: bool) -> Result<u64, LabError> {
        self.say(if on {
            "enabling dirty logging"
        } else {
            "disabling dirty logging"
        });
        let flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        let ns = self.engine.run_plans(self.setup.flags_plans(flags))?;
        if on {
            self.setup.oracle.logging_enabled();
        }
        Ok(ns)
    }

    fn get_dirty_log(&mut self) -> Result<u64, LabError> {
        // Writes that retire after this point may or may not be in this harvest.
        let k = self.setup.oracle.begin_harvest();
        let (plans, outs) = self.setup.get_plans();
        let ns = self.engine.run_plans(plans)?;
        let bitmaps = outs
            .iter()
            .map(|o| std::mem::take(&mut *o.lock()))
            .collect();
        self.harvest = Some((k, bitmaps));
        Ok(ns)
    }

    fn clear_dirty_log(&mut self) -> Result<Option<u64>, LabError> {
        if !self.p.manual_protect {
            return Ok(None);
        }
        let (_, bitmaps) = self.harvest.as_ref().expect("GET before CLEAR");
        let plans = self.setup.clear_plans(bitmaps)?;
        Ok(Some(self.engine.run_plans(plans)?))
    }

    fn check_harvest(&mut self) -> u64 {
        let (k, bitmaps) = self.harvest.take().expect("GET before the check");
        self.setup
            .check_harvest(k, &bitmaps, &mut self.oracle, &mut self.lost)
    }

    fn lap(&mut self) -> Option<PhaseCounters> {
        Some(self.clock.lap(&self.setup.vm, &self.engine.vcpu_meters()))
    }

    fn check_invariants(&mut self) -> Option<Vec<String>> {
        Some(self.setup.vm.check_invariants())
    }

    fn oracle_report(&mut self) -> OracleReport {
        let mut r = std::mem::take(&mut self.oracle);
        let mut lost = std::mem::take(&mut self.lost);
        r.lost_pages = lost.len() as u64;
        lost.truncate(16);
        r.lost_gfns = lost;
        r
    }
}

/// Runs the scenario on the threads engine. `progress` prints phase names to stderr.
pub fn run_dirty_log_threads(
    p: &DirtyLogParams,
    progress: bool,
) -> Result<DirtyLogReport, LabError> {
    run_dirty_log_threads_streamed(p, progress, &mut ())
}

/// [`run_dirty_log_threads`], telling `sink` of each phase as it ends.
pub fn run_dirty_log_threads_streamed(
    p: &DirtyLogParams,
    progress: bool,
    sink: &mut dyn PhaseSink,
) -> Result<DirtyLogReport, LabError> {
    p.validate()?;
    let setup = Setup::new(&p.test_vm(), Box::new(SpinWaiter))?;
    let engine = Threads::new(Arc::clone(&setup.vm), DirtyLogGuest::for_vcpus(&setup, p));
    run_dirty_log_streamed(p, &mut ModelBackend::new(&setup, p, engine, progress), sink)
}

/// Runs the scenario in virtual time with `cost`: the same VM, MMU, guest and oracles as the
/// threads engine, so a run at 64 or 256 vCPUs on a 2-core machine gives the same numbers
/// every time. Phase times are virtual: what the [`CostModel`] says the work each actor's
/// [`Meter`](crate::kvm::meter::Meter) counted costs, with vCPUs running in parallel and
/// waiting for each other only on `mmu_lock`. `progress` prints phase names to stderr.
pub fn run_dirty_log_virtual(
    p: &DirtyLogParams,
    cost: &CostModel,
    progress: bool,
) -> Result<DirtyLogReport, LabError> {
    run_dirty_log_virtual_streamed(p, cost, progress, &mut ())
}

/// [`run_dirty_log_virtual`], telling `sink` of each phase as it ends.
pub fn run_dirty_log_virtual_streamed(
    p: &DirtyLogParams,
    cost: &CostModel,
    progress: bool,
    sink: &mut dyn PhaseSink,
) -> Result<DirtyLogReport, LabError> {
    // Before the VM's memory is allocated.
    crate::engine::virtual_time::check_cost_model(cost)?;
    p.validate()?;
    let setup = Setup::new(&p.test_vm(), Box::new(VirtualWaiter))?;
    // memstress's vCPU threads spin on `iteration`.
    let engine = VirtualTime::new(&setup.vm, cost, DirtyLogGuest::for_vcpus(&setup, p))?
        .with_pass_start(PassStart::Poll {
            seed: p.random_seed,
        });
    let mut backend = ModelBackend::new(&setup, p, engine, progress);
    run_dirty_log_streamed(p, &mut backend, sink)
}
