//! Concurrency stress with the oracles on: vCPU threads fault, write and read at random while
//! the VMM thread enables logging (eager split + write-protect), harvests (GET / CLEAR with the
//! initially-all-set split path), and disables logging (in-place huge-page recovery), over and
//! over, on the TDP MMU, the shadow MMU and arm64's stage 2 in each lock regime. Every harvest
//! is checked by the completeness oracle (in its concurrent form: KVM may
//! report a page one harvest late when a fast-path fix races the harvest), and the page-table
//! invariants are checked at the end.

mod common;

use common::assert_invariants;
use parking_lot::RwLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use vmmu::host::backing::Backing;
use vmmu::lab::memstress::GuestRandom;
use vmmu::lab::oracle::DirtyLogOracle;
use vmmu::units::Gfn;
use vmmu::vm::exit::guest_access;
use vmmu::vm::{HostKernel, MmuKind, Vm, VmConfig, KVM_MEM_LOG_DIRTY_PAGES};

const SLOTS: [(u32, u64, u64, Backing); 2] = [
    (1, 1 << 30, 4096, Backing::AnonymousHugetlb2mb),
    (2, 2 << 30, 1 << 18, Backing::AnonymousHugetlb1gb),
];

fn stress(manual_init_set: bool, eager_split: bool, seed: u32) {
    stress_mmu(MmuKind::Tdp, manual_init_set, eager_split, seed)
}

fn stress_mmu(mmu: MmuKind, manual_init_set: bool, eager_split: bool, seed: u32) {
    stress_vm(mmu, false, manual_init_set, eager_split, seed)
}

fn stress_vm(mmu: MmuKind, pml: bool, manual_init_set: bool, eager_split: bool, seed: u32) {
    stress_kernel(
        mmu,
        pml,
        HostKernel::default(),
        manual_init_set,
        eager_split,
        seed,
    )
}

/// One stress run at a time in this binary: each runs four vCPU threads and the VMM thread,
/// and on a 2-core machine two runs at once starve each other's vCPUs.
static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

