//! The `dirty-log` scenario end to end on `/dev/kvm`, in small configurations (guests may be
//! emulated instruction by instruction on some hosts, so sizes stay small). Skipped, with the
//! reason on stderr, where `/dev/kvm` is not usable.

use vmmu::host::backing::Backing;
use vmmu::lab::params::DirtyLogParams;
use vmmu::lab::report::{DirtyLogReport, Phase};
use vmmu_kvm::{run_dirty_log, KvmOptions, TEST_MEM_GPA};

fn small(vcpus: usize, bytes: u64, iterations: u32) -> DirtyLogParams {
    DirtyLogParams {
        vcpus,
        vcpu_memory_bytes: bytes,
        iterations,
        ..Default::default()
    }
}

fn timed(name: &str, p: &Phase) {
    assert!(p.wall_ns > 0, "phase {name} has no time");
    assert!(p.counters.is_some(), "phase {name} has no counters");
}

/// Everything a correct run must show, whatever its flags.
fn assert_sound(r: &DirtyLogReport, p: &DirtyLogParams, clears: bool) {
    assert_eq!(
        (r.backend.as_str(), r.engine.as_str(), r.mmu.as_str()),
        ("kvm", "", "host kernel")
    );
    assert!(r.oracle.passed(), "oracle failed: {:?}", r.oracle);
    assert_eq!(r.oracle.harvests_checked, p.iterations as u64);
    assert_eq!(r.iterations.len(), p.iterations as usize);
    assert_eq!(
        r.test_memory,
        (TEST_MEM_GPA, TEST_MEM_GPA + p.guest_pages() * 4096)
    );
    timed("populate", &r.populate);
    timed("enable", &r.enable);
    timed("disable", &r.disable);
    for (i, it) in r.iterations.iter().enumerate() {
        assert_eq!(it.iteration, i as u32 + 1);
        timed("dirty", &it.dirty);
        timed("get", &it.get);
        assert_eq!(it.clear.is_some(), clears, "iteration {}", it.iteration);
        if let Some(c) = &it.clear {
            timed("clear", c);
        }
        assert!(it.dirty_pages <= p.guest_pages());
    }
    let text = r.to_selftest_text(true);
    assert!(text.contains("Iteration 1 dirty memory time: "), "{text}");
}

fn small_run_passes_the_oracle_and_times_every_phase() {
    let p = small(2, 16 << 20, 3);
    let r = run_dirty_log(&p, &KvmOptions::default()).unwrap_or_else(|e| panic!("{e}"));
    assert_sound(&r, &p, true);
    // Initially-all-set: the first harvest reports every page; later ones what was written.
    assert_eq!(r.iterations[0].dirty_pages, p.guest_pages());
    assert_eq!(r.iterations[2].dirty_pages, p.guest_pages());
    assert_eq!(r.oracle.pages_checked, 3 * p.guest_pages());
}

fn variants_of_the_selftest_flags_pass_the_oracle() {
    let variants = [
        // -g: GET clears and re-protects.
        DirtyLogParams {
            manual_protect: false,
            ..small(1, 2 << 20, 2)
        },
        // -a -w 50 -o -x 3: random, half writes, overlapped, three slots.
        DirtyLogParams {
            random_access: true,
            write_percent: 50,
            partition: false,
            slots: 3,
            ..small(3, 1 << 20, 2)
        },
        // -w 0: nothing written after populate, nothing to lose.
        DirtyLogParams {
            write_percent: 0,
            manual_protect: false,
            ..small(1, 1 << 20, 2)
        },
        // -e with THP backing.
        DirtyLogParams {
            run_vcpus_while_disabling: true,
            backing: Backing::AnonymousThp,
            ..small(2, 4 << 20, 2)
        },
    ];
    for p in variants {
        let thp_off = p.backing == Backing::AnonymousThp
            && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .map_or(true, |s| s.contains("[never]"));
        if thp_off {
            continue;
        }
        let r = run_dirty_log(&p, &KvmOptions::default()).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        assert_sound(&r, &p, p.manual_protect);
        if p.write_percent == 0 {
            assert_eq!(r.iterations[1].dirty_pages, 0);
            assert_eq!(r.oracle.pages_checked, 0);
        }
    }
}

fn dirty_ring_run_handles_full_rings() {
    // 1024 pages per vCPU per pass through 256-entry rings: the rings fill up mid-pass.
    let p = small(2, 4 << 20, 2);
    let opts = KvmOptions {
        dirty_ring: Some(256),
        progress: false,
    };
    let r = run_dirty_log(&p, &opts).unwrap_or_else(|e| panic!("{e}"));
    assert_sound(&r, &p, true);
    let full: u64 = r
        .iterations
        .iter()
        .filter_map(|it| {
            it.dirty
                .counters
                .as_ref()?
                .get("dirty_ring_full_exits")
                .copied()
        })
        .sum();
    assert!(full > 0, "expected full-ring exits");
    assert_eq!(r.iterations[1].dirty_pages, p.guest_pages());
}

fn bad_requests_fail_with_one_line_errors_before_touching_the_host() {
    // These fail before /dev/kvm is opened, so they run on every host.
    let cases: [(DirtyLogParams, KvmOptions, &str); 3] = [
        (small(0, 1 << 20, 2), KvmOptions::default(), "-v 0"),
        (
            // 8 TiB per vCPU is far beyond any host's MemAvailable.
            small(1, 1 << 43, 2),
            KvmOptions::default(),
            "MemAvailable",
        ),
        (
            DirtyLogParams {
                write_percent: 101,
                ..small(1, 1 << 20, 2)
            },
            KvmOptions::default(),
            "-w 101",
        ),
    ];
    for (p, o, want) in cases {
        let e = run_dirty_log(&p, &o).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}

fn bad_ring_sizes_and_missing_hugepages_are_explained() {
    let p = small(1, 1 << 20, 2);
    let e = run_dirty_log(
        &p,
        &KvmOptions {
            dirty_ring: Some(100),
            progress: false,
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("power of two"), "{e}");
    let free_1g =
        std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0);
    if free_1g == 0 {
        let p = DirtyLogParams {
            backing: Backing::AnonymousHugetlb1gb,
            ..small(1, 1 << 30, 2)
        };
        let e = run_dirty_log(&p, &KvmOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"),
            "{e}"
        );
    }
}

mod support;
use support::Needs;

fn main() -> std::process::ExitCode {
    support::run(&[
        (
            "small_run_passes_the_oracle_and_times_every_phase",
            Needs::Kvm,
            small_run_passes_the_oracle_and_times_every_phase,
        ),
        (
            "variants_of_the_selftest_flags_pass_the_oracle",
            Needs::Kvm,
            variants_of_the_selftest_flags_pass_the_oracle,
        ),
        (
            "dirty_ring_run_handles_full_rings",
            Needs::KvmDirtyRing,
            dirty_ring_run_handles_full_rings,
        ),
        (
            "bad_requests_fail_with_one_line_errors_before_touching_the_host",
            Needs::Nothing,
            bad_requests_fail_with_one_line_errors_before_touching_the_host,
        ),
        (
            "bad_ring_sizes_and_missing_hugepages_are_explained",
            Needs::Kvm,
            bad_ring_sizes_and_missing_hugepages_are_explained,
        ),
    ])
}
