//! The part of a vCPU other actors touch: its mode (`vcpu->mode`), its request bits
//! (`vcpu->requests`), and its SRCU read-side state. Remote TLB flushes and memslot updates
//! synchronise with vCPUs only through these, as in `kvm_main.c`.

use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};

/// `OUTSIDE_GUEST_MODE`.
pub const OUTSIDE_GUEST_MODE: u8 = 0;
/// `IN_GUEST_MODE`.
pub const IN_GUEST_MODE: u8 = 1;
/// `EXITING_GUEST_MODE`: kicked, will exit at its next instruction boundary.
pub const EXITING_GUEST_MODE: u8 = 2;

/// `KVM_REQ_TLB_FLUSH`.
pub const KVM_REQ_TLB_FLUSH: u64 = 1 << 0;

/// Shared per-vCPU state.
#[derive(Default)]
pub struct VcpuShared {
    mode: AtomicU8,
    requests: AtomicU64,
    /// Odd while the vCPU is inside KVM_RUN but outside guest mode (holding `kvm->srcu`).
    srcu_seq: AtomicU64,
}

impl VcpuShared {
    /// `kvm_make_request()`.
    pub fn make_request(&self, req: u64) {
        self.requests.fetch_or(req, Ordering::SeqCst);
    }

    /// Takes all pending requests (`kvm_check_request()` for each bit).
    pub fn take_requests(&self) -> u64 {
        if self.requests.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        self.requests.swap(0, Ordering::SeqCst)
    }

    /// The guest-entry half of `vcpu_enter_guest()`: set `IN_GUEST_MODE`, then re-check requests
    /// with a full barrier between (pairs with the barrier in [`VcpuShared::kick_for_request`]):
    /// either the requester sees us in guest mode and kicks us, or we see its request here.
    /// Returns false (and leaves guest mode) if a request is pending; the caller services it and
    /// tries again.
    pub fn try_enter_guest(&self) -> bool {
        self.mode.store(IN_GUEST_MODE, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.requests.load(Ordering::SeqCst) != 0 {
            self.mode.store(OUTSIDE_GUEST_MODE, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// A VM exit: leave guest mode (acknowledging any kick).
    pub fn exit_guest(&self) {
        self.mode.store(OUTSIDE_GUEST_MODE, Ordering::SeqCst);
    }

    /// True when another actor kicked this vCPU; the guest loop polls this at each access, the
    /// way an IPI interrupts the guest at an instruction boundary.
    #[inline]
    pub fn kicked(&self) -> bool {
        self.mode.load(Ordering::Relaxed) == EXITING_GUEST_MODE
    }

    /// The requester's half of `kvm_make_all_cpus_request()` for one vCPU: post the request,
    /// then (after a full barrier) kick the vCPU if it is in guest mode. Returns true when the
    /// requester must wait for this vCPU to leave guest mode (the IPI's ack).
    pub fn kick_for_request(&self, req: u64) -> bool {
        self.make_request(req);
        fence(Ordering::SeqCst);
        // kvm_vcpu_exiting_guest_mode(): IN_GUEST_MODE -> EXITING_GUEST_MODE.
        match self.mode.compare_exchange(
            IN_GUEST_MODE,
            EXITING_GUEST_MODE,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) {
            Ok(_) => true,
            Err(m) => m == EXITING_GUEST_MODE,
        }
    }

    /// True while a kick has not been acknowledged (the vCPU has not left guest mode yet).
    pub fn exiting(&self) -> bool {
        self.mode.load(Ordering::SeqCst) == EXITING_GUEST_MODE
    }

    /// `srcu_read_lock(&kvm->srcu)`: entering KVM_RUN or leaving guest mode.
    pub fn srcu_read_lock(&self) {
        let s = self.srcu_seq.fetch_add(1, Ordering::SeqCst);
        // srcu_read_lock()'s smp_mb(): the count is visible before any memslot state is read.
        // Pairs with the fence in synchronize_srcu() (store-buffering: either the updater sees
        // this reader, or this reader sees the update).
        fence(Ordering::SeqCst);
        debug_assert_eq!(s % 2, 0, "SRCU read section nested");
    }

    /// `srcu_read_unlock(&kvm->srcu)`: entering guest mode or leaving KVM_RUN.
    pub fn srcu_read_unlock(&self) {
        let s = self.srcu_seq.fetch_add(1, Ordering::SeqCst);
        debug_assert_eq!(s % 2, 1, "SRCU unlock without lock");
    }

    /// The SRCU sequence, for grace-period detection.
    pub fn srcu_seq(&self) -> u64 {
        self.srcu_seq.load(Ordering::SeqCst)
    }
}

/// How an engine waits for vCPUs. MMU code never blocks by itself: where KVM waits for IPI acks
/// or for an SRCU grace period, it asks the engine.
pub trait VcpuWaiter: Send + Sync {
    /// Wait until each vCPU in `kicked` has left guest mode.
    fn wait_for_exits(&self, vcpus: &[VcpuShared], kicked: &[usize]);
    /// `synchronize_srcu(&kvm->srcu)`: wait until every vCPU that was in an SRCU read section
    /// when this was called has left it.
    fn synchronize_srcu(&self, vcpus: &[VcpuShared]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_never_missed_by_guest_entry() {
        let v = VcpuShared::default();
        assert!(v.try_enter_guest());
        assert!(
            v.kick_for_request(KVM_REQ_TLB_FLUSH),
            "in guest: the requester must wait"
        );
        assert!(v.kicked());
        v.exit_guest();
        assert!(!v.try_enter_guest(), "request pending: entry backs out");
        assert_eq!(v.take_requests(), KVM_REQ_TLB_FLUSH);
        assert!(v.try_enter_guest());
        v.exit_guest();
        assert!(
            !v.kick_for_request(KVM_REQ_TLB_FLUSH),
            "outside guest: no wait needed"
        );
    }
}
