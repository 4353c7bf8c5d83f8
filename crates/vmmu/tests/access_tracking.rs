//! `vmmu access-tracking` (access_tracking_perf_test, page_idle mode): nothing is lost on
//! either engine; marking takes `mmu_lock` for write per page only with locked aging; marking
//! clears the Accessed flags the guest set, so the next marking finds every touched page
//! young; on arm64 touching idle memory takes an access-flag fault per page.

use vmmu::cost::CostModel;
use vmmu::kvm::mmu_notifier::Aging;
use vmmu::lab::access_tracking::{
    run_access_tracking_threads, run_access_tracking_virtual, AccessTrackingParams,
    AccessTrackingReport,
};
use vmmu::vm::MmuKind;

const PAGES_PER_VCPU: u64 = 2048;

fn small(aging: Aging) -> AccessTrackingParams {
    AccessTrackingParams {
        vcpus: 3,
        vcpu_bytes: PAGES_PER_VCPU * 4096,
        aging,
        ..Default::default()
    }
}

fn phase<'a>(
    r: &'a AccessTrackingReport,
    name: &str,
    nth: usize,
) -> &'a vmmu::lab::access_tracking::PhaseReport {
    r.phases.iter().filter(|p| p.name == name).nth(nth).unwrap()
}

fn count(p: &vmmu::lab::access_tracking::PhaseReport, k: &str) -> u64 {
    p.counters.get(k).copied().unwrap_or(0)
}

#[test]
fn marking_takes_the_write_lock_per_page_only_when_aging_is_locked() {
    let pages = 3 * PAGES_PER_VCPU;
    for aging in [Aging::Locked, Aging::Lockless] {
        let r = run_access_tracking_virtual(&small(aging), &CostModel::default(), false).unwrap();
        assert!(r.oracle.passed(), "{:?}", r.oracle);
        let first = phase(&r, "Mark memory idle", 0);
        let second = phase(&r, "Mark memory idle", 1);
        // Reading a page's bit reads its 64-page word, which re-checks every folio of the
        // word marked idle so far (page k of a word: k of them the first time, all 64 for the
        // word's first page the second time, since the guest touched them all), then the
        // write checks the page once more.
        let words = pages / 64;
        let first_calls = words * (64 * 63 / 2 + 64);
        assert_eq!(count(first, "mmu_notifier_calls"), first_calls);
        assert_eq!(
            count(second, "mmu_notifier_calls"),
            first_calls + words * 64
        );
        let marked: u64 = second.marks.iter().map(|m| m.marked).sum();
        let still: u64 = second.marks.iter().map(|m| m.still_idle).sum();
        assert_eq!((marked, still), (pages, 0));
        let writes = count(first, "mmu_lock_write_acquired");
        match aging {
            Aging::Locked => assert_eq!(writes, first_calls),
            Aging::Lockless => assert_eq!(writes, 0),
        }
    }
}

#[test]
fn lockless_marking_is_faster_with_many_threads() {
    let p = |aging| AccessTrackingParams {
        vcpus: 32,
        vcpu_bytes: 256 * 4096,
        aging,
        ..Default::default()
    };
    let cost = CostModel::default();
    let locked = run_access_tracking_virtual(&p(Aging::Locked), &cost, false).unwrap();
    let lockless = run_access_tracking_virtual(&p(Aging::Lockless), &cost, false).unwrap();
    let mark = |r: &AccessTrackingReport| phase(r, "Mark memory idle", 0).ns;
    // 32 threads serialize on the write lock; without it they run side by side.
    assert!(
        mark(&locked) > 4 * mark(&lockless),
        "{} vs {}",
        mark(&locked),
        mark(&lockless)
    );
    assert!(
        phase(&locked, "Mark memory idle", 0)
            .mark_write_wait_ns
            .unwrap()
            > 0
    );
    assert_eq!(
        phase(&lockless, "Mark memory idle", 0).mark_write_wait_ns,
        Some(0)
    );
}

#[test]
fn arm64_touching_idle_memory_takes_an_access_flag_fault_per_page() {
    let p = AccessTrackingParams {
        mmu: MmuKind::Stage2 {
            lock: vmmu::arm64::Arm64Lock::Parallel,
            ia_bits: 40,
            split_chunk_pages: 512,
            cpu: Default::default(),
            relax_flush: vmmu::arm64::RelaxFlush::Broadcast,
        },
        guest_mode: Some(5),
        ..small(Aging::Locked)
    };
    let r = run_access_tracking_virtual(&p, &CostModel::default_arm64(), false).unwrap();
    assert!(r.oracle.passed(), "{:?}", r.oracle);
    let pages = 3 * PAGES_PER_VCPU;
    assert_eq!(
        count(
            phase(&r, "Writing to populated memory", 0),
            "s2_access_fault"
        ),
        0
    );
    assert_eq!(
        count(phase(&r, "Writing to idle memory", 0), "s2_access_fault"),
        pages
    );
    assert_eq!(
        count(phase(&r, "Reading from idle memory", 0), "s2_access_fault"),
        pages
    );
}

#[test]
fn the_threads_engine_loses_nothing() {
    for aging in [Aging::Locked, Aging::Lockless] {
        let r = run_access_tracking_threads(&small(aging), false).unwrap();
        assert!(r.oracle.passed(), "{aging:?}: {:?}", r.oracle);
        assert_eq!(r.oracle.pages_checked, 3 * PAGES_PER_VCPU);
    }
}

#[test]
fn overlapped_memory_is_marked_by_vcpu_0_alone() {
    let p = AccessTrackingParams {
        overlap: true,
        ..small(Aging::Lockless)
    };
    let r = run_access_tracking_virtual(&p, &CostModel::default(), false).unwrap();
    assert!(r.oracle.passed(), "{:?}", r.oracle);
    let m = &phase(&r, "Mark memory idle", 0).marks;
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].marked, 3 * PAGES_PER_VCPU);
}

#[test]
fn virtual_time_runs_are_identical_and_bad_input_is_refused() {
    let p = small(Aging::Locked);
    let a = run_access_tracking_virtual(&p, &CostModel::default(), false).unwrap();
    let b = run_access_tracking_virtual(&p, &CostModel::default(), false).unwrap();
    assert_eq!(a.to_text(true), b.to_text(true));
    for bad in [
        AccessTrackingParams {
            vcpus: 0,
            ..small(Aging::Locked)
        },
        AccessTrackingParams {
            vcpu_bytes: 1000,
            ..small(Aging::Locked)
        },
        AccessTrackingParams {
            mmu: MmuKind::Shadow { ept: false },
            ..small(Aging::Locked)
        },
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(!e.contains('\n'), "{e}");
    }
}
