//! The `migrate` scenario: QEMU's pre-copy live migration of a VM whose guest keeps working,
//! and what the guest's owner feels of it.
//!
//! The VM is memstress's ([`Setup`]); after populating memory its vCPUs loop over a working
//! set (`MigrateGuest`: a write fraction and think time per access). The migration thread
//! is the VMM thread of the engine, doing what QEMU's `migration_thread()` does with
//! `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`:
//!
//! 1. `memory_global_dirty_log_start()`: `KVM_MEM_LOG_DIRTY_PAGES` on every memslot.
//! 2. `ram_init_bitmaps()`: the migration bitmap starts all set, then the first sync.
//! 3. Rounds of `ram_save_iterate()`: every page set in the migration bitmap is sent at the
//!    link's bandwidth. Before the first page of a `clear_bmap` chunk (`clear-bitmap-shift`,
//!    2^18 pages = 1 GiB) goes, the chunk's bits of the last `KVM_GET_DIRTY_LOG` are cleared
//!    with `KVM_CLEAR_DIRTY_LOG` (`migration_clear_memory_region_dirty_bitmap()`), so a write
//!    after the clear is logged again. Without manual protect, GET itself re-protects.
//! 4. After each round, `migration_bitmap_sync()` (GET of every memslot, ORed into the
//!    migration bitmap); when what is dirty can be sent within the downtime limit
//!    (`migration_iteration_run()`'s threshold, bandwidth × downtime), or after `max_rounds`,
//!    stop-and-copy: the vCPUs are paused (`vm_stop()`), a last sync, and the rest is sent.
//!
//! Pages land in a destination memory; after stop-and-copy it must equal the source page for
//! page (DESIGN §4's migration oracle; [`MigrateFaults::drop_bulk_page`] is its negative
//! control). Each vCPU's accesses are counted per time bucket, and the same run without
//! migration gives the baseline: the slowdown spans (the time during which the guests'
//! throughput is more than 99 %, 50 % and 10 % below the baseline) are seed 001's metric.
//!
//! Simplified, each named where it is done: the link carries page payloads only (no headers,
//! no zero-page detection, no compression, no multifd), its bandwidth is constant (QEMU
//! measures and rate-limits), the stop-and-copy decision is made once per round, and device
//! state costs nothing.

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{Engine, GuestAccess, GuestCode, PrivateGfns};
use crate::kvm::dirty_log::clear_dirty_log_plan;
use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
use crate::lab::memstress::{vcpu_regions, GuestRandom, PassCursor, VcpuRegion};
use crate::lab::params::DirtyLogParams;
use crate::lab::report::{fmt_ts, PhaseCounters};
use crate::lab::test_vm::{PhaseClock, Setup};
use crate::lab::LabError;
use crate::units::{Gfn, GfnRange, PAGE_SIZE};
use crate::vm::waiter::SpinWaiter;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

mod eta;
mod report;
mod timeline;

use report::spans;
pub use report::{
    compare_text, fmt_bandwidth, plot_timeline_svg, MigrateOracle, MigrateReport, MigrationPhase,
    RoundReport, Span,
};
use timeline::Timeline;

/// QEMU's default `clear-bitmap-shift` (`CLEAR_BITMAP_SHIFT_DEFAULT`): a `KVM_CLEAR_DIRTY_LOG`
/// covers 2^18 pages (1 GiB of 4 KiB pages).
pub const CLEAR_BITMAP_SHIFT_DEFAULT: u32 = 18;

/// In dirty ring mode, how often the migration thread looks for a vCPU whose ring is full
/// (standing in for the vCPU thread's own reap).
const RING_POLL_NS: u64 = 50_000;

/// Pages the migration thread copies before it waits for the link (1 MiB): the unit in which
/// the send phase advances time. Small against a bucket (0.84 ms at 10 Gbit/s).
const SEND_BATCH_PAGES: u64 = 256;

/// One migration, as `vmmu migrate`'s flags describe it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateParams {
    /// The VM and its memory as dirty_log_perf_test's flags describe them (`-v -b -s -x -w -a
    /// -r -g`, the MMU and KVM's switches); `iterations`, `partition` and `-e` are not used.
    pub vm: DirtyLogParams,
    /// Bytes of its region each vCPU touches in its loop (from the region's start); the rest
    /// is written once, when memory is populated.
    pub working_set_bytes: u64,
    /// Nanoseconds the guest computes before each access.
    pub think_ns: u32,
    /// The link's bandwidth in bits per second.
    pub bandwidth_bps: u64,
    /// The downtime limit (QEMU's `downtime-limit`): stop-and-copy starts once what is dirty
    /// can be sent within it.
    pub downtime_ns: u64,
    /// Rounds after the first (bulk) one before stop-and-copy is forced.
    pub max_rounds: u32,
    /// The width of a progress bucket.
    pub bucket_ns: u64,
    /// How long the guests run before the migration starts (a multiple of the bucket).
    pub warmup_ns: u64,
    /// `clear-bitmap-shift`: pages per `KVM_CLEAR_DIRTY_LOG` call, as a power of two.
    pub clear_bitmap_shift: u32,
    /// Run the same guests without migration for the baseline (off only in tests that need
    /// no timeline).
    pub baseline: bool,
    /// QEMU's `auto-converge` capability: when the guests dirty memory faster than half the
    /// link carries it in two sync periods, their vCPUs are throttled, harder each time.
    #[serde(default)]
    pub auto_converge: bool,
    /// `KVM_CAP_DIRTY_LOG_RING` with this many entries per vCPU (QEMU's `dirty-ring-size`)
    /// instead of dirty bitmaps; manual protect is then off, as QEMU leaves it.
    #[serde(default)]
    pub dirty_ring: Option<u32>,
    /// Deliberate faults for the oracle's negative control.
    #[serde(skip)]
    pub faults: MigrateFaults,
}

