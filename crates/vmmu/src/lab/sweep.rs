//! Sweeps: many independent runs of a scenario (vCPU counts, the sides of a comparison), run
//! side by side where the engine allows, with results in the points' order; and what the sides
//! of a comparison set and are called.

use crate::arm64::{Arm64Cpu, Arm64Lock};
use crate::lab::params::DirtyLogParams;
use crate::lab::report::DirtyLogReport;
use crate::lab::LabError;
use crate::vm::MmuKind;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// Runs `run` on every point and returns the results in the points' order. Virtual-time points
/// are independent and deterministic, so up to `jobs` of them run at once, heaviest first
/// (`weight`), and the output is a serial run's. `label` names a point in progress lines. The
/// first error stops handing out points and is returned.
pub fn run_points<P: Sync, R: Send, E: Send>(
    points: &[P],
    jobs: usize,
    weight: impl Fn(&P) -> u64,
    label: impl Fn(&P) -> String + Sync,
    progress: bool,
    run: impl Fn(&P) -> Result<R, E> + Sync,
) -> Result<Vec<R>, E> {
    let workers = jobs.max(1);
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(weight(&points[i])));
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<R, E>>>> =
        (0..points.len()).map(|_| Default::default()).collect();
    std::thread::scope(|scope| {
        for _ in 0..workers.min(points.len()) {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, Relaxed);
                let Some(&i) = order.get(k) else { break };
                let r = run(&points[i]);
                let failed = r.is_err();
                *results[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
                let d = done.fetch_add(1, Relaxed) + 1;
                if progress && points.len() > 1 {
                    eprintln!("vmmu: done {d}/{}: {}", points.len(), label(&points[i]));
                }
                if failed {
                    next.store(order.len(), Relaxed);
                }
            });
        }
    });
    let mut out = Vec::new();
    for r in results {
        match r.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(r)) => out.push(r),
            Some(Err(e)) => return Err(e),
            // Not run because another point failed first.
            None => {}
        }
    }
    Ok(out)
}

/// A technique a comparison runs each side of.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Technique {
    /// Eager page splitting (x86: KVM's `eager_page_split`; arm64:
    /// `KVM_CAP_ARM_EAGER_SPLIT_CHUNK_SIZE`).
    EagerSplit,
    /// arm64's `mmu_lock` regimes side by side.
    Arm64Lock,
    /// arm64 without and with FEAT_TLBIRANGE.
    TlbiRange,
    /// x86 with EPT: dirty logging by write protection and by Intel's page-modification log.
    Pml,
}

/// One side of a comparison: its column name and what it sets.
#[derive(Clone, Debug)]
pub struct Side {
    /// The column's name (empty without a comparison).
    pub name: String,
    /// The MMU.
    pub mmu: MmuKind,
    /// Eager page splitting.
    pub eager_split: bool,
    /// KVM uses the CPU's PML.
    pub pml: bool,
}

/// The sides of comparing `compare` (or the one side without it), from the run's own MMU,
/// eager splitting and PML; named as the seeds' tables name them (KVM's module parameters on
/// x86).
pub fn sides(compare: Option<Technique>, mmu: MmuKind, eager_split: bool, pml: bool) -> Vec<Side> {
    let side = |name: &str, mmu, eager_split, pml| Side {
        name: name.to_string(),
        mmu,
        eager_split,
        pml,
    };
    let arm64 = matches!(mmu, MmuKind::Stage2 { .. });
    match compare {
        None => vec![side("", mmu, eager_split, pml)],
        Some(Technique::Pml) => [false, true]
            .iter()
            .map(|&on| {
                let name = if on { "enable_pml=Y" } else { "enable_pml=N" };
                side(name, mmu, eager_split, on)
            })
            .collect(),
        Some(Technique::EagerSplit) => [false, true]
            .iter()
            .map(|&on| {
                let name = match (arm64, on) {
                    (false, false) => "eager_page_split=N",
                    (false, true) => "eager_page_split=Y",
                    (true, false) => "eager split off",
                    (true, true) => "eager split on",
                };
                side(name, mmu, on, pml)
            })
            .collect(),
        Some(Technique::Arm64Lock) => Arm64Lock::ALL
            .iter()
            .map(|&regime| {
                let q = stage2_variant(mmu, |lock, _| *lock = regime);
                side(regime.name(), q, eager_split, pml)
            })
            .collect(),
        Some(Technique::TlbiRange) => [false, true]
            .iter()
            .map(|&on| {
                let q = stage2_variant(mmu, |_, cpu| cpu.tlbi_range = on);
                let name = if on {
                    "tlbi-range on"
                } else {
                    "tlbi-range off"
                };
                side(name, q, eager_split, pml)
            })
            .collect(),
    }
}

