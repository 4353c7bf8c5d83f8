//! KVM core: the state every MMU flavour works against — memslots, `mmu_lock`, vCPU requests,
//! the remote-flush API, dirty marking — and the [`mmu::Mmu`] trait the flavours implement.

pub mod arch;
pub mod dirty_log;
pub mod dirty_ring;
pub mod host_caches;
pub mod host_fault;
pub mod memory_cache;
pub mod memslot;
pub mod memslot_delete;
pub mod meter;
pub mod mmu;
pub mod mmu_ctx;
pub mod mmu_lock;
pub mod mmu_notifier;
pub mod op_plan;
pub mod vcpu;
pub mod vm_lines;

use crate::host::lru::{self, HostMm};
use crate::host::memory::HostMemory;
use crate::hw::page_table::PageTableStats;
use crate::hw::pml::gpa_gfn;
use crate::hw::tlb::TlbInvalidation;
use crate::units::{Gfn, Pfn};
use arch::KvmArch;
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use dirty_ring::DirtyRing;
use host_fault::{Faultin, ZeroPage};
use memslot::Memslot;
use meter::Meter;
use mmu_lock::MmuLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use vcpu::{TlbiPending, VcpuShared, VcpuWaiter, KVM_REQ_TLB_FLUSH};

pub use vcpu::KVM_REQ_UPDATE_CPU_DIRTY_LOGGING;

/// `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE`.
pub const KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE: u64 = 1 << 0;
/// `KVM_DIRTY_LOG_INITIALLY_SET`.
pub const KVM_DIRTY_LOG_INITIALLY_SET: u64 = 1 << 1;

/// The memslots of the VM, sorted by base gfn; replaced as a whole (RCU style) on change.
#[derive(Default)]
pub struct MemslotSet {
    /// Slots by ascending `base_gfn`.
    pub slots: Vec<Arc<Memslot>>,
}

/// Why KVM core refused a request (each is a one-line message for the user).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvmError {
    /// `kvm_arch_init_vm()` runs once.
    #[error("the architecture hooks are already installed")]
    ArchInstalled,
    /// `KVM_CAP_DIRTY_LOG_RING` is enabled once.
    #[error("the dirty ring is already enabled")]
    DirtyRingEnabled,
    /// A `--zero-page` value that is not one of the behaviours.
    #[error("unknown zero-page behaviour '{0}' (use off, change-pte or no-change-pte)")]
    UnknownZeroPage(String),
    /// A writable leaf in a dirty-logged slot over a page its bitmap does not report dirty.
    #[error("gfn {0:#x}: writable in a dirty-logged slot but not dirty in its bitmap")]
    WritableLeafNotDirty(u64),
}

