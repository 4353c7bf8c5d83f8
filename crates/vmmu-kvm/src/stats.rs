//! KVM's binary statistics (`KVM_GET_STATS_FD`), read around each phase so a report shows what
//! the host's MMU did: faults taken and fixed, pages mapped at each size, shadow pages zapped,
//! remote TLB flushes, emulated instructions, exits.
//!
//! Cumulative statistics are reported as the change over the phase; instant ones (such as
//! `pages_4k`) and peaks as their value at the end of the phase. vCPU statistics are summed
//! over vCPUs. Names are KVM's own. Reading a stats fd does not take any vCPU lock, so the main
//! thread may read while vCPUs run.

use crate::error::KvmError;
use kvm_bindings::{
    KVM_STATS_TYPE_CUMULATIVE, KVM_STATS_TYPE_INSTANT, KVM_STATS_TYPE_MASK, KVM_STATS_TYPE_PEAK,
};
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use vmmu::lab::report::PhaseCounters;

/// Request number of `KVM_GET_STATS_FD` (kvm-ioctls has no wrapper for it).
mod ioctls {
    vmm_sys_util::ioctl_io_nr!(KVM_GET_STATS_FD, kvm_bindings::KVMIO, 0xce);
}
use ioctls::KVM_GET_STATS_FD;

/// How a statistic combines over a phase.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Kind {
    Cumulative,
    Value,
}

#[derive(Clone, Debug)]
struct Desc {
    name: String,
    kind: Kind,
    /// Byte offset of the value from the start of the data block.
    offset: u64,
}

/// One stats fd (of the VM or of a vCPU) and the scalar statistics it offers.
#[derive(Debug)]
pub struct StatsFd {
    file: File,
    data_offset: u64,
    /// Bytes of the data block that hold the statistics kept (read in one `pread`).
    data_len: usize,
    descs: Vec<Desc>,
}

fn read_u32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .unwrap_or(0)
}

fn read_u16(b: &[u8], at: usize) -> u16 {
    b.get(at..at + 2)
        .and_then(|s| s.try_into().ok())
        .map(u16::from_le_bytes)
        .unwrap_or(0)
}

impl StatsFd {
    /// Opens the stats fd of a VM or vCPU fd and reads its descriptors. Must be called before
    /// the vCPU runs on another thread (the ioctl takes the vCPU's mutex).
    pub fn open(fd: &impl AsRawFd) -> Result<Self, KvmError> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd or -1; `fd` is a
        // live VM or vCPU fd.
        let raw = unsafe { vmm_sys_util::ioctl::ioctl(fd, KVM_GET_STATS_FD()) };
        if raw < 0 {
            return Err(KvmError::last_os("KVM_GET_STATS_FD"));
        }
        // SAFETY: `raw` is a fresh fd that nothing else owns; the File takes ownership.
        let file = unsafe { File::from_raw_fd(raw) };
        let mut hdr = [0u8; 24];
        file.read_exact_at(&mut hdr, 0).map_err(|e| {
            KvmError::sys(
                "reading the KVM stats header",
                e.raw_os_error().unwrap_or(0),
            )
        })?;
        let name_size = read_u32(&hdr, 4) as usize;
        let num_desc = read_u32(&hdr, 8) as usize;
        let desc_offset = read_u32(&hdr, 16) as u64;
        let data_offset = read_u32(&hdr, 20) as u64;
        let desc_len = 16 + name_size;
        let mut raw_descs = vec![0u8; desc_len * num_desc];
        file.read_exact_at(&mut raw_descs, desc_offset)
            .map_err(|e| {
                KvmError::sys(
                    "reading the KVM stats descriptors",
                    e.raw_os_error().unwrap_or(0),
                )
            })?;
        let mut descs = Vec::new();
        for d in raw_descs.chunks_exact(desc_len) {
            let flags = read_u32(d, 0);
            let size = read_u16(d, 6);
            let offset = read_u32(d, 8) as u64;
            let kind = match flags & KVM_STATS_TYPE_MASK {
                KVM_STATS_TYPE_CUMULATIVE => Kind::Cumulative,
                KVM_STATS_TYPE_INSTANT | KVM_STATS_TYPE_PEAK => Kind::Value,
                _ => continue, // histograms
            };
            if size != 1 {
                continue;
            }
            let name = &d[16..];
            let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
            descs.push(Desc {
                name: String::from_utf8_lossy(&name[..end]).into_owned(),
                kind,
                offset,
            });
        }
        let data_len = descs
            .iter()
            .map(|d| d.offset as usize + 8)
            .max()
            .unwrap_or(0);
        Ok(StatsFd {
            file,
            data_offset,
            data_len,
            descs,
        })
    }

    fn read(&self, into: &mut BTreeMap<String, (Kind, u64)>) {
        let mut data = vec![0u8; self.data_len];
        if self
            .file
            .read_exact_at(&mut data, self.data_offset)
            .is_err()
        {
            return;
        }
        for d in &self.descs {
            let at = d.offset as usize;
            if let Some(v) = data.get(at..at + 8).and_then(|s| s.try_into().ok()) {
                let e = into.entry(d.name.clone()).or_insert((d.kind, 0));
                e.1 = e.1.wrapping_add(u64::from_le_bytes(v));
            }
        }
    }
}

/// A snapshot of every statistic, summed over the fds it was read from.
#[derive(Clone, Debug, Default)]
pub struct Snapshot(BTreeMap<String, (Kind, u64)>);

/// The stats fds of a VM and its vCPUs. Statistics are optional: a kernel without
/// `KVM_GET_STATS_FD` gives an empty set and the report shows no counters.
#[derive(Debug, Default)]
pub struct Stats {
    fds: Vec<StatsFd>,
}

impl Stats {
    /// Stats of the VM fd and the given vCPU fds; fds that fail to open are skipped.
    pub fn open<'a>(
        vm: &impl AsRawFd,
        vcpus: impl IntoIterator<Item = &'a kvm_ioctls::VcpuFd>,
    ) -> Self {
        let mut fds: Vec<StatsFd> = StatsFd::open(vm).into_iter().collect();
        fds.extend(vcpus.into_iter().filter_map(|v| StatsFd::open(v).ok()));
        Stats { fds }
    }

    /// True when no statistics are available.
    pub fn is_empty(&self) -> bool {
        self.fds.is_empty()
    }

    /// Reads every statistic now.
    pub fn snapshot(&self) -> Snapshot {
        let mut m = BTreeMap::new();
        for f in &self.fds {
            f.read(&mut m);
        }
        Snapshot(m)
    }

    /// The counters of a phase that began at `before` and ended at `after`, or `None` when no
    /// statistics are available.
    pub fn phase(&self, before: &Snapshot, after: &Snapshot) -> Option<PhaseCounters> {
        if self.is_empty() {
            return None;
        }
        Some(
            after
                .0
                .iter()
                .map(|(name, &(kind, v))| {
                    let v = match kind {
                        Kind::Cumulative => v.saturating_sub(before.0.get(name).map_or(0, |b| b.1)),
                        Kind::Value => v,
                    };
                    (name.clone(), v)
                })
                .collect(),
        )
    }
}
