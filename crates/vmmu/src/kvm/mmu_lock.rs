//! `mmu_lock`: an rwlock that counts acquisitions, contentions and time spent waiting (as
//! lock_stat does), and answers `rwlock_needbreak()`.
//!
//! MMU code never takes it: the engine that drives an actor takes it in the mode the operation
//! declared ([`LockMode`]) and hands the MMU an [`MmuLockHeld`], through which long operations
//! ask whether to yield. The threads engine uses the real lock below; the virtual-time engine
//! grants it in virtual time and answers `needbreak()` through a [`WaiterProbe`].

use super::meter::Meter;
use parking_lot::lock_api::RawRwLock as _;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// Which side of `mmu_lock` an operation needs.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum LockMode {
    /// `read_lock(&kvm->mmu_lock)`: shared with other readers.
    Read,
    /// `write_lock(&kvm->mmu_lock)`: exclusive.
    Write,
}

/// The lock modes as types ([`Held`]).
pub trait HeldMode: Copy + sealed::Sealed {
    /// The mode this type stands for.
    const MODE: LockMode;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Read {}
    impl Sealed for super::Write {}
}

/// `read_lock(&kvm->mmu_lock)`, as a type.
#[derive(Copy, Clone, Debug)]
pub enum Read {}

/// `write_lock(&kvm->mmu_lock)`, as a type.
#[derive(Copy, Clone, Debug)]
pub enum Write {}

impl HeldMode for Read {
    const MODE: LockMode = LockMode::Read;
}

impl HeldMode for Write {
    const MODE: LockMode = LockMode::Write;
}

/// A hold of `mmu_lock` known to be in mode `M`: a function that needs the write lock takes a
/// `Held<Write>`, and one that must run under the read lock (KVM's atomic SPTE updates assert
/// `lockdep_assert_held_read()`) a `Held<Read>`; handing it the other is a compile error.
/// Dereferences to the [`MmuLockHeld`] it views (`needbreak()`, the grant time).
pub struct Held<'h, M> {
    held: &'h MmuLockHeld<'h>,
    _mode: PhantomData<M>,
}

impl<M> Clone for Held<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<M> Copy for Held<'_, M> {}

impl<'h, M> std::ops::Deref for Held<'h, M> {
    type Target = MmuLockHeld<'h>;
    fn deref(&self) -> &MmuLockHeld<'h> {
        self.held
    }
}

/// A hold with its mode in the type, either one ([`MmuLockHeld::typed`]).
#[derive(Copy, Clone)]
pub enum TypedHeld<'h> {
    /// The read lock.
    Read(Held<'h, Read>),
    /// The write lock.
    Write(Held<'h, Write>),
}

/// Which of Linux's locks `kvm->mmu_lock` is: the MMU declares it
/// ([`crate::kvm::mmu::Mmu::mmu_lock_kind`]), and the virtual-time engine runs that lock's
/// protocol step by step.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum LockKind {
    /// `rwlock_t`, the queued rwlock of `kernel/locking/qrwlock.c` (x86 since 5.13, arm64 since
    /// 5.18).
    #[default]
    Rwlock,
    /// `spinlock_t`, the queued spinlock of `kernel/locking/qspinlock.c` (arm64 up to 5.17):
    /// every holder excludes every other.
    Spinlock,
}

/// The protocol step that moved the lock word's cache line (see the virtual-time lock's
/// documentation for the kernel function each stands for).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum LineStep {
    /// The fast path's one atomic (`queued_spin_trylock()`, `queued_write_lock()`'s cmpxchg,
    /// `queued_read_lock()`'s add, also when it fails and falls into the slow path).
    Fast,
    /// A first waiter sets the pending bit (`queued_fetch_set_pending_acquire()`).
    Pending,
    /// A later waiter joins the MCS queue (`xchg_tail()`), is handed the head role on its own
    /// node (`arch_mcs_spin_unlock_contended()`), and as head first reads the lock word.
    Mcs,
    /// `wait_lock` passes from one queued waiter of the rwlock to the next: the unlock store,
    /// the next one's read and its `clear_pending_set_locked()` / `set_locked()`.
    WaitLock,
    /// The lock passes from a holder to a waiter spinning on it: the holder's release store
    /// invalidates the waiter's copy, the waiter reads it and takes the lock with a cmpxchg.
    Handoff,
    /// A reader queued on `wait_lock` adds its bias and is admitted
    /// (`queued_read_lock_slowpath()`).
    ReaderAdmission,
    /// A writer announces itself (`_QW_WAITING`) and, once the readers have drained, reads the
    /// count and takes the lock (`queued_write_lock_slowpath()`).
    WriterDrain,
    /// A reader's release atomic (`queued_read_unlock()`) on a line another core took since.
    Release,
    /// A waiter spinning on the lock word (`smp_cond_load_acquire()`,
    /// `atomic_cond_read_acquire()`) reads it again after another core's store invalidated its
    /// copy, a store that did not end its wait.
    Spin,
}

