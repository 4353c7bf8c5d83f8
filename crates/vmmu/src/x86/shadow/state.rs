//! What `mmu_lock` protects in the shadow MMU ([`ShadowState`]): the shadow pages
//! (`struct kvm_mmu_page`) and the indexes over them, the memslot rmaps, the write-tracked gfns
//! and the page quota. The operations on it live by concept in the sibling modules: [`pages`],
//! [`spte`], [`slot_rmap`], [`write_track`], [`unsync`] and [`zap`].
//!
//! [`pages`]: crate::x86::shadow::pages
//! [`spte`]: crate::x86::shadow::spte
//! [`slot_rmap`]: crate::x86::shadow::slot_rmap
//! [`write_track`]: crate::x86::shadow::write_track
//! [`unsync`]: crate::x86::shadow::unsync
//! [`zap`]: crate::x86::shadow::zap

use crate::hw::page_table::PageTableStats;
use crate::kvm::host_caches::{HostCaches, MetaObject, MetaRegion, SlabCache};
use crate::kvm::meter::Meter;
use crate::kvm::vm_lines::{VmLine, VmLineWrites};
use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::{PteListDesc, SlotRmaps};

use crate::x86::shadow::vcpu::VcpuMmuCaches;
use crate::x86::spte::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

/// `KVM_MIN_FREE_MMU_PAGES`: a fault makes sure at least this many pages are free; eager
/// splitting refuses to run at or below it.
pub const KVM_MIN_FREE_MMU_PAGES: u64 = 5;
/// `KVM_REFILL_PAGES`: how many free pages zapping the oldest aims for.
pub const KVM_REFILL_PAGES: u64 = 25;
/// `KVM_MIN_ALLOC_MMU_PAGES`: the smallest default quota.
pub const KVM_MIN_ALLOC_MMU_PAGES: u64 = 64;
/// `KVM_MEMSLOT_PAGES_TO_MMU_PAGES_RATIO`: one shadow page of quota per 50 guest pages.
pub const KVM_MEMSLOT_PAGES_TO_MMU_PAGES_RATIO: u64 = 50;
/// `KVM_MMU_HASH_SHIFT`: 4096 hash buckets.
pub const KVM_MMU_HASH_SHIFT: u32 = 12;
/// `hash_64(gfn, KVM_MMU_HASH_SHIFT)`: the bucket of `gfn` in the page hash.
pub fn kvm_page_table_hashfn(gfn: Gfn) -> usize {
    (gfn.0.wrapping_mul(0x61C8_8646_80B5_83EB) >> (64 - KVM_MMU_HASH_SHIFT)) as usize
}

/// `kvm_mmu_calculate_default_mmu_pages()`: the default quota for `nr_pages` guest pages.
pub fn default_mmu_pages(nr_pages: u64) -> u64 {
    (nr_pages / KVM_MEMSLOT_PAGES_TO_MMU_PAGES_RATIO).max(KVM_MIN_ALLOC_MMU_PAGES)
}

/// The negative errno values KVM's shadow MMU returns where it can fail, by name.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Errno {
    /// `-EPERM`: the gfn may not be mapped writable (`mmu_try_to_unsync_pages()`).
    NotPermitted,
    /// `-EEXIST`: a prefetch found a page it would have to unsync.
    Exists,
    /// `-ENOSPC`: no shadow page could be freed (`make_mmu_pages_available()`).
    NoSpace,
}

/// The shadow MMU with `mmu_lock` held for write: the VM, the state the lock protects, and the
/// meter that charges the work. Operations that reach beyond [`ShadowState`] (TLB flushes,
/// memslots, guest memory, page-table allocation) take it where KVM takes `struct kvm *kvm`:
/// KVM finds all three through that one pointer, while here the state sits behind the write
/// lock outside [`Kvm`] and the cost model is explicit, so without this they would travel as
/// three arguments. Operations on the state alone stay methods of [`ShadowState`], which
/// teardown can use with no VM.
pub struct LockedMmu<'a> {
    /// The VM (`struct kvm`).
    pub kvm: &'a Kvm,
    /// What `mmu_lock` protects.
    pub st: &'a mut ShadowState,
    /// Where the work is charged.
    pub meter: &'a mut Meter,
}

impl<'a> LockedMmu<'a> {
    /// The shadow MMU of `kvm` with its locked state `st`, charging `meter`.
    pub fn new(kvm: &'a Kvm, st: &'a mut ShadowState, meter: &'a mut Meter) -> Self {
        LockedMmu { kvm, st, meter }
    }
}

