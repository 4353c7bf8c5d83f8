//! The L1 model: KVM in L1 as the guest code of each L1 vCPU ([`L1Vcpu`]), with the state its
//! vCPUs share ([`L1State`]: the L2 queue, the EPT12 table and backing page pools).

use super::*;

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
pub(super) struct L1State {
    params: NestedChurnParams,
    kvm: Arc<Kvm>,
    rng: GuestRandom,
    ram: FreeList,
    pool: FreeList,
    pool_base: Gfn,
    l2s: Vec<Option<L2>>,
    pub(super) runnable: VecDeque<usize>,
    pub(super) dying: VecDeque<usize>,
    boots: u64,
    pub(super) pages_checked: u64,
    pub(super) misplaced: u64,
    pub(super) first_misplaced: Vec<String>,
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
    pub(super) fn create_l2(&mut self, k: usize) -> Result<(), LabError> {
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

/// L1's vCPUs over `vm`, sharing one L1.
pub(super) fn guests(p: &NestedChurnParams, vm: &Vm) -> (Arc<Mutex<L1State>>, Vec<L1Vcpu>) {
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
