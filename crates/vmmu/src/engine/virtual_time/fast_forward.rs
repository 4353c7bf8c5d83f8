//! Fast-forward: a vCPU runs its guest's accesses past the next actor's clock while nothing any
//! actor does before them can change what they do, or be changed by them.
//!
//! The steps of a virtual-time run are of three kinds:
//! - **private**: a guest access (a TLB hit, or a walk that completes) of a vCPU whose guest
//!   keeps the pass's accesses within gfns no other vCPU uses ([`GuestCode::private_gfns`]),
//!   and the guest computing between two. It changes only the vCPU's own state (clock, TLB,
//!   page-modification log, meter), the Accessed/Dirty flags of leaves that map only those gfns,
//!   those gfns' memory, and what the engine accounts per epoch (each socket's DRAM traffic, the
//!   guest's lines for the caches: [`super::epoch`]), whose results do not depend on order.
//! - **ordered**: the vCPU's exits that touch only its own state and KVM's data through its own
//!   core: a page-modification-log-full exit, a kicked vCPU's exit (it applies the requests
//!   posted to it), a scheduling-clock tick, `GUEST_SYNC`, a full dirty ring. They run in
//!   virtual-time order with every other non-private step, as all steps did before; a private
//!   step neither reads nor writes anything they touch.
//! - **global**: everything else (faults, intercepted instructions, the VMM's and the host
//!   threads' steps, the jobs' chunks, a new pass, a background pass that keeps to other
//!   gfns): they may change page tables, post TLB invalidations, kick, or move memory. Each
//!   one ends every private guarantee ([`FastForward::global_step`]).
//!
//! A vCPU's guarantee ([`PrivateCheck`]) is that every gfn of its private range is mapped by
//! leaves a walk completes through, that change nothing outside the range
//! ([`Mmu::range_walks_private`]), read when no global step has run since (and not while a
//! job holds `mmu_lock`). Such a vCPU's next step is never global: its accesses complete or
//! exit for a full log or a kick. No global step can then come before the VMM's next step
//! (`until`) or the clock of the first running vCPU that holds none (it acts no sooner), so
//! the private steps of the vCPUs that hold one may run out of turn up to there (and to the end
//! of the open epoch): they commute with each other and with the ordered steps, which still run
//! in turn, and every step of a vCPU without a guarantee comes after them, as in turn. The
//! results are those of stepping one actor at a time, byte for byte (`--fast-forward off`
//! keeps that stepping, as the reference). While one vCPU is in a fault, the others run out
//! of turn up to each of its steps.
//!
//! A guest whose accesses rise through their range ([`GuestCode::accesses_before`]) may hold a
//! guarantee over a *window* of it: the gfns below the first one whose walk does not complete.
//! It holds while the vCPU stays below that gfn, which its guest reaches no sooner than its
//! clock plus the accesses it makes first at the price of the cheapest access (a read that hits
//! the first-level TLB): every phase ends by then ([`FastForward::window_limit`]), and the
//! vCPU gives its guarantee up at its first access at or above the window's end, which it makes
//! in turn. Reads of gfns other vCPUs read too ([`GuestCode::shared_reads`]) hold one where
//! their walks change nothing at all, so the order of two vCPUs' reads of a page changes no
//! table entry and no result.
//!
//! The check reads the range's entries, a part at a time: each check reads at most as many
//! entries as the vCPU's accesses since its last one pay for, and the next goes on from where
//! it stopped, until a global step starts it over. A run whose faults come often reads little
//! and never holds a guarantee.
//!
//! [`GuestCode::private_gfns`]: crate::engine::GuestCode::private_gfns
//! [`GuestCode::shared_reads`]: crate::engine::GuestCode::shared_reads
//! [`GuestCode::accesses_before`]: crate::engine::GuestCode::accesses_before

use super::pricer::Ps;
use crate::engine::{GuestCode, PrivateGfns};
use crate::hw::walker::RangeWalk;
use crate::kvm::mmu::Mmu;
use crate::units::{Gfn, GfnRange};

