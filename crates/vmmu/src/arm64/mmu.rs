//! KVM/arm64's stage-2 MMU behind KVM core's [`Mmu`] trait: the vCPU's hardware walk, the
//! stage-2 abort handler (`kvm_handle_guest_abort()` → `user_mem_abort()` or
//! `handle_access_fault()`) split at `mmu_lock`, with the lock regime of [`Arm64Lock`], unmap for
//! memslot deletion, and the invariants.

use crate::arm64::mm::Stage2MemCache;
use crate::arm64::pgtable::{
    IpaSizeError, KvmPgtable, KvmPgtableProt, MapWalker, PgtError, RacyHold, RelaxBy, Stage2Mapping,
};
use crate::arm64::{Arm64Cpu, Arm64Lock, RelaxFlush};
use crate::host::memory::HostMemory;
use crate::hw::page_table::PageTableStats;
use crate::hw::pgtable::walk::descend;
use crate::hw::pgtable::{PtFormat, PtGeometry};
use crate::hw::stage2::*;
use crate::hw::walker::{leaf_run, RangeWalk, RunLeaf, RunStep, WalkResult};
use crate::kvm::host_fault::Faultin;
use crate::kvm::memory_cache::KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE;
use crate::kvm::memslot::{Memslot, KVM_MEM_READONLY};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{FaultError, FaultStart, GuestFault, Mmu, RetPf, VcpuMmu};
use crate::kvm::mmu_lock::{Held, LockKind, LockMode, MmuLockHeld, Write};
use crate::kvm::Kvm;
use crate::units::{Gfn, GfnRange, PageSize, Pfn};
use crossbeam_epoch::{self as epoch, Guard};
use std::sync::Arc;

/// The stage-2 MMU of one VM (`struct kvm_s2_mmu` with its `kvm_pgtable`).
pub struct Stage2Mmu {
    /// The page tables.
    pub pgt: Arc<KvmPgtable>,
    /// Which kernel's `mmu_lock` discipline faults follow.
    pub lock: Arm64Lock,
    /// `kvm->arch.mmu.split_page_chunk_size` in 4 KiB pages (`KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE`;
    /// 0: eager splitting off, KVM's default).
    pub split_chunk_pages: u64,
    /// `kvm->arch.mmu.split_page_cache`: the pages eager splitting takes tables from, topped
    /// up with the lock dropped and kept between splits until logging is disabled. Only used
    /// under the write lock (the mutex is never contended).
    pub split_cache: Arc<parking_lot::Mutex<Stage2MemCache>>,
    /// How a relaxed permission is invalidated.
    pub relax_flush: RelaxFlush,
}

impl Drop for Stage2Mmu {
    fn drop(&mut self) {
        // kvm_mmu_free_memory_cache() of the split cache, so the table counters balance.
        self.split_cache.lock().free_all(&self.pgt.stats);
    }
}

/// A fault between its halves: what `user_mem_abort()` decided before taking `mmu_lock`.
#[derive(Clone)]
struct Stage2Fault {
    kind: FaultKind,
    /// The memslot as the fault looked it up.
    slot: Arc<Memslot>,
    /// The first gfn of the mapping (`fault_ipa` aligned down to `vma_pagesize`).
    gfn: Gfn,
    /// `vma_pagesize`.
    size: PageSize,
    /// The host frame of `gfn`.
    pfn: Pfn,
    /// Map writable (`writable`: a read fault while logging maps read-only).
    writable: bool,
    /// `fault_status == FSC_PERM && vma_pagesize == fault_granule`: relax instead of map.
    relax: bool,
    /// `logging_active` in the memslot the fault saw.
    logging: bool,
    /// The faulting vCPU (`kvm_get_running_vcpu()`: its dirty ring takes the page).
    vcpu: usize,
    /// `mmu_seq`: the invalidation sequence before the page was looked up.
    mmu_seq: u64,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum FaultKind {
    /// `user_mem_abort()`.
    Abort,
    /// `handle_access_fault()`: set AF under the read lock.
    AccessFlag,
}

/// A vCPU's stage-2 state: `vcpu->arch.mmu_page_cache` and the fault in flight.
pub struct Stage2VcpuMmu {
    mc: Stage2MemCache,
    fault: Option<Stage2Fault>,
    stats: Arc<PageTableStats>,
}

impl VcpuMmu for Stage2VcpuMmu {
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn free_memory_caches(&mut self, _kvm: &Kvm) {
        self.mc.free_all(&self.stats);
    }
}

fn stage2_vcpu(v: &mut dyn VcpuMmu) -> &mut Stage2VcpuMmu {
    v.as_any_mut()
        .downcast_mut()
        .expect("a stage-2 MMU's vCPU state")
}

impl Stage2Mmu {
    /// `kvm_init_stage2_mmu()` for a VM with `ia_bits` of IPA on a CPU with `cpu`'s features.
    pub fn new(
        kvm: &Kvm,
        ia_bits: u32,
        lock: Arm64Lock,
        split_chunk_pages: u64,
        cpu: Arm64Cpu,
        relax_flush: RelaxFlush,
    ) -> Result<Self, IpaSizeError> {
        let mut pgt = KvmPgtable::new(ia_bits, Arc::clone(&kvm.tables))?;
        pgt.cpu = cpu;
        let capacity = crate::arm64::arch::kvm_mmu_split_nr_page_tables(split_chunk_pages);
        Ok(Stage2Mmu {
            pgt: Arc::new(pgt),
            lock,
            split_chunk_pages,
            split_cache: Arc::new(parking_lot::Mutex::new(Stage2MemCache::new(capacity, 0))),
            relax_flush,
        })
    }

