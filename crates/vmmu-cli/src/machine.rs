//! The options every scenario shares: which architecture and MMU the model runs, the CPU's
//! features, KVM's switches, the engine and the output format; their checks (one line, exit 2),
//! the sides of a `--compare`, and running independent configurations on every core.

use clap::ValueEnum;
use std::path::PathBuf;
use vmmu::host::backing::Backing;
use vmmu::lab::sweep::{run_points, Side};
use vmmu::units::parse_size;

/// `on` or `off`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// The host kernel's preemption model.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum HostPreemptArg {
    /// CONFIG_PREEMPTION (PREEMPT, PREEMPT_RT, any PREEMPT_DYNAMIC build): rwlock_needbreak()
    /// reports waiters, so eager splitting and other long jobs drop mmu_lock when contended.
    Full,
    /// PREEMPT_NONE or PREEMPT_VOLUNTARY without PREEMPT_DYNAMIC: rwlock_needbreak() is always
    /// false, so long jobs keep mmu_lock to the end.
    None,
}

/// How the TDP MMU's eager split allocates page tables.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum SplitAllocArg {
    /// Up to Linux 6.10: GFP_NOWAIT under mmu_lock, dropping it only if that fails.
    NowaitFirst,
    /// Linux 6.11 and later: always drop mmu_lock to allocate.
    DropLock,
}

/// `--hz`: a tick rate Linux can be built with, or 0.
fn parse_hz(s: &str) -> Result<u32, String> {
    match s.parse::<u32>() {
        Ok(hz @ (0 | 100 | 250 | 300 | 1000)) => Ok(hz),
        _ => Err(format!(
            "'{s}' is not a tick rate Linux offers: use 100, 250, 300 or 1000 (CONFIG_HZ), or 0 for none"
        )),
    }
}

/// How the host backs reads of private anonymous memory nobody wrote.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum ZeroPageArg {
    /// Up to Linux 6.9: reads map the shared zero page read-only; the first write copies it
    /// inside invalidate_range_start/end, with KVM's change_pte callback between (arm64 maps
    /// the new page read-only at once).
    ChangePte,
    /// Linux 6.10 and later: the same without change_pte (the callback was deleted).
    NoChangePte,
    /// No zero page (mm_forbids_zeropage()): every first touch allocates a page.
    Off,
}

/// What drives the model.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Engine {
    /// One OS thread per vCPU, real locks and atomics; times are this machine's.
    Threads,
    /// Every actor on one thread in virtual-time order; times come from the cost model and are
    /// the same on every run.
    Virtual,
}

/// A technique `--compare` runs both sides of.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Technique {
    /// Eager page splitting (x86: KVM's eager_page_split; arm64: KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE).
    EagerSplit,
    /// arm64's mmu_lock regimes side by side: spin, perm-fast-path-v2, perm-fast-path, parallel.
    Arm64Lock,
    /// arm64 without and with FEAT_TLBIRANGE (range TLB invalidation, Linux 6.6).
    TlbiRange,
    /// x86 with EPT: dirty logging by write protection (enable_pml=0, or a CPU without PML) and
    /// by Intel's page-modification log (enable_pml=1, KVM's default on Intel since Linux 4.0).
    Pml,
}

impl Technique {
    /// The library's name for it.
    pub fn lab(self) -> vmmu::lab::sweep::Technique {
        match self {
            Technique::EagerSplit => vmmu::lab::sweep::Technique::EagerSplit,
            Technique::Arm64Lock => vmmu::lab::sweep::Technique::Arm64Lock,
            Technique::TlbiRange => vmmu::lab::sweep::Technique::TlbiRange,
            Technique::Pml => vmmu::lab::sweep::Technique::Pml,
        }
    }
}

/// The modelled architecture.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Arch {
    /// x86 with EPT (or shadow paging): the TDP MMU or the shadow MMU.
    X86,
    /// arm64: KVM/arm64's stage-2 MMU at the 4K granule.
    Arm64,
}

/// How arm64 invalidates a relaxed permission.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum RelaxFlushArg {
    /// Linux up to 6.4: __kvm_tlb_flush_vmid_ipa(), broadcast and waited for.
    Broadcast,
    /// Linux 6.5 and later: __kvm_tlb_flush_vmid_ipa_nsh(), on the faulting PE only.
    Local,
}