/// A vCPU in the shadow MMU with `mmu_lock` held for write: what the fault path reaches through
/// KVM's `struct kvm_vcpu *vcpu`, the locked MMU of its VM (`vcpu->kvm`) and its memory caches
/// (`vcpu->arch.mmu_*_cache`), topped up before the lock was taken so that nothing under it
/// allocates. Operations KVM gives a `vcpu` take it; those KVM gives a `kvm` take the
/// [`LockedMmu`] inside.
pub struct LockedVcpu<'a> {
    /// The VM's shadow MMU, locked.
    pub mmu: LockedMmu<'a>,
    /// The vCPU's caches.
    pub caches: &'a mut VcpuMmuCaches,
}

impl<'a> LockedVcpu<'a> {
    /// The vCPU whose caches are `caches`, faulting in `mmu`.
    pub fn new(mmu: LockedMmu<'a>, caches: &'a mut VcpuMmuCaches) -> Self {
        LockedVcpu { mmu, caches }
    }
}

/// Everything `mmu_lock` protects in the shadow MMU.
pub struct ShadowState {
    pub(super) sps: Vec<Option<KvmMmuPage>>,
    pub(super) free_ids: Vec<u32>,
    /// `page_private(virt_to_page(spt))`: table address → its shadow page.
    pub(super) page_header: HashMap<u64, SpId>,
    /// `kvm->arch.mmu_page_hash`. Each entry carries its page's gfn beside its id, so that
    /// the simulator compares gfns without loading every page of a long bucket (KVM loads
    /// each `struct kvm_mmu_page`; `sp_hash_steps` prices those loads all the same).
    pub(super) mmu_page_hash: Vec<Vec<(Gfn, SpId)>>,
    /// Newest and oldest page of `kvm->arch.active_mmu_pages`.
    pub(super) active_head: Option<SpId>,
    pub(super) active_tail: Option<SpId>,
    /// `kvm->arch.n_used_mmu_pages`.
    pub n_used_mmu_pages: u64,
    /// `kvm->arch.n_max_mmu_pages`.
    pub n_max_mmu_pages: u64,
    /// `kvm->arch.n_requested_mmu_pages`: a quota userspace set (0: the default applies).
    pub n_requested_mmu_pages: u64,
    /// `kvm->arch.indirect_shadow_pages`.
    pub indirect_shadow_pages: u64,
    /// `kvm->arch.mmu_valid_gen`.
    pub mmu_valid_gen: u64,
    /// Rmaps of each memslot, by base gfn.
    pub rmaps: BTreeMap<u64, SlotRmaps>,
    /// `gfn_write_track`: gfns holding upper-level guest tables, which stay read-only.
    pub gfn_write_track: HashMap<Gfn, u32>,
    /// `lpage_info.disallow_lpage` raised by last-level guest tables: (level, huge-page index).
    pub disallow_lpage: HashMap<(u8, u64), u32>,
    /// The root shadow page every vCPU uses (L1's, with nested guests).
    pub root: Option<SpId>,
    /// Seed 004's switch: whether zapping a page zaps the nested-TDP children it leaves
    /// without a parent.
    pub zap_orphans: ZapOrphans,
    /// What deleting a memslot zaps.
    pub slot_zap: SlotZap,
    /// Guest tables KVM shadows are write-protected and tracked (`account_shadowed()`). Only a
    /// negative control turns it off: KVM then misses the guest's writes to its tables, and
    /// the oracles must notice the stale translations that follow.
    pub write_tracking: bool,
    /// Shadow pages ever zapped (`kvm->stat.mmu_shadow_zapped`).
    pub mmu_shadow_zapped: u64,
    /// Pages created (`kvm->stat.mmu_cache_miss`).
    pub mmu_cache_miss: u64,
    /// Pages unsync now (`kvm->stat.mmu_unsync`).
    pub mmu_unsync: u64,
    /// Pages zapped to stay within the quota (`kvm->stat.mmu_recycled`).
    pub mmu_recycled: u64,
    /// Pages zapped because the guest kept writing their table (`kvm->stat.mmu_flooded`).
    pub mmu_flooded: u64,
    /// Largest rmap list seen (`kvm->stat.max_mmu_rmap_size`).
    pub max_mmu_rmap_size: u64,
    /// Page-table allocation counters.
    pub tables: Arc<PageTableStats>,
    /// Leaves per level (`kvm->stat.pages[]`); [`ShadowInner::pages`] shares them for readers
    /// outside the lock.
    ///
    /// [`ShadowInner::pages`]: crate::x86::shadow::ShadowInner::pages
    pub pages: Arc<PageStats>,
    /// `tdp_enabled`: EPT is on (the shadow MMU maps guest physical memory directly).
    pub tdp_enabled: bool,
    /// The host's caches, once the engine models them ([`ShadowState::place_in`]).
    pub(super) caches: Option<Arc<HostCaches>>,
    /// `mmu_page_header_cache`: where each page's `struct kvm_mmu_page` lives.
    pub(super) header_slab: SlabCache,
    /// `pte_list_desc_cache`: where each live rmap descriptor lives, by its address in this
    /// process. An entry is removed when its descriptor is freed, so that where a descriptor
    /// lives depends only on the model's own steps, never on which addresses the process's
    /// allocator reuses. Simplified: a new descriptor takes a new place in its core's slab
    /// (SLUB's per-CPU freelist would return the object freed last first).
    pub(super) desc_meta: HashMap<u64, MetaObject>,
    /// The slab descriptors come from.
    pub(super) desc_slab: SlabCache,
    /// Where `mmu_page_hash` lives: in `struct kvm_arch`, inside the `struct kvm` the VMM
    /// allocated when it created the VM.
    pub(super) page_hash_meta: MetaRegion,
}

