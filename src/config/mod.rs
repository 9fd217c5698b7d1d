//! The YAML configuration (docs/design.md §15), in two steps. [`ConfigFile::parse`] reads the
//! text into the file's sections with their defaults, so that errors carry the key path, line
//! and column. [`ConfigFile::settings`] then checks every value, reporting every problem with its
//! key, and builds the typed [`Config`] the program runs on: durations, the compiled checkpoint
//! glob and step pattern, the weights files, the listen address, the webhooks' URLs and decoded
//! secrets. That is the only place a value is checked; nothing later parses or checks it again.
//! [`Config::load`] does both and resolves relative paths against the config file's folder.

mod file;
mod text;
mod values;
use crate::record::Evaluation;
pub use file::ConfigFile;
use reqwest::Url;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::time::Duration;
use text::{key_position, too_deep};
pub use values::{Glob, SecretEnv, StepPattern, WeightsFile};

/// The annotated example printed by `diffmon init`.
pub const EXAMPLE: &str = include_str!("../../config/diffmon.example.yaml");

/// Upper bounds of the validated ranges shared by several keys (documented in
/// `config/diffmon.example.yaml`): noise levels (EDM's largest is 80), image counts and batches.
const MAX_SIGMA: f64 = 1_000.0;
const MAX_SAMPLES: usize = 1 << 20;
const MAX_BATCH: usize = 1 << 16;
/// `max_runs` by default: the most runs one daemon watches. Each run costs two threads (its
/// watcher and recorder; a third, and an inotify instance and watch, with notifications), its
/// own evaluation context, state lock and alerter.
pub const DEFAULT_MAX_RUNS: usize = 256;
/// The largest `max_runs` accepted.
pub const MAX_RUNS: usize = 4096;

/// A number as a person writes it in YAML: `1e20` rather than twenty-one digits.
fn num(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e6).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// PF-ODE latents of the memorization ratio that `early_stop.confirm: auto` turns on when no
/// held-out set is configured and `pfd.enabled` is false (docs/design.md §9): one memorized
/// sample is 0.8% of them, well under the 5% at which the toy runs count as memorizing, for 35 ×
/// 128 network calls per checkpoint.
pub const CONFIRM_LATENTS: usize = 128;

/// Largest config file read (a real one is a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Deepest flow nesting (`[`/`{`) accepted. A real config nests 3 deep; the YAML scanner's cost
/// grows with the square of the depth (100 KB of `[` took 12 s), so deeper input is refused
/// before it is parsed.
pub const MAX_FLOW_DEPTH: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read the config file: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: the config file is {size} bytes; at most {MAX_CONFIG_BYTES} are read")]
    TooLarge { path: PathBuf, size: u64 },
    #[error("{file}: {location}{key}: {message}")]
    Parse {
        file: String,
        /// `line L, column C: ` when the parser knows where.
        location: String,
        /// The key path (`icr.samples`), or `(top level)`.
        key: String,
        message: String,
    },
    #[error("{file}: {} problem{}:\n{}", problems.len(), if problems.len() == 1 { "" } else { "s" },
        problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        file: String,
        problems: Vec<Problem>,
    },
}

/// One problem found by validation, with the key it concerns.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub key: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.key, self.message)
    }
}

/// The settings the program runs on: a config file's values, each checked and parsed once by
/// [`ConfigFile::settings`] (through [`Config::load`]). The sections keep the file's names; keys
/// given in seconds are [`Duration`]s here, without the `_secs`.
#[derive(Debug, Clone)]
pub struct Config {
    pub run: RunConfig,
    /// Where diffmon keeps its history, alert outbox, caches, lock and crash marker.
    /// Default: `<run.dir>/.diffmon`.
    pub state_dir: Option<PathBuf>,
    pub checkpoints: CheckpointsConfig,
    pub model: ModelConfig,
    pub device: DeviceSpec,
    /// CPU threads of libtorch's operations (default: libtorch's choice, one per core).
    pub cpu_threads: Option<usize>,
    /// `shutdown_drain_secs`: how long the first SIGINT/SIGTERM waits for the evaluation in
    /// flight before the daemon exits anyway.
    pub shutdown_drain: Duration,
    pub data: DataConfig,
    pub icr: IcrConfig,
    pub pfd: PfdConfig,
    pub memorization: MemorizationConfig,
    pub tail: TailConfig,
    pub early_stop: EarlyStopConfig,
    pub alerts: AlertsConfig,
    pub http: HttpConfig,
    pub evaluation: EvaluationConfig,
    /// The config file this was read from (`None`: built from text); the Slurm executor's jobs
    /// read it.
    pub source: Option<PathBuf>,
    /// The memorization ratio (and, with `pfd.enabled: false`, a PF-ODE of
    /// [`CONFIRM_LATENTS`] latents) was turned on by `early_stop.confirm: auto` without a
    /// held-out set ([`Config::imply_memorization`]); not a key.
    pub implied_memorization: bool,
    /// Of these, the PF-ODE itself (`pfd.enabled` was false).
    pub implied_pf_ode: bool,
    /// A sweep (`runs`, or the folders `runs_glob` matches): each run's complete settings, in
    /// the file's order (by name for `runs_glob`); empty for a single run. The fields above are
    /// then the first run's. See [`Config::runs`].
    pub sweep: Vec<Config>,
    /// `runs_glob`: how to find the sweep's runs again, as folders appear. With no match yet,
    /// `sweep` is empty and the fields above are the shared settings, checked as those of a run
    /// in the glob's folder.
    pub runs_glob: Option<RunsGlob>,
    /// `max_runs`: the most runs of a sweep (1 to [`MAX_RUNS`]).
    pub max_runs: usize,
}

/// `runs_glob`, compiled: the folder whose entries are matched, and the matcher of their names.
#[derive(Debug, Clone)]
pub struct RunsGlob {
    /// The glob, as resolved against the config file's folder.
    pub pattern: PathBuf,
    parent: PathBuf,
    matcher: globset::GlobMatcher,
    /// The config as written (paths resolved): each new run's settings are built from it.
    file: std::sync::Arc<ConfigFile>,
}

/// Entries of the glob's folder read at most per scan: the folder is the user's, but what lands
/// in it may not be.
const MAX_GLOB_ENTRIES: usize = 100_000;

impl RunsGlob {
    /// Splits `pattern` into its folder, which must be literal, and the glob of the last
    /// component.
    fn compile(pattern: &Path, file: &ConfigFile) -> Result<RunsGlob, String> {
        let wild = |s: &str| s.contains(['*', '?', '[', '{']);
        let (Some(parent), Some(last)) = (pattern.parent(), pattern.file_name()) else {
            return Err(format!(
                "`{}` names no folder entries: give a glob such as `sweep/*`",
                pattern.display()
            ));
        };
        if wild(&parent.to_string_lossy()) {
            return Err(format!(
                "`{}`: wildcards only in the last component (the runs are the entries of one folder)",
                pattern.display()
            ));
        }
        let last = last.to_string_lossy();
        let matcher = globset::GlobBuilder::new(&last)
            .literal_separator(true)
            .build()
            .map_err(|e| format!("`{}` is not a valid glob: {e}", pattern.display()))?
            .compile_matcher();
        Ok(RunsGlob {
            pattern: pattern.to_path_buf(),
            parent: parent.to_path_buf(),
            matcher,
            file: std::sync::Arc::new(file.clone()),
        })
    }

    /// The folder whose entries are the runs (the pattern's literal part).
    pub fn folder(&self) -> &Path {
        &self.parent
    }

    /// The runs now: the folder's entries that match, are folders (not links), are not hidden
    /// and have a run's name, as (name, folder), sorted by name; all of them, of which the sweep
    /// watches at most `max_runs`. A folder that cannot be read has none.
    pub fn matches(&self) -> Vec<(String, PathBuf)> {
        let Ok(entries) = std::fs::read_dir(&self.parent) else {
            return Vec::new();
        };
        let mut found: Vec<(String, PathBuf)> = entries
            .take(MAX_GLOB_ENTRIES)
            .filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                let is_dir = e.file_type().ok()?.is_dir();
                (is_dir
                    && !name.starts_with('.')
                    && valid_run_name(&name)
                    && self.matcher.is_match(&name))
                .then(|| (name, e.path()))
            })
            .collect();
        found.sort();
        found
    }
}

/// A run's name: letters, digits, `.`, `_` or `-` (it is a URL path and a label).
fn valid_run_name(name: &str) -> bool {
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

fn default_true() -> bool {
    true
}

impl Default for CheckpointsConfig {
    /// The settings of an empty `checkpoints` section.
    fn default() -> Self {
        checkpoints(&mut Validator::default(), &file::Checkpoints::default())
            .expect("the default checkpoints section is valid")
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// TorchScript file of the model contract (docs/design.md §11).
    pub architecture: PathBuf,
}

/// `auto` (CUDA when available), `cpu`, `cuda` (device 0) or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceSpec::Auto),
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::Cuda)
                .ok_or_else(|| format!("must be auto, cpu, cuda or cuda:N, got `{s}`")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// HDF5 file of training images (docs/design.md §12).
    pub path: PathBuf,
    #[serde(default = "default_dataset")]
    pub dataset: String,
    /// Held-out images for the denoising generalization gap (docs/design.md §8).
    #[serde(default)]
    pub heldout_path: Option<PathBuf>,
    #[serde(default = "default_dataset")]
    pub heldout_dataset: String,
}

fn default_dataset() -> String {
    "images".into()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct IcrConfig {
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default = "default_icr_sigma")]
    pub sigma: f64,
    /// Noise-level sweep: ICR at each of these sigmas (absent: no sweep).
    #[serde(default)]
    pub sigmas: Option<Vec<f64>>,
    #[serde(default = "default_icr_samples")]
    pub samples: usize,
    #[serde(default = "default_ridge")]
    pub ridge: f64,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    #[serde(default)]
    pub augment: AugmentConfig,
    /// Correction of ICR's finite-n bias (docs/design.md §2); off by default.
    #[serde(default)]
    pub bias_correction: BiasCorrection,
}

/// `icr.bias_correction`: how ICR's dependence on the number of view pairs is corrected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BiasCorrection {
    /// The plain estimate.
    #[default]
    None,
    /// The jackknife's bias correction `G·ICR − (G−1)·mean of the leave-one-group-out ICRs`.
    Jackknife,
}

fn default_icr_sigma() -> f64 {
    0.29
}
fn default_icr_samples() -> usize {
    4096
}
fn default_ridge() -> f64 {
    1e-4
}
fn default_batch_size() -> usize {
    256
}

impl Default for IcrConfig {
    fn default() -> Self {
        IcrConfig {
            enabled: true,
            sigma: default_icr_sigma(),
            sigmas: None,
            samples: default_icr_samples(),
            ridge: default_ridge(),
            seed: 0,
            batch_size: default_batch_size(),
            augment: AugmentConfig::default(),
            bias_correction: BiasCorrection::None,
        }
    }
}

/// The two-view augmentations of ICR (docs/design.md §2); 0 or false switches one off.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AugmentConfig {
    /// Random crop with reflect padding of this fraction of the side.
    #[serde(default = "default_crop")]
    pub crop: f64,
    /// Horizontal flip with probability 0.5.
    #[serde(default = "default_true")]
    pub flip: bool,
    /// Brightness, contrast and saturation jitter strength.
    #[serde(default = "default_jitter")]
    pub jitter: f64,
}

fn default_crop() -> f64 {
    0.125
}
fn default_jitter() -> f64 {
    0.4
}

