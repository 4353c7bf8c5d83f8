//! Intel PML in dirty logging, through the VM API and the scenario: enabling logging clears D
//! on 4K leaves (huge leaves are write-protected), writes then take no EPT violation and are
//! logged by the CPU, a full log exits every 512 entries, every exit empties the log into the
//! bitmap, GET/CLEAR clear D again and kick vCPUs without waiting, so a page still in a
//! running vCPU's log is reported by the next harvest. The completeness oracle holds on both
//! engines, and catches a KVM that drops its log instead of emptying it (negative control).

mod common;

use common::{assert_invariants, gfn, run_threads, run_virtual, set_slot, small, GPA, PAGE, SLOT};
use vmmu::host::backing::Backing;
use vmmu::hw::pml::{PmlLog, PML_LOG_NR_ENTRIES};
use vmmu::lab::oracle::DirtyLogOracle;
use vmmu::lab::params::DirtyLogParams;
use vmmu::vm::{MmuKind, Vm, VmConfig, KVM_MEM_LOG_DIRTY_PAGES};

const PAGES: u64 = 2048;
const EPT_MMUS: [MmuKind; 2] = [MmuKind::Tdp, MmuKind::Shadow { ept: true }];

/// A one-vCPU VM with PML and a populated `PAGES`-page memslot over 2M hugetlb, then dirty
/// logging enabled (no manual protect: GET re-protects).
fn logging_vm(mmu: MmuKind, eager_split: bool) -> Vm {
    let vm = Vm::new(VmConfig {
        vcpus: 1,
        eager_page_split: eager_split,
        mmu,
        pml: true,
        kernel: Default::default(),
    });
    set_slot(&vm, PAGES * PAGE, Backing::AnonymousHugetlb2mb, 0);
    vm.vcpu_run(0, (0..PAGES).map(|p| (gfn(p), true))).unwrap();
    set_slot(
        &vm,
        PAGES * PAGE,
        Backing::AnonymousHugetlb2mb,
        KVM_MEM_LOG_DIRTY_PAGES,
    );
    vm
}

fn bits(bitmap: &[u64]) -> Vec<u64> {
    (0..bitmap.len() as u64 * 64)
        .filter(|i| bitmap[(*i / 64) as usize] & (1 << (i % 64)) != 0)
        .collect()
}

#[test]
fn writes_take_no_fault_are_logged_and_a_full_log_exits_every_512() {
    for mmu in EPT_MMUS {
        let vm = logging_vm(mmu, true);
        let n = 1100;
        let m = vm.vcpu_run(0, (0..n).map(|p| (gfn(p), true))).unwrap();
        assert_eq!(m.ept_violations, 0, "{mmu:?}: {m:?}");
        assert_eq!(m.pml_logged, n, "{mmu:?}");
        // The 513th and the 1025th write found the log full.
        assert_eq!(m.pml_full_exits, n / PML_LOG_NR_ENTRIES as u64, "{mmu:?}");
        // Two full logs emptied at those exits (the rest at the run's last exit, after `m`).
        assert_eq!(m.pml_drained, 2 * PML_LOG_NR_ENTRIES as u64, "{mmu:?}");
        assert_eq!(
            bits(&vm.get_dirty_log(SLOT).unwrap()),
            (0..n).collect::<Vec<_>>()
        );
        assert_invariants(&vm);
        // GET cleared D: the same pages are logged again, and nothing else is reported.
        let m = vm
            .vcpu_run(0, [(gfn(7), true), (gfn(2000), false)])
            .unwrap();
        assert_eq!((m.ept_violations, m.pml_logged), (0, 1), "{mmu:?}");
        assert_eq!(bits(&vm.get_dirty_log(SLOT).unwrap()), vec![7]);
        // A second write to a page whose D is set is not logged again.
        let m = vm.vcpu_run(0, [(gfn(9), true), (gfn(9), true)]).unwrap();
        assert_eq!(m.pml_logged, 1, "{mmu:?}");
        assert_invariants(&vm);
    }
}

#[test]
fn without_eager_split_huge_pages_are_write_protected_and_split_by_faults() {
    for mmu in EPT_MMUS {
        let vm = logging_vm(mmu, false);
        let m = vm.vcpu_run(0, [(gfn(3), true), (gfn(4), true)]).unwrap();
        // The 2M leaf is write-protected: each write faults (the first splits the huge page and
        // maps 4K writable and dirty; how the second is fixed depends on what the split left:
        // the TDP MMU's children are write-protected and clean, so the fast path restores W
        // and the CPU then logs the write; the shadow MMU maps it in the slow path).
        assert!(m.ept_violations >= 2, "{mmu:?}: {m:?}");
        assert!(m.split_in_fault >= 1, "{mmu:?}: {m:?}");
        assert_eq!(bits(&vm.get_dirty_log(SLOT).unwrap()), vec![3, 4]);
        // Re-protected by clearing D: the next write is logged, not faulted.
        let m = vm.vcpu_run(0, [(gfn(3), true)]).unwrap();
        assert_eq!((m.ept_violations, m.pml_logged), (0, 1), "{mmu:?}: {m:?}");
        assert_eq!(bits(&vm.get_dirty_log(SLOT).unwrap()), vec![3]);
        assert_invariants(&vm);
    }
}

