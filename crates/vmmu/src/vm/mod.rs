//! A VM behind a KVM-like API: memslots, capabilities, dirty-log ioctls, and single guest
//! accesses, executed on the calling thread with the real `mmu_lock`. The exit loop
//! ([`exit`]) and the plan interpreter ([`plan`]) are the VM's own; engines call down into
//! them. Scenarios that need many concurrent vCPUs use [`Vm::kvm`], [`Vm::mmu`] and an engine.

pub mod exit;
pub mod host_thread;
pub mod kswapd;
pub mod munmap;
pub mod page_idle;
pub mod plan;
pub mod vcpu;
pub mod waiter;

use crate::arm64::arch::Arm64Arch;
use crate::arm64::mmu::Stage2Mmu;
use crate::host::backing::Backing;
use crate::host::memory::WORDS_PER_FULL_PAGE;
use crate::kvm::dirty_log::{
    clear_dirty_log_plan, get_dirty_log_plan, reset_dirty_rings_plan, set_memslot_flags_plan,
};
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::Mmu;
use crate::kvm::{Kvm, KVM_DIRTY_LOG_INITIALLY_SET, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE};
use crate::units::{Gfn, Gpa, Pfn, PAGE_SIZE};
use crate::x86::arch::X86Arch;
use crate::x86::mmu::X86Mmu;
use crate::x86::shadow::ShadowMmu;
use crate::x86::tdp_mmu::TdpMmu;
use exit::guest_access;
use parking_lot::Mutex;
use plan::run_plan;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use vcpu::Vcpu;
use waiter::SpinWaiter;

pub use crate::kvm::memslot::{KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY};

/// `KVM_DIRTY_RING_MAX_ENTRIES`.
pub const KVM_DIRTY_RING_MAX_ENTRIES: u32 = 65536;

/// Which MMU a VM uses: KVM's module parameters `tdp_mmu` and `ept`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MmuKind {
    /// The TDP MMU (`tdp_mmu=Y`, EPT on).
    Tdp,
    /// The shadow MMU (`tdp_mmu=N`): direct over guest physical memory with `ept` on, shadow
    /// paging of the guest's own page tables with it off.
    Shadow {
        /// EPT on.
        ept: bool,
    },
    /// KVM/arm64's stage-2 MMU.
    Stage2 {
        /// How faults take `mmu_lock`.
        lock: crate::arm64::Arm64Lock,
        /// The IPA size (`KVM_VM_TYPE_ARM_IPA_SIZE`).
        ia_bits: u32,
        /// `KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE` in 4 KiB pages (0: eager splitting off).
        split_chunk_pages: u64,
        /// The CPU's features KVM checks (FEAT_TLBIRANGE, FEAT_S2FWB).
        cpu: crate::arm64::Arm64Cpu,
        /// How a relaxed permission is invalidated.
        relax_flush: crate::arm64::RelaxFlush,
    },
}

impl MmuKind {
    /// Shadow paging: KVM walks the guest's own page tables (shadow MMU with EPT off).
    pub fn shadow_paging(self) -> bool {
        self == MmuKind::Shadow { ept: false }
    }
}

/// The host kernel's build and version choices that change what KVM's MMU does. The default is
/// the kernel seed 000 measured (Linux 6.0 era, built with `CONFIG_PREEMPTION`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct HostKernel {
    /// Its preemption model: whether long MMU jobs yield `mmu_lock` to waiters.
    pub preemption: crate::kvm::mmu_lock::Preemption,
    /// How the TDP MMU's eager split allocates its tables.
    pub tdp_split_alloc: crate::x86::tdp_mmu::SplitAlloc,
    /// How reads of private anonymous memory nobody wrote are backed (the shared zero page),
    /// and whether the copy on the first write calls KVM's `change_pte`.
    pub zero_page: crate::kvm::host_fault::ZeroPage,
    /// `CONFIG_HZ`: the scheduling-clock interrupts each busy CPU takes a second (0: none, as
    /// with `nohz_full` and one task per CPU). Distributions build x86 and arm64 kernels with
    /// 250.
    pub hz: u32,
}

