//! The guest's own x86-64 4-level page tables, as KVM's shadow paging (`ept=N`) sees them.
//!
//! With shadow paging the guest maps its virtual addresses with page tables it keeps in its own
//! memory, and KVM walks those tables in software on every fault (`paging_tmpl.h`, instantiated
//! with `PTTYPE == 64`). This module holds that walk ([`walk_addr`], KVM's
//! `FNAME(walk_addr_generic)`), the helpers it is made of, the [`GuestMemory`] it reads, and a
//! [`GuestPageTableBuilder`] that writes tables into guest memory from the host side the way the
//! KVM selftests' `virt_map()` does before a guest runs.
//!
//! The guest modelled here is the one KVM's selftests run: 64-bit mode with 4-level paging,
//! supervisor data accesses with `CR0.WP = 1` and `EFER.NX = 1`, 1 GiB pages supported, no
//! SMEP, SMAP or protection keys, and a 52-bit guest physical address width (so no address bit
//! of a gpte is reserved).

use crate::kvm::Kvm;
use crate::units::{Gfn, Gpa, PAGE_SHIFT, PAGE_SIZE};
use crate::x86::spte::{Level, X86Level, PG_LEVEL_4K, PT64_ROOT_4LEVEL};
use crossbeam_epoch as epoch;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bits of a guest x86-64 page-table entry (a "gpte"), named as KVM's `mmu.h`/`paging_tmpl.h`
/// name them. They live in their own module because `crate::x86::spte` uses some of the same KVM
/// names (`PT_WRITABLE_MASK`, `PT_PAGE_SIZE_MASK`) for the EPT-format SPTE.
pub mod gpte {
    use crate::units::{PAGE_SHIFT, PAGE_SIZE};
    use crate::x86::spte::{Level, SPTE_ENT_PER_PAGE};

    /// `PT_PRESENT_MASK`: the entry is present.
    pub const PT_PRESENT_MASK: u64 = 1 << 0;
    /// `PT_WRITABLE_SHIFT`.
    pub const PT_WRITABLE_SHIFT: u32 = 1;
    /// `PT_WRITABLE_MASK`: writes are allowed through this entry.
    pub const PT_WRITABLE_MASK: u64 = 1 << PT_WRITABLE_SHIFT;
    /// `PT_USER_MASK`: user-mode accesses are allowed through this entry.
    pub const PT_USER_MASK: u64 = 1 << 2;
    /// `PT_ACCESSED_SHIFT`.
    pub const PT_ACCESSED_SHIFT: u32 = 5;
    /// `PT_ACCESSED_MASK`: set by the walker the first time the entry is used.
    pub const PT_ACCESSED_MASK: u64 = 1 << PT_ACCESSED_SHIFT;
    /// `PT_DIRTY_SHIFT`.
    pub const PT_DIRTY_SHIFT: u32 = 6;
    /// `PT_DIRTY_MASK`: set in a leaf by the walker the first time the page is written.
    pub const PT_DIRTY_MASK: u64 = 1 << PT_DIRTY_SHIFT;
    /// `PT_PAGE_SIZE_MASK`: a leaf above 4K (PS).
    pub const PT_PAGE_SIZE_MASK: u64 = 1 << 7;
    /// `PT64_NX_SHIFT`.
    pub const PT64_NX_SHIFT: u32 = 63;
    /// `PT64_NX_MASK`: instruction fetches are not allowed through this entry.
    pub const PT64_NX_MASK: u64 = 1 << PT64_NX_SHIFT;
    /// `GUEST_PT64_BASE_ADDR_MASK`: the physical-address field, bits 12..51.
    pub const GUEST_PT64_BASE_ADDR_MASK: u64 = ((1 << 52) - 1) & !(PAGE_SIZE - 1);

    /// `PT64_LVL_ADDR_MASK(level)`: the address bits a leaf at `level` holds (a 2M leaf's
    /// address is 2 MiB aligned, so bits 12..20 are not part of it).
    pub const fn pt64_lvl_addr_mask(level: Level) -> u64 {
        GUEST_PT64_BASE_ADDR_MASK & !((1 << (PAGE_SHIFT + (level.0 as u32 - 1) * 9)) - 1)
    }

    /// `PT64_LVL_OFFSET_MASK(level)`: the bits of an address above the 4K offset that select a
    /// 4K page inside a leaf at `level`.
    pub const fn pt64_lvl_offset_mask(level: Level) -> u64 {
        GUEST_PT64_BASE_ADDR_MASK & ((1 << (PAGE_SHIFT + (level.0 as u32 - 1) * 9)) - 1)
    }

    /// `PT64_INDEX(addr, level)`: the index of `addr`'s entry in a table at `level`.
    pub const fn pt64_index(addr: u64, level: Level) -> usize {
        ((addr >> (PAGE_SHIFT + (level.0 as u32 - 1) * 9)) & (SPTE_ENT_PER_PAGE as u64 - 1))
            as usize
    }
}

use gpte::*;

/// `ACC_EXEC_MASK`: instruction fetches allowed.
pub const ACC_EXEC_MASK: u8 = 1;
/// `ACC_WRITE_MASK`: writes allowed (the same bit as the gpte's `PT_WRITABLE_MASK`).
pub const ACC_WRITE_MASK: u8 = PT_WRITABLE_MASK as u8;
/// `ACC_USER_MASK`: user-mode accesses allowed (the same bit as the gpte's `PT_USER_MASK`).
pub const ACC_USER_MASK: u8 = PT_USER_MASK as u8;
/// `ACC_ALL`.
pub const ACC_ALL: u8 = ACC_EXEC_MASK | ACC_WRITE_MASK | ACC_USER_MASK;

// gpte_access() turns gpte bits into ACC_* bits by masking, which only works while these line up
// (KVM's BUILD_BUG_ONs).
const _: () = assert!(ACC_EXEC_MASK as u64 == PT_PRESENT_MASK);
const _: () = assert!(ACC_WRITE_MASK as u64 == PT_WRITABLE_MASK);
const _: () = assert!(ACC_USER_MASK as u64 == PT_USER_MASK);

/// `PFERR_PRESENT_MASK`: the #PF was a protection violation, not a missing translation.
pub const PFERR_PRESENT_MASK: u64 = 1 << 0;
/// `PFERR_WRITE_MASK`: the faulting access was a write.
pub const PFERR_WRITE_MASK: u64 = 1 << 1;
/// `PFERR_USER_MASK`: the faulting access came from user mode.
pub const PFERR_USER_MASK: u64 = 1 << 2;
/// `PFERR_RSVD_MASK`: a reserved bit was set in a paging-structure entry.
pub const PFERR_RSVD_MASK: u64 = 1 << 3;

/// Guest memory as the walker reaches it: 8-byte words at guest physical addresses. KVM reads
/// gptes with `__get_user()` through the memslot's host mapping and updates A/D bits with
/// `__try_cmpxchg_user()`.
///
/// Every `gpa` must be 8-byte aligned (a caller bug otherwise); its offset in the page selects
/// word `offset / 8` of the page. Methods return `None` when the word is not in guest memory.
pub trait GuestMemory {
    /// Reads the word at `gpa`.
    fn read_gpa_u64(&self, gpa: Gpa) -> Option<u64>;

    /// Writes `val` to the word at `gpa`.
    fn write_gpa_u64(&self, gpa: Gpa, val: u64) -> Option<()>;

    /// Replaces the word at `gpa` with `new` if it still holds `old`: `Ok(old)` when it did,
    /// `Err(current)` when someone changed it first (as `AtomicU64::compare_exchange`).
    ///
    /// [`walk_addr`] calls this only to set A/D bits in a gpte. KVM follows each successful one
    /// with `kvm_vcpu_mark_page_dirty()` on the table's gfn; an implementation that models dirty
    /// logging for a vCPU does that here.
    fn cmpxchg_gpa_u64(&self, gpa: Gpa, old: u64, new: u64) -> Option<Result<u64, u64>>;
}

