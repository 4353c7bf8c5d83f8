//! Intel's Page-Modification Log (SDM Vol. 3C, "Page-Modification Logging"): with EPT A/D on
//! and PML enabled in the VMCS, each time the CPU sets an EPT leaf's Dirty flag (0 to 1) it
//! writes the guest-physical address of the access into a 4 KiB log of 512 entries and moves
//! the index down; when the index has left 0–511, the next access that would set a Dirty flag
//! causes a PML-full VM exit *before* the flag is set, and the access is retried after it.
//! Software (KVM's `vmx_flush_pml_buffer()`) empties the log and resets the index.
//!
//! Not modelled: with EPT A/D on, the CPU's walks of the guest's own page tables count as
//! writes and log those pages too (the guest's stage-1 tables are not modelled, and the
//! memstress guest's A/D bits are set once, in its first pass); and KVM's fastpath exits that
//! re-enter the guest without `vmx_handle_exit()` (they do not empty the log).

use crate::units::Gfn;

/// Entries in the log (KVM's `PML_LOG_NR_ENTRIES`, `PML_ENTITY_NUM` before Linux 6.15).
pub const PML_LOG_NR_ENTRIES: usize = 512;

/// The index the CPU writes first (KVM's `PML_HEAD_INDEX`): the log fills from the top down.
pub const PML_HEAD_INDEX: u16 = PML_LOG_NR_ENTRIES as u16 - 1;

/// One vCPU's page-modification log and the VMCS state that drives it: the log page, the
/// `GUEST_PML_INDEX` field, and the "enable PML" secondary execution control.
pub struct PmlLog {
    /// The 4 KiB log page: guest-physical addresses, bits 11:0 clear.
    buf: Box<[u64; PML_LOG_NR_ENTRIES]>,
    /// `GUEST_PML_INDEX`: the next entry to write; past 0 it wraps to 0xffff (log full).
    index: u16,
    /// `SECONDARY_EXEC_ENABLE_PML`.
    enabled: bool,
}

impl Default for PmlLog {
    fn default() -> Self {
        PmlLog {
            buf: Box::new([0; PML_LOG_NR_ENTRIES]),
            index: PML_HEAD_INDEX,
            enabled: false,
        }
    }
}

impl PmlLog {
    /// The CPU logs Dirty-flag updates (the VMCS control is set).
    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Sets or clears the VMCS control (`vmx_update_cpu_dirty_logging()`). Entries already
    /// logged stay until software empties the log.
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    /// Logging is on and the index has left the log: the next Dirty-flag update is a PML-full
    /// exit instead.
    #[inline]
    pub fn is_full(&self) -> bool {
        self.enabled && self.index as usize >= PML_LOG_NR_ENTRIES
    }

    /// Nothing logged since the last drain.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.index == PML_HEAD_INDEX
    }

    /// Entries logged since the last drain.
    pub fn len(&self) -> usize {
        if self.index as usize >= PML_LOG_NR_ENTRIES {
            PML_LOG_NR_ENTRIES
        } else {
            PML_HEAD_INDEX as usize - self.index as usize
        }
    }

    /// How many more Dirty-flag updates the log has room for while it is on (`None`: off, no
    /// update is logged).
    #[inline]
    pub fn room(&self) -> Option<usize> {
        self.enabled.then(|| PML_LOG_NR_ENTRIES - self.len())
    }

    /// The CPU set the Dirty flag of the leaf translating `gfn`: write its address at the
    /// index and move the index down. Only when enabled and not full (a full log exits first).
    #[inline]
    pub fn log(&mut self, gfn: Gfn) {
        debug_assert!(
            self.enabled && !self.is_full(),
            "a PML write into a full or disabled log"
        );
        self.buf[self.index as usize] = gfn.to_gpa().0;
        self.index = self.index.wrapping_sub(1);
    }

    /// The gfns logged since the last drain, as [`PmlLog::drain`] yields them, leaving them
    /// there (for tests that compare two logs).
    #[cfg(test)]
    pub(crate) fn logged(&self) -> Vec<Gfn> {
        let first = PML_LOG_NR_ENTRIES - self.len();
        self.buf[first..].iter().map(|&gpa| gpa_gfn(gpa)).collect()
    }

    /// The gfns [`PmlLog::drain_gpas`] yields the addresses of, in its order (for tests).
    #[cfg(test)]
    pub fn drain(&mut self) -> impl ExactSizeIterator<Item = Gfn> + '_ {
        self.drain_gpas().iter().map(|&gpa| gpa_gfn(gpa))
    }

    /// `vmx_flush_pml_buffer()`: resets the index and yields every logged entry as the log
    /// page holds it, a guest-physical address ([`gpa_gfn`] turns one into its gfn). The
    /// order is the one Linux up to 6.14 reads (from the index up, newest entry first); 6.15
    /// reads oldest first, which matters only for the order of dirty-ring entries.
    pub fn drain_gpas(&mut self) -> &[u64] {
        // The index points at the next free entry (the head when empty), unless the log just
        // overflowed.
        let first = if self.index as usize >= PML_LOG_NR_ENTRIES {
            0
        } else {
            self.index as usize + 1
        };
        self.index = PML_HEAD_INDEX;
        &self.buf[first..]
    }
}

/// The gfn of a log entry (a guest-physical address, bits 11:0 clear).
#[inline]
pub fn gpa_gfn(gpa: u64) -> Gfn {
    debug_assert_eq!(gpa & 0xfff, 0, "a PML entry is page aligned");
    Gfn(gpa >> crate::units::PAGE_SHIFT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_downward_is_full_after_512_and_drains_newest_first() {
        let mut log = PmlLog::default();
        log.set_enabled(true);
        assert!(log.is_empty() && !log.is_full());
        for g in 0..PML_LOG_NR_ENTRIES as u64 {
            assert!(!log.is_full(), "full after {g} entries");
            log.log(Gfn(1000 + g));
        }
        assert!(log.is_full());
        assert_eq!(log.len(), PML_LOG_NR_ENTRIES);
        let seen: Vec<u64> = log.drain().map(|g| g.0).collect();
        assert_eq!(seen.len(), PML_LOG_NR_ENTRIES);
        let want: Vec<u64> = (0..PML_LOG_NR_ENTRIES as u64)
            .rev()
            .map(|g| 1000 + g)
            .collect();
        assert_eq!(seen, want);
        assert!(log.is_empty() && !log.is_full());
        log.log(Gfn(7));
        log.log(Gfn(8));
        let seen: Vec<u64> = log.drain().map(|g| g.0).collect();
        assert_eq!(seen, vec![8, 7]);
        assert_eq!(log.drain().len(), 0);
    }

    #[test]
    fn a_disabled_log_is_never_full_and_keeps_what_it_logged() {
        let mut log = PmlLog::default();
        log.set_enabled(true);
        log.log(Gfn(3));
        log.set_enabled(false);
        assert!(!log.is_full() && !log.is_empty());
        let seen: Vec<u64> = log.drain().map(|g| g.0).collect();
        assert_eq!(seen, vec![3]);
    }
}
