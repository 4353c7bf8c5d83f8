//! The virtual-time engine: deterministic, same oracles, same functional results as the threads
//! engine.

mod common;

use common::{counter, eager_split_off_and_on, run_threads, run_virtual, small};
use vmmu::host::backing::Backing;
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::DirtyLogReport;

/// Runs `p` on both engines and asserts that every harvest reported the same pages and that
/// every dirty phase counted the same of each of `keys`.
fn assert_engines_agree(p: &DirtyLogParams, keys: &[&str]) {
    let (v, t) = (run_virtual(p), run_threads(p));
    for (a, b) in v.iterations.iter().zip(&t.iterations) {
        assert_eq!(a.dirty_pages, b.dirty_pages, "{p:?}");
        for key in keys {
            assert_eq!(
                counter(&a.dirty, key),
                counter(&b.dirty, key),
                "{key}, {p:?}"
            );
        }
    }
}

#[test]
fn two_runs_with_the_same_seed_give_identical_json() {
    let p = DirtyLogParams {
        random_access: true,
        write_percent: 70,
        ..small(8, Backing::AnonymousHugetlb2mb)
    };
    let (a, b) = (run_virtual(&p), run_virtual(&p));
    let (ja, jb) = (
        serde_json::to_string(&a).unwrap(),
        serde_json::to_string(&b).unwrap(),
    );
    assert_eq!(ja, jb);
    assert!(a.iterations.iter().all(|i| i.dirty.wall_ns > 0));
}

#[test]
fn oracles_pass_in_virtual_time_for_every_backing_and_mode() {
    for backing in Backing::ALL {
        for manual_protect in [true, false] {
            for (random_access, run_vcpus_while_disabling) in [(false, false), (true, true)] {
                let p = DirtyLogParams {
                    manual_protect,
                    random_access,
                    run_vcpus_while_disabling,
                    write_percent: if random_access { 50 } else { 100 },
                    ..small(4, backing)
                };
                let r = run_virtual(&p);
                assert!(r.oracle.pages_checked > 0);
            }
        }
    }
}

/// Both engines run the same guest over the same MMU code: every harvest reports the same pages
/// and the vCPUs take the same faults; only the times differ.
#[test]
fn virtual_and_threads_engines_agree_on_what_happened() {
    for eager_split in [false, true] {
        let p = DirtyLogParams {
            eager_split,
            vcpu_memory_bytes: 64 << 20,
            ..small(2, Backing::AnonymousHugetlb2mb)
        };
        assert_engines_agree(
            &p,
            &[
                "ept_violations",
                "pf_fast_fixed",
                "pf_slow",
                "split_in_fault",
                "pages_dirtied",
            ],
        );
    }
}

#[test]
fn eager_split_takes_splitting_off_the_vcpus_in_virtual_time_too() {
    let base = DirtyLogParams {
        vcpu_memory_bytes: 1 << 30,
        iterations: 2,
        ..small(2, Backing::AnonymousHugetlb1gb)
    };
    let (off, on) = eager_split_off_and_on(&base, run_virtual);
    // Iteration 2 (after the first CLEAR): slow faults that split, against fast-path fixes.
    assert!(off.iterations[1].dirty.wall_ns > on.iterations[1].dirty.wall_ns);
    // The first CLEAR does the splitting when eager split is on.
    let clear = |r: &DirtyLogReport| r.iterations[0].clear.as_ref().unwrap().wall_ns;
    assert!(clear(&on) > clear(&off));
}

#[test]
fn the_shadow_mmu_runs_in_virtual_time_with_the_same_results_as_threads() {
    for mmu in [
        vmmu::vm::MmuKind::Shadow { ept: true },
        vmmu::vm::MmuKind::Shadow { ept: false },
    ] {
        for eager_split in [false, true] {
            let p = DirtyLogParams {
                eager_split,
                mmu,
                vcpu_memory_bytes: 16 << 20,
                ..small(4, Backing::AnonymousHugetlb2mb)
            };
            assert_engines_agree(
                &p,
                &[
                    "ept_violations",
                    "pf_fast_fixed",
                    "pf_slow",
                    "pages_dirtied",
                ],
            );
        }
    }
}

