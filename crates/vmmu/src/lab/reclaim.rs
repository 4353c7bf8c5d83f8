//! `vmmu reclaim`: KVM's max_guest_memory_test on a host that runs out of memory, seed 003's
//! benchmark. The VMM maps one memfd of `-s` GiB into every memslot from 4 GiB up (as many as
//! `-m` GiB needs, all aliasing the memfd) and prefaults it; each of `-c` vCPUs writes one word
//! to every page of its share of guest memory (run 1), the vCPUs' MMU context is reset, and they
//! do it again (run 2). With host memory (`--host-memory`) at or below the memfd's size,
//! kswapd ([`Kswapd`]) reclaims beside them the whole time: it ages KVM's Accessed bits through
//! the MMU notifier and swaps pages out; the vCPUs fault them back in.
//!
//! The report is the selftest's lines and times, kswapd's time by kernel function in the
//! layout of the seed's profile, the vCPUs' `mmu_lock` waits, swap traffic and the notifier's
//! work. The oracles: every page holds the value run 2 wrote to it (swap-out and swap-in lose
//! nothing, and no write went through a translation the swap-out removed), the page-table
//! invariants hold, and after the VMM unmaps half the memfd KVM maps none of it.
//!
//! Departures from the selftest, each harmless to what it measures: the guest writes its
//! page's GPA tagged with the run number in bits 56+ (the selftest writes the bare GPA both
//! times, which would hide a lost write of run 2); the reset does no MMU work (Linux 6.4+
//! keeps the roots when only CR0.WP changes under TDP; 6.2 dropped and zapped them).

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{Engine, GuestAccess, GuestCode, HostThread};
use crate::host::backing::Backing;
use crate::host::lru::{HostMm, LruPolicy, VmStat};
use crate::kvm::meter::{Meter, METER_FIELDS};
use crate::kvm::mmu_lock::{Held, Write};
use crate::kvm::mmu_notifier::{invalidate_range_end, invalidate_range_start, Aging, NotifierJob};
use crate::kvm::op_plan::{OpPlan, OpStep};
use crate::kvm::Kvm;
use crate::lab::compare::SideBySide;
use crate::lab::report::fmt_ts;
use crate::lab::LabError;
use crate::units::{Gfn, PAGE_SIZE};
use crate::vm::kswapd::{Func, Kswapd, Parent, ProfileRow};
use crate::vm::waiter::SpinWaiter;
use crate::vm::{MmuKind, Vm, VmConfig};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

/// One GiB.
const GIB: u64 = 1 << 30;
/// Guest memory starts at 4 GiB (the selftest skips slot 0 and the APIC's internal slot).
pub const START_GPA: u64 = 4 * GIB;
/// The selftest's first test memslot.
const FIRST_SLOT: u32 = 1;
/// Bit where the run number tags the value a guest writes.
const RUN_TAG_SHIFT: u32 = 56;
/// The least host memory a run accepts: kswapd needs room above its watermarks for the vCPUs'
/// faults and its own batches.
pub const MIN_HOST_MEMORY: u64 = 16 << 20;
/// KVM's memslot limit on x86 (`KVM_USER_MEM_SLOTS`).
const MAX_SLOTS: u64 = 32_764;

/// What a run models.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ReclaimParams {
    /// vCPUs (`-c`).
    pub vcpus: usize,
    /// Guest memory in bytes (`-m`, GiB in the selftest).
    pub max_mem: u64,
    /// Memslot size in bytes (`-s`, GiB in the selftest): the memfd's size too.
    pub slot_size: u64,
    /// The host's memory in bytes.
    pub host_memory: u64,
    /// The host's reclaim policy.
    pub lru: LruPolicy,
    /// How KVM's aging callbacks take `mmu_lock` (with MGLRU, lockless also means the seed's
    /// batched `test_clear_young()` in look-around and the aging walk).
    pub aging: Aging,
    /// The MMU.
    #[serde(skip)]
    pub mmu: MmuKind,
    /// The negative control: kswapd swaps pages out without the MMU notifier's invalidation,
    /// so KVM keeps stale translations. Never set in a real run.
    #[serde(skip)]
    pub skip_invalidate_for_negative_control: bool,
}

impl Default for ReclaimParams {
    fn default() -> Self {
        ReclaimParams {
            vcpus: 8,
            max_mem: 8 * GIB,
            slot_size: 8 * GIB,
            host_memory: 6 * GIB,
            lru: LruPolicy::Mglru,
            aging: Aging::Locked,
            mmu: MmuKind::Tdp,
            skip_invalidate_for_negative_control: false,
        }
    }
}

