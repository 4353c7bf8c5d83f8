//! The hardware model: what silicon does and nothing else — page-table formats and the one
//! walker over them (`pgtable`), EPT entries as the CPU reads them (`ept`), arm64 stage-2
//! descriptors (`stage2`) and TLB maintenance operands (`tlbi`), page-table memory, the
//! vCPU's page walker and its two-dimensional walk of the guest's own tables
//! (`guest_tables`), Intel's page-modification log (`pml`), the TLB (`tlb`, stored in
//! `tlb_array`, whose sweeps' entries go unstamped in `swept_windows` and whose runs of
//! ascending loads wait in `load_window`), and the data caches
//! (`cache`).

pub mod cache;
pub mod ept;
pub mod guest_tables;
pub(crate) mod load_window;
pub mod page_table;
pub mod pgtable;
pub mod pml;
pub mod stage2;
pub(crate) mod swept_windows;
pub mod tlb;
pub mod tlb_array;
pub mod tlbi;
pub mod walker;
