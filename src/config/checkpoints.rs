//! The `checkpoints` section: which entries of `run.dir` are checkpoints, when they are
//! complete and how their weights are read; as written ([`Checkpoints`]) and as settings
//! ([`CheckpointsConfig`], with the glob, the step pattern, the weights files and the durations
//! parsed), built and checked by [`checkpoints`].

use super::validate::{Validator, default_true};
use super::values::{Glob, StepPattern, WeightsFile};
use serde::{Deserialize, Serialize};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backlog {
    /// Evaluate every checkpoint, in step order.
    All,
    /// When evaluation falls behind, evaluate only the newest pending checkpoint.
    Latest,
}

/// `checkpoints`: which entries of `run.dir` are checkpoints, when they are complete, and how
/// their weights are read.
#[derive(Debug, Clone)]
pub struct CheckpointsConfig {
    pub pattern: Glob,
    pub step_regex: StepPattern,
    pub weights_key: Option<String>,
    pub strip_prefix: Option<String>,
    /// `checkpoints.settle_secs`: how long a unit's key must stay the same.
    pub settle: Duration,
    /// `checkpoints.poll_secs`: the periodic rescan.
    pub poll: Duration,
    pub backlog: Backlog,
    /// Use filesystem notifications (inotify) besides the periodic rescan.
    pub inotify: bool,
    /// The most MiB any one zip entry of a checkpoint may inflate to (1 to 2^20).
    pub max_entry_mib: u64,
    /// The most MiB the selected tensors of one checkpoint may take in all (1 to 2^20); `None`:
    /// 4 times the architecture's size, at least 64 MiB (`weights::default_max_total_bytes`).
    pub max_total_mib: Option<u64>,
    /// Where a checkpoint holds both EMA and raw weights, evaluate the EMA ones.
    pub prefer_ema: bool,
    /// Tried in order inside a checkpoint folder; `None`: the defaults of
    /// [`crate::store::unit::default_weights_files`].
    pub weights_files: Option<Vec<WeightsFile>>,
}

impl Default for CheckpointsConfig {
    /// The settings of an empty `checkpoints` section.
    fn default() -> Self {
        checkpoints(&mut Validator::default(), &Checkpoints::default())
            .expect("the default checkpoints section is valid")
    }
}

/// `checkpoints`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Checkpoints {
    #[serde(default = "default_pattern")]
    pub(super) pattern: String,
    #[serde(default = "default_step_regex")]
    pub(super) step_regex: String,
    #[serde(default)]
    pub(super) weights_key: Option<String>,
    #[serde(default)]
    pub(super) strip_prefix: Option<String>,
    #[serde(default = "default_settle_secs")]
    pub(super) settle_secs: f64,
    #[serde(default = "default_poll_secs")]
    pub(super) poll_secs: f64,
    #[serde(default = "default_backlog")]
    pub(super) backlog: Backlog,
    /// Use filesystem notifications (inotify) besides the periodic rescan.
    #[serde(default = "default_true")]
    pub(super) inotify: bool,
    /// The most MiB any one zip entry of a checkpoint may inflate to (bounds compressed
    /// entries; a storage is also bounded by what its tensors declare).
    #[serde(default = "default_max_entry_mib")]
    pub(super) max_entry_mib: u64,
    /// The most MiB the selected tensors of one checkpoint may take in memory in all; default
    /// (absent) 4 times the architecture's parameter and buffer bytes, at least 64 MiB.
    #[serde(default)]
    pub(super) max_total_mib: Option<u64>,
    /// Where a checkpoint holds both EMA and raw weights, evaluate the EMA ones.
    #[serde(default = "default_true")]
    pub(super) prefer_ema: bool,
    /// Relative paths (a `*` glob within a component) tried in order inside a checkpoint
    /// folder; default `unit::default_weights_files`.
    #[serde(default)]
    pub(super) weights_files: Option<Vec<String>>,
}

fn default_pattern() -> String {
    "{*.pt,*.pth,*.ckpt,*.safetensors,*.bin,*.pkl,*.ts,checkpoint-*,checkpoint_*}".into()
}
fn default_step_regex() -> String {
    r"(\d+)\D*$".into()
}
fn default_settle_secs() -> f64 {
    2.0
}
fn default_poll_secs() -> f64 {
    10.0
}
/// Largest `checkpoints.max_entry_mib`: 1 TiB (the bound must stay far below what u64 bytes hold).
pub(super) const MAX_ENTRY_MIB: u64 = 1 << 20;
fn default_max_entry_mib() -> u64 {
    crate::weights::DEFAULT_MAX_ENTRY_MIB
}
fn default_backlog() -> Backlog {
    Backlog::All
}

impl Default for Checkpoints {
    fn default() -> Self {
        Checkpoints {
            pattern: default_pattern(),
            step_regex: default_step_regex(),
            weights_key: None,
            strip_prefix: None,
            settle_secs: default_settle_secs(),
            poll_secs: default_poll_secs(),
            backlog: default_backlog(),
            inotify: true,
            max_entry_mib: default_max_entry_mib(),
            max_total_mib: None,
            prefer_ema: true,
            weights_files: None,
        }
    }
}

/// The `checkpoints` section's settings; `None` when a value is refused (the problem is in `v`).
pub(super) fn checkpoints(v: &mut Validator, c: &Checkpoints) -> Option<CheckpointsConfig> {
    let pattern = v.parse("checkpoints.pattern", Glob::parse(&c.pattern));
    let step_regex = v.parse("checkpoints.step_regex", StepPattern::parse(&c.step_regex));
    let weights_files = match &c.weights_files {
        Some(files) => {
            v.check(
                !files.is_empty(),
                "checkpoints.weights_files",
                "must list at least one relative path (or be left out for the defaults)",
            );
            let parsed: Vec<Option<WeightsFile>> = files
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    v.parse(
                        &format!("checkpoints.weights_files[{i}]"),
                        WeightsFile::parse(f),
                    )
                })
                .collect();
            parsed.into_iter().collect::<Option<Vec<_>>>().map(Some)
        }
        None => Some(None),
    };
    let settle = v.secs("checkpoints.settle_secs", c.settle_secs, 0.0..=86_400.0);
    let poll = v.secs("checkpoints.poll_secs", c.poll_secs, 0.1..=3_600.0);
    v.count(
        "checkpoints.max_entry_mib",
        usize::try_from(c.max_entry_mib).unwrap_or(usize::MAX),
        1..=MAX_ENTRY_MIB as usize,
    );
    if let Some(total) = c.max_total_mib {
        v.count(
            "checkpoints.max_total_mib",
            usize::try_from(total).unwrap_or(usize::MAX),
            1..=MAX_ENTRY_MIB as usize,
        );
    }
    Some(CheckpointsConfig {
        pattern: pattern?,
        step_regex: step_regex?,
        weights_key: c.weights_key.clone(),
        strip_prefix: c.strip_prefix.clone(),
        settle: settle?,
        poll: poll?,
        backlog: c.backlog,
        inotify: c.inotify,
        max_entry_mib: c.max_entry_mib,
        max_total_mib: c.max_total_mib,
        prefer_ema: c.prefer_ema,
        weights_files: weights_files?,
    })
}
