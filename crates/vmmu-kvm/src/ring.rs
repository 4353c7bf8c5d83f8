//! A vCPU's dirty ring (`KVM_CAP_DIRTY_LOG_RING`), mapped from the vCPU fd.
//!
//! KVM pushes `{slot, offset}` entries with flag DIRTY as the vCPU dirties pages; user space
//! reads entries in order from its fetch index, marks each harvested one RESET, and later calls
//! `KVM_RESET_DIRTY_RINGS`, which recycles the RESET entries and write-protects their pages
//! again. Ordering (documented in KVM's api.rst): the flags must be read with acquire semantics
//! before the entry's slot/offset, and RESET must be stored with release semantics after them,
//! so KVM never sees a slot reused before user space has read it.

use crate::error::KvmError;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// Entry flag: KVM wrote this entry and it has not been harvested.
pub const KVM_DIRTY_GFN_F_DIRTY: u32 = 1;
/// Entry flag: user space harvested this entry; `KVM_RESET_DIRTY_RINGS` may recycle it.
pub const KVM_DIRTY_GFN_F_RESET: u32 = 2;
/// Bytes per ring entry (`struct kvm_dirty_gfn`: u32 flags, u32 slot, u64 offset).
pub const ENTRY_BYTES: u64 = 16;

/// One vCPU's dirty ring.
#[derive(Debug)]
pub struct DirtyRing {
    base: NonNull<u8>,
    entries: u32,
    /// Next entry to read (free-running; the slot is `fetch % entries`).
    fetch: u32,
    /// Entries harvested early (when the ring filled up in the middle of guest work) and not
    /// yet handed to the caller of [`DirtyRing::harvest`].
    pending: Vec<(u32, u64)>,
    /// `KVM_EXIT_DIRTY_RING_FULL` exits seen so far.
    pub full_exits: u64,
}

// SAFETY: the ring mapping is owned by this value and only touched through `&mut self`
// (callers share it behind a Mutex), so moving it to another thread is sound.
unsafe impl Send for DirtyRing {}

impl DirtyRing {
    /// Maps the ring of the vCPU behind `vcpu_fd`: `entries` entries at page offset
    /// `KVM_DIRTY_LOG_PAGE_OFFSET` of the vCPU fd.
    pub fn map(vcpu_fd: i32, entries: u32) -> Result<Self, KvmError> {
        let len = entries as usize * ENTRY_BYTES as usize;
        let offset = kvm_bindings::KVM_DIRTY_LOG_PAGE_OFFSET as i64 * 4096;
        // SAFETY: maps a new shared region of the vCPU fd at a kernel-chosen address; no
        // existing memory is affected and the result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu_fd,
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(KvmError::last_os("mmap of the vCPU's dirty ring"));
        }
        let base = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| KvmError::sys("mmap of the vCPU's dirty ring", 0))?;
        Ok(DirtyRing {
            base,
            entries,
            fetch: 0,
            pending: Vec::new(),
            full_exits: 0,
        })
    }

    /// Ring size in entries.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Reads every entry KVM has published since the last read, marks them RESET, and keeps
    /// them for the next [`DirtyRing::harvest`]. Called when the ring filled up; the caller
    /// then issues `KVM_RESET_DIRTY_RINGS`.
    pub fn collect(&mut self) -> u64 {
        let mut n = 0;
        loop {
            let i = (self.fetch % self.entries) as usize;
            // SAFETY: i < entries, so the 16-byte entry lies inside the mapping; the flags word
            // is 4-byte aligned (the mapping is page aligned, entries are 16 bytes) and KVM
            // accesses it atomically too.
            let flags = unsafe { &*self.base.as_ptr().add(i * 16).cast::<AtomicU32>() };
            // Acquire: pairs with KVM's release store of DIRTY after it wrote slot/offset.
            if flags.load(Ordering::Acquire) & KVM_DIRTY_GFN_F_DIRTY == 0 {
                break;
            }
            // SAFETY: same entry, fields at offsets 4 (u32) and 8 (u64), naturally aligned; KVM
            // does not write them again until the entry is RESET and recycled.
            let (slot, offset) = unsafe {
                let e = self.base.as_ptr().add(i * 16);
                (
                    std::ptr::read_volatile(e.add(4).cast::<u32>()),
                    std::ptr::read_volatile(e.add(8).cast::<u64>()),
                )
            };
            self.pending.push((slot & 0xffff, offset));
            // Release: our reads of slot/offset happen before KVM can see RESET and recycle.
            flags.store(KVM_DIRTY_GFN_F_RESET, Ordering::Release);
            self.fetch = self.fetch.wrapping_add(1);
            n += 1;
        }
        n
    }

    /// Every entry published since the previous harvest, in push order, as
    /// `(slot id, page offset in slot)`. The entries stay RESET-flagged until
    /// `KVM_RESET_DIRTY_RINGS`.
    pub fn harvest(&mut self) -> Vec<(u32, u64)> {
        self.collect();
        std::mem::take(&mut self.pending)
    }
}

impl Drop for DirtyRing {
    fn drop(&mut self) {
        // SAFETY: exactly the region mmap returned in `map`; nothing refers into it any more.
        unsafe {
            libc::munmap(
                self.base.as_ptr().cast(),
                self.entries as usize * ENTRY_BYTES as usize,
            )
        };
    }
}
