//! The host's data caches as KVM's own data meets them: where that data lives in host memory,
//! which core is touching it (the engine says), and what each line read costs beyond the
//! cache-resident software cost the meter already prices ([`crate::hw::cache`] holds the
//! caches themselves).
//!
//! What is followed:
//! - the memslot rmaps of the shadow MMU, zeroed when the memslot is created
//!   (`memslot_rmap_alloc()`'s `__vcalloc()`), scanned by `walk_slot_rmaps()`, and touched
//!   head by head by `rmap_add()` and the masked dirty-log clear
//!   (`kvm_mmu_write_protect_pt_masked()`);
//! - every MMU's page tables ([`TableLines`]): the TDP MMU's SPTE pages, arm64's stage-2
//!   tables and the shadow MMU's shadow pages, placed and filled by the core that allocates
//!   them, and read entry by entry by KVM's software walks (`tdp_iter` walks through
//!   [`crate::kvm::mmu_ctx::MmuCtx`], `kvm_pgtable_walk()`, the shadow MMU's fault walk, rmap
//!   handlers and eager split);
//! - each memslot's dirty bitmap and its buffer (`kvm_alloc_dirty_bitmap()`'s one
//!   `__vcalloc()`), zeroed by the VMM when logging is enabled, a line set by
//!   `mark_page_dirty_in_slot()`, and scanned word by word by `KVM_GET_DIRTY_LOG` and
//!   `KVM_CLEAR_DIRTY_LOG`;
//! - the shadow MMU's page hash (`mmu_page_hash`, in the `struct kvm` the VMM allocated) and
//!   the shadow pages' headers (`struct kvm_mmu_page`, from each vCPU's slab: [`SlabCache`]):
//!   a lookup (`__kvm_mmu_get_shadow_page()`, `for_each_gfn_valid_sp_with_gptes()`) reads
//!   its bucket and, for each page in it, the header's hash node, gfn and role;
//! - the shadow MMU's rmap descriptors (`struct pte_list_desc`, from the same per-core
//!   slabs), which a gfn mapped by more than one SPTE chains from its head: every line of
//!   each where write protection, dirty clearing and zapping walk the chain, the head one on
//!   `pte_list_add()`, those up to the entry on `pte_list_remove()`;
//! - the guest's own lines, which compete with them for the last-level cache (a guest access
//!   that missed every TLB level fetches its line; its price stays the guest's own streaming
//!   estimate).
//!
//! Not followed: the CPU's own page walks (priced per level by `page_walk_level_ns`, an L2
//! hit); the header reads of `sptep_to_sp()` outside hash walks; the descriptors of
//! `parent_ptes` lists, and those of memslot rmaps where aging, the collapsible-SPTE scan and
//! eager split's search for huge leaves walk them; the TDP MMU's page headers; the
//! memslots (`__gfn_to_memslot()` reads a few lines of the vCPU's last-used slot, never
//! written while the guest runs: always in the core's L2, where they would cost nothing);
//! and the dirty rings' pages.
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
//! Where a line lives (NUMA): KVM's allocations come from the node of the CPU that makes them
//! (`__vcalloc()` and `__get_free_page()` under the default memory policy allocate on
//! `numa_node_id()`), so each [`MetaRegion`] has the allocating core's socket as its home. A
//! line read from another socket's memory costs the remote latency (`remote_memory_lines`, or
//! `remote_memory_lines_streamed` for a scan's later lines, the same latency over the same
//! misses in flight); it then sits in the reading socket's caches like any other.
//! [`HostCaches::counters`] tallies every line by socket: last-level hits and misses, lines
//! read from each socket's memory, and how many of those crossed sockets. Guest memory is
//! placed the same way, by first touch: a host page lives on the socket of the vCPU whose
//! fault first needed it ([`crate::kvm::Kvm::place_first_touch`]); a guest line fetched by a
//! vCPU of another socket is a `guest_remote_lines` (priced `guest_remote_line_ns`, what
//! streaming it from the other socket adds) and queues on the bandwidth of its home socket.
//!
//! Simplified: that extra time is added to the scan's own work rather than overlapped with it;
//! a line held (perhaps modified) only by the other socket's caches is read from its home
//! memory, not forwarded cache to cache; and the host's zeroing of guest pages when they are
//! first faulted in (`clear_huge_page()`, `clear_page()`) does not pass through the caches here.

