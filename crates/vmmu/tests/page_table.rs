//! The `page-table` scenario (kvm_page_table_test) on both engines: the oracles pass on every
//! MMU, and with one vCPU the threads engine takes exactly the faults virtual time does.

use vmmu::arm64::Arm64Lock;
use vmmu::cost::CostModel;
use vmmu::host::backing::Backing;
use vmmu::lab::page_table::{run_page_table_threads, run_page_table_virtual, PageTableParams};
use vmmu::vm::MmuKind;

fn stage2() -> MmuKind {
    MmuKind::Stage2 {
        lock: Arm64Lock::Parallel,
        ia_bits: 40,
        split_chunk_pages: 0,
        cpu: Default::default(),
        relax_flush: Default::default(),
    }
}

/// The fault and mapping counters of each stage.
fn faults(r: &vmmu::lab::page_table::PageTableReport) -> Vec<(String, u64, u64, u64)> {
    r.stages
        .iter()
        .map(|s| {
            let c = s.phase.counters.as_ref().unwrap();
            let get = |k: &str| c.get(k).copied().unwrap_or(0);
            (
                s.stage.clone(),
                get("ept_violations"),
                get("mapped_4k"),
                get("mapped_2m"),
            )
        })
        .collect()
}

#[test]
fn every_mmu_passes_the_oracles_on_both_engines() {
    for (mmu, mode, backing) in [
        (MmuKind::Tdp, None, Backing::AnonymousThp),
        (
            MmuKind::Shadow { ept: true },
            None,
            Backing::AnonymousHugetlb2mb,
        ),
        (stage2(), Some(5), Backing::AnonymousHugetlb2mb),
        (stage2(), Some(5), Backing::Anonymous),
    ] {
        let p = PageTableParams {
            vcpus: 2,
            test_mem_bytes: 8 << 20,
            backing,
            mmu,
            guest_mode: mode,
            eager_split: mode.is_none(),
            backward_pages: 16,
            ..Default::default()
        };
        let cost = if mode.is_some() {
            CostModel::default_arm64()
        } else {
            CostModel::default()
        };
        for r in [
            run_page_table_threads(&p, false, &mut |_| {}).unwrap(),
            run_page_table_virtual(&p, &cost, false, &mut |_| {}).unwrap(),
        ] {
            assert!(r.oracle.passed(), "{mmu:?} {backing}: {:?}", r.oracle);
            assert!(
                r.oracle.pages_checked > 0,
                "{mmu:?}: the update stage wrote"
            );
            let unmap = r.stages.last().unwrap();
            assert_eq!(unmap.stage, "KVM_UNMAP_VM");
            let c = unmap.phase.counters.as_ref().unwrap();
            assert_eq!(
                (c["mapped_4k"], c["mapped_2m"]),
                (0, 0),
                "{mmu:?}: the VM is unmapped"
            );
        }
    }
}

#[test]
fn one_vcpu_takes_the_same_faults_on_both_engines() {
    for (mmu, mode) in [(MmuKind::Tdp, None), (stage2(), Some(5))] {
        let p = PageTableParams {
            test_mem_bytes: 8 << 20,
            backing: Backing::AnonymousHugetlb2mb,
            mmu,
            guest_mode: mode,
            eager_split: false,
            ..Default::default()
        };
        let cost = if mode.is_some() {
            CostModel::default_arm64()
        } else {
            CostModel::default()
        };
        let threads = run_page_table_threads(&p, false, &mut |_| {}).unwrap();
        let virt = run_page_table_virtual(&p, &cost, false, &mut |_| {}).unwrap();
        assert_eq!(faults(&threads), faults(&virt), "{mmu:?}");
    }
}
