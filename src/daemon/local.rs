//! The local executor: [`Local`], the evaluator thread of this process, and
//! [`start_shared`], the one evaluator thread of a sweep; both evaluate one item at a time with
//! the crash marker naming it.

use super::executor::{Executor, ExecutorError, Lane, Outcome, rotated, unchanged};
use crate::config::Config;
use crate::daemon::watcher::WorkItem;
use crate::engine::eval::{Architectures, EvalError, Evaluator};
use crate::engine::model::ModelError;
use crate::engine::pfd::PfdError;
use crate::record::FailureReason;
use crate::store::crash::InFlight;
use crate::store::safe_fs::untrusted;
use crossbeam_channel::{Receiver, Sender};
use std::thread::JoinHandle;

/// The evaluator thread: one item at a time, in this process. It owns every libtorch and HDF5
/// object (the `Evaluator`), which are built on it and never leave it.
pub struct Local {
    pub config: Config,
    /// Evaluations in the history before this start: `pfd.every` counts from the run's first
    /// evaluation, across restarts.
    pub evaluated_before: usize,
}

impl Executor for Local {
    fn start(
        self,
        work: Receiver<WorkItem>,
        outcomes: Sender<Outcome>,
    ) -> Result<JoinHandle<()>, ExecutorError> {
        let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(), EvalError>>(1);
        let thread = std::thread::Builder::new()
            .name(crate::store::crash::EVALUATOR_THREAD.into())
            .spawn(move || {
                let mut evaluator = match Evaluator::new(&self.config) {
                    Ok(mut e) => {
                        e.set_evaluated(self.evaluated_before);
                        let _ = ready_tx.send(Ok(()));
                        e
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                for item in work {
                    if outcomes.send(evaluate(&mut evaluator, item)).is_err() {
                        return;
                    }
                }
            })
            .map_err(ExecutorError::Spawn)?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(thread),
            Ok(Err(e)) => Err(ExecutorError::Start(e)),
            Err(_) => Err(ExecutorError::StoppedDuringStart),
        }
    }
}

/// The evaluator thread of a sweep (docs/design.md §19): one item at a time for all the runs,
/// taken round-robin (after an item of one run, every other run with an item waiting goes
/// first), so a run with a deep backlog cannot starve the others. It keeps an evaluation
/// context per run (runs may differ in data), built on the thread: for `lanes` at start (an
/// error stops the daemon), for a run sent on `added` when it comes (`runs_glob`; an error is
/// logged and the run gets no evaluations). The crash marker it arms is the state folder's of
/// the run being evaluated. It ends once `added` and every run's work channel are closed, or
/// every outcome channel.
pub fn start_shared(
    lanes: Vec<Lane>,
    added: Receiver<Lane>,
) -> Result<JoinHandle<()>, ExecutorError> {
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(), EvalError>>(1);
    let thread = std::thread::Builder::new()
        .name(crate::store::crash::EVALUATOR_THREAD.into())
        .spawn(move || {
            let mut runs = Vec::with_capacity(lanes.len());
            // Each architecture file is loaded once for the runs that name it.
            let mut architectures = Architectures::default();
            for lane in lanes {
                match Evaluator::sharing(&lane.config, &mut architectures) {
                    Ok(mut e) => {
                        e.set_evaluated(lane.evaluated_before);
                        runs.push((lane, e));
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                }
            }
            let _ = ready_tx.send(Ok(()));
            let mut open = vec![true; runs.len()];
            let mut adding = true;
            let mut next = 0;
            let mut armed: Option<usize> = None;
            while adding || open.iter().any(|&o| o) {
                let taken = round_robin(runs.iter().map(|(lane, _)| &lane.work), &mut open, next);
                let Some((i, item)) = taken else {
                    // Nothing waiting: sleep until a run offers an item (or closes), or a run
                    // is added.
                    let mut select = crossbeam_channel::Select::new();
                    for (lane, _) in runs.iter().zip(&open).filter(|(_, o)| **o).map(|(r, _)| r) {
                        select.recv(&lane.work);
                    }
                    let adds = adding.then(|| select.recv(&added));
                    if !(adding || open.iter().any(|&o| o)) {
                        continue;
                    }
                    let ready = select.ready();
                    if Some(ready) == adds {
                        match added.try_recv() {
                            Ok(lane) => {
                                let run = lane.config.run_name();
                                match Evaluator::sharing(&lane.config, &mut architectures) {
                                    Ok(mut e) => {
                                        e.set_evaluated(lane.evaluated_before);
                                        runs.push((lane, e));
                                        open.push(true);
                                    }
                                    Err(e) => tracing::error!(
                                        run = %run,
                                        "cannot evaluate the run's checkpoints: {:#}",
                                        anyhow::Error::from(e)
                                    ),
                                }
                            }
                            Err(crossbeam_channel::TryRecvError::Disconnected) => adding = false,
                            Err(crossbeam_channel::TryRecvError::Empty) => {}
                        }
                    }
                    continue;
                };
                next = i + 1;
                let (lane, evaluator) = &mut runs[i];
                if armed != Some(i) {
                    if let Err(e) = crate::store::crash::arm(&lane.config.state_dir()) {
                        // Not the last run's marker: a crash now is recorded nowhere.
                        crate::store::crash::disarm();
                        tracing::warn!(run = %lane.config.run_name(), "{e}; a crash would not be recorded");
                    }
                    armed = Some(i);
                }
                if lane.outcomes.send(evaluate(evaluator, item)).is_err() {
                    open[i] = false;
                }
            }
        })
        .map_err(ExecutorError::Spawn)?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(e)) => Err(ExecutorError::Start(e)),
        Err(_) => Err(ExecutorError::StoppedDuringStart),
    }
}