/// The host word behind `gpa`: the memslot holding it (looked up under an epoch guard, as KVM
/// looks memslots up under SRCU), its host frame, and the word the offset selects. `None` when no
/// memslot holds `gpa`, or when its slot's region keeps fewer words per page than the offset
/// needs (a slot backed with one word per page only has the page's first 8 bytes). A `write`
/// makes the host page the page's own first ([`HostMemory::host_write`]).
///
/// [`HostMemory::host_write`]: crate::host::memory::HostMemory::host_write
fn kvm_gpa_word(kvm: &Kvm, gpa: Gpa, write: bool) -> Option<&AtomicU64> {
    assert!(
        gpa.0.is_multiple_of(8),
        "guest memory word at unaligned {gpa:?}"
    );
    let gfn = gpa.to_gfn();
    let pfn = {
        let guard = epoch::pin();
        kvm.gfn_to_memslot(gfn, &guard)?.gfn_to_pfn(gfn)
    };
    // Host regions are never freed, so the word outlives the guard that found its slot.
    let index = (gpa.0 & (PAGE_SIZE - 1)) / 8;
    if index >= kvm.host.words_per_page(pfn) {
        return None;
    }
    if write {
        kvm.host.host_write(pfn);
    }
    Some(kvm.host.page_word(pfn, index))
}

/// The VM's memory as KVM reaches it from the host. Loads and stores are acquire/release and the
/// exchange is sequentially consistent, as x86 orders plain accesses and locked instructions.
/// Memslot flags (`KVM_MEM_READONLY`, dirty logging) play no part: this is the host's view.
impl GuestMemory for Kvm {
    fn read_gpa_u64(&self, gpa: Gpa) -> Option<u64> {
        Some(kvm_gpa_word(self, gpa, false)?.load(Ordering::Acquire))
    }

    fn write_gpa_u64(&self, gpa: Gpa, val: u64) -> Option<()> {
        kvm_gpa_word(self, gpa, true)?.store(val, Ordering::Release);
        Some(())
    }

    fn cmpxchg_gpa_u64(&self, gpa: Gpa, old: u64, new: u64) -> Option<Result<u64, u64>> {
        Some(kvm_gpa_word(self, gpa, true)?.compare_exchange(
            old,
            new,
            Ordering::SeqCst,
            Ordering::SeqCst,
        ))
    }
}

/// `FNAME(is_present_gpte)` for 64-bit paging.
pub fn is_present_gpte(gpte: u64) -> bool {
    Pt64.is_present(gpte)
}

/// `FNAME(gpte_to_gfn_lvl)`: the frame a gpte at `level` points to (for a leaf above 4K, the
/// first frame of the huge page). The address field is the same in 64-bit and EPT entries.
pub fn gpte_to_gfn_lvl(gpte: u64, level: Level) -> Gfn {
    Gfn((gpte & pt64_lvl_addr_mask(level)) >> PAGE_SHIFT)
}

/// `FNAME(gpte_access)` for 64-bit paging.
pub fn gpte_access(gpte: u64) -> u8 {
    Pt64.access(gpte)
}

/// `FNAME(protect_clean_gpte)` for 64-bit paging.
pub fn protect_clean_gpte(access: &mut u8, gpte: u64) {
    Pt64.protect_clean_gpte(access, gpte)
}

/// What differs between the guest page-table formats KVM walks: `paging_tmpl.h` is compiled
/// once per `PTTYPE` (64-bit paging, and `PTTYPE_EPT` for an L1 hypervisor's EPT12 tables), and
/// these are its per-type macros and `FNAME()` helpers.
pub trait PtType {
    /// `PT_GUEST_ACCESSED_MASK`, or 0 when the tables have no A/D bits (EPT without EPTP bit 6:
    /// `PT_HAVE_ACCESSED_DIRTY()` is false).
    fn accessed_mask(&self) -> u64;
    /// `PT_GUEST_DIRTY_MASK`, or 0 without A/D bits.
    fn dirty_mask(&self) -> u64;
    /// The walk's `walk_nx_mask`: a bit that forbids rather than allows, inverted while
    /// permissions are ANDed down the walk (NX for 64-bit paging; none for EPT).
    fn walk_nx_mask(&self) -> u64;
    /// `FNAME(is_present_gpte)`.
    fn is_present(&self, gpte: u64) -> bool;
    /// `FNAME(gpte_access)`: the `ACC_*` bits a gpte grants (with the NX bit already inverted
    /// for 64-bit paging).
    fn access(&self, gpte: u64) -> u8;
    /// `FNAME(is_last_gpte)`.
    fn is_last(&self, level: Level, gpte: u64) -> bool;
    /// `FNAME(is_rsvd_bits_set)` (and EPT's `FNAME(is_bad_mt_xwr)`).
    fn is_rsvd_bits_set(&self, gpte: u64, level: Level) -> bool;
    /// Whether `access` allows the data access (`permission_fault()` for a supervisor data
    /// access: a write needs W; with EPT a read needs R, which `gpte_access` reports as
    /// `ACC_USER_MASK`).
    fn allows(&self, access: u8, write: bool) -> bool;

    /// `FNAME(protect_clean_gpte)`: without D in the gpte, drop `ACC_WRITE_MASK`, so that the
    /// shadow page is mapped read-only and the guest's first write faults into KVM, which sets
    /// D. Nothing to do for tables without A/D bits.
    fn protect_clean_gpte(&self, access: &mut u8, gpte: u64) {
        let dirty = self.dirty_mask();
        if dirty == 0 {
            return;
        }
        if gpte & dirty == 0 {
            *access &= !ACC_WRITE_MASK;
        }
    }
}

/// `PTTYPE == 64`: the guest's own 4-level x86-64 tables (shadow paging).
#[derive(Copy, Clone, Debug, Default)]
pub struct Pt64;

impl PtType for Pt64 {
    fn accessed_mask(&self) -> u64 {
        PT_ACCESSED_MASK
    }
    fn dirty_mask(&self) -> u64 {
        PT_DIRTY_MASK
    }
    fn walk_nx_mask(&self) -> u64 {
        PT64_NX_MASK
    }
    fn is_present(&self, gpte: u64) -> bool {
        gpte & PT_PRESENT_MASK != 0
    }
    /// P becomes `ACC_EXEC_MASK` unless NX is set, which the XOR takes away.
    fn access(&self, gpte: u64) -> u8 {
        let access = gpte & (PT_WRITABLE_MASK | PT_USER_MASK | PT_PRESENT_MASK);
        (access ^ (gpte >> PT64_NX_SHIFT)) as u8
    }
    /// A 4K entry, or PS above it, ends the walk.
    fn is_last(&self, level: Level, gpte: u64) -> bool {
        level == PG_LEVEL_4K || gpte & PT_PAGE_SIZE_MASK != 0
    }
    /// PS is reserved in a PML4E, and a huge leaf's address must be aligned to its size (the
    /// bits below it, except PAT in bit 12, are reserved).
    fn is_rsvd_bits_set(&self, gpte: u64, level: Level) -> bool {
        let rsvd = match level.0 {
            4 => PT_PAGE_SIZE_MASK,
            2 | 3 if gpte & PT_PAGE_SIZE_MASK != 0 => {
                pt64_lvl_offset_mask(level) & !(1 << PAGE_SHIFT)
            }
            _ => 0,
        };
        gpte & rsvd != 0
    }
    /// With CR0.WP=1 only writes can be refused.
    fn allows(&self, access: u8, write: bool) -> bool {
        !write || access & ACC_WRITE_MASK != 0
    }
}

/// Bits of an EPT entry as an L1 hypervisor writes them in its EPT12 tables (`vmx.h`'s
/// `VMX_EPT_*` names).
pub mod ept {
    /// `VMX_EPT_READABLE_MASK`.
    pub const VMX_EPT_READABLE_MASK: u64 = 1 << 0;
    /// `VMX_EPT_WRITABLE_MASK`.
    pub const VMX_EPT_WRITABLE_MASK: u64 = 1 << 1;
    /// `VMX_EPT_EXECUTABLE_MASK`.
    pub const VMX_EPT_EXECUTABLE_MASK: u64 = 1 << 2;
    /// `VMX_EPT_RWX_MASK`: any of them makes the entry present (`FNAME(is_present_gpte)`).
    pub const VMX_EPT_RWX_MASK: u64 = 7;
    /// `PT_PAGE_SIZE_MASK` in an EPT entry: a leaf above 4K.
    pub const EPT_PAGE_SIZE_MASK: u64 = 1 << 7;
    /// `VMX_EPT_ACCESS_BIT`.
    pub const VMX_EPT_ACCESS_BIT: u64 = 1 << 8;
    /// `VMX_EPT_DIRTY_BIT`.
    pub const VMX_EPT_DIRTY_BIT: u64 = 1 << 9;
    /// `VMX_EPTP_AD_ENABLE_BIT`: the EPTP enables A/D bits in the tables it points to.
    pub const VMX_EPTP_AD_ENABLE_BIT: u64 = 1 << 6;
    /// `VMX_EPTP_PWL_4`: a 4-level walk (bits 5:3 hold levels − 1).
    pub const VMX_EPTP_PWL_4: u64 = 3 << 3;
    /// `VMX_EPTP_MT_WB`: write-back paging-structure memory type.
    pub const VMX_EPTP_MT_WB: u64 = 6;
    /// The memory type field of a leaf (bits 5:3), write-back (6): what KVM as L1 writes.
    pub const EPT_LEAF_MT_WB: u64 = 6 << 3;
}

