//! The interface between KVM core and an MMU flavour: what a vCPU's exit reports, the
//! per-vCPU state a flavour keeps, fault return codes, resumable jobs with yield points, and the
//! [`Mmu`] trait.

use crate::hw::pgtable::Level;
use crate::hw::walker::{RangeWalk, RunLeaf, WalkResult};
use crate::kvm::meter::Meter;
use crate::kvm::mmu_lock::{Held, LockKind, LockMode, MmuLockHeld, Write};
use crate::kvm::vm_lines::VmLineWrites;
use crate::kvm::Kvm;
use crate::units::{Gfn, GfnRange};
use crossbeam_epoch::Guard;

/// What a guest does besides touching memory: the intercepted instructions and events of a
/// nested guest's life. Each exits to KVM, which handles it and resumes the vCPU after it.
/// Nested guests are modelled on x86 (nested EPT); other MMUs refuse these.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum GuestOp {
    /// A memory access (the guest's loads and stores; everything else is an exit).
    #[default]
    Access,
    /// L1 enters or resumes its nested guest (`VMLAUNCH`/`VMRESUME`), whose stage-2 root
    /// pointer (vmcs12's EPTP) is `root_pointer`.
    EnterNested {
        /// The EPTP: the root table's L1 address, the walk length and the A/D enable.
        root_pointer: u64,
    },
    /// The nested guest exits to L1 for a reason L1 handles (its timer tick here): KVM
    /// reflects the exit and the vCPU runs L1 again.
    ExitNested,
    /// L1 invalidates what it cached for its nested guests (`INVEPT`): the translations of one
    /// root pointer (single-context), or of all of them (`None`: global).
    InvalidateNested {
        /// The EPTP whose translations go, or `None` for all.
        root_pointer: Option<u64>,
    },
}

/// What a vCPU's exit reports about a guest access the MMU must resolve (an EPT violation on
/// x86, a stage-2 abort on arm64), before the architecture looks anything up.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GuestFault {
    /// The faulting page in the address space the vCPU translates: a guest frame with
    /// two-dimensional paging, a guest-virtual page with shadow paging.
    pub addr: Gfn,
    /// The 8-byte word of the page the access touched.
    pub word: usize,
    /// The value of a write: what KVM's emulator decodes from the instruction when it must
    /// emulate the write.
    pub value: u64,
    /// The access was a write.
    pub write: bool,
    /// The entry that stopped the hardware walk was present: a permission fault.
    pub present: bool,
    /// The level where the hardware walk stopped, in the MMU format's numbering (arm64's ESR
    /// reports it: a translation fault at the level of the invalid entry, a permission fault at
    /// the leaf's).
    pub level: Level,
    /// A present entry that lacked only its Access flag (arm64's access-flag fault status
    /// code; never on x86).
    pub access_flag: bool,
    /// The vCPU that faulted.
    pub vcpu: usize,
    /// What the guest did: a memory access (an EPT violation, a stage-2 abort) or an
    /// intercepted nested-guest instruction ([`GuestOp`]), which exits unconditionally.
    pub op: GuestOp,
    /// `Some(mmu_seq)` when this is the same fault again after the host faulted its page in
    /// ([`FaultStart::Host`]): the MMU uses this snapshot, taken before the host ran, and does
    /// not count the exit again.
    pub after_host_fault: Option<u64>,
}

/// `RET_PF_*`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RetPf {
    /// `RET_PF_CONTINUE`: not handled yet (also the fast path's "take the slow path").
    Continue,
    /// `RET_PF_RETRY`: let the vCPU re-execute and fault again.
    Retry,
    /// `RET_PF_FIXED`: a new or changed SPTE was installed.
    Fixed,
    /// `RET_PF_SPURIOUS`: the access is already allowed.
    Spurious,
    /// `RET_PF_EMULATE` / `RET_PF_WRITE_PROTECTED`: the write hit a write-protected guest page
    /// table and was emulated; the access is complete.
    Emulated,
    /// `-ENOSPC`: the shadow MMU could not free a shadow page for the fault; `KVM_RUN` fails.
    NoSpace,
    /// Not a `RET_PF_*` value: an intercepted instruction ([`GuestOp`] other than an access)
    /// was executed by KVM; the vCPU resumes after it.
    Handled,
    /// Not a `RET_PF_*` value: the nested guest's fault is L1's to handle (its EPT12 tables do
    /// not map the address): KVM injects an EPT violation into L1
    /// (`nested_ept_inject_page_fault()`), and the vCPU runs L1 from there.
    InjectNested,
    /// Not a `RET_PF_*` value: the host had no free page for the fault (its allocation is at
    /// the min watermark, [`Kvm::faultin_pfn`]); the vCPU re-enters and faults again once
    /// reclaim has freed memory. The exit ends there, so other actors run in between.
    NoMemory,
}

