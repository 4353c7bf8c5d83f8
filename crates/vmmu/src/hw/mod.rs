//! The hardware model: what silicon does and nothing else — page-table formats and the one
//! walker over them (`pgtable`), EPT entries as the CPU reads them (`ept`), page-table memory,
//! the vCPU's page walker, and the TLB.

pub mod ept;
pub mod page_table;
pub mod pgtable;
pub mod tlb;
pub mod walker;
