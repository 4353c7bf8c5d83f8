//! `vmmu access-tracking`: KVM's access_tracking_perf_test (its page_idle mode). A memstress VM
//! (`-v` vCPUs, `-b` bytes each, `-o` overlapped) populates its memory, writes and reads it,
//! then twice has its pages marked idle through `/sys/kernel/mm/page_idle/bitmap`
//! ([`PageIdleMarker`], one per vCPU thread, as the selftest's vCPU threads do it) and touches
//! them again; each phase's time is printed as the selftest prints it. Marking reaches KVM's
//! `clear_young` per page: under `mmu_lock` for write (`--aging locked`) the threads serialize
//! on it; without it (`--aging lockless`, the TDP MMU from Linux 6.15) they do not. Touching
//! idle memory shows what aging costs the guest: the walker setting Accessed bits again
//! (x86 with EPT A/D) or an access-flag fault per page (arm64).
//!
//! The oracles: every page holds what the last writing pass wrote, and the page-table
//! invariants hold. The host has enough memory: nothing is reclaimed.
//!
//! Departures: the selftest's MGLRU mode (aging through `/sys/kernel/debug/lru_gen`, 2025) is
//! not modelled; the guest writes a value that changes every pass (memstress writes a
//! constant), so a lost write is visible; the warning uses later versions' condition (too
//! many pages still idle), where 6.2's `still_idle < pages / 10` had it inverted.

use crate::cost::CostModel;
use crate::engine::threads::Threads;
use crate::engine::virtual_time::{VirtualTime, VirtualWaiter};
use crate::engine::{Engine, GuestAccess, GuestCode, HostThread, PrivateGfns};
use crate::host::backing::Backing;
use crate::host::lru::{HostMm, LruPolicy};
use crate::kvm::mmu_notifier::Aging;
use crate::lab::compare::SideBySide;
use crate::lab::memstress::{pass_value, vcpu_regions, GuestRandom, PassCursor, VcpuRegion};
use crate::lab::reclaim::aging_label;
use crate::lab::report::{fmt_ts, PhaseCounters};
use crate::lab::test_vm::{PhaseClock, Setup, TestVm};
use crate::lab::LabError;
use crate::units::{Gfn, GfnRange, Pfn, PAGE_SIZE};
use crate::vm::page_idle::{MarkStats, PageIdleMarker};
use crate::vm::waiter::SpinWaiter;
use crate::vm::MmuKind;
use std::fmt::Write as _;
use std::sync::Arc;

/// What a run models.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct AccessTrackingParams {
    /// vCPUs (`-v`).
    pub vcpus: usize,
    /// Bytes of memory per vCPU (`-b`).
    pub vcpu_bytes: u64,
    /// Every vCPU touches the whole region (`-o`); then vCPU 0 alone marks it idle.
    pub overlap: bool,
    /// The backing source (`-s`).
    pub backing: Backing,
    /// How KVM's `clear_young` takes `mmu_lock`.
    pub aging: Aging,
    /// The MMU.
    #[serde(skip)]
    pub mmu: MmuKind,
    /// arm64's guest mode (`None` on x86).
    pub guest_mode: Option<u32>,
}

impl Default for AccessTrackingParams {
    fn default() -> Self {
        AccessTrackingParams {
            vcpus: 1,
            vcpu_bytes: 1 << 30,
            overlap: false,
            backing: Backing::Anonymous,
            aging: Aging::Locked,
            mmu: MmuKind::Tdp,
            guest_mode: None,
        }
    }
}

impl AccessTrackingParams {
    /// The VM the run builds: one memslot of `-v` × `-b`.
    pub fn test_vm(&self) -> TestVm {
        TestVm {
            vcpus: self.vcpus,
            bytes: self.vcpu_bytes * self.vcpus as u64,
            slots: 1,
            backing: self.backing,
            mmu: self.mmu,
            guest_mode: self.guest_mode,
            eager_split: false,
            pml: false,
            kernel: Default::default(),
            manual_protect: false,
            guest_page_level: crate::x86::spte::PG_LEVEL_4K,
            dirty_ring: None,
        }
    }

