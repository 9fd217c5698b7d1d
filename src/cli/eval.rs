//! `diffmon eval`: evaluate checkpoints once, one summary line (or JSON record) each.

use crate::config::Config;
use crate::engine::eval::Evaluator;
use anyhow::Result;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What a job of the jobs executor passes to `diffmon eval` (`src/daemon/jobs/script.rs`).
pub struct AsJob<'a> {
    /// Checkpoints of the run evaluated before these (for `pfd.every`'s rhythm).
    pub evaluated_before: usize,
    /// A checkpoint that cannot be evaluated is a JSON failure line.
    pub failure_lines: bool,
    /// The job's folder: a compiled package is on trial in the run's state folder
    /// ([`crate::store::package_trial::in_job`]).
    pub folder: Option<&'a Path>,
}

/// `diffmon eval`.
pub fn eval(
    config_path: &Path,
    run: Option<&str>,
    checkpoints: &[PathBuf],
    json: bool,
    job: AsJob,
) -> Result<()> {
    let config = Config::load_without_secrets(config_path)?;
    let mut config = choose_run(config, run, config_path)?;
    config.imply_memorization();
    if let Some(folder) = job.folder {
        crate::store::package_trial::in_job(&config.state_dir(), folder);
    }
    let steps = checkpoints
        .iter()
        .map(|path| {
            let step_regex = &config.checkpoints.step_regex;
            crate::store::unit::step_of(path, Some(&config.run.dir), step_regex).ok_or_else(|| {
                NoStep {
                    path: path.clone(),
                    regex: step_regex.to_string(),
                }
            })
        })
        .collect::<Result<Vec<i64>, NoStep>>()?;
    let mut evaluator = Evaluator::new(&config)?;
    evaluator.set_evaluated(job.evaluated_before);
    let mut out = super::output::stdout();
    let mut failures = 0;
    for (path, step) in checkpoints.iter().zip(steps) {
        // The version evaluated: a failure's reason is `vanished` if it changes meanwhile.
        let key = crate::store::unit::key(path).ok();
        let on_trial = crate::store::package_trial::resume(evaluator.package().as_deref());
        let evaluated = evaluator.evaluate(path, step);
        if on_trial.is_some() {
            crate::store::package_trial::settle(evaluated.is_ok());
        }
        match evaluated {
            Ok(record) => {
                if json {
                    writeln!(out, "{}", serde_json::to_string(&record)?)?;
                } else {
                    writeln!(out, "{}", crate::record::eval_line(&record))?;
                    if let Some(sweep) = &record.icr_sweep {
                        write!(out, "{}", sweep_table(sweep))?;
                    }
                }
                out.flush()?;
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(checkpoint = %crate::store::safe_fs::untrusted(path), "{}", crate::store::safe_fs::untrusted_text(&e.to_string()));
                if job.failure_lines {
                    let reason = match &key {
                        Some(key) => crate::daemon::failure_reason(
                            &crate::daemon::watcher::WorkItem::new(path.clone(), step, key.clone()),
                            &e,
                        ),
                        None => crate::record::FailureReason::Unreadable,
                    };
                    let line = serde_json::json!({"failure": {
                        "step": step,
                        "reason": reason.as_str(),
                        "message": e.to_string(),
                    }});
                    writeln!(out, "{line}")?;
                    out.flush()?;
                }
            }
        }
    }
    if failures > 0 {
        anyhow::bail!(
            "{failures} of {} checkpoint(s) could not be evaluated",
            checkpoints.len()
        );
    }
    Ok(())
}

/// A checkpoint given to `eval` whose path has no training step (a usage error, exit code 2).
#[derive(Debug, thiserror::Error)]
#[error(
    "{path}: no training step in its path (checkpoints.step_regex `{regex}`, tried on the path relative to run.dir, else on the file name and its folder's name)"
)]
pub struct NoStep {
    pub(super) path: PathBuf,
    pub(super) regex: String,
}

/// The run a command was to work on cannot be chosen (`--run`): none given for a sweep of
/// several runs, a name that is not one of the config's runs, or no run yet (a usage error,
/// exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{message} (config {})", config.display())]
pub struct RunChoice {
    pub(super) message: String,
    pub(super) config: PathBuf,
}

/// [`select_run`], its error a [`RunChoice`] naming `config_path`.
pub(super) fn choose_run(
    config: Config,
    run: Option<&str>,
    config_path: &Path,
) -> Result<Config, RunChoice> {
    select_run(config, run).map_err(|message| RunChoice {
        message,
        config: config_path.to_path_buf(),
    })
}

