//! The VM a selftest builds around its test region, shared by every scenario on the model: the
//! region placed at the top of guest memory as the selftests place it, split into memslots, the
//! MMU and guest mode chosen, and the oracles over it. [`TestVm`] says what to build;
//! [`Setup`] is what was built. [`PhaseClock`] turns the actors' meters into per-phase counters.

use crate::host::backing::Backing;
use crate::kvm::dirty_log::set_memslot_flags_plan;
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::op_plan::OpPlan;
use crate::lab::oracle::DirtyLogOracle;
use crate::lab::params::{GuestMode, X86_GUEST_PA_BITS};
use crate::lab::report::PhaseCounters;
use crate::lab::LabError;
use crate::units::{PAGE_SHIFT, PAGE_SIZE};
use crate::vm::{MmuKind, Vm, VmConfig};
use std::sync::Arc;

/// The selftests' first test memslot (`MEMSTRESS_MEM_SLOT_INDEX`, kvm_page_table_test's
/// `TEST_MEM_SLOT_INDEX`): test memslots are numbered from here.
pub const TEST_MEM_SLOT_INDEX: u32 = 1;

/// What a scenario asks to be built: the test region and the VM around it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestVm {
    /// vCPUs.
    pub vcpus: usize,
    /// Bytes of test memory (a multiple of the guest page size).
    pub bytes: u64,
    /// Memslots the region is split into (equal parts).
    pub slots: usize,
    /// What backs guest memory.
    pub backing: Backing,
    /// Which MMU.
    pub mmu: MmuKind,
    /// The selftests' guest mode (`-m`, arm64); `None` on x86.
    pub guest_mode: Option<u32>,
    /// KVM's eager page splitting (x86's module parameter, arm64's capability).
    pub eager_split: bool,
    /// x86 with EPT: the CPU has PML and KVM uses it (`enable_pml`).
    pub pml: bool,
    /// The host kernel's choices.
    pub kernel: crate::vm::HostKernel,
    /// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with `KVM_DIRTY_LOG_INITIALLY_SET`.
    pub manual_protect: bool,
    /// Shadow paging: the page size the guest maps the region with in its own tables.
    pub guest_page_level: crate::x86::spte::Level,
    /// `KVM_CAP_DIRTY_LOG_RING` with this many entries per vCPU, instead of dirty bitmaps.
    pub dirty_ring: Option<u32>,
}

/// The guest mode numbered `mode` (arm64's `-m`), or x86's one mode when `None`.
pub fn guest_mode(mode: Option<u32>) -> Result<GuestMode, LabError> {
    match mode {
        Some(m) => GuestMode::arm64(m),
        None => Ok(GuestMode {
            mode: 8,
            pa_bits: X86_GUEST_PA_BITS,
            va_bits: 48,
            page_bytes: PAGE_SIZE,
        }),
    }
}

/// The page the guest maps its test memory with: the guest mode's, or under shadow paging the
/// guest's own page (`guest_page_level`, the selftests' `virt_map()` with 4K or 2M pages), so
/// a memslot or region the guest maps holds whole pages of this size.
pub fn guest_map_bytes(
    mode: &GuestMode,
    mmu: MmuKind,
    guest_page_level: crate::x86::spte::Level,
) -> u64 {
    if mmu.shadow_paging() {
        crate::x86::spte::X86Level::bytes(guest_page_level)
    } else {
        mode.page_bytes
    }
}

impl TestVm {
    /// 4 KiB pages of test memory.
    pub fn guest_pages(&self) -> u64 {
        self.bytes / PAGE_SIZE
    }

    /// 4 KiB pages in each memslot.
    pub fn pages_per_slot(&self) -> u64 {
        self.guest_pages() / self.slots as u64
    }

    /// The guest mode.
    pub fn mode(&self) -> Result<GuestMode, LabError> {
        guest_mode(self.guest_mode)
    }