    /// Checks the parameters; one line saying what is wrong and what is allowed.
    pub fn validate(&self) -> Result<(), LabError> {
        if self.vcpus == 0 || self.vcpus > 512 {
            return Err(LabError::Invalid(format!(
                "-v {}: 1 to 512 vCPUs",
                self.vcpus
            )));
        }
        let page = self.backing.page_size().max(PAGE_SIZE);
        if self.vcpu_bytes == 0 || !self.vcpu_bytes.is_multiple_of(page) {
            return Err(LabError::Invalid(format!(
                "-b {}: the memory per vCPU must be a non-zero multiple of the backing's page size ({} KiB)",
                self.vcpu_bytes,
                page >> 10
            )));
        }
        if self.backing != Backing::Anonymous {
            return Err(LabError::Invalid(format!(
                "-s {}: access-tracking models 4K anonymous memory (-s anonymous); page_idle on huge folios is not modelled",
                self.backing.name()
            )));
        }
        if matches!(self.mmu, MmuKind::Shadow { ept: false }) {
            return Err(LabError::Invalid(
                "access-tracking runs with EPT (--mmu tdp, or shadow with EPT)".into(),
            ));
        }
        self.test_vm().region_gpa().map(|_| ())
    }
}

/// The selftest's phases, in order: a guest pass (`Some(write percent)`) or a marking pass.
pub const PHASES: [(&str, Option<u32>); 7] = [
    ("Populating memory", Some(100)),
    ("Writing to populated memory", Some(100)),
    ("Reading from populated memory", Some(0)),
    ("Mark memory idle", None),
    ("Writing to idle memory", Some(100)),
    ("Mark memory idle", None),
    ("Reading from idle memory", Some(0)),
];

/// One phase's result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PhaseReport {
    /// The selftest's description.
    pub name: String,
    /// Its time.
    pub ns: u64,
    /// What every actor counted during it.
    pub counters: PhaseCounters,
    /// A marking pass: what each vCPU thread found.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub marks: Vec<MarkStats>,
    /// A marking pass: the threads' `mmu_lock` write wait, summed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mark_write_wait_ns: Option<u64>,
}

/// What the oracles found.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AccessTrackingOracle {
    /// Pages checked.
    pub pages_checked: u64,
    /// Pages not holding what the last writing pass wrote.
    pub lost_writes: u64,
    /// Page-table invariant violations.
    pub invariant_errors: Vec<String>,
}

impl AccessTrackingOracle {
    /// Whether every oracle passed.
    pub fn passed(&self) -> bool {
        self.lost_writes == 0 && self.invariant_errors.is_empty()
    }
}

/// One run's results.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AccessTrackingReport {
    /// The engine.
    pub engine: String,
    /// The MMU.
    pub mmu: String,
    /// The parameters.
    pub params: AccessTrackingParams,
    /// The guest physical test memory.
    pub test_memory: (u64, u64),
    /// The phases.
    pub phases: Vec<PhaseReport>,
    /// The oracles.
    pub oracle: AccessTrackingOracle,
}

/// A vCPU's memstress guest, its write percentage set per phase.
struct Guest {
    vcpu: usize,
    region: VcpuRegion,
    rng: GuestRandom,
    cursor: PassCursor,
    value: u64,
    /// Its region is its own (not `--overlap`).
    partitioned: bool,
    /// The pass in progress may write.
    writes: bool,
}

impl GuestCode for Guest {
    fn start_pass(&mut self, iteration: i64) {
        let write_percent = PHASES
            .iter()
            .filter_map(|(_, w)| *w)
            .nth(iteration as usize - 1)
            .expect("a pass per guest phase");
        self.cursor = PassCursor::new(self.region.pages, false, write_percent);
        self.writes = write_percent > 0;
        self.value = pass_value(iteration, self.vcpu);
    }

    fn next_access(&mut self) -> Option<GuestAccess> {
        let (page, write) = self.cursor.next(&mut self.rng)?;
        Some(GuestAccess::first_word(
            Gfn(self.region.base_gfn + page),
            write,
            self.value,
        ))
    }

    fn access_done(&mut self, _: &GuestAccess) {}

    /// Its partition of the memory, unless the vCPUs overlap.
    fn private_gfns(&self) -> Option<PrivateGfns> {
        self.partitioned.then(|| PrivateGfns {
            range: GfnRange::new(Gfn(self.region.base_gfn), self.region.pages),
            write: self.writes,
        })
    }
}

/// Builds the VM and the host's folios behind its memslot (as much memory as the guest's
/// twice over: nothing is reclaimed).
fn setup(
    p: &AccessTrackingParams,
    waiter: Box<dyn crate::kvm::vcpu::VcpuWaiter>,
) -> Result<(Setup, Vec<VcpuRegion>), LabError> {
    let s = Setup::new(&p.test_vm(), waiter)?;
    let slot = &s.slots[0];
    let mm = HostMm::new(
        slot.host_pfn,
        slot.npages,
        2 * slot.npages + (1 << 18),
        LruPolicy::Classic,
    )?;
    if s.vm.kvm.host_mm.set(Arc::new(mm)).is_err() {
        return Err(LabError::Invalid("the VM already has host folios".into()));
    }
    let regions = vcpu_regions(s.base_gfn, p.vcpus, p.vcpu_bytes / PAGE_SIZE, !p.overlap);
    Ok((s, regions))
}

