//! The resources the vCPUs share without being actors, accounted in epochs of virtual time so
//! that what one vCPU's access gets from them does not depend on the order in which the engine
//! ran the other vCPUs' accesses of the same epoch:
//!
//! - each socket's DRAM bandwidth ([`Epochs::dram_wait`]): an access waits for the backlog the
//!   socket's memory carried into the epoch, drained at the bandwidth since the epoch began; the
//!   lines moved during an epoch join the backlog when it ends;
//! - the guest's lines in the host's last-level caches: each vCPU keeps the lines its accesses
//!   fetched during the epoch ([`Vcpu::guest_lines`](crate::vm::vcpu::Vcpu)) and they enter the
//!   caches when the epoch ends, vCPU by vCPU ([`Epochs::close`] through the engine).
//!
//! The engine ends a vCPU's turn at the end of the open epoch and closes it only once every
//! running actor's clock has passed it, so an epoch's accesses are all made before it closes,
//! and none of a later epoch's before.
//!
//! Simplified: a burst of traffic delays other accesses from the next epoch on, not within its
//! own (a queue of line transfers in arrival order would delay the accesses behind it at
//! once); and the guest's lines of an epoch compete with KVM's own data from the epoch's end.
//! The epoch is short against every phase the model reports (an iteration of a dirty-log pass
//! is hundreds of microseconds at least), so the throughput of a saturated socket and the time
//! a saturated pass takes are what a queue in arrival order gives.

use super::pricer::Ps;

/// The length of an accounting epoch: 2 µs, 20 times the DRAM latency of the default hosts
/// (the backlog one epoch's traffic adds is seen from the next), and short against the
/// shortest phase a selftest reports.
pub const EPOCH_PS: Ps = 2_000_000;

/// One socket's DRAM bandwidth, epoch by epoch.
#[derive(Default, Clone, Copy, Debug)]
struct DramSocket {
    /// The transfer time queued at the start of the open epoch (what earlier epochs moved
    /// beyond what the bandwidth drained).
    backlog: Ps,
    /// The lines moved from this socket's memory during the open epoch.
    lines: u64,
}

/// The shared resources' epochs (see the module documentation).
#[derive(Debug)]
pub struct Epochs {
    /// The index of the open epoch (`EPOCH_PS` long, from virtual time 0).
    open: u64,
    /// Each socket's DRAM bandwidth.
    dram: Vec<DramSocket>,
    /// What one 64-byte line occupies of a socket's DRAM bandwidth.
    line_ps: Ps,
    /// How long the traffic in flight may be before an access waits: the DRAM latency (with
    /// the bandwidth, Little's law gives the bytes the memory system keeps in flight).
    window_ps: Ps,
}

impl Epochs {
    /// Epoch 0 of `sockets` sockets' memories, each moving a line in `line_ps`, with a
    /// latency of `window_ps`.
    pub fn new(sockets: usize, line_ps: Ps, window_ps: Ps) -> Self {
        Epochs {
            open: 0,
            dram: vec![DramSocket::default(); sockets.max(1)],
            line_ps,
            window_ps,
        }
    }

    /// Where the open epoch ends: a vCPU's turn stops before it.
    #[inline]
    pub fn open_end(&self) -> Ps {
        (self.open + 1).saturating_mul(EPOCH_PS)
    }

    /// Whether virtual time `t` lies past the open epoch (it must be closed before anything at
    /// `t` runs).
    #[inline]
    pub fn past_open(&self, t: Ps) -> bool {
        t / EPOCH_PS > self.open
    }

    /// Closes every epoch before the one holding `t`: each socket's backlog takes the lines its
    /// memory moved in the open epoch and drains for every epoch closed. The caller merges
    /// the guest's lines of the closed epoch into the caches.
    pub fn close(&mut self, t: Ps) {
        let next = t / EPOCH_PS;
        if next <= self.open {
            return;
        }
        let closed = next - self.open;
        for s in &mut self.dram {
            let queued = s.backlog + s.lines * self.line_ps;
            s.backlog = queued.saturating_sub(closed.saturating_mul(EPOCH_PS));
            s.lines = 0;
        }
        self.open = next;
    }