/// Every [`LineStep`] with its counter's name, in [`LockStats::line_transfers`] order.
pub const LINE_STEPS: [(LineStep, &str); 9] = [
    (LineStep::Fast, "fast"),
    (LineStep::Pending, "pending"),
    (LineStep::Mcs, "mcs"),
    (LineStep::WaitLock, "wait_lock"),
    (LineStep::Handoff, "handoff"),
    (LineStep::ReaderAdmission, "reader_admission"),
    (LineStep::WriterDrain, "writer_drain"),
    (LineStep::Release, "release"),
    (LineStep::Spin, "spin"),
];

/// Counters of one lock, lock_stat style (`CONFIG_LOCK_STAT`'s acquisitions, contentions, wait
/// and hold times per mode), and, in virtual time, the lock word's line transfers by protocol
/// step.
#[derive(Debug, Default)]
pub struct LockStats {
    /// Read acquisitions.
    pub read_acquired: AtomicU64,
    /// Write acquisitions.
    pub write_acquired: AtomicU64,
    /// Read acquisitions that had to wait.
    pub read_contended: AtomicU64,
    /// Write acquisitions that had to wait.
    pub write_contended: AtomicU64,
    /// Nanoseconds readers spent waiting.
    pub read_wait_ns: AtomicU64,
    /// Nanoseconds writers spent waiting.
    pub write_wait_ns: AtomicU64,
    /// Nanoseconds readers held the lock (virtual time only).
    pub read_hold_ns: AtomicU64,
    /// Nanoseconds writers held the lock (virtual time only).
    pub write_hold_ns: AtomicU64,
    /// Transfers of the lock word's line, by [`LineStep`] ([`LINE_STEPS`] order; virtual time
    /// only).
    pub line_transfers: [AtomicU64; LINE_STEPS.len()],
    /// How many of those crossed sockets.
    pub line_transfers_remote: AtomicU64,
    /// Contended acquisitions that waited for a holder's release ([`LineStep::Handoff`] or a
    /// writer's drain): the hand-offs.
    pub handoffs: AtomicU64,
    /// Nanoseconds from those releases to the next holder's start: the hand-off latency.
    pub handoff_ns: AtomicU64,
}

impl LockStats {
    /// A snapshot as name → value.
    pub fn snapshot(&self) -> std::collections::BTreeMap<String, u64> {
        let f = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("mmu_lock_read_acquired", f(&self.read_acquired)),
            ("mmu_lock_write_acquired", f(&self.write_acquired)),
            ("mmu_lock_read_contended", f(&self.read_contended)),
            ("mmu_lock_write_contended", f(&self.write_contended)),
            ("mmu_lock_read_wait_ns", f(&self.read_wait_ns)),
            ("mmu_lock_write_wait_ns", f(&self.write_wait_ns)),
            ("mmu_lock_read_hold_ns", f(&self.read_hold_ns)),
            ("mmu_lock_write_hold_ns", f(&self.write_hold_ns)),
            (
                "mmu_lock_line_transfers_remote",
                f(&self.line_transfers_remote),
            ),
            ("mmu_lock_handoffs", f(&self.handoffs)),
            ("mmu_lock_handoff_ns", f(&self.handoff_ns)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .chain(
            LINE_STEPS
                .iter()
                .zip(&self.line_transfers)
                .map(|((_, name), a)| (format!("mmu_lock_line_transfers_{name}"), f(a))),
        )
        .collect()
    }
}

/// The host kernel's preemption model, as far as `mmu_lock` sees it: whether
/// `rwlock_needbreak()` can report a waiter.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preemption {
    /// `CONFIG_PREEMPTION` (`PREEMPT`, `PREEMPT_RT`, and every `PREEMPT_DYNAMIC` build, which
    /// distribution kernels use since Linux 5.12 whatever the boot-time mode):
    /// `rwlock_needbreak()` is `rwlock_is_contended()`, so long jobs yield to waiters.
    #[default]
    Full,
    /// `PREEMPT_NONE` or `PREEMPT_VOLUNTARY` without `PREEMPT_DYNAMIC`: `rwlock_needbreak()`
    /// is always false, so long jobs yield only when the scheduler wants the CPU
    /// (`need_resched()`, which the model never sets): they keep `mmu_lock` to the end.
    None,
}