fn guests(p: &AccessTrackingParams, regions: &[VcpuRegion]) -> Vec<Guest> {
    regions
        .iter()
        .enumerate()
        .map(|(i, r)| Guest {
            vcpu: i,
            region: r.clone(),
            rng: GuestRandom::new(i as u32 + 1),
            cursor: PassCursor::new(0, false, 0),
            value: 0,
            partitioned: !p.overlap,
            writes: true,
        })
        .take(p.vcpus)
        .collect()
}

/// access_tracking_perf_test on `engine`.
fn run<E: Engine>(
    p: &AccessTrackingParams,
    s: &Setup,
    regions: &[VcpuRegion],
    engine: &mut E,
    progress: bool,
) -> Result<AccessTrackingReport, LabError> {
    let vm = &s.vm;
    let mut clock = PhaseClock::default();
    let mut phases = Vec::new();
    let mut iteration = 0;
    let mut last_write = 0;
    for (name, write) in PHASES {
        if progress {
            eprintln!("vmmu: {name}");
        }
        let mut marks = Vec::new();
        let mut mark_wait = None;
        let ns = match write {
            Some(w) => {
                iteration += 1;
                if w > 0 {
                    last_write = iteration;
                }
                engine.run_pass(iteration)?
            }
            None => {
                // With -o, vCPU 0 marks the whole region alone.
                let slot = &s.slots[0];
                let mut markers: Vec<PageIdleMarker> = regions
                    .iter()
                    .take(if p.overlap { 1 } else { p.vcpus })
                    .map(|r| {
                        let first = slot.gfn_to_pfn(Gfn(r.base_gfn));
                        PageIdleMarker::new(&vm.kvm, &vm.mmu, p.aging, first, r.pages)
                    })
                    .collect();
                let mut threads: Vec<&mut (dyn HostThread + Send)> = markers
                    .iter_mut()
                    .map(|m| m as &mut (dyn HostThread + Send))
                    .collect();
                let ns = engine.run_host_threads(&mut threads)?;
                for m in &markers {
                    vm.add_vmm_meter(&m.meter);
                }
                marks = markers.iter().map(|m| m.stats()).collect();
                mark_wait = Some(markers.iter().map(|m| m.write_wait_ns).sum());
                ns
            }
        };
        phases.push(PhaseReport {
            name: name.into(),
            ns,
            counters: clock.lap(vm, &engine.vcpu_meters()),
            marks,
            mark_write_wait_ns: mark_wait,
        });
    }
    engine.stop_vcpus()?;
    let mut oracle = AccessTrackingOracle::default();
    let kvm = &*vm.kvm;
    let mm = kvm.host_mm.get().expect("set up above");
    for (v, r) in regions.iter().enumerate() {
        for page in 0..r.pages {
            let gfn = Gfn(r.base_gfn + page);
            let pfn: Pfn = s.slots[0].gfn_to_pfn(gfn);
            let got = mm.content(mm.index(pfn).expect("the slot's frame"), &kvm.host);
            oracle.pages_checked += 1;
            // Overlapped vCPUs write the same pages: any vCPU's value of the last pass.
            let ok = if p.overlap {
                (0..p.vcpus).any(|w| got == pass_value(last_write, w))
            } else {
                got == pass_value(last_write, v)
            };
            oracle.lost_writes += !ok as u64;
        }
        if p.overlap {
            break;
        }
    }
    oracle.invariant_errors = vm.check_invariants();
    Ok(AccessTrackingReport {
        engine: engine.name().into(),
        mmu: vm.mmu.name().into(),
        params: p.clone(),
        test_memory: (s.gpa, s.gpa + p.vcpu_bytes * p.vcpus as u64),
        phases,
        oracle,
    })
}

