//! The host-memory pre-check predicts what a run needs: its prediction against the measured
//! peak RSS of `dirty-log` runs of three sizes, within 25 %.

use std::process::Command;
use vmmu::lab::params::DirtyLogParams;

/// The largest peak RSS of the children waited for so far, in bytes (`getrusage()`).
fn children_peak_rss() -> u64 {
    // SAFETY: getrusage() writes the struct it is given, which lives on this stack frame.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_CHILDREN is a valid `who`.
    let r = unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) };
    assert_eq!(r, 0, "getrusage failed");
    u.ru_maxrss as u64 * 1024
}

#[test]
fn the_pre_check_predicts_the_peak_within_a_quarter() {
    // Increasing sizes: the children's peak so far is the last one's.
    for (bytes, mmu) in [("256M", "tdp"), ("1G", "tdp"), ("2G", "shadow")] {
        let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
            .args([
                "dirty-log",
                "-b",
                bytes,
                "-i",
                "1",
                "--mmu",
                mmu,
                "--engine",
                "virtual",
                "--quiet",
            ])
            .output()
            .expect("the vmmu binary runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let measured = children_peak_rss() as f64;
        let p = DirtyLogParams {
            vcpu_memory_bytes: vmmu::units::parse_size(bytes).unwrap(),
            iterations: 1,
            mmu: if mmu == "tdp" {
                vmmu::vm::MmuKind::Tdp
            } else {
                vmmu::vm::MmuKind::Shadow { ept: true }
            },
            ..Default::default()
        };
        let predicted = vmmu::lab::test_vm::host_bytes_needed(&p.test_vm()) as f64;
        let off = (measured - predicted).abs() / measured;
        assert!(
            off <= 0.25,
            "-b {bytes} --mmu {mmu}: predicted {:.1} MiB, measured peak {:.1} MiB ({:.0} % off)",
            predicted / 1048576.0,
            measured / 1048576.0,
            off * 100.0
        );
    }
}