/// How arm64's stage-2 faults take `mmu_lock`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Arm64LockArg {
    /// Linux 5.17 and earlier: mmu_lock is a spinlock; every fault holds it.
    Spin,
    /// Seed 001 as posted (v2) and merged in 5.18-rc1, never released: every write-permission
    /// fault while logging takes the read lock, so a block is split under it with the exclusive
    /// walker. Unsafe: two faults on one block race (upstream's WARN, fixed in 5.18-rc); the
    /// invariants report it.
    PermFastPathV2,
    /// Linux 5.18-6.1 (seed 001 with the 5.18-rc fix): an rwlock; write-permission faults on
    /// 4K pages during dirty logging are relaxed under the read lock, every other fault takes
    /// the write lock.
    PermFastPath,
    /// Linux 6.2 and later: every stage-2 fault under the read lock, with cmpxchg
    /// break-before-make.
    Parallel,
}

impl Arm64LockArg {
    pub fn regime(self) -> vmmu::arm64::Arm64Lock {
        match self {
            Arm64LockArg::Spin => vmmu::arm64::Arm64Lock::Spin,
            Arm64LockArg::PermFastPathV2 => vmmu::arm64::Arm64Lock::PermFastPathV2,
            Arm64LockArg::PermFastPath => vmmu::arm64::Arm64Lock::PermFastPath,
            Arm64LockArg::Parallel => vmmu::arm64::Arm64Lock::Parallel,
        }
    }
}

/// Which x86 MMU.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum MmuKind {
    /// The x86 TDP MMU (tdp_mmu=Y).
    Tdp,
    /// The x86 shadow MMU (tdp_mmu=N): direct with EPT, shadow paging with --ept off.
    Shadow,
}

/// The guest's own page size under shadow paging.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum GuestPageSize {
    /// 4 KiB guest pages.
    #[value(name = "4k")]
    Size4k,
    /// 2 MiB guest pages.
    #[value(name = "2m")]
    Size2m,
}

pub fn parse_backing(s: &str) -> Result<Backing, String> {
    s.parse().map_err(|e: vmmu::host::HostError| e.to_string())
}

