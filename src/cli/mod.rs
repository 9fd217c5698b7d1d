//! The command line (docs/design.md §14), logging set-up, and the one place that maps errors to
//! exit codes ([`Exit`]): 0 ok, 2 bad usage or config, 1 runtime failure.
//!
//! The longer one-shot commands have a module each (`eval`, `icr_features`, `sample`,
//! `bias_variance`, `replay`); `watch` is [`crate::daemon::run`], `report`
//! [`crate::report::write`].

mod bias_variance;
mod eval;
mod icr_features;
pub mod init;
mod replay;
mod sample;

use crate::config::{self, Config, ConfigError, DeviceSpec, Observable};
use crate::engine::eval::EvalError;
use crate::engine::model::ModelError;
use crate::engine::pfd::PfdError;
use crate::engine::tail;
use crate::report::ReportError;
use anyhow::{Context, Result};
use bias_variance::bias_variance;
use clap::{Args, Parser, Subcommand};
use eval::eval;
pub use eval::sweep_table;
use icr_features::icr_features;
use sample::sample;
use std::path::PathBuf;
use std::process::ExitCode;

/// The top-level help's epilogue: the workflow, logging and exit codes (the table [`Exit`]).
const AFTER_HELP: &str = "\
Workflow, for a training run saving checkpoints into runs/exp1:
  1. diffmon-export (pip install ./python) writes the model's architecture as TorchScript,
     e.g. runs/exp1/model.ts (README, \"Your training stack\")
  2. diffmon init --run-dir runs/exp1 --out diffmon.yaml
                                    a config for what the run folder holds; edit it
  3. diffmon check-config --config diffmon.yaml
                                    every problem of the config, with its key
  4. diffmon eval --config diffmon.yaml runs/exp1/checkpoint-500
                                    evaluate one checkpoint to see the numbers and the time
  5. diffmon watch --config diffmon.yaml
                                    the daemon: evaluates every new checkpoint, serves
                                    /metrics, writes the early-stop file
  6. diffmon replay --config diffmon.yaml [--set early_stop.min_rise=0.01]
                                    what the early stop decided at each checkpoint, and
                                    would decide with other settings

Logging goes to stderr, filtered by the DIFFMON_LOG environment variable (default: info; e.g.
DIFFMON_LOG=debug, or DIFFMON_LOG=warn).

Exit codes:
  0  success (also --help and --version)
  2  bad usage or config: a command-line error, a config file that cannot be read or is
     invalid, an eval checkpoint with no step in its path, a report file of unknown format,
     a device that is not there, a TorchScript file that pins another device
  1  any other failure, e.g. a checkpoint that could not be evaluated (eval evaluates the
     others first), a model that cannot be loaded, a port in use, a locked state folder
  watch also exits 130 on a second SIGINT/SIGTERM (the first drains the evaluation in flight).

Each command has its own help: diffmon help COMMAND, or diffmon COMMAND --help.";

#[derive(Parser, Debug)]
#[command(
    name = "diffmon",
    version,
    about = "Monitor diffusion-model training: ICR, PFD, memorization, early stop",
    after_help = AFTER_HELP
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon: watch the checkpoint folder and evaluate every new checkpoint.
    Watch {
        /// The config file (YAML; `diffmon init` writes one).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Evaluate checkpoints once.
    Eval {
        /// The config file (YAML): the model, the data and the metrics to compute.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Checkpoint files or checkpoint folders; the training step is read from each path
        /// (relative to run.dir, else the file name, then its folder's name).
        #[arg(required = true, value_name = "CHECKPOINT")]
        checkpoints: Vec<PathBuf>,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// The run of a sweep config (`runs`) whose settings evaluate the checkpoints, by its
        /// name (needed for a sweep of several runs); for a single-run config, its run's name.
        #[arg(long, value_name = "NAME")]
        run: Option<String>,
        /// Checkpoints of the run evaluated before these (for `pfd.every`'s rhythm; the Slurm
        /// executor's jobs pass it).
        #[arg(long, default_value_t = 0, hide = true)]
        evaluated_before: usize,
        /// With --json: a checkpoint that cannot be evaluated is a line
        /// `{"failure": {"step", "reason", "message"}}` (the Slurm executor's jobs pass it).
        #[arg(long, hide = true)]
        failure_lines: bool,
    },
    /// ICR from precomputed features (`/h1`, `/h2` `[n,d]`), printed as JSON.
    IcrFeatures {
        /// HDF5 file with the feature pairs: datasets `/h1` and `/h2`, `[n,d]` float32/float64.
        #[arg(long, value_name = "FILE")]
        input: PathBuf,
        /// Relative ridge on the residual covariance.
        #[arg(long, default_value_t = 1e-4)]
        ridge: f64,
    },
    /// The PF-ODE map: integrate latents through a model (or the empirical flow of --data).
    Sample(SampleArgs),
    /// Tail metrics RMSQE and LOADER of two sample sets, as JSON.
    Tail {
        /// Images in `/samples` (the `sample` command's output).
        #[arg(long, value_name = "FILE")]
        samples: PathBuf,
        /// Reference images (`/samples`, or the dataset named by --reference-dataset).
        #[arg(long, value_name = "FILE")]
        reference: PathBuf,
        /// The dataset of --reference to read (`images` for a training-data file).
        #[arg(long, default_value = "samples", value_name = "NAME")]
        reference_dataset: String,
        /// max, min, mean, sum or quantile:q over each sample's pixels.
        #[arg(long, default_value = "max", value_parser = parse_observable)]
        observable: Observable,
        /// Quantile level where the tail starts, in [0, 1): RMSQE compares the two sets' quantiles
        /// above it.
        #[arg(long, default_value_t = 0.975)]
        eta: f64,
        /// Affine map of the observable to physical units: scale · o + offset.
        #[arg(long, default_value_t = 1.0)]
        scale: f64,
        /// The offset of that affine map (see --scale).
        #[arg(long, default_value_t = 0.0)]
        offset: f64,
    },
    /// E_gen per student, E_bias and E_var, as JSON.
    BiasVariance {
        /// The config file (YAML); it must set pfd.teacher.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Two or more student checkpoints (the same architecture trained on independent data
        /// sets), each compared with the teacher.
        #[arg(long, num_args = 2.., required = true, value_name = "CHECKPOINT")]
        students: Vec<PathBuf>,
    },
    /// Plots of the run's history (ICR with the turn, PFD, memorization, traces), as the live
    /// page shows them.
    Report {
        /// The daemon's config: the history is read from its state_dir.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The output file; its extension picks the format: .html, .svg or .png.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// Run the early-stop detector over the recorded history and print what it decides at each
    /// checkpoint (step, value, smoothed, noise, threshold, decision) and when it fires: to tune
    /// early_stop on your own runs.
    Replay {
        /// The daemon's config: the history is read from its state_dir, the detector's
        /// settings from its early_stop section.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// Replays with an early_stop key changed, as KEY=VALUE, the value in YAML (e.g.
        /// early_stop.min_rise=0.01, early_stop.confirm=none); repeatable.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        set: Vec<String>,
        /// One JSON object per line: one per checkpoint (`"kind": "checkpoint"`), then the
        /// summary (`"kind": "summary"`: fired_at_step, best_step, ...).
        #[arg(long)]
        json: bool,
    },
    /// Validate a config file and report every problem (exit code 2 if there is one).
    CheckConfig {
        /// The config file to validate (the same as --config).
        #[arg(
            value_name = "FILE",
            required_unless_present = "config",
            conflicts_with = "config"
        )]
        file: Option<PathBuf>,
        /// The config file to validate, as the other commands take it.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Print an annotated example config; with --run-dir, one written for what that run folder
    /// holds (checkpoints, their format and step pattern, EMA weights, architecture, data).
    Init {
        /// The training run's folder: looked at (never written), and its paths filled in. What
        /// was found is printed on stderr, the config on stdout with absolute paths (right
        /// wherever it is saved).
        #[arg(long, value_name = "DIR")]
        run_dir: Option<PathBuf>,
        /// Write the config to this new file instead (never overwritten), with paths relative
        /// to its folder, as a config's paths are read.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A TorchScript model of the contract, or `empirical` (the flow of the --data images).
    #[arg(long, value_name = "TS|empirical")]
    pub model: String,
    /// Weights to load into the TorchScript architecture first.
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Entry of a checkpoint's top-level dict holding the state dict (`ema`, `model`).
    #[arg(long, value_name = "KEY")]
    pub weights_key: Option<String>,
    /// Prefix to strip from the checkpoint's tensor names (`module.`).
    #[arg(long, value_name = "PREFIX")]
    pub strip_prefix: Option<String>,
    /// Training images (HDF5) for `--model empirical`.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// The dataset of --data holding the images.
    #[arg(long, default_value = "images", value_name = "NAME")]
    pub dataset: String,
    /// HDF5 file with standard-normal `/latents` `[M,C,H,W]`.
    #[arg(long, value_name = "FILE")]
    pub latents: PathBuf,
    /// Output HDF5 file: `/samples` `[M,C,H,W]` float32.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto", value_parser = parse_device)]
    pub device: DeviceSpec,
    /// Latents integrated together (one network call covers this many).
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Noise levels of the Heun sampler (≥ 2); each latent takes 2·steps − 1 denoiser
    /// evaluations.
    #[arg(long, default_value_t = 18)]
    pub steps: usize,
    /// The smallest nonzero noise level (> 0); the sampler's last step goes from it to 0.
    #[arg(long, default_value_t = 0.002)]
    pub sigma_min: f64,
    /// The largest noise level, where integration starts (the latents are scaled by it).
    #[arg(long, default_value_t = 80.0)]
    pub sigma_max: f64,
    /// Spacing exponent of the noise levels (Karras et al. 2022; > 0).
    #[arg(long, default_value_t = 7.0)]
    pub rho: f64,
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return Exit::of_parse(&e).into();
        }
    };
    init_logging();
    keep_freed_memory();
    match run(cli.command) {
        Ok(()) => Exit::Success.into(),
        Err(e) => {
            eprintln!("error: {}", crate::store::safe_fs::unproc(&error_text(&e)));
            Exit::of_error(&e).into()
        }
    }
}

