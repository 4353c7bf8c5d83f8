//! What the integration tests share: a VM with a memslot at [`GPA`], guest writes to it, small
//! `dirty-log` scenarios run with their oracles checked, and counter lookups that fail on a name
//! no run reports.

// Each test crate uses a part of this module.
#![allow(dead_code)]

use vmmu::cost::CostModel;
use vmmu::host::backing::Backing;
use vmmu::lab::dirty_log::oracle_failure;
use vmmu::lab::dirty_log_model::run_dirty_log_threads;
use vmmu::lab::dirty_log_model::run_dirty_log_virtual;
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::{DirtyLogReport, Phase};
use vmmu::units::Gfn;
use vmmu::vm::{MmuKind, Vm, VmConfig};

/// The memslot the VM tests create.
pub const SLOT: u32 = 1;
/// Guest physical address of [`SLOT`].
pub const GPA: u64 = 1 << 30;
/// Bytes in a 4K page.
pub const PAGE: u64 = 4096;

/// A two-vCPU VM with the given MMU and `eager_page_split`, and no memslot.
pub fn two_vcpu_vm(mmu: MmuKind, eager_split: bool) -> Vm {
    Vm::new(VmConfig {
        vcpus: 2,
        eager_page_split: eager_split,
        mmu,
        pml: false,
        kernel: Default::default(),
    })
}

/// Creates [`SLOT`] at [`GPA`], or changes its flags, or deletes it (`bytes` 0).
pub fn set_slot(vm: &Vm, bytes: u64, backing: Backing, flags: u32) {
    vm.set_user_memory_region(SLOT, GPA, bytes, backing, flags)
        .unwrap();
}

/// The gfn of page `page` of [`SLOT`].
pub fn gfn(page: u64) -> Gfn {
    Gfn((GPA >> 12) + page)
}

/// Writes `base + p` to each page `p` of [`SLOT`], from vCPU 0 for even pages and vCPU 1 for
/// odd ones.
pub fn write_pages(vm: &Vm, pages: impl IntoIterator<Item = u64>, base: u64) {
    for p in pages {
        vm.vcpu_write((p % 2) as usize, GPA + p * PAGE, base + p)
            .unwrap();
    }
}

/// Asserts that the VM's page tables keep every invariant, listing the violations.
pub fn assert_invariants(vm: &Vm) {
    let e = vm.check_invariants();
    assert!(e.is_empty(), "{e:#?}");
}

/// A small `dirty-log` scenario: `vcpus` vCPUs with 4 MiB each over `backing`, 3 iterations.
pub fn small(vcpus: usize, backing: Backing) -> DirtyLogParams {
    DirtyLogParams {
        vcpus,
        vcpu_memory_bytes: 4 << 20,
        iterations: 3,
        backing,
        ..Default::default()
    }
}

/// Runs the scenario on the threads engine; the oracles must pass and every iteration's
/// harvest must have been checked.
pub fn run_threads(p: &DirtyLogParams) -> DirtyLogReport {
    let r = run_dirty_log_threads(p, false).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    assert_eq!(oracle_failure(&r.oracle), None, "{p:?}");
    assert_eq!(r.iterations.len(), p.iterations as usize);
    assert!(r.oracle.harvests_checked == p.iterations as u64);
    r
}

/// Runs the scenario in virtual time with the default cost model; the oracles must pass.
pub fn run_virtual(p: &DirtyLogParams) -> DirtyLogReport {
    run_virtual_with(p, &CostModel::default())
}

/// [`run_virtual`] priced with `cost`.
pub fn run_virtual_with(p: &DirtyLogParams, cost: &CostModel) -> DirtyLogReport {
    let r = run_dirty_log_virtual(p, cost, false).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    assert_eq!(oracle_failure(&r.oracle), None, "{p:?}");
    r
}

/// Runs `base` with eager splitting off, then on: `(off, on)`.
pub fn eager_split_off_and_on(
    base: &DirtyLogParams,
    run: impl Fn(&DirtyLogParams) -> DirtyLogReport,
) -> (DirtyLogReport, DirtyLogReport) {
    let with = |eager_split| {
        run(&DirtyLogParams {
            eager_split,
            ..base.clone()
        })
    };
    (with(false), with(true))
}

/// The value of the counter `name` among `counters` (name, value pairs).
///
/// Panics naming `name` and the known counters when there is none by that name, so that a
/// renamed or misspelt counter fails the test rather than reading as 0.
pub fn lookup<'a>(counters: impl IntoIterator<Item = (&'a str, u64)>, name: &str) -> u64 {
    let counters: Vec<(&str, u64)> = counters.into_iter().collect();
    match counters.iter().find(|(n, _)| *n == name) {
        Some((_, v)) => *v,
        None => {
            let known: Vec<&str> = counters.iter().map(|(n, _)| *n).collect();
            panic!(
                "unknown counter `{name}`; known counters: {}",
                known.join(", ")
            )
        }
    }
}

/// The value of the counter `name` in `phase` (see [`lookup`]); the phase must have counters.
pub fn counter(phase: &Phase, name: &str) -> u64 {
    let counters = phase
        .counters
        .as_ref()
        .unwrap_or_else(|| panic!("no counters in the phase to read `{name}` from"));
    lookup(counters.iter().map(|(n, v)| (n.as_str(), *v)), name)
}

/// The MMU statistic `name` of `vm` (see [`lookup`]).
pub fn mmu_stat(vm: &Vm, name: &str) -> u64 {
    lookup(vm.mmu.mmu_stats(), name)
}

/// KVM/arm64's stage-2 MMU as the tests run it by default: faults in parallel under the read
/// lock (Linux 6.x), a 40-bit IPA, eager splitting off, an Altra's CPU features, broadcast
/// flushes on relax.
pub fn stage2_parallel() -> MmuKind {
    MmuKind::Stage2 {
        lock: vmmu::arm64::Arm64Lock::Parallel,
        ia_bits: 40,
        split_chunk_pages: 0,
        cpu: Default::default(),
        relax_flush: Default::default(),
    }
}