fn stress_kernel(
    mmu: MmuKind,
    pml: bool,
    kernel: HostKernel,
    manual_init_set: bool,
    eager_split: bool,
    seed: u32,
) {
    let _serial = ONE_AT_A_TIME.lock();
    let nr_vcpus = 4;
    let vm = Arc::new(Vm::new(VmConfig {
        vcpus: nr_vcpus,
        eager_page_split: eager_split,
        mmu,
        pml,
        kernel,
    }));
    if manual_init_set {
        vm.enable_manual_dirty_log_protect(true).unwrap();
    }
    for (id, gpa, pages, backing) in SLOTS {
        vm.set_user_memory_region(id, gpa, pages * 4096, backing, 0)
            .unwrap();
    }
    if mmu.shadow_paging() {
        vm.setup_guest_page_tables(0, 0, vmmu::x86::spte::PG_LEVEL_2M)
            .unwrap();
    }
    // One oracle per slot per logging session; vCPUs pick up the current ones.
    let new_oracles =
        || SLOTS.map(|(_, gpa, pages, _)| Arc::new(DirtyLogOracle::concurrent(gpa >> 12, pages)));
    let oracles = Arc::new(RwLock::new(new_oracles()));
    let stop = Arc::new(AtomicBool::new(false));
    let writes = Arc::new(AtomicU64::new(0));
    let vcpus: Vec<_> = (0..nr_vcpus)
        .map(|i| {
            let (vm, oracles, stop, writes) = (
                Arc::clone(&vm),
                Arc::clone(&oracles),
                Arc::clone(&stop),
                Arc::clone(&writes),
            );
            std::thread::spawn(move || {
                let mut rng = GuestRandom::new(seed + i as u32 + 1);
                let mut v = vm.vcpu(i);
                let (kvm, mmu) = (&*vm.kvm, &*vm.mmu);
                v.run_begin(kvm);
                v.enter_guest(kvm);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let which = (rng.next_u32() % 2) as usize;
                    let (_, gpa, pages, _) = SLOTS[which];
                    // Concentrate on a few huge pages so splits, faults and recovery collide.
                    let page = rng.next_u32() as u64 % pages.min(3 * 512);
                    let gfn = Gfn((gpa >> 12) + page);
                    let write = rng.next_u32() % 100 < 70;
                    let oracle = Arc::clone(&oracles.read()[which]);
                    let s = oracle.before_write();
                    guest_access(kvm, mmu, &mut v, gfn, 0, write, n).unwrap();
                    if write {
                        oracle.after_write(gfn.0, s);
                        n += 1;
                    }
                    // Leave guest mode now and then, as a real vCPU does on interrupts.
                    if n.is_multiple_of(256) {
                        v.exit_guest(kvm);
                        std::thread::yield_now();
                        v.enter_guest(kvm);
                    }
                }
                v.exit_guest(kvm);
                v.run_end(kvm);
                writes.fetch_add(n, Ordering::Relaxed);
                (v.meter.split_in_fault, v.meter.huge_recovered)
            })
        })
        .collect();

    let mut checked = 0;
    let mut late = 0;
    for _session in 0..3 {
        for (id, gpa, pages, backing) in SLOTS {
            vm.set_user_memory_region(id, gpa, pages * 4096, backing, KVM_MEM_LOG_DIRTY_PAGES)
                .unwrap();
        }
        let session = oracles.read().clone();
        session.iter().for_each(|o| o.logging_enabled());
        for _harvest in 0..6 {
            std::thread::sleep(std::time::Duration::from_millis(3));
            for (i, (id, gpa, pages, _)) in SLOTS.into_iter().enumerate() {
                let k = session[i].begin_harvest();
                let bitmap = vm.get_dirty_log(id).unwrap();
                if manual_init_set {
                    vm.clear_dirty_log(id, 0, pages, &bitmap).unwrap();
                }
                session[i].record_report(k, gpa >> 12, &bitmap);
                let c = session[i].end_harvest(k);
                assert!(
                    c.lost.is_empty(),
                    "slot {id}: lost gfns {:x?}",
                    &c.lost[..c.lost.len().min(8)]
                );
                checked += c.checked;
                late += c.late;
            }
            // With PML, GET and CLEAR kick the vCPUs without waiting, and a vCPU empties its
            // log into the bitmap at its next exit. The IPI arrives within microseconds on real
            // hardware, long before the next harvest; a vCPU thread here may be descheduled for
            // longer, so the harness waits until every vCPU has gone through an exit (and
            // re-entered guest mode, which follows the exit's handling) since the harvest:
            // what bounds PML's lateness to one harvest (the rule tests/model_pml.rs checks).
            if pml {
                let seqs: Vec<u64> = vm.kvm.vcpus.iter().map(|v| v.srcu_seq()).collect();
                vm.kvm
                    .kick_all_vcpus(&mut vmmu::kvm::meter::Meter::default());
                // srcu_seq is odd inside KVM code: the next entry makes it even again.
                let entered =
                    |v: &vmmu::kvm::vcpu::VcpuShared, s: u64| v.srcu_seq() >= s + 2 - s % 2;
                while vm.kvm.vcpus.iter().zip(&seqs).any(|(v, &s)| !entered(v, s)) {
                    std::thread::yield_now();
                }
            }
            vm.kvm.synchronize_srcu();
        }
        for (id, gpa, pages, backing) in SLOTS {
            vm.set_user_memory_region(id, gpa, pages * 4096, backing, 0)
                .unwrap();
        }
        *oracles.write() = new_oracles();
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
    stop.store(true, Ordering::SeqCst);
    let (split_in_fault, recovered_in_fault) = vcpus
        .into_iter()
        .map(|h| h.join().unwrap())
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
    assert!(
        writes.load(Ordering::Relaxed) > 1000,
        "the vCPUs hardly ran"
    );
    assert!(checked > 0, "the oracle checked nothing");
    assert_invariants(&vm);
    let m = vm.vmm_meter();
    // Eager splitting splits only with the capability. On x86 it also always finds huge
    // pages: it runs before write protection, so no vCPU fault splits them first. arm64
    // write-protects first (kvm_mmu_wp_memory_region(), then kvm_mmu_split_memory_region()),
    // so vCPUs writing meanwhile may split every block in faults before the job takes the
    // lock: there, some splitting must have happened, by either.
    match mmu {
        MmuKind::Stage2 { .. } if eager_split => {
            assert!(m.split_eager + split_in_fault > 0, "{m:?}")
        }
        _ => assert_eq!(m.split_eager > 0, eager_split, "{m:?}"),
    }
    // Whoever split huge pages (the VMM eagerly, or vCPU faults), disabling logging must have
    // put huge mappings back.
    if m.split_eager + split_in_fault > 0 {
        // The TDP MMU recovers huge pages in place; the shadow MMU zaps the small leaves
        // (kvm_rmap_zap_collapsible_sptes()) and lets faults map huge again; arm64 leaves it
        // to faults, which collapse tables into blocks.
        let recovered = match mmu {
            // The TDP MMU recovers the tables it finds in place (the VMM's job), but a vCPU
            // fault that reaches a table at its (huge) goal level replaces it with a huge leaf
            // too (tdp_mmu_map_handle_target_level()), and when the VMM thread is slow to get
            // there the vCPUs may have collapsed them all first. What must hold is the state:
            // no page the vCPUs touch is still mapped at 4K.
            MmuKind::Tdp => {
                let guard = crossbeam_epoch::pin();
                let small = SLOTS
                    .iter()
                    .flat_map(|&(_, gpa, pages, _)| {
                        (0..pages.min(3 * 512)).map(move |p| Gfn((gpa >> 12) + p))
                    })
                    .filter(|&gfn| {
                        let mut levels = 0;
                        matches!(
                            vm.mmu.hw_walk(gfn, false, false, &guard, &mut levels),
                            vmmu::hw::walker::WalkResult::Translated {
                                size: vmmu::units::PageSize::Size4K,
                                ..
                            }
                        )
                    })
                    .count();
                assert_eq!(
                    small, 0,
                    "{small} touched pages still mapped at 4K after logging was disabled: {m:?}"
                );
                1
            }
            MmuKind::Shadow { .. } => m.rmap_removes,
            MmuKind::Stage2 { .. } => recovered_in_fault,
        };
        assert!(
            recovered > 0,
            "split {} + {split_in_fault} huge pages, recovered none: {m:?}",
            m.split_eager
        );
    }
    // Without PML, lateness comes only from the fast-path window; it must stay rare. With PML
    // every page still in a vCPU's log when GET takes the bitmap is reported late, by design.
    assert!(
        pml || late * 20 <= checked,
        "{late} late reports of {checked} checked"
    );
    if pml {
        let pml_logged: u64 = (0..nr_vcpus).map(|i| vm.vcpu(i).meter.pml_logged).sum();
        assert!(pml_logged > 0, "PML logged nothing");
    }
}

