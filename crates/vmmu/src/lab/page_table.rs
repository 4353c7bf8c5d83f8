//! The `page-table` scenario: KVM's `kvm_page_table_test`. Every vCPU walks the *same* test
//! region (the test does not partition it) in four stages, each started by the host and timed
//! from the moment it publishes the stage until the last vCPU's `GUEST_SYNC`:
//!
//! - `KVM_BEFORE_MAPPINGS`: the vCPUs start and sync (not timed);
//! - `KVM_CREATE_MAPPINGS`: each vCPU touches the first word of every *large* page (the
//!   backing's page), even-numbered vCPUs writing and odd ones reading, so KVM maps blocks;
//! - `KVM_UPDATE_MAPPINGS`, with dirty logging on: anonymous memory is written page by page
//!   (write faults on write-protected pages); a huge backing has the first page of each large
//!   page written (the block is broken) and the host pages of its second half read (mapped at
//!   4K, as logging allows no blocks);
//! - `KVM_ADJUST_MAPPINGS`, dirty logging off again: every host page is read, so KVM collapses
//!   the 4K mappings back into blocks. With `--backward-pages N` (seed 002's modification of
//!   the test) each new page is followed by reads of up to N pages behind it, which refill what
//!   a TLB flush threw away.
//!
//! After the stages the VM is torn down as `kvm_vm_free()` does, each memslot deleted and then
//! its backing unmapped (`__vm_mem_region_delete()`), and timed: `KVM_UNMAP_VM`, seed 002's
//! "Unmap VM" column (the stock test does not print it), with its two parts on their own lines
//! (`KVM_UNMAP_VM_DELETE_MEMSLOT`, `KVM_UNMAP_VM_MUNMAP`). Not modelled: the vCPUs' and the
//! VM's own destruction when the last file descriptor closes (`kvm_destroy_vm()`).
//!
//! Oracles: the page-table invariants after every stage, and the dirty-log completeness oracle
//! over the update stage (every page written while logging was on is in the slot's bitmap,
//! read without a harvest so the test's course is unchanged).

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{DescendingReads, Engine, GuestAccess, GuestCode};
use crate::host::backing::Backing;
use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
use crate::kvm::memslot_delete::delete_memslot_plan;
use crate::lab::oracle::DirtyLogOracle;
use crate::lab::report::{counter_line, fmt_ts, Meetings, OracleReport, Phase};
use crate::lab::test_vm::{guest_map_bytes, guest_mode, PhaseClock, Setup, TestVm};
use crate::lab::LabError;
use crate::units::{Gfn, GfnRange, PAGE_SIZE};
use crate::vm::munmap::{munmap_plan, HostTlbFlush};
use crate::vm::waiter::SpinWaiter;
use crate::vm::MmuKind;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// kvm_page_table_test's default test memory size (`DEFAULT_TEST_MEM_SIZE`, 1 GiB).
pub const DEFAULT_TEST_MEM_SIZE: u64 = 1 << 30;

/// What the guest writes (the test's constant).
const GUEST_VALUE: u64 = 0x0123_4567_89AB_CDEF;

/// One `page-table` run, as kvm_page_table_test's command line describes it (and seed 002's
/// `--backward-pages`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageTableParams {
    /// `-v`: vCPUs (default 1).
    pub vcpus: usize,
    /// `-b`: the size of the test memory region, shared by every vCPU (default 1G). Aligned up
    /// to the larger of the backing's and the guest's page size, as the test does.
    pub test_mem_bytes: u64,
    /// `-s`: what backs the test memory.
    pub backing: Backing,
    /// Which MMU.
    pub mmu: MmuKind,
    /// `-m` (arm64): the guest mode; `None` on x86.
    pub guest_mode: Option<u32>,
    /// Eager page splitting (x86's module parameter, arm64's capability).
    pub eager_split: bool,
    /// x86 with EPT: KVM uses the CPU's PML (`enable_pml`).
    pub pml: bool,
    /// The host kernel's choices.
    pub kernel: crate::vm::HostKernel,
    /// Shadow paging: the page size the guest maps its memory with.
    pub guest_page_level: crate::x86::spte::Level,
    /// Seed 002's modification: in the adjust stage each new page is followed by reads of up
    /// to this many pages behind it (0: the stock test).
    pub backward_pages: u64,
}

impl Default for PageTableParams {
    fn default() -> Self {
        PageTableParams {
            vcpus: 1,
            test_mem_bytes: DEFAULT_TEST_MEM_SIZE,
            backing: Backing::Anonymous,
            mmu: MmuKind::Tdp,
            guest_mode: None,
            eager_split: true,
            pml: false,
            kernel: Default::default(),
            guest_page_level: crate::x86::spte::PG_LEVEL_2M,
            backward_pages: 0,
        }
    }
}