impl Default for AugmentConfig {
    fn default() -> Self {
        AugmentConfig {
            crop: default_crop(),
            flip: true,
            jitter: default_jitter(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PfdConfig {
    #[serde(default)]
    pub enabled: bool,
    /// Teacher TorchScript (same contract as the model); E_gen is computed only with one.
    #[serde(default)]
    pub teacher: Option<PathBuf>,
    #[serde(default = "default_pfd_samples")]
    pub samples: usize,
    #[serde(default = "default_steps")]
    pub steps: usize,
    #[serde(default = "default_sigma_min")]
    pub sigma_min: f64,
    #[serde(default = "default_sigma_max")]
    pub sigma_max: f64,
    #[serde(default = "default_rho")]
    pub rho: f64,
    /// Image descriptor Ψ: a TorchScript `[B,C,H,W] → [B,k]`; absent: identity (pixels).
    #[serde(default)]
    pub descriptor: Option<PathBuf>,
    #[serde(default)]
    pub seed: u64,
    /// HDF5 file whose `/latents` `[M,C,H,W]` are used instead of seeded ones.
    #[serde(default)]
    pub latents: Option<PathBuf>,
    /// Evaluate the PF-ODE metrics every k-th checkpoint.
    #[serde(default = "default_every")]
    pub every: usize,
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
}

fn default_pfd_samples() -> usize {
    10_000
}
fn default_steps() -> usize {
    18
}
fn default_sigma_min() -> f64 {
    0.002
}
fn default_sigma_max() -> f64 {
    80.0
}
fn default_rho() -> f64 {
    7.0
}
fn default_every() -> usize {
    1
}

impl Default for PfdConfig {
    fn default() -> Self {
        PfdConfig {
            enabled: false,
            teacher: None,
            samples: default_pfd_samples(),
            steps: default_steps(),
            sigma_min: default_sigma_min(),
            sigma_max: default_sigma_max(),
            rho: default_rho(),
            descriptor: None,
            seed: 0,
            latents: None,
            every: default_every(),
            batch_size: default_batch_size(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorizationCriterion {
    /// Nearest / second-nearest training image distance ratio below the threshold.
    NnRatio,
    /// Best cosine similarity in the descriptor space above the threshold.
    Cosine,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MemorizationConfig {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "default_criterion")]
    pub criterion: MemorizationCriterion,
    /// Default: 1/3 for `nn_ratio`, 0.6 for `cosine`.
    #[serde(default)]
    pub threshold: Option<f64>,
}

fn default_criterion() -> MemorizationCriterion {
    MemorizationCriterion::NnRatio
}

impl Default for MemorizationConfig {
    fn default() -> Self {
        MemorizationConfig {
            enabled: false,
            criterion: default_criterion(),
            threshold: None,
        }
    }
}

impl MemorizationConfig {
    pub fn threshold(&self) -> f64 {
        self.threshold.unwrap_or(match self.criterion {
            MemorizationCriterion::NnRatio => 1.0 / 3.0,
            MemorizationCriterion::Cosine => 0.6,
        })
    }
}

/// A scalar observable of a sample (docs/design.md §7).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Observable {
    Max,
    Min,
    Mean,
    Sum,
    Quantile(f64),
}

impl std::str::FromStr for Observable {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "max" => Ok(Observable::Max),
            "min" => Ok(Observable::Min),
            "mean" => Ok(Observable::Mean),
            "sum" => Ok(Observable::Sum),
            _ => match s.strip_prefix("quantile:").map(str::parse::<f64>) {
                Some(Ok(q)) if (0.0..=1.0).contains(&q) => Ok(Observable::Quantile(q)),
                _ => Err(format!(
                    "must be max, min, mean, sum or quantile:q with q in [0, 1], got `{s}`"
                )),
            },
        }
    }
}

impl fmt::Display for Observable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Observable::Max => write!(f, "max"),
            Observable::Min => write!(f, "min"),
            Observable::Mean => write!(f, "mean"),
            Observable::Sum => write!(f, "sum"),
            Observable::Quantile(q) => write!(f, "quantile:{q}"),
        }
    }
}

impl<'de> Deserialize<'de> for Observable {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for Observable {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TailReference {
    /// The teacher's samples from the same latents.
    Teacher,
    /// The training images.
    Training,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TailConfig {
    #[serde(default)]
    pub enabled: bool,
    #[serde(default = "default_observable")]
    pub observable: Observable,
    #[serde(default = "default_eta")]
    pub eta: f64,
    #[serde(default = "default_tail_reference")]
    pub reference: TailReference,
    /// Affine map to physical units applied to the observable: `scale · o + offset`.
    #[serde(default = "default_scale")]
    pub scale: f64,
    #[serde(default)]
    pub offset: f64,
}

fn default_observable() -> Observable {
    Observable::Max
}
fn default_eta() -> f64 {
    0.975
}
fn default_tail_reference() -> TailReference {
    TailReference::Teacher
}
fn default_scale() -> f64 {
    1.0
}

impl Default for TailConfig {
    fn default() -> Self {
        TailConfig {
            enabled: false,
            observable: default_observable(),
            eta: default_eta(),
            reference: default_tail_reference(),
            scale: default_scale(),
            offset: 0.0,
        }
    }
}

/// The series the early-stop detector watches (`early_stop.metric`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EarlyStopMetric {
    Icr,
    PfdGeneralization,
}

impl EarlyStopMetric {
    /// Its name: the config value, the evaluation record's field, and the `metric` of the
    /// early-stop events (JSON and alert labels).
    pub const fn as_str(self) -> &'static str {
        match self {
            EarlyStopMetric::Icr => "icr",
            EarlyStopMetric::PfdGeneralization => "pfd_generalization",
        }
    }

    /// Its value in an evaluation record; `None` when it was not computed.
    pub fn value(self, r: &Evaluation) -> Option<f64> {
        match self {
            EarlyStopMetric::Icr => r.icr,
            EarlyStopMetric::PfdGeneralization => r.pfd_generalization,
        }
    }
}

/// `early_stop.confirm` as written: a confirming signal, or `auto` (resolved by
/// [`Config::early_stop_resolved`] into a [`Confirmation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Confirm {
    /// `generalization_gap` when `data.heldout_path` is set, else `memorization_ratio`.
    Auto,
    None,
    GeneralizationGap,
    MemorizationRatio,
}

impl Confirm {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Confirm::Auto => "auto",
            Confirm::None => "none",
            Confirm::GeneralizationGap => "generalization_gap",
            Confirm::MemorizationRatio => "memorization_ratio",
        }
    }
}

/// The signal that confirms a turn, as the detector applies it: `early_stop.confirm` with
/// `auto` resolved (docs/design.md §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Confirmation {
    None,
    GeneralizationGap,
    MemorizationRatio,
}

impl Confirmation {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Confirmation::None => "none",
            Confirmation::GeneralizationGap => "generalization_gap",
            Confirmation::MemorizationRatio => "memorization_ratio",
        }
    }
}

/// How the detector smooths the monitored series (`early_stop.smoother`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Smoother {
    /// The median of the last `window` values.
    Median,
    /// An exponential moving average of span `window` (weight `2/(window + 1)` on the newest).
    Ema,
}

impl Smoother {
    /// Its name, as the config writes it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Smoother::Median => "median",
            Smoother::Ema => "ema",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopConfig {
    #[serde(default = "default_es_metric")]
    pub metric: EarlyStopMetric,
    #[serde(default = "default_smoother")]
    pub smoother: Smoother,
    #[serde(default = "default_window")]
    pub window: usize,
    #[serde(default = "default_warmup")]
    pub warmup: usize,
    #[serde(default = "default_patience")]
    pub patience: usize,
    #[serde(default = "default_min_rise")]
    pub min_rise: f64,
    /// The rise must also exceed this many times the noise of the smoothed value; 0 turns the
    /// noise rule off.
    #[serde(default = "default_noise_multiple")]
    pub noise_multiple: f64,
    #[serde(default = "default_confirm")]
    pub confirm: Confirm,
    #[serde(default = "default_confirm_rise")]
    pub confirm_rise: f64,
    /// Keep a link (or a copy) of the best checkpoint in `<state_dir>/best/`.
    #[serde(default = "default_keep_best")]
    pub keep_best: bool,
}

fn default_es_metric() -> EarlyStopMetric {
    EarlyStopMetric::Icr
}
fn default_smoother() -> Smoother {
    Smoother::Median
}
fn default_window() -> usize {
    3
}
fn default_warmup() -> usize {
    3
}
fn default_patience() -> usize {
    2
}
fn default_min_rise() -> f64 {
    0.005
}
fn default_noise_multiple() -> f64 {
    6.0
}
fn default_confirm() -> Confirm {
    Confirm::Auto
}
fn default_confirm_rise() -> f64 {
    0.5
}
fn default_keep_best() -> bool {
    true
}

impl Default for EarlyStopConfig {
    fn default() -> Self {
        EarlyStopConfig {
            metric: default_es_metric(),
            smoother: default_smoother(),
            window: default_window(),
            warmup: default_warmup(),
            patience: default_patience(),
            min_rise: default_min_rise(),
            noise_multiple: default_noise_multiple(),
            confirm: default_confirm(),
            confirm_rise: default_confirm_rise(),
            keep_best: default_keep_best(),
        }
    }
}

/// The detector's settings: the `early_stop` section with `confirm: auto` resolved
/// ([`Config::early_stop_resolved`]), so that the detector never meets `auto`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EarlyStopSettings {
    pub metric: EarlyStopMetric,
    pub smoother: Smoother,
    pub window: usize,
    pub warmup: usize,
    pub patience: usize,
    pub min_rise: f64,
    pub noise_multiple: f64,
    pub confirm: Confirmation,
    pub confirm_rise: f64,
}

impl EarlyStopSettings {
    /// The section's settings with `confirmation` in place of its `confirm`.
    pub fn of(e: &EarlyStopConfig, confirmation: Confirmation) -> EarlyStopSettings {
        EarlyStopSettings {
            metric: e.metric,
            smoother: e.smoother,
            window: e.window,
            warmup: e.warmup,
            patience: e.patience,
            min_rise: e.min_rise,
            noise_multiple: e.noise_multiple,
            confirm: confirmation,
            confirm_rise: e.confirm_rise,
        }
    }
}

impl EarlyStopConfig {
    /// The ranges of its values (the dependencies on other sections are checked by
    /// [`Config::validate`]).
    fn check_ranges(&self, v: &mut Validator) {
        v.count("early_stop.window", self.window, 1..=1000);
        v.count("early_stop.warmup", self.warmup, 0..=1_000_000);
        v.count("early_stop.patience", self.patience, 1..=1_000_000);
        v.real("early_stop.min_rise", self.min_rise, 0.0..=10.0);
        v.real(
            "early_stop.noise_multiple",
            self.noise_multiple,
            0.0..=100.0,
        );
        v.positive("early_stop.confirm_rise", self.confirm_rise, 10.0);
    }

    /// Every problem of the section's values, each with its key: the ranges alone, for
    /// settings given apart from a config file.
    pub fn problems(&self) -> Vec<Problem> {
        let mut v = Validator::default();
        self.check_ranges(&mut v);
        v.problems
    }
}

impl Default for EarlyStopSettings {
    /// The defaults, without a confirmation (the defaults' `auto` depends on the data keys).
    fn default() -> Self {
        EarlyStopSettings::of(&EarlyStopConfig::default(), Confirmation::None)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    Json,
    Slack,
    Alertmanager,
}

/// `alerts.webhooks[]`: a destination of the early-stop events.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub url: Url,
    pub format: WebhookFormat,
    /// `secret_env`: the variable and the signing secret read from it.
    pub secret: Option<SecretEnv>,
}

/// `alerts.alertmanager`.
#[derive(Debug, Clone)]
pub struct AlertmanagerConfig {
    /// Alertmanager's base URL (the alerts are posted to `{url}/api/v2/alerts`).
    pub url: Url,
}

#[derive(Debug, Clone)]
pub struct AlertsConfig {
    pub webhooks: Vec<WebhookConfig>,
    pub alertmanager: Option<AlertmanagerConfig>,
    /// File name inside `run.dir` written when the early stop fires.
    pub stop_file: String,
}

impl Default for AlertsConfig {
    /// No destinations, the default stop file.
    fn default() -> Self {
        alerts(&mut Validator::default(), &file::Alerts::default(), None)
            .expect("the default alerts section is valid")
    }
}

/// `evaluation.executor`: where checkpoints are evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExecutorKind {
    /// The evaluator thread of the daemon, one checkpoint at a time.
    #[default]
    Local,
    /// One Slurm job per checkpoint, `diffmon eval --json` on a compute node.
    Slurm,
}

/// `evaluation`: the executor and its settings.
#[derive(Debug, Clone, PartialEq)]
pub struct EvaluationConfig {
    pub executor: ExecutorKind,
    /// Jobs in flight at once (Slurm).
    pub max_in_flight: usize,
    /// Resubmissions of a job that failed, timed out, was cancelled or lost (Slurm).
    pub retries: usize,
    pub slurm: SlurmConfig,
}

/// `evaluation.slurm`.
#[derive(Debug, Clone, PartialEq)]
pub struct SlurmConfig {
    pub partition: Option<String>,
    pub account: Option<String>,
    /// `--time`, in Slurm's format (`30`, `1:00:00`, `1-0`).
    pub time_limit: Option<String>,
    pub gres: Option<String>,
    /// More `sbatch` options, each one argument.
    pub sbatch_args: Vec<String>,
    /// Set in `sbatch`'s environment, which the job inherits (Slurm's `--export=ALL`).
    pub env: std::collections::BTreeMap<String, String>,
    pub poll: Duration,
    /// The `diffmon` the job runs (default: this process's executable).
    pub binary: Option<PathBuf>,
}