    /// `kvm_mmu_cache_min_pages()`: the tables one fault may need (every level below the
    /// start level).
    pub fn cache_min_pages(&self) -> usize {
        (KVM_PGTABLE_LAST_LEVEL.0 - self.pgt.start_level.0) as usize
    }

    /// Counts the abort by its fault status code, as the ESR reports it.
    fn count_abort(exit: &GuestFault, access_flag: bool, m: &mut Meter) {
        let field = match (exit.present, access_flag, exit.level.0) {
            (true, true, _) => &mut m.s2_access_fault,
            (true, false, 1) => &mut m.s2_perm_fault_l1,
            (true, false, 2) => &mut m.s2_perm_fault_l2,
            (true, false, _) => &mut m.s2_perm_fault_l3,
            (false, _, 0) => &mut m.s2_xlat_fault_l0,
            (false, _, 1) => &mut m.s2_xlat_fault_l1,
            (false, _, 2) => &mut m.s2_xlat_fault_l2,
            (false, _, _) => &mut m.s2_xlat_fault_l3,
        };
        *field += 1;
    }
}

impl Mmu for Stage2Mmu {
    fn name(&self) -> &'static str {
        "stage2"
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Without hardware Access-flag and dirty-state management the walk changes nothing: every
    /// leaf must only allow the access.
    fn range_walks_private(
        &self,
        _range: GfnRange,
        check: GfnRange,
        write: bool,
        budget: &mut u64,
    ) -> RangeWalk {
        let guard = epoch::pin();
        self.pgt.range_walks_complete(check, &guard, budget, |pte| {
            s2_allows(pte, write) == S2Outcome::Allowed
        })
    }

    fn hw_walk(
        &self,
        gfn: Gfn,
        write: bool,
        _pml_full: bool,
        guard: &Guard,
        levels_read: &mut u64,
    ) -> WalkResult {
        // arm64 has no page-modification log: `_pml_full` is never set.
        let Some(root) = self.pgt.pgd_for(gfn) else {
            return WalkResult::Violation {
                level: self.pgt.start_level,
                present: false,
                access_flag: false,
            };
        };
        // SAFETY: the PGD lives as long as the MMU, tables below it are freed through RCU, and
        // the caller keeps `guard` pinned for the walk.
        let (_, pte, level) = unsafe {
            descend::<Stage2>(
                root,
                self.pgt.start_level,
                gfn,
                guard,
                levels_read,
                |_, _| false,
            )
        };
        match s2_allows(pte, write) {
            S2Outcome::Allowed => WalkResult::Translated {
                size: level_page_size(level),
                leaf_pfn: Stage2::leaf_pfn(pte),
                writable: pte & KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W != 0,
                // No hardware dirty-state management: a write through a writable entry changes
                // nothing in it.
                dirty: true,
                dirtied: false,
            },
            S2Outcome::Translation => WalkResult::Violation {
                level,
                present: false,
                access_flag: false,
            },
            S2Outcome::Permission => WalkResult::Violation {
                level,
                present: true,
                access_flag: false,
            },
            S2Outcome::AccessFlag => WalkResult::Violation {
                level,
                present: true,
                access_flag: true,
            },
        }
    }

