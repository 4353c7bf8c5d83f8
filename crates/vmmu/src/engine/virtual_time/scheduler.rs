//! The actors of a virtual-time run and their clocks: each vCPU runs its [`GuestCode`] at its
//! own clock, and the VMM thread runs plans at the host's. Everything runs on the calling
//! thread, always the actor whose clock is lowest first, so a run is deterministic.
//!
//! Ordering: an actor runs until it passes the next actor's clock (its horizon): nothing it does
//! before then can be affected by what the others do later. Steps at one picosecond run in
//! vCPU order (the lower index first), whoever was running. A fault or a job that takes
//! `mmu_lock` is granted it in virtual time ([`VirtualLock`]); its work is priced with the
//! meters before and after, so the wait and the hold each land on the right clock.

use super::drift::{Drift, PassStart};
use super::epoch::Epochs;
use super::fast_forward::{FastForward, PrivateCheck};
use super::lock::{Core, Grant, HoldBy, LineCost, VirtualLock, VMM_ACTOR, VMM_CORE};
use super::pricer::{check_cost_model, ps_to_ns, Pricer, Ps};
use super::vm_lines::VmLines;
use super::wall::{Part, WallTimes};
use crate::cost::CostModel;
use crate::engine::EngineError;
use crate::engine::{Engine, GuestAccess, GuestCode, HostThread, TimeSource};
use crate::kvm::host_caches::{Cpu, HostCaches};
use crate::kvm::meter::{Meter, MeterField};
use crate::kvm::mmu::{JobStep, MmuJob, RetPf};
use crate::kvm::mmu_lock::{LockMode, LockStats, WaiterProbe};
use crate::kvm::op_plan::{OpPlan, OpStep};
use crate::kvm::vm_lines::NR_VM_LINES;
use crate::kvm::Kvm;
use crate::units::GfnRange;
use crate::vm::exit::{after_slow_fault, exit_loop, host_fault_resume, locked_half, AccessStep};
use crate::vm::plan::{run_plan_with, PlanPoint};
use crate::vm::vcpu::{AccessExit, Vcpu};
use crate::vm::Vm;
use parking_lot::MutexGuard;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether virtual-time engines made from now on fast-forward
/// ([`VirtualTime::with_fast_forward`]): on unless [`set_fast_forward_default`] turned it off.
static FAST_FORWARD: AtomicBool = AtomicBool::new(true);

/// Sets whether the virtual-time engines this process makes from now on fast-forward (the
/// command line's `--fast-forward on|off`); each may still choose with
/// [`VirtualTime::with_fast_forward`].
pub fn set_fast_forward_default(on: bool) {
    FAST_FORWARD.store(on, Ordering::Relaxed);
}

/// Whether virtual-time engines fast-forward unless told otherwise.
pub fn fast_forward_default() -> bool {
    FAST_FORWARD.load(Ordering::Relaxed)
}

/// The actor number of host thread 0 of [`Engine::run_host_threads`] (thread `i` is this
/// minus `i`): distinct from the VMM thread's and from every vCPU's.
const HOST_THREAD_ACTOR: usize = VMM_ACTOR - 1;

/// The progress oracle's bound: how many steps the engine takes without any clock advancing
/// before it fails the run with every actor's state, instead of hanging. A real run advances
/// some clock within a few steps.
const STALL_LIMIT: u64 = 1 << 20;

/// The progress oracle's bound on a job's chunks in a row that count no work (each runs the
/// vCPUs up to its clock, so fewer are allowed).
const JOB_STALL_LIMIT: u64 = 1 << 16;

/// The progress oracle's count for one loop: steps in a row that made no progress.
struct StallGuard {
    idle: u64,
    limit: u64,
}

impl StallGuard {
    fn new(limit: u64) -> Self {
        StallGuard { idle: 0, limit }
    }

    /// One more step, which `progressed` or not; true once `limit` steps in a row did not.
    fn stalled(&mut self, progressed: bool) -> bool {
        self.idle = if progressed { 0 } else { self.idle + 1 };
        self.idle > self.limit
    }
}

/// One vCPU thread, as an actor.
struct VcpuActor<'a, G> {
    clock: Ps,
    vcpu: MutexGuard<'a, Vcpu>,
    guest: G,
    /// The iteration of the pass in progress, or `None` while outside `KVM_RUN`.
    pass: Option<i64>,
    /// The last iteration whose pass completed.
    completed: i64,
    /// Where it is with its guest's accesses (meaningful while `pass` is `Some`).
    state: VcpuState,
    /// When its CPU's next scheduling-clock interrupt falls ([`Drift::next_tick`]).
    next_tick: Ps,
    /// Its fast-forward guarantee ([`PrivateCheck`]).
    private: PrivateCheck,
    /// DRAM lines its private steps moved in a parallel phase, by socket, until the phase
    /// adds them to the open epoch ([`World::private_phase`]).
    dram_queued: Vec<u64>,
    /// When to try sweeping its guest's reads again ([`Tries::second_level_reads`]).
    sweep: SweepBackoff,
}

/// After a read that could not be swept (a first-level hit, most often: runs shorter than the
/// first level), the next tries wait 1, 2, 4, … up to 64 reads; a sweep starts over at 1.
/// Whether a read is swept or made on its own changes no result, only the time it takes.
#[derive(Clone, Copy)]
struct SweepBackoff {
    /// Reads to make on their own before the next try.
    wait: u8,
    /// What the next failed try waits.
    next: u8,
}

impl Default for SweepBackoff {
    fn default() -> Self {
        SweepBackoff { wait: 0, next: 1 }
    }
}

impl SweepBackoff {
    /// Whether to try now (else one read fewer to wait).
    #[inline]
    fn try_now(&mut self) -> bool {
        if self.wait == 0 {
            return true;
        }
        self.wait -= 1;
        false
    }

    /// The try swept `done` reads.
    #[inline]
    fn tried(&mut self, done: u64) {
        if done > 0 {
            *self = SweepBackoff::default();
        } else {
            self.wait = self.next;
            self.next = (self.next * 2).min(64);
        }
    }
}

/// What the guest does next ([`VcpuActor::guest_next`]).
enum GuestNext {
    /// An access to try now.
    Try(GuestAccess),
    /// The guest computed first: the access waits in [`VcpuState::Retry`] for the clock.
    Computed,
    /// Its `GUEST_SYNC`.
    Sync,
}

/// Where a vCPU in `KVM_RUN` is with its guest's accesses: one state at a time, each holding
/// the access it concerns.
enum VcpuState {
    /// Between accesses: the guest's code says what comes next.
    Guest,
    /// An access whose first try exited, waiting for the clock to allow the exit.
    Exiting(GuestAccess, Result<u64, AccessExit>),
    /// An access whose fault's slow half waits to request `mmu_lock` in this mode at `clock`.
    WaitingForLock(GuestAccess, LockMode),
    /// An access to try (again) when the clock gets there: its fault was handled, or the guest
    /// computed before it.
    Retry(GuestAccess),
    /// An access whose fault waits for the host to fault its page in
    /// ([`AccessStep::HostWork`]): the host's next step runs when the clock gets there.
    HostWork(GuestAccess),
    /// Its last fault found no free host page ([`AccessStep::Stalled`]): with
    /// [`World::park_stalls`] it waits, out of the run, until the host thread beside it has
    /// freed memory (`released`), then re-enters the guest and tries `access` again.
    Stalled {
        /// The access whose fault found no page.
        access: GuestAccess,
        /// The host thread freed memory since: it may run again.
        released: bool,
    },
    /// Out of guest mode with `KVM_EXIT_DIRTY_RING_FULL`, until its ring is reset below the
    /// soft limit ([`World::release_ring_waiters`]).
    RingWait,
    /// The guest reached its `GUEST_SYNC` while running out of turn: the exit waits for the
    /// clock.
    AtSync,
}

impl<G> VcpuActor<'_, G> {
    /// Waiting, out of the run, for the host thread to free memory.
    fn parked(&self) -> bool {
        matches!(
            self.state,
            VcpuState::Stalled {
                released: false,
                ..
            }
        )
    }

    /// Out of guest mode for a full dirty ring.
    fn ring_wait(&self) -> bool {
        matches!(self.state, VcpuState::RingWait)
    }

    /// Its fault has requested `mmu_lock` in a mode that conflicts with `hold`, the mode a job
    /// holds it in now: it waits until the job's hold is known.
    fn blocked_by(&self, hold: Option<LockMode>) -> bool {
        match (hold, &self.state) {
            (Some(held), VcpuState::WaitingForLock(_, wants)) => conflicts(held, *wants),
            _ => false,
        }
    }

    /// Still in `KVM_RUN` and able to act: not parked for memory, not out for a full ring.
    fn active(&self) -> bool {
        self.pass.is_some() && !self.parked() && !self.ring_wait()
    }

    /// Whether its next step is private ([`fast_forward`](super::fast_forward)): an access to
    /// try, or asking its guest for the next one before the next tick and with room in its
    /// dirty ring (a `GUEST_SYNC` the guest answers becomes [`VcpuState::AtSync`]).
    fn next_step_private(&self, kvm: &Kvm, quit: bool) -> bool {
        match self.state {
            VcpuState::Retry(_) => true,
            VcpuState::Guest => {
                self.clock < self.next_tick && (quit || !kvm.dirty_ring_full(self.vcpu.id))
            }
            _ => false,
        }
    }

    /// What the progress oracle says of this vCPU: its clock and its state.
    fn describe(&self) -> String {
        let at = format!("vCPU {} at {} ns", self.vcpu.id, ps_to_ns(self.clock));
        let Some(iteration) = self.pass else {
            return format!("{at} outside KVM_RUN");
        };
        let what = match &self.state {
            VcpuState::RingWait => "out for a full dirty ring".to_string(),
            VcpuState::Stalled {
                released: false, ..
            } => "parked until the host frees memory".to_string(),
            VcpuState::WaitingForLock(a, mode) => format!(
                "requesting mmu_lock ({mode:?}) for a fault on gfn {:#x}",
                a.gfn.0
            ),
            VcpuState::HostWork(a) => {
                format!("in the host's fault on the page of gfn {:#x}", a.gfn.0)
            }
            VcpuState::Exiting(a, _) => format!("exiting on an access to gfn {:#x}", a.gfn.0),
            VcpuState::Retry(a) | VcpuState::Stalled { access: a, .. } => {
                format!("about to retry an access to gfn {:#x}", a.gfn.0)
            }
            VcpuState::Guest => "running guest code".to_string(),
            VcpuState::AtSync => "about to exit at GUEST_SYNC".to_string(),
        };
        format!("{at} in KVM_RUN (iteration {iteration}), {what}")
    }
}

/// Whether a request for `mmu_lock` in mode `wants` must wait while it is held in `held`.
fn conflicts(held: LockMode, wants: LockMode) -> bool {
    held == LockMode::Write || wants == LockMode::Write
}

/// The progress oracle's error: what stopped advancing, then every vCPU's clock and state and
/// the host-side actor's (`host`: who and where).
fn stall_error<G>(
    what: &str,
    actors: &[VcpuActor<'_, G>],
    host: Option<(&str, Ps)>,
) -> EngineError {
    let mut parts: Vec<String> = actors.iter().map(|a| a.describe()).collect();
    if let Some((who, at)) = host {
        parts.push(format!("{who} at {} ns", ps_to_ns(at)));
    }
    EngineError::Stalled(format!(
        "virtual time made no progress ({what}); {}",
        parts.join("; ")
    ))
}

impl<G: GuestCode> VcpuActor<'_, G> {
    /// Asks the guest for its next access. One that computes first moves the clock by that
    /// and waits in [`VcpuState::Retry`]: the access is made when the clock reaches the end of
    /// the computing, in virtual-time order with the other actors.
    fn guest_next(&mut self) -> GuestNext {
        match self.guest.next_access() {
            Some(access) if access.compute_ns > 0 => {
                self.clock += access.compute_ns as Ps * 1000;
                self.state = VcpuState::Retry(access);
                GuestNext::Computed
            }
            Some(access) => GuestNext::Try(access),
            None => GuestNext::Sync,
        }
    }

    /// Where the exit loop left `access`: done, waiting for the lock (the request is made when
    /// this actor's clock comes up), or failed (`KVM_RUN` fails: the vCPU leaves it and runs
    /// no more).
    fn settle(
        &mut self,
        kvm: &Kvm,
        access: GuestAccess,
        step: Result<AccessStep, crate::vm::VmError>,
    ) -> Result<(), EngineError> {
        match step {
            Ok(AccessStep::Done(_)) => self.guest.access_done(&access),
            Ok(AccessStep::Reflected) => self.guest.access_reflected(&access),
            Ok(AccessStep::NeedLock(mode)) => self.state = VcpuState::WaitingForLock(access, mode),
            Ok(AccessStep::Retry) => self.state = VcpuState::Retry(access),
            Ok(AccessStep::HostWork) => self.state = VcpuState::HostWork(access),
            Ok(AccessStep::Stalled) => {
                self.state = VcpuState::Stalled {
                    access,
                    released: false,
                }
            }
            Err(e) => {
                self.vcpu.run_end(kvm);
                self.pass = None;
                return Err(e.into());
            }
        }
        Ok(())
    }
}

/// The core `core` runs on, as the host's caches number them.
fn cache_cpu(caches: &HostCaches, core: Core) -> Cpu {
    match core.actor {
        VMM_ACTOR => caches.vmm_cpu(),
        vcpu if vcpu < caches.nr_vcpus() => caches.vcpu_cpu(vcpu),
        thread => caches.host_thread_cpu(HOST_THREAD_ACTOR - thread),
    }
}

/// The price of one unit of `field`.
fn unit_ps(pricer: &Pricer, field: MeterField) -> Ps {
    let mut c = [0; crate::kvm::meter::NR_METER_FIELDS];
    c[field as usize] = 1;
    pricer.ps(&Meter::default(), &Meter::from_counts(c))
}

