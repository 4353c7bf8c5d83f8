//! The model itself: the software cost of each `Meter` field, the [`HardwareCosts`], their
//! defaults, and [`CostModel::nanos`], which prices a meter.

use super::file::{check_cost, CostError};
use crate::kvm::meter::Meter;
use std::collections::BTreeMap;

/// Index of a `Meter` field (short alias used throughout this module).
use crate::kvm::meter::MeterField as F;
pub(super) use crate::kvm::meter::{METER_FIELDS, NR_METER_FIELDS as NF};

/// The counters of `m` in [`METER_FIELDS`] order.
pub(super) fn meter_counts(m: &Meter) -> [u64; NF] {
    m.counts()
}

/// A meter with the given counters (tests).
#[cfg(test)]
pub(super) fn meter_from_counts(c: [u64; NF]) -> Meter {
    Meter::from_counts(c)
}

/// `Meter` fields that count hardware events; only `hardware` costs price them.
pub(super) const HARDWARE_EVENT_FIELDS: [F; 25] = [
    F::dram_lines,
    F::guest_remote_lines,
    F::llc_hits,
    F::memory_lines,
    F::memory_lines_streamed,
    F::remote_memory_lines,
    F::remote_memory_lines_streamed,
    F::dram_stall_ns,
    F::lock_line_transfers_remote,
    F::pml_logged,
    F::dirty_log_kicks,
    F::tlbi_ops,
    F::tlbi_local_ops,
    F::dsb_waits,
    F::cmo_lines,
    F::lock_line_transfers,
    F::vm_exits,
    F::guest_reads,
    F::guest_writes,
    F::tlb_hits,
    F::tlb_l2_hits,
    F::hw_walks,
    F::hw_walk_levels,
    F::s1_walk_levels,
    F::s1_table_s2_levels,
];

/// Hardware events no per-unit cost prices: uses of a shared resource (DRAM bandwidth) that the
/// virtual-time engine turns into waiting by queueing them, and the waits it added.
#[cfg(test)]
pub(super) const QUEUED_EVENT_FIELDS: [F; 2] = [F::dram_lines, F::dram_stall_ns];

pub(super) fn is_hardware_event(i: usize) -> bool {
    HARDWARE_EVENT_FIELDS.iter().any(|f| *f as usize == i)
}

pub(super) fn field_index(name: &str) -> Option<usize> {
    METER_FIELDS.iter().position(|f| *f == name)
}

