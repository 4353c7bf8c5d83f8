//! Why the vCPUs of one VM do not run in lockstep: where each starts a pass, and the host's
//! periodic tick. Without these, vCPUs with the same work and the same costs reach every page
//! at the same virtual time and fault on it together; real vCPU threads start one after
//! another and are interrupted on their own, so they meet on far fewer pages.
//!
//! - **Starting a pass** ([`PassStart`]): memstress's vCPU threads spin on the shared
//!   `iteration` (`vcpu_thread_main()` / `vcpu_worker()`); the host's store invalidates the line
//!   in every spinner's cache, and their reloads are served one after another, a cache-line
//!   transfer each, in an order nothing in the program fixes (the run's seed fixes it here, anew
//!   each pass). kvm_page_table_test's threads sleep on one semaphore instead; the host
//!   `sem_post()`s once per vCPU, each post a `futex(FUTEX_WAKE)` that wakes the thread that has
//!   waited longest (the futex queue is FIFO): the one that finished the previous stage first.
//! - **The tick**: every busy CPU takes the scheduling-clock interrupt `HZ` times a second, at
//!   the same instants on every CPU (`tick_setup_sched_timer()` without `skew_tick`). A vCPU in
//!   guest mode exits for it, runs the handler and re-enters; the CPU that keeps time
//!   (`tick_do_timer_cpu`, here vCPU 0's) also updates jiffies and the clock. Simplified: a tick
//!   is taken at the vCPU's next guest access after it falls due, as if the vCPU were in guest
//!   mode then (a tick during a fault costs the handler without the exit on real hardware).

use super::lock::LineCost;
use super::Ps;

/// How the vCPU threads learn that the host started a pass.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PassStart {
    /// Every thread spins on the shared variable the host stores (memstress's `iteration`);
    /// `seed` fixes the order their reloads are served in.
    Poll {
        /// The run's seed (`-r`).
        seed: u32,
    },
    /// The threads sleep on one semaphore the host posts once per vCPU (kvm_page_table_test):
    /// woken in the order they started waiting, one futex wake apart.
    Semaphore,
}

/// The drift sources of a run, as the engine applies them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Drift {
    /// How passes start.
    pub start: PassStart,
    /// One cache-line transfer, for [`PassStart::Poll`].
    pub line: LineCost,
    /// One `sem_post()` that wakes a waiter, for [`PassStart::Semaphore`].
    pub wake: Ps,
    /// The tick's period (`1/HZ`), or 0 without a periodic tick.
    pub tick: Ps,
}

impl Drift {
    /// When each vCPU starts pass `iteration`, after the host published it at `now`: vCPU
    /// `i`'s start is `starts[i]`. `finished[i]` is where vCPU `i`'s last pass ended (its
    /// `GUEST_SYNC`), which orders a semaphore's waiters.
    pub fn start_times(
        &self,
        iteration: i64,
        now: Ps,
        finished: &[Ps],
        remote: impl Fn(usize) -> bool,
    ) -> Vec<Ps> {
        let n = finished.len();
        let mut order: Vec<usize> = (0..n).collect();
        match self.start {
            PassStart::Poll { seed } => {
                order.sort_by_key(|&i| mix(seed as u64, iteration as u64, i as u64));
                let mut at = now;
                let mut starts = vec![0; n];
                for i in order {
                    // The line is served to one reader at a time.
                    at += if remote(i) {
                        self.line.remote
                    } else {
                        self.line.local
                    };
                    starts[i] = at;
                }
                starts
            }
            PassStart::Semaphore => {
                // The thread that finished first has waited longest (ties: the lower index,
                // which reached sem_wait() first when the threads were created).
                order.sort_by_key(|&i| (finished[i], i));
                let mut starts = vec![0; n];
                for (rank, i) in order.into_iter().enumerate() {
                    // A thread still finishing its last stage is not waiting yet: it takes
                    // its post when it gets there.
                    starts[i] = (now + (rank as Ps + 1) * self.wake).max(finished[i]);
                }
                starts
            }
        }
    }

    /// The first tick after `clock` (ticks fall at whole periods on every CPU), or
    /// `Ps::MAX` without a tick.
    pub fn next_tick(&self, clock: Ps) -> Ps {
        if self.tick == 0 {
            return Ps::MAX;
        }
        (clock / self.tick + 1) * self.tick
    }
}

/// A deterministic pseudo-random key of (seed, pass, vCPU): splitmix64's finaliser.
fn mix(seed: u64, iteration: u64, vcpu: u64) -> u64 {
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(iteration.wrapping_mul(0xBF58_476D_1CE4_E5B9))
        .wrapping_add(vcpu.wrapping_mul(0x94D0_49BB_1331_11EB));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drift(start: PassStart) -> Drift {
        Drift {
            start,
            line: LineCost {
                local: 48_000,
                remote: 135_000,
            },
            wake: 500_000,
            tick: 4_000_000_000,
        }
    }

    #[test]
    fn pollers_start_one_line_transfer_apart_in_an_order_the_seed_fixes() {
        let d = drift(PassStart::Poll { seed: 1 });
        let s = d.start_times(1, 1000, &[0; 4], |_| false);
        let mut sorted = s.clone();
        sorted.sort();
        assert_eq!(sorted, vec![49_000, 97_000, 145_000, 193_000]);
        // The same seed and pass give the same order; other passes or seeds shuffle it.
        assert_eq!(s, d.start_times(1, 1000, &[0; 4], |_| false));
        let others: Vec<Vec<Ps>> = (2..8)
            .map(|it| d.start_times(it, 1000, &[0; 4], |_| false))
            .collect();
        assert!(others.iter().any(|o| *o != s));
        // A reader on the other socket waits for a cross-socket transfer.
        let r = d.start_times(1, 0, &[0; 1], |_| true);
        assert_eq!(r, vec![135_000]);
    }

    #[test]
    fn semaphore_waiters_wake_first_come_first_served() {
        let d = drift(PassStart::Semaphore);
        // vCPU 2 finished first, then 0, then 1; vCPU 3 is still finishing when posted.
        let s = d.start_times(1, 10_000_000, &[300, 700, 100, 20_000_000], |_| false);
        assert_eq!(s, vec![11_000_000, 11_500_000, 10_500_000, 20_000_000]);
    }

    #[test]
    fn ticks_fall_on_whole_periods() {
        let d = drift(PassStart::Semaphore);
        assert_eq!(d.next_tick(0), 4_000_000_000);
        assert_eq!(d.next_tick(4_000_000_000), 8_000_000_000);
        assert_eq!(d.next_tick(3_999_999_999), 4_000_000_000);
        let no_tick = Drift { tick: 0, ..d };
        assert_eq!(no_tick.next_tick(5), Ps::MAX);
    }
}
