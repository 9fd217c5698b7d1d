//! Why a model cannot be loaded or run.

use crate::config::DeviceSpec;
use crate::weights;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: cannot load the TorchScript module: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: does not follow the model contract: {message}")]
    Contract { path: PathBuf, message: String },
    #[error("{path}: forward failed: {message}")]
    Forward { path: PathBuf, message: String },
    #[error(transparent)]
    Weights(#[from] weights::WeightsError),
    #[error("{checkpoint}: weights do not fit the architecture {architecture}: {details}")]
    Mismatch {
        checkpoint: PathBuf,
        architecture: PathBuf,
        details: String,
    },
    /// A compiled package that cannot be used where `model.compiled` names it (the message
    /// names the file, the reason and the rebuild command).
    #[error("model.compiled: {message}")]
    Compiled { path: PathBuf, message: String },
    #[error("device {spec}: {message}")]
    Device { spec: DeviceSpec, message: String },
    #[error(
        "{path}: the file pins device {pinned}: {uses}; it runs only there, and this \
         evaluation runs on {running}. {REEXPORT}, --out {path}"
    )]
    PinnedDevice {
        path: PathBuf,
        pinned: String,
        /// The ops using the pinned device and their methods, for the message.
        uses: String,
        running: String,
    },
}

impl ModelError {
    /// Whether the error is a problem of the configuration on this machine (exit 2, as a bad
    /// config): a device that is not there, or a file that cannot run on the configured one.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            ModelError::Device { .. }
                | ModelError::PinnedDevice { .. }
                | ModelError::Compiled { .. }
        )
    }
}

/// Why a file pins a device, and the fix: what every report of one ends with.
pub(super) const REEXPORT: &str = "Tracing froze the device the file was exported on into its graph. \
    Re-export it with this version's diffmon-export (or diffmon.export.export), whose files \
    follow the device of their input: the same command or call as before";