macro_rules! hardware_costs {
    ($( $(#[doc = $doc:expr])* $name:ident: [$($field:ident),+] ),* $(,)?) => {
        /// Costs of hardware events, in nanoseconds. Each multiplies fixed `Meter` fields (see
        /// the module documentation); this machine cannot measure them, because its guest is
        /// the model's emulation, so `vmmu calibrate` keeps them.
        #[derive(Clone, Debug, PartialEq)]
        pub struct HardwareCosts {
            $( $(#[doc = $doc])* pub $name: f64, )*
        }

        impl HardwareCosts {
            /// The names of the costs as the file spells them, in file order.
            pub const NAMES: &'static [&'static str] = &[$(stringify!($name)),*];

            /// The cost called `name`.
            pub fn get(&self, name: &str) -> Option<f64> {
                match name {
                    $(stringify!($name) => Some(self.$name),)*
                    _ => None,
                }
            }

            pub(super) fn get_mut(&mut self, name: &str) -> Option<&mut f64> {
                match name {
                    $(stringify!($name) => Some(&mut self.$name),)*
                    _ => None,
                }
            }

            /// The `Meter` fields the cost called `name` multiplies.
            pub fn multiplies(name: &str) -> Option<&'static [&'static str]> {
                match name {
                    $(stringify!($name) => Some(&[$(stringify!($field)),+]),)*
                    _ => None,
                }
            }

            fn zero() -> Self {
                HardwareCosts { $($name: 0.0),* }
            }

            /// Each cost with the fields it multiplies.
            fn terms(&self) -> [(f64, &'static [F]); NH] {
                [$( (self.$name, &[$(F::$field),+]) ),*]
            }
        }
    };
}

hardware_costs! {
    /// One VM exit plus the VM entry that resumes the guest (hardware transitions only).
        /// Multiplies `vm_exits` (every exit, whatever its reason, and the entry after it).
    vm_exit_entry_ns: [vm_exits],
    /// What an EPT-violation exit adds beyond the transitions and beyond the MMU code the
    /// `Meter` prices: KVM's exit dispatch and re-entry work and the VMCS reads of the exit
    /// qualification and guest-physical address. Multiplies `ept_violations`.
    ept_violation_ns: [ept_violations],
    /// One entry read by a hardware page walk: a stage-2 (EPT) entry of the accessed page, a
    /// guest stage-1 entry above the leaf that no walk entry spared, or a stage-2 entry read to
    /// translate one of the guest's tables. Multiplies `hw_walk_levels`, `s1_walk_levels` and
    /// `s1_table_s2_levels`.
    page_walk_level_ns: [hw_walk_levels, s1_walk_levels, s1_table_s2_levels],
    /// The fixed part of a TLB miss: the second-level TLB's miss penalty and the guest's leaf
    /// entry read with warm walk caches. Multiplies `hw_walks`.
    tlb_miss_ns: [hw_walks],
    /// Translating an access through a cached TLB entry. Multiplies `tlb_hits`.
    tlb_hit_ns: [tlb_hits],
    /// What a second-level TLB hit adds to a hit. Multiplies `tlb_l2_hits`.
    tlb_l2_hit_ns: [tlb_l2_hits],
    /// What a line of KVM's data that misses the core's L2 and hits the last-level cache adds
    /// to the cache-resident software cost of reading it. Multiplies `llc_hits`.
    llc_hit_ns: [llc_hits],
    /// What a line of KVM's data read from memory adds, no prefetch in flight (the idle
    /// memory latency). Multiplies `memory_lines`.
    memory_line_ns: [memory_lines],
    /// What a line of KVM's data adds when a sequential scan streams it from memory with the
    /// prefetcher ahead: the latency over the misses one core keeps in flight (Little's law).
    /// Multiplies `memory_lines_streamed`.
    memory_stream_line_ns: [memory_lines_streamed],
    /// What a line of KVM's data read from another socket's memory adds, no prefetch in flight.
    /// Multiplies `remote_memory_lines`.
    remote_memory_line_ns: [remote_memory_lines],
    /// What a line of KVM's data adds when a sequential scan streams it from another socket's
    /// memory. Multiplies `remote_memory_lines_streamed`.
    remote_memory_stream_line_ns: [remote_memory_lines_streamed],
    /// One 8-byte guest memory access once translated. Multiplies `guest_reads` and
    /// `guest_writes`.
    guest_memory_access_ns: [guest_reads, guest_writes],
    /// What a guest line from another socket's memory adds to its access. Multiplies
    /// `guest_remote_lines`.
    guest_remote_line_ns: [guest_remote_lines],
    /// One TLB invalidation operation (INVEPT on x86) executed by a vCPU that services a flush
    /// request. Multiplies `tlb_flushes`.
    tlbi_ns: [tlb_flushes],
    /// Sending the IPI that kicks one vCPU. Multiplies `flush_kicks` and `dirty_log_kicks`.
    ipi_send_ns: [flush_kicks, dirty_log_kicks],
    /// Waiting for one kicked vCPU's acknowledgement (delivery, its VM exit, the host's handler).
    /// Multiplies `flush_kicks`.
    ipi_ack_ns: [flush_kicks],
    /// Issuing one broadcast TLB maintenance instruction (arm64 `TLBI IPAS2E1IS`,
    /// `VMALLE1IS`, `VMALLS12E1IS`). Multiplies `tlbi_ops`.
    tlbi_is_ns: [tlbi_ops],
    /// One `DSB ISH` that waits until every PE has completed the broadcast TLB maintenance
    /// issued before it. Multiplies `dsb_waits`.
    dsb_ish_ns: [dsb_waits],
    /// One non-shareable TLB maintenance instruction and its `DSB NSH`, on the issuing PE
    /// only. Multiplies `tlbi_local_ops`.
    tlbi_local_ns: [tlbi_local_ops],
    /// Cleaning and invalidating one 64-byte line to the point of coherency (`DC CIVAC` in
    /// `dcache_clean_inval_poc()`). Multiplies `cmo_lines`.
    dc_civac_line_ns: [cmo_lines],
    /// Moving a contended lock's cache line from the core that used it last (an atomic on a
    /// line in another core's cache). Multiplies `lock_line_transfers`.
    lock_line_transfer_ns: [lock_line_transfers],
    /// The same across sockets: the line comes from a core of another socket. Multiplies
    /// `lock_line_transfers_remote`.
    lock_line_transfer_remote_ns: [lock_line_transfers_remote],
    /// The CPU's page-modification-log write when a walk sets a Dirty flag (Intel PML): the
    /// entry and the index update, beyond the walk's own locked update. Multiplies
    /// `pml_logged`.
    pml_log_ns: [pml_logged],
}

/// Number of hardware costs.
const NH: usize = HardwareCosts::NAMES.len();

impl Default for HardwareCosts {
    fn default() -> Self {
        let mut h = HardwareCosts::zero();
        for (name, ns, _) in HARDWARE_DEFAULTS {
            *h.get_mut(name)
                .expect("HARDWARE_DEFAULTS names a hardware cost") = *ns;
        }
        h
    }
}

/// Default software costs: (`Meter` field, ns per unit, source). Cycle counts are estimates of
/// the KVM code the counter stands for, converted at an assumed 3 GHz (3 cycles per ns).
pub const SOFTWARE_DEFAULTS: &[(&str, f64, &str)] = &[
    // Every access that exits is charged here for KVM's entry into the MMU; the slow path's
    // page lookup is in pf_slow because fast_page_fault() runs before kvm_faultin_pfn().
    ("ept_violations", 50.0, "estimate, ~150 cycles: handle_ept_violation(), kvm_mmu_page_fault() and kvm_mmu_do_page_fault() building struct kvm_page_fault and finding the memslot (last-used-slot cache hit)"),
    ("tlb_flushes", 15.0, "estimate, ~45 cycles: kvm_check_request(KVM_REQ_TLB_FLUSH) (a locked bit clear) and the kvm_vcpu_flush_tlb_all() dispatch; the INVEPT itself is hardware.tlbi_ns"),
    ("pf_fast_fixed", 30.0, "estimate, ~90 cycles: fast_page_fault() beyond its walk and store (spte_reads, spte_writes): lockless-walk begin/end under RCU, the is_access_allowed() and MMU-writable checks, the lock prefix of the cmpxchg"),
    ("pf_spurious", 10.0, "estimate, ~30 cycles: comparing the current SPTE with the fault and returning RET_PF_SPURIOUS"),
    // get_user_pages_fast() on a present page walks 4-5 host levels and takes a page reference.
    ("pf_slow", 250.0, "estimate, ~750 cycles: kvm_faultin_pfn() (get_user_pages_fast() of a present host page, ~300-400 cycles), kvm_mmu_hugepage_adjust()'s host page-table lookup (~100), read_lock()/read_unlock() of mmu_lock, is_page_fault_stale(), releasing the page"),
    ("pf_retry", 20.0, "estimate, ~60 cycles: unwinding a RET_PF_RETRY fault (the re-executed access and its new exit are counted by their own fields)"),
    ("pf_map_4k", 50.0, "estimate, ~150 cycles: tdp_mmu_map_handle_target_level(): make_spte() (memory type, permissions, software bits) and handle_changed_spte() with kvm_update_page_stats(); the store is spte_writes"),
    ("pf_map_2m", 50.0, "estimate, ~150 cycles: as pf_map_4k; installing a huge leaf is the same work"),
    ("pf_map_1g", 50.0, "estimate, ~150 cycles: as pf_map_4k; installing a huge leaf is the same work"),
    ("split_in_fault", 60.0, "estimate, ~180 cycles: tdp_mmu_split_huge_page() beyond its 512 child stores (spte_writes) and its table (tables_allocated): linking the table with cmpxchg, handle_changed_spte() for the huge leaf, page-stat accounting of the children"),
    ("split_eager", 60.0, "estimate, ~180 cycles: the same work as split_in_fault, done by tdp_mmu_split_huge_pages_root()"),
    ("huge_recovered", 150.0, "estimate, ~450 cycles: kvm_mmu_max_mapping_level()'s host page-table lookup (~100 cycles), make_huge_spte(), replacing the non-leaf entry and starting handle_removed_pt(); the frozen children and the freed table are spte_writes and tables_freed"),
    ("spte_reads", 2.0, "estimate, ~6 cycles: one tdp_iter step, a READ_ONCE() of an entry in an L1-resident table (L1 hit 4-5 cycles) plus the iterator's arithmetic; what a table's line adds from the last-level cache or memory, local or remote, is the cache model's (llc_hit_ns, memory_line_ns, memory_stream_line_ns, remote_memory_line_ns, remote_memory_stream_line_ns)"),
    ("spte_writes", 3.0, "estimate, ~10 cycles: storing one computed SPTE; most are the 512 child entries of a split or the frozen entries of a removed table; the extra cost of atomic updates in faults and write protection is in pf_map_*, sptes_wrprot and split_*"),
    ("cmpxchg_failed", 40.0, "estimate, ~120 cycles: a cmpxchg that lost a race, i.e. a locked operation on a cache line another core just wrote (a cross-core line transfer) and re-reading the entry"),
    ("tables_allocated", 200.0, "estimate, ~600 cycles: a page-table page for the MMU memory cache, __get_free_page(__GFP_ZERO) (allocator fast path ~200 cycles, zeroing 4 KiB ~250) plus struct kvm_mmu_page from its kmem_cache (~100)"),
    ("tables_freed", 150.0, "estimate, ~450 cycles: tdp_mmu_free_sp() through call_rcu(): the RCU callback, free_page() and kmem_cache_free()"),
    ("bitmap_words", 2.0, "estimate, ~6 cycles: one 64-bit word of a dirty bitmap copied to the user buffer, or read and exchanged in GET/CLEAR's loop, cache-resident (the host-cache model adds what the bitmap's and buffer's lines cost beyond the L2)"),
    ("sptes_dirty_cleared", 20.0, "estimate, ~60 cycles: clearing D in one leaf with a locked cmpxchg (clear_dirty_gfn_range(), clear_dirty_pt_masked()) or bit clear (__rmap_clear_dirty()), as sptes_wrprot; the store is spte_writes"),
    ("pml_full_exits", 200.0, "as hardware.ept_violation_ns (~600 cycles): vcpu_enter_guest()'s work around an in-kernel exit and the dispatch to handle_pml_full(), which has nothing left to do; the exit's transitions are vm_exits and the entries emptied are pml_drained"),
    ("pml_drained", 15.0, "estimate, ~45 cycles: one entry of vmx_flush_pml_buffer(): reading it from the log page (sequential, cached) and kvm_vcpu_mark_page_dirty()'s memslot lookup (the vCPU's last-used-slot cache hit); the bitmap's set_bit is pages_dirtied"),
    ("sptes_wrprot", 20.0, "estimate, ~60 cycles: clearing W in one leaf, the locked cmpxchg of tdp_mmu_set_spte_atomic() and handle_changed_spte(); the store is spte_writes"),
    ("pages_dirtied", 10.0, "estimate, ~30 cycles: mark_page_dirty_in_slot(), a set_bit_le() into the dirty bitmap (locked bit operation) or one dirty-ring entry, cache-resident (the host-cache model adds what the bitmap's line costs beyond the L2)"),
    ("remote_flushes", 50.0, "estimate, ~150 cycles: kvm_flush_remote_tlbs() without its kicks: kvm_make_all_cpus_request() setting KVM_REQ_TLB_FLUSH and reading vcpu->mode for a few vCPUs, and the barrier"),
    ("flush_kicks", 20.0, "estimate, ~60 cycles: per kicked vCPU, kvm_request_needs_ipi() and adding its CPU to the cpumask; the IPI is hardware.ipi_send_ns and ipi_ack_ns"),
    ("rmap_reads", 3.0, "estimate, ~10 cycles: one rmap head read by __walk_slot_rmaps() (slot_rmap_walk_next() index arithmetic) with the array's lines in the core's L2; what a line from the last-level cache or memory, local or remote, adds is the cache model's (llc_hit_ns, memory_line_ns, memory_stream_line_ns, remote_memory_line_ns, remote_memory_stream_line_ns)"),
    ("rmap_adds", 20.0, "estimate, ~60 cycles: pte_list_add() on an empty or single-entry head (or appending to a pte_list_desc), gfn_to_rmap(), kvm_mmu_page_set_translation() and kvm_update_page_stats() in __rmap_add(); the rmap array line usually misses L1"),
    ("rmap_removes", 20.0, "estimate, ~60 cycles: pte_list_remove() with kvm_mmu_page_get_gfn() and gfn_to_rmap() to find the head, as rmap_adds"),
    ("sp_lookups", 10.0, "estimate, ~30 cycles: hash_64() of the gfn and loading the mmu_page_hash bucket head in kvm_mmu_find_shadow_page() or for_each_gfn_valid_sp*(); the pages walked are sp_hash_steps"),
    ("sp_hash_steps", 15.0, "estimate, ~45 cycles: one step of an mmu_page_hash bucket walk, a dependent load of the next struct kvm_mmu_page's gfn and role that misses L1 and L2 (L3 hit ~40-50 cycles, 7-cpu.com 'Intel Skylake', unverified); buckets fill as the VM's shadow pages grow (4096 buckets)"),
    ("sp_zapped", 100.0, "estimate, ~300 cycles: __kvm_mmu_prepare_zap_page() beyond its per-entry work: unlinking parents and unsync state, unaccount_shadowed(), moving the page to invalid_list; the 512 entries are spte_reads/spte_writes and freeing is tables_freed"),
    ("guest_pte_reads", 15.0, "estimate, ~45 cycles: one guest PTE read by FNAME(walk_addr_generic)(): the gfn to host-virtual translation of the table (memslot cache hit) and a __get_user() of an 8-byte entry that is usually cached"),
    ("pf_emulated", 1500.0, "estimate, ~4,500 cycles: x86_emulate_instruction() for a guest store to a write-protected guest page table: fetching and decoding the instruction, emulator_write_phys() and the page-track notifier (kvm_mmu_track_write() beyond its zaps)"),
    ("sptes_synced", 30.0, "estimate, ~90 cycles: FNAME(sync_spte)(): reading one guest PTE of an unsync page, comparing it with the shadowed translation and rewriting the SPTE"),
    ("lock_yields", 100.0, "estimate, ~300 cycles: a cond_resched_rwlock_*() that yields: RCU unlock/lock and releasing and retaking mmu_lock (atomics on a contended line); the restarted walk is spte_reads and time spent waiting is not included"),
    ("s2_xlat_fault_l0", 0.0, "a classification of the stage-2 abort (its work is priced by ept_violations, pf_slow and the walk's own counters)"),
    ("s2_xlat_fault_l1", 0.0, "as s2_xlat_fault_l0"),
    ("s2_xlat_fault_l2", 0.0, "as s2_xlat_fault_l0"),
    ("s2_xlat_fault_l3", 0.0, "as s2_xlat_fault_l0"),
    ("s2_perm_fault_l1", 0.0, "as s2_xlat_fault_l0"),
    ("s2_perm_fault_l2", 0.0, "as s2_xlat_fault_l0"),
    ("s2_perm_fault_l3", 0.0, "as s2_xlat_fault_l0"),
    ("s2_access_fault", 0.0, "as s2_xlat_fault_l0"),
    ("nested_transitions", 1700.0, "derived, ~5,000 cycles at 3 GHz: an L2 CPUID exit that L1 handles takes 13,142 cycles (14,886 before the series) for the whole round trip (LKML '[PATCH 00/43] VMX optimizations', Bonzini, 2019); less its two VM exit/entry pairs (vm_exit_entry_ns, 2 x ~1,350 cycles) and L1's few hundred cycles of CPUID handling, the rest is one nested VM-exit and one nested VM-entry (vmcs02 <-> vmcs01 state switch, prepare_vmcs02/sync_vmcs02_to_vmcs12)"),
    ("mmu_notifier_calls", 100.0, "estimate, ~300 cycles: a KVM MMU notifier callback beyond its MMU work: srcu_read_lock(), kvm_handle_hva_range()'s memslot interval-tree lookup and the handler dispatch"),
    ("sptes_aged", 20.0, "as sptes_wrprot: an atomic AND that clears the Accessed bit of one SPTE, a locked operation on a line the hardware walker also writes"),
    ("swap_ins", 2500.0, "derived: a 4 KiB random read from zram with lz4 takes 1,708 ns mean (fio, page-cluster 0, a desktop x86 CPU; u/VenditatioDelendaEst's table in 'Zram Performance Analysis', 2025), plus ~800 ns (estimate) for shmem_swapin_folio(): the swap-cache insertion, the page allocation and charging the folio to the LRU"),
    ("pages_populated", 370.0, "derived, ~1,100 cycles: the page allocator's fast path (~200 cycles) and clearing 4 KiB, which clear_page() does at 13.7 GB/s for 4 KiB chunks (299 ns; measured with rep stosq on AMD Milan, LKML '[PATCH v4 00/13] x86/mm: Add multi-page clearing', Ankur Arora, June 2025)"),
    ("zero_pages_mapped", 100.0, "estimate, ~300 cycles: do_anonymous_page()'s read branch, a special PTE of the zero page set under the PTE lock, and get_user_pages() finding it (follow_page_pte()); no allocation"),
    ("pages_copied", 450.0, "derived, ~1,350 cycles: wp_page_copy(): the page allocator's fast path (~200 cycles), copying 4 KiB from the cache-hot zero page, bound like clear_page() by writing the new page (~300 ns, as pages_populated), charging the folio, its rmap and LRU insertion, and replacing the PTE (~250 cycles); its MMU-notifier callbacks are priced by mmu_notifier_calls and the MMU's own counters"),
    ("huge_pages_populated", 177000.0, "measured: demand-faulting memory in 2 MiB pages runs at 11.82 GB/s, 177 us a page, nearly all of it clearing it (perf bench mem map -p 2MB -f demand on x86, the baseline of LKML '[PATCH v4 00/13] x86/mm: Add multi-page clearing', Ankur Arora, June 2025)"),
    ("huge_zero_splits", 600.0, "estimate, ~1,800 cycles: __split_huge_zero_page_pmd(): a page-table page from the allocator (~200 cycles, zeroed ~250, as tables_allocated) and 512 zero-page PTEs written into it (~2 cycles each), under the PMD lock"),
    ("host_ptes_zapped", 30.0, "estimate, ~90 cycles: zap_present_ptes() for one 4 KiB page: ptep_get_and_clear_full(), the rmap and RSS counter updates (folio_remove_rmap_ptes(), the mapcount atomic) and adding the page to the mmu_gather batch"),
    ("host_pages_freed", 70.0, "estimate, ~200 cycles: freeing one order-0 page from the mmu_gather batch (free_pages_and_swap_cache() -> folios_put_refs()): the refcount drop, LRU removal and the page allocator's free fast path to the per-CPU lists, the counterpart of the allocation fast path priced in pages_populated"),
    ("host_huge_zapped", 100.0, "estimate, ~300 cycles: clearing one huge mapping, zap_huge_pmd() of a THP or the huge zero folio (pmdp_huge_get_and_clear_full(), the rmap and counter updates, freeing the deposited page-table page) or __unmap_hugepage_range()'s huge PTE (huge_ptep_get_and_clear(), hugetlb_remove_rmap())"),
    ("host_huge_pages_freed", 300.0, "estimate, ~900 cycles: freeing one huge page: a THP's order-9 folio to the buddy allocator (free_one_page() under the zone lock, merging buddies) or a hugetlbfs folio to its pool (free_huge_folio(): hugetlb_lock, the cgroup uncharge, enqueue_hugetlb_folio()); with hugetlb_vmemmap optimisation off, as by default"),
    ("host_tlb_flushes", 100.0, "estimate, ~300 cycles: x86 flush_tlb_mm_range() of a range past tlb_single_page_flush_ceiling (33 pages): a local full flush (CR3 write or INVPCID) and no IPI, no other CPU being in the mm's cpumask once the vCPU threads exited"),
    ("unmap_hva_range", 0.0, "a count of notifier events (the work is mmu_notifier_calls and the zap's own counters)"),
    ("set_spte_hva", 0.0, "as unmap_hva_range"),
    ("host_ticks", 1000.0, "estimate, ~3,000 cycles: the scheduling-clock interrupt's entry and exit, hrtimer_interrupt() and tick_sched_timer(): update_process_times() (CPU-time accounting, run_local_timers(), rcu_sched_clock_irq()) and scheduler_tick() under the runqueue lock; the VM exit and entry it causes are vm_exits"),
    ("jiffies_updates", 200.0, "estimate, ~600 cycles: tick_do_update_jiffies64() under jiffies_lock and update_wall_time()'s timekeeping_advance(), done by the CPU that keeps time"),
    ("futex_wakes", 500.0, "estimate, ~1,500 cycles, as host_syscalls: sem_post()'s futex(FUTEX_WAKE) system call, the futex hash bucket lock and try_to_wake_up() of the waiter, with the IPI to its CPU (ipi_send_ns)"),
    ("alloc_stalls", 1000.0, "estimate, ~3,000 cycles: a host page allocation that finds free memory at the min watermark: __alloc_pages_slowpath() waking kswapd and retrying the free lists before it would reclaim directly; the wait for kswapd to free memory is the engine's (the vCPU waits out of the run until a free page exists)"),
    ("swap_outs", 5300.0, "derived: compressing 4 KiB with lz4 at 780 MB/s (the LZ4 README's benchmark, 'LZ4 default', one core of a Core i7-9700K) for zram's synchronous write in pageout(); add_to_swap() and zsmalloc's store are not included"),
    ("lru_folios_scanned", 30.0, "estimate, ~90 cycles: isolating, sorting or putting back one folio under lru_lock (list_move() and folio flag updates; the struct folio line usually misses L2, ~20 ns for an L3 hit)"),
    ("rmap_walks", 200.0, "estimate, ~600 cycles: rmap_walk_file() of a shmem folio mapped once: i_mmap_lock_read(), the vma_interval_tree lookup and page_vma_mapped_walk()'s four dependent page-table loads, each an L2 miss (~20-40 ns)"),
    ("host_ptes_scanned", 3.0, "estimate, ~10 cycles: one PTE of MGLRU's walk_pte_range() or lru_gen_look_around(), read sequentially from a 4 KiB table (eight per cache line, prefetched), with pte_young() and the pfn check"),
    ("host_syscalls", 500.0, "estimate, ~1,500 cycles: an 8-byte pread()/pwrite() of a procfs or sysfs file: system call entry and exit with speculation mitigations (~300-600 cycles), the VFS and seq_file or kernfs handler, and the copy to or from user space"),
    ("rmap_desc_steps", 15.0, "as sp_hash_steps: one dependent load of the next pte_list_desc, which misses L1 and L2 when the rmap is long"),
    ("lock_drops_for_alloc", 100.0, "estimate, ~300 cycles: dropping mmu_lock and RCU to allocate and retaking them, as lock_yields; the allocation is tables_allocated"),
];

/// Default hardware costs: (name, ns, source).
pub const HARDWARE_DEFAULTS: &[(&str, f64, &str)] = &[
    ("vm_exit_entry_ns", 450.0, "~1,350 cycles at 3 GHz: VMRUN to the return of #VMEXIT for a minimal exit, 1,344-1,376 cycles measured on an AMD host on LKML (Dec 2020, thread of 'KVM: SVM: use vmsave/vmload for saving/restoring additional host state'); Agesen et al., USENIX ATC 2012 (unverified), trace the same round trip on Intel VMX across generations"),
    ("ept_violation_ns", 200.0, "~600 cycles: KVM's work around an in-kernel exit that the model does not execute (vcpu_enter_guest()'s post-exit and pre-entry state handling, exit dispatch, VMREADs of the exit qualification and guest-physical address); the same LKML measurement shows ~576 cycles from KVM_RUN entry to VMRUN and ~600 from #VMEXIT to ioctl exit, of which an in-kernel exit pays about half of each"),
    ("page_walk_level_ns", 4.0, "~12 cycles: one walk reference that hits L2 (Skylake L2 latency 12 cycles, 7-cpu.com 'Intel Skylake', unverified); references held by the paging-structure caches cost less, leaf entries that miss L2 more"),
    ("tlb_miss_ns", 10.0, "~30 cycles, estimate: the fixed part of a TLB miss: the L1 DTLB/STLB miss penalty (~9 cycles, 7-cpu.com 'Intel Skylake', unverified) and the guest's leaf entry read with warm paging-structure caches; the guest levels above the leaf are s1_walk_levels as far as no walk entry covers the address, the stage-2 entries that translate the guest's tables are s1_table_s2_levels, and the accessed page's stage-2 levels are hw_walk_levels when no stage-2 entry covers it (its leaf only when a stage-2 walk entry does) (a two-dimensional walk reads up to 24 entries for 4-level guest and EPT tables, Bhargava et al., ASPLOS 2008, unverified)"),
    ("tlb_hit_ns", 0.5, "~1.5 cycles: an L1 DTLB hit is looked up in parallel with L1D and adds nothing"),
    ("llc_hit_ns", 21.0, "derived, ~64 cycles at 3.0 GHz (Xeon Platinum 8275CL base clock): Skylake-SP's L3 load-to-use latency, 77 cycles, less its L2's, 11-13 cycles (AnandTech, 'The Intel Skylake-X Review', Jun 2017, 'I Keep My Cache Private')"),
    ("memory_line_ns", 90.0, "the idle DRAM latency of the host (89-91 ns measured on a Skylake-SP Xeon 8176, AnandTech, Jul 2017), as Host::CASCADE_LAKE_2S gives it"),
    ("memory_stream_line_ns", 7.5, "derived: a core streams lines from memory at the latency over the misses it keeps in flight (Little's law; J. McCalpin, Intel forum 'single core bandwidth: haswell vs. broadwell vs. skylake'): 90 ns / 12 line-fill buffers (Skylake's, as measured in the ZombieLoad paper, Schwarz et al., CCS 2019, Fig. 7)"),
    ("remote_memory_line_ns", 177.0, "derived: the local latency, 90 ns, plus what crossing to the other socket adds to a line transfer, 135 - 48 = 87 ns (lock_line_transfer_remote_ns less lock_line_transfer_ns, both measured on Cascade Lake): the request and the data each cross the UPI link once, as a cross-socket line transfer's do; an upper bound, since that transfer also snoops the other core's cache"),
    ("remote_memory_stream_line_ns", 14.75, "derived: 177 ns over the same 12 line-fill buffers (Little's law, as memory_stream_line_ns)"),
    ("guest_remote_line_ns", 7.25, "derived: a guest stream's line from the other socket's memory costs remote_memory_stream_line_ns (14.75 ns) where a local one costs memory_stream_line_ns (7.5 ns), which guest_memory_access_ns already covers: 14.75 - 7.5"),
    ("tlb_l2_hit_ns", 3.2, "~9 cycles at 2.8 GHz (Xeon Gold 6242 base clock): an STLB hit after an L1 DTLB miss (7-cpu.com 'Intel Skylake', unverified)"),
    ("guest_memory_access_ns", 10.0, "one 8-byte memstress access to a new 4 KiB page misses the caches (DRAM latency ~80-100 ns; 7-cpu.com 'Intel Skylake': 42 cycles + 51 ns, unverified), but the accesses are independent and a core keeps ~10-12 L1 misses in flight (line-fill buffers), so a stream costs ~latency/10 per access"),
    ("tlbi_ns", 100.0, "~300 cycles, estimate: single-context INVEPT when a vCPU services KVM_REQ_TLB_FLUSH, a serializing privileged instruction (no public per-instruction latency found); the refills it causes are not included, they appear as hw_walks"),
    ("ipi_send_ns", 100.0, "~300 cycles, estimate: per target, smp_call_function_many() queueing a call-single entry and the x2APIC ICR write (WRMSR)"),
    ("tlbi_is_ns", 50.0, "estimate, ~150 cycles: a broadcast TLBI is posted to the interconnect and retires without waiting (no public per-instruction latency for Neoverse-N1 found); its completion is dsb_ish_ns"),
    ("dsb_ish_ns", 100.0, "derived: a DSB ISH after broadcast TLBIs completes when every PE has acknowledged them, at least a round trip across the mesh: 2 x 47 ns, the median one-way core-to-core latency measured on a 64-core Neoverse-N1 (Graviton2) by github nviennot/core-to-core-latency; contention between concurrent broadcasts (latency growing with the number of issuing CPUs, LKML 'arm64: tlb: skip tlbi broadcast', Feb 2020) is not modelled"),
    ("pml_log_ns", 5.0, "estimate, ~15 cycles: an 8-byte store into the 4 KiB log page, written sequentially so it stays in L1, and the GUEST_PML_INDEX update, done by the CPU inside the walk's locked Dirty-flag update (whose walk is priced by tlb_miss_ns and page_walk_level_ns); no published figure for the PML assist (SDM Vol. 3C specifies it, Intel publishes no latency)"),
    ("tlbi_local_ns", 10.0, "estimate, ~30 cycles: a non-shareable TLBI and DSB NSH complete inside the core, with no interconnect round trip (no published latency found)"),
    ("dc_civac_line_ns", 5.0, "estimate, ~15 cycles: one DC CIVAC of a line that is usually in no cache (the page was written long before it is mapped), issued back to back over a page so the misses to the point of coherency overlap; no public per-line figure for Neoverse-N1 found. Only arm64 without FEAT_S2FWB counts these"),
    ("lock_line_transfer_ns", 48.0, "measured: one-way core-to-core latency of a contended cache line (CAS ping-pong round trip / 2, median) within a Cascade Lake socket, 48 ns on a Xeon Gold 6242 and 47 ns on a Platinum 8275CL (github nviennot/core-to-core-latency); across sockets it is lock_line_transfer_remote_ns"),
    ("lock_line_transfer_remote_ns", 135.0, "measured: one-way latency of a contended cache line between the two sockets of a Cascade Lake host (CAS ping-pong round trip / 2, median), 136 ns on 2 x Xeon Gold 6242 and 134 ns on 2 x Platinum 8275CL (github nviennot/core-to-core-latency)"),
    ("ipi_ack_ns", 1500.0, "estimate: delivery, the target's VM exit and ack_kick() in the host's handler; ipi_benchmark inside a Skylake 2.5 GHz guest measured 2.24 us to deliver and 2.51 us to see the ack of an IPI between vCPUs, where the sender also exits (Linux commit 'KVM: X86: Implement \"send IPI\" hypercall'); a host kick skips the sender's exit. Charged per kicked vCPU, an upper bound when acks overlap"),
];

/// arm64's hardware costs where they differ from the defaults (an Ampere Altra, 80 Neoverse-N1
/// cores at 3 GHz, the host of seed 001): (name, ns, source). KVM software costs are shared
/// with x86 (the same C code on a core of the same clock).
pub const ARM64_HARDWARE_DEFAULTS: &[(&str, f64, &str)] = &[
    ("vm_exit_entry_ns", 306.0, "measured: an hvc round trip from the guest to EL2 and back, VHE, Linux 6.12-rc1 on an Ampere Altra, mean of 65,536 (LKML 'Re: [PATCH v2] KVM: arm64: Get rid of userspace_irqchip_in_use', 29 Oct 2024, kvm-unit-tests micro-bench)"),
    ("ept_violation_ns", 140.0, "derived: a stage-2 data abort handled in the kernel (mmio_read_vgic) takes 445-451 ns on the same Altra measurement, 140 ns more than the hvc round trip: decoding ESR/FAR/HPFAR and dispatching the abort (an upper bound, since it includes the vgic's MMIO emulation)"),
    ("page_walk_level_ns", 3.7, "measured: ~11 cycles at 3 GHz, the L2 load-to-use latency of Neoverse-N1 (AnandTech 'Cloud Clash: Amazon Graviton2 Arm Against Intel and AMD', Mar 2020)"),
    ("llc_hit_ns", 27.0, "estimate, ~80 cycles at 3 GHz: a line from the Altra's system-level cache in the CMN-600 mesh beyond the N1's 11-cycle L2; no published load-to-use latency of the Altra's SLC was found"),
    ("memory_line_ns", 81.0, "the idle DRAM latency of the host (81 ns measured on Graviton2's Neoverse-N1, AnandTech, Mar 2020), as Host::ALTRA_1S gives it"),
    ("memory_stream_line_ns", 6.75, "derived: 81 ns over 12 misses in flight (Little's law, as the x86 default; the N1's own count of outstanding L1 misses is not published, so the count is an estimate)"),
    ("remote_memory_line_ns", 81.0, "the host has one socket (an 80-core Ampere Altra), so no line is remote; set to the local latency"),
    ("remote_memory_stream_line_ns", 6.75, "the host has one socket, so no line is remote; set to the local streaming cost"),
    ("guest_remote_line_ns", 0.0, "the host has one socket, so no guest line is remote: remote_memory_stream_line_ns less memory_stream_line_ns, 0"),
    ("tlb_l2_hit_ns", 1.0, "~3 cycles at 3 GHz: the L2 TLB's hit latency after an L1 DTLB miss (Arm Cortex-A76 TRM §A5.2, as the project's hardware-costs table cites it; N1 is an A76 derivative)"),
    ("lock_line_transfer_ns", 47.0, "measured: one-way core-to-core latency of a contended cache line (CAS ping-pong round trip / 2, median) across the 64 Neoverse-N1 cores of an AWS Graviton2 (github nviennot/core-to-core-latency, results/AWS Graviton2.csv)"),
    ("lock_line_transfer_remote_ns", 47.0, "the host has one socket (an 80-core Ampere Altra), so no transfer crosses sockets; set to the in-socket figure"),
];

/// Which architectures' runs pay an [`UnsourcedCost`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PaidBy {
    /// Both x86 and arm64.
    Both,
    /// x86 only (INVEPT, IPIs, PML).
    X86,
    /// arm64 only (broadcast TLBI, `DSB ISH`, cache maintenance).
    Arm64,
}

impl PaidBy {
    /// Whether a run of `arm64` (or x86) pays it.
    pub fn paid_on(self, arm64: bool) -> bool {
        match self {
            PaidBy::Both => true,
            PaidBy::X86 => !arm64,
            PaidBy::Arm64 => arm64,
        }
    }
}

/// A hardware cost no published measurement gives (its source says "estimate", or derives a
/// lower bound), which `vmmu fit` may fit to a real host's selftest output.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct UnsourcedCost {
    /// The hardware cost's name.
    pub name: &'static str,
    /// The lowest physical value, ns.
    pub lo: f64,
    /// The highest physical value, ns.
    pub hi: f64,
    /// Why that range is physical.
    pub why: &'static str,
    /// Which architectures' runs pay it.
    pub paid_by: PaidBy,
}

const fn unsourced(
    name: &'static str,
    lo: f64,
    hi: f64,
    paid_by: PaidBy,
    why: &'static str,
) -> UnsourcedCost {
    UnsourcedCost {
        name,
        lo,
        hi,
        why,
        paid_by,
    }
}

/// The hardware costs `vmmu fit` may move; every other cost is sourced and stays fixed.
pub const UNSOURCED_HARDWARE: &[UnsourcedCost] = &[
    unsourced("tlb_miss_ns", 3.0, 100.0, PaidBy::Both, "from an STLB miss with every walk reference in L1 (~10 cycles) to one whose leaf misses to DRAM (~100 ns)"),
    unsourced("tlbi_ns", 10.0, 5000.0, PaidBy::X86, "a serializing privileged instruction: from tens of cycles to a few microseconds"),
    unsourced("ipi_send_ns", 10.0, 2000.0, PaidBy::X86, "an x2APIC ICR write and a queued call entry: from tens of cycles to a few microseconds"),
    unsourced("ipi_ack_ns", 200.0, 20000.0, PaidBy::X86, "from an interrupt delivered to a running guest to one whose target must be scheduled"),
    unsourced("pml_log_ns", 0.5, 1000.0, PaidBy::X86, "from an L1-resident store to a microcode assist of ~3,000 cycles"),
    unsourced("tlbi_is_ns", 1.0, 2000.0, PaidBy::Arm64, "from posting to the interconnect to waiting for it"),
    unsourced("dsb_ish_ns", 20.0, 20000.0, PaidBy::Arm64, "from one mesh round trip to tens of microseconds under concurrent broadcasts"),
    unsourced("tlbi_local_ns", 1.0, 500.0, PaidBy::Arm64, "inside one core: from a few cycles to ~1,500"),
    unsourced("dc_civac_line_ns", 0.5, 200.0, PaidBy::Arm64, "one line cleaned to the point of coherency: from overlapped misses to a DRAM write-back each"),
];

/// The host the model's vCPUs run on, as far as it prices them: how many sockets, and how many
/// logical CPUs each has (which decides where the scheduler puts vCPU threads, and so which
/// cache-line transfers cross sockets).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Host {
    /// Sockets (NUMA nodes, one last-level cache each).
    pub sockets: u32,
    /// Logical CPUs per socket (cores times SMT threads).
    pub cpus_per_socket: u32,
    /// Peak DRAM bandwidth of one socket, GB/s: what all its cores' memory accesses share.
    pub dram_gbps_per_socket: f64,
    /// Idle DRAM latency, ns: with the bandwidth it sets how much traffic is in flight before
    /// a new access has to queue (Little's law).
    pub dram_latency_ns: f64,
}

