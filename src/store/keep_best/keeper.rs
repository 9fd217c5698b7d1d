//! The keeper's thread, `diffmon-keep` ([`Keeper`]): [`super::keep`] run off the recorder's
//! thread, the newest request replacing any waiting one (the parent module's docs say why), and
//! one WARN for each checkpoint it cannot keep.

use super::{keep_from, lookup};
use crate::store::history::CheckpointKey;
use crate::store::safe_fs::untrusted;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How long [`Keeper::kept`] waits for a keep in progress.
const WAIT_FOR_KEEP: Duration = Duration::from_secs(120);

/// Called on the keeper's thread when a keep ends: the checkpoint, and where it is kept (as
/// [`Keeper::kept`] names it), or `None` when keeping it failed.
pub type OnKept = Arc<dyn Fn(&Path, Option<&Path>) + Send + Sync>;

/// Where to read a checkpoint's files when not at its own path (its pin,
/// [`crate::store::pin`]), and what keeps them there until the keep is done (dropped then).
pub struct Source {
    pub path: PathBuf,
    pub hold: Arc<dyn std::any::Any + Send + Sync>,
}

/// What [`Keeper`]'s thread and its callers share.
#[derive(Default)]
struct Slot {
    /// The newest checkpoint asked for, not started yet: its path, its key when evaluated, and
    /// its pin (the files to link from; held until the keep is done or replaced).
    wanted: Option<(PathBuf, Option<CheckpointKey>, Option<Source>)>,
    /// The one being kept now.
    busy: Option<PathBuf>,
    /// The last one kept, and where.
    done: Option<(PathBuf, PathBuf)>,
    stop: bool,
}

/// Runs [`keep`] on its own thread, `diffmon-keep` (module docs): [`Keeper::keep`] never waits.
pub struct Keeper {
    state_dir: PathBuf,
    /// See [`Keeper::showing`].
    shown: Option<PathBuf>,
    /// See [`Keeper::on_kept`].
    on_kept: Option<OnKept>,
    shared: Arc<(Mutex<Slot>, Condvar)>,
    started: Mutex<bool>,
}

impl Keeper {
    /// A keeper for `state_dir`; its thread starts with the first request.
    pub fn new(state_dir: &Path) -> Keeper {
        Keeper {
            state_dir: state_dir.to_path_buf(),
            shown: None,
            on_kept: None,
            shared: Arc::new((Mutex::new(Slot::default()), Condvar::new())),
            started: Mutex::new(false),
        }
    }

    /// Asks for `checkpoint` to be kept, when it is still what was evaluated (`evaluated`, its
    /// key then: see [`keep`]), read from its `pin` when it has one ([`keep_from`]); a request
    /// not started yet is replaced.
    pub fn keep(&self, checkpoint: &Path, evaluated: Option<CheckpointKey>, pin: Option<Source>) {
        self.start();
        let (slot, changed) = &*self.shared;
        let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
        s.wanted = Some((checkpoint.to_path_buf(), evaluated, pin));
        changed.notify_all();
    }

    /// Where `checkpoint` is kept, once it is: waits (at most 2 minutes) while it is asked for
    /// or being kept; `None` when keeping it failed or it is not the kept one. Before any
    /// request, the folder tells ([`lookup`]).
    pub fn kept(&self, checkpoint: &Path) -> Option<PathBuf> {
        let (slot, changed) = &*self.shared;
        let pending = |s: &Slot| {
            s.wanted.as_ref().is_some_and(|(w, _, _)| w == checkpoint)
                || s.busy.as_deref() == Some(checkpoint)
        };
        let s = slot.lock().unwrap_or_else(|e| e.into_inner());
        let (s, _) = changed
            .wait_timeout_while(s, WAIT_FOR_KEEP, |s| pending(s))
            .unwrap_or_else(|e| e.into_inner());
        let kept = match &s.done {
            Some((c, kept)) if c == checkpoint => Some(kept.clone()),
            _ if pending(&s) => None,
            _ => lookup(&self.state_dir, checkpoint),
        }?;
        Some(show(&self.state_dir, self.shown.as_deref(), kept))
    }

    /// Names the kept copies under `shown` (the configured state folder) when the keeper writes
    /// through another path to it (the daemon's handle, `crate::store::state_dir`).
    pub fn showing(mut self, shown: &Path) -> Keeper {
        self.shown = Some(shown.to_path_buf());
        self
    }

    /// Calls `hook` on the keeper's thread whenever a keep ends (after [`Keeper::kept`]'s
    /// waiters are woken), so that what shows the kept copy follows it without asking: the live
    /// page learns of a copy finished after the last evaluation. Set before the first request.
    pub fn on_kept(mut self, hook: OnKept) -> Keeper {
        self.on_kept = Some(hook);
        self
    }

