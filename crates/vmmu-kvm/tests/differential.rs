//! Differential test: the same small write patterns and dirty-log calls on real KVM and on the
//! model, with the dirty bitmaps, CLEAR verdicts and dirty-ring entries compared step by step.
//!
//! On the KVM side a tiny guest writes a host-given list of guest physical addresses and exits;
//! on the model side each address is one `vcpu_write`. Runs wherever `/dev/kvm` is usable and
//! says why it skipped elsewhere.
//!
//! Hosts that run guests through KVM's instruction emulator mark a page dirty on *every*
//! emulated write, not only on the write fault after write-protection; dirty-ring entries are
//! therefore compared as sets per vCPU, and a page written by two vCPUs in the same round is
//! compared only in the union over vCPUs.

use std::collections::BTreeSet;
use vmmu::host::backing::Backing;
use vmmu::vm::{Vm, VmConfig};
use vmmu_kvm::oracle::iter_ones;
use vmmu_kvm::{KvmError, KvmVm, VmSetup, KVM_MEM_LOG_DIRTY_PAGES, TEST_MEM_GPA};

/// Test memslots: (slot, guest physical address, pages). Slot 1's size is not a multiple of 64
/// so the CLEAR rules about the end of the slot are exercised.
const SLOTS: [(u32, u64, u64); 2] = [(1, TEST_MEM_GPA, 300), (2, TEST_MEM_GPA + (2 << 20), 128)];

fn gpa(slot: u32, page: u64) -> u64 {
    let (_, base, pages) = SLOTS
        .iter()
        .copied()
        .find(|s| s.0 == slot)
        .expect("known slot");
    assert!(page < pages);
    base + page * 4096 + 8 * (page % 7)
}

/// What a step of a case observed, compared between the two backends.
#[derive(Debug, PartialEq, Eq)]
enum Obs {
    /// Set bits of a `KVM_GET_DIRTY_LOG` bitmap.
    Dirty(u32, Vec<u64>),
    /// Whether a `KVM_CLEAR_DIRTY_LOG` call was accepted.
    Clear(u32, u64, u64, bool),
    /// Dirty-ring entries of one vCPU, as a set.
    Ring(usize, BTreeSet<(u32, u64)>),
    /// Dirty-ring entries of all vCPUs, as a set.
    RingUnion(BTreeSet<(u32, u64)>),
    /// The count `KVM_RESET_DIRTY_RINGS` returned.
    Reset(u64),
    /// A word of guest memory after the writes.
    Word(u64, u64),
}

/// How a case's VM is set up.
#[derive(Clone, Copy)]
struct Config {
    vcpus: usize,
    manual_protect: Option<bool>,
    dirty_ring: Option<u32>,
}

/// One backend under test.
trait Backend {
    fn write(&mut self, vcpu: usize, gpas: &[u64], value: u64);
    fn get(&mut self, slot: u32) -> Vec<u64>;
    fn clear(&mut self, slot: u32, first: u64, num: u64, bitmap: &[u64]) -> bool;
    fn harvest(&mut self, vcpu: usize) -> Vec<(u32, u64)>;
    fn reset(&mut self) -> u64;
    fn read(&mut self, gpa: u64) -> u64;
}

struct KvmSide(KvmVm);

impl KvmSide {
    /// The KVM VM for `cfg`, or the reason this host cannot run it.
    fn new(cfg: Config) -> Result<Self, KvmError> {
        let mut vm = KvmVm::new(&VmSetup {
            vcpus: cfg.vcpus,
            manual_protect: cfg.manual_protect,
            dirty_ring: cfg.dirty_ring,
            window: 1 << 30,
            ..Default::default()
        })?;
        for (slot, base, pages) in SLOTS {
            vm.add_memslot(
                slot,
                base,
                pages * 4096,
                Backing::Anonymous,
                KVM_MEM_LOG_DIRTY_PAGES,
            )?;
        }
        Ok(KvmSide(vm))
    }
}

