//! A VM on the host's `/dev/kvm`, set up the way the lab's scenarios need it: vCPUs already in
//! 64-bit long mode with an identity-mapped guest address space, a small system memslot (slot 0)
//! holding code, mailboxes and page tables, and test memslots added by the caller. It exposes
//! the dirty-logging interfaces (`KVM_GET_DIRTY_LOG`, `KVM_CLEAR_DIRTY_LOG`, dirty rings) with
//! the same shape as the model's VM, so the two can be compared call for call.

use crate::error::KvmError;
use crate::guest::{self, mailbox, GuestProgram, SysLayout, SYNC_PORT};
use crate::mem::HostMemory;
use crate::paging::{GuestPageSize, PageTables};
use crate::ring::{DirtyRing, ENTRY_BYTES};
use kvm_bindings::{
    kvm_clear_dirty_log, kvm_enable_cap, kvm_segment, kvm_userspace_memory_region, CpuId,
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_CAP_NR_MEMSLOTS, KVM_CAP_USER_MEMORY, KVM_DIRTY_LOG_INITIALLY_SET,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_EXIT_DIRTY_RING_FULL, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use vmmu::host::backing::Backing;

/// Request numbers of the ioctls kvm-ioctls has no wrapper for.
mod ioctls {
    use kvm_bindings::kvm_clear_dirty_log;
    vmm_sys_util::ioctl_iowr_nr!(
        KVM_CLEAR_DIRTY_LOG,
        kvm_bindings::KVMIO,
        0xc0,
        kvm_clear_dirty_log
    );
    vmm_sys_util::ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, kvm_bindings::KVMIO, 0xc7);
}
use ioctls::{KVM_CLEAR_DIRTY_LOG, KVM_RESET_DIRTY_RINGS};

/// `KVM_MEM_LOG_DIRTY_PAGES`: the memslot flag that turns dirty logging on.
pub const KVM_MEM_LOG_DIRTY_PAGES: u32 = kvm_bindings::KVM_MEM_LOG_DIRTY_PAGES;

/// Guest physical address where test memory starts (4 GiB, above slot 0 and 1 GiB aligned so
/// every backing source, 1 GiB hugetlb included, can be mapped huge).
pub const TEST_MEM_GPA: u64 = 1 << 32;

/// The memslot id of the system slot (code, mailboxes, page tables). Test memslots use other
/// ids.
pub const SYS_SLOT: u32 = 0;

/// Write-list entries the system slot has room for (one [`KvmVm::run_writes`] call).
pub const WRITE_LIST_CAPACITY: u64 = 4096;

/// How a [`KvmVm`] is set up. Everything that KVM requires before vCPUs exist is here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmSetup {
    /// Number of vCPUs.
    pub vcpus: usize,
    /// `Some(initially_set)`: enable `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` with
    /// `MANUAL_PROTECT_ENABLE`, plus `INITIALLY_SET` when true.
    pub manual_protect: Option<bool>,
    /// Enable per-vCPU dirty rings of this many entries (a power of two, at least 256).
    pub dirty_ring: Option<u32>,
    /// Bytes of guest physical space from [`TEST_MEM_GPA`] the guest can reach (its identity
    /// map); test memslots must lie inside it.
    pub window: u64,
    /// Leaf size of the guest's page tables; `None` picks 1 GiB when the host's CPUID offers
    /// PDPE1GB, else 2 MiB.
    pub page_size: Option<GuestPageSize>,
    /// The program the vCPUs run.
    pub program: GuestProgram,
}

impl Default for VmSetup {
    fn default() -> Self {
        VmSetup {
            vcpus: 1,
            manual_protect: None,
            dirty_ring: None,
            window: 1 << 30,
            page_size: None,
            program: GuestProgram::WriteList,
        }
    }
}

/// A test memslot and the host memory behind it.
#[derive(Debug)]
pub struct Memslot {
    /// Guest physical address.
    pub gpa: u64,
    /// Size in bytes.
    pub size: u64,
    /// `KVM_MEM_*` flags now in force.
    pub flags: u32,
    /// The host memory.
    pub mem: HostMemory,
}

