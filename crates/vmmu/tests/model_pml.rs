//! Model-checked completeness of dirty logging with Intel PML: one vCPU writing one page and
//! the VMM harvesting it, their schedules explored by shuttle. The entry protocol is the
//! project's own: the CPU's locked Accessed/Dirty update (`hw_update_accessed_dirty()`, which
//! says when it set D, the event PML logs) and KVM's D clear under `mmu_lock`
//! (`clear_leaf_bit_locked()`, what `clear_dirty_pt_masked()` runs: a plain store when D is
//! set, since the CPU then changes nothing). The rest is transcribed
//! step for step onto shuttle's atomics: the PML log (one page, so a count of entries), the
//! dirty bitmap word, the kick (`kvm_vcpu_kick()`: `vcpu->mode` to `EXITING_GUEST_MODE`) and
//! the exit that empties the log (`vmx_flush_pml_buffer()` from `vmx_handle_exit()`).
//!
//! - The vCPU writes the page twice. Each write is the CPU's D update, with a log entry when
//!   it set D; after each write comes an instruction boundary where a pending kick makes the
//!   vCPU exit, and the exit empties the log into the bitmap. When its writes are done the vCPU
//!   leaves `KVM_RUN` (`GUEST_SYNC`), which is an exit too.
//! - The VMM makes two harvests (`KVM_GET_DIRTY_LOG` without manual protect): kick the vCPU
//!   without waiting (`kvm_arch_sync_dirty_log()`), take the bitmap word, clear D if the page
//!   was in it. After both threads end, a final harvest reads the bitmap with the vCPU stopped
//!   (migration's last sync).
//!
//! Property, the rule the completeness oracle applies to PML runs: a write that started after
//! harvest `k - 1` ended is reported by a harvest at or after `k`, and at the latest by the
//! first harvest that took the bitmap word after the vCPU's first exit following the write.
//! Because GET kicks, that exit is the kick's, so a write that completed before a harvest
//! began is reported by that harvest, or by the next one once the vCPU took the kick's exit in
//! between (an IPI is delivered in microseconds; `tests/stress.rs` waits for those exits
//! between harvests). Negative control: a KVM that empties the log only when the vCPU leaves
//! `KVM_RUN`, not on every exit, must be caught.
//!
//! A second property bounds the lateness: a write that completed before harvest `k` began is
//! reported by `k` or `k + 1` whenever the vCPU went through an instruction boundary between
//! `k`'s kick and `k + 1`'s read of the bitmap. A GET that does not kick breaks it, and the
//! model checker must find that too.
//!
//! Not in the model: a TLB (the vCPU does the locked A/D update on every write, so a harvest
//! that forgot the flush after clearing D would pass; `tests/dirty_log_interface.rs` has the
//! missing-flush control with the real TLB model).
//!
//! Exhaustive search is out of reach (about 25 and 16 scheduling points); the schedules are
//! sampled with PCT and uniformly at random, 20 000 runs each, as in `model_tlbi.rs`.

mod model_common;

use model_common::ModelSpte;
use shuttle::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use shuttle::sync::Arc;
use vmmu::hw::ept::{hw_update_accessed_dirty, AdUpdate};
use vmmu::hw::pgtable::SpteCell;
use vmmu::units::Pfn;
use vmmu::x86::spte::*;

const RUNS: usize = 20_000;
const WRITES: usize = 2;
const HARVESTS: usize = 2;
/// The final harvest, with the vCPU stopped.
const FINAL: usize = HARVESTS + 1;

/// The KVM under test.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Kvm {
    /// Empties the log on every VM exit (`vmx_handle_exit()`) and kicks the vCPUs in GET
    /// (`kvm_arch_sync_dirty_log()`), as KVM does.
    Real,
    /// Broken: empties the log only when the vCPU leaves `KVM_RUN`.
    DrainsOnlyLeavingKvmRun,
    /// Broken: GET does not kick the vCPUs.
    NoKick,
}