impl ReclaimParams {
    /// Memslots the selftest creates: as many as `-m` needs, each `-s` GiB.
    pub fn nr_slots(&self) -> u64 {
        self.max_mem.div_ceil(self.slot_size).min(MAX_SLOTS)
    }

    /// Guest memory the vCPUs write, in bytes (whole slots, as the selftest counts it).
    pub fn guest_bytes(&self) -> u64 {
        self.nr_slots() * self.slot_size
    }

    /// Pages in the memfd.
    pub fn memfd_pages(&self) -> u64 {
        self.slot_size / PAGE_SIZE
    }

    /// Checks the parameters; one line saying what is wrong and what is allowed.
    pub fn validate(&self) -> Result<(), LabError> {
        if self.vcpus == 0 || self.vcpus > 1024 {
            return Err(LabError::Invalid(format!(
                "-c {}: the vCPU count must be 1 to 1024",
                self.vcpus
            )));
        }
        if self.max_mem == 0 || self.slot_size == 0 {
            return Err(LabError::Invalid(
                "-m and -s must be at least 1 (GiB)".into(),
            ));
        }
        if !self.slot_size.is_multiple_of(2 << 20) || !self.max_mem.is_multiple_of(2 << 20) {
            return Err(LabError::Invalid(
                "-m and -s must be multiples of 2 MiB".into(),
            ));
        }
        if self.slot_size > self.max_mem {
            return Err(LabError::Invalid(format!(
                "-s {} MiB is larger than -m {} MiB: a memslot cannot be larger than guest memory",
                self.slot_size >> 20,
                self.max_mem >> 20
            )));
        }
        if self.max_mem > 16384 * GIB {
            return Err(LabError::Invalid(format!(
                "-m {} GiB: guest memory is limited to 16384 GiB",
                self.max_mem >> 30
            )));
        }
        let pages_per_vcpu = self.guest_bytes() / PAGE_SIZE / self.vcpus as u64;
        if pages_per_vcpu == 0 {
            return Err(LabError::Invalid(format!(
                "-c {} vCPUs for {} pages of guest memory: each vCPU needs at least one page",
                self.vcpus,
                self.guest_bytes() / PAGE_SIZE
            )));
        }
        if self.host_memory < MIN_HOST_MEMORY {
            return Err(LabError::Invalid(format!(
                "--host-memory {} MiB: at least {} MiB, so kswapd has room above its watermarks",
                self.host_memory >> 20,
                MIN_HOST_MEMORY >> 20
            )));
        }
        if !self.host_memory.is_multiple_of(PAGE_SIZE) {
            return Err(LabError::Invalid(
                "--host-memory must be a multiple of 4 KiB".into(),
            ));
        }
        if self.host_memory >> 12 >= 1 << 40 {
            return Err(LabError::Invalid(format!(
                "--host-memory {} GiB: the model counts host pages in 40 bits (up to 4096 TiB)",
                self.host_memory >> 30
            )));
        }
        if matches!(self.mmu, MmuKind::Shadow { ept: false }) {
            return Err(LabError::Invalid("reclaim runs with EPT (--mmu tdp or shadow with EPT): the guest's 1 GiB identity map is not modelled under shadow paging".into()));
        }
        check_model_memory(self)
    }
}

/// Refuses a run whose model this machine cannot hold (one line), before allocating anything:
/// the memfd's frames, swap slots and LRU state, KVM's page tables for every guest page.
fn check_model_memory(p: &ReclaimParams) -> Result<(), LabError> {
    use crate::lab::test_vm::{MODEL_BASE_BYTES, MODEL_BYTES_PER_GUEST_PAGE};
    let guest_pages = p.guest_bytes() / PAGE_SIZE;
    // Per memfd page: its word, its swap slot, its flags, its place in an LRU list.
    let needed = MODEL_BASE_BYTES
        + guest_pages * MODEL_BYTES_PER_GUEST_PAGE
        + p.memfd_pages() * (8 + 8 + 1 + 4)
        + p.vcpus as u64 * (300 << 10);
    match crate::host::memory::mem_available_bytes() {
        Some(avail) if needed > avail => Err(LabError::Invalid(format!(
            "modelling {} GiB of guest memory needs about {} MiB of this machine's memory but only {} MiB is available (MemAvailable): use less guest memory (-m, -s)",
            p.guest_bytes() >> 30,
            needed >> 20,
            avail >> 20
        ))),
        _ => Ok(()),
    }
}

/// The value run `run` writes to the page at `gpa`.
pub fn written_value(gpa: u64, run: i64) -> u64 {
    gpa | (run as u64) << RUN_TAG_SHIFT
}