    /// Where the test region lies: the selftests' placement at the top of guest memory
    /// (`(vm->max_gfn - guest_num_pages) * guest_page_size`), aligned down to the larger of the
    /// backing's and the guest's page size.
    pub fn region_gpa(&self) -> Result<u64, LabError> {
        let mode = self.mode()?;
        // vm->max_gfn and guest_num_pages count guest pages.
        let max_gfn = (1u64 << mode.pa_bits) / mode.page_bytes - 1;
        let pages = self.bytes / mode.page_bytes;
        if pages >= max_gfn {
            return Err(LabError::Invalid(format!(
                "{} pages of guest memory do not fit a {}-bit guest physical address space",
                pages, mode.pa_bits
            )));
        }
        let gpa = (max_gfn - pages) * mode.page_bytes;
        let guest_page = guest_map_bytes(&mode, self.mmu, self.guest_page_level);
        Ok(gpa & !(self.backing.page_size().max(guest_page) - 1))
    }
}

/// Host bytes the model needs per guest page: the page's content word (8), the oracle's write
/// record (4) and report (4), the dirty bitmap (1/8), and a 4K leaf table's share (8).
pub(crate) const MODEL_BYTES_PER_GUEST_PAGE: u64 = 25;

/// What a run needs before its guest memory: the binary, its libraries and the Rust runtime
/// (measured: the peak RSS of a `dirty-log -b 4M` run is 4–5 MiB).
pub(crate) const MODEL_BASE_BYTES: u64 = 5 << 20;

/// The host memory the model of `t` needs at its peak, as the pre-check predicts it (a test
/// compares it with the measured peak RSS of runs of three sizes).
pub fn host_bytes_needed(t: &TestVm) -> u64 {
    // The shadow MMU adds a 4K rmap head (8 bytes) per page; a stage-2 table carries its
    // `struct page` in a second 4 KiB (8 more bytes per page mapped at 4K).
    let per_page = MODEL_BYTES_PER_GUEST_PAGE
        + match t.mmu {
            MmuKind::Tdp => 0,
            _ => 8,
        };
    // Every MMU's tables (and the shadow MMU's rmaps) go through the model of the host's
    // caches, which then fills: the LLC of each socket the vCPUs run on (the VMM's is the
    // first) of a 2-socket x86 host or a 1-socket Altra, and an L2 for each vCPU's core and
    // the VMM's. Where each table lives takes one more byte a page, and the NUMA node of each
    // guest page one more.
    let cores = t.vcpus as u32 + 1;
    let caches = match t.mmu {
        MmuKind::Stage2 { .. } => crate::hw::cache::AMPERE_ALTRA.model_bytes(1, cores),
        _ => {
            let host = crate::cost::Host::CASCADE_LAKE_2S;
            let sockets = host.vcpu_sockets(t.vcpus).into_iter().max().unwrap_or(0) + 1;
            crate::hw::cache::CASCADE_LAKE_8275CL.model_bytes(sockets, cores)
        }
    };
    MODEL_BASE_BYTES + t.guest_pages() * (per_page + 2) + t.vcpus as u64 * (300 << 10) + caches
}

/// Refuses a run the host cannot hold, before allocating anything.
fn check_host_memory(t: &TestVm) -> Result<(), LabError> {
    let needed = host_bytes_needed(t);
    match crate::host::memory::mem_available_bytes() {
        Some(avail) if needed > avail => Err(LabError::Invalid(format!(
            "modelling {} GiB of guest memory needs about {} MiB of host memory but only {} MiB is available (MemAvailable): use fewer vCPUs (-v) or less memory (-b)",
            t.guest_pages() >> 18,
            needed >> 20,
            avail >> 20
        ))),
        _ => Ok(()),
    }
}

/// A VM set up as the selftests set it up: the test region split into memslots, manual protect
/// as requested, and the completeness oracle over the region.
pub struct Setup {
    /// The VM.
    pub vm: Arc<Vm>,
    /// Its test memslots, in address order.
    pub slots: Vec<Arc<Memslot>>,
    /// The test region's guest physical address.
    pub gpa: u64,
    /// Its first gfn.
    pub base_gfn: u64,
    /// The dirty-log completeness oracle over the region.
    pub oracle: Arc<DirtyLogOracle>,
}

