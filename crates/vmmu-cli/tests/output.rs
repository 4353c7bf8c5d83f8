//! What the reports hold, whatever the figures: options that shape the output.

use std::process::Command;

#[test]
fn no_counters_leaves_them_out_of_the_json_too() {
    let out = |args: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
            .args(args.split_whitespace())
            .output()
            .expect("the vmmu binary runs");
        assert!(o.status.success(), "{args}");
        String::from_utf8(o.stdout).unwrap()
    };
    let with = out("dirty-log -b 4M -i 1 --engine virtual --json");
    let without = out("dirty-log -b 4M -i 1 --engine virtual --json --no-counters");
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
    let out = |args: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
            .args(args.split_whitespace())
            .output()
            .expect("the vmmu binary runs");
        assert!(o.status.success(), "{args}");
        String::from_utf8(o.stdout).unwrap()
    };
    let sweep = "dirty-log -b 2M -i 1 --vcpus 1,2,4 --compare eager-split --quiet";
    let serial = out(&format!("{sweep} --jobs 1"));
    assert!(serial.contains("vCPU Count"), "{serial}");
    assert_eq!(serial, out(&format!("{sweep} --jobs 3")));
    assert_eq!(serial, out(sweep));
}
