//! Broadcast TLB invalidation (`TLBI ...IS` + `DSB ISH`, [`Kvm::tlbi_broadcast`]) against the
//! per-vCPU TLB model:
//!
//! - with the TDP MMU, a stale writable TLB entry keeps allowing writes after its leaf is
//!   zapped, until a broadcast from another thread completes; after that, the next write faults
//!   (threads engine, and the virtual-time engine's waiter on one thread);
//! - a stress test with vCPU threads accessing while another thread posts invalidations of
//!   every form and waits for each to complete, with page-table generations in the translations
//!   to detect any use of a translation an earlier completed invalidation covered.

mod common;

use common::{set_slot, GPA, PAGE};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use vmmu::engine::virtual_time::VirtualWaiter;
use vmmu::host::backing::Backing;
use vmmu::hw::tlb::TlbInvalidation;
use vmmu::kvm::meter::Meter;
use vmmu::kvm::mmu_lock::LockMode;
use vmmu::kvm::Kvm;
use vmmu::lab::memstress::GuestRandom;
use vmmu::units::{Gfn, PageSize, Pfn};
use vmmu::vm::exit::guest_access;
use vmmu::vm::vcpu::{AccessExit, Vcpu};
use vmmu::vm::{Vm, VmConfig};

/// Zaps the leaf of `gfn` and owes the flush (x86 would now flush by request; arm64 by a
/// broadcast TLBI).
fn zap_without_flush(vm: &Vm, gfn: Gfn) {
    let held = vm.kvm.mmu_lock.lock(LockMode::Write);
    let mut m = Meter::default();
    assert!(
        vm.mmu
            .zap_gfn_range(&vm.kvm, gfn, gfn + 1, held.write(), &mut m)
            .is_some(),
        "a zapped leaf owes a flush"
    );
}

/// vCPU 0 has written pages `a` and `b` and is in guest mode; `a` is zapped without a flush.
fn stale_writable_entry(vm: &Vm, v: &mut Vcpu, a: Gfn, b: Gfn) {
    set_slot(vm, 16 * PAGE, Backing::Anonymous, 0);
    let (kvm, mmu) = (&*vm.kvm, &*vm.mmu);
    v.run_begin(kvm);
    v.enter_guest(kvm);
    guest_access(kvm, mmu, v, a, 0, true, 1).unwrap();
    guest_access(kvm, mmu, v, b, 0, true, 1).unwrap();
    zap_without_flush(vm, a);
    assert_eq!(
        v.access(kvm, mmu, a, 0, true, 2),
        Ok(2),
        "the stale writable entry still allows the write"
    );
}

#[test]
fn a_broadcast_from_another_thread_is_applied_before_the_next_access() {
    let vm = Vm::new(VmConfig::default());
    let (a, b) = (Gfn(GPA >> 12), Gfn((GPA >> 12) + 1));
    let mut v = vm.vcpu(0);
    stale_writable_entry(&vm, &mut v, a, b);
    let (kvm, mmu) = (&*vm.kvm, &*vm.mmu);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let inv = TlbInvalidation::Gfn {
                gfn: a,
                size: Some(PageSize::Size4K),
            };
            kvm.tlbi_broadcast(inv, &mut Meter::default());
            done.store(true, Ordering::SeqCst);
        });
        // The vCPU stays in guest mode and keeps running: the broadcast cannot complete until
        // its TLB has applied the invalidation.
        while !done.load(Ordering::SeqCst) {
            assert_eq!(v.access(kvm, mmu, b, 0, false, 0), Ok(1));
            std::thread::yield_now();
        }
    });
    assert_eq!(
        v.access(kvm, mmu, a, 0, true, 3),
        Err(AccessExit::Fault {
            gfn: a,
            write: true,
            present: false,
            level: vmmu::hw::ept::PG_LEVEL_4K,
            access_flag: false,
        }),
        "after the broadcast completed, the write walks and faults"
    );
    assert_eq!(v.access(kvm, mmu, b, 0, false, 0), Ok(1), "b is untouched");
    v.exit_guest(kvm);
    v.run_end(kvm);
}

#[test]
fn a_vcpu_outside_guest_mode_is_not_waited_for_and_applies_on_entry() {
    let vm = Vm::new(VmConfig::default());
    let (a, b) = (Gfn(GPA >> 12), Gfn((GPA >> 12) + 1));
    let mut v = vm.vcpu(0);
    stale_writable_entry(&vm, &mut v, a, b);
    let (kvm, mmu) = (&*vm.kvm, &*vm.mmu);
    v.exit_guest(kvm);
    // Returns although nobody runs vCPU 0.
    kvm.tlbi_broadcast(
        TlbInvalidation::Range { start: a, pages: 1 },
        &mut Meter::default(),
    );
    v.enter_guest(kvm);
    assert!(matches!(
        v.access(kvm, mmu, a, 0, true, 3),
        Err(AccessExit::Fault { present: false, .. })
    ));
    v.exit_guest(kvm);
    v.run_end(kvm);
}

