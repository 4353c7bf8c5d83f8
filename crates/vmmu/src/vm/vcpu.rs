//! A vCPU as its own thread sees it: its TLB, its memory caches, its meter, and the guest-mode
//! protocol (`vcpu_enter_guest()`): service requests, enter guest mode, run accesses until an
//! exit, handle the exit.

use crate::hw::guest_tables::walk_guest_tables;
use crate::hw::pgtable::Level;
use crate::hw::pml::{gpa_gfn, PmlLog};
use crate::hw::tlb::{MissRun, Stage2Entry, Tlb};
use crate::hw::walker::WalkResult;
use crate::kvm::host_caches::HostCaches;
use crate::kvm::host_fault::HostFaultState;
use crate::kvm::meter::Meter;
use crate::kvm::mmu::{FaultStart, GuestFault, Mmu, VcpuMmu};
use crate::kvm::vcpu::{KVM_REQ_TLB_FLUSH, KVM_REQ_UPDATE_CPU_DIRTY_LOGGING};
use crate::kvm::Kvm;
use crate::units::{Gfn, PageSize};

/// The page the selftests' guests map their memory with in their own stage-1 tables
/// (`virt_map()` maps guest pages of 4K; a 16K or 64K guest granule is modelled as 4K entries,
/// which take the same misses for a guest that touches one 4K page per guest page).
pub const GUEST_S1_PAGE: PageSize = PageSize::Size4K;

use crossbeam_epoch as epoch;

/// Why a guest access stopped.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum AccessExit {
    /// Another actor kicked the vCPU out of guest mode (a request is pending).
    Kicked,
    /// A PML-full exit: the access would set a Dirty flag and the page-modification log is full.
    PmlFull,
    /// The guest executed an instruction KVM intercepts (a nested guest's entry, exit or TLB
    /// invalidation: [`GuestOp`](crate::kvm::mmu::GuestOp)).
    Intercept,
    /// The walk faulted on `gfn` (an EPT violation, a stage-2 abort).
    Fault {
        /// The faulting gfn.
        gfn: Gfn,
        /// The access was a write.
        write: bool,
        /// The entry that stopped the walk was present (a permission fault).
        present: bool,
        /// The level where the walk stopped, in the MMU format's numbering.
        level: Level,
        /// An access-flag fault (arm64).
        access_flag: bool,
    },
}

/// One vCPU's private state.
pub struct Vcpu {
    /// Index of the vCPU.
    pub id: usize,
    /// Its TLB.
    pub tlb: Tlb,
    /// Its MMU flavour's state: memory caches, the fault between its halves.
    pub mmu: Box<dyn VcpuMmu>,
    /// Translation is two-dimensional ([`Mmu::tlb_caches_stage2`]): the TLB keeps stage-2
    /// entries and walk entries, a combined entry maps at most the guest's stage-1 page, and a
    /// miss walks the guest's own tables ([`walk_guest_tables`]).
    stage2_tlb: bool,
    /// Entries a stage-2 walk of one of the guest's table pages reads
    /// ([`Mmu::stage2_walk_levels`]).
    stage2_walk_levels: u64,
    /// The root table the CPU walks while it runs a nested guest (the EPTP of vmcs02), loaded
    /// at each VM entry from the MMU's state ([`VcpuMmu::nested_root`]); `None` in L1.
    ///
    /// [`VcpuMmu::nested_root`]: crate::kvm::mmu::VcpuMmu::nested_root
    nested_root: Option<u64>,
    /// Its CPU's page-modification log (x86 PML; enabled only on VMs whose
    /// [`Kvm::cpu_dirty_log_size`] is not 0, while a memslot logs dirty pages).
    pub pml: PmlLog,
    /// Its work counters.
    pub meter: Meter,
    /// A fault whose page the host is faulting in (`kvm::host_fault`): the exit, to run the
    /// fault again once the host is done, and where the host is.
    pub host_fault: Option<(GuestFault, HostFaultState)>,
    /// The socket whose memory served the guest line this vCPU fetched last, when the host's
    /// caches are modelled (the engine queues the line on that socket's memory; `None`: the
    /// vCPU's own).
    pub dram_socket: Option<u32>,
    /// The guest lines fetched since the engine last handed them to the host's caches, by
    /// their last-level cache sets (`HostCaches::guest_line_set`), when the engine defers
    /// them (the virtual-time engine, at the end of each accounting epoch:
    /// `engine::virtual_time::epoch`); `None`: each enters the caches at once.
    pub guest_lines: Option<Vec<u32>>,
    /// Writes made through the TLB's load window ([`Vcpu::window_write`]), for the tests
    /// that check the window path ran.
    #[cfg(test)]
    window_writes: u64,
}

/// What every write of one [`Vcpu::write_run`] shares: the VM and its host's caches, the
/// TLB's run of misses they go through, the value written, the run's last gfn, and who hears
/// of each write.
struct WriteRun<'r, F> {
    kvm: &'r Kvm,
    /// [`Vcpu::host_cpu`].
    caches: Option<(&'r HostCaches, u32)>,
    run: &'r MissRun,
    value: u64,
    last: Gfn,
    each: &'r mut F,
}