    fn hw_walk_leaf_run(
        &self,
        first: Gfn,
        n: u64,
        write: bool,
        _log_room: u64,
        guard: &Guard,
        each: &mut dyn FnMut(RunLeaf) -> bool,
    ) -> u64 {
        let Some(root) = self.pgt.pgd_for(first) else {
            return 0;
        };
        // SAFETY: as in hw_walk(): the PGD lives as long as the MMU, tables below it are freed
        // through RCU, and the caller keeps `guard` pinned for the run.
        unsafe {
            leaf_run::<Stage2>(
                root,
                self.pgt.start_level,
                first,
                n,
                guard,
                |_, _| false,
                |gfn, _, pte| {
                    // As hw_walk(): an allowed leaf is used as it is.
                    if s2_allows(pte, write) != S2Outcome::Allowed {
                        return RunStep::Refused;
                    }
                    let leaf = RunLeaf {
                        gfn,
                        leaf_pfn: Stage2::leaf_pfn(pte),
                        writable: pte & KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W != 0,
                        dirty: true,
                        dirtied: false,
                    };
                    if each(leaf) {
                        RunStep::Next
                    } else {
                        RunStep::Last
                    }
                },
            )
        }
    }

    fn tlb_geometry(&self) -> &'static crate::hw::tlb::TlbGeometry {
        &crate::hw::tlb::NEOVERSE_N1
    }

    fn stage2_walk_levels(&self) -> u64 {
        // From the start level the IPA size gives down to level 3.
        (KVM_PGTABLE_LAST_LEVEL.0 - self.pgt.start_level.0 + 1) as u64
    }

