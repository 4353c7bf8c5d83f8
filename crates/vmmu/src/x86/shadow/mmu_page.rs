//! `struct kvm_mmu_page` and its role (`union kvm_mmu_page_role`, mmu_internal.h and
//! kvm_host.h): the metadata of one shadow page table.

use crate::hw::page_table::PageTable;
use crate::units::{Gfn, PAGE_SHIFT};
use crate::x86::shadow::rmap::KvmRmapHead;
pub use crate::x86::shadow::sptep::{SpId, SptepRef};
use crate::x86::spte::{Level, SPTE_ENT_PER_PAGE};

pub use crate::x86::guest_paging::{ACC_ALL, ACC_EXEC_MASK, ACC_USER_MASK, ACC_WRITE_MASK};

/// `union kvm_mmu_page_role`: the bits that, with the gfn, identify a shadow page in the page
/// hash. KVM's bit layout is kept so `word` values read the same as in a kernel trace:
/// `level:4 has_4_byte_gpte:1 quadrant:2 direct:1 access:3 invalid:1 efer_nx:1 cr0_wp:1
/// smep_andnot_wp:1 smap_andnot_wp:1 ad_disabled:1 guest_mode:1 passthrough:1 is_mirror:1 :4
/// smm:8`.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Default)]
pub struct KvmMmuPageRole {
    /// `role.word`.
    pub word: u32,
}

macro_rules! role_bits {
    ($( $(#[doc = $doc:expr])* $get:ident, $set:ident, $shift:expr, $width:expr; )*) => {
        impl KvmMmuPageRole {
            $(
                $(#[doc = $doc])*
                pub fn $get(self) -> u32 {
                    (self.word >> $shift) & ((1 << $width) - 1)
                }
                /// Sets the field of the same name.
                pub fn $set(&mut self, v: u32) {
                    debug_assert!(v < (1 << $width), "role field out of range");
                    self.word = (self.word & !(((1 << $width) - 1) << $shift)) | (v << $shift);
                }
            )*
        }
    };
}

role_bits! {
    /// `role.level`: the level of the table (1 = 4K leaves).
    level_bits, set_level_bits, 0, 4;
    /// `role.has_4_byte_gpte`: the guest uses 32-bit non-PAE paging (never, here).
    has_4_byte_gpte, set_has_4_byte_gpte, 4, 1;
    /// `role.quadrant`: which part of a 32-bit guest table this page shadows (always 0 with
    /// 64-bit guest tables).
    quadrant, set_quadrant, 5, 2;
    /// `role.direct`: the page maps a gfn range directly (TDP, or a guest huge page split into
    /// small shadow pages) rather than shadowing a guest table.
    direct_bit, set_direct_bit, 7, 1;
    /// `role.access`: the access the guest's upper levels allow (ACC_* bits).
    access, set_access, 8, 3;
    /// `role.invalid`: the page was zapped and must not be used or found again.
    invalid_bit, set_invalid_bit, 11, 1;
    /// `role.efer_nx`.
    efer_nx, set_efer_nx, 12, 1;
    /// `role.cr0_wp`.
    cr0_wp, set_cr0_wp, 13, 1;
    /// `role.ad_disabled`: the page's SPTEs do not use hardware A/D bits.
    ad_disabled, set_ad_disabled, 17, 1;
    /// `role.guest_mode`: the page belongs to a nested (L2) guest's MMU.
    guest_mode_bit, set_guest_mode_bit, 18, 1;
}

impl KvmMmuPageRole {
    /// The level of the table.
    pub fn level(self) -> Level {
        Level(self.level_bits() as u8)
    }
    /// Sets the level.
    pub fn set_level(&mut self, level: Level) {
        self.set_level_bits(level.0 as u32)
    }
    /// `role.direct`.
    pub fn direct(self) -> bool {
        self.direct_bit() != 0
    }
    /// `role.invalid`.
    pub fn invalid(self) -> bool {
        self.invalid_bit() != 0
    }
    /// `role.guest_mode`.
    pub fn guest_mode(self) -> bool {
        self.guest_mode_bit() != 0
    }
}

impl std::fmt::Debug for KvmMmuPageRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "role {{ level {}, {}, access {:#x}{}{} }}",
            self.level_bits(),
            if self.direct() { "direct" } else { "indirect" },
            self.access(),
            if self.invalid() { ", invalid" } else { "" },
            if self.guest_mode() {
                ", guest_mode"
            } else {
                ""
            }
        )
    }
}