impl Memslot {
    /// 4 KiB pages in the slot.
    pub fn pages(&self) -> u64 {
        self.size / 4096
    }
}

/// One vCPU: its fd and where its mailbox is.
#[derive(Debug)]
pub struct Vcpu {
    /// Index (also the vCPU id).
    pub idx: usize,
    /// The vCPU fd.
    pub fd: VcpuFd,
    /// Guest physical address of the vCPU's mailbox in slot 0.
    pub mailbox: u64,
}

/// What one run to the guest's next `OUT` saw.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// `KVM_RUN` calls.
    pub runs: u64,
    /// `KVM_EXIT_DIRTY_RING_FULL` exits handled.
    pub ring_full_exits: u64,
}

/// A VM on `/dev/kvm`. Fields are public within the crate so a scenario can lend vCPUs to
/// threads while the main thread keeps using the VM fd.
#[derive(Debug)]
pub struct KvmVm {
    // Drop order matters only for tidiness: rings (mmaps of vCPU fds) and vCPU fds first, then
    // the VM fd, then the memory KVM mapped.
    pub(crate) rings: Vec<Mutex<DirtyRing>>,
    pub(crate) vcpus: Vec<Vcpu>,
    pub(crate) vm: VmFd,
    pub(crate) kvm: Kvm,
    pub(crate) sys: HostMemory,
    pub(crate) layout: SysLayout,
    pub(crate) slots: BTreeMap<u32, Memslot>,
    pub(crate) setup: VmSetup,
    pub(crate) page_size: GuestPageSize,
}

/// Raises this process's soft open-file limit towards its hard limit when fewer than `want`
/// descriptors are allowed. Failure is not an error: fd creation then fails with `EMFILE`, whose
/// message says what to do.
fn raise_nofile_limit(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into `lim`, a valid rlimit owned by this frame.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= want {
        return;
    }
    lim.rlim_cur = want.min(lim.rlim_max);
    // SAFETY: setrlimit only reads `lim`; lowering nothing, it raises the soft limit within the
    // hard limit, which any process may do.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
}

/// Opens `/dev/kvm`, turning the usual failures into errors that say what to do.
pub fn open_kvm() -> Result<Kvm, KvmError> {
    Kvm::new().map_err(|e| match e.errno() {
        libc::ENOENT | libc::ENODEV | libc::ENXIO => KvmError::NoKvm,
        libc::EACCES | libc::EPERM => KvmError::PermissionDenied,
        errno => KvmError::Open { errno },
    })
}

/// Host CPU facts the guest setup depends on, from `KVM_GET_SUPPORTED_CPUID`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct CpuFacts {
    /// 1 GiB pages (CPUID 0x80000001 EDX bit 26).
    pub pdpe1gb: bool,
    /// Guest physical address width (CPUID 0x80000008 `EAX[7:0]`).
    pub phys_bits: u32,
}

fn cpu_facts(cpuid: &CpuId) -> CpuFacts {
    let mut f = CpuFacts {
        pdpe1gb: false,
        phys_bits: 36,
    };
    for e in cpuid.as_slice() {
        match e.function {
            0x8000_0001 => f.pdpe1gb = e.edx & (1 << 26) != 0,
            0x8000_0008 if e.eax & 0xff != 0 => f.phys_bits = e.eax & 0xff,
            _ => {}
        }
    }
    f
}

/// Checks a dirty ring size against KVM's rules and the host's maximum (in bytes).
pub fn check_ring_entries(entries: u32, max_bytes: u64) -> Result<(), KvmError> {
    let bytes = entries as u64 * ENTRY_BYTES;
    if !entries.is_power_of_two() || bytes < 4096 || bytes > max_bytes {
        return Err(KvmError::InvalidParams(format!(
            "--dirty-ring {entries}: the ring size must be a power of two between {} and {} entries",
            4096 / ENTRY_BYTES,
            max_bytes / ENTRY_BYTES
        )));
    }
    Ok(())
}

