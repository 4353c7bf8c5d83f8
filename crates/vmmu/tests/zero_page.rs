//! The host's shared zero page and its copy on the first write: a read of private anonymous
//! memory nobody wrote maps the zero page read-only, in the host and at stage 2 / in the EPT;
//! the first write copies it inside an MMU-notifier invalidation (with `change_pte` on the
//! kernels that had it), after which every vCPU sees the written value. Negative controls: a
//! host that copies without telling KVM leaves a translation of the zero page behind, and the
//! oracles catch what goes through it.

use std::sync::atomic::Ordering;
use vmmu::host::anon::HostPte;
use vmmu::host::backing::Backing;
use vmmu::host::memory::ZERO_PFN;
use vmmu::kvm::host_fault::ZeroPage;
use vmmu::units::Gfn;
use vmmu::vm::{HostKernel, MmuKind, Vm, VmConfig};

const GPA: u64 = 1 << 30;

fn stage2() -> MmuKind {
    MmuKind::Stage2 {
        lock: vmmu::arm64::Arm64Lock::PermFastPath,
        ia_bits: 40,
        split_chunk_pages: 0,
        cpu: Default::default(),
        relax_flush: Default::default(),
    }
}

fn vm(mmu: MmuKind, zero_page: ZeroPage, vcpus: usize) -> Vm {
    let vm = Vm::new(VmConfig {
        mmu,
        vcpus,
        eager_page_split: false,
        kernel: HostKernel {
            zero_page,
            ..Default::default()
        },
        ..Default::default()
    });
    vm.set_user_memory_region(1, GPA, 64 << 12, Backing::Anonymous, 0)
        .unwrap();
    vm
}

fn host_pte(vm: &Vm, page: u64) -> HostPte {
    let slot = vm.kvm.slot_by_id(1).unwrap();
    vm.kvm
        .host
        .host_pte(slot.gfn_to_pfn(Gfn((GPA >> 12) + page)))
        .expect("anonymous 4K memory has a modelled host page table")
}

fn leaf_pfn(vm: &Vm, page: u64) -> Option<vmmu::units::Pfn> {
    let guard = crossbeam_epoch::pin();
    let mut levels = 0;
    match vm
        .mmu
        .hw_walk(Gfn((GPA >> 12) + page), false, false, &guard, &mut levels)
    {
        vmmu::hw::walker::WalkResult::Translated { leaf_pfn, .. } => Some(leaf_pfn),
        _ => None,
    }
}

#[test]
fn a_read_maps_the_zero_page_and_the_first_write_copies_it_on_every_mmu() {
    for mmu in [MmuKind::Tdp, MmuKind::Shadow { ept: true }, stage2()] {
        for zp in [ZeroPage::ChangePte, ZeroPage::NoChangePte] {
            let vm = vm(mmu, zp, 2);
            assert_eq!(vm.vcpu_read(1, GPA + (5 << 12)).unwrap(), 0);
            assert_eq!(host_pte(&vm, 5), HostPte::Zero, "{mmu:?}");
            assert_eq!(
                leaf_pfn(&vm, 5),
                Some(ZERO_PFN),
                "{mmu:?}: KVM maps the zero page"
            );
            assert!(
                vm.check_invariants().is_empty(),
                "{:?}",
                vm.check_invariants()
            );
            vm.vcpu_write(0, GPA + (5 << 12), 77).unwrap();
            assert_eq!(host_pte(&vm, 5), HostPte::Private);
            // The reader's TLB lost the zero page with the invalidation.
            assert_eq!(
                vm.vcpu_read(1, GPA + (5 << 12)).unwrap(),
                77,
                "{mmu:?} {zp:?}"
            );
            let m = vm.vcpu(0).meter.clone();
            assert_eq!((m.pages_copied, m.unmap_hva_range), (1, 1), "{mmu:?}");
            let change_pte = zp == ZeroPage::ChangePte;
            assert_eq!(m.set_spte_hva, change_pte as u64, "{mmu:?} {zp:?}");
            // An untouched page written first is allocated: no copy, no notifier.
            vm.vcpu_write(0, GPA + (6 << 12), 1).unwrap();
            let m = vm.vcpu(0).meter.clone();
            assert_eq!((m.pages_copied, m.pages_populated), (1, 1));
            assert!(
                vm.check_invariants().is_empty(),
                "{:?}",
                vm.check_invariants()
            );
        }
    }
}

#[test]
fn without_a_zero_page_a_read_allocates() {
    let vm = vm(stage2(), ZeroPage::Off, 1);
    assert_eq!(vm.vcpu_read(0, GPA).unwrap(), 0);
    assert_eq!(host_pte(&vm, 0), HostPte::Private);
    vm.vcpu_write(0, GPA, 3).unwrap();
    let m = vm.vcpu(0).meter.clone();
    assert_eq!(
        (m.pages_populated, m.pages_copied, m.unmap_hva_range),
        (1, 0, 0)
    );
}