/// `PTTYPE == PTTYPE_EPT`: an L1 hypervisor's EPT12 tables, walked by KVM to shadow them as
/// EPT02 (nested EPT). `ad` is EPTP bit 6 (and the host's support for EPT A/D).
#[derive(Copy, Clone, Debug, Default)]
pub struct PtEpt {
    /// A/D bits are on in the tables (`!role.ad_disabled`).
    pub ad: bool,
}

impl PtType for PtEpt {
    fn accessed_mask(&self) -> u64 {
        if self.ad {
            ept::VMX_EPT_ACCESS_BIT
        } else {
            0
        }
    }
    fn dirty_mask(&self) -> u64 {
        if self.ad {
            ept::VMX_EPT_DIRTY_BIT
        } else {
            0
        }
    }
    fn walk_nx_mask(&self) -> u64 {
        0
    }
    fn is_present(&self, gpte: u64) -> bool {
        gpte & ept::VMX_EPT_RWX_MASK != 0
    }
    /// W grants `ACC_WRITE_MASK`, X `ACC_EXEC_MASK`, and R `ACC_USER_MASK` ("readable").
    fn access(&self, gpte: u64) -> u8 {
        let mut a = 0;
        if gpte & ept::VMX_EPT_WRITABLE_MASK != 0 {
            a |= ACC_WRITE_MASK;
        }
        if gpte & ept::VMX_EPT_EXECUTABLE_MASK != 0 {
            a |= ACC_EXEC_MASK;
        }
        if gpte & ept::VMX_EPT_READABLE_MASK != 0 {
            a |= ACC_USER_MASK;
        }
        a
    }
    fn is_last(&self, level: Level, gpte: u64) -> bool {
        level == PG_LEVEL_4K || gpte & ept::EPT_PAGE_SIZE_MASK != 0
    }
    /// Simplified from `reset_rsvds_bits_mask_ept()`: PS in a level-4 entry, a misaligned huge
    /// leaf, and `FNAME(is_bad_mt_xwr)`'s write-only and write-execute-only permissions (the
    /// execute-only case needs `execonly`, which the modelled CPU has). Memory types are not
    /// checked: L1 always writes write-back.
    fn is_rsvd_bits_set(&self, gpte: u64, level: Level) -> bool {
        let xwr = gpte & ept::VMX_EPT_RWX_MASK;
        if xwr == ept::VMX_EPT_WRITABLE_MASK
            || xwr == ept::VMX_EPT_WRITABLE_MASK | ept::VMX_EPT_EXECUTABLE_MASK
        {
            return true;
        }
        match level.0 {
            4 => gpte & ept::EPT_PAGE_SIZE_MASK != 0,
            2 | 3 if gpte & ept::EPT_PAGE_SIZE_MASK != 0 => gpte & pt64_lvl_offset_mask(level) != 0,
            _ => false,
        }
    }
    fn allows(&self, access: u8, write: bool) -> bool {
        if write {
            access & ACC_WRITE_MASK != 0
        } else {
            access & ACC_USER_MASK != 0
        }
    }
}

/// Why a guest walk faulted.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GuestFaultCause {
    /// The gpte at the fault's level is not present.
    NotPresent,
    /// The translation exists but does not allow the access (a write to a read-only mapping).
    Protection,
    /// The gpte at the fault's level sets a reserved bit.
    Reserved,
    /// The gpte's address is not in guest memory (KVM's `kvm_is_error_hva()` on the table, which
    /// it reports to the guest as a not-present fault).
    NotInMemory(Gpa),
}

/// A guest page fault: what KVM injects (`struct x86_exception` for `PF_VECTOR`) when its walk of
/// the guest's tables fails.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GuestPageFault {
    /// The faulting virtual address (what the guest sees in CR2).
    pub address: u64,
    /// The access was a write.
    pub write: bool,
    /// A translation was there (protection or reserved-bit fault) rather than missing.
    pub present: bool,
    /// The level of the gpte that decided the fault.
    pub level: Level,
    /// Why.
    pub cause: GuestFaultCause,
}

impl GuestPageFault {
    fn new(address: u64, write: bool, level: Level, cause: GuestFaultCause) -> Self {
        let present = matches!(
            cause,
            GuestFaultCause::Protection | GuestFaultCause::Reserved
        );
        GuestPageFault {
            address,
            write,
            present,
            level,
            cause,
        }
    }

    /// The #PF error code (`PFERR_*` bits) the guest receives.
    pub fn error_code(&self) -> u64 {
        let mut code = 0;
        if self.present {
            code |= PFERR_PRESENT_MASK;
        }
        if self.write {
            code |= PFERR_WRITE_MASK;
        }
        if self.cause == GuestFaultCause::Reserved {
            code |= PFERR_RSVD_MASK;
        }
        code
    }
}

impl fmt::Display for GuestPageFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let access = if self.write { "write" } else { "read" };
        write!(
            f,
            "guest page fault on a {access} of gva {:#x}: ",
            self.address
        )?;
        let level = self.level.0;
        match self.cause {
            GuestFaultCause::NotPresent => write!(f, "the level-{level} gpte is not present"),
            GuestFaultCause::Protection => write!(f, "the mapping is not writable"),
            GuestFaultCause::Reserved => write!(f, "the level-{level} gpte sets a reserved bit"),
            GuestFaultCause::NotInMemory(gpa) => write!(
                f,
                "the level-{level} gpte at gpa {:#x} is not in guest memory (no memslot, or one \
                 that keeps only the first word of each page)",
                gpa.0
            ),
        }
    }
}

impl std::error::Error for GuestPageFault {}

/// The result of a successful walk (`struct guest_walker`). The arrays are indexed by level
/// (index 0 is unused, as are the levels below [`GuestWalker::level`]); KVM indexes them by
/// `level - 1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestWalker {
    /// The leaf's level: `PG_LEVEL_4K`, or 2 or 3 for a 2M or 1G page.
    pub level: Level,
    /// The level the walk started at (4).
    pub max_level: Level,
    /// `table_gfn[l]`: the guest table read at level `l` (`table_gfn[4]` is CR3's frame).
    pub table_gfn: [Gfn; 5],
    /// `ptes[l]`: the gpte read at level `l`, with the A/D bits this walk set.
    pub ptes: [u64; 5],
    /// `pte_gpa[l]`: where `ptes[l]` lives in guest memory.
    pub pte_gpa: [Gpa; 5],
    /// `pt_access[l]`: the `ACC_*` bits the levels above `l` allow together (W only if every
    /// one of them is writable, exec only if none sets NX, user only if all do).
    pub pt_access: [u8; 5],
    /// The `ACC_*` bits the whole walk allows, leaf included; on a read, without W while the
    /// leaf is clean ([`protect_clean_gpte`]).
    pub pte_access: u8,
    /// The target frame: the leaf's frame plus, for a huge leaf, the gva's 4K page inside it.
    pub gfn: Gfn,
    /// How many times a gpte changed under the walk's A/D update and the walk started over.
    pub retries: u32,
    /// How many gptes the walk updated with A/D bits (across all its attempts).
    pub ad_writes: u32,
}

