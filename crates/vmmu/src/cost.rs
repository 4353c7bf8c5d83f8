//! The cost model: what one unit of each [`Meter`] counter costs in nanoseconds, and what the
//! hardware events around the MMU cost (VM exits, page walks, TLB hits, IPIs, TLB invalidation,
//! guest memory accesses). MMU code never reads a clock; it counts its work on a `Meter`, and
//! [`CostModel::nanos`] turns a meter into time.
//!
//! # File format
//!
//! A JSON object (see `crates/vmmu/cost-model.default.json`, generated from
//! [`CostModel::default`]):
//!
//! ```json
//! {
//!   "format": 1,
//!   "origin": "where the numbers come from",
//!   "software": { "ept_violations": 50.0, "pf_slow": 250.0, ... },
//!   "hardware": { "vm_exit_entry_ns": 450.0, ... },
//!   "sources": { "software": { "pf_slow": "..." }, "hardware": { "vm_exit_entry_ns": "..." } }
//! }
//! ```
//!
//! - `software`: nanoseconds per unit of a `Meter` field that counts KVM software work, keyed by
//!   the field's name in [`Meter::to_map`]. The five fields that count hardware events
//!   (`guest_reads`, `guest_writes`, `tlb_hits`, `hw_walks`, `hw_walk_levels`) are not allowed
//!   here: only `hardware` prices them.
//! - `hardware`: nanoseconds per hardware event, each multiplying fixed `Meter` fields (table
//!   below).
//! - `sources`: optional, one line per cost saying where its value comes from.
//! - Every cost is a finite, non-negative number. A key left out keeps its default, so a file may
//!   list only the costs it changes. Any other key is an error that names the allowed ones.
//!
//! # What each cost multiplies
//!
//! [`CostModel::nanos`] is `Σ count(field) × (software[field] + Σ hardware costs of field)`;
//! every field is counted once, with these hardware costs added to its software cost:
//!
//! | `Meter` field | software cost | hardware costs added per unit |
//! |---|---|---|
//! | `vm_exits` | — | `vm_exit_entry_ns` |
//! | `ept_violations` | yes (KVM's fault entry) | `ept_violation_ns` |
//! | `hw_walks` | — | `tlb_miss_ns` |
//! | `hw_walk_levels` | — | `page_walk_level_ns` |
//! | `tlb_hits` | — | `tlb_hit_ns` |
//! | `guest_reads`, `guest_writes` | — | `guest_memory_access_ns` |
//! | `tlb_flushes` | yes (servicing the request) | `tlbi_ns` |
//! | `flush_kicks` | yes (building the kick) | `ipi_send_ns` + `ipi_ack_ns` |
//! | every other field | yes | — |
//!
//! The result is one actor's busy time. Waiting (for `mmu_lock`, for the acks of a remote flush
//! beyond `ipi_ack_ns`) is not in it: an engine that schedules actors models waits itself.
//!
//! # Defaults
//!
//! [`CostModel::default`] comes from first principles (cycle estimates of the KVM code each
//! counter stands for, at an assumed 3 GHz) and public measurements; each value's source is in
//! [`SOFTWARE_DEFAULTS`] and [`HARDWARE_DEFAULTS`] and in the file's `sources`. They are not
//! fitted to any benchmark result.
//!
//! # Calibration
//!
//! [`calibrate`] fits the software costs of this machine to timed workloads (`vmmu calibrate`
//! times them): see [`fit_unit_costs`] for the method.

use crate::kvm::meter::Meter;
use serde::de::Error as _;
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The file format version this code reads and writes.
pub const FORMAT: u64 = 1;

/// Index of a `Meter` field (short alias used throughout this module).
use crate::kvm::meter::MeterField as F;
use crate::kvm::meter::{METER_FIELDS, NR_METER_FIELDS as NF};

/// The counters of `m` in [`METER_FIELDS`] order.
fn meter_counts(m: &Meter) -> [u64; NF] {
    m.counts()
}

/// A meter with the given counters (tests).
#[cfg(test)]
fn meter_from_counts(c: [u64; NF]) -> Meter {
    Meter::from_counts(c)
}

/// `Meter` fields that count hardware events; only `hardware` costs price them.
const HARDWARE_EVENT_FIELDS: [F; 6] = [
    F::vm_exits,
    F::guest_reads,
    F::guest_writes,
    F::tlb_hits,
    F::hw_walks,
    F::hw_walk_levels,
];

fn is_hardware_event(i: usize) -> bool {
    HARDWARE_EVENT_FIELDS.iter().any(|f| *f as usize == i)
}

