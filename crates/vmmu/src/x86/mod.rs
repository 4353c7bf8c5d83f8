//! x86 MMU flavours: the TDP MMU, and the shadow MMU (direct with EPT and `tdp_mmu=N`,
//! indirect for shadow paging), over KVM's EPT-format SPTEs (`spte`).

pub mod arch;
pub mod fast_page_fault;
pub mod guest_paging;
pub mod mmu;
pub mod shadow;
pub mod spte;
pub mod tdp_iter;
pub mod tdp_mmu;
