//! The host's caches in a scenario: the shadow MMU's memslot rmaps go through them when the
//! VMM write-protects a slot, every MMU's tables when KVM walks them, and the guest's lines
//! compete for them; a table lives on the socket of the core that allocated it.

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
    for name in [
        "llc_hit_ns",
        "memory_line_ns",
        "memory_stream_line_ns",
        "remote_memory_line_ns",
        "remote_memory_stream_line_ns",
    ] {
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
    // heads; each array's first line pays its full latency, the others are streamed. Before
    // that the VMM allocated and zeroed the dirty bitmap and its buffer (2 x 32 KiB, fresh
    // from memory): one more stream, two lines paid in full.
    let pages = (2 << 20) / 4096 + 2;
    let bitmap_lines = 2 * (1 << 18) / 8 / 64;
    let streamed = counter(&with.enable, "memory_lines_streamed");
    let demand = counter(&with.enable, "memory_lines");
    assert_eq!((demand, streamed), (3 + 2, pages - 3 + bitmap_lines - 2));
    // Identical runs give identical counters (virtual time is deterministic).
    let again = run(&p, &CostModel::default());
    assert_eq!(again.enable.counters, with.enable.counters);
    assert_eq!(again.enable.wall_ns, with.enable.wall_ns);
}

/// `vcpus` vCPUs of `bytes` each on 4K anonymous memory with initially-all-set, so that each
/// iteration's clear walks the leaf tables, under `mmu`.
fn clear_walk(mmu: MmuKind, vcpus: usize, bytes: u64) -> DirtyLogParams {
    DirtyLogParams {
        vcpus,
        vcpu_memory_bytes: bytes,
        iterations: 1,
        mmu,
        ..Default::default()
    }
}

/// The first iteration's clear.
fn clear(r: &vmmu::lab::report::DirtyLogReport) -> &vmmu::lab::report::Phase {
    r.iterations[0]
        .clear
        .as_ref()
        .expect("manual protect clears")
}

#[test]
fn tdp_tables_that_fit_the_llc_keep_the_clears_cost_and_pay_two_lines_a_table() {
    // 1 GiB at 4K: 2 MiB of leaf tables, written by the vCPU's faults: out of the VMM core's
    // L2, in the socket's LLC.
    let p = clear_walk(MmuKind::Tdp, 1, 1 << 30);
    let with = run(&p, &CostModel::default());
    let without = run(&p, &without_cache_costs());
    let (a, b) = (clear(&with).wall_ns as f64, clear(&without).wall_ns as f64);
    assert!(
        a > b && a <= b * 1.05,
        "clear {a} ns with the caches, {b} without"
    );
    // Each of the 512 leaf tables starts a stream of the VMM's core: its first two lines pay,
    // the rest are in flight. The guest's writes to the first word of each of its pages evict
    // the first line of every table page (they share its LLC sets), so that one comes from
    // memory, the second from the LLC.
    let c = clear(&with);
    let demand = counter(c, "llc_hits") + counter(c, "memory_lines");
    assert!((1024..=1040).contains(&demand), "{demand} lines paid");
    // The dirty bitmap and its buffer (2 x 32 KiB), which the VMM's core zeroed when logging
    // was enabled, are still in its L2 but for the few lines the walk's tables evicted.
    assert!(counter(c, "memory_lines_streamed") < 64);
    assert_eq!(counter(c, "remote_memory_lines"), 0, "one socket");
}

#[test]
fn tables_a_vcpu_of_the_other_socket_allocated_are_remote_for_the_vmm() {
    // 16 vCPUs: the scheduler spreads them 8 and 8 over the two sockets; the VMM runs on the
    // first. The second socket's vCPUs allocate their own leaf tables, so the VMM's clear
    // reads those from the other socket's memory.
    let p = clear_walk(MmuKind::Tdp, 16, 32 << 20);
    let r = run(&p, &CostModel::default());
    let c = clear(&r);
    let remote = counter(c, "remote_memory_lines") + counter(c, "remote_memory_lines_streamed");
    // 8 vCPUs x 32 MiB = 128 leaf tables of the second socket, 64 lines each, and the
    // lines of the upper tables its vCPUs allocated first.
    assert!(
        (128 * 64..128 * 64 + 64).contains(&remote),
        "{remote}: every line of every remote table"
    );
    assert_eq!(counter(c, "remote_lines_node0"), remote);
    assert_eq!(
        counter(c, "remote_lines_node1"),
        0,
        "nothing runs KVM there"
    );
    assert!(counter(c, "dram_lines_node1") >= remote);
}

#[test]
fn arm64_stage2_tables_go_through_the_caches_too() {
    let p = DirtyLogParams {
        guest_mode: Some(vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE),
        ..clear_walk(common::stage2_parallel(), 1, 1 << 30)
    };
    let r = run(&p, &CostModel::default_arm64());
    let c = clear(&r);
    assert!(
        counter(c, "llc_hits") + counter(c, "memory_lines") >= 1024,
        "two lines a leaf table: {:?}",
        c.counters
    );
    assert_eq!(
        counter(c, "remote_memory_lines"),
        0,
        "the Altra has one socket"
    );
}

#[test]
fn guest_pages_live_where_they_were_first_faulted_and_other_sockets_pay_to_reach_them() {
    // 16 vCPUs, 8 on each socket. Partitioned, each vCPU first-touches and then only ever
    // writes its own slice: every line is local.
    let part = DirtyLogParams {
        vcpus: 16,
        vcpu_memory_bytes: 1 << 20,
        iterations: 1,
        ..Default::default()
    };
    let r = run(&part, &CostModel::default());
    assert_eq!(counter(&r.populate, "guest_remote_lines"), 0);
    assert_eq!(counter(&r.iterations[0].dirty, "guest_remote_lines"), 0);
    // Overlapped (`-o`), every vCPU writes all 4096 pages: each page lives on the socket of
    // the vCPU that faulted it first, so each vCPU finds about half of them on the other
    // socket, and all sixteen together exactly one socket's worth of each page's two lines
    // (the line read and the line written back), whichever socket it is.
    let overlap = DirtyLogParams {
        partition: false,
        ..part
    };
    let r = run(&overlap, &CostModel::default());
    let pages = 16 * (1 << 20) / 4096;
    let remote = counter(&r.iterations[0].dirty, "guest_remote_lines");
    assert_eq!(
        remote,
        8 * pages * 2,
        "one socket's vCPUs, every page, two lines"
    );
    // Priced: the same run with remote guest lines free is faster.
    let mut free = CostModel::default();
    free.set_hardware_ns("guest_remote_line_ns", 0.0, "test: free")
        .unwrap();
    let cheap = run(&overlap, &free);
    assert!(cheap.iterations[0].dirty.wall_ns < r.iterations[0].dirty.wall_ns);
}
