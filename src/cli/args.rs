//! The command line as clap parses it: the commands ([`Command`]) and their arguments, and the
//! top-level help's epilogue.

use crate::config::{DeviceSpec, Observable};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// The top-level help's epilogue: the workflow, logging and exit codes (the table [`Exit`](super::Exit)).
pub(super) const AFTER_HELP: &str = "\
Workflow (README, \"Your own run\"), for a training run saving checkpoints into runs/exp1:
  1. diffmon-export ... --out runs/exp1/model.ts
                                    the network's architecture as TorchScript, once; pip
                                    install ./ installs it with diffmon (pip install ./python,
                                    the helpers alone, only where the daemon never runs)
  2. the training images as HDF5: runs/exp1/train.h5, dataset `images`, [N,C,H,W] floats in
     [-1, 1] or uint8; and held-out images the training never sees, runs/exp1/heldout.h5
     (a name with heldout or val): they confirm the early stop best
  3. diffmon init --run-dir runs/exp1 > diffmon.yaml
                                    a config for what the run folder holds: its checkpoints,
                                    the *.ts architecture, train.h5 and the held-out file;
                                    what it found goes to stderr (--out FILE: paths relative
                                    to that file instead of absolute)
  4. diffmon check-config --config diffmon.yaml
                                    every problem of the config, with its key; the cost
  5. diffmon eval --config diffmon.yaml runs/exp1/ckpt_000200.pt
                                    evaluate one checkpoint to see the numbers and the time
  6. diffmon watch --config diffmon.yaml
                                    the daemon: evaluates every new checkpoint, serves
                                    /metrics, writes the early-stop file; --until-pid PID
                                    ends it with the training process
  7. diffmon.should_stop(\"runs/exp1\") in the training loop obeys the early stop
Afterwards: diffmon replay --config diffmon.yaml [--set early_stop.min_rise=0.01] (what the
early stop decided at each checkpoint, and would decide with other settings); diffmon resume
--config diffmon.yaml (after the early stop, with the daemon stopped: the best checkpoint back
in the run folder, a new history segment).

Logging goes to stderr, filtered by the DIFFMON_LOG environment variable (default: info; e.g.
DIFFMON_LOG=debug, or DIFFMON_LOG=warn).

Exit codes:
  0  success (also --help and --version, and a standard output that its reader closed,
     as `| head -1` does)
  2  bad usage or config: a command-line error, a config file that cannot be read or is
     invalid, a --run that names no run of the config (or none given for a sweep of several
     runs where one is needed), an eval checkpoint with no step in its path, a report file of
     unknown format, a device that is not there, a TorchScript file that pins another device
  1  any other failure, e.g. a checkpoint that could not be evaluated (eval evaluates the
     others first), a model that cannot be loaded, a port in use, a locked state folder
  3  watch --until-pid/--until-file: the training job ended, every checkpoint it left is
     evaluated, and the early stop has fired (0: it has not)
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
    ///
    /// It runs until SIGINT/SIGTERM (exit 0 once the evaluation in flight is recorded), or,
    /// with --until-pid or --until-file, until the training job ends: then it evaluates every
    /// checkpoint the job left and exits 0, or 3 when the early stop has fired
    /// (docs/guide/watching.md, "Ending with the training job").
    Watch {
        /// The config file (YAML; `diffmon init` writes one).
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// End with the training process PID: once it has ended, evaluate the checkpoints left
        /// (ready or still settling), record them, and exit (0, or 3 when the early stop has
        /// fired). Not with a sweep config.
        #[arg(long, value_name = "PID")]
        until_pid: Option<u32>,
        /// End once FILE exists (a marker the training writes after its last checkpoint; never
        /// taken for a checkpoint), as --until-pid does; with both, whichever comes first.
        #[arg(long, value_name = "FILE")]
        until_file: Option<PathBuf>,
        /// Print the end-of-run summary (checkpoints evaluated, failed and rotated, the early
        /// stop and the best, the commands for the report and resuming) as one JSON object.
        #[arg(long)]
        json: bool,
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
        /// The job's folder (the jobs executor's jobs pass it): a compiled package is on trial in
        /// the run's state folder, and named in this folder while it runs.
        #[arg(long, value_name = "DIR", hide = true)]
        job_folder: Option<PathBuf>,
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
        /// The output file; its extension picks the format: .html, .svg or .png. For a sweep
        /// without --run: one file per run, FILE's name with `-<run>` appended
        /// (report-<run>.html), and for .html the index of the runs at FILE, linking them.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// The run of a sweep config (`runs`, `runs_glob`) to report, by its name; for a
        /// single-run config, its run's name.
        #[arg(long, value_name = "NAME")]
        run: Option<String>,
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
        /// The run of a sweep config (`runs`, `runs_glob`) to replay, by its name (needed for a
        /// sweep of several runs); for a single-run config, its run's name.
        #[arg(long, value_name = "NAME")]
        run: Option<String>,
    },
    /// After the early stop: put the best checkpoint back where training resumes from (from
    /// the copy early_stop.keep_best kept), move the abandoned branch's later checkpoints
    /// aside, remove the stop file and start a new segment of the history. Run it with the
    /// daemon stopped; it prints how each training stack resumes.
    Resume {
        /// The daemon's config.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
        /// The run of a sweep config (`runs`), by its name.
        #[arg(long, value_name = "NAME")]
        run: Option<String>,
        /// Resume from the checkpoint of this step (one evaluated on the run's current branch)
        /// instead of the best the early stop named.
        #[arg(long, value_name = "N")]
        step: Option<i64>,
        /// Leave the checkpoints after the resume step in the run folder (by default they are
        /// moved to <state_dir>/set-aside/segment-<n>/, out of the training job's way).
        #[arg(long)]
        keep_later: bool,
        /// Say what would be done; change nothing.
        #[arg(long)]
        dry_run: bool,
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
        /// The exported architecture to name (model.architecture), where the run folder holds
        /// several (init lists them and asks for this instead of choosing one).
        #[arg(long, value_name = "FILE", requires = "run_dir")]
        architecture: Option<PathBuf>,
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
        assert!(at("train.h5") < at("diffmon init --run-dir"));
        assert!(at("diffmon watch --config") < at("diffmon.should_stop"));
        at("DIFFMON_LOG environment variable (default: info");
        at("  0  success");
        at("  2  bad usage or config");
        at("  1  any other failure");
    }

    /// One workflow: each `diffmon` command line of the help's steps is in the README's
    /// "Your own run" as written there (the same file names, `>` and checkpoint).
    #[test]
    fn the_help_workflow_is_the_readmes() {
        let readme = include_str!("../../README.md");
        let own_run = &readme[readme.find("## Your own run").expect("the section")..];
        let mut commands = 0;
        for line in AFTER_HELP.lines() {
            let Some(at) = line.find(". diffmon ") else {
                continue;
            };
            let command = line[at + 2..].trim_end();
            if command.starts_with("diffmon.") {
                continue;
            }
            commands += 1;
            assert!(
                own_run.contains(command),
                "`{command}` (the help's workflow) is not in the README's \"Your own run\""
            );
        }
        assert_eq!(commands, 4, "init, check-config, eval, watch");
    }
}
