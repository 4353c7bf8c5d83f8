//! A KVM fault whose page the host must fault in first: `__gfn_to_pfn_memslot()` →
//! `hva_to_pfn_slow()` → `get_user_pages()` → `handle_mm_fault()` on private anonymous memory
//! ([`crate::host::anon`]), and what the host tells KVM through the MMU notifier when it copies
//! the zero page.
//!
//! - **Read of an untouched page**: `do_anonymous_page()` maps the shared zero page read-only;
//!   `hva_to_pfn()` returns it not writable (its `get_user_page_fast_only(FOLL_WRITE)` retry
//!   fails), so KVM maps it read-only. With [`ZeroPage::Off`] (`mm_forbids_zeropage()`), it
//!   allocates a page as a write does.
//! - **Write of an untouched page**: a page is allocated and cleared, and mapped writable. If a
//!   read mapped the zero page while the allocation ran, `vmf_pte_changed()` backs out and the
//!   write copies the zero page instead.
//! - **Write over the zero page**: `wp_page_copy()` allocates and copies, then
//!   `mmu_notifier_invalidate_range_start()` (KVM zaps the page's mappings: `kvm_unmap_hva_range`),
//!   replaces the PTE with `set_pte_at_notify()`, whose `change_pte` callback KVM handles
//!   (`kvm_set_spte_hva`: [`Mmu::set_spte_gfn`]) on the kernels that still had it, and
//!   `mmu_notifier_invalidate_range_end()`. Each callback takes `mmu_lock` for write
//!   (`__kvm_handle_hva_range()`). The fault snapshotted `mmu_invalidate_seq` before the host
//!   ran, so it finds its own invalidation and retries: the guest faults again.
//!
//! - **Transparent huge pages**: a read of an untouched 2 MiB maps the huge zero folio, and KVM
//!   may map it as a block; the first write splits the PMD into zero-page PTEs (an invalidation
//!   of the 2 MiB: `kvm_unmap_hva_range`), then copies its own page as above. A write to an
//!   untouched 2 MiB allocates and clears a huge page. (Simplified: hugetlbfs memory is mapped
//!   from the start, so its first touch, which clears a huge page too, is not priced.)
//!
//! The host's work takes time before the PTE changes, so a fault that planned on one state may
//! find another when its work ends ([`HostStage::Work`]); the engines give that time before
//! [`HostFaultState::resume`] runs. Simplified: the fault's front half is run again from the
//! start once the host is done (with the snapshot taken before the host ran and without
//! counting the exit twice), where KVM carries on inside the same call.

use crate::host::anon::{HostPmd, HostPte, PAGES_PER_PMD};
use crate::host::memory::{HUGE_ZERO_PFN, ZERO_PFN};
use crate::kvm::meter::Meter;
use crate::kvm::mmu::Mmu;
use crate::kvm::mmu_lock::MmuLockHeld;
use crate::kvm::mmu_notifier;
use crate::kvm::Kvm;
use crate::units::Pfn;

/// How the host backs reads of private anonymous memory nobody wrote, and what KVM hears
/// when the first write copies the zero page.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ZeroPage {
    /// No zero page: every first touch allocates a page (`mm_forbids_zeropage()`).
    Off,
    /// Linux up to 6.9: reads map the shared zero page; the copy on the first write replaces
    /// the PTE with `set_pte_at_notify()`, and KVM's `change_pte` callback
    /// (`kvm_set_spte_gfn()`) runs between `invalidate_range_start` and `_end`: arm64 maps the
    /// new page read-only at stage 2, x86 finds no SPTE left to change.
    #[default]
    ChangePte,
    /// Linux 6.10 and later ("KVM: delete .change_pte MMU notifier callback"): the same
    /// without `change_pte`; the guest's next access faults the new page in.
    NoChangePte,
}

impl ZeroPage {
    /// The `--zero-page` value.
    pub fn name(self) -> &'static str {
        match self {
            ZeroPage::Off => "off",
            ZeroPage::ChangePte => "change-pte",
            ZeroPage::NoChangePte => "no-change-pte",
        }
    }
}