/// What a vCPU keeps for its MMU flavour between the halves of a fault and across faults: its
/// memory caches, topped up before `mmu_lock` is taken, and the fault in flight (KVM keeps
/// them in `struct kvm_vcpu_arch` and on the faulting thread's stack). Each flavour has its
/// own; [`Mmu::create_vcpu_mmu`] makes it.
pub trait VcpuMmu: Send {
    /// The flavour's own type, so it can find its state again.
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
    /// `kvm_mmu_free_memory_caches()` when the vCPU is destroyed, so table counters balance.
    fn free_memory_caches(&mut self, kvm: &Kvm);
    /// While the vCPU runs a nested guest: the root table its hardware walks
    /// ([`Mmu::hw_walk_nested`]), held by the vCPU; `None` while it runs L1.
    fn nested_root(&self) -> Option<u64> {
        None
    }
}

/// A fault KVM cannot handle as the model runs it: the run stops with this one line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    /// x86: an access no memslot maps (an MMIO exit, which the model's guests never make).
    #[error("vCPU {vcpu} accessed {gfn:?}, which no memslot maps (MMIO is not modelled)")]
    NoMemslot {
        /// The faulting vCPU.
        vcpu: usize,
        /// The guest frame the access reached.
        gfn: crate::units::Gfn,
    },
    /// arm64: a stage-2 abort outside every memslot (an MMIO exit to userspace).
    #[error("vCPU {vcpu}: stage-2 abort at IPA {ipa:#x} outside every memslot (an MMIO exit to userspace, which the model's guests never make)")]
    AbortOutsideMemslots {
        /// The faulting vCPU.
        vcpu: usize,
        /// The intermediate physical address of the abort.
        ipa: u64,
    },
    /// arm64: a write to a read-only memslot (an MMIO exit to userspace).
    #[error("vCPU {vcpu}: write to read-only memslot {slot} at IPA {ipa:#x} (an MMIO exit to userspace)")]
    WriteToReadOnlySlot {
        /// The faulting vCPU.
        vcpu: usize,
        /// The memslot's id.
        slot: u32,
        /// The intermediate physical address of the write.
        ipa: u64,
    },
    /// A fault the guest itself would take (its own page tables do not map the address).
    #[error("vCPU {vcpu}: {what}")]
    GuestFault {
        /// The faulting vCPU.
        vcpu: usize,
        /// What the guest walk found.
        what: String,
    },
    /// A nested-guest instruction this x86 MMU or configuration does not model.
    #[error("{op:?}: nested guests {why}")]
    NestedUnsupported {
        /// The instruction.
        op: GuestOp,
        /// Why not, as the rest of the sentence.
        why: &'static str,
    },
    /// arm64: nested virtualization is not modelled.
    #[error("vCPU {vcpu}: {op:?}: nested guests are not modelled on arm64")]
    NestedOnArm64 {
        /// The vCPU.
        vcpu: usize,
        /// The instruction.
        op: GuestOp,
    },
}

/// What the engine must do to finish a fault after [`Mmu::begin_fault`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FaultStart {
    /// Finished without `mmu_lock`.
    Done(RetPf),
    /// Take `mmu_lock` in this mode and run [`Mmu::page_fault`].
    Slow(LockMode),
    /// The host must fault the page in first (`kvm::host_fault`); the MMU kept nothing of the
    /// fault, which runs again from [`Mmu::begin_fault`] once the host is done.
    Host(crate::kvm::host_fault::HostFault),
}

