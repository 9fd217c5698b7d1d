//! The watcher and its thread: it wakes on notifications, at each rescan and to check what is
//! settling, and offers the evaluator the next complete checkpoint (`checkpoints.backlog`).

use super::notifications::{Events, Notifications, SharedNotifications, notifications_failure};
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
    /// Its pin ([`crate::store::pin`]): the files to read, whatever rotation does to `path`.
    pub pin: Option<Arc<crate::store::pin::Pin>>,
    /// Deleted before its turn, unpinned: recorded as a `rotated` failure, never evaluated.
    pub rotated: bool,
}

impl WorkItem {
    pub fn new(path: PathBuf, step: i64, key: CheckpointKey) -> WorkItem {
        WorkItem {
            path,
            step,
            key,
            pin: None,
            rotated: false,
        }
    }

    /// Where its files are read: the pin, else the checkpoint itself.
    pub fn files(&self) -> &Path {
        self.pin.as_ref().map_or(&self.path, |p| p.path())
    }
}

/// A file seen in the run folder that has not been handed over yet.
pub(super) struct Candidate {
    pub(super) size: u64,
    pub(super) mtime_ns: i64,
    /// When size and mtime were last seen to change.
    pub(super) changed_at: Instant,
    pub(super) renamed_into_place: bool,
    /// Settled, and its structure checked since and found not valid (not yet written whole,
    /// or corrupt): it waits for the give-up time to be recorded as a failure, holding
    /// nothing back.
    pub(super) found_invalid: bool,
}

