//! The ranges of gfns whose second-level TLB entries sweeps down marked used without stamping
//! them ([`SweptWindows`]): the bookkeeping alone, the TLB's arrays keep the entries
//! (`super::tlb_array`).

/// One sweep's gfns `lo..=hi`: the sweep went down from `first` at clock `c` and used gfn
/// `first - r` at `c + 2r + 1`, so gfn `g` was used at `base - 2g` with `base = c + 2first + 1`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct SweptWindow {
    /// The lowest gfn.
    pub lo: u64,
    /// The highest gfn.
    pub hi: u64,
    /// The stamp of gfn `g` is `base - 2g`.
    pub base: u64,
}

impl SweptWindow {
    /// Whether it covers `gfn`.
    #[inline]
    pub fn covers(&self, gfn: u64) -> bool {
        self.lo <= gfn && gfn <= self.hi
    }

    /// How many gfns it covers.
    pub fn len(&self) -> u64 {
        self.hi - self.lo + 1
    }

    /// The stamp it gives `gfn`, one it covers.
    #[inline]
    pub fn stamp(&self, gfn: u64) -> u64 {
        debug_assert!(self.covers(gfn));
        self.base - 2 * gfn
    }
}

/// At most this many windows are kept; a sweep that leaves more has the smallest written out.
pub(crate) const MAX_WINDOWS: usize = 16;

/// Disjoint [`SweptWindow`]s, the most recent sweep's and what is left of earlier ones' (a
/// sweep that reaches a gfn an earlier one covered takes it over).
#[derive(Clone, Debug, Default)]
pub(crate) struct SweptWindows {
    /// In no order; room for the two a sweep may add before the smallest go.
    w: [SweptWindow; MAX_WINDOWS + 2],
    len: usize,
}

impl SweptWindows {
    /// The windows.
    #[inline]
    pub fn as_slice(&self) -> &[SweptWindow] {
        &self.w[..self.len]
    }

    /// Whether there are none.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The window that covers `gfn`, if any.
    #[inline]
    pub fn covering(&self, gfn: u64) -> Option<SweptWindow> {
        self.as_slice().iter().copied().find(|w| w.covers(gfn))
    }

    /// Whether any window covers a gfn in `lo..=hi`.
    pub fn overlaps(&self, lo: u64, hi: u64) -> bool {
        self.as_slice().iter().any(|w| w.lo <= hi && lo <= w.hi)
    }

    /// A sweep's window `new`, whose gfns no other window covers any more: those that did
    /// keep the rest of theirs (splitting at most one in two, since windows are disjoint).
    pub fn take_over(&mut self, new: SweptWindow) {
        let mut i = 0;
        while i < self.len {
            let w = self.w[i];
            if w.hi < new.lo || new.hi < w.lo {
                i += 1;
                continue;
            }
            let below = (w.lo < new.lo).then(|| SweptWindow {
                hi: new.lo - 1,
                ..w
            });
            let above = (new.hi < w.hi).then(|| SweptWindow {
                lo: new.hi + 1,
                ..w
            });
            match (below, above) {
                (Some(b), Some(a)) => {
                    self.w[i] = b;
                    self.push(a);
                    i += 1;
                }
                (Some(part), None) | (None, Some(part)) => {
                    self.w[i] = part;
                    i += 1;
                }
                (None, None) => self.remove(i),
            }
        }
        self.push(new);
    }

    /// Removes and returns the smallest window if there are more than [`MAX_WINDOWS`].
    pub fn pop_excess(&mut self) -> Option<SweptWindow> {
        if self.len <= MAX_WINDOWS {
            return None;
        }
        let i = (0..self.len)
            .min_by_key(|&i| self.w[i].len())
            .expect("there are windows");
        let w = self.w[i];
        self.remove(i);
        Some(w)
    }

    /// Removes and returns every window.
    pub fn take_all(&mut self) -> SweptWindows {
        std::mem::take(self)
    }

    fn push(&mut self, w: SweptWindow) {
        assert!(
            self.len < self.w.len(),
            "windows are written out as they go"
        );
        self.w[self.len] = w;
        self.len += 1;
    }

    fn remove(&mut self, i: usize) {
        self.len -= 1;
        self.w[i] = self.w[self.len];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(lo: u64, hi: u64, base: u64) -> SweptWindow {
        SweptWindow { lo, hi, base }
    }

    /// The stamp each gfn in `0..64` gets, by window.
    fn stamps(ws: &SweptWindows) -> Vec<Option<u64>> {
        (0..64)
            .map(|g| ws.covering(g).map(|w| w.stamp(g)))
            .collect()
    }

    #[test]
    fn a_sweep_takes_over_what_it_covers_and_the_rest_keeps_its_stamps() {
        let mut ws = SweptWindows::default();
        ws.take_over(w(10, 20, 1000));
        ws.take_over(w(30, 40, 2000));
        // Splits the first, ends the second.
        ws.take_over(w(15, 32, 3000));
        let want: Vec<Option<u64>> = (0..64u64)
            .map(|g| match g {
                10..=14 => Some(1000 - 2 * g),
                15..=32 => Some(3000 - 2 * g),
                33..=40 => Some(2000 - 2 * g),
                _ => None,
            })
            .collect();
        assert_eq!(stamps(&ws), want);
        // Covers one whole and nothing else.
        ws.take_over(w(33, 40, 4000));
        assert_eq!(ws.as_slice().len(), 3);
        assert!(ws.overlaps(0, 10) && !ws.overlaps(41, 63));
    }

    #[test]
    fn the_smallest_go_first_once_there_are_too_many() {
        let mut ws = SweptWindows::default();
        for k in 0..MAX_WINDOWS as u64 + 1 {
            // Window k covers k + 1 gfns.
            ws.take_over(w(100 * k, 100 * k + k, 10_000));
        }
        assert_eq!(ws.pop_excess(), Some(w(0, 0, 10_000)));
        assert_eq!(ws.pop_excess(), None);
        assert_eq!(ws.take_all().as_slice().len(), MAX_WINDOWS);
        assert!(ws.is_empty());
    }
}
