//! The executor stage: work items in, [`Outcome`]s out. It sits between the watcher and the
//! recorder (ARCHITECTURE.md, "Add an executor"). This file is the stage's interface, which
//! every executor implements and the rest of the daemon uses: the [`Executor`] trait, the
//! [`Outcome`] it reports, its error, a sweep's [`Lane`], and the checks every executor makes
//! of an item; it imports no executor. [`Local`](super::local::Local) (`local.rs`) is the
//! evaluator thread of this process; [`Jobs`](super::jobs::Jobs) (`jobs/`) runs
//! `diffmon eval --json` as batch jobs on a scheduler (`slurm/`). `choice.rs` chooses one.

use crate::config::Config;
use crate::daemon::watcher::WorkItem;
use crate::engine::eval::EvalError;
use crate::record::{Evaluation, FailureReason};
use crossbeam_channel::{Receiver, Sender};
use std::thread::JoinHandle;

/// What an executor reports for one work item.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Done(WorkItem, Box<Evaluation>),
    Failed(WorkItem, FailureReason, String),
}

#[derive(Debug, thiserror::Error)]
pub enum ExecutorError {
    #[error("cannot start the evaluator")]
    Start(#[source] EvalError),
    #[error("the evaluator thread stopped during start-up")]
    StoppedDuringStart,
    #[error("cannot start the evaluator thread")]
    Spawn(#[source] std::io::Error),
    #[error("cannot start the jobs executor")]
    Jobs(#[source] super::jobs::error::JobsError),
    #[error("the evaluator has stopped")]
    Stopped,
}

/// Turns work items into outcomes.
pub trait Executor {
    /// Starts taking items from `work` (a rendezvous channel: an item is taken only when the
    /// executor has a free slot, so the watcher chooses the next item as late as possible) and
    /// sends one outcome per item taken to `outcomes`. It ends once `work` is closed and the
    /// items it took are reported, or when `outcomes` is closed. Returns when it is ready to
    /// take work, with the thread to join at the end, or with the error that stops the daemon
    /// at start.
    fn start(
        self,
        work: Receiver<WorkItem>,
        outcomes: Sender<Outcome>,
    ) -> Result<JoinHandle<()>, ExecutorError>;
}

/// One run of a sweep as the shared evaluator sees it: the run's settings, its work channel
/// (from its watcher) and its outcome channel (to its recorder).
pub struct Lane {
    pub config: Config,
    /// As [`Local::evaluated_before`](super::local::Local::evaluated_before), for this run.
    pub evaluated_before: usize,
    pub work: Receiver<WorkItem>,
    pub outcomes: Sender<Outcome>,
}

/// Is the unit on disk still the version the item names? A pinned item's files are its pin's,
/// which must be unchanged (a rewrite in place changes both); and its name must still be that
/// version, or gone (rotation: the pin is what is left of it). A checkpoint saved again under
/// its name (renamed over) is a new version, evaluated in its turn: the old one is `vanished`.
pub(super) fn unchanged(item: &WorkItem) -> bool {
    let at_its_name = crate::store::unit::key(&item.path);
    match &item.pin {
        Some(pin) => {
            pin.unchanged()
                && match at_its_name {
                    Ok(key) => key == item.key,
                    Err(_) => matches!(std::fs::symlink_metadata(&item.path),
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound),
                }
        }
        None => at_its_name.ok().as_ref() == Some(&item.key),
    }
}

/// The outcome of an item deleted before its turn without a pin: a `rotated` failure, with no
/// evaluation.
pub(super) fn rotated(item: &WorkItem) -> Option<Outcome> {
    item.rotated.then(|| {
        Outcome::Failed(
            item.clone(),
            FailureReason::Rotated,
            "deleted before its evaluation (the training job's checkpoint rotation?), and not \
             pinned (docs/guide/watching.md, \"Rotation\")"
                .into(),
        )
    })
}