/// Deliberate mistakes in the migration thread, which the destination oracle must catch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrateFaults {
    /// The bulk round does not send the last page of the last vCPU's region (outside its
    /// working set when that is smaller than the region, so the page is never dirtied again
    /// and never resent).
    pub drop_bulk_page: bool,
}

impl Default for MigrateParams {
    fn default() -> Self {
        MigrateParams {
            vm: DirtyLogParams {
                iterations: 1,
                ..Default::default()
            },
            working_set_bytes: 1 << 30,
            think_ns: 0,
            bandwidth_bps: 10_000_000_000,
            downtime_ns: 300_000_000,
            max_rounds: 30,
            bucket_ns: 100_000_000,
            warmup_ns: 1_000_000_000,
            clear_bitmap_shift: CLEAR_BITMAP_SHIFT_DEFAULT,
            baseline: true,
            auto_converge: false,
            dirty_ring: None,
            faults: MigrateFaults::default(),
        }
    }
}

impl MigrateParams {
    /// Checks the parameters; errors are one line that says what is allowed.
    pub fn validate(&self) -> Result<(), LabError> {
        self.vm.validate()?;
        let page = self.vm.mode()?.page_bytes;
        if self.working_set_bytes == 0
            || self.working_set_bytes > self.vm.vcpu_memory_bytes
            || !self.working_set_bytes.is_multiple_of(page)
        {
            return Err(LabError::Invalid(format!(
                "--working-set {}: must be a non-zero multiple of the guest page size ({page} bytes) and at most the memory of each vCPU (-b {})",
                self.working_set_bytes, self.vm.vcpu_memory_bytes
            )));
        }
        if self.bandwidth_bps == 0 {
            return Err(LabError::Invalid(
                "--bandwidth 0: the link must carry at least 1 bit per second".into(),
            ));
        }
        if self.downtime_ns == 0 || self.downtime_ns > 2_000_000_000_000 {
            return Err(LabError::Invalid(format!(
                "--downtime {} ns: the downtime limit must be more than 0 and at most 2000 s (QEMU's downtime-limit range)",
                self.downtime_ns
            )));
        }
        if self.bucket_ns < 1_000_000 {
            return Err(LabError::Invalid(format!(
                "--bucket {} ns: buckets must be at least 1 ms",
                self.bucket_ns
            )));
        }
        if !self.warmup_ns.is_multiple_of(self.bucket_ns) {
            return Err(LabError::Invalid(format!(
                "--warmup {}: must be a multiple of the bucket ({}), so the migration starts at a bucket's edge",
                fmt_ts(self.warmup_ns),
                fmt_ts(self.bucket_ns)
            )));
        }
        if let Some(n) = self.dirty_ring {
            if !n.is_power_of_two() || !(256..=crate::vm::KVM_DIRTY_RING_MAX_ENTRIES).contains(&n) {
                return Err(LabError::Invalid(format!(
                    "--dirty-ring {n}: the ring size must be a power of two between 256 and {} entries",
                    crate::vm::KVM_DIRTY_RING_MAX_ENTRIES
                )));
            }
        }
        if !(6..=31).contains(&self.clear_bitmap_shift) {
            return Err(LabError::Invalid(format!(
                "--clear-bitmap-shift {}: QEMU allows 6 to 31",
                self.clear_bitmap_shift
            )));
        }
        if self.dirty_ring.is_some() && self.vm.mmu.shadow_paging() {
            return Err(LabError::Invalid("--dirty-ring with shadow paging (--ept off) is not modelled: the shadow MMU's guest page-table syncs mark pages dirty without a vCPU's ring".into()));
        }
        if self.bandwidth_bps < 1_000_000 {
            return Err(LabError::Invalid(format!(
                "--bandwidth {} bit/s: the link must carry at least 1 Mbit/s",
                self.bandwidth_bps
            )));
        }
        if self.bucket_ns > 3_600_000_000_000 || self.warmup_ns > 3_600_000_000_000 {
            return Err(LabError::Invalid(
                "--bucket and --warmup must be at most an hour".into(),
            ));
        }
        if self.think_ns as u64 >= self.bucket_ns {
            return Err(LabError::Invalid(format!(
                "--think-ns {}: a guest must touch memory within every bucket; use less than --bucket ({} ns)",
                self.think_ns, self.bucket_ns
            )));
        }
        Ok(())
    }

    /// The VM to build: the dirty-log VM, with the dirty ring if asked for.
    pub fn test_vm(&self) -> crate::lab::test_vm::TestVm {
        let mut t = self.vm.test_vm();
        t.dirty_ring = self.dirty_ring;
        if self.dirty_ring.is_some() {
            t.manual_protect = false;
        }
        t
    }

