//! Model-checked broadcast TLB invalidation (`TLBI ...IS` + `DSB ISH`): one flusher and one
//! vCPU, their schedules explored by shuttle. The protocol is the one of `hw::tlb::TlbShootdown`
//! (`post`, `sync`, `applied`) and `kvm::vcpu::VcpuShared` (`post_tlbi`, `tlbi_complete`,
//! `try_enter_guest`, `exit_guest`), transcribed step for step onto shuttle's atomics, fences
//! and mutex (the real ones are std's and parking_lot's, which shuttle cannot schedule). As in
//! `model_fast_pf.rs`, the property is about interleavings, not weak-memory reordering; the
//! orderings, and the two full barriers (after the post, after publishing guest mode) that make
//! the store-buffering pattern safe, are argued in the sources.
//!
//! - The flusher changes the page table (generation 0 -> 1), posts the invalidation, reads
//!   whether the vCPU is in guest mode, and if so polls (twice, so every execution is finite)
//!   until the vCPU has applied it or left guest mode; then it declares the invalidation
//!   complete. Polls that run out leave it incomplete, which the property does not mind.
//! - The vCPU starts in guest mode with generation 0 in its TLB and runs an access (sync with
//!   posted invalidations, look up or fill from the page table, use), leaves guest mode,
//!   re-enters it (publish guest mode, full barrier, sync), and runs another access. That covers
//!   completion by the vCPU applying the invalidation in guest mode, by its leaving guest mode
//!   (and applying on entry), and without a wait (the flusher finds it outside).
//!
//! Property: no access uses a generation-0 translation after the flusher declared the
//! invalidation complete. Negative controls: a flusher that completes without waiting, and one
//! that reads the vCPU's mode before posting; the model checker must catch both.
//!
//! Exhaustive search (DFS) is out of reach: shuttle's DFS already runs 700 000 schedules for two
//! threads of five atomic operations each, and these threads have about fifteen. So the
//! schedules are sampled, as `model_fast_pf.rs` does for three threads: PCT (which finds any bug
//! of depth <= 3 with a known probability per run) and uniformly random scheduling, 20 000 runs
//! each.

use shuttle::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering};
use shuttle::sync::{Arc, Mutex};
use std::sync::atomic::AtomicU64 as StdAtomicU64;

const OUTSIDE_GUEST_MODE: u8 = 0;
const IN_GUEST_MODE: u8 = 1;
const RUNS: usize = 20_000;

/// How the flusher behaves.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Flusher {
    /// As `Kvm::tlbi_broadcast`: post, full barrier, read the mode, wait.
    Kvm,
    /// Declares completion right after posting.
    CompletesWithoutWaiting,
    /// Reads whether the vCPU is in guest mode before posting.
    ReadsModeBeforePosting,
}

/// The vCPU's shared state and the page table.
struct World {
    /// `vcpu->mode`.
    mode: AtomicU8,
    /// `TlbShootdown::posted`.
    posted: AtomicU64,
    /// `TlbShootdown::applied`.
    applied: AtomicU64,
    /// `TlbShootdown::queue`: how many invalidations are queued (all of one kind here:
    /// everything).
    queue: Mutex<u64>,
    /// The generation of the page table's mapping.
    pte: AtomicU64,
    /// The generation every use must at least see: raised when the invalidation completes.
    complete: AtomicU64,
}

/// The vCPU's private TLB: the generation of its one cached translation, and how far it synced.
struct Tlb {
    entry: Option<u64>,
    synced: u64,
}

/// `TlbShootdown::sync`.
fn sync(w: &World, tlb: &mut Tlb) {
    if w.posted.load(Ordering::Relaxed) != tlb.synced {
        let upto = {
            let mut q = w.queue.lock().unwrap();
            *q = 0;
            w.posted.load(Ordering::Relaxed)
        };
        tlb.entry = None;
        tlb.synced = upto;
        w.applied.store(upto, Ordering::Release);
    }
}