/// What every actor shares.
struct World<'a> {
    vm: &'a Vm,
    pricer: Pricer,
    lock: VirtualLock,
    /// Each socket's DRAM bandwidth and the guest's lines in the caches, epoch by epoch.
    epochs: Epochs,
    /// The socket of each vCPU's core (the VMM thread runs on socket 0).
    sockets: Vec<u32>,
    /// The VM-wide lines of MMU state critical sections write.
    vm_lines: VmLines,
    /// The price of one unit of each of [`ACCESS_FIELDS`].
    access_unit_ps: [Ps; ACCESS_FIELDS.len()],
    /// The price of a read that hits the second-level TLB
    /// ([`Vcpu::count_second_level_reads`]), when `fast_access`.
    second_level_read_ps: Ps,
    /// Accesses are tried and priced on their own first (off only to test that it changes
    /// nothing).
    fast_access: bool,
    /// vCPUs start a new pass of the same iteration at each `GUEST_SYNC` (until `quit`).
    background: bool,
    /// The host asked the vCPUs to quit (ends the background passes).
    quit: bool,
    /// vCPUs whose faults found no free host page wait for the host thread beside them to
    /// free some ([`Engine::run_pass_beside`]) instead of retrying.
    park_stalls: bool,
    /// Who runs the plan in progress, for the lock's cache-line hand-offs: the VMM thread, or
    /// one of several host threads ([`Engine::run_host_threads`]).
    plan_actor: Core,
    /// The wake flag of a host thread sleeping beside the vCPUs
    /// ([`Engine::run_pass_beside`]): an exit that raises it stops the vCPUs' run.
    wake: Option<Arc<AtomicBool>>,
    /// The mode a job holds `mmu_lock` in while its work runs ([`World::run_job`]): a vCPU
    /// whose fault requests the lock in a conflicting mode meanwhile waits, its request made,
    /// until the job's hold is known ([`JobWaiterProbe`]).
    job_hold: Option<LockMode>,
    /// A vCPU whose clock stopped in [`World::step`] (the progress oracle), for
    /// [`World::run_vcpus_until`] to report with every actor.
    stalled_vcpu: Option<usize>,
    /// How many times [`World::vcpu_loop`] went on on the pool's threads (tests).
    pool_moves: u64,
    /// Where each vCPU starts a pass, and the tick.
    drift: Drift,
    /// Which vCPUs may run private steps out of turn ([`FastForward`]).
    ff: FastForward,
    /// How many vCPUs the VM has.
    nr_vcpus: usize,
    /// The host's wall time per part of the run, when asked for.
    wall: WallTimes,
}

/// A VM's vCPUs and VMM thread run in virtual time (see the module documentation).
pub struct VirtualTime<'a, G> {
    world: World<'a>,
    actors: Vec<VcpuActor<'a, G>>,
    /// The host's clock: where the last phase ended.
    now: Ps,
    /// Where the host thread beside the vCPUs stopped ([`Engine::run_pass_beside`]).
    host_thread_clock: Ps,
}

/// With `VMMU_ENGINE_TIMES` set, the run's wall clock per part ([`super::wall`]).
impl<G> Drop for VirtualTime<'_, G> {
    fn drop(&mut self) {
        if let Some(line) = self.world.wall.report() {
            let ff = &self.world.ff;
            eprintln!(
                "{line}; {} steps out of turn, {} of them reads and {} writes made in runs",
                ff.out_of_turn, ff.swept_reads, ff.swept_writes
            );
        }
    }
}

impl<'a, G: GuestCode> VirtualTime<'a, G> {
    /// The vCPUs of `vm` (which must have been built with
    /// [`VirtualWaiter`](super::VirtualWaiter)), vCPU `i` running `guests[i]`, priced with
    /// `cost`. Holds every vCPU until dropped.
    pub fn new(vm: &'a Vm, cost: &CostModel, guests: Vec<G>) -> Result<Self, EngineError> {
        check_cost_model(cost)?;
        assert_eq!(guests.len(), vm.nr_vcpus(), "one guest per vCPU");
        let actors = guests
            .into_iter()
            .enumerate()
            .map(|(i, guest)| VcpuActor {
                clock: 0,
                vcpu: {
                    let mut v = vm.vcpu(i);
                    // The guest's lines enter the caches at the end of each epoch.
                    v.guest_lines.get_or_insert_with(Vec::new);
                    v
                },
                guest,
                pass: None,
                completed: -1,
                state: VcpuState::Guest,
                next_tick: Ps::MAX,
                private: PrivateCheck::default(),
                dram_queued: vec![0; cost.host.sockets.max(1) as usize],
                sweep: SweepBackoff::default(),
            })
            .collect();
        // The host's caches, from here on: the MMU's metadata that exists already was allocated
        // by the VMM thread when its memslots were created.
        let sockets = cost.host.vcpu_sockets(vm.nr_vcpus());
        if vm.kvm.caches().is_none()
            && vm.kvm.install_caches(HostCaches::new(
                vm.mmu.host_cache_shape(),
                cost.host.sockets,
                sockets.clone(),
            ))
        {
            let caches = vm.kvm.caches().expect("installed");
            caches.run_on(caches.vmm_cpu());
            vm.mmu.place_metadata(&vm.kvm);
        }
        let pricer = Pricer::new(cost);
        let access_unit_ps = ACCESS_FIELDS.map(|f| unit_ps(&pricer, f));
        let mut read = Meter::default();
        Vcpu::count_second_level_reads(&mut read, 1);
        let second_level_read_ps = pricer.ps(&Meter::default(), &read);
        let line_cost = LineCost::from_cost_model(cost);
        let hz = vm.kvm.tick_hz() as Ps;
        let drift = Drift {
            start: PassStart::Poll { seed: 1 },
            line: line_cost,
            wake: unit_ps(&pricer, MeterField::futex_wakes),
            // One second over HZ; no tick at 0.
            tick: 1_000_000_000_000_u64.checked_div(hz).unwrap_or(0),
        };
        // The cheapest access a guest makes: a read that hits the TLB or one that misses (a
        // miss counts a walk, whatever else it reads), priced as the access path prices them
        // (whole picoseconds only; else no window is taken).
        let min_access_ps = if pricer.is_integral() {
            let read = |m: Meter| pricer.ps(&Meter::default(), &m);
            let hit = Meter {
                tlb_hits: 1,
                guest_reads: 1,
                ..Default::default()
            };
            let miss = Meter {
                hw_walks: 1,
                guest_reads: 1,
                ..Default::default()
            };
            read(hit).min(read(miss))
        } else {
            0
        };
        Ok(VirtualTime {
            world: World {
                vm,
                access_unit_ps,
                second_level_read_ps,
                // Pricing these nine counters is exactly pricing the meter when the unit prices are
                // whole picoseconds; otherwise every access is priced from the meter.
                fast_access: pricer.is_integral(),
                pricer,
                epochs: Epochs::new(
                    cost.host.sockets.max(1) as usize,
                    (64.0 / cost.host.dram_gbps_per_socket * 1000.0).round() as Ps,
                    (cost.host.dram_latency_ns * 1000.0).round() as Ps,
                ),
                sockets,
                vm_lines: VmLines::default(),
                lock: VirtualLock::new(vm.mmu.mmu_lock_kind(), line_cost),
                background: false,
                quit: false,
                plan_actor: VMM_CORE,
                park_stalls: false,
                wake: None,
                job_hold: None,
                stalled_vcpu: None,
                pool_moves: 0,
                drift,
                ff: FastForward::new(fast_forward_default()).with_min_access_ps(min_access_ps),
                nr_vcpus: vm.nr_vcpus(),
                wall: WallTimes::from_env(),
            },
            actors,
            now: 0,
            host_thread_clock: 0,
        })
    }
}

impl<G> VirtualTime<'_, G> {
    /// How the vCPU threads learn that a pass started (memstress's polling, with the run's
    /// seed, unless said otherwise).
    pub fn with_pass_start(mut self, start: PassStart) -> Self {
        self.world.drift.start = start;
        self
    }

    /// Runs private steps out of turn (`on`, the default unless
    /// [`set_fast_forward_default`] said otherwise) or steps every actor in turn (`off`): the
    /// same results ([`fast_forward`](super::fast_forward)).
    pub fn with_fast_forward(mut self, on: bool) -> Self {
        let min = self.world.ff.min_access_ps();
        self.world.ff = FastForward::new(on).with_min_access_ps(min);
        self
    }

    /// Runs private steps out of turn without checking that they are private: wrong on
    /// purpose, for the equivalence tests' negative control.
    #[doc(hidden)]
    pub fn fast_forward_unchecked(mut self) -> Self {
        self.world.ff = FastForward::unchecked();
        self
    }

    /// How many steps ran out of turn so far (tests).
    #[doc(hidden)]
    pub fn steps_out_of_turn(&self) -> u64 {
        self.world.ff.out_of_turn
    }

    /// How many times the vCPUs' loop went on on the pool's threads so far (tests).
    #[doc(hidden)]
    pub fn pool_moves(&self) -> u64 {
        self.world.pool_moves
    }

    /// How many of them were reads made in one step with others of a run (tests).
    #[doc(hidden)]
    pub fn swept_reads(&self) -> u64 {
        self.world.ff.swept_reads
    }

    /// How many were writes made in one step with others of a run (tests).
    #[doc(hidden)]
    pub fn swept_writes(&self) -> u64 {
        self.world.ff.swept_writes
    }

    /// Prices every access from the meters, hits included, instead of at the fixed price of a
    /// hit: the same results, more slowly. For tests of that sameness.
    #[doc(hidden)]
    pub fn price_every_access(mut self) -> Self {
        self.world.fast_access = false;
        self
    }
}

impl<G: GuestCode> Engine for VirtualTime<'_, G> {
    fn name(&self) -> &'static str {
        "virtual"
    }

    fn time_source(&self) -> TimeSource {
        TimeSource::Virtual
    }

    /// Every vCPU makes pass `iteration`, starting now; returns when the last one reaches its
    /// `GUEST_SYNC` (the host sees it then), with the virtual nanoseconds that took.
    fn run_pass(&mut self, iteration: i64) -> Result<u64, EngineError> {
        let start = self.now;
        let wall = self.world.wall.start();
        self.world.start_pass(&mut self.actors, iteration, start);
        let ran = self.world.run_vcpus(&mut self.actors, Ps::MAX, false);
        self.world.wall.add(Part::Passes, wall);
        ran?;
        if self.actors.iter().any(|a| a.ring_wait()) {
            return Err(EngineError::Unsupported(
                "a vCPU's dirty ring is full and nothing reaps it during this pass".into(),
            ));
        }
        debug_assert!(self.actors.iter().all(|a| a.completed == iteration));
        self.now = self.actors.iter().map(|a| a.clock).max().unwrap_or(start);
        Ok(ps_to_ns(self.now - start))
    }

    /// Every vCPU starts making passes of `iteration`, one after another, from now until
    /// [`VirtualTime::stop_vcpus`]; they advance whenever the VMM does.
    fn start_background_passes(&mut self, iteration: i64) {
        self.world.background = true;
        self.world.start_pass(&mut self.actors, iteration, self.now);
    }

    /// `host_quit`: the background passes finish and every vCPU leaves `KVM_RUN` (their work
    /// lands on the vCPUs' clocks; the host's does not move).
    fn stop_vcpus(&mut self) -> Result<(), EngineError> {
        self.world.quit = true;
        self.world.release_ring_waiters(&mut self.actors, self.now);
        let wall = self.world.wall.start();
        let ran = self.world.run_vcpus(&mut self.actors, Ps::MAX, false);
        self.world.wall.add(Part::Passes, wall);
        ran.map(|_| ())
    }

    /// What each vCPU has counted so far.
    fn vcpu_meters(&self) -> Vec<Meter> {
        self.actors.iter().map(|a| a.vcpu.meter.clone()).collect()
    }

    /// The running vCPUs advance to the host's clock plus `ns`, which becomes the host's clock.
    fn elapse(&mut self, ns: u64) -> Result<u64, EngineError> {
        let until = ns
            .checked_mul(1000)
            .and_then(|ps| self.now.checked_add(ps))
            .ok_or_else(|| {
                EngineError::Unsupported(
                    "virtual time would pass 2^64 ps (213 days); use a shorter run".into(),
                )
            })?;
        // Rings reset by the plans the VMM ran before this let their vCPUs in again now.
        self.world.release_ring_waiters(&mut self.actors, self.now);
        let wall = self.world.wall.start();
        let ran = self.world.run_vcpus(&mut self.actors, until, false);
        self.world.wall.add(Part::Passes, wall);
        ran?;
        self.now = until;
        Ok(ns)
    }

    /// The VMM thread runs `plans` in order at the host's clock; returns the virtual nanoseconds
    /// they took.
    ///
    /// Before each step the running vCPUs (background passes) are advanced up to the VMM's
    /// clock; a job holds `mmu_lock` in virtual time from its grant for as long as its work
    /// costs. At each of the job's yield points (`rwlock_needbreak()`) the vCPUs are advanced
    /// to the job's clock there (the engine's waiter probe): a fault among them that asked for the
    /// lock in a conflicting mode waits, and the job yields (`cond_resched_rwlock_*()`, counted
    /// in `lock_yields`); the fault is granted the lock when the job releases it, and the job
    /// re-queues behind it. A vCPU that only hits its TLB never makes a job yield.
    fn run_plans(&mut self, plans: Vec<OpPlan>) -> Result<u64, EngineError> {
        let start = self.now;
        let mut clock = self.now;
        let wall = self.world.wall.start();
        let ran: Result<(), EngineError> = plans.into_iter().try_for_each(|plan| {
            let meter = self.run_plan_at(plan, &mut clock)?;
            self.world.vm.add_vmm_meter(&meter);
            Ok(())
        });
        self.world.wall.add(Part::Plans, wall);
        ran?;
        self.now = clock;
        Ok(ps_to_ns(self.now - start))
    }

    /// Every vCPU makes pass `iteration` while `host` runs beside them from now: its plans run
    /// at its own clock as the VMM's do ([`VirtualTime::run_plans`]); while it sleeps, the
    /// vCPUs run until one of them wakes it (an exit that raised its wake flag), and it goes on
    /// from that vCPU's clock. Returns when the last vCPU reaches its `GUEST_SYNC`.
    fn run_pass_beside(
        &mut self,
        iteration: i64,
        host: &mut dyn HostThread,
    ) -> Result<u64, EngineError> {
        let start = self.now;
        let wall = self.world.wall.start();
        self.world.start_pass(&mut self.actors, iteration, start);
        let mut clock = start.max(self.host_thread_clock);
        self.world.park_stalls = true;
        let r = self.beside_loop(host, &mut clock);
        self.world.park_stalls = false;
        self.world.wall.add(Part::Passes, wall);
        r?;
        self.host_thread_clock = clock;
        self.now = self.actors.iter().map(|a| a.clock).max().unwrap_or(start);
        Ok(ps_to_ns(self.now - start))
    }

    /// The host threads run from now, each at its own clock, the one whose clock is lowest
    /// first, until each has no plan left; any vCPUs in a background pass go on meanwhile.
    /// Thread `i` runs on vCPU `i`'s socket (the selftests run such work on the vCPU threads).
    ///
    /// Simplified: a thread is picked by the clock its plan starts at and the whole plan runs
    /// then, so a job that follows lockless steps in the plan requests `mmu_lock` up to those
    /// steps' cost (a few hundred ns for page_idle's system calls and rmap walk) later than
    /// another thread's request it was ordered before. `VirtualLock` grants in request order,
    /// so such a request can queue behind a later one; splitting plans at every job would
    /// order them exactly, at a cost in simulation speed.
    fn run_host_threads(
        &mut self,
        threads: &mut [&mut (dyn HostThread + Send)],
    ) -> Result<u64, EngineError> {
        let start = self.now;
        let mut clocks = vec![start; threads.len()];
        let wall = self.world.wall.start();
        let ran = self.host_thread_plans(threads, &mut clocks);
        self.world.wall.add(Part::Plans, wall);
        ran?;
        self.now = clocks.into_iter().max().unwrap_or(start).max(start);
        Ok(ps_to_ns(self.now - start))
    }
}

