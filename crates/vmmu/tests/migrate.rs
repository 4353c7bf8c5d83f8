//! `migrate`: pre-copy live migration on both engines. The destination must equal the source
//! after stop-and-copy on every MMU, with and without manual protect, converged or forced; a
//! migration thread that drops a page is caught; virtual time is deterministic; and the
//! timeline measures the guests' slowdown against the run without migration.

use vmmu::cost::CostModel;
use vmmu::lab::migrate::{
    run_migrate_threads, run_migrate_virtual, MigrateFaults, MigrateParams, MigrateReport,
};
use vmmu::lab::params::DirtyLogParams;
use vmmu::vm::MmuKind;

const MIB: u64 = 1 << 20;

/// A small VM: `vcpus` × 8 MiB, each looping over 1 MiB, migrated over a 1 Gbit/s link in
/// 5 ms buckets.
fn small(vcpus: usize, mmu: MmuKind) -> MigrateParams {
    let arm64 = matches!(mmu, MmuKind::Stage2 { .. });
    MigrateParams {
        vm: DirtyLogParams {
            vcpus,
            vcpu_memory_bytes: 8 * MIB,
            iterations: 1,
            mmu,
            guest_mode: arm64.then_some(vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE),
            eager_split: !arm64,
            ..Default::default()
        },
        working_set_bytes: MIB,
        think_ns: 200,
        bandwidth_bps: 1_000_000_000,
        bucket_ns: 5_000_000,
        warmup_ns: 10_000_000,
        ..Default::default()
    }
}

fn stage2(lock: vmmu::arm64::Arm64Lock) -> MmuKind {
    MmuKind::Stage2 {
        lock,
        ia_bits: 40,
        split_chunk_pages: 512,
        cpu: Default::default(),
        relax_flush: vmmu::arm64::RelaxFlush::Broadcast,
    }
}

fn cost(mmu: MmuKind) -> CostModel {
    match mmu {
        MmuKind::Stage2 { .. } => CostModel::default_arm64(),
        _ => CostModel::default(),
    }
}

fn virtual_run(p: &MigrateParams) -> MigrateReport {
    run_migrate_virtual(p, &cost(p.vm.mmu), false).unwrap()
}

fn assert_migrated(r: &MigrateReport, p: &MigrateParams) {
    assert_eq!(r.oracle_failure(), None);
    assert_eq!(r.oracle.pages_compared, p.vm.guest_pages());
    assert!(
        r.pages_sent > p.vm.guest_pages(),
        "the bulk round sends every page and later rounds resend the working set: {}",
        r.pages_sent
    );
    assert!(!r.rounds.is_empty() && r.total_ns > 0 && r.downtime_ns > 0);
}

#[test]
fn the_destination_equals_the_source_on_every_mmu_in_virtual_time() {
    for mmu in [
        MmuKind::Tdp,
        MmuKind::Shadow { ept: true },
        stage2(vmmu::arm64::Arm64Lock::Spin),
        stage2(vmmu::arm64::Arm64Lock::Parallel),
    ] {
        let p = small(3, mmu);
        let r = virtual_run(&p);
        assert_migrated(&r, &p);
        // The working set (3 x 256 pages) fits the 300 ms downtime at once.
        assert!(r.converged, "{mmu:?}");
    }
}

#[test]
fn the_destination_equals_the_source_on_the_threads_engine() {
    let p = MigrateParams {
        baseline: false,
        ..small(2, MmuKind::Tdp)
    };
    let r = run_migrate_threads(&p, false).unwrap();
    assert_migrated(&r, &p);
}

#[test]
fn forced_stop_and_copy_without_manual_protect_still_copies_everything() {
    // The whole region is the working set and the link is slow: the rounds never converge,
    // and the round limit forces stop-and-copy. Each GET re-protects (no CLEAR).
    let mut p = small(2, MmuKind::Tdp);
    p.working_set_bytes = p.vm.vcpu_memory_bytes;
    p.think_ns = 2_000;
    p.bandwidth_bps = 400_000_000;
    p.downtime_ns = 100_000_000;
    p.max_rounds = 2;
    p.baseline = false;
    p.vm.manual_protect = false;
    let r = virtual_run(&p);
    assert_migrated(&r, &p);
    assert!(!r.converged);
    assert_eq!(r.rounds.len(), 3);
    assert!(r.rounds.iter().all(|x| x.clears == 0));
    assert!(r.final_pages > p.threshold_pages());
}

