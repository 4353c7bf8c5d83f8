//! arm64 TLB maintenance instructions by IPA as the architecture encodes them
//! (`arch/arm64/include/asm/tlbflush.h`): `TLBI IPAS2E1IS` with its TTL level hint, the range
//! form `TLBI RIPAS2E1IS` of FEAT_TLBIRANGE (BADDR, TTL, NUM, SCALE, TG), and
//! `__flush_tlb_range_op()`, the loop that covers a range of pages with as few operations as it
//! can. Every operand is decoded back into the [`TlbInvalidation`] the hardware performs, so the
//! TLB model invalidates what the encoded instruction says, not what its caller meant.

use crate::hw::pgtable::Level;
use crate::hw::tlb::TlbInvalidation;
use crate::units::{Gfn, PageSize};

/// `TLBI_TTL_TG_4K`: the translation granule field value for 4 KiB pages.
pub const TLBI_TTL_TG_4K: u64 = 1;
/// `TLBI_TTL_MASK`: the TTL field of a non-range operand, bits `[47:44]`.
pub const TLBI_TTL_MASK: u64 = 0xf << 44;
/// The address field of a non-range operand: IPA`[55:12]` in bits `[43:0]`.
pub const TLBI_VADDR_MASK: u64 = (1 << 44) - 1;

/// `__TLBI_RANGE_PAGES(num, scale)`: pages one range operation covers.
pub const fn tlbi_range_pages(num: u64, scale: u32) -> u64 {
    (num + 1) << (5 * scale + 1)
}

/// `MAX_TLBI_RANGE_PAGES`: the most one range operation covers, `__TLBI_RANGE_PAGES(31, 3)`
/// (2^21 pages, 8 GiB at 4K).
pub const MAX_TLBI_RANGE_PAGES: u64 = tlbi_range_pages(31, 3);

/// `__TLBI_RANGE_NUM(pages, scale)`: the NUM field that covers as much of `pages` as one
/// operation at `scale` can, or -1 when `pages` is below that scale's smallest operation.
pub fn tlbi_range_num(pages: u64, scale: u32) -> i64 {
    (pages.min(tlbi_range_pages(31, scale)) >> (5 * scale + 1)) as i64 - 1
}

/// One broadcast invalidation of stage-2 translations by IPA, with its encoded operand.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TlbiIpa {
    /// `TLBI IPAS2E1IS, Xt`: one page (or the leaf holding it); `__TLBI_VADDR()` with the TTL
    /// level hint of `__tlbi_level()`.
    Ipas2e1is(u64),
    /// `TLBI RIPAS2E1IS, Xt`: a range; `__TLBI_VADDR_RANGE()`.
    Ripas2e1is(u64),
}

/// `__TLBI_VADDR(addr, asid)` with `__tlbi_level()`'s TTL: `level` 1–3 hints the leaf's level
/// (FEAT_TTL), 0 or none gives no hint.
pub fn tlbi_vaddr(gfn: Gfn, level: Option<Level>) -> u64 {
    let mut arg = gfn.0 & TLBI_VADDR_MASK;
    if let Some(l) = level.filter(|l| l.0 != 0) {
        let ttl = (TLBI_TTL_TG_4K << 2) | (l.0 as u64 & 3);
        arg = (arg & !TLBI_TTL_MASK) | (ttl << 44);
    }
    arg
}

/// `__TLBI_VADDR_RANGE(baddr, asid, scale, num, ttl)`: BADDR `[36:0]` (the first page), TTL
/// `[38:37]` (the leaf level, 0 for unknown), NUM `[43:39]`, SCALE `[45:44]`, TG `[47:46]` (4K), ASID
/// `[63:48]` (0: stage-2 operations carry the VMID in VTTBR, not here).
pub fn tlbi_vaddr_range(baddr: u64, scale: u32, num: u64, ttl: u64) -> u64 {
    debug_assert!(scale <= 3 && num <= 31 && ttl <= 3 && baddr < 1 << 37);
    baddr | (ttl << 37) | (num << 39) | ((scale as u64) << 44) | (TLBI_TTL_TG_4K << 46)
}

impl TlbiIpa {
    /// What the hardware invalidates for this operand.
    pub fn invalidation(self) -> TlbInvalidation {
        match self {
            TlbiIpa::Ipas2e1is(arg) => {
                let ttl = (arg & TLBI_TTL_MASK) >> 44;
                let size = match (ttl >> 2, ttl & 3) {
                    (TLBI_TTL_TG_4K, 1) => Some(PageSize::Size1G),
                    (TLBI_TTL_TG_4K, 2) => Some(PageSize::Size2M),
                    (TLBI_TTL_TG_4K, 3) => Some(PageSize::Size4K),
                    _ => None,
                };
                TlbInvalidation::Gfn {
                    gfn: Gfn(arg & TLBI_VADDR_MASK),
                    size,
                }
            }
            TlbiIpa::Ripas2e1is(arg) => {
                let num = (arg >> 39) & 0x1f;
                let scale = ((arg >> 44) & 3) as u32;
                TlbInvalidation::Range {
                    start: Gfn(arg & ((1 << 37) - 1)),
                    pages: tlbi_range_pages(num, scale),
                }
            }
        }
    }
}

