//! `vmmu calibrate --quick` end to end: it times the workloads, prints the fit and writes a cost
//! file that loads, with every cost finite and non-negative; it keeps an existing file unless
//! told `--force`.

use std::path::Path;
use std::process::{Command, Output};
use vmmu::cost::{CostModel, HardwareCosts};

fn calibrate(out: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(["calibrate", "--quick", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("run vmmu")
}

#[test]
fn quick_calibration_writes_a_cost_model_that_loads() {
    let dir = std::env::temp_dir().join(format!("vmmu-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("costs.json");
    let _ = std::fs::remove_file(&out);

    let o = calibrate(&out, &["--counts"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "vmmu calibrate failed: {stderr}");
    let stdout = String::from_utf8(o.stdout).unwrap();
    for want in [
        "fault_4k_write",
        "split_1g_to_4k",
        "get_clear",
        "tlb_miss_write",
        "residual",
        "What each workload's Meter counted",
        "Hardware costs keep their defaults",
    ] {
        assert!(stdout.contains(want), "no {want:?} in:\n{stdout}");
    }

    let model = CostModel::load(&out).unwrap();
    for f in CostModel::software_fields() {
        let ns = model.software_ns(f).unwrap();
        assert!(ns.is_finite() && ns >= 0.0, "software.{f} = {ns}");
    }
    for n in HardwareCosts::NAMES {
        let ns = model.hardware.get(n).unwrap();
        assert!(ns.is_finite() && ns >= 0.0, "hardware.{n} = {ns}");
    }
    assert_eq!(model.hardware, CostModel::default().hardware);
    assert!(
        model.origin.contains("vmmu calibrate --quick"),
        "{}",
        model.origin
    );
    assert!(model
        .source("software.pf_slow")
        .unwrap()
        .contains("fitted by vmmu calibrate"));

    // An existing file is kept, and the refusal is one line naming --force.
    let before = std::fs::read_to_string(&out).unwrap();
    let o = calibrate(&out, &[]);
    assert_eq!(o.status.code(), Some(2));
    let stderr = String::from_utf8(o.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("already exists") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&out).unwrap(), before);

    // With --force it is replaced.
    let o = calibrate(&out, &["--force"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    CostModel::load(&out).unwrap();

    std::fs::remove_dir_all(&dir).unwrap();
}