/// What one run of a job under the lock ended with.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum JobStep {
    /// Finished; `flush` is the range the caller owes a TLB flush for.
    Done {
        /// The guest frames whose translations changed without a flush yet (`None`: none).
        flush: Option<GfnRange>,
    },
    /// Someone waits for `mmu_lock` (`cond_resched_rwlock_*()`): release it, let others in,
    /// retake it and run again; the job restarts from its cursor.
    Yield,
    /// The job needs memory: release the lock, call [`MmuJob::topup`], retake and run again.
    NeedTopup,
}

/// A long MMU operation with a cursor and explicit yield points, where KVM has
/// `tdp_mmu_iter_cond_resched()` / `cond_resched_rwlock_*()`.
pub trait MmuJob: Send {
    /// Name for traces and reports.
    fn name(&self) -> &'static str;
    /// The lock mode every run needs.
    fn lock_mode(&self) -> LockMode;
    /// Runs under `held` from the cursor until done or a yield point says to stop.
    ///
    /// In virtual time `held.needbreak()` runs the vCPUs on this thread up to the job's clock,
    /// so at a yield point a job must hold no lock that a vCPU's lockless path (its exit and
    /// the fault's front half) takes; what `mmu_lock` protects it may hold, since the slow
    /// halves that take it wait for the job.
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep;
    /// Allocates what [`JobStep::NeedTopup`] asked for; runs without the lock.
    fn topup(&mut self, _kvm: &Kvm, _meter: &mut Meter) {}
}

/// An MMU flavour (TDP MMU, shadow MMU, arm64 stage-2) behind KVM core: what every flavour
/// provides, whatever its architecture. What only one architecture's KVM asks of its MMUs
/// (x86's dirty-log write protection, for instance) is that architecture's trait.
pub trait Mmu: Send + Sync {
    /// Short name (`tdp`).
    fn name(&self) -> &'static str;

    /// The MMU as its concrete type, for the layers above that need one flavour's own
    /// operations (`crate::vm::Vm::shadow`, `stage2`, `x86`).
    fn as_any(&self) -> &dyn std::any::Any;

    /// The hardware page walk of a vCPU running a nested guest, from the root table at
    /// `root_table` ([`VcpuMmu::nested_root`]): the EPT02 tables KVM built for it. Only MMUs
    /// that shadow nested guests' tables are asked.
    ///
    /// # Safety
    ///
    /// `root_table` is 0 or the table of a nested root the walking vCPU holds a reference on,
    /// as [`VcpuMmu::nested_root`] gave it at this VM entry.
    unsafe fn hw_walk_nested(
        &self,
        _root_table: u64,
        _gfn: Gfn,
        _write: bool,
        _guard: &Guard,
        _levels_read: &mut u64,
    ) -> WalkResult {
        unreachable!("{} runs no nested guest", self.name())
    }

    /// The hardware page walk a vCPU does on a TLB miss, against this MMU's root. `pml_full`:
    /// the vCPU's page-modification log is on and full, so a walk that would set a Dirty flag
    /// stops with [`WalkResult::PmlFull`] (only x86 with EPT has PML).
    fn hw_walk(
        &self,
        gfn: Gfn,
        write: bool,
        pml_full: bool,
        guard: &Guard,
        levels_read: &mut u64,
    ) -> WalkResult;

    /// [`Mmu::hw_walk`]s of the gfns `first`, `first + 1`, … one after another, for as long as
    /// each reaches a 4K leaf of `first`'s last-level table that allows the access, each
    /// reading [`Mmu::stage2_walk_levels`] entries ([`walk_leaf_run`]): `each` hears of each
    /// leaf and says whether the run goes on. Only for a caller that knows nothing else
    /// changes the tables meanwhile (a vCPU's private steps). Returns how many gfns it walked;
    /// 0 (the default) where this MMU's walks go one at a time.
    ///
    /// [`walk_leaf_run`]: crate::hw::walker::walk_leaf_run
    fn hw_walk_leaf_run(
        &self,
        _first: Gfn,
        _n: u64,
        _write: bool,
        _log_room: u64,
        _guard: &Guard,
        _each: &mut dyn FnMut(RunLeaf) -> bool,
    ) -> u64 {
        0
    }

