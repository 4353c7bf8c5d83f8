//! What KVM's x86 code asks of its two MMU flavours, beyond the neutral [`Mmu`]: the fault
//! description (`struct kvm_page_fault`), the page-table cache both flavours top up, the front half of a fault
//! both flavours share (`kvm_mmu_page_fault()` up to `mmu_lock`: the shadow-paging guest walk,
//! `kvm_mmu_hugepage_adjust()`, `fast_page_fault()`, the cache top-up) with what it asks of
//! each flavour ([`X86FaultPath`], and the per-vCPU state [`FlavourVcpuMmu`]), and the
//! dirty-log operations x86's architecture hooks drive ([`X86Mmu`]).

use crate::kvm::host_fault::Faultin;
use crate::kvm::memory_cache::{MmuMemoryCache, KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE};
use crate::kvm::memslot::{Memslot, KVM_MEM_READONLY};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{FaultError, FaultStart, GuestFault, GuestOp, Mmu, MmuJob, RetPf, VcpuMmu};
use crate::kvm::mmu_ctx::MmuCtx;
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld, Write};
use crate::kvm::Kvm;
use crate::units::{Gfn, Pfn};
use crate::x86::guest_paging::GuestWalker;
use crate::x86::spte::SHADOW_NONPRESENT_VALUE;
use crate::x86::spte::{Level, X86Gfn, X86Level, PG_LEVEL_4K};
use crossbeam_epoch as epoch;
use std::sync::Arc;

/// `kvm_flush_remote_tlbs_gfn()` (x86's `mmu_internal.h`): flush the huge-aligned range
/// around `gfn` at `level`.
pub fn kvm_flush_remote_tlbs_gfn(kvm: &Kvm, gfn: Gfn, level: Level, meter: &mut Meter) {
    kvm.flush_remote_tlbs_range(gfn.round_for_level(level), level.pages(), meter)
}

/// `kvm_mmu_max_mapping_level()` without dirty logging: the level of the largest page the
/// memslot allows at `gfn`, and the host maps there (`host_pfn_mapping_level()`).
pub fn max_mapping_level(kvm: &Kvm, slot: &Memslot, gfn: Gfn) -> Level {
    Level::from_page_size(kvm.max_mapping_size(slot, gfn))
}

/// `PT64_ROOT_MAX_LEVEL`: a fault tops the table cache up to at least this many.
pub const PT64_ROOT_MAX_LEVEL: usize = 5;

/// `struct kvm_page_fault`: what a vCPU's EPT violation asks of the MMU.
#[derive(Clone)]
pub struct KvmPageFault {
    /// The faulting page in the address space the vCPU translates: a guest frame with EPT,
    /// a guest-virtual page with shadow paging (`fault->addr`).
    pub addr: Gfn,
    /// The 8-byte word of the page the access touched, and the value a write stores: what
    /// KVM's emulator decodes from the instruction when it must emulate the write.
    pub word: usize,
    /// The value of a write.
    pub value: u64,
    /// Shadow paging and nested guests: the walk of the guest's tables (its own, or L1's EPT12
    /// tables) that found `gfn` (`struct guest_walker`).
    pub guest: Option<Box<GuestWalker>>,
    /// A nested guest faulted (`is_guest_mode()`): `addr` is its guest physical page, `gfn`
    /// L1's, and the fault maps through the vCPU's EPT02 root.
    pub guest_mode: bool,
    /// Faulting gfn.
    pub gfn: Gfn,
    /// The access was a write.
    pub write: bool,
    /// The EPT violation reported a present entry (a permission fault).
    pub present: bool,
    /// The vCPU that faulted (for its dirty ring).
    pub vcpu: usize,
    /// The memslot holding `gfn`.
    pub slot: Arc<Memslot>,
    /// The slot logged dirty pages when the fault looked it up. KVM's fault holds a pointer to
    /// one memslot version for its whole life (SRCU); here the flags change in place, so the
    /// fault keeps this snapshot and every decision it makes uses it.
    pub dirty_logging: bool,
    /// Level the fault will map at (`kvm_mmu_hugepage_adjust()`: the largest the host backing
    /// and the slot's alignment allow, 4K while the slot logs dirty pages).
    pub goal_level: Level,
    /// Host frame of `gfn`, rounded down to `goal_level`.
    pub pfn: Pfn,
    /// The host maps the page writable (`fault->map_writable`).
    pub map_writable: bool,
    /// `fault->mmu_seq`: the invalidation sequence before the page was looked up.
    pub mmu_seq: u64,
}

