//! Memslots: a guest-physical range backed by host memory, with flags and a dirty bitmap, and
//! KVM's rules on which mapping levels a gfn may use and which CLEAR_DIRTY_LOG ranges are valid.

use crate::host::backing::Backing;
use crate::kvm::host_caches::{HostCaches, MetaLine, MetaRegion};
use crate::kvm::meter::Meter;
use crate::units::{Gfn, PageSize, Pfn};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// `KVM_MEM_LOG_DIRTY_PAGES`.
pub const KVM_MEM_LOG_DIRTY_PAGES: u32 = 1 << 0;
/// `KVM_MEM_READONLY`.
pub const KVM_MEM_READONLY: u32 = 1 << 1;

/// What a flags change does to dirty logging: `(enable, disable)`, `KVM_MEM_LOG_DIRTY_PAGES`
/// turning on or off.
pub fn dirty_logging_change(old_flags: u32, new_flags: u32) -> (bool, bool) {
    let (was, is) = (
        old_flags & KVM_MEM_LOG_DIRTY_PAGES != 0,
        new_flags & KVM_MEM_LOG_DIRTY_PAGES != 0,
    );
    (!was && is, was && !is)
}

/// One memslot (`struct kvm_memory_slot`).
pub struct Memslot {
    /// Slot id as userspace numbered it.
    pub id: u32,
    /// First gfn.
    pub base_gfn: Gfn,
    /// Number of 4 KiB pages.
    pub npages: u64,
    /// The backing source, which bounds the mapping level.
    pub backing: Backing,
    /// Host frame of the slot's first page (the slot's `userspace_addr`).
    pub host_pfn: Pfn,
    flags: AtomicU32,
    /// The dirty bitmap, one bit per page. Allocated with the slot rather than when logging is
    /// first enabled (a simplification of `kvm_alloc_dirty_bitmap()` that changes no result).
    dirty_bitmap: Box<[AtomicU64]>,
    /// Where the dirty bitmap and its twin (the buffer GET and CLEAR work in) live in host
    /// memory, when the host's caches are modelled: `kvm_alloc_dirty_bitmap()` allocates both
    /// with one `__vcalloc(2, kvm_dirty_bitmap_bytes())`, the bitmap first.
    bitmap_meta: Mutex<MetaRegion>,
}

impl Memslot {
    /// A slot of `npages` pages at `base_gfn`, backed from `host_pfn`.
    pub fn new(
        id: u32,
        base_gfn: Gfn,
        npages: u64,
        backing: Backing,
        host_pfn: Pfn,
        flags: u32,
    ) -> Self {
        let words = npages.div_ceil(64) as usize;
        Memslot {
            id,
            base_gfn,
            npages,
            backing,
            host_pfn,
            flags: AtomicU32::new(flags),
            dirty_bitmap: (0..words).map(|_| AtomicU64::new(0)).collect(),
            bitmap_meta: Mutex::new(MetaRegion::default()),
        }
    }

    /// One past the last gfn.
    pub fn end_gfn(&self) -> Gfn {
        self.base_gfn + self.npages
    }

    /// True when `gfn` is in this slot.
    pub fn contains(&self, gfn: Gfn) -> bool {
        gfn >= self.base_gfn && gfn < self.end_gfn()
    }

    /// The current flags.
    pub fn flags(&self) -> u32 {
        self.flags.load(Ordering::Acquire)
    }

    /// Replaces the flags. KVM installs a new memslot through SRCU instead; callers follow this
    /// with `synchronize_srcu()` so no fault still acts on the old flags (as
    /// `kvm_swap_active_memslots()` does).
    pub fn set_flags(&self, flags: u32) {
        self.flags.store(flags, Ordering::Release)
    }

    /// `kvm_slot_dirty_track_enabled()`.
    pub fn dirty_track_enabled(&self) -> bool {
        self.flags() & KVM_MEM_LOG_DIRTY_PAGES != 0
    }

