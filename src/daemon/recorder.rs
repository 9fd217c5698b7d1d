//! The recorder stage: durable recording, and nothing else. Every outcome is appended to the
//! journal (`history.rs`) before it is handed on; when the state folder cannot be written (a
//! full disk, a deleted folder) outcomes wait in memory, in order, and are tried again every
//! [`RECORD_RETRY`]. `history.h5` is rewritten whenever it is behind the journal. What acts on
//! an outcome (the run's state, the outputs) gets it from [`Recorder::run`]'s `recorded`, in
//! order, once it is in the journal.

use super::executor::Outcome;
use crate::daemon::watcher::WorkItem;
use crate::record::FailureReason;
use crate::store::crash::{Crash, InFlight};
use crate::store::history::{Entry, History, HistoryError};
use crate::store::safe_fs::{untrusted, untrusted_text};
use crate::store::state_dir::StateDir;
use crossbeam_channel::{Receiver, RecvTimeoutError};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How often the recorder tries again to write outcomes it could not record.
pub const RECORD_RETRY: Duration = Duration::from_secs(2);

/// The journal, `history.h5` and the outcomes waiting to be written.
pub struct Recorder {
    history: History,
    /// Outcomes not in the history yet (it could not be written), oldest first, with the time
    /// they arrived.
    unrecorded: VecDeque<(Outcome, String)>,
    /// The oldest of `unrecorded` failed to be written, and that was logged.
    stalled: bool,
    /// Rewriting `history.h5` failed, and that was logged.
    hdf5_failing: bool,
    /// The daemon's state folder, put back in place before each write (`crate::store::state_dir`).
    state: Option<Arc<StateDir>>,
}

fn now_rfc3339() -> String {
    crate::record::rfc3339_utc(std::time::SystemTime::now())
}

