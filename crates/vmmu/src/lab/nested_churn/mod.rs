//! The `nested-churn` scenario: seed 004's benchmark. An L1 guest hypervisor (KVM in L1, with
//! EPT) boots nested L2 guests `concurrent` at a time for `rounds` rounds; each L2 writes every
//! page of its memory once at boot (as the seed's Windows guests touch all their memory), and is
//! then destroyed, L1 freeing and later reusing its EPT12 tables and backing memory. At the end
//! the VM deletes memslot 0, as its shutdown does.
//!
//! The L1 model ([`L1Vcpu`]) is the guest code of each L1 vCPU, so both engines run it through
//! the one exit loop: it takes L2s round-robin from one queue, runs each for a quantum of
//! pages (`VMRESUME`, then the L2's writes, then an exit L1 handles), and handles the EPT
//! violations KVM reflects to it by allocating EPT12 tables and a backing page from its own
//! memory and storing the entries (stores that go through EPT01, so KVM sees them as a guest's
//! writes to shadowed tables: emulated, or unsync). A vCPU's first run of an L2 starts with an
//! `INVEPT` of its EPTP, as KVM in L1 does when it loads a root. Teardown writes zeros over
//! every EPT12 table of the L2 (top-down by default) and `INVEPT`s its EPTP.
//!
//! Layout of L1's memory: memslot 0 holds the pages L1 backs its L2s with (one word kept per
//! page), memslot 1 (`table_memory` of L1's memory, a quarter by default) the pages it
//! allocates EPT12 tables from (every word kept, since KVM walks them). Simplified: KVM in L1
//! takes both from all of its free memory; here they come from two pools, and the smaller the
//! table pool, the sooner L1 reuses a page KVM still shadows (which finds the stale shadow
//! page again and so reaps it). L1 does not zero backing pages before giving them to an L2
//! (KVM in L1 gets them zeroed from its kernel, a cost common to both sides of the switch),
//! and its own fault-handling instructions beyond the stores are not priced.
//!
//! Oracles: when an L2 has written all its pages, every backing page L1 gave it must hold the
//! value it wrote (a write through a stale EPT02 translation lands elsewhere); the page-table
//! invariants (including that no synced EPT02 entry maps what EPT12 does not) after the run.

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{Engine, GuestAccess, GuestCode, GuestOp};
use crate::host::backing::Backing;
use crate::kvm::memslot_delete::delete_memslot_plan;
use crate::kvm::Kvm;
use crate::lab::memstress::GuestRandom;
use crate::lab::report::{fmt_ts, Phase};
use crate::lab::test_vm::PhaseClock;
use crate::lab::{chart, LabError};
use crate::units::{Gfn, PAGE_SHIFT, PAGE_SIZE};
use crate::vm::waiter::SpinWaiter;
use crate::vm::{MmuKind, Vm, VmConfig};
use crate::x86::guest_paging::ept::*;
use crate::x86::guest_paging::gpte::pt64_index;
use crate::x86::shadow::census::PageCensus;
use crate::x86::shadow::state::{SlotZap, ZapOrphans};
use crate::x86::spte::Level;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Arc;

mod l1;
mod report;

pub use l1::L1Vcpu;
use l1::{guests, L1State};
pub use report::{
    compare_text, plot_boot_times, zap_orphans_label, NestedChurnReport, NestedOracle, RoundReport,
};

/// L1's RAM: the memslot the L2s' memory comes from.
pub const L1_RAM_SLOT: u32 = 0;
/// The memslot L1 allocates EPT12 tables from.
pub const L1_TABLE_SLOT: u32 = 1;
/// Most L1 vCPUs the model tracks per L2 (a bit each).
pub const MAX_L1_VCPUS: usize = 64;

/// The order L1 writes zeros over a dead L2's EPT12 tables.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Teardown {
    /// Root, then PDPTs, PDs, PTs: the upper tables flood and are zapped before KVM ever
    /// sees a write to a PT, so (without seed 004) the PT pages stay behind synced.
    #[default]
    TopDown,
    /// PTs first: they go unsync when written, and zapping their parents later reaps them
    /// (`mmu_zap_unsync_children()`), so little is left behind even without seed 004.
    BottomUp,
}

