//! `diffmon resume` (docs/design.md §9, "Resume"): after the early stop, makes the run ready to
//! train on from the best checkpoint. With the daemon stopped (it takes the state folder's
//! lock), it
//!
//! 1. picks the checkpoint: the best the early stop named (or `--step`, an evaluation on the
//!    run's current branch);
//! 2. puts it back where the training job resumes from, its own path in `run.dir`, from the
//!    copy `early_stop.keep_best` kept when rotation deleted it (hard links, else a copy with
//!    the files' times; never over anything);
//! 3. moves the later checkpoints of the abandoned branch (steps after it) aside, into
//!    `<state_dir>/set-aside/segment-<n>/`, so that the training job's "latest checkpoint" and
//!    its rotation see the resumed branch only (`--keep-later` leaves them);
//! 4. removes the stop file;
//! 5. appends a `resume` entry to the history: what follows is a new segment, which the detector
//!    follows from the lineage up to the resume step (`engine::detector::replay`); the next
//!    `watch` sends a `resolved` event for the early stop that stood.
//!
//! It prints what it did and how each training stack resumes from that checkpoint.

use super::eval::select_run;
use crate::config::Config;
use crate::report::Snapshot;
use crate::store::history::{CheckpointKey, Entry, History, JOURNAL, segments};
use crate::store::keep_best;
use crate::store::lock::{LockError, StateLock};
use crate::store::safe_fs::{create_private_dir, rename_noreplace, untrusted};
use anyhow::Result;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The folder of the state folder that holds the abandoned branches' checkpoints.
pub const SET_ASIDE_DIR: &str = "set-aside";

#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// Nothing to resume from, or a `--step` that names no evaluation (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The daemon runs, or the checkpoint cannot be put back (exit 1).
    #[error("{0}")]
    Failed(String),
}

impl ResumeError {
    pub fn is_usage(&self) -> bool {
        matches!(self, ResumeError::Usage(_))
    }
}

/// What `diffmon resume` was asked.
pub struct Request<'a> {
    pub config: &'a Path,
    pub run: Option<&'a str>,
    pub step: Option<i64>,
    pub keep_later: bool,
    pub dry_run: bool,
}

/// The checkpoint to resume from.
struct Point {
    step: i64,
    checkpoint: PathBuf,
    /// Its key when it was evaluated.
    key: CheckpointKey,
    /// How it was chosen, for the report.
    why: String,
}

