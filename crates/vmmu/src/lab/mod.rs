//! The lab: guest workloads, scenarios, reports and correctness oracles.

pub mod access_tracking;
pub mod calibrate;
pub mod chart;
pub mod compare;
pub mod dirty_log;
pub mod dirty_log_model;
pub mod fit;
pub mod lock_bench;
pub mod memstress;
pub mod migrate;
pub mod nested_churn;
pub mod oracle;
pub mod page_table;
pub mod params;
pub mod reclaim;
pub mod report;
pub mod sweep;
pub mod test_vm;

/// Why a scenario could not run, or stopped: one line that says what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// Parameters the scenario does not accept, with what it does.
    #[error("{0}")]
    Invalid(String),
    /// A check the scenario makes of its own run failed (an oracle, an invariant).
    #[error("{0}")]
    Check(String),
    /// A report (a chart, a file) could not be written.
    #[error("{0}")]
    Report(String),
    /// The host could not provide the memory.
    #[error(transparent)]
    Host(#[from] crate::host::HostError),
    /// The engine stopped.
    #[error(transparent)]
    Engine(#[from] crate::engine::EngineError),
    /// The VM refused an ioctl, or a vCPU a fault.
    #[error(transparent)]
    Vm(#[from] crate::vm::VmError),
    /// A `KVM_CLEAR_DIRTY_LOG` range KVM refuses.
    #[error(transparent)]
    ClearRange(#[from] crate::kvm::memslot::ClearRangeError),
    /// A calibration workload failed.
    #[error("calibration workload {workload}: {error}")]
    Workload {
        /// The workload.
        workload: &'static str,
        /// What went wrong.
        error: Box<LabError>,
    },
    /// The cost model.
    #[error(transparent)]
    Cost(#[from] crate::cost::CostError),
}

impl From<LabError> for String {
    fn from(e: LabError) -> String {
        e.to_string()
    }
}