/// `__flush_tlb_range_op()` as Linux 6.9 has it, for stage-2 IPAs at the 4K granule with a
/// stride of one page (`__flush_s2_tlb_range_op()`): issues the operations that invalidate
/// `pages` pages from `start`, largest scale first. Without FEAT_TLBIRANGE (`range` false), or
/// for a last single page, one `TLBI IPAS2E1IS` per page. `ttl`: the leaf level if known (0:
/// unknown), as `tlb_level`. With `range`, `pages` must not exceed [`MAX_TLBI_RANGE_PAGES`]
/// (callers chunk, as `kvm_tlb_flush_vmid_range()` does).
pub fn flush_s2_tlb_range_op(
    start: Gfn,
    pages: u64,
    range: bool,
    ttl: u8,
    mut issue: impl FnMut(TlbiIpa),
) {
    assert!(
        !range || pages <= MAX_TLBI_RANGE_PAGES,
        "a range flush of {pages} pages: callers split at MAX_TLBI_RANGE_PAGES"
    );
    let mut start = start.0;
    let mut pages = pages;
    let mut scale: i32 = 3;
    while pages > 0 {
        if !range || pages == 1 {
            issue(TlbiIpa::Ipas2e1is(tlbi_vaddr(Gfn(start), Some(Level(ttl)))));
            start += 1;
            pages -= 1;
            continue;
        }
        debug_assert!(
            scale >= 0,
            "scale 0 covers any even count, and an odd one leaves 1"
        );
        let num = tlbi_range_num(pages, scale as u32);
        if num >= 0 {
            let n = num as u64;
            issue(TlbiIpa::Ripas2e1is(tlbi_vaddr_range(
                start,
                scale as u32,
                n,
                ttl as u64 & 3,
            )));
            let covered = tlbi_range_pages(n, scale as u32);
            start += covered;
            pages -= covered;
        }
        scale -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ops(start: u64, pages: u64, range: bool) -> Vec<TlbiIpa> {
        let mut v = Vec::new();
        flush_s2_tlb_range_op(Gfn(start), pages, range, 0, |op| v.push(op));
        v
    }

    #[test]
    fn a_thousand_and_one_pages_take_a_scale_1_op_a_scale_0_op_and_one_single() {
        let v = ops(0x1000, 1001, true);
        assert_eq!(v.len(), 3, "{v:x?}");
        // Scale 1: NUM = (1001 >> 6) - 1 = 14, 15 << 6 = 960 pages.
        assert_eq!(
            v[0],
            TlbiIpa::Ripas2e1is(0x1000 | (14 << 39) | (1 << 44) | (1 << 46))
        );
        // Scale 0: 41 pages left, NUM = (41 >> 1) - 1 = 19, 20 << 1 = 40 pages.
        assert_eq!(
            v[1].invalidation(),
            TlbInvalidation::Range {
                start: Gfn(0x1000 + 960),
                pages: 40
            }
        );
        assert_eq!(
            v[2].invalidation(),
            TlbInvalidation::Gfn {
                gfn: Gfn(0x1000 + 1000),
                size: None
            }
        );
    }

    #[test]
    fn without_feat_tlbirange_every_page_is_one_single_tlbi() {
        let v = ops(7, 5, false);
        assert_eq!(v.len(), 5);
        assert!(v.iter().all(|op| matches!(op, TlbiIpa::Ipas2e1is(_))));
    }

    #[test]
    fn the_ttl_hint_encodes_the_leaf_level() {
        let op = TlbiIpa::Ipas2e1is(tlbi_vaddr(Gfn(0x200), Some(Level(2))));
        assert_eq!(
            op.invalidation(),
            TlbInvalidation::Gfn {
                gfn: Gfn(0x200),
                size: Some(PageSize::Size2M)
            }
        );
        assert_eq!(tlbi_vaddr(Gfn(5), Some(Level(0))), 5, "level 0: no hint");
    }

    #[test]
    fn one_operation_covers_max_tlbi_range_pages() {
        assert_eq!(MAX_TLBI_RANGE_PAGES, 1 << 21);
        let v = ops(0, MAX_TLBI_RANGE_PAGES, true);
        assert_eq!(v, [TlbiIpa::Ripas2e1is((31 << 39) | (3 << 44) | (1 << 46))]);
        // One page short: every scale's largest operation, then a single.
        assert_eq!(ops(0, MAX_TLBI_RANGE_PAGES - 1, true).len(), 5);
    }

    proptest! {
        /// The union of what the operations invalidate is exactly the requested range, and
        /// the operations do not overlap.
        #[test]
        fn the_operations_tile_the_range(start in 0u64..(1 << 30), pages in 1u64..=MAX_TLBI_RANGE_PAGES, range in any::<bool>()) {
            prop_assume!(range || pages <= 4096);
            let mut at = start;
            for op in ops(start, pages, range) {
                let (s, n) = match op.invalidation() {
                    TlbInvalidation::Range { start, pages } => (start.0, pages),
                    TlbInvalidation::Gfn { gfn, .. } => (gfn.0, 1),
                    TlbInvalidation::All | TlbInvalidation::Stage1All => unreachable!(),
                };
                prop_assert_eq!(s, at);
                at += n;
            }
            prop_assert_eq!(at, start + pages);
        }
    }
}