/// Runs `diffmon resume`; returns the report to print.
pub fn resume(request: &Request) -> Result<String> {
    let config = select_run(Config::load_without_secrets(request.config)?, request.run)
        .map_err(ResumeError::Usage)?;
    let state_dir = config.state_dir();
    if !state_dir.join(JOURNAL).is_file() {
        return Err(ResumeError::Usage(format!(
            "{}: no history: `diffmon watch` with this config has not recorded any checkpoint, so there is nothing to resume from",
            state_dir.join(JOURNAL).display()
        ))
        .into());
    }
    // Held until the end: no daemon may record while the history gets its new segment.
    let lock = match request.dry_run {
        true => None,
        false => Some(StateLock::acquire(&state_dir, &config.run.dir).map_err(|e| match e {
            LockError::Held { .. } => ResumeError::Failed(format!(
                "{e}\nstop `diffmon watch` for this run first (SIGTERM), run `diffmon resume` again, then start the training job from the restored checkpoint and `diffmon watch` again"
            ))
            .into(),
            e => anyhow::Error::from(e),
        })?),
    };
    // Under the lock the history is opened to be appended to; a dry run only reads it. What is
    // written into the state folder goes through the lock's handle on it, never its path.
    let mut history = match &lock {
        Some(lock) => Some(History::open(lock.state().path())?),
        None => None,
    };
    let read;
    let entries = match &history {
        Some(h) => h.entries(),
        None => {
            read = History::read(&state_dir)?;
            &read
        }
    };
    // Run again with nothing evaluated since the last resume: that resume stands. (Its
    // detector's best on the shortened lineage could be an earlier step, and the checkpoint
    // just put back would be set aside.)
    if request.step.is_none()
        && let Some(Entry::Resume { step, .. }) = entries.last()
    {
        return Ok(format!(
            "run `{}` was resumed from step {step}, and nothing has been evaluated since: nothing to do (`--step N` resumes from another evaluated step)\n",
            config.run_name()
        ));
    }
    let point = resume_point(&config, entries, request.step)?;
    let segment = segments(entries).last().map_or(1, |(s, _)| s);
    let held = lock.as_ref().map(|l| l.state().path().to_path_buf());
    let mut report = format!(
        "{}run `{}` from step {} ({}); segment {} of its history starts\n",
        if request.dry_run {
            "would resume "
        } else {
            "resumed "
        },
        config.run_name(),
        point.step,
        point.why,
        segment + 1
    );

    // The stop file is removed last: one that cannot be (a folder in its place) stops the
    // resume before anything is done, the dry run too.
    let stop = config.run.dir.join(&config.alerts.stop_file);
    if std::fs::symlink_metadata(&stop).is_ok_and(|m| m.is_dir()) {
        return Err(ResumeError::Failed(format!(
            "{}: a folder where the stop file goes (alerts.stop_file); nothing was done: remove it, then run `diffmon resume` again",
            untrusted(&stop)
        ))
        .into());
    }
    // The kept copy is read through the lock's handle on the state folder: the folder's path,
    // in a run folder others may write, could name another folder by now.
    let restored = put_back(
        held.as_deref().unwrap_or(&state_dir),
        &point,
        request.dry_run,
        &mut report,
    )?;
    let set_aside = if request.keep_later {
        Vec::new()
    } else {
        let (moved, left) = set_aside(
            &config,
            (&state_dir, held.as_deref()),
            point.step,
            segment,
            &mut report,
        );
        if !left.is_empty() {
            // Not the whole job: the training job would resume with the abandoned branch's
            // later checkpoints beside it (its "latest" is one of them). Nothing more is done.
            let done = report.split_once('\n').map_or("", |(_, rest)| rest);
            return Err(ResumeError::Failed(format!(
                "resume of run `{}` from step {} not complete; done:\n{done}cannot move {} of the abandoned branch aside into {} (the lines \
                 above say why: another file system, where the state folder must be on the run \
                 folder's file system to move them, or a name set aside before; they are left in \
                 place), so the resume is not complete: the stop file and the \
                 history are unchanged{}. Move {} out of the run folder yourself (or pass \
                 --keep-later to leave them), then run `diffmon resume` again.",
                config.run_name(),
                point.step,
                left.join(", "),
                untrusted(&state_dir.join(SET_ASIDE_DIR)),
                if moved.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; moved aside already: {}",
                        moved
                            .iter()
                            .map(|m| untrusted(Path::new(m)))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                },
                if left.len() == 1 { "it" } else { "them" }
            ))
            .into());
        }
        moved
    };
    if std::fs::symlink_metadata(&stop).is_ok() {
        if !request.dry_run {
            std::fs::remove_file(&stop).map_err(|e| {
                ResumeError::Failed(format!(
                    "{}: cannot remove the stop file: {e}",
                    stop.display()
                ))
            })?;
        }
        let done = if request.dry_run {
            "would be removed"
        } else {
            "removed"
        };
        let _ = writeln!(report, "  stop file   {} {done}", untrusted(&stop));
    }
    if let Some(history) = &mut history {
        history.append(Entry::Resume {
            at: crate::record::rfc3339_utc(std::time::SystemTime::now()),
            step: point.step,
            checkpoint: point.checkpoint.display().to_string(),
            restored,
            set_aside,
        })?;
        history.write_hdf5()?;
    }
    // Its shape from what is there, or from the kept copy a dry run would restore.
    let is_dir = point.checkpoint.is_dir()
        || (!point.checkpoint.exists()
            && keep_best::lookup(&state_dir, &point.checkpoint).is_some_and(|k| k.is_dir()));
    report.push_str(&how_to_resume(&point.checkpoint, is_dir));
    let _ = write!(
        report,
        "Then start `diffmon watch --config {}` again: it follows the new segment, from the steps up to {} of the branch it left.",
        request.config.display(),
        point.step
    );
    Ok(report)
}