    /// `__gfn_to_pfn_memslot()`: the host frame behind `gfn`.
    pub fn gfn_to_pfn(&self, gfn: Gfn) -> Pfn {
        debug_assert!(self.contains(gfn));
        self.host_pfn + (gfn.0 - self.base_gfn.0)
    }

    /// The largest page that may map `gfn` without dirty logging: its whole page lies in the
    /// slot, is aligned the same way in guest and host, and the backing allows it (x86's
    /// `kvm_mmu_max_mapping_level()` with `lpage_info.disallow_lpage` for misaligned slots and
    /// slot edges; arm64's `fault_supports_stage2_huge_mapping()`).
    pub fn max_mapping_size(&self, gfn: Gfn) -> PageSize {
        let max = self.backing.max_page_size();
        *PageSize::ALL
            .iter()
            .rev()
            .filter(|&&size| size <= max)
            .find(|&&size| {
                let start = size.round(gfn);
                let aligned = (self.base_gfn.0 ^ self.host_pfn.0) & (size.pages() - 1) == 0;
                aligned && start >= self.base_gfn && start.0 + size.pages() <= self.end_gfn().0
            })
            .unwrap_or(&PageSize::Size4K)
    }

    /// The invariant both architectures check for a writable leaf mapping `pages` pages from
    /// `start` in this slot: while the slot logs dirty pages, writes through the leaf are not
    /// tracked, which is only allowed while each of its pages is still reported dirty. Returns
    /// the violation, naming the first clean page.
    pub fn check_writable_leaf_is_dirty(
        &self,
        start: Gfn,
        pages: u64,
    ) -> Result<(), crate::kvm::KvmError> {
        if !self.dirty_track_enabled() {
            return Ok(());
        }
        for g in start.0..start.0 + pages {
            let rel = g - self.base_gfn.0;
            let word = self.dirty_bitmap[(rel / 64) as usize].load(Ordering::Relaxed);
            if word & (1 << (rel % 64)) == 0 {
                return Err(crate::kvm::KvmError::WritableLeafNotDirty(g));
            }
        }
        Ok(())
    }

    /// Sets `gfn`'s bit in the dirty bitmap (the bitmap half of `mark_page_dirty_in_slot()`;
    /// the caller has decided logging applies). Returns true when the bit was newly set. The
    /// one-by-one reference [`DirtyBits`] is tested against: KVM sets a bit at a time, the
    /// model a word at a time.
    #[cfg(test)]
    pub fn set_dirty_bit(&self, gfn: Gfn) -> bool {
        let rel = gfn.0 - self.base_gfn.0;
        let bit = 1u64 << (rel % 64);
        self.dirty_bitmap[(rel / 64) as usize].fetch_or(bit, Ordering::SeqCst) & bit == 0
    }

    /// Sets the bits `bits` of word `word` of the dirty bitmap at once: what `set_bit_le()`
    /// of each does in `mark_page_dirty_in_slot()`, for bits of one word ([`DirtyBits`]).
    fn set_dirty_bits(&self, word: usize, bits: u64) {
        self.dirty_bitmap[word].fetch_or(bits, Ordering::SeqCst);
    }

    /// Sets the bits of the `count` gfns from `top` down at once, a word at a time from the
    /// highest: the bitmap [`DirtyBits::set`] of each, in that order, leaves.
    pub fn set_dirty_bits_down(&self, top: Gfn, count: u64) {
        let (lo, hi) = self.pages_down(top, count);
        for word in (lo / 64..=hi / 64).rev() {
            let from = lo.max(word * 64) % 64;
            let to = hi.min(word * 64 + 63) % 64;
            // Bits `from..=to` of the word.
            let bits = (u64::MAX >> (63 - to)) & (u64::MAX << from);
            self.set_dirty_bits(word as usize, bits);
        }
    }

    /// Words in the dirty bitmap.
    pub fn bitmap_words(&self) -> usize {
        self.dirty_bitmap.len()
    }

    /// One word of the dirty bitmap.
    pub fn bitmap_word(&self, i: usize) -> &AtomicU64 {
        &self.dirty_bitmap[i]
    }

