//! `diffmon replay`: the early-stop detector over a recorded history, with the config's
//! `early_stop` settings and any overrides, printing what it decides at each checkpoint and a
//! summary (docs/design.md §14). The same [`crate::engine::detector::replay`] as the daemon's start-up.

use crate::config::{Config, ConfigError, EarlyStopConfig, Problem, Trigger};
use crate::engine::detector::{Decision, Detector, DetectorState, Replayed, Signal};
use crate::store::history::{History, JOURNAL};
use anyhow::Result;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A history that is not there (a runtime failure, exit 1).
#[derive(Debug, thiserror::Error)]
#[error(
    "{path}: no history: `diffmon watch` with this config (state_dir) has not recorded any checkpoint"
)]
pub struct NoHistory {
    path: PathBuf,
}

/// What the detector did at one checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The record has no value of the metric (`pfd.every`, a disabled metric).
    NoValue,
    /// A new best (smallest smoothed value).
    Best,
    /// Within `threshold` of the best, or the noise not known yet.
    Flat,
    /// Above `best + threshold`, for fewer than `patience` checkpoints (or during `warmup`).
    Above,
    /// Turned, but the confirmation signal has not risen: nothing sent.
    Unconfirmed,
    /// The early stop fires here.
    EarlyStop,
    /// A dip below the fired best: `resolved`.
    Resolved,
}

impl Verdict {
    fn of(value: Option<f64>, decision: &Decision, new_best: bool, wait: usize) -> Verdict {
        match (value, decision.signal) {
            // The memorization ratio may fire at a checkpoint without the metric.
            (_, Some(Signal::EarlyStop)) => Verdict::EarlyStop,
            (None, _) => Verdict::NoValue,
            (_, Some(Signal::Resolved)) => Verdict::Resolved,
            _ if decision.unconfirmed => Verdict::Unconfirmed,
            _ if new_best => Verdict::Best,
            _ if wait > 0 => Verdict::Above,
            _ => Verdict::Flat,
        }
    }

    fn text(self, wait: usize, patience: usize) -> String {
        match self {
            Verdict::NoValue => "no value".into(),
            Verdict::Best => "best".into(),
            Verdict::Flat => String::new(),
            Verdict::Above => format!("above {}/{patience}", wait.min(patience)),
            Verdict::Unconfirmed => "turned, unconfirmed".into(),
            Verdict::EarlyStop => "EARLY STOP".into(),
            Verdict::Resolved => "resolved".into(),
        }
    }
}

/// One line of `--json`: a checkpoint.
#[derive(Debug, Serialize)]
struct Row<'a> {
    kind: &'static str,
    step: i64,
    checkpoint: &'a str,
    /// The raw value of the metric.
    value: Option<f64>,
    smoothed: Option<f64>,
    /// The noise of the smoothed value.
    noise: Option<f64>,
    /// The rise over the best that counts as a turn.
    threshold: Option<f64>,
    best_step: Option<i64>,
    best_value: Option<f64>,
    /// Consecutive checkpoints above `best + threshold`.
    wait: usize,
    /// The confirmation signal in this record (`null` without a confirmation, or when the
    /// record does not have it).
    confirm_value: Option<f64>,
    decision: Verdict,
}

/// The last line of `--json`.
#[derive(Debug, Serialize)]
struct Summary {
    kind: &'static str,
    fired: bool,
    /// The step the early stop fired at.
    fired_at_step: Option<i64>,
    /// Why it fired: `turn` or `memorization` (the event's `trigger`).
    trigger: Option<Trigger>,
    /// The best it named when it fired; the best so far when it did not.
    best_step: Option<i64>,
    best_checkpoint: Option<String>,
    best_value: Option<f64>,
    /// The first step at which the curve had turned (fired, or unconfirmed).
    turned_at_step: Option<i64>,
    resolved_at_step: Option<i64>,
    evaluations: usize,
    failures: usize,
    /// The settings replayed, with `confirm: auto` resolved.
    settings: crate::config::EarlyStopSettings,
}

