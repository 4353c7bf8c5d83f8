//! `vmmu fit` end to end: costs the model itself was run with are fitted back from the
//! defaults; the selftest output of the project's real-KVM backend parses; bad input is one
//! line and exit 2.

use std::path::{Path, PathBuf};
use std::process::Command;

fn vmmu() -> Command {
    Command::new(env!("CARGO_BIN_EXE_vmmu"))
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vmmu-fit-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

const HOST: &str = "arch=x86,cpu=cascade-lake,sockets=2,cpus=48";

/// Runs `vmmu dirty-log ARGS` in virtual time at `cost` and returns its output headed by the
/// selftest's command line.
fn measured(args: &str, cost: &Path) -> String {
    let out = vmmu()
        .arg("dirty-log")
        .args(args.split_whitespace())
        .args([
            "--engine",
            "virtual",
            "--no-counters",
            "--quiet",
            "--cost-model",
        ])
        .arg(cost)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    format!(
        "# cmd: ./dirty_log_perf_test {args}\n{}",
        String::from_utf8_lossy(&out.stdout)
    )
}

fn hardware(model: &Path, name: &str) -> f64 {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model).unwrap()).unwrap();
    v["hardware"][name].as_f64().unwrap()
}

#[test]
fn costs_the_model_ran_with_are_recovered_within_one_percent() {
    let d = scratch("recover");
    let defaults = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vmmu/cost-model.default.json");
    let mut truth: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&defaults).unwrap()).unwrap();
    truth["hardware"]["tlb_miss_ns"] = 17.0.into();
    truth["hardware"]["pml_log_ns"] = 40.0.into();
    let truth_file = d.join("truth.json");
    std::fs::write(&truth_file, truth.to_string()).unwrap();
    let input: String = [
        "-v 1 -b 64M -i 2",
        "-v 2 -b 32M -i 2 -g",
        "-v 1 -b 128M -i 3",
    ]
    .iter()
    .map(|a| measured(a, &truth_file))
    .collect();
    let input_file = d.join("synthetic.txt");
    std::fs::write(&input_file, input).unwrap();
    let fitted = d.join("fitted.json");
    let out = vmmu()
        .arg("fit")
        .arg(&input_file)
        .args([
            "--host",
            HOST,
            "--params",
            "tlb_miss_ns,pml_log_ns",
            "--pull",
            "0",
        ])
        .args(["--rounds", "1", "--quiet", "--jobs", "2", "--out"])
        .arg(&fitted)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (name, want) in [("tlb_miss_ns", 17.0), ("pml_log_ns", 40.0)] {
        let got = hardware(&fitted, name);
        assert!(
            (got / want - 1.0).abs() < 0.01,
            "{name}: fitted {got}, ran with {want}\n{text}"
        );
    }
    // 3 runs × (the defaults, one secant per cost, the fitted point).
    assert!(text.contains("12 model runs"), "{text}");
    assert!(text.contains("leave-one-out"), "{text}");
    let model: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fitted).unwrap()).unwrap();
    let source = model["sources"]["hardware"]["pml_log_ns"].as_str().unwrap();
    assert!(source.starts_with("fitted by `vmmu fit` to "), "{source}");
    // The fitted model is a cost model every command takes.
    let run = vmmu()
        .args([
            "dirty-log",
            "-v",
            "1",
            "-b",
            "16M",
            "--engine",
            "virtual",
            "--quiet",
            "--cost-model",
        ])
        .arg(&fitted)
        .output()
        .unwrap();
    assert!(run.status.success());
    let _ = std::fs::remove_dir_all(&d);
}