impl Backend for KvmSide {
    fn write(&mut self, vcpu: usize, gpas: &[u64], value: u64) {
        self.0
            .run_writes(vcpu, gpas, value)
            .expect("kvm: run_writes");
    }
    fn get(&mut self, slot: u32) -> Vec<u64> {
        self.0.get_dirty_log(slot).expect("kvm: KVM_GET_DIRTY_LOG")
    }
    fn clear(&mut self, slot: u32, first: u64, num: u64, bitmap: &[u64]) -> bool {
        match self.0.clear_dirty_log(slot, first, num, bitmap) {
            Ok(()) => true,
            Err(e) => {
                assert_eq!(
                    e.errno(),
                    Some(libc::EINVAL),
                    "kvm: unexpected CLEAR error: {e}"
                );
                false
            }
        }
    }
    fn harvest(&mut self, vcpu: usize) -> Vec<(u32, u64)> {
        self.0.dirty_ring_harvest(vcpu).expect("kvm: ring harvest")
    }
    fn reset(&mut self) -> u64 {
        self.0
            .reset_dirty_rings()
            .expect("kvm: KVM_RESET_DIRTY_RINGS")
    }
    fn read(&mut self, gpa: u64) -> u64 {
        self.0.read_u64(gpa).expect("kvm: read of test memory")
    }
}

struct ModelSide(Vm);

impl ModelSide {
    fn new(cfg: Config) -> Self {
        let vm = Vm::new(VmConfig {
            vcpus: cfg.vcpus,
            ..Default::default()
        });
        if let Some(initially_set) = cfg.manual_protect {
            vm.enable_manual_dirty_log_protect(initially_set)
                .expect("model: enable_manual_dirty_log_protect");
        }
        if let Some(entries) = cfg.dirty_ring {
            vm.enable_dirty_ring(entries)
                .expect("model: enable_dirty_ring");
        }
        for (slot, base, pages) in SLOTS {
            vm.set_user_memory_region(
                slot,
                base,
                pages * 4096,
                Backing::Anonymous,
                vmmu::vm::KVM_MEM_LOG_DIRTY_PAGES,
            )
            .expect("model: set_user_memory_region");
        }
        ModelSide(vm)
    }
}

impl Backend for ModelSide {
    fn write(&mut self, vcpu: usize, gpas: &[u64], value: u64) {
        for &g in gpas {
            self.0
                .vcpu_write(vcpu, g, value)
                .expect("model: vcpu_write");
        }
    }
    fn get(&mut self, slot: u32) -> Vec<u64> {
        self.0.get_dirty_log(slot).expect("model: get_dirty_log")
    }
    fn clear(&mut self, slot: u32, first: u64, num: u64, bitmap: &[u64]) -> bool {
        self.0.clear_dirty_log(slot, first, num, bitmap).is_ok()
    }
    fn harvest(&mut self, vcpu: usize) -> Vec<(u32, u64)> {
        self.0.dirty_ring_harvest(vcpu)
    }
    fn reset(&mut self) -> u64 {
        self.0
            .reset_dirty_rings()
            .expect("model: reset_dirty_rings")
    }
    fn read(&mut self, gpa: u64) -> u64 {
        self.0.vcpu_read(0, gpa).expect("model: vcpu_read")
    }
}

fn set_bits(bitmap: &[u64]) -> Vec<u64> {
    iter_ones(bitmap).collect()
}

fn all_ones(pages: u64) -> Vec<u64> {
    let mut v = vec![u64::MAX; pages.div_ceil(64) as usize];
    if !pages.is_multiple_of(64) {
        if let Some(last) = v.last_mut() {
            *last = (1 << (pages % 64)) - 1;
        }
    }
    v
}

/// Runs `case` on KVM and on the model and compares what they observed. Returns false (after
/// saying why) when this host cannot run the KVM side.
fn differential(name: &str, cfg: Config, case: impl Fn(&mut dyn Backend, &mut Vec<Obs>)) -> bool {
    let mut kvm = match KvmSide::new(cfg) {
        Ok(k) => k,
        // The harness ignores the test where /dev/kvm or a capability it needs is missing.
        Err(e) => panic!("case '{name}': setting up the KVM VM failed: {e}"),
    };
    let mut model = ModelSide::new(cfg);
    let (mut k, mut m) = (Vec::new(), Vec::new());
    case(&mut kvm, &mut k);
    case(&mut model, &mut m);
    assert_eq!(
        k.len(),
        m.len(),
        "case '{name}': different numbers of observations"
    );
    if std::env::var_os("VMMU_DIFF_VERBOSE").is_some() {
        eprintln!("case '{name}': {k:#?}");
    }
    for (i, (a, b)) in k.iter().zip(&m).enumerate() {
        assert_eq!(
            a, b,
            "case '{name}', observation {i}: real KVM (left) and the model (right) differ"
        );
    }
    // Guard against both sides agreeing on nothing at all.
    assert!(
        k.iter().any(|o| match o {
            Obs::Dirty(_, v) => !v.is_empty(),
            Obs::Ring(_, s) | Obs::RingUnion(s) => !s.is_empty(),
            _ => false,
        }),
        "case '{name}': no dirty page was observed at all"
    );
    true
}