/// The next item of the first run, from `next` on and wrapping around, that has one waiting
/// (`open[i]` turns false once run `i`'s channel is found closed), with its run's index.
fn round_robin<'a, T: 'a>(
    channels: impl ExactSizeIterator<Item = &'a Receiver<T>>,
    open: &mut [bool],
    next: usize,
) -> Option<(usize, T)> {
    let n = channels.len();
    let channels: Vec<&Receiver<T>> = channels.collect();
    (0..n).map(|k| (next + k) % n).find_map(|i| {
        if !open[i] {
            return None;
        }
        match channels[i].try_recv() {
            Ok(item) => Some((i, item)),
            Err(crossbeam_channel::TryRecvError::Empty) => None,
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                open[i] = false;
                None
            }
        }
    })
}

/// Evaluates one item with the crash marker naming it (docs/design.md §10).
fn evaluate(evaluator: &mut Evaluator, item: WorkItem) -> Outcome {
    if let Some(outcome) = rotated(&item) {
        return outcome;
    }
    // A compiled package on trial runs this evaluation: a crash is its own, not the checkpoint's.
    let package_on_trial = crate::store::package_trial::resume(evaluator.package().as_deref());
    crate::store::crash::evaluating(Some(&InFlight {
        key: item.key.clone(),
        step: item.step,
        package_on_trial: package_on_trial.clone(),
    }));
    // Logged once a crash would be recorded against this checkpoint.
    tracing::debug!(checkpoint = %untrusted(&item.path), step = item.step, "evaluating");
    let evaluated = evaluator.evaluate_from(&item.path, item.files(), item.step);
    crate::store::crash::evaluating(None);
    if package_on_trial.is_some() {
        crate::store::package_trial::settle(evaluated.is_ok());
    }
    match evaluated {
        // A file deleted or rewritten while it was read may not be what was evaluated.
        Ok(_) if !unchanged(&item) => Outcome::Failed(
            item,
            FailureReason::Vanished,
            "the checkpoint was deleted or rewritten during its evaluation".into(),
        ),
        Ok(record) => Outcome::Done(item, Box::new(record)),
        Err(e) => Outcome::Failed(item.clone(), failure_reason(&item, &e), e.to_string()),
    }
}

