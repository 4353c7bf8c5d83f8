//! `mmu_lock` in virtual time, as Linux builds it: the queued spinlock
//! (`kernel/locking/qspinlock.c`, arm64's `mmu_lock` up to 5.17) and the queued rwlock
//! (`kernel/locking/qrwlock.c`, x86's `mmu_lock`, and arm64's from 5.18), step by step, each
//! step paying the transfers of the lock word's cache line it causes.
//!
//! # Grants
//!
//! Requests arrive in virtual-time order and are granted first come, first served, as the
//! kernel's locks grant them: the qspinlock's pending waiter and MCS queue are FIFO, and every
//! qrwlock waiter queues on `wait_lock`. A holder's hold is known when it is granted (its work
//! runs at the grant), so each request is worked out completely when it arrives, from the holds
//! reserved before it. Simplified (`queued_write_lock_slowpath()`): a writer blocks readers
//! from the moment it arrives; in the kernel it does so once it holds `wait_lock` and has set
//! `_QW_WAITING`, a few transfers later, and readers that arrive in between still take the
//! fast path.
//!
//! # The lock word's line
//!
//! Every atomic or store on the lock word by a core that does not have its line exclusively
//! costs one transfer, within the socket or across ([`LineCost`]), and the line serves one
//! transfer at a time: a transfer takes the first free slot of the line at or after the moment
//! its cause happened (`LineCalendar`). A waiter spins reading the word (holding the line
//! shared), so the holder's release must take the line back from it, and the waiter must read
//! it again and then take it exclusively for its cmpxchg: three transfers between the two cores
//! before the next holder starts ([`LineStep::Handoff`]). A core's atomics in a row on a line
//! nobody took in between move nothing (the slow path's pending bit or `xchg_tail()` right
//! after its failed fast-path atomic). Per step, from the code (`LineStep` names the counter):
//!
//! | kernel code | transfers | step |
//! |---|---|---|
//! | `queued_spin_lock()`, `queued_write_lock()`: the cmpxchg on a free lock; `queued_read_lock()`'s `atomic_add_return_acquire()` | 1 when another core used the line last | `Fast` |
//! | `queued_read_unlock()`: `atomic_sub_return_release()` by a reader whose acquire took the line from another core, at the reader's end, which waits for it | 1 | `Release` |
//! | a slow path's arrival (its failed fast-path atomic) when one core holds the spinlock and none waits; then `queued_fetch_set_pending_acquire()` | 1 | `Pending` |
//! | an arrival when a waiter is already there; then `xchg_tail()`; the predecessor's `arch_mcs_spin_unlock_contended()` writes this waiter's node (a line of its own, off the lock word) | 1 + 1 | `Mcs` |
//! | the holder's unlock store, the waiter's `smp_cond_load_acquire()` / `atomic_cond_read_acquire()` read, its `clear_pending_set_locked()` / `set_locked()` / cmpxchg (a reader queued behind a writer has added its bias already: no cmpxchg) | 3 (2) | `Handoff` |
//! | `arch_spin_unlock(&lock->wait_lock)` by one rwlock waiter as soon as it has the rwlock, the next one's read and `set_locked()` | 3 | `WaitLock` |
//! | `queued_read_lock_slowpath()`: the arrival when `wait_lock` is free; the `atomic_add(_QR_BIAS)` after taking `wait_lock` finds the line there | 1 | `ReaderAdmission` |
//! | `queued_write_lock_slowpath()`: the arrival when `wait_lock` is free (then `atomic_or(_QW_WAITING)` finds the line there); after the last reader's release, the read that sees `_QW_WAITING` alone and the cmpxchg to `_QW_LOCKED` | 1 + 2 | `WriterDrain` |
//!
//! So readers that queued behind a writer are admitted one at a time: each takes `wait_lock`
//! from the one before (3 transfers) before it can add its bias. A writer behind a writer with
//! another waiting pays, on the line, its arrival (1), taking `wait_lock` (3) and the hand-off
//! (3): under contention the line, not the critical section, can be what bounds the lock's
//! throughput. Simplified: a spinning waiter's re-reads after stores that do not end its wait
//! are not counted.
//!
//! Each transfer costs the in-socket or the cross-socket latency of the cost model, depending
//! on the sockets of the two cores ([`crate::cost::Host::vcpu_sockets`]).

use super::pricer::{ps_to_ns, Ps};
use crate::cost::CostModel;
use crate::kvm::meter::MeterField;
use crate::kvm::mmu_lock::{LineStep, LockKind, LockMode, LockStats, LINE_STEPS};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

/// The core an actor runs on, as the lock sees it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Core {
    /// The actor (a vCPU's index, or [`VMM_ACTOR`]).
    pub actor: usize,
    /// Its socket.
    pub socket: u32,
}

/// The actor number of the VMM thread (vCPUs use their index).
pub const VMM_ACTOR: usize = usize::MAX;

/// The socket the VMM thread runs on.
pub const VMM_SOCKET: u32 = 0;

/// The VMM thread's core.
pub const VMM_CORE: Core = Core {
    actor: VMM_ACTOR,
    socket: VMM_SOCKET,
};

/// What one transfer of a line costs: in the socket, and across sockets.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineCost {
    /// In-socket transfer.
    pub local: Ps,
    /// Cross-socket transfer.
    pub remote: Ps,
}

impl LineCost {
    /// The cost model's `lock_line_transfer_ns` and `lock_line_transfer_remote_ns`.
    pub fn from_cost_model(cost: &CostModel) -> LineCost {
        let ps = |field| (cost.unit_costs()[field as usize] * 1000.0).round() as Ps;
        LineCost {
            local: ps(MeterField::lock_line_transfers),
            remote: ps(MeterField::lock_line_transfers_remote),
        }
    }