fn field_index(name: &str) -> Option<usize> {
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

            fn get_mut(&mut self, name: &str) -> Option<&mut f64> {
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
    /// One entry read by a hardware page walk. Multiplies `hw_walk_levels`.
    page_walk_level_ns: [hw_walk_levels],
    /// The fixed part of a TLB miss that the model's EPT-only walk leaves out (STLB miss, the
    /// guest dimension of the two-dimensional walk). Multiplies `hw_walks`.
    tlb_miss_ns: [hw_walks],
    /// Translating an access through a cached TLB entry. Multiplies `tlb_hits`.
    tlb_hit_ns: [tlb_hits],
    /// One 8-byte guest memory access once translated. Multiplies `guest_reads` and
    /// `guest_writes`.
    guest_memory_access_ns: [guest_reads, guest_writes],
    /// One TLB invalidation operation (INVEPT on x86) executed by a vCPU that services a flush
    /// request. Multiplies `tlb_flushes`.
    tlbi_ns: [tlb_flushes],
    /// Sending the IPI that kicks one vCPU. Multiplies `flush_kicks`.
    ipi_send_ns: [flush_kicks],
    /// Waiting for one kicked vCPU's acknowledgement (delivery, its VM exit, the host's handler).
    /// Multiplies `flush_kicks`.
    ipi_ack_ns: [flush_kicks],
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
    ("spte_reads", 2.0, "estimate, ~6 cycles: one tdp_iter step, a READ_ONCE() of an entry in an L1-resident table (L1 hit 4-5 cycles) plus the iterator's arithmetic"),
    ("spte_writes", 3.0, "estimate, ~10 cycles: storing one computed SPTE; most are the 512 child entries of a split or the frozen entries of a removed table; the extra cost of atomic updates in faults and write protection is in pf_map_*, sptes_wrprot and split_*"),
    ("cmpxchg_failed", 40.0, "estimate, ~120 cycles: a cmpxchg that lost a race, i.e. a locked operation on a cache line another core just wrote (a cross-core line transfer) and re-reading the entry"),
    ("tables_allocated", 200.0, "estimate, ~600 cycles: a page-table page for the MMU memory cache, __get_free_page(__GFP_ZERO) (allocator fast path ~200 cycles, zeroing 4 KiB ~250) plus struct kvm_mmu_page from its kmem_cache (~100)"),
    ("tables_freed", 150.0, "estimate, ~450 cycles: tdp_mmu_free_sp() through call_rcu(): the RCU callback, free_page() and kmem_cache_free()"),
    ("bitmap_words", 2.0, "estimate, ~6 cycles: one 64-bit word of a dirty bitmap copied to the user buffer, or read and exchanged in GET/CLEAR's loop (sequential, prefetched memory)"),
    ("sptes_wrprot", 20.0, "estimate, ~60 cycles: clearing W in one leaf, the locked cmpxchg of tdp_mmu_set_spte_atomic() and handle_changed_spte(); the store is spte_writes"),
    ("pages_dirtied", 10.0, "estimate, ~30 cycles: mark_page_dirty_in_slot(), a set_bit_le() into the dirty bitmap (locked bit operation) or one dirty-ring entry"),
    ("remote_flushes", 50.0, "estimate, ~150 cycles: kvm_flush_remote_tlbs() without its kicks: kvm_make_all_cpus_request() setting KVM_REQ_TLB_FLUSH and reading vcpu->mode for a few vCPUs, and the barrier"),
    ("flush_kicks", 20.0, "estimate, ~60 cycles: per kicked vCPU, kvm_request_needs_ipi() and adding its CPU to the cpumask; the IPI is hardware.ipi_send_ns and ipi_ack_ns"),
    ("rmap_reads", 3.0, "estimate, ~10 cycles: one rmap head read by __walk_slot_rmaps() (slot_rmap_walk_next() index arithmetic; the rmap array is read sequentially, so prefetched)"),
    ("rmap_adds", 20.0, "estimate, ~60 cycles: pte_list_add() on an empty or single-entry head (or appending to a pte_list_desc), gfn_to_rmap(), kvm_mmu_page_set_translation() and kvm_update_page_stats() in __rmap_add(); the rmap array line usually misses L1"),
    ("rmap_removes", 20.0, "estimate, ~60 cycles: pte_list_remove() with kvm_mmu_page_get_gfn() and gfn_to_rmap() to find the head, as rmap_adds"),
    ("sp_lookups", 10.0, "estimate, ~30 cycles: hash_64() of the gfn and loading the mmu_page_hash bucket head in kvm_mmu_find_shadow_page() or for_each_gfn_valid_sp*(); the pages walked are sp_hash_steps"),
    ("sp_hash_steps", 15.0, "estimate, ~45 cycles: one step of an mmu_page_hash bucket walk, a dependent load of the next struct kvm_mmu_page's gfn and role that misses L1 and L2 (L3 hit ~40-50 cycles, 7-cpu.com 'Intel Skylake', unverified); buckets fill as the VM's shadow pages grow (4096 buckets)"),
    ("sp_zapped", 100.0, "estimate, ~300 cycles: __kvm_mmu_prepare_zap_page() beyond its per-entry work: unlinking parents and unsync state, unaccount_shadowed(), moving the page to invalid_list; the 512 entries are spte_reads/spte_writes and freeing is tables_freed"),
    ("guest_pte_reads", 15.0, "estimate, ~45 cycles: one guest PTE read by FNAME(walk_addr_generic)(): the gfn to host-virtual translation of the table (memslot cache hit) and a __get_user() of an 8-byte entry that is usually cached"),
    ("pf_emulated", 1500.0, "estimate, ~4,500 cycles: x86_emulate_instruction() for a guest store to a write-protected guest page table: fetching and decoding the instruction, emulator_write_phys() and the page-track notifier (kvm_mmu_track_write() beyond its zaps)"),
    ("sptes_synced", 30.0, "estimate, ~90 cycles: FNAME(sync_spte)(): reading one guest PTE of an unsync page, comparing it with the shadowed translation and rewriting the SPTE"),
    ("lock_yields", 100.0, "estimate, ~300 cycles: a cond_resched_rwlock_*() that yields: RCU unlock/lock and releasing and retaking mmu_lock (atomics on a contended line); the restarted walk is spte_reads and time spent waiting is not included"),
    ("lock_drops_for_alloc", 100.0, "estimate, ~300 cycles: dropping mmu_lock and RCU to allocate and retaking them, as lock_yields; the allocation is tables_allocated"),
];

/// Default hardware costs: (name, ns, source).
pub const HARDWARE_DEFAULTS: &[(&str, f64, &str)] = &[
    ("vm_exit_entry_ns", 450.0, "~1,350 cycles at 3 GHz: VMRUN to the return of #VMEXIT for a minimal exit, 1,344-1,376 cycles measured on an AMD host on LKML (Dec 2020, thread of 'KVM: SVM: use vmsave/vmload for saving/restoring additional host state'); Agesen et al., USENIX ATC 2012 (unverified), trace the same round trip on Intel VMX across generations"),
    ("ept_violation_ns", 200.0, "~600 cycles: KVM's work around an in-kernel exit that the model does not execute (vcpu_enter_guest()'s post-exit and pre-entry state handling, exit dispatch, VMREADs of the exit qualification and guest-physical address); the same LKML measurement shows ~576 cycles from KVM_RUN entry to VMRUN and ~600 from #VMEXIT to ioctl exit, of which an in-kernel exit pays about half of each"),
    ("page_walk_level_ns", 4.0, "~12 cycles: one walk reference that hits L2 (Skylake L2 latency 12 cycles, 7-cpu.com 'Intel Skylake', unverified); references held by the paging-structure caches cost less, leaf entries that miss L2 more"),
    ("tlb_miss_ns", 10.0, "~30 cycles, estimate: the fixed part of a TLB miss the EPT-only walk omits: the L1 DTLB/STLB miss penalty (~9 cycles, 7-cpu.com 'Intel Skylake', unverified) and the guest dimension of the two-dimensional walk (up to 24 references for 4-level guest and EPT tables, Bhargava et al., ASPLOS 2008, unverified), mostly absorbed by paging-structure caches"),
    ("tlb_hit_ns", 0.5, "~1.5 cycles: an L1 DTLB hit is looked up in parallel with L1D and adds nothing; an STLB hit adds ~9 cycles (7-cpu.com 'Intel Skylake', unverified); streaming accesses mostly hit L1 DTLB entries"),
    ("guest_memory_access_ns", 10.0, "one 8-byte memstress access to a new 4 KiB page misses the caches (DRAM latency ~80-100 ns; 7-cpu.com 'Intel Skylake': 42 cycles + 51 ns, unverified), but the accesses are independent and a core keeps ~10-12 L1 misses in flight (line-fill buffers), so a stream costs ~latency/10 per access"),
    ("tlbi_ns", 100.0, "~300 cycles, estimate: single-context INVEPT when a vCPU services KVM_REQ_TLB_FLUSH, a serializing privileged instruction (no public per-instruction latency found); the refills it causes are not included, they appear as hw_walks"),
    ("ipi_send_ns", 100.0, "~300 cycles, estimate: per target, smp_call_function_many() queueing a call-single entry and the x2APIC ICR write (WRMSR)"),
    ("ipi_ack_ns", 1500.0, "estimate: delivery, the target's VM exit and ack_kick() in the host's handler; ipi_benchmark inside a Skylake 2.5 GHz guest measured 2.24 us to deliver and 2.51 us to see the ack of an IPI between vCPUs, where the sender also exits (Linux commit 'KVM: X86: Implement \"send IPI\" hypercall'); a host kick skips the sender's exit. Charged per kicked vCPU, an upper bound when acks overlap"),
];

/// A cost model: nanoseconds per unit of each `Meter` field that counts KVM software work, and
/// the costs of hardware events. See the module documentation for the file format and for which
/// fields each cost multiplies.
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// Where the numbers come from (one line).
    pub origin: String,
    /// ns per unit, in `METER_FIELDS` order; hardware-event fields stay 0.
    software: [f64; NF],
    /// Costs of hardware events.
    pub hardware: HardwareCosts,
    /// One line per cost saying where its value comes from, keyed `software.FIELD` or
    /// `hardware.NAME`.
    sources: BTreeMap<String, String>,
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
            origin: "defaults: first-principles estimates and public measurements (crates/vmmu/src/cost.rs)".into(),
            software,
            hardware: HardwareCosts::default(),
            sources,
        }
    }
}

