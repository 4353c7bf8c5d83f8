//! The `dirty-log` scenario on real KVM: the lab's scenario ([`vmmu::lab::dirty_log`], the one
//! the model runs) with real KVM as its [`DirtyLogBackend`]. What each phase does here:
//!
//! 1. Create the VM (manual protect with initially-set unless `-g`, or dirty rings), one vCPU
//!    thread per vCPU, test memory in `-x` memslots from [`TEST_MEM_GPA`].
//! 2. Populate: every vCPU writes every page of its region once (iteration 0), timed from the
//!    start of the vCPU threads to the last vCPU's sync.
//! 3. Enable `KVM_MEM_LOG_DIRTY_PAGES` on every slot (timed).
//! 4. For each iteration: the vCPUs make one pass each (timed until the last finishes), then
//!    `KVM_GET_DIRTY_LOG` on every slot (timed) and, with manual protect, `KVM_CLEAR_DIRTY_LOG`
//!    of exactly the returned bits (timed). With dirty rings, "get" is the harvest of every
//!    vCPU's ring and "clear" is `KVM_RESET_DIRTY_RINGS`. After each harvest the oracle checks
//!    that every page written in the pass was reported.
//! 5. Disable logging on every slot (timed); with `-e` the vCPUs keep making passes meanwhile.
//!
//! Phase counters are the host's binary statistics (where the kernel has them) plus what the
//! replay knows; the page tables are not visible, so there is no invariant check, and times
//! are wall-clock.
//!
//! Unlike the selftest, idle vCPU threads and the main thread wait on a condition variable
//! instead of spinning: on small hosts spinning threads steal the CPU from the vCPUs being
//! measured. The handshake is the selftest's: the main thread publishes an iteration number,
//! each vCPU thread runs one pass for it and records it as its last completed iteration.

use crate::error::KvmError;
use crate::guest::{mailbox, GuestProgram};
use crate::mem::check_host_can_back;
use crate::oracle::{bitmap_words, count_ones, iter_ones, set_bit, splice_bits, Oracle};
use crate::stats::{Snapshot, Stats};
use crate::vm::{
    self, clear_dirty_log, get_dirty_log, reset_dirty_rings, run_to_sync, KvmVm, Vcpu, VmSetup,
    KVM_MEM_LOG_DIRTY_PAGES, TEST_MEM_GPA,
};
use kvm_ioctls::VmFd;
use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;
use vmmu::engine::TimeSource;
use vmmu::lab::dirty_log::{run_dirty_log_streamed as run_scenario, DirtyLogBackend};
use vmmu::lab::memstress::{pass_value, vcpu_regions, GuestRandom, PassAccesses, VcpuRegion};
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::PhaseSink;
use vmmu::lab::report::{DirtyLogReport, OracleReport, PhaseCounters};

/// Options of the real-KVM backend that the model has no use for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvmOptions {
    /// `--dirty-ring N`: harvest through per-vCPU dirty rings of N entries instead of
    /// `KVM_GET_DIRTY_LOG` bitmaps. Manual protect does not apply to rings; each iteration's
    /// "get" phase is then the harvest of every ring and its "clear" phase
    /// `KVM_RESET_DIRTY_RINGS`. Rings that fill up during a pass are harvested and reset by the
    /// vCPU's thread (`KVM_EXIT_DIRTY_RING_FULL`), and their entries join the next harvest.
    pub dirty_ring: Option<u32>,
    /// Print what is happening to stderr as the run goes (it can take minutes on large
    /// configurations).
    pub progress: bool,
}

/// What the vCPUs do in one pass.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct PassParams {
    write_percent: u32,
    random: bool,
}

/// State shared by the main thread and the vCPU threads, under one mutex.
struct CtlState {
    /// The pass the vCPUs are to make; -1 means "keep making passes" (`-e` while disabling).
    iteration: i64,
    pass: PassParams,
    quit: bool,
    /// The last iteration each vCPU completed (`i64::MIN` before the first).
    completed: Vec<i64>,
    /// The first error a vCPU thread hit; everybody stops when it is set.
    error: Option<KvmError>,
    /// Dirty-ring-full exits since the main thread last looked.
    ring_full_exits: u64,
}

struct Ctl {
    state: Mutex<CtlState>,
    /// vCPU threads wait here for a new iteration (or quit).
    vcpu_cv: Condvar,
    /// The main thread waits here for vCPUs to complete (or fail).
    main_cv: Condvar,
}

