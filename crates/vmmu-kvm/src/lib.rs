//! vmmu-kvm: the lab's scenarios run against the host's real `/dev/kvm`, so the model's numbers
//! and dirty-logging behaviour can be set beside the kernel's.
//!
//! - [`run_dirty_log`] runs dirty_log_perf_test's scenario (the lab's own scenario code, with
//!   real KVM as its backend: same flags, same phases, same report) with a generated memstress
//!   guest and checks the dirty-log completeness oracle after every harvest.
//! - [`KvmVm`] is the VM underneath: vCPUs in 64-bit mode over an identity-mapped guest,
//!   memslots, `KVM_GET_DIRTY_LOG`/`KVM_CLEAR_DIRTY_LOG`, dirty rings, and a tiny guest that
//!   writes a host-given list of addresses ([`KvmVm::run_writes`]), used to compare real KVM
//!   with the model call for call.
//!
//! The guest code is generated with an assembler ([`guest`]) and uses general-purpose
//! registers only, so it also runs on hosts whose KVM executes guests through its instruction
//! emulator. Every error is one line that says what to do ([`KvmError`]).

#![warn(missing_docs)]

pub mod dirty_log;
pub mod error;
pub mod guest;
pub mod mem;
pub mod oracle;
pub mod paging;
pub mod ring;
pub mod stats;
pub mod vm;

pub use dirty_log::{run_dirty_log, run_dirty_log_streamed, KvmOptions};
pub use error::KvmError;
pub use guest::GuestProgram;
pub use paging::GuestPageSize;
pub use vm::{KvmVm, VmSetup, KVM_MEM_LOG_DIRTY_PAGES, TEST_MEM_GPA};

/// Whether `/dev/kvm` can be opened by this process; `Err` says why not (for tests and tools
/// that skip real-KVM work on hosts without it).
pub fn kvm_available() -> Result<(), KvmError> {
    vm::open_kvm().map(|_| ())
}