impl std::str::FromStr for ZeroPage {
    type Err = crate::kvm::KvmError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [ZeroPage::Off, ZeroPage::ChangePte, ZeroPage::NoChangePte]
            .into_iter()
            .find(|z| z.name() == s)
            .ok_or_else(|| crate::kvm::KvmError::UnknownZeroPage(s.into()))
    }
}

/// What the host half of `kvm_faultin_pfn()` found ([`Kvm::faultin_pfn`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Faultin {
    /// The host maps the page: KVM maps `pfn`, writable only where the host PTE is.
    Mapped {
        /// The frame to map (the zero page's, for a read of memory nobody wrote).
        pfn: Pfn,
        /// `hva_to_pfn()`'s `writable`.
        writable: bool,
    },
    /// The host must fault the page in first; the MMU's fault is abandoned and run again once
    /// it has ([`HostFaultState`]).
    Host(HostFault),
    /// No free host page above the min watermark (`vmmu reclaim`): the vCPU tries again.
    NoMemory,
}

/// A page a fault needs the host to fault in.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HostFault {
    /// The faulting 4 KiB page's own frame (in a region whose host page table is modelled).
    pub page: Pfn,
    /// A write fault (`FOLL_WRITE`).
    pub write: bool,
    /// The fault's `mmu_seq`, snapshotted before the page was looked up: the fault checks it
    /// when it runs again.
    pub mmu_seq: u64,
}

/// The host's work for one fault, counted on the meter when it starts.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Work {
    /// `do_anonymous_page()` for a read: map the zero page.
    MapZero,
    /// `do_anonymous_page()` for a write: allocate and clear a page.
    Allocate,
    /// `wp_page_copy()`: allocate a page and copy the zero page into it.
    Copy,
    /// `do_huge_pmd_anonymous_page()` for a read: map the huge zero folio.
    MapHugeZero,
    /// `do_huge_pmd_anonymous_page()` for a write: a huge page of its own.
    AllocateHuge,
    /// `do_huge_pmd_wp_page()` over the huge zero folio: split the PMD into zero-page PTEs.
    SplitHugeZero,
}

/// A callback of the MMU notifier the host makes, each under `mmu_lock` for write.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum NotifierCall {
    /// `kvm_mmu_notifier_invalidate_range_start()` of the copied page.
    InvalidateStart,
    /// `kvm_mmu_notifier_change_pte()`.
    ChangePte,
    /// `kvm_mmu_notifier_invalidate_range_end()` of the copied page.
    InvalidateEnd,
    /// `kvm_mmu_notifier_invalidate_range_start()` of the 2 MiB a split covers.
    SplitStart,
    /// `kvm_mmu_notifier_invalidate_range_end()` of the split.
    SplitEnd,
}

/// Where a host fault is.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostStage {
    /// This work is running; its end is when the PTE changes.
    Work(Work),
    /// This callback runs next, once the vCPU holds `mmu_lock` for write.
    Locked(NotifierCall),
    /// The PMD was split: the host faults the page in again, on its PTE.
    Replan,
    /// The host is done: the fault runs again.
    Done,
}

/// What the engine does next for a vCPU in a host fault.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostNext {
    /// Let the work just counted on the meter take its time, then resume.
    Elapse,
    /// Take `mmu_lock` for write and run [`HostFaultState::run_locked`].
    NeedWriteLock,
    /// The host is done; run the fault again.
    Done,
}

/// A vCPU's host fault in progress.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct HostFaultState {
    /// The page and the fault's snapshot.
    pub fault: HostFault,
    /// Where it is.
    pub stage: HostStage,
    /// The copy replaced the PTE (so `change_pte` has a new page to report).
    replaced: bool,
}

impl HostFaultState {
    /// Starts the host's fault on `fault`'s page as the host page table is now, counting its
    /// first work on `meter`; `None` when the host maps the page already (another fault got
    /// there first).
    pub fn start(kvm: &Kvm, fault: HostFault, meter: &mut Meter) -> Option<Self> {
        let work = plan(kvm, fault)?;
        count(work, meter);
        Some(HostFaultState {
            fault,
            stage: HostStage::Work(work),
            replaced: false,
        })
    }

