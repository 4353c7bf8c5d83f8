//! `munmap()` of a memslot's backing memory, as the selftests' `kvm_vm_free()` does for each
//! region right after deleting its memslot (`__vm_mem_region_delete()`): the host's own work,
//! on the VMM thread, as an [`OpPlan`] every engine runs and prices.
//!
//! From the code (Linux 6.x, `unmap_vmas()` → `unmap_single_vma()`):
//! - `mmu_notifier_invalidate_range_start()` over the whole range: KVM's
//!   `__kvm_handle_hva_range()` looks the range up in the memslots' interval tree, finds no
//!   memslot (deleted just before), and so takes no `mmu_lock` and zaps nothing; `_end()` the
//!   same. Each callback is priced as any notifier call;
//! - the host page table's zap: `zap_pte_range()` clears every present 4 KiB PTE
//!   (`host_ptes_zapped`) and frees the pages of its own (`host_pages_freed`; the zero page is
//!   never freed); `zap_huge_pmd()` clears a THP's or the huge zero folio's PMD and
//!   `__unmap_hugepage_range()` a hugetlbfs page's huge PTE (`host_huge_zapped`), freeing the
//!   huge page to the buddy allocator or the hugetlb pool (`host_huge_pages_freed`);
//! - `tlb_finish_mmu()`: one flush of the range, which past `MAX_TLBI_OPS` strides on arm64 is
//!   `flush_tlb_mm()` (a broadcast `TLBI ASIDE1IS` and `DSB ISH`), and on x86 a local full
//!   flush once the vCPU threads have exited (no other CPU in the mm's cpumask).
//!
//! Simplified: the zap runs at once rather than in `ZAP_BLOCK_SIZE` batches with
//! `cond_resched()` between them (nothing else runs on the host then), and the page-table pages
//! of the range are not counted (`free_pgtables()`: one 4 KiB table per 2 MiB).

use crate::host::anon::{HostPmd, HostPte, PAGES_PER_PMD};
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::kvm::mmu_notifier::gfn_ranges_of;
use crate::kvm::op_plan::{OpPlan, OpStep};
use crate::kvm::Kvm;
use crate::units::Pfn;
use std::sync::Arc;

/// How the host invalidates its own TLB entries for a range it unmapped.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostTlbFlush {
    /// arm64: a broadcast TLBI and the `DSB ISH` that waits for it.
    Broadcast,
    /// x86: a local flush, with no other CPU in the mm's cpumask.
    Local,
}

/// The plan that unmaps `slot`'s backing memory from the VMM's address space, the memslot
/// already deleted.
pub fn munmap_plan(slot: &Arc<Memslot>, flush: HostTlbFlush) -> OpPlan {
    let slot = Arc::clone(slot);
    OpPlan {
        steps: vec![OpStep::Call(Box::new(move |kvm, meter| {
            munmap_backing(kvm, &slot, flush, meter)
        }))],
    }
}

/// `munmap()` of `slot`'s backing (see the module documentation).
fn munmap_backing(kvm: &Kvm, slot: &Memslot, flush: HostTlbFlush, m: &mut Meter) {
    let first = slot.gfn_to_pfn(slot.base_gfn);
    let end = first + slot.npages;
    // mmu_notifier_invalidate_range_start(): no memslot maps the range any more.
    debug_assert!(
        gfn_ranges_of(kvm, first, end).is_empty(),
        "munmap() of memory a memslot still maps"
    );
    m.mmu_notifier_calls += 1;
    if kvm.host.host_pte(first).is_none() {
        // hugetlbfs: every huge page was faulted in by the test (the host maps it from the
        // start here); __unmap_hugepage_range() clears each huge PTE and the pages go back to
        // the pool.
        let huge = slot.backing.max_page_size().pages();
        let n = slot.npages.div_ceil(huge);
        m.host_huge_zapped += n;
        m.host_huge_pages_freed += n;
    } else {
        zap_anon_range(kvm, first, end, m);
    }
    match flush {
        HostTlbFlush::Broadcast => {
            m.tlbi_ops += 1;
            m.dsb_waits += 1;
        }
        HostTlbFlush::Local => m.host_tlb_flushes += 1,
    }
    // mmu_notifier_invalidate_range_end().
    m.mmu_notifier_calls += 1;
}

/// `zap_pmd_range()` over private anonymous memory whose host page table is modelled: a huge
/// PMD goes whole, a split PMD or 4 KiB pages PTE by PTE; everything ends unmapped.
fn zap_anon_range(kvm: &Kvm, first: Pfn, end: Pfn, m: &mut Meter) {
    let host = &kvm.host;
    let mut pfn = first;
    while pfn < end {
        let pmd_end = Pfn(((pfn.0 / PAGES_PER_PMD + 1) * PAGES_PER_PMD).min(end.0));
        let pmd = host.host_pmd(pfn);
        match pmd {
            Some(HostPmd::None) => {}
            Some(huge @ (HostPmd::Huge | HostPmd::HugeZero)) => {
                m.host_huge_zapped += 1;
                // The huge zero folio is shared and never freed.
                if huge == HostPmd::Huge {
                    m.host_huge_pages_freed += 1;
                }
                let _ = host.change_host_pmd(pfn, huge, HostPmd::None);
            }
            // Pages mapped by 4 KiB PTEs: memory without THP, or a split PMD.
            None | Some(HostPmd::Split) => {
                for p in pfn.0..pmd_end.0 {
                    let page = Pfn(p);
                    let pte = host.host_pte(page).expect("a modelled host page table");
                    if pte == HostPte::None {
                        continue;
                    }
                    m.host_ptes_zapped += 1;
                    if pte == HostPte::Private {
                        m.host_pages_freed += 1;
                    }
                    let _ = host.change_host_pte(page, pte, HostPte::None);
                }
                if pmd == Some(HostPmd::Split) {
                    let _ = host.change_host_pmd(pfn, HostPmd::Split, HostPmd::None);
                }
            }
        }
        pfn = pmd_end;
    }
}
