//! The shadow MMU through the VM API: direct mode (EPT, `tdp_mmu=N`) mapping, dirty logging
//! through the rmaps, eager splitting with its refusals and page reuse, the page quota and
//! zapping; shadow paging (`ept=N`) with write-protected guest tables, emulated table writes,
//! unsync pages and their sync on the guest's TLB flush. Invariants are checked after each.

mod common;

use common::{
    assert_invariants, gfn, mmu_stat, set_slot, two_vcpu_vm, write_pages, GPA, PAGE, SLOT,
};
use proptest::prelude::*;
use vmmu::host::backing::Backing;
use vmmu::vm::{MmuKind, Vm, KVM_MEM_LOG_DIRTY_PAGES};
use vmmu::x86::spte::{Level, PG_LEVEL_2M, PG_LEVEL_4K};

/// Pages in the property test's memslot: 128 2M regions.
const SLOT_PAGES: u64 = 128 * 512;

fn shadow_vm(ept: bool, eager_split: bool) -> Vm {
    two_vcpu_vm(MmuKind::Shadow { ept }, eager_split)
}

#[test]
fn direct_faults_map_huge_pages_and_prefetch_small_ones() {
    let vm = shadow_vm(true, true);
    set_slot(&vm, 8 << 20, Backing::AnonymousHugetlb2mb, 0);
    write_pages(&vm, 0..2048, 7);
    assert_eq!(vm.mmu.page_stats(), [0, 4, 0]);
    for p in (0..2048).step_by(97) {
        assert_eq!(vm.vcpu_read(0, GPA + p * PAGE).unwrap(), 7 + p);
    }
    assert_invariants(&vm);

    for populated in [true, false] {
        let vm = shadow_vm(true, true);
        set_slot(&vm, 1 << 20, Backing::Anonymous, 0);
        if populated {
            // The VMM wrote the memory first (as QEMU's -mem-prealloc does).
            use vmmu::x86::guest_paging::GuestMemory;
            for p in 0..256 {
                vm.kvm
                    .write_gpa_u64(vmmu::units::Gpa(GPA + p * PAGE), 0)
                    .unwrap();
            }
        }
        let m = vm.vcpu_run(0, (0..256).map(|p| (gfn(p), true))).unwrap();
        // direct_pte_prefetch(): each fault maps its aligned group of 8, of the pages the host
        // maps (get_user_pages_fast_only()): none of the memory nobody touched.
        let faults = if populated { 32 } else { 256 };
        assert_eq!(m.pf_slow, faults, "{m:?}");
        assert_eq!(vm.mmu.page_stats(), [256, 0, 0]);
        assert_invariants(&vm);
    }
}

#[test]
fn dirty_logging_write_protects_through_rmaps_and_eager_split_keeps_the_fast_path() {
    for eager in [false, true] {
        let vm = shadow_vm(true, eager);
        set_slot(&vm, 4 << 20, Backing::AnonymousHugetlb2mb, 0);
        write_pages(&vm, 0..1024, 1);
        set_slot(
            &vm,
            4 << 20,
            Backing::AnonymousHugetlb2mb,
            KVM_MEM_LOG_DIRTY_PAGES,
        );
        let vmm = vm.vmm_meter();
        assert_eq!(vmm.split_eager, if eager { 2 } else { 0 }, "{vmm:?}");
        assert_invariants(&vm);
        let m = vm.vcpu_run(0, (0..1024).map(|p| (gfn(p), true))).unwrap();
        if eager {
            assert_eq!(
                m.pf_fast_fixed, 1024,
                "split pieces keep MMU-writable: {m:?}"
            );
            assert_eq!(m.pf_slow, 0, "{m:?}");
        } else {
            // Each huge page: a write-protection fault that splits it, then a non-present
            // fault per small page (no prefetch while logging).
            assert_eq!(m.pf_slow, 1024, "{m:?}");
            assert_eq!(m.split_in_fault, 2, "{m:?}");
        }
        let bitmap = vm.get_dirty_log(SLOT).unwrap();
        assert!(bitmap.iter().all(|w| *w == u64::MAX), "every page reported");
        assert_invariants(&vm);
        // GET re-protected everything: the next writes fault again (fast path).
        let m = vm.vcpu_run(1, (0..64).map(|p| (gfn(p), true))).unwrap();
        assert_eq!(m.pf_fast_fixed, 64, "{m:?}");
        // Disabling zaps the collapsible small leaves; faults map huge again.
        set_slot(&vm, 4 << 20, Backing::AnonymousHugetlb2mb, 0);
        assert_eq!(vm.mmu.page_stats(), [0, 0, 0]);
        write_pages(&vm, 0..1024, 3);
        assert_eq!(vm.mmu.page_stats(), [0, 2, 0]);
        assert_invariants(&vm);
    }
}