    /// One transfer from a core on socket `from` to one on `to`.
    pub fn between(&self, from: u32, to: u32) -> Ps {
        if from == to {
            self.local
        } else {
            self.remote
        }
    }
}

/// A request as the lock granted it.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// When the holder's critical section starts: its acquire's transfers are done.
    pub start: Ps,
    /// It took the slow path: a contention, as lock_stat counts one.
    pub contended: bool,
    /// A reader whose acquire took the line from another core releases with an atomic that
    /// takes it back from that core's socket (`queued_read_unlock()`): the socket.
    pub release_from: Option<u32>,
}

/// Who holds the lock ([`VirtualLock::hold`]): the mode, the core, and when the hold was asked
/// for, `None` for a job resuming a hold it never released (no new acquisition).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HoldBy {
    /// The mode held.
    pub mode: LockMode,
    /// The holder's core.
    pub core: Core,
    /// When the acquisition was requested, if this is one.
    pub requested: Option<Ps>,
}

impl Grant {
    /// A job resuming a hold it never released: no acquire, nothing to release yet.
    pub fn resumed(at: Ps) -> Grant {
        Grant {
            start: at,
            ..Grant::default()
        }
    }
}

/// The lock word's line over virtual time: the transfers reserved on it, as busy intervals,
/// sorted and merged. A transfer takes the first free slot at or after its cause, so one
/// caused early (a waiter's arrival during a long hold) does not queue behind one caused
/// later but reserved first (the hand-off at that hold's end).
#[derive(Debug, Default)]
struct LineCalendar {
    busy: VecDeque<(Ps, Ps)>,
    /// The shortest transfer: a gap shorter than this can never be used, so the intervals
    /// around it are kept as one (the same reservations, fewer intervals to search).
    min_len: Ps,
}

impl LineCalendar {
    /// An empty line whose transfers take at least `min_len`.
    fn new(min_len: Ps) -> Self {
        LineCalendar {
            busy: VecDeque::new(),
            min_len,
        }
    }

    /// Reserves `len` at the first free slot at or after `at`; returns its end.
    fn reserve(&mut self, at: Ps, len: Ps) -> Ps {
        let mut i = self.busy.partition_point(|&(_, end)| end <= at);
        let mut start = at;
        while let Some(&(s, e)) = self.busy.get(i) {
            if start + len <= s {
                break;
            }
            start = start.max(e);
            i += 1;
        }
        let end = start + len;
        let joins_prev = i > 0 && start < self.busy[i - 1].1 + self.min_len.max(1);
        let joins_next = self
            .busy
            .get(i)
            .is_some_and(|&(s, _)| s < end + self.min_len.max(1));
        match (joins_prev, joins_next) {
            (true, true) => {
                self.busy[i - 1].1 = self.busy[i].1;
                self.busy.remove(i);
            }
            (true, false) => self.busy[i - 1].1 = end,
            (false, true) => self.busy[i].0 = start,
            (false, false) => self.busy.insert(i, (start, end)),
        }
        end
    }

    /// Forgets what ended by `t`: no request arrives before the one being worked out.
    fn forget_before(&mut self, t: Ps) {
        while self.busy.front().is_some_and(|&(_, end)| end <= t) {
            self.busy.pop_front();
        }
    }
}

/// A holder or waiter of the queued spinlock.
#[derive(Debug, Clone, Copy)]
struct Queued {
    /// When it releases the spinlock.
    release: Ps,
    /// Its core.
    core: Core,
    /// When it acquired the spinlock, and handed the MCS head role to the waiter behind it.
    acquired: Ps,
    /// Stores on the lock word while it waited for the spinlock (its predecessor's release and
    /// its own take): a waiter already spinning behind it reads the word again after each.
    stores_before: u64,
    /// Stores on the lock word from its acquiring the spinlock to its releasing it (a rwlock
    /// waiter's `_QW_WAITING` or bias, the hand-off's release and cmpxchg).
    stores_after: u64,
}

/// `mmu_lock` in virtual time (see the module documentation).
#[derive(Debug)]
pub struct VirtualLock {
    kind: LockKind,
    cost: LineCost,
    /// The lock word's line.
    line: LineCalendar,
    /// The core that used the lock word last, in arrival order (`None`: nobody yet).
    owner: Option<Core>,
    /// The last writer reserved: when its hold ends, and its core. A reader that arrives
    /// before then finds a writer holding or waiting.
    writer: (Ps, Core),
    /// When that writer's release store has taken the line back, once a core that arrived
    /// during its hold made it a transfer (`None`: not yet known to be one).
    writer_released: Option<Ps>,
    /// The reader whose hold ends last, and its core.
    reader: (Ps, Core),
    /// The queued spinlock's holder and waiters, first come first: when each releases it, and
    /// its core. For a [`LockKind::Spinlock`], the lock's own; for a [`LockKind::Rwlock`], its
    /// `wait_lock`'s, which a slow-path acquirer releases as soon as it has the rwlock.
    queue: VecDeque<Queued>,
    /// Stores on the lock word so far.
    stores: u64,
    /// What the request being worked out counted.
    tally: Tally,
}

impl VirtualLock {
    /// A free lock of `kind` whose line transfers cost `cost`.
    pub fn new(kind: LockKind, cost: LineCost) -> Self {
        VirtualLock {
            kind,
            cost,
            line: LineCalendar::new(cost.local.min(cost.remote)),
            owner: None,
            writer: (0, Core::default()),
            writer_released: None,
            reader: (0, Core::default()),
            queue: VecDeque::new(),
            stores: 0,
            tally: Tally::default(),
        }
    }