    /// Moves on once the engine let the last step's time pass: the work's change of the host
    /// page table (or a new plan, if another fault changed it meanwhile), the next callback, or
    /// done.
    pub fn resume(&mut self, kvm: &Kvm, meter: &mut Meter) -> HostNext {
        let page = self.fault.page;
        // Each first touch fills an empty PTE or PMD, unless another fault filled it first.
        let fill_pte = |to| kvm.host.change_host_pte(page, HostPte::None, to).is_ok();
        let fill_pmd = |to| kvm.host.change_host_pmd(page, HostPmd::None, to).is_ok();
        let changed = match self.stage {
            HostStage::Work(work) => match work {
                Work::MapZero => fill_pte(HostPte::Zero),
                Work::Allocate => fill_pte(HostPte::Private),
                Work::MapHugeZero => fill_pmd(HostPmd::HugeZero),
                Work::AllocateHuge => fill_pmd(HostPmd::Huge),
                // The copy is done; the PTE is replaced after invalidate_range_start(), if it
                // still maps the zero page then (pte_same()).
                Work::Copy => {
                    self.stage = HostStage::Locked(NotifierCall::InvalidateStart);
                    return HostNext::NeedWriteLock;
                }
                Work::SplitHugeZero => {
                    self.stage = HostStage::Locked(NotifierCall::SplitStart);
                    return HostNext::NeedWriteLock;
                }
            },
            HostStage::Locked(_) => return HostNext::NeedWriteLock,
            HostStage::Replan => false,
            HostStage::Done => return HostNext::Done,
        };
        if changed {
            self.stage = HostStage::Done;
            return HostNext::Done;
        }
        // vmf_pte_changed(): another fault set the entry while this one worked (the page it
        // allocated is freed), or a split left PTEs: the fault goes on from what is there.
        match plan(kvm, self.fault) {
            Some(next) => {
                count(next, meter);
                self.stage = HostStage::Work(next);
                HostNext::Elapse
            }
            None => {
                self.stage = HostStage::Done;
                HostNext::Done
            }
        }
    }

    /// Runs the next notifier callback under `held` (the write lock), as the vCPU whose fault
    /// changes the host page table.
    pub fn run_locked(&mut self, kvm: &Kvm, mmu: &dyn Mmu, held: &MmuLockHeld, meter: &mut Meter) {
        let HostStage::Locked(call) = self.stage else {
            unreachable!("a host fault took mmu_lock with no callback to run");
        };
        // Every host-fault callback runs under the write lock it asked for (NeedWriteLock).
        let held = held.write();
        let page = self.fault.page;
        let end = page + 1;
        let first = Pfn(page.0 / PAGES_PER_PMD * PAGES_PER_PMD);
        let notify = !kvm.mmu_invalidate.skip_cow_for_negative_control();
        match call {
            NotifierCall::InvalidateStart => {
                meter.unmap_hva_range += 1;
                if notify {
                    mmu_notifier::invalidate_range_start(kvm, mmu, page, end, held, meter);
                }
                // ptep_clear_flush_notify() and set_pte_at_notify(), under the PTE lock, if
                // the PTE still maps the zero page.
                self.replaced = kvm
                    .host
                    .change_host_pte(page, HostPte::Zero, HostPte::Private)
                    .is_ok();
                self.stage =
                    HostStage::Locked(if self.replaced && kvm.zero_page() == ZeroPage::ChangePte {
                        NotifierCall::ChangePte
                    } else {
                        NotifierCall::InvalidateEnd
                    });
            }
            NotifierCall::ChangePte => {
                meter.set_spte_hva += 1;
                // .change_pte() must be surrounded by .invalidate_range_{start,end}(); KVM
                // acts only while an invalidation is in progress, which this one is.
                if kvm.mmu_invalidate.in_progress() > 0 && notify {
                    for (s, e) in mmu_notifier::gfn_ranges_of(kvm, page, end) {
                        debug_assert_eq!(e.0, s.0 + 1);
                        mmu.set_spte_gfn(kvm, s, page, held, meter);
                    }
                }
                meter.mmu_notifier_calls += 1;
                self.stage = HostStage::Locked(NotifierCall::InvalidateEnd);
            }
            NotifierCall::InvalidateEnd | NotifierCall::SplitEnd => {
                if notify {
                    mmu_notifier::invalidate_range_end(kvm, held, meter);
                }
                self.stage = if call == NotifierCall::SplitEnd {
                    HostStage::Replan
                } else {
                    HostStage::Done
                };
            }
            NotifierCall::SplitStart => {
                meter.unmap_hva_range += 1;
                if notify {
                    let last = first + PAGES_PER_PMD;
                    mmu_notifier::invalidate_range_start(kvm, mmu, first, last, held, meter);
                }
                // __split_huge_pmd_locked(), under the PMD lock, if the PMD still maps the
                // huge zero folio.
                let _ = kvm
                    .host
                    .change_host_pmd(page, HostPmd::HugeZero, HostPmd::Split);
                self.stage = HostStage::Locked(NotifierCall::SplitEnd);
            }
        }
    }
}