#[test]
fn eager_split_reuses_the_small_pages_left_from_the_last_split() {
    let vm = shadow_vm(true, true);
    let backing = Backing::AnonymousHugetlb2mb;
    set_slot(&vm, 4 << 20, backing, 0);
    write_pages(&vm, 0..1024, 1);
    set_slot(&vm, 4 << 20, backing, KVM_MEM_LOG_DIRTY_PAGES);
    let created = mmu_stat(&vm, "mmu_cache_miss");
    // Disable (leaves zapped, their pages stay), fault huge again (the pages are unlinked but
    // kept), enable again: the split finds them in the hash.
    set_slot(&vm, 4 << 20, backing, 0);
    write_pages(&vm, 0..1024, 2);
    let before = vm.vmm_meter();
    set_slot(&vm, 4 << 20, backing, KVM_MEM_LOG_DIRTY_PAGES);
    let m = vm.vmm_meter().since(&before);
    assert_eq!(m.split_eager, 2, "{m:?}");
    assert_eq!(
        mmu_stat(&vm, "mmu_cache_miss"),
        created,
        "no new page: both reused"
    );
    assert_eq!(vm.mmu.page_stats(), [1024, 0, 0]);
    assert_invariants(&vm);
}

#[test]
fn eager_split_refuses_at_kvm_min_free_mmu_pages_and_faults_recycle() {
    let vm = shadow_vm(true, true);
    let backing = Backing::AnonymousHugetlb2mb;
    let pages = 64 * 512;
    set_slot(&vm, pages * PAGE, backing, 0);
    let shadow = vm.shadow().unwrap();
    assert!(
        shadow.set_nr_mmu_pages(&vm.kvm, 63).is_err(),
        "KVM_SET_NR_MMU_PAGES refuses less than KVM_MIN_ALLOC_MMU_PAGES"
    );
    shadow.set_nr_mmu_pages(&vm.kvm, 64).unwrap();
    vm.vcpu_run(0, (0..64).map(|h| (gfn(h * 512), true)))
        .unwrap();
    assert_eq!(vm.mmu.page_stats(), [0, 64, 0]);
    // Root, level 3 and level 2 in use: 61 free. A split needs one page and is refused at
    // 5 or fewer free, so 56 of the 64 huge pages are split.
    set_slot(&vm, pages * PAGE, backing, KVM_MEM_LOG_DIRTY_PAGES);
    assert_eq!(vm.vmm_meter().split_eager, 56);
    assert_eq!(mmu_stat(&vm, "split_refused_enospc"), 8);
    assert_invariants(&vm);
    // Writes still work: faults on the huge pages left zap the oldest pages to stay within
    // the quota.
    for round in 0..2 {
        vm.vcpu_run(1, (0..pages).step_by(7).map(|p| (gfn(p), true)))
            .unwrap();
        assert_invariants(&vm);
        assert!(mmu_stat(&vm, "mmu_pages_used") <= 64, "round {round}");
    }
    assert!(mmu_stat(&vm, "mmu_shadow_zapped") > 0);
}

#[test]
fn deleting_a_memslot_zaps_its_leaves_and_keeps_direct_pages_for_reuse() {
    let vm = shadow_vm(true, true);
    set_slot(&vm, 4 << 20, Backing::Anonymous, 0);
    vm.set_user_memory_region(2, 2 * GPA, 4 << 20, Backing::AnonymousHugetlb2mb, 0)
        .unwrap();
    write_pages(&vm, 0..1024, 1);
    vm.vcpu_write(0, 2 * GPA, 5).unwrap();
    let created = mmu_stat(&vm, "mmu_cache_miss");
    set_slot(&vm, 0, Backing::Anonymous, 0);
    // Every leaf of the slot is gone; its direct pages stay, empty, as in KVM.
    assert_invariants(&vm);
    assert_eq!(vm.mmu.page_stats(), [0, 1, 0]);
    assert_eq!(vm.vcpu_read(1, 2 * GPA).unwrap(), 5);
    assert!(
        vm.vcpu_read(0, GPA).is_err(),
        "no memslot holds it any more"
    );
    // A new memslot there finds them in the hash.
    set_slot(&vm, 4 << 20, Backing::Anonymous, 0);
    write_pages(&vm, 0..1024, 2);
    assert_eq!(mmu_stat(&vm, "mmu_cache_miss"), created);
    assert_invariants(&vm);
}

