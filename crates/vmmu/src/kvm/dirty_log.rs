//! Dirty logging as KVM core drives it: enabling and disabling `KVM_MEM_LOG_DIRTY_PAGES`
//! (`kvm_mmu_slot_apply_flags()`), `KVM_GET_DIRTY_LOG`, `KVM_CLEAR_DIRTY_LOG` and
//! `KVM_RESET_DIRTY_RINGS`, each expressed as an [`OpPlan`]: the sequence of lock-taking jobs,
//! SRCU waits and flushes KVM performs, which any engine can execute.

use crate::kvm::arch::EnableLogDirtyPtMasked;
use crate::kvm::dirty_ring::coalesce_ring_entries;
use crate::kvm::host_caches::HostCaches;
use crate::kvm::memslot::{
    check_clear_dirty_log_range, dirty_logging_change, ClearRangeError, Memslot,
};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::op_plan::{OpPlan, OpStep};
use crate::kvm::Kvm;
use crate::units::{owe_flush, GfnRange};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Changes a memslot's flags and applies what KVM does on the change
/// (`kvm_set_memslot()` for a flags-only change, then the architecture's
/// `kvm_mmu_slot_apply_flags()`).
pub fn set_memslot_flags_plan(kvm: &Kvm, slot: &Arc<Memslot>, new_flags: u32) -> OpPlan {
    let mut plan = OpPlan::default();
    let old_flags = slot.flags();
    let (enable, disable) = dirty_logging_change(old_flags, new_flags);
    let init_set = kvm.dirty_log_manual_protect_and_init_set();
    let s = Arc::clone(slot);
    plan.push(OpStep::Call(Box::new(move |kvm, meter| {
        // kvm_prepare_memory_region(): a fresh bitmap, all ones with KVM_DIRTY_LOG_INITIALLY_SET.
        if enable {
            if init_set {
                s.set_all_dirty();
            } else {
                s.clear_all_dirty();
            }
            if let Some(caches) = kvm.caches() {
                s.alloc_dirty_bitmap(caches, init_set, meter);
            }
        }
        s.set_flags(new_flags);
        if disable {
            s.clear_all_dirty();
        }
    })));
    // kvm_swap_active_memslots(): no fault may still act on the old flags after this.
    plan.push(OpStep::SyncSrcu);
    // kvm_free_memslot() of the old version frees its bitmap once no reader can see it (a
    // fault in flight may still mark a page dirty in it until the SRCU wait ends).
    if disable {
        let s = Arc::clone(slot);
        plan.push(OpStep::Call(Box::new(move |_, _| s.free_dirty_bitmap())));
    }
    // kvm_commit_memory_region(): count the memslots that log dirty pages.
    if enable || disable {
        plan.push(OpStep::Call(Box::new(move |kvm, _| {
            kvm.count_memslot_dirty_logging(enable)
        })));
    }
    // kvm_commit_memory_region() -> kvm_arch_commit_memory_region(). The plan is built before
    // the flags change, so the hook is told the new flags the change will publish.
    plan.steps.extend(
        kvm.arch()
            .mmu_slot_apply_flags(kvm, slot, old_flags, new_flags),
    );
    plan
}

/// `kvm_arch_sync_dirty_log()` of `slot`, the first thing GET and CLEAR do.
fn sync_dirty_log_step(slot: &Arc<Memslot>) -> OpStep {
    let s = Arc::clone(slot);
    OpStep::Call(Box::new(move |kvm, meter| {
        kvm.arch().sync_dirty_log(kvm, &s, meter)
    }))
}

/// The write-locked loop shared by GET (without manual protect), CLEAR and ring reset: for each
/// 64-page word, decide the mask to re-protect (and update the bitmap), then re-protect it.
struct ReprotectLoop<F: FnMut(&Memslot, usize) -> u64 + Send> {
    slot: Arc<Memslot>,
    /// Word indexes still to visit, in order.
    words: std::ops::Range<usize>,
    /// Takes the mask of a word from the bitmap (the part of KVM's loop before
    /// `kvm_arch_mmu_enable_log_dirty_pt_masked()`).
    take_mask: F,
    /// The architecture's re-protection of one mask.
    reprotect: Box<dyn EnableLogDirtyPtMasked>,
    /// A mask is being re-protected (it may have yielded).
    in_mask: bool,
    /// The pages re-protected so far, owed a flush.
    flush: Option<GfnRange>,
    /// The bitmap line the loop read last, when the host's caches are modelled.
    bitmap_line: Option<u64>,
    name: &'static str,
}