    fn start(&self) {
        let mut started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        if *started {
            return;
        }
        let shared = self.shared.clone();
        let state_dir = self.state_dir.clone();
        let shown = self.shown.clone();
        let on_kept = self.on_kept.clone();
        let spawned = std::thread::Builder::new()
            .name("diffmon-keep".into())
            .spawn(move || run(&state_dir, shown.as_deref(), on_kept.as_ref(), &shared));
        match spawned {
            Ok(_) => *started = true,
            Err(e) => tracing::warn!("cannot start the thread that keeps the best checkpoint: {e}"),
        }
    }
}

impl Drop for Keeper {
    /// Lets the keep asked for last finish (for at most [`WAIT_FOR_KEEP`]: the daemon lets go of
    /// its state folder after this, and a run that ends names its best last), then stops the
    /// thread; a copy cut short is removed at the next start.
    fn drop(&mut self) {
        let started = *self.started.lock().unwrap_or_else(|e| e.into_inner());
        let (slot, changed) = &*self.shared;
        let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
        if started && (s.wanted.is_some() || s.busy.is_some()) {
            tracing::info!("keeping the best checkpoint before stopping");
            let (kept, timeout) = changed
                .wait_timeout_while(s, WAIT_FOR_KEEP, |s| s.wanted.is_some() || s.busy.is_some())
                .unwrap_or_else(|e| e.into_inner());
            if timeout.timed_out() {
                tracing::warn!(
                    "the best checkpoint is still being kept after {WAIT_FOR_KEEP:?}: stopping without it (the copy cut short is removed at the next start)"
                );
            }
            s = kept;
        }
        s.stop = true;
        drop(s);
        changed.notify_all();
    }
}

/// `kept` (a path under `state_dir`) named under `shown`, the configured state folder, when
/// there is one: for people and other programs, not the daemon's handle on it.
fn show(state_dir: &Path, shown: Option<&Path>, kept: PathBuf) -> PathBuf {
    match (shown, kept.strip_prefix(state_dir)) {
        (Some(shown), Ok(rest)) => shown.join(rest),
        _ => kept,
    }
}

/// The keeper thread: keeps the newest request, until stopped; tells `on_kept` how each keep
/// ended.
fn run(
    state_dir: &Path,
    shown: Option<&Path>,
    on_kept: Option<&OnKept>,
    shared: &(Mutex<Slot>, Condvar),
) {
    let (slot, changed) = shared;
    // The last refusal: asked again for the same checkpoint (a new best that turns back, a stop
    // that keeps the best before it ends), the same reason is not a second WARN.
    let mut refused: Option<(PathBuf, String)> = None;
    loop {
        let (checkpoint, evaluated, pin) = {
            let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
            while s.wanted.is_none() && !s.stop {
                s = changed.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            if s.stop {
                return;
            }
            let (c, evaluated, pin) = s.wanted.take().expect("waited for it");
            s.busy = Some(c.clone());
            (c, evaluated, pin)
        };
        let started = std::time::Instant::now();
        let source = pin
            .as_ref()
            .map_or(checkpoint.as_path(), |p| p.path.as_path());
        let result = keep_from(state_dir, &checkpoint, source, evaluated.as_ref());
        drop(pin);
        let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
        s.busy = None;
        let ended = match result {
            Ok(kept) => {
                refused = None;
                if kept.linked + kept.copied > 0 {
                    tracing::info!(
                        checkpoint = %untrusted(&checkpoint),
                        kept = %untrusted(&kept.path),
                        linked = kept.linked,
                        copied = kept.copied,
                        seconds = started.elapsed().as_secs_f64(),
                        "best checkpoint kept (early_stop.keep_best)"
                    );
                }
                s.done = Some((checkpoint.clone(), kept.path.clone()));
                Some(show(state_dir, shown, kept.path))
            }
            Err(e) => {
                let why = crate::store::safe_fs::untrusted_text(&e.to_string());
                let again = refused
                    .as_ref()
                    .is_some_and(|(c, w)| *c == checkpoint && *w == why);
                if again {
                    tracing::debug!(
                        "cannot keep the best checkpoint (early_stop.keep_best), again: {why}"
                    );
                } else {
                    tracing::warn!("cannot keep the best checkpoint (early_stop.keep_best): {why}");
                }
                refused = Some((checkpoint.clone(), why));
                s.done = None;
                None
            }
        };
        changed.notify_all();
        // Outside the lock: the hook may take locks that a waiter in `kept` holds.
        drop(s);
        if let Some(hook) = on_kept {
            hook(&checkpoint, ended.as_deref());
        }
    }
}