/// `sizeof(struct kvm_mmu_page)` on x86-64 (arch/x86/kvm/mmu/mmu_internal.h): the active-list
/// head, the hash node, the flag bytes, role, gfn, `spt`, `shadowed_translation`, root count
/// and `parent_ptes`, the possible-NX-huge-page list head, the 512-bit
/// `unsync_child_bitmap`, the write-flooding count and the `rcu_head`: 184 bytes.
pub const KVM_MMU_PAGE_BYTES: u64 = 184;

/// Where in `struct kvm_mmu_page` the fields a hash walk reads lie: from `hash_link` (after
/// the 16-byte `link`) to the last byte of `gfn` (`role` at byte 36, `gfn` at 40; the
/// kernel's own comment says `link` through `spt` share one 64-byte line when the object is
/// aligned, which slab objects packed without `SLAB_HWCACHE_ALIGN` are not).
const HASH_WALK_OFFSETS: [u64; 2] = [16, 47];

/// Seed 004 ("KVM: x86/MMU: Recursively zap nested TDP SPs when zapping last/only parent"):
/// what `__kvm_mmu_prepare_zap_page()` does with a child page whose last parent it unlinks.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ZapOrphans {
    /// Linux 5.9 and later (v2 as merged): `mmu_page_zap_pte()` zaps a child left without a
    /// parent when TDP is on, the child is a nested guest's (`role.guest_mode`) and the caller
    /// collects an invalid list; single-entry zaps (write tracking) never recurse.
    #[default]
    On,
    /// The seed's v1: `kvm_mmu_page_unlink_children()` zaps any child left without a parent
    /// when TDP is on, nested or not.
    V1,
    /// Linux 5.8 and earlier: children are only unlinked; a parentless child stays (an orphan)
    /// until it is found again, flooded, reclaimed by the quota or the VM ends.
    Off,
}

/// What deleting a memslot zaps in the shadow MMU (`kvm_arch_flush_shadow_memslot()`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SlotZap {
    /// `kvm_mmu_zap_memslot()`: the slot's leaves, then the shadow pages of guest tables on its
    /// gfns (Linux 6.12+ with `KVM_X86_QUIRK_SLOT_ZAP_ALL` disabled).
    #[default]
    Memslot,
    /// `kvm_mmu_zap_all_fast()`: every shadow page of the VM, whatever slot it maps (what
    /// every kernel does by default, and all of them before 6.12).
    AllFast,
}

/// The MMU's VM-wide counters that readers outside the lock see: leaves per level
/// (`kvm->stat.pages[]`), and the writes to the VM-wide lines a critical section changes.
#[derive(Debug, Default)]
pub struct PageStats {
    /// Leaves per level (index level-1), updated where KVM's `kvm_update_page_stats()` is.
    pub leaves: [AtomicI64; 3],
    /// Writes to `kvm->stat.pages[]` and to the shadow-page accounting.
    pub lines: VmLineWrites,
}

pub(super) fn account_leaf(pages: &PageStats, level: Level, delta: i64) {
    if level <= KVM_MAX_HUGEPAGE_LEVEL {
        pages.leaves[level.0 as usize - 1].fetch_add(delta, Ordering::Relaxed);
        pages.lines.wrote(VmLine::PageStats);
    }
}