/// How many table entries a check may read per access the vCPU made since its last check
/// in the generation (an entry costs a few nanoseconds to read; an access stepped in turn,
/// most of a microsecond of the host's time, and every access before the guarantee is one):
/// a 1 GiB range of 4K leaves (262,144 entries) is read within its first 4,096 accesses.
const ENTRIES_PER_ACCESS: u64 = 64;

/// Accesses after a global step before a vCPU first checks, and between checks that ran out
/// of budget; a check that finds an entry in the way doubles the wait.
const FIRST_CHECK_AFTER: u64 = 64;

/// Private steps a parallel phase must have run, the last time, for the next one to be spread
/// over the host's cores: waking the pool's threads costs microseconds, a private step a fraction
/// of one, and a phase of a few steps (guests that mostly compute) is cheaper on one core.
/// Which way a phase runs changes no result, only the wall clock.
const PARALLEL_MIN_STEPS: u64 = 1024;

/// Private steps per vCPU a phase must run to be worth its own pass over the actors: a phase
/// that ran fewer (guests that compute for longer than an epoch between accesses) makes the
/// next ones wait, twice as many epochs each time up to [`MAX_PHASE_BACKOFF`]; between phases
/// the private steps still run out of turn, in the actors' turns.
const PHASE_MIN_STEPS_PER_VCPU: u64 = 4;

/// The most epochs a phase waits after phases that ran too few steps.
const MAX_PHASE_BACKOFF: u64 = 1024;

/// The run's fast-forward state: whether it is on, and which vCPUs hold a guarantee.
#[derive(Debug)]
pub struct FastForward {
    /// Private steps may run out of turn (`--fast-forward on`).
    pub enabled: bool,
    /// Global steps so far: a guarantee holds only at the count it was made at.
    generation: u64,
    /// vCPUs whose guarantee holds now.
    holding: usize,
    /// Private steps run out of turn without any guarantee: wrong on purpose, the negative
    /// control of the tests that compare both sides.
    unchecked: bool,
    /// Private steps run out of turn so far.
    pub out_of_turn: u64,
    /// Of those, reads made in one step with others of a run ([`GuestCode::descending_reads`]).
    pub swept_reads: u64,
    /// And writes made in one step with others of a run ([`GuestCode::ascending_writes`]).
    pub swept_writes: u64,
    /// The first epoch in which the next parallel phase may run (one per epoch at most).
    phase_due: u64,
    /// Epochs the next phase waits after one that ran too few steps.
    phase_backoff: u64,
    /// Private steps the last parallel phase ran.
    last_phase_steps: u64,
    /// Parallel phases run so far on this thread alone, and on the host's cores.
    pub phases: [u64; 2],
    /// The price of the cheapest access (a read that hits the first-level TLB): what a
    /// window's guarantee counts each access before its end at, at least.
    min_access_ps: Ps,
    /// No vCPU that holds a window's guarantee can leave its window before this time (the
    /// least of their bounds when they were last worked out); `Ps::MAX` when none holds one.
    window_limit: Ps,
}

impl FastForward {
    /// No guarantee yet; private runs only when `enabled`.
    pub fn new(enabled: bool) -> Self {
        FastForward {
            enabled,
            generation: 0,
            holding: 0,
            unchecked: false,
            out_of_turn: 0,
            swept_reads: 0,
            swept_writes: 0,
            phase_due: 0,
            phase_backoff: 1,
            last_phase_steps: 0,
            phases: [0; 2],
            min_access_ps: 0,
            window_limit: Ps::MAX,
        }
    }

    /// Windows' guarantees count each access at `ps` (0, the default: none is taken).
    pub fn with_min_access_ps(mut self, ps: Ps) -> Self {
        self.min_access_ps = ps;
        self
    }

