//! `diffmon eval`: evaluate checkpoints once, one summary line (or JSON record) each.

use super::NoStep;
use crate::config::Config;
use crate::eval::Evaluator;
use anyhow::Result;
use std::io::Write;
use std::path::{Path, PathBuf};

/// `diffmon eval`.
pub fn eval(
    config_path: &Path,
    checkpoints: &[PathBuf],
    json: bool,
    evaluated_before: usize,
    failure_lines: bool,
) -> Result<()> {
    let mut config = Config::load_without_secrets(config_path)?;
    config.imply_memorization();
    let steps = checkpoints
        .iter()
        .map(|path| {
            let step_regex = &config.checkpoints.step_regex;
            crate::unit::step_of(path, Some(&config.run.dir), step_regex).ok_or_else(|| NoStep {
                path: path.clone(),
                regex: step_regex.to_string(),
            })
        })
        .collect::<Result<Vec<i64>, NoStep>>()?;
    let mut evaluator = Evaluator::new(&config)?;
    evaluator.set_evaluated(evaluated_before);
    let mut out = std::io::stdout().lock();
    let mut failures = 0;
    for (path, step) in checkpoints.iter().zip(steps) {
        // The version evaluated: a failure's reason is `vanished` if it changes meanwhile.
        let key = crate::unit::key(path).ok();
        match evaluator.evaluate(path, step) {
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
                tracing::warn!(checkpoint = %path.display(), "{e}");
                if failure_lines {
                    let reason = match &key {
                        Some(key) => crate::daemon::failure_reason(
                            &crate::watcher::WorkItem {
                                path: path.clone(),
                                step,
                                key: key.clone(),
                            },
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
