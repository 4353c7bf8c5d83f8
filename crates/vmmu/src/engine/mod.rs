//! Engines: what drives actors (vCPUs, the VMM thread) over a VM. The threads engine runs each
//! actor on an OS thread with the real `mmu_lock`.

pub mod threads;
