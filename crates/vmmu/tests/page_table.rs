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

/// The run of `p` on each engine (virtual time with the architecture's default costs).
fn on_both_engines(p: &PageTableParams) -> [vmmu::lab::page_table::PageTableReport; 2] {
    let cost = if p.guest_mode.is_some() {
        CostModel::default_arm64()
    } else {
        CostModel::default()
    };
    [
        run_page_table_threads(p, false, &mut |_| {}).unwrap(),
        run_page_table_virtual(p, &cost, false, &mut |_| {}).unwrap(),
    ]
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
        for r in on_both_engines(&p) {
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

/// `kvm_vm_free()`'s teardown: the memslot deletion, then the `munmap()` of its backing, whose
/// host-side work frees exactly what the run populated; `KVM_UNMAP_VM` is the two together.
#[test]
fn unmapping_the_vm_is_the_memslot_deletion_then_the_munmap_of_every_page() {
    let mib = 8u64;
    for (mmu, mode, backing) in [
        (MmuKind::Tdp, None, Backing::Anonymous),
        (MmuKind::Tdp, None, Backing::AnonymousThp),
        (stage2(), Some(5), Backing::AnonymousHugetlb2mb),
    ] {
        let p = PageTableParams {
            vcpus: 2,
            test_mem_bytes: mib << 20,
            backing,
            mmu,
            guest_mode: mode,
            ..Default::default()
        };
        for r in on_both_engines(&p) {
            assert!(r.oracle.passed(), "{backing}: {:?}", r.oracle);
            let n = r.stages.len();
            let [deletion, munmap, total] = &r.stages[n - 3..] else {
                unreachable!()
            };
            assert_eq!(
                (
                    deletion.stage.as_str(),
                    munmap.stage.as_str(),
                    total.stage.as_str()
                ),
                (
                    "KVM_UNMAP_VM_DELETE_MEMSLOT",
                    "KVM_UNMAP_VM_MUNMAP",
                    "KVM_UNMAP_VM"
                )
            );
            assert_eq!(
                total.phase.wall_ns,
                deletion.phase.wall_ns + munmap.phase.wall_ns
            );
            let c = munmap.phase.counters.as_ref().unwrap();
            let get = |k: &str| c.get(k).copied().unwrap_or(0);
            // The deletion zapped KVM's mappings: the munmap finds no memslot and takes no lock.
            assert_eq!(get("mmu_lock_write_acquired"), 0, "{backing}");
            assert_eq!(get("mmu_notifier_calls"), 2, "{backing}");
            let pages = mib << 8;
            match backing {
                // Every page of the region was written in the update stage: each is its own.
                Backing::Anonymous => {
                    assert_eq!(
                        (get("host_ptes_zapped"), get("host_pages_freed")),
                        (pages, pages)
                    )
                }
                // Each 2 MiB piece is mapped one way or another, and only written pages are
                // freed: no more than the region, at least one per piece.
                Backing::AnonymousThp => {
                    let freed = get("host_pages_freed") + 512 * get("host_huge_pages_freed");
                    assert!(
                        (pages / 512..=pages).contains(&freed),
                        "{freed} of {pages} pages freed"
                    );
                }
                _ => assert_eq!(
                    (get("host_huge_zapped"), get("host_huge_pages_freed")),
                    (pages / 512, pages / 512)
                ),
            }
        }
    }
}
