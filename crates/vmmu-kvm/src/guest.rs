//! The guest programs, generated with an assembler, and the layout of the small system memslot
//! (slot 0) they live in.
//!
//! Both programs use general-purpose registers only (no SSE/AVX, no stack, no interrupts):
//! some hosts run guests through KVM's instruction emulator, which handles plain integer
//! instructions well and little else. Each program talks to the host through a per-vCPU
//! *mailbox* in slot 0 (its address is in RDI from the start) and reports with `OUT` to
//! [`SYNC_PORT`]. The host writes the mailbox only while the vCPU is out of the guest (between
//! the `OUT` exit and the next `KVM_RUN`), so the guest reads a consistent set of values after
//! every `OUT`: `KVM_RUN` orders the host's stores before the guest's loads.

use crate::error::KvmError;
use iced_x86::code_asm::*;

/// I/O port the guest writes to when it finishes a pass (or a write list). Nothing in the
/// kernel claims it, so every `OUT` to it exits to user space.
pub const SYNC_PORT: u16 = 0x6d6d;

/// Byte offsets of the fields of a vCPU's mailbox (each an 8-byte little-endian word).
pub mod mailbox {
    /// memstress: guest address of the vCPU's region.
    pub const BASE: u64 = 0;
    /// memstress: 4 KiB pages in the region (`rand % pages` is a 64-bit division, as the
    /// selftest's `uint64_t pages` makes it).
    pub const PAGES: u64 = 8;
    /// memstress: write percentage of the next pass (0..=100).
    pub const WRITE_PERCENT: u64 = 16;
    /// memstress: non-zero for random access in the next pass.
    pub const RANDOM: u64 = 24;
    /// Both programs: the 8-byte value every write of the next pass stores (for memstress,
    /// [`vmmu::lab::memstress::pass_value`] of the pass, as the model writes).
    pub const VALUE: u64 = 32;
    /// memstress: initial `guest_random_u32()` seed (`random_seed + vcpu_idx`, 32 bits), read
    /// once at start.
    pub const SEED: u64 = 40;
    /// write list: guest address of the list of guest addresses to write.
    pub const LIST: u64 = 48;
    /// write list: number of entries in the list.
    pub const COUNT: u64 = 56;
    /// Bytes per mailbox.
    pub const SIZE: u64 = 64;
}

/// The multiplier of the selftests' `guest_random_u32()` (Park–Miller "minimal standard"):
/// `seed = (u64)seed * RANDOM_MULTIPLIER % RANDOM_MODULUS`. The host replays the same
/// generator with [`vmmu::lab::memstress::GuestRandom`].
pub const RANDOM_MULTIPLIER: u32 = 48_271;
/// The modulus of `guest_random_u32()`: `2^31 - 1`.
pub const RANDOM_MODULUS: u32 = 0x7fff_ffff;

/// Which program a VM's vCPUs run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GuestProgram {
    /// memstress: passes over a region, touching the first 8 bytes of pages.
    Memstress,
    /// Writes a host-given list of guest addresses, then reports.
    WriteList,
}

/// Where things are in slot 0 (which starts at guest physical address 0).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SysLayout {
    /// The GDT.
    pub gdt: u64,
    /// The memstress program.
    pub memstress_code: u64,
    /// The write-list program.
    pub write_list_code: u64,
    /// vCPU 0's mailbox; vCPU i's is `mailboxes + i * mailbox::SIZE`.
    pub mailboxes: u64,
    /// The write list area.
    pub write_list: u64,
    /// Entries the write list area holds.
    pub write_list_capacity: u64,
    /// First page-table page.
    pub page_tables: u64,
    /// Bytes reserved for page tables.
    pub page_tables_len: u64,
    /// Size of slot 0 (a multiple of 2 MiB).
    pub size: u64,
}

/// Bytes reserved for each program's code.
const CODE_BYTES: u64 = 0x1000;