/// The instrumented rwlock. parking_lot's rwlock, like the kernel's queued rwlock, makes new
/// readers wait behind a waiting writer, so a writer is not starved by a stream of faults.
pub struct MmuLock {
    raw: parking_lot::RawRwLock,
    waiters: AtomicU32,
    /// The test waiter of [`MmuLock::force_needbreak_every`].
    forced: ForcedWaiter,
    /// `rwlock_needbreak()` can report waiters (`CONFIG_PREEMPTION`).
    preemption: bool,
    /// The counters.
    pub stats: LockStats,
}

impl Default for MmuLock {
    fn default() -> Self {
        Self::new(Preemption::Full)
    }
}

impl MmuLock {
    /// A free lock on a host kernel with `preemption`.
    pub fn new(preemption: Preemption) -> Self {
        MmuLock {
            raw: parking_lot::RawRwLock::INIT,
            waiters: AtomicU32::new(0),
            forced: ForcedWaiter::default(),
            preemption: preemption == Preemption::Full,
            stats: LockStats::default(),
        }
    }

    /// Takes the lock in `mode`, counting a contention (and the wait) when it was not free.
    pub fn lock(&self, mode: LockMode) -> MmuLockHeld<'_> {
        let got = match mode {
            LockMode::Read => self.raw.try_lock_shared(),
            LockMode::Write => self.raw.try_lock_exclusive(),
        };
        let (acq, cont, wait) = match mode {
            LockMode::Read => (
                &self.stats.read_acquired,
                &self.stats.read_contended,
                &self.stats.read_wait_ns,
            ),
            LockMode::Write => (
                &self.stats.write_acquired,
                &self.stats.write_contended,
                &self.stats.write_wait_ns,
            ),
        };
        let mut waited_ns = 0;
        if !got {
            // Announce the wait before blocking: the holder's needbreak() reads this count.
            self.waiters.fetch_add(1, Ordering::SeqCst);
            let start = Instant::now();
            match mode {
                LockMode::Read => self.raw.lock_shared(),
                LockMode::Write => self.raw.lock_exclusive(),
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
            cont.fetch_add(1, Ordering::Relaxed);
            waited_ns = start.elapsed().as_nanos() as u64;
            wait.fetch_add(waited_ns, Ordering::Relaxed);
        }
        acq.fetch_add(1, Ordering::Relaxed);
        MmuLockHeld {
            lock: self,
            mode,
            real: true,
            waited_ns,
            probe: None,
            virtual_start_ps: None,
        }
    }

    /// A token that says `mode` is held in virtual time (the virtual-time engine's grant); it
    /// does not touch the real lock.
    pub fn virtual_grant(&self, mode: LockMode) -> MmuLockHeld<'_> {
        self.virtual_grant_after(mode, 0)
    }

    /// [`MmuLock::virtual_grant`] to a request that waited `waited_ns` of virtual time.
    pub fn virtual_grant_after(&self, mode: LockMode, waited_ns: u64) -> MmuLockHeld<'_> {
        MmuLockHeld {
            lock: self,
            mode,
            real: false,
            waited_ns,
            probe: None,
            virtual_start_ps: None,
        }
    }

    /// [`MmuLock::virtual_grant_after`] whose `needbreak()` asks `probe` whether another actor
    /// has asked for the lock by the time the holder's work has reached.
    pub fn virtual_grant_probed<'a>(
        &'a self,
        mode: LockMode,
        waited_ns: u64,
        probe: &'a dyn WaiterProbe,
    ) -> MmuLockHeld<'a> {
        MmuLockHeld {
            lock: self,
            mode,
            real: false,
            waited_ns,
            probe: Some(probe),
            virtual_start_ps: None,
        }
    }

    /// A test hook that makes long operations yield without another thread: from now on a
    /// waiter arrives at every `every`-th call of [`MmuLock::needbreak`] and waits until the
    /// lock is next released, as a vCPU queued on `mmu_lock` would; 0 turns it off. With 1 a
    /// waiter is there at every check, so every yield point yields. (KVM's shadow-MMU split
    /// checks `rwlock_needbreak()` before it splits anything, so with a waiter at every check it
    /// never progresses, in KVM too; it needs 2 or more.)
    pub fn force_needbreak_every(&self, every: u32) {
        self.forced.calls.store(0, Ordering::Relaxed);
        self.forced.waiting.store(false, Ordering::Relaxed);
        self.forced.every.store(every, Ordering::Relaxed);
    }

    /// `rwlock_needbreak()`: someone is waiting for the lock (or the waiter of
    /// [`MmuLock::force_needbreak_every`]); always false without `CONFIG_PREEMPTION`.
    pub fn needbreak(&self) -> bool {
        self.preemption && (self.forced.needbreak() || self.waiters.load(Ordering::SeqCst) > 0)
    }
}

