//! KVM's `struct kvm_mmu_page *` and `u64 *sptep` as handles: what rmaps, `parent_ptes` and
//! the page hash store to name a shadow page and one of its entries.

use crate::x86::spte::SPTE_ENT_PER_PAGE;

/// Index of a shadow page in the MMU's page table (its `struct kvm_mmu_page *`).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct SpId(pub u32);

/// One SPTE, named by the shadow page holding it and its index there: KVM's `u64 *sptep`, with
/// the page and index that KVM recovers from the address (`sptep_to_sp()`, `spte_index()`)
/// carried along instead. The SPTE itself is reached through the page
/// ([`ShadowState::sptep`](crate::x86::shadow::state::ShadowState::sptep)), so a handle to a
/// freed page fails a check rather than reading freed memory. Rmaps and `parent_ptes` store it
/// packed in one word ([`crate::x86::shadow::rmap`]).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SptepRef {
    /// The page whose table holds the SPTE.
    pub sp: SpId,
    /// The SPTE's index in that table.
    pub index: usize,
}

impl SptepRef {
    /// Entry `index` of page `sp` (`&sp->spt[index]`).
    pub fn new(sp: SpId, index: usize) -> Self {
        debug_assert!(index < SPTE_ENT_PER_PAGE, "SPTE index {index} out of range");
        SptepRef { sp, index }
    }
}

impl std::fmt::Debug for SptepRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}[{}]", self.sp, self.index)
    }
}
