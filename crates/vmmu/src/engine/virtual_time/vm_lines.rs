//! The VM-wide lines of MMU state that critical sections write
//! ([`VmLine`](crate::kvm::vm_lines::VmLine)), in virtual time: where each line is, so that a
//! holder that writes one another core wrote last pays its transfer inside its critical
//! section (a store that misses stalls the holder until the line arrives).

use super::lock::Core;
use crate::kvm::meter::Meter;
use crate::kvm::vm_lines::NR_VM_LINES;

/// A cache line written by actors in turn: where it is, so a write knows whether it must move.
#[derive(Default, Debug, Clone, Copy)]
pub struct SharedLine {
    /// The core that wrote it last (`None`: nobody yet).
    owner: Option<Core>,
}

impl SharedLine {
    /// `core` writes the line: `None` when it has it already, else `Some(remote)`, whether it
    /// comes from another socket.
    pub fn write(&mut self, core: Core) -> Option<bool> {
        let moved = match self.owner {
            Some(o) if o.actor == core.actor => None,
            Some(o) => Some(o.socket != core.socket),
            None => Some(false),
        };
        self.owner = Some(core);
        moved
    }
}

/// Every VM-wide line of the MMU.
#[derive(Default, Debug)]
pub struct VmLines([SharedLine; NR_VM_LINES]);

impl VmLines {
    /// After a critical section of `core`: each line whose write count went from `before` to
    /// `after` was written; when another core wrote it last, its transfer is counted on `meter`
    /// (`lock_line_transfers`, or `_remote` across sockets), which prices it into the hold.
    pub fn wrote(
        &mut self,
        before: &[u64; NR_VM_LINES],
        after: &[u64; NR_VM_LINES],
        core: Core,
        meter: &mut Meter,
    ) {
        for ((line, b), a) in self.0.iter_mut().zip(before).zip(after) {
            if a == b {
                continue;
            }
            match line.write(core) {
                Some(true) => meter.lock_line_transfers_remote += 1,
                Some(false) => meter.lock_line_transfers += 1,
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_line_moves_only_when_another_core_wrote_it() {
        let c = |actor, socket| Core { actor, socket };
        let mut line = SharedLine::default();
        assert_eq!(line.write(c(0, 0)), Some(false));
        assert_eq!(line.write(c(0, 0)), None);
        assert_eq!(line.write(c(1, 1)), Some(true));
        assert_eq!(line.write(c(2, 1)), Some(false));
    }

    #[test]
    fn only_lines_written_are_charged() {
        let mut lines = VmLines::default();
        let mut m = Meter::default();
        let core = |actor| Core { actor, socket: 0 };
        lines.wrote(&[0, 0], &[1, 0], core(0), &mut m);
        lines.wrote(&[1, 0], &[1, 0], core(1), &mut m);
        assert_eq!(m.lock_line_transfers, 1, "core 1 wrote nothing");
        lines.wrote(&[1, 0], &[2, 1], core(1), &mut m);
        assert_eq!(m.lock_line_transfers, 3, "one moved, one new");
    }
}