    /// Which lock this is.
    pub fn kind(&self) -> LockKind {
        self.kind
    }

    /// A read of the lock word that moves its line to `to` from a core on socket `from`,
    /// caused at `at`: returns when it is done.
    fn read(&mut self, step: LineStep, to: Core, from: u32, at: Ps) -> Ps {
        let done = self.line.reserve(at, self.cost.between(from, to.socket));
        self.tally.transfers[step as usize] += 1;
        if from != to.socket {
            self.tally.remote += 1;
        }
        done
    }

    /// An atomic or a store on the lock word by `to`, whose line comes from a core on socket
    /// `from`, caused at `at`: returns when it is done. It invalidates the copies of the waiters
    /// spinning on the word, which read it again ([`VirtualLock::rereads_by_spinners`],
    /// [`VirtualLock::rereads_of_stores_ahead`]).
    fn transfer(&mut self, step: LineStep, to: Core, from: u32, at: Ps) -> Ps {
        let done = self.read(step, to, from, at);
        self.owner = Some(to);
        self.stores += 1;
        done
    }

    /// The waiters spinning on the lock word at `t` read it again after a store by `core` (a
    /// slow path's arrival): a rwlock's `wait_lock` holder (on `cnts`), its pending waiter and
    /// MCS head (on `wait_lock`, in the same word); a spinlock's pending waiter and MCS head.
    fn rereads_by_spinners(&mut self, core: Core, at: Ps) {
        let (skip, spinners) = match self.kind {
            LockKind::Rwlock => (0, 3),
            LockKind::Spinlock => (1, 2),
        };
        for i in skip..(skip + spinners).min(self.queue.len()) {
            let spinner = self.queue[i].core;
            if spinner != core {
                self.read(LineStep::Spin, spinner, core.socket, at);
            }
        }
    }

    /// `core`, spinning on the lock word from `from`, reads it again after each store the
    /// holders and waiters ahead of it made on the word from then on.
    fn rereads_of_stores_ahead(&mut self, core: Core, from: Ps) {
        let ahead = self
            .queue
            .iter()
            .rev()
            .take_while(|q| q.release > from)
            .count();
        for i in self.queue.len() - ahead..self.queue.len() {
            let q = self.queue[i];
            let seen = if from < q.acquired {
                q.stores_before + q.stores_after
            } else {
                q.stores_after
            };
            for _ in 0..seen {
                self.read(LineStep::Spin, core, q.core.socket, q.acquired.max(from));
            }
        }
    }

    /// When the waiter that arrives at `t` behind `queued` others starts spinning on the lock
    /// word: at once as the pending waiter, the MCS head or `wait_lock`'s holder (the first
    /// three to queue), else once it heads the MCS queue, when the one before it has acquired
    /// the spinlock and written this waiter's node, with a first read of the word then.
    fn spin_from(&mut self, core: Core, t: Ps, queued: usize) -> Ps {
        if queued <= 2 {
            return t;
        }
        let ahead = *self.queue.back().expect("queued");
        let from = ahead.acquired.max(t);
        self.read(LineStep::Mcs, core, ahead.core.socket, from);
        from
    }

    /// `core` does an atomic on the lock word at `at`: a transfer only when another core used
    /// the line last. Returns when it is done.
    fn touch(&mut self, step: LineStep, core: Core, at: Ps) -> Ps {
        match self.owner {
            Some(o) if o.actor == core.actor => at,
            Some(o) => self.transfer(step, core, o.socket, at),
            None => self.transfer(step, core, core.socket, at),
        }
    }

    /// The queued spinlock's holder and waiters at `t` (those that release it after `t`).
    fn queued(&mut self, t: Ps) -> usize {
        while self.queue.front().is_some_and(|q| q.release <= t) {
            self.queue.pop_front();
        }
        self.queue.len()
    }

    /// `core` arrives at `t` on the slow path of a queued spinlock that `queued` cores hold
    /// or wait for. Its failed fast-path atomic fetches the line (`arrival` names the step it
    /// leads to when nobody holds the spinlock); what it does next on the word (pending bit,
    /// `xchg_tail()`, `_QW_WAITING`, the reader's bias) finds the line still there. Returns
    /// when the arrival is done and the one it waits behind, if any: the pending bit behind
    /// a lone holder, else the MCS queue.
    fn arrive(
        &mut self,
        core: Core,
        t: Ps,
        queued: usize,
        arrival: LineStep,
    ) -> (Ps, Option<(Ps, Core)>) {
        let step = match queued {
            0 => arrival,
            1 => LineStep::Pending,
            _ => {
                // The predecessor hands over the head role on this waiter's own node, a line
                // of its own: counted, off the lock word.
                self.tally.transfers[LineStep::Mcs as usize] += 1;
                LineStep::Mcs
            }
        };
        let arrived = self.touch(step, core, t);
        if queued > 0 {
            self.rereads_by_spinners(core, arrived);
        }
        let behind = self.queue.back().map(|q| (q.release, q.core));
        (arrived, behind.filter(|_| queued > 0))
    }