impl SysLayout {
    /// Lays out slot 0 for `vcpus` mailboxes, `list_capacity` write-list entries and
    /// `page_table_pages` page tables.
    pub fn new(vcpus: usize, list_capacity: u64, page_table_pages: u64) -> SysLayout {
        let page = |x: u64| x.div_ceil(4096) * 4096;
        let gdt = 0x1000;
        let memstress_code = 0x2000;
        let write_list_code = memstress_code + CODE_BYTES;
        let mailboxes = write_list_code + CODE_BYTES;
        let write_list = mailboxes + page(vcpus as u64 * mailbox::SIZE);
        let page_tables = write_list + page(list_capacity * 8);
        let page_tables_len = page_table_pages * 4096;
        let end = page_tables + page_tables_len;
        SysLayout {
            gdt,
            memstress_code,
            write_list_code,
            mailboxes,
            write_list,
            write_list_capacity: list_capacity,
            page_tables,
            page_tables_len,
            size: end.div_ceil(2 << 20) * (2 << 20),
        }
    }

    /// vCPU `idx`'s mailbox.
    pub fn mailbox(&self, idx: usize) -> u64 {
        self.mailboxes + idx as u64 * mailbox::SIZE
    }

    /// The entry point of `program`.
    pub fn entry(&self, program: GuestProgram) -> u64 {
        match program {
            GuestProgram::Memstress => self.memstress_code,
            GuestProgram::WriteList => self.write_list_code,
        }
    }
}

/// The GDT: null, 64-bit code (selector 0x08), data (0x10), and a 64-bit TSS (0x18, two
/// slots) so that the segment state KVM is given matches a real descriptor table.
pub fn gdt_entries() -> [u64; 5] {
    [
        0,
        0x00af_9b00_0000_ffff, // code: P, DPL0, S, type 0xb, L, G
        0x00cf_9300_0000_ffff, // data: P, DPL0, S, type 0x3, D/B, G
        0x0000_8b00_0000_0067, // TSS (busy, 64-bit), base 0, limit 0x67
        0,
    ]
}

fn asm_err(e: IcedError) -> KvmError {
    KvmError::Assembler(e.to_string())
}

/// Emits one `guest_random_u32()` step: `EBX = (u64)EBX * 48271 % (2^31 - 1)`, leaving the
/// new seed zero-extended in RDX too. Clobbers RAX, RCX and RDX.
///
/// The product of a 32-bit seed and 48271 needs at most 48 bits, so a 64-bit `IMUL` cannot
/// overflow, and `DIV` of RDX:RAX (RDX = 0) by the modulus cannot fault.
fn emit_random_u32(a: &mut CodeAssembler) -> Result<(), IcedError> {
    a.mov(eax, ebx)?; // zero-extends the seed into RAX
    a.imul_3(rax, rax, RANDOM_MULTIPLIER as i32)?;
    a.xor(edx, edx)?;
    a.mov(ecx, RANDOM_MODULUS)?;
    a.div(rcx)?;
    a.mov(ebx, edx)?;
    Ok(())
}