impl PageTableParams {
    /// The size of the region after the test aligns it up to the larger of the backing's and
    /// the guest's page size (`test_mem_size` in `pre_init_before_test()`).
    pub fn aligned_bytes(&self) -> u64 {
        let guest_page = guest_mode(self.guest_mode).map_or(PAGE_SIZE, |m| {
            guest_map_bytes(&m, self.mmu, self.guest_page_level)
        });
        let alignment = self.backing.page_size().max(guest_page);
        self.test_mem_bytes.div_ceil(alignment) * alignment
    }

    /// Host (4 KiB) pages in the region: the adjust stage reads each.
    pub fn host_pages(&self) -> u64 {
        self.aligned_bytes() / PAGE_SIZE
    }

    /// The VM the test builds: one test memslot, no manual protect.
    pub fn test_vm(&self) -> TestVm {
        TestVm {
            vcpus: self.vcpus,
            bytes: self.aligned_bytes(),
            slots: 1,
            backing: self.backing,
            mmu: self.mmu,
            guest_mode: self.guest_mode,
            eager_split: self.eager_split,
            pml: self.pml,
            kernel: self.kernel,
            manual_protect: false,
            guest_page_level: self.guest_page_level,
            dirty_ring: None,
        }
    }

    /// Checks the parameters, with one-line errors that say what is allowed.
    pub fn validate(&self) -> Result<(), LabError> {
        if self.vcpus == 0 || self.vcpus > crate::lab::params::KVM_MAX_VCPUS {
            return Err(LabError::Invalid(format!(
                "-v {}: the number of vCPUs must be between 1 and {}",
                self.vcpus,
                crate::lab::params::KVM_MAX_VCPUS
            )));
        }
        let is_arm64 = matches!(self.mmu, MmuKind::Stage2 { .. });
        if self.guest_mode.is_some() != is_arm64 {
            return Err(LabError::Invalid(if is_arm64 {
                "an arm64 VM needs a guest mode (-m)".into()
            } else {
                "-m: x86 has one guest mode (PA-bits:ANY, VA-bits:48, 4K pages); -m applies to --arch arm64".into()
            }));
        }
        let mode = guest_mode(self.guest_mode)?;
        if self.test_mem_bytes == 0 {
            return Err(LabError::Invalid(
                "-b 0: the test memory size must be at least one page".into(),
            ));
        }
        if let MmuKind::Stage2 { ia_bits, .. } = self.mmu {
            if ia_bits != mode.pa_bits {
                return Err(LabError::Invalid(format!(
                    "the stage 2's IPA size ({ia_bits} bits) must be the guest mode's ({} bits)",
                    mode.pa_bits
                )));
            }
        }
        let bytes = self.aligned_bytes();
        let room = (1u64 << mode.pa_bits) - mode.page_bytes;
        if bytes + self.backing.page_size().max(mode.page_bytes) > room {
            return Err(LabError::Invalid(format!(
                "-b {}: {} GiB of test memory does not fit guest mode {} ({}-bit guest physical addresses); use a mode with more PA bits or less memory",
                self.test_mem_bytes,
                bytes >> 30,
                mode.mode,
                mode.pa_bits
            )));
        }
        if self.backward_pages >= self.host_pages() {
            return Err(LabError::Invalid(format!(
                "--backward-pages {}: a vCPU walks the {} host pages of the test region, so it can reach at most {} pages behind a page",
                self.backward_pages,
                self.host_pages(),
                self.host_pages() - 1
            )));
        }
        Ok(())
    }
}

/// kvm_page_table_test's `enum test_stage`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TestStage {
    /// The vCPUs start; their guest code does nothing.
    BeforeMappings,
    /// First touch of every large page.
    CreateMappings,
    /// Writes and reads with dirty logging on.
    UpdateMappings,
    /// Reads of every host page with dirty logging off.
    AdjustMappings,
}

impl TestStage {
    /// The stages in the order the host publishes them.
    pub const ALL: [TestStage; 4] = [
        TestStage::BeforeMappings,
        TestStage::CreateMappings,
        TestStage::UpdateMappings,
        TestStage::AdjustMappings,
    ];

    /// `test_stage_string[]`.
    pub fn name(self) -> &'static str {
        match self {
            TestStage::BeforeMappings => "KVM_BEFORE_MAPPINGS",
            TestStage::CreateMappings => "KVM_CREATE_MAPPINGS",
            TestStage::UpdateMappings => "KVM_UPDATE_MAPPINGS",
            TestStage::AdjustMappings => "KVM_ADJUST_MAPPINGS",
        }
    }
}

