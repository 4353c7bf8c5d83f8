//! The harness of the real-KVM tests (libtest-mimic instead of libtest): a test that needs
//! `/dev/kvm`, or a capability this host's KVM lacks, is reported by `cargo test` as *ignored*,
//! with the reason on stderr, instead of passing without having run.

// Each test binary uses a part of this module.
#![allow(dead_code)]

use libtest_mimic::{Arguments, Trial};
use std::process::ExitCode;
use vmmu_kvm::{GuestPageSize, KvmVm, VmSetup};

/// What a test needs of the host.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Needs {
    /// Nothing: it runs everywhere.
    Nothing,
    /// A usable `/dev/kvm`.
    Kvm,
    /// `/dev/kvm` with 1 GiB guest pages (CPUID's PDPE1GB).
    Kvm1GPages,
    /// `/dev/kvm` with the dirty ring (`KVM_CAP_DIRTY_LOG_RING(_ACQ_REL)`).
    KvmDirtyRing,
}

/// Why this host cannot run a test that needs `needs`, if it cannot.
fn missing(needs: Needs) -> Option<String> {
    if needs == Needs::Nothing {
        return None;
    }
    if let Err(e) = vmmu_kvm::kvm_available() {
        return Some(e.to_string());
    }
    let probe = match needs {
        Needs::Kvm1GPages => VmSetup {
            vcpus: 1,
            window: 3 << 30,
            page_size: Some(GuestPageSize::Size1G),
            ..Default::default()
        },
        Needs::KvmDirtyRing => VmSetup {
            vcpus: 1,
            dirty_ring: Some(256),
            ..Default::default()
        },
        _ => return None,
    };
    KvmVm::new(&probe).err().map(|e| e.to_string())
}

/// Runs `tests` (name, what it needs, body) as libtest does, each a trial that is ignored
/// when the host lacks what it needs.
pub fn run(tests: &[(&'static str, Needs, fn())]) -> ExitCode {
    let args = Arguments::from_args();
    let trials = tests
        .iter()
        .map(|&(name, needs, body)| {
            let why = missing(needs);
            if let Some(why) = &why {
                eprintln!("{name}: ignored on this host: {why}");
            }
            Trial::test(name, move || {
                body();
                Ok(())
            })
            .with_ignored_flag(why.is_some())
        })
        .collect();
    libtest_mimic::run(&args, trials).exit_code()
}