use crate::host::memory::{MAX_REGIONS, REGION_PFN_BITS};
use crate::hw::cache::{
    CacheGeometry, CacheHierarchy, HostCacheShape, LineCost, Served, LINE_SHIFT,
};
use crate::hw::page_table::TableLines;
use crate::kvm::meter::Meter;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
/// from a page boundary, in the memory of socket `home`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaRegion {
    first: u64,
    lines: u64,
    home: u32,
}

/// One line of KVM's data: its line number and the socket whose memory holds it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MetaLine {
    /// The line number (host byte address >> 6).
    pub line: u64,
    /// The socket whose memory holds it.
    pub home: u32,
}

impl MetaRegion {
    /// True for a region not placed yet (no caches were modelled when it was allocated).
    pub fn is_unplaced(&self) -> bool {
        self.lines == 0
    }

    /// The line holding byte `offset` of the region.
    #[inline]
    pub fn line_of(&self, offset: u64) -> MetaLine {
        MetaLine {
            line: self.first + (offset >> LINE_SHIFT),
            home: self.home,
        }
    }

    /// The lines holding bytes `low..=high` of the region, highest first.
    pub fn lines_down(&self, high: u64, low: u64) -> impl Iterator<Item = MetaLine> {
        let home = self.home;
        let lines = self.line_of(low).line..=self.line_of(high).line;
        lines.rev().map(move |line| MetaLine { line, home })
    }

    /// The socket whose memory holds the region.
    pub fn home(&self) -> u32 {
        self.home
    }
}

/// One of KVM's objects from a slab cache (`kmem_cache_alloc()`): at host byte address
/// `addr`, in the memory of socket `home`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct MetaObject {
    addr: u64,
    home: u32,
}

impl MetaObject {
    /// True for an object not placed (no caches were modelled when it was allocated).
    pub fn is_unplaced(&self) -> bool {
        self.addr == 0
    }

    /// The line holding byte `offset` of the object.
    #[inline]
    pub fn line_of(&self, offset: u64) -> MetaLine {
        MetaLine {
            line: (self.addr + offset) >> LINE_SHIFT,
            home: self.home,
        }
    }
}

/// A `kmem_cache` of `object_bytes`-byte objects as the host's caches see it: SLUB hands each
/// CPU objects from a slab page of its own (`kmem_cache_cpu`), one after another, from the
/// page allocator on its node; without `SLAB_HWCACHE_ALIGN` objects are packed back to back,
/// so one may straddle two lines. Simplified: a freed object is not handed out again (SLUB's
/// per-CPU freelist would return it first), and a slab page is one 4 KiB page.
#[derive(Debug)]
pub struct SlabCache {
    object_bytes: u64,
    /// Each core's slab page and the bytes of it handed out.
    per_core: Vec<(MetaRegion, u64)>,
}

impl SlabCache {
    /// An empty cache of `object_bytes`-byte objects.
    pub const fn new(object_bytes: u64) -> Self {
        SlabCache {
            object_bytes,
            per_core: Vec::new(),
        }
    }

