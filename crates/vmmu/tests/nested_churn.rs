//! Nested EPT and seed 004's orphan zapping, through the `nested-churn` scenario on both
//! engines: the L2s' writes land where L1 mapped them, the invariants hold, and zapping
//! orphans changes what stays behind the way the seed describes.

use vmmu::cost::CostModel;
use vmmu::lab::nested_churn::*;
use vmmu::x86::shadow::state::ZapOrphans;

/// 10 L2s of 16 MiB (8 PTs under one PD each) on 4 L1 vCPUs: more EPTPs than a vCPU caches
/// roots for, so roots are reloaded and their leaves re-synced, as in the seed.
fn small(zap: ZapOrphans) -> NestedChurnParams {
    NestedChurnParams {
        l1_memory: 1 << 30,
        l2_memory: 16 << 20,
        concurrent: 10,
        rounds: 5,
        l1_vcpus: 4,
        quantum: 512,
        zap_orphans: zap,
        ..Default::default()
    }
}

fn run(p: &NestedChurnParams) -> NestedChurnReport {
    run_nested_churn_virtual(p, &CostModel::default(), false).unwrap()
}

#[test]
fn without_zapping_orphans_stale_pages_pile_up_and_slot_deletion_pays_for_them() {
    let off = run(&small(ZapOrphans::Off));
    let on = run(&small(ZapOrphans::On));
    let v1 = run(&small(ZapOrphans::V1));
    for r in [&off, &on, &v1] {
        assert!(r.oracle.passed(), "{}", r.to_text(false));
        assert_eq!(r.oracle.pages_checked, 10 * 5 * 4096);
    }
    let stale = |r: &NestedChurnReport| r.rounds.iter().map(|x| x.census.stale).collect::<Vec<_>>();
    let (s_off, s_on) = (stale(&off), stale(&on));
    // Off: the PT pages KVM had synced stay behind every round.
    assert!(s_off.windows(2).all(|w| w[1] > w[0]), "{s_off:?}");
    // On: at most the two PTs a PD's first, non-flooding stores unlink, per L2 and round.
    for (k, (&a, &b)) in s_on.iter().zip(&s_off).enumerate() {
        assert!(
            a <= 2 * 10 * (k as u64 + 1),
            "round {}: {a} stale with zapping on",
            k + 1
        );
        assert!(a < b, "round {}: {a} stale with zapping on, {b} off", k + 1);
    }
    // v1 zaps any parentless child, so it leaves no more than v2 here (all pages are nested).
    assert!(stale(&v1).last() <= s_on.last());
    // Deleting memslot 0 zaps every page that is left: far more without the technique.
    let zapped = |r: &NestedChurnReport| r.delete_slot0.counters.as_ref().unwrap()["sp_zapped"];
    assert!(
        zapped(&off) > 2 * zapped(&on),
        "{} vs {}",
        zapped(&off),
        zapped(&on)
    );
    assert!(off.delete_slot0.wall_ns > 2 * on.delete_slot0.wall_ns);
    // Nothing is left after the deletion but L1's own direct pages.
    assert!(off.rounds.last().unwrap().census.used >= off.before_delete.stale);
}

#[test]
fn virtual_time_is_deterministic() {
    let a = serde_json::to_string(&run(&small(ZapOrphans::Off))).unwrap();
    let b = serde_json::to_string(&run(&small(ZapOrphans::Off))).unwrap();
    assert_eq!(a, b);
}

#[test]
fn the_threads_engine_runs_l1_vcpus_and_their_l2s_as_threads() {
    for zap in [ZapOrphans::Off, ZapOrphans::On] {
        let p = NestedChurnParams {
            rounds: 3,
            ..small(zap)
        };
        let r = run_nested_churn_threads(&p, false).unwrap();
        assert_eq!(r.engine, "threads");
        assert!(r.oracle.passed(), "{}", r.to_text(false));
        assert_eq!(r.oracle.pages_checked, 10 * 3 * 4096);
    }
}

/// The negative control: KVM misses L1's writes to the EPT12 tables it shadows. L1 reuses a
/// small table pool, so a new L2's table lands on a page whose stale EPT02 shadow KVM finds
/// again by hash; the L2 then writes through translations L1 took away, and the oracles see
/// pages that do not hold what was written, or EPT02 entries EPT12 does not have.
#[test]
fn an_l1_write_kvm_does_not_see_is_caught() {
    let p = NestedChurnParams {
        table_memory: 128 << 12,
        write_tracking: false,
        ..small(ZapOrphans::On)
    };
    let r = run(&p);
    assert!(
        !r.oracle.passed(),
        "the broken KVM went unnoticed: {}",
        r.to_text(false)
    );
    assert!(r.oracle.misplaced > 0 && !r.oracle.invariant_errors.is_empty());
    assert!(
        r.oracle
            .invariant_errors
            .iter()
            .any(|e| e.starts_with("stale EPT02 entry")),
        "{:?}",
        &r.oracle.invariant_errors[..4]
    );
    let ok = run(&NestedChurnParams {
        write_tracking: true,
        ..p
    });
    assert!(ok.oracle.passed(), "{}", ok.to_text(false));
}

#[test]
fn bad_configurations_are_refused_with_one_line() {
    let base = small(ZapOrphans::On);
    for (p, want) in [
        (
            NestedChurnParams {
                rounds: 0,
                ..base.clone()
            },
            "--rounds",
        ),
        (
            NestedChurnParams {
                concurrent: 100,
                ..base.clone()
            },
            "more than --l1-memory",
        ),
        (
            NestedChurnParams {
                l2_memory: 5000,
                ..base.clone()
            },
            "--l2-memory",
        ),
        (
            NestedChurnParams {
                l1_vcpus: 0,
                ..base.clone()
            },
            "--l1-vcpus",
        ),
        (
            NestedChurnParams {
                mmu_pages: Some(3),
                ..base.clone()
            },
            "--mmu-pages",
        ),
        (
            NestedChurnParams {
                table_memory: 8 << 12,
                ..base.clone()
            },
            "--l1-table-memory",
        ),
    ] {
        let e = p.validate().unwrap_err().to_string();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    }
}

#[test]
fn the_chart_draws_a_line_per_side() {
    let reports = [run(&small(ZapOrphans::Off)), run(&small(ZapOrphans::On))];
    let path = std::env::temp_dir().join(format!("vmmu-nested-{}.svg", std::process::id()));
    plot_boot_times(&path, &reports).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..80]);
    for label in [
        "zap orphans off (Linux 5.8",
        "zap orphans on (Linux 5.9+)",
        "round",
    ] {
        assert!(svg.contains(label), "no {label:?} in the chart");
    }
}

/// A small quota (`KVM_SET_NR_MMU_PAGES`) bounds the leak: faults make room by zapping the
/// oldest unrooted pages (`kvm_mmu_zap_oldest_mmu_pages()`), stale ones among them.
#[test]
fn a_small_quota_recycles_what_leaks() {
    let p = NestedChurnParams {
        mmu_pages: Some(256),
        ..small(ZapOrphans::Off)
    };
    let r = run(&p);
    assert!(r.oracle.passed(), "{}", r.to_text(false));
    assert_eq!(r.quota, 256);
    let last = &r.rounds.last().unwrap().census;
    assert!(last.recycled > 0, "{last:?}");
    assert!(r.rounds.iter().all(|x| x.census.used <= 256));
    let free = run(&small(ZapOrphans::Off));
    assert!(last.stale < free.rounds.last().unwrap().census.stale);
}