impl Host {
    /// A 2-socket Cascade Lake host, 2 x Xeon Platinum 8275CL: 24 cores and 48 threads per
    /// socket (the host whose in- and cross-socket line latencies the x86 defaults use).
    /// DRAM: 6 channels of DDR4-2933 per socket, 140.8 GB/s (computed from the specification:
    /// Microway, "Detailed Specifications of the Cascade Lake SP"); latency 90 ns (89-91 ns
    /// measured on a Skylake-SP Xeon 8176, AnandTech, Jul 2017).
    pub const CASCADE_LAKE_2S: Host = Host {
        sockets: 2,
        cpus_per_socket: 48,
        dram_gbps_per_socket: 140.8,
        dram_latency_ns: 90.0,
    };
    /// A 1-socket Ampere Altra Q80: 80 Neoverse-N1 cores, no SMT.
    /// DRAM: 8 channels of DDR4-3200, 204.8 GB/s (AnandTech, "The Ampere Altra Review", Dec
    /// 2020); latency 81 ns (measured on Graviton2's Neoverse-N1, AnandTech, Mar 2020).
    pub const ALTRA_1S: Host = Host {
        sockets: 1,
        cpus_per_socket: 80,
        dram_gbps_per_socket: 204.8,
        dram_latency_ns: 81.0,
    };

