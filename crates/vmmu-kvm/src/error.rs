//! Errors of the real-KVM backend.
//!
//! Every error prints as one line that says what went wrong and what the user can do about it,
//! so a command-line front end can print it as is and exit non-zero.

use std::fmt;

/// Why a run against `/dev/kvm` could not be done (or could not be finished).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvmError {
    /// `/dev/kvm` does not exist: the host has no KVM at all.
    NoKvm,
    /// `/dev/kvm` exists but this user may not open it.
    PermissionDenied,
    /// `/dev/kvm` could not be opened for another reason.
    Open {
        /// The errno `open(2)` returned.
        errno: i32,
    },
    /// The host's KVM lacks a capability the run needs.
    MissingCapability {
        /// The capability's name (`KVM_CAP_...`).
        name: &'static str,
        /// What the run needs it for.
        needed_for: &'static str,
    },
    /// A parameter is out of range (from [`DirtyLogParams::validate`] or this backend's own
    /// limits).
    ///
    /// [`DirtyLogParams::validate`]: vmmu::lab::params::DirtyLogParams::validate
    InvalidParams(String),
    /// Guest memory would not fit in the host's available memory.
    InsufficientMemory {
        /// Bytes the run needs.
        needed: u64,
        /// `MemAvailable` from `/proc/meminfo`, in bytes.
        available: u64,
    },
    /// The host has too few free hugetlb pages of the size the backing source asks for.
    NoHugePages {
        /// Huge page size in bytes (2 MiB or 1 GiB).
        page_size: u64,
        /// Pages the run needs.
        needed: u64,
        /// Free pages the host has.
        free: u64,
        /// The file that sets how many such pages the host reserves.
        knob: &'static str,
    },
    /// Transparent huge pages are disabled on the host.
    ThpDisabled,
    /// An ioctl (or mmap) failed.
    Sys {
        /// What was being done, e.g. `KVM_SET_USER_MEMORY_REGION (slot 2)`.
        op: String,
        /// The errno.
        errno: i32,
    },
    /// The guest did something unexpected: a crash, an unexpected exit, an emulation failure.
    Guest {
        /// vCPU index.
        vcpu: usize,
        /// What happened.
        what: String,
    },
    /// Guest code could not be generated (a bug in this crate, not in the host).
    Assembler(String),
}

impl KvmError {
    /// The errno of a failed system call, if this error is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            KvmError::Sys { errno, .. } | KvmError::Open { errno } => Some(*errno),
            _ => None,
        }
    }

    /// Builds a [`KvmError::Sys`] from an operation name and the errno it failed with.
    pub(crate) fn sys(op: impl Into<String>, errno: i32) -> Self {
        KvmError::Sys {
            op: op.into(),
            errno,
        }
    }

    /// Builds a [`KvmError::Sys`] from the calling thread's current errno.
    pub(crate) fn last_os(op: impl Into<String>) -> Self {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        KvmError::sys(op, errno)
    }
}

/// `strerror` text for an errno, without the "(os error N)" suffix Rust adds.
fn errno_text(errno: i32) -> String {
    let s = std::io::Error::from_raw_os_error(errno).to_string();
    match s.find(" (os error") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes.div_ceil(1 << 20))
}

impl fmt::Display for KvmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvmError::NoKvm => write!(
                f,
                "/dev/kvm not found: this host has no KVM; run on a host with KVM enabled \
                 (bare metal with VT-x/AMD-V, or a VM with nested virtualization) or use the model backend"
            ),
            KvmError::PermissionDenied => write!(
                f,
                "/dev/kvm: permission denied: add your user to the kvm group \
                 (sudo usermod -aG kvm $USER, then log in again) or run as root"
            ),
            KvmError::Open { errno } => write!(
                f,
                "/dev/kvm could not be opened: {}: check that the kvm module is loaded",
                errno_text(*errno)
            ),
            KvmError::MissingCapability { name, needed_for } => write!(
                f,
                "this host's KVM lacks {name}, which {needed_for} needs: \
                 use a newer kernel or run without that option"
            ),
            KvmError::InvalidParams(msg) => f.write_str(msg),
            KvmError::InsufficientMemory { needed, available } => write!(
                f,
                "guest memory needs {} but the host has only {} available (MemAvailable in /proc/meminfo): \
                 use fewer vCPUs (-v) or less memory per vCPU (-b)",
                mib(*needed),
                mib(*available)
            ),
            KvmError::NoHugePages {
                page_size,
                needed,
                free,
                knob,
            } => {
                let size = if *page_size >= 1 << 30 { "1 GiB" } else { "2 MiB" };
                write!(
                    f,
                    "guest memory needs {needed} free {size} huge pages but the host has {free}: \
                     reserve them as root with `echo {needed} > {knob}` (more if other users need some)"
                )
            }
            KvmError::ThpDisabled => write!(
                f,
                "transparent huge pages are disabled on this host: \
                 run `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` as root, or use another -s"
            ),
            KvmError::Sys { op, errno } => {
                write!(f, "{op} failed: {}", errno_text(*errno))?;
                match *errno {
                    libc::ENOMEM => write!(f, ": the host is out of memory; use less guest memory"),
                    libc::EPERM | libc::EACCES => write!(f, ": run as root or add your user to the kvm group"),
                    libc::EMFILE | libc::ENFILE => {
                        write!(f, ": raise the open-file limit (ulimit -n) or use fewer vCPUs")
                    }
                    _ => Ok(()),
                }
            }
            KvmError::Guest { vcpu, what } => write!(
                f,
                "vCPU {vcpu}: {what} (the guest program or this host's KVM misbehaved; rerun with a smaller configuration to narrow it down)"
            ),
            KvmError::Assembler(msg) => write!(
                f,
                "could not assemble the guest program: {msg} (a bug in vmmu-kvm; please report it)"
            ),
        }
    }
}

impl std::error::Error for KvmError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_is_one_line_that_says_what_to_do() {
        let all = [
            KvmError::NoKvm,
            KvmError::PermissionDenied,
            KvmError::Open { errno: libc::ENXIO },
            KvmError::MissingCapability {
                name: "KVM_CAP_DIRTY_LOG_RING",
                needed_for: "--dirty-ring",
            },
            KvmError::InsufficientMemory {
                needed: 64 << 30,
                available: 1 << 30,
            },
            KvmError::NoHugePages {
                page_size: 1 << 30,
                needed: 4,
                free: 0,
                knob: "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages",
            },
            KvmError::ThpDisabled,
            KvmError::sys("KVM_CREATE_VM", libc::ENOMEM),
            KvmError::Guest {
                vcpu: 3,
                what: "guest shut down".into(),
            },
        ];
        for e in all {
            let s = e.to_string();
            assert!(!s.contains('\n'), "{s}");
            assert!(s.contains(':'), "{s}");
        }
        assert!(KvmError::NoKvm
            .to_string()
            .starts_with("/dev/kvm not found"));
        assert!(KvmError::PermissionDenied.to_string().contains("kvm group"));
        let m = KvmError::InsufficientMemory {
            needed: 3 << 30,
            available: 1 << 30,
        }
        .to_string();
        assert!(m.contains("3072 MiB") && m.contains("1024 MiB"), "{m}");
        assert_eq!(KvmError::sys("x", libc::EINVAL).errno(), Some(libc::EINVAL));
        assert!(KvmError::sys("KVM_CLEAR_DIRTY_LOG", libc::EINVAL)
            .to_string()
            .contains("Invalid argument"));
    }
}
