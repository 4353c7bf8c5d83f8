//! The lab: guest workloads, scenarios, reports and correctness oracles.

pub mod params;
pub mod report;