/// One guest access to a host frame: a read or a write (of `value`) of its 8-byte `word`.
#[derive(Copy, Clone, Debug)]
struct FrameAccess {
    pfn: crate::units::Pfn,
    word: usize,
    write: bool,
    value: u64,
}

impl FrameAccess {
    #[inline]
    fn new(pfn: crate::units::Pfn, word: usize, write: bool, value: u64) -> Self {
        FrameAccess {
            pfn,
            word,
            write,
            value,
        }
    }

    /// A write of `value` to the first word of `pfn` (a run's writes: the memstress guest's).
    #[inline]
    fn write_first_word(pfn: crate::units::Pfn, value: u64) -> Self {
        FrameAccess::new(pfn, 0, true, value)
    }
}

impl Vcpu {
    /// vCPU `id` of a VM whose MMU is `mmu`, with an empty TLB.
    pub fn new(id: usize, mmu: &dyn Mmu) -> Self {
        let mut tlb = Tlb::new(mmu.tlb_geometry());
        if mmu.tlb_caches_stage2() {
            tlb.cap_combined_size(GUEST_S1_PAGE);
        }
        Vcpu {
            id,
            tlb,
            mmu: mmu.create_vcpu_mmu(),
            stage2_tlb: mmu.tlb_caches_stage2(),
            stage2_walk_levels: mmu.stage2_walk_levels(),
            nested_root: None,
            host_fault: None,
            pml: PmlLog::default(),
            meter: Meter::default(),
            dram_socket: None,
            guest_lines: None,
            #[cfg(test)]
            window_writes: 0,
        }
    }

    /// Entering `KVM_RUN`: the vCPU holds `kvm->srcu` whenever it runs KVM code.
    pub fn run_begin(&mut self, kvm: &Kvm) {
        kvm.vcpus[self.id].srcu_read_lock();
    }

    /// Leaving `KVM_RUN`.
    pub fn run_end(&mut self, kvm: &Kvm) {
        kvm.vcpus[self.id].srcu_read_unlock();
    }

    /// `vcpu_enter_guest()`: service requests (a TLB flush, turning PML on or off), drop SRCU,
    /// and enter guest mode, backing out and servicing again if a request arrived meanwhile;
    /// once in guest mode, apply the broadcast invalidations posted while the vCPU was outside
    /// it.
    pub fn enter_guest(&mut self, kvm: &Kvm) {
        let shared = &kvm.vcpus[self.id];
        // VM entry loads the current VMCS's EPTP: L1's, or the nested guest's.
        self.nested_root = self.mmu.nested_root();
        loop {
            let requests = shared.take_requests();
            if requests & KVM_REQ_TLB_FLUSH != 0 {
                self.tlb.flush_all();
                self.meter.tlb_flushes += 1;
            }
            if requests & KVM_REQ_UPDATE_CPU_DIRTY_LOGGING != 0 {
                // vmx_update_cpu_dirty_logging(): PML on while any memslot logs dirty pages.
                self.pml.set_enabled(
                    kvm.cpu_dirty_log_size() > 0 && kvm.nr_memslots_dirty_logging() > 0,
                );
            }
            shared.srcu_read_unlock();
            if shared.try_enter_guest() {
                // After try_enter_guest()'s barrier: a flusher that saw us outside guest mode
                // did not wait for us, and its post is visible here.
                shared.tlb_shootdown().sync(&mut self.tlb);
                return;
            }
            shared.srcu_read_lock();
        }
    }

    /// A VM exit: leave guest mode, retake SRCU, and empty the page-modification log into the
    /// dirty bitmap or ring, as `vmx_handle_exit()` does on every exit (so GET and CLEAR need
    /// only kick the vCPUs in guest mode).
    pub fn exit_guest(&mut self, kvm: &Kvm) {
        self.meter.vm_exits += 1;
        let shared = &kvm.vcpus[self.id];
        shared.exit_guest();
        shared.srcu_read_lock();
        if !self.pml.is_empty() {
            self.flush_pml_buffer(kvm);
        }
    }

    /// `vmx_flush_pml_buffer()`: `kvm_vcpu_mark_page_dirty()` of every logged address, in
    /// whatever memslot holds it now (the vCPU holds SRCU), looked up through the last slot
    /// used, as `kvm_vcpu_gfn_to_memslot()` does with `vcpu->last_used_slot`: each run of
    /// entries one slot holds is marked in one go.
    fn flush_pml_buffer(&mut self, kvm: &Kvm) {
        let (id, meter) = (self.id, &mut self.meter);
        let guard = epoch::pin();
        let mut logged = self.pml.drain_gpas();
        meter.pml_drained += logged.len() as u64;
        while let Some(&gpa) = logged.first() {
            let Some(slot) = kvm.gfn_to_memslot(gpa_gfn(gpa), &guard) else {
                logged = &logged[1..];
                continue;
            };
            let held = logged
                .iter()
                .position(|&gpa| !slot.contains(gpa_gfn(gpa)))
                .unwrap_or(logged.len());
            let (run, rest) = logged.split_at(held);
            kvm.mark_pages_dirty_in_slot(slot, run, slot.dirty_track_enabled(), Some(id), meter);
            logged = rest;
        }
    }