impl<G: GuestCode> VirtualTime<'_, G> {
    /// The loop of [`Engine::run_pass_beside`]: the host thread's plans at `clock`; while it
    /// sleeps, the vCPUs until one wakes it. vCPUs stalled for memory rejoin, at the host
    /// thread's clock, after a plan that left free memory above the min watermark.
    fn beside_loop(
        &mut self,
        host: &mut dyn HostThread,
        clock: &mut Ps,
    ) -> Result<(), EngineError> {
        let kvm = &*self.world.vm.kvm;
        let memory_free = || {
            kvm.host_mm
                .get()
                .is_none_or(|mm| mm.free_pages() > mm.watermarks.min)
        };
        // The progress oracle: turns of this loop in which neither a vCPU's clock nor the host
        // thread's moved.
        let (mut guard, mut seen) = (StallGuard::new(STALL_LIMIT), None);
        while self.actors.iter().any(|a| a.pass.is_some()) {
            let time = self
                .actors
                .iter()
                .fold(*clock, |t, a| t.wrapping_add(a.clock));
            if guard.stalled(seen != Some(time)) {
                return Err(stall_error(
                    &format!("neither the vCPUs nor the host thread beside them advanced in {STALL_LIMIT} turns"),
                    &self.actors,
                    Some(("the host thread", *clock)),
                ));
            }
            seen = Some(time);
            if let Some(plan) = host.next_plan(kvm) {
                let t0 = *clock;
                let meter = self.run_plan_at(plan, clock)?;
                host.plan_done(ps_to_ns(*clock - t0), &meter);
                if memory_free() {
                    for a in self.actors.iter_mut().filter(|a| a.parked()) {
                        if let VcpuState::Stalled { released, .. } = &mut a.state {
                            *released = true;
                        }
                        a.clock = a.clock.max(*clock);
                    }
                }
                continue;
            }
            if self.actors.iter().any(|a| a.ring_wait()) {
                return Err(EngineError::Unsupported(
                    "a vCPU's dirty ring is full and nothing reaps it beside the vCPUs".into(),
                ));
            }
            if self
                .actors
                .iter()
                .filter(|a| a.pass.is_some())
                .all(|a| a.parked())
            {
                return Err(EngineError::Stalled(
                    "the host ran out of memory: every vCPU waits for a free page and kswapd found nothing left to reclaim"
                        .into(),
                ));
            }
            // Asleep: the vCPUs run until one wakes the thread, which starts at its clock.
            self.world.wake = Some(host.wake_flag());
            let woke = self
                .world
                .run_vcpus_until(&mut self.actors, Ps::MAX, false, true);
            self.world.wake = None;
            if let Some(at) = woke?.1 {
                *clock = (*clock).max(at);
            }
        }
        Ok(())
    }

    /// [`Engine::run_host_threads`]'s loop: the thread whose clock (in `clocks`) is lowest runs
    /// its next plan, until none has one left.
    fn host_thread_plans(
        &mut self,
        threads: &mut [&mut (dyn HostThread + Send)],
        clocks: &mut [Ps],
    ) -> Result<(), EngineError> {
        let kvm = &*self.world.vm.kvm;
        let mut live = vec![true; threads.len()];
        let sockets = self.world.sockets.clone();
        while let Some(i) = (0..threads.len())
            .filter(|&i| live[i])
            .min_by_key(|&i| (clocks[i], i))
        {
            let Some(plan) = threads[i].next_plan(kvm) else {
                live[i] = false;
                continue;
            };
            let t0 = clocks[i];
            self.world.plan_actor = Core {
                actor: HOST_THREAD_ACTOR - i,
                socket: sockets[i % sockets.len().max(1)],
            };
            let meter = self.run_plan_at(plan, &mut clocks[i]);
            self.world.plan_actor = VMM_CORE;
            threads[i].plan_done(ps_to_ns(clocks[i] - t0), &meter?);
        }
        Ok(())
    }

    /// Runs `plan` at `clock` as the actor `world.plan_actor`, which ends where the plan did (see
    /// [`VirtualTime::run_plans`]); returns what it counted.
    fn run_plan_at(&mut self, plan: OpPlan, clock: &mut Ps) -> Result<Meter, EngineError> {
        let vm = self.world.vm;
        let kvm = &*vm.kvm;
        // A vCPU waiting for host memory holds SRCU until kswapd frees some (Linux's task would
        // be reclaiming directly, and synchronize_srcu() would wait for it): not modelled.
        if self.actors.iter().any(|a| a.parked())
            && plan.steps.iter().any(|s| matches!(s, OpStep::SyncSrcu))
        {
            return Err(EngineError::Unsupported("synchronize_srcu() while a vCPU waits for host memory is not modelled; run the VMM's memslot changes when no vCPU is short of memory".into()));
        }
        let state = RefCell::new((
            &mut self.world,
            &mut self.actors[..],
            &mut *clock,
            None::<EngineError>,
        ));
        let mut meter = Meter::default();
        let mut step_start = (0, Meter::default());
        run_plan_with(
            kvm,
            plan,
            &mut meter,
            &mut |point, m| {
                let mut st = state.borrow_mut();
                let (world, actors, clock, err) = &mut *st;
                match point {
                    // After a failure the plan only runs out: no vCPU runs again.
                    PlanPoint::Before(_) | PlanPoint::BeforeSrcuSync if err.is_some() => {}
                    PlanPoint::Before(_) | PlanPoint::BeforeSrcuSync => {
                        // synchronize_srcu() waits for the faults in flight to finish.
                        let sync = point == PlanPoint::BeforeSrcuSync;
                        match world.run_vcpus(actors, **clock, sync) {
                            Ok(end) => **clock = (**clock).max(end),
                            Err(e) => {
                                err.get_or_insert(e);
                            }
                        }
                        world.close_epochs(actors, **clock);
                        // The VMM's step is global: it may change what any vCPU's access does.
                        world.ff.global_step();
                        // The step runs on the plan's own core, whichever vCPU ran last.
                        if let Some(caches) = kvm.caches() {
                            caches.run_on(cache_cpu(caches, world.plan_actor));
                        }
                        step_start = (**clock, m.clone());
                    }
                    // Jobs account for themselves below.
                    PlanPoint::After(Some(_)) => {}
                    PlanPoint::After(None) => **clock += world.pricer.ps(&step_start.1, m),
                }
            },
            &mut |kvm: &Kvm, job: &mut dyn MmuJob, meter: &mut Meter| {
                let mut st = state.borrow_mut();
                let (world, actors, clock, err) = &mut *st;
                world.run_job(actors, clock, err, kvm, job, meter)
            },
        );
        match state.into_inner().3 {
            Some(e) => Err(e),
            None => Ok(meter),
        }
    }
}

/// The running actors by `(clock, index)`, least first: a binary min-heap whose least entry is
/// replaced in place after each step (one sift instead of a pop and a push), and whose next
/// least clock (the running actor's horizon) is one of the root's two children. Ties go to the
/// lower index, so the order is the same as any other min-heap's over these keys.
struct ActorHeap {
    h: Vec<(Ps, usize)>,
}

impl ActorHeap {
    fn new(mut h: Vec<(Ps, usize)>) -> Self {
        h.sort_unstable();
        ActorHeap { h }
    }

    fn min(&self) -> Option<(Ps, usize)> {
        self.h.first().copied()
    }

    /// The second least entry.
    fn second_min(&self) -> Option<(Ps, usize)> {
        match (self.h.get(1), self.h.get(2)) {
            (Some(&a), Some(&b)) => Some(a.min(b)),
            (Some(&a), None) => Some(a),
            _ => None,
        }
    }

    /// The last clock at which actor `i`, the least, may still step before the second least
    /// actor: steps run in `(clock, index)` order, so at the second's very clock only an actor
    /// of lower index goes first. That makes the order of two steps at one picosecond the
    /// same however the actors got there (in turn, or in a fast-forward phase that ended
    /// there), which the equivalence of `--fast-forward on` and `off` rests on.
    fn horizon(&self, i: usize) -> Option<Ps> {
        self.second_min()
            .map(|(t, j)| if i < j { t } else { t.saturating_sub(1) })
    }

    fn replace_min(&mut self, key: (Ps, usize)) {
        self.h[0] = key;
        self.sift_down(0);
    }

    fn pop_min(&mut self) {
        let last = self.h.pop().expect("not empty");
        if !self.h.is_empty() {
            self.h[0] = last;
            self.sift_down(0);
        }
    }

    fn sift_down(&mut self, mut k: usize) {
        let n = self.h.len();
        loop {
            let (l, r) = (2 * k + 1, 2 * k + 2);
            let mut m = k;
            if l < n && self.h[l] < self.h[m] {
                m = l;
            }
            if r < n && self.h[r] < self.h[m] {
                m = r;
            }
            if m == k {
                return;
            }
            self.h.swap(k, m);
            k = m;
        }
    }
}

/// The counters a guest access can change until it completes or exits: hits, walks (and the
/// PML write of a walk that sets a Dirty flag), and the access itself. What happens after an exit is counted elsewhere.
const ACCESS_FIELDS: [MeterField; 10] = [
    MeterField::pml_logged,
    MeterField::guest_remote_lines,
    MeterField::tlb_hits,
    MeterField::tlb_l2_hits,
    MeterField::hw_walks,
    MeterField::hw_walk_levels,
    MeterField::s1_walk_levels,
    MeterField::s1_table_s2_levels,
    MeterField::guest_reads,
    MeterField::guest_writes,
];

/// Which of the [`ACCESS_FIELDS`] (by index) a run of writes changes ([`Vcpu::write_run`]):
/// its walks and their leaf levels, the PML writes of those that set a Dirty flag, the writes
/// and their lines from another socket's memory. The others stay as they are through a run
/// (checked in debug builds), so its writes' prices are differences of these alone.
const WRITE_RUN_FIELDS: [usize; 5] = [0, 1, 4, 5, 9];
const _: () = assert!(
    matches!(ACCESS_FIELDS[0], MeterField::pml_logged)
        && matches!(ACCESS_FIELDS[1], MeterField::guest_remote_lines)
        && matches!(ACCESS_FIELDS[4], MeterField::hw_walks)
        && matches!(ACCESS_FIELDS[5], MeterField::hw_walk_levels)
        && matches!(ACCESS_FIELDS[9], MeterField::guest_writes),
    "WRITE_RUN_FIELDS names its fields by their places in ACCESS_FIELDS"
);

/// The [`ACCESS_FIELDS`] of `m`.
#[inline]
fn access_counts(m: &Meter) -> [u64; ACCESS_FIELDS.len()] {
    [
        m.pml_logged,
        m.guest_remote_lines,
        m.tlb_hits,
        m.tlb_l2_hits,
        m.hw_walks,
        m.hw_walk_levels,
        m.s1_walk_levels,
        m.s1_table_s2_levels,
        m.guest_reads,
        m.guest_writes,
    ]
}

/// `lines` DRAM lines a private step moved from socket `socket`'s memory, queued in a vCPU's
/// [`VcpuActor::dram_queued`] (the last entry stands for any socket beyond it).
#[inline]
fn queue_dram(queued: &mut [u64], socket: usize, lines: u64) {
    let last = queued.len() - 1;
    queued[socket.min(last)] += lines;
}

/// Which actors a [`World::run_vcpus_until`] runs: those in a pass, not waiting on their
/// dirty ring, not parked (when `park`), not queued behind the VMM's job holding `mmu_lock` in
/// a conflicting mode (`hold`), and either before `until` or, with `flush_faults`, inside a
/// fault.
#[derive(Copy, Clone)]
struct Runnable {
    park: bool,
    hold: Option<LockMode>,
    until: Ps,
    flush_faults: bool,
}

impl Runnable {
    /// Whether `a` runs.
    #[inline]
    fn runs<G: GuestCode>(&self, a: &VcpuActor<'_, G>) -> bool {
        let out = a.pass.is_none() || a.ring_wait() || (self.park && a.parked());
        let in_fault = matches!(
            a.state,
            VcpuState::WaitingForLock(..) | VcpuState::HostWork(_)
        );
        !out && !a.blocked_by(self.hold)
            && (a.clock < self.until || (self.flush_faults && in_fault))
    }

    /// The actors that run, by clock.
    fn heap<G: GuestCode>(&self, actors: &[VcpuActor<'_, G>]) -> ActorHeap {
        ActorHeap::new(
            actors
                .iter()
                .enumerate()
                .filter(|(_, a)| self.runs(a))
                .map(|(i, a)| (a.clock, i))
                .collect(),
        )
    }
}

/// What private runs did ([`Tries::private_run`]), added up over a phase's vCPUs.
#[derive(Copy, Clone, Default)]
struct PhaseSteps {
    /// Steps run.
    steps: u64,
    /// Of those, reads made in one step with others of a run.
    swept: u64,
    /// And writes made in one step with others of a run.
    written: u64,
    /// vCPUs that ran.
    running: usize,
}

impl std::ops::Add for PhaseSteps {
    type Output = PhaseSteps;

    fn add(self, o: PhaseSteps) -> PhaseSteps {
        PhaseSteps {
            steps: self.steps + o.steps,
            swept: self.swept + o.swept,
            written: self.written + o.written,
            running: self.running + o.running,
        }
    }
}

/// What a guest access's first try reads of the world, and nothing it writes: one copy serves
/// every thread of a parallel private phase ([`World::private_phase`]).
struct Tries<'w> {
    pricer: &'w Pricer,
    access_unit_ps: &'w [Ps; ACCESS_FIELDS.len()],
    fast_access: bool,
    /// The price of a read that hits the second-level TLB
    /// ([`Vcpu::count_second_level_reads`]), when `fast_access`.
    second_level_read_ps: Ps,
    epochs: &'w Epochs,
    sockets: &'w [u32],
    quit: bool,
    ff: &'w FastForward,
}