/// One vCPU's `guest_code()`: the accesses of the stage the host published.
struct PageTableGuest {
    /// `!(vcpu->id % 2)`: this vCPU writes in the create stage.
    do_write: bool,
    base_gfn: u64,
    host_pages: u64,
    /// Host pages per large page (`host_pages_per_lpage`).
    lpage_pages: u64,
    /// `src_type == VM_MEM_SRC_ANONYMOUS`: the update stage writes every page.
    anonymous: bool,
    backward_pages: u64,
    stage: TestStage,
    /// The loop's index (`i`) and the inner position (`j`) of the stage in progress.
    i: u64,
    j: u64,
    oracle: Arc<DirtyLogOracle>,
    write_seq: u32,
}

impl PageTableGuest {
    /// vCPU `vcpu`'s guest over the region of `p` starting at `base_gfn`, before any stage.
    fn new(p: &PageTableParams, vcpu: usize, base_gfn: u64, oracle: Arc<DirtyLogOracle>) -> Self {
        PageTableGuest {
            do_write: vcpu.is_multiple_of(2),
            base_gfn,
            host_pages: p.host_pages(),
            lpage_pages: p.backing.page_size() / PAGE_SIZE,
            anonymous: p.backing == Backing::Anonymous,
            backward_pages: p.backward_pages,
            stage: TestStage::BeforeMappings,
            i: 0,
            j: 0,
            oracle,
            write_seq: 0,
        }
    }

    /// The next (page index in the region, write?) of the stage, advancing the loops.
    #[inline]
    fn next_page(&mut self) -> Option<(u64, bool)> {
        match self.stage {
            TestStage::BeforeMappings => None,
            TestStage::CreateMappings => {
                let lpages = self.host_pages / self.lpage_pages;
                (self.i < lpages).then(|| {
                    self.i += 1;
                    ((self.i - 1) * self.lpage_pages, self.do_write)
                })
            }
            TestStage::UpdateMappings if self.anonymous => (self.i < self.host_pages).then(|| {
                self.i += 1;
                (self.i - 1, true)
            }),
            TestStage::UpdateMappings => {
                let lpages = self.host_pages / self.lpage_pages;
                if self.i == lpages {
                    return None;
                }
                let first = self.i * self.lpage_pages;
                let half = self.lpage_pages / 2;
                let out = if self.j == 0 {
                    // Break the block: a write to the large page's first host page.
                    (first, true)
                } else {
                    // Map the second half at the smallest granularity: reads.
                    (first + half + self.j - 1, false)
                };
                if self.j == half {
                    self.i += 1;
                    self.j = 0;
                } else {
                    self.j += 1;
                }
                Some(out)
            }
            TestStage::AdjustMappings => {
                if self.i == self.host_pages {
                    return None;
                }
                // The new page (j = 0), then up to `backward_pages` pages behind it.
                let out = (self.i - self.j, false);
                if self.j == self.backward_pages.min(self.i) {
                    self.i += 1;
                    self.j = 0;
                } else {
                    self.j += 1;
                }
                Some(out)
            }
        }
    }
}

#[cfg(test)]
impl PageTableGuest {
    /// A copy of where the guest is in its stage (tests).
    fn clone_position(&self) -> PageTableGuest {
        PageTableGuest {
            oracle: self.oracle.clone(),
            ..*self
        }
    }
}

impl GuestCode for PageTableGuest {
    fn start_pass(&mut self, iteration: i64) {
        self.stage = TestStage::ALL[iteration as usize];
        self.i = 0;
        self.j = 0;
    }

    #[inline]
    fn next_access(&mut self) -> Option<GuestAccess> {
        let (page, write) = self.next_page()?;
        if write {
            self.write_seq = self.oracle.before_write();
        }
        Some(GuestAccess::first_word(
            Gfn(self.base_gfn + page),
            write,
            GUEST_VALUE,
        ))
    }

    #[inline]
    fn access_done(&mut self, access: &GuestAccess) {
        if access.write {
            self.oracle.after_write(access.gfn.0, self.write_seq);
        }
    }

    /// The adjust stage only reads, every vCPU the same pages: from the next access on, pages
    /// from the lowest one the current page's backward reads reach to the region's end.
    fn shared_reads(&self) -> Option<GfnRange> {
        (self.stage == TestStage::AdjustMappings).then(|| {
            let end = self.base_gfn + self.host_pages;
            let low = self.base_gfn + self.i - self.backward_pages.min(self.i);
            GfnRange {
                start: Gfn(low.min(end)),
                end: Gfn(end),
            }
        })
    }