/// `struct kvm_mmu_page`.
pub struct KvmMmuPage {
    /// `role`.
    pub role: KvmMmuPageRole,
    /// `gfn`: the guest table this page shadows (indirect), or the first gfn it maps (direct).
    pub gfn: Gfn,
    /// `spt`: the table itself, owned by this page (`Box::into_raw`); freed through RCU when
    /// the page is freed, because lockless walkers may still read it.
    pub spt: *const PageTable,
    /// `shadowed_translation[]`: for each index, `gfn << PAGE_SHIFT | access` of what the
    /// entry maps (indirect pages only; a direct page derives both from `gfn` and its role).
    pub shadowed_translation: Option<Box<[u64; SPTE_ENT_PER_PAGE]>>,
    /// `parent_ptes`: the non-leaf SPTEs that point to this page (an rmap list).
    pub parent_ptes: KvmRmapHead,
    /// `root_count`: vCPUs (here: the MMU itself) using this page as their root.
    pub root_count: u32,
    /// `unsync`: the guest may have changed the table without KVM knowing; synced on the
    /// guest's next TLB flush.
    pub unsync: bool,
    /// `unsync_children`: how many bits of `unsync_child_bitmap` are set.
    pub unsync_children: u32,
    /// `unsync_child_bitmap`: entries that lead to unsync pages.
    pub unsync_child_bitmap: [u64; SPTE_ENT_PER_PAGE / 64],
    /// `write_flooding_count`: emulated writes since the page was last used by a fault.
    pub write_flooding_count: u32,
    /// `mmu_valid_gen`: obsolete when it differs from the VM's generation.
    pub mmu_valid_gen: u64,
    /// For a page vCPUs loaded as a nested root: raised when the page is zapped, so a vCPU
    /// holding it sees `role.invalid` without `mmu_lock`, as KVM reads it.
    pub root_invalid: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// Where the `struct kvm_mmu_page` itself lives in host memory, when the host's caches
    /// are modelled.
    pub header: crate::kvm::host_caches::MetaObject,
    /// Links of `kvm->arch.active_mmu_pages` (towards newer, towards older).
    pub(crate) link_prev: Option<SpId>,
    pub(crate) link_next: Option<SpId>,
}

// SAFETY: `spt` is an owned heap table (see its field doc) whose entries are atomics; the rest
// of the page is plain data mutated only under mmu_lock held for write.
unsafe impl Send for KvmMmuPage {}
// SAFETY: as above; shared access reads the table only through atomics.
unsafe impl Sync for KvmMmuPage {}

impl KvmMmuPage {
    /// The table.
    pub fn spt(&self) -> &PageTable {
        // SAFETY: `spt` is allocated with the page and freed only after the page is removed
        // from every index (hash, active list, page headers) and no `&KvmMmuPage` remains.
        unsafe { &*self.spt }
    }

    /// `sp_has_gptes()`: the page shadows a guest table (indirect and not a passthrough page).
    pub fn has_gptes(&self) -> bool {
        !self.role.direct()
    }

    /// `kvm_mmu_page_get_gfn()`: the gfn entry `index` maps.
    pub fn get_gfn(&self, index: usize) -> Gfn {
        if let Some(t) = &self.shadowed_translation {
            return Gfn(t[index] >> PAGE_SHIFT);
        }
        // Direct pages, and indirect pages above the largest huge-page level (their entries
        // are never leaves), map consecutive ranges from `gfn`.
        Gfn(self.gfn.0 + ((index as u64) << ((self.role.level().0 as u32 - 1) * 9)))
    }

