//! The parameters of the `dirty-log` scenario: dirty_log_perf_test's flags, with its defaults,
//! shared by every engine and backend so they are validated in one place.

use crate::host::backing::Backing;
use crate::units::PAGE_SIZE;
use serde::{Deserialize, Serialize};

/// KVM's `KVM_MAX_VCPUS` on x86 (the selftest rejects more).
pub const KVM_MAX_VCPUS: usize = 4096;

/// One `dirty-log` run, as dirty_log_perf_test's command line describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyLogParams {
    /// `-v`: number of vCPUs (default 1).
    pub vcpus: usize,
    /// `-b`: bytes of memory each vCPU dirties (default 1G).
    pub vcpu_memory_bytes: u64,
    /// `-i`: dirty-memory iterations after populate (default 2).
    pub iterations: u32,
    /// `-s`: backing source of guest memory (default anonymous).
    pub backing: Backing,
    /// `-w`: percentage of accesses that write (default 100).
    pub write_percent: u32,
    /// Not `-g`: enable `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with
    /// `KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE | KVM_DIRTY_LOG_INITIALLY_SET`.
    pub manual_protect: bool,
    /// `-x`: number of memslots the test region is split into (default 1).
    pub slots: usize,
    /// `-a`: access pages in random order instead of sequentially.
    pub random_access: bool,
    /// Not `-o`: each vCPU touches its own region (default) instead of all of them.
    pub partition: bool,
    /// `-r`: random seed (default 1).
    pub random_seed: u32,
    /// `-e`: keep vCPUs running while dirty logging is disabled.
    pub run_vcpus_while_disabling: bool,
    /// `--eager-split on|off`: KVM's `eager_page_split` module parameter (default on).
    pub eager_split: bool,
    /// `--mmu tdp|shadow` and `--ept on|off`: which MMU (KVM's `tdp_mmu` and `ept`).
    pub mmu: crate::vm::MmuKind,
    /// `--guest-page-size 4k|2m`: the page size the guest maps its memory with in its own
    /// tables (shadow paging only).
    pub guest_page_level: crate::x86::spte::Level,
}

impl Default for DirtyLogParams {
    fn default() -> Self {
        DirtyLogParams {
            vcpus: 1,
            vcpu_memory_bytes: 1 << 30,
            iterations: 2,
            backing: Backing::Anonymous,
            write_percent: 100,
            manual_protect: true,
            slots: 1,
            random_access: false,
            partition: true,
            random_seed: 1,
            run_vcpus_while_disabling: false,
            eager_split: true,
            mmu: crate::vm::MmuKind::Tdp,
            guest_page_level: crate::x86::spte::PG_LEVEL_2M,
        }
    }
}

impl DirtyLogParams {
    /// Guest pages (4 KiB) in the test region.
    pub fn guest_pages(&self) -> u64 {
        self.vcpus as u64 * (self.vcpu_memory_bytes / PAGE_SIZE)
    }

    /// Guest pages in each memslot.
    pub fn pages_per_slot(&self) -> u64 {
        self.guest_pages() / self.slots as u64
    }

    /// Checks the parameters as the selftest does, with one-line errors that say what is allowed.
    pub fn validate(&self) -> Result<(), String> {
        if self.vcpus == 0 || self.vcpus > KVM_MAX_VCPUS {
            return Err(format!(
                "-v {}: the number of vCPUs must be between 1 and {KVM_MAX_VCPUS}",
                self.vcpus
            ));
        }
        if self.vcpu_memory_bytes == 0 || !self.vcpu_memory_bytes.is_multiple_of(PAGE_SIZE) {
            return Err(format!(
                "-b {}: the per-vCPU memory size must be a non-zero multiple of {PAGE_SIZE} bytes",
                self.vcpu_memory_bytes
            ));
        }
        if self.iterations == 0 {
            return Err("-i 0: the number of iterations must be at least 1".into());
        }
        if self.write_percent > 100 {
            return Err(format!(
                "-w {}: the write percentage must be between 0 and 100",
                self.write_percent
            ));
        }
        if self.slots == 0 {
            return Err("-x 0: the number of memslots must be at least 1".into());
        }
        if !self.guest_pages().is_multiple_of(self.slots as u64) {
            return Err(format!(
                "-x {}: guest memory ({} pages) cannot be evenly divided into {} slots",
                self.slots,
                self.guest_pages(),
                self.slots
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_selftests() {
        let p = DirtyLogParams::default();
        assert_eq!(
            (p.vcpus, p.iterations, p.write_percent, p.slots),
            (1, 2, 100, 1)
        );
        assert!(p.manual_protect && p.partition && !p.random_access);
        assert!(p.validate().is_ok());
    }

    #[test]
    fn bad_values_are_rejected_with_what_is_allowed() {
        let bad = [
            DirtyLogParams {
                vcpus: 0,
                ..Default::default()
            },
            DirtyLogParams {
                vcpu_memory_bytes: 100,
                ..Default::default()
            },
            DirtyLogParams {
                iterations: 0,
                ..Default::default()
            },
            DirtyLogParams {
                write_percent: 101,
                ..Default::default()
            },
            DirtyLogParams {
                slots: 0,
                ..Default::default()
            },
            DirtyLogParams {
                slots: 3,
                vcpu_memory_bytes: 4 << 12,
                ..Default::default()
            },
        ];
        for p in bad {
            let e = p.validate().unwrap_err();
            assert!(e.contains("must") || e.contains("cannot"), "{e}");
        }
    }
}