impl Tries<'_> {
    /// The first try of `access` by `a` at its clock: a TLB hit or a walk that translates
    /// completes here, priced from the few counters it can change (the same picoseconds as
    /// pricing the whole meter), and the clock moves by that and the DRAM wait; the guest
    /// hears of a completed access, and an exit waits in [`VcpuState::Exiting`]. Returns the
    /// DRAM lines it moved and the socket whose memory they come from, for the caller to add
    /// to the open epoch.
    #[inline]
    fn first_try<G: GuestCode>(
        &self,
        kvm: &Kvm,
        mmu: &dyn crate::kvm::mmu::Mmu,
        a: &mut VcpuActor<'_, G>,
        access: GuestAccess,
    ) -> Option<(usize, u64)> {
        let v = &mut *a.vcpu;
        let (start, lines) = (a.clock, v.meter.dram_lines);
        let first = if self.fast_access {
            let before = access_counts(&v.meter);
            let r = v.try_op(kvm, mmu, &access);
            a.clock += self.access_price(&before, &access_counts(&v.meter));
            r
        } else {
            let before = v.meter.clone();
            let r = v.try_op(kvm, mmu, &access);
            a.clock += self.pricer.ps(&before, &v.meter);
            r
        };
        let moved = v.meter.dram_lines - lines;
        let home = v.dram_socket.take();
        let queued = self.dram_wait(&mut a.clock, &mut v.meter, v.id, home, start, moved);
        match first {
            Ok(_) => a.guest.access_done(&access),
            Err(_) => a.state = VcpuState::Exiting(access, first),
        }
        queued
    }

    /// The DRAM wait of an access of vCPU `vcpu` that started at `start` and fetched `moved`
    /// lines (none: no wait) from the memory of socket `home` (the vCPU's own when `None`; it
    /// is another only where the host's caches place guest pages: `Vcpu::dram_socket`): moves
    /// `clock` by it and counts it in `meter`. Returns the socket and the lines, for the
    /// caller to add to the open epoch.
    #[inline]
    fn dram_wait(
        &self,
        clock: &mut Ps,
        meter: &mut Meter,
        vcpu: usize,
        home: Option<u32>,
        start: Ps,
        moved: u64,
    ) -> Option<(usize, u64)> {
        if moved == 0 {
            return None;
        }
        let socket = home.unwrap_or(self.sockets[vcpu]) as usize;
        let wait = self.epochs.dram_backlog_wait(socket, start);
        meter.dram_stall_ns += ps_to_ns(wait);
        *clock += wait;
        Some((socket, moved))
    }

    /// `a`'s private steps from its clock up to `limit`, stopping before its first step that
    /// is not private (an exit waits in [`VcpuState::Exiting`], a `GUEST_SYNC` in
    /// [`VcpuState::AtSync`]); the DRAM lines they moved go to `a.dram_queued`. Reads of a
    /// run that hit the second-level TLB go in one step ([`Tries::second_level_reads`]), and
    /// so do writes of a run that miss it ([`Tries::missing_writes`]). Returns how many steps
    /// ran, and how many of them were such reads and such writes.
    fn private_run<G: GuestCode>(
        &self,
        kvm: &Kvm,
        mmu: &dyn crate::kvm::mmu::Mmu,
        a: &mut VcpuActor<'_, G>,
        limit: Ps,
    ) -> PhaseSteps {
        let (mut steps, mut swept, mut written) = (0, 0, 0);
        while a.clock < limit && a.next_step_private(kvm, self.quit) {
            if let Some(done) = self.second_level_reads(kvm, a, limit) {
                steps += done;
                swept += done;
                continue;
            }
            if let Some(done) = self.missing_writes(kvm, mmu, a, limit) {
                steps += done;
                written += done;
                continue;
            }
            steps += 1;
            let access = match std::mem::replace(&mut a.state, VcpuState::Guest) {
                VcpuState::Retry(access) => access,
                _ => match a.guest_next() {
                    GuestNext::Computed => continue,
                    GuestNext::Sync => {
                        a.state = VcpuState::AtSync;
                        break;
                    }
                    GuestNext::Try(access) => access,
                },
            };
            if a.private.leaves_window(self.ff, access.gfn) {
                // Not before the window limit, which ends the phase first, unless the guest's
                // bound is wrong (the tests' negative control): the access waits for its turn,
                // where the vCPU gives its guarantee up.
                a.state = VcpuState::Retry(access);
                break;
            }
            if let Some((socket, lines)) = self.first_try(kvm, mmu, a, access) {
                queue_dram(&mut a.dram_queued, socket, lines);
            }
        }
        PhaseSteps {
            steps,
            swept,
            written,
            running: 1,
        }
    }

    /// The writes `a`'s guest announced next ([`GuestCode::ascending_writes`]) that miss the
    /// TLB within one 2 MiB region, through the walk entries the TLB holds for it
    /// ([`Vcpu::write_run`]), made in one step while each starts before `limit` (and the
    /// vCPU's next tick), as the steps of [`Tries::private_run`] would make them one by one:
    /// each priced from what it counted, with the DRAM wait of its socket, its lines queued
    /// for the open epoch. Returns how many, or `None` when it made none (the next access goes
    /// one by one: the first in a region loads the walk entries the next ones use).
    #[inline]
    fn missing_writes<G: GuestCode>(
        &self,
        kvm: &Kvm,
        mmu: &dyn crate::kvm::mmu::Mmu,
        a: &mut VcpuActor<'_, G>,
        limit: Ps,
    ) -> Option<u64> {
        if !self.fast_access || !matches!(a.state, VcpuState::Guest) {
            return None;
        }
        let run = a.guest.ascending_writes()?;
        // The run's gfns rise: it stays in the window below the first one at its end.
        let len = match a.private.window_end(self.ff) {
            Some(end) => run.len.min(end.0.saturating_sub(run.first.0)),
            None => run.len,
        };
        if len < 2 {
            return None;
        }
        let end = limit.min(a.next_tick);
        let id = a.vcpu.id;
        // In debug builds, the price's other fields, to check they stay as they are.
        let unchanged = |m: &Meter| {
            let mut counts = access_counts(m);
            for i in WRITE_RUN_FIELDS {
                counts[i] = 0;
            }
            counts
        };
        let others = cfg!(debug_assertions).then(|| unchanged(&a.vcpu.meter));
        let mut before = self.write_run_total(&a.vcpu.meter);
        let mut lines = a.vcpu.meter.dram_lines;
        let (clock, queued) = (&mut a.clock, &mut a.dram_queued);
        let done = a
            .vcpu
            .write_run(kvm, mmu, run.first, len, run.value, &mut |meter, home| {
                // As first_try() prices and waits for one access.
                let start = *clock;
                let after = self.write_run_total(meter);
                *clock += after.wrapping_sub(before);
                before = after;
                let moved = meter.dram_lines - lines;
                lines = meter.dram_lines;
                if let Some((socket, moved)) = self.dram_wait(clock, meter, id, home, start, moved)
                {
                    queue_dram(queued, socket, moved);
                }
                *clock < end
            });
        debug_assert!(
            others.is_none_or(|o| o == unchanged(&a.vcpu.meter)),
            "a run of writes changed a price's field other than WRITE_RUN_FIELDS"
        );
        if done == 0 {
            return None;
        }
        a.guest.skip_accesses(done);
        Some(done)
    }

    /// The reads `a`'s guest announced next ([`GuestCode::descending_reads`]) that hit the
    /// second-level TLB, made in one step while each starts before `limit` (and the vCPU's
    /// next tick), as the steps of [`Tries::private_run`] would make them one by one: each at
    /// the same price, none moving a DRAM line or changing anything another vCPU sees.
    /// Returns how many, or `None` when it made none (the next access goes one by one).
    #[inline]
    fn second_level_reads<G: GuestCode>(
        &self,
        kvm: &Kvm,
        a: &mut VcpuActor<'_, G>,
        limit: Ps,
    ) -> Option<u64> {
        if !self.fast_access || !matches!(a.state, VcpuState::Guest) {
            return None;
        }
        let run = a.guest.descending_reads()?;
        // The highest gfn comes first: the run leaves the window no sooner than its first
        // read does.
        if run.len < 2 || a.private.leaves_window(self.ff, run.first) || !a.sweep.try_now() {
            return None;
        }
        let end = limit.min(a.next_tick);
        let p = self.second_level_read_ps;
        let fit = match p {
            0 => run.len,
            p => (end - a.clock).div_ceil(p).min(run.len),
        };
        let done = a.vcpu.second_level_read_run(kvm, run.first, fit);
        a.sweep.tried(done);
        if done == 0 {
            return None;
        }
        a.clock += done * p;
        a.guest.skip_accesses(done);
        Some(done)
    }

    /// What the [`WRITE_RUN_FIELDS`] of `m` come to at their unit prices, modulo 2^64. Prices
    /// are linear in the counts, and a run of writes changes no other field of the
    /// [`ACCESS_FIELDS`], so the price of what one of its writes counted is the difference of
    /// this before and after it (a wrapping subtraction, exact since that price fits a
    /// [`Ps`]): a run keeps one total instead of its counters.
    #[inline]
    fn write_run_total(&self, m: &Meter) -> Ps {
        let counts = access_counts(m);
        WRITE_RUN_FIELDS.iter().fold(0, |ps: Ps, &i| {
            ps.wrapping_add(counts[i].wrapping_mul(self.access_unit_ps[i]))
        })
    }

    /// The price of what an access counted between `before` and `after` (its
    /// [`ACCESS_FIELDS`]): [`Pricer::ps`] of the same difference, since it is used only when
    /// the cost model's unit prices are whole picoseconds (the defaults), where prices add up
    /// exactly.
    #[inline]
    fn access_price(
        &self,
        before: &[u64; ACCESS_FIELDS.len()],
        after: &[u64; ACCESS_FIELDS.len()],
    ) -> Ps {
        let mut ps = 0;
        for i in 0..ACCESS_FIELDS.len() {
            ps += (after[i] - before[i]) * self.access_unit_ps[i];
        }
        ps
    }
}