    /// `kvm_mmu_page_get_access()`: the access entry `index` was mapped with.
    pub fn get_access(&self, index: usize) -> u8 {
        match &self.shadowed_translation {
            Some(t) => (t[index] & ACC_ALL as u64) as u8,
            // Direct pages inherit their access from the role (ACC_ALL with TDP; the guest's
            // huge-page access for a direct page under an indirect one).
            None => self.role.access() as u8,
        }
    }

    /// `kvm_mmu_page_set_translation()`.
    pub fn set_translation(&mut self, index: usize, gfn: Gfn, access: u8) {
        if let Some(t) = &mut self.shadowed_translation {
            t[index] = (gfn.0 << PAGE_SHIFT) | access as u64;
            return;
        }
        debug_assert!(
            access == self.get_access(index),
            "access {access:#x} differs from the cached {:#x} at index {index} of {:?} {:?}",
            self.get_access(index),
            self.role,
            self.gfn
        );
        debug_assert!(
            gfn == self.get_gfn(index),
            "{gfn:?} differs from the direct page's {:?} at index {index}",
            self.get_gfn(index)
        );
    }
}

/// The format of the EPT12 table a nested guest's shadow page of `role` shadows: A/D bits as
/// its root's EPTP enabled them (`!role.ad_disabled`).
pub fn ept12_format(role: KvmMmuPageRole) -> crate::x86::guest_paging::PtEpt {
    crate::x86::guest_paging::PtEpt {
        ad: role.ad_disabled() == 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::x86::spte::{PG_LEVEL_2M, PT64_ROOT_4LEVEL};

    #[test]
    fn role_bits_sit_where_kvm_puts_them() {
        let mut r = KvmMmuPageRole::default();
        r.set_level(PT64_ROOT_4LEVEL);
        assert_eq!(r.word, 4);
        r.set_direct_bit(1);
        assert_eq!(r.word, 4 | 1 << 7);
        r.set_access(ACC_ALL as u32);
        assert_eq!(r.word, 4 | 1 << 7 | 7 << 8);
        r.set_invalid_bit(1);
        assert!(r.invalid() && r.direct());
        assert_eq!(r.word >> 11 & 1, 1);
        r.set_guest_mode_bit(1);
        assert_eq!(r.word >> 18 & 1, 1);
        r.set_level(PG_LEVEL_2M);
        assert_eq!(r.level(), PG_LEVEL_2M);
        assert_eq!(r.access(), 7, "changing one field leaves the others");
    }

    #[test]
    fn direct_pages_derive_gfn_and_access_indirect_pages_cache_them() {
        let table = Box::into_raw(crate::hw::page_table::alloc_page_table(
            &crate::hw::page_table::PageTableStats::default(),
            crate::x86::spte::SHADOW_NONPRESENT_VALUE,
        ));
        let mut role = KvmMmuPageRole::default();
        role.set_level(PG_LEVEL_2M);
        role.set_direct_bit(1);
        role.set_access(ACC_ALL as u32);
        let mut sp = KvmMmuPage {
            role,
            gfn: Gfn(0x40000),
            spt: table,
            shadowed_translation: None,
            parent_ptes: KvmRmapHead::default(),
            root_count: 0,
            unsync: false,
            unsync_children: 0,
            unsync_child_bitmap: [0; 8],
            write_flooding_count: 0,
            mmu_valid_gen: 0,
            root_invalid: None,
            header: Default::default(),
            link_prev: None,
            link_next: None,
        };
        assert_eq!(sp.get_gfn(3), Gfn(0x40000 + 3 * 512));
        assert_eq!(sp.get_access(3), ACC_ALL);
        sp.role.set_direct_bit(0);
        sp.shadowed_translation = Some(Box::new([0; SPTE_ENT_PER_PAGE]));
        sp.set_translation(5, Gfn(0x1234), ACC_EXEC_MASK | ACC_USER_MASK);
        assert_eq!(sp.get_gfn(5), Gfn(0x1234));
        assert_eq!(sp.get_access(5), ACC_EXEC_MASK | ACC_USER_MASK);
        // SAFETY: allocated above with Box::into_raw and never shared.
        drop(unsafe { Box::from_raw(table) });
    }
}