/// A vCPU's guest code: write every page of `[start, end)` once per pass.
struct MaxMemGuest {
    start: Gfn,
    end: Gfn,
    next: u64,
    run: i64,
}

impl GuestCode for MaxMemGuest {
    fn start_pass(&mut self, iteration: i64) {
        self.next = self.start.0;
        self.run = iteration;
    }

    fn next_access(&mut self) -> Option<GuestAccess> {
        if self.run == 0 || self.next >= self.end.0 {
            return None;
        }
        let gfn = Gfn(self.next);
        self.next += 1;
        Some(GuestAccess::first_word(
            gfn,
            true,
            written_value(gfn.0 * PAGE_SIZE, self.run),
        ))
    }

    fn access_done(&mut self, _: &GuestAccess) {}
}

/// kswapd's time in one row of the seed's profile.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ProfileLine {
    /// Depth in the call tree (0: `balance_pgdat`).
    pub depth: usize,
    /// The kernel function.
    pub function: String,
    /// Percent of kswapd's time.
    pub percent: f64,
    /// Nanoseconds.
    pub ns: u64,
}

/// What the oracles found.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReclaimOracle {
    /// Guest pages whose content was checked.
    pub pages_checked: u64,
    /// Pages that did not hold what run 2 wrote (a lost write).
    pub lost_writes: u64,
    /// Guest pages no vCPU writes (`spawn_workers()` leaves the remainder of memory divided by
    /// vCPUs), checked to hold no guest write.
    #[serde(skip_serializing_if = "is_zero")]
    pub unwritten_pages: u64,
    /// Of those, pages that hold a guest write all the same (a write that went astray).
    #[serde(skip_serializing_if = "is_zero")]
    pub stray_writes: u64,
    /// The first few lost pages, as guest frame numbers.
    pub lost_gfns: Vec<u64>,
    /// Page-table invariant violations.
    pub invariant_errors: Vec<String>,
    /// Guest pages KVM still mapped after the VMM unmapped their half of the memfd.
    pub mapped_after_munmap: u64,
    /// Guest pages KVM mapped at the end of the runs whose host page was not resident (a
    /// translation the swap-out should have removed).
    pub stale_translations: u64,
}

/// For `skip_serializing_if`: a count that is zero is left out.
fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ReclaimOracle {
    /// The counts of several runs' oracles (their first lost pages left out).
    pub fn total<'a>(all: impl IntoIterator<Item = &'a ReclaimOracle>) -> ReclaimOracle {
        let mut t = ReclaimOracle::default();
        for o in all {
            t.pages_checked += o.pages_checked;
            t.lost_writes += o.lost_writes;
            t.unwritten_pages += o.unwritten_pages;
            t.stray_writes += o.stray_writes;
            t.mapped_after_munmap += o.mapped_after_munmap;
            t.stale_translations += o.stale_translations;
            t.invariant_errors
                .extend(o.invariant_errors.iter().cloned());
        }
        t
    }

    /// The report's `Oracle:` line.
    pub fn line(&self) -> String {
        let unwritten = if self.unwritten_pages == 0 {
            String::new()
        } else {
            format!(
                " ({} written by no vCPU, the remainder of memory / vCPUs: {} hold a write)",
                self.unwritten_pages, self.stray_writes
            )
        };
        format!(
            "Oracle: {} guest pages checked{unwritten}, {} lost writes, {} stale translations; {} pages still mapped after munmap; page-table invariants {}",
            self.pages_checked,
            self.lost_writes,
            self.stale_translations,
            self.mapped_after_munmap,
            crate::lab::report::invariants_verdict(self.invariant_errors.len())
        )
    }

    /// Whether every oracle passed.
    pub fn passed(&self) -> bool {
        self.lost_writes == 0
            && self.stray_writes == 0
            && self.invariant_errors.is_empty()
            && self.mapped_after_munmap == 0
            && self.stale_translations == 0
    }
}

/// One run's results.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReclaimReport {
    /// The engine (`threads`, `virtual`).
    pub engine: String,
    /// The MMU's name.
    pub mmu: String,
    /// The parameters.
    pub params: ReclaimParams,
    /// The selftest's times.
    pub run1_ns: u64,
    /// The reset between the runs.
    pub reset_ns: u64,
    /// Run 2: the seed's metric.
    pub run2_ns: u64,
    /// The zone's watermarks, in pages.
    pub watermarks: [u64; 3],
    /// kswapd's busy time during the runs.
    pub kswapd_ns: u64,
    /// kswapd's time by function, the seed's profile.
    pub profile: Vec<ProfileLine>,
    /// Host memory counters over the runs.
    pub vmstat: VmStat,
    /// What kswapd (`kswapd`) and the vCPUs (`vcpus`) counted over both runs.
    pub counters: BTreeMap<String, BTreeMap<String, u64>>,
    /// `mmu_lock`'s statistics over both runs.
    pub mmu_lock: BTreeMap<String, u64>,
    /// The oracles.
    pub oracle: ReclaimOracle,
}