    /// Seconds the link needs for `pages` 4 KiB pages, in nanoseconds (rounded up).
    pub fn wire_ns(&self, pages: u64) -> u64 {
        let bits = pages as u128 * PAGE_SIZE as u128 * 8;
        (bits * 1_000_000_000).div_ceil(self.bandwidth_bps as u128) as u64
    }

    /// Pages the link carries within the downtime limit: `migration_iteration_run()`'s
    /// threshold (QEMU computes it from the bandwidth it measured; here the link's).
    pub fn threshold_pages(&self) -> u64 {
        let bytes = self.bandwidth_bps as u128 * self.downtime_ns as u128 / 8 / 1_000_000_000;
        (bytes / PAGE_SIZE as u128) as u64
    }
}

/// QEMU's `cpu-throttle-initial` default: the first throttle takes 20 % of each vCPU's time.
pub const CPU_THROTTLE_INITIAL: u32 = 20;
/// QEMU's `cpu-throttle-increment` default: each later throttle takes 10 % more.
pub const CPU_THROTTLE_INCREMENT: u32 = 10;
/// QEMU's `max-cpu-throttle` default.
pub const MAX_CPU_THROTTLE: u32 = 99;
/// QEMU's `throttle-trigger-threshold` default: a sync period whose dirtied bytes exceed this
/// percentage of the bytes sent counts as dirtying too fast.
pub const THROTTLE_TRIGGER_THRESHOLD: u32 = 50;
/// QEMU's `CPU_THROTTLE_TIMESLICE_NS`: the throttle's time slice.
pub const CPU_THROTTLE_TIMESLICE_NS: u64 = 10_000_000;

/// Each vCPU's completed guest accesses, one counter per cache line: written by the vCPU's
/// thread, read by the migration thread at bucket edges.
pub struct Progress {
    done: Box<[PaddedCounter]>,
    /// Per vCPU, the nanoseconds it must sleep out of the guest before its next access
    /// (`cpu_throttle_thread()`'s sleep, queued by the throttle timer).
    sleep_ns: Box<[PaddedCounter]>,
    /// `vm_stop()`: the guests take no further access (they end their pass at once).
    paused: AtomicBool,
}

/// A counter alone on its cache line, so vCPU threads do not share lines.
#[repr(align(64))]
#[derive(Default)]
struct PaddedCounter(AtomicU64);

impl Progress {
    fn new(vcpus: usize) -> Self {
        Progress {
            done: (0..vcpus).map(|_| PaddedCounter::default()).collect(),
            sleep_ns: (0..vcpus).map(|_| PaddedCounter::default()).collect(),
            paused: AtomicBool::new(false),
        }
    }

    /// Every vCPU's count now.
    fn snapshot(&self) -> Vec<u64> {
        self.done
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .collect()
    }
}

/// One vCPU's guest: pass 0 writes every page of its region (populate); every later pass
/// goes over its working set with the run's write fraction and think time. Each write stores
/// a new value, so a page the migration failed to resend differs at the destination.
pub(crate) struct MigrateGuest {
    vcpu: usize,
    region: VcpuRegion,
    working_set_pages: u64,
    stride: u64,
    rng: GuestRandom,
    random_access: bool,
    write_percent: u32,
    think_ns: u32,
    cursor: PassCursor,
    value: u64,
    done: u64,
    progress: Arc<Progress>,
    /// The pages (of `stride` 4 KiB pages) the pass in progress goes over from the region's
    /// start, and whether it may write.
    pass_pages: u64,
    pass_writes: bool,
}

impl MigrateGuest {
    /// The guests of every vCPU of `setup`'s VM.
    fn for_vcpus(setup: &Setup, p: &MigrateParams, progress: &Arc<Progress>) -> Vec<Self> {
        let stride = p.vm.guest_page_stride();
        vcpu_regions(
            setup.base_gfn,
            p.vm.vcpus,
            p.vm.vcpu_memory_bytes / PAGE_SIZE,
            true,
        )
        .into_iter()
        .enumerate()
        .map(|(i, mut region)| {
            region.pages /= stride;
            MigrateGuest {
                vcpu: i,
                region,
                working_set_pages: p.working_set_bytes / PAGE_SIZE / stride,
                stride,
                rng: GuestRandom::new(p.vm.random_seed.wrapping_add(i as u32)),
                random_access: p.vm.random_access,
                write_percent: p.vm.write_percent,
                think_ns: p.think_ns,
                cursor: PassCursor::new(0, false, 0),
                value: 0,
                done: 0,
                progress: Arc::clone(progress),
                pass_pages: 0,
                pass_writes: false,
            }
        })
        .collect()
    }
}

impl GuestCode for MigrateGuest {
    fn start_pass(&mut self, iteration: i64) {
        // Populate writes every page in order; later passes go over the working set.
        let (pages, random, write_percent) = if iteration == 0 {
            (self.region.pages, false, 100)
        } else {
            (
                self.working_set_pages,
                self.random_access,
                self.write_percent,
            )
        };
        (self.pass_pages, self.pass_writes) = (pages, write_percent > 0);
        self.cursor = PassCursor::new(pages, random, write_percent);
    }

