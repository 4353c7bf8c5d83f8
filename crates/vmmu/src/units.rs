//! Units: guest frame numbers, guest physical addresses, host page frame numbers, gfn ranges and
//! page sizes. Arithmetic only; no policy lives here, and no architecture's page-table levels
//! (each format numbers its own: `hw::pgtable::Level`).

use serde::{Deserialize, Serialize};
use std::fmt;

/// log2 of the base page size (4 KiB).
pub const PAGE_SHIFT: u32 = 12;
/// The base page size in bytes.
pub const PAGE_SIZE: u64 = 1 << PAGE_SHIFT;

/// A guest frame number: a guest physical address shifted right by [`PAGE_SHIFT`].
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Gfn(pub u64);

/// A guest physical address.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Gpa(pub u64);

/// A host page frame number: an index into the host's backing memory in 4 KiB units.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Pfn(pub u64);

/// `+ u64`, `- u64` (the frame or address that far away) and `- Self` (how far apart) for a
/// unit newtype; overflow panics in debug builds, as integer arithmetic does.
macro_rules! offset_arithmetic {
    ($($t:ident),*) => {$(
        impl std::ops::Add<u64> for $t {
            type Output = $t;
            #[inline]
            fn add(self, n: u64) -> $t {
                $t(self.0 + n)
            }
        }
        impl std::ops::AddAssign<u64> for $t {
            #[inline]
            fn add_assign(&mut self, n: u64) {
                self.0 += n;
            }
        }
        impl std::ops::Sub<u64> for $t {
            type Output = $t;
            #[inline]
            fn sub(self, n: u64) -> $t {
                $t(self.0 - n)
            }
        }
        impl std::ops::Sub for $t {
            type Output = u64;
            #[inline]
            fn sub(self, other: $t) -> u64 {
                self.0 - other.0
            }
        }
    )*};
}

offset_arithmetic!(Gfn, Gpa, Pfn);

impl Gfn {
    /// The guest physical address of the first byte of this frame.
    pub fn to_gpa(self) -> Gpa {
        Gpa(self.0 << PAGE_SHIFT)
    }
}

/// A range of guest frames `[start, end)`: what a caller owes a TLB flush for.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct GfnRange {
    /// First gfn.
    pub start: Gfn,
    /// One past the last gfn.
    pub end: Gfn,
}

impl GfnRange {
    /// `pages` frames from `start`.
    pub fn new(start: Gfn, pages: u64) -> Self {
        GfnRange {
            start,
            end: (start + pages),
        }
    }
    /// Frames in the range.
    pub fn pages(self) -> u64 {
        self.end.0 - self.start.0
    }
    /// The smallest range covering both.
    pub fn union(self, other: GfnRange) -> GfnRange {
        GfnRange {
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

/// Adds `range` to what `owed` covers (a caller's pending flush; `None`: nothing owed).
pub fn owe_flush(owed: &mut Option<GfnRange>, range: GfnRange) {
    *owed = Some(owed.map_or(range, |o| o.union(range)));
}

impl Gpa {
    /// The frame holding this address.
    pub fn to_gfn(self) -> Gfn {
        Gfn(self.0 >> PAGE_SHIFT)
    }
}

impl fmt::Debug for Gfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gfn {:#x}", self.0)
    }
}
impl fmt::Display for Gfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}
impl fmt::Debug for Gpa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpa {:#x}", self.0)
    }
}
impl fmt::Debug for Pfn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pfn {:#x}", self.0)
    }
}

/// A size a page can be mapped at: the base page, or a huge page made of 512 or 512 × 512 of
/// them (what a host backing, a memslot's alignment or a TLB entry allows, whatever an
/// architecture calls the page-table level that maps it).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PageSize {
    /// 4 KiB.
    Size4K,
    /// 2 MiB.
    Size2M,
    /// 1 GiB.
    Size1G,
}

impl PageSize {
    /// 4 KiB pages in one page of this size.
    pub fn pages(self) -> u64 {
        match self {
            PageSize::Size4K => 1,
            PageSize::Size2M => 1 << 9,
            PageSize::Size1G => 1 << 18,
        }
    }
    /// log2 of [`PageSize::pages`]: how far a gfn shifts to number pages of this size.
    pub fn gfn_shift(self) -> u32 {
        match self {
            PageSize::Size4K => 0,
            PageSize::Size2M => 9,
            PageSize::Size1G => 18,
        }
    }
    /// `gfn` rounded down to the first gfn of the page of this size that holds it.
    pub fn round(self, gfn: Gfn) -> Gfn {
        Gfn(gfn.0 & !(self.pages() - 1))
    }
    /// Every size, smallest first.
    pub const ALL: [PageSize; 3] = [PageSize::Size4K, PageSize::Size2M, PageSize::Size1G];
}

/// Why a size did not parse ([`parse_size`]); each names the input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// A letter after the number that is not a size suffix.
    #[error("size '{0}' has an unknown suffix: use a number with optional K, M, G or T")]
    UnknownSuffix(String),
    /// No number before the suffix.
    #[error("size '{0}' is not a number with optional K, M, G or T suffix")]
    NotANumber(String),
    /// More bytes than a `u64` counts.
    #[error("size '{0}' is too large")]
    TooLarge(String),
}

/// Parses a size the way KVM selftests' `parse_size()` does: a number, optionally followed by one
/// of `k`, `m`, `g`, `t` (either case, powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let (digits, mult) = match t.chars().last() {
        Some(c) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_lowercase() {
                'b' => 1u64,
                'k' => 1 << 10,
                'm' => 1 << 20,
                'g' => 1 << 30,
                't' => 1 << 40,
                _ => return Err(SizeError::UnknownSuffix(s.into())),
            };
            (&t[..t.len() - 1], m)
        }
        _ => (t, 1),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| SizeError::NotANumber(s.into()))?;
    n.checked_mul(mult)
        .ok_or_else(|| SizeError::TooLarge(s.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_sizes_round_and_count_base_pages() {
        assert_eq!(PageSize::Size2M.pages(), 512);
        assert_eq!(PageSize::Size1G.pages(), 512 * 512);
        assert_eq!(PageSize::Size2M.round(Gfn(0x4_0203)), Gfn(0x4_0200));
        assert_eq!(PageSize::Size1G.round(Gfn(0x4_0203)), Gfn(0x4_0000));
    }

    #[test]
    fn parse_size_accepts_selftest_forms_and_rejects_garbage() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10M").unwrap(), 10 << 20);
        assert_eq!(parse_size("3g").unwrap(), 3 << 30);
        assert!(parse_size("1X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