    /// Whether a hardware walk ([`Mmu::hw_walk`]) of every gfn of `check` (for a write when
    /// `write`) would complete, changing (through its Accessed/Dirty updates) no entry that also
    /// maps a gfn outside `range` (which holds `check`): read from the tables as they are now,
    /// changing nothing, at most `*budget` entries (counted off; where it stopped once they
    /// are spent). [`RangeWalk::Blocked`] at `check`'s start where not known (the default). The virtual-time
    /// engine's fast-forward asks it of the gfns a vCPU's guest keeps to
    /// (`engine::virtual_time::fast_forward`), a part at a time.
    fn range_walks_private(
        &self,
        _range: GfnRange,
        check: GfnRange,
        _write: bool,
        _budget: &mut u64,
    ) -> RangeWalk {
        RangeWalk::Blocked(check.start)
    }

    /// This MMU's per-vCPU state, for a new vCPU.
    fn create_vcpu_mmu(&self) -> Box<dyn VcpuMmu>;

    /// Translation is two-dimensional (the guest's own stage 1, then this MMU's tables as stage
    /// 2 or EPT): the vCPU's TLB keeps stage-2-only entries a combined miss consults before
    /// walking, and caps combined entries at the guest's stage-1 page. False for shadow paging,
    /// whose tables already map guest virtual addresses to host frames.
    fn tlb_caches_stage2(&self) -> bool {
        true
    }

    /// The writes to the VM-wide lines of its state that every CPU changing the MMU writes
    /// ([`VmLine`](crate::kvm::vm_lines::VmLine)): lines that move between cores when they take
    /// turns. `None` by default: arm64's stage 2 writes none on its fault path.
    fn vm_line_writes(&self) -> Option<&VmLineWrites> {
        None
    }

    /// Which of Linux's locks `kvm->mmu_lock` is for this MMU: an rwlock by default (x86 since
    /// 5.13, arm64 since 5.18).
    fn mmu_lock_kind(&self) -> LockKind {
        LockKind::Rwlock
    }

    /// Entries a stage-2 (EPT) walk reads from the root down to a 4K leaf: what translating one
    /// of the guest's own table pages costs when no stage-2 walk entry covers it
    /// ([`crate::hw::guest_tables`]). 4 by default: x86's 4-level EPT.
    fn stage2_walk_levels(&self) -> u64 {
        4
    }