fn check_cost(key: &str, ns: f64) -> Result<(), String> {
    if ns.is_finite() && ns >= 0.0 {
        Ok(())
    } else {
        Err(format!(
            "`{key}` is {ns}: costs must be finite, non-negative nanoseconds"
        ))
    }
}

impl CostModel {
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
    pub fn set_software_ns(&mut self, field: &str, ns: f64) -> Result<(), String> {
        let i = field_index(field)
            .filter(|i| !is_hardware_event(*i))
            .ok_or_else(|| unknown_software_key(field))?;
        check_cost(&format!("software.{field}"), ns)?;
        self.software[i] = ns;
        self.sources.remove(&format!("software.{field}"));
        Ok(())
    }

    /// Where the value of `key` (`software.FIELD` or `hardware.NAME`) comes from.
    pub fn source(&self, key: &str) -> Option<&str> {
        self.sources.get(key).map(String::as_str)
    }

    /// Records where the value of `key` (`software.FIELD` or `hardware.NAME`) comes from.
    pub fn set_source(&mut self, key: &str, source: &str) -> Result<(), String> {
        check_key(key)?;
        self.sources.insert(key.to_string(), source.to_string());
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

    /// The model as the JSON text of a cost file (pretty-printed, keys in a fixed order).
    pub fn to_json_string(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("a cost model serializes");
        s.push('\n');
        s
    }

    /// Parses the JSON text of a cost file. Errors are one line: what is wrong and what is
    /// allowed.
    pub fn from_json_str(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        Self::from_value(&v)
    }

    /// Reads a cost file. Errors are one line that names the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, String> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cost model {}: cannot read it: {e}", path.display()))?;
        Self::from_json_str(&text).map_err(|e| format!("cost model {}: {e}", path.display()))
    }

    /// Writes the model as a cost file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), String> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json_string())
            .map_err(|e| format!("cannot write cost model {}: {e}", path.display()))
    }

    fn from_value(v: &Value) -> Result<Self, String> {
        const TOP: &str = "format, origin, software, hardware, sources";
        let obj = v
            .as_object()
            .ok_or_else(|| format!("the file must hold a JSON object with the keys {TOP}"))?;
        let mut m = CostModel {
            origin: String::new(),
            ..CostModel::default()
        };
        for key in obj.keys() {
            if !["format", "origin", "software", "hardware", "sources"].contains(&key.as_str()) {
                return Err(format!("unknown key `{key}`; allowed keys: {TOP}"));
            }
        }
        if let Some(f) = obj.get("format") {
            if f.as_u64() != Some(FORMAT) {
                return Err(format!("`format` is {f}: this vmmu reads format {FORMAT}"));
            }
        }
        if let Some(o) = obj.get("origin") {
            m.origin = o
                .as_str()
                .ok_or_else(|| format!("`origin` is {o}: it must be a string"))?
                .to_string();
        }
        if let Some(sw) = obj.get("software") {
            for (field, value) in section(sw, "software")? {
                let key = format!("software.{field}");
                let i = field_index(field)
                    .filter(|i| !is_hardware_event(*i))
                    .ok_or_else(|| unknown_software_key(field))?;
                m.software[i] = cost_value(&key, value)?;
                m.sources.remove(&key);
            }
        }
        if let Some(hw) = obj.get("hardware") {
            for (name, value) in section(hw, "hardware")? {
                let key = format!("hardware.{name}");
                let ns = cost_value(&key, value)?;
                *m.hardware
                    .get_mut(name)
                    .ok_or_else(|| unknown_hardware_key(name))? = ns;
                m.sources.remove(&key);
            }
        }
        if let Some(src) = obj.get("sources") {
            for (part, entries) in section(src, "sources")? {
                if part != "software" && part != "hardware" {
                    return Err(format!(
                        "unknown key `sources.{part}`; allowed keys: software, hardware"
                    ));
                }
                for (name, text) in section(entries, &format!("sources.{part}"))? {
                    let key = format!("{part}.{name}");
                    check_key(&key)?;
                    let text = text.as_str().ok_or_else(|| {
                        format!("`sources.{key}` is {text}: a source must be a string")
                    })?;
                    m.sources.insert(key, text.to_string());
                }
            }
        }
        Ok(m)
    }
}