/// An error and its causes, joined by `: ` as anyhow's `{:#}` does, but without a cause whose
/// text the message already holds (most of the crate's errors quote their source in their own
/// message, and keep it as `source` too).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}

/// Keeps memory that libtorch frees for its next tensors instead of handing it back to the
/// kernel. By default glibc serves large blocks (the activations of a forward pass, a few MiB
/// each) with fresh `mmap`s and trims the heap after frees, so every network call faults its
/// pages in again: measured on the toy PF-ODE (256 latents, 140 calls), 0.5–0.9 M page faults
/// and 1.5–2.2 s of system time against 26 k and 0.1 s with these settings; the PFD benchmark
/// went from 3.9–4.2 s to 2.5–2.7 s per checkpoint. The cost: the process keeps its peak heap. (PyTorch's CPU performance guide
/// recommends a caching allocator for the same reason.)
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator parameters; called before any worker thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// `check-config`'s look into the TorchScript files the runs name (architecture, teacher,
/// descriptor): a file whose graph pins a device runs on that device only, so it is a problem
/// wherever the daemon will run. A file libtorch cannot load is left to the start, which says
/// why.
/// `check-config`: the run folders that do not exist. `watch` would create such a folder and
/// wait in it for checkpoints that never come, which is how a path resolved against the wrong
/// folder (paths are relative to the config file's folder) goes unnoticed.
fn missing_run_folders(config: &Config, runs: &[Config]) -> Vec<config::Problem> {
    let missing = |dir: &std::path::Path| match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => None,
        Ok(_) => Some(format!("names {}, which is not a folder", dir.display())),
        Err(_) => Some(format!(
            "names {}, which does not exist (paths in a config are relative to the config file's \
             folder; create the folder first if training has not started yet)",
            dir.display()
        )),
    };
    if let Some(glob) = &config.runs_glob {
        let problem = missing(glob.folder()).map(|message| config::Problem {
            key: "runs_glob".into(),
            message,
        });
        return problem.into_iter().collect();
    }
    runs.iter()
        .enumerate()
        .filter_map(|(i, run)| {
            let key = if config.is_sweep() {
                format!("runs[{i}].dir")
            } else {
                "run.dir".into()
            };
            let message = missing(&run.run.dir)?;
            Some(config::Problem { key, message })
        })
        .collect()
}