impl KvmVm {
    /// Creates the VM: checks capabilities, enables manual protect and dirty rings (both must
    /// precede vCPU creation, and KVM refuses the ring once a vCPU exists), builds slot 0 and
    /// creates the vCPUs in long mode, ready to run `setup.program`.
    pub fn new(setup: &VmSetup) -> Result<Self, KvmError> {
        if setup.vcpus == 0 {
            return Err(KvmError::InvalidParams(
                "a VM needs at least one vCPU".into(),
            ));
        }
        let kvm = open_kvm()?;
        // Each vCPU costs a vCPU fd and a stats fd: make room for them as the selftests do.
        raise_nofile_limit(2 * setup.vcpus as u64 + 64);
        if kvm.check_extension_raw(KVM_CAP_USER_MEMORY as _) <= 0 {
            return Err(KvmError::MissingCapability {
                name: "KVM_CAP_USER_MEMORY",
                needed_for: "guest memory",
            });
        }
        let max_vcpus = kvm.get_max_vcpus();
        if setup.vcpus > max_vcpus {
            return Err(KvmError::InvalidParams(format!(
                "-v {}: this host's KVM allows at most {max_vcpus} vCPUs per VM",
                setup.vcpus
            )));
        }
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| KvmError::sys("KVM_GET_SUPPORTED_CPUID", e.errno()))?;
        let facts = cpu_facts(&cpuid);
        let page_size = match setup.page_size {
            Some(GuestPageSize::Size1G) if !facts.pdpe1gb => {
                return Err(KvmError::InvalidParams(
                    "1 GiB guest pages were asked for but this host's CPUID lacks PDPE1GB".into(),
                ))
            }
            Some(p) => p,
            None if facts.pdpe1gb => GuestPageSize::Size1G,
            None => GuestPageSize::Size2M,
        };
        let window_end = TEST_MEM_GPA.saturating_add(setup.window);
        if window_end > 1u64 << facts.phys_bits.min(48) {
            return Err(KvmError::InvalidParams(format!(
                "guest memory would end at {window_end:#x}, beyond this host's {}-bit guest physical address space: use less memory",
                facts.phys_bits
            )));
        }