fn section<'v>(v: &'v Value, name: &str) -> Result<&'v serde_json::Map<String, Value>, String> {
    v.as_object()
        .ok_or_else(|| format!("`{name}` is {v}: it must be a JSON object"))
}

fn cost_value(key: &str, v: &Value) -> Result<f64, String> {
    let ns = v
        .as_f64()
        .ok_or_else(|| format!("`{key}` is {v}: costs must be numbers of nanoseconds"))?;
    check_cost(key, ns)?;
    Ok(ns)
}

fn unknown_software_key(field: &str) -> String {
    let allowed: Vec<&str> = CostModel::software_fields().collect();
    match field_index(field) {
        Some(_) => {
            let by: Vec<&str> = HardwareCosts::NAMES
                .iter()
                .copied()
                .filter(|n| HardwareCosts::multiplies(n).is_some_and(|f| f.contains(&field)))
                .collect();
            format!(
                "`software.{field}` is not allowed: {field} counts a hardware event, priced by hardware.{}; allowed software keys: {}",
                by.join(" + hardware."),
                allowed.join(", ")
            )
        }
        None => format!(
            "unknown key `software.{field}`; allowed software keys (Meter fields): {}",
            allowed.join(", ")
        ),
    }
}

fn unknown_hardware_key(name: &str) -> String {
    format!(
        "unknown key `hardware.{name}`; allowed hardware keys: {}",
        HardwareCosts::NAMES.join(", ")
    )
}

fn check_key(key: &str) -> Result<(), String> {
    match key.split_once('.') {
        Some(("software", f)) => field_index(f)
            .filter(|i| !is_hardware_event(*i))
            .map(|_| ())
            .ok_or_else(|| unknown_software_key(f)),
        Some(("hardware", n)) => HardwareCosts::NAMES
            .contains(&n)
            .then_some(())
            .ok_or_else(|| unknown_hardware_key(n)),
        _ => Err(format!(
            "unknown cost `{key}`: costs are named software.FIELD or hardware.NAME"
        )),
    }
}

/// Serializes `(key, value)` pairs as a JSON object in the given order.
struct Ordered<V: Serialize>(Vec<(&'static str, V)>);

impl<V: Serialize> Serialize for Ordered<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl Serialize for CostModel {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let software = Ordered(
            CostModel::software_fields()
                .map(|f| (f, self.software[field_index(f).expect("a Meter field")]))
                .collect(),
        );
        let hardware = Ordered(
            HardwareCosts::NAMES
                .iter()
                .map(|n| (*n, self.hardware.get(n).expect("a hardware cost")))
                .collect(),
        );
        let src = |part: &str, keys: Vec<&'static str>| {
            Ordered(
                keys.into_iter()
                    .filter_map(|k| {
                        self.sources
                            .get(&format!("{part}.{k}"))
                            .map(|t| (k, t.as_str()))
                    })
                    .collect(),
            )
        };
        let sources = Ordered(vec![
            (
                "software",
                src("software", CostModel::software_fields().collect()),
            ),
            ("hardware", src("hardware", HardwareCosts::NAMES.to_vec())),
        ]);
        let mut m = s.serialize_map(Some(5))?;
        m.serialize_entry("format", &FORMAT)?;
        m.serialize_entry("origin", &self.origin)?;
        m.serialize_entry("software", &software)?;
        m.serialize_entry("hardware", &hardware)?;
        m.serialize_entry("sources", &sources)?;
        m.end()
    }
}

impl<'de> Deserialize<'de> for CostModel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        CostModel::from_value(&v).map_err(D::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Calibration
// ---------------------------------------------------------------------------------------------

/// Unconstrained least squares `min ‖a·x − b‖` (Householder QR); `a` is a list of rows.
/// Columns linearly dependent on earlier ones get 0.
fn least_squares(a: &[Vec<f64>], b: &[f64]) -> Vec<f64> {
    let m = a.len();
    let k = a.first().map_or(0, Vec::len);
    // Column-major copy.
    let mut q: Vec<Vec<f64>> = (0..k).map(|j| a.iter().map(|r| r[j]).collect()).collect();
    let mut y = b.to_vec();
    let mut rdiag = vec![0.0; k];
    for c in 0..k.min(m) {
        let (head, tail) = q.split_at_mut(c + 1);
        let v = &mut head[c];
        let norm = v[c..].iter().map(|t| t * t).sum::<f64>().sqrt();
        if norm == 0.0 {
            continue;
        }
        let alpha = if v[c] > 0.0 { -norm } else { norm };
        v[c] -= alpha;
        let vv: f64 = v[c..].iter().map(|t| t * t).sum();
        rdiag[c] = alpha;
        if vv == 0.0 {
            continue;
        }
        for col in tail.iter_mut() {
            let f = 2.0 * (c..m).map(|i| v[i] * col[i]).sum::<f64>() / vv;
            for i in c..m {
                col[i] -= f * v[i];
            }
        }
        let f = 2.0 * (c..m).map(|i| v[i] * y[i]).sum::<f64>() / vv;
        for i in c..m {
            y[i] -= f * v[i];
        }
    }
    let rmax = rdiag.iter().fold(0.0f64, |acc, r| acc.max(r.abs()));
    let mut x = vec![0.0; k];
    for c in (0..k.min(m)).rev() {
        if rdiag[c].abs() <= 1e-12 * rmax {
            continue;
        }
        let s: f64 = (c + 1..k).map(|j| q[j][c] * x[j]).sum();
        x[c] = (y[c] - s) / rdiag[c];
    }
    x
}

/// The regularization of [`fit_unit_costs`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitWeights {
    /// Weight of the pull of each cost towards its prior:
    /// `prior · Σ_j w_j · (x_j + 1/x_j − 2)`, where `x_j = c_j / s_j` is the cost relative to
    /// the prior `s_j` (1 ns for a zero prior) and `w_j` is field `j`'s share of the workloads'
    /// time at the priors, summed over the workloads and at least [`FitWeights::MIN_SHARE`].
    ///
    /// The penalty is convex, weighs a cost 2× above its prior as much as one 2× below, and is
    /// infinite at zero, so every fitted cost stays positive. Weighting it by share makes the
    /// fields a workload cannot tell apart scale alike: they share the workload's time in
    /// proportion to their priors.
    pub prior: f64,
}

