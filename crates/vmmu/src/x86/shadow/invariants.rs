//! The shadow MMU's invariant checker: rmap ↔ SPTE consistency, `parent_ptes` consistency,
//! the page hash and active list, the quota, writable triples, unsync bookkeeping, page stats,
//! and no stale pages or rmaps for memory no memslot holds. Runs with no other actor active.

use crate::kvm::Kvm;
use crate::units::*;
use crate::x86::shadow::inner::ShadowInner;
use crate::x86::shadow::mmu_page::{KvmMmuPage, SpId, SptepRef};
use crate::x86::shadow::rmap::check_rmap;
use crate::x86::shadow::state::ShadowState;
use crate::x86::spte::*;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

/// Every violated invariant, one line each.
pub fn check(inner: &ShadowInner, kvm: &Kvm) -> Vec<String> {
    let mut errors = Vec::new();
    let st = inner.lock_state_quiescent();
    let slots = kvm.all_slots();
    let slot_of = |gfn: Gfn| slots.iter().find(|s| s.contains(gfn));
    let mut leaves = [0i64; 3];
    // Leaves counted in the tables, and every non-leaf (address → child). Leaves are not
    // collected: each rmap entry is checked against its page directly, and equal counts then
    // make the rmaps a bijection onto the leaves (no entry twice, each in its gfn's head).
    let mut nr_leaves = 0u64;
    let mut nonleaf: HashMap<SptepRef, SpId> = HashMap::new();
    let ids: Vec<SpId> = st.live_sps().map(|(id, _)| id).collect();
    for &id in &ids {
        let sp = st.sp(id);
        let level = sp.role.level();
        if sp.role.invalid() && sp.root_count == 0 {
            errors.push(format!(
                "{:?} {:?} is invalid but was never freed",
                sp.role, sp.gfn
            ));
        }
        // After a memslot is deleted, KVM (kvm_mmu_zap_memslot()) zaps every leaf in it and
        // every page shadowing a guest table on its gfns; direct pages stay, empty. A valid
        // page shadowing a table no memslot holds is stale.
        if sp.has_gptes() && !sp.role.invalid() && slot_of(sp.gfn).is_none() {
            errors.push(format!(
                "stale page: {:?} shadows a guest table at {:?}, which no memslot holds",
                sp.role, sp.gfn
            ));
        }
        if sp.unsync && (level != PG_LEVEL_4K || sp.role.direct()) {
            errors.push(format!(
                "{:?} {:?} is unsync but only last-level indirect pages may be",
                sp.role, sp.gfn
            ));
        }
        let bits: u32 = sp.unsync_child_bitmap.iter().map(|w| w.count_ones()).sum();
        if bits != sp.unsync_children {
            errors.push(format!(
                "{:?} {:?}: unsync_children {} but {} bits set",
                sp.role, sp.gfn, sp.unsync_children, bits
            ));
        }
        for i in 0..SPTE_ENT_PER_PAGE {
            let sptep = &sp.spt().spt[i];
            let spte = sptep.load(Ordering::Relaxed);
            if !is_shadow_present_pte(spte) {
                continue;
            }
            let this = SptepRef::new(id, i);
            if is_last_spte(spte, level) {
                if let Err(e) = check_spte_writable_invariants(spte) {
                    errors.push(format!("{:?} index {i}: {e}", sp.role));
                }
                let gfn = sp.get_gfn(i);
                nr_leaves += 1;
                if level <= KVM_MAX_HUGEPAGE_LEVEL {
                    leaves[level.0 as usize - 1] += 1;
                }
                match slot_of(gfn) {
                    None => errors.push(format!(
                        "stale leaf: {gfn:?} at {level:?} is mapped but no memslot holds it"
                    )),
                    Some(slot) => {
                        if spte_to_pfn(spte) != kvm.host_pfn(slot, gfn) {
                            errors.push(format!(
                                "{gfn:?}: leaf maps pfn {:#x}, the memslot says {:#x}",
                                spte_to_pfn(spte).0,
                                kvm.host_pfn(slot, gfn).0
                            ));
                        }
                        if level > crate::x86::mmu::max_mapping_level(kvm, slot, gfn) {
                            errors.push(format!(
                                "{gfn:?} mapped at {level:?}, above what its memslot allows"
                            ));
                        }
                        if crate::host::memory::HostMemory::is_zero_pfn(spte_to_pfn(spte))
                            && is_writable_pte(spte)
                        {
                            errors.push(format!("{gfn:?}: maps the host's zero page writable"));
                        }
                        // A writable leaf in a logged slot must have every page it maps
                        // dirty: marked when it was made writable, or set from the start
                        // (initially-all-set leaves huge writable leaves until the first
                        // CLEAR). With PML a writable 4K leaf whose D is clear is logged by
                        // the CPU when written (checked with every vCPU's PML log empty); a
                        // huge one is not, since one D covers all its pages.
                        let logged_by_pml = kvm.cpu_dirty_log_size() > 0
                            && level == PG_LEVEL_4K
                            && !is_dirty_spte(spte);
                        if slot.dirty_track_enabled()
                            && is_writable_pte(spte)
                            && !logged_by_pml
                            && kvm.dirty_rings.get().is_none()
                        {
                            let first = gfn.round_for_level(level).max(slot.base_gfn);
                            let end =
                                (gfn.round_for_level(level) + level.pages()).min(slot.end_gfn());
                            let clean = (first.0..end.0).find(|g| {
                                let rel = g - slot.base_gfn.0;
                                let w = slot
                                    .bitmap_word((rel / 64) as usize)
                                    .load(Ordering::Relaxed);
                                w & (1 << (rel % 64)) == 0
                            });
                            if let Some(g) = clean {
                                errors.push(format!("{gfn:?}: writable {level:?} leaf in a dirty-logged memslot but gfn {g:#x} is not dirty in its bitmap"));
                            }
                        }
                        // Writable only if no upper-level guest table is there and every page
                        // shadowing it went unsync (mmu_try_to_unsync_pages()).
                        let shadowed_sync = || {
                            st.valid_sps_for_gfn(gfn).into_iter().any(|p| {
                                let sp = st.sp(p);
                                sp.has_gptes() && !sp.unsync
                            })
                        };
                        if is_writable_pte(spte)
                            && (st.gfn_is_write_tracked(gfn) || shadowed_sync())
                        {
                            errors.push(format!(
                                "{gfn:?} holds a shadowed guest table but is mapped writable"
                            ));
                        }
                    }
                }
            } else {
                let child = st.spte_to_child_sp(spte);
                nonleaf.insert(this, child);
                let c = st.sp(child);
                if c.role.level() != level.below() {
                    errors.push(format!(
                        "{:?} index {i} links a page of {:?}",
                        sp.role, c.role
                    ));
                }
                if c.role.invalid() {
                    errors.push(format!("{:?} index {i} links an invalid page", sp.role));
                }
                if !c.parent_ptes.iter().any(|p| p == this) {
                    errors.push(format!(
                        "{:?} index {i} links {:?} {:?}, which does not list it as a parent",
                        sp.role, c.role, c.gfn
                    ));
                }
            }
        }
    }
    // parent_ptes: each parent entry exists and points back.
    for &id in &ids {
        let sp = st.sp(id);
        if let Err(e) = check_rmap(&sp.parent_ptes) {
            errors.push(format!("{:?} {:?} parent_ptes: {e}", sp.role, sp.gfn));
        }
        for p in sp.parent_ptes.iter() {
            if nonleaf.get(&p) != Some(&id) {
                errors.push(format!(
                    "{:?} {:?} lists parent SPTE {p:?}, which does not point to it",
                    sp.role, sp.gfn
                ));
            }
        }
    }
    // rmaps: each entry is a present leaf of that gfn and level, and there are as many
    // entries as leaves.
    let mut nr_rmapped = 0u64;
    let slot_bases: HashSet<u64> = slots.iter().map(|s| s.base_gfn.0).collect();
    for (base, r) in st.rmaps.iter() {
        if !slot_bases.contains(base) {
            errors.push(format!(
                "rmaps of a deleted memslot at gfn {base:#x} are still allocated"
            ));
        }
        for (li, heads) in r.rmap.iter().enumerate() {
            let level = Level(li as u8 + 1);
            for (idx, h) in heads.iter().enumerate() {
                if h.is_empty() {
                    continue;
                }
                match check_rmap(h) {
                    Ok(n) => nr_rmapped += n as u64,
                    Err(e) => errors.push(format!("rmap {level:?} index {idx}: {e}")),
                }
                let head_gfn = Gfn(((base >> level.gfn_shift()) + idx as u64) << level.gfn_shift());
                for s in h.iter() {
                    let sp = st.sp(s.sp);
                    let spte = st.sptep(s).load(Ordering::Relaxed);
                    let gfn = sp.get_gfn(s.index);
                    if !is_shadow_present_pte(spte) || !is_last_spte(spte, sp.role.level()) {
                        errors.push(format!("rmap {level:?} of {head_gfn:?} holds SPTE {s:?}, which is not a present leaf"));
                    } else if sp.role.level() != level || gfn.round_for_level(level) != head_gfn {
                        errors.push(format!(
                            "rmap {level:?} of {head_gfn:?} holds the leaf of {gfn:?} at {:?}",
                            sp.role.level()
                        ));
                    }
                }
            }
        }
    }
    if nr_rmapped != nr_leaves {
        errors.push(format!(
            "{nr_leaves} leaves are mapped but the rmaps hold {nr_rmapped} entries"
        ));
    }
    // The page hash and the active list.
    let active = st.active_list_oldest_first();
    let on_list: HashSet<SpId> = active.iter().copied().collect();
    for &id in &ids {
        let sp = st.sp(id);
        if !sp.role.invalid() && !on_list.contains(&id) {
            errors.push(format!(
                "{:?} {:?} is valid but not on the active list",
                sp.role, sp.gfn
            ));
        }
        if !st.valid_sps_for_gfn(sp.gfn).contains(&id) && !st.is_obsolete_sp(sp) {
            errors.push(format!(
                "{:?} {:?} is not in its hash bucket",
                sp.role, sp.gfn
            ));
        }
    }
    // The quota.
    let unsync = ids.iter().filter(|&&id| st.sp(id).unsync).count() as u64;
    if st.mmu_unsync != unsync {
        errors.push(format!(
            "mmu_unsync is {} but {unsync} pages are unsync",
            st.mmu_unsync
        ));
    }
    // Every live page counts: valid ones, and zapped roots until their last user puts them.
    if st.n_used_mmu_pages != ids.len() as u64 {
        errors.push(format!(
            "n_used_mmu_pages is {} but {} pages are alive",
            st.n_used_mmu_pages,
            ids.len()
        ));
    }
    if st.n_used_mmu_pages > st.n_max_mmu_pages {
        errors.push(format!(
            "{} shadow pages in use, above the quota of {}",
            st.n_used_mmu_pages, st.n_max_mmu_pages
        ));
    }
    let stats = [0, 1, 2].map(|i| inner.pages.leaves[i].load(Ordering::Relaxed));
    if stats != leaves {
        errors.push(format!(
            "page stats {stats:?} but the tables hold {leaves:?} leaves"
        ));
    }
    if let Some(root) = st.root {
        if st.sp(root).root_count == 0 {
            errors.push("the root page has no root reference".into());
        }
    }
    check_write_tracking(&st, &ids, &mut errors);
    check_nested_ept(&st, kvm, &mut errors);
    errors
}