/// The machine a scenario runs on: architecture, MMU, CPU features, KVM's switches, engine and
/// output.
#[derive(clap::Args)]
pub struct MachineArgs {
    /// Backing source of guest memory: anonymous, anonymous_thp, anonymous_hugetlb_2mb,
    /// anonymous_hugetlb_1gb; the selftests' anonymous_hugetlb (2 MiB), shared_thp,
    /// shared_hugetlb (2 MiB) and shmem (4 KiB pages) are modelled as the private source of the
    /// same page size, and reports name that source.
    #[arg(short = 's', default_value = "anonymous", value_parser = parse_backing)]
    pub backing: Backing,
    /// Eager page splitting: on x86 KVM's eager_page_split module parameter (default on); on
    /// arm64 KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE set to --split-chunk (Linux 6.4; default off, as
    /// KVM leaves it until the VMM sets it).
    #[arg(long, value_enum)]
    pub eager_split: Option<OnOff>,
    /// The architecture the model runs.
    #[arg(long, value_enum, default_value = "x86")]
    pub arch: Arch,
    /// With --arch arm64: how stage-2 faults take mmu_lock (default parallel).
    #[arg(long, value_enum, value_name = "REGIME")]
    pub arm64_lock: Option<Arm64LockArg>,
    /// With --arch arm64: the guest mode (the selftests' -m): 2-7 and 11-14; 2 is PA-bits:48,
    /// VA-bits:48, 4K pages (default 5, PA-bits:40, 4K pages, aarch64's VM_MODE_DEFAULT).
    #[arg(short = 'm', value_name = "MODE")]
    pub guest_mode: Option<u32>,
    /// With --arch arm64: the CPU has FEAT_TLBIRANGE, so KVM (6.6+) invalidates ranges instead
    /// of the whole VMID (default off, as on the Neoverse-N1 of an Ampere Altra).
    #[arg(long, value_enum)]
    pub tlbi_range: Option<OnOff>,
    /// With --arch arm64: the CPU has FEAT_S2FWB, so KVM does no cache maintenance before
    /// mapping a page, and with FEAT_TLBIRANGE defers an unmap's TLBIs to one range flush
    /// (default off, as on Neoverse-N1).
    #[arg(long, value_enum)]
    pub fwb: Option<OnOff>,
    /// With --arch arm64: how a relaxed permission is invalidated: broadcast to every PE (Linux
    /// up to 6.4, default) or on the faulting PE only (6.5 and later).
    #[arg(long, value_enum)]
    pub relax_flush: Option<RelaxFlushArg>,
    /// With --arch arm64 and eager splitting on: the split chunk size, a block size the 4K
    /// granule supports (4K, 2M or 1G; default 2M).
    #[arg(long, value_name = "SIZE")]
    pub split_chunk: Option<String>,
    /// Which x86 MMU to model (default tdp).
    #[arg(long, value_enum)]
    pub mmu: Option<MmuKind>,
    /// KVM's ept module parameter; off means shadow paging (needs --mmu shadow).
    #[arg(long, value_enum, default_value = "on")]
    pub ept: OnOff,
    /// x86 with EPT: the CPU has PML and KVM uses it (KVM's enable_pml: on by default on Intel
    /// since Linux 4.0, as on the Cascade Lake the model's costs describe): enabling logging
    /// clears D on 4K leaves instead of write-protecting them, the CPU logs each page it dirties
    /// and exits every 512, and GET/CLEAR kick the vCPUs first. off: write protection (AMD, or
    /// enable_pml=0). Default on with --ept on and off with --ept off, where on is refused (PML
    /// needs EPT); not available on arm64.
    #[arg(long, value_enum)]
    pub pml: Option<OnOff>,
    /// The host kernel's preemption model, which decides whether rwlock_needbreak() can report
    /// a waiter: full (CONFIG_PREEMPTION: PREEMPT, PREEMPT_RT and every PREEMPT_DYNAMIC build,
    /// as distribution kernels are since Linux 5.12; the default, and what seed 000's lock drops
    /// "if there is any contention" need) or none (PREEMPT_NONE or PREEMPT_VOLUNTARY builds
    /// without PREEMPT_DYNAMIC: long jobs never yield mmu_lock to a waiter).
    #[arg(long, value_enum, default_value = "full")]
    pub host_preempt: HostPreemptArg,
    /// x86 TDP MMU: how eager splitting allocates each table: nowait-first (up to Linux 6.10,
    /// seed 000's kernel included: GFP_NOWAIT under mmu_lock) or drop-lock (6.11 and later: drop
    /// mmu_lock to allocate, then restart the walk). Default nowait-first.
    #[arg(long, value_enum)]
    pub tdp_split_alloc: Option<SplitAllocArg>,
    /// -s anonymous: how the host answers a read of a page nobody wrote. change-pte (Linux up
    /// to 6.9, the default): it maps the shared zero page read-only, KVM maps it read-only too,
    /// and the first write copies it, telling KVM through invalidate_range_start,
    /// change_pte (arm64 6.1 maps the new page read-only at once) and invalidate_range_end;
    /// no-change-pte (6.10 and later): the same without change_pte; off: no zero page, a read
    /// allocates a page as a write does. Other backings map their memory from the start.
    #[arg(long, value_enum, default_value = "change-pte")]
    pub zero_page: ZeroPageArg,
    /// The host kernel's CONFIG_HZ: scheduling-clock interrupts each busy CPU takes a second,
    /// each a VM exit of the vCPU on it, at the same instants on every CPU (--engine virtual).
    /// 250 as distributions build x86 and arm64 kernels (the default); 100, 300 or 1000 as
    /// other builds; 0 for none (nohz_full with one task per CPU).
    #[arg(long, default_value_t = 250, value_parser = parse_hz)]
    pub hz: u32,
    /// With --ept off: the page size the guest maps its memory with in its own page tables.
    #[arg(long, value_enum, default_value = "2m")]
    pub guest_page_size: GuestPageSize,
    /// Which engine drives the model (default: threads for one run, virtual for sweeps and
    /// --compare).
    #[arg(long, value_enum)]
    pub engine: Option<Engine>,
    /// With --engine virtual: the cost model file (as `vmmu calibrate` writes it); the built-in
    /// defaults of the architecture otherwise (arm64: an Ampere Altra's hardware costs).
    #[arg(long, value_name = "FILE")]
    pub cost_model: Option<PathBuf>,
    /// Print the report as JSON instead of the selftest's text.
    #[arg(long)]
    pub json: bool,
    /// Leave out the per-phase counters: the indented lines of the text output, the `counters`
    /// objects of the JSON.
    #[arg(long)]
    pub no_counters: bool,
    /// No progress lines on stderr (by default each phase, and each point of a sweep, is
    /// announced there as it starts or ends, terminal or not).
    #[arg(long)]
    pub quiet: bool,
    /// Sweep points run at once, in virtual time (default: the cores available); the output
    /// is a serial run's. The threads engine measures this machine, so it runs one at a time.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
}