    /// `kmem_cache_zalloc()` on the running core: the next object of its slab page (a new page
    /// when that one is full), zeroed through the core's caches. Not priced: KVM allocates
    /// these when it tops up a vCPU's memory caches, which the top-up's own cost covers.
    pub fn zalloc(&mut self, caches: &HostCaches) -> MetaObject {
        let mut st = caches.lock();
        let cpu = st.cpu;
        if cpu.core >= self.per_core.len() {
            self.per_core
                .resize(cpu.core + 1, (MetaRegion::default(), 0));
        }
        let (page, used) = &mut self.per_core[cpu.core];
        if page.is_unplaced() || *used + self.object_bytes > 4096 {
            *page = st.alloc_page(cpu);
            *used = 0;
        }
        let obj = MetaObject {
            addr: (page.first << LINE_SHIFT) + *used,
            home: page.home,
        };
        *used += self.object_bytes;
        let last = obj.line_of(self.object_bytes - 1).line;
        for line in obj.line_of(0).line..=last {
            st.caches.access(cpu.core, cpu.socket as usize, line);
        }
        obj
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

/// Sequential scans one core's prefetchers follow at once: the L2 streamer "detects and
/// maintains up to 32 streams of data accesses" (Intel 64 and IA-32 Architectures Optimization
/// Reference Manual), so a walk that reads a table's entries between reads of other tables
/// (a leaf table between its parents) keeps its stream.
const STREAMS: usize = 32;

/// Lines of KVM's data a core's L1 is taken to hold: the last ones it read. Simplified: a
/// 32 KiB L1 holds 512 lines, of which these cover what walks read again and again (a table's
/// line for its eight entries, a fault's upper tables for the next fault); a line found here
/// costs nothing and is not looked up further (its place in the L2's LRU order is not
/// refreshed).
const L1_LINES: usize = 8;

/// Tables [`State::recent_tables`] remembers.
const RECENT_TABLES: usize = 64;

/// Where [`State::recent_tables`] keeps the table at address `table`.
#[inline]
fn recent_slot(table: u64) -> usize {
    (table >> 12) as usize % RECENT_TABLES
}

/// One sequential scan a core's prefetchers follow.
#[derive(Copy, Clone, Debug)]
struct Stream {
    /// The last line it read.
    last: u64,
    /// How many lines it has read (saturating at [`DEMAND_LINES`] + 1).
    seen: u32,
    /// When it last read one (`State::reads`).
    used: u64,
}

#[derive(Debug)]
struct State {
    caches: CacheHierarchy,
    /// The core running now (as [`HostCaches::run_on`] last set it).
    cpu: Cpu,
    /// The next free line of KVM's data.
    next_line: u64,
    /// Each core's sequential scans in progress (its prefetchers are its own).
    streams: Vec<Vec<Stream>>,
    /// The stream each core read last, where its next read most likely goes on.
    last_stream: Vec<usize>,
    /// The last lines each core read, its L1's share of KVM's data ([`L1_LINES`]).
    l1: Vec<[u64; L1_LINES]>,
    /// Lines read so far (the clock streams are aged by).
    reads: u64,
    /// What every read of KVM's data found, by socket.
    tally: Vec<SocketTally>,
    /// Where each page table the model follows lives, by its address in this process.
    tables: HashMap<u64, MetaRegion>,
    /// Tables looked up lately, by their address's page number modulo [`RECENT_TABLES`]: a
    /// walk reads a table's entries one after another, and a fault's walk the same upper
    /// tables as the one before it.
    recent_tables: [(u64, MetaRegion); RECENT_TABLES],
}

/// What reads of KVM's data found on one socket ([`HostCaches::counters`]).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SocketTally {
    /// Reads by this socket's cores that missed their L2 and hit the socket's LLC.
    pub llc_hits: u64,
    /// Reads by this socket's cores that missed its LLC too.
    pub llc_misses: u64,
    /// Lines read from this socket's memory, by any socket's cores.
    pub dram_lines: u64,
    /// Of this socket's misses, the lines read from another socket's memory.
    pub remote_lines: u64,
}

impl State {
    /// The running core reads `at`: as the next line of one of its sequential scans if it
    /// follows the last line that scan read, else as the first of a new one. What it costs
    /// beyond a read from the core's L2.
    fn read(&mut self, at: MetaLine) -> LineCost {
        let MetaLine { line, home } = at;
        let Cpu { core, socket } = self.cpu;
        if core >= self.streams.len() {
            self.streams.resize_with(core + 1, Vec::new);
            self.last_stream.resize(core + 1, 0);
            self.l1.resize(core + 1, [u64::MAX; L1_LINES]);
        }
        let l1 = &mut self.l1[core];
        if l1.contains(&line) {
            return LineCost::Free;
        }
        l1.rotate_right(1);
        l1[0] = line;
        self.reads += 1;
        let now = self.reads;
        let streams = &mut self.streams[core];
        // The same line again (a walk resuming after a yield) is no progress; the next one
        // carries its stream on; any other starts a new one, in place of the stream used
        // longest ago once the core follows `STREAMS` of them.
        let goes_on = |s: &Stream| line == s.last || line == s.last.wrapping_add(1);
        let advance = |s: &mut Stream| {
            if line != s.last {
                s.seen = (s.seen + 1).min(DEMAND_LINES + 1);
            }
            s.last = line;
            s.used = now;
            s.seen
        };
        let last = self.last_stream[core];
        let served = self.caches.access(core, socket as usize, line);
        if served == Served::L2 {
            // Free whatever the prefetchers do. Carry the core's last stream on if the line
            // continues it (a scan partly in the L2 keeps its stream); a hit elsewhere is
            // not followed further (simplified: the streamer also trains on L2 hits, but
            // what it would start here only matters once a line misses).
            if let Some(s) = streams.get_mut(last).filter(|s| goes_on(s)) {
                advance(s);
            }
            return LineCost::Free;
        }
        let found = match streams.get(last) {
            Some(s) if goes_on(s) => Some(last),
            _ => streams.iter().position(goes_on),
        };
        let seen = match found {
            Some(i) => {
                self.last_stream[core] = i;
                advance(&mut streams[i])
            }
            None => {
                let new = Stream {
                    last: line,
                    seen: 1,
                    used: now,
                };
                let i = if streams.len() < STREAMS {
                    streams.push(new);
                    streams.len() - 1
                } else {
                    let oldest = (0..STREAMS)
                        .min_by_key(|&i| streams[i].used)
                        .expect("STREAMS > 0");
                    streams[oldest] = new;
                    oldest
                };
                self.last_stream[core] = i;
                1
            }
        };
        let demand = seen <= DEMAND_LINES;
        let remote = self.record(socket, home, served);
        match (served, demand, remote) {
            (Served::L2, ..) | (Served::Llc, false, _) => LineCost::Free,
            (Served::Llc, true, _) => LineCost::LlcHit,
            (Served::Memory, true, false) => LineCost::Memory,
            (Served::Memory, false, false) => LineCost::MemoryStreamed,
            (Served::Memory, true, true) => LineCost::RemoteMemory,
            (Served::Memory, false, true) => LineCost::RemoteMemoryStreamed,
        }
    }

