//! The parameters of the `dirty-log` scenario: dirty_log_perf_test's flags, with its defaults,
//! shared by every engine and backend so they are validated in one place.

use crate::host::backing::Backing;
use crate::lab::LabError;
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
    /// `--pml on|off`: x86 with EPT on an Intel CPU with PML, KVM's `enable_pml` (the library
    /// default is off: a CPU without PML; the CLI turns it on with EPT, as KVM does on Intel).
    #[serde(default)]
    pub pml: bool,
    /// `--host-preempt`, `--tdp-split-alloc`: the host kernel's choices.
    #[serde(default)]
    pub kernel: crate::vm::HostKernel,
    /// `--mmu tdp|shadow` and `--ept on|off`: which MMU (KVM's `tdp_mmu` and `ept`).
    pub mmu: crate::vm::MmuKind,
    /// `--guest-page-size 4k|2m`: the page size the guest maps its memory with in its own
    /// tables (shadow paging only).
    pub guest_page_level: crate::x86::spte::Level,
    /// `-m`: the selftests' `enum vm_guest_mode` (arm64: the IPA size and the guest's page
    /// size); `None` on x86, whose one mode is `VM_MODE_PXXV48_4K`.
    pub guest_mode: Option<u32>,
}

/// One of the selftests' guest modes (`vm_guest_mode_params[]`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GuestMode {
    /// The mode's number (`-m`).
    pub mode: u32,
    /// Guest physical (IPA) bits.
    pub pa_bits: u32,
    /// Guest virtual bits.
    pub va_bits: u32,
    /// The guest's page size in bytes (its stage-1 granule; stage 2 uses the host's 4 KiB).
    pub page_bytes: u64,
}

/// The guest modes a modelled arm64 VM runs (`enum vm_guest_mode` of the selftests): every
/// 4K/16K/64K mode with a 36-, 40- or 48-bit IPA. The 52-bit modes (0, 1) need LPA2, which the
/// modelled stage 2 lacks; modes 8–10 belong to other architectures.
pub const ARM64_GUEST_MODES: &[GuestMode] = &[
    GuestMode {
        mode: 2,
        pa_bits: 48,
        va_bits: 48,
        page_bytes: 4 << 10,
    },
    GuestMode {
        mode: 3,
        pa_bits: 48,
        va_bits: 48,
        page_bytes: 16 << 10,
    },
    GuestMode {
        mode: 4,
        pa_bits: 48,
        va_bits: 48,
        page_bytes: 64 << 10,
    },
    GuestMode {
        mode: 5,
        pa_bits: 40,
        va_bits: 48,
        page_bytes: 4 << 10,
    },
    GuestMode {
        mode: 6,
        pa_bits: 40,
        va_bits: 48,
        page_bytes: 16 << 10,
    },
    GuestMode {
        mode: 7,
        pa_bits: 40,
        va_bits: 48,
        page_bytes: 64 << 10,
    },
    GuestMode {
        mode: 11,
        pa_bits: 36,
        va_bits: 48,
        page_bytes: 4 << 10,
    },
    GuestMode {
        mode: 12,
        pa_bits: 36,
        va_bits: 48,
        page_bytes: 16 << 10,
    },
    GuestMode {
        mode: 13,
        pa_bits: 36,
        va_bits: 48,
        page_bytes: 64 << 10,
    },
    GuestMode {
        mode: 14,
        pa_bits: 36,
        va_bits: 47,
        page_bytes: 16 << 10,
    },
];

/// aarch64's `VM_MODE_DEFAULT` (`VM_MODE_P40V48_4K`).
pub const ARM64_DEFAULT_GUEST_MODE: u32 = 5;

/// x86's guest physical address bits in the model (a common host's MAXPHYADDR): its one mode,
/// `VM_MODE_PXXV48_4K`, takes the host's.
pub const X86_GUEST_PA_BITS: u32 = 46;

impl GuestMode {
    /// The arm64 mode numbered `mode`, or a one-line error listing the valid ones.
    pub fn arm64(mode: u32) -> Result<GuestMode, LabError> {
        ARM64_GUEST_MODES
            .iter()
            .find(|m| m.mode == mode)
            .copied()
            .ok_or_else(|| {
                let valid: Vec<String> = ARM64_GUEST_MODES.iter().map(|m| m.mode.to_string()).collect();
                LabError::Invalid(format!(
                    "-m {mode}: not an arm64 guest mode the model runs; valid modes are {} (see `vmmu dirty-log --help`)",
                    valid.join(", ")
                ))
            })
    }

    /// `vm_guest_mode_string()`: "PA-bits:40,  VA-bits:48,  4K pages".
    pub fn name(&self) -> String {
        format!(
            "PA-bits:{},  VA-bits:{},  {}K pages",
            self.pa_bits,
            self.va_bits,
            self.page_bytes >> 10
        )
    }
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
            pml: false,
            kernel: Default::default(),
            mmu: crate::vm::MmuKind::Tdp,
            guest_page_level: crate::x86::spte::PG_LEVEL_2M,
            guest_mode: None,
        }
    }
}

impl DirtyLogParams {
    /// Guest pages (4 KiB) in the test region.
    pub fn guest_pages(&self) -> u64 {
        self.vcpus as u64 * (self.vcpu_memory_bytes / PAGE_SIZE)
    }

    /// The guest mode: `-m` on arm64; x86's one mode otherwise.
    pub fn mode(&self) -> Result<GuestMode, LabError> {
        crate::lab::test_vm::guest_mode(self.guest_mode)
    }

