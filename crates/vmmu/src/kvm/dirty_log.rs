//! Dirty logging as KVM core drives it: enabling and disabling `KVM_MEM_LOG_DIRTY_PAGES`
//! (`kvm_mmu_slot_apply_flags()`), `KVM_GET_DIRTY_LOG`, `KVM_CLEAR_DIRTY_LOG` and
//! `KVM_RESET_DIRTY_RINGS`, each expressed as an [`OpPlan`]: the sequence of lock-taking jobs,
//! SRCU waits and flushes KVM performs, which any engine can execute.

use crate::kvm::dirty_ring::coalesce_ring_entries;
use crate::kvm::memslot::{
    check_clear_dirty_log_range, Memslot, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, Mmu, MmuJob};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::Kvm;
use crate::units::{Gfn, PG_LEVEL_2M, PG_LEVEL_4K};
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// A lockless action inside a plan.
pub type PlanCall = Box<dyn FnOnce(&Kvm, &mut Meter) + Send>;

/// One step of a KVM operation.
pub enum OpStep {
    /// Run a closure without `mmu_lock` (flag updates, bitmap copies).
    Call(PlanCall),
    /// `synchronize_srcu()`.
    SyncSrcu,
    /// Run a job under `mmu_lock`, yielding when it asks to.
    Job(Box<dyn MmuJob>),
    /// `kvm_flush_remote_tlbs_memslot()` if an earlier job left a flush pending.
    FlushMemslotIfPending(Arc<Memslot>),
    /// `kvm_flush_remote_tlbs()` if an earlier job left a flush pending.
    FlushIfPending,
    /// `kvm_flush_remote_tlbs_memslot()` unconditionally.
    FlushMemslot(Arc<Memslot>),
}

/// A KVM operation as an ordered list of steps. Engines execute it with
/// [`crate::vm::plan::run_plan`] or in virtual time.
#[derive(Default)]
pub struct OpPlan {
    /// The steps, in order.
    pub steps: Vec<OpStep>,
}

impl OpPlan {
    fn push(&mut self, s: OpStep) -> &mut Self {
        self.steps.push(s);
        self
    }
}

/// Changes a memslot's flags and applies what KVM does on the change
/// (`kvm_set_memslot()` for a flags-only change, then `kvm_mmu_slot_apply_flags()`).
pub fn set_memslot_flags_plan(
    kvm: &Kvm,
    mmu: &Arc<dyn Mmu>,
    slot: &Arc<Memslot>,
    new_flags: u32,
) -> OpPlan {
    let mut plan = OpPlan::default();
    let old_flags = slot.flags();
    let enable =
        old_flags & KVM_MEM_LOG_DIRTY_PAGES == 0 && new_flags & KVM_MEM_LOG_DIRTY_PAGES != 0;
    let disable =
        old_flags & KVM_MEM_LOG_DIRTY_PAGES != 0 && new_flags & KVM_MEM_LOG_DIRTY_PAGES == 0;
    let init_set = kvm.dirty_log_manual_protect_and_init_set();
    let s = Arc::clone(slot);
    plan.push(OpStep::Call(Box::new(move |_, _| {
        // kvm_prepare_memory_region(): a fresh bitmap, all ones with KVM_DIRTY_LOG_INITIALLY_SET.
        if enable {
            if init_set {
                s.set_all_dirty();
            } else {
                s.clear_all_dirty();
            }
        }
        s.set_flags(new_flags);
        if disable {
            s.clear_all_dirty();
        }
    })));
    // kvm_swap_active_memslots(): no fault may still act on the old flags after this.
    plan.push(OpStep::SyncSrcu);
    // kvm_mmu_slot_apply_flags(): read-only slots have nothing to split, protect or recover.
    if new_flags & KVM_MEM_READONLY != 0 {
        return plan;
    }
    if enable {
        // With initially-all-set nothing is protected or split now: the first CLEAR does it.
        if !init_set {
            if kvm.eager_page_split.load(Ordering::Relaxed) {
                // kvm_mmu_slot_try_split_huge_pages(): TDP MMU under the read lock.
                plan.push(OpStep::Job(mmu.try_split_huge_pages(
                    slot,
                    slot.base_gfn,
                    slot.end_gfn(),
                    PG_LEVEL_4K,
                    LockMode::Read,
                )));
            }
            // No PML: write-protect everything down to 4K.
            plan.push(OpStep::Job(mmu.slot_remove_write_access(slot, PG_LEVEL_4K)));
            // Flushed unconditionally after enabling (see kvm_mmu_slot_apply_flags()).
            plan.push(OpStep::FlushMemslot(Arc::clone(slot)));
        }
    } else if disable {
        // The job flushes before it releases the lock.
        plan.push(OpStep::Job(mmu.recover_huge_pages(slot)));
    }
    plan
}