/// A meter's non-zero counters by name.
fn counters(m: &Meter) -> BTreeMap<String, u64> {
    METER_FIELDS
        .iter()
        .zip(m.counts())
        .filter(|(_, v)| *v != 0)
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

/// The mmu_lock counters' change since `before`.
fn lock_delta(now: BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    now.into_iter()
        .map(|(k, v)| {
            let b = before.get(&k).copied().unwrap_or(0);
            (k, v - b)
        })
        .collect()
}

/// The VM, its memslots and the host memory behind them.
struct Setup {
    vm: Arc<Vm>,
    mm: Arc<HostMm>,
}

/// Builds the VM: vCPUs, the memslots aliasing one memfd, the host that reclaims.
fn setup(
    p: &ReclaimParams,
    waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>,
) -> Result<Setup, LabError> {
    let vm = Vm::try_with_waiter(
        VmConfig {
            vcpus: p.vcpus,
            mmu: p.mmu,
            ..Default::default()
        },
        waiter,
    )?;
    let slot_bytes = p.slot_size;
    // MADV_NOHUGEPAGE: the memfd is mapped with 4K host pages, so KVM maps 4K too.
    vm.set_user_memory_region(FIRST_SLOT, START_GPA, slot_bytes, Backing::Anonymous, 0)?;
    let base = vm.kvm.all_slots()[0].host_pfn;
    for n in 1..p.nr_slots() {
        vm.set_user_memory_region_alias(
            FIRST_SLOT + n as u32,
            START_GPA + n * slot_bytes,
            slot_bytes,
            Backing::Anonymous,
            base,
        )?;
    }
    let mm = Arc::new(HostMm::new(
        base,
        p.memfd_pages(),
        p.host_memory / PAGE_SIZE,
        p.lru,
    )?);
    if vm.kvm.host_mm.set(Arc::clone(&mm)).is_err() {
        return Err(LabError::Invalid(
            "the VM already has a host that reclaims".into(),
        ));
    }
    Ok(Setup {
        vm: Arc::new(vm),
        mm,
    })
}

/// The pages each vCPU writes: `spawn_workers()` gives every vCPU `memory / vCPUs` bytes rounded
/// down to a page, so the remainder at the top of guest memory (fewer pages than vCPUs) is
/// written by nobody.
fn pages_per_vcpu(p: &ReclaimParams) -> u64 {
    p.guest_bytes() / PAGE_SIZE / p.vcpus as u64
}

/// The vCPUs' guests: vCPU `i` writes the `i`th equal share of guest memory.
fn guests(p: &ReclaimParams) -> Vec<MaxMemGuest> {
    let share = pages_per_vcpu(p);
    let first = START_GPA / PAGE_SIZE;
    (0..p.vcpus as u64)
        .map(|i| MaxMemGuest {
            start: Gfn(first + i * share),
            end: Gfn(first + (i + 1) * share),
            next: 0,
            run: 0,
        })
        .collect()
}

/// The VMM's prefault of the memfd (one byte per page), which sets each host PTE's Accessed
/// bit; when memory runs out the prefaulting thread reclaims directly
/// (`__alloc_pages_direct_reclaim()`). Simplified: it runs kswapd's plans itself until memory
/// is balanced, where Linux's direct reclaim takes `SWAP_CLUSTER_MAX` pages and retries.
fn prefault<E: Engine>(s: &Setup, engine: &mut E, kswapd: &mut Kswapd) -> Result<(), LabError> {
    let kvm = &*s.vm.kvm;
    let mut i = 0;
    while i < s.mm.npages {
        match s.mm.faultin(s.mm.base + i, &kvm.host, true) {
            crate::host::lru::Faultin::NoMemory => {
                let mut progress = false;
                while let Some(plan) = kswapd.next_plan(kvm) {
                    let ns = engine.run_plans(vec![plan])?;
                    kswapd.plan_done(ns, &Meter::default());
                    progress = true;
                }
                if !progress {
                    return Err(LabError::Invalid(
                        "the host ran out of memory with nothing left to reclaim".into(),
                    ));
                }
            }
            _ => i += 1,
        }
    }
    Ok(())
}

/// `munmap()` of the first half of the memfd: the MMU notifier invalidates it (KVM zaps),
/// as the selftest's teardown does.
fn munmap_first_half(s: &Setup) -> OpPlan {
    let start = s.mm.base;
    let end = start + s.mm.npages / 2;
    let mmu = Arc::clone(&s.vm.mmu);
    OpPlan {
        steps: vec![
            OpStep::Job(Box::new(NotifierJob::new(
                "invalidate_range_start",
                Box::new(move |kvm: &Kvm, held: Held<'_, Write>, m: &mut Meter| {
                    invalidate_range_start(kvm, &*mmu, start, end, held, m);
                }),
            ))),
            OpStep::Job(Box::new(NotifierJob::new(
                "invalidate_range_end",
                Box::new(|kvm: &Kvm, held: Held<'_, Write>, m: &mut Meter| {
                    invalidate_range_end(kvm, held, m)
                }),
            ))),
        ],
    }
}