impl Ctl {
    fn lock(&self) -> MutexGuard<'_, CtlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Publishes the next pass. Pass parameters and the iteration change together under the
    /// lock, so a vCPU never runs a new iteration with the previous pass's parameters.
    fn start(&self, iteration: i64, pass: PassParams) {
        let mut st = self.lock();
        st.iteration = iteration;
        st.pass = pass;
        self.vcpu_cv.notify_all();
    }

    /// Waits until every vCPU has completed `iteration`, or one failed.
    fn wait_all(&self, iteration: i64) -> Result<u64, KvmError> {
        let mut st = self.lock();
        loop {
            if let Some(e) = st.error.take() {
                return Err(e);
            }
            if st.completed.iter().all(|&c| c == iteration) {
                return Ok(std::mem::take(&mut st.ring_full_exits));
            }
            st = self.main_cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn quit(&self) {
        let mut st = self.lock();
        st.quit = true;
        self.vcpu_cv.notify_all();
    }
}

/// Tells the vCPU threads to stop when dropped, so every way out of the main thread's scope
/// (errors included) lets the scoped threads finish their current pass and exit.
struct QuitOnDrop<'a>(&'a Ctl);

impl Drop for QuitOnDrop<'_> {
    fn drop(&mut self) {
        self.0.quit();
    }
}

/// What a vCPU thread needs besides its vCPU.
struct WorkerEnv<'a> {
    vm: &'a VmFd,
    sys: &'a crate::mem::HostMemory,
    ctl: &'a Ctl,
}

