//! arm64's KVM architecture hooks ([`KvmArch`]): flushes by broadcast TLBI of the VMID or, with
//! FEAT_TLBIRANGE, of a range (so write-protecting a memslot flushes only the memslot), what `kvm_arch_commit_memory_region()` does when
//! dirty logging starts (write-protect the slot, flush, and with eager splitting split it), and
//! `kvm_arch_mmu_enable_log_dirty_pt_masked()` (`stage2_wp_range()` of the mask's span, and
//! eager splitting of it under initially-all-set).

use crate::arm64::mm::Stage2MemCache;
use crate::arm64::mmu::Stage2Mmu;
use crate::arm64::pgtable::{KvmPgtable, PgtError};
use crate::arm64::tlb::{kvm_tlb_flush_vmid, kvm_tlb_flush_vmid_range};
use crate::kvm::arch::{EnableLogDirtyPtMasked, KvmArch};
use crate::kvm::memslot::{dirty_logging_change, Memslot, KVM_MEM_READONLY};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{JobStep, MmuJob};
use crate::kvm::mmu_lock::{LockMode, MmuLockHeld};
use crate::kvm::op_plan::OpStep;
use crate::kvm::Kvm;
use crate::units::{Gfn, GfnRange, PageSize};
use crossbeam_epoch as epoch;
use std::sync::Arc;

/// arm64's hooks over the VM's stage-2 MMU.
pub struct Arm64Arch {
    mmu: Arc<Stage2Mmu>,
}

impl Arm64Arch {
    /// The hooks of a VM whose MMU is `mmu`.
    pub fn new(mmu: Arc<Stage2Mmu>) -> Self {
        Arm64Arch { mmu }
    }
}

impl KvmArch for Arm64Arch {
    fn flush_remote_tlbs(&self, kvm: &Kvm, meter: &mut Meter) -> bool {
        // kvm_arch_flush_remote_tlbs() (kvm_flush_remote_tlbs() in 6.1):
        // __kvm_tlb_flush_vmid(), a broadcast TLBI with no IPI.
        kvm_tlb_flush_vmid(kvm, meter);
        true
    }

    fn flush_remote_tlbs_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        pages: u64,
        meter: &mut Meter,
    ) -> bool {
        // kvm_arch_flush_remote_tlbs_range() (Linux 6.6) with FEAT_TLBIRANGE. Without it the
        // model declines, so KVM core flushes the whole VMID as it did before the series (6.6
        // itself does the same through kvm_tlb_flush_vmid_range()'s fallback).
        if !self.mmu.pgt.cpu.tlbi_range {
            return false;
        }
        kvm_tlb_flush_vmid_range(kvm, self.mmu.pgt.cpu, start, pages, meter);
        true
    }

    fn mmu_slot_apply_flags(
        &self,
        kvm: &Kvm,
        slot: &Arc<Memslot>,
        old_flags: u32,
        new_flags: u32,
    ) -> Vec<OpStep> {
        let mut steps = Vec::new();
        let (enable, _) = dirty_logging_change(old_flags, new_flags);
        if !enable || new_flags & KVM_MEM_READONLY != 0 {
            // Disabling logging changes nothing in stage 2: pages coalesce back into blocks
            // as faults map them. kvm_arch_commit_memory_region() frees the split cache.
            let cache = Arc::clone(&self.mmu.split_cache);
            steps.push(OpStep::Call(Box::new(move |kvm: &Kvm, _: &mut Meter| {
                cache.lock().free_all(&kvm.tables)
            })));
            return steps;
        }
        // With initially-all-set, CLEAR write-protects (and splits) gradually.
        if kvm.dirty_log_manual_protect_and_init_set() {
            return steps;
        }
        // kvm_mmu_wp_memory_region(): stage2_wp_range() under the write lock, then a flush.
        steps.push(OpStep::Job(Box::new(WpRangeJob::new(
            Arc::clone(&self.mmu.pgt),
            slot.base_gfn,
            slot.end_gfn(),
        ))));
        steps.push(OpStep::FlushMemslot(Arc::clone(slot)));
        // kvm_mmu_split_memory_region() (6.4): under the write lock, in chunks.
        if self.mmu.split_chunk_pages != 0 {
            steps.push(OpStep::Job(Box::new(SplitHugePagesJob::new(
                &self.mmu,
                slot.base_gfn,
                slot.end_gfn(),
            ))));
        }
        steps
    }

    fn enable_log_dirty_pt_masked(&self) -> Box<dyn EnableLogDirtyPtMasked> {
        Box::new(MaskedWrprotect {
            mmu: Arc::clone(&self.mmu),
            range: None,
            split: None,
        })
    }
}