impl Recorder {
    /// Opens (or creates) the history in `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Recorder, HistoryError> {
        Ok(Recorder {
            history: History::open(state_dir)?,
            unrecorded: VecDeque::new(),
            stalled: false,
            hdf5_failing: false,
            state: None,
        })
    }

    /// Follows the held state folder `state` (moved back or made again) before each write.
    pub fn following(mut self, state: Arc<StateDir>) -> Recorder {
        self.state = Some(state);
        self
    }

    /// The journal's entries, in order (what replay and the watcher's "done" set start from).
    pub fn entries(&self) -> &[Entry] {
        self.history.entries()
    }

    /// Takes one outcome: it is recorded durably, then handed to `recorded`, after any older
    /// outcome still waiting to be recorded.
    pub fn record(&mut self, outcome: Outcome, recorded: &mut impl FnMut(Outcome, &str)) {
        if let Outcome::Failed(item, reason, message) = &outcome {
            tracing::warn!(checkpoint = %untrusted(&item.path), step = item.step, reason = reason.as_str(), "evaluation failed: {}", untrusted_text(message));
        }
        self.unrecorded.push_back((outcome, now_rfc3339()));
        self.flush(recorded);
    }

    /// Records the checkpoint a crashed process was evaluating (from its crash marker) as a
    /// failure with reason [`FailureReason::Crashed`], unless the history has it already or the
    /// crash is blamed on a compiled package on trial (then the checkpoint is evaluated again).
    pub fn record_crash(&mut self, crash: Crash, recorded: &mut impl FnMut(Outcome, &str)) {
        if let Some(package) = crash.package_blamed() {
            tracing::warn!(
                "the last run died ({}) while the compiled package {} ran on trial: the package \
                 is blamed, not the checkpoint it was evaluating, which is evaluated again",
                crash.cause,
                crate::store::safe_fs::untrusted_text(package)
            );
            return;
        }
        let Some(InFlight { key, step, .. }) = crash.checkpoint else {
            tracing::warn!(
                "the last run died ({}) outside any evaluation; no checkpoint is blamed",
                crash.cause
            );
            return;
        };
        if self.history.contains(&key) {
            return;
        }
        tracing::error!(
            checkpoint = %crate::store::safe_fs::untrusted_text(&key.path),
            step,
            "the last run died ({}) while evaluating this checkpoint; it is recorded as a failure (reason {}) and not evaluated again",
            crash.cause,
            FailureReason::Crashed
        );
        let message = format!("the process died ({}) while evaluating it", crash.cause);
        let item = WorkItem::new(key.path.clone().into(), step, key);
        self.record(
            Outcome::Failed(item, FailureReason::Crashed, message),
            recorded,
        );
    }

    /// Records the outcomes of `outcomes` until that channel is closed (every sender gone), then
    /// tries once more to write what waits; hands each outcome to `recorded` once it is in the
    /// history. While outcomes wait or `history.h5` is behind, it tries again every
    /// [`RECORD_RETRY`].
    pub fn run(mut self, outcomes: Receiver<Outcome>, mut recorded: impl FnMut(Outcome, &str)) {
        loop {
            let next = if self.behind() {
                outcomes.recv_timeout(RECORD_RETRY)
            } else {
                outcomes.recv().map_err(|_| RecvTimeoutError::Disconnected)
            };
            match next {
                Ok(outcome) => self.record(outcome, &mut recorded),
                Err(RecvTimeoutError::Timeout) => self.flush(&mut recorded),
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        if self.behind() {
            self.flush(&mut recorded);
        }
        if !self.unrecorded.is_empty() {
            tracing::error!(
                waiting = self.unrecorded.len(),
                "outcomes could not be recorded (the state folder cannot be written); their checkpoints will be evaluated again after a restart"
            );
        }
    }

    /// Records the waiting outcomes in order, handing each on once it is in the history. Stops
    /// at the first that cannot be written (a full disk): it and the later ones stay in memory,
    /// and nothing acts on them until they are recorded, by the next call.
    fn flush(&mut self, recorded: &mut impl FnMut(Outcome, &str)) {
        if let Some(state) = &self.state
            && !self.unrecorded.is_empty()
        {
            state.follow(true);
        }
        while let Some((outcome, at)) = self.unrecorded.front() {
            let (item, entry) = match outcome {
                Outcome::Done(item, record) => (
                    item,
                    Entry::Evaluation {
                        key: item.key.clone(),
                        at: at.clone(),
                        record: record.clone(),
                    },
                ),
                Outcome::Failed(item, reason, message) => (
                    item,
                    Entry::Failure {
                        key: item.key.clone(),
                        at: at.clone(),
                        step: item.step,
                        reason: reason.as_str().to_string(),
                        message: message.clone(),
                    },
                ),
            };
            if let Err(e) = self.history.append(entry) {
                if self.stalled {
                    tracing::debug!(
                        waiting = self.unrecorded.len(),
                        "the state folder still cannot be written"
                    );
                } else {
                    tracing::error!(checkpoint = %untrusted(&item.path), "cannot record the outcome ({e}); it waits in memory, with any later ones, and is recorded and published as soon as the state folder can be written (a restart before then evaluates them again)");
                    self.stalled = true;
                }
                return;
            }
            if self.stalled {
                tracing::info!(
                    waiting = self.unrecorded.len(),
                    "the state folder can be written again; recording the waiting outcomes"
                );
                self.stalled = false;
            }
            let (outcome, at) = self.unrecorded.pop_front().expect("the front was there");
            if let Outcome::Done(_, record) = &outcome {
                self.keep_parameterization(record);
            }
            recorded(outcome, &at);
        }
        self.write_hdf5();
    }

    /// Keeps the parameterization check's warning in the state folder while it stands
    /// ([`crate::store::parameterization`]).
    fn keep_parameterization(&self, record: &crate::record::Evaluation) {
        use crate::record::ParameterizationCheck;
        use crate::store::parameterization::{Warning, clear, record as keep};
        let dir = self.history.dir();
        let kept = match &record.parameterization {
            ParameterizationCheck::NotRun => return,
            ParameterizationCheck::Warned(warning) => keep(
                dir,
                &Warning {
                    step: record.step,
                    checkpoint: record.checkpoint.clone(),
                    warning: warning.clone(),
                },
            ),
            ParameterizationCheck::Passed => clear(dir),
        };
        if let Err(e) = kept {
            tracing::warn!(
                "cannot keep the parameterization check in the state folder ({e}); check-config will not show it"
            );
        }
    }

    /// Brings `history.h5` up to date, logging the first failure of a series at WARN.
    pub fn write_hdf5(&mut self) {
        match self.history.write_hdf5() {
            Ok(()) if self.hdf5_failing => {
                tracing::info!("the HDF5 history is up to date again");
                self.hdf5_failing = false;
            }
            Ok(()) => {}
            Err(e) if self.hdf5_failing => {
                tracing::debug!("still cannot rewrite the HDF5 history: {e}")
            }
            Err(e) => {
                tracing::warn!(
                    "cannot rewrite the HDF5 history ({e}); the journal has every outcome, and the file is tried again every {RECORD_RETRY:?}"
                );
                self.hdf5_failing = true;
            }
        }
    }

    /// Are outcomes waiting to be recorded, or is `history.h5` behind the journal?
    fn behind(&self) -> bool {
        !self.unrecorded.is_empty() || self.history.hdf5_stale()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::tests::item;
    use crate::record::Evaluation;
    use crate::store::history::HDF5;

    fn done(step: i64) -> Outcome {
        Outcome::Done(
            item(step),
            Box::new(Evaluation {
                step,
                checkpoint: format!("ckpt_{step}.pt"),
                icr: Some(0.5 + step as f64),
                ..Evaluation::default()
            }),
        )
    }

    fn failed(step: i64) -> Outcome {
        Outcome::Failed(item(step), FailureReason::NonFinite, "ICR is NaN".into())
    }

    /// The steps of the journal on disk, as a reader beside the daemon sees it.
    fn journal_steps(state_dir: &Path) -> Vec<i64> {
        History::read(state_dir)
            .unwrap()
            .iter()
            .map(|e| match e {
                Entry::Evaluation { record, .. } => record.step,
                Entry::Failure { step, .. } | Entry::Resume { step, .. } => *step,
            })
            .collect()
    }

    fn step_of(o: &Outcome) -> i64 {
        match o {
            Outcome::Done(item, _) | Outcome::Failed(item, ..) => item.step,
        }
    }

    /// Each outcome is in the journal on disk when it is handed on, in the order it came, with
    /// its record or its failure; `history.h5` follows.
    #[test]
    fn outcomes_are_journalled_before_they_are_handed_on() {
        let dir = tempfile::tempdir().unwrap();
        let state_dir = dir.path().join("state");
        let mut recorder = Recorder::open(&state_dir).unwrap();
        let mut handed = Vec::new();
        let mut next = |o: Outcome, at: &str| {
            assert!(
                journal_steps(&state_dir).contains(&step_of(&o)),
                "step {} handed on before it was journalled",
                step_of(&o)
            );
            assert!(at.ends_with('Z'), "{at}");
            handed.push(o);
        };
        for o in [done(1), failed(2), done(3)] {
            recorder.record(o, &mut next);
        }
        assert_eq!(handed, vec![done(1), failed(2), done(3)]);
        let entries = History::read(&state_dir).unwrap();
        match &entries[1] {
            Entry::Failure {
                reason, message, ..
            } => assert_eq!(
                (reason.as_str(), message.as_str()),
                ("non_finite", "ICR is NaN")
            ),
            other => panic!("not a failure: {other:?}"),
        }
        match (&entries[2], &handed[2]) {
            (Entry::Evaluation { record, .. }, Outcome::Done(_, r)) => assert_eq!(record, r),
            other => panic!("not an evaluation: {other:?}"),
        }
        assert!(state_dir.join(HDF5).is_file());
        assert!(!recorder.behind());
    }

    /// With the state folder's parent gone (`run.dir` removed), nothing is recorded and so
    /// nothing is handed on; the outcomes wait in order, and once the folder can be written
    /// again they are recorded and handed on in that order.
    #[test]
    fn outcomes_wait_in_order_while_the_state_folder_cannot_be_written() {
        let dir = tempfile::tempdir().unwrap();
        let run_dir = dir.path().join("run");
        let state_dir = run_dir.join(".diffmon");
        let mut recorder = Recorder::open(&state_dir).unwrap();
        let mut handed = Vec::new();
        recorder.record(done(1), &mut |o, _| handed.push(o));
        std::fs::remove_dir_all(&run_dir).unwrap();
        recorder.record(failed(2), &mut |o, _| handed.push(o));
        recorder.record(done(3), &mut |o, _| handed.push(o));
        assert_eq!(handed, vec![done(1)]);
        assert!(recorder.behind());
        recorder.flush(&mut |o, _| handed.push(o));
        assert_eq!(handed, vec![done(1)], "recorded while the folder is gone");
        std::fs::create_dir(&run_dir).unwrap();
        recorder.flush(&mut |o, _| handed.push(o));
        assert_eq!(handed, vec![done(1), failed(2), done(3)]);
        assert_eq!(journal_steps(&state_dir), vec![1, 2, 3]);
        assert!(!recorder.behind());
    }

    /// `run` records everything sent until the channel closes, then returns.
    #[test]
    fn run_records_until_the_outcome_channel_closes() {
        let dir = tempfile::tempdir().unwrap();
        let recorder = Recorder::open(dir.path()).unwrap();
        let (tx, rx) = crossbeam_channel::bounded(16);
        for step in 1..=4 {
            tx.send(done(step)).unwrap();
        }
        drop(tx);
        let mut handed = Vec::new();
        recorder.run(rx, |o, _| handed.push(step_of(&o)));
        assert_eq!(handed, vec![1, 2, 3, 4]);
        assert_eq!(journal_steps(dir.path()), vec![1, 2, 3, 4]);
    }

    /// The checkpoint a crash blames is recorded as `crashed`, once; not where a compiled
    /// package on trial is blamed.
    #[test]
    fn a_crash_is_recorded_once_against_its_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut recorder = Recorder::open(dir.path()).unwrap();
        let crash = |package_on_trial: Option<&str>| Crash {
            cause: "SIGSEGV".into(),
            signal: true,
            checkpoint: Some(InFlight {
                key: item(7).key,
                step: 7,
                package_on_trial: package_on_trial.map(String::from),
            }),
        };
        let mut handed = Vec::new();
        // A compiled package on trial ran the evaluation: blamed instead of the checkpoint.
        recorder.record_crash(crash(Some("/m/net.pt2")), &mut |o, _| handed.push(o));
        assert!(handed.is_empty(), "{handed:?}");
        recorder.record_crash(crash(None), &mut |o, _| handed.push(o));
        recorder.record_crash(crash(None), &mut |o, _| handed.push(o));
        let unblamed = Crash {
            cause: "SIGKILL".into(),
            signal: false,
            checkpoint: None,
        };
        recorder.record_crash(unblamed, &mut |o, _| handed.push(o));
        let [Outcome::Failed(item, FailureReason::Crashed, message)] = handed.as_slice() else {
            panic!("one crashed failure, not {handed:?}")
        };
        assert_eq!(item.step, 7);
        assert!(message.contains("SIGSEGV"), "{message}");
        assert_eq!(journal_steps(dir.path()), vec![7]);
    }
}