    /// Host memory for `bytes` of KVM's data from `cpu`'s socket, with a guard page after it
    /// (see [`HostCaches::alloc`]).
    fn alloc(&mut self, cpu: Cpu, bytes: u64) -> MetaRegion {
        let lines = (bytes.div_ceil(4096) * LINES_PER_PAGE).max(LINES_PER_PAGE);
        let first = self.next_line;
        self.next_line += lines + LINES_PER_PAGE;
        let home = cpu.socket.min(self.tally.len() as u32 - 1);
        MetaRegion { first, lines, home }
    }

    /// One page from `cpu`'s socket, right after the last one handed out: the page
    /// allocator's pages for tables have no guard page, and fresh ones come split off larger
    /// free blocks, so consecutive allocations are mostly contiguous (simplified: always).
    fn alloc_page(&mut self, cpu: Cpu) -> MetaRegion {
        let first = self.next_line;
        self.next_line += LINES_PER_PAGE;
        let home = cpu.socket.min(self.tally.len() as u32 - 1);
        MetaRegion {
            first,
            lines: LINES_PER_PAGE,
            home,
        }
    }

    /// `cpu` writes every line of `region`, a page [`State::alloc_page`] just handed out: no
    /// access has named its lines (pages are never handed out twice), so each misses both
    /// levels ([`CacheHierarchy::insert_new`]) as [`State::fill`] would find.
    fn fill_new_page(&mut self, cpu: Cpu, region: MetaRegion) {
        debug_assert_eq!(
            region.first + region.lines,
            self.next_line,
            "the last page out"
        );
        for line in region.first..region.first + region.lines {
            self.caches.insert_new(cpu.core, cpu.socket as usize, line);
        }
    }

    /// `cpu` writes every line of `region`.
    fn fill(&mut self, cpu: Cpu, region: MetaRegion) {
        for line in region.first..region.first + region.lines {
            self.caches.access(cpu.core, cpu.socket as usize, line);
        }
    }

