//! Yield points are restart-safe: every long MMU operation (eager splitting when logging is
//! enabled and inside `KVM_CLEAR_DIRTY_LOG` with initially-all-set, write-protecting a slot,
//! huge-page recovery when logging is disabled) gives the same page tables, dirty bitmap, page
//! stats and work done whether it runs uninterrupted or yields `mmu_lock` at its yield points
//! and resumes from its cursor. The yields are forced with `MmuLock::force_needbreak_every()`,
//! for the TDP MMU and the shadow MMU (direct, EPT on).

mod common;

use common::{gfn, lookup, set_slot, two_vcpu_vm, write_pages, SLOT};
use std::collections::BTreeMap;
use vmmu::host::backing::Backing;
use vmmu::hw::walker::WalkResult;
use vmmu::kvm::dirty_log::{clear_dirty_log_plan, set_memslot_flags_plan};
use vmmu::kvm::meter::{Meter, METER_FIELDS};
use vmmu::kvm::op_plan::OpPlan;
use vmmu::vm::plan::{run_job, run_plan_with};
use vmmu::vm::{MmuKind, Vm, KVM_MEM_LOG_DIRTY_PAGES};

/// Eight 2M regions; the guest first touches all but the third and the sixth, so walks cross
/// empty ranges.
const BYTES: u64 = 16 << 20;
const PAGES: u64 = BYTES / 4096;
const BACKING: Backing = Backing::AnonymousHugetlb2mb;

const MMUS: [MmuKind; 2] = [MmuKind::Tdp, MmuKind::Shadow { ept: true }];

/// Work that must not depend on where a job stopped: a restart must neither redo nor skip any
/// of it. (Entries read, flushes and lock acquisitions do depend on it.)
const SAME_WORK: &[&str] = &[
    "split_eager",
    "huge_recovered",
    "sptes_wrprot",
    "sp_zapped",
    "tables_allocated",
    "tables_freed",
    "pages_dirtied",
];

/// What a run leaves behind, compared between the runs.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    /// What a hardware read of each page of the slot finds (leaf level, frame, permissions).
    walks: Vec<WalkResult>,
    bitmap: Vec<u64>,
    page_stats: [i64; 3],
    mmu_stats: Vec<(&'static str, u64)>,
}

fn snapshot(vm: &Vm) -> Snapshot {
    let e = vm.check_invariants();
    assert!(e.is_empty(), "{e:#?}");
    let slot = vm.kvm.slot_by_id(SLOT).unwrap();
    let guard = crossbeam_epoch::pin();
    let mut reads = 0;
    Snapshot {
        // Every leaf the jobs leave has its Accessed bit set, so these reads change nothing.
        walks: (0..PAGES)
            .map(|p| vm.mmu.hw_walk(gfn(p), false, false, &guard, &mut reads))
            .collect(),
        bitmap: (0..slot.bitmap_words())
            .map(|i| {
                slot.bitmap_word(i)
                    .load(std::sync::atomic::Ordering::SeqCst)
            })
            .collect(),
        page_stats: vm.mmu.page_stats(),
        mmu_stats: vm.mmu.mmu_stats(),
    }
}

/// What the jobs of one stage did: the VMM's meter, and the yields of each job by name.
struct Stage {
    meter: Meter,
    yields: BTreeMap<&'static str, u64>,
}

impl Stage {
    fn work(&self) -> Vec<(&'static str, u64)> {
        let counts = self.meter.counts();
        SAME_WORK
            .iter()
            .map(|&n| {
                let fields = METER_FIELDS.iter().copied().zip(counts.iter().copied());
                (n, lookup(fields, n))
            })
            .collect()
    }
}

/// Runs `plan` on the threads engine, with every `every`-th `needbreak()` forced true (0: none).
fn run_stage(vm: &Vm, plan: OpPlan, every: u32) -> Stage {
    let kvm = &*vm.kvm;
    kvm.mmu_lock.force_needbreak_every(every);
    let mut meter = Meter::default();
    let mut yields = BTreeMap::new();
    run_plan_with(
        kvm,
        plan,
        &mut meter,
        &mut |_, _| {},
        &mut |kvm, job, meter| {
            let before = meter.lock_yields;
            let flush = run_job(kvm, job, meter);
            *yields.entry(job.name()).or_insert(0) += meter.lock_yields - before;
            flush
        },
    );
    kvm.mmu_lock.force_needbreak_every(0);
    vm.add_vmm_meter(&meter);
    Stage { meter, yields }
}

