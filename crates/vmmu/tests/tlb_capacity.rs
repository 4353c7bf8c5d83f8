//! The vCPU's TLB as a core has it, through the VM API: combined entries at the guest's 4K
//! page even over a 1G stage-2 block, the stage-2 entry and the walk entry that make the next
//! miss cheap, and a TLBI of the VMID (or KVM_REQ_TLB_FLUSH) that throws them all away, on both
//! architectures.

use vmmu::arm64::{Arm64Cpu, Arm64Lock, RelaxFlush};
use vmmu::host::backing::Backing;
use vmmu::kvm::meter::Meter;
use vmmu::vm::{MmuKind, Vm, VmConfig};

const GPA: u64 = 1 << 30;

/// A one-vCPU VM of `mmu` with 1 GiB of 1G hugetlb memory at `GPA`.
fn vm(mmu: MmuKind) -> Vm {
    vm_backed(mmu, Backing::AnonymousHugetlb1gb, 1 << 30)
}

/// A one-vCPU VM of `mmu` with `bytes` of `backing` at `GPA`.
fn vm_backed(mmu: MmuKind, backing: Backing, bytes: u64) -> Vm {
    let vm = Vm::new(VmConfig {
        vcpus: 1,
        eager_page_split: false,
        mmu,
        pml: false,
        kernel: Default::default(),
    });
    vm.set_user_memory_region(1, GPA, bytes, backing, 0)
        .unwrap();
    vm
}

fn stage2() -> MmuKind {
    MmuKind::Stage2 {
        lock: Arm64Lock::Parallel,
        ia_bits: 40,
        split_chunk_pages: 0,
        cpu: Arm64Cpu::default(),
        relax_flush: RelaxFlush::default(),
    }
}

/// What vCPU 0 counted while `f` ran.
fn counted(vm: &Vm, f: impl FnOnce()) -> Meter {
    let before = vm.vcpu(0).meter.clone();
    f();
    vm.vcpu(0).meter.since(&before)
}

#[test]
fn a_4k_guest_page_over_a_1g_block_misses_once_per_page_and_walks_stage_2_once() {
    for mmu in [MmuKind::Tdp, stage2()] {
        let vm = vm(mmu);
        // The first access faults in the 1G block; the walk that retries it loads a stage-2
        // entry and the walk entry of its 2M region.
        vm.vcpu_write(0, GPA, 1).unwrap();
        // Another 4K page of the block: a miss (a new combined entry), stage 2 from the stage-2
        // entry (no level read), stage 1 from the walk entry (no level above the leaf).
        let m = counted(&vm, || vm.vcpu_write(0, GPA + 4096, 2).unwrap());
        assert_eq!(
            (m.hw_walks, m.hw_walk_levels, m.s1_walk_levels, m.tlb_hits),
            (1, 0, 0, 0),
            "{mmu:?}: {m:?}"
        );
        // The same page again hits.
        let m = counted(&vm, || vm.vcpu_write(0, GPA + 4096 + 8, 3).unwrap());
        assert_eq!((m.hw_walks, m.tlb_hits), (0, 1), "{mmu:?}: {m:?}");
        // A page in another 2M region of the block: the guest's walk reads the level-2 entry
        // (the 1 GiB region's walk entry holds where its table is) and translates the
        // last-level table, whose 2 MiB of guest tables has a stage-2 walk entry: one stage-2
        // leaf. Stage 2 of the page still comes from the stage-2 entry.
        let m = counted(&vm, || vm.vcpu_write(0, GPA + (2 << 20), 4).unwrap());
        assert_eq!(
            (
                m.hw_walks,
                m.hw_walk_levels,
                m.s1_walk_levels,
                m.s1_table_s2_levels
            ),
            (1, 0, 1, 1),
            "{mmu:?}: {m:?}"
        );
        // The model keeps one word per page: the last write to the page.
        assert_eq!(vm.vcpu_read(0, GPA + 4096).unwrap(), 3);
    }
}

#[test]
fn a_full_flush_throws_away_combined_stage2_and_walk_entries() {
    for mmu in [MmuKind::Tdp, stage2()] {
        let vm = vm(mmu);
        vm.vcpu_write(0, GPA, 1).unwrap();
        vm.vcpu_write(0, GPA + 4096, 1).unwrap();
        let mut meter = Meter::default();
        vm.kvm.flush_remote_tlbs(&mut meter);
        let m = counted(&vm, || vm.vcpu_write(0, GPA + 4096, 2).unwrap());
        assert_eq!(m.hw_walks, 1, "{mmu:?}: {m:?}");
        assert!(m.hw_walk_levels > 0, "stage 2 walked again: {mmu:?}: {m:?}");
        assert_eq!(
            m.s1_walk_levels, 3,
            "the walk entries went too: {mmu:?}: {m:?}"
        );
        // And the stage-2 walk entries of the guest's tables: the root's and the last-level
        // table's 2 MiB regions are walked in full (4 levels of EPT; 3 of a 40-bit IPA's stage
        // 2), the level-1 and level-2 tables share the root's.
        let full = vm.mmu.stage2_walk_levels();
        assert_eq!(full, if mmu == MmuKind::Tdp { 4 } else { 3 });
        assert_eq!(
            m.s1_table_s2_levels,
            2 * full + 2,
            "the guest's tables translated again: {mmu:?}: {m:?}"
        );
    }
}

#[test]
fn the_l1_holds_what_the_core_holds_and_the_l2_catches_the_rest() {
    // Neoverse-N1: 48 L1 entries. Touching 64 pages and then the first again hits in the L2.
    let vm = vm(stage2());
    for p in 0..64 {
        vm.vcpu_write(0, GPA + p * 4096, p).unwrap();
    }
    let m = counted(&vm, || {
        vm.vcpu_read(0, GPA).unwrap();
    });
    assert_eq!((m.tlb_hits, m.tlb_l2_hits, m.hw_walks), (1, 1, 0), "{m:?}");
    let m = counted(&vm, || {
        vm.vcpu_read(0, GPA + 63 * 4096).unwrap();
    });
    assert_eq!(
        (m.tlb_hits, m.tlb_l2_hits),
        (1, 0),
        "the last 48 are in L1: {m:?}"
    );
}

#[test]
fn a_stage2_walk_entry_spares_the_upper_levels_of_a_4k_leafs_walk() {
    for mmu in [MmuKind::Tdp, stage2()] {
        let vm = vm_backed(mmu, Backing::Anonymous, 4 << 20);
        // Two 4K pages of one 2M region mapped, then every cached translation dropped.
        for p in 0..2 {
            vm.vcpu_write(0, GPA + p * 4096, p).unwrap();
        }
        vm.kvm.flush_remote_tlbs(&mut Meter::default());
        let full = vm.mmu.stage2_walk_levels();
        let m = counted(&vm, || vm.vcpu_write(0, GPA, 7).unwrap());
        assert_eq!(
            (m.hw_walks, m.hw_walk_levels),
            (1, full),
            "{mmu:?}: the first walk after the flush reads every level: {m:?}"
        );
        let m = counted(&vm, || vm.vcpu_write(0, GPA + 4096, 7).unwrap());
        assert_eq!(
            (m.hw_walks, m.hw_walk_levels),
            (1, 1),
            "{mmu:?}: the next in the region reads its leaf only: {m:?}"
        );
    }
}