#[test]
fn faults_vs_eager_split_vs_wrprot_vs_clear_with_initially_set() {
    stress(true, true, 1);
}

#[test]
fn faults_vs_eager_split_vs_wrprot_vs_get() {
    stress(false, true, 2);
}

/// Linux 6.11's TDP MMU drops `mmu_lock` to allocate each table of an eager split; a host
/// kernel without `CONFIG_PREEMPTION` never yields it to the faulting vCPUs.
#[test]
fn tdp_mmu_with_6_11_split_allocation_and_without_preemption() {
    use vmmu::kvm::mmu_lock::Preemption;
    use vmmu::x86::tdp_mmu::SplitAlloc;
    let drop_lock = HostKernel {
        tdp_split_alloc: SplitAlloc::DropLock,
        ..HostKernel::default()
    };
    stress_kernel(MmuKind::Tdp, false, drop_lock, true, true, 31);
    stress_kernel(MmuKind::Tdp, false, drop_lock, false, true, 32);
    let no_preempt = HostKernel {
        preemption: Preemption::None,
        ..HostKernel::default()
    };
    stress_kernel(MmuKind::Tdp, true, no_preempt, false, true, 33);
    stress_kernel(
        MmuKind::Shadow { ept: true },
        false,
        no_preempt,
        true,
        true,
        34,
    );
}

