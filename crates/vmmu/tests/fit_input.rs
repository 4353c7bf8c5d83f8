//! `vmmu fit` reads real selftest output: the KVM/arm64 6.1 runs kept in
//! `tests/data/arm64-kvm-6.1-selftests/` (see its README), each turned into a fit input by
//! heading its selftest lines with their command line, and a run of the project's backend on
//! an x86 host's `/dev/kvm` kept in `tests/data/x86-dev-kvm/`.

use std::path::Path;
use vmmu::lab::fit::{parse_file, Selftest};

/// The file's selftest lines as `vmmu fit` input: `# cmd:` from the harness's BEGIN line, and
/// everything up to the harness's own counters.
fn as_input(text: &str) -> String {
    let mut lines = text.lines();
    let begin = lines.next().unwrap();
    let cmd = begin.split_once(": ").unwrap().1;
    let body: Vec<&str> = lines
        .take_while(|l| !l.starts_with("----- counters"))
        .collect();
    format!("# cmd: ./{cmd}\n{}\n", body.join("\n"))
}

fn read(name: &str) -> vmmu::lab::fit::Run {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/arm64-kvm-6.1-selftests")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap();
    let mut runs = parse_file(name, &as_input(&text)).unwrap();
    assert_eq!(runs.len(), 1);
    runs.remove(0)
}

#[test]
fn dirty_log_perf_test_output_gives_every_phase_of_every_iteration() {
    for name in [
        "dirty_log_perf_test-m5-v1-b64M-i3.txt",
        "dirty_log_perf_test-m5-v2-b64M-i3-o-hugetlb2mb.txt",
    ] {
        let r = read(name);
        assert_eq!(r.test, Selftest::DirtyLogPerf);
        let keys: Vec<String> = r.measurements.iter().map(|m| m.key()).collect();
        let mut want = vec![
            "Populate memory time".to_string(),
            "Enabling dirty logging time".into(),
        ];
        for i in 1..=3 {
            for what in ["dirty memory", "get dirty log", "clear dirty log"] {
                want.push(format!("Iteration {i} {what} time"));
            }
        }
        want.push("Disabling dirty logging time".into());
        assert_eq!(keys, want, "{name}");
    }
    let r = read("dirty_log_perf_test-m5-v1-b64M-i3.txt");
    assert_eq!(r.args, ["-m", "5", "-v", "1", "-b", "64M", "-i", "3"]);
    assert_eq!(r.measurements[0].seconds, 18.0282012);
}

#[test]
fn kvm_page_table_test_output_gives_its_stages_past_kernel_log_lines() {
    // The first file has a kernel log line (`[  428.372525] hrtimer: ...`) between stages.
    for name in [
        "kvm_page_table_test-m5-b64M-v1.txt",
        "kvm_page_table_test-m5-b64M-v2-thp.txt",
    ] {
        let r = read(name);
        assert_eq!(r.test, Selftest::KvmPageTable);
        let labels: Vec<&str> = r.measurements.iter().map(|m| m.label.as_str()).collect();
        assert_eq!(
            labels,
            [
                "KVM_CREATE_MAPPINGS: total execution time",
                "KVM_UPDATE_MAPPINGS: total execution time",
                "KVM_ADJUST_MAPPINGS: total execution time"
            ],
            "{name}"
        );
    }
}

#[test]
fn an_x86_dev_kvm_run_gives_every_phase() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/x86-dev-kvm/dirty_log_perf_test-v2-b64M-i3.txt");
    let text = std::fs::read_to_string(&p).unwrap();
    let runs = parse_file("x86", &text).unwrap();
    let keys: Vec<String> = runs[0].measurements.iter().map(|m| m.key()).collect();
    assert_eq!(keys.len(), 12, "{keys:?}");
    assert_eq!(keys[4], "Iteration 1 clear dirty log time");
    assert_eq!(runs[0].measurements[0].seconds, 0.42740804);
}