/// max_guest_memory_test on `engine` over `s`.
fn run_reclaim<E: Engine>(
    p: &ReclaimParams,
    s: &Setup,
    engine: &mut E,
    progress: bool,
) -> Result<ReclaimReport, LabError> {
    let vm = &s.vm;
    let kvm = &*vm.kvm;
    let say = |what: &str| {
        if progress {
            eprintln!("vmmu: {what}");
        }
    };
    let mut kswapd = Kswapd::new(
        &vm.kvm,
        &vm.mmu,
        p.aging,
        p.skip_invalidate_for_negative_control,
    );
    say("prefaulting the memfd");
    prefault(s, engine, &mut kswapd)?;
    // The counters start with the vCPUs.
    let mut kswapd = Kswapd::new(
        &vm.kvm,
        &vm.mmu,
        p.aging,
        p.skip_invalidate_for_negative_control,
    );
    let vmstat0 = s.mm.vmstat();
    let lock0 = kvm.mmu_lock.stats.snapshot();
    // Spawning: the vCPU threads start and rendezvous (pass 0 runs no guest code).
    engine.run_pass(0)?;
    say("run 1");
    let run1_ns = engine.run_pass_beside(1, &mut kswapd)?;
    // The reset: KVM_SET_REGS and KVM_SET_SREGS toggling CR0.WP on each vCPU, no MMU work.
    let reset_ns = 0;
    say("run 2");
    let run2_ns = engine.run_pass_beside(2, &mut kswapd)?;
    engine.stop_vcpus()?;
    let mmu_lock = lock_delta(kvm.mmu_lock.stats.snapshot(), &lock0);
    let vmstat = vmstat_delta(&s.mm.vmstat(), &vmstat0);
    let mut vcpu = Meter::default();
    for m in engine.vcpu_meters() {
        vcpu.add(&m);
    }

    say("checking guest memory");
    let mut oracle = ReclaimOracle::default();
    let slots = kvm.all_slots();
    // The memfd's pages below this index are written through some slot's GPA (slot 0 maps the
    // lowest guest pages); the rest are the vCPUs' remainder, which nobody writes.
    let written = pages_per_vcpu(p) * p.vcpus as u64;
    for slot in &slots {
        for g in 0..slot.npages {
            let gfn = slot.base_gfn + g;
            let i =
                s.mm.index(slot.gfn_to_pfn(gfn))
                    .expect("the memfd backs every slot");
            let got = s.mm.content(i, &kvm.host);
            if translated(vm, gfn) && !s.mm.resident(i) {
                oracle.stale_translations += 1;
            }
            // Slots alias the memfd: the page holds what run 2 wrote through one of its GPAs;
            // a page no vCPU writes holds no guest write at all.
            let gpa = got & ((1 << RUN_TAG_SHIFT) - 1);
            let ok = if g < written {
                got >> RUN_TAG_SHIFT == 2
                    && gpa >= START_GPA
                    && (gpa - START_GPA) % p.slot_size == g * PAGE_SIZE
            } else {
                oracle.unwritten_pages += 1;
                if got >> RUN_TAG_SHIFT != 0 {
                    oracle.stray_writes += 1;
                }
                true
            };
            oracle.pages_checked += 1;
            if !ok {
                oracle.lost_writes += 1;
                if oracle.lost_gfns.len() < 16 {
                    oracle.lost_gfns.push(gfn.0);
                }
            }
        }
    }
    oracle.invariant_errors.extend(vm.check_invariants());
    // The selftest's teardown: delete the even memslots, unmap the first half of the memfd.
    say("deleting even memslots and unmapping half the memfd");
    let mut plans: Vec<OpPlan> = slots
        .iter()
        .filter(|s| s.id % 2 == 0)
        .map(|s| crate::kvm::memslot_delete::delete_memslot_plan(&vm.mmu, s))
        .collect();
    plans.push(munmap_first_half(s));
    engine.run_plans(plans)?;
    let half = s.mm.npages / 2;
    for slot in kvm.all_slots() {
        for g in 0..half.min(slot.npages) {
            if translated(vm, slot.base_gfn + g) {
                oracle.mapped_after_munmap += 1;
            }
        }
    }
    oracle.invariant_errors.extend(vm.check_invariants());

    let busy = kswapd.busy_ns();
    Ok(ReclaimReport {
        engine: engine.name().into(),
        mmu: vm.mmu.name().into(),
        params: p.clone(),
        run1_ns,
        reset_ns,
        run2_ns,
        watermarks: [
            s.mm.watermarks.min,
            s.mm.watermarks.low,
            s.mm.watermarks.high,
        ],
        kswapd_ns: busy,
        profile: profile_lines(&kswapd.profile, busy),
        vmstat,
        counters: [
            ("kswapd".to_string(), counters(&kswapd.meter)),
            ("vcpus".to_string(), counters(&vcpu)),
        ]
        .into(),
        mmu_lock,
        oracle,
    })
}

