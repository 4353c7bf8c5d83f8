//! The host's data caches as KVM's own data meets them: where that data lives in host memory,
//! which core is touching it (the engine says), and what each line read costs beyond the
//! cache-resident software cost the meter already prices ([`crate::hw::cache`] holds the
//! caches themselves).
//!
//! What is followed: the memslot rmaps of the shadow MMU, zeroed when the memslot is created
//! (`memslot_rmap_alloc()`'s `__vcalloc()`) and scanned by `walk_slot_rmaps()`; and the guest's
//! own lines, which compete with them for the same caches (a guest access that missed every
//! TLB level fetches its line; its price stays the guest's own streaming estimate). Not yet
//! followed: SPTE and stage-2 table pages, shadow-page headers, the page hash, dirty bitmaps.
//!
//! What a line costs, beyond the software cost (which was measured cache-resident):
//! - found in the core's L2: nothing more;
//! - the first two lines of a sequential scan (an ascending walk over an array): their full
//!   latency (`llc_hits` from the last-level cache, `memory_lines` from memory), because the
//!   hardware prefetchers detect a stream from its first misses (Intel 64 and IA-32
//!   Architectures Optimization Reference Manual: the L2 streamer "detects and maintains up to
//!   32 streams of data accesses");
//! - the scan's other lines: nothing more from the last-level cache (the streamer has them in
//!   flight), and the streaming rate from memory (`memory_lines_streamed`), since one core
//!   keeps only so many misses in flight. The stream carries on across 4 KiB pages, which the
//!   L2 streamer never crosses: the next-page prefetcher (the same manual, Ivy Bridge and
//!   later: "triggered by sequential accesses to cache lines approaching the page boundary")
//!   starts the next page's lines.
//!
//! Simplified: that extra time is added to the scan's own work rather than overlapped with it;
//! a line's home socket is not modelled (no remote-memory latency yet); and the host's zeroing
//! of guest pages when they are first faulted in (`clear_huge_page()`, `clear_page()`) does not
//! pass through the caches here.

use crate::host::memory::{MAX_REGIONS, REGION_PFN_BITS};
use crate::hw::cache::{CacheHierarchy, HostCacheShape, Served, LINE_SHIFT};
use crate::kvm::meter::Meter;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// A core as the caches see it: an index of its own (the engine numbers vCPUs, the VMM thread
/// and host threads apart) and its socket.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct Cpu {
    /// The core's index.
    pub core: usize,
    /// Its socket.
    pub socket: u32,
}

/// Where a piece of KVM's data lives in host memory: `lines` cache lines from line `first`,
/// from a page boundary.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaRegion {
    first: u64,
    lines: u64,
}

impl MetaRegion {
    /// True for a region not placed yet (no caches were modelled when it was allocated).
    pub fn is_unplaced(&self) -> bool {
        self.lines == 0
    }

    /// The line holding byte `offset` of the region.
    #[inline]
    pub fn line_of(&self, offset: u64) -> u64 {
        self.first + (offset >> LINE_SHIFT)
    }
}

/// The first line of KVM's data in host memory: past the last region of host memory the model
/// can back guest memory with (`MAX_REGIONS` regions of 2^`REGION_PFN_BITS` pages), so the two
/// never share a line.
const FIRST_META_LINE: u64 = (MAX_REGIONS as u64) << (REGION_PFN_BITS + 12 - LINE_SHIFT);

/// Lines a 4 KiB page holds.
const LINES_PER_PAGE: u64 = 4096 >> LINE_SHIFT;

/// A sequential scan's first lines, which pay their latency before the prefetchers run ahead.
const DEMAND_LINES: u32 = 2;

#[derive(Debug)]
struct State {
    caches: CacheHierarchy,
    /// The core running now.
    cpu: Cpu,
    /// The next free line of KVM's data.
    next_line: u64,
    /// Each core's sequential scan in progress (its prefetchers are its own): the scan's last
    /// line and how many lines it has read (saturating at [`DEMAND_LINES`] + 1).
    streams: Vec<(u64, u32)>,
}