/// `indirect_shadow_pages`, `gfn_write_track` and `disallow_lpage` count exactly the valid
/// pages that shadow guest tables (`account_shadowed()` on creation, `unaccount_shadowed()`
/// when zapped).
fn check_write_tracking(st: &ShadowState, ids: &[SpId], errors: &mut Vec<String>) {
    let shadowing: Vec<&KvmMmuPage> = ids
        .iter()
        .map(|&id| st.sp(id))
        .filter(|sp| sp.has_gptes() && !sp.role.invalid())
        .collect();
    if st.indirect_shadow_pages != shadowing.len() as u64 {
        errors.push(format!(
            "indirect_shadow_pages is {} but {} valid pages shadow guest tables",
            st.indirect_shadow_pages,
            shadowing.len()
        ));
    }
    if !st.write_tracking {
        return;
    }
    let mut tracked: HashMap<Gfn, u32> = HashMap::new();
    let mut lpage: HashMap<(u8, u64), u32> = HashMap::new();
    for sp in &shadowing {
        if sp.role.level() > PG_LEVEL_4K {
            *tracked.entry(sp.gfn).or_default() += 1;
        }
        for l in [PG_LEVEL_2M, PG_LEVEL_1G] {
            *lpage.entry((l.0, sp.gfn.0 >> l.gfn_shift())).or_default() += 1;
        }
    }
    if tracked != st.gfn_write_track {
        errors.push(format!(
            "gfn_write_track counts {} gfns but {} gfns hold shadowed upper-level tables",
            st.gfn_write_track.len(),
            tracked.len()
        ));
    }
    if lpage != st.disallow_lpage {
        errors.push("disallow_lpage does not count the shadowed guest tables".into());
    }
}