    /// In the adjust stage, between a page's first read and the next page: its backward reads
    /// left, down to `min(N, i)` pages behind it.
    fn descending_reads(&self) -> Option<DescendingReads> {
        (self.stage == TestStage::AdjustMappings && self.i < self.host_pages && self.j > 0).then(
            || DescendingReads {
                first: Gfn(self.base_gfn + self.i - self.j),
                len: self.backward_pages.min(self.i) + 1 - self.j,
            },
        )
    }

    /// As [`PageTableGuest::next_page`] would advance over `n` of the reads above (reads need
    /// no `access_done`).
    fn skip_accesses(&mut self, n: u64) {
        let run = self.descending_reads().map_or(0, |r| r.len);
        assert!(n <= run, "{n} reads skipped of a run of {run}");
        if n == run && n > 0 {
            self.i += 1;
            self.j = 0;
        } else {
            self.j += n;
        }
    }

    /// In the adjust stage a page above every page read so far comes only after the backward
    /// reads of every page below it: at least `1 + min(N, i)` accesses for each page `i`
    /// between.
    fn accesses_before(&self, end: Gfn) -> u64 {
        if self.stage != TestStage::AdjustMappings || self.i == self.host_pages {
            return 0;
        }
        let e = end.0.saturating_sub(self.base_gfn);
        let group = |page: u64| 1 + self.backward_pages.min(page);
        // The page of the next access: the new page, or the next one behind it.
        if self.i - self.j >= e {
            return 0;
        }
        let left = group(self.i) - self.j;
        if e <= self.i {
            return left;
        }
        left + (e - 1 - self.i) * group(self.i + 1)
    }
}

/// One timed stage of the run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageReport {
    /// The test's name for it (`KVM_CREATE_MAPPINGS`).
    pub stage: String,
    /// Its time and counters.
    pub phase: Phase,
}

/// The whole `page-table` run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PageTableReport {
    /// Which engine drove the model.
    pub engine: String,
    /// Which MMU flavour.
    pub mmu: String,
    /// The parameters.
    pub params: PageTableParams,
    /// The guest physical test memory range `[start, end)`.
    pub test_memory: (u64, u64),
    /// The timed stages: create, update, adjust, then the memslot deletion (`KVM_UNMAP_VM`).
    pub stages: Vec<StageReport>,
    /// Setting and clearing `KVM_MEM_LOG_DIRTY_PAGES` (between stages; the test does not time
    /// them).
    pub enable: Phase,
    /// See `enable`.
    pub disable: Phase,
    /// The oracles' verdict.
    pub oracle: OracleReport,
}

impl PageTableReport {
    /// The time of stage `name`, if the run has it.
    pub fn stage_ns(&self, name: &str) -> Option<u64> {
        self.stages
            .iter()
            .find(|s| s.stage == name)
            .map(|s| s.phase.wall_ns)
    }

    /// The run in kvm_page_table_test's text format (its `pr_info` lines), followed by each
    /// stage's counters on indented lines.
    pub fn to_selftest_text(&self, with_counters: bool) -> String {
        let mut s = header_text(&self.params, self.test_memory);
        for st in &self.stages {
            s.push_str(&st.selftest_text(with_counters));
        }
        if let Some(line) = self.met_line() {
            let _ = writeln!(s, "{line}");
        }
        s
    }

    /// The line saying how often the vCPUs met on a page over the stages ([`Meetings`]).
    pub fn met_line(&self) -> Option<String> {
        let mut m = Meetings::default();
        for st in &self.stages {
            m.add(&st.phase);
        }
        m.line()
    }
}

/// kvm_page_table_test's lines before its first stage, for `p` with its test memory at
/// `test_memory`.
pub fn header_text(p: &PageTableParams, test_memory: (u64, u64)) -> String {
    let mut s = String::new();
    let mode = match p.guest_mode {
        Some(_) => guest_mode(p.guest_mode)
            .map(|m| m.name())
            .unwrap_or_default(),
        None => "PA-bits:ANY, VA-bits:48,  4K pages".into(),
    };
    let _ = writeln!(s, "Testing guest mode: {mode}");
    let _ = writeln!(s, "Testing memory backing src type: {}", p.backing);
    let _ = writeln!(
        s,
        "Testing memory backing src granularity: {:#x}",
        p.backing.page_size()
    );
    let _ = writeln!(s, "Testing memory size(aligned): {:#x}", p.aligned_bytes());
    let _ = writeln!(s, "Guest physical test memory offset: {:#x}", test_memory.0);
    let _ = writeln!(s, "Number of testing vCPUs: {}", p.vcpus);
    if p.backward_pages > 0 {
        let _ = writeln!(
            s,
            "Adjust stage: each page is followed by up to {} pages behind it",
            p.backward_pages
        );
    }
    let _ = writeln!(s, "Started all vCPUs successfully");
    s
}

