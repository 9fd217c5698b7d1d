//! The config file as written: what serde reads from the YAML, before any value is checked. The
//! sections whose values become typed settings (durations, the checkpoint glob and step
//! pattern, weights files, the listen address, webhook URLs and secrets) are here as plain
//! values; the other sections are shared with [`Config`](super::Config) as they are.
//! [`ConfigFile::settings`] checks every value and builds the `Config` once.

use super::{
    Backlog, DataConfig, DeviceSpec, EarlyStopConfig, IcrConfig, MemorizationConfig, ModelConfig,
    PfdConfig, RunConfig, TailConfig, WebhookFormat, default_true,
};
use serde::Deserialize;
use std::path::PathBuf;

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
    pub(super) data: DataConfig,
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
}

/// `evaluation`: where checkpoints are evaluated.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Evaluation {
    #[serde(default)]
    pub(super) executor: super::ExecutorKind,
    #[serde(default = "default_max_in_flight")]
    pub(super) max_in_flight: usize,
    #[serde(default = "default_retries")]
    pub(super) retries: usize,
    #[serde(default)]
    pub(super) slurm: Slurm,
}

fn default_max_runs() -> usize {
    super::DEFAULT_MAX_RUNS
}

fn default_max_in_flight() -> usize {
    4
}

impl Default for Evaluation {
    fn default() -> Self {
        Evaluation {
            executor: super::ExecutorKind::Local,
            max_in_flight: default_max_in_flight(),
            retries: default_retries(),
            slurm: Slurm::default(),
        }
    }
}

/// `evaluation.slurm`: the jobs' `sbatch` options.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Slurm {
    #[serde(default)]
    pub(super) partition: Option<String>,
    #[serde(default)]
    pub(super) account: Option<String>,
    #[serde(default)]
    pub(super) time_limit: Option<String>,
    #[serde(default)]
    pub(super) gres: Option<String>,
    #[serde(default)]
    pub(super) sbatch_args: Vec<String>,
    #[serde(default)]
    pub(super) env: std::collections::BTreeMap<String, String>,
    #[serde(default = "default_slurm_poll_secs")]
    pub(super) poll_secs: f64,
    #[serde(default)]
    pub(super) binary: Option<PathBuf>,
}

fn default_slurm_poll_secs() -> f64 {
    5.0
}

fn default_retries() -> usize {
    1
}

impl Default for Slurm {
    fn default() -> Self {
        Slurm {
            partition: None,
            account: None,
            time_limit: None,
            gres: None,
            sbatch_args: Vec::new(),
            env: Default::default(),
            poll_secs: default_slurm_poll_secs(),
            binary: None,
        }
    }
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

fn default_shutdown_drain_secs() -> f64 {
    120.0
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

/// `alerts.webhooks[]`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Webhook {
    pub(super) url: String,
    #[serde(default = "default_webhook_format")]
    pub(super) format: WebhookFormat,
    /// Name of the environment variable holding the signing secret (never the secret itself).
    #[serde(default)]
    pub(super) secret_env: Option<String>,
}

fn default_webhook_format() -> WebhookFormat {
    WebhookFormat::Json
}

/// `alerts.alertmanager`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Alertmanager {
    pub(super) url: String,
}

/// `alerts`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Alerts {
    #[serde(default)]
    pub(super) webhooks: Vec<Webhook>,
    #[serde(default)]
    pub(super) alertmanager: Option<Alertmanager>,
    /// File name inside `run.dir` written when the early stop fires.
    #[serde(default = "default_stop_file")]
    pub(super) stop_file: String,
}

fn default_stop_file() -> String {
    "EARLY_STOP".into()
}

impl Default for Alerts {
    fn default() -> Self {
        Alerts {
            webhooks: Vec::new(),
            alertmanager: None,
            stop_file: default_stop_file(),
        }
    }
}

/// `http`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Http {
    #[serde(default = "default_listen")]
    pub(super) listen: String,
    /// A request's headers must arrive within this time after its first byte, else the
    /// connection is closed. Range 0.1 to 3600.
    #[serde(default = "default_header_timeout_secs")]
    pub(super) header_timeout_secs: f64,
    /// A connection without a request in flight is closed after this time. Range 0.1 to 86400.
    #[serde(default = "default_idle_timeout_secs")]
    pub(super) idle_timeout_secs: f64,
    /// Connections open at once; one more is accepted and closed at once. Range 1 to 65536.
    #[serde(default = "default_max_connections")]
    pub(super) max_connections: u32,
}

fn default_listen() -> String {
    "127.0.0.1:9464".into()
}

fn default_header_timeout_secs() -> f64 {
    10.0
}

fn default_idle_timeout_secs() -> f64 {
    60.0
}

fn default_max_connections() -> u32 {
    256
}

impl Default for Http {
    fn default() -> Self {
        Http {
            listen: default_listen(),
            header_timeout_secs: default_header_timeout_secs(),
            idle_timeout_secs: default_idle_timeout_secs(),
            max_connections: default_max_connections(),
        }
    }
}
