//! Engines: what drives actors (vCPUs, the VMM thread) over a VM. The threads engine runs each
//! actor on an OS thread with the real `mmu_lock`; the virtual-time engine runs every actor on
//! one thread in virtual-time order, charging a cost model.

pub mod threads;
pub mod virtual_time;
