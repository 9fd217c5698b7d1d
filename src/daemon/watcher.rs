//! Finds complete checkpoints in `run.dir` and hands them to the evaluator in step order.
//!
//! A checkpoint is a *unit* ([`crate::store::unit`]): a file or a folder directly in `run.dir` whose
//! name matches `checkpoints.pattern` and holds a step; the files the config names never match.
//! Filesystem notifications (inotify) wake the watcher early; a periodic rescan every
//! `checkpoints.poll_secs` finds units where notifications are silent (NFS, Lustre) or switched
//! off. A unit is complete when it was renamed into place, or when its key (size and mtime; for
//! a folder, over its whole tree) has been stable for `checkpoints.settle_secs`; in both cases
//! its weights must be there and their container structure valid. A unit that stays invalid
//! long after it stopped changing is handed over anyway, so the evaluator records it as a
//! failure instead of waiting forever.
//!
//! Never silent: while nothing has been found, entries that look like checkpoints but are
//! skipped (no match for the pattern, no step, not a regular file) are named in a warning at
//! the first scan and then once a minute, and counted in `diffmon_checkpoints_ignored`.
//!
//! Work is offered on a rendezvous channel: the evaluator takes an item only when it is idle, so
//! the watcher always offers the best next one: the lowest pending step (`backlog: all`) or the
//! newest (`backlog: latest`, which drops the older pending ones and counts them as skipped).
//!
//! The structure check opens a unit before it is ever evaluated, so it is guarded like an
//! evaluation ([`crate::store::crash::ThreadMarker`]): while the watcher checks a unit, a fatal signal
//! or a panic on its thread writes that unit to `<state_dir>/crash-scan`; after the restart the
//! unit is recorded as a `crashed` failure and never opened again, so a file that kills the
//! process there (a reader's bug) cannot make every restart crash.

use crate::config::{Backlog, CheckpointsConfig};
use crate::metrics::Metrics;
use crate::store::history::CheckpointKey;
use crossbeam_channel::{Receiver, Select, Sender, TryRecvError};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A complete checkpoint to evaluate.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkItem {
    pub path: PathBuf,
    pub step: i64,
    pub key: CheckpointKey,
}

/// A file seen in the run folder that has not been handed over yet.
struct Candidate {
    size: u64,
    mtime_ns: i64,
    /// When size and mtime were last seen to change.
    changed_at: Instant,
    renamed_into_place: bool,
}