/// How L1 picks the free pages it allocates.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum L1Alloc {
    /// A seeded random free page, as a buddy allocator under churn hands them out.
    #[default]
    Random,
    /// The page freed last: tables are reused at once, so KVM finds its old shadow pages
    /// again by hash.
    Lifo,
}

/// One `nested-churn` run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NestedChurnParams {
    /// L1's memory in bytes: memslots 0 and 1.
    pub l1_memory: u64,
    /// Of it, the bytes L1 allocates EPT12 tables from (memslot 1); 0: a quarter.
    pub table_memory: u64,
    /// Each L2's memory in bytes.
    pub l2_memory: u64,
    /// L2s booted at a time.
    pub concurrent: u32,
    /// Rounds of boots.
    pub rounds: u32,
    /// L1's vCPUs.
    pub l1_vcpus: usize,
    /// L2 pages an L1 vCPU runs before switching to the next L2.
    pub quantum: u64,
    /// Seed 004's switch.
    pub zap_orphans: ZapOrphans,
    /// What deleting memslot 0 zaps.
    pub slot_zap: SlotZap,
    /// `KVM_SET_NR_MMU_PAGES` (None: KVM's default quota).
    pub mmu_pages: Option<u64>,
    /// The order of teardown writes.
    pub teardown: Teardown,
    /// How L1 allocates.
    pub l1_alloc: L1Alloc,
    /// L1 enables EPT A/D bits in its EPTPs.
    pub ept_ad: bool,
    /// The seed of L1's allocator.
    pub seed: u32,
    /// KVM write-protects and tracks the EPT12 tables it shadows. Only the negative control
    /// turns it off (`ShadowMmu::set_write_tracking`): the oracles must then catch the L2
    /// writes that go through stale EPT02 translations.
    #[serde(default = "yes")]
    pub write_tracking: bool,
}

fn yes() -> bool {
    true
}

impl Default for NestedChurnParams {
    /// A configuration that keeps the seed's shape (10 concurrent L2s, 20 rounds, 4 L1 vCPUs)
    /// at an eighth of its L2 size and a quarter of its L1 memory, so it runs in well under a
    /// minute.
    fn default() -> Self {
        NestedChurnParams {
            l1_memory: 16 << 30,
            table_memory: 0,
            l2_memory: 256 << 20,
            concurrent: 10,
            rounds: 20,
            l1_vcpus: 4,
            quantum: 4096,
            zap_orphans: ZapOrphans::On,
            slot_zap: SlotZap::AllFast,
            mmu_pages: None,
            teardown: Teardown::TopDown,
            l1_alloc: L1Alloc::Random,
            ept_ad: true,
            seed: 1,
            write_tracking: true,
        }
    }
}

/// EPT12 tables of one L2 of `pages` pages: a root, PDPTs, PDs and PTs.
fn tables_per_l2(pages: u64) -> u64 {
    let per = |level: u32| pages.div_ceil(1 << (9 * level));
    1 + per(3) + per(2) + per(1)
}

impl NestedChurnParams {
    /// L1 pages that hold EPT12 tables (memslot 1).
    pub fn table_pool_pages(&self) -> u64 {
        let bytes = if self.table_memory == 0 {
            self.l1_memory / 4
        } else {
            self.table_memory
        };
        bytes / PAGE_SIZE
    }

    /// L1 pages that back L2 memory (memslot 0).
    pub fn ram_pages(&self) -> u64 {
        (self.l1_memory / PAGE_SIZE).saturating_sub(self.table_pool_pages())
    }