/// The VM-wide state of KVM that MMU code may use (`struct kvm`).
pub struct Kvm {
    /// `kvm->mmu_lock`.
    pub mmu_lock: MmuLock,
    memslots: Atomic<MemslotSet>,
    /// The shared part of each vCPU.
    pub vcpus: Box<[VcpuShared]>,
    waiter: Box<dyn VcpuWaiter>,
    /// Host memory backing the memslots.
    pub host: HostMemory,
    /// `kvm->manual_dirty_log_protect`.
    pub manual_dirty_log_protect: AtomicU64,
    /// The `eager_page_split` module parameter.
    pub eager_page_split: AtomicBool,
    /// Page-table allocation counters (leaks, metadata memory).
    pub tables: Arc<PageTableStats>,
    /// Per-vCPU dirty rings, when `KVM_CAP_DIRTY_LOG_RING` is enabled.
    pub dirty_rings: OnceLock<Box<[DirtyRing]>>,
    /// `KVM_RESET_DIRTY_RINGS` calls in progress: from when a reset plan takes the harvested
    /// entries out of the rings to its last step. A vCPU out for a full ring stays out until
    /// none is (the thread that reaps returns from the ioctl only then).
    pub dirty_ring_resets: AtomicUsize,
    /// The architecture's hooks, installed once the MMU exists ([`Kvm::set_arch`]).
    arch: OnceLock<Box<dyn KvmArch>>,
    /// `kvm_cpu_dirty_log_size()`: entries of the per-vCPU log in which the CPU itself records
    /// the pages it dirties (x86's PML: 512), or 0 where dirty logging is write protection only
    /// (arm64, AMD, shadow paging, `enable_pml=0`). Fixed when the VM is created.
    cpu_dirty_log_size: usize,
    /// `kvm->nr_memslots_dirty_logging`: memslots with `KVM_MEM_LOG_DIRTY_PAGES`, counted when
    /// a change is committed (`kvm_commit_memory_region()`). That is Linux 6.3's counter; 6.0
    /// kept the same count in `kvm->arch.cpu_dirty_logging_count`, changed inside
    /// `kvm_mmu_update_cpu_dirty_logging()` only with PML, which decides the same way.
    nr_memslots_dirty_logging: AtomicUsize,
    /// `mmu_invalidate_seq`, `mmu_invalidate_in_progress` and the open range: what faults
    /// check against the host's invalidations (`kvm::mmu_notifier`).
    pub mmu_invalidate: mmu_notifier::MmuInvalidate,
    /// The host's reclaim state, when the host can run out of memory and swap guest memory out
    /// (`vmmu reclaim`): faults on swapped-out pages swap them back in ([`Kvm::faultin_pfn`]).
    pub host_mm: OnceLock<Arc<HostMm>>,
    /// How the host answers reads of private anonymous memory nobody wrote.
    zero_page: ZeroPage,
    /// The host kernel's `CONFIG_HZ`: scheduling-clock interrupts per second on a busy CPU (0:
    /// none, as `nohz_full` gives a CPU running one task).
    tick_hz: u32,
    /// The host's data caches, when the engine prices what KVM's data costs in them (the
    /// virtual-time engine installs them; [`Kvm::install_caches`]).
    caches: OnceLock<Arc<host_caches::HostCaches>>,
}

impl Kvm {
    /// A VM with `nr_vcpus` vCPUs whose waits are served by `waiter`.
    pub fn new(nr_vcpus: usize, waiter: Box<dyn VcpuWaiter>, eager_page_split: bool) -> Self {
        Kvm {
            mmu_lock: MmuLock::default(),
            memslots: Atomic::new(MemslotSet::default()),
            vcpus: (0..nr_vcpus).map(|_| VcpuShared::default()).collect(),
            waiter,
            host: HostMemory::default(),
            manual_dirty_log_protect: AtomicU64::new(0),
            eager_page_split: AtomicBool::new(eager_page_split),
            tables: Arc::new(PageTableStats::default()),
            dirty_rings: OnceLock::new(),
            dirty_ring_resets: AtomicUsize::new(0),
            arch: OnceLock::new(),
            cpu_dirty_log_size: 0,
            nr_memslots_dirty_logging: AtomicUsize::new(0),
            mmu_invalidate: Default::default(),
            host_mm: OnceLock::new(),
            zero_page: ZeroPage::default(),
            tick_hz: 0,
            caches: OnceLock::new(),
        }
    }

    /// The host kernel's tick rate ([`Kvm::tick_hz`]), set while creating the VM.
    pub fn with_tick_hz(mut self, hz: u32) -> Self {
        self.tick_hz = hz;
        self
    }

    /// The host kernel's `CONFIG_HZ` (0: no periodic tick on busy CPUs).
    pub fn tick_hz(&self) -> u32 {
        self.tick_hz
    }

    /// Starts modelling the host's data caches with `caches`; false if the VM has them already
    /// (an engine ran on it before: they keep what they hold).
    /// Page tables allocated from now on are followed in them.
    pub fn install_caches(&self, caches: host_caches::HostCaches) -> bool {
        let caches = Arc::new(caches);
        if self.caches.set(Arc::clone(&caches)).is_err() {
            return false;
        }
        self.tables.install_lines(caches);
        true
    }

    /// The host's data caches, if modelled ([`Kvm::install_caches`]).
    #[inline]
    pub fn caches(&self) -> Option<&host_caches::HostCaches> {
        self.caches.get().map(|c| &**c)
    }

    /// The host's data caches, if modelled, for a holder that keeps them.
    pub fn caches_arc(&self) -> Option<Arc<host_caches::HostCaches>> {
        self.caches.get().cloned()
    }