impl StageReport {
    /// The stage's line (and its counters' line when asked), then the empty line the test
    /// ends each stage with.
    pub fn selftest_text(&self, with_counters: bool) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{}: total execution time: {}",
            self.stage,
            fmt_ts(self.phase.wall_ns)
        );
        if let (true, Some(line)) = (with_counters, counter_line(&self.stage, &self.phase)) {
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s);
        s
    }
}

/// The name of the memslot deletions' line, the first part of [`UNMAP_VM`].
pub const UNMAP_VM_DELETE_MEMSLOT: &str = "KVM_UNMAP_VM_DELETE_MEMSLOT";

/// The name of the backing's `munmap()`s' line, the second part of [`UNMAP_VM`].
pub const UNMAP_VM_MUNMAP: &str = "KVM_UNMAP_VM_MUNMAP";

/// The name of the VM teardown's line (seed 002's "Unmap VM"): the memslot deletions and the
/// `munmap()`s of `kvm_vm_free()`, together.
pub const UNMAP_VM: &str = "KVM_UNMAP_VM";

/// The guests of every vCPU of `setup`'s VM.
fn guests(setup: &Setup, p: &PageTableParams) -> Vec<PageTableGuest> {
    (0..p.vcpus)
        .map(|i| PageTableGuest::new(p, i, setup.base_gfn, Arc::clone(&setup.oracle)))
        .collect()
}

/// What a streaming caller of the `page-table` scenario hears.
#[derive(Copy, Clone, Debug)]
pub enum StageEvent<'a> {
    /// The vCPUs started: the test's header lines can be printed.
    Started {
        /// The run's parameters.
        params: &'a PageTableParams,
        /// The guest physical test memory range.
        test_memory: (u64, u64),
    },
    /// A timed stage ended.
    Stage(&'a StageReport),
}