#[test]
fn a_migration_thread_that_drops_a_page_is_caught_on_both_engines() {
    let p = MigrateParams {
        faults: MigrateFaults {
            drop_bulk_page: true,
        },
        baseline: false,
        ..small(2, MmuKind::Tdp)
    };
    for r in [virtual_run(&p), run_migrate_threads(&p, false).unwrap()] {
        assert_eq!(r.oracle.mismatched, 1, "{}", r.engine);
        let e = r.oracle_failure().unwrap();
        assert!(e.contains("1 of 4096 destination page(s) differ"), "{e}");
    }
    // A 64K-page arm64 guest writes the first 4 KiB of each of its pages: the dropped page is
    // the last one it writes.
    let mut arm64 = MigrateParams {
        faults: p.faults,
        baseline: false,
        ..small(2, stage2(vmmu::arm64::Arm64Lock::Parallel))
    };
    arm64.vm.guest_mode = Some(7);
    assert_eq!(virtual_run(&arm64).oracle.mismatched, 1);
}

#[test]
fn virtual_time_gives_the_same_report_every_time() {
    let p = small(4, stage2(vmmu::arm64::Arm64Lock::PermFastPath));
    let a = serde_json::to_string(&virtual_run(&p)).unwrap();
    let b = serde_json::to_string(&virtual_run(&p)).unwrap();
    assert_eq!(a, b);
}

#[test]
fn the_timeline_measures_the_slowdown_against_the_run_without_migration() {
    // memstress's loop over half of each vCPU's memory: every page of it faults once after
    // the bulk round's CLEAR.
    let mut p = small(4, stage2(vmmu::arm64::Arm64Lock::Spin));
    p.vm.vcpu_memory_bytes = 4 * MIB;
    p.think_ns = 100;
    p.working_set_bytes = 2 * MIB;
    let r = virtual_run(&p);
    assert_eq!(r.throughput.len(), r.baseline.len());
    assert_eq!(r.vcpu_throughput.len(), 4);
    let first = r.live_buckets.0;
    // Before the migration both runs are the same guests at the same time.
    assert_eq!(r.throughput[..first], r.baseline[..first]);
    // Each vCPU's buckets add up to the total.
    for (b, &total) in r.throughput.iter().enumerate() {
        assert_eq!(r.vcpu_throughput.iter().map(|v| v[b]).sum::<u64>(), total);
    }
    // Under the spinlock every write fault after a CLEAR serializes the vCPUs: the guests
    // slow down while the working set is re-protected, and the spans are nested.
    let s = &r.spans;
    assert_eq!(
        s.iter().map(|x| x.over_percent).collect::<Vec<_>>(),
        [99, 50, 10]
    );
    assert!(s[2].total_ns > 0, "{s:?}");
    assert!(s[0].total_ns <= s[1].total_ns && s[1].total_ns <= s[2].total_ns);
    // Paused for stop-and-copy: the guests make no progress after the pause.
    let pause = r.phases.last().unwrap().start_ns;
    let after = (pause / r.params.bucket_ns + 1) as usize;
    assert!(r.throughput[after..].iter().all(|&x| x == 0));
}

#[test]
fn under_the_seed_s_fast_path_write_faults_take_the_read_lock() {
    let spin = virtual_run(&small(4, stage2(vmmu::arm64::Arm64Lock::Spin)));
    let fast = virtual_run(&small(4, stage2(vmmu::arm64::Arm64Lock::PermFastPath)));
    let write_locks = |r: &MigrateReport| r.live_count("mmu_lock_write_acquired");
    // Every permission fault of the working set takes the write lock under the spinlock;
    // with the fast path only the VMM's ioctls do.
    assert!(write_locks(&spin) >= 4 * 256, "{}", write_locks(&spin));
    assert!(write_locks(&fast) < 16, "{}", write_locks(&fast));
}