    /// Sets every bit of the bitmap (`KVM_DIRTY_LOG_INITIALLY_SET` when logging is enabled).
    pub fn set_all_dirty(&self) {
        for (i, w) in self.dirty_bitmap.iter().enumerate() {
            let left = self.npages - i as u64 * 64;
            w.store(
                if left >= 64 {
                    u64::MAX
                } else {
                    (1u64 << left) - 1
                },
                Ordering::SeqCst,
            );
        }
    }

    /// Clears the whole bitmap.
    pub fn clear_all_dirty(&self) {
        for w in self.dirty_bitmap.iter() {
            w.store(0, Ordering::SeqCst);
        }
    }

    /// `kvm_dirty_bitmap_bytes()`: the bitmap's size in bytes (whole 64-bit words).
    pub fn dirty_bitmap_bytes(&self) -> u64 {
        self.dirty_bitmap.len() as u64 * 8
    }

    /// `kvm_alloc_dirty_bitmap()` as the host's caches see it: the running core (the VMM's,
    /// in `KVM_SET_USER_MEMORY_REGION`) allocates the bitmap and its buffer from its socket's
    /// memory and zeroes both (`__vcalloc()`), every line written through its caches, priced
    /// on `meter` as a sequential scan; with `KVM_DIRTY_LOG_INITIALLY_SET` (`init_set`)
    /// `bitmap_set()` then writes the bitmap's lines again.
    pub fn alloc_dirty_bitmap(&self, caches: &HostCaches, init_set: bool, meter: &mut Meter) {
        let bytes = self.dirty_bitmap_bytes();
        let region = caches.alloc(caches.running_cpu(), 2 * bytes);
        *self.bitmap_meta.lock() = region;
        caches.scan(region, 0..2 * bytes, meter);
        if init_set {
            caches.scan(region, 0..bytes, meter);
        }
    }

    /// `kvm_destroy_dirty_bitmap()`: logging is off, the bitmap's memory is freed (a later
    /// enable allocates afresh).
    pub fn free_dirty_bitmap(&self) {
        *self.bitmap_meta.lock() = MetaRegion::default();
    }

    /// Where the bitmap lives: placed by the running core when first used if it was allocated
    /// before the caches were modelled (a slot created with logging on), in no cache yet.
    pub fn dirty_bitmap_region(&self, caches: &HostCaches) -> MetaRegion {
        let mut meta = self.bitmap_meta.lock();
        if meta.is_unplaced() {
            *meta = caches.alloc(caches.running_cpu(), 2 * self.dirty_bitmap_bytes());
        }
        *meta
    }

    /// The running core sets `gfn`'s bit (`set_bit_le()` in `mark_page_dirty_in_slot()`): a
    /// locked read-modify-write of the bitmap line holding it, priced on `meter`.
    pub fn touch_dirty_bit(&self, caches: &HostCaches, gfn: Gfn, meter: &mut Meter) {
        caches.read_lines(self.dirty_bit_lines(caches, std::iter::once(gfn)), meter);
    }

    /// The bitmap lines holding the bits of `gfns`, in order (the bitmap placed first if it
    /// is not yet).
    pub fn dirty_bit_lines<'a>(
        &'a self,
        caches: &HostCaches,
        gfns: impl Iterator<Item = Gfn> + 'a,
    ) -> impl Iterator<Item = MetaLine> + 'a {
        let region = self.dirty_bitmap_region(caches);
        gfns.map(move |gfn| region.line_of((gfn.0 - self.base_gfn.0) / 8))
    }

    /// [`Memslot::dirty_bit_lines`] of the `count` gfns from `top` down, each line once
    /// (highest first), as [`HostCaches::read_lines`] reads them.
    pub fn dirty_bit_lines_down(
        &self,
        caches: &HostCaches,
        top: Gfn,
        count: u64,
    ) -> impl Iterator<Item = MetaLine> {
        let (lo, hi) = self.pages_down(top, count);
        self.dirty_bitmap_region(caches).lines_down(hi / 8, lo / 8)
    }

    /// The lowest and highest of the `count` gfns from `top` down, as pages of the slot.
    fn pages_down(&self, top: Gfn, count: u64) -> (u64, u64) {
        debug_assert!(count >= 1 && count <= top.0 + 1 - self.base_gfn.0);
        let hi = top.0 - self.base_gfn.0;
        (hi + 1 - count, hi)
    }
}