    /// Tallies a read by a core of `socket` of a line homed on `home` that `served` answered;
    /// true when it came from another socket's memory.
    fn record(&mut self, socket: u32, home: u32, served: Served) -> bool {
        let last = self.tally.len() - 1;
        let (socket, home) = ((socket as usize).min(last), (home as usize).min(last));
        match served {
            Served::L2 => false,
            Served::Llc => {
                self.tally[socket].llc_hits += 1;
                false
            }
            Served::Memory => {
                self.tally[socket].llc_misses += 1;
                self.tally[home].dram_lines += 1;
                let remote = socket != home;
                self.tally[socket].remote_lines += remote as u64;
                remote
            }
        }
    }
}

/// The host's caches, shared by every actor of a VM (see the module documentation).
#[derive(Debug)]
pub struct HostCaches {
    state: Mutex<State>,
    /// The socket of each vCPU's core.
    vcpu_sockets: Vec<u32>,
    /// The shape of each socket's last-level cache (to place the guest's lines in sets
    /// outside the lock: [`HostCaches::guest_line_set`]).
    llc: &'static CacheGeometry,
    /// The running core, packed (socket << 32 | core): set once per vCPU step or job chunk,
    /// so kept out of the lock.
    running: AtomicU64,
    /// Some of KVM's data lives in the caches ([`HostCaches::alloc`]): until then the guest's
    /// lines compete with nothing the model follows, and are not followed either.
    following: AtomicBool,
}

impl HostCaches {
    /// Empty caches of `shape`, on `sockets` sockets; vCPU `i` runs on a core of socket
    /// `vcpu_sockets[i]`.
    pub fn new(shape: &'static HostCacheShape, sockets: u32, vcpu_sockets: Vec<u32>) -> Self {
        assert!(
            u64::from(shape.llc.slices) * u64::from(shape.llc.sets_per_slice) <= 1 << 32,
            "{}: a guest line's set is a u32",
            shape.llc.name
        );
        HostCaches {
            state: Mutex::new(State {
                caches: CacheHierarchy::new(shape.l2, shape.llc, sockets as usize),
                cpu: Cpu::default(),
                next_line: FIRST_META_LINE,
                streams: Vec::new(),
                last_stream: Vec::new(),
                l1: Vec::new(),
                reads: 0,
                tally: vec![SocketTally::default(); sockets.max(1) as usize],
                tables: HashMap::new(),
                recent_tables: [(u64::MAX, MetaRegion::default()); RECENT_TABLES],
            }),
            vcpu_sockets,
            llc: shape.llc,
            running: AtomicU64::new(0),
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
    #[inline]
    pub fn run_on(&self, cpu: Cpu) {
        // Read by the next `lock()` of the same engine thread: no ordering needed.
        self.running.store(
            ((cpu.socket as u64) << 32) | cpu.core as u64,
            Ordering::Relaxed,
        );
    }

    /// The state, with the core [`HostCaches::run_on`] last named as the running one.
    fn lock(&self) -> parking_lot::MutexGuard<'_, State> {
        let mut st = self.state.lock();
        st.cpu = self.running_cpu();
        st
    }

    /// Host memory for `bytes` of KVM's data, allocated by `cpu` and so from its socket's
    /// memory, from a page boundary, with a guard page after it (as `__vcalloc()` hands out
    /// vmalloc areas): a scan of one allocation never runs on into the next.
    pub fn alloc(&self, cpu: Cpu, bytes: u64) -> MetaRegion {
        self.following.store(true, Ordering::Relaxed);
        self.state.lock().alloc(cpu, bytes)
    }

    /// The core [`HostCaches::run_on`] last named.
    pub fn running_cpu(&self) -> Cpu {
        let running = self.running.load(Ordering::Relaxed);
        Cpu {
            core: running as u32 as usize,
            socket: (running >> 32) as u32,
        }
    }

    /// The running core reads (or writes) bytes `bytes` of `region` in order, one line after
    /// another (a copy, a `memset()`, a loop over an array's words): counts on `meter` what
    /// each line costs beyond a cache-resident read, as [`HostCaches::read_line`] would.
    pub fn scan(&self, region: MetaRegion, bytes: std::ops::Range<u64>, meter: &mut Meter) {
        if bytes.is_empty() {
            return;
        }
        let mut st = self.lock();
        let first = region.line_of(bytes.start);
        let last = region.line_of(bytes.end - 1);
        for line in first.line..=last.line {
            meter.count_line(st.read(MetaLine { line, ..first }));
        }
    }

    /// `cpu` zeroes `region` (a zeroed allocation): every line passes through its caches. Not
    /// priced: allocations happen outside what the selftests time.
    pub fn zeroed(&self, cpu: Cpu, region: MetaRegion) {
        self.state.lock().fill(cpu, region);
    }

    /// The running core reads (or writes) `at`: counts on `meter` what it costs beyond a
    /// cache-resident read. A line right after one of the core's last reads carries that
    /// sequential scan on (an ascending walk over an array), any other starts a new one.
    pub fn read_line(&self, at: MetaLine, meter: &mut Meter) {
        self.read_lines(std::iter::once(at), meter);
    }

    /// [`HostCaches::read_line`] of each of `lines` in order, under one hold of the lock. A
    /// line read again right after itself is not looked up: the first read left it in the
    /// core's L1, where a read finds it free and changes nothing (a PML flush reads
    /// one bitmap line for up to 512 entries in a row).
    pub fn read_lines(&self, lines: impl Iterator<Item = MetaLine>, meter: &mut Meter) {
        let mut st = self.lock();
        let mut last = None;
        for at in lines {
            if last != Some(at.line) {
                last = Some(at.line);
                meter.count_line(st.read(at));
            }
        }
    }

    /// What reads of KVM's data found so far, by socket (`llc_hits_node0`, `llc_misses_node0`,
    /// `dram_lines_node0`, `remote_lines_node0`, ... for each socket), for reports.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let st = self.state.lock();
        let mut out = Vec::with_capacity(4 * st.tally.len());
        for (s, t) in st.tally.iter().enumerate() {
            out.push((format!("llc_hits_node{s}"), t.llc_hits));
            out.push((format!("llc_misses_node{s}"), t.llc_misses));
            out.push((format!("dram_lines_node{s}"), t.dram_lines));
            out.push((format!("remote_lines_node{s}"), t.remote_lines));
        }
        out
    }

