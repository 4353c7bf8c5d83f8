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
            if n < crate::x86::shadow::pages::KVM_MIN_ALLOC_MMU_PAGES {
                return Err(LabError::Invalid(format!(
                    "--mmu-pages {n}: KVM_SET_NR_MMU_PAGES needs at least {}",
                    crate::x86::shadow::pages::KVM_MIN_ALLOC_MMU_PAGES
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

/// A free list of page indices.
struct FreeList {
    free: Vec<u32>,
}

impl FreeList {
    /// Pages `0..n`, the lowest handed out first by LIFO.
    fn new(n: u64) -> Self {
        FreeList {
            free: (0..n as u32).rev().collect(),
        }
    }

    fn alloc(&mut self, how: L1Alloc, rng: &mut GuestRandom) -> Option<u32> {
        if self.free.is_empty() {
            return None;
        }
        match how {
            L1Alloc::Lifo => self.free.pop(),
            L1Alloc::Random => {
                let i = rng.next_u32() as usize % self.free.len();
                Some(self.free.swap_remove(i))
            }
        }
    }

    fn free(&mut self, page: u32) {
        self.free.push(page);
    }
}

/// What L1 knows of one L2.
struct L2 {
    /// The EPTP L1 gives it.
    eptp: u64,
    /// Its EPT12 tables: `tables[l - 1][i]` is the L1 frame of the level-`l` table that maps
    /// the L2 frames whose bits above `9 * l` are `i` (`NO_FRAME`: none yet); the root is
    /// `tables[3][0]`.
    tables: [Vec<u64>; 4],
    /// The L1 frame backing each L2 page (`NO_BACKING`: none yet), as an index into L1 RAM.
    backing: Vec<u32>,
    /// Pages written so far (while a vCPU runs it, that vCPU counts them).
    touched: u64,
    /// What it writes in every page.
    value: u64,
    /// L1 vCPUs that have run it (each `INVEPT`s its EPTP first).
    ran_on: u64,
}

/// Everything L1 shares between its vCPUs: its allocators and its L2s.
struct L1State {
    params: NestedChurnParams,
    kvm: Arc<Kvm>,
    rng: GuestRandom,
    ram: FreeList,
    pool: FreeList,
    pool_base: Gfn,
    l2s: Vec<Option<L2>>,
    runnable: VecDeque<usize>,
    dying: VecDeque<usize>,
    boots: u64,
    pages_checked: u64,
    misplaced: u64,
    first_misplaced: Vec<String>,
}

const NO_BACKING: u32 = u32::MAX;
const NO_FRAME: u64 = u64::MAX;
/// The permissions L1 gives every EPT12 entry.
const EPT_RWX: u64 = VMX_EPT_READABLE_MASK | VMX_EPT_WRITABLE_MASK | VMX_EPT_EXECUTABLE_MASK;

impl L1State {
    fn alloc_table(&mut self) -> Result<Gfn, LabError> {
        let how = self.params.l1_alloc;
        let p = self
            .pool
            .alloc(how, &mut self.rng)
            .ok_or_else(|| LabError::Invalid("L1 ran out of EPT12 table pages".into()))?;
        Ok(self.pool_base + p as u64)
    }

    /// A new L2 in slot `k`: its root table.
    fn create_l2(&mut self, k: usize) -> Result<(), LabError> {
        let root = self.alloc_table()?;
        let pages = self.params.l2_memory / PAGE_SIZE;
        let ad = if self.params.ept_ad {
            VMX_EPTP_AD_ENABLE_BIT
        } else {
            0
        };
        self.boots += 1;
        let tables = [1u32, 2, 3, 4].map(|l| {
            let mut v = vec![NO_FRAME; pages.div_ceil(1 << (9 * l)) as usize];
            if l == 4 {
                v[0] = root.0;
            }
            v
        });
        self.l2s[k] = Some(L2 {
            eptp: (root.0 << PAGE_SHIFT) | VMX_EPTP_PWL_4 | VMX_EPTP_MT_WB | ad,
            tables,
            backing: vec![NO_BACKING; pages as usize],
            touched: 0,
            value: 0x5a00_0000_0000_0000 | self.boots,
            ran_on: 0,
        });
        Ok(())
    }

    /// L1's EPT-violation handler for L2 `k`'s page `page`: the stores that map it, allocating
    /// the missing tables top-down and a backing page.
    fn map_page(
        &mut self,
        k: usize,
        page: u64,
        ops: &mut VecDeque<GuestAccess>,
    ) -> Result<(), LabError> {
        let mut table = Gfn(self.l2s[k].as_ref().expect("live L2").tables[3][0]);
        for level in [4u32, 3, 2] {
            let i = (page >> (9 * (level - 1))) as usize;
            let existing = self.l2s[k].as_ref().expect("live L2").tables[level as usize - 2][i];
            table = if existing != NO_FRAME {
                Gfn(existing)
            } else {
                let c = self.alloc_table()?;
                self.l2s[k].as_mut().expect("live L2").tables[level as usize - 2][i] = c.0;
                let index = pt64_index(page << PAGE_SHIFT, Level(level as u8));
                ops.push_back(store(table, index, (c.0 << PAGE_SHIFT) | EPT_RWX));
                c
            };
        }
        let how = self.params.l1_alloc;
        let l2 = self.l2s[k].as_mut().expect("live L2");
        if l2.backing[page as usize] == NO_BACKING {
            l2.backing[page as usize] = self
                .ram
                .alloc(how, &mut self.rng)
                .ok_or_else(|| LabError::Invalid("L1 ran out of memory for its L2s".into()))?;
        }
        let b = l2.backing[page as usize] as u64;
        ops.push_back(store(
            table,
            pt64_index(page << PAGE_SHIFT, Level(1)),
            (b << PAGE_SHIFT) | EPT_RWX | EPT_LEAF_MT_WB,
        ));
        Ok(())
    }

    /// The oracle at the end of L2 `k`'s boot: every page it wrote holds its value in the
    /// backing page L1 gave it.
    fn check_boot(&mut self, k: usize) {
        let l2 = self.l2s[k].as_ref().expect("live L2");
        let ram = self.kvm.slot_by_id(L1_RAM_SLOT).expect("L1's RAM");
        for (page, &b) in l2.backing.iter().enumerate() {
            self.pages_checked += 1;
            let got = (b != NO_BACKING).then(|| self.kvm.host.read(ram.gfn_to_pfn(Gfn(b as u64))));
            if got != Some(l2.value) {
                self.misplaced += 1;
                if self.first_misplaced.len() < 8 {
                    self.first_misplaced.push(if b == NO_BACKING {
                        format!("L2 page {page:#x} was written, but L1 never mapped it: the write went through a stale EPT02 translation")
                    } else {
                        format!(
                            "L2 page {page:#x} (L1 frame {b:#x}) holds {got:x?}, not {:#x}",
                            l2.value
                        )
                    });
                }
            }
        }
    }

    /// Teardown of L2 `k`: zeros over its tables in the configured order, an `INVEPT` of its
    /// EPTP, and its pages back to L1's allocators.
    fn destroy_l2(&mut self, k: usize, ops: &mut VecDeque<GuestAccess>) {
        let l2 = self.l2s[k].take().expect("live L2");
        // Root first, then each level down (top-down), or the reverse.
        let mut tables: Vec<u64> = l2
            .tables
            .iter()
            .rev()
            .flat_map(|level| level.iter().copied().filter(|&t| t != NO_FRAME))
            .collect();
        if self.params.teardown == Teardown::BottomUp {
            tables.reverse();
        }
        for &t in &tables {
            for w in 0..crate::x86::spte::SPTE_ENT_PER_PAGE {
                ops.push_back(store(Gfn(t), w, 0));
            }
        }
        ops.push_back(GuestAccess::instruction(GuestOp::InvalidateNested {
            root_pointer: Some(l2.eptp),
        }));
        for t in tables {
            self.pool.free((t - self.pool_base.0) as u32);
        }
        for b in l2.backing {
            if b != NO_BACKING {
                self.ram.free(b);
            }
        }
    }
}

/// An L1 store of `value` into word `word` of its page `gfn`.
fn store(gfn: Gfn, word: usize, value: u64) -> GuestAccess {
    GuestAccess {
        gfn,
        word,
        write: true,
        value,
        op: GuestOp::Access,
        compute_ns: 0,
    }
}

/// What an L1 vCPU does in a pass.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Pass {
    Boot,
    Teardown,
}

/// The L2 an L1 vCPU runs: nobody else runs it meanwhile, so its progress lives here until
/// the vCPU leaves it.
#[derive(Copy, Clone, Debug)]
struct Running {
    /// Its slot in [`L1State::l2s`].
    k: usize,
    /// Pages left in the quantum.
    left: u64,
    /// Pages written so far.
    touched: u64,
    /// Its pages.
    pages: u64,
    /// What it writes.
    value: u64,
}

/// One L1 vCPU's guest code (see the module documentation).
pub struct L1Vcpu {
    l1: Arc<Mutex<L1State>>,
    id: usize,
    pass: Pass,
    /// L1 work queued: stores, instructions.
    ops: VecDeque<GuestAccess>,
    /// The L2 it runs.
    running: Option<Running>,
    /// The access in flight is the L2's.
    in_l2: bool,
}

impl GuestCode for L1Vcpu {
    fn start_pass(&mut self, iteration: i64) {
        self.pass = if iteration % 2 == 0 {
            Pass::Boot
        } else {
            Pass::Teardown
        };
    }

    fn next_access(&mut self) -> Option<GuestAccess> {
        loop {
            if let Some(a) = self.ops.pop_front() {
                self.in_l2 = false;
                return Some(a);
            }
            if let Some(r) = self.running {
                if r.touched < r.pages && r.left > 0 {
                    self.in_l2 = true;
                    return Some(GuestAccess::first_word(Gfn(r.touched), true, r.value));
                }
                // The L2 exits to L1: its boot is over, or L1's timer took the CPU back.
                self.running = None;
                let mut l1 = self.l1.lock();
                l1.l2s[r.k].as_mut().expect("running L2").touched = r.touched;
                if r.touched == r.pages {
                    l1.check_boot(r.k);
                } else {
                    l1.runnable.push_back(r.k);
                }
                self.ops
                    .push_back(GuestAccess::instruction(GuestOp::ExitNested));
                continue;
            }
            let mut l1 = self.l1.lock();
            if self.pass == Pass::Teardown {
                let k = l1.dying.pop_front()?;
                l1.destroy_l2(k, &mut self.ops);
                continue;
            }
            let k = l1.runnable.pop_front()?;
            let quantum = l1.params.quantum;
            let l2 = l1.l2s[k].as_mut().expect("runnable L2");
            if l2.ran_on & (1 << self.id) == 0 {
                // KVM in L1 loading a root on this CPU: KVM_REQ_TLB_FLUSH_CURRENT.
                l2.ran_on |= 1 << self.id;
                self.ops
                    .push_back(GuestAccess::instruction(GuestOp::InvalidateNested {
                        root_pointer: Some(l2.eptp),
                    }));
            }
            self.ops
                .push_back(GuestAccess::instruction(GuestOp::EnterNested {
                    root_pointer: l2.eptp,
                }));
            self.running = Some(Running {
                k,
                left: quantum,
                touched: l2.touched,
                pages: l2.backing.len() as u64,
                value: l2.value,
            });
        }
    }

    fn access_done(&mut self, access: &GuestAccess) {
        if self.in_l2 && access.op == GuestOp::Access {
            let r = self.running.as_mut().expect("an L2 access ran in an L2");
            r.touched += 1;
            r.left -= 1;
        }
    }

    fn access_reflected(&mut self, access: &GuestAccess) {
        let k = self.running.expect("only an L2 access is reflected").k;
        let mut l1 = self.l1.lock();
        let eptp = l1.l2s[k].as_ref().expect("running L2").eptp;
        // The allocators are sized by NestedChurnParams::validate() for a round of L2s.
        if let Err(e) = l1.map_page(k, access.gfn.0, &mut self.ops) {
            panic!("L1: {e}");
        }
        // handle_ept_violation() in L1 returns to its vcpu_run(): VMRESUME.
        self.ops
            .push_back(GuestAccess::instruction(GuestOp::EnterNested {
                root_pointer: eptp,
            }));
    }
}

/// One round: its boots and its teardown.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RoundReport {
    /// 1-based.
    pub round: u32,
    /// Booting the round's L2s (all of them, concurrently).
    pub boot: Phase,
    /// Destroying them.
    pub teardown: Phase,
    /// The shadow pages after the teardown.
    pub census: PageCensus,
}

/// The oracles' verdict.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct NestedOracle {
    /// L2 pages whose backing page was checked.
    pub pages_checked: u64,
    /// Of those, pages that did not hold what the L2 wrote.
    pub misplaced: u64,
    /// The first few, described.
    pub first_misplaced: Vec<String>,
    /// Page-table invariant violations after the run.
    pub invariant_errors: Vec<String>,
}

impl NestedOracle {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.misplaced == 0 && self.invariant_errors.is_empty()
    }
}

