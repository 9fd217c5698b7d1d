//! A scan of the run folder: which entries are checkpoint units, when a unit is complete
//! (renamed into place, or settled, and its weights' structure valid), and the warnings about
//! entries that look like checkpoints but are skipped.

use super::offer::{Candidate, Watcher, WorkItem, shown};
use crate::store::history::CheckpointKey;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Extensions of files that look like checkpoints (for the warning about skipped entries).
const WEIGHT_LIKE: [&str; 9] = [
    ".pt",
    ".pth",
    ".ckpt",
    ".safetensors",
    ".bin",
    ".pkl",
    ".ts",
    ".distcp",
    ".index.json",
];

/// How often the warning about entries that look like checkpoints but are skipped repeats
/// while nothing has been found.
const IGNORED_WARNING_EVERY: Duration = Duration::from_secs(60);

/// Whether `path` (a file or folder of `run.dir`) looks like a checkpoint: a weights-like
/// extension, or a folder with such a file (or `.metadata`) among its first entries.
fn looks_like_checkpoint(path: &Path, name: &str, is_dir: bool) -> bool {
    let weight_like = |n: &str| n == ".metadata" || WEIGHT_LIKE.iter().any(|e| n.ends_with(e));
    if !is_dir {
        return weight_like(name);
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return false;
    };
    entries.take(64).flatten().any(|e| {
        let n = e.file_name();
        let n = n.to_string_lossy();
        weight_like(&n) || ["unet", "unet_ema", "transformer", "transformer_ema"].contains(&&*n)
    })
}

/// An error reading a file that may go away by itself (permissions fixed, a flaky disk or
/// network filesystem), as opposed to a malformed file.
fn is_transient(e: &crate::weights::WeightsError) -> bool {
    let crate::weights::WeightsError::Io { source, .. } = e else {
        return false;
    };
    source.kind() == std::io::ErrorKind::PermissionDenied
        || matches!(
            source.raw_os_error(),
            Some(
                libc::EIO
                    | libc::EACCES
                    | libc::EPERM
                    | libc::EAGAIN
                    | libc::EINTR
                    | libc::ESTALE
                    | libc::ETIMEDOUT
            )
        )
}

/// An entry's name for messages: escaped, with `/` after a folder.
fn shown_entry(name: &str, is_dir: bool) -> String {
    let mut s = crate::store::safe_fs::untrusted_text(name);
    if is_dir {
        s.push('/');
    }
    s
}

/// Names that are never checkpoints: hidden files and files still being written.
fn is_temporary(name: &str) -> bool {
    name.starts_with('.')
        || [".tmp", ".partial", ".part", ".incomplete", ".lock"]
            .iter()
            .any(|s| name.ends_with(s))
}