impl ShadowState {
    /// Empty state with quota `n_max_mmu_pages`.
    pub fn new(tables: Arc<PageTableStats>, pages: Arc<PageStats>, tdp_enabled: bool) -> Self {
        ShadowState {
            sps: Vec::new(),
            free_ids: Vec::new(),
            page_header: HashMap::new(),
            mmu_page_hash: vec![Vec::new(); 1 << KVM_MMU_HASH_SHIFT],
            active_head: None,
            active_tail: None,
            n_used_mmu_pages: 0,
            n_max_mmu_pages: KVM_MIN_ALLOC_MMU_PAGES,
            n_requested_mmu_pages: 0,
            indirect_shadow_pages: 0,
            mmu_valid_gen: 0,
            rmaps: BTreeMap::new(),
            gfn_write_track: HashMap::new(),
            disallow_lpage: HashMap::new(),
            root: None,
            zap_orphans: ZapOrphans::default(),
            slot_zap: SlotZap::default(),
            write_tracking: true,
            mmu_shadow_zapped: 0,
            mmu_cache_miss: 0,
            mmu_unsync: 0,
            mmu_recycled: 0,
            mmu_flooded: 0,
            max_mmu_rmap_size: 0,
            tables,
            pages,
            tdp_enabled,
            caches: None,
            header_slab: SlabCache::new(KVM_MMU_PAGE_BYTES),
            desc_meta: HashMap::new(),
            desc_slab: SlabCache::new(std::mem::size_of::<PteListDesc>() as u64),
            page_hash_meta: MetaRegion::default(),
        }
    }

    /// The engine models the host's caches from now on: the page hash gets its place (from
    /// the VMM's socket, zeroed long ago: in no cache), and pages allocated from now on get
    /// their headers there.
    pub fn place_in(&mut self, caches: &Arc<HostCaches>) {
        if self.caches.is_none() {
            let bytes = (8u64 << KVM_MMU_HASH_SHIFT).max(1);
            self.page_hash_meta = caches.alloc(caches.vmm_cpu(), bytes);
            self.caches = Some(Arc::clone(caches));
        }
    }

    /// The running core reads (or writes) `gfn`'s hash bucket (an `hlist_head`).
    #[inline]
    pub fn touch_hash_bucket(&self, gfn: Gfn, meter: &mut Meter) {
        if let Some(c) = &self.caches {
            let bucket = kvm_page_table_hashfn(gfn) as u64;
            c.read_line(self.page_hash_meta.line_of(bucket * 8), meter);
        }
    }

    /// The running core reads what a hash walk reads of page `id`'s header: its `hash_link`,
    /// `gfn` and `role` (one line, or two where the header straddles them).
    #[inline]
    pub fn touch_sp_header(&self, id: SpId, meter: &mut Meter) {
        if let Some(c) = &self.caches {
            let header = self.sp(id).header;
            if header.is_unplaced() {
                return;
            }
            let [a, b] = HASH_WALK_OFFSETS.map(|o| header.line_of(o));
            c.read_line(a, meter);
            if b != a {
                c.read_line(b, meter);
            }
        }
    }

    /// The page `id`.
    pub fn sp(&self, id: SpId) -> &KvmMmuPage {
        self.sps[id.0 as usize].as_ref().expect("live shadow page")
    }

    /// The page `id`, mutably.
    pub fn sp_mut(&mut self, id: SpId) -> &mut KvmMmuPage {
        self.sps[id.0 as usize].as_mut().expect("live shadow page")
    }

    /// Every live page (valid or zapped-but-rooted).
    pub fn live_sps(&self) -> impl Iterator<Item = (SpId, &KvmMmuPage)> {
        self.sps
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.as_ref().map(|s| (SpId(i as u32), s)))
    }

    /// `spte_to_child_sp()`: the page a present non-leaf SPTE points to.
    pub fn spte_to_child_sp(&self, spte: u64) -> SpId {
        let addr = spte_to_pfn(spte).0 << PAGE_SHIFT;
        *self
            .page_header
            .get(&addr)
            .unwrap_or_else(|| panic!("non-leaf SPTE {spte:#x} points to no shadow page"))
    }

    /// The SPTE `sptep` names (`*sptep`); panics if its page was freed.
    pub fn sptep(&self, sptep: SptepRef) -> &AtomicU64 {
        &self.sp(sptep.sp).spt().spt[sptep.index]
    }

    /// The running core reads or writes the SPTE `sptep`: counts on `meter` what its line
    /// costs in the host's caches, where they are modelled.
    #[inline]
    pub fn touch_spte(&self, sptep: SptepRef, meter: &mut Meter) {
        if self.tables.lines().is_some() {
            let cost = self.tables.entry_cost(self.sp(sptep.sp).spt(), sptep.index);
            meter.count_line(cost);
        }
    }

    /// `is_obsolete_sp()`.
    pub fn is_obsolete_sp(&self, sp: &KvmMmuPage) -> bool {
        sp.role.invalid() || sp.mmu_valid_gen != self.mmu_valid_gen
    }
}
