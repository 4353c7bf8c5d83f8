//! vmmu: KVM's MMU rebuilt in user space, and a lab that runs KVM's benchmarks against it.
//!
//! Layers, bottom up (each uses only those below it): [`units`] (frames, ranges, page sizes),
//! [`hw`] (what silicon does: entry formats and the one page-table walker, the vCPU's walk, the
//! TLB), [`host`] (backing memory), [`kvm`] (architecture-neutral KVM: memslots, dirty logging,
//! `mmu_lock`, the flush API, the [`kvm::mmu::Mmu`] trait and the [`kvm::arch::KvmArch`] hooks),
//! [`x86`] (x86's KVM: SPTEs, the fault path, its hooks, and the TDP and shadow MMUs), [`arm64`]
//! (KVM/arm64's stage-2 MMU, its lock regimes, TLB maintenance and hooks), [`vm`] (a
//! KVM-like API), [`engine`] (actors over a VM, and the [`cost`] model that prices them in
//! virtual time) and [`lab`] (workloads, scenarios, reports, oracles).

#![warn(missing_docs)]

pub mod arm64;
pub mod cost;
pub mod engine;
pub mod host;
pub mod hw;
pub mod kvm;
pub mod lab;
pub mod units;
pub mod vm;
pub mod x86;