pub struct Watcher {
    pub(super) dir: PathBuf,
    pub(super) config: CheckpointsConfig,
    /// Keys already evaluated, failed, or handed over.
    pub(super) offered: HashSet<CheckpointKey>,
    pub(super) candidates: HashMap<PathBuf, Candidate>,
    /// Complete checkpoints by (step, path).
    pub(super) ready: BTreeMap<(i64, PathBuf), WorkItem>,
    /// Files matching the pattern whose name has no step: skipped by name, warned about once.
    pub(super) warned_no_step: HashSet<PathBuf>,
    /// Files matching the pattern that are not regular files (FIFO, socket, device), warned
    /// about once: never opened.
    pub(super) warned_not_regular: HashSet<PathBuf>,
    /// Files that could not be read (permission denied, EIO), warned about once: retried on
    /// later scans, not recorded as failures.
    pub(super) unreadable: HashSet<PathBuf>,
    /// Entries whose name is not UTF-8 (no pattern can match it), warned about once each.
    pub(super) warned_not_utf8: HashSet<std::ffi::OsString>,
    /// The run folder could be listed at the last scan (`None`: not listed yet).
    pub(super) dir_present: Option<bool>,
    /// The run folder came back after it disappeared: its notifications must be set up again.
    pub(super) rewatch: bool,
    /// How many times a file's container structure was checked (each opens and reads it).
    pub(super) structure_checks: u64,
    /// Files the config names (architecture, data, teacher, ...): never checkpoints.
    pub(super) excluded: HashSet<PathBuf>,
    /// Entries that look like checkpoints but are not evaluated, from the last scan: (name,
    /// why).
    pub(super) ignored: Vec<(String, &'static str)>,
    /// When the warning about `ignored` entries was last logged.
    pub(super) warned_ignored_at: Option<Instant>,
    pub(super) metrics: Arc<Metrics>,
    /// The daemon's state folder, when it runs in `run.dir` (see [`Watcher::following`]).
    pub(super) state: Option<Arc<crate::store::state_dir::StateDir>>,
    /// A sweep's one inotify instance, which this run's folder joins (`None`: its own).
    pub(super) shared_notifications: Option<SharedNotifications>,
    /// The state folder whose `crash-scan` marker guards the structure checks (armed on the
    /// watcher's thread when it runs).
    pub(super) crash_dir: Option<PathBuf>,
    pub(super) marker: Option<crate::store::crash::ThreadMarker>,
    /// Where complete checkpoints are pinned against rotation (`None`: not pinned).
    /// The state folder whose kept best checkpoint (`best/`) a restored copy is recognized
    /// by: such a copy is not evaluated again ([`Watcher::recognizing_kept`]).
    pub(super) kept_from: Option<PathBuf>,
    pub(super) pins: Option<crate::store::pin::Pins>,
    /// The run's pace, told the checkpoints offered (see [`Watcher::pacing`]).
    pub(super) pace: Option<Arc<crate::daemon::pace::Pace>>,
    /// The training job's end (`watch --until-pid`/`--until-file`; see [`Watcher::until`]).
    pub(super) finish: Option<crate::daemon::until::Finish>,
}

/// A daemon that stops leaves the pins of the checkpoints still waiting on disk: the next start
/// evaluates those that rotation deletes meanwhile ([`crate::store::pin::Pins::leftovers`]).
impl Drop for Watcher {
    fn drop(&mut self) {
        for pin in self.ready.values().filter_map(|w| w.pin.as_ref()) {
            pin.leave_on_disk();
        }
    }
}

/// A name from `run.dir` for logs (control characters escaped).
pub(super) fn shown(path: &Path) -> String {
    crate::store::safe_fs::untrusted(path)
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
            pins: None,
            kept_from: None,
            pace: None,
            finish: None,
        }
    }

    /// Pins complete checkpoints in `state_dir` until their outcome is recorded
    /// ([`crate::store::pin`]); the pins a previous daemon left of checkpoints deleted since are
    /// offered again, to be evaluated from the pin, unless the history has them. Without
    /// `keep_best` (`early_stop.keep_best`), a folder's pin holds only its weights file.
    pub fn with_pins(mut self, state_dir: &Path, keep_best: bool) -> Watcher {
        let pins = match crate::store::pin::Pins::open(state_dir) {
            Ok(p) if keep_best => p,
            Ok(p) => p.only_weights(crate::store::unit::weights_files(&self.config)),
            Err(e) => {
                tracing::warn!(state_dir = %state_dir.display(), "cannot make the folder for pins ({e}): checkpoints are not pinned against rotation");
                return self;
            }
        };
        for left in pins.leftovers(&self.dir) {
            if self.offered.contains(&left.key) {
                continue; // recorded before the restart; dropping the pin removes it
            }
            let path = PathBuf::from(&left.key.path);
            tracing::info!(checkpoint = %shown(&path), step = left.step,
                "deleted while the daemon was stopped; evaluated from its pin");
            let mut item = WorkItem::new(path.clone(), left.step, left.key);
            item.pin = Some(left.pin);
            self.ready.insert((left.step, path), item);
        }
        self.pins = Some(pins);
        self
    }

    /// Takes a checkpoint with the same files as the one kept in `state_dir` under its name as
    /// evaluated already (`diffmon resume` restored it, or the user copied it back), however its
    /// times differ: `store::restore::is_copy_of_kept`.
    pub fn recognizing_kept(mut self, state_dir: &Path) -> Watcher {
        self.kept_from = Some(state_dir.to_path_buf());
        self
    }

    /// Tells `pace` the steps and modification times of the checkpoints ready at each offer,
    /// from which it measures the interval between checkpoints (`daemon/pace.rs`).
    pub fn pacing(mut self, pace: Arc<crate::daemon::pace::Pace>) -> Watcher {
        self.pace = Some(pace);
        self
    }

    /// Ends the watcher once the training job has ended and everything it wrote has been
    /// handed over (`daemon/until.rs`); its marker file is never a checkpoint.
    pub(crate) fn until(mut self, finish: crate::daemon::until::Finish) -> Watcher {
        if let Some(file) = finish.file() {
            self.excluded.insert(crate::config::normalize(file));
        }
        self.finish = Some(finish);
        self
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
        self.excluded
            .extend(paths.into_iter().map(|p| crate::config::normalize(&p)));
        self
    }

    /// Puts the daemon's state folder back at each scan when the run folder was replaced
    /// (`crate::store::state_dir::StateDir::follow`), so the next start finds its history.
    pub fn following(mut self, state: Arc<crate::store::state_dir::StateDir>) -> Watcher {
        self.state = Some(state);
        self
    }

    /// The step in a unit's name (its path relative to `run.dir`).
    pub(super) fn step(&self, path: &Path) -> Option<i64> {
        self.config.step_regex.step_in(path.file_name()?.to_str()?)
    }

    pub(super) fn settle(&self) -> Duration {
        self.config.settle
    }

    /// The item to offer the evaluator now. With `all`, checkpoints go in step order: the
    /// detector reads the curve in evaluation order, so one renamed into place must not overtake
    /// an older one that is still settling (as every file found after a restart is), nor one
    /// that has settled since the last scan and waits for that scan's structure check. A file
    /// found not valid once settled only waits to be recorded as a failure, which the detector
    /// never sees, and one that cannot be read now may stay so: neither holds anything back.
    pub(super) fn next(&self) -> Option<WorkItem> {
        match self.config.backlog {
            Backlog::All => {
                let first = self.ready.values().next()?;
                let older_pending = self.candidates.iter().any(|(p, c)| {
                    !c.found_invalid
                        && !self.unreadable.contains(p)
                        && self.step(p).is_some_and(|s| s < first.step)
                });
                (!older_pending).then(|| first.clone())
            }
            Backlog::Latest => self.ready.values().next_back().cloned(),
        }
    }

    /// Marks `item` as handed over; with `latest`, drops the older pending items.
    pub(super) fn taken(&mut self, item: &WorkItem) {
        // The pace reads the checkpoints waiting after this one was taken.
        let offered: Vec<(i64, i64)> = (self.ready.values().chain([item]))
            .map(|w| (w.step, w.key.mtime_ns))
            .collect();
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
        if let Some(pace) = &self.pace {
            pace.offered(offered);
        }
    }

    /// Checkpoints that can still be handed over: ready, or settling (not those that cannot be
    /// read now: after the job's end they are left, with a WARN).
    fn left(&self) -> usize {
        let settling = self.candidates.keys();
        self.ready.len() + settling.filter(|p| !self.unreadable.contains(*p)).count()
    }

    /// After the training job's end (`--until-pid`/`--until-file`): whether everything is
    /// handed over, so that the watcher ends.
    fn finished(&self) -> bool {
        let left = self.left();
        let Some(finish) = &self.finish else {
            return false;
        };
        if !finish.done(left) {
            return false;
        }
        for path in self.candidates.keys() {
            tracing::warn!(checkpoint = %shown(path), "cannot be read: not evaluated before the daemon stops");
        }
        finish.finish();
        true
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
            if self.finish.as_mut().is_some_and(|f| f.check()) {
                next_poll = Instant::now(); // a scan now: what the job wrote last
            }
            let now = Instant::now();
            if now >= next_poll {
                self.scan();
                next_poll = now + poll;
                if let Some(finish) = &mut self.finish {
                    finish.scanned();
                }
            }
            if self.finished() {
                return; // the work channel closes: the evaluator finishes and ends
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
    pub(super) fn on_event(&mut self, event: notify::Result<notify::Event>) -> bool {
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

    pub(super) fn start_notifications(&self, tx: Events) -> Option<Notifications> {
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

/// The rendezvous channel from the watcher to the evaluator: a send completes only when the
/// evaluator is idle and takes the item.
pub fn work_channel() -> (Sender<WorkItem>, Receiver<WorkItem>) {
    crossbeam_channel::bounded(0)
}