    /// The VM memstress builds for this run.
    pub fn test_vm(&self) -> crate::lab::test_vm::TestVm {
        crate::lab::test_vm::TestVm {
            vcpus: self.vcpus,
            bytes: self.guest_pages() * PAGE_SIZE,
            slots: self.slots,
            backing: self.backing,
            mmu: self.mmu,
            guest_mode: self.guest_mode,
            eager_split: self.eager_split,
            pml: self.pml,
            kernel: self.kernel,
            manual_protect: self.manual_protect,
            guest_page_level: self.guest_page_level,
            dirty_ring: None,
        }
    }

    /// 4 KiB pages per guest page: the guest touches one 4 KiB page of each of its pages.
    pub fn guest_page_stride(&self) -> u64 {
        self.mode().map_or(1, |m| m.page_bytes / PAGE_SIZE)
    }

    /// Guest pages in each memslot.
    pub fn pages_per_slot(&self) -> u64 {
        self.guest_pages() / self.slots as u64
    }

    /// Checks the parameters as the selftest does, with one-line errors that say what is allowed.
    pub fn validate(&self) -> Result<(), LabError> {
        if self.vcpus == 0 || self.vcpus > KVM_MAX_VCPUS {
            return Err(LabError::Invalid(format!(
                "-v {}: the number of vCPUs must be between 1 and {KVM_MAX_VCPUS}",
                self.vcpus
            )));
        }
        let is_arm64 = matches!(self.mmu, crate::vm::MmuKind::Stage2 { .. });
        if self.guest_mode.is_some() != is_arm64 {
            return Err(LabError::Invalid(if is_arm64 {
                "an arm64 VM needs a guest mode (-m)".into()
            } else {
                "-m: x86 has one guest mode (PA-bits:ANY, VA-bits:48, 4K pages); -m applies to --arch arm64".into()
            }));
        }
        let mode = self.mode()?;
        if self.vcpu_memory_bytes == 0 || !self.vcpu_memory_bytes.is_multiple_of(mode.page_bytes) {
            return Err(LabError::Invalid(format!(
                "-b {}: the per-vCPU memory size must be a non-zero multiple of the guest page size, {} bytes",
                self.vcpu_memory_bytes, mode.page_bytes
            )));
        }
        if self.iterations == 0 || self.iterations > crate::lab::oracle::MAX_HARVESTS {
            return Err(LabError::Invalid(format!(
                "-i {}: the number of iterations must be between 1 and {} (one harvest each, \
                 which the completeness oracle checks)",
                self.iterations,
                crate::lab::oracle::MAX_HARVESTS
            )));
        }
        if self.write_percent > 100 {
            return Err(LabError::Invalid(format!(
                "-w {}: the write percentage must be between 0 and 100",
                self.write_percent
            )));
        }
        if self.slots == 0 {
            return Err(LabError::Invalid(
                "-x 0: the number of memslots must be at least 1".into(),
            ));
        }
        if let crate::vm::MmuKind::Stage2 { ia_bits, .. } = self.mmu {
            if ia_bits != mode.pa_bits {
                return Err(LabError::Invalid(format!(
                    "the stage 2's IPA size ({ia_bits} bits) must be the guest mode's ({} bits)",
                    mode.pa_bits
                )));
            }
        }
        let bytes = self.guest_pages() * PAGE_SIZE;
        // The region sits below the top of the address space, aligned to the backing's pages.
        let room = (1u64 << mode.pa_bits) - mode.page_bytes;
        if bytes + self.backing.page_size().max(mode.page_bytes) > room {
            return Err(LabError::Invalid(format!(
                "{} GiB of test memory (-v {} x -b {}) does not fit guest mode {} ({}-bit guest physical addresses) with {} pages; use a mode with more PA bits, fewer vCPUs or less memory",
                bytes >> 30,
                self.vcpus,
                self.vcpu_memory_bytes,
                mode.mode,
                mode.pa_bits,
                self.backing
            )));
        }
        if !self.guest_pages().is_multiple_of(self.slots as u64) {
            return Err(LabError::Invalid(format!(
                "-x {}: guest memory ({} pages) cannot be evenly divided into {} slots",
                self.slots,
                self.guest_pages(),
                self.slots
            )));
        }
        // The guest maps each memslot with its pages (the selftests' virt_map() of each slot).
        let guest_page =
            crate::lab::test_vm::guest_map_bytes(&mode, self.mmu, self.guest_page_level);
        let slot_bytes = self.guest_pages() / self.slots as u64 * PAGE_SIZE;
        if !slot_bytes.is_multiple_of(guest_page) {
            return Err(LabError::Invalid(format!(
                "-x {}: each memslot ({} KiB of -v {} x -b {}) must be a multiple of the guest's {} KiB pages; use fewer slots or more memory (or, with shadow paging, --guest-page-size 4k)",
                self.slots,
                slot_bytes >> 10,
                self.vcpus,
                self.vcpu_memory_bytes,
                guest_page >> 10
            )));
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
            // Regression (soak): 5 x 2 MiB in 4 slots of 2.5 MiB under shadow paging with
            // 2 MiB guest pages failed at run time instead.
            DirtyLogParams {
                vcpus: 5,
                vcpu_memory_bytes: 2 << 20,
                slots: 4,
                mmu: crate::vm::MmuKind::Shadow { ept: false },
                guest_page_level: crate::x86::spte::PG_LEVEL_2M,
                ..Default::default()
            },
        ];
        for p in bad {
            let e = p.validate().unwrap_err().to_string();
            assert!(e.contains("must") || e.contains("cannot"), "{e}");
        }
    }
}
