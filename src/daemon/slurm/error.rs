//! Why the Slurm executor cannot start. A leaf: the executor's error (`daemon/executor.rs`)
//! wraps it.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
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
    #[error("the Slurm executor needs the config file's path (the jobs read it)")]
    NoConfigFile,
    #[error("cannot find diffmon's own executable for the jobs (set evaluation.slurm.binary)")]
    NoBinary(#[source] std::io::Error),
}
