//! What `diffmon watch` prints on stdout when it ends (docs/design.md §14): per run, the
//! checkpoints evaluated, failed and rotated away (from its history), the early stop (from the
//! stop file: trigger, fired at, the best and its kept copy) or that none stands, and the
//! commands for the report and for resuming; `--json` prints the same as one object.

use crate::alerts::{Event, EventKind};
use crate::config::Config;
use crate::engine::detector::{Detector, DetectorState, replay};
use crate::record::FailureReason;
use crate::store::history::{Entry, History};
use crate::store::safe_fs::{read_bounded, untrusted_text};
use serde::Serialize;
use std::path::Path;

/// The longest stop file read.
const MAX_STOP_FILE: u64 = 64 << 10;

/// One run's end.
#[derive(Debug, Serialize)]
pub struct RunSummary {
    pub run: String,
    /// Entries of its history: evaluations, failures (rotated ones apart) and resumes.
    pub evaluated: usize,
    pub failed: usize,
    pub rotated: usize,
    /// The early stop that stands (the stop file's event), if any.
    pub early_stop: Option<Event>,
    /// Without one: the best checkpoint the detector names so far (step, checkpoint).
    pub best_so_far: Option<(i64, String)>,
    /// `diffmon report …` and, when an early stop stands, `diffmon resume …`.
    pub report: String,
    pub resume: Option<String>,
    /// The history could not be read: why.
    pub unreadable: Option<String>,
}

/// How `watch` ended, for the first line.
#[derive(Debug, Clone, Copy, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HowEnded {
    /// SIGINT or SIGTERM.
    Signal,
    /// The training job ended (`--until-pid`, `--until-file`).
    TrainingEnded,
}

/// Shell quoting for a path in a command line shown to copy.
fn quoted(path: &Path) -> String {
    let s = path.display().to_string();
    if s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-+:=@".contains(&b))
    {
        s
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

impl RunSummary {
    /// The summary of `config`'s run (`config_file`: the file `watch` was given; `in_sweep`:
    /// the run is one of a sweep's, which the report names).
    pub fn of(config: &Config, config_file: &Path, in_sweep: bool) -> RunSummary {
        let file = quoted(config_file);
        let run = config.run_name();
        let mut s = RunSummary {
            report: match in_sweep {
                true => format!("diffmon report --config {file} --run {run} --out report.html"),
                false => format!("diffmon report --config {file} --out report.html"),
            },
            run,
            evaluated: 0,
            failed: 0,
            rotated: 0,
            early_stop: None,
            best_so_far: None,
            resume: None,
            unreadable: None,
        };
        let entries = match History::read(&config.state_dir()) {
            Ok(entries) => entries,
            Err(e) => {
                s.unreadable = Some(e.to_string());
                Vec::new()
            }
        };
        for e in &entries {
            match e {
                Entry::Evaluation { .. } => s.evaluated += 1,
                Entry::Failure { reason, .. } if reason == FailureReason::Rotated.as_str() => {
                    s.rotated += 1
                }
                Entry::Failure { .. } => s.failed += 1,
                Entry::Resume { .. } => {}
            }
        }
        let stop_file = config.run.dir.join(&config.alerts.stop_file);
        s.early_stop = read_bounded(&stop_file, MAX_STOP_FILE)
            .ok()
            .and_then(|b| serde_json::from_slice::<Event>(&b).ok())
            .filter(|e| e.event == EventKind::EarlyStop);
        if s.early_stop.is_some() {
            s.resume = Some(format!("diffmon resume --config {file} --dry-run"));
        } else {
            let settings = config.early_stop_resolved();
            let metric = settings.metric;
            let mut detector = Detector::new(settings, DetectorState::default());
            replay(&mut detector, metric, &entries, |_| {});
            s.best_so_far = detector.state.best.map(|b| (b.step, b.checkpoint.clone()));
        }
        s
    }

    /// The lines printed (names from the run folder escaped, as in the logs).
    pub fn lines(&self) -> Vec<String> {
        let esc = untrusted_text;
        let mut out = vec![format!(
            "  checkpoints: {} evaluated, {} failed, {} rotated away before their evaluation",
            self.evaluated, self.failed, self.rotated
        )];
        if let Some(why) = &self.unreadable {
            out.push(format!("  history: not readable ({})", esc(why)));
        }
        out.push(match (&self.early_stop, &self.best_so_far) {
            (Some(e), _) => format!(
                "  early stop: fired at step {} ({}, {}); best checkpoint: step {}, {}",
                e.current_step,
                e.trigger.as_str(),
                esc(&e.fired_at),
                e.best_step,
                match &e.best_checkpoint_kept {
                    Some(kept) => format!("{}, kept as {}", esc(&e.best_checkpoint), esc(kept)),
                    None => format!(
                        "{} ({})",
                        esc(&e.best_checkpoint),
                        crate::store::keep_best::NOT_KEPT
                    ),
                }
            ),
            (None, Some((step, checkpoint))) => format!(
                "  early stop: none stands; the best so far is step {step}, {}",
                esc(checkpoint)
            ),
            (None, None) => "  early stop: none stands".into(),
        });
        out.push(format!("  report: {}", self.report));
        if let Some(resume) = &self.resume {
            out.push(format!("  resume from the best: {resume}"));
        }
        out
    }
}

/// The text `watch` prints at its end.
pub fn text(how: HowEnded, runs: &[RunSummary]) -> String {
    let why = match how {
        HowEnded::Signal => "stopped by a signal",
        HowEnded::TrainingEnded => "the training job ended",
    };
    let mut out = String::new();
    for r in runs {
        out.push_str(&format!("diffmon: run `{}` ended ({why})\n", r.run));
        for line in r.lines() {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// `watch --json`: one object, `{"ended", "runs": [...]}`.
pub fn json(how: HowEnded, runs: &[RunSummary]) -> String {
    serde_json::json!({ "ended": how, "runs": runs }).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_quoted_for_the_shell_only_when_needed() {
        assert_eq!(
            quoted(Path::new("/runs/exp1/diffmon.yaml")),
            "/runs/exp1/diffmon.yaml"
        );
        assert_eq!(
            quoted(Path::new("/runs/my exp/d.yaml")),
            "'/runs/my exp/d.yaml'"
        );
        assert_eq!(quoted(Path::new("/r/it's.yaml")), r"'/r/it'\''s.yaml'");
    }
}