/// The host's caches, shared by every actor of a VM (see the module documentation).
#[derive(Debug)]
pub struct HostCaches {
    state: Mutex<State>,
    /// The socket of each vCPU's core.
    vcpu_sockets: Vec<u32>,
    /// Some of KVM's data lives in the caches ([`HostCaches::alloc`]): until then the guest's
    /// lines compete with nothing the model follows, and are not followed either.
    following: AtomicBool,
}

impl HostCaches {
    /// Empty caches of `shape`, on `sockets` sockets; vCPU `i` runs on a core of socket
    /// `vcpu_sockets[i]`.
    pub fn new(shape: &'static HostCacheShape, sockets: u32, vcpu_sockets: Vec<u32>) -> Self {
        HostCaches {
            state: Mutex::new(State {
                caches: CacheHierarchy::new(shape.l2, shape.llc, sockets as usize),
                cpu: Cpu::default(),
                next_line: FIRST_META_LINE,
                streams: Vec::new(),
            }),
            vcpu_sockets,
            following: AtomicBool::new(false),
        }
    }

    /// How many vCPUs the caches number cores for.
    pub fn nr_vcpus(&self) -> usize {
        self.vcpu_sockets.len()
    }

    /// vCPU `id`'s core.
    pub fn vcpu_cpu(&self, id: usize) -> Cpu {
        Cpu {
            core: id,
            socket: self.vcpu_sockets.get(id).copied().unwrap_or(0),
        }
    }

    /// The VMM thread's core (on socket 0).
    pub fn vmm_cpu(&self) -> Cpu {
        Cpu {
            core: self.vcpu_sockets.len(),
            socket: 0,
        }
    }

    /// Host thread `i`'s core: vCPU `i`'s (the selftests run such work on the vCPU threads).
    pub fn host_thread_cpu(&self, i: usize) -> Cpu {
        self.vcpu_cpu(i % self.vcpu_sockets.len().max(1))
    }

    /// The engine runs `cpu`'s work next: what KVM's code touches from now on, it touches
    /// from there.
    pub fn run_on(&self, cpu: Cpu) {
        self.state.lock().cpu = cpu;
    }

    /// Host memory for `bytes` of KVM's data, from a page boundary, with a guard page after it
    /// (as `__vcalloc()` hands out vmalloc areas): a scan of one allocation never runs on into
    /// the next.
    pub fn alloc(&self, bytes: u64) -> MetaRegion {
        self.following.store(true, Ordering::Relaxed);
        let mut st = self.state.lock();
        let lines = (bytes.div_ceil(4096) * LINES_PER_PAGE).max(LINES_PER_PAGE);
        let first = st.next_line;
        st.next_line += lines + LINES_PER_PAGE;
        MetaRegion { first, lines }
    }

    /// `cpu` zeroes `region` (a zeroed allocation): every line passes through its caches. Not
    /// priced: allocations happen outside what the selftests time.
    pub fn zeroed(&self, cpu: Cpu, region: MetaRegion) {
        let mut st = self.state.lock();
        for line in region.first..region.first + region.lines {
            st.caches.access(cpu.core, cpu.socket as usize, line);
        }
    }

    /// The running core reads `line` as the next line of a sequential scan (an ascending walk
    /// over an array): counts on `meter` what it costs beyond a cache-resident read.
    pub fn scan_line(&self, line: u64, meter: &mut Meter) {
        let mut st = self.state.lock();
        let Cpu { core, socket } = st.cpu;
        if core >= st.streams.len() {
            st.streams.resize(core + 1, (u64::MAX, 0));
        }
        let (last, n) = st.streams[core];
        // The same line again (a walk resuming after a yield) is no progress; the next one
        // carries the stream on; any other starts a new one.
        let seen = if line == last {
            n
        } else if line == last.wrapping_add(1) {
            (n + 1).min(DEMAND_LINES + 1)
        } else {
            1
        };
        st.streams[core] = (line, seen);
        let demand = seen <= DEMAND_LINES;
        match st.caches.access(core, socket as usize, line) {
            Served::L2 => {}
            Served::Llc if demand => meter.llc_hits += 1,
            Served::Llc => {}
            Served::Memory if demand => meter.memory_lines += 1,
            Served::Memory => meter.memory_lines_streamed += 1,
        }
    }

