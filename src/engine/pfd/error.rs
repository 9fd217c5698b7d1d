//! Why a PF-ODE metric could not be computed.

use crate::engine::data::DataError;
use crate::engine::model::ModelError;
use crate::engine::sampler::SamplerError;
use crate::engine::tail::TailError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum PfdError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error(transparent)]
    Tail(#[from] TailError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Hdf5 {
        path: PathBuf,
        #[source]
        source: hdf5::Error,
    },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: descriptor: {what}: {source}")]
    DescriptorTorch {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: tch::TchError,
    },
    #[error("{path}: descriptor: {message}")]
    Descriptor { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}: the student's PF-ODE produced non-finite values: the weights are broken")]
    NonFinite(String),
}

impl PfdError {
    /// The model error inside, when there is one (the teacher's).
    pub fn model(&self) -> Option<&ModelError> {
        match self {
            PfdError::Model(e) => Some(e),
            _ => None,
        }
    }
}