    /// Makes the guest's access `a` to its host frame, counting it.
    #[inline]
    fn touch(&mut self, kvm: &Kvm, a: FrameAccess) -> u64 {
        let FrameAccess {
            pfn,
            word,
            write,
            value,
        } = a;
        let w = kvm.host.access_word(pfn, word as u64);
        if write {
            self.meter.guest_writes += 1;
            w.store(value, std::sync::atomic::Ordering::Relaxed);
            value
        } else {
            self.meter.guest_reads += 1;
            w.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// `n` first-word reads of the gfns `first`, `first - 1`, … in guest mode, as
    /// [`Vcpu::access`] makes them, for as long as each hits a 4K translation in the
    /// second-level TLB only ([`Tlb::second_level_read_run`]): returns how many it made. The
    /// values read are not returned: a caller that needs them makes the accesses one by one.
    /// The caller runs this vCPU while no other actor can kick it or post it an invalidation
    /// (in turn, or in a phase of private steps): both are looked at once, before the first.
    pub(crate) fn second_level_read_run(&mut self, kvm: &Kvm, first: Gfn, n: u64) -> u64 {
        let shared = &kvm.vcpus[self.id];
        if shared.kicked() {
            return 0;
        }
        shared.tlb_shootdown().sync(&mut self.tlb);
        let done = self.tlb.second_level_read_run(first, n);
        Self::count_second_level_reads(&mut self.meter, done);
        done
    }

    /// What `n` reads that hit the second-level TLB count: what [`Vcpu::access`] counts for
    /// each (the engine's tests compare every counter of both ways).
    pub(crate) fn count_second_level_reads(meter: &mut Meter, n: u64) {
        meter.tlb_hits += n;
        meter.tlb_l2_hits += n;
        meter.guest_reads += n;
    }

    /// What the guest does next, in guest mode: a memory access ([`Vcpu::access`]) or an
    /// instruction KVM intercepts, which exits at once.
    #[inline]
    pub fn try_op(
        &mut self,
        kvm: &Kvm,
        mmu: &dyn Mmu,
        a: &crate::vm::exit::GuestAccess,
    ) -> Result<u64, AccessExit> {
        if a.op != crate::kvm::mmu::GuestOp::Access {
            return Err(AccessExit::Intercept);
        }
        self.access(kvm, mmu, a.gfn, a.word, a.write, a.value)
    }

    /// One 8-byte guest access in guest mode: apply posted broadcast invalidations, translate
    /// through the TLB (a stale writable entry still allows the write), walk on a miss (setting
    /// A/D), and read or write host memory. Returns the value read (or written).
    #[inline]
    pub fn access(
        &mut self,
        kvm: &Kvm,
        mmu: &dyn Mmu,
        gfn: Gfn,
        word: usize,
        write: bool,
        value: u64,
    ) -> Result<u64, AccessExit> {
        let shared = &kvm.vcpus[self.id];
        if shared.kicked() {
            return Err(AccessExit::Kicked);
        }
        shared.tlb_shootdown().sync(&mut self.tlb);
        // A hit; a write through an entry whose D is clear needs a walk to set it.
        if let Some(t) = self.tlb.lookup(gfn) {
            if !write || (t.writable && t.dirty) {
                self.meter.tlb_hits += 1;
                self.meter.tlb_l2_hits += !t.first_level as u64;
                return Ok(self.touch(kvm, FrameAccess::new(t.pfn, word, write, value)));
            }
        }
        // A TLB miss. Stage 1: the guest's walk reads its leaf entry (in the miss's fixed
        // price) and, as far as no walk entry shortens it, the levels above it, each table
        // translated through stage 2 first.
        self.meter.hw_walks += 1;
        if self.stage2_tlb {
            let w = walk_guest_tables(&mut self.tlb, gfn, self.stage2_walk_levels);
            self.meter.s1_walk_levels += w.s1_levels;
            self.meter.s1_table_s2_levels += w.s2_levels;
        }
        // Stage 2: a stage-2 entry that allows the access, or the walk of this MMU's tables.
        let leaf = match self.stage2_hit(gfn, write) {
            Some(e) => e,
            None => {
                let guard = epoch::pin();
                let pml_full = self.pml.is_full();
                let mut read = 0;
                let levels = &mut read;
                let walk = match self.nested_root {
                    // A nested guest's walk goes through the tables KVM built for it.
                    // SAFETY: `nested_root` was loaded at this VM entry from the vCPU's MMU
                    // state, whose current root it holds a reference on; the vCPU changes its
                    // roots only in its own exits, and every exit re-enters through
                    // enter_guest(), which loads it again.
                    Some(root) => unsafe { mmu.hw_walk_nested(root, gfn, write, &guard, levels) },
                    None => mmu.hw_walk(gfn, write, pml_full, &guard, levels),
                };
                self.meter.hw_walk_levels += self.stage2_walk_read(gfn, read);
                match walk {
                    WalkResult::Translated {
                        size,
                        leaf_pfn,
                        writable,
                        dirty,
                        dirtied,
                    } => {
                        self.log_dirtied(gfn, dirtied);
                        let e = Stage2Entry {
                            size,
                            leaf_pfn,
                            writable,
                            dirty,
                        };
                        if self.stage2_tlb {
                            self.tlb.insert_stage2(gfn, e);
                        }
                        e
                    }
                    WalkResult::PmlFull => return Err(AccessExit::PmlFull),
                    WalkResult::Violation {
                        level,
                        present,
                        access_flag,
                    } => {
                        return Err(AccessExit::Fault {
                            gfn,
                            write,
                            present,
                            level,
                            access_flag,
                        });
                    }
                }
            }
        };
        // The rest of the miss: the combined entry, then the line from DRAM and the access.
        let pfn = self.insert_combined(gfn, leaf);
        let caches = self.host_cpu(kvm);
        Ok(self.fetch_and_touch(kvm, caches, FrameAccess::new(pfn, word, write, value)))
    }

    /// An access that missed the TLB, once its stage-2 translation is `leaf`: caches the
    /// combined entry and returns the frame `gfn` lies in. [`Vcpu::fetch_and_touch`] then
    /// makes the access.
    #[inline]
    fn insert_combined(&mut self, gfn: Gfn, leaf: Stage2Entry) -> crate::units::Pfn {
        // The combined entry maps the smaller of the guest's page and the stage-2 leaf.
        let size = if self.stage2_tlb {
            leaf.size.min(GUEST_S1_PAGE)
        } else {
            leaf.size
        };
        let leaf_base = leaf.size.round(gfn);
        let base = size.round(gfn);
        let first = leaf.leaf_pfn + (base.0 - leaf_base.0);
        self.tlb
            .insert(base, size, first, leaf.writable, leaf.dirty);
        first + (gfn.0 - base.0)
    }

    /// The host's caches, when modelled, with the socket this vCPU runs on: what
    /// [`Vcpu::fetch_and_touch`] needs of them, found once for a run of accesses.
    #[inline]
    fn host_cpu<'k>(&self, kvm: &'k Kvm) -> Option<(&'k HostCaches, u32)> {
        kvm.caches().map(|c| (c, c.vcpu_cpu(self.id).socket))
    }

    /// The access of a miss once translated to host frame `pfn`: a page whose translation no
    /// TLB level held was not touched lately, so its line comes from DRAM (and a written one
    /// goes back later); it takes its place in the host's caches when they are modelled,
    /// where it competes with KVM's own data. `caches`: [`Vcpu::host_cpu`]. Returns what
    /// [`Vcpu::touch`] returns.
    #[inline(always)]
    fn fetch_and_touch(
        &mut self,
        kvm: &Kvm,
        caches: Option<(&HostCaches, u32)>,
        a: FrameAccess,
    ) -> u64 {
        let FrameAccess {
            pfn, word, write, ..
        } = a;
        let lines = 1 + write as u64;
        self.meter.dram_lines += lines;
        if let Some((caches, socket)) = caches {
            // From the memory of the socket the page was first faulted in on.
            let home = kvm.host.home(pfn).unwrap_or(socket);
            if home != socket {
                self.meter.guest_remote_lines += lines;
            }
            self.dram_socket = Some(home);
            let addr = (pfn.0 << 12) + (word as u64) * 8;
            match &mut self.guest_lines {
                Some(lines) => lines.push(caches.guest_line_set(addr)),
                None => caches.guest_line(self.id, addr),
            }
        }
        self.touch(kvm, a)
    }

    /// Up to `n` writes of `value` to the first word of the gfns `first`, `first + 1`, … in
    /// guest mode, as [`Vcpu::access`] makes them, for as long as each misses the TLB within
    /// `first`'s 2 MiB region and goes through the walk entries the TLB holds for the region
    /// ([`Tlb::miss_run`]): its stage-2 translation comes from the region's stage-2 entry, or
    /// from a walk of the region's last-level table ([`Mmu::hw_walk_leaf_run`]), which stops
    /// before a write the page-modification log has no room for (that one exits). After each
    /// write, `each` is given the meter and the socket whose memory the line came from (what
    /// [`Vcpu::dram_socket`] holds after an access) and says whether the next may start.
    /// Returns how many writes it made. The caller runs this vCPU while no other actor can
    /// kick it, post it an invalidation or change the tables it walks (in a phase of private
    /// steps): those are looked at once, before the first write.
    pub(crate) fn write_run<F: FnMut(&mut Meter, Option<u32>) -> bool>(
        &mut self,
        kvm: &Kvm,
        mmu: &dyn Mmu,
        first: Gfn,
        n: u64,
        value: u64,
        each: &mut F,
    ) -> u64 {
        let shared = &kvm.vcpus[self.id];
        if n == 0 || !self.stage2_tlb || self.nested_root.is_some() || shared.kicked() {
            return 0;
        }
        shared.tlb_shootdown().sync(&mut self.tlb);
        if self.tlb.lazy() || !self.tlb.misses(first) {
            return 0;
        }
        let Some(run) = self.tlb.miss_run(first) else {
            return 0;
        };
        self.tlb.open_loads(&run, first);
        // Within the region; each write then stops the run before a page a lookup would find
        // (`run_write`).
        let region_left = PageSize::Size2M.pages() - first.0 % PageSize::Size2M.pages();
        let n = n.min(region_left);
        let last = Gfn(first.0 + n - 1);
        let mut w = WriteRun {
            kvm,
            caches: self.host_cpu(kvm),
            run: &run,
            value,
            last,
            each,
        };
        if let Some(e) = run.stage2_entry() {
            for i in 0..n {
                if !self.run_write(&mut w, Gfn(first.0 + i), e) {
                    return i + 1;
                }
                // Once the TLB's load window is saturated, the rest in one loop.
                let (next, left) = (Gfn(first.0 + i + 1), n - i - 1);
                if left > 0 && self.tlb.window_takes_misses(&run, next, left) {
                    return i + 1 + self.window_writes(&mut w, next, left, e);
                }
            }
            return n;
        }
        let log_room = self.pml.room().map_or(u64::MAX, |r| r as u64);
        let guard = epoch::pin();
        // Whether the writes load into the TLB's window in one go, from the first that may on
        // (the rest of the run may then too).
        let mut in_window = false;
        let made = mmu.hw_walk_leaf_run(first, n, true, log_room, &guard, &mut |leaf| {
            // The stage-2 walk entry holds the leaf's table: only the leaf is read.
            self.meter.hw_walk_levels += 1;
            self.log_dirtied(leaf.gfn, leaf.dirtied);
            let e = Stage2Entry {
                size: PageSize::Size4K,
                leaf_pfn: leaf.leaf_pfn,
                writable: leaf.writable,
                dirty: leaf.dirty,
            };
            in_window = in_window
                || self
                    .tlb
                    .window_takes_misses(&run, leaf.gfn, last.0 - leaf.gfn.0 + 1);
            if in_window {
                return self.window_write(&mut w, leaf.gfn, e);
            }
            self.run_write(&mut w, leaf.gfn, e)
        });
        if in_window {
            self.tlb.end_window_misses(&run);
        }
        made
    }

    /// The writes of a [`Vcpu::write_run`] through the stage-2 entry `e`, up to `n` of them
    /// from `first` on, once the TLB lets their misses load into its window in one go
    /// ([`Tlb::window_takes_misses`]): each as [`Vcpu::run_write`] makes it, without the TLB's
    /// searches (each next gfn is known to miss), its uses of the run's entries stamped once
    /// at the end ([`Tlb::end_window_misses`]). Returns how many it made (at least one).
    fn window_writes<F: FnMut(&mut Meter, Option<u32>) -> bool>(
        &mut self,
        w: &mut WriteRun<'_, F>,
        first: Gfn,
        n: u64,
        e: Stage2Entry,
    ) -> u64 {
        debug_assert!(n > 0 && GUEST_S1_PAGE == PageSize::Size4K);
        let leaf_base = e.size.round(first);
        let mut done = 0;
        while done < n {
            let gfn = Gfn(first.0 + done);
            done += 1;
            let page = Stage2Entry {
                size: PageSize::Size4K,
                leaf_pfn: e.leaf_pfn + (gfn.0 - leaf_base.0),
                ..e
            };
            if !self.window_write(w, gfn, page) {
                break;
            }
        }
        self.tlb.end_window_misses(w.run);
        done
    }

    /// One write of a run whose misses load into the TLB's window ([`Vcpu::window_writes`]),
    /// to `gfn`, translated by `page` (its 4K page's translation, with the stage-2 leaf's
    /// flags): as [`Vcpu::run_write`] makes it, without the TLB's searches. The caller ends
    /// the window's misses ([`Tlb::end_window_misses`]) after the last. Whether the run goes
    /// on (`each` says so; the next gfn is known to miss).
    #[inline(always)]
    fn window_write<F: FnMut(&mut Meter, Option<u32>) -> bool>(
        &mut self,
        w: &mut WriteRun<'_, F>,
        gfn: Gfn,
        page: Stage2Entry,
    ) -> bool {
        debug_assert!(
            self.tlb.misses_in_run(w.run, gfn),
            "{gfn:?} was known to miss"
        );
        debug_assert_eq!(page.size, PageSize::Size4K);
        #[cfg(test)]
        {
            self.window_writes += 1;
        }
        self.meter.hw_walks += 1;
        self.tlb
            .window_miss(gfn, page.leaf_pfn, page.writable, page.dirty);
        let pfn = page.leaf_pfn;
        self.fetch_and_touch(w.kvm, w.caches, FrameAccess::write_first_word(pfn, w.value));
        let home = self.dram_socket.take();
        (w.each)(&mut self.meter, home)
    }

    /// PML: the CPU logs an access's address when its walk set a Dirty flag (`dirtied`).
    #[inline]
    fn log_dirtied(&mut self, gfn: Gfn, dirtied: bool) {
        if dirtied && self.pml.enabled() {
            self.pml.log(gfn);
            self.meter.pml_logged += 1;
        }
    }

    /// One write of a [`Vcpu::write_run`] to `gfn`, translated at stage 2 by `leaf`: the miss
    /// goes through the run's walk entries and completes, and `each` hears of it. Whether the
    /// run goes on: `each` says so, and the next gfn, up to the run's last, still misses
    /// (looked up now, as its access one by one would look it up).
    #[inline]
    fn run_write<F: FnMut(&mut Meter, Option<u32>) -> bool>(
        &mut self,
        w: &mut WriteRun<'_, F>,
        gfn: Gfn,
        leaf: Stage2Entry,
    ) -> bool {
        self.meter.hw_walks += 1;
        self.tlb.use_miss_run(w.run, gfn);
        let pfn = self.insert_combined(gfn, leaf);
        self.fetch_and_touch(w.kvm, w.caches, FrameAccess::write_first_word(pfn, w.value));
        let home = self.dram_socket.take();
        (w.each)(&mut self.meter, home) && (gfn == w.last || self.tlb.misses_in_run(w.run, gfn + 1))
    }

    /// Stage-2 entries the CPU read for a walk of `gfn` on which the MMU's walker read `read`
    /// from the root: a walk that reached the last level reads only the leaf when a stage-2
    /// walk entry holds the last-level table of `gfn`'s 2 MiB region (the walker still goes
    /// through every level, for the translation and the A/D flags), and caches that table
    /// otherwise. Not for a nested guest's walk (its tables are the nested EPT's, and its
    /// stage-2 walk entries are not followed).
    #[inline]
    fn stage2_walk_read(&mut self, gfn: Gfn, read: u64) -> u64 {
        if !self.stage2_tlb || self.nested_root.is_some() || read != self.stage2_walk_levels {
            return read;
        }
        if self.tlb.lookup_stage2_walk(gfn) {
            1
        } else {
            self.tlb.insert_stage2_walk(gfn);
            read
        }
    }

    /// The stage-2 entry that translates `gfn` for this access, if the TLB keeps stage-2
    /// entries and has one that allows it.
    #[inline]
    fn stage2_hit(&mut self, gfn: Gfn, write: bool) -> Option<Stage2Entry> {
        if !self.stage2_tlb {
            return None;
        }
        self.tlb
            .lookup_stage2(gfn)
            .filter(|e| !write || (e.writable && e.dirty))
    }

    /// The lock-free front half of an intercepted instruction's exit: the MMU handles it
    /// ([`Mmu::begin_fault`] with the instruction's [`GuestOp`](crate::kvm::mmu::GuestOp)),
    /// and says whether the rest needs `mmu_lock`.
    pub fn begin_intercept(
        &mut self,
        kvm: &Kvm,
        mmu: &dyn Mmu,
        exit: &GuestFault,
    ) -> Result<FaultStart, crate::kvm::mmu::FaultError> {
        debug_assert_eq!(exit.vcpu, self.id);
        mmu.begin_fault(kvm, &mut *self.mmu, exit, &mut self.meter)
    }

    /// The lock-free front half of a fault: count the exit, let the MMU resolve what it can
    /// without `mmu_lock` ([`Mmu::begin_fault`]), and count a slow fault when the lock is
    /// needed. `exit` is this vCPU's.
    ///
    /// When the host must fault the page in first ([`FaultStart::Host`]), the host's fault
    /// starts here and waits in [`Vcpu::host_fault`]; the exit loop runs it, and then this
    /// fault again.
    pub fn begin_fault(
        &mut self,
        kvm: &Kvm,
        mmu: &dyn Mmu,
        exit: &GuestFault,
    ) -> Result<FaultStart, crate::kvm::mmu::FaultError> {
        debug_assert_eq!(exit.vcpu, self.id);
        if exit.after_host_fault.is_none() {
            self.meter.ept_violations += 1;
        }
        loop {
            let start = mmu.begin_fault(kvm, &mut *self.mmu, exit, &mut self.meter)?;
            match start {
                FaultStart::Slow(_) => self.meter.pf_slow += 1,
                FaultStart::Host(f) => {
                    let again = GuestFault {
                        after_host_fault: Some(f.mmu_seq),
                        ..*exit
                    };
                    let Some(st) = HostFaultState::start(kvm, f, &mut self.meter) else {
                        // Another fault mapped the page since the MMU looked: look again.
                        continue;
                    };
                    self.host_fault = Some((again, st));
                }
                FaultStart::Done(_) => {}
            }
            return Ok(start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::backing::Backing;
    use crate::kvm::memslot::KVM_MEM_LOG_DIRTY_PAGES;
    use crate::lab::memstress::GuestRandom;
    use crate::vm::exit::guest_access;
    use crate::vm::{MmuKind, Vm, VmConfig};

    /// Memslot 1's first gfn: 1 GiB-aligned, so that a 1 GiB page can map the slot.
    const BASE: u64 = 0x40000;

    /// When memslot 1 logs dirty pages.
    #[derive(Copy, Clone, Debug, PartialEq)]
    enum Logging {
        /// Never.
        Never,
        /// From the start.
        FromStart,
        /// From after the first writes (which write-protects huge pages), followed by a read
        /// of every page: the TLB holds stage-2 entries that do not allow writes.
        AfterWrites,
    }

    /// arm64's stage 2.
    fn stage2() -> MmuKind {
        MmuKind::Stage2 {
            lock: crate::arm64::Arm64Lock::Parallel,
            ia_bits: 40,
            split_chunk_pages: 0,
            cpu: Default::default(),
            relax_flush: Default::default(),
        }
    }

    /// A one-vCPU VM on `mmu` (with PML when `pml`) whose memslot 1 holds `pages` pages of
    /// `backing` at [`BASE`], each written once, and then harvested when it logs dirty pages
    /// (the writes of the pass under test walk to set D again).
    fn written_vm(mmu: MmuKind, pml: bool, backing: Backing, logging: Logging, pages: u64) -> Vm {
        let vm = Vm::new(VmConfig {
            vcpus: 1,
            eager_page_split: false,
            mmu,
            pml,
            kernel: Default::default(),
        });
        let (gpa, size) = (BASE << 12, pages << 12);
        let flags = match logging {
            Logging::FromStart => KVM_MEM_LOG_DIRTY_PAGES,
            _ => 0,
        };
        vm.set_user_memory_region(1, gpa, size, backing, flags)
            .unwrap();
        let all = |write| (0..pages).map(move |i| (Gfn(BASE + i), write));
        vm.vcpu_run(0, all(true)).unwrap();
        if logging == Logging::AfterWrites {
            vm.set_user_memory_region(1, gpa, size, backing, KVM_MEM_LOG_DIRTY_PAGES)
                .unwrap();
            vm.vcpu_run(0, all(false)).unwrap();
        }
        if logging != Logging::Never {
            vm.get_dirty_log(1).unwrap();
        }
        vm
    }

    /// What the two VMs must agree on after a pass, by name: the vCPU's TLB and meter, what
    /// every page holds, and the dirty log.
    fn seen(vm: &Vm, pages: u64) -> [(&'static str, String); 4] {
        let (tlb, meter) = {
            let v = vm.vcpu(0);
            (v.tlb.state(), v.meter.clone())
        };
        let memory: Vec<u64> = (0..pages)
            .map(|i| vm.vcpu_read(0, (BASE + i) << 12).unwrap())
            .collect();
        let log = vm.get_dirty_log(1).ok();
        assert_eq!(vm.check_invariants(), Vec::<String>::new());
        [
            ("the TLB", format!("{tlb:?}")),
            ("the meter", format!("{meter:?}")),
            ("the dirty log", format!("{log:?}")),
            ("memory", format!("{memory:?}")),
        ]
    }

    /// Writes made in runs ([`Vcpu::write_run`], cut short at random as a phase's end cuts
    /// them, the rest one by one) leave the vCPU, the tables, the log and memory as the same
    /// writes one by one do: over 4K leaves with PML filling and exiting, and through the
    /// stage-2 entries of 2 MiB blocks, and where those entries do not allow the write (the
    /// first write in each region faults and splits its block). Compared after each of
    /// several pieces of the pass.
    #[test]
    fn writes_made_in_runs_are_the_writes_one_by_one() {
        let pages = 4096;
        // (MMU, PML, backing, logging, the least share of the writes made in runs).
        for (mmu, pml, backing, logging, share) in [
            (
                MmuKind::Tdp,
                true,
                Backing::Anonymous,
                Logging::FromStart,
                2,
            ),
            (
                MmuKind::Tdp,
                false,
                Backing::AnonymousHugetlb2mb,
                Logging::Never,
                2,
            ),
            (
                MmuKind::Tdp,
                false,
                Backing::AnonymousHugetlb2mb,
                Logging::AfterWrites,
                0,
            ),
            (stage2(), false, Backing::Anonymous, Logging::Never, 2),
            (
                stage2(),
                false,
                Backing::AnonymousHugetlb2mb,
                Logging::Never,
                2,
            ),
            (stage2(), false, Backing::Anonymous, Logging::AfterWrites, 0),
        ] {
            let one = written_vm(mmu, pml, backing, logging, pages);
            let runs = written_vm(mmu, pml, backing, logging, pages);
            let mut rng = GuestRandom::new(7);
            let (mut next, mut in_runs) = (0, 0);
            while next < pages {
                let end = (next + 1 + u64::from(rng.next_u32() % 700)).min(pages);
                let value = 0x5a00 + next;
                // A few of the piece's pages are in the TLB already, a written one's entry
                // dirty, a read one's maybe not: a run stops before each.
                let touched: Vec<(Gfn, bool)> = (0..6)
                    .map(|i| {
                        let g = next + u64::from(rng.next_u32()) % (end - next);
                        (Gfn(BASE + g), i % 2 == 0)
                    })
                    .collect();
                for vm in [&one, &runs] {
                    vm.vcpu_run(0, touched.iter().copied()).unwrap();
                }
                // Each piece ends with what the log holds before the exit empties it.
                let logged = one
                    .kvm_run(0, |v| {
                        for g in next..end {
                            guest_access(&one.kvm, &*one.mmu, v, Gfn(BASE + g), 0, true, value)?;
                        }
                        Ok(v.pml.logged())
                    })
                    .unwrap();
                let logged_in_runs = runs
                    .kvm_run(0, |v| {
                        let mut g = next;
                        while g < end {
                            let first = Gfn(BASE + g);
                            let mut cut =
                                |_: &mut Meter, _: Option<u32>| !rng.next_u32().is_multiple_of(8);
                            let done =
                                v.write_run(&runs.kvm, &*runs.mmu, first, end - g, value, &mut cut);
                            in_runs += done;
                            if done == 0 {
                                guest_access(&runs.kvm, &*runs.mmu, v, first, 0, true, value)?;
                                g += 1;
                            }
                            g += done;
                        }
                        Ok(v.pml.logged())
                    })
                    .unwrap();
                assert_eq!(logged, logged_in_runs, "{mmu:?} {backing:?} {logging:?}");
                next = end;
                for ((what, a), (_, b)) in seen(&one, pages).iter().zip(&seen(&runs, pages)) {
                    assert!(
                        a == b,
                        "{mmu:?} {backing:?} {logging:?}: {what} differs at page {end}"
                    );
                }
            }
            let least = pages.checked_div(share).unwrap_or(0);
            assert!(
                in_runs >= least,
                "{mmu:?} {backing:?} {logging:?}: {in_runs} writes in runs"
            );
        }
    }

    #[test]
    fn writes_through_a_saturated_load_window_are_the_writes_one_by_one() {
        // Long runs through a 1 GiB page's stage-2 entry (Cascade Lake keeps those apart from
        // the 4K entries; its 2 MiB ones share the second level with them, and no window
        // opens): the TLB's load window saturates (after as many loads as its second level
        // holds), and the rest of each run loads into it in one loop. Runs stop now and then
        // (the engine's epoch ends), and go on from where they stopped; a page read midway
        // closes the window.
        let pages = 1 << 18;
        // And 4K pages whose writes walk to set Dirty and log it (PML), from a stage-2 walk
        // entry: the window takes those too.
        for (mmu, pml, backing, logging) in [
            (
                MmuKind::Tdp,
                false,
                Backing::AnonymousHugetlb1gb,
                Logging::Never,
            ),
            (MmuKind::Tdp, true, Backing::Anonymous, Logging::FromStart),
        ] {
            let one = written_vm(mmu, pml, backing, logging, pages);
            let runs = written_vm(mmu, pml, backing, logging, pages);
            let mut rng = GuestRandom::new(11);
            let value = 0x77;
            let read_at = pages / 2 + 3;
            one.kvm_run(0, |v| {
                for g in 0..pages {
                    if g == read_at {
                        guest_access(&one.kvm, &*one.mmu, v, Gfn(BASE + 2), 0, false, 0)?;
                    }
                    guest_access(&one.kvm, &*one.mmu, v, Gfn(BASE + g), 0, true, value)?;
                }
                Ok(())
            })
            .unwrap();
            let (mut in_runs, mut in_window) = (0, 0);
            runs.kvm_run(0, |v| {
                let mut g = 0;
                while g < pages {
                    if g == read_at {
                        guest_access(&runs.kvm, &*runs.mmu, v, Gfn(BASE + 2), 0, false, 0)?;
                    }
                    let mut cut =
                        |_: &mut Meter, _: Option<u32>| !rng.next_u32().is_multiple_of(300);
                    let n = if g < read_at { read_at - g } else { pages - g };
                    let done =
                        v.write_run(&runs.kvm, &*runs.mmu, Gfn(BASE + g), n, value, &mut cut);
                    in_runs += done;
                    if done == 0 {
                        guest_access(&runs.kvm, &*runs.mmu, v, Gfn(BASE + g), 0, true, value)?;
                        g += 1;
                    }
                    g += done;
                }
                in_window = v.window_writes;
                Ok(())
            })
            .unwrap();
            for ((what, a), (_, b)) in seen(&one, pages).iter().zip(&seen(&runs, pages)) {
                assert!(a == b, "{backing:?}: {what} differs");
            }
            assert!(
                in_runs >= pages * 9 / 10,
                "{backing:?}: {in_runs} writes in runs"
            );
            assert!(
                in_window >= pages * 8 / 10,
                "{backing:?}: {in_window} writes through the window"
            );
        }
    }
}
