//! The loads of 4K combined entries for ascending gfns that a TLB has made but not yet written
//! into its arrays ([`LoadWindow`]): the bookkeeping alone, the TLB's arrays write them
//! (`super::tlb_array`).
//!
//! A guest that writes its pages in order misses the TLB on every page, and each miss loads
//! the page's entry into the second level and the first. Consecutive gfns fall in consecutive
//! sets, and each load is of a key its set does not hold, so a set's loads fill its ways round
//! and round in the order its entries had before them (least recently used first): load `j`
//! of a set (from 0) goes into the way `j % ways` places in that order. Of a long run a set
//! keeps only its last `ways` loads, and where each went is known from its number. So the
//! window keeps the stamps and payloads of the last `sets × ways` loads, and the arrays write
//! only those when something reads or changes them.

/// The loads of gfns `lo..=hi` (none while `hi < lo`), in that order, each with the stamp of
/// its second-level load (its first-level load's is the next tick) and its payload (the TLB's
/// packed word): the last
/// [`LoadWindow::capacity`] of them are kept, gfn `g` at `g % capacity`.
#[derive(Clone, Debug)]
pub(crate) struct LoadWindow {
    /// Stamp and payload per gfn, modulo the capacity (allocated when first opened).
    ring: Box<[(u64, u64)]>,
    capacity: usize,
    /// Open: loads of `hi + 1` extend it.
    open: bool,
    /// Open and holding loads (`hi >= lo`): one flag for the checks on every lookup.
    held: bool,
    lo: u64,
    hi: u64,
    /// `(hi + 1) % capacity`, where the next load goes (kept so that a load divides nothing).
    next_at: usize,
}

impl LoadWindow {
    /// A closed window that keeps the last `capacity` loads once open.
    pub fn new(capacity: usize) -> Self {
        LoadWindow {
            ring: Box::default(),
            capacity,
            open: false,
            held: false,
            lo: 1,
            hi: 0,
            next_at: 0,
        }
    }

    /// How many loads it keeps.
    pub fn capacity(&self) -> u64 {
        self.capacity as u64
    }

    /// Opens it, empty, for loads from `first` on (closed before: the caller wrote what it
    /// held).
    pub fn open(&mut self, first: u64) {
        debug_assert!(!self.pending(), "open over pending loads");
        if self.ring.is_empty() {
            // Once per TLB, on the first run of writes.
            self.ring = vec![(0, 0); self.capacity].into_boxed_slice();
        }
        self.open = true;
        self.held = false;
        (self.lo, self.hi) = (first, first.wrapping_sub(1));
        self.next_at = (first % self.capacity as u64) as usize;
    }

    /// The gfn whose load would extend it, while open.
    #[inline]
    pub fn next(&self) -> Option<u64> {
        self.open.then(|| self.hi.wrapping_add(1))
    }

    /// Whether it holds loads not yet written.
    #[inline]
    pub fn pending(&self) -> bool {
        self.held
    }

    /// Whether `gfn` is among its loads.
    #[inline]
    pub fn covers(&self, gfn: u64) -> bool {
        self.pending() && self.lo <= gfn && gfn <= self.hi
    }

    /// Whether it holds at least [`LoadWindow::capacity`] loads: then every way of the arrays
    /// they go into holds one of them once written (each set's last `ways` loads fill its
    /// `ways` ways), so no entry there maps a gfn outside it.
    #[inline]
    pub fn saturated(&self) -> bool {
        // `hi >= lo` while it holds loads.
        self.pending() && self.hi - self.lo >= self.capacity as u64 - 1
    }

    /// The last gfn loaded, while it holds loads.
    #[inline]
    pub fn top(&self) -> Option<u64> {
        self.pending().then_some(self.hi)
    }

    /// The load of [`LoadWindow::next`], at `stamp`, with `payload`.
    #[inline]
    pub fn push(&mut self, stamp: u64, payload: u64) {
        debug_assert!(self.open);
        self.held = true;
        self.hi = self.hi.wrapping_add(1);
        debug_assert_eq!(self.next_at as u64, self.hi % self.capacity as u64);
        self.ring[self.next_at] = (stamp, payload);
        self.next_at += 1;
        if self.next_at == self.capacity {
            self.next_at = 0;
        }
    }

    /// Closes it: the gfns it held loads of, if any (their stamps and payloads stay readable
    /// through [`LoadWindow::load`] until it is opened again).
    pub fn close(&mut self) -> Option<(u64, u64)> {
        let held = self.pending().then_some((self.lo, self.hi));
        self.open = false;
        self.held = false;
        held
    }

    /// The stamp and payload of gfn `g`'s load, one of the last [`LoadWindow::capacity`].
    #[inline]
    pub fn load(&self, g: u64) -> (u64, u64) {
        self.ring[(g % self.capacity as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn it_keeps_the_last_loads_and_closes_to_what_it_held() {
        let mut w = LoadWindow::new(4);
        assert_eq!(w.next(), None);
        w.open(10);
        assert!(!w.pending() && !w.saturated());
        assert_eq!(w.next(), Some(10));
        for (i, g) in (10..16).enumerate() {
            assert_eq!(w.saturated(), i >= 4, "{i} loads");
            assert_eq!(w.next(), Some(g));
            w.push(100 + i as u64, g);
        }
        assert!(w.covers(10) && w.covers(15) && !w.covers(16) && !w.covers(9));
        assert!(w.saturated(), "six loads fill four ways");
        assert_eq!(w.top(), Some(15));
        assert_eq!(w.close(), Some((10, 15)));
        assert!(!w.pending() && w.next().is_none());
        // The last four stay readable.
        assert_eq!(w.load(12), (102, 12));
        assert_eq!(w.load(15), (105, 15));
        w.open(0);
        assert_eq!(w.close(), None, "an empty window held nothing");
    }
}