/// `stage2_range_addr_end()` with a chunk of `pages`: the end of the chunk holding `at`, or
/// `end`.
fn stage2_range_addr_end(at: Gfn, end: Gfn, pages: u64) -> Gfn {
    Gfn(((at.0 / pages) + 1) * pages).min(end)
}

/// `stage2_wp_range()`: `kvm_pgtable_stage2_wrprotect()` applied a 1 GiB chunk at a time
/// (`stage2_apply_range_resched()`), yielding the write lock between chunks when contended.
pub struct WpRangeJob {
    pgt: Arc<KvmPgtable>,
    at: Gfn,
    end: Gfn,
}

impl WpRangeJob {
    /// Write-protects `[start, end)`.
    pub fn new(pgt: Arc<KvmPgtable>, start: Gfn, end: Gfn) -> Self {
        WpRangeJob {
            pgt,
            at: start,
            end,
        }
    }
}

impl MmuJob for WpRangeJob {
    fn name(&self) -> &'static str {
        "stage2_wp_range"
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, _kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let held = held.write();
        let guard = epoch::pin();
        let chunk = PageSize::Size1G.pages();
        loop {
            let next = stage2_range_addr_end(self.at, self.end, chunk);
            self.pgt
                .kvm_pgtable_stage2_wrprotect(self.at, next, &guard, meter);
            self.at = next;
            if self.at >= self.end {
                return JobStep::Done { flush: None };
            }
            // cond_resched_rwlock_write() between chunks.
            if held.needbreak(meter) {
                return JobStep::Yield;
            }
        }
    }
}

/// `kvm_mmu_split_nr_page_tables()`: the tables splitting `pages` of blocks down to pages needs
/// (one per 1 GiB and one per 2 MiB).
pub fn kvm_mmu_split_nr_page_tables(pages: u64) -> usize {
    (pages.div_ceil(PageSize::Size1G.pages()) + pages.div_ceil(PageSize::Size2M.pages())) as usize
}

/// `kvm_mmu_split_huge_pages()` (Linux 6.4): splits every block in the range under the write
/// lock, `split_page_chunk_size` at a time; before each chunk, if someone waits for the lock or
/// the split cache holds less than a chunk needs, drops the lock and tops the cache up to a
/// chunk's worth (`need_split_memcache_topup_or_resched()`). The cache is the VM's
/// (`kvm->arch.mmu.split_page_cache`, [`Stage2Mmu::split_cache`]): what one split leaves in it
/// serves the next.
pub struct SplitHugePagesJob {
    pgt: Arc<KvmPgtable>,
    at: Gfn,
    end: Gfn,
    chunk_pages: u64,
    cache: Arc<parking_lot::Mutex<Stage2MemCache>>,
    /// The lock was just retaken: split one chunk before checking again (forward progress).
    resumed: bool,
}

impl SplitHugePagesJob {
    /// Splits `[start, end)` with `mmu`'s chunk size.
    pub fn new(mmu: &Stage2Mmu, start: Gfn, end: Gfn) -> Self {
        let chunk_pages = mmu.split_chunk_pages;
        SplitHugePagesJob {
            pgt: Arc::clone(&mmu.pgt),
            at: start,
            end,
            chunk_pages,
            cache: Arc::clone(&mmu.split_cache),
            resumed: false,
        }
    }

