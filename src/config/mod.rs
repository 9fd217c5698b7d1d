//! The YAML configuration (docs/design.md §15), in two steps. [`ConfigFile::parse`] reads the
//! text into the file's sections with their defaults, so that errors carry the key path, line
//! and column. [`ConfigFile::settings`] then checks every value, reporting every problem with its
//! key, and builds the typed [`Config`] the program runs on: durations, the compiled checkpoint
//! glob and step pattern, the weights files, the listen address, the webhooks' URLs and decoded
//! secrets. That is the only place a value is checked; nothing later parses or checks it again.
//! [`Config::load`] does both and resolves relative paths against the config file's folder.
//!
//! The files, each section's types beside their checks (every item is re-exported here):
//!
//! - `file.rs`: [`ConfigFile`], the top level of the file as written, and [`EXAMPLE`].
//! - `run.rs`: the `run` and `runs` keys ([`RunConfig`], a `runs` entry), run names, `max_runs`.
//! - `checkpoints.rs`, `model.rs` (`model`, `data`, `device`), `icr.rs`, `pfd.rs` (`pfd`,
//!   `memorization`, `tail`), `early_stop.rs`, `alerts.rs`, `http.rs`, `evaluation.rs` (with
//!   `evaluation.slurm`), `trackers.rs`: one section or family each, its struct as written where its values
//!   are parsed, its settings, defaults, and the function that checks it.
//! - `settings.rs`: [`Config`] and what it tells (named files, run name, cost and early-stop
//!   summaries, the confirmation `auto` resolves to), and a single run's settings, built from
//!   each section's check.
//! - `sweep.rs`: [`ConfigFile::settings`] for one run, a sweep (`runs`) or a glob of run folders
//!   (`runs_glob`), and each run's settings back ([`Config::runs`], [`Config::discover_runs`]).
//! - `runs_glob.rs`: [`RunsGlob`], the compiled `runs_glob`, which finds the run folders.
//! - `load.rs`: [`Config::load`], [`ConfigFile::parse`], [`ConfigError`], the bounded read, the
//!   resolution of relative paths.
//! - `validate.rs`: [`Problem`] and the `Validator` that collects them, the bounds and serde
//!   defaults that several sections share.
//! - `values.rs`: the values parsed from a string once ([`Glob`], [`StepPattern`],
//!   [`WeightsFile`], [`SecretEnv`], webhook URLs).
//! - `text.rs`: plain scans of the text: a key's line and column, too deep nesting.
//!
//! Files import their siblings directly, never this one, so that there is no cycle between them.

mod alerts;
mod checkpoints;
mod early_stop;
mod evaluation;
mod file;
mod http;
mod icr;
mod load;
mod model;
mod pfd;
mod run;
mod runs_glob;
mod settings;
mod sweep;
#[cfg(test)]
mod test_support;
mod text;
mod trackers;
mod validate;
mod values;

pub use alerts::{AlertmanagerConfig, AlertsConfig, WebhookConfig, WebhookFormat};
pub use checkpoints::{Backlog, CheckpointsConfig};
pub use early_stop::{
    Confirm, Confirmation, EarlyStopConfig, EarlyStopMetric, EarlyStopSettings, Smoother, Trigger,
};
pub use evaluation::{EvaluationConfig, ExecutorKind, Precision, SlurmConfig};
pub use file::{ConfigFile, EXAMPLE};
pub use http::HttpConfig;
pub use icr::{AugmentConfig, BiasCorrection, IcrConfig};
pub(crate) use load::normalize;
pub use load::{ConfigError, MAX_CONFIG_BYTES};
pub use model::{CompiledSetting, DataConfig, DeviceSpec, ModelConfig};
pub use pfd::{
    MemorizationConfig, MemorizationCriterion, Observable, PfdConfig, TailConfig, TailReference,
};
pub use run::{DEFAULT_MAX_RUNS, MAX_RUNS, RunConfig};
pub use runs_glob::RunsGlob;
pub use settings::{CONFIRM_LATENTS, Config};
pub use text::MAX_FLOW_DEPTH;
pub use trackers::{MlflowConfig, MlflowRun, TensorboardConfig, Token, TrackersConfig};
pub use validate::Problem;
pub use values::{Glob, SecretEnv, StepPattern, WeightsFile};
