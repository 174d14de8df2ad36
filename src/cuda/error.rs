//! Errors of the GPU code, and the check that turns a driver result into one.

use cudarc::driver::sys;

/// Why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GpuError {
    /// No CUDA driver library on this machine.
    #[error("CUDA is not available: {0}")]
    NoDriver(String),
    /// The driver is there but the device is not.
    #[error("no CUDA device cuda:{ordinal} (this machine has {count})")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// Devices present.
        count: usize,
    },
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// Sizes or shapes that do not fit.
    #[error("{0}")]
    Invalid(String),
}

impl From<cudarc::driver::DriverError> for GpuError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        GpuError::Driver(e.to_string())
    }
}

/// `Ok` for `CUDA_SUCCESS`, else the driver's code named with the call `what`.
pub(super) fn check(r: sys::CUresult, what: &str) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(GpuError::Driver(format!("{what}: {r:?}"))) }
}