    /// The start of its own region (migrate's memory is always partitioned), as far as the
    /// pass goes. What the migration thread tells it (pause, auto-converge's sleep) and reads
    /// of it (pages done) changes only at the thread's own steps.
    fn private_gfns(&self) -> Option<PrivateGfns> {
        Some(PrivateGfns {
            range: GfnRange::new(Gfn(self.region.base_gfn), self.pass_pages * self.stride),
            write: self.pass_writes,
        })
    }

    #[inline]
    fn next_access(&mut self) -> Option<GuestAccess> {
        if self.progress.paused.load(Ordering::Relaxed) {
            return None;
        }
        let (page, write) = self.cursor.next(&mut self.rng)?;
        // Every write stores a value of its own (vCPU, then a per-vCPU sequence), so a write
        // the migration lost differs at the destination even when the same pass writes the
        // page twice (-a).
        self.value += 1;
        let mut a = GuestAccess::first_word(
            Gfn(self.region.base_gfn + page * self.stride),
            write,
            (self.vcpu as u64) << 48 | (self.value & ((1 << 48) - 1)),
        );
        a.compute_ns = self.think_ns;
        // Auto-converge's sleep: the vCPU is out of the guest for that long first (the model
        // spends it as the guest's own time: nothing of the MMU happens either way).
        let sleep = &self.progress.sleep_ns[self.vcpu].0;
        if sleep.load(Ordering::Relaxed) != 0 {
            let ns = sleep.swap(0, Ordering::Relaxed);
            a.compute_ns = a.compute_ns.saturating_add(ns.min(u32::MAX as u64) as u32);
        }
        Some(a)
    }

    #[inline]
    fn access_done(&mut self, _: &GuestAccess) {
        self.done += 1;
        self.progress.done[self.vcpu]
            .0
            .store(self.done, Ordering::Relaxed);
    }
}

/// The migration thread over an engine, and what it has measured so far.
struct Migration<'a> {
    setup: &'a Setup,
    p: &'a MigrateParams,
    engine: &'a mut dyn Engine,
    progress: Arc<Progress>,
    timeline: Timeline,
    clock: PhaseClock,
    /// Ns since the workload started, on the engine's clock.
    now: u64,
    /// The destination's first word of each 4 KiB page of the test region.
    dest: Vec<u64>,
    /// QEMU's migration bitmap, per memslot.
    bitmap: Vec<Vec<u64>>,
    /// Per memslot, the last `KVM_GET_DIRTY_LOG` (what a chunk's CLEAR clears).
    kvm_bitmap: Vec<Vec<u64>>,
    /// Per memslot, the chunks to clear before their next page is sent (`clear_bmap`).
    clear_bmap: Vec<Vec<bool>>,
    progress_lines: bool,
    /// The run's wall clock and estimate, for the progress lines.
    eta: eta::Eta,
    /// Auto-converge: the throttle in percent (0: off), when its timer next fires, how many
    /// sync periods in a row dirtied too fast, and the period's start (time, pages sent).
    throttle_pct: u32,
    next_tick_ns: u64,
    dirty_rate_high_cnt: u32,
    period_start: (u64, u64),
    /// Pages sent so far, and pages newly dirtied since the period started.
    sent_total: u64,
    dirtied_in_period: u64,
    /// Dirty ring mode: QEMU's per-memslot `dirty_bmap`, where reaped ring entries wait for
    /// the next sync; when the reaper thread last ran; reaps for a full ring and by the
    /// reaper.
    reaped: Vec<Vec<u64>>,
    last_reap_ns: u64,
    ring_full_reaps: u64,
    reaper_reaps: u64,
}