impl MachineArgs {
    /// The x86 MMU the flags select.
    pub fn mmu_kind(&self) -> MmuKind {
        self.mmu.unwrap_or(MmuKind::Tdp)
    }

    /// `--split-chunk` in 4 KiB pages (2M when not given).
    fn split_chunk_pages(&self) -> Result<u64, String> {
        let Some(s) = &self.split_chunk else {
            return Ok(vmmu::units::PageSize::Size2M.pages());
        };
        let bytes = parse_size(s).map_err(|e| format!("--split-chunk {s}: {e}"))?;
        vmmu::units::PageSize::ALL
            .iter()
            .find(|p| p.pages() * vmmu::units::PAGE_SIZE == bytes)
            .map(|p| p.pages())
            .ok_or_else(|| {
                format!(
                    "--split-chunk {s}: not a block size the 4K granule supports; use 4K, 2M or 1G"
                )
            })
    }

    /// The modelled MMU and guest mode the flags select.
    pub fn vm_kind(&self) -> Result<(vmmu::vm::MmuKind, Option<u32>), String> {
        Ok(match self.arch {
            Arch::X86 => (
                match self.mmu_kind() {
                    MmuKind::Tdp => vmmu::vm::MmuKind::Tdp,
                    MmuKind::Shadow => vmmu::vm::MmuKind::Shadow {
                        ept: self.ept == OnOff::On,
                    },
                },
                None,
            ),
            Arch::Arm64 => {
                let mode = self
                    .guest_mode
                    .unwrap_or(vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE);
                let m = vmmu::lab::params::GuestMode::arm64(mode)?;
                (
                    vmmu::vm::MmuKind::Stage2 {
                        lock: self.arm64_lock.unwrap_or(Arm64LockArg::Parallel).regime(),
                        ia_bits: m.pa_bits,
                        split_chunk_pages: self.split_chunk_pages()?,
                        cpu: vmmu::arm64::Arm64Cpu {
                            tlbi_range: self.tlbi_range == Some(OnOff::On),
                            fwb: self.fwb == Some(OnOff::On),
                        },
                        relax_flush: match self.relax_flush {
                            Some(RelaxFlushArg::Local) => vmmu::arm64::RelaxFlush::Local,
                            _ => vmmu::arm64::RelaxFlush::Broadcast,
                        },
                    },
                    Some(mode),
                )
            }
        })
    }

    /// `p` with what these flags choose: the backing, the MMU and guest mode, eager
    /// splitting, PML and the host kernel.
    pub fn vm_params(
        &self,
        p: vmmu::lab::params::DirtyLogParams,
    ) -> Result<vmmu::lab::params::DirtyLogParams, String> {
        let (mmu, guest_mode) = self.vm_kind()?;
        Ok(vmmu::lab::params::DirtyLogParams {
            backing: self.backing,
            eager_split: self.eager_split(),
            pml: self.pml(),
            kernel: self.kernel(),
            mmu,
            guest_page_level: self.guest_page_level(),
            guest_mode,
            ..p
        })
    }

    /// Eager page splitting: as given, else on for x86 (the module parameter's default) and off
    /// for arm64 (the capability is unset).
    pub fn eager_split(&self) -> bool {
        self.eager_split
            .map_or(self.arch == Arch::X86, |e| e == OnOff::On)
    }