/// `TlbShootdown::post`: returns the sequence number.
fn post(w: &World) -> u64 {
    let mut q = w.queue.lock().unwrap();
    *q += 1;
    w.posted.fetch_add(1, Ordering::SeqCst) + 1
}

/// `VcpuShared::tlbi_complete`.
fn tlbi_complete(w: &World, seq: u64) -> bool {
    w.applied.load(Ordering::Acquire) >= seq || w.mode.load(Ordering::SeqCst) == OUTSIDE_GUEST_MODE
}

/// `Vcpu::access`: sync, translate (filling from the page table on a miss), use.
fn access(w: &World, tlb: &mut Tlb) {
    sync(w, tlb);
    let gen = *tlb
        .entry
        .get_or_insert_with(|| w.pte.load(Ordering::Acquire));
    let must = w.complete.load(Ordering::Acquire);
    assert!(
        gen >= must,
        "used a generation-{gen} translation after the invalidation for generation {must} completed"
    );
}

/// `Vcpu::enter_guest`: `try_enter_guest()` (publish, full barrier), then sync.
fn enter_guest(w: &World, tlb: &mut Tlb) {
    w.mode.store(IN_GUEST_MODE, Ordering::SeqCst);
    fence(Ordering::SeqCst);
    sync(w, tlb);
}

/// Completions declared over every schedule explored: the model must not be vacuous.
static COMPLETIONS: StdAtomicU64 = StdAtomicU64::new(0);

fn model(flusher: Flusher) {
    let w = Arc::new(World {
        mode: AtomicU8::new(IN_GUEST_MODE),
        posted: AtomicU64::new(0),
        applied: AtomicU64::new(0),
        queue: Mutex::new(0),
        pte: AtomicU64::new(0),
        complete: AtomicU64::new(0),
    });
    let vcpu = {
        let w = w.clone();
        shuttle::thread::spawn(move || {
            let mut tlb = Tlb {
                entry: Some(0),
                synced: 0,
            };
            access(&w, &mut tlb);
            // VcpuShared::exit_guest().
            w.mode.store(OUTSIDE_GUEST_MODE, Ordering::SeqCst);
            enter_guest(&w, &mut tlb);
            access(&w, &mut tlb);
        })
    };
    // The page-table change, then `TLBI ...IS; DSB ISH` (VcpuShared::post_tlbi, then the
    // waiter's polls of VcpuShared::tlbi_complete).
    w.pte.store(1, Ordering::SeqCst);
    let (seq, wait) = match flusher {
        Flusher::ReadsModeBeforePosting => {
            let wait = w.mode.load(Ordering::SeqCst) != OUTSIDE_GUEST_MODE;
            (post(&w), wait)
        }
        _ => {
            let seq = post(&w);
            fence(Ordering::SeqCst);
            (seq, w.mode.load(Ordering::SeqCst) != OUTSIDE_GUEST_MODE)
        }
    };
    let done = !wait
        || flusher == Flusher::CompletesWithoutWaiting
        || (0..2).any(|_| tlbi_complete(&w, seq));
    if done {
        COMPLETIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        w.complete.store(1, Ordering::Release);
    }
    vcpu.join().unwrap();
}

#[test]
fn no_access_uses_a_translation_after_its_broadcast_invalidation_completed() {
    shuttle::check_pct(|| model(Flusher::Kvm), RUNS, 3);
    shuttle::check_random(|| model(Flusher::Kvm), RUNS);
    assert!(
        COMPLETIONS.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no schedule completed the invalidation"
    );
}

/// The model checker must find the schedule where `flusher` lets an access use the stale
/// translation after completion.
fn assert_caught(flusher: Flusher) {
    let broken = std::panic::catch_unwind(|| shuttle::check_random(move || model(flusher), RUNS));
    assert!(
        broken.is_err(),
        "the model checker must find a use of the stale translation"
    );
}

#[test]
fn completing_without_waiting_is_caught() {
    assert_caught(Flusher::CompletesWithoutWaiting);
}

#[test]
fn reading_the_mode_before_posting_is_caught() {
    assert_caught(Flusher::ReadsModeBeforePosting);
}
