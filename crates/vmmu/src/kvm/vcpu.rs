//! The part of a vCPU other actors touch: its mode (`vcpu->mode`), its request bits
//! (`vcpu->requests`), its SRCU read-side state, and its TLB's broadcast-invalidation endpoint.
//! Remote TLB flushes and memslot updates synchronise with vCPUs only through these, as in
//! `kvm_main.c`; broadcast invalidations (arm64's `TLBI ...IS`) reach the TLB with no software
//! on the vCPU, and the flusher's `DSB ISH` waits on the vCPU's mode and on how far its TLB has
//! applied them.

use crate::hw::tlb::{TlbInvalidation, TlbShootdown};
use std::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};

/// `OUTSIDE_GUEST_MODE`.
pub const OUTSIDE_GUEST_MODE: u8 = 0;
/// `IN_GUEST_MODE`.
pub const IN_GUEST_MODE: u8 = 1;
/// `EXITING_GUEST_MODE`: kicked, will exit at its next instruction boundary.
pub const EXITING_GUEST_MODE: u8 = 2;

/// `KVM_REQ_TLB_FLUSH`.
pub const KVM_REQ_TLB_FLUSH: u64 = 1 << 0;

/// x86's `KVM_REQ_UPDATE_CPU_DIRTY_LOGGING`: turn the CPU's dirty log (PML) on or off to match
/// `kvm->nr_memslots_dirty_logging` before the next entry (`vmx_update_cpu_dirty_logging()`).
pub const KVM_REQ_UPDATE_CPU_DIRTY_LOGGING: u64 = 1 << 1;

/// Shared per-vCPU state.
#[derive(Default)]
pub struct VcpuShared {
    mode: AtomicU8,
    requests: AtomicU64,
    /// Odd while the vCPU is inside KVM_RUN but outside guest mode (holding `kvm->srcu`).
    srcu_seq: AtomicU64,
    tlb_shootdown: TlbShootdown,
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
    /// tries again. The same barrier orders the entry before the caller's
    /// [`TlbShootdown::sync`] (pairs with the barrier in [`VcpuShared::post_tlbi`]).
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
        let m = self.exiting_guest_mode();
        m == IN_GUEST_MODE || m == EXITING_GUEST_MODE
    }

    /// `kvm_vcpu_exiting_guest_mode()`: after a full barrier (pairs with the one in
    /// [`VcpuShared::try_enter_guest`]), `IN_GUEST_MODE` becomes `EXITING_GUEST_MODE`; returns
    /// the mode found.
    fn exiting_guest_mode(&self) -> u8 {
        fence(Ordering::SeqCst);
        match self.mode.compare_exchange(
            IN_GUEST_MODE,
            EXITING_GUEST_MODE,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) {
            Ok(m) | Err(m) => m,
        }
    }

    /// `kvm_vcpu_kick()` with no request: a vCPU in guest mode is made to leave it (the
    /// kicker sends the IPI and does not wait). Returns true when an IPI was sent.
    /// Simplified: `kvm_vcpu_kick()` also wakes a vCPU halted in `kvm_vcpu_block()`; vCPUs
    /// here never halt (the guest loop runs until the run ends), so only the IPI is modelled.
    pub fn kick(&self) -> bool {
        self.exiting_guest_mode() == IN_GUEST_MODE
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

    /// The vCPU's TLB broadcast-invalidation endpoint; the vCPU syncs its TLB with it.
    #[inline]
    pub fn tlb_shootdown(&self) -> &TlbShootdown {
        &self.tlb_shootdown
    }

    /// A broadcast `TLBI` as it reaches this vCPU: post `inv`, then, after a full barrier, read
    /// whether the vCPU is in guest mode. Returns the invalidation's sequence number when the
    /// flusher's `DSB ISH` must wait for it ([`VcpuShared::tlbi_complete`]), or `None` when the
    /// vCPU is outside guest mode: it syncs its TLB when it enters, before any access.
    ///
    /// The barrier pairs with the one in [`VcpuShared::try_enter_guest`] (store buffering, as
    /// for requests): either this read sees the vCPU in guest mode, or the vCPU's sync after
    /// entering sees the post.
    pub fn post_tlbi(&self, inv: TlbInvalidation) -> Option<u64> {
        let seq = self.tlb_shootdown.post(inv);
        fence(Ordering::SeqCst);
        (self.mode.load(Ordering::SeqCst) != OUTSIDE_GUEST_MODE).then_some(seq)
    }

    /// True once the invalidation numbered `seq` (from [`VcpuShared::post_tlbi`]) is complete
    /// on this vCPU: its TLB has applied it, or the vCPU has left guest mode since (its accesses
    /// through the old translation are over, and it syncs on entry). A kicked vCPU
    /// (`EXITING_GUEST_MODE`) is still in guest mode. Both loads acquire (the `applied` count
    /// pairs with its Release store in [`TlbShootdown::sync`], the mode with the SeqCst store
    /// in [`VcpuShared::exit_guest`]): what the vCPU did through the dropped translations
    /// happens before the flusher goes on.
    pub fn tlbi_complete(&self, seq: u64) -> bool {
        self.tlb_shootdown.applied() >= seq
            || self.mode.load(Ordering::SeqCst) == OUTSIDE_GUEST_MODE
    }
}