    /// The host kernel's choices.
    pub fn kernel(&self) -> vmmu::vm::HostKernel {
        vmmu::vm::HostKernel {
            preemption: match self.host_preempt {
                HostPreemptArg::Full => vmmu::kvm::mmu_lock::Preemption::Full,
                HostPreemptArg::None => vmmu::kvm::mmu_lock::Preemption::None,
            },
            tdp_split_alloc: match self.tdp_split_alloc {
                None | Some(SplitAllocArg::NowaitFirst) => {
                    vmmu::x86::tdp_mmu::SplitAlloc::NowaitFirst
                }
                Some(SplitAllocArg::DropLock) => vmmu::x86::tdp_mmu::SplitAlloc::DropLock,
            },
            hz: self.hz,
            zero_page: match self.zero_page {
                ZeroPageArg::ChangePte => vmmu::kvm::host_fault::ZeroPage::ChangePte,
                ZeroPageArg::NoChangePte => vmmu::kvm::host_fault::ZeroPage::NoChangePte,
                ZeroPageArg::Off => vmmu::kvm::host_fault::ZeroPage::Off,
            },
        }
    }

    /// KVM uses PML: as given, else on for x86 with EPT (KVM's default on Intel).
    pub fn pml(&self) -> bool {
        self.pml
            .map_or(self.arch == Arch::X86 && self.ept == OnOff::On, |p| {
                p == OnOff::On
            })
    }

    /// The guest's page level under shadow paging.
    pub fn guest_page_level(&self) -> vmmu::x86::spte::Level {
        match self.guest_page_size {
            GuestPageSize::Size4k => vmmu::x86::spte::PG_LEVEL_4K,
            GuestPageSize::Size2m => vmmu::x86::spte::PG_LEVEL_2M,
        }
    }

    /// The cost model: `--cost-model`, or the architecture's defaults.
    pub fn cost_model(&self) -> Result<vmmu::cost::CostModel, String> {
        match &self.cost_model {
            Some(f) => vmmu::cost::CostModel::load(f).map_err(|e| e.to_string()),
            None if self.arch == Arch::Arm64 => Ok(vmmu::cost::CostModel::default_arm64()),
            None => Ok(vmmu::cost::CostModel::default()),
        }
    }

    /// Checks the machine flags against each other, `--compare` and the engine; a usage error
    /// is one line.
    pub fn check(&self, compare: Option<Technique>, engine: Engine) -> Result<(), String> {
        check_jobs(self.jobs, engine)?;
        if self.arch == Arch::Arm64 {
            if self.mmu.is_some() {
                return Err(
                    "--mmu selects an x86 MMU (tdp or shadow); --arch arm64 has one, the stage-2 MMU"
                        .into(),
                );
            }
            if self.ept == OnOff::Off {
                return Err(
                    "--ept is x86's; arm64 always translates guest physical addresses through stage 2"
                        .into(),
                );
            }
            if self.pml.is_some() || compare == Some(Technique::Pml) {
                return Err("--pml is Intel's page-modification log; arm64 logs dirty pages by write protection only".into());
            }
        } else {
            if self.arm64_lock.is_some() {
                return Err("--arm64-lock applies to --arch arm64 (x86's TDP MMU faults under the read lock, its shadow MMU under the write lock)".into());
            }
            if self.guest_mode.is_some() {
                return Err("-m: x86 has one guest mode (PA-bits:ANY, VA-bits:48, 4K pages); -m applies to --arch arm64".into());
            }
            if self.split_chunk.is_some() {
                return Err(
                    "--split-chunk is KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE and applies to --arch arm64"
                        .into(),
                );
            }
            if compare == Some(Technique::Arm64Lock) {
                return Err(
                    "--compare arm64-lock compares arm64's lock regimes: add --arch arm64".into(),
                );
            }
            if self.relax_flush.is_some() {
                return Err("--relax-flush is KVM/arm64's invalidation after a permission relaxation: add --arch arm64".into());
            }
            if self.tlbi_range.is_some()
                || self.fwb.is_some()
                || compare == Some(Technique::TlbiRange)
            {
                return Err("--tlbi-range and --fwb are arm64 CPU features (FEAT_TLBIRANGE, FEAT_S2FWB): add --arch arm64".into());
            }
        }
        if compare == Some(Technique::Arm64Lock) && self.arm64_lock.is_some() {
            return Err("--compare arm64-lock runs every regime; leave out --arm64-lock".into());
        }
        if compare == Some(Technique::TlbiRange) && self.tlbi_range.is_some() {
            return Err("--compare tlbi-range runs both sides; leave out --tlbi-range".into());
        }
        if self.ept == OnOff::Off
            && (self.pml == Some(OnOff::On) || compare == Some(Technique::Pml))
        {
            return Err("--pml needs EPT (PML logs EPT Dirty-flag updates): shadow paging (--ept off) logs by write protection".into());
        }
        if self.tdp_split_alloc.is_some()
            && (self.arch != Arch::X86 || self.mmu_kind() != MmuKind::Tdp)
        {
            return Err("--tdp-split-alloc is the TDP MMU's eager split (x86, --mmu tdp); the shadow MMU tops up its split caches outside mmu_lock".into());
        }
        if compare == Some(Technique::Pml) && self.pml.is_some() {
            return Err("--compare pml runs both sides; leave out --pml".into());
        }
        if compare == Some(Technique::EagerSplit) && self.eager_split.is_some() {
            return Err("--compare eager-split runs both sides; leave out --eager-split".into());
        }
        if self.split_chunk.is_some()
            && self.eager_split != Some(OnOff::On)
            && compare != Some(Technique::EagerSplit)
        {
            return Err("--split-chunk sizes eager splitting, which is off by default on arm64: add --eager-split on".into());
        }
        if self.ept == OnOff::Off && self.mmu_kind() != MmuKind::Shadow {
            return Err(
                "--ept off means shadow paging, which only the shadow MMU does: add --mmu shadow"
                    .into(),
            );
        }
        if self.guest_page_size != GuestPageSize::Size2m && self.ept == OnOff::On {
            return Err(
                "--guest-page-size applies to shadow paging only (--mmu shadow --ept off)".into(),
            );
        }
        if engine == Engine::Threads && self.cost_model.is_some() {
            return Err("--cost-model applies to --engine virtual only".into());
        }
        Ok(())
    }

