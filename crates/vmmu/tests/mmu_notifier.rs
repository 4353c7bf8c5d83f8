//! KVM's MMU notifier: invalidations keep faults from installing what the host takes away
//! (with the negative control of a KVM without the retry check), and aging tests and clears
//! Accessed flags, locked or lockless, one range or a bitmap of pages, on every MMU.

mod common;

use vmmu::host::backing::Backing;
use vmmu::hw::walker::WalkResult;
use vmmu::kvm::meter::Meter;
use vmmu::kvm::mmu::RetPf;
use vmmu::kvm::mmu_lock::LockMode;
use vmmu::kvm::mmu_notifier::*;
use vmmu::units::{Gfn, Pfn};
use vmmu::vm::exit::{after_slow_fault, complete_fault, exit_loop, AccessStep, GuestAccess};
use vmmu::vm::{MmuKind, Vm, VmConfig};

const GPA: u64 = 1 << 30;
const PAGES: u64 = 256;

fn stage2() -> MmuKind {
    common::stage2_parallel()
}

/// A VM with one 4K memslot of `PAGES` pages at 1 GiB, every page written once.
fn vm(mmu: MmuKind) -> Vm {
    let vm = Vm::new(VmConfig {
        mmu,
        ..Default::default()
    });
    vm.set_user_memory_region(1, GPA, PAGES << 12, Backing::Anonymous, 0)
        .unwrap();
    for p in 0..PAGES {
        vm.vcpu_write(0, GPA + (p << 12), p).unwrap();
    }
    vm
}

/// The host frames of the memslot's pages `[first, first + n)`.
fn pfns(vm: &Vm, first: u64, n: u64) -> (Pfn, Pfn) {
    let slot = vm.kvm.slot_by_id(1).unwrap();
    let p = slot.gfn_to_pfn(Gfn((GPA >> 12) + first)).0;
    (Pfn(p), Pfn(p + n))
}

fn mapped(vm: &Vm, page: u64) -> bool {
    let guard = crossbeam_epoch::pin();
    let mut levels = 0;
    matches!(
        vm.mmu
            .hw_walk(Gfn((GPA >> 12) + page), false, false, &guard, &mut levels),
        WalkResult::Translated { .. }
    )
}

fn all_mmus() -> [MmuKind; 3] {
    [MmuKind::Tdp, MmuKind::Shadow { ept: true }, stage2()]
}

#[test]
fn invalidation_zaps_the_range_and_a_fault_that_raced_it_retries() {
    for mmu in all_mmus() {
        for broken in [false, true] {
            let vm = vm(mmu);
            let kvm = &*vm.kvm;
            kvm.mmu_invalidate
                .ignore_for_negative_control
                .store(broken, std::sync::atomic::Ordering::Relaxed);
            let (s, e) = pfns(&vm, 0, 16);
            // Page 3 is unmapped, then a vCPU faults on it: its front half looks the page up...
            {
                let held = kvm.mmu_lock.lock(LockMode::Write);
                let mut m = Meter::default();
                invalidate_range_start(kvm, &*vm.mmu, s, s + 4, held.write(), &mut m);
                invalidate_range_end(kvm, held.write(), &mut m);
            }
            assert!(!mapped(&vm, 3), "{mmu:?}");
            let mut v = vm.vcpu(0);
            v.run_begin(kvm);
            v.enter_guest(kvm);
            let a = GuestAccess::first_word(Gfn((GPA >> 12) + 3), true, 7);
            let r = v.try_op(kvm, &*vm.mmu, &a);
            let Ok(AccessStep::NeedLock(mode)) = exit_loop(kvm, &*vm.mmu, &mut v, &a, r) else {
                panic!("{mmu:?}: the fault should need mmu_lock");
            };
            // ...then the host invalidates the range before the fault takes the lock.
            let held = kvm.mmu_lock.lock(LockMode::Write);
            let mut m = Meter::default();
            assert!(invalidate_range_start(
                kvm,
                &*vm.mmu,
                s,
                e,
                held.write(),
                &mut m
            ));
            drop(held);
            assert!(
                (0..16).all(|p| !mapped(&vm, p)),
                "{mmu:?}: range_start left a mapping"
            );
            let ret = complete_fault(kvm, &*vm.mmu, &mut v, mode);
            if broken {
                // The KVM without the check maps the page in the middle of the invalidation.
                assert!(
                    mapped(&vm, 3),
                    "{mmu:?}: the negative control went unnoticed"
                );
            } else {
                assert_eq!(ret, RetPf::Retry, "{mmu:?}");
                assert!(
                    !mapped(&vm, 3),
                    "{mmu:?}: a fault mapped a page being invalidated"
                );
            }
            let held = kvm.mmu_lock.lock(LockMode::Write);
            invalidate_range_end(kvm, held.write(), &mut m);
            drop(held);
            // The exit completes (the vCPU re-enters guest mode), then it leaves KVM_RUN.
            after_slow_fault(kvm, &mut v, &a, ret).unwrap();
            v.exit_guest(kvm);
            v.run_end(kvm);
            drop(v);
            // After the invalidation the page faults in again.
            vm.vcpu_write(0, GPA + (3 << 12), 9).unwrap();
            assert!(mapped(&vm, 3));
            assert_eq!(kvm.mmu_invalidate.in_progress(), 0);
            assert!(
                vm.check_invariants().is_empty(),
                "{:?}",
                vm.check_invariants()
            );
        }
    }
}

