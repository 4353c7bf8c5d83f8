//! Waits on vCPUs that run on OS threads: a remote TLB flush waits for every kicked vCPU to
//! leave guest mode, and `synchronize_srcu()` for every reader inside its read section when the
//! grace period began. The waiter spins on the shared vCPU state, as the kernel's
//! `kvm_make_all_cpus_request()` waits for IPI acks.

use crate::kvm::vcpu::{VcpuShared, VcpuWaiter};
use std::time::{Duration, Instant};

/// How long a wait on vCPUs may last before it is reported as a stall (like the kernel's RCU
/// stall detector): a vCPU thread that died inside an SRCU read section, or never acknowledges
/// a kick, would otherwise hang the run.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(20);

/// The [`VcpuWaiter`] of vCPUs on OS threads (the [`crate::vm::Vm`] API, the threads engine):
/// spins, then yields the CPU, on the shared vCPU state, and panics with a diagnosis after
/// [`STALL_TIMEOUT`].
pub struct SpinWaiter;

fn wait_until(what: impl Fn() -> String, done: impl Fn() -> bool) {
    let start = Instant::now();
    let mut spins = 0u32;
    while !done() {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        std::thread::yield_now();
        if spins.is_multiple_of(1024) && start.elapsed() > STALL_TIMEOUT {
            panic!("stall: {} for more than {:?}", what(), STALL_TIMEOUT);
        }
    }
}

impl VcpuWaiter for SpinWaiter {
    fn wait_for_exits(&self, vcpus: &[VcpuShared], kicked: &[usize]) {
        for &i in kicked {
            wait_until(
                || format!("vCPU {i} has not acknowledged a kick"),
                || !vcpus[i].exiting(),
            );
        }
    }

    fn wait_for_tlbi(&self, vcpus: &[VcpuShared], seqs: &[u64]) {
        for (i, &seq) in seqs.iter().enumerate().filter(|(_, &s)| s != 0) {
            wait_until(
                || format!("DSB ISH: vCPU {i} has not applied broadcast TLBI {seq}"),
                || vcpus[i].tlbi_complete(seq),
            );
        }
    }

    fn synchronize_srcu(&self, vcpus: &[VcpuShared]) {
        // Pairs with the fence in srcu_read_lock(): the update (memslot flags, the new memslot
        // set) is visible before the readers' counts are sampled.
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let snap: Vec<u64> = vcpus.iter().map(|v| v.srcu_seq()).collect();
        for (i, (v, s)) in vcpus.iter().zip(snap).enumerate() {
            if s % 2 == 1 {
                wait_until(
                    || format!("synchronize_srcu(): vCPU {i} has not left its read section"),
                    || v.srcu_seq() != s,
                );
            }
        }
    }
}