impl KvmPageFault {
    /// `mark_page_dirty_in_slot()` for this fault's page, in the memslot version the fault
    /// looked up (its `dirty_logging` snapshot), into the faulting vCPU's ring if rings are on.
    pub fn mark_page_dirty(&self, kvm: &Kvm, meter: &mut Meter) {
        kvm.mark_page_dirty_in_slot(
            &self.slot,
            self.gfn,
            self.dirty_logging,
            Some(self.vcpu),
            meter,
        )
    }
}

/// A new `mmu_shadow_page_cache` (`vcpu->arch.mmu_shadow_page_cache`): the page tables a vCPU
/// tops up before taking `mmu_lock`, for either flavour's tables.
pub fn new_shadow_page_cache() -> MmuMemoryCache {
    MmuMemoryCache::new(KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE, SHADOW_NONPRESENT_VALUE)
}

/// `mmu_topup_memory_caches()`'s page-table part: enough tables (`PT64_ROOT_MAX_LEVEL`) for
/// any one fault, counted in `tables_allocated`.
pub fn topup_shadow_page_cache(cache: &mut MmuMemoryCache, kvm: &Kvm, meter: &mut Meter) {
    let n = cache.topup(PT64_ROOT_MAX_LEVEL, &kvm.tables);
    meter.tables_allocated += n as u64;
}

/// What an x86 flavour keeps per vCPU (KVM keeps it in `struct kvm_vcpu_arch`): its memory
/// caches and, for the shadow MMU, the nested guests' roots (`vcpu->arch.guest_mmu`). KVM's one
/// vCPU structure carries every cache and both MMU contexts because one VM may use both
/// flavours at once (the TDP MMU for L1, the shadow MMU for its nested guests); a model VM runs
/// one flavour, so each keeps only what it uses.
pub trait FlavourVcpuMmu: Default + Send + 'static {
    /// `mmu_topup_memory_caches()`: before a fault takes `mmu_lock`, enough objects of every
    /// cache the flavour allocates from under it for any one fault.
    fn mmu_topup_memory_caches(&mut self, kvm: &Kvm, meter: &mut Meter);
    /// `mmu_free_memory_caches()`.
    fn free_memory_caches(&mut self, kvm: &Kvm);
    /// While the vCPU runs a nested guest: the root table its hardware walks (0: none loaded
    /// yet; the walk faults and the fault loads one). `None` while it runs L1.
    fn nested_root(&self) -> Option<u64> {
        None
    }
}

/// An x86 vCPU's MMU state: its flavour's (`F`: caches and nested roots) and the fault between
/// its two halves.
#[derive(Default)]
pub struct X86VcpuMmu<F> {
    /// The flavour's per-vCPU state.
    pub flavour: F,
    /// The fault [`kvm_mmu_begin_fault`] prepared for the slow half.
    fault: Option<KvmPageFault>,
}

impl<F: FlavourVcpuMmu> VcpuMmu for X86VcpuMmu<F> {
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn free_memory_caches(&mut self, kvm: &Kvm) {
        self.flavour.free_memory_caches(kvm);
    }
    fn nested_root(&self) -> Option<u64> {
        self.flavour.nested_root()
    }
}

/// The x86 state of a vCPU's MMU for flavour state `F`. Panics if `vcpu_mmu` belongs to
/// another flavour: a vCPU's MMU state always comes from its VM's MMU.
pub fn x86_vcpu_mmu<F: FlavourVcpuMmu>(vcpu_mmu: &mut dyn VcpuMmu) -> &mut X86VcpuMmu<F> {
    vcpu_mmu
        .as_any_mut()
        .downcast_mut()
        .expect("an x86 MMU was given another flavour's vCPU state")
}

/// What the shadow-paging guest walk of a fault found ([`X86FaultPath::walk_guest`]).
pub enum GuestWalk {
    /// The MMU maps guest physical addresses: the faulting page is the gfn.
    Direct,
    /// The guest's tables map the page: a guest-virtual page under shadow paging, or a nested
    /// guest's physical page through L1's EPT12 tables (`guest_mode`).
    Walked {
        /// The walk (`struct guest_walker`).
        walker: GuestWalker,
        /// The vCPU runs a nested guest (`is_guest_mode()`).
        guest_mode: bool,
    },
    /// L1's EPT12 tables do not map the nested guest's page: the fault is L1's, reflected to
    /// it with a nested VM-exit (`nested_ept_inject_page_fault()`).
    Reflected,
    /// A fault the guest itself would take (not modelled: the run stops).
    Failed(String),
}