    /// The host's zero-page behaviour ([`ZeroPage`]), set while creating the VM.
    pub fn with_zero_page(mut self, zero_page: ZeroPage) -> Self {
        self.zero_page = zero_page;
        self
    }

    /// How the host answers reads of private anonymous memory nobody wrote.
    pub fn zero_page(&self) -> ZeroPage {
        self.zero_page
    }

    /// What the host maps behind `gfn` of `slot` now: the slot's own frame, or the zero page's
    /// where the guest has only read it (the leaf PFN the invariants expect).
    pub fn host_pfn(&self, slot: &Memslot, gfn: Gfn) -> Pfn {
        let pfn = slot.gfn_to_pfn(gfn);
        host_fault::host_mapping(self, pfn, false).map_or(pfn, |(mapped, _)| mapped)
    }

    /// The largest page that may map `gfn` of `slot`: what the memslot allows
    /// ([`Memslot::max_mapping_size`]), and no more than the host maps there
    /// (`host_pfn_mapping_level()`: 4K where the host split a huge page).
    pub fn max_mapping_size(&self, slot: &Memslot, gfn: Gfn) -> crate::units::PageSize {
        let max = slot.max_mapping_size(gfn);
        if !slot.contains(gfn) {
            return max;
        }
        match host_fault::host_mapping_limit(self, slot.gfn_to_pfn(gfn)) {
            Some(limit) => max.min(limit),
            None => max,
        }
    }

    /// The host kernel's preemption model decides whether `mmu_lock` reports waiters
    /// ([`MmuLock::needbreak`]); set while creating the VM.
    pub fn with_preemption(mut self, preemption: mmu_lock::Preemption) -> Self {
        self.mmu_lock = MmuLock::new(preemption);
        self
    }

    /// This VM's vCPUs log the pages they dirty in a CPU log of `entries` entries (x86's PML:
    /// `kvm_x86_ops.cpu_dirty_log_size`), set while creating the VM.
    pub fn with_cpu_dirty_log_size(mut self, entries: usize) -> Self {
        self.cpu_dirty_log_size = entries;
        self
    }

    /// `kvm_cpu_dirty_log_size()`: 0 unless the CPU logs dirtied pages itself (PML).
    pub fn cpu_dirty_log_size(&self) -> usize {
        self.cpu_dirty_log_size
    }

    /// `kvm->nr_memslots_dirty_logging`.
    pub fn nr_memslots_dirty_logging(&self) -> usize {
        self.nr_memslots_dirty_logging.load(Ordering::SeqCst)
    }

    /// `kvm_commit_memory_region()`'s count of logging memslots, for a slot whose logging
    /// starts (`enable`) or stops.
    pub fn count_memslot_dirty_logging(&self, enable: bool) {
        if enable {
            self.nr_memslots_dirty_logging
                .fetch_add(1, Ordering::SeqCst);
        } else {
            self.nr_memslots_dirty_logging
                .fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Installs the architecture's hooks (`kvm_arch_init_vm()` and the MMU's init, which KVM
    /// runs while creating the VM). Fails if they are already installed.
    pub fn set_arch(&self, arch: Box<dyn KvmArch>) -> Result<(), KvmError> {
        self.arch.set(arch).map_err(|_| KvmError::ArchInstalled)
    }

    /// The architecture's hooks. Panics before [`Kvm::set_arch`]: a VM is not usable before
    /// its MMU exists.
    pub fn arch(&self) -> &dyn KvmArch {
        &**self
            .arch
            .get()
            .expect("KVM used before its architecture hooks were installed")
    }

    /// `KVM_CAP_DIRTY_LOG_RING`: per-vCPU rings of `entries` entries. Fails once enabled.
    pub fn enable_dirty_rings(&self, entries: u32) -> Result<(), KvmError> {
        self.dirty_rings
            .set(
                (0..self.vcpus.len())
                    .map(|_| DirtyRing::new(entries))
                    .collect(),
            )
            .map_err(|_| KvmError::DirtyRingEnabled)
    }

    /// `kvm_dirty_ring_check_request()`: vCPU `vcpu` may not enter the guest, because its
    /// dirty ring has reached its soft limit (`KVM_EXIT_DIRTY_RING_FULL`).
    #[inline]
    pub fn dirty_ring_full(&self, vcpu: usize) -> bool {
        self.dirty_rings.get().is_some_and(|r| r[vcpu].soft_full())
    }

    /// A vCPU out for a full ring may go back in: its ring is below the soft limit and no
    /// `KVM_RESET_DIRTY_RINGS` is in progress (userspace's reaping thread returns from the
    /// ioctl before it re-enters).
    pub fn dirty_ring_released(&self, vcpu: usize) -> bool {
        !self.dirty_ring_full(vcpu) && self.dirty_ring_resets.load(Ordering::SeqCst) == 0
    }

    /// `kvm_dirty_log_manual_protect_and_init_set()`.
    pub fn dirty_log_manual_protect_and_init_set(&self) -> bool {
        self.manual_dirty_log_protect.load(Ordering::Relaxed) & KVM_DIRTY_LOG_INITIALLY_SET != 0
    }

    /// Manual-protect mode is on (GET only copies; CLEAR re-protects).
    pub fn manual_protect(&self) -> bool {
        self.manual_dirty_log_protect.load(Ordering::Relaxed) & KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE
            != 0
    }

    /// The memslots, read under an RCU guard (KVM reads them under SRCU).
    pub fn memslots<'g>(&self, guard: &'g Guard) -> &'g MemslotSet {
        // SAFETY: the pointer is never null (initialised in new(), replaced only with a valid set
        // in install_memslots()), and old sets are destroyed only after a grace period, which
        // `guard` holds off.
        unsafe { self.memslots.load(Ordering::Acquire, guard).deref() }
    }