/// The checkpoint to resume from: `step`'s on the run's current branch, or the best the early
/// stop named, or the best so far.
fn resume_point(config: &Config, entries: &[Entry], step: Option<i64>) -> Result<Point> {
    let early_stop = config.early_stop_resolved();
    let snapshot = Snapshot::replay(&config.run_name(), early_stop.metric, early_stop, entries);
    let (wanted, why) = match (step, &snapshot.fired) {
        (Some(step), _) => {
            let row = snapshot.lineage().filter(|r| r.step == step).last();
            let Some(row) = row else {
                let steps: Vec<String> = snapshot.lineage().map(|r| r.step.to_string()).collect();
                return Err(ResumeError::Usage(format!(
                    "--step {step}: no evaluation of that step on the run's current branch (evaluated: {})",
                    if steps.is_empty() { "none".into() } else { steps.join(", ") }
                ))
                .into());
            };
            (row.checkpoint.clone(), "asked with --step".to_string())
        }
        (None, Some((best, at))) if !snapshot.resolved => (
            best.checkpoint.clone(),
            format!("the best checkpoint the early stop named at step {at}"),
        ),
        (None, _) => match &snapshot.best {
            Some(best) => (
                best.checkpoint.clone(),
                "the best so far: the early stop has not fired".to_string(),
            ),
            None => {
                return Err(ResumeError::Usage(
                    "the history has no evaluation with a value: nothing to resume from".into(),
                )
                .into());
            }
        },
    };
    // Its evaluation: the last one of that checkpoint (a rewritten checkpoint is evaluated anew).
    let found = entries.iter().rev().find_map(|e| match e {
        Entry::Evaluation { key, record, .. } if record.checkpoint == wanted => {
            Some((record.step, key.clone()))
        }
        _ => None,
    });
    let (step, key) = found.expect("the snapshot's checkpoints come from the history");
    Ok(Point {
        step,
        checkpoint: PathBuf::from(wanted),
        key,
        why,
    })
}

/// Makes sure the checkpoint is at its own path: there and unchanged, or restored from the kept
/// copy. Returns the restored unit's key.
fn put_back(
    state_dir: &Path,
    point: &Point,
    dry_run: bool,
    report: &mut String,
) -> Result<Option<CheckpointKey>> {
    let path = &point.checkpoint;
    let shown = untrusted(path);
    // A kept file shares its bytes with the checkpoint where it is a hard link: a job that
    // saved over the checkpoint in place (torch.save truncates) changed both.
    let kept = keep_best::lookup(state_dir, path);
    let kept_changed = kept.as_ref().filter(|kept| {
        crate::store::history::CheckpointKey::of(kept)
            .is_ok_and(|k| (k.size, k.mtime_ns) != (point.key.size, point.key.mtime_ns))
    });
    if std::fs::symlink_metadata(path).is_ok() {
        let unchanged = crate::store::unit::key(path).is_ok_and(|k| k == point.key)
            || (kept_changed.is_none() && crate::store::restore::is_copy_of_kept(state_dir, path));
        if let (false, Some(kept)) = (unchanged, kept_changed) {
            return Err(ResumeError::Failed(format!(
                "{shown}: not the checkpoint evaluated at step {step}, and the copy diffmon kept, {}, is no longer the file evaluated at step {step} either (a kept link shares its file with the checkpoint, and the training job saved over the checkpoint in place): there is nothing to resume from at this step",
                untrusted(kept),
                step = point.step
            ))
            .into());
        }
        if !unchanged {
            return Err(ResumeError::Failed(format!(
                "{shown}: not the checkpoint evaluated at step {} (it changed since); move it away and run `diffmon resume` again to put back the copy diffmon kept, if it kept one",
                point.step
            ))
            .into());
        }
        let _ = writeln!(report, "  checkpoint  {shown} (in place)");
        return Ok(None);
    }
    let Some(kept) = kept.as_ref() else {
        return Err(ResumeError::Failed(format!(
            "{shown}: deleted (by the training job's rotation?), and diffmon keeps no copy of it: it keeps the best checkpoint only, with early_stop.keep_best"
        ))
        .into());
    };
    if kept_changed.is_some() {
        return Err(ResumeError::Failed(format!(
            "{shown}: the copy diffmon kept, {}, is no longer the file evaluated at step {} (its size or time changed: a kept link shares its file with the checkpoint, and the training job saved over the checkpoint in place); it is not restored",
            untrusted(kept),
            point.step
        ))
        .into());
    }
    if dry_run {
        let _ = writeln!(
            report,
            "  checkpoint  {shown} (would be restored from {})",
            untrusted(kept)
        );
        return Ok(None);
    }
    // A resume killed while it copied left its partial copy beside the checkpoint.
    let leftovers = crate::store::restore::remove_leftovers(path);
    if leftovers > 0 {
        let _ = writeln!(
            report,
            "  removed     the partial copy of {shown} an interrupted resume left ({leftovers})"
        );
    }
    let done = crate::store::restore::restore(kept, path)
        .map_err(|e| ResumeError::Failed(format!("cannot restore the kept copy: {e}")))?;
    let _ = writeln!(
        report,
        "  checkpoint  {shown} (restored from {}: {} files linked, {} copied)",
        untrusted(kept),
        done.linked,
        done.copied
    );
    Ok(crate::store::unit::key(path).ok())
}

