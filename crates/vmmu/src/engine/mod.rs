//! Engines: what drives actors (vCPUs, the VMM thread) over a VM. Both call down into the VM's
//! own exit loop ([`crate::vm::exit`]) and plan interpreter ([`crate::vm::plan`]); they differ
//! in who runs when and how `mmu_lock` is granted. The threads engine runs each actor on an OS
//! thread with the real `mmu_lock`; the virtual-time engine runs every actor on one thread in
//! virtual-time order, charging a cost model.

pub mod virtual_time;