fn pinned_device_problems(config: &Config, runs: &[Config]) -> Vec<config::Problem> {
    let mut seen = std::collections::HashSet::new();
    let mut problems = Vec::new();
    for run in runs {
        let prefix = if config.is_sweep() {
            format!("runs `{}`: ", run.run_name())
        } else {
            String::new()
        };
        let files = [
            ("model.architecture", Some(&run.model.architecture)),
            (
                "pfd.teacher",
                run.pfd.teacher.as_ref().filter(|_| run.pfd.enabled),
            ),
            (
                "pfd.descriptor",
                run.pfd.descriptor.as_ref().filter(|_| run.pfd.enabled),
            ),
        ];
        for (key, path) in files {
            let Some(path) = path else { continue };
            if !seen.insert((key, path.clone())) {
                continue;
            }
            match crate::engine::model::pinned_devices(path) {
                Ok(pins) if !pins.is_empty() => problems.push(config::Problem {
                    key: format!("{prefix}{key}"),
                    message: format!(
                        "{}: {}",
                        path.display(),
                        crate::engine::model::pins_problem(&pins)
                    ),
                }),
                Ok(_) => {}
                Err(e) => tracing::debug!("{e}"),
            }
        }
    }
    problems
}

/// A checkpoint given to `eval` whose path has no training step (a usage error, exit code 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "{path}: no training step in its path (checkpoints.step_regex `{regex}`, tried on the path relative to run.dir, else on the file name and its folder's name)"
)]
pub struct NoStep {
    path: PathBuf,
    regex: String,
}

