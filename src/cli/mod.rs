//! The command line (docs/design.md §14), logging set-up, and the one place that maps errors to
//! exit codes ([`Exit`]): 0 ok, 2 bad usage or config, 1 runtime failure.
//!
//! The longer one-shot commands have a module each (`eval`, `icr_features`, `sample`,
//! `bias_variance`, `replay`); `watch` is [`crate::daemon::run`], `report`
//! [`crate::report::write`].
//!
//! Files: `mod.rs` the entry point, the commands' dispatch, `check-config`'s extra checks and
//! measured cost per checkpoint, [`Exit`] and logging; `args.rs` the command line as clap
//! parses it ([`Cli`], [`Command`], [`SampleArgs`], the help's epilogue); `eval.rs` `diffmon
//! eval` and its usage error [`NoStep`]; `init.rs`, `icr_features.rs`, `sample.rs`,
//! `bias_variance.rs`, `replay.rs` the command each is named after; `describe.rs` what
//! `check-config` says of the model files; `output.rs` standard output, written through
//! [`output::stdout`] (a reader that goes away ends a command quietly, status 0) and best
//! effort for `watch`.

// Results go through `output::stdout`, never `println!`, which panics when the reader has gone.
#![deny(clippy::print_stdout)]

mod args;
mod bias_variance;
mod describe;
mod eval;
mod icr_features;
pub mod init;
mod output;
mod replay;
mod resume;
mod sample;
mod summary;

use crate::config::{self, Config, ConfigError};
use crate::engine::eval::EvalError;
use crate::engine::model::ModelError;
use crate::engine::pfd::PfdError;
use crate::engine::tail;
use crate::report::ReportError;
use anyhow::{Context, Result};
pub use args::{Cli, Command, SampleArgs};
use bias_variance::bias_variance;
use clap::Parser;
use eval::eval;
pub use eval::sweep_table;
pub use eval::{NoStep, RunChoice};
use icr_features::icr_features;
use sample::sample;
use std::io::Write;
use std::process::ExitCode;

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
        Ok(exit) => exit.into(),
        // The reader has all it wanted (`| head -1`): nothing to say.
        Err(e) if output::is_stdout_closed(&e) => Exit::Success.into(),
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

/// `check-config`'s measured seconds per checkpoint, a line per run whose state folder holds a
/// history with evaluations (a restarted run), measured as the daemon measures its own
/// (`crate::daemon::measured_in_history`); nothing for a run without one. The journal is read as
/// `diffmon report` reads it, beside a running daemon, without its lock and without changing it.
fn measured_lines(config: &Config, runs: &[Config]) -> Vec<String> {
    use crate::store::history::{History, JOURNAL};
    let mut lines = Vec::new();
    for run in runs {
        let state_dir = run.state_dir();
        if !state_dir.join(JOURNAL).is_file() {
            continue;
        }
        let entries = match History::read(&state_dir) {
            Ok(entries) => entries,
            Err(e) => {
                tracing::debug!("{e}");
                continue;
            }
        };
        let every = crate::daemon::pf_ode_every(run);
        let Some((seconds, n)) = crate::daemon::measured_in_history(&entries, every) else {
            continue;
        };
        let who = if config.is_sweep() {
            format!(" (run `{}`)", run.run_name())
        } else {
            String::new()
        };
        let spread = if every > 1 {
            format!(", the PF-ODE probe's time spread over pfd.every = {every}")
        } else {
            String::new()
        };
        lines.push(format!(
            "measured{who}: {seconds:.1} s per checkpoint (median of the last {n} evaluations in {}{spread})",
            state_dir.display()
        ));
    }
    lines
}

/// The exit statuses of `diffmon`: the one table behind the help's "Exit codes"
/// ([`AFTER_HELP`](args::AFTER_HELP)) and the guide's list
/// (docs/guide/configuration.md, "Exit codes"). Each row has its test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exit {
    /// 0: the command worked; also `--help` and `--version` ([`Exit::of_parse`]), and a
    /// command whose standard output was closed by its reader ([`output::is_stdout_closed`]).
    Success = 0,
    /// 1: any other failure ([`Exit::of_error`]): a checkpoint that could not be evaluated (`eval`
    /// evaluates the others first), a model that cannot be loaded, a port in use, a locked state
    /// folder. `watch` also exits 1 when one of its threads panics (`daemon::run`).
    Failure = 1,
    /// 2: bad usage or config: a command line clap rejects ([`Exit::of_parse`]), or an error with
    /// one of these anywhere in its chain ([`Exit::of_error`]): a [`ConfigError`] (a config file
    /// that cannot be read or is invalid), a [`RunChoice`] (a `--run` that names no run of the
    /// config, or none where a sweep of several runs needs one), a [`NoStep`] (an `eval`
    /// checkpoint with no step in its path), a [`ReportError`] that [`ReportError::is_usage`] (a report file of unknown format),
    /// a [`ModelError`] that [`ModelError::is_usage`] (a device that is not there, a TorchScript
    /// file that pins another device), also inside an [`EvalError`] or a [`PfdError`].
    Usage = 2,
    /// 3: `watch --until-pid`/`--until-file` ended with the training job, every checkpoint it left
    /// evaluated, and the early stop has fired (and was not resolved since); 0 when it has not
    /// (`daemon::Ended::JobEnded`).
    EarlyStopped = 3,
    /// 130: `watch` on a second SIGINT/SIGTERM, from its signal handler (`daemon::run`; the first
    /// one drains the evaluation in flight).
    Interrupted = 130,
}