    fn host_cache_shape(&self) -> &'static crate::hw::cache::HostCacheShape {
        &crate::hw::cache::AMPERE_ALTRA
    }

    fn create_vcpu_mmu(&self) -> Box<dyn VcpuMmu> {
        Box::new(Stage2VcpuMmu {
            mc: Stage2MemCache::new(KVM_ARCH_NR_OBJS_PER_MEMORY_CACHE, Stage2::INVALID),
            fault: None,
            stats: Arc::clone(&self.pgt.stats),
        })
    }

    /// `kvm_handle_guest_abort()` and `user_mem_abort()` up to `mmu_lock`: the memslot,
    /// `logging_active`, the memory-cache top-up, `vma_pagesize` (4K while logging, else the
    /// backing's page within the slot's alignment), the writable decision, and the lock mode
    /// of the regime.
    fn begin_fault(
        &self,
        kvm: &Kvm,
        vcpu_mmu: &mut dyn VcpuMmu,
        exit: &GuestFault,
        meter: &mut Meter,
    ) -> Result<FaultStart, FaultError> {
        if exit.op != crate::kvm::mmu::GuestOp::Access {
            return Err(FaultError::NestedOnArm64 {
                vcpu: exit.vcpu,
                op: exit.op,
            });
        }
        let v = stage2_vcpu(vcpu_mmu);
        debug_assert!(v.fault.is_none(), "a fault's slow half was abandoned");
        let guard = epoch::pin();
        // The ESR's fault status code tells an access-flag fault from a permission fault.
        let access_flag = exit.access_flag;
        if exit.after_host_fault.is_none() {
            Self::count_abort(exit, access_flag, meter);
        }
        let Some(slot) = kvm.gfn_to_memslot(exit.addr, &guard).cloned() else {
            return Err(FaultError::AbortOutsideMemslots {
                vcpu: exit.vcpu,
                ipa: ipa(exit.addr),
            });
        };
        let readonly = slot.flags() & KVM_MEM_READONLY != 0;
        if exit.write && readonly {
            return Err(FaultError::WriteToReadOnlySlot {
                vcpu: exit.vcpu,
                slot: slot.id,
                ipa: ipa(exit.addr),
            });
        }
        // memslot_is_logging(): a dirty bitmap and not read-only.
        let logging = slot.dirty_track_enabled() && !readonly;
        if access_flag {
            v.fault = Some(Stage2Fault {
                kind: FaultKind::AccessFlag,
                gfn: exit.addr,
                size: PageSize::Size4K,
                pfn: slot.gfn_to_pfn(exit.addr),
                writable: false,
                relax: false,
                logging,
                slot,
                vcpu: exit.vcpu,
                // handle_access_fault() changes no PFN, so it has no retry check.
                mmu_seq: 0,
            });
            // handle_access_fault(): mkyoung under the write lock until 6.1, the read lock since
            // 6.2's parallel faults.
            return Ok(FaultStart::Slow(if self.lock == Arm64Lock::Parallel {
                LockMode::Read
            } else {
                LockMode::Write
            }));
        }
        let fault_is_perm = exit.present;
        let fault_granule = Stage2Geometry::pages(exit.level);
        // Permission faults only update a leaf and need no table, except a logging write that
        // must replace a block with a table.
        if !fault_is_perm || (logging && exit.write) {
            let n = v.mc.topup(self.cache_min_pages(), &self.pgt.stats);
            meter.tables_allocated += n as u64;
        }
        let size = if logging {
            // force_pte: dirty logging tracks 4K pages.
            PageSize::Size4K
        } else if slot.backing.is_hugetlb() {
            // A hugetlb VMA's page size, as far as the memslot's alignment allows
            // (fault_supports_stage2_huge_mapping()).
            kvm.max_mapping_size(&slot, exit.addr)
        } else if fault_is_perm && fault_granule > 1 {
            // vma_pagesize == PAGE_SIZE: a permission fault on a block keeps the block's size.
            level_page_size(exit.level).min(kvm.max_mapping_size(&slot, exit.addr))
        } else {
            // transparent_hugepage_adjust(): a THP-backed page maps as a block where aligned.
            kvm.max_mapping_size(&slot, exit.addr)
        };
        let gfn = size.round(exit.addr);
        // Only a write fault maps writable while logging, so reads do not hide later writes.
        let mut writable = !readonly && (!logging || exit.write);
        let relax = fault_is_perm && size.pages() == fault_granule;
        let mode = match self.lock {
            Arm64Lock::Spin => LockMode::Write,
            // Seed 001 v2 / 5.18-rc1: logging_perm_fault = FSC_PERM && write, any granule.
            Arm64Lock::PermFastPathV2 => {
                if logging && fault_is_perm && exit.write {
                    LockMode::Read
                } else {
                    LockMode::Write
                }
            }
            // Linux 5.18-6.1: use_read_lock = logging && FSC_PERM && write && granule == 4K.
            Arm64Lock::PermFastPath => {
                if logging && fault_is_perm && exit.write && fault_granule == 1 {
                    LockMode::Read
                } else {
                    LockMode::Write
                }
            }
            Arm64Lock::Parallel => LockMode::Read,
        };
        // mmu_seq = kvm->mmu_invalidate_seq; smp_rmb(); then __kvm_faultin_pfn() (kept from
        // before the host faulted the page in, when it did).
        let mmu_seq = exit
            .after_host_fault
            .unwrap_or_else(|| kvm.mmu_invalidate.snapshot());
        let page = slot.gfn_to_pfn(exit.addr);
        kvm.place_first_touch(&slot, page);
        let pfn = match kvm.faultin_pfn(slot.gfn_to_pfn(gfn), page, exit.write, mmu_seq, meter) {
            Faultin::Mapped {
                pfn,
                writable: host_writable,
            } => {
                // The host maps the zero page read-only: KVM does too.
                writable &= host_writable;
                pfn
            }
            Faultin::Host(h) => return Ok(FaultStart::Host(h)),
            Faultin::NoMemory => return Ok(FaultStart::Done(RetPf::NoMemory)),
        };
        v.fault = Some(Stage2Fault {
            kind: FaultKind::Abort,
            mmu_seq,
            pfn,
            slot,
            gfn,
            size,
            writable,
            relax,
            logging,
            vcpu: exit.vcpu,
        });
        Ok(FaultStart::Slow(mode))
    }

    /// `user_mem_abort()` under `mmu_lock`: `kvm_pgtable_stage2_relax_perms()` for a permission
    /// fault at the mapping's own size, else `kvm_pgtable_stage2_map()`; then
    /// `mark_page_dirty_in_slot()` if the mapping is writable. `-EAGAIN` re-enters the guest.
    /// Under the lock, `mmu_invalidate_retry()` first: an invalidation open or ended since the
    /// page was looked up sends the vCPU back to fault again. Simplified: no
    /// `mmap_read_lock()`/`vma_lookup()` before it (the memslot's backing stands for the VMA).
    fn page_fault(
        &self,
        kvm: &Kvm,
        vcpu_mmu: &mut dyn VcpuMmu,
        held: &MmuLockHeld,
        meter: &mut Meter,
    ) -> RetPf {
        let v = stage2_vcpu(vcpu_mmu);
        let f = v.fault.take().expect("begin_fault() left a fault");
        if f.kind == FaultKind::Abort && kvm.mmu_invalidate.retry(f.mmu_seq) {
            return RetPf::Retry;
        }
        let guard = epoch::pin();
        // Shared walks (cmpxchg) only where the kernel made several faults' changes safe
        // together (6.2+); seed 001 v2 maps under the read lock with the exclusive walker.
        let shared = self.lock == Arm64Lock::Parallel;
        let walker = if shared {
            MapWalker::Shared
        } else if held.mode() == LockMode::Read {
            MapWalker::ExclusiveUnderReadLock(RacyHold {
                vcpu: f.vcpu,
                virtual_start: held.virtual_start_ps(),
            })
        } else {
            MapWalker::Exclusive
        };
        let ret = match f.kind {
            FaultKind::AccessFlag => self
                .pgt
                .kvm_pgtable_stage2_mkyoung(f.gfn, shared, &guard, meter)
                .map(|()| true),
            FaultKind::Abort => {
                // A data abort maps non-executable (exec_fault is false; the CPU is assumed to
                // lack CTR_EL0.DIC, which would make KVM map executable too).
                let prot = KvmPgtableProt {
                    r: true,
                    w: f.writable,
                    x: false,
                };
                if f.relax {
                    let how = RelaxBy {
                        shared,
                        flush: self.relax_flush,
                        vcpu: f.vcpu,
                    };
                    self.pgt
                        .kvm_pgtable_stage2_relax_perms(kvm, f.gfn, prot, how, &guard, meter)
                } else {
                    // The 5.18-rc fix's WARN_ONCE("Attempted stage-2 map outside of write lock"),
                    // which seed 001 v2 did not have.
                    debug_assert!(
                        shared
                            || held.mode() == LockMode::Write
                            || self.lock == Arm64Lock::PermFastPathV2,
                        "stage-2 map outside of the write lock"
                    );
                    self.pgt
                        .kvm_pgtable_stage2_map(
                            kvm,
                            Stage2Mapping {
                                gfn: f.gfn,
                                size: f.size,
                                pfn: f.pfn,
                                prot,
                            },
                            &mut v.mc,
                            walker,
                            &guard,
                            meter,
                        )
                        .map(|()| true)
                }
            }
        };
        match ret {
            Ok(changed) => {
                if f.kind == FaultKind::Abort && f.writable {
                    kvm.mark_page_dirty_in_slot(&f.slot, f.gfn, f.logging, Some(f.vcpu), meter);
                }
                // A relaxation another vCPU's fault made first: the vCPUs met on the page.
                if changed {
                    RetPf::Fixed
                } else {
                    RetPf::Spurious
                }
            }
            // -EAGAIN: the entry needed no update, or another walker had it: another vCPU's
            // fault got there first (user_mem_abort() returns 0 and the guest runs on).
            Err(PgtError::Again) => RetPf::Spurious,
            Err(e) => {
                debug_assert!(false, "stage-2 fault failed with {e:?} after its top-up");
                RetPf::Retry
            }
        }
    }

    /// `kvm_unmap_gfn_range()` → `__unmap_stage2_range()`: each leaf is invalidated as it is
    /// cleared, so nothing is owed.
    fn zap_gfn_range(
        &self,
        kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        _held: Held<'_, Write>,
        meter: &mut Meter,
    ) -> Option<GfnRange> {
        let guard = epoch::pin();
        let _ = self
            .pgt
            .kvm_pgtable_stage2_unmap(kvm, start, end, &guard, meter);
        None
    }

    /// Linux 6.1's `kvm_set_spte_gfn()`: the page moved (copy-on-write), so map the new one
    /// read-only at once, as a translation fault would, with no memory cache
    /// (`kvm_pgtable_stage2_map(..., KVM_PGTABLE_PROT_R, NULL, 0)`): `invalidate_range_start`
    /// left the table that held the old leaf in place, and if it did not, the map fails and
    /// the guest's next access faults instead (the error is ignored, as KVM does).
    fn set_spte_gfn(
        &self,
        kvm: &Kvm,
        gfn: Gfn,
        pfn: Pfn,
        _held: Held<'_, Write>,
        meter: &mut Meter,
    ) {
        let guard = epoch::pin();
        let mut no_cache = Stage2MemCache::new(0, Stage2::INVALID);
        let prot = KvmPgtableProt {
            r: true,
            w: false,
            x: false,
        };
        let map = Stage2Mapping {
            gfn,
            size: PageSize::Size4K,
            pfn,
            prot,
        };
        let _ = self.pgt.kvm_pgtable_stage2_map(
            kvm,
            map,
            &mut no_cache,
            MapWalker::Exclusive,
            &guard,
            meter,
        );
    }

    fn age_gfn_range(
        &self,
        _kvm: &Kvm,
        start: Gfn,
        end: Gfn,
        young: &mut dyn FnMut(Gfn, u64) -> bool,
        held: Option<Held<'_, Write>>,
        meter: &mut Meter,
    ) -> bool {
        // kvm_age_gfn() / kvm_test_age_gfn() under the write lock, or the seed's
        // kvm_arch_test_clear_young() as a shared walk under RCU.
        let guard = epoch::pin();
        self.pgt
            .stage2_age_range(start, end, held.is_none(), young, &guard, meter)
    }

    fn lockless_test_clear_young(&self) -> bool {
        // The seed's arm64 part: hardware AF updates (FEAT_HAFDBS, which the modelled N1 has)
        // and stage-2 tables freed through RCU, which the model's tables always are.
        true
    }

    fn check_invariants(&self, kvm: &Kvm) -> Vec<String> {
        let guard = epoch::pin();
        let mut errors = Vec::new();
        let logging_bitmaps = kvm.dirty_rings.get().is_none();
        let refcounts = self.pgt.for_each_entry(|gfn, level, pte| {
            if errors.len() > 32 {
                return;
            }
            if stage2_pte_is_locked(pte) {
                errors.push(format!(
                    "{gfn:?} at {level:?}: left locked (break without make)"
                ));
                return;
            }
            if !Stage2::is_leaf(pte, level) {
                return;
            }
            let Some(slot) = kvm.gfn_to_memslot(gfn, &guard) else {
                errors.push(format!("{gfn:?} at {level:?}: leaf outside every memslot"));
                return;
            };
            if kvm.host_pfn(slot, gfn) != Stage2::leaf_pfn(pte) {
                errors.push(format!(
                    "{gfn:?} at {level:?}: leaf maps {:?}, memslot says {:?}",
                    Stage2::leaf_pfn(pte),
                    kvm.host_pfn(slot, gfn)
                ));
            }
            if level_page_size(level) > kvm.max_mapping_size(slot, gfn) {
                errors.push(format!(
                    "{gfn:?}: {:?} leaf where the memslot allows {:?}",
                    level_page_size(level),
                    kvm.max_mapping_size(slot, gfn)
                ));
            }
            if HostMemory::is_zero_pfn(Stage2::leaf_pfn(pte))
                && pte & KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W != 0
            {
                errors.push(format!("{gfn:?}: maps the host's zero page writable"));
            }
            if logging_bitmaps && pte & KVM_PTE_LEAF_ATTR_LO_S2_S2AP_W != 0 {
                if let Err(e) = slot.check_writable_leaf_is_dirty(gfn, Stage2Geometry::pages(level))
                {
                    errors.push(e.to_string());
                }
            }
        });
        errors.extend(refcounts);
        let (lost, first) = self.pgt.lost_updates();
        if lost != 0 {
            errors.push(format!(
                "{lost} stage-2 entries overwritten by a walker that had read another value; the first: {}",
                first.unwrap_or_default()
            ));
        }
        let bbm = self.pgt.bbm_violations();
        if bbm != 0 {
            errors.push(format!(
                "{bbm} valid leaves changed output address without break-before-make"
            ));
        }
        errors
    }

    fn mmu_lock_kind(&self) -> LockKind {
        match self.lock {
            // arm64 up to 5.17: kvm->mmu_lock is a spinlock_t.
            Arm64Lock::Spin => LockKind::Spinlock,
            Arm64Lock::PermFastPathV2 | Arm64Lock::PermFastPath | Arm64Lock::Parallel => {
                LockKind::Rwlock
            }
        }
    }

    fn fault_hold_ended(&self, vcpu: usize, end_ps: u64) {
        if self.lock == Arm64Lock::PermFastPathV2 {
            self.pgt.racy_hold_ended(vcpu, end_ps);
        }
    }

    fn page_stats(&self) -> [i64; 3] {
        let mut n = [0i64; 3];
        let _ = self.pgt.for_each_entry(|_, level, pte| {
            if Stage2::is_leaf(pte, level) {
                n[3 - level.0 as usize] += 1;
            }
        });
        n
    }
}