#[test]
fn auto_converge_throttles_the_vcpus_harder_every_two_fast_dirtying_periods() {
    // Each vCPU rewrites all of its memory every 2 ms, far faster than a 100 Mbit/s link
    // carries it: every sync period dirties more than half of what was sent.
    let mut p = small(2, MmuKind::Tdp);
    p.working_set_bytes = p.vm.vcpu_memory_bytes;
    p.think_ns = 1_000;
    p.bandwidth_bps = 100_000_000;
    p.max_rounds = 4;
    p.baseline = false;
    let plain = virtual_run(&p);
    p.auto_converge = true;
    let throttled = virtual_run(&p);
    assert_migrated(&throttled, &p);
    assert_eq!(plain.final_throttle_pct, 0);
    // Periods end at the syncs after rounds 0-4: too fast at each, so the throttle starts at
    // the second (20 %) and rises at the fourth (30 %).
    assert_eq!(throttled.final_throttle_pct, 30);
    let accesses = |r: &MigrateReport| r.throughput.iter().sum::<u64>();
    assert!(
        accesses(&throttled) < accesses(&plain) * 9 / 10,
        "{} vs {}",
        accesses(&throttled),
        accesses(&plain)
    );
}

#[test]
fn with_the_dirty_ring_full_rings_are_reaped_and_nothing_is_lost_on_both_engines() {
    // 256 entries (a soft limit of 192) against a 1 MiB working set per vCPU: the rings fill
    // within every round, so vCPUs exit with KVM_EXIT_DIRTY_RING_FULL and wait for a reap.
    let p = MigrateParams {
        dirty_ring: Some(256),
        baseline: false,
        ..small(2, MmuKind::Tdp)
    };
    for r in [virtual_run(&p), run_migrate_threads(&p, false).unwrap()] {
        assert_migrated(&r, &p);
        assert!(r.ring_full_reaps > 0, "{}", r.engine);
        // No GET or CLEAR: the rings replace the bitmaps.
        assert!(r.rounds.iter().all(|x| x.clears == 0), "{}", r.engine);
    }
    // The negative control with rings: the bulk round's dropped page is caught.
    let dropped = MigrateParams {
        faults: MigrateFaults {
            drop_bulk_page: true,
        },
        ..p.clone()
    };
    assert_eq!(virtual_run(&dropped).oracle.mismatched, 1);
    let arm64 = MigrateParams {
        dirty_ring: Some(256),
        baseline: false,
        ..small(2, stage2(vmmu::arm64::Arm64Lock::Parallel))
    };
    assert_migrated(&virtual_run(&arm64), &arm64);
    let bad = MigrateParams {
        dirty_ring: Some(300),
        ..small(2, MmuKind::Tdp)
    };
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .starts_with("--dirty-ring 300"));
}

/// Regression (found by `vmmu soak` on 16 cores: `migrate --mmu shadow --pml on -s
/// anonymous_hugetlb_2mb -v 9 -b 8M -x 2 --dirty-ring 256 ...`). With two memslots, the
/// vCPUs fill their rings as soon as the first slot logs, and the second slot's flag change
/// calls synchronize_srcu() while they wait for a reset. A vCPU out for
/// KVM_EXIT_DIRTY_RING_FULL has left KVM_RUN and dropped SRCU; the model kept it, so virtual
/// time panicked ("inside a fault at synchronize_srcu()") and the threads engine deadlocked
/// (the VMM waited for SRCU, the vCPU for the VMM's reset).
#[test]
fn vcpus_out_for_full_rings_do_not_hold_srcu_across_a_memslot_change() {
    let mut p = small(9, MmuKind::Shadow { ept: true });
    p.vm.slots = 2;
    p.vm.pml = true;
    p.vm.backing = vmmu::host::backing::Backing::AnonymousHugetlb2mb;
    p.working_set_bytes = 8 * MIB;
    p.think_ns = 500;
    p.bandwidth_bps = 12_000_000_000;
    p.max_rounds = 2;
    p.dirty_ring = Some(256);
    let v = virtual_run(&p);
    assert_migrated(&v, &p);
    assert!(v.ring_full_reaps > 0, "rings filled");
    let t = run_migrate_threads(&p, false).unwrap();
    assert_migrated(&t, &p);
}
