//! The `dirty-log` scenario (dirty_log_perf_test) on the threads engine: one OS thread per vCPU
//! running the memstress guest, and the calling thread as the VMM running the phases:
//! populate, enable dirty logging, N × (dirty memory, GET, CLEAR), disable dirty logging.
//! The completeness oracle checks every harvest; the page-table invariants are checked at the
//! end (and after every dirty phase in debug builds).

use crate::engine::{GuestAccess, GuestCode};
use crate::kvm::dirty_log::{
    clear_dirty_log_plan, get_dirty_log_plan, set_memslot_flags_plan, OpPlan,
};
use crate::kvm::memslot::{Memslot, KVM_MEM_LOG_DIRTY_PAGES};
use crate::kvm::meter::Meter;
use crate::lab::memstress::{
    pass_value, vcpu_regions, GuestRandom, PassAccesses, PassCursor, VcpuRegion,
};
use crate::lab::oracle::DirtyLogOracle;
use crate::lab::params::DirtyLogParams;
use crate::lab::report::{DirtyLogReport, IterationReport, OracleReport, Phase, PhaseCounters};
use crate::units::{Gfn, PAGE_SHIFT, PAGE_SIZE};
use crate::vm::exit::guest_access;
use crate::vm::plan::run_plan;
use crate::vm::vcpu::Vcpu;
use crate::vm::{Vm, VmConfig};
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Guest physical address bits of the modelled VM (a common host's MAXPHYADDR). The test region
/// sits at the top of guest physical memory, as memstress puts it.
pub const GUEST_PA_BITS: u32 = 46;

/// memstress's `MEMSTRESS_MEM_SLOT_INDEX`: test memslots are numbered from here.
pub const MEMSTRESS_MEM_SLOT_INDEX: u32 = 1;

/// Where the test region lies: `memstress_create_vm()`'s placement at the top of guest memory,
/// aligned down to the backing page size.
pub fn test_region_gpa(p: &DirtyLogParams) -> Result<u64, String> {
    let max_gfn = (1u64 << (GUEST_PA_BITS - PAGE_SHIFT)) - 1;
    let pages = p.guest_pages();
    if pages >= max_gfn {
        return Err(format!("{} pages of guest memory do not fit a {GUEST_PA_BITS}-bit guest physical address space", pages));
    }
    let gpa = (max_gfn + 1 - pages - 1) * PAGE_SIZE;
    // Shadow paging: the guest maps the region with its own page size too.
    let guest_page = if p.mmu.shadow_paging() {
        p.guest_page_level.bytes()
    } else {
        PAGE_SIZE
    };
    Ok(gpa & !(p.backing.page_size().max(guest_page) - 1))
}

/// Host bytes the model needs per guest page: the page's content word (8), the oracle's write
/// record (8) and report (4), the dirty bitmap (1/8), and a 4K leaf table's share (8).
const MODEL_BYTES_PER_GUEST_PAGE: u64 = 29;

/// Refuses a run the host cannot hold, before allocating anything.
fn check_host_memory(p: &DirtyLogParams) -> Result<(), String> {
    // The shadow MMU adds a 4K rmap head (8 bytes) per page.
    let per_page = MODEL_BYTES_PER_GUEST_PAGE
        + if p.mmu == crate::vm::MmuKind::Tdp {
            0
        } else {
            8
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
        let vm = Arc::new(Vm::with_waiter(
            VmConfig {
                vcpus: p.vcpus,
                eager_page_split: p.eager_split,
                mmu: p.mmu,
            },
            waiter,
        ));
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
            .map(|s| set_memslot_flags_plan(&self.vm.kvm, &self.vm.mmu, s, flags))
            .collect()
    }

    /// `KVM_GET_DIRTY_LOG` plans for every test slot, and where their bitmaps land.
    fn get_plans(&self) -> (Vec<OpPlan>, Vec<BitmapOut>) {
        self.slots
            .iter()
            .map(|s| {
                let out = Arc::new(Mutex::new(Vec::new()));
                (
                    get_dirty_log_plan(&self.vm.kvm, &self.vm.mmu, s, Arc::clone(&out)),
                    out,
                )
            })
            .unzip()
    }

    /// `KVM_CLEAR_DIRTY_LOG` plans that clear what GET returned, whole slot by whole slot.
    fn clear_plans(&self, bitmaps: &[Vec<u64>]) -> Result<Vec<OpPlan>, String> {
        self.slots
            .iter()
            .zip(bitmaps)
            .map(|(s, bm)| clear_dirty_log_plan(&self.vm.mmu, s, 0, s.npages, bm))
            .collect()
    }

    /// The harvest after iteration `it` as dirty_log_perf_test does it, with the oracle around
    /// it: GET every slot, CLEAR what GET returned (manual protect only), check what was
    /// reported. `step` runs plans the engine's way and returns their phase. One place for the
    /// protocol, whichever engine drives it.
    pub(crate) fn harvest(
        &self,
        p: &DirtyLogParams,
        it: u32,
        dirty: Phase,
        oracle: &mut OracleReport,
        lost: &mut Vec<u64>,
        step: &mut dyn FnMut(Vec<OpPlan>) -> Result<Phase, String>,
    ) -> Result<IterationReport, String> {
        let k = self.oracle.begin_harvest();
        let (plans, outs) = self.get_plans();
        let get = step(plans)?;
        let bitmaps: Vec<Vec<u64>> = outs
            .iter()
            .map(|o| std::mem::take(&mut *o.lock()))
            .collect();
        let clear = if p.manual_protect {
            Some(step(self.clear_plans(&bitmaps)?)?)
        } else {
            None
        };
        let dirty_pages = self.check_harvest(k, &bitmaps, oracle, lost);
        Ok(IterationReport {
            iteration: it,
            dirty,
            get,
            clear,
            dirty_pages,
        })
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
        .map(|(i, region)| DirtyLogGuest {
            vcpu: i,
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
            gfn: Gfn(self.region.base_gfn + page),
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

/// Coordination between the VMM thread and the vCPU threads (the selftest's `iteration`,
/// `vcpu_last_completed_iteration[]` and `host_quit`).
struct Control {
    iteration: AtomicI64,
    quit: AtomicBool,
    completed: Vec<AtomicI64>,
    lock: Mutex<()>,
    cv: Condvar,
    /// Each vCPU's meter as of its last completed pass.
    meters: Vec<Mutex<Meter>>,
    /// First error a vCPU hit (a fault it could not handle).
    error: Mutex<Option<String>>,
}

impl Control {
    fn notify(&self) {
        let _g = self.lock.lock();
        self.cv.notify_all();
    }
}

/// Runs the memstress guest on one vCPU until told to quit.
fn vcpu_worker(
    vm: &Vm,
    ctl: &Control,
    oracle: &DirtyLogOracle,
    region: VcpuRegion,
    p: &DirtyLogParams,
    idx: usize,
) {
    let kvm = &*vm.kvm;
    let mut vcpu = vm.vcpu(idx);
    let mut rng = GuestRandom::new(p.random_seed.wrapping_add(idx as u32));
    loop {
        let cur = ctl.iteration.load(Ordering::Acquire);
        // KVM_RUN until the guest's GUEST_SYNC at the end of one pass.
        vcpu.run_begin(kvm);
        let r = guest_pass(vm, &mut vcpu, oracle, &region, &mut rng, p, cur);
        vcpu.run_end(kvm);
        if let Err(e) = r {
            ctl.error.lock().get_or_insert(e);
            ctl.quit.store(true, Ordering::SeqCst);
        }
        *ctl.meters[idx].lock() = vcpu.meter.clone();
        ctl.completed[idx].store(cur, Ordering::Release);
        ctl.notify();
        // Wait for the next iteration; a negative one (-e) means keep running.
        let mut g = ctl.lock.lock();
        while cur == ctl.iteration.load(Ordering::Acquire)
            && cur >= 0
            && !ctl.quit.load(Ordering::Acquire)
        {
            ctl.cv.wait(&mut g);
        }
        drop(g);
        if ctl.quit.load(Ordering::Acquire) {
            return;
        }
    }
}

/// One pass of `memstress_guest_code()` in guest mode, handling exits as KVM_RUN would.
fn guest_pass(
    vm: &Vm,
    vcpu: &mut Vcpu,
    oracle: &DirtyLogOracle,
    region: &VcpuRegion,
    rng: &mut GuestRandom,
    p: &DirtyLogParams,
    iteration: i64,
) -> Result<(), String> {
    let kvm = &*vm.kvm;
    let mmu = &*vm.mmu;
    vcpu.enter_guest(kvm);
    // dirty_log_perf_test populates (iteration 0) with sequential 100% writes so every page is
    // mapped, then switches to the requested pattern.
    let value = pass_value(iteration, vcpu.id);
    let (random, write_percent) = if iteration == 0 {
        (false, 100)
    } else {
        (p.random_access, p.write_percent)
    };
    for (page, write) in PassAccesses::new(rng, region.pages, random, write_percent) {
        let gfn = Gfn(region.base_gfn + page);
        let s = if write { oracle.before_write() } else { 0 };
        guest_access(kvm, mmu, vcpu, gfn, 0, write, value)?;
        if write {
            oracle.after_write(gfn.0, s);
        }
    }
    // GUEST_SYNC: a VM exit to userspace.
    vcpu.exit_guest(kvm);
    Ok(())
}

/// Collects what happened since the last snapshot: meters of all actors, `mmu_lock` counters,
/// and the mapped-page stats now.
#[derive(Default)]
pub(crate) struct PhaseClock {
    last_meter: Meter,
    last_lock: PhaseCounters,
}

impl PhaseClock {
    fn lap(&mut self, vm: &Vm, ctl: &Control) -> PhaseCounters {
        let vcpu_meters: Vec<Meter> = ctl.meters.iter().map(|m| m.lock().clone()).collect();
        self.lap_with(vm, &vcpu_meters)
    }

    /// What happened since the last lap, given every vCPU's meter now.
    pub(crate) fn lap_with(&mut self, vm: &Vm, vcpu_meters: &[Meter]) -> PhaseCounters {
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

/// Runs the scenario on the threads engine. `progress` prints phase names to stderr.
pub fn run_dirty_log_threads(p: &DirtyLogParams, progress: bool) -> Result<DirtyLogReport, String> {
    let setup = Setup::new(p, Box::new(crate::vm::waiter::SpinWaiter))?;
    let (vm, oracle) = (Arc::clone(&setup.vm), Arc::clone(&setup.oracle));
    let ctl = Arc::new(Control {
        iteration: AtomicI64::new(0),
        quit: AtomicBool::new(false),
        completed: (0..p.vcpus).map(|_| AtomicI64::new(-1)).collect(),
        lock: Mutex::new(()),
        cv: Condvar::new(),
        meters: (0..p.vcpus).map(|_| Mutex::new(Meter::default())).collect(),
        error: Mutex::new(None),
    });
    let mut report = setup.report(p, "threads");
    let say = |what: &str| {
        if progress {
            eprintln!("vmmu: {what}");
        }
    };
    let mut clock = PhaseClock::default();
    // The VMM thread runs plans on itself with the real lock.
    let vmm = |plans: Vec<OpPlan>| -> u64 {
        let start = Instant::now();
        for plan in plans {
            let mut m = Meter::default();
            run_plan(&vm.kvm, plan, &mut m);
            vm.add_vmm_meter(&m);
        }
        start.elapsed().as_nanos() as u64
    };

    let regions = vcpu_regions(
        setup.base_gfn,
        p.vcpus,
        p.vcpu_memory_bytes / PAGE_SIZE,
        p.partition,
    );
    say("populating memory");
    let start = Instant::now();
    let handles: Vec<_> = regions
        .into_iter()
        .enumerate()
        .map(|(i, region)| {
            let (vm, ctl, oracle, p) = (
                Arc::clone(&vm),
                Arc::clone(&ctl),
                Arc::clone(&oracle),
                p.clone(),
            );
            std::thread::Builder::new()
                .name(format!("vcpu{i}"))
                .stack_size(256 << 10)
                .spawn(move || {
                    // A vCPU that dies must not leave the VMM waiting for it forever.
                    let run = std::panic::AssertUnwindSafe(|| {
                        vcpu_worker(&vm, &ctl, &oracle, region, &p, i)
                    });
                    if let Err(panic) = std::panic::catch_unwind(run) {
                        let msg = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        ctl.error
                            .lock()
                            .get_or_insert(format!("vCPU {i} panicked: {msg}"));
                        ctl.quit.store(true, Ordering::SeqCst);
                        ctl.notify();
                    }
                })
                .map_err(|e| format!("cannot start vCPU thread {i}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let wait_all = |it: i64| -> Result<(), String> {
        let mut g = ctl.lock.lock();
        while !ctl
            .completed
            .iter()
            .all(|c| c.load(Ordering::Acquire) == it)
        {
            if ctl.quit.load(Ordering::Acquire) {
                break;
            }
            ctl.cv.wait(&mut g);
        }
        drop(g);
        match ctl.error.lock().clone() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    };
    let finish = |handles: Vec<std::thread::JoinHandle<()>>| {
        ctl.quit.store(true, Ordering::SeqCst);
        ctl.notify();
        for h in handles {
            let _ = h.join();
        }
    };
    if let Err(e) = wait_all(0) {
        finish(handles);
        return Err(e);
    }
    report.populate = Phase {
        wall_ns: start.elapsed().as_nanos() as u64,
        counters: Some(clock.lap(&vm, &ctl)),
    };

    say("enabling dirty logging");
    let ns = vmm(setup.flags_plans(KVM_MEM_LOG_DIRTY_PAGES));
    oracle.logging_enabled();
    report.enable = Phase {
        wall_ns: ns,
        counters: Some(clock.lap(&vm, &ctl)),
    };

    let mut lost_total = Vec::new();
    for it in 1..=p.iterations as i64 {
        say(&format!("iteration {it}"));
        let start = Instant::now();
        ctl.iteration.store(it, Ordering::Release);
        ctl.notify();
        if let Err(e) = wait_all(it) {
            finish(handles);
            return Err(e);
        }
        let dirty = Phase {
            wall_ns: start.elapsed().as_nanos() as u64,
            counters: Some(clock.lap(&vm, &ctl)),
        };
        if cfg!(debug_assertions) {
            report.oracle.invariant_errors.extend(vm.check_invariants());
        }

        let it_report = setup.harvest(
            p,
            it as u32,
            dirty,
            &mut report.oracle,
            &mut lost_total,
            &mut |plans| {
                let ns = vmm(plans);
                Ok(Phase {
                    wall_ns: ns,
                    counters: Some(clock.lap(&vm, &ctl)),
                })
            },
        )?;
        report.iterations.push(it_report);
    }

    if p.run_vcpus_while_disabling {
        ctl.iteration.store(-1, Ordering::Release);
        ctl.notify();
    }
    say("disabling dirty logging");
    let disable_ns = vmm(setup.flags_plans(0));
    finish(handles);
    if let Some(e) = ctl.error.lock().clone() {
        return Err(e);
    }
    report.disable = Phase {
        wall_ns: disable_ns,
        counters: Some(clock.lap(&vm, &ctl)),
    };
    finish_report(&mut report, lost_total, &vm);
    Ok(report)
}

/// Fills the oracle's verdict: lost pages (the first 16 named) and the final invariant check.
pub(crate) fn finish_report(report: &mut DirtyLogReport, mut lost: Vec<u64>, vm: &Vm) {
    report.oracle.lost_pages = lost.len() as u64;
    lost.truncate(16);
    report.oracle.lost_gfns = lost;
    report.oracle.invariant_errors.extend(vm.check_invariants());
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