/// Whether KVM's tables translate `gfn` (the hardware walk a vCPU's TLB miss would make).
fn translated(vm: &Vm, gfn: Gfn) -> bool {
    let guard = crossbeam_epoch::pin();
    let mut levels = 0;
    matches!(
        vm.mmu.hw_walk(gfn, false, false, &guard, &mut levels),
        crate::hw::walker::WalkResult::Translated { .. }
    )
}

/// `now - before`, counter by counter.
fn vmstat_delta(now: &VmStat, before: &VmStat) -> VmStat {
    VmStat {
        pswpout: now.pswpout - before.pswpout,
        pswpin: now.pswpin - before.pswpin,
        pgscan: now.pgscan - before.pgscan,
        pgsteal: now.pgsteal - before.pgsteal,
        pgactivate: now.pgactivate - before.pgactivate,
        pgdeactivate: now.pgdeactivate - before.pgdeactivate,
        kswapd_wakeups: now.kswapd_wakeups - before.kswapd_wakeups,
        allocstall: now.allocstall - before.allocstall,
        mglru_aging: now.mglru_aging - before.mglru_aging,
        pgpopulated: now.pgpopulated - before.pgpopulated,
    }
}

/// kswapd's rows as the seed's call tree: `balance_pgdat` at the top, each list's shrinking
/// below it, `folio_referenced` and its KVM call below that, the write-lock wait innermost.
fn profile_lines(rows: &BTreeMap<(Parent, Func), ProfileRow>, busy: u64) -> Vec<ProfileLine> {
    let pct = |ns: u64| {
        if busy == 0 {
            0.0
        } else {
            ns as f64 * 100.0 / busy as f64
        }
    };
    let mut out = Vec::new();
    let mut line = |depth: usize, function: &str, ns: u64| {
        out.push(ProfileLine {
            depth,
            function: function.into(),
            percent: pct(ns),
            ns,
        })
    };
    line(0, "balance_pgdat", busy);
    for parent in Parent::ALL {
        let of = |f: Func| rows.get(&(parent, f)).cloned().unwrap_or_default();
        let total: u64 = rows
            .iter()
            .filter(|((p, _), _)| *p == parent)
            .map(|(_, r)| r.ns)
            .sum();
        if total == 0 {
            continue;
        }
        line(1, parent.kernel_name(), total);
        let (isolate, referenced, cfy, look, unmap, pageout, walk) = (
            of(Func::IsolateFolios),
            of(Func::FolioReferenced),
            of(Func::ClearFlushYoung),
            of(Func::LookAround),
            of(Func::TryToUnmap),
            of(Func::Pageout),
            of(Func::WalkMm),
        );
        if walk.ns > 0 {
            line(2, Func::WalkMm.kernel_name(), walk.ns);
        }
        if isolate.ns > 0 {
            line(2, Func::IsolateFolios.kernel_name(), isolate.ns);
        }
        let referenced_ns = referenced.ns + cfy.ns + look.ns;
        if referenced_ns > 0 {
            line(2, Func::FolioReferenced.kernel_name(), referenced_ns);
            if cfy.ns > 0 {
                line(3, Func::ClearFlushYoung.kernel_name(), cfy.ns);
                line(4, "_raw_write_lock", cfy.write_wait_ns);
            }
            if look.ns > 0 {
                line(3, Func::LookAround.kernel_name(), look.ns);
            }
        }
        if unmap.ns > 0 {
            line(2, Func::TryToUnmap.kernel_name(), unmap.ns);
            line(3, "_raw_write_lock", unmap.write_wait_ns);
        }
        if pageout.ns > 0 {
            line(2, Func::Pageout.kernel_name(), pageout.ns);
        }
    }
    out
}