/// Arm64 6.1's `change_pte` maps the copy read-only at once, so the write that copied takes a
/// second permission fault (where Linux 6.10 takes a translation fault): two permission faults
/// per page read first, as real KVM/arm64 6.1 took (`tests/arm64_anchor.rs`). It maps without
/// a memory cache, so where `invalidate_range_start` freed the table that held the zero page's
/// leaf (the only page it mapped), it maps nothing and the write faults as on 6.10.
#[test]
fn arm64_change_pte_maps_the_copy_read_only_where_its_table_survives() {
    for (zp, neighbours, perm, xlat) in [
        (ZeroPage::ChangePte, true, 2, 1),
        (ZeroPage::NoChangePte, true, 1, 2),
        (ZeroPage::ChangePte, false, 1, 2),
    ] {
        let vm = vm(stage2(), zp, 1);
        if neighbours {
            vm.vcpu_read(0, GPA + (1 << 12)).unwrap();
        }
        let before = vm.vcpu(0).meter.clone();
        vm.vcpu_read(0, GPA).unwrap();
        vm.vcpu_write(0, GPA, 9).unwrap();
        let m = vm.vcpu(0).meter.since(&before);
        let xlat_faults = m.s2_xlat_fault_l1 + m.s2_xlat_fault_l2 + m.s2_xlat_fault_l3;
        assert_eq!(
            (m.s2_perm_fault_l3, xlat_faults),
            (perm, xlat),
            "{zp:?}, a neighbour mapped: {neighbours}"
        );
        assert!(
            vm.check_invariants().is_empty(),
            "{:?}",
            vm.check_invariants()
        );
    }
}

/// The negative control on arm64: without the notifier, the stage-2 entry of the zero page
/// survives the copy, and the write's permission fault relaxes it (kvm_pgtable_stage2_relax_perms()
/// does not look at the PFN): the guest writes the zero page.
#[test]
fn a_copy_that_kvm_is_not_told_of_lets_the_guest_write_the_zero_page() {
    let vm = vm(stage2(), ZeroPage::ChangePte, 1);
    vm.kvm
        .mmu_invalidate
        .skip_cow_notifier_for_negative_control
        .store(true, Ordering::Relaxed);
    vm.vcpu_read(0, GPA).unwrap();
    vm.vcpu_write(0, GPA, 9).unwrap();
    let errors = vm.check_invariants();
    assert!(
        errors.iter().any(|e| e.contains("zero page was written"))
            && errors.iter().any(|e| e.contains("zero page writable")),
        "{errors:?}"
    );
}

/// The negative control on x86: the zero page's SPTE survives the copy, and the write's fault
/// would replace it with the copy's in place, which KVM refuses (`handle_changed_spte()`'s
/// "cannot replace a present leaf SPTE with another present leaf SPTE mapping a different
/// PFN", a `KVM_BUG_ON()`): the notifier is what zaps it first.
#[test]
fn a_copy_that_kvm_is_not_told_of_leaves_a_zero_page_spte_kvm_cannot_replace() {
    let vm = vm(MmuKind::Tdp, ZeroPage::ChangePte, 2);
    vm.kvm
        .mmu_invalidate
        .skip_cow_notifier_for_negative_control
        .store(true, Ordering::Relaxed);
    vm.vcpu_read(1, GPA).unwrap();
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        vm.vcpu_write(0, GPA, 9).unwrap();
    }))
    .expect_err("replacing the zero page's SPTE in place must be refused");
    let msg = err
        .downcast_ref::<String>()
        .map(String::as_str)
        .unwrap_or("");
    assert!(msg.contains("with another PFN"), "{msg}");
}

/// Transparent huge pages: a read maps the huge zero folio (a 2M leaf of it); the first write
/// splits the PMD into zero-page PTEs (an invalidation of the 2 MiB) and copies its own page
/// (another), and the 2 MiB is mapped at 4K from then on.
#[test]
fn a_read_maps_the_huge_zero_folio_and_the_first_write_splits_it() {
    for mmu in [MmuKind::Tdp, stage2()] {
        let vm = Vm::new(VmConfig {
            mmu,
            vcpus: 1,
            eager_page_split: false,
            ..Default::default()
        });
        vm.set_user_memory_region(1, GPA, 4 << 20, Backing::AnonymousThp, 0)
            .unwrap();
        let slot = vm.kvm.slot_by_id(1).unwrap();
        let pmd = |page: u64| {
            vm.kvm
                .host
                .host_pmd(slot.gfn_to_pfn(Gfn((GPA >> 12) + page)))
        };
        assert_eq!(vm.vcpu_read(0, GPA + (3 << 12)).unwrap(), 0);
        assert_eq!(pmd(0), Some(vmmu::host::anon::HostPmd::HugeZero));
        assert_eq!(
            leaf_pfn(&vm, 0),
            Some(vmmu::host::memory::HUGE_ZERO_PFN),
            "{mmu:?}: a 2M leaf of the huge zero folio"
        );
        assert!(
            vm.check_invariants().is_empty(),
            "{:?}",
            vm.check_invariants()
        );
        vm.vcpu_write(0, GPA + (5 << 12), 55).unwrap();
        assert_eq!(pmd(0), Some(vmmu::host::anon::HostPmd::Split));
        assert_eq!(
            (host_pte(&vm, 5), host_pte(&vm, 6)),
            (HostPte::Private, HostPte::Zero)
        );
        assert_eq!(vm.vcpu_read(0, GPA + (6 << 12)).unwrap(), 0);
        assert_eq!(leaf_pfn(&vm, 6), Some(ZERO_PFN), "{mmu:?}: 4K from now on");
        assert_eq!(vm.vcpu_read(0, GPA + (5 << 12)).unwrap(), 55);
        let m = vm.vcpu(0).meter.clone();
        assert_eq!(
            (m.huge_zero_splits, m.pages_copied, m.unmap_hva_range),
            (1, 1, 2),
            "{mmu:?}"
        );
        // A write to untouched 2 MiB allocates a huge page of its own.
        vm.vcpu_write(0, GPA + (512 << 12), 1).unwrap();
        assert_eq!(pmd(512), Some(vmmu::host::anon::HostPmd::Huge));
        assert_eq!(vm.vcpu(0).meter.huge_pages_populated, 1);
        assert!(
            vm.check_invariants().is_empty(),
            "{:?}",
            vm.check_invariants()
        );
    }
}