/// Bits of a slot's dirty bitmap set a word at a time: a gfn's bit joins those of the word
/// before it when it falls in the same one (a PML flush's entries run down one page after
/// another), and each word's bits are set by one atomic OR when the next word comes or the
/// batch is dropped. The bitmap ends as `mark_page_dirty_in_slot()`'s `set_bit_le()` of each
/// gfn leaves it; another thread reading it meanwhile sees the bits a word later, as if the
/// flush had not reached them yet.
pub struct DirtyBits<'s> {
    slot: &'s Memslot,
    /// The word gathered, and its bits (none yet: `usize::MAX`).
    word: usize,
    bits: u64,
}

impl<'s> DirtyBits<'s> {
    /// A batch for `slot`'s bitmap.
    pub fn new(slot: &'s Memslot) -> Self {
        DirtyBits {
            slot,
            word: usize::MAX,
            bits: 0,
        }
    }

    /// Sets `gfn`'s bit (at the latest when the batch moves to another word or is dropped).
    #[inline]
    pub fn set(&mut self, gfn: Gfn) {
        let rel = gfn.0 - self.slot.base_gfn.0;
        let word = (rel / 64) as usize;
        if word != self.word {
            self.flush();
            self.word = word;
        }
        self.bits |= 1u64 << (rel % 64);
    }

    fn flush(&mut self) {
        if self.bits != 0 {
            self.slot.set_dirty_bits(self.word, self.bits);
            self.bits = 0;
        }
    }
}

impl Drop for DirtyBits<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A `KVM_CLEAR_DIRTY_LOG` range `kvm_clear_dirty_log_protect()` refuses (`-EINVAL`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClearRangeError {
    /// `first_page` is not 64-aligned.
    #[error("first_page {first_page} is not a multiple of 64")]
    FirstPageUnaligned {
        /// The range's first page in the slot.
        first_page: u64,
    },
    /// The range leaves the slot.
    #[error("pages [{first_page}, {end}) are outside slot {slot} of {npages} pages")]
    OutsideSlot {
        /// The range's first page.
        first_page: u64,
        /// Its end (saturating).
        end: u64,
        /// The slot's id.
        slot: u32,
        /// The slot's pages.
        npages: u64,
    },
    /// `num_pages` is not a multiple of 64 and the range stops short of the slot's end.
    #[error(
        "num_pages {num_pages} is not a multiple of 64 and does not reach the end of slot {slot}"
    )]
    NumPagesUnaligned {
        /// The range's length.
        num_pages: u64,
        /// The slot's id.
        slot: u32,
    },
    /// The caller's bitmap is shorter than the range.
    #[error("the bitmap holds {bits} pages, fewer than num_pages {num_pages}")]
    BitmapTooShort {
        /// Pages the bitmap holds.
        bits: u64,
        /// The range's length.
        num_pages: u64,
    },
}