    /// The sides of `--compare technique` (or the one side without it), from the run's own
    /// MMU, eager splitting and PML.
    pub fn sides(
        &self,
        compare: Option<Technique>,
        mmu: vmmu::vm::MmuKind,
        eager_split: bool,
        pml: bool,
    ) -> Vec<Side> {
        vmmu::lab::sweep::sides(compare.map(Technique::lab), mmu, eager_split, pml)
    }

    /// The MMU as a comparison's header names it ([`vmmu::lab::sweep::describe`]).
    pub fn describe(&self, mmu: vmmu::vm::MmuKind, compare: Option<Technique>) -> String {
        vmmu::lab::sweep::describe(
            mmu,
            self.pml(),
            self.guest_mode
                .unwrap_or(vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE),
            compare.map(Technique::lab),
        )
    }
}

/// `--jobs` is for virtual time only: the threads engine measures this machine, and points
/// running side by side would measure each other.
pub fn check_jobs(jobs: Option<u32>, engine: Engine) -> Result<(), String> {
    match jobs {
        Some(n) if n > 1 && engine == Engine::Threads => Err(format!(
            "--jobs {n}: the threads engine measures this machine, so its sweep points run one at a time; use --engine virtual"
        )),
        _ => Ok(()),
    }
}

/// How many sweep points run at once: `--jobs`, or every core in virtual time; one with the
/// threads engine.
pub fn jobs(jobs: Option<u32>, engine: Engine) -> usize {
    match engine {
        Engine::Threads => 1,
        Engine::Virtual => jobs.map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |n| n as usize,
        ),
    }
}

/// KVM's aging on the command line.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum AgingArg {
    /// Every aging callback under mmu_lock for write, clear_flush_young flushing when young:
    /// Linux up to 6.12 on x86 (the seed's base, 6.2; 6.13 and 6.14 dropped the flush but kept
    /// the lock, which is not offered), and arm64 to this day.
    Locked,
    /// Seed 003: KVM tests and clears Accessed bits under RCU alone where the MMU can (the
    /// TDP MMU, arm64 stage 2 with hardware AF), and never flushes on young; x86's per-range
    /// callbacks do so from Linux 6.15. With MGLRU, reclaim batches its checks with
    /// test_clear_young() (the seed's mm side, not merged).
    Lockless,
}