impl FitWeights {
    /// Smallest weight of a field's prior penalty, so that fields with a negligible share of
    /// every workload stay near their priors instead of absorbing noise.
    pub const MIN_SHARE: f64 = 0.25;

    /// No regularization: plain least squares of the relative residuals over positive costs.
    pub const NONE: FitWeights = FitWeights { prior: 0.0 };

    /// What [`calibrate`] uses: a field that is a tenth of one workload's time, 2× off its
    /// prior, costs `1e-3 · 0.1 · 0.5`, as much as a 0.7 % residual of that workload, and 30×
    /// off (`x + 1/x − 2 ≈ 28`) as much as a 5 % residual. So the data decide where they speak
    /// clearly, their blind spots are shared in proportion to the priors, and fields no workload
    /// exercises keep their priors.
    pub const CALIBRATION: FitWeights = FitWeights { prior: 1e-3 };
}

/// Fits per-unit costs `c > 0` to workloads: `counts[w][j]` units of field `j` took `times[w]`
/// ns in workload `w`. Minimizes the squared *relative* residuals of the workloads,
/// `Σ_w ((Σ_j counts[w][j]·c_j − times[w]) / times[w])²`, plus the prior penalty of `weights`
/// (see [`FitWeights`]), by Levenberg–Marquardt over `y_j = ln(c_j / s_j)`. The problem is
/// convex in `c`, so the optimum is unique (with a non-zero prior weight).
///
/// The workloads cannot separate fields that always occur in the same proportion, nor say
/// anything about fields they never exercise: such fields share their workload's time in
/// proportion to their priors (a workload that runs 2× faster than the priors predict makes each
/// of them about 2× cheaper), and fields no workload exercises keep their priors. With
/// [`FitWeights::NONE`] and independent workloads this recovers exact data.
pub fn fit_unit_costs(
    counts: &[Vec<f64>],
    times: &[f64],
    prior: &[f64],
    weights: FitWeights,
) -> Result<Vec<f64>, String> {
    let n = prior.len();
    if counts.len() != times.len() || counts.is_empty() {
        return Err(format!(
            "{} workloads with counts and {} with times; they must be equal and non-zero",
            counts.len(),
            times.len()
        ));
    }
    if let Some(r) = counts.iter().find(|r| r.len() != n) {
        return Err(format!("a workload has {} counts for {n} fields", r.len()));
    }
    if let Some(t) = times.iter().find(|t| !(t.is_finite() && **t > 0.0)) {
        return Err(format!("a workload time is {t}: times must be positive"));
    }
    if counts
        .iter()
        .flatten()
        .any(|c| !(c.is_finite() && *c >= 0.0))
    {
        return Err("counts must be finite and non-negative".into());
    }
    if prior
        .iter()
        .chain([&weights.prior])
        .any(|p| !p.is_finite() || *p < 0.0)
    {
        return Err("priors and weights must be finite and non-negative".into());
    }
    let scale: Vec<f64> = prior
        .iter()
        .map(|&p| if p > 0.0 { p } else { 1.0 })
        .collect();
    // Data rows in units of the priors: a[w][j] · x_j is field j's part of workload w's
    // predicted time, relative to its measured time.
    let a: Vec<Vec<f64>> = counts
        .iter()
        .zip(times)
        .map(|(row, &t)| row.iter().zip(&scale).map(|(c, s)| c * s / t).collect())
        .collect();
    // √(prior · w_j): the penalty is the square of this times (√x − 1/√x).
    let pull: Vec<f64> = (0..n)
        .map(|j| {
            let share: f64 = a.iter().map(|r| r[j]).sum();
            (weights.prior * share.max(FitWeights::MIN_SHARE)).sqrt()
        })
        .collect();
    // Fields no workload counts and no penalty touches stay at the prior.
    let free: Vec<usize> = (0..n)
        .filter(|&j| pull[j] > 0.0 || a.iter().any(|r| r[j] != 0.0))
        .collect();
    let residuals = |y: &[f64]| -> Vec<f64> {
        let mut r: Vec<f64> = a
            .iter()
            .map(|row| row.iter().zip(y).map(|(a, y)| a * y.exp()).sum::<f64>() - 1.0)
            .collect();
        r.extend(
            free.iter()
                .map(|&j| pull[j] * ((y[j] / 2.0).exp() - (-y[j] / 2.0).exp())),
        );
        r
    };
    let cost = |r: &[f64]| r.iter().map(|v| v * v).sum::<f64>();
    let mut y = vec![0.0; n];
    let mut r = residuals(&y);
    let mut f = cost(&r);
    let mut mu: f64 = 1e-3;
    for _ in 0..5000 {
        // Jacobian of the residuals over the free fields, damped: [J; √μ·I] δ = [−r; 0].
        let mut jac: Vec<Vec<f64>> = a
            .iter()
            .map(|row| free.iter().map(|&j| row[j] * y[j].exp()).collect())
            .collect();
        for (k, &j) in free.iter().enumerate() {
            let mut row = vec![0.0; free.len()];
            row[k] = pull[j] * ((y[j] / 2.0).exp() + (-y[j] / 2.0).exp()) / 2.0;
            jac.push(row);
        }
        let mut rhs: Vec<f64> = r.iter().map(|v| -v).collect();
        for k in 0..free.len() {
            let mut row = vec![0.0; free.len()];
            row[k] = mu.sqrt();
            jac.push(row);
            rhs.push(0.0);
        }
        let step = least_squares(&jac, &rhs);
        let mut trial = y.clone();
        for (k, &j) in free.iter().enumerate() {
            trial[j] = (y[j] + step[k].clamp(-5.0, 5.0)).clamp(-60.0, 60.0);
        }
        let rt = residuals(&trial);
        let ft = cost(&rt);
        if ft < f {
            let moved = free
                .iter()
                .map(|&j| (trial[j] - y[j]).abs())
                .fold(0.0, f64::max);
            let converged = moved < 1e-10 || f - ft <= 1e-18 * f;
            y = trial;
            r = rt;
            f = ft;
            mu = (mu / 3.0).max(1e-12);
            if converged {
                break;
            }
        } else {
            mu *= 4.0;
            if mu > 1e12 {
                break;
            }
        }
    }
    Ok(y.iter().zip(&scale).map(|(y, s)| s * y.exp()).collect())
}

