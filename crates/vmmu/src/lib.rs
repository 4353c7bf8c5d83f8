//! vmmu: KVM's MMU rebuilt in user space, and a lab that runs KVM's benchmarks against it.
//!
//! Layers, bottom up (each uses only those below it): [`units`], [`hw`] (what silicon does),
//! [`host`] (backing memory), [`kvm`] (memslots, dirty logging, `mmu_lock`, flushes, the
//! [`kvm::mmu::Mmu`] trait), [`x86`] (MMU flavours), [`vm`] (a KVM-like API), [`engine`]
//! (actors over a VM) and [`lab`] (workloads, scenarios, reports, oracles).

#![warn(missing_docs)]

pub mod cost;
pub mod engine;
pub mod host;
pub mod hw;
pub mod kvm;
pub mod lab;
pub mod units;
pub mod vm;
pub mod x86;
