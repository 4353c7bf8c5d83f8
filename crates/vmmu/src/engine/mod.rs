//! Engines: what drives actors (vCPUs, the VMM thread) over a VM. Both call down into the VM's
//! own exit loop ([`crate::vm::exit`]) and plan interpreter ([`crate::vm::plan`]); they differ
//! in who runs when and how `mmu_lock` is granted. The threads engine runs each actor on an OS
//! thread with the real `mmu_lock`; the virtual-time engine runs every actor on one thread in
//! virtual-time order, charging a cost model.
//!
//! What a vCPU's guest does is the scenario's business ([`GuestCode`]); engines only run it.
//! What a scenario asks of an engine is [`Engine`]: run the vCPUs for a pass, run the VMM's
//! plans, report the vCPUs' meters. A scenario written against it runs on either engine.

pub mod threads;
pub mod virtual_time;

use crate::kvm::meter::Meter;
use crate::kvm::op_plan::OpPlan;

pub use crate::kvm::mmu::GuestOp;
pub use crate::vm::exit::GuestAccess;
pub use crate::vm::host_thread::HostThread;

/// A vCPU's guest code as engines run it: passes of accesses, each ending in a `GUEST_SYNC`
/// exit to userspace. One value per vCPU; engines call it from whichever thread runs that vCPU,
/// never from two at once.
pub trait GuestCode: Send {
    /// The host published `iteration` and the vCPU re-entered `KVM_RUN`: start that pass.
    fn start_pass(&mut self, iteration: i64);

    /// The next access of the pass, or `None` at its `GUEST_SYNC`.
    fn next_access(&mut self) -> Option<GuestAccess>;

    /// `access` (the last one [`GuestCode::next_access`] returned) completed: the guest saw it
    /// retire. Not called when `KVM_RUN` failed on it.
    fn access_done(&mut self, access: &GuestAccess);

    /// `access`, a nested guest's, faulted in L1's own tables and KVM reflected the fault to
    /// L1: the vCPU runs L1 now, whose code fixes its tables and resumes the nested guest,
    /// which tries the access again. Only guests that run nested guests see this.
    fn access_reflected(&mut self, access: &GuestAccess) {
        unreachable!("{access:?} was reflected to L1, but this guest runs no nested guest")
    }

    /// What the current pass promises of its accesses: all plain accesses
    /// ([`GuestOp::Access`](crate::kvm::mmu::GuestOp)) within gfns no other vCPU touches until
    /// the pass ends. `None` (the default): nothing promised. The virtual-time engine's
    /// fast-forward runs such a pass's accesses out of turn when the MMU's tables allow
    /// (`engine::virtual_time::fast_forward`).
    fn private_gfns(&self) -> Option<PrivateGfns> {
        None
    }

    /// What the current pass promises of its accesses from the next one on when other vCPUs
    /// may use the same gfns: all plain reads ([`GuestOp::Access`](crate::kvm::mmu::GuestOp)),
    /// of gfns within the range. `None` (the default): nothing promised. Fast-forward runs
    /// such reads out of turn while their walks complete and change nothing, up to the first
    /// gfn whose walk does not, which the guest reaches no sooner than
    /// [`GuestCode::accesses_before`] says.
    fn shared_reads(&self) -> Option<crate::units::GfnRange> {
        None
    }

    /// At least how many accesses the pass makes, from its next one on, before its first
    /// access to a gfn at or above `end` within the range it promised
    /// ([`GuestCode::private_gfns`], [`GuestCode::shared_reads`]): a guest whose accesses
    /// rise through its range can say, and fast-forward then runs it out of turn while the
    /// tables allow the walks below `end` only. Counts only the accesses of the current pass
    /// (one that ends before reaching `end` may say how many it has left). 0 (the default):
    /// nothing known.
    fn accesses_before(&self, _end: crate::units::Gfn) -> u64 {
        0
    }

    /// The run of reads the pass makes from its next access on, if it is one: `len` plain
    /// reads of the first word ([`GuestAccess::first_word`], no computing first) of the gfns
    /// `first`, `first - 1`, … down by one. `None` (the default): nothing known. The
    /// virtual-time engine makes such reads that each hit the second-level TLB in one step
    /// ([`GuestCode::skip_accesses`]).
    fn descending_reads(&self) -> Option<DescendingReads> {
        None
    }

    /// The run of writes the pass makes from its next access on, if it is one: `len` plain
    /// writes of `value` to the first word ([`GuestAccess::first_word`], no computing first)
    /// of the gfns `first`, `first + 1`, … up by one. `None` (the default): nothing known. The
    /// virtual-time engine makes such writes that miss the TLB in one step
    /// ([`GuestCode::skip_accesses`]).
    fn ascending_writes(&self) -> Option<AscendingWrites> {
        None
    }