    /// The socket of each of `nr_vcpus` busy vCPU threads, as the scheduler of seed 000's
    /// kernel (Linux 5.18 and 5.19) places them: the load balancer lets a node with a single LLC
    /// keep up to a quarter of its CPUs' worth of tasks (`imb_numa_nr = span_weight >> 2` in
    /// `build_sched_domains()`, read by `adjust_numa_imbalance()`; an eighth from Linux 6.0);
    /// once the busiest node holds more, it balances the tasks evenly between the sockets.
    /// Simplified: the sockets are filled in order, and SMT siblings are not told apart from
    /// other cores of the socket.
    pub fn vcpu_sockets(&self, nr_vcpus: usize) -> Vec<u32> {
        let sockets = self.sockets.max(1) as usize;
        let imb = (self.cpus_per_socket as usize >> 2).max(1);
        let per_socket = if nr_vcpus <= imb {
            nr_vcpus
        } else {
            nr_vcpus.div_ceil(sockets)
        };
        (0..nr_vcpus)
            .map(|i| ((i / per_socket.max(1)).min(sockets - 1)) as u32)
            .collect()
    }
}

/// A cost model: nanoseconds per unit of each `Meter` field that counts KVM software work, and
/// the costs of hardware events. See the module documentation for the file format and for which
/// fields each cost multiplies.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Where the numbers come from (one line).
    pub origin: String,
    /// The host the costs describe.
    pub host: Host,
    /// ns per unit, in `METER_FIELDS` order; hardware-event fields stay 0.
    pub(super) software: [f64; NF],
    /// Costs of hardware events.
    pub hardware: HardwareCosts,
    /// One line per cost saying where its value comes from, keyed `software.FIELD` or
    /// `hardware.NAME`.
    pub(super) sources: BTreeMap<String, String>,
}

