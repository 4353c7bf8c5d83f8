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
//!   "host": { "sockets": 2, "cpus_per_socket": 48 },
//!   "software": { "ept_violations": 50.0, "pf_slow": 250.0, ... },
//!   "hardware": { "vm_exit_entry_ns": 450.0, ... },
//!   "sources": { "software": { "pf_slow": "..." }, "hardware": { "vm_exit_entry_ns": "..." } }
//! }
//! ```
//!
//! - `host`: the host the costs describe ([`Host`]): its sockets and logical CPUs per socket,
//!   from which the virtual-time engine places vCPU threads, so it knows which cache-line
//!   transfers cross sockets.
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
//! | `hw_walk_levels`, `s1_walk_levels`, `s1_table_s2_levels` | — | `page_walk_level_ns` |
//! | `tlb_hits` | — | `tlb_hit_ns` |
//! | `guest_reads`, `guest_writes` | — | `guest_memory_access_ns` |
//! | `tlb_flushes` | yes (servicing the request) | `tlbi_ns` |
//! | `flush_kicks` | yes (building the kick) | `ipi_send_ns` + `ipi_ack_ns` |
//! | `dirty_log_kicks` | — | `ipi_send_ns` |
//! | `pml_logged` | — | `pml_log_ns` |
//! | `lock_line_transfers` | — | `lock_line_transfer_ns` |
//! | `lock_line_transfers_remote` | — | `lock_line_transfer_remote_ns` |
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
//!
//! [`Meter`]: crate::kvm::meter::Meter
//! [`Meter::to_map`]: crate::kvm::meter::Meter::to_map

mod file;
mod fit;
mod model;

pub use file::{CostError, FORMAT};
pub use fit::{
    calibrate, fit_unit_costs, Calibration, FitWeights, FittedCost, Observation, WorkloadFit,
    EMULATED_EVENT_PRIOR_NS,
};
pub use model::{
    CostModel, HardwareCosts, Host, PaidBy, UnsourcedCost, HARDWARE_DEFAULTS, SOFTWARE_DEFAULTS,
    UNSOURCED_HARDWARE,
};
