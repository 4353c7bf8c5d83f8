//! KVM_GET_DIRTY_LOG / KVM_CLEAR_DIRTY_LOG / dirty ring semantics through the VM API, and a
//! demonstration that the TLB model makes a missing flush lose writes.

mod common;

use common::{assert_invariants, set_slot, two_vcpu_vm, write_pages, GPA, PAGE, SLOT};
use vmmu::host::backing::Backing;
use vmmu::kvm::meter::Meter;
use vmmu::kvm::op_plan::OpStep;
use vmmu::vm::plan::run_plan;
use vmmu::vm::{MmuKind, Vm, KVM_MEM_LOG_DIRTY_PAGES};

/// Pages in the memslot.
const PAGES: u64 = 1024;

/// A two-vCPU VM with a `PAGES`-page memslot over `backing`, and manual protect enabled (with
/// its initially-all-set flag) when `manual` says so.
fn vm(manual: Option<bool>, backing: Backing) -> Vm {
    let vm = two_vcpu_vm(MmuKind::Tdp, true);
    if let Some(init) = manual {
        vm.enable_manual_dirty_log_protect(init).unwrap();
    }
    set_slot(&vm, PAGES * PAGE, backing, 0);
    vm
}

/// Enables dirty logging on the memslot.
fn log_dirty_pages(vm: &Vm, backing: Backing) {
    set_slot(vm, PAGES * PAGE, backing, KVM_MEM_LOG_DIRTY_PAGES);
}

fn bits(bitmap: &[u64]) -> Vec<u64> {
    (0..bitmap.len() as u64 * 64)
        .filter(|i| bitmap[(*i / 64) as usize] & (1 << (i % 64)) != 0)
        .collect()
}

#[test]
fn get_without_manual_protect_reports_and_clears() {
    for backing in [Backing::Anonymous, Backing::AnonymousHugetlb2mb] {
        let vm = vm(None, backing);
        write_pages(&vm, [0, 1, 700], 1);
        log_dirty_pages(&vm, backing);
        assert!(
            bits(&vm.get_dirty_log(SLOT).unwrap()).is_empty(),
            "writes before logging are not logged"
        );
        write_pages(&vm, [3, 64, 700, 1023], 1);
        assert_eq!(
            bits(&vm.get_dirty_log(SLOT).unwrap()),
            vec![3, 64, 700, 1023]
        );
        assert!(
            bits(&vm.get_dirty_log(SLOT).unwrap()).is_empty(),
            "GET cleared and re-protected"
        );
        write_pages(&vm, [64, 65], 1);
        assert_eq!(bits(&vm.get_dirty_log(SLOT).unwrap()), vec![64, 65]);
        assert_invariants(&vm);
        assert!(
            vm.clear_dirty_log(SLOT, 0, 64, &[u64::MAX]).is_err(),
            "CLEAR needs manual protect"
        );
        for p in [3u64, 64, 700, 1023] {
            assert_eq!(vm.vcpu_read(0, GPA + p * PAGE).unwrap(), p + 1);
        }
    }
}

#[test]
fn manual_protect_get_copies_and_clear_reprotects_only_cleared_bits() {
    let vm = vm(Some(false), Backing::AnonymousHugetlb2mb);
    log_dirty_pages(&vm, Backing::AnonymousHugetlb2mb);
    write_pages(&vm, [1, 2, 130], 1);
    let b = vm.get_dirty_log(SLOT).unwrap();
    assert_eq!(bits(&b), vec![1, 2, 130]);
    assert_eq!(
        bits(&vm.get_dirty_log(SLOT).unwrap()),
        vec![1, 2, 130],
        "GET alone clears nothing"
    );
    // Clear only page 1 (first 64 pages).
    vm.clear_dirty_log(SLOT, 0, 64, &[1 << 1]).unwrap();
    assert_eq!(bits(&vm.get_dirty_log(SLOT).unwrap()), vec![2, 130]);
    write_pages(&vm, [1, 2], 1);
    assert_eq!(
        bits(&vm.get_dirty_log(SLOT).unwrap()),
        vec![1, 2, 130],
        "page 1 was re-protected and logged again"
    );
    vm.clear_dirty_log(SLOT, 0, PAGES, &vm.get_dirty_log(SLOT).unwrap())
        .unwrap();
    assert!(bits(&vm.get_dirty_log(SLOT).unwrap()).is_empty());
    assert_invariants(&vm);
}