impl Default for CostModel {
    fn default() -> Self {
        let mut software = [0.0; NF];
        let mut sources = BTreeMap::new();
        for (field, ns, source) in SOFTWARE_DEFAULTS {
            let i = field_index(field).expect("SOFTWARE_DEFAULTS names a Meter field");
            software[i] = *ns;
            sources.insert(format!("software.{field}"), source.to_string());
        }
        for (name, _, source) in HARDWARE_DEFAULTS {
            sources.insert(format!("hardware.{name}"), source.to_string());
        }
        CostModel {
            origin: "defaults: first-principles estimates and public measurements (crates/vmmu/src/cost/model.rs)".into(),
            host: Host::CASCADE_LAKE_2S,
            software,
            hardware: HardwareCosts::default(),
            sources,
        }
    }
}

impl CostModel {
    /// The defaults with arm64's hardware costs (`ARM64_HARDWARE_DEFAULTS`).
    pub fn default_arm64() -> Self {
        let mut m = CostModel::default();
        for (name, ns, source) in ARM64_HARDWARE_DEFAULTS {
            *m.hardware
                .get_mut(name)
                .expect("ARM64_HARDWARE_DEFAULTS names a hardware cost") = *ns;
            m.sources
                .insert(format!("hardware.{name}"), source.to_string());
        }
        m.origin = "arm64 defaults: first-principles estimates and public measurements of an Ampere Altra (crates/vmmu/src/cost/model.rs)".into();
        m.host = Host::ALTRA_1S;
        m
    }

