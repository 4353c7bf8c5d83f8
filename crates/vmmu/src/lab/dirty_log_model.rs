//! The model as a [`DirtyLogBackend`]: a VM set up as memstress sets it up, its vCPUs running the
//! memstress guest (`DirtyLogGuest`) on an [`Engine`], the VMM's ioctls run as plans on the
//! same engine, and the completeness oracle recording every guest write as it retires.
//! [`run_dirty_log_threads`] and [`run_dirty_log_virtual`] run the one scenario
//! ([`run_dirty_log`]) on each engine.

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{Engine, GuestAccess, GuestCode, TimeSource};
use crate::kvm::dirty_log::{
    clear_dirty_log_plan, get_dirty_log_plan, set_memslot_flags_plan, OpPlan,
};
use crate::kvm::memslot::{Memslot, KVM_MEM_LOG_DIRTY_PAGES};
use crate::kvm::meter::Meter;
use crate::lab::dirty_log::{run_dirty_log, DirtyLogBackend};
use crate::lab::memstress::{pass_value, vcpu_regions, GuestRandom, PassCursor, VcpuRegion};
use crate::lab::oracle::DirtyLogOracle;
use crate::lab::params::DirtyLogParams;
use crate::lab::report::{DirtyLogReport, OracleReport, PhaseCounters};
use crate::units::{Gfn, PAGE_SHIFT, PAGE_SIZE};
use crate::vm::waiter::SpinWaiter;
use crate::vm::{Vm, VmConfig};
use parking_lot::Mutex;
use std::sync::Arc;

/// memstress's `MEMSTRESS_MEM_SLOT_INDEX`: test memslots are numbered from here.
pub const MEMSTRESS_MEM_SLOT_INDEX: u32 = 1;

/// Where the test region lies: `memstress_create_vm()`'s placement at the top of guest memory,
/// aligned down to the backing page size.
pub fn test_region_gpa(p: &DirtyLogParams) -> Result<u64, String> {
    let mode = p.mode()?;
    // vm->max_gfn and guest_num_pages count guest pages.
    let max_gfn = (1u64 << mode.pa_bits) / mode.page_bytes - 1;
    let pages = p.guest_pages() * PAGE_SIZE / mode.page_bytes;
    if pages >= max_gfn {
        return Err(format!(
            "{} pages of guest memory do not fit a {}-bit guest physical address space",
            pages, mode.pa_bits
        ));
    }
    let gpa = (max_gfn - pages) * mode.page_bytes;
    // Shadow paging: the guest maps the region with its own page size too.
    let guest_page = if p.mmu.shadow_paging() {
        crate::x86::spte::X86Level::bytes(p.guest_page_level)
    } else {
        mode.page_bytes
    };
    Ok(gpa & !(p.backing.page_size().max(guest_page) - 1))
}

/// Host bytes the model needs per guest page: the page's content word (8), the oracle's write
/// record (8) and report (4), the dirty bitmap (1/8), and a 4K leaf table's share (8).
const MODEL_BYTES_PER_GUEST_PAGE: u64 = 29;

/// Refuses a run the host cannot hold, before allocating anything.
fn check_host_memory(p: &DirtyLogParams) -> Result<(), String> {
    // The shadow MMU adds a 4K rmap head (8 bytes) per page; a stage-2 table carries its
    // `struct page` in a second 4 KiB (8 more bytes per page mapped at 4K).
    let per_page = MODEL_BYTES_PER_GUEST_PAGE
        + match p.mmu {
            crate::vm::MmuKind::Tdp => 0,
            _ => 8,
        };
    let needed = p.guest_pages() * per_page + p.vcpus as u64 * (300 << 10);
    match crate::host::memory::mem_available_bytes() {
        Some(avail) if needed > avail => Err(format!(
            "modelling {} GiB of guest memory needs about {} MiB of host memory but only {} MiB is available (MemAvailable): use fewer vCPUs (-v) or less memory per vCPU (-b)",
            p.guest_pages() >> 18,
            needed >> 20,
            avail >> 20
        )),
        _ => Ok(()),
    }
}

/// Where a GET plan leaves the bitmap it copied out.
pub(crate) type BitmapOut = Arc<Mutex<Vec<u64>>>;

