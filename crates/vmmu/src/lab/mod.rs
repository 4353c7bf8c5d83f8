//! The lab: guest workloads, scenarios, reports and correctness oracles.

pub mod access_tracking;
pub mod compare;
pub mod dirty_log;
pub mod dirty_log_model;
pub mod lock_bench;
pub mod memstress;
pub mod migrate;
pub mod nested_churn;
pub mod oracle;
pub mod page_table;
pub mod params;
pub mod reclaim;
pub mod report;
pub mod test_vm;