/// In virtual time every actor runs on one thread: the `DSB ISH` returns at once, and the vCPU's
/// next access applies the invalidation before it translates.
#[test]
fn in_virtual_time_the_next_vcpu_step_applies_a_completed_broadcast() {
    let vm = Vm::with_waiter(VmConfig::default(), Box::new(VirtualWaiter));
    let (a, b) = (Gfn(GPA >> 12), Gfn((GPA >> 12) + 1));
    let mut v = vm.vcpu(0);
    stale_writable_entry(&vm, &mut v, a, b);
    let (kvm, mmu) = (&*vm.kvm, &*vm.mmu);
    kvm.tlbi_broadcast(TlbInvalidation::All, &mut Meter::default());
    assert!(matches!(
        v.access(kvm, mmu, a, 0, true, 3),
        Err(AccessExit::Fault { present: false, .. })
    ));
    v.exit_guest(kvm);
    v.run_end(kvm);
}

// The stress test's guest-physical layout: one 1G leaf, then 2M leaves, then 4K leaves.
const GFN_1G: u64 = 0;
const GFN_2M: u64 = 1 << 18;
const GFN_4K: u64 = GFN_2M + (1 << 17);
const GFN_END: u64 = 1 << 19;

/// The level of the leaf mapping `gfn` in the stress test's page tables.
fn leaf_size(gfn: u64) -> PageSize {
    match gfn {
        g if g < GFN_2M => PageSize::Size1G,
        g if g < GFN_4K => PageSize::Size2M,
        _ => PageSize::Size4K,
    }
}

/// A translation's frame carries the page-table generation it was loaded from above this
/// shift (a 1G leaf's frames stay below it).
const GEN_SHIFT: u32 = 20;

/// The gfns the vCPUs access: 16 in each region, some sharing a huge page.
fn hot_gfns() -> Vec<u64> {
    (0..16u64)
        .flat_map(|k| {
            [
                GFN_1G + k * 16_411,
                GFN_2M + k * 4_099,
                GFN_4K + (k / 2) * 1_000 + k % 2,
            ]
        })
        .collect()
}

/// What the stress test's threads share: the page-table generation (bumped by every change the
/// invalidator makes before it posts the invalidation), and per hot gfn the generation a
/// translation of it must at least carry, raised once an invalidation covering it completed.
struct World {
    hot: Vec<u64>,
    generation: AtomicU64,
    min_generation: Vec<AtomicU64>,
    stop: AtomicBool,
    violations: AtomicU64,
    accesses: AtomicU64,
    tlb_hits: AtomicU64,
}

/// One guest access of `world.hot[i]` by `v`, in guest mode: translate as `Vcpu::access` does
/// (sync with posted invalidations, look up, fill from the current page tables on a miss), then,
/// at the moment the translation is used, read the generation it must at least carry.
fn access(kvm: &Kvm, v: &mut Vcpu, world: &World, i: usize) {
    let gfn = world.hot[i];
    kvm.vcpus[v.id].tlb_shootdown().sync(&mut v.tlb);
    let pfn = match v.tlb.lookup(Gfn(gfn)) {
        Some(t) => {
            world.tlb_hits.fetch_add(1, Ordering::Relaxed);
            t.pfn.0
        }
        None => {
            let size = leaf_size(gfn);
            let base = size.round(Gfn(gfn));
            // Acquire: pairs with the invalidator's SeqCst bump before it posts.
            let gen = world.generation.load(Ordering::Acquire);
            v.tlb.insert(base, size, Pfn(gen << GEN_SHIFT), true, true);
            (gen << GEN_SHIFT) + (gfn - base.0)
        }
    };
    // The memory access itself takes a while: an invalidation may be posted meanwhile.
    for _ in 0..16 {
        std::hint::spin_loop();
    }
    // Read after the translation: an invalidation that completed before this use must have
    // been applied by a sync before it. (No false alarm: completion waits for this vCPU's next
    // sync, whose Release publication is ordered after this load.) Acquire: pairs with the
    // invalidator's Release fetch_max after its DSB ISH.
    let must = world.min_generation[i].load(Ordering::Acquire);
    if pfn >> GEN_SHIFT < must {
        world.violations.fetch_add(1, Ordering::Relaxed);
    }
    world.accesses.fetch_add(1, Ordering::Relaxed);
}

/// A random invalidation around the hot gfns: a gfn (with a correct level hint or none), a
/// range from a few pages to most of the space (crossing huge pages), or everything.
fn random_invalidation(rng: &mut GuestRandom, hot: &[u64]) -> TlbInvalidation {
    let near = hot[rng.next_u32() as usize % hot.len()];
    match rng.next_u32() % 16 {
        0 => TlbInvalidation::All,
        1 => TlbInvalidation::Stage1All,
        2..=7 => TlbInvalidation::Gfn {
            gfn: Gfn(near),
            size: rng.next_u32().is_multiple_of(2).then(|| leaf_size(near)),
        },
        _ => {
            let pages = 1 + rng.next_u32() as u64 % [4, 600, 1 << 18][rng.next_u32() as usize % 3];
            let start = near.saturating_sub(rng.next_u32() as u64 % pages);
            TlbInvalidation::Range {
                start: Gfn(start),
                pages,
            }
        }
    }
}

