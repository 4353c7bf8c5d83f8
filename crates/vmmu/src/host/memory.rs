//! Host memory behind guest memory. Each memslot gets a region; a host frame number encodes the
//! region in its high bits so that translating a PFN to memory is two array indexes.
//!
//! Each 4 KiB page holds the 8-byte word the memstress guest writes (the first 8 bytes of the
//! page), which is all the dirty-log and migration oracles need to compare content.

use crate::units::Pfn;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Parses `MemAvailable` (in bytes) out of the text of `/proc/meminfo`.
pub fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The host's `MemAvailable`, when `/proc/meminfo` can be read.
pub fn mem_available_bytes() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .as_deref()
        .and_then(parse_mem_available)
}

/// Bits of a PFN that index a page inside its region (16 TiB per region).
pub const REGION_PFN_BITS: u32 = 32;
/// How many regions the host can hold (the PFN field has 40 bits).
pub const MAX_REGIONS: usize = 256;

/// Host memory: regions of page words, allocated lazily (zeroed pages cost no RSS until written).
pub struct HostMemory {
    regions: Box<[OnceLock<Box<[AtomicU64]>>]>,
    next: std::sync::Mutex<usize>,
}

impl Default for HostMemory {
    fn default() -> Self {
        HostMemory {
            regions: (0..MAX_REGIONS).map(|_| OnceLock::new()).collect(),
            next: Default::default(),
        }
    }
}

impl HostMemory {
    /// Allocates a region of `pages` 4 KiB pages and returns the PFN of its first page, which is
    /// aligned to every page size (so huge mappings depend only on the guest side's alignment).
    pub fn alloc_region(&self, pages: u64) -> Result<Pfn, String> {
        if pages >= 1 << REGION_PFN_BITS {
            return Err(format!(
                "a memslot of {pages} pages is larger than the {} pages a region holds",
                1u64 << REGION_PFN_BITS
            ));
        }
        let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
        if *next >= MAX_REGIONS {
            return Err(format!("no more than {MAX_REGIONS} memslots can be backed"));
        }
        let idx = *next;
        // Zeroed allocation: pages cost no RSS until the guest writes them.
        let words: Box<[AtomicU64]> = {
            let zeroed = Box::<[AtomicU64]>::new_zeroed_slice(pages as usize);
            // SAFETY: an all-zero bit pattern is a valid AtomicU64 (zero).
            unsafe { zeroed.assume_init() }
        };
        if self.regions[idx].set(words).is_err() {
            return Err("host memory region allocated twice".into());
        }
        *next += 1;
        Ok(Pfn((idx as u64) << REGION_PFN_BITS))
    }

    /// The word of page `pfn`. Panics on a PFN no region holds: the MMU only installs PFNs it got
    /// from a memslot, so that would be an MMU bug.
    #[inline]
    pub fn word(&self, pfn: Pfn) -> &AtomicU64 {
        let region = self.regions[(pfn.0 >> REGION_PFN_BITS) as usize]
            .get()
            .expect("PFN in an allocated region");
        &region[(pfn.0 & ((1 << REGION_PFN_BITS) - 1)) as usize]
    }

    /// Reads the guest-visible word of `pfn`.
    pub fn read(&self, pfn: Pfn) -> u64 {
        self.word(pfn).load(Ordering::Relaxed)
    }

    /// Writes the guest-visible word of `pfn`.
    pub fn write(&self, pfn: Pfn, value: u64) {
        self.word(pfn).store(value, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_parsed_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(t), Some(2 << 20));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn regions_are_zeroed_and_addressed_by_pfn() {
        let m = HostMemory::default();
        let a = m.alloc_region(10).unwrap();
        let b = m.alloc_region(10).unwrap();
        assert_ne!(a, b);
        m.write(Pfn(b.0 + 3), 7);
        assert_eq!(m.read(Pfn(b.0 + 3)), 7);
        assert_eq!(m.read(Pfn(a.0 + 3)), 0);
    }
}