    /// `gfn_to_memslot()`.
    pub fn gfn_to_memslot<'g>(&self, gfn: Gfn, guard: &'g Guard) -> Option<&'g Arc<Memslot>> {
        let slots = &self.memslots(guard).slots;
        let i = slots.partition_point(|s| s.base_gfn <= gfn);
        slots[..i].last().filter(|s| s.contains(gfn))
    }

    /// The slot holding `gfn`.
    pub fn slot_by_gfn(&self, gfn: Gfn) -> Option<Arc<Memslot>> {
        let guard = epoch::pin();
        self.gfn_to_memslot(gfn, &guard).cloned()
    }

    /// The slot with userspace id `id`.
    pub fn slot_by_id(&self, id: u32) -> Option<Arc<Memslot>> {
        let guard = epoch::pin();
        self.memslots(&guard)
            .slots
            .iter()
            .find(|s| s.id == id)
            .cloned()
    }

    /// Where the host page behind `page` of `slot` lives, when the host's caches are modelled:
    /// on the socket of the running core (the faulting vCPU's) if this is the first fault that
    /// needs it ([`crate::host::memory::HostMemory::place_first_touch`]). The host page is the
    /// slot's backing page (a 2 MiB or 1 GiB page for huge page backings). Simplified: a page
    /// a read first mapped to the zero page is placed by that reader.
    pub fn place_first_touch(&self, slot: &Memslot, page: Pfn) {
        if let Some(caches) = self.caches() {
            let pages = (slot.backing.page_size() >> 12).max(1);
            let first = Pfn(page.0 & !(pages - 1));
            self.host
                .place_first_touch(first, pages, caches.running_cpu().socket);
        }
    }

    /// The host half of `kvm_faultin_pfn()` (`__gfn_to_pfn_memslot()`): `get_user_pages()` of
    /// `pfn` (the first frame of the mapping the fault wants; `page` is the faulting page's own)
    /// for a fault that reads or writes (`write`) it, whose `mmu_seq` was snapshotted
    /// before. Under host reclaim (`vmmu reclaim`), a swapped-out page is read back here
    /// ([`HostMm::faultin`]), counted on `meter`, or [`Faultin::NoMemory`] when the host has no
    /// free page above its min watermark: the fault returns
    /// [`RetPf::NoMemory`](mmu::RetPf::NoMemory) and the vCPU tries again. Simplified: the
    /// faulting task waits for kswapd instead of reclaiming itself
    /// (`__alloc_pages_direct_reclaim()`), each failed try charged as an allocation stall. On
    /// private anonymous memory whose host page table is modelled, a page the host maps as the
    /// fault needs is [`Faultin::Mapped`] (the zero page, read-only, for a read of a page
    /// nobody wrote), and any other needs the host's fault first ([`Faultin::Host`],
    /// `kvm::host_fault`).
    pub fn faultin_pfn(
        &self,
        pfn: Pfn,
        page: Pfn,
        write: bool,
        mmu_seq: u64,
        meter: &mut Meter,
    ) -> Faultin {
        if let Some(mm) = self.host_mm.get() {
            // get_user_pages() does not touch a resident page's host PTE.
            return match mm.faultin(pfn, &self.host, false) {
                lru::Faultin::Resident => Faultin::Mapped {
                    pfn,
                    writable: true,
                },
                lru::Faultin::SwappedIn => {
                    meter.swap_ins += 1;
                    Faultin::Mapped {
                        pfn,
                        writable: true,
                    }
                }
                lru::Faultin::Populated => {
                    meter.pages_populated += 1;
                    Faultin::Mapped {
                        pfn,
                        writable: true,
                    }
                }
                lru::Faultin::NoMemory => {
                    meter.alloc_stalls += 1;
                    Faultin::NoMemory
                }
            };
        }
        match host_fault::host_mapping(self, pfn, write) {
            Some((pfn, writable)) => Faultin::Mapped { pfn, writable },
            None => Faultin::Host(host_fault::HostFault {
                page,
                write,
                mmu_seq,
            }),
        }
    }

    /// Whether a lockless page lookup (`get_user_pages_fast_only()`, which never faults)
    /// finds `pfn`, behind `gfn`, mapped by the host: it is resident, and no open invalidation
    /// covers `gfn` (the host may be clearing its mapping). Prefetching maps only such pages.
    pub fn host_page_mapped(&self, pfn: Pfn, gfn: Gfn) -> bool {
        let resident = match self.host_mm.get() {
            Some(mm) => mm.index(pfn).is_none_or(|i| mm.resident(i)),
            // KVM prefetches with get_user_pages_fast_only(FOLL_WRITE): not a page nobody
            // touched, nor the read-only zero page.
            None => host_fault::host_mapping(self, pfn, true).is_some(),
        };
        resident && !self.mmu_invalidate.in_progress_covers(gfn)
    }

    /// Every slot.
    pub fn all_slots(&self) -> Vec<Arc<Memslot>> {
        let guard = epoch::pin();
        self.memslots(&guard).slots.clone()
    }

    /// Publishes a new memslot set and waits out readers of the old one
    /// (`kvm_swap_active_memslots()`: swap, then `synchronize_srcu_expedited()`).
    pub fn install_memslots(&self, slots: Vec<Arc<Memslot>>) {
        self.publish_memslots(slots);
        self.synchronize_srcu();
    }

    /// The swap half of [`Kvm::install_memslots`], for a plan whose next step is its own
    /// `synchronize_srcu()` (an engine must see that wait as a step).
    pub fn publish_memslots(&self, mut slots: Vec<Arc<Memslot>>) {
        slots.sort_by_key(|s| s.base_gfn);
        let guard = epoch::pin();
        let old = self
            .memslots
            .swap(Owned::new(MemslotSet { slots }), Ordering::AcqRel, &guard);
        // SAFETY: `old` was the published set and is now unreachable; destruction is deferred
        // past every guard that might still read it.
        unsafe { guard.defer_destroy(old) };
    }

    /// `synchronize_srcu(&kvm->srcu)`: after this, no vCPU still acts on memslot state it read
    /// before the call.
    pub fn synchronize_srcu(&self) {
        self.waiter.synchronize_srcu(&self.vcpus);
    }

    /// `kvm_flush_remote_tlbs()`: the architecture flushes by its own means
    /// (`kvm_arch_flush_remote_tlbs()`), or else every vCPU gets `KVM_REQ_TLB_FLUSH` and KVM
    /// waits for the acks of those in guest mode (`kvm_make_all_cpus_request()`). (Lockless
    /// software walkers are protected by RCU epochs here, not by this wait.)
    pub fn flush_remote_tlbs(&self, meter: &mut Meter) {
        meter.remote_flushes += 1;
        if self.arch().flush_remote_tlbs(self, meter) {
            return;
        }
        self.make_all_cpus_request(KVM_REQ_TLB_FLUSH, meter);
    }

    /// `kvm_make_all_cpus_request()`: posts `req` on every vCPU, kicks those in guest mode and
    /// waits for their acks (they leave guest mode, and service `req` before re-entering).
    pub fn make_all_cpus_request(&self, req: u64, meter: &mut Meter) {
        let kicked: Vec<usize> = (0..self.vcpus.len())
            .filter(|&i| self.vcpus[i].kick_for_request(req))
            .collect();
        meter.flush_kicks += kicked.len() as u64;
        if !kicked.is_empty() {
            self.waiter.wait_for_exits(&self.vcpus, &kicked);
        }
    }

    /// `kvm_vcpu_kick()` of every vCPU, without waiting: each one in guest mode leaves it at
    /// its next instruction boundary (an IPI), and what KVM does on every exit happens then.
    /// Counts the IPIs sent in `dirty_log_kicks`.
    pub fn kick_all_vcpus(&self, meter: &mut Meter) {
        for v in self.vcpus.iter() {
            if v.kick() {
                meter.dirty_log_kicks += 1;
            }
        }
    }

    /// `kvm_flush_remote_tlbs_range()`: the architecture's range flush
    /// (`kvm_arch_flush_remote_tlbs_range()`), or a full flush where it has none.
    pub fn flush_remote_tlbs_range(&self, start: Gfn, pages: u64, meter: &mut Meter) {
        if !self
            .arch()
            .flush_remote_tlbs_range(self, start, pages, meter)
        {
            self.flush_remote_tlbs(meter)
        }
    }

    /// `kvm_flush_remote_tlbs_memslot()`.
    pub fn flush_remote_tlbs_memslot(&self, slot: &Memslot, meter: &mut Meter) {
        self.flush_remote_tlbs_range(slot.base_gfn, slot.npages, meter)
    }

    /// A broadcast `TLBI <op>IS` of the VM's stage-2 translations, issued by the calling actor:
    /// posts `inv` to every vCPU's TLB (a vCPU needs no software to apply it) and records in
    /// `pending` what a later [`Kvm::dsb_ish`] must wait for. Several may be issued before one
    /// wait. The caller must not be a vCPU in guest mode (KVM code runs outside it). Counts one
    /// `tlbi_ops`.
    pub fn tlbi_is(&self, inv: TlbInvalidation, pending: &mut TlbiPending, meter: &mut Meter) {
        meter.tlbi_ops += 1;
        for (i, v) in self.vcpus.iter().enumerate() {
            if let Some(seq) = v.post_tlbi(inv) {
                pending.add(i, seq);
            }
        }
    }

    /// `DSB ISH` after broadcast `TLBI`s: returns once every invalidation in `pending` is
    /// complete on every vCPU (applied to its TLB, or the vCPU left guest mode and will apply it
    /// before its next access). After this no vCPU uses a translation they dropped, and what it
    /// did through one happens before the caller's next step. In the threads engine this spins
    /// on the vCPUs; in the virtual-time engine it returns at once, because a vCPU in guest mode
    /// runs no access before its next step and that step syncs its TLB first. Empties
    /// `pending`. Counts one `dsb_waits`.
    pub fn dsb_ish(&self, pending: &mut TlbiPending, meter: &mut Meter) {
        meter.dsb_waits += 1;
        if !pending.is_empty() {
            self.waiter.wait_for_tlbi(&self.vcpus, pending.seqs());
        }
        pending.clear();
    }

    /// `TLBI <op>; DSB NSH` on vCPU `vcpu`'s own PE, which is running KVM code: its TLB applies
    /// `inv` before it next enters guest mode; no other vCPU sees it. Counts one
    /// `tlbi_local_ops`.
    pub fn tlbi_local(&self, vcpu: usize, inv: TlbInvalidation, meter: &mut Meter) {
        meter.tlbi_local_ops += 1;
        self.vcpus[vcpu].tlb_shootdown().post(inv);
    }

    /// `TLBI <op>IS; DSB ISH`: [`Kvm::tlbi_is`] then [`Kvm::dsb_ish`].
    pub fn tlbi_broadcast(&self, inv: TlbInvalidation, meter: &mut Meter) {
        vcpu::with_tlbi_pending(|pending| {
            self.tlbi_is(inv, pending, meter);
            self.dsb_ish(pending, meter);
        })
    }

    /// `mark_page_dirty_in_slot()`: into the vCPU's dirty ring when rings are enabled, else into
    /// the slot's bitmap — only if the slot logs dirty pages *in the memslot version the caller
    /// is working with* (`logging`, a fault's snapshot): KVM checks the flags of the memslot
    /// struct the fault looked up under SRCU, which a concurrent flags change replaces rather
    /// than modifies.
    pub fn mark_page_dirty_in_slot(
        &self,
        slot: &Memslot,
        gfn: Gfn,
        logging: bool,
        vcpu: Option<usize>,
        meter: &mut Meter,
    ) {
        self.mark_pages_dirty_in_slot(slot, &[gfn.to_gpa().0], logging, vcpu, meter);
    }

    /// [`Kvm::mark_page_dirty_in_slot`] of each page at the guest-physical addresses `gpas`
    /// (all in `slot`; a PML log's entries) in order, the bitmap's lines read under one hold
    /// of the host caches' lock. Pages one below the other (a guest that wrote its pages in
    /// order fills the log so) set their bits a word at a time and read each bitmap line
    /// once, highest first, as marking them one by one leaves the bitmap and reads its lines.
    pub fn mark_pages_dirty_in_slot(
        &self,
        slot: &Memslot,
        gpas: &[u64],
        logging: bool,
        vcpu: Option<usize>,
        meter: &mut Meter,
    ) {
        if !logging {
            return;
        }
        let gfns = gpas.iter().map(|&gpa| gpa_gfn(gpa));
        match (self.dirty_rings.get(), vcpu) {
            (Some(rings), Some(v)) => {
                gfns.for_each(|gfn| rings[v].push(slot.id, gfn.0 - slot.base_gfn.0));
            }
            _ => match (pages_down(gpas), self.caches()) {
                (Some((top, count)), caches) => {
                    slot.set_dirty_bits_down(top, count);
                    if let Some(caches) = caches {
                        caches.read_lines(slot.dirty_bit_lines_down(caches, top, count), meter);
                    }
                }
                (None, caches) => {
                    let mut bits = memslot::DirtyBits::new(slot);
                    let set = gfns.inspect(|&gfn| bits.set(gfn));
                    match caches {
                        Some(caches) => caches.read_lines(slot.dirty_bit_lines(caches, set), meter),
                        None => set.for_each(drop),
                    }
                }
            },
        }
        meter.pages_dirtied += gpas.len() as u64;
    }
}

