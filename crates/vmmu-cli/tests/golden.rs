//! Golden outputs of the virtual-time engine: deterministic runs that cover every MMU path (TDP
//! and shadow MMU, shadow paging with 4K and 2M guest pages, `-g`, `-a`, `-o`, `-e`, `-x 2`,
//! eager split off, every backing, write-lock contention, `--compare` tables, kvm_page_table_test
//! on each MMU), compared byte for
//! byte with `tests/golden/*.out`. A change that is not meant to change results keeps them all;
//! one that is meant to re-records them with `VMMU_BLESS=1 cargo test -p vmmu-cli --test golden`
//! and says why, with before and after figures, in its commit.

use std::path::PathBuf;
use std::process::Command;

/// (file name, `vmmu` arguments). Every case runs in virtual time.
const CASES: &[(&str, &str)] = &[
    ("tdp-anon", "dirty-log -v 2 -b 8M -i 3 --json"),
    (
        "tdp-thp-random",
        "dirty-log -v 4 -b 8M -s anonymous_thp -a -w 50 --json",
    ),
    (
        "tdp-2m-overlap-e",
        "dirty-log -v 2 -b 16M -s anonymous_hugetlb_2mb -o -e --json",
    ),
    (
        "tdp-1g",
        "dirty-log -v 1 -b 1G -s anonymous_hugetlb_1gb --json",
    ),
    (
        "tdp-1g-g-split-off",
        "dirty-log -v 1 -b 1G -s anonymous_hugetlb_1gb -g --eager-split off --json",
    ),
    (
        "tdp-thp-x2-g",
        "dirty-log -v 2 -b 8M -s anonymous_thp -x 2 -g --json",
    ),
    (
        "tdp-2m-split-off-e",
        "dirty-log -v 2 -b 16M -s anonymous_hugetlb_2mb --eager-split off -e -i 3 --json",
    ),
    (
        "shadow-2m",
        "dirty-log --mmu shadow -v 4 -b 8M -s anonymous_hugetlb_2mb --json",
    ),
    (
        "shadow-1g-split-off",
        "dirty-log --mmu shadow -v 1 -b 1G -s anonymous_hugetlb_1gb --eager-split off --json",
    ),
    (
        "shadow-1g-g",
        "dirty-log --mmu shadow -v 2 -b 512M -s anonymous_hugetlb_1gb -g --json",
    ),
    (
        "shadow-thp-g-random-x2",
        "dirty-log --mmu shadow -v 4 -b 8M -s anonymous_thp -g -a -w 70 -x 2 --json",
    ),
    (
        "shadow-contended-split-off",
        "dirty-log --mmu shadow -v 16 -b 4M -s anonymous_hugetlb_2mb --eager-split off --json",
    ),
    (
        "shadow-overlap-e",
        "dirty-log --mmu shadow -v 4 -b 4M -s anonymous_thp -o -e --json",
    ),
    (
        "ept-off-4k-e",
        "dirty-log --mmu shadow --ept off --guest-page-size 4k -v 2 -b 8M -e --json",
    ),
    (
        "ept-off-2m-g",
        "dirty-log --mmu shadow --ept off -v 2 -b 16M -s anonymous_hugetlb_2mb -g --json",
    ),
    (
        "ept-off-contended-split-off",
        "dirty-log --mmu shadow --ept off -v 16 -b 2M -s anonymous_hugetlb_2mb --eager-split off -a --json",
    ),
    ("arm64-anon-m2", "dirty-log --arch arm64 -m 2 -v 2 -b 8M -i 3 --json"),
    (
        "arm64-2m-perm-fast-path",
        "dirty-log --arch arm64 -v 4 -b 16M -s anonymous_hugetlb_2mb --arm64-lock perm-fast-path --json",
    ),
    (
        "arm64-2m-g-eager-split-1g-chunk",
        "dirty-log --arch arm64 -v 2 -b 16M -s anonymous_hugetlb_2mb -g --eager-split on --split-chunk 1G --json",
    ),
    (
        "arm64-64k-guest-spin-overlap",
        "dirty-log --arch arm64 -m 7 -v 2 -b 8M -o --arm64-lock spin --json",
    ),
    (
        "arm64-1g-random-e",
        "dirty-log --arch arm64 -m 2 -v 2 -b 1G -s anonymous_hugetlb_1gb -a -w 50 -e --json",
    ),
    (
        "arm64-2m-eager-split-clear",
        "dirty-log --arch arm64 -v 2 -b 16M -s anonymous_hugetlb_2mb --eager-split on --json",
    ),
    (
        "arm64-2m-g-tlbi-range-fwb",
        "dirty-log --arch arm64 -v 2 -b 16M -s anonymous_hugetlb_2mb -g --tlbi-range on --fwb on --json",
    ),
    (
        "compare-arm64-lock-text",
        "dirty-log --arch arm64 -s anonymous_hugetlb_2mb -b 8M --vcpus 1,4 --compare arm64-lock",
    ),
    (
        "compare-tdp-text",
        "dirty-log -s anonymous_hugetlb_2mb -b 8M --vcpus 1,4 --compare eager-split",
    ),
    (
        "page-table-arm64-thp",
        "page-table --arch arm64 -v 2 -b 8M -s anonymous_thp",
    ),
    (
        "page-table-arm64-2m-backward",
        "page-table --arch arm64 -v 4 -b 8M -s anonymous_hugetlb_2mb --backward-pages 64 --tlbi-range on --fwb on --json",
    ),
    (
        "page-table-tdp-anon",
        "page-table -v 2 -b 4M",
    ),
    (
        "page-table-shadow-2m",
        "page-table --mmu shadow -v 4 -b 8M -s anonymous_hugetlb_2mb --json",
    ),
    (
        "compare-page-table-tlbi-range",
        "page-table --arch arm64 -v 4 -s anonymous_hugetlb_2mb --backward-pages 32 --fwb on -b 4M,8M --compare tlbi-range",
    ),
    (
        "tdp-2m-pml-off",
        "dirty-log -v 2 -b 16M -s anonymous_hugetlb_2mb --pml off --json",
    ),
    (
        "shadow-2m-g-pml-off",
        "dirty-log --mmu shadow -v 2 -b 16M -s anonymous_hugetlb_2mb -g --pml off --json",
    ),
    (
        "compare-pml-shadow-text",
        "dirty-log --mmu shadow -s anonymous_hugetlb_2mb -b 4M -g -i 1 --vcpus 2,8 --compare pml",
    ),
    (
        "compare-pml-csv",
        "dirty-log --mmu shadow -s anonymous_hugetlb_2mb -b 4M -g -i 2 --vcpus 2,8 --compare pml --csv",
    ),
    (
        "nested-churn-text",
        "nested-churn --l1-memory 1G --l2-memory 8M --concurrent 6 --rounds 3 --l1-vcpus 2 --quantum 256 --quiet",
    ),
    (
        "nested-churn-off-json",
        "nested-churn --l1-memory 1G --l2-memory 16M --concurrent 10 --rounds 2 --quantum 512 --zap-orphans off --teardown bottom-up --json --no-counters --quiet",
    ),
    (
        "compare-nested-churn",
        "nested-churn --l1-memory 1G --l2-memory 16M --concurrent 10 --rounds 4 --quantum 512 --compare zap-orphans --quiet",
    ),
    (
        "reclaim-compare-aging",
        "reclaim -c 2 -m 128M -s 64M --host-memory 48M --compare aging --quiet",
    ),
    (
        "reclaim-classic-json",
        "reclaim -c 3 -m 96M -s 32M --host-memory 24M --lru classic --json --quiet",
    ),
    (
        "reclaim-arm64-lockless",
        "reclaim --arch arm64 -c 2 -m 64M -s 64M --host-memory 40M --aging lockless --quiet",
    ),
    (
        "access-tracking-compare-aging",
        "access-tracking -v 16 -b 2M --compare aging --quiet",
    ),
    (
        "access-tracking-arm64",
        "access-tracking --arch arm64 -v 2 -b 4M -o --quiet",
    ),
    (
        "migrate-x86",
        "migrate -v 2 -b 16M --working-set 2M --think-ns 500 --bucket 10ms --warmup 20ms --bandwidth 1Gbit --quiet",
    ),
    (
        "migrate-arm64-compare-lock-json",
        "migrate --arch arm64 -v 4 -b 8M --working-set 4M --bucket 1ms --warmup 2ms --compare arm64-lock --json --no-counters --quiet",
    ),
    (
        "migrate-compare-dirty-ring",
        "migrate -v 2 -b 8M --working-set 1M --think-ns 500 --bucket 5ms --warmup 10ms --bandwidth 1Gbit --compare dirty-ring --dirty-ring 512 --quiet",
    ),
    (
        "compare-shadow-text",
        "dirty-log --mmu shadow -s anonymous_hugetlb_2mb -b 4M -g --vcpus 2,8 --compare eager-split",
    ),
];

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn run(args: &str) -> String {
    let mut argv: Vec<&str> = args.split_whitespace().collect();
    if !argv.contains(&"--compare") {
        argv.extend(["--engine", "virtual"]);
    }
    let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(&argv)
        .output()
        .expect("run vmmu");
    assert!(
        o.status.success(),
        "vmmu {args} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("UTF-8 output")
}

/// `VMMU_BLESS` is set (and not empty): the golden files are being recorded.
fn blessing() -> bool {
    std::env::var_os("VMMU_BLESS").is_some_and(|v| !v.is_empty())
}

#[test]
fn virtual_time_outputs_equal_the_golden_files() {
    let bless = blessing();
    let mut differ = Vec::new();
    for (name, args) in CASES {
        let path = golden_dir().join(format!("{name}.out"));
        let got = run(args);
        if bless {
            std::fs::create_dir_all(golden_dir()).unwrap();
            std::fs::write(&path, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (record it with VMMU_BLESS=1)", path.display()));
        if got != want {
            let line = got
                .lines()
                .zip(want.lines())
                .position(|(g, w)| g != w)
                .unwrap_or(got.lines().count().min(want.lines().count()));
            differ.push(format!(
                "{name} (`vmmu {args}`): first difference at line {}: got {:?}, golden {:?}",
                line + 1,
                got.lines().nth(line),
                want.lines().nth(line)
            ));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

/// Fast-forward (on by default) changes no result: every case stepped in turn
/// (`--fast-forward off`) gives its golden output too.
#[test]
fn stepping_in_turn_gives_the_golden_outputs() {
    // The files are being rewritten beside this test: nothing to compare with yet.
    if blessing() {
        return;
    }
    let mut differ = Vec::new();
    for (name, args) in CASES {
        let path = golden_dir().join(format!("{name}.out"));
        let Ok(want) = std::fs::read_to_string(&path) else {
            continue;
        };
        if run(&format!("{args} --fast-forward off")) != want {
            differ.push(format!("{name} (`vmmu {args} --fast-forward off`)"));
        }
    }
    assert!(
        differ.is_empty(),
        "stepping in turn differs from the golden output in: {}",
        differ.join(", ")
    );
}

#[test]
fn every_golden_file_has_a_case() {
    for entry in std::fs::read_dir(golden_dir()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let stem = name.trim_end_matches(".out");
        assert!(
            CASES.iter().any(|(n, _)| *n == stem),
            "{name} has no case in tests/golden.rs"
        );
    }
}