#[test]
fn faults_split_huge_pages_themselves_without_eager_split() {
    stress(true, false, 3);
    stress(false, false, 4);
}

#[test]
fn shadow_mmu_faults_vs_eager_split_vs_clear_with_initially_set() {
    stress_mmu(MmuKind::Shadow { ept: true }, true, true, 5);
}

#[test]
fn shadow_mmu_faults_vs_eager_split_vs_get() {
    stress_mmu(MmuKind::Shadow { ept: true }, false, true, 6);
}

#[test]
fn shadow_mmu_faults_split_huge_pages_themselves_without_eager_split() {
    stress_mmu(MmuKind::Shadow { ept: true }, true, false, 7);
    stress_mmu(MmuKind::Shadow { ept: true }, false, false, 8);
}

#[test]
fn pml_tdp_mmu_logs_vs_eager_split_vs_clear_dirty_vs_get_and_clear() {
    stress_vm(MmuKind::Tdp, true, true, true, 21);
    stress_vm(MmuKind::Tdp, true, false, true, 22);
    stress_vm(MmuKind::Tdp, true, false, false, 23);
}

#[test]
fn pml_shadow_mmu_logs_vs_eager_split_vs_clear_dirty_vs_get_and_clear() {
    stress_vm(MmuKind::Shadow { ept: true }, true, true, true, 24);
    stress_vm(MmuKind::Shadow { ept: true }, true, false, true, 25);
    stress_vm(MmuKind::Shadow { ept: true }, true, false, false, 26);
}

#[test]
fn shadow_paging_faults_vs_eager_split_vs_clear_and_get() {
    stress_mmu(MmuKind::Shadow { ept: false }, true, true, 9);
    stress_mmu(MmuKind::Shadow { ept: false }, false, false, 10);
}

fn stage2(lock: vmmu::arm64::Arm64Lock, eager_split: bool) -> MmuKind {
    MmuKind::Stage2 {
        lock,
        ia_bits: 40,
        split_chunk_pages: if eager_split { 512 } else { 0 },
        cpu: Default::default(),
        relax_flush: Default::default(),
    }
}

#[test]
fn arm64_parallel_faults_vs_eager_split_vs_wrprot_vs_clear_and_get() {
    use vmmu::arm64::Arm64Lock::Parallel;
    stress_mmu(stage2(Parallel, true), true, true, 11);
    stress_mmu(stage2(Parallel, true), false, true, 12);
    stress_mmu(stage2(Parallel, false), true, false, 13);
}

#[test]
fn arm64_perm_fast_path_and_spin_faults_vs_wrprot_vs_clear_and_get() {
    use vmmu::arm64::Arm64Lock::{PermFastPath, Spin};
    stress_mmu(stage2(PermFastPath, false), true, false, 14);
    stress_mmu(stage2(PermFastPath, true), false, true, 15);
    stress_mmu(stage2(Spin, false), false, false, 16);
}

#[test]
fn arm64_parallel_with_the_local_relax_flush_of_linux_6_5() {
    let local = match stage2(vmmu::arm64::Arm64Lock::Parallel, false) {
        MmuKind::Stage2 {
            lock,
            ia_bits,
            split_chunk_pages,
            cpu,
            ..
        } => MmuKind::Stage2 {
            lock,
            ia_bits,
            split_chunk_pages,
            cpu,
            relax_flush: vmmu::arm64::RelaxFlush::Local,
        },
        m => m,
    };
    stress_mmu(local, true, false, 17);
    stress_mmu(local, false, false, 18);
}