        let vm = kvm
            .create_vm()
            .map_err(|e| KvmError::sys("KVM_CREATE_VM", e.errno()))?;
        if let Some(initially_set) = setup.manual_protect {
            let supported = kvm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 as _);
            let mut want = KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE;
            if initially_set {
                want |= KVM_DIRTY_LOG_INITIALLY_SET;
            }
            if supported <= 0 || (supported as u32 & want) != want {
                return Err(KvmError::MissingCapability {
                    name: if supported > 0 {
                        "KVM_DIRTY_LOG_INITIALLY_SET (of KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)"
                    } else {
                        "KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2"
                    },
                    needed_for: "manual dirty-log protection (the default; -g runs without it)",
                });
            }
            let mut cap = kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                ..Default::default()
            };
            cap.args[0] = want as u64;
            vm.enable_cap(&cap).map_err(|e| {
                KvmError::sys(
                    "KVM_ENABLE_CAP(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2)",
                    e.errno(),
                )
            })?;
        }
        if let Some(entries) = setup.dirty_ring {
            // Prefer the acquire/release flavour: its contract is the one this crate's ring
            // code follows (and it is the only one on weakly ordered hosts).
            let (cap_id, max) = match kvm.check_extension_raw(KVM_CAP_DIRTY_LOG_RING_ACQ_REL as _) {
                n if n > 0 => (KVM_CAP_DIRTY_LOG_RING_ACQ_REL, n as u64),
                _ => (
                    KVM_CAP_DIRTY_LOG_RING,
                    kvm.check_extension_raw(KVM_CAP_DIRTY_LOG_RING as _).max(0) as u64,
                ),
            };
            if max == 0 {
                return Err(KvmError::MissingCapability {
                    name: "KVM_CAP_DIRTY_LOG_RING",
                    needed_for: "--dirty-ring",
                });
            }
            check_ring_entries(entries, max)?;
            let mut cap = kvm_enable_cap {
                cap: cap_id,
                ..Default::default()
            };
            cap.args[0] = entries as u64 * ENTRY_BYTES;
            vm.enable_cap(&cap)
                .map_err(|e| KvmError::sys("KVM_ENABLE_CAP(KVM_CAP_DIRTY_LOG_RING)", e.errno()))?;
        }

        // Slot 0: GDT, code, mailboxes, write list, page tables.
        let ranges_of = |sys_size: u64| [(0, sys_size), (TEST_MEM_GPA, setup.window)];
        // Page tables map slot 0 too, whose size depends on the page tables: size them for a
        // generous slot 0 first (its mapping is a single leaf either way unless it is huge).
        let tables = PageTables::tables_needed(&ranges_of(1 << 30), page_size);
        let layout = SysLayout::new(setup.vcpus, WRITE_LIST_CAPACITY, tables);
        let pt = PageTables::identity_map(
            &ranges_of(layout.size),
            page_size,
            layout.page_tables,
            layout.page_tables_len,
        )?;
        let sys = HostMemory::new(layout.size, Backing::Anonymous)?;
        let mut ok = true;
        for (i, e) in guest::gdt_entries().iter().enumerate() {
            ok &= sys.write_u64(layout.gdt + 8 * i as u64, *e);
        }
        ok &= sys.write_bytes(
            layout.memstress_code,
            &guest::assemble_memstress(layout.memstress_code)?,
        );
        ok &= sys.write_bytes(
            layout.write_list_code,
            &guest::assemble_write_list(layout.write_list_code)?,
        );
        for (gpa, table) in &pt.tables {
            for (i, e) in table.iter().enumerate() {
                ok &= sys.write_u64(gpa + 8 * i as u64, *e);
            }
        }
        if !ok {
            return Err(KvmError::InvalidParams(
                "the system memslot layout does not fit (a bug in vmmu-kvm)".into(),
            ));
        }
        let region = kvm_userspace_memory_region {
            slot: SYS_SLOT,
            flags: 0,
            guest_phys_addr: 0,
            memory_size: sys.len(),
            userspace_addr: sys.as_ptr() as u64,
        };
        // SAFETY: the region is backed by `sys`, which lives in the returned KvmVm as long as
        // the VM fd (fields drop VM before memory), so KVM never maps freed host memory.
        unsafe { vm.set_user_memory_region(region) }
            .map_err(|e| KvmError::sys("KVM_SET_USER_MEMORY_REGION (slot 0)", e.errno()))?;

        let mut vcpus = Vec::with_capacity(setup.vcpus);
        let mut rings = Vec::new();
        for idx in 0..setup.vcpus {
            let fd = vm
                .create_vcpu(idx as u64)
                .map_err(|e| KvmError::sys(format!("KVM_CREATE_VCPU {idx}"), e.errno()))?;
            let mailbox = layout.mailbox(idx);
            init_vcpu(
                &fd,
                &cpuid,
                &layout,
                pt.root,
                layout.entry(setup.program),
                mailbox,
            )
            .map_err(|e| match e {
                KvmError::Sys { op, errno } => KvmError::sys(format!("{op} (vCPU {idx})"), errno),
                e => e,
            })?;
            if let Some(entries) = setup.dirty_ring {
                rings.push(Mutex::new(DirtyRing::map(fd.as_raw_fd(), entries)?));
            }
            vcpus.push(Vcpu { idx, fd, mailbox });
        }
        Ok(KvmVm {
            rings,
            vcpus,
            vm,
            kvm,
            sys,
            layout,
            slots: BTreeMap::new(),
            setup: setup.clone(),
            page_size,
        })
    }

    /// The setup the VM was created with.
    pub fn setup(&self) -> &VmSetup {
        &self.setup
    }

    /// The leaf size of the guest's identity map.
    pub fn guest_page_size(&self) -> GuestPageSize {
        self.page_size
    }

    /// How many memslots this host's KVM allows per address space.
    pub fn max_memslots(&self) -> u64 {
        self.kvm
            .check_extension_raw(KVM_CAP_NR_MEMSLOTS as _)
            .max(0) as u64
    }

    /// Adds test memslot `slot` (not [`SYS_SLOT`]) at `gpa`, `size` bytes of new host memory of
    /// `backing`, with `flags`.
    pub fn add_memslot(
        &mut self,
        slot: u32,
        gpa: u64,
        size: u64,
        backing: Backing,
        flags: u32,
    ) -> Result<(), KvmError> {
        if slot == SYS_SLOT || self.slots.contains_key(&slot) {
            return Err(KvmError::InvalidParams(format!(
                "memslot {slot} is in use (slot {SYS_SLOT} holds the guest's code)"
            )));
        }
        let end = gpa.saturating_add(size);
        if !gpa.is_multiple_of(4096)
            || !size.is_multiple_of(4096)
            || size == 0
            || gpa < TEST_MEM_GPA
            || end > TEST_MEM_GPA + self.setup.window
        {
            return Err(KvmError::InvalidParams(format!(
                "memslot {slot} [{gpa:#x}, {end:#x}) must be page aligned, non-empty and inside the guest's window [{TEST_MEM_GPA:#x}, {:#x})",
                TEST_MEM_GPA + self.setup.window
            )));
        }
        let mem = HostMemory::new(size, backing)?;
        let m = Memslot {
            gpa,
            size,
            flags,
            mem,
        };
        // SAFETY: `m` goes into `self.slots` right below and stays there as long as the VM fd.
        unsafe { set_region(&self.vm, slot, &m, flags) }?;
        self.slots.insert(slot, m);
        Ok(())
    }

    /// Changes the flags of test memslot `slot` (e.g. [`KVM_MEM_LOG_DIRTY_PAGES`] on or off).
    pub fn set_memslot_flags(&mut self, slot: u32, flags: u32) -> Result<(), KvmError> {
        let m = self.slots.get(&slot).ok_or_else(|| no_slot(slot))?;
        // SAFETY: `m` is owned by `self.slots`, which lives as long as the VM fd.
        unsafe { set_region(&self.vm, slot, m, flags) }?;
        if let Some(m) = self.slots.get_mut(&slot) {
            m.flags = flags;
        }
        Ok(())
    }

    /// The test memslot `slot`.
    pub fn memslot(&self, slot: u32) -> Option<&Memslot> {
        self.slots.get(&slot)
    }

    /// `KVM_GET_DIRTY_LOG` on test memslot `slot`: one bit per page.
    pub fn get_dirty_log(&self, slot: u32) -> Result<Vec<u64>, KvmError> {
        let m = self.slots.get(&slot).ok_or_else(|| no_slot(slot))?;
        get_dirty_log(&self.vm, slot, m.size)
    }

    /// `KVM_CLEAR_DIRTY_LOG` on `slot` for pages `[first_page, first_page + num_pages)` with
    /// `bitmap` (bit 0 = `first_page`). KVM's rules (checked by KVM, not here, so a comparison
    /// sees KVM's verdict): `first_page` 64-aligned, `num_pages` a multiple of 64 unless the
    /// range ends at the end of the slot, range inside the slot.
    pub fn clear_dirty_log(
        &self,
        slot: u32,
        first_page: u64,
        num_pages: u64,
        bitmap: &[u64],
    ) -> Result<(), KvmError> {
        clear_dirty_log(&self.vm, slot, first_page, num_pages, bitmap)
    }

    /// Runs vCPU `vcpu` (with the write-list program) until it has stored `value` to each of
    /// `gpas`, in order.
    pub fn run_writes(
        &mut self,
        vcpu: usize,
        gpas: &[u64],
        value: u64,
    ) -> Result<RunStats, KvmError> {
        if self.setup.program != GuestProgram::WriteList {
            return Err(KvmError::InvalidParams(
                "run_writes needs a VM set up with GuestProgram::WriteList".into(),
            ));
        }
        if gpas.len() as u64 > self.layout.write_list_capacity {
            return Err(KvmError::InvalidParams(format!(
                "a write list holds at most {} addresses, not {}",
                self.layout.write_list_capacity,
                gpas.len()
            )));
        }
        let window = TEST_MEM_GPA..TEST_MEM_GPA + self.setup.window;
        if let Some(bad) = gpas.iter().find(|g| !window.contains(*g) || **g % 8 != 0) {
            return Err(KvmError::InvalidParams(format!(
                "guest address {bad:#x} is not 8-byte aligned inside the guest's window [{:#x}, {:#x})",
                window.start, window.end
            )));
        }
        let v = self
            .vcpus
            .get_mut(vcpu)
            .ok_or_else(|| KvmError::InvalidParams(format!("there is no vCPU {vcpu}")))?;
        for (i, g) in gpas.iter().enumerate() {
            self.sys
                .write_u64(self.layout.write_list + 8 * i as u64, *g);
        }
        self.sys
            .write_u64(v.mailbox + mailbox::LIST, self.layout.write_list);
        self.sys
            .write_u64(v.mailbox + mailbox::COUNT, gpas.len() as u64);
        self.sys.write_u64(v.mailbox + mailbox::VALUE, value);
        run_to_sync(v, &self.vm, self.rings.get(vcpu))
    }

    /// The dirty-ring entries of vCPU `vcpu` published since the last harvest, in order, as
    /// `(slot, page offset in slot)`. Entries stay in the ring until
    /// [`KvmVm::reset_dirty_rings`].
    pub fn dirty_ring_harvest(&self, vcpu: usize) -> Result<Vec<(u32, u64)>, KvmError> {
        let ring = self
            .rings
            .get(vcpu)
            .ok_or_else(|| KvmError::InvalidParams(format!("vCPU {vcpu} has no dirty ring")))?;
        Ok(lock(ring).harvest())
    }

    /// `KVM_RESET_DIRTY_RINGS`: recycles harvested entries and write-protects their pages again;
    /// returns how many entries were reset.
    pub fn reset_dirty_rings(&self) -> Result<u64, KvmError> {
        reset_dirty_rings(&self.vm)
    }

    /// Reads the 8-byte word at guest physical address `gpa` of a test memslot through the
    /// host mapping (no guest access, no dirty bit).
    pub fn read_u64(&self, gpa: u64) -> Option<u64> {
        self.slots
            .values()
            .find(|m| (m.gpa..m.gpa + m.size).contains(&gpa))
            .and_then(|m| m.mem.read_u64(gpa - m.gpa))
    }
}