impl From<AgingArg> for vmmu::kvm::mmu_notifier::Aging {
    fn from(a: AgingArg) -> Self {
        match a {
            AgingArg::Locked => vmmu::kvm::mmu_notifier::Aging::Locked,
            AgingArg::Lockless => vmmu::kvm::mmu_notifier::Aging::Lockless,
        }
    }
}

/// The architecture and MMU of the host-side scenarios (`reclaim`, `access-tracking`), which
/// keep the KVM defaults for everything else.
#[derive(clap::Args)]
pub struct HostMachineArgs {
    /// The architecture the model runs.
    #[arg(long, value_enum, default_value = "x86")]
    pub arch: Arch,
    /// With --arch x86: which MMU (default tdp; the shadow MMU ages under the write lock
    /// whatever --aging says, as its rmaps require).
    #[arg(long, value_enum)]
    pub mmu: Option<MmuKind>,
    /// With --arch arm64: how stage-2 faults take mmu_lock (default parallel).
    #[arg(long, value_enum, value_name = "REGIME")]
    pub arm64_lock: Option<Arm64LockArg>,
}

impl HostMachineArgs {
    /// The modelled MMU: x86's TDP or shadow MMU with EPT, or arm64's stage 2 in its default
    /// guest mode with a Neoverse-N1's features.
    pub fn vm_kind(&self) -> Result<vmmu::vm::MmuKind, String> {
        match self.arch {
            Arch::X86 => {
                if self.arm64_lock.is_some() {
                    return Err("--arm64-lock needs --arch arm64".into());
                }
                Ok(match self.mmu.unwrap_or(MmuKind::Tdp) {
                    MmuKind::Tdp => vmmu::vm::MmuKind::Tdp,
                    MmuKind::Shadow => vmmu::vm::MmuKind::Shadow { ept: true },
                })
            }
            Arch::Arm64 => {
                if self.mmu.is_some() {
                    return Err("--mmu chooses an x86 MMU; arm64 has its stage-2 MMU".into());
                }
                let mode = vmmu::lab::params::GuestMode::arm64(
                    vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE,
                )?;
                Ok(vmmu::vm::MmuKind::Stage2 {
                    lock: self.arm64_lock.unwrap_or(Arm64LockArg::Parallel).regime(),
                    ia_bits: mode.pa_bits,
                    split_chunk_pages: vmmu::units::PageSize::Size2M.pages(),
                    cpu: vmmu::arm64::Arm64Cpu::default(),
                    relax_flush: vmmu::arm64::RelaxFlush::Broadcast,
                })
            }
        }
    }

    /// The built-in cost model of the architecture.
    pub fn default_cost(&self) -> vmmu::cost::CostModel {
        match self.arch {
            Arch::X86 => vmmu::cost::CostModel::default(),
            Arch::Arm64 => vmmu::cost::CostModel::default_arm64(),
        }
    }

    /// arm64's guest mode, `None` on x86.
    pub fn guest_mode(&self) -> Option<u32> {
        (self.arch == Arch::Arm64).then_some(vmmu::lab::params::ARM64_DEFAULT_GUEST_MODE)
    }
}

/// How a scenario command (`nested-churn`, `reclaim`) runs and reports: its engine, cost model,
/// output and parallelism.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The engine: virtual (deterministic virtual time, the default) or threads (each vCPU a
    /// real thread, times measured on this machine).
    #[arg(long, value_enum, default_value = "virtual")]
    pub engine: Engine,
    /// With --engine virtual: the cost model file (as `vmmu calibrate` writes it).
    #[arg(long, value_name = "FILE")]
    pub cost_model: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Leave out the counters: only the scenario's own lines (and no `counters` objects in
    /// JSON).
    #[arg(long)]
    pub no_counters: bool,
    /// No progress lines on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Sides of --compare run at once in virtual time (default: the cores available).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
}

impl RunArgs {
    /// Checks the flags (`--jobs` only in virtual time, `--cost-model` not with the threads
    /// engine, which measures this machine) and returns the cost model virtual time prices
    /// with: the file's, or `default`. Errors are one line.
    pub fn cost_model(
        &self,
        default: impl FnOnce() -> vmmu::cost::CostModel,
    ) -> Result<vmmu::cost::CostModel, String> {
        check_jobs(self.jobs, self.engine)?;
        match &self.cost_model {
            Some(_) if self.engine == Engine::Threads => Err(
                "--cost-model prices virtual time; the threads engine measures this machine".into(),
            ),
            Some(f) => vmmu::cost::CostModel::load(f).map_err(|e| e.to_string()),
            None => Ok(default()),
        }
    }
}