/// `FNAME(walk_addr_generic)` for 4-level paging: translates `gva` through the guest tables at
/// `cr3` for a read or a `write`, setting the guest's A bits along the way and D in the leaf on a
/// write (`FNAME(update_accessed_dirty_bits)`). When a gpte changes between the read and its A/D
/// update, the whole walk starts over (KVM's `goto retry_walk`). Every gpte read is counted in
/// `guest_pte_reads`, retries included.
///
/// The gva's bits 12..47 select the entries; hardware has refused a non-canonical address with a
/// #GP before any walk.
pub fn walk_addr<M: GuestMemory + ?Sized>(
    mem: &M,
    cr3: Gpa,
    gva: u64,
    write: bool,
    guest_pte_reads: &mut u64,
) -> Result<GuestWalker, GuestPageFault> {
    walk_addr_generic(mem, &Pt64, cr3.0, gva, write, guest_pte_reads)
}

/// `FNAME(walk_addr_nested)` for `PTTYPE_EPT`: translates the L2 guest physical address `gpa`
/// through the L1 hypervisor's 4-level EPT12 tables at `eptp` (an EPTP: root address, walk
/// length, A/D enable), as [`walk_addr`] does for 64-bit paging. The walker's frames are L1 guest
/// frames.
pub fn walk_addr_ept<M: GuestMemory + ?Sized>(
    mem: &M,
    eptp: u64,
    gpa: u64,
    write: bool,
    guest_pte_reads: &mut u64,
) -> Result<GuestWalker, GuestPageFault> {
    let pt = PtEpt {
        ad: eptp & ept::VMX_EPTP_AD_ENABLE_BIT != 0,
    };
    walk_addr_generic(mem, &pt, eptp, gpa, write, guest_pte_reads)
}

/// `FNAME(walk_addr_generic)` for the format `pt`, from the root pointer `root` (CR3 or EPTP,
/// whose address field points at the root table the way a gpte points at the next one).
fn walk_addr_generic<M: GuestMemory + ?Sized, P: PtType>(
    mem: &M,
    pt: &P,
    root: u64,
    addr: u64,
    write: bool,
    guest_pte_reads: &mut u64,
) -> Result<GuestWalker, GuestPageFault> {
    let mut retries = 0;
    let mut ad_writes = 0;
    loop {
        if let Some(mut walker) =
            walk_once(mem, pt, root, addr, write, guest_pte_reads, &mut ad_writes)?
        {
            walker.retries = retries;
            walker.ad_writes = ad_writes;
            return Ok(walker);
        }
        retries += 1;
    }
}

/// One attempt of [`walk_addr_generic`]: `Ok(None)` asks for a retry.
fn walk_once<M: GuestMemory + ?Sized, P: PtType>(
    mem: &M,
    pt: &P,
    root: u64,
    addr: u64,
    write: bool,
    guest_pte_reads: &mut u64,
    ad_writes: &mut u32,
) -> Result<Option<GuestWalker>, GuestPageFault> {
    let fault = |level, cause| GuestPageFault::new(addr, write, level, cause);
    let mut w = GuestWalker {
        level: PT64_ROOT_4LEVEL,
        max_level: PT64_ROOT_4LEVEL,
        table_gfn: [Gfn(0); 5],
        ptes: [0; 5],
        pte_gpa: [Gpa(0); 5],
        pt_access: [0; 5],
        pte_access: 0,
        gfn: Gfn(0),
        retries: 0,
        ad_writes: 0,
    };
    let nx = pt.walk_nx_mask();
    let mut pte = root;
    // Permissions are ANDed down the walk in gpte form, with NX inverted so that it ANDs like the
    // other bits.
    let mut pte_access = !0u64;
    // The accessed bit ANDs down the walk too: it stays set only if every level has it (zero
    // from the start for tables without A/D bits, which then need no update).
    let mut accessed_dirty = pt.accessed_mask();
    let mut level = PT64_ROOT_4LEVEL.0 + 1;
    loop {
        let pt_access = pte_access;
        level -= 1;
        let lvl = Level(level);
        let l = level as usize;
        let table_gfn = gpte_to_gfn_lvl(pte, PG_LEVEL_4K);
        let pte_gpa = table_gfn.to_gpa() + pt64_index(addr, lvl) as u64 * 8;
        w.level = lvl;
        w.table_gfn[l] = table_gfn;
        w.pte_gpa[l] = pte_gpa;
        *guest_pte_reads += 1;
        pte = mem
            .read_gpa_u64(pte_gpa)
            .ok_or_else(|| fault(lvl, GuestFaultCause::NotInMemory(pte_gpa)))?;
        pte_access = pt_access & (pte ^ nx);
        if !pt.is_present(pte) {
            return Err(fault(lvl, GuestFaultCause::NotPresent));
        }
        if pt.is_rsvd_bits_set(pte, lvl) {
            return Err(fault(lvl, GuestFaultCause::Reserved));
        }
        accessed_dirty &= pte;
        w.ptes[l] = pte;
        w.pt_access[l] = pt.access(pt_access ^ nx);
        if pt.is_last(lvl, pte) {
            break;
        }
    }
    let lvl = w.level;
    w.pte_access = pt.access(pte_access ^ nx);
    if !pt.allows(w.pte_access, write) {
        return Err(fault(lvl, GuestFaultCause::Protection));
    }
    w.gfn = Gfn(gpte_to_gfn_lvl(pte, lvl).0 + ((addr & pt64_lvl_offset_mask(lvl)) >> PAGE_SHIFT));
    if !write {
        pt.protect_clean_gpte(&mut w.pte_access, pte);
    } else if pt.dirty_mask() != 0 {
        // A write also needs D in the leaf before the walk can skip the update.
        let shift = pt.dirty_mask().trailing_zeros() - pt.accessed_mask().trailing_zeros();
        accessed_dirty &= pte >> shift;
    }
    if pt.accessed_mask() != 0
        && accessed_dirty == 0
        && !update_accessed_dirty_bits(mem, pt, &mut w, addr, write, ad_writes)?
    {
        return Ok(None);
    }
    Ok(Some(w))
}

/// `FNAME(update_accessed_dirty_bits)`: sets A in every gpte of the walk that lacks it, and D in
/// the leaf on a write, each with a compare-and-exchange against the value the walk read. Returns
/// false when a gpte no longer holds that value (the guest changed it): the caller walks again.
fn update_accessed_dirty_bits<M: GuestMemory + ?Sized, P: PtType>(
    mem: &M,
    pt: &P,
    w: &mut GuestWalker,
    addr: u64,
    write: bool,
    ad_writes: &mut u32,
) -> Result<bool, GuestPageFault> {
    for level in (w.level.0..=w.max_level.0).rev() {
        let l = level as usize;
        let orig = w.ptes[l];
        let mut pte = orig | pt.accessed_mask();
        if level == w.level.0 && write {
            pte |= pt.dirty_mask();
        }
        if pte == orig {
            continue;
        }
        match mem.cmpxchg_gpa_u64(w.pte_gpa[l], orig, pte) {
            None => {
                return Err(GuestPageFault::new(
                    addr,
                    write,
                    Level(level),
                    GuestFaultCause::NotInMemory(w.pte_gpa[l]),
                ))
            }
            Some(Err(_)) => return Ok(false),
            Some(Ok(_)) => {
                *ad_writes += 1;
                w.ptes[l] = pte;
            }
        }
    }
    Ok(true)
}

/// Writes a guest's 4-level page tables into guest memory from the host side, the way the KVM
/// selftests' `virt_map()`/`__virt_pg_map()` do before the guest runs. Table pages come
/// bump-style from a pool of guest frames, zero-filled; the first is the root (CR3).
///
/// Entries above the leaf are present, writable and user; leaves are present and user, writable
/// if asked, with A and D clear (the walker sets them), PS above 4K, and never NX.
pub struct GuestPageTableBuilder<'m> {
    mem: &'m dyn GuestMemory,
    pool_start: Gfn,
    pool_pages: u64,
    used: u64,
    root: Gfn,
}

/// The bits of a table-pointing gpte the builder writes.
const NONLEAF_BITS: u64 = PT_PRESENT_MASK | PT_WRITABLE_MASK | PT_USER_MASK;

/// Whether `gva` is canonical for 4-level paging (bits 63..47 all equal).
fn is_canonical(gva: u64) -> bool {
    (((gva << 16) as i64) >> 16) as u64 == gva
}

/// Why the guest page-table builder refused a pool or a mapping: one line that says what was
/// wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GuestPageTableError(pub String);