    /// The lock passes from `holder`, whose hold ends at `end`, to `core` spinning on it (no
    /// earlier than `ready`): the release store (unless it is `released` already), the
    /// waiter's read, and (`take`) its cmpxchg.
    fn handoff(
        &mut self,
        core: Core,
        (end, holder): (Ps, Core),
        released: Option<Ps>,
        ready: Ps,
        take: bool,
    ) -> Ps {
        let released = match released {
            Some(done) => done.max(ready),
            None => self.transfer(LineStep::Handoff, holder, core.socket, end.max(ready)),
        };
        let mut start = self.read(LineStep::Handoff, core, holder.socket, released);
        if take {
            start = self.transfer(LineStep::Handoff, core, holder.socket, start);
        }
        self.tally.handoff(end, start);
        start
    }

    /// `core` requests the lock in `mode` at `t`: when its critical section can start, and what
    /// its release will cost. [`VirtualLock::hold`] must follow before the next request.
    pub fn acquire(&mut self, mode: LockMode, core: Core, t: Ps) -> Grant {
        self.line.forget_before(t);
        // A core arriving while a writer holds the rwlock takes the line from it, so the
        // writer's release store (queued_write_unlock()) will have to take it back.
        if self.kind == LockKind::Rwlock
            && t < self.writer.0
            && self.writer_released.is_none()
            && core != self.writer.1
        {
            let (end, w) = self.writer;
            self.writer_released = Some(self.transfer(LineStep::Handoff, w, core.socket, end));
        }
        match (self.kind, mode) {
            (LockKind::Spinlock, _) => self.spin_lock(core, t),
            (LockKind::Rwlock, LockMode::Write) => self.write_lock(core, t),
            (LockKind::Rwlock, LockMode::Read) => self.read_lock(core, t),
        }
    }

    /// `queued_spin_lock()`.
    fn spin_lock(&mut self, core: Core, t: Ps) -> Grant {
        let queued = self.queued(t);
        let (arrived, behind) = self.arrive(core, t, queued, LineStep::Fast);
        let Some(last) = behind else {
            self.queue_holder(core, arrived, 0, 0);
            return Grant {
                start: arrived,
                ..Grant::default()
            };
        };
        let spin_from = self.spin_from(core, arrived, queued);
        let mark = self.stores;
        let start = self.handoff(core, last, None, arrived, true);
        let stores_before = self.stores - mark;
        self.rereads_of_stores_ahead(core, spin_from);
        // Its release, at the end of its hold, is filled in by VirtualLock::hold().
        self.queue_holder(core, start, stores_before, 0);
        Grant {
            start,
            contended: true,
            release_from: None,
        }
    }

    /// `arch_spin_lock(&lock->wait_lock)` by `core`, which arrived at `arrived` behind
    /// `behind`: returns when it holds it (the predecessor's unlock store, this waiter's read
    /// and its `set_locked()`).
    fn lock_wait_lock(&mut self, core: Core, arrived: Ps, behind: Option<(Ps, Core)>) -> Ps {
        let Some((released, prev)) = behind else {
            return arrived;
        };
        let at = released.max(arrived);
        let x = self.transfer(LineStep::WaitLock, prev, core.socket, at);
        let x = self.read(LineStep::WaitLock, core, prev.socket, x);
        self.transfer(LineStep::WaitLock, core, prev.socket, x)
    }

    /// Queues `core`, which acquired the spinlock at `acquired`; [`VirtualLock::hold`] fills
    /// in its release.
    fn queue_holder(&mut self, core: Core, acquired: Ps, stores_before: u64, stores_after: u64) {
        self.queue.push_back(Queued {
            release: Ps::MAX,
            core,
            acquired,
            stores_before,
            stores_after,
        });
    }

    fn free_at(&self, t: Ps) -> bool {
        t >= self.writer.0 && t >= self.reader.0
    }

    /// `queued_write_lock()`.
    fn write_lock(&mut self, core: Core, t: Ps) -> Grant {
        let queued = self.queued(t);
        if queued == 0 && self.free_at(t) {
            return Grant {
                start: self.touch(LineStep::Fast, core, t),
                ..Grant::default()
            };
        }
        // queued_write_lock_slowpath(): wait_lock, then the lock itself if it is free by then
        // (this core has the line), else _QW_WAITING and the wait.
        let start = self.queue_on_wait_lock(core, t, LineStep::WriterDrain, |l, got| {
            if l.free_at(got) {
                // If the last holder released after this core arrived, its release took the
                // line, and the cmpxchg takes it back.
                let (end, last, released) = if l.writer.0 >= l.reader.0 {
                    let released = l.writer_released.unwrap_or(l.writer.0);
                    (l.writer.0, l.writer.1, released)
                } else {
                    (l.reader.0, l.reader.1, l.reader.0)
                };
                if end > t && last != core {
                    let start = l.transfer(LineStep::Handoff, core, last.socket, got.max(released));
                    l.tally.handoff(end, start);
                    start
                } else {
                    got
                }
            } else if l.writer.0 >= l.reader.0 {
                l.stores += 1; // _QW_WAITING
                l.handoff(core, l.writer, l.writer_released, got, true)
            } else {
                l.stores += 1; // _QW_WAITING
                               // The last reader's release atomic lands at its end (reserved in its hold);
                               // then the read that sees _QW_WAITING alone, and the cmpxchg to _QW_LOCKED.
                let (end, r) = l.reader;
                let x = l.read(LineStep::WriterDrain, core, r.socket, end.max(got));
                let start = l.transfer(LineStep::WriterDrain, core, r.socket, x);
                l.tally.handoff(end, start);
                start
            }
        });
        Grant {
            start,
            contended: true,
            release_from: None,
        }
    }

