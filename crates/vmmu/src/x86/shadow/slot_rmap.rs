//! The operations on the SPTEs the memslot rmaps ([`SlotRmaps`]) list:
//! `rmap_add()` / `rmap_remove()`, zapping a gfn's mappings (`kvm_zap_all_rmap_sptes()`) and
//! write-protecting them (`rmap_write_protect()`).

use crate::kvm::host_caches::{HostCaches, MetaLine};
use crate::kvm::memslot::Memslot;
use crate::kvm::meter::Meter;
use crate::units::*;
use crate::x86::shadow::mmu_page::*;
use crate::x86::shadow::rmap::*;
use crate::x86::shadow::state::*;
use crate::x86::spte::{Level, X86Level, KVM_MAX_HUGEPAGE_LEVEL, PG_LEVEL_4K};
use std::collections::BTreeMap;
use std::sync::Arc;

/// `gfn_to_rmap()` read-only over the memslots' rmaps `rmaps`.
#[inline]
fn head_in(rmaps: &BTreeMap<u64, SlotRmaps>, gfn: Gfn, level: Level) -> Option<&KvmRmapHead> {
    let (_, r) = rmaps.range(..=gfn.0).next_back()?;
    (gfn < r.end_gfn()).then(|| &r.rmap[level.0 as usize - 1][gfn_to_index(gfn, r.base_gfn, level)])
}

/// `sizeof(struct pte_list_desc)`: 128 bytes, as [`PteListDesc`] is laid out.
const PTE_LIST_DESC_BYTES: u64 = std::mem::size_of::<PteListDesc>() as u64;

impl ShadowState {
    /// The rmaps of the slot holding `gfn`.
    pub fn rmaps_for_gfn(&mut self, gfn: Gfn) -> Option<&mut SlotRmaps> {
        self.rmaps
            .range_mut(..=gfn.0)
            .next_back()
            .map(|(_, r)| r)
            .filter(|r| gfn < r.end_gfn())
    }

    /// `gfn_to_rmap()` read-only: the rmap of (`gfn`, `level`), if a memslot holds `gfn`.
    pub fn rmap_head(&self, gfn: Gfn, level: Level) -> Option<&KvmRmapHead> {
        head_in(&self.rmaps, gfn, level)
    }

    /// Where the rmap head of (`gfn`, `level`) lives in host memory, once its array was placed
    /// in the host's caches ([`SlotRmaps::place`]).
    pub fn rmap_head_line(&self, gfn: Gfn, level: Level) -> Option<MetaLine> {
        let (_, r) = self.rmaps.range(..=gfn.0).next_back()?;
        let meta = r.meta[level.0 as usize - 1];
        (gfn < r.end_gfn() && !meta.is_unplaced()).then(|| {
            let i = gfn_to_index(gfn, r.base_gfn, level);
            meta.line_of((i * std::mem::size_of::<KvmRmapHead>()) as u64)
        })
    }

    /// The running core touches the rmap head of (`gfn`, `level`) in `caches`, if modelled.
    fn touch_rmap_head(
        &self,
        caches: Option<&HostCaches>,
        gfn: Gfn,
        level: Level,
        meter: &mut Meter,
    ) {
        if let Some(caches) = caches {
            if let Some(line) = self.rmap_head_line(gfn, level) {
                caches.read_line(line, meter);
            }
        }
    }

    /// The running core reads (or writes) the first `limit` descriptors of the rmap of
    /// (`gfn`, `level`), head first, where the host's caches are modelled: every line of each
    /// (a walk of the chain reads all of them; `pte_list_add()` only the head one;
    /// `pte_list_remove()` those up to the one holding the entry). A descriptor met for the
    /// first time is placed in the running core's slab page: it was just allocated there
    /// (`rmap_add()` touches the head right after adding to it).
    pub(super) fn touch_rmap_descs(
        &mut self,
        gfn: Gfn,
        level: Level,
        limit: usize,
        meter: &mut Meter,
    ) {
        let ShadowState {
            caches,
            rmaps,
            desc_meta,
            desc_slab,
            ..
        } = self;
        let Some(caches) = caches.as_deref() else {
            return;
        };
        let Some(head) = head_in(rmaps, gfn, level) else {
            return;
        };
        for addr in head.desc_addrs().take(limit) {
            let desc = *desc_meta
                .entry(addr)
                .or_insert_with(|| desc_slab.zalloc(caches));
            let (first, last) = (desc.line_of(0), desc.line_of(PTE_LIST_DESC_BYTES - 1));
            for line in first.line..=last.line {
                caches.read_line(MetaLine { line, ..first }, meter);
            }
        }
    }