fn vcpu_worker(v: &mut Vcpu, ring: Option<&Mutex<crate::ring::DirtyRing>>, env: &WorkerEnv<'_>) {
    let mut last: Option<i64> = None;
    loop {
        let (cur, pass) = {
            let mut st = env.ctl.lock();
            loop {
                if st.quit || st.error.is_some() {
                    return;
                }
                if st.iteration < 0 || Some(st.iteration) != last {
                    break;
                }
                st = env.ctl.vcpu_cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            (st.iteration, st.pass)
        };
        // The vCPU is outside the guest here (it last exited on OUT), so these stores are
        // ordered before the guest's loads by the KVM_RUN below. The value is the model's for
        // the same pass (iteration -1 for the passes made while logging is being disabled, as
        // the model's vCPUs see it too), so both write identical content.
        env.sys.write_u64(
            v.mailbox + mailbox::WRITE_PERCENT,
            pass.write_percent as u64,
        );
        env.sys
            .write_u64(v.mailbox + mailbox::RANDOM, pass.random as u64);
        env.sys
            .write_u64(v.mailbox + mailbox::VALUE, pass_value(cur, v.idx));
        let r = run_to_sync(v, env.vm, ring);
        let mut st = env.ctl.lock();
        match r {
            Ok(rs) => {
                st.completed[v.idx] = cur;
                st.ring_full_exits += rs.ring_full_exits;
                env.ctl.main_cv.notify_all();
            }
            Err(e) => {
                st.error.get_or_insert(e);
                env.ctl.main_cv.notify_all();
                env.ctl.vcpu_cv.notify_all();
                return;
            }
        }
        last = Some(cur);
    }
}

/// Geometry of the test memory. "Global page" below means a page index counted from the
/// first page of test memory ([`TEST_MEM_GPA`]).
#[derive(Clone, Debug)]
struct Geometry {
    vcpu_pages: u64,
    total_pages: u64,
    slots: usize,
    pages_per_slot: u64,
    partition: bool,
    /// Each vCPU's region (`memstress_setup_vcpus()`, shared with the model), in gfns.
    regions: Vec<VcpuRegion>,
}

impl Geometry {
    /// The first global page of vCPU `i`'s region.
    fn region_start(&self, i: usize) -> u64 {
        self.regions[i].base_gfn - (TEST_MEM_GPA >> 12)
    }

    /// Test slot id and page offset of global page `g`.
    fn locate(&self, g: u64) -> (u32, u64) {
        (
            (g / self.pages_per_slot) as u32 + 1,
            g % self.pages_per_slot,
        )
    }
}

fn progress(on: bool, msg: impl FnOnce() -> String) {
    if on {
        eprintln!("[kvm] {}", msg());
    }
}

fn elapsed_ns(t: Instant) -> u64 {
    t.elapsed().as_nanos().min(u64::MAX as u128) as u64
}

/// Reads the host's `eager_page_split` module parameter (None when KVM does not have one).
fn host_eager_split() -> Option<bool> {
    let s = std::fs::read_to_string("/sys/module/kvm/parameters/eager_page_split").ok()?;
    Some(matches!(s.trim(), "Y" | "y" | "1"))
}

/// Runs dirty_log_perf_test's scenario on `/dev/kvm` and reports it in the lab's format, with
/// the dirty-log completeness oracle checked after every harvest.
///
/// Errors (one line each, see [`KvmError`]) cover hosts without usable KVM, missing
/// capabilities, parameters out of range, not enough host memory, and guest failures. A lost
/// dirty page is not an error: it is reported in `report.oracle`.
pub fn run_dirty_log(
    params: &DirtyLogParams,
    opts: &KvmOptions,
) -> Result<DirtyLogReport, KvmError> {
    run_dirty_log_streamed(params, opts, &mut ())
}

/// [`run_dirty_log`], telling `sink` of each phase as it ends.
pub fn run_dirty_log_streamed(
    params: &DirtyLogParams,
    opts: &KvmOptions,
    sink: &mut dyn PhaseSink,
) -> Result<DirtyLogReport, KvmError> {
    params
        .validate()
        .map_err(|e| KvmError::InvalidParams(e.to_string()))?;
    let vcpu_pages = params.vcpu_memory_bytes / 4096;
    let geo = Geometry {
        vcpu_pages,
        total_pages: params.guest_pages(),
        slots: params.slots,
        pages_per_slot: params.pages_per_slot(),
        partition: params.partition,
        regions: vcpu_regions(
            TEST_MEM_GPA >> 12,
            params.vcpus,
            vcpu_pages,
            params.partition,
        ),
    };
    let slot_bytes = geo.pages_per_slot * 4096;
    let test_bytes = geo.total_pages * 4096;
    let hp = params.backing.page_size();
    let host_bytes = geo.slots as u64 * slot_bytes.div_ceil(hp) * hp;
    check_host_can_back(host_bytes, params.backing)?;
    if let Some(host) = host_eager_split().filter(|h| *h != params.eager_split) {
        let (flag, val) = if host { ("on", "Y") } else { ("off", "N") };
        return Err(KvmError::InvalidParams(format!(
            "--eager-split {}: the host's KVM has eager_page_split={val}; run `echo {} > /sys/module/kvm/parameters/eager_page_split` as root or use --eager-split {flag}",
            if params.eager_split { "on" } else { "off" },
            if params.eager_split { "Y" } else { "N" },
        )));
    }

    let ring = opts.dirty_ring;
    let manual = params.manual_protect && ring.is_none();
    let setup = VmSetup {
        vcpus: params.vcpus,
        manual_protect: manual.then_some(true),
        dirty_ring: ring,
        window: test_bytes,
        page_size: None,
        program: GuestProgram::Memstress,
    };
    progress(opts.progress, || {
        format!(
            "creating a VM with {} vCPUs and {} MiB of {} test memory in {} memslots",
            params.vcpus,
            test_bytes >> 20,
            params.backing,
            params.slots
        )
    });
    let mut kvm = KvmVm::new(&setup)?;
    let max_slots = kvm.max_memslots();
    if max_slots > 0 && params.slots as u64 + 1 > max_slots {
        return Err(KvmError::InvalidParams(format!(
            "-x {}: this host's KVM allows {} memslots and one holds the guest's code: use at most {}",
            params.slots,
            max_slots,
            max_slots - 1
        )));
    }
    for s in 0..geo.slots {
        let gpa = TEST_MEM_GPA + s as u64 * slot_bytes;
        kvm.add_memslot(s as u32 + 1, gpa, slot_bytes, params.backing, 0)?;
    }
    for v in &kvm.vcpus {
        let region = &geo.regions[v.idx];
        kvm.sys
            .write_u64(v.mailbox + mailbox::BASE, region.base_gfn << 12);
        kvm.sys.write_u64(v.mailbox + mailbox::PAGES, region.pages);
        kvm.sys.write_u64(
            v.mailbox + mailbox::SEED,
            params.random_seed.wrapping_add(v.idx as u32) as u64,
        );
    }
    let stats = Stats::open(&kvm.vm, kvm.vcpus.iter().map(|v| &v.fd));

    let header = DirtyLogReport {
        backend: "kvm".into(),
        engine: String::new(),
        mmu: "host kernel".into(),
        params: params.clone(),
        test_memory: (TEST_MEM_GPA, TEST_MEM_GPA + test_bytes),
        ..Default::default()
    };
    let ctl = Ctl {
        state: Mutex::new(CtlState {
            iteration: 0,
            pass: POPULATE_PASS,
            quit: false,
            completed: vec![i64::MIN; params.vcpus],
            error: None,
            ring_full_exits: 0,
        }),
        vcpu_cv: Condvar::new(),
        main_cv: Condvar::new(),
    };
    let KvmVm {
        rings,
        vcpus,
        vm: vm_fd,
        sys,
        slots,
        ..
    } = &mut kvm;
    let (vm_fd, sys, rings, slots) = (&*vm_fd, &*sys, &*rings, &*slots);
    let env = WorkerEnv {
        vm: vm_fd,
        sys,
        ctl: &ctl,
    };
    let report = std::thread::scope(|scope| {
        let _quit = QuitOnDrop(&ctl);
        let mut backend = KvmBackend {
            scope,
            vcpus: Some(vcpus),
            rings,
            slots,
            env: &env,
            geo: &geo,
            params,
            ring,
            manual,
            progress: opts.progress,
            header,
            last: stats.snapshot(),
            stats: &stats,
            extra: PhaseCounters::new(),
            // The host's replay of every vCPU's `guest_random_u32()`, seeded as the guest is.
            replays: (0..params.vcpus)
                .map(|i| GuestRandom::new(params.random_seed.wrapping_add(i as u32)))
                .collect(),
            oracle: Oracle::new(),
            iteration: 0,
            dirty_ns: 0,
            written: Vec::new(),
            harvested: Vec::new(),
            bitmaps: Vec::new(),
        };
        run_scenario(params, &mut backend, sink)
    })?;
    // A vCPU that failed during the last (-e) passes is reported even though all phases ran.
    if let Some(e) = ctl.lock().error.take() {
        return Err(e);
    }
    Ok(report)
}

/// The populate pass: sequential writes of every page.
const POPULATE_PASS: PassParams = PassParams {
    write_percent: 100,
    random: false,
};

/// Real KVM as the scenario's backend: the vCPU threads (started with the first pass, scoped to
/// the run), the VM fd for the dirty-log ioctls, the host's binary statistics for each phase,
/// and the replay oracle.
struct KvmBackend<'scope, 'env> {
    scope: &'scope std::thread::Scope<'scope, 'env>,
    /// The vCPUs, until their threads start.
    vcpus: Option<&'env mut Vec<Vcpu>>,
    rings: &'env [Mutex<crate::ring::DirtyRing>],
    slots: &'env BTreeMap<u32, vm::Memslot>,
    env: &'env WorkerEnv<'env>,
    geo: &'env Geometry,
    params: &'env DirtyLogParams,
    ring: Option<u32>,
    manual: bool,
    progress: bool,
    header: DirtyLogReport,
    stats: &'env Stats,
    /// The statistics at the end of the last phase.
    last: Snapshot,
    /// The backend's own counters for the phase in progress.
    extra: PhaseCounters,
    replays: Vec<GuestRandom>,
    oracle: Oracle,
    /// The last pass the vCPUs made, how long it took, and the pages it wrote.
    iteration: u32,
    dirty_ns: u64,
    written: Vec<u64>,
    /// The harvest in progress: every page reported, and each slot's bitmap.
    harvested: Vec<u64>,
    bitmaps: Vec<(u32, Vec<u64>)>,
}

impl KvmBackend<'_, '_> {
    /// Starts one thread per vCPU; they begin with the published iteration.
    fn spawn(&mut self) -> Result<(), KvmError> {
        let vcpus = self.vcpus.take().expect("vCPU threads start once");
        for (i, v) in vcpus.iter_mut().enumerate() {
            let env = self.env;
            let ring = self.rings.get(i);
            std::thread::Builder::new()
                .name(format!("vcpu{i}"))
                .spawn_scoped(self.scope, move || vcpu_worker(v, ring, env))
                .map_err(|e| {
                    KvmError::sys("spawning a vCPU thread", e.raw_os_error().unwrap_or(0))
                })?;
        }
        Ok(())
    }

    /// The pass the vCPUs make in every iteration after populating.
    fn pass(&self) -> PassParams {
        PassParams {
            write_percent: self.params.write_percent,
            random: self.params.random_access,
        }
    }

    fn set_logging(&self, on: bool) -> Result<(), KvmError> {
        for id in 1..=self.geo.slots as u32 {
            let m = self
                .slots
                .get(&id)
                .ok_or_else(|| KvmError::InvalidParams(format!("memslot {id} vanished")))?;
            let flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
            // SAFETY: `m` is owned by the KvmVm that also owns the VM fd, which outlives this
            // backend; only the flags change.
            unsafe { vm::set_region(self.env.vm, id, m, flags) }?;
        }
        Ok(())
    }
}

impl DirtyLogBackend for KvmBackend<'_, '_> {
    type Error = KvmError;

    fn report(&self) -> DirtyLogReport {
        self.header.clone()
    }

    fn time_source(&self) -> TimeSource {
        TimeSource::Wall
    }

    fn run_pass(&mut self, iteration: u32) -> Result<u64, KvmError> {
        let pass = if iteration == 0 {
            POPULATE_PASS
        } else {
            self.pass()
        };
        let t = Instant::now();
        if iteration == 0 {
            // The clock starts before the vCPU threads, as in the selftest.
            progress(self.progress, || "populating memory (iteration 0)".into());
            self.spawn()?;
        } else {
            self.env.ctl.start(iteration as i64, pass);
        }
        let full = self.env.ctl.wait_all(iteration as i64)?;
        let ns = elapsed_ns(t);
        let (written, writes, reads) = replay_pass(self.geo, &mut self.replays, pass);
        self.extra = own_counters(writes, reads, full, self.ring.is_some());
        if iteration == 0 {
            check_content(self.geo, self.slots, &written, 0, &mut self.oracle);
            progress(self.progress, || {
                format!("populate took {:.3}s", ns as f64 / 1e9)
            });
        }
        (self.iteration, self.dirty_ns, self.written) = (iteration, ns, written);
        Ok(ns)
    }

    fn start_background_passes(&mut self) -> Result<(), KvmError> {
        // The selftest's `iteration = -1`: the vCPUs keep dirtying memory.
        self.env.ctl.start(-1, self.pass());
        Ok(())
    }

    fn stop_vcpus(&mut self) -> Result<(), KvmError> {
        progress(self.progress, || {
            "dirty logging disabled; stopping vCPUs".into()
        });
        self.env.ctl.quit();
        let err = self.env.ctl.lock().error.take();
        err.map_or(Ok(()), Err)
    }

    fn set_dirty_logging(&mut self, on: bool) -> Result<u64, KvmError> {
        // Rings start empty of test pages: memory was populated before logging was enabled.
        let t = Instant::now();
        self.set_logging(on)?;
        Ok(elapsed_ns(t))
    }

    fn get_dirty_log(&mut self) -> Result<u64, KvmError> {
        let geo = self.geo;
        let mut harvested = vec![0u64; bitmap_words(geo.total_pages)];
        let t = Instant::now();
        if self.ring.is_some() {
            let mut entries = 0u64;
            for r in self.rings {
                let got = vm::lock(r).harvest();
                entries += got.len() as u64;
                for (slot, offset) in got {
                    if slot >= 1 && slot as usize <= geo.slots && offset < geo.pages_per_slot {
                        set_bit(
                            &mut harvested,
                            (slot as u64 - 1) * geo.pages_per_slot + offset,
                        );
                    }
                }
            }
            self.extra.insert("ring_entries_harvested".into(), entries);
        } else {
            self.bitmaps.clear();
            for (&id, m) in self.slots.iter() {
                self.bitmaps
                    .push((id, get_dirty_log(self.env.vm, id, m.size)?));
            }
        }
        let ns = elapsed_ns(t);
        for (id, bm) in &self.bitmaps {
            splice_bits(
                &mut harvested,
                (*id as u64 - 1) * geo.pages_per_slot,
                bm,
                geo.pages_per_slot,
            );
        }
        self.extra
            .insert("dirty_pages".into(), count_ones(&harvested));
        self.harvested = harvested;
        Ok(ns)
    }

    fn clear_dirty_log(&mut self) -> Result<Option<u64>, KvmError> {
        if self.ring.is_some() {
            let t = Instant::now();
            let reset = reset_dirty_rings(self.env.vm)?;
            let ns = elapsed_ns(t);
            self.extra.insert("ring_entries_reset".into(), reset);
            return Ok(Some(ns));
        }
        if !self.manual {
            return Ok(None);
        }
        let t = Instant::now();
        for (id, bm) in &self.bitmaps {
            clear_dirty_log(self.env.vm, *id, 0, self.geo.pages_per_slot, bm)?;
        }
        Ok(Some(elapsed_ns(t)))
    }

    fn check_harvest(&mut self) -> u64 {
        let it = self.iteration;
        let dirty_pages = count_ones(&self.harvested);
        let lost = self
            .oracle
            .check_harvest(&self.written, &self.harvested, |g| (TEST_MEM_GPA >> 12) + g);
        check_content(
            self.geo,
            self.slots,
            &self.written,
            it as i64,
            &mut self.oracle,
        );
        progress(self.progress, || {
            format!(
                "iteration {it}/{}: dirty {:.3}s, {dirty_pages} pages harvested, {lost} lost",
                self.params.iterations,
                self.dirty_ns as f64 / 1e9
            )
        });
        dirty_pages
    }

    fn lap(&mut self) -> Option<PhaseCounters> {
        let now = self.stats.snapshot();
        let mut counters = self.stats.phase(&self.last, &now).unwrap_or_default();
        counters.extend(std::mem::take(&mut self.extra));
        self.last = now;
        Some(counters)
    }

    fn check_invariants(&mut self) -> Option<Vec<String>> {
        // KVM's page tables are not visible from userspace.
        None
    }

    fn oracle_report(&mut self) -> OracleReport {
        std::mem::take(&mut self.oracle).into_report()
    }
}

/// The backend's own counters for a dirty phase.
fn own_counters(writes: u64, reads: u64, ring_full: u64, ring: bool) -> PhaseCounters {
    let mut c = PhaseCounters::new();
    c.insert("guest_writes".into(), writes);
    c.insert("guest_reads".into(), reads);
    if ring {
        c.insert("dirty_ring_full_exits".into(), ring_full);
    }
    c
}

/// Replays one pass of every vCPU with the model's [`PassAccesses`] (the guest's order of
/// `guest_random_u32()` draws); returns the bitmap of pages written (global page index), and
/// the numbers of writes and reads.
fn replay_pass(
    geo: &Geometry,
    replays: &mut [GuestRandom],
    pass: PassParams,
) -> (Vec<u64>, u64, u64) {
    let mut written = vec![0u64; bitmap_words(geo.total_pages)];
    let (mut writes, mut reads) = (0, 0);
    for (i, rng) in replays.iter_mut().enumerate() {
        let first = geo.region_start(i);
        let pages = geo.regions[i].pages;
        for (page, write) in PassAccesses::new(rng, pages, pass.random, pass.write_percent) {
            if write {
                set_bit(&mut written, first + page);
                writes += 1;
            } else {
                reads += 1;
            }
        }
    }
    (written, writes, reads)
}

// check_content reads the writer back from 16 bits of the value.
const _: () = assert!(vmmu::lab::params::KVM_MAX_VCPUS <= 0x1_0000);

/// Checks that every page the replay says was written in pass `iteration` holds a value
/// written in that pass ([`pass_value`]; by its own vCPU when regions are partitioned, by any
/// vCPU otherwise). A mismatch means the
/// host's idea of what the guest did is wrong, which would make the completeness check
/// meaningless, so it is reported as an oracle error.
fn check_content(
    geo: &Geometry,
    slots: &BTreeMap<u32, vm::Memslot>,
    written: &[u64],
    iteration: i64,
    oracle: &mut Oracle,
) {
    let mut bad = 0u64;
    let mut first = None;
    for g in iter_ones(written) {
        let (slot, off) = geo.locate(g);
        let got = slots.get(&slot).and_then(|m| m.mem.read_u64(off * 4096));
        let ok = match got {
            Some(v) if geo.partition => v == pass_value(iteration, (g / geo.vcpu_pages) as usize),
            // Overlapping regions: any vCPU's value of this pass (the last writer wins). The
            // writer is read back from the value; vCPU ids fit its 16 bits (KVM_MAX_VCPUS).
            Some(v) => {
                let w = ((v >> 16) & 0xffff) as usize;
                w < geo.regions.len() && v == pass_value(iteration, w)
            }
            None => false,
        };
        if !ok {
            bad += 1;
            first.get_or_insert((g, got));
        }
    }
    if let Some((g, got)) = first {
        oracle.add_error(format!(
            "guest memory after pass {iteration}: {bad} written pages do not hold that pass's value (first: gfn {:#x} holds {})",
            (TEST_MEM_GPA >> 12) + g,
            got.map_or_else(|| "nothing readable".to_string(), |v| format!("{v:#x}"))
        ));
    }
}