    /// The earliest a vCPU at `clock` can make an access after `accesses` more: each costs at
    /// least the cheapest access's price.
    #[inline]
    fn leave_bound(&self, clock: Ps, accesses: u64) -> Ps {
        clock.saturating_add(accesses.saturating_mul(self.min_access_ps))
    }

    /// What windows' guarantees count each access at.
    pub fn min_access_ps(&self) -> Ps {
        self.min_access_ps
    }

    /// Runs private steps out of turn whether or not every vCPU holds a guarantee: results
    /// that differ from stepping in turn (the equivalence tests' negative control).
    pub fn unchecked() -> Self {
        FastForward {
            unchecked: true,
            ..FastForward::new(true)
        }
    }

    /// A global step runs: every guarantee ends.
    #[inline]
    pub fn global_step(&mut self) {
        self.generation += 1;
        self.holding = 0;
        self.window_limit = Ps::MAX;
    }

    /// No vCPU holding a window's guarantee leaves its window before this time: private steps
    /// run out of turn only before it.
    #[inline]
    pub fn window_limit(&self) -> Ps {
        self.window_limit
    }

    /// Works the window limit out again from every vCPU that holds a window's guarantee
    /// (`least`: the least of their [`PrivateCheck::window_bound`]s, `None` when none holds
    /// one): each is a lower bound on when its vCPU can leave, worked out from where it is
    /// now, so the least of them is a valid limit whether it is later than the last or not.
    pub fn renew_window_limit(&mut self, least: Option<Ps>) {
        self.window_limit = least.unwrap_or(Ps::MAX);
    }

    /// Whether the next parallel phase should run on the host's cores rather than on this
    /// thread alone: the last one ran enough steps to pay for waking the pool.
    #[inline]
    pub fn phase_on_cores(&self) -> bool {
        self.last_phase_steps >= PARALLEL_MIN_STEPS
    }

    /// Whether a parallel phase may run in epoch `epoch`.
    #[inline]
    pub fn phase_due(&self, epoch: u64) -> bool {
        epoch >= self.phase_due
    }

    /// A parallel phase ran `steps` private steps of `vcpus` running vCPUs in epoch `epoch`,
    /// on the host's cores if `on_cores`: the next may run in the next epoch, or later when
    /// this one ran too few steps to pay for itself. One that was `cut` short (it ended before
    /// the epoch did, where a vCPU without a guarantee acts or one with a window may leave
    /// it) changes no backoff, and if it ran some steps the next may run in this epoch, once
    /// that vCPU has acted.
    #[inline]
    pub fn phase_ran(&mut self, epoch: u64, steps: u64, vcpus: usize, on_cores: bool, cut: bool) {
        self.phases[on_cores as usize] += 1;
        self.last_phase_steps = steps;
        self.out_of_turn += steps;
        if cut {
            // Cut short, it says nothing of what a whole phase pays for: no backoff. One that
            // ran nothing waits for the next epoch, so a stepped turn never retries it.
            self.phase_due = if steps > 0 { epoch } else { epoch + 1 };
            return;
        }
        self.phase_backoff = if steps >= PHASE_MIN_STEPS_PER_VCPU * vcpus as u64 {
            1
        } else {
            (self.phase_backoff * 2).min(MAX_PHASE_BACKOFF)
        };
        self.phase_due = epoch + self.phase_backoff;
    }

    /// Whether every one of `nr_vcpus` vCPUs holds a guarantee: private steps may run out of
    /// turn.
    #[inline]
    pub fn all_private(&self, nr_vcpus: usize) -> bool {
        self.enabled && (self.holding == nr_vcpus || self.unchecked)
    }

    /// Whether some vCPU holds a guarantee: a parallel phase may run its private steps up to
    /// the clock of the first vCPU that holds none.
    #[inline]
    pub fn any_private(&self) -> bool {
        self.enabled && (self.holding > 0 || self.unchecked)
    }