/// Starting guess for the model's own cost of emulating one hardware event (an access, a TLB
/// lookup, a walk step) in [`calibrate`]. Those costs are fitted so that the emulation's time is
/// not charged to the software fields, and are never written to a cost file.
pub const EMULATED_EVENT_PRIOR_NS: f64 = 5.0;

/// One timed calibration workload: the work its `Meter` counted and how long it took.
#[derive(Clone, Debug)]
pub struct Observation {
    /// Name of the workload.
    pub name: String,
    /// What the MMU counted during the timed part.
    pub meter: Meter,
    /// How long the timed part took, in ns.
    pub nanos: f64,
}

/// The fitted cost of one `Meter` field.
#[derive(Clone, Debug)]
pub struct FittedCost {
    /// The `Meter` field.
    pub field: &'static str,
    /// The field has a software cost; when false it counts a hardware event, the fitted value
    /// is this machine's cost of *emulating* it, and the cost file keeps the hardware costs.
    pub software: bool,
    /// Some workload counted the field.
    pub exercised: bool,
    /// The base model's cost (the fit's prior).
    pub prior_ns: f64,
    /// The fitted cost.
    pub fitted_ns: f64,
    /// The largest fraction of one workload's measured time that the field accounts for at the
    /// fitted cost: how much the data, rather than the prior, decide the value.
    pub max_share: f64,
}

/// How well the fitted costs explain one workload.
#[derive(Clone, Debug)]
pub struct WorkloadFit {
    /// Name of the workload.
    pub name: String,
    /// Measured time, ns.
    pub measured_ns: f64,
    /// `Σ count × fitted cost` over every field, ns.
    pub predicted_ns: f64,
}

impl WorkloadFit {
    /// `(predicted − measured) / measured`.
    pub fn residual(&self) -> f64 {
        (self.predicted_ns - self.measured_ns) / self.measured_ns
    }
}

/// The result of [`calibrate`].
#[derive(Clone, Debug)]
pub struct Calibration {
    /// The base model with the fitted software costs.
    pub model: CostModel,
    /// Every `Meter` field's fit, in `Meter` order.
    pub costs: Vec<FittedCost>,
    /// Every workload's fit, in the order given.
    pub workloads: Vec<WorkloadFit>,
}

