//! Why a report could not be written.

use crate::store::history::HistoryError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(
        "{path}: unknown report format `{extension}`: the extension must be .html, .svg or .png"
    )]
    UnknownFormat { path: PathBuf, extension: String },
    #[error(
        "{path}: no history yet: `diffmon watch` with this config (state_dir) has not recorded any checkpoint"
    )]
    NoHistory { path: PathBuf },
    #[error(transparent)]
    History(#[from] HistoryError),
    #[error(
        "no font found for the PNG's text: install one (the Debian package fonts-dejavu-core; `make setup` does)"
    )]
    NoFont,
    #[error("cannot rasterize the plots: {0}")]
    Rasterize(String),
    #[error("{path}: cannot write the report: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl ReportError {
    /// A bad command line (exit 2), rather than a runtime failure.
    pub fn is_usage(&self) -> bool {
        matches!(self, ReportError::UnknownFormat { .. })
    }
}