    /// What reads of KVM's data found on each socket so far.
    pub fn tally(&self) -> Vec<SocketTally> {
        self.state.lock().tally.clone()
    }

    /// A guest access by vCPU `vcpu` fetched the line of host byte address `addr`: it takes
    /// its place in the socket's last-level cache, where it competes with KVM's data (its own
    /// price is the guest's, unchanged). Simplified: it skips the vCPU core's L2, where the
    /// memstress guest's lines (the first word of each page) would use only the 16 of its
    /// 1,024 sets that page offset selects.
    #[inline]
    pub fn guest_line(&self, vcpu: usize, addr: u64) {
        self.guest_lines(vcpu, &[self.guest_line_set(addr)]);
    }

    /// The set of the last-level caches that the guest line at host byte address `addr`
    /// goes into: all a line's place there depends on ([`HostCaches::guest_lines`]), worked
    /// out without the lock.
    #[inline]
    pub fn guest_line_set(&self, addr: u64) -> u32 {
        self.llc.set_of(addr >> LINE_SHIFT) as u32
    }

    /// Guest lines that vCPU `vcpu` fetched, by their last-level cache sets
    /// ([`HostCaches::guest_line_set`]): each takes its place in the socket's last-level
    /// cache as [`HostCaches::guest_line`] says, all under one lock. Their order does not
    /// matter: a guest line only counts in its set ([`crate::hw::cache::Cache::insert_anonymous`]).
    pub fn guest_lines(&self, vcpu: usize, sets: &[u32]) {
        if sets.is_empty() || !self.following.load(Ordering::Relaxed) {
            return;
        }
        let socket = self.vcpu_sockets.get(vcpu).copied().unwrap_or(0) as usize;
        self.state
            .lock()
            .caches
            .insert_llc_anonymous_in(socket, sets);
    }

    /// Page tables the model holds now.
    pub fn nr_tables(&self) -> usize {
        self.state.lock().tables.len()
    }
}

/// Page tables (SPTE pages, stage-2 tables, shadow pages) live where the core that allocated
/// them runs: `kvm_mmu_topup_memory_cache()` takes them from the page allocator on that
/// core's node and fills them (`init_value`, or zeroes), so each is a page of its own in that
/// socket's memory, in the allocating core's caches. Simplified: a freed table's page is not
/// handed out again (the page allocator's per-CPU lists would return a recently freed,
/// cache-warm page first), and a table allocated before the caches were installed (a root)
/// is placed where it is first read.
impl TableLines for HostCaches {
    fn allocated(&self, table: u64) {
        self.following.store(true, Ordering::Relaxed);
        let mut st = self.lock();
        let cpu = st.cpu;
        let region = st.alloc_page(cpu);
        st.fill_new_page(cpu, region);
        st.tables.insert(table, region);
    }

    fn released(&self, table: u64) {
        let mut st = self.state.lock();
        st.tables.remove(&table);
        let slot = recent_slot(table);
        if st.recent_tables[slot].0 == table {
            st.recent_tables[slot] = (u64::MAX, MetaRegion::default());
        }
    }