impl ReclaimReport {
    /// The selftest's lines, then (`with_counters`) kswapd's profile, the host's and the
    /// vCPUs' counters and the oracle.
    pub fn to_text(&self, with_counters: bool) -> String {
        let mut s = String::new();
        let p = &self.params;
        // The selftest counts whole GiB; a run given a smaller size says it in MiB.
        let bytes = p.guest_bytes();
        let size = if bytes.is_multiple_of(GIB) {
            format!("{}gb", bytes / GIB)
        } else {
            format!("{}mb", bytes >> 20)
        };
        let _ = writeln!(
            s,
            "Running with {size} of guest memory and {} vCPUs",
            p.vcpus
        );
        for phase in ["spawning", "run 1", "reset", "run 2"] {
            let _ = writeln!(s, "Waiting for vCPUs to finish {phase}...");
            let _ = writeln!(s, "All vCPUs finished {phase}, releasing...");
        }
        let _ = writeln!(
            s,
            "run1 = {}, reset = {}, run2 =  {}",
            fmt_ts(self.run1_ns),
            fmt_ts(self.reset_ns),
            fmt_ts(self.run2_ns)
        );
        if with_counters {
            s.push_str(&self.counters_text());
        }
        s
    }

    /// kswapd's profile and the counters, as indented lines.
    fn counters_text(&self) -> String {
        let mut s = String::new();
        let p = &self.params;
        let [min, low, high] = self.watermarks;
        let _ = writeln!(
            s,
            "  [host] {} MiB, --lru {}, --aging {}; watermarks min {} low {} high {} pages",
            p.host_memory >> 20,
            p.lru.name(),
            aging_label(p.aging),
            min,
            low,
            high
        );
        let runs = self.run1_ns + self.run2_ns;
        let _ = writeln!(
            s,
            "  [kswapd] busy {} ({:.1}% of the runs), woken {} times",
            fmt_ts(self.kswapd_ns),
            if runs == 0 {
                0.0
            } else {
                self.kswapd_ns as f64 * 100.0 / runs as f64
            },
            self.vmstat.kswapd_wakeups
        );
        for l in &self.profile {
            let _ = writeln!(
                s,
                "  {:>7.2}% {}{}",
                l.percent,
                " ".repeat(l.depth),
                l.function
            );
        }
        let v = &self.vmstat;
        let _ = writeln!(
            s,
            "  [vmstat] pswpout {} pswpin {} pgscan {} pgsteal {} pgactivate {} pgdeactivate {} allocstall {} mglru_aging {}",
            v.pswpout, v.pswpin, v.pgscan, v.pgsteal, v.pgactivate, v.pgdeactivate, v.allocstall, v.mglru_aging
        );
        let l = &self.mmu_lock;
        let g = |k: &str| l.get(k).copied().unwrap_or(0);
        let _ = writeln!(
            s,
            "  [mmu_lock] write: {} acquired, {} contended, waited {}; read: {} acquired, {} contended, vCPUs waited {}",
            g("mmu_lock_write_acquired"),
            g("mmu_lock_write_contended"),
            fmt_ts(g("mmu_lock_write_wait_ns")),
            g("mmu_lock_read_acquired"),
            g("mmu_lock_read_contended"),
            fmt_ts(g("mmu_lock_read_wait_ns"))
        );
        for (name, c) in self.counters.iter().rev() {
            let body: Vec<String> = c.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(s, "  [{name}] {}", body.join(" "));
        }
        let _ = writeln!(s, "{}", self.oracle.line());
        s
    }
}

/// `--aging`'s value as the command line spells it.
pub fn aging_label(a: Aging) -> &'static str {
    match a {
        Aging::Locked => "locked",
        Aging::Lockless => "lockless",
    }
}

/// Runs max_guest_memory_test on the threads engine. `progress` prints phases to stderr.
pub fn run_reclaim_threads(p: &ReclaimParams, progress: bool) -> Result<ReclaimReport, LabError> {
    p.validate()?;
    let s = setup(p, Box::new(SpinWaiter))?;
    let mut engine = Threads::new(Arc::clone(&s.vm), guests(p));
    run_reclaim(p, &s, &mut engine, progress)
}