fn get_all(b: &mut dyn Backend, o: &mut Vec<Obs>) {
    for (slot, _, _) in SLOTS {
        let bm = b.get(slot);
        o.push(Obs::Dirty(slot, set_bits(&bm)));
    }
}

fn get_dirty_log_without_manual_protect() {
    let cfg = Config {
        vcpus: 1,
        manual_protect: None,
        dirty_ring: None,
    };
    differential("get without manual protect", cfg, |b, o| {
        // Nothing written yet: empty logs.
        get_all(b, o);
        let first = [
            gpa(1, 0),
            gpa(1, 5),
            gpa(1, 63),
            gpa(1, 64),
            gpa(1, 299),
            gpa(2, 7),
        ];
        b.write(0, &first, 0x1111);
        get_all(b, o);
        // GET cleared and re-protected: only the new writes (some to pages written before).
        let second = [
            gpa(1, 5),
            gpa(1, 100),
            gpa(2, 0),
            gpa(2, 127),
            gpa(2, 7),
            gpa(2, 7),
        ];
        b.write(0, &second, 0x2222);
        get_all(b, o);
        get_all(b, o);
        for g in [gpa(1, 0), gpa(1, 5), gpa(2, 7), gpa(2, 127)] {
            o.push(Obs::Word(g, b.read(g)));
        }
    });
}

fn manual_protect_clear_rules_and_reprotection() {
    let cfg = Config {
        vcpus: 1,
        manual_protect: Some(false),
        dirty_ring: None,
    };
    differential("manual protect, not initially set", cfg, |b, o| {
        let pages: Vec<u64> = [0, 1, 63, 64, 65, 127, 128, 191, 192, 255, 256, 270, 299]
            .iter()
            .map(|&p| gpa(1, p))
            .collect();
        b.write(0, &pages, 0xaaaa);
        b.write(0, &[gpa(2, 3), gpa(2, 64)], 0xaaaa);
        get_all(b, o);
        // GET does not clear in manual mode.
        get_all(b, o);
        let clear = |b: &mut dyn Backend, o: &mut Vec<Obs>, slot, first: u64, num: u64| {
            let bm = vec![u64::MAX; num.div_ceil(64).max(1) as usize];
            let ok = b.clear(slot, first, num, &bm);
            o.push(Obs::Clear(slot, first, num, ok));
        };
        // Accepted: an aligned sub-range, and a tail that ends at the end of the slot.
        clear(b, o, 1, 64, 128);
        clear(b, o, 1, 256, 44);
        get_all(b, o);
        // Rejected: unaligned first page; a length that is not a multiple of 64 and does not
        // end the slot; ranges past the end of the slot.
        clear(b, o, 1, 1, 64);
        clear(b, o, 1, 0, 65);
        clear(b, o, 1, 256, 64);
        clear(b, o, 1, 320, 64);
        clear(b, o, 2, 64, 128);
        get_all(b, o);
        // A partial bitmap: only the bits set are cleared.
        let mut half = vec![0u64; 1];
        half[0] = (1 << 63) | 1; // pages 0 and 63
        o.push(Obs::Clear(1, 0, 64, b.clear(1, 0, 64, &half)));
        get_all(b, o);
        // Cleared pages were write-protected again: new writes show up.
        b.write(0, &[gpa(1, 64), gpa(1, 0), gpa(1, 270)], 0xbbbb);
        get_all(b, o);
    });
}