impl<'m> GuestPageTableBuilder<'m> {
    /// A builder whose tables come from the `table_pool_pages` frames at `table_pool_start`;
    /// allocates the root from it. Every pool page must be guest memory that keeps whole pages.
    pub fn new(
        mem: &'m dyn GuestMemory,
        table_pool_start: Gfn,
        table_pool_pages: u64,
    ) -> Result<Self, GuestPageTableError> {
        let end = table_pool_start
            .0
            .checked_add(table_pool_pages)
            .filter(|&e| e <= 1 << (52 - PAGE_SHIFT))
            .ok_or_else(|| {
                GuestPageTableError(format!(
                    "a page-table pool of {table_pool_pages} pages at gfn {table_pool_start} \
                     ends beyond the 52-bit guest physical address space"
                ))
            })?;
        if table_pool_pages == 0 {
            return Err(GuestPageTableError(
                "the page-table pool is empty: it needs at least the root".into(),
            ));
        }
        // Checking the last word of each page up front means no write below can fail.
        for gfn in table_pool_start.0..end {
            if mem
                .read_gpa_u64(Gfn(gfn).to_gpa() + PAGE_SIZE - 8)
                .is_none()
            {
                return Err(GuestPageTableError(format!(
                    "page-table pool page gfn {:#x} is not guest memory that keeps whole pages",
                    gfn
                )));
            }
        }
        let mut b = GuestPageTableBuilder {
            mem,
            pool_start: table_pool_start,
            pool_pages: table_pool_pages,
            used: 0,
            root: Gfn(0),
        };
        b.root = b.alloc_table()?;
        Ok(b)
    }

    /// The guest's CR3: the root (PML4) table.
    pub fn cr3(&self) -> Gpa {
        self.root.to_gpa()
    }

    /// Pool pages used so far, the root included.
    pub fn tables_used(&self) -> u64 {
        self.used
    }

    /// Pages in the pool.
    pub fn pool_pages(&self) -> u64 {
        self.pool_pages
    }

    /// Takes the next pool page and zero-fills it.
    fn alloc_table(&mut self) -> Result<Gfn, GuestPageTableError> {
        if self.used == self.pool_pages {
            return Err(GuestPageTableError(format!(
                "the page-table pool of {} pages at gfn {} is exhausted",
                self.pool_pages, self.pool_start
            )));
        }
        let gfn = self.pool_start + self.used;
        self.used += 1;
        for i in 0..PAGE_SIZE / 8 {
            self.write(gfn.to_gpa() + i * 8, 0)?;
        }
        Ok(gfn)
    }

    fn read(&self, gpa: Gpa) -> Result<u64, GuestPageTableError> {
        self.mem.read_gpa_u64(gpa).ok_or_else(|| {
            GuestPageTableError(format!("gpte at gpa {:#x} is not in guest memory", gpa.0))
        })
    }

    fn write(&self, gpa: Gpa, val: u64) -> Result<(), GuestPageTableError> {
        self.mem.write_gpa_u64(gpa, val).ok_or_else(|| {
            GuestPageTableError(format!("gpte at gpa {:#x} is not in guest memory", gpa.0))
        })
    }

    /// Maps `[gva, gva + size)` to `[gpa, gpa + size)` with `page_level` leaves (4K, 2M or 1G),
    /// writable or not. All three must be aligned to the page size, the range must not cross the
    /// non-canonical hole, and no part of it may be mapped already. Either the whole range is
    /// mapped or, on error, nothing is written.
    pub fn map(
        &mut self,
        gva: u64,
        gpa: u64,
        size: u64,
        page_level: Level,
        writable: bool,
    ) -> Result<(), GuestPageTableError> {
        if !(1..=3).contains(&page_level.0) {
            return Err(GuestPageTableError(format!(
                "page level {} cannot be a leaf: use 4K, 2M or 1G",
                page_level.0
            )));
        }
        let page = page_level.bytes();
        let name = page_level.name();
        if size == 0 || !size.is_multiple_of(page) {
            return Err(GuestPageTableError(format!(
                "map size {size:#x} is not a positive multiple of the {name} page size"
            )));
        }
        if !gva.is_multiple_of(page) || !gpa.is_multiple_of(page) {
            return Err(GuestPageTableError(format!(
                "gva {gva:#x} or gpa {gpa:#x} is not aligned to the {name} page size"
            )));
        }
        let last = gva
            .checked_add(size - 1)
            .filter(|&last| is_canonical(gva) && is_canonical(last) && gva >> 47 == last >> 47)
            .ok_or_else(|| {
                GuestPageTableError(format!(
                    "gva range {gva:#x} + {size:#x} is not canonical for 4-level paging"
                ))
            })?;
        if gpa.checked_add(size).is_none_or(|end| end > 1 << 52) {
            return Err(GuestPageTableError(format!(
                "gpa range {gpa:#x} + {size:#x} ends beyond the 52-bit guest physical address space"
            )));
        }
        let mut req = MapRequest {
            gva,
            gpa,
            leaf: page_level,
            writable,
            apply: false,
        };
        // A dry run first finds conflicts and counts the tables to create, so that a failed map
        // leaves guest memory untouched.
        let mut needed = 0;
        self.fill(
            Some(self.root),
            PT64_ROOT_4LEVEL,
            gva,
            last,
            &req,
            &mut needed,
        )?;
        let left = self.pool_pages - self.used;
        if needed > left {
            return Err(GuestPageTableError(format!(
                "mapping {size:#x} bytes at gva {gva:#x} needs {needed} more page-table pages, \
                 but the pool of {} pages at gfn {} has {left} left",
                self.pool_pages, self.pool_start
            )));
        }
        let mut created = 0;
        req.apply = true;
        self.fill(
            Some(self.root),
            PT64_ROOT_4LEVEL,
            gva,
            last,
            &req,
            &mut created,
        )?;
        debug_assert_eq!(created, needed);
        Ok(())
    }

    /// Visits the entries of the table at `level` (`None`: one not created yet) that cover
    /// `[lo, last]`, counting in `created` the tables to create below it. With `req.apply`,
    /// creates them and writes the leaves; without, only checks that nothing in the range is
    /// mapped.
    fn fill(
        &mut self,
        table: Option<Gfn>,
        level: Level,
        lo: u64,
        last: u64,
        req: &MapRequest,
        created: &mut u64,
    ) -> Result<(), GuestPageTableError> {
        let apply = req.apply;
        if table.is_none() && level == req.leaf && !apply {
            // A new leaf table holds nothing to conflict with.
            return Ok(());
        }
        let span = level.bytes();
        let mut cur = lo;
        loop {
            let hi = (cur | (span - 1)).min(last);
            let pte_gpa = table.map(|t| t.to_gpa() + pt64_index(cur, level) as u64 * 8);
            let old = match pte_gpa {
                Some(p) => self.read(p)?,
                None => 0,
            };
            if level == req.leaf {
                if is_present_gpte(old) {
                    return Err(GuestPageTableError(format!(
                        "gva {cur:#x} is already mapped (level-{} gpte {old:#x})",
                        level.0
                    )));
                }
                if apply {
                    let target = req.gpa + (cur - req.gva);
                    let mut leaf = (target & GUEST_PT64_BASE_ADDR_MASK) | PT_PRESENT_MASK;
                    leaf |= PT_USER_MASK;
                    if req.writable {
                        leaf |= PT_WRITABLE_MASK;
                    }
                    if level > PG_LEVEL_4K {
                        leaf |= PT_PAGE_SIZE_MASK;
                    }
                    self.write(pte_gpa.expect("apply creates every table"), leaf)?;
                }
            } else {
                let mut child = None;
                if is_present_gpte(old) {
                    if old & PT_PAGE_SIZE_MASK != 0 {
                        return Err(GuestPageTableError(format!(
                            "gva {cur:#x} lies in a {} page mapped already",
                            level.name()
                        )));
                    }
                    child = Some(gpte_to_gfn_lvl(old, PG_LEVEL_4K));
                } else {
                    *created += 1;
                    if apply {
                        let t = self.alloc_table()?;
                        self.write(
                            pte_gpa.expect("apply creates every table"),
                            t.to_gpa().0 | NONLEAF_BITS,
                        )?;
                        child = Some(t);
                    }
                }
                self.fill(child, level.below(), cur, hi, req, created)?;
            }
            if hi == last {
                return Ok(());
            }
            cur = hi + 1;
        }
    }

