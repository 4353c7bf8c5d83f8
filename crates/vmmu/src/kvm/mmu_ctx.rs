//! What an MMU operation under `mmu_lock` works with, as one value: the VM, the hold with its
//! mode in the type ([`Held`]), the RCU read-side guard that keeps every table the walk reads
//! alive (under the read lock other walkers unlink tables; under the write lock nobody else
//! does, so there the guard only defers the holder's own frees, as KVM's `rcu_read_lock()` is
//! not taken by the shadow MMU's write-locked fault), and the actor's meter. KVM reaches all four from `kvm` and the thread it runs on;
//! here they travel together, so no walker threads them by hand, and a function that needs the
//! write lock takes an `MmuCtx<Write>` (a compile error with a read hold, as
//! `lockdep_assert_held_write()` is a run-time one in KVM).

use crate::hw::page_table::{PageTable, PageTableStats};
use crate::hw::pgtable::walk::CountReads;
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{Held, HeldMode, LockMode};
use crate::kvm::Kvm;
use crossbeam_epoch::Guard;

/// The context of an MMU operation under `mmu_lock` held in mode `M`.
pub struct MmuCtx<'c, M> {
    /// The VM.
    pub kvm: &'c Kvm,
    /// The hold, its mode in the type.
    pub held: Held<'c, M>,
    /// The RCU read side: tables unlinked meanwhile are freed only after it ends.
    pub guard: &'c Guard,
    /// The actor's counters.
    pub meter: &'c mut Meter,
    /// The table line the walk read last ([`count_entry_read`]).
    last_line: u64,
}

impl<'c, M: HeldMode> MmuCtx<'c, M> {
    /// A context of `held` for `kvm`, reading under `guard` and counting on `meter`.
    pub fn new(kvm: &'c Kvm, held: Held<'c, M>, guard: &'c Guard, meter: &'c mut Meter) -> Self {
        MmuCtx {
            kvm,
            held,
            guard,
            meter,
            last_line: u64::MAX,
        }
    }

    /// The hold is the read lock: updates must be atomic against other readers (KVM's
    /// `shared`).
    pub fn shared(&self) -> bool {
        M::MODE == LockMode::Read
    }

    /// `rwlock_needbreak()` on the hold, with the holder's work so far.
    pub fn needbreak(&self) -> bool {
        self.held.needbreak(self.meter)
    }
}

impl<M> CountReads for MmuCtx<'_, M> {
    #[inline]
    fn pte_read(&mut self, table: &PageTable, index: usize) {
        count_entry_read(
            self.meter,
            &self.kvm.tables,
            &mut self.last_line,
            table,
            index,
        );
    }
}

/// A walk's entry reads, counted as `spte_reads` and, where the host's caches are modelled,
/// priced there: for walks that need no more context than a meter (arm64's stage-2 walker).
pub struct TableReads<'m> {
    /// The actor's counters.
    pub meter: &'m mut Meter,
    tables: &'m PageTableStats,
    last_line: u64,
}

impl<'m> TableReads<'m> {
    /// Reads of the tables `tables` counts, charged to `meter`.
    pub fn new(meter: &'m mut Meter, tables: &'m PageTableStats) -> Self {
        TableReads {
            meter,
            tables,
            last_line: u64::MAX,
        }
    }
}

impl CountReads for TableReads<'_> {
    #[inline]
    fn pte_read(&mut self, table: &PageTable, index: usize) {
        count_entry_read(self.meter, self.tables, &mut self.last_line, table, index);
    }
}

/// Counts one entry read on `meter`, and what its line costs in the host's caches when it is
/// not the line read just before (`last_line`: a walk reads a line's eight entries one after
/// another; the cache model's L1 would find the line again too, but this check spares the
/// walk its lock for seven of every eight entries).
#[inline]
pub fn count_entry_read(
    meter: &mut Meter,
    tables: &PageTableStats,
    last_line: &mut u64,
    table: &PageTable,
    index: usize,
) {
    meter.spte_reads += 1;
    if let Some(lines) = tables.lines() {
        let line = table.addr() | (index >> 3) as u64;
        if line != *last_line {
            *last_line = line;
            meter.count_line(lines.entry(table.addr(), index));
        }
    }
}