/// Runs `vmmu fit` on `input` with `extra` flags and returns (status, stderr).
fn refused(input: &str, extra: &[&str]) -> (Option<i32>, String) {
    let d = scratch("bad");
    let f = d.join("in.txt");
    std::fs::write(&f, input).unwrap();
    let out = vmmu().arg("fit").arg(&f).args(extra).output().unwrap();
    let _ = std::fs::remove_dir_all(&d);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let ok = "# cmd: ./dirty_log_perf_test -v 1 -b 16M\nPopulate memory time: 0.1s\n";
    for (input, extra, says) in [
        ("Populate memory time: 0.1s\n", vec!["--host", HOST], "in.txt:1: selftest output before any `# cmd:"),
        ("# cmd: ./mmu_stress_test -v 2\nx: 1s\n", vec!["--host", HOST], "is not a selftest vmmu fit reads"),
        ("# cmd: ./dirty_log_perf_test -v 1\nPopulate memory time: 0.1s\nKVM_CREATE_MAPPINGS: total execution time: 1s\n", vec!["--host", HOST], "in.txt:3: `KVM_CREATE_MAPPINGS"),
        (ok, vec!["--host", "arch=x86,cpu=zen4,sockets=1,cpus=8"], "cpu=zen4"),
        (ok, vec!["--host", "arch=x86,cpu=cascade-lake"], "names no sockets"),
        (ok, vec!["--host", HOST, "--params", "pml_log_ns=10:100"], "excludes its default"),
        (ok, vec!["--host", HOST, "--params", "vm_exit_entry_ns"], "not an unsourced hardware cost"),
        ("# cmd: ./dirty_log_perf_test -v 1 -q\nPopulate memory time: 0.1s\n", vec!["--host", HOST], "the model cannot run"),
        ("# cmd: ./dirty_log_perf_test -v 1\n# param: kvm.nx_huge_pages=Y\nPopulate memory time: 0.1s\n", vec!["--host", HOST], "unknown module parameter `nx_huge_pages`"),
        // Parsed by the command line, refused by the model when it starts: still exit 2.
        ("# cmd: ./dirty_log_perf_test -v 1 -n\nPopulate memory time: 0.1s\n", vec!["--host", HOST, "--quiet"], "the model does not run"),
        (ok, vec!["--host", HOST, "--params", "pml_log_ns=0.1:100"], "narrows pml_log_ns's physical range"),
    ] {
        let (code, err) = refused(input, &extra);
        assert_eq!(code, Some(2), "{input:?} {extra:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains(says), "{input:?} {extra:?}: {err}");
    }
}

#[test]
fn the_real_kvm_backends_selftest_output_parses() {
    // The project's /dev/kvm backend prints dirty_log_perf_test's lines for a real KVM run.
    let out = vmmu()
        .args([
            "dirty-log",
            "--backend",
            "kvm",
            "-v",
            "1",
            "-b",
            "8M",
            "-i",
            "2",
            "--no-counters",
            "--quiet",
        ])
        .output()
        .unwrap();
    if !out.status.success() {
        eprintln!(
            "skipped: /dev/kvm is not usable here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return;
    }
    let text = format!(
        "# cmd: ./dirty_log_perf_test -v 1 -b 8M -i 2\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let runs = vmmu::lab::fit::parse_file("kvm", &text).unwrap();
    let keys: Vec<String> = runs[0].measurements.iter().map(|m| m.key()).collect();
    assert!(
        keys.contains(&"Iteration 2 dirty memory time".to_string()),
        "{keys:?}"
    );
    assert!(
        keys.contains(&"Populate memory time".to_string()),
        "{keys:?}"
    );
}

/// The model's own output of every selftest it runs reads as `vmmu fit` input (its extra
/// lines, such as seed 002's adjust-stage note, are informational).
#[test]
fn the_models_own_output_of_each_selftest_parses() {
    use vmmu::lab::fit::{parse_output, Selftest};
    for (test, args) in [
        (
            Selftest::DirtyLogPerf,
            "dirty-log -v 2 -b 8M -i 2 --engine virtual",
        ),
        (
            Selftest::KvmPageTable,
            "page-table --arch arm64 -m 5 -v 2 -b 8M --backward-pages 4 --engine virtual",
        ),
        (Selftest::AccessTrackingPerf, "access-tracking -v 2 -b 8M"),
    ] {
        let out = vmmu()
            .args(args.split_whitespace())
            .args(["--no-counters", "--quiet"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let m = parse_output(test, &text).unwrap_or_else(|e| panic!("{args}: {e:?}\n{text}"));
        assert!(m.len() >= 3, "{args}: {m:?}");
    }
}
