//! The `trackers` section: the experiment trackers a run's numbers are written into
//! (docs/design.md §21). Its structs are the settings as written; [`check_trackers`] checks them.

use super::validate::Validator;
use serde::Deserialize;
use std::path::PathBuf;

/// `trackers`: every tracker is off unless its section is given.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrackersConfig {
    /// `trackers.tensorboard`: TensorBoard event files.
    #[serde(default)]
    pub tensorboard: Option<TensorboardConfig>,
}

/// `trackers.tensorboard`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorboardConfig {
    /// The TensorBoard log folder (the one `tensorboard --logdir` is given, usually the
    /// training job's own): each run's events go to `<dir>/diffmon/<run name>/`. Relative to the
    /// config file's folder; made if absent; never a symbolic link.
    pub dir: PathBuf,
}

impl TensorboardConfig {
    /// The folder under `dir` that holds the runs' folders.
    pub const FOLDER: &'static str = "diffmon";

    /// Where run `run`'s events go: `<dir>/diffmon/<run>`.
    pub fn run_folder(&self, run: &str) -> PathBuf {
        self.dir.join(Self::FOLDER).join(run)
    }
}

impl TrackersConfig {
    /// Where each tracker writes for run `run`, one line each (`check-config`); empty when
    /// none is on.
    pub fn destinations(&self, run: &str) -> Vec<String> {
        self.tensorboard
            .iter()
            .map(|tb| format!("tensorboard: {}", tb.run_folder(run).display()))
            .collect()
    }
}

pub(super) fn check_trackers(v: &mut Validator, trackers: &TrackersConfig) {
    if let Some(tb) = &trackers.tensorboard
        && tb.dir.as_os_str().is_empty()
    {
        v.problem(
            "trackers.tensorboard.dir",
            "is empty: give the TensorBoard log folder, e.g. `dir: logs`",
        );
    }
}
