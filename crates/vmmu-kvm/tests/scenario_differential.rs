//! The whole `dirty-log` scenario on the model and on real KVM with the same parameters: the
//! guests draw the same pages (same RNG, same order), so every harvest must report the same
//! number of dirty pages on both.

use vmmu::host::backing::Backing;
use vmmu::lab::dirty_log_model::run_dirty_log_threads;
use vmmu::lab::params::DirtyLogParams;
use vmmu_kvm::{run_dirty_log, KvmOptions};

fn model_and_kvm_harvest_the_same_pages() {
    for (manual_protect, random_access, write_percent) in [
        (true, true, 50),
        (false, true, 30),
        (true, false, 100),
        (false, false, 100),
    ] {
        let p = DirtyLogParams {
            vcpus: 2,
            vcpu_memory_bytes: 2 << 20,
            iterations: 3,
            backing: Backing::Anonymous,
            manual_protect,
            random_access,
            write_percent,
            ..Default::default()
        };
        let model = run_dirty_log_threads(&p, false).unwrap();
        let kvm = run_dirty_log(&p, &KvmOptions::default()).unwrap();
        assert!(model.oracle.passed() && kvm.oracle.passed());
        let counts = |r: &vmmu::lab::report::DirtyLogReport| {
            r.iterations
                .iter()
                .map(|i| i.dirty_pages)
                .collect::<Vec<_>>()
        };
        assert_eq!(counts(&model), counts(&kvm), "{p:?}");
        assert!(counts(&model).iter().any(|&c| c > 0));
    }
}

mod support;

fn main() -> std::process::ExitCode {
    support::run(&[(
        "model_and_kvm_harvest_the_same_pages",
        support::Needs::Kvm,
        model_and_kvm_harvest_the_same_pages,
    )])
}