impl<F: FnMut(&Memslot, usize) -> u64 + Send> ReprotectLoop<F> {
    /// Word `i` as the host's caches see it: GET reads it from the bitmap and stores its mask
    /// in the buffer (`dirty_bitmap_buffer`, which `copy_to_user()` then reads), CLEAR reads the
    /// user's mask from the buffer (where `copy_from_user()` put it) and clears it in the
    /// bitmap; either way one line of each, on its first word. Simplified: the copy to or from
    /// the VMM's own buffer is not followed (user memory), and the buffer's line is counted
    /// once for the copy and the loop.
    fn touch_word(&mut self, caches: &HostCaches, i: usize, meter: &mut Meter) {
        let line = i as u64 / 8;
        if self.bitmap_line == Some(line) {
            return;
        }
        self.bitmap_line = Some(line);
        let region = self.slot.dirty_bitmap_region(caches);
        let offset = i as u64 * 8;
        caches.read_line(region.line_of(offset), meter);
        caches.read_line(
            region.line_of(self.slot.dirty_bitmap_bytes() + offset),
            meter,
        );
    }
}

impl<F: FnMut(&Memslot, usize) -> u64 + Send> MmuJob for ReprotectLoop<F> {
    fn name(&self) -> &'static str {
        self.name
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        loop {
            if !self.in_mask {
                let Some(i) = self.words.next() else {
                    return JobStep::Done { flush: self.flush };
                };
                meter.bitmap_words += 1;
                if let Some(caches) = kvm.caches() {
                    self.touch_word(caches, i, meter);
                }
                let mask = (self.take_mask)(&self.slot, i);
                if mask == 0 {
                    continue;
                }
                self.reprotect.start(&self.slot, i as u64 * 64, mask);
                self.in_mask = true;
            }
            match self.reprotect.run(kvm, held, meter) {
                JobStep::Done { flush } => {
                    self.in_mask = false;
                    if let Some(range) = flush {
                        owe_flush(&mut self.flush, range);
                    }
                }
                other => return other,
            }
        }
    }
    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if self.in_mask {
            self.reprotect.topup(kvm, meter);
        }
    }
}

/// `KVM_GET_DIRTY_LOG` (`kvm_get_dirty_log_protect()`). With manual protect it only copies the
/// bitmap; otherwise, under the write lock, each non-zero word is exchanged for zero and its
/// pages re-protected, then the memslot is flushed. The bitmap lands in `out`.
pub fn get_dirty_log_plan(kvm: &Kvm, slot: &Arc<Memslot>, out: Arc<Mutex<Vec<u64>>>) -> OpPlan {
    let mut plan = OpPlan::default();
    *out.lock() = vec![0; slot.bitmap_words()];
    plan.push(sync_dirty_log_step(slot));
    if kvm.manual_protect() {
        let s = Arc::clone(slot);
        plan.push(OpStep::Call(Box::new(move |kvm, meter| {
            let mut o = out.lock();
            for (i, w) in o.iter_mut().enumerate() {
                *w = s.bitmap_word(i).load(Ordering::SeqCst);
            }
            meter.bitmap_words += o.len() as u64;
            // copy_to_user() straight from the bitmap.
            if let Some(caches) = kvm.caches() {
                let region = s.dirty_bitmap_region(caches);
                caches.scan(region, 0..s.dirty_bitmap_bytes(), meter);
            }
        })));
        return plan;
    }
    plan.push(OpStep::Job(Box::new(ReprotectLoop {
        slot: Arc::clone(slot),
        words: 0..slot.bitmap_words(),
        take_mask: move |s: &Memslot, i| {
            let w = s.bitmap_word(i);
            if w.load(Ordering::Relaxed) == 0 {
                return 0;
            }
            let mask = w.swap(0, Ordering::SeqCst);
            out.lock()[i] = mask;
            mask
        },
        reprotect: kvm.arch().enable_log_dirty_pt_masked(),
        in_mask: false,
        flush: None,
        bitmap_line: None,
        name: "get_dirty_log",
    })));
    plan.push(OpStep::FlushMemslotIfPending(Arc::clone(slot)));
    plan
}