/// A VM set up as memstress sets it up: the test region split into memslots, manual protect
/// as requested, and the completeness oracle over the region.
pub(crate) struct Setup {
    pub(crate) vm: Arc<Vm>,
    pub(crate) slots: Vec<Arc<Memslot>>,
    pub(crate) gpa: u64,
    pub(crate) base_gfn: u64,
    pub(crate) oracle: Arc<DirtyLogOracle>,
}

impl Setup {
    /// Validates `p`, checks the host can hold the model, and builds the VM with `waiter`.
    pub(crate) fn new(
        p: &DirtyLogParams,
        waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>,
    ) -> Result<Setup, String> {
        p.validate()?;
        let gpa = test_region_gpa(p)?;
        check_host_memory(p)?;
        let vm = Arc::new(
            Vm::try_with_waiter(
                VmConfig {
                    vcpus: p.vcpus,
                    eager_page_split: p.eager_split,
                    mmu: match p.mmu {
                        // KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE is set only with eager splitting on.
                        crate::vm::MmuKind::Stage2 {
                            lock,
                            ia_bits,
                            split_chunk_pages,
                            cpu,
                            relax_flush,
                        } => crate::vm::MmuKind::Stage2 {
                            lock,
                            ia_bits,
                            split_chunk_pages: if p.eager_split { split_chunk_pages } else { 0 },
                            cpu,
                            relax_flush,
                        },
                        m => m,
                    },
                },
                waiter,
            )
            .map_err(|e| e.to_string())?,
        );
        if p.manual_protect {
            vm.enable_manual_dirty_log_protect(true)
                .map_err(|e| e.to_string())?;
        }
        let pages_per_slot = p.pages_per_slot();
        for i in 0..p.slots as u64 {
            vm.set_user_memory_region(
                MEMSTRESS_MEM_SLOT_INDEX + i as u32,
                gpa + i * pages_per_slot * PAGE_SIZE,
                pages_per_slot * PAGE_SIZE,
                p.backing,
                0,
            )
            .map_err(|e| e.to_string())?;
        }
        if p.mmu.shadow_paging() {
            // The selftest's slot 0 holds the guest's page tables, at the bottom of memory.
            vm.setup_guest_page_tables(0, 0, p.guest_page_level)
                .map_err(|e| e.to_string())?;
        }
        let slots = (0..p.slots as u32)
            .map(|i| {
                vm.kvm
                    .slot_by_id(MEMSTRESS_MEM_SLOT_INDEX + i)
                    .expect("created above")
            })
            .collect();
        let base_gfn = gpa >> PAGE_SHIFT;
        let oracle = Arc::new(DirtyLogOracle::new(base_gfn, p.guest_pages()));
        Ok(Setup {
            vm,
            slots,
            gpa,
            base_gfn,
            oracle,
        })
    }

    /// The report skeleton for a run by `engine`.
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

    /// Plans that set `flags` on every test slot (enable or disable dirty logging).
    pub(crate) fn flags_plans(&self, flags: u32) -> Vec<OpPlan> {
        self.slots
            .iter()
            .map(|s| set_memslot_flags_plan(&self.vm.kvm, s, flags))
            .collect()
    }

    /// `KVM_GET_DIRTY_LOG` plans for every test slot, and where their bitmaps land.
    fn get_plans(&self) -> (Vec<OpPlan>, Vec<BitmapOut>) {
        self.slots
            .iter()
            .map(|s| {
                let out = Arc::new(Mutex::new(Vec::new()));
                (get_dirty_log_plan(&self.vm.kvm, s, Arc::clone(&out)), out)
            })
            .unzip()
    }

    /// `KVM_CLEAR_DIRTY_LOG` plans that clear what GET returned, whole slot by whole slot.
    fn clear_plans(&self, bitmaps: &[Vec<u64>]) -> Result<Vec<OpPlan>, String> {
        self.slots
            .iter()
            .zip(bitmaps)
            .map(|(s, bm)| clear_dirty_log_plan(&self.vm.kvm, s, 0, s.npages, bm))
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
        self.value = pass_value(iteration, self.vcpu);
    }

    #[inline]
    fn next_access(&mut self) -> Option<GuestAccess> {
        let (page, write) = self.cursor.next(&mut self.rng)?;
        if write {
            self.write_seq = self.oracle.before_write();
        }
        Some(GuestAccess {
            gfn: Gfn(self.region.base_gfn + page * self.stride),
            write,
            value: self.value,
        })
    }