    /// The rmaps of `slot`, allocated on first use (`memslot_rmap_alloc()` runs when the slot
    /// is created; a slot the MMU never touched needs none).
    pub fn slot_rmaps(&mut self, slot: &Memslot) -> &mut SlotRmaps {
        self.rmaps
            .entry(slot.base_gfn.0)
            .or_insert_with(|| SlotRmaps::new(slot))
    }

    /// `kvm_arch_free_memslot()`'s rmap part: frees the rmaps of memslots not in `slots`. They
    /// are empty, because a memslot is zapped before it is deleted.
    pub fn free_stale_slot_rmaps(&mut self, slots: &[Arc<Memslot>]) {
        let live: Vec<u64> = slots.iter().map(|s| s.base_gfn.0).collect();
        let gone: Vec<u64> = self
            .rmaps
            .keys()
            .copied()
            .filter(|k| !live.contains(k))
            .collect();
        for k in gone {
            let mut r = self.rmaps.remove(&k).expect("listed");
            for level in r.rmap.iter_mut() {
                for h in level.iter_mut() {
                    debug_assert!(
                        h.is_empty(),
                        "rmap of a deleted memslot still maps something"
                    );
                    for addr in h.desc_addrs() {
                        self.desc_meta.remove(&addr);
                    }
                    pte_list_free(h);
                }
            }
        }
    }

    /// `rmap_remove()`: forgets the leaf `sptep` (whose page and index give its gfn).
    pub(super) fn rmap_remove(&mut self, sptep: SptepRef, meter: &mut Meter) {
        let (gfn, level) = {
            let sp = self.sp(sptep.sp);
            (sp.get_gfn(sptep.index), sp.role.level())
        };
        let walked = self.rmap_head(gfn, level).map_or(0, |h| h.descs_to(sptep));
        self.touch_rmap_descs(gfn, level, walked, meter);
        // The only descriptor a removal can free is the head one (KVM moves the head's last
        // entry into the hole and frees the head once it is empty).
        let head_desc = self.placed_head_desc(gfn, level);
        let rmaps = self
            .rmaps_for_gfn(gfn)
            .unwrap_or_else(|| panic!("{gfn:?} is mapped but no memslot rmap holds it"));
        meter.rmap_desc_steps += pte_list_remove(sptep, rmaps.head(gfn, level)) as u64;
        meter.rmap_removes += 1;
        if let Some(addr) = head_desc {
            if !self
                .rmap_head(gfn, level)
                .is_some_and(|h| h.desc_addrs().any(|a| a == addr))
            {
                self.desc_meta.remove(&addr);
            }
        }
    }

    /// The head descriptor of the rmap of (`gfn`, `level`), if it has one placed in the host's
    /// caches (which must forget it when it is freed, so that where the next descriptor at its
    /// address lives depends only on the model's own steps, not on the process's allocator).
    fn placed_head_desc(&self, gfn: Gfn, level: Level) -> Option<u64> {
        if self.desc_meta.is_empty() {
            return None;
        }
        self.rmap_head(gfn, level)?
            .desc_addrs()
            .next()
            .filter(|a| self.desc_meta.contains_key(a))
    }