impl Migration<'_> {
    fn say(&self, what: &str) {
        if self.progress_lines {
            eprintln!("vmmu: {what}");
        }
    }

    /// Moves the clock on by `ns` and samples the guests.
    fn advance(&mut self, ns: u64) {
        self.now += ns;
        let snap = self.progress.snapshot();
        self.timeline.sample(self.now, &snap);
        self.throttle_tick();
        if self.progress_lines {
            let what = if self.dest.is_empty() {
                "baseline"
            } else {
                "migration"
            };
            if let Some(line) = self.eta.tick(what, self.now, snap.iter().sum()) {
                self.say(&line);
            }
        }
    }

    /// Whether the VM logs dirty pages into rings.
    fn ring_mode(&self) -> bool {
        self.setup.vm.kvm.dirty_rings.get().is_some()
    }

    /// `kvm_dirty_ring_reap()` of every vCPU: their harvested entries go into QEMU's
    /// per-memslot bitmaps, then `KVM_RESET_DIRTY_RINGS` re-protects them. Returns its time.
    fn reap(&mut self) -> Result<u64, LabError> {
        let Some(rings) = self.setup.vm.kvm.dirty_rings.get() else {
            return Ok(0);
        };
        for ring in rings.iter() {
            for (slot_id, offset) in ring.harvest() {
                if let Some(i) = self.setup.slots.iter().position(|s| s.id == slot_id) {
                    self.reaped[i][(offset / 64) as usize] |= 1 << (offset % 64);
                }
            }
        }
        let plan = crate::kvm::dirty_log::reset_dirty_rings_plan(Default::default());
        self.last_reap_ns = self.now;
        self.ioctl(vec![plan])
    }

    /// The ring reaps QEMU makes besides the sync: a vCPU's thread on
    /// `KVM_EXIT_DIRTY_RING_FULL`, and the reaper thread once a second
    /// (`kvm_dirty_ring_reaper_thread()`). Simplified: both run on the migration thread, which
    /// looks every `RING_POLL_NS` of its waits, so a vCPU with a full ring waits up to that
    /// long before the reap (QEMU's vCPU thread reaps at once), and the link waits for the
    /// reset.
    fn reap_if_due(&mut self) -> Result<(), LabError> {
        let Some(rings) = self.setup.vm.kvm.dirty_rings.get() else {
            return Ok(());
        };
        if self.progress.paused.load(Ordering::Relaxed) {
            return Ok(());
        }
        if rings.iter().any(|r| r.soft_full()) {
            self.ring_full_reaps += 1;
            self.reap()?;
        } else if self.now >= self.last_reap_ns + 1_000_000_000 {
            self.reaper_reaps += 1;
            self.reap()?;
        }
        Ok(())
    }

    /// `cpu_throttle_timer_tick()`: every `CPU_THROTTLE_TIMESLICE_NS / (1 - pct)` each vCPU is
    /// made to sleep `pct / (1 - pct)` time slices, so it runs `1 - pct` of the time. The
    /// migration thread's waits are cut at each tick; an ioctl in progress delays it.
    fn throttle_tick(&mut self) {
        if self.throttle_pct == 0 || self.now < self.next_tick_ns {
            return;
        }
        let pct = self.throttle_pct as u64;
        let sleep = CPU_THROTTLE_TIMESLICE_NS * pct / (100 - pct);
        for c in self.progress.sleep_ns.iter() {
            c.0.store(sleep, Ordering::Relaxed);
        }
        self.next_tick_ns = self.now + CPU_THROTTLE_TIMESLICE_NS * 100 / (100 - pct);
    }

    /// `migration_trigger_throttle()`, at a sync at least a second after the period began:
    /// dirtying more than `THROTTLE_TRIGGER_THRESHOLD` % of what was sent, twice in a row,
    /// throttles the guests (`mig_throttle_guest_down()`): to `CPU_THROTTLE_INITIAL` %, then
    /// `CPU_THROTTLE_INCREMENT` % more each time, at most `MAX_CPU_THROTTLE` %.
    fn trigger_throttle(&mut self) {
        if !self.p.auto_converge || self.now < self.period_start.0 + 1_000_000_000 {
            return;
        }
        let xfer = self.sent_total - self.period_start.1;
        let threshold = xfer * THROTTLE_TRIGGER_THRESHOLD as u64 / 100;
        if self.dirtied_in_period > threshold {
            self.dirty_rate_high_cnt += 1;
            if self.dirty_rate_high_cnt >= 2 {
                self.dirty_rate_high_cnt = 0;
                self.throttle_pct = if self.throttle_pct == 0 {
                    CPU_THROTTLE_INITIAL
                } else {
                    (self.throttle_pct + CPU_THROTTLE_INCREMENT).min(MAX_CPU_THROTTLE)
                };
                // cpu_throttle_set() arms the timer one time slice ahead when it is not
                // running yet; a running timer keeps its period, at the new percentage.
                if self.next_tick_ns <= self.now {
                    self.next_tick_ns = self.now + CPU_THROTTLE_TIMESLICE_NS;
                }
                self.say(&format!(
                    "auto-converge: throttling the vCPUs {}%",
                    self.throttle_pct
                ));
            }
        }
        self.period_start = (self.now, self.sent_total);
        self.dirtied_in_period = 0;
    }

    /// Runs the VMM's `plans` and brings the guests up to their end.
    fn ioctl(&mut self, plans: Vec<crate::kvm::op_plan::OpPlan>) -> Result<u64, LabError> {
        let ns = self.engine.run_plans(plans)?;
        self.engine.elapse(0)?;
        self.advance(ns);
        Ok(ns)
    }

    /// The link is busy for `ns`; the guests go on. The wait is cut at every bucket edge and
    /// throttle tick in it, so the samples and the throttle's sleeps fall where they belong.
    fn wait(&mut self, ns: u64) -> Result<(), LabError> {
        let end = self.now + ns;
        loop {
            let mut cut = (self.now / self.p.bucket_ns + 1) * self.p.bucket_ns;
            if self.throttle_pct > 0 && self.next_tick_ns > self.now {
                cut = cut.min(self.next_tick_ns);
            }
            if self.ring_mode() {
                cut = cut.min(self.now + RING_POLL_NS);
            }
            let step = cut.min(end) - self.now;
            // On threads the sleep can be longer than asked: the clock follows what passed.
            let passed = self.engine.elapse(step)?;
            self.advance(passed);
            self.reap_if_due()?;
            if self.now >= end {
                return Ok(());
            }
        }
    }

    /// Runs the guests without migration until `t`.
    fn run_until(&mut self, t: u64) -> Result<(), LabError> {
        self.wait(t.saturating_sub(self.now))
    }

    /// `migration_bitmap_sync()`: GET of every memslot, ORed into the migration bitmap; every
    /// chunk is to be cleared before its next page goes. Returns the GET time and the pages
    /// now dirty in the migration bitmap.
    fn sync(&mut self) -> Result<(u64, u64), LabError> {
        if self.ring_mode() {
            return self.sync_rings();
        }
        let (plans, outs) = self.setup.get_plans();
        let ns = self.ioctl(plans)?;
        let mut dirty = 0;
        for (i, out) in outs.iter().enumerate() {
            let got = std::mem::take(&mut *out.lock());
            for (w, g) in self.bitmap[i].iter_mut().zip(&got) {
                self.dirtied_in_period += (g & !*w).count_ones() as u64;
                *w |= g;
                dirty += w.count_ones() as u64;
            }
            self.kvm_bitmap[i] = got;
            self.clear_bmap[i].iter_mut().for_each(|c| *c = true);
        }
        Ok((ns, dirty))
    }

    /// The sync with dirty rings (`kvm_log_sync_global()`): every vCPU kicked out so its ring
    /// is complete (free here: the model's rings take entries as pages are dirtied), every
    /// ring reaped and reset, and QEMU's per-memslot bitmaps moved into the migration bitmap.
    fn sync_rings(&mut self) -> Result<(u64, u64), LabError> {
        let ns = self.reap()?;
        let mut dirty = 0;
        for (bm, reaped) in self.bitmap.iter_mut().zip(self.reaped.iter_mut()) {
            for (w, r) in bm.iter_mut().zip(reaped.iter_mut()) {
                self.dirtied_in_period += (*r & !*w).count_ones() as u64;
                *w |= std::mem::take(r);
                dirty += w.count_ones() as u64;
            }
        }
        Ok((ns, dirty))
    }

    /// Sends every page set in the migration bitmap (one `ram_save_iterate()` pass over it):
    /// each chunk is cleared first if it must be, then its pages go in batches at the link's
    /// speed. Returns the pages sent and the CLEAR calls and their time.
    fn send_dirty(&mut self, round: u32) -> Result<(u64, u64, u64), LabError> {
        let chunk_pages = 1u64 << self.p.clear_bitmap_shift;
        let (mut sent, mut clears, mut clear_ns) = (0, 0, 0);
        let manual = self.setup.vm.kvm.manual_protect();
        for si in 0..self.setup.slots.len() {
            let slot = Arc::clone(&self.setup.slots[si]);
            let base = slot.base_gfn.0 - self.setup.base_gfn;
            for (ci, first) in (0..slot.npages).step_by(chunk_pages as usize).enumerate() {
                let end = (first + chunk_pages).min(slot.npages);
                let words = (first / 64) as usize..end.div_ceil(64) as usize;
                if self.bitmap[si][words.clone()].iter().all(|w| *w == 0) {
                    continue;
                }
                if manual && self.clear_bmap[si][ci] {
                    self.clear_bmap[si][ci] = false;
                    let bits = &self.kvm_bitmap[si][words.clone()];
                    if bits.iter().any(|w| *w != 0) {
                        let plan = clear_dirty_log_plan(
                            &self.setup.vm.kvm,
                            &slot,
                            first,
                            end - first,
                            bits,
                        )?;
                        clear_ns += self.ioctl(vec![plan])?;
                        clears += 1;
                    }
                }
                let mut batch = 0;
                for w in words {
                    while self.bitmap[si][w] != 0 {
                        let bit = self.bitmap[si][w].trailing_zeros() as u64;
                        self.bitmap[si][w] &= !(1 << bit);
                        let page = w as u64 * 64 + bit;
                        // The last guest page (its first 4 KiB, which the guest writes).
                        let dropped = self.p.faults.drop_bulk_page
                            && round == 0
                            && si == self.setup.slots.len() - 1
                            && page == slot.npages - self.p.vm.guest_page_stride();
                        if !dropped {
                            let pfn = slot.gfn_to_pfn(slot.base_gfn + page);
                            self.dest[(base + page) as usize] = self.setup.vm.kvm.host.read(pfn);
                        }
                        sent += 1;
                        batch += 1;
                        if batch == SEND_BATCH_PAGES {
                            self.wait(self.p.wire_ns(batch))?;
                            batch = 0;
                        }
                    }
                }
                if batch > 0 {
                    self.wait(self.p.wire_ns(batch))?;
                }
            }
        }
        Ok((sent, clears, clear_ns))
    }

    fn lap(&mut self) -> PhaseCounters {
        self.clock.lap(&self.setup.vm, &self.engine.vcpu_meters())
    }

    /// Populate, warm up, migrate; returns the report without the baseline.
    fn migrate(mut self) -> Result<MigrateReport, LabError> {
        let p = self.p;
        let mut r = MigrateReport {
            engine: self.engine.name().into(),
            mmu: self.setup.vm.mmu.name().into(),
            params: p.clone(),
            ..Default::default()
        };
        self.say("populating memory");
        r.populate_ns = self.engine.run_pass(0)?;
        self.engine.start_background_passes(1);
        self.timeline.start(&self.progress.snapshot());
        self.eta
            .guests_started(self.progress.snapshot().iter().sum());
        self.say("guests running");
        self.run_until(p.warmup_ns)?;
        self.lap();
        if self.progress_lines {
            let accesses = self.progress.snapshot().iter().sum();
            let line = self.eta.after_warmup(p, accesses, p.warmup_ns);
            self.say(&line);
        }

        self.say("enabling dirty logging");
        let t0 = self.now;
        r.enable_ns = self.ioctl(self.setup.flags_plans(KVM_MEM_LOG_DIRTY_PAGES))?;
        r.phases.push(MigrationPhase {
            name: "enable dirty logging".into(),
            start_ns: t0,
            end_ns: self.now,
        });
        // ram_init_bitmaps(): everything is to be sent; the first sync starts the log.
        for b in &mut self.bitmap {
            b.iter_mut().for_each(|w| *w = !0);
        }
        for (b, s) in self.bitmap.iter_mut().zip(&self.setup.slots) {
            if !s.npages.is_multiple_of(64) {
                *b.last_mut().expect("a slot has pages") = (1u64 << (s.npages % 64)) - 1;
            }
        }
        self.sync()?;
        // migration_bitmap_sync()'s first call starts the first rate period.
        self.period_start = (self.now, self.sent_total);
        self.dirtied_in_period = 0;
        let threshold = p.threshold_pages();
        let mut round = 0;
        loop {
            let start = self.now;
            self.say(&format!("round {round}"));
            let (sent, clears, clear_ns) = self.send_dirty(round)?;
            self.sent_total += sent;
            let (get_ns, dirty) = self.sync()?;
            self.trigger_throttle();
            r.rounds.push(RoundReport {
                round,
                pages_sent: sent,
                get_ns,
                clear_ns,
                clears,
                dirty_after: dirty,
                ns: self.now - start,
                counters: Some(self.lap()),
            });
            r.phases.push(MigrationPhase {
                name: if round == 0 {
                    "round 0 (bulk)".into()
                } else {
                    format!("round {round}")
                },
                start_ns: start,
                end_ns: self.now,
            });
            r.pages_sent += sent;
            if dirty <= threshold {
                r.converged = true;
                break;
            }
            if round >= p.max_rounds {
                break;
            }
            round += 1;
        }

        r.final_throttle_pct = self.throttle_pct;
        r.ring_full_reaps = self.ring_full_reaps;
        r.reaper_reaps = self.reaper_reaps;
        // vm_stop(): every vCPU leaves the guest at its next access.
        self.say("stop-and-copy");
        let pause = self.now;
        self.progress.paused.store(true, Ordering::Relaxed);
        self.engine.stop_vcpus()?;
        self.advance(0);
        self.sync()?;
        let (sent, _, _) = self.send_dirty(round + 1)?;
        r.final_pages = sent;
        r.pages_sent += sent;
        r.downtime_ns = self.now - pause;
        r.total_ns = self.now - t0;
        r.stop_counters = Some(self.lap());
        r.phases.push(MigrationPhase {
            name: "stop-and-copy".into(),
            start_ns: pause,
            end_ns: self.now,
        });
        // The timeline covers every bucket up to the last page sent.
        self.timeline
            .bucket((self.now.saturating_sub(1) / p.bucket_ns) as usize);
        r.throughput = self.timeline.totals();
        r.vcpu_throughput = self.timeline.per_vcpu();
        // The buckets from the migration's start to the last that ends before the pause
        // (empty when the live migration was shorter than a bucket).
        let first = (p.warmup_ns / p.bucket_ns) as usize;
        r.live_buckets = (first, ((pause / p.bucket_ns) as usize).max(first));

        // The destination oracle: every page of the region, as the source holds it now.
        let mut o = MigrateOracle::default();
        for s in &self.setup.slots {
            let base = s.base_gfn.0 - self.setup.base_gfn;
            for page in 0..s.npages {
                let src = self.setup.vm.kvm.host.read(s.gfn_to_pfn(s.base_gfn + page));
                o.pages_compared += 1;
                if self.dest[(base + page) as usize] != src {
                    o.mismatched += 1;
                    if o.mismatched_gfns.len() < 16 {
                        o.mismatched_gfns.push(s.base_gfn.0 + page);
                    }
                }
            }
        }
        o.invariant_errors = self.setup.vm.check_invariants();
        r.oracle = o;
        Ok(r)
    }

    /// The same guests without migration, until `end_ns`: the baseline's accesses per bucket.
    fn baseline(mut self, end_ns: u64) -> Result<Vec<u64>, LabError> {
        self.say("baseline: the same guests without migration");
        self.eta.ends_at(end_ns);
        self.engine.run_pass(0)?;
        self.engine.start_background_passes(1);
        self.timeline.start(&self.progress.snapshot());
        self.run_until(end_ns)?;
        self.engine.stop_vcpus()?;
        Ok(self.timeline.totals())
    }
}