    #[inline]
    fn access_done(&mut self, access: &GuestAccess) {
        if access.write {
            self.oracle.after_write(access.gfn.0, self.write_seq);
        }
    }
}

/// Collects what happened since the last snapshot: meters of all actors, `mmu_lock` counters,
/// and the mapped-page stats now.
#[derive(Default)]
struct PhaseClock {
    last_meter: Meter,
    last_lock: PhaseCounters,
}

impl PhaseClock {
    /// What happened since the last lap, given every vCPU's meter now.
    fn lap(&mut self, vm: &Vm, vcpu_meters: &[Meter]) -> PhaseCounters {
        let mut total = vm.vmm_meter();
        for m in vcpu_meters {
            total.add(m);
        }
        let lock = vm.kvm.mmu_lock.stats.snapshot();
        let mut out: PhaseCounters = total.since(&self.last_meter).to_map();
        for (k, v) in &lock {
            out.insert(k.clone(), v - self.last_lock.get(k).copied().unwrap_or(0));
        }
        let stats = vm.mmu.page_stats();
        for (name, v) in ["mapped_4k", "mapped_2m", "mapped_1g"].iter().zip(stats) {
            out.insert(name.to_string(), v.max(0) as u64);
        }
        self.last_meter = total;
        self.last_lock = lock;
        out
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
    type Error = String;

    fn report(&self) -> DirtyLogReport {
        self.setup.report(self.p, self.engine.name())
    }

    fn time_source(&self) -> TimeSource {
        self.engine.time_source()
    }

    fn run_pass(&mut self, iteration: u32) -> Result<u64, String> {
        self.say(&if iteration == 0 {
            "populating memory".to_string()
        } else {
            format!("iteration {iteration}")
        });
        self.engine.run_pass(iteration as i64)
    }

    fn start_background_passes(&mut self) -> Result<(), String> {
        // The selftest's `iteration = -1`: passes go on until host_quit.
        self.engine.start_background_passes(-1);
        Ok(())
    }

    fn stop_vcpus(&mut self) -> Result<(), String> {
        self.engine.stop_vcpus()
    }

    fn set_dirty_logging(&mut self, on: bool) -> Result<u64, String> {
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

    fn get_dirty_log(&mut self) -> Result<u64, String> {
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

    fn clear_dirty_log(&mut self) -> Result<Option<u64>, String> {
        if !self.p.manual_protect {
            return Ok(None);
        }
        let (_, bitmaps) = self.harvest.as_ref().expect("GET before CLEAR");
        let plans = self.setup.clear_plans(bitmaps)?;
        self.engine.run_plans(plans).map(Some)
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
pub fn run_dirty_log_threads(p: &DirtyLogParams, progress: bool) -> Result<DirtyLogReport, String> {
    let setup = Setup::new(p, Box::new(SpinWaiter))?;
    let engine = Threads::new(Arc::clone(&setup.vm), DirtyLogGuest::for_vcpus(&setup, p));
    run_dirty_log(p, &mut ModelBackend::new(&setup, p, engine, progress))
}

/// Runs the scenario in virtual time with `cost`: the same VM, MMU, guest and oracles as the
/// threads engine, so a run at 64 or 256 vCPUs on a 2-core machine gives the same numbers
/// every time. Phase times are virtual: what the [`CostModel`] says the work each actor's
/// [`Meter`] counted costs, with vCPUs running in parallel and waiting for each other only on
/// `mmu_lock`. `progress` prints phase names to stderr.
pub fn run_dirty_log_virtual(
    p: &DirtyLogParams,
    cost: &CostModel,
    progress: bool,
) -> Result<DirtyLogReport, String> {
    // Before the VM's memory is allocated.
    crate::engine::virtual_time::check_cost_model(cost)?;
    let setup = Setup::new(p, Box::new(VirtualWaiter))?;
    let engine = VirtualTime::new(&setup.vm, cost, DirtyLogGuest::for_vcpus(&setup, p))?;
    let mut backend = ModelBackend::new(&setup, p, engine, progress);
    run_dirty_log(p, &mut backend)
}