/// The whole run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NestedChurnReport {
    /// Which engine drove the model.
    pub engine: String,
    /// The parameters.
    pub params: NestedChurnParams,
    /// The page quota the run had.
    pub quota: u64,
    /// Every round.
    pub rounds: Vec<RoundReport>,
    /// Deleting memslot 0 at shutdown.
    pub delete_slot0: Phase,
    /// The shadow pages before the deletion.
    pub before_delete: PageCensus,
    /// The oracles.
    pub oracle: NestedOracle,
}

/// The switch's name in reports, with the kernel it follows.
pub fn zap_orphans_label(z: ZapOrphans) -> &'static str {
    match z {
        ZapOrphans::On => "on (Linux 5.9+)",
        ZapOrphans::V1 => "v1 (the seed's first version)",
        ZapOrphans::Off => "off (Linux 5.8 and earlier)",
    }
}

impl NestedChurnReport {
    /// A table of the rounds, the deletion and the verdict.
    pub fn to_text(&self, with_counters: bool) -> String {
        let p = &self.params;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "nested-churn: L1 {} GiB with {} vCPUs (shadow MMU, ept=Y tdp_mmu=N, quota {} pages), {} L2s of {} MiB at a time, {} rounds, zap orphans {}, {} engine",
            p.l1_memory >> 30,
            p.l1_vcpus,
            self.quota,
            p.concurrent,
            p.l2_memory >> 20,
            p.rounds,
            zap_orphans_label(p.zap_orphans),
            self.engine
        );
        let _ = writeln!(
            s,
            "round   boot time     teardown   pages used  reachable    stale  orphans  max hash  max rmap  flooded  recycled"
        );
        for r in &self.rounds {
            let c = &r.census;
            let _ = writeln!(
                s,
                "{:5}  {:>11}  {:>11}  {:11}  {:9}  {:7}  {:7}  {:8}  {:8}  {:7}  {:8}",
                r.round,
                fmt_ts(r.boot.wall_ns),
                fmt_ts(r.teardown.wall_ns),
                c.used,
                c.reachable,
                c.stale,
                c.orphans,
                c.max_hash_chain,
                c.max_rmap,
                c.flooded,
                c.recycled
            );
            if with_counters {
                for (name, ph) in [("boot", &r.boot), ("teardown", &r.teardown)] {
                    if let Some(line) = crate::lab::report::counter_line(name, ph) {
                        let _ = writeln!(s, "{line}");
                    }
                }
            }
        }
        if let (Some(first), Some(last)) = (self.rounds.first(), self.rounds.last()) {
            let a = first.boot.wall_ns as f64;
            let b = last.boot.wall_ns as f64;
            let _ = writeln!(
                s,
                "Boot time of round {} against round 1: {:+.1}%",
                last.round,
                (b / a - 1.0) * 100.0
            );
        }
        let d = &self.delete_slot0;
        let count = |k: &str| {
            d.counters
                .as_ref()
                .and_then(|c| c.get(k).copied())
                .unwrap_or(0)
        };
        let _ = writeln!(
            s,
            "Deleting memslot 0 ({}): {}, {} shadow pages zapped, {} SPTEs read, {} rmap removals walking {} extra descriptors",
            match p.slot_zap {
                SlotZap::AllFast => "kvm_mmu_zap_all_fast",
                SlotZap::Memslot => "kvm_mmu_zap_memslot",
            },
            fmt_ts(d.wall_ns),
            count("sp_zapped"),
            count("spte_reads"),
            count("rmap_removes"),
            count("rmap_desc_steps")
        );
        let mut met = crate::lab::report::Meetings::default();
        for r in &self.rounds {
            met.add(&r.boot);
            met.add(&r.teardown);
        }
        if let Some(line) = met.line() {
            let _ = writeln!(s, "{line}");
        }
        let o = &self.oracle;
        let _ = writeln!(
            s,
            "Oracle: {} L2 pages checked in L1 memory, {} misplaced; page-table invariants {}",
            o.pages_checked,
            o.misplaced,
            crate::lab::report::invariants_verdict(o.invariant_errors.len())
        );
        for e in o
            .first_misplaced
            .iter()
            .chain(o.invariant_errors.iter().take(8))
        {
            let _ = writeln!(s, "  {e}");
        }
        s
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
    let vm = Arc::new(
        Vm::try_with_waiter(
            VmConfig {
                vcpus: p.l1_vcpus,
                eager_page_split: false,
                mmu: MmuKind::Shadow { ept: true },
                pml: false,
                kernel: Default::default(),
            },
            waiter,
        )
        .map_err(|e| LabError::Invalid(e.to_string()))?,
    );
    let shadow = vm.shadow().expect("a shadow MMU");
    shadow.set_zap_orphans(&vm.kvm, p.zap_orphans);
    shadow.set_slot_zap(&vm.kvm, p.slot_zap);
    shadow.set_write_tracking(&vm.kvm, p.write_tracking);
    let ram_bytes = p.ram_pages() * PAGE_SIZE;
    vm.set_user_memory_region(L1_RAM_SLOT, 0, ram_bytes, Backing::Anonymous, 0)
        .map_err(|e| LabError::Invalid(e.to_string()))?;
    vm.set_user_memory_region_full_pages(
        L1_TABLE_SLOT,
        ram_bytes,
        p.table_pool_pages() * PAGE_SIZE,
        Backing::Anonymous,
    )
    .map_err(|e| LabError::Invalid(e.to_string()))?;
    if let Some(n) = p.mmu_pages {
        shadow
            .set_nr_mmu_pages(&vm.kvm, n)
            .map_err(|e| LabError::Invalid(e.to_string()))?;
    }
    Ok(vm)
}