pub struct Watcher {
    dir: PathBuf,
    config: CheckpointsConfig,
    /// Keys already evaluated, failed, or handed over.
    offered: HashSet<CheckpointKey>,
    candidates: HashMap<PathBuf, Candidate>,
    /// Complete checkpoints by (step, path).
    ready: BTreeMap<(i64, PathBuf), WorkItem>,
    /// Files matching the pattern whose name has no step: skipped by name, warned about once.
    warned_no_step: HashSet<PathBuf>,
    /// Files matching the pattern that are not regular files (FIFO, socket, device), warned
    /// about once: never opened.
    warned_not_regular: HashSet<PathBuf>,
    /// Files that could not be read (permission denied, EIO), warned about once: retried on
    /// later scans, not recorded as failures.
    unreadable: HashSet<PathBuf>,
    /// Entries whose name is not UTF-8 (no pattern can match it), warned about once each.
    warned_not_utf8: HashSet<std::ffi::OsString>,
    /// The run folder could be listed at the last scan (`None`: not listed yet).
    dir_present: Option<bool>,
    /// The run folder came back after it disappeared: its notifications must be set up again.
    rewatch: bool,
    /// How many times a file's container structure was checked (each opens and reads it).
    structure_checks: u64,
    /// Files the config names (architecture, data, teacher, ...): never checkpoints.
    excluded: HashSet<PathBuf>,
    /// Entries that look like checkpoints but are not evaluated, from the last scan: (name,
    /// why).
    ignored: Vec<(String, &'static str)>,
    /// When the warning about `ignored` entries was last logged.
    warned_ignored_at: Option<Instant>,
    metrics: Arc<Metrics>,
    /// The daemon's state folder, when it runs in `run.dir` (see [`Watcher::following`]).
    state: Option<Arc<crate::store::state_dir::StateDir>>,
    /// A sweep's one inotify instance, which this run's folder joins (`None`: its own).
    shared_notifications: Option<SharedNotifications>,
    /// The state folder whose `crash-scan` marker guards the structure checks (armed on the
    /// watcher's thread when it runs).
    crash_dir: Option<PathBuf>,
    marker: Option<crate::store::crash::ThreadMarker>,
}

/// Events of filesystem notifications, as a watcher receives them.
type Events = Sender<notify::Result<notify::Event>>;

/// One inotify instance (and one event-loop thread) for the run folders of a sweep, instead of
/// one per run: the kernel allows 128 instances per user by default, and a sweep of more runs
/// polled the others. Each folder is one watch; an event goes to the watcher of the folder its
/// path is in (or is). Clones share the instance.
#[derive(Clone)]
pub struct SharedNotifications {
    routes: Arc<std::sync::Mutex<HashMap<PathBuf, Events>>>,
    watcher: Arc<std::sync::Mutex<notify::RecommendedWatcher>>,
}

impl SharedNotifications {
    pub fn new() -> notify::Result<SharedNotifications> {
        let routes: Arc<std::sync::Mutex<HashMap<PathBuf, Events>>> = Arc::default();
        let to = routes.clone();
        let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
            let routes = to.lock().unwrap_or_else(|e| e.into_inner());
            match event {
                Ok(e) => {
                    let run = e.paths.iter().find_map(|p| {
                        routes
                            .get(p)
                            .or_else(|| p.parent().and_then(|d| routes.get(d)))
                    });
                    if let Some(tx) = run {
                        let _ = tx.send(Ok(e));
                    }
                }
                // An error concerns every folder (each rescans).
                Err(e) => {
                    for tx in routes.values() {
                        let _ = tx.send(Err(notify::Error::generic(&e.to_string())));
                    }
                }
            }
        })?;
        Ok(SharedNotifications {
            routes,
            watcher: Arc::new(std::sync::Mutex::new(watcher)),
        })
    }

    /// Watches `dir` until the returned guard is dropped, its events sent on `tx`.
    fn watch(&self, dir: &Path, tx: Events) -> notify::Result<SharedWatch> {
        use notify::Watcher as _;
        self.routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(dir.to_path_buf(), tx);
        let watched = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .watch(dir, notify::RecursiveMode::NonRecursive);
        match watched {
            Ok(()) => Ok(SharedWatch {
                dir: dir.to_path_buf(),
                shared: self.clone(),
            }),
            Err(e) => {
                self.routes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(dir);
                Err(e)
            }
        }
    }
}

/// A run folder's watch in a [`SharedNotifications`]; removed when dropped.
struct SharedWatch {
    dir: PathBuf,
    shared: SharedNotifications,
}

impl Drop for SharedWatch {
    fn drop(&mut self) {
        use notify::Watcher as _;
        // The watch is gone already if the folder was deleted.
        let _ = self
            .shared
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .unwatch(&self.dir);
        self.shared
            .routes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.dir);
    }
}