/// `KVM_CLEAR_DIRTY_LOG` (`kvm_clear_dirty_log_protect()`): checks KVM's range rules, then
/// under the write lock clears the requested bits (`mask &= fetch_andnot(mask)`, so only bits
/// really cleared are re-protected) and re-protects those pages, splitting huge pages first on
/// the initially-all-set path; one memslot flush if anything was cleared.
pub fn clear_dirty_log_plan(
    kvm: &Kvm,
    slot: &Arc<Memslot>,
    first_page: u64,
    num_pages: u64,
    bitmap: &[u64],
) -> Result<OpPlan, ClearRangeError> {
    check_clear_dirty_log_range(slot, first_page, num_pages)?;
    let nwords = num_pages.div_ceil(64) as usize;
    if bitmap.len() < nwords {
        return Err(ClearRangeError::BitmapTooShort {
            bits: bitmap.len() as u64 * 64,
            num_pages,
        });
    }
    let user: Vec<u64> = bitmap[..nwords].to_vec();
    let first_word = (first_page / 64) as usize;
    let mut plan = OpPlan::default();
    plan.push(sync_dirty_log_step(slot));
    plan.push(OpStep::Job(Box::new(ReprotectLoop {
        slot: Arc::clone(slot),
        words: first_word..first_word + nwords,
        take_mask: move |s: &Memslot, i| {
            let mask = user[i - first_word];
            if mask == 0 {
                return 0;
            }
            mask & s.bitmap_word(i).fetch_and(!mask, Ordering::SeqCst)
        },
        reprotect: kvm.arch().enable_log_dirty_pt_masked(),
        in_mask: false,
        flush: None,
        bitmap_line: None,
        name: "clear_dirty_log",
    })));
    plan.push(OpStep::FlushMemslotIfPending(Arc::clone(slot)));
    Ok(plan)
}

/// `KVM_RESET_DIRTY_RINGS`: every ring's harvested entries, coalesced into 64-page masks and
/// re-protected under the write lock; one flush if anything was reset. The plan takes the
/// entries when it runs (what it re-protects depends on them), not when it is built, and adds
/// how many it took to `reset`.
pub fn reset_dirty_rings_plan(reset: Arc<AtomicU64>) -> OpPlan {
    OpPlan {
        steps: vec![OpStep::Expand(Box::new(move |kvm, _| {
            let Some(rings) = kvm.dirty_rings.get() else {
                return Vec::new();
            };
            // The reset is in progress from here (the entries leave the rings) to the plan's
            // last step.
            kvm.dirty_ring_resets.fetch_add(1, Ordering::SeqCst);
            let mut steps = Vec::new();
            let mut total = 0;
            for ring in rings.iter() {
                let entries = ring.take_harvested();
                total += entries.len() as u64;
                for (slot_id, base, mask) in coalesce_ring_entries(&entries) {
                    let Some(slot) = kvm.slot_by_id(slot_id) else {
                        continue;
                    };
                    // kvm_reset_dirty_gfn(): ignore runs that reach past the slot.
                    if base + (63 - mask.leading_zeros() as u64) >= slot.npages {
                        continue;
                    }
                    // One ReprotectLoop per run: the mask is not word-aligned, so re-protect
                    // it directly at its offset (kvm_reset_dirty_gfn()).
                    let mut reprotect = kvm.arch().enable_log_dirty_pt_masked();
                    reprotect.start(&slot, base, mask);
                    steps.push(OpStep::Job(Box::new(RingReprotect {
                        reprotect,
                        done: false,
                    })));
                }
            }
            if total > 0 {
                steps.push(OpStep::FlushIfPending);
            }
            steps.push(OpStep::Call(Box::new(|kvm, _| {
                kvm.dirty_ring_resets.fetch_sub(1, Ordering::SeqCst);
            })));
            reset.fetch_add(total, Ordering::Relaxed);
            steps
        }))],
    }
}

/// One coalesced ring run being re-protected.
struct RingReprotect {
    reprotect: Box<dyn EnableLogDirtyPtMasked>,
    done: bool,
}

impl MmuJob for RingReprotect {
    fn name(&self) -> &'static str {
        "reset_dirty_gfn"
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        if self.done {
            return JobStep::Done { flush: None };
        }
        let step = self.reprotect.run(kvm, held, meter);
        self.done = matches!(step, JobStep::Done { .. });
        step
    }
    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if !self.done {
            self.reprotect.topup(kvm, meter);
        }
    }
}
