//! The hardware model: what silicon does and nothing else — entry formats, page-table memory,
//! the page walker, and the TLB.

pub mod page_table;
pub mod spte;
pub mod tlb;
pub mod walker;