    /// Refuses what the benchmark cannot run, with a one-line reason.
    pub fn validate(&self) -> Result<(), LabError> {
        if self.rounds == 0 {
            return Err(LabError::Invalid("--rounds must be at least 1".into()));
        }
        if self.concurrent == 0 {
            return Err(LabError::Invalid("--concurrent must be at least 1".into()));
        }
        if self.l1_vcpus == 0 || self.l1_vcpus > MAX_L1_VCPUS {
            return Err(LabError::Invalid(format!(
                "--l1-vcpus {}: L1 has 1 to {MAX_L1_VCPUS} vCPUs",
                self.l1_vcpus
            )));
        }
        if self.quantum == 0 {
            return Err(LabError::Invalid(
                "--quantum must be at least 1 page".into(),
            ));
        }
        if self.l2_memory < PAGE_SIZE || !self.l2_memory.is_multiple_of(PAGE_SIZE) {
            return Err(LabError::Invalid(format!(
                "--l2-memory {}: a positive multiple of 4 KiB is needed",
                self.l2_memory
            )));
        }
        if self.l1_memory == 0 || !self.l1_memory.is_multiple_of(1 << 30) {
            return Err(LabError::Invalid(format!(
                "--l1-memory {}: a positive multiple of 1 GiB is needed",
                self.l1_memory
            )));
        }
        let l2_total = self.l2_memory.saturating_mul(self.concurrent as u64);
        if l2_total > self.l1_memory {
            return Err(LabError::Invalid(format!(
                "--l2-memory x --concurrent is {} MiB, more than --l1-memory ({} MiB): L1 cannot back its guests",
                l2_total >> 20,
                self.l1_memory >> 20
            )));
        }
        if !self.table_memory.is_multiple_of(PAGE_SIZE) || self.table_memory >= self.l1_memory {
            return Err(LabError::Invalid(format!(
                "--l1-table-memory {}: a multiple of 4 KiB smaller than --l1-memory is needed",
                self.table_memory
            )));
        }
        if l2_total > self.ram_pages() * PAGE_SIZE {
            return Err(LabError::Invalid(format!(
                "--l2-memory x --concurrent is {} MiB, more than the {} MiB of --l1-memory left after --l1-table-memory: L1 cannot back its guests",
                l2_total >> 20,
                (self.ram_pages() * PAGE_SIZE) >> 20
            )));
        }
        let tables = self.concurrent as u64 * tables_per_l2(self.l2_memory / PAGE_SIZE);
        if tables > self.table_pool_pages() {
            return Err(LabError::Invalid(format!(
                "--l1-table-memory holds {} pages, fewer than the {tables} EPT12 tables one round of L2s needs",
                self.table_pool_pages()
            )));
        }
        if self.l1_memory > 1 << 44 {
            return Err(LabError::Invalid(format!(
                "--l1-memory {} GiB: at most 16384 GiB can be modelled",
                self.l1_memory >> 30
            )));
        }
        if let Some(n) = self.mmu_pages {
            if n < crate::x86::shadow::state::KVM_MIN_ALLOC_MMU_PAGES {
                return Err(LabError::Invalid(format!(
                    "--mmu-pages {n}: KVM_SET_NR_MMU_PAGES needs at least {}",
                    crate::x86::shadow::state::KVM_MIN_ALLOC_MMU_PAGES
                )));
            }
        }
        Ok(())
    }

    /// Host bytes the run needs, roughly: L1 RAM (a word, an rmap head and a free-list entry
    /// per page), the table pool (whole pages), and the shadow pages alive at the end without
    /// seed 004 (8 KiB each: the table and its `shadowed_translation`).
    pub fn host_bytes(&self) -> u64 {
        let per_boot = tables_per_l2(self.l2_memory / PAGE_SIZE);
        let boots = self.concurrent as u64 * self.rounds as u64;
        // The table pool's pages are backed when first written (once per table allocated).
        let tables_touched = (boots * per_boot).min(self.table_pool_pages());
        self.l1_memory / PAGE_SIZE * 20 + tables_touched * PAGE_SIZE + boots * per_boot * (9 << 10)
    }
}

/// The VM of `p`: L1's vCPUs on the shadow MMU with EPT, its RAM and table pool.
fn build_vm(
    p: &NestedChurnParams,
    waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>,
) -> Result<Arc<Vm>, LabError> {
    p.validate()?;
    if let Some(avail) = crate::host::memory::mem_available_bytes() {
        let need = p.host_bytes();
        if need > avail {
            return Err(LabError::Invalid(format!(
                "this nested-churn run needs about {} MiB of host memory but {} MiB is available: use less --l1-memory, --l2-memory or fewer --rounds",
                need >> 20,
                avail >> 20
            )));
        }
    }
    let vm = Arc::new(Vm::try_with_waiter(
        VmConfig {
            vcpus: p.l1_vcpus,
            eager_page_split: false,
            mmu: MmuKind::Shadow { ept: true },
            pml: false,
            kernel: Default::default(),
        },
        waiter,
    )?);
    let shadow = vm.shadow().expect("a shadow MMU");
    shadow.set_zap_orphans(&vm.kvm, p.zap_orphans);
    shadow.set_slot_zap(&vm.kvm, p.slot_zap);
    shadow.set_write_tracking(&vm.kvm, p.write_tracking);
    let ram_bytes = p.ram_pages() * PAGE_SIZE;
    vm.set_user_memory_region(L1_RAM_SLOT, 0, ram_bytes, Backing::Anonymous, 0)?;
    vm.set_user_memory_region_full_pages(
        L1_TABLE_SLOT,
        ram_bytes,
        p.table_pool_pages() * PAGE_SIZE,
        Backing::Anonymous,
    )?;
    if let Some(n) = p.mmu_pages {
        shadow
            .set_nr_mmu_pages(&vm.kvm, n)
            .map_err(|e| LabError::Invalid(e.to_string()))?;
    }
    Ok(vm)
}