/// L1's vCPUs over `vm`, sharing one L1.
fn guests(p: &NestedChurnParams, vm: &Vm) -> (Arc<Mutex<L1State>>, Vec<L1Vcpu>) {
    let l1 = Arc::new(Mutex::new(L1State {
        params: p.clone(),
        kvm: Arc::clone(&vm.kvm),
        rng: GuestRandom::new(p.seed.max(1)),
        ram: FreeList::new(p.ram_pages()),
        pool: FreeList::new(p.table_pool_pages()),
        pool_base: Gfn(p.ram_pages()),
        l2s: (0..p.concurrent).map(|_| None).collect(),
        runnable: VecDeque::new(),
        dying: VecDeque::new(),
        boots: 0,
        pages_checked: 0,
        misplaced: 0,
        first_misplaced: Vec::new(),
    }));
    let vcpus = (0..p.l1_vcpus)
        .map(|id| L1Vcpu {
            l1: Arc::clone(&l1),
            id,
            pass: Pass::Boot,
            ops: VecDeque::new(),
            running: None,
            in_l2: false,
        })
        .collect();
    (l1, vcpus)
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

/// Draws the boot time of every round, one line per report (a side of a comparison), into the
/// SVG file `path`.
pub fn plot_boot_times(
    path: &std::path::Path,
    reports: &[NestedChurnReport],
) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| chart::draw_error(path, e);
    let rounds = reports
        .iter()
        .map(|r| r.rounds.len())
        .max()
        .unwrap_or(1)
        .max(2) as u32;
    let y_max = reports
        .iter()
        .flat_map(|r| r.rounds.iter().map(|x| x.boot.wall_ns as f64 / 1e9))
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let root = chart::svg_area(path, (800, 520))?;
    let p = &reports[0].params;
    let title = format!(
        "nested-churn: {} L2s of {} MiB per round under a {} GiB L1",
        p.concurrent,
        p.l2_memory >> 20,
        p.l1_memory >> 30
    );
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(1u32..rounds, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("round")
        .y_desc("boot time of the round's L2s (s)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in reports.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(u32, f64)> = r
            .rounds
            .iter()
            .map(|x| (x.round, x.boot.wall_ns as f64 / 1e9))
            .collect();
        let label = format!("zap orphans {}", zap_orphans_label(r.params.zap_orphans));
        chart::labelled_line(&mut chart, points.clone(), color, label).map_err(|e| err(&e))?;
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart::legend(&mut chart, None).map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}

/// The sides of a comparison: boot time and stale pages per round, then the deletion.
pub fn compare_text(reports: &[NestedChurnReport]) -> String {
    let mut s = String::new();
    let p = &reports[0].params;
    let _ = writeln!(
        s,
        "nested-churn --compare zap-orphans: L1 {} GiB with {} vCPUs, {} L2s of {} MiB at a time, {} rounds, {} engine",
        p.l1_memory >> 30,
        p.l1_vcpus,
        p.concurrent,
        p.l2_memory >> 20,
        p.rounds,
        reports[0].engine
    );
    let names: Vec<&str> = reports
        .iter()
        .map(|r| match r.params.zap_orphans {
            ZapOrphans::On => "on",
            ZapOrphans::V1 => "v1",
            ZapOrphans::Off => "off",
        })
        .collect();
    let _ = write!(s, "round");
    for n in &names {
        let _ = write!(s, "  boot ({n:>3})  stale ({n:>3})");
    }
    let _ = writeln!(s);
    for i in 0..reports[0].rounds.len() {
        let _ = write!(s, "{:5}", i + 1);
        for r in reports {
            let round = &r.rounds[i];
            let _ = write!(
                s,
                "  {:>10}  {:11}",
                crate::lab::report::fmt_ts(round.boot.wall_ns),
                round.census.stale
            );
        }
        let _ = writeln!(s);
    }
    for (r, n) in reports.iter().zip(&names) {
        let first = r.rounds.first().map_or(1, |x| x.boot.wall_ns) as f64;
        let last = r.rounds.last().map_or(1, |x| x.boot.wall_ns) as f64;
        let zapped = r
            .delete_slot0
            .counters
            .as_ref()
            .and_then(|c| c.get("sp_zapped").copied())
            .unwrap_or(0);
        let _ = writeln!(
            s,
            "zap orphans {n}: boot time of the last round {:+.1}% against the first; deleting memslot 0 took {} ({} shadow pages zapped); max hash chain {}, max rmap {}",
            (last / first - 1.0) * 100.0,
            crate::lab::report::fmt_ts(r.delete_slot0.wall_ns),
            zapped,
            r.before_delete.max_hash_chain,
            r.before_delete.max_rmap
        );
    }
    let checked: u64 = reports.iter().map(|r| r.oracle.pages_checked).sum();
    let misplaced: u64 = reports.iter().map(|r| r.oracle.misplaced).sum();
    let inv: usize = reports
        .iter()
        .map(|r| r.oracle.invariant_errors.len())
        .sum();
    let _ = writeln!(
        s,
        "Oracle: {checked} L2 pages checked in L1 memory, {misplaced} misplaced; page-table invariants {}",
        crate::lab::report::invariants_verdict(inv)
    );
    s
}