/// The highest gfn of the pages at `gpas` and how many there are, when each is the page
/// below the one before it.
fn pages_down(gpas: &[u64]) -> Option<(Gfn, u64)> {
    let (&top, rest) = gpas.split_first()?;
    let page = 1u64 << crate::units::PAGE_SHIFT;
    // Every pair looked at (no early exit), so that the loop runs several pairs at once.
    let down = gpas
        .iter()
        .zip(rest)
        .fold(true, |down, (&a, &b)| down & (a.wrapping_sub(b) == page));
    if !down {
        return None;
    }
    Some((gpa_gfn(top), gpas.len() as u64))
}

impl Drop for Kvm {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can hold a reference to the memslot set.
        unsafe {
            let guard = epoch::unprotected();
            let cur = self.memslots.load(Ordering::Relaxed, guard);
            drop(cur.into_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_down_are_found_only_one_below_the_other() {
        let gpa = |gfns: &[u64]| gfns.iter().map(|g| g << 12).collect::<Vec<u64>>();
        assert_eq!(pages_down(&gpa(&[9, 8, 7, 6])), Some((Gfn(9), 4)));
        assert_eq!(pages_down(&gpa(&[5])), Some((Gfn(5), 1)));
        assert_eq!(pages_down(&[]), None);
        for not_down in [&[6, 7, 8][..], &[9, 7, 6], &[9, 8, 8, 7], &[9, 8, 7, 3]] {
            assert_eq!(pages_down(&gpa(not_down)), None, "{not_down:?}");
        }
    }
}