/// Assembles the memstress guest at `ip`.
///
/// Registers: RDI mailbox, EBX `guest_random_u32()` seed, R8 region base, R9 pages, R10 write
/// percentage, R11 random flag, R12 value, R13 loop counter, RSI address, RAX/RCX/RDX scratch.
///
/// Per pass, for `i` in `0..pages`: `page = random ? guest_random_u32() % pages : i` (a 64-bit
/// division, as the selftest's `uint64_t pages` makes it); then
/// `write = guest_random_u32() % 100 < write_percent`; then store `value` to (or load from) the
/// first 8 bytes of the page. That is `memstress_guest_code()`'s order of draws, which
/// [`vmmu::lab::memstress::PassAccesses`] replays. The seed carries over from pass to pass, as
/// in the selftest; the region parameters are re-read from the mailbox at the start of every
/// pass.
pub fn assemble_memstress(ip: u64) -> Result<Vec<u8>, KvmError> {
    let mut a = CodeAssembler::new(64).map_err(asm_err)?;
    let mut pass = a.create_label();
    let mut lp = a.create_label();
    let mut addr = a.create_label();
    let mut read = a.create_label();
    let mut next = a.create_label();
    let mut done = a.create_label();
    (|| -> Result<(), IcedError> {
        a.mov(ebx, dword_ptr(rdi + mailbox::SEED as i32))?;
        a.set_label(&mut pass)?;
        a.mov(r8, qword_ptr(rdi + mailbox::BASE as i32))?;
        a.mov(r9, qword_ptr(rdi + mailbox::PAGES as i32))?;
        a.mov(r10, qword_ptr(rdi + mailbox::WRITE_PERCENT as i32))?;
        a.mov(r11, qword_ptr(rdi + mailbox::RANDOM as i32))?;
        a.mov(r12, qword_ptr(rdi + mailbox::VALUE as i32))?;
        a.xor(r13d, r13d)?;
        a.test(r9, r9)?;
        a.jz(done)?;
        a.set_label(&mut lp)?;
        a.mov(rax, r13)?;
        a.test(r11, r11)?;
        a.jz(addr)?;
        // page = guest_random_u32() % pages
        emit_random_u32(&mut a)?;
        a.mov(eax, ebx)?;
        a.xor(edx, edx)?;
        a.div(r9)?;
        a.mov(rax, rdx)?;
        a.set_label(&mut addr)?;
        a.mov(rsi, rax)?;
        a.shl(rsi, 12)?;
        a.add(rsi, r8)?;
        // write = guest_random_u32() % 100 < write_percent
        emit_random_u32(&mut a)?;
        a.mov(eax, ebx)?;
        a.xor(edx, edx)?;
        a.mov(ecx, 100)?;
        a.div(ecx)?;
        a.cmp(rdx, r10)?;
        a.jae(read)?;
        a.mov(qword_ptr(rsi), r12)?;
        a.jmp(next)?;
        a.set_label(&mut read)?;
        a.mov(rax, qword_ptr(rsi))?;
        a.set_label(&mut next)?;
        a.inc(r13)?;
        a.cmp(r13, r9)?;
        a.jb(lp)?;
        a.set_label(&mut done)?;
        a.mov(edx, SYNC_PORT as u32)?;
        a.out(dx, al)?;
        a.jmp(pass)?;
        Ok(())
    })()
    .map_err(asm_err)?;
    let code = a.assemble(ip).map_err(asm_err)?;
    check_code_size(code)
}

/// Assembles the write-list guest at `ip`: stores the mailbox's VALUE to each guest address in
/// the list at LIST (COUNT entries), in order, then `OUT`s and starts over with a new list.
pub fn assemble_write_list(ip: u64) -> Result<Vec<u8>, KvmError> {
    let mut a = CodeAssembler::new(64).map_err(asm_err)?;
    let mut start = a.create_label();
    let mut lp = a.create_label();
    let mut done = a.create_label();
    (|| -> Result<(), IcedError> {
        a.set_label(&mut start)?;
        a.mov(rsi, qword_ptr(rdi + mailbox::LIST as i32))?;
        a.mov(rcx, qword_ptr(rdi + mailbox::COUNT as i32))?;
        a.mov(r12, qword_ptr(rdi + mailbox::VALUE as i32))?;
        a.test(rcx, rcx)?;
        a.jz(done)?;
        a.set_label(&mut lp)?;
        a.mov(rax, qword_ptr(rsi))?;
        a.mov(qword_ptr(rax), r12)?;
        a.add(rsi, 8)?;
        a.dec(rcx)?;
        a.jnz(lp)?;
        a.set_label(&mut done)?;
        a.mov(edx, SYNC_PORT as u32)?;
        a.out(dx, al)?;
        a.jmp(start)?;
        Ok(())
    })()
    .map_err(asm_err)?;
    let code = a.assemble(ip).map_err(asm_err)?;
    check_code_size(code)
}