/// The waiter [`MmuLock::force_needbreak_every`] sets up.
#[derive(Default)]
struct ForcedWaiter {
    /// A waiter arrives at every `every`-th check; 0: never.
    every: AtomicU32,
    /// Checks since it was set up, while nobody waited.
    calls: AtomicU64,
    /// A waiter has arrived and not yet had the lock.
    waiting: AtomicBool,
}

impl ForcedWaiter {
    fn needbreak(&self) -> bool {
        let every = self.every.load(Ordering::Relaxed);
        if every == 0 {
            return false;
        }
        if self.waiting.load(Ordering::Relaxed) {
            return true;
        }
        let arrives =
            (self.calls.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(u64::from(every));
        self.waiting.store(arrives, Ordering::Relaxed);
        arrives
    }

    /// The lock was released: the waiter has had it.
    fn served(&self) {
        if self.waiting.load(Ordering::Relaxed) {
            self.waiting.store(false, Ordering::Relaxed);
        }
    }
}

/// How the virtual-time engine answers `rwlock_needbreak()` for a holder it runs: the holder's
/// clock is where its work (counted on its meter) has brought it, and the other actors are
/// brought up to that clock before the question is answered, so a long job yields exactly when
/// an actor asked for the lock while it held it, and never to an actor that did not.
pub trait WaiterProbe {
    /// Whether an actor has requested the lock, in a mode that conflicts with the holder's, by
    /// the time the holder's work has counted `meter`.
    fn waiting_by(&self, meter: &Meter) -> bool;
}

/// Proof that `mmu_lock` is held in a given mode; dropping it releases the lock. MMU functions
/// take one to state (and assert, like `lockdep_assert_held_*`) which lock they run under.
pub struct MmuLockHeld<'a> {
    lock: &'a MmuLock,
    mode: LockMode,
    real: bool,
    waited_ns: u64,
    /// The virtual-time engine's answer to `needbreak()` (`None`: the waiter count).
    probe: Option<&'a dyn WaiterProbe>,
    /// The virtual time of the grant, in ps (`None` on real threads, or where the engine did
    /// not say).
    virtual_start_ps: Option<u64>,
}

impl<'a> MmuLockHeld<'a> {
    /// The mode held.
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// The same hold, granted at virtual time `ps` (the virtual-time engine says when).
    pub fn at_virtual_ps(mut self, ps: u64) -> Self {
        self.virtual_start_ps = Some(ps);
        self
    }

    /// The virtual time of the grant, in ps, where the engine gave it.
    pub fn virtual_start_ps(&self) -> Option<u64> {
        self.virtual_start_ps
    }

