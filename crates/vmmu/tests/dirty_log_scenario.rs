//! The `dirty-log` scenario with its oracles on, over every backing source, with and without
//! manual protect, sequential and random, and the eager-split on/off fault signature.

mod common;

use common::{counter, eager_split_off_and_on, run_threads, small};
use vmmu::host::backing::Backing;
use vmmu::kvm::meter::Meter;
use vmmu::lab::dirty_log_model::run_dirty_log_threads;
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::{DirtyLogReport, Phase};
use vmmu::vm::MmuKind;

fn it2(r: &DirtyLogReport) -> &Phase {
    &r.iterations[1].dirty
}

fn clear1(r: &DirtyLogReport) -> &Phase {
    r.iterations[0].clear.as_ref().unwrap()
}

#[test]
fn oracles_pass_for_every_backing_mode_and_order() {
    for backing in Backing::ALL {
        for manual_protect in [true, false] {
            for random_access in [false, true] {
                let r = run_threads(&DirtyLogParams {
                    vcpu_memory_bytes: 8 << 20,
                    manual_protect,
                    random_access,
                    write_percent: if random_access { 60 } else { 100 },
                    ..small(2, backing)
                });
                assert!(r.oracle.pages_checked > 0, "the oracle checked nothing");
            }
        }
    }
}

#[test]
fn overlapped_multi_slot_and_running_while_disabling_pass_the_oracles() {
    run_threads(&DirtyLogParams {
        slots: 3,
        partition: false,
        iterations: 2,
        ..small(3, Backing::AnonymousThp)
    });
    run_threads(&DirtyLogParams {
        run_vcpus_while_disabling: true,
        iterations: 2,
        ..small(2, Backing::AnonymousHugetlb2mb)
    });
}

/// Without eager splitting, vCPU faults split the huge pages (and, after CLEAR write-protected
/// them, take the slow path for every page); with it, the VMM thread splits them and the vCPUs
/// only take fast-path faults.
#[test]
fn eager_split_moves_splitting_out_of_vcpu_faults() {
    let base = DirtyLogParams {
        vcpus: 1,
        vcpu_memory_bytes: 1 << 30,
        iterations: 2,
        backing: Backing::AnonymousHugetlb1gb,
        ..Default::default()
    };
    let (off, on) = eager_split_off_and_on(&base, run_threads);
    assert_eq!(counter(it2(&on), "split_in_fault"), 0);
    assert_eq!(counter(it2(&on), "pf_slow"), 0);
    assert_eq!(counter(it2(&on), "pf_fast_fixed"), 262144);
    assert_eq!(
        counter(clear1(&on), "split_eager"),
        1 + 512,
        "one 1G page, then its 512 2M children"
    );
    assert_eq!(counter(it2(&off), "split_in_fault"), 1 + 512);
    assert_eq!(
        counter(it2(&off), "pf_slow"),
        262144,
        "CLEAR took MMU-writable away from the huge page"
    );
    assert_eq!(counter(clear1(&off), "split_eager"), 0);
    // Disabling logging recovers the 1G mapping in place either way.
    for r in [&off, &on] {
        assert_eq!(counter(&r.disable, "mapped_1g"), 1);
        assert_eq!(counter(&r.disable, "mapped_4k"), 0);
    }

    // -g: enabling logging splits eagerly and write-protects, keeping MMU-writable, so the
    // first iteration's faults are fixed without the lock.
    let g_on = run_threads(&DirtyLogParams {
        manual_protect: false,
        ..base.clone()
    });
    assert_eq!(counter(&g_on.enable, "split_eager"), 513);
    assert_eq!(counter(&g_on.iterations[0].dirty, "pf_fast_fixed"), 262144);
    let g_off = run_threads(&DirtyLogParams {
        manual_protect: false,
        eager_split: false,
        ..base
    });
    assert_eq!(counter(&g_off.iterations[0].dirty, "split_in_fault"), 513);
    assert_eq!(
        counter(&g_off.iterations[0].dirty, "pf_slow"),
        512,
        "one slow fault per 2M page"
    );
}

#[test]
fn bad_parameters_are_refused_before_anything_runs() {
    let e = run_dirty_log_threads(
        &DirtyLogParams {
            slots: 3,
            vcpu_memory_bytes: 4 << 12,
            ..Default::default()
        },
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("evenly divided"), "{e}");
}

#[test]
fn the_shadow_mmu_passes_the_oracles_with_and_without_ept() {
    for mmu in [
        MmuKind::Shadow { ept: true },
        MmuKind::Shadow { ept: false },
    ] {
        for backing in Backing::ALL {
            for manual_protect in [true, false] {
                let r = run_threads(&DirtyLogParams {
                    manual_protect,
                    random_access: manual_protect,
                    write_percent: if manual_protect { 60 } else { 100 },
                    mmu,
                    ..small(2, backing)
                });
                assert!(r.oracle.pages_checked > 0, "the oracle checked nothing");
            }
        }
    }
    run_threads(&DirtyLogParams {
        mmu: MmuKind::Shadow { ept: false },
        guest_page_level: vmmu::x86::spte::PG_LEVEL_4K,
        run_vcpus_while_disabling: true,
        iterations: 2,
        ..small(3, Backing::AnonymousHugetlb2mb)
    });
}

#[test]
fn in_the_shadow_mmu_eager_split_turns_write_locked_faults_into_fast_path_fixes() {
    let base = DirtyLogParams {
        vcpus: 1,
        vcpu_memory_bytes: 1 << 30,
        iterations: 2,
        backing: Backing::AnonymousHugetlb1gb,
        mmu: MmuKind::Shadow { ept: true },
        ..Default::default()
    };
    let (off, on) = eager_split_off_and_on(&base, run_threads);
    // Without: the 1G page is dropped by the first write fault, and every 4K page then takes a
    // fault under the write lock.
    assert_eq!(counter(it2(&off), "pf_slow"), 262144);
    assert_eq!(counter(it2(&off), "split_in_fault"), 1);
    assert_eq!(counter(it2(&off), "mmu_lock_write_acquired"), 262144);
    // With: the first CLEAR splits 1G -> 2M -> 4K in the VMM thread; writes are fixed locklessly.
    assert_eq!(counter(clear1(&on), "split_eager"), 1 + 512);
    assert_eq!(counter(it2(&on), "pf_fast_fixed"), 262144);
    assert_eq!(counter(it2(&on), "mmu_lock_write_acquired"), 0);
    // Disabling zaps the small leaves; the next faults map 1G again.
    for r in [&off, &on] {
        assert_eq!(counter(&r.disable, "mapped_4k"), 0);
    }
}

fn phase_with_meter_counters() -> Phase {
    let meter = Meter {
        pf_slow: 7,
        ..Meter::default()
    };
    Phase {
        wall_ns: 1,
        counters: Some(meter.to_map()),
    }
}

#[test]
fn counter_reads_a_phase_counter_by_name() {
    let phase = phase_with_meter_counters();
    assert_eq!(counter(&phase, "pf_slow"), 7);
    assert_eq!(counter(&phase, "pf_fast_fixed"), 0);
}

#[test]
#[should_panic(expected = "unknown counter `pf_slowww`; known counters: ")]
fn counter_fails_on_a_name_the_phase_does_not_report() {
    counter(&phase_with_meter_counters(), "pf_slowww");
}