/// A run folder's notifications: an inotify instance of its own, or a watch in a sweep's.
enum Notifications {
    Own(#[allow(dead_code)] notify::RecommendedWatcher),
    Shared(#[allow(dead_code)] SharedWatch),
}

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

/// A name from `run.dir` for logs (control characters escaped).
fn shown(path: &Path) -> String {
    crate::store::safe_fs::untrusted(path)
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
    /// `done`: keys of checkpoints the history already has.
    pub fn new(
        dir: &Path,
        config: &CheckpointsConfig,
        done: HashSet<CheckpointKey>,
        metrics: Arc<Metrics>,
    ) -> Watcher {
        Watcher {
            dir: dir.to_path_buf(),
            config: config.clone(),
            offered: done,
            candidates: HashMap::new(),
            ready: BTreeMap::new(),
            warned_no_step: HashSet::new(),
            warned_not_regular: HashSet::new(),
            unreadable: HashSet::new(),
            warned_not_utf8: HashSet::new(),
            dir_present: None,
            rewatch: false,
            structure_checks: 0,
            excluded: HashSet::new(),
            ignored: Vec::new(),
            warned_ignored_at: None,
            metrics,
            state: None,
            shared_notifications: None,
            crash_dir: None,
            marker: None,
        }
    }

    /// Notifications through a sweep's one inotify instance instead of one of its own.
    pub fn with_notifications(mut self, shared: Option<SharedNotifications>) -> Watcher {
        self.shared_notifications = shared;
        self
    }

    /// Guards the structure checks with a crash marker in `state_dir` (see the module docs).
    pub fn with_crash_marker(mut self, state_dir: &Path) -> Watcher {
        self.crash_dir = Some(state_dir.to_path_buf());
        self
    }

    /// Files that are never checkpoints, whatever their name (those the config names).
    pub fn with_excluded(mut self, paths: impl IntoIterator<Item = PathBuf>) -> Watcher {
        self.excluded = paths
            .into_iter()
            .map(|p| crate::config::normalize(&p))
            .collect();
        self
    }

    /// Puts the daemon's state folder back at each scan when the run folder was replaced
    /// (`crate::store::state_dir::StateDir::follow`), so the next start finds its history.
    pub fn following(mut self, state: Arc<crate::store::state_dir::StateDir>) -> Watcher {
        self.state = Some(state);
        self
    }

    /// The step in a unit's name (its path relative to `run.dir`).
    fn step(&self, path: &Path) -> Option<i64> {
        self.config.step_regex.step_in(path.file_name()?.to_str()?)
    }

    fn settle(&self) -> Duration {
        self.config.settle
    }

    /// Lists the folder and moves complete files to `ready`.
    fn scan(&mut self) {
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
            });
            if (c.size, c.mtime_ns) != (key.size, key.mtime_ns) {
                c.size = key.size;
                c.mtime_ns = key.mtime_ns;
                c.changed_at = now;
                c.renamed_into_place = false;
            }
        }
        self.note_ignored(ignored);
        // Files that vanished before evaluation are forgotten.
        self.candidates.retain(|p, _| present.contains(p));
        self.ready.retain(|(_, p), _| present.contains(p));
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
            }
            self.ready
                .insert((step, path.clone()), WorkItem { path, step, key });
        }
        self.metrics.set_pending(self.ready.len());
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
    fn renamed(&mut self, path: &Path) {
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
                },
            );
        }
    }

    /// The item to offer the evaluator now. With `all`, checkpoints go in step order: the
    /// detector reads the curve in evaluation order, so one renamed into place must not overtake
    /// an older one that is still settling (as every file found after a restart is). A file that
    /// has settled but is not a valid container only waits to be recorded as a failure, which
    /// the detector never sees: it holds nothing back.
    fn next(&self) -> Option<WorkItem> {
        match self.config.backlog {
            Backlog::All => {
                let first = self.ready.values().next()?;
                let settle = self.settle();
                let older_settling = self.candidates.iter().any(|(p, c)| {
                    !c.renamed_into_place
                        && c.changed_at.elapsed() < settle
                        && self.step(p).is_some_and(|s| s < first.step)
                });
                (!older_settling).then(|| first.clone())
            }
            Backlog::Latest => self.ready.values().next_back().cloned(),
        }
    }

    /// Marks `item` as handed over; with `latest`, drops the older pending items.
    fn taken(&mut self, item: &WorkItem) {
        self.offered.insert(item.key.clone());
        self.ready.remove(&(item.step, item.path.clone()));
        if self.config.backlog == Backlog::Latest && !self.ready.is_empty() {
            let skipped = std::mem::take(&mut self.ready);
            for w in skipped.values() {
                tracing::info!(checkpoint = %shown(&w.path), step = w.step, "skipped (backlog: latest)");
                self.offered.insert(w.key.clone());
            }
            self.metrics.skipped(skipped.len());
        }
        self.metrics.set_pending(self.ready.len());
    }

    /// Runs until `stop` is closed (the daemon stops; nothing is ever sent on it) or the
    /// evaluator hangs up; offers work on `work`.
    pub fn run(mut self, work: Sender<WorkItem>, stop: Receiver<()>) {
        if let Some(dir) = &self.crash_dir {
            match crate::store::crash::ThreadMarker::arm(dir) {
                Ok(Some(marker)) => self.marker = Some(marker),
                Ok(None) => tracing::warn!(
                    "too many watchers for the crash markers: a file that crashes this watcher's structure check would not be recorded"
                ),
                Err(e) => tracing::warn!(
                    "{e}; a file that crashes the watcher's structure check would not be recorded"
                ),
            }
        }
        let (events_tx, events) = crossbeam_channel::unbounded();
        let mut _notifier = if self.config.inotify {
            self.start_notifications(events_tx.clone())
        } else {
            None
        };
        let poll = self.config.poll;
        let settle_check =
            (self.settle() / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut next_poll = Instant::now();
        while !matches!(stop.try_recv(), Err(TryRecvError::Disconnected)) {
            let now = Instant::now();
            if now >= next_poll {
                self.scan();
                next_poll = now + poll;
            }
            if std::mem::take(&mut self.rewatch) && self.config.inotify {
                // The old watch went with the deleted folder; a shared one is removed first,
                // so that its removal does not take the new one with it.
                _notifier = None;
                _notifier = self.start_notifications(events_tx.clone());
            }
            let mut wait = next_poll.saturating_duration_since(Instant::now());
            if !self.candidates.is_empty() {
                wait = wait.min(settle_check);
            }
            // Wake at least every 200 ms: what `next` offers changes as checkpoints settle.
            wait = wait.min(Duration::from_millis(200));
            let offer = self.next();
            let mut sel = Select::new();
            let stop_op = sel.recv(&stop);
            let events_op = sel.recv(&events);
            let work_op = offer.as_ref().map(|_| sel.send(&work));
            let Ok(op) = sel.select_timeout(wait) else {
                if !self.candidates.is_empty() {
                    self.scan();
                }
                continue;
            };
            if op.index() == stop_op {
                let _ = op.recv(&stop);
                return;
            } else if op.index() == events_op {
                let Ok(event) = op.recv(&events) else {
                    continue;
                };
                let mut changed = self.on_event(event);
                // Coalesce a burst of events into one scan.
                while let Ok(event) = events.try_recv() {
                    changed |= self.on_event(event);
                }
                if changed {
                    self.scan();
                }
            } else if Some(op.index()) == work_op {
                let item = offer.expect("offered");
                if op.send(&work, item.clone()).is_err() {
                    return; // the evaluator is gone
                }
                self.taken(&item);
            }
        }
    }

    /// Handles one notification; whether it may change what a scan finds. Opening or reading a
    /// file or the folder does not: the scan itself opens the folder and the evaluator opens
    /// checkpoints, and rescanning on those events would wake the watcher forever.
    fn on_event(&mut self, event: notify::Result<notify::Event>) -> bool {
        use notify::EventKind;
        use notify::event::{AccessKind, AccessMode, ModifyKind, RenameMode};
        let Ok(event) = event else { return true };
        match event.kind {
            EventKind::Modify(ModifyKind::Name(RenameMode::To | RenameMode::Both)) => {
                // For `Both`, the last path is the destination.
                if let Some(path) = event.paths.last() {
                    self.renamed(path);
                }
                true
            }
            EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
            EventKind::Access(_) => false,
            _ => true,
        }
    }

    fn start_notifications(&self, tx: Events) -> Option<Notifications> {
        use notify::Watcher as _;
        if let Some(shared) = &self.shared_notifications {
            if let Err(e) = std::fs::create_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), "cannot create the run folder: {e}");
            }
            return match shared.watch(&self.dir, tx) {
                Ok(watch) => Some(Notifications::Shared(watch)),
                Err(e) => {
                    self.polling_instead(&e);
                    None
                }
            };
        }
        let watcher = notify::recommended_watcher(move |event| {
            let _ = tx.send(event);
        });
        let mut watcher = match watcher {
            Ok(w) => w,
            Err(e) => {
                self.polling_instead(&e);
                return None;
            }
        };
        if let Err(e) = std::fs::create_dir_all(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), "cannot create the run folder: {e}");
        }
        match watcher.watch(&self.dir, notify::RecursiveMode::NonRecursive) {
            Ok(()) => Some(Notifications::Own(watcher)),
            Err(e) => {
                self.polling_instead(&e);
                None
            }
        }
    }

    /// The one WARN of a run whose folder cannot be watched with notifications: it is polled
    /// every `checkpoints.poll_secs` instead. Naming the limit when one is the cause: each run
    /// takes one inotify instance and one watch (a sweep of many runs meets the defaults).
    fn polling_instead(&self, e: &notify::Error) {
        let cause = notifications_failure(e);
        tracing::warn!(run = %self.metrics.run(), dir = %shown(&self.dir),
            "no filesystem notifications for this run ({cause}); polling its folder every {:?} (checkpoints.poll_secs) instead", self.config.poll);
    }
}