fn check_code_size(code: Vec<u8>) -> Result<Vec<u8>, KvmError> {
    if code.len() as u64 > CODE_BYTES {
        return Err(KvmError::Assembler(format!(
            "{} bytes of code do not fit in the {CODE_BYTES} reserved",
            code.len()
        )));
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iced_x86::{Decoder, DecoderOptions, Mnemonic, OpKind};

    fn decode(code: &[u8], ip: u64) -> Vec<iced_x86::Instruction> {
        let mut d = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
        let mut v = Vec::new();
        while d.can_decode() {
            let i = d.decode();
            assert!(!i.is_invalid(), "invalid instruction at {:#x}", i.ip());
            v.push(i);
        }
        v
    }

    /// Plain integer instructions that KVM's emulator handles, on general-purpose registers.
    fn assert_emulator_friendly(code: &[u8], ip: u64) {
        use Mnemonic::*;
        let allowed = [
            Mov, Xor, Test, Jne, Je, Imul, Add, Div, Shl, Cmp, Jae, Jmp, Inc, Jb, Out, Dec,
        ];
        for i in decode(code, ip) {
            assert!(
                allowed.contains(&i.mnemonic()),
                "{:?} at {:#x}",
                i.mnemonic(),
                i.ip()
            );
            for op in 0..i.op_count() {
                if i.op_kind(op) == OpKind::Register {
                    let r = i.op_register(op);
                    assert!(r.is_gpr(), "{r:?} in {:?}", i.mnemonic());
                }
            }
        }
    }

    #[test]
    fn memstress_assembles_to_gpr_only_code_that_ends_in_out_and_loops() {
        let ip = 0x2000;
        let code = assemble_memstress(ip).unwrap();
        assert!(code.len() < 200, "{}", code.len());
        assert_emulator_friendly(&code, ip);
        let ins = decode(&code, ip);
        let out = ins
            .iter()
            .position(|i| i.mnemonic() == Mnemonic::Out)
            .unwrap();
        // After OUT comes a jump back to the pass start (the second instruction).
        let j = &ins[out + 1];
        assert_eq!(j.mnemonic(), Mnemonic::Jmp);
        assert_eq!(j.near_branch_target(), ins[1].ip());
        // Exactly one store: the 8-byte write of the value.
        let stores = ins
            .iter()
            .filter(|i| i.mnemonic() == Mnemonic::Mov && i.op0_kind() == OpKind::Memory)
            .count();
        assert_eq!(stores, 1);
    }

    #[test]
    fn write_list_assembles_to_gpr_only_code() {
        let ip = 0x3000;
        let code = assemble_write_list(ip).unwrap();
        assert_emulator_friendly(&code, ip);
        let ins = decode(&code, ip);
        assert_eq!(ins.last().unwrap().near_branch_target(), ip);
    }

    #[test]
    fn layout_keeps_regions_apart_and_page_aligned() {
        let l = SysLayout::new(300, 1000, 7);
        assert!(l.gdt + 40 <= l.memstress_code);
        assert!(l.write_list_code + CODE_BYTES <= l.mailboxes);
        assert!(l.mailbox(299) + mailbox::SIZE <= l.write_list);
        assert!(l.write_list + 8000 <= l.page_tables);
        assert_eq!(l.page_tables % 4096, 0);
        assert!(l.page_tables + 7 * 4096 <= l.size);
        assert_eq!(l.size % (2 << 20), 0);
        assert_eq!(l.entry(GuestProgram::WriteList), l.write_list_code);
    }

    #[test]
    fn random_constants_are_the_selftests_park_miller() {
        use vmmu::lab::memstress::GuestRandom;
        // The guest computes `seed * RANDOM_MULTIPLIER % RANDOM_MODULUS` in 64 bits; the model's
        // GuestRandom is the reference (guest_random_u32()).
        for seed in [1u32, 7, 0x7fff_fffe, 0x7fff_ffff, 0x8000_0000, u32::MAX] {
            let guest = (seed as u64 * RANDOM_MULTIPLIER as u64 % RANDOM_MODULUS as u64) as u32;
            assert_eq!(guest, GuestRandom::new(seed).next_u32(), "seed {seed:#x}");
        }
        // The worst-case product fits in 64 bits with room to spare, so IMUL cannot overflow.
        assert!(
            (u32::MAX as u64)
                .checked_mul(RANDOM_MULTIPLIER as u64)
                .unwrap()
                < 1 << 48
        );
    }

    /// Runs the assembled memstress guest on real KVM for a few small passes (1 vCPU, random
    /// and sequential, several write percentages, a seed above 2^31) and checks it against the
    /// model's definitions: after every pass the guest's seed register (EBX) equals
    /// [`GuestRandom`](vmmu::lab::memstress::GuestRandom) stepped as
    /// [`PassAccesses`](vmmu::lab::memstress::PassAccesses) steps it, every page the replay says
    /// was written holds that pass's [`pass_value`](vmmu::lab::memstress::pass_value), and every
    /// other page still holds what it held before.
    #[test]
    fn guest_draws_and_writes_exactly_as_the_model_replays() {
        use crate::vm::{run_to_sync, KvmVm, VmSetup, TEST_MEM_GPA};
        use vmmu::host::backing::Backing;
        use vmmu::lab::memstress::{pass_value, GuestRandom, PassAccesses};

        if let Err(e) = crate::kvm_available() {
            eprintln!("skipping the real-KVM guest RNG test: {e}");
            return;
        }
        // Not a power of two, so `% pages` matters; small, as the host may emulate the guest.
        const PAGES: u64 = 37;
        const SEED: u32 = 0xdead_beef;
        let mut vm = KvmVm::new(&VmSetup {
            program: GuestProgram::Memstress,
            window: 2 << 20,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{e}"));
        vm.add_memslot(1, TEST_MEM_GPA, PAGES * 4096, Backing::Anonymous, 0)
            .unwrap();
        let mb = vm.vcpus[0].mailbox;
        assert!(vm.sys.write_u64(mb + mailbox::BASE, TEST_MEM_GPA));
        assert!(vm.sys.write_u64(mb + mailbox::PAGES, PAGES));
        assert!(vm.sys.write_u64(mb + mailbox::SEED, SEED as u64));

        let mut rng = GuestRandom::new(SEED);
        // A second generator stepped draw by draw: the seed after a draw is the number drawn,
        // which is what the guest keeps in EBX.
        let mut shadow = GuestRandom::new(SEED);
        let mut expect = vec![0u64; PAGES as usize];
        // (random access, write percentage) of each pass.
        let passes = [(true, 50), (true, 30), (false, 40), (true, 100), (true, 0)];
        for (it, &(random, write_percent)) in passes.iter().enumerate() {
            let value = pass_value(it as i64 + 1, 0);
            assert!(vm
                .sys
                .write_u64(mb + mailbox::WRITE_PERCENT, write_percent as u64));
            assert!(vm.sys.write_u64(mb + mailbox::RANDOM, random as u64));
            assert!(vm.sys.write_u64(mb + mailbox::VALUE, value));
            run_to_sync(&mut vm.vcpus[0], &vm.vm, None).unwrap_or_else(|e| panic!("{e}"));

            let mut writes = 0;
            for (page, write) in PassAccesses::new(&mut rng, PAGES, random, write_percent) {
                if write {
                    expect[page as usize] = value;
                    writes += 1;
                }
            }
            let draws = if random { 2 * PAGES } else { PAGES };
            let mut seed = 0;
            for _ in 0..draws {
                seed = shadow.next_u32();
            }
            assert_eq!(
                rng.clone().next_u32(),
                shadow.clone().next_u32(),
                "pass {it}: the replay drew {draws} numbers"
            );
            let guest_seed = vm.vcpus[0].fd.get_regs().unwrap().rbx;
            assert_eq!(guest_seed, seed as u64, "pass {it}: the guest's seed (EBX)");
            for (page, want) in expect.iter().enumerate() {
                let got = vm.read_u64(TEST_MEM_GPA + page as u64 * 4096);
                assert_eq!(got, Some(*want), "pass {it}: page {page}");
            }
            if it == 0 {
                // The first pass both wrote pages and left some untouched, so the check above
                // saw pages that must and pages that must not hold the value.
                let untouched = expect.iter().filter(|&&v| v == 0).count();
                assert!(
                    writes > 0 && untouched > 0,
                    "{writes} writes, {untouched} untouched"
                );
            }
            match write_percent {
                0 => assert_eq!(writes, 0),
                100 => assert_eq!(writes, PAGES),
                _ => {}
            }
        }
    }
}