    /// `kvm_zap_all_rmap_sptes()`: clears every leaf in the rmap of (`gfn`, `level`).
    /// Returns whether anything was zapped.
    pub fn zap_rmap(&mut self, gfn: Gfn, level: Level, meter: &mut Meter) -> bool {
        self.touch_rmap_descs(gfn, level, usize::MAX, meter);
        // pte_list_destroy() frees every descriptor of the chain.
        if !self.desc_meta.is_empty() {
            let ShadowState {
                rmaps, desc_meta, ..
            } = self;
            for addr in head_in(rmaps, gfn, level)
                .into_iter()
                .flat_map(|h| h.desc_addrs())
            {
                desc_meta.remove(&addr);
            }
        }
        let Some(rmaps) = self.rmaps_for_gfn(gfn) else {
            return false;
        };
        let head = rmaps.head(gfn, level);
        meter.rmap_reads += 1;
        if head.is_empty() {
            return false;
        }
        let mut sptes = Vec::new();
        pte_list_destroy(head, |s| sptes.push(s));
        for s in sptes {
            self.touch_spte(s, meter);
            self.spte_clear_track_bits(self.sptep(s), level, meter);
            meter.rmap_removes += 1;
        }
        true
    }

    /// `rmap_write_protect()` of the rmap of (`gfn`, `level`). Returns whether a flush is
    /// needed.
    pub fn rmap_write_protect(
        &mut self,
        gfn: Gfn,
        level: Level,
        pt_protect: bool,
        meter: &mut Meter,
    ) -> bool {
        self.touch_rmap_descs(gfn, level, usize::MAX, meter);
        let Some(head) = self.rmap_head(gfn, level) else {
            return false;
        };
        meter.rmap_reads += 1;
        let mut flush = false;
        for s in head.iter() {
            meter.spte_reads += 1;
            self.touch_spte(s, meter);
            flush |= Self::spte_write_protect(self.sptep(s), pt_protect, meter);
        }
        flush
    }

    /// `__rmap_clear_dirty()` of the rmap of (`gfn`, `level`): clear D on each of its leaves so
    /// the CPU logs the next write (PML). Returns whether a D was cleared.
    pub fn rmap_clear_dirty(&mut self, gfn: Gfn, level: Level, meter: &mut Meter) -> bool {
        self.touch_rmap_descs(gfn, level, usize::MAX, meter);
        let Some(head) = self.rmap_head(gfn, level) else {
            return false;
        };
        meter.rmap_reads += 1;
        let mut flush = false;
        for s in head.iter() {
            meter.spte_reads += 1;
            self.touch_spte(s, meter);
            flush |= Self::spte_clear_dirty(self.sptep(s), meter);
        }
        flush
    }

    /// `kvm_mmu_write_protect_pt_masked()` (`wrprot`: clear W, keeping MMU-writable) or
    /// `kvm_mmu_clear_dirty_pt_masked()` (clear D, with PML) on the 4K leaves of the gfns at
    /// `gfn_offset` in `slot` whose bits are set in `mask`. Returns whether an SPTE changed.
    pub fn clear_pt_masked(
        &mut self,
        slot: &Memslot,
        gfn_offset: u64,
        mut mask: u64,
        wrprot: bool,
        caches: Option<&HostCaches>,
        meter: &mut Meter,
    ) -> bool {
        let mut flush = false;
        while mask != 0 {
            let gfn = slot.base_gfn + gfn_offset + mask.trailing_zeros() as u64;
            self.touch_rmap_head(caches, gfn, PG_LEVEL_4K, meter);
            flush |= if wrprot {
                self.rmap_write_protect(gfn, PG_LEVEL_4K, false, meter)
            } else {
                self.rmap_clear_dirty(gfn, PG_LEVEL_4K, meter)
            };
            mask &= mask - 1;
        }
        flush
    }

    /// `kvm_mmu_slot_gfn_write_protect()` (shadow part): write-protect (W and MMU-writable)
    /// every mapping of `gfn` at `min_level` and above.
    pub fn gfn_write_protect(&mut self, gfn: Gfn, min_level: Level, meter: &mut Meter) -> bool {
        let mut write_protected = false;
        let mut level = min_level;
        while level <= KVM_MAX_HUGEPAGE_LEVEL {
            write_protected |= self.rmap_write_protect(gfn, level, true, meter);
            level = level.above();
        }
        write_protected
    }
}