/// The exit statuses of `diffmon`: the one table behind the help's "Exit codes"
/// ([`AFTER_HELP`]) and the README's list ("Commands"). Each row has its test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// 0: the command worked; also `--help` and `--version` ([`Exit::of_parse`]).
    Success = 0,
    /// 1: any other failure ([`Exit::of_error`]): a checkpoint that could not be evaluated (`eval`
    /// evaluates the others first), a model that cannot be loaded, a port in use, a locked state
    /// folder. `watch` also exits 1 when one of its threads panics (`daemon::run`).
    Failure = 1,
    /// 2: bad usage or config: a command line clap rejects ([`Exit::of_parse`]), or an error with
    /// one of these anywhere in its chain ([`Exit::of_error`]): a [`ConfigError`] (a config file
    /// that cannot be read or is invalid), a [`NoStep`] (an `eval` checkpoint with no step in its
    /// path), a [`ReportError`] that [`ReportError::is_usage`] (a report file of unknown format),
    /// a [`ModelError`] that [`ModelError::is_usage`] (a device that is not there, a TorchScript
    /// file that pins another device), also inside an [`EvalError`] or a [`PfdError`].
    Usage = 2,
    /// 130: `watch` on a second SIGINT/SIGTERM, from its signal handler (`daemon::run`; the first
    /// one drains the evaluation in flight).
    Interrupted = 130,
}