/// The work the host does for `fault` as its page table is now; `None` when it maps what the
/// fault needs already.
fn plan(kvm: &Kvm, fault: HostFault) -> Option<Work> {
    let write = fault.write;
    match kvm.host.host_pmd(fault.page) {
        Some(HostPmd::None) if write || kvm.zero_page() == ZeroPage::Off => {
            return Some(Work::AllocateHuge)
        }
        Some(HostPmd::None) => return Some(Work::MapHugeZero),
        Some(HostPmd::HugeZero) if write => return Some(Work::SplitHugeZero),
        Some(HostPmd::HugeZero | HostPmd::Huge) => return None,
        Some(HostPmd::Split) | None => {}
    }
    match (kvm.host.host_pte(fault.page)?, write) {
        (HostPte::Private, _) | (HostPte::Zero, false) => None,
        (HostPte::Zero, true) => Some(Work::Copy),
        (HostPte::None, true) => Some(Work::Allocate),
        (HostPte::None, false) if kvm.zero_page() == ZeroPage::Off => Some(Work::Allocate),
        (HostPte::None, false) => Some(Work::MapZero),
    }
}

fn count(work: Work, meter: &mut Meter) {
    match work {
        Work::MapZero | Work::MapHugeZero => meter.zero_pages_mapped += 1,
        Work::Allocate => meter.pages_populated += 1,
        Work::Copy => meter.pages_copied += 1,
        Work::AllocateHuge => meter.huge_pages_populated += 1,
        Work::SplitHugeZero => meter.huge_zero_splits += 1,
    }
}

/// What the host maps for a fault that needs frame `pfn` (a mapping's first frame: the page's
/// own, or a huge page's first) to read or write (`write`) now: the frame to map and whether
/// it is writable, or `None` when the host must fault the page in first.
pub fn host_mapping(kvm: &Kvm, pfn: Pfn, write: bool) -> Option<(Pfn, bool)> {
    // The huge zero folio maps each 4 KiB at the same offset as the memory it stands for.
    let huge_zero = HUGE_ZERO_PFN + pfn.0 % PAGES_PER_PMD;
    match kvm.host.host_pmd(pfn) {
        Some(HostPmd::HugeZero) if !write => return Some((huge_zero, false)),
        Some(HostPmd::Huge) => return Some((pfn, true)),
        Some(HostPmd::None | HostPmd::HugeZero) => return None,
        Some(HostPmd::Split) | None => {}
    }
    match kvm.host.host_pte(pfn) {
        None | Some(HostPte::Private) => Some((pfn, true)),
        Some(HostPte::Zero) if !write => Some((ZERO_PFN, false)),
        Some(_) => None,
    }
}

/// The largest page the host maps at `pfn` (`host_pfn_mapping_level()`,
/// `get_user_mapping_size()`): 4 KiB under a split PMD, else what the backing allows (`None`).
pub fn host_mapping_limit(kvm: &Kvm, pfn: Pfn) -> Option<crate::units::PageSize> {
    (kvm.host.host_pmd(pfn) == Some(HostPmd::Split)).then_some(crate::units::PageSize::Size4K)
}