fn no_slot(slot: u32) -> KvmError {
    KvmError::InvalidParams(format!("there is no test memslot {slot}"))
}

/// `KVM_SET_USER_MEMORY_REGION` for test memslot `slot` backed by `m`, with `flags`.
///
/// # Safety
///
/// `m.mem` must stay mapped for as long as the VM behind `vm` may use the slot (in practice:
/// `m` is owned by the same [`KvmVm`] as `vm`). Otherwise the guest could write into whatever
/// host memory is mapped at that address later.
pub(crate) unsafe fn set_region(
    vm: &VmFd,
    slot: u32,
    m: &Memslot,
    flags: u32,
) -> Result<(), KvmError> {
    let region = kvm_userspace_memory_region {
        slot,
        flags,
        guest_phys_addr: m.gpa,
        memory_size: m.size,
        userspace_addr: m.mem.as_ptr() as u64,
    };
    // SAFETY: the caller guarantees the host memory outlives the VM's use of the slot.
    unsafe { vm.set_user_memory_region(region) }.map_err(|e| {
        KvmError::sys(
            format!("KVM_SET_USER_MEMORY_REGION (slot {slot}, flags {flags:#x})"),
            e.errno(),
        )
    })
}

/// Locks a ring, recovering from a poisoned lock (a panicking holder cannot leave the ring in a
/// state that matters here: the indices are updated entry by entry).
pub(crate) fn lock(ring: &Mutex<DirtyRing>) -> std::sync::MutexGuard<'_, DirtyRing> {
    ring.lock().unwrap_or_else(|p| p.into_inner())
}