    /// Whether the vCPU whose guarantee is `check` may run private steps out of turn: it holds
    /// its guarantee (or the run checks none, the negative control).
    #[inline]
    pub fn may_run(&self, check: &PrivateCheck) -> bool {
        self.unchecked || check.holds(self)
    }
}

/// One vCPU's guarantee, and when it may check for one.
#[derive(Debug, Clone, Copy)]
pub struct PrivateCheck {
    /// The generation its guarantee holds at (`None`: none).
    held_at: Option<u64>,
    /// The generation it last saw, and its access count then.
    seen: (u64, u64),
    /// Accesses after `seen` before it checks (again).
    check_after: u64,
    /// Its access count at its last check in this generation.
    checked_at: u64,
    /// What its last check in this generation was asked, and the gfn it stopped at when its
    /// budget ran out: the walks of the gfns before it complete, and still do. Only a global
    /// step changes an entry so that a walk through it stops completing; walks in between
    /// only set Accessed and Dirty flags, which never makes a check fail.
    resume: Option<(Promise, Gfn)>,
    /// While the guarantee holds: the end of its window (`None`: the whole promised range).
    window_end: Option<Gfn>,
}

/// What a vCPU's guest promises of its accesses, which its check reads the tables against.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Promise {
    /// Within gfns no other vCPU uses ([`GuestCode::private_gfns`]).
    Private(PrivateGfns),
    /// Reads of gfns other vCPUs may read too ([`GuestCode::shared_reads`]): their walks
    /// must change nothing.
    SharedReads(GfnRange),
}

impl Promise {
    /// The promise `guest` makes now, if any: its private gfns first.
    fn of<G: GuestCode>(guest: &G) -> Option<Promise> {
        guest
            .private_gfns()
            .map(Promise::Private)
            .or_else(|| guest.shared_reads().map(Promise::SharedReads))
    }

    fn range(&self) -> GfnRange {
        match self {
            Promise::Private(p) => p.range,
            Promise::SharedReads(r) => *r,
        }
    }

    /// Where a check of this promise may go on from, after one of `asked` stopped at `at`:
    /// private gfns only when they are the same; shared reads when this range lies within
    /// that one and ends where it did (the guest moved up through it).
    fn resume_at(&self, asked: &Promise, at: Gfn) -> Option<Gfn> {
        match (self, asked) {
            (Promise::Private(p), Promise::Private(q)) => (p == q).then_some(at),
            (Promise::SharedReads(r), Promise::SharedReads(q)) => {
                (r.start >= q.start && r.end == q.end).then_some(at.max(r.start))
            }
            _ => None,
        }
    }

    /// Whether a walk of every gfn of `check` completes, changing no entry that maps gfns
    /// outside the promise's own (none for shared reads): [`Mmu::range_walks_private`].
    fn check(&self, mmu: &dyn Mmu, check: GfnRange, budget: &mut u64) -> RangeWalk {
        match self {
            Promise::Private(p) => mmu.range_walks_private(p.range, check, p.write, budget),
            Promise::SharedReads(_) => {
                let nothing = GfnRange {
                    start: check.start,
                    end: check.start,
                };
                mmu.range_walks_private(nothing, check, false, budget)
            }
        }
    }
}

impl Default for PrivateCheck {
    fn default() -> Self {
        PrivateCheck {
            held_at: None,
            seen: (u64::MAX, 0),
            check_after: FIRST_CHECK_AFTER,
            checked_at: 0,
            resume: None,
            window_end: None,
        }
    }
}

impl PrivateCheck {
    /// Whether the guarantee holds now.
    #[inline]
    pub fn holds(&self, ff: &FastForward) -> bool {
        self.held_at == Some(ff.generation)
    }