impl Setup {
    /// Checks the host can hold the model, and builds the VM of `t` with `waiter`. `t` must
    /// have been validated by its scenario.
    pub fn new(
        t: &TestVm,
        waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>,
    ) -> Result<Setup, LabError> {
        let gpa = t.region_gpa()?;
        check_host_memory(t)?;
        let mut mmu = t.mmu;
        // KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE is set only with eager splitting on.
        if let MmuKind::Stage2 {
            split_chunk_pages, ..
        } = &mut mmu
        {
            if !t.eager_split {
                *split_chunk_pages = 0;
            }
        }
        let vm = Arc::new(Vm::try_with_waiter(
            VmConfig {
                vcpus: t.vcpus,
                eager_page_split: t.eager_split,
                mmu,
                pml: t.pml,
                kernel: t.kernel,
            },
            waiter,
        )?);
        if t.manual_protect {
            vm.enable_manual_dirty_log_protect(true)?;
        }
        if let Some(entries) = t.dirty_ring {
            vm.enable_dirty_ring(entries)?;
        }
        let pages_per_slot = t.pages_per_slot();
        for i in 0..t.slots as u64 {
            vm.set_user_memory_region(
                TEST_MEM_SLOT_INDEX + i as u32,
                gpa + i * pages_per_slot * PAGE_SIZE,
                pages_per_slot * PAGE_SIZE,
                t.backing,
                0,
            )?;
        }
        if t.mmu.shadow_paging() {
            // The selftest's slot 0 holds the guest's page tables, at the bottom of memory.
            vm.setup_guest_page_tables(0, 0, t.guest_page_level)?;
        }
        let slots = (0..t.slots as u32)
            .map(|i| {
                vm.kvm
                    .slot_by_id(TEST_MEM_SLOT_INDEX + i)
                    .expect("created above")
            })
            .collect();
        let base_gfn = gpa >> PAGE_SHIFT;
        let oracle = Arc::new(DirtyLogOracle::new(base_gfn, t.guest_pages()));
        Ok(Setup {
            vm,
            slots,
            gpa,
            base_gfn,
            oracle,
        })
    }

    /// Plans that set `flags` on every test slot (enable or disable dirty logging).
    pub fn flags_plans(&self, flags: u32) -> Vec<OpPlan> {
        self.slots
            .iter()
            .map(|s| set_memslot_flags_plan(&self.vm.kvm, s, flags))
            .collect()
    }
}

/// Collects what happened since the last snapshot: meters of all actors, `mmu_lock` counters,
/// the host caches' counters by socket (where the engine models them), and the mapped-page
/// stats now.
#[derive(Default)]
pub struct PhaseClock {
    last_meter: Meter,
    last_lock: PhaseCounters,
    last_caches: PhaseCounters,
}

impl PhaseClock {
    /// What happened since the last lap, given every vCPU's meter now.
    pub fn lap(&mut self, vm: &Vm, vcpu_meters: &[Meter]) -> PhaseCounters {
        let mut total = vm.vmm_meter();
        for m in vcpu_meters {
            total.add(m);
        }
        let lock = vm.kvm.mmu_lock.stats.snapshot();
        let mut out: PhaseCounters = total.since(&self.last_meter).to_map();
        for (k, v) in &lock {
            out.insert(k.clone(), v - self.last_lock.get(k).copied().unwrap_or(0));
        }
        let caches: PhaseCounters = vm
            .kvm
            .caches()
            .map(|c| c.counters().into_iter().collect())
            .unwrap_or_default();
        for (k, v) in &caches {
            out.insert(k.clone(), v - self.last_caches.get(k).copied().unwrap_or(0));
        }
        let stats = vm.mmu.page_stats();
        for (name, v) in crate::lab::report::GAUGE_COUNTERS.iter().zip(stats) {
            out.insert(name.to_string(), v.max(0) as u64);
        }
        self.last_meter = total;
        self.last_lock = lock;
        self.last_caches = caches;
        out
    }
}
