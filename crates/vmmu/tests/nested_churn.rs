//! Nested EPT and seed 004's orphan zapping, through the `nested-churn` scenario on both
//! engines: the L2s' writes land where L1 mapped them, the invariants hold, and zapping
//! orphans changes what stays behind the way the seed describes.

use vmmu::cost::CostModel;
use vmmu::lab::nested_churn::*;
use vmmu::x86::shadow::state::ZapOrphans;

fn small(zap: ZapOrphans) -> NestedChurnParams {
    NestedChurnParams {
        l1_memory: 1 << 30,
        l2_memory: 8 << 20,
        concurrent: 10,
        rounds: 4,
        l1_vcpus: 4,
        quantum: 256,
        zap_orphans: zap,
        ..Default::default()
    }
}

#[test]
fn smoke() {
    for zap in [ZapOrphans::On, ZapOrphans::Off, ZapOrphans::V1] {
        let r = run_nested_churn_virtual(&small(zap), &CostModel::default(), false).unwrap();
        println!("{}", r.to_text(false));
        assert!(r.oracle.passed(), "{zap:?}: {:?}", r.oracle);
    }
}