/// Sets `early_stop.KEY=VALUE` overrides on `e`; VALUE is read as YAML (`0.01`, `none`, `ema`).
pub fn apply_overrides(
    e: &EarlyStopConfig,
    set: &[String],
) -> Result<EarlyStopConfig, Vec<Problem>> {
    let problem = |key: &str, message: String| Problem {
        key: key.to_string(),
        message,
    };
    let mut tree = serde_yaml::to_value(e).expect("the section serializes");
    let mut problems = Vec::new();
    for item in set {
        let Some((key, value)) = item.split_once('=') else {
            problems.push(problem(
                "--set",
                format!("takes KEY=VALUE (e.g. early_stop.min_rise=0.01), got `{item}`"),
            ));
            continue;
        };
        let key = key.trim();
        let Some(field) = key.strip_prefix("early_stop.") else {
            problems.push(problem(
                key,
                "only early_stop keys can be set for a replay".into(),
            ));
            continue;
        };
        match serde_yaml::from_str::<serde_yaml::Value>(value) {
            Ok(v) => {
                tree[field] = v;
            }
            Err(err) => problems.push(problem(key, format!("is not a YAML value: {err}"))),
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let parsed: Result<EarlyStopConfig, _> = serde_path_to_error::deserialize(tree);
    let section = parsed.map_err(|err| {
        let path = err.path().to_string();
        let key = if path == "." {
            "early_stop".to_string()
        } else {
            format!("early_stop.{path}")
        };
        vec![problem(&key, err.into_inner().to_string())]
    })?;
    let problems = section.problems();
    if problems.is_empty() {
        Ok(section)
    } else {
        Err(problems)
    }
}

/// `diffmon replay` of the run `run` names (required for a sweep of several runs).
pub fn replay(config_path: &Path, run: Option<&str>, set: &[String], json: bool) -> Result<()> {
    let config = Config::load_without_secrets(config_path)?;
    let mut config = super::eval::choose_run(config, run, config_path)?;
    config.early_stop =
        apply_overrides(&config.early_stop, set).map_err(|problems| ConfigError::Invalid {
            file: format!("{} (with --set)", config_path.display()),
            problems,
        })?;
    let state_dir = config.state_dir();
    let journal = state_dir.join(JOURNAL);
    if !journal.is_file() {
        return Err(NoHistory { path: journal }.into());
    }
    let entries = History::read(&state_dir)?;
    let settings = config.early_stop_resolved();
    let metric = settings.metric;
    let patience = settings.patience;
    let confirm = settings.confirm;
    let mut detector = Detector::new(settings.clone(), DetectorState::default());
    let mut out = super::output::stdout();
    if !json {
        writeln!(
            out,
            "{}: {} smoothed by {} of {}, warmup {}, patience {}, min_rise {}, noise_multiple {}, confirm {} (rise {})",
            journal.display(),
            metric.as_str(),
            settings.smoother.as_str(),
            settings.window,
            settings.warmup,
            settings.patience,
            settings.min_rise,
            settings.noise_multiple,
            confirm.as_str(),
            settings.confirm_rise
        )?;
        writeln!(
            out,
            "{:>9} {:>10} {:>10} {:>10} {:>10}  decision",
            "step", "value", "smoothed", "noise", "threshold"
        )?;
    }
    let mut evaluations = 0;
    let mut best_step = None;
    let mut turned_at = None;
    let mut resolved_at = None;
    let mut confirm_seen = false;
    let mut written: std::io::Result<()> = Ok(());
    let failures = crate::engine::detector::replay(&mut detector, metric, &entries, |replayed| {
        let (record, decision, state) = match replayed {
            Replayed::Evaluation {
                record,
                decision,
                state,
                ..
            } => (record, decision, state),
            Replayed::Resume {
                step,
                checkpoint,
                segment,
                state,
                ..
            } => {
                // The summary is the new segment's: what the detector decides from now on.
                best_step = state.best.as_ref().map(|b| b.step);
                (turned_at, resolved_at) = (None, None);
                let line = if json {
                    serde_json::json!({"kind": "resume", "step": step,
                            "checkpoint": checkpoint, "segment": segment})
                    .to_string()
                } else {
                    format!(
                        "{:>9} resumed from {} (segment {segment}): the detector restarts on the steps up to {step}",
                        step,
                        crate::store::safe_fs::untrusted_text(checkpoint)
                    )
                };
                if written.is_ok() {
                    written = writeln!(out, "{line}");
                }
                return;
            }
        };
        evaluations += 1;
        let value = metric.value(record).filter(|v| v.is_finite());
        let best = state.best.as_ref();
        let new_best = value.is_some() && best.map(|b| b.step) != best_step;
        best_step = best.map(|b| b.step);
        let verdict = Verdict::of(value, decision, new_best, state.wait);
        let stop_by_turn = verdict == Verdict::EarlyStop && state.fired_by == Some(Trigger::Turn);
        if stop_by_turn || verdict == Verdict::Unconfirmed {
            turned_at.get_or_insert(record.step);
        }
        if verdict == Verdict::Resolved {
            resolved_at.get_or_insert(record.step);
        }
        let confirm_value = match confirm {
            crate::config::Confirmation::None => None,
            crate::config::Confirmation::GeneralizationGap => record.generalization_gap,
            crate::config::Confirmation::MemorizationRatio => record.memorization_ratio,
        };
        confirm_seen |= confirm_value.is_some();
        let line = if json {
            serde_json::to_string(&Row {
                kind: "checkpoint",
                step: record.step,
                checkpoint: &record.checkpoint,
                value,
                smoothed: value.and(decision.smoothed),
                noise: decision.noise,
                threshold: decision.threshold,
                best_step: best.map(|b| b.step),
                best_value: best.map(|b| b.value),
                wait: state.wait,
                confirm_value,
                decision: verdict,
            })
            .expect("a row serializes")
        } else {
            let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v:.6}"));
            format!(
                "{:>9} {:>10} {:>10} {:>10} {:>10}  {}",
                record.step,
                num(value),
                num(value.and(decision.smoothed)),
                num(decision.noise),
                num(decision.threshold),
                verdict.text(state.wait, patience)
            )
        };
        if written.is_ok() {
            written = writeln!(out, "{line}");
        }
    });
    written?;
    let s = &detector.state;
    let best = s.fired.as_ref().or(s.best.as_ref());
    let summary = Summary {
        kind: "summary",
        fired: s.fired.is_some(),
        fired_at_step: s.fired_step,
        trigger: s.fired_by,
        best_step: best.map(|b| b.step),
        best_checkpoint: best.map(|b| b.checkpoint.clone()),
        best_value: best.map(|b| b.value),
        turned_at_step: turned_at,
        resolved_at_step: resolved_at,
        evaluations,
        failures,
        settings,
    };
    if json {
        writeln!(out, "{}", serde_json::to_string(&summary)?)?;
    } else {
        writeln!(out, "{}", summary_text(&summary, confirm_seen))?;
    }
    out.flush()?;
    Ok(())
}

/// The summary's lines, for people.
fn summary_text(s: &Summary, confirm_seen: bool) -> String {
    let best = match (s.best_step, &s.best_checkpoint, s.best_value) {
        // The name is escaped as in the logs: whoever writes `run.dir` chooses it.
        (Some(step), Some(c), Some(v)) => format!(
            "best step {step} ({}, smoothed {v:.6})",
            crate::store::safe_fs::untrusted_text(c)
        ),
        _ => "no best: no evaluation has a value".to_string(),
    };
    let mut lines = vec![match s.fired_at_step {
        Some(at) if s.trigger == Some(Trigger::Memorization) => format!(
            "fired at step {at}, where the memorization ratio reached {} (early_stop.memorization_level): {best}",
            s.settings.memorization_level
        ),
        Some(at) => format!("fired at step {at}: {best}"),
        None => format!("did not fire: {best}"),
    }];
    if let (Some(at), None) = (s.turned_at_step, s.fired_at_step) {
        lines.push(format!(
            "turned at step {at}, but {} never confirmed it",
            s.settings.confirm.as_str()
        ));
    }
    if let Some(at) = s.resolved_at_step {
        lines.push(format!(
            "resolved at step {at} (a new best below the fired one)"
        ));
    }
    if s.settings.confirm != crate::config::Confirmation::None && !confirm_seen {
        lines.push(format!(
            "the history has no {}: this confirmation can never pass (--set early_stop.confirm=none to see the turns alone)",
            s.settings.confirm.as_str()
        ));
    }
    lines.push(format!(
        "{} evaluations, {} failures",
        s.evaluations, s.failures
    ));
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_set_early_stop_keys_and_report_bad_ones() {
        let base = EarlyStopConfig::default();
        let e = apply_overrides(
            &base,
            &[
                "early_stop.min_rise=0.01".into(),
                "early_stop.smoother=ema".into(),
                "early_stop.confirm=none".into(),
                "early_stop.window = 5".into(),
            ],
        )
        .unwrap();
        assert_eq!(e.min_rise, 0.01);
        assert_eq!(e.smoother, crate::config::Smoother::Ema);
        assert_eq!(e.confirm, crate::config::Confirm::None);
        assert_eq!(e.window, 5);
        assert_eq!(e.patience, base.patience);
        let keys = |set: &[&str]| -> Vec<String> {
            let set: Vec<String> = set.iter().map(|s| s.to_string()).collect();
            apply_overrides(&base, &set)
                .unwrap_err()
                .iter()
                .map(|p| p.to_string())
                .collect()
        };
        assert_eq!(
            keys(&["early_stop.min_rise=-1"]),
            ["early_stop.min_rise must be ≥ 0, got -1"]
        );
        let unknown = keys(&["early_stop.min_ris=1"]);
        assert!(
            unknown[0].contains("unknown field `min_ris`"),
            "{unknown:?}"
        );
        assert_eq!(
            keys(&["icr.samples=5"]),
            ["icr.samples only early_stop keys can be set for a replay"]
        );
        assert!(keys(&["early_stop.min_rise"])[0].starts_with("--set takes KEY=VALUE"));
        let wrong = keys(&["early_stop.smoother=mean"]);
        assert!(wrong[0].starts_with("early_stop.smoother"), "{wrong:?}");
    }
}
