//! `<state_dir>/parameterization.json`: the parameterization check's warning
//! (`crate::engine::model::consistency`) while it stands, so that `check-config` and a restarted
//! daemon's live page say it without evaluating anything. The recorder writes it when an
//! evaluation warns and removes it when a later one passes; a file that cannot be read is as
//! none.

use super::safe_fs;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

const FILE: &str = "parameterization.json";
/// The longest file read (a warning is a few hundred bytes).
const MAX_BYTES: u64 = 64 << 10;

/// The warning and the checkpoint it was made on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Warning {
    pub step: i64,
    pub checkpoint: String,
    pub warning: String,
}

fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

/// Keeps `warning` (atomically, following no link).
pub fn record(state_dir: &Path, warning: &Warning) -> io::Result<()> {
    let bytes = serde_json::to_vec(warning).expect("a warning serializes");
    safe_fs::atomic_write(&path(state_dir), &bytes)
}

/// Removes the warning, if one is kept (a link in its place is removed, not followed).
pub fn clear(state_dir: &Path) -> io::Result<()> {
    match std::fs::remove_file(path(state_dir)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The kept warning; `None` without one, or when the file is not one (bounded, no link
/// followed).
pub fn read(state_dir: &Path) -> Option<Warning> {
    let bytes = safe_fs::read_bounded(&path(state_dir), MAX_BYTES).ok()?;
    serde_json::from_slice(&bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warning_is_kept_until_cleared_and_a_bad_file_is_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()), None);
        let w = Warning {
            step: 100,
            checkpoint: "/run/ckpt_100.pt".into(),
            warning: "the denoised output grows".into(),
        };
        record(dir.path(), &w).unwrap();
        assert_eq!(read(dir.path()), Some(w));
        clear(dir.path()).unwrap();
        assert_eq!(read(dir.path()), None);
        clear(dir.path()).unwrap();
        std::fs::write(path(dir.path()), b"{\"step\": 1}").unwrap();
        assert_eq!(read(dir.path()), None);
        std::fs::remove_file(path(dir.path())).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", path(dir.path())).unwrap();
        assert_eq!(read(dir.path()), None, "a link is not followed");
    }
}