/// `KVM_GET_DIRTY_LOG` of a slot of `size` bytes.
pub(crate) fn get_dirty_log(vm: &VmFd, slot: u32, size: u64) -> Result<Vec<u64>, KvmError> {
    vm.get_dirty_log(slot, size as usize)
        .map_err(|e| KvmError::sys(format!("KVM_GET_DIRTY_LOG (slot {slot})"), e.errno()))
}

/// `KVM_CLEAR_DIRTY_LOG` (kvm-ioctls has no wrapper for it).
pub(crate) fn clear_dirty_log(
    vm: &VmFd,
    slot: u32,
    first_page: u64,
    num_pages: u64,
    bitmap: &[u64],
) -> Result<(), KvmError> {
    // KVM reads ALIGN(num_pages, 64) / 8 bytes of the bitmap: make sure they exist.
    if (bitmap.len() as u64) < num_pages.div_ceil(64) {
        return Err(KvmError::InvalidParams(format!(
            "KVM_CLEAR_DIRTY_LOG of {num_pages} pages needs a bitmap of {} words, not {}",
            num_pages.div_ceil(64),
            bitmap.len()
        )));
    }
    let num_pages = u32::try_from(num_pages).map_err(|_| {
        KvmError::InvalidParams(format!(
            "KVM_CLEAR_DIRTY_LOG of {num_pages} pages: at most 2^32-1"
        ))
    })?;
    let mut arg = kvm_clear_dirty_log {
        slot,
        num_pages,
        first_page,
        ..Default::default()
    };
    // KVM only reads the bitmap; the pointer is `*mut` because the uapi union shares it with
    // KVM_GET_DIRTY_LOG's output pointer.
    arg.__bindgen_anon_1.dirty_bitmap = bitmap.as_ptr() as *mut libc::c_void;
    // SAFETY: `vm` is a live VM fd, `arg` is a properly initialised kvm_clear_dirty_log whose
    // bitmap pointer covers at least ALIGN(num_pages, 64) bits (checked above) and outlives
    // the call; KVM does not write through it.
    let r = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vm, KVM_CLEAR_DIRTY_LOG(), &arg) };
    if r < 0 {
        return Err(KvmError::last_os(format!(
            "KVM_CLEAR_DIRTY_LOG (slot {slot}, pages {first_page}+{num_pages})"
        )));
    }
    Ok(())
}

