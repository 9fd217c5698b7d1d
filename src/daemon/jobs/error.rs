//! Why a jobs executor cannot start. A leaf: the executor's error (`daemon/executor.rs`) wraps
//! it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum JobsError {
    #[error("cannot open the jobs journal {path}")]
    Journal {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the jobs folder {path}")]
    JobsDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the {0} executor needs the config file's path (the jobs read it)")]
    NoConfigFile(&'static str),
    #[error("cannot find diffmon's own executable for the jobs (set {0})")]
    NoBinary(&'static str, #[source] std::io::Error),
}
