//! A compiled package on trial: one that crashes libtorch's loader or its kernels must not crash
//! every start of the daemon, nor cost the checkpoints it was running on (docs/design.md §11,
//! "The compiled network").
//!
//! A package is native code, and where it crashes (libtorch's AOTInductor loader on CUDA with
//! torch 2.11, a sidecar that no longer fits its package, a kernel that fails on the first
//! checkpoint's weights), it takes the process down: at the start no checkpoint is in flight, so
//! the crash marker blames nothing and a service manager's restart loads the package and dies
//! again, for ever; in the first evaluation the marker would blame the checkpoint, which is
//! then lost. So a package is on trial until it has run one evaluation through, and the trial
//! counts the starts that died while the package was running, `<state_dir>/compiled-trial`:
//! the package's path, size and modification time, and that count. The package runs, and a
//! death counts, in two phases:
//!
//! 1. from before the evaluator loads it to the start's contract check, its first forward
//!    ([`begin`], then [`pause`]);
//! 2. from the start of its first evaluation of a checkpoint to the evaluation's end
//!    ([`resume`], then [`end`] once one evaluation has succeeded; a failed one pauses the
//!    trial, which resumes with the next). A crash in this phase is the package's: the marker
//!    names the package on trial ([`crate::store::crash::InFlight::package_on_trial`]) and the
//!    next start evaluates the checkpoint again instead of recording it as crashed.
//!
//! While the daemon waits between the two, nothing of the package runs and a death does not
//! count. A start that finds the same package at [`MAX_STARTS`] deaths refuses it: under
//! `model.compiled: auto` TorchScript runs (and evaluates the checkpoint the package died on)
//! with a warning, under a path the start fails naming the package. The refusal holds until the
//! package changes (rebuilt: another size or time) or the file is deleted. Two deaths, not one,
//! so that a single kill (an operator, the out-of-memory killer) does not cost the package.
//!
//! The trial lives in the daemon's first run's state folder ([`keep_in`]: a sweep's runs that
//! share the network share its trial, and `check-config` reads the same file), or, for
//! `diffmon eval` in a job of the jobs executor, in the run's state folder ([`in_job`]: the
//! job's folder names the package while it runs, and the daemon submits a job the package
//! killed again). A `diffmon eval` run by hand (a one-off
//! process whose crash loops nothing) has no trial. The files are replaced atomically without
//! following a link, and read bounded, as data ([`safe_fs`]).

use crate::store::history::CheckpointKey;
use crate::store::safe_fs;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The trial's file name inside the state folder.
pub const FILE: &str = "compiled-trial";
/// In a job's folder, while the package runs on trial in the job's `diffmon eval`: the
/// package's path. A job that dies leaving it died of the package ([`in_job`]).
pub const JOB_FILE: &str = "package-on-trial";
/// Starts that died while the same package was running on trial, after which it is refused.
pub const MAX_STARTS: u64 = 2;
/// The most of the file that is read (a path of `PATH_MAX` bytes escaped as JSON fits).
const MAX_BYTES: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Trial {
    /// The package as it was when the trial began (a rebuilt one is another package).
    package: CheckpointKey,
    /// Starts that died while the package was running, this one included while it runs.
    starts: u64,
}

/// The trial this process began and has not ended.
struct Open {
    /// The state folder that holds its file.
    dir: PathBuf,
    /// The job's folder, for `diffmon eval` in a job ([`in_job`]).
    job: Option<PathBuf>,
    /// The package's path as `model.compiled` gave it.
    path: PathBuf,
    package: CheckpointKey,
    /// Starts that died while the package ran, before this one.
    died: u64,
    /// The package is running (loaded, checked, evaluating): a death now counts.
    running: bool,
}

static ON_TRIAL: Mutex<Option<Open>> = Mutex::new(None);
/// Where trials are kept in this process ([`keep_in`]), and for `diffmon eval` in a job, the
/// job's folder ([`in_job`]); `None`: no trial.
static FOLDERS: Mutex<Option<(PathBuf, Option<PathBuf>)>> = Mutex::new(None);

fn on_trial() -> std::sync::MutexGuard<'static, Option<Open>> {
    ON_TRIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Puts `package` on trial before it is loaded (it runs from now on: phase 1). `Err` with the
/// reason when [`MAX_STARTS`] starts died while it ran: the package is not to be loaded.
/// Where no folder keeps trials (`diffmon eval` by hand), or the file cannot be written (a
/// warning), the package is loaded without a trial.
pub fn begin(package: &Path) -> Result<(), String> {
    let folders = FOLDERS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let Some((dir, job)) = folders else {
        return Ok(());
    };
    if let Some(open) = Open::begin(dir, job, package)? {
        *on_trial() = Some(open);
    }
    Ok(())
}

/// `diffmon eval` runs in a job of `diffmon watch`'s jobs executor (`src/daemon/jobs/`): the
/// package's trial is the run's, in its state folder `state_dir` (which the job's machine
/// shares), and while the package runs, [`JOB_FILE`] in `job_folder` names it, so that the daemon
/// tells a job the package killed from one the checkpoint did, and submits it again (the trial
/// refuses the package after [`MAX_STARTS`] such deaths; TorchScript then evaluates the
/// checkpoint under `auto`).
pub fn in_job(state_dir: &Path, job_folder: &Path) {
    *FOLDERS.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((state_dir.to_path_buf(), Some(job_folder.to_path_buf())));
}