fn set_flags_stage(vm: &Vm, flags: u32, every: u32) -> Stage {
    let slot = vm.kvm.slot_by_id(SLOT).unwrap();
    run_stage(vm, set_memslot_flags_plan(&vm.kvm, &slot, flags), every)
}

/// Guest writes that map the slot huge, but for regions 2 and 5.
fn map_huge(vm: &Vm) {
    let touched = |p: &u64| ![2, 5].contains(&(p / 512));
    write_pages(vm, (0..PAGES).filter(touched), 1);
    assert_eq!(vm.mmu.page_stats(), [0, 6, 0]);
}

/// Logging on (eager split, then write protection), guest writes, `KVM_GET_DIRTY_LOG`, logging
/// off (huge-page recovery). Returns each job stage with the state after it.
fn enable_get_disable(mmu: MmuKind, eager_split: bool, every: u32) -> Vec<(Stage, Snapshot)> {
    let vm = two_vcpu_vm(mmu, eager_split);
    set_slot(&vm, BYTES, BACKING, 0);
    map_huge(&vm);
    let mut out = Vec::new();
    let enable = set_flags_stage(&vm, KVM_MEM_LOG_DIRTY_PAGES, every);
    out.push((enable, snapshot(&vm)));
    write_pages(&vm, (0..PAGES).step_by(5), 2);
    vm.get_dirty_log(SLOT).unwrap();
    write_pages(&vm, (3..PAGES).step_by(11), 3);
    let disable = set_flags_stage(&vm, 0, every);
    out.push((disable, snapshot(&vm)));
    out
}

/// Manual protect with initially-all-set: logging on does nothing; the first
/// `KVM_CLEAR_DIRTY_LOG` splits and write-protects, under the write lock, the pages it clears:
/// the first half of the slot (all but a few pages of a huge page), then the second.
fn clear_initially_set(mmu: MmuKind, every: u32) -> Vec<(Stage, Snapshot)> {
    let vm = two_vcpu_vm(mmu, true);
    vm.enable_manual_dirty_log_protect(true).unwrap();
    set_slot(&vm, BYTES, BACKING, 0);
    map_huge(&vm);
    set_slot(&vm, BYTES, BACKING, KVM_MEM_LOG_DIRTY_PAGES);
    let slot = vm.kvm.slot_by_id(SLOT).unwrap();
    let mut out = Vec::new();
    let half = PAGES / 2;
    let mut bitmap = vec![u64::MAX; (half / 64) as usize];
    bitmap[3] = 0xf0f0_0000_ffff_0f0f;
    let plan = clear_dirty_log_plan(&vm.kvm, &slot, 0, half, &bitmap).unwrap();
    out.push((run_stage(&vm, plan, every), snapshot(&vm)));
    write_pages(&vm, (1..PAGES).step_by(7), 2);
    let all = vec![u64::MAX; bitmap.len()];
    let plan = clear_dirty_log_plan(&vm.kvm, &slot, half, half, &all).unwrap();
    out.push((run_stage(&vm, plan, every), snapshot(&vm)));
    out
}

/// Whether `job` has a yield point it can reach in these scenarios. The TDP MMU's split inside
/// CLEAR walks the 2M entry of one 64-page mask, and a walk only yields once it has moved past
/// the gfn it (re)started at (`tdp_mmu_iter_cond_resched()`'s forward-progress rule), so it
/// never yields there; the shadow MMU's does, before each split.
fn can_yield(mmu: MmuKind, job: &str) -> bool {
    !(mmu == MmuKind::Tdp && job == "clear_dirty_log")
}