/// `KVM_RESET_DIRTY_RINGS` (kvm-ioctls has no wrapper for it).
pub(crate) fn reset_dirty_rings(vm: &VmFd) -> Result<u64, KvmError> {
    // SAFETY: `vm` is a live VM fd; the ioctl takes no argument and returns a count or -1.
    let r = unsafe { vmm_sys_util::ioctl::ioctl(vm, KVM_RESET_DIRTY_RINGS()) };
    if r < 0 {
        return Err(KvmError::last_os("KVM_RESET_DIRTY_RINGS"));
    }
    Ok(r as u64)
}

/// Puts a new vCPU straight into 64-bit mode at `entry` with RDI = its mailbox.
fn init_vcpu(
    fd: &VcpuFd,
    cpuid: &CpuId,
    layout: &SysLayout,
    cr3: u64,
    entry: u64,
    mailbox: u64,
) -> Result<(), KvmError> {
    // The guest CPUID must be set before EFER.LME: KVM checks EFER against guest CPUID (LM),
    // and 1 GiB guest pages need PDPE1GB there too.
    fd.set_cpuid2(cpuid)
        .map_err(|e| KvmError::sys("KVM_SET_CPUID2", e.errno()))?;
    let mut s = fd
        .get_sregs()
        .map_err(|e| KvmError::sys("KVM_GET_SREGS", e.errno()))?;
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0xb,
        present: 1,
        dpl: 0,
        db: 0,
        s: 1,
        l: 1,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0x3,
        db: 1,
        l: 0,
        ..code
    };
    let tss = kvm_segment {
        selector: 0x18,
        limit: 0x67,
        type_: 0xb,
        s: 0,
        l: 0,
        g: 0,
        ..code
    };
    s.cs = code;
    s.ds = data;
    s.es = data;
    s.ss = data;
    s.fs = data;
    s.gs = data;
    s.tr = tss;
    s.gdt.base = layout.gdt;
    s.gdt.limit = (guest::gdt_entries().len() * 8 - 1) as u16;
    s.cr3 = cr3;
    s.cr4 = 1 << 5; // PAE
    s.cr0 = 0x8005_0033; // PG | AM | WP | NE | ET | MP | PE
    s.efer = (1 << 8) | (1 << 10); // LME | LMA
    fd.set_sregs(&s)
        .map_err(|e| KvmError::sys("KVM_SET_SREGS", e.errno()))?;
    let mut r = fd
        .get_regs()
        .map_err(|e| KvmError::sys("KVM_GET_REGS", e.errno()))?;
    r.rip = entry;
    r.rdi = mailbox;
    r.rsp = 0;
    r.rflags = 0x2;
    fd.set_regs(&r)
        .map_err(|e| KvmError::sys("KVM_SET_REGS", e.errno()))
}

