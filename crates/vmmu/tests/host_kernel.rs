//! The host kernel's choices that change what KVM's MMU does: the TDP MMU's eager-split
//! allocation (Linux 6.0's `GFP_NOWAIT` under `mmu_lock` against 6.11's lock drop), and the
//! preemption model that decides whether long jobs yield `mmu_lock` to waiting vCPUs.

mod common;

use common::{set_slot, PAGE};
use vmmu::host::backing::Backing;
use vmmu::kvm::mmu_lock::Preemption;
use vmmu::lab::params::DirtyLogParams;
use vmmu::vm::{HostKernel, MmuKind, Vm, VmConfig};
use vmmu::x86::tdp_mmu::SplitAlloc;

fn vm(kernel: HostKernel) -> Vm {
    let vm = Vm::new(VmConfig {
        kernel,
        ..Default::default()
    });
    set_slot(&vm, 4 << 30 >> 12 << 12, Backing::AnonymousHugetlb1gb, 0);
    let pages = (4u64 << 30) / PAGE;
    vm.vcpu_run(0, (0..pages).step_by(512).map(|p| (common::gfn(p), true)))
        .unwrap();
    vm
}

#[test]
fn linux_6_0_splits_without_dropping_the_lock_and_6_11_drops_it_for_every_table() {
    let split = |tdp_split_alloc| {
        vm(HostKernel {
            tdp_split_alloc,
            ..Default::default()
        })
        .eager_split_slot(common::SLOT)
        .unwrap()
    };
    let old = split(SplitAlloc::NowaitFirst);
    let new = split(SplitAlloc::DropLock);
    // 4 x (1 + 512) huge pages split, one table each.
    assert_eq!(old.split_eager, 4 * 513);
    assert_eq!(new.split_eager, old.split_eager);
    assert_eq!(old.tables_allocated, old.split_eager);
    assert_eq!(new.tables_allocated, new.split_eager);
    assert_eq!(old.lock_drops_for_alloc, 0, "{old:?}");
    assert_eq!(new.lock_drops_for_alloc, new.split_eager, "{new:?}");
}

/// The scenario with vCPUs running while logging is disabled (`-e`): with preemption, the
/// recovery job yields `mmu_lock` to them; without, it never does. The oracles hold either way.
#[test]
fn without_preemption_long_jobs_never_yield_to_waiting_vcpus() {
    let run = |preemption| {
        let p = DirtyLogParams {
            vcpus: 4,
            vcpu_memory_bytes: 16 << 20,
            iterations: 2,
            backing: Backing::AnonymousHugetlb2mb,
            manual_protect: false,
            run_vcpus_while_disabling: true,
            mmu: MmuKind::Shadow { ept: true },
            kernel: HostKernel {
                preemption,
                ..Default::default()
            },
            ..Default::default()
        };
        let r = common::run_virtual(&p);
        common::counter(&r.disable, "lock_yields")
    };
    assert!(
        run(Preemption::Full) > 0,
        "the recovery yields to the vCPUs"
    );
    assert_eq!(run(Preemption::None), 0);
}