struct World {
    /// The page's 4K leaf: writable, D cleared when logging was enabled.
    spte: ModelSpte,
    /// The page's bit in the dirty bitmap.
    bitmap: AtomicU64,
    /// Entries in the vCPU's PML log (all for this page).
    log: AtomicU64,
    /// `vcpu->mode == EXITING_GUEST_MODE`: kicked, exits at the next instruction boundary.
    kicked: AtomicBool,
    /// Exits the vCPU has completed (the log emptied, where KVM empties it).
    exits: AtomicU64,
    /// Harvest generation: `2k + 1` while harvest `k` runs, `2k + 2` after; 2 before the first.
    gen: AtomicU64,
    /// Per write: the generation when it started and when it completed, and the exits completed
    /// by then.
    writes: [[AtomicU64; 3]; WRITES],
    /// Per harvest (1-based): the page was in its bitmap word.
    reported: [AtomicBool; FINAL + 1],
    /// Per harvest: the exits completed before it took the bitmap word.
    exits_seen: [AtomicU64; FINAL + 1],
    /// Instruction boundaries the vCPU has started (before it looks for a kick) and finished
    /// (after the exit a kick caused).
    boundaries_started: AtomicU64,
    boundaries_finished: AtomicU64,
    /// Per harvest: the boundaries started when its kick was posted, and the boundaries
    /// finished when it took the bitmap word.
    started_at_kick: [AtomicU64; FINAL + 1],
    finished_seen: [AtomicU64; FINAL + 1],
}

/// The vCPU's exit: the log goes into the bitmap (unless the broken KVM keeps it), then the
/// exit counts as complete.
fn exit(w: &World, empty_log: bool) {
    if empty_log && w.log.swap(0, Ordering::SeqCst) > 0 {
        w.bitmap.fetch_or(1, Ordering::SeqCst);
    }
    w.exits.fetch_add(1, Ordering::SeqCst);
}

fn vcpu(w: &World, kvm: Kvm) {
    for i in 0..WRITES {
        let s = w.gen.load(Ordering::SeqCst);
        // The CPU's write: the locked A/D update, and a log entry when it set D (the log is
        // never full here).
        match hw_update_accessed_dirty(&w.spte, w.spte.load(), true, false) {
            AdUpdate::Used { dirtied, .. } => {
                if dirtied {
                    w.log.fetch_add(1, Ordering::SeqCst);
                }
            }
            other => panic!("a writable leaf refused the write: {other:?}"),
        }
        let c = w.gen.load(Ordering::SeqCst);
        let e = w.exits.load(Ordering::SeqCst);
        for (field, v) in w.writes[i].iter().zip([s, c, e]) {
            field.store(v, Ordering::SeqCst);
        }
        // An instruction boundary: a kick makes the vCPU exit.
        w.boundaries_started.fetch_add(1, Ordering::SeqCst);
        if w.kicked.swap(false, Ordering::SeqCst) {
            exit(w, kvm != Kvm::DrainsOnlyLeavingKvmRun);
        }
        w.boundaries_finished.fetch_add(1, Ordering::SeqCst);
    }
    // GUEST_SYNC: leaving KVM_RUN is an exit too, and every KVM empties the log there.
    exit(w, true);
}

fn harvest(w: &World, k: usize, kvm: Kvm) {
    w.gen.store(2 * k as u64 + 1, Ordering::SeqCst);
    // kvm_arch_sync_dirty_log(): kick, do not wait.
    if kvm != Kvm::NoKick {
        w.kicked.store(true, Ordering::SeqCst);
    }
    let started = w.boundaries_started.load(Ordering::SeqCst);
    w.started_at_kick[k].store(started, Ordering::SeqCst);
    // Under mmu_lock: take the word, clear D of the pages in it (clear_dirty_pt_masked()).
    let finished = w.boundaries_finished.load(Ordering::SeqCst);
    w.finished_seen[k].store(finished, Ordering::SeqCst);
    w.exits_seen[k].store(w.exits.load(Ordering::SeqCst), Ordering::SeqCst);
    let mask = w.bitmap.swap(0, Ordering::SeqCst);
    w.reported[k].store(mask != 0, Ordering::SeqCst);
    if mask != 0 {
        clear_leaf_bit_locked(&w.spte, PG_LEVEL_4K, false);
    }
    w.gen.store(2 * k as u64 + 2, Ordering::SeqCst);
}

