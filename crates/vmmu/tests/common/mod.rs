//! What the integration tests share: a VM with a memslot at [`GPA`], guest writes to it, and
//! counter lookups that fail on a name nothing reports.

// Each test crate uses a part of this module.
#![allow(dead_code)]

use vmmu::host::backing::Backing;
use vmmu::units::Gfn;
use vmmu::vm::{MmuKind, Vm, VmConfig};

/// The memslot the VM tests create.
pub const SLOT: u32 = 1;
/// Guest physical address of [`SLOT`].
pub const GPA: u64 = 1 << 30;
/// Bytes in a 4K page.
pub const PAGE: u64 = 4096;

/// A two-vCPU VM with the given MMU and `eager_page_split`, and no memslot.
pub fn two_vcpu_vm(mmu: MmuKind, eager_split: bool) -> Vm {
    Vm::new(VmConfig {
        vcpus: 2,
        eager_page_split: eager_split,
        mmu,
    })
}

/// Creates [`SLOT`] at [`GPA`], or changes its flags, or deletes it (`bytes` 0).
pub fn set_slot(vm: &Vm, bytes: u64, backing: Backing, flags: u32) {
    vm.set_user_memory_region(SLOT, GPA, bytes, backing, flags)
        .unwrap();
}

/// The gfn of page `page` of [`SLOT`].
pub fn gfn(page: u64) -> Gfn {
    Gfn((GPA >> 12) + page)
}

/// Writes `base + p` to each page `p` of [`SLOT`], from vCPU 0 for even pages and vCPU 1 for
/// odd ones.
pub fn write_pages(vm: &Vm, pages: impl IntoIterator<Item = u64>, base: u64) {
    for p in pages {
        vm.vcpu_write((p % 2) as usize, GPA + p * PAGE, base + p)
            .unwrap();
    }
}

/// Asserts that the VM's page tables keep every invariant, listing the violations.
pub fn assert_invariants(vm: &Vm) {
    let e = vm.check_invariants();
    assert!(e.is_empty(), "{e:#?}");
}

/// The value of the counter `name` among `counters` (name, value pairs).
///
/// Panics naming `name` and the known counters when there is none by that name, so that a
/// renamed or misspelt counter fails the test rather than reading as 0.
pub fn lookup<'a>(counters: impl IntoIterator<Item = (&'a str, u64)>, name: &str) -> u64 {
    let counters: Vec<(&str, u64)> = counters.into_iter().collect();
    match counters.iter().find(|(n, _)| *n == name) {
        Some((_, v)) => *v,
        None => {
            let known: Vec<&str> = counters.iter().map(|(n, _)| *n).collect();
            panic!(
                "unknown counter `{name}`; known counters: {}",
                known.join(", ")
            )
        }
    }
}

/// The MMU statistic `name` of `vm` (see [`lookup`]).
pub fn mmu_stat(vm: &Vm, name: &str) -> u64 {
    lookup(vm.mmu.mmu_stats(), name)
}