/// Runs max_guest_memory_test in virtual time, priced with `cost`.
pub fn run_reclaim_virtual(
    p: &ReclaimParams,
    cost: &CostModel,
    progress: bool,
) -> Result<ReclaimReport, LabError> {
    p.validate()?;
    crate::engine::virtual_time::check_cost_model(cost)?;
    let s = setup(p, Box::new(VirtualWaiter))?;
    let mut engine = VirtualTime::new(&s.vm, cost, guests(p))?;
    run_reclaim(p, &s, &mut engine, progress)
}

/// A size as max_guest_memory_test's `-m` and `-s` take it: whole GiB, else `<n>M`.
pub fn size_label(bytes: u64) -> String {
    if bytes.is_multiple_of(1 << 30) {
        (bytes >> 30).to_string()
    } else {
        format!("{}M", bytes >> 20)
    }
}

/// `--compare aging`: run times and, with counters, kswapd's profile, vmstat and the lock's
/// counters on each side, then the oracles' verdict.
pub fn compare_text(reports: &[ReclaimReport], with_counters: bool) -> String {
    let mut s = String::new();
    let p = &reports[0].params;
    let _ = writeln!(
        s,
        "reclaim --compare aging: max_guest_memory_test -c {} -m {} -s {}, host memory {} MiB, {} MMU, {} engine",
        p.vcpus,
        size_label(p.max_mem),
        size_label(p.slot_size),
        p.host_memory >> 20,
        reports[0].mmu,
        reports[0].engine
    );
    if reports[0].mmu == "shadow" {
        let _ = writeln!(
            s,
            "(the shadow MMU has no lockless test_clear_young(): MGLRU after falls back to clear_young under the write lock)"
        );
    }
    let names = ["MGLRU before", "MGLRU after", "MGLRU off"];
    let table = SideBySide {
        label: 34,
        head: 16,
        cell: 16,
        sep: "",
    };
    table.header(&mut s, names.iter().take(reports.len()).copied());
    let mut row = |name: &str, f: &dyn Fn(&ReclaimReport) -> String| {
        table.row(&mut s, name, reports.iter().map(f));
    };
    row("run1", &|r| crate::lab::report::fmt_ts(r.run1_ns));
    row("run2", &|r| crate::lab::report::fmt_ts(r.run2_ns));
    if with_counters {
        row("kswapd busy", &|r| crate::lab::report::fmt_ts(r.kswapd_ns));
        let pct = |r: &ReclaimReport, depth: usize, f: &str| {
            r.profile
                .iter()
                .filter(|l| l.depth == depth && l.function == f)
                .map(|l| l.percent)
                // An empty f64 sum is -0.0; print it as 0.00%.
                .sum::<f64>()
                + 0.0
        };
        for (depth, f) in [
            (1, "shrink_active_list"),
            (1, "shrink_folio_list"),
            (2, "folio_referenced"),
            (3, "kvm_mmu_notifier_clear_flush_young"),
            (4, "_raw_write_lock"),
            (3, "lru_gen_look_around"),
            (2, "try_to_unmap"),
            (3, "_raw_write_lock"),
            (2, "pageout"),
            (1, "try_to_inc_max_seq"),
        ] {
            row(&format!("  % {}{f}", " ".repeat(depth - 1)), &|r| {
                format!("{:.2}%", pct(r, depth, f))
            });
        }
        row("pswpout", &|r| r.vmstat.pswpout.to_string());
        row("pswpin", &|r| r.vmstat.pswpin.to_string());
        row("pgactivate", &|r| r.vmstat.pgactivate.to_string());
        row("allocstall", &|r| r.vmstat.allocstall.to_string());
        let c = |r: &ReclaimReport, k: &str| {
            r.counters["kswapd"]
                .get(k)
                .copied()
                .unwrap_or(0)
                .to_string()
        };
        row("kswapd mmu_notifier_calls", &|r| c(r, "mmu_notifier_calls"));
        row("kswapd remote_flushes", &|r| c(r, "remote_flushes"));
        let l = |r: &ReclaimReport, k: &str| r.mmu_lock.get(k).copied().unwrap_or(0);
        row("mmu_lock write acquisitions", &|r| {
            l(r, "mmu_lock_write_acquired").to_string()
        });
        row("vCPU mmu_lock read wait", &|r| {
            crate::lab::report::fmt_ts(l(r, "mmu_lock_read_wait_ns"))
        });
    }
    let total = ReclaimOracle::total(reports.iter().map(|r| &r.oracle));
    let _ = writeln!(s, "{}", total.line());
    s
}
