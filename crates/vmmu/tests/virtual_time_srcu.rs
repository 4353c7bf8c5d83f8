//! Virtual time's SRCU grace period: a vCPU waiting for `mmu_lock` in a fault is inside
//! `kvm->srcu`, and a VMM `synchronize_srcu()` must wait for it, as the kernel's does. vCPUs
//! write continuously (background passes) while the VMM turns dirty logging on and off again
//! and again (each change is a flag update, a `synchronize_srcu()` and lock-taking jobs), with
//! faults that take the write lock (arm64's 5.17 regime, the shadow MMU).

use vmmu::arm64::Arm64Lock;
use vmmu::cost::CostModel;
use vmmu::engine::virtual_time::{VirtualTime, VirtualWaiter};
use vmmu::engine::{Engine, GuestAccess, GuestCode};
use vmmu::host::backing::Backing;
use vmmu::kvm::dirty_log::set_memslot_flags_plan;
use vmmu::units::Gfn;
use vmmu::vm::{MmuKind, Vm, VmConfig, KVM_MEM_LOG_DIRTY_PAGES};

const BASE_GFN: u64 = 0x40000;
const PAGES: u64 = 512;

/// Writes every page of its own quarter of the slot, pass after pass.
struct Writer {
    first: u64,
    i: u64,
}

impl GuestCode for Writer {
    fn start_pass(&mut self, _: i64) {
        self.i = 0;
    }
    fn next_access(&mut self) -> Option<GuestAccess> {
        (self.i < PAGES / 4).then(|| {
            self.i += 1;
            GuestAccess::first_word(Gfn(BASE_GFN + self.first + self.i - 1), true, self.i)
        })
    }
    fn access_done(&mut self, _: &GuestAccess) {}
}

#[test]
fn synchronize_srcu_waits_for_the_faults_in_flight() {
    let stage2 = MmuKind::Stage2 {
        lock: Arm64Lock::Spin,
        ia_bits: 40,
        split_chunk_pages: 0,
        cpu: Default::default(),
        relax_flush: Default::default(),
    };
    // The shadow MMU fixes write-protected 4K pages on its fast path without the lock; over 2M
    // pages each logging round breaks blocks under the write lock.
    for (mmu, cost, backing) in [
        (stage2, CostModel::default_arm64(), Backing::Anonymous),
        (
            MmuKind::Shadow { ept: true },
            CostModel::default(),
            Backing::AnonymousThp,
        ),
    ] {
        let vm = Vm::with_waiter(
            VmConfig {
                vcpus: 4,
                eager_page_split: false,
                mmu,
                pml: false,
                kernel: Default::default(),
            },
            Box::new(VirtualWaiter),
        );
        vm.set_user_memory_region(1, BASE_GFN << 12, PAGES << 12, backing, 0)
            .unwrap();
        let slot = vm.kvm.slot_by_id(1).unwrap();
        let guests = (0..4)
            .map(|k| Writer {
                first: k * PAGES / 4,
                i: 0,
            })
            .collect();
        let mut e = VirtualTime::new(&vm, &cost, guests).unwrap();
        e.run_pass(0).unwrap();
        e.start_background_passes(1);
        for round in 0..200 {
            let flags = if round % 2 == 0 {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            };
            e.run_plans(vec![set_memslot_flags_plan(&vm.kvm, &slot, flags)])
                .unwrap();
        }
        e.stop_vcpus().unwrap();
        assert!(vm.check_invariants().is_empty(), "{mmu:?}");
        let faults: u64 = e.vcpu_meters().iter().map(|m| m.pf_slow).sum();
        assert!(faults > 500, "{mmu:?}: the vCPUs kept faulting ({faults})");
    }
}