/// Which of a side's two runs to make.
#[derive(Clone, Copy)]
enum Role {
    /// Populate, warm up, migrate.
    Migrate,
    /// The same guests without migration, until this time.
    Baseline { end_ns: u64 },
}

/// What a run returns.
enum Outcome {
    Migrated(Box<MigrateReport>),
    Baseline(Vec<u64>),
}

/// One run of `role` on `setup`'s VM driven by `engine`, whose guests count into `progress`.
fn run_role(
    setup: &Setup,
    p: &MigrateParams,
    progress: Arc<Progress>,
    engine: &mut dyn Engine,
    role: Role,
    progress_lines: bool,
) -> Result<Outcome, LabError> {
    let chunk = 1u64 << p.clear_bitmap_shift;
    let migrating = matches!(role, Role::Migrate);
    // A bitmap per memslot (only a migration needs them).
    let slot_bitmaps = || -> Vec<Vec<u64>> {
        setup
            .slots
            .iter()
            .map(|s| vec![0; if migrating { s.bitmap_words() } else { 0 }])
            .collect()
    };
    let m = Migration {
        bitmap: slot_bitmaps(),
        kvm_bitmap: vec![Vec::new(); setup.slots.len()],
        clear_bmap: setup
            .slots
            .iter()
            .map(|s| vec![false; s.npages.div_ceil(chunk) as usize])
            .collect(),
        dest: vec![
            0;
            if migrating {
                p.vm.guest_pages() as usize
            } else {
                0
            }
        ],
        timeline: Timeline::new(p.bucket_ns, p.vm.vcpus),
        clock: PhaseClock::default(),
        now: 0,
        progress,
        engine,
        setup,
        p,
        progress_lines,
        eta: eta::Eta::new(),
        throttle_pct: 0,
        next_tick_ns: 0,
        dirty_rate_high_cnt: 0,
        period_start: (0, 0),
        sent_total: 0,
        dirtied_in_period: 0,
        reaped: slot_bitmaps(),
        last_reap_ns: 0,
        ring_full_reaps: 0,
        reaper_reaps: 0,
    };
    Ok(match role {
        Role::Migrate => Outcome::Migrated(Box::new(m.migrate()?)),
        Role::Baseline { end_ns } => Outcome::Baseline(m.baseline(end_ns)?),
    })
}

