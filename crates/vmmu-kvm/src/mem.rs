//! Host memory behind guest memory: mmap'ed per backing source, as KVM selftests allocate it,
//! plus the checks that turn "the host cannot give this much" into a clear error before the
//! run starts instead of an OOM kill half-way through populate.

use crate::error::KvmError;
use std::ptr::NonNull;
use vmmu::host::backing::Backing;

/// `MAP_HUGE_SHIFT` from `<linux/mman.h>`: the huge page size's log2 goes in these flag bits.
const MAP_HUGE_SHIFT: i32 = 26;
const MAP_HUGE_2MB: i32 = 21 << MAP_HUGE_SHIFT;
const MAP_HUGE_1GB: i32 = 30 << MAP_HUGE_SHIFT;

/// Where the host says how many 2 MiB huge pages it reserves.
pub const HUGETLB_2M_KNOB: &str = "/proc/sys/vm/nr_hugepages";
/// Where the host says how many 1 GiB huge pages it reserves.
pub const HUGETLB_1G_KNOB: &str = "/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages";

/// A private anonymous host mapping that backs guest memory.
///
/// The guest writes it through KVM while the host reads it, so the host accesses it only with
/// volatile 8-byte loads and stores ([`HostMemory::read_u64`], [`HostMemory::write_u64`]) and
/// never forms Rust references into it.
#[derive(Debug)]
pub struct HostMemory {
    /// Start of the whole mapping (what `munmap` gets).
    map: NonNull<u8>,
    /// Length of the whole mapping.
    map_len: usize,
    /// Offset of the usable, aligned start inside the mapping.
    offset: usize,
    /// Usable length.
    len: usize,
    backing: Backing,
}