fn run_nested_churn(
    p: &NestedChurnParams,
    vm: &Arc<Vm>,
    l1: &Mutex<L1State>,
    engine: &mut dyn Engine,
    progress: bool,
) -> Result<NestedChurnReport, LabError> {
    let shadow = vm.shadow().expect("a shadow MMU");
    let mut clock = PhaseClock::default();
    let mut lap = |engine: &dyn Engine, ns: u64| Phase {
        wall_ns: ns,
        counters: Some(clock.lap(vm, &engine.vcpu_meters())),
    };
    let quota = shadow.census().quota;
    let mut rounds = Vec::new();
    for round in 0..p.rounds {
        {
            let mut l1 = l1.lock();
            for k in 0..p.concurrent as usize {
                l1.create_l2(k)?;
                l1.runnable.push_back(k);
            }
        }
        let ns = engine.run_pass(2 * round as i64)?;
        let boot = lap(&*engine, ns);
        l1.lock().dying.extend(0..p.concurrent as usize);
        let ns = engine.run_pass(2 * round as i64 + 1)?;
        let teardown = lap(&*engine, ns);
        let census = shadow.census();
        if progress {
            eprintln!(
                "vmmu: round {} of {}: boot {}, {} stale pages",
                round + 1,
                p.rounds,
                fmt_ts(boot.wall_ns),
                census.stale
            );
        }
        rounds.push(RoundReport {
            round: round + 1,
            boot,
            teardown,
            census,
        });
    }
    engine.stop_vcpus()?;
    let mut invariant_errors = vm.check_invariants();
    let before_delete = shadow.census();
    let slot0 = vm
        .kvm
        .slot_by_id(L1_RAM_SLOT)
        .ok_or_else(|| LabError::Invalid("memslot 0 is gone".into()))?;
    let ns = engine.run_plans(vec![delete_memslot_plan(&vm.mmu, &slot0)])?;
    let delete_slot0 = lap(&*engine, ns);
    invariant_errors.extend(vm.check_invariants());
    let l1 = l1.lock();
    Ok(NestedChurnReport {
        engine: engine.name().into(),
        params: p.clone(),
        quota,
        rounds,
        delete_slot0,
        before_delete,
        oracle: NestedOracle {
            pages_checked: l1.pages_checked,
            misplaced: l1.misplaced,
            first_misplaced: l1.first_misplaced.clone(),
            invariant_errors,
        },
    })
}

/// Runs `nested-churn` on the threads engine (each L1 vCPU a thread running its L2s).
pub fn run_nested_churn_threads(
    p: &NestedChurnParams,
    progress: bool,
) -> Result<NestedChurnReport, LabError> {
    let vm = build_vm(p, Box::new(SpinWaiter))?;
    let (l1, vcpus) = guests(p, &vm);
    let mut engine = Threads::new(Arc::clone(&vm), vcpus);
    run_nested_churn(p, &vm, &l1, &mut engine, progress)
}

/// Runs `nested-churn` in virtual time, priced with `cost`.
pub fn run_nested_churn_virtual(
    p: &NestedChurnParams,
    cost: &CostModel,
    progress: bool,
) -> Result<NestedChurnReport, LabError> {
    crate::engine::virtual_time::check_cost_model(cost)?;
    let vm = build_vm(p, Box::new(VirtualWaiter))?;
    let (l1, vcpus) = guests(p, &vm);
    let mut engine = VirtualTime::new(&vm, cost, vcpus)?;
    run_nested_churn(p, &vm, &l1, &mut engine, progress)
}