/// The migration, then (unless `p.baseline` is off) the baseline, each on a VM of its own
/// that `run` builds; the slowdown spans compare them.
fn run_both(
    p: &MigrateParams,
    run: impl Fn(Role) -> Result<Outcome, LabError>,
) -> Result<MigrateReport, LabError> {
    p.validate()?;
    let Outcome::Migrated(report) = run(Role::Migrate)? else {
        unreachable!("a migration run reports a migration")
    };
    let mut report = *report;
    if p.baseline {
        let end_ns = report.throughput.len() as u64 * p.bucket_ns;
        let Outcome::Baseline(mut b) = run(Role::Baseline { end_ns })? else {
            unreachable!("a baseline run reports a baseline")
        };
        b.resize(report.throughput.len(), 0);
        report.baseline = b;
        report.spans = spans(&report.slowdown(), report.live_buckets, p.bucket_ns);
    }
    Ok(report)
}

/// The scenario on the threads engine (wall-clock times). `progress` prints phase names on
/// stderr.
pub fn run_migrate_threads(p: &MigrateParams, progress: bool) -> Result<MigrateReport, LabError> {
    run_both(p, |role| {
        let setup = Setup::new(&p.test_vm(), Box::new(SpinWaiter))?;
        let shared = Arc::new(Progress::new(p.vm.vcpus));
        let guests = MigrateGuest::for_vcpus(&setup, p, &shared);
        let mut engine = Threads::new(Arc::clone(&setup.vm), guests);
        run_role(&setup, p, shared, &mut engine, role, progress)
    })
}

