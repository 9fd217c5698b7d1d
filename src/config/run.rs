//! The `run` and `runs` keys: the run watched ([`RunConfig`]), an entry of a sweep's `runs` as
//! written ([`RunEntry`]), what a run's name may be, and the bounds of `max_runs`.

use super::alerts::Alerts;
use super::model::DataConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `max_runs` by default: the most runs one daemon watches. Each run costs two threads (its
/// watcher and recorder; a third, and an inotify instance and watch, with notifications), its
/// own evaluation context, state lock and alerter.
pub const DEFAULT_MAX_RUNS: usize = 256;
/// The largest `max_runs` accepted.
pub const MAX_RUNS: usize = 4096;

/// A run's name: letters, digits, `.`, `_` or `-` (it is a URL path and a label).
pub(super) fn valid_run_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// Label `run` on every metric. Default: the name of `run.dir`.
    #[serde(default)]
    pub name: Option<String>,
    /// The folder the training job writes checkpoints into.
    pub dir: PathBuf,
}

/// One entry of `runs`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RunEntry {
    /// The run's label `run` on every metric; unique in the sweep.
    pub(super) name: String,
    pub(super) dir: PathBuf,
    #[serde(default)]
    pub(super) state_dir: Option<PathBuf>,
    #[serde(default)]
    pub(super) data: Option<DataConfig>,
    #[serde(default)]
    pub(super) alerts: Option<Alerts>,
}