    /// Table pages (the root not included) that one [`GuestPageTableBuilder::map`] of `size`
    /// bytes with `level` leaves creates in the worst case: a fresh tree and a start that is only
    /// `level`-aligned, so the range touches as many tables at each level as it can. A start
    /// aligned to 512 GiB needs one table less per level whenever the size is not a multiple of
    /// that level's table span. Size a pool as 1 + the sum over the maps.
    pub fn tables_for(size: u64, level: Level) -> u64 {
        if size == 0 || !(1..=3).contains(&level.0) {
            return 0;
        }
        let n = size.div_ceil(level.bytes());
        (level.0..=3)
            .map(|l| {
                // A table at level l spans one entry of level l + 1, which is m leaves.
                let m = Level(l + 1).bytes() / level.bytes();
                // Starting on the table's last leaf, the first leaf fills one table and the
                // other n - 1 fill tables of m from the start of the next.
                1 + (n - 1).div_ceil(m)
            })
            .sum()
    }

    /// Where the gpte for `gva` at `level` (1..=4) lives, following the tables built so far;
    /// `None` when a level above is not present or is a leaf.
    pub fn pte_gpa(&self, gva: u64, level: Level) -> Option<Gpa> {
        if !(1..=4).contains(&level.0) {
            return None;
        }
        let mut table = self.root;
        let mut l = PT64_ROOT_4LEVEL;
        loop {
            let gpa = table.to_gpa() + pt64_index(gva, l) as u64 * 8;
            if l == level {
                return Some(gpa);
            }
            let e = self.mem.read_gpa_u64(gpa)?;
            if !is_present_gpte(e) || e & PT_PAGE_SIZE_MASK != 0 {
                return None;
            }
            table = gpte_to_gfn_lvl(e, PG_LEVEL_4K);
            l = l.below();
        }
    }
}

/// What one [`GuestPageTableBuilder::map`] call maps.
struct MapRequest {
    gva: u64,
    gpa: u64,
    leaf: Level,
    writable: bool,
    /// False for the dry run that only checks and counts.
    apply: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::backing::Backing;
    use crate::host::memory::WORDS_PER_FULL_PAGE;
    use crate::kvm::memslot::Memslot;

    use crate::x86::spte::{PG_LEVEL_1G, PG_LEVEL_2M};
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;
    use std::sync::Arc;

    /// A guest write applied to a gpte's value.
    type Interference = fn(u64) -> u64;

    /// Guest memory as a map of words: every gpa below `limit` is memory (zero until written).
    /// `interfere`, when set, is applied to the word by the next compare-and-exchange just before
    /// it compares, as a guest vCPU writing the gpte at that moment would.
    struct FakeMem {
        words: RefCell<HashMap<u64, u64>>,
        limit: u64,
        cmpxchgs: Cell<u64>,
        interfere: Cell<Option<Interference>>,
    }

    impl FakeMem {
        fn new(limit: u64) -> Self {
            FakeMem {
                words: Default::default(),
                limit,
                cmpxchgs: Cell::new(0),
                interfere: Cell::new(None),
            }
        }
    }

    impl GuestMemory for FakeMem {
        fn read_gpa_u64(&self, gpa: Gpa) -> Option<u64> {
            assert_eq!(gpa.0 % 8, 0);
            (gpa.0 < self.limit).then(|| *self.words.borrow().get(&gpa.0).unwrap_or(&0))
        }
        fn write_gpa_u64(&self, gpa: Gpa, val: u64) -> Option<()> {
            assert_eq!(gpa.0 % 8, 0);
            (gpa.0 < self.limit).then(|| {
                self.words.borrow_mut().insert(gpa.0, val);
            })
        }
        fn cmpxchg_gpa_u64(&self, gpa: Gpa, old: u64, new: u64) -> Option<Result<u64, u64>> {
            let mut cur = self.read_gpa_u64(gpa)?;
            self.cmpxchgs.set(self.cmpxchgs.get() + 1);
            if let Some(f) = self.interfere.take() {
                cur = f(cur);
                self.write_gpa_u64(gpa, cur)?;
            }
            if cur != old {
                return Some(Err(cur));
            }
            self.write_gpa_u64(gpa, new)?;
            Some(Ok(old))
        }
    }

    const MEM: u64 = 1 << 30;
    const POOL: Gfn = Gfn(0x100);

    fn walk(
        mem: &impl GuestMemory,
        cr3: Gpa,
        gva: u64,
        write: bool,
    ) -> (Result<GuestWalker, GuestPageFault>, u64) {
        let mut reads = 0;
        (walk_addr(mem, cr3, gva, write, &mut reads), reads)
    }

    #[test]
    fn gpte_helpers_follow_kvm() {
        let p = PT_PRESENT_MASK;
        assert!(is_present_gpte(p) && !is_present_gpte(PT_WRITABLE_MASK));
        assert_eq!(gpte_access(p), ACC_EXEC_MASK);
        assert_eq!(
            gpte_access(p | PT_WRITABLE_MASK | PT_USER_MASK | PT_DIRTY_MASK),
            ACC_ALL
        );
        assert_eq!(
            gpte_access(p | PT_WRITABLE_MASK | PT64_NX_MASK),
            ACC_WRITE_MASK
        );
        let mut a = ACC_ALL;
        protect_clean_gpte(&mut a, p | PT_WRITABLE_MASK);
        assert_eq!(a, ACC_EXEC_MASK | ACC_USER_MASK, "clean: write dropped");
        let mut a = ACC_ALL;
        protect_clean_gpte(&mut a, p | PT_WRITABLE_MASK | PT_DIRTY_MASK);
        assert_eq!(a, ACC_ALL, "dirty: write kept");
        let g = 0x8000_0000_4020_2000 | PT_PAGE_SIZE_MASK | 0x1000 | p;
        assert_eq!(gpte_to_gfn_lvl(g, PG_LEVEL_4K), Gfn(0x40203));
        assert_eq!(
            gpte_to_gfn_lvl(g, PG_LEVEL_2M),
            Gfn(0x40200),
            "PAT bit dropped"
        );
        assert_eq!(gpte_to_gfn_lvl(g, PG_LEVEL_1G), Gfn(0x40000));
        assert_eq!(pt64_index(0x7fff_ffff_f000, PT64_ROOT_4LEVEL), 255);
        assert_eq!(pt64_index(0xffff_8000_0000_0000, PT64_ROOT_4LEVEL), 256);
        assert_eq!(pt64_index(0x40_2000, PG_LEVEL_4K), 2);
        assert_eq!(pt64_index(0x40_2000, PG_LEVEL_2M), 2);
        assert_eq!(pt64_lvl_offset_mask(PG_LEVEL_2M), 0x1f_f000);
    }

    #[test]
    fn walk_of_a_4k_map_sets_accessed_everywhere_and_dirty_only_on_write() {
        let mem = FakeMem::new(MEM);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, 8).unwrap();
        let (gva, gpa) = (0x4000_0000u64, 0x20_0000u64);
        b.map(gva, gpa, 16 * PAGE_SIZE, PG_LEVEL_4K, true).unwrap();
        assert_eq!(b.tables_used(), 4, "root, PDPT, PD, PT");
        let cr3 = b.cr3();
        assert_eq!(cr3, POOL.to_gpa());

        let (w, reads) = walk(&mem, cr3, gva + 3 * PAGE_SIZE + 0x18, false);
        let w = w.unwrap();
        assert_eq!(reads, 4);
        assert_eq!((w.level, w.max_level), (PG_LEVEL_4K, PT64_ROOT_4LEVEL));
        assert_eq!(w.gfn, Gfn((gpa >> PAGE_SHIFT) + 3));
        assert_eq!(w.table_gfn[4], POOL);
        assert_eq!(
            [w.table_gfn[3], w.table_gfn[2], w.table_gfn[1]],
            [(POOL + 1), (POOL + 2), (POOL + 3)],
            "tables in the order the builder took them"
        );
        for l in 1..=4 {
            assert_eq!(
                Some(w.pte_gpa[l]),
                b.pte_gpa(gva + 3 * PAGE_SIZE, Level(l as u8))
            );
            let stored = mem.read_gpa_u64(w.pte_gpa[l]).unwrap();
            assert_eq!(stored, w.ptes[l], "walker holds the updated gpte");
            assert_ne!(stored & PT_ACCESSED_MASK, 0, "A set at level {l}");
            assert_eq!(stored & PT_DIRTY_MASK, 0, "no D on a read");
            assert_eq!(w.pt_access[l], ACC_ALL);
        }
        assert_eq!(
            w.pte_access,
            ACC_EXEC_MASK | ACC_USER_MASK,
            "read of a clean page"
        );
        assert_eq!((w.ad_writes, w.retries), (4, 0));