/// The settings of the run named `run`: of a sweep, the entry of `runs` with that name
/// (required when it lists several); of a single run, its own, if `run` names it.
pub(super) fn select_run(config: Config, run: Option<&str>) -> Result<Config, String> {
    let runs = config.runs();
    let names = || {
        runs.iter()
            .map(|c| format!("`{}`", c.run_name()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if runs.is_empty() {
        return Err(
            "the config's runs_glob matches no run folder yet: there is no run to work on".into(),
        );
    }
    let Some(name) = run else {
        if runs.len() > 1 {
            return Err(format!(
                "the config is a sweep of {} runs: name one with --run ({})",
                runs.len(),
                names()
            ));
        }
        return Ok(runs.into_iter().next().unwrap_or(config));
    };
    match runs.iter().position(|c| c.run_name() == name) {
        Some(i) => Ok(runs.into_iter().nth(i).expect("found above")),
        // A run of the glob beyond the first `max_runs` by name, which the daemon holds.
        None if let Some(found) = config.glob_run(name) => found.map_err(|problems| {
            let problems: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
            format!("run `{name}`: {}", problems.join("; "))
        }),
        None => Err(format!(
            "--run: no run is named `{}`; the config's runs: {}",
            name.escape_debug(),
            names()
        )),
    }
}

/// The noise-level sweep as a table, the sigma of lowest ICR (the semantic window) marked.
pub fn sweep_table(sweep: &[crate::record::SweepPoint]) -> String {
    let best = sweep.iter().map(|p| p.icr).fold(f64::INFINITY, f64::min);
    let mut table = String::from("    sigma        ICR   std.err\n");
    for p in sweep {
        let mark = if p.icr == best { "  <- lowest" } else { "" };
        let se = p.stderr.map_or("-".to_string(), |se| format!("{se:.5}"));
        table += &format!("  {:>7.4}  {:>9.5}  {se:>8}{mark}\n", p.sigma, p.icr);
    }
    table
}

#[cfg(test)]
mod select_tests {
    use super::*;

    /// A sweep's run is chosen by name (required with several runs, an unknown one is an error
    /// listing the names); a single run's config takes its own name or none.
    #[test]
    fn the_run_is_selected_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "a.h5", "b.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let d = dir.path().display();
        let sweep = format!(
            "model: {{architecture: {d}/m.ts}}\ndevice: cpu\ndata: {{path: {d}/a.h5}}\n\
             runs:\n  - {{name: ra, dir: {d}/ra}}\n  - {{name: rb, dir: {d}/rb, data: {{path: {d}/b.h5}}}}\n"
        );
        let config = crate::config::ConfigFile::parse(&sweep, "s.yaml")
            .unwrap()
            .settings(false)
            .unwrap();
        let rb = select_run(config.clone(), Some("rb")).unwrap();
        assert_eq!(rb.run_name(), "rb");
        assert_eq!(rb.data.path, dir.path().join("b.h5"));
        assert_eq!(
            select_run(config.clone(), Some("ra")).unwrap().data.path,
            dir.path().join("a.h5")
        );
        let e = select_run(config.clone(), Some("rc")).unwrap_err();
        assert!(e.contains("`rc`") && e.contains("`ra`, `rb`"), "{e}");
        let e = select_run(config, None).unwrap_err();
        assert!(
            e.contains("sweep of 2 runs") && e.contains("`ra`, `rb`"),
            "{e}"
        );

        let single = format!(
            "run: {{dir: {d}/ra, name: one}}\nmodel: {{architecture: {d}/m.ts}}\ndevice: cpu\n\
             data: {{path: {d}/a.h5}}\n"
        );
        let config = crate::config::ConfigFile::parse(&single, "s.yaml")
            .unwrap()
            .settings(false)
            .unwrap();
        assert_eq!(select_run(config.clone(), None).unwrap().run_name(), "one");
        assert_eq!(
            select_run(config.clone(), Some("one")).unwrap().run_name(),
            "one"
        );
        let e = select_run(config, Some("two")).unwrap_err();
        assert!(e.contains("`two`") && e.contains("`one`"), "{e}");

        // A glob of run folders with no match yet has no run to evaluate.
        let glob = format!(
            "runs_glob: {d}/sweep/lr-*\nmodel: {{architecture: {d}/m.ts}}\ndevice: cpu\n\
             data: {{path: {d}/a.h5}}\n"
        );
        let config = crate::config::ConfigFile::parse(&glob, "s.yaml")
            .unwrap()
            .settings(false)
            .unwrap();
        let e = select_run(config, None).unwrap_err();
        assert!(e.contains("matches no run folder yet"), "{e}");
    }
}