impl AccessTrackingReport {
    /// The selftest's lines, then (`with_counters`) each phase's counters, the marking
    /// passes' findings and the oracle.
    pub fn to_text(&self, with_counters: bool) -> String {
        let mut s = String::new();
        match self.params.guest_mode {
            Some(_) => {
                let mode = crate::lab::test_vm::guest_mode(self.params.guest_mode)
                    .map(|m| m.name())
                    .unwrap_or_default();
                let _ = writeln!(s, "Testing guest mode: {mode}");
            }
            None => {
                let _ = writeln!(s, "Testing guest mode: PA-bits:ANY, VA-bits:48,  4K pages");
            }
        }
        let _ = writeln!(
            s,
            "guest physical test memory: [{:#x}, {:#x})",
            self.test_memory.0, self.test_memory.1
        );
        let _ = writeln!(s);
        for ph in &self.phases {
            for (v, m) in ph.marks.iter().enumerate() {
                let pages = m.no_pfn + m.still_idle + m.marked;
                if m.still_idle >= pages / 10 && m.still_idle > 0 {
                    let _ = writeln!(
                        s,
                        "WARNING: vCPU{v}: Too many pages still idle ({} out of {pages}), this will affect performance results.",
                        m.still_idle
                    );
                }
            }
            let _ = writeln!(s, "{:<30}: {}", ph.name, fmt_ts(ph.ns));
            if with_counters {
                if let Some(line) = crate::lab::report::counter_line(
                    &ph.name,
                    &crate::lab::report::Phase {
                        wall_ns: ph.ns,
                        counters: Some(ph.counters.clone()),
                    },
                ) {
                    let _ = writeln!(s, "{line}");
                }
                if let Some(wait) = ph.mark_write_wait_ns {
                    let sum = |f: fn(&MarkStats) -> u64| ph.marks.iter().map(f).sum::<u64>();
                    let _ = writeln!(
                        s,
                        "  [{}] threads {} marked {} still_idle {} no_pfn {} mmu_lock_write_wait {}",
                        ph.name,
                        ph.marks.len(),
                        sum(|m| m.marked),
                        sum(|m| m.still_idle),
                        sum(|m| m.no_pfn),
                        fmt_ts(wait)
                    );
                }
            }
        }
        if with_counters {
            let o = &self.oracle;
            let _ = writeln!(
                s,
                "Oracle: {} pages checked, {} lost writes; page-table invariants {}",
                o.pages_checked,
                o.lost_writes,
                crate::lab::report::invariants_verdict(o.invariant_errors.len())
            );
        }
        s
    }
}

/// Runs access_tracking_perf_test on the threads engine.
pub fn run_access_tracking_threads(
    p: &AccessTrackingParams,
    progress: bool,
) -> Result<AccessTrackingReport, LabError> {
    p.validate()?;
    let (s, regions) = setup(p, Box::new(SpinWaiter))?;
    let mut engine = Threads::new(Arc::clone(&s.vm), guests(p, &regions));
    run(p, &s, &regions, &mut engine, progress)
}

/// Runs access_tracking_perf_test in virtual time, priced with `cost`.
pub fn run_access_tracking_virtual(
    p: &AccessTrackingParams,
    cost: &CostModel,
    progress: bool,
) -> Result<AccessTrackingReport, LabError> {
    p.validate()?;
    crate::engine::virtual_time::check_cost_model(cost)?;
    let (s, regions) = setup(p, Box::new(VirtualWaiter))?;
    let mut engine = VirtualTime::new(&s.vm, cost, guests(p, &regions))?;
    run(p, &s, &regions, &mut engine, progress)
}

/// `--compare aging`: each phase's time on each side, then the oracle's verdict.
pub fn compare_text(reports: &[AccessTrackingReport]) -> String {
    let mut s = String::new();
    let p = &reports[0].params;
    let _ = writeln!(
        s,
        "access-tracking --compare aging: {} vCPUs x {} MiB{}, {} MMU, {} engine",
        p.vcpus,
        p.vcpu_bytes >> 20,
        if p.overlap { " overlapped" } else { "" },
        reports[0].mmu,
        reports[0].engine
    );
    if reports[0].mmu != "tdp" {
        let _ = writeln!(
            s,
            "(the {} MMU's clear_young takes mmu_lock for write under either --aging: only the TDP MMU ages without it)",
            reports[0].mmu
        );
    }
    let table = SideBySide {
        label: 30,
        head: 14,
        cell: 18,
        sep: "  ",
    };
    let names: Vec<String> = reports
        .iter()
        .map(|r| format!("--aging {}", aging_label(r.params.aging)))
        .collect();
    table.header(&mut s, names.iter().map(String::as_str));
    for (i, ph) in reports[0].phases.iter().enumerate() {
        let cells = reports.iter().map(|r| fmt_ts(r.phases[i].ns));
        table.row(&mut s, &ph.name, cells);
    }
    let lost: u64 = reports.iter().map(|r| r.oracle.lost_writes).sum();
    let checked: u64 = reports.iter().map(|r| r.oracle.pages_checked).sum();
    let inv = reports
        .iter()
        .map(|r| r.oracle.invariant_errors.len())
        .sum();
    let _ = writeln!(
        s,
        "Oracle: {checked} pages checked, {lost} lost writes; page-table invariants {}",
        crate::lab::report::invariants_verdict(inv)
    );
    s
}