impl Default for EvaluationConfig {
    fn default() -> Self {
        evaluation(&mut Validator::default(), &file::Evaluation::default())
            .expect("the default evaluation section is valid")
    }
}

/// `http`: the metrics server's address and bounds.
#[derive(Debug, Clone, Copy)]
pub struct HttpConfig {
    pub listen: SocketAddr,
    /// `http.header_timeout_secs`: a request's headers must arrive within this time after its
    /// first byte, else the connection is closed.
    pub header_timeout: Duration,
    /// `http.idle_timeout_secs`: a connection without a request in flight is closed after this.
    pub idle_timeout: Duration,
    /// Connections open at once; one more is accepted and closed at once.
    pub max_connections: NonZeroUsize,
}

impl Default for HttpConfig {
    fn default() -> Self {
        http(&mut Validator::default(), &file::Http::default())
            .expect("the default http section is valid")
    }
}

impl Config {
    /// Reads, parses and validates a config file; relative paths become relative to its folder.
    /// The webhooks' secrets must be set in the environment and well-formed (for `watch` and
    /// `check-config`).
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_checking(path, true)
    }

    /// [`Config::load`] for commands that send nothing (`eval`, `report`, `bias-variance`):
    /// the webhooks' secrets are not looked up.
    pub fn load_without_secrets(path: &Path) -> Result<Config, ConfigError> {
        Config::load_checking(path, false)
    }

    fn load_checking(path: &Path, secrets: bool) -> Result<Config, ConfigError> {
        let text = read_bounded(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        let mut config = ConfigFile::parse(&text, &path.display().to_string())?;
        config.resolve_paths(base);
        let mut config = config
            .settings(secrets)
            .map_err(|problems| ConfigError::Invalid {
                file: path.display().to_string(),
                problems,
            })?;
        config.source = Some(std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()));
        Ok(config)
    }
}

impl ConfigFile {
    /// Parses YAML text; `file` names the source in errors. No validation, no path resolution.
    /// A UTF-8 byte-order mark (which some Windows editors write) is dropped first; it is
    /// invisible, so columns are counted without it.
    pub fn parse(text: &str, file: &str) -> Result<ConfigFile, ConfigError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        if let Some((line, column)) = too_deep(text) {
            return Err(ConfigError::Parse {
                file: file.to_string(),
                location: format!("line {line}, column {column}: "),
                key: "(top level)".to_string(),
                message: format!(
                    "brackets nest more than {MAX_FLOW_DEPTH} deep; a config needs at most a few levels"
                ),
            });
        }
        let de = serde_yaml::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let key = match e.path().to_string() {
                p if p == "." => "(top level)".to_string(),
                p => p,
            };
            let inner = e.into_inner();
            // serde_yaml appends " at line L column C" itself; keep the message clean.
            let mut message = inner.to_string();
            if let Some(i) = message.find(" at line ") {
                message.truncate(i);
            }
            // It also starts nested messages with its own (shorter) path: `icr: unknown field`.
            if let Some((head, rest)) = message.split_once(": ")
                && !head.contains(char::is_whitespace)
            {
                message = rest.to_string();
            }
            // For errors raised after a value was read (`device: tpu`) and for duplicate keys,
            // serde_yaml points at the start of the enclosing mapping; the key is found in the
            // text instead. (A duplicate's path is the mapping that holds it.)
            let path = if key == "(top level)" { "" } else { &key };
            let duplicate = message
                .strip_prefix("duplicate field `")
                .and_then(|m| m.split('`').next());
            let found = match duplicate {
                Some(name) => key_position(text, path, Some((name, 2))),
                None if !path.is_empty() => key_position(text, path, None),
                None => None,
            };
            let reported = inner.location().map(|l| (l.line(), l.column()));
            let location = match (reported, found) {
                (Some((line, _)), Some(at)) if at.0 != line => Some(at),
                (reported, found) => reported.or(found),
            }
            .map(|(line, column)| format!("line {line}, column {column}: "))
            .unwrap_or_default();
            ConfigError::Parse {
                file: file.to_string(),
                location,
                key,
                message,
            }
        })
    }

    fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            *p = if p.is_relative() {
                normalize(&base.join(&*p))
            } else {
                normalize(p)
            };
        };
        if let Some(run) = self.run.as_mut() {
            fix(&mut run.dir);
        }
        if let Some(p) = self.state_dir.as_mut() {
            fix(p);
        }
        if let Some(p) = self.runs_glob.as_mut() {
            fix(p);
        }
        for entry in self.runs.iter_mut().flatten() {
            fix(&mut entry.dir);
            if let Some(p) = entry.state_dir.as_mut() {
                fix(p);
            }
            if let Some(data) = entry.data.as_mut() {
                fix(&mut data.path);
                if let Some(p) = data.heldout_path.as_mut() {
                    fix(p);
                }
            }
        }
        fix(&mut self.model.architecture);
        fix(&mut self.data.path);
        for p in [
            self.data.heldout_path.as_mut(),
            self.pfd.teacher.as_mut(),
            self.pfd.descriptor.as_mut(),
            self.pfd.latents.as_mut(),
        ]
        .into_iter()
        .flatten()
        {
            fix(p);
        }
        if let Some(p) = self.evaluation.slurm.binary.as_mut() {
            fix(p);
        }
    }
}

impl Config {
    /// Files the config names that may sit in `run.dir` and are never checkpoints: the
    /// architecture, the data, the teacher, descriptor and latents, the stop file and the state
    /// folder.
    pub fn named_files(&self) -> Vec<PathBuf> {
        let mut v = vec![
            self.model.architecture.clone(),
            self.data.path.clone(),
            self.run.dir.join(&self.alerts.stop_file),
            self.state_dir(),
        ];
        v.extend(
            [
                &self.data.heldout_path,
                &self.pfd.teacher,
                &self.pfd.descriptor,
                &self.pfd.latents,
            ]
            .into_iter()
            .flatten()
            .cloned(),
        );
        v
    }

    /// The label `run` on every metric.
    pub fn run_name(&self) -> String {
        self.run.name.clone().unwrap_or_else(|| {
            let dir = std::fs::canonicalize(&self.run.dir).unwrap_or_else(|_| self.run.dir.clone());
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "run".into())
        })
    }

    /// What one checkpoint costs in network calls (one image through the network), per metric:
    /// one line for `check-config` and the daemon's start. ICR is two views per pair (and again
    /// per sweep sigma), the gap one call per training and held-out image (at most
    /// `icr.samples` each), PFD the student's PF-ODE, `2·steps − 1` calls per latent.
    pub fn cost_summary(&self) -> String {
        let mut parts = Vec::new();
        let n = self.icr.samples;
        if self.icr.enabled {
            let sigmas = 1 + self.icr.sigmas.as_ref().map_or(0, Vec::len);
            let times = if sigmas > 1 {
                format!(" x {sigmas} sigmas")
            } else {
                String::new()
            };
            parts.push(format!("ICR {} (2 x icr.samples{times})", 2 * n * sigmas));
        }
        if self.data.heldout_path.is_some() {
            parts.push(format!("gap up to {} (train and held-out images)", 2 * n));
        }
        if self.pfd.enabled {
            let per_latent = 2 * self.pfd.steps - 1;
            let every = match self.pfd.every {
                1 => "every checkpoint".to_string(),
                k => format!("every {k}{} checkpoint", ordinal_suffix(k)),
            };
            let (what, why) = if self.implied_pf_ode {
                (
                    "memorization ratio",
                    ", for early_stop.confirm: auto without data.heldout_path",
                )
            } else {
                ("PFD", "")
            };
            parts.push(match &self.pfd.latents {
                Some(_) => format!("{what} {per_latent} per latent of pfd.latents, {every}{why}"),
                None if self.implied_pf_ode => format!(
                    "{what} {} ({per_latent} x {} latents, {every}{why})",
                    per_latent * self.pfd.samples,
                    self.pfd.samples
                ),
                None => format!(
                    "{what} {} ({per_latent} x pfd.samples, {every})",
                    per_latent * self.pfd.samples
                ),
            });
        }
        format!(
            "network calls per checkpoint: {} (README, \"Cost and GPU\")",
            parts.join(", ")
        )
    }

    /// `early_stop.confirm` resolved: `auto` is the generalization gap when a held-out set is
    /// configured, else the memorization ratio (docs/design.md §9).
    pub fn confirmation(&self) -> Confirmation {
        match self.early_stop.confirm {
            Confirm::Auto if self.data.heldout_path.is_some() => Confirmation::GeneralizationGap,
            Confirm::Auto | Confirm::MemorizationRatio => Confirmation::MemorizationRatio,
            Confirm::GeneralizationGap => Confirmation::GeneralizationGap,
            Confirm::None => Confirmation::None,
        }
    }

    /// The detector's settings, with `confirm: auto` resolved ([`Config::confirmation`]).
    pub fn early_stop_resolved(&self) -> EarlyStopSettings {
        EarlyStopSettings::of(&self.early_stop, self.confirmation())
    }

    /// Does `early_stop.confirm: auto` need the memorization ratio that the config does not
    /// compute? (No held-out set, and `memorization.enabled` false.)
    fn needs_implied_memorization(&self) -> bool {
        implies_memorization(&self.early_stop, &self.data, &self.memorization)
    }

    /// Turns on what `early_stop.confirm: auto` without a held-out set confirms by: the
    /// memorization ratio, computed from the PF-ODE samples of PFD when `pfd.enabled`, else from
    /// [`CONFIRM_LATENTS`] latents integrated for it alone (the other `pfd.*` keys as written;
    /// E_mem comes with them). For the commands that evaluate for the early stop (`eval`,
    /// `watch`) and `check-config`, after [`Config::load`], which validates the config as
    /// written (`bias-variance` keeps its `pfd.samples`).
    pub fn imply_memorization(&mut self) {
        if !self.needs_implied_memorization() {
            return;
        }
        self.memorization.enabled = true;
        if !self.pfd.enabled {
            self.pfd.enabled = true;
            self.pfd.samples = CONFIRM_LATENTS;
            self.implied_pf_ode = true;
        }
        self.implied_memorization = true;
    }

    /// What the early stop, as configured, can and cannot tell apart (for `check-config`).
    pub fn early_stop_summary(&self) -> String {
        let e = &self.early_stop;
        let metric = e.metric.as_str();
        let rule = if e.noise_multiple > 0.0 {
            format!(
                "fires when the smoothed {metric} rises above its best by more than min_rise \
                 ({}) and {} times its own noise",
                e.min_rise, e.noise_multiple
            )
        } else {
            format!(
                "fires when the smoothed {metric} rises above its best by more than min_rise \
                 ({}); noise_multiple is 0, so a rise of noise alone can fire it",
                e.min_rise
            )
        };
        let confirm = match self.confirmation() {
            Confirmation::GeneralizationGap => "confirmed by the generalization gap \
                (data.heldout_path): tells a model that memorizes (the held-out loss rises above \
                the training loss) from a steady rise of the metric in data-rich training, \
                provided the training job never sees the held-out images"
                .to_string(),
            Confirmation::MemorizationRatio => {
                let source = match (self.implied_memorization, self.implied_pf_ode) {
                    (true, true) => format!(
                        " (early_stop.confirm: auto without data.heldout_path; from {} PF-ODE \
                         latents of its own, {} network calls per checkpoint)",
                        self.pfd.samples,
                        (2 * self.pfd.steps - 1) * self.pfd.samples
                    ),
                    (true, false) => " (early_stop.confirm: auto without data.heldout_path; \
                        from the PFD samples)"
                        .to_string(),
                    _ => String::new(),
                };
                format!(
                    "confirmed by the memorization ratio{source}: tells a model that memorizes \
                     (its samples copy training images) from a steady rise of the metric in \
                     data-rich training, but sees only copies of the images in data.path, so \
                     that file must hold the whole training set"
                )
            }
            Confirmation::None => "unconfirmed (early_stop.confirm: none): tells a turn from \
                noise, but not a model that memorizes from a steady rise of the metric in \
                data-rich training (about 2% on the full digits set, with no memorization)"
                .to_string(),
        };
        format!("early stop: {rule}; {confirm} (README, \"The early stop\")")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| self.run.dir.join(".diffmon"))
    }

    /// This config with its state folder reached through `path` (the daemon's held handle,
    /// `crate::store::state_dir`), for the evaluator, which writes caches and the crash marker there.
    pub fn writing_state_through(&self, path: &Path) -> Config {
        Config {
            state_dir: Some(path.to_path_buf()),
            ..self.clone()
        }
    }

    /// Is this a sweep (`runs` or `runs_glob`), even one with no run yet?
    pub fn is_sweep(&self) -> bool {
        !self.sweep.is_empty() || self.runs_glob.is_some()
    }

    /// `runs_glob`: every run's settings as of now, the folders that appeared since the config
    /// was read included; otherwise [`Config::runs`].
    pub fn discover_runs(&self) -> Result<Vec<Config>, Vec<Problem>> {
        let Some(glob) = &self.runs_glob else {
            return Ok(self.runs());
        };
        let mut runs = glob.file.settings(true)?.runs();
        for run in &mut runs {
            run.source.clone_from(&self.source);
        }
        Ok(runs)
    }

    /// `runs_glob`: the settings of the run folder `name` the glob matches now, whether or not
    /// it is among the first `max_runs` by name ([`Config::runs`]): a daemon keeps the runs it
    /// holds when a folder that sorts first appears, and a Slurm job of such a run
    /// (`diffmon eval --run`) must find it. `None` when no such folder matches (or no glob).
    /// The webhooks' secrets are not looked up.
    pub fn glob_run(&self, name: &str) -> Option<Result<Config, Vec<Problem>>> {
        let glob = self.runs_glob.as_ref()?;
        let (name, dir) = glob.matches().into_iter().find(|(n, _)| n == name)?;
        let mut file = (*glob.file).clone();
        file.runs_glob = None;
        let entry = file::RunEntry {
            name,
            dir,
            state_dir: None,
            data: None,
            alerts: None,
        };
        Some(file.sweep_settings(&[entry], None).map(|run| Config {
            source: self.source.clone(),
            sweep: Vec::new(),
            ..run
        }))
    }

    /// Each watched run's complete settings: this config for a single run, one per entry of
    /// `runs` (or folder `runs_glob` matched) for a sweep (docs/design.md §19).
    pub fn runs(&self) -> Vec<Config> {
        if self.sweep.is_empty() && self.runs_glob.is_none() {
            vec![self.clone()]
        } else {
            // Each from the one config file (the Slurm executor's jobs read it).
            self.sweep
                .iter()
                .map(|c| Config {
                    source: self.source.clone(),
                    ..c.clone()
                })
                .collect()
        }
    }
}