/// The dirty-log operations of an x86 MMU flavour (the TDP MMU or the shadow MMU) that x86's
/// architecture hooks drive.
pub trait X86Mmu: Mmu {
    /// Eager page splitting of `[start, end)` of `slot` down to `target_level`, under the lock
    /// mode given (read at enable time, write inside CLEAR_DIRTY_LOG).
    fn try_split_huge_pages(
        &self,
        slot: &Arc<Memslot>,
        start: Gfn,
        end: Gfn,
        target_level: Level,
        mode: LockMode,
    ) -> Box<dyn MmuJob>;

    /// `kvm_mmu_slot_remove_write_access()`: clear W on every leaf at or above `start_level`.
    fn slot_remove_write_access(&self, slot: &Arc<Memslot>, start_level: Level) -> Box<dyn MmuJob>;

    /// `kvm_mmu_slot_gfn_write_protect()`: write-protect (W and MMU-writable) the leaves at or
    /// above `min_level` mapping `gfn`. Write lock. Returns true if anything changed.
    fn slot_gfn_write_protect(
        &self,
        ctx: &mut MmuCtx<'_, Write>,
        slot: &Memslot,
        gfn: Gfn,
        min_level: Level,
    ) -> bool;

    /// Re-protect the 4K leaves of the 64 pages from `slot.base_gfn + gfn_offset` selected by
    /// `mask`, under the write lock: clear W (`wrprot`: `kvm_mmu_write_protect_pt_masked()`)
    /// or D (PML: `kvm_mmu_clear_dirty_pt_masked()`), the choice the TDP MMU's
    /// `kvm_tdp_mmu_clear_dirty_pt_masked()` takes as its `wrprot` argument. Returns true if
    /// anything changed.
    fn clear_pt_masked(
        &self,
        ctx: &mut MmuCtx<'_, Write>,
        slot: &Memslot,
        gfn_offset: u64,
        mask: u64,
        wrprot: bool,
    ) -> bool;

    /// `kvm_mmu_slot_leaf_clear_dirty()`: clear D on the slot's leaves so the CPU logs the next
    /// write to each (PML). The TDP MMU clears every leaf under the read lock; the shadow MMU
    /// clears its 4K rmaps under the write lock. The caller flushes the memslot.
    fn slot_leaf_clear_dirty(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob>;

    /// `kvm_mmu_recover_huge_pages()`: after dirty logging is disabled, map huge again.
    fn recover_huge_pages(&self, slot: &Arc<Memslot>) -> Box<dyn MmuJob>;
}

/// The fault path of an x86 MMU flavour: what [`kvm_mmu_begin_fault`], the front half both
/// flavours share, and [`kvm_mmu_slow_page_fault`] ask of it. The nested-guest hooks have
/// defaults for a flavour that runs no nested guests.
pub trait X86FaultPath: X86Mmu + Sized {
    /// The flavour's per-vCPU state.
    type Vcpu: FlavourVcpuMmu;

    /// The guest walk before any lock is taken: `FNAME(walk_addr)` of the guest's own tables
    /// under shadow paging, or of L1's EPT12 tables for a nested guest (`ept_page_fault()`).
    fn walk_guest(
        &self,
        _kvm: &Kvm,
        _vcpu: &mut Self::Vcpu,
        _addr: Gfn,
        _write: bool,
        _meter: &mut Meter,
    ) -> GuestWalk {
        GuestWalk::Direct
    }

    /// The lockless part of a nested guest's intercepted instruction (nested VM-entry or exit,
    /// `INVEPT`), on `vcpu`: [`FaultStart::Slow`] when the rest needs `mmu_lock`
    /// ([`X86FaultPath::nested_op_locked`]). An error when this MMU runs no nested guests.
    fn nested_op_begin(
        &self,
        _kvm: &Kvm,
        _vcpu: &mut Self::Vcpu,
        op: GuestOp,
        _meter: &mut Meter,
    ) -> Result<FaultStart, FaultError> {
        Err(FaultError::NestedUnsupported {
            op,
            why: "are modelled with the shadow MMU only (tdp_mmu=N)",
        })
    }

    /// The locked part of the instruction [`X86FaultPath::nested_op_begin`] left pending.
    fn nested_op_locked(
        &self,
        _kvm: &Kvm,
        _vcpu: &mut Self::Vcpu,
        _held: &MmuLockHeld,
        _meter: &mut Meter,
    ) -> Option<RetPf> {
        None
    }