/// Why notifications failed, naming the kernel limit when one is the cause.
fn notifications_failure(e: &notify::Error) -> String {
    let limit = match &e.kind {
        notify::ErrorKind::MaxFilesWatch => Some("fs.inotify.max_user_watches"),
        notify::ErrorKind::Io(io) if io.raw_os_error() == Some(libc::EMFILE) => {
            Some("fs.inotify.max_user_instances (or the open files limit)")
        }
        _ => None,
    };
    match limit {
        Some(limit) => format!("{e}: the limit {limit} is reached"),
        None => e.to_string(),
    }
}

/// The rendezvous channel from the watcher to the evaluator: a send completes only when the
/// evaluator is idle and takes the item.
pub fn work_channel() -> (Sender<WorkItem>, Receiver<WorkItem>) {
    crossbeam_channel::bounded(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(backlog: Backlog) -> CheckpointsConfig {
        CheckpointsConfig {
            pattern: crate::config::Glob::parse("ckpt_*.pt").unwrap(),
            settle: Duration::ZERO,
            backlog,
            ..CheckpointsConfig::default()
        }
    }

    /// Steps of everything the watcher offers now, each taken as the evaluator would.
    fn take_all(w: &mut Watcher) -> Vec<i64> {
        let mut steps = Vec::new();
        while let Some(item) = w.next() {
            steps.push(item.step);
            w.taken(&item);
        }
        steps
    }

    fn write_checkpoint(path: &Path) {
        // A minimal valid safetensors file: header length, JSON header, no tensors.
        let header = b"{}      ";
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        std::fs::write(path, bytes).unwrap();
    }

    #[test]
    fn offers_in_step_order_and_skips_temporary_known_and_nested_files() {
        let dir = tempfile::tempdir().unwrap();
        for name in [
            "ckpt_200.pt",
            "ckpt_50.pt",
            "ckpt_100.pt",
            "ckpt_300.pt.tmp",
            ".ckpt_400.pt",
            "notes.txt",
        ] {
            write_checkpoint(&dir.path().join(name));
        }
        // Only files directly inside the run folder: not a subfolder's, not a folder.
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        write_checkpoint(&dir.path().join("sub/ckpt_500.pt"));
        std::fs::create_dir(dir.path().join("ckpt_600.pt")).unwrap();
        let done = HashSet::from([CheckpointKey::of(&dir.path().join("ckpt_100.pt")).unwrap()]);
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            done,
            Arc::new(Metrics::new("t")),
        );
        w.scan();
        assert_eq!(take_all(&mut w), vec![50, 200]);
    }

    /// An accelerate-style checkpoint folder: weights plus optimizer state.
    fn write_folder(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        write_checkpoint(&dir.join("model.safetensors"));
        std::fs::write(dir.join("optimizer.bin"), b"state").unwrap();
    }

    #[test]
    fn folders_are_checkpoints_named_by_the_folder_once_stable() {
        let dir = tempfile::tempdir().unwrap();
        for s in [200, 50] {
            write_folder(&dir.path().join(format!("checkpoint-{s}")));
        }
        // A folder without weights yet is not complete.
        std::fs::create_dir(dir.path().join("checkpoint-10")).unwrap();
        // The architecture the config names is never a checkpoint, whatever its name.
        write_checkpoint(&dir.path().join("model_1.ts"));
        let cfg = CheckpointsConfig {
            settle: Duration::from_millis(300),
            ..CheckpointsConfig::default()
        };
        let mut w = Watcher::new(
            dir.path(),
            &cfg,
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        )
        .with_excluded([dir.path().join("model_1.ts")]);
        w.scan();
        assert!(w.next().is_none(), "ready before settling");
        // A file written inside a folder restarts its settle time.
        std::thread::sleep(Duration::from_millis(200));
        std::fs::write(dir.path().join("checkpoint-50/scheduler.bin"), b"s").unwrap();
        std::thread::sleep(Duration::from_millis(150));
        w.scan();
        // checkpoint-200 has settled, but waits for the older checkpoint-50, still settling.
        assert!(w.ready.keys().any(|(s, _)| *s == 200));
        assert!(w.next().is_none(), "checkpoint-200 overtook checkpoint-50");
        std::thread::sleep(Duration::from_millis(350));
        w.scan();
        let items: Vec<WorkItem> = std::iter::from_fn(|| {
            let i = w.next()?;
            w.taken(&i);
            Some(i)
        })
        .collect();
        assert_eq!(
            items.iter().map(|i| i.step).collect::<Vec<_>>(),
            vec![50, 200]
        );
        assert_eq!(items[0].path, dir.path().join("checkpoint-50"));
        assert_eq!(
            items[0].key,
            crate::store::unit::key(&items[0].path).unwrap()
        );
    }

    #[test]
    fn entries_that_look_like_checkpoints_but_never_match_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        write_folder(&dir.path().join("ckpt-step-a"));
        write_folder(&dir.path().join("run_state"));
        write_checkpoint(&dir.path().join("weights.safetensors"));
        std::fs::write(dir.path().join("notes.txt"), b"x").unwrap();
        let metrics = Arc::new(Metrics::new("t"));
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            HashSet::new(),
            metrics.clone(),
        );
        w.scan();
        let mut names: Vec<&str> = w.ignored.iter().map(|(n, _)| n.as_str()).collect();
        names.sort();
        assert_eq!(
            names,
            vec!["ckpt-step-a/", "run_state/", "weights.safetensors"]
        );
        assert!(
            metrics
                .encode()
                .contains("diffmon_checkpoints_ignored{run=\"t\"} 3")
        );
        assert!(
            w.warned_ignored_at.is_some(),
            "no warning at the first scan"
        );
    }

    #[test]
    fn latest_backlog_keeps_only_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        for s in [10, 20, 30] {
            write_checkpoint(&dir.path().join(format!("ckpt_{s}.pt")));
        }
        let metrics = Arc::new(Metrics::new("t"));
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::Latest),
            HashSet::new(),
            metrics.clone(),
        );
        w.scan();
        let item = w.next().unwrap();
        assert_eq!(item.step, 30);
        w.taken(&item);
        assert!(w.next().is_none());
        assert!(
            metrics
                .encode()
                .contains("diffmon_checkpoints_skipped_total{run=\"t\"} 2")
        );
    }

    /// A sweep's runs share one inotify instance: each folder's events reach its own watcher
    /// only, and a watcher that stops takes its folder's watch with it, not the others'.
    #[test]
    fn runs_share_one_inotify_instance_and_get_their_own_events() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let shared = SharedNotifications::new().expect("inotify");
        let watcher = |dir: &Path| {
            Watcher::new(
                dir,
                &config(Backlog::All),
                HashSet::new(),
                Arc::new(Metrics::new("t")),
            )
            .with_notifications(Some(shared.clone()))
        };
        let (wa, wb) = (watcher(a.path()), watcher(b.path()));
        let (tx_a, rx_a) = crossbeam_channel::unbounded();
        let (tx_b, rx_b) = crossbeam_channel::unbounded();
        let na = wa.start_notifications(tx_a).expect("a watch");
        let _nb = wb.start_notifications(tx_b).expect("b watch");
        assert!(matches!(na, Notifications::Shared(_)));
        let paths = |rx: &Receiver<notify::Result<notify::Event>>| -> Vec<PathBuf> {
            std::thread::sleep(Duration::from_millis(300));
            rx.try_iter()
                .flat_map(|e| e.unwrap().paths)
                .collect::<Vec<_>>()
        };
        write_checkpoint(&a.path().join("ckpt_1.pt"));
        let got = paths(&rx_a);
        assert!(
            !got.is_empty() && got.iter().all(|p| p.starts_with(a.path())),
            "{got:?}"
        );
        assert!(paths(&rx_b).is_empty(), "b got a's events");
        write_checkpoint(&b.path().join("ckpt_1.pt"));
        assert!(!paths(&rx_b).is_empty());
        assert!(paths(&rx_a).is_empty(), "a got b's events");
        drop(na);
        write_checkpoint(&a.path().join("ckpt_2.pt"));
        write_checkpoint(&b.path().join("ckpt_2.pt"));
        assert!(
            paths(&rx_a).is_empty(),
            "a stopped watcher still gets events"
        );
        assert!(!paths(&rx_b).is_empty(), "b lost its watch with a's");
    }

    #[test]
    fn its_own_scans_do_not_wake_it_but_a_renamed_checkpoint_does() {
        // Real inotify: a scan opens the folder, which notifies an access. Were that taken as a
        // change, every scan would trigger the next and an idle daemon would spin.
        let dir = tempfile::tempdir().unwrap();
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        let (tx, rx) = crossbeam_channel::unbounded();
        let _notifier = w.start_notifications(tx).expect("inotify");
        let drain = |rx: &Receiver<notify::Result<notify::Event>>| {
            std::thread::sleep(Duration::from_millis(300));
            rx.try_iter().collect::<Vec<_>>()
        };
        w.scan();
        let own = drain(&rx);
        assert!(
            !own.is_empty(),
            "the scan's own folder access was not notified"
        );
        for e in own {
            assert!(!w.on_event(e), "a scan's own access counted as a change");
        }
        let tmp = dir.path().join("ckpt_7.pt.tmp");
        write_checkpoint(&tmp);
        std::fs::rename(&tmp, dir.path().join("ckpt_7.pt")).unwrap();
        let changes: Vec<bool> = drain(&rx).into_iter().map(|e| w.on_event(e)).collect();
        assert!(
            changes.contains(&true),
            "a renamed checkpoint did not count"
        );
        w.scan();
        assert_eq!(w.next().map(|i| i.step), Some(7));
    }

    #[test]
    fn a_renamed_checkpoint_waits_for_an_older_one_still_settling() {
        // After a restart, ckpt_1 (found by the scan) must settle; ckpt_2 arrives by rename and
        // is complete at once, but is offered only after ckpt_1.
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(&dir.path().join("ckpt_1.pt"));
        let cfg = CheckpointsConfig {
            settle: Duration::from_millis(300),
            ..config(Backlog::All)
        };
        let mut w = Watcher::new(
            dir.path(),
            &cfg,
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        w.scan();
        let renamed = dir.path().join("ckpt_2.pt");
        write_checkpoint(&renamed);
        w.renamed(&renamed);
        w.scan();
        assert!(w.next().is_none(), "ckpt_2 overtook ckpt_1");
        std::thread::sleep(Duration::from_millis(350));
        w.scan();
        assert_eq!(take_all(&mut w), vec![1, 2]);
    }

    #[test]
    fn a_corrupt_file_renamed_into_place_is_handed_over_at_once() {
        // Renamed into place means complete: an invalid container is recorded as a failure
        // now, not after the give-up time that files found by a scan get.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt_9.pt");
        std::fs::write(&path, b"not a checkpoint").unwrap();
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        w.renamed(&path);
        w.scan();
        assert_eq!(w.next().map(|i| i.step), Some(9));
    }

    #[test]
    fn a_growing_file_is_not_ready_until_it_settles() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt_5.pt");
        write_checkpoint(&path);
        let cfg = CheckpointsConfig {
            settle: Duration::from_millis(300),
            ..config(Backlog::All)
        };
        let mut w = Watcher::new(
            dir.path(),
            &cfg,
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        w.scan();
        assert!(w.next().is_none(), "ready before settling");
        std::thread::sleep(Duration::from_millis(350));
        w.scan();
        assert_eq!(w.next().map(|i| i.step), Some(5));
    }

    #[test]
    fn files_without_a_step_are_skipped_without_opening_them() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["ckpt_best.pt", "ckpt_last.pt", "ckpt_final.pt"] {
            write_checkpoint(&dir.path().join(name));
        }
        write_checkpoint(&dir.path().join("ckpt_3.pt"));
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        for _ in 0..5 {
            w.scan();
        }
        assert_eq!(take_all(&mut w), vec![3]);
        for _ in 0..5 {
            w.scan();
        }
        // Only ckpt_3 was ever opened, once; the others are known by name.
        assert_eq!(w.structure_checks, 1, "files without a step were checked");
        assert_eq!(w.warned_no_step.len(), 3);
        assert!(w.candidates.is_empty());
    }

    #[test]
    fn a_fifo_named_like_a_checkpoint_is_skipped_and_never_opened() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("ckpt_1.pt");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        // A link to the FIFO as well.
        std::os::unix::fs::symlink(&fifo, dir.path().join("ckpt_2.pt")).unwrap();
        write_checkpoint(&dir.path().join("ckpt_3.pt"));
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        // Renamed into place (as a notification would say) changes nothing.
        w.renamed(&fifo);
        for _ in 0..3 {
            w.scan();
        }
        assert_eq!(take_all(&mut w), vec![3]);
        assert_eq!(w.warned_not_regular.len(), 2);
        assert_eq!(w.structure_checks, 1);
    }

    /// A name that is not UTF-8 was skipped silently: now warned about once and counted in
    /// `diffmon_checkpoints_ignored` (0 before), while the other checkpoints go on.
    #[test]
    fn a_name_that_is_not_utf8_is_counted_and_warned_about_once() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let odd = std::ffi::OsStr::from_bytes(b"ckpt_\xff\x1b[31m.pt");
        write_checkpoint(&dir.path().join(odd));
        // Hidden ones are skipped as any hidden file is.
        write_checkpoint(
            &dir.path()
                .join(std::ffi::OsStr::from_bytes(b".ckpt_\xff.pt")),
        );
        write_checkpoint(&dir.path().join("ckpt_3.pt"));
        let metrics = Arc::new(Metrics::new("t"));
        let mut w = Watcher::new(
            dir.path(),
            &config(Backlog::All),
            HashSet::new(),
            metrics.clone(),
        );
        for _ in 0..3 {
            w.scan();
        }
        assert_eq!(take_all(&mut w), vec![3]);
        assert_eq!(w.warned_not_utf8.len(), 1);
        assert_eq!(
            w.ignored,
            [(
                "ckpt_\\xff\\u{1b}[31m.pt".to_string(),
                "has a name that is not UTF-8"
            )]
        );
        let text = metrics.encode();
        assert!(
            text.contains("diffmon_checkpoints_ignored{run=\"t\"} 1"),
            "{text}"
        );
        std::fs::remove_file(dir.path().join(odd)).unwrap();
        w.scan();
        assert!(w.warned_not_utf8.is_empty(), "a gone entry is forgotten");
    }

    /// Out of inotify watches (ENOSPC) or instances (EMFILE), the warning names the limit to
    /// raise.
    #[test]
    fn running_out_of_notifications_names_the_limit() {
        let watches = notify::Error::new(notify::ErrorKind::MaxFilesWatch);
        assert!(notifications_failure(&watches).contains("fs.inotify.max_user_watches"));
        let instances = notify::Error::io(std::io::Error::from_raw_os_error(libc::EMFILE));
        assert!(notifications_failure(&instances).contains("fs.inotify.max_user_instances"));
        let other = notify::Error::generic("boom");
        assert!(!notifications_failure(&other).contains("fs.inotify"));
    }

    #[test]
    fn a_run_folder_deleted_and_recreated_is_watched_again() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        write_checkpoint(&dir.join("ckpt_1.pt"));
        let mut w = Watcher::new(
            &dir,
            &config(Backlog::All),
            HashSet::new(),
            Arc::new(Metrics::new("t")),
        );
        w.scan();
        assert_eq!(take_all(&mut w), vec![1]);
        std::fs::remove_dir_all(&dir).unwrap();
        w.scan();
        assert_eq!(w.dir_present, Some(false));
        assert!(!dir.exists(), "the watcher re-created the run folder");
        std::fs::create_dir(&dir).unwrap();
        write_checkpoint(&dir.join("ckpt_2.pt"));
        w.scan();
        assert!(w.rewatch, "the notifications are not set up again");
        assert_eq!(take_all(&mut w), vec![2]);
    }
}