/// Broadcast invalidations posted to vCPUs in guest mode and not yet waited for: what a
/// `DSB ISH` completes ([`crate::kvm::Kvm::tlbi_is`], [`crate::kvm::Kvm::dsb_ish`]).
#[derive(Default, Debug)]
pub struct TlbiPending {
    /// Per vCPU, the sequence number of its last posted invalidation to wait for; 0 for none.
    /// A vCPU applies its invalidations in order, so the last one covers the earlier ones.
    seqs: Vec<u64>,
}

thread_local! {
    /// The calling thread's [`TlbiPending`], reused so a broadcast allocates nothing once the
    /// buffer has grown to the vCPU count (TLBIs are on arm64's fault path).
    static PENDING: std::cell::RefCell<TlbiPending> = std::cell::RefCell::new(TlbiPending::default());
}

/// Runs `f` with this thread's empty [`TlbiPending`]. Not re-entrant: `f` must not call it
/// again (a broadcast inside `f` uses the `pending` it is given).
pub fn with_tlbi_pending<R>(f: impl FnOnce(&mut TlbiPending) -> R) -> R {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.clear();
        f(&mut p)
    })
}

impl TlbiPending {
    /// Records that vCPU `vcpu`'s invalidation `seq` must complete.
    pub fn add(&mut self, vcpu: usize, seq: u64) {
        if self.seqs.len() <= vcpu {
            self.seqs.resize(vcpu + 1, 0);
        }
        self.seqs[vcpu] = self.seqs[vcpu].max(seq);
    }

    /// Per vCPU, the sequence number to wait for (0: nothing); shorter than the vCPU array when
    /// the last vCPUs have nothing pending.
    pub fn seqs(&self) -> &[u64] {
        &self.seqs
    }

    /// Forgets what was recorded (the buffer is kept).
    pub fn clear(&mut self) {
        self.seqs.clear();
    }

    /// Nothing to wait for.
    pub fn is_empty(&self) -> bool {
        self.seqs.iter().all(|&s| s == 0)
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
    /// The wait of a `DSB ISH` after broadcast `TLBI`s: until each vCPU `i` with `seqs[i] != 0`
    /// satisfies [`VcpuShared::tlbi_complete`]`(seqs[i])`.
    fn wait_for_tlbi(&self, vcpus: &[VcpuShared], seqs: &[u64]);
}

/// A waiter for unit tests whose KVM has no running vCPU to wait for.
#[cfg(test)]
pub(crate) struct NoWait;

#[cfg(test)]
impl VcpuWaiter for NoWait {
    fn wait_for_exits(&self, _vcpus: &[VcpuShared], _kicked: &[usize]) {}
    fn synchronize_srcu(&self, _vcpus: &[VcpuShared]) {}
    fn wait_for_tlbi(&self, _vcpus: &[VcpuShared], _seqs: &[u64]) {}
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

    #[test]
    fn a_tlbi_waits_only_for_a_vcpu_in_guest_mode_until_it_applies_or_exits() {
        use crate::hw::tlb::Tlb;
        let inv = TlbInvalidation::All;
        let v = VcpuShared::default();
        let mut tlb = Tlb::default();
        assert_eq!(v.post_tlbi(inv), None, "outside guest mode: no wait");
        assert!(v.try_enter_guest());
        v.tlb_shootdown().sync(&mut tlb);
        assert_eq!(v.tlb_shootdown().applied(), 1, "applied on entry");
        let seq = v.post_tlbi(inv).expect("in guest mode: the flusher waits");
        assert!(!v.tlbi_complete(seq));
        v.tlb_shootdown().sync(&mut tlb);
        assert!(v.tlbi_complete(seq), "applied at the next access");
        let seq = v.post_tlbi(inv).unwrap();
        assert!(v.kick_for_request(KVM_REQ_TLB_FLUSH));
        assert!(
            !v.tlbi_complete(seq),
            "a kicked vCPU is still in guest mode"
        );
        v.exit_guest();
        assert!(v.tlbi_complete(seq), "left guest mode: applies on entry");
    }
}