#[test]
fn deleting_the_memslot_at_gfn_0_keeps_the_direct_root() {
    // The direct root's gfn is 0; kvm_mmu_zap_memslot() zaps only pages shadowing guest
    // tables, so the root survives and faults keep working.
    let vm = shadow_vm(true, true);
    vm.set_user_memory_region(0, 0, 1 << 20, Backing::Anonymous, 0)
        .unwrap();
    vm.vcpu_write(0, 0, 1).unwrap();
    vm.set_user_memory_region(0, 0, 0, Backing::Anonymous, 0)
        .unwrap();
    vm.set_user_memory_region(0, 0, 1 << 20, Backing::Anonymous, 0)
        .unwrap();
    vm.vcpu_write(0, PAGE, 2).unwrap();
    assert_eq!(vm.vcpu_read(1, PAGE).unwrap(), 2);
    assert_invariants(&vm);
}

#[test]
#[should_panic(expected = "unknown counter `mmu_pages_in_use`; known counters: mmu_pages_used")]
fn mmu_stat_fails_on_a_name_the_mmu_does_not_report() {
    mmu_stat(&shadow_vm(true, true), "mmu_pages_in_use");
}

/// Shadow paging over a 4 MiB slot mapped by the guest with `level` pages.
fn paging_vm(level: Level, backing: Backing) -> Vm {
    let vm = shadow_vm(false, true);
    set_slot(&vm, 4 << 20, backing, 0);
    vm.setup_guest_page_tables(0, 0, level).unwrap();
    vm
}

#[test]
fn shadow_paging_maps_guest_pages_and_splits_guest_huge_pages() {
    for (level, huge) in [(PG_LEVEL_4K, [1024, 0, 0]), (PG_LEVEL_2M, [0, 2, 0])] {
        let vm = paging_vm(level, Backing::AnonymousHugetlb2mb);
        write_pages(&vm, 0..1024, 1);
        assert_eq!(vm.vcpu(0).meter.pf_emulated, 0);
        assert_eq!(vm.mmu.page_stats(), huge, "guest pages {level:?}");
        assert_invariants(&vm);
        set_slot(
            &vm,
            4 << 20,
            Backing::AnonymousHugetlb2mb,
            KVM_MEM_LOG_DIRTY_PAGES,
        );
        // A 2M guest page's huge SPTE sits on an indirect page: split into direct pages
        // with the access cached in shadowed_translation.
        assert_eq!(
            vm.vmm_meter().split_eager,
            if level == PG_LEVEL_2M { 2 } else { 0 }
        );
        let m = vm.vcpu_run(0, (0..1024).map(|p| (gfn(p), true))).unwrap();
        // Shadow paging has no fast path: every write to a protected page takes the lock.
        assert_eq!(m.pf_fast_fixed, 0);
        assert_eq!(m.pf_slow, 1024, "{m:?}");
        assert!(m.guest_pte_reads >= 4 * 1024, "{m:?}");
        assert_eq!(
            vm.get_dirty_log(SLOT)
                .unwrap()
                .iter()
                .map(|w| w.count_ones())
                .sum::<u32>(),
            1024
        );
        assert_invariants(&vm);
    }
}