/// The MMU as a comparison's header names it: KVM's module parameters on x86 (with `pml`); the
/// guest mode `guest_mode`, the lock regime and the CPU features on arm64; leaving out what
/// `compare` varies.
pub fn describe(mmu: MmuKind, pml: bool, guest_mode: u32, compare: Option<Technique>) -> String {
    let pml = match (compare, pml) {
        (Some(Technique::Pml), _) => "",
        (_, true) => ", enable_pml=Y",
        (_, false) => ", enable_pml=N",
    };
    match mmu {
        MmuKind::Tdp => format!("ept=Y, tdp_mmu=Y{pml}"),
        MmuKind::Shadow { ept: true } => format!("ept=Y, tdp_mmu=N{pml}"),
        MmuKind::Shadow { ept: false } => "ept=N, tdp_mmu=N".to_string(),
        MmuKind::Stage2 { lock, cpu, .. } => format!(
            "arm64 -m {guest_mode}{}{}{}",
            if compare == Some(Technique::Arm64Lock) {
                String::new()
            } else {
                format!(", {}", lock.name())
            },
            if cpu.tlbi_range && compare != Some(Technique::TlbiRange) {
                ", FEAT_TLBIRANGE"
            } else {
                ""
            },
            if cpu.fwb { ", FEAT_S2FWB" } else { "" }
        ),
    }
}

/// `mmu` with its arm64 stage 2's lock regime or CPU features changed by `change` (an x86 MMU
/// is returned as it is).
fn stage2_variant(mut mmu: MmuKind, change: impl Fn(&mut Arm64Lock, &mut Arm64Cpu)) -> MmuKind {
    if let MmuKind::Stage2 { lock, cpu, .. } = &mut mmu {
        change(lock, cpu);
    }
    mmu
}

/// The points of a `dirty-log` sweep in table order: for each vCPU count in `counts`, each side
/// of `sides` applied to `base`, named by its side. Every point is validated first: the error
/// names the vCPU count whose configuration is refused.
pub fn dirty_log_points(
    base: &DirtyLogParams,
    counts: &[u32],
    sides: &[Side],
) -> Result<Vec<(String, DirtyLogParams)>, LabError> {
    let mut points = Vec::with_capacity(counts.len() * sides.len());
    for &n in counts {
        let q = DirtyLogParams {
            vcpus: n as usize,
            ..base.clone()
        };
        q.validate()
            .map_err(|e| LabError::Invalid(format!("with {n} vCPUs: {e}")))?;
        for s in sides {
            let p = DirtyLogParams {
                mmu: s.mmu,
                eager_split: s.eager_split,
                pml: s.pml,
                ..q.clone()
            };
            points.push((s.name.clone(), p));
        }
    }
    Ok(points)
}

/// The reports of a sweep of `sides` sides per vCPU count (in [`dirty_log_points`]' order),
/// grouped by vCPU count as a comparison's tables read them.
pub fn by_vcpus(reports: &[DirtyLogReport], sides: usize) -> Vec<(usize, Vec<DirtyLogReport>)> {
    reports
        .chunks(sides.max(1))
        .map(|c| (c[0].params.vcpus, c.to_vec()))
        .collect()
}