/// Runs `f` with the lock the aging mode needs.
fn aging<R>(
    vm: &Vm,
    a: Aging,
    f: impl FnOnce(Option<vmmu::kvm::mmu_lock::Held<'_, vmmu::kvm::mmu_lock::Write>>) -> R,
) -> R {
    match aging_lock_mode(&*vm.mmu, a) {
        Some(mode) => f(Some(vm.kvm.mmu_lock.lock(mode).write())),
        None => f(None),
    }
}

#[test]
fn aging_clears_accessed_flags_and_only_a_flush_makes_the_next_access_count() {
    for mmu in all_mmus() {
        for a in [Aging::Locked, Aging::Lockless] {
            let vm = vm(mmu);
            let kvm = &*vm.kvm;
            let (s, e) = pfns(&vm, 0, PAGES);
            let mut m = Meter::default();
            let test = |m: &mut Meter| {
                aging(&vm, a, |h| {
                    age_range(kvm, &*vm.mmu, s, e, AgeOp::Test, h, m)
                })
            };
            assert!(test(&mut m), "{mmu:?} {a:?}: written pages are young");
            assert!(aging(&vm, a, |h| age_range(
                kvm,
                &*vm.mmu,
                s,
                e,
                AgeOp::Clear,
                h,
                &mut m
            )));
            assert!(m.sptes_aged > 0);
            assert!(!test(&mut m), "{mmu:?} {a:?}: cleared pages are old");
            // clear_young does not flush: an access through the TLB sets no flag.
            vm.vcpu_read(0, GPA).unwrap();
            assert!(
                !test(&mut m),
                "{mmu:?} {a:?}: a TLB hit set the Accessed flag"
            );
            // A flush makes the next access walk, which sets it.
            kvm.flush_remote_tlbs(&mut m);
            vm.vcpu_read(0, GPA).unwrap();
            assert!(test(&mut m), "{mmu:?} {a:?}");
            let locked = aging_lock_mode(&*vm.mmu, a).is_some();
            assert_eq!(
                locked,
                a == Aging::Locked || mmu != MmuKind::Tdp,
                "{mmu:?} {a:?}"
            );
            assert!(
                vm.check_invariants().is_empty(),
                "{:?}",
                vm.check_invariants()
            );
        }
    }
}

#[test]
fn clear_flush_young_flushes_only_when_locked_and_young() {
    let vm = vm(MmuKind::Tdp);
    let kvm = &*vm.kvm;
    let (s, e) = pfns(&vm, 0, PAGES);
    for (a, flushes) in [(Aging::Locked, 1), (Aging::Lockless, 0)] {
        kvm.flush_remote_tlbs(&mut Meter::default());
        for p in 0..PAGES {
            vm.vcpu_read(0, GPA + (p << 12)).unwrap();
        }
        let mut m = Meter::default();
        let young = aging(&vm, a, |h| {
            clear_flush_young(kvm, &*vm.mmu, s, e, a, h, &mut m)
        });
        assert!(young);
        assert_eq!(m.remote_flushes, flushes, "{a:?}");
        // Nothing young now: no flush either way.
        let mut m = Meter::default();
        assert!(!aging(&vm, a, |h| clear_flush_young(
            kvm, &*vm.mmu, s, e, a, h, &mut m
        )));
        assert_eq!(m.remote_flushes, 0);
    }
}

#[test]
fn test_clear_young_tests_into_a_bitmap_and_clears_only_what_it_selects() {
    for mmu in [MmuKind::Tdp, stage2()] {
        let vm = vm(mmu);
        let kvm = &*vm.kvm;
        let (s, _) = pfns(&vm, 0, PAGES);
        let mut m = Meter::default();
        // Age everything, then touch pages 5 and 70 again (through a flushed TLB).
        let held = kvm.mmu_lock.lock(LockMode::Write);
        let (_, e) = pfns(&vm, 0, PAGES);
        age_range(
            kvm,
            &*vm.mmu,
            s,
            e,
            AgeOp::Clear,
            Some(held.write()),
            &mut m,
        );
        drop(held);
        kvm.flush_remote_tlbs(&mut m);
        vm.vcpu_read(0, GPA + (5 << 12)).unwrap();
        vm.vcpu_read(0, GPA + (70 << 12)).unwrap();
        let lockless = Aging::Lockless;
        // The seed counts bits from the end of the range.
        let bits = |pages: &[u64]| {
            let mut b = [0u64; 4];
            for &p in pages {
                let (w, bit) = young_bit(PAGES, p);
                b[w] |= bit;
            }
            b
        };
        assert_eq!(young_bit(PAGES, PAGES - 1), (0, 1));
        let mut bitmap = [0u64; 4];
        let r = test_clear_young(
            kvm,
            &*vm.mmu,
            s,
            PAGES,
            YoungBitmap::Fill(&mut bitmap),
            lockless,
            &mut m,
        )
        .unwrap();
        assert_eq!(
            r,
            TestClearYoung {
                lockless: true,
                young: true
            },
            "{mmu:?}"
        );
        assert_eq!(bitmap, bits(&[5, 70]), "{mmu:?}");
        // Clear only page 70: page 5 stays young.
        let select = bits(&[70]);
        test_clear_young(
            kvm,
            &*vm.mmu,
            s,
            PAGES,
            YoungBitmap::Clear(&select),
            lockless,
            &mut m,
        )
        .unwrap();
        let mut again = [0u64; 4];
        test_clear_young(
            kvm,
            &*vm.mmu,
            s,
            PAGES,
            YoungBitmap::Fill(&mut again),
            lockless,
            &mut m,
        )
        .unwrap();
        assert_eq!(again, bits(&[5]), "{mmu:?}");
        // Locked aging offers no batched call.
        let locked = test_clear_young(
            kvm,
            &*vm.mmu,
            s,
            PAGES,
            YoungBitmap::Fill(&mut again),
            Aging::Locked,
            &mut m,
        );
        assert_eq!(locked, None);
        assert!(vm.check_invariants().is_empty());
    }
    // The shadow MMU has no lockless path: the caller falls back.
    let vm = vm(MmuKind::Shadow { ept: true });
    let (s, _) = pfns(&vm, 0, PAGES);
    let mut bitmap = [0u64; 4];
    assert_eq!(
        test_clear_young(
            &vm.kvm,
            &*vm.mmu,
            s,
            PAGES,
            YoungBitmap::Fill(&mut bitmap),
            Aging::Lockless,
            &mut Meter::default()
        ),
        None
    );
}

/// Lockless aging on the TDP MMU while vCPU threads fault, write and the host invalidates:
/// no lost write, invariants hold, and no translation survives an open invalidation.
#[test]
fn lockless_aging_races_faults_and_invalidations() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let vm = Arc::new(Vm::new(VmConfig {
        vcpus: 2,
        ..Default::default()
    }));
    vm.set_user_memory_region(1, GPA, PAGES << 12, Backing::Anonymous, 0)
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2)
        .map(|id| {
            let (vm, stop) = (Arc::clone(&vm), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // Each vCPU owns every other page, so what it reads back is what it wrote.
                    let p = (n * 7) % (PAGES / 2) * 2 + id;
                    let v = (n << 8) | id;
                    vm.vcpu_write(id as usize, GPA + (p << 12), v).unwrap();
                    assert_eq!(vm.vcpu_read(id as usize, GPA + (p << 12)).unwrap(), v);
                    n += 1;
                }
                n
            })
        })
        .collect();
    let kvm = &*vm.kvm;
    let (s, e) = pfns(&vm, 0, PAGES);
    let mut m = Meter::default();
    let t0 = std::time::Instant::now();
    let mut round = 0u64;
    while round < 300 || t0.elapsed() < std::time::Duration::from_millis(300) {
        round += 1;
        assert!(aging_lock_mode(&*vm.mmu, Aging::Lockless).is_none());
        age_range(kvm, &*vm.mmu, s, e, AgeOp::Clear, None, &mut m);
        let mut bitmap = [0u64; 4];
        let clear = round % 2 == 1;
        test_clear_young(
            kvm,
            &*vm.mmu,
            s,
            PAGES,
            if clear {
                YoungBitmap::Clear(&bitmap)
            } else {
                YoungBitmap::Fill(&mut bitmap)
            },
            Aging::Lockless,
            &mut m,
        )
        .unwrap();
        if round.is_multiple_of(10) {
            let lo = s + round % PAGES;
            let hi = Pfn((lo.0 + 8).min(e.0));
            let held = kvm.mmu_lock.lock(LockMode::Write);
            invalidate_range_start(kvm, &*vm.mmu, lo, hi, held.write(), &mut m);
            drop(held);
            let first = lo.0 - s.0;
            for p in first..first + (hi.0 - lo.0) {
                assert!(
                    !mapped(&vm, p),
                    "page {p} mapped while its invalidation is open"
                );
            }
            let held = kvm.mmu_lock.lock(LockMode::Write);
            invalidate_range_end(kvm, held.write(), &mut m);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let writes: u64 = writers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(writes > 100, "the vCPUs hardly ran");
    assert!(m.sptes_aged > 0);
    assert!(
        vm.check_invariants().is_empty(),
        "{:?}",
        vm.check_invariants()
    );
}