    fn capacity(&self) -> usize {
        kvm_mmu_split_nr_page_tables(self.chunk_pages)
    }
}

impl MmuJob for SplitHugePagesJob {
    fn name(&self) -> &'static str {
        "kvm_mmu_split_huge_pages"
    }
    fn lock_mode(&self) -> LockMode {
        LockMode::Write
    }
    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let held = held.write();
        let guard = epoch::pin();
        while self.at < self.end {
            if !self.resumed {
                if held.needbreak(meter) {
                    self.resumed = true;
                    return JobStep::Yield;
                }
                if self.cache.lock().nr_objs() < self.capacity() {
                    self.resumed = true;
                    return JobStep::NeedTopup;
                }
            }
            self.resumed = false;
            let next = stage2_range_addr_end(self.at, self.end, self.chunk_pages);
            match self.pgt.kvm_pgtable_stage2_split(
                kvm,
                self.at,
                next,
                &mut self.cache.lock(),
                &guard,
                meter,
            ) {
                Ok(()) => self.at = next,
                // The chunk needed more than a chunk's worth (a block larger than the chunk):
                // top up and resume where the walk stopped (the split blocks stay split).
                Err(PgtError::NoMem) => {
                    self.resumed = true;
                    return JobStep::NeedTopup;
                }
                Err(e) => unreachable!("an exclusive split walk failed with {e:?}"),
            }
        }
        // Each block was broken with its own TLBI; nothing is owed.
        JobStep::Done { flush: None }
    }
    fn topup(&mut self, _kvm: &Kvm, meter: &mut Meter) {
        let cap = self.capacity();
        meter.tables_allocated += self.cache.lock().topup(cap, &self.pgt.stats) as u64;
    }
}

/// `kvm_arch_mmu_enable_log_dirty_pt_masked()`: `stage2_wp_range()` over the span of the mask
/// (first to last set bit), then with initially-all-set and eager splitting on, splitting that
/// span (`kvm_mmu_split_huge_pages()`). The caller holds the write lock and flushes.
struct MaskedWrprotect {
    mmu: Arc<Stage2Mmu>,
    range: Option<(Gfn, Gfn)>,
    split: Option<SplitHugePagesJob>,
}

impl EnableLogDirtyPtMasked for MaskedWrprotect {
    fn start(&mut self, slot: &Arc<Memslot>, gfn_offset: u64, mask: u64) {
        let base = slot.base_gfn.0 + gfn_offset;
        let start = Gfn(base + mask.trailing_zeros() as u64);
        let end = Gfn(base + 64 - mask.leading_zeros() as u64);
        self.range = Some((start, end));
        self.split = None;
    }

    fn run(&mut self, kvm: &Kvm, held: &MmuLockHeld, meter: &mut Meter) -> JobStep {
        let held = held.write();
        let (start, end) = self.range.expect("start() before run()");
        if self.split.is_none() {
            let guard = epoch::pin();
            self.mmu
                .pgt
                .kvm_pgtable_stage2_wrprotect(start, end, &guard, meter);
            if self.mmu.split_chunk_pages != 0 && kvm.dirty_log_manual_protect_and_init_set() {
                self.split = Some(SplitHugePagesJob::new(&self.mmu, start, end));
            }
        }
        if let Some(split) = self.split.as_mut() {
            match split.run(kvm, &held, meter) {
                JobStep::Done { .. } => {}
                other => return other,
            }
        }
        JobStep::Done {
            flush: Some(GfnRange { start, end }),
        }
    }

    fn topup(&mut self, kvm: &Kvm, meter: &mut Meter) {
        if let Some(s) = self.split.as_mut() {
            s.topup(kvm, meter);
        }
    }
}
