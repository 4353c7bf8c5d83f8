//! DRAM bandwidth shared by the vCPUs of a socket (virtual time): below saturation nothing
//! waits, and a host whose bandwidth cannot carry the vCPUs' lines makes them wait, bounded
//! below by the bytes over the bandwidth.

mod common;

use common::counter;
use vmmu::cost::CostModel;
use vmmu::host::backing::Backing;
use vmmu::lab::dirty_log_model::run_dirty_log_virtual;
use vmmu::lab::params::DirtyLogParams;

#[test]
fn vcpus_wait_for_dram_only_when_their_socket_saturates() {
    let p = DirtyLogParams {
        vcpus: 8,
        vcpu_memory_bytes: 8 << 20,
        iterations: 1,
        backing: Backing::AnonymousHugetlb2mb,
        manual_protect: false,
        pml: true,
        ..Default::default()
    };
    let run = |gbps: f64| {
        let mut cost = CostModel::default();
        cost.host.dram_gbps_per_socket = gbps;
        let r = run_dirty_log_virtual(&p, &cost, false).unwrap();
        let dirty = &r.iterations[0].dirty;
        (
            dirty.wall_ns,
            counter(dirty, "dram_lines"),
            counter(dirty, "dram_stall_ns"),
        )
    };
    let (fast, lines, stall) = run(CostModel::default().host.dram_gbps_per_socket);
    // Every page is new to its vCPU's TLB: a line read and a line written back.
    assert_eq!(lines, 2 * 8 * 2048);
    assert_eq!(stall, 0, "8 vCPUs are far from 140 GB/s");
    let gbps = 0.5;
    let (slow, lines, stall) = run(gbps);
    assert_eq!(lines, 2 * 8 * 2048);
    assert!(stall > 0);
    // All 8 vCPUs share socket 0: its lines cannot go faster than the bandwidth allows.
    let floor_ns = (lines * 64) as f64 / gbps;
    assert!(
        slow as f64 >= floor_ns - 100.0,
        "{slow} ns for {lines} lines at {gbps} GB/s"
    );
    assert!(slow > fast);
}