#[test]
fn shadow_mmu_write_lock_faults_queue_behind_each_other_in_virtual_time() {
    // Iteration 2 without eager split: every write faults under the write lock, so with more
    // vCPUs the faults wait for each other and the dirty time grows; with eager split the
    // writes are fixed without the lock and the time stays flat.
    let run = |vcpus: usize, eager_split: bool| {
        let p = DirtyLogParams {
            eager_split,
            mmu: vmmu::vm::MmuKind::Shadow { ept: true },
            vcpu_memory_bytes: 64 << 20,
            iterations: 2,
            ..small(vcpus, Backing::AnonymousHugetlb1gb)
        };
        run_virtual(&p).iterations[1].dirty.wall_ns as f64
    };
    let (off2, off32) = (run(2, false), run(32, false));
    let (on2, on32) = (run(2, true), run(32, true));
    assert!(
        off32 > 2.0 * off2,
        "no growth without eager split: {off2} -> {off32}"
    );
    assert!(
        on32 < 1.2 * on2,
        "eager split should stay flat: {on2} -> {on32}"
    );
}

/// Regression (the randomized sweep's "run that never ends": `dirty-log -v 11 -b 32M -i 4
/// -w 100 -s anonymous_hugetlb_2mb -r 82 -e --mmu shadow --pml on`). With vCPUs running while
/// dirty logging is disabled, every running vCPU used to count as a waiter for
/// `mmu_lock`, so `kvm_rmap_zap_collapsible_sptes()` yielded after every rmap head and flushed
/// before each yield (`flush_on_yield`): 90,112 flushes, each letting 11 vCPUs run millions of
/// accesses. A job now yields only to a vCPU whose fault asked for the lock while it held it.
#[test]
fn zapping_collapsible_sptes_beside_running_vcpus_yields_only_to_waiters() {
    let p = DirtyLogParams {
        vcpus: 11,
        vcpu_memory_bytes: 32 << 20,
        iterations: 4,
        random_seed: 82,
        run_vcpus_while_disabling: true,
        mmu: vmmu::vm::MmuKind::Shadow { ept: true },
        pml: true,
        ..small(11, Backing::AnonymousHugetlb2mb)
    };
    let r = run_virtual(&p);
    let d = &r.disable;
    let (yields, flushes, faults) = (
        counter(d, "lock_yields"),
        counter(d, "remote_flushes"),
        counter(d, "pf_slow"),
    );
    assert!(
        yields > 0,
        "vCPUs faulted on zapped pages and the job let them in"
    );
    assert!(
        yields <= faults,
        "every yield lets a waiting fault in: {yields} yields, {faults} faults"
    );
    // A fault that maps 2M over a zapped 4K table flushes too; the job flushes once per yield
    // and once at the end, never once per rmap head.
    assert!(
        flushes <= yields + faults + 1,
        "{flushes} flushes, {yields} yields, {faults} faults"
    );
    assert!(flushes * 100 < counter(d, "rmap_removes"));
}

/// Regression (the sweep's second "run that never ends", shadow paging with 2 MiB guest pages:
/// `dirty-log -v 11 -b 64M -i 4 -w 65 -s anonymous_hugetlb_2mb -r 52 -g -a -o -e --mmu shadow
/// --ept off --guest-page-size 2m`), at a quarter of the memory: the same yield to no waiter.
#[test]
fn zapping_collapsible_sptes_under_shadow_paging_finishes() {
    let p = DirtyLogParams {
        vcpu_memory_bytes: 16 << 20,
        iterations: 4,
        write_percent: 65,
        random_seed: 52,
        manual_protect: false,
        random_access: true,
        partition: false,
        run_vcpus_while_disabling: true,
        mmu: vmmu::vm::MmuKind::Shadow { ept: false },
        guest_page_level: vmmu::x86::spte::PG_LEVEL_2M,
        ..small(11, Backing::AnonymousHugetlb2mb)
    };
    let r = run_virtual(&p);
    let d = &r.disable;
    assert!(counter(d, "remote_flushes") * 100 < counter(d, "rmap_removes"));
}