/// `kvm_arch_mmu_enable_log_dirty_pt_masked()` for one 64-page mask, resumable because the
/// eager split inside it yields `mmu_lock` (write) when contended.
struct MaskedReprotect {
    slot: Arc<Memslot>,
    gfn_offset: u64,
    mask: u64,
    split: Option<Box<dyn MmuJob>>,
    split_done: bool,
}

impl MaskedReprotect {
    fn new(slot: Arc<Memslot>, gfn_offset: u64, mask: u64) -> Self {
        MaskedReprotect {
            slot,
            gfn_offset,
            mask,
            split: None,
            split_done: false,
        }
    }

    fn run(&mut self, kvm: &Kvm, mmu: &dyn Mmu, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        held.assert_write();
        let slot = &*self.slot;
        if kvm.dirty_log_manual_protect_and_init_set() {
            let base = slot.base_gfn.0 + self.gfn_offset;
            let start = Gfn(base + self.mask.trailing_zeros() as u64);
            let end = Gfn(base + 63 - self.mask.leading_zeros() as u64);
            if kvm.eager_page_split.load(Ordering::Relaxed) && !self.split_done {
                // kvm_mmu_try_split_huge_pages(): the write lock is already held.
                let job = self.split.get_or_insert_with(|| {
                    mmu.try_split_huge_pages(
                        &self.slot,
                        start,
                        Gfn(end.0 + 1),
                        PG_LEVEL_4K,
                        LockMode::Write,
                    )
                });
                match job.run(kvm, held, meter) {
                    JobStep::Done { .. } => self.split_done = true,
                    other => return other,
                }
            }
            // Huge pages that remain (split off or refused) are write-protected at both ends.
            mmu.slot_gfn_write_protect(kvm, slot, start, PG_LEVEL_2M, held, meter);
            if start.0 & !(PG_LEVEL_2M.pages() - 1) != end.0 & !(PG_LEVEL_2M.pages() - 1) {
                mmu.slot_gfn_write_protect(kvm, slot, end, PG_LEVEL_2M, held, meter);
            }
        }
        // No PML: write-protect the 4K pages of the mask.
        mmu.write_protect_pt_masked(kvm, slot, self.gfn_offset, self.mask, held, meter);
        JobStep::Done { flush: true }
    }

    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if let Some(j) = self.split.as_mut() {
            j.topup(kvm, meter);
        }
    }
}

/// The write-locked loop shared by GET (without manual protect), CLEAR and ring reset: for each
/// 64-page word, decide the mask to re-protect (and update the bitmap), then re-protect it.
struct ReprotectLoop<F: FnMut(&Memslot, usize) -> u64 + Send> {
    mmu: Arc<dyn Mmu>,
    slot: Arc<Memslot>,
    /// Word indexes still to visit, in order.
    words: std::ops::Range<usize>,
    /// Takes the mask of a word from the bitmap (the part of KVM's loop before
    /// `kvm_arch_mmu_enable_log_dirty_pt_masked()`).
    take_mask: F,
    current: Option<MaskedReprotect>,
    flush: bool,
    name: &'static str,
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
            if self.current.is_none() {
                let Some(i) = self.words.next() else {
                    return JobStep::Done { flush: self.flush };
                };
                meter.bitmap_words += 1;
                let mask = (self.take_mask)(&self.slot, i);
                if mask == 0 {
                    continue;
                }
                self.flush = true;
                self.current = Some(MaskedReprotect::new(
                    Arc::clone(&self.slot),
                    i as u64 * 64,
                    mask,
                ));
            }
            match self
                .current
                .as_mut()
                .expect("set above")
                .run(kvm, &*self.mmu, held, meter)
            {
                JobStep::Done { .. } => self.current = None,
                other => return other,
            }
        }
    }
    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if let Some(c) = self.current.as_mut() {
            c.topup(kvm, meter);
        }
    }
}