    /// `lines` DRAM lines of socket `socket`'s memory moved by an access starting at `start`
    /// (in the open epoch): returns how long the access waits, which is how much longer than
    /// the DRAM latency the backlog carried into the epoch takes to drain from `start`. Below
    /// saturation the backlog stays shorter than that, and nothing waits.
    #[inline]
    pub fn dram_wait(&mut self, socket: usize, start: Ps, lines: u64) -> Ps {
        let wait = self.dram_backlog_wait(socket, start);
        self.add_dram_lines(socket, lines);
        wait
    }

    /// What [`Epochs::dram_wait`] waits at `start` on socket `socket`, moving nothing.
    #[inline]
    pub fn dram_backlog_wait(&self, socket: usize, start: Ps) -> Ps {
        let s = &self.dram[socket.min(self.dram.len() - 1)];
        let since_open = start.saturating_sub(self.open * EPOCH_PS);
        s.backlog
            .saturating_sub(since_open)
            .saturating_sub(self.window_ps)
    }

    /// `lines` lines moved from socket `socket`'s memory in the open epoch (what
    /// [`Epochs::dram_wait`] adds).
    #[inline]
    pub fn add_dram_lines(&mut self, socket: usize, lines: u64) {
        let last = self.dram.len() - 1;
        self.dram[socket.min(last)].lines += lines;
    }

    /// The index of the open epoch.
    pub fn open(&self) -> u64 {
        self.open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn below_saturation_nothing_waits() {
        let mut e = Epochs::new(1, 1_000, 100_000);
        // Half the epoch's bandwidth.
        assert_eq!(e.dram_wait(0, 0, EPOCH_PS / 2_000), 0);
        e.close(EPOCH_PS);
        assert_eq!(e.dram_wait(0, EPOCH_PS, 1), 0);
    }

    #[test]
    fn an_epochs_excess_delays_the_next_and_drains() {
        let mut e = Epochs::new(2, 1_000, 100_000);
        // Twice what the epoch can move, on socket 1.
        let lines = 2 * EPOCH_PS / 1_000;
        assert_eq!(e.dram_wait(1, 10, lines), 0, "not within its own epoch");
        e.close(EPOCH_PS + 5);
        // One epoch's worth is left: at the epoch's start it exceeds the window by that much
        // less the window; halfway through, half of it has drained.
        assert_eq!(e.dram_wait(1, EPOCH_PS, 0), EPOCH_PS - 100_000);
        assert_eq!(
            e.dram_wait(1, EPOCH_PS + EPOCH_PS / 2, 0),
            EPOCH_PS / 2 - 100_000
        );
        assert_eq!(e.dram_wait(0, EPOCH_PS, 0), 0, "the other socket is idle");
        // Two more epochs close with nothing moved: drained.
        e.close(3 * EPOCH_PS);
        assert_eq!(e.dram_wait(1, 3 * EPOCH_PS, 0), 0);
    }

    #[test]
    fn the_order_of_an_epochs_accesses_does_not_matter() {
        let run = |order: &[(usize, Ps, u64)]| {
            let mut e = Epochs::new(2, 700, 90_000);
            e.dram_wait(0, 0, 10_000);
            e.dram_wait(1, 0, 4_000);
            e.close(EPOCH_PS);
            let waits: Vec<Ps> = order
                .iter()
                .map(|&(s, t, n)| e.dram_wait(s, t, n))
                .collect();
            e.close(2 * EPOCH_PS);
            (
                waits,
                e.dram_wait(0, 2 * EPOCH_PS, 0),
                e.dram_wait(1, 2 * EPOCH_PS, 0),
            )
        };
        let a = [
            (0, EPOCH_PS + 10, 5),
            (1, EPOCH_PS + 900, 3_000),
            (0, EPOCH_PS + 40, 2),
        ];
        let (wa, a0, a1) = run(&a);
        let b = [a[2], a[0], a[1]];
        let (wb, b0, b1) = run(&b);
        assert_eq!((wa[0], wa[1], wa[2]), (wb[1], wb[2], wb[0]));
        assert_eq!((a0, a1), (b0, b1));
    }
}
