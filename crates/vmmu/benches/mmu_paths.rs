//! Throughput of the model's hot paths on this machine, reported as elements per second:
//! simulated guest accesses, page faults (slow path mapping 4K, fast path restoring W), huge
//! pages split by eager splitting, and a virtual-time dirty-log run's accesses with
//! fast-forward off and on.
//!
//! `cargo bench -p vmmu --bench mmu_paths`

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use vmmu::host::backing::Backing;
use vmmu::units::Gfn;
use vmmu::vm::{Vm, VmConfig, KVM_MEM_LOG_DIRTY_PAGES};

const GPA: u64 = 1 << 30;

fn vm_with(pages: u64, backing: Backing) -> Vm {
    let vm = Vm::new(VmConfig::default());
    vm.set_user_memory_region(1, GPA, pages * 4096, backing, 0)
        .unwrap();
    vm
}

/// Touches `pages` pages in order on vCPU 0 in one KVM_RUN.
fn pass(vm: &Vm, pages: u64, write: bool) {
    vm.vcpu_run(0, (0..pages).map(|p| (Gfn((GPA >> 12) + p), write)))
        .unwrap();
}

fn guest_accesses(c: &mut Criterion) {
    let mut g = c.benchmark_group("guest_accesses");
    for (name, backing) in [
        ("tlb_miss_4k", Backing::Anonymous),
        ("tlb_hit_1g", Backing::AnonymousHugetlb1gb),
    ] {
        let pages = 1 << 18;
        let vm = vm_with(pages, backing);
        pass(&vm, pages, true);
        g.throughput(Throughput::Elements(pages));
        g.bench_function(name, |b| b.iter(|| pass(&vm, pages, true)));
    }
    g.finish();
}

fn faults(c: &mut Criterion) {
    let pages = 1 << 14;
    let mut g = c.benchmark_group("faults");
    g.throughput(Throughput::Elements(pages));
    g.sample_size(20);
    g.bench_function("slow_path_map_4k", |b| {
        b.iter_batched(
            || vm_with(pages, Backing::Anonymous),
            |vm| pass(&vm, pages, true),
            BatchSize::PerIteration,
        )
    });
    g.bench_function("fast_path_restore_w", |b| {
        b.iter_batched(
            || {
                let vm = vm_with(pages, Backing::Anonymous);
                pass(&vm, pages, true);
                vm.set_user_memory_region(
                    1,
                    GPA,
                    pages * 4096,
                    Backing::Anonymous,
                    KVM_MEM_LOG_DIRTY_PAGES,
                )
                .unwrap();
                vm
            },
            |vm| pass(&vm, pages, true),
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn huge_page_split(c: &mut Criterion) {
    let pages = 1 << 18; // one 1G page: 1 + 512 splits down to 4K
    let mut g = c.benchmark_group("eager_split");
    g.throughput(Throughput::Elements(513));
    g.sample_size(20);
    g.bench_function("split_1g_to_4k", |b| {
        b.iter_batched(
            || {
                let vm = vm_with(pages, Backing::AnonymousHugetlb1gb);
                pass(&vm, 1, true);
                vm
            },
            |vm| {
                let m = vm.eager_split_slot(1).unwrap();
                assert_eq!(m.split_eager, 513);
                vm
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

/// `dirty-log --engine virtual -v 16 -b 16M -s anonymous_hugetlb_2mb -i 2` with PML and eager
/// split (its second iteration takes no fault), stepping every actor in turn and
/// fast-forwarding: simulated accesses per second on each side, both in one run.
fn fast_forward(c: &mut Criterion) {
    use vmmu::cost::CostModel;
    use vmmu::engine::virtual_time::scheduler::set_fast_forward_default;
    use vmmu::lab::dirty_log_model::run_dirty_log_virtual;
    use vmmu::lab::params::DirtyLogParams;
    let p = DirtyLogParams {
        vcpus: 16,
        vcpu_memory_bytes: 16 << 20,
        backing: Backing::AnonymousHugetlb2mb,
        pml: true,
        ..Default::default()
    };
    let cost = CostModel::default();
    let accesses = p.guest_pages() * (p.iterations as u64 + 1);
    let mut g = c.benchmark_group("fast_forward");
    g.sample_size(10);
    g.throughput(Throughput::Elements(accesses));
    for (name, on) in [("dirty_log_v16_off", false), ("dirty_log_v16_on", true)] {
        g.bench_function(name, |b| {
            set_fast_forward_default(on);
            b.iter(|| run_dirty_log_virtual(&p, &cost, false).unwrap())
        });
    }
    set_fast_forward_default(true);
    g.finish();
}

criterion_group!(
    benches,
    guest_accesses,
    faults,
    huge_page_split,
    fast_forward
);
criterion_main!(benches);