#[test]
fn clear_dirty_log_rejects_ranges_kvm_rejects() {
    let vm = vm(Some(false), Backing::Anonymous);
    log_dirty_pages(&vm, Backing::Anonymous);
    let ones = vec![u64::MAX; 16];
    assert!(
        vm.clear_dirty_log(SLOT, 1, 64, &ones).is_err(),
        "first_page not 64-aligned"
    );
    assert!(
        vm.clear_dirty_log(SLOT, 0, 100, &ones).is_err(),
        "num_pages not a multiple of 64"
    );
    assert!(
        vm.clear_dirty_log(SLOT, 960, 100, &ones).is_err(),
        "past the end of the slot"
    );
    assert!(
        vm.clear_dirty_log(SLOT, 1024, 64, &ones).is_err(),
        "starts past the end"
    );
    assert!(vm.clear_dirty_log(2, 0, 64, &ones).is_err(), "no such slot");
    vm.clear_dirty_log(SLOT, 960, 64, &ones).unwrap();
}

#[test]
fn initially_all_set_reports_everything_then_splits_on_first_clear() {
    let vm = vm(Some(true), Backing::AnonymousHugetlb2mb);
    write_pages(&vm, (0..PAGES).step_by(8), 1);
    assert_eq!(vm.mmu.page_stats(), [0, 2, 0], "two 2M mappings");
    log_dirty_pages(&vm, Backing::AnonymousHugetlb2mb);
    let b = vm.get_dirty_log(SLOT).unwrap();
    assert_eq!(bits(&b).len(), PAGES as usize, "initially all set");
    assert_eq!(
        vm.mmu.page_stats(),
        [0, 2, 0],
        "enabling logging did not split"
    );
    // Clear the first 64 pages: eager split of the first 2M page only.
    vm.clear_dirty_log(SLOT, 0, 64, &b[..1]).unwrap();
    assert_eq!(vm.mmu.page_stats(), [512, 1, 0]);
    write_pages(&vm, [5], 1);
    let b = vm.get_dirty_log(SLOT).unwrap();
    assert_eq!(bits(&b).len(), PAGES as usize - 64 + 1);
    assert_invariants(&vm);
}

#[test]
fn dirty_ring_collects_entries_and_reset_reprotects() {
    let vm = two_vcpu_vm(MmuKind::Tdp, true);
    assert!(vm.enable_dirty_ring(100).is_err(), "not a power of two");
    vm.enable_dirty_ring(4096).unwrap();
    set_slot(&vm, PAGES * PAGE, Backing::Anonymous, 0);
    assert!(vm.enable_dirty_ring(4096).is_err(), "too late");
    write_pages(&vm, [0, 1], 1);
    log_dirty_pages(&vm, Backing::Anonymous);
    assert!(vm.get_dirty_log(SLOT).is_err(), "no bitmap with the ring");
    write_pages(&vm, [0, 1, 2, 3], 1);
    assert_eq!(vm.dirty_ring_harvest(0), vec![(1, 0), (1, 2)]);
    assert_eq!(vm.dirty_ring_harvest(1), vec![(1, 1), (1, 3)]);
    write_pages(&vm, [0], 1);
    assert!(
        vm.dirty_ring_harvest(0).is_empty(),
        "still writable until reset"
    );
    assert_eq!(vm.reset_dirty_rings().unwrap(), 4);
    write_pages(&vm, [0, 3], 1);
    assert_eq!(vm.dirty_ring_harvest(0), vec![(1, 0)]);
    assert_eq!(vm.dirty_ring_harvest(1), vec![(1, 3)]);
}

/// The negative control for the TLB model and the oracle: enabling logging *without* the
/// memslot flush leaves a writable translation in the vCPU's TLB, and the next write is not
/// logged. With the flush (the real plan) it is.
#[test]
fn a_missing_flush_loses_a_write() {
    for with_flush in [true, false] {
        let vm = vm(None, Backing::Anonymous);
        write_pages(&vm, [10], 1);
        let slot = vm.kvm.slot_by_id(SLOT).unwrap();
        let mut plan =
            vmmu::kvm::dirty_log::set_memslot_flags_plan(&vm.kvm, &slot, KVM_MEM_LOG_DIRTY_PAGES);
        if !with_flush {
            plan.steps.retain(|s| !matches!(s, OpStep::FlushMemslot(_)));
        }
        run_plan(&vm.kvm, plan, &mut Meter::default());
        write_pages(&vm, [10], 1);
        let logged = bits(&vm.get_dirty_log(SLOT).unwrap()) == vec![10];
        assert_eq!(logged, with_flush, "with_flush={with_flush}");
    }
}
