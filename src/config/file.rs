//! The config file as written: what serde reads from the YAML, before any value is checked.
//! [`ConfigFile`] is its top level; each section's struct is in the section's file, as written
//! where its values become typed settings (durations, the checkpoint glob and step pattern,
//! weights files, the listen address, webhook URLs and secrets), else shared with
//! [`Config`](super::Config) as it is. [`ConfigFile::settings`] checks every value and builds
//! the `Config` once. [`EXAMPLE`] is the annotated example file.

use super::alerts::Alerts;
use super::checkpoints::Checkpoints;
use super::early_stop::EarlyStopConfig;
use super::evaluation::Evaluation;
use super::http::Http;
use super::icr::IcrConfig;
use super::model::{DataConfig, DeviceSpec, ModelConfig};
use super::pfd::{MemorizationConfig, PfdConfig, TailConfig};
use super::run::{DEFAULT_MAX_RUNS, RunConfig, RunEntry};
use super::trackers::Trackers;
use serde::Deserialize;
use std::path::PathBuf;

/// The annotated example printed by `diffmon init`.
pub const EXAMPLE: &str = include_str!("../../config/diffmon.example.yaml");

/// A config file parsed but not checked: [`ConfigFile::parse`], then [`ConfigFile::settings`]
/// (or [`ConfigFile::validate`] for the problems alone). Paths are as written until
/// `Config::load` resolves them against the file's folder.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// The one run watched; exclusive with `runs` (a sweep).
    #[serde(default)]
    pub(super) run: Option<RunConfig>,
    /// A sweep: the runs one daemon watches, each with its own name, folder and, optionally,
    /// state folder, data and alerts; every other section is shared.
    #[serde(default)]
    pub(super) runs: Option<Vec<RunEntry>>,
    /// A sweep of folders: every folder matching this glob (wildcards in its last component
    /// only) is a run, named after the folder, with every section shared; folders that appear
    /// later join while the daemon runs. Exclusive with `run` and `runs`.
    #[serde(default)]
    pub(super) runs_glob: Option<PathBuf>,
    /// The most runs of a sweep: a longer `runs` list is an error; of the folders `runs_glob`
    /// matches, the first by name are watched and the others left out, with a warning.
    #[serde(default = "default_max_runs")]
    pub(super) max_runs: usize,
    /// Where diffmon keeps its history, alert outbox, caches, lock and crash marker.
    /// Default: `<run.dir>/.diffmon`.
    #[serde(default)]
    pub(super) state_dir: Option<PathBuf>,
    #[serde(default)]
    pub(super) checkpoints: Checkpoints,
    pub(super) model: ModelConfig,
    #[serde(default)]
    pub(super) device: DeviceSpec,
    /// CPU threads of libtorch's operations (default: libtorch's choice, one per core). Lower it
    /// when diffmon shares the CPU with the training job.
    #[serde(default)]
    pub(super) cpu_threads: Option<usize>,
    /// How long the first SIGINT/SIGTERM waits for the evaluation in flight before the daemon
    /// exits anyway (that checkpoint is evaluated again after a restart).
    #[serde(default = "default_shutdown_drain_secs")]
    pub(super) shutdown_drain_secs: f64,
    /// The training (and held-out) images. Required, except in a `runs` sweep whose every
    /// entry gives its own; in a sweep, the data of the entries that give none.
    #[serde(default)]
    pub(super) data: Option<DataConfig>,
    #[serde(default)]
    pub(super) icr: IcrConfig,
    #[serde(default)]
    pub(super) pfd: PfdConfig,
    #[serde(default)]
    pub(super) memorization: MemorizationConfig,
    #[serde(default)]
    pub(super) tail: TailConfig,
    #[serde(default)]
    pub(super) early_stop: EarlyStopConfig,
    #[serde(default)]
    pub(super) alerts: Alerts,
    #[serde(default)]
    pub(super) http: Http,
    #[serde(default)]
    pub(super) evaluation: Evaluation,
    /// Experiment trackers the numbers are written into; none by default.
    #[serde(default)]
    pub(super) trackers: Trackers,
}

fn default_max_runs() -> usize {
    DEFAULT_MAX_RUNS
}

fn default_shutdown_drain_secs() -> f64 {
    120.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_parses() {
        ConfigFile::parse(EXAMPLE, "example").unwrap();
    }
}