    /// A rwlock's slow path for `core`, arriving at `t` (`arrival`: the step its arrival
    /// counts as when `wait_lock` is free): it queues on `wait_lock`, then `take` works out
    /// from the moment it holds `wait_lock` when it holds the rwlock; `wait_lock` is released
    /// at once (`arch_spin_unlock(&lock->wait_lock)`: the next waiter pays its transfer).
    /// Returns when it holds the rwlock.
    fn queue_on_wait_lock(
        &mut self,
        core: Core,
        t: Ps,
        arrival: LineStep,
        take: impl FnOnce(&mut Self, Ps) -> Ps,
    ) -> Ps {
        let queued = self.queued(t);
        let (arrived, behind) = self.arrive(core, t, queued, arrival);
        let spin_from = self.spin_from(core, arrived, queued);
        let mark = self.stores;
        let got = self.lock_wait_lock(core, arrived, behind);
        let stores_before = self.stores - mark;
        let mark = self.stores;
        let start = take(self, got);
        let stores_after = self.stores - mark;
        self.rereads_of_stores_ahead(core, spin_from);
        self.queue.push_back(Queued {
            release: start,
            core,
            acquired: got,
            stores_before,
            stores_after,
        });
        start
    }

    /// `queued_read_lock()`.
    fn read_lock(&mut self, core: Core, t: Ps) -> Grant {
        let prev = self.owner.filter(|o| o.actor != core.actor);
        let release_from = prev.map(|o| o.socket);
        if t >= self.writer.0 {
            return Grant {
                start: self.touch(LineStep::Fast, core, t),
                contended: false,
                release_from,
            };
        }
        // queued_read_lock_slowpath(): the failed add (undone on the same core), wait_lock,
        // the bias (the line is here), and the writer's release store and this reader's read.
        let start = self.queue_on_wait_lock(core, t, LineStep::ReaderAdmission, |l, got| {
            l.stores += 1; // atomic_add(_QR_BIAS)
            if l.writer.0 > got {
                l.handoff(core, l.writer, l.writer_released, got, false)
            } else {
                got
            }
        });
        Grant {
            start,
            contended: true,
            release_from: Some(self.writer.1.socket),
        }
    }

    /// `by` holds the lock from `grant.start` until its work is done at `work_end`; returns
    /// the hold's end, after a reader's release atomic when it must take the line back
    /// ([`Grant::release_from`]). A new acquisition ([`HoldBy::requested`]) is counted in
    /// `stats` as lock_stat would; a job resuming a lock it never released
    /// ([`Grant::resumed`]) is not.
    pub fn hold(&mut self, stats: &LockStats, by: HoldBy, grant: Grant, work_end: Ps) -> Ps {
        let HoldBy {
            mode,
            core,
            requested,
        } = by;
        let end = match grant.release_from {
            Some(from) if mode == LockMode::Read => {
                self.transfer(LineStep::Release, core, from, work_end)
            }
            _ => work_end,
        };
        let (acq, cont, wait, held) = match mode {
            LockMode::Read => (
                &stats.read_acquired,
                &stats.read_contended,
                &stats.read_wait_ns,
                &stats.read_hold_ns,
            ),
            LockMode::Write => (
                &stats.write_acquired,
                &stats.write_contended,
                &stats.write_wait_ns,
                &stats.write_hold_ns,
            ),
        };
        if let Some(requested) = requested {
            acq.fetch_add(1, Ordering::Relaxed);
            if grant.contended {
                cont.fetch_add(1, Ordering::Relaxed);
                wait.fetch_add(ps_to_ns(grant.start - requested), Ordering::Relaxed);
            }
        }
        held.fetch_add(ps_to_ns(end - grant.start), Ordering::Relaxed);
        self.tally.flush(stats);
        match (self.kind, mode) {
            (LockKind::Spinlock, _) => {
                let last = self.queue.back_mut().expect("the holder is queued");
                debug_assert_eq!(last.core, core);
                last.release = end;
            }
            (LockKind::Rwlock, LockMode::Write) => {
                self.writer = (end, core);
                self.writer_released = None;
            }
            (LockKind::Rwlock, LockMode::Read) => {
                if end >= self.reader.0 {
                    self.reader = (end, core);
                }
            }
        }
        end
    }
}

/// What a request counted, kept in plain integers while it is worked out and added to the
/// lock's [`LockStats`] when its hold is known.
#[derive(Debug, Default)]
struct Tally {
    transfers: [u64; LINE_STEPS.len()],
    remote: u64,
    handoffs: u64,
    handoff_ps: Ps,
}

impl Tally {
    /// A hand-off: from a release at `released` to the next holder's start.
    fn handoff(&mut self, released: Ps, start: Ps) {
        self.handoffs += 1;
        self.handoff_ps += start - released;
    }