impl Watcher {
    /// Lists the folder and moves complete files to `ready`.
    pub(super) fn scan(&mut self) {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => {
                if self.dir_present == Some(false) {
                    tracing::info!(dir = %shown(&self.dir), "the run folder is back; watching it again");
                    self.rewatch = true;
                }
                self.dir_present = Some(true);
                if let Some(state) = &self.state {
                    state.follow(false);
                }
                e
            }
            Err(e) => {
                if self.dir_present == Some(true) {
                    tracing::error!(dir = %shown(&self.dir), "the run folder disappeared ({e}); new checkpoints are found once it is back, and the history is re-created in it from memory");
                } else {
                    tracing::debug!(dir = %shown(&self.dir), "cannot list the run folder yet: {e}");
                }
                if self.dir_present.is_some() {
                    self.dir_present = Some(false);
                }
                return;
            }
        };
        let now = Instant::now();
        let mut present = HashSet::new();
        let mut matching = HashSet::new();
        let mut ignored = Vec::new();
        let mut not_utf8 = HashSet::new();
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else {
                self.not_utf8(&name, &mut ignored, &mut not_utf8);
                continue;
            };
            if is_temporary(name) {
                continue;
            }
            let path = entry.path();
            if self.excluded.contains(&crate::config::normalize(&path)) {
                continue;
            }
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if !self.config.pattern.is_match(name) {
                // Only looked at while nothing was found: the warning is for a wrong pattern.
                if self.nothing_found()
                    && ignored.len() < 1000
                    && looks_like_checkpoint(&path, name, is_dir)
                {
                    ignored.push((
                        shown_entry(name, is_dir),
                        "does not match checkpoints.pattern",
                    ));
                }
                continue;
            }
            matching.insert(path.clone());
            // The step is in the name: an entry without one is skipped before any stat or open.
            let Some(step) = self.step(&path) else {
                if looks_like_checkpoint(&path, name, is_dir) && ignored.len() < 1000 {
                    ignored.push((
                        shown_entry(name, is_dir),
                        "has no step in its name (checkpoints.step_regex)",
                    ));
                }
                if self.warned_no_step.insert(path.clone()) {
                    tracing::warn!(checkpoint = %shown(&path), regex = %self.config.step_regex,
                        "no training step in the name (checkpoints.step_regex); skipping it");
                }
                continue;
            };
            // Regular files (or links to them) and folders are checkpoints; a FIFO, socket or
            // device is never opened (opening a FIFO would block), nor a link to a folder.
            let kind = match entry.file_type() {
                Ok(t) if t.is_file() => Some(true),
                Ok(t) if t.is_dir() => Some(true),
                Ok(t) if t.is_symlink() => match std::fs::metadata(&path) {
                    Ok(m) if m.is_file() => Some(true),
                    Ok(m) if m.is_dir() => None,
                    Ok(_) => Some(false),
                    Err(_) => None, // a broken link
                },
                Ok(_) => Some(false),
                Err(_) => None,
            };
            match kind {
                Some(true) => {}
                Some(false) => {
                    ignored.push((shown_entry(name, false), "is a FIFO, socket or device"));
                    if self.warned_not_regular.insert(path.clone()) {
                        tracing::warn!(checkpoint = %shown(&path), "not a regular file (FIFO, socket or device); skipping it");
                    }
                    continue;
                }
                None => continue,
            }
            // One stat per file; a folder's tree is walked (bounded).
            let key = match crate::store::unit::key(&path) {
                Ok(key) => key,
                Err(e @ crate::store::unit::UnitError::TooLarge { .. }) => {
                    ignored.push((
                        shown_entry(name, true),
                        "is too large a tree to be a checkpoint",
                    ));
                    if self.warned_not_regular.insert(path.clone()) {
                        tracing::warn!(checkpoint = %shown(&path), "{e}");
                    }
                    continue;
                }
                Err(_) => continue,
            };
            if self.offered.contains(&key) {
                continue;
            }
            present.insert(path.clone());
            // Ready and unchanged: nothing to check again.
            if self
                .ready
                .get(&(step, path.clone()))
                .is_some_and(|w| w.key == key)
            {
                continue;
            }
            let c = self.candidates.entry(path.clone()).or_insert(Candidate {
                size: key.size,
                mtime_ns: key.mtime_ns,
                changed_at: now,
                renamed_into_place: false,
                found_invalid: false,
            });
            if (c.size, c.mtime_ns) != (key.size, key.mtime_ns) {
                c.size = key.size;
                c.mtime_ns = key.mtime_ns;
                c.changed_at = now;
                c.renamed_into_place = false;
                c.found_invalid = false;
            }
        }
        self.note_ignored(ignored);
        self.deleted_before_their_turn(&present);
        self.candidates.retain(|p, _| present.contains(p));
        self.ready
            .retain(|(_, p), w| present.contains(p) || w.pin.is_some() || w.rotated);
        self.warned_no_step.retain(|p| matching.contains(p));
        self.warned_not_regular.retain(|p| matching.contains(p));
        self.unreadable.retain(|p| present.contains(p));
        self.warned_not_utf8.retain(|n| not_utf8.contains(n));

        let settle = self.settle();
        let give_up = (settle * 5).max(Duration::from_secs(30));
        let paths: Vec<PathBuf> = self.candidates.keys().cloned().collect();
        for path in paths {
            let c = &self.candidates[&path];
            let stable_for = now.duration_since(c.changed_at);
            if !c.renamed_into_place && stable_for < settle {
                continue;
            }
            // A file renamed into place is complete: if it is not a valid container it is
            // corrupt, and recorded as a failure at once. One found by the scan may still be
            // growing in a way size and mtime do not show (NFS), so it gets until `give_up`.
            self.structure_checks += 1;
            let step_now = self.step(&path).unwrap_or_default();
            if let Some(marker) = &self.marker {
                marker.checking(Some(&crate::store::crash::InFlight {
                    key: CheckpointKey {
                        path: path.display().to_string(),
                        size: c.size,
                        mtime_ns: c.mtime_ns,
                    },
                    step: step_now,
                    package_on_trial: None,
                }));
            }
            let checked: Result<(), Option<crate::weights::WeightsError>> =
                match crate::store::unit::weights_path(&path, &self.config) {
                    Ok(weights) => crate::weights::validate_structure(&weights)
                        .map(|_| ())
                        .map_err(Some),
                    // A folder without its weights file yet: not complete (or, after the
                    // give-up time, a failure naming what was looked for).
                    Err(_) => Err(None),
                };
            if let Some(marker) = &self.marker {
                marker.checking(None);
            }
            // A file that cannot be read now (permission denied, EIO) is not corrupt: it is
            // tried again at the next scans, and evaluated once it can be read.
            if let Err(Some(e)) = &checked
                && is_transient(e)
            {
                if self.unreadable.insert(path.clone()) {
                    tracing::warn!(checkpoint = %shown(&path), "cannot read the file ({e}); trying again at the next scans");
                }
                continue;
            }
            if self.unreadable.remove(&path) {
                tracing::info!(checkpoint = %shown(&path), "the file can be read again");
            }
            let valid = checked.is_ok();
            if !valid && !c.renamed_into_place && stable_for < give_up {
                if let Some(c) = self.candidates.get_mut(&path) {
                    c.found_invalid = true;
                }
                continue;
            }
            let key = CheckpointKey {
                path: path.display().to_string(),
                size: c.size,
                mtime_ns: c.mtime_ns,
            };
            self.candidates.remove(&path);
            let Some(step) = self.step(&path) else {
                continue; // names without a step never become candidates
            };
            if !valid {
                tracing::warn!(checkpoint = %shown(&path), "not a valid checkpoint container (renamed into place, or stable for {give_up:?}); handing it over to be recorded as a failure");
            } else if let Some(state_dir) = &self.kept_from
                && crate::store::restore::is_copy_of_kept(state_dir, &path)
            {
                tracing::info!(checkpoint = %shown(&path), step,
                    "the same files as the kept best checkpoint (restored from it): evaluated already, not again");
                self.offered.insert(key);
                continue;
            }
            let mut item = WorkItem::new(path.clone(), step, key);
            if valid {
                item.pin = self
                    .pins
                    .as_ref()
                    .and_then(|pins| pins.pin(&path, &item.key, step));
            }
            self.ready.insert((step, path), item);
        }
        self.metrics.set_pending(self.ready.len());
        if let Some(pins) = &self.pins {
            self.metrics.set_pinned_bytes(pins.held_bytes());
        }
    }

    /// Checkpoints deleted before their turn, found by a scan that listed `present` (those not
    /// handed over): never forgotten. One waiting unpinned, or still settling, becomes a
    /// `rotated` item, recorded as a failure in its turn; a pinned one stays, to be evaluated
    /// from its pin. Only a name that no longer exists counts: one whose key could not be read
    /// this time (a folder being written) is looked at again at the next scan.
    fn deleted_before_their_turn(&mut self, present: &HashSet<PathBuf>) {
        let gone = |p: &Path| {
            matches!(std::fs::symlink_metadata(p),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        };
        let settling: Vec<(PathBuf, CheckpointKey)> = self
            .candidates
            .iter()
            .filter(|(p, _)| !present.contains(*p) && gone(p))
            .map(|(p, c)| {
                let key = CheckpointKey {
                    path: p.display().to_string(),
                    size: c.size,
                    mtime_ns: c.mtime_ns,
                };
                (p.clone(), key)
            })
            .collect();
        for (path, key) in settling {
            if let Some(step) = self.step(&path) {
                let mut item = WorkItem::new(path.clone(), step, key);
                item.rotated = true;
                tracing::warn!(checkpoint = %shown(&path), step,
                    "deleted before it was complete or evaluated (rotation?): recorded as `rotated`");
                self.ready.insert((step, path), item);
            }
        }
        for w in self.ready.values_mut() {
            if present.contains(&w.path) || w.pin.is_some() || w.rotated || !gone(&w.path) {
                continue;
            }
            w.rotated = true;
            tracing::warn!(checkpoint = %shown(&w.path), step = w.step,
                "deleted before its evaluation and not pinned (rotation?): recorded as `rotated`");
        }
    }

    /// An entry whose name is not UTF-8: never a checkpoint (no pattern matches it, no record
    /// could name it), but counted in `diffmon_checkpoints_ignored` and warned about once, its
    /// name escaped; hidden and temporary names are skipped as others are.
    fn not_utf8(
        &mut self,
        name: &std::ffi::OsStr,
        ignored: &mut Vec<(String, &'static str)>,
        seen: &mut HashSet<std::ffi::OsString>,
    ) {
        if is_temporary(&name.to_string_lossy()) || seen.len() >= 1000 {
            return;
        }
        seen.insert(name.to_os_string());
        let escaped = crate::store::safe_fs::untrusted(Path::new(name));
        if ignored.len() < 1000 {
            ignored.push((escaped.clone(), "has a name that is not UTF-8"));
        }
        if self.warned_not_utf8.insert(name.to_os_string()) {
            tracing::warn!(dir = %shown(&self.dir), entry = %escaped,
                "an entry's name is not UTF-8, so it is never a checkpoint; skipping it");
        }
    }

    /// Nothing found yet: no checkpoint seen, pending, handed over or in the history.
    fn nothing_found(&self) -> bool {
        self.offered.is_empty() && self.candidates.is_empty() && self.ready.is_empty()
    }

    /// Exports the count of entries that look like checkpoints but are skipped and, while
    /// nothing was found, warns about them (at the first scan, then every minute).
    fn note_ignored(&mut self, ignored: Vec<(String, &'static str)>) {
        self.metrics.set_ignored(ignored.len());
        let due = self
            .warned_ignored_at
            .is_none_or(|t| t.elapsed() >= IGNORED_WARNING_EVERY);
        if !ignored.is_empty() && due && self.nothing_found() {
            self.warned_ignored_at = Some(Instant::now());
            let mut seen: Vec<String> = ignored
                .iter()
                .take(10)
                .map(|(n, why)| format!("{n} {why}"))
                .collect();
            if ignored.len() > 10 {
                seen.push(format!("and {} more", ignored.len() - 10));
            }
            tracing::warn!(dir = %shown(&self.dir), pattern = %self.config.pattern,
                "no checkpoint found yet, but {} entries look like checkpoints and are skipped: {}. Set checkpoints.pattern (file or folder names directly in run.dir), checkpoints.step_regex or checkpoints.weights_files (the weights inside a checkpoint folder)",
                ignored.len(), seen.join("; "));
        }
        self.ignored = ignored;
    }

    /// A notification that `path` was renamed into place: complete without waiting to settle.
    pub(super) fn renamed(&mut self, path: &Path) {
        if let Some(c) = self.candidates.get_mut(path) {
            c.renamed_into_place = true;
        } else if let Some(name) = path.file_name().and_then(|n| n.to_str())
            && !is_temporary(name)
            && self.config.pattern.is_match(name)
            && path.parent() == Some(self.dir.as_path())
            && !self.excluded.contains(&crate::config::normalize(path))
            && self.step(path).is_some()
            && std::fs::symlink_metadata(path)
                .is_ok_and(|m| m.is_file() || m.is_symlink() || m.is_dir())
            && let Ok(key) = crate::store::unit::key(path)
            && !self.offered.contains(&key)
        {
            self.candidates.insert(
                path.to_path_buf(),
                Candidate {
                    size: key.size,
                    mtime_ns: key.mtime_ns,
                    changed_at: Instant::now(),
                    renamed_into_place: true,
                    found_invalid: false,
                },
            );
        }
    }
}