/// GET kicks a vCPU in guest mode and does not wait: a page still in its log is reported by
/// the harvest after the vCPU takes the kick's exit, never lost.
#[test]
fn a_page_in_a_running_vcpus_log_is_reported_by_the_next_harvest() {
    for mmu in EPT_MMUS {
        let vm = logging_vm(mmu, true);
        let kvm = std::sync::Arc::clone(&vm.kvm);
        let mut v = vm.vcpu(0);
        v.run_begin(&kvm);
        v.enter_guest(&kvm);
        vmmu::vm::exit::guest_access(&kvm, &*vm.mmu, &mut v, gfn(5), 0, true, 1).unwrap();
        assert_eq!(v.pml.len(), 1);
        drop(v);
        assert!(
            bits(&vm.get_dirty_log(SLOT).unwrap()).is_empty(),
            "{mmu:?}: still in the log"
        );
        let mut v = vm.vcpu(0);
        // The next access sees the kick: the exit empties the log.
        vmmu::vm::exit::guest_access(&kvm, &*vm.mmu, &mut v, gfn(6), 0, false, 0).unwrap();
        assert!(v.pml.is_empty());
        v.exit_guest(&kvm);
        v.run_end(&kvm);
        drop(v);
        assert_eq!(bits(&vm.get_dirty_log(SLOT).unwrap()), vec![5], "{mmu:?}");
    }
}

/// The negative control: a KVM that drops the vCPU's log at an exit instead of emptying it
/// into the bitmap loses the writes, and the completeness oracle says which.
#[test]
fn the_oracle_catches_a_dropped_pml_log() {
    for drop_log in [false, true] {
        let vm = logging_vm(MmuKind::Tdp, true);
        let oracle = DirtyLogOracle::new(GPA >> 12, PAGES);
        oracle.logging_enabled();
        let kvm = std::sync::Arc::clone(&vm.kvm);
        let mut v = vm.vcpu(0);
        v.run_begin(&kvm);
        v.enter_guest(&kvm);
        for p in [10, 11, 700] {
            let s = oracle.before_write();
            vmmu::vm::exit::guest_access(&kvm, &*vm.mmu, &mut v, gfn(p), 0, true, p).unwrap();
            oracle.after_write(gfn(p).0, s);
        }
        if drop_log {
            let enabled = v.pml.enabled();
            v.pml = PmlLog::default();
            v.pml.set_enabled(enabled);
        }
        v.exit_guest(&kvm);
        v.run_end(&kvm);
        drop(v);
        let k = oracle.begin_harvest();
        oracle.record_report(k, GPA >> 12, &vm.get_dirty_log(SLOT).unwrap());
        let lost = oracle.end_harvest(k).lost;
        let want: Vec<u64> = if drop_log {
            [10, 11, 700].iter().map(|&p| gfn(p).0).collect()
        } else {
            vec![]
        };
        assert_eq!(lost, want, "drop_log={drop_log}");
    }
}

/// The `dirty-log` scenario with PML on both engines, every MMU with EPT, with and without
/// eager splitting and manual protect: the oracles hold, and once the first harvest has
/// re-protected the pages, the dirty passes take no EPT violation.
#[test]
fn dirty_log_scenario_with_pml_holds_its_oracles_on_both_engines() {
    for mmu in EPT_MMUS {
        for (eager_split, manual_protect) in [(true, false), (true, true), (false, false)] {
            let p = DirtyLogParams {
                mmu,
                pml: true,
                eager_split,
                manual_protect,
                ..small(2, Backing::AnonymousHugetlb2mb)
            };
            for r in [run_threads(&p), run_virtual(&p)] {
                // The first pass may fault (huge pages are write-protected, and with
                // initially-all-set nothing is protected until the first CLEAR); every later
                // pass writes pages whose D the harvest cleared: each write is logged once,
                // and none faults.
                for it in &r.iterations[1..] {
                    let c = it.dirty.counters.as_ref().unwrap();
                    let get = |k: &str| c.get(k).copied().unwrap_or(0);
                    assert_eq!(get("pml_logged"), get("guest_writes"), "{p:?}: {c:?}");
                    assert_eq!(get("ept_violations"), 0, "{p:?}: {c:?}");
                }
            }
        }
    }
}

/// PML needs EPT: shadow paging and arm64 refuse it.
#[test]
fn pml_without_ept_is_refused() {
    let e = Vm::try_with_waiter(
        VmConfig {
            mmu: MmuKind::Shadow { ept: false },
            pml: true,
            ..Default::default()
        },
        Box::new(vmmu::vm::waiter::SpinWaiter),
    )
    .err()
    .expect("refused");
    assert!(e.to_string().contains("EPT"), "{e}");
}