/// `KVM_GET_DIRTY_LOG` (`kvm_get_dirty_log_protect()`). With manual protect it only copies the
/// bitmap; otherwise, under the write lock, each non-zero word is exchanged for zero and its
/// pages re-protected, then the memslot is flushed. The bitmap lands in `out`.
pub fn get_dirty_log_plan(
    kvm: &Kvm,
    mmu: &Arc<dyn Mmu>,
    slot: &Arc<Memslot>,
    out: Arc<Mutex<Vec<u64>>>,
) -> OpPlan {
    let mut plan = OpPlan::default();
    *out.lock() = vec![0; slot.bitmap_words()];
    if kvm.manual_protect() {
        let s = Arc::clone(slot);
        plan.push(OpStep::Call(Box::new(move |_, meter| {
            let mut o = out.lock();
            for (i, w) in o.iter_mut().enumerate() {
                *w = s.bitmap_word(i).load(Ordering::SeqCst);
            }
            meter.bitmap_words += o.len() as u64;
        })));
        return plan;
    }
    plan.push(OpStep::Job(Box::new(ReprotectLoop {
        mmu: Arc::clone(mmu),
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
        current: None,
        flush: false,
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
    mmu: &Arc<dyn Mmu>,
    slot: &Arc<Memslot>,
    first_page: u64,
    num_pages: u64,
    bitmap: &[u64],
) -> Result<OpPlan, String> {
    check_clear_dirty_log_range(slot, first_page, num_pages)?;
    let nwords = num_pages.div_ceil(64) as usize;
    if bitmap.len() < nwords {
        return Err(format!(
            "the bitmap holds {} pages, fewer than num_pages {num_pages}",
            bitmap.len() * 64
        ));
    }
    let user: Vec<u64> = bitmap[..nwords].to_vec();
    let first_word = (first_page / 64) as usize;
    let mut plan = OpPlan::default();
    plan.push(OpStep::Job(Box::new(ReprotectLoop {
        mmu: Arc::clone(mmu),
        slot: Arc::clone(slot),
        words: first_word..first_word + nwords,
        take_mask: move |s: &Memslot, i| {
            let mask = user[i - first_word];
            if mask == 0 {
                return 0;
            }
            mask & s.bitmap_word(i).fetch_and(!mask, Ordering::SeqCst)
        },
        current: None,
        flush: false,
        name: "clear_dirty_log",
    })));
    plan.push(OpStep::FlushMemslotIfPending(Arc::clone(slot)));
    Ok(plan)
}

/// `KVM_RESET_DIRTY_RINGS`: every ring's harvested entries, coalesced into 64-page masks and
/// re-protected under the write lock; one flush if anything was reset. Returns the plan and the
/// number of entries reset.
pub fn reset_dirty_rings_plan(kvm: &Kvm, mmu: &Arc<dyn Mmu>) -> (OpPlan, u64) {
    let mut plan = OpPlan::default();
    let mut total = 0;
    let Some(rings) = kvm.dirty_rings.get() else {
        return (plan, 0);
    };
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
            // One ReprotectLoop per run: the mask is not word-aligned, so re-protect it
            // directly at its offset (kvm_reset_dirty_gfn()).
            plan.push(OpStep::Job(Box::new(RingReprotect {
                mmu: Arc::clone(mmu),
                inner: Some(MaskedReprotect::new(slot, base, mask)),
            })));
        }
    }
    if total > 0 {
        plan.push(OpStep::FlushIfPending);
    }
    (plan, total)
}

/// One coalesced ring run being re-protected.
struct RingReprotect {
    mmu: Arc<dyn Mmu>,
    inner: Option<MaskedReprotect>,
}

impl MmuJob for RingReprotect {
    fn name(&self) -> &'static str {
        "reset_dirty_gfn"
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        match self.inner.as_mut() {
            Some(m) => match m.run(kvm, &*self.mmu, held, meter) {
                JobStep::Done { flush } => {
                    self.inner = None;
                    JobStep::Done { flush }
                }
                other => other,
            },
            None => JobStep::Done { flush: false },
        }
    }
    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if let Some(m) = self.inner.as_mut() {
            m.topup(kvm, meter);
        }
    }
}