    fn entry(&self, table: u64, index: usize) -> LineCost {
        let mut st = self.lock();
        let slot = recent_slot(table);
        let region = if st.recent_tables[slot].0 == table {
            st.recent_tables[slot].1
        } else {
            let r = match st.tables.get(&table) {
                Some(&r) => r,
                None => {
                    // A table allocated before the caches were installed (a root, or one a
                    // vCPU's memory cache held already): placed where it is first touched,
                    // in no cache yet.
                    let cpu = st.cpu;
                    let r = st.alloc_page(cpu);
                    st.tables.insert(table, r);
                    r
                }
            };
            st.recent_tables[slot] = (table, r);
            r
        };
        st.read(region.line_of((index * 8) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hw::cache::CASCADE_LAKE_8275CL;

    fn scan(c: &HostCaches, r: MetaRegion) -> Meter {
        let mut m = Meter::default();
        for offset in (0..r.lines).map(|l| l << LINE_SHIFT) {
            c.read_line(r.line_of(offset), &mut m);
        }
        m
    }

    #[test]
    fn a_scan_pays_only_for_what_the_caches_do_not_hold() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        let vmm = Cpu { core: 0, socket: 0 };
        c.run_on(vmm);
        let small = c.alloc(vmm, 512 << 10);
        c.zeroed(vmm, small);
        assert_eq!(scan(&c, small), Meter::default(), "in the L2: nothing more");
        // 4 MiB: out of the L2, in the LLC: the scan's first two lines pay the LLC's latency,
        // the prefetchers have the rest in flight, across pages.
        let big = c.alloc(vmm, 4 << 20);
        c.zeroed(vmm, big);
        let m = scan(&c, big);
        assert_eq!(m.llc_hits, 2, "{m:?}");
        assert_eq!(m.memory_lines + m.memory_lines_streamed, 0);
        // Never touched: from memory, two lines at full latency, the rest streamed.
        let cold = c.alloc(vmm, 1 << 20);
        let m = scan(&c, cold);
        let lines = (1 << 20) / 64;
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (2, lines - 2));
        // A scan that jumps starts a new stream; so does another core's.
        let mut m = Meter::default();
        let fresh = c.alloc(vmm, 8192);
        c.read_line(fresh.line_of(0), &mut m);
        c.read_line(fresh.line_of(4096), &mut m);
        assert_eq!(m.memory_lines, 2);
        // The same line again (a walk resuming) is no progress: the next one is still the
        // scan's second.
        let mut m = Meter::default();
        let again = c.alloc(vmm, 4096);
        for offset in [0, 0, 64, 128] {
            c.read_line(again.line_of(offset), &mut m);
        }
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (2, 1));
        c.run_on(Cpu { core: 1, socket: 1 });
        // Another socket's core finds nothing of it in its own LLC, and reads it from the
        // memory of the socket that allocated it.
        let m = scan(&c, big);
        assert_eq!((m.memory_lines, m.memory_lines_streamed), (0, 0));
        assert_eq!(
            (m.remote_memory_lines, m.remote_memory_lines_streamed),
            (2, 65536 - 2)
        );
    }

    #[test]
    fn lines_read_in_one_hold_cost_what_they_cost_one_by_one() {
        // Repeats in a row (skipped in one hold), repeats after other lines, and lines read
        // again after more distinct lines than the L2 holds, which cost again.
        let twins = || {
            let c = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
            c.run_on(Cpu { core: 0, socket: 0 });
            let r = c.alloc(Cpu { core: 0, socket: 0 }, 4 << 20);
            (c, r)
        };
        let (one, r) = twins();
        let (held, r2) = twins();
        assert_eq!(r.line_of(0), r2.line_of(0));
        let mut order: Vec<u64> = vec![0, 0, 0, 1, 1, 0, 2, 2, 2, 2];
        order.extend((3..40).flat_map(|l| [l, l, 0]));
        order.extend(100..20_100);
        order.extend([0, 0, 5, 5, 39, 39, 1, 1]);
        let at = |l: u64| r.line_of(l << LINE_SHIFT);
        let mut m1 = Meter::default();
        for &l in &order {
            one.read_line(at(l), &mut m1);
        }
        let mut m2 = Meter::default();
        held.read_lines(order.iter().map(|&l| at(l)), &mut m2);
        assert_eq!(m1, m2);
        assert!(
            m1.memory_lines + m1.memory_lines_streamed >= 20_040,
            "{m1:?}"
        );
        // Nothing differs afterwards either.
        assert_eq!(scan(&one, r), scan(&held, r));
    }