impl Exit {
    /// Every row of the table.
    pub const ALL: [Exit; 4] = [Exit::Success, Exit::Failure, Exit::Usage, Exit::Interrupted];

    /// The process exit status.
    pub const fn code(self) -> u8 {
        self as u8
    }

    /// The status of a command line that clap did not run: [`Exit::Usage`] for an error,
    /// [`Exit::Success`] for `--help` and `--version` (printed to stdout).
    pub fn of_parse(e: &clap::Error) -> Exit {
        if e.use_stderr() {
            Exit::Usage
        } else {
            Exit::Success
        }
    }

    /// The status of a command that failed: [`Exit::Usage`] when an error of its chain is a
    /// usage error (see the variant), else [`Exit::Failure`].
    pub fn of_error(e: &anyhow::Error) -> Exit {
        let usage = |c: &(dyn std::error::Error + 'static)| {
            c.downcast_ref::<ConfigError>().is_some()
                || c.downcast_ref::<NoStep>().is_some()
                || c.downcast_ref::<crate::cli::init::InitError>()
                    .is_some_and(crate::cli::init::InitError::is_usage)
                || c.downcast_ref::<ReportError>()
                    .is_some_and(ReportError::is_usage)
                || c.downcast_ref::<ModelError>()
                    .or_else(|| c.downcast_ref::<EvalError>().and_then(EvalError::model))
                    .or_else(|| c.downcast_ref::<PfdError>().and_then(PfdError::model))
                    .is_some_and(ModelError::is_usage)
        };
        if e.chain().any(usage) {
            Exit::Usage
        } else {
            Exit::Failure
        }
    }
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        ExitCode::from(e.code())
    }
}

/// Logs go to stderr, filtered by `DIFFMON_LOG` (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DIFFMON_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| Unproc(std::io::stderr()))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// A log writer that shows paths in the daemon's held state folder (`/proc/self/fd/<n>/...`)
/// where the folder is ([`crate::store::safe_fs::unproc`]). The formatter writes each line at once.
struct Unproc<W>(W);

impl<W: std::io::Write> std::io::Write for Unproc<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match std::str::from_utf8(buf) {
            Ok(text) if text.contains("/proc/self/fd/") => {
                self.0
                    .write_all(crate::store::safe_fs::unproc(text).as_bytes())?;
                Ok(buf.len())
            }
            _ => self.0.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
}