    /// The core whose TLB the vCPUs have.
    fn tlb_geometry(&self) -> &'static crate::hw::tlb::TlbGeometry {
        &crate::hw::tlb::CASCADE_LAKE
    }

    /// The host's data caches the architecture's host has (Cascade Lake by default).
    fn host_cache_shape(&self) -> &'static crate::hw::cache::HostCacheShape {
        &crate::hw::cache::CASCADE_LAKE_8275CL
    }

    /// The lockless front half of a fault (`kvm_mmu_page_fault()` up to taking `mmu_lock`):
    /// find the memslot, size the mapping, try the fast path, top up `vcpu_mmu`'s caches, and
    /// say which lock mode the slow half needs. An error is a fault KVM cannot handle (no
    /// memslot; a fault the guest itself would take).
    fn begin_fault(
        &self,
        kvm: &Kvm,
        vcpu_mmu: &mut dyn VcpuMmu,
        exit: &GuestFault,
        meter: &mut Meter,
    ) -> Result<FaultStart, FaultError>;

    /// The slow half of the fault [`Mmu::begin_fault`] left in `vcpu_mmu`, under `held`.
    fn page_fault(
        &self,
        kvm: &Kvm,
        vcpu_mmu: &mut dyn VcpuMmu,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> RetPf;

    /// `kvm_tdp_mmu_zap_leafs()` / `kvm_unmap_gfn_range()`: remove every leaf in the range.
    /// Write lock. Returns the range the caller owes a flush for.
    fn zap_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: Held<'_, Write>,
        meter: &mut Meter,
    ) -> Option<GfnRange>;

    /// `kvm_arch_flush_shadow_memslot()`: what deleting the memslot `[start, end)` zaps, under
    /// the write lock. By default the slot's mappings ([`Mmu::zap_gfn_range`]); x86's shadow
    /// MMU may zap everything instead (`kvm_mmu_zap_all_fast()`, KVM's default quirk). Returns
    /// the range the caller owes a flush for.
    fn flush_shadow_memslot(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        held: Held<'_, Write>,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        self.zap_gfn_range(kvm, start, end, held, meter)
    }

    /// `kvm_set_spte_gfn()`, the `change_pte` callback the host makes when it has replaced the
    /// page behind `gfn` with `pfn` (copy-on-write of the zero page), write lock held and the
    /// invalidation that removed the old mapping still open. By default nothing: x86's
    /// `kvm_set_pte_rmap()` and `kvm_tdp_mmu_set_spte_gfn()` change only present SPTEs, and
    /// `invalidate_range_start` has zapped them. Arm64 maps the new page read-only.
    fn set_spte_gfn(
        &self,
        _kvm: &Kvm,
        _gfn: Gfn,
        _pfn: crate::units::Pfn,
        _held: Held<'_, Write>,
        _meter: &mut Meter,
    ) {
    }

    /// Aging (`kvm_age_gfn()`, `kvm_test_age_gfn()`, the seed's `kvm_arch_test_clear_young()`):
    /// visits every present leaf in `[start, end)` whose Accessed flag is set, calls
    /// `young(gfn, pages)` with the first gfn and the number of pages it maps, and clears the
    /// flag when that returns true. `held` is the write lock, or `None` for a walk under RCU
    /// alone (asked only of an MMU whose [`Mmu::lockless_age_range`] or
    /// [`Mmu::lockless_test_clear_young`] says it can). Returns whether any leaf was young.
    fn age_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        young: &mut dyn FnMut(Gfn, u64) -> bool,
        held: Option<Held<'_, Write>>,
        meter: &mut Meter,
    ) -> bool;

    /// The per-range aging callbacks can run without `mmu_lock` (Linux 6.15's
    /// `CONFIG_KVM_MMU_LOCKLESS_AGING`: the x86 TDP MMU).
    fn lockless_age_range(&self) -> bool {
        false
    }

    /// Seed 003's batched `test_clear_young` can run without `mmu_lock` (the x86 TDP MMU, and
    /// arm64 stage 2 with hardware AF updates and RCU-freed tables).
    fn lockless_test_clear_young(&self) -> bool {
        false
    }

    /// The virtual-time engine's note that `vcpu`'s fault held `mmu_lock` until `end_ps` (the
    /// grant is in [`MmuLockHeld::virtual_start_ps`]): an MMU whose faults write under the read
    /// lock without the shared walker's atomics keeps the holds that may overlap, so that a
    /// fault granted inside another's hold sees what that hold had not yet written (arm64's
    /// seed 001 v2). Nothing for every other MMU.
    fn fault_hold_ended(&self, _vcpu: usize, _end_ps: u64) {}

    /// Page-table invariants (writable triples, leaf PFNs match memslots, mapping levels within
    /// what the slot allows, stats match the tree, writable leaves in logged slots are dirty).
    /// Must run with no other actor active.
    fn check_invariants(&self, kvm: &Kvm) -> Vec<String>;

    /// Leaves currently mapped at 4K, 2M and 1G (KVM's `pages_4k/2m/1g` stats).
    fn page_stats(&self) -> [i64; 3];

    /// `kvm_arch_commit_memory_region()` for a memslot created or deleted: the shadow MMU
    /// sizes its page quota from the memslots (`kvm_mmu_change_mmu_pages()`) and drops the
    /// rmaps of deleted slots. A deleted slot was zapped with [`Mmu::zap_gfn_range`] first.
    fn commit_memory_region(&self, _kvm: &Kvm) {}

    /// The host's caches are modelled from now on ([`Kvm::caches`]): gives the MMU's metadata
    /// that exists already its place in host memory, as the running core allocated it. Called
    /// while no actor runs.
    fn place_metadata(&self, _kvm: &Kvm) {}

    /// Counters specific to this MMU (the shadow MMU's page quota and page counts), for
    /// reports.
    fn mmu_stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}
