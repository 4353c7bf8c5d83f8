//! arm64 stage 2 through the VM API: access-flag faults and aging, memslot deletion freeing
//! tables by reference count, blocks split by a logging write and collapsed back by a fault once
//! logging is off, and TLB maintenance by broadcast, by VMID or by range (FEAT_TLBIRANGE).

mod common;

use common::assert_invariants;
use vmmu::arm64::{Arm64Cpu, Arm64Lock, RelaxFlush};
use vmmu::host::backing::Backing;
use vmmu::units::Gfn;
use vmmu::vm::{MmuKind, Vm, VmConfig, KVM_MEM_LOG_DIRTY_PAGES};

const GPA: u64 = 1 << 30;

fn vm(lock: Arm64Lock) -> Vm {
    vm_on(lock, Arm64Cpu::default())
}

fn vm_on(lock: Arm64Lock, cpu: Arm64Cpu) -> Vm {
    vm_with(1, lock, cpu, RelaxFlush::default())
}

fn vm_with(vcpus: usize, lock: Arm64Lock, cpu: Arm64Cpu, relax_flush: RelaxFlush) -> Vm {
    Vm::new(VmConfig {
        vcpus,
        eager_page_split: false,
        mmu: MmuKind::Stage2 {
            lock,
            ia_bits: 40,
            split_chunk_pages: 0,
            cpu,
            relax_flush,
        },
        pml: false,
        kernel: Default::default(),
    })
}

/// Slot 1 at [`GPA`] of `pages` pages, its first page written by vCPU 0, then dirty logging
/// enabled without manual protect (so every page is write-protected).
fn logging_after_a_write(vm: &Vm, pages: u64) {
    vm.enable_manual_dirty_log_protect(false).unwrap();
    vm.set_user_memory_region(1, GPA, pages << 12, Backing::Anonymous, 0)
        .unwrap();
    vm.vcpu_write(0, GPA, 1).unwrap();
    enable_logging(vm, pages);
}

/// `KVM_MEM_LOG_DIRTY_PAGES` on slot 1 (anonymous memory at [`GPA`], `pages` pages).
fn enable_logging(vm: &Vm, pages: u64) {
    vm.set_user_memory_region(
        1,
        GPA,
        pages << 12,
        Backing::Anonymous,
        KVM_MEM_LOG_DIRTY_PAGES,
    )
    .unwrap();
}

/// Whether vCPU 0's TLB still caches a translation of `gpa`, after applying every broadcast
/// posted to it.
fn cached(vm: &Vm, gpa: u64) -> bool {
    let mut v = vm.vcpu(0);
    vm.kvm.vcpus[0].tlb_shootdown().sync(&mut v.tlb);
    v.tlb.lookup(Gfn(gpa >> 12)).is_some()
}

#[test]
fn an_aged_page_takes_an_access_flag_fault_that_sets_af_again() {
    for lock in Arm64Lock::ALL {
        let vm = vm(lock);
        vm.set_user_memory_region(1, GPA, 16 << 12, Backing::Anonymous, 0)
            .unwrap();
        vm.vcpu_write(0, GPA, 7).unwrap();
        let pgt = &vm.stage2().unwrap().pgt;
        let guard = crossbeam_epoch::pin();
        let mut m = vmmu::kvm::meter::Meter::default();
        let gfn = Gfn(GPA >> 12);
        let end = gfn + 16;
        let held = vm.kvm.mmu_lock.lock(vmmu::kvm::mmu_lock::LockMode::Write);
        assert!(pgt.kvm_pgtable_stage2_test_clear_young(gfn, end, true, &guard, &mut m));
        assert!(!pgt.kvm_pgtable_stage2_test_clear_young(gfn, end, false, &guard, &mut m));
        drop(held);
        // The TLB still holds the translation; a flush makes the CPU walk and see AF clear.
        vm.kvm.flush_remote_tlbs(&mut m);
        let run = vm.vcpu_run(0, [(gfn, false)]).unwrap();
        assert_eq!(run.s2_access_fault, 1, "{lock:?}: {run:?}");
        assert_eq!(vm.vcpu_read(0, GPA).unwrap(), 7);
        let held = vm.kvm.mmu_lock.lock(vmmu::kvm::mmu_lock::LockMode::Write);
        assert!(pgt.kvm_pgtable_stage2_test_clear_young(gfn, end, false, &guard, &mut m));
        drop(held);
        assert_invariants(&vm);
    }
}