/// How a scenario command runs one side on each engine, and prints one report or several.
pub struct Scenario<T, V, O, M> {
    /// The side on the threads engine, told whether to print its own progress.
    pub threads: T,
    /// The side in virtual time, priced with the cost model.
    pub virtual_time: V,
    /// One report's text, with or without its counters.
    pub one: O,
    /// Several reports side by side, with or without their counters.
    pub many: M,
}

/// Runs a scenario command's sides ([`run_points`]: at once in virtual time, up to `--jobs`;
/// only a single side prints its own progress) on the engine `run` chooses, then prints the
/// reports as `run` asks: JSON, one report's text, or the sides compared. A failed run is
/// printed and ends the command with exit code 1.
pub fn run_scenario<P: Sync, R: Send + serde::Serialize, E: Send + std::fmt::Display, T, V, O, M>(
    sides: &[P],
    run: &RunArgs,
    cost: &vmmu::cost::CostModel,
    label: impl Fn(&P) -> String + Sync,
    s: Scenario<T, V, O, M>,
) -> Result<Vec<R>, std::process::ExitCode>
where
    T: Fn(&P, bool) -> Result<R, E> + Sync,
    V: Fn(&P, &vmmu::cost::CostModel, bool) -> Result<R, E> + Sync,
    O: Fn(&R, bool) -> String,
    M: Fn(&[R], bool) -> String,
{
    let single = sides.len() == 1;
    let progress = !run.quiet && single;
    let reports = run_points(
        sides,
        jobs(run.jobs, run.engine),
        |_| 1,
        label,
        !run.quiet,
        |p| match run.engine {
            Engine::Threads => (s.threads)(p, progress),
            Engine::Virtual => (s.virtual_time)(p, cost, progress),
        },
    )
    .map_err(|e| {
        eprintln!("vmmu: {e}");
        std::process::ExitCode::from(1)
    })?;
    let counters = !run.no_counters;
    if run.json {
        print_json(&reports, counters)?;
    } else {
        match &reports[..] {
            [r] => print!("{}", (s.one)(r, counters)),
            _ => print!("{}", (s.many)(&reports, counters)),
        }
    }
    Ok(reports)
}

/// Prints the reports as JSON: one object for one run, an array for several, without the
/// phases' counters unless `with_counters`. On failure, the error is printed and the exit code
/// returned.
pub fn print_json<T: serde::Serialize>(
    reports: &[T],
    with_counters: bool,
) -> Result<(), std::process::ExitCode> {
    let out = match (reports.len() == 1, with_counters) {
        (true, true) => serde_json::to_string_pretty(&reports[0]),
        (false, true) => serde_json::to_string_pretty(&reports),
        // Through a JSON value, whose objects list their keys in sorted order.
        (one, false) => {
            let value = if one {
                serde_json::to_value(&reports[0])
            } else {
                serde_json::to_value(reports)
            };
            value.and_then(|mut v| {
                strip_counters(&mut v);
                serde_json::to_string_pretty(&v)
            })
        }
    };
    match out {
        Ok(s) => {
            println!("{s}");
            Ok(())
        }
        Err(e) => {
            eprintln!("vmmu: cannot encode the report as JSON: {e}");
            Err(std::process::ExitCode::from(1))
        }
    }
}

/// `--no-counters` in JSON: drops every phase's `counters` object.
fn strip_counters(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.remove("counters");
            m.values_mut().for_each(strip_counters);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip_counters),
        _ => {}
    }
}

/// What begins the line a run prints on stderr when an oracle failed (`vmmu soak` classifies
/// its runs by it).
pub const ORACLE_FAILED: &str = "oracle failed: ";

/// The run's exit code: 1 with the first oracle failure printed (each labelled by its
/// configuration), else success.
pub fn oracle_exit(mut failures: impl Iterator<Item = String>) -> std::process::ExitCode {
    match failures.next() {
        Some(msg) => {
            eprintln!("vmmu: {ORACLE_FAILED}{msg}");
            std::process::ExitCode::from(1)
        }
        None => std::process::ExitCode::SUCCESS,
    }
}
