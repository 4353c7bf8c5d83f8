//! What the reports hold, whatever the figures: options that shape the output.

use std::process::Command;

/// What `vmmu args` prints on stdout; it must succeed.
fn stdout(args: &str) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(args.split_whitespace())
        .output()
        .expect("the vmmu binary runs");
    assert!(o.status.success(), "{args}");
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn no_counters_leaves_them_out_of_the_json_too() {
    let with = stdout("dirty-log -b 4M -i 1 --engine virtual --json");
    let without = stdout("dirty-log -b 4M -i 1 --engine virtual --json --no-counters");
    assert!(with.contains("\"counters\""));
    assert!(!without.contains("\"counters\""));
    assert!(without.contains("\"wall_ns\""));
}

#[test]
fn progress_goes_to_stderr_even_when_piped_unless_quiet() {
    let err = |args: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
            .args(args.split_whitespace())
            .output()
            .expect("the vmmu binary runs");
        assert!(o.status.success(), "{args}");
        String::from_utf8(o.stderr).unwrap()
    };
    let loud = err("dirty-log -b 4M -i 1 --engine virtual");
    assert!(loud.contains("vmmu: iteration 1"), "{loud}");
    assert_eq!(err("dirty-log -b 4M -i 1 --engine virtual --quiet"), "");
}

#[test]
fn the_selftests_other_flags_and_backing_names_are_accepted() {
    let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(
            "dirty-log -b 4M -i 1 --engine virtual --quiet -c 0-3 -s shared_hugetlb --json"
                .split_whitespace(),
        )
        .output()
        .expect("the vmmu binary runs");
    assert!(o.status.success());
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(
        out.contains("\"backing\": \"anonymous_hugetlb_2mb\""),
        "{out}"
    );
}

#[test]
fn a_sweep_gives_the_same_output_whatever_its_jobs() {
    let sweep = "dirty-log -b 2M -i 1 --vcpus 1,2,4 --compare eager-split --quiet";
    let serial = stdout(&format!("{sweep} --jobs 1"));
    assert!(serial.contains("vCPU Count"), "{serial}");
    assert_eq!(serial, stdout(&format!("{sweep} --jobs 3")));
    assert_eq!(serial, stdout(sweep));
}

#[test]
fn a_single_run_prints_each_phase_as_it_ends() {
    use std::io::BufRead;
    // A run of several seconds: its first lines arrive long before it ends.
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args("dirty-log -v 4 -b 512M -i 40 --engine virtual --quiet".split_whitespace())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("the vmmu binary runs");
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|l: &String| l.starts_with("Iteration 1 dirty memory time"))
    {
        seen.push(lines.next().expect("a line").unwrap());
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the run ended before its first iteration's line was read: {seen:?}"
    );
    child.kill().unwrap();
    let _ = child.wait();
}

#[test]
fn the_streamed_text_is_the_reports_text_and_json_lines_follow_the_phases() {
    let run = "dirty-log -b 4M -i 3 --engine virtual --quiet";
    let report: vmmu::lab::report::DirtyLogReport =
        serde_json::from_str(&stdout(&format!("{run} --json"))).unwrap();
    assert_eq!(stdout(run), report.to_selftest_text(true));
    let lines = stdout(&format!("{run} --json-lines"));
    let phases: Vec<String> = lines
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["phase"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(
        phases,
        [
            "populate",
            "enable",
            "iteration",
            "iteration",
            "iteration",
            "disable",
            "oracle"
        ]
    );
}

#[test]
fn page_table_streams_its_stages_as_the_report_prints_them() {
    let run = "page-table -b 8M -v 2 --engine virtual --quiet";
    let report: vmmu::lab::page_table::PageTableReport =
        serde_json::from_str(&stdout(&format!("{run} --json"))).unwrap();
    let streamed = stdout(run);
    assert!(streamed.contains("KVM_UNMAP_VM"), "{streamed}");
    assert_eq!(streamed, report.to_selftest_text(true));
}