fn initially_all_set() {
    let cfg = Config {
        vcpus: 1,
        manual_protect: Some(true),
        dirty_ring: None,
    };
    differential("manual protect, initially all set", cfg, |b, o| {
        // Every page reads dirty before anything was written.
        get_all(b, o);
        // Clear the first 128 pages of slot 1 and all of slot 2.
        let ones = all_ones(300);
        o.push(Obs::Clear(1, 0, 128, b.clear(1, 0, 128, &ones[..2])));
        o.push(Obs::Clear(2, 0, 128, b.clear(2, 0, 128, &all_ones(128))));
        get_all(b, o);
        // Writes inside and outside the cleared range.
        b.write(
            0,
            &[
                gpa(1, 3),
                gpa(1, 127),
                gpa(1, 128),
                gpa(1, 299),
                gpa(2, 100),
            ],
            0xcccc,
        );
        get_all(b, o);
        // Clearing the rest leaves nothing but what is written next.
        o.push(Obs::Clear(1, 0, 300, b.clear(1, 0, 300, &ones)));
        o.push(Obs::Clear(2, 0, 128, b.clear(2, 0, 128, &all_ones(128))));
        get_all(b, o);
        b.write(0, &[gpa(1, 200), gpa(2, 0)], 0xdddd);
        get_all(b, o);
    });
}

fn dirty_ring_entries() {
    let cfg = Config {
        vcpus: 2,
        manual_protect: None,
        dirty_ring: Some(512),
    };
    differential("dirty ring", cfg, |b, o| {
        let ring = |b: &mut dyn Backend, o: &mut Vec<Obs>| {
            for v in 0..2 {
                let set: BTreeSet<(u32, u64)> = b.harvest(v).into_iter().collect();
                o.push(Obs::Ring(v, set));
            }
        };
        // Disjoint pages per vCPU.
        b.write(0, &[gpa(1, 0), gpa(1, 1), gpa(1, 299), gpa(2, 5)], 1);
        b.write(1, &[gpa(1, 64), gpa(2, 6), gpa(2, 127)], 2);
        ring(b, o);
        // Nothing new until more writes.
        ring(b, o);
        // Each page was written once per vCPU, so both sides pushed one entry per page.
        let reset = b.reset();
        o.push(Obs::Reset(reset));
        // After the reset the pages are write-protected again: writing them again (and new
        // pages) produces entries again.
        b.write(0, &[gpa(1, 0), gpa(1, 2), gpa(2, 5)], 3);
        b.write(1, &[gpa(1, 64), gpa(1, 65)], 4);
        ring(b, o);
        b.reset();
        // The same page from both vCPUs in one round: compared as a union.
        b.write(0, &[gpa(1, 10), gpa(2, 20)], 5);
        b.write(1, &[gpa(1, 10), gpa(1, 11)], 6);
        let mut union = BTreeSet::new();
        for v in 0..2 {
            union.extend(b.harvest(v));
        }
        o.push(Obs::RingUnion(union));
        b.reset();
        o.push(Obs::Word(gpa(1, 10), b.read(gpa(1, 10))));
        o.push(Obs::Word(gpa(2, 5), b.read(gpa(2, 5))));
    });
}

fn kvm_side_catches_its_own_misuse() {
    let mut k = KvmSide::new(Config {
        vcpus: 1,
        manual_protect: Some(false),
        dirty_ring: None,
    })
    .expect("kvm VM");
    // Bitmaps shorter than the range would let KVM read past them: refused before the ioctl.
    assert!(matches!(
        k.0.clear_dirty_log(1, 0, 128, &[u64::MAX]),
        Err(KvmError::InvalidParams(_))
    ));
    assert!(k.0.run_writes(0, &[TEST_MEM_GPA - 8], 1).is_err());
    assert!(k.0.run_writes(5, &[TEST_MEM_GPA], 1).is_err());
    assert!(k.0.dirty_ring_harvest(0).is_err());
    assert!(k.0.get_dirty_log(9).is_err());
}

mod support;
use support::Needs;

fn main() -> std::process::ExitCode {
    support::run(&[
        (
            "get_dirty_log_without_manual_protect",
            Needs::Kvm,
            get_dirty_log_without_manual_protect,
        ),
        (
            "manual_protect_clear_rules_and_reprotection",
            Needs::Kvm,
            manual_protect_clear_rules_and_reprotection,
        ),
        ("initially_all_set", Needs::Kvm, initially_all_set),
        (
            "dirty_ring_entries",
            Needs::KvmDirtyRing,
            dirty_ring_entries,
        ),
        (
            "kvm_side_catches_its_own_misuse",
            Needs::Kvm,
            kvm_side_catches_its_own_misuse,
        ),
    ])
}
