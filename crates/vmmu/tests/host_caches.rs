//! The host's caches in a scenario: the shadow MMU's memslot rmaps go through them when the
//! VMM write-protects a slot, and the guest's lines compete for them.

mod common;

use common::{counter, run_virtual_with as run};
use vmmu::cost::CostModel;
use vmmu::host::backing::Backing;
use vmmu::lab::params::DirtyLogParams;
use vmmu::vm::MmuKind;

/// Seed 000's configuration at one vCPU: the shadow MMU, 1 GiB HugeTLB pages, no
/// initially-all-set (enabling logging write-protects the slot), no eager split.
fn seed000(vcpu_memory_bytes: u64) -> DirtyLogParams {
    DirtyLogParams {
        vcpus: 1,
        vcpu_memory_bytes,
        iterations: 1,
        backing: Backing::AnonymousHugetlb1gb,
        manual_protect: false,
        eager_split: false,
        mmu: MmuKind::Shadow { ept: true },
        ..Default::default()
    }
}

/// The default costs with what the cache model adds priced at nothing.
fn without_cache_costs() -> CostModel {
    let mut c = CostModel::default();
    for name in ["llc_hit_ns", "memory_line_ns", "memory_stream_line_ns"] {
        c.set_hardware_ns(name, 0.0, "test: no cache costs")
            .unwrap();
    }
    c
}

#[test]
fn rmaps_that_fit_the_caches_keep_enablings_cost_and_the_guests_lines_evict_a_line_a_page() {
    // 1 GiB: 2 MiB of 4K-level rmap heads, more than the VMM core's L2 and far less than the
    // socket's LLC, where they stay from their zeroing at memslot creation.
    let p = seed000(1 << 30);
    let with = run(&p, &CostModel::default());
    let without = run(&p, &without_cache_costs());
    let (a, b) = (with.enable.wall_ns as f64, without.enable.wall_ns as f64);
    assert!(
        a >= b && a <= b * 1.05,
        "enable {a} ns with the caches, {b} without"
    );
    // The guest writes the first word of each of its pages: those lines share the 64th of the
    // LLC's sets that the first line of each rmap page maps to, and evict it. So the scan
    // reads one line a page from memory: 512 pages of 4K heads, one of 2M heads and one of 1G
    // heads; each array's first line pays its full latency, the others are streamed.
    let pages = (2 << 20) / 4096 + 2;
    let streamed = counter(&with.enable, "memory_lines_streamed");
    let demand = counter(&with.enable, "memory_lines");
    assert_eq!((demand, streamed), (3, pages - 3));
    // Identical runs give identical counters (virtual time is deterministic).
    let again = run(&p, &CostModel::default());
    assert_eq!(again.enable.counters, with.enable.counters);
    assert_eq!(again.enable.wall_ns, with.enable.wall_ns);
}