impl World<'_> {
    /// Starts pass `iteration` on every vCPU after `now`, when the host published it: each
    /// re-enters `KVM_RUN` when it notices, in the order and at the spacing the pass's start
    /// mechanism gives ([`Drift::start_times`]).
    fn start_pass<G: GuestCode>(
        &mut self,
        actors: &mut [VcpuActor<'_, G>],
        iteration: i64,
        now: Ps,
    ) {
        let kvm = &*self.vm.kvm;
        if self.drift.start == PassStart::Semaphore {
            // The host's sem_post()s, one per vCPU thread.
            self.vm.add_vmm_meter(&Meter {
                futex_wakes: actors.len() as u64,
                ..Default::default()
            });
        }
        // A new pass may keep to other gfns: every guarantee ends.
        self.ff.global_step();
        let finished: Vec<Ps> = actors.iter().map(|a| a.clock).collect();
        let vmm_socket = self.sockets.first().copied().unwrap_or(0);
        let starts = self
            .drift
            .start_times(iteration, now, &finished, |i| self.sockets[i] != vmm_socket);
        for (a, start) in actors.iter_mut().zip(starts) {
            a.clock = a.clock.max(start);
            a.next_tick = self.drift.next_tick(a.clock);
            let v = &mut *a.vcpu;
            let before = v.meter.clone();
            v.run_begin(kvm);
            v.enter_guest(kvm);
            a.clock += self.pricer.ps(&before, &v.meter);
            a.guest.start_pass(iteration);
            a.pass = Some(iteration);
        }
    }

    /// The scheduling-clock interrupts that fell due on `a`'s CPU by its clock: each an exit,
    /// the handler (and the timekeeping on vCPU 0's CPU) and an entry, at the vCPU's next guest
    /// access.
    fn take_ticks<G>(&self, a: &mut VcpuActor<'_, G>) {
        let kvm = &*self.vm.kvm;
        let n = (a.clock - a.next_tick) / self.drift.tick + 1;
        let v = &mut *a.vcpu;
        let before = v.meter.clone();
        v.exit_guest(kvm);
        v.meter.host_ticks += n;
        if v.id == 0 {
            v.meter.jiffies_updates += n;
        }
        v.enter_guest(kvm);
        a.clock += self.pricer.ps(&before, &v.meter);
        a.next_tick = self.drift.next_tick(a.clock);
    }

    /// Runs vCPU actors in virtual-time order until none has work left before `until`. With
    /// `flush_faults` (the VMM is about to `synchronize_srcu()`, which waits for them), a vCPU
    /// inside a fault's slow half finishes it even at or past `until`; returns the latest clock
    /// such a fault ended at (0 if none), where the grace period ends.
    fn run_vcpus<G: GuestCode>(
        &mut self,
        actors: &mut [VcpuActor<'_, G>],
        until: Ps,
        flush_faults: bool,
    ) -> Result<Ps, EngineError> {
        self.run_vcpus_until(actors, until, flush_faults, false)
            .map(|(flushed_end, _)| flushed_end)
    }

    /// [`World::run_vcpus`]; with `stop_on_wake`, it also stops as soon as a vCPU's exit
    /// raised [`World::wake`], and returns that vCPU's clock second.
    fn run_vcpus_until<G: GuestCode>(
        &mut self,
        actors: &mut [VcpuActor<'_, G>],
        until: Ps,
        flush_faults: bool,
        stop_on_wake: bool,
    ) -> Result<(Ps, Option<Ps>), EngineError> {
        let runnable = Runnable {
            park: self.park_stalls,
            hold: self.job_hold,
            until,
            flush_faults,
        };
        let heap = runnable.heap(actors);
        self.vcpu_loop(actors, runnable, stop_on_wake, heap, 0)
    }

    /// The loop of [`World::run_vcpus_until`], from where it stands: `heap` holds the running
    /// actors by clock, and `flushed_end` the latest clock a flushed fault ended at so far.
    fn vcpu_loop<G: GuestCode>(
        &mut self,
        actors: &mut [VcpuActor<'_, G>],
        runnable: Runnable,
        stop_on_wake: bool,
        mut heap: ActorHeap,
        mut flushed_end: Ps,
    ) -> Result<(Ps, Option<Ps>), EngineError> {
        let Runnable {
            until,
            flush_faults,
            ..
        } = runnable;
        let runs = |a: &VcpuActor<'_, G>| runnable.runs(a);
        while let Some((t, i)) = heap.min() {
            // Every running actor has reached `t`: the shared resources' epochs before it
            // close (a fault finishing past `until` closes none past `until`).
            self.close_epochs(actors, t.min(until));
            // While parallel phases run on the host's cores, the loop goes on on one of the
            // pool's threads, from here, so that each phase forks from a worker (rayon's
            // `join`: the other workers steal) instead of being injected from outside the pool
            // with this thread asleep until it ends. `dirty-log -v 64 -b 1G -s
            // anonymous_hugetlb_1gb --eager-split on -i 2` (20,000 phases): 105,200 context
            // switches before, 10,800 after (`perf stat`). Only then: the move costs a
            // wake-up of its own, and the many short calls of the VMM's steps beside
            // background passes paid it for nothing (a soak of small runs took 6× longer).
            // The iteration starts again there, where closing the epochs up to `t` again
            // does nothing.
            if self.ff.phase_on_cores()
                && self.ff.phase_due(self.epochs.open())
                && rayon::current_thread_index().is_none()
            {
                self.pool_moves += 1;
                return rayon::scope(|_| {
                    self.vcpu_loop(actors, runnable, stop_on_wake, heap, flushed_end)
                });
            }
            // Fast-forward: once per epoch while vCPUs hold their guarantees (less often while
            // phases find little to run), the private steps of every running vCPU that holds
            // one run at once, up to the VMM's next step, the epoch's end, the first clock at
            // which a running vCPU that holds none acts (every step of its comes after theirs,
            // as in turn), and the earliest any vCPU can leave its window; the steps that are
            // not private then run in turn as before. The vCPU with the least clock must hold
            // one, or none can run before it.
            if self.ff.any_private()
                && self.ff.phase_due(self.epochs.open())
                && t < until
                && self.ff.may_run(&actors[i].private)
            {
                let ff = &self.ff;
                let mut bound = None::<Ps>;
                let mut unheld = Ps::MAX;
                // A vCPU out of its pass acts again only when the VMM starts the next one.
                for a in actors.iter().filter(|a| a.pass.is_some()) {
                    if !ff.may_run(&a.private) {
                        if runs(a) {
                            unheld = unheld.min(a.clock);
                        }
                        continue;
                    }
                    let pending = match &a.state {
                        VcpuState::Retry(access) => Some(access.gfn),
                        _ => None,
                    };
                    if let Some(b) = a.private.window_bound(ff, &a.guest, a.clock, pending) {
                        bound = Some(bound.map_or(b, |x| x.min(b)));
                    }
                }
                self.ff.renew_window_limit(bound);
                let full = until.min(self.epochs.open_end());
                let limit = full.min(self.ff.window_limit()).min(unheld);
                if t < limit && self.private_phase(actors, runs, limit, limit < full) > 0 {
                    heap = runnable.heap(actors);
                    continue;
                }
            }
            // Run this actor until it passes the next actor's clock: nothing it does before
            // then can be affected by what the others do later. Its turn ends with the open
            // epoch too, which closes only once every actor has reached its end.
            // A step starting at `until` itself runs after the VMM's step there, as a
            // private one does.
            let horizon = heap
                .horizon(i)
                .map_or(until, |t| t.min(until))
                .min(until.saturating_sub(1))
                .min(self.epochs.open_end() - 1);
            let flushing = actors[i].clock >= until;
            self.step(&mut actors[i], horizon, until, flush_faults)?;
            if let Some(id) = self.stalled_vcpu.take() {
                return Err(stall_error(
                    &format!("vCPU {id}'s clock did not advance in {STALL_LIMIT} events"),
                    actors,
                    None,
                ));
            }
            let a = &actors[i];
            if flushing {
                flushed_end = flushed_end.max(a.clock);
            }
            if stop_on_wake && self.woken() {
                return Ok((flushed_end, Some(a.clock)));
            }
            if runs(a) {
                heap.replace_min((a.clock, i));
            } else {
                heap.pop_min();
            }
        }
        Ok((flushed_end, None))
    }

    /// vCPUs out for `KVM_EXIT_DIRTY_RING_FULL` whose ring was reset (or that must leave for
    /// `host_quit`) re-enter the guest at `at`, the VMM's clock after the reset. Called only
    /// between the VMM's plans: the reset plan empties the rings at its first step, but in KVM
    /// the vCPU thread that reaps runs again only once `KVM_RESET_DIRTY_RINGS` returns.
    fn release_ring_waiters<G: GuestCode>(&self, actors: &mut [VcpuActor<'_, G>], at: Ps) {
        let kvm = &*self.vm.kvm;
        for a in actors.iter_mut().filter(|a| a.ring_wait()) {
            if self.quit || kvm.dirty_ring_released(a.vcpu.id) {
                a.state = VcpuState::Guest;
                a.clock = a.clock.max(at);
                let v = &mut *a.vcpu;
                let before = v.meter.clone();
                // Back into KVM_RUN (SRCU), then the guest.
                v.run_begin(kvm);
                v.enter_guest(kvm);
                a.clock += self.pricer.ps(&before, &v.meter);
            }
        }
    }

    /// Whether a host thread sleeps beside the vCPUs and one of them just woke it.
    #[inline]
    fn woken(&self) -> bool {
        self.wake
            .as_ref()
            .is_some_and(|w| w.load(Ordering::Acquire))
    }

    /// Runs one vCPU while its clock is at or before `horizon` (the next vCPU's clock, or the
    /// VMM's `until`): nothing it does before then can be affected by what the others do later.
    /// An exit waits for the clock too: an access whose try ended past `horizon` takes its exit
    /// on the vCPU's next turn. With `flush_faults` (the VMM is about to `synchronize_srcu()`),
    /// a vCPU inside a fault at or past `until` finishes the fault's slow half first.
    fn step<G: GuestCode>(
        &mut self,
        a: &mut VcpuActor<'_, G>,
        horizon: Ps,
        until: Ps,
        flush_faults: bool,
    ) -> Result<(), EngineError> {
        let kvm = &*self.vm.kvm;
        let mmu = &*self.vm.mmu;
        if let Some(caches) = kvm.caches() {
            caches.run_on(caches.vcpu_cpu(a.vcpu.id));
        }
        if flush_faults && a.clock >= until {
            self.ff.global_step();
            let v = &mut *a.vcpu;
            match std::mem::replace(&mut a.state, VcpuState::Guest) {
                VcpuState::HostWork(access) => {
                    let mark = v.meter.clone();
                    let step = host_fault_resume(kvm, mmu, v, &access);
                    a.clock += self.pricer.ps(&mark, &v.meter);
                    a.settle(kvm, access, step)?;
                }
                VcpuState::WaitingForLock(access, mode) => {
                    let ret = self.slow_half(v, &mut a.clock, mode);
                    let mark = v.meter.clone();
                    let step = after_slow_fault(kvm, v, &access, ret);
                    a.clock += self.pricer.ps(&mark, &v.meter);
                    a.settle(kvm, access, step)?;
                }
                other => a.state = other,
            }
            return Ok(());
        }
        // The progress oracle: events in a row that left the clock where it was.
        let (mut guard, mut at) = (StallGuard::new(STALL_LIMIT), a.clock);
        loop {
            // In turn up to the horizon; past it only a private step, while every vCPU holds
            // its guarantee, before the VMM's next step and within the open epoch (see
            // `fast_forward`).
            if a.clock > horizon
                && !(self.ff.all_private(self.nr_vcpus)
                    && a.clock < until
                    && a.clock < self.epochs.open_end()
                    && a.clock < self.ff.window_limit()
                    && a.next_step_private(kvm, self.quit))
            {
                return Ok(());
            }
            self.ff.out_of_turn += (a.clock > horizon) as u64;
            let Some(iteration) = a.pass else {
                return Ok(());
            };
            if guard.stalled(a.clock != at) {
                // run_vcpus_until() reports it, with every actor.
                self.stalled_vcpu = Some(a.vcpu.id);
                return Ok(());
            }
            at = a.clock;
            let v = &mut *a.vcpu;
            // Between accesses (most turns) there is nothing to take out of the state.
            let state = if matches!(a.state, VcpuState::Guest) {
                VcpuState::Guest
            } else {
                std::mem::replace(&mut a.state, VcpuState::Guest)
            };
            let next = match state {
                // A fault's slow half whose lock request falls at this clock: every actor whose
                // clock is earlier has run, so the request is made in virtual-time order, and
                // what the fault changes becomes visible from its grant, not from when the walk
                // failed.
                VcpuState::WaitingForLock(access, mode) => {
                    // A job holds the lock in a mode that excludes this request: it waits.
                    if self.job_hold.is_some_and(|held| conflicts(held, mode)) {
                        a.state = VcpuState::WaitingForLock(access, mode);
                        return Ok(());
                    }
                    self.ff.global_step();
                    let ret = self.slow_half(v, &mut a.clock, mode);
                    let mark = v.meter.clone();
                    let step = after_slow_fault(kvm, v, &access, ret);
                    a.clock += self.pricer.ps(&mark, &v.meter);
                    a.settle(kvm, access, step)?;
                    continue;
                }
                // The host's next step of a fault's page, once the work before it took its
                // time: a PTE changes in virtual-time order with the other actors' faults.
                VcpuState::HostWork(access) => {
                    self.ff.global_step();
                    let mark = v.meter.clone();
                    let step = host_fault_resume(kvm, mmu, v, &access);
                    a.clock += self.pricer.ps(&mark, &v.meter);
                    a.settle(kvm, access, step)?;
                    continue;
                }
                // An access whose first try ended in an exit, taken once the clock allows it.
                VcpuState::Exiting(access, first) => {
                    let mark = v.meter.clone();
                    let start = a.clock;
                    let ordered = matches!(first, Err(AccessExit::PmlFull | AccessExit::Kicked));
                    let step = exit_loop(kvm, mmu, v, &access, first);
                    // An exit for a full log or a kick, retried to completion, is ordered;
                    // anything that faulted or intercepted is global.
                    if !(ordered
                        && v.meter.ept_violations == mark.ept_violations
                        && matches!(step, Ok(AccessStep::Done(_))))
                    {
                        if a.private.holds(&self.ff) {
                            return Err(EngineError::Unsupported(format!(
                                "fast-forward: vCPU {} faulted on gfn {:#x} although its range was checked accessible; run with --fast-forward off",
                                v.id, access.gfn.0
                            )));
                        }
                        self.ff.global_step();
                    }
                    a.clock += self.pricer.ps(&mark, &v.meter);
                    a.clock += self.dram_wait(v, start, mark.dram_lines);
                    a.settle(kvm, access, step)?;
                    // An exit that woke a sleeping host thread ends the step: the thread runs
                    // from this clock.
                    if self.woken() {
                        return Ok(());
                    }
                    continue;
                }
                // A fault that found no free host page: the vCPU waits, out of the run, until
                // the host thread beside it releases it; then it re-enters guest mode and
                // faults again.
                VcpuState::Stalled { access, released } => {
                    if !self.park_stalls {
                        return Err(EngineError::Unsupported(format!(
                            "vCPU {}: the host is out of memory and no reclaim runs beside the vCPUs",
                            v.id
                        )));
                    }
                    if !released {
                        a.state = VcpuState::Stalled { access, released };
                        return Ok(());
                    }
                    self.ff.global_step();
                    let before = v.meter.clone();
                    v.enter_guest(kvm);
                    a.clock += self.pricer.ps(&before, &v.meter);
                    Some(access)
                }
                VcpuState::Retry(access) => Some(access),
                // Out for a full ring: only the VMM's reset lets it back in.
                VcpuState::RingWait => {
                    a.state = VcpuState::RingWait;
                    return Ok(());
                }
                // kvm_dirty_ring_check_request() before entering the guest again: a ring at its
                // soft limit exits to userspace, and the vCPU stays out until the ring is reset
                // (after host_quit it leaves KVM_RUN instead).
                // The tick interrupts the guest between two of its accesses.
                VcpuState::Guest if a.clock >= a.next_tick => {
                    self.take_ticks(a);
                    continue;
                }
                VcpuState::Guest if !self.quit && kvm.dirty_ring_full(v.id) => {
                    let before = v.meter.clone();
                    v.exit_guest(kvm);
                    // KVM_RUN returns to userspace and drops SRCU (kvm_arch_vcpu_ioctl_run()),
                    // so a synchronize_srcu() meanwhile does not wait for this vCPU.
                    v.run_end(kvm);
                    a.clock += self.pricer.ps(&before, &v.meter);
                    a.state = VcpuState::RingWait;
                    return Ok(());
                }
                VcpuState::Guest => {
                    // Not while a job holds mmu_lock (its yield points run the vCPUs): it is
                    // changing the tables a check would read.
                    if self.ff.enabled && self.job_hold.is_none() {
                        let accesses = v.meter.guest_reads + v.meter.guest_writes;
                        a.private
                            .try_check(&mut self.ff, mmu, &a.guest, accesses, a.clock);
                    }
                    match a.guest_next() {
                        GuestNext::Computed => continue,
                        // Out of turn: the exit waits for the clock.
                        GuestNext::Sync if a.clock > horizon => {
                            a.state = VcpuState::AtSync;
                            return Ok(());
                        }
                        GuestNext::Sync => None,
                        GuestNext::Try(access) => Some(access),
                    }
                }
                VcpuState::AtSync => None,
            };
            let Some(access) = next else {
                // GUEST_SYNC: exit to userspace; wait for the next iteration.
                let v = &mut *a.vcpu;
                let before = v.meter.clone();
                v.exit_guest(kvm);
                a.clock += self.pricer.ps(&before, &v.meter);
                a.completed = iteration;
                if self.background && !self.quit {
                    // The vCPU goes straight back for another pass of the same iteration: a
                    // pass that keeps to other gfns than its guarantee covers may take a
                    // global step before the others' clocks, so it ends every guarantee.
                    let promise = |g: &G| (g.private_gfns(), g.shared_reads());
                    let again = promise(&a.guest);
                    let before = v.meter.clone();
                    v.enter_guest(kvm);
                    a.clock += self.pricer.ps(&before, &v.meter);
                    a.guest.start_pass(iteration);
                    if a.private.holds(&self.ff) && promise(&a.guest) != again {
                        self.ff.global_step();
                    }
                    continue;
                }
                v.run_end(kvm);
                a.pass = None;
                return Ok(());
            };
            // Leaving its window, the vCPU gives its guarantee up first.
            a.private.before_access(&mut self.ff, access.gfn);
            // The exit, if any, is taken at the top of the loop, when the clock allows.
            if let Some((socket, lines)) = self.tries().first_try(kvm, mmu, a, access) {
                self.epochs.add_dram_lines(socket, lines);
            }
        }
    }

    /// What a private step reads of the world ([`Tries`]).
    fn tries(&self) -> Tries<'_> {
        Tries {
            pricer: &self.pricer,
            access_unit_ps: &self.access_unit_ps,
            fast_access: self.fast_access,
            second_level_read_ps: self.second_level_read_ps,
            epochs: &self.epochs,
            sockets: &self.sockets,
            quit: self.quit,
            ff: &self.ff,
        }
    }

    /// The parallel phase of fast-forward: each running vCPU of `actors` (those `runs`
    /// selects) that holds its guarantee runs its private steps up to `limit` (the VMM's next
    /// step, the open epoch's end, the clock of the first running vCPU without a guarantee, or
    /// the earliest a vCPU may leave its window: `cut` when before the epoch's end and the
    /// VMM's step) or its first step that is not private, all of them
    /// at once on the host's cores ([`rayon`]), or one after the other on this thread when
    /// the last phase was too short to pay for the pool ([`FastForward::phase_on_cores`]).
    /// Their steps commute (see [`fast_forward`](super::fast_forward)), so the results are
    /// those of running them one at a time, either way; the DRAM lines they moved are added to
    /// the open epoch afterwards. Returns how many steps ran.
    fn private_phase<G: GuestCode>(
        &mut self,
        actors: &mut [VcpuActor<'_, G>],
        runs: impl Fn(&VcpuActor<'_, G>) -> bool + Sync,
        limit: Ps,
        cut: bool,
    ) -> u64 {
        use rayon::prelude::*;
        let wall = self.wall.start();
        let kvm = &*self.vm.kvm;
        let mmu = &*self.vm.mmu;
        let tries = self.tries();
        let ff = &self.ff;
        let runs = |a: &VcpuActor<'_, G>| runs(a) && ff.may_run(&a.private);
        let run = |a: &mut VcpuActor<'_, G>| tries.private_run(kvm, mmu, a, limit);
        let on_cores = self.ff.phase_on_cores();
        let PhaseSteps {
            steps,
            swept,
            written,
            running,
        } = if on_cores {
            let runs = actors.par_iter_mut().filter(|a| runs(a));
            runs.map(run).reduce(PhaseSteps::default, |x, y| x + y)
        } else {
            actors
                .iter_mut()
                .filter(|a| runs(a))
                .map(run)
                .fold(PhaseSteps::default(), |x, y| x + y)
        };
        self.ff.swept_reads += swept;
        self.ff.swept_writes += written;
        self.ff
            .phase_ran(self.epochs.open(), steps, running, on_cores, cut);
        self.wall.add(Part::Phases, wall);
        for a in actors.iter_mut() {
            for (socket, lines) in a.dram_queued.iter_mut().enumerate() {
                self.epochs.add_dram_lines(socket, std::mem::take(lines));
            }
        }
        steps
    }

    /// The DRAM lines `v` moved since its meter counted `lines_before`, in accesses from
    /// `start`, on the bandwidth of the socket whose memory holds them: returns how long they
    /// waited ([`Epochs::dram_wait`]), counted in `dram_stall_ns`.
    fn dram_wait(&mut self, v: &mut Vcpu, start: Ps, lines_before: u64) -> Ps {
        let lines = v.meter.dram_lines - lines_before;
        if lines == 0 {
            return 0;
        }
        // The lines come from the memory of the socket that holds the page (the vCPU's own
        // unless the host's caches place guest pages: `Vcpu::dram_socket`).
        let socket = v.dram_socket.take().unwrap_or(self.sockets[v.id]) as usize;
        let wait = self.epochs.dram_wait(socket, start, lines);
        v.meter.dram_stall_ns += ps_to_ns(wait);
        wait
    }

    /// Closes the shared resources' epochs before the one holding `t`, once every running
    /// actor has reached `t`: the DRAM backlogs take the closed epoch's traffic, and the
    /// guest lines every vCPU fetched in it enter the host's caches, vCPU by vCPU.
    fn close_epochs<G>(&mut self, actors: &mut [VcpuActor<'_, G>], t: Ps) {
        if !self.epochs.past_open(t) {
            return;
        }
        self.epochs.close(t);
        let caches = self.vm.kvm.caches();
        for a in actors.iter_mut() {
            let id = a.vcpu.id;
            if let (Some(caches), Some(lines)) = (caches, a.vcpu.guest_lines.as_mut()) {
                caches.guest_lines(id, lines);
                lines.clear();
            }
        }
    }

    /// The MMU's writes to its VM-wide lines so far, before a critical section (`None` when it
    /// keeps none).
    fn vm_line_writes(&self) -> Option<[u64; NR_VM_LINES]> {
        self.vm.mmu.vm_line_writes().map(|w| w.snapshot())
    }

    /// After a critical section of `core`: the VM-wide lines it wrote since `before` move to
    /// its core, their transfers counted on `meter` ([`VmLines::wrote`]).
    fn wrote_vm_lines(
        &mut self,
        before: Option<[u64; NR_VM_LINES]>,
        core: Core,
        meter: &mut Meter,
    ) {
        if let (Some(before), Some(w)) = (before, self.vm.mmu.vm_line_writes()) {
            self.vm_lines.wrote(&before, &w.snapshot(), core, meter);
        }
    }

    /// The slow half of a fault of `v` under `mmu_lock` taken in `mode` at `clock`: granted in
    /// virtual time (after the holders before it, the lock's cache line moved), run, and held
    /// for as long as its work costs; `clock` ends where the hold ends.
    fn slow_half(&mut self, v: &mut Vcpu, clock: &mut Ps, mode: LockMode) -> RetPf {
        let kvm = &*self.vm.kvm;
        let stats = &kvm.mmu_lock.stats;
        let core = Core {
            actor: v.id,
            socket: self.sockets[v.id],
        };
        let grant = self.lock.acquire(mode, core, *clock);
        let held = kvm.mmu_lock.virtual_grant(mode).at_virtual_ps(grant.start);
        let before = v.meter.clone();
        let lines = self.vm_line_writes();
        let r = locked_half(kvm, &*self.vm.mmu, v, &held);
        drop(held);
        self.wrote_vm_lines(lines, core, &mut v.meter);
        let work_end = grant.start + self.pricer.ps(&before, &v.meter);
        self.vm.mmu.fault_hold_ended(v.id, work_end);
        let by = HoldBy {
            mode,
            core,
            requested: Some(*clock),
        };
        *clock = self.lock.hold(stats, by, grant, work_end);
        r
    }

    /// Runs one job of a VMM plan to completion under `mmu_lock` in virtual time, at `clock`
    /// (see [`VirtualTime::run_plans`]); returns the range it owes a flush for.
    fn run_job<G: GuestCode>(
        &mut self,
        actors: &mut [VcpuActor<'_, G>],
        clock: &mut Ps,
        err: &mut Option<EngineError>,
        kvm: &Kvm,
        job: &mut dyn MmuJob,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        let mode = job.lock_mode();
        // Whether this job resumes after a stop where nobody took the lock: then it never
        // released it, and the chunk is not a new acquisition.
        let mut resumed = false;
        // The progress oracle: chunks in a row that did no work.
        let mut guard = StallGuard::new(JOB_STALL_LIMIT);
        loop {
            if let Err(e) = self.run_vcpus(actors, *clock, false) {
                err.get_or_insert(e);
            }
            self.close_epochs(actors, *clock);
            // The job's chunk is global: it changes page tables.
            self.ff.global_step();
            // A vCPU's run failed (KVM_RUN failed, or the progress oracle): the plan fails
            // with it, and nothing more runs.
            if err.is_some() {
                return None;
            }
            let requested = *clock;
            let core = self.plan_actor;
            if let Some(caches) = kvm.caches() {
                caches.run_on(cache_cpu(caches, core));
            }
            // A chunk resuming a lock it never released acquires nothing.
            let grant = if resumed {
                Grant::resumed(requested)
            } else {
                self.lock.acquire(mode, core, requested)
            };
            let start = grant.start;
            let before = meter.clone();
            let lines = self.vm_line_writes();
            // rwlock_needbreak() at each of the job's yield points: the vCPUs run up to the
            // job's clock there, and a fault that asked for the lock meanwhile is a waiter.
            let step = {
                let probe = JobWaiterProbe::new(self, actors, start, &before);
                let held =
                    kvm.mmu_lock
                        .virtual_grant_probed(mode, ps_to_ns(start - requested), &probe);
                probe.state.borrow_mut().world.job_hold = Some(mode);
                let step = job.run(kvm, &held, meter);
                drop(held);
                // What the chunk changed ends any guarantee taken meanwhile.
                probe.state.borrow_mut().world.ff.global_step();
                let st = probe.state.into_inner();
                st.world.job_hold = None;
                if let Some(e) = st.err {
                    err.get_or_insert(e);
                }
                step
            };
            if err.is_some() {
                return None;
            }
            if guard.stalled(*meter != before) && !matches!(step, JobStep::Done { .. }) {
                err.get_or_insert(stall_error(
                    &format!(
                        "the job {} did no work in {JOB_STALL_LIMIT} chunks in a row",
                        job.name()
                    ),
                    actors,
                    Some((&format!("the job {}", job.name()), start)),
                ));
                return None;
            }
            // Simplified: with a read-held job, vCPU faults that ran inside it (in its probe)
            // changed the shared counters too, and the job is charged their lines as if it had
            // written them last.
            self.wrote_vm_lines(lines, core, meter);
            let work_end = start + self.pricer.ps(&before, meter);
            let by = HoldBy {
                mode,
                core,
                requested: (!resumed).then_some(requested),
            };
            let end = self.lock.hold(&kvm.mmu_lock.stats, by, grant, work_end);
            *clock = end;
            resumed = false;
            match step {
                JobStep::Done { flush } => return flush,
                JobStep::Yield => {
                    // Let the vCPUs catch up; if one took the lock meanwhile, the job really
                    // yielded (cond_resched_rwlock_write() let it in).
                    let acquired = |st: &LockStats| {
                        st.read_acquired.load(Ordering::Relaxed)
                            + st.write_acquired.load(Ordering::Relaxed)
                    };
                    let seen = acquired(&kvm.mmu_lock.stats);
                    if let Err(e) = self.run_vcpus(actors, end, false) {
                        err.get_or_insert(e);
                    }
                    if acquired(&kvm.mmu_lock.stats) != seen {
                        let before = meter.clone();
                        meter.lock_yields += 1;
                        *clock += self.pricer.ps(&before, meter);
                    } else {
                        resumed = true;
                    }
                }
                JobStep::NeedTopup => {
                    let before = meter.clone();
                    meter.lock_drops_for_alloc += 1;
                    job.topup(kvm, meter);
                    *clock += self.pricer.ps(&before, meter);
                }
            }
        }
    }
}

/// The virtual-time engine's `rwlock_needbreak()` for a job it runs ([`WaiterProbe`]): at a
/// yield point, the job's clock is the chunk's start plus the price of what it has counted
/// since; the vCPUs run up to that clock (their accesses see what the job has done so far, as
/// they would on real CPUs), and a fault among them that requested the lock in a conflicting
/// mode stays waiting ([`World::job_hold`]) and makes the answer true until the job releases
/// the lock. A vCPU that only hits its TLB never makes a job yield.
struct JobWaiterProbe<'p, 'a, 'v, G> {
    state: RefCell<ProbeState<'p, 'a, 'v, G>>,
    /// Where the chunk's hold started.
    start: Ps,
    /// The job's meter when the chunk started.
    before: &'p Meter,
}

/// What [`JobWaiterProbe`] changes as it runs the vCPUs.
struct ProbeState<'p, 'a, 'v, G> {
    world: &'p mut World<'a>,
    actors: &'p mut [VcpuActor<'v, G>],
    /// No vCPU acts before this clock (the least clock of those that can; recomputed after
    /// each run), so a check before it needs no run.
    next_event: Ps,
    /// A waiter was found: it waits until the lock is released.
    waiting: bool,
    /// The first error a vCPU's run returned.
    err: Option<EngineError>,
}

impl<'p, 'a, 'v, G> JobWaiterProbe<'p, 'a, 'v, G> {
    fn new(
        world: &'p mut World<'a>,
        actors: &'p mut [VcpuActor<'v, G>],
        start: Ps,
        before: &'p Meter,
    ) -> Self {
        let next_event = next_vcpu_event(actors);
        JobWaiterProbe {
            state: RefCell::new(ProbeState {
                world,
                actors,
                next_event,
                waiting: false,
                err: None,
            }),
            start,
            before,
        }
    }
}

/// The least clock of the vCPUs that can still act (`Ps::MAX` if none).
fn next_vcpu_event<G>(actors: &[VcpuActor<'_, G>]) -> Ps {
    actors
        .iter()
        .filter(|a| a.active())
        .map(|a| a.clock)
        .min()
        .unwrap_or(Ps::MAX)
}

impl<G: GuestCode> WaiterProbe for JobWaiterProbe<'_, '_, '_, G> {
    fn waiting_by(&self, meter: &Meter) -> bool {
        let mut st = self.state.borrow_mut();
        // A waiter waits until the lock is released; after a vCPU's run failed, the job
        // should stop as soon as it can, and nothing more runs.
        if st.waiting || st.err.is_some() {
            return true;
        }
        let now = self.start + st.world.pricer.ps(self.before, meter);
        if now < st.next_event {
            return false;
        }
        let ProbeState {
            world, actors, err, ..
        } = &mut *st;
        if let Err(e) = world.run_vcpus(actors, now, false) {
            err.get_or_insert(e);
        }
        // The job's chunk goes on on its own core, whichever vCPU ran last.
        if let Some(caches) = world.vm.kvm.caches() {
            caches.run_on(cache_cpu(caches, world.plan_actor));
        }
        let hold = world.job_hold;
        st.waiting = st
            .actors
            .iter()
            .any(|a| a.active() && a.blocked_by(hold) && a.clock < now);
        st.next_event = next_vcpu_event(st.actors);
        st.waiting
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::GuestAccess;
    use crate::host::backing::Backing;
    use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
    use crate::units::Gfn;
    use crate::vm::VmConfig;

    /// Each pass: for every page, a write and then reads of it and of the 3 pages before it
    /// (hits, and misses on pages another vCPU's fault or the harvest changed).
    struct Sweep {
        vcpu: u64,
        pages: u64,
        i: u64,
        j: u64,
    }

    impl GuestCode for Sweep {
        fn start_pass(&mut self, _: i64) {
            (self.i, self.j) = (0, 0);
        }
        fn next_access(&mut self) -> Option<GuestAccess> {
            if self.i == self.pages {
                return None;
            }
            let page = self.i.saturating_sub(self.j);
            let write = self.j == 0;
            if self.j == 4 {
                (self.i, self.j) = (self.i + 1, 0);
            } else {
                self.j += 1;
            }
            Some(GuestAccess::first_word(
                Gfn(0x1000 + page),
                write,
                self.vcpu,
            ))
        }
        fn access_done(&mut self, _: &GuestAccess) {}
    }

    fn run(mmu: crate::vm::MmuKind, every_access: bool) -> (Vec<u64>, Vec<Meter>) {
        let vm = Vm::with_waiter(
            VmConfig {
                vcpus: 16,
                eager_page_split: false,
                mmu,
                pml: false,
                kernel: Default::default(),
            },
            Box::new(super::super::VirtualWaiter),
        );
        vm.set_user_memory_region(1, 0x1000 << 12, 4 << 20, Backing::AnonymousThp, 0)
            .unwrap();
        let slot = vm.kvm.slot_by_id(1).unwrap();
        let guests = (0..16)
            .map(|vcpu| Sweep {
                vcpu,
                pages: 1024,
                i: 0,
                j: 0,
            })
            .collect();
        let cost = if matches!(mmu, crate::vm::MmuKind::Stage2 { .. }) {
            CostModel::default_arm64()
        } else {
            CostModel::default()
        };
        let mut e = VirtualTime::new(&vm, &cost, guests).unwrap();
        if every_access {
            e = e.price_every_access();
        }
        let mut times = vec![e.run_pass(0).unwrap()];
        let plan =
            crate::kvm::dirty_log::set_memslot_flags_plan(&vm.kvm, &slot, KVM_MEM_LOG_DIRTY_PAGES);
        times.push(e.run_plans(vec![plan]).unwrap());
        times.push(e.run_pass(1).unwrap());
        (times, e.vcpu_meters())
    }

    #[test]
    fn the_fixed_price_of_a_hit_changes_no_result() {
        let stage2 = crate::vm::MmuKind::Stage2 {
            lock: crate::arm64::Arm64Lock::Parallel,
            ia_bits: 40,
            split_chunk_pages: 0,
            cpu: Default::default(),
            relax_flush: Default::default(),
        };
        for mmu in [crate::vm::MmuKind::Tdp, stage2] {
            let fast = run(mmu, false);
            assert!(fast.1.iter().all(|m| m.tlb_hits > 0 && m.hw_walks > 0));
            // Sixteen vCPUs (more than the scheduler keeps on one socket: `Host::vcpu_sockets`)
            // sweep the same pages from two sockets on x86's host: some lines come from the
            // other socket's memory, priced on both paths.
            if mmu == crate::vm::MmuKind::Tdp {
                assert!(fast.1.iter().any(|m| m.guest_remote_lines > 0));
            }
            assert_eq!(fast, run(mmu, true), "{mmu:?}");
        }
    }
    /// Each vCPU writes its own 256 pages, each followed by reads of it and the page before:
    /// memstress's partitioned memory, which it declares private.
    struct Partitioned(Sweep);

    impl GuestCode for Partitioned {
        fn start_pass(&mut self, i: i64) {
            self.0.start_pass(i)
        }
        fn next_access(&mut self) -> Option<GuestAccess> {
            let a = self.0.next_access()?;
            let base = 0x1000 + self.0.vcpu * self.0.pages;
            Some(GuestAccess::first_word(
                Gfn((a.gfn.0 - 0x1000) % self.0.pages + base),
                a.write,
                a.value,
            ))
        }
        fn access_done(&mut self, _: &GuestAccess) {}
        fn private_gfns(&self) -> Option<crate::engine::PrivateGfns> {
            Some(crate::engine::PrivateGfns {
                range: crate::units::GfnRange::new(
                    Gfn(0x1000 + self.0.vcpu * self.0.pages),
                    self.0.pages,
                ),
                write: true,
            })
        }
    }

    /// Populates, enables dirty logging (with PML on x86), then two passes and a harvest
    /// between them, on 16 vCPUs of `guests`, with fast-forward `ff` (`None`: unchecked):
    /// every pass's time, every vCPU's meter, the steps run out of turn, and how many of them
    /// were writes made in runs.
    fn logged_passes<G: GuestCode>(
        mmu: crate::vm::MmuKind,
        guests: Vec<G>,
        ff: Option<bool>,
    ) -> (Vec<u64>, Vec<Meter>, u64, u64) {
        let (vm, slot, cost) = sixteen_vcpus(mmu, mmu == crate::vm::MmuKind::Tdp);
        let e = VirtualTime::new(&vm, &cost, guests).unwrap();
        let mut e = match ff {
            Some(on) => e.with_fast_forward(on),
            None => e.fast_forward_unchecked(),
        };
        let mut times = vec![e.run_pass(0).unwrap()];
        let plan =
            crate::kvm::dirty_log::set_memslot_flags_plan(&vm.kvm, &slot, KVM_MEM_LOG_DIRTY_PAGES);
        times.push(e.run_plans(vec![plan]).unwrap());
        times.push(e.run_pass(1).unwrap());
        let bitmap = vec![!0u64; (slot.npages as usize).div_ceil(64)];
        let clear =
            crate::kvm::dirty_log::clear_dirty_log_plan(&vm.kvm, &slot, 0, slot.npages, &bitmap)
                .unwrap();
        times.push(e.run_plans(vec![clear]).unwrap());
        times.push(e.run_pass(2).unwrap());
        (
            times,
            e.vcpu_meters(),
            e.steps_out_of_turn(),
            e.swept_writes(),
        )
    }

    /// The vCPUs' loop goes on on the pool's threads only where its phases run on the
    /// host's cores, and then once per call: never with fast-forward off, where no phase runs
    /// (many short calls once paid the move for nothing), at most once per pass with it on.
    #[test]
    fn the_vcpu_loop_moves_to_the_pool_only_for_phases_on_its_cores() {
        let run = |ff: bool| {
            let (vm, slot, cost) = sixteen_vcpus(crate::vm::MmuKind::Tdp, true);
            let mut e = VirtualTime::new(&vm, &cost, partitioned())
                .unwrap()
                .with_fast_forward(ff);
            e.run_pass(0).unwrap();
            let plan = crate::kvm::dirty_log::set_memslot_flags_plan(
                &vm.kvm,
                &slot,
                KVM_MEM_LOG_DIRTY_PAGES,
            );
            e.run_plans(vec![plan]).unwrap();
            e.run_pass(1).unwrap();
            e.run_pass(2).unwrap();
            (e.pool_moves(), e.world.ff.phases[1])
        };
        assert_eq!(run(false), (0, 0), "no phase, no move");
        let (moves, on_cores) = run(true);
        assert!(on_cores > 0, "phases ran on the cores");
        assert!((1..=3).contains(&moves), "{moves} moves in 3 passes");
    }

    /// A VM of 16 vCPUs on `mmu` (with PML when `pml`) with 16 MiB of THP-backed memory in
    /// memslot 1 at gfn 0x1000, the memslot, and the architecture's default costs.
    fn sixteen_vcpus(
        mmu: crate::vm::MmuKind,
        pml: bool,
    ) -> (Vm, std::sync::Arc<crate::kvm::memslot::Memslot>, CostModel) {
        let vm = Vm::with_waiter(
            VmConfig {
                vcpus: 16,
                eager_page_split: false,
                mmu,
                pml,
                kernel: Default::default(),
            },
            Box::new(super::super::VirtualWaiter),
        );
        vm.set_user_memory_region(1, 0x1000 << 12, 16 << 20, Backing::AnonymousThp, 0)
            .unwrap();
        let slot = vm.kvm.slot_by_id(1).unwrap();
        let cost = if matches!(mmu, crate::vm::MmuKind::Stage2 { .. }) {
            CostModel::default_arm64()
        } else {
            CostModel::default()
        };
        (vm, slot, cost)
    }

    fn stage2() -> crate::vm::MmuKind {
        crate::vm::MmuKind::Stage2 {
            lock: crate::arm64::Arm64Lock::Parallel,
            ia_bits: 40,
            split_chunk_pages: 0,
            cpu: Default::default(),
            relax_flush: Default::default(),
        }
    }

    fn partitioned() -> Vec<Partitioned> {
        (0..16)
            .map(|vcpu| {
                Partitioned(Sweep {
                    vcpu,
                    pages: 256,
                    i: 0,
                    j: 0,
                })
            })
            .collect()
    }

    fn shared() -> Vec<Sweep> {
        (0..16)
            .map(|vcpu| Sweep {
                vcpu,
                pages: 1024,
                i: 0,
                j: 0,
            })
            .collect()
    }

    /// Each vCPU writes its own 256 pages in order, and says so: memstress's sequential
    /// writes, made in runs ([`GuestCode::ascending_writes`]).
    struct Writer {
        vcpu: u64,
        i: u64,
    }

    /// Pages each [`Writer`] writes.
    const WRITER_PAGES: u64 = 256;

    impl Writer {
        fn base(&self) -> u64 {
            0x1000 + self.vcpu * WRITER_PAGES
        }
    }

    impl GuestCode for Writer {
        fn start_pass(&mut self, _: i64) {
            self.i = 0;
        }
        fn next_access(&mut self) -> Option<GuestAccess> {
            if self.i == WRITER_PAGES {
                return None;
            }
            self.i += 1;
            Some(GuestAccess::first_word(
                Gfn(self.base() + self.i - 1),
                true,
                self.vcpu,
            ))
        }
        fn access_done(&mut self, _: &GuestAccess) {}
        fn private_gfns(&self) -> Option<crate::engine::PrivateGfns> {
            Some(crate::engine::PrivateGfns {
                range: crate::units::GfnRange::new(Gfn(self.base()), WRITER_PAGES),
                write: true,
            })
        }
        fn ascending_writes(&self) -> Option<crate::engine::AscendingWrites> {
            (self.i < WRITER_PAGES).then(|| crate::engine::AscendingWrites {
                first: Gfn(self.base() + self.i),
                len: WRITER_PAGES - self.i,
                value: self.vcpu,
            })
        }
        fn skip_accesses(&mut self, n: u64) {
            self.i += n;
        }
    }

    /// Writes made in runs (each priced, waiting for its socket's DRAM and cut at the phase's
    /// end as one by one; over 2 MiB blocks, and over 4K leaves with PML after the split)
    /// give the results of stepping in turn, on both MMUs.
    #[test]
    fn written_runs_change_no_result() {
        let writers = || {
            (0..16)
                .map(|vcpu| Writer { vcpu, i: 0 })
                .collect::<Vec<_>>()
        };
        for mmu in [crate::vm::MmuKind::Tdp, stage2()] {
            let on = logged_passes(mmu, writers(), Some(true));
            let off = logged_passes(mmu, writers(), Some(false));
            assert!(on.3 > 2_000, "{mmu:?}: {} writes in runs", on.3);
            assert_eq!(off.3, 0);
            assert_eq!((&on.0, &on.1), (&off.0, &off.1), "{mmu:?}");
        }
    }

    #[test]
    fn fast_forward_changes_no_result() {
        for mmu in [crate::vm::MmuKind::Tdp, stage2()] {
            let on = logged_passes(mmu, partitioned(), Some(true));
            let off = logged_passes(mmu, partitioned(), Some(false));
            assert!(on.2 > 1_000, "{mmu:?}: {} steps out of turn", on.2);
            assert_eq!(off.2, 0);
            assert!(on.1.iter().all(|m| m.hw_walks > 0));
            assert_eq!((&on.0, &on.1), (&off.0, &off.1), "{mmu:?}");
        }
        // Guests that share their pages promise nothing: nothing runs out of turn.
        let on = logged_passes(crate::vm::MmuKind::Tdp, shared(), Some(true));
        assert_eq!(on.2, 0);
        assert_eq!(
            on,
            logged_passes(crate::vm::MmuKind::Tdp, shared(), Some(false))
        );
    }

    /// The fast-forward check reads a vCPU's range a budget at a time: one that runs out says
    /// where it stopped, and the next goes on from there to the end; a range whose gfns are
    /// not mapped is blocked.
    #[test]
    fn a_check_out_of_budget_goes_on_where_it_stopped() {
        use crate::hw::walker::RangeWalk;
        for mmu in [crate::vm::MmuKind::Tdp, stage2()] {
            let (vm, _, cost) = sixteen_vcpus(mmu, false);
            let mut e = VirtualTime::new(&vm, &cost, partitioned()).unwrap();
            e.run_pass(0).unwrap();
            // Every vCPU's range, mapped by its pass (2 MiB leaves of THP, each shared by
            // two vCPUs' ranges, their Accessed flags set).
            let all = crate::units::GfnRange::new(Gfn(0x1000), 16 * 256);
            let mut check = all;
            let mut parts = 0;
            loop {
                // More than a descent from the root reads (the engine's least is 4,096).
                let mut budget = 6;
                match vm.mmu.range_walks_private(all, check, false, &mut budget) {
                    RangeWalk::Complete => break,
                    RangeWalk::Partial(at) => {
                        assert!(at >= check.start && at < all.end, "{mmu:?}: {at:?}");
                        check.start = at;
                        parts += 1;
                    }
                    RangeWalk::Blocked(at) => panic!("{mmu:?}: blocked at {at:?}"),
                }
                assert!(parts < 1_000, "{mmu:?}: no progress");
            }
            assert!(parts >= 2, "{mmu:?}: {parts} parts");
            let mut budget = 1 << 20;
            assert_eq!(
                vm.mmu.range_walks_private(all, all, false, &mut budget),
                RangeWalk::Complete
            );
            let unmapped = crate::units::GfnRange::new(Gfn(0x1000 + 16 * 256), 512);
            assert_eq!(
                vm.mmu
                    .range_walks_private(unmapped, unmapped, false, &mut budget),
                RangeWalk::Blocked(unmapped.start),
                "{mmu:?}"
            );
        }
    }

    /// Partitioned guests that compute 10 µs before each access make at most one private
    /// step per vCPU in a 2 µs epoch: their few phases run on this thread, and ever more
    /// epochs apart, since waking the host's cores for a phase in each epoch cost 60 times
    /// the run's time (`migrate --think-ns 10000`: 0.8 s stepping in turn, 46 s with every
    /// phase on the cores). Guests that access without computing run enough steps per phase
    /// to use the cores. The results are the same either way.
    #[test]
    fn phases_of_few_steps_stay_on_one_thread() {
        struct Thinking(Partitioned);
        impl GuestCode for Thinking {
            fn start_pass(&mut self, i: i64) {
                self.0.start_pass(i)
            }
            fn next_access(&mut self) -> Option<GuestAccess> {
                let mut a = self.0.next_access()?;
                a.compute_ns = 10_000;
                Some(a)
            }
            fn access_done(&mut self, a: &GuestAccess) {
                self.0.access_done(a)
            }
            fn private_gfns(&self) -> Option<crate::engine::PrivateGfns> {
                self.0.private_gfns()
            }
        }
        fn passes<G: GuestCode>(
            vm: &Vm,
            cost: &CostModel,
            guests: Vec<G>,
            ff: bool,
        ) -> (Vec<u64>, Vec<Meter>, [u64; 2]) {
            let mut e = VirtualTime::new(vm, cost, guests)
                .unwrap()
                .with_fast_forward(ff);
            let times = vec![e.run_pass(0).unwrap(), e.run_pass(1).unwrap()];
            (times, e.vcpu_meters(), e.world.ff.phases)
        }
        let phases = |thinking: bool, ff: bool| {
            let (vm, _, cost) = sixteen_vcpus(crate::vm::MmuKind::Tdp, true);
            if thinking {
                let guests = partitioned().into_iter().map(Thinking).collect();
                passes(&vm, &cost, guests, ff)
            } else {
                passes(&vm, &cost, partitioned(), ff)
            }
        };
        let (times, meters, [on_thread, on_cores]) = phases(true, true);
        // 8,192 accesses, 16 at a time 10 µs apart: about 500 epochs with a step in them.
        assert!(
            (1..100).contains(&on_thread) && on_cores == 0,
            "{on_thread} on one thread, {on_cores} on the cores"
        );
        assert_eq!((times, meters), {
            let off = phases(true, false);
            (off.0, off.1)
        });
        let (times, meters, [_, on_cores]) = phases(false, true);
        assert!(on_cores > 0, "no phase used the cores");
        assert_eq!((times, meters), {
            let off = phases(false, false);
            (off.0, off.1)
        });
    }

    /// A CLEAR job (and the enabling of dirty logging) while the vCPUs make background
    /// passes: the job's yield points run the vCPUs while it holds `mmu_lock` and changes
    /// their tables, so no guarantee may be taken then (a vCPU that took one would fault on
    /// what the job write-protected next). Results equal stepping in turn, on stage 2 and on
    /// the TDP MMU without PML (write protection) and with it.
    #[test]
    fn fast_forward_beside_jobs_changes_no_result() {
        let run = |mmu: crate::vm::MmuKind, pml: bool, ff: bool| {
            let (vm, slot, cost) = sixteen_vcpus(mmu, pml);
            let mut e = VirtualTime::new(&vm, &cost, partitioned())
                .unwrap()
                .with_fast_forward(ff);
            let mut times = vec![e.run_pass(0).unwrap()];
            e.start_background_passes(1);
            times.push(e.elapse(20_000).unwrap());
            let plan = crate::kvm::dirty_log::set_memslot_flags_plan(
                &vm.kvm,
                &slot,
                KVM_MEM_LOG_DIRTY_PAGES,
            );
            times.push(e.run_plans(vec![plan]).unwrap());
            for _ in 0..3 {
                times.push(e.elapse(30_000).unwrap());
                let bitmap = vec![!0u64; (slot.npages as usize).div_ceil(64)];
                let clear = crate::kvm::dirty_log::clear_dirty_log_plan(
                    &vm.kvm,
                    &slot,
                    0,
                    slot.npages,
                    &bitmap,
                )
                .unwrap();
                times.push(e.run_plans(vec![clear]).unwrap());
            }
            e.stop_vcpus().unwrap();
            (times, e.vcpu_meters(), e.steps_out_of_turn())
        };
        for (mmu, pml) in [
            (stage2(), false),
            (crate::vm::MmuKind::Tdp, false),
            (crate::vm::MmuKind::Tdp, true),
        ] {
            let on = run(mmu, pml, true);
            let off = run(mmu, pml, false);
            assert!(on.2 > 0, "{mmu:?} pml {pml}: nothing ran out of turn");
            assert_eq!((&on.0, &on.1), (&off.0, &off.1), "{mmu:?} pml {pml}");
        }
    }

    /// The negative control: the same accesses run out of turn without the guarantee (vCPUs
    /// that read each other's pages) give other results, which the comparison above would see.
    #[test]
    fn running_shared_accesses_out_of_turn_changes_results() {
        let unchecked = logged_passes(crate::vm::MmuKind::Tdp, shared(), None);
        let off = logged_passes(crate::vm::MmuKind::Tdp, shared(), Some(false));
        assert!(unchecked.2 > 0);
        assert_ne!((&unchecked.0, &unchecked.1), (&off.0, &off.1));
    }

    /// Every vCPU reads the same pages in order, each followed by reads of up to `back` pages
    /// behind it (kvm_page_table_test's adjust stage with backward reads): shared reads that
    /// rise through the region.
    struct Reader {
        pages: u64,
        back: u64,
        i: u64,
        j: u64,
    }

    impl GuestCode for Reader {
        fn start_pass(&mut self, _: i64) {
            (self.i, self.j) = (0, 0);
        }
        fn next_access(&mut self) -> Option<GuestAccess> {
            if self.i == self.pages {
                return None;
            }
            let page = self.i - self.j;
            if self.j == self.back.min(self.i) {
                (self.i, self.j) = (self.i + 1, 0);
            } else {
                self.j += 1;
            }
            Some(GuestAccess::first_word(Gfn(0x1000 + page), false, 0))
        }
        fn access_done(&mut self, _: &GuestAccess) {}
        fn shared_reads(&self) -> Option<crate::units::GfnRange> {
            let low = 0x1000 + self.i - self.back.min(self.i);
            Some(crate::units::GfnRange {
                start: Gfn(low.min(0x1000 + self.pages)),
                end: Gfn(0x1000 + self.pages),
            })
        }
        fn accesses_before(&self, end: Gfn) -> u64 {
            let e = end.0.saturating_sub(0x1000);
            if self.i == self.pages || self.i - self.j >= e {
                return 0;
            }
            // The rest of this page's reads, then one new page at least for each page between.
            let left = 1 + self.back.min(self.i) - self.j;
            left + e.saturating_sub(self.i + 1)
        }
        fn descending_reads(&self) -> Option<crate::engine::DescendingReads> {
            (self.i < self.pages && self.j > 0).then(|| crate::engine::DescendingReads {
                first: Gfn(0x1000 + self.i - self.j),
                len: self.back.min(self.i) + 1 - self.j,
            })
        }
        fn skip_accesses(&mut self, n: u64) {
            for _ in 0..n {
                self.next_access();
            }
        }
    }

    /// 16 vCPUs reading the same 4096 pages, each followed by reads of the `back` before it.
    fn readers(back: u64) -> Vec<Reader> {
        (0..16)
            .map(|_| Reader {
                pages: 4096,
                back,
                i: 0,
                j: 0,
            })
            .collect()
    }

    /// vCPUs that read the same pages, whose first reader faults each 2 MiB region in, run
    /// out of turn within the windows below the next region that is not mapped, and give the
    /// results of stepping in turn (the negative control, a guest whose bound is wrong, is
    /// `lab::page_table`'s: there a fault collapses a block the others read through).
    #[test]
    fn shared_reads_run_out_of_turn_within_their_windows() {
        for mmu in [crate::vm::MmuKind::Tdp, stage2()] {
            let on = logged_passes(mmu, readers(8), Some(true));
            let off = logged_passes(mmu, readers(8), Some(false));
            assert!(on.2 > 10_000, "{mmu:?}: {} steps out of turn", on.2);
            assert_eq!((&on.0, &on.1), (&off.0, &off.1), "{mmu:?}");
        }
    }

    /// Reads that sweep down through more pages than the first-level TLB holds, made in one
    /// step while each hits the second level only, give the results of making them one by one
    /// in turn, on both cores' TLBs.
    #[test]
    fn swept_reads_are_the_reads_one_by_one() {
        for mmu in [crate::vm::MmuKind::Tdp, stage2()] {
            let (on, swept) = {
                let (vm, _, cost) = sixteen_vcpus(mmu, false);
                let mut e = VirtualTime::new(&vm, &cost, readers(100)).unwrap();
                let times = vec![e.run_pass(0).unwrap(), e.run_pass(1).unwrap()];
                ((times, e.vcpu_meters()), e.swept_reads())
            };
            let off = {
                let (vm, _, cost) = sixteen_vcpus(mmu, false);
                let e = VirtualTime::new(&vm, &cost, readers(100)).unwrap();
                let mut e = e.with_fast_forward(false);
                let times = vec![e.run_pass(0).unwrap(), e.run_pass(1).unwrap()];
                (times, e.vcpu_meters())
            };
            assert!(swept > 100_000, "{mmu:?}: {swept} reads swept");
            assert_eq!(on, off, "{mmu:?}");
        }
    }

    /// Reads 1024 pages round and round: a pass that never reaches its `GUEST_SYNC`.
    #[derive(Default)]
    struct Forever(u64);

    impl GuestCode for Forever {
        fn start_pass(&mut self, _: i64) {}
        fn next_access(&mut self) -> Option<GuestAccess> {
            self.0 += 1;
            Some(GuestAccess::first_word(
                Gfn(0x1000 + self.0 % 1024),
                false,
                0,
            ))
        }
        fn access_done(&mut self, _: &GuestAccess) {}
    }

    fn tdp_vm(vcpus: usize) -> Vm {
        let vm = Vm::with_waiter(
            VmConfig {
                vcpus,
                eager_page_split: false,
                mmu: crate::vm::MmuKind::Tdp,
                pml: false,
                kernel: Default::default(),
            },
            Box::new(super::super::VirtualWaiter),
        );
        vm.set_user_memory_region(1, 0x1000 << 12, 4 << 20, Backing::Anonymous, 0)
            .unwrap();
        vm
    }

    /// Two vCPUs of `vm` whose passes never end.
    fn endless(vm: &Vm) -> VirtualTime<'_, Forever> {
        let guests = vec![Forever::default(), Forever::default()];
        VirtualTime::new(vm, &CostModel::default(), guests).unwrap()
    }

    /// The progress oracle's negative control for vCPUs: accesses deliberately priced at
    /// nothing, in a pass that never ends, leave the vCPU's clock where it is; the run fails
    /// with each actor's clock and state instead of hanging.
    #[test]
    fn a_vcpu_whose_clock_stops_is_reported_not_waited_for() {
        let vm = tdp_vm(2);
        let mut e = endless(&vm);
        e.world.access_unit_ps = [0; ACCESS_FIELDS.len()];
        let err = e.run_pass(1).unwrap_err().to_string();
        assert!(err.starts_with("virtual time made no progress"), "{err}");
        assert!(
            err.contains("vCPU 0 at ") && err.contains("in KVM_RUN (iteration 1)"),
            "{err}"
        );
        assert!(err.contains("vCPU 1 at "), "every vCPU is named: {err}");
    }

    /// A test job: `Some(n)` units of work, asking `rwlock_needbreak()` after each; `None`
    /// asks to yield at every chunk and never does any work (a stuck job).
    struct TestJob(Option<u64>);

    impl MmuJob for TestJob {
        fn name(&self) -> &'static str {
            match self.0 {
                Some(_) => "long_job",
                None => "stuck_job",
            }
        }
        fn lock_mode(&self) -> LockMode {
            LockMode::Write
        }
        fn run(
            &mut self,
            _: &Kvm,
            held: &crate::kvm::mmu_lock::MmuLockHeld,
            m: &mut Meter,
        ) -> JobStep {
            let Some(left) = &mut self.0 else {
                return JobStep::Yield;
            };
            while *left > 0 {
                *left -= 1;
                m.spte_reads += 1;
                if held.needbreak(m) {
                    return JobStep::Yield;
                }
            }
            JobStep::Done { flush: None }
        }
    }

    /// The negative control for a vCPU whose clock stops while a job holds the lock: the job's
    /// `needbreak()` runs the vCPUs, the stall is reported, and the job and its plan stop
    /// there instead of running the stalled vCPU again at every one of its 100,000 yield
    /// points (2^20 events each: hours).
    #[test]
    fn a_vcpu_that_stalls_under_a_job_fails_the_plan() {
        let vm = tdp_vm(2);
        let mut e = endless(&vm);
        // The vCPUs map their pages (each read of a page nobody wrote faults the host's zero
        // page in first), then their clocks stop.
        e.start_background_passes(1);
        e.elapse(10_000_000).unwrap();
        e.world.access_unit_ps = [0; ACCESS_FIELDS.len()];
        let plan = OpPlan {
            steps: vec![OpStep::Job(Box::new(TestJob(Some(100_000))))],
        };
        let err = e.run_plans(vec![plan]).unwrap_err().to_string();
        assert!(err.starts_with("virtual time made no progress"), "{err}");
        assert!(err.contains("in KVM_RUN (iteration 1)"), "{err}");
    }

    /// The progress oracle's negative control for jobs: a job that never progresses fails the
    /// plan, naming itself and every vCPU, instead of hanging.
    #[test]
    fn a_job_that_never_progresses_is_reported_not_waited_for() {
        let vm = tdp_vm(1);
        let guests = vec![Sweep {
            vcpu: 0,
            pages: 16,
            i: 0,
            j: 0,
        }];
        let mut e = VirtualTime::new(&vm, &CostModel::default(), guests).unwrap();
        e.run_pass(0).unwrap();
        let plan = OpPlan {
            steps: vec![OpStep::Job(Box::new(TestJob(None)))],
        };
        let err = e.run_plans(vec![plan]).unwrap_err().to_string();
        assert!(err.contains("the job stuck_job did no work"), "{err}");
        assert!(
            err.contains("vCPU 0 at ") && err.contains("outside KVM_RUN"),
            "{err}"
        );
    }

    /// Steps at one picosecond run in vCPU order whoever runs: the running actor stops short of
    /// a lower-index actor's clock and steps at a higher-index one's. Before, it stepped at
    /// either, so two steps at one picosecond ran in an order that depended on which actor
    /// had been running, which a fast-forward phase ending at that clock could change.
    #[test]
    fn simultaneous_steps_run_in_vcpu_order() {
        // vCPU 2 runs (least clock); the next is vCPU 1 at 20 ps, then vCPU 3 at 20 ps.
        let heap = ActorHeap::new(vec![(10, 2), (20, 3), (20, 1), (30, 0)]);
        assert_eq!(heap.min(), Some((10, 2)));
        assert_eq!(heap.horizon(2), Some(19), "vCPU 1 steps first at 20 ps");
        // vCPU 0 runs; the next is vCPU 1 at 20 ps: vCPU 0 steps at 20 ps first.
        let heap = ActorHeap::new(vec![(10, 0), (20, 3), (20, 1)]);
        assert_eq!(heap.horizon(0), Some(20));
        // Alone, an actor has no horizon but the VMM's.
        assert_eq!(ActorHeap::new(vec![(5, 1)]).horizon(1), None);
    }
}