/// Fits this machine's software costs to timed workloads with [`fit_unit_costs`], using
/// `base`'s software costs as the prior ([`EMULATED_EVENT_PRIOR_NS`] for the fields that count
/// hardware events, whose fitted emulation costs are reported but not kept). Fields no workload
/// exercises keep `base`'s cost; hardware costs are `base`'s. Fitted costs are rounded to
/// 0.001 ns.
pub fn calibrate(
    observations: &[Observation],
    base: &CostModel,
    origin: &str,
) -> Result<Calibration, String> {
    let counts: Vec<Vec<f64>> = observations
        .iter()
        .map(|o| meter_counts(&o.meter).iter().map(|&c| c as f64).collect())
        .collect();
    let times: Vec<f64> = observations.iter().map(|o| o.nanos).collect();
    let prior: Vec<f64> = (0..NF)
        .map(|i| {
            if is_hardware_event(i) {
                EMULATED_EVENT_PRIOR_NS
            } else {
                base.software[i]
            }
        })
        .collect();
    let fitted: Vec<f64> = fit_unit_costs(&counts, &times, &prior, FitWeights::CALIBRATION)?
        .into_iter()
        .map(|c| (c * 1000.0).round() / 1000.0)
        .collect();
    let mut model = base.clone();
    model.origin = origin.to_string();
    let names: Vec<&str> = observations.iter().map(|o| o.name.as_str()).collect();
    let mut costs = Vec::with_capacity(NF);
    for i in 0..NF {
        let field = METER_FIELDS[i];
        let exercised = counts.iter().any(|r| r[i] > 0.0);
        let max_share = counts
            .iter()
            .zip(&times)
            .map(|(r, t)| r[i] * fitted[i] / t)
            .fold(0.0, f64::max);
        let software = !is_hardware_event(i);
        if software && exercised {
            model.software[i] = fitted[i];
            let used: Vec<&str> = names
                .iter()
                .zip(&counts)
                .filter(|(_, r)| r[i] > 0.0)
                .map(|(n, _)| *n)
                .collect();
            model.sources.insert(
                format!("software.{field}"),
                format!(
                    "fitted by vmmu calibrate ({origin}) from workloads {}",
                    used.join(", ")
                ),
            );
        } else if software {
            let key = format!("software.{field}");
            let was = base.sources.get(&key).cloned().unwrap_or_default();
            model.sources.insert(
                key,
                format!("not exercised by vmmu calibrate; kept from the base model: {was}"),
            );
        }
        costs.push(FittedCost {
            field,
            software,
            exercised,
            prior_ns: prior[i],
            fitted_ns: if software && !exercised {
                base.software[i]
            } else {
                fitted[i]
            },
            max_share,
        });
    }
    let workloads = observations
        .iter()
        .zip(&counts)
        .map(|(o, r)| WorkloadFit {
            name: o.name.clone(),
            measured_ns: o.nanos,
            predicted_ns: r.iter().zip(&fitted).map(|(c, f)| c * f).sum(),
        })
        .collect();
    Ok(Calibration {
        model,
        costs,
        workloads,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT_FILE: &str = include_str!("../cost-model.default.json");

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
            assert!(
                HardwareCosts::NAMES
                    .iter()
                    .any(|n| HardwareCosts::multiplies(n).unwrap().contains(&name)),
                "{name} has no hardware cost"
            );
        }
    }

    #[test]
    fn default_file_equals_the_defaults() {
        let text = CostModel::default().to_json_string();
        if std::env::var_os("VMMU_WRITE_DEFAULT_COST_MODEL").is_some() {
            let path = concat!(env!("CARGO_MANIFEST_DIR"), "/cost-model.default.json");
            std::fs::write(path, &text).unwrap();
            return;
        }
        assert!(
            DEFAULT_FILE == text,
            "crates/vmmu/cost-model.default.json differs from CostModel::default(); regenerate it with VMMU_WRITE_DEFAULT_COST_MODEL=1 cargo test -p vmmu --lib cost"
        );
        assert_eq!(
            CostModel::from_json_str(DEFAULT_FILE).unwrap(),
            CostModel::default()
        );
    }

    #[test]
    fn json_round_trip() {
        let mut m = CostModel {
            origin: "test".into(),
            ..CostModel::default()
        };
        m.set_software_ns("pf_slow", 123.456).unwrap();
        m.hardware.ipi_ack_ns = 0.0;
        m.set_source("hardware.ipi_ack_ns", "made up").unwrap();
        let back = CostModel::from_json_str(&m.to_json_string()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.source("software.pf_slow"), None);
        assert_eq!(back.source("hardware.ipi_ack_ns"), Some("made up"));
        // Through serde too.
        let v = serde_json::to_value(&m).unwrap();
        let back: CostModel = serde_json::from_value(v).unwrap();
        assert_eq!(back, m);
        // And through a file.
        let path = std::env::temp_dir().join(format!("vmmu-cost-{}.json", std::process::id()));
        m.save(&path).unwrap();
        assert_eq!(CostModel::load(&path).unwrap(), m);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_partial_file_keeps_the_other_defaults() {
        let m = CostModel::from_json_str(r#"{"hardware": {"ipi_send_ns": 7}}"#).unwrap();
        let d = CostModel::default();
        assert_eq!(m.hardware.ipi_send_ns, 7.0);
        assert_eq!(m.hardware.ipi_ack_ns, d.hardware.ipi_ack_ns);
        assert_eq!(m.software_ns("pf_slow"), d.software_ns("pf_slow"));
        assert_eq!(m.source("hardware.ipi_send_ns"), None);
    }

    fn load_err(text: &str) -> String {
        let e = CostModel::from_json_str(text).unwrap_err();
        assert!(!e.contains('\n'), "not one line: {e}");
        e
    }

    #[test]
    fn load_errors_are_one_line_and_say_what_is_allowed() {
        let e = load_err(r#"{"software": {"pf_slowww": 1}}"#);
        assert!(e.contains("unknown key `software.pf_slowww`"), "{e}");
        assert!(
            e.contains("pf_slow, ") && e.contains("lock_drops_for_alloc"),
            "{e}"
        );
        let e = load_err(r#"{"software": {"tlb_hits": 1}}"#);
        assert!(
            e.contains("tlb_hits counts a hardware event, priced by hardware.tlb_hit_ns"),
            "{e}"
        );
        let e = load_err(r#"{"software": {"flush_kicks": 1}, "hardware": {"ipi": 2}}"#);
        assert!(e.contains("unknown key `hardware.ipi`"), "{e}");
        assert!(e.contains("ipi_send_ns, ipi_ack_ns"), "{e}");
        let e = load_err(r#"{"cost": {}}"#);
        assert!(
            e.contains("unknown key `cost`; allowed keys: format"),
            "{e}"
        );
        let e = load_err(r#"{"hardware": {"tlbi_ns": -3}}"#);
        assert_eq!(
            e,
            "`hardware.tlbi_ns` is -3: costs must be finite, non-negative nanoseconds"
        );
        let e = load_err(r#"{"software": {"pf_slow": "fast"}}"#);
        assert!(e.contains("costs must be numbers of nanoseconds"), "{e}");
        let e = load_err("{\"software\": {\n\"pf_slow\": 1,,\n}}");
        assert!(e.starts_with("not valid JSON: "), "{e}");
        assert!(e.contains("line 2"), "{e}");
        let e = load_err(r#"{"format": 2}"#);
        assert!(e.contains("reads format 1"), "{e}");
        let e = load_err(r#"{"sources": {"software": {"nope": "x"}}}"#);
        assert!(e.contains("unknown key `software.nope`"), "{e}");
        let e = load_err("[1, 2]");
        assert!(e.contains("must hold a JSON object"), "{e}");
        // Non-finite values cannot be written in JSON, and the API refuses them too.
        let mut m = CostModel::default();
        let e = m.set_software_ns("pf_slow", f64::NAN).unwrap_err();
        assert!(e.contains("finite, non-negative"), "{e}");
        assert!(m.set_software_ns("guest_reads", 1.0).is_err());
        // A missing file names the file.
        let e = CostModel::load("/nonexistent/vmmu-costs.json").unwrap_err();
        assert!(
            e.starts_with("cost model /nonexistent/vmmu-costs.json: cannot read it: "),
            "{e}"
        );
        assert!(!e.contains('\n'));
    }

    #[test]
    fn nanos_counts_each_field_once_with_its_hardware_costs() {
        let mut m = CostModel::default();
        // Distinct powers of two make any double count or omission visible.
        for (k, f) in CostModel::software_fields().enumerate() {
            m.set_software_ns(f, (1u64 << k) as f64).unwrap();
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

    /// Rows of counts whose columns are independent: each row is dominated by one column
    /// (1000 units) with a sparse, deterministic spread of 1-3 units of the others.
    fn synthetic_counts(rows: usize, n: usize) -> Vec<Vec<f64>> {
        (0..rows)
            .map(|w| {
                (0..n)
                    .map(|j| match (w * 31 + j * 17) % 11 {
                        _ if w % n == j => 1000.0,
                        k @ 0..=2 => k as f64 + 1.0,
                        _ => 0.0,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_fit_recovers_known_costs_from_exact_data() {
        let truth = [3.0, 50.0, 200.0, 7.5, 0.25, 1000.0, 0.01];
        let n = truth.len();
        let counts = synthetic_counts(10, n);
        let times: Vec<f64> = counts
            .iter()
            .map(|r| r.iter().zip(&truth).map(|(c, t)| c * t).sum())
            .collect();
        // Without penalties: plain least squares, exact.
        let exact = fit_unit_costs(&counts, &times, &[10.0; 7], FitWeights::NONE).unwrap();
        for (f, t) in exact.iter().zip(&truth) {
            assert!((f - t).abs() <= 1e-6 * t, "{exact:?} vs {truth:?}");
        }
        // With calibrate's prior pull and priors 2x off: within 1 % (0.01 ns for tiny costs).
        let prior: Vec<f64> = truth.iter().map(|t| 2.0 * t).collect();
        let fitted = fit_unit_costs(&counts, &times, &prior, FitWeights::CALIBRATION).unwrap();
        for (f, t) in fitted.iter().zip(&truth) {
            assert!(
                (f - t).abs() <= 1e-2 * t.max(1.0),
                "{fitted:?} vs {truth:?}"
            );
        }
    }

    #[test]
    fn the_fit_keeps_costs_positive_and_the_prior_where_data_say_nothing() {
        // Column 1 never occurs; columns 2 and 3 always occur together.
        let counts = vec![
            vec![10.0, 0.0, 5.0, 5.0, 0.0],
            vec![20.0, 0.0, 0.0, 0.0, 10.0],
            vec![0.0, 0.0, 1.0, 1.0, 0.0],
        ];
        let times = vec![100.0, 180.0, 3.0];
        let prior = vec![1.0, 42.0, 1.0, 2.0, 1.0];
        let c = fit_unit_costs(&counts, &times, &prior, FitWeights::CALIBRATION).unwrap();
        assert!(c.iter().all(|v| *v > 0.0 && v.is_finite()), "{c:?}");
        assert!((c[1] - 42.0).abs() < 1e-9, "{c:?}");
        assert!((c[2] + c[3] - 3.0).abs() < 1e-2, "{c:?}");
        // Fields the data cannot separate share in proportion to their priors.
        assert!((c[3] / c[2] - 2.0).abs() < 0.05, "{c:?}");
        assert!(
            (c[0] - 8.5).abs() < 0.1 && (c[4] - 1.0).abs() < 0.1,
            "{c:?}"
        );
        // Data whose unconstrained solution is (2, -1): the second cost goes towards 0, never
        // below, and the first minimizes the relative residuals, (c0 - 1)^2 + (c0 / 2 - 1)^2
        // at c0 = 1.2.
        let rows = [vec![1.0, 1.0], vec![1.0, 0.0]];
        let c = fit_unit_costs(&rows, &[1.0, 2.0], &[1.0; 2], FitWeights::NONE).unwrap();
        assert!(
            (c[0] - 1.2).abs() < 1e-6 && c[1] >= 0.0 && c[1] < 1e-6,
            "{c:?}"
        );
        let e = fit_unit_costs(&counts, &[1.0, 0.0, 1.0], &prior, FitWeights::NONE).unwrap_err();
        assert!(e.contains("times must be positive"), "{e}");
    }

    #[test]
    fn calibrate_recovers_software_costs_and_keeps_hardware() {
        let mut truth = CostModel::default();
        for (k, f) in CostModel::software_fields().enumerate() {
            truth.set_software_ns(f, 1.0 + 3.0 * k as f64).unwrap();
        }
        let emulated = |i: usize| 2.0 + i as f64 / 4.0;
        // Leave one software field unexercised.
        let skip = field_index("lock_yields").unwrap();
        let counts = synthetic_counts(40, NF);
        let observations: Vec<Observation> = counts
            .iter()
            .enumerate()
            .map(|(w, r)| {
                let mut c = [0u64; NF];
                for j in 0..NF {
                    c[j] = if j == skip { 0 } else { r[j] as u64 };
                }
                let nanos = (0..NF)
                    .map(|j| {
                        let unit = if is_hardware_event(j) {
                            emulated(j)
                        } else {
                            truth.software[j]
                        };
                        c[j] as f64 * unit
                    })
                    .sum();
                Observation {
                    name: format!("w{w}"),
                    meter: meter_from_counts(c),
                    nanos,
                }
            })
            .collect();
        // Priors 2x off the truth.
        let mut base = CostModel::default();
        for f in CostModel::software_fields() {
            base.set_software_ns(f, 2.0 * truth.software_ns(f).unwrap())
                .unwrap();
        }
        let cal = calibrate(&observations, &base, "synthetic").unwrap();
        for f in &cal.costs {
            let i = field_index(f.field).unwrap();
            let want = if i == skip {
                base.software[i]
            } else if f.software {
                truth.software[i]
            } else {
                emulated(i)
            };
            assert!(
                (f.fitted_ns - want).abs() <= 0.03 * want,
                "{}: {} vs {want}",
                f.field,
                f.fitted_ns
            );
            assert_eq!(f.exercised, i != skip);
        }
        for w in &cal.workloads {
            assert!(w.residual().abs() < 1e-2, "{}: {}", w.name, w.residual());
        }
        assert_eq!(cal.model.hardware, base.hardware);
        assert_eq!(cal.model.origin, "synthetic");
        let back = CostModel::from_json_str(&cal.model.to_json_string()).unwrap();
        assert_eq!(back, cal.model);
        assert!(cal
            .model
            .source("software.pf_slow")
            .unwrap()
            .contains("fitted"));
        assert!(cal
            .model
            .source("software.lock_yields")
            .unwrap()
            .contains("not exercised"));
    }
}