    /// How long this acquisition waited for the lock (0 when it was free), so an actor can
    /// account its own waits.
    pub fn waited_ns(&self) -> u64 {
        self.waited_ns
    }
    /// Releases the lock handing it to the waiters first (a fair unlock), as dropping the lock
    /// in `cond_resched_rwlock_*()` does on the kernel's queued rwlock.
    pub fn unlock_fair(self) {
        let this = std::mem::ManuallyDrop::new(self);
        this.lock.forced.served();
        if this.real {
            use parking_lot::lock_api::RawRwLockFair as _;
            // SAFETY: as in Drop: the raw lock is held in `this.mode`; ManuallyDrop keeps Drop
            // from releasing it a second time.
            unsafe {
                match this.mode {
                    LockMode::Read => this.lock.raw.unlock_shared_fair(),
                    LockMode::Write => this.lock.raw.unlock_exclusive_fair(),
                }
            }
        }
    }
    /// This hold as the write lock: what `lockdep_assert_held_write()` checks at run time, in
    /// the type, so a function that needs the write lock cannot be handed a read hold. Panics on
    /// a read hold: an MMU converts the engine's hold where it declared the mode it needs (its
    /// fault's slow half, a job, a notifier callback).
    pub fn write(&self) -> Held<'_, Write> {
        assert_eq!(
            self.mode,
            LockMode::Write,
            "mmu_lock must be held for write"
        );
        Held {
            held: self,
            _mode: PhantomData,
        }
    }

    /// This hold as the read lock (`lockdep_assert_held_read()`, in the type). Panics on a write
    /// hold.
    pub fn read(&self) -> Held<'_, Read> {
        assert_eq!(self.mode, LockMode::Read, "mmu_lock must be held for read");
        Held {
            held: self,
            _mode: PhantomData,
        }
    }

    /// This hold with its mode in the type, for code that runs under either.
    pub fn typed(&self) -> TypedHeld<'_> {
        match self.mode {
            LockMode::Read => TypedHeld::Read(Held {
                held: self,
                _mode: PhantomData,
            }),
            LockMode::Write => TypedHeld::Write(Held {
                held: self,
                _mode: PhantomData,
            }),
        }
    }
    /// `rwlock_needbreak()` on the held lock, asked by a holder whose work so far is counted on
    /// `meter` (the virtual-time engine reads the holder's clock from it, and runs the other
    /// actors up to that clock on this thread before it answers; a real lock ignores it).
    pub fn needbreak(&self, meter: &Meter) -> bool {
        if self.lock.needbreak() {
            return true;
        }
        self.lock.preemption && self.probe.is_some_and(|p| p.waiting_by(meter))
    }
}

impl Drop for MmuLockHeld<'_> {
    fn drop(&mut self) {
        self.lock.forced.served();
        if self.real {
            // SAFETY: a real MmuLockHeld is only created by MmuLock::lock after acquiring the raw
            // lock in `self.mode`, and it is dropped exactly once.
            unsafe {
                match self.mode {
                    LockMode::Read => self.lock.raw.unlock_shared(),
                    LockMode::Write => self.lock.raw.unlock_exclusive(),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn without_preemption_needbreak_never_reports_a_waiter() {
        let lock = Arc::new(MmuLock::new(Preemption::None));
        let r = lock.lock(LockMode::Read);
        let l2 = Arc::clone(&lock);
        let writer = std::thread::spawn(move || drop(l2.lock(LockMode::Write)));
        while lock.waiters.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        assert!(
            !r.needbreak(&Meter::default()),
            "rwlock_needbreak() is 0 without CONFIG_PREEMPTION"
        );
        lock.force_needbreak_every(1);
        assert!(!r.needbreak(&Meter::default()));
        lock.force_needbreak_every(0);
        drop(r);
        writer.join().unwrap();
    }

    #[test]
    fn readers_share_and_a_waiting_writer_makes_needbreak_true() {
        let lock = Arc::new(MmuLock::default());
        let r1 = lock.lock(LockMode::Read);
        let r2 = lock.lock(LockMode::Read);
        assert!(!r1.needbreak(&Meter::default()));
        let l2 = Arc::clone(&lock);
        let writer = std::thread::spawn(move || {
            let w = l2.lock(LockMode::Write);
            let _: Held<'_, Write> = w.write();
        });
        while !r1.needbreak(&Meter::default()) {
            std::thread::yield_now();
        }
        drop(r1);
        drop(r2);
        writer.join().unwrap();
        assert_eq!(lock.stats.write_contended.load(Ordering::Relaxed), 1);
        assert_eq!(lock.stats.read_acquired.load(Ordering::Relaxed), 2);
        assert!(!lock.needbreak());
    }

    #[test]
    fn a_forced_waiter_arrives_every_nth_check_and_waits_until_the_lock_is_released() {
        let lock = MmuLock::default();
        lock.force_needbreak_every(3);
        let held = lock.lock(LockMode::Write);
        let checks: Vec<bool> = (0..4).map(|_| held.needbreak(&Meter::default())).collect();
        assert_eq!(checks, [false, false, true, true], "it waits until served");
        held.unlock_fair();
        let held = lock.virtual_grant(LockMode::Read);
        let checks: Vec<bool> = (0..3).map(|_| held.needbreak(&Meter::default())).collect();
        assert_eq!(checks, [false, false, true]);
        drop(held);
        let held = lock.lock(LockMode::Read);
        assert!(
            !held.needbreak(&Meter::default()),
            "served when the grant was dropped"
        );
        lock.force_needbreak_every(0);
        assert!((0..6).all(|_| !held.needbreak(&Meter::default())));
    }
}