/// Whether `inv` covers `gfn` (the architecture's promise, not what the TLB happens to drop).
fn covers(inv: TlbInvalidation, gfn: u64) -> bool {
    match inv {
        // The stress test's translations are combined entries, which VMALLE1IS covers.
        TlbInvalidation::All | TlbInvalidation::Stage1All => true,
        TlbInvalidation::Gfn { gfn: g, .. } => g.0 == gfn,
        TlbInvalidation::Range { start, pages } => (start.0..start.0 + pages).contains(&gfn),
    }
}

#[test]
fn stress_no_vcpu_uses_a_translation_after_its_invalidation_completed() {
    let nr_vcpus = 3;
    // A VM only for its KVM state and its MMU's per-vCPU state; the vCPU threads below use
    // neither its page tables nor its vCPUs.
    let vm = Vm::new(VmConfig {
        vcpus: nr_vcpus,
        ..Default::default()
    });
    let kvm = Arc::clone(&vm.kvm);
    let hot = hot_gfns();
    assert!(hot.iter().all(|&g| g < GFN_END));
    let world = Arc::new(World {
        min_generation: hot.iter().map(|_| AtomicU64::new(0)).collect(),
        hot,
        generation: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        violations: AtomicU64::new(0),
        accesses: AtomicU64::new(0),
        tlb_hits: AtomicU64::new(0),
    });
    let vcpus: Vec<_> = (0..nr_vcpus)
        .map(|id| {
            let (kvm, world) = (Arc::clone(&kvm), Arc::clone(&world));
            let mmu = Arc::clone(&vm.mmu);
            std::thread::spawn(move || {
                let mut rng = GuestRandom::new(id as u32 + 1);
                let mut v = Vcpu::new(id, &*mmu);
                // Entries of every page size (the vCPU's own TLB holds only the guest's 4K
                // pages as combined entries), so invalidations of each size are exercised.
                v.tlb = vmmu::hw::tlb::Tlb::default();
                v.run_begin(&kvm);
                v.enter_guest(&kvm);
                let mut n = 0u64;
                while !world.stop.load(Ordering::Relaxed) {
                    access(
                        &kvm,
                        &mut v,
                        &world,
                        rng.next_u32() as usize % world.hot.len(),
                    );
                    n += 1;
                    // Leave guest mode now and then: a flusher stops waiting for this vCPU,
                    // which then applies on entry.
                    if n.is_multiple_of(97) {
                        v.exit_guest(&kvm);
                        std::thread::yield_now();
                        v.enter_guest(&kvm);
                    }
                }
                v.exit_guest(&kvm);
                v.run_end(&kvm);
                kvm.vcpus[id].tlb_shootdown().applied()
            })
        })
        .collect();

    let mut rng = GuestRandom::new(99);
    let mut meter = Meter::default();
    let start = std::time::Instant::now();
    let mut invalidations = 0;
    // Until both sides have done enough: on a machine with many busy cores the invalidator
    // could finish its 50,000 before the vCPU threads were scheduled much (a 16-core run
    // once ended with 4,074 accesses).
    let enough = |n: u64| n >= 50_000 && world.accesses.load(Ordering::Relaxed) >= 20_000;
    while !enough(invalidations) && start.elapsed() < std::time::Duration::from_secs(10) {
        let inv = random_invalidation(&mut rng, &world.hot);
        // The page-table change the invalidation is for, made before the TLBI.
        let gen = world.generation.fetch_add(1, Ordering::SeqCst) + 1;
        kvm.tlbi_broadcast(inv, &mut meter);
        for (i, &g) in world.hot.iter().enumerate() {
            if covers(inv, g) {
                // Release: pairs with the vCPU's Acquire load in access().
                world.min_generation[i].fetch_max(gen, Ordering::Release);
            }
        }
        invalidations += 1;
        if invalidations % 8 == 0 {
            std::thread::yield_now();
        }
    }
    world.stop.store(true, Ordering::SeqCst);
    let applied: Vec<u64> = vcpus.into_iter().map(|h| h.join().unwrap()).collect();
    let accesses = world.accesses.load(Ordering::Relaxed);
    let hits = world.tlb_hits.load(Ordering::Relaxed);
    assert_eq!(
        world.violations.load(Ordering::Relaxed),
        0,
        "a vCPU used a translation an invalidation had completed on ({accesses} accesses)"
    );
    assert!(invalidations >= 100, "only {invalidations} invalidations");
    assert!(
        // A sanity bound, not a rate: on a loaded 2-core machine the invalidator can keep the
        // hit rate under a fifth (whole-TLB flushes are an eighth of its invalidations).
        accesses > 10_000 && hits > 1_000 && hits > accesses / 20,
        "the vCPUs hardly ran or hardly hit: {accesses} accesses, {hits} hits"
    );
    assert!(
        applied.iter().all(|&a| a > 0),
        "every vCPU applied invalidations: {applied:?}"
    );
}