    /// Adds what was counted to `stats` and starts again.
    fn flush(&mut self, stats: &LockStats) {
        for (a, n) in stats.line_transfers.iter().zip(&mut self.transfers) {
            if *n != 0 {
                a.fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        }
        for (a, n) in [
            (&stats.line_transfers_remote, &mut self.remote),
            (&stats.handoffs, &mut self.handoffs),
        ] {
            if *n != 0 {
                a.fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        }
        if self.handoff_ps != 0 {
            stats.handoff_ns.fetch_add(
                ps_to_ns(std::mem::take(&mut self.handoff_ps)),
                Ordering::Relaxed,
            );
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    const X: Ps = 10;
    const XR: Ps = 30;

    fn lock(kind: LockKind) -> VirtualLock {
        VirtualLock::new(
            kind,
            LineCost {
                local: X,
                remote: XR,
            },
        )
    }

    fn core(actor: usize) -> Core {
        Core { actor, socket: 0 }
    }

    fn transfers(stats: &LockStats, step: LineStep) -> u64 {
        stats.line_transfers[step as usize].load(Ordering::Relaxed)
    }

    fn total(stats: &LockStats) -> u64 {
        stats
            .line_transfers
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .sum()
    }

    /// Requests and holds `work` long; returns the grant and the hold's end.
    fn take(
        l: &mut VirtualLock,
        s: &LockStats,
        mode: LockMode,
        c: Core,
        t: Ps,
        work: Ps,
    ) -> (Grant, Ps) {
        let g = l.acquire(mode, c, t);
        let end = l.hold(
            s,
            HoldBy {
                mode,
                core: c,
                requested: Some(t),
            },
            g,
            g.start + work,
        );
        (g, end)
    }

    #[test]
    fn the_line_serves_one_transfer_at_a_time_in_the_first_free_slot() {
        let mut c = LineCalendar::new(0);
        assert_eq!(c.reserve(100, 10), 110);
        assert_eq!(c.reserve(105, 10), 120, "behind the one in flight");
        assert_eq!(c.reserve(500, 10), 510, "a later one");
        assert_eq!(
            c.reserve(200, 10),
            210,
            "an earlier cause fills the gap before it"
        );
        assert_eq!(c.reserve(115, 10), 130, "after the merged block");
        assert_eq!(c.busy, [(100, 130), (200, 210), (500, 510)]);
        assert_eq!(c.reserve(205, 290), 500, "exactly fills a gap");
        assert_eq!(c.busy, [(100, 130), (200, 510)]);
        c.forget_before(300);
        assert_eq!(c.busy, [(200, 510)]);
    }

    #[test]
    fn gaps_no_transfer_fits_are_kept_inside_one_interval() {
        let mut c = LineCalendar::new(10);
        assert_eq!(c.reserve(100, 10), 110);
        assert_eq!(c.reserve(115, 10), 125, "a 5-unit gap: one interval");
        assert_eq!(c.busy, [(100, 125)]);
        assert_eq!(c.reserve(135, 10), 145, "a 10-unit gap stays usable");
        assert_eq!(c.busy, [(100, 125), (135, 145)]);
        assert_eq!(c.reserve(100, 10), 135, "and is used");
        assert_eq!(c.busy, [(100, 145)]);
        assert_eq!(c.reserve(111, 10), 155, "nothing fits inside");
    }

    #[test]
    fn an_uncontended_lock_costs_a_transfer_only_when_another_core_used_it() {
        for kind in [LockKind::Rwlock, LockKind::Spinlock] {
            let s = LockStats::default();
            let mut l = lock(kind);
            let (g, end) = take(&mut l, &s, LockMode::Write, core(0), 100, 50);
            assert_eq!((g.start, end, g.contended), (110, 160, false), "{kind:?}");
            let (g, _) = take(&mut l, &s, LockMode::Write, core(0), 200, 50);
            assert_eq!(g.start, 200, "same core: the line is here");
            let (g, _) = take(
                &mut l,
                &s,
                LockMode::Write,
                Core {
                    actor: 1,
                    socket: 1,
                },
                300,
                50,
            );
            assert_eq!(g.start, 330, "from the other socket");
            assert_eq!(transfers(&s, LineStep::Fast), 2);
            assert_eq!(s.line_transfers_remote.load(Ordering::Relaxed), 1);
            assert_eq!(s.write_contended.load(Ordering::Relaxed), 0);
        }
    }

    #[test]
    fn two_writers_hand_off_with_three_transfers_after_the_release() {
        // qrwlock: W1 holds [110, 1110); W2 arrives at 200: its failed cmpxchg (1), wait_lock
        // free (1), _QW_WAITING (1), then at 1110 the release, its read and cmpxchg (3).
        let s = LockStats::default();
        let mut l = lock(LockKind::Rwlock);
        let (_, end1) = take(&mut l, &s, LockMode::Write, core(1), 100, 1000);
        assert_eq!(end1, 1110);
        let (g, _) = take(&mut l, &s, LockMode::Write, core(2), 200, 100);
        assert_eq!(g.start, end1 + 3 * X);
        assert!(g.contended);
        assert_eq!(transfers(&s, LineStep::Handoff), 3);
        assert_eq!(transfers(&s, LineStep::WriterDrain), 1);
        assert_eq!(s.handoffs.load(Ordering::Relaxed), 1);
        assert_eq!(s.write_wait_ns.load(Ordering::Relaxed), 0, "under 1 ns");
        assert_eq!(s.write_contended.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn a_third_writer_takes_wait_lock_from_the_second_when_it_gets_the_lock() {
        // W3 arrives while W2 holds wait_lock: pending (1); at W2's grant (1140) the unlock,
        // read and set_locked of wait_lock (3), _QW_WAITING (1); then at W2's end the hand-off.
        let s = LockStats::default();
        let mut l = lock(LockKind::Rwlock);
        take(&mut l, &s, LockMode::Write, core(1), 100, 1000);
        let (g2, end2) = take(&mut l, &s, LockMode::Write, core(2), 200, 1000);
        assert_eq!(g2.start, 1140);
        let (g3, _) = take(&mut l, &s, LockMode::Write, core(3), 300, 1000);
        assert_eq!(transfers(&s, LineStep::Pending), 1);
        assert_eq!(transfers(&s, LineStep::WaitLock), 3);
        assert_eq!(
            g3.start,
            end2 + 3 * X,
            "its wait_lock steps hid under W2's hold"
        );
        // A fourth, while W2 holds and W3 waits on wait_lock: the MCS queue (xchg_tail and
        // the node hand-off; it heads the queue at once, spinning on the word).
        let (g4, _) = take(&mut l, &s, LockMode::Write, core(4), 400, 10);
        assert_eq!(transfers(&s, LineStep::Mcs), 2);
        // W2 and W3 re-read after its arrival; it re-reads after theirs (their hand-offs, W3's
        // taking of wait_lock and _QW_WAITING).
        assert!(transfers(&s, LineStep::Spin) >= 2 + 5);
        // A fifth queues behind W4 in the MCS queue and first reads the word when W4 has
        // wait_lock.
        take(&mut l, &s, LockMode::Write, core(5), 500, 10);
        assert_eq!(transfers(&s, LineStep::Mcs), 2 + 3);
        assert!(g4.start > g3.start + 1000);
    }

    #[test]
    fn tiny_critical_sections_are_bounded_by_the_line() {
        // Eight writers arrive at once with 1-unit critical sections: each finds the lock free
        // once it has wait_lock, so an acquisition costs its arrival and the three spinners'
        // re-reads after it (wait_lock's holder, pending waiter and MCS head), wait_lock's
        // hand-off (3), the holder's release store taking the line back and the cmpxchg taking
        // it again, and the next MCS head's first read: 10 transfers, and the line serves one
        // at a time.
        let s = LockStats::default();
        let mut l = lock(LockKind::Rwlock);
        let mut starts = vec![];
        for i in 0..8 {
            let (g, _) = take(&mut l, &s, LockMode::Write, core(i), i as Ps, 1);
            starts.push(g.start);
        }
        for pair in starts[4..].windows(2) {
            assert_eq!(pair[1] - pair[0], 10 * X + 1, "{starts:?}");
        }
        assert_eq!(transfers(&s, LineStep::WaitLock), 6 * 3);
    }

    #[test]
    fn readers_share_and_pay_the_line_in_and_out() {
        let s = LockStats::default();
        let mut l = lock(LockKind::Rwlock);
        let (g1, e1) = take(&mut l, &s, LockMode::Read, core(1), 100, 500);
        assert_eq!(
            (g1.start, g1.release_from),
            (110, None),
            "first use: nobody to take it back"
        );
        let (g2, e2) = take(&mut l, &s, LockMode::Read, core(2), 120, 500);
        assert_eq!(
            g2.start, 130,
            "readers share; one transfer at a time on the line"
        );
        assert_eq!(g2.release_from, Some(0));
        assert_eq!(e2, 130 + 500 + X);
        assert!(e2 > e1);
        assert_eq!(s.read_contended.load(Ordering::Relaxed), 0);
        // A writer drains them: _QW_WAITING, then after the last release the read and cmpxchg.
        let (w, _) = take(&mut l, &s, LockMode::Write, core(3), 200, 100);
        assert_eq!(w.start, e2 + 2 * X);
        assert_eq!(transfers(&s, LineStep::WriterDrain), 3);
    }

    #[test]
    fn readers_behind_a_waiting_writer_are_admitted_one_at_a_time() {
        let s = LockStats::default();
        let mut l = lock(LockKind::Rwlock);
        let (_, e0) = take(&mut l, &s, LockMode::Read, core(0), 0, 1000);
        let (w, ew) = take(&mut l, &s, LockMode::Write, core(1), 100, 1000);
        assert!(w.start >= e0);
        let mut grants = vec![];
        for i in 2..6 {
            let (g, _) = take(&mut l, &s, LockMode::Read, core(i), 200 + i as Ps, 5000);
            assert!(g.contended, "a writer waits: the slow path");
            grants.push(g.start);
        }
        assert_eq!(
            grants[0],
            ew + 2 * X,
            "the writer's release and the reader's read"
        );
        // wait_lock passes from reader to reader (3 transfers), and the next MCS head's first
        // read and a spinning waiter's re-read share the line with it.
        for pair in grants.windows(2) {
            let gap = pair[1] - pair[0];
            assert!((3 * X..=5 * X).contains(&gap), "{grants:?}");
        }
        assert_eq!(s.read_contended.load(Ordering::Relaxed), 4);
        // A reader that arrives after the writer released takes the fast path beside them.
        let (late, _) = take(&mut l, &s, LockMode::Read, core(9), ew + 1, 10);
        assert!(!late.contended);
        assert!(late.start < grants[3] + 3 * X);
    }

    #[test]
    fn grants_follow_the_kernels_order() {
        // R0 holds; W1 waits; R2 arrives behind W1 and must not pass it; W3 comes after R2.
        let s = LockStats::default();
        let mut l = lock(LockKind::Rwlock);
        let (_, _) = take(&mut l, &s, LockMode::Read, core(0), 0, 1000);
        let (w1, e1) = take(&mut l, &s, LockMode::Write, core(1), 10, 100);
        let (r2, e2) = take(&mut l, &s, LockMode::Read, core(2), 20, 100);
        let (w3, _) = take(&mut l, &s, LockMode::Write, core(3), 30, 100);
        assert!(w1.start >= 1000, "a writer waits for the reader");
        assert!(r2.start >= e1, "a waiting writer blocks new readers");
        assert!(w3.start >= e2, "FIFO through wait_lock");
    }

    #[test]
    fn a_spinlock_goes_pending_then_mcs() {
        let s = LockStats::default();
        let mut l = lock(LockKind::Spinlock);
        let (_, e0) = take(&mut l, &s, LockMode::Write, core(0), 0, 1000);
        let (g1, e1) = take(&mut l, &s, LockMode::Write, core(1), 10, 1000);
        assert_eq!(transfers(&s, LineStep::Pending), 1);
        assert_eq!(g1.start, e0 + 3 * X);
        let (g2, _) = take(&mut l, &s, LockMode::Write, core(2), 20, 1000);
        assert_eq!(
            transfers(&s, LineStep::Mcs),
            2,
            "xchg_tail and the node hand-off; it heads the queue at once"
        );
        assert_eq!(g2.start, e1 + 3 * X);
        assert_eq!(
            transfers(&s, LineStep::WaitLock),
            0,
            "no wait_lock in a spinlock"
        );
        // Fast 1, pending 1, hand-off 3, MCS 2, hand-off 3; the pending waiter re-reads the
        // word after the MCS waiter's xchg_tail, and the MCS head after the first hand-off's
        // release and take.
        assert_eq!(total(&s), 1 + 1 + 3 + 2 + 3 + 3);
        assert_eq!(transfers(&s, LineStep::Spin), 3);
        // Readers of a spinlock exclude each other too.
        let (r, _) = take(&mut l, &s, LockMode::Read, core(3), 30, 10);
        assert!(r.contended);
    }

    /// One hold as the lock granted it: requested at, mode, from, to.
    type Hold = (Ps, LockMode, Ps, Ps);

    /// The kernel's guarantees over a schedule of holds listed in request order: no hold
    /// starts before its request; nothing overlaps a write hold (with a spinlock, any hold);
    /// a writer starts after every hold requested before it ends; a reader requested after a
    /// writer starts after that writer ends.
    fn check_schedule(kind: LockKind, holds: &[Hold]) -> Result<(), String> {
        let exclusive = |m: LockMode| kind == LockKind::Spinlock || m == LockMode::Write;
        for (i, &(req, m, start, end)) in holds.iter().enumerate() {
            if start < req {
                return Err(format!(
                    "hold {i} starts at {start} before its request at {req}"
                ));
            }
            for (j, &(_, m2, s2, e2)) in holds.iter().enumerate().take(i) {
                let overlap = start < e2 && s2 < end;
                if overlap && (exclusive(m) || exclusive(m2)) {
                    return Err(format!(
                        "holds {j} [{s2}, {e2}) and {i} [{start}, {end}) overlap"
                    ));
                }
                if exclusive(m) && start < e2 {
                    return Err(format!(
                        "writer {i} starts at {start} before hold {j} ends at {e2}"
                    ));
                }
                if exclusive(m2) && start < e2 {
                    return Err(format!(
                        "hold {i} passes writer {j}: starts at {start} < {e2}"
                    ));
                }
            }
        }
        Ok(())
    }

    #[test]
    fn the_schedule_check_catches_a_reader_inside_a_writer() {
        let w = (0, LockMode::Write, 10, 100);
        let r = (5, LockMode::Read, 50, 60);
        assert!(check_schedule(LockKind::Rwlock, &[w, r]).is_err());
        let r_after = (5, LockMode::Read, 100, 160);
        assert!(check_schedule(LockKind::Rwlock, &[w, r_after]).is_ok());
        let readers = [(0, LockMode::Read, 10, 100), (5, LockMode::Read, 20, 60)];
        assert!(check_schedule(LockKind::Rwlock, &readers).is_ok());
        assert!(check_schedule(LockKind::Spinlock, &readers).is_err());
        let early = [(50, LockMode::Read, 10, 100)];
        assert!(check_schedule(LockKind::Rwlock, &early).is_err());
    }

    proptest::proptest! {
        /// Random arrivals, modes, holds and cores (two sockets) on both locks: every schedule
        /// keeps the kernel's guarantees.
        #[test]
        fn random_requests_keep_the_kernels_guarantees(
            spin in proptest::bool::ANY,
            reqs in proptest::collection::vec(
                (0u64..400, proptest::bool::ANY, 0u64..600, 0usize..6),
                1..60,
            ),
        ) {
            let kind = if spin { LockKind::Spinlock } else { LockKind::Rwlock };
            let s = LockStats::default();
            let mut l = lock(kind);
            let mut t = 0;
            let mut holds = vec![];
            for (gap, write, work, c) in reqs {
                t += gap;
                let mode = if write { LockMode::Write } else { LockMode::Read };
                let c = Core { actor: c, socket: (c % 2) as u32 };
                let g = l.acquire(mode, c, t);
                let end = l.hold(&s, HoldBy { mode, core: c, requested: Some(t) }, g, g.start + work + 1);
                holds.push((t, mode, g.start, end));
            }
            if let Err(e) = check_schedule(kind, &holds) {
                return Err(proptest::test_runner::TestCaseError::fail(e));
            }
        }
    }

    #[test]
    fn a_resumed_hold_is_not_an_acquisition_and_extends_the_hold() {
        for kind in [LockKind::Rwlock, LockKind::Spinlock] {
            let s = LockStats::default();
            let mut l = lock(kind);
            let g = l.acquire(LockMode::Write, VMM_CORE, 0);
            let end = l.hold(
                &s,
                HoldBy {
                    mode: LockMode::Write,
                    core: VMM_CORE,
                    requested: Some(0),
                },
                g,
                100,
            );
            let by = HoldBy {
                mode: LockMode::Write,
                core: VMM_CORE,
                requested: None,
            };
            let end = l.hold(&s, by, Grant::resumed(end), end + 100);
            assert_eq!(s.write_acquired.load(Ordering::Relaxed), 1);
            let w = l.acquire(LockMode::Write, core(1), 50);
            assert_eq!(
                w.start,
                end + 3 * X,
                "{kind:?}: waits for the resumed chunk"
            );
        }
    }
}