/// Did the job whose folder is `job_folder` end while a compiled package ran on trial in it
/// ([`JOB_FILE`] left there; a link in its place does not count)? Then the package killed it.
pub fn ran_in_job(job_folder: &Path) -> bool {
    std::fs::symlink_metadata(job_folder.join(JOB_FILE)).is_ok_and(|m| m.is_file())
}

/// The daemon keeps its trials in `state_dir`, the state folder of its first run (a later call
/// changes nothing): one folder for the process, whichever run's evaluator loads the package.
pub fn keep_in(state_dir: &Path) {
    FOLDERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(|| (state_dir.to_path_buf(), None));
}

/// The package on trial has stopped running without a crash (its contract check passed, an
/// evaluation failed, the daemon is stopping): a death from now on is not its own.
pub fn pause() {
    if let Some(open) = on_trial().as_mut() {
        open.set_running(false);
    }
}

/// The evaluator starts on a checkpoint with `package` (the compiled package it runs, `None`
/// for TorchScript): when that package is on trial, a death from now on is counted against it
/// (phase 2), and its path is returned for the crash marker. `None` when it is not on trial.
pub fn resume(package: Option<&Path>) -> Option<String> {
    let mut guard = on_trial();
    let open = guard
        .as_mut()
        .filter(|o| Some(o.path.as_path()) == package)?;
    open.set_running(true);
    Some(open.path.display().to_string())
}

/// The evaluation the package on trial ran ([`resume`]) is over: run through (`passed`), the
/// trial is passed ([`end`]); failed, it is paused until the next ([`pause`]).
pub fn settle(passed: bool) {
    if passed { end() } else { pause() }
}

/// The trial this process began is over without a crash: the package has run an evaluation
/// through, or it was refused with an error (corrupt, not this architecture's). Its file is
/// removed. Nothing to do where no trial is open (no folder keeps trials, no package, or one
/// refused by its trial: that file stays).
pub fn end() {
    if let Some(open) = on_trial().take() {
        open.close();
    }
}

impl Open {
    /// The trial of `package` in `dir`, running; `Ok(None)` where it cannot be recorded.
    fn begin(dir: PathBuf, job: Option<PathBuf>, package: &Path) -> Result<Option<Open>, String> {
        let Ok(key) = CheckpointKey::of(package) else {
            return Ok(None); // loading it gives the error that names it
        };
        let died = died_in(&dir, &key);
        if died >= MAX_STARTS {
            return Err(refusal(died, &dir));
        }
        let open = Open {
            dir,
            job,
            path: package.to_path_buf(),
            package: key,
            died,
            running: true,
        };
        if !open.record() {
            return Ok(None);
        }
        open.mark_job(true);
        Ok(Some(open))
    }

    fn set_running(&mut self, running: bool) {
        if self.running != running {
            self.running = running;
            self.record();
            self.mark_job(running);
        }
    }

    /// Writes what a death now would leave: the deaths before this start, plus this one while
    /// the package runs (no file where that is none). `false`, with a warning, where it cannot.
    fn record(&self) -> bool {
        let path = self.dir.join(FILE);
        let starts = self.died + u64::from(self.running);
        let written = if starts == 0 {
            remove(&path)
        } else {
            write(
                &path,
                &Trial {
                    package: self.package.clone(),
                    starts,
                },
            )
        };
        if let Err(e) = &written {
            tracing::warn!(
                "cannot write {} ({e}): a compiled package that crashes the process would crash every start",
                shown_file(&self.dir)
            );
        }
        written.is_ok()
    }

    /// In a job: names the package in the job's folder while it runs ([`JOB_FILE`]).
    fn mark_job(&self, running: bool) {
        let Some(job) = &self.job else { return };
        let path = job.join(JOB_FILE);
        let marked = if running {
            safe_fs::atomic_write(&path, self.path.display().to_string().as_bytes())
        } else {
            remove(&path)
        };
        if let Err(e) = marked {
            tracing::warn!(
                "cannot write {} ({e}): a crash of the compiled package would be the checkpoint's",
                safe_fs::untrusted(&path)
            );
        }
    }

    /// The trial is passed: its files are removed.
    fn close(self) {
        self.mark_job(false);
        // The file holds this trial: one daemon per state folder, one trial at a time.
        if let Err(e) = remove(&self.dir.join(FILE)) {
            tracing::warn!("cannot remove {} ({e})", shown_file(&self.dir))
        }
    }
}

/// What `check-config` says: the reason the trial in `state_dir` refuses `package` (a start
/// would not load it), `None` when it does not.
pub fn refused(state_dir: &Path, package: &Path) -> Option<String> {
    let key = CheckpointKey::of(package).ok()?;
    let died = died_in(state_dir, &key);
    (died >= MAX_STARTS).then(|| refusal(died, state_dir))
}