impl ConfigFile {
    /// Every problem of the config, each with its key; empty when it is valid. Includes the
    /// webhooks' secrets, read from the environment.
    pub fn validate(&self) -> Vec<Problem> {
        self.settings(true).err().unwrap_or_default()
    }

    /// The typed settings, or every problem of the config, each with its key. With `secrets`,
    /// each webhook's `secret_env` variable is read from the environment and must hold a
    /// Standard-Webhooks secret; without, it is not looked up (for commands that send
    /// nothing). The only place where the config's values are checked.
    pub fn settings(&self, secrets: bool) -> Result<Config, Vec<Problem>> {
        let env: &SecretLookup = &|var: &str| std::env::var(var);
        self.settings_with(secrets.then_some(env))
    }

    /// [`ConfigFile::settings`] with the secrets' variables looked up by `lookup` (`None`: not
    /// looked up).
    fn settings_with(&self, lookup: Option<&SecretLookup>) -> Result<Config, Vec<Problem>> {
        let problem = |key: &str, message: &str| {
            Err(vec![Problem {
                key: key.into(),
                message: message.into(),
            }])
        };
        match (&self.run, &self.runs, &self.runs_glob) {
            (Some(run), None, None) => self.run_settings(run, lookup),
            (None, Some(entries), None) => self.sweep_settings(entries, lookup),
            (None, None, Some(glob)) => self.glob_settings(glob, lookup),
            (Some(_), Some(_), _) => problem(
                "runs",
                "cannot be given with `run`: give one run (`run`) or a sweep (`runs`)",
            ),
            (_, _, Some(_)) => problem(
                "runs_glob",
                "cannot be given with `run` or `runs`: give one run (`run`), a list of runs \
                 (`runs`) or a glob of run folders (`runs_glob`)",
            ),
            (None, None, None) => problem(
                "run",
                "missing field `run` (or `runs` or `runs_glob`, for a sweep)",
            ),
        }
    }

    /// A sweep of folders: the runs `pattern` matches now, each with the shared sections, as
    /// `runs` entries with nothing of their own would give; with no match yet, the shared
    /// settings checked as those of a run in the glob's folder. Either way the glob is kept to
    /// find new runs ([`Config::discover_runs`]).
    fn glob_settings(
        &self,
        pattern: &Path,
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let problem = |key: &str, message: String| {
            vec![Problem {
                key: key.into(),
                message,
            }]
        };
        let glob = RunsGlob::compile(pattern, self).map_err(|m| problem("runs_glob", m))?;
        if self.state_dir.is_some() {
            return Err(problem(
                "state_dir",
                "cannot be given with `runs_glob`: each run keeps its state in its own folder \
                 (`<run>/.diffmon`)"
                    .into(),
            ));
        }
        let mut shared = self.clone();
        shared.runs_glob = None;
        let mut found = glob.matches();
        // The first by name; the daemon warns about the others (`daemon/sweep.rs`).
        found.truncate(self.max_runs);
        let mut config = if found.is_empty() {
            let run = RunConfig {
                name: Some("runs_glob".into()),
                dir: glob.parent.clone(),
            };
            shared.run_settings(&run, lookup)?
        } else {
            let entries: Vec<file::RunEntry> = found
                .into_iter()
                .map(|(name, dir)| file::RunEntry {
                    name,
                    dir,
                    state_dir: None,
                    data: None,
                    alerts: None,
                })
                .collect();
            shared.sweep_settings(&entries, lookup)?
        };
        config.runs_glob = Some(glob);
        Ok(config)
    }

    /// A sweep's settings: each entry's run settings (the shared sections with the entry's own
    /// `state_dir`, `data` and `alerts`), checked as a single run's are; a problem of an entry's
    /// own section is keyed under `runs[i]`, one of a shared section is reported once.
    fn sweep_settings(
        &self,
        entries: &[file::RunEntry],
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let mut v = Validator::default();
        v.check(!entries.is_empty(), "runs", "must list at least one run");
        v.count("max_runs", self.max_runs, 1..=MAX_RUNS);
        v.check(
            entries.len() <= self.max_runs,
            "runs",
            format!(
                "lists {} runs; at most {} (max_runs)",
                entries.len(),
                self.max_runs
            ),
        );
        let mut configs = Vec::new();
        for (i, entry) in entries.iter().enumerate().take(self.max_runs.min(MAX_RUNS)) {
            let at = format!("runs[{i}]");
            v.check(
                valid_run_name(&entry.name),
                &format!("{at}.name"),
                format!(
                    "`{}`: a run's name is letters, digits, `.`, `_` or `-` (it is a URL path and a label)",
                    entry.name.escape_debug()
                ),
            );
            if let Some(j) = entries[..i].iter().position(|e| e.name == entry.name) {
                v.problem(
                    &format!("{at}.name"),
                    format!("`{}` is also the name of runs[{j}]", entry.name),
                );
            }
            let mut one = self.clone();
            one.runs = None;
            one.run = Some(RunConfig {
                name: Some(entry.name.clone()),
                dir: entry.dir.clone(),
            });
            if let Some(state_dir) = &entry.state_dir {
                one.state_dir = Some(state_dir.clone());
            } else {
                one.state_dir = None;
            }
            let own = |key: &str| {
                (key.starts_with("data") && entry.data.is_some())
                    || (key.starts_with("alerts") && entry.alerts.is_some())
                    || key.starts_with("state_dir")
            };
            if let Some(data) = &entry.data {
                one.data = data.clone();
            }
            if let Some(alerts) = &entry.alerts {
                one.alerts = alerts.clone();
            }
            match one.run_settings(one.run.as_ref().expect("set above"), lookup) {
                Ok(config) => {
                    let state_dir = config.state_dir();
                    if let Some(j) = configs
                        .iter()
                        .position(|c: &Config| c.state_dir() == state_dir)
                    {
                        v.problem(
                            &format!("{at}.state_dir"),
                            format!(
                                "{} is also the state folder of runs[{j}] (each run needs its own)",
                                state_dir.display()
                            ),
                        );
                    }
                    configs.push(config);
                }
                Err(problems) => {
                    for p in problems {
                        let key = match p.key.strip_prefix("run.") {
                            Some(rest) => format!("{at}.{rest}"),
                            None if own(&p.key) => format!("{at}.{}", p.key),
                            None => p.key.clone(),
                        };
                        let p = Problem { key, ..p };
                        if !v.problems.contains(&p) {
                            v.problems.push(p);
                        }
                    }
                }
            }
        }
        if !v.problems.is_empty() {
            return Err(v.problems);
        }
        let mut first = configs[0].clone();
        first.sweep = configs;
        Ok(first)
    }

    /// A single run's settings.
    fn run_settings(
        &self,
        run: &RunConfig,
        lookup: Option<&SecretLookup>,
    ) -> Result<Config, Vec<Problem>> {
        let mut v = Validator::default();
        if let Some(name) = &run.name {
            v.check(!name.trim().is_empty(), "run.name", "must not be empty");
        }

        let checkpoints = checkpoints(&mut v, &self.checkpoints);

        if let Some(n) = self.cpu_threads {
            v.count("cpu_threads", n, 1..=1024);
        }
        v.count("max_runs", self.max_runs, 1..=MAX_RUNS);
        let shutdown_drain = v.secs(
            "shutdown_drain_secs",
            self.shutdown_drain_secs,
            0.1..=86_400.0,
        );
        v.file("model.architecture", &self.model.architecture);
        v.file("data.path", &self.data.path);
        v.check(
            !self.data.dataset.is_empty(),
            "data.dataset",
            "must not be empty",
        );
        if let Some(p) = &self.data.heldout_path {
            v.file("data.heldout_path", p);
        }

        let i = &self.icr;
        v.positive("icr.sigma", i.sigma, MAX_SIGMA);
        if let Some(sigmas) = &i.sigmas {
            v.check(
                !sigmas.is_empty(),
                "icr.sigmas",
                "must list at least one sigma",
            );
            v.check(
                sigmas.len() <= 64,
                "icr.sigmas",
                format!("lists {} sigmas; at most 64", sigmas.len()),
            );
            for (k, s) in sigmas.iter().enumerate() {
                v.positive(&format!("icr.sigmas[{k}]"), *s, MAX_SIGMA);
            }
        }
        v.count("icr.samples", i.samples, 2..=MAX_SAMPLES);
        v.real("icr.ridge", i.ridge, 0.0..=1.0);
        v.count("icr.batch_size", i.batch_size, 1..=MAX_BATCH);
        v.check(
            (0.0..0.5).contains(&i.augment.crop),
            "icr.augment.crop",
            format!("must be in [0, 0.5), got {}", i.augment.crop),
        );
        v.check(
            (0.0..=1.0).contains(&i.augment.jitter),
            "icr.augment.jitter",
            format!("must be in [0, 1], got {}", i.augment.jitter),
        );

        let p = &self.pfd;
        v.count("pfd.samples", p.samples, 1..=MAX_SAMPLES);
        v.count("pfd.steps", p.steps, 2..=1000);
        v.positive("pfd.sigma_min", p.sigma_min, MAX_SIGMA);
        v.positive("pfd.sigma_max", p.sigma_max, MAX_SIGMA);
        v.check(
            p.sigma_max > p.sigma_min || !(p.sigma_max.is_finite() && p.sigma_min.is_finite()),
            "pfd.sigma_max",
            format!(
                "must be greater than pfd.sigma_min ({}), got {}",
                p.sigma_min, p.sigma_max
            ),
        );
        v.positive("pfd.rho", p.rho, 100.0);
        v.count("pfd.every", p.every, 1..=1_000_000);
        v.count("pfd.batch_size", p.batch_size, 1..=MAX_BATCH);
        for (key, path) in [
            ("pfd.teacher", &p.teacher),
            ("pfd.descriptor", &p.descriptor),
            ("pfd.latents", &p.latents),
        ] {
            if let Some(path) = path {
                v.file(key, path);
            }
        }

        let m = &self.memorization;
        if m.enabled {
            v.check(
                p.enabled,
                "memorization.enabled",
                "needs pfd.enabled: the ratio is computed from the PFD samples",
            );
            if m.criterion == MemorizationCriterion::Cosine {
                v.check(
                    p.descriptor.is_some(),
                    "memorization.criterion",
                    "`cosine` needs a descriptor model in pfd.descriptor",
                );
            }
        }
        let t = m.threshold();
        v.check(
            t > 0.0 && t <= 1.0,
            "memorization.threshold",
            format!("must be in (0, 1], got {t}"),
        );

        let tl = &self.tail;
        if tl.enabled {
            v.check(
                p.enabled,
                "tail.enabled",
                "needs pfd.enabled: tail metrics use the PFD samples",
            );
            if tl.reference == TailReference::Teacher {
                v.check(
                    p.teacher.is_some(),
                    "tail.reference",
                    "`teacher` needs pfd.teacher (or use `training`)",
                );
            }
        }
        v.check(
            tl.eta > 0.0 && tl.eta < 1.0,
            "tail.eta",
            format!("must be in (0, 1), got {}", tl.eta),
        );
        v.check(
            tl.scale != 0.0 && tl.scale.is_finite(),
            "tail.scale",
            format!("must be a finite, non-zero number, got {}", num(tl.scale)),
        );
        v.real("tail.offset", tl.offset, f64::MIN..=f64::MAX);

        let e = &self.early_stop;
        e.check_ranges(&mut v);
        match e.metric {
            EarlyStopMetric::Icr => v.check(
                i.enabled,
                "early_stop.metric",
                "is `icr` but icr.enabled is false",
            ),
            EarlyStopMetric::PfdGeneralization => v.check(
                p.enabled && p.teacher.is_some(),
                "early_stop.metric",
                "`pfd_generalization` needs pfd.enabled and pfd.teacher",
            ),
        }
        match e.confirm {
            Confirm::None | Confirm::Auto => {}
            Confirm::GeneralizationGap => v.check(
                self.data.heldout_path.is_some(),
                "early_stop.confirm",
                "`generalization_gap` needs data.heldout_path",
            ),
            Confirm::MemorizationRatio => v.check(
                m.enabled,
                "early_stop.confirm",
                "`memorization_ratio` needs memorization.enabled",
            ),
        }
        if implies_memorization(e, &self.data, m) && m.criterion == MemorizationCriterion::Cosine {
            v.check(
                p.descriptor.is_some(),
                "memorization.criterion",
                "`cosine` needs a descriptor model in pfd.descriptor (early_stop.confirm: auto \
                 without data.heldout_path confirms by the memorization ratio)",
            );
        }

        let alerts = alerts(&mut v, &self.alerts, lookup);
        let http = http(&mut v, &self.http);
        let evaluation = evaluation(&mut v, &self.evaluation);

        match (checkpoints, shutdown_drain, alerts, http, evaluation) {
            (
                Some(checkpoints),
                Some(shutdown_drain),
                Some(alerts),
                Some(http),
                Some(evaluation),
            ) if v.problems.is_empty() => Ok(Config {
                run: run.clone(),
                state_dir: self.state_dir.clone(),
                checkpoints,
                model: self.model.clone(),
                device: self.device,
                cpu_threads: self.cpu_threads,
                shutdown_drain,
                data: self.data.clone(),
                icr: self.icr.clone(),
                pfd: self.pfd.clone(),
                memorization: self.memorization.clone(),
                tail: self.tail.clone(),
                early_stop: self.early_stop.clone(),
                alerts,
                http,
                evaluation,
                source: None,
                implied_memorization: false,
                implied_pf_ode: false,
                sweep: Vec::new(),
                runs_glob: None,
                max_runs: self.max_runs,
            }),
            _ => Err(v.problems),
        }
    }
}