/// The scenario in virtual time with `cost`: deterministic, whatever the vCPU count.
pub fn run_migrate_virtual(
    p: &MigrateParams,
    cost: &CostModel,
    progress: bool,
) -> Result<MigrateReport, LabError> {
    crate::engine::virtual_time::check_cost_model(cost)?;
    run_both(p, |role| {
        let setup = Setup::new(&p.test_vm(), Box::new(VirtualWaiter))?;
        let shared = Arc::new(Progress::new(p.vm.vcpus));
        let guests = MigrateGuest::for_vcpus(&setup, p, &shared);
        // memstress's vCPU threads spin on `iteration`.
        let mut engine = VirtualTime::new(&setup.vm, cost, guests)?.with_pass_start(
            crate::engine::virtual_time::drift::PassStart::Poll {
                seed: p.vm.random_seed,
            },
        );
        run_role(&setup, p, shared, &mut engine, role, progress)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_link_and_the_threshold_follow_the_bandwidth() {
        let p = MigrateParams::default();
        // 10 Gbit/s: a 4 KiB page takes 3,276.8 ns; 300 ms carry 91,552 pages.
        assert_eq!(p.wire_ns(1), 3277);
        assert_eq!(p.wire_ns(256), 838_861);
        assert_eq!(p.threshold_pages(), 91_552);
    }

    #[test]
    fn bad_parameters_are_refused_with_what_is_allowed() {
        for (p, want) in [
            (
                MigrateParams {
                    bandwidth_bps: 0,
                    ..Default::default()
                },
                "--bandwidth",
            ),
            (
                MigrateParams {
                    downtime_ns: 0,
                    ..Default::default()
                },
                "--downtime",
            ),
            (
                MigrateParams {
                    working_set_bytes: 2 << 30,
                    ..Default::default()
                },
                "--working-set",
            ),
            (
                MigrateParams {
                    warmup_ns: 150_000_000,
                    ..Default::default()
                },
                "--warmup",
            ),
        ] {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.starts_with(want) && !e.contains('\n'), "{e}");
        }
    }
}