#[test]
fn deleting_a_memslot_unmaps_it_and_frees_its_tables() {
    let vm = vm(Arm64Lock::Parallel);
    let live = || {
        vm.kvm
            .tables
            .live
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let empty = live();
    vm.set_user_memory_region(1, GPA, 1024 << 12, Backing::Anonymous, 0)
        .unwrap();
    for p in 0..1024 {
        vm.vcpu_write(0, GPA + p * 4096, p).unwrap();
    }
    assert_eq!(vm.mmu.page_stats(), [1024, 0, 0]);
    assert_invariants(&vm);
    vm.set_user_memory_region(1, GPA, 0, Backing::Anonymous, 0)
        .unwrap();
    assert_eq!(vm.mmu.page_stats(), [0, 0, 0]);
    assert_invariants(&vm);
    // Level-1, level-2 and two level-3 tables went back through RCU (the vCPU's cache keeps
    // what it topped up).
    for _ in 0..64 {
        crossbeam_epoch::pin().flush();
    }
    let cached = live() - empty;
    assert!(
        cached <= 40,
        "{cached} tables left beyond the vCPU's memory cache"
    );
}

#[test]
fn a_logging_write_splits_a_block_and_a_fault_after_logging_collapses_it() {
    let vm = vm(Arm64Lock::PermFastPath);
    vm.set_user_memory_region(1, GPA, 1024 << 12, Backing::AnonymousHugetlb2mb, 0)
        .unwrap();
    vm.vcpu_write(0, GPA, 1).unwrap();
    vm.vcpu_write(0, GPA + (512 << 12), 1).unwrap();
    assert_eq!(vm.mmu.page_stats(), [0, 2, 0]);
    vm.set_user_memory_region(
        1,
        GPA,
        1024 << 12,
        Backing::AnonymousHugetlb2mb,
        KVM_MEM_LOG_DIRTY_PAGES,
    )
    .unwrap();
    let run = vm.vcpu_run(0, [(Gfn((GPA >> 12) + 3), true)]).unwrap();
    assert_eq!(
        (run.s2_perm_fault_l2, run.split_in_fault),
        (1, 1),
        "{run:?}"
    );
    // Only the written page is mapped in the new table; its neighbour faults in as a page.
    let run = vm.vcpu_run(0, [(Gfn((GPA >> 12) + 4), true)]).unwrap();
    assert_eq!(run.s2_xlat_fault_l3, 1, "{run:?}");
    assert_eq!(vm.mmu.page_stats(), [2, 1, 0]);
    assert_invariants(&vm);
    vm.set_user_memory_region(1, GPA, 1024 << 12, Backing::AnonymousHugetlb2mb, 0)
        .unwrap();
    // An unmapped page of the split block faults and is mapped as the block again.
    let run = vm.vcpu_run(0, [(Gfn((GPA >> 12) + 5), false)]).unwrap();
    assert_eq!(
        (run.s2_xlat_fault_l3, run.huge_recovered),
        (1, 1),
        "{run:?}"
    );
    assert_eq!(vm.mmu.page_stats(), [0, 2, 0]);
    assert_eq!(
        vm.vcpu_read(0, GPA).unwrap(),
        1,
        "the block maps the same memory"
    );
    assert_invariants(&vm);
}

#[test]
fn relaxing_a_permission_broadcasts_tlbis_with_no_ipi() {
    let vm = vm(Arm64Lock::PermFastPath);
    logging_after_a_write(&vm, 64);
    let before = vm.vmm_meter();
    assert!(
        before.tlbi_ops >= 1 && before.flush_kicks == 0,
        "{before:?}"
    );
    let run = vm.vcpu_run(0, [(Gfn(GPA >> 12), true)]).unwrap();
    // Under the read lock: IPAS2E1IS + DSB + VMALLE1IS + DSB.
    assert_eq!(
        (
            run.s2_perm_fault_l3,
            run.tlbi_ops,
            run.dsb_waits,
            run.flush_kicks
        ),
        (1, 2, 2, 0),
        "{run:?}"
    );
    assert_eq!(
        vm.kvm.mmu_lock.stats.snapshot()["mmu_lock_read_acquired"],
        1
    );
    assert_invariants(&vm);
}

#[test]
fn with_feat_tlbirange_write_protecting_a_memslot_flushes_its_range() {
    for tlbi_range in [false, true] {
        let cpu = Arm64Cpu {
            tlbi_range,
            fwb: false,
        };
        let vm = vm_on(Arm64Lock::Parallel, cpu);
        vm.enable_manual_dirty_log_protect(false).unwrap();
        vm.set_user_memory_region(1, GPA, 16 << 12, Backing::Anonymous, 0)
            .unwrap();
        vm.vcpu_write(0, GPA, 1).unwrap();
        assert!(cached(&vm, GPA));
        let before = vm.vmm_meter();
        enable_logging(&vm, 16);
        let m = vm.vmm_meter().since(&before);
        // Without: KVM core's full flush, TLBI VMALLS12E1IS. With: the architecture's range
        // flush, one RIPAS2E1IS for the 16 pages (scale 0, NUM 7), then TLBI VMALLE1IS.
        let want = if tlbi_range { (0, 2) } else { (1, 1) };
        assert_eq!((m.remote_flushes, m.tlbi_ops), want, "{m:?}");
        assert!(
            !cached(&vm, GPA),
            "the protected page's translation is gone"
        );
        assert_invariants(&vm);
    }
}

/// With FEAT_TLBIRANGE and FEAT_S2FWB the unmap walk clears leaves without TLBIs and flushes
/// the range once at the end (`stage2_unmap_defer_tlb_flush()`). The TLB coherence oracle —
/// a guest access after the unmap completed must not use a translation the unmap removed —
/// holds, and catches the walk that skips the deferred flush (negative control). The deleted
/// slot shares its last-level table with another slot, so no table is freed and no table
/// TLBI hides the missing flush.
#[test]
fn a_deferred_unmap_flush_is_needed_and_skipping_it_is_caught() {
    let cpu = Arm64Cpu {
        tlbi_range: true,
        fwb: true,
    };
    for skip in [false, true] {
        let vm = vm_on(Arm64Lock::Parallel, cpu);
        vm.set_user_memory_region(1, GPA, 16 << 12, Backing::Anonymous, 0)
            .unwrap();
        vm.set_user_memory_region(2, GPA + (16 << 12), 16 << 12, Backing::Anonymous, 0)
            .unwrap();
        vm.vcpu_write(0, GPA + 4096, 5).unwrap();
        vm.vcpu_write(0, GPA + (16 << 12), 6).unwrap();
        let pgt = &vm.stage2().unwrap().pgt;
        pgt.skip_deferred_unmap_flush
            .store(skip, std::sync::atomic::Ordering::Relaxed);
        let before = vm.vmm_meter();
        vm.set_user_memory_region(1, GPA, 0, Backing::Anonymous, 0)
            .unwrap();
        let unmap = vm.vmm_meter().since(&before);
        // No per-leaf TLBI: one range op and VMALLE1IS after the walk, or nothing.
        assert_eq!(unmap.tlbi_ops, if skip { 0 } else { 2 }, "{unmap:?}");
        let after_unmap = vm.vcpu_read(0, GPA + 4096);
        if skip {
            assert_eq!(after_unmap, Ok(5), "the stale translation is still used");
        } else {
            assert!(after_unmap.is_err(), "the page is gone: the access faults");
        }
        assert_eq!(vm.vcpu_read(0, GPA + (16 << 12)), Ok(6));
    }
}

#[test]
fn with_the_dirty_ring_a_logged_write_lands_in_the_faulting_vcpus_ring() {
    let vm = vm(Arm64Lock::Parallel);
    vm.enable_dirty_ring(256).unwrap();
    vm.set_user_memory_region(1, GPA, 16 << 12, Backing::Anonymous, 0)
        .unwrap();
    enable_logging(&vm, 16);
    vm.vcpu_write(0, GPA + 3 * 4096, 1).unwrap();
    assert_eq!(vm.dirty_ring_harvest(0), vec![(1, 3)]);
}

/// Linux 6.5 invalidates a relaxed permission on the faulting PE only: no broadcast. Another
/// vCPU that cached the stricter entry may use either it or the new one until it is
/// invalidated (a permission relaxation needs no break-before-make); this TLB re-walks a
/// cached entry that denies a write, and finds the relaxed one.
#[test]
fn a_local_relax_flush_is_no_broadcast() {
    let vm = vm_with(
        2,
        Arm64Lock::Parallel,
        Arm64Cpu::default(),
        RelaxFlush::Local,
    );
    logging_after_a_write(&vm, 16);
    // vCPU 1 caches the write-protected translation.
    assert_eq!(vm.vcpu_read(1, GPA).unwrap(), 1);
    let run = vm.vcpu_run(0, [(Gfn(GPA >> 12), true)]).unwrap();
    assert_eq!(
        (
            run.s2_perm_fault_l3,
            run.tlbi_ops,
            run.dsb_waits,
            run.tlbi_local_ops
        ),
        (1, 0, 0, 2),
        "{run:?}"
    );
    let run = vm.vcpu_run(1, [(Gfn(GPA >> 12), true)]).unwrap();
    assert_eq!((run.s2_perm_fault_l3, run.guest_writes), (0, 1), "{run:?}");
    assert_eq!(
        vm.get_dirty_log(1).unwrap()[0],
        1,
        "the page is logged dirty"
    );
    assert_invariants(&vm);
}

/// Negative controls of the stage-2 invariant checker: a writable leaf that is clean in a logged
/// slot, an entry left locked, and a leaf cleared without dropping its table reference are each
/// reported.
#[test]
fn the_invariant_checker_catches_what_it_checks() {
    use vmmu::hw::pgtable::walk::descend;
    use vmmu::hw::stage2::{Stage2, KVM_INVALID_PTE_LOCKED, KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W};
    let corrupt = |change: &dyn Fn(u64) -> u64, gfn: u64, says: &str| {
        let vm = vm(Arm64Lock::Parallel);
        logging_after_a_write(&vm, 16);
        assert!(vm.check_invariants().is_empty());
        let pgt = &vm.stage2().unwrap().pgt;
        let guard = crossbeam_epoch::pin();
        let gfn = Gfn(gfn);
        let mut reads = 0u64;
        // SAFETY: the PGD lives as long as `vm`, and `guard` is pinned while the entry is used.
        let (ptep, pte, _) = unsafe {
            descend::<Stage2>(
                pgt.pgd_for(gfn).unwrap(),
                pgt.start_level,
                gfn,
                &guard,
                &mut reads,
                |_, _| false,
            )
        };
        ptep.store(change(pte), std::sync::atomic::Ordering::Relaxed);
        let errors = vm.check_invariants();
        assert!(
            errors.iter().any(|e| e.contains(says)),
            "{says}: {errors:?}"
        );
        // Put the entry back so the VM's teardown sees a consistent tree.
        ptep.store(pte, std::sync::atomic::Ordering::Relaxed);
    };
    let page = GPA >> 12;
    corrupt(
        &|pte| pte | KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W,
        page,
        "not dirty in its bitmap",
    );
    corrupt(&|_| KVM_INVALID_PTE_LOCKED, page + 1, "left locked");
    corrupt(&|_| 0, page, "reference count");
}