/// Does `early_stop.confirm: auto` confirm by a memorization ratio that the config does not
/// compute? (No held-out set, and `memorization.enabled` false.)
fn implies_memorization(e: &EarlyStopConfig, data: &DataConfig, m: &MemorizationConfig) -> bool {
    e.confirm == Confirm::Auto && data.heldout_path.is_none() && !m.enabled
}

/// The `checkpoints` section's settings; `None` when a value is refused (the problem is in `v`).
fn checkpoints(v: &mut Validator, c: &file::Checkpoints) -> Option<CheckpointsConfig> {
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
        1..=file::MAX_ENTRY_MIB as usize,
    );
    if let Some(total) = c.max_total_mib {
        v.count(
            "checkpoints.max_total_mib",
            usize::try_from(total).unwrap_or(usize::MAX),
            1..=file::MAX_ENTRY_MIB as usize,
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

/// Reads an environment variable: [`std::env::var`], or a stand-in in tests.
type SecretLookup = dyn Fn(&str) -> Result<String, std::env::VarError>;

/// The `alerts` section's settings: the destinations' URLs parsed and, with a `lookup`, their
/// secrets read; `None` when a value is refused (the problem is in `v`).
fn alerts(
    v: &mut Validator,
    a: &file::Alerts,
    lookup: Option<&SecretLookup>,
) -> Option<AlertsConfig> {
    let mut webhooks = Some(Vec::new());
    for (k, w) in a.webhooks.iter().enumerate() {
        let url = v.parse(
            &format!("alerts.webhooks[{k}].url"),
            values::http_url(&w.url),
        );
        let secret = match &w.secret_env {
            None => Some(None),
            Some(var) => {
                let secret = match lookup {
                    Some(lookup) => v
                        .secret(
                            &format!("alerts.webhooks[{k}].secret_env"),
                            var,
                            lookup(var),
                        )
                        .map(Some),
                    None => Some(None),
                };
                secret.map(|secret| {
                    Some(SecretEnv {
                        var: var.clone(),
                        secret,
                    })
                })
            }
        };
        match (url, secret, webhooks.as_mut()) {
            (Some(url), Some(secret), Some(list)) => list.push(WebhookConfig {
                url,
                format: w.format,
                secret,
            }),
            _ => webhooks = None,
        }
    }
    let alertmanager = match &a.alertmanager {
        Some(am) => v
            .parse("alerts.alertmanager.url", values::http_url(&am.url))
            .map(|url| Some(AlertmanagerConfig { url })),
        None => Some(None),
    };
    v.check(
        !a.stop_file.is_empty()
            && Path::new(&a.stop_file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_))),
        "alerts.stop_file",
        format!(
            "must be a file name inside run.dir (no `..`, no absolute path), got `{}`",
            a.stop_file
        ),
    );
    Some(AlertsConfig {
        webhooks: webhooks?,
        alertmanager: alertmanager?,
        stop_file: a.stop_file.clone(),
    })
}

/// The `http` section's settings; `None` when a value is refused (the problem is in `v`).
fn http(v: &mut Validator, h: &file::Http) -> Option<HttpConfig> {
    let listen = v.parse(
        "http.listen",
        h.listen.parse::<SocketAddr>().map_err(|e| {
            format!(
                "must be an address:port such as 127.0.0.1:9464 ({e}), got `{}`",
                h.listen
            )
        }),
    );
    let mut timeout = |key: &str, x: f64, max: f64| {
        let ok = (0.1..=max).contains(&x);
        v.check(ok, key, format!("must be between 0.1 and {max}, got {x}"));
        ok.then(|| Duration::from_secs_f64(x))
    };
    let header_timeout = timeout("http.header_timeout_secs", h.header_timeout_secs, 3600.0);
    let idle_timeout = timeout("http.idle_timeout_secs", h.idle_timeout_secs, 86400.0);
    let max_connections = usize::try_from(h.max_connections)
        .ok()
        .filter(|n| *n <= 65536)
        .and_then(NonZeroUsize::new);
    v.check(
        max_connections.is_some(),
        "http.max_connections",
        format!("must be between 1 and 65536, got {}", h.max_connections),
    );
    Some(HttpConfig {
        listen: listen?,
        header_timeout: header_timeout?,
        idle_timeout: idle_timeout?,
        max_connections: max_connections?,
    })
}

/// The `evaluation` section's settings; `None` when a value is refused.
fn evaluation(v: &mut Validator, e: &file::Evaluation) -> Option<EvaluationConfig> {
    v.count("evaluation.max_in_flight", e.max_in_flight, 1..=1024);
    let s = &e.slurm;
    // One word each: they become single sbatch arguments.
    let word = |x: &str| {
        !x.is_empty() && x.len() <= 256 && !x.chars().any(|c| c.is_whitespace() || c.is_control())
    };
    for (key, value) in [
        ("evaluation.slurm.partition", &s.partition),
        ("evaluation.slurm.account", &s.account),
        ("evaluation.slurm.gres", &s.gres),
    ] {
        if let Some(x) = value {
            v.check(
                word(x),
                key,
                format!("must be one word without spaces, got `{x}`"),
            );
        }
    }
    if let Some(t) = &s.time_limit {
        let ok = !t.is_empty()
            && t.len() <= 32
            && t.chars()
                .all(|c| c.is_ascii_digit() || c == ':' || c == '-')
            && t.starts_with(|c: char| c.is_ascii_digit());
        v.check(
            ok,
            "evaluation.slurm.time_limit",
            format!("must be a Slurm time such as `30`, `1:00:00` or `1-0`, got `{t}`"),
        );
    }
    v.check(
        s.sbatch_args.len() <= 64,
        "evaluation.slurm.sbatch_args",
        format!("lists {} options; at most 64", s.sbatch_args.len()),
    );
    for (k, a) in s.sbatch_args.iter().enumerate() {
        v.check(
            a.starts_with('-') && a.len() <= 1024 && !a.chars().any(|c| c.is_control()),
            &format!("evaluation.slurm.sbatch_args[{k}]"),
            format!("must be one sbatch option starting with `-`, got `{a}`"),
        );
    }
    v.check(
        s.env.len() <= 256,
        "evaluation.slurm.env",
        format!("sets {} variables; at most 256", s.env.len()),
    );
    for (name, value) in &s.env {
        let ok = name.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        v.check(
            ok,
            &format!("evaluation.slurm.env.{name}"),
            "must be a variable name (letters, digits, `_`)",
        );
        v.check(
            !value.contains('\0') && value.len() <= 4096,
            &format!("evaluation.slurm.env.{name}"),
            "must be at most 4096 bytes without NUL",
        );
    }
    let poll = v.secs("evaluation.slurm.poll_secs", s.poll_secs, 0.1..=3600.0);
    v.check(
        e.retries <= 100,
        "evaluation.retries",
        format!("must be between 0 and 100, got {}", e.retries),
    );
    // The compute node's path: not checked here, where it may not exist.
    Some(EvaluationConfig {
        executor: e.executor,
        max_in_flight: e.max_in_flight,
        retries: e.retries,
        slurm: SlurmConfig {
            partition: s.partition.clone(),
            account: s.account.clone(),
            time_limit: s.time_limit.clone(),
            gres: s.gres.clone(),
            sbatch_args: s.sbatch_args.clone(),
            env: s.env.clone(),
            poll: poll?,
            binary: s.binary.clone(),
        },
    })
}

#[derive(Default)]
struct Validator {
    problems: Vec<Problem>,
}

impl Validator {
    fn problem(&mut self, key: &str, message: impl Into<String>) {
        self.problems.push(Problem {
            key: key.to_string(),
            message: message.into(),
        });
    }

    fn check(&mut self, ok: bool, key: &str, message: impl Into<String>) {
        if !ok {
            self.problem(key, message);
        }
    }

    /// The value of `parsed`, or `None` with its message as the problem of `key`.
    fn parse<T>(&mut self, key: &str, parsed: Result<T, String>) -> Option<T> {
        parsed.map_err(|message| self.problem(key, message)).ok()
    }

    /// `x` must be a finite number in `range`; the message names the bound that is broken.
    /// Whether it is.
    fn real(&mut self, key: &str, x: f64, range: RangeInclusive<f64>) -> bool {
        let message = if !x.is_finite() {
            format!("must be a finite number, got {}", num(x))
        } else if x < *range.start() {
            format!("must be ≥ {}, got {}", num(*range.start()), num(x))
        } else if x > *range.end() {
            format!("must be ≤ {}, got {}", num(*range.end()), num(x))
        } else {
            return true;
        };
        self.problem(key, message);
        false
    }

    /// A number of seconds in `range` (which must lie within what a [`Duration`] holds), as a
    /// duration.
    fn secs(&mut self, key: &str, x: f64, range: RangeInclusive<f64>) -> Option<Duration> {
        if !self.real(key, x, range) {
            return None;
        }
        let d = Duration::try_from_secs_f64(x);
        self.check(d.is_ok(), key, format!("is not a duration, got {}", num(x)));
        d.ok()
    }

    /// `x` must be a finite number in `(0, max]`.
    fn positive(&mut self, key: &str, x: f64, max: f64) {
        if x.is_finite() && x <= 0.0 {
            self.problem(key, format!("must be > 0, got {}", num(x)));
        } else {
            self.real(key, x, 0.0..=max);
        }
    }

    fn count(&mut self, key: &str, x: usize, range: RangeInclusive<usize>) {
        if x < *range.start() {
            self.problem(key, format!("must be ≥ {}, got {x}", range.start()));
        } else if x > *range.end() {
            self.problem(key, format!("must be ≤ {}, got {x}", range.end()));
        }
    }

    fn file(&mut self, key: &str, path: &Path) {
        if !path.is_file() {
            let what = if path.exists() {
                "is not a file"
            } else {
                "does not exist"
            };
            self.problem(key, format!("names {}, which {what}", path.display()));
        }
    }