    #[test]
    fn a_line_lives_on_the_socket_that_allocated_it_and_the_counters_say_who_read_what() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        let (s0, s1) = (c.vcpu_cpu(0), c.vcpu_cpu(1));
        let r = c.alloc(s1, 8192);
        assert_eq!(r.home(), 1, "first touch: the allocating core's socket");
        c.run_on(s0);
        let m = scan(&c, r);
        assert_eq!(
            (m.remote_memory_lines, m.remote_memory_lines_streamed),
            (2, 126)
        );
        c.run_on(s1);
        let m = scan(&c, r);
        assert_eq!(
            (m.memory_lines, m.memory_lines_streamed),
            (2, 126),
            "local there"
        );
        let t = c.tally();
        assert_eq!(t[0].llc_misses, 128);
        assert_eq!(t[0].remote_lines, 128);
        assert_eq!(t[1].llc_misses, 128);
        assert_eq!(t[1].remote_lines, 0);
        assert_eq!(t[1].dram_lines, 256, "both sockets read node 1's memory");
        assert_eq!(t[0].dram_lines, 0);
        // Read again from socket 0: its LLC has the lines now.
        c.run_on(s0);
        let m = scan(&c, r);
        assert_eq!(
            m.llc_hits + m.memory_lines + m.remote_memory_lines,
            0,
            "{m:?}"
        );
        // A socket the caches were not built with counts as the last one.
        let far = c.alloc(Cpu { core: 9, socket: 7 }, 64);
        assert_eq!(far.home(), 1);
        let names: Vec<String> = c.counters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), 8);
        assert!(names.contains(&"remote_lines_node1".to_string()));
    }

    #[test]
    fn a_slab_packs_each_cores_objects_in_a_page_of_its_own() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        let mut slab = SlabCache::new(184);
        c.run_on(c.vcpu_cpu(0));
        let objs: Vec<MetaObject> = (0..23).map(|_| slab.zalloc(&c)).collect();
        // 22 objects of 184 bytes fill a page; the 23rd starts the next one.
        assert_eq!(objs[1].addr, objs[0].addr + 184);
        assert_eq!(objs[0].addr % 4096, 0);
        assert_eq!(objs[22].addr % 4096, 0);
        assert_eq!(objs[22].addr, objs[0].addr + 4096, "the next page");
        // The second object (bytes 184..368, packed without line alignment) spans lines 2 to
        // 5 of the page.
        assert_eq!(objs[1].line_of(0).line % 64, 2);
        assert_eq!(objs[1].line_of(183).line % 64, 5);
        // Zeroed through the allocating core's caches: its L2 holds them.
        let mut m = Meter::default();
        c.read_line(objs[5].line_of(0), &mut m);
        assert_eq!(m, Meter::default());
        // Another socket's core takes a page of its own, from its memory.
        c.run_on(c.vcpu_cpu(1));
        let other = slab.zalloc(&c);
        assert_eq!(other.home, 1);
        assert_eq!(other.addr % 4096, 0);
        assert!(other.addr > objs[22].addr);
        assert!(MetaObject::default().is_unplaced() && !other.is_unplaced());
    }

    #[test]
    fn regions_are_page_aligned_and_never_overlap() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 1, vec![]);
        let vmm = c.vmm_cpu();
        let a = c.alloc(vmm, 8);
        let b = c.alloc(vmm, 4097);
        assert_eq!(a.lines, LINES_PER_PAGE);
        assert_eq!(
            b.first,
            a.first + 2 * LINES_PER_PAGE,
            "a guard page between"
        );
        assert_eq!(b.lines, 2 * LINES_PER_PAGE);
        assert!(!a.is_unplaced() && MetaRegion::default().is_unplaced());
        assert_eq!(b.line_of(4096).line, b.first + LINES_PER_PAGE);
    }

    #[test]
    fn tables_live_where_they_were_allocated_and_are_read_line_by_line() {
        let c = HostCaches::new(&CASCADE_LAKE_8275CL, 2, vec![0, 1]);
        let (s0, s1) = (c.vcpu_cpu(0), c.vcpu_cpu(1));
        // vCPU 1 (socket 1) allocates a table: filled through its caches, from its memory.
        c.run_on(s1);
        c.allocated(0x1000);
        assert_eq!(c.nr_tables(), 1);
        assert_eq!(
            c.entry(0x1000, 0),
            LineCost::Free,
            "in the allocating core's L2"
        );
        // vCPU 0 (socket 0) walks it: a stream of remote lines, one line per eight entries.
        c.run_on(s0);
        let costs: Vec<LineCost> = (0..512).step_by(8).map(|i| c.entry(0x1000, i)).collect();
        assert_eq!(costs[..2], [LineCost::RemoteMemory; 2]);
        assert!(costs[2..]
            .iter()
            .all(|&l| l == LineCost::RemoteMemoryStreamed));
        // The next table was allocated right after it, in the next page: the walk's stream
        // carries on into it, and reading another table in between does not break it.
        c.run_on(s1);
        c.allocated(0x2000);
        c.run_on(s0);
        c.allocated(0x3000);
        assert_eq!(c.entry(0x2000, 0), LineCost::RemoteMemoryStreamed);
        assert_eq!(c.entry(0x3000, 0), LineCost::Free, "its own, in its L2");
        assert_eq!(c.entry(0x2000, 8), LineCost::RemoteMemoryStreamed);
        assert_eq!(c.entry(0x3000, 8), LineCost::Free);
        // A table allocated before the caches were installed is placed where it is first
        // read, in no cache yet.
        assert_eq!(c.entry(0x9000, 0), LineCost::Memory);
        assert_eq!(c.nr_tables(), 4);
        c.released(0x1000);
        c.released(0x9000);
        assert_eq!(c.nr_tables(), 2);
    }
}
