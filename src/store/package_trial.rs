//! A compiled package on trial: one that crashes libtorch's loader or its own first forward
//! must not crash every start of the daemon (docs/design.md §11, "The compiled network").
//!
//! A package is native code, and where it crashes (libtorch's AOTInductor loader on CUDA with
//! torch 2.11, a sidecar that no longer fits its package), it takes the process down before any
//! checkpoint is in flight: the crash marker blames nothing, and a service manager's restart
//! loads the package and dies again, for ever. So before the evaluator loads a package it puts
//! it on trial, `<state_dir>/compiled-trial`: the package's path, size and modification time,
//! and how many starts began the trial. Once the package has run its first forward (the
//! contract check at start) the trial has passed and the file is removed. A start that finds
//! the same package on trial at [`MAX_STARTS`] starts refuses it: under `model.compiled: auto`
//! TorchScript runs with a warning, under a path the start fails naming the package. The
//! refusal holds until the package changes (rebuilt: another size or time) or the file is
//! deleted. Two starts, not one, so that a single kill during the start (an operator, the
//! out-of-memory killer) does not cost the package.
//!
//! The trial lives in the state folder the crash marker was armed for
//! ([`crate::store::crash::armed_dir`]); where none is (`diffmon eval`, a one-off process whose
//! crash loops nothing) there is no trial. The file is replaced atomically without following a
//! link, and read bounded, as data ([`safe_fs`]).

use crate::store::history::CheckpointKey;
use crate::store::safe_fs;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The trial's file name inside the state folder.
pub const FILE: &str = "compiled-trial";
/// Starts that began the trial of the same package without passing it, after which it is
/// refused.
pub const MAX_STARTS: u64 = 2;
/// The most of the file that is read (a path of `PATH_MAX` bytes escaped as JSON fits).
const MAX_BYTES: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Trial {
    /// The package as it was when the trial began (a rebuilt one is another package).
    package: CheckpointKey,
    /// Starts that began this trial.
    starts: u64,
}

/// The state folder of the trial this process began and has not ended yet.
static ON_TRIAL: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Puts `package` on trial before it is loaded. `Err` with the reason when the last
/// [`MAX_STARTS`] starts began its trial and none passed it: the package is not to be loaded.
/// Without an armed state folder, or where the file cannot be written (a warning), the package
/// is loaded without a trial.
pub fn begin(package: &Path) -> Result<(), String> {
    let Some(dir) = crate::store::crash::armed_dir() else {
        return Ok(());
    };
    let Ok(key) = CheckpointKey::of(package) else {
        return Ok(()); // loading it gives the error that names it
    };
    let starts = starts_of(&dir, &key);
    if starts >= MAX_STARTS {
        return Err(refusal(starts, &dir));
    }
    let trial = Trial {
        package: key,
        starts: starts + 1,
    };
    match write(&dir.join(FILE), &trial) {
        Ok(()) => *ON_TRIAL.lock().unwrap_or_else(|e| e.into_inner()) = Some(dir),
        Err(e) => tracing::warn!(
            "cannot write {} ({e}): a compiled package that crashes the process would crash every start",
            shown_file(&dir)
        ),
    }
    Ok(())
}

/// What `check-config` says: the reason the trial in `state_dir` refuses `package` (a start
/// would not load it), `None` when it does not.
pub fn refused(state_dir: &Path, package: &Path) -> Option<String> {
    let key = CheckpointKey::of(package).ok()?;
    let starts = starts_of(state_dir, &key);
    (starts >= MAX_STARTS).then(|| refusal(starts, state_dir))
}

/// How many starts began the trial of `package` in `dir` without ending it.
fn starts_of(dir: &Path, package: &CheckpointKey) -> u64 {
    read(&dir.join(FILE))
        .filter(|t| t.package == *package)
        .map_or(0, |t| t.starts)
}

fn refusal(starts: u64, dir: &Path) -> String {
    format!(
        "the last {starts} starts of diffmon died while it was being loaded or run for the first \
         time (a crash in libtorch's loader or in its kernels), so it is not loaded again until \
         it is rebuilt (or {} is deleted to try it once more)",
        shown_file(dir)
    )
}

/// The trial this process began is over without a crash: the package has run its first forward,
/// or it was refused with an error (corrupt, not this architecture's). Its file is removed.
/// Nothing to do where no trial began in this process (none armed, no package, or one refused
/// by its trial: that file stays).
pub fn end() {
    let Some(dir) = ON_TRIAL.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        return;
    };
    // The file holds this trial: one daemon per state folder, one trial at a time.
    match std::fs::remove_file(dir.join(FILE)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            tracing::warn!("cannot remove {} ({e})", shown_file(&dir))
        }
        _ => {}
    }
}

/// The trial file of `dir`, for messages: where the held state folder is ([`safe_fs::untrusted`]).
fn shown_file(dir: &Path) -> String {
    safe_fs::untrusted(&dir.join(FILE))
}

/// The trial in `path`, `None` when absent, unreadable or malformed (then overwritten).
fn read(path: &Path) -> Option<Trial> {
    serde_json::from_slice(&safe_fs::read_bounded(path, MAX_BYTES).ok()?).ok()
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
}