pub fn run(command: Command) -> Result<()> {
    match command {
        Command::CheckConfig { file, config } => {
            let file = config.or(file).expect("clap requires the file or --config");
            let mut config = Config::load(&file)?;
            config.imply_memorization();
            let runs = config.runs();
            let mut problems = missing_run_folders(&config, &runs);
            problems.extend(pinned_device_problems(&config, &runs));
            if !problems.is_empty() {
                return Err(ConfigError::Invalid {
                    file: file.display().to_string(),
                    problems,
                }
                .into());
            }
            let what = if !config.is_sweep() {
                format!(
                    "run `{}`, watching {}",
                    config.run_name(),
                    config.run.dir.display()
                )
            } else {
                let names: Vec<String> =
                    runs.iter().map(|r| format!("`{}`", r.run_name())).collect();
                let listed = if names.is_empty() {
                    "none yet".to_string()
                } else {
                    names.join(", ")
                };
                match &config.runs_glob {
                    Some(glob) => format!(
                        "a sweep of the folders {} matches, joining as they appear; runs now: {listed}",
                        glob.pattern.display()
                    ),
                    None => format!("a sweep of {} runs: {listed}", names.len()),
                }
            };
            println!("{}: ok ({what})", file.display());
            println!("{}", config.cost_summary());
            println!("{}", config.early_stop_summary());
            Ok(())
        }
        Command::Init { run_dir, out } => {
            let text = match run_dir {
                Some(dir) => {
                    let written = crate::cli::init::written_dir(&dir, out.as_deref())?;
                    let survey = match crate::cli::init::survey(&dir) {
                        Ok(survey) => {
                            // They name entries of the run folder: escaped as in the logs.
                            for line in crate::cli::init::describe(&dir, &survey) {
                                eprintln!("{}", crate::store::safe_fs::untrusted_text(&line));
                            }
                            survey
                        }
                        Err(e) => {
                            eprintln!(
                                "{}: cannot look at the run folder ({e}); writing the defaults for it",
                                dir.display()
                            );
                            crate::cli::init::Survey::default()
                        }
                    };
                    crate::cli::init::config_for(&dir, &written, &survey)
                }
                None => config::EXAMPLE.to_string(),
            };
            match out {
                Some(file) => {
                    crate::cli::init::write_new(&file, &text)?;
                    eprintln!("wrote {}", file.display());
                }
                None => print!("{text}"),
            }
            Ok(())
        }
        Command::Eval {
            config,
            checkpoints,
            json,
            run,
            evaluated_before,
            failure_lines,
        } => eval(
            &config,
            run.as_deref(),
            &checkpoints,
            json,
            evaluated_before,
            json && failure_lines,
        ),
        Command::Watch { config } => {
            let mut config = Config::load(&config)?;
            config.imply_memorization();
            crate::daemon::run(config)
        }
        Command::IcrFeatures { input, ridge } => icr_features(&input, ridge),
        Command::Sample(args) => sample(args),
        Command::Tail {
            samples,
            reference,
            reference_dataset,
            observable,
            eta,
            scale,
            offset,
        } => {
            let read = |path: &std::path::Path, dataset: &str| -> Result<tch::Tensor> {
                Ok(crate::engine::data::ImageSet::open_samples(path, dataset)?.read_all()?)
            };
            let p = tail::observables(&read(&samples, "samples")?, observable, scale, offset);
            let q = tail::observables(
                &read(&reference, &reference_dataset)?,
                observable,
                scale,
                offset,
            );
            let m = tail::tail_metrics(&p, &q, eta)
                .with_context(|| format!("{} vs {}", samples.display(), reference.display()))?;
            println!("{}", serde_json::to_string(&m)?);
            Ok(())
        }
        Command::BiasVariance { config, students } => bias_variance(&config, &students),
        Command::Replay { config, set, json } => replay::replay(&config, &set, json),
        Command::Report { config, out } => {
            crate::report::write(&Config::load_without_secrets(&config)?, &out)?;
            println!("{}", out.display());
            Ok(())
        }
    }
}

fn parse_observable(s: &str) -> Result<Observable, String> {
    s.parse()
}

fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    s.parse()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `command` and its subcommands (recursively), each as `path: what`, where an argument or a
    /// subcommand has no help text.
    fn undocumented(command: &clap::Command, parent: &str) -> Vec<String> {
        let path = format!("{parent} {}", command.get_name())
            .trim()
            .to_string();
        let empty = |s: Option<&clap::builder::StyledStr>| {
            s.is_none_or(|s| s.to_string().trim().is_empty())
        };
        let mut missing = Vec::new();
        if empty(command.get_about()) && empty(command.get_long_about()) {
            missing.push(format!("{path}: the command itself"));
        }
        for arg in command.get_arguments() {
            if empty(arg.get_help()) && empty(arg.get_long_help()) {
                missing.push(format!("{path}: {}", arg.get_id()));
            }
        }
        for sub in command.get_subcommands() {
            missing.extend(undocumented(sub, &path));
        }
        missing
    }

    /// The command line as clap builds it, with `help` and `--help`/`--version` added.
    fn built() -> clap::Command {
        let mut command = Cli::command();
        command.build();
        command
    }

    #[test]
    fn every_argument_of_every_command_has_help() {
        let command = built();
        assert_eq!(undocumented(&command, ""), Vec::<String>::new());
        // The walk reaches every subcommand's arguments, positionals included.
        let eval = command.find_subcommand("eval").unwrap();
        assert!(eval.get_positionals().any(|a| a.get_id() == "checkpoints"));
        assert!(command.get_subcommands().count() >= 10);
    }

    #[test]
    fn an_undocumented_argument_is_caught() {
        let mut command = clap::Command::new("x")
            .about("x")
            .disable_help_subcommand(true)
            .subcommand(
                clap::Command::new("y")
                    .about("y")
                    .disable_help_subcommand(true)
                    .arg(clap::Arg::new("documented").long("documented").help("yes"))
                    .arg(clap::Arg::new("bare").long("bare"))
                    .subcommand(clap::Command::new("z").arg(clap::Arg::new("file"))),
            );
        command.build();
        assert_eq!(
            undocumented(&command, ""),
            ["x y: bare", "x y z: the command itself", "x y z: file"]
        );
    }

    #[test]
    fn an_error_prints_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file");
        #[derive(Debug, thiserror::Error)]
        #[error("c.yaml: cannot read: {source}")]
        struct Quoting {
            source: std::io::Error,
        }
        let quoting = anyhow::Error::new(Quoting { source: io() });
        assert_eq!(error_text(&quoting), "c.yaml: cannot read: No such file");
        let plain = anyhow::Error::new(io()).context("loading the model");
        assert_eq!(error_text(&plain), "loading the model: No such file");
    }

    /// Errors keep their cause (`#[source]`), and the printed text names it once.
    #[test]
    fn kept_causes_are_printed_once() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"not HDF5").unwrap();
        let once = |e: anyhow::Error, start: String| {
            let cause = e.source().expect("the cause is kept").to_string();
            let text = error_text(&e);
            assert!(text.starts_with(&start), "{text}");
            assert_eq!(text.matches(&cause).count(), 1, "{text}");
        };
        let data = crate::engine::data::ImageSet::open(&plain, "images")
            .err()
            .unwrap();
        once(
            data.into(),
            format!("{}: cannot open HDF5 file: ", plain.display()),
        );
        let missing = dir.path().join("missing.ts");
        let pfd = crate::engine::pfd::file_sha256(&missing).unwrap_err();
        assert!(
            matches!(&pfd, crate::engine::pfd::PfdError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::NotFound)
        );
        once(pfd.into(), format!("{}: ", missing.display()));
        // A state folder under a file: neither the lock nor the crash marker can be made.
        let state = plain.join("state");
        let lock = crate::store::lock::StateLock::acquire(&state, dir.path()).unwrap_err();
        once(
            lock.into(),
            format!("{}: cannot open the state folder: ", plain.display()),
        );
        let crash = crate::store::crash::read_marker(&state).unwrap_err();
        once(
            crash.into(),
            format!(
                "{}: cannot read the crash marker: ",
                state.join(crate::store::crash::MARKER_FILE).display()
            ),
        );
    }

    #[test]
    fn check_config_takes_the_file_bare_or_as_config() {
        let file = |args: &[&str]| match Cli::try_parse_from(args).map(|c| c.command) {
            Ok(Command::CheckConfig { file, config }) => Ok(config.or(file).unwrap()),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.kind()),
        };
        assert_eq!(
            file(&["diffmon", "check-config", "a.yaml"]),
            Ok("a.yaml".into())
        );
        assert_eq!(
            file(&["diffmon", "check-config", "--config", "a.yaml"]),
            Ok("a.yaml".into())
        );
        assert_eq!(
            file(&["diffmon", "check-config"]),
            Err(clap::error::ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            file(&["diffmon", "check-config", "a.yaml", "--config", "b.yaml"]),
            Err(clap::error::ErrorKind::ArgumentConflict)
        );
    }

    #[test]
    fn the_top_level_help_shows_the_workflow_logging_and_exit_codes() {
        let help = built().render_long_help().to_string();
        let at = |s: &str| {
            help.find(s)
                .unwrap_or_else(|| panic!("`{s}` is not in the help:\n{help}"))
        };
        assert!(at("diffmon-export") < at("diffmon init --run-dir"));
        assert!(at("diffmon init --run-dir") < at("diffmon check-config --config"));
        assert!(at("diffmon check-config --config") < at("diffmon eval --config"));
        assert!(at("diffmon eval --config") < at("diffmon watch --config"));
        at("DIFFMON_LOG environment variable (default: info");
        at("  0  success");
        at("  2  bad usage or config");
        at("  1  any other failure");
    }

    /// What the help's "Exit codes" says is what [`exit_code`] does.
    #[test]
    fn exit_codes_are_as_the_help_says() {
        let exit_code = |e: &anyhow::Error| Exit::of_error(e).code();
        let config = ConfigError::Invalid {
            file: "c.yaml".into(),
            problems: Vec::new(),
        };
        let no_step = NoStep {
            path: "x.pt".into(),
            regex: "(\\d+)".into(),
        };
        let format = ReportError::UnknownFormat {
            path: "r.pdf".into(),
            extension: "pdf".into(),
        };
        let history = ReportError::NoHistory {
            path: "state".into(),
        };
        assert_eq!(
            exit_code(&anyhow::Error::from(config).context("loading")),
            2
        );
        assert_eq!(exit_code(&no_step.into()), 2);
        assert_eq!(exit_code(&format.into()), 2);
        assert_eq!(exit_code(&history.into()), 1);
        assert_eq!(exit_code(&anyhow::anyhow!("a checkpoint failed")), 1);
    }

    /// One test per row of [`Exit`], and the help lists every row.
    #[test]
    fn exit_table_success() {
        for args in [["diffmon", "--help"], ["diffmon", "--version"]] {
            let e = Cli::try_parse_from(args).unwrap_err();
            assert_eq!(Exit::of_parse(&e), Exit::Success, "{args:?}");
        }
        assert_eq!(Exit::Success.code(), 0);
    }

    #[test]
    fn exit_table_failure() {
        let history = ReportError::NoHistory {
            path: "state".into(),
        };
        assert_eq!(Exit::of_error(&history.into()), Exit::Failure);
        let chained = anyhow::anyhow!("a checkpoint failed").context("eval");
        assert_eq!(Exit::of_error(&chained), Exit::Failure);
        assert_eq!(Exit::Failure.code(), 1);
    }

    #[test]
    fn exit_table_usage() {
        let e = Cli::try_parse_from(["diffmon", "--no-such-flag"]).unwrap_err();
        assert_eq!(Exit::of_parse(&e), Exit::Usage);
        let config = ConfigError::Invalid {
            file: "c.yaml".into(),
            problems: Vec::new(),
        };
        assert_eq!(
            Exit::of_error(&anyhow::Error::from(config).context("loading")),
            Exit::Usage
        );
        let no_step = NoStep {
            path: "x.pt".into(),
            regex: "(\\d+)".into(),
        };
        assert_eq!(Exit::of_error(&no_step.into()), Exit::Usage);
        let format = ReportError::UnknownFormat {
            path: "r.pdf".into(),
            extension: "pdf".into(),
        };
        assert_eq!(Exit::of_error(&format.into()), Exit::Usage);
        assert_eq!(Exit::Usage.code(), 2);
    }

    #[test]
    fn exit_table_interrupted() {
        assert_eq!(Exit::Interrupted.code(), 130);
    }

    #[test]
    fn the_help_lists_every_exit_status() {
        for exit in Exit::ALL {
            let code = exit.code();
            assert!(
                AFTER_HELP.contains(&format!("\n  {code}  "))
                    || AFTER_HELP.contains(&format!("exits {code} ")),
                "{exit:?} ({code}) is not in the help's exit codes"
            );
        }
    }
}