impl Exit {
    /// Every row of the table.
    pub const ALL: [Exit; 5] = [
        Exit::Success,
        Exit::Failure,
        Exit::Usage,
        Exit::EarlyStopped,
        Exit::Interrupted,
    ];

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
                || c.downcast_ref::<RunChoice>().is_some()
                || c.downcast_ref::<crate::cli::init::InitError>()
                    .is_some_and(crate::cli::init::InitError::is_usage)
                || c.downcast_ref::<ReportError>()
                    .is_some_and(ReportError::is_usage)
                || c.downcast_ref::<resume::ResumeError>()
                    .is_some_and(resume::ResumeError::is_usage)
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

/// Runs a command: the exit status of one that worked ([`Exit::Success`], or `watch`'s
/// [`Exit::EarlyStopped`]).
pub fn run(command: Command) -> Result<Exit> {
    match command {
        Command::Watch {
            config,
            until_pid,
            until_file,
            json,
        } => watch(&config, until_pid, until_file, json),
        command => one_shot(command).map(|()| Exit::Success),
    }
}

/// `diffmon watch`: the daemon ([`crate::daemon::run`]), then the end-of-run summary on
/// stdout (`json`: as one object).
fn watch(
    path: &std::path::Path,
    until_pid: Option<u32>,
    until_file: Option<std::path::PathBuf>,
    json: bool,
) -> Result<Exit> {
    let mut config = Config::load(path)?;
    config.imply_memorization();
    let until = crate::daemon::Until {
        pid: until_pid,
        // As given on the command line: relative to the current folder.
        file: until_file.map(|f| std::path::absolute(&f).unwrap_or(f)),
    };
    if until.is_set() && config.is_sweep() {
        return Err(RunChoice {
            message: "--until-pid and --until-file end one run's daemon with its training job; \
                      a sweep's runs end at different times (stop its daemon with SIGTERM)"
                .into(),
            config: path.to_path_buf(),
        }
        .into());
    }
    // The console's lines are best effort: a reader that goes away (`watch | head`) does not
    // end the daemon. Put back when the daemon returns.
    let _stdout = output::BestEffort::install().unwrap_or_else(|e| {
        tracing::warn!("standard output stays as it is: {e}");
        None
    });
    let (runs, in_sweep) = (config.runs(), config.is_sweep());
    let ended = crate::daemon::run(config, until)?;
    let how = match ended {
        crate::daemon::Ended::Signalled => summary::HowEnded::Signal,
        crate::daemon::Ended::JobEnded { .. } => summary::HowEnded::TrainingEnded,
    };
    // A sweep's runs as they were at the start (of `runs_glob`, those that joined later are
    // left out).
    let summaries: Vec<summary::RunSummary> = runs
        .iter()
        .map(|run| summary::RunSummary::of(run, path, in_sweep))
        .collect();
    let text = match json {
        true => summary::json(how, &summaries) + "\n",
        false => summary::text(how, &summaries),
    };
    let mut out = output::stdout();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    Ok(match ended {
        crate::daemon::Ended::JobEnded {
            early_stop_fired: true,
        } => Exit::EarlyStopped,
        _ => Exit::Success,
    })
}

/// The commands other than `watch`.
fn one_shot(command: Command) -> Result<()> {
    match command {
        Command::CheckConfig { file, config } => {
            let file = config.or(file).expect("clap requires the file or --config");
            let mut config = Config::load(&file)?;
            config.imply_memorization();
            let runs = config.runs();
            let mut problems = missing_run_folders(&config, &runs);
            problems.extend(pinned_device_problems(&config, &runs));
            problems.extend(describe::note_problems(&runs));
            let (formats, format_problems) = describe::network_format(&runs);
            problems.extend(format_problems);
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
            let mut out = output::stdout();
            writeln!(out, "{}: ok ({what})", file.display())?;
            writeln!(out, "{}", describe::model_summary(&config))?;
            for line in formats {
                writeln!(out, "{line}")?;
            }
            // What the daemon's parameterization check found on its run's checkpoints.
            for run in &runs {
                if let Some(w) = crate::store::parameterization::read(&run.state_dir()) {
                    writeln!(
                        out,
                        "parameterization check on step {} ({}): {} (warning)",
                        w.step,
                        crate::store::safe_fs::untrusted_text(&w.checkpoint),
                        crate::store::safe_fs::untrusted_text(&w.warning)
                    )?;
                }
            }
            if !config.is_sweep()
                && let Some(line) = describe::noise_summary(&config)
            {
                writeln!(out, "{line}")?;
            }
            writeln!(out, "{}", config.cost_summary())?;
            for line in measured_lines(&config, &runs) {
                writeln!(out, "{line}")?;
            }
            writeln!(out, "{}", config.early_stop_summary())?;
            for run in &runs {
                for line in run.trackers.destinations(&run.run_name()) {
                    writeln!(out, "tracker {line}")?;
                }
            }
            out.flush()?;
            Ok(())
        }
        Command::Init {
            run_dir,
            out,
            architecture,
        } => {
            let text = match run_dir {
                Some(dir) => {
                    let written = crate::cli::init::written_dir(&dir, out.as_deref())?;
                    let mut survey = match crate::cli::init::survey(&dir) {
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
                    crate::cli::init::choose_architecture(
                        &dir,
                        &mut survey,
                        architecture.as_deref(),
                    )?;
                    crate::cli::init::config_for(&dir, &written, &survey)
                }
                None => config::EXAMPLE.to_string(),
            };
            match out {
                Some(file) => {
                    crate::cli::init::write_new(&file, &text)?;
                    eprintln!("wrote {}", file.display());
                }
                None => {
                    let mut out = output::stdout();
                    out.write_all(text.as_bytes())?;
                    out.flush()?;
                }
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
            job_folder,
        } => eval(
            &config,
            run.as_deref(),
            &checkpoints,
            json,
            eval::AsJob {
                evaluated_before,
                failure_lines: json && failure_lines,
                folder: job_folder.as_deref(),
            },
        ),
        Command::Watch { .. } => unreachable!("`run` runs watch"),
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
            output::line(serde_json::to_string(&m)?)?;
            Ok(())
        }
        Command::BiasVariance { config, students } => bias_variance(&config, &students),
        Command::Replay {
            config,
            set,
            json,
            run,
        } => replay::replay(&config, run.as_deref(), &set, json),
        Command::Resume {
            config,
            run,
            step,
            keep_later,
            dry_run,
        } => {
            let report = resume::resume(&resume::Request {
                config: &config,
                run: run.as_deref(),
                step,
                keep_later,
                dry_run,
            })?;
            output::line(report)?;
            Ok(())
        }
        Command::Report { config, out, run } => report(&config, &out, run.as_deref()),
    }
}

/// `diffmon report`: the plots of one run (a single run, or `--run`), or of each run of a
/// sweep and their index (docs/design.md §14); prints each file written, the index last.
fn report(config_path: &std::path::Path, out: &std::path::Path, run: Option<&str>) -> Result<()> {
    let config = Config::load_without_secrets(config_path)?;
    if run.is_none() && config.is_sweep() && !config.runs().is_empty() {
        for file in crate::report::write_sweep(&config.runs(), out)? {
            output::line(file.display())?;
        }
        return Ok(());
    }
    let config = eval::choose_run(config, run, config_path)?;
    crate::report::write(&config, out)?;
    output::line(out.display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::args::AFTER_HELP;
    use super::*;

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
        let choice = eval::RunChoice {
            message: "the config is a sweep of 2 runs".into(),
            config: "s.yaml".into(),
        };
        assert_eq!(Exit::of_error(&choice.into()), Exit::Usage);
        assert_eq!(Exit::Usage.code(), 2);
    }

    #[test]
    fn exit_table_early_stopped() {
        assert_eq!(Exit::EarlyStopped.code(), 3);
        let cli = Cli::try_parse_from([
            "diffmon",
            "watch",
            "--config",
            "c.yaml",
            "--until-pid",
            "12",
            "--until-file",
            "DONE",
        ])
        .unwrap();
        assert!(matches!(
            cli.command,
            Command::Watch {
                until_pid: Some(12),
                until_file: Some(_),
                json: false,
                ..
            }
        ));
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