        // A second read finds A everywhere and writes nothing.
        let before = mem.cmpxchgs.get();
        let w2 = walk(&mem, cr3, gva + 3 * PAGE_SIZE, false).0.unwrap();
        assert_eq!((mem.cmpxchgs.get(), w2.ad_writes), (before, 0));

        // A write sets D in the leaf only, and then allows writes.
        let w3 = walk(&mem, cr3, gva + 3 * PAGE_SIZE, true).0.unwrap();
        assert_eq!(w3.ad_writes, 1);
        assert_eq!(w3.pte_access, ACC_ALL);
        assert_ne!(w3.ptes[1] & PT_DIRTY_MASK, 0);
        for l in 2..=4 {
            assert_eq!(w3.ptes[l] & PT_DIRTY_MASK, 0, "no D above the leaf");
        }
        // Now dirty, a read keeps W in pte_access.
        let w4 = walk(&mem, cr3, gva + 3 * PAGE_SIZE, false).0.unwrap();
        assert_eq!(w4.pte_access, ACC_ALL);
    }

    #[test]
    fn walk_of_huge_maps_ends_at_the_leaf_and_adds_the_4k_index() {
        let mem = FakeMem::new(MEM);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, 8).unwrap();
        let gva = 0x8000_0000u64;
        let gpa = 0x1_0000_0000u64;
        b.map(gva, gpa, 4 << 20, PG_LEVEL_2M, true).unwrap();
        assert_eq!(b.tables_used(), 3, "root, PDPT, PD");
        let (w, reads) = walk(&mem, b.cr3(), gva + (2 << 20) + 0x5_3008, true);
        let w = w.unwrap();
        assert_eq!((reads, w.level), (3, PG_LEVEL_2M));
        assert_eq!(w.gfn, Gfn(((gpa + (2 << 20)) >> PAGE_SHIFT) + 0x53));
        assert_eq!(w.table_gfn[2], (POOL + 2));
        assert_ne!(w.ptes[2] & PT_PAGE_SIZE_MASK, 0);
        assert_ne!(w.ptes[2] & PT_DIRTY_MASK, 0, "D in the 2M leaf");
        assert_eq!(w.ptes[3] & PT_DIRTY_MASK, 0);
        assert_eq!(w.ptes[1], 0, "no level below the leaf");

        let gva1g = 0x80_0000_0000u64;
        b.map(gva1g, 0x4000_0000, 1 << 30, PG_LEVEL_1G, false)
            .unwrap();
        let (w, reads) = walk(&mem, b.cr3(), gva1g + 0x1234_5000, false);
        let w = w.unwrap();
        assert_eq!((reads, w.level), (2, PG_LEVEL_1G));
        assert_eq!(w.gfn, Gfn((0x4000_0000 + 0x1234_5000) >> PAGE_SHIFT));
        assert_eq!(w.pte_access, ACC_EXEC_MASK | ACC_USER_MASK);
    }

    #[test]
    fn a_gpte_changed_under_the_walk_restarts_it() {
        let mem = FakeMem::new(MEM);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, 8).unwrap();
        b.map(0, 0x10_0000, PAGE_SIZE, PG_LEVEL_4K, true).unwrap();
        // The guest sets a software-available bit in the PML4E just before KVM's first A update.
        mem.interfere.set(Some(|v| v | 1 << 9));
        let (w, reads) = walk(&mem, b.cr3(), 0, true);
        let w = w.unwrap();
        assert_eq!(w.retries, 1);
        assert_eq!(reads, 8, "two full walks");
        assert_eq!(w.ad_writes, 4, "the failed exchange wrote nothing");
        assert_eq!(
            w.ptes[4] & (1 << 9 | PT_ACCESSED_MASK),
            1 << 9 | PT_ACCESSED_MASK,
            "the retry saw the guest's change and kept it"
        );
        assert_eq!(mem.read_gpa_u64(w.pte_gpa[4]), Some(w.ptes[4]));
        assert_ne!(w.ptes[1] & PT_DIRTY_MASK, 0);

        // A guest that zaps the leaf under the walk: the retry faults instead.
        b.map(PAGE_SIZE, 0x20_0000, PAGE_SIZE, PG_LEVEL_4K, true)
            .unwrap();
        mem.interfere.set(Some(|_| 0));
        let (r, reads) = walk(&mem, b.cr3(), PAGE_SIZE, true);
        let f = r.unwrap_err();
        assert_eq!(
            (f.cause, f.level, reads),
            (GuestFaultCause::NotPresent, PG_LEVEL_4K, 8)
        );
    }

    #[test]
    fn missing_and_read_only_translations_fault() {
        let mem = FakeMem::new(MEM);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, 8).unwrap();
        b.map(0x20_0000, 0x20_0000, PAGE_SIZE, PG_LEVEL_4K, false)
            .unwrap();
        let cr3 = b.cr3();

        let (r, reads) = walk(&mem, cr3, 0x80_0000_0000, false);
        let f = r.unwrap_err();
        assert_eq!(
            (f.level, f.present, f.cause, reads),
            (PT64_ROOT_4LEVEL, false, GuestFaultCause::NotPresent, 1)
        );
        assert_eq!(f.error_code(), 0);
        let (r, reads) = walk(&mem, cr3, 0x20_1000, true);
        let f = r.unwrap_err();
        assert_eq!((f.level, f.present, reads), (PG_LEVEL_4K, false, 4));
        assert_eq!(f.error_code(), PFERR_WRITE_MASK);

        let f = walk(&mem, cr3, 0x20_0000, true).0.unwrap_err();
        assert_eq!(
            (f.cause, f.level, f.present),
            (GuestFaultCause::Protection, PG_LEVEL_4K, true)
        );
        assert_eq!(f.error_code(), PFERR_PRESENT_MASK | PFERR_WRITE_MASK);
        assert_eq!(
            f.to_string(),
            "guest page fault on a write of gva 0x200000: the mapping is not writable"
        );
        let w = walk(&mem, cr3, 0x20_0000, false).0.unwrap();
        assert_eq!(w.pte_access, ACC_EXEC_MASK | ACC_USER_MASK);

        // Read-only or NX at an upper level applies to everything below it.
        b.map(0x40_0000, 0x40_0000, PAGE_SIZE, PG_LEVEL_4K, true)
            .unwrap();
        let pde = b.pte_gpa(0x40_0000, PG_LEVEL_2M).unwrap();
        let v = mem.read_gpa_u64(pde).unwrap();
        mem.write_gpa_u64(pde, (v & !PT_WRITABLE_MASK) | PT64_NX_MASK);
        let f = walk(&mem, cr3, 0x40_0000, true).0.unwrap_err();
        assert_eq!(f.cause, GuestFaultCause::Protection);
        let w = walk(&mem, cr3, 0x40_0000, false).0.unwrap();
        assert_eq!(w.pt_access[2], ACC_ALL);
        assert_eq!(w.pt_access[1], ACC_USER_MASK, "below the PDE: no W, no X");
        assert_eq!(w.pte_access, ACC_USER_MASK);
        for f in [
            walk(&mem, cr3, 0x80_0000_0000, false).0.unwrap_err(),
            walk(&mem, Gpa(MEM), 0, false).0.unwrap_err(),
        ] {
            assert!(!f.to_string().contains('\n'), "{f}");
        }
    }

    #[test]
    fn reserved_bits_and_tables_outside_memory_fault() {
        let mem = FakeMem::new(MEM);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, 8).unwrap();
        b.map(0, 0, 2 << 20, PG_LEVEL_2M, true).unwrap();
        let cr3 = b.cr3();
        let pde = b.pte_gpa(0, PG_LEVEL_2M).unwrap();
        let good = mem.read_gpa_u64(pde).unwrap();
        mem.write_gpa_u64(pde, good | 1 << 13);
        let f = walk(&mem, cr3, 0, false).0.unwrap_err();
        assert_eq!((f.cause, f.level), (GuestFaultCause::Reserved, PG_LEVEL_2M));
        assert_eq!(f.error_code(), PFERR_PRESENT_MASK | PFERR_RSVD_MASK);
        mem.write_gpa_u64(pde, good);
        let pml4e = b.pte_gpa(0, PT64_ROOT_4LEVEL).unwrap();
        let v = mem.read_gpa_u64(pml4e).unwrap();
        mem.write_gpa_u64(pml4e, v | PT_PAGE_SIZE_MASK);
        let f = walk(&mem, cr3, 0, false).0.unwrap_err();
        assert_eq!(
            (f.cause, f.level),
            (GuestFaultCause::Reserved, PT64_ROOT_4LEVEL)
        );
        mem.write_gpa_u64(pml4e, MEM | NONLEAF_BITS);
        let f = walk(&mem, cr3, 0, false).0.unwrap_err();
        assert_eq!(f.cause, GuestFaultCause::NotInMemory(Gpa(MEM)));
        assert_eq!((f.level, f.present), (Level(3), false));
    }

    #[test]
    fn builder_errors_are_one_line_and_write_nothing() {
        let mem = FakeMem::new(MEM);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, 3).unwrap();
        let bad = [
            b.map(0x1000, 0, 2 << 20, PG_LEVEL_2M, true),
            b.map(0, 0x1000, 2 << 20, PG_LEVEL_2M, true),
            b.map(0, 0, 0x1800, PG_LEVEL_4K, true),
            b.map(0, 0, 0, PG_LEVEL_4K, true),
            b.map(0, 0, PAGE_SIZE, PT64_ROOT_4LEVEL, true),
            b.map(0x8000_0000_0000, 0, PAGE_SIZE, PG_LEVEL_4K, true),
            b.map(0x7fff_ffff_f000, 0, 2 * PAGE_SIZE, PG_LEVEL_4K, true),
            b.map(0, (1 << 52) - PAGE_SIZE, 2 * PAGE_SIZE, PG_LEVEL_4K, true),
            // Root + 3 more tables needed, 2 left.
            b.map(0, 0, PAGE_SIZE, PG_LEVEL_4K, true),
        ];
        for e in bad {
            let e = e.unwrap_err().to_string();
            assert!(!e.contains('\n') && !e.is_empty(), "{e}");
        }
        assert_eq!(b.tables_used(), 1, "failed maps took no tables");
        assert_eq!(b.pte_gpa(0, PG_LEVEL_2M), None, "and wrote no gptes");
        b.map(0, 0, 4 << 20, PG_LEVEL_2M, true).unwrap();
        assert_eq!(b.tables_used(), 3);
        let e = b
            .map(0x20_0000, 0, PAGE_SIZE, PG_LEVEL_4K, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2M page mapped already"), "{e}");
        let e = b
            .map(0x20_0000, 0, 2 << 20, PG_LEVEL_2M, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("already mapped"), "{e}");
        // Exhaustion is found before any write: the mapped part stays as it was.
        let e = b
            .map(0x4000_0000, 0, PAGE_SIZE, PG_LEVEL_4K, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("pool"), "{e}");
        assert_eq!(b.pte_gpa(0x4000_0000, PG_LEVEL_2M), None);

        assert!(GuestPageTableBuilder::new(&mem, POOL, 0).is_err());
        let e = GuestPageTableBuilder::new(&mem, Gfn((MEM >> PAGE_SHIFT) - 1), 2)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not guest memory") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn tables_for_matches_what_map_allocates() {
        // (gva, size, level, tables on a fresh tree)
        let cases = [
            (0u64, PAGE_SIZE, PG_LEVEL_4K, 3),
            (0, 2 << 20, PG_LEVEL_4K, 3),
            (0, 4 << 20, PG_LEVEL_4K, 4),
            (0, 1 << 30, PG_LEVEL_4K, 2 + 512),
            (0, 1 << 30, PG_LEVEL_2M, 2),
            (0, 3 << 30, PG_LEVEL_2M, 4),
            (0, 2 << 30, PG_LEVEL_1G, 1),
            // The worst start: the last leaf of a 512 GiB region, so every level crosses a table.
            ((512 << 30) - PAGE_SIZE, 4 << 20, PG_LEVEL_4K, 7),
            ((512 << 30) - (2 << 20), 4 << 20, PG_LEVEL_2M, 4),
            ((512 << 30) - (1 << 30), 2 << 30, PG_LEVEL_1G, 2),
            (0x20_0000 - PAGE_SIZE, 2 * PAGE_SIZE, PG_LEVEL_4K, 4),
        ];
        for (gva, size, level, want) in cases {
            let mem = FakeMem::new(1 << 33);
            let mut b = GuestPageTableBuilder::new(&mem, POOL, 600).unwrap();
            b.map(gva, 0, size, level, true).unwrap();
            let made = b.tables_used() - 1;
            assert_eq!(made, want, "{gva:#x} + {size:#x} at {level:?}");
            let bound = GuestPageTableBuilder::tables_for(size, level);
            assert!(
                made <= bound,
                "{gva:#x} + {size:#x} at {level:?}: {made} > {bound}"
            );
            // The bound is tight for a start on the last leaf of a 512 GiB region.
            if gva % (512 << 30) == (512 << 30) - level.bytes() {
                assert_eq!(made, bound);
            }
            // Each mapped page walks to its frame.
            let w = walk(&mem, b.cr3(), gva + size - PAGE_SIZE, false)
                .0
                .unwrap();
            assert_eq!(w.gfn, Gfn((size - PAGE_SIZE) >> PAGE_SHIFT));
        }
        // A pool of 1 + tables_for is always enough.
        let size = 6 << 20;
        let mem = FakeMem::new(MEM);
        let pool = 1 + GuestPageTableBuilder::tables_for(size, PG_LEVEL_4K);
        let mut b = GuestPageTableBuilder::new(&mem, POOL, pool).unwrap();
        b.map((512 << 30) - PAGE_SIZE, 0, size, PG_LEVEL_4K, true)
            .unwrap();
        assert_eq!(b.tables_used(), pool);
    }

    use crate::kvm::vcpu::NoWait;

    #[test]
    fn kvm_guest_memory_reads_full_pages_and_only_word_zero_of_thin_ones() {
        let kvm = Kvm::new(1, Box::new(NoWait), false);
        let full = kvm
            .host
            .alloc_region_words(1024, WORDS_PER_FULL_PAGE)
            .unwrap();
        let thin = kvm.host.alloc_region(1024).unwrap();
        let slot = |id, base, pfn| {
            Arc::new(Memslot::new(
                id,
                Gfn(base),
                1024,
                Backing::Anonymous,
                pfn,
                0,
            ))
        };
        kvm.install_memslots(vec![slot(0, 0, full), slot(1, 0x1000, thin)]);

        let thin_gpa = Gfn(0x1005).to_gpa();
        assert_eq!(kvm.write_gpa_u64(thin_gpa, 9), Some(()));
        assert_eq!(kvm.host.read(thin + 5), 9, "word 0 is the page's word");
        assert_eq!(kvm.read_gpa_u64(thin_gpa + 8), None);
        assert_eq!(kvm.read_gpa_u64(Gfn(0x2000).to_gpa()), None, "no memslot");
        let g = Gfn(7).to_gpa() + 0xff8;
        assert_eq!(kvm.read_gpa_u64(g), Some(0));
        assert_eq!(kvm.cmpxchg_gpa_u64(g, 0, 5), Some(Ok(0)));
        assert_eq!(kvm.cmpxchg_gpa_u64(g, 0, 6), Some(Err(5)));
        assert_eq!(kvm.host.page_word(full + 7, 511).load(Ordering::Relaxed), 5);

        let mut b = GuestPageTableBuilder::new(&kvm, Gfn(0x200), 16).unwrap();
        b.map(0x4000_0000, 0x1000_0000, 64 << 10, PG_LEVEL_4K, true)
            .unwrap();
        let mut reads = 0;
        let w = walk_addr(&kvm, b.cr3(), 0x4000_2000, true, &mut reads).unwrap();
        assert_eq!((w.gfn, reads), (Gfn(0x1_0002), 4));
        assert_ne!(kvm.read_gpa_u64(w.pte_gpa[1]).unwrap() & PT_DIRTY_MASK, 0);
        assert!(
            GuestPageTableBuilder::new(&kvm, Gfn(0x1000), 1).is_err(),
            "thin pool"
        );
    }
}
