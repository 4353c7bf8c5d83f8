//! A sweep split into jobs (`--emit-jobs DIR`), run by a batch tool (`xargs -P 2` here), and
//! put back together by `vmmu tables` gives the tables, CSV and chart of the in-process sweep.

use std::path::Path;
use std::process::{Command, Stdio};

fn vmmu(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(args)
        .output()
        .expect("the vmmu binary runs");
    assert!(
        o.status.success(),
        "vmmu {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Runs each of `jobs` (one shell command per line) with `xargs -P 2`, as a batch system would.
fn run_with_xargs(jobs: &str) {
    let mut xargs = Command::new("xargs")
        .args(["-0", "-P", "2", "-n", "1", "sh", "-c"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("xargs runs");
    use std::io::Write;
    let lines: Vec<&str> = jobs.lines().collect();
    xargs
        .stdin
        .take()
        .unwrap()
        .write_all(lines.join("\0").as_bytes())
        .unwrap();
    assert!(xargs.wait().unwrap().success(), "a job failed");
}

fn reports(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn jobs_run_through_xargs_give_the_tables_of_the_in_process_sweep() {
    let dir = std::env::temp_dir().join(format!("vmmu-jobs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let sweep = [
        "dirty-log",
        "-b",
        "2M",
        "-i",
        "2",
        "--vcpus",
        "1,2,4",
        "--compare",
        "eager-split",
    ];
    let mut emit = sweep.to_vec();
    let d = dir.display().to_string();
    emit.extend(["--emit-jobs", &d]);
    let jobs = vmmu(&emit);
    assert_eq!(jobs.lines().count(), 6, "{jobs}");
    run_with_xargs(&jobs);
    let files = reports(&dir);
    assert_eq!(files.len(), 6);
    let mut tables = vec!["tables"];
    tables.extend(files.iter().map(String::as_str));
    let mut in_process = sweep.to_vec();
    in_process.push("--quiet");
    assert_eq!(vmmu(&tables), vmmu(&in_process));
    tables.push("--csv");
    in_process.push("--csv");
    assert_eq!(vmmu(&tables), vmmu(&in_process));
    // The chart too.
    let (a, b) = (dir.join("a.svg"), dir.join("b.svg"));
    let (a_s, b_s) = (a.display().to_string(), b.display().to_string());
    tables.pop();
    tables.extend(["--plot", &a_s]);
    in_process.pop();
    in_process.extend(["--plot", &b_s]);
    vmmu(&tables);
    vmmu(&in_process);
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tables_refuses_what_is_not_a_job_report_with_one_line() {
    let dir = std::env::temp_dir().join(format!("vmmu-notjob-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let plain = dir.join("plain.json");
    std::fs::write(
        &plain,
        vmmu(&[
            "dirty-log",
            "-b",
            "2M",
            "-i",
            "1",
            "--engine",
            "virtual",
            "--json",
            "--quiet",
        ]),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(["tables", &plain.display().to_string()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--emit-jobs") && err.trim_end().lines().count() == 1,
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