// SAFETY: HostMemory owns its mapping; the host touches it only through volatile loads/stores
// of plain integers (no references), which is sound from any thread. Concurrent guest writes
// through KVM are the point of the mapping and cannot break host memory safety.
unsafe impl Send for HostMemory {}
// SAFETY: see `Send`: every method takes `&self` and performs only volatile integer accesses.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Maps `len` bytes (rounded up to the backing's page size) of memory of the given backing:
    /// anonymous 4K (`MADV_NOHUGEPAGE`), THP (`MADV_HUGEPAGE`, 2 MiB aligned so KVM can map
    /// huge pages: it needs guest and host addresses congruent modulo the huge page size), or
    /// hugetlb 2M/1G (`MAP_HUGETLB`).
    pub fn new(len: u64, backing: Backing) -> Result<Self, KvmError> {
        let page = backing.page_size();
        let len = usize::try_from(len.div_ceil(page) * page)
            .map_err(|_| KvmError::InvalidParams(format!("{len} bytes do not fit in memory")))?;
        if len == 0 {
            return Err(KvmError::InvalidParams(
                "a guest memory region must not be empty".into(),
            ));
        }
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // hugetlb mappings come aligned to their page size; for the others over-allocate by
        // one huge page and align by hand, as the selftests do.
        let align = match backing {
            Backing::Anonymous | Backing::AnonymousThp => 2 << 20,
            Backing::AnonymousHugetlb2mb => {
                flags |= libc::MAP_HUGETLB | MAP_HUGE_2MB;
                flags &= !libc::MAP_NORESERVE;
                0
            }
            Backing::AnonymousHugetlb1gb => {
                flags |= libc::MAP_HUGETLB | MAP_HUGE_1GB;
                flags &= !libc::MAP_NORESERVE;
                0
            }
        };
        let map_len = len + align;
        // SAFETY: an anonymous mapping at a kernel-chosen address: no existing memory is
        // affected. The result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            return Err(match (backing, errno) {
                (Backing::AnonymousHugetlb2mb, libc::ENOMEM | libc::EINVAL) => {
                    hugetlb_error(2 << 20, len as u64)
                }
                (Backing::AnonymousHugetlb1gb, libc::ENOMEM | libc::EINVAL) => {
                    hugetlb_error(1 << 30, len as u64)
                }
                _ => KvmError::sys(format!("mmap of {len} bytes of {backing} memory"), errno),
            });
        }
        let map = NonNull::new(p.cast::<u8>()).ok_or_else(|| KvmError::sys("mmap", 0))?;
        let offset = if align == 0 {
            0
        } else {
            (align - (map.as_ptr() as usize % align)) % align
        };
        let mem = HostMemory {
            map,
            map_len,
            offset,
            len,
            backing,
        };
        let advice = match backing {
            Backing::Anonymous => Some(libc::MADV_NOHUGEPAGE),
            Backing::AnonymousThp => Some(libc::MADV_HUGEPAGE),
            _ => None,
        };
        if let Some(advice) = advice {
            // SAFETY: the range is inside the mapping created above; madvise changes only the
            // huge page policy of that range.
            let r = unsafe { libc::madvise(mem.as_ptr().cast(), len, advice) };
            if r != 0 {
                return Err(KvmError::last_os(format!("madvise of {backing} memory")));
            }
        }
        Ok(mem)
    }

    /// The aligned start of the usable memory (what goes in a memslot's `userspace_addr`).
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `offset` is 0 or below `align`, and `map_len == len + align`, so the result
        // and the `len` bytes after it stay inside the mapping.
        unsafe { self.map.as_ptr().add(self.offset) }
    }

    /// Usable length in bytes.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Always false: empty mappings are refused by [`HostMemory::new`].
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The backing source.
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// Reads the 8-byte word at `offset`, or `None` when it is out of range or unaligned.
    pub fn read_u64(&self, offset: u64) -> Option<u64> {
        let off = self.check(offset)?;
        // SAFETY: `check` proved the 8 bytes lie inside the mapping and are 8-byte aligned.
        // Volatile, because the guest may have written the word through another mapping of the
        // same page (KVM's) since the host last looked.
        Some(unsafe { std::ptr::read_volatile(self.as_ptr().add(off).cast::<u64>()) })
    }

    /// Writes the 8-byte word at `offset`; false when it is out of range or unaligned.
    pub fn write_u64(&self, offset: u64, value: u64) -> bool {
        match self.check(offset) {
            Some(off) => {
                // SAFETY: `check` proved the 8 bytes lie inside the mapping and are aligned.
                unsafe { std::ptr::write_volatile(self.as_ptr().add(off).cast::<u64>(), value) };
                true
            }
            None => false,
        }
    }

    /// Copies `bytes` to `offset`, 8 bytes at a time (zero-padded); false when out of range.
    pub fn write_bytes(&self, offset: u64, bytes: &[u8]) -> bool {
        if !offset.is_multiple_of(8) || offset.saturating_add(bytes.len() as u64) > self.len as u64
        {
            return false;
        }
        for (i, chunk) in bytes.chunks(8).enumerate() {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            if !self.write_u64(offset + 8 * i as u64, u64::from_le_bytes(w)) {
                return false;
            }
        }
        true
    }

    fn check(&self, offset: u64) -> Option<usize> {
        let off = usize::try_from(offset).ok()?;
        (off % 8 == 0 && off.checked_add(8)? <= self.len).then_some(off)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: `map`/`map_len` are exactly what mmap returned; nothing refers into the
        // mapping any more (KVM memslots using it are gone with the VM fd, which the owners
        // drop first).
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

fn hugetlb_error(page_size: u64, bytes: u64) -> KvmError {
    let (dir, knob) = if page_size >= 1 << 30 {
        ("hugepages-1048576kB", HUGETLB_1G_KNOB)
    } else {
        ("hugepages-2048kB", HUGETLB_2M_KNOB)
    };
    let free =
        read_u64_file(&format!("/sys/kernel/mm/hugepages/{dir}/free_hugepages")).unwrap_or(0);
    KvmError::NoHugePages {
        page_size,
        needed: bytes.div_ceil(page_size),
        free,
        knob,
    }
}

fn read_u64_file(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Checks before anything is mapped that the host can give `bytes` of `backing` memory:
/// `MemAvailable` for anonymous and THP memory, free hugetlb pages of the right size for
/// hugetlb, and that THP is not disabled.
pub fn check_host_can_back(bytes: u64, backing: Backing) -> Result<(), KvmError> {
    match backing {
        Backing::Anonymous | Backing::AnonymousThp => {
            if backing == Backing::AnonymousThp {
                let enabled =
                    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                        .unwrap_or_default();
                if enabled.is_empty() || enabled.contains("[never]") {
                    return Err(KvmError::ThpDisabled);
                }
            }
            if let Some(available) = vmmu::host::memory::mem_available_bytes() {
                if bytes > available {
                    return Err(KvmError::InsufficientMemory {
                        needed: bytes,
                        available,
                    });
                }
            }
            Ok(())
        }
        Backing::AnonymousHugetlb2mb | Backing::AnonymousHugetlb1gb => {
            let page = backing.page_size();
            let dir = if page >= 1 << 30 {
                "hugepages-1048576kB"
            } else {
                "hugepages-2048kB"
            };
            let free = read_u64_file(&format!("/sys/kernel/mm/hugepages/{dir}/free_hugepages"))
                .unwrap_or(0);
            if free < bytes.div_ceil(page) {
                return Err(hugetlb_error(page, bytes));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_memory_is_aligned_and_bounds_checked() {
        let m = HostMemory::new(3 * 4096, Backing::Anonymous).unwrap();
        assert_eq!(m.len(), 3 * 4096);
        assert_eq!(m.as_ptr() as usize % (2 << 20), 0);
        assert!(m.write_u64(8, 42));
        assert_eq!(m.read_u64(8), Some(42));
        assert_eq!(m.read_u64(3 * 4096 - 8), Some(0));
        assert_eq!(m.read_u64(3 * 4096), None);
        assert_eq!(m.read_u64(4), None);
        assert!(!m.write_u64(u64::MAX - 3, 1));
        assert!(m.write_bytes(16, &[1, 2, 3]));
        assert_eq!(m.read_u64(16), Some(0x030201));
    }

    #[test]
    fn absurd_sizes_fail_with_a_clear_error() {
        let e = check_host_can_back(u64::MAX / 2, Backing::Anonymous).unwrap_err();
        assert!(matches!(e, KvmError::InsufficientMemory { .. }), "{e}");
        let e = check_host_can_back(1 << 50, Backing::AnonymousHugetlb1gb).unwrap_err();
        assert!(e.to_string().contains(HUGETLB_1G_KNOB), "{e}");
        let e = check_host_can_back(1 << 50, Backing::AnonymousHugetlb2mb).unwrap_err();
        assert!(e.to_string().contains(HUGETLB_2M_KNOB), "{e}");
    }
}