    /// `fast_page_fault()`: tries to fix the fault without `mmu_lock`; `Continue` means take
    /// the slow path.
    fn fast_page_fault(&self, kvm: &Kvm, fault: &KvmPageFault, meter: &mut Meter) -> RetPf;

    /// The lock mode the slow path of `fault` needs, declared before taking it.
    fn fault_lock_mode(&self, fault: &KvmPageFault) -> LockMode;

    /// The slow path of a fault, under `held` (`kvm_tdp_mmu_map()`, `direct_page_fault()`'s
    /// locked part, `FNAME(page_fault)`'s).
    fn slow_page_fault(
        &self,
        kvm: &Kvm,
        fault: &KvmPageFault,
        held: &MmuLockHeld,
        vcpu: &mut Self::Vcpu,
        meter: &mut Meter,
    ) -> RetPf;
}

/// The neutral [`Mmu`] fault entry points of an x86 MMU flavour, expanded inside its
/// `impl Mmu`: both flavours share one front half ([`kvm_mmu_begin_fault`]) and reach their own
/// slow path through [`X86FaultPath::slow_page_fault`] ([`kvm_mmu_slow_page_fault`]).
macro_rules! x86_fault_entry_points {
    () => {
        fn create_vcpu_mmu(&self) -> Box<dyn $crate::kvm::mmu::VcpuMmu> {
            $crate::x86::mmu::create_vcpu_mmu::<Self>()
        }

        fn begin_fault(
            &self,
            kvm: &$crate::kvm::Kvm,
            vcpu_mmu: &mut dyn $crate::kvm::mmu::VcpuMmu,
            exit: &$crate::kvm::mmu::GuestFault,
            meter: &mut $crate::kvm::meter::Meter,
        ) -> Result<$crate::kvm::mmu::FaultStart, $crate::kvm::mmu::FaultError> {
            $crate::x86::mmu::kvm_mmu_begin_fault(self, kvm, vcpu_mmu, exit, meter)
        }

        fn page_fault(
            &self,
            kvm: &$crate::kvm::Kvm,
            vcpu_mmu: &mut dyn $crate::kvm::mmu::VcpuMmu,
            held: &$crate::kvm::mmu_lock::MmuLockHeld,
            meter: &mut $crate::kvm::meter::Meter,
        ) -> $crate::kvm::mmu::RetPf {
            $crate::x86::mmu::kvm_mmu_slow_page_fault(self, kvm, vcpu_mmu, held, meter)
        }
    };
}
pub(crate) use x86_fault_entry_points;

/// A new vCPU's x86 MMU state ([`Mmu::create_vcpu_mmu`] of both flavours).
pub fn create_vcpu_mmu<M: X86FaultPath>() -> Box<dyn VcpuMmu> {
    Box::new(X86VcpuMmu::<M::Vcpu>::default())
}

/// The lock-free front half of `kvm_mmu_page_fault()` ([`Mmu::begin_fault`] of both flavours):
/// walk the guest's tables under shadow paging, find the memslot, size the mapping
/// (`kvm_mmu_hugepage_adjust()`: the backing, the slot's alignment and the guest's page size
/// bound it; dirty logging forces 4K), try `fast_page_fault()`, and top up the caches before
/// any lock is taken. The fault waits in `vcpu_mmu` for [`kvm_mmu_slow_page_fault`].
pub fn kvm_mmu_begin_fault<M: X86FaultPath>(
    mmu: &M,
    kvm: &Kvm,
    vcpu_mmu: &mut dyn VcpuMmu,
    exit: &GuestFault,
    meter: &mut Meter,
) -> Result<FaultStart, FaultError> {
    let v = x86_vcpu_mmu::<M::Vcpu>(vcpu_mmu);
    debug_assert!(
        v.fault.is_none(),
        "a fault's slow half was abandoned: every FaultStart::Slow must reach page_fault()"
    );
    let GuestFault {
        addr,
        word,
        value,
        write,
        present,
        vcpu,
        level: _,
        access_flag: _,
        op,
        after_host_fault,
    } = *exit;
    if op != GuestOp::Access {
        return mmu.nested_op_begin(kvm, &mut v.flavour, op, meter);
    }
    let reads_before = meter.guest_pte_reads;
    // Shadow paging: FNAME(page_fault) walks the guest's tables first; the guest frame it
    // finds is what the rest of the fault maps, and the guest's page size bounds the level.
    // A nested guest's fault walks L1's EPT12 tables; when they do not map the address the
    // fault is L1's, and L1 runs.
    let (gfn, guest, guest_mode) = match mmu.walk_guest(kvm, &mut v.flavour, addr, write, meter) {
        GuestWalk::Direct => (addr, None, false),
        GuestWalk::Walked { walker, guest_mode } => {
            (walker.gfn, Some(Box::new(walker)), guest_mode)
        }
        GuestWalk::Reflected => return Ok(FaultStart::Done(RetPf::InjectNested)),
        // The run stops here: what the meter counted is not reported.
        GuestWalk::Failed(what) => return Err(FaultError::GuestFault { vcpu, what }),
    };
    // After the host faulted the page in, the walk is done again only to find the fault's
    // frame: KVM walked once, so its reads are not counted twice.
    if after_host_fault.is_some() {
        meter.guest_pte_reads = reads_before;
    }
    let guard = epoch::pin();
    let Some(slot) = kvm.gfn_to_memslot(gfn, &guard) else {
        return Err(FaultError::NoMemslot { vcpu, gfn });
    };
    let max_level = max_mapping_level(kvm, slot, gfn);
    let dirty_logging = slot.dirty_track_enabled();
    let max_level = guest.as_ref().map_or(max_level, |w| max_level.min(w.level));
    let goal_level = if dirty_logging {
        PG_LEVEL_4K
    } else {
        max_level
    };
    // mmu_seq = kvm->mmu_invalidate_seq; smp_rmb(); then kvm_faultin_pfn() (kept from before
    // the host faulted the page in, when it did).
    let mmu_seq = after_host_fault.unwrap_or_else(|| kvm.mmu_invalidate.snapshot());
    let pfn = Pfn(slot.gfn_to_pfn(gfn.round_for_level(goal_level)).0);
    let mut fault = KvmPageFault {
        addr,
        word,
        value,
        guest,
        guest_mode,
        gfn,
        write,
        present,
        vcpu,
        slot: Arc::clone(slot),
        dirty_logging,
        goal_level,
        pfn,
        map_writable: slot.flags() & KVM_MEM_READONLY == 0,
        mmu_seq,
    };
    drop(guard);
    // FNAME(page_fault) has no fast path: only faults on direct roots try it.
    if !guest_mode {
        let r = mmu.fast_page_fault(kvm, &fault, meter);
        if r != RetPf::Continue {
            return Ok(FaultStart::Done(r));
        }
    }
    let st = x86_vcpu_mmu::<M::Vcpu>(vcpu_mmu);
    st.flavour.mmu_topup_memory_caches(kvm, meter);
    // kvm_faultin_pfn(), after the caches are topped up as direct_page_fault() orders them: a
    // page the host swapped out is read back here, before mmu_lock.
    let page = fault.slot.gfn_to_pfn(gfn);
    kvm.place_first_touch(&fault.slot, page);
    match kvm.faultin_pfn(fault.pfn, page, write, mmu_seq, meter) {
        Faultin::Mapped { pfn, writable } => {
            // The host maps the zero page read-only: so does KVM (map_writable).
            fault.pfn = pfn;
            fault.map_writable &= writable;
        }
        Faultin::Host(h) => return Ok(FaultStart::Host(h)),
        Faultin::NoMemory => return Ok(FaultStart::Done(RetPf::NoMemory)),
    }
    let mode = mmu.fault_lock_mode(&fault);
    st.fault = Some(fault);
    Ok(FaultStart::Slow(mode))
}

/// The slow half of the fault [`kvm_mmu_begin_fault`] prepared ([`Mmu::page_fault`] of both
/// flavours).
pub fn kvm_mmu_slow_page_fault<M: X86FaultPath>(
    mmu: &M,
    kvm: &Kvm,
    vcpu_mmu: &mut dyn VcpuMmu,
    held: &MmuLockHeld,
    meter: &mut Meter,
) -> RetPf {
    let st = x86_vcpu_mmu::<M::Vcpu>(vcpu_mmu);
    if let Some(ret) = mmu.nested_op_locked(kvm, &mut st.flavour, held, meter) {
        return ret;
    }
    let fault = st
        .fault
        .take()
        .expect("page_fault() without a fault from begin_fault()");
    // is_page_fault_stale(): an invalidation of the page opened, or ended, since the fault
    // looked it up; the vCPU faults again.
    if kvm.mmu_invalidate.retry_gfn(fault.mmu_seq, fault.gfn) {
        return RetPf::Retry;
    }
    mmu.slow_page_fault(kvm, &fault, held, &mut st.flavour, meter)
}