    /// The next `n` accesses (at most the `len` of the run [`GuestCode::descending_reads`] or
    /// [`GuestCode::ascending_writes`] announced) completed: what `n` calls of
    /// [`GuestCode::next_access`] and [`GuestCode::access_done`] would do.
    fn skip_accesses(&mut self, n: u64) {
        assert_eq!(n, 0, "this guest announced no accesses to skip");
    }
}

/// A run of writes a guest makes next ([`GuestCode::ascending_writes`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct AscendingWrites {
    /// The gfn of the first write; each next one is one above.
    pub first: crate::units::Gfn,
    /// How many writes.
    pub len: u64,
    /// The value each writes.
    pub value: u64,
}

/// A run of reads a guest makes next ([`GuestCode::descending_reads`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DescendingReads {
    /// The gfn of the first read; each next one is one below.
    pub first: crate::units::Gfn,
    /// How many reads (at most `first + 1`).
    pub len: u64,
}

/// The gfns a vCPU's pass keeps to and no other vCPU touches meanwhile
/// ([`GuestCode::private_gfns`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PrivateGfns {
    /// Every access of the pass is to a gfn of this range.
    pub range: crate::units::GfnRange,
    /// Some of them may write.
    pub write: bool,
}

/// What an engine's times measure.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TimeSource {
    /// Wall-clock time on this host (the threads engine; real KVM too).
    Wall,
    /// Virtual time priced by a cost model (the virtual-time engine): deterministic.
    Virtual,
}

/// Why an engine could not finish what it was asked: one line that says what went wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A vCPU's `KVM_RUN` or the VMM's ioctl failed.
    #[error(transparent)]
    Vm(#[from] crate::vm::VmError),
    /// The progress oracle: a run stopped making progress; what every actor was doing.
    #[error("{0}")]
    Stalled(String),
    /// A situation the engine does not model, and what to do instead.
    #[error("{0}")]
    Unsupported(String),
    /// A vCPU thread could not start, or panicked (the threads engine).
    #[error("{0}")]
    Thread(String),
    /// The cost model cannot drive virtual time.
    #[error("{0}")]
    CostModel(String),
}

/// What a scenario asks of an engine driving a VM's actors. Times are nanoseconds of the
/// engine's clock: wall-clock for the threads engine, virtual for the virtual-time engine.
pub trait Engine {
    /// The engine's name in reports (`threads`, `virtual`).
    fn name(&self) -> &'static str;

    /// What its times measure.
    fn time_source(&self) -> TimeSource;

    /// The host publishes `iteration`; every vCPU enters `KVM_RUN`, makes that pass of its
    /// guest code and exits to userspace at its `GUEST_SYNC`. Returns when the last one has,
    /// with the time since the host published the iteration. An error is a `KVM_RUN` that
    /// failed.
    fn run_pass(&mut self, iteration: i64) -> Result<u64, EngineError>;

    /// The host publishes `iteration` and goes on without waiting: every vCPU makes passes of
    /// it, one after another, until [`Engine::stop_vcpus`] (dirty_log_perf_test's `-e`).
    fn start_background_passes(&mut self, iteration: i64);

    /// `host_quit`: every vCPU finishes the pass it is making and leaves `KVM_RUN` for good.
    /// Reports an error a vCPU hit since the last pass the host waited for.
    fn stop_vcpus(&mut self) -> Result<(), EngineError>;

    /// The VMM thread runs `plans` (its ioctls) in order, while any running vCPUs go on;
    /// returns the time they took. What the plans count is added to the VM's VMM meter.
    fn run_plans(&mut self, plans: Vec<OpPlan>) -> Result<u64, EngineError>;

    /// What each vCPU has counted so far (as of its last completed pass).
    fn vcpu_meters(&self) -> Vec<Meter>;

    /// The VMM thread spends `ns` outside KVM (sending pages over a link, sleeping) while any
    /// vCPUs in a background pass go on; returns when that time has passed, with every such
    /// vCPU brought up to it (virtual time), so what the guests did by then can be read. Returns
    /// the time that passed: `ns` in virtual time, what the clock measured on threads.
    fn elapse(&mut self, ns: u64) -> Result<u64, EngineError>;

    /// Every vCPU makes pass `iteration` (as [`Engine::run_pass`]) while `host`, a host thread
    /// such as kswapd, runs beside them: its plans run as the VMM's do, and while it sleeps
    /// it waits for its wake flag. Returns when the last vCPU has reached its `GUEST_SYNC`,
    /// with the time since the host published the iteration; the host thread stops then, and
    /// goes on from where it was at the next call.
    fn run_pass_beside(
        &mut self,
        iteration: i64,
        host: &mut dyn HostThread,
    ) -> Result<u64, EngineError>;

    /// Host threads each run their plans to the end, at the same time (the selftests' vCPU
    /// threads doing host work, such as access_tracking_perf_test marking pages idle through
    /// `/sys/kernel/mm/page_idle/bitmap`). Returns when the last one is done, with the time
    /// since they started.
    fn run_host_threads(
        &mut self,
        threads: &mut [&mut (dyn HostThread + Send)],
    ) -> Result<u64, EngineError>;
}