/// How many starts died while `package` ran on trial in `dir`.
fn died_in(dir: &Path, package: &CheckpointKey) -> u64 {
    read(&dir.join(FILE))
        .filter(|t| t.package == *package)
        .map_or(0, |t| t.starts)
}

fn refusal(starts: u64, dir: &Path) -> String {
    format!(
        "the last {starts} starts of diffmon died while it was being loaded or run for the first \
         time (a crash in libtorch's loader or in its kernels, or a kill: each counts), so it is \
         not loaded again until it is rebuilt (or {} is deleted to try it once more)",
        shown_file(dir)
    )
}

/// The trial file of `dir`, for messages: where the held state folder is ([`safe_fs::untrusted`]).
fn shown_file(dir: &Path) -> String {
    safe_fs::untrusted(&dir.join(FILE))
}

/// The trial in `path`, `None` when absent, unreadable or malformed (then overwritten).
fn read(path: &Path) -> Option<Trial> {
    serde_json::from_slice(&safe_fs::read_bounded(path, MAX_BYTES).ok()?).ok()
}

/// Removes the trial file (a link in its place is removed, not followed); absent is removed.
fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Replaces the trial file atomically, following no link.
fn write(path: &Path, trial: &Trial) -> std::io::Result<()> {
    safe_fs::atomic_write(
        path,
        &serde_json::to_vec(trial).expect("a trial serializes"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trial_file_round_trips_and_refuses_links_and_junk() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("model.pt2");
        std::fs::write(&pkg, b"a package").unwrap();
        let path = dir.path().join(FILE);
        let trial = Trial {
            package: CheckpointKey::of(&pkg).unwrap(),
            starts: 1,
        };
        write(&path, &trial).unwrap();
        assert_eq!(read(&path), Some(trial.clone()));
        // Junk reads as no trial; a link in the file's place is replaced, its target untouched.
        std::fs::write(&path, b"{not json").unwrap();
        assert_eq!(read(&path), None);
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, b"keep").unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert_eq!(read(&path), None, "a link was followed");
        write(&path, &trial).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"keep");
        assert_eq!(read(&path), Some(trial));
    }

    /// A start that dies while the package runs (loading, or in its first evaluation) counts;
    /// one that dies while it waits between the two does not; at two deaths it is refused, until
    /// it is rebuilt; a trial run through removes its file.
    #[test]
    fn only_deaths_while_the_package_runs_count() {
        let dir = tempfile::tempdir().unwrap();
        let pkg = dir.path().join("model.pt2");
        std::fs::write(&pkg, b"a package").unwrap();
        let starts = || read(&dir.path().join(FILE)).map(|t| t.starts);
        let begin = || Open::begin(dir.path().to_path_buf(), None, &pkg);

        // Dies while waiting for a checkpoint, after its contract check: not counted.
        let mut open = begin().unwrap().unwrap();
        assert_eq!(starts(), Some(1));
        open.set_running(false);
        assert_eq!(starts(), None);
        drop(open);

        // Dies in its first evaluation, twice: counted, then refused.
        for died in 1..=2 {
            let mut open = begin().unwrap().unwrap();
            assert_eq!(starts(), Some(died));
            open.set_running(false);
            assert_eq!(starts(), Some(died - 1).filter(|&n| n > 0));
            open.set_running(true);
            assert_eq!(starts(), Some(died));
        }
        let refused_now = begin().err().unwrap();
        assert!(refused_now.contains("the last 2 starts"), "{refused_now}");
        assert_eq!(refused(dir.path(), &pkg), Some(refused_now));

        // Rebuilt: a trial of its own, passed and removed.
        std::fs::write(&pkg, b"a package, rebuilt").unwrap();
        assert_eq!(refused(dir.path(), &pkg), None);
        let open = begin().unwrap().unwrap();
        assert_eq!(starts(), Some(1));
        open.close();
        assert_eq!(starts(), None);
    }

    /// In a job, the job's folder names the package while it runs, and not otherwise.
    #[test]
    fn a_job_folder_names_the_package_while_it_runs() {
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("job");
        std::fs::create_dir(&job).unwrap();
        let pkg = dir.path().join("model.pt2");
        std::fs::write(&pkg, b"a package").unwrap();
        let named = || {
            let text = std::fs::read_to_string(job.join(JOB_FILE)).ok();
            assert_eq!(ran_in_job(&job), text.is_some());
            text
        };
        let mut open = Open::begin(dir.path().to_path_buf(), Some(job.clone()), &pkg)
            .unwrap()
            .unwrap();
        let shown = pkg.display().to_string();
        assert_eq!(named().as_ref(), Some(&shown));
        open.set_running(false);
        assert_eq!(named(), None);
        open.set_running(true);
        assert_eq!(named().as_ref(), Some(&shown));
        open.close();
        assert_eq!(named(), None);
        assert_eq!(read(&dir.path().join(FILE)), None, "the trial is passed");
        std::os::unix::fs::symlink(&pkg, job.join(JOB_FILE)).unwrap();
        assert!(!ran_in_job(&job), "a link in its place counts");
    }
}