    /// The earliest time a vCPU holding this guarantee at `clock`, whose guest is `guest`, can
    /// leave its window, with the access to `pending` to make before the guest's next one:
    /// `None` when it holds none or its window is the whole range.
    #[inline]
    pub fn window_bound<G: GuestCode>(
        &self,
        ff: &FastForward,
        guest: &G,
        clock: Ps,
        pending: Option<Gfn>,
    ) -> Option<Ps> {
        let end = self.window_end.filter(|_| self.holds(ff))?;
        if pending.is_some_and(|gfn| gfn >= end) {
            return Some(clock);
        }
        Some(ff.leave_bound(clock, guest.accesses_before(end)))
    }

    /// The end of the window the guarantee holds over, while it holds one: accesses at or
    /// above it leave the window.
    #[inline]
    pub fn window_end(&self, ff: &FastForward) -> Option<Gfn> {
        self.window_end.filter(|_| self.holds(ff))
    }

    /// Before an access to `gfn`: a vCPU that holds a window's guarantee and is leaving the
    /// window gives the guarantee up (its access may fault, a global step, which it takes in
    /// turn: no other vCPU has run past this clock, by the window limit).
    #[inline]
    pub fn before_access(&mut self, ff: &mut FastForward, gfn: Gfn) {
        if self.leaves_window(ff, gfn) {
            self.held_at = None;
            self.window_end = None;
            ff.holding -= 1;
        }
    }

    /// Whether the guarantee holds over a window whose end `gfn` is at or above: an access to
    /// `gfn` leaves it.
    #[inline]
    pub fn leaves_window(&self, ff: &FastForward, gfn: Gfn) -> bool {
        self.window_end.is_some_and(|end| gfn >= end) && self.holds(ff)
    }

    /// Between two accesses of a vCPU at `clock` that has made `accesses` so far, whose guest
    /// is `guest`: checks the range its guest promises when it is time to, going on from
    /// where its last check in this generation ran out of budget, and takes the guarantee once
    /// the whole range has passed, or a window of it that the guest takes time to leave.
    /// Reads the tables, changes nothing but this check and `ff`.
    pub fn try_check<G: GuestCode>(
        &mut self,
        ff: &mut FastForward,
        mmu: &dyn Mmu,
        guest: &G,
        accesses: u64,
        clock: Ps,
    ) {
        if !ff.enabled || self.holds(ff) {
            return;
        }
        if self.seen.0 != ff.generation {
            self.seen = (ff.generation, accesses);
            self.check_after = FIRST_CHECK_AFTER;
            self.checked_at = accesses;
            self.resume = None;
        }
        let since = accesses - self.seen.1;
        if since < self.check_after {
            return;
        }
        let Some(p) = Promise::of(guest) else {
            // Nothing promised: never again in this generation.
            self.check_after = u64::MAX;
            return;
        };
        // The entries the accesses since the last check pay for.
        let mut budget = (accesses - self.checked_at) * ENTRIES_PER_ACCESS;
        self.checked_at = accesses;
        let range = p.range();
        let from = self
            .resume
            .and_then(|(asked, at)| p.resume_at(&asked, at))
            .unwrap_or(range.start);
        let check = GfnRange {
            start: from,
            end: range.end,
        };
        match p.check(mmu, check, &mut budget) {
            RangeWalk::Complete => self.hold(ff, None),
            RangeWalk::Partial(at) => {
                self.resume = Some((p, at));
                self.check_after = since + FIRST_CHECK_AFTER;
            }
            RangeWalk::Blocked(end) => {
                // A window below `end`, if the guest takes time to get there: it holds until
                // then, at least.
                let accesses = guest.accesses_before(end);
                if accesses > 0 && ff.min_access_ps > 0 {
                    self.hold(ff, Some(end));
                    ff.window_limit = ff.window_limit.min(ff.leave_bound(clock, accesses));
                } else {
                    self.check_after = self.check_after.saturating_mul(2);
                }
            }
        }
    }

    fn hold(&mut self, ff: &mut FastForward, window_end: Option<Gfn>) {
        self.held_at = Some(ff.generation);
        self.window_end = window_end;
        ff.holding += 1;
    }
}