    /// The `Meter` fields that have a software cost (the `software` keys), in `Meter` order.
    pub fn software_fields() -> impl Iterator<Item = &'static str> {
        METER_FIELDS
            .iter()
            .enumerate()
            .filter(|(i, _)| !is_hardware_event(*i))
            .map(|(_, f)| *f)
    }

    /// The `Meter` fields that count hardware events, priced only by [`HardwareCosts`].
    pub fn hardware_event_fields() -> impl Iterator<Item = &'static str> {
        HARDWARE_EVENT_FIELDS
            .iter()
            .map(|f| METER_FIELDS[*f as usize])
    }

    /// Every `Meter` field the model prices, in `Meter` order (the names of [`Meter::to_map`]).
    pub fn meter_fields() -> &'static [&'static str] {
        METER_FIELDS
    }

    /// The software cost of one unit of `field`, if `field` has one.
    pub fn software_ns(&self, field: &str) -> Option<f64> {
        field_index(field)
            .filter(|i| !is_hardware_event(*i))
            .map(|i| self.software[i])
    }

    /// Sets the software cost of `field` (and forgets its source).
    pub fn set_software_ns(&mut self, field: &str, ns: f64) -> Result<(), CostError> {
        let i = field_index(field)
            .filter(|i| !is_hardware_event(*i))
            .ok_or_else(|| CostError::UnknownSoftwareKey(field.into()))?;
        check_cost(&format!("software.{field}"), ns)?;
        self.software[i] = ns;
        self.sources.remove(&format!("software.{field}"));
        Ok(())
    }

    /// Sets the hardware cost `name` and the line that says where its value comes from.
    pub fn set_hardware_ns(&mut self, name: &str, ns: f64, source: &str) -> Result<(), CostError> {
        let slot = self
            .hardware
            .get_mut(name)
            .ok_or_else(|| CostError::UnknownHardwareKey(name.into()))?;
        check_cost(&format!("hardware.{name}"), ns)?;
        *slot = ns;
        self.sources
            .insert(format!("hardware.{name}"), source.to_string());
        Ok(())
    }

    /// The total cost of one unit of `field`: its software cost plus the hardware costs that
    /// multiply it.
    pub fn unit_ns(&self, field: &str) -> Option<f64> {
        field_index(field).map(|i| self.unit_costs()[i])
    }

    /// The cost of one unit of each `Meter` field (software plus the hardware costs that
    /// multiply it), in [`METER_FIELDS`] order: what [`CostModel::nanos_f64`] multiplies counts by.
    pub fn unit_costs(&self) -> [f64; NF] {
        let mut unit = self.software;
        for (ns, fields) in self.hardware.terms() {
            for f in fields {
                unit[*f as usize] += ns;
            }
        }
        unit
    }

    /// The time `meter`'s work takes, in nanoseconds, unrounded:
    /// `Σ count × (software cost + hardware costs of the field)`.
    pub fn nanos_f64(&self, meter: &Meter) -> f64 {
        let counts = meter_counts(meter);
        let unit = self.unit_costs();
        counts
            .iter()
            .zip(unit.iter())
            .map(|(&n, &u)| n as f64 * u)
            .sum()
    }

    /// The time `meter`'s work takes, in whole nanoseconds (see [`CostModel::nanos_f64`]).
    pub fn nanos(&self, meter: &Meter) -> u64 {
        self.nanos_f64(meter).round() as u64
    }

    /// Where `meter`'s time goes: each field with a non-zero count and its share in ns
    /// (software plus hardware costs), in `Meter` order.
    pub fn breakdown(&self, meter: &Meter) -> Vec<(&'static str, f64)> {
        let counts = meter_counts(meter);
        let unit = self.unit_costs();
        (0..NF)
            .filter(|&i| counts[i] != 0)
            .map(|i| (METER_FIELDS[i], counts[i] as f64 * unit[i]))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cache_costs_are_the_memory_latency_of_the_host_they_describe() {
        // memory_line_ns is the host's DRAM latency; memory_stream_line_ns that latency over the
        // 12 misses a core keeps in flight. A default changed on one side only fails here.
        for (m, host) in [
            (CostModel::default(), Host::CASCADE_LAKE_2S),
            (CostModel::default_arm64(), Host::ALTRA_1S),
        ] {
            let h = &m.hardware;
            assert_eq!(h.memory_line_ns, host.dram_latency_ns);
            assert_eq!(h.memory_stream_line_ns, host.dram_latency_ns / 12.0);
            // A remote line: the local latency plus what crossing sockets adds to a transfer.
            let crossing = h.lock_line_transfer_remote_ns - h.lock_line_transfer_ns;
            assert_eq!(h.remote_memory_line_ns, host.dram_latency_ns + crossing);
            assert_eq!(
                h.remote_memory_stream_line_ns,
                h.remote_memory_line_ns / 12.0
            );
            // A guest's remote line adds what streaming it from the other socket adds.
            assert_eq!(
                h.guest_remote_line_ns,
                h.remote_memory_stream_line_ns - h.memory_stream_line_ns
            );
        }
    }

    #[test]
    fn every_unsourced_cost_is_an_estimate_and_its_range_holds_both_defaults() {
        let (x86, arm64) = (CostModel::default(), CostModel::default_arm64());
        for UnsourcedCost {
            name, lo, hi, why, ..
        } in UNSOURCED_HARDWARE
        {
            let source = x86.source(&format!("hardware.{name}")).unwrap();
            assert!(
                source.contains("estimate") || source.contains("derived"),
                "{name} is listed as unsourced but its source is {source}"
            );
            for m in [&x86, &arm64] {
                let v = m.hardware.get(name).unwrap();
                assert!(
                    *lo <= v && v <= *hi,
                    "{name}: default {v} outside {lo}-{hi}"
                );
            }
            assert!(!why.is_empty());
        }
        let mut m = CostModel::default();
        m.set_hardware_ns("pml_log_ns", 7.0, "here").unwrap();
        assert_eq!(
            (m.hardware.pml_log_ns, m.source("hardware.pml_log_ns")),
            (7.0, Some("here"))
        );
        assert!(m.set_hardware_ns("nope", 1.0, "").is_err());
        assert!(m.set_hardware_ns("pml_log_ns", -1.0, "").is_err());
    }

    #[test]
    fn vcpu_threads_stay_on_one_socket_up_to_a_quarter_of_it_then_spread_evenly() {
        let h = Host::CASCADE_LAKE_2S;
        let count = |n: usize| {
            let s = h.vcpu_sockets(n);
            (
                s.iter().filter(|&&x| x == 0).count(),
                s.iter().filter(|&&x| x == 1).count(),
            )
        };
        assert_eq!(count(2), (2, 0));
        assert_eq!(count(12), (12, 0), "imb_numa_nr = 48 >> 2");
        assert_eq!(count(13), (7, 6));
        assert_eq!(count(16), (8, 8));
        assert_eq!(count(64), (32, 32));
        assert!(Host::ALTRA_1S.vcpu_sockets(64).iter().all(|&s| s == 0));
        assert_eq!(
            Host {
                sockets: 2,
                cpus_per_socket: 2,
                ..Host::CASCADE_LAKE_2S
            }
            .vcpu_sockets(3),
            vec![0, 0, 1]
        );
    }

    use super::*;

    #[test]
    fn every_meter_field_is_priced_exactly_once() {
        // The field list matches Meter::to_map(), names and values.
        let mut c = [0u64; NF];
        for (i, v) in c.iter_mut().enumerate() {
            *v = 1000 + i as u64;
        }
        let m = meter_from_counts(c);
        let map = m.to_map();
        assert_eq!(map.len(), NF);
        for (i, f) in METER_FIELDS.iter().enumerate() {
            assert_eq!(map[*f], 1000 + i as u64, "{f}");
        }
        // Software defaults: each software field once, no hardware-event field.
        let mut seen = vec![0; NF];
        for (f, ns, src) in SOFTWARE_DEFAULTS {
            let i = field_index(f).unwrap_or_else(|| panic!("{f} is not a Meter field"));
            assert!(!is_hardware_event(i), "{f} is a hardware event");
            assert!(*ns >= 0.0 && !src.is_empty());
            seen[i] += 1;
        }
        for i in 0..NF {
            let want = usize::from(!is_hardware_event(i));
            assert_eq!(seen[i], want, "{} in SOFTWARE_DEFAULTS", METER_FIELDS[i]);
        }
        // Hardware defaults: each cost once; every hardware-event field has a hardware cost.
        for n in HardwareCosts::NAMES {
            let k = HARDWARE_DEFAULTS.iter().filter(|(h, _, _)| h == n).count();
            assert_eq!(k, 1, "{n} in HARDWARE_DEFAULTS");
        }
        assert_eq!(HARDWARE_DEFAULTS.len(), NH);
        for f in HARDWARE_EVENT_FIELDS {
            let name = METER_FIELDS[f as usize];
            let priced = HardwareCosts::NAMES
                .iter()
                .any(|n| HardwareCosts::multiplies(n).unwrap().contains(&name));
            assert_eq!(
                priced,
                !QUEUED_EVENT_FIELDS.contains(&f),
                "{name}: every hardware event but the queued ones has a hardware cost"
            );
        }
    }

    #[test]
    fn nanos_counts_each_field_once_with_its_hardware_costs() {
        let mut m = CostModel::default();
        // Powers of two below the hardware costs make any double count or omission visible
        // (each field is priced alone below).
        for (k, f) in CostModel::software_fields().enumerate() {
            m.set_software_ns(f, (1u64 << (k % 32)) as f64).unwrap();
        }
        let h = &mut m.hardware;
        h.vm_exit_entry_ns = 1e9;
        h.ept_violation_ns = 2e9;
        h.page_walk_level_ns = 4e9;
        h.tlb_miss_ns = 8e9;
        h.tlb_hit_ns = 16e9;
        h.guest_memory_access_ns = 32e9;
        h.tlbi_ns = 64e9;
        h.ipi_send_ns = 128e9;
        h.ipi_ack_ns = 256e9;
        h.tlbi_is_ns = 512e9;
        h.dsb_ish_ns = 1024e9;
        h.dc_civac_line_ns = 2048e9;
        h.tlbi_local_ns = 8192e9;
        h.lock_line_transfer_ns = 4096e9;
        let h = m.hardware.clone();
        for i in 0..NF {
            let mut c = [0u64; NF];
            c[i] = 1;
            let field = METER_FIELDS[i];
            let sw = m.software_ns(field).unwrap_or(0.0);
            let hw: f64 = HardwareCosts::NAMES
                .iter()
                .filter(|n| HardwareCosts::multiplies(n).unwrap().contains(&field))
                .map(|n| h.get(n).unwrap())
                .sum();
            let want = sw + hw;
            assert_eq!(m.nanos_f64(&meter_from_counts(c)), want, "{field}");
            assert_eq!(m.unit_ns(field), Some(want));
        }
        // The documented mapping.
        let unit = |f: &str| m.unit_ns(f).unwrap() - m.software_ns(f).unwrap_or(0.0);
        assert_eq!(unit("vm_exits"), 1e9);
        assert_eq!(unit("ept_violations"), 2e9);
        assert_eq!(unit("hw_walk_levels"), 4e9);
        assert_eq!(unit("hw_walks"), 8e9);
        assert_eq!(unit("tlb_hits"), 16e9);
        assert_eq!(unit("guest_reads"), 32e9);
        assert_eq!(unit("guest_writes"), 32e9);
        assert_eq!(unit("tlb_flushes"), 64e9);
        assert_eq!(unit("flush_kicks"), 384e9);
        assert_eq!(unit("tlbi_ops"), 512e9);
        assert_eq!(unit("dsb_waits"), 1024e9);
        assert_eq!(unit("cmo_lines"), 2048e9);
        assert_eq!(unit("tlbi_local_ops"), 8192e9);
        assert_eq!(unit("lock_line_transfers"), 4096e9);
        assert_eq!(unit("pf_slow"), 0.0);
    }

    #[test]
    fn nanos_is_linear() {
        let m = CostModel::default();
        let mut a = [0u64; NF];
        let mut b = [0u64; NF];
        for i in 0..NF {
            a[i] = (i as u64 * 7919) % 1000;
            b[i] = (i as u64 * 104729) % 777;
        }
        let (ma, mb) = (meter_from_counts(a), meter_from_counts(b));
        let mut sum = ma.clone();
        sum.add(&mb);
        let (x, y, s) = (m.nanos_f64(&ma), m.nanos_f64(&mb), m.nanos_f64(&sum));
        assert!((s - (x + y)).abs() <= 1e-9 * s, "{s} vs {x} + {y}");
        let three = meter_from_counts(a.map(|v| 3 * v));
        assert!((m.nanos_f64(&three) - 3.0 * x).abs() <= 1e-9 * x);
        assert_eq!(m.nanos(&Meter::default()), 0);
        assert!(m.nanos(&sum).abs_diff(m.nanos(&ma) + m.nanos(&mb)) <= 1);
        let total: f64 = m.breakdown(&sum).iter().map(|(_, ns)| ns).sum();
        assert!((total - s).abs() <= 1e-9 * s);
    }
}