/// Failure reason label of `diffmon_checkpoint_failures_total{reason}`.
pub(crate) fn failure_reason(item: &WorkItem, e: &EvalError) -> FailureReason {
    if !unchanged(item) {
        return FailureReason::Vanished;
    }
    match e {
        EvalError::Model(ModelError::Weights(_) | ModelError::Load { .. }) => {
            FailureReason::Unreadable
        }
        EvalError::Model(ModelError::Mismatch { .. }) => FailureReason::Mismatch,
        EvalError::Unit(_) => FailureReason::Unreadable,
        EvalError::Invalid { .. } | EvalError::Icr(_) | EvalError::Pfd(PfdError::NonFinite(_)) => {
            FailureReason::NonFinite
        }
        _ => FailureReason::Error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit that changed (or is gone) is `vanished`, whatever the error; otherwise the error
    /// says which reason.
    #[test]
    fn failure_reasons_name_what_went_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt_1.pt");
        std::fs::write(&path, b"weights").unwrap();
        let item = WorkItem::new(path.clone(), 1, crate::store::unit::key(&path).unwrap());
        let invalid = || EvalError::Invalid {
            checkpoint: path.clone(),
            message: "ICR is NaN".into(),
        };
        let shape = EvalError::ShapeMismatch {
            path: path.clone(),
            data: [1, 8, 8],
            other_path: path.clone(),
            other: [3, 8, 8],
        };
        assert_eq!(failure_reason(&item, &invalid()), FailureReason::NonFinite);
        assert_eq!(failure_reason(&item, &shape), FailureReason::Error);
        std::fs::write(&path, b"other weights").unwrap();
        assert_eq!(failure_reason(&item, &invalid()), FailureReason::Vanished);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(failure_reason(&item, &invalid()), FailureReason::Vanished);
    }

    /// A run with a deep backlog does not starve the others: after an item of one run, every
    /// other run with an item waiting goes first; a closed channel closes its run.
    #[test]
    fn the_shared_evaluator_takes_work_round_robin() {
        let (deep_tx, deep) = crossbeam_channel::unbounded();
        let (short_tx, short) = crossbeam_channel::unbounded();
        let (closed_tx, closed) = crossbeam_channel::unbounded::<i32>();
        for i in 0..5 {
            deep_tx.send(i).unwrap();
        }
        for i in 10..12 {
            short_tx.send(i).unwrap();
        }
        drop(closed_tx);
        let channels = [deep, closed, short];
        let mut open = [true; 3];
        let mut next = 0;
        let mut taken = Vec::new();
        while let Some((i, item)) = round_robin(channels.iter(), &mut open, next) {
            taken.push(item);
            next = i + 1;
        }
        assert_eq!(taken, [0, 10, 1, 11, 2, 3, 4]);
        assert_eq!(
            open,
            [true, false, true],
            "only the closed channel is closed"
        );
        drop((deep_tx, short_tx));
        assert_eq!(round_robin(channels.iter(), &mut open, next), None);
        assert_eq!(open, [false; 3]);
    }

    /// An evaluator that cannot be built (here: no data file) fails the start with its cause.
    #[test]
    fn a_local_executor_that_cannot_start_says_why() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.ts", "d.h5"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let text = format!(
            "run: {{dir: r}}\nmodel: {{architecture: {}}}\ndevice: cpu\ndata: {{path: {}}}\n",
            dir.path().join("m.ts").display(),
            dir.path().join("d.h5").display()
        );
        let file = crate::config::ConfigFile::parse(&text, "t.yaml").unwrap();
        let mut config = file.settings(false).unwrap();
        config.data.path = dir.path().join("missing.h5");
        let (_work_tx, work_rx) = crate::daemon::watcher::work_channel();
        let (outcome_tx, _outcome_rx) = crossbeam_channel::bounded(1);
        let local = Local {
            config,
            evaluated_before: 0,
        };
        let Err(e) = local.start(work_rx, outcome_tx) else {
            panic!("the evaluator started without its data")
        };
        assert!(matches!(e, ExecutorError::Start(_)), "{e:?}");
        assert_eq!(e.to_string(), "cannot start the evaluator");
        let cause = std::error::Error::source(&e)
            .expect("the cause")
            .to_string();
        assert!(cause.contains("missing.h5"), "{cause}");
    }
}