/// `run_test()` on `engine` over `setup`'s VM, telling `sink` of the start and of each stage as
/// it ends.
fn run_page_table<E: Engine>(
    p: &PageTableParams,
    setup: &Setup,
    engine: &mut E,
    progress: bool,
    sink: &mut dyn FnMut(StageEvent<'_>),
) -> Result<PageTableReport, LabError> {
    let vm = &setup.vm;
    let say = |what: &str| {
        if progress {
            eprintln!("vmmu: {what}");
        }
    };
    let mut clock = PhaseClock::default();
    let mut lap = |engine: &E, wall_ns: u64| Phase {
        wall_ns,
        counters: Some(clock.lap(vm, &engine.vcpu_meters())),
    };
    let mut invariant_errors = Vec::new();
    let mut stages = Vec::new();
    let mut oracle = OracleReport::default();

    engine.run_pass(0)?;
    lap(engine, 0);
    sink(StageEvent::Started {
        params: p,
        test_memory: (setup.gpa, setup.gpa + p.aligned_bytes()),
    });
    let mut enable = Phase::default();
    let mut disable = Phase::default();
    for (n, stage) in TestStage::ALL.iter().enumerate().skip(1) {
        match stage {
            TestStage::UpdateMappings => {
                let ns = engine.run_plans(setup.flags_plans(KVM_MEM_LOG_DIRTY_PAGES))?;
                setup.oracle.logging_enabled();
                enable = lap(engine, ns);
            }
            TestStage::AdjustMappings => {
                // The update stage's writes are all in the bitmap, before disabling clears it.
                let k = setup.oracle.begin_harvest();
                for s in &setup.slots {
                    let words: Vec<u64> = (0..s.bitmap_words())
                        .map(|i| s.bitmap_word(i).load(Ordering::Relaxed))
                        .collect();
                    setup.oracle.record_report(k, s.base_gfn.0, &words);
                }
                let check = setup.oracle.end_harvest(k);
                oracle.harvests_checked += 1;
                oracle.pages_checked += check.checked;
                oracle.lost_pages += check.lost.len() as u64;
                oracle.lost_gfns.extend(check.lost.into_iter().take(16));
                let ns = engine.run_plans(setup.flags_plans(0))?;
                disable = lap(engine, ns);
            }
            _ => {}
        }
        say(stage.name());
        let ns = engine.run_pass(n as i64)?;
        stages.push(StageReport {
            stage: stage.name().into(),
            phase: lap(engine, ns),
        });
        sink(StageEvent::Stage(stages.last().expect("just pushed")));
        invariant_errors.extend(vm.check_invariants());
    }
    // host_quit: the vCPUs leave KVM_RUN; then kvm_vm_free() deletes each memslot and unmaps
    // its backing (__vm_mem_region_delete()).
    engine.stop_vcpus()?;
    say("unmapping the VM");
    let plans = setup
        .slots
        .iter()
        .map(|s| delete_memslot_plan(&vm.mmu, s))
        .collect();
    let ns = engine.run_plans(plans)?;
    let deletion = lap(engine, ns);
    let flush = match p.mmu {
        MmuKind::Stage2 { .. } => HostTlbFlush::Broadcast,
        _ => HostTlbFlush::Local,
    };
    let plans = setup.slots.iter().map(|s| munmap_plan(s, flush)).collect();
    let ns = engine.run_plans(plans)?;
    let munmap = lap(engine, ns);
    let total = deletion.then(&munmap);
    for (stage, phase) in [
        (UNMAP_VM_DELETE_MEMSLOT, deletion),
        (UNMAP_VM_MUNMAP, munmap),
        (UNMAP_VM, total),
    ] {
        stages.push(StageReport {
            stage: stage.into(),
            phase,
        });
        sink(StageEvent::Stage(stages.last().expect("just pushed")));
    }
    invariant_errors.extend(vm.check_invariants());
    oracle.invariant_errors = invariant_errors;
    Ok(PageTableReport {
        engine: engine.name().into(),
        mmu: vm.mmu.name().into(),
        params: p.clone(),
        test_memory: (setup.gpa, setup.gpa + p.aligned_bytes()),
        stages,
        enable,
        disable,
        oracle,
    })
}

/// Runs kvm_page_table_test on the threads engine. `progress` prints stage names to stderr;
/// `sink` hears of each stage as it ends.
pub fn run_page_table_threads(
    p: &PageTableParams,
    progress: bool,
    sink: &mut dyn FnMut(StageEvent<'_>),
) -> Result<PageTableReport, LabError> {
    p.validate()?;
    let setup = Setup::new(&p.test_vm(), Box::new(SpinWaiter))?;
    let mut engine = Threads::new(Arc::clone(&setup.vm), guests(&setup, p));
    run_page_table(p, &setup, &mut engine, progress, sink)
}

/// Runs kvm_page_table_test in virtual time, priced with `cost`.
pub fn run_page_table_virtual(
    p: &PageTableParams,
    cost: &CostModel,
    progress: bool,
    sink: &mut dyn FnMut(StageEvent<'_>),
) -> Result<PageTableReport, LabError> {
    let fast_forward = crate::engine::virtual_time::scheduler::fast_forward_default();
    run_virtual_with(p, cost, fast_forward, |g| g, progress, sink)
}

/// [`run_page_table_virtual`] with fast-forward `on` or off, each vCPU's guest made by `guest`
/// from the test's.
fn run_virtual_with<G: GuestCode>(
    p: &PageTableParams,
    cost: &CostModel,
    fast_forward: bool,
    guest: impl FnMut(PageTableGuest) -> G,
    progress: bool,
    sink: &mut dyn FnMut(StageEvent<'_>),
) -> Result<PageTableReport, LabError> {
    p.validate()?;
    crate::engine::virtual_time::check_cost_model(cost)?;
    let setup = Setup::new(&p.test_vm(), Box::new(VirtualWaiter))?;
    let guests = guests(&setup, p).into_iter().map(guest).collect();
    // The vCPU threads sleep on the test's semaphore between stages.
    let mut engine = VirtualTime::new(&setup.vm, cost, guests)?
        .with_pass_start(crate::engine::virtual_time::drift::PassStart::Semaphore)
        .with_fast_forward(fast_forward);
    run_page_table(p, &setup, &mut engine, progress, sink)
}

/// Seed 002's table: a row per memory size, and for each of `metrics` (stage names) a column
/// per side. `runs[row][side]`.
pub fn seed_table(
    sides: &[String],
    metrics: &[&str],
    runs: &[(u64, Vec<PageTableReport>)],
) -> String {
    let mut s = String::new();
    let mut head = format!("| {:>6} |", "mem_sz");
    let mut rule = format!("|{}|", "-".repeat(8));
    for m in metrics {
        for side in sides {
            let name = format!("{m} ({side})");
            let _ = write!(head, " {name:>w$} |", w = name.len().max(12));
            let _ = write!(rule, "{}|", "-".repeat(name.len().max(12) + 2));
        }
    }
    let _ = writeln!(s, "{head}\n{rule}");
    for (bytes, reports) in runs {
        let size = if bytes % (1 << 30) == 0 {
            format!("{}G", bytes >> 30)
        } else {
            format!("{}M", bytes >> 20)
        };
        let mut line = format!("| {size:>6} |");
        for m in metrics {
            for (side, r) in sides.iter().zip(reports) {
                let w = format!("{m} ({side})").len().max(12);
                let v = r
                    .stage_ns(m)
                    .map_or("-".to_string(), |ns| format!("{:.6}", ns as f64 / 1e9));
                let _ = write!(line, " {v:>w$} |");
            }
        }
        let _ = writeln!(s, "{line}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guest(p: &PageTableParams, vcpu: usize, stage: TestStage) -> Vec<(u64, bool)> {
        let oracle = Arc::new(DirtyLogOracle::new(0, p.host_pages()));
        let mut g = PageTableGuest::new(p, vcpu, 0, oracle);
        g.stage = stage;
        std::iter::from_fn(|| g.next_page()).collect()
    }

    #[test]
    fn the_stages_touch_what_the_selftest_touches() {
        let p = PageTableParams {
            test_mem_bytes: 4 << 20,
            backing: Backing::AnonymousHugetlb2mb,
            ..Default::default()
        };
        // Create: the first word of each large page; vCPU 0 writes, vCPU 1 reads.
        assert_eq!(
            guest(&p, 0, TestStage::CreateMappings),
            vec![(0, true), (512, true)]
        );
        assert_eq!(
            guest(&p, 1, TestStage::CreateMappings),
            vec![(0, false), (512, false)]
        );
        // Update: per large page, a write to its first page, then reads of its second half.
        let u = guest(&p, 1, TestStage::UpdateMappings);
        assert_eq!(u.len(), 2 * (1 + 256));
        assert_eq!(&u[..3], &[(0, true), (256, false), (257, false)]);
        assert_eq!(u[256], (511, false));
        assert_eq!(u[257], (512, true));
        // Adjust: every host page, read.
        let a = guest(&p, 0, TestStage::AdjustMappings);
        assert_eq!(a, (0..1024).map(|i| (i, false)).collect::<Vec<_>>());
        // Anonymous memory: the update stage writes every page.
        let anon = PageTableParams {
            test_mem_bytes: 64 << 10,
            ..Default::default()
        };
        assert_eq!(
            guest(&anon, 1, TestStage::UpdateMappings),
            (0..16).map(|i| (i, true)).collect::<Vec<_>>()
        );
    }

    #[test]
    fn backward_pages_reach_up_to_n_pages_behind_each_new_page() {
        let p = PageTableParams {
            test_mem_bytes: 16 << 12,
            backward_pages: 2,
            ..Default::default()
        };
        let a: Vec<u64> = guest(&p, 0, TestStage::AdjustMappings)
            .into_iter()
            .map(|(pg, w)| {
                assert!(!w);
                pg
            })
            .collect();
        assert_eq!(&a[..9], &[0, 1, 0, 2, 1, 0, 3, 2, 1]);
        assert_eq!(a.len(), 1 + 2 + 3 * 14);
    }

    /// 40 pages, 5 backward pages, and vCPU 0's guest at the start of its adjust stage.
    fn adjust_stage_guest() -> (PageTableParams, PageTableGuest) {
        let p = PageTableParams {
            test_mem_bytes: 40 << 12,
            backward_pages: 5,
            ..Default::default()
        };
        let oracle = Arc::new(DirtyLogOracle::new(0, p.host_pages()));
        let mut g = PageTableGuest::new(&p, 0, 0, oracle);
        let adjust = TestStage::ALL
            .iter()
            .position(|s| *s == TestStage::AdjustMappings)
            .expect("a stage");
        g.start_pass(adjust as i64);
        (p, g)
    }

    /// In the adjust stage, before every access: the promised range holds every later access,
    /// and the bound on the accesses before a page never exceeds the count the guest makes.
    #[test]
    fn the_adjust_stages_promise_and_bound_hold() {
        let (p, mut g) = adjust_stage_guest();
        let pages = guest(&p, 0, TestStage::AdjustMappings);
        for (n, _) in pages.iter().enumerate() {
            let range = g.shared_reads().unwrap();
            assert!(pages[n..]
                .iter()
                .all(|&(pg, _)| range.start.0 <= pg && pg < range.end.0));
            for e in 0..=p.host_pages() + 1 {
                let made = pages[n..].iter().position(|&(pg, _)| pg >= e);
                let bound = g.accesses_before(Gfn(e));
                assert!(
                    made.is_none_or(|m| bound <= m as u64),
                    "access {n}, page {e}: bound {bound}, made {made:?}"
                );
                // Tight across a page's backward reads.
                if e == g.i + 1 && g.i + 1 < p.host_pages() {
                    assert_eq!(Some(bound as usize), made);
                }
            }
            g.next_page();
        }
        assert_eq!(g.next_page(), None);
    }

    /// At every position of the adjust stage, the run of reads the guest announces is its next
    /// accesses (first-word reads, down a page at a time, the whole rest of the page's
    /// backward reads), and skipping any number of them leaves it where that many accesses
    /// would.
    #[test]
    fn the_adjust_stages_announced_reads_are_its_next_accesses() {
        let (_, mut g) = adjust_stage_guest();
        let mut runs = 0;
        loop {
            if let Some(run) = g.descending_reads() {
                runs += 1;
                for skip in 0..=run.len {
                    let (mut stepped, mut skipped) = (g.clone_position(), g.clone_position());
                    for k in 0..skip {
                        let a = stepped.next_access().unwrap();
                        assert_eq!((a.gfn, a.write, a.word), (Gfn(run.first.0 - k), false, 0));
                    }
                    skipped.skip_accesses(skip);
                    assert_eq!(
                        (skipped.i, skipped.j),
                        (stepped.i, stepped.j),
                        "{run:?} {skip}"
                    );
                }
                // The run is all of the page's backward reads left: the next access is a new page.
                let mut after = g.clone_position();
                after.skip_accesses(run.len);
                assert_eq!(after.j, 0);
            }
            if g.next_access().is_none() {
                break;
            }
        }
        assert!(runs > 100, "{runs} runs");
    }

    /// Says it reaches a page later than it does: the negative control of the window bound.
    struct Late(PageTableGuest);

    impl GuestCode for Late {
        fn start_pass(&mut self, i: i64) {
            self.0.start_pass(i)
        }
        fn next_access(&mut self) -> Option<GuestAccess> {
            self.0.next_access()
        }
        fn access_done(&mut self, a: &GuestAccess) {
            self.0.access_done(a)
        }
        fn shared_reads(&self) -> Option<GfnRange> {
            self.0.shared_reads()
        }
        fn accesses_before(&self, end: Gfn) -> u64 {
            self.0.accesses_before(end).saturating_mul(1000)
        }
        fn descending_reads(&self) -> Option<DescendingReads> {
            self.0.descending_reads()
        }
        fn skip_accesses(&mut self, n: u64) {
            self.0.skip_accesses(n)
        }
    }

    /// Backward reads of shared pages run out of turn, within windows below the next page a
    /// fault maps, with the results of stepping in turn; with a bound that says the leading
    /// vCPU reaches that page later than it does, the others run past its fault, which
    /// collapses a block they read through, and the results change.
    #[test]
    fn backward_reads_run_out_of_turn_up_to_the_next_fault() {
        let p = PageTableParams {
            vcpus: 4,
            test_mem_bytes: 8 << 20,
            backing: Backing::AnonymousHugetlb2mb,
            mmu: MmuKind::Stage2 {
                lock: crate::arm64::Arm64Lock::Parallel,
                ia_bits: 48,
                split_chunk_pages: 0,
                cpu: Default::default(),
                relax_flush: Default::default(),
            },
            guest_mode: Some(2),
            eager_split: false,
            backward_pages: 64,
            ..Default::default()
        };
        let cost = CostModel::default_arm64();
        let run = |ff: bool, late: bool| {
            let json = |r: PageTableReport| serde_json::to_string(&r).unwrap();
            if late {
                json(run_virtual_with(&p, &cost, ff, Late, false, &mut |_| {}).unwrap())
            } else {
                json(run_virtual_with(&p, &cost, ff, |g| g, false, &mut |_| {}).unwrap())
            }
        };
        let off = run(false, false);
        assert_eq!(run(true, false), off);
        assert_ne!(run(true, true), off);
    }

    #[test]
    fn the_size_is_aligned_up_and_bad_values_are_refused() {
        let p = PageTableParams {
            test_mem_bytes: 3 << 20,
            backing: Backing::AnonymousHugetlb2mb,
            ..Default::default()
        };
        assert_eq!(p.aligned_bytes(), 4 << 20);
        let e = PageTableParams {
            backward_pages: 1024,
            test_mem_bytes: 4 << 20,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("at most 1023"), "{e}");
        assert!(PageTableParams {
            vcpus: 0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