/// Runs a vCPU until the guest's next `OUT` to [`SYNC_PORT`].
///
/// A full dirty ring (`KVM_EXIT_DIRTY_RING_FULL`) is handled here: the vCPU's own ring is
/// collected (entries kept for the next harvest) and `KVM_RESET_DIRTY_RINGS` issued, then the
/// guest resumes. Only this vCPU's thread and the harvesting thread touch the ring, under its
/// mutex; the reset is VM-wide but recycles only entries already marked harvested.
pub fn run_to_sync(
    vcpu: &mut Vcpu,
    vm: &VmFd,
    ring: Option<&Mutex<DirtyRing>>,
) -> Result<RunStats, KvmError> {
    let mut stats = RunStats::default();
    loop {
        stats.runs += 1;
        let exit = match vcpu.fd.run() {
            Ok(VcpuExit::IoOut(port, _)) if port == SYNC_PORT => return Ok(stats),
            Ok(VcpuExit::Unsupported(r)) if r == KVM_EXIT_DIRTY_RING_FULL => {
                let ring = ring.ok_or_else(|| KvmError::Guest {
                    vcpu: vcpu.idx,
                    what: "KVM reported a full dirty ring but no ring is enabled".into(),
                })?;
                {
                    let mut r = lock(ring);
                    r.collect();
                    r.full_exits += 1;
                }
                reset_dirty_rings(vm)?;
                stats.ring_full_exits += 1;
                continue;
            }
            Ok(VcpuExit::Intr) => continue,
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
            Err(e) => {
                return Err(KvmError::sys(
                    format!("KVM_RUN (vCPU {})", vcpu.idx),
                    e.errno(),
                ))
            }
            Ok(VcpuExit::Shutdown) => "the guest shut down (triple fault)".to_string(),
            Ok(VcpuExit::InternalError) => {
                "KVM internal error (often an instruction its emulator cannot handle)".to_string()
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                format!("VM entry failed (reason {reason:#x}, cpu {cpu})")
            }
            Ok(VcpuExit::Hlt) => "the guest halted".to_string(),
            Ok(VcpuExit::IoOut(port, _)) => format!("unexpected OUT to port {port:#x}"),
            Ok(VcpuExit::IoIn(port, _)) => format!("unexpected IN from port {port:#x}"),
            Ok(VcpuExit::MmioRead(addr, _)) | Ok(VcpuExit::MmioWrite(addr, _)) => {
                format!("guest access to {addr:#x}, which no memslot backs")
            }
            Ok(other) => format!("unexpected exit {other:?}"),
        };
        let rip = vcpu
            .fd
            .get_regs()
            .map(|r| format!(" at rip {:#x}", r.rip))
            .unwrap_or_default();
        return Err(KvmError::Guest {
            vcpu: vcpu.idx,
            what: format!("{exit}{rip}"),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_sizes_follow_kvm_rules() {
        assert!(check_ring_entries(256, 1 << 20).is_ok());
        assert!(check_ring_entries(65536, 1 << 20).is_ok());
        for bad in [0, 100, 128, 65537, 131072] {
            let e = check_ring_entries(bad, 1 << 20).unwrap_err().to_string();
            assert!(e.contains("power of two between 256 and 65536"), "{e}");
        }
    }
}