#[test]
fn guest_table_writes_are_emulated_or_unsync_and_synced_on_a_tlb_flush() {
    let vm = paging_vm(PG_LEVEL_4K, Backing::Anonymous);
    vm.vcpu_write(0, GPA, 11).unwrap();
    vm.vcpu_write(0, GPA + PAGE, 22).unwrap();
    // The guest PTE that maps GPA lives in a last-level table page; point it at GPA + PAGE.
    let (pte_gpa, pde_gpa) = {
        let cr3 = vm.shadow().unwrap().guest_cr3().unwrap();
        let walk = vmmu::x86::guest_paging::walk_addr(&*vm.kvm, cr3, GPA, false, &mut 0).unwrap();
        (walk.pte_gpa[1].0, walk.pte_gpa[2].0)
    };
    let old = vm.vcpu_read(0, pte_gpa).unwrap();
    // Writing its own last-level table: the shadow page goes unsync and the guest writes it
    // directly.
    let new = (old & !0x000f_ffff_ffff_f000) | (GPA + PAGE) | 0x60;
    vm.vcpu_write(1, pte_gpa, new).unwrap();
    assert!(mmu_stat(&vm, "mmu_unsync") > 0);
    assert_eq!(
        vm.vcpu(1).meter.pf_emulated,
        0,
        "an unsync table is written directly"
    );
    assert_invariants(&vm);
    // After the guest's TLB flush KVM syncs the page: GPA now reads what GPA + PAGE holds.
    vm.guest_tlb_flush(0).unwrap();
    vm.guest_tlb_flush(1).unwrap();
    assert_eq!(vm.vcpu_read(0, GPA).unwrap(), 22);
    assert_invariants(&vm);
    // An upper-level table is write-tracked: writing it is emulated, the store lands in guest
    // memory, and the shadow entry it backs is zapped, so the next access walks the new PDE.
    let pde = vm.vcpu_read(0, pde_gpa).unwrap();
    let emulated = |vm: &Vm| -> u64 { (0..2).map(|i| vm.vcpu(i).meter.pf_emulated).sum() };
    let before = emulated(&vm);
    vm.vcpu_write(0, pde_gpa, pde & !1).unwrap();
    assert_eq!(emulated(&vm), before + 1);
    let e = vm.vcpu_read(1, GPA).unwrap_err().to_string();
    assert!(
        e.contains("not present"),
        "the guest now faults on its own table: {e}"
    );
    // Present again: the same table, the same mapping.
    vm.vcpu_write(0, pde_gpa, pde).unwrap();
    assert_eq!(emulated(&vm), before + 2);
    vm.guest_tlb_flush(0).unwrap();
    assert_eq!(vm.vcpu_read(0, GPA).unwrap(), 22);
    assert_invariants(&vm);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    /// Random faults over 128 2M regions (more shadow pages than a 64-page quota holds),
    /// logging changes, harvests, memslot deletion and quotas never break the rmap, parent and
    /// quota invariants, and memory keeps its content.
    #[test]
    fn random_operations_keep_the_invariants(
        ops in prop::collection::vec((0u8..6, 0u64..SLOT_PAGES, any::<bool>()), 1..80),
        quota in prop::option::of(64u64..80),
        hugetlb in any::<bool>(),
    ) {
        let vm = shadow_vm(true, true);
        vm.enable_manual_dirty_log_protect(true).unwrap();
        let backing = if hugetlb { Backing::AnonymousHugetlb2mb } else { Backing::Anonymous };
        let size = SLOT_PAGES * PAGE;
        set_slot(&vm, size, backing, 0);
        if let Some(q) = quota {
            vm.shadow().unwrap().set_nr_mmu_pages(&vm.kvm, q).unwrap();
        }
        let mut logging = false;
        let mut present = true;
        let mut content = std::collections::HashMap::new();
        for (op, page, flag) in ops {
            match op {
                0 | 1 if present => {
                    vm.vcpu_write(flag as usize, GPA + page * PAGE, page ^ 0xabc).unwrap();
                    content.insert(page, page ^ 0xabc);
                }
                2 if present => {
                    logging = !logging;
                    let flags = if logging { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
                    set_slot(&vm, size, backing, flags);
                }
                3 if present && logging => {
                    let b = vm.get_dirty_log(SLOT).unwrap();
                    vm.clear_dirty_log(SLOT, 0, SLOT_PAGES, &b).unwrap();
                }
                4 if flag => {
                    if present {
                        set_slot(&vm, 0, backing, 0);
                        content.clear();
                        logging = false;
                    } else {
                        set_slot(&vm, size, backing, 0);
                    }
                    present = !present;
                }
                _ if present => {
                    let want = content.get(&page).copied().unwrap_or(0);
                    prop_assert_eq!(vm.vcpu_read(0, GPA + page * PAGE).unwrap(), want);
                }
                _ => {}
            }
            let e = vm.check_invariants();
            prop_assert!(e.is_empty(), "{:#?}", e);
        }
    }
}