impl LockedMmu<'_> {
    /// `__rmap_add()`: records that the leaf `sptep` maps `gfn` with `access`. A gfn with more
    /// than `RMAP_RECYCLE_THRESHOLD` mappings has them all zapped.
    pub fn rmap_add(
        &mut self,
        cache: &mut PteListDescCache,
        slot: &Memslot,
        sptep: SptepRef,
        gfn: Gfn,
        access: u8,
    ) {
        let SptepRef { sp: id, index } = sptep;
        self.st.sp_mut(id).set_translation(index, gfn, access);
        let level = self.st.sp(id).role.level();
        account_leaf(&self.st.pages, level, 1);
        self.st
            .touch_rmap_head(self.kvm.caches(), gfn, level, self.meter);
        let head = self.st.slot_rmaps(slot).head(gfn, level);
        let count = pte_list_add(cache, sptep, head);
        self.st.touch_rmap_descs(gfn, level, 1, self.meter);
        self.meter.rmap_adds += 1;
        self.st.max_mmu_rmap_size = self.st.max_mmu_rmap_size.max(count as u64);
        if count > RMAP_RECYCLE_THRESHOLD {
            self.st.zap_rmap(gfn, level, self.meter);
            crate::x86::mmu::kvm_flush_remote_tlbs_gfn(self.kvm, gfn, level, self.meter);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::backing::Backing;
    use crate::hw::cache::CASCADE_LAKE_8275CL;
    use crate::hw::page_table::PageTableStats;
    use crate::kvm::host_caches::Cpu;
    use crate::x86::shadow::sptep::SpId;

    #[test]
    fn an_rmaps_descriptors_live_where_they_were_added_and_a_walk_reads_each_line() {
        let mut st = ShadowState::new(Arc::new(PageTableStats::default()), Arc::default(), true);
        let caches = Arc::new(HostCaches::new(&CASCADE_LAKE_8275CL, 1, vec![0, 0]));
        st.place_in(&caches);
        let slot = Memslot::new(1, Gfn(0), 512, Backing::Anonymous, Pfn(0), 0);
        let mut cache = PteListDescCache::new(4);
        cache.topup(4);
        let gfn = Gfn(3);
        // One gfn mapped by 16 SPTEs (as aliases of a guest page would): the first in the
        // head, then a descriptor of 14, then a second; each touched as rmap_add() does.
        let mut m = Meter::default();
        for i in 0..16 {
            let head = st.slot_rmaps(&slot).head(gfn, PG_LEVEL_4K);
            pte_list_add(&mut cache, SptepRef::new(SpId(0), i), head);
            st.touch_rmap_descs(gfn, PG_LEVEL_4K, usize::MAX, &mut m);
        }
        assert_eq!(st.desc_meta.len(), 2);
        assert_eq!(m, Meter::default(), "zeroed by this core: in its L2");
        // Another core walks the chain: the newer descriptor (two lines after the older one in
        // the slab page) then the older: two streams of two lines, each from the LLC.
        caches.run_on(Cpu { core: 1, socket: 0 });
        let mut m = Meter::default();
        st.touch_rmap_descs(gfn, PG_LEVEL_4K, usize::MAX, &mut m);
        assert_eq!(m.llc_hits, 4, "{m:?}");
        // No caches, nothing counted.
        let mut bare = ShadowState::new(Arc::new(PageTableStats::default()), Arc::default(), true);
        let head = bare.slot_rmaps(&slot).head(gfn, PG_LEVEL_4K);
        pte_list_add(&mut cache, SptepRef::new(SpId(0), 0), head);
        let mut m = Meter::default();
        bare.touch_rmap_descs(gfn, PG_LEVEL_4K, usize::MAX, &mut m);
        assert!(bare.desc_meta.is_empty() && m == Meter::default());
    }
}