/// The checks of `kvm_clear_dirty_log_protect()`: `first_page` 64-aligned, the range inside the
/// slot, and `num_pages` a multiple of 64 unless the range ends at the slot's end.
pub fn check_clear_dirty_log_range(
    slot: &Memslot,
    first_page: u64,
    num_pages: u64,
) -> Result<(), ClearRangeError> {
    if !first_page.is_multiple_of(64) {
        return Err(ClearRangeError::FirstPageUnaligned { first_page });
    }
    if first_page >= slot.npages || num_pages > slot.npages - first_page {
        return Err(ClearRangeError::OutsideSlot {
            first_page,
            end: first_page.saturating_add(num_pages),
            slot: slot.id,
            npages: slot.npages,
        });
    }
    if num_pages < slot.npages - first_page && !num_pages.is_multiple_of(64) {
        return Err(ClearRangeError::NumPagesUnaligned {
            num_pages,
            slot: slot.id,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(base: u64, npages: u64, backing: Backing) -> Memslot {
        Memslot::new(0, Gfn(base), npages, backing, Pfn(0), 0)
    }

    #[test]
    fn mapping_level_is_bounded_by_backing_alignment_and_slot_edges() {
        let s = slot(0x40000, 0x40000, Backing::AnonymousHugetlb1gb);
        assert_eq!(s.max_mapping_size(Gfn(0x40000)), PageSize::Size1G);
        let thp = slot(0x40000, 0x40000, Backing::AnonymousThp);
        assert_eq!(thp.max_mapping_size(Gfn(0x40123)), PageSize::Size2M);
        // A slot that ends mid-way through a 1G page: the last part maps at 2M.
        let short = slot(0x40000, 0x40000 - 0x200, Backing::AnonymousHugetlb1gb);
        assert_eq!(short.max_mapping_size(Gfn(0x40000)), PageSize::Size2M);
        // Guest and host misaligned: no huge page anywhere.
        let mis = slot(0x40001, 0x1000, Backing::AnonymousHugetlb2mb);
        assert_eq!(mis.max_mapping_size(Gfn(0x40400)), PageSize::Size4K);
        assert_eq!(
            slot(0, 1024, Backing::Anonymous).max_mapping_size(Gfn(0)),
            PageSize::Size4K
        );
    }

    #[test]
    fn the_dirty_bitmap_lives_where_logging_was_enabled_and_is_priced_line_by_line() {
        use crate::hw::cache::CASCADE_LAKE_8275CL;
        // 1 GiB: a 32 KiB bitmap and its 32 KiB buffer.
        let s = slot(0, 1 << 18, Backing::Anonymous);
        let caches = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        caches.run_on(caches.vmm_cpu());
        let mut m = Meter::default();
        s.alloc_dirty_bitmap(&caches, true, &mut m);
        // Zeroed from memory as one scan; set again from the VMM's L2 (free).
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (2, 1024 - 2));
        let region = s.dirty_bitmap_region(&caches);
        assert_eq!(region.home(), 0, "the VMM's socket");
        // A vCPU of the other socket marks pages: one line for 512 consecutive pages, read
        // from socket 0's memory (the VMM's L2 holds it, not socket 1's caches).
        caches.run_on(caches.vcpu_cpu(1));
        let mut m = Meter::default();
        for g in 0..1024 {
            s.touch_dirty_bit(&caches, Gfn(g), &mut m);
        }
        assert_eq!(m.remote_memory_lines + m.remote_memory_lines_streamed, 2);
        // Disabling logging frees it; a later use places it anew, in no cache.
        s.free_dirty_bitmap();
        caches.run_on(caches.vcpu_cpu(0));
        let mut m = Meter::default();
        s.touch_dirty_bit(&caches, Gfn(0), &mut m);
        assert_ne!(s.dirty_bitmap_region(&caches), region);
        assert_eq!(m.memory_lines, 1);
    }

    #[test]
    fn bits_set_a_word_at_a_time_are_the_bits_set_one_by_one() {
        // Down one word and into the next (as a PML flush runs), back up, repeats, and new
        // bits last.
        let gfns: Vec<u64> = (0..200)
            .rev()
            .chain([3, 64, 63, 199, 0, 0, 250, 251])
            .map(|g| 0x100 + g)
            .collect();
        let one = slot(0x100, 256, Backing::Anonymous);
        let batched = slot(0x100, 256, Backing::Anonymous);
        let mut bits = DirtyBits::new(&batched);
        for (i, &g) in gfns.iter().enumerate() {
            one.set_dirty_bit(Gfn(g));
            bits.set(Gfn(g));
            if i == 70 {
                // Mid-way, the bits of words the batch has left are set already.
                let left = (0..4)
                    .filter(|&w| w != bits.word)
                    .map(|w| batched.bitmap_word(w).load(Ordering::Relaxed));
                let want = (0..4)
                    .filter(|&w| w != bits.word)
                    .map(|w| one.bitmap_word(w).load(Ordering::Relaxed));
                assert!(left.eq(want));
            }
        }
        drop(bits);
        for w in 0..4 {
            let (a, b) = (one.bitmap_word(w), batched.bitmap_word(w));
            assert_eq!(
                a.load(Ordering::Relaxed),
                b.load(Ordering::Relaxed),
                "word {w}"
            );
        }
        let last = 0xff | 0b11 << 58;
        assert_eq!(
            one.bitmap_word(3).load(Ordering::Relaxed),
            last,
            "192-199, 250, 251"
        );
    }

    #[test]
    fn bits_and_lines_of_pages_down_are_those_of_the_pages_one_by_one() {
        use crate::hw::cache::CASCADE_LAKE_8275CL;
        let caches = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        caches.run_on(caches.vmm_cpu());
        let base = 0x100;
        // Within a word, to its edges, across words and bitmap lines (512 pages a line), and
        // the whole slot.
        let runs = [
            (0, 1),
            (5, 3),
            (63, 64),
            (64, 1),
            (127, 64),
            (130, 70),
            (511, 512),
            (600, 200),
            (1100, 1024),
            (2047, 2048),
        ];
        for (top, count) in runs {
            let one = slot(base, 2048, Backing::Anonymous);
            let down = slot(base, 2048, Backing::Anonymous);
            let gfns = (top + 1 - count..=top).rev().map(|g| Gfn(base + g));
            for g in gfns.clone() {
                one.set_dirty_bit(g);
            }
            down.set_dirty_bits_down(Gfn(base + top), count);
            for w in 0..one.bitmap_words() {
                let (a, b) = (one.bitmap_word(w), down.bitmap_word(w));
                let (a, b) = (a.load(Ordering::Relaxed), b.load(Ordering::Relaxed));
                assert_eq!(a, b, "{count} pages down from {top}: word {w}");
            }
            let mut each: Vec<MetaLine> = one.dirty_bit_lines(&caches, gfns).collect();
            each.dedup();
            let lines: Vec<MetaLine> = one
                .dirty_bit_lines_down(&caches, Gfn(base + top), count)
                .collect();
            assert_eq!(lines, each, "{count} pages down from {top}");
        }
    }

    #[test]
    fn dirty_bits_and_initially_set() {
        let s = slot(0x100, 130, Backing::Anonymous);
        s.set_flags(KVM_MEM_LOG_DIRTY_PAGES);
        assert!(s.dirty_track_enabled());
        assert!(s.set_dirty_bit(Gfn(0x100 + 65)));
        assert!(!s.set_dirty_bit(Gfn(0x100 + 65)), "already set");
        assert_eq!(s.bitmap_word(1).load(Ordering::Relaxed), 2);
        s.set_all_dirty();
        assert_eq!(
            s.bitmap_word(2).load(Ordering::Relaxed),
            0b11,
            "no bits past the slot end"
        );
    }

    #[test]
    fn clear_dirty_log_ranges_follow_kvm_rules() {
        let s = slot(0, 200, Backing::Anonymous);
        assert!(check_clear_dirty_log_range(&s, 0, 64).is_ok());
        assert!(
            check_clear_dirty_log_range(&s, 128, 72).is_ok(),
            "ends the slot: any length"
        );
        assert!(check_clear_dirty_log_range(&s, 0, 200).is_ok());
        assert!(
            check_clear_dirty_log_range(&s, 1, 64).is_err(),
            "unaligned first page"
        );
        assert!(
            check_clear_dirty_log_range(&s, 0, 65).is_err(),
            "not a multiple of 64"
        );
        assert!(
            check_clear_dirty_log_range(&s, 128, 73).is_err(),
            "past the end"
        );
        assert!(
            check_clear_dirty_log_range(&s, 256, 0).is_err(),
            "starts past the end"
        );
    }
}