impl Default for HostKernel {
    fn default() -> Self {
        HostKernel {
            preemption: Default::default(),
            tdp_split_alloc: Default::default(),
            zero_page: Default::default(),
            hz: 250,
        }
    }
}

/// How to build a VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Number of vCPUs.
    pub vcpus: usize,
    /// KVM's `eager_page_split` module parameter.
    pub eager_page_split: bool,
    /// The MMU.
    pub mmu: MmuKind,
    /// KVM's `enable_pml` module parameter on an Intel CPU with PML: the CPU logs the pages
    /// it dirties and dirty logging clears D instead of write-protecting 4K pages. Needs EPT
    /// (the TDP MMU, or the shadow MMU with EPT on). Off by default: a CPU without PML (AMD,
    /// or `enable_pml=0`).
    pub pml: bool,
    /// The host kernel.
    pub kernel: HostKernel,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            vcpus: 1,
            eager_page_split: true,
            mmu: MmuKind::Tdp,
            pml: false,
            kernel: HostKernel::default(),
        }
    }
}

/// An ioctl's or a vCPU's failure: one line that says what was wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum VmError {
    /// An argument or a capability the call does not allow: what was wrong and what is.
    #[error("{0}")]
    Invalid(String),
    /// `KVM_RUN` failed with `-ENOSPC`: the shadow MMU found no shadow page to free for a fault.
    #[error("vCPU {vcpu}: KVM_RUN failed with -ENOSPC: the shadow MMU found no shadow page to free for a fault on {gfn:?}")]
    NoShadowPage {
        /// The faulting vCPU.
        vcpu: usize,
        /// The page it faulted on.
        gfn: Gfn,
    },
    /// A single access of a nested guest that L1 must handle (its EPT12 tables do not map it).
    #[error("vCPU {vcpu}: the nested guest's access to {gfn:?} is L1's to handle")]
    ReflectedToL1 {
        /// The vCPU.
        vcpu: usize,
        /// The nested guest's page.
        gfn: Gfn,
    },
    /// A fault KVM cannot handle as the model runs it.
    #[error(transparent)]
    Fault(#[from] crate::kvm::mmu::FaultError),
    /// KVM's core refused.
    #[error(transparent)]
    Kvm(#[from] crate::kvm::KvmError),
    /// The host could not provide the memory.
    #[error(transparent)]
    Host(#[from] crate::host::HostError),
    /// A `KVM_CLEAR_DIRTY_LOG` range KVM refuses.
    #[error(transparent)]
    ClearRange(#[from] crate::kvm::memslot::ClearRangeError),
    /// The guest's page tables could not be built as asked.
    #[error(transparent)]
    GuestPageTable(#[from] crate::x86::guest_paging::GuestPageTableError),
    /// arm64: the memslots do not fit the stage-2 input range.
    #[error(transparent)]
    IpaSize(#[from] crate::arm64::pgtable::IpaSizeError),
}

/// Where a new memslot's host memory comes from.
#[derive(Copy, Clone, Debug)]
enum HostFrames {
    /// A new region keeping this many words of each page.
    New {
        /// 1, or [`WORDS_PER_FULL_PAGE`].
        words_per_page: u64,
    },
    /// Frames another memslot maps, from this one.
    Alias(Pfn),
}

fn err<T>(msg: impl Into<String>) -> Result<T, VmError> {
    Err(VmError::Invalid(msg.into()))
}

/// A VM: KVM core state, one MMU, and its vCPUs.
pub struct Vm {
    /// KVM core state.
    pub kvm: Arc<Kvm>,
    /// The MMU ([`Vm::x86`], [`Vm::shadow`] and [`Vm::stage2`] see it as its flavour).
    pub mmu: Arc<dyn Mmu>,
    vcpus: Vec<Mutex<Vcpu>>,
    vmm_meter: Mutex<Meter>,
}

impl Vm {
    /// A VM with the MMU `config` asks for.
    pub fn new(config: VmConfig) -> Self {
        Self::with_waiter(config, Box::new(SpinWaiter))
    }

    /// A VM whose waits on vCPUs (remote-flush acks, SRCU grace periods) are
    /// served by `waiter`: the engine that drives it. Panics on a configuration KVM would
    /// refuse (an arm64 IPA size stage 2 cannot have); [`Vm::try_with_waiter`] returns it.
    pub fn with_waiter(config: VmConfig, waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>) -> Self {
        Self::try_with_waiter(config, waiter).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Vm::with_waiter`], with a one-line error for a configuration KVM would refuse
    /// (`KVM_CREATE_VM` with an IPA size stage 2 cannot have).
    pub fn try_with_waiter(
        config: VmConfig,
        waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>,
    ) -> Result<Self, VmError> {
        // vmx hardware_setup(): PML needs EPT with A/D bits.
        let ept = matches!(config.mmu, MmuKind::Tdp | MmuKind::Shadow { ept: true });
        if config.pml && !ept {
            return err("PML logs EPT Dirty-flag updates: it needs x86 with EPT on (the TDP MMU, or the shadow MMU with --ept on)");
        }
        let pml_entries = if config.pml {
            crate::hw::pml::PML_LOG_NR_ENTRIES
        } else {
            0
        };
        let kvm = Arc::new(
            Kvm::new(config.vcpus, waiter, config.eager_page_split)
                .with_cpu_dirty_log_size(pml_entries)
                .with_preemption(config.kernel.preemption)
                .with_zero_page(config.kernel.zero_page)
                .with_tick_hz(config.kernel.hz),
        );
        let (mmu, x86): (Arc<dyn Mmu>, Option<Arc<dyn X86Mmu>>) = match config.mmu {
            MmuKind::Tdp => {
                let t = Arc::new(TdpMmu::with_split_alloc(
                    &kvm,
                    config.kernel.tdp_split_alloc,
                ));
                (Arc::clone(&t) as _, Some(t as _))
            }
            MmuKind::Shadow { ept } => {
                let s = Arc::new(ShadowMmu::new(&kvm, ept));
                (Arc::clone(&s) as _, Some(s as _))
            }
            MmuKind::Stage2 {
                lock,
                ia_bits,
                split_chunk_pages,
                cpu,
                relax_flush,
            } => {
                let s = Arc::new(
                    Stage2Mmu::new(&kvm, ia_bits, lock, split_chunk_pages, cpu, relax_flush)
                        .map_err(VmError::from)?,
                );
                kvm.set_arch(Box::new(Arm64Arch::new(Arc::clone(&s))))
                    .expect("a new VM has no architecture hooks yet");
                (s as _, None)
            }
        };
        if let Some(x86) = x86 {
            kvm.set_arch(Box::new(X86Arch::new(x86)))
                .expect("a new VM has no architecture hooks yet");
        }
        Ok(Vm {
            vcpus: (0..config.vcpus)
                .map(|i| Mutex::new(Vcpu::new(i, &*mmu)))
                .collect(),
            kvm,
            mmu,
            vmm_meter: Mutex::new(Meter::default()),
        })
    }

    /// vCPU `i`'s private state (for scenario threads).
    pub fn vcpu(&self, i: usize) -> parking_lot::MutexGuard<'_, Vcpu> {
        self.vcpus[i].lock()
    }

    /// Number of vCPUs.
    pub fn nr_vcpus(&self) -> usize {
        self.vcpus.len()
    }

    /// What the VMM thread's ioctls have done so far.
    pub fn vmm_meter(&self) -> Meter {
        self.vmm_meter.lock().clone()
    }

    /// Adds work done by the VMM thread outside the [`Vm`] API (scenarios running plans).
    pub fn add_vmm_meter(&self, m: &Meter) {
        self.vmm_meter.lock().add(m);
    }

    /// `KVM_ENABLE_CAP(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)`.
    pub fn enable_manual_dirty_log_protect(&self, initially_set: bool) -> Result<(), VmError> {
        let caps = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE
            | if initially_set {
                KVM_DIRTY_LOG_INITIALLY_SET
            } else {
                0
            };
        self.kvm
            .manual_dirty_log_protect
            .store(caps, Ordering::Relaxed);
        Ok(())
    }

    /// `KVM_ENABLE_CAP(KVM_CAP_DIRTY_LOG_RING)` with `entries` 16-byte entries: a power of two
    /// between 256 (one page) and 65536, before any memslot exists (KVM requires it before vCPUs
    /// are created; here vCPUs exist from the start, so memslots stand in as the "too late" mark).
    pub fn enable_dirty_ring(&self, entries: u32) -> Result<(), VmError> {
        if !entries.is_power_of_two() || !(256..=KVM_DIRTY_RING_MAX_ENTRIES).contains(&entries) {
            return err(format!("dirty ring size {entries}: must be a power of two between 256 and {KVM_DIRTY_RING_MAX_ENTRIES} entries"));
        }
        if !self.kvm.all_slots().is_empty() {
            return err("the dirty ring must be enabled before any memslot is created");
        }
        self.kvm.enable_dirty_rings(entries).map_err(VmError::from)
    }

    /// `KVM_SET_USER_MEMORY_REGION`: create (new id), change flags (same id, address and size),
    /// or delete (size 0) a memslot.
    pub fn set_user_memory_region(
        &self,
        slot: u32,
        guest_phys_addr: u64,
        memory_size: u64,
        backing: Backing,
        flags: u32,
    ) -> Result<(), VmError> {
        self.set_memory_region(slot, guest_phys_addr, memory_size, backing, flags, 1)
    }

    /// [`Vm::set_user_memory_region`] creating a slot whose host memory keeps every word of
    /// every page, for memory that holds page tables KVM walks (an L1 hypervisor's EPT12
    /// tables): ordinary slots keep only the first word of each page.
    pub fn set_user_memory_region_full_pages(
        &self,
        slot: u32,
        guest_phys_addr: u64,
        memory_size: u64,
        backing: Backing,
    ) -> Result<(), VmError> {
        self.set_memory_region(
            slot,
            guest_phys_addr,
            memory_size,
            backing,
            0,
            WORDS_PER_FULL_PAGE,
        )
    }

    /// [`Vm::set_user_memory_region`] creating a slot over host memory another slot already
    /// maps, from its frame `host_pfn` (a VMM mapping one memfd into several memslots, as
    /// max_guest_memory_test does): the slots alias each other.
    pub fn set_user_memory_region_alias(
        &self,
        slot: u32,
        guest_phys_addr: u64,
        memory_size: u64,
        backing: Backing,
        host_pfn: Pfn,
    ) -> Result<(), VmError> {
        self.create_memory_region(
            slot,
            guest_phys_addr,
            memory_size,
            backing,
            0,
            HostFrames::Alias(host_pfn),
        )
    }

    /// `KVM_SET_USER_MEMORY_REGION` with host memory keeping `words_per_page` 8-byte words of
    /// each page: 1 for ordinary memory (the word the workloads read and write stands for the
    /// page), [`WORDS_PER_FULL_PAGE`] for guest page tables, whose every entry matters.
    fn set_memory_region(
        &self,
        slot: u32,
        guest_phys_addr: u64,
        memory_size: u64,
        backing: Backing,
        flags: u32,
        words_per_page: u64,
    ) -> Result<(), VmError> {
        self.create_memory_region(
            slot,
            guest_phys_addr,
            memory_size,
            backing,
            flags,
            HostFrames::New { words_per_page },
        )
    }

    /// `KVM_SET_USER_MEMORY_REGION`: create, change the flags of, or delete (size 0) `slot`; a
    /// new slot's host memory is `host`.
    fn create_memory_region(
        &self,
        slot: u32,
        guest_phys_addr: u64,
        memory_size: u64,
        backing: Backing,
        flags: u32,
        host: HostFrames,
    ) -> Result<(), VmError> {
        if flags & !(KVM_MEM_LOG_DIRTY_PAGES | KVM_MEM_READONLY) != 0 {
            return err(format!("memslot flags {flags:#x}: only KVM_MEM_LOG_DIRTY_PAGES (1) and KVM_MEM_READONLY (2) are supported"));
        }
        if !guest_phys_addr.is_multiple_of(PAGE_SIZE) || !memory_size.is_multiple_of(PAGE_SIZE) {
            return err(format!("memslot {slot}: address {guest_phys_addr:#x} and size {memory_size:#x} must be multiples of 4096"));
        }
        let mut slots = self.kvm.all_slots();
        let existing = slots.iter().position(|s| s.id == slot);
        let mut meter = self.vmm_meter.lock();
        match existing {
            Some(i) if memory_size == 0 => {
                let plan = crate::kvm::memslot_delete::delete_memslot_plan(&self.mmu, &slots[i]);
                run_plan(&self.kvm, plan, &mut meter);
                Ok(())
            }
            Some(i) => {
                let s = Arc::clone(&slots[i]);
                if s.base_gfn != Gpa(guest_phys_addr).to_gfn()
                    || s.npages * PAGE_SIZE != memory_size
                {
                    return err(format!("memslot {slot}: moving or resizing a memslot is not supported; delete it (size 0) and create it again"));
                }
                if (s.flags() ^ flags) & KVM_MEM_READONLY != 0 {
                    return err(format!(
                        "memslot {slot}: KVM_MEM_READONLY cannot be changed on an existing memslot"
                    ));
                }
                let plan = set_memslot_flags_plan(&self.kvm, &s, flags);
                run_plan(&self.kvm, plan, &mut meter);
                Ok(())
            }
            None if memory_size == 0 => err(format!(
                "memslot {slot} does not exist; a size of 0 deletes an existing memslot"
            )),
            None => {
                let base = Gpa(guest_phys_addr).to_gfn();
                let npages = memory_size / PAGE_SIZE;
                let end = base
                    .0
                    .checked_add(npages)
                    .filter(|e| *e <= 1 << 40)
                    .ok_or_else(|| {
                        VmError::Invalid(format!(
                            "memslot {slot} ends beyond the 52-bit guest physical address space"
                        ))
                    })?;
                if let Some(o) = slots
                    .iter()
                    .find(|s| s.base_gfn.0 < end && base < s.end_gfn())
                {
                    return err(format!("memslot {slot} [{guest_phys_addr:#x}, +{memory_size:#x}) overlaps memslot {}", o.id));
                }
                let host_pfn = match host {
                    // Private anonymous memory, in 4 KiB pages or transparent huge pages: the
                    // host page table is modelled (first touches fault, reads may map the
                    // (huge) zero page). Simplified: hugetlbfs memory is mapped from the start,
                    // its first touch free.
                    HostFrames::New { words_per_page }
                        if matches!(backing, Backing::Anonymous | Backing::AnonymousThp) =>
                    {
                        self.kvm
                            .host
                            .alloc_anon_region(
                                npages,
                                words_per_page,
                                backing == Backing::AnonymousThp,
                            )
                            .map_err(VmError::from)?
                    }
                    HostFrames::New { words_per_page } => self
                        .kvm
                        .host
                        .alloc_region_words(npages, words_per_page)
                        .map_err(VmError::from)?,
                    HostFrames::Alias(pfn) => pfn,
                };
                let new = Arc::new(Memslot::new(slot, base, npages, backing, host_pfn, flags));
                if flags & KVM_MEM_LOG_DIRTY_PAGES != 0
                    && self.kvm.dirty_log_manual_protect_and_init_set()
                {
                    new.set_all_dirty();
                }
                slots.push(new);
                self.kvm.install_memslots(slots);
                if flags & KVM_MEM_LOG_DIRTY_PAGES != 0 {
                    // kvm_commit_memory_region(), then kvm_mmu_slot_apply_flags()'s first step
                    // (a new slot has nothing mapped to protect).
                    self.kvm.count_memslot_dirty_logging(true);
                    self.kvm
                        .arch()
                        .update_cpu_dirty_logging(&self.kvm, true, &mut meter);
                }
                self.mmu.commit_memory_region(&self.kvm);
                Ok(())
            }
        }
    }

    /// One `KVM_RUN` of vCPU `vcpu`: refuses to enter with a full dirty ring
    /// (`KVM_EXIT_DIRTY_RING_FULL`), enters guest mode, runs `body` (guest accesses that handle
    /// their own exits), and leaves.
    fn kvm_run<R>(
        &self,
        vcpu: usize,
        body: impl FnOnce(&mut Vcpu) -> Result<R, VmError>,
    ) -> Result<R, VmError> {
        if vcpu >= self.vcpus.len() {
            return err(format!(
                "vCPU {vcpu} does not exist; the VM has {} vCPUs",
                self.vcpus.len()
            ));
        }
        if self.kvm.dirty_ring_full(vcpu) {
            return err(format!(
                "KVM_EXIT_DIRTY_RING_FULL: vCPU {vcpu}'s dirty ring is full; harvest and reset it"
            ));
        }
        let mut v = self.vcpus[vcpu].lock();
        let kvm = &*self.kvm;
        v.run_begin(kvm);
        v.enter_guest(kvm);
        let result = body(&mut v);
        // guest_access() leaves guest mode itself when it fails.
        if result.is_ok() {
            v.exit_guest(kvm);
        }
        v.run_end(kvm);
        result
    }

    /// One 8-byte guest access by vCPU `vcpu` as a complete `KVM_RUN`: enter guest mode, access,
    /// and handle EPT violations until the access completes.
    pub fn vcpu_access(
        &self,
        vcpu: usize,
        gpa: u64,
        write: bool,
        value: u64,
    ) -> Result<u64, VmError> {
        let word = ((gpa % PAGE_SIZE) / 8) as usize;
        self.kvm_run(vcpu, |v| {
            guest_access(
                &self.kvm,
                &*self.mmu,
                v,
                Gpa(gpa).to_gfn(),
                word,
                write,
                value,
            )
        })
    }

    /// One `KVM_RUN` of vCPU `vcpu` performing `accesses` in order (`(gfn, write)`; the n-th
    /// write stores `n`). Returns what the vCPU counted.
    pub fn vcpu_run(
        &self,
        vcpu: usize,
        accesses: impl IntoIterator<Item = (Gfn, bool)>,
    ) -> Result<Meter, VmError> {
        self.kvm_run(vcpu, |v| {
            let before = v.meter.clone();
            for (n, (gfn, write)) in accesses.into_iter().enumerate() {
                guest_access(&self.kvm, &*self.mmu, v, gfn, 0, write, n as u64)?;
            }
            Ok(v.meter.since(&before))
        })
    }

    /// A guest write of `value` to `gpa` by `vcpu`.
    pub fn vcpu_write(&self, vcpu: usize, gpa: u64, value: u64) -> Result<(), VmError> {
        self.vcpu_access(vcpu, gpa, true, value).map(|_| ())
    }

    /// A guest read of `gpa` by `vcpu`.
    pub fn vcpu_read(&self, vcpu: usize, gpa: u64) -> Result<u64, VmError> {
        self.vcpu_access(vcpu, gpa, false, 0)
    }

    fn logged_slot(&self, slot: u32) -> Result<Arc<Memslot>, VmError> {
        if self.kvm.dirty_rings.get().is_some() {
            return err("the dirty bitmap is not available while the dirty ring is enabled");
        }
        match self.kvm.slot_by_id(slot) {
            Some(s) if s.dirty_track_enabled() => Ok(s),
            Some(_) => err(format!(
                "memslot {slot} does not log dirty pages (KVM_MEM_LOG_DIRTY_PAGES is clear)"
            )),
            None => err(format!("memslot {slot} does not exist")),
        }
    }

    /// `KVM_GET_DIRTY_LOG`.
    pub fn get_dirty_log(&self, slot: u32) -> Result<Vec<u64>, VmError> {
        let s = self.logged_slot(slot)?;
        let out = Arc::new(Mutex::new(Vec::new()));
        let plan = get_dirty_log_plan(&self.kvm, &s, Arc::clone(&out));
        run_plan(&self.kvm, plan, &mut self.vmm_meter.lock());
        let v = std::mem::take(&mut *out.lock());
        Ok(v)
    }

    /// `KVM_CLEAR_DIRTY_LOG`.
    pub fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u64,
        bitmap: &[u64],
    ) -> Result<(), VmError> {
        let s = self.logged_slot(slot)?;
        if !self.kvm.manual_protect() {
            return err("KVM_CLEAR_DIRTY_LOG needs KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 enabled");
        }
        let plan = clear_dirty_log_plan(&self.kvm, &s, first_page, num_pages, bitmap)?;
        run_plan(&self.kvm, plan, &mut self.vmm_meter.lock());
        Ok(())
    }

    /// Userspace's harvest of vCPU `vcpu`'s dirty ring: `(slot, offset)` of each entry pushed
    /// since the last harvest, in order (each is flagged for reset).
    pub fn dirty_ring_harvest(&self, vcpu: usize) -> Vec<(u32, u64)> {
        self.kvm
            .dirty_rings
            .get()
            .map(|r| r[vcpu].harvest())
            .unwrap_or_default()
    }

    /// `KVM_RESET_DIRTY_RINGS`: returns the number of entries reset.
    pub fn reset_dirty_rings(&self) -> Result<u64, VmError> {
        if self.kvm.dirty_rings.get().is_none() {
            return err("KVM_RESET_DIRTY_RINGS needs the dirty ring enabled");
        }
        let reset = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let plan = reset_dirty_rings_plan(Arc::clone(&reset));
        run_plan(&self.kvm, plan, &mut self.vmm_meter.lock());
        Ok(reset.load(Ordering::Relaxed))
    }

    /// The page-table invariant check (run with no vCPU active), and the host's zero page still
    /// all zeroes (nothing wrote through a mapping of it).
    pub fn check_invariants(&self) -> Vec<String> {
        let mut errors = self.mmu.check_invariants(&self.kvm);
        if let Some((word, value)) = self.kvm.host.zero_page_written() {
            errors.push(format!(
                "the host's zero page was written: word {word} holds {value:#x}"
            ));
        }
        errors
    }

    /// Eager page splitting of a whole memslot down to 4K under the read lock, on its own:
    /// the first step of `kvm_mmu_slot_apply_flags()` when logging is enabled. Returns what the
    /// VMM thread counted (for benchmarks and calibration).
    pub fn eager_split_slot(&self, slot: u32) -> Result<Meter, VmError> {
        let s = self
            .kvm
            .slot_by_id(slot)
            .ok_or_else(|| VmError::Invalid(format!("memslot {slot} does not exist")))?;
        let Some(x86) = self.x86() else {
            return err("eager splitting of a whole slot under the read lock is x86's (kvm_mmu_slot_try_split_huge_pages())");
        };
        let mut job = x86.try_split_huge_pages(
            &s,
            s.base_gfn,
            s.end_gfn(),
            crate::x86::spte::PG_LEVEL_4K,
            crate::kvm::mmu_lock::LockMode::Read,
        );
        let mut m = Meter::default();
        plan::run_job(&self.kvm, &mut *job, &mut m);
        self.add_vmm_meter(&m);
        Ok(m)
    }
}

impl Vm {
    /// Shadow paging: builds the guest's page tables the way the selftests' `virt_map()` does
    /// (the VMM writes them into guest memory before the guest runs): a new memslot `slot` at
    /// `gpa` keeping whole pages, holding 4-level tables that map every existing memslot at a
    /// guest-virtual address equal to its guest-physical one with `page_level` pages (4K or
    /// 2M), and the table memory itself with 4K pages; then the guest loads CR3. Returns the
    /// size of the table memslot.
    pub fn setup_guest_page_tables(
        &self,
        slot: u32,
        gpa: u64,
        page_level: crate::x86::spte::Level,
    ) -> Result<u64, VmError> {
        use crate::x86::guest_paging::GuestPageTableBuilder;
        let Some(shadow) = self.shadow_paging() else {
            return err("guest page tables are only walked by KVM with shadow paging (--mmu shadow --ept off)");
        };
        let slots = self.kvm.all_slots();
        let mut tables = 0;
        for s in &slots {
            tables += GuestPageTableBuilder::tables_for(s.npages * PAGE_SIZE, page_level);
        }
        // The root, the tables of every map (tables_for() is an upper bound per map), and
        // those mapping the table memslot itself with 4K pages: the smallest size that holds
        // its own map.
        let mut pt_pages = 1 + tables;
        loop {
            let need = 1
                + tables
                + GuestPageTableBuilder::tables_for(
                    pt_pages * PAGE_SIZE,
                    crate::x86::spte::PG_LEVEL_4K,
                );
            if need <= pt_pages {
                break;
            }
            pt_pages = need;
        }
        self.set_memory_region(
            slot,
            gpa,
            pt_pages * PAGE_SIZE,
            Backing::Anonymous,
            0,
            WORDS_PER_FULL_PAGE,
        )?;
        let mut b = GuestPageTableBuilder::new(&*self.kvm, Gpa(gpa).to_gfn(), pt_pages)?;
        for s in &slots {
            let base = s.base_gfn.to_gpa().0;
            b.map(base, base, s.npages * PAGE_SIZE, page_level, true)?;
        }
        b.map(
            gpa,
            gpa,
            pt_pages * PAGE_SIZE,
            crate::x86::spte::PG_LEVEL_4K,
            true,
        )?;
        let mut m = self.vmm_meter.lock();
        shadow.set_guest_cr3(&self.kvm, b.cr3(), &mut m);
        Ok(pt_pages * PAGE_SIZE)
    }

    /// Shadow paging: vCPU `vcpu` flushed its TLB (a CR3 reload): its own TLB is emptied and
    /// KVM syncs the unsync shadow pages (`kvm_mmu_sync_roots()`, on `KVM_REQ_MMU_SYNC`).
    /// Simplified: KVM does this inside `KVM_RUN` (under SRCU) at the next entry; here it runs
    /// at once, from the VMM's side, with no vCPU running.
    pub fn guest_tlb_flush(&self, vcpu: usize) -> Result<(), VmError> {
        let Some(shadow) = self.shadow_paging() else {
            return err("a guest TLB flush only matters to KVM with shadow paging");
        };
        let mut v = self
            .vcpus
            .get(vcpu)
            .ok_or_else(|| VmError::Invalid(format!("vCPU {vcpu} does not exist")))?
            .lock();
        v.tlb.flush_all();
        let mut m = Meter {
            tlb_flushes: 1,
            ..Default::default()
        };
        shadow.guest_tlb_flush(&self.kvm, &mut m);
        v.meter.add(&m);
        Ok(())
    }

    /// The shadow MMU when it does shadow paging (EPT off).
    fn shadow_paging(&self) -> Option<&ShadowMmu> {
        self.shadow().filter(|s| !s.inner().tdp_enabled)
    }

    /// The MMU as x86's KVM code sees it (dirty-log write protection, eager split), on x86.
    pub fn x86(&self) -> Option<&dyn X86Mmu> {
        let any = self.mmu.as_any();
        match any.downcast_ref::<TdpMmu>() {
            Some(t) => Some(t),
            None => any.downcast_ref::<ShadowMmu>().map(|s| s as &dyn X86Mmu),
        }
    }

    /// The MMU when it is the shadow MMU (shadow paging's guest CR3 and TLB flushes, nested
    /// churn).
    pub fn shadow(&self) -> Option<&ShadowMmu> {
        self.mmu.as_any().downcast_ref()
    }

    /// The MMU when it is arm64's stage 2 (its page tables: aging, tests).
    pub fn stage2(&self) -> Option<&Stage2Mmu> {
        self.mmu.as_any().downcast_ref()
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        // kvm_mmu_free_memory_cache() of every vCPU's caches, so the table counters balance.
        for v in &self.vcpus {
            v.lock().mmu.free_memory_caches(&self.kvm);
        }
    }
}