/// Nested EPT: an EPT02 page a vCPU can reach and that is not unsync maps exactly what the
/// EPT12 table it shadows holds: each present entry's EPT12 entry is present and names the
/// same L1 frame (a leaf) or table (a link). KVM keeps this by write-tracking upper tables
/// (their writes are emulated and zap the entry) and unsyncing last-level ones until the next
/// sync; a stale entry is a translation L1 took away.
fn check_nested_ept(st: &ShadowState, kvm: &Kvm, errors: &mut Vec<String>) {
    use crate::x86::guest_paging::{gpte_to_gfn_lvl, GuestMemory, PtType};
    if !st.live_sps().any(|(_, sp)| sp.role.guest_mode()) {
        return;
    }
    let mut ids: Vec<SpId> = st.reachable_sps().into_iter().collect();
    ids.sort_unstable();
    for id in ids {
        let sp = st.sp(id);
        if !sp.role.guest_mode() || sp.unsync || sp.role.direct() {
            continue;
        }
        let level = sp.role.level();
        let pt = crate::x86::shadow::mmu_page::ept12_format(sp.role);
        for i in 0..SPTE_ENT_PER_PAGE {
            let spte = sp.spt().spt[i].load(Ordering::Relaxed);
            if !is_shadow_present_pte(spte) {
                continue;
            }
            let gpa = sp.gfn.to_gpa() + i as u64 * 8;
            let Some(gpte) = kvm.read_gpa_u64(gpa) else {
                errors.push(format!(
                    "EPT02 {:?} at {:?}: its EPT12 table is not in L1 memory",
                    sp.role, sp.gfn
                ));
                break;
            };
            let (what, want) = if is_last_spte(spte, level) {
                ("maps L1 frame", sp.get_gfn(i))
            } else {
                let child = st.sp(st.spte_to_child_sp(spte));
                if child.role.direct() {
                    continue;
                }
                ("links the table at", child.gfn)
            };
            if !pt.is_present(gpte) || gpte_to_gfn_lvl(gpte, PG_LEVEL_4K) != want {
                errors.push(format!(
                    "stale EPT02 entry: {:?} at {:?} index {i} {what} {want:?}, but its EPT12 entry is {gpte:#x}",
                    sp.role, sp.gfn
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::host::backing::Backing;
    use crate::units::Gfn;
    use crate::vm::{MmuKind, Vm, VmConfig};
    use crate::x86::shadow::rmap::pte_list_remove;
    use crate::x86::spte::PG_LEVEL_4K;
    use crate::x86::spte::{is_shadow_present_pte, SpteCell, SHADOW_NONPRESENT_VALUE};

    fn mapped_vm() -> Vm {
        let vm = Vm::new(VmConfig {
            mmu: MmuKind::Shadow { ept: true },
            ..Default::default()
        });
        vm.set_user_memory_region(1, 1 << 30, 1 << 20, Backing::Anonymous, 0)
            .unwrap();
        vm.vcpu_write(0, 1 << 30, 1).unwrap();
        assert!(vm.check_invariants().is_empty());
        vm
    }

    /// The first mapped 4K rmap entry of the test memslot.
    fn first_leaf(vm: &Vm) -> crate::x86::shadow::mmu_page::SptepRef {
        let st = vm.shadow().unwrap().inner().lock_state_quiescent();
        st.rmap_head(Gfn((1 << 30) >> 12), PG_LEVEL_4K)
            .and_then(|h| h.iter().next())
            .expect("the write mapped its page")
    }

    /// With PML a writable 4K leaf whose D is clear is tracked (the CPU logs the write that sets
    /// D): accepted in a logged slot. Once D is set without the page in the bitmap, writes
    /// through it go unlogged: reported (the negative control of the PML exemption).
    #[test]
    fn with_pml_a_writable_leaf_is_accepted_clean_and_reported_dirty_but_unlogged() {
        let vm = Vm::new(VmConfig {
            mmu: MmuKind::Shadow { ept: true },
            pml: true,
            ..Default::default()
        });
        vm.set_user_memory_region(1, 1 << 30, 1 << 20, Backing::Anonymous, 0)
            .unwrap();
        vm.vcpu_write(0, 1 << 30, 1).unwrap();
        vm.set_user_memory_region(
            1,
            1 << 30,
            1 << 20,
            Backing::Anonymous,
            crate::vm::KVM_MEM_LOG_DIRTY_PAGES,
        )
        .unwrap();
        let s = first_leaf(&vm);
        let inner = vm.shadow().unwrap().inner();
        let clean = SpteCell::load(inner.lock_state_quiescent().sptep(s));
        assert!(
            crate::x86::spte::is_writable_pte(clean) && !crate::x86::spte::is_dirty_spte(clean)
        );
        assert!(
            vm.check_invariants().is_empty(),
            "{:#?}",
            vm.check_invariants()
        );
        SpteCell::store(
            inner.lock_state_quiescent().sptep(s),
            clean | crate::x86::spte::SHADOW_DIRTY_MASK,
        );
        let e = vm.check_invariants();
        assert!(
            e.iter().any(|l| l.contains("not dirty in its bitmap")),
            "{e:#?}"
        );
        SpteCell::store(inner.lock_state_quiescent().sptep(s), clean);
    }

    #[test]
    fn a_leaf_missing_from_its_rmap_is_reported() {
        let vm = mapped_vm();
        let s = first_leaf(&vm);
        {
            let mut st = vm.shadow().unwrap().inner().lock_state_quiescent();
            let base = st.rmaps_for_gfn(Gfn((1 << 30) >> 12)).unwrap();
            pte_list_remove(s, base.head(Gfn((1 << 30) >> 12), PG_LEVEL_4K));
        }
        let e = vm.check_invariants();
        assert!(e.iter().any(|l| l.contains("rmaps hold")), "{e:#?}");
        // Put it back so teardown finds a consistent MMU.
        let mut st = vm.shadow().unwrap().inner().lock_state_quiescent();
        let mut cache = crate::x86::shadow::rmap::PteListDescCache::new(1);
        let rm = st.rmaps_for_gfn(Gfn((1 << 30) >> 12)).unwrap();
        crate::x86::shadow::rmap::pte_list_add(
            &mut cache,
            s,
            rm.head(Gfn((1 << 30) >> 12), PG_LEVEL_4K),
        );
    }

    #[test]
    fn an_rmap_entry_for_a_cleared_spte_is_reported() {
        let vm = mapped_vm();
        let s = first_leaf(&vm);
        let inner = vm.shadow().unwrap().inner();
        let old = {
            let st = inner.lock_state_quiescent();
            let old = SpteCell::load(st.sptep(s));
            assert!(is_shadow_present_pte(old));
            SpteCell::store(st.sptep(s), SHADOW_NONPRESENT_VALUE);
            old
        };
        let e = vm.check_invariants();
        assert!(e.iter().any(|l| l.contains("not a present leaf")), "{e:#?}");
        SpteCell::store(inner.lock_state_quiescent().sptep(s), old);
        assert!(vm.check_invariants().is_empty());
    }
}
