//! Per-actor work counters. MMU code counts what it does here (entries written, tables allocated,
//! cmpxchg retries, flushes, faults by kind) instead of reading a clock; the threads engine
//! reports them, and the virtual-time engine turns them into time with a cost model.

use std::collections::BTreeMap;

macro_rules! meter {
    ($( $(#[doc = $doc:expr])* $name:ident ),* $(,)?) => {
        /// Work done by one actor (a vCPU or the VMM thread). Plain integers: each actor owns its
        /// meter, so counting costs no atomics.
        #[derive(Clone, Debug, Default, PartialEq, Eq)]
        pub struct Meter {
            $( $(#[doc = $doc])* pub $name: u64, )*
        }

        /// Each `Meter` field as an index into [`METER_FIELDS`] and [`Meter::counts`].
        #[allow(non_camel_case_types)]
        #[derive(Copy, Clone, Debug, PartialEq, Eq)]
        pub enum MeterField {
            $( $(#[doc = $doc])* $name, )*
        }

        /// Every `Meter` field name, in declaration order.
        pub const METER_FIELDS: &[&str] = &[$(stringify!($name)),*];

        /// Number of `Meter` fields.
        pub const NR_METER_FIELDS: usize = METER_FIELDS.len();

        impl Meter {
            /// The counters in [`METER_FIELDS`] order. The pattern names every field, so code
            /// that prices each field cannot miss a new one.
            pub fn counts(&self) -> [u64; NR_METER_FIELDS] {
                let Meter { $($name),* } = self;
                [$(*$name),*]
            }

            /// The sum of every counter times its weight in `weights` ([`METER_FIELDS`] order),
            /// in wrapping arithmetic: read from the fields in place, so the difference of two
            /// meters' sums is, bit for bit, the sum over their differences.
            #[inline]
            pub fn wrapping_dot(&self, weights: &[u64; NR_METER_FIELDS]) -> u64 {
                0u64 $( .wrapping_add(self.$name.wrapping_mul(weights[MeterField::$name as usize])) )*
            }

            /// A meter with the given counters, in [`METER_FIELDS`] order.
            pub fn from_counts(c: [u64; NR_METER_FIELDS]) -> Meter {
                Meter { $($name: c[MeterField::$name as usize]),* }
            }

            /// Adds `other` into `self`.
            pub fn add(&mut self, other: &Meter) {
                $( self.$name += other.$name; )*
            }
            /// `self - earlier`, field by field (saturating).
            pub fn since(&self, earlier: &Meter) -> Meter {
                Meter { $( $name: self.$name.saturating_sub(earlier.$name), )* }
            }
            /// The counters as a name → value map (for reports).
            pub fn to_map(&self) -> BTreeMap<String, u64> {
                let mut m = BTreeMap::new();
                $( m.insert(stringify!($name).to_string(), self.$name); )*
                m
            }
        }
    };
}

meter! {
    /// Guest reads performed.
    guest_reads,
    /// Guest writes performed.
    guest_writes,
    /// Cache lines guest accesses moved to or from DRAM: the model has no data cache, so an
    /// access whose translation was in no TLB level (a page not touched lately) is taken to
    /// read its line from DRAM, and a write to write it back later. A shared resource: the
    /// virtual-time engine queues these lines on their socket's bandwidth.
    dram_lines,
    /// Nanoseconds guest accesses waited for DRAM bandwidth the other vCPUs of their socket
    /// were using (counted by the virtual-time engine, which adds the wait to the vCPU's clock).
    dram_stall_ns,
    /// Lines of KVM's own data (the metadata the host's cache model follows,
    /// `crate::kvm::host_caches`) that missed the reading core's L2 and were found in its
    /// socket's last-level cache, where no prefetcher had them in flight.
    llc_hits,
    /// Lines of KVM's own data read from memory where no prefetcher had them in flight (the
    /// first two lines of a sequential scan).
    memory_lines,
    /// Lines of KVM's own data a sequential scan read from memory with the prefetcher running
    /// ahead: each costs what one line of a stream from memory costs.
    memory_lines_streamed,
    /// Lines of KVM's own data read from another socket's memory where no prefetcher had them
    /// in flight (as `memory_lines`, for a line allocated on the other socket).
    remote_memory_lines,
    /// Lines of KVM's own data a sequential scan streamed from another socket's memory (as
    /// `memory_lines_streamed`).
    remote_memory_lines_streamed,
    /// Guest lines fetched from, or (for a write) later written back to, another socket's
    /// memory: the guest page lives on the socket of the vCPU that first faulted it in, and
    /// another socket's vCPU reached it (each line is also in `dram_lines`; the write-back is
    /// priced with the access that caused it).
    guest_remote_lines,
    /// Accesses translated by the TLB without a walk.
    tlb_hits,
    /// Of those, the hits that missed the first-level TLB and hit the second level.
    tlb_l2_hits,
    /// Hardware page walks (TLB misses, and D-bit updates).
    hw_walks,
    /// Entries read by hardware walks.
    hw_walk_levels,
    /// Guest stage-1 entries read above the leaf (0 to 3 a walk, as far as no walk entry
    /// shortened it: `crate::hw::guest_tables`).
    s1_walk_levels,
    /// Stage-2 (EPT) entries read to translate the guest's own table pages on stage-1 walks
    /// (the two-dimensional walk, `crate::hw::guest_tables`).
    s1_table_s2_levels,
    /// TLB flushes executed by this vCPU on request.
    tlb_flushes,
        /// VM exits of any kind (EPT violations, kicks, syncs to userspace); each pairs with an entry.
    vm_exits,
    /// EPT violations taken (VM exits into the fault handler).
    ept_violations,
    /// Faults fixed by `fast_page_fault()` without `mmu_lock`.
    pf_fast_fixed,
    /// Faults found already fixed (`RET_PF_SPURIOUS`; arm64's `-EAGAIN` from the stage-2
    /// walk), fast or slow path: another vCPU's fault on the page got there first (the vCPUs
    /// met on it), or the TLB held an entry since changed.
    pf_spurious,
    /// Faults that took `mmu_lock`.
    pf_slow,
    /// Slow faults that had to be retried (`RET_PF_RETRY`).
    pf_retry,
    /// Leaves installed at 4K by faults.
    pf_map_4k,
    /// Leaves installed at 2M by faults.
    pf_map_2m,
    /// Leaves installed at 1G by faults.
    pf_map_1g,
    /// Huge SPTEs split by vCPU faults (one count per level split).
    split_in_fault,
    /// Huge SPTEs split eagerly by the VMM thread.
    split_eager,
    /// Non-leaf SPTEs replaced by a huge leaf when dirty logging was disabled.
    huge_recovered,
    /// Entries read by KVM's software walks (tdp_iter steps).
    spte_reads,
    /// Entries written (plain stores, xchg or successful cmpxchg).
    spte_writes,
    /// cmpxchg attempts that lost a race.
    cmpxchg_failed,
    /// Page tables allocated.
    tables_allocated,
    /// Page tables freed (handed to RCU or dropped unused).
    tables_freed,
    /// Leaves write-protected for dirty logging.
    sptes_wrprot,
    /// Leaves whose Dirty flag KVM cleared so the CPU logs the next write (PML).
    sptes_dirty_cleared,
    /// Guest-physical addresses the CPU wrote into a vCPU's page-modification log when it set
    /// a Dirty flag (Intel PML).
    pml_logged,
    /// PML-full VM exits: an access that would set a Dirty flag found the log full.
    pml_full_exits,
    /// Page-modification-log entries KVM read on a VM exit and marked dirty
    /// (`vmx_flush_pml_buffer()`).
    pml_drained,
    /// vCPUs kicked without waiting so that they empty their page-modification logs
    /// (`kvm_arch_sync_dirty_log()` before GET and CLEAR).
    dirty_log_kicks,
        /// Pages marked dirty in a memslot bitmap or ring.
    pages_dirtied,
    /// 64-page words of a dirty bitmap read, exchanged or cleared by GET/CLEAR.
    bitmap_words,
    /// `kvm_flush_remote_tlbs*()` calls.
    remote_flushes,
    /// vCPUs kicked out of guest mode by `kvm_make_all_cpus_request()`: remote flushes and
    /// other requests (each waits for an ack).
    flush_kicks,
    /// rmap heads read by the shadow MMU's rmap walks (`for_each_slot_rmap_range`).
    rmap_reads,
    /// SPTEs added to an rmap list (`pte_list_add()`: leaf rmaps and `parent_ptes`).
    rmap_adds,
    /// SPTEs removed from an rmap list (`pte_list_remove()`).
    rmap_removes,
    /// Shadow-page hash lookups (`kvm_mmu_find_shadow_page()`, `for_each_gfn_valid_sp*()`).
    sp_lookups,
    /// Pages visited walking hash buckets in those lookups (one pointer chase each).
    sp_hash_steps,
    /// Shadow pages zapped (`__kvm_mmu_prepare_zap_page()`).
    sp_zapped,
    /// Guest page-table entries read by KVM's software walk of the guest's tables
    /// (`FNAME(walk_addr_generic)`, shadow paging only).
    guest_pte_reads,
    /// Guest writes KVM emulated because they hit a write-protected guest page table.
    pf_emulated,
    /// Entries of unsync shadow pages re-read from the guest's table (`FNAME(sync_spte)`).
    sptes_synced,
    /// Times a long operation released `mmu_lock` because someone waited (counted by the
    /// engine that released it).
    lock_yields,
    /// Times a long operation released `mmu_lock` to allocate memory (counted by the engine).
    lock_drops_for_alloc,
    /// Broadcast TLB maintenance instructions issued (arm64 `TLBI ...IS`).
    tlbi_ops,
    /// `DSB ISH` barriers that waited for broadcast TLB maintenance to complete everywhere.
    dsb_waits,
    /// Non-shareable TLB maintenance on the issuing PE only (arm64 `TLBI ...E1` with
    /// `DSB NSH`).
    tlbi_local_ops,
    /// Cache lines cleaned and invalidated to the point of coherency before a new stage-2
    /// mapping is installed (`dcache_clean_inval_poc()`, needed without FEAT_S2FWB).
    cmo_lines,
    /// Cache lines a contended `mmu_lock` hand-off moved to this actor's core from another core
    /// of its socket: the lock word for its acquire and release atomics, and the VM-wide leaf
    /// counters its critical section wrote (counted by the virtual-time engine).
    lock_line_transfers,
    /// Of the cache-line transfers a contended `mmu_lock` hand-off costs, those between cores
    /// of different sockets (counted by the virtual-time engine, which places the actors).
    lock_line_transfers_remote,
    /// arm64 stage-2 translation faults at level 0 (ESR fault status: translation, level 0).
    s2_xlat_fault_l0,
    /// Stage-2 translation faults at level 1.
    s2_xlat_fault_l1,
    /// Stage-2 translation faults at level 2.
    s2_xlat_fault_l2,
    /// Stage-2 translation faults at level 3.
    s2_xlat_fault_l3,
    /// Stage-2 permission faults on a level-1 (1 GiB) block.
    s2_perm_fault_l1,
    /// Stage-2 permission faults on a level-2 (2 MiB) block.
    s2_perm_fault_l2,
    /// Stage-2 permission faults on a level-3 page.
    s2_perm_fault_l3,
    /// Stage-2 access flag faults.
    s2_access_fault,
    /// Nested transitions KVM performed: entering a nested guest for L1 (`nested_vmx_run()`)
    /// and leaving it to L1 (`nested_vmx_vmexit()`), each switching between vmcs01 and vmcs02.
    nested_transitions,
    /// rmap descriptors visited past the head one when removing an SPTE from a long rmap
    /// (`pte_list_remove()`'s walk of the `pte_list_desc` chain, a dependent load each).
    rmap_desc_steps,
    /// MMU notifier callbacks KVM handled (invalidations, aging).
    mmu_notifier_calls,
    /// Leaves whose Accessed flag aging cleared (an atomic AND each).
    sptes_aged,
    /// Guest pages a fault read back from the host's swap device (`do_swap_page()` /
    /// `shmem_swapin_folio()`, a synchronous read).
    swap_ins,
    /// Guest pages a fault populated with a zeroed host page (first touch).
    pages_populated,
    /// Reads of untouched private anonymous memory the host answered with its shared zero
    /// page (`do_anonymous_page()` without `FAULT_FLAG_WRITE`).
    zero_pages_mapped,
    /// Zero pages the host copied for a first write (`wp_page_copy()`).
    pages_copied,
    /// Transparent huge pages the host allocated and cleared for a first write
    /// (`do_huge_pmd_anonymous_page()`).
    huge_pages_populated,
    /// Huge zero folios the host split into zero-page PTEs for a first write
    /// (`__split_huge_zero_page_pmd()`).
    huge_zero_splits,
    /// Present host PTEs of 4 KiB pages cleared by `munmap()` (`zap_pte_range()`).
    host_ptes_zapped,
    /// 4 KiB pages of its own a `munmap()` freed (the zero page is never freed).
    host_pages_freed,
    /// Huge host mappings cleared by `munmap()`: a THP's or the huge zero folio's PMD
    /// (`zap_huge_pmd()`), a hugetlbfs page's huge PTE (`__unmap_hugepage_range()`).
    host_huge_zapped,
    /// Huge pages a `munmap()` freed: a THP back to the buddy allocator, a hugetlbfs page back
    /// to its pool (`free_huge_folio()`).
    host_huge_pages_freed,
    /// The host's own TLB flushes at the end of a `munmap()` (`tlb_finish_mmu()`) on x86: a
    /// local flush, no other CPU using the mm once the vCPU threads have exited (arm64's is a
    /// broadcast `TLBI ASIDE1IS` and its `DSB ISH`, counted in `tlbi_ops` and `dsb_waits`).
    host_tlb_flushes,
    /// `kvm_unmap_hva_range` events: MMU-notifier invalidations of guest memory the host
    /// started (`kvm_mmu_notifier_invalidate_range_start()`), here for copy-on-write.
    unmap_hva_range,
    /// `kvm_set_spte_hva` events: the host's `change_pte` callbacks
    /// (`kvm_mmu_notifier_change_pte()`), on the kernels that had it.
    set_spte_hva,
    /// Scheduling-clock interrupts the vCPU's CPU took (`HZ` a second), each with the VM exit
    /// and entry it causes in guest mode (counted in `vm_exits`).
    host_ticks,
    /// Ticks on which this CPU also kept time (`tick_do_update_jiffies64()` and
    /// `update_wall_time()` on `tick_do_timer_cpu`).
    jiffies_updates,
    /// `sem_post()`s that woke a waiting thread (`futex(FUTEX_WAKE)`), made by the host to
    /// start a pass of kvm_page_table_test.
    futex_wakes,
    /// Faults whose host page allocation found free memory at the min watermark and retried.
    alloc_stalls,
    /// Host pages written to the swap device by reclaim (`pageout()`).
    swap_outs,
    /// Folios reclaim took off, sorted on, or put back on an LRU list under `lru_lock`.
    lru_folios_scanned,
    /// Reverse-map walks from a folio to the PTEs that map it (`rmap_walk_file()` for
    /// `folio_referenced()` and `try_to_unmap()`).
    rmap_walks,
    /// Host PTEs read by MGLRU's page-table walks and look-around.
    host_ptes_scanned,
    /// System calls a host thread made on small files (`/proc/self/pagemap`,
    /// `/sys/kernel/mm/page_idle/bitmap`), beyond the kernel work they lead to.
    host_syscalls,
}

impl Meter {
    /// Counts what a line of KVM's data cost in the host's caches.
    #[inline]
    pub fn count_line(&mut self, cost: crate::hw::cache::LineCost) {
        use crate::hw::cache::LineCost;
        match cost {
            LineCost::Free => {}
            LineCost::LlcHit => self.llc_hits += 1,
            LineCost::Memory => self.memory_lines += 1,
            LineCost::MemoryStreamed => self.memory_lines_streamed += 1,
            LineCost::RemoteMemory => self.remote_memory_lines += 1,
            LineCost::RemoteMemoryStreamed => self.remote_memory_lines_streamed += 1,
        }
    }
}

/// KVM software's walks count the entries they read as `spte_reads`. A bare meter does not
/// see the host's caches: walks that should ([`crate::kvm::mmu_ctx::MmuCtx`], the stage-2
/// walker) count through a context that does.
impl crate::hw::pgtable::walk::CountReads for Meter {
    #[inline]
    fn pte_read(&mut self, _table: &crate::hw::page_table::PageTable, _index: usize) {
        self.spte_reads += 1;
    }
}