    /// A guest access by vCPU `vcpu` fetched the line of host byte address `addr`: it takes
    /// its place in the socket's last-level cache (its own price is the guest's, unchanged).
    /// Simplified: it skips the vCPU core's L2, which holds none of KVM's data the model
    /// follows (the vCPUs' own metadata reads are not followed yet).
    #[inline]
    pub fn guest_line(&self, vcpu: usize, addr: u64) {
        if !self.following.load(Ordering::Relaxed) {
            return;
        }
        let socket = self.vcpu_sockets.get(vcpu).copied().unwrap_or(0);
        self.state
            .lock()
            .caches
            .access_llc(socket as usize, addr >> LINE_SHIFT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::cache::CASCADE_LAKE_8275CL;

    fn scan(c: &HostCaches, r: MetaRegion) -> Meter {
        let mut m = Meter::default();
        for l in r.first..r.first + r.lines {
            c.scan_line(l, &mut m);
        }
        m
    }

    #[test]
    fn a_scan_pays_only_for_what_the_caches_do_not_hold() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        let vmm = Cpu { core: 0, socket: 0 };
        c.run_on(vmm);
        let small = c.alloc(512 << 10);
        c.zeroed(vmm, small);
        assert_eq!(scan(&c, small), Meter::default(), "in the L2: nothing more");
        // 4 MiB: out of the L2, in the LLC: the scan's first two lines pay the LLC's latency,
        // the prefetchers have the rest in flight, across pages.
        let big = c.alloc(4 << 20);
        c.zeroed(vmm, big);
        let m = scan(&c, big);
        assert_eq!(m.llc_hits, 2, "{m:?}");
        assert_eq!(m.memory_lines + m.memory_lines_streamed, 0);
        // Never touched: from memory, two lines at full latency, the rest streamed.
        let cold = c.alloc(1 << 20);
        let m = scan(&c, cold);
        let lines = (1 << 20) / 64;
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (2, lines - 2));
        // A scan that jumps starts a new stream; so does another core's.
        let mut m = Meter::default();
        let fresh = c.alloc(8192);
        c.scan_line(fresh.line_of(0), &mut m);
        c.scan_line(fresh.line_of(4096), &mut m);
        assert_eq!(m.memory_lines, 2);
        // The same line again (a walk resuming) is no progress: the next one is still the
        // scan's second.
        let mut m = Meter::default();
        let again = c.alloc(4096);
        for offset in [0, 0, 64, 128] {
            c.scan_line(again.line_of(offset), &mut m);
        }
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (2, 1));
        c.run_on(Cpu { core: 1, socket: 1 });
        // Another socket's core finds nothing of it in its own LLC.
        let m = scan(&c, big);
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (2, 65536 - 2));
    }

    #[test]
    fn regions_are_page_aligned_and_never_overlap() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 1, vec![]);
        let a = c.alloc(8);
        let b = c.alloc(4097);
        assert_eq!(a.lines, LINES_PER_PAGE);
        assert_eq!(
            b.first,
            a.first + 2 * LINES_PER_PAGE,
            "a guard page between"
        );
        assert_eq!(b.lines, 2 * LINES_PER_PAGE);
        assert!(!a.is_unplaced() && MetaRegion::default().is_unplaced());
        assert_eq!(b.line_of(4096), b.first + LINES_PER_PAGE);
    }
}