/// Moves the checkpoints of `run.dir` with a step after `step` into
/// `<state_dir>/set-aside/segment-<segment>/`; returns their new paths (with those a killed resume
/// of this segment moved there already), and the names of those
/// that could not be moved (another file system: they stay, with a line in the report).
/// `state_dir` is (its path, the lock's handle on it); without a handle (a dry run) nothing
/// moves.
fn set_aside(
    config: &Config,
    (state_dir, held): (&Path, Option<&Path>),
    step: i64,
    segment: u32,
    report: &mut String,
) -> (Vec<String>, Vec<String>) {
    let later: Vec<(i64, PathBuf)> = checkpoints_in(config, &config.run.dir)
        .into_iter()
        .filter(|(s, _)| *s > step)
        .collect();
    let folder = format!("{SET_ASIDE_DIR}/segment-{segment}");
    let dir = state_dir.join(&folder);
    // What a resume of this segment that was interrupted moved aside already: part of this
    // resume's record (one that completes starts the next segment, whose folder is new).
    let earlier = checkpoints_in(config, &dir);
    if !earlier.is_empty() {
        let names: Vec<String> = earlier.iter().map(|(_, p)| file_name(p)).collect();
        let _ = writeln!(
            report,
            "  set aside   {} by an interrupted resume, in {}",
            names.join(", "),
            untrusted(&dir)
        );
    }
    let shown = |moved: Vec<(i64, PathBuf)>| -> Vec<String> {
        moved
            .into_iter()
            .map(|(_, p)| p.display().to_string())
            .collect()
    };
    if later.is_empty() {
        return (shown(earlier), Vec::new());
    }
    // Made through the lock's handle on the state folder, once.
    let target = held.map(|held| {
        let target = held.join(&folder);
        create_private_dir(&held.join(SET_ASIDE_DIR))
            .and_then(|()| create_private_dir(&target))
            .map(|()| target)
    });
    let mut moved = earlier;
    let mut names = Vec::new();
    let mut left = Vec::new();
    for (s, path) in &later {
        let Some(name) = path.file_name() else {
            continue;
        };
        if let Some(target) = &target {
            let done = match target {
                Ok(target) => rename_noreplace(path, &target.join(name)),
                Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
            };
            if let Err(e) = done {
                let _ = writeln!(
                    report,
                    "  left        {} in place: cannot move it aside ({e})",
                    untrusted(path)
                );
                left.push(untrusted(Path::new(name)));
                continue;
            }
        }
        names.push(name.to_string_lossy().into_owned());
        moved.push((*s, dir.join(name)));
    }
    if !names.is_empty() {
        let _ = writeln!(
            report,
            "  set aside   {} (after step {step}, the branch left) {} {}",
            names.join(", "),
            if held.is_some() {
                "moved to"
            } else {
                "would go to"
            },
            untrusted(&dir)
        );
    }
    // In step order, those a killed resume moved among them.
    moved.sort();
    (shown(moved), left)
}

/// The checkpoints in `dir` (by `checkpoints.pattern`, hidden names left out), by step.
fn checkpoints_in(config: &Config, dir: &Path) -> Vec<(i64, PathBuf)> {
    let c = &config.checkpoints;
    let mut found: Vec<(i64, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let s = c.step_regex.step_in(&name)?;
            (c.pattern.is_match(&name) && !name.starts_with('.')).then(|| (s, e.path()))
        })
        .collect();
    found.sort();
    found
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// How the training stacks resume from `checkpoint`, by its shape (`is_dir`: a folder).
fn how_to_resume(checkpoint: &Path, is_dir: bool) -> String {
    let name = checkpoint
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let shown = untrusted(checkpoint);
    let mut text = String::from("Resume training from it:\n");
    if is_dir {
        let _ = writeln!(
            text,
            "  accelerate (diffusers' train_*.py): --resume_from_checkpoint {name}\n    \
             (its output_dir is the run folder; in your own loop: accelerator.load_state(\"{shown}\"))"
        );
        let _ = writeln!(
            text,
            "  torch.distributed.checkpoint: dcp.load(state_dict, checkpoint_id=\"{shown}\")"
        );
    } else if name.ends_with(".ckpt") {
        let _ = writeln!(
            text,
            "  PyTorch Lightning: trainer.fit(model, datamodule, ckpt_path=\"{shown}\")"
        );
    } else {
        let _ = writeln!(
            text,
            "  your training code's resume, from {shown} (e.g. torch.load(\"{shown}\", weights_only=True))"
        );
    }
    text
}
