//! Bad command lines get one line on stderr that says what was wrong and what is allowed, and
//! exit status 2, before anything runs.

use std::process::Command;

fn vmmu(args: &str) -> (Option<i32>, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_vmmu"))
        .args(args.split_whitespace())
        .output()
        .expect("the vmmu binary runs");
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn arm64_options_are_checked_with_one_line_errors() {
    for (args, says) in [
        ("dirty-log --arm64-lock spin", "applies to --arch arm64"),
        ("dirty-log -m 2", "-m applies to --arch arm64"),
        ("dirty-log --compare arm64-lock", "add --arch arm64"),
        ("dirty-log --split-chunk 2M", "applies to --arch arm64"),
        ("dirty-log --tlbi-range on", "add --arch arm64"),
        ("dirty-log --fwb on", "add --arch arm64"),
        ("dirty-log --relax-flush local", "add --arch arm64"),
        ("dirty-log --compare tlbi-range", "add --arch arm64"),
        (
            "dirty-log --arch arm64 --compare tlbi-range --tlbi-range on",
            "leave out --tlbi-range",
        ),
        (
            "dirty-log --arch arm64 --mmu shadow",
            "--mmu selects an x86 MMU",
        ),
        ("dirty-log --arch arm64 --ept off", "--ept is x86's"),
        ("dirty-log --arch arm64 --backend kvm", "this host is x86"),
        (
            "dirty-log --arch arm64 -m 1",
            "valid modes are 2, 3, 4, 5, 6, 7, 11, 12, 13, 14",
        ),
        ("dirty-log --arch arm64 -m 9", "valid modes are"),
        (
            "dirty-log --arch arm64 -m 11 -v 64 -b 1G -s anonymous_hugetlb_1gb",
            "does not fit guest mode 11 (36-bit guest physical addresses)",
        ),
        (
            "dirty-log --arch arm64 --eager-split on --split-chunk 3M",
            "use 4K, 2M or 1G",
        ),
        (
            "dirty-log --arch arm64 --split-chunk 1G",
            "add --eager-split on",
        ),
        (
            "dirty-log --arch arm64 -m 6 -b 20K",
            "multiple of the guest page size, 16384 bytes",
        ),
        (
            "dirty-log --arch arm64 --compare arm64-lock --arm64-lock spin",
            "leave out --arm64-lock",
        ),
        ("page-table --tlbi-range on", "add --arch arm64"),
        ("page-table -b 4M --backward-pages 1024", "at most 1023"),
        ("page-table -b 0", "at least one page"),
        (
            "page-table --arch arm64 -m 11 -b 64G",
            "does not fit guest mode 11",
        ),
        ("page-table -b 1X", "unknown suffix"),
    ] {
        let (code, err) = vmmu(args);
        assert_eq!(code, Some(2), "`vmmu {args}`: {err}");
        assert_eq!(err.lines().count(), 1, "`vmmu {args}`: {err}");
        assert!(err.contains(says), "`vmmu {args}`: {err}");
    }
}

#[test]
fn pml_options_are_checked_with_one_line_errors() {
    for (args, says) in [
        (
            "dirty-log --arch arm64 --pml on",
            "arm64 logs dirty pages by write protection",
        ),
        (
            "dirty-log --arch arm64 --compare pml",
            "arm64 logs dirty pages by write protection",
        ),
        (
            "dirty-log --mmu shadow --ept off --pml on",
            "--pml needs EPT",
        ),
        (
            "dirty-log --mmu shadow --ept off --compare pml",
            "--pml needs EPT",
        ),
        ("dirty-log --compare pml --pml off", "leave out --pml"),
        (
            "dirty-log --backend kvm --pml off",
            "enable_pml module parameter decides",
        ),
        (
            "page-table --arch arm64 --pml off",
            "arm64 logs dirty pages by write protection",
        ),
    ] {
        let (code, err) = vmmu(args);
        assert_eq!(code, Some(2), "{args}: {err}");
        assert!(err.contains(says), "{args}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args}: {err}");
    }
}

#[test]
fn usage_errors_name_the_allowed_values_and_the_subcommand_help() {
    for (args, says) in [
        (
            "dirty-log --mmu foo",
            "possible values: tdp, shadow (see 'vmmu dirty-log --help')",
        ),
        (
            "page-table --pml maybe",
            "possible values: on, off (see 'vmmu page-table --help')",
        ),
        ("dirty-log -v 4 --vcpus 2,4", "cannot be used with"),
        (
            "fit input.txt",
            "were not provided: --host <DESCRIPTION> (see 'vmmu fit --help')",
        ),
        (
            "lock-bench --hold-ns -5",
            "--hold-ns -5: must be from 0 to 1e9 ns (see 'vmmu lock-bench --help')",
        ),
        (
            "lock-bench --lock mutex",
            "possible values: rwlock, spinlock (see 'vmmu lock-bench --help')",
        ),
        ("lock-bench --cores 0", "0 is not in 1..=1024"),
        ("dirty-log --vcpus 2,4,2", "2 is listed twice"),
        (
            "dirty-log --backend kvm --dirty-ring 3",
            "power of two between 256 and 65536",
        ),
        ("bogus", "(see 'vmmu --help')"),
        ("dirty-log -n", "nested (L2) mode is not modelled"),
        (
            "dirty-log --engine threads --vcpus 1,2 --jobs 2",
            "its sweep points run one at a time",
        ),
        ("page-table --jobs 0", "0 is not in 1.."),
        (
            "dirty-log --vcpus 1,2 --json-lines",
            "--json-lines streams one run's phases",
        ),
        (
            "dirty-log --emit-jobs /tmp/x",
            "add --vcpus LIST or --compare",
        ),
        ("tables /nonexistent.json", "(see 'vmmu tables --help')"),
        (
            "calibrate --quick --out /nonexistent/dir/x.json",
            "cannot write /nonexistent/dir/x.json",
        ),
        (
            "nested-churn --rounds 0",
            "--rounds must be at least 1 (see 'vmmu nested-churn --help')",
        ),
        (
            "nested-churn --l1-memory 4G --l2-memory 1G --concurrent 10",
            "more than --l1-memory",
        ),
        (
            "nested-churn --zap-orphans maybe",
            "possible values: on, v1, off (see 'vmmu nested-churn --help')",
        ),
        ("nested-churn --l2-memory 5000", "multiple of 4 KiB"),
        ("nested-churn --l1-memory 100M", "multiple of 1 GiB"),
        (
            "nested-churn --engine threads --cost-model x.json",
            "the threads engine measures this machine",
        ),
        ("dirty-log -s shared_hugetlb_16kb", "shmem"),
        (
            "reclaim -m 8 -s 16",
            "-s 16384 MiB is larger than -m 8192 MiB",
        ),
        (
            "reclaim --lru mglr",
            "possible values: classic, mglru (see 'vmmu reclaim --help')",
        ),
        ("reclaim --host-memory 1M", "at least 16 MiB"),
        ("reclaim --host-memory 10Q", "(see 'vmmu reclaim --help')"),
        ("reclaim -m 16384 -s 1", "this machine's memory"),
        ("reclaim -c 0", "the vCPU count must be 1 to 1024"),
        ("reclaim --compare aging --lru classic", "leave them out"),
        (
            "reclaim --arch arm64 --mmu tdp",
            "arm64 has its stage-2 MMU",
        ),
        (
            "access-tracking -v 0",
            "1 to 512 vCPUs (see 'vmmu access-tracking --help')",
        ),
        (
            "access-tracking -b 5000",
            "multiple of the backing's page size",
        ),
        (
            "access-tracking --aging maybe",
            "possible values: locked, lockless",
        ),
        (
            "access-tracking --compare aging --aging lockless",
            "leave --aging out",
        ),
        (
            "access-tracking --arm64-lock spin",
            "--arm64-lock needs --arch arm64",
        ),
        (
            "migrate --bandwidth 0Gbit",
            "--bandwidth 0: the link must carry at least 1 bit per second",
        ),
        ("migrate --bandwidth fast", "is not a bandwidth"),
        ("migrate --bandwidth 10", "is not a bandwidth"),
        ("migrate --downtime 0ms", "--downtime 0"),
        ("migrate --downtime 300", "is not a duration"),
        (
            "migrate -b 64M --working-set 128M",
            "at most the memory of each vCPU",
        ),
        ("migrate --warmup 150ms", "a multiple of the bucket"),
        ("migrate --compare arm64-lock", "add --arch arm64"),
        (
            "migrate --compare auto-converge --auto-converge",
            "leave out --auto-converge",
        ),
        ("migrate --think-ns 200000000", "use less than --bucket"),
        ("migrate --bandwidth 100Kbit", "at least 1 Mbit/s"),
        (
            "migrate -g --clear-bitmap-shift 20",
            "which -g and --dirty-ring do not make",
        ),
        ("migrate --clear-bitmap-shift 5", "QEMU allows 6 to 31"),
        (
            "migrate --dirty-ring 1000",
            "--dirty-ring 1000: the ring size must be a power of two",
        ),
        ("soak --minutes 0", "not a positive number of minutes"),
        ("soak --max-scale 3", "not one of 1, 2, 4, 8"),
        ("soak --jobs 0", "--jobs"),
        (
            "dirty-log --mmu shadow --ept off -v 5 -b 2M -x 4",
            "must be a multiple of the guest's 2048 KiB pages",
        ),
        // memstress_create_vm() divides guest pages (64 KiB here) among the slots.
        (
            "dirty-log --arch arm64 -m 7 -b 64K -x 16",
            "must be a multiple of the guest's 64 KiB pages",
        ),
    ] {
        let (code, err) = vmmu(args);
        assert_eq!(code, Some(2), "{args}: {err}");
        assert!(err.contains(says), "{args}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args}: {err}");
    }
}

#[test]
fn no_command_prints_the_help_and_fails() {
    let (code, err) = vmmu("");
    assert_eq!(code, Some(2));
    assert!(err.contains("Usage: vmmu [OPTIONS] <COMMAND>"), "{err}");
}