    /// The variable `var`, whose lookup gave `value`, must hold a Standard-Webhooks secret
    /// (never shown in the message).
    fn secret(
        &mut self,
        key: &str,
        var: &str,
        value: Result<String, std::env::VarError>,
    ) -> Option<crate::sign::Secret> {
        let message = match value {
            Err(std::env::VarError::NotPresent) => {
                format!("names the environment variable {var}, which is not set")
            }
            Err(std::env::VarError::NotUnicode(_)) => {
                format!("names the environment variable {var}, whose value is not UTF-8")
            }
            Ok(value) => match crate::sign::Secret::parse(&value) {
                Ok(secret) => return Some(secret),
                Err(reason) => format!(
                    "names the environment variable {var}, whose value is not a \
                     Standard-Webhooks secret: it {reason}"
                ),
            },
        };
        self.problem(key, message);
        None
    }
}

/// Reads the config file, refusing one larger than [`MAX_CONFIG_BYTES`] before reading it.
fn read_bounded(path: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let read_error = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        let size = std::fs::metadata(path).map_or(text.len() as u64, |m| m.len());
        return Err(ConfigError::TooLarge {
            path: path.to_path_buf(),
            size,
        });
    }
    Ok(text)
}

/// `path` without `.` components and with each `name/..` pair removed, lexically (what the user
/// wrote, shorter: `config/../runs/demo` is `runs/demo`). Leading `..` stay; an empty result is
/// `.`.
pub(crate) fn normalize(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out: Vec<Component> = Vec::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => match out.last() {
                Some(Component::Normal(_)) => {
                    out.pop();
                }
                Some(Component::RootDir | Component::Prefix(_)) => {}
                _ => out.push(c),
            },
            _ => out.push(c),
        }
    }
    if out.is_empty() {
        PathBuf::from(".")
    } else {
        out.iter().collect()
    }
}