fn model(kvm: Kvm) {
    let leaf = make_spte(PG_LEVEL_4K, Pfn(42), true, false) & !SHADOW_DIRTY_MASK;
    let w = Arc::new(World {
        spte: ModelSpte::new(leaf),
        bitmap: AtomicU64::new(0),
        log: AtomicU64::new(0),
        kicked: AtomicBool::new(false),
        exits: AtomicU64::new(0),
        gen: AtomicU64::new(2),
        writes: Default::default(),
        reported: Default::default(),
        exits_seen: Default::default(),
        boundaries_started: AtomicU64::new(0),
        boundaries_finished: AtomicU64::new(0),
        started_at_kick: Default::default(),
        finished_seen: Default::default(),
    });
    let v = {
        let w = Arc::clone(&w);
        shuttle::thread::spawn(move || vcpu(&w, kvm))
    };
    for k in 1..=HARVESTS {
        harvest(&w, k, kvm);
    }
    v.join().unwrap();
    // The last sync of a migration: the vCPU is stopped, its log emptied by its last exit.
    w.exits_seen[FINAL].store(w.exits.load(Ordering::SeqCst), Ordering::SeqCst);
    w.reported[FINAL].store(w.bitmap.swap(0, Ordering::SeqCst) != 0, Ordering::SeqCst);

    let ld = |a: &AtomicU64| a.load(Ordering::SeqCst);
    for (i, rec) in w.writes.iter().enumerate() {
        let (s, c, e) = (ld(&rec[0]), ld(&rec[1]), ld(&rec[2]));
        // The first harvest that had not ended when the write started.
        let first = (s / 2) as usize;
        // The first harvest that took the word after an exit that followed the write.
        let deadline = (first..=FINAL)
            .find(|&k| ld(&w.exits_seen[k]) > e)
            .unwrap_or(FINAL);
        assert!(
            (first..=deadline).any(|k| w.reported[k].load(Ordering::SeqCst)),
            "write {i} (started at generation {s}, completed at {c}, after {e} exits) is not \
             reported by harvests {first}..={deadline}"
        );
        // One harvest late at most: a write that completed before harvest k began is reported
        // by k, or by k + 1 when the vCPU went through an instruction boundary between k's
        // kick and k + 1's read of the bitmap (a boundary that started after the kick and
        // finished before the read: the kick made it exit, or an earlier boundary already had).
        let Some(k) = (1..=HARVESTS).find(|&k| c <= 2 * k as u64) else {
            continue;
        };
        let next = k + 1;
        if ld(&w.finished_seen[next]) > ld(&w.started_at_kick[k]) || next == FINAL {
            assert!(
                (first..=next).any(|j| w.reported[j].load(Ordering::SeqCst)),
                "write {i} completed before harvest {k} began and is reported by neither it \
                 nor harvest {next}, though the vCPU passed an instruction boundary after the \
                 kick"
            );
        }
    }
}

#[test]
fn a_write_is_reported_by_the_first_harvest_after_the_vcpus_next_exit() {
    shuttle::check_pct(|| model(Kvm::Real), RUNS, 3);
    shuttle::check_random(|| model(Kvm::Real), RUNS);
}

/// The model checker must find a schedule where `kvm` breaks a rule.
fn assert_caught(kvm: Kvm) {
    let broken = std::panic::catch_unwind(|| shuttle::check_random(move || model(kvm), RUNS));
    assert!(
        broken.is_err(),
        "the model checker must find the harvest that misses a logged write"
    );
}

#[test]
fn emptying_the_log_only_when_leaving_kvm_run_is_caught() {
    assert_caught(Kvm::DrainsOnlyLeavingKvmRun);
}

#[test]
fn a_harvest_without_its_kick_is_caught() {
    assert_caught(Kvm::NoKick);
}
