//! x86 MMU flavours.

pub mod tdp_iter;
pub mod tdp_mmu;