/// `st`, `nd`, `rd` or `th`, as English writes the ordinal of `k`.
fn ordinal_suffix(k: usize) -> &'static str {
    match (k % 10, k % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The early-stop metric's name is its config spelling and its record field.
    #[test]
    fn early_stop_metric_names_and_values() {
        let r = Evaluation {
            icr: Some(0.5),
            pfd_generalization: Some(2.0),
            ..Evaluation::default()
        };
        for (metric, name, value) in [
            (EarlyStopMetric::Icr, "icr", 0.5),
            (
                EarlyStopMetric::PfdGeneralization,
                "pfd_generalization",
                2.0,
            ),
        ] {
            assert_eq!(metric.as_str(), name);
            assert_eq!(serde_json::to_value(metric).unwrap(), name);
            assert_eq!(serde_json::to_value(&r).unwrap()[name], value);
            assert_eq!(metric.value(&r), Some(value));
        }
        assert_eq!(EarlyStopMetric::Icr.value(&Evaluation::default()), None);
    }

    const MINIMAL: &str = "run: {dir: r}\nmodel: {architecture: m.ts}\ndata: {path: d.h5}\n";

    #[test]
    fn ordinals_read_as_english() {
        let got: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 102, 111]
            .map(|k| format!("{k}{}", ordinal_suffix(k)))
            .to_vec();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "102nd",
                "111th"
            ]
        );
    }

    #[test]
    fn confirm_names_are_the_config_spelling() {
        for c in [
            Confirm::Auto,
            Confirm::None,
            Confirm::GeneralizationGap,
            Confirm::MemorizationRatio,
        ] {
            let yaml: Confirm = serde_yaml::from_str(c.as_str()).unwrap();
            assert_eq!(yaml, c);
        }
    }

    /// The settings of `text`, with the files MINIMAL names (and `h.h5`) created in a temporary
    /// folder the paths are resolved against.
    fn settings(text: &str) -> Config {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5", "h.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
        file.resolve_paths(dir.path());
        file.settings(false).unwrap()
    }

    /// `evaluation`: the defaults are today's local evaluator; the Slurm settings arrive as
    /// written, the binary resolved against the config's folder.
    #[test]
    fn the_evaluation_section_defaults_to_local_and_reads_the_slurm_options() {
        let c = settings(MINIMAL);
        assert_eq!(c.evaluation.executor, ExecutorKind::Local);
        assert_eq!(c.evaluation.max_in_flight, 4);
        assert_eq!(c.evaluation.slurm.poll, Duration::from_secs(5));
        assert_eq!(c.evaluation.retries, 1);
        assert_eq!(c.evaluation, EvaluationConfig::default());
        let c = settings(&format!(
            "{MINIMAL}evaluation:\n  executor: slurm\n  max_in_flight: 8\n  retries: 0\n  slurm:\n    \
             partition: gpu\n    account: lab\n    time_limit: \"1-0\"\n    gres: \"gpu:1\"\n    \
             sbatch_args: [\"--mem=16G\"]\n    env: {{OMP_NUM_THREADS: \"4\"}}\n    \
             poll_secs: 0.5\n    binary: bin/diffmon\n"
        ));
        let (e, s) = (&c.evaluation, &c.evaluation.slurm);
        assert_eq!((e.executor, e.max_in_flight), (ExecutorKind::Slurm, 8));
        assert_eq!(s.partition.as_deref(), Some("gpu"));
        assert_eq!(s.account.as_deref(), Some("lab"));
        assert_eq!(s.time_limit.as_deref(), Some("1-0"));
        assert_eq!(s.gres.as_deref(), Some("gpu:1"));
        assert_eq!(s.sbatch_args, ["--mem=16G"]);
        assert_eq!(s.env["OMP_NUM_THREADS"], "4");
        assert_eq!((s.poll, e.retries), (Duration::from_millis(500), 0));
        let binary = s.binary.as_ref().unwrap();
        assert!(
            binary.is_absolute() && binary.ends_with("bin/diffmon"),
            "{binary:?}"
        );
    }

    #[test]
    fn the_cost_summary_counts_network_calls_per_metric() {
        let c = settings(MINIMAL);
        assert_eq!(
            c.cost_summary(),
            "network calls per checkpoint: ICR 8192 (2 x icr.samples) (README, \"Cost and GPU\")"
        );
        let text = format!(
            "{MINIMAL}icr: {{samples: 100, sigmas: [0.1, 1.0]}}\n\
             pfd: {{enabled: true, samples: 10000, every: 5}}\n"
        );
        let text = text.replace(
            "data: {path: d.h5}",
            "data: {path: d.h5, heldout_path: h.h5}",
        );
        let c = settings(&text);
        assert_eq!(
            c.cost_summary(),
            "network calls per checkpoint: ICR 600 (2 x icr.samples x 3 sigmas), gap up to 200 \
             (train and held-out images), PFD 350000 (35 x pfd.samples, every 5th checkpoint) \
             (README, \"Cost and GPU\")"
        );
    }

    #[test]
    fn keys_are_found_in_the_text_for_error_positions() {
        let text = "# a comment naming icr: and device:\n\
                    run: {dir: ., name: x}\n\
                    icr:\n  samples: 8  # not samples: here\n  seed: 1\n\
                    pfd: {enabled: true, samples: 4}\n\
                    alerts:\n  webhooks:\n    - {url: 'http://h', format: json}\n\
                    device: tpu\n\
                    icr: {samples: 16}\n";
        assert_eq!(key_position(text, "device", None), Some((10, 1)));
        assert_eq!(key_position(text, "icr.samples", None), Some((4, 3)));
        assert_eq!(key_position(text, "pfd.samples", None), Some((6, 22)));
        assert_eq!(key_position(text, "run.name", None), Some((2, 15)));
        assert_eq!(
            key_position(text, "alerts.webhooks[0].format", None),
            Some((9, 25))
        );
        assert_eq!(key_position(text, "", Some(("icr", 2))), Some((11, 1)));
        assert_eq!(key_position(text, "icr.sample", None), None);
        assert_eq!(key_position(text, "", Some(("pfd", 2))), None);
        // The error of a value checked after it was read names the key's line, not the start
        // of the enclosing mapping.
        let e = ConfigFile::parse(text, "c.yaml").unwrap_err().to_string();
        assert!(e.starts_with("c.yaml: line 10, column 1: device: "), "{e}");
        // A duplicate key names its second occurrence, at the top level and nested.
        let e = ConfigFile::parse(
            &format!("{MINIMAL}icr: {{seed: 1}}\nicr: {{seed: 2}}\n"),
            "c.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("c.yaml: line 5, column 1: (top level): duplicate field `icr`"),
            "{e}"
        );
        let e = ConfigFile::parse(
            &format!("{MINIMAL}icr:\n  seed: 1\n  samples: 8\n  samples: 16\n"),
            "c.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("c.yaml: line 7, column 3: icr: duplicate field `samples`"),
            "{e}"
        );
    }

    #[test]
    fn defaults_follow_the_design() {
        let c = settings(MINIMAL);
        assert_eq!(c.icr.samples, 4096);
        assert_eq!(c.icr.sigma, 0.29);
        assert_eq!(c.icr.ridge, 1e-4);
        assert_eq!(c.icr.bias_correction, BiasCorrection::None);
        assert_eq!(c.pfd.samples, 10_000);
        assert_eq!(
            (c.pfd.steps, c.pfd.sigma_min, c.pfd.sigma_max, c.pfd.rho),
            (18, 0.002, 80.0, 7.0)
        );
        assert_eq!(c.early_stop.window, 3);
        assert_eq!(c.early_stop.smoother, Smoother::Median);
        assert_eq!(c.early_stop.min_rise, 0.005);
        assert_eq!(c.early_stop.noise_multiple, 6.0);
        assert!(c.early_stop.keep_best);
        assert_eq!(c.early_stop.confirm, Confirm::Auto);
        assert_eq!(
            c.early_stop_resolved().confirm,
            Confirmation::MemorizationRatio
        );
        let with_heldout = MINIMAL.replace("{path: d.h5}", "{path: d.h5, heldout_path: h.h5}");
        let c = settings(&with_heldout);
        assert_eq!(
            c.early_stop_resolved().confirm,
            Confirmation::GeneralizationGap
        );
        assert_eq!(c.data.dataset, "images");
        assert_eq!(c.alerts.stop_file, "EARLY_STOP");
        assert_eq!(c.http.listen, SocketAddr::from(([127, 0, 0, 1], 9464)));
        assert_eq!(
            (c.http.header_timeout, c.http.idle_timeout),
            (Duration::from_secs(10), Duration::from_secs(60))
        );
        assert_eq!(c.http.max_connections.get(), 256);
        assert_eq!(
            (c.checkpoints.settle, c.checkpoints.poll, c.shutdown_drain),
            (
                Duration::from_secs(2),
                Duration::from_secs(10),
                Duration::from_secs(120)
            )
        );
        assert_eq!(
            c.checkpoints.pattern.as_str(),
            "{*.pt,*.pth,*.ckpt,*.safetensors,*.bin,*.pkl,*.ts,checkpoint-*,checkpoint_*}"
        );
        assert_eq!(c.checkpoints.step_regex.as_str(), r"(\d+)\D*$");
        assert!(c.checkpoints.weights_files.is_none());
        assert_eq!(
            c.checkpoints.max_entry_mib,
            crate::weights::DEFAULT_MAX_ENTRY_MIB
        );
        assert_eq!(c.checkpoints.max_total_mib, None);
        assert_eq!(c.device, DeviceSpec::Auto);
        assert_eq!(c.run_name(), "r");
        assert_eq!(c.memorization.threshold(), 1.0 / 3.0);
    }

    #[test]
    fn unknown_key_names_path_line_and_column() {
        let text = format!("{MINIMAL}icr:\n  sigma: 0.3\n  sampels: 12\n");
        let err = ConfigFile::parse(&text, "t.yaml").unwrap_err().to_string();
        assert!(
            err.starts_with("t.yaml: line 6, column 3: icr.sampels: unknown field `sampels`"),
            "{err}"
        );
        assert!(err.contains("unknown field `sampels`"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let text = format!("{MINIMAL}pfd:\n  samples: many\n");
        let err = ConfigFile::parse(&text, "t.yaml").unwrap_err().to_string();
        assert!(err.contains("line 5, column 12: pfd.samples:"), "{err}");
        let text = format!("{MINIMAL}device: gpu\n");
        let err = ConfigFile::parse(&text, "t.yaml").unwrap_err().to_string();
        assert!(
            err.contains("device: must be auto, cpu, cuda or cuda:N, got `gpu`"),
            "{err}"
        );
    }

    #[test]
    fn validation_reports_every_problem_with_its_key() {
        let text = format!(
            "{MINIMAL}pfd: {{samples: 0, sigma_min: 1, sigma_max: 0.5}}\nicr: {{sigma: -1}}\n\
             http: {{listen: nowhere}}\nalerts: {{stop_file: ../x, webhooks: [{{url: ftp://a, secret_env: DIFFMON_TEST_UNSET_VAR}}]}}\n"
        );
        let c = ConfigFile::parse(&text, "t.yaml").unwrap();
        let keys: Vec<String> = c.validate().into_iter().map(|p| p.to_string()).collect();
        let has = |s: &str| keys.iter().any(|k| k.starts_with(s));
        assert!(has("pfd.samples must be ≥ 1, got 0"), "{keys:?}");
        assert!(
            has("pfd.sigma_max must be greater than pfd.sigma_min"),
            "{keys:?}"
        );
        assert!(has("icr.sigma must be > 0, got -1"), "{keys:?}");
        assert!(has("http.listen"), "{keys:?}");
        assert!(has("alerts.stop_file"), "{keys:?}");
        assert!(has("alerts.webhooks[0].url"), "{keys:?}");
        assert!(
            has(
                "alerts.webhooks[0].secret_env names the environment variable DIFFMON_TEST_UNSET_VAR"
            ),
            "{keys:?}"
        );
        assert!(
            has("model.architecture names m.ts, which does not exist"),
            "{keys:?}"
        );
        assert!(has("data.path names d.h5"), "{keys:?}");
    }

    #[test]
    fn observables_and_devices_parse() {
        assert_eq!(
            "quantile:0.99".parse::<Observable>(),
            Ok(Observable::Quantile(0.99))
        );
        assert!("quantile:2".parse::<Observable>().is_err());
        assert_eq!("cuda:1".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(1)));
        assert_eq!("cuda".parse::<DeviceSpec>(), Ok(DeviceSpec::Cuda(0)));
    }

    /// Every shipped config parses and is valid apart from files that a run creates.
    #[test]
    fn every_file_in_config_folder_loads() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut seen = 0;
        for entry in std::fs::read_dir(&folder).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            seen += 1;
            let text = std::fs::read_to_string(&path).unwrap();
            let mut config = ConfigFile::parse(&text, &path.display().to_string()).unwrap();
            config.resolve_paths(&folder);
            let problems: Vec<Problem> = config
                .validate()
                .into_iter()
                .filter(|p| !p.message.ends_with("which does not exist"))
                .collect();
            assert!(problems.is_empty(), "{}: {problems:?}", path.display());
        }
        assert!(seen >= 2, "config/ holds {seen} yaml files");
    }

    /// Found by the `config` fuzz target (`make fuzz`): the 3-byte file `.[:` made `parse` loop
    /// forever while locating the key `.[` in the text (its path has an empty segment name).
    #[test]
    fn fuzz_key_with_path_characters_does_not_hang() {
        for text in [".[:", "a.[0]: 1", "run: {.: 1}", "\"\": 1\n\"\": 2"] {
            let (tx, rx) = std::sync::mpsc::channel();
            let owned = text.to_string();
            std::thread::spawn(move || tx.send(ConfigFile::parse(&owned, "c.yaml").is_err()));
            let failed = rx.recv_timeout(std::time::Duration::from_secs(10));
            assert_eq!(failed, Ok(true), "{text:?}: no error within 10 s");
        }
    }

    /// 100 KB of nested brackets took 12 s in the YAML scanner (quadratic in the depth); the
    /// depth is now refused by a linear scan before the scanner runs. Brackets in comments and
    /// quoted scalars do not count.
    #[test]
    fn deep_nesting_is_refused_before_parsing() {
        let deep = format!("icr: {}{}", "[".repeat(50_000), "]".repeat(50_000));
        match ConfigFile::parse(&deep, "c.yaml") {
            Err(ConfigError::Parse {
                location, message, ..
            }) => {
                assert_eq!(location, "line 1, column 38: ");
                assert!(message.contains("nest more than 32 deep"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let fine = format!(
            "# {open}\nrun: {{dir: '{open}'}}\nmodel: {{architecture: \"{open}\\\"\"}}\ndata: {{path: don't{open}}}\n",
            open = "[".repeat(40)
        );
        assert_eq!(
            too_deep(&fine),
            Some((4, 50)),
            "only the plain scalar counts"
        );
        let ok = format!("# {open}\nrun: {{dir: '{open}'}}\n", open = "[".repeat(40));
        assert_eq!(too_deep(&ok), None);
        assert_eq!(too_deep(&format!("a: {}", "[".repeat(32))), None);
    }

    /// A file starting with a UTF-8 byte-order mark failed with "missing field `model`"; it
    /// reads as the same text without it, and errors keep their line and column.
    #[test]
    fn a_byte_order_mark_is_ignored() {
        let with_bom = format!("\u{feff}{MINIMAL}");
        let c = settings(&with_bom);
        assert_eq!(c.run.dir.file_name().unwrap(), "r");
        let bad = "\u{feff}icr: {samples: many}\n";
        match ConfigFile::parse(bad, "c.yaml") {
            Err(ConfigError::Parse { location, key, .. }) => {
                let plain = match ConfigFile::parse(&bad['\u{feff}'.len_utf8()..], "c.yaml") {
                    Err(ConfigError::Parse { location, .. }) => location,
                    other => panic!("{other:?}"),
                };
                assert_eq!(location, plain);
                assert!(location.starts_with("line 1, column "), "{location}");
                assert_eq!(key, "icr.samples");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn paths_are_normalized_lexically() {
        for (path, want) in [
            ("config/../runs/demo", "runs/demo"),
            ("./a/./b/", "a/b"),
            ("../x/../y", "../y"),
            ("a/..", "."),
            ("/a/../../b", "/b"),
        ] {
            assert_eq!(normalize(Path::new(path)), PathBuf::from(want), "{path}");
        }
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("config");
        std::fs::create_dir(&sub).unwrap();
        for f in ["model.ts", "train.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let file = sub.join("c.yaml");
        std::fs::write(
            &file,
            "run: {dir: ../runs/x}\nmodel: {architecture: ../model.ts}\ndata: {path: ./../train.h5}\n",
        )
        .unwrap();
        let c = Config::load(&file).unwrap();
        assert_eq!(c.run.dir, dir.path().join("runs/x"));
        assert_eq!(c.model.architecture, dir.path().join("model.ts"));
        assert_eq!(c.data.path, dir.path().join("train.h5"));
    }

    #[test]
    fn a_config_larger_than_the_bound_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("big.yaml");
        std::fs::write(&file, "#".repeat(MAX_CONFIG_BYTES as usize + 1)).unwrap();
        let err = Config::load(&file).unwrap_err().to_string();
        assert!(
            err.contains("big.yaml: the config file is 1048577 bytes"),
            "{err}"
        );
    }

    /// A loaded config in a folder holding the files it names: [`MINIMAL`] and `extra`
    /// (whose `data:` line, if any, replaces the minimal one).
    fn loaded(extra: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5", "h.h5", "desc.ts"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let base = if extra.contains("data:") {
            MINIMAL.replace("data: {path: d.h5}\n", "")
        } else {
            MINIMAL.to_string()
        };
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, format!("{base}{extra}")).unwrap();
        let mut config = Config::load(&file)?;
        config.imply_memorization();
        Ok(config)
    }

    /// `confirm: auto` without a held-out set confirms by the memorization ratio, which
    /// `imply_memorization` turns on: with PFD off, from `CONFIRM_LATENTS` PF-ODE latents (counted in the
    /// cost summary); with PFD on, from its samples. A held-out set, an explicit confirmation
    /// or the ratio already enabled leave the config as written.
    #[test]
    fn auto_without_heldout_data_turns_the_memorization_ratio_on() {
        let c = loaded("").unwrap();
        assert!(c.memorization.enabled && c.pfd.enabled && c.implied_memorization);
        assert_eq!(c.pfd.samples, CONFIRM_LATENTS);
        assert_eq!(
            c.cost_summary(),
            "network calls per checkpoint: ICR 8192 (2 x icr.samples), memorization ratio 4480 \
             (35 x 128 latents, every checkpoint, for early_stop.confirm: auto without \
             data.heldout_path) (README, \"Cost and GPU\")"
        );
        assert!(
            c.early_stop_summary()
                .contains("confirmed by the memorization ratio (early_stop.confirm: auto"),
            "{}",
            c.early_stop_summary()
        );
        let c = loaded("pfd: {enabled: true, samples: 500}\n").unwrap();
        assert!(c.memorization.enabled && c.implied_memorization && !c.implied_pf_ode);
        assert_eq!(c.pfd.samples, 500);
        for extra in [
            "early_stop: {confirm: none}\n",
            "data: {path: d.h5, heldout_path: h.h5}\n",
        ] {
            let c = loaded(extra).unwrap();
            assert!(!c.memorization.enabled && !c.pfd.enabled, "{extra}");
            assert!(!c.implied_memorization);
        }
        // Validation checks the config as written: the implied PF-ODE does not satisfy a key
        // that needs pfd.enabled.
        let e = loaded("tail: {enabled: true, reference: training}\n").unwrap_err();
        assert!(
            e.to_string().contains("tail.enabled needs pfd.enabled"),
            "{e}"
        );
        // The implied ratio's criterion must be computable.
        let e = loaded("memorization: {criterion: cosine}\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("memorization.criterion `cosine` needs a descriptor model"),
            "{e}"
        );
    }

    /// `check-config` says what each configuration can and cannot tell apart.
    #[test]
    fn the_early_stop_summary_says_what_each_confirmation_tells_apart() {
        let summary = |extra: &str| loaded(extra).unwrap().early_stop_summary();
        let gap = summary(
            "early_stop: {confirm: generalization_gap}\ndata: {path: d.h5, heldout_path: h.h5}\n",
        );
        assert!(gap.contains("confirmed by the generalization gap"), "{gap}");
        assert!(gap.contains("never sees the held-out images"), "{gap}");
        let memorization = summary("");
        assert!(
            memorization.contains("must hold the whole training set"),
            "{memorization}"
        );
        let none = summary("early_stop: {confirm: none}\n");
        assert!(
            none.contains("not a model that memorizes from a steady rise"),
            "{none}"
        );
        assert!(
            none.contains("min_rise (0.005) and 6 times its own noise"),
            "{none}"
        );
        let no_noise = summary("early_stop: {confirm: none, noise_multiple: 0}\n");
        assert!(
            no_noise.contains("a rise of noise alone can fire it"),
            "{no_noise}"
        );
    }

    #[test]
    fn early_stop_keys_have_ranges_and_names() {
        let e = EarlyStopConfig {
            noise_multiple: -1.0,
            window: 0,
            ..EarlyStopConfig::default()
        };
        let problems: Vec<String> = e.problems().iter().map(|p| p.to_string()).collect();
        assert_eq!(
            problems,
            [
                "early_stop.window must be ≥ 1, got 0",
                "early_stop.noise_multiple must be ≥ 0, got -1"
            ]
        );
        for s in [Smoother::Median, Smoother::Ema] {
            let yaml: Smoother = serde_yaml::from_str(s.as_str()).unwrap();
            assert_eq!(yaml, s);
        }
        for c in [
            Confirmation::None,
            Confirmation::GeneralizationGap,
            Confirmation::MemorizationRatio,
        ] {
            let yaml: Confirm = serde_yaml::from_str(c.as_str()).unwrap();
            assert_eq!(yaml.as_str(), c.as_str());
        }
    }

    #[test]
    fn example_parses() {
        ConfigFile::parse(EXAMPLE, "example").unwrap();
    }

    /// Every value that is a string or a number of seconds in the file is parsed once into the
    /// value its users need.
    #[test]
    fn settings_hold_parsed_values() {
        let c = settings(&format!(
            "{MINIMAL}checkpoints: {{pattern: 'ckpt_*.pt', step_regex: 'step=(\\d+)', \
             settle_secs: 0.25, poll_secs: 1.5, weights_files: [unet/w.bin, '*/model.*']}}\n\
             shutdown_drain_secs: 3\n\
             http: {{listen: '[::1]:9000', header_timeout_secs: 0.5, idle_timeout_secs: 7, \
             max_connections: 3}}\n"
        ));
        let k = &c.checkpoints;
        assert!(k.pattern.is_match("ckpt_10.pt") && !k.pattern.is_match("ckpt_10.pth"));
        assert_eq!(k.step_regex.step_in("epoch=3-step=400.ckpt"), Some(400));
        assert_eq!(k.step_regex.step_in("ckpt_10.pt"), None);
        assert_eq!(
            (k.settle, k.poll, c.shutdown_drain),
            (
                Duration::from_millis(250),
                Duration::from_millis(1500),
                Duration::from_secs(3)
            )
        );
        let files = k.weights_files.as_ref().unwrap();
        assert_eq!(files[0].as_str(), "unet/w.bin");
        assert!(files[0].glob().is_none(), "a plain path is not a glob");
        let glob = files[1].glob().unwrap();
        assert!(glob.is_match("unet/model.safetensors"));
        assert!(
            !glob.is_match("a/unet/model.safetensors"),
            "`*` crosses no `/`"
        );
        assert_eq!(c.http.listen, "[::1]:9000".parse::<SocketAddr>().unwrap());
        assert_eq!(c.http.header_timeout, Duration::from_millis(500));
        assert_eq!(c.http.idle_timeout, Duration::from_secs(7));
        assert_eq!(c.http.max_connections.get(), 3);
    }

    /// The webhooks' URLs are parsed, and their secrets read and decoded, when the settings are
    /// built; without secrets (commands that send nothing) the variable is kept, not read.
    #[test]
    fn destinations_are_parsed_with_their_secrets() {
        let text = format!(
            "{MINIMAL}alerts: {{webhooks: [{{url: 'https://hooks.example/x?t=1', format: slack, \
             secret_env: DIFFMON_T_SET}}, {{url: 'http://127.0.0.1:8/h'}}], \
             alertmanager: {{url: 'http://am:9093/'}}}}\n"
        );
        let file = ConfigFile::parse(&text, "c.yaml").unwrap();
        // `whsec_` + base64 of the 3 bytes "key".
        let lookup = |var: &str| match var {
            "DIFFMON_T_SET" => Ok("whsec_a2V5".to_string()),
            _ => Err(std::env::VarError::NotPresent),
        };
        let problems = file.settings_with(Some(&lookup)).unwrap_err();
        // Only the files MINIMAL names are missing: the alerts are fine.
        assert!(
            problems.iter().all(|p| !p.key.starts_with("alerts.")),
            "{problems:?}"
        );
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let mut file = file;
        file.resolve_paths(dir.path());
        let c = file.settings_with(Some(&lookup)).unwrap();
        let w = &c.alerts.webhooks;
        assert_eq!(w[0].url.as_str(), "https://hooks.example/x?t=1");
        assert_eq!(w[0].format, WebhookFormat::Slack);
        let secret = w[0].secret.as_ref().unwrap();
        assert_eq!(secret.var, "DIFFMON_T_SET");
        assert_eq!(
            crate::sign::signature(secret.secret.as_ref().unwrap(), "id", 1, b"body"),
            crate::sign::signature(
                &crate::sign::Secret::parse("a2V5").unwrap(),
                "id",
                1,
                b"body"
            ),
            "the secret is the decoded key"
        );
        assert!(!format!("{c:?}").contains("a2V5"), "Debug shows no secret");
        assert!(w[1].secret.is_none());
        assert_eq!(
            c.alerts.alertmanager.unwrap().url.as_str(),
            "http://am:9093/"
        );
        let unread = file.settings_with(None).unwrap();
        let secret = unread.alerts.webhooks[0].secret.as_ref().unwrap();
        assert_eq!(
            (secret.var.as_str(), secret.secret.is_none()),
            ("DIFFMON_T_SET", true)
        );

        // A variable that is not set, or holds no secret: a problem naming key and variable.
        let unset = |_: &str| Err(std::env::VarError::NotPresent);
        let problems = file.settings_with(Some(&unset)).unwrap_err();
        assert_eq!(
            problems.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            [
                "alerts.webhooks[0].secret_env names the environment variable DIFFMON_T_SET, \
              which is not set"
            ]
        );
        let mangled = |_: &str| Ok("not-a-secret".to_string());
        let problems = file.settings_with(Some(&mangled)).unwrap_err();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0]
                .message
                .contains("is not a Standard-Webhooks secret")
                && !problems[0].message.contains("not-a-secret"),
            "{problems:?}"
        );
    }

    #[test]
    fn urls_must_be_http_with_a_host() {
        for (url, message) in [
            (
                "ftp://a/x",
                "must be an http:// or https:// URL, got `ftp://a/x`",
            ),
            (
                "HTTP://a/x",
                "must be an http:// or https:// URL, got `HTTP://a/x`",
            ),
            ("http://", "is not a valid URL (empty host), got `http://`"),
            (
                "http://a b/",
                "is not a valid URL (invalid international domain name), got `http://a b/`",
            ),
        ] {
            let text = format!("{MINIMAL}alerts: {{alertmanager: {{url: '{url}'}}}}\n");
            let problems = ConfigFile::parse(&text, "c.yaml").unwrap().validate();
            let got: Vec<String> = problems
                .iter()
                .filter(|p| p.key == "alerts.alertmanager.url")
                .map(|p| p.message.clone())
                .collect();
            assert_eq!(got, [message], "{url}");
        }
        assert!(values::http_url("https://h:1/p").is_ok());
    }

    #[test]
    fn weights_files_entries_must_be_plain_relative_paths() {
        for good in [
            "unet/diffusion_pytorch_model.safetensors",
            "*.safetensors.index.json",
            ".metadata",
        ] {
            assert!(WeightsFile::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../b", "./x", "a[", "x\\"] {
            assert!(WeightsFile::parse(bad).is_err(), "{bad}");
        }
    }

    const SWEEP: &str = "runs:\n  - {name: a, dir: ra}\n  - {name: b, dir: rb, state_dir: sb, data: {path: h.h5}}\n  \
        - {name: c, dir: rc, alerts: {stop_file: STOP_C}}\nmodel: {architecture: m.ts}\ndata: {path: d.h5}\n\
        icr: {samples: 512}\n";

    /// A sweep is one complete single-run config per entry: its own name, folder, state folder,
    /// data and alerts where it gives them, the shared sections otherwise.
    #[test]
    fn a_sweep_is_one_complete_config_per_run() {
        let c = settings(SWEEP);
        let runs = c.runs();
        let names: Vec<String> = runs.iter().map(|r| r.run_name()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert!(runs[0].state_dir().ends_with("ra/.diffmon"));
        assert!(runs[1].state_dir().ends_with("sb"));
        assert!(runs[0].data.path.ends_with("d.h5"));
        assert!(runs[1].data.path.ends_with("h.h5"), "b's own data");
        assert!(runs[2].data.path.ends_with("d.h5"));
        assert_eq!(runs[2].alerts.stop_file, "STOP_C");
        assert_eq!(runs[0].alerts.stop_file, c.alerts.stop_file);
        assert!(
            runs.iter()
                .all(|r| r.icr.samples == 512 && r.sweep.is_empty())
        );
        // The top-level fields are the first run's; a single run is its own only run.
        assert_eq!(c.run_name(), "a");
        let one = settings(MINIMAL);
        assert!(one.sweep.is_empty());
        assert_eq!(one.runs().len(), 1);
        assert_eq!(one.runs()[0].run_name(), one.run_name());
    }

    /// `runs_glob`: the matching folders are the runs, by name, each with the shared sections
    /// and its state in its own folder; hidden folders, links, files and names that are not run
    /// names are not runs; with no match yet the sweep is empty, and a folder that appears is
    /// found by `discover_runs`.
    #[test]
    fn runs_glob_makes_a_run_of_each_matching_folder() {
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(at.join(f), b"").unwrap();
        }
        std::fs::create_dir(at.join("sweep")).unwrap();
        let load = || {
            let text = "runs_glob: sweep/lr-*
model: {architecture: m.ts}
data: {path: d.h5}
";
            let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
            file.resolve_paths(at);
            file.settings(false).unwrap()
        };
        let empty = load();
        assert!(empty.is_sweep());
        assert!(empty.runs().is_empty());
        assert!(empty.discover_runs().unwrap().is_empty());

        for d in ["lr-b", "lr-a", ".lr-hidden", "lr-a b", "other"] {
            std::fs::create_dir(at.join("sweep").join(d)).unwrap();
        }
        std::fs::write(at.join("sweep/lr-file"), b"").unwrap();
        std::os::unix::fs::symlink(at.join("sweep/other"), at.join("sweep/lr-link")).unwrap();
        let names = |runs: &[Config]| runs.iter().map(|r| r.run_name()).collect::<Vec<_>>();
        // Found by the config read before the folders appeared, and by a fresh read.
        assert_eq!(names(&empty.discover_runs().unwrap()), ["lr-a", "lr-b"]);
        let c = load();
        let runs = c.runs();
        assert_eq!(names(&runs), ["lr-a", "lr-b"]);
        assert!(runs[1].run.dir.ends_with("sweep/lr-b"));
        assert!(runs[1].state_dir().ends_with("sweep/lr-b/.diffmon"));
        assert!(runs.iter().all(|r| r.data.path.ends_with("d.h5")));
        assert_eq!(c.run_name(), "lr-a");

        // At `max_runs`, the first by name are the runs; the others are still found by name
        // (the Slurm job of a run the daemon holds, after a folder sorting first appeared).
        let text = "runs_glob: sweep/lr-*\nmax_runs: 1\nmodel: {architecture: m.ts}\n\
                    data: {path: d.h5}\n";
        let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
        file.resolve_paths(at);
        let capped = file.settings(false).unwrap();
        assert_eq!(names(&capped.runs()), ["lr-a"]);
        assert_eq!(names(&capped.discover_runs().unwrap()), ["lr-a"]);
        let b = capped.glob_run("lr-b").unwrap().unwrap();
        assert_eq!(b.run_name(), "lr-b");
        assert!(b.state_dir().ends_with("sweep/lr-b/.diffmon"));
        assert!(b.sweep.is_empty() && b.runs_glob.is_none());
        assert!(capped.glob_run("lr-x").is_none());
        assert!(
            capped.glob_run("other").is_none(),
            "not matched by the glob"
        );
    }

    /// The problems of a config whose model and data files exist (`m.ts`, `d.h5`).
    fn problems(text: &str) -> Vec<String> {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let mut file = ConfigFile::parse(text, "c.yaml").unwrap();
        file.resolve_paths(dir.path());
        let problems = file.settings(false).unwrap_err();
        problems.iter().map(|p| p.to_string()).collect()
    }

    /// `runs_glob` is exclusive with `run` and `runs`, takes wildcards in its last component
    /// only, and leaves each run's state in its own folder (no `state_dir`).
    #[test]
    fn runs_glob_problems() {
        let tail = "model: {architecture: m.ts}\ndata: {path: d.h5}\n";
        for (text, expected) in [
            (
                "run: {dir: r}\nruns_glob: s/*\n",
                "runs_glob cannot be given with `run` or `runs`",
            ),
            ("runs_glob: s*/x\n", "runs_glob "),
            ("runs_glob: 's/[a'\n", "is not a valid glob"),
            (
                "runs_glob: s/*\nstate_dir: st\n",
                "state_dir cannot be given with `runs_glob`",
            ),
        ] {
            let p = problems(&format!("{text}{tail}"));
            assert_eq!(p.len(), 1, "{text}: {p:?}");
            assert!(p[0].contains(expected), "{text}: {p:?}");
        }
        assert!(
            problems(&format!("runs_glob: s*/x\n{tail}"))[0]
                .contains("wildcards only in the last component")
        );
    }

    /// `run` xor `runs`; names and state folders unique; an entry's own sections' problems are
    /// keyed under it, a shared section's reported once.
    #[test]
    fn sweep_problems_are_keyed_by_entry() {
        let tail = "model: {architecture: m.ts}\ndata: {path: d.h5}\n";
        let both = problems(&format!(
            "run: {{dir: r}}\nruns: [{{name: a, dir: r}}]\n{tail}"
        ));
        assert_eq!(both.len(), 1);
        assert!(
            both[0].starts_with("runs cannot be given with `run`"),
            "{both:?}"
        );
        let neither = problems(tail);
        assert!(
            neither[0].starts_with("run missing field `run`"),
            "{neither:?}"
        );
        let same = problems(&format!(
            "runs: [{{name: a, dir: r}}, {{name: a, dir: s}}, {{name: b, dir: r}}]\n{tail}"
        ));
        assert!(
            same.iter()
                .any(|p| p.starts_with("runs[1].name `a` is also the name of runs[0]")),
            "{same:?}"
        );
        assert!(
            same.iter()
                .any(|p| p.starts_with("runs[2].state_dir") && p.contains("runs[0]")),
            "{same:?}"
        );
        let bad = problems(&format!(
            "runs: [{{name: a, dir: r, data: {{path: x.h5}}}}, {{name: b, dir: s}}]\nicr: {{samples: 0}}\n{tail}"
        ));
        assert!(
            bad.iter().any(|p| p.starts_with("runs[0].data.path")),
            "{bad:?}"
        );
        assert_eq!(
            bad.iter().filter(|p| p.starts_with("icr.samples")).count(),
            1,
            "{bad:?}"
        );
    }
}