/// Compares a scenario run with forced yields against the same scenario without: in each
/// stage every job that can yield did in the forced run (and none did in the other), the same
/// work was done and the same state left.
fn assert_restart_safe(
    mmu: MmuKind,
    what: &str,
    every: u32,
    scenario: impl Fn(u32) -> Vec<(Stage, Snapshot)>,
) {
    let plain = scenario(0);
    let forced = scenario(every);
    assert_eq!(plain.len(), forced.len());
    for (i, ((p, ps), (f, fs))) in plain.iter().zip(&forced).enumerate() {
        let ctx = format!("{what}, needbreak every {every}, stage {i}");
        assert!(!p.yields.is_empty(), "{ctx}: no job ran");
        assert!(p.yields.values().all(|&y| y == 0), "{ctx}: {:?}", p.yields);
        assert_eq!(
            p.yields.keys().collect::<Vec<_>>(),
            f.yields.keys().collect::<Vec<_>>(),
            "{ctx}"
        );
        for (&job, &y) in &f.yields {
            assert_eq!(y > 0, can_yield(mmu, job), "{ctx}: {job} yielded {y} times");
        }
        assert_eq!(p.work(), f.work(), "{ctx}: work done");
        assert_eq!(ps, fs, "{ctx}: state after the stage");
    }
}

/// Needbreak periods to force. The shadow MMU's split checks `rwlock_needbreak()` before it
/// splits anything (`need_topup_split_caches_or_resched()`), so a waiter at every check would
/// keep it from progressing: it gets every other check at most.
fn periods(mmu: MmuKind, splits: bool) -> &'static [u32] {
    if matches!(mmu, MmuKind::Shadow { .. }) && splits {
        &[2, 3]
    } else {
        &[1, 2, 3]
    }
}

#[test]
fn enabling_and_disabling_logging_give_the_same_tables_with_yields_at_every_yield_point() {
    for mmu in MMUS {
        for eager_split in [false, true] {
            for &every in periods(mmu, eager_split) {
                assert_restart_safe(
                    mmu,
                    &format!("{mmu:?}, eager split {eager_split}, enable/GET/disable"),
                    every,
                    |e| enable_get_disable(mmu, eager_split, e),
                );
            }
        }
    }
}

#[test]
fn clear_dirty_log_with_initially_set_gives_the_same_tables_with_yields_at_every_yield_point() {
    for mmu in MMUS {
        for &every in periods(mmu, true) {
            assert_restart_safe(
                mmu,
                &format!("{mmu:?}, CLEAR with initially-all-set"),
                every,
                |e| clear_initially_set(mmu, e),
            );
        }
    }
}

/// The stages run the jobs they are meant to check.
#[test]
fn the_stages_run_every_job_kind() {
    let names = |stages: Vec<(Stage, Snapshot)>| -> Vec<Vec<&'static str>> {
        stages
            .iter()
            .map(|(s, _)| s.yields.keys().copied().collect())
            .collect()
    };
    assert_eq!(
        names(enable_get_disable(MmuKind::Tdp, true, 0)),
        [
            vec!["tdp_mmu_split_huge_pages", "tdp_mmu_wrprot_slot"],
            vec!["tdp_mmu_recover_huge_pages"],
        ]
    );
    assert_eq!(
        names(enable_get_disable(MmuKind::Shadow { ept: true }, true, 0)),
        [
            vec!["shadow_mmu_try_split_huge_pages", "slot_rmap_write_protect"],
            vec!["kvm_rmap_zap_collapsible_sptes"],
        ]
    );
    assert_eq!(
        names(clear_initially_set(MmuKind::Tdp, 0)),
        [vec!["clear_dirty_log"], vec!["clear_dirty_log"]]
    );
    // The work itself: everything split, then recovered.
    let stages = enable_get_disable(MmuKind::Tdp, true, 0);
    assert_eq!(stages[0].0.meter.split_eager, 6);
    assert_eq!(stages[0].1.page_stats, [3072, 0, 0]);
    // The guest wrote to the untouched regions while logging: mapped at 4K, recovered too.
    assert_eq!(stages[1].0.meter.huge_recovered, 8);
    assert_eq!(stages[1].1.page_stats, [0, 8, 0]);
}
